"""`--restore-in-recompute NAME`: the recompute sees the state the region's forward saw, and the current
state is put back after it. This simulates "move the update after backward" (a buffer or attribute the
forward or an optimizer changes) and "give the generator's state to the checkpoint" (a private
torch.Generator), so `ac-diff fix` can prove such a code change before the user makes it.

    RestoreInRecompute(["layers.*.moe.expert_bias"], name_of).apply(call)
    # call.function now holds layers.1.moe.expert_bias as the forward found it, and every later call (a
    # recompute) runs with that value in place, then puts back the value it found

NAME is a glob over fully qualified names, matched dot by dot (`layers.*.bias`): a buffer, tensor attribute
or Python scalar attribute (`layers.1.moe.router.calls`; not a parameter), or a torch.Generator attribute
(`layers.1.attn.gen`). A NAME that matches a module instead (`layers.1`) means every torch.Generator held by
that module or its submodules. Only what the checkpointed module reaches is restored; a region that is a
bare function or a checkpoint_sequential segment has nothing to restore.
"""

from __future__ import annotations

import fnmatch
from typing import Any, Callable

import torch

from ..capture.modules import clean_fqn
from ..capture.torch_compat import checkpointed_module
from .call import CheckpointCall

_SCALARS = (bool, int, float, str)


class _Slot:
    """One piece of state: a snapshot of it, and a swap that puts a value in and hands back what was there. A
    tensor is swapped as the module's attribute (the buffer's entry), not by its data: no tensor op runs in
    the recompute for it, so the recording sees only the region's own ops, and the recompute's in-place
    updates land on the snapshot's copy while the module's tensor stays untouched."""

    def __init__(self, owner: Any, attr: str) -> None:
        self.owner, self.attr = owner, attr

    def snapshot(self) -> Any:
        value = getattr(self.owner, self.attr)
        if isinstance(value, torch.Generator):
            return value.get_state()
        return value.detach().clone() if isinstance(value, torch.Tensor) else value

    def swap(self, value: Any) -> Any:
        current = getattr(self.owner, self.attr)
        if isinstance(current, torch.Generator):
            before = current.get_state()
            current.set_state(value)
            return before
        if self.attr in self.owner._buffers:
            self.owner._buffers[self.attr] = value
        else:
            object.__setattr__(self.owner, self.attr, value)
        return current


def fqn_matches(name: str, globs: list[str]) -> bool:
    """Dot by dot: `layers.*.bias` matches `layers.0.bias`, not `layers.0.fc.bias`."""
    parts = name.split(".")
    return any(len(g.split(".")) == len(parts) and all(map(fnmatch.fnmatchcase, parts, g.split(".")))
               for g in globs)


def find(root: torch.nn.Module, prefix: str, globs: list[str]) -> dict[str, _Slot]:
    """Every piece of state under `root` (named `prefix`) whose FQN matches: `{"layers.1.moe.expert_bias": slot}`."""
    found: dict[str, _Slot] = {}
    for sub_name, sub in root.named_modules():
        name = clean_fqn(".".join(p for p in (prefix, sub_name) if p))
        module_matches = fqn_matches(name, globs)
        # buffers, public attributes, and private generators (`self._gen = torch.Generator()`); not parameters:
        # a stand-in would take their gradients
        attrs = [*sub._buffers,
                 *(k for k, v in vars(sub).items() if not k.startswith("_") or isinstance(v, torch.Generator))]
        for attr in dict.fromkeys(attrs):
            value = getattr(sub, attr, None)
            if not isinstance(value, (torch.Tensor, torch.Generator, *_SCALARS)):
                continue
            fqn = f"{name}.{attr}" if name else attr
            if fqn_matches(fqn, globs) or (isinstance(value, torch.Generator) and module_matches):
                found[fqn] = _Slot(sub, attr)
    return found


def _copy(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value


class _Restoring:
    """The checkpointed function, run by every recompute (its later calls, early-stopped ones included) with
    the state as the forward found it, then the current state put back. The snapshot and the recompute's
    copy are made when checkpoint() is called, outside the region (a second recompute copies again)."""

    def __init__(self, function: Callable, slots: dict[str, _Slot]) -> None:
        self._ac_diff_checkpointed = function  # what the recorder names the region after
        self.function, self.slots = function, slots
        self.snapshot = {name: slot.snapshot() for name, slot in slots.items()}
        self.spare: dict[str, Any] | None = {name: _copy(v) for name, v in self.snapshot.items()}
        self.forward_done = False

    def __call__(self, *args, **kwargs):
        if not self.forward_done:
            self.forward_done = True
            return self.function(*args, **kwargs)
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

    def apply(self, call: CheckpointCall) -> str | None:
        if call.bypass:
            return None
        module, _ = checkpointed_module(call.function)
        if module is None:
            return None
        slots = find(module, self.name_of(module), self.globs)
        if not slots:
            return None
        call.function = _Restoring(call.function, slots)
        return "forward value restored in the recompute: " + ", ".join(slots)
