"""A recompute that draws other numbers is a divergence unless those provably reach no saved tensor and nothing
that outlives the region: saved tensors are compared by value (each saved position's fingerprint, taken as torch
packs it), whatever the ops before them measured.

The mechanism (tests/stacks/stochastic_rounding.py): a custom autograd.Function rounds activations stochastically
with a private generator seeded from a class-level call counter. Its noise reaches the tensor the next linear saves
only through ops that are not fingerprinted (a bit-level add and mask, `view.dtype`, `detach`, `view`), and torch's
early stop ends the recompute before anything measured reads it. Before saved tensors were fingerprinted, the
taint through those ops was lost at the `detach` and ac-diff said "clean: all 6 recomputed region(s) reproduced
their saved tensors exactly"; `--reference no-ac` then called the differing gradients "unexplained: the recompute
matched the forward".
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint as cp

import ac_diff
from ac_diff.capture import recorder as recorder_module
from ac_diff.diagnosis.passdiff import compare_passes
from ac_diff.diagnosis.region import diagnose_region
from ac_diff.report import STATE_READ_AGAIN
from ac_diff.trace import read_run
from conftest import run_cli
from stacks.runs import STACKS

sys.path.insert(0, str(STACKS))  # the scripts import their shared loop and model
import stochastic_rounding  # noqa: E402


def _record(tmp_path, fn, **options) -> tuple:
    path = tmp_path / "trace-rank0.jsonl"
    with ac_diff.record(path, write="all", **options):
        fn()
    return read_run(path), ac_diff.diagnose_paths([path])


@pytest.mark.parametrize("derived", [False, True], ids=["default", "fingerprint_derived"])
def test_stochastic_rounding_with_a_counter_seeded_generator_diverges(tmp_path, derived):
    run, report = _record(tmp_path, lambda: stochastic_rounding.main(["--steps", "1"]), fingerprint_derived=derived)
    assert report.verdict == "diverged", report.headline
    assert [r.status for r in report.regions] == ["diverged"] * 3
    region = report.regions[0]
    assert (region.cause.kind, region.cause.mechanism) == ("rng", "private_generator"), region.cause
    assert "aten.randint.low_generator" in region.cause.detail and "torch.Generator" in region.cause.tensor
    # the evidence is the saved tensor itself: the one `down` saves, made by ops nobody fingerprinted
    differ = [p for p in region.positions if p.values_differ]
    assert [p.op for p in differ] == ["aten.view.default"], region.positions
    fwd, rec = run.regions[0].forward, run.regions[0].recompute
    saved = next(p for p in fwd.positions if p.position == differ[0].position)
    assert fwd.ops[saved.op_index].fingerprint is None
    assert saved.fingerprint != next(p for p in rec.positions if p.position == saved.position).fingerprint
    assert rec.stopped_early and not any(o.op == "aten.addmm.default" and o.module == "layers.0.down" for o in rec.ops)


def test_a_detach_the_alignment_skips_passes_the_difference_on(tmp_path):
    """Without saved-tensor fingerprints (a trace before them), the inference that a saved tensor differs follows
    the dataflow through `x.detach()`, which alignment drops as a hook-only copy."""
    run, _ = _record(tmp_path, lambda: stochastic_rounding.main(["--steps", "1"]))
    region = run.regions[0]
    for p in (region.forward, region.recompute):
        for pos in p.positions:
            pos.fingerprint = None
    cmp = compare_passes(region.forward, region.recompute)
    view = next(o for o in region.forward.ops if o.op == "aten.view.default")
    assert cmp.tainted[view.index]
    assert diagnose_region(region).status == "diverged"


class _Noisy(nn.Module):
    """Private-generator noise: added to what the region returns ("returned"), to a tensor its module keeps
    ("kept": the recompute's replaces the forward's), or drawn and dropped ("dropped")."""

    def __init__(self, noise: str) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.gen = torch.Generator().manual_seed(0)
        self.noise = noise
        self.last = None

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        noise = torch.randn(h.shape, generator=self.gen)
        if self.noise == "kept":
            self.last = h + 0.01 * noise  # (read by the loop after the backward: the recompute's by then)
        return h + 0.01 * noise if self.noise == "returned" else h


def _noisy_step(noise: str):
    def step():
        torch.manual_seed(0)
        model, x = _Noisy(noise), torch.randn(4, 8, requires_grad=True)
        with cp.set_checkpoint_early_stop(False):  # the recompute runs the whole region
            y = cp.checkpoint(model, x, use_reentrant=False)
        y.sum().backward()
    return step


def test_other_values_kept_beyond_the_region_are_a_divergence(tmp_path):
    """Every saved tensor matches, but the tensor the module keeps differs in the recompute, which replaces the
    forward's: not "harmless"."""
    run, report = _record(tmp_path, _noisy_step("kept"))
    region = report.regions[0]
    assert region.status == "diverged" and region.cause.mechanism == "private_generator"
    assert not any(p.values_differ for p in region.positions)
    assert any("outlived the region" in n for n in region.notes), region.notes
    fwd = run.regions[0].forward
    assert [fwd.ops[i].op for i, _ in fwd.outputs] == ["aten.tanh.default", "aten.add.Tensor"]  # returned, kept
    assert [h[2] for h in fwd.state["held_outputs"]] == ["last"]


