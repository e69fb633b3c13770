"""`ac-diff compare LOG_OR_TRACE [OTHER ...]`: explain a log torch wrote (several: as one report), or compare two
runs/ranks.

    ac-diff compare rank1.log                 # CheckpointError text or debug=True dump, any prefixes
    ac-diff compare run_a/trace-rank0.jsonl run_b/trace-rank0.jsonl
"""

from __future__ import annotations

import sys

from ..api import read_runs
from ..diagnosis import Settings, diagnose
from ..fix.statuses import mark_from_runs
from .common import emit


def compare_command(paths: list[str], fmt: str, json_path: str | None, output: str | None,
                    settings: Settings) -> int:
    runs = read_runs(paths, progress=_progress(), lazy=True)
    if len(runs) == 2 and all(r.source == "trace" for r in runs):
        from ..diagnosis.two_runs import compare_runs

        report = compare_runs(runs[0], runs[1], settings)
    else:
        report = diagnose(runs, settings)
    mark_from_runs(report, runs)  # every suggestion: untested, and the command that would verify it
    return emit(report, fmt, json_path, output)


def _progress():
    """A progress bar on a TTY for big logs; nothing otherwise."""
    if not sys.stderr.isatty():
        return None
    from rich.progress import Progress

    state: dict = {}

    def update(done: int, total: int) -> None:
        if total < 4 << 20:
            return
        if "bar" not in state:
            state["bar"] = Progress(transient=True)
            state["bar"].start()
            state["task"] = state["bar"].add_task("parsing log", total=total)
        state["bar"].update(state["task"], completed=done)
        if done >= total:
            state["bar"].stop()

    return update
