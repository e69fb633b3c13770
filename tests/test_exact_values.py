"""Saved tensors are compared exactly: one element one ulp off is a divergence, and an input a few ulps off that the
region's ops round away is none. Both with a buffer moved between the forward and the backward (a logit prior, a
calibration offset: the update a training loop makes right after the forward), the gradients with and without AC
compared bit for bit first."""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as cp

import ac_diff


class _PriorHead(nn.Module):
    """A classifier with a logit-adjustment prior (log class frequencies) kept as a buffer."""

    def __init__(self, d: int, classes: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d, classes, bias=False)
        self.register_buffer("log_prior", -0.5 + torch.rand(classes, generator=torch.Generator().manual_seed(1)))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return F.softmax(self.proj(torch.tanh(h)) + self.log_prior, dim=-1)


def _prior_steps(path, ac: bool) -> list[list[torch.Tensor]]:
    """Two steps of batch 1; the prior of the label just seen moves (a few ulps) after the forward, before the
    backward: the recompute's saved softmax differs from the forward's in one element, by about one ulp."""
    torch.manual_seed(0)
    body, head = nn.Linear(32, 32), _PriorHead(32, 8192)
    grads = []
    with ac_diff.record(path) if ac else contextlib.nullcontext():
        for _ in range(2):
            x, y = torch.randn(1, 32), torch.randint(0, 8192, (1,))
            h = body(x)
            p = cp.checkpoint(head, h, use_reentrant=False) if ac else head(h)
            loss = -torch.log(p[0, y]).sum() + 0.1 * (p * p).sum()
            with torch.no_grad():
                head.log_prior[y] += 4e-8
            loss.backward()
            grads.append([q.grad.clone() for q in (*body.parameters(), *head.parameters())])
            body.zero_grad(), head.zero_grad()
    return grads


def test_one_element_one_ulp_off_in_a_large_saved_tensor_is_a_divergence(tmp_path):
    with_ac, without = _prior_steps(tmp_path / "t.jsonl", True), _prior_steps(None, False)
    assert not all(torch.equal(a, b) for a, b in zip(with_ac[0], without[0]))  # (the truth: step 1 differs)
    report = ac_diff.diagnose_paths([tmp_path / "t.jsonl"])
    assert report.verdict == "diverged", report.headline
    first = report.regions[0]
    assert first.status != "clean" and first.cause.kind == "state_mutation", first.cause
    assert "log_prior" in first.cause.tensor


class _Gate(nn.Module):
    """tanh(x w + offset), `offset` a running calibration buffer."""

    def __init__(self, n: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        offset = torch.randn(n, generator=g).abs() + 1.0
        self.w = nn.Parameter(torch.randn(n, generator=g))
        self.register_buffer("offset", offset)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x * self.w + self.offset)


def _gate_step(path, ac: bool) -> list[torch.Tensor]:
    """One step; the offset's first element is nudged two ulps after the forward: tanh, saturated there, rounds the
    change away, so the saved tanh output (and every gradient) is bit-identical."""
    gate = _Gate(64)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=g)[2].requires_grad_()
    with ac_diff.record(path) if ac else contextlib.nullcontext():
        y = cp.checkpoint(gate, x, use_reentrant=False) if ac else gate(x)
        with torch.no_grad():
            for _ in range(2):
                gate.offset[0] = torch.nextafter(gate.offset[0], torch.tensor(100.0))
        y.sum().backward()
    return [gate.w.grad, x.grad]


def test_an_input_a_few_ulps_off_that_the_region_rounds_away_is_no_divergence(tmp_path):
    with_ac, without = _gate_step(tmp_path / "t.jsonl", True), _gate_step(None, False)
    assert all(torch.equal(a, b) for a, b in zip(with_ac, without))  # (the truth: identical)
    report = ac_diff.diagnose_paths([tmp_path / "t.jsonl"])
    assert report.verdict == "clean", report.headline
    assert any("harmless for the gradients" in note for note in report.regions[0].notes), report.regions[0].notes
    # the offset did change: measured, so the recompute's add differs, and tanh's saved output is measured the same
    assert report.regions[0].changed_inputs and report.regions[0].changed_inputs[0]["name"] == "offset"
