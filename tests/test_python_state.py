"""Python state a region reads, named as the cause when the recompute sees it changed:

- a container attribute a forward appends to (a Transformer-XL style memory of past segments): the recompute
  sees one entry more, `torch.cat` gets another number of inputs, torch raises. The cause is the attribute,
  `cells.1.memory.seen` 0 -> 1 entries, with its restore (which works) and its fix;
- a module-level flag of the model's own Python module set around the forward only: the branch that reads it
  is named by the flag and its value in each pass, wherever the branch reads it (the forward, a helper
  function, a method, a child module's method called by name);
- a scheduler that anneals every dropout's `p` between forward and backward: the changed attributes that feed
  bernoulli_'s argument outrank the random op, and `fix` restores them all, never trying preserve_rng_state
  (already on).
"""

from __future__ import annotations

import json
import random
from collections import deque

import pytest
import torch
from torch import nn
import torch.utils.checkpoint as cp

import ac_diff
from ac_diff.fix.candidates import candidates
from ac_diff.remedies import CheckpointPatch, RemedySpec
from conftest import run_cli
from stacks import annealed_dropout
from stacks.annealed_dropout import anneal


def _record(tmp_path, step):
    """Run `step()` under the recorder (a CheckpointError it raises is part of the mechanism) and diagnose it."""
    with ac_diff.record(tmp_path / "trace-rank0.jsonl"):
        try:
            step()
        except cp.CheckpointError:
            pass
    return ac_diff.diagnose_paths([str(tmp_path)])


def _diverged(report):
    return [r for r in report.regions if r.status == "diverged"]


# --- a container attribute the forward appends to ----------------------------------------------------------------

class Memory(nn.Module):
    """Attends over the segments it has seen and the new one, then remembers the new one."""

    def __init__(self, container: type) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.seen = container()

    def forward(self, x):
        past = list(self.seen.values()) if isinstance(self.seen, dict) else list(self.seen)
        context = torch.cat([*past, x])
        if isinstance(self.seen, dict):
            self.seen[len(self.seen)] = x.detach()
        else:
            self.seen.append(x.detach())
        return self.proj(context)[-x.shape[0]:]


class Cell(nn.Module):
    def __init__(self, container: type) -> None:
        super().__init__()
        self.memory = Memory(container)
        self.out = nn.Linear(8, 8)

    def forward(self, x):
        return x + self.out(torch.tanh(self.memory(x)))


