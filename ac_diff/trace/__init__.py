"""The trace file: versioned, self-describing JSON Lines (optionally gzip), streamed and flushed per pass.

    writer = TraceWriter("ac-diff-out/trace-rank0.jsonl", default_header(options))
    writer.write(encode_ops(0, "forward", 0, ops, fps, vals, cached, nonfinite=False))
    writer.close({"type": "end", "status": "ok", "exit_code": 0})
    read_run("ac-diff-out/trace-rank0.jsonl") -> Run(source="trace", regions=[Region(forward=Pass(...)), ...])

One module per job; the format itself (its records, version history, integrity rules and NOTEs) is
specified in format.py:

    format.py   FORMAT, VERSION, MAJOR/MINOR, RECORD_TYPES, the op flags, TraceFormatError, default_header
    lines.py    one line: a record's JSON bytes with its CRC-32 (with_crc, check_crc, decode_line)
    encode.py   a pass's ops as one "ops" record (encode_ops), a tensor's meta as written (written_meta)
    writer.py   TraceWriter: appends records, flushed per pass, optionally from a background thread
    reader.py   a file back into `ac_diff.passes.Run` (read_run, read_header, iter_records, trace_files)

It uses nothing of ac_diff.capture (the dtype spellings are ac_diff.dtypes, kept values ac_diff.values).
"""

from .encode import encode_ops, written_meta
from .format import (FLAG_CACHED, FLAG_DERIVED, FLAG_DISCRETE, FLAG_RANDOM, FORMAT, MAJOR, MINOR, OPS_FIELDS,
                     RECORD_TYPES, VERSION, TraceFormatError, default_header, merge_read)
from .lines import check_crc, decode_line, with_crc
from .reader import _ops_from_json, is_trace, iter_records, open_text, read_header, read_run, trace_files
from .writer import TraceWriter

# `_ops_from_json` too: tests decode hand-built "ops" records with it

__all__ = [
    "FLAG_CACHED", "FLAG_DERIVED", "FLAG_DISCRETE", "FLAG_RANDOM", "FORMAT", "MAJOR", "MINOR", "OPS_FIELDS",
    "RECORD_TYPES", "VERSION", "TraceFormatError", "TraceWriter", "check_crc", "decode_line", "default_header",
    "encode_ops", "is_trace", "iter_records", "merge_read", "open_text", "read_header", "read_run", "trace_files",
    "with_crc", "written_meta",
]
