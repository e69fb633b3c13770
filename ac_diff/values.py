"""Kept values as a trace stores them, read back: raw little-endian bytes in base64 -> nested lists.

    decode_values({"dtype": "i64", "shape": [2, 2], "as": "i8", "b64": "AQIDBA=="}) -> [[1, 2], [3, 4]]
    decode_values([[1, 2], [3, 4]])                                                  -> [[1, 2], [3, 4]]
                                                           (format 1.0 traces stored the lists themselves)

`encode_values` (capture/fingerprint.py) writes them: dtype, shape, the bytes, and integers in the
narrowest type that holds them ("as").
"""

from __future__ import annotations

import base64
from typing import Any

import torch

from .dtypes import dtype_from_short


def decode_values(v: Any) -> Any:
    """The inverse of `encode_values` (nested lists, like `.tolist()`); anything else is returned as is
    (format 1.0 traces stored the lists themselves)."""
    if not isinstance(v, dict) or "b64" not in v:
        return v
    dtype = dtype_from_short(v.get("dtype", "f32"))
    stored = dtype_from_short(v["as"]) if v.get("as") else dtype
    shape = tuple(v.get("shape", ()))
    raw = base64.b64decode(v["b64"])
    if not raw:
        return torch.empty(shape, dtype=dtype).tolist()
    values = torch.frombuffer(bytearray(raw), dtype=stored).reshape(shape)
    return (values if stored is dtype else values.to(dtype)).tolist()
