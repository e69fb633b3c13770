"""Does `ac-diff audit` predict the flips that real recompute noise causes? Two real CPU mechanisms.

    python benchmarks/audit_calibration.py --seeds 4 --steps 4 --json calibration.json

1. The MoE load-balancing bias (examples/moe_bias_update.py): the broken example moves `expert_bias` between
   the forward and the recompute. Observed: rows whose topk indices differ between a block's forward and its
   real recompute (checkpoint with determinism_check="none", so training goes on for many steps), and the
   size of that bias change. Predicted: the audit of the fixed example (examples/moe_bias_update_fixed.py)
   with `--noise abs:SIGMA`, SIGMA = the rms of the observed bias change.
2. Batch layout: the router's gate computed one token at a time (a gemv) instead of in one matmul sums in
   another order, so its logits differ in the last bits. Observed: rows whose topk indices differ between
   the two layouts, in the fixed example's own training. Predicted: the audit with `--noise realistic`
   (u * sqrt(K) * |a_i * b_j|_2 at the gate's matmul).

Also: the audit's wall time against one plain run of the same training. Rates are per routed row (token);
the spread is the standard deviation over seeds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "examples")]

import tiny_moe  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

from ac_diff.audit import Auditor, AuditSettings, parse_noise  # noqa: E402


class _NoCheck(torch.nn.Module):
    """Non-reentrant checkpoint without torch's metadata check, so a run whose recompute differs keeps training."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        return checkpoint(self.block, x, use_reentrant=False, determinism_check="none")


ARGS = tiny_moe.ModelArgs()
BATCH = {"batch_size": 2, "seq_len": 128}


def _build(seed: int, wrap) -> tiny_moe.Transformer:
    torch.manual_seed(seed)
    model = tiny_moe.Transformer(ARGS)
    for name, block in list(model.layers.named_children()):
        model.layers.register_module(name, wrap(block))
    return model


def observe_bias(seed: int, steps: int) -> dict:
    """The broken example's real mechanism: topk rows that differ between forward and recompute, and the bias change."""
    model = _build(seed, _NoCheck)
    pairs: list = []  # (forward's bias, forward's indices, recompute's bias, recompute's indices) per router call
    last: dict = {}

    def post(router, args, out):
        bias, chosen = args[1].clone(), out[1].clone()
        if torch._C._current_graph_task_id() == -1:
            last[router] = (bias, chosen)  # the original forward
        elif router in last:
            pairs.append((*last.pop(router), bias, chosen))  # its recompute in backward

    for moe in model.moe_layers():
        moe.router.register_forward_hook(post)
        moe.register_forward_hook(lambda mod, inputs, output: tiny_moe.update_expert_bias(mod))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(steps):  # tiny_moe.train's loop; a recompute whose shapes changed fails in its backward
        inputs, labels = tiny_moe.make_batch(model.args, step, seed=seed, **BATCH)
        loss = tiny_moe.loss_fn(model(inputs), labels)
        try:
            loss.backward()
            optimizer.step()
        except RuntimeError:  # the flip reached a matmul's shapes: what CheckpointError would have said first
            pass
        optimizer.zero_grad()
        last.clear()
    flips = sum(int((f != r).any(dim=-1).sum()) for _, f, _, r in pairs)
    rows = sum(f.shape[0] for _, f, _, _ in pairs)
    deltas = [(rb - fb).pow(2).mean().sqrt().item() for fb, _, rb, _ in pairs]
    return {"rate": flips / rows, "flips": flips, "rows": rows, "recomputes": len(pairs),
            "bias_change_rms": statistics.fmean(deltas)}


def observe_layout(seed: int, steps: int) -> dict:
    """The fixed example's routers, their gate computed per token (gemv) instead of in one matmul."""
    model = tiny_moe.build_model(ARGS, seed=seed, ac_mode="checkpoint")
    stats = {"flips": 0, "rows": 0, "diff": []}

    def post(router, args, out):
        if torch._C._current_graph_task_id() != -1:  # the recompute in backward repeats the forward: count once
            return
        x = args[0].detach()
        with torch.no_grad():
            one = torch.cat([router.gate(x[i:i + 1]) for i in range(x.shape[0])])
            logits = router.gate(x)
            alt = router.route(one, args[1] if len(args) > 1 else None)[1]
        stats["flips"] += int((alt != out[1]).any(dim=-1).sum())
        stats["rows"] += out[1].shape[0]
        stats["diff"].append((one - logits).double().pow(2).mean().sqrt().item())

    for moe in model.moe_layers():
        moe.router.register_forward_hook(post)
    tiny_moe.train(model=model, steps=steps, seed=seed, bias_update="after_step", log=lambda s: None, **BATCH)
    return {"rate": stats["flips"] / max(stats["rows"], 1), "flips": stats["flips"], "rows": stats["rows"],
            "logit_change_rms": statistics.fmean(stats["diff"]) if stats["diff"] else None}


