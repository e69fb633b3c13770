"""One LoggingTensor op line (what `checkpoint(debug=True)` lists) -> ParsedOp.

torch writes each op as `f"{outputs} = {func.__module__}.{func.__name__}({args})"`
(torch/testing/_internal/logging_tensor.py), and in the stack-trace sections adds
`"   ({i} of {n} in original|recompute)"`:

    parse_op_line("$1: bf16[1, 128, 5120] = torch._ops.aten.view.default($0, ['1', '128', '5120'])")
        -> ParsedOp(op="aten.view.default", out=[TensorMeta((1, 128, 5120), "bf16", "unknown")],
                    out_ids=["$1"], args=["$0", [1, 128, 5120]], in_ids=["$0"], status=OK)
    parse_op_line("('$159: f32[128, 1]', '$160: i64[128, 1]') = torch._ops.aten.topk.default($158, 1, 1)")
        -> op="aten.topk.default", out_ids=["$159", "$160"], args=["$158", 1, 1]
    parse_op_line("$5: f32[1] = torch._ops.aten.exp.default($4)   (2 of 9 in original)")
        -> ..., ordinal=(2, 9, "original")   (and in a flattened log, what follows the suffix is
                                              kept in `trailing`: that op's stack frames)
    parse_op_line("$124: bf16[1, 128, 5120] = t5120]', '$192: bf16[33, 5120]'] = "
                  "torch._ops.aten.split_with_sizes.default($181, ['14', '99'])")
        -> op="aten.split_with_sizes.default", out_ids=["$192"], status=SALVAGED
           (a line spliced by another writer: the call is whole, only some outputs survived)
    parse_op_line("$93: f32[1, 5] = torch._opsat32)")        -> ParsedOp(status=GARBLED)

`looks_like_op(text)` says whether a segment was meant to be an op line, so that one that fails to
parse is counted as garbled rather than ignored. Argument values: see `args.parse_args`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from ac_diff.logs.args import parse_args, scalar
from ac_diff.logs.meta import UNKNOWN_DEVICE, parse_shape
from ac_diff.passes import TensorMeta

OK, SALVAGED, GARBLED = "ok", "salvaged", "garbled"

_CALL = " = torch._ops."
# An OpOverload is always namespace.name.overload: "aten.view.default", "_c10d_functional.wait_tensor.default".
_OP_NAME = re.compile(r"[A-Za-z_]\w*\.[A-Za-z_]\w*\.[A-Za-z_]\w*\Z")
_ORDINAL = re.compile(r"\s+\((\d+) of (\d+) in (\w+)[^()]*\)")
_OUT = re.compile(r"\$(\d+): ([a-z][a-z0-9]*)\[([^\]]*)\]")
_SINGLE_OUT = re.compile(r"\$\d+: [a-z][a-z0-9]*\[[^\]]*\]\Z")
_OP_START = re.compile(r"\$\d+: [a-z][a-z0-9]*\[|[\[(]'\$\d+: ")


@dataclass(slots=True)
class ParsedOp:
    """An op line as read; `status` says whether it was whole (OK), partly recovered, or lost."""

    op: str = ""
    out: list[TensorMeta] = field(default_factory=list)
    out_ids: list[str] = field(default_factory=list)
    args: list[Any] = field(default_factory=list)
    in_ids: list[str] = field(default_factory=list)
    host_value: Any = None  # a non-tensor result (e.g. of aten._local_scalar_dense)
    ordinal: tuple[int, int, str] | None = None  # (i, n, "original"|"recompute") from sections 1/2
    status: str = OK
    trailing: str = ""  # text after the "(i of n in ...)" suffix: the op's frames, in a flattened log

    @property
    def key(self) -> tuple:
        """What identifies the same op printed twice (in the stack-trace and the op-list sections)."""
        return (self.op, tuple(self.out_ids), tuple(self.in_ids))


def looks_like_op(text: str) -> bool:
    """True for a segment that was meant to be an op line (whole or damaged)."""
    return "_ops." in text or (text[:1] in "$[(" and _OP_START.match(text) is not None)


_META_CACHE: dict[tuple[str, str], TensorMeta | None] = {}  # TensorMeta is frozen: safe to share


def _meta(dtype: str, dims: str) -> TensorMeta | None:
    key = (dtype, dims)
    meta = _META_CACHE.get(key, False)
    if meta is False:
        shape = parse_shape(dims)
        meta = TensorMeta(shape, dtype, UNKNOWN_DEVICE) if shape is not None else None
        if len(_META_CACHE) > 50_000:
            _META_CACHE.clear()
        _META_CACHE[key] = meta
    return meta  # type: ignore[return-value]


def _outputs(lhs: str) -> tuple[list[TensorMeta], list[str], bool]:
    """Outputs from the text left of ` = `: (metas, ids, whole)."""
    metas: list[TensorMeta] = []
    ids: list[str] = []
    whole = True
    for n, dtype, dims in _OUT.findall(lhs):
        meta = _meta(dtype, dims)
        if meta is None:
            whole = False
            continue
        metas.append(meta)
        ids.append("$" + n)
    return metas, ids, whole


def _lhs_is_whole(lhs: str, n_outs: int) -> bool:
    """Is the output text one well-formed value (a tensor, a container of them, or a scalar)?"""
    if n_outs == 0:
        return "$" not in lhs and "=" not in lhs and "'" not in lhs[:1]
    if n_outs == 1 and _SINGLE_OUT.match(lhs):
        return True
    if lhs[:1] not in "[(" or lhs[-1:] not in "])":
        return False
    # every output inside a container is quoted ('$N: f32[...]'); brackets pair up
    return (lhs.count("'$") == n_outs and lhs.count("$") == n_outs
            and lhs.count("[") == lhs.count("]") and lhs.count("(") == lhs.count(")"))


def _call(text: str) -> tuple[str, str, bool] | None:
    """`aten.view.default($0, [...])` -> ("aten.view.default", "$0, [...]", closed)."""
    paren = text.find("(")
    if paren <= 0:
        return None
    name = text[:paren]
    if not _OP_NAME.match(name):
        return None
    inner = text[paren + 1:]
    closed = inner.endswith(")")
    return name, (inner[:-1] if closed else inner), closed


def parse_op_line(text: str) -> ParsedOp:
    """Parse one segment (prefixes already stripped); never raises."""
    try:
        return _parse(text)
    except Exception:  # noqa: BLE001 - damaged input must never escape as an exception
        return ParsedOp(status=GARBLED)


def _parse(text: str) -> ParsedOp:
    text = text.strip()
    ordinal = None
    trailing = ""
    if " of " in text:
        m = _ORDINAL.search(text)
        if m:
            ordinal = (int(m.group(1)), int(m.group(2)), m.group(3))
            trailing = text[m.end():].strip()
            text = text[:m.start()]
    op = _parse_call(text, ordinal)
    op.trailing = trailing
    return op


def _parse_call(text: str, ordinal: tuple[int, int, str] | None) -> ParsedOp:
    at = text.find(_CALL)
    if at < 0:
        return ParsedOp(status=GARBLED)
    lhs, rest = text[:at], text[at + len(_CALL):]
    call = _call(rest)
    if call is not None and " = " not in lhs:
        name, arg_text, closed = call
        metas, ids, outs_whole = _outputs(lhs)
        if closed and outs_whole and _lhs_is_whole(lhs, len(ids)):
            args = parse_args(arg_text)
            if args.complete:
                host = None if ids else scalar(lhs, [])
                return ParsedOp(name, metas, ids, args.values, args.tensor_ids, host, ordinal, OK)
    return _salvage(text, ordinal)


def _salvage(text: str, ordinal: tuple[int, int, str] | None) -> ParsedOp:
    """A line spliced with another writer's output: keep the call that survived and its outputs.

    The call is the last ` = torch._ops.` in the line; outputs are the `$N: dtype[...]` left of it
    and right of any earlier ` = ` (which belonged to the line that was cut). Arguments are kept up
    to the damage.
    """
    at = text.rfind(_CALL)
    call = _call(text[at + len(_CALL):])
    if call is None:
        return ParsedOp(status=GARBLED)
    name, arg_text, closed = call
    lhs = text[:at]
    eq = lhs.rfind(" = ")
    if eq >= 0:
        lhs = lhs[eq + 3:]
    metas, ids, _ = _outputs(lhs)
    args = parse_args(arg_text, closed)
    if not ids and not args.values:
        return ParsedOp(status=GARBLED)
    return ParsedOp(name, metas, ids, args.values, args.tensor_ids, None, ordinal, SALVAGED)
