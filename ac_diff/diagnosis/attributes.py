"""Python state of the modules a region calls, compared between its forward and its recompute.

The recorder keeps each module's attributes (int/float/bool/str, and list/tuple/dict/deque by length and the
identity of their items) at its first call in a pass, the ones a call changed (a forward pre-hook counting
calls, a forward that appends to a memory), and the scalar module-level globals the modules' code reads
(capture/pystate.py). Here they become the cause when the region diverged on a Python value, not a tensor
(`control_flow` where a branch on it changed the ops):

    attribute_cause(region, first)
    -> Cause(kind="state_mutation", tensor="blocks.0.step", mechanism="attribute",
             detail="the Python attribute `blocks.0.step` was 0 in the forward and 1 in the recompute: ...",
             evidence=["blocks.0.step: 0 in the forward and 1 in the recompute", "each call of blocks.0 changes
                        blocks.0.step: 0 -> 1 in the forward, 1 -> 2 in the recompute (by its forward pre-hook ...)"])
    # a list a forward appends to: "`layers.1.attn.mems` was a list of 1 entry in the forward and 2 in the recompute"
    # a flag a branch reads: Cause(kind="control_flow", tensor="model.LOW_PRECISION", mechanism="global",
    #     detail="... the module-level global `model.LOW_PRECISION` was True in the forward and False in the recompute")
    attribute_suggestion(region, "blocks.0.step") -> Suggestion("Do not update `blocks.0.step` in a forward ...")

A change read where the region first diverged (an attribute of the op's module or one around it, a global
read by the function at the op's source line) is named first; it outranks a random op whose argument it
changed (a dropout's `p` annealed between forward and backward changes bernoulli_'s probability).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

from ..capture.pystate import FORWARD_CLOSURE, FUNCTION_CODE, UNSET, is_container
from ..oprules import COMPILED_GRAPH_OP
from ..passes import OpRecord, Region
from ..report import Cause, Suggestion
from .labels import backticked, module_label
from .passdiff import ARGUMENT_KINDS, PairDiff


@dataclass(frozen=True)
class AttributeChange:
    name: str  # "blocks.0.step", or a global "model.LOW_PRECISION"
    forward: Any
    recompute: Any
    # [before, after] of the call that changed it, in each pass (a call counted again in the recompute)
    forward_update: list | None = None
    recompute_update: list | None = None
    hooks: list[str] = field(default_factory=list)  # the module's forward pre-hooks
    readers: list[str] = field(default_factory=list)  # a global: the functions reading it ("model.py in forward")
    uncalled: bool = False  # an attribute of a module that ran no op: the code around it reads it (`self.dropout.p`)
    read_again: bool = False  # its module's code reads it beyond its update (capture.pystate.read_again)
    rebound: bool = False  # its module's code only binds it, never reads it (capture.pystate.only_rebinds)

    @property
    def counted_twice(self) -> bool:
        """Updated by each pass, from what the previous pass left (a rebinding from the inputs alone repeats the same
        value where the recompute reproduced the forward)."""
        return self.forward_update is not None and self.recompute_update is not None and not self.rebound

    @property
    def is_global(self) -> bool:
        return bool(self.readers)

    def read_by(self, op: OpRecord | None) -> bool:
        """Whether `op` ran where this state is read: in the attribute's module (or one inside it), or in a
        function that reads the global."""
        if op is None:
            return False
        if self.is_global:
            return bool(op.source) and _function_of(op.source) in {r.split(" (")[0] for r in self.readers}
        module = split_name(self.name)[0]
        if op.module is None:
            return False
        if self.uncalled and op.module == (module.rsplit(".", 1)[0] if "." in module else ""):
            return True  # (its parent's code: the module itself never ran)
        return op.module == module or op.module.startswith(module + ".")


def split_name(name: str) -> tuple[str, str]:
    """(the module, the attribute) of a recorded attribute's name: "layers.0.step" -> ("layers.0", "step"); a
    variable a hook of the module keeps (capture.pystate.hook_state), "layers.0.lin.<forward pre-hook warm>.calls"
    -> ("layers.0.lin", "<forward pre-hook warm>.calls")."""
    head, sep, hook = name.partition(".<")
    if sep:
        return head, "<" + hook
    if name.startswith("<"):
        return "", name
    head, bracket, key = name.partition("[")  # (a dict's item, "layers.0.cfg['lr.decay']")
    module, _, attr = head.rpartition(".")
    return module, attr + bracket + key


def hook_variable(name: str) -> tuple[str, str, str] | None:
    """(hook kind, its function's name, the variable) for a hook's own variable, else None."""
    attr = split_name(name)[1]
    if not attr.startswith("<"):
        return None
    label, _, var = attr[1:].partition(">.")
    kind, _, function = label.rpartition(" ")
    return kind, function, var


def _function_of(source: str) -> str:
    """"model.py:12 in forward" -> "model.py in forward" (how a global's readers are named)."""
    place, _, function = source.partition(" in ")
    return f"{place.rsplit(':', 1)[0]} in {function}"


def changed_attributes(region: Region) -> list[AttributeChange]:
    """Attributes and globals with another value at the first reading in the recompute than in the forward."""
    fwd, rec = region.forward, region.recompute
    if fwd is None or rec is None:
        return []
    out = []
    ran = {op.module for op in fwd.ops}
    for name, value in fwd.attributes.items():
        if name in rec.attributes and rec.attributes[name] != value and not _items_tell(name, value, fwd.attributes,
                                                                                        rec.attributes):
            f_up, r_up = fwd.attribute_updates.get(name), rec.attribute_updates.get(name)
            hooks = list((f_up or r_up or [None, None, []])[2] or [])
            module = split_name(name)[0]
            uncalled = bool(module) and not any(m == module or m.startswith(module + ".") for m in ran if m)
            out.append(AttributeChange(name, value, rec.attributes[name], f_up[:2] if f_up else None,
                                       r_up[:2] if r_up else None, hooks, uncalled=uncalled,
                                       read_again=bool(f_up and len(f_up) > 3 and f_up[3]),
                                       rebound=bool(f_up and len(f_up) > 4 and f_up[4])))
    for name, value in fwd.globals.items():
        if name in rec.globals and rec.globals[name] != value and not _items_tell(name, value, fwd.globals,
                                                                                   rec.globals):
            readers = list(dict.fromkeys([*fwd.global_readers.get(name, ()), *rec.global_readers.get(name, ())]))
            f_up, r_up = fwd.global_updates.get(name), rec.global_updates.get(name)
            # (read by a function of its own, `temperature()` beside the forward's `STEP += 1`: beyond its update)
            out.append(AttributeChange(name, value, rec.globals[name], f_up, r_up, readers=readers or ["?"],
                                       read_again=len({r.split(" (")[0] for r in readers}) > 1))
    return out


def _items_tell(name: str, value: Any, forward: dict, recompute: dict) -> bool:
    """A container whose scalar items are recorded by key, one of which changed, its length the same: the item says
    it (`cfg['stage']`, a helper's `calls[0]`)."""
    other = recompute[name]
    if not (is_container(value) and is_container(other) and value["len"] == other["len"]):
        return False
    return any(key.startswith(name + "[") and recompute.get(key, v) != v for key, v in forward.items())


def counted_twice(region: Region) -> list[tuple[AttributeChange, str]]:
    """Attributes and globals the region's own code changes in each pass (a counter its forward increments, a
    fade-in schedule's step), each with how it changed: under AC the recompute changes them again, so they
    advance twice per step, and what later steps compute from them differs from a run without AC."""
    return [(c, f"{_shown_update(c.forward_update)} in the forward, {_shown_update(c.recompute_update)} in the "
                f"recompute") for c in changed_attributes(region) if c.counted_twice]


def code_name(change: AttributeChange) -> str:
    """How the code names a global: "train.PhiloxState.offset" read in train.py -> `PhiloxState.offset`,
    "model.LOW_PRECISION" -> `LOW_PRECISION` (a global's name begins with the module its readers are in); one of
    another module, which its readers read through it, whole: "hparams.TEMP" read in train.py -> `hparams.TEMP`."""
    for reader in change.readers:
        stem = os.path.splitext(os.path.basename(reader.split(" in ")[0]))[0]
        head, sep, rest = change.name.partition(stem + ".")
        if sep and rest and (not head or head.endswith(".")):
            return rest
    return change.name if any(r != "?" for r in change.readers) else split_name(change.name)[1]


def shown(value: Any) -> str:
    """An attribute's recorded value as a report shows it: `0.1`, `'residual'`, "a list of 2 entries"."""
    if value == UNSET:
        return "unset"
    return f"a {value['type']} of {_entries(value['len'])}" if is_container(value) else repr(value)


def _entries(n: int) -> str:
    return f"{n} entr{'y' if n == 1 else 'ies'}"


def change_words(forward: Any, recompute: Any) -> str:
    """"0 in the forward and 1 in the recompute"; "a list of 1 entry in the forward and 2 in the recompute"; "a
    list of 2 entries in both passes, with other items in the recompute"."""
    if is_container(forward) and is_container(recompute) and forward["type"] == recompute["type"]:
        a, b = forward["len"], recompute["len"]
        if a == b:
            return f"{shown(forward)} in both passes, with other items in the recompute"
        return f"{shown(forward)} in the forward and {b} in the recompute"
    a, b = _distinct(forward, recompute)
    return f"{a} in the forward and {b} in the recompute"


def _distinct(a: Any, b: Any) -> tuple[str, str]:
    """Two values with as few digits as tell them apart: (0.1, 0.09000000000000001) -> ("0.1", "0.09")."""
    if type(a) is float and type(b) is float:
        for digits in (6, 9, 12, 17):
            x, y = _float_text(a, digits), _float_text(b, digits)
            if x != y:
                return x, y
    return shown(a), shown(b)


def _float_text(x: float, digits: int) -> str:
    """`x` to `digits` significant digits, still reading as a float: 1.0 -> "1.0", not "1"."""
    text = f"{x:.{digits}g}"
    return text if any(c in text for c in ".einf") else text + ".0"


def _what(change: AttributeChange) -> str:
    hook = hook_variable(change.name)
    if hook is not None:
        module = split_name(change.name)[0]
        return f"`{hook[2]}`, which the {hook[0]} `{hook[1]}` of {module} keeps {_kept_in(hook[2])},"
    return (f"the module-level global `{change.name}`" if change.is_global else
            f"the Python attribute `{change.name}`")


def other_compiled_graph(region: Region) -> bool:
    """The recompute called a compiled graph the forward did not call (torch.compile compiled again)."""
    called = {o.args[0] for o in region.forward.ops if o.op == COMPILED_GRAPH_OP and o.args}
    return any(o.op == COMPILED_GRAPH_OP and o.args and o.args[0] not in called for o in region.recompute.ops)


def attribute_cause(region: Region, first: PairDiff | None, drew: bool = False) -> Cause | None:
    """The changed attribute behind a divergence that no tensor explains: the first divergent op read
    identical tensors (a Python number argument changed, or another branch was taken). A random op's other
    values are its own (RNG) unless its arguments changed too, and a change read where it ran explains them. `drew`:
    the forward drew from the host's generators (`random`, numpy), which then explain what it set from them too (a
    CutMix ratio it keeps for the loss): only attributes it did not set itself are causes."""
    changes = changed_attributes(region)
    if drew:
        changes = [c for c in changes if not _set_by_forward(c)]
    saved_other = saved_by_other_ops(region) if changes and first is None else None
    if not changes or (first is None and saved_other is None) or first is not None and first.inputs_same is False:
        return None
    op = (first.forward or first.recompute) if first is not None else None
    if op is not None and op.random and "value" in first.kinds:
        if not first.kinds & (ARGUMENT_KINDS | {"control"}):
            return None
        if not any(c.read_by(op) for c in changes):
            return None
    # (an attribute changed between the passes before one the region's own forward sets: a statistic it writes;
    # one both passes read alike, whose update only came out otherwise, a monitor's maximum, follows from the other)
    passed = _changed_arguments(first) if first is not None else set()  # (what it was, where an op's argument)
    top = min(changes, key=lambda c: (not c.read_by(op), not _numbers(c) or (c.forward, c.recompute) not in passed,
                                      c.forward == c.recompute, _set_by_forward(c), not c.counted_twice))
    module = module_label(split_name(top.name)[0]) if split_name(top.name)[0] else "the module"
    branch = first is None or "control" in first.kinds  # Python code took another branch on it
    why = ("the recompute ran another compiled graph than the forward (a guard torch.compile put on what changed "
           "failed): " if other_compiled_graph(region) else
           f"the recompute saved other tensors than the forward ({saved_other}: Python code took another branch"
           + (", before the recompute ran any op" if not region.recompute.ops else
              ", whose own ops torch's early stop cut off") + "): " if saved_other else
           "the recompute ran another sequence of ops (Python code took another branch): " if branch else "")
    root = _counting_pre_hook(top, changes)
    detail = why + f"{_what(top)} was {change_words(top.forward, top.recompute)}"
    evidence = [f"{c.name}: {change_words(c.forward, c.recompute)}"
                + (f" (read by {', '.join(c.readers[:2])})" if c.is_global else "") for c in changes[:4]]
    if root is not None:  # (the body reads what the pre-hook set: the values after each pass's update)
        kind, function, var = hook_variable(root.name)
        detail = (why + f"{_what(top)} was {change_words(top.forward_update[1], top.recompute_update[1])}: "
                  f"{module}'s {kind} `{function}` sets it at each call from `{var}`, a count it keeps {_kept_in(var)} "
                  f"({_shown_update(root.forward_update)} in the forward, {_shown_update(root.recompute_update)} in "
                  f"the recompute), and the recompute calls {module}, and its hooks, again, so the count advances "
                  "twice")
        evidence.append(f"each call of {module} changes {root.name} and {top.name}: "
                        f"{_shown_update(root.forward_update)} and {_shown_update(top.forward_update)} in the forward, "
                        f"{_shown_update(root.recompute_update)} and {_shown_update(top.recompute_update)} in the "
                        "recompute")
    elif top.counted_twice and top.is_global:
        detail += (f": the region's code changes it ({_shown_update(top.forward_update)} in the forward), and the "
                   f"recompute runs that code again ({_shown_update(top.recompute_update)}), so the update counts "
                   "twice")
        evidence.append(f"{top.name} changed during each pass: {_shown_update(top.forward_update)} in the forward, "
                        f"{_shown_update(top.recompute_update)} in the recompute")
    elif top.counted_twice:
        by = f"its forward pre-hook {backticked(top.hooks)} or its forward" if top.hooks else "its forward"
        detail += (f": each call of {module} changes it (by {by}), and the recompute calls {module} again, so the "
                   "update counts twice")
        evidence.append(f"each call of {module} changes {top.name}: {_shown_update(top.forward_update)} in the "
                        f"forward, {_shown_update(top.recompute_update)} in the recompute (by {by})")
    elif top.is_global:
        detail += ": it was set for the forward and changed before the backward, whose recompute reads it again"
    elif _set_by_forward(top):  # the forward changed it once
        # (a hook, its code) after reading it, and the recompute read what it left
        detail += (f": the region's forward changed it ({_shown_update(top.forward_update)}, in {module}'s code or a "
                   "hook) after reading it, so the recompute starts from the new value")
    elif _rebuilt_later(top):
        detail += (f": the region's forward set it ({_shown_update(top.forward_update)}, in {module}'s code or a "
                   f"hook), and it was set again ({shown(top.forward_update[1])} -> {shown(top.recompute)}) before "
                   "this recompute: by a later forward of the module (another micro-batch, a longer sequence: a lazy "
                   "cache rebuilt) or by the loop")
    else:
        detail += ": it was changed between the forward and the backward"
    if op is not None:
        evidence.append(f"first divergence: {op.op} ({', '.join(sorted(first.kinds))}), its input tensors identical")
    elif saved_other:
        evidence.append(saved_other)
    # what a restore must cover: every module attribute that changed (a scheduler moved each dropout's `p`)
    # (not one the region's own forward set, a statistic it writes: nothing changed it between the passes; unless it
    # is the same state as the cause's in another module: each linear's delayed fp8 scale)
    leaf = split_name(top.name)[1]
    names = [top.name] if top.is_global else [top.name, *(
        c.name for c in changes
        if c is not top and not c.is_global and (not _set_by_forward(c) or split_name(c.name)[1] == leaf))]
    if root is not None:  # (the count is what to fix: the fix for the hook, the restore of both)
        top, names = root, [root.name, *(n for n in names if n != root.name)]
    return Cause("control_flow" if branch else "state_mutation", top.name, detail, evidence,
                 mechanism="global" if top.is_global else "attribute", names=names)


def saved_before_any_op(region: Region) -> str | None:
    """A recompute that ended before any op of it reached the recorder, having saved other tensors than the forward:
    autograd saves an op's inputs before its kernel runs, so torch's early stop (or its check) can end the recompute
    inside its first op, a LayerNorm the forward never ran saving its weight where the forward saved the block's
    input. Says which position differs and how ("position 0: input[0] in the forward, ln.bias in the recompute")."""
    fwd, rec = region.forward, region.recompute
    if fwd is None or rec is None or rec.ops:
        return None
    return saved_by_other_ops(region)


def saved_by_other_ops(region: Region) -> str | None:
    """The first saved position the two passes filled from other ops (the output of relu in the forward, of the
    addmm feeding gelu in the recompute: another branch, whose own ops torch's early stop cut off before they ran)."""
    fwd, rec = region.forward, region.recompute
    if fwd is None or rec is None or not rec.positions:
        return None
    for a, b in zip(fwd.positions, rec.positions):
        label_a, label_b = _saved_label(fwd, a), _saved_label(rec, b)
        if label_a != label_b:
            return f"position {a.position}: {label_a} in the forward, {label_b} in the recompute"
    return None


def _saved_label(p: Any, position: Any) -> str:
    if position.origin == "op":
        op = next((o for o in p.ops if o.index == position.op_index), None)
        return f"the output of {op.op}" if op is not None else "an op's output"
    return position.name or position.origin


def _kept_in(var: str) -> str:
    """Where a hook keeps `var`: "in its closure", or for an item (`calls[0]`) "in `calls`, a list or dict its closure
    or a default argument holds"."""
    head, item, _ = var.partition("[")
    return f"in `{head}`, a list or dict its closure or a default argument holds" if item else "in its closure"


def _counting_pre_hook(top: AttributeChange, changes: list[AttributeChange]) -> AttributeChange | None:
    """The variable a forward pre-hook of `top`'s module keeps in its closure and advances at each call, where that
    hook also sets `top` at each call (a warmup hook that counts its calls and sets the block's `alpha`): the count is
    the state the recompute advances a second time, `top` follows from it."""
    owner = split_name(top.name)[0]
    if not (top.counted_twice and top.hooks and not top.is_global) or hook_variable(top.name) is not None:
        return None
    return next((c for c in changes if c.counted_twice and split_name(c.name)[0] == owner
                 and (hook_variable(c.name) or ("",))[0] == "forward pre-hook"), None)


def _numbers(change: AttributeChange) -> bool:
    return all(isinstance(v, (int, float)) for v in (change.forward, change.recompute))


def _changed_arguments(first: PairDiff) -> set[tuple]:
    """(forward, recompute) of each number argument that differs between the ops of `first` (a scale 0.25 -> 0.216
    passed to a mul): an attribute that held exactly those values is the one passed."""
    if first.forward is None or first.recompute is None or "argument" not in first.kinds:
        return set()
    return {(a, b) for a, b in zip(first.forward.args, first.recompute.args)
            if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a != b}


def _rebuilt_later(change: AttributeChange) -> bool:
    """The region's forward set the attribute, and something set it again before the recompute read it."""
    return change.forward_update is not None and change.forward_update[1] != change.recompute \
        and not change.counted_twice


def _set_by_forward(change: AttributeChange) -> bool:
    """The region's forward set the attribute to the value the recompute then read (a statistic it writes)."""
    return change.forward_update is not None and change.forward_update[1] == change.recompute


def function_state_cause(region: Region) -> Cause | None:
    """A reentrant region whose recompute matched its forward op by op, where a global read by a custom
    autograd.Function's forward changed between the passes: the backward runs on the graph the recompute built, so a
    value that Function keeps on `ctx` for its backward (a gradient scale) is the recompute's. None otherwise."""
    if region.kind != "reentrant":
        return None
    change = next((c for c in changed_attributes(region) if c.is_global
                   and any(r.endswith(FUNCTION_CODE) and _ran(r, region) for r in c.readers)), None)
    if change is None:
        return None
    reader = next(r for r in change.readers if r.endswith(FUNCTION_CODE) and _ran(r, region))
    return Cause("state_mutation", change.name,
                 f"{_what(change)} was {change_words(change.forward, change.recompute)}, read by a custom "
                 f"autograd.Function ({reader.removesuffix(' ' + FUNCTION_CODE)}): with use_reentrant=True the "
                 "backward runs on the graph the recompute built, so a value that Function keeps on ctx for its "
                 "backward comes from the recompute. Every op matched, and the gradients may still differ",
                 [f"{change.name}: {change_words(change.forward, change.recompute)} (read by {reader})"],
                 mechanism="global", names=[change.name])


_SPAN = re.compile(r"^(?P<file>.+):(?P<first>\d+)-(?P<last>\d+) in ")


def _ran(reader: str, region: Region) -> bool:
    """Whether the autograd.Function forward `reader` names ran in the region: an op of either pass was recorded at
    one of its lines ("dann_grl.py:24-28 in GradReverse.forward"); static reading alone also follows calls in a
    branch the region never takes. A reader without its lines (an older trace) counts as run."""
    span = _SPAN.match(reader)
    if span is None:
        return True
    first, last = int(span["first"]), int(span["last"])
    for p in (region.forward, region.recompute):
        for op in p.ops if p is not None else ():
            where_ = (op.source or "").split(" in ", 1)[0]
            file, _, line = where_.rpartition(":")
            if file == span["file"] and line.isdigit() and first <= int(line) <= last:
                return True
    return False


def _shown_update(update: list) -> str:
    before, after = update
    if is_container(before) and is_container(after):
        return f"{before['len']} -> {after['len']} entries"
    return " -> ".join(_distinct(before, after))


def update_code(change: AttributeChange) -> str:
    """The code of the fix for an attribute the region's code updates, made once per forward outside the region, as
    a run without AC makes it: before the forward where its code reads the updated value (a schedule that counts
    the batch first), else after the backward."""
    hook = hook_variable(change.name)
    if hook is not None:  # (kept by a function: a hook's closure, a forward's factory; no attribute to set outside)
        return guarded_count_code(change, *hook)
    owner, attr = split_name(change.name)
    where = f"its pre-hook ({', '.join(change.hooks[:2])})" if change.hooks else "its forward"
    layer = re.fullmatch(r"(.+)\.(\d+)", owner or "")  # one of a ModuleList's layers: each updates its own
    module = "m" if layer else f'model.get_submodule("{owner}")' if owner else "model"
    before, after = change.forward_update
    # a counter advances by a step of its own; any other value (a float EMA) by what its update computes
    update = (f"{module}.{attr} += {after - before!r}" if all(type(v) is int for v in (before, after))
              else f"{module}.{attr} = ...  # the update {where} made ({shown(before)} -> {shown(after)} once), here")
    if layer:
        update = f'for m in model.get_submodule("{layer.group(1)}"):  # every layer\n    {update}'
    if change.read_again:
        return (f"# {where}: read self.{attr}, do not change it\n# before the forward that reads it, outside the "
                f"checkpointed region:\n{update}\nloss = model(batch)\nloss.backward()")
    return (f"# {where}: read self.{attr}, do not change it\nloss.backward()\noptimizer.step()\n# once per step:\n"
            f"{update}")


def guarded_count_code(change: AttributeChange, kind: str, function: str, var: str) -> str:
    """The fix's code for a count a function keeps (a hook's closure variable, an item of a list it holds, a forward's
    factory state): it advances only outside the recompute, which then reads what its forward read."""
    nonlocal_line = "" if "[" in var else f"    nonlocal {var}\n"  # (an item changes without rebinding the name)
    head = (f"def {function}(self, *args):  # its forward, which reads `{var.partition('[')[0]}` from the code that "
            "made its class\n" if kind == FORWARD_CLOSURE else f"def {function}(mod, *args):  # the {kind}\n")
    return ("IN_BACKWARD = False  # at module level, beside it\n" + head + nonlocal_line +
            f"    if not IN_BACKWARD:  # the recompute reuses the count its forward reached\n"
            f"        {var} {_advance(change)}\n"
            f"    ...  # the rest as before: what it computes from {var}\n"
            "# in the training loop (inside a function: `global IN_BACKWARD` first):\n"
            "IN_BACKWARD = True\nloss.backward()\nIN_BACKWARD = False")


def _advance(change: AttributeChange) -> str:
    """The update a pass made, as code: "+= 1" for a counter, "= ...  # its update" otherwise."""
    before, after = change.forward_update or (None, None)
    if all(type(v) is int for v in (before, after)):
        return f"+= {after - before!r}"
    return f"= ...  # its update ({shown(before)} -> {shown(after)} once)"


def attribute_suggestion(region: Region, name: str) -> Suggestion | None:
    """The fix for a changed attribute or global (None if `name` is neither, in the region)."""
    changes = changed_attributes(region)
    change = next((c for c in changes if c.name == name), None)
    if change is None:
        return None
    attr = split_name(name)[1]
    if change.is_global and change.counted_twice:
        var = code_name(change)
        before, after = change.forward_update
        advance = (f"{var} += {after - before!r}" if all(type(v) in (int, float) for v in (before, after))
                   else f"{var} = ...  # what the forward set it to ({shown(before)} -> {shown(after)})")
        return Suggestion(
            f"Do not change the global `{var}` in the checkpointed forward: the recompute changes it again",
            f"The region's code changes `{name}` ({_shown_update(change.forward_update)}), and the recompute runs "
            f"that code again inside loss.backward(): it starts from {shown(change.recompute)} and computes with it. "
            "Read the value outside the region and pass it to the checkpointed function as an argument (checkpoint "
            "keeps its arguments for the recompute), and advance it there, once per call.",
            f"value = {var}  # read once, outside the checkpointed forward\n"
            f"out = checkpoint(block, x, value, use_reentrant=False)  # the forward uses `value`, not {var}\n"
            f"{advance}  # advanced outside the region: the recompute sees `value` again")
    if change.is_global:
        var = code_name(change)
        return Suggestion(
            f"Keep the global `{var}` as the forward saw it until after the backward",
            f"The recompute runs inside loss.backward() and reads `{name}` as it is then ({shown(change.recompute)}, "
            f"not the forward's {shown(change.forward)}), so it computes with that value, or branches on it. Set it "
            "around the forward and "
            "the backward together, or pass the value to the checkpointed module as an argument (checkpoint keeps "
            "its arguments for the recompute).",
            f"{var} = {change.forward!r}\nloss = model(batch)\nloss.backward()  # the recompute reads {var} here\n"
            f"{var} = {change.recompute!r}")
    # (a container the forward itself changes, a cache it appends to; one changed between forward and backward, a
    # config dict a callback updates, is changed after the backward as any attribute)
    if is_container(change.forward) and (change.counted_twice or change.forward_update is not None):
        return Suggestion(
            f"Do not change `{name}` in the checkpointed forward; update it after the backward",
            f"The recompute runs the module's forward again and reads the {change.forward['type']} as it is then "
            f"({change_words(change.forward, change.recompute)}). A cache kept for generation (past keys and "
            "values): keep it off while training (`use_cache=False`, as Hugging Face sets it under gradient "
            "checkpointing). Else append (or replace) its entries after loss.backward(), or hand the forward a "
            "snapshot as an argument (checkpoint keeps its arguments for the recompute). `ac-diff fix` can simulate "
            f"this: --restore-in-recompute restores `{name}` for the recompute.",
            f"# in forward: read self.{attr}, return the new entry instead of appending it\n"
            f"out, new_entry = model(batch)\nloss = loss_fn(out)\nloss.backward()\n"
            f"module.{attr}.append(new_entry.detach())  # after the backward")
    hook = hook_variable(name)
    if hook is not None:
        kind, function, var = hook
        item = "[" in var  # (an item of a list or dict it keeps: no `nonlocal` needed to change it)
        return Suggestion(
            f"Do not count `{var}` in the {kind} `{function}` of {split_name(name)[0]}: the recompute calls it again",
            f"The {kind} keeps `{var}` {_kept_in(var)}{',' if item else ''} and changes it at each call of the module; "
            "the recompute calls "
            "the module, and its hooks, a second time, so the hook sees another value and the recompute computes "
            f"with it. Let the hook leave `{var}` alone in the recompute (a flag the loop sets around loss.backward(): "
            f"the recompute then reads the count its forward reached, and the hook does the rest as before), or keep "
            f"`{var}` outside the hook (the training loop's step, passed to the model).",
            guarded_count_code(change, kind, function, var))
    if _rebuilt_later(change):
        return Suggestion(
            f"Build what sets `{name}` once, outside the checkpointed forward",
            f"The region's forward sets `{name}` (a lazily built cache and its size), and a later forward of the "
            "module sets it again before this region's recompute, which then reads the later one. Build it once "
            "before training for the largest size, or compute it outside the checkpointed module and pass it in "
            "(checkpoint keeps its arguments for the recompute).",
            f"model.get_submodule(\"{split_name(name)[0]}\")  # build its cache for the longest sequence before the "
            "first forward\n# (e.g. rotary cos/sin for max_seq_len), and never grow it inside forward()")
    if change.counted_twice:
        return Suggestion(
            f"Do not update `{name}` in the checkpointed module's forward or pre-hook",
            "The recompute runs the module (and its forward pre-hooks) again, so an update made there is applied a "
            "second time and the recompute computes with the new value. "
            + ("Its code reads the updated value: make the update in the training loop, right before the forward "
               "(it then reads what it read without AC), or pass the value in as an argument."
               if change.read_again else "Update it once per step outside the region (in the training loop, or an "
               "optimizer step hook), or pass the value in as an argument."),
            update_code(change))
    also = [c.name for c in changes if c is not change and not c.is_global and not c.counted_twice
            and not _set_by_forward(c)]
    names = backticked([name, *also])
    return Suggestion(
        f"Change {names} after the backward, not between forward and backward",
        "The recompute reads the attribute as it is during backward. Change it after loss.backward(), or pass the "
        "value to the checkpointed function as an argument (checkpoint keeps its arguments for the recompute): where "
        "another forward needs the new value before this backward (an adapter switched for another task), only the "
        "argument, or a backward per forward, keeps what each forward computed.",
        f"out = checkpoint(block, x, value, use_reentrant=False)  # forward(x, value) uses `value`, not self.{attr}\n"
        "# or: loss.backward() for this forward before changing it for the next")
