"""How far each row of a discrete decision is from flipping: its margin, in score units and in ulps.

    m = decision_margins("aten.topk.default", func, args, kwargs)
    m.kind       -> "chooser"           (topk / sort / argsort / argmax / max.dim / kthvalue)
    m.margins    -> float64 [rows]      the gap between the k-th and (k+1)-th score (the closest pair among
                                         the first k+1 ranked: any swap there changes the output)
    m.ulps       -> float64 [rows]      the same gap in ulps of the score dtype at that magnitude
    m.score_arg  -> 0                   which argument holds the scores

Comparisons (gt/lt/ge/le/eq/ne that feed masks or nonzero): the distance to the threshold per
element; histc: the distance to the nearest bin edge; bucketize: to the nearest boundary. Other
discrete ops (nonzero of a mask, bincount of ids, where on a bool) have no margin of their own: they
flip only when a decision upstream does. `summarize` turns a site's margins into the shares within
1, 4 and 16 ulps, the density near zero and a small histogram.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..oprules import DECISION_OUTPUT
from ..oprules import packet as packet_of
from .noise import exact_values, ulp

COMPARISONS = frozenset({"eq", "ne", "gt", "lt", "ge", "le"})
# histogram of margins in ulps: [0], (0, 1], (1, 4], (4, 16], (16, 64], (64, 256], (256, 1024], > 1024
HIST_EDGES = (0.0, 1.0, 4.0, 16.0, 64.0, 256.0, 1024.0)
HIST_LABELS = ("0", "≤1", "≤4", "≤16", "≤64", "≤256", "≤1k", ">1k")


@dataclass
class Margins:
    kind: str  # "chooser" | "comparison" | "histc" | "bucketize"
    margins: torch.Tensor  # float64 [rows], score units
    ulps: torch.Tensor  # float64 [rows], the margin over the score dtype's spacing there
    score_arg: int  # the argument holding the scores (perturbed and measured)
    score_dtype: torch.dtype
    k: int | None = None
    candidates: int | None = None  # entries a row chooses among (experts, vocabulary)
    dim: int | None = None  # a chooser's dimension (None: the whole tensor is one row); None elsewhere
    # a chooser's: per row, the positions (along dim) of the two scores whose gap is the margin
    pair: torch.Tensor | None = None


def bind(func, args: tuple, kwargs: dict) -> dict:
    """The op's arguments by schema name ({"self": t, "k": 2, "dim": 1, ...})."""
    bound = dict(kwargs or {})
    schema = getattr(func, "_schema", None)
    if schema is not None:
        for i, a in enumerate(schema.arguments):
            if i < len(args):
                bound.setdefault(a.name, args[i])
            elif a.name not in bound and a.has_default_value():
                bound[a.name] = a.default_value  # topk's dim=-1, largest=True
    return bound


def decision_margins(name: str, func, args: tuple, kwargs: dict) -> Margins | None:
    packet = packet_of(name)
    b = bind(func, args, kwargs)
    try:
        if packet in DECISION_OUTPUT:
            m = _chooser(packet, b)
        elif packet in COMPARISONS:
            m = _comparison(b)
        elif packet == "histc":
            m = _histc(b)
        elif packet == "bucketize":
            m = _bucketize(b.get("self"), b.get("boundaries"), 0)
        elif packet == "searchsorted":
            m = _bucketize(b.get("self"), b.get("sorted_sequence"), 1)
        else:
            return None
    except (RuntimeError, TypeError, ValueError, IndexError):  # an odd overload: no margin, still flip-counted
        return None
    if m is not None and all(exact_values(t) or not _floating(t) for t in (b.get("self"), b.get("other"))):
        m.ulps = torch.full_like(m.ulps, float("inf"))  # exact scores: no rounding moves them, ties included
    return m


