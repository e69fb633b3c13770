"""Compare a region's forward with its recompute, op by op, after aligning them.

    cmp = compare_passes(region.forward, region.recompute, tolerance=Tolerance())
    cmp.pairs                 # aligned (forward index, recompute index, how)
    cmp.value_diff[i]         # forward op i: outputs measured different
    cmp.tainted[i]            # forward op i: outputs differ, measured or inferred from its inputs (never
                              # for an op selective AC served from its cache: those are the forward's tensors)
    cmp.first("value")        # PairDiff of the first op whose values diverged, or None

Works on recorded passes (fingerprints, input references) and on passes parsed from a log (shapes,
arguments and `$N` ids only): whatever evidence is present is used, absent evidence is never guessed.
"""

from __future__ import annotations

import math
import re
import struct
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Collection, Iterator

from ..align import Pair, align
from ..dtypes import computes_in_float32
from ..passes import External, InputRef, OpRecord, Pass, TensorMeta, exact_print, ops_feeding
from ..oprules import (CAST, HOOK_ONLY_OPS, REENTRANT_ONLY_OPS, is_collective, is_decision, is_host_read,
                       is_in_place_method, is_view_op, packet, reads_scalars_exactly, updates_as_it_computes,
                       written_inputs)
from ..oprules import is_outside_update as _is_outside_update
from .labels import readable_arg, where



@dataclass(frozen=True)
class Tolerance:
    """When two fingerprints count as equal. Exact by default: a recompute should be bit-identical."""

    rtol: float = 0.0
    atol: float = 0.0

    def equal(self, a: Any, b: Any) -> bool:
        if a is None or b is None:
            return True  # nothing to compare
        if isinstance(a, list) and isinstance(b, list):
            # list == (in C) implies equal here (a NaN only equals itself there); kept values are long lists
            if a == b:
                return True
            if (self.rtol or self.atol) and exact_print(a) and exact_print(b):
                a, b = a[:2], b[:2]  # (within a tolerance the pair decides; the bit sum tells any change at all)
            return len(a) == len(b) and all(self.equal(x, y) for x, y in zip(a, b))
        if isinstance(a, float) or isinstance(b, float):
            try:
                fa, fb = float(a), float(b)
            except (TypeError, ValueError):
                return a == b
            if math.isnan(fa) or math.isnan(fb):
                return math.isnan(fa) and math.isnan(fb)
            if fa == fb:
                return True
            return abs(fa - fb) <= self.atol + self.rtol * max(abs(fa), abs(fb))
        return a == b


# kinds of PairDiff that say the two ops were called with other non-tensor arguments
ARGUMENT_KINDS = frozenset({"args", "argument"})


@dataclass
class PairDiff:
    """What differs in one aligned pair."""

    pair: Pair
    forward: OpRecord | None
    recompute: OpRecord | None
    # value, shape, args (size lists), argument (another non-tensor argument: a float, a flag), host, control
    kinds: set[str] = field(default_factory=set)
    inputs_same: bool | None = None  # all inputs identical between passes (None: cannot tell)
    changed_inputs: list[str] = field(default_factory=list)  # names of externals that changed, feeding it
    sources: frozenset[str] = frozenset()  # changed externals reaching this op through any path
    side_effect: bool = False  # an in-place update of state outside the region (a buffer counter...)

    @property
    def differs(self) -> bool:
        return bool(self.kinds) and not self.side_effect


def is_discrete(op: OpRecord) -> bool:
    return op.discrete or is_decision(op.op)


# record_function scopes of framework hooks that run in one pass only: FSDP2 gathers parameters in the
# forward (its pre-forward hook runs inside a region checkpointed around a fully_shard module) but not
# in the recompute (backward gathered them already)
FRAMEWORK_SCOPES = ("FSDP::",)
_SCOPE_ENTER, _SCOPE_EXIT = "profiler._record_function_enter", "profiler._record_function_exit"


def usable_ops(p: Pass, skip: frozenset[str] = HOOK_ONLY_OPS) -> list[OpRecord]:
    """The ops to align: no hook-only copies, no profiler scope markers, nothing inside a framework
    hook's scope (see FRAMEWORK_SCOPES)."""
    hooks = framework_hook_ops(p)
    return [o for o in p.ops if o.op not in skip and o.index not in hooks]


def _saved_measured(p: Pass, ops: list[OpRecord]) -> list[OpRecord]:
    """`ops`, where an output the recorder did not fingerprint (a derived op's: its values follow from its inputs') was
    saved whole, with the saved tensor's fingerprint as its own: measured, not inferred from its inputs (an input 2
    ulps off that tanh rounds away leaves tanh's output, and the gradients, as they were)."""
    saved = {(q.op_index, q.output): q.fingerprint for q in p.positions
             if q.origin == "op" and q.view is None and q.fingerprint is not None}
    if not saved:
        return ops
    out = []
    for o in ops:
        prints = list(o.fingerprint or ())
        missing = [j for j in range(len(o.out)) if (o.index, j) in saved and (j >= len(prints) or prints[j] is None)]
        if missing:
            prints.extend([None] * (len(o.out) - len(prints)))
            for j in missing:
                prints[j] = saved[(o.index, j)]
            o = replace(o, fingerprint=prints)
        out.append(o)
    return out


