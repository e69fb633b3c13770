"""The trace reader: a trace file back into the model of a run (`ac_diff.passes.Run`).

    read_run("ac-diff-out/trace-rank0.jsonl")
    -> Run(source="trace", rank=0, regions=[Region(region=0, module="layers.0", forward=Pass(ops=[OpRecord(...),
       ...]), recompute=Pass(...)), ...], truncated=False, damaged=0, notes=[...])
    read_run(path, lazy=True)            # ops left undecoded until `run.ops_loader(region)` asks for them
    read_header(path) -> {"type": "header", "format": "ac-diff-trace", "version": "1.4", "rank": 0, ...}
    iter_records(path)                   # the header, then each record ({"type": "_damaged", ...} where damaged)
    trace_files("ac-diff-out")           # [.../trace-rank0.jsonl, .../trace-rank1.jsonl]

What a damaged line, a cut file or a newer version does to the result: format.py (Integrity, NOTE
[versions and record types]).
"""

from __future__ import annotations

import contextlib
import io
import os
import platform
import re
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

from .._version import __version__
from ..passes import (External, InputRef, OpRecord, Pass, Position, Region, Run, TensorMeta, PHASES)
from ..streams import STREAM_DAMAGE, open_binary
from ..values import decode_values
from .format import (FLAG_CACHED, FLAG_DERIVED, FLAG_DISCRETE, FLAG_RANDOM, FORMAT, MAJOR, MINOR, RECORD_TYPES,
                     VERSION, TraceFormatError, merge_read)
