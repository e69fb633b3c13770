"""Selective AC's cache is the forward's own tensor: an op served from it is never a divergence.

The mechanism: the MoE's load-balancing `expert_bias` is updated in a forward hook (between the forward
and the backward's recompute), but the region saves `topk` with selective AC, so the recompute reuses the
forward's expert choice. The bias change reaches only `scores + expert_bias`, which feeds the cached topk
alone: the gradients are bit-identical to a run without AC, and the run is clean. Without the SAC policy
the same change flips the routing and the region diverges (the control that makes the test able to fail).
"""

from __future__ import annotations

import contextlib
import functools
import sys

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import (CheckpointError, CheckpointPolicy, checkpoint,
                                   create_selective_checkpoint_contexts)

import ac_diff
from conftest import EXAMPLES

sys.path.insert(0, str(EXAMPLES))
import tiny_moe  # noqa: E402


def _save_topk(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op == torch.ops.aten.topk.default else CheckpointPolicy.PREFER_RECOMPUTE


class Checkpointed(nn.Module):
    def __init__(self, block: nn.Module, mode: str) -> None:
        super().__init__()
        self.block, self.mode = block, mode

    def forward(self, x):
        if self.mode == "none":
            return self.block(x)
        context = functools.partial(create_selective_checkpoint_contexts, _save_topk) if self.mode == "sac" else None
        return checkpoint(self.block, x, use_reentrant=False, **({"context_fn": context} if context else {}))


def _step(mode: str, path=None):
    args = tiny_moe.ModelArgs(n_layers=2, dim=32, hidden_dim=32)
    torch.manual_seed(0)
    model = tiny_moe.Transformer(args)
    for name, block in list(model.layers.named_children()):
        model.layers.register_module(name, Checkpointed(block, mode))
    for moe in model.moe_layers():  # the bias changes between the forward and the recompute
        moe.register_forward_hook(lambda mod, inputs, output: tiny_moe.update_expert_bias(mod))
    inputs, labels = tiny_moe.make_batch(args, 0, seq_len=32)
    with ac_diff.record(path) if path is not None else contextlib.nullcontext():
        loss = tiny_moe.loss_fn(model(inputs), labels)
        loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_a_state_change_that_only_reaches_a_cached_op_is_clean(tmp_path):
    plain_loss, plain_grads = _step("none")
    loss, grads = _step("sac", tmp_path / "sac" / "trace-rank0.jsonl")
    assert torch.equal(loss, plain_loss) and all(torch.equal(grads[k], plain_grads[k]) for k in grads)

    report = ac_diff.diagnose_paths([str(tmp_path / "sac")]).to_json()
    assert report["verdict"] == "clean", report["headline"]
    region = report["regions"][0]
    cached = [p for p in region["positions"] if p["cached"]]
    assert cached and {p["op"] for p in cached} == {"aten.topk.default"}
    assert not any(p["values_differ"] for p in region["positions"])
    assert any("selective AC's cache" in n and str(cached[0]["position"]) in n for n in region["notes"])
    # the change itself was measured (the bias add), and said to be harmless
    assert any("aten.add.Tensor" in n and "harmless" in n for n in region["notes"])


def test_the_same_change_without_the_cache_diverges(tmp_path):
    with pytest.raises(CheckpointError):  # the routing flips: other split sizes
        _step("full", tmp_path / "full" / "trace-rank0.jsonl")
    report = ac_diff.diagnose_paths([str(tmp_path / "full")]).to_json()
    assert report["verdict"] == "diverged"
    diverged = [r for r in report["regions"] if r["status"] == "diverged"]
    assert diverged and diverged[0]["cause"]["tensor"].endswith("moe.expert_bias")


class Branching(nn.Module):
    """Shifts its activations while `shift` is set: a Python attribute the recompute reads as it is then."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.shift = False

    def forward(self, x):
        h = self.fc(x)
        if self.shift:
            h = h + 1.0  # (the branch the recompute takes: an op that saves nothing, so torch's own check is silent)
        return torch.relu(h)


def _save_matmuls(ctx, op, *args, **kwargs):
    aten = torch.ops.aten
    return CheckpointPolicy.MUST_SAVE if op in (aten.mm.default, aten.addmm.default) \
        else CheckpointPolicy.PREFER_RECOMPUTE


@pytest.mark.parametrize("mode", ["full", "watch"])
def test_a_recompute_that_takes_a_branch_selective_ac_refuses_diverged_there(tmp_path, mode):
    """`shift` is set between the forward and the backward: the recompute runs an extra `add`, which selective AC's
    storage does not hold, and torch raises "aten.add.Tensor encountered during backward but not found in storage",
    naming no region. The report names the region, the branch and the attribute, not "the recompute raised"."""
    torch.manual_seed(0)
    block, x = Branching(), torch.randn(4, 8, requires_grad=True)
    context = functools.partial(create_selective_checkpoint_contexts, _save_matmuls)
    options = {"watch": True, "watch_full_steps": 0} if mode == "watch" else {}
    with pytest.raises(RuntimeError, match="not found in storage"):
        with ac_diff.record(tmp_path / "trace-rank0.jsonl", **options):
            out = checkpoint(block, x, use_reentrant=False, context_fn=context)
            block.shift = True
            out.sum().backward()
    report = ac_diff.diagnose_paths([str(tmp_path)]).to_json()
    assert report["verdict"] == "diverged"
    assert [(e["kind"], e["region"]) for e in report["torch_errors"]] == [("sac_not_found", 0)]
    region = report["regions"][0]
    assert region["status"] == "diverged", region.get("unchecked_reason")
    if mode == "watch":  # no ops recorded: the error is what says it diverged
        return
    assert region["cause"]["kind"] == "control_flow" and "shift" in region["cause"]["detail"]
    branch = region["first_control_divergence"]
    assert branch["op"] == "aten.relu.default" and branch["recompute_index"] is not None
    line = Branching.forward.__code__.co_firstlineno + 3
    assert "aten.add.Tensor" in branch["summary"] and f"test_sac_cache.py:{line} in forward" in branch["summary"]
    assert "selective AC refused" in branch["summary"]


class _DroppedFFN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.drop = nn.Linear(16, 16), nn.Dropout(0.25)

    def forward(self, x):
        return torch.tanh(self.drop(self.fc(x)))


def _dropout_grads(save: set, preserve: bool, path=None, checkpointed: bool = True) -> list:
    """Two steps of a dropout block under a selective-AC policy that MUST_SAVEs `save`; the weight's gradients."""
    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    torch.manual_seed(0)
    block, grads = _DroppedFFN(), []
    with ac_diff.record(path) if path is not None else contextlib.nullcontext():
        for _ in range(2):
            x = torch.randn(8, 16, requires_grad=True)
            y = checkpoint(block, x, use_reentrant=False, preserve_rng_state=preserve,
                           context_fn=functools.partial(create_selective_checkpoint_contexts, policy)) \
                if checkpointed else block(x)
            try:
                y.sum().backward()
            except RuntimeError:
                return grads
            grads.append(block.fc.weight.grad.clone())
            block.zero_grad()
    return grads


def test_a_policy_that_saves_a_tensor_the_forward_changes_in_place_is_named_with_the_fix(tmp_path):
    """Saving dropout's `bernoulli_` and `div_` (CPU dropout makes its mask in place): torch raises "Tensor cached
    during selective activation checkpoint has been mutated". The cause names the saved op and the one that changed
    its tensor (it was "unknown: no recorded evidence"), and the policy the fix prints, applied, gives the gradients
    of a run without AC."""
    bernoulli, div = torch.ops.aten.bernoulli_.float, torch.ops.aten.div_.Scalar
    assert _dropout_grads({bernoulli, div}, False, tmp_path / "t.jsonl") == []  # (torch raised in the first backward)
    report = ac_diff.diagnose_paths([tmp_path / "t.jsonl"])
    region = next(r for r in report.regions if r.status == "diverged")
    assert region.cause.kind == "sac_policy" and region.cause.names == ["aten.bernoulli_.float", "aten.div_.Scalar"], \
        region.cause
    fix = region.suggestions[0]
    assert "torch.ops.aten.bernoulli_.float, torch.ops.aten.div_.Scalar" in fix.code and "preserve_rng_state=True" \
        in fix.code
    fixed = _dropout_grads({torch.ops.aten.mm.default, torch.ops.aten.addmm.default}, True)  # (what the fix leaves)
    assert len(fixed) == 2 and all(torch.equal(a, b) for a, b in zip(fixed, _dropout_grads(set(), True,
                                                                                             checkpointed=False)))


class _ScaledScores(nn.Module):
    """Attention scores from a matmul, scaled in place (`mul_`, to save memory) or out of place."""

    def __init__(self, in_place: bool) -> None:
        super().__init__()
        self.qk, self.in_place = nn.Linear(16, 32, bias=False), in_place

    def forward(self, x):
        q, k = self.qk(x).chunk(2, -1)
        scores = q @ k.transpose(-1, -2)
        scores = scores.mul_(0.25) if self.in_place else scores * 0.25
        return scores.softmax(-1) @ x


def _scores_grads(in_place: bool, checkpointed: bool, path=None) -> list:
    save = {torch.ops.aten.bmm.default, torch.ops.aten.mm.default}

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    torch.manual_seed(0)
    block, grads = _ScaledScores(in_place), []
    with ac_diff.record(path) if path is not None else contextlib.nullcontext():
        for _ in range(2):
            x = torch.randn(2, 6, 16, requires_grad=True)
            y = checkpoint(block, x, use_reentrant=False,
                           context_fn=functools.partial(create_selective_checkpoint_contexts, policy)) \
                if checkpointed else block(x)
            y.pow(2).sum().backward()
            grads.append(block.qk.weight.grad.clone())
            block.zero_grad()
    return grads


def test_a_saved_matmul_scaled_in_place_through_its_view_is_the_policy_not_a_nondeterministic_kernel(tmp_path):
    """`scores.mul_(scale)` on a saved bmm's output (through matmul's `_unsafe_view`): torch raises nothing, the
    recompute scales the cached tensor a second time, and the gradients are wrong. It read "nondeterministic_op:
    mul_ returned other values from identical inputs"; the fix that keeps the policy makes the scaling out of place,
    which gives the gradients of a run without AC."""
    with_ac = _scores_grads(True, True, tmp_path / "t.jsonl")
    assert not all(torch.equal(a, b) for a, b in zip(with_ac, _scores_grads(True, False)))  # the ground truth
    region = next(r for r in ac_diff.diagnose_paths([tmp_path / "t.jsonl"]).regions if r.status == "diverged")
    assert region.cause.kind == "sac_policy" and region.cause.names == ["aten.bmm.default", "aten.mul_.Tensor"], \
        region.cause
    assert region.suggestions[0].title.startswith("Make mul_ out of place") and "x.mul(" in region.suggestions[0].code
    assert all(torch.equal(a, b) for a, b in zip(_scores_grads(False, True), _scores_grads(False, False)))
