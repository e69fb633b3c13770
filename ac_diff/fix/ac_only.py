"""Whether the script failed only because of AC: a checkpointing defect, even where no region was seen to diverge.

    fails_only_with_ac(base_m, out / "base", ref_m, out / "reference")   # -> True / False

True when the recorded run failed and the run without AC did not, within the backward passes the run without AC
completed (it stops after `--steps` of them: a failure of the run with AC after those proves nothing).
"""

from __future__ import annotations

from pathlib import Path

from ..reference.grads import load_grads
from ..reference.paths import grads_path
from .tries import Measured


def fails_only_with_ac(base: Measured, base_dir: Path, reference: Measured, reference_dir: Path) -> bool:
    return base.code != 0 and reference.code == 0 and backward_passes(base_dir) < backward_passes(reference_dir)


def backward_passes(directory: Path) -> int:
    """The backward passes rank 0 of a run finished (whose gradients it captured)."""
    grads = load_grads(grads_path(directory, 0))
    return len(grads.get("steps") or []) if grads else 0
