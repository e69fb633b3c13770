"""reference/explain.py on given gradient comparisons: what a later loss that differs means, and a backward that
left no gradient to compare (no runs needed: the e2e cases are in test_reference.py)."""

from __future__ import annotations

from types import SimpleNamespace

from ac_diff.reference.explain import explain
from ac_diff.reference.result import DIFFERS, FAILED, IDENTICAL, StepComparison


def _steps(second_loss_identical: bool, no_grad: int = 0) -> list[StepComparison]:
    return [StepComparison(step=0, loss_identical=True, loss_rel_diff=None, parameters=4, identical=4, no_grad=no_grad),
            StepComparison(step=1, loss_identical=second_loss_identical, loss_rel_diff=1e-4, parameters=4,
                           identical=4, no_grad=no_grad)]


def _report(side_effects=(), rng=False, cause=None):
    region = SimpleNamespace(side_effects=list(side_effects), state_changes={"rng": {}} if rng else {},
                             cause=SimpleNamespace(kind=cause) if cause else None, status="clean", rank=0, module="l0")
    return SimpleNamespace(regions=[region])


def test_a_later_loss_after_identical_gradients_is_the_repeated_update_when_there_is_one():
    effect = "l0.center is updated in place by aten.mul_.Tensor in l0 (x.py:3) inside the region, so ... (counted twice)"
    result = explain(_steps(False), [], _report([effect]), steps_requested=2)
    assert result.verdict == DIFFERS and result.explanations[0].kind == "repeated_update"
    assert "l0.center" in result.explanations[0].text and "repeated update" in result.headline


def test_random_draws_excuse_a_later_loss_only_with_evidence_of_draws():
    drew = explain(_steps(False), [], _report(rng=True), steps_requested=2)
    assert drew.verdict == IDENTICAL and [e.kind for e in drew.explanations] == ["rng_draws"]
    unexplained = explain(_steps(False), [], _report(), steps_requested=2)
    assert unexplained.verdict == DIFFERS and unexplained.explanations[0].kind == "state_drift"
    same = explain(_steps(True), [], _report(), steps_requested=2)
    assert same.verdict == IDENTICAL and not same.explanations


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
                                                                      for e in effects])
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
