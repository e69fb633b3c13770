"""Physical lines in, logical segments out: reading, log collectors' records, launcher prefixes, and splitting
spliced lines.

    iter_lines(open("rank1.log", "rb"))        -> ("[rank1]: tensor at position 48:", True), ...
    collected_lines(...)   # a Docker / fluent-bit JSON record -> its text's lines: '{"log": "x\\n"}' -> "x"
    srun_label(" 3: tensor at position 4:")   -> (3, "tensor at position 4:")   (a file whose first line has one)
    strip_prefix("[default1]:[rank1]: Traceback (most recent call last):")
        -> (1, "Traceback (most recent call last):")
    strip_prefix("[7,1]<stderr>: hi")         -> (1, "hi")   (mpirun --tag-output)
    strip_prefix("E           tensor at position 0:")   -> (None, "tensor at position 0:")
    split_segments("[rank11]: recomputed metadata: {'shape': torch.Size([964, 5120]),"
                   "[rank13]: Traceback (most recent call last):", None)
        -> ([(11, "recomputed metadata: {'shape': torch.Size([964, 5120]),"),
             (13, "Traceback (most recent call last):")], 13, True)

A segment is one logical line: its launcher prefixes removed, leading/trailing whitespace removed,
and a rank (or None when no prefix said which). A whole log flattened onto one line comes back as
the segments it was made of: it is cut before every rank prefix, exception line
(`torch.utils.checkpoint.CheckpointError:`, `torch.utils.checkpoint: `), "tensor at position",
"saved metadata:", "recomputed metadata:", "Number of tensors saved during", op-line start
(`$N: dtype[`, `['$N: `, `('$N: `), debug-dump section header or rule, and traceback marker that
does not start the line. Lines longer than `max_line` bytes are returned in pieces.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import IO

from ..streams import STREAM_DAMAGE

MAX_LINE = 1 << 20  # a single line longer than this is handed on in pieces of this size
_PROGRESS_EVERY = 1 << 20


@dataclass(slots=True)
class ReadStats:
    """What reading noticed about the bytes themselves."""

    bytes_read: int = 0
    lines: int = 0
    long_lines: int = 0  # lines split into pieces of MAX_LINE
    undecodable_lines: int = 0  # lines with bytes that are not UTF-8 (replaced by U+FFFD)
    stream_damaged: str | None = None  # why a compressed stream could not be read to its end


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
        except (OSError, ValueError, UnicodeDecodeError, *STREAM_DAMAGE) as exc:  # a damaged or cut .gz
            stats.stream_damaged = f"{type(exc).__name__}: {exc}"
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
# The run of launcher prefixes at the start of a line: `[rank1]:`, `[default1]:` (torchrun --tee),
# a bare `rank11: `, pytest's `E   `, a timestamp a log collector put first (`2025-12-04T08:00:00.123Z`,
# `[2025-12-04 08:00:00,123]`), in any order and number, with indentation around them.
# mpirun --tag-output's `[1,3]<stderr>:` (job, rank) counts as a rank prefix too.
_PREFIX_RUN = re.compile(r"(?:[ \t]*(?:\[(?:rank|default)\d+\]:|rank\d+:(?=[ \t]|\Z)|E(?=[ \t]{2,}|[ \t]*\Z)"
                         r"|\[\d+,\d+\]<std(?:out|err|diag)>:"
                         r"|\[?\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d(?:[.,]\d+)?(?:Z|[+-]\d\d:?\d\d)?\]?:?(?=[ \t])))+")
_PREFIX_NUM = re.compile(r"(rank|default)(\d+)|\[\d+,(\d+)\]<")
# srun --label's ` 3: ` before every line: a rank prefix only in a file whose first line has one (`srun_label`), as
# any line may start with a number and a colon
_SRUN_LABEL = re.compile(r"[ \t]*(\d{1,6}): ")


def srun_label(text: str) -> tuple[int, str] | None:
    """(rank, the rest) of a line srun --label prefixed; None where it has no such label."""
    m = _SRUN_LABEL.match(text)
    return (int(m.group(1)), text[m.end():]) if m else None


# The keys a log collector keeps a line's text under (Docker's json-file `log`, fluent-bit / Loki / Vector
# `message`, journald `MESSAGE`), and a rank it may have kept beside it
_MESSAGE_KEYS = ("log", "message", "msg", "MESSAGE", "text", "line")


def collected_message(line: str) -> str | None:
    """The text of a log collector's JSON line (`{"log": "tensor at position 3:\\n", "stream": "stderr"}`), with a
    `[rankN]:` prefix where the record names its rank; None for any other line."""
    body = line.strip()
    if body[:1] != "{" or body[-1:] != "}":
        return None
    try:
        record = json.loads(body)
    except ValueError:
        return None
    if not isinstance(record, dict):
        return None
    text = next((record[k] for k in _MESSAGE_KEYS if isinstance(record.get(k), str)), None)
    if text is not None and text.endswith("\n"):
        text = text[:-1]  # (Docker keeps each line's own newline)
    rank = record.get("rank")
    if text is not None and type(rank) is int:
        text = "\n".join(f"[rank{rank}]: {part}" for part in text.split("\n"))
    return text


def collected_lines(lines: Iterator[tuple[str, bool]]) -> Iterator[tuple[str, bool]]:
    """Lines as iter_lines yields them, each log collector's JSON record replaced by the lines of its text."""
    for text, ended in lines:
        message = collected_message(text) if ended and text[-1:] == "}" else None
        if message is None:
            yield text, ended
            continue
        for part in message.split("\n"):
            yield part.rstrip("\r"), True


