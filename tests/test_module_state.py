"""State around a region: batch norm in training updates its running statistics in the forward and
again in the recompute (a side effect, not a divergence: the gradients are exact); `model.eval()`
between forward and backward changes what batch norm does in the recompute (a cause with its own fix);
a buffer changed upstream of a decision gets no "save the decision" fix when it also shifts saved
values directly; a buffer updated then read inside the region, a Python number changed before the
backward, a bias nudge that flips no choice (clean), a run that stops before the recompute, and a rotary cache that a
longer micro-batch grows before the backward (clean: the rows the region read are the same; rescaled, as a dynamic-NTK
rotary does, diverged)."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint as cp

import ac_diff
from ac_diff.trace import read_run


class BNBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.bn = nn.BatchNorm1d(16)

    def forward(self, x):
        return torch.relu(self.bn(self.lin(x))) + x


def _bn_run(path, eval_before_backward: bool):
    torch.manual_seed(0)
    block = BNBlock()
    grads = []
    with ac_diff.record(path):
        for _ in range(2):
            block.train()
            x = torch.randn(8, 16, requires_grad=True)
            loss = cp.checkpoint(block, x, use_reentrant=False).pow(2).mean()
            if eval_before_backward:
                block.eval()
            try:
                loss.backward()
            except cp.CheckpointError:  # eval mode saves [0]-shaped statistics: torch sees other metadata
                pass
            grads.append(block.lin.weight.grad.clone() if block.lin.weight.grad is not None else None)
    return ac_diff.diagnose([read_run(path)])


def test_batch_norm_statistics_updated_again_in_the_recompute_are_a_side_effect(tmp_path):
    report = _bn_run(tmp_path / "t.jsonl", eval_before_backward=False)
    assert report.verdict == "clean" and [r.status for r in report.regions] == ["clean", "clean"]
    region = report.regions[0]
    assert region.cause is None and not any(p.values_differ for p in region.positions)
    effects = " ".join(region.side_effects)
    assert "bn.running_mean" in effects and "bn.running_var" in effects and "bn.num_batches_tracked" in effects
    # what that costs and the fix: the statistics end each step other than without AC; saving the batch norm op
    # keeps the recompute from running it again (a clean report said nothing more, and `fix` "nothing to fix")
    assert "so they end each step other than a run without AC leaves them" in report.headline, report.headline
    # whether the training reads them (a balancing update from counts does) is for a comparison over two steps to tell
    # (26g: a clean headline left it at the note); one that found every gradient identical says so instead
    from ac_diff.diagnosis import REPEATED_ASK
    from ac_diff.reference.explain import attach
    from ac_diff.reference.result import IDENTICAL, ReferenceResult, StepComparison

    assert REPEATED_ASK.format(n=2) in report.headline, report.headline
    attach(report, ReferenceResult("no-ac", IDENTICAL, "gradients identical", 2,
                                   steps=[StepComparison(i, True, 0.0, 2, 2) for i in range(2)]))
    assert report.headline.endswith("(the gradients match the run without AC over 2 backward passes)"), \
        report.headline
    (fix,) = region.suggestions
    assert fix.title.startswith("Save aten.native_batch_norm.default with selective activation checkpointing, so "
                                "the recompute does not update `bn.running_mean`, `bn.running_var` again"), fix.title
    assert "torch.ops.aten.native_batch_norm.default," in fix.code and "`bn.num_batches_tracked`" in fix.text
    from ac_diff.fix.candidates import candidates

    (save,) = candidates(report)
    assert save.spec.must_save == ["aten.native_batch_norm.default"] and save.spec.must_save_modules == ["bn"]
    assert save.repeats == {"bn.running_mean", "bn.running_var"}  # (the counter's add_ cannot be saved)


def test_a_cumulative_batch_norm_reads_the_counter_its_recompute_advances_again(tmp_path):
    """BatchNorm(momentum=None) averages its statistics with the factor 1 / num_batches_tracked, a Python float read
    from the counter the recompute advances a second time (26a, 26h): the statistics end each step other than without
    AC even where the batch norm op is saved, and `fix` called saving it "verified". The counter reaches only the
    batch norm's own state update (its momentum argument, another one in the recompute): the gradients never change
    (clean, 27f: GRADIENTS AT RISK misled), the counter is named, and `fix` holds a try to it."""

    def train(ac: bool, path=None):
        torch.manual_seed(0)
        block = BNBlock()
        block.bn.momentum = None
        grads = []
        with ac_diff.record(path) if path else contextlib.nullcontext():
            for _ in range(3):
                x = torch.randn(8, 16, requires_grad=True)
                (cp.checkpoint(block, x, use_reentrant=False) if ac else block(x)).pow(2).mean().backward()
                grads.append(block.lin.weight.grad.clone())
                block.zero_grad()
        return grads, block.bn.running_mean.clone()

    (with_ac, mean_ac), (without, mean) = train(True), train(False)
    assert all(torch.equal(a, b) for a, b in zip(with_ac, without)) and not torch.equal(mean_ac, mean)  # (the truth)
    train(True, tmp_path / "t.jsonl")
    report = ac_diff.diagnose([read_run(tmp_path / "t.jsonl")])
    assert report.verdict == "clean", report.headline
    region = report.regions[1]
    assert region.read_into == ["bn.num_batches_tracked"], region.read_into
    assert any(e.startswith("bn.num_batches_tracked is read as a number that aten.native_batch_norm.default")
               for e in region.side_effects), region.side_effects


def test_eval_between_forward_and_backward_is_the_module_mode(tmp_path):
    report = _bn_run(tmp_path / "t.jsonl", eval_before_backward=True)
    region = next(r for r in report.regions if r.status == "diverged")
    assert region.cause.kind == "global_state" and region.cause.tensor == "training"
    assert "'train' in the forward and 'eval' in the recompute" in region.cause.detail
    assert region.suggestions[0].title.startswith("Keep the model's train/eval mode")
    assert not region.side_effects  # the recompute ran in eval mode: it updated nothing a second time
    # torch's error (eval-mode batch norm saves [0]-shaped statistics) is this cause, not a guess from its shapes
    assert report.torch_error.cause.startswith("global_state: "), report.torch_error.cause


class RunningScale(nn.Module):
    """Updates a running average in place, then divides by it: the recompute divides by another value."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.register_buffer("avg", torch.ones(()))

    def forward(self, x):
        h = self.lin(x)
        with torch.no_grad():
            self.avg.lerp_(h.abs().mean(), 0.5)
        return h / self.avg