def framework_hook_ops(p: Pass) -> dict[int, OpRecord]:
    """Ops of `p` that are scope markers or run inside a framework hook's record_function scope."""
    found: dict[int, OpRecord] = {}
    scopes: list[bool] = []  # open record_function scopes: is it a framework hook's
    for o in p.ops:
        if o.op.startswith(_SCOPE_ENTER):
            name = next((a for a in o.args if isinstance(a, str)), "")
            scopes.append(name.startswith(FRAMEWORK_SCOPES) or bool(scopes and scopes[-1]))
            found[o.index] = o
        elif o.op.startswith(_SCOPE_EXIT):
            if scopes:
                scopes.pop()
            found[o.index] = o
        elif scopes and scopes[-1]:
            found[o.index] = o
    return found


def _pass_through(p: Pass, skip: frozenset[str]) -> dict[int, int]:
    """Skipped copy ops -> the op whose output they copy, so references through them still resolve."""
    source: dict[int, int] = {}
    for o in p.ops:
        if o.op in skip and o.input_refs and o.input_refs[0].kind == "op":
            first = o.input_refs[0].op_index
            source[o.index] = source.get(first, first)
    return source


@dataclass
class PassComparison:
    forward_ops: list[OpRecord]
    recompute_ops: list[OpRecord]
    pairs: list[Pair]
    diffs: list[PairDiff]  # one per pair, same order
    tainted: dict[int, bool]  # forward op index -> outputs differ (measured or inferred)
    changed_externals: list[tuple[External, External | None]]  # (forward, recompute) whose values differ
    not_recomputed: int  # forward ops after the recompute stopped (early stop): never compared
    rec_to_fwd: dict[int, int]
    # (forward op index, output) -> that output differs, where its outputs were measured one by one (topk's
    # values may change while its indices do not); other outputs go by `tainted`
    tainted_outputs: dict[tuple[int, int], bool] = field(default_factory=dict)
    # forward ops inside a framework hook's scope that are views of a region input, parameter or external:
    # op index -> that tensor (FSDP2's pre-forward hook views the input the recompute saves directly)
    hook_views: dict[int, InputRef] = field(default_factory=dict)
    # externals whose values differ only because the forward updated them itself (a batch norm's running
    # statistics): the recompute reads the updated tensor and updates it again -> the op that wrote it
    self_updated: dict[tuple, OpRecord] = field(default_factory=dict)
    tolerance: Tolerance = Tolerance()  # the one values were compared with (saved positions too)
    # forward copy ops hooks make (HOOK_ONLY_OPS: a compiled graph's saved `detach`) -> the op whose output they copy
    forward_through: dict[int, int] = field(default_factory=dict)
    # the recompute's externals the forward made and kept (`kept_read_back`): name -> ((op, output), unchanged)
    kept: dict[str, tuple[tuple[int, int], bool]] = field(default_factory=dict)
    # the forward's ops the recompute did not run, as it read back what they made (`_read_back`)
    read_back: set[int] = field(default_factory=set)
    # forward ops whose outputs reach a saved tensor or the pass's outputs (`_read_by_backward`), None: unknown.
    # What differs elsewhere goes into state only (an amax history rolled and written back)
    read_by_backward: set[int] | None = None

    def first(self, kind: str) -> PairDiff | None:
        """The earliest pair that differs in `kind`, side effects excluded, preferring one whose outputs reach more
        than state updates (the region's outputs, a saved tensor): the divergence the backward reads."""
        found = [d for d in self.diffs if kind in d.kinds and not d.side_effect]
        reach = self.read_by_backward
        return next((d for d in found if reach is None or d.forward is None or d.forward.index in reach),
                    found[0] if found else None)

    def discrete_diffs(self) -> Iterator[PairDiff]:
        """The pairs of discrete ops (topk, argmax, comparisons) whose outputs or arguments differ, in order."""
        for d in self.diffs:
            op = d.forward or d.recompute
            if op is not None and is_discrete(op) and d.kinds & {"value", "shape", "args", "argument", "host"} \
                    and not d.side_effect:
                yield d

    def first_shape(self) -> PairDiff | None:
        for d in self.diffs:
            if d.kinds & {"shape", "args"} and not d.side_effect:
                return d
        return None

    def first_divergence(self) -> PairDiff | None:
        """The earliest pair that differs in any way that matters (side effects excluded)."""
        return next((d for d in self.diffs if d.differs), None)

    def side_effects(self) -> list[PairDiff]:
        return [d for d in self.diffs if d.side_effect and d.kinds]

    def repeated_updates(self) -> list[PairDiff]:
        """In-place updates of outside state that both passes applied with other values (counted twice),
        side effects or not (an update the region then reads is also a divergence)."""
        return [d for d in self.diffs if d.kinds and d.forward is not None and d.recompute is not None
                and is_outside_update(d.forward)]

    def region_updates(self) -> list[tuple[str | None, OpRecord]]:
        """(name, the forward's op) of each outside tensor the region's own ops update in place, once each: those
        both passes updated with other values, then those the region updates before reading them."""
        updates = [(d.forward.input_refs[0].name, d.forward) for d in self.repeated_updates()]
        return updates + [(name, op) for (_, name), op in self.self_updated.items()
                          if not any(n == name for n, _ in updates)]


