"""Two nodes without a shared filesystem: each rank's trace reaches rank 0 through torchrun's rendezvous store
(ac_diff/commands/rank_exchange.py), a rank that never delivers is named and the verdict is never clean.

The end-to-end tests simulate two nodes on this machine: two torchrun launches of 2 processes each (c10d
rendezvous, gloo on CPU), each in its own working directory with its own -o directory:

    python -m torch.distributed.run --nnodes 2 --node-rank N --nproc-per-node 2 --rdzv-backend c10d \\
        --rdzv-endpoint localhost:PORT --rdzv-id ID -m ac_diff run --check -o out stacks/rank_local_center.py ...

The unit tests run the exchange over an in-process store (HashStore, TCPStore) with traces recorded here.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils.checkpoint as cp

from conftest import REPO, report_json, run_cli

from ac_diff.capture.recorder import Recorder, RecordOptions
from ac_diff.commands import launch_cmd, rank_exchange
from ac_diff.commands.common import verdict_code
from ac_diff.commands.report_cmd import one_trace_per_rank
from ac_diff.diagnosis import Settings, diagnose
from ac_diff.report import CLEAN, DIVERGED, UNCHECKED, Report, missing_ranks
from ac_diff.trace import read_run

SCRIPT = REPO / "tests" / "stacks" / "rank_local_center.py"
RID = "two-nodes.0"


# -- the exchange, in one process ---------------------------------------------------------------------
class Centered(nn.Module):
    """A checkpointed block whose buffer `center` may move inside the forward (then the recompute moves it again)."""

    def __init__(self, moves: bool) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.register_buffer("center", torch.zeros(8))
        self.moves = moves

    def forward(self, x):
        if self.moves:
            with torch.no_grad():
                self.center.add_(x.mean(0))
        return torch.tanh(self.proj(x - self.center))


def record_rank(path: Path, rank: int, monkeypatch, world: int = 3, moves: bool = False, **options) -> Path:
    """Rank `rank`'s trace of run RID: three checkpointed blocks (the last one's centre moves if `moves`), one step."""
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(world))
    torch.manual_seed(0)
    blocks = nn.ModuleList([Centered(False), Centered(False), Centered(moves)])
    recorder = Recorder(path, RecordOptions(**options), header_extra={"run_id": RID}).start()
    try:
        x = torch.randn(4, 8)
        for block in blocks:
            x = cp.checkpoint(block, x, use_reentrant=False)
        x.pow(2).sum().backward()
    finally:
        recorder.stop()
    return path


def as_node(monkeypatch, node: int, host: str = "node-a") -> None:
    monkeypatch.setenv("GROUP_RANK", str(node))
    monkeypatch.setattr(rank_exchange.platform, "node", lambda: host)


def test_exchange_delivers_a_trace_and_names_a_rank_that_died(tmp_path, monkeypatch, capsys):
    store = dist.HashStore()
    dirs = {r: tmp_path / f"node{r}" / "out" for r in range(3)}
    for d in dirs.values():
        d.mkdir(parents=True)
    zero = rank_exchange.Exchange(store, 0, 3)
    as_node(monkeypatch, 0, "node-a")
    zero.hello(dirs[0])
    record_rank(dirs[0] / "trace-rank0.jsonl", 0, monkeypatch)
    monkeypatch.setattr(rank_exchange, "CHUNK", 4096)  # several chunks
    as_node(monkeypatch, 1, "node-b")
    one = rank_exchange.Exchange(store, 1, 3)
    one.hello(dirs[1])
    sent = record_rank(dirs[1] / "trace-rank1.jsonl", 1, monkeypatch, moves=True, write="all")
    meta = one.send(sent, dirs[1])
    assert meta["chunks"] > 1 and not meta["cut"] and not meta["shared"]
    rank_exchange.Exchange(store, 2, 3).hello(dirs[2])  # rank 2 starts, then dies: no trace, no "done"

    assert zero.receive(dirs[0], RID) == {0, 1}
    received = dirs[0] / "trace-rank1.jsonl"
    assert received.read_bytes() == sent.read_bytes()
    assert not store.check([f"trace/1/{i}" for i in range(meta["chunks"])][:1])  # taken out of the store
    assert zero.arrived[1]["node"] == 1 and zero.arrived[1]["host"] == "node-b"

    found = launch_cmd.collect_traces(dirs[0], RID, 3)
    assert sorted(found.paths) == [0, 1] and found.missing == [2]
    report = launch_cmd.report_ranks(found, Settings(), "terminal", None, None, dirs[0], exchange=zero)
    assert report.verdict == DIVERGED  # a divergence stays a divergence, rank 2 missing or not
    assert report.missing_ranks == [2]
    notes = " ".join(report.notes)
    assert f"rank 1: trace received from node 1 (host node-b, {dirs[1]}); its full trace is there" in notes
    assert "rank 2 (node 1, host node-b) started but sent no results: it may have died" in notes
    assert str(dirs[2]) in notes
    assert "RANKS MISSING" not in capsys.readouterr().out


def test_a_shared_directory_is_not_sent_twice(tmp_path, monkeypatch):
    store = dist.HashStore()
    out = tmp_path / "out"
    zero, one = rank_exchange.Exchange(store, 0, 2), rank_exchange.Exchange(store, 1, 2)
    zero.hello(out)
    trace = record_rank(out / "trace-rank1.jsonl", 1, monkeypatch, world=2)
    before = trace.stat().st_mtime_ns
    meta = one.send(trace, out)
    assert meta["shared"] and meta["chunks"] == 0
    assert zero.receive(out, RID) == {0, 1} and not zero.arrived
    assert trace.stat().st_mtime_ns == before


def test_a_ranks_gradients_and_its_references_travel_with_its_trace(tmp_path, monkeypatch):
    """32c: with `--reference no-ac` on two nodes, rank 0 compared only its own node's ranks (the others' gradients
    stayed on their node). The files a comparison of a rank reads go with its trace, in their place under rank 0's
    directory; one over the rank's share of the store stays behind, named."""
    from ac_diff.reference.paths import REFERENCE_DIR, grads_path, rank_outputs, side_path

    store = dist.HashStore()
    node1, node0 = tmp_path / "node1" / "out", tmp_path / "node0" / "out"
    trace = record_rank(node1 / "trace-rank1.jsonl", 1, monkeypatch, world=2)
    (node1 / REFERENCE_DIR).mkdir()
    files = {grads_path(node1, 1): b"run gradients", side_path(node1, 1): b"{}",
             grads_path(node1 / REFERENCE_DIR, 1): b"reference gradients" * 1000}
    for path, data in files.items():
        path.write_bytes(data)
    grads_path(node1, 0).write_bytes(b"another rank's: not sent")
    assert sorted(rank_outputs(node1, 1)) == sorted(files)
    monkeypatch.setattr(rank_exchange, "CHUNK", 4096)  # several chunks
    meta = rank_exchange.Exchange(store, 1, 2).send(trace, node1, rank_outputs(node1, 1))
    assert not meta["left"] and len(meta["files"]) == 3
    zero = rank_exchange.Exchange(store, 0, 2)
    assert zero.receive(node0, RID) == {0, 1}
    for path, data in files.items():
        assert (node0 / path.relative_to(node1)).read_bytes() == data
    assert not (node0 / "grads-rank0.pt").exists()
    assert not store.check(["file/1/2/0"])  # taken out of the store

    small = trace.stat().st_size + 100  # (room for the trace and the small files only)
    meta = rank_exchange.Exchange(store, 1, 2, cap=small).send(trace, node1, rank_outputs(node1, 1))
    assert meta["left"] == [f"{REFERENCE_DIR}/grads-rank1.pt"] and len(meta["files"]) == 2
    zero = rank_exchange.Exchange(store, 0, 2, cap=small)
    zero.receive(tmp_path / "elsewhere", RID, scan=True)
    notes = launch_cmd._received_notes(zero)
    assert any(n.startswith(f"rank 1: {REFERENCE_DIR}/grads-rank1.pt stayed on its node") for n in notes), notes


