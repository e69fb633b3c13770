"""The recorder on every checkpoint variant: regions, phases, op counts, modules and saved positions."""

from __future__ import annotations

import pytest
import torch

import ac_diff
from models import VARIANT_PARAMS, VARIANTS, Net, record_step, wrapped_net


def _ops(p):
    return [o.op for o in p.ops if o.op != "aten.detach.default"]


@pytest.mark.parametrize("variant", VARIANT_PARAMS)
def test_each_variant_records_both_passes_of_every_region(variant, tmp_path):
    torch.manual_seed(0)
    model = Net(VARIANTS[variant])
    _, run = record_step(model, tmp_path / "t.jsonl")

    assert [r.region for r in run.regions] == [0, 1]
    assert [r.module for r in run.regions] == ["layers.0", "layers.1"]
    assert all(r.kind == ("reentrant" if variant == "reentrant" else "checkpoint") for r in run.regions)
    for r in run.regions:
        fwd, rec = r.forward, r.recompute
        assert fwd.phase == "forward" and rec.phase == "recompute"
        assert _ops(fwd) == ["aten.t.default", "aten.addmm.default", "aten.relu.default", "aten.t.default",
                             "aten.addmm.default", "aten.sin.default"]
        if variant in ("reentrant", "early_stop_off"):
            assert _ops(rec) == _ops(fwd)  # the whole region reruns
            assert not rec.stopped_early
        elif variant == "sac":
            assert _ops(rec) == _ops(fwd)[:5]
            assert [o.op for o in rec.ops if o.cached] == ["aten.addmm.default", "aten.addmm.default"]
            assert r.options["sac"] is True
        else:
            assert _ops(rec) == _ops(fwd)[:5]  # early stop at the last saved tensor: sin is not recomputed
            assert rec.stopped_early
        if variant == "reentrant":
            assert fwd.positions == [] and rec.positions == []  # reentrant checkpoint saves nothing itself
        else:
            assert len(fwd.positions) == len(rec.positions) == 6
            assert [p.position for p in fwd.positions] == list(range(6))

    report = ac_diff.diagnose([run])
    assert report.verdict == "clean", report.headline


def test_region_options_are_recorded(tmp_path):
    _, run = record_step(Net(VARIANTS["determinism_none"]), tmp_path / "t.jsonl")
    assert run.regions[0].options["determinism_check"] == "none"
    _, run = record_step(Net(VARIANTS["early_stop_off"]), tmp_path / "u.jsonl")
    assert run.regions[0].options["early_stop"] is False
    assert run.regions[0].options["preserve_rng_state"] is True


def test_checkpoint_wrapper_names_strip_the_wrapper(tmp_path):
    torch.manual_seed(0)
    _, run = record_step(wrapped_net(), tmp_path / "t.jsonl")
    assert [r.module for r in run.regions] == ["layers.0", "layers.1"]
    for r in run.regions:
        for p in (r.forward, r.recompute):
            modules = {o.module for o in p.ops}
            assert modules == {f"layers.{r.region}", f"layers.{r.region}.up", f"layers.{r.region}.down"}


def test_nested_regions_have_parents(tmp_path):
    import torch.nn as nn
    import torch.utils.checkpoint as cp

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.pre = nn.Linear(8, 8)
            self.inner = Net(VARIANTS["non_reentrant"], n=1)

        def forward(self, x):
            return cp.checkpoint(self.inner, self.pre(x), use_reentrant=False)

    class Top(nn.Module):
        def __init__(self):
            super().__init__()
            self.outer = Outer()

        def forward(self, x):
            return cp.checkpoint(self.outer, x, use_reentrant=False)

    torch.manual_seed(0)
    _, run = record_step(Top(), tmp_path / "t.jsonl")
    by_module = {(r.module, r.parent_phase): r for r in run.regions}
    outer = by_module[("outer", None)]
    assert outer.parent is None
    children = [r for r in run.regions if r.parent == outer.region]
    assert children, [(r.region, r.module, r.parent) for r in run.regions]
    assert all(r.module == "outer.inner" for r in children)
    # the inner region is entered again when the outer one recomputes: that instance says so
    assert {r.parent_phase for r in children} >= {"forward"}
    assert ac_diff.diagnose([run]).verdict == "clean"


