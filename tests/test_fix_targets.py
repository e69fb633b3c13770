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
    report = SimpleNamespace(regions=[SimpleNamespace(module="layers.0", suggestions=suggestions)], reference=None,
                             diverged=True)
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
