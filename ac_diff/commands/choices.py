"""Every fixed set of values a command-line option (or settings key) takes, declared once: the checks, the
help texts and shell completion all read these.

    REPORT_FORMATS  -> ("terminal", "json", "html")     # --format of run, fix, report, compare, demo
    complete(REPORT_FORMATS)("h")  -> ["html"]          # typer's autocompletion callback
"""

from __future__ import annotations

from typing import Callable

REPORT_FORMATS = ("terminal", "json", "html")
AUDIT_FORMATS = ("terminal", "json")
SCOPES = ("regions", "all")  # --scope / scope: what the recorder observes
WRITES = ("all", "diverged")  # --write / write: which regions' ops the trace gets
EXPORT_TABLES = ("ops", "positions", "regions")  # export --what
EXPORT_FORMATS = ("csv", "parquet", "jsonl")  # export --format


def complete(choices: tuple[str, ...]) -> Callable[[str], list[str]]:
    """Shell completion of an option: the choices that start with what was typed."""
    return lambda incomplete: [c for c in choices if c.startswith(incomplete)]
