"""Short human labels for ops, tensors and argument differences, shared by every part of a report.

    op_label(op)                  -> "aten.topk.default -> f32[512, 2], i64[512, 2]"
    module_label("1")             -> "module `1`" (a Sequential's child; "layers.1" stays as it is)
    backticked(["a", "b"])        -> "`a`, `b`" (four, then "and 2 more")
    list_diff([14, 99, 71], [14, 98, 71]) -> "[14, 99→98, 71]"
    fingerprint_pair((1.0000001, 2.0), (1.0000002, 2.0)) -> ("(1.0000001, 2)", "(1.0000002, 2)")
"""

from __future__ import annotations

import re
from typing import Any

from ..passes import OpRecord, Region, TensorMeta, exact_print, op_at
from ..report import Divergence

# a Python object the recorder could only write as its repr: "<torch._C.Generator object at 0x7f..>"
_OBJECT_REPR = re.compile(r"<([\w.]+) object at 0x[0-9a-fA-F]+>")


def backticked(names: list[str], limit: int = 4) -> str:
    """The first `limit` names in backticks, and how many more: "`a`, `b`, `c`, `d` and 2 more"."""
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(f"`{n}`" for n in names[:limit]) + more


def fingerprint_pair(a, b) -> tuple[str, str]:
    """Two fingerprints printed with the fewest digits (6 at least) that tell them apart: an EMA step of 0.4% still
    reads as a change."""
    if exact_print(a) and exact_print(b):  # (the pairs where they differ; where only the bits do, those too)
        a, b = (a[:2], b[:2]) if a[:2] != b[:2] else ([*a[:2], f"bits {a[2]}"], [*b[:2], f"bits {b[2]}"])
    pair = _fingerprint(a), _fingerprint(b)
    for digits in range(7, 18):
        if pair[0] != pair[1]:
            break
        pair = _fingerprint(a, digits), _fingerprint(b, digits)
    return pair


def changed_line(change: dict, a: str, b: str) -> str:
    """One line of evidence for a changed tensor (`state_changes`' item), its fingerprints under keys `a` and `b`:
    "param `w` f32[4]: fingerprint (1, 2) in forward, (1, 3) in recompute"."""
    pa, pb = fingerprint_pair(change[a], change[b])
    name = {"run_a": "run A", "run_b": "run B"}
    return (f"{change['kind']} `{change['name']}` {change['meta']}: fingerprint {pa} in {name.get(a, a)}, "
            f"{pb} in {name.get(b, b)}")


def _fingerprint(fp, digits: int = 6) -> str:
    if not fp:
        return "?"
    return "(" + ", ".join(f"{x:.{digits}g}" if isinstance(x, float) else str(x) for x in fp) + ")"


def module_label(fqn: str) -> str:
    """A module's name in a sentence: a bare Sequential child's index ("1", "0.2") reads as a number, so it is named
    as a module (module `1`); any other FQN as it is."""
    return f"module `{fqn}`" if fqn and all(part.isdigit() for part in fqn.split(".")) else fqn


def readable_arg(a: Any) -> Any:
    """An argument as a person reads it and as two passes compare it: an object's address is dropped
    ("<torch._C.Generator object at 0x7f..>" -> "torch.Generator"), lists and dicts are walked."""
    if isinstance(a, str) and " object at 0x" in a:
        return _OBJECT_REPR.sub(lambda m: m.group(1).replace("torch._C.", "torch."), a)
    if isinstance(a, list):
        return [readable_arg(x) for x in a]
    if isinstance(a, dict):
        return {k: readable_arg(v) for k, v in a.items()}
    return a


def metas(items: list[TensorMeta]) -> str:
    return ", ".join(str(m) for m in items) or "()"


def op_label(op: OpRecord | None, with_args: bool = False) -> str | None:
    if op is None:
        return None
    text = op.op
    if with_args:
        shown = [a for a in op.args if not (isinstance(a, str) and a.startswith("$"))]
        if shown:
            text += "(" + ", ".join(_short(a) for a in shown)[:120] + ")"
    text += f" -> {metas(op.out)}" if op.out else ""
    if op.host_value is not None:
        text += f" = {op.host_value!r}"
    if op.cached:
        text += " [cached]"
    return text


def _short(a: Any) -> str:
    a = readable_arg(a)
    if isinstance(a, dict) and len(a) == 1:  # a keyword argument: "generator=torch.Generator"
        (k, v), = a.items()
        return f"{k}={_short(v)}"
    if isinstance(a, list) and len(a) > 8:
        return "[" + ", ".join(str(x) for x in a[:8]) + f", ... {len(a)} items]"
    return str(a)


