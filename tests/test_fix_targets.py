"""Remedies that hit their target: `ac-diff fix` restores a private generator in the module that holds it and every
buffer the report found updated, the restore never undoes a module's first forward, and fix's headline never points
at a code change it does not show.

Real mechanisms (tests/stacks/): LoRA dropouts drawing from their own generators two modules below the checkpointed
block (lora_generator.py), two linears in one block each updating a running buffer (two_running_buffers.py), an
fp8-style amax history filled from the first batch on the first forward and rolled by every forward
(delayed_scaling.py).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from ac_diff.commands.fix_cmd import _result
from ac_diff.diagnosis.suggest import LOUDER
from ac_diff.fix.candidates import Candidate
from ac_diff.fix.result import VERIFIED, Try
from ac_diff.fix.tries import Measured
from ac_diff.remedies import RemedySpec
from ac_diff.report import Suggestion
from stacks.runs import STACKS, Job, fix, run_all


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("targets")
    with ThreadPoolExecutor(2) as pool:
        lora = pool.submit(fix, out / "lora", "--max-tries", "2", str(STACKS / "lora_generator.py"))
        two = pool.submit(fix, out / "two", "--max-tries", "1", str(STACKS / "two_running_buffers.py"))
        scaled = pool.submit(run_all, out, {"scaled": Job(
            [str(STACKS / "delayed_scaling.py")],
            ["--reference", "no-ac", "--reference-steps", "3", "--restore-in-recompute", "layers.*.amax_history"])})
        return {"lora": lora.result(), "two": two.result(), "scaled": scaled.result()["scaled"]}


def _restore_try(report: dict) -> dict:
    return next(t for t in report["fixes"]["tries"] if t["remedy"].startswith("restore"))


@pytest.mark.e2e
def test_a_private_generator_is_restored_in_the_module_that_holds_it(runs):
    """Not the block's glob (`layers.*`, which holds no generator itself): each LoRA dropout that draws."""
    proc, report = runs["lora"]
    assert report["regions"][0]["cause"]["names"] == ["layers.0.q_proj.lora_dropout.default",
                                                      "layers.0.v_proj.lora_dropout.default"]
    t = _restore_try(report)
    assert t["args"] == ["--restore-in-recompute", "layers.*.q_proj.lora_dropout.default",
                         "--restore-in-recompute", "layers.*.v_proj.lora_dropout.default"]
    assert (t["status"], t["regions_before"], t["regions_after"], t["gradients"]) == ("verified", 6, 0,
                                                                                       "bit-identical")
    assert report["fixes"]["verified"] == t["remedy"] and "gen.set_state(gen_state)" in report["fixes"]["verified_code"]
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.e2e
def test_one_restore_covers_every_buffer_the_report_found_updated(runs):
    """fc1's and fc2's running buffers both moved: the first try restores both, not only the lead's."""
    proc, report = runs["two"]
    t = report["fixes"]["tries"][0]
    assert t["args"] == ["--restore-in-recompute", "layers.*.fc1.running", "--restore-in-recompute",
                         "layers.*.fc2.running"], t
    assert (t["status"], t["regions_after"], t["gradients"]) == ("verified", 0, "bit-identical")
    code = report["fixes"]["verified_code"]
    assert "`layers.*.fc1.running`, `layers.*.fc2.running`" in code and "register_step_post_hook" in code
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.e2e
def test_restoring_a_lazily_filled_history_keeps_the_first_forwards_filling(runs):
    """Step 0's recompute replays the forward's filling of the history (it used to read the empty history under the
    flag the forward had set: its 3 regions diverged where none had): every region is clean and 3 steps of
    gradients match the run without AC."""
    r = runs["scaled"]
    assert r.report is not None, r.explain()
    assert [g["status"] for g in r.report["regions"]] == ["clean"] * 9, r.explain()
    assert r.report["reference"]["verdict"] == "identical", r.report["reference"]["headline"]
    assert len(r.report["reference"]["steps"]) == 3


