"""Watch mode: each checkpointed region's saved tensors compared between its forward and its recompute, with no
dispatch mode and no host sync; a module whose region diverged is then recorded in full (escalation).

    watch = Watch(writer, full_from_step=None)
    watch.full(key, step)                       # per region forward, in its step: True -> record it in full
    wp = WatchedPass(inputs)                    # a watched pass (inputs: id -> index of the region's inputs)
    if wp.hold(position, tensor, module):       # per saved tensor: classified; a CPU one digested now, on the host
        wp.flush()                              # every 64 held CUDA tensors: ONE launch of the batched kernel
    watch.ended(region, wp, ...)                # per pass: its digests in one asynchronous copy to pinned memory
    watch.poll()                                # comparisons whose copies have landed (event.query(): no sync)
    watch.close()                               # at the end: the rest (waits once), then the totals

What it writes (trace format 1.5): nothing for a region that reproduced its saved tensors (it is counted); for one
that did not (values, shapes, count of saved tensors, or torch's error), its region record ("watched": true, its
step) and both passes' positions, each with the digest of the tensor saved there and the module it was saved in;
an "escalate" record when a module is recorded in full (until a full recording of it diverges, at most
ESCALATION_STEPS steps: then it is watched again, and its divergences are counted, not written); a "watch" record with the totals per module [compared, diverged, never
compared, diverged unwritten, nested reruns, compared by outputs only] (every 100 steps or 30 seconds, and at the end), so a long watched run's trace stays small.

The digest of a saved tensor. A CPU tensor's is taken on the host as torch saves it (a CPU read waits for no
device; a later write behind torch's back, numpy's or `.data`'s, cannot reach it): the hash of its bytes in order and
their count (host_hash.py: XXH3, no kernel); one too large for that, as a device tensor's. A device tensor's: its
bit patterns as same-size integers summed per row of its last dimension in wrap-around integers (one kernel, exact,
in any order), then the plain and the row-weighted sums of those row sums in int64 (odd weights starting over at
each tensor: one cumulative sum per pass for all of them; on CPU one matrix-vector product): changing any element's
bits changes both, moving rows (tokens routed elsewhere) changes the weighted one. Two elements exchanged within one
row go unseen. On CUDA, the batched kernel's [sum, odd-weighted sum] of the tensor's 32-bit words (byte_sums.py)
sees those too. A tensor saved at several positions is digested once per pass; on a GPU so are views of one memory
span over 64 KiB held at one version (a linear's 2-D view of a 3-D activation), which the batched kernel would read
twice.
Parameters (and views of them) and the region's inputs are the same tensors in both passes: compared by metadata
(an FSDP all-gather rewrites a parameter in place, a new version with the same values).

Steps: the first region's forward begins step 1; a region's forward that begins after a recompute has run (a backward
reached a region) begins the next step. With gradient accumulation that is one micro-batch where each one's backward
runs before the next forward, one accumulation cycle where the forwards run first. Steps count from 1, as training
loops print them.
"""

from __future__ import annotations

import time
from collections import deque
from weakref import ref as _weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from .byte_sums import ByteSums
from .host_hash import hash_bytes
from .torch_compat import version_of
from .fingerprint import (HOLD, _SAME_SIZE_INTS, _Packed, _as_real, _local, _rows, current_stream_raw, in_memory_order,
                          wait_for_raw)
from .segments import segment_pairs
from ..trace.encode import written_meta

SUMMARY_EVERY = 100  # steps between "watch" totals records ...
# ... or seconds, whichever comes first: a process killed outright (SIGKILL, the out-of-memory killer) writes no end,
# and its trace keeps the counts of the last totals only
SUMMARY_SECONDS = 30.0
# An escalated module is recorded in full until one of its full recordings diverges (the diagnosis is then in the
# trace), at most this many steps (a divergence that recurs every few steps, an accumulation cycle's, is caught);
# then it is watched again, its divergences counted, not written: one that persists would otherwise write every
# step of a long run in full. Watch seeing it again where full recording never did escalates again, through the step
# the gap between the two divergences predicts (a schedule's period; a window around it where that is more than 3
# windows away), at most MISSED_ESCALATIONS times: then counted.
ESCALATION_STEPS = 20
MISSED_ESCALATIONS = 3
# HOLD (fingerprint.py): CUDA tensors held before their digests are taken (one launch of the batched kernel,
# byte_sums.py)
HOLD_BYTES = 256 << 20  # ... or fewer, once they hold this much memory
SPAN_MIN = 64 << 10  # a held tensor smaller than this is read again where another view of its memory is: cheaper
HOST_CPU = True  # False: CPU tensors are digested as CUDA tensors without the batched kernel are (tests run that path)
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
        bits = _rows(repeated_once(bits))
    return bits.sum(-1, dtype=acc)


