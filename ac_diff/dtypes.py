"""The short dtype spellings of traces and reports, both ways.

    short_dtype(torch.float32)          -> "f32"
    short_dtype(torch.float8_e4m3fnuz)  -> "float8_e4m3fnuz"  (no short name: torch's own, without "torch.")
    dtype_from_short("bf16")            -> torch.bfloat16

The recorder writes them (capture/), the trace encodes and decodes with them (trace/, values.py).
"""

from __future__ import annotations

import torch

_SHORT_DTYPES = {
    torch.float32: "f32", torch.float64: "f64", torch.float16: "f16", torch.bfloat16: "bf16",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
    torch.bool: "b8", torch.complex64: "c64", torch.complex128: "c128",
}
for _name, _short in (("float8_e4m3fn", "f8e4m3fn"), ("float8_e5m2", "f8e5m2"), ("uint16", "u16"),
                      ("uint32", "u32"), ("uint64", "u64")):
    if hasattr(torch, _name):
        _SHORT_DTYPES[getattr(torch, _name)] = _short


def short_dtype(dtype: torch.dtype) -> str:
    short = _SHORT_DTYPES.get(dtype)
    return short if short is not None else str(dtype).replace("torch.", "")


_FROM_SHORT = {short: dtype for dtype, short in _SHORT_DTYPES.items()}


def dtype_from_short(name: str) -> torch.dtype:
    """The inverse of `short_dtype`: "f32" -> torch.float32, "float8_e4m3fnuz" -> torch.float8_e4m3fnuz."""
    dtype = _FROM_SHORT.get(name)
    if dtype is None:
        dtype = getattr(torch, name, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown dtype {name!r}")
    return dtype


def carries_gradient(name: str) -> bool:
    """Whether a tensor of the short dtype `name` can carry a gradient (floating point or complex); an unknown
    spelling counts as one that can."""
    try:
        dtype = dtype_from_short(name)
    except ValueError:
        return True
    return dtype.is_floating_point or dtype.is_complex


def computes_in_float32(names: list[str]) -> bool:
    """Whether an op on tensors of these short dtypes computes in float32 at most: a floating tensor among them, none
    wider than 32 bits (f32, bf16, f16, fp8; not f64, not complex). Such a kernel casts a Python float argument to
    float32 (a scalar's compute type: `x / 0.1` computes with float32(0.1))."""
    floating = []
    for name in names:
        try:
            dtype = dtype_from_short(name)
        except ValueError:
            return False
        if dtype.is_complex or dtype.is_floating_point and dtype.itemsize > 4:
            return False
        if dtype.is_floating_point:
            floating.append(dtype)
    return bool(floating)
