"""Fingerprints: equal for equal values and layouts, different for the changes AC divergence makes."""

from __future__ import annotations

import contextlib
import os
import sys
import warnings

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint as cp

import ac_diff
from ac_diff.capture import fingerprint, fused_prints
from ac_diff.capture.fingerprint import FingerprintBatch, StreamFence, _rows
from models import record_step


# Under Triton's interpreter (TRITON_INTERPRET=1, set before triton is imported: tests/test_fused_prints.py runs this
# file so), every test here also runs on the fused kernels' path, the one CUDA tensors take where they compiled.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture(autouse=True, params=["batched", "alone", *(["fused"] if INTERPRETED else [])])
def cpu_path(request, monkeypatch):
    """Every test here on each path: CPU tensors held and reduced together; each reduced on its own (the path CUDA
    tensors take without the fused kernels); held for the fused kernels (interpreted: see INTERPRETED)."""
    monkeypatch.setattr(fingerprint, "BATCH_CPU", request.param == "batched")
    if request.param == "fused":
        prints = fused_prints.FusedPrints(fused_prints._kernels())
        monkeypatch.setattr(fingerprint, "_fused", lambda t: prints)
        monkeypatch.setattr(fused_prints, "G", 4)  # (fewer programs to interpret; each still strides over many tiles)
    return request.param


def fp(*tensors: torch.Tensor, bits: bool = False) -> list:
    batch = FingerprintBatch(bits=bits)
    slots = [batch.add(t) for t in tensors]
    values, _ = batch.collect()
    return [values[s] if s is not None else None for s in slots]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_same_values_same_fingerprint_and_changes_show(dtype):
    torch.manual_seed(0)
    a = torch.randn(64, 32).to(dtype)
    zero_sum = a.clone()
    zero_sum[3, :] += 0.5
    zero_sum[40, :] -= 0.5  # the sum is unchanged: (sum, abs-sum) fingerprints missed this
    swapped = a.clone()
    swapped[[5, 6]] = a[[6, 5]]  # a token routed to another slot: same multiset of values
    first, again, moved, permuted = fp(a, a.clone(), zero_sum, swapped)
    assert first == again
    assert moved != first
    assert permuted != first


def test_a_vector_gives_its_sum_and_a_weighted_sum():
    bias = torch.zeros(8)
    updated = bias + torch.tensor([1.0, -1.0, 0, 0, 0, 0, 0, 0])  # a load-balancing update: zero sum
    (s0, w0), (s1, w1) = fp(bias, updated)
    assert s0 == s1 == 0.0
    assert w1 != w0


def test_a_zero_sum_update_at_any_four_positions_shows():
    """A load-balancing bias update +c, -c, -c, +c (an MoE router's expert bias): weights in arithmetic progression,
    or any additive sequence (frac(k * golden ratio)), cancel it wherever i + j = k + l; hashed weights do not."""
    bias = torch.zeros(16)
    updates = []
    for i in range(16):
        for j in range(i + 1, 16):
            for k in range(16):
                l_ = i + j - k
                if k not in (i, j) and k < l_ < 16 and l_ not in (i, j):
                    u = bias.clone()
                    u[[i, j]] += 0.25
                    u[[k, l_]] -= 0.25
                    updates.append(u)
    assert len(updates) > 100
    first, *rest = fp(bias, *updates)
    assert all(r != first for r in rest)


def test_integers_are_exact_and_order_sensitive():
    idx = torch.tensor([[0, 3], [1, 2]])
    (a_sum, a_w), (b_sum, b_w) = fp(idx, idx.flip(-1))
    assert a_sum == b_sum == 6
    assert a_w != b_w


