"""What every subcommand shares: exit codes, the one-line error, and emitting a finished report.

    emit(report, fmt="terminal", json_path="report.json")   # prints / writes; returns the exit code
    command_line("ac-diff", "report", "out ü dir")           # -> "ac-diff report 'out ü dir'" (to paste into a shell)
"""

from __future__ import annotations

import contextlib
import os
import shlex
import sys
from pathlib import Path

from rich.console import Console

from ..render import RENDERERS, render
from ..report import CLEAN, DAMAGED, DIVERGED, UNCHECKED, Report
from ..streams import describe_os_error

from ..errors import EXIT_BAD_INPUT, EXIT_CLEAN, EXIT_DIVERGED, EXIT_INTERNAL, EXIT_UNCHECKED  # noqa: F401 (the commands import them from here)


def verdict_code(report: Report) -> int:
    """0 clean, 1 diverged, 4 unchecked, 2 damaged (the trace is partly unreadable): a run where nothing
    was compared never passes as clean, nor does one whose script failed or was stopped after its regions (what ran
    was clean, but not the training the script meant to run: 4)."""
    if report.verdict == CLEAN and report.script_failed:
        return EXIT_UNCHECKED
    return {DIVERGED: EXIT_DIVERGED, UNCHECKED: EXIT_UNCHECKED, DAMAGED: EXIT_BAD_INPUT}.get(report.verdict,
                                                                                           EXIT_CLEAN)


def fail(message: str, code: int = EXIT_BAD_INPUT) -> int:
    print(f"ac-diff: error: {message}", file=sys.stderr)
    return code


def command_line(*words: str | Path) -> str:
    """A command to show the user, quoted for a POSIX shell: every path pastes back as one word."""
    return shlex.join(str(w) for w in words)


def print_next(output_dir: str | Path, json_path: str | None, more: str = "") -> None:
    """After a run: the command that shows its report again (on stderr)."""
    print("ac-diff: next: " + command_line("ac-diff", "report", output_dir)
          + ("" if json_path else " --json report.json") + more, file=sys.stderr)


def console(stderr: bool = False) -> Console:
    """stdout's console (stderr's where stdout carries a report for a program: `--json -`); piped into a file or a
    CI log, 120 columns (rich's fallback, 80, cuts the tables) unless COLUMNS says otherwise, as a report written to
    a file is."""
    piped = not (sys.stderr if stderr else sys.stdout).isatty() and not os.environ.get("COLUMNS")
    return Console(soft_wrap=False, width=120 if piped else None, stderr=stderr)


def format_of(path: str) -> str:
    """The format a file's suffix names (report.html, report.json), else terminal (plain text)."""
    suffix = os.path.splitext(path)[1].lower()
    suffix = {".htm": ".html"}.get(suffix, suffix)
    return next((name for name, r in RENDERERS.items() if r.suffix == suffix), "terminal")


def emit(report: Report, fmt: str = "terminal", json_path: str | None = None, output: str | None = None) -> int:
    """Render the report as asked; return its verdict's exit code (`verdict_code`).

    A file given with `output` gets `fmt` (or the format its suffix names); the terminal report is
    printed as well, unless the report itself goes to stdout (`--format json` without a file); where another
    report goes to stdout (`--json -`, `--report -`), the terminal report goes to stderr."""
    if output and fmt == "terminal":
        fmt = format_of(output)
    if output or fmt == "terminal":  # (first: a file that cannot be written loses nothing the terminal shows)
        render(report, "terminal", console=console(stderr="-" in (json_path, output)))
    else:
        render(report, fmt, path=None)
    unwritten = [f for f in (_written(report, "json", json_path, "--json"), _written(report, fmt, output, "--report"))
                 if f]
    if json_path and json_path != "-" and not any(f.startswith("--json") for f in unwritten):
        print(f"ac-diff: JSON report written to {json_path}", file=sys.stderr)
    if output and not any(f.startswith("--report") for f in unwritten):
        print(f"ac-diff: {fmt} report written to {output}", file=sys.stderr)
    if unwritten:
        return fail("; ".join(unwritten))
    if report.verdict == DAMAGED:  # neither clean nor diverged: the input is (partly) unreadable
        fail(report.headline)
    return verdict_code(report)


def _written(report: Report, fmt: str, path: str | None, option: str) -> str | None:
    """Write the report to `path` in `fmt`; None once written (or with no path), else what went wrong, one line
    naming the option and the file (a partial file is removed)."""
    if not path:
        return None
    try:
        render(report, fmt, path=path)
        return None
    except OSError as exc:
        with contextlib.suppress(OSError):
            if path != "-" and os.path.isfile(path):
                os.remove(path)
        return f"{option} {path}: {describe_os_error(exc).replace('(-o)', f'({option})')}"
