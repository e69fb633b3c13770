"""The recorder's cost structure (not its speed: timings live in benchmarks/overhead.py).

On a GPU every device->host read is a synchronisation, so the recorder may read back a constant number
of times per checkpointed pass, never once per op: fingerprints and kept values stay on the device and
travel together at the end of the pass (`fingerprint.to_host`). These tests count the reads on CPU,
where the same code path runs. They also pin the trace's compact "ops" record, the base64 kept values
and the `write="diverged"` mode for long runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint as cp

import ac_diff
from ac_diff.capture import fingerprint
from ac_diff.capture.fingerprint import FingerprintBatch, decode_values, encode_values
from ac_diff.passes import op_count
from ac_diff.trace import read_run
from conftest import EXAMPLES

sys.path.insert(0, str(EXAMPLES))
import tiny_moe  # noqa: E402

AC_DIFF_DIR = os.path.dirname(os.path.abspath(ac_diff.__file__)) + os.sep
# Tensor methods that read values into host memory: each one is a device sync when the tensor is on a GPU.
HOST_READS = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


class Router(nn.Module):
    """`depth` linear+gelu steps and a top-k decision (kept values) per step: ops grow with depth."""

    def __init__(self, depth: int, dim: int = 16) -> None:
        super().__init__()
        self.steps = nn.ModuleList(nn.Linear(dim, dim) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin in self.steps:
            x = nn.functional.gelu(lin(x))
            scores, idx = torch.topk(x, k=2, dim=-1)
            x = x + scores.sum(-1, keepdim=True) * 1e-3 + idx.sum(-1, keepdim=True).float() * 1e-4
        return x


class Model(nn.Module):
    def __init__(self, depth: int, layers: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Router(depth) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = cp.checkpoint(layer, x, use_reentrant=False)
        return x


@contextlib.contextmanager
def counting_host_reads():
    """Count value reads made by ac_diff's own code: `to_host` calls, and any other host read (which
    must not happen at all outside the collection at the end of a pass)."""
    counts = {"to_host": 0, "later": 0, "elsewhere": 0, "where": []}
    real_to_host, real_later = fingerprint.to_host, fingerprint.to_host_later

    def to_host(t):
        counts["to_host"] += 1
        return real_to_host(t)

    def to_host_later(t):
        counts["later"] += 1
        return real_later(t)

    originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def spy(name, original):
        def method(self, *args, **kwargs):
            caller = sys._getframe(1)
            code = caller.f_code
            name_ = code.co_name if not code.co_name.startswith("<") else caller.f_back.f_code.co_name
            # reads of what to_host returned (host memory) happen in these functions only
            if code.co_filename.startswith(AC_DIFF_DIR) and name_ not in (
                    "collect", "_decode", "_encode_kept", "_as_numpy", "_encode_array", "encode_values", "decode_values",
                    "rng_digest", "combine"):
                counts["elsewhere"] += 1
                counts["where"].append(f"{code.co_filename}:{caller.f_lineno} {name}")
            return original(self, *args, **kwargs)
        return method

    syncs = {"n": 0}
    real_sync = torch.cuda.synchronize

    def synchronize(*args, **kwargs):
        if sys._getframe(1).f_code.co_filename.startswith(AC_DIFF_DIR):
            syncs["n"] += 1
        return real_sync(*args, **kwargs)

    fingerprint.to_host, fingerprint.to_host_later = to_host, to_host_later
    torch.cuda.synchronize = synchronize
    for name, original in originals.items():
        setattr(torch.Tensor, name, spy(name, original))
    try:
        yield counts
    finally:
        fingerprint.to_host, fingerprint.to_host_later = real_to_host, real_later
        torch.cuda.synchronize = real_sync
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
        counts["elsewhere"] += syncs["n"]


def _recorded_step(depth: int, path) -> tuple[dict, int, int]:
    torch.manual_seed(0)
    model = Model(depth)
    x = torch.randn(8, 16, requires_grad=True)
    with counting_host_reads() as counts:
        with ac_diff.record(path) as rec:
            model(x).sum().backward()
    run = read_run(path)
    passes = sum((r.forward is not None) + (r.recompute is not None) for r in run.regions)
    return counts, passes, rec.ops_recorded


@pytest.fixture
def device_path(monkeypatch):
    """CPU tensors reduced one by one, on their device, as CUDA tensors are: the path whose reads are device syncs (CPU
    tensors are held and reduced together, and read on the host at their flush: `test_cpu_flushes_read_per_flush`)."""
    monkeypatch.setattr(fingerprint, "BATCH_CPU", False)


def test_host_reads_are_per_pass_not_per_op(tmp_path, device_path):
    small, passes_small, ops_small = _recorded_step(2, tmp_path / "small.jsonl")
    big, passes_big, ops_big = _recorded_step(10, tmp_path / "big.jsonl")
    assert passes_small == passes_big == 6  # 3 regions, forward + recompute
    assert ops_big >= 4 * ops_small
    # nothing reads values while ops are recorded: no .item()/.tolist()/.cpu() per op or per tensor
    assert small["elsewhere"] == big["elsewhere"] == 0, big["where"][:10]
    # at the end of a pass: ONE read per device (fingerprints of every kind and kept values of every dtype
    # travel in one byte buffer), however many ops, and asynchronous (to_host_later: no sync on a GPU; the pass is
    # written once it has landed)
    assert big["later"] == small["later"] == passes_small
    assert big["to_host"] == small["to_host"] == 0


def test_cpu_flushes_read_per_flush_not_per_op(tmp_path, monkeypatch):
    """CPU tensors are fingerprinted HOLD at a time (or fewer, before an in-place write and at a pass's end), and read on
    the host then (a CPU read waits for no device): two reads per flush, however many tensors it holds."""
    flushes = []
    real = FingerprintBatch._flush
    monkeypatch.setattr(FingerprintBatch, "_flush", lambda self, *parts: flushes.append(1) or real(self, *parts))
    torch.manual_seed(0)
    model = Model(10)
    x = torch.randn(8, 16, requires_grad=True)
    with counting_host_reads() as counts:
        with ac_diff.record(tmp_path / "t.jsonl") as rec:
            model(x).sum().backward()
    reads = [w for w in counts["where"] if "fingerprint.py" in w]
    assert counts["elsewhere"] == len(reads)  # every read outside a pass's collection is a flush's
    assert 0 < len(reads) <= 2 * len(flushes) < rec.ops_recorded / 8
    assert counts["to_host"] == 0


def test_fingerprints_and_kept_values_are_collected_in_one_read_per_group(device_path):
    batch = FingerprintBatch()
    tensors = [torch.randn(5, 3), torch.arange(7), torch.rand(4) > 0.5, torch.randn(2, 2).to(torch.bfloat16)]
    slots = [batch.add(t) for t in tensors * 50]
    kept = [batch.keep(t) for t in tensors * 50]
    with counting_host_reads() as counts:
        fps, values = batch.collect()
    assert counts["elsewhere"] == 0
    assert counts["to_host"] == 1  # fingerprints (floats, ints) and kept values (f32, i64, b8, bf16): one buffer
    assert all(fps[s] is not None for s in slots)
    for t, k in zip(tensors * 50, kept):
        assert decode_values(values[k]) == t.tolist()


@pytest.mark.parametrize("t", [
    torch.randn(3, 4), torch.randn(2, 3).to(torch.bfloat16), torch.randn(5).to(torch.float16),
    torch.randint(-2**40, 2**40, (6,)), torch.randint(0, 8, (4, 2)).to(torch.int32), torch.rand(7) > 0.5,
    torch.tensor(3), torch.tensor(2.5), torch.zeros(0, 3), torch.randn(4, 3).t(),
], ids=lambda t: f"{t.dtype}{list(t.shape)}")
def test_kept_values_round_trip_exactly(t):
    encoded = json.loads(json.dumps(encode_values(t)))
    assert decode_values(encoded) == t.tolist()
    assert decode_values([1, 2, 3]) == [1, 2, 3]  # format 1.0 stored the lists themselves


def test_one_ops_record_per_pass_reads_like_one_record_per_op(tmp_path):
    """The compact "ops" record loads into the same model as format 1.0's "op" records."""
    path = tmp_path / "t.jsonl"
    torch.manual_seed(0)
    with ac_diff.record(path):
        tiny_moe.train(steps=1, args=tiny_moe.ModelArgs(n_layers=1), seq_len=32, log=lambda _: None)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert not [r for r in lines if r["type"] == "op"]
    ops_records = [r for r in lines if r["type"] == "ops"]
    assert len(ops_records) == 2  # one region: forward and recompute

    # the same content as one "op" record per op (format 1.0), written by hand
    old = []
    for r in lines:
        r.pop("crc", None)  # format 1.0 had no checksums
        if r["type"] == "header":
            r["version"] = "1.0"
        if r["type"] != "ops":
            old.append(r)
            continue
        strings, fields = r["strings"], r["fields"]
        for i, row in enumerate(r["rows"]):
            row = row + [None] * (len(fields) - len(row))
            v = dict(zip(fields, row))
            rec = {"type": "op", "region": r["region"], "phase": r["phase"], "attempt": r["attempt"], "i": i,
                   "op": strings[v["op"]], "in": v["in"], "args": v["args"], "out": v["out"],
                   "refs": [{"k": "op", "op": x[1], **({"o": x[2]} if x[2] else {})} if x[0] == "op"
                            else {"k": x[0], "name": x[1], "ext": x[2]} for x in v["refs"]]}
            for key, value in (("module", v["module"]), ("src", v["src"])):
                if value is not None:
                    rec[key] = strings[value]
            for key, value in (("fp", v["fp"]), ("host", v["host"]),
                               ("vals", {k: decode_values(x) for k, x in (v["vals"] or {}).items()} or None)):
                if value is not None:
                    rec[key] = value
            for bit, key in ((1, "cached"), (2, "random"), (4, "discrete"), (8, "derived")):
                if (v["flags"] or 0) & bit:
                    rec[key] = True
            old.append(rec)
    old_path = tmp_path / "old.jsonl"
    old_path.write_text("".join(json.dumps(r) + "\n" for r in old))
    new_run, old_run = read_run(path), read_run(old_path)
    for a, b in zip(new_run.regions, old_run.regions):
        for phase in ("forward", "recompute"):
            assert getattr(a, phase).ops == getattr(b, phase).ops
    assert any(o.values for o in new_run.regions[0].forward.ops)  # topk's kept values came through
    regions = [[{k: v for k, v in r.items() if k != "path"} for r in ac_diff.diagnose([run]).to_json()["regions"]]
               for run in (new_run, old_run)]  # the same report but for the file each came from
    assert regions[0] == regions[1]


def test_the_background_writer_writes_the_same_trace(tmp_path):
    runs = []
    for background in (False, True):
        torch.manual_seed(0)
        path = tmp_path / f"t{background}.jsonl"
        with ac_diff.record(path, writer_thread=background):
            Model(3)(torch.randn(8, 16, requires_grad=True)).sum().backward()
        runs.append(read_run(path))
    a, b = runs
    assert not b.truncated and b.exit_status == "ok"
    for x, y in zip(a.regions, b.regions):
        for phase in ("forward", "recompute"):
            p, q = getattr(x, phase), getattr(y, phase)
            assert p.ops == q.ops and p.positions == q.positions and p.externals == q.externals


def test_the_background_writer_finishes_the_trace_of_a_crash(tmp_path):
    class Boom(nn.Module):
        def forward(self, x):
            x = torch.relu(x * 2)
            raise RuntimeError("boom")

    path = tmp_path / "t.jsonl"
    with pytest.raises(RuntimeError, match="boom"):
        with ac_diff.record(path, writer_thread=True):
            cp.checkpoint(Boom(), torch.randn(4, 4, requires_grad=True), use_reentrant=False)
    run = read_run(path)
    assert not run.truncated and run.exit_status == "exception"
    assert [o.op for o in run.regions[0].forward.ops] == ["aten.mul.Tensor", "aten.relu.default"]


def _moe_run(path, bias_update, write, steps=2):
    with contextlib.suppress(torch.utils.checkpoint.CheckpointError):
        with ac_diff.record(path, write=write):
            tiny_moe.train(steps=steps, bias_update=bias_update, seq_len=64, log=lambda _: None)
    return read_run(path)


def _summary(run):
    report = ac_diff.diagnose([run]).to_json()
    return report["verdict"], [(r["region"], r["status"], (r["first_value_divergence"] or {}).get("op"),
                                (r["first_shape_divergence"] or {}).get("op"), (r["cause"] or {}).get("kind"))
                               for r in report["regions"]]


@pytest.mark.parametrize("bias_update", ["forward_hook", "after_step"])
def test_write_diverged_reports_like_write_all(bias_update, tmp_path):
    everything = _moe_run(tmp_path / "all.jsonl", bias_update, "all")
    diverged = _moe_run(tmp_path / "diverged.jsonl", bias_update, "diverged")
    assert _summary(diverged) == _summary(everything)
    if bias_update == "after_step":  # clean: the second step's regions are summaries without ops
        second_step = [r for r in diverged.regions if r.region >= 2]
        assert second_step and all(not r.forward.ops and not r.recompute.ops for r in second_step)
        assert all(r.ops_written is False for r in second_step)
        assert all(r.forward.state["n_ops"] > 0 for r in second_step)
        assert os.path.getsize(tmp_path / "diverged.jsonl") < 0.7 * os.path.getsize(tmp_path / "all.jsonl")
    else:  # the diverging region is written in full
        failing = ac_diff.diagnose([diverged]).to_json()["regions"]
        region = next(r for r in failing if r["status"] == "diverged")
        assert next(r for r in diverged.regions if r.region == region["region"]).forward.ops


def test_the_default_trace_grows_with_what_diverged_not_with_the_steps(tmp_path):
    """Clean training: the first region of each module is written in full (a sample), every later one as a
    summary of about 1 KB (a distributed run's summaries also keep the parameters they read: test_distributed)."""
    sizes = {}
    for steps in (2, 6):
        path = tmp_path / f"{steps}.jsonl"
        with ac_diff.record(path):  # the default policy
            tiny_moe.train(steps=steps, seq_len=64, log=lambda _: None)
        sizes[steps] = os.path.getsize(path)
    run = read_run(path)
    full = [r.region for r in run.regions if r.forward.ops]
    assert full == [0, 1]  # layers.0 and layers.1 of the first step
    assert all(r.ops_written is False and not r.recompute.ops for r in run.regions[2:])
    assert not run.regions[5].forward.externals and not run.regions[5].recompute.externals
    per_region = (sizes[6] - sizes[2]) / 8
    assert per_region < 1500, per_region  # (2,300 bytes of ops per pass under write="all")
    assert ac_diff.diagnose([run]).verdict == "clean"


def test_a_recompute_that_stops_before_the_last_linear_still_counts_as_a_reproduction(tmp_path):
    """A block ending in a linear with a bias: torch's early stop skips that last addmm, so the recompute never
    reads the bias. That is no difference: clean regions are summarized, not written in full every step (a
    stranger's clean 2000-step run wrote 20 MB)."""
    torch.manual_seed(0)
    blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16)) for _ in range(2))
    path = tmp_path / "t.jsonl"
    with ac_diff.record(path):
        for _ in range(4):
            x = torch.randn(4, 16)
            for block in blocks:
                x = cp.checkpoint(block, x, use_reentrant=False)
            x.pow(2).mean().backward()
    run = read_run(path)
    assert {r.region for r in run.regions if r.forward.ops} <= {0, 1}  # the first step's: a sample
    assert all(r.ops_written is False for r in run.regions[2:])
    assert ac_diff.diagnose([run]).verdict == "clean"


