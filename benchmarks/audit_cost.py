"""What `ac-diff audit` costs against one plain run of the same training, and how --max-regions / --seeds bound it.

    python benchmarks/audit_cost.py --steps 4 --rounds 3

Trains the bundled MoE (examples/tiny_moe.py, 2 blocks, every block checkpointed) for --steps steps in one
process: plain, then under the auditor with several settings, each round in turn from the same seed, and
prints the median wall time of each variant and its ratio to plain.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "examples")]

import tiny_moe  # noqa: E402

from ac_diff.audit import Auditor, AuditSettings, parse_noise  # noqa: E402

VARIANTS = {  # name -> (max_regions, seeds, noise) or None for plain
    "plain": None,
    "audit --max-regions 1 --seeds 1": (1, 1, "1ulp"),
    "audit (defaults: --max-regions 4 --seeds 3)": (4, 3, "1ulp"),
    "audit every region, --seeds 3": (10_000, 3, "1ulp"),
    "audit every region, --seeds 3, --noise realistic": (10_000, 3, "realistic"),
}


def one(variant, steps: int, args) -> float:
    auditor = None
    if variant is not None:
        auditor = Auditor(AuditSettings(parse_noise(variant[2]), seeds=variant[1], max_regions=variant[0])).start()
    start = time.perf_counter()
    try:
        tiny_moe.train(args=args, steps=steps, seed=0, log=lambda s: None, seq_len=256, batch_size=2)
    finally:
        if auditor is not None:
            auditor.stop()
    return time.perf_counter() - start


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    args = tiny_moe.ModelArgs(n_layers=4, dim=128)
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(a.rounds):
        for name, variant in VARIANTS.items():
            times[name].append(one(variant, a.steps, args))
    base = statistics.median(times["plain"])
    regions = a.steps * args.n_layers
    print(f"{args.n_layers}-layer MoE, dim {args.dim}, 512 tokens, {a.steps} steps ({regions} regions), "
          f"median of {a.rounds} rounds")
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"  {name:52s} {m:7.2f} s  {m / base:5.2f}x plain")
    return 0


if __name__ == "__main__":
    sys.exit(main())
