"""How a discrete decision flipped: how many elements changed, and by what score margin.

    flip = describe_flip(forward_op, recompute_op)
    flip.summary  ->  "1 of 512 rows chose differently (top-2 of 8); score margin at the flip 3.1e-04,
                       the scores moved by up to 2.0e-03"

Uses the values the recorder kept for discrete ops (`OpRecord.values`: "out<j>" outputs, "in0" the
score input). Without kept values it says only that the fingerprint changed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..oprules import DECISION_OUTPUT, packet
from ..passes import OpRecord, TensorMeta
from ..report import REORDERED_ONLY

# Ops that choose the k largest/smallest entries along a dim, and which output holds the choice.
@dataclass
class Flip:
    summary: str
    changed: int | None = None
    total: int | None = None
    rows_changed: int | None = None
    rows: int | None = None
    margin_min: float | None = None
    margin_max: float | None = None
    score_shift: float | None = None
    detail: dict[str, Any] = field(default_factory=dict)


def _tensor(values: Any, dtype=None) -> torch.Tensor | None:
    try:
        return torch.tensor(values, dtype=dtype)
    except (TypeError, ValueError, RuntimeError):
        return None


def _shape(shape) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


def describe_flip(f: OpRecord, r: OpRecord) -> Flip:
    name = packet(f.op)
    if f.host_value is not None or r.host_value is not None:
        return Flip(f"the value handed to Python changed: {f.host_value!r} -> {r.host_value!r}",
                    detail={"forward": f.host_value, "recompute": r.host_value})
    out_key = f"out{DECISION_OUTPUT.get(name, 0)}"
    fv = (f.values or {}).get(out_key)
    rv = (r.values or {}).get(out_key)
    if fv is None or rv is None:
        shapes = [(a.shape, b.shape) for a, b in zip(f.out, r.out)
                  if type(a) is TensorMeta and type(b) is TensorMeta and a.shape != b.shape]
        if shapes:  # a log, or values past --keep-values: the shape of the decision is what is known
            return Flip(f"its output changed shape: {_shape(shapes[0][0])} -> {_shape(shapes[0][1])}")
        if f.log_ids is not None:
            return Flip("its output values changed (a log holds no values: `ac-diff run` would show which)")
        return Flip("its output values changed (values not kept: raise --keep-values to see which elements)")
    a, b = _tensor(fv), _tensor(rv)
    if a is None or b is None or a.shape != b.shape:
        return Flip("its output changed shape", detail={"forward": _short(fv), "recompute": _short(rv)})
    diff = a != b
    changed, total = int(diff.sum()), diff.numel()
    flip = Flip(summary="", changed=changed, total=total)
    unit = "elements"
    if a.dim() >= 2 and name in DECISION_OUTPUT:
        rows = diff.reshape(-1, a.shape[-1]).any(dim=1)
        flip.rows_changed, flip.rows = int(rows.sum()), rows.numel()
        unit = "rows"
        _margins(flip, f, r, name, rows)
    elif a.dim() == 1 and name in DECISION_OUTPUT:
        flip.rows_changed, flip.rows = changed, total
        unit = "rows"
        _margins(flip, f, r, name, diff)
    count = f"{flip.rows_changed} of {flip.rows} {unit}" if unit == "rows" else f"{changed} of {total} elements"
    what = {"topk": "chose other entries", "argmax": "picked another index", "argmin": "picked another index",
            "sort": "ordered differently", "argsort": "ordered differently"}.get(name, "changed")
    if name == "topk" and flip.rows_changed and _reordered_only(a, b):
        what = "chose the same entries in another order"
        flip.detail[REORDERED_ONLY] = True
    parts = [f"{count} {what}"]
    k = _k_of(f, name)
    if name == "topk" and k is not None and f.inputs:
        parts[0] += f" (top-{k} of {f.inputs[0].shape[-1] if f.inputs[0].shape else '?'})"
    if flip.margin_min is not None:
        parts.append(f"score margin at the flip {flip.margin_min:.2g}"
                     + (f"..{flip.margin_max:.2g}" if flip.margin_max and flip.margin_max != flip.margin_min else ""))
    if flip.score_shift is not None:
        parts.append(f"the scores moved by up to {flip.score_shift:.2g} between passes")
    if flip.detail.get(REORDERED_ONLY):
        parts.append(f"the gradients change only where the code uses the order of the {k or 'k'} choices (a sum "
                     "weighted by their scores does not): `--reference no-ac` tells")
    flip.summary = "; ".join(parts)
    if unit != "rows":
        idx = diff.reshape(-1).nonzero().reshape(-1)[:8].tolist()
        flip.detail["first_changed_at"] = idx
    return flip


def _reordered_only(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Every row of two top-k index tensors holds the same entries, some in another order (a tie among the chosen)."""
    if a.dim() == 0 or a.shape[-1] < 2:
        return False
    return bool((a.sort(dim=-1).values == b.sort(dim=-1).values).all())


