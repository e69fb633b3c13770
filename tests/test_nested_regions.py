"""A checkpoint inside a checkpointed block: the nested region's output reaches the outer region as a
tensor it did not make. It is named after the nested region (not "external[0]"), the outer region takes
the nested region's cause and fixes, and the nested forwards that run inside the outer recompute are
explained, not reported as never recomputed."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import ac_diff
from ac_diff.passes import NESTED_OUTPUT
from ac_diff.trace import read_run


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("temp", torch.ones(8))

    def forward(self, x):
        return torch.tanh(self.fc(x) / self.temp)


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(8, 8)
        self.inner = Inner()
        self.post = nn.Linear(8, 8)  # saves the nested region's output for its backward

    def forward(self, x):
        return x + self.post(checkpoint(self.inner, torch.relu(self.pre(x)), use_reentrant=False))


def _report(tmp_path, anneal: bool):
    torch.manual_seed(0)
    block = Outer()
    x = torch.randn(4, 8, requires_grad=True)
    with ac_diff.record(tmp_path / "t.jsonl"):
        loss = checkpoint(block, x, use_reentrant=False).pow(2).sum()
        if anneal:  # a temperature annealed between the forward and the backward
            with torch.no_grad():
                block.inner.temp.mul_(1.5)
        loss.backward()
    run = read_run(tmp_path / "t.jsonl")
    return run, ac_diff.diagnose([run])


def test_the_outer_region_names_the_nested_output_and_takes_its_cause(tmp_path):
    run, report = _report(tmp_path, anneal=True)
    outer = next(r for r in run.regions if r.module == "Outer")
    assert any(e.name == NESTED_OUTPUT + "inner" for e in outer.forward.externals)
    lead = report.regions[0]
    assert lead.status == "diverged" and lead.module == "Outer"
    assert lead.cause.kind == "state_mutation" and lead.cause.tensor == "inner.temp"
    assert "through the nested region inner" in lead.cause.detail
    assert lead.suggestions[0].title.startswith("Update `inner.temp`")


def test_nested_forwards_inside_the_outer_recompute_are_explained(tmp_path):
    run, report = _report(tmp_path, anneal=False)
    assert report.verdict == "clean"
    inside = [r for r in report.regions if r.status == "unchecked"]
    assert inside and all("inside region 0's recompute" in " ".join(r.notes) for r in inside)


class DroppedBlock(nn.Module):
    """Token dropout drawn from the block's own torch.Generator, which checkpoint does not restore."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.gen = torch.Generator().manual_seed(seed)

    def forward(self, x):
        keep = (torch.rand(x.shape[:1], generator=self.gen) > 0.3).float()[:, None]
        return x + torch.tanh(self.fc(x)) * keep


class Stage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([DroppedBlock(1), DroppedBlock(2)])

    def forward(self, x):
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return x


def test_a_nested_region_fed_by_the_enclosing_recompute_takes_its_cause(tmp_path):
    """The second block's input is the first block's output, which the enclosing stage's checkpoint keeps; in the
    backward the stage's recompute computes it again with other dropout draws, and hands that copy to the second
    block's recompute. Its input differs because the enclosing recompute diverged, not through the user's saved-tensor
    hooks (there are none) nor a write after the forward."""
    torch.manual_seed(0)
    stage = Stage()
    with ac_diff.record(tmp_path / "t.jsonl"):
        checkpoint(stage, torch.randn(6, 8), use_reentrant=False).pow(2).sum().backward()
    report = ac_diff.diagnose_paths([tmp_path / "t.jsonl"])
    second = next(r for r in report.regions if r.module == "blocks.1" and r.status == "diverged")
    assert second.enclosing == 0
    assert (second.cause.kind, second.cause.mechanism) == ("rng", "private_generator"), second.cause
    assert second.cause.detail.startswith("its input[0] came from the recompute of the enclosing region"), second.cause
    assert second.suggestions[0].title.startswith("Give the recompute the state your torch.Generator had")


class _KeepsFirst(Inner):
    """Keeps its first call's hidden state for a later look (a debugging stash): one more of its tensors is alive
    when the forward's nested pass ends than when the recompute's does."""

    def __init__(self) -> None:
        super().__init__()
        self.first_hidden = None

    def forward(self, x):
        hidden = self.fc(x)
        if self.first_hidden is None:
            self.first_hidden = hidden.detach()
        return torch.tanh(hidden / self.temp)


