"""Where a run's comparison with its reference keeps its files, per rank.

    grads_path("out", 1)          -> out/grads-rank1.pt        (each backward's gradients, reference/grads.py)
    side_path("out", 1)           -> out/remedies-rank1.json   (what the rank applied and watched)
    trace_path("out/reference", 1) -> out/reference/trace-rank1.jsonl (the reference's first forwards)
    rank_outputs("out", 1)        -> those of rank 1 that exist, the reference's too (what travels with its trace)
"""

from __future__ import annotations

import os
from pathlib import Path

from ..env import process_rank as rank

REFERENCE_DIR = "reference"


def grads_path(directory: str | os.PathLike, r: int | None = None) -> Path:
    return Path(directory) / f"grads-rank{rank() if r is None else r}.pt"


def side_path(directory: str | os.PathLike, r: int | None = None) -> Path:
    return Path(directory) / f"remedies-rank{rank() if r is None else r}.json"


def trace_path(directory: str | os.PathLike, r: int | None = None) -> Path:
    return Path(directory) / f"trace-rank{rank() if r is None else r}.jsonl"


def rank_outputs(directory: str | os.PathLike, r: int) -> list[Path]:
    """What a comparison of rank r with its reference reads beside the rank's trace, where the run wrote it: its
    gradients and remedies, and its reference's (with the reference's trace of its first forwards)."""
    ref = Path(directory) / REFERENCE_DIR
    paths = [grads_path(directory, r), side_path(directory, r), grads_path(ref, r), side_path(ref, r),
             trace_path(ref, r)]
    return [p for p in paths if p.is_file()]