# A file torchrun wrote one rank's output to (`--log-dir D --redirects 3`: D/<run>/attempt_0/<local rank>/stderr.log),
# or one named by its rank (`rank3.log`, `train_rank_3.err`)
_LOG_DIR_PATH = re.compile(r"^(.*)[\\/]attempt_\d+[\\/](\d+)[\\/](?:stderr|stdout|error)\.log$")
_RANK_NAME = re.compile(r"rank[_-]?(\d+)[^\\/\d]*$")


def rank_in_path(path: str | None) -> int | None:
    """The rank a log file's path names, for its lines without a rank prefix; None where it names none (a torchrun
    --log-dir file's is its local rank: log_dir_place)."""
    placed = log_dir_place(path)
    if placed is not None:
        return placed[1]
    m = _RANK_NAME.search(path or "")
    return int(m.group(1)) if m else None


def log_dir_place(path: str | None) -> tuple[str, int] | None:
    """(the node's run directory, local rank) of a file torchrun --log-dir wrote; None for any other path."""
    m = _LOG_DIR_PATH.match(path or "")
    return (m.group(1), int(m.group(2))) if m else None


def strip_prefix(text: str) -> tuple[int | None, str]:
    """Remove launcher prefixes, pytest's `E   ` and indentation; return (rank, body).

    `[rankN]` wins over `[defaultN]` (torchrun's local-rank tag) when both are present.
    """
    rank, body, _ = _stripped(text)
    return rank, body


def _stripped(text: str) -> tuple[int | None, str, bool]:
    """strip_prefix's (rank, body), and whether the rank is only torchrun's local `[defaultN]`."""
    if "\x1b" in text:
        text = _ANSI.sub("", text)
    m = _PREFIX_RUN.match(text)
    if m is None:
        return None, text.strip(), False
    rank = default = None
    for kind, num, tagged in _PREFIX_NUM.findall(m.group()):
        if kind == "rank" or tagged:
            rank = int(num or tagged)
        else:
            default = int(num)
    return (rank if rank is not None else default), text[m.end():].strip(), rank is None and default is not None


# A local rank on a node an srun label named (`1: [default0]: ...`: torchrun under `srun -l`, one task per node) is
# kept as a negative number until the log is read: its global rank needs the ranks per node, the most local ranks
# any node showed (`global_ranks`).
_NODE_STRIDE = 1 << 20


def node_local(node: int, local: int) -> int:
    return -(1 + node * _NODE_STRIDE + local)


def node_and_local(rank: int | None) -> tuple[int, int] | None:
    """(node, local rank) of a rank node_local made; None for any other rank."""
    return divmod(-rank - 1, _NODE_STRIDE) if rank is not None and rank < 0 else None


def global_ranks(ranks: list[int | None]) -> dict[int, int]:
    """{node-local rank as node_local made it: its global rank, node x ranks per node + local}."""
    pairs = {r: pair for r in ranks if (pair := node_and_local(r)) is not None}
    n = per_node(pairs)
    return {r: node * n + local for r, (node, local) in pairs.items()}


def per_node(ranks: dict[int, object]) -> int:
    """The ranks per node: the most local ranks a node showed (highest local rank + 1), over node_local's keys."""
    return max((pair[1] for r in ranks if (pair := node_and_local(r)) is not None), default=-1) + 1


