"""Value fingerprints of tensors, computed on the tensor's own device and read back once per pass.

    batch = FingerprintBatch()
    slot = batch.add(tensor)          # queues device-side reductions; no host sync
    k = batch.keep(small_tensor)      # a device-side copy of a small tensor's values; no host sync
    ...
    values, kept = batch.collect()    # ONE device->host copy per device and kind (fingerprints) and
    values[slot]                      # per device and dtype (kept values): O(passes), not O(ops)
    kept[k]                           # {"dtype": "i64", "shape": [4, 2], "b64": "..."} (see encode_values)

Floats: two position-weighted sums, see `_weights_of_matrix` (on a device: float32/64 in one pass over the
data; half precision: a float32 sum and the weighted sum, no float64 upcasts, which cost 2-4x more).
Integers and bools: exact int64 sum and position-weighted sum, so a permutation (topk picking the
same experts in another order) changes the fingerprint.

CPU tensors are not reduced one by one: they are fingerprinted HOLD at a time (`FingerprintBatch.flush`). A small
one is copied into a staging buffer when added (one kernel: whatever writes it later, through torch or behind its
back, cannot reach its fingerprint), one per dtype and row length, so they share one row reduction at the flush; a
larger float tensor gets its weighted row sums when added; all those row sums become pairs in ONE segmented float64
sum, and the small integer tensors get theirs from ONE exact cumulative sum (segments.py). Each number depends on
its tensor's values only, never on the tensors beside it in the flush (tested), so forward and recompute agree bit
for bit. Borrowed tensors (parameters, inputs: the pass did not make them) are not copied but read at the flush,
which comes before any op that writes one of them in place; one whose storage was freed since (FSDP's reshard) gets
no fingerprint. About 0.8 kernels per recorded op where there were 2.4. On CPU reading the results waits for no
device, so they are read at the flush; the bit sums below are then taken only for the tensors whose pair is not
finite. Tensors on a GPU are held too and fingerprinted by ONE launch of the fused kernels per dtype at the flush
(fused_prints.py: the pair and the bit sum from one pass over each tensor's memory, over fixed tiles in a fixed order;
a non-dense one through a copy); where those kernels are not available, each is reduced on its own, on its stream (a
GPU's segmented reductions may order a sum by its alignment, and the pair must be bit-identical).

Every other dtype is fingerprinted through a view of the same memory (`_plan`), no copy:
* complex: `torch.view_as_real`, as floats (complex32 as float16), so like its real dtype;
* float dtypes without arithmetic kernels (float8 variants, float4_e2m1fn_x2 and any later one):
  their bit patterns as same-size integers (a byte view: uint8), fingerprinted as integers: the exact
  sum and position-weighted sum of the bit patterns, so one changed byte or a permutation changes it;
* uint16/32/64 (few kernels) and the bits, sub-byte int and uint dtypes: the same-size integer view
  (int16/32/64, uint8), fingerprinted as integers;
* quantized tensors (their values mean something only with their scales), sparse and meta tensors
  get no fingerprint.

Non-finite floats: a sum over a tensor that holds -inf (an additive attention mask) or NaN, or whose
huge values overflow (a `finfo.min` mask), is -inf or NaN whatever else changed. So every float tensor
also gets a third number, computed on the device with the pair: the sums of each row's bit patterns
(the floats reinterpreted as integers, in wrap-around int32 arithmetic, exact in any order) weighted
by odd row weights. A change of any one element's bits changes it, as does a changed row. A recording's batches
(`FingerprintBatch(bits=True)`: the recorder's, the audit's recompute check's, the gradients') end every float
fingerprint with it, `[s1, s2, 12345]`: one element one ulp off in a large tensor can vanish in the pair's float sums.
Without `bits` it follows the pair only where the pair is not finite (`[-inf, -inf, 12345]`). On a device the fused
kernels take it in the same pass; on a CPU, one kernel per staged buffer or large tensor and five per flush
(`segments.segment_odd_sums`).

Every device->host transfer goes through `to_host` (tests count its calls: on a GPU each one is a
synchronisation, so there must be a constant number per pass, never one per op), or, where the values are read
later (watch mode), `to_host_later`: an asynchronous copy into pinned memory and its event, no sync.

CUDA streams: the reductions of a tensor are queued on the stream current when it is added (the one its
producer ran on: an FSDP all-gather's or an overlapped collective's side stream), the read-back runs on
the stream current at collect time. So `add` and `keep` note, per device, the current stream of the
tensor's own device (cuda:1 on LOCAL_RANK 1), and `collect` makes each device's reading stream wait for
all of them first (`StreamFence`). CPU tensors make no torch.cuda call.
"""

from __future__ import annotations

import base64
from math import isfinite
from operator import methodcaller
from typing import Any, Callable

import torch

from .fused_prints import MAX_ELEMENTS, FusedPrints, combine
from .opinfo import short_dtype
from .segments import _weights, segment_float_pairs, segment_odd_sums, segment_pairs, wrapped
from .torch_compat import EXACT_MATMULS, flatten_dense
from ..values import decode_values  # noqa: F401 - the codec's other half, importable from here

# The dtypes reduced by their own kernels; every other one through a view of its memory (see `_plan`)
_FLOAT_KINDS = frozenset({torch.float32, torch.float64, torch.bfloat16, torch.float16})
_INT_KINDS = frozenset({torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64})
# Integer dtypes by element size: bit patterns of dtypes without arithmetic (or numpy) support
_SAME_SIZE_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# dtype -> (kind: "f" float, "i" integer or bit pattern, "" not fingerprinted; view to reduce or None)
_plans: dict[torch.dtype, tuple[str, Callable[[torch.Tensor], torch.Tensor] | None]] = {}