def test_a_trace_over_the_cap_travels_without_its_op_lists(tmp_path, monkeypatch):
    store = dist.HashStore()
    # (no clean sample written in full: each block is its own module, `blocks.0`-`2`)
    full = record_rank(tmp_path / "node1" / "trace-rank1.jsonl", 1, monkeypatch, world=2, moves=True, keep_clean=0)
    one = rank_exchange.Exchange(store, 1, 2, cap=1000)
    meta = one.send(full, full.parent)
    assert meta["cut"] and meta["original_bytes"] == full.stat().st_size and meta["bytes"] < meta["original_bytes"]
    zero = rank_exchange.Exchange(store, 0, 2)
    zero.receive(tmp_path / "node0", RID)
    copy = tmp_path / "node0" / "trace-rank1.jsonl"
    lines = [json.loads(line) for line in copy.read_text().splitlines()]
    assert lines[0]["cut"]["path"] == str(full.resolve()) and lines[-1]["type"] == "end"
    assert not {rec["type"] for rec in lines} & {"op", "ops"}
    originals = [json.loads(line) for line in full.read_text().splitlines()]
    had_ops = {(r["region"], r["phase"], r["attempt"]) for r in originals if r["type"] == "ops"}
    cut = {(r["region"], r["phase"], r["attempt"]) for r in lines if r["type"] == "pass" and r["state"].get("cut")}
    assert had_ops and cut == had_ops  # exactly the passes whose op lists stayed behind

    run = read_run(copy, lazy=True)  # every checksum holds: nothing reads as damaged
    assert not run.damaged and not run.truncated
    assert any("cut for the trip to rank 0" in note and str(full.resolve()) in note for note in run.notes)
    report = diagnose([run])
    status = {r.region: r.status for r in report.regions}
    # a summarized region (it reproduced) travels whole; one without its ops and positions proves nothing either way
    summarized = {r.region for r in run.regions if not r.ops_written}
    assert summarized and all(status[r] == CLEAN for r in summarized)
    assert status[2] == UNCHECKED
    # a cut copy is never clean (and rank 0, of the same world of 2, has no trace here)
    assert report.verdict == UNCHECKED and report.missing_ranks == [0, 1]
    whole = diagnose([read_run(full)])
    assert {r.region: r.status for r in whole.regions} == {0: CLEAN, 1: CLEAN, 2: DIVERGED}

    kept, notes = one_trace_per_rank([read_run(copy, lazy=True), read_run(full, lazy=True)])
    assert [r.path for r in kept] == [str(full)]  # the complete trace wins
    assert notes == [f"rank 1: read from {full}, not from {copy} (a cut copy)"]


