"""`ac-diff report PATH...`: re-render the diagnosis from traces (files or directories) or logs.

    ac-diff report ac-diff-out                 # terminal report; exit 0 clean, 1 diverged, 2 bad input
    ac-diff report ac-diff-out --json r.json   # also the versioned JSON report
"""

from __future__ import annotations

from ..api import read_runs
from ..diagnosis import diagnose
from ..fix.statuses import mark_from_runs
from .common import emit


def report_command(paths: list[str], fmt: str, json_path: str | None, output: str | None, settings) -> int:
    runs = read_runs(paths, lazy=True)
    report = diagnose(runs, settings)
    mark_from_runs(report, runs)  # every suggestion: untested, and the command that would verify it
    return emit(report, fmt, json_path, output)
