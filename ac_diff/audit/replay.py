"""Replays of one checkpointed region on its own inputs, outside the training's autograd graph.

    passes = RegionReplay(fn, inputs, kwargs, rng, modules, discrete_ops)
    clean = passes.run()                                   # what the recompute would do: every op, the
                                                           # discrete decisions with their margins, the
                                                           # metadata of every tensor autograd saves
    noisy = passes.run(noise=targets, spec=spec, seed=1)   # the same with seeded noise injected into the
                                                           # floating outputs that feed the decisions
    fixed = passes.run(..., served={"aten.topk.default"})  # the same with those ops' outputs served from
                                                           # `clean` (what a selective-AC save list does);
                                                           # the ops the region's own selective-AC policy saved
                                                           # (`sac_ops`) are served in every noisy pass
    passes.close()                                          # puts back every tensor a replay wrote in place

Each pass starts from the forward's RNG state and runs under its own `torch.random.fork_rng`, so the
training's RNG is untouched; tensors from outside the replay that an op writes in place (buffers,
counters, running statistics) are copied before a pass first writes them and restored as it ends, so every pass
starts from the state the forward left (what the real recompute reads). The inputs
are detached: nothing a replay builds reaches the training's graph, and no backward ever runs on it.
Python state the checkpointed module's code changes (a counter `self.calls += 1`, a list it appends to, a count a
hook keeps in its closure, a private generator) is put back after each pass (remedies/restore.KeptState).
"""

from __future__ import annotations

import math
import random
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..capture.opinfo import op_info
from ..capture.torch_compat import checkpointed_module
from ..remedies.restore import KeptState
from ..oprules import keeps_order, written_arguments, written_keywords
from ..capture.sourceline import user_source
from .margins import Margins, comparison_gap, decision_margins
from .noise import NoiseSpec, perturb, reduction_sigma

Key = tuple[str, int]  # (op name, call index of that op in the pass): how two passes of a region line up


@dataclass
class OpRow:
    key: Key
    module: str
    out_meta: tuple  # ((shape, dtype), ...) of tensor outputs
    producers: tuple  # per tensor input: (op row index, output slot) or None (from outside the pass)
    floating_inputs: bool
    views: bool  # shares its input's values (a view or aliasing copy)
    pointwise: bool
    nbytes: int


@dataclass
class Decision:
    index: int  # row of the op in its pass
    key: Key
    module: str
    source: str | None
    margins: Margins | None
    outputs: tuple  # clones of the tensor outputs
    scores: torch.Tensor | None  # clone of the score input
    # a chooser's candidates by what they score: the same number for candidates whose scores are identical in every
    # row (a memory bank's duplicated rows), engine.same_candidates; computed once, for the clean pass
    candidates: torch.Tensor | None = None


@dataclass
class PassResult:
    rows: list[OpRow] = field(default_factory=list)
    decisions: dict[Key, Decision] = field(default_factory=dict)
    saved: list = field(default_factory=list)  # (shape, dtype) of each tensor autograd saved, in order
    error: str | None = None
    served_bytes: int = 0
    outputs: dict = field(default_factory=dict)  # Key -> outputs of the ops the region's own selective AC saves


class _Guard:
    """Copies of tensors from outside the replay, taken before a replay first writes them."""

    def __init__(self) -> None:
        self.copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def before_write(self, t: torch.Tensor, created: set[int]) -> None:
        if id(t) in self.copies or _storage(t) in created:
            return
        self.copies[id(t)] = (t, t.detach().clone())

    def restore(self) -> None:
        """Last copied first: a view written after its base (`hist.copy_(hist.roll(1)); hist[0] = amax`) was copied
        holding the base's first write, which the base's own, older copy then undoes."""
        with torch.no_grad():
            for t, copy in reversed(self.copies.values()):
                t.copy_(copy)
        self.copies.clear()


