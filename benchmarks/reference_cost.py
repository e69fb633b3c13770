"""What `ac-diff run --reference no-ac` costs: wall time and peak memory, side by side in one run.

    python benchmarks/reference_cost.py [--steps 3] [--rounds 3] [-- SCRIPT ARGS...]

Runs the script (default: the bundled MoE, examples/moe_bias_update_fixed.py) three ways, each round in
turn, each in a fresh process: plain `python`, `ac-diff run`, `ac-diff run --reference no-ac`; prints the
median wall time, its ratio to plain, each variant's peak RSS (the largest process of the variant: the
run, or the reference), and the size of the gradient captures it writes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_MEASURE = """
import json, resource, subprocess, sys, time
t = time.perf_counter()
code = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode
print(json.dumps({"wall": time.perf_counter() - t, "code": code,
                  "maxrss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))
"""


def measure(cmd: list[str], env: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", _MEASURE, *cmd], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("script", nargs="*")
    a = p.parse_args()
    script = a.script or [str(REPO / "examples" / "moe_bias_update_fixed.py"), "--steps", str(a.steps)]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONPATH": str(REPO)}
    tmp = Path(tempfile.mkdtemp())
    variants = {
        "plain": [sys.executable, *script],
        "ac-diff run": [sys.executable, "-m", "ac_diff", "run", "--force", "-o", str(tmp / "run"), *script],
        "ac-diff run --reference no-ac": [sys.executable, "-m", "ac_diff", "run", "--force", "-o", str(tmp / "ref"),
                                          "--reference", "no-ac", *script],
    }
    results: dict[str, list[dict]] = {k: [] for k in variants}
    for _ in range(a.rounds):
        for name, cmd in variants.items():
            results[name].append(measure(cmd, env))
    base = statistics.median(r["wall"] for r in results["plain"])
    print(f"{' '.join(Path(script[0]).name.split()) } {' '.join(script[1:])}: median of {a.rounds} rounds")
    print(f"{'variant':32} {'wall s':>8} {'vs plain':>9} {'peak RSS MB':>12}")
    for name, rs in results.items():
        wall = statistics.median(r["wall"] for r in rs)
        print(f"{name:32} {wall:8.2f} {wall / base:8.2f}x {max(r['maxrss_mb'] for r in rs):12.0f}")
    captured = sorted(tmp.glob("ref/**/grads-rank*.pt"))
    print("gradient captures: " + ", ".join(f"{c.relative_to(tmp)} {c.stat().st_size / 1e6:.1f} MB" for c in captured))


if __name__ == "__main__":
    main()
