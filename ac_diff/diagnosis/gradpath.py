"""The ops of a pass that a gradient flows through, for a reentrant region's backward.

    on_path = gradient_path(forward, recompute)
    on_path(pair_diff) -> True for `x * scale` (x: the region's input), False for `scale = 448 / amax_hist.max()`
    (a buffer read) or anything after `x.detach()`

A reentrant region's backward runs on the graph its recompute builds: a difference counts for the gradients only
where it reaches that graph. An op is on the path when a floating-point input is: the region's inputs, parameters
that require grad and captured tensors start it; a detach and integer or boolean outputs end it. Where a path value
is written in place into outside state (a buffer, a captured tensor), later reads of that state cannot be followed:
gradient_path answers None and every difference counts.
"""

from __future__ import annotations

from typing import Callable

from ..dtypes import carries_gradient
from ..oprules import (DETACHED_ALIAS_OPS, IDENTITY_WHERE_UNCHANGED, OUTSIDE_KINDS, blind_arguments,
                       gradients_reading_input, is_in_place_method, packet, reads_shape_only, reads_values_in_backward)
from ..passes import InputRef, OpRecord, Pass, Position, TensorMeta, ops_feeding
from .passdiff import PairDiff

_NO_GRADIENT_KINDS = frozenset({"buffer"})


def _sources(p: Pass) -> set[tuple[str, str | None]]:
    """(kind, name) of the pass's outside tensors a gradient can reach: inputs, parameters not frozen, captures."""
    return {(e.kind, e.name) for e in p.externals
            if e.kind not in _NO_GRADIENT_KINDS and e.requires_grad is not False and carries_gradient(e.meta.dtype)}


def path_ops(p: Pass, sources: set[tuple[str, str | None]] | None = None) -> set[int] | None:
    """The indices of `p`'s ops a gradient flows through from `sources` ((kind, name) of outside tensors; default:
    the pass's inputs, parameters not frozen and captures), or None where it cannot be followed."""
    sources = _sources(p) if sources is None else sources
    on: set[int] = set()

    def carries(ref: InputRef, dtype: str) -> bool:
        if not carries_gradient(dtype):
            return False
        return ref.op_index in on if ref.kind == "op" else (ref.kind, ref.name) in sources

    for op in p.ops:
        if op.op in DETACHED_ALIAS_OPS or not any(carries(r, m.dtype) for r, m in zip(op.input_refs, op.inputs)):
            continue
        on.add(op.index)
        if is_in_place_method(op.op) and op.input_refs:
            written = op.input_refs[0]
            if written.kind in OUTSIDE_KINDS and (written.kind, written.name) not in sources:
                return None  # a gradient-carrying value stored in state later ops read by name
            if written.kind == "op":
                on.add(written.op_index)
    return on


def _reads_other_index(d: PairDiff, op: OpRecord, pairs: dict[int, PairDiff]) -> bool:
    """An op on the path whose integer or boolean inputs differ (a gather with other indices, equal values picked):
    the gradient lands elsewhere even where its outputs match. An index made in the pass differs where its own output
    measured so (`pairs`: the pass's ops by index); one from outside where the op's changed inputs name any."""
    if d.inputs_same is not False:
        return False
    if len(op.inputs) != len(op.input_refs):  # (a trace without one reference per tensor input: any index)
        return any(not carries_gradient(m.dtype) for m in op.inputs)
    return _an_input_differs(d, op, False, lambda ref: (made := pairs.get(ref.op_index)) is None
                             or _output_differs(made, ref.output))


def _reads_other_values(d: PairDiff, op: OpRecord, pairs: dict[int, PairDiff], readers: dict[int, list]) -> bool:
    """An op on the path whose gradient reads the values of an input that differs (`h * mask`, the mask drawn again
    without the RNG state: h's gradient is the grad times the other mask), whether or not the op's own output was
    measured (an elementwise op's is derived from its inputs). An input no op measured differs as the measured ops
    it reaches tell (fp8's scale, reached by another branch to the same value, then its cast and its matmul)."""
    if d.inputs_same is not False or not reads_values_in_backward(op.op) or len(op.inputs) != len(op.input_refs):
        return False

    def differs(ref: InputRef) -> bool:
        made = pairs.get(ref.op_index)
        if made is None:
            return False
        measured = all(o is not None and o.fingerprint and ref.output < len(o.fingerprint)
                       and o.fingerprint[ref.output] is not None for o in (made.forward, made.recompute))
        return _output_differs(made, ref.output) if measured else _measured_downstream_differs(
            ref.op_index, pairs, readers)

    return _an_input_differs(d, op, True, differs)


