"""A trace file's header and end record, read without loading the trace (while its rank may still be writing it).

    read_header(path)  -> {"type": "header", "run_id": "...", "rank": 1, ...} or None (not written yet, not a trace)
    read_end(path)     -> {"type": "end", "status": "ok", ...} or None (the rank has not finished it)
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def read_header(path: Path) -> dict | None:
    """The trace's header, or None while it cannot be read as one (not written yet, another format)."""
    from ..trace import read_header as read_trace_header

    try:
        return read_trace_header(path)
    except (OSError, ValueError):  # TraceFormatError is a ValueError
        return None


def read_end(path: Path) -> dict | None:
    """The end record, if the trace has one (read from the file's tail; gzip files are read through)."""
    try:
        if path.name.endswith(".gz"):
            from ..trace import open_text

            last = None
            with open_text(path) as f:
                for line in f:
                    last = line
            tail = [last] if last else []
        else:
            with open(path, "rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - 8192))
                tail = f.read().decode("utf-8", "replace").splitlines()[-2:]
        for line in reversed(tail):
            if '"type":"end"' in line or '"type": "end"' in line:
                return json.loads(line)
    except (OSError, ValueError, EOFError):
        return None
