"""Multi-rank runs: torchrun as the launcher, one trace per rank, the cross-rank report, collectives.

The end-to-end tests run 2 processes on CPU with the gloo backend:

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m ac_diff run -o OUT SCRIPT ...
    ac-diff run --nproc-per-node 2 -o OUT SCRIPT ...            (the same, launched by ac-diff)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import EXAMPLES, report_json, run_cli
from factories import ext, meta, op, ref

from ac_diff.commands import launch_cmd
from ac_diff.diagnosis import diagnose
from ac_diff.passes import InputRef, Pass, Region, Run
from ac_diff.report import CLEAN, DIVERGED, Cause, RegionReport, Report

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "AC_DIFF_RANK_WAIT": "60"}
ENV.pop(launch_cmd.RUN_ID_ENV, None)
ENV.pop(launch_cmd.LAUNCHED_ENV, None)


def torchrun(*args: str, cwd: Path, timeout: int = 240) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "ac_diff", "run", *args]
    return subprocess.run(cmd, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout)


def headers(out: Path) -> dict[int, dict]:
    found = {}
    for path in sorted(out.glob("trace-rank*.jsonl")):
        header = json.loads(path.open().readline())
        found[header["rank"]] = header
    return found


def by_rank(report: dict) -> dict[int, dict]:
    return {r["rank"]: r for r in report["ranks"]}


def finding_kinds(report: dict) -> set[str]:
    return {f["kind"] for f in report["cross_rank_findings"]}


def _assert_rank1_bias_update(report: dict) -> None:
    ranks = by_rank(report)
    assert report["verdict"] == DIVERGED
    assert ranks[0]["verdict"] == CLEAN and ranks[0]["diverged"] == 0 and ranks[0]["clean"] == 2
    one = ranks[1]
    assert one["verdict"] == DIVERGED
    assert one["cause"] == "state_mutation" and one["cause_tensor"] == "layers.1.moe.expert_bias"
    assert one["first_module"] == "layers.1" and one["first_region"] == 1
    assert one["first_op_module"] == "layers.1.moe.router"
    assert one["torch_error"].startswith("metadata_mismatch")
    assert {(r["rank"], r["region"], r["module"], r["status"]) for r in report["regions"]} == {
        (0, 0, "layers.0", CLEAN), (0, 1, "layers.1", CLEAN),
        (1, 0, "layers.0", "unchecked"), (1, 1, "layers.1", DIVERGED)}  # the CheckpointError stopped rank 1's backward
    first = next(f for f in report["cross_rank_findings"] if f["kind"] == "first")
    assert first["ranks"] == [1] and first["region"] == 1 and first["module"] == "layers.1"
    local = next(f for f in report["cross_rank_findings"] if f["kind"] == "rank_local")
    assert local["ranks"] == [1] and local["detail"]["clean_ranks"] == [0]
    overview = next(f for f in report["cross_rank_findings"] if f["kind"] == "ranks")
    assert overview["text"] == "diverged: rank 1 (1 of 2 ranks); clean: rank 0"
    exits = next(f for f in report["cross_rank_findings"] if f["kind"] == "exits")
    assert exits["detail"]["failed_in_order"][0] == 1  # rank 1 failed first; rank 0 only lost its peer
    assert not finding_kinds(report) & {"replicated_disagreement", "replicated_rng", "mixed_runs"}


# -- end to end -------------------------------------------------------------------------------------
@pytest.mark.e2e
def test_torchrun_only_rank1_mutates_state(tmp_path):
    """torchrun directly: rank 1 updates its router bias between forward and recompute, rank 0 does not."""
    out = tmp_path / "out"
    proc = torchrun("-o", str(out), str(EXAMPLES / "distributed_bias_update.py"), cwd=tmp_path)
    assert proc.returncode != 0, proc.stderr[-3000:]  # rank 1 raised CheckpointError
    assert "CheckpointError" in proc.stderr
    hs = headers(out)
    assert sorted(hs) == [0, 1] and {h["world_size"] for h in hs.values()} == {2}
    assert hs[0]["run_id"] and hs[0]["run_id"] == hs[1]["run_id"]  # one launch
    assert hs[0]["launcher"] == "torchrun"
    from ac_diff import diagnose_paths

    _assert_rank1_bias_update(diagnose_paths([out]).to_json())
    # the failing rank names its trace and the command to run, since torchrun now stops rank 0
    assert f"ac-diff report {out}" in proc.stderr


@pytest.mark.e2e
def test_launcher_reports_across_ranks(tmp_path):
    """`ac-diff run --nproc-per-node 2` hands off to torchrun and reports once torchrun is done."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "trace-rank3.jsonl").write_text('{"type":"header","format":"ac-diff-trace","version":"1.0","rank":3}\n')
    from ac_diff.cli import main

    refused = main(["run", "--nproc-per-node", "2", "-o", str(out), str(EXAMPLES / "distributed_bias_update.py")])
    assert refused == 2 and (out / "trace-rank3.jsonl").exists()  # refused without --force: nothing launched
    json_path = tmp_path / "report.json"
    proc = run_cli("run", "--nproc-per-node", "2", "--force", "-o", str(out), "--json", str(json_path),
                   str(EXAMPLES / "distributed_bias_update.py"), cwd=tmp_path, timeout=240)
    assert proc.returncode == 1, proc.stderr[-3000:]  # the script's exit code (rank 1's CheckpointError)
    assert "launching 2 processes with torchrun" in proc.stderr
    assert not (out / "trace-rank3.jsonl").exists()  # --force cleared the stale trace of an earlier, bigger run
    hs = headers(out)
    assert sorted(hs) == [0, 1] and hs[0]["launcher"] == "ac-diff" and hs[0]["run_id"] == hs[1]["run_id"]
    report = report_json(json_path)
    _assert_rank1_bias_update(report)
    assert proc.stdout.count("ac-diff: DIVERGED") == 1  # one report, from the launcher
    assert "cross-rank: rank-local: region 1 (layers.1) diverged on rank 1 only" in proc.stdout.replace("\n", " ")


