"""Watch mode: each checkpointed region's saved tensors compared between its forward and its recompute, with no
dispatch mode and no host sync; a module whose region diverged is then recorded in full (escalation).

    watch = Watch(writer, full_from_step=None)
    watch.full(key, top_level)                  # per region forward: counts steps; True -> record it in full
    wp = WatchedPass()                          # a watched pass
    wp.saved(position, tensor, meta, origin, name)  # ONE reduction kernel per saved tensor the region made
    watch.ended(region, wp, ...)                # per pass: 3 kernels and an asynchronous copy to pinned memory
    watch.poll()                                # comparisons whose copies have landed (event.query(): no sync)
    watch.close()                               # at the end: the rest (waits once), then the totals

What it writes (trace format 1.5): nothing for a region that reproduced its saved tensors (it is counted); for one
that did not (values, shapes, count of saved tensors, or torch's error), its region record ("watched": true, its
step) and both passes' positions, each with the digest of the tensor saved there and the module it was saved in;
an "escalate" record when a module is recorded in full from then on; a "watch" record with the totals per module
(every 100 steps and at the end), so a long watched run's trace stays small.

The digest of a saved tensor: its bit patterns as same-size integers summed per row of its last dimension in
wrap-around integers (one kernel, exact, in any order), then, per pass and for all its tensors at once, the plain and
the row-weighted sums of those row sums in int64 (odd weights starting over at each tensor): changing any element's
bits changes both, moving rows (tokens routed elsewhere) changes the weighted one. Two elements exchanged within one
row go unseen. A tensor saved at several positions is reduced once per pass.
Parameters (and views of them) and the region's inputs are the same tensors in both passes: compared by metadata
(an FSDP all-gather rewrites a parameter in place, a new version with the same values).

Steps: the first region's forward begins step 1; a region's forward that begins after a recompute has run (a backward
reached a region) begins the next step. With gradient accumulation that is one micro-batch where each one's backward
runs before the next forward, one accumulation cycle where the forwards run first. Steps count from 1, as training
loops print them.
"""

from __future__ import annotations

from collections import deque
from weakref import ref as _weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from .byte_sums import ByteSums, wrapped
from .fingerprint import _SAME_SIZE_INTS, StreamFence, _Packed, _as_real, _local, _rows, _weights

SUMMARY_EVERY = 100  # steps between "watch" totals records
BATCH = 64  # CUDA tensors held for one launch of the batched digest kernel (byte_sums.py)
# Row sums accumulate in wrap-around int32 (int64 for 8-byte elements): exact modulo 2**32 in any order, so a change of
# any one element's bits changes its row's sum; an int64 accumulator over narrower integers is 10x slower on CPU.
_ROW_SUM_DTYPE = {1: torch.int32, 2: torch.int32, 4: torch.int32, 8: torch.int64}


_plans: dict[torch.dtype, tuple | None] = {}  # dtype -> (bit view dtype or None, sum dtype), None: no digest


def _plan(t: torch.Tensor) -> tuple | None:
    """How tensors of `t`'s dtype are digested (per dtype, cached): complex through its real view, every dtype
    through the same-size integers of its bits."""
    if t.is_quantized:
        plan = None
    else:
        size = t.element_size() // 2 if t.dtype.is_complex else t.element_size()
        ints = _SAME_SIZE_INTS.get(size)
        plan = None if ints is None else (None if t.dtype is ints else ints, _ROW_SUM_DTYPE[size])
    _plans[t.dtype] = plan
    return plan


def row_bits(t: torch.Tensor) -> torch.Tensor | None:
    """The sums of `t`'s bit patterns per row of its last dimension (one kernel), or None for a tensor whose memory
    holds no plain values (quantized, sparse, meta, a wrapper subclass without a local tensor)."""
    if type(t) is not _Tensor:
        t = _local(t)
        if t is None:
            return None
    dtype = t.dtype
    plan = _plans[dtype] if dtype in _plans else _plan(t)
    if plan is None or t.layout is not _strided or t.is_meta:
        return None
    if dtype.is_complex:
        t = _as_real(t)
    view, acc = plan
    bits = t if view is None else t.view(view)
    if bits.dim() != 2 or not bits.is_contiguous():
        bits = _rows(bits)
    return bits.sum(-1, dtype=acc)


_Tensor = torch.Tensor
_strided = torch.strided
_current_stream = getattr(torch._C, "_cuda_getCurrentStream", None)  # device index -> (stream id, index, type)
_byte_sums = ByteSums.get


