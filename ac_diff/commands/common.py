"""What every subcommand shares: exit codes, the one-line error, and emitting a finished report.

    emit(report, fmt="terminal", json_path="report.json")   # prints / writes; returns the exit code
"""

from __future__ import annotations

import sys

from rich.console import Console

from ..render import render
from ..report import Report

EXIT_CLEAN = 0
EXIT_DIVERGED = 1
EXIT_BAD_INPUT = 2
EXIT_INTERNAL = 3


class UsageError(Exception):
    """Bad input from the user; the message names the problem and the fix."""


def fail(message: str, code: int = EXIT_BAD_INPUT) -> int:
    print(f"ac-diff: error: {message}", file=sys.stderr)
    return code


def console() -> Console:
    return Console(soft_wrap=False)


def emit(report: Report, fmt: str = "terminal", json_path: str | None = None, output: str | None = None) -> int:
    """Render the report as asked; return 0 for clean, 1 for divergence."""
    if json_path:
        render(report, "json", path=json_path)
    if fmt == "terminal" and output is None:
        render(report, "terminal", console=console())
    else:
        render(report, fmt, path=output)
    if json_path and json_path != "-":
        print(f"ac-diff: JSON report written to {json_path}", file=sys.stderr)
    if output:
        print(f"ac-diff: {fmt} report written to {output}", file=sys.stderr)
    return EXIT_DIVERGED if report.diverged else EXIT_CLEAN
