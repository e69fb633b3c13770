"""Follow data backwards from a divergent op to the data-dependent decision behind it.

    decision_path(forward_ops, split_op)
    -> [topk, view, histc, _to_copy(device=cpu), split_with_sizes]
    data_path(forward_ops, nonzero_op, sources={topk.index}, through=lambda op: differs[op.index])
    -> [topk, squeeze, eq, nonzero]          (every step a real producer link)

Tensor inputs are followed through their producers (input references, or a log's `$N` ids).
A list of sizes handed to an op from Python (`counts.tolist()` -> `split_with_sizes`) has no tensor
link; the host tensor it came from is found as the closest earlier op whose output has as many
elements as the list (and, when fingerprints exist, the same sum).
"""

from __future__ import annotations

from ..passes import OpRecord
from ..oprules import CHOOSER_OPS, packet
from .passdiff import is_discrete

_MAX_STEPS = 12


def is_chooser(op: OpRecord) -> bool:
    """A recorded decision that chooses (see oprules.CHOOSER_OPS); `discrete` as recorded or by name."""
    return is_discrete(op) and packet(op.op) in CHOOSER_OPS


def _int_list_args(op: OpRecord) -> list[list[int]]:
    lists = []
    for a in op.args:
        if isinstance(a, list) and a and all(isinstance(x, int) and not isinstance(x, bool) for x in a):
            lists.append(a)
    return lists


def _host_source(ops_before: list[OpRecord], sizes: list[int]) -> OpRecord | None:
    """The op whose output became this host list: same element count (and sum, if fingerprinted)."""
    total = sum(sizes)
    fallback = None
    for op in reversed(ops_before[-200:]):
        for j, meta in op.tensor_outputs():
            numel = 1
            for s in meta.shape:
                numel *= s
            if numel != len(sizes) or not meta.shape:
                continue
            fp = op.fingerprint[j] if op.fingerprint and j < len(op.fingerprint) else None
            if fp is not None:
                if abs(float(fp[0]) - total) < 0.5:
                    return op
                continue
            on_host = meta.device == "cpu" or "device(type='cpu')" in str(op.args) or "'cpu'" in str(op.args)
            if on_host and meta.dtype[:1] in "iu":
                return op
            fallback = fallback or op
    return fallback


def decision_path(ops: list[OpRecord], target: OpRecord) -> list[OpRecord]:
    """From `target` back to the discrete decision it depends on, in forward order (target last)."""
    by_index = {o.index: o for o in ops}
    position = {o.index: k for k, o in enumerate(ops)}
    path = [target]
    current = target
    for _ in range(_MAX_STEPS):
        nxt = None
        refs = [r for r in current.input_refs if r.kind == "op" and r.op_index in by_index]
        lists = _int_list_args(current)
        if lists and current is target:
            k = position.get(current.index, len(ops))
            nxt = _host_source(ops[:k], max(lists, key=len))
        if nxt is None and refs:
            nxt = by_index[refs[0].op_index]
        if nxt is None or nxt in path:
            break
        path.append(nxt)
        current = nxt
        if is_chooser(current):
            break
    path.reverse()
    return path


def _producers(ops: list[OpRecord], op: OpRecord, by_index: dict, position: dict) -> list[OpRecord]:
    """The ops whose outputs `op` reads: tensor inputs, and the host tensor behind a list of sizes."""
    found = [by_index[r.op_index] for r in op.input_refs if r.kind == "op" and r.op_index in by_index]
    lists = _int_list_args(op)
    if lists:
        host = _host_source(ops[:position.get(op.index, len(ops))], max(lists, key=len))
        if host is not None:
            found.append(host)
    return found


def data_path(ops: list[OpRecord], target: OpRecord, sources: set[int], through) -> list[OpRecord]:
    """The shortest chain of producer links from an op in `sources` to `target`, in forward order, passing
    only through ops where `through(op)` holds; [] when the data does not connect them."""
    by_index = {o.index: o for o in ops}
    position = {o.index: k for k, o in enumerate(ops)}
    parent: dict[int, int | None] = {target.index: None}
    queue = [target]
    while queue:
        current = queue.pop(0)
        if current.index in sources and current is not target:
            path = [current]
            while parent[path[-1].index] is not None:
                path.append(by_index[parent[path[-1].index]])
            return path
        for producer in _producers(ops, current, by_index, position):
            if producer.index not in parent and (producer.index in sources or through(producer)):
                parent[producer.index] = current.index
                queue.append(producer)
    return []


def upstream(ops: list[OpRecord], target: OpRecord) -> list[OpRecord]:
    """Every op of the pass whose outputs `target`'s values depend on, nearest first."""
    by_index = {o.index: o for o in ops}
    position = {o.index: k for k, o in enumerate(ops)}
    seen, found = {target.index}, []
    queue = [target]
    while queue:
        current = queue.pop(0)
        for producer in _producers(ops, current, by_index, position):
            if producer.index not in seen:
                seen.add(producer.index)
                found.append(producer)
                queue.append(producer)
    return found
