"""Read what torch.utils.checkpoint printed (errors, `debug=True` dumps) into `Run(source="log")`.

    from ac_diff.logs import parse_log, parse_text, looks_like_log

    run = parse_log("rank1.log", progress=lambda done, total: ...)
    run.errors[0]   # TorchError(kind="metadata_mismatch", rank=1,
                    #            positions=[PositionMismatch(48, bf16[99, 5120], bf16[98, 5120]), ...],
                    #            count=40643, first_line=7, last_line=1788249)   (one per distinct error)
    run.regions[0]  # Region(rank=1, region=0, kind="log", forward=Pass(ops=[OpRecord(...)]), recompute=...)
    run.notes       # ["skipped 7 garbled lines (...)", "the log ends mid-structure: rank 1: ..."]
    run.truncated   # True if the log stops inside an error message, a dump or a traceback

The parser is lenient and streaming: it never raises on content (non-UTF-8 bytes, binary junk,
a cut anywhere, lines spliced by concurrent writers, a whole log flattened onto one line), reads
line by line with a cap on line length, and keeps only what it extracts.

Modules, one job each:
    lines    bytes -> lines -> (rank, segment): collectors' JSON records, prefixes, pytest `E`, spliced lines
    meta     dtype / shape / device / metadata dicts -> TensorMeta
    args     the arguments of an op call -> JSON values
    errors   CheckpointError texts -> TorchError
    repeats  the same error printed again and again -> one TorchError with its count and first / last line
    memo     each distinct short line read once (logs repeat theirs)
    oplines  one LoggingTensor op line -> ParsedOp
    dump     debug=True dump sections -> Region (with sources from the stack traces)
    spill    parse_log(lazy=True): each finished region's ops on disk until the diagnosis loads them
    parser   the per-rank state machine that ties them together
"""

from __future__ import annotations

import contextlib
import gzip
import io
import os
from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from typing import IO, Union

from ac_diff.gc_hold import collector_paused
from ac_diff.logs.lines import MAX_LINE, collected_lines, collected_message, iter_lines, log_dir_place
from ac_diff.logs.meta import UNKNOWN_DEVICE
from ac_diff.logs.parser import LogParser
from ac_diff.logs.repeats import fold_errors
from ac_diff.logs.spill import RegionSpill
from ac_diff.passes import Run, TorchError
from ac_diff.streams import STREAM_DAMAGE, open_binary

__all__ = ["parse_log", "parse_text", "looks_like_log", "place_log_dir_ranks", "UNKNOWN_DEVICE", "LogParser"]

Progress = Callable[[int, Union[int, None]], None]
SNIFF_BYTES = 1 << 20
_SNIFF_BLOCK = 1 << 10

# Any of these in the first or last MiB makes a file a torch checkpoint log.
_MARKERS = (
    b"CheckpointError",
    b"tensor at position ",
    b"saved metadata: {",
    b"recomputed metadata: {",
    b"Number of tensors saved during",
    b"Recomputed values for the following tensors",
    b"Operations executed during the original forward",
    b"Stack traces of the operators that ran",
    b"Detected non-determinism while running activation checkpointing",
    b"= torch._ops.",
    b"but not found in storage",
    b"cached during selective activation checkpoint",
    b"set_checkpoint_debug_enabled",  # the Tip block
    # a traceback through checkpoint (the error line may be cut off); not a warning torch printed from there (2.4's
    # FutureWarning on torch.cpu.amp.autocast at every recompute, in a log that holds no error)
    b'torch/utils/checkpoint.py", line',
    b"Traceback (most recent call last)",  # a traceback-only paste: read like the others, it says what is missing
    b"None of the inputs have requires_grad=True",  # torch's warning: a reentrant region whose parameters get no grad
)


