"""The trace file: versioned, self-describing JSON Lines (optionally gzip), streamed and flushed per pass.

    {"type": "header", "format": "ac-diff-trace", "version": "1.3", "torch": "2.13.0", "rank": 0, ...}
    {"type": "region", "region": 0, "module": "layers.0", "kind": "checkpoint", "options": {...}}
    {"type": "op", "region": 0, "phase": "forward", "attempt": 0, "i": 0, "op": "aten.mm.default",
     "module": "layers.0.moe.router.gate", "src": "model.py:40 in forward", "in": [[[512, 64], "f32", "cpu"], ...],
     "out": [...], "args": ["$", "$"], "refs": [{"k": "op", "op": 3}, {"k": "param", "name": "..."}],
     "fp": [[12.5, 801.2]], "vals": {"out1": {"dtype": "i64", "shape": [512, 2], "b64": "..."}}}
    {"type": "pass", "region": 0, "phase": "forward", "n_ops": 57, "complete": true, "positions": [...], ...}
    {"type": "check_error" | "exception" | "warning", ...}
    {"type": "end", "status": "ok" | "exception" | "interrupted" | "exit", "exit_code": 0, ...}

Kept values (`vals`) are raw little-endian bytes in base64 with their dtype and shape (older traces
stored nested lists; both load). `read_run(path)` turns a file back into the model
(`ac_diff.passes.Run`); `read_run(path, lazy=True)` (what `ac-diff report` reads with) only checksums and
indexes the "ops" lines and leaves ops, positions and externals to be decoded one region at a time
(`Run.ops_loader`), so memory follows the largest region, not the file. A file of another format or of a newer major version raises
`TraceFormatError` saying what it is and what to do; a file without its end record (the process
died) loads with `Run.truncated` set and a note.

Integrity: since 1.1 every line ends with `"crc": N`, the CRC-32 of the line's bytes without that
field (`{..., "crc": N}` -> `{...}`). A line whose checksum does not match, that does not parse, or
that lacks the checksum in a 1.1 trace is damaged: it is skipped, counted, and every region that was
being recorded when it was written (its region record before the line, its last recompute pass record not)
is marked damaged (`Region.damaged`), and so is the region whose recompute ended just
before the line (a torch error or exception record is about it); so is a region named only by records
whose region record was lost. The diagnosis reports such a region as "damaged", never as clean or diverged. A
damaged header, or one whose fields have the wrong types, raises `TraceFormatError`.

Format history (every version stays readable; tests/data keeps a file of each):
  1.0  header, region, op (one per op, later one "ops" record per pass), pass, end records
  1.1  a CRC-32 per line (`crc`); readers of 1.0 ignore it
  1.2  record types are checked against the minor version (the lines are those of 1.1)
  1.3  a summarized pass (`"ops_written": false`; `write: diverged`, the default since) carries its `verdict`
       and a `values_digest`, and no attributes; in a distributed run a forward's summary keeps the parameters
       and buffers it reads; readers of 1.2 ignore the new keys

NOTE [versions and record types]: the major version changes when a reader of the old one would
misread the file; it is refused with advice ("upgrade ac-diff" / "re-record it"). A minor version may
add record types. A record type this reader does not know is therefore corruption in a trace of its own
minor version or an older one (an error), but new data in a trace of a newer minor: those records are
skipped with one line on stderr naming both versions and saying "upgrade ac-diff". (Readers before 1.2
skipped unknown types silently: an older ac-diff read a newer trace as empty regions.)
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import os
import queue
import threading
import platform
import re
import zlib
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

try:  # ~10x faster than json for the per-pass records; optional (json writes the same lines)
    import orjson
except ImportError:  # pragma: no cover - orjson is a dependency; json is the fallback
    orjson = None

from ._version import __version__
from .capture.opinfo import short_dtype
from .errors import AcDiffError
from .streams import STREAM_DAMAGE, open_binary
from .passes import (External, InputRef, OpRecord, Pass, Position, Region, Run, TensorMeta, PHASES)

FORMAT = "ac-diff-trace"
VERSION = "1.3"
MAJOR, MINOR = (int(x) for x in VERSION.split("."))


class TraceFormatError(AcDiffError, ValueError):
    """The file is not an ac-diff trace this version can read. The message says what to do."""


# -- writing ----------------------------------------------------------------------------------
# flags of an op row (see encode_ops)
FLAG_CACHED, FLAG_RANDOM, FLAG_DISCRETE, FLAG_DERIVED = 1, 2, 4, 8
OPS_FIELDS = ("op", "module", "src", "in", "args", "refs", "out", "fp", "host", "flags", "vals")
# every record type a trace of this version may hold
RECORD_TYPES = frozenset({"header", "region", "op", "ops", "pass", "check_error", "exception", "warning", "end"})


def default_header(options: Any, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    import torch

    rank = int(os.environ.get("RANK", "0") or 0)
    header = {
        "type": "header", "format": FORMAT, "version": VERSION, "ac_diff": __version__,
        "torch": torch.__version__, "python": platform.python_version(), "argv": list(sys.argv),
        "rank": rank, "world_size": int(os.environ.get("WORLD_SIZE", "1") or 1),
        "local_rank": int(os.environ.get("LOCAL_RANK", "0") or 0), "pid": os.getpid(),
        "host": platform.node(), "start_time": time.time(), "cwd": os.getcwd(),
        "options": {k: sorted(v) if isinstance(v, frozenset) else v for k, v in vars(options).items()},
    }
    header.update(extra or {})
    return header


class TraceWriter:
    """Appends records to a trace file; `flush()` pushes them to disk so a crash loses nothing written.

    With `background=True` a writer thread encodes and writes, in order, what `write` queues (a record,
    or a function that builds one): the training thread only queues, and on a machine with a core to
    spare the JSON encoding overlaps the backward's kernels (which run without the GIL). Whoever queues
    a record must not change it afterwards. `close()` drains the queue, so an exception, SystemExit or
    Ctrl-C still leaves a finished trace; a process killed outright loses what was still queued (a pass
    or two) instead of nothing after the last flush. A write that fails (a full disk) never raises into
    the training: the writer stops writing and `failure` says which file and what was lost.
    """

    def __init__(self, path: str | os.PathLike, header: dict[str, Any], background: bool = False) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        raw = open(self.path, "wb")
        self._raw = raw
        self._file = gzip.GzipFile(fileobj=raw, mode="wb") if self.path.suffix == ".gz" else raw
        # records are trees: no circular-reference bookkeeping (a quarter of the encoding time)
        self._encode = json.JSONEncoder(separators=(",", ":"), default=str, check_circular=False).encode
        self.error: BaseException | None = None  # the first failure of the writer thread, if any
        self.failure: str | None = None  # the first write that failed (a full disk): what was lost, in words
        self._lost = 0  # records not written since
        self._written = 0
        self._write_now(header)
        self._flush_now()
        if self.failure is not None:  # not even the header: nothing to record into, before anything ran
            raise self._os_error
        self._queue: queue.SimpleQueue | None = None
        self._thread: threading.Thread | None = None
        if background:
            self._queue = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._run, name="ac-diff-trace-writer", daemon=True)
            self._thread.start()

    def write(self, record: dict[str, Any] | Callable[[], dict[str, Any]]) -> None:
        """Queue or write one record. One that may hold NaN or infinite floats must say so with
        `"nonfinite": true`: only json writes them as such (orjson would write null)."""
        if self._queue is not None:
            self._queue.put((self._write_now, record))
        else:
            self._write_now(record)

    def flush(self) -> None:
        if self._queue is not None:
            self._queue.put((self._flush_now, None))
        else:
            self._flush_now()

    def close(self, end_record: dict[str, Any]) -> None:
        self.write(end_record)
        if self._queue is not None:
            self._queue.put((None, None))
            self._thread.join()
            self._queue = None
        self._flush_now()
        for f in {id(self._file): self._file, id(self._raw): self._raw}.values():
            try:
                f.close()
            except OSError as exc:  # the last buffered bytes (a gzip trailer) did not fit
                self._failed(exc)
        if self.failure is not None:
            self.failure += f"; {self._lost} record(s) after it were lost (the end record too)" if self._lost else ""

    def _write_now(self, record: Any) -> None:
        if self.failure is not None:
            self._lost += 1
            return
        if callable(record):
            record = record()
        line = None if record.get("nonfinite") else _fast_encode(record)
        if line is None:
            line = self._encode(record).encode("utf-8", "replace")
        try:
            self._file.write(with_crc(line) + b"\n")
            self._written += 1
        except OSError as exc:
            self._failed(exc)
            self._lost += 1

    def _flush_now(self, _: Any = None) -> None:
        if self.failure is not None:
            return
        try:
            if isinstance(self._file, gzip.GzipFile):
                self._file.flush(gzip.zlib.Z_SYNC_FLUSH)
            self._file.flush()
            self._raw.flush()
        except OSError as exc:
            self._failed(exc)

    def _failed(self, exc: OSError) -> None:
        """A write failed (a full disk, a quota, a dead mount): keep the training running, write nothing more,
        and say what was lost. The file keeps what reached it (read back as a trace cut short)."""
        if self.failure is None:
            from .streams import describe_os_error

            exc.filename = exc.filename or str(self.path)
            self._os_error = exc
            self.failure = (f"could not write the trace: {describe_os_error(exc)}; it holds only what was written "
                            f"before ({self._written} record(s), the last one possibly cut) and reads as cut short")

    def _run(self) -> None:
        queue_ = self._queue
        while True:
            action, arg = queue_.get()
            if action is None:
                return
            try:
                action(arg)
            except Exception as exc:  # noqa: BLE001 - one bad record must not stop the others
                if self.error is None:
                    self.error = exc
                with contextlib.suppress(Exception):
                    self._write_now({"type": "warning", "message": f"ac-diff trace writer: {type(exc).__name__}: "
                                                                   f"{exc} (a record was lost; please report)"})


def encode_ops(region: int, phase: str, attempt: int, ops: list[tuple], fps: dict[int, list],
               vals: dict[int, dict], cached: Any, nonfinite: bool) -> dict[str, Any]:
    """All ops of a pass as ONE trace record (format 1.0 wrote one "op" record per op; both load):

        {"type": "ops", "region": 0, "phase": "forward", "attempt": 0, "start": 0,
         "fields": ["op", "module", "src", "in", "args", "refs", "out", "fp", "host", "flags", "vals"],
         "strings": ["aten.mm.default", "layers.0.attention.wq", "model.py:40 in forward", ...],
         "rows": [[0, 1, 2, [[[512, 64], "f32", "cpu"]], ["$", "$"], [["op", 3, 0], ["param", "w", 1]],
                   [[[512, 64], "f32", "cpu"]], [[12.5, 801.2]], null, 0, {"out1": {...}}], ...]}

    Each row is one recorder op tuple; `cached` holds the indices of ops selective AC served. `op`, `module` and `src` are indices into `strings`; refs are ["op", op index, output index] or
    [kind, name, external index]; flags: 1 cached (selective AC), 2 random, 4 discrete, 8 derived
    (elementwise op of measured inputs: not fingerprinted, see recorder `_record`); trailing empty
    fields are left off. One JSON encoding per pass instead of one per op, and a third of the bytes.
    """
    strings: dict[str, int] = {}
    rows = []
    for index, (name, module, src, in_meta, args, refs, out_meta, host, flags) in enumerate(ops):
        op_id = strings.get(name)
        if op_id is None:
            op_id = strings[name] = len(strings)
        module_id = None
        if module is not None:
            module_id = strings.get(module)
            if module_id is None:
                module_id = strings[module] = len(strings)
        src_id = None
        if src is not None:
            src_id = strings.get(src)
            if src_id is None:
                src_id = strings[src] = len(strings)
        if cached and index in cached:
            flags |= FLAG_CACHED
        row = [op_id, module_id, src_id, _written_metas(in_meta), args, refs, _written_metas(out_meta),
               fps.get(index), host, flags,
               vals.get(index)]
        if row[10] is None:  # leave off empty trailing fields: no vals, no flags, no host, no fp
            row.pop()
            if not flags:
                row.pop()
                while len(row) > 7 and row[-1] is None:
                    row.pop()
        rows.append(row)
    record = {"type": "ops", "region": region, "phase": phase, "attempt": attempt, "start": 0,
              "fields": OPS_FIELDS, "strings": list(strings), "rows": rows}
    if nonfinite:
        record["nonfinite"] = True
    return record


# (size, dtype, device) as the recorder keeps it -> its written form (size, short dtype, device name); the
# same few metas recur in every pass, so each is converted once (bounded: data-dependent shapes vary)
_written: dict[tuple, tuple] = {}


def _written_meta(meta: tuple) -> tuple:
    size, dtype, device = meta
    if len(_written) > 8192:
        _written.clear()
    w = _written[meta] = (tuple(size), short_dtype(dtype), "cpu" if device.type == "cpu" else str(device))
    return w


def written_meta(meta: tuple) -> tuple:
    """(size, dtype, device) -> (size as a tuple, short dtype, device name), as the trace holds a tensor's meta."""
    w = _written.get(meta)
    return w if w is not None else _written_meta(meta)