def _as_real(t: torch.Tensor) -> torch.Tensor:
    """A complex tensor as floats (..., 2); a lazily conjugated one is resolved first (a copy)."""
    return torch.view_as_real(t.resolve_conj())


def _plan(t: torch.Tensor) -> tuple[str, Callable[[torch.Tensor], torch.Tensor] | None]:
    """How tensors of `t`'s dtype are fingerprinted: (kind, the view of them to reduce or None for
    themselves), see the module docstring. It depends on the dtype only, and is cached per dtype."""
    dtype = t.dtype
    if dtype in _FLOAT_KINDS:
        plan = ("f", None)
    elif dtype in _INT_KINDS:
        plan = ("i", None)
    elif t.is_quantized:
        plan = ("", None)
    elif dtype.is_complex:
        plan = ("f", _as_real)
    else:  # float8 & co., uint16/32/64, bits and sub-byte dtypes: their bit patterns as integers
        bits = _SAME_SIZE_INTS.get(t.element_size())
        plan = ("i", methodcaller("view", bits)) if bits is not None else ("", None)
    _plans[dtype] = plan
    return plan


def _local(t: torch.Tensor) -> torch.Tensor | None:
    """The plain tensor to reduce: a DTensor's local shard (reducing the DTensor itself would run a
    collective, and `.tolist()` refuses subclasses); an in-flight collective's result once it arrived
    (AsyncCollectiveTensor); for another wrapper subclass, the plain tensor of its shape it wraps (its
    `__tensor_flatten__` attributes, else its own: a float8 tensor's data, a simulated-precision wrapper's `elem`),
    else the only one of its dtype (a jagged nested tensor's packed `_values`);
    a subclass that holds its own data (`_make_subclass`) as it is; else None (not measured)."""
    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter:
        return t
    local = getattr(t, "_local_tensor", None)  # DTensor (also as a Parameter)
    if isinstance(local, torch.Tensor):
        return local
    wait = getattr(t, "trigger_wait", None)  # AsyncCollectiveTensor: wait for the collective's values
    if callable(wait) and hasattr(t, "elem"):
        waited = wait()
        return waited if type(waited) is torch.Tensor else None
    if _storage_of(t)[0] is not None and not hasattr(t, "__tensor_flatten__"):
        return t  # (its own data: reductions run on it as on a plain tensor)
    return wrapped_tensor(t)


def wrapped_tensor(t: torch.Tensor) -> torch.Tensor | None:
    """The plain tensor a wrapper subclass holds (its `__tensor_flatten__` attributes, else its own): the one of its
    shape, else the only one of its dtype; None where there is none. No tensor work (nothing waits)."""
    try:
        flatten = getattr(t, "__tensor_flatten__", None)
        names = flatten()[0] if callable(flatten) else list(vars(t))
        inner = [getattr(t, name, None) for name in names]
    except Exception:  # noqa: BLE001 - a subclass's own protocol failing: not measured
        return None
    plain = [x for x in inner if type(x) is torch.Tensor]
    # the one of its shape; else (a jagged nested tensor's `_values`, packed rows of its ragged shape) the one of its
    # dtype, where only one is
    same = next((x for x in plain if x.shape == t.shape), None)
    if same is not None:
        return same
    of_dtype = [x for x in plain if x.dtype == t.dtype]
    return of_dtype[0] if len(of_dtype) == 1 else None


# Float dtypes whose row sums keep float32 precision: one weighted pass gives both numbers of the pair.
_EXACT_ROW_DTYPES = frozenset({torch.float32, torch.float64})


def in_memory_order(t: torch.Tensor) -> torch.Tensor:
    """`t`, or where it is not contiguous but dense (a transposed attention output) a view of it whose dimensions are
    permuted to its memory order, which is contiguous: its memory read as it lies, without a copy. The same layout
    gives the same view, so forward and recompute read alike. A tensor that is not dense comes back as it is."""
    dim = t.dim()
    if dim > 1 and not t.is_contiguous():
        strides = t.stride()
        dense = t.permute(sorted(range(dim), key=lambda d: -strides[d]))
        if dense.is_contiguous():
            return dense
    return t


def _rows(t: torch.Tensor) -> torch.Tensor:
    """`t` as a matrix of rows of its last dimension, its values in their logical order: a view where `t` is
    contiguous, else a copy. Never its memory as it lies: a tensor whose layout alone changed between the passes
    (weights converted to channels_last before the backward, values untouched) must keep its fingerprint. A vector
    is one column (so its pair is its plain sum and its weighted sum, not one number twice)."""
    dim = t.dim()
    if dim == 2 and t.is_contiguous():
        return t  # its own row view: reshaping would only add a dispatch
    return t.reshape(-1, t.shape[-1]) if dim > 1 else t.reshape(-1, 1)


# (device, dtype, rows, columns) -> the weights a float matrix's fingerprint needs (`_weights_of_matrix`)
_matrix_weights: dict[tuple, tuple] = {}


