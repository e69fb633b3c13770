"""reference/explain.py on given gradient comparisons: what a later loss that differs means, a backward that left no
gradient to compare, and a first loss that differs: a kernel that gives other values from identical inputs in
another process, or the script's own randomness, told apart on factory-built first forwards (no runs needed: the
e2e cases are in test_reference.py and test_reference_kernel.py)."""

from __future__ import annotations

from dataclasses import replace

from types import SimpleNamespace

import pytest
import torch

from ac_diff.passes import Pass, Region
from ac_diff.reference.explain import explain
from ac_diff.reference.forwards import first_difference
from ac_diff.reference.result import DIFFERS, FAILED, IDENTICAL, NOT_COMPARABLE, ParamDiff, StepComparison
from factories import ext, op, param_ref, ref, run


def _steps(second_loss_identical: bool, no_grad: int = 0, grads_follow: bool = True) -> list[StepComparison]:
    """Two backward passes; the second's loss differs where asked, and its gradients with it (a state that differs
    as the step starts reaches both), unless `grads_follow` is False."""
    follow = not second_loss_identical and grads_follow
    return [StepComparison(step=0, loss_identical=True, loss_rel_diff=None, parameters=4, identical=4, no_grad=no_grad),
            StepComparison(step=1, loss_identical=second_loss_identical, loss_rel_diff=1e-4, parameters=4,
                           identical=3 if follow else 4, no_grad=no_grad,
                           differing=[ParamDiff("l0.w", "differs", 1e-3)] if follow else [])]


def _report(side_effects=(), rng=False, cause=None, mechanism=None, source=None, host_draws=()):
    region = SimpleNamespace(side_effects=list(side_effects), state_changes={"rng": {}} if rng else {},
                             cause=SimpleNamespace(kind=cause, mechanism=mechanism, source=source) if cause else None,
                             status="clean", rank=0, module="l0", host_draws=list(host_draws), unchecked_reason=None)
    return SimpleNamespace(regions=[region])


def test_a_later_loss_after_identical_gradients_is_the_repeated_update_when_there_is_one():
    effect = "l0.center is updated in place by aten.mul_.Tensor in l0 (x.py:3) inside the region, so ... (counted twice)"
    result = explain(_steps(False), [], _report([effect]), steps_requested=2)
    assert result.verdict == DIFFERS and result.explanations[0].kind == "repeated_update"
    assert "l0.center" in result.explanations[0].text and "repeated update" in result.headline


def test_a_later_loss_that_differs_while_every_gradient_matches_is_the_forwards_values_only():
    """27e: an aux loss normalised by a counter the recompute advances again (f = counts / counts.sum()): the
    forward's loss differs from the run without AC from backward 2, the recompute's saved tensors, hence every
    gradient, match it. The reference said "differs: repeated update" over 34 identical gradients, and the report
    "the gradients ... are silently wrong"."""
    effect = ("l0.counts is updated in place by aten.add_.Tensor in l0 (x.py:3) inside the region, so ... "
              "(counted twice)")
    result = explain(_steps(False, grads_follow=False), [], _report([effect]), steps_requested=2)
    assert result.verdict == IDENTICAL and not result.defect, result.headline
    assert "the loss of backward 2 differs (rel. diff 0.0001)" in result.headline, result.headline
    assert any("l0.counts" in n and "the training is the same" in n for n in result.notes), result.notes


def test_a_first_loss_after_a_recompute_that_updated_state_again_is_acs_doing():
    """27f: a WGAN-GP step takes its penalty with torch.autograd.grad(create_graph=True) before the loss's backward:
    the critic's regions are recomputed there, and spectral norm's `_u` is updated a second time before the next
    forward reads it. The first loss differed and the reference said "the script's own randomness: seed it", on a
    seeded script. An earlier region that repeated an update, before the first region to differ, is AC's doing."""
    first = [StepComparison(step=0, loss_identical=False, loss_rel_diff=5e-5, parameters=4, identical=4)]
    def region(number: int, backward: int, repeats: bool) -> SimpleNamespace:
        return SimpleNamespace(
            rank=0, region=number, module="D.blocks.0", status="diverged", silent=True, backward=backward, step=1,
            repeated=[("D.blocks.0.fc1._u", "aten.mv.default", "D.blocks.0.fc1")] if repeats else [],
            cause=SimpleNamespace(kind="state_mutation", mechanism="updated_in_forward", tensor="D.blocks.0.fc1._v",
                                  source="sn.py:14 in forward"))

    def first_differing(number: int) -> SimpleNamespace:  # (forwards.first_difference's region)
        return SimpleNamespace(rank=0, region=number, module="D.blocks.0", changed_inputs=[], cause=None,
                               first_value_divergence=None, first_control_divergence=None,
                               first_divergence=lambda: None)

    penalty = [region(0, 1, True), region(2, 2, True)]  # (region 0 recomputed by the penalty, region 2 after it)
    result = explain(first, [], SimpleNamespace(regions=penalty), steps_requested=1, first_forward=first_differing(2))
    assert result.verdict == DIFFERS and result.explanations[0].kind == "repeated_update", result.headline
    assert "`D.blocks.0.fc1._u` a second time" in result.explanations[0].text
    assert "as AC changed the forward itself" in result.headline and "randomness" not in result.headline
    # a plain step, every region recomputed in the one backward after all the forwards (a batch norm's statistics
    # counted twice in region 0): a first loss that differs at region 2 is the script's own randomness, as before
    plain = [region(0, 1, True), region(2, 1, False)]
    for number in (0, 2):
        alone = explain(first, [], SimpleNamespace(regions=plain), steps_requested=1,
                        first_forward=first_differing(number))
        assert alone.verdict == NOT_COMPARABLE, alone.headline


