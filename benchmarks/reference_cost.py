"""What `ac-diff run --reference no-ac` costs: wall time and peak memory, side by side in one run.

    python benchmarks/reference_cost.py [--steps 3] [--rounds 3] [-- SCRIPT ARGS...]

    python benchmarks/reference_cost.py --big --rounds 1 --before /tmp/ac_diff_before   # 302M parameters, one step

Runs the script (default: the bundled MoE, examples/moe_bias_update_fixed.py; --big: benchmarks/reference_model.py,
302M parameters) three ways, each round in turn, each in a fresh process: plain `python`, `ac-diff run`,
`ac-diff run --reference no-ac`; prints the median wall time, its ratio to plain, each variant's peak RSS (the
largest process of the variant: the run, or the reference) and its ratio to plain, and the size of the gradient
captures it writes. `--before DIR`: also `ac-diff run --reference no-ac` with the ac_diff package copied into DIR
(an earlier version), so before and after are measured side by side in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_MEASURE = """
import json, resource, subprocess, sys, time
t = time.perf_counter()
code = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode
print(json.dumps({"wall": time.perf_counter() - t, "code": code,
                  "maxrss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))
"""


def measure(cmd: list[str], env: dict, cwd: Path) -> dict:
    """Wall time, exit code and peak RSS of `cmd`, run in `cwd` (not the repository: `-m ac_diff` would import the
    repository's package first, whatever PYTHONPATH says)."""
    out = subprocess.run([sys.executable, "-c", _MEASURE, *cmd], env=env, cwd=cwd, capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--big", action="store_true", help="the 302M-parameter model, one step")
    p.add_argument("--before", metavar="DIR", help="a directory holding an earlier ac_diff package")
    p.add_argument("script", nargs="*")
    a = p.parse_args()
    script = a.script or ([str(REPO / "benchmarks" / "reference_model.py"), "--steps", "1"] if a.big else
                          [str(REPO / "examples" / "moe_bias_update_fixed.py"), "--steps", str(a.steps)])
    if Path(script[0]).exists():
        script[0] = str(Path(script[0]).resolve())  # (the variants run in a temporary directory)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONPATH": str(REPO)}
    tmp = Path(tempfile.mkdtemp())
    variants = {
        "plain": [sys.executable, *script],
        "ac-diff run": [sys.executable, "-m", "ac_diff", "run", "--force", "-o", str(tmp / "run"), *script],
        "ac-diff run --reference no-ac": [sys.executable, "-m", "ac_diff", "run", "--force", "-o", str(tmp / "ref"),
                                          "--reference", "no-ac", *script],
    }
    envs = {name: env for name in variants}
    if a.before:
        name = "--reference no-ac (before)"
        variants[name] = [*variants["ac-diff run --reference no-ac"]]
        variants[name][variants[name].index(str(tmp / "ref"))] = str(tmp / "before")
        envs[name] = {**env, "PYTHONPATH": str(Path(a.before).resolve())}
    results: dict[str, list[dict]] = {k: [] for k in variants}
    for _ in range(a.rounds):
        for name, cmd in variants.items():
            results[name].append(measure(cmd, envs[name], tmp))
    base = statistics.median(r["wall"] for r in results["plain"])
    print(f"{' '.join(Path(script[0]).name.split()) } {' '.join(script[1:])}: median of {a.rounds} rounds")
    base_rss = max(r["maxrss_mb"] for r in results["plain"])
    print(f"{'variant':32} {'wall s':>8} {'vs plain':>9} {'peak RSS MB':>12} {'vs plain':>9}")
    for name, rs in results.items():
        wall = statistics.median(r["wall"] for r in rs)
        rss = max(r["maxrss_mb"] for r in rs)
        print(f"{name:32} {wall:8.2f} {wall / base:8.2f}x {rss:12.0f} {rss / base_rss:8.2f}x"
              + ("" if all(r["code"] == 0 for r in rs) else f"  (exit {rs[-1]['code']})"))
    captured = sorted(tmp.glob("ref/**/grads-rank*.pt")) + sorted(tmp.glob("before/**/grads-rank*.pt"))
    print("gradient captures: " + ", ".join(f"{c.relative_to(tmp)} {c.stat().st_size / 1e6:.1f} MB" for c in captured))


if __name__ == "__main__":
    main()
