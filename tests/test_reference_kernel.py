"""A first loss that differs from the run without AC because a kernel sums in another order in every process
(tests/stacks/unordered_sum.py: a seeded script; the order comes from Python's hash randomisation, as a GPU's float
atomics take theirs from the scheduler): the two runs' first forwards, compared op by op, name the kernel (identical
inputs, other values), and `ac-diff fix` verifies deterministic algorithms against a run without AC that uses them
too. With PYTHONHASHSEED fixed both processes sum in the same order: the gradients are compared, and identical.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ac_diff.trace import read_run
from stacks.runs import STACKS, Job, run_all

pytestmark = pytest.mark.e2e
SCRIPT = str(STACKS / "unordered_sum.py")
REF = ["--reference", "no-ac", "--check"]
KERNEL = "unordered.row_sum.default"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("kernel")
    return run_all(out, {
        "per_process": Job([SCRIPT], REF, env={"PYTHONHASHSEED": "random"}),  # each process its own order
        "same_order": Job([SCRIPT], REF, env={"PYTHONHASHSEED": "0"}),
    })


def test_a_kernel_that_differs_between_processes_is_named_not_the_scripts_randomness(runs):
    r = runs["per_process"]
    assert r.report is not None and r.returncode == 0, r.explain()  # not a defect of AC: --check passes
    ref = r.report["reference"]
    assert r.report["verdict"] == "clean" and ref["verdict"] == "not_comparable"
    assert ref["headline"].endswith("before any recompute ran (a nondeterministic kernel)")
    why = ref["explanations"][0]
    assert why["kind"] == "nondeterministic_kernel" and why["region"] == "layers.0" and why["module"] == "layers.0"
    assert f"nondeterministic kernel: {KERNEL} at layers.0 (" in why["text"]
    assert "gives other values from the same inputs from one process to the next" in why["text"]
    assert "unordered_sum.py:" in why["source"]
    assert why["fix"] == "run with torch.use_deterministic_algorithms(True) (ac-diff fix tries --deterministic)"
    assert "nondeterministic kernel" in r.stdout
    # what the reference recorded: the forward of the regions of its first step, the run's regions in order
    recorded = read_run(r.trace_dir / "reference" / "trace-rank0.jsonl")
    assert [(x.module, x.recompute is None) for x in recorded.regions] == [("layers.0", True), ("layers.1", True)]


def test_the_same_order_in_both_processes_compares_the_gradients(runs):
    r = runs["same_order"]
    ref = r.report["reference"]
    assert ref["verdict"] == "identical" and not ref["explanations"], r.explain()


def test_fix_verifies_deterministic_algorithms_against_a_deterministic_run_without_ac(tmp_path):
    out, json_path = tmp_path / "fix", tmp_path / "fix.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONHASHSEED": "random"}
    proc = subprocess.run([sys.executable, "-m", "ac_diff", "fix", "-o", str(out), "--json", str(json_path), SCRIPT],
                          capture_output=True, text=True, timeout=600, env=env)
    assert json_path.exists(), proc.stderr[-3000:]
    report = json.loads(json_path.read_text())
    assert report["reference"]["explanations"][0]["kind"] == "nondeterministic_kernel"
    fixes = report["fixes"]
    assert proc.returncode == 0 and fixes["verified"] == "deterministic algorithms", proc.stderr[-3000:]
    tried = fixes["tries"][0]
    assert tried["args"] == ["--deterministic"] and tried["status"] == "verified"
    assert tried["gradients"] == "bit-identical" and tried["why"].startswith("nondeterministic kernel in layers.0 (")
    assert "torch.use_deterministic_algorithms(True)" in fixes["verified_code"]
    assert (out / "reference-deterministic" / "grads-rank0.pt").exists()  # the try's run without AC: deterministic too