def _headline(tmp_path, suggestions: list[Suggestion], only_no_ac: bool = True) -> tuple[str, str | None]:
    """fix's headline and code change for a diverged region with `suggestions`: turning AC off verified, or (not
    `only_no_ac`) no remedy at all."""
    report = SimpleNamespace(regions=[SimpleNamespace(module="layers.0", status="diverged", suggestions=suggestions)],
                             reference=None, diverged=True)
    no_ac = Candidate("no AC in layers.0", RemedySpec(no_ac=["layers.0"]), "the diverged regions", "no_ac")
    found, tries = ([no_ac], [Try(no_ac.name, no_ac.spec.cli_args(), no_ac.why, VERIFIED)]) if only_no_ac else ([], [])
    result = _result(report, found, tries, Measured(1.0, 0, tmp_path / "base.log"), 2.0)
    return result.headline, result.code_change


def test_the_headline_points_at_a_code_change_only_when_one_is_shown(tmp_path):
    """Only turning AC off works and the region's one suggestion is the CI check (no code change): the headline says
    no code change that keeps AC is known, instead of pointing at one below."""
    loud = Suggestion(LOUDER, "keep ac-diff run --check in CI")
    headline, change = _headline(tmp_path, [loud])
    assert change is None and "below" not in headline and "knows no code change that keeps AC" in headline
    headline, change = _headline(tmp_path, [loud], only_no_ac=False)
    assert change is None and "below" not in headline
    update = Suggestion("Update `layers.0.fc1.running` after the backward", "apply the update after backward")
    headline, change = _headline(tmp_path, [update, loud])
    assert change.startswith("Update `layers.0.fc1.running`") and headline.endswith("the code change below keeps AC")


def _sac_run(regions: int, saved: list[int]) -> SimpleNamespace:
    """A run whose `regions` forwards' selective AC saved one output of `saved[i]` float32 elements each."""
    import contextlib

    from ac_diff.passes import OpRecord, Pass, Region, TensorMeta

    def region(i: int) -> Region:
        ops = [OpRecord(0, "aten.topk.default", out=[TensorMeta((saved[i],), "f32", "cpu")], cached=True)]
        return Region(rank=0, region=i, module="layers.0", forward=Pass("forward", ops=ops))
    return SimpleNamespace(regions=[region(i) for i in range(regions)], loaded=lambda r: contextlib.nullcontext())


def test_a_tries_extra_memory_is_per_region_of_each_run():
    """A base run that crashed in its first backward recorded 2 regions, the try 6: what selective AC saved is
    averaged over each run's own regions (it summed the try's 6 over the base's 2: +209 KiB where 3 KiB is true)."""
    from ac_diff.fix.memory import extra_bytes_per_region

    base, tried = _sac_run(2, [0, 0]), _sac_run(6, [256] * 6)
    assert extra_bytes_per_region(tried, base, []) == 256 * 4


def test_a_scripts_own_sac_policy_is_added_to_not_replaced():
    """The script's regions already run a selective-AC policy (it saves its own matmuls): the try composes with it,
    and the form says to add the op to that policy (it printed a fresh policy saving the op alone)."""
    from ac_diff.fix.candidates import candidates
    from ac_diff.fix.forms import code_for

    region = SimpleNamespace(status="diverged", module="layers.0.moe", kind="checkpoint", cause=None, repeated=[],
                             checkpoint_options={"sac": True}, changed_inputs=[],
                             first_discrete_divergence=SimpleNamespace(op="aten.topk.default", module="layers.0.moe.router"))
    (save, *_) = candidates(SimpleNamespace(regions=[region], reference=None))
    assert save.kind == "must_save" and save.own_policy
    code = code_for(save)
    assert "already pass a selective-AC policy (context_fn): add torch.ops.aten.topk.default" in code
    assert "SAVE = {" not in code  # (no policy of its own that would drop the script's saves)