def compare_passes(forward: Pass, recompute: Pass, tolerance: Tolerance = Tolerance(),
                   whole: bool = True, reentrant: bool = False) -> PassComparison:
    f_ops = _saved_measured(forward, usable_ops(forward))
    read_back = _read_back(f_ops, recompute)
    if read_back:  # the recompute read what they made (a cache kept it: autocast's casts, a memoized table)
        f_ops = [o for o in f_ops if o.index not in read_back]
    r_ops = _saved_measured(recompute, usable_ops(recompute))
    stopped = recompute.stopped_early or not recompute.complete or not whole
    raw = align([o.key for o in f_ops], [o.key for o in r_ops], early_stop=stopped)
    # back to the ops' own indices
    pairs = [Pair(f_ops[p.forward].index if p.forward is not None else None,
                  r_ops[p.recompute].index if p.recompute is not None else None, p.how) for p in raw]
    f_by_index = {o.index: o for o in f_ops}
    r_by_index = {o.index: o for o in r_ops}
    through = _pass_through(recompute, HOOK_ONLY_OPS)
    if reentrant:  # autograd's own clones in a reentrant recompute: dropped where the forward has none
        extra = {p.recompute for p in pairs if p.forward is None and p.recompute is not None
                 and r_by_index[p.recompute].op in REENTRANT_ONLY_OPS}
        pairs = [p for p in pairs if p.recompute not in extra]
        r_ops = [o for o in r_ops if o.index not in extra]
        for i in sorted(extra):
            first = r_by_index[i].input_refs[0] if r_by_index[i].input_refs else None
            if first is not None and first.kind == "op":
                through[i] = through.get(first.op_index, first.op_index)
    rec_to_fwd = {p.recompute: p.forward for p in pairs if p.forward is not None and p.recompute is not None}
    for copy, original in through.items():
        if original in rec_to_fwd:
            rec_to_fwd[copy] = rec_to_fwd[original]
    f_source = _pass_through(forward, HOOK_ONLY_OPS)

    changed_ext, ext_status, renamed = compare_externals(forward, recompute, tolerance)
    kept = kept_read_back(forward, recompute, tolerance)
    self_updated, read_updates = _self_updated(f_ops, r_ops, ext_status)
    if self_updated:
        changed_ext = [(f, r) for f, r in changed_ext if _external_key(f.kind, f.name) not in self_updated]
        ext_status.update({key: False for key in self_updated})

    # Trailing forward ops after the last op the recompute reached were never recomputed (early stop).
    last_rec = max((k for k, p in enumerate(pairs) if p.recompute is not None), default=-1)
    not_recomputed = 0
    if stopped:
        not_recomputed = sum(1 for p in pairs[last_rec + 1:] if p.forward is not None)

    sources = _changed_sources(r_ops, ext_status, renamed, through)
    damaged_ops = {o.op for o in (*f_ops, *r_ops) if o.damaged}
    tainted: dict[int, bool] = {}
    tainted_outputs: dict[tuple[int, int], bool] = {}
    received: set[int] = set()  # collectives whose results neither pass measured: what the other ranks sent
    diffs: list[PairDiff] = []
    for k, p in enumerate(pairs):
        f = f_by_index.get(p.forward) if p.forward is not None else None
        r = r_by_index.get(p.recompute) if p.recompute is not None else None
        d = PairDiff(p, f, r, sources=sources.get(p.recompute, frozenset()), side_effect=is_outside_update(f or r)
                     and (f is None or f.index not in read_updates))  # an update the region reads is a divergence
        if k > last_rec and stopped and r is None:
            diffs.append(d)  # not recomputed: nothing to compare
            continue
        if p.how != "match" and not _maybe_damage(f, r, damaged_ops, forward, recompute):
            d.kinds.add("control")
        if f is not None and r is not None and p.how == "match":  # a substituted pair is already "control"
            _compare_pair(d, f, r, tolerance)
            same, changed = _inputs_same(f, r, tainted, rec_to_fwd, ext_status, f_source, tainted_outputs, kept,
                                         received)
            d.inputs_same, d.changed_inputs = same, changed
            if is_collective(f.op) and not _measured(f, r):  # (the tensors an in-place one wrote: what it received)
                received.update([f.index, *(w.op_index for w in written_inputs(f.op, f.args, f.input_refs)
                                            if w.kind == "op")])
            # a side effect taints what reads its result (`avg.lerp_(x)` then `y / avg`), nothing else
            if r.cached:  # served from selective AC's cache: the forward's own tensors, whatever fed it
                tainted[f.index] = False
                tainted_outputs.update({(f.index, j): False for j in range(len(f.out))})
                diffs.append(d)
                continue
            # an input that differs taints the output unless both passes measured it equal; an in-place write
            # (`buf[i] = x`: copy_ into a view) stays tainted: equal written values may have landed elsewhere
            written_elsewhere = same is False and is_in_place_method(f.op)
            tainted[f.index] = (not d.side_effect or f.index in read_updates) and (
                bool(d.kinds & {"value", "shape", "args", "argument", "host"})
                or (same is False and (written_elsewhere or not _measured(f, r))))
            if tainted[f.index] and not d.kinds & {"args", "argument", "host"} and not written_elsewhere:
                _taint_outputs(tainted_outputs, f, r, tolerance)
        elif f is not None:
            tainted[f.index] = True
        diffs.append(d)
    hook_views = {i: o.input_refs[0] for i, o in framework_hook_ops(forward).items()
                  if o.input_refs and o.input_refs[0].kind != "op" and is_view_op(o.op)}
    return PassComparison(f_ops, r_ops, pairs, diffs, tainted, changed_ext, not_recomputed, rec_to_fwd,
                          tainted_outputs=tainted_outputs, hook_views=hook_views, self_updated=self_updated,
                          tolerance=tolerance, forward_through=f_source, kept=kept, read_back=read_back,
                          read_by_backward=_read_by_backward(forward))


