"""Watch mode (capture/watch.py): no dispatch mode, saved tensors digested on the device and compared per position,
read back without a sync; escalation to full recording; the same verdicts as full recording on real mechanisms."""

from __future__ import annotations

import contextlib
import functools
import json

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import ac_diff
from ac_diff.capture import fingerprint, watch
from ac_diff.capture.watch import WatchedPass, row_bits
from ac_diff.trace import read_run
from conftest import run_cli
from cuda_standin import KERNELS, CudaAttention, attention
from test_fingerprint import _dtypes, _edited, _flip_one, _sample, _swap_two

WATCH = {"watch": True, "watch_full_steps": 0}  # every step watched (the steady state of a long run)


def digests(*tensors: torch.Tensor) -> list:
    wp = WatchedPass()
    for i, t in enumerate(tensors):
        wp.hold(i, t, None)
    wp.launch()
    wp.resolve()
    return wp.digests


# -- the digest ---------------------------------------------------------------------------------------------------
_swap_rows = functools.partial(_swap_two, start=4)  # an element of another row of the (8, 4) sample


@pytest.fixture(params=["host", "device"])
def digest_path(request, monkeypatch):
    """CPU tensors hashed on the host (watch.HOST_CPU), or reduced on their device as a CUDA tensor is where the
    batched kernel did not compile."""
    monkeypatch.setattr(watch, "HOST_CPU", request.param == "host")
    return request.param


@pytest.mark.parametrize("dtype", _dtypes(), ids=lambda d: str(d).removeprefix("torch."))
def test_every_dtype_gets_a_digest_that_sees_one_bit_and_moved_rows(dtype, digest_path):
    t = _sample(dtype)
    first, again, flipped, moved = digests(t, _edited(t, lambda e: None), _edited(t, _flip_one), _edited(t, _swap_rows))
    assert first is not None and again == first and digests(t) == [first]
    assert flipped != first  # one element's bits changed
    assert moved != first  # values moved to another row (a token routed elsewhere)


def test_a_large_cpu_tensor_digest_sees_values_moved_within_a_row(monkeypatch):
    """A CPU tensor over 1 MiB, torch running several threads: it was reduced by rows (faster than one thread's
    hash), whose sums do not see values moved within a row (a stranger's shuffle of channel groups inside the region
    read as clean). Hashed on the host at any size now."""
    monkeypatch.setattr(watch, "HOST_CPU", True)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        t = torch.randn(4, 200_000, generator=torch.Generator().manual_seed(0))  # 3.2 MB
        moved = t.clone()
        moved[0, [0, 1]] = moved[0, [1, 0]]  # two values exchanged within the first row
        assert digests(t, moved)[0] != digests(t, moved)[1]
    finally:
        torch.set_num_threads(before)


def test_the_digest_of_a_tensor_does_not_depend_on_what_was_saved_before_it(digest_path):
    a, b = torch.randn(16, 8), torch.randn(5, 8)
    alone = digests(b)[0]
    after_a = digests(a, b)[1]
    after_other = digests(torch.randn(3, 8), b)[1]
    assert alone == after_a == after_other  # weights start over at each tensor: a shifted position still matches


def test_a_tensor_saved_twice_is_reduced_once(digest_path):
    x = torch.randn(4, 4)
    alone = digests(x)[0]
    wp = WatchedPass()
    for i, t in enumerate((x, x, x.clone())):
        wp.hold(i, t, None)
    wp.launch()
    wp.resolve()
    assert wp.digests == [alone] * 3
    assert wp.slots == [0, 0, 1]  # the same tensor, one digest; its copy, another


def test_views_of_one_memory_are_hashed_at_each_save():
    """Views reading one span of memory in memory order (a linear's 2-D view of a 3-D activation, a transposed one)
    get the digest of the same bytes; a write behind torch's back between two saves (`.data`: no version bump) is
    seen at the second."""
    x = torch.randn(64, 32, 16)  # 128 KiB
    same = digests(x, x.view(-1, 16), x.transpose(0, 1))
    assert same[0] == same[1] == same[2]
    wp = WatchedPass()
    wp.hold(0, x, None)
    x.data.mul_(2)
    wp.hold(1, x.view(-1, 16), None)
    wp.launch()
    wp.resolve()
    assert wp.digests[0] == same[0] != wp.digests[1]


def test_an_expanded_tensor_is_digested_by_the_values_it_repeats(digest_path):
    """An MoE's token indices expanded over the model dimension (stride 0) are read once per index, not copied;
    the digest still sees a changed index."""
    idx = torch.randint(0, 64, (256, 1))
    moved = idx.clone()
    moved[7] += 1
    wide, other = idx.expand(-1, 4096), moved.expand(-1, 4096)
    assert digests(wide) == digests(idx.expand(-1, 4096)) != digests(other)


def test_held_tensors_digested_together_get_the_digests_each_gets_alone(digest_path):
    """Each tensor of a pass keeps the digest it gets alone, whatever its neighbours: big, non-contiguous, 1-D,
    integer."""
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(n, 8, generator=g) for n in (3, 1, 5)] + [torch.randn(2, 8, generator=g).t(),
               torch.randn(7, generator=g), torch.randint(0, 9, (4, 8), generator=g), torch.randn(70_000, 8)]
    together = digests(*tensors)
    assert together == [digests(t)[0] for t in tensors]
    assert len(set(map(tuple, together))) == len(tensors)


def test_the_host_hash_reads_the_tensors_bytes_in_place(monkeypatch):
    """A slice of one memoryview of the address space reads exactly the tensor's bytes: the same hash as a copy of
    them (the fallback where CPython's C API is missing), for a view that starts inside its storage too."""
    from ac_diff.capture import host_hash

    base = torch.arange(4096, dtype=torch.int32)
    for t in (base, base[1000:1003], torch.randn(3, 5).t().contiguous(), torch.zeros(0)):
        in_place = host_hash.hash_bytes(t, t.nbytes)
        assert in_place == (host_hash._hash(t.numpy().tobytes()) if t.numel() else 0)
        monkeypatch.setattr(host_hash, "_ALL_MEMORY", None)
        assert host_hash.hash_bytes(t, t.nbytes) == in_place
        monkeypatch.undo()
    assert host_hash.hash_bytes(base[1:], 8) != host_hash.hash_bytes(base, 8)


def test_a_cpu_tensor_is_digested_as_torch_saves_it():
    """On the host, at the save: what happens to the tensor afterwards (an in-place write, a write behind torch's
    back through NumPy, its storage freed as FSDP's reshard frees it) does not reach its digest. (Held CUDA tensors:
    tests/watch_batched.py.)"""
    small, large, numpy_written, freed = torch.randn(4, 4), torch.randn(512, 256), torch.randn(3, 4), torch.randn(256, 256)
    before = digests(*(t.clone() for t in (small, large, numpy_written, freed)))
    wp = WatchedPass()
    for i, t in enumerate((small, large, numpy_written, freed)):
        wp.hold(i, t, None)
    small.add_(1)
    large.add_(1)
    numpy_written.numpy()[0, 0] += 1  # (no version bump: torch cannot see it)
    freed.untyped_storage().resize_(0)
    wp.launch()
    wp.resolve()
    assert wp.digests == before


class Resharded(nn.Module):
    """FSDP's reshard after forward, by hand: a full weight made in the region, used (the matmul saves it), then its
    storage freed outside torch's dispatch."""

    def __init__(self, dim: int = 256) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim, dim) * 0.05)

    def forward(self, x):
        full = self.weight * 1.0
        out = torch.relu(x @ full)
        full.untyped_storage().resize_(0)
        return out


def test_watch_leaves_storages_resizable_and_training_unchanged(tmp_path):
    """Hashing a saved tensor on the host must not touch its storage (a NumPy view would mark it not resizable for
    good, and the region's own `resize_(0)` would raise): the watched run trains exactly as the plain one."""
    def run(watched: bool) -> list[float]:
        torch.manual_seed(0)
        model, losses = Resharded(), []
        with ac_diff.record(tmp_path / "r.jsonl", **WATCH) if watched else contextlib.nullcontext():
            for _ in range(2):
                loss = checkpoint(model, torch.randn(8, 256, requires_grad=True), use_reentrant=False).sum()
                loss.backward()
                losses.append(loss.item())
        return losses + [model.weight.grad.sum().item()]

    assert run(True) == run(False)
    report = ac_diff.diagnose([read_run(tmp_path / "r.jsonl")])
    assert report.verdict == "clean" and report.watch["compared"] == 2, report.headline


@pytest.mark.parametrize("full_steps", [0, 1])
def test_a_batch_norm_in_training_is_not_a_divergence(tmp_path, full_steps):
    """A batch norm in training saves its running statistics before it updates them; the recompute saves them after
    the forward's update, and no backward reads them: full recording leaves them out, and watch learns that from the
    module's full recording (the first step, or one recorded to learn it). Here the region is a lambda, called from
    no module: watch keys it by its source line."""
    torch.manual_seed(0)
    lin, bn = nn.Linear(16, 16), nn.BatchNorm1d(16)
    with ac_diff.record(tmp_path / "bn.jsonl", watch=True, watch_full_steps=full_steps):
        for _ in range(3):
            out = checkpoint(lambda t: torch.relu(bn(lin(t))), torch.randn(8, 16), use_reentrant=False)
            out.pow(2).mean().backward()
    report = ac_diff.diagnose([read_run(tmp_path / "bn.jsonl")])
    assert report.verdict == "clean", report.headline
    assert report.watch["compared"] >= 1


class ScaledBehindTorchsBack(nn.Module):
    """A saved activation scaled in place by a gain the region itself advances, through `.data` (dispatched, a
    version counter of its own) or through NumPy (nothing torch sees): the recompute scales by another gain, and the
    next op saves a view of it."""

    def __init__(self, numpy: bool = False) -> None:
        super().__init__()
        self.w, self.u = nn.Parameter(torch.randn(32, 64) * 0.1), nn.Parameter(torch.randn(16, 8) * 0.1)
        self.register_buffer("gain", torch.tensor(1.0))
        self.numpy = numpy

    def forward(self, x):
        a = torch.tanh(x @ self.w)
        if self.numpy:
            a.detach().numpy()[:] *= float(self.gain)
        else:
            a.data.mul_(self.gain)
        with torch.no_grad():
            self.gain += 0.5
        return a.t() @ self.u


def _scaled(tmp_path, **options):
    torch.manual_seed(0)
    model = ScaledBehindTorchsBack(numpy=options.pop("numpy"))
    with ac_diff.record(tmp_path / "data.jsonl", **options):
        for _ in range(3):
            checkpoint(model, torch.randn(16, 32), use_reentrant=False).pow(2).mean().backward()
    return ac_diff.diagnose([read_run(tmp_path / "data.jsonl")])