@pytest.mark.parametrize("fix", [None, "code"])
def test_a_restores_code_change_is_the_diagnosiss_fix_for_that_state(fix):
    """A verified restore printed one template for every state: "update it after the backward, in an optimizer step
    hook", which trains another schedule for a counter the forward reads after counting, and cannot be done for an
    adapter switched between two forwards of a step. It now prints the diagnosis's own fix for that state; without
    one, to change it after the backward or pass it in as an argument."""
    from ac_diff.fix.candidates import candidates
    from ac_diff.fix.forms import code_for
    from ac_diff.report import Cause, Suggestion

    own = Suggestion("Update `blocks.0.seen` before the forward that reads it, outside the checkpointed region", "",
                     "model.blocks[0].seen += 8  # before the forward") if fix else Suggestion("Turn it loud", "", "x")
    region = SimpleNamespace(status="diverged", module="blocks.0", kind="checkpoint", repeated=[], changed_inputs=[],
                             cause=Cause("state_mutation", "blocks.0.seen", "", mechanism="attribute"),
                             checkpoint_options={}, first_discrete_divergence=None, suggestions=[own])
    restore = next(c for c in candidates(SimpleNamespace(regions=[region], reference=None)) if c.kind == "restore")
    code = code_for(restore)
    assert "register_step_post_hook" not in code, code
    if fix:  # (the restore covered every block: the change, shown for blocks.0, is for each of them)
        assert code.endswith("# Update `blocks.0.seen` before the forward that reads it, outside the checkpointed "
                             "region\n# the same for every module blocks.*.seen names, not only the one shown\n"
                             "model.blocks[0].seen += 8  # before the forward"), code
    else:
        assert "pass the value" in code and "checkpoint(block, x, value" in code, code


def test_an_attribute_bound_to_another_tensor_before_the_backward_is_restored_in_the_recompute():
    """An annealed temperature kept as a tensor attribute, `self.tau = self.tau * 0.9` before the backward (cause:
    rebound): `fix` tried only turning AC off and said no remedy that keeps AC works, where restoring the forward's
    `tau` in the recompute is bit-identical to the run without AC."""
    from ac_diff.fix.candidates import candidates
    from ac_diff.report import REBOUND, Cause

    region = SimpleNamespace(status="diverged", module="blocks.0", kind="checkpoint", repeated=[], changed_inputs=[],
                             cause=Cause("state_mutation", "blocks.0.tau", "", mechanism=REBOUND),
                             checkpoint_options={}, first_discrete_divergence=None, suggestions=[])
    restore = next(c for c in candidates(SimpleNamespace(regions=[region], reference=None)) if c.kind == "restore")
    assert restore.state == "blocks.*.tau", restore


def test_turning_ac_off_in_a_reentrant_region_costs_what_its_recompute_saved(tmp_path):
    """A reentrant region's forward runs without grad and saves nothing; without AC it would keep what its recompute
    saved (it said +0 B/region)."""
    import torch
    from torch.utils.checkpoint import checkpoint

    import ac_diff
    from ac_diff.fix.memory import extra_bytes_per_region
    from ac_diff.trace import read_run

    torch.manual_seed(0)
    block, path = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()), tmp_path / "t.jsonl"
    with ac_diff.record(path):
        checkpoint(block, torch.randn(4, 8, requires_grad=True), use_reentrant=True).sum().backward()
    run = read_run(path)
    assert run.regions[0].kind == "reentrant" and not run.regions[0].forward.positions
    assert extra_bytes_per_region(run, run, ["*"]) == 2 * 4 * 8 * 4  # (at most) the linear's and the tanh's outputs