def _written_metas(metas: tuple) -> list:
    get = _written.get
    return [get(m) or _written_meta(m) for m in metas]


def _json_default(o: Any) -> Any:
    return list(o) if isinstance(o, tuple) else str(o)  # tuple subclasses (torch.Size) as json writes them


def _fast_encode(record: Any) -> bytes | None:
    """orjson's bytes for `record`, or None where only json can write it (no orjson, ints over 64 bits,
    lone surrogates): the caller then uses json. Non-finite floats must not get here (see `write`)."""
    if orjson is None:
        return None
    try:
        return orjson.dumps(record, default=_json_default, option=orjson.OPT_NON_STR_KEYS)
    except (TypeError, ValueError):  # orjson.JSONEncodeError is a TypeError
        return None


_CRC = b',"crc":'


def with_crc(line: bytes) -> bytes:
    """An encoded record (`{...}`) with its checksum as the last field: `{...,"crc":N}`."""
    return b"%s%s%d}" % (line[:-1], _CRC, zlib.crc32(line))


def check_crc(line: bytes) -> bool | None:
    """True if the line's checksum matches, False if it does not, None if the line has none."""
    at = line.rfind(_CRC)
    if at < 0:
        return None
    digits = line[at + len(_CRC):].rstrip()
    if not digits.endswith(b"}") or not digits[:-1].isdigit():
        return False
    return zlib.crc32(line[:at] + b"}") == int(digits[:-1])