@pytest.mark.parametrize("noise", ["returned", "dropped"])
def test_other_values_that_reach_no_saved_or_kept_tensor_stay_harmless(tmp_path, noise):
    """What a non-reentrant region returns outlives its forward only: torch drops the recompute's (the gradients of
    the step are the same); noise drawn and dropped reaches nothing. Yet the recompute drew from the private
    generator again, which checkpoint does not restore: later draws differ from a run without AC (31f), so the
    region is at risk, not clean."""
    _, report = _record(tmp_path, _noisy_step(noise))
    region = report.regions[0]
    assert (region.status, region.unchecked_reason) == ("unchecked", STATE_READ_AGAIN), region.notes
    assert region.cause.mechanism == "private_generator", region.cause
    assert any("harmless for the gradients" in n for n in region.notes)


class _Counting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)
        return torch.tanh(self.fc(x))


def test_a_buffer_the_region_updates_in_place_outlives_it_as_a_side_effect(tmp_path):
    """The recompute's second update of state the region reads is reported as counted twice, not as a divergence."""
    def step():
        with cp.set_checkpoint_early_stop(False):
            y = cp.checkpoint(_Counting(), torch.randn(4, 8, requires_grad=True), use_reentrant=False)
        y.sum().backward()

    run, report = _record(tmp_path, step)
    region = report.regions[0]
    assert region.status == "clean" and any("calls" in s for s in region.side_effects), region
    fwd = run.regions[0].forward
    assert [fwd.ops[i].op for i, _ in fwd.outputs] == ["aten.tanh.default"]


def test_saved_tensors_already_measured_cost_no_second_fingerprint(tmp_path, monkeypatch):
    """Linear -> GELU -> Linear saves the input, `w.t()` twice (views of parameters), the first linear's output and
    the GELU's output: only the GELU's (an elementwise op of measured inputs, not fingerprinted) is reduced again."""
    fresh = []
    saved_values = recorder_module.Recorder._saved_values

    def counting(self, p, tensor, ref):
        before = len(p.batch)
        values = saved_values(self, p, tensor, ref)
        fresh.append(len(p.batch) > before)
        return values

    monkeypatch.setattr(recorder_module.Recorder, "_saved_values", counting)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))

    def step():
        cp.checkpoint(model, torch.randn(4, 8, requires_grad=True), use_reentrant=False).sum().backward()

    run, report = _record(tmp_path, step)
    assert report.verdict == "clean"
    assert len(fresh) == 10 and sum(fresh) == 2  # 5 positions per pass, one fresh fingerprint in each
    fwd = run.regions[0].forward
    assert all(p.fingerprint is not None for p in fwd.positions)
    gelu = next(p for p in fwd.positions if p.op_index is not None and fwd.ops[p.op_index].op == "aten.gelu.default")
    assert fwd.ops[gelu.op_index].fingerprint is None  # derived: only the saved tensor was measured


