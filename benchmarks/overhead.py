"""What ac-diff costs per training step, side by side with torch's own tools (not a test).

Usage::

    python benchmarks/overhead.py [--json FILE] [--rounds N] [--models moe,dense] [--dim 256] ...
    python benchmarks/overhead.py --device cuda --dtype bfloat16 --configs gpu,launch    # on a GPU

Two models, both with every transformer block checkpointed (non-reentrant, `checkpoint_wrapper`,
torchtitan's way), trained with AdamW in ONE process:

* moe    the bundled example (`examples/tiny_moe.py`): 4 layers, hidden 256, seq 512, top-2 of 8
         experts (expert FFN 128, tiny_moe's default), batch 2; router + histc + argsort + split;
         the load-balancing bias is updated after the optimizer step;
* dense  the same transformer with a dense SwiGLU FFN of the same active size (top_k * expert FFN).

Variants of the same training step (forward, loss, backward, optimizer step):

* plain        nothing
* floor        a bare pass-through `TorchDispatchMode` (`return func(*args, **kwargs)`) inside every region's
               forward and recompute (checkpoint's `context_fn`): the floor of any Python op recorder
* debug        `torch.utils.checkpoint.set_checkpoint_debug_enabled(True)` (torch's debug=True)
* debugmode    `torch.utils._debug_mode.DebugMode()` + `DebugMode.log_tensor_hashes()` (the whole step)
* meta         ac-diff, metadata only: `RecordOptions(fingerprints=False, keep_values=0)`
* full         ac-diff recording everything (fingerprints, positions, discrete values, source lines) and
               writing every region's ops: `RecordOptions(write="all")`
* default      ac-diff with the defaults (`write="diverged"`): everything is recorded and checked, the ops of
               regions whose recompute did not reproduce the forward are written, plus the first clean region
               of each module; a ~1 KB summary of every other one
* watch        ac-diff watch mode in its steady state: `RecordOptions(watch=True, watch_full_steps=0)`: no dispatch
               mode; each region's saved tensors digested on the device (CUDA: one batched kernel per 64 of them;
               CPU: small ones of one shape share a kernel), compared per pass, read back asynchronously (no host
               sync). Timed as it runs in a long run: the step after `--settle` untimed ones inside the same recorder
               (starting and stopping a recorder, ~1 ms, happens once per run, not per step)
* limit0       ac-diff `RecordOptions(max_regions=0)`: what a step costs in a long run once the first
               `--max-regions N` regions have been recorded (later regions are listed with their saved
               positions; their ops never reach the recorder)

Two configurations, both by default (`--configs`): `large` (the sizes above: CPU kernels are slow enough
that Python overhead hides behind them) and `launch` (`--dim 64 --seq 32 --batch 1 --expert-hidden 64`:
kernels are tiny, the step is bound by how fast Python launches ops, as a GPU step often is). For each
recording variant the table gives µs per recorded op: (its median step time - plain's) / the ops ac-diff
records in one step (the same ops floor's mode sees), beside floor's.

Each ac-diff variant records into a fresh trace file per step (in a temporary directory, deleted
after each round), and the timed step includes starting and finishing the recorder (so writing the
trace is paid for). After `--warmup` rounds, the model and optimizer state is saved, and `--rounds`
rounds run every variant once, in an order rotated each round (round-robin: a load spike on this
machine hits all variants alike), each timed step starting from that saved state with the same batch
(so every timed step does the same work: the same routing, the same expert loads); the table
gives median wall-clock times and their ratio to plain's ("ratio"), the median over rounds of
variant / plain in the same round ("paired": a load spike that slows a whole round cancels out),
and the ratio of median CPU times (this process, all threads). Then, untimed, one more step per variant measures:

* trace bytes per recorded op (file size / ops recorded);
* peak extra RSS over plain: how far resident memory grows during one step (Linux VmHWM, reset
  through /proc/self/clear_refs after `malloc_trim`), torch's CPU tensors included, minus plain's
  growth (mean of two measurements in opposite variant orders; allocator noise is a few MB);
* peak Python heap (tracemalloc, Python objects only: records, dicts, lists; not tensor storage).

* host syncs: on CUDA, the device-to-host synchronisations of one step (torch's sync debug mode, counted on
  the training thread; autograd's backward threads are not seen), and ac-diff's own read-backs (`to_host` calls).
* profile (`--profile`): one more step under torch's profiler (CUDA: kernels launched, their summed device time,
  the host ops with the most self time) and one under cProfile (the Python functions with the most self time).

On a GPU (`--device cuda`): the model stays float32 and `--dtype bfloat16` runs the forward under autocast, as
mixed-precision training does; the step ends with `loss.item()` (a sync), so its wall time includes the GPU's
work. `--configs gpu` is a GPU-bound MoE (dim 2048, 16 experts top-4, 2x4096 tokens, 4 layers).

The machine's load average is printed before and after: other processes make timings noisy.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import gc
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import tracemalloc
from typing import Callable

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils.checkpoint import set_checkpoint_debug_enabled  # noqa: E402

import ac_diff  # noqa: E402
from ac_diff.capture.recorder import RecordOptions  # noqa: E402
import tiny_moe  # noqa: E402


# -- models -----------------------------------------------------------------------------------
class DenseFFN(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class DenseBlock(nn.Module):
    def __init__(self, args: tiny_moe.ModelArgs, hidden: int):
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim)
        self.attention = tiny_moe.Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim)
        self.feed_forward = DenseFFN(args.dim, hidden)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


def build(kind: str, cli) -> tuple[nn.Module, tiny_moe.ModelArgs]:
    args = tiny_moe.ModelArgs(vocab_size=cli.vocab, dim=cli.dim, n_layers=cli.layers, n_heads=cli.heads,
                              num_experts=cli.experts, top_k=cli.top_k, hidden_dim=cli.expert_hidden)
    torch.manual_seed(cli.seed)
    model = tiny_moe.Transformer(args).to(cli.device)
    if kind == "dense":
        for name in list(model.layers.keys()):
            model.layers[name] = DenseBlock(args, cli.top_k * cli.expert_hidden)
    elif kind != "moe":
        raise SystemExit(f"unknown model {kind!r}: use moe or dense")
    return tiny_moe.apply_ac(model, mode="checkpoint_wrapper"), args


def make_step(model: nn.Module, args: tiny_moe.ModelArgs, cli) -> Callable[[int], float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    moes = [m for m in model.modules() if isinstance(m, tiny_moe.MoE)]

    autocast = (functools.partial(torch.autocast, cli.device.split(":")[0], dtype=getattr(torch, cli.dtype))
                if cli.dtype != "float32" else contextlib.nullcontext)

    def step(i: int) -> float:
        inputs, labels = tiny_moe.make_batch(args, i, seed=cli.seed, batch_size=cli.batch, seq_len=cli.seq)
        inputs, labels = inputs.to(cli.device), labels.to(cli.device)
        with autocast():
            loss = tiny_moe.loss_fn(model(inputs), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        for moe in moes:
            tiny_moe.update_expert_bias(moe)
        return loss.item()

    def snapshot() -> Callable[[], None]:
        """Save the model and optimizer state; the function returned puts it back (untimed, before each timed
        step: every timed step then does the same work, same batch, same routing)."""
        saved = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())

        def restore() -> None:
            model.load_state_dict(saved[0])
            optimizer.load_state_dict(saved[1])
        return restore

    step.snapshot = snapshot
    return step


# -- variants ---------------------------------------------------------------------------------
class Variant:
    """How to run one step; `last_trace` is the trace of the last step (ac-diff variants)."""

    def __init__(self, name: str, ctx: Callable[["Variant", str], contextlib.AbstractContextManager],
                 steady: bool = False):
        self.name = name
        self._ctx = ctx
        self.steady = steady  # timed inside a running recorder, after a first step (`_timed_step`)
        self.last_trace: str | None = None
        self.last_ops = 0
        self.model: nn.Module | None = None  # floor: the model whose checkpoint wrappers it patches

    def context(self, tmpdir: str, tag: str):
        return self._ctx(self, os.path.join(tmpdir, f"{self.name}-{tag}.jsonl"))


def _recorder(options: RecordOptions):
    @contextlib.contextmanager
    def ctx(variant: Variant, path: str):
        with ac_diff.record(path, options) as rec:
            yield
        variant.last_trace = path
        variant.last_ops = rec.ops_recorded

    return ctx


def _plain(variant, path):
    return contextlib.nullcontext()


def _debug(variant, path):
    return set_checkpoint_debug_enabled(True)


@contextlib.contextmanager
def _debugmode(variant, path):
    from torch.utils._debug_mode import DebugMode

    with DebugMode() as dm, DebugMode.log_tensor_hashes():
        yield
    variant.last_ops = len(dm.operators)


class _PassThrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _floor_contexts():
    return _PassThrough(), _PassThrough()


@contextlib.contextmanager
def _floor(variant, path):
    # checkpoint_wrapper calls `self.checkpoint_fn(module, ...)`, a partial of checkpoint(): add context_fn to it
    wrappers = [m for m in variant.model.modules() if isinstance(m, CheckpointWrapper)]
    saved = [w.checkpoint_fn for w in wrappers]
    for w in wrappers:
        w.checkpoint_fn = functools.partial(w.checkpoint_fn, context_fn=_floor_contexts)
    try:
        yield
    finally:
        for w, fn in zip(wrappers, saved):
            w.checkpoint_fn = fn


def variants(cli, model: nn.Module) -> list[Variant]:
    fields = RecordOptions.__dataclass_fields__
    floor = Variant("floor", _floor)
    floor.model = model
    out = [Variant("plain", _plain), floor, Variant("debug", _debug), Variant("debugmode", _debugmode),
           Variant("meta", _recorder(RecordOptions(fingerprints=False, keep_values=0))),
           Variant("full", _recorder(RecordOptions(**({"write": "all"} if "write" in fields else {}))))]
    if "write" in fields:
        out.append(Variant("default", _recorder(RecordOptions())))
    out.append(Variant("limit0", _recorder(RecordOptions(max_regions=0))))
    if "watch" in fields:  # steady state: every step watched (a run records its first step in full, once)
        out.append(Variant("watch", _recorder(RecordOptions(watch=True, watch_full_steps=0)), steady=True))
    wanted = cli.variants.split(",") if cli.variants else None
    return [v for v in out if wanted is None or v.name in wanted]


# Variants that run a dispatch mode over exactly the ops of the regions: their cost per op is comparable.
US_PER_OP = ("floor", "meta", "full", "default")
# --configs launch: sizes at which the step is bound by Python launching ops, not by CPU kernels.
CONFIGS = {"large": {}, "launch": {"dim": 64, "seq": 32, "batch": 1, "expert_hidden": 64},
           "gpu": {"dim": 2048, "heads": 16, "experts": 16, "top_k": 4, "expert_hidden": 1024, "seq": 4096,
                   "batch": 2}}


# -- measurement ------------------------------------------------------------------------------
def _proc_status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _settle_memory() -> bool:
    """Free what Python and malloc hold so the next step's RSS growth is its own; reset the peak (VmHWM)."""
    gc.collect()
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss_growth_mb(v: Variant, tmp: str, step) -> float | None:
    if not _settle_memory():
        return None
    base = _proc_status_kb("VmRSS")
    with v.context(tmp, "mem"):
        step(0)
    peak = _proc_status_kb("VmHWM")
    return (peak - base) / 1024 if peak is not None and base is not None else None