def _storage(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return -id(t)


class _Mode(TorchDispatchMode):
    """Sees every op of one replay pass: records it, injects noise, serves saved ops, guards writes."""

    def __init__(self, owner: "RegionReplay", result: PassResult, noise: dict | None, spec: NoiseSpec | None,
                 seed: int, served: set[str], clean: PassResult | None, keep: bool) -> None:
        super().__init__()
        self.owner, self.result, self.noise, self.spec = owner, result, noise or {}, spec
        self.served, self.clean, self.keep = served, clean, keep
        self.counts: dict[str, int] = {}
        self.where: dict[int, tuple] = {}  # id(tensor) -> (weakref, row, slot)
        self.created: set[int] = set()
        self.generator = torch.Generator().manual_seed(seed)
        self.cuda_generators: dict = {}

    def _gen(self, device: torch.device) -> torch.Generator:
        if device.type == "cpu":
            return self.generator
        g = self.cuda_generators.get(device)
        if g is None:
            g = self.cuda_generators[device] = torch.Generator(device=device).manual_seed(self.generator.initial_seed())
        return g

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        info = op_info(func)
        name = info.name
        n = self.counts.get(name, 0)
        self.counts[name] = n + 1
        key = (name, n)
        written = written_arguments(name, args)
        for i in written:
            if i < len(args) and isinstance(args[i], torch.Tensor):
                self.owner.guard.before_write(args[i], self.created)
        for keyword in written_keywords(name):  # (`normalize(..., out=self._u)`: spectral norm's power iteration)
            if isinstance(kwargs.get(keyword), torch.Tensor):
                self.owner.guard.before_write(kwargs[keyword], self.created)
        saved = None
        if self.clean is not None and (name in self.served or name in self.owner.sac_ops):
            hit = self.clean.decisions.get(key)
            saved = hit.outputs if hit is not None else self.clean.outputs.get(key)
        if saved is not None:  # what selective AC does: the forward's output, not a recomputed one
            out = tuple(t.clone() for t in saved)
            if len(getattr(func, "_schema").returns) == 1 and len(out) == 1:
                out = out[0]
            if name in self.served:
                self.result.served_bytes += sum(t.nbytes for t in saved)
        else:
            out = func(*args, **kwargs)
        outs = [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]
        if self.clean is None and name in self.owner.sac_ops:
            self.result.outputs[key] = tuple(t.detach().clone() for t in outs)
        target = self.noise.get(key) if saved is None else None  # a saved output is exact in the recompute
        if target is not None:
            slot = target
            if slot < len(outs) and outs[slot].is_floating_point():
                t = outs[slot]
                sigma = reduction_sigma(name, args, t)[0] if self.spec.at_origin else None
                with torch.no_grad():
                    t.add_(perturb(t, self.spec, self._gen(t.device), sigma))
        self._record(func, info, name, key, args, kwargs, outs, written)
        return out

    def _record(self, func, info, name, key, args, kwargs, outs, written) -> None:
        producers, floating = [], False
        for a in _tensors(args, kwargs):
            hit = self.where.get(id(a))
            producers.append(hit[1:] if hit is not None and hit[0]() is a else None)
            floating = floating or a.is_floating_point()
        index = len(self.result.rows)
        if not info.shares_values and not written:
            self.created.update(_storage(t) for t in outs)
        for slot, t in enumerate(outs):
            self.where[id(t)] = (weakref.ref(t), index, slot)
        module = self.owner.modules.current() if self.owner.modules is not None else None
        self.result.rows.append(OpRow(key, module or "", tuple((tuple(t.shape), t.dtype) for t in outs),
                                      tuple(producers), floating, info.shares_values,
                                      info.derivable, sum(t.nbytes for t in outs)))
        if info.discrete or name in self.owner.discrete_ops:
            margins = decision_margins(name, func, args, kwargs) if self.keep else None
            ts = _tensors(args, kwargs)
            arg = margins.score_arg if margins is not None else 0
            score = comparison_gap(name, func, args, kwargs)  # (a comparison: the noise of its gap)
            if score is None:
                score = ts[arg] if arg < len(ts) and ts[arg].is_floating_point() else None
            self.result.decisions[key] = Decision(
                index, key, module or "", user_source(2) if self.keep else None, margins,
                tuple(t.detach().clone() for t in outs),
                score.detach().clone() if score is not None else None)


def _tensors(args, kwargs) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []

    def walk(a):
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            for x in a:
                walk(x)
        elif isinstance(a, dict):
            for x in a.values():
                walk(x)
    walk(args)
    walk(kwargs)
    return out


@dataclass
class RngState:
    cpu: torch.Tensor
    devices: list
    device_states: list
    python: Any

    @classmethod
    def capture(cls, inputs) -> "RngState":
        devices, states = [], []
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            devices = sorted({t.device.index for t in _tensors(inputs, {}) if t.is_cuda})
            states = [torch.cuda.get_rng_state(d) for d in devices]
        return cls(torch.get_rng_state(), devices, states, random.getstate())


class RegionReplay:
    def __init__(self, fn, inputs: tuple, kwargs: dict, rng: RngState, modules, discrete_ops=frozenset(),
                 module=None, sac_ops=frozenset()) -> None:
        self.fn, self.kwargs, self.rng, self.modules = fn, kwargs or {}, rng, modules
        self.discrete_ops = discrete_ops
        self.sac_ops = frozenset(sac_ops)  # ops the region's selective-AC policy saved in the forward: served
        self.module = module  # pushed on the module stack when its own hooks do not run (partial(forward))
        self.inputs = tuple(a.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor)
                            and (a.is_floating_point() or a.is_complex()) else a for a in inputs)
        self.guard = _Guard()
        self.kept = KeptState(checkpointed_module(fn)[0] or module)  # Python state a replay's forward changes
        self.baseline: PassResult | None = None

    def run(self, noise: dict | None = None, spec: NoiseSpec | None = None, seed: int = 0,
            served: set[str] = frozenset(), clean: PassResult | None = None, keep: bool = True) -> PassResult:
        result = PassResult()
        clean = clean if clean is not None else self.baseline  # the first pass is the clean one
        mode = _Mode(self, result, noise, spec, seed, set(served), clean, keep)

        def pack(t):
            result.saved.append((tuple(t.shape), t.dtype))
            return t

        pushed = False
        with torch.random.fork_rng(devices=self.rng.devices, enabled=True):
            torch.set_rng_state(self.rng.cpu)
            for d, s in zip(self.rng.devices, self.rng.device_states):
                torch.cuda.set_rng_state(s, d)
            py = random.getstate()
            numpy_random = getattr(sys.modules.get("numpy"), "random", None)  # (its global generator, if loaded)
            np_state = numpy_random.get_state() if numpy_random is not None else None
            try:
                if self.module is not None and self.modules is not None:
                    self.modules.stack().append((self.module, self.modules.name_of(self.module)))
                    pushed = True
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), mode:
                    self.fn(*self.inputs, **self.kwargs)
            except Exception as exc:  # a flip the region cannot survive (an expert with no tokens, an index error)
                result.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            finally:
                if pushed:
                    stack = self.modules.stack()
                    if stack and stack[-1][0] is self.module:
                        stack.pop()
                random.setstate(py)
                if np_state is not None:
                    numpy_random.set_state(np_state)
                self.kept.restore()
                self.guard.restore()  # (each pass starts from the state the forward left, as the recompute does)
        if self.baseline is None:
            self.baseline = result
        return result

    def close(self) -> None:
        self.guard.restore()