def _batched(t: torch.Tensor) -> bool:
    """Digested by the batched kernel (a CUDA tensor, where it compiled), not by a reduction of its own."""
    return t.is_cuda and _byte_sums() is not None


_index_cache: dict[tuple, torch.Tensor] = {}  # (device, row counts of a pass) -> index of each tensor's last row


def _last_rows(device: torch.device, lengths: tuple[int, ...]) -> torch.Tensor:
    """The device index of each non-empty tensor's last row in the concatenation: copied there once per layout
    (the same every step for a fixed model), from pinned memory without a sync."""
    key = (device, lengths)
    idx = _index_cache.get(key)
    if idx is None:
        ends, at = [], 0
        for n in lengths:
            at += n
            if n:
                ends.append(at - 1)
        host = torch.tensor(ends, dtype=torch.int64)
        if device.type == "cuda":
            idx = host.pin_memory().to(device, non_blocking=True)
        else:
            idx = host.to(device)
        if len(_index_cache) > 256:
            _index_cache.clear()
        _index_cache[key] = idx
    return idx


class Landing:
    """One pass's digests on their way to the host (fingerprint._Packed: one buffer per device, no sync); `digests()`
    reads them, waiting only if they have not landed."""

    def __init__(self, parts: list[tuple[list[int], tuple[int, ...] | None, torch.Tensor]]) -> None:
        # (slots, row counts (None: one [sum, weighted sum] row per slot, byte_sums), the device tensor)
        self._layout = [(slots, lengths) for slots, lengths, _ in parts]
        self._packed = _Packed([t for *_, t in parts], later=True)

    def ready(self) -> bool:
        return self._packed.ready()

    def digests(self, n: int) -> list[list[int] | None]:
        """[plain sum, row-weighted sum] per slot (None for a tensor without a digest)."""
        out: list[list[int] | None] = [None] * n
        for (slots, lengths), host in zip(self._layout, self._packed.hosts()):
            if lengths is None:  # byte sums, one pair per slot
                for slot, pair in zip(slots, host.tolist()):
                    out[slot] = pair
                continue
            c1, c2 = host.tolist() if host.numel() else ([], [])
            k, prev1, prev2, start = 0, 0, 0, 0
            for slot, rows in zip(slots, lengths):
                if not rows:
                    out[slot] = [0, 0]
                    continue
                s1, s2 = c1[k] - prev1, c2[k] - prev2
                prev1, prev2 = c1[k], c2[k]
                k += 1
                out[slot] = [wrapped(s1, 64), wrapped(s2 - 2 * start * s1, 64)]  # weights restart at the first row
                start += rows
        return out