def _read_by_backward(p: Pass) -> set[int] | None:
    """The indices of `p`'s ops whose outputs reach a saved tensor or a tensor that outlived the pass (its outputs):
    what the backward reads. None where the trace says neither (a log)."""
    roots = {q.op_index for q in p.positions if q.origin == "op" and q.op_index is not None}
    roots |= {i for i, _ in p.outputs or ()}
    return ops_feeding(p, roots) if roots else None


def _taint_outputs(tainted_outputs: dict, f: OpRecord, r: OpRecord, tol: Tolerance) -> None:
    """Per output, where both passes measured it: does it differ (shape or fingerprint)?"""
    fa, fb = f.fingerprint or [], r.fingerprint or []
    for j, (ma, mb) in enumerate(zip(f.out_signature(), r.out_signature())):
        a = fa[j] if j < len(fa) else None
        b = fb[j] if j < len(fb) else None
        if ma != mb:
            tainted_outputs[(f.index, j)] = True
        elif a is not None and b is not None:
            tainted_outputs[(f.index, j)] = not tol.equal(a, b)


def viewed_source(ops: dict[int, OpRecord], ref: InputRef) -> InputRef:
    """The tensor `ref` is a view of (`x[:, 0]` -> x, `weight.t()` -> weight), through any chain of views; else
    `ref`. `ops`: the pass's ops by index."""
    source = ops.get(ref.op_index) if ref.kind == "op" else None
    while source is not None and is_view_op(source.op) and source.input_refs:
        ref = source.input_refs[0]
        source = ops.get(ref.op_index) if ref.kind == "op" else None
    return ref


def written_refs(op: OpRecord) -> list[InputRef]:
    """The inputs `op` writes in place (see `oprules.written_inputs`)."""
    return written_inputs(op.op, op.args, op.input_refs)


def _writes(op: OpRecord) -> list[InputRef]:
    """Every input `op` writes in place: an in-place method's own tensor, and what `written_refs` names."""
    return ([op.input_refs[0]] if is_in_place_method(op.op) and op.input_refs else []) + written_refs(op)


def writer_in(p: Pass | None, name: str) -> str | None:
    """The first op of pass `p` that writes `name` (an in-place method, a foreach update, an `out=`) or a view of it
    (`queue[ptr:ptr + n] = keys`, a copy_ into a slice), as where it ran: "aten.mul_.Tensor at blk (train.py:9 in
    forward)"."""
    op = writer_op_in(p, name)
    return f"{op.op} at {where(op.module, op.source)}" if op is not None else None


def writer_op_in(p: Pass | None, name: str) -> OpRecord | None:
    """The op writer_in names."""
    if p is None:
        return None
    ops = {o.index: o for o in p.ops}
    return next((op for op in p.ops
                 if any(r.name == name or r.kind == "op" and viewed_source(ops, r).name == name for r in _writes(op))),
                None)


def read_after_write(p: Pass | None, name: str) -> bool:
    """Whether pass `p` computes with `name` after its first in-place write of it (an update, then a read of the
    updated value: a normalizer's statistics) rather than only before (a read, then the update: an EMA)."""
    if p is None:
        return False
    names_it, writers = _naming(p, name)
    written = False
    for op in p.ops:
        if any(names_it(r) for r in _writes(op)):
            written = written or op.index in writers
        elif written and not is_view_op(op.op) and any(names_it(r) for r in op.input_refs):
            return True
    return False


def _naming(p: Pass, name: str) -> tuple[Callable[[InputRef], bool], set[int]]:
    """A test of whether a tensor reference of pass `p` is the outside tensor `name` (itself, a view of it, or what an
    in-place write of it returned), and the ops whose output is `name` itself (that write)."""
    ops = {o.index: o for o in p.ops}
    writers: set[int] = set()

    def names_it(r: InputRef) -> bool:
        source = viewed_source(ops, r) if r.kind == "op" else r
        return source.name == name or source.kind == "op" and source.op_index in writers

    for o in p.ops:  # (in order: a reference names an earlier op)
        if _returns_written(o) and any(names_it(w) for w in _writes(o)):
            writers.add(o.index)
    return names_it, writers