def test_random_draws_excuse_a_later_loss_only_with_evidence_of_draws():
    drew = explain(_steps(False), [], _report(rng=True), steps_requested=2)
    assert drew.verdict == IDENTICAL and [e.kind for e in drew.explanations] == ["rng_draws"]
    unexplained = explain(_steps(False), [], _report(), steps_requested=2)
    assert unexplained.verdict == DIFFERS and unexplained.explanations[0].kind == "state_drift"
    same = explain(_steps(True), [], _report(), steps_requested=2)
    assert same.verdict == IDENTICAL and not same.explanations
    # clean regions whose recompute drew from Python's `random` again (LayerDrop decided on the host, the same
    # decisions as their forwards): the run goes on from other draws than without AC, which preserve_rng_state
    # cannot prevent: checkpointing changes the training (26a/26g: "identical" over 1 of 4, then at risk, where the
    # gradients differ from backward 2)
    host = explain(_steps(False), [], _report(host_draws=["random"]), steps_requested=2)
    assert host.verdict == DIFFERS and [e.kind for e in host.explanations] == ["host_draws"]
    assert "drew from a host generator (Python's random, NumPy) again" in host.explanations[0].text


def test_host_draws_are_not_answered_with_preserve_rng_state():
    """A region that draws from Python's random (LayerDrop): the later loss differs because the recompute drew
    again; preserve_rng_state, which the script already had, restores torch's generators only."""
    host = explain(_steps(False), [], _report(cause="rng", mechanism="host_rng", source="m.py:23 in forward"),
                   steps_requested=2)
    why = host.explanations[0]
    assert why.kind == "host_draws" and "m.py:23 in forward" in why.text
    assert "--preserve-rng" not in why.fix and "outside the checkpointed region" in why.fix
    torch_rng = explain(_steps(False), [], _report(cause="rng", mechanism="preserve_rng_state"), steps_requested=2)
    assert "--preserve-rng" in torch_rng.explanations[0].fix
    # a private torch.Generator the region draws from again (32a: "rng draws ... not a gradient defect; later
    # backwards are not compared", with the preserve_rng_state fix the script already had): a defect, compared on
    private = _report(cause="rng", mechanism="private_generator", source="m.py:9 in heads")
    private.regions[0].cause.tensor = "the torch.Generator passed to aten.randn.generator at m.py:9"
    drew = explain(_steps(False), [], private, steps_requested=2)
    assert drew.verdict == DIFFERS and [e.kind for e in drew.explanations] == ["private_generator"], drew.explanations
    assert "--preserve-rng" not in drew.explanations[0].fix and "generator's state" in drew.explanations[0].fix


def test_a_backward_that_left_every_grad_none_compares_nothing():
    """An optimizer step in a backward hook frees every .grad: None == None in both runs is no evidence."""
    result = explain(_steps(False, no_grad=4), [], _report(), steps_requested=2)
    assert result.verdict == FAILED and "no gradients to compare" in result.headline
    frozen = explain(_steps(True, no_grad=2), [], _report(), steps_requested=2)  # some frozen parameters: fine
    assert frozen.verdict == IDENTICAL


