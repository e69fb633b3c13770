"""The reference process: `python -m ac_diff.reference.child [-m] TARGET [ARGS...]`.

Started by `ac-diff run --reference no-ac` (reference/run.py) with the run's own arguments and environment,
plus $AC_DIFF_REMEDIES (AC off everywhere) and $AC_DIFF_GRADS_DIR / $AC_DIFF_GRADS_STEPS. It runs the
target like python would, captures every parameter's gradient for the first N backward passes into
DIR/grads-rank{RANK}.pt and exits right after the N-th (nothing later is compared). The recorder records only
the forward of the calls that would have been checkpointed, up to the first backward, into DIR/trace-rank{RANK}.jsonl
(forwards.py: which op makes a first loss differ from the recorded run's).
"""

from __future__ import annotations

import os
import sys

from ..capture.compiled import EagerStance, eager_requested, force_eager
from ..remedies import CheckpointPatch, RemedySpec
from ..capture.runner import run_target
from .session import COMPILED_ENV, DIR_ENV, STEPS_ENV, CaptureSession


class _NoRecorder:
    def start(self) -> None:
        pass

    def stop(self, exc: BaseException | None = None, exit_code: int | None = None) -> None:
        pass


def main(argv: list[str]) -> int:
    module = bool(argv) and argv[0] == "-m"
    if module:
        argv = argv[1:]
    if not argv or DIR_ENV not in os.environ:
        print("ac-diff: error: the reference child is started by `ac-diff run --reference no-ac SCRIPT`",
              file=sys.stderr)
        return 2
    compiled = bool(os.environ.get(COMPILED_ENV)) and not eager_requested()
    patch = CheckpointPatch(RemedySpec.from_env(), compiled=compiled)
    session = CaptureSession(os.environ[DIR_ENV], int(os.environ.get(STEPS_ENV, "1")), patch, watch=False,
                             exit_after=True, forwards=True)
    if eager_requested():  # --compiled eager: the reference runs compiled code eagerly too, for all its steps
        force_eager(EagerStance())
    patch.install()
    session.install()
    outcome = run_target(argv[0], argv[1:], module=module, recorder=_NoRecorder())
    session.finish()
    patch.uninstall()
    return outcome.exit_code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
