"""Every fixed set of values a command-line option (or settings key) takes, declared once: the checks, the
help texts and shell completion all read these.

    REPORT_FORMATS  -> ("terminal", "json", "html")     # --format of run, fix, report, compare, demo, audit
    complete(REPORT_FORMATS)("h")  -> ["html"]          # typer's autocompletion callback
"""

from __future__ import annotations

from typing import Callable

REPORT_FORMATS = ("terminal", "json", "html")  # --format of every command that reports (export: EXPORT_FORMATS)
SCOPES = ("regions", "all")  # --scope / scope: what the recorder observes
WRITES = ("all", "diverged")  # --write / write: which regions' ops the trace gets
COMPILED = ("keep", "eager")  # --compiled: torch.compile'd code runs compiled (keep) or eagerly, its regions recorded
EXPORT_TABLES = ("ops", "positions", "regions")  # export --what
EXPORT_FORMATS = ("csv", "parquet", "jsonl")  # export --format


def complete(choices: tuple[str, ...]) -> Callable[[str], list[str]]:
    """Shell completion of an option: the choices that start with what was typed."""
    return lambda incomplete: [c for c in choices if c.startswith(incomplete)]