def _returns_written(op: OpRecord) -> bool:
    """Whether `op`'s output is the tensor it writes (an in-place method, an `out=` variant), not another one (a batch
    norm returns the normalized input and writes its running statistics)."""
    return is_in_place_method(op.op) or op.op.endswith(".out")


def reads_beyond_update(p: Pass | None, name: str) -> bool:
    """Whether pass `p` computes with the outside tensor `name` other than to update it: what an op reads of it (or
    of a view of it) reaches a tensor other than a write of `name` (`x * 448 / amax_history.max()`), not only that
    write (`history.copy_(history.roll(1))`, `history[0] = amax`), nor only Python (`.item()` for a log line, which
    the ops cannot tell from a branch), nor an op that updates it as it computes (a batch norm's statistics)."""
    if p is None:
        return False
    users: dict[int, list[OpRecord]] = {}
    for o in p.ops:
        for r in o.input_refs:
            if r.kind == "op":
                users.setdefault(r.op_index, []).append(o)
    names_it, _ = _naming(p, name)
    seen: set[int] = set()
    todo = [op for op in p.ops if not updates_as_it_computes(op.op) and not is_view_op(op.op)
            and any(names_it(r) for r in op.input_refs)]
    while todo:
        op = todo.pop()
        if op.index in seen or any(names_it(w) for w in _writes(op)):
            continue  # (the update itself: what was read went back into `name`)
        seen.add(op.index)
        after = users.get(op.index)
        if not after and not is_host_read(op.op):
            return True  # used: an output, a value computed with (not a number handed to Python: a log line's?)
        todo.extend(after or ())
    return False


def read_into_arguments(cmp: PassComparison, p: Pass, name: str) -> OpRecord | None:
    """The first op of pass `p` (the forward) called with another non-tensor argument in the recompute, after a host
    read of the outside tensor `name` (`float(t)`, `.item()`) that gave the recompute another number: the Python value
    read from state the recompute updated again reached an op (a batch norm's momentum=None factor, `1 /
    num_batches_tracked`), not only a log line (which changes no argument)."""
    names_it, _ = _naming(p, name)
    read_at = next((d.forward.index for d in cmp.diffs if d.forward is not None and "host" in d.kinds
                    and is_host_read(d.forward.op) and any(names_it(r) for r in d.forward.input_refs)), None)
    if read_at is None:
        return None
    return next((d.forward for d in cmp.diffs if d.forward is not None and d.forward.index > read_at
                 and d.kinds & ARGUMENT_KINDS), None)


def _self_updated(f_ops: list[OpRecord], r_ops: list[OpRecord], ext_status: dict[tuple, bool]
                  ) -> tuple[dict[tuple, OpRecord], set[int]]:
    """Externals the region updates in place, from both passes:

    - changed ones that both passes update and no other op reads (a batch norm's running statistics, a
      step counter): the recompute reads them after the forward's update and updates them again, a side
      effect, not a changed input -> {key: the forward op that wrote it}; a read whose values go only to Python
      (`running_mean[0].item()` for a log line: `_host_only`) does not count;
    - forward in-place updates whose result a later op reads (`avg.lerp_(x)` then `y / avg`): a
      difference there flows on like any other -> their op indices."""
    writer: dict[tuple, OpRecord] = {}
    rewritten: set[tuple] = set()
    read_elsewhere: set[tuple] = set()
    read_updates: set[int] = set()
    for ops, first in ((f_ops, True), (r_ops, False)):
        updated_by: dict[int, tuple] = {}  # in-place op index -> the external its output is (add_ returns it)
        host_only = _host_only(ops)
        for op in ops:
            written = {_external_key(r.kind, r.name) for r in written_refs(op) if r.kind != "op"}
            for key in written:
                if first:
                    writer.setdefault(key, op)
                else:
                    rewritten.add(key)
            for r in op.input_refs:
                key = updated_by.get(r.op_index) if r.kind == "op" else _external_key(r.kind, r.name)
                if key is None or key in written or op.index in host_only:
                    continue
                read_elsewhere.add(key)
                if first and r.kind == "op":
                    read_updates.add(r.op_index)
            if written and op.input_refs and op.input_refs[0].kind != "op" and is_in_place_method(op.op):
                updated_by[op.index] = _external_key(op.input_refs[0].kind, op.input_refs[0].name)
    updated = {key: op for key, op in writer.items()
               if ext_status.get(key) and key in rewritten and key not in read_elsewhere}
    return updated, read_updates


def _host_only(ops: list[OpRecord]) -> set[int]:
    """The ops whose outputs reach only host reads (`.item()`, directly or through views and reductions) and no
    other op: what they compute goes to Python, where a later op that uses it shows it in its arguments."""
    consumers: dict[int, list[OpRecord]] = {}
    for op in ops:
        for r in op.input_refs:
            if r.kind == "op":
                consumers.setdefault(r.op_index, []).append(op)
    only: set[int] = set()
    for op in reversed(ops):  # (consumers come later in a pass)
        users = consumers.get(op.index)
        if is_host_read(op.op) or users and all(u.index in only for u in users):
            only.add(op.index)
    return only