def parse_log(source: Union[str, os.PathLike, IO], *, progress: Progress | None = None, lazy: bool = False) -> Run:
    """Parse a log file (path) or an open stream (text or binary) into a Run; never raises on content.

    `progress(bytes_read, total_bytes)` is called about once per MiB and at the end; total_bytes is
    None for a stream whose size is unknown. A path that cannot be opened raises OSError, as open()
    would: that is the caller's error, not the log's. `lazy`: each region's ops wait in a temporary
    file until `run.loaded(region)` asks for them (spill.py), so memory holds one region, not the log.
    """
    spill = RegionSpill() if lazy else None
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        with _open_log(path) as (f, total):
            return _parse_stream(f, path, total, progress, spill)
    name = getattr(source, "name", None)
    total = None
    if isinstance(name, str):
        try:
            total = os.path.getsize(name)
        except OSError:
            total = None
    return _parse_stream(source, name if isinstance(name, str) else None, total, progress, spill)


@contextlib.contextmanager
def _open_log(path: str):
    """(binary stream, size or None) of a log as saved: plain, gzip-compressed (`.log.gz`), or UTF-16
    with a byte-order mark (what PowerShell's `>` writes), the latter two as UTF-8 bytes."""
    with open_binary(path) as f:
        if isinstance(f, gzip.GzipFile):
            yield f, None
            return
        if f.peek(2)[:2] in (b"\xff\xfe", b"\xfe\xff"):
            data = f.read().decode("utf-16", errors="replace").encode("utf-8")
            yield io.BytesIO(data), len(data)
            return
        yield f, os.fstat(f.fileno()).st_size


def parse_text(text: str) -> Run:
    """Parse a log held in a string, e.g. `str(exception)` of a CheckpointError.

    The end of the string counts as the end of a line (a message is whole; older torch ends the
    count message with the number itself). A file that stops mid-line is parse_log's case.
    """
    if text and not text.endswith("\n"):
        text += "\n"
    return _parse_stream(io.StringIO(text), None, len(text), None)


def recorded_errors(run: Run, check_errors: list[dict]) -> list[TorchError]:
    """The CheckpointErrors a recorded process raised, parsed from the texts its trace kept: the
    check_error records, else an uncaught CheckpointError / RuntimeError, else a recompute's error."""
    messages = [(c.get("message", ""), c.get("region")) for c in check_errors]
    raised = [(region.recompute.state["error"], region.region) for region in run.regions
              if region.recompute is not None and region.recompute.state.get("error")]
    if run.exc_type in ("CheckpointError", "RuntimeError") and not messages:
        # the uncaught error is the one a recompute raised, where it is that region's (selective AC's, raised in the
        # recompute, not by torch's check after it)
        message = run.exc_message or ""
        messages.append((message, next((n for text, n in raised if message and message[:1000] in text), None)))
    if not messages and raised:
        messages.append(raised[0])
    found: list[TorchError] = []
    for message, region_number in messages:
        for err in parse_text(message).errors:
            err.rank = run.rank or 0
            err.region = region_number
            err.first_line = err.last_line = None  # lines of the message, not of a log
            found.append(err)
    return fold_errors(found)


def place_log_dir_ranks(runs: list[Run], seen: Iterable[str]) -> None:
    """Give the logs torchrun --log-dir wrote on several nodes their global ranks, in place.

    Such a file's path names only its local rank (<node's dir>/<run>/attempt_0/<local rank>/stderr.log), so two
    nodes' rank 0 would be one rank. `seen`: every such file's path known (the ones without an error included), for
    the nodes and the ranks per node. The nodes are taken in their directories' path order, which the files cannot
    confirm: a note says so. Nothing changes where a log's lines named their own ranks (torch's `[rankN]:`)."""
    placed = {path: where for path in {*seen, *(run.path for run in runs if run.path)}
              if (where := log_dir_place(path)) is not None}
    nodes = sorted({node for node, _ in placed.values()})
    logs = [(run, placed[run.path]) for run in runs if run.source == "log" and run.path in placed]
    if len(nodes) < 2 or not logs or any(set(run.header.get("ranks") or ()) - {local} for run, (_, local) in logs):
        return
    per_node = max(local for _, local in placed.values()) + 1
    offset = {node: i * per_node for i, node in enumerate(nodes)}
    for run, (node, local) in logs:
        rank = offset[node] + local
        for item in [*run.regions, *run.errors]:
            item.rank = rank if item.rank == local else item.rank
        run.header["ranks"] = [rank] if run.header.get("ranks") else []
        run.header["raised"] = {str(rank): text for text in (run.header.get("raised") or {}).values()}
    try:
        common = os.path.commonpath(nodes)
    except ValueError:  # (absolute and relative paths)
        common = ""
    spans = ", ".join(f"{os.path.relpath(node, common) if common else node} = ranks {offset[node]}-"
                      f"{offset[node] + per_node - 1}" for node in nodes)
    runs[0].notes.append(f"ranks: the files torchrun --log-dir wrote name local ranks only; {len(nodes)} nodes' "
                         f"directories, {per_node} ranks each, taken as nodes 0-{len(nodes) - 1} in path order "
                         f"({spans}): if that is not their node order, so are the ranks (torch's `[rankN]:` "
                         "prefix, on a traceback that reaches the top, names global ranks)")