def _an_input_differs(d: PairDiff, op: OpRecord, floating: bool, made_differs: Callable[[InputRef], bool]) -> bool:
    """Whether an input of `op` of the kind asked (floating point, or an index or mask) differs: one from outside the
    pass where the pair's changed inputs name any; one an op of the pass made as `made_differs(ref)` says."""
    for meta, ref in zip(op.inputs, op.input_refs):
        if carries_gradient(meta.dtype) is not floating:
            continue
        if ref.kind != "op":
            if d.changed_inputs:
                return True
        elif made_differs(ref):
            return True
    return False


def _readers(p: Pass) -> dict[int, list[OpRecord]]:
    """op index -> the ops of `p` that read one of its outputs."""
    readers: dict[int, list[OpRecord]] = {}
    for op in p.ops:
        for r in op.input_refs:
            if r.kind == "op" and r.op_index != op.index:
                readers.setdefault(r.op_index, []).append(op)
    return readers


def _measured_downstream_differs(start: int, pairs: dict[int, PairDiff], readers: dict[int, list]) -> bool:
    """Whether the output of op `start`, which no fingerprint measured, differs, as the first measured ops that read
    it (directly or through other unmeasured ones) tell: any of them differs; True where it reaches none."""
    seen, todo, reached = set(), [start], False
    while todo:
        for op in readers.get(todo.pop(), ()):
            if op.index in seen:
                continue
            seen.add(op.index)
            if op.fingerprint and any(f is not None for f in op.fingerprint):
                d = pairs.get(op.index)
                if d is None or d.differs:
                    return True
                reached = True
            else:
                todo.append(op.index)
    return not reached


def _output_differs(d: PairDiff, output: int) -> bool:
    """Whether output `output` of a pair's op differs: by its fingerprints where both passes measured it; where they
    did not (an integer add the recorder derives from its inputs), whenever its inputs differ."""
    prints = [o.fingerprint[output] if o is not None and o.fingerprint and output < len(o.fingerprint) else None
              for o in (d.forward, d.recompute)]
    if None in prints:  # (its inputs identical: so is what it computed from them)
        return d.differs or d.inputs_same is not True
    return bool(d.kinds - {"value", "argument"}) and d.differs or prints[0] != prints[1]  # (`h > thr`, another thr:
    # the same mask where its fingerprint says so)


def _chose_otherwise(d: PairDiff) -> bool:
    """A chooser whose gradient reads only its indices (topk, sort, max.dim): whether an integer output of it differs
    (other entries chosen), as _output_differs tells."""
    op = d.recompute
    outputs = [j for j, m in enumerate(op.out) if isinstance(m, TensorMeta) and not carries_gradient(m.dtype)]
    return any(_output_differs(d, j) for j in outputs)


def gradient_path(forward: Pass, recompute: Pass, diffs: list[PairDiff] = ()) -> Callable[[PairDiff], bool] | None:
    """A test of whether a pair's difference reaches the gradient's path (in either pass), or None where the path
    cannot be followed (a trace without parameters' requires_grad, a path value written into outside state).
    `diffs`: every pair compared (what tells that an op one pass ran alone left its input as it was)."""
    if any(e.kind == "param" and e.requires_grad is None for e in recompute.externals):
        return None
    fwd_on, rec_on = path_ops(forward), path_ops(recompute)
    if fwd_on is None or rec_on is None:
        return None
    by_forward = {d.forward.index: d for d in diffs if d.forward is not None}
    by_recompute = {d.recompute.index: d for d in diffs if d.recompute is not None}
    upstream = _feeding(recompute, recompute.state.get("grad_outputs"))
    if upstream is not None:  # (only what feeds an output that requires grad: the backward starts there)
        rec_on &= upstream
        fwd_on = {i for i in fwd_on if (d := by_forward.get(i)) is None or d.recompute is None
                  or d.recompute.index in rec_on}

    read = _values_read(recompute, rec_on)
    readers = (_readers(recompute), _readers(forward))

    def reaches(d: PairDiff) -> bool:
        on_f = d.forward is not None and d.forward.index in fwd_on
        on_r = d.recompute is not None and d.recompute.index in rec_on
        if not (on_f or on_r):
            return False
        if d.kinds == {"control"} and (d.forward is None) != (d.recompute is None):  # ran in one pass only
            alone, p, pairs = ((d.recompute, recompute, by_recompute) if d.forward is None else
                               (d.forward, forward, by_forward))
            if _left_as_it_was(p, alone, pairs):
                return False
        op, pairs = (d.recompute, by_recompute) if d.recompute is not None else (d.forward, by_forward)
        if _reads_other_index(d, op, pairs) or _reads_other_values(
                d, op, pairs, readers[0] if d.recompute is not None else readers[1]):
            return True
        if not _carries(op):  # (a comparison: what it chose reaches a gradient through its readers' indices, above)
            return False
        if (d.kinds <= {"value", "argument"} and on_r and not reads_values_in_backward(d.recompute.op)
                and d.recompute.index not in read and _only_blind_arguments_differ(d) and not _chose_otherwise(d)):
            return False  # (`x + y - shift`, `x + self.shift`: the sub's output differs, no gradient reads it)
        return d.differs

    return reaches