def decision_kept(f: OpRecord | None, r: OpRecord | None) -> bool:
    """The decision output of a discrete op (topk's indices) is measured identical in both passes (its kept values,
    else its fingerprint): only its scores differ, so no decision flipped."""
    if f is None or r is None or f.host_value is not None or r.host_value is not None:
        return False
    slot = DECISION_OUTPUT.get(packet(f.op), 0)
    a, b = _tensor((f.values or {}).get(f"out{slot}")), _tensor((r.values or {}).get(f"out{slot}"))
    if a is not None and b is not None:
        return a.shape == b.shape and bool((a == b).all())
    # values past --keep-values: the decision output's fingerprint (exact sums of its bits) tells it
    fa, fb = (op.fingerprint[slot] if op.fingerprint and slot < len(op.fingerprint) else None for op in (f, r))
    return fa is not None and fa == fb and f.out_signature() == r.out_signature()


def first_flip(cmp: Any) -> Any:
    """The first pair of a PassComparison whose discrete op decided otherwise (not one whose scores alone moved)."""
    return next((d for d in cmp.discrete_diffs() if not decision_kept(d.forward, d.recompute)), None)


def _k_of(op: OpRecord, name: str) -> int | None:
    if name == "topk":
        ints = [a for a in op.args[1:] if isinstance(a, int) and not isinstance(a, bool)]
        return ints[0] if ints else None
    return 1 if name in ("argmax", "argmin", "max", "min") else None


def _margins(flip: Flip, f: OpRecord, r: OpRecord, name: str, rows: torch.Tensor) -> None:
    """Gap between the k-th and (k+1)-th score in the rows that flipped, from the forward's scores."""
    fs = _tensor((f.values or {}).get("in0"), torch.float64)
    rs = _tensor((r.values or {}).get("in0"), torch.float64)
    if fs is None or fs.dim() == 0:
        return
    k = _k_of(f, name)
    scores = fs.reshape(-1, fs.shape[-1])
    if scores.shape[0] != rows.numel() or k is None or k >= scores.shape[-1]:
        return
    picked = scores[rows]
    if picked.numel() == 0:
        return
    gaps = _closest_gaps(picked, f, name, k)
    flip.margin_min, flip.margin_max = float(gaps.min()), float(gaps.max())
    if rs is not None and rs.shape == fs.shape:
        shift = (rs.reshape(-1, fs.shape[-1])[rows] - picked).abs()
        flip.score_shift = float(shift.max())


@dataclass
class HeldChoice:
    """A chooser (top-k, argmax) whose scores moved between the passes while every choice held: how far they moved,
    and how close the nearest choice came (the smallest gap between the k-th and the next score)."""
    op: OpRecord
    moved: float
    margin: float
    rows: int


def held_choice(cmp: Any) -> HeldChoice | None:
    """The first chooser of a PassComparison whose scores moved (kept values of both passes) and whose choice held,
    where its margin is known: what a larger batch, with more rows near a tie, flips."""
    for d in cmp.discrete_diffs():
        f, r = d.forward, d.recompute
        name = packet(f.op) if f is not None else None
        if name not in ("topk", "argmax", "argmin", "max", "min") or not decision_kept(f, r):
            continue
        fs = _tensor((f.values or {}).get("in0"), torch.float64)
        rs = _tensor((r.values or {}).get("in0"), torch.float64)
        k = _k_of(f, name)
        if fs is None or rs is None or fs.shape != rs.shape or fs.dim() == 0 or k is None or k >= fs.shape[-1]:
            continue
        moved = float((rs - fs).abs().max())
        if not moved > 0:
            continue
        rows = fs.reshape(-1, fs.shape[-1])
        return HeldChoice(f, moved, float(_closest_gaps(rows, f, name, k).min()), int(rows.shape[0]))
    return None


def _closest_gaps(rows: torch.Tensor, f: OpRecord, name: str, k: int) -> torch.Tensor:
    """Per row of scores, the closest pair among the first k+1 ranked (in the chooser's own order): the near-tie that
    could reorder the choice."""
    largest = not (name in ("argmin", "min") or (name == "topk" and False in f.args[3:4]))
    ordered = rows.sort(dim=-1, descending=largest).values
    return (ordered[:, :k] - ordered[:, 1:k + 1]).abs().min(dim=-1).values


def _short(values: Any, n: int = 12) -> Any:
    if isinstance(values, list) and len(values) > n:
        return values[:n] + ["..."]
    return values