def test_connect_over_a_real_store_and_without_one(monkeypatch):
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(master.port))
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    with pytest.raises(rank_exchange.StoreUnavailable) as absent:
        rank_exchange.connect(RID, 1, 2)
    assert not absent.value.failed  # nothing to reach: rank 0 says so once, the others stay quiet
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    exchange = rank_exchange.connect(RID, 1, 2)
    exchange.hello("out")
    assert master.check([f"ac-diff/{RID}/hello/1"])  # namespaced by the run id
    assert rank_exchange.connect("another.0", 0, 2).hellos([1]) == {}

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        monkeypatch.setenv("MASTER_PORT", str(s.getsockname()[1]))
    start = time.monotonic()
    with pytest.raises(rank_exchange.StoreUnavailable) as failed:
        rank_exchange.connect(RID, 1, 2, timeout=1.0)
    assert failed.value.failed and "could not reach the rendezvous store" in str(failed.value)
    assert time.monotonic() - start < 10


def test_a_launch_that_reuses_the_rendezvous_id_gets_its_own_run_id(tmp_path, monkeypatch):
    """A fixed --rdzv-id (torch's docs use 100) or a requeued job's id is the same for the next launch: every rank of
    one launch reads the token the first one set in the agent's store, a new launch (a new store) another, so rank 0
    never takes an earlier launch's traces for this one's. With --force, rank 0 removes every trace an earlier
    launch left (it kept node 1's received copies, reported them for this launch: CLEAN over a divergence)."""
    port = _free_port()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "100")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.delenv(launch_cmd.RUN_ID_ENV, raising=False)
    ids = []
    for _ in range(2):  # two launches: each its own agent store
        server = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=__import__("datetime").timedelta(seconds=5))
        launch_cmd._tokens.clear()
        first = launch_cmd.run_id()
        launch_cmd._tokens.clear()  # (another rank of the same launch: its own process)
        assert launch_cmd.run_id() == first and first.startswith("100-") and first.endswith(".0")
        ids.append(first)
        del server
    assert ids[0] != ids[1]

    out = tmp_path / "out"  # rank 0's directory: its own trace and node 1's copies from the earlier launch
    out.mkdir()
    monkeypatch.setattr(launch_cmd, "RUN_ID_ENV", "AC_DIFF_TEST_UNSET")
    for r in (0, 1, 2):
        record_rank(out / f"trace-rank{r}.jsonl", r, monkeypatch)  # (run RID: an earlier launch)
    server = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=__import__("datetime").timedelta(seconds=5))
    launch_cmd._tokens.clear()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(launch_cmd, "is_multi_rank", lambda: True)
    monkeypatch.setattr(launch_cmd, "launched", lambda: True)  # (no hello: this test has no exchange)
    launch_cmd.prepare_rank(str(out), out / "trace-rank0.jsonl", force=True)
    assert sorted(p.name for p in out.iterdir()) == []
    del server