def test_a_buffer_updated_then_read_inside_the_region_is_the_cause(tmp_path):
    torch.manual_seed(0)
    block = RunningScale()
    x = torch.randn(8, 16, requires_grad=True)
    with ac_diff.record(tmp_path / "t.jsonl"):
        cp.checkpoint(block, x, use_reentrant=False).pow(2).sum().backward()
    region = ac_diff.diagnose([read_run(tmp_path / "t.jsonl")]).regions[0]
    assert region.status == "diverged" and region.silent
    assert region.cause.kind == "state_mutation" and region.cause.tensor == "avg"
    assert region.first_divergence().op == "aten.lerp_.Scalar"  # where the values first differ: the update


class ShiftedGate(nn.Module):
    """A buffer shifts the values the block saves AND the decision (a comparison) taken from them."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.register_buffer("shift", torch.zeros(16))

    def forward(self, x):
        h = self.lin(x) + self.shift
        keep = torch.topk(h, 4, dim=-1).indices
        return torch.tanh(h).gather(-1, keep).sum(-1, keepdim=True) * h


def test_saving_the_decision_is_not_offered_when_the_change_also_shifts_saved_values(tmp_path):
    torch.manual_seed(0)
    block = ShiftedGate()
    x = torch.randn(8, 16, requires_grad=True)
    with ac_diff.record(tmp_path / "t.jsonl"):
        loss = cp.checkpoint(block, x, use_reentrant=False).sum()
        with torch.no_grad():
            block.shift.copy_(torch.randn(16))  # updated between the forward and the recompute
        loss.backward()
    region = ac_diff.diagnose([read_run(tmp_path / "t.jsonl")]).regions[0]
    assert region.cause.kind == "state_mutation" and region.cause.tensor == "shift"
    assert region.first_discrete_divergence is not None
    titles = [s.title for s in region.suggestions]
    assert titles[0].startswith("Update `shift`")
    assert not any(t.startswith("Save ") for t in titles)


def test_a_bias_nudge_that_flips_no_choice_changes_no_saved_tensor(tmp_path):
    """A load-balancing bias nudged between forward and backward: topk's values change, its indices
    (what the region saves and uses) do not. Outputs are compared one by one: the region is clean."""
    torch.manual_seed(0)
    gate = nn.Linear(16, 4, bias=False)
    experts = nn.Parameter(torch.randn(4, 16, 16) * 0.1)
    bias = torch.zeros(4)

    def moe(x):
        scores = gate(x).softmax(-1)
        _, idx = torch.topk(scores + bias, 1, dim=-1)
        weight = scores.gather(-1, idx)
        return x + weight * torch.einsum("nd,nde->ne", x, experts[idx.squeeze(-1)])

    x = torch.randn(32, 16) * 20  # wide margins: a 1e-3 nudge flips no choice
    with ac_diff.record(tmp_path / "t.jsonl"):
        y = cp.checkpoint(moe, x, use_reentrant=False)
        bias += 1e-3 * torch.tensor([1.0, -1.0, 1.0, -1.0])
        y.sum().backward()
    region = ac_diff.diagnose([read_run(tmp_path / "t.jsonl")]).regions[0]
    assert region.status == "clean" and not any(p.values_differ for p in region.positions)


class ScheduledScale(nn.Module):
    """Multiplies by a Python float the training loop advances every step (a schedule)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.scale = 1.0

    def forward(self, x):
        return torch.tanh(self.lin(x) * self.scale)  # tanh saves its output for backward


def test_a_python_number_changed_before_backward_is_named_with_its_fix(tmp_path):
    torch.manual_seed(0)
    block = ScheduledScale()
    x = torch.randn(8, 16, requires_grad=True)
    with ac_diff.record(tmp_path / "t.jsonl"):
        loss = cp.checkpoint(block, x, use_reentrant=False).pow(2).sum()
        block.scale = 1.5  # the schedule advances before the backward
        loss.backward()
    region = ac_diff.diagnose([read_run(tmp_path / "t.jsonl")]).regions[0]
    assert region.status == "diverged" and region.silent
    # the module attribute the region read (a root module is named by its class, as its region is)
    assert region.cause.kind == "state_mutation" and region.cause.tensor == "ScheduledScale.scale"
    assert "was 1.0 in the forward and 1.5 in the recompute" in region.cause.detail
    assert region.suggestions[0].title.startswith("Change `ScheduledScale.scale` after the backward")


