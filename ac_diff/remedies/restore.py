"""`--restore-in-recompute NAME`: the recompute sees the state the region's forward saw, and the current
state is put back after it. This simulates "move the update after backward" (a buffer or attribute the
forward or an optimizer changes) and "give the generator's state to the checkpoint" (a private
torch.Generator), so `ac-diff fix` can prove such a code change before the user makes it.

    RestoreInRecompute(["layers.*.moe.expert_bias"], name_of).apply(call)
    # call.function now holds layers.1.moe.expert_bias as the forward found it, and every later call (a
    # recompute) runs with that value in place, then puts back the value it found

NAME is a glob over fully qualified names, matched dot by dot (`layers.*.bias`): a buffer, tensor attribute,
Python scalar attribute (`layers.1.moe.router.calls`, or a field of a small run config the module holds,
`layers.1.scan.cfg.chunk`, or a scalar a forward hook keeps in its closure, `layers.1.<forward pre-hook warmup>.calls`;
not a parameter), list/tuple/dict/deque attribute (a
memory the forward appends to, `layers.1.attn.mems`: the recompute gets a copy of the forward's), or a
torch.Generator attribute (`layers.1.attn.gen`). A NAME that matches a module instead (`layers.1`) means every
torch.Generator held by that module or its submodules (a LoRA dropout's own, `layers.1.q_proj.lora_dropout.default
.gen`), or read as a global by their forward (`aug_gen = torch.Generator()` beside the class:
`convs.0.<global aug_gen>`). Only what the checkpointed module reaches is restored; a region that is a bare function or a
checkpoint_sequential segment has nothing to restore.

The forward's own updates stand after the recompute, and a module's first forward is never undone: where that
forward also changed other state of the module that holds what NAME names (the flag a lazy initialisation sets when
it fills `amax_history` from the first batch), the recompute of that first forward starts from that state too, so
it initialises again as the forward did instead of reading the empty buffer with the flag already set.
"""

from __future__ import annotations

import copy
import fnmatch
import weakref
from collections import deque
from typing import Any, Callable, Iterator

import torch

from ..capture.dispatch import no_dispatch_modes
from ..capture.modules import clean_fqn
from ..capture.pystate import (CONTAINER_TYPES, NAMED_TYPES, SCALAR_TYPES, forward_hooks, global_state_read, hook_cells,
                               hook_context_vars, method_owners, run_config, scalar_fields)
from ..capture.torch_compat import checkpointed_module
from .call import CheckpointCall


class _Slot:
    """One piece of state: a snapshot of it, and a swap that puts a value in and hands back what was there. A
    tensor is swapped as the module's attribute (the buffer's entry), not by its data: no tensor op runs in
    the recompute for it, so the recording sees only the region's own ops, and the recompute's in-place
    updates land on the snapshot's copy while the module's tensor stays untouched."""

    def __init__(self, owner: Any, attr: str) -> None:
        self.owner, self.attr = owner, attr
        self.label = attr  # what its FQN ends with, after its owner's

    def get(self) -> Any:
        return getattr(self.owner, self.attr, ABSENT)

    def put(self, value: Any) -> None:
        if value is ABSENT:  # (not set yet when the forward began: the recompute finds it unset too)
            vars(self.owner).pop(self.attr, None)
        elif self.attr in getattr(self.owner, "_buffers", ()):  # (a run config the module holds has none)
            self.owner._buffers[self.attr] = value
        else:
            object.__setattr__(self.owner, self.attr, value)

    def snapshot(self) -> Any:
        value = self.get()
        if isinstance(value, torch.Generator):
            return value.get_state()
        return _copy(value)

    def swap(self, value: Any) -> Any:
        current = self.get()
        if isinstance(current, torch.Generator):
            before = current.get_state()
            current.set_state(value)
            return before
        self.put(value)
        return current

    def put_back(self, snapshot: Any) -> None:
        """Put the state `snapshot` holds back (a copy: the snapshot stays as it is)."""
        self.swap(_copy(snapshot))

    def holds(self, snapshot: Any) -> bool:
        """Whether the state still equals `snapshot` (a container of tensors counts as changed)."""
        value = self.get()
        if isinstance(value, torch.Generator):
            value = value.get_state()
        if isinstance(value, torch.Tensor) or isinstance(snapshot, torch.Tensor):
            if not (isinstance(value, torch.Tensor) and isinstance(snapshot, torch.Tensor)
                    and (value.shape, value.dtype) == (snapshot.shape, snapshot.dtype)):
                return False
            with no_dispatch_modes():  # (this runs at the end of the region's forward: not one of its ops)
                return torch.equal(value, snapshot)
        try:
            return type(value) is type(snapshot) and bool(value == snapshot)
        except Exception:  # (tensors inside a container: not compared)
            return False