def test_a_write_through_data_between_two_saves_of_one_tensor_is_seen_in_full(tmp_path):
    """`.data` dispatches a detach whose alias has its own version counter: writing it marks the outputs sharing its
    memory stale, so the view saved next is fingerprinted as it is then (before: the output's fingerprint from before
    the write was reused, and the region read as clean)."""
    report = _scaled(tmp_path, numpy=False)
    assert report.verdict == "diverged", report.headline
    lead = report.lead_groups()[0][0]
    assert (lead.cause.kind, lead.cause.tensor) == ("state_mutation", "gain"), lead.cause


def test_a_divergence_full_recording_does_not_see_says_so(tmp_path):
    """Written through NumPy, nothing reaches torch: watch hashes each save and sees the scaled view differ; full
    recording fingerprints the view by its base's values at their version, so the escalated recording reproduces.
    The report says the divergence did not recur there, names writes behind torch's back among the reasons, and
    gives the command that records the step in full."""
    report = _scaled(tmp_path, numpy=True, **WATCH)
    assert report.verdict == "diverged", report.headline
    lead = report.lead_groups()[0][0]
    assert lead.watched and lead.step == 1
    assert any("did not recur there" in n and "behind torch's back" in n and "--full-from-step 1" in n
               for n in lead.notes), lead.notes
    regions = ac_diff.load(tmp_path / "data.jsonl").regions  # (the table `export --what regions` writes)
    assert regions[regions.watched].step.tolist() == [1], regions


def test_tensors_without_plain_values_get_no_digest():
    sparse = torch.eye(3).to_sparse()
    assert digests(sparse, torch.empty(2, 2, device="meta")) == [None, None]
    assert row_bits(torch.zeros(0, 3)) is not None


# -- watched training -------------------------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, dim: int = 16, drift_after: int | None = None, dropout: float = 0.0) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)
        self.register_buffer("center", torch.zeros(dim))
        self.calls, self.drift_after, self.dropout = 0, drift_after, dropout

    def forward(self, x):
        self.calls += 1
        if self.drift_after is not None and self.calls > self.drift_after:
            # a running statistic updated inside the checkpointed forward: the recompute reads the new one
            self.center.mul_(0.9).add_(x.detach().mean((0, 1)), alpha=0.1)
        h = torch.relu(self.up(x - self.center))
        return self.down(nn.functional.dropout(h, self.dropout, self.training)) + x


class Net(nn.Module):
    def __init__(self, reentrant: bool = False, preserve: bool = True, **block) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(**block) for _ in range(2))
        self.reentrant, self.preserve = reentrant, preserve

    def forward(self, x):
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=self.reentrant, preserve_rng_state=self.preserve)
        return x


MECHANISMS = {  # name -> (model kwargs, the verdict full recording reaches)
    "clean": ({}, "clean"),
    "clean_reentrant": ({"reentrant": True}, "clean"),
    "buffer_updated_from_step_3": ({"drift_after": 4}, "diverged"),  # 2 forward calls per step: forward, recompute
    "dropout_without_rng_state": ({"dropout": 0.3, "preserve": False}, "diverged"),
    "reentrant_dropout_without_rng_state": ({"reentrant": True, "dropout": 0.3, "preserve": False}, "diverged"),
    "dropout_with_rng_state": ({"dropout": 0.3}, "clean"),
}


def train(model: nn.Module, steps: int = 4) -> list[float]:
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for _ in range(steps):
        x = torch.randn(2, 6, 16, requires_grad=True)  # (reentrant checkpoint needs an input that requires grad)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def recorded(tmp_path, name: str, model_kwargs: dict, **options):
    torch.manual_seed(0)
    model = Net(**model_kwargs)
    path = tmp_path / f"{name}.jsonl"
    with ac_diff.record(path, **options) as rec:
        losses = train(model)
    run = read_run(path)
    return rec, run, ac_diff.diagnose([run]), losses, model


@pytest.mark.parametrize("name", sorted(MECHANISMS))
def test_watch_reaches_the_verdict_full_recording_reaches(name, tmp_path):
    kwargs, expected = MECHANISMS[name]
    _, _, full, full_losses, full_model = recorded(tmp_path, f"{name}-full", kwargs)
    rec, run, watched, losses, model = recorded(tmp_path, f"{name}-watch", kwargs, **WATCH)
    assert rec.errors == []
    assert full.verdict == expected, full.headline
    assert watched.verdict == expected, watched.headline
    assert watched.watch["compared"] >= 1 and run.watch is not None
    assert losses == full_losses  # the recorder changes nothing it watches
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), full_model.state_dict().values()))


def test_after_escalation_the_lead_is_full_recordings_lead(tmp_path):
    kwargs = MECHANISMS["buffer_updated_from_step_3"][0]
    _, _, full, _, _ = recorded(tmp_path, "full", kwargs)
    _, run, watched, _, _ = recorded(tmp_path, "watch", kwargs, **WATCH)
    lead_full, lead_watch = full.lead_groups()[0][0], watched.lead_groups()[0][0]
    assert not lead_watch.watched, watched.headline  # a region recorded in full after the escalation leads
    assert (lead_watch.module, lead_watch.cause.kind, lead_watch.cause.tensor) == \
        (lead_full.module, lead_full.cause.kind, lead_full.cause.tensor)
    assert lead_watch.first_divergence().op == lead_full.first_divergence().op
    escalated = {e["module"]: e for e in watched.watch["escalated"]}
    first = min(r.step for r in watched.regions if r.watched and r.status == "diverged")
    assert escalated[lead_watch.module]["diverged_step"] == first == 3
    assert escalated[lead_watch.module]["from_step"] == 4
    assert "recorded in full from step 4" in watched.watch["text"]
    # the watched region that diverged first takes the cause its module's full recording found (the ranks table
    # and the cross-rank line name the earliest region: it said "unknown" there)
    first_watched = next(r for r in watched.regions if r.watched and r.status == "diverged")
    assert (first_watched.cause.kind, first_watched.cause.tensor) == (lead_watch.cause.kind, lead_watch.cause.tensor)
    assert f"region {lead_watch.region} shows" in first_watched.cause.detail


def test_watch_reads_nothing_back_synchronously(tmp_path, monkeypatch):
    """No `to_host` (a device sync on a GPU) while watching; one asynchronous copy per pass and device (CPU tensors
    digested on their device, as CUDA tensors are)."""
    monkeypatch.setattr(watch, "HOST_CPU", False)
    calls = {"to_host": 0, "later": 0}
    real_to_host, real_later = fingerprint.to_host, fingerprint.to_host_later
    monkeypatch.setattr(fingerprint, "to_host", lambda t: calls.__setitem__("to_host", calls["to_host"] + 1)
                        or real_to_host(t))
    monkeypatch.setattr(fingerprint, "to_host_later", lambda t: calls.__setitem__("later", calls["later"] + 1)
                        or real_later(t))
    _, _, report, _, _ = recorded(tmp_path, "syncs", {}, **WATCH)
    assert report.verdict == "clean"
    assert calls["to_host"] == 0
    assert calls["later"] == 4 * 2 * 2  # steps x regions x passes
    calls["later"] = 0
    monkeypatch.setattr(fingerprint, "BATCH_CPU", False)  # each tensor reduced on its own, as on a GPU
    recorded(tmp_path, "full", {})
    assert calls["to_host"] == 0 and calls["later"] == 4 * 2 * 2  # full recording: once per pass, no sync either
    calls["later"] = 0
    monkeypatch.setattr(fingerprint, "BATCH_CPU", True)  # CPU tensors read at their flush: nothing left to copy
    recorded(tmp_path, "full-cpu", {})
    assert calls["to_host"] == 0 and calls["later"] <= 4 * 2 * 2


# aten ops that launch no kernel (views, metadata): the profiler counts every other outermost aten op as one kernel
_NO_KERNEL = frozenset({"aten::view", "aten::reshape", "aten::unsqueeze", "aten::squeeze", "aten::t", "aten::transpose",
                        "aten::permute", "aten::expand", "aten::slice", "aten::select", "aten::as_strided",
                        "aten::detach", "aten::alias", "aten::_unsafe_view", "aten::view_as_real", "aten::unbind",
                        "aten::split", "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::lift_fresh",
                        "aten::result_type", "aten::resolve_conj", "aten::resolve_neg", "aten::contiguous",
                        "aten::is_nonzero", "aten::item", "aten::_local_scalar_dense"})