def test_a_run_that_stops_before_the_recompute_says_why(tmp_path):
    """The region's input is modified in place after the forward: autograd refuses the backward before
    the recompute runs. The report says the run stopped, and how, not that no backward came."""
    torch.manual_seed(0)
    block = nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    h = x * 2
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        with ac_diff.record(tmp_path / "t.jsonl"):
            out = cp.checkpoint(block, h, use_reentrant=False)
            h.mul_(3)
            out.sum().backward()
    report = ac_diff.diagnose([read_run(tmp_path / "t.jsonl")])
    assert [r.status for r in report.regions] == ["unchecked"]
    notes = report.regions[0].notes
    assert any("the run stopped first (RuntimeError" in n for n in notes), notes
    assert report.headline.startswith("the script crashed") and "RuntimeError" in report.headline
    assert report.verdict == "unchecked" and report.title == "CRASHED"
    # the linear saves its input itself: a run without AC stops at the same check, so it is no checkpoint divergence
    assert any("its input[0] (f32[4, 8]) was modified in place after the forward" in n and "not the checkpoint" in n
               for n in notes), notes


class DoubledFeedForward(nn.Module):
    """Its first op, `x * 2.0`, saves nothing of its input: only checkpoint keeps that tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.fc(x * 2.0))


def test_an_input_only_the_checkpoint_kept_written_after_the_forward_is_named(tmp_path):
    """A residual stream scaled in place (`h.mul_(0.5)`) after the region's forward: only checkpoint keeps `h`, so the
    run fails only with AC. Autograd names the tensor as "output 0 of Mul" (it has a grad_fn): the report names the
    region's input written after the forward (it read the message as another error, and called the run CRASHED with
    every region unchecked)."""
    torch.manual_seed(0)
    block = DoubledFeedForward()
    h = torch.randn(4, 8, requires_grad=True) * 1.0
    with pytest.raises(RuntimeError, match="which is output 0 of Mul"):
        with ac_diff.record(tmp_path / "t.jsonl"):
            out = cp.checkpoint(block, h, use_reentrant=False)
            h.mul_(0.5)
            out.sum().backward()
    region = ac_diff.diagnose([read_run(tmp_path / "t.jsonl")]).regions[0]
    assert region.status == "diverged" and region.cause.tensor == "input[0]", region
    assert "was modified in place after the forward, before its recompute (its version went from 0 to 1)" in \
        region.cause.detail
    assert region.suggestions[0].title.startswith("Do not modify the region's input in place after the forward")


def test_training_mode_follows_each_modules_flag_and_names_it_as_users_do():
    """The modes of a region's modules, read per pass (watched passes too): listed once per module, the flags read
    each time; wrapper segments the user never wrote are left out of the names."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from ac_diff.capture.state import training_mode

    block = torch.nn.Sequential(checkpoint_wrapper(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout())))
    assert training_mode(block) == "train"
    block[0]._checkpoint_wrapped_module[1].eval()
    assert training_mode(block) == "train except 0.1"
    block.eval()
    assert training_mode(block) == "eval"
    block[0].train()
    assert training_mode(block) == "eval except 0, 0.0, 0.1"


def test_ac_diffs_own_dispatch_modes_are_not_the_scripts_global_state():
    """The reference run's watch around reentrant forwards (reference/leaks.py) is a dispatch mode of ac-diff's: a
    stranger's `fix` run read it as the script's (`dispatch_modes` ['_Made'] in the forward, none in the recompute)
    and suggested making the modes alike. A mode of the script's own still counts."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from ac_diff.capture.state import global_state
    from ac_diff.reference.leaks import _Made

    class Scripts(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with _Made(lambda: None, set()):
        assert "dispatch_modes" not in global_state(None)
        with Scripts():
            assert global_state(None)["dispatch_modes"] == ["Scripts"]


@pytest.mark.parametrize("between_steps", [False, True])
@pytest.mark.parametrize("watch", [False, True])
def test_parameters_unfrozen_before_the_backward(between_steps, watch, tmp_path):
    """A gradual-unfreezing schedule sets requires_grad on a frozen layer after the forward: the recompute saves what
    the layer's gradient needs, which the forward did not (torch raises). Unfrozen between steps: clean. Watch mode,
    which records no op and so no parameter read, names it from which of the region's parameters require grad."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    model[0].requires_grad_(False)
    options = {"watch": True, "watch_full_steps": 1} if watch else {}
    with ac_diff.record(tmp_path / "t.jsonl", **options):
        for step in range(2):
            x = torch.randn(4, 8, requires_grad=True)
            if between_steps and step == 1:
                model[0].requires_grad_(True)
            y = cp.checkpoint(model, x, use_reentrant=False)
            if not between_steps and step == 1:
                model[0].requires_grad_(True)  # the schedule, applied between the forward and the backward
            try:
                y.sum().backward()
            except cp.CheckpointError:
                assert not between_steps
    report = ac_diff.diagnose_paths([tmp_path / "t.jsonl"])
    if between_steps:
        assert report.verdict == "clean", report.headline
        return
    region = next(r for r in report.regions if r.status == "diverged")
    assert region.watched is watch
    assert (region.cause.kind, region.cause.mechanism) == ("state_mutation", "requires_grad"), region.cause
    assert ("(those that require grad: all except 0.weight, 0.bias in the forward, all in the recompute)" if watch
            else "were unfrozen between the forward and the backward") in region.cause.detail
    assert region.suggestions[0].title.startswith("Freeze or unfreeze parameters between steps")


