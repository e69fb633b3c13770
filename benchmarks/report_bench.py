"""Throughput and memory of `ac-diff report` on a large generated trace (not a test).

Builds a trace of about --mb MB from a real one: its header, then its region, ops and pass records
repeated with the region numbers (and parents) shifted past the last copy's, each line re-encoded with
its checksum as the recorder writes it, then its end record. Each code path (this checkout, and every
--baseline checkout) then runs in its own process on that file, in two stages: `read` (read_run as
`ac-diff report` reads: lazily where the checkout can) and `report` (diagnose_paths + the JSON report). Printed per path and stage: trace MB/s, CPU
seconds, peak RSS and its growth over the process's peak before the stage (after the imports).

    PYTHONPATH=. python benchmarks/report_bench.py --source ac-diff-out/trace-rank0.jsonl --mb 500
    PYTHONPATH=. python benchmarks/report_bench.py --source T --mb 100 --baseline /path/to/old/checkout

Without --source it records examples/moe_bias_update_fixed.py for --steps steps first (minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# One stage in a fresh process: prints {"cpu_s", "rss_growth_mb", "regions"} as JSON.
STAGE = r"""
import inspect, json, os, resource, sys, time
from ac_diff.api import diagnose_paths
from ac_diff.trace import read_run
import ac_diff.diagnosis, ac_diff.report  # imports are not the trace's cost
lazy = "lazy" in inspect.signature(read_run).parameters  # what `ac-diff report` reads with (older: eagerly)
before = resource.getrusage(resource.RUSAGE_SELF)
t0 = time.process_time()
if sys.argv[2] == "read":
    n = len((read_run(sys.argv[1], lazy=True) if lazy else read_run(sys.argv[1])).regions)
else:
    report = diagnose_paths([sys.argv[1]])
    n = len(report.regions)
    from ac_diff.render import RENDERERS  # the JSON report as `--json FILE` writes it (older checkouts: whole)
    with open(os.devnull, "w") as out:
        json_renderer = RENDERERS["json"]
        out.writelines(json_renderer.chunks(report) if hasattr(json_renderer, "chunks") else [json_renderer.render(report)])
after = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"cpu_s": time.process_time() - t0, "regions": n,
                  "rss_growth_mb": (after.ru_maxrss - before.ru_maxrss) / 1024, "peak_rss_mb": after.ru_maxrss / 1024}))
"""


def build_trace(source: Path, target_mb: float, out: Path) -> int:
    """Write the generated trace; returns the number of copies of the source's regions."""
    from ac_diff.trace import decode_line, with_crc

    import orjson

    lines = source.read_bytes().splitlines()
    header, body = lines[0], [decode_line(line) for line in lines[1:] if line.strip()]
    for rec in body:
        rec.pop("crc", None)
    end = [rec for rec in body if rec.get("type") == "end"]
    regional = [rec for rec in body if rec.get("type") in ("region", "ops", "op", "pass")]
    span = 1 + max(rec["region"] for rec in regional)
    unit = sum(len(line) for line in lines[1:])
    copies = max(1, round(target_mb * 1e6 / unit))
    with open(out, "wb") as f:
        f.write(header + b"\n")
        for copy in range(copies):
            shift = copy * span
            for rec in regional:
                rec = dict(rec, region=rec["region"] + shift)
                if isinstance(rec.get("parent"), int):
                    rec["parent"] += shift
                f.write(with_crc(orjson.dumps(rec)) + b"\n")
        for rec in end:
            f.write(with_crc(orjson.dumps(rec)) + b"\n")
    return copies


def record(steps: int, out_dir: Path) -> Path:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    subprocess.run([sys.executable, "-m", "ac_diff", "run", "-o", str(out_dir), "--force",
                    "examples/moe_bias_update_fixed.py", "--steps", str(steps)], cwd=REPO, env=env, check=True,
                   stdout=subprocess.DEVNULL)
    return out_dir / "trace-rank0.jsonl"


def stage(checkout: Path, trace: Path, which: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(checkout))
    # cwd: `python -c` puts it first on sys.path, so it must be the checkout measured
    proc = subprocess.run([sys.executable, "-c", STAGE, str(trace), which], cwd=checkout, env=env, text=True,
                          capture_output=True, check=True)
    return json.loads(proc.stdout.splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", type=Path, help="a real trace to replicate (default: record one)")
    ap.add_argument("--steps", type=int, default=20, help="steps to record without --source (default 20)")
    ap.add_argument("--mb", type=float, default=500.0, help="size of the generated trace (default 500)")
    ap.add_argument("--baseline", type=Path, action="append", default=[], help="another checkout to measure too")
    ap.add_argument("--stages", default="read,report", help="read, report or both (default read,report)")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        source = args.source or record(args.steps, tmp / "recorded")
        trace = tmp / "trace-rank0.jsonl"
        copies = build_trace(source, args.mb, trace)
        mb = trace.stat().st_size / 1e6
        print(f"trace: {mb:.1f} MB ({copies} copies of {source})")
        results = []
        for checkout in [REPO, *args.baseline]:
            for which in args.stages.split(","):
                r = stage(checkout, trace, which)
                r.update(checkout=str(checkout), stage=which, trace_mb=mb, mb_per_s=mb / r["cpu_s"])
                results.append(r)
                print(f"{which:7s} {r['mb_per_s']:7.1f} MB/s  {r['cpu_s']:7.1f} s CPU  "
                      f"peak RSS {r['peak_rss_mb']:6.0f} MB (+{r['rss_growth_mb']:.0f} over the imports)  {r['regions']} regions  "
                      f"({checkout})", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
