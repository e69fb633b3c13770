"""Where a command writes: the paths the user gave, resolved when ac-diff starts, checked before the script runs,
and the output directory held by one run at a time.

    output_dir("out", "-o")           # -> "/home/me/proj/out" (created); a script's os.chdir() cannot move it
    output_file("r.json", "--json")   # -> "/home/me/proj/r.json", once a write there was shown to work
    with hold_directory("/home/me/proj/out"):   # a second run into out/ stops at once:
        ...                                     # ac-diff: error: /home/me/proj/out is in use by another ac-diff
                                                # run; wait for it to end, or pass -o DIR for another directory

Every problem is an `OutputError` (exit 2) naming the option that gave the path:
    --report /data: a directory, not a file; pass a file path to --report
    -o results.txt: a file, not a directory; -o takes a directory: pass another path
"""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path
from typing import Iterator

from ..errors import InputError


class OutputError(InputError):
    """An output path that cannot be written: the message names the option that gave it."""


def output_file(path: str | None, option: str) -> str | None:
    """The absolute path of a file the command will write (`-` and None as they are), after creating or opening it
    for appending once (nothing is truncated, and a file created for the check is removed again)."""
    if not path or path == "-":
        return path
    full = os.path.abspath(path)
    folder = os.path.dirname(full)
    if os.path.isdir(full):
        raise OutputError(f"{option} {path}: a directory, not a file; pass a file path to {option}")
    if not os.path.isdir(folder):
        file = next((p for p in (Path(folder), *Path(folder).parents) if p.exists() and not p.is_dir()), None)
        if file is not None:
            raise OutputError(f"{option} {path}: {file} is a file, not a folder; pick another path")
        raise OutputError(f"{option} {path}: the folder {folder} does not exist; create it or pick another path")
    existed = os.path.exists(full)
    try:
        with open(full, "ab"):
            pass
        if not existed:
            os.unlink(full)
    except OSError as exc:
        raise OutputError(f"{option} {path}: cannot be written ({exc.strerror or exc}); pass a writable path to "
                          f"{option}") from None
    return full


def output_dir(path: str, option: str = "-o") -> str:
    """The absolute path of the directory the command writes into, created if needed."""
    full = os.path.abspath(path)
    if os.path.exists(full) and not os.path.isdir(full):
        raise OutputError(f"{option} {path}: a file, not a directory; {option} takes a directory: pass another path")
    try:
        os.makedirs(full, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"{option} {path}: the directory cannot be created ({exc.strerror or exc}); pass a writable "
                          f"path to {option}") from None
    return full


@contextlib.contextmanager
def hold_directory(directory: str) -> Iterator[None]:
    """Hold `directory` for this run: while it is held, another `hold_directory` of it (another ac-diff process)
    raises OutputError instead of replacing the traces this run writes and reports. The hold is an flock of the
    directory itself (no lock file is left behind) and ends with the block or the process; on a platform or file
    system without flock the block runs unheld."""
    with _held(directory, os.O_RDONLY):
        yield


@contextlib.contextmanager
def hold_trace(path: str | os.PathLike) -> Iterator[None]:
    """Hold a rank's own trace file for its run under a plain torchrun, where rank 0 holds the directory and the
    other ranks would otherwise replace another run's traces (`--force`) while it writes them: the same flock, of
    the file (created empty where missing: the recorder writes it from its start)."""
    with _held(str(path), os.O_RDWR | os.O_CREAT):
        yield


@contextlib.contextmanager
def _held(path: str, flags: int) -> Iterator[None]:
    """`path` opened with `flags` and locked (`_lock`) for the block; closing it releases the hold."""
    fd = os.open(path, flags, 0o644)
    try:
        _lock(fd, path)
        yield
    finally:
        os.close(fd)


def _lock(fd: int, directory: str) -> None:
    try:
        import fcntl
    except ImportError:  # Windows
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise OutputError(f"{directory} is in use by another ac-diff run; wait for it to end, or pass -o DIR "
                              "for another directory") from None
        # this file system does not lock (some network mounts): run unheld