def decode_line(line: str | bytes) -> Any:
    """One JSON line (orjson where it can: it rejects the NaN and Infinity literals json writes)."""
    if orjson is not None:
        try:
            return orjson.loads(line)
        except ValueError:  # orjson.JSONDecodeError is a ValueError (and a json.JSONDecodeError)
            pass
    return json.loads(line)


# -- reading ----------------------------------------------------------------------------------
def open_text(path: str | os.PathLike) -> io.TextIOBase:
    """Open a file as text whether it is gzip-compressed or not."""
    return io.TextIOWrapper(open_binary(path), encoding="utf-8", errors="replace")


def is_trace(path: str | os.PathLike) -> bool:
    """True if the file starts like an ac-diff trace (any version)."""
    try:
        with open_binary(path) as f:
            first = f.readline(65536)
        return b'"format"' in first and FORMAT.encode() in first
    except STREAM_DAMAGE:
        return False


_DAMAGED = "_damaged"


def _lines(f: Any) -> Iterator[bytes]:
    """The file's lines; a compressed stream that breaks off ends them with one None."""
    while True:
        try:
            line = f.readline()
        except STREAM_DAMAGE:
            yield None
            return
        if not line:
            return
        yield line


# The start of an "ops" line as encode_ops writes it (orjson; json's spacing where json wrote it)
_OPS_LINE = re.compile(rb'\{"type": ?"ops", ?"region": ?(\d+), ?"phase": ?"(forward|recompute)", ?"attempt": ?(\d+),')
_AT = "_at"  # the byte offset of a deferred "ops" record's line, or of a "pass" record's