def _floating(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() > 0


def _chooser(packet: str, b: dict) -> Margins | None:
    scores = b.get("self")
    if not _floating(scores):
        return None
    dim = b.get("dim")
    x = scores.detach().reshape(-1) if dim is None or scores.dim() == 0 else scores.detach().movedim(dim, -1)
    rows = x.reshape(-1, x.shape[-1]) if x.dim() else x.reshape(1, 1)
    n = rows.shape[-1]
    if n < 2:
        return None
    largest = bool(b.get("largest", True)) and packet not in ("argmin", "min")
    if packet in ("sort", "argsort", "msort"):
        k = n - 1
    elif packet == "kthvalue":
        k, largest = min(int(b.get("k", 1)), n - 1), False
    else:
        k = min(int(b.get("k", 1)), n - 1)
    # the first k+1 ranked, in the scores' own dtype (the order is the same), then float64: never a copy of a
    # whole vocabulary's logits in float64
    ranked, where = rows.topk(k + 1, dim=-1, largest=largest) if k + 1 < n else rows.sort(dim=-1, descending=largest)
    ordered = ranked.to(torch.float64)
    gaps = (ordered[:, :k] - ordered[:, 1:k + 1]).abs()
    m, j = gaps.min(dim=-1)
    at = ordered[:, k - 1:k].reshape(-1) if k >= 1 else ordered[:, 0]
    pair = torch.stack([where.gather(1, j[:, None]), where.gather(1, j[:, None] + 1)], dim=-1).reshape(-1, 2)
    return Margins("chooser", m, m / ulp(at, scores.dtype), 0, scores.dtype, k, n,
                   None if dim is None or scores.dim() == 0 else dim % scores.dim(), pair)


def comparison_gap(name: str, func, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """A comparison's signed distance to its threshold per element (`self - other`, float64, flat), what its noise is
    measured on: a threshold computed from the same scores (`z < z.kthvalue(5).values`, `x >= x.max()`) moves with
    them, so the element it was taken from stays at distance 0 however rounding moves both. None for other ops."""
    if packet_of(name) not in COMPARISONS:
        return None
    b = bind(func, args, kwargs)
    operands = _operands(b)
    return None if operands is None else (operands[0] - operands[1]).reshape(-1)


def _operands(b: dict) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A comparison's two operands in float64, broadcast; None where neither is floating."""
    a, other = b.get("self"), b.get("other")
    if not isinstance(a, torch.Tensor) or not _floating(a) and not _floating(other):
        return None
    av = a.detach().to(torch.float64)
    ov = other.detach().to(torch.float64) if isinstance(other, torch.Tensor) else torch.tensor(float(other), dtype=torch.float64)
    av, ov = torch.broadcast_tensors(av, ov.to(av.device))
    return av, ov


def _comparison(b: dict) -> Margins | None:
    operands = _operands(b)
    if operands is None:
        return None
    av, ov = operands
    a, other = b.get("self"), b.get("other")
    dtype = a.dtype if a.is_floating_point() else other.dtype
    m = (av - ov).abs().reshape(-1)
    return Margins("comparison", m, m / ulp(torch.maximum(av.abs(), ov.abs()).reshape(-1), dtype), 0, dtype)


def _histc(b: dict) -> Margins | None:
    x = b.get("self")
    if not _floating(x):
        return None
    v = x.detach().to(torch.float64).reshape(-1)
    lo, hi, bins = float(b.get("min", 0) or 0), float(b.get("max", 0) or 0), int(b.get("bins", 100))
    if lo == hi:
        lo, hi = float(v.min()), float(v.max())
    if hi <= lo:
        return None
    width = (hi - lo) / bins
    pos = (v - lo) / width
    m = (pos - pos.round()).abs() * width
    return Margins("histc", m, m / ulp(v, x.dtype), 0, x.dtype)


def _bucketize(x, boundaries, score_arg: int) -> Margins | None:
    if not _floating(x) or not isinstance(boundaries, torch.Tensor) or boundaries.dim() != 1 or boundaries.numel() == 0:
        return None
    v = x.detach().to(torch.float64).reshape(-1)
    edges = boundaries.detach().to(torch.float64).to(v.device)
    i = torch.searchsorted(edges, v).clamp(max=edges.numel() - 1)
    m = torch.minimum((v - edges[i]).abs(), (v - edges[(i - 1).clamp(min=0)]).abs())
    return Margins("bucketize", m, m / ulp(v, x.dtype), score_arg, x.dtype)


def histogram(ulps: torch.Tensor) -> list[int]:
    """Counts per HIST_LABELS bin."""
    if ulps.numel() == 0:
        return [0] * len(HIST_LABELS)
    edges = torch.tensor(HIST_EDGES, dtype=torch.float64)
    zero = int((ulps == 0).sum())
    idx = torch.bucketize(ulps[ulps > 0].cpu(), edges, right=False)  # (0,1] -> 1, (1,4] -> 2, ...
    counts = torch.bincount(idx, minlength=len(HIST_LABELS)).tolist()
    counts[0] = zero
    return counts[:len(HIST_LABELS)]


def summarize(ulps: torch.Tensor) -> dict:
    """Shares of rows within 1, 4 and 16 ulps; density near zero (share of rows per ulp, over [0, 4])."""
    rows = ulps.numel()
    if rows == 0:
        return {"rows": 0, "within_1ulp": None, "within_4ulp": None, "within_16ulp": None,
                "density_near_zero": None, "min_ulps": None, "median_ulps": None, "histogram": histogram(ulps)}
    share = {n: float((ulps <= n).sum()) / rows for n in (1, 4, 16)}
    least, median = float(ulps.min()), float(ulps.median())
    return {"rows": rows, "within_1ulp": share[1], "within_4ulp": share[4], "within_16ulp": share[16],
            "density_near_zero": share[4] / 4.0,  # (exact scores: no margin in ulps, null: JSON has no infinity)
            "min_ulps": least if math.isfinite(least) else None,
            "median_ulps": median if math.isfinite(median) else None,
            "exact": not math.isfinite(least), "histogram": histogram(ulps)}