class _BoundSlot(_Slot):
    """A tensor a module holds (a buffer, `self.last_counts = counts`), kept by identity: a forward that binds another
    tensor to it is undone by binding the original again (its in-place writes are undone elsewhere, op by op)."""

    def snapshot(self) -> Any:
        return self.get()

    def holds(self, snapshot: Any) -> bool:
        return self.get() is snapshot

    def put_back(self, snapshot: Any) -> None:
        self.put(snapshot)


class _HeldContainer(_Slot):
    """A list or dict a module holds (router logits collected for an aux loss, a memory), kept as the object and its
    items: put back in place, so whoever else holds the same object (the parent that collects into it, a module-level
    list) sees it restored too; rebinding a copy left them the replay's items."""

    def snapshot(self) -> Any:
        value = self.get()
        return value, (list(value.items()) if isinstance(value, dict) else list(value))

    def holds(self, snapshot: Any) -> bool:
        held, items = snapshot
        value = self.get()
        now = list(value.items()) if isinstance(value, dict) else list(value)
        return value is held and len(now) == len(items) and all(
            _same_item(a, b) for a, b in zip(now, items))

    def put_back(self, snapshot: Any) -> None:
        held, items = snapshot
        if self.get() is not held:
            self.put(held)
        held.clear()
        (held.update if isinstance(held, dict) else held.extend)(items)


def _same_item(a: Any, b: Any) -> bool:
    if type(a) is tuple and type(b) is tuple:  # (a dict's items)
        return len(a) == len(b) and all(_same_item(x, y) for x, y in zip(a, b))
    if a is b:
        return True
    try:
        return not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor) and type(a) is type(b) and \
            bool(a == b)
    except Exception:  # noqa: BLE001 - an item whose == is not a plain bool
        return False


class _Absent:
    """An attribute a module does not have yet (a memory its first forward creates); not capture.pystate.UNSET, the
    recorded form of one, which is a dict and would be copied as a container."""

    def __repr__(self) -> str:
        return "<unset>"


ABSENT = _Absent()


class _ClosureSlot(_Slot):
    """A scalar a forward (pre-)hook of `owner` keeps in its closure (a warmup hook's call count): swapped in its
    cell, which the hook reads and writes."""

    def __init__(self, owner: torch.nn.Module, label: str, cell: Any) -> None:
        super().__init__(owner, label)
        self.cell = cell

    def get(self) -> Any:
        return self.cell.cell_contents

    def put(self, value: Any) -> None:
        self.cell.cell_contents = value


class _GlobalSlot(_Slot):
    """A torch.Generator the module's forward reads as a module-level global (`aug_gen = torch.Generator()` beside
    the class): its state is swapped, the generator itself stays in its module's namespace."""

    def __init__(self, namespace: dict, name: str) -> None:
        super().__init__(None, name)
        self.namespace = namespace
        self.label = f"<global {name}>"

    def get(self) -> Any:
        return self.namespace.get(self.attr, ABSENT)

    def put(self, value: Any) -> None:
        self.namespace[self.attr] = value