def test_turning_ac_off_covers_every_layer_where_the_cause_is_random():
    """Stochastic depth drawn on the host: which blocks diverge is chance, and another run diverges in others. The
    no-AC try covers the whole stack (it named the blocks that diverged once, and did not help on the next run)."""
    from ac_diff.fix.candidates import candidates

    def region(module: str, kind: str) -> SimpleNamespace:
        return SimpleNamespace(status="diverged", module=module, kind="checkpoint", repeated=[], checkpoint_options={},
                               cause=SimpleNamespace(kind=kind, mechanism="host_rng", tensor=None, names=[]),
                               first_discrete_divergence=None, changed_inputs=[])

    drawn = candidates(SimpleNamespace(regions=[region("blocks.0", "rng"), region("blocks.2", "rng")], reference=None))
    assert [c.spec.no_ac for c in drawn if c.kind == "no_ac"] == [["blocks.*"]]
    stepped = candidates(SimpleNamespace(regions=[region("blocks.0", "state_mutation")], reference=None))
    assert [c.spec.no_ac for c in stepped if c.kind == "no_ac"] == [["blocks.0"]]  # (a named module: only it)


def test_where_saving_the_decision_and_restoring_the_state_both_work_the_code_change_leads(tmp_path):
    """A schedule stepped before the backward: saving the comparison it feeds and restoring the attribute both make
    every region clean; the restore simulates the code change (step after the backward), which keeps no extra
    memory: it leads. The suggestion marked verified for the save shows what was verified (its own form saved the
    matmul feeding it too)."""
    from ac_diff.fix.statuses import mark

    save = Candidate("save aten.gt.Scalar in blocks.*", RemedySpec(must_save=["aten.gt.Scalar"],
                     must_save_modules=["blocks.*"]), "flipped", "must_save", "aten.gt.Scalar")
    restore = Candidate("restore the forward's blocks.*.threshold in the recompute",
                        RemedySpec(restore=["blocks.*.threshold"]), "state", "restore", state="blocks.*.threshold")
    tries = [Try(c.name, c.spec.cli_args(), c.why, VERIFIED, command=f"ac-diff run {c.kind}") for c in (save, restore)]
    sac = Suggestion("Save aten.gt.Scalar with selective activation checkpointing", "...",
                     "SAVE = {\n    torch.ops.aten.gt.Scalar,\n    torch.ops.aten.addmm.default,\n}")
    report = SimpleNamespace(regions=[SimpleNamespace(module="blocks.0", status="diverged", suggestions=[sac])],
                             reference=None, diverged=True)
    result = _result(report, [save, restore], tries, Measured(1.0, 0, tmp_path / "base.log"), 2.0)
    assert result.verified == restore.name and result.headline.startswith("verified: restore the forward's")
    mark(report, "train.py", [], False, list(zip([save, restore], tries)))
    assert sac.status == VERIFIED and "aten.addmm.default" not in sac.code and "aten.gt.Scalar" in sac.code
    assert sac.text.endswith("(ac-diff verified saving aten.gt.Scalar alone: the code below.)")


def test_the_code_change_is_the_diverged_regions_not_a_clean_ones_side_effect_fix(tmp_path):
    """A step whose batch norms updated their statistics twice (clean regions, a side-effect fix) before a later
    step diverged on `model.eval()`: the code change fix points at is the diverged region's (it offered the
    batch-norm save its own table marked "did not help")."""
    side = Suggestion("Save aten.native_batch_norm.default with selective activation checkpointing", "...")
    mode = Suggestion("Keep the model's train/eval mode until the backward has run", "...")
    report = SimpleNamespace(regions=[SimpleNamespace(module="blocks.0", status="clean", suggestions=[side]),
                                      SimpleNamespace(module="blocks.0", status="diverged", suggestions=[mode])],
                             reference=None, diverged=True)
    result = _result(report, [], [], Measured(1.0, 0, tmp_path / "base.log"), 2.0)
    assert result.code_change.startswith("Keep the model's train/eval mode"), result.code_change