def _only_blind_arguments_differ(d: PairDiff) -> bool:
    """The pair's non-tensor arguments differ, if at all, only where no gradient reads them (oprules.blind_arguments:
    the scalar of `x + self.shift`, not an alpha)."""
    if "argument" not in d.kinds:
        return True
    f, r = d.forward.args, d.recompute.args
    blind = blind_arguments(d.recompute.op)
    return len(f) == len(r) and all(a == b or i in blind for i, (a, b) in enumerate(zip(f, r)))


def _values_read(p: Pass, on_path: set[int]) -> set[int]:
    """The indices of `p`'s ops whose output values a gradient may read: an op on the path whose gradient reads values
    (reads_values_in_backward) reads them, directly or through ops whose gradients do not (a residual's add, a
    view)."""
    readers: dict[int, list[OpRecord]] = {}
    for op in p.ops:
        for k, r in enumerate(op.input_refs):  # (through a floating-point input: a gather's index is no value read)
            floating = k >= len(op.inputs) or carries_gradient(op.inputs[k].dtype)
            if r.kind == "op" and r.op_index != op.index and floating and not reads_shape_only(op.op):
                readers.setdefault(r.op_index, []).append(op)
    read: set[int] = set()
    for op in reversed(p.ops):  # (readers come after what they read: each is settled when its input is)
        if any(r.index in read if not reads_values_in_backward(r.op) else r.index in on_path and _carries(r)
               for r in readers.get(op.index, ())):
            read.add(op.index)
    return read


def _carries(op: OpRecord) -> bool:
    """An op with an output a gradient can flow back through (not a comparison's mask, an argmax)."""
    return any(isinstance(m, TensorMeta) and carries_gradient(m.dtype) for m in op.out) or not op.out


def _feeding(p: Pass, roots: list | None) -> set[int] | None:
    """The indices of `p`'s ops whose outputs reach `roots` ([[op, output]] the pass returned that require grad),
    these included; None where the recorder did not note them (a trace before it, an output no op made)."""
    return None if roots is None else ops_feeding(p, (op for op, _ in roots))


def _left_as_it_was(p: Pass, op: OpRecord, pairs: dict[int, PairDiff]) -> bool:
    """A clamp no element reached, run in one pass only (an overflow guard a buffer switched on between the passes):
    every op that read it matched its twin in the other pass value for value (both measured), so it left its input as
    it was, and its gradient is the identity there: no gradient changes."""
    if packet(op.op) not in IDENTITY_WHERE_UNCHANGED or not op.input_refs or op.input_refs[0].kind != "op":
        return False
    readers = [o for o in p.ops if any(r.kind == "op" and r.op_index == op.index for r in o.input_refs)]
    for reader in readers:
        d = pairs.get(reader.index)
        twin = None if d is None else d.forward if d.recompute is reader else d.recompute
        if twin is None or d.kinds & {"value", "shape", "args"} or not (twin.fingerprint and reader.fingerprint):
            return False
    return bool(readers)


def read_for_no_computed_gradient(forward: Pass, position: Position, read: tuple[str, frozenset[int]]) -> bool:
    """Whether the saved tensor at `position`, unpacked only by autograd node `read[0]` computing the gradients of its
    inputs `read[1]` (`autograd.grad(loss, x)`), fed none of those: it is an input of the forward's ops of that node
    which only other inputs' gradients read (a linear's saved input, read for its weight's). False where any such op
    may read it for one of them, or none is known."""
    node, computed = read
    readers = [r for op in forward.ops for k, ref in enumerate(op.input_refs)
               if _is_saved(ref, position) and (r := gradients_reading_input(op.op, node, k)) is not None]
    return bool(readers) and not any(r & computed for r in readers)


def _is_saved(ref: InputRef, position: Position) -> bool:
    if position.origin == "op":
        return ref.kind == "op" and ref.op_index == position.op_index and ref.output == position.output
    return ref.kind == position.origin and ref.name == position.name