def test_a_rank_killed_after_the_others_finished_is_neither_clean_nor_stopped_by_torchrun(tmp_path, monkeypatch):
    """Rank 2's process was killed (no end record) while no rank failed: its own verdict is unchecked (it read clean,
    and "clean: ranks 0-2"), and it was killed outright, not "stopped (torchrun ends every rank when one fails)"."""
    out = tmp_path / "out"
    out.mkdir()
    for r in range(3):
        record_rank(out / f"trace-rank{r}.jsonl", r, monkeypatch)
    killed = out / "trace-rank2.jsonl"
    lines = killed.read_text().splitlines(keepends=True)
    assert json.loads(lines[-1])["type"] == "end"
    killed.write_text("".join(lines[:-1]))  # what a SIGKILL leaves: everything but the end record
    import ac_diff

    report = ac_diff.diagnose_paths([out])
    assert report.verdict == UNCHECKED and 2 in report.missing_ranks
    ranks = {r.rank: r.verdict for r in report.ranks}
    assert ranks == {0: CLEAN, 1: CLEAN, 2: UNCHECKED}, ranks
    exits = next(f for f in report.cross_rank_findings if f.kind == "exits")
    assert exits.text.startswith("rank 2: the trace ends without an end record and no rank failed (the process was "
                                 "killed"), exits.text
    assert "torchrun ends every rank" not in exits.text


def test_a_directory_with_an_unreadable_trace_reports_the_others(tmp_path, monkeypatch):
    """One rank's file empty (or its header cut: a rank killed as it began, a copy cut short): the other ranks are
    reported, that rank is missing, and the report is never clean (the whole directory was refused, exit 2)."""
    out = tmp_path / "out"
    out.mkdir()
    for r in (1, 2):
        record_rank(out / f"trace-rank{r}.jsonl", r, monkeypatch, moves=r == 2)
    (out / "trace-rank0.jsonl").write_text("")
    shown = run_cli("report", "--check", str(out))
    assert shown.returncode == 1, shown.stderr  # rank 2's divergence still found
    assert "was left out (it is empty): that rank's results are missing" in " ".join(shown.stdout.split())
    for r in (1, 2):
        (out / f"trace-rank{r}.jsonl").unlink()
    record_rank(out / "trace-rank1.jsonl", 1, monkeypatch)
    (out / "trace-rank2.jsonl").write_text('{"format": "ac-diff-tr')  # its header cut
    clean_but = run_cli("report", "--check", str(out))
    assert clean_but.returncode == 4 and "RANKS MISSING" in clean_but.stdout, clean_but.stdout[-2000:]
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "trace-rank0.jsonl").write_text("")
    nothing = run_cli("report", str(alone))
    assert nothing.returncode == 2 and "trace-rank0.jsonl: the file is empty" in nothing.stderr, nothing.stderr