def _toggled_grads(unfreeze: bool, checkpointed: bool, path=None, watch: bool = False) -> list:
    """Five steps of a model whose first layer a schedule freezes (or unfreezes) after step 3's forward, before its
    backward, with reentrant AC; the first layer's gradient per step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    model[0].requires_grad_(not unfreeze)
    grads = []
    with ac_diff.record(path, watch=watch) if path is not None else contextlib.nullcontext():
        for step in range(5):
            x = torch.randn(4, 8, requires_grad=True)
            y = cp.checkpoint(model, x, use_reentrant=True) if checkpointed else model(x)
            if step == 2:
                model[0].requires_grad_(unfreeze)
            y.sum().backward()
            grads.append(None if model[0].weight.grad is None else model[0].weight.grad.clone())
            model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("watch", [False, True])
@pytest.mark.parametrize("unfreeze", [True, False])
def test_a_reentrant_region_whose_parameters_are_unfrozen_before_the_backward_diverged(unfreeze, watch, tmp_path):
    """use_reentrant=True builds the backward's graph in the recompute: a layer unfrozen after the forward gets a
    gradient there that a run without AC does not give it, though every op and value matched (it was CLEAN). Frozen
    after the forward, both runs drop its gradient (autograd accumulates none into a leaf that no longer requires
    grad): clean."""
    path = tmp_path / "t.jsonl"
    with_ac, without = _toggled_grads(unfreeze, True, path, watch), _toggled_grads(unfreeze, False)
    same = all((a is None) == (b is None) and (a is None or torch.equal(a, b)) for a, b in zip(with_ac, without))
    assert same is not unfreeze  # the ground truth
    report = ac_diff.diagnose_paths([path])
    if not unfreeze:
        assert report.verdict == "clean", report.headline
        return
    region = next(r for r in report.regions if r.status == "diverged")
    assert region.silent and region.step == 3 and region.watched is watch
    assert (region.cause.kind, region.cause.mechanism) == ("state_mutation", "requires_grad"), region.cause
    assert "the backward runs on the graph the recompute builds" in region.cause.detail, region.cause.detail


def test_a_frozen_teacher_sharing_parameter_names_with_its_student_is_not_unfrozen(tmp_path):
    """A distillation loss reads a student and a frozen teacher, two models whose parameters have the same names
    (`0.weight`); the teacher's EMA update before the backward is a change of values, never an unfreezing."""
    torch.manual_seed(0)
    student, teacher = nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    teacher.requires_grad_(False)

    def distill(x):
        return (student(x) - teacher(x)).pow(2).mean()

    with ac_diff.record(tmp_path / "t.jsonl"):
        loss = cp.checkpoint(distill, torch.randn(4, 8), use_reentrant=False)
        with torch.no_grad():  # the EMA, between the forward and the backward
            for t, s in zip(teacher.parameters(), student.parameters()):
                t.mul_(0.9).add_(s, alpha=0.1)
        loss.backward()
    region = ac_diff.diagnose_paths([tmp_path / "t.jsonl"]).regions[0]
    assert region.status == "diverged" and region.cause.mechanism != "requires_grad", region.cause


class Rotary(nn.Module):
    """A rotary cache of the positions seen so far, rebuilt (a new buffer) when a longer sequence arrives; `ntk`
    rescales its base with the length, as a dynamic-NTK rotary does, so every row changes."""

    def __init__(self, dim: int, ntk: bool) -> None:
        super().__init__()
        self.dim, self.ntk = dim, ntk
        self._build(8)

    def _build(self, n: int) -> None:
        self.n = n
        base = 10000.0 * (n / 8 if self.ntk else 1.0)
        freqs = torch.outer(torch.arange(n).float(), base ** (-torch.arange(0, self.dim, 2).float() / self.dim))
        self.register_buffer("cos_cached", torch.cat([freqs, freqs], -1).cos(), persistent=False)

    def forward(self, t: int):
        if t > self.n:
            self._build(t)
        return self.cos_cached[:t]


class RotaryLayer(nn.Module):
    def __init__(self, ntk: bool) -> None:
        super().__init__()
        self.fc, self.rotary = nn.Linear(16, 16), Rotary(16, ntk)

    def forward(self, x):
        return x + self.fc(x) * self.rotary(x.shape[1])


@pytest.mark.parametrize("ntk", [False, True])
def test_a_rotary_cache_grown_by_a_longer_micro_batch(ntk, tmp_path):
    """Two micro-batches forward before one backward; the second, longer, rebuilds the cache the first region read
    part of. The saved slice `cos_cached[:6]` is what its recompute compares, not the whole (grown) cache."""
    torch.manual_seed(0)
    layer = RotaryLayer(ntk)
    with ac_diff.record(tmp_path / "t.jsonl"):
        loss = sum(cp.checkpoint(layer, torch.randn(2, t, 16), use_reentrant=False).pow(2).mean() for t in (6, 14))
        loss.backward()
    report = ac_diff.diagnose_paths([tmp_path / "t.jsonl"])
    if not ntk:
        assert report.verdict == "clean", report.headline
        return
    region = report.regions[0]
    assert (region.status, region.silent) == ("diverged", True), report.headline
    assert region.cause.tensor == "rotary.cos_cached", region.cause
    assert report.regions[1].status == "clean"