def _global_generators(module: torch.nn.Module) -> Iterator[_GlobalSlot]:
    """The torch.Generators the module's forward names as globals of its own Python module."""
    forward = getattr(type(module), "forward", None)
    code, namespace = getattr(forward, "__code__", None), getattr(forward, "__globals__", None)
    if code is None or not isinstance(namespace, dict):
        return
    for name in code.co_names:
        if isinstance(namespace.get(name), torch.Generator):
            yield _GlobalSlot(namespace, name)


class KeptState:
    """The state of `root`'s modules that their code changes outside autograd's view, as it is now, put back by
    `restore()`: Python attributes (scalars, containers, names), the tensors they hold by identity (a forward that
    keeps its counts for an update after the step, `self.last_counts = counts`; the audit's replays undo in-place
    writes op by op), the counts their hooks keep in their closures, and their private generators and those their
    forward reads as globals."""

    def __init__(self, root: Any) -> None:
        modules = list(root.modules()) if isinstance(root, torch.nn.Module) else []
        self.slots: list[_Slot] = [
            *(_kept_slot(value)(sub, attr) for sub in modules for attr, value in _state_of(sub)),
            *(_ClosureSlot(sub, label, cell) for sub in modules for label, cell, _ in hook_cells(sub)),
            *{(id(g.namespace), g.attr): g for sub in modules for g in _global_generators(sub)}.values(),
            *_global_state(modules),
            *{id(var): _ContextHeld(var) for sub in modules for var in hook_context_vars(sub)}.values()]
        self.saved = [slot.snapshot() for slot in self.slots]

    def restore(self) -> None:
        for slot, value in zip(self.slots, self.saved):
            if not slot.holds(value):
                slot.put_back(value)


class _ContextHeld(_Slot):
    """The list or dict a context variable holds for the hooks of a module (transformers' output collector: the
    router logits each layer's gate hook appends for the aux loss, while the model's forward runs): put back in place,
    a dict's lists too, so that a replay's calls of those hooks leave nothing in it."""

    def __init__(self, var: Any) -> None:
        super().__init__(None, var.name)
        self.var = var
        self.label = f"<context {var.name}>"

    def get(self) -> Any:
        return self.var.get(None)

    def snapshot(self) -> Any:
        value = self.get()
        if isinstance(value, dict):
            return value, [(k, v, list(v) if isinstance(v, list) else None) for k, v in value.items()]
        return value, list(value) if isinstance(value, list) else None

    def holds(self, snapshot: Any) -> bool:
        held, items = snapshot
        if items is None:
            return True
        now = self.snapshot()[1]
        return self.get() is held and len(now) == len(items) and all(_same_item(a, b) for a, b in zip(now, items))

    def put_back(self, snapshot: Any) -> None:
        held, items = snapshot
        if isinstance(held, dict):
            held.clear()
            for key, value, inner in items:
                if inner is not None:
                    value[:] = inner
                held[key] = value
        else:
            held[:] = items


def _global_state(modules: list) -> list[_Slot]:
    """Slots for the module-level state the modules' forwards and hooks read (a global counter, a dict cache, a list
    collected into): scalars by value, containers in place."""
    seen: dict[tuple[int, str], _Slot] = {}
    for sub in modules:
        functions = [(type(sub).forward, method_owners(sub)), *((hook, None) for _, hook in forward_hooks(sub))]
        for fn, owner in functions:
            for space, name in global_state_read(fn, owner):
                if (id(space), name) not in seen:
                    value = space.get(name)
                    kind = _GlobalHeld if isinstance(value, (list, dict, deque)) else _GlobalSlot
                    seen[id(space), name] = kind(space, name)
    return list(seen.values())


class _GlobalHeld(_HeldContainer, _GlobalSlot):
    """A module-level list or dict (a cache, logits collected for a loss): put back in place (_HeldContainer), held in
    its module's namespace (_GlobalSlot)."""


def _kept_slot(value: Any) -> type:
    """How KeptState keeps an attribute's value: a tensor by identity, a list or dict in place, else by value."""
    if isinstance(value, torch.Tensor):
        return _BoundSlot
    return _HeldContainer if isinstance(value, (list, dict, deque)) else _Slot