class WatchedPass:
    """One watched pass: the rows of its saved positions, and their row sums on the device until it ends."""

    def __init__(self) -> None:
        # per saved position: [position, meta, origin, None, 0, name(, digest slot -> its digest once landed)]
        self.positions: list[list] = []
        self._rows: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}  # device -> [(slot, row sums)]
        self._slots = 0
        self._seen: dict[int, tuple[Any, int, int]] = {}  # id(tensor) -> (weakref, version, slot): reduced once
        self._streams: set[tuple] = set()  # CUDA streams the saved tensors were made on (raw, see `_fence`)
        # CUDA tensors awaiting the batched kernel (byte_sums), by device: [(slot, tensor, its version at the save)]
        self._batch: dict[torch.device, list[tuple[int, torch.Tensor, int]]] = {}
        self._pairs: dict[torch.device, list[tuple[list[int], torch.Tensor]]] = {}  # device -> [(slots, (k, 2) sums)]
        self.unmeasured: set[int] = set()  # slots whose tensor changed in place before it was read: not compared
        self.landing: Landing | None = None
        self.error: str | None = None
        self.complete = True
        self.stopped_early = False

    def saved(self, position: int, tensor: torch.Tensor | None, meta: Any, origin: str, name: str | None) -> None:
        row = [position, meta, origin, None, 0, name]
        if tensor is not None:
            hit = self._seen.get(id(tensor))
            if hit is not None and hit[0]() is tensor and hit[1] == tensor._version:
                row.append(hit[2])
            elif not (_batched(tensor) and self._add_to_batch(tensor, row)):
                rows = row_bits(tensor)
                if rows is not None:
                    device = rows.device
                    if device.type == "cuda":  # the raw (id, device, type) of its current stream: a cheap C call
                        self._streams.add(_current_stream(device.index))
                    self._rows.setdefault(device, []).append((self._slots, rows))
                    self._seen[id(tensor)] = (_weakref(tensor), tensor._version, self._slots)
                    row.append(self._slots)
                    self._slots += 1
        self.positions.append(row)

    def _add_to_batch(self, tensor: torch.Tensor, row: list) -> bool:
        """A CUDA tensor waits for the batched kernel (held until then: at most BATCH of them per device); False for
        one the kernel does not take (not dense, not 16-byte sized and aligned: reduced on its own)."""
        t = tensor if type(tensor) is _Tensor else _local(tensor)
        if t is None or t.is_quantized or t.layout is not _strided or not _byte_sums().fits(t):
            return False
        if t.is_cuda:
            self._streams.add(_current_stream(t.device.index))
        batch = self._batch.setdefault(t.device, [])
        batch.append((self._slots, t, t._version))
        self._seen[id(tensor)] = (_weakref(tensor), tensor._version, self._slots)
        row.append(self._slots)
        self._slots += 1
        if len(batch) >= BATCH:
            self._flush(t.device)
        return True

    def _flush(self, device: torch.device) -> None:
        batch = self._batch.pop(device, [])
        if not batch:
            return
        self._fence()
        self.unmeasured.update(slot for slot, t, version in batch if t._version != version)
        self._pairs.setdefault(device, []).append(([s for s, _, _ in batch], _byte_sums().launch([t for _, t, _ in batch])))

    def _fence(self) -> None:
        """The current stream waits for the streams the saved tensors were made on (a device-side wait)."""
        if self._streams:
            fence = StreamFence()
            for stream_id, index, kind in self._streams:
                fence.note(index, torch.cuda.Stream(stream_id=stream_id, device_index=index, device_type=kind))
            fence.wait(torch.cuda.current_stream)
            self._streams = set()

    def launch(self) -> None:
        """Per device: the digests of the pass, copied to pinned memory in one buffer (no host sync). Row sums: their
        plain and weighted cumulative sums at each tensor's last row (cat, mul, cumsum, index_select, copy); CUDA
        tensors: the batched byte sums (one kernel per BATCH tensors, a cat, a copy)."""
        parts = []
        for device in list(self._batch):
            self._flush(device)
        self._fence()
        for device, batches in self._pairs.items():
            slots = [s for part, _ in batches for s in part]
            parts.append((slots, None, torch.cat([p for _, p in batches]) if len(batches) > 1 else batches[0][1]))
        self._pairs = {}
        for device, entries in self._rows.items():
            slots = [s for s, _ in entries]
            rows = [r for _, r in entries]
            lengths = tuple(r.numel() for r in rows)
            flat = torch.cat(rows) if len(rows) > 1 else rows[0]
            sums = torch.cumsum(flat.unsqueeze(0) * _weights(device, torch.int64, flat.numel(), "ones_odd"), dim=1)
            parts.append((slots, lengths, sums.index_select(1, _last_rows(device, lengths))))
        self._rows = {}
        self._seen = {}
        self.landing = Landing(parts)

    def resolve(self) -> None:
        """Replace each digest slot by its digest (the landing is ready)."""
        digests = self.landing.digests(self._slots) if self.landing is not None else []
        for row in self.positions:
            if len(row) > 6:
                row[6] = None if row[6] in self.unmeasured else digests[row[6]]
        self.landing = None


@dataclass
class _Totals:
    compared: int = 0
    diverged: int = 0
    unchecked: int = 0  # forwards never compared (no backward reached them, the run stopped first)

    def to_json(self) -> list[int]:
        return [self.compared, self.diverged, self.unchecked]


@dataclass
class _Comparison:
    region: Any
    forward: WatchedPass
    recompute: WatchedPass