def _weights_of_matrix(device: torch.device, dtype: torch.dtype, rows: int, cols: int) -> tuple:
    """The weights of a (rows, cols) float matrix's fingerprint, looked up once per fingerprint:

    * columns wc (cols,): `mv(M, wc)` is every row's weighted sum, the one pass over the data;
    * the (2, rows) matrix [ones; wr]: `mv` of it and those row sums is the pair (sum_ij wc[j] M[i, j],
      sum_ij wr[i] wc[j] M[i, j]), which changes when values move between positions (rows routed
      elsewhere) or shift by a zero-sum amount (a load-balancing bias update), unlike (sum, abs-sum);
    * odd int32 row weights for `_bit_rows_sum`;
    * wr alone (rows,), for the half-precision dtypes whose row sums are rounded to their own precision
      (their plain sum is taken in float32 instead)."""
    if len(_matrix_weights) > 4096:  # many distinct shapes (data-dependent): start over
        _matrix_weights.clear()
    w = _matrix_weights[(device, dtype, rows, cols)] = (
        _weights(device, dtype, cols), _weights(device, dtype, rows, "rows"), _weights(device, torch.int32, rows, "odd"),
        _weights(device, dtype, rows))
    return w


# Integer views of the float dtypes' bit patterns, by element size (8-byte floats as pairs of int32)
_BIT_VIEWS = {2: torch.int16, 4: torch.int32, 8: torch.int32}


