"""What a process does for gradient capture and the reentrant watch, and where it writes (one place).

    session = CaptureSession(output_dir, steps=1, patch=patch)   # in `ac-diff run --reference` and its children
    session.install(); ...script...; session.finish()
    -> OUT/grads-rank{R}.pt (this run's gradients), OUT/remedies-rank{R}.json (the remedies asked for and applied,
       reentrant findings, the backward passes captured)

The reference child writes OUT/reference/grads-rank{R}.pt, and with `forwards=True` the forward of its regions up to
its first backward, OUT/reference/trace-rank{R}.jsonl (forwards.py). `load_side(OUT, rank)` reads a sidecar back.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from .grads import GradCapture
from .paths import grads_path, side_path
from .leaks import ReentrantWatch

DIR_ENV = "AC_DIFF_GRADS_DIR"  # set for a child: capture gradients into this directory
STEPS_ENV = "AC_DIFF_GRADS_STEPS"
COMPILED_ENV = "AC_DIFF_REFERENCE_COMPILED"  # set for the reference of a run that used torch.compile (child.py)


class CaptureSession:
    def __init__(self, directory: str | os.PathLike, steps: int, patch: Any, *, watch: bool = True,
                 exit_after: bool = False, forwards: bool = False) -> None:
        self.directory = Path(directory)
        self.patch = patch
        self.watch = ReentrantWatch(patch.stack) if watch else None
        if self.watch is not None:
            patch.add_watcher(self.watch)
        self.exit_after = exit_after  # the reference child: nothing after the N-th backward is needed
        self.capture = GradCapture(grads_path(directory), steps, on_done=self._done) if steps > 0 else None
        self.forwards = None
        if forwards:
            from .forwards import ReferenceForwards  # (the recorder: only the reference child needs it)

            self.forwards = ReferenceForwards(directory, patch, until=lambda: self.capture is None
                                              or self.capture.snapshots)

    def install(self) -> "CaptureSession":
        if self.capture is not None:
            self.capture.install()
        if self.forwards is not None:
            self.forwards.start()
        return self

    def _done(self) -> None:
        if self.exit_after:
            self.finish()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)

    def finish(self) -> None:
        if self.forwards is not None:
            self.forwards.stop()
        if self.capture is not None:
            self.capture.finish()
        write_side(self.directory, self.patch, self.watch.findings() if self.watch else [],
                   self.capture.steps if self.capture is not None else 0)


def write_side(directory: str | os.PathLike, patch: Any, findings: list[dict[str, Any]], steps: int = 0) -> None:
    path = side_path(directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"spec": json.loads(patch.spec.to_env()), "applied": patch.summary(),
                                "reentrant": findings, "capture_steps": steps}))


def load_side(directory: str | os.PathLike, r: int) -> dict[str, Any]:
    return read_side(directory, r) or {}


def read_side(directory: str | os.PathLike, r: int) -> dict[str, Any] | None:
    """The sidecar of rank `r` in `directory`: {} where there is none, None where it cannot be read (cut, garbled)."""
    try:
        data = json.loads(side_path(directory, r).read_text())
    except OSError:
        return {}
    except ValueError:
        return None
    return data if isinstance(data, dict) else None