def test_a_missing_rank_is_never_clean():
    def report(verdict: str) -> Report:
        return Report(verdict=verdict, headline="clean: all 4 recomputed region(s) reproduced", regions=[])

    clean = report(CLEAN)
    missing_ranks(clean, [3], ["rank 3 (node 1, host h) started but sent no results: it may have died"])
    assert clean.verdict == UNCHECKED and verdict_code(clean) == 4 and clean.title == "RANKS MISSING"
    assert clean.headline.startswith("results missing from rank 3: ")
    missing_ranks(clean, [2, 3])  # the launch knows more than the diagnosis: one headline for both
    assert clean.missing_ranks == [2, 3] and clean.headline.startswith("results missing from ranks 2, 3: ")
    assert clean.headline.count("clean: all 4") == 1 and len(clean.notes) == 1
    diverged = report(DIVERGED)
    missing_ranks(diverged, [1])
    assert diverged.verdict == DIVERGED and verdict_code(diverged) == 1
    untouched = report(CLEAN)
    missing_ranks(untouched, [])
    assert untouched.verdict == CLEAN
    # a rank whose process was killed (its trace has no end record): the headline says so, before what the other
    # ranks raised on losing their peer (25b: it led with rank 0's "Connection reset by peer")
    killed = report(CLEAN)
    missing_ranks(killed, [1], killed=[1])
    assert killed.headline.startswith("results missing from rank 1 (killed: the trace of rank 1 has no end record, "
                                      "as after SIGKILL or the out-of-memory killer;"), killed.headline


# -- two nodes, end to end ----------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_listener(port: int, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """Until the launch has bound the rendezvous port: which launch binds it first hosts the store, and a sleep
    does not decide that when importing torch takes longer than the sleep."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            socket.create_connection(("localhost", port), timeout=1.0).close()
            return
        except OSError:
            time.sleep(0.1)


def two_nodes(tmp_path: Path, *script_args: str, wait_s: int = 60, timeout: int = 90,
              run_args: tuple[str, ...] = ()) -> dict[str, dict]:
    """Both launches, each in its own directory (a "node") writing its own out/; returns per node its exit code,
    output and directory, keyed "zero" (the node that got rank 0) and "one"."""
    port, rdzv_id = _free_port(), f"t{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "AC_DIFF_RANK_WAIT": str(wait_s)}
    for name in (launch_cmd.RUN_ID_ENV, launch_cmd.LAUNCHED_ENV, "TORCHELASTIC_USE_AGENT_STORE"):
        env.pop(name, None)
    procs = []
    for node in (0, 1):
        cwd = tmp_path / f"node{node}"
        cwd.mkdir()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
               "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}",
               "--rdzv-id", rdzv_id, "-m", "ac_diff", "run", "--check", "-o", "out", "--json", "report.json",
               *run_args, str(SCRIPT), *script_args]
        procs.append((cwd, subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                            text=True, start_new_session=True)))
        if node == 0:  # hosts the store and, started first (torch ranks nodes of one host by pid), gets rank 0
            _wait_for_listener(port, procs[0][1])
    deadline = time.monotonic() + timeout
    nodes = []
    for cwd, proc in procs:
        try:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for _, p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
            out, err = proc.communicate()
        nodes.append({"dir": cwd, "code": proc.returncode, "stdout": out, "stderr": err})
    zero = next(n for n in nodes if (n["dir"] / "out" / "trace-rank0.jsonl").exists())
    return {"zero": zero, "one": next(n for n in nodes if n is not zero)}


def rank0_exit_code(stderr: str) -> int | None:
    """Rank 0's exit code, from torchrun's failure summary (torchrun itself exits 1 when a worker fails)."""
    hit = re.search(r"rank\s*:\s*0 \(local_rank: 0\)\s*\n\s*exitcode\s*:\s*(-?\d+)", stderr)
    return int(hit[1]) if hit else None


