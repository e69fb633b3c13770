"""Physical lines in, logical segments out: reading, launcher prefixes, and splitting spliced lines.

    iter_lines(open("rank1.log", "rb"))        -> ("[rank1]: tensor at position 48:", True), ...
    strip_prefix("[default1]:[rank1]: Traceback (most recent call last):")
        -> (1, "Traceback (most recent call last):")
    strip_prefix("E           tensor at position 0:")   -> (None, "tensor at position 0:")
    split_segments("[rank11]: recomputed metadata: {'shape': torch.Size([964, 5120]),"
                   "[rank13]: Traceback (most recent call last):", None)
        -> [(11, "recomputed metadata: {'shape': torch.Size([964, 5120]),"),
            (13, "Traceback (most recent call last):")]

A segment is one logical line: its launcher prefixes removed, leading/trailing whitespace removed,
and a rank (or None when no prefix said which). A whole log flattened onto one line comes back as
the segments it was made of: it is cut before every rank prefix, "tensor at position",
"saved metadata:", "recomputed metadata:", "Number of tensors saved during", op-line start
(`$N: dtype[`, `['$N: `, `('$N: `), debug-dump section header, and traceback marker that does not
start the line. Lines longer than `max_line` bytes are returned in pieces.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import IO

MAX_LINE = 1 << 20  # a single line longer than this is handed on in pieces of this size
_PROGRESS_EVERY = 1 << 20


@dataclass(slots=True)
class ReadStats:
    """What reading noticed about the bytes themselves."""

    bytes_read: int = 0
    lines: int = 0
    long_lines: int = 0  # lines split into pieces of MAX_LINE
    undecodable_lines: int = 0  # lines with bytes that are not UTF-8 (replaced by U+FFFD)


def iter_lines(stream: IO, stats: ReadStats, *, total: int | None = None,
               progress: Callable[[int, int | None], None] | None = None,
               max_line: int = MAX_LINE) -> Iterator[tuple[str, bool]]:
    """Yield (text, ended_with_newline) for each line of a binary or text stream.

    Never raises on content: bytes that are not UTF-8 are replaced. Lines are split on \\n and on a
    lone \\r (progress bars); the trailing \\r of \\r\\n is dropped. A piece of an over-long line
    ends with ended_with_newline=False.
    """
    next_report = _PROGRESS_EVERY
    readline = stream.readline
    while True:
        try:
            raw = readline(max_line)
        except (OSError, ValueError, UnicodeDecodeError):
            break
        if not raw:
            break
        if isinstance(raw, bytes):
            stats.bytes_read += len(raw)
            text = raw.decode("utf-8", "replace")
            if "\ufffd" in text:
                stats.undecodable_lines += 1
        else:
            text = raw
            stats.bytes_read += len(raw)  # characters: the best a text stream can tell
        ended = text.endswith("\n")
        if ended:
            text = text[:-1]
        elif len(raw) >= max_line:
            stats.long_lines += 1
        stats.lines += 1
        if "\r" in text:
            parts = text.split("\r")
            if parts[-1] == "":
                parts.pop()  # \r\n
            for part in parts[:-1]:
                yield part, True
            text = parts[-1] if parts else ""
        yield text, ended
        if progress is not None and stats.bytes_read >= next_report:
            next_report = stats.bytes_read + _PROGRESS_EVERY
            _call_progress(progress, stats.bytes_read, total)
    if progress is not None:
        _call_progress(progress, stats.bytes_read, total)


def _call_progress(progress: Callable[[int, int | None], None], done: int, total: int | None) -> None:
    try:
        progress(done, total)
    except Exception:  # noqa: BLE001 - a broken progress bar must not break parsing
        pass


_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# One launcher prefix: `[rank1]:`, `[default1]:` (torchrun --tee), or a bare `rank11: `.
_PREFIX = re.compile(r"[ \t]*(?:\[(rank|default)(\d+)\]:[ \t]?|(rank)(\d+):(?:[ \t]|\Z))")
_PYTEST_E = re.compile(r"E(?:[ \t]{2,}|[ \t]*\Z)")


def strip_prefix(text: str) -> tuple[int | None, str]:
    """Remove launcher prefixes, pytest's `E   ` and indentation; return (rank, body).

    `[rankN]` wins over `[defaultN]` (torchrun's local-rank tag) when both are present.
    """
    if "\x1b" in text:
        text = _ANSI.sub("", text)
    rank = None
    default = None
    pos = 0
    n = len(text)
    while pos < n:
        c = text[pos]
        if c == "[" or c == "r" or c == " " or c == "\t":
            m = _PREFIX.match(text, pos)
            if m:
                if m.group(1) == "default":
                    default = int(m.group(2))
                else:
                    rank = int(m.group(2) or m.group(4))
                pos = m.end()
                continue
        elif c == "E":
            m = _PYTEST_E.match(text, pos)
            if m:
                pos = m.end()
                continue
        break
    body = text[pos:].strip()
    return (rank if rank is not None else default), body


# Markers that start a new logical line when they appear inside a line (see module docstring).
_SPLIT = re.compile(
    r"(?=[\[rtsNO$(|123ETD])"  # every marker starts with one of these: skip other positions fast
    r"(?:\[(?:rank|default)\d+\]:"
    r"|(?<=\s)rank\d+:(?=\s)"
    r"|tensor at position \d"
    r"|saved metadata:"
    r"|recomputed metadata:"
    r"|Number of tensors saved during"
    r"|(?<!['\w$])\$\d+: [a-z][a-z0-9]*\["
    r"|[\[(]'\$\d+: "
    r"|Operations executed during"
    r"|(?:\|\s*)?[123]\. (?:Stack traces of the operators|Log of operators)"
    r"|ERROR: Detected non-determinism"
    r"|Traceback \(most recent call last\)"
    r"|The above exception was the direct cause"
    r"|During handling of the above exception)"
)
# Cheap substring tests: the regex runs only on lines that contain one of these.
_SPLIT_HINTS = ("rank", "position", "metadata:", "$", "Number of", "Operations executed",
                "Stack traces", "Log of operators", "non-determinism",
                "Traceback", "above exception")


def _may_split(body: str) -> bool:
    for hint in _SPLIT_HINTS:
        if hint in body:
            return True
    return False


def split_segments(text: str, rank: int | None) -> tuple[list[tuple[int | None, str]], int | None]:
    """Strip prefixes from one physical line and cut it into logical segments.

    `rank` is the rank to assume when the line has no prefix of its own (the caller passes the last
    rank it saw). Returns the non-empty segments and the rank that the next line inherits (a
    prefix with nothing after it still changes that rank).
    """
    line_rank, body = strip_prefix(text)
    if line_rank is not None:
        rank = line_rank
    if not body:
        return [], rank
    if not _may_split(body):
        return [(rank, body)], rank
    cuts = [m.start() for m in _SPLIT.finditer(body) if m.start() > 0]
    if not cuts:
        return [(rank, body)], rank
    out: list[tuple[int | None, str]] = []
    bounds = [0, *cuts, len(body)]
    for a, b in zip(bounds, bounds[1:]):
        piece = body[a:b]
        if a > 0:
            piece_rank, piece = strip_prefix(piece)
            if piece_rank is not None:
                rank = piece_rank
        else:
            piece = piece.strip()
        if piece:
            out.append((rank, piece))
    return out, rank