def fqn_matches(name: str, globs: list[str]) -> bool:
    """Dot by dot: `layers.*.bias` matches `layers.0.bias`, not `layers.0.fc.bias`; `*` and `?` are the wildcards, a
    bracket is itself (an item a hook keeps: `layers.*.<forward pre-hook warm>.calls[0]`)."""
    parts = name.split(".")
    return any(len(g.split(".")) == len(parts) and all(
        fnmatch.fnmatchcase(part, pattern.replace("[", "[[]")) for part, pattern in zip(parts, g.split(".")))
        for g in globs)


def find(root: torch.nn.Module, prefix: str, globs: list[str]) -> dict[str, _Slot]:
    """Every piece of state under `root` (named `prefix`) whose FQN matches, and every generator of a module a glob
    names or of its submodules: `{"layers.1.moe.expert_bias": slot, "layers.1.q_proj.lora_dropout.default.gen":
    slot}`."""
    found: dict[str, _Slot] = {}
    for sub_name, sub in root.named_modules():
        name = clean_fqn(".".join(p for p in (prefix, sub_name) if p))
        parts = name.split(".")
        under = any(fqn_matches(".".join(parts[:k]), globs) for k in range(1, len(parts) + 1))
        for attr, value in _state_of(sub):
            fqn = f"{name}.{attr}" if name else attr
            if fqn_matches(fqn, globs) or (isinstance(value, torch.Generator) and under):
                found[fqn] = _Slot(sub, attr)
        for slot in _global_generators(sub) if under else ():  # (one its code reads: `rand(n, generator=aug_gen)`)
            found[f"{name}.{slot.label}" if name else slot.label] = slot
        for label, cell, _ in hook_cells(sub):  # `layers.0.<forward pre-hook warmup>.calls`
            fqn = f"{name}.{label}" if name else label
            if fqn_matches(fqn, globs):
                found[fqn] = _ClosureSlot(sub, label, cell)
        for attr, value in vars(sub).items():  # a run config the module holds: its fields (`scan.cfg.chunk`)
            if run_config(value):
                for field, _ in scalar_fields(value):
                    fqn = ".".join(p for p in (name, attr, field) if p)
                    if fqn_matches(fqn, globs):
                        found[fqn] = _Slot(value, field)
        for glob in globs:  # an attribute named outright that the module does not have yet: restored as unset
            owner, _, attr = glob.rpartition(".")
            fqn = f"{name}.{attr}" if name else attr
            if attr.isidentifier() and fqn not in found and fqn_matches(name, [owner]) and not hasattr(sub, attr):
                found[fqn] = _Slot(sub, attr)
    return found


def _state_of(module: torch.nn.Module) -> Iterator[tuple[str, Any]]:
    """(attribute, value) of the state a module holds itself: buffers, public tensor / scalar / container / unset
    (None) attributes, and private generators (`self._gen = torch.Generator()`); not parameters: a stand-in would
    take their gradients."""
    attrs = [*module._buffers,
             *(k for k, v in vars(module).items() if not k.startswith("_") or isinstance(v, torch.Generator))]
    for attr in dict.fromkeys(attrs):
        value = getattr(module, attr, None)
        # (None too: a memory the first segment's forward finds unset, and sets before the recompute reads it)
        if value is None or isinstance(value, (torch.Tensor, torch.Generator, *SCALAR_TYPES, *NAMED_TYPES,
                                               *CONTAINER_TYPES)):
            yield attr, value


def _copy(value: Any) -> Any:
    """A copy the forward's later updates do not reach: a tensor's values laid out as they are (a recurrent state
    kept as `h[:, -1]`, strided with gaps: the recompute's views of a contiguous copy would read its values with
    other strides than the forward's), a container's entries (shallow)."""
    if isinstance(value, torch.Tensor):
        copied = value.detach().clone()
        if copied.stride() != value.stride() and value.layout == torch.strided \
                and type(value) in (torch.Tensor, torch.nn.Parameter):
            copied = torch.empty_strided(value.size(), value.stride(), dtype=value.dtype, device=value.device)
            with torch.no_grad():
                copied.copy_(value)
        return copied
    return copy.copy(value) if isinstance(value, CONTAINER_TYPES) else value


