"""`ac-diff run [opts] SCRIPT [ARGS...]` / `ac-diff run [opts] -m MODULE [ARGS...]`.

Runs the target as python would with the recorder on, writes `OUT/trace-rank{RANK}.jsonl`, prints
the report (rank 0 only under torchrun) and the next command, and exits with the script's code
(with --check: 1 when the script succeeded but a region diverged).

    ac-diff run -o out train.py --lr 3e-4
    ac-diff: trace written to out/trace-rank0.jsonl  (next: ac-diff report out)
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

from ..diagnosis import Settings, diagnose
from ..capture.recorder import Recorder, RecordOptions
from ..remedies import RemedySpec
from .run_extras import RunExtras
from ..capture.runner import check_target, run_target
from ..children import share_stdin
from ..trace import read_run
from . import launch_cmd as launch
from .common import emit, fail, print_next, verdict_code
from .outputs import hold_trace


def trace_path_for(output_dir: str | os.PathLike) -> Path:
    rank = int(os.environ.get("RANK", "0") or 0)
    return Path(output_dir) / f"trace-rank{rank}.jsonl"


def run_command(target: str, args: list[str], *, module: bool, output_dir: str, force: bool, check: bool,
                fmt: str, json_path: str | None, output: str | None, options: RecordOptions,
                settings: Settings, quiet_report: bool = False, remedies: RemedySpec | None = None,
                reference: str | None = None, reference_steps: int = 1, example: bool = False) -> int:
    """Record the target, report, and return the exit code. Paths are used as given: the CLI has resolved them
    (commands/outputs.py), so a script that calls os.chdir() does not move them. `example`: see `run_target`."""
    trace_path = trace_path_for(output_dir)
    check_target(target, module)  # a missing script first: that is the problem to report
    held = contextlib.ExitStack()  # this rank's own trace, under a plain torchrun (outputs.hold_trace)
    multi = launch.is_multi_rank() or launch.launched()  # under torchrun: one trace per rank, one report
    if multi:
        launch.prepare_rank(output_dir, trace_path, force)
        if trace_path.exists() and not force:
            return fail(f"{trace_path} already exists; pass --force to overwrite it, or -o DIR for another directory")
        if launch.rank() != 0 and not launch.launched():  # (rank 0 holds the directory, the launcher holds it too)
            held.enter_context(hold_trace(trace_path))
    else:  # one process writes the directory's only trace: an earlier run's traces of other ranks would mix in
        refused = launch.clear_traces(output_dir, force)
        if refused:
            return fail(refused)
    with held:
        rank = int(os.environ.get("RANK", "0") or 0)
        recorder = Recorder(trace_path, options, header_extra={"target": target, "module": module,
                                                               "target_args": args, **launch.header_fields()})
        extras = RunExtras(remedies, reference, reference_steps, output_dir, target, args, module)
        if reference:
            share_stdin()  # (the reference runs the script again)
        with launch.sigterm_as_exit(), extras:  # SIGTERM (a scheduler, torchrun's agent) still finishes the trace
            outcome = run_target(target, args, module=module, recorder=recorder, example=example)
        extras.after(target, args, module, outcome.exit_code)
        if recorder.write_failure:  # the script's exit code still wins; the report covers what was written
            print(f"ac-diff: error: {recorder.write_failure}", file=sys.stderr)
        if multi:
            return outcome.end(launch.finish_rank(outcome.exit_code, trace_path, output_dir, check=check, fmt=fmt,
                                                  json_path=json_path, output=output, settings=settings,
                                                  decorate=extras.decorate))
        if rank != 0:
            return outcome.end(outcome.exit_code)
        if not recorder.write_failure:
            print(f"ac-diff: trace written to {trace_path}", file=sys.stderr)
        report = diagnose([read_run(trace_path, lazy=True)], settings)
        extras.decorate(report, [rank])
        if not quiet_report:
            emit(report, fmt, json_path, output)
        print_next(output_dir, json_path)
        if check and outcome.exit_code == 0 and report.verdict != "clean":
            return outcome.end(verdict_code(report))
        return outcome.end(outcome.exit_code)
