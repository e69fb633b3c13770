"""A list or dict the checkpointed region was given, changed by the caller between the forward and the backward
(Transformer-XL's memory of past segments, appended to before one backward over several segments): checkpoint keeps
the object, not a copy, so the recompute reads the new items. Named as the region's argument, with its fix."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint as cp

import ac_diff
from ac_diff.trace import read_run


class MemoryLayer(nn.Module):
    """Attention over the memory of past segments and the segment itself."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.ff = nn.Linear(d, d)

    def forward(self, x, mems):
        ctx = torch.cat([*mems[-2:], x], 1) if mems else x
        return x + self.ff(self.attn(x, ctx, ctx, need_weights=False)[0])


def _train(tmp_path, remember, reentrant: bool = False):
    torch.manual_seed(0)
    layers = nn.ModuleList(MemoryLayer() for _ in range(2))
    mems = [[torch.zeros(2, 4, 16)] for _ in layers]  # (the memory starts as zeros, as Transformer-XL's)
    with ac_diff.record(tmp_path / "t.jsonl"):
        loss = 0
        for _ in range(2):  # two segments, one backward
            h, new = torch.randn(2, 4, 16, requires_grad=reentrant), []
            for layer, mem in zip(layers, mems):
                new.append(h.detach())
                h = cp.checkpoint(layer, h, mem, use_reentrant=reentrant)
            loss = loss + h.square().mean()
            remember(mems, new)
        with contextlib.suppress(cp.CheckpointError):  # (a recompute whose memory window grew raises)
            loss.backward()
    return ac_diff.diagnose([read_run(tmp_path / "t.jsonl")])


def _append(mems, new):
    for mem, m in zip(mems, new):
        mem.append(m)


def _replace(mems, new):  # (a fixed-size memory: its item swapped for the newest)
    for mem, m in zip(mems, new):
        mem[0] = m


@pytest.mark.parametrize("remember, held", [(_append, "held 2 item(s) in the forward and 3 in the recompute"),
                                            (_replace, "held other items in the recompute than in the forward")])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_a_list_argument_the_caller_changes_before_the_backward_is_named(tmp_path, remember, held, reentrant):
    report = _train(tmp_path, remember, reentrant)
    assert report.verdict == "diverged", report.headline
    assert "input[1], a list, held" in report.headline, report.headline
    for region in (r for r in report.regions if r.status == "diverged"):
        assert (region.cause.kind, region.cause.tensor, region.cause.mechanism) == (
            "state_mutation", "input[1]", "argument_items"), region.cause
        fix = region.suggestions[0]
        assert fix.title.startswith("Give the region a copy of its input[1] (list)") and "list(mems)" in fix.code
    second = next(r for r in report.regions if r.region == 2)  # (layers.0 in the second segment: its window of the
    # memory keeps its length as the list grows, so its recompute runs to the end)
    assert held in second.cause.detail and "a list" in second.cause.detail, second.cause.detail


def test_a_list_argument_left_alone_is_clean(tmp_path):
    """The caller keeps the new memories for the next step instead: every list the regions got holds what it did."""
    kept = []
    report = _train(tmp_path, lambda mems, new: kept.append(new))
    assert report.verdict == "clean", report.headline
    assert not any("arguments" in r.state_changes for r in report.regions)


def test_a_replaced_tensor_is_another_item_even_at_the_freed_ones_address():
    """CPython hands a freed tensor's address, its id, to the next tensor allocated: a memory whose item was replaced
    by such a tensor digested as unchanged, and the flaky cause fell back to "the captured tensor ... was modified"."""
    from ac_diff.capture.pystate import container_summary

    mems = [torch.zeros(2, 4)]
    before, address = container_summary(mems), id(mems[0])
    for _ in range(100):  # (the allocator reuses the freed block at once; a few tries make sure)
        mems[0] = torch.zeros(2, 4)
        if id(mems[0]) == address:
            break
    assert id(mems[0]) == address  # the case itself: the new tensor sits where the old one was
    assert container_summary(mems)["ids"] != before["ids"]
    assert container_summary(mems) == container_summary(mems)  # the same items: the same digest
