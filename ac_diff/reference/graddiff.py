"""Compare two gradient captures (grads.py) backward by backward.

    compare_captures(run, reference, region_modules=["layers.0", "layers.1"])  ->  [StepComparison, ...]

Bit-identical when the hashes match; else the relative difference ||run - ref|| / ||ref|| over the kept
values (all of them up to grads.FULL_LIMIT elements, else a strided sample: `sampled`). A gradient that is
None in one run only is `missing_in_run` / `missing_in_reference`.
"""

from __future__ import annotations

from typing import Any

from .result import ParamDiff, StepComparison


def rel_diff(a: dict[str, Any], b: dict[str, Any]) -> float | None:
    x, y = a.get("values"), b.get("values")
    if x is None or y is None or x.shape != y.shape:
        return None
    x, y = x.double(), y.double()
    denom = float(y.norm())
    num = float((x - y).norm())
    return num / denom if denom > 0 else (0.0 if num == 0 else float("inf"))


def same(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    if a is None or b is None:
        return a is b
    return a["shape"] == b["shape"] and a["dtype"] == b["dtype"] and a["hash"] == b["hash"]


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
            out.differing.append(ParamDiff(name, "differs", rel_diff(a, b), bool(a.get("sampled") or b.get("sampled")),
                                           region))
    return out


def compare_captures(run: dict[str, Any], ref: dict[str, Any], region_modules: list[str]) -> list[StepComparison]:
    return [compare_step(i, a, b, region_modules) for i, (a, b) in enumerate(zip(run["steps"], ref["steps"]))]