class Deep(nn.Module):
    """Many small saved tensors of one shape in one region (a stack of tiny layers)."""

    def __init__(self, depth: int = 24) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _added_kernels(tmp_path, model: nn.Module, x: torch.Tensor) -> tuple[int, int, int]:
    """(kernels a watched step adds over a plain one, saved tensors watch digested, passes), one step each."""
    from torch.profiler import ProfilerActivity, profile

    def kernels(watched: bool) -> int:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            with ac_diff.record(tmp_path / "k.jsonl", **WATCH) if watched else contextlib.nullcontext():
                checkpoint(model, x, use_reentrant=False).pow(2).mean().backward()
        return sum(1 for e in prof.events() if e.name.startswith("aten::") and e.name not in _NO_KERNEL
                   and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")))

    kernels(True)  # the weights made once per process
    digested = []
    real = WatchedPass.launch
    WatchedPass.launch = lambda wp: digested.append(wp._slots) or real(wp)
    try:
        watched = kernels(True)
    finally:
        WatchedPass.launch = real
    return watched - kernels(False), sum(digested), len(digested)


def test_watch_adds_at_most_a_kernel_per_saved_tensor_and_a_few_per_pass(tmp_path, monkeypatch):
    """Kernels watch adds (profiler, outermost aten ops) where tensors are reduced on their device (a GPU's path where
    the batched kernel did not compile): at most one per saved tensor it digests, plus a constant number per pass
    (the pass's cumulative sum, its packed copy)."""
    monkeypatch.setattr(watch, "HOST_CPU", False)
    torch.manual_seed(0)
    added, digested, passes = _added_kernels(tmp_path, Block(dim=16), torch.randn(2, 6, 16, requires_grad=True))
    assert passes == 2 and digested > 0
    assert 0 < added <= digested + 16 * passes, (added, digested)


def test_small_cpu_saved_tensors_add_no_kernel(tmp_path):
    """A region saving 24 small tensors per pass: on CPU watch hashes them on the host (host_hash.py), no kernel."""
    torch.manual_seed(0)
    added, digested, passes = _added_kernels(tmp_path, Deep(), torch.randn(4, 16, requires_grad=True))
    assert passes == 2 and digested >= 2 * 24
    assert added == 0, (added, digested)


def test_a_full_recording_adds_about_a_kernel_per_fingerprinted_tensor(tmp_path, monkeypatch):
    """Fingerprints of small CPU tensors share their reductions (fingerprint.FingerprintBatch.flush): each costs the
    copy that stages it, plus a constant number of kernels per flush of up to 64 (20: 12 for the pairs, 8 for the
    exact bit sums, one per staged buffer and five for all of them); reduced one by one (the GPU path), the same region
    costs several times that."""
    from torch.profiler import ProfilerActivity, profile

    from ac_diff.capture import fingerprint

    torch.manual_seed(0)
    model, x = Deep(), torch.randn(4, 16, requires_grad=True)
    counts = {"added": 0, "flushes": 0}
    real_add, real_flush = fingerprint.FingerprintBatch.add, fingerprint.FingerprintBatch._flush

    def add(self, t, borrowed=False):
        counts["added"] += 1
        return real_add(self, t, borrowed)

    def flush(self, *parts):
        counts["flushes"] += 1
        return real_flush(self, *parts)

    monkeypatch.setattr(fingerprint.FingerprintBatch, "add", add)
    monkeypatch.setattr(fingerprint.FingerprintBatch, "_flush", flush)

    seen = {"segment_reduce": 0}

    def kernels(recording: bool) -> int:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            with ac_diff.record(tmp_path / "f.jsonl") if recording else contextlib.nullcontext():
                checkpoint(model, x, use_reentrant=False).pow(2).mean().backward()
        seen["segment_reduce"] = sum(e.name == "aten::segment_reduce" for e in prof.events())
        return sum(1 for e in prof.events() if e.name.startswith("aten::") and e.name not in _NO_KERNEL
                   and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")))

    plain = kernels(False)
    kernels(True)  # the weights made once per process
    counts.update(added=0, flushes=0)
    batched = kernels(True) - plain
    added, flushes, segmented = counts["added"], counts["flushes"], seen["segment_reduce"]
    monkeypatch.setattr(fingerprint, "BATCH_CPU", False)
    alone = kernels(True) - plain
    assert added > 2 * 24 and flushes >= 2
    assert 0 < batched <= added + 20 * flushes, (batched, added, flushes)
    if segmented < flushes or alone < added:  # (each tensor reduced on its own takes one kernel or more)
        pytest.skip("this torch's profiler does not see every op the recorder runs (torch 2.4)")
    assert 2 * batched < alone, (batched, alone)


@pytest.mark.parametrize("kernel", KERNELS)
def test_attention_kernels_uninitialised_outputs_are_not_an_alarm(kernel, tmp_path):
    """CUDA's attention kernels save an output nobody writes (flash's `unused`, the philox state of a call that drew
    nothing): a watched difference there is held until a full recording of the module says which positions hold no
    values; then the region is clean, and the module is watched again."""

    class Attn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(32, 96)
            self.repeats = 1

        def forward(self, x):
            q, k, v = (t.view(2, 8, 4, 8).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
            x = attention(q, k, v, kernel, dropout_p=0.0, is_causal=True).transpose(1, 2).reshape(2, 8, 32)
            for _ in range(self.repeats):  # saves a number of tensors that changes from step to step (as an MoE's)
                x = torch.sin(x) * x
            return x

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(Attn() for _ in range(2))

        def forward(self, x):
            for layer in self.layers:
                x = checkpoint(layer, x, use_reentrant=False)
            return x

    torch.manual_seed(0)
    model = Model()
    path = tmp_path / "t.jsonl"
    with ac_diff.record(path, **WATCH):
        for step in range(4):
            for layer in model.layers:
                layer.repeats = 1 + step % 3
            with CudaAttention():
                model(torch.randn(2, 8, 32)).pow(2).sum().backward()
    report = ac_diff.diagnose([read_run(path)])
    assert report.verdict == "clean", report.headline
    assert report.watch["escalated"] == [] and report.watch["diverged"] == 0
    assert report.watch["compared"] >= 2 * 3  # one step recorded in full to learn, the rest watched


def test_a_watched_divergence_the_run_never_saw_again_says_so(tmp_path):
    """The script stops in the step the divergence appeared (torch raised): the report says which step to record in
    full, and the verdict is diverged."""
    torch.manual_seed(0)
    model = Net(drift_after=4)
    path = tmp_path / "t.jsonl"
    with ac_diff.record(path, **WATCH):
        train(model, steps=3)
    report = ac_diff.diagnose([read_run(path)])
    assert report.verdict == "diverged"
    assert "--full-from-step 3" in report.watch["text"]
    lead = report.lead_groups()[0][0]
    assert lead.watched and lead.step == 3 and "watch mode in step 3" in lead.cause.detail
    # the command to paste names the script the run ran (here, the library: no script)
    assert "`ac-diff run --full-from-step 3 SCRIPT ...`" in " ".join([lead.cause.detail, *lead.notes]), lead.notes
    # run under torchrun (two ranks' traces): the command keeps the launch (26f: it dropped --nproc-per-node)
    runs = [read_run(path), read_run(path)]
    runs[1].rank = 1
    for region in runs[1].regions:
        region.rank = 1
    lead = ac_diff.diagnose(runs).lead_groups()[0][0]
    assert "`ac-diff run --nproc-per-node 2 --full-from-step 3 SCRIPT ...`" in " ".join(
        [lead.cause.detail, *lead.notes]), lead.notes


def test_the_full_from_step_command_names_the_script_and_its_arguments():
    """It said "`ac-diff run --full-from-step 6`", which runs nothing: the script and its arguments, as the trace's
    header has them, complete it."""
    from types import SimpleNamespace

    from ac_diff.diagnosis.watched import _script_words

    def run(**header):
        return SimpleNamespace(source="trace", header=header)

    assert _script_words([run(target="train.py", target_args=["--lr", "3e-4", "--name", "a b"])]) == \
        "train.py --lr 3e-4 --name 'a b'"
    assert _script_words([run(target="pkg.train", target_args=[], module=True)]) == "-m pkg.train"
    assert _script_words([run()]) == "SCRIPT ..."


def test_full_from_step_records_from_that_step(tmp_path):
    _, run, report, _, _ = recorded(tmp_path, "from", {}, watch=True, watch_full_steps=0, full_from_step=3)
    steps = sorted({r.step for r in run.regions if r.recorded})
    assert steps == [3, 4] and report.verdict == "clean"
    assert report.watch["compared"] == 2 * 2  # steps 1 and 2 watched


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_long_watched_run_keeps_a_small_trace(tmp_path, monkeypatch, reentrant):
    """Clean watched regions leave only counts: a "watch" record every 100 steps and at the end. Reentrant ones are
    also recorded in full now and then (resampled), and written as summaries: their forward runs without grad and
    their recompute with it, which is no difference (a clean 2-layer run wrote 1.6 MB in 300 steps)."""
    monkeypatch.setattr(watch, "SUMMARY_SECONDS", 1e9)  # (the cadence in time: the next test)
    torch.manual_seed(0)
    model = Net(reentrant=reentrant)
    path = tmp_path / "long.jsonl"
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with ac_diff.record(path, watch=True):
        for _ in range(300):
            model(torch.randn(1, 2, 16, requires_grad=reentrant)).pow(2).mean().backward()  # (finite all the way)
            opt.step()
            opt.zero_grad()
    size = path.stat().st_size
    report = ac_diff.diagnose([read_run(path)])
    assert report.verdict == "clean" and report.watch["steps"] == 300
    assert size < 200_000, size
    types = [json.loads(line)["type"] for line in path.read_text().splitlines()]
    assert types.count("watch") == 300 // 100 + 1
    if reentrant:  # op lists of the first clean region of each module only
        assert report.watch["resampled"] > 10 and types.count("ops") == 2 * 2, types.count("ops")
    else:
        assert report.watch["compared"] == 2 * 299 + 0  # step 1 in full


def test_a_clean_watched_reentrant_region_says_only_its_outputs_were_compared(tmp_path):
    """A reentrant region's forward runs without grad and saves nothing: watch compares its outputs, and a recompute
    that reaches the same outputs through other saved tensors (a softmax kept in bf16) changes the gradients unseen.
    The report says what it compared (it said every region "reproduced their saved tensors")."""
    torch.manual_seed(0)
    block, path = nn.Sequential(nn.Linear(8, 8), nn.Tanh()), tmp_path / "r.jsonl"
    with ac_diff.record(path, **WATCH, watch_resample=0):  # (every step watched: none resampled in full)
        for _ in range(3):
            checkpoint(block, torch.randn(2, 8, requires_grad=True), use_reentrant=True).sum().backward()
    report = ac_diff.diagnose([read_run(path)])
    assert report.verdict == "clean" and report.watch["outputs_only"] == report.watch["compared"] == 3
    assert "(the watched reentrant ones: their outputs; their forward saves nothing)" in report.headline
    assert "all reentrant: compared by their outputs only" in report.watch["text"]


class PrecisionScheduled(nn.Module):
    """Its softmax runs in `softmax_dtype`, which a precision schedule sets between the forward and the backward: a
    float32 softmax rounded to bf16 and a bf16 softmax give the same bf16 output, so a reentrant recompute reaches the
    forward's outputs while it saves its softmax in another dtype (its backward then runs in bf16)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.softmax_dtype = torch.float32

    def forward(self, x):
        s = self.lin(x.float()).to(torch.bfloat16)
        return s.to(self.softmax_dtype).softmax(-1).to(torch.bfloat16)


def _precision_schedule(block: nn.Module, steps: int, ac: bool = True) -> list[torch.Tensor]:
    torch.manual_seed(1)
    grads = []
    for step in range(steps):
        x = torch.randn(4, 8, 16).to(torch.bfloat16).requires_grad_()
        out = checkpoint(block, x, use_reentrant=True) if ac else block(x)
        block.softmax_dtype = torch.bfloat16 if step >= 1 else torch.float32  # (the schedule, after the forward)
        (out.float() * torch.arange(16.0)).sum().backward()
        block.softmax_dtype = torch.float32
        grads.append(block.lin.weight.grad.clone())
        block.lin.weight.grad = None
    return grads


def test_watch_resamples_reentrant_modules_in_full(tmp_path):
    """Watch compares a reentrant region by its outputs; a recompute that reaches the same outputs through other saved
    tensors changes the gradients unseen. Such a module is recorded in full every --watch-resample steps: the run is
    diverged, where without resampling it reads clean (the limit the report then states)."""
    torch.manual_seed(0)
    block = PrecisionScheduled()
    state = {k: v.clone() for k, v in block.state_dict().items()}
    with_ac, without = _precision_schedule(block, 2), _precision_schedule(block, 2, ac=False)
    assert torch.equal(with_ac[0], without[0]) and not torch.equal(with_ac[1], without[1])  # a real divergence
    said = {}
    for every in (3, 0):
        block.load_state_dict(state)
        path = tmp_path / f"every{every}.jsonl"
        with ac_diff.record(path, watch=True, watch_full_steps=0, watch_resample=every):
            _precision_schedule(block, 6)
        said[every] = ac_diff.diagnose([read_run(path)])
    resampled, unsampled = said[3], said[0]
    assert resampled.verdict == "diverged", resampled.headline
    lead = resampled.lead_groups()[0][0]
    # the first resample comes a step after the module's first forward: the divergence from step 2 is found there
    assert not lead.watched and lead.step == 2 and lead.cause.tensor and "softmax_dtype" in lead.cause.tensor
    assert "recorded in full every 3 steps, in turn (--watch-resample; 2 time(s) in this run)" in resampled.watch["text"]
    assert unsampled.verdict == "clean" and unsampled.watch["outputs_only"] == 6  # (what resampling is for)
    assert "record them in full, --watch-resample N" in unsampled.watch["text"]


def test_resampling_takes_one_module_a_step():
    """Several modules compared by their outputs are recorded in full in turn, one a step, each every N steps (the
    first time a step after its first forward, then 2, 4, ... steps apart, up to N)."""
    w = watch.Watch(write=lambda rec: None, region_record=None, resample_every=2)
    full = {step: [key for key in ("a", "b", "c") if w.full(key, step, outputs_only=True)] for step in range(1, 9)}
    assert full == {1: [], 2: ["a"], 3: ["b"], 4: ["c"], 5: ["a"], 6: ["b"], 7: ["c"], 8: ["a"]}
    assert w.resampled == {"a": 3, "b": 2, "c": 2}
    w = watch.Watch(write=lambda rec: None, region_record=None, resample_every=20)  # one module: the ramp
    assert [step for step in range(1, 60) if w.full("a", step, outputs_only=True)] == [2, 4, 8, 16, 32, 52]
    assert not any(w.full("d", step) for step in range(9, 20))  # (not compared by its outputs: never)


def test_watched_counts_are_written_every_few_seconds_too(tmp_path, monkeypatch):
    """Slow steps write their totals by time as well: a process killed outright (SIGKILL) keeps the counts up to its
    last totals, and its report is CUT SHORT, never clean (it said CLEAN over 3 regions, 156 run)."""
    monkeypatch.setattr(watch, "SUMMARY_SECONDS", 0.0)
    torch.manual_seed(0)
    model, path = Net(), tmp_path / "slow.jsonl"
    with ac_diff.record(path, **WATCH):
        for _ in range(6):
            model(torch.randn(1, 2, 16)).sum().backward()
    lines = path.read_text().splitlines()
    assert [json.loads(line)["type"] for line in lines].count("watch") == 5 + 1  # each step after the first, the end
    cut = tmp_path / "cut.jsonl"  # killed in step 6: its last totals (step 5) are what is left
    cut.write_text("\n".join(line for line in lines if json.loads(line)["type"] != "end") + "\n")
    report = ac_diff.diagnose([read_run(cut)])
    assert report.verdict == "unchecked" and report.title == "CUT SHORT", report.headline
    assert report.watch["compared"] >= 2 * 4 and "regions checked clean before its last record" not in report.headline
    assert f"{report.watch['compared']} region(s) checked clean before its last record" in report.headline


def test_watched_counts_reach_the_disk_while_the_run_goes_on(tmp_path, monkeypatch):
    """Each "watch" totals record is on disk as it is written, not when some later write fills the buffer: a clean
    watched run writes nothing else, and `ac-diff report` mid-run (or after SIGKILL) read only step 1's 2 regions of
    a 1,100-step run."""
    monkeypatch.setattr(watch, "SUMMARY_EVERY", 3)
    monkeypatch.setattr(watch, "SUMMARY_SECONDS", 1e9)
    torch.manual_seed(0)
    model, path = Net(), tmp_path / "live.jsonl"
    with ac_diff.record(path, **WATCH):
        for step in range(1, 8):
            model(torch.randn(1, 2, 16)).sum().backward()
        mid = [json.loads(line) for line in path.read_text().splitlines()]  # (read as the run goes on)
    totals = [r for r in mid if r["type"] == "watch"]
    assert [t["step"] for t in totals] == [3, 6], [r["type"] for r in mid]
    assert sum(t[0] for t in totals[-1]["modules"].values()) >= 2 * 4


# -- the batched CUDA digest (byte_sums.py), run on CPU by Triton's interpreter ---------------------------------
def _interpreter_loads_through_addresses() -> bool:
    """Triton's interpreter before 3.1 cannot load through a pointer made from an integer address (the kernel's
    inputs): it returns other memory. (On a GPU, the kernel's check at first use catches any such build.)"""
    try:
        import triton
    except ImportError:
        return False
    return tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (3, 1)


@pytest.mark.skipif(not _interpreter_loads_through_addresses(), reason="needs Triton >= 3.1 (its interpreter)")
def test_watch_through_the_batched_cuda_kernel_under_tritons_interpreter():
    """Watch mode's CUDA path (every saved tensor to the batched Triton kernel) on CPU tensors, the kernel run by
    Triton's interpreter, which must be switched on before triton is imported: a process of its own
    (tests/watch_batched.py holds the checks)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "watch_batched.py")], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.split() == ["kernel", "ok", "verdicts", "ok", "in_place", "ok", "spans", "ok"], done.stdout


@pytest.mark.e2e
def test_watch_under_torchrun_finds_the_rank_that_diverged(tmp_path):
    """`ac-diff run --nproc-per-node 2 --watch`: every rank watches; rank 1 updates its router bias between forward
    and recompute (torch raises there), rank 0 reproduces; the cross-rank report says so."""
    from conftest import EXAMPLES, report_json, run_cli

    out, json_path = tmp_path / "out", tmp_path / "report.json"
    proc = run_cli("run", "--nproc-per-node", "2", "--watch", "--watch-full-steps", "0", "-o", str(out),
                   "--json", str(json_path), str(EXAMPLES / "distributed_bias_update.py"), cwd=tmp_path, timeout=240)
    assert proc.returncode == 1, proc.stderr[-3000:]  # rank 1's CheckpointError
    report = report_json(json_path)
    assert report["verdict"] == "diverged"
    headers = [json.loads((out / f"trace-rank{r}.jsonl").open().readline()) for r in (0, 1)]
    assert all(h["options"]["watch"] and h["options"]["watch_full_steps"] == 0 for h in headers)
    diverged = [(r["rank"], r["module"], r["watched"]) for r in report["regions"] if r["status"] == "diverged"]
    assert diverged == [(1, "layers.1", True)], report["regions"]
    assert report["watch"]["compared"] >= 2  # rank 0's two regions, and rank 1's
    ranks = {r["rank"]: r for r in report["ranks"]}  # rank 0's watched regions count there ("0 of 0" before)
    assert ranks[0]["verdict"] == "clean" and ranks[0]["regions"] == ranks[0]["clean"] >= 2, ranks[0]


def test_a_reentrant_region_that_diverged_in_the_full_first_step_stays_recorded_in_full(tmp_path):
    """A reentrant region's forward saves nothing: in the step recorded in full, watch compares its outputs (as it
    does when it watches it), so a module whose recompute differed there is never watched."""
    kwargs = {**MECHANISMS["dropout_without_rng_state"][0], "reentrant": True}
    _, _, report, _, _ = recorded(tmp_path, "rng_reentrant", kwargs, watch=True)
    assert report.verdict == "diverged" and not any(r.watched for r in report.regions)
    assert all(e["why"] == "full" and e["from_step"] == 1 for e in report.watch["escalated"])
    _, _, clean, _, _ = recorded(tmp_path, "clean_reentrant", {"reentrant": True}, watch=True, watch_resample=0)
    assert clean.verdict == "clean" and clean.watch["escalated"] == [] and clean.watch["compared"] == 2 * 3
    assert clean.watch["text"].startswith("step 1 recorded in full (--watch-full-steps 1), then watched 6 region(s) "
                                          "over 3 step(s)"), clean.watch["text"]


def test_a_divergence_in_the_full_first_step_keeps_its_module_recorded_in_full(tmp_path):
    """With the first step recorded in full (the default), a module whose saved tensors differ there has its full
    diagnosis in the trace (the same lead, op and cause as full recording): it is watched again from the next step,
    its divergences counted, not written (a divergence that persists does not write every step in full); the report
    says so; a module that only counts its calls in its forward (a harmless attribute update) is watched."""
    _, run, report, _, _ = recorded(tmp_path, "rng", MECHANISMS["dropout_without_rng_state"][0], watch=True)
    assert report.verdict == "diverged" and not any(r.watched for r in report.regions)
    assert run.watch["step"] > 1  # (the test needs a step after the first)
    assert all(e["why"] == "full" and e["from_step"] == 1 and e["until_step"] == 2 for e in report.watch["escalated"])
    assert {r.step for r in report.regions} == {1}  # written: the step whose full recording showed it
    later = report.watch["compared"]
    assert later == report.watch["diverged"] == report.watch["unwritten"] > 0  # after it: counted
    # (not "..., so it was recorded in full in step 1": it was, as the first step is)
    assert "(recorded in full) saved other tensors than its forward: 1 of 1 diverged" in report.watch["text"], \
        report.watch["text"]
    assert "watched again from step 2" in report.watch["text"]
    # which steps they were, in a few numbers: a divergence that persists from one that stopped (it kept only the
    # first step's)
    last = run.watch["step"]
    assert all(e["counted_steps"] == [[2, last]] for e in report.watch["escalated"]), report.watch["escalated"]
    assert f"more diverged (counted, not written; in step(s) 2-{last})" in report.watch["text"], report.watch["text"]
    assert f"{later} diverged (watched, counted)" in report.status_counts()
    rank = report.ranks[0]  # the ranks table counts them too
    assert rank.diverged == len(report.regions) + later and rank.regions == rank.diverged + rank.clean + rank.unchecked
    _, _, clean, _, _ = recorded(tmp_path, "counting", {}, watch=True)  # Block counts its calls in its forward
    assert clean.verdict == "clean" and clean.watch["escalated"] == [] and clean.watch["compared"] == 2 * 3


class Wide(nn.Module):
    """Saved tensors (and outputs) larger than watch reduces at their save on CPU (watch.SMALL)."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(128, 256), nn.Linear(256, 128)

    def forward(self, x):
        return self.down(torch.relu(self.up(x))) + x


def _train_wide(context_fn=None, reentrant: bool = False, steps: int = 3) -> None:
    torch.manual_seed(0)
    model = Wide()
    for _ in range(steps):
        x = torch.randn(4, 64, 128, requires_grad=True)
        kwargs = {"context_fn": context_fn} if context_fn is not None else {}
        loss = checkpoint(model, x, use_reentrant=reentrant, **kwargs).pow(2).mean()
        loss.backward()  # (another line: ops recorded here and at the checkpoint call read as other code)


def test_a_large_output_reduced_in_a_step_recorded_in_full_is_not_recorded_as_the_regions_op(tmp_path):
    """A reentrant region's large output is reduced when watch takes it (its first step, recorded in full): the
    recording mode must not see that reduction (before: it was recorded as the region's ops, in the forward and the
    recompute at other source lines, a control-flow false alarm)."""
    path = tmp_path / "reentrant.jsonl"
    with ac_diff.record(path, watch=True, watch_resample=0):  # the first step recorded in full, none resampled
        _train_wide(reentrant=True)
    run = read_run(path)
    report = ac_diff.diagnose([run])
    assert report.verdict == "clean", report.headline
    assert report.watch["compared"] == 2  # steps 2 and 3 watched
    full = tmp_path / "full.jsonl"  # the same first step recorded in full without watch: the same ops
    with ac_diff.record(full):
        _train_wide(reentrant=True, steps=1)
    assert [o.op for o in run.regions[0].forward.ops] == [o.op for o in read_run(full).regions[0].forward.ops]


class WideDropout(Wide):
    def forward(self, x):
        return self.down(torch.dropout(torch.relu(self.up(x)), 0.3, True)) + x


@pytest.mark.skipif(not hasattr(torch.utils.checkpoint, "CheckpointPolicy"), reason="selective AC's policy API")
def test_selective_acs_cache_never_serves_watchs_own_reductions(tmp_path):
    """Selective AC whose policy saves every sum: the reductions watch runs as it takes a large saved tensor must
    not reach its caching mode, or the recompute's digest would be the forward's, replayed (here a dropout without
    its RNG state would read as clean)."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx, func, *args, **kwargs):
        saved = (torch.ops.aten.mm.default, torch.ops.aten.sum.dim_IntList)
        return CheckpointPolicy.MUST_SAVE if func in saved else CheckpointPolicy.PREFER_RECOMPUTE

    torch.manual_seed(0)
    model = WideDropout()
    path = tmp_path / "sac.jsonl"
    with ac_diff.record(path, **WATCH):
        for _ in range(2):
            x = torch.randn(4, 64, 128, requires_grad=True)
            loss = checkpoint(model, x, use_reentrant=False, preserve_rng_state=False,
                              context_fn=functools.partial(create_selective_checkpoint_contexts, policy)).sum()
            loss.backward()
    report = ac_diff.diagnose([read_run(path)])
    assert report.verdict == "diverged", report.headline


class Remembers(nn.Module):
    """Transformer-XL-like: attends over a memory its trainer passes in (a checkpointed region's input)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, mem):
        return x + torch.tanh(self.fc(torch.cat([mem, x], dim=1))).narrow(1, 0, x.shape[1])


@pytest.mark.parametrize("options", [{}, WATCH], ids=["full", "watch"])
def test_a_region_input_written_in_place_before_the_backward_is_named_where_torch_stops_the_run(tmp_path, options):
    """From step 3 the trainer refreshes the memory in place (`mem.copy_`) after the forward, before the backward:
    torch's version check stops the backward over a [2, 4, 8] tensor, naming no region and no input. A stranger's
    Transformer-XL: watch called the run clean, full recording left the region unexplained."""
    torch.manual_seed(0)
    model, mem = Remembers(), torch.zeros(2, 4, 8)
    path = tmp_path / "t.jsonl"
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        with ac_diff.record(path, **options):
            for step in range(1, 4):
                out = checkpoint(model, torch.randn(2, 4, 8, requires_grad=True), mem, use_reentrant=False)
                if step == 3:
                    with torch.no_grad():
                        mem.copy_(out)
                out.pow(2).sum().backward()
    report = ac_diff.diagnose_paths([path])
    assert report.verdict == "diverged", report.headline
    lead = report.lead_groups()[0][0]
    assert (lead.cause.kind, lead.cause.tensor, lead.cause.mechanism) == ("state_mutation", "input[1]", "input")
    assert "modified in place after the forward" in lead.cause.detail and "version went from 0 to 1" in \
        lead.cause.detail, lead.cause.detail
    assert lead.suggestions[0].title.startswith("Do not modify the region's input in place"), lead.suggestions


def test_a_watched_run_that_stops_before_its_recomputes_is_never_clean(tmp_path):
    """Step 3's targets have another batch size (a data bug): the script stops before that step's backward, and
    the forwards it watched are never compared. Watch called such a run clean (it counted only what it compared)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    path = tmp_path / "t.jsonl"
    with pytest.raises(ValueError, match="batch_size"):
        with ac_diff.record(path, **WATCH):
            for step in range(1, 4):
                logits = checkpoint(model, torch.randn(4, 8, requires_grad=True), use_reentrant=False)
                target = torch.zeros(4 if step < 3 else 3, dtype=torch.long)
                nn.functional.cross_entropy(logits, target).backward()
    report = ac_diff.diagnose_paths([path])
    assert report.verdict == "unchecked", report.headline
    assert "crashed" in report.headline and "2 region(s) checked clean, 1 never checked" in report.headline, \
        report.headline
    assert "the run stopped first" in report.watch["text"]


def test_an_escalated_module_whose_full_recording_was_never_compared_is_not_said_to_reproduce(tmp_path):
    """Both layers diverge in step 3 (a buffer updated in their forward), so step 4 records them in full; step 4's
    targets have another batch size and the script stops before its backward. The report said the full recording
    "reproduced its saved tensors in all 1 recorded region(s): the divergence did not recur"."""
    torch.manual_seed(0)
    model = Net(drift_after=4)
    path = tmp_path / "t.jsonl"
    with pytest.raises(ValueError, match="batch_size"):
        with ac_diff.record(path, **WATCH):
            for step in range(1, 5):
                out = model(torch.randn(2, 6, 16, requires_grad=True)).mean(1)
                target = torch.zeros(2 if step < 4 else 3, dtype=torch.long)
                nn.functional.cross_entropy(out, target).backward()
    report = ac_diff.diagnose_paths([path])
    assert report.verdict == "diverged", report.headline
    assert [(e["diverged_step"], e["from_step"], e["full_regions"], e["full_clean"]) for e in
            report.watch["escalated"]] == [(3, 4, 1, 0)] * 2
    assert "reproduced" not in report.watch["text"].split("; ", 1)[1], report.watch["text"]
    watched = [r for r in report.regions if r.watched and r.status == "diverged"]
    assert watched and all("none of its 1 region(s) was compared" in " ".join(r.notes) and
                           "did not recur" not in r.cause.detail for r in watched)


class NestedBlocks(nn.Module):
    """Each block checkpoints its inner layer inside its own checkpointed region (nested AC)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(2)])

    def forward(self, x):
        for layer in self.inner:
            x = checkpoint(lambda y, f=layer: torch.tanh(checkpoint(f, y, use_reentrant=False)), x, use_reentrant=False)
        return x


@pytest.mark.parametrize("options", [{}, WATCH], ids=["full", "watch"])
def test_nested_checkpoints_of_a_function_region_are_clean_and_not_left_uncompared(tmp_path, options):
    """A nested checkpoint that runs inside its parent's recompute is never recomputed again (torch runs it as part
    of that recompute): watch counted each as a forward "no backward reached", on a clean run where every backward
    ran. And the parent, a function checkpointed inside the root module, read as diverged in both modes: its
    forward ran inside the root module (FQN ""), its recompute, run from the backward, inside no module."""
    torch.manual_seed(0)
    model = NestedBlocks()
    path = tmp_path / "t.jsonl"
    with ac_diff.record(path, **options):
        for _ in range(2):
            model(torch.randn(4, 8, requires_grad=True)).sum().backward()
    report = ac_diff.diagnose_paths([path])
    assert report.verdict == "clean", report.headline
    if options:
        assert report.watch["never_compared"] == 0 and report.watch["compared"] > 0, report.watch["text"]
        assert not report.regions, [(r.region, r.status, r.unchecked_reason) for r in report.regions]


def test_a_model_switched_to_eval_before_the_backward_is_named_by_watch(tmp_path):
    """A stranger's monitor calls model.eval() between step 4's forward and its backward: batch norm's recompute
    saves [0]-shaped statistics. Watch blamed ZeRO-3/FSDP (parameters recomputed with shape [0]); it now notes each
    watched pass's training mode (one attribute per module, per pass) and names the switch, as full recording does."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Tanh())
    path = tmp_path / "t.jsonl"
    with pytest.raises(torch.utils.checkpoint.CheckpointError):
        with ac_diff.record(path, **WATCH):
            for step in range(1, 4):
                model.train()
                out = checkpoint(model, torch.randn(4, 8, requires_grad=True), use_reentrant=False)
                if step == 3:
                    model.eval()  # a monitor's evaluation between the forward and the backward
                out.pow(2).sum().backward()
    report = ac_diff.diagnose_paths([path])
    lead = report.lead_groups()[0][0]
    assert lead.watched and (lead.cause.kind, lead.cause.tensor) == ("global_state", "training"), lead.cause


def test_the_counts_lead_and_steps_say_what_watch_saw(tmp_path):
    """The headline leads with the first region that diverged (watched: its cause comes from its module's full
    recording); the region count includes a last forward the run never took a backward of, as full recording counts
    it; the steps watched are those before --full-from-step."""
    torch.manual_seed(0)
    _, _, drift, _, _ = recorded(tmp_path, "drift", MECHANISMS["buffer_updated_from_step_3"][0], **WATCH)
    first = min((r for r in drift.regions if r.status == "diverged"), key=lambda r: r.region)
    assert first.watched and f"region {first.region}, step {first.step})" in drift.headline.split(" diverged")[0], \
        drift.headline
    torch.manual_seed(0)
    model, path = Net(), tmp_path / "t.jsonl"
    with ac_diff.record(path, watch=True, watch_full_steps=0, full_from_step=3):
        train(model, steps=4)
        model(torch.randn(2, 6, 16, requires_grad=True))  # (an evaluation with grad on: no backward)
    report = ac_diff.diagnose([read_run(path)])
    assert report.status_counts().startswith(f"{5 * 2} region(s)"), report.status_counts()
    assert "over 2 step(s)" in report.watch["text"], report.watch["text"]  # steps 1-2: watched; 3 on: in full
    torch.manual_seed(0)
    with ac_diff.record(tmp_path / "w.jsonl", **WATCH):
        train(model, steps=2)
        model(torch.randn(2, 6, 16, requires_grad=True))
    watched = ac_diff.diagnose([read_run(tmp_path / "w.jsonl")])
    assert watched.status_counts() == "6 region(s): 4 clean (watched), 2 unchecked (watched, never recomputed)"


def test_a_full_from_step_the_run_never_reached_is_said_and_step_0_is_refused(tmp_path):
    torch.manual_seed(0)
    path = tmp_path / "t.jsonl"
    with ac_diff.record(path, watch=True, full_from_step=9):
        train(Net(), steps=2)
    report = ac_diff.diagnose([read_run(path)])
    assert "--full-from-step 9: the run ended in step 2, before it" in report.watch["text"]
    assert "every region recorded in full from step 9" not in report.watch["text"]
    bad = run_cli("run", "--watch", "--full-from-step", "0", "-o", str(tmp_path / "out"), "missing.py")
    assert bad.returncode == 2 and "--full-from-step must be an integer >= 1" in bad.stderr


class _Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class _Outer(nn.Module):
    """A checkpointed block with a checkpointed sub-block (torchtitan's per-layer AC around per-op AC)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner, self.lin = _Inner(), nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(checkpoint(self.inner, x, use_reentrant=False))


def test_nested_checkpoints_are_counted_as_full_recording_counts_them(tmp_path):
    """The nested checkpoint the outer recompute runs again is never recomputed itself: full recording reports it
    unchecked (nested); watch counted nothing for it (full said 9 regions, watch 6)."""
    counts = []
    for options in ({}, WATCH):
        torch.manual_seed(0)
        model, path = _Outer(), tmp_path / f"{len(options)}.jsonl"
        with ac_diff.record(path, **options):
            for _ in range(3):
                checkpoint(model, torch.randn(2, 8, requires_grad=True), use_reentrant=False).sum().backward()
        counts.append(ac_diff.diagnose([read_run(path)]).status_counts())
    assert counts == ["9 region(s): 6 clean, 3 nested rerun(s) in a recompute (nothing to compare)",
                      "9 region(s): 6 clean (watched), 3 nested rerun(s) in a recompute (nothing to compare)"], counts


def test_a_divergence_that_recurs_every_few_steps_is_caught_by_the_full_recording(tmp_path):
    """Gradient accumulation over 4 micro-batches whose loop steps the optimizer before the last micro-batch's
    backward: every 4th step diverges. Its module stays recorded in full until a full recording catches it (step 8),
    so watch reaches the cause full recording reaches (it recorded 3 steps, saw none diverge, and called it a rare
    event of unknown cause)."""
    torch.manual_seed(0)
    model, path = Net(), tmp_path / "t.jsonl"
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with ac_diff.record(path, watch=True):
        for _ in range(3):
            for micro in range(4):
                loss = model(torch.randn(2, 6, 16, requires_grad=True)).pow(2).mean()
                if micro == 3:
                    opt.step()  # (the bug: before the last micro-batch's backward)
                    opt.zero_grad()
                loss.backward()
    report = ac_diff.diagnose([read_run(path)])
    lead = min((r for r in report.regions if r.status == "diverged"), key=lambda r: r.region)
    assert lead.watched and lead.step == 4
    assert lead.cause.kind == "state_mutation" and lead.cause.mechanism == "optimizer_step", lead.cause
    assert "diverged in step 4: recorded in full in steps 5-8" in report.watch["text"], report.watch["text"]
    assert "did not recur" not in report.watch["text"]


def test_a_watched_divergence_that_did_not_recur_points_at_random_draws_seen_elsewhere():
    """Stochastic depth drawn on the host, forwards first: a watched region diverged, its module's full recording
    reproduced (the draws agreed that time), while another region recorded in full diverged on that draw. The note
    points at it (it said only "a rare event: a near-tie, a nondeterministic kernel, ...")."""
    from types import SimpleNamespace

    from ac_diff.diagnosis.watched import _link_escalations
    from ac_diff.report import Cause

    watched = SimpleNamespace(rank=0, region=51, module="blocks.0", watched=True, status="diverged", step=5, notes=[],
                              cause=Cause("unknown", None, "watch mode in step 5"), suggestions=[], path="t")
    drawn = SimpleNamespace(rank=0, region=68, module="blocks.2", watched=False, status="diverged", step=6, notes=[],
                            cause=Cause("rng", "random", "the region draws from `random`", [], "host_rng",
                                        "train.py:42 in forward"), suggestions=[], path="t", unchecked_reason=None)
    full = [SimpleNamespace(rank=0, region=60 + i, module="blocks.0", watched=False, status="clean", step=6 + i,
                            notes=[], cause=None, suggestions=[], path="t", unchecked_reason=None)
            for i in range(4)]  # its full recording
    escalated = [{"rank": 0, "module": "blocks.0", "lead": None, "full_diverged": 0, "full_clean": 4,
                  "full_regions": 4, "from_step": 6, "diverged_steps": [5]}]
    _link_escalations([watched, drawn, *full], escalated)
    assert "did not recur there" in watched.notes[0]
    assert "random draws made a region diverge (blocks.2, region 68: a host draw at train.py:42 in forward)" in \
        watched.notes[0] and watched.notes[0] in watched.cause.detail


def test_an_escalation_after_full_from_step_is_not_said_again():
    """With --full-from-step 5 every region is recorded in full from step 5: a module escalated in step 17 is not
    said to be "recorded in full from step 17 on" beside it (the text contradicted itself)."""
    from ac_diff.diagnosis.watched import _text

    summary = {"steps": 24, "compared": 12, "clean": 12, "diverged": 0, "never_compared": 0, "full_steps": 0,
               "full_from_step": 5, "all_full_from": None, "escalated": [
                   {"module": "blocks.2", "diverged_step": 17, "from_step": 17, "why": "full", "until_step": None,
                    "full_diverged": 1, "full_regions": 1, "lead": 50, "unwritten": 0}]}
    text = _text(summary)
    assert "step 17" not in text and text.endswith("every region recorded in full from step 5 (--full-from-step)")


@pytest.mark.e2e
def test_a_rank_that_raised_before_its_recompute_is_never_clean(tmp_path):
    """Rank 1 raises after its forward in step 2 (its watched forwards are never recomputed); rank 0 then stops in
    its all_reduce. The run is CRASHED on rank 1, never clean: it read CLEAN where rank 0, the first rank that
    stopped, had compared everything it ran."""
    from conftest import REPO, report_json, run_cli

    out, json_path = tmp_path / "out", tmp_path / "report.json"
    proc = run_cli("run", "--nproc-per-node", "2", "--watch", "-o", str(out), "--json", str(json_path),
                   str(REPO / "tests" / "stacks" / "rank_local_center.py"), "--center-rank", "-1", "--steps", "3", "--raise-rank", "1",
                   "--raise-step", "2", cwd=tmp_path, timeout=240)
    assert proc.returncode != 0, proc.stderr[-3000:]
    report = report_json(json_path)
    assert report["verdict"] == "unchecked" and report["title"] == "CRASHED", report["headline"]
    assert report["headline"].startswith("the script crashed on rank 1 in step 2: ZeroDivisionError"), report["headline"]
    assert report["watch"]["never_compared"] >= 1
    again = run_cli("report", "--check", str(out))
    assert again.returncode == 4, again.stdout[-2000:]


class _ScheduledScale(nn.Module):
    """Reads `scale`, which a schedule event sets between the forward and the backward now and then."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.scale = 1.0

    def forward(self, x):
        return torch.tanh(self.fc(x) * self.scale)


def test_a_divergence_that_recurs_less_often_than_the_full_recording_lasts_is_told_as_such(tmp_path):
    """A schedule event in steps 25 and 50 only: each watched divergence is followed by steps recorded in full in
    which it does not recur. Each region says so, and that it diverged again (it said the run ended before the
    module ran again, and 'did not recur (a rare event)')."""
    torch.manual_seed(0)
    block, path = _ScheduledScale(), tmp_path / "t.jsonl"
    with ac_diff.record(path, watch=True):
        for step in range(1, 53):
            out = checkpoint(block, torch.randn(4, 8, requires_grad=True), use_reentrant=False)
            if step in (25, 50):
                block.scale += 0.5  # the schedule's event, before the backward
            out.sum().backward()
    report = ac_diff.diagnose_paths([path])
    assert report.verdict == "diverged"
    watched = sorted((r for r in report.regions if r.watched and r.status == "diverged"), key=lambda r: r.step)
    assert [r.step for r in watched] == [25, 50], [(r.step, r.status) for r in report.regions if r.status != "clean"]
    first = " ".join(watched[0].notes)
    assert "recorded in full in steps 26-45: all 20 reproduced their saved tensors; it diverged again in step 50" \
        in first and "the run ended before" not in first and "rare event" not in first, first
    assert "also diverged (watched) in step 25: the steps recorded in full after each saw no divergence" \
        in report.watch["text"], report.watch["text"]


class Routed(nn.Module):
    """A router whose forward hook keeps, per step, the expert counts (no gradient could reach them) or the router
    logits themselves (a load-balancing loss's input): under reentrant AC, a side output."""

    def __init__(self, kept: list, logits: bool) -> None:
        super().__init__()
        self.router, self.expert = nn.Linear(16, 4), nn.Linear(16, 16)
        self.router.register_forward_hook(lambda m, i, out: kept.append(
            out if logits else torch.bincount(out.argmax(-1).flatten(), minlength=4).float()))

    def forward(self, x):
        return x + torch.tanh(self.expert(x)) * self.router(x).softmax(-1).amax(-1, keepdim=True)


@pytest.mark.parametrize("logits", [False, True])
def test_resampled_reentrant_regions_with_side_outputs_keep_a_small_trace(tmp_path, logits):
    """Each resample of a reentrant module whose hook keeps a tensor was written whole (1.7 MB in 300 steps of a
    clean MoE): the first forward of each module with those side outputs is kept whole (its ops say whether a
    gradient could reach them), the later ones are summaries. Router logits still put the gradients at risk."""
    torch.manual_seed(0)
    kept: list = []
    layers = nn.ModuleList(Routed(kept, logits) for _ in range(2))
    path = tmp_path / "t.jsonl"
    with ac_diff.record(path, watch=True):
        for _ in range(150):
            h = torch.randn(2, 16, requires_grad=True)
            for layer in layers:
                h = checkpoint(layer, h, use_reentrant=True)
            h.pow(2).mean().backward()
            kept.clear()
    report = ac_diff.diagnose([read_run(path)])
    types = [json.loads(line)["type"] for line in path.read_text().splitlines()]
    assert report.watch["resampled"] > 5 and types.count("ops") <= 2 * 2 * 2, types.count("ops")
    assert path.stat().st_size < 150_000, path.stat().st_size
    assert report.title == ("GRADIENTS AT RISK" if logits else "CLEAN"), report.headline


class AnnealedDropout(nn.Module):
    """A dropout whose `p` a schedule lowers between each forward and its backward, to 0 in the third step (the
    recompute then draws no mask: one tensor fewer saved, and torch raises)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.drop = nn.Linear(16, 16), nn.Dropout(0.3)

    def forward(self, x):
        return self.drop(torch.relu(self.lin(x)))


def test_torchs_error_about_a_watched_region_is_in_the_headline(tmp_path):
    """Watch mode leads with the first step's region (recorded in full, silently diverged); torch's error in a later
    step is about a watched region, counted and not written: the headline says torch raised, and about which region
    (it named only the silent divergence)."""
    torch.manual_seed(0)
    block = AnnealedDropout()
    with ac_diff.record(tmp_path / "t.jsonl", watch=True, watch_full_steps=1), \
            contextlib.suppress(torch.utils.checkpoint.CheckpointError):
        for p in (0.3, 0.2, 0.1):
            block.drop.p = p
            loss = checkpoint(block, torch.randn(4, 16), use_reentrant=False).sum()
            block.drop.p = max(0.0, p - 0.1)
            loss.backward()
    report = ac_diff.diagnose([read_run(tmp_path / "t.jsonl")])
    assert report.verdict == "diverged" and report.torch_error is not None, report.headline
    assert ("torch raised a count mismatch (CheckpointError: another number of tensors saved) about region 2, a "
            "watched region (counted, not written)") in report.headline, \
        report.headline


class _Warmup(nn.Module):
    """A warmup whose counter the forward advances and reads: full strength from its 6th call on. Under AC the
    recompute counts again, so it switches to full strength in a recompute whose forward ran at half, once."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return torch.tanh(self.fc(x) * (0.5 if self.calls < 6 else 1.0))


def test_a_watched_divergence_at_a_counters_threshold_is_explained_by_the_state_full_recording_saw_read_twice(tmp_path):
    """The first step, recorded in full, saw `calls` updated twice and read; the watched step whose recompute crossed
    the threshold diverged, and the steps recorded in full after it reproduced. The cause is that counter and its fix
    (it was 'unknown: ... a rare event: a near-tie, a nondeterministic kernel')."""
    torch.manual_seed(0)
    block, path = _Warmup(), tmp_path / "t.jsonl"
    with ac_diff.record(path, watch=True):
        for _ in range(8):
            checkpoint(block, torch.randn(4, 8, requires_grad=True), use_reentrant=False).sum().backward()
    report = ac_diff.diagnose_paths([path])
    lead = next(r for r in report.regions if r.status == "diverged")
    assert lead.watched and lead.step == 3, [(r.step, r.status) for r in report.regions]
    assert lead.cause.kind == "state_mutation" and lead.cause.tensor == "_Warmup.calls", lead.cause
    assert "rare event" not in lead.cause.detail and "region 0, recorded in full in step 1" in lead.cause.detail
    assert any("updates `_Warmup.calls` in place" in s.text for s in lead.suggestions), [s.text for s in lead.suggestions]
    assert any("threshold on `_Warmup.calls` is crossed once" in n for n in lead.notes), lead.notes
    # its own gradients are wrong: the fix it shares with region 0 does not say "this step's are right" (30c P2-b),
    # and the values the evidence quotes are region 0's
    assert not any("this step's are right" in s.text for s in lead.suggestions), [s.text for s in lead.suggestions]
    assert any("its step's gradients differ too" in s.text for s in lead.suggestions)
    assert lead.cause.evidence and all(e.startswith("in region 0: ") for e in lead.cause.evidence), lead.cause.evidence


def test_a_watched_divergence_shares_the_global_a_region_recorded_in_full_in_its_step_diverged_on():
    """A logging callback bumps a global step between the forward and the backward; both blocks read a schedule from
    it. moe.0's region, watched, diverged; moe.1's, recorded in full in the same step (resampled), names the global.
    The watched one said "unknown ... a rare event"."""
    from types import SimpleNamespace

    from ac_diff.diagnosis.watched import _link_escalations
    from ac_diff.report import Cause

    watched = SimpleNamespace(rank=0, region=4, module="moe.0", watched=True, status="diverged", step=3, notes=[],
                              cause=Cause("unknown", None, "watch mode in step 3"), suggestions=[], path="t",
                              unchecked_reason=None)
    full = SimpleNamespace(rank=0, region=5, module="moe.1", watched=False, status="diverged", step=3, notes=[],
                           cause=Cause("state_mutation", "train.GLOBAL_STEP", "the module-level global "
                                       "`train.GLOBAL_STEP` was 2 in the forward and 3 in the recompute", [], "global"),
                           suggestions=["keep it"], path="t", unchecked_reason=None)
    later = [SimpleNamespace(rank=0, region=6 + i, module="moe.0", watched=False, status="clean", step=4 + i,
                             notes=[], cause=None, suggestions=[], path="t", unchecked_reason=None) for i in range(3)]
    escalated = [{"rank": 0, "module": "moe.0", "lead": None, "full_diverged": 0, "full_clean": 3,
                  "full_regions": 3, "from_step": 4, "diverged_steps": [3]}]
    _link_escalations([watched, full, *later], escalated)
    assert watched.cause.kind == "state_mutation" and watched.cause.tensor == "train.GLOBAL_STEP", watched.cause
    assert watched.cause.detail.startswith("likely as moe.1's region 5, recorded in full in the same step, shows")
    assert watched.suggestions == ["keep it"]


def test_steps_counted_after_an_escalation_are_kept_as_ranges():
    """A divergence every 10th step reads as such ("21-23, 30, 40-41"), and a run of thousands keeps a bounded list."""
    ranges: list = []
    for step in (21, 22, 22, 23, 30, 40, 41):  # (several regions a step)
        watch._add_step(ranges, step)
    assert ranges == [[21, 23], [30, 30], [40, 41]]
    for step in range(100, 10_000, 2):
        watch._add_step(ranges, step)
    assert len(ranges) == watch._MAX_STEP_RANGES


class _StoppedInItsRecompute(nn.Module):
    """Ctrl-C lands as the fourth call runs: the recompute of step 2 (forward, recompute, forward, recompute)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.calls = nn.Linear(8, 8), nn.Linear(8, 8), 0

    def forward(self, x):
        import os
        import signal

        self.calls += 1
        h = torch.tanh(self.fc1(x))
        if self.calls == 4:
            os.kill(os.getpid(), signal.SIGINT)  # (Python raises KeyboardInterrupt at its next instruction)
        return torch.tanh(self.fc2(h))


def test_a_recompute_the_run_was_interrupted_in_is_not_counted_as_diverged(tmp_path):
    """A watched control stopped by Ctrl-C in a recompute: its watch totals said "1 diverged ... run again with
    --full-from-step 2", a divergence there was not; what it saved until then matches: never compared."""
    torch.manual_seed(0)
    block = _StoppedInItsRecompute()
    with pytest.raises(KeyboardInterrupt):
        with ac_diff.record(tmp_path / "t.jsonl", watch=True, watch_full_steps=0):
            for _ in range(3):
                checkpoint(block, torch.randn(4, 8, requires_grad=True), use_reentrant=False).sum().backward()
    report = ac_diff.diagnose_paths([tmp_path / "t.jsonl"])
    assert report.watch is not None and report.watch["diverged"] == 0, report.watch
    assert not any(r.status == "diverged" for r in report.regions), report.headline
    assert "--full-from-step" not in report.headline, report.headline


class _Tempered(nn.Module):
    """A temperature the loop anneals between each forward and its backward; in the first step it scales what the
    block returns (saved), later only a range check nothing saved depends on."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.temperature, self.scaled = nn.Linear(8, 8), 1.0, True

    def forward(self, x):
        h = self.fc(x)
        if self.scaled:
            return torch.tanh(h / self.temperature)
        with torch.no_grad():  # (a range check: the same answer whatever the temperature, nothing saved for it)
            in_range = (h / self.temperature).amax() > -1e9
        return torch.tanh(h) * in_range


def test_a_watched_divergence_is_named_by_the_change_its_full_recording_saw_absorbed(tmp_path):
    """Watch saw step 1 diverge (no ops: cause unknown); step 2, recorded in full, reproduced its saved tensors though
    the temperature changed between its passes there too. It said "did not recur there (a rare event ...)"; the
    change the full recording saw names the watched divergence now, with its fix."""
    torch.manual_seed(0)
    blocks = nn.ModuleList([_Tempered()])
    with ac_diff.record(tmp_path / "t.jsonl", watch=True, watch_full_steps=0):
        for step in range(3):
            blocks[0].scaled = step == 0
            y = checkpoint(blocks[0], torch.randn(4, 8, requires_grad=True), use_reentrant=False)
            blocks[0].temperature *= 0.9  # (annealed before the backward: the bug)
            y.sum().backward()
    report = ac_diff.diagnose_paths([tmp_path / "t.jsonl"])
    lead = report.lead_groups()[0][0]
    assert lead.watched and lead.step == 1 and lead.cause.tensor == "blocks.0.temperature", lead.cause
    assert "there it reached no saved tensor" in lead.cause.detail, lead.cause.detail
    assert "did not recur" not in " ".join(lead.notes), lead.notes


_LATE_THRESHOLD = """
import torch
from torch.utils.checkpoint import checkpoint
torch.manual_seed(0)
class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.calls = torch.nn.Linear(16, 16), 0
    def forward(self, x):
        self.calls += 1
        h = torch.tanh(self.fc(x))
        if self.calls > 9:  # a warm-up ends: with AC the recompute counts too, so it ends at step 6, not 10
            h = h * 0.5
        return x + h
blocks = torch.nn.ModuleList(Block() for _ in range(2))
opt = torch.optim.SGD(blocks.parameters(), lr=0.01)
for step in range(8):
    h = torch.randn(4, 16)
    for b in blocks:
        h = checkpoint(b, h, use_reentrant=False)
    h.square().mean().backward()
    opt.step()
    opt.zero_grad()
"""


def test_watch_counts_every_step_it_watched_as_a_backward_the_reference_must_reach(tmp_path):
    """A counter read past a threshold (25f): the regions watch summarizes have no report, so "every backward this
    run made" read 1 (the first step's regions), the headline advised `--reference-steps 3`, and that reference
    (identical over 3 of 8 backwards; they differ from backward 6) turned the run CLEAN. The watched steps count."""
    script = tmp_path / "late_threshold.py"
    script.write_text(_LATE_THRESHOLD)
    plain = run_cli("run", "--watch", "-o", str(tmp_path / "w"), "--json", str(tmp_path / "w.json"), str(script))
    assert plain.returncode == 0, plain.stderr
    doc = json.loads((tmp_path / "w.json").read_text())
    assert doc["verdict"] == "unchecked" and "--reference-steps 8`" in doc["headline"], doc["headline"]
    short = run_cli("run", "--watch", "--reference", "no-ac", "--reference-steps", "3", "-o", str(tmp_path / "r"),
                    "--json", str(tmp_path / "r.json"), str(script))
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["reference"]["verdict"] == "identical" and doc["verdict"] != "clean", doc["headline"]
    notes = [n for r in doc["regions"] for n in r["notes"]]
    assert any("over 3 of the 8 backward passes" in n and "--reference-steps 8" in n for n in notes), notes
    full = run_cli("run", "--watch", "--reference", "no-ac", "--reference-steps", "8", "-o", str(tmp_path / "f"),
                   "--json", str(tmp_path / "f.json"), str(script))
    doc = json.loads((tmp_path / "f.json").read_text())
    assert doc["reference"]["verdict"] == "differs" and doc["verdict"] == "diverged", doc["reference"]["headline"]
    assert short.returncode == full.returncode == 0


class _Centered(nn.Module):
    """Subtracts a running center, a buffer a schedule refreshes at some steps between the forward and the backward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.register_buffer("center", torch.zeros(16))

    def forward(self, x):
        return torch.tanh(self.fc(x - self.center))


def test_a_watched_divergence_its_window_missed_takes_the_cause_a_later_full_recording_found(tmp_path):
    """The buffer is refreshed before the backward in steps 2, 25 and 26 (25f's router warm-up): step 2 diverges
    watched, its module's 20 steps recorded in full see nothing, step 25 diverges watched and step 26 in full, which
    names `center`. The lead (step 2) read "unknown" while the same report named the cause for its module."""
    torch.manual_seed(0)
    block, path = _Centered(), tmp_path / "t.jsonl"
    with ac_diff.record(path, watch=True):
        for step in range(1, 30):
            out = checkpoint(block, torch.randn(4, 16), use_reentrant=False)
            if step in (2, 25, 26):
                block.center += 0.1  # (the refresh, before the backward)
            out.sum().backward()
    report = ac_diff.diagnose_paths([path])
    lead = min((r for r in report.regions if r.status == "diverged"), key=lambda r: r.step)
    assert lead.watched and lead.step == 2
    assert lead.cause.kind == "state_mutation" and lead.cause.tensor == "center", lead.cause
    assert lead.cause.detail.startswith("likely as _Centered's region"), lead.cause.detail
    assert "recorded in full in step 26 when it diverged again" in lead.cause.detail


def test_an_escalation_made_to_learn_a_modules_mask_and_confirmed_ends_as_any_other():
    """A model rebuilt mid-run (a resume from a checkpoint): its modules were never recorded in full, so the first
    watched divergence escalated them provisionally, to learn which saved positions carry no values, and the next
    full recording confirmed it. The escalation then never ended (27i: every step to the end recorded in full, a 32
    MB trace for a 0.4 MB one), and no escalate record said so."""
    from ac_diff.capture import watch

    written = []
    w = watch.Watch(write=written.append, region_record=None)
    w.escalated["blocks.0"] = {"diverged_step": 1000, "region": 7, "from_step": None, "provisional": True}
    assert w.full("blocks.0", 1001)  # (recorded in full to learn the mask)
    w.escalated["blocks.0"]["confirmed"] = True  # (as _judge confirms it once its held comparison diverged)
    full = [w.full("blocks.0", step) for step in range(1002, 1040)]
    assert all(full[:watch.ESCALATION_STEPS - 1]) and not any(full[watch.ESCALATION_STEPS:]), full


def test_an_escalated_modules_regions_at_risk_count_as_reproduced_in_the_summary(tmp_path):
    """29b: after the step whose forward and recompute took either branch, the module's regions recorded in full
    reproduced their forwards (at risk: they read the count their recompute updates again). The summary said "none of
    its 4 region(s) was compared (never recomputed, or the recompute stopped early)", a crash that did not happen."""
    torch.manual_seed(0)
    block, path = _Warmup(), tmp_path / "w.jsonl"
    with ac_diff.record(path, **WATCH):
        for _ in range(8):
            checkpoint(block, torch.randn(2, 8, requires_grad=True), use_reentrant=False).sum().backward()
    report = ac_diff.diagnose([read_run(path)])
    assert report.verdict == "diverged", report.headline
    (e,) = report.watch["escalated"]
    assert e["diverged_step"] == 3 and e["full_regions"] == e["full_clean"] == e["full_at_risk"] > 0, e
    assert "was compared" not in report.watch["text"] and "reproduced their saved tensors (" in report.watch["text"]


def test_a_saved_tensor_the_recorder_failed_to_hold_is_no_divergence(tmp_path, monkeypatch):
    """31b: a recorder error in the pack hook of a watched recompute (torch 2.6: Dynamo compiling watch's `hold`) lost
    one saved position; the recompute then held one tensor fewer than its forward, and the region read DIVERGED
    ("saved other tensors"). What the recorder lost is not compared: the run is never clean, never diverged."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    real, calls = watch.WatchedPass.hold, []

    def fails_once_in_step_2(self, position, tensor, name, origin=None):
        calls.append(position)
        if len(calls) == 2:  # (the forward of step 2, the first watched one)
            raise RuntimeError("Cannot call numel() on tensor with symbolic sizes/strides")
        return real(self, position, tensor, name, origin)

    monkeypatch.setattr(watch.WatchedPass, "hold", fails_once_in_step_2)
    path = tmp_path / "t.jsonl"
    with ac_diff.record(path, watch=True):
        for _ in range(3):
            checkpoint(block, torch.randn(4, 8, requires_grad=True), use_reentrant=False).sum().backward()
    report = ac_diff.diagnose_paths([path])
    assert len(calls) > 10 and report.verdict == "unchecked", (calls, report.verdict, report.headline)
    assert not any(r.status == "diverged" for r in report.regions)


_INTERRUPTED_IN_A_RECOMPUTE = '''
import os, signal, torch, torch.nn as nn
from torch.utils.checkpoint import checkpoint
torch.manual_seed(0)
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("bias", torch.zeros(8))
    def forward(self, x):
        global CALLS
        CALLS += 1
        if STEP == 12 and CALLS == 2:  # (Ctrl-C lands in the recompute of step 12's backward)
            os.kill(os.getpid(), signal.SIGINT)
        return x + torch.tanh(self.fc(x) + self.bias)
block = Block()
for step in range(1, 30):
    STEP, CALLS = step, 0
    loss = checkpoint(block, torch.randn(4, 8), use_reentrant=False).square().mean()
    with torch.no_grad():
        block.bias += 0.01  # (between the forward and the backward: every recompute differs)
    loss.backward()
'''


def test_an_interrupt_in_a_later_recompute_is_not_put_on_the_steps_recorded_in_full(tmp_path):
    """35d P2-1: watch records step 2 in full after the divergence of step 1; a Ctrl-C in step 12's recompute was put
    on step 2's regions ("the backward raised after its recompute: KeyboardInterrupt", no longer silent) and the
    report never said the run was interrupted in step 12. The exception record names its step."""
    (tmp_path / "train.py").write_text(_INTERRUPTED_IN_A_RECOMPUTE)
    proc = run_cli("run", "--watch", "-o", str(tmp_path / "out"), "--json", str(tmp_path / "r.json"),
                   str(tmp_path / "train.py"), cwd=tmp_path)
    assert proc.returncode == 130, proc.stderr[-2000:]
    report = json.loads((tmp_path / "r.json").read_text())
    diverged = [r for r in report["regions"] if r["status"] == "diverged"]
    assert diverged and not any(r["backward_raised"] for r in diverged), [r["backward_raised"] for r in diverged]
    assert all(r["silent"] for r in diverged)
    assert "interrupted: KeyboardInterrupt (its last region ran in step 12" in " ".join(proc.stdout.split()), \
        proc.stdout[-3000:]


class _Annealed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.temperature = nn.Linear(8, 8), 1.0

    def forward(self, x):
        return x + torch.tanh(self.fc(x) / self.temperature)


def test_a_divergence_rarer_than_the_full_window_is_caught_where_its_period_predicts(tmp_path):
    """35d P2-3: a schedule changes `temperature` between the forward and the backward every 25 steps; each watched
    divergence recorded the module in full for the next 20 steps, which never reached the next one, again and again:
    most of the run was recorded in full. After a window that missed, the next lasts through the step the gap between
    the divergences predicts: it catches the divergence (the first divergent op and the cause), and then stops."""
    from ac_diff.capture.watch import ESCALATION_STEPS

    torch.manual_seed(0)
    layer, period = _Annealed(), ESCALATION_STEPS + 5
    path = tmp_path / "t.jsonl"
    with ac_diff.record(path, **WATCH):
        for step in range(1, 4 * period + 1):
            loss = checkpoint(layer, torch.randn(4, 8), use_reentrant=False).square().mean()
            if step % period == 0:
                layer.temperature *= 0.9  # (the schedule steps before the backward)
            loss.backward()
    run = read_run(path)
    full = [r for r in run.regions if r.recorded and not r.watched]
    assert len(full) <= 2 * ESCALATION_STEPS + 7, len(full)  # (26-45, then 51-76 until it diverged in 75)
    report = ac_diff.diagnose([run])
    caught = [r for r in report.regions if r.status == "diverged" and not r.watched]
    assert [r.step for r in caught] == [3 * period], [(r.region, r.step) for r in caught]
    assert caught[0].cause.tensor.endswith("temperature"), caught[0].cause


def test_a_divergence_before_the_step_its_gap_predicted_is_recorded_in_full_next(tmp_path):
    """36b P2-1: after a miss, a divergence 65 steps after the first waits for the step the gap predicts (around 125);
    it diverged again in steps 100 and 101, and the report said the run "ended before it ran again". A divergence
    while waiting records the module in full from the next step: step 101 shows the cause."""
    torch.manual_seed(0)
    layer = _Annealed()
    path = tmp_path / "t.jsonl"
    with ac_diff.record(path, **WATCH):
        for step in range(1, 111):
            loss = checkpoint(layer, torch.randn(4, 8), use_reentrant=False).square().mean()
            if step in (5, 70, 100, 101):
                layer.temperature *= 0.9  # (a schedule stepped before the backward, irregularly)
            loss.backward()
    report = ac_diff.diagnose([read_run(path)])
    caught = [r for r in report.regions if r.status == "diverged" and not r.watched]
    assert [r.step for r in caught] == [101], [(r.region, r.step) for r in caught]
    assert caught[0].cause.tensor.endswith("temperature"), caught[0].cause
