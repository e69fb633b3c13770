"""`ac-diff compare TRACE_A TRACE_B`: two runs (or two ranks) aligned region by region, op by op."""

from __future__ import annotations

import json
import sys

import pytest

from conftest import EXAMPLES
from factories import ext, meta, op, ref

from ac_diff.diagnosis.two_runs import compare_runs
from ac_diff.passes import Pass, Region, Run
from ac_diff.trace import read_run

sys.path.insert(0, str(EXAMPLES))


# -- real traces: the tiny MoE trained twice the same way, and once with another learning rate -----------
@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    import ac_diff
    import tiny_moe

    out = tmp_path_factory.mktemp("two_runs")
    paths = {}
    for name, kwargs in (("a", {}), ("b", {}), ("lr", {"lr": 1e-2})):
        for write in ("all", "diverged"):  # every region's ops; the default: later clean regions summarized
            paths[name, write] = out / write / name / "trace-rank0.jsonl"
            with ac_diff.record(paths[name, write], write=write):
                tiny_moe.train(steps=2, seq_len=32, log=lambda s: None, **kwargs)
        paths[name] = paths[name, "all"]
    return paths


def _compare_cli(a, b, tmp_path):
    from ac_diff.cli import main

    json_path = tmp_path / "compare.json"
    code = main(["compare", str(a), str(b), "--json", str(json_path), "--format", "json", "-o", str(tmp_path / "r")])
    return code, json.loads(json_path.read_text())


def test_same_script_twice_is_the_same(traces, tmp_path):
    code, report = _compare_cli(traces["a"], traces["b"], tmp_path)
    assert code == 0
    assert report["verdict"] == "clean"
    assert report["headline"].startswith("same: all 4 region(s)")
    assert [r["status"] for r in report["regions"]] == ["clean"] * 4
    assert all(r["kind"] == "two_runs" for r in report["regions"])
    assert report["compared"]["columns"] == ["run A", "run B"]
    assert report["compared"]["regions_compared"] == 4