def test_fix_does_not_verify_a_try_whose_recompute_still_updates_the_culprit_twice(tmp_path):
    """A remedy that saves the decision: every recompute matches and the compared backwards too, but the bias the
    base run's cause names is still updated a second time by each recompute: the drift shows later (did not help).
    The same try with only a harmless repeated update (batch norm's running statistics) is verified."""
    from ac_diff.fix.result import DID_NOT_HELP, VERIFIED, Try
    from ac_diff.fix.tries import Measured, judge
    from ac_diff.report import Report, RegionReport

    def report(*effects):
        region = RegionReport(rank=0, region=0, module="layers.0", kind="checkpoint", status="clean", silent=False,
                              cause=None, first_value_divergence=None, first_discrete_divergence=None,
                              first_shape_divergence=None, first_control_divergence=None, positions=[],
                              suggestions=[], chain=[], side_effects=[f"{e} is updated in place by aten.add_.Tensor in "
                                                                      "layers.0.moe (m.py:9) inside the region"
                                                                      for e in effects],
                              repeated=[(e, "aten.add_.Tensor", "layers.0.moe") for e in effects])
        return Report(verdict="clean", headline="", regions=[region])

    identical = SimpleNamespace(steps=_steps(True), defect=False)
    ok = Measured(1.0, 0, tmp_path / "log")
    still = Try("save aten.topk.default in layers.*.moe", [], "state_mutation")
    judge(still, report("layers.0.moe.bias"), identical, ok, ok, "aten.topk.default",
          culprits=frozenset({"layers.0.moe.bias"}))
    assert still.status == DID_NOT_HELP and "layers.0.moe.bias" in still.reason and "second time" in still.reason
    harmless = Try("preserve_rng_state=True", [], "rng")
    judge(harmless, report("layers.0.bn.running_mean"), identical, ok, ok, None,
          culprits=frozenset({"aten.native_dropout.default"}))
    assert harmless.status == VERIFIED
    # a counter the region's code reads (a balancing update in a forward hook from the counts the recompute adds
    # again, 27e): the recompute still computes with it a second time, the drift shows after the compared passes
    from ac_diff.diagnosis.cause import Cause
    from ac_diff.report import STATE_READ_AGAIN

    reads = report("layers.0.moe.tokens_per_expert")
    reads.regions[0].status, reads.regions[0].unchecked_reason = "unchecked", STATE_READ_AGAIN
    reads.regions[0].cause = Cause("state_mutation", "layers.0.moe.tokens_per_expert", "reads it", [])
    saved = Try("save aten.topk.default in layers.*.moe", [], "state_mutation")
    judge(saved, reads, SimpleNamespace(steps=_steps(True), defect=False, backwards=2), ok, ok, "aten.topk.default",
          culprits=frozenset({"layers.0.moe.expert_bias"}))
    assert saved.status == DID_NOT_HELP and "reads a second time (`layers.0.moe.tokens_per_expert`)" in saved.reason, \
        saved.reason


def test_fix_says_a_try_whose_remedy_matched_nothing_was_not_applied(tmp_path):
    """A restore of a name the run never held ran as the base run did: the table said "did not help", as if the change
    had been simulated and failed, and `fix` concluded only AC off works."""
    from ac_diff.fix.result import DID_NOT_HELP, Try
    from ac_diff.fix.tries import Measured, judge
    from ac_diff.report import Report, RegionReport

    region = RegionReport(rank=0, region=0, module="layers.0", kind="checkpoint", status="diverged", silent=True,
                          cause=None, first_value_divergence=None, first_discrete_divergence=None,
                          first_shape_divergence=None, first_control_divergence=None, positions=[], suggestions=[],
                          chain=[])
    report = Report(verdict="diverged", headline="", regions=[region], remedies=[
        {"remedy": "restore", "region": None, "calls": 0, "what": "matched nothing: layers.*.attn.mem (...)"}])
    ok = Measured(1.0, 0, tmp_path / "log")
    tried = Try("restore the forward's layers.*.attn.mem in the recompute", [], "state_mutation")
    judge(tried, report, SimpleNamespace(steps=_steps(False), defect=True), ok, ok, None)
    assert tried.status == DID_NOT_HELP and tried.reason.startswith("not applied: the remedy matched nothing"), \
        tried.reason


def test_fix_judges_a_script_that_always_ends_with_its_own_exit_code_by_its_tries(tmp_path):
    """A pipeline gate ends every run with `sys.exit(3)`, the base run's too: every try was called crashed, quoting
    ac-diff's own "next:" line as the script's error, and the remedy that works was not verified. A try that exits as
    the base run did, by the script's own exit, is judged by its regions and gradients; one that exits otherwise still
    crashed, and its quoted line is the script's."""
    from ac_diff.fix.result import CRASHED, VERIFIED, Try
    from ac_diff.fix.tries import Measured, judge
    from ac_diff.report import Report, RegionReport

    region = RegionReport(rank=0, region=0, module="layers.0", kind="checkpoint", status="clean", silent=False,
                          cause=None, first_value_divergence=None, first_discrete_divergence=None,
                          first_shape_divergence=None, first_control_divergence=None, positions=[], suggestions=[],
                          chain=[])
    log = tmp_path / "log"
    log.write_text("step 2 0.5\nval loss too high\nac-diff: next: ac-diff report out\n")
    identical = SimpleNamespace(steps=_steps(True), defect=False)
    gate, failed = Measured(1.0, 3, log), Measured(1.0, 1, log)
    kept = Try("use_reentrant=False", [], "lost_gradient")
    judge(kept, Report(verdict="clean", headline="", regions=[region], exit_status="exit", exit_code=3), identical,
          gate, gate, None)
    assert kept.status == VERIFIED, (kept.status, kept.reason)
    other = Try("use_reentrant=False", [], "lost_gradient")
    judge(other, Report(verdict="clean", headline="", regions=[region], exit_status="exit", exit_code=1), identical,
          failed, gate, None)
    assert other.status == CRASHED and other.reason.endswith("val loss too high"), other.reason


