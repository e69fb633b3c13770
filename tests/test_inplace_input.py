"""A region that writes its own input in place (`x += self.pos` as a block's first line) is named from the forward's
trace, and `ac-diff fix` treats a failure that only happens with AC as a checkpointing defect.

checkpoint keeps the region's input to recompute from it; the in-place add changes that very tensor, so torch's
version check stops the backward before any recompute, while the run without AC trains (tests/stacks/
inplace_input.py). Before: "the script crashed before any region was recomputed", no cause; `fix` exited 0 with
"the script failed on its own ... before any remedy could be tried".
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

import ac_diff
from ac_diff.fix.ac_only import fails_only_with_ac
from ac_diff.fix.candidates import candidates
from ac_diff.fix.tries import Measured
from ac_diff.passes import InputRef, Pass, Position
from ac_diff.reference.grads import FORMAT_VERSION as GRADS_VERSION
from conftest import run_cli
from factories import meta, op, param_ref, region, run
from stacks.runs import STACKS

sys.path.insert(0, str(STACKS))  # the scripts import their shared loop and model
import inplace_input  # noqa: E402


def _line_of(text: str) -> int:
    return next(i for i, line in enumerate(open(inplace_input.__file__).read().splitlines(), 1) if text in line)


def test_a_region_writing_its_input_in_place_is_named(tmp_path):
    path = tmp_path / "trace-rank0.jsonl"
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        with ac_diff.record(path):
            inplace_input.main(["--steps", "1"])
    report = ac_diff.diagnose_paths([path])
    assert report.verdict == "diverged" and "modifies its own input in place" in report.headline
    assert [r.status for r in report.regions] == ["diverged", "diverged"]
    r = report.regions[0]
    assert (r.cause.kind, r.cause.mechanism, r.cause.tensor) == ("state_mutation", "input_written", "input[0]")
    assert "aten.add_.Tensor" in r.cause.detail and f":{_line_of('x += self.pos  #')} " in r.cause.source
    assert not r.silent  # torch raised
    assert r.suggestions[0].code.startswith("x = x + self.pos")


def test_the_out_of_place_update_is_clean(tmp_path, monkeypatch):
    monkeypatch.setattr(inplace_input, "OUT_OF_PLACE", True)
    path = tmp_path / "trace-rank0.jsonl"
    with ac_diff.record(path):
        inplace_input.main(["--steps", "1"])
    assert ac_diff.diagnose_paths([path]).verdict == "clean"


def _stopped(forward: Pass) -> object:
    """A report of a run that raised before the region's recompute."""
    r = run(region(forward, None))
    r.exit_status, r.exc_type, r.exc_message = "exception", "RuntimeError", "boom"
    return ac_diff.diagnose([r])


def test_only_a_write_to_the_input_names_it():
    """A write to the input or a view of it names it; one to a tensor the region made does not."""
    x = InputRef("input", name="input[0]")
    written = Pass("forward", ops=[op(0, "aten.mul_.Tensor", module="layers.0", refs=[x, param_ref("layers.0.scale")],
                                      args=["$", "$"])])
    other = Pass("forward", ops=[op(0, "aten.add.Tensor", refs=[x, param_ref("layers.0.pos")], args=["$", "$"]),
                                 op(1, "aten.add_.Tensor", refs=[InputRef("op", 0), x], args=["$", "$"])])
    sliced = Pass("forward", ops=[op(0, "aten.select.int", refs=[x], args=["$", 1, 0]),
                                  op(1, "aten.add_.Scalar", refs=[InputRef("op", 0)], args=["$", 1.0])])
    assert _stopped(written).regions[0].suggestions[0].code.startswith("x = x * self.scale")
    assert _stopped(sliced).regions[0].cause.detail.startswith("the region modifies its own input in place")
    assert _stopped(other).regions[0].status == "unchecked"


def test_a_run_that_fails_only_with_ac_makes_its_unchecked_regions_suspects():
    forward = Pass("forward", ops=[op(0, "aten.mm.default")],
                   positions=[Position(0, meta(4, 4), "input", name="input[0]")])
    report = _stopped(forward)
    assert report.regions[0].status == "unchecked" and candidates(report) == []
    found = candidates(report, failed_with_ac=True)
    assert [(c.kind, c.spec.no_ac, c.why) for c in found] == [("no_ac", ["layers.0"], "the run fails only with AC")]


def test_fails_only_with_ac_needs_the_run_without_ac_to_get_further(tmp_path):
    def grads(name: str, steps: int):
        d = tmp_path / name
        d.mkdir()
        torch.save({"format": "ac-diff-grads", "version": GRADS_VERSION, "steps": [{}] * steps}, d / "grads-rank0.pt")
        return d

    log = tmp_path / "log"
    base, ref, short = grads("base", 0), grads("reference", 2), grads("short", 0)
    assert fails_only_with_ac(Measured(1.0, 1, log), base, Measured(1.0, 0, log), ref)
    assert not fails_only_with_ac(Measured(1.0, 1, log), base, Measured(1.0, 1, log), ref)  # it fails without AC too
    assert not fails_only_with_ac(Measured(1.0, 1, log), base, Measured(1.0, 0, log), short)  # it stopped first
    assert not fails_only_with_ac(Measured(1.0, 0, log), base, Measured(1.0, 0, log), ref)


@pytest.mark.e2e
def test_fix_treats_a_failure_only_with_ac_as_a_defect(tmp_path):
    json_path = tmp_path / "fix.json"
    proc = run_cli("fix", "-o", str(tmp_path / "out"), "--json", str(json_path), str(STACKS / "inplace_input.py"))
    fixes = json.loads(json_path.read_text())["fixes"]
    assert "failed on its own" not in fixes["headline"], fixes["headline"]
    assert [(t["remedy"], t["status"]) for t in fixes["tries"]] == [("no AC in layers.0, layers.1", "verified")]
    assert "only turning AC off works" in fixes["headline"]
    assert "out of place" in fixes["code_change"]
    assert proc.returncode == 1, proc.stdout + proc.stderr  # only turning AC off verified: not a fix that keeps AC


class _IndexedBias(torch.nn.Module):
    """Writes its routing bias through a view at an index its call counter picks (`bias.zero_()[i] = 0.5`), inside
    the checkpointed forward: the recompute writes elsewhere, with equal values."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(8, 4)
        self.register_buffer("bias", torch.zeros(4))
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        with torch.no_grad():
            self.bias.zero_()[self.calls % 4] = 0.5
        return (self.gate(x) + self.bias).softmax(-1)


def test_a_write_through_a_view_reaches_the_readers_of_its_base(tmp_path):
    """The readers of a tensor written through a view read that write: a value divergence after it is not blamed on
    "identical inputs" (before: the base's producer stayed its earlier `zero_`, and the equal written values hid the
    other index)."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    block = _IndexedBias()
    path = tmp_path / "trace-rank0.jsonl"
    with ac_diff.record(path):
        checkpoint(block, torch.randn(5, 8, requires_grad=True), use_reentrant=False).pow(2).sum().backward()
    report = ac_diff.diagnose_paths([path])
    assert report.verdict == "diverged"
    first_value = report.regions[0].first_value_divergence
    assert first_value.op == "aten.add.Tensor", first_value
    assert "every input is identical" not in first_value.summary and "input already differed" in first_value.summary
    listed = report.regions[0].divergences()  # in forward order: the index that changed, then the sum it moved
    assert [d.kind for d in listed][:2] == ["argument", "value"], [(d.kind, d.forward_index) for d in listed]
