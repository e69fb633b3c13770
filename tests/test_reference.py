"""`ac-diff run --reference no-ac`: the same script again without AC, every parameter's gradient compared.

Real mechanisms only (tests/stacks/reentrant_side.py): router logits collected by a forward hook under
reentrant checkpoint (the aux loss then gives no gradient), frozen embedding + adapters under reentrant
checkpoint (no region input requires grad), dropout with preserve_rng_state=False (a recompute divergence),
an unseeded script (the reference's own randomness), and the same model with use_reentrant=False (clean).
"""

from __future__ import annotations

import json

import pytest

from conftest import run_cli
from stacks.runs import STACKS, Job, run_all

pytestmark = pytest.mark.e2e
SCRIPT = str(STACKS / "reentrant_side.py")
CENTER = str(STACKS / "running_center.py")
REF = ["--reference", "no-ac", "--check"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    return run_all(out, {
        "side_output": Job([SCRIPT, "--reentrant"], REF),
        "side_output_unused": Job([SCRIPT, "--reentrant", "--no-aux"], REF),  # the logits collected, never a loss
        "clean": Job([SCRIPT], REF + ["--reference-steps", "2"]),
        "frozen": Job([SCRIPT, "--reentrant", "--frozen-embedding", "--no-aux"], REF),
        "dropout": Job([SCRIPT, "--no-aux", "--dropout", "0.1", "--no-preserve-rng"], REF),
        "unseeded": Job([SCRIPT, "--unseeded"], REF),
        "side_output_no_ac_layer1": Job([SCRIPT, "--reentrant"], REF + ["--no-ac", "layers.1"]),
        # a hook in the region moves a buffer: saving the decision keeps the recompute clean, not the next step
        "repeated_update": Job([CENTER], REF + ["--reference-steps", "2", "--must-save", "aten.argmax.default",
                                                "--must-save-module", "layers.*.router"]),
        "repeated_update_restored": Job([CENTER], REF + ["--reference-steps", "2", "--restore-in-recompute",
                                                         "layers.*.router.center"]),
        "fails_only_with_ac": Job([str(STACKS / "scan_chunk.py"), "--steps", "2"], REF + ["--reference-steps", "2"]),
        "fails_only_without_ac": Job([str(STACKS / "step_before_backward.py")], REF + ["--reference-steps", "2"]),
        "first_backward_fails_only_with_ac": Job([str(STACKS / "scan_chunk.py"), "--steps", "2"], REF,
                                                 env={"FLIP_AT": "1"}),
    })


def _ref(result):
    assert result.report is not None, result.explain()
    return result.report["reference"]


def test_side_output_under_reentrant_checkpoint_is_named_and_fails_check(runs):
    r = runs["side_output"]
    ref = _ref(r)
    assert r.returncode == 1, r.explain()  # --check: the recompute is clean, the gradients are not
    assert r.report["verdict"] == "diverged"
    # each recompute reproduced its forward; its side output, which the gradients show fed a loss, diverged it
    assert all(x["status"] == "diverged" and x["silent"] and x["cause"]["mechanism"] == "side_output"
               for x in r.report["regions"])
    assert not any("--reference no-ac` compares" in n for x in r.report["regions"] for n in x["notes"])
    assert ref["verdict"] == "differs"
    differing = {d["name"]: d for d in ref["steps"][0]["differing"]}
    assert differing["layers.0.gate.weight"]["rel_diff"] > 0.1
    assert differing["layers.1.gate.weight"]["region"] == "layers.1"
    side = [e for e in ref["explanations"] if e["kind"] == "side_output"]
    assert {e["module"] for e in side} == {"layers.0.gate", "layers.1.gate"}
    assert all("reentrant_side.py:" in e["source"] for e in side)
    assert all("use_reentrant=False" in e["fix"] for e in side)
    assert "gradients differ from the run without AC" in r.report["headline"]
    assert "side output" in r.stdout


def test_a_side_output_no_loss_reads_is_clean_once_the_gradients_match(runs):
    """The same router logits collected on the side, but no aux loss: alone, the recompute cannot tell (gradients at
    risk); the run without AC has identical gradients, so the run is clean."""
    r = runs["side_output_unused"]
    assert r.returncode == 0 and _ref(r)["verdict"] == "identical", r.explain()
    assert r.report["verdict"] == "clean" and "feed no loss" in r.report["headline"], r.report["headline"]
    assert all(x["status"] == "clean" for x in r.report["regions"])
    assert all("no loss is computed from them" in " ".join(x["notes"]) for x in r.report["regions"])


def test_turning_ac_off_in_one_layer_confirms_where_it_breaks(runs):
    ref = _ref(runs["side_output_no_ac_layer1"])
    names = {d["name"] for d in ref["steps"][0]["differing"]}
    assert "layers.0.gate.weight" in names and not any(n.startswith("layers.1.") for n in names)
    assert {"remedy": "no_ac", "region": "layers.1", "what": "AC off", "calls": 2, "rank": 0} \
        in runs["side_output_no_ac_layer1"].report["remedies"]


def test_clean_run_reports_gradients_identical_to_the_run_without_ac(runs):
    r = runs["clean"]
    ref = _ref(r)
    assert r.returncode == 0, r.explain()
    assert ref["verdict"] == "identical" and len(ref["steps"]) == 2
    assert ref["headline"].startswith("gradients identical to the run without AC")
    assert "gradients identical to the run without AC" in r.stdout
    assert any("without AC" in n for n in ref["notes"])  # the reference really turned AC off


def test_frozen_embedding_adapters_get_no_gradient_under_reentrant(runs):
    r = runs["frozen"]
    ref = _ref(r)
    assert r.returncode == 1, r.explain()
    missing = {d["name"] for d in ref["steps"][0]["differing"] if d["status"] == "missing_in_run"}
    assert missing == {"layers.0.adapter.weight", "layers.1.adapter.weight"}
    why = [e for e in ref["explanations"] if e["kind"] == "no_grad_inputs"]
    assert {e["region"] for e in why} == {"layers.0", "layers.1"}
    assert "enable_input_require_grads" in why[0]["fix"]


def test_recompute_divergence_is_tied_to_its_region(runs):
    ref = _ref(runs["dropout"])
    assert ref["verdict"] == "differs"
    why = [e for e in ref["explanations"] if e["kind"] == "recompute_divergence"]
    assert {e["region"] for e in why} == {"layers.0", "layers.1"}
    assert "(rng)" in why[0]["text"]
    assert all(p.startswith("layers.0.") for p in why[0]["parameters"]) and why[0]["parameters"]


def test_the_references_own_randomness_is_not_a_defect(runs):
    r = runs["unseeded"]
    ref = _ref(r)
    assert ref["verdict"] == "not_comparable"
    assert ref["explanations"][0]["kind"] == "reference_randomness"
    assert r.report["verdict"] == "clean" and r.returncode == 0, r.explain()


@pytest.mark.parametrize("args, words", [
    (["--reference", "twice"], "--reference 'twice' is not a mode"),
    (["--reference", "no-ac", "--reference-steps", "0"], "--reference-steps must be at least 1"),
    (["--must-save-module", "layers.*"], "--must-save-module needs --must-save"),
])
def test_bad_reference_and_remedy_options_are_one_line_exit_2(tmp_path, args, words):
    proc = run_cli("run", "-o", str(tmp_path / "o"), *args, SCRIPT)
    assert proc.returncode == 2
    assert words in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_torchrun_two_ranks_each_compare_with_their_own_reference(tmp_path):
    import os
    import subprocess
    import sys

    out, json_path = tmp_path / "o", tmp_path / "r.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "AC_DIFF_RANK_WAIT": "60"}
    for key in ("AC_DIFF_RUN_ID", "AC_DIFF_LAUNCHED"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "ac_diff", "run", "-o", str(out), "--json", str(json_path), "--reference", "no-ac",
                           SCRIPT, "--distributed", "--reentrant"], env=env, capture_output=True, text=True, timeout=300)
    assert json_path.exists(), proc.stderr[-3000:]
    import json

    ref = json.loads(json_path.read_text())["reference"]
    assert ref["verdict"] == "differs"
    assert {s["rank"] for s in ref["steps"] if s["differing"]} == {0, 1}
    assert ref["headline"].startswith("every rank (2), rank 0's figures: ")  # not "rank 0" alone
    assert any(e["kind"] == "side_output" for e in ref["explanations"])
    assert (out / "reference" / "grads-rank1.pt").exists()