def test_fix_reaches_the_first_divergence_up_to_its_cap_and_knows_where_it_is():
    """A divergence in backward 200: `fix` said "the first divergence is in backward 32" (its cap on the backward
    passes a try compares), then that region was "recomputed in backward 200"."""
    from ac_diff.fix.tries import REACH_MAX, first_recomputed_in, reach

    report = SimpleNamespace(regions=[SimpleNamespace(status="clean", backward=3, step=3),
                                      SimpleNamespace(status="diverged", backward=200, step=200),
                                      SimpleNamespace(status="diverged", backward=250, step=250)])
    assert first_recomputed_in(report) == 200 and reach(report, 2) == REACH_MAX
    near = SimpleNamespace(regions=[SimpleNamespace(status="diverged", backward=None, step=10)])
    assert first_recomputed_in(near) == 10 and reach(near, 2) == 10 and reach(near, 12) == 12


def test_a_rank_that_only_received_another_ranks_error_says_so():
    """DDP averages gradients: rank 0's regions are clean but its gradients differ because rank 1 diverged."""
    step = StepComparison(step=0, loss_identical=True, loss_rel_diff=None, parameters=2, identical=0)
    step.differing = [SimpleNamespace(name="w", status="differs", rel_diff=0.1, region="l0")]
    rank1 = SimpleNamespace(rank=1, region=3, module="layers.0", status="diverged",
                            cause=SimpleNamespace(kind="rng"))
    report = _report()
    report.other_ranks_diverged = [rank1]
    result = explain([step], [], report, steps_requested=1)
    assert result.verdict == DIFFERS and result.explanations[0].kind == "other_rank_divergence"
    assert "rank 1" in result.explanations[0].text and "layers.0" in result.explanations[0].text


# -- a first loss that differs: the two runs' first forwards, op by op -------------------------------------------
def _first_loss_differs() -> list[StepComparison]:
    return [StepComparison(step=0, loss_identical=False, loss_rel_diff=3e-7, parameters=4, identical=0)]


def _forward(w=(1.0, 2.0), index_add=(2.0, 2.0), drop=(3.0, 3.0), random_drop=False) -> Region:
    """mm(param w) -> index_add -> dropout (random or not), with the given fingerprints."""
    ops = [op(0, "aten.mm.default", refs=[param_ref("layers.0.w")], fp=[[1.0, 1.0] if w == (1.0, 2.0) else [7.0, 7.0]]),
           op(1, "aten.index_add.default", refs=[ref(0)], fp=[list(index_add)]),
           op(2, "aten.native_dropout.default", refs=[ref(1)], fp=[list(drop)], random=random_drop)]
    return Region(rank=0, region=0, module="layers.0",
                  forward=Pass("forward", ops, externals=[ext("param", "layers.0.w", list(w))]))


def _first_loss(a: Region, b: Region):
    return explain(_first_loss_differs(), [], _report(), steps_requested=1,
                   first_forward=first_difference(run(a), run(b, path="reference/trace-rank0.jsonl")))


def test_a_first_loss_from_a_kernel_that_differs_between_processes_names_the_kernel():
    """Every input of index_add identical in both runs, its output not: a nondeterministic kernel (float atomics)."""
    result = _first_loss(_forward(), _forward(index_add=(2.0, 2.5), drop=(3.0, 3.5)))
    assert result.verdict == NOT_COMPARABLE and "(a nondeterministic kernel)" in result.headline
    why = result.explanations[0]
    assert why.kind == "nondeterministic_kernel" and why.region == "layers.0" and why.source == "model.py:11 in forward"
    assert ("nondeterministic kernel: aten.index_add.default at m (model.py:11 in forward) gives other values from the "
            "same inputs from one process to the next") in why.text
    assert why.fix == "run with torch.use_deterministic_algorithms(True) (ac-diff fix tries --deterministic)"


def test_a_first_loss_from_inputs_or_draws_that_already_differ_is_the_scripts_own_randomness():
    """A parameter that differs (unseeded initialisation), a random op drawing other numbers from identical inputs
    (unseeded), or nothing recorded: seed the script."""
    unseeded_init = _first_loss(_forward(), _forward(w=(1.0, 2.5), index_add=(2.0, 2.5), drop=(3.0, 3.5)))
    unseeded_draw = _first_loss(_forward(random_drop=True), _forward(drop=(3.0, 3.5), random_drop=True))
    unrecorded = explain(_first_loss_differs(), [], _report(), steps_requested=1, first_forward=None)
    for result in (unseeded_init, unseeded_draw, unrecorded):
        assert result.verdict == NOT_COMPARABLE and "(the script's own randomness)" in result.headline
        assert [e.kind for e in result.explanations] == ["reference_randomness"]
        assert result.explanations[0].fix.startswith("seed the script")
    assert "layers.0.w" in unseeded_init.explanations[0].text
    assert "aten.native_dropout.default" in unseeded_draw.explanations[0].text


