"""Compare two gradient captures (grads.py) backward by backward.

    compare_captures(run, reference, region_modules=["layers.0", "layers.1"])  ->  [StepComparison, ...]

Bit-identical when the fingerprints match (grads.py); else the relative difference ||run - ref|| / ||ref||: exact
where both runs kept the whole gradient, over a strided sample where they kept one (`sampled`), and where the
values were over the budget, from the norms alone (`norm_only`): | ||run|| - ||ref|| | / ||ref||, a lower bound.
A gradient that is None in one run only is `missing_in_run` / `missing_in_reference`.
"""

from __future__ import annotations

from typing import Any

from .result import ParamDiff, StepComparison


def rel_diff(a: dict[str, Any], b: dict[str, Any]) -> float | None:
    """||a - b|| / ||b|| over the values both kept (all, or the same strided sample), else None."""
    x, y = a.get("values"), b.get("values")
    if x is None or y is None or x.shape != y.shape or a.get("kept", "full") != b.get("kept", "full"):
        return None
    x, y = x.double(), y.double()
    return _ratio(float((x - y).norm()), float(y.norm()))


def norm_bound(a: dict[str, Any], b: dict[str, Any]) -> float | None:
    """| ||a|| - ||b|| | / ||b||: a lower bound of the relative difference, from the norms alone."""
    if a.get("norm") is None or b.get("norm") is None:
        return None
    return _ratio(abs(a["norm"] - b["norm"]), b["norm"])


def _ratio(num: float, denom: float) -> float:
    return num / denom if denom > 0 else (0.0 if num == 0 else float("inf"))


def _same_numbers(x: list[float] | None, y: list[float] | None) -> bool:
    """Equal fingerprints (NaN equals NaN: a fingerprint is NaN when the gradient is)."""
    return x is not None and y is not None and len(x) == len(y) and all(
        u == v or (u != u and v != v) for u, v in zip(x, y))


def same(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    if a is None or b is None:
        return a is b
    return a["shape"] == b["shape"] and a["dtype"] == b["dtype"] and _same_numbers(a.get("fp"), b.get("fp"))


def region_of(name: str, region_modules: list[str]) -> str | None:
    """The longest region module name that is a dotted prefix of the parameter's name."""
    best = None
    for module in region_modules:
        if module and (name == module or name.startswith(module + ".")) and (best is None or len(module) > len(best)):
            best = module
    return best


def compare_step(step: int, run: dict[str, Any], ref: dict[str, Any], region_modules: list[str]) -> StepComparison:
    loss_a, loss_b = run.get("loss"), ref.get("loss")
    loss_same = None if loss_a is None or loss_b is None else same(loss_a, loss_b)
    grads_a, grads_b = run.get("grads", {}), ref.get("grads", {})
    names = list(grads_a) + [n for n in grads_b if n not in grads_a]
    out = StepComparison(step=step, loss_identical=loss_same,
                         loss_rel_diff=None if loss_same in (None, True) else rel_diff(loss_a, loss_b),
                         parameters=len(names), identical=0)
    for name in names:
        a, b = grads_a.get(name), grads_b.get(name)
        if same(a, b):
            out.identical += 1
            out.no_grad += a is None
            continue
        region = region_of(name, region_modules)
        if a is None:
            out.differing.append(ParamDiff(name, "missing_in_run", region=region))
        elif b is None:
            out.differing.append(ParamDiff(name, "missing_in_reference", region=region))
        elif a["shape"] != b["shape"]:
            out.differing.append(ParamDiff(name, "shape", region=region))
        else:
            rel = rel_diff(a, b)
            out.differing.append(ParamDiff(name, "differs", rel if rel is not None else norm_bound(a, b),
                                           rel is not None and bool(a.get("sampled")), region, norm_only=rel is None))
    return out


def compare_captures(run: dict[str, Any], ref: dict[str, Any], region_modules: list[str]) -> list[StepComparison]:
    return [compare_step(i, a, b, region_modules) for i, (a, b) in enumerate(zip(run["steps"], ref["steps"]))]
