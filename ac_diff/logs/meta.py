"""Tensor metadata as torch prints it (dtypes, shapes, devices, metadata dicts) -> TensorMeta.

No torch import: the spellings are copied from torch (`torch/utils/_dtype_abbrs.py`) and a test
checks the table against the installed torch.

    short_dtype("torch.bfloat16")                      -> "bf16"
    parse_device("device(type='xpu', index=1)")        -> "xpu:1"
    parse_metadata("{'shape': torch.Size([99, 5120]), 'dtype': torch.bfloat16, "
                   "'device': device(type='xpu', index=1)}")
        -> MetaParse(TensorMeta((99, 5120), "bf16", "xpu:1"), complete=True)
    parse_metadata("{'shape': torch.Size([105, 8192]), 'dtype': torch.bfloat16, 'device': dev")
        -> MetaParse(TensorMeta((105, 8192), "bf16", "unknown"), complete=False)
    parse_metadata("{'shape': torch.Size([964, 5120]),")   -> MetaParse(None, complete=False)
    parse_shape("1, 128, 5120")                        -> (1, 128, 5120)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ac_diff.logs.memo import short_text_memo
from ac_diff.passes import TensorMeta

UNKNOWN_DEVICE = "unknown"  # op lines in a debug dump do not say where a tensor lives

# torch.utils._dtype_abbrs.dtype_abbrs, keyed by the name after "torch.", plus the aliases that
# str(dtype) never prints but users paste (torch.float, torch.half, ...).
DTYPE_ABBRS: dict[str, str] = {
    "uint8": "u8", "int8": "i8", "int16": "i16", "int32": "i32", "int64": "i64",
    "float16": "f16", "float32": "f32", "float64": "f64",
    "complex32": "c32", "complex64": "c64", "complex128": "c128",
    "bool": "b8", "bfloat16": "bf16",
    "bits1x8": "b1x8", "bits2x4": "b2x4", "bits4x2": "b4x2", "bits8": "b8x1", "bits16": "b16x1",
    "float8_e5m2": "f8e5m2", "float8_e4m3fn": "f8e4m3fn", "float8_e5m2fnuz": "f8e5m2fnuz",
    "float8_e4m3fnuz": "f8e4m3fnuz", "float8_e8m0fnu": "f8e8m0fnu", "float4_e2m1fn_x2": "f4e2m1fnx2",
    "uint16": "u16", "uint32": "u32", "uint64": "u64",
    "bcomplex32": "bc32",  # torch >= 2.14
}
_DTYPE_ALIASES = {
    "float": "f32", "double": "f64", "half": "f16", "long": "i64", "int": "i32", "short": "i16",
    "cfloat": "c64", "cdouble": "c128", "chalf": "c32",
}


def short_dtype(name: str) -> str:
    """`torch.bfloat16` or `bfloat16` -> `bf16`; an unknown name is returned without `torch.`."""
    name = name.strip()
    if name.startswith("torch."):
        name = name[6:]
    return DTYPE_ABBRS.get(name) or _DTYPE_ALIASES.get(name) or name


INT = re.compile(r"-?\d+\Z")


def parse_shape(dims: str) -> tuple | None:
    """`1, 128, 5120` -> (1, 128, 5120); `` -> (); symbolic dims (`s0`) stay strings.

    None when the text is not a clean comma-separated list (a cut or spliced shape).
    """
    dims = dims.strip()
    if not dims:
        return ()
    out = []
    for d in dims.split(","):
        d = d.strip()
        if INT.match(d):
            out.append(int(d))
        elif d.isidentifier():  # a SymInt printed by name
            out.append(d)
        else:
            return None
    return tuple(out)


_DEVICE = re.compile(r"device\(type='([\w-]+)'(?:, index=(\d+))?\)")


def parse_device(text: str) -> str | None:
    """`device(type='xpu', index=1)` -> `xpu:1`, `device(type='cpu')` -> `cpu`; None if absent."""
    m = _DEVICE.search(text)
    if not m:
        return None
    return f"{m.group(1)}:{m.group(2)}" if m.group(2) is not None else m.group(1)


@dataclass(slots=True)
class MetaParse:
    """A metadata dict read from a log: what could be read, and whether the dict was whole."""

    meta: TensorMeta | None
    complete: bool


_META_SHAPE = re.compile(r"'shape': torch\.Size\(\[([^\]]*)\]\)")
_META_DTYPE = re.compile(r"'dtype': torch\.(\w+)(?=[,}])")  # a cut name (`torch.b`) does not count


def parse_metadata(text: str) -> MetaParse:
    """Read torch's `_default_meta_extractor` dict (see the module docstring for examples).

    The dict holds no nested braces, so it ends at the first `}`. Shape and dtype are needed for a
    TensorMeta; a device that was cut off reads as UNKNOWN_DEVICE. `complete` is False when the dict
    was cut or garbled, even if a TensorMeta could still be read from it.
    """
    start = text.find("{")
    if start < 0:
        return MetaParse(None, False)
    end = text.find("}", start)
    body = text[start:end + 1] if end >= 0 else text[start:]
    shape_m = _META_SHAPE.search(body)
    dtype_m = _META_DTYPE.search(body)
    shape = parse_shape(shape_m.group(1)) if shape_m else None
    device = parse_device(body)
    complete = end >= 0 and shape is not None and dtype_m is not None and device is not None
    if shape is None or dtype_m is None:
        return MetaParse(None, False)
    return MetaParse(TensorMeta(shape, short_dtype(dtype_m.group(1)), device or UNKNOWN_DEVICE), complete)


# parse_metadata of a dict text seen before (a repeated error): the same MetaParse, read once
parse_metadata_cached = short_text_memo(parse_metadata)
