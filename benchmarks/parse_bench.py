"""Throughput and memory of the log parser on a ~14 MB debug=True log (not a test).

Builds the log by repeating the two real llama4 excerpts (head, then tail: each repetition is a
metadata error followed by a debug dump whose middle is missing, each repetition on a rank of its own)
into a temporary file, parses it, and reports MB/s, tracemalloc peak and the ru_maxrss growth.

    PYTHONPATH=. python benchmarks/parse_bench.py [--mb 14] [--logs DIR] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

from ac_diff.logs import parse_log
from compare_bench import build, dump_unit  # (benchmarks/, the script's folder)

DEFAULT_LOGS = Path(__file__).resolve().parents[1] / "tests" / "data" / "real_logs"


def build_log(logs: Path, target_mb: float, out: Path) -> int:
    return build(dump_unit(logs), target_mb, out, per_rank=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=14.0, help="size of the generated log (default 14)")
    ap.add_argument("--logs", type=Path, default=Path(os.environ.get("AC_DIFF_REAL_LOGS", DEFAULT_LOGS)))
    ap.add_argument("--repeat", type=int, default=3, help="timed parses; the best is reported")
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.log"
        reps = build_log(args.logs, args.mb, path)
        size = path.stat().st_size
        print(f"log: {size / 1e6:.1f} MB ({reps} x head+tail of the llama4 rank1 log); "
              f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")

        best = best_cpu = float("inf")
        for _ in range(args.repeat):
            t0, c0 = time.perf_counter(), time.process_time()
            run = parse_log(path)
            best = min(best, time.perf_counter() - t0)
            best_cpu = min(best_cpu, time.process_time() - c0)
        ops = sum(len(p.ops) for r in run.regions for p in (r.forward, r.recompute) if p is not None)
        print(f"parsed: {len(run.errors)} errors, {len(run.regions)} regions, {ops} ops, "
              f"truncated={run.truncated}")
        print(f"time:   {best:.2f} s wall, {best_cpu:.2f} s CPU (best of {args.repeat})  ->  "
              f"{size / 1e6 / best:.1f} MB/s wall, {size / 1e6 / best_cpu:.1f} MB/s CPU")

        del run
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        tracemalloc.start()
        run = parse_log(path)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
        print(f"memory: tracemalloc peak {peak / 2**20:.1f} MiB; ru_maxrss grew {(rss1 - rss0) * scale / 2**20:.1f} MiB "
              f"(input {size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