def test_a_trace_cut_short_compared_with_the_whole_run_is_not_all_compared(traces, tmp_path):
    """28f: a copy of run A's trace cut to its first half (the process killed) against run B's whole trace: the regions
    B ran after A's trace ends were "ran in run B only" (control flow), RUNS DIFFER, exit 1. They were never compared:
    NOT ALL COMPARED, exit 4, and the regions both traces hold still match."""
    data = traces["a"].read_bytes()
    cut = tmp_path / "cut" / "trace-rank0.jsonl"
    cut.parent.mkdir()
    cut.write_bytes(data[:len(data) // 2])
    code, report = _compare_cli(cut, traces["b"], tmp_path)
    assert code == 4 and report["verdict"] == "unchecked", report["headline"]
    statuses = [r["status"] for r in report["regions"]]
    assert "diverged" not in statuses and "clean" in statuses and statuses[-1] == "unchecked", statuses
    assert report["compared"]["only_b"] == []


def test_other_learning_rate_first_divergent_op(traces, tmp_path):
    code, report = _compare_cli(traces["a"], traces["lr"], tmp_path)
    assert code == 1
    assert report["verdict"] == "diverged"
    status = [(r["region"], r["module"], r["status"]) for r in report["regions"]]
    # step 0 (regions 0, 1) reads the same initial weights; step 1 reads weights updated with another lr
    assert status == [(0, "layers.0", "clean"), (1, "layers.1", "clean"),
                      (2, "layers.0", "diverged"), (3, "layers.1", "diverged")]
    first = report["regions"][2]
    value = first["first_value_divergence"]
    assert value["forward_index"] == value["recompute_index"] == 0  # the region's very first op, in A and in B
    assert value["module"] == "layers.0.attention_norm" and value["source"].split(" in ")[0].endswith("tiny_moe.py:172")
    assert first["cause"]["kind"] == "different_inputs"
    changed = {c["name"] for c in first["changed_inputs"]}
    assert "layers.0.attention.wq.weight" in changed and "input[0]" in changed
    assert first["cause"]["tensor"].startswith("layers.0.")
    assert report["compared"]["first"]["region"] == 2
    # the router decision that flips follows from it
    assert first["first_discrete_divergence"]["op"] == "aten.topk.default"
    assert first["window"] and first["window"][0]["forward_index"] == 0


def test_summarized_regions_are_compared_by_their_values_digest(traces, tmp_path):
    """The default trace writes the first region of each module in full and summarizes later clean ones: those
    are compared by the digest of every value they measured; a difference is found, with no op to name."""
    code, report = _compare_cli(traces["a", "diverged"], traces["b", "diverged"], tmp_path)
    assert code == 0 and report["verdict"] == "clean"
    assert [r["status"] for r in report["regions"]] == ["clean"] * 4
    assert all("digests" in " ".join(r["notes"]) for r in report["regions"][2:])
    code, report = _compare_cli(traces["a", "diverged"], traces["lr", "diverged"], tmp_path)
    assert code == 1
    assert [r["status"] for r in report["regions"]] == ["clean", "clean", "diverged", "diverged"]
    assert report["regions"][2]["first_value_divergence"] is None and "--write all" in report["headline"]
    code, report = _compare_cli(traces["a", "all"], traces["b", "diverged"], tmp_path)
    assert [r["status"] for r in report["regions"]] == ["clean", "clean", "unchecked", "unchecked"]
    assert "run B kept only a summary" in report["regions"][2]["notes"][-1]
    assert code == 4 and report["verdict"] == "unchecked" and report["title"] == "NOT ALL COMPARED"  # not a match


def test_terminal_labels_run_a_and_b(traces, tmp_path):
    from rich.console import Console

    from ac_diff.diagnosis import Settings
    from ac_diff.render.terminal import render_terminal

    report = compare_runs(read_run(traces["a"]), read_run(traces["lr"]), Settings())
    console = Console(width=120, record=True, color_system=None)
    render_terminal(report, console)
    text = console.export_text()
    assert "RUNS DIFFER" in text and "run A | run B, aligned" in text and "A #0 / B #0" in text
    assert "forward | recompute" not in text
    # two runs that part say nothing of either one's gradients (31e: "the gradients ... are silently wrong")
    assert "silently wrong" not in " ".join(text.split())
    assert "not whether either run's gradients are wrong" in report.silent_warning, report.silent_warning


# -- factory-built runs --------------------------------------------------------------------------------
def _run(path: str, regions: list[Region], rank: int = 0) -> Run:
    return Run(source="trace", path=path, rank=rank, argv=["train.py"], regions=regions,
               exit_status="ok")


def _region(number: int, module: str, ops, externals=(), rank: int = 0, recompute=None) -> Region:
    return Region(rank=rank, region=number, module=module, forward=Pass("forward", list(ops), externals=list(externals)),
                  recompute=recompute)


def _ops(values):
    """mm(param) -> topk -> add, with the given fingerprints of the three outputs."""
    return [op(0, "aten.mm.default", refs=[ref_param()], fp=[values[0]]),
            op(1, "aten.topk.default", refs=[ref(0)], fp=[values[1], [5, 9]], out=[meta(4, 2), meta(4, 2, dtype="i64")]),
            op(2, "aten.add.Tensor", refs=[ref(1)], fp=[values[2]])]


def ref_param():
    from ac_diff.passes import InputRef

    return InputRef("param", name="w")


def test_nondeterministic_op_between_runs():
    same_w = [ext("param", "w", [1.0, 2.0])]
    a = _run("a", [_region(0, "layers.0", _ops([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]), same_w)])
    b = _run("b", [_region(0, "layers.0", _ops([[1.0, 1.0], [2.5, 2.5], [3.5, 3.5]]), same_w)])
    report = compare_runs(a, b)
    r = report.regions[0]
    assert report.verdict == "diverged" and r.status == "diverged"
    assert r.first_value_divergence.op == "aten.topk.default"
    assert r.first_value_divergence.detail["inputs_identical"] is True
    assert r.cause.kind == "nondeterministic_op"
    assert "run_a" in r.first_value_divergence.detail and "forward" not in r.first_value_divergence.detail


def test_unmatched_regions_and_recompute_only_difference():
    w = [ext("param", "w", [1.0, 2.0])]
    fwd = _ops([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]])
    rec_a = Pass("recompute", _ops([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]), externals=list(w))
    rec_b = Pass("recompute", _ops([[1.0, 1.0], [2.0, 2.0], [9.0, 9.0]]), externals=list(w))
    a = _run("a", [_region(0, "layers.0", fwd, w, recompute=rec_a)])
    b = _run("b", [_region(0, "layers.0", fwd, w, recompute=rec_b), _region(1, "layers.1", fwd, w)])
    report = compare_runs(a, b)
    assert [(r.region, r.module, r.status) for r in report.regions] == [(0, "layers.0", "diverged"),
                                                                     (1, "layers.1", "diverged")]
    first, extra = report.regions
    assert first.first_value_divergence.op == "aten.add.Tensor"
    assert first.first_value_divergence.detail["phase"] == "recompute"
    assert any("RECOMPUTES differ" in n for n in first.notes)
    assert extra.cause.kind == "control_flow" and "run B only" in extra.cause.detail
    assert report.compared["only_b"] == [1] and report.compared["only_a"] == []


def test_a_region_one_run_summarized_and_the_other_diverged_in_differs(tmp_path):
    """Both runs with the default write="diverged": run A's third region reproduced (a summary), run B's did not
    (a buffer changed between its forward and backward: written in full). The runs differ there, not "unchecked";
    and a region neither side could compare never lets the verdict read clean."""
    import torch
    import torch.utils.checkpoint as cp
    from models import Scaled

    import ac_diff

    paths = {}
    for name, bad_step in (("a", None), ("b", 2)):
        torch.manual_seed(0)
        model, paths[name] = Scaled(), tmp_path / name / "trace-rank0.jsonl"
        with ac_diff.record(paths[name]):
            for step in range(3):
                y = cp.checkpoint(model, torch.randn(4, 8), use_reentrant=False)
                if step == bad_step:
                    with torch.no_grad():
                        model.scale.mul_(1.5)  # between the forward and the backward
                y.sum().backward()
    code, report = _compare_cli(paths["a"], paths["b"], tmp_path)
    assert code == 1 and report["title"] == "RUNS DIFFER", report["headline"]
    region = report["regions"][2]
    assert region["status"] == "diverged" and region["cause"]["kind"] == "state_mutation", region
    assert "in run B this region's recompute did not reproduce its forward" in region["cause"]["detail"]
    code, report = _compare_cli(paths["a"], paths["a"], tmp_path)
    assert code == 0 and report["title"] == "RUNS MATCH"
    # run A's own regions diverged: matching each other, they are counted as matching, not as clean
    from ac_diff.cli import main

    assert main(["compare", str(paths["a"]), str(paths["a"]), "-o", str(tmp_path / "r.txt")]) == 0
    text = (tmp_path / "r.txt").read_text()
    assert f"{len(report['regions'])} region(s): {len(report['regions'])} match" in text and " clean" not in text
    assert [r["status"] for r in report["regions"]] == ["clean"] * len(report["regions"])  # (the JSON's word)


def test_two_runs_that_checkpoint_with_other_rng_options_say_so(tmp_path):
    """The same dropout block, checkpointed with preserve_rng_state=True in run A and False in run B: the recompute
    of B draws other masks. It said "another seed?" and "seed both runs alike", though both traces hold the option."""
    import torch
    import torch.utils.checkpoint as cp

    import ac_diff

    paths = []
    for preserve in (True, False):
        torch.manual_seed(0)
        block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5), torch.nn.Tanh())
        paths.append(tmp_path / f"{preserve}.jsonl")
        with ac_diff.record(paths[-1], write="all"):
            x = torch.randn(4, 8, requires_grad=True)
            cp.checkpoint(block, x, use_reentrant=False, preserve_rng_state=preserve).sum().backward()
    report = compare_runs(read_run(paths[0]), read_run(paths[1]))
    (region,) = report.regions
    assert region.status == "diverged" and region.cause.kind == "rng", region.cause
    assert "preserve_rng_state=True in run A and False in run B" in region.cause.detail, region.cause.detail
    assert "another seed" not in region.cause.detail
    assert "preserve_rng_state=True in run A, False in run B" in " ".join(region.notes)
    assert region.suggestions[0].title == "Checkpoint with preserve_rng_state=True (torch's default)"


