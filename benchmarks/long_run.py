"""Trace size and peak memory of long runs, side by side with the plain run (not a test).

Usage::

    python benchmarks/long_run.py [--steps 100,1000] [--write-all-steps 100] [--json FILE]

For each step count it runs the fixed MoE example (`examples/moe_bias_update_fixed.py`: clean, 2 checkpointed
regions per step) three ways, each in its own process: plain `python`, `ac-diff run` with the defaults
(`write: diverged`: diverged regions and a sample in full, a summary of every other one) and, for the step counts
in `--write-all-steps`, `ac-diff run --write all`. It prints the trace size, the bytes per region, the peak RSS
of the process (its ru_maxrss, from wait4) and that peak minus the plain run's:

     steps  variant     trace MB  bytes/region  peak RSS MB  vs plain MB
       100  plain              -             -          324           +0
       100  default         0.43          2154          351          +27
       100  write all      19.39         96970          537         +212
      1000  plain              -             -          327           +0
      1000  default         2.58          1292          359          +32

(2 CPU cores, torch 2.13; the default's first two regions are written in full, as the sample.)

The claim it checks: the trace grows with the regions that diverged (here none), not with the steps, and the
run's peak RSS stays within a fixed margin of the plain run's whatever the number of steps.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "moe_bias_update_fixed.py"
REGIONS_PER_STEP = 2


def _run(cmd: list[str]) -> tuple[int, float]:
    """(exit code, peak RSS in MB) of one child process."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    return os.waitstatus_to_exitcode(status), usage.ru_maxrss / 1024


def measure(steps: int, variant: str, out: Path) -> dict:
    if variant == "plain":
        cmd = [sys.executable, str(EXAMPLE), "--steps", str(steps)]
    else:
        cmd = [sys.executable, "-m", "ac_diff", "run", "-o", str(out), "--force",
               *(["--write", "all"] if variant == "write all" else []), str(EXAMPLE), "--steps", str(steps)]
    code, rss = _run(cmd)
    trace = out / "trace-rank0.jsonl"
    size = trace.stat().st_size if variant != "plain" and trace.exists() else None
    return {"steps": steps, "variant": variant, "exit_code": code, "trace_bytes": size,
            "bytes_per_region": size / (steps * REGIONS_PER_STEP) if size else None, "peak_rss_mb": rss}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", default="100,1000", help="step counts (comma-separated)")
    ap.add_argument("--write-all-steps", default="100", help="step counts also run with --write all")
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args(argv)
    write_all = {int(s) for s in args.write_all_steps.split(",") if s}
    rows = []
    print(f"{'steps':>6}  {'variant':<10} {'trace MB':>9} {'bytes/region':>13} {'peak RSS MB':>12} {'vs plain MB':>12}")
    with tempfile.TemporaryDirectory() as tmp:
        for steps in (int(s) for s in args.steps.split(",")):
            plain = None
            for variant in ("plain", "default", *(["write all"] if steps in write_all else [])):
                row = measure(steps, variant, Path(tmp) / f"{steps}-{variant.replace(' ', '_')}")
                plain = row["peak_rss_mb"] if variant == "plain" else plain
                row["rss_over_plain_mb"] = row["peak_rss_mb"] - plain
                rows.append(row)
                size = f"{row['trace_bytes'] / 1e6:.2f}" if row["trace_bytes"] else "-"
                per = f"{row['bytes_per_region']:.0f}" if row["bytes_per_region"] else "-"
                print(f"{steps:>6}  {variant:<10} {size:>9} {per:>13} {row['peak_rss_mb']:>12.0f} "
                      f"{row['rss_over_plain_mb']:>+12.0f}" + ("" if row["exit_code"] == 0 else f"  exit {row['exit_code']}"),
                      flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0 if all(r["exit_code"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
