"""No clean run is ever reported as diverged: every clean example and stack of the test suite, run under
op-level selective AC (topk and the matmuls saved), full AC and nested AC (each checkpointed function
checkpointed again inside), is reported clean; so is a whole-model torch.compile of checkpointed blocks, recorded
with `--compiled eager`, and FSDP2 (`fully_shard`) blocks on two ranks. Small sizes, one step (`tests/stacks/ac_modes.py` switches
the mode without touching the scripts).
"""

from __future__ import annotations

import os

import pytest

from ac_diff.trace import read_run
from conftest import EXAMPLES, REPO
from stacks.runs import STACKS, Job, run_all

pytestmark = pytest.mark.e2e
MODES = ("full", "sac", "nested")
RUNNER = str(STACKS / "ac_modes.py")
ENV = {"PYTHONPATH": os.pathsep.join(filter(None, [str(STACKS), str(REPO), os.environ.get("PYTHONPATH")]))}
CLEAN = {  # name -> the script (or -m module) and its arguments
    "moe_bias_update_fixed": [str(EXAMPLES / "moe_bias_update_fixed.py"), "--steps", "1", "--seq-len", "32"],
    "grad_accum_summed": [str(STACKS / "grad_accum.py"), "--schedule", "summed", "--micro-batches", "2"],
    "compiled_none": [str(STACKS / "compiled_blocks.py"), "--compile", "none", "--steps", "1", "--dropout", "0.1"],
    # torch.compile(model) over the checkpointed blocks, recorded with compiled code forced eager (OPTIONS)
    "compiled_around": [str(STACKS / "compiled_blocks.py"), "--compile", "around", "--steps", "1", "--dropout", "0.1"],
    # Mixtral divides topk's values in place, which selective AC refuses for a cached tensor: mm only
    "hf_mixtral": ["--save", "mm", str(STACKS / "hf_moe.py"), "--model", "mixtral", "--steps", "1", "--seq-len", "16"],
    "torchtitan_selective": ["-m", "titanlike.train", "--steps", "1"],
    # fully_shard blocks, each checkpointed, on 2 gloo ranks (OPTIONS): FSDP2's gathers inside the forward only
    "fsdp2": [str(STACKS / "fsdp2_blocks.py"), "--steps", "1"],
}


OPTIONS = {"compiled_around": ["--compiled", "eager"], "fsdp2": ["--nproc-per-node", "2"]}  # ac-diff run options


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    jobs = {f"{name}-{mode}": Job([RUNNER, "--ac", mode, *target], options=OPTIONS.get(name, []), cwd=STACKS, env=ENV)
            for name, target in CLEAN.items() for mode in MODES}
    return run_all(tmp_path_factory.mktemp("clean"), jobs, timeout=900)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(CLEAN))
def test_a_clean_run_is_clean_in_every_ac_mode(runs, name, mode):
    r = runs[f"{name}-{mode}"]
    assert r.returncode == 0, r.explain()
    report = r.report
    assert report["regions"], r.explain()
    bad = [(g["region"], g["status"], (g["cause"] or {}).get("detail")) for g in report["regions"]
           if g["status"] != "clean"]
    assert report["verdict"] == "clean" and not bad, f"{report['headline']}: {bad}"
    if name == "fsdp2":
        assert report["ranks"] and len(report["ranks"]) == 2, report["ranks"]  # both ranks recorded and compared
    if mode == "nested":  # every region has a region inside it
        assert len(report["regions"]) == 2 * len(runs[f"{name}-full"].report["regions"])
    if name == "compiled_around":  # compiled code forced eager: said in the headline
        assert report["headline"].startswith("Net ran eagerly (--compiled eager"), report["headline"]
    if mode == "sac":  # selective AC really ran (torchtitan's stack: with its own save list)
        run = read_run(r.trace_dir / "trace-rank0.jsonl")
        assert all(g.options.get("sac") for g in run.regions)