@pytest.mark.e2e
def test_divergence_on_a_rank_of_the_other_node_reaches_rank_0(tmp_path):
    """Rank 3 (node 1) keeps a running centre inside its checkpointed blocks; rank 0 (node 0, another -o
    directory) reports it diverged, and says where the full traces of node 1 are."""
    nodes = two_nodes(tmp_path, "--center-rank", "3")
    zero, one = nodes["zero"], nodes["one"]
    said = zero["stderr"][-4000:] + one["stderr"][-4000:]
    assert sorted(p.name for p in (one["dir"] / "out").iterdir()) == ["trace-rank2.jsonl", "trace-rank3.jsonl"], said
    report = report_json(zero["dir"] / "report.json")
    assert report["verdict"] == DIVERGED and report["missing_ranks"] == [], said
    ranks = {r["rank"]: r for r in report["ranks"]}
    assert {r: s["verdict"] for r, s in ranks.items()} == {0: CLEAN, 1: CLEAN, 2: CLEAN, 3: DIVERGED}
    assert ranks[3]["cause"] == "state_mutation" and ranks[3]["first_module"] == "layers.0"
    assert ranks[3]["cause_tensor"] == "layers.0.center"
    local = next(f for f in report["cross_rank_findings"] if f["kind"] == "rank_local")
    assert local["ranks"] == [3] and local["region"] == 0 and local["module"] == "layers.0"
    node1 = (one["dir"] / "out").resolve()
    assert any(n.startswith("ranks 2, 3: traces received from node 1 (host ") and f", {node1}); their full traces "
               "are there" in n for n in report["notes"]), report["notes"]
    assert "DIVERGED" in zero["stdout"] and "rank 3" in zero["stdout"]
    assert rank0_exit_code(zero["stderr"]) == 1, said  # --check: the diverged verdict's code
    # every rank exits with it (32c: node 1's ranks exited 0, and its torchrun waited 300 s in the exit barrier)
    assert one["code"] == 1 and zero["code"] == 1, (one["code"], zero["code"], said)
    verify = {s["verify"] for r in report["regions"] for s in r["suggestions"]}  # `fix` runs one node's processes
    assert verify and all("--nproc-per-node 2 " in v for v in verify), verify

    merged = run_cli("report", "--json", str(tmp_path / "merged.json"), str(zero["dir"] / "out"),
                     str(one["dir"] / "out"))
    assert merged.returncode == 1, merged.stderr  # ranks 2 and 3 are in both directories: read once
    kinds = {f["kind"] for f in report_json(tmp_path / "merged.json")["cross_rank_findings"]}
    assert "mixed_runs" not in kinds and "missing_ranks" not in kinds
    verify = {s["verify"] for r in report_json(tmp_path / "merged.json")["regions"] for s in r["suggestions"]}
    assert verify and all("--nproc-per-node 2 " in v for v in verify), verify


@pytest.mark.e2e
def test_reference_no_ac_on_two_nodes_without_a_shared_filesystem(tmp_path):
    """31c: `--reference no-ac` on two nodes hung (the reference ranks never met: see
    test_the_reference_ranks_of_two_nodes_meet_through_the_store_not_a_shared_directory), then said "the run without
    AC exited with -15 ... checkpointing hides an error"."""
    nodes = two_nodes(tmp_path, "--center-rank", "3", run_args=("--reference", "no-ac"), timeout=240)
    zero, one = nodes["zero"], nodes["one"]
    said = zero["stderr"][-4000:] + one["stderr"][-4000:]
    report = report_json(zero["dir"] / "report.json")
    assert report["verdict"] == DIVERGED and report["reference"], said
    # (32c: rank 0 compared only its own node's ranks) node 1's gradients and its reference's came with its traces
    reference = report["reference"]
    assert reference["verdict"] == "differs" and "rank 3" in reference["headline"], reference
    assert not any("another node" in n for n in reference["notes"]), reference["notes"]
    assert {s["rank"] for s in reference["steps"]} == {0, 1, 2, 3}, reference["steps"]
    assert (one["dir"] / "out" / "reference" / "grads-rank3.pt").exists(), said  # (node 1's reference ran)
    # with node 1's directory beside it, every rank is compared: rank 3's gradients differ
    merged = run_cli("report", "--json", str(tmp_path / "merged.json"), str(zero["dir"] / "out"),
                     str(one["dir"] / "out"))
    reference = report_json(tmp_path / "merged.json")["reference"]
    assert reference["verdict"] == "differs" and "rank 3" in reference["headline"], (merged.stderr, reference)