from .lines import check_crc, decode_line


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
_STREAM_CUT = "the compressed stream is damaged or cut short here"


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
                yield {"type": _DAMAGED, "why": _STREAM_CUT}
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
    "rank": (int,), "world_size": (int,), "local_rank": (int,), "local_world_size": (int,), "pid": (int,),
    "restart": (int,),
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
    started = None  # regions the recorder began (the end record's count)
    inputs_written: list[tuple] = []  # the exception record's (Region.inputs_written)
    # "unpacked" records: region -> the saved positions a backward read -> None, or (node, the gradients it computed)
    unpacked: dict[int, dict[int, tuple[str, frozenset[int]] | None]] = {}
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
                    compiled=list(rec.get("compiled", [])), watched=rec.get("watched") is True,
                    step=rec.get("step") if isinstance(rec.get("step"), int) else None,
                    function=rec.get("function") if isinstance(rec.get("function"), str) else None,
                    optimizer_steps=rec.get("optimizer_steps") if isinstance(rec.get("optimizer_steps"), int) else 0,
                )
                opened[number] = line
            elif kind == "watch":
                earlier = (run.watch or {}).get("escalated", {})
                run.watch = {"step": int(rec.get("step") or 0), "full_from_step": rec.get("full_from_step"),
                             "full_steps": int(rec.get("full_steps") or 0),
                             "resample_every": int(rec.get("resample_every") or 0),
                             "resampled": {str(k): int(v) for k, v in dict(rec.get("resampled") or {}).items()},
                             "modules": {str(k): ([int(x) for x in v] + [0] * 6)[:6]  # (older: 3, 5)
                                         for k, v in dict(rec["modules"]).items()},
                             "escalated": {**earlier, **{str(k): dict(v) for k, v in
                                                         dict(rec.get("escalated") or {}).items()}}}
            elif kind == "escalate":  # also in the next "watch" record; this one survives a killed process
                watch = run.watch = run.watch or {"step": 0, "full_from_step": None, "full_steps": 0, "modules": {},
                                                  "escalated": {}}
                watch["escalated"][str(rec["module"])] = {k: rec.get(k) for k in ("diverged_step", "region", "from_step",
                                                                                  "why", "reentrant")}
            elif kind == "unpacked":
                _merge_reads(unpacked.setdefault(int(rec["region"]), {}), rec)
            elif kind == "check_error":
                check_errors.append(rec)
            elif kind == "exception":
                run.exc_type, run.exc_message = rec.get("exc_type"), rec.get("message")
                run.exc_in_backward = rec.get("in_backward") is True
                run.exc_in_checkpoint = rec.get("in_checkpoint") is True
                run.exc_step = rec["step"] if isinstance(rec.get("step"), int) else None
                inputs_written = [(int(r[0]), int(r[1]), TensorMeta.from_json(r[2]), int(r[3]), int(r[4]))
                                  for r in rec.get("inputs_changed") or ()]
            elif kind == "warning":
                run.notes.append(str(rec.get("message", "")))
            elif kind == "end":
                ended = True
                run.exit_status = rec.get("status")
                started = rec.get("regions")
                run.exit_code, run.end_time = rec.get("exit_code"), rec.get("end_time")
                steps = rec.get("optimizer_steps")
                run.optimizer_steps = steps if isinstance(steps, int) else None
                run.spawned = rec.get("spawned") if isinstance(rec.get("spawned"), int) else 0
                run.recorder_lost = rec.get("lost")
                run.compiled = rec.get("compiled") if isinstance(rec.get("compiled"), dict) else None
        except (KeyError, IndexError, TypeError, ValueError, AttributeError, RecursionError):
            damage.append((line, f"a {kind!r} record with fields of the wrong type"))
    if newer:  # read as far as this reader knows the format: say so even when nothing was skipped
        what = (f"skipped {sum(skipped.values())} records of types it does not know ({', '.join(sorted(skipped))})"
                if skipped else "what the newer format added may be missing from the report")
        newer_note = (f"{path} is a trace of format {header.get('version')}, this ac-diff ({__version__}) reads "
                      f"{VERSION}: {what}; upgrade ac-diff (pip install -U ac-diff)")
        print(f"ac-diff: warning: {newer_note}", file=sys.stderr)
        run.notes.append(newer_note)  # (the JSON report says it too: a CI job reads no stderr)
    for (number, phase, attempt), pending in ops.items():  # ops whose pass record never came: a crash
        region = regions.get(number)
        if region is not None and phase in PHASES:
            p = Pass(phase=phase, ops=pending, complete=False, attempt=attempt,
                     deferred=deferred.get((number, phase, attempt)))
            p.state["cut"] = True  # not "it raised": the trace ends before this pass was written out
            _set_pass(region, p)
    stream_cut = bool(damage) and not ended and damage[-1][1] == _STREAM_CUT
    if damage and not ended and damage[-1][0] == line:  # the line a killed process was writing: cut, not damaged
        damage.pop()
    if damage:
        _mark_damaged(run, regions, damage, opened, last_pass, named, region_lines, rank)
    for number, reads in unpacked.items():
        if number in regions:
            regions[number].unpacked = set(reads)
            regions[number].partial_reads = {p: read for p, read in reads.items() if read is not None}
    for number, *entry in inputs_written:
        if number in regions:
            regions[number].inputs_written.append(tuple(entry))
    if ended and run.exit_status in ("exception", "interrupted") and run.watch is None and isinstance(started, int):
        for number in range(started):  # begun as the run stopped, before anything of them was written
            if number not in regions:
                regions[number] = Region(rank=rank, region=number, module=None)
    if (header.get("options") or {}).get("fingerprints") is False:  # watch compares saved tensors without them
        for region in regions.values():
            region.values_recorded = region.watched
    run.regions = sorted(regions.values(), key=lambda r: r.region)
    if lazy:
        run.ops_loader = lambda region: _ops_loaded(path, metas, region)
    from ..logs import recorded_errors  # the log parser reads torch's error text (not needed to record)

    run.errors = recorded_errors(run, check_errors)
    if not ended:
        run.truncated = True
        run.running = _still_running(header)
        run.notes.append(f"{path} has no end record" + (
            ", and its compressed stream is cut short: the recorded process was killed while writing it, or the file "
            "is an incomplete copy (copy it again)" if stream_cut else
            f" yet: its process (pid {header.get('pid')} on this host) is still running" if run.running else
            ": the recorded process stopped before ac-diff could finish the trace (killed?)")
            + "; everything up to the last completed pass is shown")
    return run


def _still_running(header: dict) -> bool | None:
    """Whether the process that writes this trace is alive: its pid on this host (the header's), running Python."""
    pid = header.get("pid")
    if not isinstance(pid, int) or pid == os.getpid() or header.get("host") != platform.node():
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return None
    try:
        return b"python" in Path(f"/proc/{pid}/cmdline").read_bytes()  # (not a later process given the same pid)
    except OSError:
        return None


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
    passes = [p for p in (region.forward, region.recompute, *region.later) if p is not None and p.deferred]
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
        globals=rec.get("globals") or {}, global_readers=rec.get("global_readers") or {},
        global_updates=rec.get("global_updates") or {},
        values_digest=rec.get("values_digest"),
        outputs=_outputs_from_json(rec.get("outputs")),
    )
    if rec.get("error"):
        p.state["error"] = rec["error"]
    if rec.get("lost"):  # the recorder failed inside this pass (format 1.4)
        p.state["lost"] = rec["lost"]
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
    passes = {q.attempt: q for q in (region.recompute, *region.later) if q is not None}
    passes[p.attempt] = p
    first, *region.later = [passes[a] for a in sorted(passes)]
    region.recompute = first