def test_module_fqns_are_right_during_recompute(tmp_path):
    import sys
    from conftest import EXAMPLES

    sys.path.insert(0, str(EXAMPLES))
    import tiny_moe

    torch.manual_seed(0)
    model = tiny_moe.Transformer(tiny_moe.ModelArgs(n_layers=2))
    tiny_moe.apply_ac(model, mode="checkpoint_wrapper")
    tokens = torch.randint(0, 256, (2, 32))
    with ac_diff.record(tmp_path / "t.jsonl"):
        model(tokens).float().pow(2).mean().backward()
    run = ac_diff.load(tmp_path / "t.jsonl")
    ops = run.ops
    rec = ops[ops.phase == "recompute"]
    assert set(run.regions.module) == {"layers.0", "layers.1"}
    assert {"layers.1.moe.router.gate", "layers.1.moe.experts", "layers.1.attention.wq"} <= set(rec.module)
    assert not any("_checkpoint_wrapped_module" in str(m) for m in ops.module)
    topk = rec[rec.op == "aten.topk.default"]
    assert set(topk.module) == {"layers.0.moe.router", "layers.1.moe.router"}


def test_a_recorder_failure_never_reaches_the_training(tmp_path, monkeypatch):
    from ac_diff.capture.fingerprint import FingerprintBatch
    from models import train_step

    def broken(self, t, *args, **kwargs):
        raise RuntimeError("simulated recorder bug")

    torch.manual_seed(0)
    model = Net(VARIANTS["non_reentrant"])
    expected = train_step(model)
    for p in model.parameters():
        p.grad = None
    monkeypatch.setattr(FingerprintBatch, "add", broken)
    with ac_diff.record(tmp_path / "t.jsonl") as rec:
        loss, grads = train_step(model)
    assert torch.equal(loss, expected[0]) and all(torch.equal(grads[k], expected[1][k]) for k in grads)
    assert rec.errors and "simulated recorder bug" in rec.errors[0]
    assert any("simulated recorder bug" in n for n in ac_diff.load(tmp_path / "t.jsonl").runs[0].notes)


def test_missing_private_internals_degrade_with_a_warning(tmp_path, monkeypatch):
    import torch.utils.checkpoint as cp

    monkeypatch.delattr(cp, "_recomputation_hook")
    with pytest.warns(RuntimeWarning, match="cannot see non-reentrant checkpoint regions"):
        with ac_diff.record(tmp_path / "t.jsonl"):
            torch.manual_seed(0)
            Net(VARIANTS["reentrant"])(torch.randn(2, 8, requires_grad=True)).sum().backward()
    trace = ac_diff.load(tmp_path / "t.jsonl")
    assert any("cannot see" in n for n in trace.runs[0].notes)
    assert len(trace.regions) == 2  # reentrant regions are still seen through CheckpointFunction


def test_checkpoint_sequential_names_segments_and_modules(tmp_path):
    """checkpoint_sequential on a Sequential nobody calls: regions are segments, modules their indices
    (its last segment runs without checkpoint)."""
    from torch.utils.checkpoint import checkpoint_sequential

    from ac_diff.trace import read_run

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    x = torch.randn(4, 8, requires_grad=True)
    with ac_diff.record(tmp_path / "t.jsonl"):
        checkpoint_sequential(model, 2, x, use_reentrant=False, preserve_rng_state=False).sum().backward()
    run = read_run(tmp_path / "t.jsonl")
    assert [r.module for r in run.regions] == ["segment 0-1"]
    modules = {o.op: o.module for o in run.regions[0].forward.ops}
    assert modules["aten.addmm.default"] == "0" and modules["aten.bernoulli_.float"] == "1"
    region = ac_diff.diagnose([run]).regions[0]
    assert region.cause.kind == "rng" and region.first_value_divergence.module == "1"

    # the Sequential held by the model the loop holds: named by its place there (was "0", "1"), and that model by its
    # variable (`model`, another model, trains beside it)
    torch.manual_seed(0)
    held = torch.nn.ModuleDict({"net": torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5),
                                                           torch.nn.ReLU(), torch.nn.Linear(8, 1))})
    with ac_diff.record(tmp_path / "held.jsonl"):
        checkpoint_sequential(held["net"], 2, x, use_reentrant=False, preserve_rng_state=False).sum().backward()
    ops = {o.op: o.module for o in read_run(tmp_path / "held.jsonl").regions[0].forward.ops}
    assert ops["aten.addmm.default"] == "held.net.0" and ops["aten.bernoulli_.float"] == "held.net.1", ops


