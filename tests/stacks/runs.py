"""Run several training scripts under `ac-diff run --json` at once (subprocesses), for the stack tests.

    results = run_all(tmp_path, {
        "clean": Job(["script.py", "--flag", "1"]),
        "bad": Job(["-m", "pkg.train", "--steps", "2"], cwd=..., env={"PYTHONPATH": ...}),
    })
    results["bad"].report["verdict"], results["bad"].returncode, results["bad"].trace_dir

Each job runs `python -m ac_diff run -o DIR --json FILE [ac-diff options] TARGET...` (or plain `python`
with `plain=True`) with OMP_NUM_THREADS=1; at most `workers` run at the same time.

    proc, report = fix(tmp_path / "gen", "--max-tries", "2", "script.py")   # `ac-diff fix`, its JSON report
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

STACKS = Path(__file__).resolve().parent


@dataclass
class Job:
    target: list[str]  # the script (or -m module) and its arguments
    options: list[str] = field(default_factory=list)  # ac-diff run options before the target
    cwd: str | os.PathLike | None = None
    env: dict[str, str] = field(default_factory=dict)
    plain: bool = False  # run `python TARGET...` without ac-diff (the script records itself)


@dataclass
class Result:
    name: str
    returncode: int
    stdout: str
    stderr: str
    trace_dir: Path
    report: dict | None

    def explain(self) -> str:
        return f"{self.name}: exit {self.returncode}\n--- stdout\n{self.stdout[-4000:]}\n--- stderr\n{self.stderr[-4000:]}"


def run_all(out: Path, jobs: dict[str, Job], workers: int = 2, timeout: int = 600) -> dict[str, Result]:
    def one(name: str, job: Job) -> Result:
        trace_dir = out / name
        json_path = out / f"{name}.json"
        if job.plain:
            cmd = [sys.executable, *job.target]
        else:
            cmd = [sys.executable, "-m", "ac_diff", "run", "-o", str(trace_dir), "--force", "--json", str(json_path),
                   *job.options, *job.target]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "COLUMNS": "120", **job.env}
        proc = subprocess.run(cmd, cwd=job.cwd, env=env, capture_output=True, text=True, timeout=timeout)
        report = json.loads(json_path.read_text()) if json_path.exists() else None
        return Result(name, proc.returncode, proc.stdout, proc.stderr, trace_dir, report)

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        futures = {name: pool.submit(one, name, job) for name, job in jobs.items()}
        return {name: f.result() for name, f in futures.items()}


def regions_by(report: dict, **match) -> list[dict]:
    return [r for r in report["regions"] if all(r[k] == v for k, v in match.items())]


def fix(out: Path, *args: str, cwd: str | os.PathLike | None = None) -> tuple[subprocess.CompletedProcess, dict]:
    """`python -m ac_diff fix -o OUT --json OUT.json ARGS...` (with `cwd`, the stack scripts importable from it)."""
    json_path = out.parent / f"{out.name}.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "COLUMNS": "160"}
    if cwd is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(STACKS), env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-m", "ac_diff", "fix", "-o", str(out), "--json", str(json_path), *args],
                          capture_output=True, text=True, timeout=600, env=env, cwd=cwd)
    assert json_path.exists(), proc.stderr[-3000:]
    return proc, json.loads(json_path.read_text())