def repeated_once(t: torch.Tensor) -> torch.Tensor:
    """`t` with each expanded dimension (stride 0: every index reads the same memory) cut to one index, a view: the
    values it repeats, once (an MoE's token indices expanded over the model dimension for a gather or a scatter
    are digested without a copy of every repeat)."""
    strides = t.stride()
    if 0 not in strides or t.numel() == 0:
        return t
    return t.as_strided([1 if stride == 0 else n for n, stride in zip(t.shape, strides)], strides)


_Tensor = torch.Tensor
_strided = torch.strided


def host_digest(t: torch.Tensor) -> list[int] | None:
    """The digest of a CPU tensor, read on the host when it is saved (a CPU read waits for no device, and the values
    at the save are what it digests, whatever writes them later behind torch's back): [hash of its bytes, their
    count] (host_hash.py: no kernel), its memory read as it lies where it is dense (in memory order; an expanded
    dimension once, `repeated_once`), else a copy (a slice, a lazily conjugated complex tensor), whatever its size
    (row sums would not see values moved within a row). None for a tensor without plain values. (Each save is hashed
    on its own, views of one memory included: a write behind torch's back between two saves, through `.data`, bumps
    no version, so no span can stand for the other.)"""
    dtype = t.dtype
    if (_plans[dtype] if dtype in _plans else _plan(t)) is None or t.layout is not _strided or t.is_nested:
        return None  # (the dtype's digest plan, as `row_bits` reads it: None for quantized values)
    if dtype.is_complex:
        t = t.resolve_conj().resolve_neg()
    if not t.is_contiguous():
        t = in_memory_order(repeated_once(t))
        if not t.is_contiguous():  # (not dense: a slice)
            t = t.detach().contiguous()
    size = t.nbytes
    return [hash_bytes(t, size), size]


_byte_sums = ByteSums.get
_fits = ByteSums.fits


def _batched(t: torch.Tensor) -> bool:
    """Digested by the batched kernel (a CUDA tensor, where it compiled), not by a reduction of its own."""
    return t.is_cuda and _byte_sums() is not None


class Landing:
    """One pass's digests on their way to the host (fingerprint._Packed: one buffer per device, no sync); `digests()`
    reads them, waiting only if they have not landed."""

    def __init__(self, parts: list[tuple[list[int], torch.Tensor]]) -> None:
        # (slots, their (k, 2) [sum, weighted sum] on the device)
        self._slots = [slots for slots, _ in parts]
        self._packed = _Packed([t for _, t in parts], later=True)

    def ready(self) -> bool:
        return self._packed.ready()

    def digests(self, n: int) -> list[list[int] | None]:
        """[plain sum, weighted sum] per slot (None for a tensor without a digest)."""
        out: list[list[int] | None] = [None] * n
        for slots, host in zip(self._slots, self._packed.hosts()):
            for slot, pair in zip(slots, host.tolist()):
                out[slot] = pair
        return out


NO_DIGEST = -1  # a position compared by metadata only (a parameter, a region input, a tensor without plain values)