@pytest.mark.e2e
def test_a_rank_killed_on_the_other_node_makes_the_report_unchecked(tmp_path):
    """Rank 3 (node 1) kills itself after its last step, before finishing its trace: rank 0 names it, with its
    node and host, and the verdict is unchecked (exit 4 with --check), not clean."""
    nodes = two_nodes(tmp_path, "--center-rank", "-1", "--die-rank", "3", wait_s=8)
    zero = nodes["zero"]
    said = zero["stderr"][-4000:] + nodes["one"]["stderr"][-4000:]
    report = report_json(zero["dir"] / "report.json")
    assert report["verdict"] == UNCHECKED and report["title"] == "RANKS MISSING", said
    # rank 2, which node 1's torchrun stops when rank 3 dies, may be cut short too (a trace without its end record)
    assert 3 in report["missing_ranks"] and set(report["missing_ranks"]) <= {2, 3}, report["missing_ranks"]
    assert report["headline"].startswith("results missing from rank"), report["headline"]
    assert any(n.startswith("rank 3 (node 1, host ") and "started but sent no results: it may have died" in n
               for n in report["notes"]), report["notes"]
    assert "RANKS MISSING" in zero["stdout"]
    assert rank0_exit_code(zero["stderr"]) == 4, said

    later = run_cli("report", str(zero["dir"] / "out"))
    assert later.returncode == 4, later.stdout[-2000:]  # rank 3's trace is not there: never clean


def test_one_ranks_trace_alone_is_never_clean(tmp_path, monkeypatch):
    """The trace of rank 0 of a world of 2, copied back alone (the node one could reach): its regions reproduced, but
    what rank 1 ran was not compared, and DDP reduced rank 0's gradients with rank 1's: RANKS MISSING, not clean."""
    trace = record_rank(tmp_path / "trace-rank0.jsonl", 0, monkeypatch, world=2)
    report = diagnose([read_run(trace)])
    assert all(r.status == CLEAN for r in report.regions)
    assert (report.verdict, report.title, report.missing_ranks) == (UNCHECKED, "RANKS MISSING", [1]), report.headline
    assert verdict_code(report) == 4
    monkeypatch.setenv("WORLD_SIZE", "1")
    alone = record_rank(tmp_path / "alone" / "trace-rank0.jsonl", 0, monkeypatch, world=1)
    assert diagnose([read_run(alone)]).verdict == CLEAN


