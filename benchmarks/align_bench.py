"""Benchmark ac_diff.align on realistic op-key sequences (not a test).

Usage::

    python benchmarks/align_bench.py [--json FILE] [--sizes 1000,10000,100000,1000000]

Sequences are ``(aten op, module name)`` keys produced by walking a MoE
transformer: 64 layers (the layer index cycles, so long sequences repeat every
key many times, the hard case for unique-key anchoring), attention + router +
a data-dependent subset of 8 experts per layer, each module emitting a fixed
pattern drawn from ~40 aten ops with repeats (view/reshape/...).  The
recompute sequence is generated again from scratch (fresh, equal tuples, not
the same objects) and then edited:

* identical        - no change
* prefix60         - early stop: the recompute is the first 60% of the forward
* prefix60+5       - early stop plus 5 substitutions before the stop point
* few(5)           - 5 insertions, 5 deletions and 5 substitutions
* heavy(5%)        - 5% of the positions edited (insert/delete/substitute)

Timing is ``time.perf_counter``; the median of several runs for small sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time



def _load_align():
    """Load ac_diff/align.py by path: it is dependency-free, and this skips the
    package ``__init__`` (which imports torch and friends)."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "ac_diff", "align.py")
    spec = importlib.util.spec_from_file_location("ac_diff_align_bench", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses looks the module up while building Pair
    spec.loader.exec_module(mod)
    return mod


_align = _load_align()
align, summarize = _align.align, _align.summarize

ATEN_OPS = [
    "aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.view.default",
    "aten._unsafe_view.default", "aten.reshape.default", "aten.t.default", "aten.transpose.int",
    "aten.permute.default", "aten.expand.default", "aten.clone.default", "aten.contiguous.default",
    "aten.add.Tensor", "aten.mul.Tensor", "aten.div.Tensor", "aten.sub.Tensor", "aten.neg.default",
    "aten.pow.Tensor_Scalar", "aten.rsqrt.default", "aten.mean.dim", "aten.sum.dim_IntList",
    "aten._softmax.default", "aten.topk.default", "aten.sort.default", "aten.gather.default",
    "aten.scatter_add.default", "aten.index_select.default", "aten.index.Tensor", "aten.cat.default",
    "aten.split.Tensor", "aten.slice.Tensor", "aten.unsqueeze.default", "aten.squeeze.dim",
    "aten.silu.default", "aten.gelu.default", "aten.sigmoid.default", "aten.where.self",
    "aten._to_copy.default", "aten.bincount.default", "aten.cumsum.default",
]  # 40 ops

N_LAYERS = 64
N_EXPERTS = 8


def _module_patterns(seed: int = 1234) -> dict[str, list[str]]:
    rng = random.Random(seed)
    kinds = [
        "input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
        "self_attn.rotary_emb", "self_attn", "self_attn.o_proj", "post_attention_layernorm",
        "moe.router.gate", "moe.router", "moe.dispatch", "moe.experts.w1", "moe.experts.w3",
        "moe.experts.act", "moe.experts.w2", "moe.combine",
    ]
    pats = {}
    for kind in kinds:
        n = rng.randint(2, 9)
        ops = [rng.choice(ATEN_OPS) for _ in range(n)]
        # views/reshapes around the compute op, as traces usually show
        ops = ["aten.view.default"] + ops + ["aten.view.default"]
        pats[kind] = ops
    return pats


PATTERNS = _module_patterns()


def make_sequence(n_ops: int, seed: int = 0) -> list[tuple[str, str]]:
    """Deterministic op-key sequence of exactly ``n_ops`` keys (fresh objects each call)."""
    rng = random.Random(seed)
    out: list[tuple[str, str]] = []
    step = 0
    while len(out) < n_ops:
        layer = step % N_LAYERS
        step += 1
        p = f"layers.{layer}"
        mods = [
            "input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
            "self_attn.rotary_emb", "self_attn", "self_attn.o_proj", "post_attention_layernorm",
            "moe.router.gate", "moe.router", "moe.dispatch",
        ]
        for kind in mods:
            name = f"{p}.{kind}"
            out.extend((op, name) for op in PATTERNS[kind])
        for e in sorted(rng.sample(range(N_EXPERTS), 2)):  # top-2 routing
            for kind in ("moe.experts.w1", "moe.experts.w3", "moe.experts.act", "moe.experts.w2"):
                name = f"{p}.moe.experts.{e}.{kind.rsplit('.', 1)[1]}"
                out.extend((op, name) for op in PATTERNS[kind])
        out.extend((op, f"{p}.moe.combine") for op in PATTERNS["moe.combine"])
    del out[n_ops:]
    return out


def random_key(rng: random.Random) -> tuple[str, str]:
    return (rng.choice(ATEN_OPS), f"layers.{rng.randrange(N_LAYERS)}.moe.experts.{rng.randrange(N_EXPERTS)}.w1")


def apply_edits(b: list, n_ins: int, n_del: int, n_sub: int, rng: random.Random, limit: int | None = None) -> list:
    """Apply random edits; positions drawn in [0, limit). Done in one pass (O(n))."""
    limit = len(b) if limit is None else limit
    ops: dict[int, list[str]] = {}
    for kind, k in (("ins", n_ins), ("del", n_del), ("sub", n_sub)):
        for pos in rng.sample(range(limit), k):
            ops.setdefault(pos, []).append(kind)
    out = []
    for i, key in enumerate(b):
        kinds = ops.get(i)
        if not kinds:
            out.append(key)
            continue
        if "ins" in kinds:
            out.append(random_key(rng))
        if "del" in kinds:
            continue
        out.append(random_key(rng) if "sub" in kinds else key)
    return out


def build_case(case: str, n: int) -> tuple[list, list]:
    a = make_sequence(n)
    b = make_sequence(n)  # equal keys, distinct objects
    rng = random.Random(n)
    if case == "identical":
        pass
    elif case == "prefix60":
        del b[int(n * 0.6) :]
    elif case == "prefix60+5":
        del b[int(n * 0.6) :]
        b = apply_edits(b, 0, 0, 5, rng)
    elif case == "few(5)":
        b = apply_edits(b, 5, 5, 5, rng)
    elif case == "heavy(5%)":
        k = max(1, n // 60)  # 3 kinds x n/60 = 5% of positions
        b = apply_edits(b, k, k, k, rng)
    else:
        raise ValueError(case)
    return a, b


CASES = ["identical", "prefix60", "prefix60+5", "few(5)", "heavy(5%)"]


def repeats_for(n: int) -> int:
    return 7 if n <= 10_000 else 3 if n <= 100_000 else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    ap.add_argument("--sizes", default="1000,10000,100000,1000000")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--max-edit", type=int, default=2000)
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    cases = args.cases.split(",")

    rows = []
    hdr = (
        f"{'size':>9} {'case':<12} {'runs':>4} {'seconds':>9} {'cpu_s':>8} {'ops/s':>12}"
        f" {'match':>9} {'subst':>7} {'fwd_only':>9} {'rec_only':>9}"
    )
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"python {platform.python_version()} on {platform.machine()}, {os.cpu_count()} cpus,"
        f" load avg {load:.1f}, max_edit={args.max_edit}"
    )
    print(hdr)
    print("-" * len(hdr))
    for n in sizes:
        for case in cases:
            a, b = build_case(case, n)
            times = []
            cpu = []
            pairs = None
            for _ in range(repeats_for(n)):
                pairs = None
                c0 = time.process_time()
                t0 = time.perf_counter()
                pairs = align(a, b, max_edit=args.max_edit)
                times.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
            sec = statistics.median(times)
            cpu_sec = statistics.median(cpu)
            s = summarize(pairs)
            ops = (len(a) + len(b)) / sec if sec > 0 else float("inf")
            row = dict(
                size=n, case=case, len_a=len(a), len_b=len(b), runs=len(times),
                seconds=sec, cpu_seconds=cpu_sec, ops_per_s=ops, **s,
            )
            rows.append(row)
            print(
                f"{n:>9} {case:<12} {len(times):>4} {sec:>9.4f} {cpu_sec:>8.4f} {ops:>12,.0f}"
                f" {s['match']:>9} {s['substituted']:>7}"
                f" {s['forward_only']:>9} {s['recompute_only']:>9}",
                flush=True,
            )
            del pairs, a, b
    print("seconds: wall time (perf_counter, median); cpu_s: process CPU time;"
          " ops/s: (len(a) + len(b)) per wall second.")
    if args.json:
        with open(args.json, "w") as f:
            meta = {
                "python": platform.python_version(), "cpus": os.cpu_count(),
                "load_avg": load, "max_edit": args.max_edit,
            }
            json.dump({**meta, "results": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
