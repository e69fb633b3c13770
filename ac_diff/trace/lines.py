"""One line of a trace: a record's JSON bytes with its CRC-32 as the last field, and back (format 1.1+).

    with_crc(b'{"type":"end"}')                    -> b'{"type":"end","crc":1418195717}'
    check_crc(b'{"type":"end","crc":1418195717}')  -> True (False: damaged; None: no checksum, a 1.0 line)
    decode_line(b'{"type":"end"}')                 -> {"type": "end"}
    fast_encode({"type": "end"})                   -> b'{"type":"end"}' (None where only json can write it)

orjson encodes and decodes where it can (`orjson` is None without it, or where a test sets it so); json
writes and reads the same lines.
"""

from __future__ import annotations

import json
import zlib
from typing import Any

try:  # ~10x faster than json for the per-pass records; optional (json writes the same lines)
    import orjson
except ImportError:  # pragma: no cover - orjson is a dependency; json is the fallback
    orjson = None


def _json_default(o: Any) -> Any:
    return list(o) if isinstance(o, tuple) else str(o)  # tuple subclasses (torch.Size) as json writes them


def fast_encode(record: Any) -> bytes | None:
    """orjson's bytes for `record`, or None where only json can write it (no orjson, ints over 64 bits,
    lone surrogates): the caller then uses json. Non-finite floats must not get here (see `TraceWriter.write`)."""
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