class Counted(nn.Module):
    """A block whose forward pre-hook counts its calls: the recompute bumps the counter again, no op differs."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.calls = 0
        self.register_forward_pre_hook(lambda m, args: setattr(m, "calls", m.calls + 1))

    def forward(self, x):
        return torch.relu(self.lin(x))


def test_a_module_attribute_the_recompute_changes_again_is_a_side_effect(tmp_path):
    """Equal ops are not enough: a Python attribute the recompute changes again (a call counter) is a side effect, as a
    counter tensor's in-place update is: the first region of its module is written in full, so the report names it
    as write="all" does (the verdict, the headline's note, that region's side effects); the later ones, which only
    repeat it, are summaries (a long watched run of such blocks wrote every resample whole)."""
    reports, runs = {}, {}
    for write in ("all", "diverged"):
        torch.manual_seed(0)
        block = Counted()
        path = tmp_path / f"{write}.jsonl"
        with ac_diff.record(path, write=write, keep_clean=0):
            for _ in range(3):
                cp.checkpoint(block, torch.randn(4, 16, requires_grad=True), use_reentrant=False).sum().backward()
        runs[write] = read_run(path)
        reports[write] = ac_diff.diagnose([runs[write]])
    assert [bool(r.forward.ops) for r in runs["diverged"].regions] == [True, False, False]
    full, summarized = reports["all"], reports["diverged"]
    assert full.verdict == summarized.verdict == "clean"
    assert full.headline == summarized.headline and "repeats the updates of Counted.calls" in full.headline
    assert full.regions[0].side_effects == summarized.regions[0].side_effects != []


def test_write_diverged_over_its_memory_bound_writes_the_held_forwards(tmp_path):
    torch.manual_seed(0)
    path = tmp_path / "t.jsonl"
    with ac_diff.record(path, write="diverged", hold_bytes=0):
        Model(2)(torch.randn(8, 16, requires_grad=True)).sum().backward()
    run = read_run(path)
    # every forward went to disk at once, so its recompute is written in full too
    assert all(r.forward.ops and r.recompute.ops for r in run.regions)
    assert ac_diff.diagnose([run]).verdict == "clean"


def test_write_diverged_keeps_forwards_that_were_never_recomputed(tmp_path):
    torch.manual_seed(0)
    model = Model(2)
    path = tmp_path / "t.jsonl"
    with ac_diff.record(path, write="diverged"):
        model(torch.randn(8, 16, requires_grad=True))  # no backward: no recompute
    run = read_run(path)
    assert len(run.regions) == 3 and all(r.forward.ops and r.recompute is None for r in run.regions)


def test_regions_past_max_regions_are_listed_without_dispatching_to_the_recorder(tmp_path):
    torch.manual_seed(0)
    path = tmp_path / "t.jsonl"
    with ac_diff.record(path, max_regions=1) as rec:
        Model(2)(torch.randn(8, 16, requires_grad=True)).sum().backward()
    run = read_run(path)
    assert [r.recorded for r in run.regions] == [True, False, False]
    first = run.regions[0]
    assert rec.ops_recorded == len(first.forward.ops) + len(first.recompute.ops) > 0
    assert rec.ops_outside == 0  # the recording mode was never on the stack in regions 1 and 2
    for r in run.regions[1:]:  # listed with their passes and positions, but no ops and no op count
        assert r.forward.ops == [] and op_count(r.forward) == 0 and r.recompute is not None
        assert r.forward.state["n_ops"] is None


def test_the_collector_threshold_is_raised_only_while_passes_are_recorded(tmp_path):
    import gc

    seen = []

    class Probe(nn.Module):
        def forward(self, x):
            seen.append(gc.get_threshold())
            return torch.relu(x * 2)

    before = gc.get_threshold()
    with ac_diff.record(tmp_path / "t.jsonl"):
        seen.append(gc.get_threshold())
        cp.checkpoint(Probe(), torch.randn(4, 4, requires_grad=True), use_reentrant=False).sum().backward()
        seen.append(gc.get_threshold())
    assert gc.get_threshold() == before
    outside, forward, recompute, after = seen
    assert outside == after == before
    assert forward[0] == recompute[0] > before[0] and forward[1:] == before[1:]


def test_a_threshold_the_user_set_is_left_alone(tmp_path):
    import gc

    before = gc.get_threshold()
    try:
        gc.set_threshold(1_000_000, 10, 10)
        with ac_diff.record(tmp_path / "t.jsonl"):
            cp.checkpoint(lambda x: torch.relu(x * 2), torch.randn(4, 4, requires_grad=True),
                          use_reentrant=False).sum().backward()
            assert gc.get_threshold() == (1_000_000, 10, 10)
    finally:
        gc.set_threshold(*before)
