"""Regions that diverged for the same reason, grouped so a report can say it once.

    group_regions(report.regions)
    -> [RegionGroup(label="layers.0-5", cause="state_mutation", culprit="moe.expert_bias",
                    regions=[(0, 1), (0, 3), ...], lead=(0, 1))]

Two diverged regions share a group when their cause has the same kind and mechanism and names the same
culprit relative to the region (`layers.3.moe.expert_bias` in layers.3 is `moe.expert_bias`), and their
first divergence is the same op in the same relative module.
"""

from __future__ import annotations

import re

from ..report import DIVERGED, RegionGroup, RegionReport
from .cause import OPTIMIZER_STEP
from .labels import number_ranges


def _relative(name: str | None, module: str | None) -> str | None:
    """A name with the region's own module path taken off: the same culprit in every layer compares equal."""
    if not name:
        return name
    if module and (name == module or name.startswith(module + ".")):
        return name[len(module):].lstrip(".") or "(the region)"
    return re.sub(r"\b\d+\b", "#", name) if module and re.search(r"\d", module) else name


def _key(r: RegionReport) -> tuple:
    first = r.first_divergence()
    # the model's parameters updated between forward and backward: one cause, whichever parameters and ops each
    # region reads (its culprit counts them: "parameters (11 of the 12 the region reads)")
    stepped = r.cause is not None and r.cause.mechanism == OPTIMIZER_STEP
    return ((r.path, r.rank) if r.source == "log" else None, r.kind,
            r.cause.kind if r.cause else None, r.cause.mechanism if r.cause else None,
            _relative(r.cause.tensor, r.module) if r.cause and not stepped else None,
            first.kind if first and not stepped else None, first.op if first and not stepped else None,
            _relative(first.module, r.module) if first and not stepped else None)


def module_range(modules: list[str | None]) -> str:
    """"layers.0", "layers.1", ..., "layers.5" -> "layers.0-5"; otherwise the names, shortened."""
    names = [m or "?" for m in modules]
    parts = [re.fullmatch(r"(.*?)(\d+)", n) for n in names]
    if all(parts) and len({p.group(1) for p in parts}) == 1:
        return parts[0].group(1) + number_ranges([int(p.group(2)) for p in parts], sep=",")
    unique = list(dict.fromkeys(names))
    return ", ".join(unique[:4]) + (f", ... ({len(unique)} modules)" if len(unique) > 4 else "")


def group_regions(regions: list[RegionReport], lead_first=None) -> list[RegionGroup]:
    """Diverged regions grouped by shared cause and culprit; groups in the order of their lead region
    (`lead_first(region)` sorts the regions first: the one torch raised about leads)."""
    diverged = [r for r in regions if r.status == DIVERGED]
    if lead_first is not None:
        diverged.sort(key=lead_first)
    groups: dict[tuple, list[RegionReport]] = {}
    for r in diverged:
        groups.setdefault(_key(r), []).append(r)
    out = []
    for members in groups.values():
        lead = members[0]
        out.append(RegionGroup(
            label=module_range([r.module for r in members]), cause=lead.cause.kind if lead.cause else None,
            culprit=_relative(lead.cause.tensor, lead.module) if lead.cause else None,
            regions=[(r.rank, r.region) for r in members], lead=(lead.rank, lead.region), members=members))
    return out
