"""Elementwise ops of measured inputs are recorded but not fingerprinted ("derived", flag 8): their values
follow bit for bit from their inputs', so the first divergence is never at one of them, and the
diagnosis infers whether their outputs (and the saved positions they fill) differ. What changes is the
recorder's cost, not the report: these tests run the same real divergence with and without the option
that fingerprints them too.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as cp

import ac_diff
from ac_diff.trace import read_run


class ScaledBlock(nn.Module):
    """mm (measured) -> silu, mul (derived) -> * buffer (an input from outside: measured) -> tanh (derived)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8) / 3)
        self.register_buffer("scale", torch.ones(8))

    def forward(self, x):
        h = torch.mm(x, self.w)
        y = F.silu(h) * h
        return torch.tanh(y * self.scale)


def _run(path, update_between: bool, **options):
    torch.manual_seed(0)
    block = ScaledBlock()
    x = torch.randn(4, 8, requires_grad=True)
    with ac_diff.record(path, **options):
        loss = cp.checkpoint(block, x, use_reentrant=False).sum()
        if update_between:  # a buffer updated in place after the forward, before backward recomputes it
            with torch.no_grad():
                block.scale.mul_(1.5)
        loss.backward()
    return read_run(path)


def _ops(run, phase="forward"):
    return {o.op: o for o in getattr(run.regions[0], phase).ops}


def test_elementwise_ops_of_measured_inputs_are_marked_derived_and_not_fingerprinted(tmp_path):
    ops = _ops(_run(tmp_path / "t.jsonl", False))
    assert ops["aten.mm.default"].fingerprint and not ops["aten.mm.default"].derived
    for name in ("aten.silu.default", "aten.tanh.default"):
        assert ops[name].derived and ops[name].fingerprint is None
    # `y * scale` reads a buffer from outside the region: where an outside change would first show
    scaled = [o for o in _run(tmp_path / "u.jsonl", False).regions[0].forward.ops if o.op == "aten.mul.Tensor"]
    assert [o.derived for o in scaled] == [True, False] and scaled[1].fingerprint


def test_the_option_fingerprints_every_elementwise_op(tmp_path):
    ops = _run(tmp_path / "t.jsonl", False, fingerprint_derived=True).regions[0].forward.ops
    assert not any(o.derived for o in ops)
    assert all(o.fingerprint for o in ops if o.op in ("aten.silu.default", "aten.tanh.default"))


def test_a_divergence_reads_the_same_with_and_without_derived_fingerprints(tmp_path):
    reports = []
    for measure_all in (False, True):
        run = _run(tmp_path / f"t{measure_all}.jsonl", True, fingerprint_derived=measure_all)
        reports.append(ac_diff.diagnose([run]).regions[0])
    lean, full = reports
    assert lean.status == full.status == "diverged"
    assert lean.cause.kind == full.cause.kind
    assert lean.first_value_divergence.op == full.first_value_divergence.op == "aten.mul.Tensor"
    assert lean.first_value_divergence.forward_index == full.first_value_divergence.forward_index
    assert any("scale" in str(c) for c in lean.changed_inputs)
    # tanh saves its output: measured different in both runs (in the lean one by the tensor it saved)
    by_op = [{p.op: p.values_differ for p in r.positions} for r in reports]
    assert by_op[0]["aten.tanh.default"] is by_op[1]["aten.tanh.default"] is True
    assert by_op[0] == by_op[1]
    tanh_rows = [[row.marker for row in r.window if "tanh" in (row.forward or "")] for r in reports]
    assert tanh_rows == [["value"], ["value"]], tanh_rows


def test_a_clean_recompute_stays_clean_with_derived_ops(tmp_path):
    region = ac_diff.diagnose([_run(tmp_path / "t.jsonl", False)]).regions[0]
    assert region.status == "clean" and region.first_value_divergence is None
    assert not any(p.values_differ for p in region.positions)