def iter_records(path: str | os.PathLike, defer_ops: bool = False) -> Iterator[dict[str, Any]]:
    """Yield the trace's records after checking its header. A damaged line is yielded as
    {"type": "_damaged", "why": ...}; a cut compressed stream ends the iteration with one.
    defer_ops (uncompressed files): an intact "ops" line is not decoded but yielded as
    {"type": "ops", "region", "phase", "attempt", "_at": its byte offset}; a "pass" record has "_at" too."""
    with open_binary(path) as f:
        lines = _lines(f)
        first = next(lines, b"") or b""
        header = _parse_header(first, path)
        checked = header.pop("crc", None) is not None  # 1.1: every line carries its checksum
        yield header
        end = len(first)
        for line in lines:
            if line is None:
                yield {"type": _DAMAGED, "why": "the compressed stream is damaged or cut short here"}
                return
            at, end = end, end + len(line)
            if not line.strip():
                continue
            ok = check_crc(line) if checked else None
            if ok is False or (checked and ok is None):
                yield {"type": _DAMAGED, "why": "checksum mismatch" if ok is False else "a line without its checksum"}
                continue
            deferred = _OPS_LINE.match(line) if defer_ops else None
            if deferred is not None:
                yield {"type": "ops", "region": int(deferred[1]), "phase": deferred[2].decode(),
                       "attempt": int(deferred[3]), _AT: at}
                continue
            try:
                rec = decode_line(line)
            except (ValueError, RecursionError):  # a cut last line, garbage, nesting too deep to parse
                rec = None
            if not isinstance(rec, dict):
                yield {"type": _DAMAGED, "why": "not a JSON record"}
                continue
            rec.pop("crc", None)
            if defer_ops and rec.get("type") == "pass":
                rec[_AT] = at
            yield rec