def _host_syncs(v: Variant, tmp: str, step) -> dict | None:
    """One untimed step's device-to-host syncs on CUDA: {"cuda": seen on this thread, "ac_diff": to_host calls}."""
    if not torch.cuda.is_available() or not str(next(iter(v.model.parameters())).device).startswith("cuda"):
        return None
    import warnings

    from ac_diff.capture import fingerprint

    calls = [0]
    real = fingerprint.to_host

    def counted(t):
        calls[0] += not t.is_cpu
        return real(t)

    fingerprint.to_host = counted
    torch.cuda.synchronize()
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with v.context(tmp, "syncs"):
                    step(0)
            finally:
                torch.cuda.set_sync_debug_mode(0)
    finally:
        fingerprint.to_host = real
    return {"cuda": sum("synchroniz" in str(w.message) for w in seen), "ac_diff": calls[0]}


def _kernel_profile(v: Variant, tmp: str, step, restore, settle: int) -> dict | None:
    """One untimed step under torch's profiler (--profile): device kernels launched and their summed time, and the
    host's busiest functions (self time). A steady variant is profiled after its settling steps, as it is timed."""
    if not torch.cuda.is_available() or not str(next(iter(v.model.parameters())).device).startswith("cuda"):
        return None
    from torch.profiler import ProfilerActivity, profile

    with v.context(tmp, "prof"):
        if v.steady:
            _settle(lambda: step(0), restore, settle)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step(0)
            torch.cuda.synchronize()
    try:  # the profiler's event fields were renamed across releases: a profile that fails is a note, not a crash
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        ranked = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
        return {"kernels": len(kernels), "gpu_ms": round(sum(e.device_time for e in kernels) / 1e3, 2),
                "host_top": [(e.key, e.count, round(e.self_cpu_time_total / 1e3, 2)) for e in ranked[:8]]}
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"}