@pytest.mark.e2e
def test_a_rank_that_diverged_through_an_all_reduce_takes_the_cause_of_the_rank_it_came_from(tmp_path):
    """Tensor-parallel blocks all-reduce their partial sums inside the region; rank 1's warmup raises its blocks'
    `gain` between the forward and the backward. Rank 0 changed nothing: its recompute received rank 1's other
    partial sums through the all_reduce (written in place, not measured). Rank 0's cause was "nondeterministic_op:
    aten.add.Tensor returned other values from identical inputs", with use_deterministic_algorithms as the fix."""
    out, json_path = tmp_path / "out", tmp_path / "report.json"
    stack = Path(__file__).parent / "stacks" / "tp_rank_gain.py"
    proc = torchrun("-o", str(out), "--json", str(json_path), str(stack), "--warm-rank", "1", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    regions = [r for r in report_json(json_path)["regions"] if r["status"] == DIVERGED]
    assert {r["rank"] for r in regions} == {0, 1}
    assert not [r for r in regions if r["cause"]["kind"] != "state_mutation"], [r["cause"] for r in regions]
    received = [r for r in regions if r["rank"] == 0]
    assert all(r["cause"]["detail"].startswith("through c10d.allreduce_.default, from rank 1, whose region")
               and "`blocks." in r["cause"]["detail"] and ".gain`" in r["cause"]["detail"] for r in received)
    assert not any("use_deterministic_algorithms" in (s["code"] or "") for r in received for s in r["suggestions"])
    # (the evidence rank 1's region gave is labelled as rank 1's: rank 0's own values stayed as they were, 25b)
    evidence = received[0]["cause"]["evidence"]
    assert any(e.startswith("rank 1: blocks.") and ".gain: 1.0 in the forward" in e for e in evidence), evidence
    assert not any(e.startswith("blocks.") for e in evidence), evidence


@pytest.mark.e2e
def test_tensor_parallel_dtensor_replicated_router_disagrees(tmp_path):
    """DTensor tensor parallelism with checkpointed blocks; per-rank seeds make the replicated router's
    jitter differ: activation checkpointing is clean on every rank, the ranks disagree with each other."""
    out = tmp_path / "out"
    json_path = tmp_path / "report.json"
    proc = torchrun("-o", str(out), "--json", str(json_path), str(EXAMPLES / "distributed_tp.py"),
                    "--jitter", "0.01", "--per-rank-seed", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = report_json(json_path)  # written by rank 0 after it waited for rank 1's trace
    assert report["verdict"] == CLEAN
    assert [(r["rank"], r["verdict"], r["regions"]) for r in report["ranks"]] == [(0, CLEAN, 4), (1, CLEAN, 4)]
    rng = [f for f in report["cross_rank_findings"] if f["kind"] == "replicated_rng"]
    assert rng and rng[0]["region"] == 0 and rng[0]["ranks"] == [0, 1]
    assert rng[0]["op"] == "aten.uniform_.default" and rng[0]["op_module"] == "layers.0.moe.router"
    assert "distributed_tp.py" in rng[0]["source"]
    assert not [f for f in report["cross_rank_findings"] if f["kind"] == "replicated_disagreement"]
    drift = next(f for f in report["cross_rank_findings"] if f["kind"] == "replicated_state")
    assert "layers.0.moe.router.gate.weight" in drift["detail"]["tensors"]
    assert "layers.0.attention.wq.weight" not in drift["detail"]["tensors"]  # sharded: differs by design
    # the row-wise parallel projection runs an all_reduce inside every checkpointed block
    import ac_diff

    ops = ac_diff.load(out).ops
    reduce = ops[ops.op == "_c10d_functional.all_reduce.default"]
    assert set(reduce["rank"]) == {0, 1} and set(reduce["phase"]) == {"forward", "recompute"}
    assert proc.stderr.count("ac-diff: 2 traces written") == 1  # only rank 0 reports


COLLECTIVES = '''
import torch, torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.utils.checkpoint import checkpoint

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
lin = torch.nn.Linear(4, 4)
IN_SPLITS = [[1, 2], [3, 2]][rank]     # rows this rank sends to rank 0, rank 1
OUT_SPLITS = [[1, 3], [2, 2]][rank]    # rows it receives from rank 0, rank 1

def block(x):
    y = lin(x)
    g = funcol.all_gather_tensor(y, 0, dist.group.WORLD)
    rows = g.reshape(-1)[: sum(IN_SPLITS)].reshape(-1, 1).expand(-1, 4).contiguous()
    a2a = funcol.all_to_all_single(rows, OUT_SPLITS, IN_SPLITS, dist.group.WORLD)
    r = funcol.reduce_scatter_tensor(a2a, "sum", 0, dist.group.WORLD)
    return (r * r).sum() + (g * g).sum()

x = torch.randn(2, 4, requires_grad=True)
with torch.utils.checkpoint.set_checkpoint_early_stop(False):   # the recompute runs every collective again
    checkpoint(block, x, use_reentrant=False).backward()
dist.barrier()  # no rank tears gloo down while another still talks to it (a rare abort at exit otherwise)
dist.destroy_process_group()
'''


@pytest.mark.e2e
def test_collectives_recorded_with_split_sizes(tmp_path):
    script = tmp_path / "collectives.py"
    script.write_text(textwrap.dedent(COLLECTIVES))
    out = tmp_path / "out"
    json_path = tmp_path / "report.json"
    proc = torchrun("-o", str(out), "--json", str(json_path), str(script), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import ac_diff

    ops = ac_diff.load(out).ops
    for rank, ins, outs in ((0, [1, 2], [1, 3]), (1, [3, 2], [2, 2])):
        mine = ops[ops["rank"] == rank]
        for phase in ("forward", "recompute"):
            seq = mine[(mine.phase == phase) & mine.op.str.startswith("_c10d_functional.")]
            names = [n for n in seq.op if "_wrap_tensor_autograd" not in n]
            assert names == ["_c10d_functional.all_gather_into_tensor.default",
                             "_c10d_functional.all_to_all_single.default",
                             "_c10d_functional.reduce_scatter_tensor.default"], (rank, phase, names)
            a2a = seq[seq.op == "_c10d_functional.all_to_all_single.default"].iloc[0]
            assert a2a.args[1:3] == [outs, ins]  # output and input split sizes, as lists
            assert a2a.out_shapes == [[sum(outs), 4]]
            gathered = seq[seq.op == "_c10d_functional.all_gather_into_tensor.default"].iloc[0]
            assert gathered.args[1] == 2 and gathered.fingerprint is None  # in flight: no fingerprint of garbage
            waited = seq[seq.op == "_c10d_functional._wrap_tensor_autograd.default"].iloc[0]
            assert waited.fingerprint is not None  # the result, once it arrived
    report = report_json(json_path)
    assert report["verdict"] == CLEAN, report["headline"]  # replaying the collectives reproduced every value
    assert [r["status"] for r in report["regions"]] == [CLEAN, CLEAN]
    assert not finding_kinds(report) & {"replicated_disagreement", "replicated_rng"}  # rank-dependent splits


# -- the launcher's pieces -------------------------------------------------------------------------
def test_rank_argv():
    from ac_diff.capture.recorder import RecordOptions

    argv = launch_cmd.rank_argv("pkg.train", ["--lr", "1"], module=True, output_dir="out",
                                options=RecordOptions(max_regions=3, fingerprints=False, write="diverged"))
    assert argv == ["run", "-o", "out", "--keep-values", "16384", "--scope", "regions", "--write", "diverged",
                    "--max-regions", "3",
                    "--no-fingerprints", "-m", "pkg.train", "--lr", "1"]


def _trace(path: Path, rank: int, run_id, *, end: bool = True, start: float = 100.0) -> Path:
    lines = [{"type": "header", "format": "ac-diff-trace", "version": "1.0", "rank": rank, "world_size": 2,
              "run_id": run_id, "start_time": start, "pid": 1, "host": "elsewhere"}]
    if end:
        lines.append({"type": "end", "status": "ok", "exit_code": 0})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_collect_traces_of_one_launch(tmp_path):
    _trace(tmp_path / "trace-rank0.jsonl", 0, "new")
    _trace(tmp_path / "trace-rank1.jsonl", 1, "old")  # an earlier run's, not yet overwritten
    _trace(tmp_path / "trace-rank2.jsonl", 2, "new")  # beyond the world size
    found = launch_cmd.collect_traces(tmp_path, "new", 2)
    assert sorted(found.paths) == [0] and found.missing == [1]
    assert sorted(p.name for p in found.stale) == ["trace-rank1.jsonl", "trace-rank2.jsonl"]
    _trace(tmp_path / "trace-rank1.jsonl", 1, "new", end=False)  # rank 1 started, still running
    found = launch_cmd.collect_traces(tmp_path, "new", 2)
    assert sorted(found.paths) == [0, 1] and found.ended == {0} and found.finished == {0}
    found = launch_cmd.wait_for_ranks(tmp_path, "new", 2, timeout=0.3)
    assert found.ended == {0}  # bounded: gives up
    # without a run id (torchrun's default rendezvous id), traces started after `since` count
    found = launch_cmd.collect_traces(tmp_path, None, 2, since=50.0)
    assert sorted(found.paths) == [0, 1]
    assert launch_cmd.collect_traces(tmp_path, None, 2, since=150.0).paths == {}


def test_script_exit_code_is_the_first_failing_rank():
    assert launch_cmd._script_exit_code({0: 143, 1: 3}, 1) == 3  # rank 0 was only stopped by torchrun
    assert launch_cmd._script_exit_code({0: 1, 1: 3}, 1, {0: 20.0, 1: 10.0}) == 3  # rank 1 failed first
    assert launch_cmd._script_exit_code({0: 0, 1: 0}, 0) == 0
    assert launch_cmd._script_exit_code({0: None, 1: None}, 1) == 1  # killed: torchrun's code


# -- the cross-rank report on factory-built runs ---------------------------------------------------------
def _pass(ops, externals) -> Pass:
    return Pass("forward", list(ops), externals=list(externals))


def _region_on(rank: int, ops, externals, number: int = 0, module: str = "layers.0") -> Region:
    return Region(rank=rank, region=number, module=module, forward=_pass(ops, externals))


def _router(score_fp, index_fp, *, k: int = 2, args=None):
    """gate mm (reads the replicated input) -> sigmoid -> topk (-> indices)."""
    return [
        op(0, "aten.mm.default", module="layers.0.moe.router.gate", refs=[InputRef("input", name="input[0]")],
           fp=[[1.0, 2.0]]),
        op(1, "aten.sigmoid.default", module="layers.0.moe.router", refs=[ref(0)], fp=[score_fp]),
        op(2, "aten.topk.default", module="layers.0.moe.router", refs=[ref(1)], args=args or ["$", k],
           fp=[[3.0, 3.0], index_fp], out=[meta(4, k), meta(4, k, dtype="i64")]),
    ]


def _runs(*per_rank) -> list[Run]:
    return [Run(source="trace", path=f"trace-rank{r}.jsonl", rank=r, world_size=len(per_rank), run_id="x",
                regions=[reg], exit_status="ok")
            for r, reg in enumerate(per_rank)]


def _findings(runs):
    report = diagnose(runs)
    return report, {f.kind: f for f in report.cross_rank_findings}


INPUT = [ext("input", "input[0]", [5.0, 6.0])]


def test_replicated_router_disagrees_across_ranks():
    runs = _runs(_region_on(0, _router([2.0, 2.0], [10, 30]), INPUT), _region_on(1, _router([2.0, 2.0], [11, 31]), INPUT))
    report, found = _findings(runs)
    hit = found["replicated_disagreement"]
    assert hit.op == "aten.topk.default" and hit.op_module == "layers.0.moe.router" and hit.ranks == [0, 1]
    assert "read identical inputs" in hit.text and "replicated computation disagrees" in hit.text


def test_no_disagreement_when_inputs_differ_or_arguments_differ():
    other_input = [ext("input", "input[0]", [7.0, 6.0])]  # data parallel: another batch
    _, found = _findings(_runs(_region_on(0, _router([2.0, 2.0], [10, 30]), INPUT),
                               _region_on(1, _router([2.0, 2.0], [11, 31]), other_input)))
    assert "replicated_disagreement" not in found
    # the ranks asked for different things (k): by design
    _, found = _findings(_runs(_region_on(0, _router([2.0, 2.0], [10, 30]), INPUT),
                               _region_on(1, _router([2.0, 2.0], [11, 31], k=3, args=["$", 3]), INPUT)))
    assert "replicated_disagreement" not in found


def test_a_matching_fingerprint_does_not_heal_a_difference():
    """The gate weight differs (a shard), so does the sigmoid; a copy whose (sum, abs-sum) happens to match
    follows, then topk differs: topk did not read identical inputs, the difference only hid from the
    fingerprint."""
    def ops(first, index_fp):
        base = _router(first, index_fp)
        base[0].input_refs.append(InputRef("param", name="gate.weight"))
        copy = op(2, "aten._to_copy.default", module="layers.0.moe.router", refs=[ref(1)], fp=[[2.0, 2.0]])
        topk = base[2]
        topk.index, topk.input_refs = 3, [ref(2)]
        return base[:2] + [copy, topk]

    def externals(w):
        return INPUT + [ext("param", "gate.weight", w, 1)]

    _, found = _findings(_runs(_region_on(0, ops([2.0, 2.0], [10, 30]), externals([1.0, 1.0])),
                               _region_on(1, ops([2.5, 2.5], [11, 31]), externals([1.5, 1.5]))))
    assert "replicated_disagreement" not in found


def test_rank_specific_collective_output_is_not_a_disagreement():
    def ops(received):
        return [op(0, "aten.mm.default", refs=[InputRef("input", name="input[0]")], fp=[[1.0, 2.0]]),
                op(1, "_c10d_functional.reduce_scatter_tensor.default", refs=[ref(0)], args=["$", "sum", 2, "0"]),
                op(2, "_c10d_functional._wrap_tensor_autograd.default", refs=[ref(1)], fp=[received]),
                op(3, "aten.relu.default", refs=[ref(2)], fp=[received])]

    _, found = _findings(_runs(_region_on(0, ops([1.0, 1.0]), INPUT), _region_on(1, ops([4.0, 4.0]), INPUT)))
    assert "replicated_disagreement" not in found


def test_a_compiled_graphs_call_reads_what_is_not_recorded():
    """A torch.compile'd function inside the region is one op that records no inputs: data-parallel ranks feed it
    other batches, so its outputs differ by design; "read identical inputs ... replicated computation disagrees"
    was reported on a clean control."""
    def ops(out_fp):
        return [op(0, "inductor_compiled_code", module="layers.0", fp=[out_fp]),
                op(1, "aten.relu.default", module="layers.0", refs=[ref(0)], fp=[out_fp])]

    _, found = _findings(_runs(_region_on(0, ops([1.0, 2.0]), INPUT), _region_on(1, ops([3.0, 4.0]), INPUT)))
    assert "replicated_disagreement" not in found


def test_symmetric_collective_result_is_shared():
    """All-reduce of different partial sums: the result is the same on every rank, so an op after it that
    reads it and disagrees is a real disagreement."""
    def ops(partial, after):  # a row-wise parallel matmul on each rank's shard, then its all-reduce
        return [op(0, "aten.mm.default", refs=[InputRef("input", name="input[0]"), InputRef("param", name="wo")],
                   fp=[partial]),
                op(1, "_c10d_functional.all_reduce.default", refs=[ref(0)], args=["$", "sum", "0"]),
                op(2, "_c10d_functional._wrap_tensor_autograd.default", refs=[ref(1)], fp=[[9.0, 9.0]]),
                op(3, "aten.sigmoid.default", refs=[ref(2)], fp=[after])]

    def shard(rank):
        return INPUT + [ext("param", "wo", [float(rank), 1.0], 1)]

    _, found = _findings(_runs(_region_on(0, ops([1.0, 1.0], [3.0, 3.0]), shard(0)),
                               _region_on(1, ops([8.0, 8.0], [3.0, 3.0]), shard(1))))
    assert "replicated_disagreement" not in found
    _, found = _findings(_runs(_region_on(0, ops([1.0, 1.0], [3.0, 3.0]), shard(0)),
                               _region_on(1, ops([8.0, 8.0], [3.5, 3.5]), shard(1))))
    assert found["replicated_disagreement"].op == "aten.sigmoid.default"


def test_replicated_state_drift_but_not_sharded_parameters():
    def region(rank, number, gate_fp, shard_fp):
        externals = [ext("input", "input[0]", [5.0, 6.0], 0), ext("param", "gate.weight", gate_fp, 1),
                     ext("param", "wq.weight", shard_fp, 2)]
        ops = [op(0, "aten.mm.default", refs=[InputRef("input", name="input[0]"), InputRef("param", name="gate.weight")],
                  fp=[[1.0, 1.0]]),
               op(1, "aten.mm.default", refs=[InputRef("input", name="input[0]"), InputRef("param", name="wq.weight")],
                  fp=[[float(rank), 1.0]])]
        return Region(rank=rank, region=number, module="layers.0", forward=_pass(ops, externals))

    runs = [Run(source="trace", path=f"r{r}", rank=r, run_id="x", exit_status="ok",
                regions=[region(r, 0, [1.0, 1.0], [float(r), 2.0]), region(r, 1, [1.0 + r, 1.0], [float(r), 2.0])])
            for r in (0, 1)]
    _, found = _findings(runs)
    drift = found["replicated_state"]
    assert drift.detail["tensors"] == ["gate.weight"]
    assert drift.detail["agreed_in_region"] == 0 and drift.detail["differs_in_region"] == 1


def _region_report(rank, number, status, cause=None, tensor=None) -> RegionReport:
    return RegionReport(rank=rank, region=number, module=f"layers.{number}", kind="checkpoint", status=status,
                        silent=False, cause=Cause(cause, tensor, "detail") if cause else None,
                        first_value_divergence=None, first_discrete_divergence=None, first_shape_divergence=None,
                        first_control_divergence=None, positions=[], suggestions=[], chain=[])


def test_a_logs_ranks_are_never_said_to_share_a_region_or_an_order():
    """35c P2-1: a debug=True log of four ranks, rank 1's dump and rank 2's both its region 0: it said "first divergence
    (earliest region in forward order): rank 1, region 0 ... (region 0 diverged on rank 2 too)", where rank 1 diverged
    in blocks.2 and rank 2 in blocks.0. A log's region is the dump's number on its rank: no order, no shared region."""
    from dataclasses import replace

    from ac_diff.diagnosis.ranks import cross_rank_findings, rank_summaries

    report = Report(verdict=DIVERGED, headline="", regions=[
        replace(_region_report(2, 0, DIVERGED, "unknown", "aten.nonzero.default"), kind="log"),
        replace(_region_report(1, 0, DIVERGED, "unknown", "aten.nonzero.default"), kind="log")])
    runs = [Run(source="log", path="ddp.log", rank=r, world_size=4) for r in (1, 2)]
    report.ranks = rank_summaries(report, runs)
    first = next(f for f in cross_rank_findings(runs, report).findings if f.kind == "first")
    assert first.ranks == [1] and "forward order:" not in first.text and "too)" not in first.text, first.text
    assert "no forward order across ranks" in first.text


def test_rank_summaries_first_divergence_and_mixed_runs():
    from ac_diff.diagnosis.ranks import cross_rank_findings, rank_summaries

    report = Report(verdict=DIVERGED, headline="", regions=[
        _region_report(0, 0, CLEAN), _region_report(0, 1, CLEAN),
        _region_report(1, 0, CLEAN), _region_report(1, 1, DIVERGED, "state_mutation", "layers.1.moe.expert_bias"),
        _region_report(2, 0, DIVERGED, "rng", "aten.native_dropout.default"), _region_report(2, 1, DIVERGED, "rng"),
    ])
    report.ranks = rank_summaries(report)  # no runs: the regions' ranks only
    assert [(s.rank, s.verdict, s.first_region, s.cause) for s in report.ranks] == [
        (0, CLEAN, None, None), (1, DIVERGED, 1, "state_mutation"), (2, DIVERGED, 0, "rng")]
    runs = [Run(source="trace", path=f"r{r}", rank=r, world_size=4, run_id=rid, exit_status="ok")
            for r, rid in ((0, "a"), (1, "a"), (2, "b"))]
    report.ranks = rank_summaries(report, runs)
    cross = cross_rank_findings(runs, report)
    report.cross_rank, report.cross_rank_findings, lines = cross.texts, cross.findings, cross.texts
    kinds = [f.kind for f in report.cross_rank_findings]
    assert "mixed_runs" in kinds and "missing_ranks" not in kinds  # mixed: the world size says nothing
    first = next(f for f in report.cross_rank_findings if f.kind == "first")
    assert first.ranks == [2] and first.region == 0  # earliest region in forward order wins over rank order
    assert any(line.startswith("diverged: ranks 1, 2 (2 of 3 ranks); clean: rank 0") for line in lines)
    assert any(f.kind == "same_cause" and "different causes" in f.text for f in report.cross_rank_findings)
    assert report.to_json()["cross_rank_findings"][0]["kind"] == "mixed_runs"
    # ranks of different runs say nothing together: no rank-local finding (a stranger's merged directory) ...
    assert not any(f.kind == "rank_local" for f in report.cross_rank_findings)
    runs = [Run(source="trace", path=f"r{r}", rank=r, world_size=3, run_id="a", exit_status="ok") for r in range(3)]
    report.ranks = rank_summaries(report, runs)  # ... where the ranks of one run do
    local = [f for f in cross_rank_findings(runs, report).findings if f.kind == "rank_local"]
    assert [(f.region, f.ranks, f.detail["clean_ranks"]) for f in local] == [(0, [2], [0, 1]), (1, [1, 2], [0])]


@pytest.mark.parametrize("preserve_rng_state", [True, False])
def test_fsdp2_hooks_inside_a_checkpointed_region_are_not_control_flow(tmp_path, monkeypatch, preserve_rng_state):
    """checkpoint() around fully_shard blocks: FSDP2 gathers the parameters inside the region in the forward
    (its pre-forward hook) but not in the recompute (backward gathered them). Those hook ops are not the
    region's control flow: clean, and a real divergence (dropout without its RNG state) is still found."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.fsdp import fully_shard
    from torch.utils.checkpoint import checkpoint

    import ac_diff
    from ac_diff.trace import read_run

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    import socket

    with socket.socket() as free:  # a port no other test run on this machine holds
        free.bind(("127.0.0.1", 0))
        monkeypatch.setenv("MASTER_PORT", str(free.getsockname()[1]))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        blocks = [nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.3), nn.Linear(16, 8)) for _ in range(2)]
        for b in blocks:
            fully_shard(b)
        with ac_diff.record(tmp_path / "t.jsonl"):
            x = torch.randn(4, 8)
            for b in blocks:
                x = x + checkpoint(b, x, use_reentrant=False, preserve_rng_state=preserve_rng_state)
            x.sum().backward()
    finally:
        dist.destroy_process_group()
    run = read_run(tmp_path / "t.jsonl")
    assert any("FSDP::" in str(o.args) for o in run.regions[0].forward.ops)  # the hooks ran in the region
    report = ac_diff.diagnose([run])
    if preserve_rng_state:
        assert report.verdict == "clean", report.headline
    else:
        assert {r.cause.kind for r in report.regions if r.status == "diverged"} == {"rng"}


@pytest.mark.parametrize("moved_from_step", [None, 3])
def test_watch_over_fsdp2_blocks_escalates_on_a_divergence_only(tmp_path, monkeypatch, moved_from_step):
    """`--watch` over fully_shard blocks: the first step, recorded in full, saves in its forward a view of the input
    that FSDP2's pre-forward hook makes inside the region, where the recompute saves the input itself. Same values:
    nothing escalates (every block was kept in full, and a later divergence was only counted: CLEAN). A scale
    buffer moved between the forward and the backward from step 3 on is found, escalated and reported."""
    import socket

    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.fsdp import fully_shard
    from torch.utils.checkpoint import checkpoint

    import ac_diff
    from ac_diff.trace import read_run

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)
            self.register_buffer("scale", torch.ones(16))

        def forward(self, x):
            return self.down(torch.relu(self.up(x)) * self.scale)

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        monkeypatch.setenv("MASTER_PORT", str(free.getsockname()[1]))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        blocks = [Scaled() for _ in range(2)]
        for b in blocks:
            fully_shard(b)
        with ac_diff.record(tmp_path / "t.jsonl", watch=True, watch_resample=0):
            for step in range(1, 5):
                x = torch.randn(4, 8)
                for b in blocks:
                    x = x + checkpoint(b, x, use_reentrant=False)
                if moved_from_step is not None and step >= moved_from_step:
                    with torch.no_grad():
                        blocks[1].scale.mul_(1.01)
                x.sum().backward()
    finally:
        dist.destroy_process_group()
    report = ac_diff.diagnose([read_run(tmp_path / "t.jsonl")])
    escalated = report.watch["escalated"]
    if moved_from_step is None:
        assert report.verdict == "clean" and escalated == [], (report.headline, escalated)
        return
    assert report.verdict == "diverged", report.headline
    assert [(e["module"], e["diverged_step"], e["from_step"]) for e in escalated] == [("blocks[1]", 3, 4)], escalated


def test_a_lone_process_trace_beside_a_launched_runs_traces_is_another_run():
    """`ac-diff run` without a launcher writes no run id: next to an earlier two-rank run's rank-1 trace it is
    still another run (a report would otherwise read that rank's divergence as this run's)."""
    from ac_diff.diagnosis.ranks import cross_rank_findings

    report = Report(verdict=CLEAN, headline="", regions=[_region_report(0, 0, CLEAN), _region_report(1, 0, CLEAN)])
    alone = Run(source="trace", path="trace-rank0.jsonl", rank=0, world_size=1, run_id=None, exit_status="ok")
    launched = Run(source="trace", path="trace-rank1.jsonl", rank=1, world_size=2, run_id="f9e8", exit_status="ok")
    mixed = [f for f in cross_rank_findings([alone, launched], report).findings if f.kind == "mixed_runs"]
    assert len(mixed) == 1 and "trace-rank0.jsonl (one process)" in mixed[0].text and mixed[0].ranks == [0, 1]
    same = [Run(source="trace", path=f"trace-rank{r}.jsonl", rank=r, world_size=2, run_id="f9e8", exit_status="ok")
            for r in (0, 1)]
    assert not [f for f in cross_rank_findings(same, report).findings if f.kind == "mixed_runs"]


def test_run_force_removes_an_earlier_runs_traces_of_every_rank(tmp_path):
    """One process writes the directory's only trace: --force removes an earlier launch's rank-1 trace, and without
    --force an earlier trace of any rank stops the run before the script starts."""
    script = tmp_path / "train.py"
    script.write_text("import torch\nfrom torch.utils.checkpoint import checkpoint\n"
                      "x = torch.ones(3, requires_grad=True)\n"
                      "checkpoint(torch.sin, x, use_reentrant=False).sum().backward()\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / "trace-rank1.jsonl").write_text("an earlier run's\n")
    refused = run_cli("run", "-o", str(out), str(script))
    assert refused.returncode == 2 and "trace-rank1.jsonl already exists" in refused.stderr
    assert not (out / "trace-rank0.jsonl").exists()
    done = run_cli("run", "--force", "-o", str(out), str(script))
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in out.iterdir()) == ["trace-rank0.jsonl"]


def test_a_rank_killed_outright_before_the_others_failed_is_named_first(tmp_path):
    """Rank 1 SIGKILLed (no end record), rank 0 then loses its peer in a collective: rank 1 stopped first, not
    rank 0 (torchrun names rank 1 the root cause); a trace cut after the others failed is only stopped."""
    from ac_diff.diagnosis.ranks import killed_first
    from ac_diff.passes import Run

    killed, failed = tmp_path / "trace-rank1.jsonl", tmp_path / "trace-rank0.jsonl"
    killed.write_text("{}\n")
    failed.write_text("{}\n")
    os.utime(killed, (100.0, 100.0))
    peer_lost = Run(source="trace", path=str(failed), rank=0, exit_status="exception", exit_code=1, end_time=130.0,
                    exc_type="RuntimeError", exc_message="Connection reset by peer")
    cut = Run(source="trace", path=str(killed), rank=1, truncated=True)
    assert killed_first([peer_lost, cut]) == 1
    os.utime(killed, (200.0, 200.0))  # written after rank 0 failed: torchrun stopped it
    assert killed_first([peer_lost, cut]) is None


def test_a_rank_killed_before_any_region_leads_over_the_stop_it_caused():
    """Rank 1 was killed (SIGKILL: no end record) before any region ran; torchrun then stopped rank 0 (SIGTERM). The
    headline named rank 0's SIGTERM, the consequence."""
    from ac_diff.diagnosis import diagnose

    runs = [Run(source="trace", path="r0", rank=0, world_size=2, run_id="a", exit_status="interrupted", exit_code=143,
                exc_type="Terminated", exc_message="the process received SIGTERM"),
            Run(source="trace", path="r1", rank=1, world_size=2, run_id="a", truncated=True, running=False)]
    report = diagnose(runs)
    assert report.headline.startswith("no checkpointed region ran: rank 1's process was killed before any did"), \
        report.headline
    assert report.verdict == "unchecked"


def test_ranks_stopped_by_a_sigterm_when_none_failed_are_not_said_to_be_ended_by_torchrun():
    """The user sent SIGTERM to the launcher: every rank stopped (143), none failed. The cross-rank line said
    "stopped before finishing (torchrun ends every rank when one fails)", a failure there was not."""
    from ac_diff.diagnosis import diagnose
    from ac_diff.diagnosis.ranks import cross_rank_findings

    def stopped(rank: int) -> Run:
        return Run(source="trace", path=f"r{rank}", rank=rank, world_size=2, run_id="a", exit_status="interrupted",
                   exit_code=143, exc_type="Terminated", exc_message="the process received SIGTERM")

    runs = [stopped(0), stopped(1)]
    exits = next(f for f in cross_rank_findings(runs, diagnose(runs)).findings if f.kind == "exits")
    assert "ranks 0, 1 were stopped before finishing (by SIGTERM" in exits.text, exits.text
    assert "torchrun ends every rank" not in exits.text, exits.text


def test_a_rank_still_running_after_rank_0_failed_is_said_to_wait_for_it():
    """Plain torchrun, rank 0's script raised: rank 0 reports after 3 s (the others are blocked in a collective
    waiting for it), and said rank 1 was "slower than AC_DIFF_RANK_WAIT", a wait it never made."""
    from ac_diff.diagnosis import diagnose
    from ac_diff.diagnosis.ranks import cross_rank_findings

    runs = [Run(source="trace", path="r0", rank=0, world_size=2, run_id="a", exit_status="exception", exit_code=1,
                end_time=10.0, exc_type="RuntimeError", exc_message="boom"),
            Run(source="trace", path="r1", rank=1, world_size=2, run_id="a", truncated=True, running=True)]
    exits = next(f for f in cross_rank_findings(runs, diagnose(runs)).findings if f.kind == "exits")
    assert "blocked in a collective, waiting for rank 0, which failed" in exits.text, exits.text
    assert "AC_DIFF_RANK_WAIT" not in exits.text, exits.text


@pytest.mark.parametrize("peer", ["killed", "failed_earlier", "none"])
def test_a_backward_that_raised_after_a_peer_stopped_leaves_the_divergence_silent(tmp_path, peer):
    """Rank 0's region diverged silently; rank 1 was then killed, and rank 0's next backward raised gloo's
    "Connection reset by peer". Under --watch (only that step written) the headline said "DIVERGED ...; then the
    backward raised RuntimeError: ... Connection reset by peer", dropping SILENTLY for an error the divergence did not
    cause. Without a peer that stopped first, a backward raising after a silent divergence still counts (the
    control)."""
    from ac_diff.diagnosis import _raised_in_their_backward
    from ac_diff.report import DIVERGED, RegionReport

    r0, r1 = tmp_path / "trace-rank0.jsonl", tmp_path / "trace-rank1.jsonl"
    r0.write_text("{}\n")
    r1.write_text("{}\n")
    os.utime(r1, (100.0, 100.0))
    lost = Run(source="trace", path=str(r0), rank=0, world_size=2, exit_status="exception", exit_code=1,
               end_time=130.0, exc_type="RuntimeError", exc_message="Read error: Connection reset by peer",
               exc_in_backward=True)
    other = {"killed": Run(source="trace", path=str(r1), rank=1, world_size=2, truncated=True),
             "failed_earlier": Run(source="trace", path=str(r1), rank=1, world_size=2, exit_status="exception",
                                   exit_code=1, end_time=120.0, exc_type="ValueError", exc_message="bad batch"),
             "none": Run(source="trace", path=str(r1), rank=1, world_size=2, exit_status="ok", exit_code=0,
                         end_time=140.0)}[peer]
    region = RegionReport(rank=0, region=3, module="blocks.0", kind="checkpoint", status=DIVERGED, silent=True,
                          cause=None, first_value_divergence=None, first_discrete_divergence=None,
                          first_shape_divergence=None, first_control_divergence=None, positions=[], suggestions=[],
                          chain=[], path=str(r0))
    _raised_in_their_backward([lost, other], [region])
    assert region.silent == (peer != "none") and (region.backward_raised is None) == (peer != "none"), region


@pytest.mark.e2e
def test_a_rank_whose_gradients_differ_only_through_the_all_reduce_keeps_its_regions(tmp_path):
    """DDP fade-in blocks (tests/stacks/ddp_fade_in.py): both ranks count their tokens twice under AC; only rank 1's
    alpha still ramps, so only rank 1 diverges, and the all-reduce hands its error to rank 0's gradients (25b).
    `--reference` marked every region of rank 0 diverged (its gradients differ from the run without AC) and the
    summary read "16 diverged"; the rank-local line sent the user looking for code that runs on rank 1 alone. Rank 0's
    regions stay as their recomputes were (clean, or at risk with a note that the gradients say nothing of them),
    and the rank-local line says that the same code runs on both ranks."""
    out, json_path = tmp_path / "out", tmp_path / "r.json"
    proc = run_cli("run", "--nproc-per-node", "2", "-o", str(out), "--json", str(json_path), "--reference", "no-ac",
                   "--reference-steps", "2", str(Path(__file__).parent / "stacks" / "ddp_fade_in.py"), cwd=tmp_path,
                   timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = report_json(json_path)
    assert report["verdict"] == DIVERGED and report["reference"]["verdict"] == "differs"
    statuses = {(r["rank"], r["region"]): r["status"] for r in report["regions"]}
    assert all(statuses[1, n] == DIVERGED for n in range(6)), statuses
    assert not any(statuses[0, n] == DIVERGED for n in range(6)), statuses
    at_risk = [r for r in report["regions"] if r["rank"] == 0 and r["status"] == "unchecked"]
    assert at_risk and all(any("only as another rank's do (reduced across ranks)" in n for n in r["notes"])
                           for r in at_risk), at_risk
    local = next(f for f in report["cross_rank_findings"] if f["kind"] == "rank_local")
    assert "the same code runs on every rank: `module.blocks" in local["text"], local["text"]
    assert "tokens_seen` changes between the passes on rank 0 too" in local["text"], local["text"]
    assert "alone" not in local["text"]