# header fields and the types they must have (a header with others is damaged, not a trace to trust)
_HEADER_TYPES: dict[str, tuple[type, ...]] = {
    "rank": (int,), "world_size": (int,), "local_rank": (int,), "pid": (int,), "restart": (int,),
    "start_time": (int, float), "argv": (list,), "options": (dict,), "target_args": (list,),
    "run_id": (str,), "host": (str,), "torch": (str,), "python": (str,), "ac_diff": (str,), "cwd": (str,),
    "target": (str,), "module": (bool,),
}


def read_header(path: str | os.PathLike) -> dict[str, Any]:
    """The trace's checked header (the first line only; the rest may still be being written).
    Raises TraceFormatError for a file that is not a trace this version reads, OSError if unreadable."""
    with open_binary(path) as f:
        try:
            line = f.readline()
        except STREAM_DAMAGE:
            line = b""
    return _parse_header(line, path)


def _version(header: dict[str, Any]) -> tuple[int, int]:
    """(major, minor) of a header's "version"; (-1, -1) when it is not "N.M"."""
    try:
        major, minor = (int(x) for x in str(header.get("version", "")).split("."))
    except ValueError:
        return -1, -1
    return major, minor


def _parse_header(line: bytes, path: Any) -> dict[str, Any]:
    try:
        header = decode_line(line)
    except (ValueError, RecursionError):
        header = None
    if header is None and FORMAT.encode() in line:  # it names the format but does not parse: damaged, not foreign
        raise TraceFormatError(
            f"{path}: the trace's header (its first line) is damaged and cannot be read; re-record the trace "
            "(`ac-diff run`), or copy it again from where it was written")
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise TraceFormatError(
            f"{path} is not an ac-diff trace (its first line is not an ac-diff-trace header); "
            "pass a trace written by `ac-diff run`, or use `ac-diff compare` for a log torch printed"
        )
    version = str(header.get("version", ""))
    major, _ = _version(header)
    if major != MAJOR:
        raise TraceFormatError(
            f"{path} is an ac-diff trace of format version {version or '?'}, this ac-diff ({__version__}) reads "
            f"version {MAJOR}.x; {'upgrade ac-diff' if major > MAJOR else 're-record it with this ac-diff'} "
            "(pip install -U ac-diff)"
        )
    damaged = "its checksum does not match" if check_crc(line) is False else next(
        (f"field {key!r} is {header[key]!r}" for key, types in _HEADER_TYPES.items()
         if key in header and header[key] is not None and
         (not isinstance(header[key], types) or (types == (int,) and isinstance(header[key], bool)))), None)
    if damaged:
        raise TraceFormatError(f"{path}: the trace's header is damaged ({damaged}); the file was changed after "
                               "ac-diff wrote it: copy it again from where it was written, or re-record it")
    return header