@pytest.mark.e2e
def test_reference_explains_the_gradients_by_the_diverged_regions(tmp_path):
    out, json_path = tmp_path / "out", tmp_path / "report.json"
    proc = run_cli("run", "--reference", "no-ac", "-o", str(out), "--json", str(json_path),
                   str(STACKS / "stochastic_rounding.py"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(json_path.read_text())
    assert report["verdict"] == "diverged" and report["reference"]["verdict"] == "differs"
    kinds = {e["kind"] for e in report["reference"]["explanations"]}
    assert kinds == {"recompute_divergence"}, report["reference"]["explanations"]
    assert "unexplained" not in report["reference"]["headline"]


class Rotary(nn.Module):
    """Rotary cos/sin cached on the module and rebuilt when a longer sequence comes (`max_len`: built that long)."""

    def __init__(self, d: int, max_len: int = 0) -> None:
        super().__init__()
        self.d, self.max_len, self.cached, self.cos = d, max_len, 0, None

    def forward(self, x):
        T = x.shape[1]
        if T > self.cached:
            inv = 1.0 / (10000 ** (torch.arange(0, self.d, 2).float() / self.d))
            self.cached = max(T, self.max_len)
            self.cos = torch.outer(torch.arange(self.cached).float(), inv).cos()
        c = self.cos[:T]
        return torch.cat((x[..., ::2] * c, x[..., 1::2] * c), -1)


@pytest.mark.parametrize("max_len", [0, 12], ids=["as_long_as_needed", "longest_first"])
def test_a_cache_a_later_micro_batch_rebuilt_longer_is_sliced_alike(tmp_path, max_len):
    """Micro-batches of 6 then 12 tokens forwarded before one backward: the second rebuilds the rotary cache longer
    (or, built to the longest at once, keeps it), and the first's recompute slices the rebuilt one, skipping the
    ops that built it. Its saved slices hold the same values: clean (the skipped ops saved nothing). Was "8 saved
    positions hold other values" where the forward's slice was of a cache exactly as long, fingerprinted as its
    base, and the recompute's a part of a longer one, fingerprinted by its own values."""
    torch.manual_seed(0)
    proj, rope = nn.Linear(16, 16), Rotary(16, max_len)

    def block(x):
        return rope(proj(x)).square()

    def train():
        loss = sum(cp.checkpoint(block, torch.randn(2, T, 16), use_reentrant=False).mean() for T in (6, 12))
        loss.backward()

    run, report = _record(tmp_path, train)
    assert report.verdict == "clean", report.headline
    assert not any(p.values_differ for r in report.regions for p in r.positions)


class _Predicts(nn.Module):
    """Returns its hidden state and a class prediction made under no_grad from a prior the loop updates between the
    forward and the backward (`into_output`: the prior also scales the hidden state it returns, through a matmul or
    through an elementwise op, which the recorder does not fingerprint as it runs)."""

    def __init__(self, into_output: str) -> None:
        super().__init__()
        self.f, self.cls = nn.Linear(16, 16), nn.Linear(16, 6)
        self.register_buffer("prior", torch.zeros(6))
        self.into_output = into_output
        self.offset = 0.0  # (a Python float a schedule moves, as the prior)

    def forward(self, x):
        h = torch.tanh(self.f(x))
        with torch.no_grad():
            pred = (self.cls(h) + self.prior).argmax(-1)
        if self.into_output == "matmul":
            return (x + h) @ (torch.eye(16) * (1 + self.prior.sum())), pred
        if self.into_output == "shift":  # (a sub's gradient reads no value: the output moves, no gradient does)
            return x + h - self.prior.sum(), pred
        if self.into_output == "scalar_shift":  # (nor an add's of the scalar it adds)
            return x + h + self.offset, pred
        return (x + h) * (1 + self.prior.sum() if self.into_output == "elementwise" else 1), pred


def _reentrant_steps(path, into_output: str, ac: bool) -> list:
    torch.manual_seed(0)
    block, grads = _Predicts(into_output), []
    for _ in range(2):
        x = torch.randn(32, 16, requires_grad=True)
        h, pred = cp.checkpoint(block, x, use_reentrant=True) if ac else block(x)
        with torch.no_grad():
            block.prior += torch.bincount(pred, minlength=6).float() / 32 - 1 / 6  # (flips argmaxes)
            block.offset += 0.01
        h.square().sum().backward()
        grads.append([x.grad.clone(), *(q.grad.clone() for q in block.f.parameters())])
        block.zero_grad()
    return grads


@pytest.mark.parametrize("into_output", ["", "matmul", "elementwise", "shift", "scalar_shift"])
def test_a_reentrant_regions_output_that_gets_no_gradient_is_no_divergence(tmp_path, into_output):
    """30a: a reentrant region's backward runs on the graph its recompute builds, from the outputs that require grad.
    A prediction it returns under no_grad (an argmax of a prior the loop moved) differs in the recompute and reaches
    nothing the backward reads: the gradients are bit-identical, and it read SILENTLY DIVERGED. Where the prior also
    reaches the returned hidden state, it is a divergence; through an elementwise op too, which read CLEAN: the
    outputs a reentrant pass returns are measured, not inferred. 31a: where it reaches the hidden state only through a
    sub (`x + h - shift`), no gradient formula reads the value that moved: bit-identical gradients, and it read
    SILENTLY DIVERGED."""
    path = tmp_path / "trace-rank0.jsonl"
    with ac_diff.record(path, write="all"):
        recorded = _reentrant_steps(path, into_output, True)
    same = all(torch.equal(a, b) for s, t in zip(recorded, _reentrant_steps(None, into_output, False))
               for a, b in zip(s, t))
    moves_gradients = into_output in ("matmul", "elementwise")
    assert same is not moves_gradients  # (the truth)
    report = ac_diff.diagnose_paths([path])
    assert report.verdict == ("diverged" if moves_gradients else "clean"), report.headline
    if into_output in ("shift", "scalar_shift"):  # (34c: `+ self.shift`, a Python float, read SILENTLY DIVERGED)
        assert "in 2 of them the recompute computed other values, which no gradient reads" in report.headline, \
            report.headline
        assert "buffer `prior` changed" in report.regions[0].notes[0], report.regions[0].notes


def test_watch_says_a_reentrant_region_returned_other_outputs(tmp_path):
    """A watched reentrant region is compared by what it returns (its forward saves nothing): where its full
    recording in the first step differed so, the watch summary said it "saved other tensors"."""
    path = tmp_path / "trace-rank0.jsonl"
    with ac_diff.record(path, watch=True):
        _reentrant_steps(path, "shift", True)
    report = ac_diff.diagnose_paths([path])
    assert report.verdict == "clean", report.headline
    assert "(recorded in full) returned other outputs than its forward" in report.watch["text"], report.watch["text"]
    assert "saved other tensors" not in report.watch["text"]


class _Indexed(nn.Module):
    """A reentrant block whose output moves with a shift buffer the loop updates between the forward and the backward,
    then is picked by an index (or a condition) that does not move, or by a top-k of the shifted scores."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.f = nn.Linear(16, 16)
        self.register_buffer("shift", torch.zeros(16))
        self.mode = mode

    def forward(self, x):
        h = self.f(x) + self.shift
        if self.mode == "gather_fixed":  # (the index comes from the input, which did not move)
            return h.gather(1, x.abs().argsort(1)[:, :4])
        if self.mode == "where_fixed":
            return torch.where(x > 0, h, -h)
        k = h.topk(4, dim=1)  # held: a uniform shift keeps every choice; flips: a shift per feature does not
        return self.f(x).gather(1, k.indices)


def _indexed_steps(mode: str, ac: bool) -> list:
    torch.manual_seed(0)
    block, grads = _Indexed(mode), []
    for _ in range(2):
        x = torch.randn(32, 16, requires_grad=True)
        out = cp.checkpoint(block, x, use_reentrant=True) if ac else block(x)
        with torch.no_grad():
            block.shift += 0.5 if mode == "topk_held" else torch.linspace(-2, 2, 16)
        out.square().sum().backward()
        grads.append([x.grad.clone(), *(q.grad.clone() for q in block.parameters())])
        block.zero_grad()
    return grads


@pytest.mark.parametrize("mode", ["gather_fixed", "where_fixed", "topk_held", "topk_flips"])
def test_values_picked_by_an_index_that_did_not_move_reach_no_gradient(tmp_path, mode):
    """34a: reentrant regions whose shifted values only a gather, a where or a top-k read read SILENTLY DIVERGED over
    bit-identical gradients: an index (a condition, a top-k's choices) was taken as moved whenever any input of its
    op differed. It counts where the index itself differs (the top-k that flips)."""
    path = tmp_path / "trace-rank0.jsonl"
    with ac_diff.record(path, write="all"):
        recorded = _indexed_steps(mode, True)
    same = all(torch.equal(a, b) for s, t in zip(recorded, _indexed_steps(mode, False)) for a, b in zip(s, t))
    assert same is (mode != "topk_flips")  # (the truth)
    report = ac_diff.diagnose_paths([path])
    assert report.verdict == ("diverged" if mode == "topk_flips" else "clean"), report.headline