def test_a_tensor_whose_layout_alone_changed_keeps_its_fingerprint():
    """Values are reduced in their logical order, whatever their layout: weights converted to channels_last between
    the forward and the backward (`model.to(memory_format=...)`, values untouched) kept their values, but reduced in
    memory order their fingerprint changed, and ac-diff said SILENTLY DIVERGED over bit-identical gradients."""
    base = torch.randn(2, 8, 16, 4)
    t = base.permute(0, 2, 1, 3)  # an attention output (batch, heads, seq, dim) seen as (batch, seq, ...)
    assert not t.is_contiguous()
    assert fp(t) == fp(t.contiguous())  # its values in order: the layout does not count
    w = torch.randn(8, 8, 3, 3)
    assert fp(w) == fp(w.contiguous(memory_format=torch.channels_last))
    assert fp(w) != fp(w.permute(0, 1, 3, 2).contiguous())  # (other values in order: another fingerprint)
    assert _rows(base).data_ptr() == base.data_ptr()  # a contiguous tensor: no copy
    expanded = torch.randn(4, 1).expand(4, 6)  # not dense: reduced through a copy, still deterministic
    assert fp(expanded) == fp(expanded.contiguous())


def _quantized(dtype: torch.dtype) -> bool:
    with warnings.catch_warnings():  # torch warns that quantized tensors are deprecated
        warnings.simplefilter("ignore")
        return torch.empty(0, dtype=dtype).is_quantized


def _dtypes() -> list[torch.dtype]:
    """Every dtype of the torch that runs the tests (found at run time: float8, uint16, sub-byte, bits
    dtypes come and go with versions), but the quantized ones, which need a quantizer to hold values."""
    found = {v for v in vars(torch).values() if isinstance(v, torch.dtype)}
    return sorted((d for d in found if not _quantized(d)), key=str)


def _sample(dtype: torch.dtype) -> torch.Tensor:
    """An (8, 4) tensor of `dtype`: normal values cast where torch can cast to a float or complex dtype
    (random bits would hold NaN, and NaN != NaN), random bytes otherwise. The first two values are 2 and
    -2 (times 1+1j): half-precision weighted sums are only as fine as their dtype, so the swap of two
    close values may round away, and 2's top byte has an exponent bit to flip."""
    g = torch.Generator().manual_seed(0)
    if dtype.is_floating_point or dtype.is_complex:
        values = torch.randn(8, 4, generator=g, dtype=torch.complex64 if dtype.is_complex else None)
        values.view(-1)[:2] = torch.tensor([2.0, -2.0]) * (1 + 1j if dtype.is_complex else 1)
        try:
            return values.to(dtype)
        except (RuntimeError, NotImplementedError):  # float4_e2m1fn_x2: no casts, only bits
            pass
    high = 2 if dtype is torch.bool else 256
    return torch.randint(0, high, (8, 4 * dtype.itemsize), generator=g, dtype=torch.uint8).view(dtype)


def _edited(t: torch.Tensor, edit) -> torch.Tensor:
    """A copy of `t` made through its bytes, `edit` applied to the (elements, bytes) matrix of the copy
    (the only way to write every dtype: the sub-byte ones have no copy kernels)."""
    data = t.view(torch.uint8).clone()
    edit(data.view(-1, t.element_size()))
    return data.view(t.dtype)


def _flip_one(elements: torch.Tensor) -> None:
    # a bit of the first element's most significant byte: a float's last bits can round away in its sums
    elements[0, -1 if sys.byteorder == "little" else 0] ^= 1


def _swap_two(elements: torch.Tensor, start: int = 1) -> None:
    """Swap the first element with the first one from `start` on that holds other bits."""
    other = next(j for j in range(start, len(elements)) if not torch.equal(elements[j], elements[0]))
    elements[[0, other]] = elements[[other, 0]]


@pytest.mark.parametrize("dtype", _dtypes(), ids=lambda d: str(d).removeprefix("torch."))
def test_every_dtype_is_fingerprinted(dtype):
    t = _sample(dtype)
    first, again, flipped, swapped = fp(t, _edited(t, lambda e: None), _edited(t, _flip_one), _edited(t, _swap_two))
    assert first is not None
    assert again == first and fp(t) == [first]  # the same values give the same fingerprint, batch after batch
    assert flipped != first  # one element's bits changed
    assert swapped != first  # two unequal elements swapped