def _mv(m: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """`torch.mv(m, v)` in full float32 precision on a CPU whatever precision the script set (a CPU with bf16 units
    runs float32 matmuls in bfloat16 under "medium": a precision set between a forward and its recompute would change
    the fingerprints of values that did not change)."""
    if m.is_cuda:  # (a GPU's float32 matrix-vector products use no reduced-precision units)
        return torch.mv(m, v)
    with EXACT_MATMULS:
        return torch.mv(m, v)


def _bit_rows(m: torch.Tensor) -> torch.Tensor:
    """sum_j bits(M[i, j]) per row i, in wrap-around int32 arithmetic (one kernel, exact in any order)."""
    try:
        bits = m.view(_BIT_VIEWS[m.element_size()])
    except RuntimeError:  # 8-byte floats whose rows are not contiguous cannot be viewed as pairs of int32
        bits = m.contiguous().view(torch.int32)
    return bits.sum(-1, dtype=torch.int32)


def _bit_rows_sum(m: torch.Tensor, odd: torch.Tensor) -> torch.Tensor:
    """sum_i wo[i] * (sum_j bits(M[i, j])) in wrap-around int32 arithmetic, wo odd: a 0-d int32 tensor that
    changes whenever one element's bit pattern does (infinities and NaN included), exact in any order. (Tensors
    reduced on their own get the same number from their `_bit_rows`, all of a pass's in one `segment_pairs`.)"""
    return torch.dot(_bit_rows(m), odd)


def _storage_of(t: torch.Tensor) -> tuple[int | None, int]:
    """(address, bytes) of `t`'s storage, which changes when something frees or resizes it (FSDP's reshard, outside
    torch's dispatch); (None, 0) for a tensor without one (sparse, a wrapper subclass)."""
    try:
        storage = t.untyped_storage()
        return storage.data_ptr(), storage.nbytes()  # (a wrapper subclass has a storage whose data_ptr raises)
    except (RuntimeError, NotImplementedError, TypeError):
        return None, 0


def to_host(t: torch.Tensor) -> torch.Tensor:
    """The one place ac-diff copies recorded values from a device to the host (a sync on a GPU)."""
    return t if t.device.type == "cpu" else t.cpu()


def to_host_later(t: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """The one place ac-diff copies device values to the host without waiting (watch mode): into pinned memory, on the
    current stream, with the event that says when they have landed (`event.query()`: no sync). A CPU tensor is its
    own host copy, event None."""
    if t.device.type == "cpu":
        return t, None
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)  # (queued on the current stream of t's device, cuda:1 on LOCAL_RANK 1)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(t.device))
    return host, event


class StreamFence:
    """The CUDA streams that queued work, per device, and making a reader wait for all of them.

    Bookkeeping only: streams are any objects with `wait_stream` (torch.cuda.Stream), so that it is
    tested without a GPU. `FingerprintBatch` notes a tensor's stream when it queues work on it, and
    collects after `wait`, on the stream then current."""

    def __init__(self) -> None:
        self._queued: dict[Any, dict[Any, None]] = {}  # device -> its streams that queued work (ordered)

    def note(self, device: Any, stream: Any) -> None:
        """Work for `device` was queued on `stream`."""
        streams = self._queued.get(device)
        if streams is None:
            streams = self._queued[device] = {}
        streams[stream] = None

    def wait(self, reader_of: Callable[[Any], Any]) -> None:
        """Make each device's reading stream, `reader_of(device)`, wait for every other stream that queued
        work on that device (a device-side wait: no host sync). Nothing noted, nothing called."""
        for device, streams in self._queued.items():
            reader = reader_of(device)
            for stream in streams:
                if stream != reader:
                    reader.wait_stream(stream)


current_stream_raw = getattr(torch._C, "_cuda_getCurrentStream", None)  # device index -> (stream id, index, type):
# the CUDA stream current on a device as a cheap C call (per held tensor), made a Stream only when waited for


def wait_for_raw(streams: set[tuple]) -> bool:
    """The current stream of each device waits for the `streams` noted there (raw, `current_stream_raw`; a
    device-side wait); True if one of them is not the current stream (tensors made there and read on it must be
    kept for it: `record_stream`)."""
    if not streams:
        return False
    fence, foreign = StreamFence(), False
    for stream_id, index, kind in streams:
        stream = torch.cuda.Stream(stream_id=stream_id, device_index=index, device_type=kind)
        fence.note(index, stream)
        foreign = foreign or stream != torch.cuda.current_stream(index)
    fence.wait(torch.cuda.current_stream)
    return foreign


# CPU tensors are fingerprinted together (`FingerprintBatch.flush`): small ones are copied to a staging buffer when
# added (one kernel; float tensors of one dtype and row length then share one row reduction, integer tensors one exact
# cumulative sum); a larger float tensor gets its row reduction when added, a larger integer tensor its own reductions.
SMALL = 16 << 10  # (watch mode's too: a saved CPU tensor larger than this is reduced when it is saved)
HOLD = 64  # tensors per flush (watch mode's too)
BATCH_CPU = True  # False: CPU tensors are reduced one by one, as CUDA tensors are (the tests run that path this way)
HOLD_BYTES = 64 << 20  # ... or fewer, once the larger ones among them (kept for their bit sums) hold this much memory
_layout_weights: dict[tuple, torch.Tensor] = {}  # a flush's rows per tensor -> `_flush_weights`


def _flush_weights(lengths: tuple[int, ...]) -> torch.Tensor:
    """(n, 2) float64 [1, wr_i] per row i of each tensor of a flush (`lengths` rows each), made once per layout: what
    turns weighted row sums into the pair (`_weights_of_matrix`)."""
    w = _layout_weights.get(lengths)
    if w is None:
        if len(_layout_weights) > 256:  # data-dependent shapes: many layouts; start over
            _layout_weights.clear()
        pieces = [_weights(_CPU, torch.float64, n, "rows").t() for n in lengths]
        w = _layout_weights[lengths] = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
    return w


_CPU = torch.device("cpu")
_NO_ROWS = torch.zeros(0, dtype=torch.int32)


def _fused(t: torch.Tensor) -> FusedPrints | None:
    """The fused kernels that fingerprint `t` among others (a CUDA tensor, where they compiled), else None."""
    return FusedPrints.get() if t.is_cuda else None


class FingerprintBatch:
    """Deferred fingerprints of many tensors, collected with one sync per device and kind.

    CPU (`add`, see the module docstring): small tensors staged (copied) when added, large float ones reduced to
    weighted row sums when added, borrowed ones (parameters, inputs) read at the flush; HOLD of them fingerprinted
    together (`flush`). The recorder flushes before any op that writes a waiting tensor in place (`holding`,
    `holds_memory_of`). CUDA: held as well, HOLD of them fingerprinted by one launch of the fused kernels per dtype
    (`_launch_fused`); without those kernels, each reduced on its own, on its stream (a GPU's segmented sums may order
    a segment's sum by its alignment, and the float pair must be bit-identical)."""

    def __init__(self, *, bits: bool = False) -> None:
        self.bits = bits  # every float fingerprint ends with its exact bit sum, finite or not (gradients: grads.py)
        # (kind, device) -> [pairs: (2,) tensors, firsts: 0-d tensors, seconds: 0-d tensors,
        #                   bits: int32 row sums of the bit patterns (floats only, see `_bit_rows_sum`)]
        self._buckets: dict[tuple[str, torch.device], tuple[list[torch.Tensor], list[torch.Tensor],
                                                             list[torch.Tensor], list[torch.Tensor]]] = {}
        # per slot: (bucket, is a pair, index, index of its bit sum or -1); ("done", fingerprint, is a float's): read
        # at its flush (CPU) or made without a kernel (an empty tensor); None while held
        self._slots: list[tuple | None] = []
        # CPU (BATCH_CPU), until the next flush: small tensors copied to a staging buffer per (dtype, row length; 0:
        # integers, flat): [buffer, elements used, [(slot, rows or elements)]]; large float tensors, (slot, their
        # weighted row sums, the tensor, its storage's address and size)
        self._staged: dict[tuple, list] = {}
        self._large: list[tuple[int, torch.Tensor, torch.Tensor, int | None, int]] = []
        self._borrowed: list[tuple[int, torch.Tensor, str, int | None, int]] = []  # small borrowed tensors: (slot,
        # the tensor, kind, its storage's address and size)
        # (device, dtype) -> tensors held for the fused kernels (CUDA): [(slot, their memory as (rows, cols) or flat,
        # its storage's address and size)], and the streams they were made on (raw: `current_stream_raw`)
        self._fused_held: dict[tuple, list[tuple[int, torch.Tensor, int | None, int]]] = {}
        self._fused_streams: set[tuple] = set()
        self._fused_out: list[tuple[list[int], torch.Tensor, torch.Tensor | None]] = []  # (slots, sums, bits) launched
        self._prints: FusedPrints | None = None
        self._large_bytes = 0
        self._pending = 0  # tensors staged, large or held for the fused kernels since the last flush
        self._addresses: set[int | None] = set()  # the large and borrowed ones' storages (`holds_memory_of`)
        self._kept: list[torch.Tensor] = []
        self._streams = StreamFence()
        self.finite = True  # after collect(): no fingerprint is NaN or infinite
        self.subclasses: set[type] = set()  # the tensor subclasses added (their Python code runs each op they see)

    @property
    def holding(self) -> bool:
        """Borrowed tensors and large ones (for their bit sums) wait for their flush: an op about to write one of them in
        place must `flush` first."""
        return bool(self._large or self._borrowed or self._fused_held)

    def holds_memory_of(self, t: torch.Tensor) -> bool:
        """A tensor waiting for its flush shares `t`'s memory (its storage): writing `t` may change it. True where that
        cannot be told (a wrapper subclass, a sparse tensor: no storage of their own)."""
        address = _storage_of(t)[0]
        return address is None or address in self._addresses

    def add(self, t: torch.Tensor, borrowed: bool = False) -> int | None:
        """Queue a fingerprint of `t`; returns its slot, or None for tensors that cannot be reduced. `borrowed`: a
        tensor the pass did not make (a parameter, an input), which its code does not write behind torch's back: a
        small one is read at the flush, not copied now."""
        if type(t) is not torch.Tensor:
            if type(t) is not torch.nn.Parameter:
                self.subclasses.add(type(t))
            t = _local(t)
            if t is None:
                return None
        plan = _plans.get(t.dtype)
        if plan is None:
            plan = _plan(t)
        kind, view = plan
        # quantized dtypes have kind ""; sparse and other layouts are not strided
        if not kind or t.layout is not torch.strided or t.is_meta:
            return None
        if view is not None:
            t = view(t)
        slots = self._slots
        if t.is_cpu and BATCH_CPU:
            numel = t.numel()
            if not numel:
                slots.append(("done", [0.0, 0.0] if kind == "f" else [0, 0], False))
                return len(slots) - 1
            nbytes = numel * t.element_size()
            if nbytes <= SMALL:
                slots.append(None)
                if borrowed:
                    address, size = _storage_of(t)
                    self._borrowed.append((len(slots) - 1, t.data, kind, address, size))
                    self._addresses.add(address)
                else:
                    self._stage(len(slots) - 1, t, kind, numel)
            elif kind == "f":
                m = _rows(t)
                rows_, cols = m.shape
                weights = _matrix_weights.get((_CPU, m.dtype, rows_, cols))
                if weights is None:
                    weights = _weights_of_matrix(_CPU, m.dtype, rows_, cols)
                slots.append(None)
                address, size = _storage_of(m)
                # its weighted row sums now; the tensor itself (`.data`: an alias no dispatch mode sees) only for the
                # exact bit sum, wanted where its pair is not finite
                self._large.append((len(slots) - 1, _mv(m, weights[0]), m.data, address, size))
                self._addresses.add(address)
                self._large_bytes += nbytes
            else:
                return self._add_alone(t, kind)
            self._one_more_pending()
            return len(slots) - 1
        prints = _fused(t)
        if prints is not None and FusedPrints.takes(t.dtype) and 0 < t.numel() < MAX_ELEMENTS:
            # its values in their logical order, as `_rows`: a copy where it is not contiguous (a channels_last or
            # expanded tensor), the copy a reduction of its own would make
            self._prints = prints
            return self._hold_fused(t if t.is_contiguous() else t.contiguous(), kind)
        return self._add_alone(t, kind)

    def _hold_fused(self, m: torch.Tensor, kind: str) -> int:
        """Hold a contiguous tensor for the fused kernels' launch at the flush; its slot."""
        slots = self._slots
        slots.append(None)
        # (`.data`: an alias of its memory that keeps the tensor itself, which the recorder follows by weak
        # reference, from outliving its pass)
        m = m.data.view(-1, m.shape[-1] if kind == "f" and m.dim() > 1 else 1)  # (`_rows`)
        address, size = _storage_of(m)
        if m.is_cuda:
            self._fused_streams.add(current_stream_raw(m.get_device()))
        self._fused_held.setdefault((m.device, m.dtype), []).append((len(slots) - 1, m, address, size))
        self._addresses.add(address)
        self._large_bytes += m.numel() * m.element_size()
        self._one_more_pending()
        return len(slots) - 1

    def _one_more_pending(self) -> None:
        """A tensor waits for the flush: flush when HOLD of them wait, or HOLD_BYTES of the held ones."""
        self._pending += 1
        if self._pending >= HOLD or self._large_bytes > HOLD_BYTES:
            self.flush()

    def _stage(self, slot: int, t: torch.Tensor, kind: str, numel: int) -> None:
        """Copy a small tensor into its staging buffer (one per dtype and row length, integers flat): one kernel, and
        later writes to the tensor, through torch or not (numpy, `.data`), cannot reach its fingerprint."""
        if kind == "f":
            m = _rows(t)
            key = (m.dtype, m.shape[1])
        else:
            m, key = t, (t.dtype, 0)
        stage = self._staged.get(key)
        if stage is None:
            stage = self._staged[key] = [torch.empty(HOLD * SMALL // t.element_size(), dtype=t.dtype), 0, []]
        buffer, used, members = stage
        buffer[used:used + numel].view(m.shape).copy_(m)
        members.append((slot, m.shape[0] if kind == "f" else numel))
        stage[1] = used + numel

    def _add_alone(self, t: torch.Tensor, kind: str) -> int:
        """Queue the reductions of one tensor (on its device and stream) into its bucket; returns its slot."""
        dtype = t.dtype
        key = (kind, t.device)
        if t.is_cuda:
            self._note_stream(key[1])
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = ([], [], [], [])
        bit = -1
        if kind == "f" and t.numel():
            m = _rows(t)
            rows_, cols = m.shape
            weights = _matrix_weights.get((key[1], dtype, rows_, cols))
            if weights is None:
                weights = _weights_of_matrix(key[1], dtype, rows_, cols)
            columns, row_pair, odd, row_weights = weights
            bits = bucket[3]
            bits.append(_bit_rows(m))  # (their odd-weighted sums: all of them at once, in `launch`)
            bit = len(bits) - 1
            if dtype in _EXACT_ROW_DTYPES:  # the pair in two kernels (see `_weights_of_matrix`)
                pairs = bucket[0]
                pairs.append(_mv(row_pair, _mv(m, columns)))
                self._slots.append((key, True, len(pairs) - 1, bit))
                return len(self._slots) - 1
            # half precision: the plain sum in float32; the bilinear sum from the row sums, as float32
            first = t.sum(dtype=torch.float32)
            second = torch.dot(_mv(m, columns), row_weights)
            if second.dtype is not torch.float32:
                second = second.float()
        elif kind == "f":
            first = second = t.sum(dtype=torch.float32)
        else:
            flat = t.reshape(-1)
            first = flat.sum(dtype=torch.int64)
            w = _weights(key[1], torch.int64, flat.numel(), "int")
            # the same int64 number either way; dot (CPU only for integers) dispatches one op, not two
            second = torch.dot(flat, w) if flat.dtype is torch.int64 and flat.is_cpu \
                else (flat * w).sum(dtype=torch.int64)
        bucket[1].append(first)
        bucket[2].append(second)
        self._slots.append((key, False, len(bucket[1]) - 1, bit))
        return len(self._slots) - 1

    def flush(self) -> None:
        """Fingerprint the staged and the large tensors together (see the class docstring)."""
        if not self._pending:
            return
        large, staged = self._large, [(key, buffer[:used], members) for key, (buffer, used, members)
                                       in self._staged.items() if members]
        borrowed, fused = self._borrowed, self._fused_held
        self._large, self._borrowed, self._fused_held, self._large_bytes, self._pending = [], [], {}, 0, 0
        self._addresses.clear()
        if fused:
            self._launch_fused(fused)
        with torch.no_grad():  # (a pass's end: outputs require grad by then; no graph, nothing saved)
            self._flush(large, staged + _grouped_borrowed(borrowed))
        for stage in self._staged.values():  # (read: the buffers take the next ones)
            stage[1], stage[2] = 0, []

    def _launch_fused(self, groups: dict[tuple, list]) -> None:
        """ONE launch of the fused kernels per (device, dtype) for the tensors held for them, on the current stream,
        after the streams they were made on. One whose storage was freed or resized since (FSDP's reshard) gets no
        fingerprint; where one was made on another stream, all are kept for this stream's read (`record_stream`)."""
        foreign = wait_for_raw(self._fused_streams)
        self._fused_streams = set()
        for (device, dtype), held in groups.items():
            live = [(slot, m) for slot, m, address, size in held if _storage_of(m) == (address, size)]
            if not live:
                continue
            if foreign:
                current = torch.cuda.current_stream(device)
                for _, m in live:
                    m.record_stream(current)
            sums, bits = self._prints.launch(device, dtype, [(m.data_ptr(), *m.shape) for _, m in live])
            if device.type == "cuda":
                self._note_stream(device)  # (the read-back waits for the stream the kernel ran on)
            self._fused_out.append(([slot for slot, _ in live], sums, bits))

    def _flush(self, large: list, staged: list) -> None:
        row_sums: list[torch.Tensor] = []  # per large tensor and per staged dtype and row length: weighted row sums
        counts: list[int] = []  # rows per tensor, in order
        order: list[tuple[int, torch.Tensor | None]] = []  # (slot, its rows for the bit sum, None: freed since)
        # `bits`: every tensor's bit rows (`_bit_rows`), a staged buffer's in one kernel, totalled at once below
        bit_rows: list[torch.Tensor] | None = [] if self.bits else None
        for slot, rs, m, address, size in large:
            row_sums.append(rs)
            counts.append(m.shape[0])
            # (a storage freed or resized outside dispatch since, as FSDP's reshard does: no bit sum to take)
            live = _storage_of(m) == (address, size)
            order.append((slot, m if live else None))
            if bit_rows is not None:
                bit_rows.append(_bit_rows(m) if live else _NO_ROWS)
        ints: list[torch.Tensor] = []
        int_members: list[tuple[int, int]] = []
        for (dtype, cols), flat, members in staged:
            if not cols:
                ints.append(flat)
                int_members.extend(members)
                continue
            matrix = flat.view(-1, cols)
            wc = _weights(_CPU, torch.float64 if dtype is torch.float64 else torch.float32, cols)
            row_sums.append((matrix * wc).sum(-1))  # (each row's sum on its own: the same whatever its neighbours)
            at = 0
            rows_bits = _bit_rows(matrix) if bit_rows is not None else None
            for slot, rows_ in members:
                counts.append(rows_)
                order.append((slot, matrix[at:at + rows_]))
                if rows_bits is not None:
                    bit_rows.append(rows_bits[at:at + rows_])
                at += rows_
        # the integers' pairs and the floats' bit sums (`_bit_rows_sum` of each, wrapped as its int32 dot) read together
        exact = [segment_pairs(ints, tuple(n for _, n in int_members)).reshape(-1)] if ints else []
        if row_sums and bit_rows is not None:
            exact.append(segment_odd_sums(bit_rows, tuple(r.numel() for r in bit_rows)))
        exact_values = (torch.cat(exact) if len(exact) > 1 else exact[0]).tolist() if exact else []
        if row_sums:
            flat = torch.cat(row_sums) if len(row_sums) > 1 else row_sums[0]
            lengths = tuple(counts)
            bit_sums = exact_values[2 * len(int_members):] if bit_rows is not None else None
            for k, ((slot, m), fp) in enumerate(
                    zip(order, segment_float_pairs(flat, _flush_weights(lengths), lengths).tolist())):
                if bit_sums is not None:
                    if m is not None:
                        fp.append(wrapped(bit_sums[k], 32))
                elif not (isfinite(fp[0]) and isfinite(fp[1])) and m is not None:  # (CPU: no wait)
                    fp.append(int(_bit_rows_sum(m, _weights(_CPU, torch.int32, m.shape[0], "odd"))))
                self._slots[slot] = ("done", fp, True)
        for k, (slot, _) in enumerate(int_members):
            self._slots[slot] = ("done", exact_values[2 * k:2 * k + 2], False)

    def keep(self, t: torch.Tensor) -> int:
        """Keep a small tensor's values (a contiguous copy on its device) to read back at collect time."""
        local = _local(t)
        if local is not None and local.is_cuda:
            self._note_stream(local.device)
        self._kept.append(local.detach().clone(memory_format=torch.contiguous_format) if local is not None
                          else torch.zeros(0))
        return len(self._kept) - 1

    def _note_stream(self, device: torch.device) -> None:
        """Note the stream now current on a CUDA device: the work just queued for it runs there."""
        self._streams.note(device, torch.cuda.current_stream(device))

    def collect(self) -> tuple[list[list[float] | None], list[dict[str, Any]]]:
        """Read everything back now: (fingerprint per slot, kept values encoded by `encode_values`); one `to_host`
        (a sync on a GPU) per device."""
        return self.launch(later=False).collect()

    def launch(self, later: bool = True) -> "Collection":
        """Queue the read-back: per device ONE byte buffer of every fingerprint and kept value, copied to pinned memory
        without waiting (`to_host_later`; `later=False`: `to_host`, read at once). `Collection.ready()` says when
        `collect()` no longer waits."""
        self.flush()
        self._streams.wait(torch.cuda.current_stream)
        on_device = []
        for pairs, firsts, seconds, bits in self._buckets.values():
            parts = [torch.stack(pairs)] if pairs else []
            if firsts:
                parts.append(torch.stack((torch.stack(firsts), torch.stack(seconds)), dim=1))
            both = torch.cat(parts) if len(parts) > 1 else parts[0]
            if bits:  # float pairs and int32 bit sums travel together as float64 (exact for both)
                sums = segment_pairs(bits, tuple(b.numel() for b in bits))[:, 1].to(torch.int32)  # (wraps as int32)
                both = torch.cat((both.double().reshape(-1), sums.double()))
            on_device.append(both)
        fused_out, self._fused_out = self._fused_out, []
        fused = [t for _, sums, bits in fused_out for t in (sums, bits) if t is not None]
        kept = _grouped(self._kept)
        packed = _Packed(on_device + fused + [flat for flat, _ in kept], later)
        return Collection(self, packed, len(on_device), fused_out, [idx for _, idx in kept])

    def _decode(self, hosts: list[torch.Tensor], n_buckets: int, fused_out: list, kept_idx: list[list[int]]
                ) -> tuple[list[list[float] | None], list[dict[str, Any]]]:
        read = {}
        for (key, (pairs, firsts, _, bits)), host in zip(self._buckets.items(), hosts):
            n = len(pairs) + len(firsts)
            values = host[:2 * n].reshape(n, 2) if bits else host
            if key[0] == "f" and self.finite and not bool(torch.isfinite(values).all()):
                self.finite = False
            read[key] = (values.tolist(), [int(b) for b in host[2 * n:].tolist()] if bits else [])
        at = n_buckets
        for slots, _, bits in fused_out:
            for slot, fp in zip(slots, combine(hosts[at], hosts[at + 1] if bits is not None else None)):
                self._slots[slot] = ("done", fp if bits is None or self.bits or not all(map(isfinite, fp[:2]))
                                     else fp[:2], bits is not None)
            at += 1 if bits is None else 2
        out: list[list[float] | None] = []
        for entry in self._slots:
            if entry is None:
                out.append(None)
            elif entry[0] == "done":
                fp = entry[1]
                if entry[2] and self.finite and not (isfinite(fp[0]) and isfinite(fp[1])):
                    self.finite = False
                out.append(list(fp))
            else:
                key, is_pair, i, bit = entry
                values, bit_sums = read[key]
                fp = values[i if is_pair else len(self._buckets[key][0]) + i]
                if bit >= 0 and (self.bits or not all(map(isfinite, fp))):
                    fp = fp + [bit_sums[bit]]
                out.append(fp)
        return out, _encode_kept(self._kept, list(zip(hosts[at:], kept_idx)))

    def __len__(self) -> int:
        return len(self._slots)


def _grouped_borrowed(borrowed: list) -> list[tuple[tuple, torch.Tensor, list]]:
    """Small borrowed tensors as staged ones are: per (dtype, row length; 0 for integers), their values in one flat
    copy (integers: one tensor each, the cumulative sum concatenates them) and [(slot, rows or elements)]. One whose
    storage was freed or resized since it was added (FSDP's reshard, outside torch's dispatch) is left out: no
    fingerprint."""
    groups: dict[tuple, tuple[list, list]] = {}
    out = []
    for slot, t, kind, address, size in borrowed:
        if _storage_of(t) != (address, size):
            continue
        if kind != "f":
            out.append(((t.dtype, 0), t.reshape(-1), [(slot, t.numel())]))
            continue
        m = _rows(t)
        tensors, members = groups.setdefault((m.dtype, m.shape[1]), ([], []))
        tensors.append(m)
        members.append((slot, m.shape[0]))
    return out + [(key, flatten_dense(tensors), members) for key, (tensors, members) in groups.items()]


def _encode_kept(kept: list[torch.Tensor], read: list[tuple[torch.Tensor, list[int]]]) -> list[dict[str, Any]]:
    """Encode kept tensors from their host copies: [(the flat copy of one (device, dtype) group, its indices)]."""
    out: list[dict[str, Any] | None] = [None] * len(kept)
    for flat, idx in read:
        array = _as_numpy(flat)
        name = short_dtype(flat.dtype)
        start = 0
        for i in idx:
            n = kept[i].numel()
            out[i] = _encode_array(array[start:start + n], name, list(kept[i].shape))
            start += n
    return out  # type: ignore[return-value]


def _grouped(tensors: list[torch.Tensor]) -> list[tuple[torch.Tensor, list[int]]]:
    """[(the tensors of one (device, dtype) flattened into one, on their device; their indices)]."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    out = []
    for idx in groups.values():
        parts = [tensors[i].reshape(-1) for i in idx]
        out.append((torch.cat(parts) if len(parts) > 1 else parts[0], idx))
    return out


class Collection:
    """A FingerprintBatch's read-back on its way (`FingerprintBatch.launch`): `ready()` without waiting, `collect()`
    (fingerprint per slot, kept values), waiting only if it has not landed."""

    def __init__(self, batch: FingerprintBatch, packed: "_Packed", n_buckets: int, fused_out: list,
                 kept_idx: list[list[int]]) -> None:
        self._batch, self._packed, self._n, self._fused, self._kept_idx = batch, packed, n_buckets, fused_out, kept_idx

    def ready(self) -> bool:
        return self._packed.ready()

    def collect(self) -> tuple[list[list[float] | None], list[dict[str, Any]]]:
        return self._batch._decode(self._packed.hosts(), self._n, self._fused, self._kept_idx)


class _Packed:
    """Tensors of any dtypes and shapes, those of one device copied to the host as ONE byte buffer (`to_host`, one sync
    per device; `later`: `to_host_later`, no sync), then split and viewed as their dtypes again (`hosts()`). Each part
    starts 8-byte aligned (a view as float64 needs it). On CPU the same packing runs, so the read-count tests on CPU
    test the GPU path."""

    def __init__(self, tensors: list[torch.Tensor], later: bool = False) -> None:
        self._tensors = [(t.dtype, t.shape) for t in tensors]
        self._devices: list[tuple[list[int], list[tuple[int, int]], torch.Tensor, Any]] = []
        by_device: dict[torch.device, list[int]] = {}
        for i, t in enumerate(tensors):
            by_device.setdefault(t.device, []).append(i)
        for device, idx in by_device.items():
            parts, spans, at = [], [], 0
            for i in idx:
                raw = tensors[i].contiguous().reshape(-1).view(torch.uint8)
                pad = -raw.numel() % 8
                parts += [raw, torch.zeros(pad, dtype=torch.uint8, device=device)] if pad else [raw]
                spans.append((at, raw.numel()))
                at += raw.numel() + pad
            buffer = torch.cat(parts) if len(parts) > 1 else parts[0]
            host, event = to_host_later(buffer) if later else (to_host(buffer), None)
            self._devices.append((idx, spans, host, event))

    def ready(self) -> bool:
        return all(event is None or event.query() for *_, event in self._devices)

    def hosts(self) -> list[torch.Tensor]:
        out: list[torch.Tensor | None] = [None] * len(self._tensors)
        for idx, spans, host, event in self._devices:
            if event is not None:
                event.synchronize()
            for i, (start, n) in zip(idx, spans):
                dtype, shape = self._tensors[i]
                out[i] = host[start:start + n].view(dtype).view(shape)
        return out  # type: ignore[return-value]


def _packed_to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Host copies of tensors of any dtypes and shapes: one `to_host` per device (`_Packed`)."""
    return _Packed(tensors).hosts()


def host_copies(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Host tensors holding the values of `tensors` (same shapes), read back with one copy per (device, dtype):

        host_copies([cuda_a, cuda_b, cpu_c])  ->  [a, b, c] on the host; a and b share one storage

    Never a view of a CPU input's own memory (so keeping them never keeps a larger tensor alive)."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    groups = _grouped(tensors)
    for (_, idx), flat in zip(groups, _packed_to_host([g for g, _ in groups])):
        if len(idx) == 1 and flat.device.type == "cpu" and flat.untyped_storage().data_ptr() == \
                tensors[idx[0]].untyped_storage().data_ptr():
            flat = flat.clone()  # one CPU part: to_host gave its own memory back
        start = 0
        for i in idx:
            n = tensors[i].numel()
            out[i] = flat[start:start + n].view(tensors[i].shape)
            start += n
    return out  # type: ignore[return-value]


# Integers are stored in the narrowest of these that holds them (indices, counts: mostly int16).
_NARROW = (("i8", "int8", -2**7, 2**7 - 1), ("i16", "int16", -2**15, 2**15 - 1), ("i32", "int32", -2**31, 2**31 - 1))
_WIDE_INTS = frozenset({"i16", "i32", "i64"})


def _as_numpy(flat: torch.Tensor) -> Any:
    """A 1-D host tensor as a numpy array of the same bytes (bfloat16 & co. as same-size integers)."""
    try:
        return flat.numpy()
    except (TypeError, RuntimeError):  # no numpy dtype (bfloat16, float8): the raw bits will do
        return flat.view(_SAME_SIZE_INTS[flat.element_size()]).numpy()


def _encode_array(a: Any, dtype: str, shape: list) -> dict[str, Any]:
    record: dict[str, Any] = {"dtype": dtype, "shape": shape}
    if dtype in _WIDE_INTS and a.size:
        low, high = int(a.min()), int(a.max())
        for short, np_name, lo, hi in _NARROW:
            if short == dtype:
                break
            if lo <= low and high <= hi:
                a = a.astype(np_name)
                record["as"] = short  # stored narrower; decode_values widens back
                break
    record["b64"] = base64.b64encode(a.tobytes()).decode("ascii")
    return record


def encode_values(t: torch.Tensor) -> dict[str, Any]:
    """A host tensor's values for the trace: dtype, shape and the raw (little-endian) bytes in base64,
    integers in the narrowest type that holds them ("as"). About 4x smaller and 10x faster to write
    than a JSON list of numbers; `decode_values` gives back exactly `t.tolist()`."""
    flat = t.detach().contiguous().reshape(-1)
    return _encode_array(_as_numpy(flat), short_dtype(t.dtype), list(t.shape))

