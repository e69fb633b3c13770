"""State a later forward of the same module changed before a region's recompute: micro-batches (or a long sequence's
chunks) forwarded before their backwards, each setting state for its own forward.

    later_forward(reports, regions, versions)
    region 0 (layers.0, backward 1): the buffer `layers.0.rope` has other values in the recompute ... modified between
    the forward and the backward; regions 2, 4 and 6, later forwards of layers.0, ran before this recompute (in the
    same step) -> mechanism later_forward, and the fix passes the value as an argument (an update after the
    backward cannot serve each micro-batch's forward)
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import replace
from typing import Any, Callable

from ..oprules import OUTSIDE_KINDS, written_inputs
from ..passes import Pass, Region
from ..report import DIVERGED, LATER_FORWARD, NESTED_RERUN, RegionReport
from .labels import number_ranges
from .suggest import suggestions_for

# mechanisms of state changed between a forward and its recompute, by no op of its own: a tensor, a Python attribute
# (a scale the training loop sets before each micro-batch's forward)
_CHANGED_BETWEEN = ("tensor", "attribute")


def later_forward(reports: list[RegionReport], regions: dict[tuple, Region], versions: dict[Any, str | None],
                  loaders: dict[tuple, Callable]) -> None:
    """Each diverged region whose buffer (or captured tensor, or Python attribute) changed between its forward and its
    recompute, where later forwards of the same module ran in between: its cause says so, and its fix passes the
    value to the checkpointed function. `regions`: (path, rank, region) -> Region; `versions`: path -> its torch
    version; `loaders`: (path, rank) -> `Run.loaded` (the passes' ops and externals, decoded for a block)."""
    by_module: dict[tuple, list[RegionReport]] = {}
    for r in reports:
        by_module.setdefault((r.path, r.rank, r.module), []).append(r)
    for r in reports:
        c = r.cause
        if r.status != DIVERGED or c is None or c.kind != "state_mutation" or c.mechanism not in _CHANGED_BETWEEN \
                or r.step is None or r.watched:
            continue
        # (a step begins at the first forward after a recompute: a later region of the same step ran its forward
        # after this one's and before any recompute, this one's included)
        later = [x.region for x in by_module[(r.path, r.rank, r.module)] if x.region > r.region and x.step == r.step
                 and x.unchecked_reason != NESTED_RERUN and not _rerun(regions.get((r.path, r.rank, x.region)))]
        region = regions.get((r.path, r.rank, r.region))
        if not later or region is None:
            continue
        with ExitStack() as loaded:
            passes = [regions.get((r.path, r.rank, x)) for x in later]
            if c.mechanism != "attribute":  # (a tensor's reads are in the passes' externals, decoded for this block)
                for x in [region, *passes]:
                    loaded.enter_context(loaders[r.path, r.rank](x))
            if _before_each_later(c, region, passes):
                continue
        many = len(later) > 1
        r.cause = replace(c, mechanism=LATER_FORWARD, detail=(
            f"{c.detail}: region{'s' if many else ''} {number_ranges(later)}, later forward{'s' if many else ''} of "
            f"{r.module} (micro-batches or chunks forwarded before their backwards), ran before this recompute: what "
            "is set at or in each forward (a position offset, a cache for its length) reaches this recompute as the "
            "last forward left it"), evidence=[*c.evidence, (
                f"region{'s' if many else ''} {number_ranges(later)} ({r.module}) ran {'their' if many else 'its'} "
                f"forward after this region's and before its recompute (step {r.step})")])
        r.suggestions = suggestions_for(r, region, versions.get(r.path))


def _rerun(region: Region | None) -> bool:
    """A nested region its parent's recompute ran again (pair_nested_reruns: what a region is compared with)."""
    return region is not None and region.parent_phase == "recompute"


def _before_each_later(cause: Any, region: Region, later: list[Region | None]) -> bool:
    """The attribute or tensor of `cause` read the same in every later forward of the module as in this region's, and
    none of them changed it: what changed it came after them all (the loop, between the step's forward and its
    backward, or after an earlier micro-batch's backward: the second and third calls of a weight-shared block are no
    micro-batches). False where a pass was not recorded, or its values were not measured."""
    if region.forward is None or any(x is None or x.forward is None for x in later):
        return False
    name = cause.tensor
    if cause.mechanism == "attribute":
        if name not in region.forward.attributes:
            return False
        value = region.forward.attributes[name]
        return all(name in x.forward.attributes and x.forward.attributes[name] == value
                   and name not in (x.forward.attribute_updates or {}) for x in later)
    read = _read_as(region.forward, name)
    return read is not None and all(_read_as(x.forward, name) == read and name not in _written(x.forward)
                                    for x in later)


def _read_as(p: Pass, name: str) -> list[float] | None:
    """The fingerprint of the tensor `name` a pass read from outside it (a buffer, a captured tensor), None where it
    read none such or did not measure it."""
    return next((e.fingerprint for e in p.externals if e.name == name and e.kind in OUTSIDE_KINDS), None)


def _written(p: Pass) -> set[str]:
    """The names of the outside tensors a pass writes in place (a batch norm's running statistics)."""
    return {ref.name for op in p.ops for ref in written_inputs(op.op, op.args, op.input_refs) if ref.kind != "op"}
