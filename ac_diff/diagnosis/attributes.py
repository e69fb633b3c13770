"""Python attributes of the modules a region calls, compared between its forward and its recompute.

The recorder keeps each module's scalar attributes (int/float/bool/str) at its first call in a pass, and
the ones a call changed (a forward pre-hook counting calls). Here they become the cause when the region
diverged on a Python value, not a tensor (`control_flow` where a branch on it changed the ops):

    attribute_cause(region, first)
    -> Cause(kind="state_mutation", tensor="blocks.0.step",
             detail="the Python attribute `blocks.0.step` was 0 in the forward and 1 in the recompute: ...",
             evidence=["blocks.0.step: 0 in the forward, 1 in the recompute", "each call of blocks.0 changes it
                        (0 -> 1 in the forward, 1 -> 2 in the recompute) (by its forward pre-hook Block.bump_step ...)"])
    attribute_suggestion(region, "blocks.0.step") -> Suggestion("Do not update `blocks.0.step` in a forward ...")
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..passes import Region
from ..report import Cause, Suggestion
from .passdiff import PairDiff


@dataclass(frozen=True)
class AttributeChange:
    name: str  # "blocks.0.step"
    forward: Any
    recompute: Any
    # [before, after] of the call that changed it, in each pass (a call counted again in the recompute)
    forward_update: list | None = None
    recompute_update: list | None = None
    hooks: list[str] = field(default_factory=list)  # the module's forward pre-hooks

    @property
    def counted_twice(self) -> bool:
        return self.forward_update is not None and self.recompute_update is not None


def changed_attributes(region: Region) -> list[AttributeChange]:
    """Attributes with another value at the module's first call in the recompute than in the forward."""
    fwd, rec = region.forward, region.recompute
    if fwd is None or rec is None:
        return []
    out = []
    for name, value in fwd.attributes.items():
        if name in rec.attributes and rec.attributes[name] != value:
            f_up, r_up = fwd.attribute_updates.get(name), rec.attribute_updates.get(name)
            hooks = list((f_up or r_up or [None, None, []])[2] or [])
            out.append(AttributeChange(name, value, rec.attributes[name], f_up[:2] if f_up else None,
                                       r_up[:2] if r_up else None, hooks))
    return out


def attribute_cause(region: Region, first: PairDiff | None) -> Cause | None:
    """The changed attribute behind a divergence that no tensor explains: the first divergent op read
    identical tensors (a Python number argument changed, or another branch was taken) and draws no
    random numbers."""
    changes = changed_attributes(region)
    if not changes or first is None or first.inputs_same is False:
        return None
    op = first.forward or first.recompute
    if op is not None and op.random and "value" in first.kinds and not first.kinds & {"args", "control"}:
        return None
    top = next((c for c in changes if c.counted_twice), changes[0])
    module = top.name.rsplit(".", 1)[0] if "." in top.name else "the module"
    branch = "control" in first.kinds  # Python code took another branch on it
    detail = (("the recompute ran another sequence of ops (Python code took another branch): " if branch else "")
              + f"the Python attribute `{top.name}` was {top.forward!r} in the forward and {top.recompute!r} in "
              "the recompute")
    evidence = [f"{c.name}: {c.forward!r} in the forward, {c.recompute!r} in the recompute" for c in changes[:4]]
    if top.counted_twice:
        by = (f"its forward pre-hook {', '.join(top.hooks)} or its forward" if top.hooks else "its forward")
        detail += (f": each call of {module} changes it (by {by}), and the recompute calls {module} again, so the "
                   "update counts twice")
        evidence.append(f"each call of {module} changes {top.name}: {top.forward_update[0]!r} -> "
                        f"{top.forward_update[1]!r} in the forward, {top.recompute_update[0]!r} -> "
                        f"{top.recompute_update[1]!r} in the recompute (by {by})")
    else:
        detail += ": it was changed between the forward and the backward"
    if op is not None:
        evidence.append(f"first divergence: {op.op} ({', '.join(sorted(first.kinds))}) with identical tensors in")
    return Cause("control_flow" if branch else "state_mutation", top.name, detail, evidence, mechanism="attribute")


def attribute_suggestion(region: Region, name: str) -> Suggestion | None:
    """The fix for a changed attribute (None if `name` is no changed attribute of the region)."""
    change = next((c for c in changed_attributes(region) if c.name == name), None)
    if change is None:
        return None
    attr = name.rsplit(".", 1)[-1]
    if change.counted_twice:
        return Suggestion(
            f"Do not update `{name}` in the checkpointed module's forward or pre-hook",
            "The recompute runs the module (and its forward pre-hooks) again, so an update made there is applied a "
            "second time and the recompute computes with the new value. Update it once per step outside the region "
            "(in the training loop, or an optimizer step hook), or pass the value in as an argument.",
            f"# instead of a forward pre-hook that does `module.{attr} += 1`:\n"
            f"loss.backward()\noptimizer.step()\nfor block in model.blocks:\n    block.{attr} += 1")
    return Suggestion(
        f"Change `{name}` after the backward, not between forward and backward",
        "The recompute reads the attribute as it is during backward. Change it after loss.backward(), or pass the "
        "value to the checkpointed function as an argument (checkpoint keeps its arguments for the recompute).")