def read_run(path: str | os.PathLike, lazy: bool = False) -> Run:
    """Read one trace file into the model. Raises TraceFormatError for a file that is not one.

    lazy: leave the ops of an uncompressed file undecoded (`Pass.deferred`: where their lines are) until the
    diagnosis of their region asks for them (`Run.ops_loader`): reading takes a checksum per line, and
    memory holds one region's ops at a time instead of the whole file's. A compressed file is read whole."""
    with open(path, "rb") as f:
        lazy = lazy and f.read(2) != b"\x1f\x8b"
    records = iter_records(path, defer_ops=lazy)
    header = next(records)
    run = Run(source="trace", path=str(path), header=header, rank=header.get("rank"),
              world_size=int(header.get("world_size", 1) or 1), run_id=header.get("run_id"), argv=header.get("argv"),
              start_time=header.get("start_time"), torch_version=header.get("torch"))
    rank = int(header.get("rank", 0) or 0)
    check_errors: list[dict] = []
    regions: dict[int, Region] = {}
    ops: dict[tuple, list[OpRecord]] = {}
    metas: dict[tuple, TensorMeta] = {}
    deferred: dict[tuple, list[tuple[int, int]]] = {}  # lazy: (region, phase, attempt) -> its ops lines
    damage: list[tuple[int, str]] = []  # (line number, why)
    opened: dict[int, int] = {}  # region -> line of its region record
    last_pass: dict[int, int] = {}  # region -> line of its last recompute pass record
    named: set[int] = set()  # regions that records name
    newer = _version(header)[1] > MINOR  # a newer minor may add record types: skip those (NOTE above)
    skipped: dict[str, int] = {}  # unknown record type -> records skipped
    region_lines: list[int] = []  # lines of region, op(s) and pass records
    ended = False
    line = 1
    for line, rec in enumerate(records, start=2):
        kind = rec.get("type")
        if kind in ("region", "op", "ops", "pass"):
            region_lines.append(line)
        try:
            if kind not in RECORD_TYPES and kind != _DAMAGED:
                if newer:
                    skipped[str(kind)] = skipped.get(str(kind), 0) + 1
                else:  # its own version or an older one knows no such record: corrupt
                    damage.append((line, f"a record of unknown type {kind!r} in a format {header.get('version')} trace"))
            elif kind == _DAMAGED:
                damage.append((line, rec.get("why", "")))
            elif kind == "op":
                key = (rec.get("region"), rec.get("phase"), rec.get("attempt", 0))
                ops.setdefault(key, []).append(_op_from_json(rec))
                named.add(key[0])
            elif kind == "ops" and _AT in rec:
                key = (rec["region"], rec["phase"], rec["attempt"])
                ops.setdefault(key, [])
                deferred.setdefault(key, []).append((rec[_AT], line))
                named.add(key[0])
            elif kind == "ops":
                key = (rec.get("region"), rec.get("phase"), rec.get("attempt", 0))
                ops.setdefault(key, []).extend(_ops_from_json(rec, metas))
                named.add(key[0])
            elif kind == "pass":
                _attach_pass(regions, ops, rec, rank, metas, deferred, path, line)
                named.add(rec.get("region"))
                if rec.get("phase") == "recompute":
                    last_pass[rec.get("region")] = line
            elif kind == "region":
                number = rec["region"]
                if not isinstance(number, int):
                    raise TypeError("region number")
                regions[number] = Region(
                    rank=rank, region=number, module=rec.get("module"), kind=rec.get("kind", "checkpoint"),
                    parent=rec.get("parent"), options=dict(rec.get("options", {})),
                    recorded=rec.get("recorded", True) is not False, parent_phase=rec.get("parent_phase"),
                    compiled=list(rec.get("compiled", [])),
                )
                opened[number] = line
            elif kind == "check_error":
                check_errors.append(rec)
            elif kind == "exception":
                run.exc_type, run.exc_message = rec.get("exc_type"), rec.get("message")
            elif kind == "warning":
                run.notes.append(str(rec.get("message", "")))
            elif kind == "end":
                ended = True
                run.exit_status = rec.get("status")
                run.exit_code, run.end_time = rec.get("exit_code"), rec.get("end_time")
        except (KeyError, IndexError, TypeError, ValueError, AttributeError, RecursionError):
            damage.append((line, f"a {kind!r} record with fields of the wrong type"))
    if skipped:
        print(f"ac-diff: warning: {path} is a trace of format {header.get('version')}, this ac-diff ({__version__}) "
              f"reads {VERSION}: skipped {sum(skipped.values())} records of types it does not know "
              f"({', '.join(sorted(skipped))}); upgrade ac-diff (pip install -U ac-diff)", file=sys.stderr)
    for (number, phase, attempt), pending in ops.items():  # ops whose pass record never came: a crash
        region = regions.get(number)
        if region is not None and phase in PHASES:
            p = Pass(phase=phase, ops=pending, complete=False, attempt=attempt,
                     deferred=deferred.get((number, phase, attempt)))
            p.state["cut"] = True  # not "it raised": the trace ends before this pass was written out
            _set_pass(region, p)
    if damage and not ended and damage[-1][0] == line:  # the line a killed process was writing: cut, not damaged
        damage.pop()
    if damage:
        _mark_damaged(run, regions, damage, opened, last_pass, named, region_lines, rank)
    run.regions = sorted(regions.values(), key=lambda r: r.region)
    if lazy:
        run.ops_loader = lambda region: _ops_loaded(path, metas, region)
    from .logs import recorded_errors  # the log parser reads torch's error text (not needed to record)

    run.errors = recorded_errors(run, check_errors)
    if not ended:
        run.truncated = True
        run.notes.append(f"{path} has no end record: the recorded process stopped before ac-diff could finish "
                         "the trace (killed?); everything up to the last completed pass is shown")
    return run


def _decode_deferred(path: Any, p: Pass, metas: dict) -> None:
    """Fill a lazily read pass: its ops, positions and externals, from the lines `p.deferred` names."""
    ops: list[OpRecord] = []
    with open(path, "rb") as f:
        for at, _ in p.deferred:
            f.seek(at)
            rec = decode_line(f.readline())
            if rec.get("type") == "pass":
                p.positions = [_position_from_json(x, metas) for x in rec.get("positions", [])]
                p.externals = [_external_from_json(x) for x in rec.get("externals", [])]
            else:
                ops.extend(_ops_from_json(rec, metas))
    p.ops = ops


