"""Every suggestion carries a status and the one command that would verify it.

    mark(report, "train.py", ["--steps", "2"], module=False)            # untested, verify: ac-diff fix train.py ...
    mark(report, ..., tries=[(candidate, try_)])                        # verified / did not help, by the fix runs
    mark_from_runs(report, runs)   # `ac-diff report`: the script named in the traces' header

A suggestion is matched to a remedy of `ac-diff fix` by what it asks for: preserve_rng_state, use_reentrant,
deterministic algorithms, saving an op, the state a restore puts back, leaving the region out of AC.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

from ..capture.compiled import eager_requested
from ..remedies.restore import fqn_matches
from .forms import code_for
from .result import UNTESTED, VERIFIED


def _launch(nproc: int) -> list[str]:
    return ["--nproc-per-node", str(nproc)] if nproc >= 1 else []


def verify_nproc(ranks: int, per_node: int | None) -> int:
    """The processes `ac-diff fix` starts under torchrun to verify a run of `ranks` ranks, `per_node` of them on each
    node (LOCAL_WORLD_SIZE, set under torchrun): one node's, since `fix` runs on the node it is started on; 0 for a
    run of one process without torchrun (a script run under torchrun needs it, one process per node too)."""
    return min(ranks, per_node) if per_node else ranks if ranks > 1 else 0


def fix_command(target: str, args: list[str], module: bool, nproc: int = 0) -> str:
    return shlex.join(["ac-diff", "fix", *_launch(nproc), *(["-m"] if module else []), target, *args])


def run_command(spec_args: list[str], target: str, args: list[str], module: bool, nproc: int = 0) -> str:
    eager = ["--compiled", "eager"] if eager_requested() else []  # (compiled code run eagerly: so is the check)
    return shlex.join(["ac-diff", "run", *_launch(nproc), *eager, "--reference", "no-ac", *spec_args,
                       *(["-m"] if module else []), target, *args])


def _answers(title: str, candidate: Any, region_module: str | None) -> bool:
    t = title.lower()
    if candidate.kind == "preserve_rng":
        return "preserve_rng_state" in t
    if candidate.kind == "deterministic":
        return "deterministic" in t
    if candidate.kind == "must_save":
        return bool(candidate.op) and t.startswith(f"save {candidate.op}".lower())
    if candidate.kind == "non_reentrant":
        return "use_reentrant" in t
    if candidate.kind == "restore" and candidate.state == "generator":
        return "torch.generator" in t
    if candidate.kind == "restore":  # "Update `layers.1.moe.expert_bias` after ...": the named state matches
        return any(fqn_matches(name, candidate.spec.restore) for name in re.findall(r"`([^`]+)`", title))
    if candidate.kind == "no_ac":
        return "out of activation checkpointing" in t and region_module in candidate.spec.no_ac
    return False


def mark(report: Any, target: str, args: list[str], module: bool, tries: list[tuple[Any, Any]] | None = None,
         nproc: int = 0) -> None:
    default = fix_command(target, args, module, nproc)
    for region in report.regions:
        for s in region.suggestions:
            s.status, s.verify = UNTESTED, default
            for candidate, t in tries or []:
                if t.status != UNTESTED and _answers(s.title, candidate, region.module):
                    s.status, s.verify = t.status, t.command
                    if t.status == VERIFIED and candidate.kind == "must_save":
                        s.code = code_for(candidate)  # what was verified (the suggestion's saves the matmul too)
                        s.text += f" (ac-diff verified saving {candidate.op} alone: the code below.)"
                    break


def mark_from_runs(report: Any, runs: list[Any]) -> None:
    """Statuses and verify commands for a report re-read from traces (`ac-diff report`, `compare`): the script
    their header names (a log names none: `ac-diff fix SCRIPT`)."""
    for run in runs:
        header = run.header if run.source == "trace" else {}
        if header.get("target"):
            folder = Path(run.path or ".").parent
            ranks = len({r.path for r in runs if r.source == "trace" and Path(r.path or ".").parent == folder})
            mark(report, header["target"], list(header.get("target_args") or []), bool(header.get("module")),
                 nproc=verify_nproc(ranks, header.get("local_world_size") if header.get("launcher") else None))
            return
    mark(report, "SCRIPT", [], False)
