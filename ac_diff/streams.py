"""Files that may be gzip-compressed, what a damaged compressed stream raises, and OSErrors in one line.

    with open_binary("trace-rank0.jsonl.gz") as f:   # plain or gzip, by the magic bytes
        try:
            line = f.readline()
        except STREAM_DAMAGE:                         # cut short (EOFError), flipped bits (zlib.error,
            ...                                       # BadGzipFile): damage, not a failure of the file

`readable_file(path)` gives a path that can be opened more than once: standard input ("-"), a pipe or a
FIFO is copied into a temporary file first; `source_name(copy)` is what to call it ("<stdin>", "/dev/fd/63"):

    copy = readable_file("-")        # /tmp/ac-diff-input-k2x/stdin
    source_name(copy)                # "<stdin>"

An OSError of the file itself (EACCES, EIO) is not in STREAM_DAMAGE: it propagates to the CLI,
which names the file and the fix with `describe_os_error(exc)`:
    "out/trace-rank0.jsonl: No space left on device; the disk is full: free space or pass a path on another disk (-o)"
"""

from __future__ import annotations

import atexit
import errno
import gzip
import io
import os
import shutil
import stat
import sys
import tempfile
import zlib
from pathlib import Path

STREAM_DAMAGE = (EOFError, zlib.error, gzip.BadGzipFile)


def open_binary(path: str | os.PathLike) -> io.BufferedIOBase:
    """Open a file for reading its bytes whether it is gzip-compressed or not."""
    raw = open(path, "rb")
    if raw.peek(2)[:2] != b"\x1f\x8b":
        return raw
    raw.close()
    return gzip.open(path, "rb")  # owns its file: closing it closes the file


def readable_file(path: str | os.PathLike) -> Path:
    """A path to read as many times as needed: "-" (standard input), a pipe, a FIFO or a device (`<(cmd)`,
    /dev/stdin) is copied once into a temporary file (removed at exit), since what is read from it is gone, and a
    second open of a FIFO would wait for another writer; any other path as it is."""
    p = Path(path)
    if str(path) != "-":
        try:
            mode = p.stat().st_mode
        except OSError:
            return p
        if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
            return p
    folder = tempfile.mkdtemp(prefix="ac-diff-input-")
    atexit.register(shutil.rmtree, folder, True)
    copy = Path(folder) / ("stdin" if str(path) == "-" else p.name or "input")
    with (open(sys.stdin.fileno(), "rb", closefd=False) if str(path) == "-" else open(p, "rb")) as src, \
            open(copy, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    _COPIED[str(copy)] = STDIN if str(path) == "-" else str(path)
    return copy


STDIN = "<stdin>"
_COPIED: dict[str, str] = {}  # a copy readable_file made -> the name of what it copied


def source_name(path: str | os.PathLike) -> str:
    """What to call a file in messages and reports: `<stdin>` (or the pipe's own path) for a copy readable_file
    made, else the path itself."""
    return _COPIED.get(str(path), str(path))


def stream_damage(path: str | os.PathLike) -> str | None:
    """Why a compressed file cannot be read to its end ("EOFError: ..."), or None if it can (or is plain)."""
    with open_binary(path) as f:
        try:
            while f.read(1 << 20):
                pass
        except STREAM_DAMAGE as exc:
            return f"{type(exc).__name__}: {exc}"
    return None


# what to do about an OSError, by its errno name (the message names the file and the problem)
_OS_ADVICE = {
    "ENOENT": "check the path", "ENOTDIR": "check the path", "EISDIR": "pass a file, not a directory",
    "EACCES": "check the file's permissions", "EPERM": "check the file's permissions",
    "EROFS": "the file system is read-only: pass a path on a writable one (-o)",
    "ENOSPC": "the disk is full: free space or pass a path on another disk (-o)",
    "EDQUOT": "the disk quota is used up: free space or pass a path on another disk (-o)",
    "EFBIG": "the file outgrew the size limit (ulimit -f, or the file system's): raise it or record less "
             "(--max-regions N, --write diverged)",
    "EIO": "the device reported a read/write error: copy the file to a healthy disk",
    "EMFILE": "too many open files: raise the limit (ulimit -n)",
}


def describe_os_error(exc: OSError) -> str:
    """One line for an OSError: the file, the problem, what to do. A damaged gzip file is named as such."""
    where = f"{exc.filename}: " if exc.filename else ""
    if isinstance(exc, gzip.BadGzipFile) or exc.errno is None:
        return f"{where}{exc}: the file is damaged or not what it claims to be; copy it again or re-record it"
    name = errno.errorcode.get(exc.errno, "")
    advice = _OS_ADVICE.get(name, "check the path and permissions")
    return f"{where}{exc.strerror or exc}; {advice}"