@contextlib.contextmanager
def _ops_loaded(path: Any, metas: dict, region: Region) -> Iterator[None]:
    """A lazily read region's ops, positions and externals, decoded for the time of the `with` and dropped
    after. A line that no longer decodes (the file changed since read_run) makes the region damaged."""
    passes = [p for p in (region.forward, region.recompute) if p is not None and p.deferred]
    try:
        for p in passes:
            try:
                _decode_deferred(path, p, metas)
            except (OSError, KeyError, IndexError, TypeError, ValueError, AttributeError, RecursionError):
                region.damaged = region.damaged or (
                    f"line {p.deferred[0][1]} of the trace, written while this region was recorded or just after, "
                    "is damaged (an 'ops' record with fields of the wrong type)")
        yield
    finally:
        for p in passes:
            p.ops, p.positions, p.externals = [], [], []


def _mark_damaged(run: Run, regions: dict[int, Region], damage: list[tuple[int, str]], opened: dict[int, int],
                  last_pass: dict[int, int], named: set, region_lines: list[int], rank: int) -> None:
    """Mark every region a damaged line may have belonged to; add a placeholder for a region whose
    region record was lost; say how many lines were damaged and where."""
    for number in named - regions.keys():
        if isinstance(number, int):
            regions[number] = Region(rank=rank, region=number, module=None, kind="checkpoint",
                                     damaged="its region record is damaged")
    for line, why in damage:
        hit = [number for number, start in opened.items()
               if start < line and (number not in last_pass or last_pass[number] > line)]
        closed = [(end, number) for number, end in last_pass.items() if end < line]
        if closed and not any(max(closed)[0] < other < line for other in region_lines):
            hit.append(max(closed)[1])  # right after a region's recompute: its torch error, the exception
        for number in hit:
            regions[number].damaged = regions[number].damaged or (
                f"line {line} of the trace, written while this region was recorded or just after, is damaged ({why})")
    lines = ", ".join(str(line) for line, _ in damage[:5]) + (" ..." if len(damage) > 5 else "")
    run.damaged = len(damage)
    run.notes.append(f"{run.path}: {len(damage)} damaged line(s) skipped (line {lines}: {damage[0][1]}); the "
                     "regions recorded around them are reported as damaged, not diagnosed")


def _attach_pass(regions: dict[int, Region], ops: dict[tuple, list[OpRecord]], rec: dict, rank: int,
                 metas: dict, deferred: dict[tuple, list[tuple[int, int]]], path: Any, line: int) -> None:
    number = rec.get("region")
    region = regions.get(number)
    if region is None:
        return
    attempt = rec.get("attempt", 0)
    key = (number, rec.get("phase"), attempt)
    lazy = _AT in rec  # positions and externals are decoded with the ops, when the region is diagnosed
    p = Pass(
        phase=rec.get("phase", "forward"), ops=ops.pop(key, []),
        deferred=[*deferred.pop(key, ()), (rec[_AT], line)] if lazy else None,
        positions=[] if lazy else [_position_from_json(x, metas) for x in rec.get("positions", [])],
        externals=[] if lazy else [_external_from_json(x) for x in rec.get("externals", [])],
        state=rec.get("state", {}), complete=bool(rec.get("complete", True)),
        stopped_early=bool(rec.get("stopped_early", False)), attempt=attempt,
        attributes=rec.get("attributes") or {}, attribute_updates=rec.get("attribute_updates") or {},
        values_digest=rec.get("values_digest"),
    )
    if rec.get("error"):
        p.state["error"] = rec["error"]
    if rec.get("ops_written") is False:  # RecordOptions(write="diverged"): a clean region's ops were not kept
        region.ops_written = False
    if lazy and not rec.get("n_ops"):  # only the ops themselves can say how many there were
        _decode_deferred(path, p, metas)
        p.deferred = None
    p.state["n_ops"] = rec.get("n_ops", len(p.ops))
    _set_pass(region, p)


def _set_pass(region: Region, p: Pass) -> None:
    if p.phase == "forward":
        region.forward = p
        return
    region.recomputes = max(region.recomputes, p.attempt + 1)
    if region.recompute is None or p.attempt < region.recompute.attempt:
        # the first recompute is the one torch compares; later ones (retain_graph) are only counted
        region.recompute = p


def _meta(x: Any) -> TensorMeta:
    return TensorMeta.from_json(x)