# Markers that start a new logical line when they appear inside a line (see module docstring).
# Literal ones are found with str.find (C speed); the regexes below run only when a cheap
# substring test says they could match.
_LITERAL_MARKERS = (
    "torch.utils.checkpoint.CheckpointError:", "torch.utils.checkpoint: ", "tensor at position ", "saved metadata:", "recomputed metadata:", "Number of tensors saved during",
    "Operations executed during", "ERROR: Detected non-determinism", "Traceback (most recent call last)",
    "The above exception was the direct cause", "During handling of the above exception",
    "+--------",  # the rule that ends the recompute op list
)
_BOXED_MARKERS = ("Stack traces of the operators", "Log of operators")  # cut before "| 1. "
_RANK_MID = re.compile(r"\[(?:rank|default)\d+\]:|(?<=\s)rank\d+:(?=\s)|\[\d+,\d+\]<std(?:out|err|diag)>:")
_OP_MID = re.compile(r"\$(?<!['\w$]\$)\d+: [a-z][a-z0-9]*\[")  # `$N: dtype[` not inside quotes
_OP_LIST_MID = re.compile(r"'\$\d+: ")  # `['$N: ` / `('$N: ` (checked for the bracket before it)
_BOX_PREFIX = re.compile(r"(?:\|\s*)?[123]\.\s*\Z")


def _cuts(body: str) -> list[int]:
    """Positions (> 0) where a marker starts a new segment inside `body`."""
    cuts: list[int] = []
    for marker in _LITERAL_MARKERS:
        if marker in body:
            i = body.find(marker, 1)
            while i > 0:
                cuts.append(i)
                i = body.find(marker, i + 1)
    for marker in _BOXED_MARKERS:
        if marker in body:
            i = body.find(marker, 1)
            while i > 0:
                m = _BOX_PREFIX.search(body, max(0, i - 24), i)
                j = m.start() if m else i
                if j > 0:
                    cuts.append(j)
                i = body.find(marker, i + 1)
    if "rank" in body or "[default" in body or "]<std" in body:
        cuts.extend(m.start() for m in _RANK_MID.finditer(body, 1))
    if "$" in body:
        cuts.extend(m.start() for m in _OP_MID.finditer(body, 1))
        if "'$" in body:
            cuts.extend(m.start() - 1 for m in _OP_LIST_MID.finditer(body, 2) if body[m.start() - 1] in "[(")
    if len(cuts) > 1:
        cuts = sorted(set(cuts))
    return cuts


# a logger's own rank tag in its record (`2026-12-07 04:47:00,108 [ERROR] [rank1] trainer: training failed`): no
# colon after it (that is a launcher's prefix), near the record's start
_LOGGER_RANK = re.compile(r"\[rank(\d+)\](?!:)")
_LOGGER_TAG_WITHIN = 80  # characters of a record's start its rank tag may be in


def split_segments(text: str, rank: int | None, home: int | None = None, mixed: bool = False,
                   by_prefix: bool = False, node: int | None = None
                   ) -> tuple[list[tuple[int | None, str]], int | None, bool]:
    """Strip prefixes from one physical line and cut it into logical segments.

    `rank` is the rank to assume when the line has no prefix of its own (the caller passes the last
    rank it saw, and `by_prefix`: whether a launcher's prefix named it). Returns the non-empty segments,
    the rank that the next line inherits (a prefix with nothing after it still changes that rank) and
    whether a prefix named it. A line without a prefix whose logger record names its rank
    (`[ERROR] [rank1] trainer: ...`) sets it: a `logger.exception` copy of an error that follows is that
    rank's. In a log where several ranks were seen (`mixed`), a traceback that starts without a prefix
    after prefixed lines is written by another hand than theirs: it takes the file's own rank (`home`,
    the one its path names, else unknown), not the last prefix's. `node`: the srun label the line had: a local
    `[defaultN]` then is that node's (node_local).
    """
    line_rank, body, local = _stripped(text)
    if local and node is not None:
        line_rank = node_local(node, line_rank)
    if line_rank is not None:
        rank, by_prefix = line_rank, True
    elif "[rank" in body and (tag := _LOGGER_RANK.search(body, 0, _LOGGER_TAG_WITHIN)):
        rank, by_prefix = int(tag.group(1)), False
    elif mixed and by_prefix and body.startswith("Traceback (most recent call last)"):
        rank, by_prefix = home, False
    if not body:
        return [], rank, by_prefix
    cuts = _cuts(body)
    if not cuts:
        return [(rank, body)], rank, by_prefix
    out: list[tuple[int | None, str]] = []
    bounds = [0, *cuts, len(body)]
    for a, b in zip(bounds, bounds[1:]):
        piece = body[a:b]
        if a > 0:
            piece_rank, piece, local = _stripped(piece)
            if local and node is not None:
                piece_rank = node_local(node, piece_rank)
            if piece_rank is not None:
                rank, by_prefix = piece_rank, True
        else:
            piece = piece.strip()
        if piece:
            out.append((rank, piece))
    return out, rank, by_prefix