def test_remedies_reach_every_rank_under_the_launcher(tmp_path):
    import json

    out, json_path = tmp_path / "o", tmp_path / "r.json"
    proc = run_cli("run", "--nproc-per-node", "2", "-o", str(out), "--json", str(json_path), "--no-ac", "layers.1",
                   "--reference", "no-ac", SCRIPT, "--distributed", "--reentrant", env={"AC_DIFF_RANK_WAIT": "60"})
    assert json_path.exists(), proc.stderr[-3000:]
    report = json.loads(json_path.read_text())
    assert {(r["rank"], r["region"], r["what"]) for r in report["remedies"]} == {
        (0, "layers.1", "AC off"), (1, "layers.1", "AC off")}
    differing = {d["name"] for s in report["reference"]["steps"] for d in s["differing"]}
    assert "layers.0.gate.weight" in differing and not any(n.startswith("layers.1.") for n in differing)


def test_a_state_the_recompute_updates_twice_is_a_defect_from_the_next_step(runs):
    """Every recompute reproduced its forward and the first backward's gradients are identical, but the hook ran
    twice: the second loss differs. That is the recompute's repeated update, not random draws, and not a pass. The
    regions read the centre they update (state read again): settled by the reference, those of the second backward
    diverged (they were clean beside gradients that differ); those of the first computed right (a stranger's step 1
    said "silently wrong" for gradients bit-identical to a run without AC), and say what they left changed."""
    r = runs["repeated_update"]
    ref = _ref(r)
    regions = r.report["regions"]
    assert regions and all(x["cause"]["tensor"].endswith("router.center") for x in regions), regions
    assert {x["status"] for x in regions if x["backward"] == 2} == {"diverged"}, regions
    first = [x for x in regions if x["backward"] == 1]
    assert first and all(x["status"] == "unchecked" and any("its own gradients match the run without AC (backward 1)"
                                                            in n for n in x["notes"]) for x in first), first
    assert ref["verdict"] == "differs" and r.returncode == 1, r.explain()
    assert [s["loss_identical"] for s in ref["steps"]] == [True, False] and not ref["steps"][0]["differing"]
    why = ref["explanations"][0]
    assert why["kind"] == "repeated_update" and "router.center" in why["text"] and "counted twice" in why["text"]
    assert "rng_draws" not in {e["kind"] for e in ref["explanations"]}
    restored = runs["repeated_update_restored"]
    assert _ref(restored)["verdict"] == "identical" and restored.returncode == 0, restored.explain()
    assert len(_ref(restored)["steps"]) == 2