def _meta(x: Any) -> TensorMeta:
    return TensorMeta.from_json(x)


def _op_from_json(rec: dict) -> OpRecord:
    return OpRecord(
        index=rec.get("i", 0), op=rec.get("op", "?"), module=rec.get("module"), source=rec.get("src"),
        inputs=[_meta(x) for x in rec.get("in", [])], out=[_output(x, _meta) for x in rec.get("out", [])],
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
            inputs=[meta(x) for x in row[i_in] or ()], out=[_output(x, meta) for x in row[i_out] or ()],
            args=row[i_args] or [], input_refs=refs, fingerprint=row[i_fp], host_value=row[i_host],
            values=_values_from_json(row[i_vals]), cached=bool(flags & FLAG_CACHED),
            random=bool(flags & FLAG_RANDOM), discrete=bool(flags & FLAG_DISCRETE),
            derived=bool(flags & FLAG_DERIVED),
        ))
    return out


def _output(x: Any, meta: Callable[[Any], TensorMeta]) -> Any:
    """One entry of an op's "out" (NOTE [op outputs]): a tensor's meta, or the non-tensor return as written."""
    return meta(x) if type(x) is list else x


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
    out = {}
    for key, v in vals.items():
        try:
            out[key] = decode_values(v)
        except (ValueError, TypeError, RuntimeError):  # a damaged entry costs only that entry
            out[key] = None
    return out


def _merge_reads(reads: dict[int, tuple[str, frozenset[int]] | None], rec: dict) -> None:
    """One "unpacked" record into a region's reads: a position some backward read for all of its node's gradients
    stays so; one read for some of them only (`partial`: [position, node, [gradients]]) adds those."""
    partial = {}
    for entry in rec.get("partial") or ():
        if isinstance(entry, list) and len(entry) == 3 and isinstance(entry[2], list):
            partial[int(entry[0])] = (str(entry[1]), frozenset(int(i) for i in entry[2]))
    for p in map(int, rec["positions"]):
        merge_read(reads, p, partial.get(p))


def _position_from_json(x: list, metas: dict) -> Position:
    position, meta, origin, op_index, output, name, fingerprint, view = (list(x) + [None] * 8)[:8]
    return Position(position=position, meta=_interned_meta(meta, metas) if meta else None, origin=origin or "unknown",
                    op_index=op_index, output=output or 0, name=name, fingerprint=fingerprint, view=view)


def _outputs_from_json(x: Any) -> list[tuple[int, int]] | None:
    """A forward's `outputs` ([[op index, output], ...], format 1.4), or None where the trace has none."""
    return [tuple(o) for o in x if isinstance(o, list) and len(o) == 2] if isinstance(x, list) else None


def _external_from_json(x: dict) -> External:
    return External(index=x.get("i", 0), kind=x.get("kind", "external"), name=x.get("name", "?"),
                    meta=_meta(x["meta"]) if x.get("meta") else TensorMeta((), "?"), fingerprint=x.get("fp"),
                    first_op=x.get("first_op"), made_by=_pair(x.get("made_by")), versions=_pair(x.get("versions")),
                    obj=x.get("obj") if isinstance(x.get("obj"), int) else None,
                    made_in=x.get("made_in") if isinstance(x.get("made_in"), int) else None,
                    requires_grad=x.get("rg") if isinstance(x.get("rg"), bool) else None, graph=x.get("graph") is True)


def _pair(value: Any) -> tuple[int, int] | None:
    return (int(value[0]), int(value[1])) if isinstance(value, list) and len(value) == 2 else None


def trace_files(path: str | os.PathLike) -> list[Path]:
    """The trace files in a directory (one per rank), or the file itself."""
    p = Path(path)
    if p.is_dir():
        return sorted(q for q in p.iterdir() if q.is_file() and q.name.startswith("trace") and
                      (q.suffix == ".jsonl" or q.name.endswith(".jsonl.gz")))
    return [p]