def test_a_watched_run_compared_with_a_full_run_pairs_regions_by_step(tmp_path):
    """One training recorded in full and watched: the watched trace writes its first step and the step that diverged
    (and the steps recorded in full after it) only. Regions pair by step, the watched ones are not comparable, and
    the regions watch counted without writing are not "ran in run A only" (the trace's 4th region, of step 6, was
    compared with run A's of step 3: the runs "differed from region 4")."""
    import torch
    import torch.utils.checkpoint as cp
    from models import Scaled

    import ac_diff

    paths = {}
    for name, watch in (("full", False), ("watch", True)):
        torch.manual_seed(0)
        model, paths[name] = Scaled(), tmp_path / name / "trace-rank0.jsonl"
        with ac_diff.record(paths[name], watch=watch):
            for step in range(8):
                y = cp.checkpoint(model, torch.randn(4, 8), use_reentrant=False)
                if step == 3:
                    with torch.no_grad():
                        model.scale.mul_(1.5)  # between the forward and the backward
                y.sum().backward()
    code, report = _compare_cli(paths["full"], paths["watch"], tmp_path)
    statuses = [(r["region"], r["status"]) for r in report["regions"]]
    assert report["verdict"] != "diverged" and "diverged" not in {s for _, s in statuses}, statuses
    assert statuses[0] == (0, "clean") and all(s == "clean" for region, s in statuses if region > 4), statuses
    assert not any("only" in " ".join(r["notes"]) and "watched" not in " ".join(r["notes"]) for r in report["regions"])


def test_a_watched_run_compared_with_another_is_not_said_to_match(traces, tmp_path):
    """A watched run's trace holds op lists of its first step only (the rest compared as they ran, counted): two such
    runs "matched" over those few regions (RUNS MATCH, exit 0, a CI gate passed). Not all compared: exit 4."""
    import ac_diff
    import tiny_moe

    paths = []
    for name in ("a", "b"):
        paths.append(tmp_path / name / "trace-rank0.jsonl")
        with ac_diff.record(paths[-1], watch=True):
            tiny_moe.train(steps=3, seq_len=32, log=lambda s: None)
    code, report = _compare_cli(*paths, tmp_path)
    assert (code, report["title"]) == (4, "NOT ALL COMPARED"), report["headline"]
    assert "not all compared" in report["headline"]
    code, report = _compare_cli(traces["a"], traces["b"], tmp_path)
    assert (code, report["title"]) == (0, "RUNS MATCH")  # (recorded in full: every region compared)