def test_views_of_other_dtypes_are_taken_whatever_the_layout():
    c = torch.randn(8, 4, dtype=torch.complex64)
    assert fp(c.conj()) == fp(c.conj().resolve_conj()) != fp(c)  # a lazy conjugate is resolved, not refused
    for t in (torch.randn(8, 4).to(torch.float8_e4m3fn), torch.randint(0, 2**16, (8, 4)).to(torch.uint16)):
        assert fp(t.t()) == fp(t.t().contiguous())  # non-contiguous: the same integers


def test_tensors_that_cannot_be_reduced_get_no_slot():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantized = torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)
    sparse = torch.eye(3).to_sparse()
    assert fp(quantized, sparse, torch.empty(2, 2, device="meta")) == [None, None, None]
    assert fp(torch.zeros(0, 3))[0] is not None  # empty: a fingerprint all the same


class _Float8Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).to(torch.float8_e4m3fn).to(torch.float32).relu()  # a float8 round trip


class _Float8Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = _Float8Block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cp.checkpoint(self.block, x, use_reentrant=False)


def test_a_float8_cast_in_a_checkpointed_region_is_recorded_and_compared(tmp_path):
    torch.manual_seed(0)
    _, run = record_step(_Float8Net(), tmp_path / "t.jsonl")
    assert not run.notes  # no recorder warning (the float8 fingerprint used to raise inside the recorder)
    region = run.regions[0]
    for p in (region.forward, region.recompute):
        casts = [o for o in p.ops if o.op == "aten._to_copy.default" and o.out[0].dtype == "f8e4m3fn"]
        assert len(casts) == 1 and casts[0].fingerprint and casts[0].fingerprint[0] is not None, p.phase
    assert ac_diff.diagnose([run]).verdict == "clean"


class _FakeStream:
    """A CUDA stream's `wait_stream`, recorded."""

    def __init__(self) -> None:
        self.waited: list = []

    def wait_stream(self, other) -> None:
        self.waited.append(other)


def test_the_reading_stream_waits_for_every_other_stream_that_queued_work_on_its_device():
    main0, side0, main1, reader0 = _FakeStream(), _FakeStream(), _FakeStream(), _FakeStream()
    fence = StreamFence()
    for device, stream in (("cuda:0", main0), ("cuda:0", side0), ("cuda:0", side0), ("cuda:1", main1)):
        fence.note(device, stream)
    fence.wait({"cuda:0": main0, "cuda:1": main1}.__getitem__)
    assert main0.waited == [side0]  # once, and never on itself
    assert main1.waited == [] and side0.waited == []  # cuda:1 reads on its only stream: nothing to wait for
    fence.wait({"cuda:0": reader0, "cuda:1": main1}.__getitem__)  # a collect on a third stream
    assert reader0.waited == [main0, side0]


def test_nothing_queued_on_a_gpu_asks_for_no_reading_stream():
    StreamFence().wait(lambda device: pytest.fail(f"asked for the reading stream of {device}"))


def test_cpu_tensors_make_no_cuda_call(monkeypatch):
    def no_cuda(*args, **kwargs):
        raise AssertionError("torch.cuda called for CPU tensors")

    for name in ("current_stream", "current_device", "synchronize", "is_available", "stream"):
        monkeypatch.setattr(torch.cuda, name, no_cuda)
    batch = FingerprintBatch()
    tensors = (torch.randn(4, 4), torch.arange(6), torch.randn(3, dtype=torch.complex64),
               torch.randn(4).to(torch.float8_e4m3fn), torch.arange(3).to(torch.uint16))
    slots = [batch.add(t) for t in tensors]
    batch.keep(torch.arange(3))
    values, kept = batch.collect()
    assert all(values[s] is not None for s in slots) and len(kept) == 1


def _assorted(g: torch.Generator) -> list[torch.Tensor]:
    """Tensors of every kind a flush mixes: small and large, several row lengths and dtypes, transposed, integers."""
    return [torch.randn(4, 8, generator=g), torch.randn(3, 8, generator=g).double(), torch.randn(100, 64, generator=g),
            torch.randn(5, 7, generator=g).t(), torch.randn(6, 8, generator=g).to(torch.bfloat16),
            torch.randint(0, 50, (9, 2), generator=g), torch.randn(17, generator=g) * 1e4,
            torch.randn(2, 3000, generator=g), torch.tensor([1.0, float("-inf"), 2.0])]