def test_report_of_the_directory_gives_back_the_remedies_and_the_reference_comparison(runs, tmp_path):
    """`ac-diff report DIR` later: the remedies the run applied and its comparison with the reference come back
    from what it left beside the traces, as the run printed them, and the verdict they make (exit 1)."""
    r = runs["side_output_no_ac_layer1"]
    later = run_cli("report", str(r.trace_dir), "--json", str(tmp_path / "later.json"))
    report = json.loads((tmp_path / "later.json").read_text())
    assert later.returncode == 1, later.stderr
    assert report["remedies"] == r.report["remedies"]
    for key in ("verdict", "headline", "steps", "explanations"):
        assert report["reference"][key] == r.report["reference"][key]
    assert report["verdict"] == r.report["verdict"] == "diverged"
    assert "gradients vs the run without AC" in later.stdout and "remedies applied" in later.stdout


@pytest.mark.parametrize("damage", ["gone", "cut", "replaced", "reference cut", "remedies garbled"])
def test_report_of_a_directory_whose_gradients_files_were_damaged_since_is_bad_input(runs, tmp_path, damage):
    """28f: a clean run's directory whose grads-rank0.pt was removed, cut or replaced since read DIVERGED ("backward 1
    failed only with AC") and failed --check; a garbled remedies file, "could not turn AC off". One line naming the
    file and how to write it again, exit 2."""
    import shutil

    import torch

    copy = tmp_path / "copy"
    shutil.copytree(runs["clean"].trace_dir, copy)
    grads, ref = copy / "grads-rank0.pt", copy / "reference" / "grads-rank0.pt"
    if damage == "gone":
        grads.unlink()
    elif damage == "cut":
        grads.write_bytes(grads.read_bytes()[: grads.stat().st_size // 2])
    elif damage == "replaced":
        torch.save(torch.nn.Linear(2, 2).state_dict(), grads)
    elif damage == "reference cut":
        ref.write_bytes(ref.read_bytes()[:100])
    else:
        (copy / "reference" / "remedies-rank0.json").write_text("{not json")
    later = run_cli("report", "--check", str(copy))
    assert later.returncode == 2 and later.stderr.count("\n") == 1, later.stdout + later.stderr
    named = "remedies-rank0.json" if damage == "remedies garbled" else "grads-rank0.pt"
    assert named in later.stderr and "re-run `ac-diff run --reference no-ac" in later.stderr, later.stderr
    assert run_cli("report", "--check", str(runs["clean"].trace_dir)).returncode == 0


def test_a_backward_that_fails_only_with_ac_is_said_beside_identical_gradients(runs):
    """The run with AC raises in its second backward (a chunk size changed before it), the run without AC finishes
    both: the first backward's gradients are identical, and the reference says the second failed only with AC (it
    said "gradients identical" and nothing else)."""
    ref = _ref(runs["fails_only_with_ac"])  # (differs: a failure in one run only is a change of the training)
    assert ref["verdict"] == "differs" and len(ref["steps"]) == 1 and ref["steps"][0]["backward"] == 1
    assert "backward 2 failed only with AC: the run without AC finished it" in ref["headline"]
    # the region that diverged ran in step 2, which the run with AC never finished: no `--reference-steps 2` advice
    assert "was recomputed in backward 2 (step 2), after the compared backward pass(es)" in ref["headline"], \
        ref["headline"]
    assert "--reference-steps" not in ref["headline"], ref["headline"]
    # the cause: a field of the run config the module holds (it read "Python code took another branch")
    region = next(r for r in runs["fails_only_with_ac"].report["regions"] if r["status"] == "diverged")
    assert region["cause"]["tensor"] == "scan.cfg.chunk" and "was 4 in the forward and 8" in region["cause"]["detail"]
    # the first backward: nothing to compare, and the reference still runs to say so (it said "no reference was run")
    first = _ref(runs["first_backward_fails_only_with_ac"])
    assert first["verdict"] == "differs" and first["headline"].startswith(
        "backward 1 failed only with AC: the run without AC finished it")


def test_a_backward_that_fails_only_without_ac_is_said_beside_identical_gradients(runs):
    """An optimizer step before the last micro-batch's backward: torch's version counter stops the run without AC in
    its second backward; the run with AC recomputes from the stepped weights and finishes it (silently). The
    reference says so (it said "identical" and advised the `--reference-steps 2` it was given)."""
    result = runs["fails_only_without_ac"]
    ref = _ref(result)
    assert ref["verdict"] == "identical" and len(ref["steps"]) == 1 and ref["exit_code"] == 1, ref
    assert "backward 2 failed only without AC: the run without AC exited with 1 there" in ref["headline"], ref
    assert "--reference-steps" not in ref["headline"], ref["headline"]
    assert result.report["verdict"] == "diverged"


PARITY_SCALE = """
import torch, torch.nn as nn
from torch.utils.checkpoint import checkpoint

class Block(nn.Module):  # a call counter picks the residual scale: the recompute counts a second time
    def __init__(self):
        super().__init__()
        self.fc, self.calls = nn.Linear(16, 16), 0

    def forward(self, x):
        self.calls += 1
        return x + (1.0 if self.calls % 2 else 0.5) * torch.tanh(self.fc(x))

torch.manual_seed(0)
model = nn.Sequential(Block(), Block())
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    h = torch.randn(8, 16)
    for block in model:
        h = checkpoint(block, h, use_reentrant=False)
    h.square().mean().backward()
    opt.step()
    opt.zero_grad()
"""


def test_later_steps_that_read_a_python_counter_counted_twice_are_the_diverged_ones(tmp_path):
    """A call counter the region reads (a residual scale on its parity): each recompute reproduces its forward (the
    scale multiplies what is not saved), but counts again, so from backward 2 the forwards use other scales than a run
    without AC. The reference's table said step 1's regions "diverged (silent)" (their gradients are the identical
    ones) and the later steps' regions clean (theirs differ)."""
    script = tmp_path / "parity_scale.py"
    script.write_text(PARITY_SCALE)
    json_path = tmp_path / "r.json"
    proc = run_cli("run", "-o", str(tmp_path / "out"), "--json", str(json_path), "--reference", "no-ac",
                   "--reference-steps", "3", str(script))
    report = json.loads(json_path.read_text())
    assert report["verdict"] == "diverged", proc.stderr[-2000:]
    first = min(s["step"] for s in report["reference"]["steps"] if s["differing"]) + 1
    status = {(x["backward"], x["module"]): x["status"] for x in report["regions"]}
    assert first == 2 and {s for (b, _), s in status.items() if b >= first} == {"diverged"}, status
    assert {s for (b, _), s in status.items() if b < first} == {"unchecked"}, status


_READS_STDIN = """
import sys, torch
from torch.utils.checkpoint import checkpoint
steps = int(sys.stdin.read().split()[0])  # (its configuration, piped in)
torch.manual_seed(0)
class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.temperature = torch.nn.Linear(16, 16), 1.0
    def forward(self, x):
        return torch.tanh(self.lin(x) / self.temperature)
blocks = torch.nn.ModuleList(Block() for _ in range(2))
for step in range(steps):
    h = torch.randn(8, 16, requires_grad=True)
    for b in blocks:
        h = checkpoint(b, h, use_reentrant=False)
    for b in blocks:
        b.temperature *= 0.9  # annealed before the backward: the recompute divides by another temperature
    h.sum().backward()
"""


@pytest.mark.parametrize("given", ["pipe", "file"])
def test_the_reference_reads_the_standard_input_the_run_read(tmp_path, given):
    """A script reading its configuration from standard input (24c): the run consumed it, the reference found it
    empty, crashed, and the comparison said "the run without AC exited with 1". Both runs read the same input now,
    piped or redirected from a file."""
    import os
    import subprocess
    import sys

    script, json_path = tmp_path / "reads_stdin.py", tmp_path / "r.json"
    script.write_text(_READS_STDIN)
    (tmp_path / "in.txt").write_text("2\n")
    argv = [sys.executable, "-m", "ac_diff", "run", "-o", str(tmp_path / "out"), "--json", str(json_path),
            "--reference", "no-ac", str(script)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(tmp_path / "in.txt") as f:
        proc = subprocess.run(argv, input="2\n" if given == "pipe" else None, stdin=None if given == "pipe" else f,
                              capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    reference = json.loads(json_path.read_text())["reference"]
    assert reference["verdict"] == "differs", reference
    assert reference["headline"].startswith("4 of 4 gradients differ from the run without AC at backward 1")