def _op_from_json(rec: dict) -> OpRecord:
    return OpRecord(
        index=rec.get("i", 0), op=rec.get("op", "?"), module=rec.get("module"), source=rec.get("src"),
        inputs=[_meta(x) for x in rec.get("in", [])], out=[_meta(x) for x in rec.get("out", [])],
        args=rec.get("args", []), input_refs=[InputRef.from_json(r) for r in rec.get("refs", [])],
        fingerprint=rec.get("fp"), host_value=rec.get("host"), values=_values_from_json(rec.get("vals")),
        cached=bool(rec.get("cached", False)), random=bool(rec.get("random", False)),
        discrete=bool(rec.get("discrete", False)), derived=bool(rec.get("derived", False)),
    )


def _ops_from_json(rec: dict, metas: dict | None = None) -> list[OpRecord]:
    """A pass's ops written as one "ops" record (rows of `fields`, strings interned; see encode_ops).
    `metas` interns equal TensorMetas across the passes of one file (frozen: safe to share)."""
    strings = rec.get("strings", [])
    fields = rec.get("fields", [])
    n = len(fields)
    at = {name: i for i, name in enumerate(fields)}
    # a field the record lacks reads the padding slot n, which is always None
    i_op, i_module, i_src, i_in, i_out, i_args, i_refs, i_fp, i_host, i_vals, i_flags = (
        at.get(name, n) for name in ("op", "module", "src", "in", "out", "args", "refs", "fp", "host", "vals", "flags"))
    meta = _meta if metas is None else lambda x: _interned_meta(x, metas)
    out = []
    start = int(rec.get("start", 0) or 0)
    for k, row in enumerate(rec.get("rows", [])):
        row = list(row[:n])
        row.extend([None] * (n + 1 - len(row)))
        flags = row[i_flags] or 0
        refs = []
        for r in row[i_refs] or ():
            if r[0] == "op":
                refs.append(InputRef("op", op_index=r[1], output=r[2] or 0))
            else:
                refs.append(InputRef(r[0], name=r[1], external=r[2]))
        op, module, src = row[i_op], row[i_module], row[i_src]
        out.append(OpRecord(
            index=start + k, op=(strings[op] if op is not None else None) or "?",
            module=strings[module] if module is not None else None, source=strings[src] if src is not None else None,
            inputs=[meta(x) for x in row[i_in] or ()], out=[meta(x) for x in row[i_out] or ()],
            args=row[i_args] or [], input_refs=refs, fingerprint=row[i_fp], host_value=row[i_host],
            values=_values_from_json(row[i_vals]), cached=bool(flags & FLAG_CACHED),
            random=bool(flags & FLAG_RANDOM), discrete=bool(flags & FLAG_DISCRETE),
            derived=bool(flags & FLAG_DERIVED),
        ))
    return out


def _interned_meta(x: Any, metas: dict) -> TensorMeta:
    """TensorMeta.from_json(x), one shared object per distinct meta (a trace repeats a few hundred shapes)."""
    key = (tuple(x[0]), x[1], x[2] if len(x) > 2 else "cpu")
    try:
        found = metas.get(key)
    except TypeError:  # an unhashable field (a damaged line that passed its checksum): not interned
        return _meta(x)
    if found is None:
        found = metas[key] = TensorMeta(*key)
    return found


def _values_from_json(vals: Any) -> Any:
    """Kept values: each is {"dtype", "shape", "b64"} (raw bytes); the first 1.0 traces stored nested lists."""
    if not isinstance(vals, dict) or not any(isinstance(v, dict) for v in vals.values()):
        return vals
    from .capture.fingerprint import decode_values

    out = {}
    for key, v in vals.items():
        try:
            out[key] = decode_values(v)
        except (ValueError, TypeError, RuntimeError):  # a damaged entry costs only that entry
            out[key] = None
    return out


def _position_from_json(x: list, metas: dict) -> Position:
    position, meta, origin, op_index, output, name = (list(x) + [None] * 6)[:6]
    return Position(position=position, meta=_interned_meta(meta, metas) if meta else None, origin=origin or "unknown",
                    op_index=op_index, output=output or 0, name=name)


def _external_from_json(x: dict) -> External:
    return External(index=x.get("i", 0), kind=x.get("kind", "external"), name=x.get("name", "?"),
                    meta=_meta(x["meta"]) if x.get("meta") else TensorMeta((), "?"), fingerprint=x.get("fp"),
                    first_op=x.get("first_op"))


def trace_files(path: str | os.PathLike) -> list[Path]:
    """The trace files in a directory (one per rank), or the file itself."""
    p = Path(path)
    if p.is_dir():
        return sorted(q for q in p.iterdir() if q.is_file() and q.name.startswith("trace") and
                      (q.suffix == ".jsonl" or q.name.endswith(".jsonl.gz")))
    return [p]