class Recurrent(nn.Module):
    def __init__(self, container: type, checkpointed: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.cells = nn.ModuleList([Cell(container) for _ in range(2)])
        self.checkpointed = checkpointed

    def forward(self, x):
        for cell in self.cells:
            x = cp.checkpoint(cell, x, use_reentrant=False) if self.checkpointed else cell(x)
        return x


def _grads(net):
    torch.manual_seed(1)
    net(torch.randn(4, 8)).pow(2).sum().backward()
    return [p.grad.clone() for p in net.parameters()]


@pytest.mark.parametrize("container", [list, deque, dict])
def test_a_memory_the_forward_appends_to_is_the_cause_with_its_entries(tmp_path, container):
    report = _record(tmp_path, lambda: _grads(Recurrent(container)))
    region, = _diverged(report)  # (torch stopped at the first recompute: cells.1)
    assert region.first_shape_divergence.op == "aten.cat.default"
    cause = region.cause
    assert (cause.kind, cause.mechanism, cause.tensor) == ("state_mutation", "attribute", "cells.1.memory.seen")
    kind = container.__name__
    assert f"a {kind} of 0 entries in the forward and 1 in the recompute" in cause.detail
    assert "counts twice" in cause.detail  # the recompute calls the forward that appends again
    assert any("0 -> 1 entries in the forward, 1 -> 2 entries in the recompute" in e for e in cause.evidence)
    assert region.suggestions[0].title.startswith("Do not change `cells.1.memory.seen` in the checkpointed forward")
    restore = [c for c in candidates(report) if c.kind == "restore"]
    assert [c.spec.restore for c in restore] == [["cells.*.memory.seen"]]


def test_restoring_the_memory_in_the_recompute_gives_the_gradients_without_ac():
    reference = _grads(Recurrent(list, checkpointed=False))
    patch = CheckpointPatch(RemedySpec(restore=["cells.*.memory.seen"])).install()
    try:
        net = Recurrent(list)
        restored = _grads(net)
    finally:
        patch.uninstall()
    assert all(torch.equal(a, b) for a, b in zip(restored, reference))
    assert [len(c.memory.seen) for c in net.cells] == [1, 1]  # the forward's own append stays, once


# --- a module-level flag set around the forward only --------------------------------------------------------------

ROUNDED = False  # "compute this block in reduced precision": the user's own switch


def _rounded(h):
    return h.to(torch.bfloat16).float() if ROUNDED else h


class InForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        if ROUNDED:
            h = h.to(torch.bfloat16).float()
        return torch.tanh(h)


class InHelper(InForward):
    def forward(self, x):
        return torch.tanh(_rounded(self.fc(x)))


class InMethod(InForward):
    def forward(self, x):
        return torch.tanh(self.maybe_round(self.fc(x)))

    def maybe_round(self, h):
        if ROUNDED:
            return h.to(torch.bfloat16).float()
        return h


class _Rounder(nn.Module):
    def round(self, h):  # a child's helper method, not its forward: no module call runs it
        if ROUNDED:
            return h.to(torch.bfloat16).float()
        return h


class InChildMethod(InForward):
    def __init__(self) -> None:
        super().__init__()
        self.rounder = _Rounder()

    def forward(self, x):
        return torch.tanh(self.rounder.round(self.fc(x)))


class Layers(nn.Module):
    def __init__(self, block: type) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([block() for _ in range(2)])

    def forward(self, x):
        for layer in self.layers:
            x = cp.checkpoint(layer, x, use_reentrant=False)
        return x


def _rounded_step(net, through_backward: bool):
    global ROUNDED
    ROUNDED = True
    try:
        loss = net(torch.randn(4, 8)).pow(2).sum()
        if not through_backward:
            ROUNDED = False
        loss.backward()
    finally:
        ROUNDED = False


@pytest.mark.parametrize("block", [InForward, InHelper, InMethod, InChildMethod])
def test_a_global_flag_set_around_the_forward_is_named_at_the_branch(tmp_path, block):
    report = _record(tmp_path, lambda: _rounded_step(Layers(block), through_backward=False))
    regions = _diverged(report)
    assert len(regions) == 2
    flag = f"{__name__}.ROUNDED"
    for region in regions:
        cause = region.cause
        assert (cause.kind, cause.mechanism, cause.tensor) == ("control_flow", "global", flag)
        assert f"the module-level global `{flag}` was True in the forward and False in the recompute" in cause.detail
        assert any(e.startswith(f"{flag}: True in the forward and False in the recompute (read by ") for e in
                   cause.evidence)
        assert region.suggestions[0].title == "Keep the global `ROUNDED` as the forward saw it until after the backward"
        assert "ROUNDED = True" in region.suggestions[0].code
    assert not [c for c in candidates(report) if c.kind == "restore"]  # a global is no module state to restore


class PrecisionConfig:
    upcast = True  # a default the class holds: the instance sets its own only when a callback changes it


PRECISION = PrecisionConfig()


class Upcast(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        return torch.tanh(h.double()).float() if PRECISION.upcast else torch.tanh(h)


def test_a_config_objects_class_default_changed_on_the_instance_is_named(tmp_path):
    """A callback sets `PRECISION.upcast = False` between the forward and the backward: the forward read the class's
    default (the instance had no field of its own), the recompute the instance's. It read "Python code took another
    branch" without the flag."""
    PRECISION.__dict__.pop("upcast", None)

    def step():
        loss = Layers(Upcast)(torch.randn(4, 8)).pow(2).sum()
        PRECISION.upcast = False
        loss.backward()

    try:
        report = _record(tmp_path, step)
    finally:
        PRECISION.__dict__.pop("upcast", None)
    cause = _diverged(report)[0].cause
    flag = f"{__name__}.PRECISION.upcast"
    assert (cause.kind, cause.tensor) == ("control_flow", flag), cause
    assert f"`{flag}` was True in the forward and False in the recompute" in cause.detail, cause.detail


def test_a_setting_of_the_users_own_module_read_through_it_is_named(tmp_path, monkeypatch):
    """A temperature kept in a settings module of the user's (`import hparams` ... `/ hparams.TEMP`) that a schedule
    moves between the forward and the backward: named `hparams.TEMP`, with the fix in the code's own spelling (it
    read "a Python value passed to aten.div.Tensor")."""
    code = tmp_path / "code"
    code.mkdir()
    (code / "hparams_t.py").write_text("TEMP = 1.0\n")
    (code / "head_t.py").write_text(
        "import torch\nimport hparams_t\n\n\n"
        "class Head(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.fc = torch.nn.Linear(8, 4)\n\n"
        "    def forward(self, x):\n"
        "        return torch.log_softmax(self.fc(x) / hparams_t.TEMP, -1)\n")
    monkeypatch.syspath_prepend(str(code))
    import hparams_t
    import head_t

    torch.manual_seed(0)
    head = head_t.Head()

    def step():
        loss = cp.checkpoint(head, torch.randn(4, 8), use_reentrant=False).sum()
        hparams_t.TEMP = 1.5  # the schedule, before the backward
        loss.backward()

    report = _record(tmp_path, step)
    cause = _diverged(report)[0].cause
    assert (cause.mechanism, cause.tensor) == ("global", "hparams_t.TEMP"), cause
    assert "was 1.0 in the forward and 1.5 in the recompute" in cause.detail, cause.detail
    fix = _diverged(report)[0].suggestions[0]
    assert fix.title == "Keep the global `hparams_t.TEMP` as the forward saw it until after the backward", fix.title


CALLS = 0


class EveryOtherCall(nn.Module):
    """A module-level call counter the forward advances (a schedule by call count): the recompute advances it again."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        global CALLS
        CALLS += 1
        h = self.fc(x)
        return torch.relu(h) if CALLS % 2 else torch.tanh(h)


def test_a_global_counter_the_forward_advances_counts_twice(tmp_path):
    global CALLS
    CALLS = 0
    report = _record(tmp_path, lambda: Layers(EveryOtherCall)(torch.randn(4, 8)).pow(2).sum().backward())
    region = _diverged(report)[0]
    flag = f"{__name__}.CALLS"
    assert (region.cause.mechanism, region.cause.tensor) == ("global", flag), region.cause
    assert "changes it (0 -> 1 in the forward)" in region.cause.detail and "counts twice" in region.cause.detail
    fix = region.suggestions[0]
    assert fix.title == "Do not change the global `CALLS` in the checkpointed forward: the recompute changes it again"
    assert "value = CALLS" in fix.code and "CALLS += 1" in fix.code, fix.code


WARM_CALLS = 0


def _temperature() -> float:
    return 2.0 if WARM_CALLS <= 2 else 1.0


class GlobalWarmup(nn.Module):
    """The forward counts its calls in a global, and a helper of its own reads the count (a temperature schedule)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        global WARM_CALLS
        WARM_CALLS += 1
        return torch.tanh(self.fc(x) / _temperature())


@pytest.mark.parametrize("watch", [False, True])
def test_a_global_counter_a_helper_reads_crossing_its_threshold_between_steps(tmp_path, watch):
    """Under AC the count runs twice as fast: 1, 2 | 3, 4 against 1 | 2 without AC, so step 2's forward reads another
    temperature while each step's passes agree. Read beyond its update (by `_temperature`): GRADIENTS AT RISK, not
    clean; watched, the first step's full recording names it (it said "unknown: a rare event")."""
    from models import same_steps, steps_with_and_without_ac

    def fresh():
        global WARM_CALLS
        WARM_CALLS = 0
        return GlobalWarmup()

    with_ac, without = steps_with_and_without_ac(fresh, tmp_path / "t.jsonl", steps=2, batch=(4, 8), watch=watch)
    assert same_steps(with_ac, without) == [True, False]
    report = ac_diff.diagnose_paths([tmp_path / "t.jsonl"])
    assert report.verdict != "clean", report.headline
    assert f"{__name__}.WARM_CALLS" in report.headline, report.headline


def test_a_global_flag_kept_for_the_backward_is_no_cause(tmp_path):
    report = _record(tmp_path, lambda: _rounded_step(Layers(InHelper), through_backward=True))
    assert report.verdict == "clean", report.headline


# --- a scheduler anneals every dropout's p between forward and backward -------------------------------------------

def _annealed_step(net):
    torch.manual_seed(1)
    loss = net(torch.randn(8, 16)).pow(2).mean()
    anneal(net)
    loss.backward()
    return [p.grad.clone() for p in net.parameters()]


def test_an_annealed_dropout_probability_outranks_the_random_op(tmp_path):
    torch.manual_seed(0)
    report = _record(tmp_path, lambda: _annealed_step(annealed_dropout.Net()))
    regions = _diverged(report)
    assert [r.module for r in regions] == ["blocks.0", "blocks.1"] and all(r.silent for r in regions)
    for region, i in zip(regions, (0, 1)):
        cause = region.cause
        assert region.first_argument_divergence.op == "aten.bernoulli_.float"
        assert (cause.kind, cause.mechanism) == ("state_mutation", "attribute"), cause.detail
        assert cause.tensor == f"blocks.{i}.mixer.after_mix.p"  # the first dropout to draw, in the forward
        assert "was 0.2 in the forward and 0.18 in the recompute" in cause.detail
        assert cause.names == [f"blocks.{i}.mixer.after_mix.p", f"blocks.{i}.ffn.hidden_dropout.p"]
        assert region.suggestions[0].title == (f"Change `blocks.{i}.mixer.after_mix.p`, "
                                               f"`blocks.{i}.ffn.hidden_dropout.p` after the backward, not between "
                                               "forward and backward")
        assert region.checkpoint_options["preserve_rng_state"] is True
    found = candidates(report)
    assert [c.kind for c in found] == ["restore", "no_ac"]  # preserve_rng_state is on already: not a remedy
    assert found[0].spec.restore == ["blocks.*.ffn.hidden_dropout.p", "blocks.*.mixer.after_mix.p"]


def test_restoring_every_annealed_probability_gives_the_gradients_without_ac():
    torch.manual_seed(0)
    reference = _annealed_step(_NoAC(annealed_dropout.Net()))  # the same model and draws, without AC
    spec = RemedySpec(restore=["blocks.*.ffn.hidden_dropout.p", "blocks.*.mixer.after_mix.p"])
    patch = CheckpointPatch(spec).install()
    try:
        torch.manual_seed(0)
        restored = _annealed_step(annealed_dropout.Net())
    finally:
        patch.uninstall()
    assert all(torch.equal(a, b) for a, b in zip(restored, reference))


class _NoAC(nn.Module):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.blocks = net.blocks

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.e2e
def test_fix_restores_every_annealed_probability_and_skips_preserve_rng(tmp_path):
    json_path = tmp_path / "fix.json"
    proc = run_cli("fix", "-o", str(tmp_path / "out"), "--json", str(json_path), "--steps", "1",
                   annealed_dropout.__file__)
    assert json_path.exists(), proc.stderr[-3000:]
    fixes = json.loads(json_path.read_text())["fixes"]
    tried = [t for t in fixes["tries"] if t["status"] != "untested"]
    assert [t["status"] for t in tried] == ["verified"], fixes
    assert tried[0]["args"] == ["--restore-in-recompute", "blocks.*.ffn.hidden_dropout.p",
                                "--restore-in-recompute", "blocks.*.mixer.after_mix.p"]
    assert tried[0]["gradients"] == "bit-identical"
    assert not any("preserve_rng" in t["remedy"] for t in fixes["tries"])
    assert proc.returncode == 0, proc.stdout[-3000:]


class _GroupShuffle(nn.Module):
    """A regulariser: the hidden channels split into groups concatenated in an order Python draws (`random.shuffle`,
    or the next order of a schedule the module keeps), inside the checkpointed region."""

    def __init__(self, by_random: bool) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 32), nn.Linear(32, 8)
        self.by_random = by_random
        self.orders = __import__("itertools").cycle([[1, 0, 3, 2], [2, 3, 0, 1]])

    def forward(self, x):
        chunks = list(torch.relu(self.fc1(x)).chunk(4, dim=-1))
        if self.by_random:
            import random
            random.shuffle(chunks)
        else:
            chunks = [chunks[i] for i in next(self.orders)]
        return x + self.fc2(torch.cat(chunks, dim=-1))


@pytest.mark.parametrize("by_random", [True, False])
def test_tensors_python_hands_an_op_in_another_order_are_not_a_nondeterministic_kernel(tmp_path, by_random):
    """A stranger's channel-group shuffle: the recompute's cat reads the same chunks in another order, none of which
    differed. It read as "cat returned other values from identical inputs (a nondeterministic kernel)", fixed by
    deterministic algorithms; it is Python's choice: the host draw where there is one, else Python state."""

    random.seed(0)
    torch.manual_seed(0)
    block, path = _GroupShuffle(by_random), tmp_path / "t.jsonl"
    with ac_diff.record(path):
        cp.checkpoint(block, torch.randn(4, 8, requires_grad=True), use_reentrant=False).sum().backward()
    report = ac_diff.diagnose_paths([path])
    assert report.verdict == "diverged", report.headline
    cause = report.regions[0].cause
    if by_random:
        assert (cause.kind, cause.mechanism) == ("rng", "host_rng") and "`random`" in cause.detail, cause
    else:
        assert cause.kind == "control_flow" and "other tensors than the forward did" in cause.detail, cause


PACK_CTX: dict = {"doc_ids": None}  # a packing context the collator fills and the attention reads


class PackedAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.v = nn.Linear(8, 8)

    def forward(self, x):
        doc = PACK_CTX["doc_ids"]
        mask = (doc[:, None] == doc[None, :]).float()
        return mask @ self.v(x)


def test_a_tensor_in_a_module_level_context_is_named_by_it(tmp_path):
    """Two micro-batches forwarded before one backward, each setting the module-level packing context: the first
    one's recompute reads the second's document ids. The tensor is named where the code finds it."""
    torch.manual_seed(0)
    model = PackedAttention()
    with ac_diff.record(tmp_path / "t.jsonl"):
        losses = []
        for n in (3, 5):
            PACK_CTX["doc_ids"] = torch.arange(6) // n
            losses.append(cp.checkpoint(model, torch.randn(6, 8), use_reentrant=False).sum())
        sum(losses).backward()
    region = ac_diff.diagnose_paths([tmp_path / "t.jsonl"]).regions[0]
    assert region.status == "diverged" and region.cause.tensor == "test_python_state.PACK_CTX['doc_ids']", \
        region.cause


def _scale_now(calls=[0]):  # noqa: B006 (the state under test: a mutable default that lasts from call to call)
    calls[0] += 1
    return 1.0 if calls[0] <= 3 else 0.5


class HelperCounted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.fc(x) * _scale_now())


