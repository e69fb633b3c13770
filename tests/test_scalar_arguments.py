"""A Python float a region's code computes with, which its recompute computes again a few ulps off in double
(a running mean `0.9 * r + 0.1 * v` where the forward set `r = v`): the kernel of a float32 op casts it to
float32, where both are the same number, so nothing the op computed differs. Where the float differs in float32
too, it is a divergence (the same update, a step later)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as cp

import ac_diff


class NormalisedHead(nn.Module):
    """A task head whose loss is divided by a running mean of itself, updated in its own forward (so twice a step
    under AC: the recompute runs it again)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
        self.running = None

    def forward(self, h, y):
        loss = F.mse_loss(self.net(h), y)
        v = loss.item()
        self.running = v if self.running is None else 0.9 * self.running + 0.1 * v
        return loss / self.running


def _train(ac: bool, steps: int = 3) -> list[list[torch.Tensor]]:
    torch.manual_seed(5)  # (its first loss v: 0.9 * v + 0.1 * v is v + 1 ulp in double, v in float32)
    trunk, head = nn.Linear(8, 16), NormalisedHead()
    grads = []
    for _ in range(steps):
        x = torch.randn(32, 8)
        h = trunk(x)
        loss = cp.checkpoint(head, h, x[:, :1] * 3, use_reentrant=True) if ac else head(h, x[:, :1] * 3)
        loss.backward()
        grads.append([p.grad.clone() for p in (*trunk.parameters(), *head.parameters())])
        trunk.zero_grad(), head.zero_grad()
    return grads


def test_a_float_a_few_ulps_off_in_double_but_equal_in_float32_is_no_divergence(tmp_path):
    """33c: the first step's recompute divided by `0.9 * v + 0.1 * v`, one ulp off `v` in double: SILENTLY DIVERGED
    led with that step ("the gradients are silently wrong"), whose gradients are bit-identical to the run without
    AC; they differ from the second step on (the running mean, updated twice, moved)."""
    path = tmp_path / "trace-rank0.jsonl"
    with ac_diff.record(path, write="all"):
        with_ac = _train(True)
    without = _train(False)
    same = [all(torch.equal(a, b) for a, b in zip(s, t)) for s, t in zip(with_ac, without)]
    assert same == [True, False, False]  # (the truth)
    report = ac_diff.diagnose_paths([path])
    assert report.verdict == "diverged", report.headline
    statuses = [(r.step, r.status) for r in report.regions]
    assert statuses[0] != (1, "diverged") and (2, "diverged") in statuses, statuses
    first = min((r for r in report.regions if r.status == "diverged"), key=lambda r: r.region)
    assert first.step == 2 and first.cause.tensor.endswith("running"), (first.step, first.cause)


class GeM(nn.Module):
    """Generalised-mean pooling whose exponent a schedule anneals to 2 (set before the backward, by mistake)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.proj = nn.Linear(16, 16), nn.Linear(16, 4)
        self.p = 2.000000000000005

    def forward(self, x):  # (proj saves what pow computed)
        return self.proj(self.fc(x).clamp_min(1e-6).pow(self.p)).mean(0)


def test_an_exponent_equal_in_float32_still_moves_pow_and_is_named(tmp_path):
    """34c: pow branches on its exponent's exact double value (x * x for 2.0), so 2.000000000000005 and 2.0, the same
    float32, compute other values: the rule that let such a float pass hid the argument, and the first divergence
    read "values differ although every input is identical" (a nondeterministic kernel's words)."""
    torch.manual_seed(0)
    pool, x = GeM(), torch.randn(64, 16)
    assert not torch.equal(x.pow(2.000000000000005), x.pow(2.0))  # (the kernel's own branch)
    path = tmp_path / "trace-rank0.jsonl"
    with ac_diff.record(path, write="all"):
        out = cp.checkpoint(pool, x, use_reentrant=False)
        pool.p = 2.0
        out.sum().backward()
    (region,) = ac_diff.diagnose_paths([path]).regions
    arg = region.first_argument_divergence
    assert arg is not None and arg.op == "aten.pow.Tensor_Scalar", region.divergences()
