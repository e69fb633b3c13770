"""A nested region the enclosing region's forward ran, and nothing recomputed (a reentrant forward runs under no_grad:
it saved nothing), compared with its rerun in the enclosing region's recompute.

    pair_nested_reruns(run.regions)   # -> {1: 2}: region 1 (Inner, in region 0's forward) is compared with the
                                      #    forward of region 2 (Inner, rerun in region 0's recompute)

The enclosing recompute must reproduce its forward, nested calls included: an inner module whose Python state changed
between the passes (a warm-up's scale) computes otherwise in the rerun, and each of the two nested regions reproduces
itself (the first is never recomputed, the second recomputes the rerun).
"""

from __future__ import annotations

from ..passes import Region


def pair_nested_reruns(regions: list[Region]) -> dict[int, int]:
    """Set the recompute of each nested region of an enclosing forward that has none to the forward of its rerun
    (the nested region of the same module at the same place among the enclosing recompute's); return {region: rerun}.
    Pairing stops at the first place where the two lists of modules differ (the recompute took another path)."""
    children: dict[tuple[int, str], list[Region]] = {}
    for r in regions:
        if r.parent is not None and r.parent_phase in ("forward", "recompute"):
            children.setdefault((r.parent, r.parent_phase), []).append(r)
    pairs: dict[int, int] = {}
    for (parent, phase), ran in children.items():
        if phase != "forward":
            continue
        for r, rerun in zip(ran, children.get((parent, "recompute"), ())):
            if r.module != rerun.module or r.kind != rerun.kind:
                break
            if r.recompute is None and _comparable(r, rerun):
                r.recompute = rerun.forward
                pairs[r.region] = rerun.region
    return pairs


def _comparable(ran: Region, rerun: Region) -> bool:
    """Both forwards written in full (a rerun that reproduced itself is summarized, its ops not kept) and run in the
    same grad mode: a non-reentrant checkpoint in a reentrant forward runs under no_grad, its rerun with autograd on,
    and saves otherwise."""
    a, b = ran.forward, rerun.forward
    return (a is not None and b is not None and not ran.watched and not rerun.watched
            and a.values_digest is None and b.values_digest is None and rerun.ops_written
            and a.state.get("grad_enabled") == b.state.get("grad_enabled"))