@pytest.mark.parametrize("threads", [1, 2])
def test_a_fingerprint_does_not_depend_on_the_tensors_reduced_beside_it(threads):
    """Forward and recompute reduce the same tensor among other neighbours (an op more or less, another flush): its
    numbers must be bit-identical all the same."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(0)
        tensors = _assorted(g)
        alone = [fp(t)[0] for t in tensors]
        together = fp(*tensors)
        shuffled = torch.randperm(len(tensors), generator=g).tolist()
        others = fp(*[torch.randn(3, 8, generator=g), torch.randn(1, 64, generator=g)],
                    *[tensors[i] for i in shuffled])[2:]
        assert together == alone
        assert [others[shuffled.index(i)] for i in range(len(tensors))] == alone
    finally:
        torch.set_num_threads(before)


def test_a_batch_of_more_than_a_flush_keeps_every_slot():
    g = torch.Generator().manual_seed(1)
    tensors = [torch.randn(2, 4, generator=g) for _ in range(fingerprint.HOLD * 2 + 3)]
    assert fp(*tensors) == [fp(t)[0] for t in tensors]


class _WritesItsOutput(nn.Module):
    """`h` is made, read, then written in place within the region: its op's fingerprint must be of what it made."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        y = h * 2
        h.add_(1)
        return y + h


def test_an_output_written_in_place_later_is_fingerprinted_as_its_op_made_it(tmp_path):
    torch.manual_seed(1)
    model = _WritesItsOutput()
    torch.manual_seed(0)  # (the input `record_step` makes)
    with torch.no_grad():
        made = model.lin(torch.randn(4, 8))
    _, run = record_step(_Wrapped(model), tmp_path / "t.jsonl")
    ops = run.regions[0].forward.ops
    linear = next(o for o in ops if o.op.startswith("aten.addmm"))
    assert linear.fingerprint[0] == fp(made, bits=True)[0] != fp(made + 1, bits=True)[0]  # (a recording's: exact)