def test_a_nondeterministic_kernel_makes_fix_try_deterministic_algorithms():
    """The base run is clean and its gradients could not be compared: deterministic algorithms is the remedy to try."""
    from ac_diff.fix.candidates import candidates

    result = _first_loss(_forward(), _forward(index_add=(2.0, 2.5), drop=(3.0, 3.5)))
    found = candidates(SimpleNamespace(regions=[], reference=result))
    assert [(c.kind, c.spec.cli_args()) for c in found] == [("deterministic", ["--deterministic"])]
    assert found[0].why == "nondeterministic kernel in m (model.py:11 in forward)"
    seeded = _first_loss(_forward(), _forward(w=(1.0, 2.5)))
    assert candidates(SimpleNamespace(regions=[], reference=seeded)) == []


def test_identical_gradients_do_not_vouch_for_a_region_that_diverged_in_a_later_step(tmp_path):
    """Full recording numbers steps as watch does (a top-level forward after a recompute begins the next); a
    region that diverged in a step after the compared backward passes is not covered by "the gradients match"
    (a stranger's accumulation loop diverged in step 4 and the report said the gradients matched, comparing 1)."""
    import torch.nn as nn
    import torch.utils.checkpoint as cp

    import ac_diff
    from ac_diff.reference.result import ReferenceResult
    from ac_diff.report import diverged_after

    torch.manual_seed(0)
    block, path = nn.Linear(4, 4), tmp_path / "t.jsonl"
    with ac_diff.record(path):
        for step in range(3):
            y = cp.checkpoint(block, torch.randn(2, 4, requires_grad=True), use_reentrant=False)
            if step == 2:
                with torch.no_grad():
                    block.weight.mul_(0.5)  # (an optimizer step between this forward and its backward)
            y.sum().backward()
    report = ac_diff.diagnose_paths([path])
    assert [r.step for r in report.regions] == [1, 2, 3]
    assert [r.region for r in diverged_after(report.regions, 1)] == [2]
    report.reference = ReferenceResult("no-ac", IDENTICAL, "gradients identical", 1,
                                       steps=_steps(True)[:1])
    assert "silently wrong" in report.silent_warning  # (not "yet the gradients match")
    # two ranks, two backward passes each: four comparisons, but backward 3 is still not among them (25b: `fix` said
    # "yet the gradients match" counting each rank's comparisons as backward passes)
    two_ranks = _steps(True) + [replace(s, rank=1) for s in _steps(True)]
    report.reference = ReferenceResult("no-ac", IDENTICAL, "gradients identical", 2, steps=two_ranks)
    assert report.reference.backwards == 2 and "silently wrong" in report.silent_warning
    assert report.title == "SILENTLY DIVERGED"
    # compared over backward 3 too, the gradients matched: the title says so (30a: it stayed SILENTLY DIVERGED, a
    # clamp's saved input a few ulps off that its backward's mask does not see)
    three = [replace(s, step=i) for i, s in enumerate(_steps(True) * 2)][:3]
    report.reference = ReferenceResult("no-ac", IDENTICAL, "gradients identical", 3, steps=three)
    assert report.reference.backwards == 3 and "yet the gradients match" in report.silent_warning
    assert (report.verdict, report.title) == ("diverged", "DIVERGED, GRADIENTS MATCH")


def test_a_reference_that_failed_in_its_first_backward_says_it_fails_without_ac_too():
    """(It said "exited with 1 before its first backward", where the run without AC failed in it: an in-place
    write torch's version check caught, the same bug without AC.)"""
    failed = explain([], [], _report(), steps_requested=1, exit_code=1)
    assert failed.verdict == FAILED
    assert "exited with 1 before its first backward finished (it fails without AC too" in failed.headline
    # where the run with AC finished its backward passes, only the run without AC fails: AC hides its error (25i: it
    # said "it fails without AC too", and `fix` "the gradients match the run without AC", compared over none)
    hidden = explain([], [], _report(), steps_requested=1, exit_code=1, captured=3)
    assert hidden.verdict == FAILED and "where the run with AC finished 3: checkpointing hides an error the run " \
        "without it raises" in hidden.headline, hidden.headline
    # killed (31c: a reference whose ranks never met, stopped by a timeout's SIGTERM) is no error of the script's
    killed = explain([], [], _report(), steps_requested=1, exit_code=-15, captured=3)
    assert killed.verdict == FAILED and "stopped by signal 15" in killed.headline, killed.headline
    assert "hides an error" not in killed.headline