@dataclass
class Watch:
    """Steps, escalation and the comparisons of watched passes (see the module docstring). `write(record)` writes
    one trace record; `region_record(region)` gives a region's record."""

    write: Any
    region_record: Any
    full_from_step: int | None = None
    escalate: bool = True
    full_steps: int = 0  # the first steps recorded in full (a bug that strikes in step 1 needs no second run)
    step: int = 0
    recomputed: bool = False  # a recompute ran since the step began (the next region forward begins a new step)
    escalated: dict[str, dict] = field(default_factory=dict)  # key -> {"diverged_step", "region", "from_step"}
    totals: dict[str, _Totals] = field(default_factory=dict)
    pending: deque = field(default_factory=deque)
    raised: set = field(default_factory=set)  # ids of regions torch's check raised for
    # module -> the (position, metadata) of saved tensors whose values its full recordings do not compare (`learn`)
    unmeasured: dict[str, set] = field(default_factory=dict)
    held: dict[str, list] = field(default_factory=dict)  # comparisons awaiting a full recording of their module
    _summarized_at: int = 0

    # -- which regions are recorded in full ----------------------------------------------------
    def full(self, key: str | None, top_level: bool) -> bool:
        """A region's forward begins: count the step, and say whether it is recorded in full (from
        --full-from-step, or its module was escalated)."""
        if top_level and (self.step == 0 or self.recomputed):
            self.step += 1
            self.recomputed = False
            if self.step - self._summarized_at >= SUMMARY_EVERY:
                self.summarize()
        if self.step <= self.full_steps or self.full_from_step is not None and self.step >= self.full_from_step:
            return True
        hit = self.escalated.get(key) if key is not None else None
        if hit is None:
            return False
        if hit["from_step"] is None:
            hit["from_step"] = self.step
            if not hit.get("provisional"):
                self.write({"type": "escalate", "module": key, "diverged_step": hit["diverged_step"],
                            "region": hit["region"], "from_step": self.step})
        return True

    def learn(self, key: str | None, positions: list[list]) -> None:
        """A forward of `key`'s module recorded in full: its saved positions without a fingerprint are those whose
        values full recording does not compare (attention's unused output, the philox state of a call that drew
        nothing, selective AC's cache); watched passes of the same module skip a position of the same number and
        metadata (not the count: an MoE's saves vary with the experts that got tokens). Comparisons held for this
        module are judged now."""
        if key is None:
            return
        self.unmeasured.setdefault(key, set()).update(
            (row[0], row[1]) for row in positions if len(row) <= 6 or row[6] is None)
        held = self.held.pop(key, [])
        for cmp in held:
            self._judge(cmp)
        hit = self.escalated.get(key) if key is not None else None
        if held and hit is not None and hit.get("provisional") and not hit.get("confirmed"):
            del self.escalated[key]  # escalated only to learn the mask, and nothing diverged: watched again

    def full_pass(self, region: Any, phase: str, positions: list[list], complete: bool, stopped_early: bool,
                  error: str | None) -> None:
        """A pass recorded in full (the first steps, an escalated module, --full-from-step): a forward teaches which
        saved positions hold no values (`learn`); a recompute whose saved tensors differ from its forward's, as watch
        compares them, keeps its module recorded in full (`keep_full`)."""
        wp = WatchedPass()
        wp.positions, wp.complete, wp.stopped_early, wp.error = positions, complete, stopped_early, error
        if phase == "forward":
            region.watch_forward = wp
            self.learn(region.watch_key, positions)
            return
        if region.watch_forward is None or region.watch_compared:
            return
        region.watch_compared = True
        if _difference(region.watch_forward, wp, frozenset()):
            self.keep_full(region)

    def keep_full(self, region: Any) -> None:
        """A region recorded in full saved other tensors in its recompute: its module is recorded in full from then
        on, as if watch had seen it diverge."""
        key = region.watch_key
        if key is None or not self.escalate:
            return
        hit = self.escalated.get(key)
        if hit is None or hit.get("provisional") and not hit.get("confirmed"):
            self.escalated[key] = {"diverged_step": region.step, "region": region.number, "from_step": region.step,
                                   "confirmed": True, "why": "full"}
            self.write({"type": "escalate", "module": key, "diverged_step": region.step, "region": region.number,
                        "from_step": region.step, "why": "full"})

    def started(self, key: str | None) -> None:
        """A watched forward began."""
        self._totals(key).unchecked += 1

    def torch_raised(self, region: Any) -> None:
        self.raised.add(id(region))

    # -- passes ------------------------------------------------------------------------------
    def ended(self, region: Any, wp: WatchedPass, phase: str, complete: bool, stopped_early: bool,
              error: str | None) -> None:
        wp.complete, wp.stopped_early, wp.error = complete, stopped_early, error
        wp.launch()
        if phase == "forward":
            if region.watch_forward is None:
                region.watch_forward = wp
            return
        forward = region.watch_forward
        if forward is None or region.watch_compared:  # a second recompute (retain_graph): the first is compared
            return
        region.watch_compared = True
        self.pending.append(_Comparison(region, forward, wp))

    def poll(self) -> None:
        """Judge every comparison whose digests have landed, oldest first (the copies land in order)."""
        pending = self.pending
        while pending and _landed(pending[0]):
            self._judge(pending.popleft())

    def close(self) -> None:
        """The run ended: wait for every digest still on its way, judge, write the totals."""
        while self.pending:
            self._judge(self.pending.popleft())  # (reading the digests waits for those still on their way)
        for held in self.held.values():
            for cmp in held:
                self._judge(cmp, final=True)
        self.held.clear()
        self.summarize()

    def summarize(self) -> None:
        self._summarized_at = self.step
        self.write({"type": "watch", "step": self.step, "full_from_step": self.full_from_step,
                    "full_steps": self.full_steps,
                    "modules": {key: t.to_json() for key, t in self.totals.items()},
                    "escalated": {key: dict(v) for key, v in self.escalated.items()}})

    # -- judging -----------------------------------------------------------------------------
    def _judge(self, cmp: _Comparison, final: bool = False) -> None:
        """`final`: the run ended; a comparison whose mask never came is judged without it (never clean over a
        difference nothing explained)."""
        region = cmp.region
        for wp in (cmp.forward, cmp.recompute):
            if wp.landing is not None:
                wp.resolve()
        key = region.watch_key
        learned = self.unmeasured.get(key) if key is not None else None
        mask = None if learned is None else frozenset(row[0] for row in cmp.forward.positions
                                                      if (row[0], row[1]) in learned)
        raised = id(region) in self.raised
        how = _difference(cmp.forward, cmp.recompute, mask or frozenset())
        if how == "values" and mask is None and not raised and not final and self.escalate and key is not None:
            # values differ only where full recording may not compare them (uninitialised outputs): record this
            # module's next region in full to learn which positions those are, then judge
            self.held.setdefault(key, []).append(cmp)
            self.escalated.setdefault(key, {"diverged_step": region.step, "region": region.number,
                                            "from_step": None, "provisional": True})
            return
        totals = self._totals(key)
        totals.unchecked -= 1
        totals.compared += 1
        if not (how or raised):
            return
        self.raised.discard(id(region))
        totals.diverged += 1
        self.write(self.region_record(region))
        for wp, phase in ((cmp.forward, "forward"), (cmp.recompute, "recompute")):
            rows = wp.positions if not mask else [row[:6] if row[0] in mask else row for row in wp.positions]
            record = {"type": "pass", "region": region.number, "phase": phase, "attempt": 0, "n_ops": None,
                      "complete": wp.complete, "stopped_early": wp.stopped_early, "state": {}, "externals": [],
                      "positions": rows}
            if wp.error:
                record["error"] = wp.error
            self.write(record)
        if self.escalate and key is not None:
            hit = self.escalated.get(key)
            if hit is None:
                self.escalated[key] = {"diverged_step": region.step, "region": region.number, "from_step": None}
            elif hit.get("provisional") and not hit.get("confirmed"):
                hit.update(confirmed=True, diverged_step=region.step, region=region.number)

    def _totals(self, key: str | None) -> _Totals:
        name = key or "?"
        t = self.totals.get(name)
        if t is None:
            t = self.totals[name] = _Totals()
        return t


def _landed(cmp: _Comparison) -> bool:
    return all(wp.landing is None or wp.landing.ready() for wp in (cmp.forward, cmp.recompute))


def _difference(forward: WatchedPass, recompute: WatchedPass, mask: frozenset) -> str | None:
    """How the recompute saved other tensors: "saved" (another count, not an early stop's prefix; other metadata or
    origin; or it raised), "values" (only values differ, outside `mask`), or None."""
    if recompute.error or not recompute.complete:
        return "saved"
    f, r = forward.positions, recompute.positions
    if len(r) != len(f) and not (recompute.stopped_early and len(r) < len(f)):
        return "saved"
    values = False
    for a, b in zip(f, r):
        if a[1] != b[1] or a[2] != b[2] or a[5] != b[5]:
            return "saved"
        if len(a) > 6 and len(b) > 6 and a[6] != b[6] and a[6] is not None and b[6] is not None \
                and a[0] not in mask:
            values = True
    return "values" if values else None