def _parse_stream(stream: IO, path: str | None, total: int | None, progress: Progress | None,
                  spill: RegionSpill | None = None) -> Run:
    # The parser makes no reference cycles, so the cyclic collector has nothing to find; with torch
    # loaded it would rescan ~200k old objects again and again while the ops pile up (5-10x slower).
    with collector_paused():
        parser = LogParser(path, spill)
        for line, ended in collected_lines(iter_lines(stream, parser.read_stats, total=total, progress=progress,
                                                      max_line=MAX_LINE)):
            parser.feed(line, ended)
        return parser.finish()


def _readable_blocks(f, size: int) -> Iterator[bytes]:
    """A compressed log's blocks of `size` bytes, as far as the stream can be read (one that is cut or damaged ends
    them; a single read past that point would lose every byte it had decompressed)."""
    with contextlib.suppress(*STREAM_DAMAGE):
        yield from iter(lambda: f.read(size), b"")


def is_text(path: Union[str, os.PathLike]) -> bool:
    """Is this file text a program printed (a training log without checkpoint error text), not binary data or records
    (JSON: a trace of an unknown format, another tool's output): its first 64 KiB hold no NUL byte, read as UTF-8 (a
    character cut at their end aside) and do not begin with `{` or `[`. False where it cannot be read."""
    try:
        with _open_log(os.fspath(path)) as (f, _):
            head = f.read(1 << 16)
    except (*STREAM_DAMAGE, UnicodeError, OSError):
        return False
    if not head.strip() or b"\x00" in head or head.lstrip()[:1] in (b"{", b"["):
        return False
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as exc:
        return exc.start >= len(head) - 3  # (a character cut where the read stopped)
    return True


def looks_like_log(path: Union[str, os.PathLike]) -> bool:
    """Does this file hold checkpoint error text or a debug dump (in its first or last MiB)?

    A file whose first line is a JSON object is taken for a trace (JSONL), not a log. False for a
    compressed file whose start cannot be decompressed; an OSError opening the file propagates.
    """
    try:
        with _open_log(os.fspath(path)) as (f, size):
            # (compressed: small blocks, since a stream cut short loses the whole block being read)
            head = f.read(SNIFF_BYTES) if size is not None else b"".join(
                islice(_readable_blocks(f, _SNIFF_BLOCK), SNIFF_BYTES // _SNIFF_BLOCK))
            tail = b""
            if size is None or size > SNIFF_BYTES:
                if size is None:  # compressed: read through
                    for tail in _readable_blocks(f, SNIFF_BYTES):
                        pass
                else:
                    f.seek(max(SNIFF_BYTES, size - SNIFF_BYTES))
                    tail = f.read(SNIFF_BYTES)
    except (*STREAM_DAMAGE, UnicodeError):
        return False
    first = head.lstrip()[:1]
    if first == b"{":
        line = head.lstrip().split(b"\n", 1)[0].rstrip()
        if line.endswith(b"}") and (b'"format"' in line or collected_message(line.decode("utf-8", "replace")) is None):
            return False  # (a trace, which names its format; a log collector's record holds a line of text)
    return any(m in head or m in tail for m in _MARKERS)

