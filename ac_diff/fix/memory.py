"""Activation bytes a remedy keeps per region beyond full AC, from the recorded traces (not process RSS).

    extra_bytes_per_region(try_run, base_run, no_ac_globs)  ->  6144.0   # +6 KiB per region vs the base run

Under full AC a region keeps only its inputs. What a remedy adds: the outputs selective AC saves in the
forward (ops recorded as `cached`), and, for a region run without AC, every tensor autograd saves inside it
(the base recording's saved positions that the region computed; parameters and the region's inputs are kept
either way). Each run's bytes are averaged over its own regions (a try may run more steps than a base run that
crashed in its first backward), and the base run's (whose own SAC policy may already save some) subtracted.
"""

from __future__ import annotations

import math
from typing import Any

from ..capture.opinfo import dtype_from_short
from ..oprules import is_view_op
from ..remedies.call import matches


def _bytes(meta: Any) -> int:
    if meta is None:
        return 0
    try:
        size = dtype_from_short(meta.dtype).itemsize
    except (KeyError, ValueError, TypeError, AttributeError):
        size = 4
    return math.prod(meta.shape) * size


def sac_bytes(region: Any) -> int:
    """Bytes of the forward outputs selective AC saved in this region."""
    fwd = region.forward
    return 0 if fwd is None else sum(_bytes(m) for op in fwd.ops if op.cached for _, m in op.tensor_outputs())


def activation_bytes(region: Any) -> int:
    """Bytes autograd saves inside the region when it is not checkpointed: its forward's saved positions that the
    region computed; a reentrant region's forward runs without grad and saves nothing, and its recompute's are not
    listed: at most what its ops made (their outputs that are not views)."""
    fwd = region.forward
    if fwd is None:
        return 0
    if fwd.positions or region.kind != "reentrant":
        return sum(_bytes(p.meta) for p in fwd.positions if p.origin == "op")
    return sum(_bytes(m) for op in fwd.ops if not is_view_op(op.op) for _, m in op.tensor_outputs())


def _each(run: Any, regions: list, count) -> int:
    """The sum of `count(region)` over `regions` of `run`, each region's ops decoded only while it is counted
    (a run read lazily holds one region's ops at a time)."""
    total = 0
    for region in regions:
        with run.loaded(region):
            total += count(region)
    return total


def extra_bytes_per_region(run: Any, base: Any, no_ac: list[str]) -> float | None:
    regions = [r for r in base.regions if r.forward is not None]
    ran = [r for r in run.regions if r.forward is not None]
    if not regions:
        return None
    kept = _each(run, ran, sac_bytes) / len(ran) if ran else 0.0
    if no_ac:
        kept += _each(base, [r for r in regions if matches(r.module, no_ac)], activation_bytes) / len(regions)
    return kept - _each(base, regions, sac_bytes) / len(regions)