def test_a_comparison_of_no_parameter_is_no_identical_gradients():
    """26d: a global nn.Parameter a checkpointed function reads, in no module the script calls: 0 parameters compared
    were "gradients identical to the run without AC (0 parameter(s), 2 backward pass(es))"; nothing is compared."""
    steps = [StepComparison(step=i, loss_identical=True, loss_rel_diff=None, parameters=0, identical=0)
             for i in range(2)]
    result = explain(steps, [], _report(), steps_requested=2)
    assert result.verdict == FAILED and "no parameter of a module the script called was seen" in result.headline


def test_parameters_that_get_a_gradient_in_one_run_only_are_counted_both_ways():
    """Stochastic depth drawn on the host: some blocks run only with AC, others only without. The headline counts
    both (it said "6 get no gradient with AC" and not that 6 others got one only with AC)."""
    step = StepComparison(step=0, loss_identical=True, loss_rel_diff=None, parameters=4, identical=1)
    step.differing = [SimpleNamespace(name="a", status="missing_in_run", rel_diff=None, region=None),
                      SimpleNamespace(name="b", status="missing_in_reference", rel_diff=None, region=None),
                      SimpleNamespace(name="c", status="differs", rel_diff=0.5, region=None)]
    result = explain([step], [], _report(), steps_requested=1)
    assert result.verdict == DIFFERS
    assert ", 1 get no gradient with AC, 1 get one only with AC" in result.headline, result.headline


def test_gradients_that_differ_where_every_recompute_reproduced_are_the_backwards_own_kernels():
    """A GNN whose backward (index_put_ with accumulate) runs with deterministic algorithms off: every region
    reproduced its saved tensors, yet gradients differ from the run without AC (from run to run too). Said as the
    backward's kernels, with the regions named as such; was "unexplained ... in: convs.0, convs.1, outside any
    checkpointed region". A region left unchecked keeps it unexplained."""
    from ac_diff.reference.result import ParamDiff

    first = StepComparison(step=0, loss_identical=True, loss_rel_diff=None, parameters=4, identical=1, differing=[
        ParamDiff(name="convs.0.w", status="differs", rel_diff=3e-7, region="convs.0"),
        ParamDiff(name="convs.1.w", status="differs", rel_diff=2e-7, region="convs.1"),
        ParamDiff(name="head.w", status="differs", rel_diff=1e-7, region=None)])
    report = _report()
    report.regions[0].state_changes = {"deterministic": {"forward": True, "recompute": False}}
    why = explain([first], [], report, steps_requested=1).explanations[0]
    assert why.kind == "backward_kernels", why
    assert "deterministic algorithms were True in the forward and False in the backward" in why.text
    assert why.text.endswith("the differing gradients are those of checkpointed region(s) convs.0, convs.1 and of 1 "
                             "parameter(s) outside any checkpointed region"), why.text
    # `fix` tries deterministic algorithms for them, as the explanation's own fix says (25i: "no mechanical remedy
    # applies to what was diagnosed")
    from ac_diff.fix.candidates import candidates

    result = explain([first], [], report, steps_requested=1)
    found = candidates(SimpleNamespace(regions=[], reference=result))
    assert [(c.kind, c.spec.cli_args()) for c in found] == [("deterministic", ["--deterministic"])], found
    report.regions[0].status = "unchecked"
    assert explain([first], [], report, steps_requested=1).explanations[0].kind == "unexplained"