def test_a_count_a_helpers_mutable_default_keeps_is_named(tmp_path):
    """`_scale_now(calls=[0])`, called by the forward: the recompute advances the count again, and in step 2 it
    crosses the threshold between the passes. The cause names the default's item (it said "a Python value passed to
    aten.mul changed ... updated before the backward, or drawn on the host")."""
    _scale_now.__defaults__[0][0] = 0
    report = _record(tmp_path, lambda: [cp.checkpoint(HelperCounted(), torch.randn(2, 8, requires_grad=True),
                                                      use_reentrant=False).sum().backward() for _ in range(2)])
    region = _diverged(report)[0]
    assert region.cause.tensor == f"{__name__}._scale_now.calls[0]", region.cause
    assert "counts twice" in region.cause.detail


class _LayerDrop(nn.Module):
    """LayerDrop drawn with Python's `random` inside the block (26a), or handed the draw (`skip`) from outside."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, skip=None):
        if skip is None:
            skip = random.random() < 0.1
        return x if skip else x + torch.tanh(self.fc(x))


@pytest.mark.parametrize("inside", [True, False])
def test_a_host_draw_the_recompute_repeats_is_never_clean(tmp_path, inside):
    """A LayerDrop drawn with `random.random()` inside checkpointed blocks: each recompute draws again (this time on
    the same side of p), so Python's generator advances twice per step and a later step's draws differ from a run
    without AC (torch raised a CheckpointError at step 5, the gradients differed from step 4). It read CLEAN with
    `--check` exit 0 until a redraw flipped a branch; now at risk, the host draw named. Drawn outside and passed
    in: clean."""

    torch.manual_seed(0)
    random.seed(0)
    blocks = nn.ModuleList(_LayerDrop() for _ in range(3))

    def step():
        h = torch.randn(4, 8)
        for block in blocks:
            h = (cp.checkpoint(block, h, use_reentrant=False) if inside else
                 cp.checkpoint(block, h, random.random() < 0.1, use_reentrant=False))
        h.square().sum().backward()

    report = _record(tmp_path, step)
    if not inside:
        assert report.verdict == "clean", report.headline
        return
    assert report.title == "GRADIENTS AT RISK", report.headline
    for region in report.regions:
        assert (region.cause.kind, region.cause.mechanism) == ("rng", "host_rng"), region.cause
        assert region.suggestions[0].title.startswith("Draw the host random values outside the checkpointed region")


class _CutMix(nn.Module):
    """CutMix inside the block: the box drawn with Python's `random`, its area ratio kept for the loss (`self.lam`)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x):
        h = torch.tanh(self.conv(x))
        rh, rw = random.randint(1, 7), random.randint(1, 7)
        cy, cx = random.randint(0, 8 - rh), random.randint(0, 8 - rw)
        mask = torch.zeros(1, 1, 8, 8)
        mask[..., cy:cy + rh, cx:cx + rw] = 1
        self.lam = 1 - rh * rw / 64
        return h * (1 - mask) + h.flip(0) * mask


