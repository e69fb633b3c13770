"""torch.compile (inductor) inside checkpointed regions stays compiled while ac-diff records.

Inductor's dropout draws other numbers than eager dropout, so a recorder that ran compiled code eagerly
changed the very first loss. Here each block's feed-forward (with dropout) is compiled by inductor (CPU:
C++ kernels, gcc) inside a checkpointed block: the losses with and without ac-diff are bit-identical,
each compiled graph call is recorded as one step with fingerprinted outputs, and without a preserved RNG
state the divergence is placed at that call with cause `rng`.
"""

from __future__ import annotations

import re
import shutil

import pytest

from ac_diff.trace import read_run
from stacks.runs import STACKS, Job, run_all

SCRIPT = str(STACKS / "compiled_blocks.py")
ARGS = [SCRIPT, "--compile", "inner", "--backend", "inductor", "--dropout", "0.1", "--steps", "2"]

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(shutil.which("gcc") is None and shutil.which("cc") is None,
                                                  reason="inductor on CPU needs a C++ compiler")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_all(tmp_path_factory.mktemp("inductor"), {
        "plain": Job(ARGS, plain=True),
        "recorded": Job(ARGS),
        "no_rng": Job(ARGS[:-2] + ["--steps", "1", "--no-preserve-rng"]),
        "anneal": Job([SCRIPT, "--compile", "inner", "--backend", "inductor", "--anneal", "static", "--steps", "3"]),
        "anneal_dynamic": Job([SCRIPT, "--compile", "inner", "--backend", "inductor", "--anneal", "dynamic"]),
        "rebind": Job([SCRIPT, "--compile", "inner", "--backend", "inductor", "--rebind"]),
        "guard": Job([str(STACKS / "compiled_guard.py")]),
        "guard_fixed": Job([str(STACKS / "compiled_guard.py"), "--fixed"]),
    }, timeout=900)


def _losses(stdout: str) -> list[str]:
    return re.findall(r"exactly (\S+)\)", stdout)


def test_compiled_code_keeps_its_numbers_under_the_recorder(runs):
    plain, recorded = runs["plain"], runs["recorded"]
    assert plain.returncode == 0, plain.explain()
    assert recorded.returncode == 0, recorded.explain()
    assert len(_losses(plain.stdout)) == 2 and _losses(recorded.stdout) == _losses(plain.stdout)
    report = recorded.report
    assert report["verdict"] == "clean", report["headline"]
    run = read_run(recorded.trace_dir / "trace-rank0.jsonl")
    calls = [o for o in run.regions[0].forward.ops if o.op == "inductor_compiled_code"]
    assert len(calls) == 1 and calls[0].module == "layers.0.ff" and calls[0].random
    assert calls[0].fingerprint and all(fp is not None for fp in calls[0].fingerprint)
    assert calls[0].args[0].startswith("<compiled graph")  # no object address
    note = next(n for n in report["notes"] if n.startswith("torch.compile"))
    assert "ran compiled" in note


def test_a_divergence_inside_compiled_code_is_placed_at_the_call(runs):
    r = runs["no_rng"]
    assert r.returncode == 0, r.explain()
    for region in r.report["regions"]:
        assert region["status"] == "diverged" and region["silent"]
        assert region["cause"]["kind"] == "rng"
        first = region["first_value_divergence"]
        assert first["op"] == "inductor_compiled_code" and first["module"] == f"{region['module']}.ff"