class WatchedPass:
    """One watched pass: its saved positions as columns (position, metadata, origin, module, digest slot), and the
    digests on the device until it ends.

    `hold` classifies a saved tensor when torch packs it: a parameter (or a view of one) and the region's inputs are
    the same tensors in both passes, compared by metadata; anything else gets a digest slot. A CPU tensor is digested
    at once, on the host (`host_digest`); a CUDA tensor is kept until `flush` (every HOLD of them, or HOLD_BYTES),
    which digests them with ONE launch of the batched kernel (byte_sums), or, where it did not compile, has its row
    sums taken at once. Holding them costs what a recompute holds anyway, a region's saved tensors, and at most
    HOLD_BYTES of them."""

    def __init__(self, inputs: dict[int, int] | None = None) -> None:
        # per saved position: (position, (size, dtype, device), origin, module, digest slot or NO_DIGEST); as columns
        # (`positions`, `metas`, ...) once the pass is resolved. Metadata is written as the trace holds it only for a
        # pass that is written.
        self.entries: list[tuple] = []
        self.positions: list[int] = []
        self.metas: list[tuple] = []
        self.origins: list[str] = []
        self.names: list[str | None] = []
        self.slots: list[int] = []
        self.digests: list | None = None  # per position, once landed (`resolve`): [sum, weighted sum] or None
        self._inputs = inputs if inputs is not None else {}  # id(tensor) -> index of the region's input it is
        # (slot, tensor, its version and the address of its memory at the save, whether the batched kernel takes it)
        self._held: list[tuple[int, torch.Tensor, int, int | None, bool]] = []
        self._held_bytes = 0
        self._host: dict[int, list[int] | None] = {}  # slot -> digest, taken on the host at the save (CPU tensors)
        self._spans: dict[tuple, tuple[Any, int]] = {}  # (address, bytes, version) held -> (weakref, slot)
        # device -> [(slots, their row counts, row sums)] for `launch`'s one cumulative sum (groups of small CPU tensors,
        # device tensors the batched kernel did not take)
        self._rows: dict[torch.device, list[tuple[list[int], tuple[int, ...], torch.Tensor]]] = {}
        self._slots = 0
        self._seen: dict[int, tuple[Any, int, int]] = {}  # id(tensor) -> (weakref, version, slot): reduced once
        self._streams: set[tuple] = set()  # CUDA streams the saved tensors were made on (raw, see `_fence`)
        # (device, dtype) -> [(slots, (k, 2) [sum, weighted sum] per slot)]: the batched kernel's, a CPU tensor's own
        self._pairs: dict[tuple, list[tuple[list[int], torch.Tensor]]] = {}
        self.unmeasured: set[int] = set()  # slots whose tensor changed in place before it was read: not compared
        self.landing: Landing | None = None
        self.state: dict = {}  # the pass's state as a trace's pass holds it (the region's training mode)
        self.error: str | None = None
        self.complete = True
        self.stopped_early = False
        self.interrupted = False  # the run was stopped in it (Ctrl-C, SIGTERM): its saved tensors are a prefix
        self.lost = 0  # saved tensors a recorder error lost (Recorder._lose): the pass is never compared

    @classmethod
    def of_rows(cls, rows: list[list]) -> "WatchedPass":
        """A pass recorded in full, from its position rows (metadata as written, fingerprints landed), to compare as
        watch compares."""
        wp = cls()
        wp.positions = [row[0] for row in rows]
        wp.metas = [row[1] for row in rows]
        wp.origins = [row[2] for row in rows]
        wp.names = [row[5] for row in rows]
        wp.digests = [row[6] if len(row) > 6 else None for row in rows]
        return wp

    def hold(self, position: int, tensor: torch.Tensor, name: str | None, origin: str | None = None) -> bool:
        """Torch saved `tensor` at `position` (in module `name`); `origin` "output": a reentrant region's output.
        True: the tensors held for their digests are due (`flush`). (Per saved tensor: kept lean.)"""
        meta = (tensor.size(), tensor.dtype, tensor.device)
        kind = type(tensor)
        if origin is None:
            base = tensor._base
            if kind is not _Tensor and _is_parameter(tensor) or base is not None and type(base) is not _Tensor \
                    and _is_parameter(base):
                self.entries.append((position, meta, "param", None, NO_DIGEST))
                return False
            index = self._inputs.get(id(tensor) if base is None else id(base))
            if index is not None:
                self.entries.append((position, meta, "input", f"input[{index}]", NO_DIGEST))
                return False
            origin = "saved"
        version = version_of(tensor)
        hit = self._seen.get(id(tensor))
        if hit is not None and hit[1] == version and hit[0]() is tensor:
            self.entries.append((position, meta, origin, name, hit[2]))
            return False
        t = tensor if kind is _Tensor else _local(tensor)
        if t is None:
            self.entries.append((position, meta, origin, name, NO_DIGEST))
            return False
        if t.is_cpu and HOST_CPU:  # its digest now, on the host: the values at the save, whatever writes them later
            digest = host_digest(t)
            if digest is None:
                self.entries.append((position, meta, origin, name, NO_DIGEST))
                return False
            slot = self._new_slot(tensor, version)
            self._host[slot] = digest
            self.entries.append((position, meta, origin, name, slot))
            return False
        if _batched(t):
            return self._hold_for_kernel(position, meta, origin, name, tensor, t, version)
        # its row sums now, on its device (while its memory is in the cache), paired at `launch`
        if t.is_cuda:
            self._streams.add(current_stream_raw(t.get_device()))
        rows = row_bits(t)
        if rows is None:
            self.entries.append((position, meta, origin, name, NO_DIGEST))
            return False
        slot = self._new_slot(tensor, version)
        self._add_rows(slot, rows)
        self.entries.append((position, meta, origin, name, slot))
        return False

    def _hold_for_kernel(self, position: int, meta: tuple, origin: str, name: str | None, tensor: torch.Tensor,
                         t: torch.Tensor, version: int) -> bool:
        """Hold `t` (the plain tensor of `tensor`) for the batched kernel, which reads the memory it occupies at the
        flush: views of one memory span over SPAN_MIN, saved at one version, read the same bytes then and share one
        digest. True: the held tensors are due."""
        size = t.numel() * t.element_size()  # (`nbytes` raises for a sparse tensor)
        try:  # (where its memory begins: freed or resized outside dispatch, as FSDP's reshard does, it moves)
            address = t.data_ptr()
        except RuntimeError:  # no storage (sparse): reduced by rows, or not at all, at the flush
            address = None
        takes = address is not None and t.layout is _strided and not t.is_quantized and _fits(t)  # (the kernel)
        span = (address, size, version_of(t)) if takes and size > SPAN_MIN else None
        if span is not None:
            hit = self._spans.get(span)
            if hit is not None and hit[0]() is not None:  # (alive: its memory is not another tensor's since)
                self.entries.append((position, meta, origin, name, hit[1]))
                return False
        slot = self._new_slot(tensor, version)
        if span is not None:
            self._spans[span] = (self._seen[id(tensor)][0], slot)
        self.entries.append((position, meta, origin, name, slot))
        if t.is_cuda:  # the raw (id, device, type) of the stream it was made on: a cheap C call
            self._streams.add(current_stream_raw(t.get_device()))
        self._held.append((slot, t, version, address, takes))
        self._held_bytes += size
        return len(self._held) >= HOLD or self._held_bytes >= HOLD_BYTES

    def _new_slot(self, tensor: torch.Tensor, version: int) -> int:
        slot = self._slots
        self._slots = slot + 1
        self._seen[id(tensor)] = (_weakref(tensor), version, slot)
        return slot

    def flush(self) -> None:
        """Digest the held tensors (CUDA ones, or any where the batched kernel is forced): the batched kernel takes
        them in one launch per device; one it cannot take (a size it does not fit) gets its row sums. A tensor changed
        in place since its save is not compared (its values at the save are gone), nor is one whose storage was
        resized or freed since (FSDP's reshard frees storage so)."""
        held, self._held, self._held_bytes = self._held, [], 0
        batches: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
        for slot, t, version, address, takes in held:
            if version_of(t) != version or address is not None and t.data_ptr() != address:
                self.unmeasured.add(slot)  # (written, or its storage resized outside dispatch: FSDP frees so)
            elif takes:  # (its layout cannot change without a new version or address)
                batches.setdefault(t.device, []).append((slot, t))
            else:
                rows = row_bits(t)
                if rows is None:
                    self.unmeasured.add(slot)
                else:
                    self._add_rows(slot, rows)
        if batches:
            foreign = self._fence()
            for device, batch in batches.items():
                tensors = [t for _, t in batch]
                if foreign:  # made on another stream, read on this one: their memory must outlive the read there
                    stream = torch.cuda.current_stream(device)
                    for t in tensors:
                        t.record_stream(stream)
                self._pairs.setdefault((device, torch.int32), []).append(
                    ([s for s, _ in batch], _byte_sums().launch(tensors)))

    def _add_rows(self, slot: int, rows: torch.Tensor) -> None:
        """One tensor's row sums, kept for the pass's one cumulative sum on their device (`segment_pairs`)."""
        self._rows.setdefault(rows.device, []).append(([slot], (rows.numel(),), rows))

    def _fence(self) -> bool:
        """The current stream waits for the streams the saved tensors were made on (a device-side wait); True if one
        of them is another stream."""
        foreign = wait_for_raw(self._streams)
        self._streams = set()
        return foreign

    def launch(self) -> None:
        """Per device: the [sum, weighted sum] pairs of the pass, copied to pinned memory in one buffer (no host sync):
        the batched kernel's, those of CPU tensors (taken as they were saved or flushed), and those of a device's row
        sums (`segment_pairs`, where the batched kernel did not take a tensor)."""
        self.flush()
        self._fence()
        for device, entries in self._rows.items():  # ONE cumulative sum per device for all their row sums
            self._pairs.setdefault((device, torch.int64), []).append((
                [s for slots, _, _ in entries for s in slots],
                segment_pairs([r for _, _, r in entries], tuple(n for _, lengths, _ in entries for n in lengths))))
        self._rows = {}
        parts = []
        for batches in self._pairs.values():
            slots = [s for part, _ in batches for s in part]
            parts.append((slots, torch.cat([p for _, p in batches]) if len(batches) > 1 else batches[0][1]))
        self._pairs = {}
        self._seen, self._spans = {}, {}
        self.landing = Landing(parts) if parts else None  # (nothing to read back: parameters and inputs only)

    def resolve(self) -> None:
        """The columns of the saved positions and the digest of each (the landing is ready)."""
        by_slot = self.landing.digests(self._slots) if self.landing is not None else [None] * self._slots
        for slot, digest in self._host.items():
            by_slot[slot] = digest
        for slot in self.unmeasured:
            by_slot[slot] = None
        if self.entries:
            self.positions, self.metas, self.origins, self.names, self.slots = map(list, zip(*self.entries))
        self.digests = [None if slot < 0 else by_slot[slot] for slot in self.slots]
        self.landing = None

    def rows(self, mask: frozenset = frozenset()) -> list[list]:
        """The positions as the trace holds them: [position, meta, origin, None, 0, module(, digest)]; a position
        in `mask` (or without values) without its digest, one whose tensor changed in place with None."""
        digests = self.digests or [None] * len(self.positions)
        return [[p, written_meta(m), o, None, 0, n] if s < 0 or p in mask else [p, written_meta(m), o, None, 0, n, d]
                for p, m, o, n, s, d in zip(self.positions, self.metas, self.origins, self.names, self.slots, digests)]