def test_what_the_forward_sets_from_host_draws_is_not_the_cause(tmp_path):
    """29e: the box of a CutMix drawn with `random` inside the region, whose ratio the block keeps for the loss: the
    recompute draws another box. The cause read "the Python attribute `lam` was unset in the forward and 0.5625 in
    the recompute: the region's forward changed it after reading it" (the block never reads it), its fix "pass the
    value in, not self.lam"; it is the host draw, named at its line."""
    torch.manual_seed(0)
    random.seed(0)
    block = _CutMix()
    report = _record(tmp_path, lambda: cp.checkpoint(block, torch.randn(2, 4, 8, 8), use_reentrant=False)
                     .square().sum().backward())
    region = _diverged(report)[0]
    assert (region.cause.kind, region.cause.mechanism) == ("rng", "host_rng"), region.cause
    assert "lam" not in (region.cause.tensor or "") and "random" in region.cause.detail, region.cause


HOOK_STATE = {"batches": 0}  # a global dict of the script's own, which a forward pre-hook counts in


def _annealing_pre_hook(module, inputs):
    HOOK_STATE["batches"] += 1
    return (inputs[0] / max(1.0, 2.0 - HOOK_STATE["batches"] / 4),)


def test_a_pre_hook_counting_in_a_global_dict_is_named_as_counted_twice(tmp_path):
    """26b: a router's pre-hook anneals a temperature from a count it keeps in a global dict; the recompute runs the
    hook again and counts twice. The cause read "a Python value passed to aten.div.Tensor changed between the forward
    and the recompute ... updated before the backward", the fix "change it after loss.backward()". The globals a
    module's hooks read are recorded as its forward's are: the dict's count, counted twice."""
    HOOK_STATE["batches"] = 0
    torch.manual_seed(0)
    net = Layers(InForward)
    for layer in net.layers:
        layer.fc.register_forward_pre_hook(_annealing_pre_hook)
    report = _record(tmp_path, lambda: net(torch.randn(4, 8)).pow(2).sum().backward())
    regions = _diverged(report)
    assert regions, report.headline
    flag = f"{__name__}.HOOK_STATE['batches']"
    assert all(r.cause.tensor == flag and "counts twice" in r.cause.detail for r in regions), \
        [r.cause for r in regions]


