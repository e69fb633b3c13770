"""The tensors checkpoint keeps to recompute a region from (its inputs), and which of them were written in place after
the region's forward and before its recompute: torch's version check then stops the backward ("one of the variables
needed for gradient computation has been modified by an inplace operation"), an error that names a shape and a
version, never the region or the input.

    kept = KeptInputs()
    kept.forward_ended(region, inputs)    # a region's forward ended: its tensor inputs (weakly) and their versions
    kept.recomputed(region)               # its recompute began: [(0, weakref to the forward's input 0)]
    kept_as(forward_inputs, inputs)       # the recompute's inputs: ["copy", "same", None (the forward's is gone)]
    kept.written()                        # the run stopped: [(region, [[input index, meta, version then, now]])]

What it holds per region awaiting its recompute is a few weak references: a forward that is never recomputed (an
evaluation forward under grad, a graph dropped) costs nothing once its inputs are freed, and those entries are
dropped when many accumulate.
"""

from __future__ import annotations

import contextlib
from typing import Any
from weakref import ref as _weakref

import torch

from ..trace.encode import written_meta
from .fingerprint import _storage_of
from .torch_compat import version_of

_PRUNE_AT = 4096  # regions awaiting their recompute before the entries whose inputs are gone are dropped


class KeptInputs:
    def __init__(self) -> None:
        # region number -> (weakref to the region, [(input index, weakref to the tensor, its version)])
        self._awaiting: dict[int, tuple[Any, list[tuple[int, Any, int]]]] = {}

    def forward_ended(self, region: Any, inputs: tuple | list | None) -> None:
        entries = []
        for i, t in enumerate(inputs or ()):
            if isinstance(t, torch.Tensor):
                with contextlib.suppress(RuntimeError, TypeError):  # (an inference tensor has no version counter)
                    entries.append((i, _weakref(t), version_of(t)))
        if not entries:
            return
        if len(self._awaiting) >= _PRUNE_AT:
            self._awaiting = {n: e for n, e in self._awaiting.items() if any(r() is not None for _, r, _ in e[1])}
        self._awaiting[region.number] = (_weakref(region), entries)

    def recomputed(self, region: Any) -> list[tuple[int, Any]]:
        """The region's recompute began: nothing left to check. Returns [(input index, weakref to the forward's
        tensor)]: what `kept_as` compares the recompute's inputs with."""
        _, entries = self._awaiting.pop(region.number, (None, ()))
        return [(index, tensor_ref) for index, tensor_ref, _ in entries]

    def written(self) -> list[tuple[Any, list[list]]]:
        """Each region still awaiting its recompute with an input written in place since its forward ended:
        (the region, [[input index, meta as the trace holds it, version at the forward's end, version now]])."""
        out = []
        for number, (region_ref, entries) in sorted(self._awaiting.items()):
            region = region_ref()
            changed = []
            for index, tensor_ref, version in entries:
                t = tensor_ref()
                if t is not None and version_of(t) != version:
                    changed.append([index, written_meta((t.size(), t.dtype, t.device)), version, version_of(t)])
            if region is not None and changed:
                out.append((region, changed))
        return out


def kept_as(forward: list[tuple[int, Any]], inputs: tuple) -> list[str | None]:
    """Per input of a recompute: "same" (the forward's tensor itself, or a view of its memory: what checkpoint keeps
    without saved-tensor hooks), "copy" (other memory: what the user's hooks gave back), None (not known: the
    forward's tensor is gone, or no tensor)."""
    alive = {index: ref() for index, ref in forward}
    out: list[str | None] = []
    for i, t in enumerate(inputs):
        f = alive.get(i)
        if f is None or not isinstance(t, torch.Tensor):
            out.append(None)
            continue
        mine, theirs = _storage_of(t)[0], _storage_of(f)[0]  # (a wrapper subclass has none: not known)
        out.append(None if mine is None or theirs is None else "same" if mine == theirs else "copy")
    return out