@pytest.mark.parametrize("kind", ["reentrant", "checkpoint"])
def test_rounding_through_reentrant_regions_is_fixed_by_use_reentrant_false(kind):
    """33d: T5 with reentrant AC, every region reproduced, gradients 3e-7 off the run without AC: the fix said
    deterministic algorithms (which did not help) and `fix` never tried use_reentrant=False, which makes them
    bit-identical (a reentrant region's backward sums in an order of its own). Both are named, and tried."""
    from ac_diff.fix.candidates import candidates
    from ac_diff.reference.explain import explain
    from ac_diff.reference.result import ParamDiff, StepComparison

    region = SimpleNamespace(status="clean", module="encoder.block.0", kind=kind, cause=None, repeated=[],
                             changed_inputs=[], checkpoint_options={}, first_discrete_divergence=None, suggestions=[],
                             side_effects=[], state_changes={}, rank=0, host_draws=[], unchecked_reason=None)
    report = SimpleNamespace(regions=[region], reference=None)
    rounding = [StepComparison(step=0, loss_identical=True, loss_rel_diff=None, parameters=4, identical=3,
                               differing=[ParamDiff("encoder.block.0.w", "differs", 3e-7)])]
    report.reference = explain(rounding, [], report, steps_requested=1)
    (why,) = report.reference.explanations
    assert why.kind == "backward_kernels" and ("use_reentrant=False" in why.fix) is (kind == "reentrant"), why.fix
    tried = [c.kind for c in candidates(report)]
    assert tried == (["deterministic", "non_reentrant"] if kind == "reentrant" else ["deterministic"]), tried


def test_a_verified_restore_of_quantization_observers_reads_as_turning_them_off():
    """33c: QAT (prepare_qat's moving-average observers): `fix` verified restoring the 16 observers' ranges in the
    recompute, then told the user to "change it after backward or pass the value as an argument", which cannot be
    done to an observer's internals. The change is the diagnosis's own: the observers off while the backward runs."""
    from ac_diff.fix.candidates import Candidate
    from ac_diff.fix.forms import code_for
    from ac_diff.remedies import RemedySpec

    names = ["blocks.*.fc1.activation_post_process.min_val", "blocks.*.fc1.weight_fake_quant.activation_post_process"
             ".max_val"]
    code = code_for(Candidate("restore", RemedySpec(restore=names), "state_mutation", "restore",
                              state=", ".join(names)))
    assert "model.apply(tq.disable_observer)" in code and "pass the value" not in code, code
    other = code_for(Candidate("restore", RemedySpec(restore=["blocks.*.center"]), "state_mutation", "restore",
                               state="blocks.*.center"))
    assert "disable_observer" not in other and "pass the value" in other, other


def test_a_verified_try_says_what_its_recompute_still_counts_twice():
    """33b: MoE whose router bias moves before the backward and whose token counts (which feed the next bias update)
    are counted twice under AC: `fix` verified restoring the bias over 2 backward passes, bit-identical, and said no
    more; the counts, still updated twice, move the bias two steps later (backward 3 differs). Verified, and said."""
    from ac_diff.fix.result import VERIFIED, Try
    from ac_diff.fix.tries import Measured, judge
    from ac_diff.report import Report, RegionReport

    region = RegionReport(rank=0, region=0, module="layers.0.moe", kind="checkpoint", status="clean", silent=False,
                          cause=None, first_value_divergence=None, first_discrete_divergence=None,
                          first_shape_divergence=None, first_control_divergence=None, positions=[], suggestions=[],
                          chain=[])
    region.repeated = [("layers.0.moe.tokens_per_expert", "aten.add_.Tensor", "layers.0.moe")]
    identical = SimpleNamespace(steps=[SimpleNamespace(differing=[], parameters=4)], backwards=2, defect=False)
    ok = Measured(1.0, 0, None)
    tried = Try("restore the forward's layers.*.moe.expert_bias in the recompute", [], "state_mutation")
    judge(tried, Report(verdict="clean", headline="", regions=[region]), identical, ok, ok, None,
          culprits=frozenset({"layers.0.moe.expert_bias"}))
    assert tried.status == VERIFIED, tried.reason
    assert "layers.0.moe.tokens_per_expert a second time" in tried.reason and "--steps 4" in tried.reason, tried.reason