def _python_profile(v: Variant, tmp: str, step, restore, settle: int) -> list | None:
    """One untimed step under cProfile (--profile): the Python functions with the most self time, ac-diff's among
    them (where a GPU step's host time goes: the GPU waits for it at every sync)."""
    if v.name == "plain":
        return None
    import cProfile
    import pstats

    prof = cProfile.Profile()
    with v.context(tmp, "cprof"):
        if v.steady:
            _settle(lambda: step(0), restore, settle)
        prof.enable()
        step(0)
        prof.disable()
    stats = pstats.Stats(prof).stats
    ours = [(key, row) for key, row in stats.items() if f"{os.sep}ac_diff{os.sep}" in key[0]]
    ranked = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:10]
    ranked += sorted(ours, key=lambda kv: kv[1][2], reverse=True)[:6]  # ac-diff's own, where they rank lower
    top = [(f"{os.path.basename(f)}:{line}({name})", calls, round(tt * 1e3, 2))
           for (f, line, name), (_, calls, tt, _, _) in dict(ranked).items()]
    return [("ac-diff's Python, all functions", sum(row[1] for _, row in ours),
             round(sum(row[2] for _, row in ours) * 1e3, 2)), *top]


def _settle(run: Callable[[], float], restore, steps: int) -> None:
    """The untimed steps a steady variant runs inside its recorder first (the model state put back after each): a
    module watch escalates after a divergence is recorded in full for a step or more, then watched again."""
    for _ in range(steps):
        run()
        if restore is not None:
            restore()