def producer_of(result: PassResult, index: int, arg: int) -> tuple[int, int] | None:
    """The op (row, output slot) that computed the values of input `arg` of op `index`, through views."""
    row = result.rows[index]
    if arg >= len(row.producers):
        return None
    hit = row.producers[arg]
    while hit is not None and result.rows[hit[0]].views and result.rows[hit[0]].producers:
        hit = result.rows[hit[0]].producers[0]
    return hit


def origin_of(result: PassResult, hit: tuple[int, int] | None) -> tuple[int, int] | None:
    """Back from a producer through elementwise ops, views, casts and softmaxes to the op whose reduction made the
    values (a matmul): where a recompute's own rounding noise comes from."""
    return _walk_back(result, hit, stop=lambda row, slot: False)


def rounded_at(result: PassResult, hit: tuple[int, int] | None) -> tuple[int, int] | None:
    """Where the values at `hit` were last rounded to a narrower dtype than their own, on the way back to their
    origin (bf16 router logits that `.float().softmax()` turns into float32 scores): rounding noise belongs there,
    before that rounding, since float32 noise added after it breaks ties that no recompute order can break.
    `hit` itself when no narrower dtype lies on the way."""
    if hit is None:
        return None
    bits = _mantissa_bits(result.rows[hit[0]].out_meta[hit[1]][1])
    at = _walk_back(result, hit, stop=lambda row, slot: _mantissa_bits(row.out_meta[slot][1]) < bits)
    return at if at is not None and _mantissa_bits(result.rows[at[0]].out_meta[at[1]][1]) < bits else hit


def _mantissa_bits(dtype: torch.dtype) -> int:
    return round(-math.log2(torch.finfo(dtype).eps)) if dtype.is_floating_point else 0


def _walk_back(result: PassResult, hit: tuple[int, int] | None, stop) -> tuple[int, int] | None:
    while hit is not None:
        row = result.rows[hit[0]]
        if stop(row, hit[1]) or not (row.views or row.pointwise or keeps_order(row.key[0])):
            return hit
        nxt = None
        for p in row.producers:
            if p is not None and result.rows[p[0]].out_meta[p[1]][1].is_floating_point:
                nxt = p
                break
        if nxt is None:
            return hit
        hit = nxt
    return None


def reachable(result: PassResult, hit: tuple[int, int] | None) -> bool:
    """Whether recompute noise can reach these values: computed in the region from floating inputs
    (not a conversion of integer ids, a parameter, or a random draw the preserved RNG repeats)."""
    if hit is None:
        return False
    row = result.rows[hit[0]]
    return row.floating_inputs and row.out_meta[hit[1]][1].is_floating_point