class _Wrapped(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cp.checkpoint(self.inner, x, use_reentrant=False)


def test_the_exact_bit_sum_is_one_number_whichever_path_reduced_the_tensor(monkeypatch):
    """A float tensor's bit sum (the fingerprint's third number where its pair is not finite, always for gradients)
    is defined once: held CPU tensors take it at their flush, tensors on a device from their row sums, all of a
    pass's in one exact cumulative sum; the numbers are equal."""
    g = torch.Generator().manual_seed(2)
    tensors = [torch.randn(4, 8, generator=g), torch.randn(300, 64, generator=g), torch.tensor([1.0, float("-inf")]),
               torch.randn(5, 7, generator=g).t().to(torch.bfloat16), torch.randn(6, generator=g).double()]

    def bit_sums(batched: bool) -> list[int]:
        monkeypatch.setattr(fingerprint, "BATCH_CPU", batched)
        batch = FingerprintBatch(bits=True)
        slots = [batch.add(t) for t in tensors]
        values, _ = batch.collect()
        return [values[s][2] for s in slots]

    assert bit_sums(True) == bit_sums(False)
    assert len(set(bit_sums(True))) == len(tensors)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("n", [64, 262144])
def test_a_one_ulp_change_of_one_element_changes_an_exact_fingerprint(dtype, n):
    """A recording's fingerprints end with the exact bit sum (`bits=True`): one element of a large softmax moved by one
    ulp, which the float pair can round away, still reads as another tensor; the same values read alike."""
    g = torch.Generator().manual_seed(3)
    t = torch.softmax(torch.randn(n, generator=g, dtype=torch.float64), 0).to(dtype)
    moved = t.clone()
    moved[n // 3] = torch.nextafter(t[n // 3], torch.tensor(1.0, dtype=dtype))
    same, other = fp(t.clone(), moved, bits=True)
    assert fp(t, bits=True)[0] == same != other
    assert same[2] != other[2]


def test_a_tensor_whose_storage_is_freed_before_the_flush_is_never_read_there(cpu_path):
    """FSDP frees an all-gathered tensor's storage outside torch's dispatch (`untyped_storage().resize_(0)`): a
    tensor waiting for the flush may have no memory by then. A small one was copied when added (its fingerprint
    stands); a borrowed one (a parameter) or a large one's bit sum is not read: no fingerprint, or the pair alone."""
    small, borrowed, large = torch.randn(4, 8), torch.randn(3, 8), torch.randn(128, 64)
    large[0, 0] = float("-inf")  # (a pair that is not finite: its bit sum is wanted)
    expected = fp(small.clone(), borrowed.clone(), large.clone())
    batch = FingerprintBatch()
    slots = [batch.add(small), batch.add(borrowed, borrowed=True), batch.add(large)]
    for t in (small, borrowed, large):
        t.untyped_storage().resize_(0)
    values = [batch.collect()[0][s] for s in slots]
    if cpu_path == "fused":  # every one read at the flush (a CUDA tensor is not copied when added)
        assert values == [None, None, None]
    elif cpu_path == "batched":  # the small one copied when added
        assert values[0] == expected[0] and values[1] is None and values[2] == expected[2][:2]
    else:  # each reduced when added
        assert values == expected


class _WriteAfterLastSave(nn.Module):
    """After its last saved tensor, the region writes into relu's output, through numpy (no torch op: no version, no
    dispatch) where it keeps the mask, or in place through `.data` (an alias with a version counter of its own): the
    recompute stops before that line, and the gradients are the same."""

    def __init__(self, through: str) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(8, 8), nn.Linear(8, 8)
        self.through = through

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.relu(self.l1(x))
        out = self.l2(a * 2.0)
        if self.through == "numpy":
            values = a.detach().numpy()
            values[values > 0] += 1.0
        else:
            a.data.mul_(3.0)
        return out


def test_a_write_behind_torchs_back_after_the_op_does_not_reach_its_fingerprint(tmp_path):
    """A stranger's script: fingerprints read when the op ran, not at a later flush (small tensors are copied when
    added), so a numpy write after it is no false alarm."""
    torch.manual_seed(0)
    _, run = record_step(_Wrapped(_WriteAfterLastSave("numpy")), tmp_path / "t.jsonl")
    assert ac_diff.diagnose([run]).verdict == "clean"


def test_a_write_through_data_after_the_op_does_not_reach_its_fingerprint(tmp_path):
    """The write dispatches an op: a held output that shares its memory is fingerprinted before it (on the fused path
    too, where outputs wait for their flush), so the forward's relu reads as the recompute's."""
    torch.manual_seed(0)
    _, run = record_step(_Wrapped(_WriteAfterLastSave("data")), tmp_path / "t.jsonl")
    assert ac_diff.diagnose([run]).verdict == "clean"


def test_weights_converted_to_channels_last_before_the_backward_are_no_divergence(tmp_path):
    """An export helper converts the model to channels_last between the forward and the backward: the recompute
    reads the same values in another layout, its convolution computes the same values, and the gradients are
    bit-identical (torch checks no strides). Clean, as the gradients say."""
    def train(convert: bool, path=None):
        torch.manual_seed(0)
        block = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1))
        x = torch.randn(2, 8, 10, 10).contiguous(memory_format=torch.channels_last).requires_grad_()
        recording = ac_diff.record(path) if path is not None else contextlib.nullcontext()
        with recording:
            y = cp.checkpoint(block, x, use_reentrant=False)
            if convert:
                block.to(memory_format=torch.channels_last)
            y.pow(2).mean().backward()
        return [p.grad for p in block.parameters()]

    expected = train(False)
    got = train(True, tmp_path / "t.jsonl")
    assert all(torch.equal(a, b) for a, b in zip(expected, got))  # (the truth)
    report = ac_diff.diagnose_paths([tmp_path / "t.jsonl"])
    assert report.verdict == "clean", report.headline