def _timed_step(v: Variant, tmp: str, tag: str, run: Callable[[], float], restore,
                settle: int = 3) -> tuple[float, float]:
    """(wall, CPU) seconds of one training step of variant `v`: with its recorder's start and finish, or for a steady
    variant inside a running recorder, after `settle` untimed steps there."""
    if not v.steady:
        gc.collect()
        t0, c0 = time.perf_counter(), time.process_time()
        with v.context(tmp, tag):
            run()
        return time.perf_counter() - t0, time.process_time() - c0
    with v.context(tmp, tag):
        _settle(run, restore, settle)
        gc.collect()
        t0, c0 = time.perf_counter(), time.process_time()
        run()
        return time.perf_counter() - t0, time.process_time() - c0


def bench_model(kind: str, cli, out: dict) -> None:
    model, args = build(kind, cli)
    step = make_step(model, args, cli)
    vs = variants(cli, model)
    for v in vs:
        v.model = model
    times: dict[str, list[float]] = {v.name: [] for v in vs}
    cpu: dict[str, list[float]] = {v.name: [] for v in vs}
    paired: dict[str, list[float]] = {v.name: [] for v in vs}  # time / plain's time in the same round
    tmp = tempfile.mkdtemp(prefix="ac-diff-overhead-")
    n = len(vs)
    restore = None
    try:
        for rnd in range(cli.warmup + cli.rounds):
            if rnd == cli.warmup:
                restore = step.snapshot()
            order = vs[rnd % n:] + vs[:rnd % n]
            this: dict[str, float] = {}
            for v in order:
                if restore is not None:
                    restore()
                dt, dc = _timed_step(v, tmp, str(rnd), lambda: step(min(rnd, cli.warmup)), restore,
                                     cli.settle)
                this[v.name] = dt * 1e3
                if rnd >= cli.warmup:
                    times[v.name].append(dt * 1e3)
                    cpu[v.name].append(dc * 1e3)
            if rnd >= cli.warmup and "plain" in this:
                for name, t in this.items():
                    paired[name].append(t / this["plain"])
            for f in os.listdir(tmp):  # this round's traces
                with contextlib.suppress(OSError):
                    os.remove(os.path.join(tmp, f))
            if cli.verbose:
                print(f"  {kind} round {rnd}: " + ", ".join(f"{k} {t:.0f}" for k, t in this.items())
                      + f"  (load {os.getloadavg()[0]:.1f})", file=sys.stderr, flush=True)
        # untimed: trace size and memory, one step per variant and measure
        mem: dict[str, dict] = {}
        for v in vs:
            growth = [_peak_rss_growth_mb(v, tmp, step)]
            gc.collect()
            tracemalloc.start()
            with v.context(tmp, "tm"):
                step(0)
            _, py_peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            size = os.path.getsize(v.last_trace) if v.last_trace and os.path.exists(v.last_trace) else None
            mem[v.name] = {"growth": growth, "py_peak_mb": py_peak / 2**20, "trace_bytes": size, "ops": v.last_ops,
                           "syncs": _host_syncs(v, tmp, step),
                           "profile": _kernel_profile(v, tmp, step, restore, cli.settle) if cli.profile else None,
                           "python": _python_profile(v, tmp, step, restore, cli.settle) if cli.profile else None}
        for v in reversed(vs):  # a second RSS measurement in the other order: allocator state favours neither
            mem[v.name]["growth"].append(_peak_rss_growth_mb(v, tmp, step))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    def growth(name: str) -> float | None:
        g = [x for x in mem[name]["growth"] if x is not None]
        return sum(g) / len(g) if g else None

    plain = statistics.median(times["plain"]) if times.get("plain") else None
    plain_cpu = statistics.median(cpu["plain"]) if cpu.get("plain") else None
    recorded_ops = mem["full"]["ops"] if "full" in mem else None  # the ops inside regions, both passes
    rows = {}
    for v in vs:
        med = statistics.median(times[v.name])
        med_cpu = statistics.median(cpu[v.name])
        m = mem[v.name]
        g, g0 = growth(v.name), growth("plain") if "plain" in mem else None
        rows[v.name] = {
            "median_ms": round(med, 2),
            "ratio": round(med / plain, 3) if plain else None,
            "paired_ratio": round(statistics.median(paired[v.name]), 3) if paired[v.name] else None,
            "min_ms": round(min(times[v.name]), 2), "max_ms": round(max(times[v.name]), 2),
            "cpu_median_ms": round(med_cpu, 2), "cpu_ratio": round(med_cpu / plain_cpu, 3) if plain_cpu else None,
            "ops": m["ops"], "trace_bytes": m["trace_bytes"],
            "us_per_op": (round((med - plain) * 1e3 / recorded_ops, 1)
                          if plain and recorded_ops and v.name in US_PER_OP else None),
            "trace_bytes_per_op": round(m["trace_bytes"] / m["ops"], 1) if m["trace_bytes"] and m["ops"] else None,
            "peak_rss_growth_mb": round(g, 1) if g is not None else None,
            "extra_peak_rss_mb": round(g - g0, 1) if g is not None and g0 is not None else None,
            "py_peak_mb": round(m["py_peak_mb"], 2),
            "host_syncs": m["syncs"], "profile": m["profile"], "python_top": m["python"],
        }
    out[kind] = rows