def is_outside_update(op: OpRecord | None) -> bool:
    """An in-place op on a tensor the region did not create: state updated as a side effect
    (a tokens-per-expert counter). The recompute repeats it, but no saved activation depends on it."""
    return op is not None and bool(op.input_refs) and _is_outside_update(op.op, op.input_refs[0].kind)


def _changed_sources(r_ops: list[OpRecord], ext_status: dict[tuple, bool], renamed: dict[tuple, str | None],
                     through: dict[int, int]) -> dict[int, frozenset[str]]:
    """For each recompute op, the changed externals that reach it through its inputs (transitively, and through the
    skipped copies `through` maps to what they copy: `(q - x).detach()`), by their forward names."""
    reach: dict[int, frozenset[str]] = {}
    for op in r_ops:
        found: set[str] = set()
        for ref in op.input_refs:
            if ref.kind == "op":
                found |= reach.get(through.get(ref.op_index, ref.op_index), frozenset())
                continue
            key = _external_key(ref.kind, ref.name)
            name = renamed.get(key, ref.name)
            if ext_status.get(_external_key(ref.kind, name)):
                found.add(name or ref.kind)
        reach[op.index] = frozenset(found)
    return reach


def _measured(f: OpRecord, r: OpRecord) -> bool:
    """Both passes fingerprinted at least one output of this op (so 'same' is a measurement)."""
    return bool(f.fingerprint and r.fingerprint and any(
        a is not None and b is not None for a, b in zip(f.fingerprint, r.fingerprint)))


def _maybe_damage(f: OpRecord | None, r: OpRecord | None, damaged_ops: set[str], forward: Pass,
                  recompute: Pass) -> bool:
    """An op only one pass has is no evidence of control flow when it may be the work of another writer
    cutting into a log: its own line is damaged, a damaged line names the same op, or the other pass
    lost op lines that could not be read (the op's counterpart may be one of them)."""
    if any(o is not None and (o.damaged or o.op in damaged_ops) for o in (f, r)):
        return True
    return bool((f is not None and recompute.state.get("lost_lines")) or
                (r is not None and forward.state.get("lost_lines")))


def _compare_pair(d: PairDiff, f: OpRecord, r: OpRecord, tol: Tolerance) -> None:
    if f.damaged or r.damaged:  # a log line cut by another writer: only whole size lists are evidence
        if _int_lists(f.args) != _int_lists(r.args) and len(_int_lists(f.args)) == len(_int_lists(r.args)):
            d.kinds.add("args")
        return
    if f.out_signature() != r.out_signature():
        d.kinds.add("shape")
    plain_f, plain_r = _plain_args(f.args), _plain_args(r.args)
    if plain_f != plain_r and not _alike_in_float32(f, plain_f, plain_r):
        # a log's arguments are text: only size lists are read from them
        d.kinds.add("args" if f.log_ids is not None or _only_sizes_differ(plain_f, plain_r) else "argument")
    if f.fingerprint and r.fingerprint and "shape" not in d.kinds:
        for a, b in zip(f.fingerprint, r.fingerprint):
            if a is not None and b is not None and not tol.equal(a, b):
                d.kinds.add("value")
                break
    if f.host_value is not None or r.host_value is not None:
        if not tol.equal(f.host_value, r.host_value):
            d.kinds.add("host")
            d.kinds.add("value")
    if f.values and r.values and "value" not in d.kinds:
        for key, fv in f.values.items():
            if key.startswith("out") and key in r.values and not tol.equal(fv, r.values[key]):
                d.kinds.add("value")
                break


# Ops whose integer lists are shapes, not sizes of pieces: a difference there is no redistribution.
_SHAPE_ARG_OPS = frozenset({"view", "_unsafe_view", "reshape", "expand", "permute", "transpose", "new_empty",
                            "new_zeros", "new_ones", "new_full", "empty", "zeros", "ones", "full", "repeat", "tile",
                            "flatten", "unflatten", "as_strided", "view_copy", "_reshape_alias", "randn", "rand"})


def _int_lists(args: list) -> list[list[int]]:
    return [a for a in args if isinstance(a, list) and a and all(isinstance(x, int) for x in a)]


def first_size_change_by_occurrence(f_ops: list[OpRecord], r_ops: list[OpRecord]) -> tuple[OpRecord, OpRecord] | None:
    """Pair the k-th call of each op in both passes and find the first whose size lists differ.

    Robust where the op order itself is unreliable (a log whose lines other writers cut and spliced):
    `split_with_sizes(['14', '99', ...])` vs `(['14', '98', ...])` is found wherever the line landed.
    Only redistributions count (same length, same total, other entries: split sizes, all-to-all splits);
    a reshape argument that differs is more likely a misplaced line than the cause.
    """
    seen: dict[str, list[OpRecord]] = {}
    for op in r_ops:
        if _int_lists(op.args):
            seen.setdefault(op.op, []).append(op)
    counts: dict[str, int] = {}
    found = None
    for op in f_ops:
        lists = _int_lists(op.args)
        if not lists or packet(op.op) in _SHAPE_ARG_OPS:
            continue
        k = counts.get(op.op, 0)
        counts[op.op] = k + 1
        partners = seen.get(op.op, [])
        if k < len(partners):
            other = _int_lists(partners[k].args)
            if len(other) == len(lists) and other != lists and all(
                    len(a) == len(b) and sum(a) == sum(b) for a, b in zip(lists, other)):
                if found is None or op.index < found[0].index:
                    found = (op, partners[k])
    return found