def test_a_recompile_in_the_recompute_is_the_attribute_that_changed_in_every_step(runs):
    """A Python float the compiled feed-forward reads is lowered before each backward: Dynamo's guard on it fails in
    the recompute, which runs a graph compiled again. Every region says so (the attribute, at the compiled call); a
    recompute that compiled its graph again was read as 'another branch' where its forward reused one compiled in
    an earlier recompute: the graph returns the parameters it saves, which read as made by the forward's call."""
    r = runs["anneal"]
    assert r.returncode == 0, r.explain()
    regions = r.report["regions"]
    assert len(regions) == 6 and all(g["status"] == "diverged" and g["silent"] for g in regions)
    for g in regions:
        assert g["cause"]["kind"] == "state_mutation", (g["region"], g["cause"])
        assert g["cause"]["tensor"] == f"{g['module']}.ff.act_scale"
        assert "the recompute ran another compiled graph than the forward" in g["cause"]["detail"]
        assert g["first_control_divergence"] is None  # (it read "ran in the recompute but not in the forward")
        first = g["first_value_divergence"]
        assert first["op"] == "inductor_compiled_code" and first["module"] == f"{g['module']}.ff", first
        assert first["detail"]["differs"] == ["argument", "value"]  # another compiled graph, other values


def test_a_recompile_that_makes_torch_raise_is_another_compiled_graph_not_another_branch(runs):
    """With automatic dynamic shapes the lowered float becomes the recompiled graph's input: the recompute saves a
    scalar where the forward saved a weight, and torch raises. The region names the attribute and the other graph
    (it said "Python code took another branch")."""
    r = runs["anneal_dynamic"]
    assert r.returncode == 1, r.explain()  # (the script's CheckpointError)
    assert r.report["torch_error"]["kind"] == "metadata_mismatch"
    diverged = [g for g in r.report["regions"] if g["status"] == "diverged"]
    assert diverged and all(g["cause"]["tensor"] == f"{g['module']}.ff.act_scale" for g in diverged)
    detail = diverged[0]["cause"]["detail"]
    assert "another compiled graph than the forward" in detail and "took another branch" not in detail, detail


def test_a_buffer_rebound_before_the_backward_is_named_through_the_compiled_calls_inputs(runs):
    """The compiled feed-forward reads its `gain` buffer, which a schedule binds to a new tensor before the
    backward. Inductor's graph takes its inputs as one list it empties as it runs (the boxed calling convention): the
    call was recorded with no inputs, and the cause read "unknown". The recorder keeps a copy of that list, so the
    call's inputs are measured and the rebound buffer is the cause."""
    r = runs["rebind"]
    assert r.returncode == 0, r.explain()
    regions = r.report["regions"]
    assert regions and all(g["status"] == "diverged" and g["silent"] for g in regions)
    for g in regions:
        assert (g["cause"]["kind"], g["cause"]["tensor"]) == ("state_mutation", f"{g['module']}.ff.gain"), g["cause"]
    run = read_run(r.trace_dir / "trace-rank0.jsonl")
    call = next(o for o in run.regions[0].forward.ops if o.op == "inductor_compiled_code")
    assert any(ref.kind == "buffer" and ref.name == "layers.0.ff.gain" for ref in call.input_refs), call.input_refs


def test_a_guard_that_fails_in_the_recompute_of_a_block_compiled_in_place_names_the_attribute(runs):
    """`block.compile()` on the checkpointed block itself (25c): its module hooks run inside the compiled call, where
    they record nothing, so the int attribute Dynamo guards on (`keep`, raised before the backward) was never
    recorded and the cause read "a Python value passed to inductor_compiled_code changed ..., or drawn on the host".
    The attributes of a block compiled in place are noted as each pass begins: the attribute is named."""
    r, fixed = runs["guard"], runs["guard_fixed"]
    assert r.returncode == 0 and fixed.returncode == 0, r.explain() + fixed.explain()
    assert fixed.report["verdict"] == "clean", fixed.report["headline"]
    diverged = [g for g in r.report["regions"] if g["status"] == "diverged"]
    assert diverged and all(g["silent"] for g in diverged)
    cause = diverged[0]["cause"]
    assert cause["kind"] == "state_mutation" and cause["tensor"] == f"{diverged[0]['module']}.keep", cause
    assert "another compiled graph than the forward" in cause["detail"] and "was 4 in the forward and 6" in \
        cause["detail"], cause["detail"]