@pytest.mark.parametrize("compared", [1, 2, 3])
def test_a_counter_read_only_for_logging_is_clean_once_the_gradients_match(tmp_path, compared):
    """Blocks count their calls and read the count only to decide whether to log: gradients at risk, and the headline
    sends the user to `--reference no-ac --reference-steps N`. That said "gradients identical" and the run stayed
    GRADIENTS AT RISK (exit 4). Identical over every backward pass the run made settles it: clean. Over fewer it
    cannot: a counter that crosses its threshold in a later step changes only that step's gradients (a warmup
    pre-hook's, 6 calls: CLEAN after 3 identical backward passes, the 4th differed)."""
    import torch.nn as nn
    import torch.utils.checkpoint as cp

    import ac_diff
    from ac_diff.reference.explain import attach
    from ac_diff.reference.result import ReferenceResult

    class Logged(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.calls, self.log = nn.Linear(4, 4), 0, []

        def forward(self, x):
            self.calls += 1
            h = torch.tanh(self.fc(x))
            if self.calls % 3 == 0:  # periodic activation logging only
                self.log.append(h.detach().abs().mean().item())
            return h

    torch.manual_seed(0)
    block, path = Logged(), tmp_path / "t.jsonl"
    with ac_diff.record(path):
        for _ in range(3):
            cp.checkpoint(block, torch.randn(2, 4, requires_grad=True), use_reentrant=False).sum().backward()
    report = ac_diff.diagnose_paths([path])
    assert (report.verdict, report.title) == ("unchecked", "GRADIENTS AT RISK"), report.headline
    assert "--reference-steps 3`" in report.headline, report.headline  # (every backward the run made)
    attach(report, ReferenceResult("no-ac", IDENTICAL, "gradients identical", compared,
                                   steps=[StepComparison(i, True, 0.0, 2, 2) for i in range(compared)]))
    if compared < 3:
        assert report.title == "GRADIENTS AT RISK"
        assert any(("compare 2 or more" if compared == 1 else "over 2 of the 3 backward passes") in n
                   and "--reference-steps 3" in n for r in report.regions for n in r.notes)
        return
    assert (report.verdict, report.title) == ("clean", "CLEAN"), report.headline
    assert "did not change the gradients over all 3 backward passes" in report.headline, report.headline


def test_gradients_one_run_has_and_the_other_lacks_are_no_rounding():
    """Every region clean, and parameters that get a gradient in one run only (a layer unfrozen after the forward,
    or a model re-created): it said "backward kernels ... rounding only" and offered deterministic algorithms."""
    from ac_diff.reference.result import ParamDiff

    steps = [StepComparison(step=0, loss_identical=True, loss_rel_diff=None, parameters=4, identical=2, differing=[
        ParamDiff("enc.0.weight", "missing_in_reference"), ParamDiff("enc.0.bias", "missing_in_reference")])]
    result = explain(steps, [], _report(), steps_requested=1)
    assert result.verdict == DIFFERS and result.explanations[0].kind == "other_parameters", result.explanations
    assert "2 parameter(s) get a gradient in one run only (2 only with AC, 0 only without it" in \
        result.explanations[0].text and "deterministic" not in result.explanations[0].fix
    rounding = [StepComparison(step=0, loss_identical=True, loss_rel_diff=None, parameters=4, identical=3,
                               differing=[ParamDiff("enc.0.weight", "differs", 1e-7)])]
    assert explain(rounding, [], _report(), steps_requested=1).explanations[0].kind == "backward_kernels"


def test_a_region_no_backward_reached_does_not_leave_rounding_unexplained():
    """Whisper's LayerDrop under reentrant AC (25a): two regions whose output fed no loss were never recomputed, and
    gradients that differ by rounding (1.8e-7) were "unexplained" because not every region was clean. A region no
    backward reached gives no gradient: the explanation is the backward's arithmetic, as with every region clean."""
    from ac_diff.reference.result import ParamDiff
    from ac_diff.report import NOT_REACHED

    report = _report()
    report.regions.append(SimpleNamespace(side_effects=[], state_changes={}, cause=None, status="unchecked", rank=0,
                                          module="l1", host_draws=[], unchecked_reason=NOT_REACHED))
    for r in report.regions[:1]:
        r.unchecked_reason = None
    rounding = [StepComparison(step=0, loss_identical=True, loss_rel_diff=None, parameters=4, identical=3,
                               differing=[ParamDiff("enc.0.weight", "differs", 1.8e-7)])]
    assert explain(rounding, [], report, steps_requested=1).explanations[0].kind == "backward_kernels"
    report.regions[1].unchecked_reason = "recorder error"  # (a region that was not compared still leaves it open)
    assert explain(rounding, [], report, steps_requested=1).explanations[0].kind == "unexplained"


def test_the_reentrant_note_stops_asking_for_the_comparison_once_it_ran(tmp_path):
    """A clean reentrant run notes that its backward may sum in another order and that `--reference no-ac` compares
    the gradients (25b): the note still asked for it after the comparison ran and found them identical."""
    import torch.utils.checkpoint as cp

    import ac_diff
    from ac_diff.diagnosis import REENTRANT_BACKWARD
    from ac_diff.reference.explain import attach
    from ac_diff.reference.result import ReferenceResult

    torch.manual_seed(0)
    block, path = torch.nn.Linear(4, 4), tmp_path / "t.jsonl"
    with ac_diff.record(path):
        cp.checkpoint(block, torch.randn(2, 4, requires_grad=True), use_reentrant=True).sum().backward()
    report = ac_diff.diagnose_paths([path])
    assert REENTRANT_BACKWARD in report.notes
    attach(report, ReferenceResult("no-ac", IDENTICAL, "gradients identical", 1, steps=_steps(True)[:1]))
    assert REENTRANT_BACKWARD not in report.notes
    assert any(n.endswith("the comparison with the run without AC below says whether they do") for n in report.notes)


def test_a_rank_whose_sharded_gradients_receive_another_ranks_error_keeps_its_regions():
    """26f: FSDP2 warmup blocks counting tokens twice; only rank 0's ramp still moves, so only rank 0 diverged. The
    reduce-scatter brings its error into rank 1's shard, whose figures differ from rank 0's (another shard): rank 1's
    clean regions of the same module were marked diverged, against its own ranks table. Another rank that diverged by
    then speaks for the difference, whatever the figures."""
    from ac_diff.reference.explain import attach
    from ac_diff.reference.result import ParamDiff, ReferenceResult

    def region(rank, n, status, reason=None):
        return SimpleNamespace(rank=rank, region=n, module="blocks.0", status=status, silent=status == "diverged",
                               unchecked_reason=reason, backward=1, step=1, notes=[], suggestions=[],
                               cause=SimpleNamespace(kind="state_mutation", tensor="blocks.0.tokens_seen"),
                               first_discrete_divergence=None)

    regions = [region(0, 0, "diverged"), region(1, 0, "unchecked", "reproduced; state it reads is updated twice"),
               region(1, 1, "clean")]
    report = SimpleNamespace(regions=regions, notes=[], verdict="diverged", headline="h", torch_errors=[],
                             watch=None, crashed=False)
    steps = [StepComparison(step=0, loss_identical=True, loss_rel_diff=None, parameters=2, identical=0, rank=rank,
                            differing=[ParamDiff("blocks.0.w", "differs", rel, region="blocks.0")])
             for rank, rel in ((0, 0.25), (1, 0.03))]  # (each rank its own shard: other figures)
    attach(report, ReferenceResult("no-ac", DIFFERS, "gradients differ", 1, steps=steps))
    assert [r.status for r in regions] == ["diverged", "unchecked", "clean"], [r.status for r in regions]
    assert any("reduced across ranks" in n for n in regions[1].notes), regions[1].notes


def test_the_ranks_table_follows_the_regions_the_comparison_settles():
    """32c: two nodes, a call counter on ranks 2-3 only; the comparison with the run without AC turned their regions
    whose code reads it (held unchecked) into diverged ones: the report read SILENTLY DIVERGED over a ranks table of
    `clean 0 of 6` on every rank and "cross-rank: clean: ranks 0-3"."""
    from ac_diff.diagnosis.ranks import cross_rank_findings, rank_summaries
    from ac_diff.reference.explain import attach
    from ac_diff.reference.result import ReferenceResult
    from ac_diff.report import STATE_READ_AGAIN, Cause, Report, RegionReport

    def region(rank, n, status, reason=None):
        return RegionReport(rank=rank, region=n, module="blocks.0", kind="checkpoint", status=status, silent=False,
                            cause=Cause("state_mutation", "blocks.0.calls", "read again") if reason else None,
                            first_value_divergence=None, first_discrete_divergence=None, first_shape_divergence=None,
                            first_control_divergence=None, positions=[], suggestions=[], chain=[],
                            unchecked_reason=reason, step=n + 1, backward=n + 1)

    regions = [region(rank, n, "clean") for rank in (0, 1) for n in range(2)] + [
        region(1, 2, "unchecked", STATE_READ_AGAIN)]
    report = Report(verdict="unchecked", headline="gradients at risk", regions=regions)
    report.ranks = rank_summaries(report)
    report.cross_rank_findings = cross_rank_findings([], report).findings
    assert [s.verdict for s in report.ranks] == ["clean", "unchecked"]  # (at risk: never clean)
    steps = [StepComparison(step=s, loss_identical=s < 2, loss_rel_diff=None, parameters=2, identical=2, rank=rank,
                            differing=[ParamDiff("blocks.0.w", "differs", 0.1, region="blocks.0")]
                            if rank == 1 and s == 2 else [])
             for rank in (0, 1) for s in range(3)]
    attach(report, ReferenceResult("no-ac", DIFFERS, "gradients differ", 3, steps=steps))
    assert regions[-1].status == "diverged"  # (the comparison's own doing)
    assert [(s.verdict, s.diverged, s.clean, s.unchecked) for s in report.ranks] == [
        ("clean", 0, 2, 0), ("diverged", 1, 2, 0)], report.ranks
    assert report.ranks[1].first_region == 2 and report.ranks[1].cause == "state_mutation"
    assert report.cross_rank[0].startswith("diverged: rank 1 (1 of 2 ranks); clean: rank 0"), report.cross_rank


def test_fix_calls_a_try_unverified_where_the_run_without_ac_finished_no_backward(tmp_path):
    """28e: truncated BPTT whose hidden state is updated in place: without AC autograd raises (an in-place error AC
    hides), so the run without AC finishes no backward. The restore that makes every recompute match was "did not
    help"; it is unverified, and says why (the gradients have nothing to be compared with)."""
    from ac_diff.fix.result import UNVERIFIED, Try
    from ac_diff.fix.tries import Measured, judge
    from ac_diff.report import Report, RegionReport

    region = RegionReport(rank=0, region=0, module="block", kind="checkpoint", status="clean", silent=False,
                          cause=None, first_value_divergence=None, first_discrete_divergence=None,
                          first_shape_divergence=None, first_control_divergence=None, positions=[], suggestions=[],
                          chain=[])
    ok = Measured(1.0, 0, tmp_path / "log")
    tried = Try("restore the forward's block.h in the recompute", [], "state_mutation")
    judge(tried, Report(verdict="clean", headline="", regions=[region]), SimpleNamespace(steps=[], defect=True), ok,
          ok, None)
    assert tried.status == UNVERIFIED and "finished no backward" in tried.reason, (tried.status, tried.reason)
