"""What `ac-diff run` adds around the script beyond recording: remedies, gradient capture, the reference.

    extras = RunExtras(RemedySpec(preserve_rng=True), reference="no-ac", reference_steps=1, output_dir="out")
    with extras:                      # remedies installed before the script, gradients captured
        outcome = run_target(...)
    extras.after("train.py", args, module=False, exit_code=0)   # the reference process (each rank its own)
    extras.decorate(report, ranks=[0])             # report.remedies, report.reference (verdict), suggestion statuses

Nothing is installed when no remedy, no reference and no $AC_DIFF_CAPTURE_STEPS is asked for: a plain
`ac-diff run` is untouched. $AC_DIFF_CAPTURE_STEPS=N (set by `ac-diff fix` for its tries) captures N
backward passes' gradients without starting a reference.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from ..fix.statuses import mark, verify_nproc
from ..reference.explain import attach
from ..children import EXIT_TERMINATED
from ..env import process_rank as rank, process_world_size
from ..reference.run import peers_agree, reference_result, run_reference
from ..reference.paths import REFERENCE_DIR, grads_path
from ..reference.session import CaptureSession, load_side
from ..remedies import CheckpointPatch, RemedySpec, split_ops

CAPTURE_ENV = "AC_DIFF_CAPTURE_STEPS"
REFERENCE_MODES = ("no-ac",)


def remedy_options(reference: str | None, reference_steps: int, no_ac: list[str] | None, preserve_rng: bool,
                   non_reentrant: bool, deterministic: bool, must_save: list[str] | None,
                   must_save_module: list[str] | None, restore: list[str] | None = None) -> tuple[RemedySpec, str | None]:
    """The remedy spec and reference mode from `ac-diff run`'s options (bad values: InputError, exit 2)."""
    from ..api import InputError

    if reference is not None and reference not in REFERENCE_MODES:
        raise InputError(f"--reference {reference!r} is not a mode; use --reference no-ac")
    if reference_steps < 1:
        raise InputError(f"--reference-steps must be at least 1, got {reference_steps}")
    ops = split_ops(must_save)
    if must_save_module and not ops:
        raise InputError("--must-save-module needs --must-save OP (which ops to save in those modules)")
    return RemedySpec(no_ac=list(no_ac or []), preserve_rng=preserve_rng, non_reentrant=non_reentrant,
                      deterministic=deterministic,
                      must_save=ops, must_save_modules=list(must_save_module or []),
                      restore=list(restore or [])), reference


class RunExtras:
    def __init__(self, remedies: RemedySpec | None, reference: str | None, reference_steps: int,
                 output_dir: str, target: str | None = None, args: list[str] | None = None,
                 module: bool = False) -> None:
        self.target, self.args, self.module = target, list(args or []), module
        self.spec = (remedies or RemedySpec()).merged(RemedySpec.from_env())
        self.reference = reference
        self.steps = max(1, int(reference_steps or 1))
        self.output_dir = output_dir
        capture = self.steps if reference else int(os.environ.get(CAPTURE_ENV, "0") or 0)
        self.active = bool(self.spec or reference or capture)
        self.patch = CheckpointPatch(self.spec) if self.active else None
        self.session = CaptureSession(output_dir, capture, self.patch, watch=bool(reference or capture)) \
            if self.active else None
        self.exit_code: int | None = None
        self.command: str | None = None
        self.skipped: str | None = None
        self.started = 0.0

    def __enter__(self) -> "RunExtras":
        self.started = time.time()
        if self.active:
            self.patch.install()
            self.session.install()
        return self

    def __exit__(self, *exc_info) -> None:
        if self.active:
            self.session.finish()
            self.patch.uninstall()

    def after(self, target: str, args: list[str], module: bool, exit_code: int | None = 0) -> None:
        """`exit_code`: the script's; one that failed before finishing a backward still gets its reference, which
        tells whether it fails without AC too, unless it runs with other ranks (their references run as one group:
        reference.run.peers_agree)."""
        if not self.reference:
            return
        why = peers_agree(self._why_not(exit_code))
        if why:
            self.skipped = f"{why}: no reference was run"
            return
        self.exit_code, self.command = run_reference(target, args, module=module, output_dir=self.output_dir,
                                                     steps=self.steps, spec=self.spec, since=self.started - 1.0)

    def _why_not(self, exit_code: int | None) -> str | None:
        """Why this process runs no reference (None: it does)."""
        capture = self.session.capture if self.session is not None else None
        if capture is not None and not capture.snapshots and not exit_code:
            return "this run finished no backward pass, so there is nothing to compare"
        if not exit_code or process_world_size() <= 1:  # (alone: its reference tells whether it fails without AC)
            return None
        if exit_code == EXIT_TERMINATED:
            return f"rank {rank()} was stopped (exit {exit_code}: torchrun stops every rank once one fails)"
        return f"the script failed on rank {rank()} (exit {exit_code}), and the reference's ranks run together"

    def decorate(self, report: Any, ranks: list[int]) -> None:
        if self.target:  # every suggestion: untested, and the command that would verify it
            mark(report, self.target, self.args, self.module,
                 nproc=verify_nproc(len(ranks), int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)))
        if not self.active:
            return
        dirs = {r: Path(self.output_dir) for r in ranks}
        if self.spec:
            report.remedies = applied_remedies(dirs)
        if self.reference and self.skipped:
            report.notes.append(self.skipped)
        elif self.reference:
            attach(report, reference_result(report, dirs, ranks, self.steps, self.exit_code, self.command))


def applied_remedies(dirs: dict[int, Path]) -> list[dict[str, Any]]:
    """The remedies each rank applied (its sidecar, remedies-rank{R}.json, in its directory), with their rank."""
    return [dict(row, rank=r) for r, d in sorted(dirs.items()) for row in load_side(d, r).get("applied", [])]


def decorate_from_outputs(report: Any, dirs: dict[int, Path]) -> None:
    """What `ac-diff run` added to its report, from what it left beside the traces (`ac-diff report DIR`): the
    remedies applied where it was run with any, and the comparison with the reference where one ran (its
    gradients in DIR/reference). `dirs`: each rank's directory."""
    sides = {r: load_side(d, r) for r, d in dirs.items()}
    if any(any(side.get("spec", {}).values()) for side in sides.values()):
        report.remedies = applied_remedies(dirs)
    ranks = sorted(r for r, d in dirs.items() if grads_path(Path(d) / REFERENCE_DIR, r).exists())
    if ranks:
        steps = max([side.get("capture_steps") or 1 for side in sides.values()])
        attach(report, reference_result(report, dirs, ranks, steps, None, None))