def predict(seed: int, steps: int, noise: str, audit_seeds: int, max_regions: int = 10_000) -> dict:
    """The audit of the fixed example's training: P(flip) per row of every topk site, pooled over regions."""
    auditor = Auditor(AuditSettings(parse_noise(noise), seeds=audit_seeds, max_regions=max_regions, probe=False)).start()
    start = time.perf_counter()
    try:
        tiny_moe.train(args=ARGS, steps=steps, seed=seed, bias_update="after_step", ac_mode="checkpoint",
                       log=lambda s: None, **BATCH)
    finally:
        auditor.stop()
    wall = time.perf_counter() - start
    sites = [s for s in auditor.sites.values() if s.kind == "chooser"]
    flips = sum(sum(s.flips) for s in sites)
    rows = sum(s.rows * len(s.flips) for s in sites)
    model = sum(s.model_flips for s in sites)
    sigma = [x for s in sites for x in s.score_noise]
    return {"rate": flips / rows, "model_rate": model / rows, "flips": flips, "rows": rows, "wall": wall,
            "audit_seconds": auditor.audit_seconds, "score_noise_rms": statistics.fmean(sigma) if sigma else None}


def plain(seed: int, steps: int) -> float:
    start = time.perf_counter()
    tiny_moe.train(args=ARGS, steps=steps, seed=seed, bias_update="after_step", ac_mode="checkpoint",
                   log=lambda s: None, **BATCH)
    return time.perf_counter() - start


def _spread(values: list[float]) -> str:
    return f"{statistics.fmean(values):.3g} ± {statistics.stdev(values) if len(values) > 1 else 0:.2g}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=4)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--audit-seeds", type=int, default=3)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--mechanisms", default="bias,layout")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    global ARGS
    ARGS = tiny_moe.ModelArgs(num_experts=a.experts, top_k=a.top_k)
    BATCH.update(batch_size=a.batch_size, seq_len=a.seq_len)
    mechanisms = a.mechanisms.split(",")
    torch.set_num_threads(1)
    out: dict = {"seeds": a.seeds, "steps": a.steps, "bias": [], "layout": [], "cost": []}
    for seed in range(a.seeds):
        line = f"seed {seed}:"
        if "bias" in mechanisms:
            real = observe_bias(seed, a.steps)
            pred = predict(seed, a.steps, f"abs:{real['bias_change_rms']:.3g}", a.audit_seeds)
            out["bias"].append({"observed": real, "predicted": pred})
            line += (f" bias observed {real['rate']:.4f} ({real['flips']}/{real['rows']}, |dbias| "
                     f"{real['bias_change_rms']:.2g}) predicted {pred['rate']:.4f} (model {pred['model_rate']:.4f});")
        if "layout" in mechanisms:
            real2 = observe_layout(seed, a.steps)
            pred2 = predict(seed, a.steps, "realistic", a.audit_seeds)
            out["layout"].append({"observed": real2, "predicted": pred2})
            line += (f" layout observed {real2['rate']:.2e} ({real2['flips']}/{real2['rows']}, |dlogit| "
                     f"{real2['logit_change_rms']:.2g}) predicted {pred2['rate']:.2e} (model {pred2['model_rate']:.2e}, "
                     f"|dscore| {pred2['score_noise_rms']:.2g})")
            out["cost"].append({"plain": plain(seed, a.steps), "audit": pred2["wall"], "replays": pred2["audit_seconds"]})
        print(line, flush=True)
    for name in mechanisms:
        obs = [r["observed"]["rate"] for r in out[name]]
        pre = [r["predicted"]["rate"] for r in out[name]]
        mod = [r["predicted"]["model_rate"] for r in out[name]]
        print(f"{name}: observed {_spread(obs)}  predicted (perturbation) {_spread(pre)}  predicted (margin model) "
              f"{_spread(mod)}  per row")
    ratio = [c["audit"] / c["plain"] for c in out["cost"]]
    if ratio:
        print(f"cost: audit run / plain run {_spread(ratio)} (all regions replayed, {a.audit_seeds} seeds)")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