def list_diff(a: list, b: list, context: int = 2, limit: int = 24) -> str:
    """Mark the entries that differ (`99→98`); long lists keep only the differing entries and context."""
    if len(a) != len(b):
        return f"{_short(a)} vs {_short(b)}"
    differ = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    keep = set(range(len(a))) if len(a) <= limit else {
        j for i in differ for j in range(max(0, i - context), min(len(a), i + context + 1))}
    parts, skipped = [], False
    for i, (x, y) in enumerate(zip(a, b)):
        if i not in keep:
            if not skipped:
                parts.append("..")
                skipped = True
            continue
        skipped = False
        parts.append(f"{x}→{y}" if x != y else str(x))
    return "[" + ", ".join(parts) + "]"


def args_diff(f: OpRecord, r: OpRecord) -> str | None:
    """The first non-tensor argument that differs, rendered with list_diff ("[56→57, 77]", "0.5→0.25",
    "alpha=1.0→2.0")."""
    for x, y in zip(readable_arg(f.args), readable_arg(r.args)):
        if isinstance(x, str) and x.startswith("$"):
            continue
        if x != y:
            if isinstance(x, list) and isinstance(y, list):
                return list_diff(_plain(x), _plain(y))
            if isinstance(x, dict) and isinstance(y, dict) and x.keys() == y.keys():
                return ", ".join(f"{k}={x[k]!r}→{y[k]!r}" for k in x if x[k] != y[k])
            return f"{x!r}→{y!r}"
    if len(f.args) != len(r.args):
        return f"{len(f.args)} vs {len(r.args)} arguments"
    return None


def _plain(xs: list) -> list:
    out = []
    for x in xs:
        try:
            out.append(int(x) if isinstance(x, str) and x.lstrip("-").isdigit() else x)
        except ValueError:
            out.append(x)
    return out


def where(module: str | None, source: str | None) -> str:
    """"layers.1.moe (tiny_moe.py:158 in update)"; either part may be unknown."""
    if module and source:
        return f"{module_label(module)} ({source})"
    return (module_label(module) if module else None) or source or "(unknown place)"


def outputs_diff(f: OpRecord, r: OpRecord, limit: int = 4) -> str | None:
    """Only the outputs whose metadata differ: "outputs 0, 3: f32[56, 64]→f32[57, 64], ..."."""
    if len(f.out) != len(r.out):
        return f"{len(f.out)} outputs vs {len(r.out)}: {metas(f.out)} vs {metas(r.out)}"
    changed = [(j, a, b) for j, (a, b) in enumerate(zip(f.out, r.out)) if str(a) != str(b)]
    if not changed:
        return None
    head = "output" if len(f.out) == 1 else f"output{'s' if len(changed) > 1 else ''} {', '.join(str(j) for j, _, _ in changed[:limit])}"
    more = f", ... ({len(changed)} in all)" if len(changed) > limit else ""
    return f"{head}: " + ", ".join(f"{a}→{b}" for _, a, b in changed[:limit]) + more


def number_ranges(numbers: list[int], sep: str = ", ") -> str:
    """[3, 4, 5, 9] -> "3-5, 9"."""
    numbers = sorted(set(numbers))
    parts, start, prev = [], numbers[0], numbers[0]
    for n in numbers[1:] + [None]:
        if n is not None and n == prev + 1:
            prev = n
            continue
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
        if n is not None:
            start = prev = n
    return sep.join(parts)


def branch_sites(region: Region, control: Divergence) -> str:
    """Where the passes' op sequences part: the line of the op that differs, or of each pass's where they ran other
    ops from other lines (the forward's layer norm, the recompute's extra branch)."""
    fwd, rec = op_at(region.forward, control.forward_index), op_at(region.recompute, control.recompute_index)
    if fwd is None or rec is None or (fwd.module, fwd.source) == (rec.module, rec.source):
        return where(control.module, control.source)
    return f"{where(fwd.module, fwd.source)} (the forward's op) and {where(rec.module, rec.source)} (the recompute's)"


def positions_label(positions: list) -> str:
    """"saved position(s) 4, 10 (aten.sigmoid.default at act (model.py:14 in forward))": report PositionRows."""
    made = ", ".join(dict.fromkeys(f"{p.op or p.origin} at {where(p.module, p.source)}" for p in positions[:3]))
    return f"saved position(s) {number_ranges([p.position for p in positions])} ({made})"