def print_table(title: str, rows: dict) -> None:
    print(f"\n{title}: median step time of the timed rounds and its ratio to plain's")
    print(f"{'variant':<10} {'median ms':>10} {'ratio':>7} {'paired':>7} {'cpu ratio':>9} {'min..max ms':>15} "
          f"{'µs/op':>6} {'ops':>6} {'trace B/op':>10} {'+RSS MB':>8} {'py heap MB':>10}")
    for name, r in rows.items():
        bpo = f"{r['trace_bytes_per_op']:.0f}" if r["trace_bytes_per_op"] else "-"
        rss = f"{r['extra_peak_rss_mb']:+.1f}" if r["extra_peak_rss_mb"] is not None else "-"
        upo = f"{r['us_per_op']:.1f}" if r["us_per_op"] is not None else "-"
        print(f"{name:<10} {r['median_ms']:>10.1f} {r['ratio']:>6.2f}x {r['paired_ratio']:>6.2f}x "
              f"{r['cpu_ratio']:>8.2f}x {r['min_ms']:>7.0f}..{r['max_ms']:<7.0f} {upo:>6} {r['ops'] or '-':>6} "
              f"{bpo:>10} {rss:>8} {r['py_peak_mb']:>10.2f}")
    syncs = {name: r["host_syncs"] for name, r in rows.items() if r.get("host_syncs")}
    if syncs:
        print("host syncs in one step (CUDA syncs seen on the training thread / ac-diff's read-backs): "
              + ", ".join(f"{name} {s['cuda']}/{s['ac_diff']}" for name, s in syncs.items()))
    for name, r in rows.items():
        if r.get("python_top"):
            print(f"python self time, {name}: "
                  + ", ".join(f"{fn} x{n} {ms:.1f} ms" for fn, n, ms in r["python_top"]))
    profiled = {name: r["profile"] for name, r in rows.items() if r.get("profile")}
    for name, prof in profiled.items():
        if "error" in prof:
            print(f"profile {name}: {prof['error']}")
            continue
        print(f"profile {name}: {prof['kernels']} kernels, {prof['gpu_ms']:.1f} ms of kernel time; host self time: "
              + ", ".join(f"{key} x{n} {ms:.1f} ms" for key, n, ms in prof["host_top"]))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", metavar="FILE", help='write {"config": {"model": {"variant": {"median_ms", "ratio", "us_per_op", ...}}}}')
    p.add_argument("--configs", default="large,launch",
                   help="comma-separated: large (the sizes below), launch (" + ", ".join(
                       f"--{k.replace('_', '-')} {v}" for k, v in CONFIGS["launch"].items()) + "); default %(default)s")
    p.add_argument("--models", default="moe,dense", help="comma-separated: moe, dense (default %(default)s)")
    p.add_argument("--variants", default="", help="comma-separated subset (default: all)")
    p.add_argument("--rounds", type=int, default=9, help="timed rounds (default %(default)s)")
    p.add_argument("--warmup", type=int, default=2, help="untimed warm-up rounds (default %(default)s)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--expert-hidden", type=int, default=128,
                   help="per-expert FFN size, tiny_moe's default (dense FFN: top_k x this)")
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--threads", type=int, default=1,
                   help="torch.set_num_threads; 0: torch's choice (default %(default)s: on a loaded 2-core machine "
                        "two OpenMP threads oversubscribe and step times jump 3-5x at random)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 (default %(default)s)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="float32, or autocast to this dtype (default %(default)s)")
    p.add_argument("--settle", type=int, default=3,
                   help="untimed steps a steady variant (watch) runs in its recorder before the timed one (default "
                        "%(default)s: on a GPU, watch records a module's second step in full, once, to learn which "
                        "saved values full recording never compares)")
    p.add_argument("--profile", action="store_true",
                   help="on CUDA: one more step per variant under torch's profiler (kernels, kernel time, host time)")
    p.add_argument("-v", "--verbose", action="store_true", help="print every round's times to stderr")
    cli = p.parse_args(argv)
    if cli.threads:
        torch.set_num_threads(cli.threads)
    load0 = os.getloadavg()
    t0, c0 = time.perf_counter(), time.process_time()
    print(f"torch {torch.__version__}, python {platform.python_version()}, {os.cpu_count()} CPUs, "
          f"{torch.get_num_threads()} torch threads; load average {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}")
    results: dict = {}
    for config in cli.configs.split(","):
        if config not in CONFIGS:
            raise SystemExit(f"unknown config {config!r}: use " + " or ".join(CONFIGS))
        sized = argparse.Namespace(**{**vars(cli), **CONFIGS[config]})
        print(f"\nconfig {config}: layers {sized.layers}, dim {sized.dim}, heads {sized.heads}, seq {sized.seq}, "
              f"batch {sized.batch}, experts {sized.experts} top-{sized.top_k} (expert FFN {sized.expert_hidden}), "
              f"{sized.warmup} warm-up + {sized.rounds} timed rounds", flush=True)
        results[config] = {}
        for kind in cli.models.split(","):
            bench_model(kind, sized, results[config])
            print_table(f"{config} {kind}", results[config][kind])
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    load1 = os.getloadavg()
    print(f"\nload average after: {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f}; this process used {cpu:.0f} s CPU "
          f"in {wall:.0f} s wall ({cpu / wall:.2f} cores)")
    print("paired: median over rounds of (variant / plain in the same round); cpu ratio: of median CPU times "
          "(all threads of this process: ac-diff's trace writer thread included)")
    print("µs/op: (median - plain's median) / ops ac-diff records in one step (floor: a bare dispatch mode over "
          "the same ops)")
    print("ops: ops recorded in one step (debugmode: ops logged); trace B/op: trace file bytes per recorded op")
    print("+RSS: growth of resident memory during one step (VmHWM after malloc_trim, tensors included; mean of "
          "two), minus plain's; py heap: tracemalloc peak of one step (Python objects only)")
    if cli.json:
        with open(cli.json, "w") as f:
            json.dump(results, f, indent=1)
        print(f"wrote {cli.json}")


if __name__ == "__main__":
    main()