def test_a_rank_its_launcher_did_not_start_under_ac_diff_says_the_others_are_missing(tmp_path, monkeypatch):
    """Lightning's ddp strategy re-launches the other ranks as plain python: the one recorded rank's trace
    says so. (The process group is a one-process gloo group; its reported size is what the check reads.)"""
    import torch.distributed as dist

    from ac_diff.trace import read_run

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: 2)
        with ac_diff.record(tmp_path / "t.jsonl"):
            pass
    finally:
        monkeypatch.undo()
        dist.destroy_process_group()
    notes = read_run(tmp_path / "t.jsonl").notes
    assert any("only this one was recorded" in n and "--nproc-per-node 2" in n for n in notes)


def test_a_checkpointed_function_is_named_after_itself_when_it_does_more_than_call_a_module(tmp_path):
    from ac_diff.trace import read_run

    torch.manual_seed(0)
    gate = torch.nn.Linear(8, 4)
    block = torch.nn.Linear(8, 8)

    def route(x):  # a module call, then work of its own
        return gate(x).softmax(-1).topk(2, dim=-1).values.sum() * x

    def wrapper(x):  # nothing but a module call: named after the module
        return block(x)

    x = torch.randn(4, 8, requires_grad=True)
    with ac_diff.record(tmp_path / "t.jsonl"):
        torch.utils.checkpoint.checkpoint(route, x, use_reentrant=False).sum().backward()
        torch.utils.checkpoint.checkpoint(wrapper, x, use_reentrant=False).sum().backward()
    names = [r.module for r in read_run(tmp_path / "t.jsonl").regions]
    assert names[0].endswith("route") and names[1] == "block"  # (a second root: by its variable, not "Linear")


def test_reentrant_recompute_aligns_a_clone_the_forward_also_made(tmp_path):
    """A reentrant recompute has clones of its own (autograd's), and here also one the forward made
    (`.contiguous()` of a transpose): the latter is matched, so the first divergence is the dropout."""
    from ac_diff.trace import read_run

    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)

    def block(x):
        h = lin(x).t().contiguous().t()
        return torch.nn.functional.dropout(h, 0.5, training=True) * 2

    x = torch.randn(4, 8, requires_grad=True)
    with ac_diff.record(tmp_path / "t.jsonl"):
        torch.utils.checkpoint.checkpoint(block, x, use_reentrant=True, preserve_rng_state=False).sum().backward()
    region = ac_diff.diagnose([read_run(tmp_path / "t.jsonl")]).regions[0]
    assert region.cause.kind == "rng"
    assert region.first_divergence().op.startswith("aten.bernoulli") or \
        region.first_divergence().op.startswith("aten.native_dropout")


class _InferenceConstants(torch.nn.Module):
    """A block that builds a constant under torch.inference_mode (a mask, a position table) and computes with it, with
    dropout: inference tensors keep no version counter (reading `_version` raises)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x):
        with torch.inference_mode():
            table = torch.arange(8.0) / 8
        return self.drop(self.lin(x) + table.clone()) * table.clone()


@pytest.mark.parametrize("watch", [False, True])
@pytest.mark.parametrize("preserve", [True, False])
def test_a_region_that_makes_inference_tensors_is_recorded(tmp_path, preserve, watch):
    """27c: a block with an inference_mode constant failed the recorder on every op after it ("Inference tensors do
    not track version counter"): NOTHING CHECKED. Recorded, it is clean with its RNG state preserved, and diverged
    (rng) without it: the dropout mask drawn again."""
    torch.manual_seed(0)
    block = _InferenceConstants()
    options = {"watch": True, "watch_full_steps": 0} if watch else {}
    with ac_diff.record(tmp_path / "t.jsonl", **options):
        for _ in range(2):
            x = torch.randn(4, 8, requires_grad=True)
            out = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False, preserve_rng_state=preserve)
            out.sum().backward()
    report = ac_diff.diagnose_paths([tmp_path / "t.jsonl"])
    assert not any("recorder error" in n for n in report.notes), report.notes
    assert report.verdict == ("clean" if preserve else "diverged"), report.headline
    if not preserve and not watch:
        assert report.regions[0].cause.kind == "rng", report.regions[0].cause
