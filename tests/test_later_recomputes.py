"""A region recomputed by more than one backward: `torch.autograd.grad(..., retain_graph=True)` recomputes it once,
a later `.backward()` through the same graph again, from the state of then. Each recompute is compared with the
forward: a first one that reproduced it does not make the region clean when a later one, whose saved tensors that
later backward's gradients come from, did not."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint

import ac_diff


def maml(steps: int = 2, adapt: bool = True) -> None:
    """Sequential adaptation in the style of MAML: each task's checkpointed loss reads the `fast` weights dict, its
    gradient (autograd.grad, the graph retained) updates the dict for the next task, and the meta-backward through
    every task's loss recomputes each region again, reading the dict as it is then (`adapt`: updated since)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(net.parameters(), lr=1e-2)
    for _ in range(steps):
        fast = dict(net.named_parameters())

        def task_loss(x, y):
            return F.mse_loss(functional_call(net, fast, (x,)), y)

        losses = []
        for t in range(2):
            x = torch.randn(8, 4)
            y = (x * (t + 1)).sin().sum(-1, keepdim=True)
            loss = checkpoint(task_loss, x, y, use_reentrant=False)
            losses.append(loss)
            grads = torch.autograd.grad(loss, list(fast.values()), retain_graph=True)
            if adapt:
                fast.update({k: v - 0.05 * g for (k, v), g in zip(fast.items(), grads)})
        opt.zero_grad()
        torch.stack(losses).mean().backward()
        opt.step()


MODES = {"full": {}, "full, every pass written": {"write": "all"}, "watch": {"watch": True, "watch_full_steps": 0}}


@pytest.mark.parametrize("mode", MODES)
def test_a_later_recompute_that_diverges_is_reported(mode, tmp_path):
    with ac_diff.record(tmp_path / "t.jsonl", **MODES[mode]):
        maml(steps=3)
    report = ac_diff.diagnose_paths([tmp_path / "t.jsonl"])
    assert report.verdict == "diverged" and report.silent, report.headline
    lead = report.lead_groups()[0][0]
    assert lead.recompute_n == 2 and "recompute 2 (a later backward's)" in report.headline, report.headline
    assert any(n.startswith("recompute 2 of 2 diverged") for n in lead.notes), lead.notes
    if mode == "watch":  # its module recorded in full after it: the later recomputes diverge there too, and the
        # watched function regions are named as the full recording names them
        assert report.watch["escalated"][0]["full_diverged"] >= 1, report.watch["escalated"]
        assert len({r.module for r in report.regions}) == 1
    lead = min((r for r in report.regions if not r.watched), key=lambda r: r.region)
    assert lead.cause.kind == "state_mutation" and lead.first_value_divergence is not None
    # the dict's new tensors were bound in place of the weights: not an update in place (an optimizer step)
    assert lead.cause.mechanism == "rebound", lead.cause
    assert lead.suggestions[0].title == "Pass the weights the region computes with to checkpoint as arguments"


@pytest.mark.parametrize("mode", MODES)
def test_recomputes_that_all_reproduce_the_forward_are_clean(mode, tmp_path):
    """The same loop without the update between the backwards: both recomputes reproduce the forward."""
    with ac_diff.record(tmp_path / "t.jsonl", **MODES[mode]):
        maml(adapt=False)
    report = ac_diff.diagnose_paths([tmp_path / "t.jsonl"])
    assert report.verdict == "clean", report.headline


def test_the_forwards_kept_for_a_later_recompute_go_with_their_graph(tmp_path):
    """A reproduced region's forward is kept while a backward can still recompute it (retain_graph). Its liveness
    was a weak reference to the region, which the kept forward itself referred to: it never died, so every step's
    forwards piled up to a quarter of --hold-bytes (a stranger's 2000-step run: +434 MB of peak memory, linear in
    the steps). It follows torch's checkpoint frame now: one step's regions at most are kept."""
    torch.manual_seed(0)
    blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(2))
    import gc

    with ac_diff.record(tmp_path / "t.jsonl") as recorder:
        for step in range(31):
            if step == 30:
                gc.collect()  # (a frame caught in a reference cycle goes at a collection; the next step prunes it)
            x = torch.randn(4, 8, requires_grad=True)
            for block in blocks:
                x = checkpoint(block, x, use_reentrant=False)
            x.sum().backward()
        kept = len(recorder._retention._reproduced)
    assert kept <= 2, kept
    report = ac_diff.diagnose_paths([tmp_path / "t.jsonl"])
    assert report.verdict == "clean" and len(report.regions) == 62, report.headline


class HeatResidual(nn.Module):
    """A PINN's residual u_t - k u_xx, its derivatives taken with autograd.grad(create_graph=True) inside the
    checkpointed region: each grad unpacks what the forward saved so far, so torch recomputes the region's prefix
    inside its own forward (twice), and the backward recomputes it whole. `scale`: a buffer the loop may move
    between the forward and the backward."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
        self.register_buffer("scale", torch.ones(()))

    def forward(self, xt):
        xt = xt.clone().requires_grad_(True)
        u = self.net(xt) * self.scale
        du = torch.autograd.grad(u.sum(), xt, create_graph=True)[0]
        u_xx = torch.autograd.grad(du[:, :1].sum(), xt, create_graph=True)[0][:, :1]
        return du[:, 1:] - 0.1 * u_xx


@pytest.mark.parametrize("moved", [False, True])
def test_a_region_that_takes_derivatives_with_autograd_grad_is_compared_prefix_by_prefix(moved, tmp_path):
    """28a: a PINN whose residual runs autograd.grad inside the region (gradients bit-identical, torch silent) read
    DIVERGED "unknown": the recomputes its own forward ran saved a prefix (8 and 17 of 38 tensors), positions the
    alignment leaves out (the engine's detaches) were "saved by the recompute only", and in later steps the forward,
    summarized, could not be compared at all. Clean now in every step; the buffer moved before the backward is
    found."""
    torch.manual_seed(0)
    model = HeatResidual()
    with ac_diff.record(tmp_path / "trace-rank0.jsonl"):
        for _ in range(3):
            r = checkpoint(model, torch.rand(32, 2), use_reentrant=False)
            if moved:
                with torch.no_grad():
                    model.scale.mul_(1.01)
            r.pow(2).mean().backward()
    report = ac_diff.diagnose_paths(tmp_path)
    if moved:
        assert report.verdict == "diverged", report.headline
        assert report.regions[0].cause.tensor.endswith("scale"), report.regions[0].cause
    else:
        assert report.verdict == "clean" and [r.status for r in report.regions] == ["clean"] * 3, report.headline
