"""Proof that a change left the diagnosis alone: the examples' JSON reports, before and after.

    python scripts/report_identity.py snapshot /tmp/before      # on the old commit
    python scripts/report_identity.py snapshot /tmp/after       # on the new one
    python scripts/report_identity.py diff /tmp/before /tmp/after

`snapshot` runs every bundled example under `ac-diff run --json` (the torchrun one with
`--nproc-per-node 2`), `ac-diff compare` on every bundled log, and `ac-diff report` on a trace, from
this checkout (`python -m ac_diff`, PYTHONPATH = the checkout), and writes one normalised JSON file per
case: timing fields dropped, the checkout's own path, temporary directories and torchrun's random
ports replaced by placeholders. `diff` prints each case that differs (with the first differing JSON paths) and exits 1
if any does, else prints "N cases identical" and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

RUNS = {
    "moe_bias_update": ["examples/moe_bias_update.py"],
    "moe_bias_update_fixed": ["examples/moe_bias_update_fixed.py"],
    "dropout_no_rng": ["examples/dropout_no_rng.py"],
    "python_state_branch": ["examples/python_state_branch.py"],
    "distributed_bias_update": ["--nproc-per-node", "2", "examples/distributed_bias_update.py"],
    "hf_moe": ["tests/stacks/hf_moe.py", "--model", "mixtral"],
    "hf_moe_dropout": ["tests/stacks/hf_moe.py", "--model", "mixtral", "--attention-dropout", "0.1", "--no-preserve-rng"],
    "hf_moe_bias_hook": ["tests/stacks/hf_moe.py", "--model", "deepseek_v3", "--bias-update", "forward_hook"],
    "titanlike": ["-m", "tests.stacks.titanlike.train"],
}
# Keys whose values are measured times or sizes of this machine, not diagnosis.
TIMING_KEY = re.compile(r"(^|_)(time|times|seconds|wall|wall_s|elapsed|duration|rss|peak_rss|.*_s)$")

# torchrun's rendezvous port is random: a peer's "Connection closed by peer [127.0.0.1]:40160" is not diagnosis.
# A report cuts such a message at a fixed length, so the port's digit count moves the cut: drop what follows.
EPHEMERAL_PORT = re.compile(r"(\[[\d.]+\]|localhost|127\.0\.0\.1):(\d{2,5}\b|<port>).*", re.S)


def normalise(value, placeholders: dict[str, str]):
    if isinstance(value, dict):
        return {k: normalise(v, placeholders) for k, v in value.items() if not TIMING_KEY.search(k)}
    if isinstance(value, list):
        return [normalise(v, placeholders) for v in value]
    if isinstance(value, str):
        for real, name in placeholders.items():
            value = value.replace(real, name)
        return EPHEMERAL_PORT.sub(r"\1:<port>...", value)
    return value


def snapshot(dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    cases: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        for name, target in RUNS.items():
            cases[f"run-{name}"] = ["run", "-o", str(tmp / name), "--force", "--json", str(tmp / "report.json"), *target]
        for log in sorted((REPO / "sample_logs").glob("*.log")) + sorted((REPO / "tests/data/real_logs").glob("*.log")):
            cases[f"compare-{log.stem}"] = ["compare", "--format", "json", str(log.relative_to(REPO))]
        cases["report-moe_bias_update"] = ["report", "--format", "json", str(tmp / "moe_bias_update")]
        placeholders = {str(tmp): "<tmp>", str(REPO): "<repo>", REPO.name + "/": "<repo>/"}
        env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONHASHSEED="0")
        for name, args in cases.items():
            (tmp / "report.json").unlink(missing_ok=True)
            proc = subprocess.run([sys.executable, "-m", "ac_diff", *args], cwd=REPO, env=env, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=900)
            if "--json" in args:
                path = tmp / "report.json"
                text = path.read_text() if path.exists() else "null"
            else:
                text = proc.stdout
            try:
                data = json.loads(text)
            except ValueError:
                data = {"not_json": text[-2000:], "stderr": proc.stderr[-2000:]}
            out = {"exit_code": proc.returncode, "report": normalise(data, placeholders)}
            (dest / f"{name}.json").write_text(json.dumps(out, indent=1, sort_keys=True))
            print(f"{name}: exit {proc.returncode}", flush=True)


def first_differences(a, b, path: str = "", limit: int = 5) -> list[str]:
    if type(a) is not type(b):
        return [f"{path or '/'}: {str(a)[:80]} != {str(b)[:80]}"]
    if isinstance(a, dict):
        found = []
        for key in sorted(set(a) | set(b)):
            if key not in a or key not in b:
                found.append(f"{path}/{key}: only in {'after' if key not in a else 'before'}")
            else:
                found += first_differences(a[key], b[key], f"{path}/{key}", limit)
            if len(found) >= limit:
                break
        return found[:limit]
    if isinstance(a, list):
        if len(a) != len(b):
            return [f"{path}: {len(a)} items != {len(b)}"]
        found = []
        for i, (x, y) in enumerate(zip(a, b)):
            found += first_differences(x, y, f"{path}[{i}]", limit)
            if len(found) >= limit:
                break
        return found[:limit]
    return [] if a == b else [f"{path}: {str(a)[:80]} != {str(b)[:80]}"]


def diff(before: Path, after: Path) -> int:
    names = sorted({p.name for p in before.glob("*.json")} | {p.name for p in after.glob("*.json")})
    differing = 0
    for name in names:
        a, b = before / name, after / name
        if not a.exists() or not b.exists():
            print(f"{name}: only in {'after' if not a.exists() else 'before'}")
            differing += 1
            continue
        # normalised again: a snapshot taken by an older version of this script is compared by today's rules
        found = first_differences(normalise(json.loads(a.read_text()), {}), normalise(json.loads(b.read_text()), {}))
        if found:
            differing += 1
            print(f"{name}:")
            for line in found:
                print(f"  {line}")
    if differing:
        print(f"{differing} of {len(names)} cases differ")
        return 1
    print(f"{len(names)} cases identical")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    snap = sub.add_parser("snapshot")
    snap.add_argument("dest", type=Path)
    cmp_ = sub.add_parser("diff")
    cmp_.add_argument("before", type=Path)
    cmp_.add_argument("after", type=Path)
    args = parser.parse_args()
    if args.command == "snapshot":
        snapshot(args.dest)
        return 0
    return diff(args.before, args.after)


if __name__ == "__main__":
    sys.exit(main())
