"""What reentrant checkpoint silently drops, seen while the script runs (a watcher of remedies.CheckpointPatch).

    watch = ReentrantWatch(stack)           # CheckpointPatch(spec, watchers=[watch]); stack: its ModuleStack
    ...                                     # the script runs
    watch.findings()  ->  [{"kind": "side_output", "region": "model.layers.0", "module": "model.layers.0.mlp.gate",
                            "op": "aten.mm.default", "source": "modeling_mixtral.py:112 in forward",
                            "shape": [64, 4], "holder": "a list or dict (a hook or the model collects it)", "calls": 2},
                           {"kind": "no_grad_inputs", "region": "layers.0", "parameters": ["layers.0.lora_a", ...]}]

Under `use_reentrant=True` the region's forward runs under no_grad. A float tensor made there from
something that requires grad, that is still alive after the region returns but is not (a view of) one of
its outputs, left through another way (a forward hook, a module attribute, a list the model collects):
it has `requires_grad=False`, so whatever the script computes from it (a router aux loss) gives no
gradient. A region none of whose inputs require grad gives its parameters no gradient at all.
"""

from __future__ import annotations

import gc
import os
import sys
import weakref
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..capture.sourceline import user_source
from ..capture.state import autocast_on
from ..oprules import DETACHED_ALIAS_OPS, is_autocast_weight_cast
from ..own_files import is_own_file
from ..capture.torch_compat import checkpointed_module, parameters_losing_grad

MAX_TENSORS = 1 << 16  # per region forward: beyond this, stop tracking (bounded memory)


def tree_leaves(obj: Any, depth: int = 0) -> list[Any]:
    """The leaves of nested lists, tuples and dicts (HF ModelOutput is a dict)."""
    if depth > 8:
        return []
    if isinstance(obj, (list, tuple)):
        return [leaf for item in obj for leaf in tree_leaves(item, depth + 1)]
    if isinstance(obj, dict):
        return [leaf for item in obj.values() for leaf in tree_leaves(item, depth + 1)]
    return [obj]


def _storage(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except Exception:  # wrapper subclasses, sparse: not tracked
        return None


_TORCH_ROOT = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def _from_ac_diff() -> bool:
    """The op was issued by ac-diff itself (the recorder's fingerprints in its own dispatch handler, which
    sits above this mode), not by the region: the first frame outside torch, above this handler, is ours."""
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename.startswith(_TORCH_ROOT)
                                 or frame.f_code.co_name == "__torch_dispatch__"):  # modes passing the op on
        frame = frame.f_back
    if frame is None:
        return False
    return is_own_file(frame.f_code.co_filename)


class _Made(TorchDispatchMode):
    """Weak references to the float tensors ops make inside one region forward that would require grad."""

    def __init__(self, current_module: Callable[[], str | None], grad_storages: set[int],
                 autocast: bool = False) -> None:
        super().__init__()
        self.current_module = current_module
        self.autocast = autocast  # on as the region began (within an op's dispatch autocast reads as off)
        self.grad_storages = grad_storages  # storages that carry a gradient without no_grad
        self.outside = set(grad_storages)  # theirs from outside the region (its inputs, parameters: alive throughout)
        self.new_storages: set[int] = set()
        self.made: list[tuple[weakref.ref, int, str, str | None, str | None, list[int]]] = []
        # the tensors made in the region that would carry a gradient, by identity: not the region's `h.detach()` (for
        # logging or fp8's amax; autograd wraps detach's result in a new tensor), meant to carry none, nor what is
        # computed from it alone; nor a tensor whose memory a freed one's had (storage addresses are reused)
        self.carrying: dict[int, weakref.ref] = {}
        self.detached: dict[int, weakref.ref] = {}  # detach's own results (of the region's inputs, parameters)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if str(func) in DETACHED_ALIAS_OPS:
            self.detached.update((id(t), weakref.ref(t)) for t in tree_leaves(out) if isinstance(t, torch.Tensor))
            return out
        if len(self.made) >= MAX_TENSORS or _from_ac_diff():
            return out
        inputs = [a for a in tree_leaves((args, kwargs or {})) if isinstance(a, torch.Tensor)]
        if not any(a.requires_grad or _held(self.carrying, a) or _storage(a) in self.outside
                   and not _held(self.detached, a) for a in inputs):
            return out
        if is_autocast_weight_cast(str(func), self.autocast, not {_storage(a) for a in inputs} & self.new_storages):
            return out
        in_storages = {_storage(a) for a in inputs} - self.new_storages
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                key = _storage(t)
                if key is None or key in in_storages:
                    continue  # in place on, or a view of, something that existed before the region
                self.grad_storages.add(key)
                self.new_storages.add(key)
                self.carrying[id(t)] = weakref.ref(t)
                self.made.append((weakref.ref(t), key, str(func), self.current_module(), user_source(), list(t.shape)))
        return out


def _held(refs: dict[int, weakref.ref], t: torch.Tensor) -> bool:
    """`t` is the tensor `refs` holds under its id (alive: an id is reused once its tensor is freed)."""
    held = refs.get(id(t))
    return held is not None and held() is t


class ReentrantWatch:
    def __init__(self, stack: Any) -> None:
        self.stack = stack
        self._found: dict[tuple, dict[str, Any]] = {}

    def __call__(self, call: Any, run: Callable[[], Any]) -> Any:
        if not call.reentrant or not torch.is_grad_enabled():
            return run()
        inputs = [a for a in tree_leaves((call.args, call.kwargs)) if isinstance(a, torch.Tensor)]
        module, _ = checkpointed_module(call.function)
        lost = parameters_losing_grad(call.function, call.args)
        if lost is not None and lost[1]:
            self._add(("no_grad_inputs", call.region), {
                "kind": "no_grad_inputs", "region": call.region,
                "parameters": [f"{call.region}.{n}" if call.region else n for n in lost[1]]})
        grad = {_storage(t) for t in inputs if t.requires_grad}
        if module is not None:
            grad |= {_storage(p) for p in module.parameters() if p.requires_grad}
        mode = _Made(self.stack.current, grad, autocast_on())
        with mode:
            out = run()
        self._escaped(call, module, mode, out)
        return out

    def _escaped(self, call: Any, module: Any, mode: _Made, out: Any) -> None:
        kept = {_storage(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor)}
        for ref, key, op, where, source, shape in mode.made:
            t = ref()
            if t is None or key in kept:
                continue
            self._add(("side_output", call.region, op, source), {
                "kind": "side_output", "region": call.region, "module": where, "op": op, "source": source,
                "shape": shape, "holder": _holder(t, module, call.region)})
        mode.made.clear()

    def _add(self, key: tuple, finding: dict[str, Any]) -> None:
        if key in self._found:
            self._found[key]["calls"] += 1
        else:
            self._found[key] = {**finding, "calls": 1}

    def findings(self) -> list[dict[str, Any]]:
        return list(self._found.values())


def _holder(t: torch.Tensor, module: Any, region: str) -> str:
    if module is not None:
        for name, sub in module.named_modules():
            for key, value in vars(sub).items():
                if value is t:
                    path = ".".join(p for p in (region, name, key) if p)
                    return f"module attribute `{path}`"
    kinds = {type(r).__name__ for r in gc.get_referrers(t) if isinstance(r, (list, dict, tuple))}
    return "a " + " or ".join(sorted(kinds)) + " (a hook or the model collects it)" if kinds else \
        "a reference outside the region's outputs"
