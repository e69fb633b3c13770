"""Retention: what the recorder writes of a pass under `write="diverged"`, decided from a signature of each pass.

    retention = Retention(writer, hold_bytes=256 << 20, keep_clean=1, distributed=lambda: False)
    retention.write(p, ops_record, record, fps, kept, failed=False)   # per finished pass: hold, summarize or write
    retention.release(region); retention.release_all()                # write held forwards in full

    sig = signature(p, fps)                               # ops, positions, externals, state, mutated, attributes, first reads
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
import weakref
from typing import Any, Callable, NamedTuple

from ..stateflags import PASS_NOTES
from ..oprules import HOOK_ONLY_OPS, REENTRANT_ONLY_OPS, is_outside_update, state_read, written_inputs
from .rows import _ARGS, _HOST, _OP, _OUT, _REFS
from .torch_compat import _SAC_MODES, FORWARD


def pass_summary(record: dict, verdict: str, fps: dict[int, list], rows: list[tuple], ranks: bool) -> dict:
    """The pass record of a region whose recompute reproduced its forward (write="diverged"), ~1 KB: counts, the
    verdict ("same", or "side_effects": only outside state updated in place differs) and a digest of every value
    the pass measured (its ops' fingerprints, then its inputs', in order), so two runs' summaries can still be
    compared. With `ranks` (a distributed run), the forward keeps the parameters and buffers it reads, with
    their fingerprints: what ranks compare to find replicated state that drifted apart (+~100 bytes each).
    Positions, module attributes and every other input go (the signature found them equal), but the state a pass
    of a side-effect verdict updated (`_updated_state`)."""
    kept = {k: v for k, v in record.items()
            if k not in ("positions", "externals", "attributes", "attribute_updates", "globals", "global_readers",
                         "outputs")}
    read = set() if record["phase"] != FORWARD or not ranks else {
        key for row in rows for key in state_read(row[_OP], [ref[:2] for ref in row[_REFS]])}
    externals = [{k: v for k, v in e.items() if k not in ("i", "first_op", "obj", "rg")}
                 for e in record.get("externals", ()) if (e["kind"], e["name"]) in read]
    return {**kept, **(_updated_state(record) if verdict == SIDE_EFFECTS else {}), "ops_written": False,
            "verdict": verdict, "positions": [], "externals": externals,
            "n_positions": len(record.get("positions", ())), "n_externals": len(record.get("externals", ())),
            "values_digest": values_digest(fps, record.get("externals", ()))}


def _updated_state(record: dict) -> dict:
    """The module attributes and globals a pass updated, with their values and updates: a counter each pass bumps
    and the code reads is what every later region's gradients depend on (diagnosis: read again), not only the
    first one's written in full. A few entries."""
    updated, changed = record.get("attribute_updates") or {}, record.get("global_updates") or {}
    out: dict = {}
    if updated:
        out["attribute_updates"] = updated
        out["attributes"] = {k: v for k, v in (record.get("attributes") or {}).items() if k in updated}
    if changed:
        out["globals"] = {k: v for k, v in (record.get("globals") or {}).items() if k in changed}
        out["global_readers"] = {k: v for k, v in (record.get("global_readers") or {}).items() if k in changed}
    return out