def test_report_of_node_directories_a_relaunch_did_not_clear_reports_the_latest_launch():
    """A relaunch with c10d gave node 0 ranks 2-3 this time: its directory still holds ranks 0-1 of the earlier launch
    (its new ranks overwrite nothing), and `report node0 node1` reported that earlier launch's divergence for a clean
    relaunch. The latest launch is reported; the earlier traces are named as left out."""
    from ac_diff.commands.report_cmd import latest_run
    from ac_diff.errors import InputError
    from ac_diff.passes import Run

    def trace(rank: int, rid: str, start: float, node: int) -> Run:
        return Run(source="trace", path=f"node{node}/out/trace-rank{rank}.jsonl", rank=rank, regions=[],
                   exit_status="ok", run_id=rid, start_time=start)

    old = [trace(0, "first", 100.0, 0), trace(1, "first", 100.0, 0)]
    new = [trace(2, "second", 200.0, 0), trace(3, "second", 200.0, 0), trace(0, "second", 200.1, 1),
           trace(1, "second", 200.1, 1)]
    kept, notes = latest_run([*old, *new])
    assert kept == new and len(notes) == 2 and all("earlier launch, run first" in n for n in notes), notes
    other = [trace(0, "third", 300.0, 2)]  # (no rank twice: left to the mixed-runs finding)
    assert latest_run([*new[:2], *other]) == ([*new[:2], *other], [])
    # single processes have no run id (27d: `report killed/ finished/` mixed a killed run's 428 regions with a finished
    # run's into NOTHING CHECKED, "traces of different runs are mixed"): each process is a launch of its own
    single = [Run(source="trace", path=f"{name}/trace-rank0.jsonl", rank=0, regions=[], exit_status=status,
                  start_time=start, header={"pid": pid, "host": "vm"}) for name, status, start, pid in
              [("killed", "ok", 100.0, 11), ("finished", "ok", 200.0, 12)]]
    kept, notes = latest_run(single)
    assert kept == single[1:] and len(notes) == 1 and "left out killed/trace-rank0.jsonl" in notes[0], notes
    # two scripts' traces are no relaunch (28f: `report --check diverged/ clean/` passed, the diverged one left out)
    single[0].argv, single[1].argv = ["train_a.py"], ["train_b.py", "--lr", "1"]
    with pytest.raises(InputError, match="the paths hold traces of 2 different runs .*killed/trace-rank0.jsonl: "
                                         "train_a.py; finished/trace-rank0.jsonl: train_b.py --lr 1"):
        latest_run(single)


def test_the_reference_ranks_of_two_nodes_meet_through_the_store_not_a_shared_directory(tmp_path, monkeypatch):
    """31c: each node's ranks looked for rank 0's port in their own output directory; the other node's never saw it,
    guessed MASTER_PORT + 1, and both waited in init_process_group until a timeout killed them."""
    from ac_diff.reference import run as reference_run

    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(master.port))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", RID)
    monkeypatch.setattr(reference_run, "_STARTED", iter([0, 0]))  # (each process counts its own references)
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    node0.mkdir(), node1.mkdir()
    monkeypatch.setenv("RANK", "0")
    published = reference_run._fresh_group(node0, since=0.0)
    monkeypatch.setenv("RANK", "1")
    met = reference_run._fresh_group(node1, since=0.0)
    assert met == published and met["MASTER_PORT"] != str(master.port + 1), (met, published)
    assert not list(node1.iterdir())  # (nothing was read from, or written to, node 1's directory)


def test_no_rank_runs_its_reference_when_one_will_not(monkeypatch):
    """34b: `--reference no-ac` on two nodes, a CheckpointError on rank 1: rank 1 waited 120 s for a reference group
    while rank 0's script sat in an all-reduce rank 1 no longer joined; then rank 0's reference waited for peers that
    had left (node 0 hung). Each rank says through the store whether it runs its reference: one that does not (its
    script failed, or finished no backward) makes every rank skip it, with its reason."""
    from ac_diff.reference import run as reference_run

    store = dist.HashStore()
    monkeypatch.setattr(reference_run, "job_store", lambda namespace, timeout=None: dist.PrefixStore(namespace, store))
    monkeypatch.setattr(reference_run, "PORT_WAIT_S", 5.0)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(reference_run, "_AGREED", iter([0, 0, 1, 2]))  # (each rank's n-th reference: one key)
    monkeypatch.setenv("RANK", "1")
    failed = "the script failed on rank 1 (exit 1), and the reference's ranks run together"
    assert reference_run.peers_agree(failed) == failed  # (it says so, and does not wait)
    monkeypatch.setenv("RANK", "0")
    assert reference_run.peers_agree(None) == failed
    agreed = dist.PrefixStore(f"reference/{reference_run._tag()}", store)
    agreed.set("agree/1/1", "")  # (rank 1 finished its second one and runs its reference)
    assert reference_run.peers_agree(None) is None
    # rank 1 never says (it hangs elsewhere): bounded
    assert reference_run.peers_agree(None) == "rank 1 did not finish the script within 5 s of this one"