WARMUP_COUNTS: dict = {}  # empty until a pre-hook counts each block's calls in it


class _WarmedUp(InForward):
    def __init__(self, name: str = "b") -> None:
        super().__init__()
        self.name = name

    def forward(self, x):
        alpha = min(1.0, WARMUP_COUNTS[self.name] / 10.0)
        return x + alpha * torch.tanh(self.fc(x))


def _count_calls(module, inputs):
    WARMUP_COUNTS[module.name] = WARMUP_COUNTS.get(module.name, 0) + 1


def test_a_count_a_pre_hook_keeps_in_a_global_dict_empty_at_first_is_never_clean(tmp_path):
    """26i: a pre-hook counts each block's calls in a module-level dict that starts empty, the block's forward reads
    the count for a warmup scale: the recompute counts again (the gradients differ from step 2). It read CLEAN: the
    dict was empty when its reads were first worked out, so it was never recorded."""
    WARMUP_COUNTS.clear()
    torch.manual_seed(0)
    net = Layers(_WarmedUp)
    for i, layer in enumerate(net.layers):
        layer.name = f"b{i}"
        layer.register_forward_pre_hook(_count_calls)

    def steps():
        for _ in range(2):
            net(torch.randn(4, 8)).pow(2).sum().backward()

    report = _record(tmp_path, steps)
    assert report.title == "GRADIENTS AT RISK", report.headline
    assert f"{__name__}.WARMUP_COUNTS['b0']" in report.headline, report.headline