def values_digest(fps: dict[int, list], externals: Any) -> str:
    """16 hex digits over the fingerprints of a pass's op outputs and inputs (float reprs are exact)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(repr(sorted(fps.items())).encode())
    h.update(repr([e.get("fp") for e in externals]).encode())
    return h.hexdigest()


def updated_externals(ops: Any) -> set[tuple]:
    """(kind, name) of the tensors a pass did not make that its ops (recorder rows) write in place: a batch norm's
    running statistics in training, a step counter."""
    return {ref[:2] for row in ops for ref in written_inputs(row[_OP], row[_ARGS], row[_REFS]) if ref[0] != "op"}


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
        ops.append((name, row[_ARGS], row[_OUT], row[_HOST], fps.get(i), side))
    if p.phase == FORWARD:  # externals the forward updates itself (a batch norm's running statistics)
        mutated |= updated_externals(row for row in p.ops if row[_OP] not in HOOK_ONLY_OPS)
    # per saved position: ([meta, view of a base]) and the fingerprint of its values
    positions = [(pos[1:2] + pos[7:8], pos[6] if len(pos) > 6 else None) for pos in p.positions]
    externals = {(e["kind"], e["name"]): e.get("fp") for e in p.externals}
    first_reads = {(e["kind"], e["name"]): e.get("first_op") for e in p.externals}  # the op that read it first
    # RNG effects show in the random ops' values
    state = {k: v for k, v in p.state.items() if k != "rng" and k not in PASS_NOTES}
    if "dispatch_modes" in state:  # selective AC runs a caching mode in the forward, a cached one in recompute
        state["dispatch_modes"] = ["SAC" if m in _SAC_MODES else m for m in state["dispatch_modes"]]
    attributes = {**p.attributes, **{"updated " + k: v for k, v in p.attribute_updates.items()},
                  **{"global " + k: v for k, v in p.globals.items()}}
    return ops, positions, externals, state, mutated, attributes, first_reads


SAME, SIDE_EFFECTS, DIFFERENT = "same", "side_effects", "different"


def compare_signatures(forward: tuple, recompute: tuple, stopped_early: bool, reentrant: bool) -> str:
    """SAME; SIDE_EFFECTS (only in-place updates of outside state differ); DIFFERENT (anything else)."""
    f_ops, f_positions, f_externals, f_state, f_mutated, f_attributes, f_reads = forward
    r_ops, r_positions, r_externals, r_state, r_mutated, r_attributes, _ = recompute
    if reentrant:  # (torch runs a reentrant forward without grad, its recompute with: a branch on it shows in the ops)
        f_state, r_state = ({k: v for k, v in s.items() if k != "grad_enabled"} for s in (f_state, r_state))
    if f_state != r_state or len(f_positions) != len(r_positions) or not _same_reads(
            f_externals.keys(), r_externals.keys(), f_reads, len(r_ops) if stopped_early else None):
        return DIFFERENT
    for (meta, a), (other, b) in zip(f_positions, r_positions):  # values where both were measured
        if meta != other or a is not None and b is not None and a != b:
            return DIFFERENT
    # module attributes both passes saw (an early-stopped recompute calls fewer modules); a counter the region's code
    # bumps in each pass, and nothing else between them, is a side effect (the report names it: counted twice)
    side_effects = False
    for k in f_attributes.keys() & r_attributes.keys():
        if f_attributes[k] != r_attributes[k]:
            name = k.removeprefix("updated ")
            f_up, r_up = f_attributes.get("updated " + name), r_attributes.get("updated " + name)
            if not (f_up and r_up and f_up[1] == r_attributes.get(name)):
                return DIFFERENT
            side_effects = True
    for key, a in f_externals.items():
        if key not in r_externals:  # (read only after where the recompute stopped: `_same_reads`)
            continue
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


def _same_reads(forward: Any, recompute: Any, first_reads: dict, stopped_at: int | None) -> bool:
    """Both passes read the same outside tensors; a recompute torch stopped early (`stopped_at`: the ops it ran) may
    not read those that only the forward's ops after that point read (the bias of a block's last linear)."""
    if forward == recompute:
        return True
    return stopped_at is not None and recompute <= forward and all(
        (first_reads.get(key) or 0) >= stopped_at for key in forward - recompute)


class HeldForward(NamedTuple):
    """A forward held unwritten until its recompute says whether it reproduced."""

    ops_record: Any  # () -> its "ops" record (built and encoded only if written), or None without ops
    record: dict  # its "pass" record
    signature: tuple  # `signature`
    size: int  # ~ its encoded size, counted against `hold_bytes`
    fps: dict[int, list]  # fingerprints by op: its summary's values digest
    rows: list[tuple]  # its op rows: the state its summary keeps in a distributed run


class Retention:
    """The write="diverged" policy: hold each forward until its recompute; then write both in full if they differ,
    else only their pass records (marked "ops_written": false). Conservative: anything unusual is written in full.
    A region carries its state in `hold` ("held": forward in memory, "clean": summarized, "written"), `held` (a
    HeldForward) and `signature` (the forward's, once decided: later recomputes compare with it)."""

    def __init__(self, writer: Any, hold_bytes: int, keep_clean: int, distributed: Callable[[], bool]) -> None:
        self._writer = writer
        self._hold_bytes = hold_bytes
        self._keep_clean = keep_clean
        self._distributed = distributed  # whether summaries keep what ranks compare
        self._held: dict[int, Any] = {}  # region number -> region whose forward waits for its recompute
        self._held_size = 0
        # region number -> (weakref to the region, its forward): forwards of regions that reproduced, while the region
        # lives (its frame: the graph can still be backpropagated through) and within a quarter of `hold_bytes`, for
        # a later recompute that does not (another backward: retain_graph, autograd.grad then .backward())
        self._reproduced: dict[int, tuple[Any, HeldForward]] = {}
        self._reproduced_size = 0
        self._side_effect_modules: set[str | None] = set()
        self._clean_samples: dict[str | None, int] = {}  # module -> its clean regions written in full
        # module -> the side outputs ([op, output, holder]...) written in full
        self._side_outputs: dict[str | None, set] = {}

    def write(self, p: Any, ops_record: Any, record: dict, fps: dict[int, list], kept: list, failed: bool) -> None:
        """A finished pass: hold it (a forward), summarize it and its forward (a reproduction), or write both."""
        region = p.region
        writer = self._writer
        sig = signature(p, fps)
        if p.phase == FORWARD:
            # a forward that raised; a region entered twice; the first of its module to hand out side outputs from
            # these ops (a reentrant region's: its forward's ops tell whether a gradient could reach them; later
            # ones, a resample's, repeat it): keep everything
            if failed or region.hold or self._new_side_outputs(region.module, record):
                region.hold = "written"
                if ops_record is not None:
                    writer.write(ops_record)
                writer.write(record)
                return
            # held unencoded (encoding is half the cost of writing); counted at ~ its encoded size
            size = 300 * len(p.ops) + sum(len(v["b64"]) for v in kept if v) if ops_record is not None else 0
            region.held, region.hold = HeldForward(ops_record, record, sig, size, fps, p.ops), "held"
            self._held[region.number] = region
            self._held_size += size
            while self._held_size > self._hold_bytes and self._held:
                self.release(next(iter(self._held.values())))  # the oldest forward goes to disk in full
            return
        if not region.hold:  # a recompute inside the region's own forward (autograd.grad in it): keep the forward
            region.hold = "written"
        forward = region.held.signature if region.hold == "held" else region.signature
        verdict = DIFFERENT if failed or forward is None else compare_signatures(
            forward, sig, bool(record.get("stopped_early")), region.kind == "reentrant")
        clean = verdict != DIFFERENT and not self._written_in_full(region, verdict)
        if region.hold == "held":
            if clean:
                held = self._unhold(region, "clean")
                writer.write(pass_summary(held.record, verdict, held.fps, held.rows, ranks=self._distributed()))
                self._keep_reproduced(region, held)
            else:
                self.release(region)
        if clean and region.hold == "clean":
            writer.write(pass_summary(record, verdict, fps, p.ops, ranks=self._distributed()))
            return
        if region.hold == "clean":
            kept = self._reproduced.pop(region.number, None)
            if kept is not None and kept[0]() is not None:  # the forward again, in full: diagnosis compares this one
                self._reproduced_size -= kept[1].size
                region.hold = "written"
                if kept[1].ops_record is not None:
                    writer.write(kept[1].ops_record)
                writer.write(kept[1].record)
            else:
                writer.write({"type": "warning", "message": (
                    f"region {region.number}: recompute {p.attempt + 1} did not reproduce the forward, whose ops "
                    "were not kept (write='diverged' keeps a reproduced region's forward while memory allows)")})
        if ops_record is not None:
            writer.write(ops_record)
        writer.write(record)

    def _new_side_outputs(self, module: str | None, record: dict) -> bool:
        side = (record.get("state") or {}).get("side_outputs")
        if not side:
            return False
        seen = self._side_outputs.setdefault(module, set())
        key = tuple(tuple(pair) for pair in side)
        if key in seen:
            return False
        seen.add(key)
        return True

    def release(self, region: Any) -> None:
        """Write a held forward in full (memory limit, a failed check, the end of the run)."""
        if region.hold != "held":
            return
        held = self._unhold(region, "written")
        if held.ops_record is not None:
            self._writer.write(held.ops_record)
        self._writer.write(held.record)

    def _keep_reproduced(self, region: Any, held: HeldForward) -> None:
        """Keep a reproduced region's forward for a later recompute while the region lives, the oldest dropped past
        a quarter of `hold_bytes`; those of regions gone (their graph freed) are dropped first. The region lives as
        long as torch's checkpoint frame does (the held forward itself refers to the region: a weak reference to the
        region would never die, and every step's forwards piled up to the bound)."""
        kept = self._reproduced
        for number in [n for n, (ref, _) in kept.items() if ref() is None]:
            self._reproduced_size -= kept.pop(number)[1].size
        kept[region.number] = (getattr(region, "frame", None) or weakref.ref(region), held)
        self._reproduced_size += held.size
        while self._reproduced_size > self._hold_bytes // 4 and kept:
            self._reproduced_size -= kept.pop(next(iter(kept)))[1].size

    def release_all(self) -> None:
        for region in list(self._held.values()):
            self.release(region)

    def _unhold(self, region: Any, hold: str) -> HeldForward:
        held = region.held
        region.signature = held.signature
        self._held_size -= held.size
        self._held.pop(region.number, None)
        region.held, region.hold = None, hold
        return held

    def _written_in_full(self, region: Any, verdict: str) -> bool:
        """Whether a reproduced region is written in full all the same: the first region of each module with side
        effects (a counter the recompute bumps again: the report names them), and the first `keep_clean` clean
        regions of each module while their forward is still held (a sample of what a clean region records)."""
        first_side_effects = verdict == SIDE_EFFECTS and region.module not in self._side_effect_modules
        if first_side_effects:
            self._side_effect_modules.add(region.module)
        sampled = self._clean_samples.get(region.module, 0)
        if not first_side_effects and (region.hold != "held" or sampled >= self._keep_clean):
            return False
        self._clean_samples[region.module] = sampled + 1
        return True