def _is_parameter(t: torch.Tensor) -> bool:
    """isinstance(t, Parameter), without its metaclass's Python __instancecheck__ for plain tensors (per saved tensor)."""
    kind = type(t)
    return kind is not _Tensor and (kind is torch.nn.Parameter or isinstance(t, torch.nn.Parameter))


@dataclass
class _Totals:
    compared: int = 0
    diverged: int = 0
    unchecked: int = 0  # forwards never compared (no backward reached them, the run stopped first)
    unwritten: int = 0  # diverged after their module's full recording showed it (ESCALATION_STEPS): counted only
    nested: int = 0  # nested checkpoints a watched recompute ran: torch never recomputes them again
    outputs: int = 0  # of those compared, reentrant ones: by their outputs only (their forward saves nothing)

    def to_json(self) -> list[int]:
        return [self.compared, self.diverged, self.unchecked, self.unwritten, self.nested, self.outputs]


@dataclass
class _Comparison:
    region: Any
    forward: WatchedPass
    recompute: WatchedPass
    attempt: int = 0  # the recompute's number from 0: a later backward recomputes the region again (retain_graph)


@dataclass
class Watch:
    """Steps, escalation and the comparisons of watched passes (see the module docstring). `write(record)` writes
    one trace record; `region_record(region)` gives a region's record."""

    write: Any
    region_record: Any
    full_from_step: int | None = None
    escalate: bool = True
    full_steps: int = 0  # the first steps recorded in full (a bug that strikes in step 1 needs no second run)
    # a module watch compares by its outputs only (a reentrant checkpoint's forward saves nothing) is recorded in full
    # once every `resample_every` steps, one such module a step (`_resample`; 0: never)
    resample_every: int = 0
    flush: Any = None  # pushes what was written to disk: the totals are read while the run goes on, or after a kill
    resampled: dict[str, int] = field(default_factory=dict)  # module -> its steps recorded in full for that
    _last_full: dict[str, int] = field(default_factory=dict)  # such a module -> the step it was last recorded in full
    _resampling: tuple = (0, None)  # (step, the module recorded in full in it for that)
    _ran: dict[str, None] = field(default_factory=dict)  # such modules that ran in this step (ordered)
    step: int = 0
    escalated: dict[str, dict] = field(default_factory=dict)  # key -> {"diverged_step", "region", "from_step"}
    totals: dict[str, _Totals] = field(default_factory=dict)
    pending: deque = field(default_factory=deque)
    raised: set = field(default_factory=set)  # ids of regions torch's check raised for
    # module -> the (position, metadata) of saved tensors whose values its full recordings do not compare (`learn`)
    unmeasured: dict[str, set] = field(default_factory=dict)
    held: dict[str, list] = field(default_factory=dict)  # comparisons awaiting a full recording of their module
    _summarized_at: int = 0
    _summarized_time: float = field(default_factory=time.monotonic)

    # -- which regions are recorded in full ----------------------------------------------------
    def full(self, key: str | None, step: int, outputs_only: bool = False) -> bool:
        """A region's forward begins in `step` (the recorder counts them): say whether it is recorded in full (from
        --full-from-step, its module was escalated, or, `outputs_only` (reentrant), its turn to be resampled)."""
        if step != self.step and self.resample_every:
            self._choose_resample(step)
        full = self._full(key, step)
        if outputs_only and key is not None:
            self._ran[key] = None
            if full:
                self._last_full[key] = self.step
            else:
                full = self._resample(key)
        return full

    def _choose_resample(self, step: int) -> None:
        """Where watch compares a module's regions by their outputs only, a recompute that reaches the same outputs
        through other saved tensors changes the gradients unseen: such a module is recorded in full every
        `resample_every` steps, in turn, one a step (no step pays for all of them): of those that ran in the step
        before, the one recorded in full longest ago, once it is due. The first resamples come sooner, 1, 2, 4, 8
        and 16 steps apart, so that a short run, or a divergence from its first steps, is looked at early."""
        ran, self._ran = self._ran, {}
        due = [k for k in ran if step - self._last_full[k] >= min(self.resample_every, 1 << self.resampled.get(k, 0))]
        self._resampling = (step, min(due, key=self._last_full.__getitem__) if due else None)

    def _resample(self, key: str) -> bool:
        self._last_full.setdefault(key, self.step)
        if self._resampling != (self.step, key):
            return False
        if self._last_full[key] != self.step:  # (its first region this step: counted once)
            self._last_full[key] = self.step
            self.resampled[key] = self.resampled.get(key, 0) + 1
        return True

    def _full(self, key: str | None, step: int) -> bool:
        if step != self.step:
            self.step = step
            if self.step - self._summarized_at >= SUMMARY_EVERY or self.step > 1 and \
                    time.monotonic() - self._summarized_time >= SUMMARY_SECONDS:
                self.summarize()
        if self.step <= self.full_steps or self.full_from_step is not None and self.step >= self.full_from_step:
            return True
        hit = self.escalated.get(key) if key is not None else None
        if hit is None or hit["from_step"] is None and self.step < hit.get("start_at", 0):
            return False
        if hit["from_step"] is None:
            hit["from_step"] = self.step
            if not hit.get("provisional"):
                self.write({"type": "escalate", "module": key, "diverged_step": hit["diverged_step"],
                            "region": hit["region"], "from_step": self.step})
        if hit.get("until_step") is not None:
            return False
        caught = hit.get("caught")
        settled = not hit.get("provisional") or hit.get("confirmed")  # (a provisional one confirmed: an escalation)
        steps = hit.get("steps", ESCALATION_STEPS)
        if caught is not None and self.step > caught or settled and self.step >= hit["from_step"] + steps:
            hit["until_step"] = self.step  # watched again from this step
            return False
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
                  error: str | None, outputs: WatchedPass | None = None) -> None:
        """A pass recorded in full (the first steps, an escalated module, --full-from-step): a forward teaches which
        saved positions hold no values (`learn`); a recompute whose saved tensors differ from its forward's, as watch
        compares them, keeps its module recorded in full (`keep_full`). `outputs`: a reentrant region's, compared
        instead (its forward saves nothing)."""
        if outputs is not None:
            outputs.resolve()  # (queued before the pass's own read-back, which has landed)
            wp = outputs
        else:
            wp = WatchedPass.of_rows(positions)
        wp.complete, wp.stopped_early, wp.error = complete, stopped_early, error
        if phase == "forward":
            region.watch_forward = wp
            self.learn(region.watch_key, positions)
            return
        if region.watch_forward is None:
            return
        region.watch_compared = True
        if _difference(region.watch_forward, wp, frozenset()):  # (each recompute: a later backward's too)
            self.keep_full(region)
            hit = self.escalated.get(region.watch_key)
            # (a region of the escalation, not one before it whose later recompute differed)
            if hit is not None and hit.get("caught") is None and hit.get("from_step") is not None \
                    and (region.step or 0) >= hit["from_step"]:
                hit["caught"] = region.step  # its full recording shows the divergence: watched again after it

    def keep_full(self, region: Any) -> None:
        """A region recorded in full saved other tensors in its recompute: its module is recorded in full from then
        on, as if watch had seen it diverge."""
        key = region.watch_key
        if key is None or not self.escalate:
            return
        hit = self.escalated.get(key)
        if hit is None or hit.get("provisional") and not hit.get("confirmed"):
            reentrant = region.kind == "reentrant"  # (watch compares its outputs, not what it saved)
            self.escalated[key] = {"diverged_step": region.step, "region": region.number, "from_step": region.step,
                                   "confirmed": True, "why": "full", "reentrant": reentrant}
            self.write({"type": "escalate", "module": key, "diverged_step": region.step, "region": region.number,
                        "from_step": region.step, "why": "full", "reentrant": reentrant})

    def started(self, key: str | None) -> None:
        """A watched forward began."""
        self._totals(key).unchecked += 1

    def nested_rerun(self, key: str | None) -> None:
        """A nested checkpoint ran inside a watched recompute: nothing to compare (counted, as full recording
        reports it)."""
        self._totals(key).nested += 1

    def torch_raised(self, region: Any) -> None:
        self.raised.add(id(region))

    # -- passes ------------------------------------------------------------------------------
    def ended(self, region: Any, wp: WatchedPass, phase: str, complete: bool, stopped_early: bool,
              error: str | None, interrupted: bool = False) -> None:
        wp.complete, wp.stopped_early, wp.error, wp.interrupted = complete, stopped_early, error, interrupted
        wp.launch()
        if phase == "forward":
            if region.watch_forward is None:
                region.watch_forward = wp
            return
        forward = region.watch_forward
        if forward is None:
            return
        # each recompute is compared: a later backward through the region (retain_graph=True, torch.autograd.grad
        # then .backward()) recomputes it from the state of then, and its gradients come from that recompute
        region.watch_compared = True
        self.pending.append(_Comparison(region, forward, wp, region.recomputes - 1))  # (the recorder counts them)

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
        self._summarized_at, self._summarized_time = self.step, time.monotonic()
        self.write({"type": "watch", "step": self.step, "full_from_step": self.full_from_step,
                    "full_steps": self.full_steps, "resample_every": self.resample_every,
                    "resampled": dict(self.resampled),
                    "modules": {key: t.to_json() for key, t in self.totals.items()},
                    "escalated": {key: dict(v) for key, v in self.escalated.items()}})
        if self.flush is not None:  # (a clean watched run writes nothing else that would flush it)
            self.flush()

    # -- judging -----------------------------------------------------------------------------
    def _judge(self, cmp: _Comparison, final: bool = False) -> None:
        """`final`: the run ended; a comparison whose mask never came is judged without it (never clean over a
        difference nothing explained)."""
        region = cmp.region
        for wp in (cmp.forward, cmp.recompute):
            if wp.digests is None:  # (not yet resolved: a pass of parameters and host digests has no landing)
                wp.resolve()
        key = region.watch_key
        learned = self.unmeasured.get(key) if key is not None else None
        forward = cmp.forward
        mask = None if learned is None else frozenset(
            p for p, meta in zip(forward.positions, forward.metas) if (p, written_meta(meta)) in learned
        ) if learned else frozenset()
        raised = id(region) in self.raised
        if (cmp.forward.lost or cmp.recompute.lost) and not raised:
            return  # (what the recorder failed to hold is no difference: not compared, so never clean either)
        how = _difference(cmp.forward, cmp.recompute, mask or frozenset())
        if cmp.recompute.interrupted and not how and not raised:
            return  # (stopped in it, what it saved until then the same: never compared, as full recording says)
        if how == "values" and mask is None and not raised and not final and self.escalate and key is not None:
            # values differ only where full recording may not compare them (uninitialised outputs): record this
            # module's next region in full to learn which positions those are, then judge
            self.held.setdefault(key, []).append(cmp)
            self.escalated.setdefault(key, {"diverged_step": region.step, "region": region.number,
                                            "from_step": None, "provisional": True})
            return
        totals = self._totals(key)
        if not cmp.attempt:  # (a region counts once, by its first recompute; a later one only when it diverges)
            totals.unchecked -= 1
            totals.compared += 1
            if cmp.forward.origins and all(o == "output" for o in cmp.forward.origins):
                totals.outputs += 1
        if not (how or raised) or cmp.attempt and region.watch_diverged:
            return
        region.watch_diverged = True
        self.raised.discard(id(region))
        totals.diverged += 1
        hit = self.escalated.get(key) if key is not None else None
        if hit is not None and hit.get("until_step") is not None and (region.step or 0) >= hit["until_step"]:
            if hit.get("caught") is not None or hit.get("missed", 0) >= MISSED_ESCALATIONS:
                totals.unwritten += 1  # its module's full recording already shows this divergence, or never will
                _add_step(hit.setdefault("counted_steps", []), region.step)
                return
            # full recording never saw it (it recurs less often than the window): record the module again, through
            # the step the gap since the last divergence predicts (a schedule's period); where that is far, a window
            # around it
            gap = region.step - hit["diverged_step"] if region.step and hit.get("diverged_step") else 0
            far = gap + 2 > 3 * ESCALATION_STEPS
            self.escalated[key] = hit = {"diverged_step": region.step, "region": region.number, "from_step": None,
                                         "missed": hit.get("missed", 0) + 1,
                                         "start_at": region.step + gap - ESCALATION_STEPS // 2 if far else 0,
                                         "steps": ESCALATION_STEPS if far else max(ESCALATION_STEPS, gap + 2)}
        self._write_region(region, (cmp.forward, "forward"), (cmp.recompute, "recompute"), mask=mask,
                           attempt=cmp.attempt)
        if self.escalate and key is not None:
            hit = self.escalated.get(key)
            if hit is None:
                self.escalated[key] = {"diverged_step": region.step, "region": region.number, "from_step": None}
            elif hit["from_step"] is None and hit.get("start_at"):  # (before the step its gap predicted: record now)
                hit.update(start_at=0, diverged_step=region.step, region=region.number)
            elif hit.get("provisional") and not hit.get("confirmed"):
                hit.update(confirmed=True, diverged_step=region.step, region=region.number)
                if hit["from_step"] is not None:  # (recorded in full already, to learn its mask: say so now)
                    self.write({"type": "escalate", "module": key, "diverged_step": region.step,
                                "region": region.number, "from_step": hit["from_step"]})

    def unfinished(self, region: Any) -> None:
        """A watched region the run stopped before recomputing, which the diagnosis needs (torch's version check
        stopped the backward over one of its inputs): its record and its forward's saved positions."""
        wp = region.watch_forward
        if wp is None or region.watch_compared:
            return
        if wp.digests is None:
            wp.resolve()
        self._write_region(region, (wp, "forward"))

    def _write_region(self, region: Any, *passes: tuple[WatchedPass, str], mask: frozenset | None = None,
                      attempt: int = 0) -> None:
        self.write(self.region_record(region))
        for wp, phase in passes:
            record = {"type": "pass", "region": region.number, "phase": phase,
                      "attempt": attempt if phase == "recompute" else 0, "n_ops": None,
                      "complete": wp.complete, "stopped_early": wp.stopped_early, "state": wp.state, "externals": [],
                      "positions": wp.rows(mask or frozenset())}
            if wp.error:
                record["error"] = wp.error
            self.write(record)

    def _totals(self, key: str | None) -> _Totals:
        name = key or "?"
        t = self.totals.get(name)
        if t is None:
            t = self.totals[name] = _Totals()
        return t


