"""`ac-diff fix`: each remedy tried on the script in its own process; the table says which one works and why
the others did not. Real mechanisms only (tests/stacks/reentrant_side.py, the torchtitan-shaped package):
dropout with preserve_rng_state=False, a router bias updated in a forward hook whose biased scores also
give the weights (saving topk does not help: its input already differed and feeds the weights too), the same with top-k weights normalised in place (saving topk crashes the
script: SAC's cached tensor is mutated), router logits lost through reentrant checkpoint, and torchtitan's
own op-level SAC policy composed with --must-save; a block drawing from its own torch.Generator (preserve_rng_state
does not help, restoring the generator's forward state does); a batch norm whose recompute updates its running
statistics again (saving its op does); and the distributed bias update under torchrun (2 ranks, gloo); a clean run whose run without AC fails (padding
zeroed in place on a block's output: AC hides torch's version-check error).
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from stacks.runs import STACKS, fix as _fix

pytestmark = pytest.mark.e2e
SCRIPT = str(STACKS / "reentrant_side.py")
EXAMPLES = STACKS.parent.parent / "examples"


@pytest.fixture(scope="module")
def fixes(tmp_path_factory):
    out = tmp_path_factory.mktemp("fix")
    jobs = {
        "rng": ["--max-tries", "1", "--report", str(out / "rng.html"), SCRIPT, "--no-aux", "--dropout", "0.1", "--no-preserve-rng"],
        "bias": ["--max-tries", "2", SCRIPT, "--no-aux", "--bias-update", "--gather-weights"],
        "bias_inplace": ["--max-tries", "3", "--jobs", "2", SCRIPT, "--no-aux", "--bias-update", "--inplace-norm"],
        "generator": [str(STACKS / "private_generator.py")],
        "side_output": [SCRIPT, "--reentrant"],
        "two_causes": [str(STACKS / "two_causes.py")],
        "scaled_cache": [str(STACKS / "scaled_cache.py")],
        "batch_norm": [str(STACKS / "batch_norm_block.py")],
        "hidden_error": [str(STACKS / "padding_zeroed_in_place.py")],
    }
    with ThreadPoolExecutor(2) as pool:
        done = dict(zip(jobs, pool.map(lambda kv: _fix(out / kv[0], *kv[1]), jobs.items())))
    done["torchrun"] = _fix(out / "torchrun", "--nproc-per-node", "2", "--max-tries", "2", "--jobs", "2",
                            str(EXAMPLES / "distributed_bias_update.py"))
    done["titan"] = _fix(out / "titan", "--max-tries", "1", "-m", "titanlike.train", "--steps", "1",
                         "--bias-update", "forward_hook", cwd=str(STACKS))
    done["dirs"] = {name: out / name for name in [*jobs, "torchrun", "titan"]}
    return done


def test_every_run_keeps_every_regions_ops(fixes):
    """A try's extra memory is read from the saved positions of every region (fix/memory.py): fix records with
    --write all, or the clean regions the default summarizes would count as keeping nothing."""
    from ac_diff.trace import read_run

    traces = [t for d in fixes["dirs"].values() for t in d.glob("*/trace-rank*.jsonl")]
    regions = [r for t in traces for r in read_run(t).regions if r.recorded]
    assert len(traces) > 10 and regions and all(r.ops_written for r in regions)
    assert any(r.forward is not None and r.forward.ops for r in regions)


def test_preserve_rng_is_verified_first_with_its_exact_form(fixes):
    proc, report = fixes["rng"]
    fx = report["fixes"]
    assert proc.returncode == 0, proc.stderr[-2000:]
    first = fx["tries"][0]
    assert (first["remedy"], first["status"], first["gradients"]) == ("preserve_rng_state=True", "verified",
                                                                      "bit-identical")
    assert first["regions_before"] == 4 and first["regions_after"] == 0 and first["wall_s"] > 0
    assert "preserve_rng_state=True" in fx["verified_code"] and "gradient_checkpointing_kwargs" in fx["verified_code"]
    assert "[activation_checkpoint]" in fx["verified_code"]
    rng = [s for r in report["regions"] for s in r["suggestions"] if "preserve_rng_state" in s["title"]]
    assert rng and all(s["status"] == "verified" and "--preserve-rng" in s["verify"] for s in rng)
    others = [s for r in report["regions"] for s in r["suggestions"] if "preserve_rng_state" not in s["title"]]
    assert all(s["status"] == "untested" and s["verify"].startswith("ac-diff fix ") for s in others)
    assert "fixes tried on your script" in proc.stdout and "verified" in proc.stdout
    table = re.search(r"^ *regions *$", proc.stdout, re.M)  # the region table's title
    assert table and proc.stdout.index("fixes tried on your script") < table.start()  # near the top
    page = (Path(report["regions"][0]["path"]).parents[2] / "rng.html").read_text()  # OUT/base/trace -> OUT/..
    fixes_at = page.index('<section id="fixes">')
    assert fixes_at < page.index('<section id="reference"') < page.index('<section id="regions">')
    assert "ac-diff run --reference no-ac --preserve-rng" in page[fixes_at:]  # each try's command
    assert "[verified]" in page and "[untested]" in page  # the suggestions' statuses


def test_saving_the_decision_does_not_help_when_its_input_already_differed(fixes):
    proc, report = fixes["bias"]
    t, restore = report["fixes"]["tries"][1], report["fixes"]["tries"][0]
    assert t["remedy"].startswith("save aten.topk.default") and t["status"] == "did not help"
    assert "its input already differed" in t["reason"] and "expert_bias" in t["reason"]
    # what does help: the bias the forward saw, in the recompute (moving the update after backward)
    assert restore["args"] == ["--restore-in-recompute", "layers.*.expert_bias"], restore
    assert (restore["status"], restore["regions_after"], restore["gradients"]) == ("verified", 0, "bit-identical")
    assert restore["extra_bytes"] == 0 and t["extra_bytes"] > 0  # topk's outputs saved per region
    assert "a simulation of a code change" in report["fixes"]["headline"]
    assert "register_step_post_hook" in report["fixes"]["verified_code"]
    assert proc.returncode == 0
    assert report["fixes"]["tries"][2]["status"] == "untested"
    update = [s for r in report["regions"] for s in r["suggestions"] if "`layers." in s["title"]]
    assert update and all(s["status"] == "verified" and "--restore-in-recompute" in s["verify"] for s in update)


def test_a_remedy_that_crashes_the_script_is_reported_and_the_others_still_run(fixes):
    proc, report = fixes["bias_inplace"]
    by = {t["remedy"].split(" in ")[0]: t for t in report["fixes"]["tries"]}
    crashed = by["save aten.topk.default"]
    assert crashed["status"] == "crashed" and crashed["exit_code"] == 1
    assert "Tensor cached during selective activation checkpoint has been mutated" in crashed["reason"]
    assert by["no AC"]["status"] == "verified" and by["no AC"]["gradients"] == "bit-identical"
    assert by["no AC"]["extra_bytes"] > 0  # the regions keep their activations
    restore = next(t for t in report["fixes"]["tries"] if t["remedy"].startswith("restore"))
    assert restore["status"] == "verified"
    assert report["fixes"]["verified"] == restore["remedy"]  # the one that keeps AC comes first
    assert "crashed" in proc.stdout


def test_a_private_generator_is_restored_where_preserve_rng_state_does_not_help(fixes):
    """The blocks ran with preserve_rng_state=True (checkpoint's default), which does not cover their own generator:
    it is not tried again; restoring the generator's forward state is."""
    proc, report = fixes["generator"]
    assert "preserve_rng_state=True" not in {t["remedy"] for t in report["fixes"]["tries"]}
    first = report["fixes"]["tries"][0]
    assert first["args"] == ["--restore-in-recompute", "layers.*"] and first["status"] == "verified"
    assert "gen.set_state(gen_state)" in report["fixes"]["verified_code"]
    gen = [s for r in report["regions"] for s in r["suggestions"] if "torch.Generator" in s["title"]]
    assert gen and all(s["status"] == "verified" and "--restore-in-recompute" in s["verify"] for s in gen)
    assert proc.returncode == 0


def test_a_batch_norm_the_recompute_runs_again_is_saved(fixes):
    """Every region reproduced its forward, but the recompute updates the batch norms' running statistics a second
    time: saving the batch norm op is tried and verified (it said "nothing to fix"), and the try counts only where
    the statistics are no longer updated twice (the counter's add_ still is: harmless with a momentum)."""
    proc, report = fixes["batch_norm"]
    first = report["fixes"]["tries"][0]
    assert first["args"][:2] == ["--must-save", "aten.native_batch_norm.default"], first
    assert first["status"] == "verified" and first["gradients"] == "bit-identical", first
    assert "the recompute no longer updates layers.0.bn.running_mean, layers.0.bn.running_var, layers.1.bn." \
        "running_mean again" in report["fixes"]["headline"], report["fixes"]["headline"]
    assert proc.returncode == 0


def test_fix_under_torchrun_tries_each_remedy_on_every_rank(fixes):
    proc, report = fixes["torchrun"]
    assert {r["rank"] for r in report["regions"]} == {0, 1}
    tries = report["fixes"]["tries"]
    assert [t["status"] for t in tries] == ["verified", "verified", "untested"], tries  # --max-tries 2
    assert {t["args"][0] for t in tries[:2]} == {"--must-save", "--restore-in-recompute"}
    assert all(t["regions_before"] == 1 and t["gradients"] == "bit-identical" for t in tries[:2])
    assert all(t["command"].startswith("ac-diff run --nproc-per-node 2 ") for t in tries)
    assert proc.returncode == 0


def test_gradients_lost_through_reentrant_regions_are_fixed_by_use_reentrant_false(fixes):
    proc, report = fixes["side_output"]
    assert report["reference"]["verdict"] == "differs"
    t = report["fixes"]["tries"][0]
    assert (t["remedy"], t["status"]) == ("use_reentrant=False", "verified"), t
    assert "--non-reentrant" in t["command"]
    assert proc.returncode == 0


def test_must_save_composes_with_torchtitans_own_sac_policy(fixes):
    proc, report = fixes["titan"]
    t = report["fixes"]["tries"][0]
    assert t["args"][:2] == ["--must-save", "aten.topk.default"] and t["status"] != "untested", t
    base_trace = Path(report["regions"][0]["path"])  # OUT/base/trace-rank0.jsonl
    applied = json.loads((base_trace.parent.parent / "try-1" / "remedies-rank0.json").read_text())["applied"]
    assert any(a["what"] == "composed with the script's SAC policy" for a in applied)
    assert any(a["what"].startswith("saved aten.topk.default in layers.") for a in applied)


def test_two_causes_in_one_block_get_their_remedies_together(fixes):
    """Dropout without its RNG state and a call counter in the same block: the base run names the counter; restoring
    it reveals the dropout; neither remedy helps alone, both together are verified (and keep AC), with both forms."""
    proc, report = fixes["two_causes"]
    fx = report["fixes"]
    assert proc.returncode == 0, proc.stderr[-2000:]
    by = {t["remedy"]: t for t in fx["tries"]}
    both = next(t for name, t in by.items() if " + " in name)
    assert "calls" in both["remedy"] and "preserve_rng_state=True" in both["remedy"], list(by)
    assert both["status"] == "verified" and both["gradients"] == "bit-identical"
    assert by["restore the forward's layers.*.calls in the recompute"]["status"] == "did not help"
    assert fx["verified"] == both["remedy"] and "preserve_rng_state=True" in fx["verified_code"]
    # the counter is read after its update: counted before the forward (after the step would blend a step late)
    code = fx["verified_code"]
    assert "before the forward that reads it" in code and "m.calls += 1" in code, code


def test_where_only_turning_ac_off_works_fix_exits_1_and_gives_the_code_change(fixes):
    """A cached embedding the scheduler scales in place: no remedy that keeps AC can fix it from outside. Strangers
    read exit 0 ("a remedy verified") as fixed, where the only verified remedy was turning AC off."""
    proc, report = fixes["scaled_cache"]
    fx = report["fixes"]
    assert [(t["remedy"].split(" in ")[0], t["status"]) for t in fx["tries"]] == [("no AC", "verified")], fx["tries"]
    assert fx["headline"].startswith("only turning AC off works") and not fx["keeps_ac"]
    assert fx["code_change"].startswith("Do not modify `blocks.0.temb_cache[3]` in place"), fx["code_change"]
    assert proc.returncode == 1, proc.stderr[-2000:]


def test_a_clean_run_whose_run_without_ac_fails_says_no_gradients_were_compared(fixes):
    """Padding zeroed in place on a block's output: without AC torch's version check fails the first backward, with AC
    the run finishes (its gradients are those of the out-of-place model). `fix` said "nothing to fix: every region
    reproduced its forward and the gradients match the run without AC", compared over none; the reference said "it
    fails without AC too", where only the run without AC fails."""
    proc, report = fixes["hidden_error"]
    assert proc.returncode == 0 and report["verdict"] == "clean", proc.stderr[-2000:]
    headline = report["fixes"]["headline"]
    assert headline.startswith("nothing to fix: every region reproduced its forward (the gradients were not compared"), \
        headline
    assert re.search(r"where the run with AC finished [12]: checkpointing hides an error the run without it raises",
                     headline), headline


def test_turning_ac_off_is_no_fix_where_the_parameters_changed_in_place_before_the_backward():
    """An EMA copied into the model through `.data` before the backward: the run without AC reads the changed
    weights in its backward too, so matching it verifies nothing (a stranger's U-Net: 'verified, bit-identical')."""
    from types import SimpleNamespace

    from ac_diff.diagnosis.cause import OPTIMIZER_STEP, PARAMETER
    from ac_diff.fix.result import DID_NOT_HELP, VERIFIED, Try
    from ac_diff.fix.tries import without_ac_too

    def base(mechanism):
        cause = SimpleNamespace(mechanism=mechanism)
        return SimpleNamespace(regions=[SimpleNamespace(module="down", cause=cause)])

    t = Try("no AC in down", ["--no-ac", "down"], "", status=VERIFIED)
    without_ac_too(t, base(OPTIMIZER_STEP), ["down"])
    assert t.status == DID_NOT_HELP and "the run without AC is wrong too" in t.reason
    other = Try("no AC in down", ["--no-ac", "down"], "", status=VERIFIED)
    without_ac_too(other, base(PARAMETER), ["down"])  # (one parameter, maybe reassigned: the old one is saved)
    without_ac_too(other, base(OPTIMIZER_STEP), ["up"])  # another module's
    assert other.status == VERIFIED


def test_each_try_compares_the_backward_passes_that_reach_the_first_divergence():
    """A schedule crossing its threshold in backward 10: a try compares 10 backward passes with the run without AC,
    not the 2 of --steps (a try was called verified on gradients compared before the step it was to fix), up to
    REACH_MAX; an earlier divergence keeps --steps."""
    from types import SimpleNamespace

    from ac_diff.fix.tries import REACH_MAX, reach

    def report(*steps):
        return SimpleNamespace(regions=[SimpleNamespace(status="diverged" if s else "clean", step=abs(s) or 3)
                                        for s in steps])
    assert reach(report(0, 10, 12), 2) == 10
    assert reach(report(1, 10), 2) == 2 and reach(report(0), 2) == 2 and reach(report(), 3) == 3
    assert reach(report(500), 2) == REACH_MAX


def test_fix_of_a_run_that_compared_nothing_does_not_pass(tmp_path):
    """31c: `fix` of a run that checked nothing (there: a multi-node script started without torchrun) exited 0, the
    code of "a remedy verified, or nothing to fix": a CI gate read it as fixed. Here the script only evaluates
    through its checkpoints: no backward, nothing compared, exit 4 as `run` says."""
    script = tmp_path / "evaluate_only.py"
    script.write_text("import torch\nimport torch.nn as nn\nimport torch.utils.checkpoint as cp\n\n"
                      "block = nn.Linear(4, 4)\nwith torch.no_grad():\n"
                      "    for _ in range(2):\n        cp.checkpoint(block, torch.randn(2, 4), use_reentrant=False)\n")
    proc, report = _fix(tmp_path / "out", str(script))
    assert report["verdict"] == "unchecked", report["headline"]
    assert proc.returncode == 4, proc.stderr[-2000:]


@pytest.mark.parametrize("ranks, per_node, flag", [(1, None, ""), (1, 1, "--nproc-per-node 1 "),
                                                    (4, 2, "--nproc-per-node 2 "),
                                                    (2, 1, "--nproc-per-node 1 "), (3, None, "--nproc-per-node 3 ")])
def test_a_run_under_torchrun_is_verified_under_torchrun(ranks, per_node, flag):
    """32c: two nodes of one process each: the verify line read `ac-diff fix train.py` (no torchrun: the script's
    init_process_group found no RANK), and `fix --nproc-per-node 1` ran it without torchrun too. Under torchrun
    (LOCAL_WORLD_SIZE set), `fix` runs one node's processes under torchrun, one of them too."""
    from ac_diff.fix.statuses import fix_command, run_command, verify_nproc

    n = verify_nproc(ranks, per_node)
    assert fix_command("train.py", ["--lr", "1"], False, n) == f"ac-diff fix {flag}train.py --lr 1"
    assert run_command([], "train.py", [], False, n).startswith(f"ac-diff run {flag}--reference no-ac")
