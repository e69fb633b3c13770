"""torch.compile around and inside checkpointed regions (`tests/stacks/compiled_blocks.py`, backend aot_eager:
through Dynamo and AOTAutograd without a C++ compiler): ac-diff never crashes the run, says which modules
ran compiled and what that means for the recording, and still diagnoses what it can see.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from ac_diff.capture.compiled import CompileWatch, EagerStance, compile_kind, skip_when_compiling, tracing
from ac_diff.trace import read_run
from stacks.runs import STACKS, Job, run_all

SCRIPT = str(STACKS / "compiled_blocks.py")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_all(tmp_path_factory.mktemp("compile"), {
        # a compiled submodule (fullgraph=True) inside each checkpointed block, with a real divergence in it
        "inner": Job([SCRIPT, "--compile", "inner", "--fullgraph", "--dropout", "0.1", "--no-preserve-rng"]),
        # torchtitan: each layer = torch.compile(checkpoint_wrapper(block), fullgraph=True)
        "block": Job([SCRIPT, "--compile", "block", "--fullgraph"]),
        # the workaround the report gives: --scope all runs compiled code eagerly, regions included
        "around_scope_all": Job([SCRIPT, "--compile", "around"], options=["--scope", "all"]),
    })


@pytest.mark.e2e
def test_compiled_submodule_inside_regions_is_named_and_the_divergence_still_found(runs):
    r = runs["inner"]
    assert r.returncode == 0, r.explain()
    report = r.report
    assert [g["module"] for g in report["regions"]] == ["layers.0", "layers.1"] * 2
    for g in report["regions"]:
        assert g["status"] == "diverged" and g["silent"]
        assert g["cause"]["kind"] == "rng"
        # the compiled graph's ops (aot_eager runs them as aten ops) belong to the compiled module
        assert g["first_value_divergence"]["module"] == f"{g['module']}.ff"
    note = next(n for n in report["notes"] if n.startswith("torch.compile"))
    assert "layers.0.ff, layers.1.ff" in note and "ran compiled" in note
    run = read_run(r.trace_dir / "trace-rank0.jsonl")
    assert [g.compiled for g in run.regions] == [["layers.0.ff"], ["layers.1.ff"]] * 2
    assert "torch.compile" in r.stdout  # the terminal report shows the note too


@pytest.mark.e2e
def test_torchtitan_per_block_fullgraph_compile_does_not_crash_and_says_why_no_region_ran(runs):
    r = runs["block"]
    assert r.returncode == 0, r.explain()  # the training itself ran, compiled
    assert "step 1: loss" in r.stdout
    report = r.report
    assert report["regions"] == []
    note = next(n for n in report["notes"] if n.startswith("torch.compile"))
    assert "compiled module(s) layers.0, layers.1 ran outside any recorded region" in note
    assert "no checkpointed region ran" in note and "--scope all" in note


@pytest.mark.e2e
def test_scope_all_records_the_regions_of_a_compiled_model_eagerly(runs):
    r = runs["around_scope_all"]
    assert r.returncode == 0, r.explain()
    report = r.report
    assert report["verdict"] == "clean", report["headline"]
    assert [g["module"] for g in report["regions"]] == ["layers.0", "layers.1"] * 2
    assert any(n.startswith("torch.compile: Net ran eagerly") for n in report["notes"])


# -- in process ---------------------------------------------------------------------------------------
def _blocks(compile_how: str) -> nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch.manual_seed(0)
    layers = nn.Sequential(*[nn.Sequential(nn.LayerNorm(8), nn.Sequential(nn.Linear(8, 8), nn.GELU()))
                             for _ in range(2)])
    for i, block in enumerate(layers):
        if compile_how == "method":  # (fullgraph=True fails here without ac-diff too: torch 2.13 meets the
            block[1].compile(backend="aot_eager")  # region's pack hook, a skipped frame, inside the graph)
        layers[i] = checkpoint_wrapper(block)
    return torch.compile(layers, backend="aot_eager") if compile_how == "around" else layers


@pytest.mark.parametrize("how", ["method", "around"])
def test_in_process_recording_of_compiled_models(tmp_path, how):
    import ac_diff

    model = _blocks(how)
    try:
        with ac_diff.record(tmp_path / "t.jsonl"):
            for _ in range(2):
                model(torch.randn(4, 8)).sum().backward()
    finally:
        torch._dynamo.reset()
    run = read_run(tmp_path / "t.jsonl")
    if how == "method":  # block[1].compile(): compiled in place, runs compiled inside the regions; its module
        # hooks are part of the compiled code, so its ops (the graph's, run by aot_eager) belong to the block
        assert [g.module for g in run.regions] == ["0", "1"] * 2
        linear = [o for o in run.regions[0].forward.ops if o.op == "aten.addmm.default"]
        assert linear and linear[0].module == "0"
        assert ac_diff.diagnose([run]).verdict == "clean"
    else:  # torch.compile(model) over checkpoint_wrapper'd blocks: no crash, no region, and why
        note = next(n for n in run.notes if n.startswith("torch.compile"))
        assert run.regions == []
        assert "Sequential ran outside any recorded region" in note and "no checkpointed region ran" in note


# -- units ------------------------------------------------------------------------------------------
def test_compile_kind():
    plain = nn.Linear(2, 2)
    assert compile_kind(plain) is None
    assert compile_kind(torch.compile(nn.Linear(2, 2), backend="eager")) == "torch.compile(module)"
    in_place = nn.Linear(2, 2)
    in_place.compile(backend="eager")
    assert compile_kind(in_place) == "module.compile()"


def test_skip_when_compiling_and_tracing_are_false_in_eager_code():
    calls = []
    hook = skip_when_compiling(lambda *a: calls.append(a) or "ran")
    assert hook(1, 2) == "ran" and calls == [(1, 2)]
    assert tracing() is False
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        assert tracing() is True


def test_eager_stance_nests_and_restores():
    import torch._dynamo.eval_frame as ef

    before = ef._stance
    stance = EagerStance()
    stance.push()
    stance.push()
    assert ef._stance.stance == "force_eager"
    stance.pop()
    assert ef._stance.stance == "force_eager"
    stance.pop()
    assert ef._stance is before
    stance.pop()  # unbalanced pops are harmless
    assert ef._stance is before


def test_compile_watch_messages():
    class Region:
        number = 3

    watch = CompileWatch()
    compiled = torch.compile(nn.Linear(2, 2), backend="eager")
    assert watch.saw(nn.Linear(2, 2), "layers.0.ff", Region()) is None
    assert watch.saw(compiled, "layers.0.ff", Region()) == "torch.compile(module)"
    assert watch.saw(compiled, "", None) == "torch.compile(module)"
    assert watch.inside == {3: ["layers.0.ff"]} and watch.outside == {"Linear": "torch.compile(module)"}
    inside, outside = watch.messages(regions_seen=1)
    assert "layers.0.ff ran inside checkpointed region(s) 3" in inside
    assert "Linear ran outside any recorded region" in outside