_MAX_STEP_RANGES = 64  # counted steps kept per module, as ranges: a divergence every other step fills them first


def _add_step(ranges: list[list[int]], step: int | None) -> None:
    """Count `step` into `ranges` ([[first, last], ...], ascending): the steps a divergence recurred in, which a
    report names ("steps 21-29"), in a few numbers however long the run."""
    if step is None:
        return
    if ranges and ranges[-1][0] <= step <= ranges[-1][1] + 1:
        ranges[-1][1] = max(ranges[-1][1], step)
    elif len(ranges) < _MAX_STEP_RANGES:
        ranges.append([step, step])


def _landed(cmp: _Comparison) -> bool:
    return all(wp.landing is None or wp.landing.ready() for wp in (cmp.forward, cmp.recompute))


def _other_tensor(forward: WatchedPass, recompute: WatchedPass, column: str, mask: frozenset) -> bool:
    """A position whose origin (or module) differs where its values were not measured in both passes (outside `mask`).
    Where they were, the values decide: a forward recorded in full may save a view of an input that a framework's hook
    made inside the region (FSDP2's pre-forward hook), where its recompute, run without that hook, saves the input."""
    f, r = getattr(forward, column), getattr(recompute, column)
    return any(a != b and (x is None or y is None or x == NO_DIGEST or y == NO_DIGEST or p in mask)
               for a, b, x, y, p in zip(f, r, forward.digests, recompute.digests, forward.positions))


