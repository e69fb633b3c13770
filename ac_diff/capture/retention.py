"""Retention: what the recorder writes of a pass under `write="diverged"`, decided from a signature of each pass.

    sig = signature(p, fps)                               # ops, positions, externals, state, mutated, attributes
    compare_signatures(forward_sig, recompute_sig, stopped_early=False, reentrant=False)
    -> "same" | "side_effects" | "different"
    pass_summary(record, verdict, fps)                    # a reproduced pass's record: counts, verdict, digest

Exact and conservative: anything that may differ is "different" and written in full. The op rules it
applies (hook-only and reentrant-only ops, outside updates, in-place writes) are diagnosis's, from
ac_diff.oprules; the alignment and tolerances of diagnosis are not needed here (a reproduction is
bit-identical, op for op).
"""

from __future__ import annotations

import hashlib
from typing import Any

from ..oprules import HOOK_ONLY_OPS, REENTRANT_ONLY_OPS, is_outside_update, state_read, written_inputs
from .rows import _ARGS, _HOST, _OP, _OUT, _REFS
from .torch_compat import _SAC_MODES, FORWARD


def pass_summary(record: dict, verdict: str, fps: dict[int, list], rows: list[tuple], ranks: bool) -> dict:
    """The pass record of a region whose recompute reproduced its forward (write="diverged"), ~1 KB: counts, the
    verdict ("same", or "side_effects": only outside state updated in place differs) and a digest of every value
    the pass measured (its ops' fingerprints, then its inputs', in order), so two runs' summaries can still be
    compared. With `ranks` (a distributed run), the forward keeps the parameters and buffers it reads, with
    their fingerprints: what ranks compare to find replicated state that drifted apart (+~100 bytes each).
    Positions, module attributes and every other input go (the signature found them equal; a counter bumped
    twice would look like a changed input)."""
    kept = {k: v for k, v in record.items() if k not in ("positions", "externals", "attributes", "attribute_updates")}
    read = set() if record["phase"] != FORWARD or not ranks else {
        key for row in rows for key in state_read(row[_OP], [ref[:2] for ref in row[_REFS]])}
    externals = [{k: v for k, v in e.items() if k not in ("i", "first_op")}
                 for e in record.get("externals", ()) if (e["kind"], e["name"]) in read]
    return {**kept, "ops_written": False, "verdict": verdict, "positions": [], "externals": externals,
            "n_positions": len(record.get("positions", ())), "n_externals": len(record.get("externals", ())),
            "values_digest": values_digest(fps, record.get("externals", ()))}


def values_digest(fps: dict[int, list], externals: Any) -> str:
    """16 hex digits over the fingerprints of a pass's op outputs and inputs (float reprs are exact)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(repr(sorted(fps.items())).encode())
    h.update(repr([e.get("fp") for e in externals]).encode())
    return h.hexdigest()


def signature(p: Any, fps: dict[int, list]) -> tuple:
    """What must be equal for a recompute to count as a reproduction of its forward (write="diverged")."""
    ops = []
    mutated: set[tuple] = set()  # externals the pass updates in place
    for i, row in enumerate(p.ops):
        name = row[_OP]
        if name in HOOK_ONLY_OPS:
            continue
        side = bool(row[_REFS]) and is_outside_update(name, row[_REFS][0][0])
        if side:
            mutated.add(row[_REFS][0][:2])
        if p.phase == FORWARD:  # externals the forward updates itself (a batch norm's running statistics)
            mutated.update(ref[:2] for ref in written_inputs(name, row[_ARGS], row[_REFS]) if ref[0] != "op")
        ops.append((name, row[_ARGS], row[_OUT], row[_HOST], fps.get(i), side))
    positions = [pos[1] for pos in p.positions]
    externals = {(e["kind"], e["name"]): e.get("fp") for e in p.externals}
    state = {k: v for k, v in p.state.items() if k != "rng"}  # RNG effects show in the random ops' values
    if "dispatch_modes" in state:  # selective AC runs a caching mode in the forward, a cached one in recompute
        state["dispatch_modes"] = ["SAC" if m in _SAC_MODES else m for m in state["dispatch_modes"]]
    attributes = {**p.attributes, **{"updated " + k: v for k, v in p.attribute_updates.items()}}
    return ops, positions, externals, state, mutated, attributes


SAME, SIDE_EFFECTS, DIFFERENT = "same", "side_effects", "different"


def compare_signatures(forward: tuple, recompute: tuple, stopped_early: bool, reentrant: bool) -> str:
    """SAME; SIDE_EFFECTS (only in-place updates of outside state differ); DIFFERENT (anything else)."""
    f_ops, f_positions, f_externals, f_state, f_mutated, f_attributes = forward
    r_ops, r_positions, r_externals, r_state, r_mutated, r_attributes = recompute
    if f_state != r_state or f_positions != r_positions or f_externals.keys() != r_externals.keys():
        return DIFFERENT
    # module attributes both passes saw (an early-stopped recompute calls fewer modules): a counter a pre-hook bumps
    if any(f_attributes[k] != r_attributes[k] for k in f_attributes.keys() & r_attributes.keys()):
        return DIFFERENT
    side_effects = False
    for key, a in f_externals.items():
        b = r_externals[key]
        if a is not None and b is not None and a != b:
            if key not in f_mutated:
                return DIFFERENT
            side_effects = True  # a counter the forward already bumped
    if reentrant:
        r_ops = [o for o in r_ops if o[0] not in REENTRANT_ONLY_OPS]
    if len(r_ops) > len(f_ops) or (len(r_ops) < len(f_ops) and not stopped_early):
        return DIFFERENT
    for a, b in zip(f_ops, r_ops):
        if a[:4] != b[:4] or a[5] != b[5]:
            return DIFFERENT
        fa, fb = a[4], b[4]
        if fa and fb:
            for x, y in zip(fa, fb):
                if x is not None and y is not None and x != y:  # NaN != NaN: written, conservatively
                    if not a[5]:
                        return DIFFERENT
                    side_effects = True
    return SIDE_EFFECTS if side_effects else SAME