class _Staged(nn.Module):
    """A curriculum block: its activation follows the stage a config dict it holds names (relu saves its output, gelu
    its input: torch's early stop ends the recompute before gelu runs)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.cfg = nn.Linear(8, 8), {"stage": 1}

    def forward(self, x):
        h = self.fc(x)
        return torch.relu(h) if self.cfg["stage"] == 1 else torch.nn.functional.gelu(h)


def test_a_config_dict_changed_between_forward_and_backward_is_named_and_changed_after_the_backward(tmp_path):
    """27i: a curriculum callback moves `cfg["stage"]` between the forward and the backward. With every recorded op
    matching (the recompute's branch saved the addmm's output for gelu where the forward saved relu's, and stopped),
    the cause was "unknown"; where named, the fix said "Do not change `blocks.0.cfg` in the checkpointed forward" with
    a generation cache's `.append(...)`: the forward never changes it. The position saved from another op is the
    branch, and a dict's setting changed outside the forward is named by its key and changed after the backward, as any
    attribute."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([_Staged()])

        def forward(self, x):
            return cp.checkpoint(self.blocks[0], x, use_reentrant=False)

    torch.manual_seed(0)
    net = Net()

    def step():
        out = net(torch.randn(4, 8, requires_grad=True))
        net.blocks[0].cfg["stage"] = 2  # (the callback, before the backward)
        out.sum().backward()

    (region,) = _diverged(_record(tmp_path, step))
    name = "blocks.0.cfg['stage']"  # (a dict's scalar items are recorded by key: "a dict of 1 entry ... other items")
    assert (region.cause.kind, region.cause.tensor) == ("control_flow", name), region.cause
    assert "position 2: the output of aten.relu.default in the forward" in region.cause.detail, region.cause.detail
    assert f"`{name}` was 1 in the forward and 2 in the recompute" in region.cause.detail, region.cause.detail
    fix = region.suggestions[0]
    assert fix.title == f"Change `{name}` after the backward, not between forward and backward", fix.title
    assert "past keys" not in fix.text, fix.text


_SEEN: list = []  # (a module-level list the forward appends a statistic to, read by gradient hooks)


class _Logged(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        _SEEN.append(float(x.detach().var()))  # (before the last saved tensor: the recompute runs it again)
        return torch.tanh(self.fc(x))


def test_a_module_level_list_the_forward_appends_to_is_a_repeated_update(tmp_path):
    """28b: a global list the forward appends to (gradient hooks scale by its length) got a second entry from each
    recompute: CLEAN with no note. A global list is recorded by its length and items: the repeated update is named."""
    torch.manual_seed(0)
    _SEEN.clear()
    block = _Logged()

    def step():
        cp.checkpoint(block, torch.randn(4, 8, requires_grad=True), use_reentrant=False).sum().backward()

    report = _record(tmp_path, step)
    assert len(_SEEN) == 2
    assert report.verdict == "clean" and "the recompute repeats the updates of" in report.headline, report.headline
    assert "_SEEN" in report.headline, report.headline


def test_the_fix_names_a_field_of_the_modules_run_config_as_its_code_reads_it():
    """33f: `blocks.0.cfg.amp_dtype` changed before the backward: the fix's code read "computes with `value`, not
    self.amp_dtype"; the module's code reads self.cfg.amp_dtype."""
    from ac_diff.diagnosis.suggest import _under

    assert _under("blocks.0.cfg.amp_dtype", "blocks.0") == "cfg.amp_dtype"
    assert _under("blocks.0.temperature", "blocks.0") == "temperature"
    assert _under("blocks.10.scale", "blocks.1") == "scale"  # (another module's: its last part)
    assert _under("scale", None) == "scale"
