"""Custom training loops with gradient accumulation (`tests/stacks/grad_accum.py`) and
PyTorch Lightning (`tests/stacks/lightning_moe.py`): each region's recompute is matched to its own forward
when several micro-batches run forward before their backward, and a divergence is attributed to the
micro-batch whose regions really diverged.

Regions are numbered in forward order: micro-batch k (1-based) of a 2-layer model owns regions 2k-2
(layers.0) and 2k-1 (layers.1).
"""

from __future__ import annotations

import pytest

import ac_diff
from ac_diff.trace import iter_records
from stacks.runs import STACKS, Job, run_all

pytestmark = pytest.mark.e2e
SCRIPT = str(STACKS / "grad_accum.py")


def mb(k: int) -> set[int]:
    """The regions of micro-batch k."""
    return {2 * k - 2, 2 * k - 1}


def pass_order(trace_dir) -> list[tuple[str, int]]:
    """(phase, region) of every finished pass, in the order the process ran them (`--write all` writes each pass
    as it ends; the default holds a forward until its recompute decides what is written)."""
    return [(r["phase"][0].upper(), r["region"]) for r in iter_records(trace_dir / "trace-rank0.jsonl")
            if r.get("type") == "pass"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    write_all = ["--write", "all"]
    jobs = {
        "summed": Job([SCRIPT, "--schedule", "summed"], write_all),
        "summed_bias_after_2": Job([SCRIPT, "--schedule", "summed", "--update-bias-after", "2"]),
        "interleaved_bias_after_2": Job([SCRIPT, "--schedule", "interleaved", "--update-bias-after", "2"]),
        "pipelined": Job([SCRIPT, "--schedule", "pipelined"], write_all),
        "lightning_training_step": Job([str(STACKS / "lightning_moe.py"), "--bias-update", "training_step"],
                                       write_all),
    }
    return run_all(tmp_path_factory.mktemp("loops"), jobs)


def _by_region(report):
    return {g["region"]: g for g in report["regions"]}


def test_summed_micro_batches_each_recompute_matches_its_own_forward(runs):
    r = runs["summed"]
    assert r.returncode == 0, r.explain()
    report = r.report
    assert report["verdict"] == "clean", report["headline"]
    assert [g["module"] for g in report["regions"]] == ["layers.0", "layers.1"] * 3
    assert len({(g["forward_ops"], g["recompute_ops"]) for g in report["regions"]}) == 1
    # three forwards, then one backward recomputes them last-in first-out
    assert pass_order(r.trace_dir) == [("F", i) for i in range(6)] + [("R", i) for i in (5, 4, 3, 2, 1, 0)]

    # the values prove the pairing: a recompute reproduces its own forward, not another micro-batch's
    ops = ac_diff.load(r.trace_dir).ops
    first = {}
    for (region, phase), mine in ops[ops.fingerprint.notna()].groupby(["region", "phase"]):
        first[region, phase] = (mine.iloc[0]["index"], str(mine.iloc[0]["fingerprint"]))
    for region in range(6):
        assert first[region, "forward"] == first[region, "recompute"], region
    assert len({first[region, "forward"][1] for region in (0, 2, 4)}) == 3  # the micro-batches differ


def _diverged_by_the_bias_or_harmless(g: dict) -> None:
    """A region recomputed after the router bias changed: diverged because of it (a token was routed
    elsewhere), or clean because no choice flipped (topk's values changed, its saved indices did not)."""
    if g["status"] == "diverged":
        assert g["cause"]["kind"] == "state_mutation" and g["cause"]["tensor"] == f"{g['module']}.moe.expert_bias"
    else:
        assert g["status"] == "clean" and any("harmless for the gradients" in n for n in g["notes"]), g


def test_summed_divergence_is_attributed_to_the_micro_batches_that_diverged(runs):
    # F1 F2 [expert_bias updated] F3, one backward: mb3 saw the new bias in both passes (clean, and it is
    # recomputed first); mb2 and mb1 were forwarded before the update and recomputed after it.
    r = runs["summed_bias_after_2"]
    report = r.report
    assert report is not None and r.returncode == 1, r.explain()
    regions = _by_region(report)
    assert all(regions[i]["status"] == "clean" for i in mb(3))
    diverged = {i for i, g in regions.items() if g["status"] == "diverged"}
    assert diverged and diverged <= mb(1) | mb(2)
    for i in mb(1) | mb(2):
        if regions[i]["status"] != "unchecked":  # mb1's recompute may never come: torch raised in mb2's
            _diverged_by_the_bias_or_harmless(regions[i])
    assert report["torch_error"]["region"] in mb(1) | mb(2)


def test_interleaved_divergence_in_micro_batch_2_only(runs):
    # F1 B1 F2 [expert_bias updated] B2 (raises) -- mb3 never runs
    r = runs["interleaved_bias_after_2"]
    report = r.report
    assert report is not None and r.returncode == 1, r.explain()
    regions = _by_region(report)
    assert set(regions) == mb(1) | mb(2)
    assert all(regions[i]["status"] == "clean" for i in mb(1))
    for i in mb(2):  # a layer whose router flipped no token saved the same tensors: clean, with the note
        _diverged_by_the_bias_or_harmless(regions[i])
    assert report["torch_error"]["region"] in mb(2) and regions[report["torch_error"]["region"]]["status"] == "diverged"
    assert report["torch_error"]["region"] in mb(2)
    assert report["headline"].startswith(regions[report["torch_error"]["region"]]["module"])


def test_pipelined_schedule_matches_each_recompute(runs):
    r = runs["pipelined"]
    assert r.returncode == 0, r.explain()
    assert r.report["verdict"] == "clean", r.report["headline"]
    assert [g["status"] for g in r.report["regions"]] == ["clean"] * 6
    # F1 F2 B1 F3 B2 B3
    assert pass_order(r.trace_dir) == [("F", 0), ("F", 1), ("F", 2), ("F", 3), ("R", 1), ("R", 0),
                                       ("F", 4), ("F", 5), ("R", 3), ("R", 2), ("R", 5), ("R", 4)]


def test_lightning_accumulation_bias_update_in_training_step_is_state_mutation(runs):
    # Trainer(accumulate_grad_batches=3); the bias update at the end of training_step runs after each
    # micro-batch's forward and before Lightning's backward of it: every recompute sees a new bias.
    r = runs["lightning_training_step"]
    report = r.report
    assert report is not None and r.returncode == 1, r.explain()
    regions = _by_region(report)
    error_region = report["torch_error"]["region"]
    assert set(regions) == set(range(2 * (error_region // 2) + 2))  # whole micro-batches, up to the error
    recomputed = [g for g in regions.values() if g["status"] != "unchecked"]
    assert len(recomputed) >= 2
    for g in recomputed:
        _diverged_by_the_bias_or_harmless(g)
    assert regions[error_region]["status"] == "diverged"
    # Lightning runs each micro-batch's backward right after its forward: F1 B1 F2 B2 ...
    assert pass_order(r.trace_dir)[:6] == [("F", 0), ("F", 1), ("R", 1), ("R", 0), ("F", 2), ("F", 3)]
