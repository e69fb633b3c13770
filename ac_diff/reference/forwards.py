"""The reference's first forward, recorded, to tell why the two runs differ from their first loss on.

    forwards = ReferenceForwards("out/reference", patch, until=lambda: capture.snapshots).start()  # the reference child
    ...  # the script: each checkpoint call, run without AC, is recorded as a region's forward until the first backward
    forwards.stop()   ->  out/reference/trace-rank0.jsonl    (ac-diff compare out/trace-rank0.jsonl with it by hand)

    first_difference(read_run("out/trace-rank0.jsonl"), read_run("out/reference/trace-rank0.jsonl"))
    -> RegionReport(kind="two_runs", module="layers.0", changed_inputs=[],
                    first_value_divergence=Divergence(op="aten.index_add.default", detail={"inputs_identical": True}),
                    cause=Cause(kind="nondeterministic_op", ...))        (None where the recorded forwards agree)
    compare_first_forwards("out", "out/reference", rank=0)  ->  the same, from the two directories' traces

explain.py reads it: an op that gave other values from identical inputs is a nondeterministic kernel.

The recorded run's regions and the reference's are compared as two runs are (diagnosis/two_runs.py): forward
against forward, op by op, over the regions the reference recorded.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

import torch

from ..capture.recorder import RecordOptions, Recorder
from ..capture.torch_compat import FORWARD, ReentrantFrame
from ..diagnosis.two_runs import compare_runs
from ..passes import Run
from ..report import DIVERGED, RegionReport
from ..trace import read_run
from .paths import trace_path


class _Bypassed:
    """Stands in for the checkpoint frame of a call run without AC: what the recorder reads of a frame."""

    def __init__(self, fn: Any, inputs: tuple) -> None:
        self._ac_diff_fn = fn
        self._ac_diff_inputs = inputs


class ReferenceForwards:
    """Records each call the patch runs without AC as a region's forward (the recorded run's regions, in the same
    order), until `until()` says the first backward has run."""

    def __init__(self, directory: str | os.PathLike, patch: Any, until: Callable[[], Any]) -> None:
        self.path = trace_path(directory)
        self.until = until
        self.recorder: Recorder | None = None
        self._depth = 0
        patch.add_bypass_watcher(self._around)

    def start(self) -> "ReferenceForwards":
        self.recorder = Recorder(self.path, RecordOptions(write="all"), {"reference": "no-ac"}).start()
        return self

    def stop(self) -> None:
        recorder, self.recorder = self.recorder, None
        if recorder is not None:
            recorder.stop()

    def _around(self, call: Any, run: Callable[[], Any]) -> Any:
        if self.recorder is not None and not self._depth and self.until():
            self.stop()  # the first backward has run: its forward is recorded
        recorder = self.recorder
        if recorder is None or not (call.reentrant or torch.is_grad_enabled()):
            return run()  # (non-reentrant checkpoint makes no region under no_grad)
        if call.reentrant:
            frame = ReentrantFrame(call.kwargs.get("preserve_rng_state", True), call.function)
            frame._ac_diff_inputs = call.args
        else:
            frame = _Bypassed(call.function, call.args)
        recorder.enter(frame, FORWARD)
        self._depth += 1
        exc = None
        try:
            return run()
        except BaseException as e:
            exc = e
            raise
        finally:
            self._depth -= 1
            recorder.exit(frame, FORWARD, exc)


def first_difference(run: Run, reference: Run) -> RegionReport | None:
    """The first region whose forward differs between the recorded run and the reference, over the regions the
    reference recorded (its first forward); None where they agree."""
    recorded = sum(1 for r in reference.regions if r.recorded)
    report = compare_runs(dataclasses.replace(run, regions=run.regions[:recorded]),
                          dataclasses.replace(reference, regions=reference.regions[:recorded]))
    return next((r for r in report.regions if r.status == DIVERGED), None)


def compare_first_forwards(output_dir: str | os.PathLike, reference_dir: str | os.PathLike,
                           r: int) -> RegionReport | None:
    """first_difference of rank `r`'s traces in the run's and the reference's directories (None without both)."""
    paths = trace_path(output_dir, r), trace_path(reference_dir, r)
    if not all(p.exists() for p in paths):
        return None
    try:
        return first_difference(read_run(paths[0], lazy=True), read_run(paths[1], lazy=True))
    except Exception:  # noqa: BLE001 - a trace cut short or unreadable: the explanation goes without it
        return None