class _Feat(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class _Student(nn.Module):
    """Gates its features with a mean teacher's, in a checkpointed closure (the teacher is an argument)."""

    def __init__(self) -> None:
        super().__init__()
        self.feat = _Feat()

    def forward(self, x, teacher):
        def gated(h):
            with torch.no_grad():
                gate = torch.sigmoid(teacher.feat(h))
            return self.feat(h) * gate
        return cp.checkpoint(gated, x, use_reentrant=False)


@pytest.mark.parametrize("watch", [False, True])
def test_a_teachers_module_a_checkpointed_closure_calls_is_named_by_the_teacher(watch, tmp_path):
    """A mean teacher whose EMA update runs before the backward: the changed parameter is the teacher's. It was
    `fc1.weight` (the teacher's `feat` read as a root, as the student's own modules do), the region named `Feat` when
    recorded in full and `Student.forward.<locals>.gated` when watched, so watch's escalation never found its full
    recording ("unknown")."""
    import copy

    torch.manual_seed(0)
    student = _Student()
    teacher = copy.deepcopy(student).requires_grad_(False)
    opt = torch.optim.SGD(student.parameters(), lr=0.1)
    with ac_diff.record(tmp_path / "t.jsonl", watch=watch):
        for _ in range(3):
            loss = student(torch.randn(4, 8), teacher).pow(2).mean()
            with torch.no_grad():  # the EMA, placed before the backward
                for t, s in zip(teacher.parameters(), student.parameters()):
                    t.lerp_(s, 0.1)
            loss.backward()
            opt.step()
            opt.zero_grad()
    report = ac_diff.diagnose_paths([tmp_path / "t.jsonl"])
    lead = next(r for r in report.regions if r.status == "diverged")
    assert {r.module for r in report.regions} == {"_Student.forward.<locals>.gated"}, [r.module for r in report.regions]
    assert lead.cause.kind == "state_mutation" and lead.cause.tensor == "teacher.feat.fc1.weight", lead.cause


class DelayedScaleLinear(nn.Linear):
    """fp8-style delayed scaling: the input's scale comes from an amax history the forward rolls (from step
    `start` on), or from the current amax while the history is empty. Read through a detached copy: no gradient."""

    def __init__(self, d: int, start: int) -> None:
        super().__init__(d, d, bias=False)
        self.start, self.step = start, 0
        self.register_buffer("amax_history", torch.zeros(4))

    def forward(self, x):
        current = x.detach().abs().max()
        amax = torch.maximum(self.amax_history[1:].max(),
                             self.amax_history[0] if self.amax_history[0] > 0 else current)
        scale = 448.0 / amax
        if self.step >= self.start:
            with torch.no_grad():
                self.amax_history.copy_(torch.roll(self.amax_history, 1))
                self.amax_history[0] = current
        q = (x * scale).to(torch.float8_e4m3fn).to(x.dtype) / scale
        return torch.relu(nn.functional.linear(q, self.weight))


def _delayed_scale_grads(checkpointed: bool, path=None) -> list:
    torch.manual_seed(0)
    inp = nn.Linear(16, 16)
    blocks = nn.ModuleList(DelayedScaleLinear(16, start=2) for _ in range(2))
    opt = torch.optim.SGD([*inp.parameters(), *blocks.parameters()], lr=0.1)
    grads = []
    with ac_diff.record(path) if path else contextlib.nullcontext():
        for step in range(4):
            x = inp(torch.randn(8, 16) * (1 + step))
            for b in blocks:
                b.step = step
                x = cp.checkpoint(b, x, use_reentrant=True) if checkpointed else b(x)
            x.pow(2).mean().backward()
            grads.append([p.grad.clone() for p in (*inp.parameters(), *blocks.parameters())])
            opt.step()
            opt.zero_grad()
    return grads


def test_a_reentrant_recompute_that_differs_off_the_gradients_path_is_not_a_divergence(tmp_path):
    # The first step that rolls the history: the recompute finds it filled and takes the other branch to the same
    # scale (a detached value), so its graph is the forward's; it rolls the history a second time, and the next
    # step's forward reads that. Only the next step's gradients differ from a run without AC, and only it diverged.
    path = tmp_path / "t.jsonl"
    with_ac, without = _delayed_scale_grads(True, path), _delayed_scale_grads(False)
    differ = [step for step, (a, b) in enumerate(zip(with_ac, without))
              if not all(torch.equal(x, y) for x, y in zip(a, b))]
    assert differ and differ[0] == 3
    report = ac_diff.diagnose([read_run(path)])
    by_step = {}
    for r in report.regions:
        by_step.setdefault(r.step, set()).add(r.status)
    # (the report counts steps from 1; the first update's step reproduced, its scale read from the history it updates:
    # at risk, not diverged)
    assert by_step[1] == by_step[2] == {"clean"} and by_step[3] == {"unchecked"} and "diverged" in by_step[4]
    update_step = [r for r in report.regions if r.step == 3]
    assert {r.unchecked_reason for r in update_step} == {"reproduced; state it reads is updated twice"}
    assert all(any("amax_history" in e for e in r.side_effects) for r in update_step)
    assert any("gradient's path" in n for r in update_step for n in r.notes)
    lead = report.lead_groups()[0][0]
    assert lead.step == 4 and lead.cause.kind == "state_mutation"


class OffsetRotary(nn.Module):
    """Attention-free stand-in of a rotary layer whose table a long sequence's chunks rewrite in place, each for its
    own position offset (set around each chunk's checkpoint call, as a chunked long-context trainer does)."""

    def __init__(self, length: int = 4, dim: int = 8) -> None:
        super().__init__()
        self.fc, self.dim = nn.Linear(dim, dim), dim
        self.register_buffer("table", torch.zeros(length, dim))

    def set_offset(self, offset: int) -> None:
        pos = torch.arange(offset, offset + self.table.shape[0], dtype=torch.float32)[:, None]
        self.table.copy_(torch.cos(pos / 10 ** (torch.arange(self.dim) / self.dim)))

    def forward(self, x):
        return x + self.fc(x * self.table)


def test_state_each_chunks_forward_sets_before_the_backwards_is_named_with_a_fix_that_serves_every_chunk(tmp_path):
    """Three chunks forwarded, then their backwards: each chunk's recompute reads the table the last chunk set. The
    cause names the later forwards (it said only "modified between the forward and the backward") and the fix passes
    the table as an argument (it led with an update after the backward, which cannot serve each chunk)."""
    torch.manual_seed(0)
    layer = OffsetRotary()
    with ac_diff.record(tmp_path / "t.jsonl"):
        losses = []
        for chunk in range(3):
            layer.set_offset(4 * chunk)
            losses.append(cp.checkpoint(layer, torch.randn(2, 4, 8, requires_grad=True), use_reentrant=False).sum())
        for loss in losses:
            loss.backward()
    report = ac_diff.diagnose_paths([tmp_path / "t.jsonl"])
    first, second, last = report.regions
    assert (first.status, second.status, last.status) == ("diverged", "diverged", "clean"), report.headline
    assert (first.cause.tensor, first.cause.mechanism) == ("table", "later_forward"), first.cause
    assert "regions 1-2, later forwards of" in first.cause.detail and "region 2, later forward of" in \
        second.cause.detail
    assert first.suggestions[0].title == "Pass what `table` holds to the checkpointed function as an argument"


class ScaledResidual(nn.Module):
    """A residual branch scaled by a Python attribute the training loop sets before each micro-batch's forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.res_scale = nn.Linear(8, 8), 1.0

    def forward(self, x):
        return x + torch.tanh(self.res_scale * self.fc(x)) ** 2


def test_an_attribute_each_micro_batchs_forward_sets_is_a_later_forwards_state(tmp_path):
    """Gradient accumulation with every micro-batch forwarded before one backward, `res_scale` set to 1 / (mb + 1)
    before each forward: each recompute reads the last. The cause was "changed between the forward and the backward",
    its fix "change it after the backward", which the next micro-batch's forward cannot wait for."""
    torch.manual_seed(0)
    layer = ScaledResidual()
    with ac_diff.record(tmp_path / "t.jsonl"):
        losses = []
        for mb in range(3):
            layer.res_scale = 1.0 / (mb + 1)
            losses.append(cp.checkpoint(layer, torch.randn(4, 8), use_reentrant=False).square().mean())
        sum(losses).backward()
    report = ac_diff.diagnose_paths([tmp_path / "t.jsonl"])
    diverged = [r for r in report.regions if r.status == "diverged"]
    assert [r.region for r in diverged] == [0, 1], report.headline
    assert all(r.cause.tensor.endswith("res_scale") and r.cause.mechanism == "later_forward" for r in diverged), diverged
    assert diverged[0].suggestions[0].title.startswith("Pass what `") and "res_scale` holds to the checkpointed" \
        in diverged[0].suggestions[0].title
    assert "after the backward" not in diverged[0].suggestions[0].title


def test_an_attribute_the_loop_sets_after_a_shared_blocks_calls_is_no_later_forwards_state(tmp_path):
    """A weight-shared block called three times in one forward (29b), `res_scale` set by the loop's schedule after the
    forward, before the backward: its second and third calls read the value the first did and set nothing. The cause
    named them "later forwards of shared (micro-batches or chunks ...)", and the fix passed the value as an argument;
    it was changed between the forward and the backward, and the fix moves the update after the backward."""
    torch.manual_seed(0)
    layer = ScaledResidual()
    with ac_diff.record(tmp_path / "t.jsonl"):
        x = torch.randn(4, 8)
        for _ in range(3):
            x = cp.checkpoint(layer, x, use_reentrant=False)
        layer.res_scale = 0.5  # (the schedule's hook)
        x.square().mean().backward()
    report = ac_diff.diagnose_paths([tmp_path / "t.jsonl"])
    diverged = [r for r in report.regions if r.status == "diverged"]
    assert diverged and all(r.cause.tensor.endswith("res_scale") for r in diverged), report.headline
    assert not any(r.cause.mechanism == "later_forward" for r in diverged), [r.cause for r in diverged]
    assert "later forward" not in diverged[0].cause.detail and "after the backward" in \
        diverged[0].suggestions[0].title, diverged[0].suggestions[0].title


class Biased(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("bias", torch.zeros(8))

    def forward(self, x):
        return x + torch.tanh(self.fc(x) + self.bias)


def test_a_buffer_updated_after_each_micro_batchs_backward_is_no_later_forwards_state(tmp_path):
    """35d P2-2: micro-batches forwarded first, then their backwards, `bias` updated after each backward: every forward
    read the same bias, and the recompute of each later micro-batch reads an updated one. The cause named "later
    forwards of the module (micro-batches ...)" and its fix passed the value as an argument, "an update after the
    backward cannot serve each forward"; none of those forwards changed it: the fix moves the update."""
    torch.manual_seed(0)
    layer = Biased()
    with ac_diff.record(tmp_path / "t.jsonl"):
        losses = [cp.checkpoint(layer, torch.randn(4, 8), use_reentrant=False).square().mean() for _ in range(3)]
        for loss in losses:
            loss.backward()
            with torch.no_grad():
                layer.bias.add_(0.1)  # (a running statistic updated per micro-batch)
    report = ac_diff.diagnose_paths([tmp_path / "t.jsonl"])
    diverged = [r for r in report.regions if r.status == "diverged"]
    assert [r.region for r in diverged] == [1, 2], report.headline
    assert all(r.cause.tensor == "bias" and r.cause.mechanism != "later_forward" for r in diverged), \
        [r.cause for r in diverged]
    assert "after the backward" in diverged[0].suggestions[0].title, diverged[0].suggestions[0].title


class BufferWarmup(nn.Module):
    """Halves its input while a call count it keeps in a buffer (and reads as a tensor) is at most `warmup`."""

    def __init__(self, warmup: int) -> None:
        super().__init__()
        self.fc, self.warmup = nn.Linear(8, 8), warmup
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.calls.add_(1)
        return torch.tanh(self.fc(x * torch.where(self.calls <= self.warmup, 0.5, 1.0)))


def test_a_buffer_the_forward_updates_and_computes_with_puts_gradients_at_risk(tmp_path):
    """Under AC the count runs twice a step (1, 2 | 3, 4 | 5, 6 against 1 | 2 | 3): each step's passes agree, and
    step 3's gradients differ all the same. A tensor the region updates and computes with is state read again, as a
    Python counter is: at risk, not clean (it was a note on a clean run)."""
    from models import same_steps, steps_with_and_without_ac

    with_ac, without = steps_with_and_without_ac(lambda: BufferWarmup(4), tmp_path / "t.jsonl", steps=3)
    assert same_steps(with_ac, without) == [True, True, False]
    report = ac_diff.diagnose_paths([tmp_path / "t.jsonl"])
    assert (report.verdict, report.title) == ("unchecked", "GRADIENTS AT RISK"), report.headline
    region = report.regions[0]
    assert region.cause.tensor == "calls" and "updates the buffer `calls` and reads it" in region.cause.detail


class OverflowGuard(nn.Module):
    """An EMA of the input's amax, updated in the forward, switches on a clamp of the hidden activations once past a
    threshold: between the forward and the recompute of the step that crosses it, the guard flips."""

    def __init__(self, bound: float) -> None:
        super().__init__()
        self.fc1, self.fc2, self.bound, self.threshold = nn.Linear(8, 16), nn.Linear(16, 8), bound, 2.5
        self.register_buffer("amax_ema", torch.zeros(()))

    def forward(self, x):
        with torch.no_grad():
            self.amax_ema.mul_(0.5).add_(0.5 * x.detach().abs().amax())
        h = nn.functional.gelu(self.fc1(x))
        if float(self.amax_ema) > self.threshold:
            h = h.clamp(-self.bound, self.bound)
        return x + self.fc2(h)


@pytest.mark.parametrize("bound", [1e4, 0.05])
def test_a_reentrant_recompute_that_adds_a_clamp_no_value_reaches_is_no_divergence(bound, tmp_path):
    """The recompute runs the clamp the forward did not. Far above every activation it changes no value and its
    gradient is the identity: the gradients match a run without AC, and the region is no divergence (it was SILENTLY
    DIVERGED, "branches on grad mode"). A bound the activations cross changes the values: diverged."""
    def make():
        torch.manual_seed(1)
        return nn.Sequential(nn.Linear(8, 8), OverflowGuard(bound))

    grads = {}
    for ac in (True, False):
        model = make()
        with ac_diff.record(tmp_path / "t.jsonl") if ac else contextlib.nullcontext():
            h = model[0](torch.randn(8, 8))
            model[1].threshold = 0.6 * float(h.abs().amax())  # (the EMA: 0.5 amax after the forward, 0.75 after the
            (cp.checkpoint(model[1], h, use_reentrant=True) if ac else model[1](h)).sum().backward()  # recompute)
        grads[ac] = [p.grad.clone() for p in model.parameters()]
    identical = all(torch.equal(a, b) for a, b in zip(grads[True], grads[False]))
    assert identical == (bound > 1)
    region = ac_diff.diagnose_paths([tmp_path / "t.jsonl"]).regions[0]
    assert region.status == ("clean" if identical else "diverged"), (region.cause, region.notes)


def test_the_reference_does_not_take_autocasts_weight_casts_for_side_outputs():
    """A reentrant block under CPU bf16 autocast hands out its z-loss through a list: the reference's explanation
    listed autocast's casts of the weights (aten._to_copy in every projection) as side outputs beside it, which
    autocast's cache keeps alive, not the script; the diagnosis already left them out (one rule now, in oprules)."""

    class ZLossBlock(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.losses = nn.Linear(8, 8), []

        def forward(self, x):
            logits = self.fc(x)
            self.losses.append(logits.float().logsumexp(-1).square().mean())
            return torch.tanh(logits)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        ops = _side_output_ops(ZLossBlock())
    assert ops and "aten._to_copy.default" not in ops, ops


def _side_output_ops(block: nn.Module) -> set[str]:
    """The ops whose tensors the reference's ReentrantWatch finds handed out of `block`'s reentrant forward other than
    through its outputs."""
    from ac_diff.capture.modules import ModuleStack
    from ac_diff.reference.leaks import ReentrantWatch
    from ac_diff.remedies.call import CheckpointCall

    torch.manual_seed(0)
    x = torch.randn(4, 8, requires_grad=True)
    watch = ReentrantWatch(ModuleStack())

    def forward():
        with torch.no_grad():  # (as checkpoint(use_reentrant=True) runs it)
            return block(x)

    watch(CheckpointCall(block, (x,), {}, "block", True), forward)
    return {f["op"] for f in watch.findings() if f["kind"] == "side_output"}


def test_the_reference_does_not_take_what_a_region_computes_from_a_detached_copy_for_side_outputs():
    """27d: a reentrant block keeps `h.detach().abs().amax(0)` on itself for a scale update (fp8's amax): the reference
    named aten.amax "a side output ... adds no gradient" and suggested use_reentrant=False, where the README exempts
    it: the detached copy shares its source's storage, and what was computed from it alone was taken as made with
    grad. A z-loss handed out the same way is one."""

    class AmaxBlock(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.last_amax, self.losses = nn.Linear(8, 8), None, []

        def forward(self, x):
            h = self.fc(x)
            self.last_amax = h.detach().abs().amax(0)
            self.losses.append(h.logsumexp(-1).square().mean())
            return torch.tanh(h)

    ops = _side_output_ops(AmaxBlock())
    assert "aten.mean.default" in ops and not ops & {"aten.abs.default", "aten.amax.default"}, ops

    class RmsBlock(nn.Module):  # (31a: the RMS of a LayerScale's branch, kept for an EMA the loop updates)
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.last_rms = nn.Linear(8, 8), None

        def forward(self, x):
            y = torch.tanh(self.fc(x))
            self.last_rms = y.detach().pow(2).mean(0).sqrt()
            return x + y

    assert not _side_output_ops(RmsBlock())


class _DelayedScaling(nn.Linear):
    """fp8-style delayed scaling: the scale comes from an amax history the forward rolls in place (the recompute
    rolls it again); activations and weights are fake-quantized through a straight-through estimator,
    `x + (q(x) - x).detach()`."""

    def __init__(self, i: int, o: int) -> None:
        super().__init__(i, o)
        self.register_buffer("amax_hist", torch.full((8,), 0.5))

    @staticmethod
    def _fake8(t, scale, dtype):
        top = torch.finfo(dtype).max
        return (t * scale).clamp(-top, top).to(dtype).to(t.dtype) / scale

    def forward(self, x):
        scale = torch.finfo(torch.float8_e4m3fn).max / self.amax_hist.max()
        amax = x.detach().abs().max()
        self.amax_hist.copy_(torch.roll(self.amax_hist, 1))
        self.amax_hist[0] = amax
        xq = x + (self._fake8(x, scale, torch.float8_e4m3fn) - x).detach()
        w_scale = torch.finfo(torch.float8_e5m2).max / self.weight.detach().abs().max()
        wq = self.weight + (self._fake8(self.weight, w_scale, torch.float8_e5m2) - self.weight).detach()
        return torch.nn.functional.linear(xq, wq, self.bias)


class _Fp8Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = _DelayedScaling(32, 64), _DelayedScaling(64, 32)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


def test_the_buffer_named_is_the_one_the_first_divergent_op_reads_through_a_straight_through_estimator(tmp_path):
    """Both linears of the block roll their own history. The first op to differ reads `up.amax_hist`, and what it
    feeds reaches the saved tensors only through `.detach()` (a copy the alignment skips), so only `down.amax_hist`
    counted as reaching them and the cause named the second buffer; `.detach()` passes values on."""
    torch.manual_seed(0)
    block = _Fp8Block()
    with ac_diff.record(tmp_path / "t.jsonl"):
        # (the data: no grad, so `x * scale` saves nothing; only the `.detach()` path reaches what the linear saves)
        cp.checkpoint(block, torch.randn(16, 32) * 3, use_reentrant=False).sum().backward()
    region = ac_diff.diagnose_paths([tmp_path / "t.jsonl"]).regions[0]
    assert region.status == "diverged" and region.first_value_divergence.module == "up", region.first_value_divergence
    assert region.cause.tensor == "up.amax_hist", region.cause


def test_with_gradient_accumulation_the_comparison_asked_for_reaches_the_next_optimizer_step(tmp_path):
    """31c: two micro-batches per optimizer step; the statistics the recompute updates a second time are read from the
    next optimizer step on, backward 3. The headline asked for `--reference-steps 2`, which compares the first step's
    two backward passes only, and found them identical: false reassurance."""
    torch.manual_seed(0)
    block = BNBlock()
    opt = torch.optim.SGD(block.parameters(), lr=0.1)
    path = tmp_path / "t.jsonl"
    with ac_diff.record(path):
        for _ in range(2):
            for _ in range(2):
                x = torch.randn(8, 16, requires_grad=True)
                cp.checkpoint(block, x, use_reentrant=False).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    report = ac_diff.diagnose([read_run(path)])
    assert [r.optimizer_step for r in report.regions][1:] == [1, 2, 2], [r.optimizer_step for r in report.regions]
    assert "--reference-steps 3` tells whether the training reads them" in report.headline, report.headline


def test_a_kept_rms_of_a_detached_copy_is_no_side_output_in_the_reference(tmp_path):
    """31a: a reentrant LayerScale block keeps `y.detach().pow(2).mean(0).sqrt()` for an EMA; its `gain` is rebound
    between the forward and the backward (the real divergence). `--reference no-ac` explained the differing gradients
    by `last_rms` "leaving the region ... adds no gradient" and suggested use_reentrant=False: under the run's
    recording, detach's result reached the watch as another tensor than the one the mode returned."""
    import json

    from conftest import run_cli

    script = tmp_path / "layerscale.py"
    script.write_text(
        "import torch\nimport torch.nn as nn\nfrom torch.utils.checkpoint import checkpoint\n\n"
        "torch.manual_seed(0)\n\n\nclass Block(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.fc = nn.Linear(8, 8)\n        self.register_buffer('gain', torch.full((8,), 0.5))\n"
        "        self.last_rms = None\n\n    def forward(self, x):\n        y = torch.tanh(self.fc(x))\n"
        "        self.last_rms = y.detach().pow(2).mean(0).sqrt()\n        return x + y * self.gain\n\n\n"
        "block, head = Block(), nn.Linear(8, 1)\nfor _ in range(2):\n"
        "    x = torch.randn(16, 8, requires_grad=True)\n"
        "    loss = head(checkpoint(block, x, use_reentrant=True)).pow(2).mean()\n"
        "    block.gain = 0.5 / (0.5 + block.last_rms)  # (rebound before the backward)\n    loss.backward()\n")
    proc = run_cli("run", "--reference", "no-ac", "-o", str(tmp_path / "out"), "--json", str(tmp_path / "r.json"),
                   str(script), cwd=tmp_path)
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["verdict"] == "diverged" and report["reference"]["verdict"] == "differs", proc.stderr[-2000:]
    kinds = [e["kind"] for e in report["reference"]["explanations"]]
    assert "side_output" not in kinds, report["reference"]["explanations"]