def _difference(forward: WatchedPass, recompute: WatchedPass, mask: frozenset) -> str | None:
    """How the recompute saved other tensors: "saved" (another count, not an early stop's prefix; other metadata or
    origin; or it raised), "values" (only values differ, outside `mask`), or None."""
    cut = recompute.stopped_early or recompute.interrupted  # (a prefix of the forward's saved tensors)
    if (recompute.error or not recompute.complete) and not recompute.interrupted:
        return "saved"
    # (a reentrant region's parameters unfrozen between its passes: the backward runs on the recompute's graph, so they
    # get gradients, whatever the outputs compared say)
    if (recompute.state or {}).get("trainable_n", 0) > (forward.state or {}).get("trainable_n", 0):
        return "saved"
    n, m = len(recompute.metas), len(forward.metas)
    if n != m and not (cut and n < m):
        return "saved"
    # column by column (list comparisons in C): an early stop's recompute is a prefix of the forward
    if recompute.metas != (forward.metas if n == m else forward.metas[:n]):
        return "saved"
    fd, rd = forward.digests, recompute.digests
    for column in ("origins", "names"):
        f = getattr(forward, column)
        if getattr(recompute, column) != (f if n == m else f[:n]) and _other_tensor(forward, recompute, column, mask):
            return "saved"
    if fd == rd:
        return None
    for p, a, b in zip(forward.positions, fd, rd):
        if a != b and a is not None and b is not None and p not in mask:
            return "values"
    return None

