"""torchtitan-style training: `tests/stacks/titanlike`, launched like torchtitan (`python -m titanlike.train --flag
value`) under `ac-diff run -m`, asserted on the JSON report and the trace.

Blocks are wrapped with `checkpoint_wrapper` (names carry `_checkpoint_wrapped_module`), op-level selective AC
runs through `create_selective_checkpoint_contexts` with torchtitan's `_save_list` policy (mm, sdpa; every
second mm recomputed), `preserve_rng_state=False` as in torchtitan, and the MoE's load-balancing `expert_bias`
is updated from an optimizer step hook (right) or a forward hook (wrong).
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

import ac_diff
from stacks.runs import STACKS, Job, regions_by, run_all

pytestmark = pytest.mark.e2e
ENV = {"PYTHONPATH": os.pathsep.join(filter(None, [str(STACKS), os.environ.get("PYTHONPATH")]))}


def _job(*args: str) -> Job:
    return Job(["-m", "titanlike.train", *args], cwd=STACKS, env=ENV)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_all(tmp_path_factory.mktemp("titan"), {
        "clean": _job("--steps", "2"),
        "forward_hook": _job("--steps", "2", "--bias-update", "forward_hook"),
        "full_forward_hook": _job("--steps", "2", "--bias-update", "forward_hook",
                                  "--activation_checkpoint.mode", "full"),
    })


def test_clean_when_the_bias_update_is_after_backward(runs):
    r = runs["clean"]
    assert r.returncode == 0, r.explain()
    report = r.report
    assert report["verdict"] == "clean", report["headline"]
    assert [g["module"] for g in report["regions"]] == ["layers.0", "layers.1"] * 2
    assert all(g["status"] == "clean" and g["kind"] == "checkpoint" for g in report["regions"])

    trace = ac_diff.load(r.trace_dir)
    assert trace.regions.sac.tolist() == [True] * 4
    assert trace.regions.preserve_rng_state.tolist() == [False] * 4  # torchtitan's default
    ops = trace.ops
    assert not ops.module.dropna().str.contains("_checkpoint_wrapped_module").any()
    assert {"layers.0.moe.router.gate", "layers.1.moe.experts", "layers.0.attention.wq"} <= set(ops.module)


def test_selective_ac_saved_ops_are_known_as_cached(runs):
    ops = ac_diff.load(runs["clean"].trace_dir).ops
    cached = ops[ops.cached]
    assert set(cached.op) == {"aten.mm.default", "aten._scaled_dot_product_flash_attention_for_cpu.default"}
    for (region, phase), mine in ops.groupby(["region", "phase"]):
        mm = mine[mine.op == "aten.mm.default"]
        # torchtitan's policy saves every second mm: the 1st, 3rd, 5th... of the block
        assert mm.cached.tolist() == [i % 2 == 0 for i in range(len(mm))], (region, phase)
        gate = mm[mm.module.str.endswith("moe.router.gate")]
        assert gate.cached.all()
    # the recompute is answered from the cache for the same op instances the forward saved
    for region, mine in ops.groupby("region"):
        fwd = mine[(mine.phase == "forward") & mine.cached]
        rec = mine[(mine.phase == "recompute") & mine.cached]
        assert list(zip(fwd.op, fwd.module)) == list(zip(rec.op, rec.module))


def test_bias_updated_in_a_forward_hook_is_state_mutation_of_each_layer(runs):
    r = runs["forward_hook"]
    assert r.returncode == 1, r.explain()  # the script's own failure (a shape error in the recompute)
    report = r.report
    assert report["verdict"] == "diverged"
    diverged = regions_by(report, status="diverged")
    # layers.1's router flips no token in the first step: its saved tensors are the same (clean, noted)
    assert {g["module"] for g in diverged} == {"layers.0"}
    assert any("harmless for the gradients" in n for g in regions_by(report, status="clean")
               if g["module"] == "layers.1" for n in g["notes"])
    for g in diverged:
        assert g["cause"]["kind"] == "state_mutation"
        assert g["cause"]["tensor"] == f"{g['module']}.moe.expert_bias"
        assert g["first_value_divergence"]["module"] == f"{g['module']}.moe.router"
        assert "after the backward" in g["suggestions"][0]["title"]
    # where the router flipped a token, the fix is said in the words a torchtitan user edits
    flipped = [g for g in diverged if any("selective activation checkpointing" in s["title"] for s in g["suggestions"])]
    assert flipped, "no selective-AC suggestion"
    for g in flipped:
        text = next(s["text"] for s in g["suggestions"] if "selective activation" in s["title"])
        assert 'selective_ac_option = "op"' in text and "_save_list" in text
        assert "torch.ops.aten.topk.default" in text
        assert "torch.ops.aten.mm.default is already in it" in text  # the gate mm is saved already


def test_full_ac_bias_in_forward_hook_raises_checkpoint_error_mapped_to_the_layer(runs):
    r = runs["full_forward_hook"]
    assert r.returncode == 1, r.explain()
    report = r.report
    error = report["torch_error"]
    assert error["kind"] == "metadata_mismatch" and error["positions"]
    region = regions_by(report, region=error["region"])[0]
    assert region["cause"]["kind"] == "state_mutation"
    assert region["cause"]["tensor"] == f"{region['module']}.moe.expert_bias"
    flagged = sorted(p["position"] for p in region["positions"] if p["matches"] is False)
    assert flagged == sorted(error["positions"])
    assert all(p["module"].startswith(region["module"] + ".moe.experts") for p in region["positions"]
               if p["matches"] is False)
    text = " ".join(s["text"] for s in region["suggestions"])
    assert 'activation_checkpoint.mode = "selective"' in text


def test_module_launch_from_the_package_directory_like_python_m(tmp_path):
    exe = shutil.which("ac-diff")
    if exe is None:
        pytest.skip("ac-diff console script not installed")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([exe, "run", "-o", str(tmp_path / "o"), "-m", "titanlike.train", "--steps", "1"],
                          cwd=STACKS, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
