"""`ac-diff compare LOG` end to end on big logs: wall and CPU time, MB/s, peak RSS, lines printed (not a test).

Builds two logs from the real llama4 rank-1 log in tests/data/real_logs (or --logs DIR):

    errors  the CheckpointError of its head (traceback, 12 positions, `[rank1]:` prefixes), repeated:
            200 MB = 45,000 identical errors, the log a job that raised every step leaves behind
    dumps   head + tail (the error, then a `debug=True` dump of both passes' ops), repeated on as many ranks (a
            dump printed again on one rank is one region): one region each

and runs `python -m ac_diff compare LOG` on each in a fresh process (the CLI as a user runs it: interpreter start
and imports included; the `startup` row is `--version` alone), this checkout and, with --baseline REV, the same command on that git revision
(`git archive`d to a temporary directory), side by side with the ratios:

    python benchmarks/compare_bench.py                          # errors 200 MB, dumps 14 MB
    python benchmarks/compare_bench.py --baseline HEAD          # before (HEAD) vs after (the working tree)
    python benchmarks/compare_bench.py --errors-mb 20 --dumps-mb 0

    log          MB    reps  code        wall s   MB/s   CPU s MB/s CPU  peak RSS MB     lines exit
    startup                  HEAD           3.7            1.8                   227              0
    errors    200.0   45126  HEAD         100.8    2.0    67.7      3.0         1429   631,776    1
    errors    200.0   45126  this          11.1   18.0     7.4     27.1          236        28    1
                            ratio         9.1x           9.2x            6.0x less   22563x fewer lines

Peak RSS is the child's own (wait4), so the figures of one run do not mix.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_LOGS = ROOT / "tests" / "data" / "real_logs"
HEAD_LOG = "torchtitan_llama4_rank1_head.log"
TAIL_LOG = "torchtitan_llama4_rank1_tail.log"
ERROR_LINES = 44  # the head's traceback and CheckpointError, up to "The above exception was the direct cause"


def error_unit(logs: Path) -> bytes:
    """One CheckpointError as the llama4 run printed it (traceback frames, 12 positions, spliced lines)."""
    lines = (logs / HEAD_LOG).read_bytes().split(b"\n")
    return b"\n".join(lines[:ERROR_LINES]) + b"\n"


def dump_unit(logs: Path) -> bytes:
    """The error and a debug=True dump (head + tail of the llama4 log): one region per repetition (on its rank)."""
    return (logs / HEAD_LOG).read_bytes() + b"\n" + (logs / TAIL_LOG).read_bytes() + b"\n"


def build(unit: bytes, target_mb: float, out: Path, per_rank: bool = False) -> int:
    """Write `unit` repeated to about `target_mb` MB (`per_rank`: the i-th repetition as rank i prints it, where the
    unit has rank 1's prefixes); returns the repetitions."""
    n = max(1, round(target_mb * 1e6 / len(unit)))
    with open(out, "wb") as f:
        for i in range(n):
            f.write(unit.replace(b"[rank1]:", b"[rank%d]:" % i) if per_rank else unit)
    return n


@dataclass
class Measured:
    wall: float
    cpu: float
    rss_mb: float
    lines: int
    exit_code: int


def measure(code_dir: Path, args: list[str], out: Path) -> Measured:
    """`python -m ac_diff ARGS` with `code_dir` first on the path, in a fresh process (stdout to `out`)."""
    env = dict(os.environ, PYTHONPATH=str(code_dir), COLUMNS="100")
    with open(out, "wb") as f:
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "ac_diff", *args], stdout=f,
                                stderr=subprocess.DEVNULL, env=env, cwd=code_dir)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    with open(out, "rb") as f:
        lines = sum(1 for _ in f)
    return Measured(wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss * scale / 2**20, lines, proc.returncode)


def checkout(rev: str, into: Path) -> Path:
    """The files of git revision `rev` of this repository, extracted under `into`."""
    target = into / rev.replace("/", "_")
    target.mkdir(parents=True)
    archive = into / "rev.tar"
    subprocess.run(["git", "-C", str(ROOT), "archive", "-o", str(archive), rev], check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(target, filter="data")
    return target


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--errors-mb", type=float, default=200.0, help="size of the repeated-errors log (0: none)")
    ap.add_argument("--dumps-mb", type=float, default=14.0, help="size of the errors-and-dumps log (0: none)")
    ap.add_argument("--baseline", metavar="REV", help="also run this git revision (e.g. HEAD: before the changes)")
    ap.add_argument("--logs", type=Path, default=Path(os.environ.get("AC_DIFF_REAL_LOGS", DEFAULT_LOGS)))
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        tmp_dir = Path(tmp)
        codes = [(args.baseline, checkout(args.baseline, tmp_dir / "code"))] if args.baseline else []
        codes.append(("this", ROOT))
        logs = []
        for name, unit, mb in (("errors", error_unit(args.logs), args.errors_mb),
                               ("dumps", dump_unit(args.logs), args.dumps_mb)):
            if mb > 0:
                path = tmp_dir / f"{name}.log"
                reps = build(unit, mb, path, per_rank=name == "dumps")
                logs.append((name, path, reps))
        print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; python {sys.version.split()[0]}")
        print(f"{'log':<8}{'MB':>7} {'reps':>7}  {'code':<10}{'wall s':>8}{'MB/s':>7}{'CPU s':>8}{'MB/s CPU':>9}"
              f"{'peak RSS MB':>13}{'lines':>10}{'exit':>5}")
        for label, code_dir in codes:  # what every command costs before it reads a byte (python, torch imports)
            m = measure(code_dir, ["--version"], tmp_dir / "version.txt")
            print(f"{'startup':<8}{'':>7} {'':>7}  {label:<10}{m.wall:>8.1f}{'':>7}{m.cpu:>8.1f}{'':>9}{m.rss_mb:>13.0f}"
                  f"{'':>10}{m.exit_code:>5}", flush=True)
        for name, path, reps in logs:
            size = path.stat().st_size / 1e6
            results = []
            for label, code_dir in codes:
                m = measure(code_dir, ["compare", str(path)], tmp_dir / f"{name}-{code_dir.name}.txt")
                results.append(m)
                print(f"{name:<8}{size:>7.1f} {reps:>7}  {label:<10}{m.wall:>8.1f}{size / m.wall:>7.1f}{m.cpu:>8.1f}"
                      f"{size / m.cpu:>9.1f}{m.rss_mb:>13.0f}{m.lines:>10,}{m.exit_code:>5}", flush=True)
            if len(results) == 2:
                before, after = results
                print(f"{'':<24}{'ratio':<10}{before.wall / after.wall:>7.1f}x{'':>7}{before.cpu / after.cpu:>7.1f}x"
                      f"{'':>8}{before.rss_mb / after.rss_mb:>7.1f}x less"
                      f"{before.lines / max(after.lines, 1):>8.0f}x fewer lines")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