def _only_sizes_differ(a: list, b: list) -> bool:
    """The arguments that differ are all lists of integers (split sizes, shapes), not scalars or flags."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x == y:
            continue
        if isinstance(x, dict) and isinstance(y, dict):
            if not _only_sizes_differ(list(x.values()), list(y.values())):
                return False
        elif not (_int_lists([x]) and _int_lists([y])):
            return False
    return True


def _alike_in_float32(op: OpRecord, a: list, b: list) -> bool:
    """Arguments that differ only in Python floats equal once rounded to float32, of an op that computes in float32 at
    most (dtypes.computes_in_float32): its kernel ran alike (a loss normaliser a running mean left 1 ulp off in double,
    `l / running`)."""
    if reads_scalars_exactly(op.op):  # (pow(x, 2.000000000000005) is no pow(x, 2.0): a fast path for 2.0)
        return False
    metas = [m for m in (*op.inputs, *op.out) if isinstance(m, TensorMeta)]
    return computes_in_float32([m.dtype for m in metas]) and _same_in_float32(a, b)


def _same_in_float32(a: Any, b: Any) -> bool:
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same_in_float32(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_in_float32(a[k], b[k]) for k in a)
    if type(a) is float and type(b) is float and a != b:
        try:
            return struct.pack("<f", a) == struct.pack("<f", b)
        except OverflowError:
            return False
    return a == b


def _plain_args(args: list) -> list:
    """Non-tensor arguments only (tensors and ids compare through their producers, not by name), objects
    without their address (a Generator's wrapper is a new Python object in each pass)."""
    out = []
    for a in readable_arg(args):
        if isinstance(a, str) and (a == "$" or a.startswith("$")):
            continue
        if isinstance(a, list):
            out.append(_plain_args(a))
        elif isinstance(a, dict):
            out.append({k: _plain_args([v]) for k, v in a.items()})
        else:
            out.append(a)
    return out


def _read_back(f_ops: list[OpRecord], recompute: Pass) -> set[int]:
    """The forward's ops the recompute did not run because it read back what they made (`External.made_by`: a
    tensor the forward made and something kept, autocast's bf16 weight casts, a memoized table) and the ops that
    fed only those: not aligned, as they have no counterpart (what was read back is compared as an input)."""
    dropped = {e.made_by[0] for e in recompute.externals if e.made_by is not None}
    if dropped:  # (an op the recompute ran as often as the forward was recomputed: what it returned aliases state
        # the region reads, as a compiled graph returns the parameters it saves for the backward)
        ran = Counter(o.key for o in usable_ops(recompute))
        made = Counter(o.key for o in f_ops)
        dropped = {o.index for o in f_ops if o.index in dropped and made[o.key] > ran[o.key]}
    dropped |= _cached_casts(f_ops, recompute)
    if not dropped:
        return dropped
    consumers: dict[int, set[int]] = {}
    for o in f_ops:
        for r in o.input_refs:
            if r.kind == "op":
                consumers.setdefault(r.op_index, set()).add(o.index)
    for o in reversed(f_ops):  # (an op's consumers come after it)
        feeds = consumers.get(o.index)
        if feeds and feeds <= dropped:
            dropped.add(o.index)
    return dropped


def _cached_casts(f_ops: list[OpRecord], recompute: Pass) -> set[int]:
    """From a log (no externals: ids only), the forward's casts of tensors from outside the pass (autocast's casts of
    the weights) that the recompute did not make again, by output shape and dtype: autocast's cache served them (a
    backward run inside the forward's autocast context), so they have no counterpart to align with."""
    if recompute.externals or not f_ops or f_ops[0].log_ids is None:
        return set()

    def casts(ops: list[OpRecord]) -> list[OpRecord]:
        return [o for o in ops if o.op == CAST and o.input_refs and o.input_refs[0].kind == "external" and o.out]

    remade = Counter(str(o.out[0]) for o in casts(recompute.ops))
    out = set()
    for o in casts(f_ops):
        if remade[str(o.out[0])] > 0:
            remade[str(o.out[0])] -= 1
        else:
            out.add(o.index)
    return out


def kept_read_back(forward: Pass, recompute: Pass, tolerance: Tolerance) -> dict[str, tuple[tuple[int, int], bool]]:
    """The recompute's externals that the forward made and kept (a cache it fills, found there by the recompute):
    name -> ((forward op index, output), whether it still holds what the forward made: measured alike, or, where
    not measured, not written since)."""
    made = {o.index: o for o in forward.ops}
    out = {}
    for e in recompute.externals:
        op = made.get(e.made_by[0]) if e.made_by is not None else None
        if op is None:
            continue
        j = e.made_by[1]
        fp = op.fingerprint[j] if op.fingerprint and j < len(op.fingerprint) else None
        if fp is not None and e.fingerprint is not None:
            unchanged = tolerance.equal(fp, e.fingerprint)
        else:
            unchanged = e.versions is not None and e.versions[0] == e.versions[1]
        out[e.name] = (e.made_by, unchanged)
    return out


def _inputs_same(f: OpRecord, r: OpRecord, tainted: dict[int, bool], rec_to_fwd: dict[int, int],
                 ext_status: dict[tuple, bool], f_source: dict[int, int],
                 tainted_outputs: dict[tuple[int, int], bool] | None = None,
                 kept: dict[str, tuple[tuple[int, int], bool]] | None = None,
                 received: Collection[int] = ()) -> tuple[bool | None, list[str]]:
    """Were all inputs of this pair identical? Uses the producers' comparison and the externals' (`kept`: the
    forward's own tensors the recompute read back, `kept_read_back`). None where one is what a collective received
    (`received`: its values unmeasured; another rank's divergence reaches this one through it)."""
    if not f.input_refs or not r.input_refs or len(f.input_refs) != len(r.input_refs):
        return None, []
    same: bool | None = True
    changed: list[str] = []
    for fr, rr in zip(f.input_refs, r.input_refs):
        if fr.kind == "op":
            source = f_source.get(fr.op_index, fr.op_index)
            if source in received and same:
                same = None
            if rr.kind != "op":
                back = (kept or {}).get(rr.name)
                if back is None or back[0] != (fr.op_index, fr.output) or not back[1]:
                    same = False  # (else: the tensor that op made, kept and read back as it was)
            elif rec_to_fwd.get(rr.op_index) != source:
                same = False
            elif source == fr.op_index and rr.output != fr.output:
                same = False  # another output of the same op (a split's chunks concatenated in another order)
            elif source != fr.op_index:  # a skipped copy (a detach) of that op's output: as that op
                same = same and not tainted.get(source, False) if same is not None else same
            elif (tainted_outputs or {}).get((fr.op_index, fr.output), tainted.get(fr.op_index, False)):
                same = False
        else:
            key = _external_key(fr.kind, fr.name)
            status = ext_status.get(key)
            if rr.kind != fr.kind:
                same = False
            elif status is True:
                same = False
                changed.append(fr.name or fr.kind)
            elif status is None and key in ext_status and same:
                same = None  # (its values were not measured)
    return same, changed


def _external_key(kind: str, name: str | None) -> tuple:
    return (kind, name)


def _paired_externals(forward: list[External], recompute: list[External], rec: dict[tuple, External]
                      ) -> list[tuple[External, External]]:
    """Each forward external and the recompute's: by name, else, where one pass could not name it (a module attribute
    named from the module stack in the forward is `external[0]` in a nested recompute that lacks its owner), the
    next unmatched one of its kind in the order the passes first read them. Two different names are two tensors."""
    fwd_keys = {_external_key(e.kind, e.name) for e in forward}
    spare: dict[str, list[External]] = {}
    for e in recompute:
        if _external_key(e.kind, e.name) not in fwd_keys:
            spare.setdefault(e.kind, []).append(e)
    pairs = []
    for e in forward:
        other = rec.get(_external_key(e.kind, e.name))
        candidates = spare.get(e.kind)
        if other is None and candidates and (_unnamed(e) or _unnamed(candidates[0])):
            other = candidates.pop(0)
        if other is not None:
            pairs.append((e, other))
    return pairs


def _unnamed(e: External) -> bool:
    """Named by its place only (`external[0]`, `param[2]`: the recorder found no owner for it)."""
    return e.name is None or re.fullmatch(r"\w+\[\d+\]", e.name) is not None and not e.name.startswith("input[")


def compare_externals(forward: Pass, recompute: Pass, tol: Tolerance
                      ) -> tuple[list[tuple[External, External | None]], dict[tuple, bool | None],
                                 dict[tuple, str | None]]:
    """Externals (inputs, parameters, buffers, captured tensors) whose values differ between passes: (the changed
    ones, differs per forward external's key (None: its values were not measured), the forward name of each recompute
    external named otherwise)."""
    rec = {_external_key(e.kind, e.name): e for e in recompute.externals}
    changed: list[tuple[External, External | None]] = []
    status: dict[tuple, bool | None] = {}
    renamed: dict[tuple, str | None] = {}
    for e, other in _paired_externals(forward.externals, recompute.externals, rec):
        key = _external_key(e.kind, e.name)
        differs = (e.meta.shape != other.meta.shape or e.meta.dtype != other.meta.dtype
                   or not tol.equal(e.fingerprint, other.fingerprint))
        # (values not measured, --no-fingerprints: whether they differ is not known, not "no")
        status[key] = None if not differs and (e.fingerprint is None or other.fingerprint is None) else differs
        if other.name != e.name:
            renamed[_external_key(other.kind, other.name)] = e.name
        if differs:
            changed.append((e, other))
    return changed, status, renamed