def test_the_nested_output_has_one_name_in_both_passes_whatever_else_stays_alive(tmp_path):
    """Nested outputs were numbered by their order among the nested pass's tensors still alive (`#0`, `#1`), or left
    unnumbered where one was: a stash (or selective AC's cache) that kept one more alive in the forward named the same
    output `... inner #1` there and `... inner` in the recompute (now: in the order the enclosing pass reads them),
    so the outer region did not see it change and its cause was "unknown" (a nested selective-AC block with a buffer
    updated in its forward)."""
    torch.manual_seed(0)
    block = Outer()
    block.inner = _KeepsFirst()
    with ac_diff.record(tmp_path / "t.jsonl"):
        loss = checkpoint(block, torch.randn(4, 8, requires_grad=True), use_reentrant=False).pow(2).sum()
        with torch.no_grad():
            block.inner.temp.mul_(1.5)
        loss.backward()
    lead = ac_diff.diagnose_paths([tmp_path / "t.jsonl"]).regions[0]
    assert lead.module == "Outer" and (lead.cause.kind, lead.cause.tensor) == ("state_mutation", "inner.temp"), \
        lead.cause


class _Warmed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.scale = nn.Linear(8, 8), 1.0

    def forward(self, x):
        return x + self.scale * torch.tanh(self.fc(x))


class _Outer(nn.Module):
    def __init__(self, ac: bool) -> None:
        super().__init__()
        self.inner, self.ac = _Warmed(), ac

    def forward(self, x):
        return checkpoint(self.inner, x, use_reentrant=True) if self.ac else self.inner(x)


def _nested_reentrant(ac: bool, scaled: bool) -> list:
    torch.manual_seed(0)
    emb, outer = nn.Linear(4, 8), _Outer(ac)
    h = emb(torch.randn(4, 4))
    loss = (checkpoint(outer, h, use_reentrant=True) if ac else outer(h)).pow(2).mean()
    if scaled:
        outer.inner.scale = 0.5  # (a warm-up schedule stepped before the backward)
    loss.backward()
    return [p.grad for p in (*emb.parameters(), *outer.parameters())]


@pytest.mark.parametrize("scaled", [True, False])
def test_a_nested_reentrant_region_is_compared_with_its_rerun_in_the_enclosing_recompute(tmp_path, scaled):
    """35e P1-2: the outer reentrant forward runs the inner checkpoint under no_grad (region 1: saves nothing, never
    recomputed); the outer recompute runs it again (region 2), which recomputes itself alike. The inner scale changed
    between the passes and every gradient differs, and it read CLEAN: region 1 is compared with region 2's forward."""
    same = all(torch.equal(a, b) for a, b in zip(_nested_reentrant(True, scaled), _nested_reentrant(False, scaled)))
    assert same is not scaled
    path = tmp_path / "t.jsonl"
    with ac_diff.record(path):
        _nested_reentrant(True, scaled)
    report = ac_diff.diagnose_paths([path])
    assert report.verdict == ("diverged" if scaled else "clean"), report.headline
    inner = next(r for r in report.regions if r.region == 1)
    assert any("compared with its rerun in the recompute of region 0" in n for n in inner.notes), inner.notes
    if scaled:
        assert inner.status == "diverged" and inner.cause.tensor.endswith("inner.scale"), inner.cause
        assert inner.cause.mechanism != "later_forward", inner.cause


def test_nested_reentrant_regions_over_several_steps_stay_clean(tmp_path):
    """36a P1-C: from the second step on, the reruns of the nested regions reproduced themselves and were summarized
    (their ops not kept), and the nested regions of the enclosing forward were compared with those empty passes: a
    control-flow divergence on every clean step. A summarized rerun is not compared."""
    torch.manual_seed(0)
    outer = _Outer(True)
    with ac_diff.record(tmp_path / "t.jsonl"):
        for _ in range(3):
            checkpoint(outer, torch.randn(4, 8, requires_grad=True), use_reentrant=True).pow(2).mean().backward()
    report = ac_diff.diagnose_paths([tmp_path / "t.jsonl"])
    assert report.verdict == "clean", report.headline
