"""Files that may be gzip-compressed, and what a damaged compressed stream raises while it is read.

    with open_binary("trace-rank0.jsonl.gz") as f:   # plain or gzip, by the magic bytes
        try:
            line = f.readline()
        except STREAM_DAMAGE:                         # cut short (EOFError), flipped bits (zlib.error,
            ...                                       # BadGzipFile): damage, not a failure of the file

An OSError of the file itself (EACCES, EIO) is not in STREAM_DAMAGE: it propagates to the CLI,
which names the file and the fix.
"""

from __future__ import annotations

import gzip
import io
import os
import zlib

STREAM_DAMAGE = (EOFError, zlib.error, gzip.BadGzipFile)


def open_binary(path: str | os.PathLike) -> io.BufferedIOBase:
    """Open a file for reading its bytes whether it is gzip-compressed or not."""
    raw = open(path, "rb")
    magic = raw.peek(2)[:2] if hasattr(raw, "peek") else b""
    return gzip.GzipFile(fileobj=raw) if magic == b"\x1f\x8b" else raw


def stream_damage(path: str | os.PathLike) -> str | None:
    """Why a compressed file cannot be read to its end ("EOFError: ..."), or None if it can (or is plain)."""
    with open_binary(path) as f:
        try:
            while f.read(1 << 20):
                pass
        except STREAM_DAMAGE as exc:
            return f"{type(exc).__name__}: {exc}"
    return None