class _Restoring:
    """The checkpointed function, run by every recompute (its later calls, early-stopped ones included) with
    the state as the forward found it, then the current state put back. The snapshot and the recompute's
    copy are made when checkpoint() is called, outside the region (a second recompute copies again).
    `replay`: more state, restored only where the forward changed it (an owner's first forward)."""

    def __init__(self, function: Callable, slots: dict[str, _Slot], replay: dict[str, _Slot] | None = None) -> None:
        self._ac_diff_checkpointed = function  # what the recorder names the region after
        self.function, self.slots = function, {**(replay or {}), **slots}
        self.replay = [name for name in replay or () if name not in slots]
        self.snapshot = {name: slot.snapshot() for name, slot in self.slots.items()}
        self.spare: dict[str, Any] | None = {name: _copy(v) for name, v in self.snapshot.items()}
        self.forward_done = False

    def __call__(self, *args, **kwargs):
        if not self.forward_done:
            self.forward_done = True
            try:
                return self.function(*args, **kwargs)
            finally:
                for name in self.replay:  # what the forward left as it found it needs no restoring
                    if self.slots[name].holds(self.snapshot[name]):
                        for table in (self.slots, self.snapshot, self.spare):
                            table.pop(name, None)
        # each recompute updates its own copy in place (the forward hook runs again)
        values, self.spare = self.spare or {name: _copy(v) for name, v in self.snapshot.items()}, None
        held = {name: slot.swap(values[name]) for name, slot in self.slots.items()}
        try:
            return self.function(*args, **kwargs)
        finally:
            for name, slot in self.slots.items():
                slot.swap(held[name])


class RestoreInRecompute:
    kind = "restore"

    def __init__(self, globs: list[str], name_of: Callable[[torch.nn.Module], str]) -> None:
        self.globs = list(globs)
        self.name_of = name_of
        self._started: weakref.WeakSet = weakref.WeakSet()  # the modules whose first forward has run
        self._matched: set[str] = set()  # the globs that named some state of a checkpointed module

    def apply(self, call: CheckpointCall) -> str | None:
        if call.bypass:
            return None
        module, _ = checkpointed_module(call.function)
        if module is None:
            return None
        slots = find(module, self.name_of(module), self.globs)
        if not slots:
            return None
        if len(self._matched) < len(self.globs):
            self._matched.update(g for g in self.globs if g not in self._matched
                                 and find(module, self.name_of(module), [g]))
        call.function = _Restoring(call.function, slots, self._first_forwards(slots))
        return "forward value restored in the recompute: " + ", ".join(slots)

    unmatched_note = ("a buffer, tensor, Python attribute, list or generator of a checkpointed module is restored; a "
                      "parameter is not")

    def unmatched(self) -> list[str]:
        """The globs that named nothing the recompute could be given (a parameter, a misspelt name)."""
        return [g for g in self.globs if g not in self._matched]

    def _first_forwards(self, slots: dict[str, _Slot]) -> dict[str, _Slot]:
        """The rest of the state of each module holding a slot, on that module's first forward: what the forward
        initialises there with it (a flag) is replayed, never left set over the restored buffer."""
        out: dict[str, _Slot] = {}
        for fqn, slot in slots.items():
            if isinstance(slot, _GlobalSlot) or slot.owner in self._started:  # (a global has no module to replay)
                continue
            prefix = fqn[:len(fqn) - len(slot.label)]
            state = _state_of(slot.owner) if isinstance(slot.owner, torch.nn.Module) else scalar_fields(slot.owner)
            out.update({prefix + attr: _Slot(slot.owner, attr) for attr, _ in state})
        self._started.update(slot.owner for slot in slots.values() if not isinstance(slot, _GlobalSlot))
        return out
