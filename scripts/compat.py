"""Proof of which torch releases ac-diff supports: one row of the version x feature table per run.

    python scripts/compat.py 2.7.1                 # venv /work/venvs/torch-2.7.1: tests + demo -> compat/torch-2.7.1.json
    python scripts/compat.py 2.4.1 --logs          # also write its CheckpointError / debug=True logs to tests/data/logs/
    python scripts/compat.py --table               # compat/*.json -> the markdown table (the README's support table)

For VERSION it builds a venv (`--venvs DIR`, default /work/venvs; deleted afterwards unless `--keep`), installs
torch==VERSION (the registry's build; an empty PIP_CONSTRAINT lifts the machine's cap on torch) and the project,
runs the internals-sensitive tests (INTERNALS) and `ac-diff demo --json`, and writes one JSON row: torch version,
each FEATURE as "yes" (all its tests passed), "NO" (one failed) or "n/a" (torch lacks it: skipped, with the
reason), the demo's diagnosis (layer, first value/decision/shape divergence, cause, positions mapped), the
warnings ac-diff and torch printed, and the test counts. `--subset` only runs the tests and prints the summary
(CI). Exit 0 when every test passed and the demo ran, else 1.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# The tests that rest on torch's checkpoint internals (or on the text torch prints).
INTERNALS = ["tests/test_positions_match_torch.py", "tests/test_recorder_variants.py", "tests/test_bit_identical.py",
             "tests/test_nested_regions.py", "tests/test_torch_versions.py", "tests/test_compare_logs.py",
             "tests/test_logs_units.py", "tests/test_remedies.py", "tests/test_later_recomputes.py",
             "tests/test_branch_causes.py", "tests/test_held_elsewhere.py"]

# feature -> pytest node ids (substrings) whose outcome decides it
FEATURES = {
    "regions seen": ["test_each_variant_records_both_passes_of_every_region[non_reentrant]",
                     "test_checkpoint_wrapper_names_strip_the_wrapper", "test_module_fqns_are_right_during_recompute"],
    "positions mapped": ["test_torch_positions_map_to_ops_with_the_saved_shape"],
    "SAC": ["test_each_variant_records_both_passes_of_every_region[sac]",
            "test_gradients_bit_identical_with_and_without_recorder[sac]", "test_sac_"],
    "reentrant": ["test_each_variant_records_both_passes_of_every_region[reentrant]",
                  "test_reentrant_recompute_aligns_a_clone_the_forward_also_made"],
    "nested": ["test_nested_regions.py", "test_nested_regions_have_parents"],
    "early stop": ["test_each_variant_records_both_passes_of_every_region[early_stop_off]",
                   "test_region_options_are_recorded"],
    "debug=True logs": ["test_compare_logs.py", "test_torch_metadata_error", "test_torch_dump", "test_stored_logs_"],
    "bit-identical grads": ["test_bit_identical.py"],
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("version", nargs="?", help="torch release, e.g. 2.4.1")
    ap.add_argument("--venvs", default="/work/venvs", help="where the venv goes (default /work/venvs)")
    ap.add_argument("--keep", action="store_true", help="keep the venv afterwards")
    ap.add_argument("--out", default=str(REPO / "compat"), help="where the JSON rows go (default compat/)")
    ap.add_argument("--subset", action="store_true", help="CI: only the internals-sensitive tests, no row")
    ap.add_argument("--logs", action="store_true", help="also write this release's logs to tests/data/logs/")
    ap.add_argument("--table", action="store_true", help="print the markdown table of the rows in --out")
    args = ap.parse_args(argv)
    if args.table:
        print(table(Path(args.out)))
        return 0
    if not args.version:
        ap.error("give a torch version (e.g. 2.4.1) or --table")
    venv = Path(args.venvs) / f"torch-{args.version}"
    try:
        python = build_venv(venv, args.version)
        tests = run_tests(python, args.version)
        if args.subset:
            print(f"compat: torch {args.version}: {tests['counts']}" + (f"\n{tests['pytest_tail']}" if not tests["ok"] else ""))
            return 0 if tests["ok"] else 1
        commit = _run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"]).stdout.strip()
        if _run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no", "--", ".", ":!compat"]).stdout:
            commit += "-dirty"  # code that is not committed (the rows themselves do not count)
        row = {"torch": torch_version(python), "python": sys.version.split()[0], "date": time.strftime("%Y-%m-%d"),
               "commit": commit,
               **tests, "demo": run_demo(python)}
        if args.logs:
            row["logs"] = write_logs(python, row["torch"])
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"torch-{args.version}.json").write_text(json.dumps(row, indent=1) + "\n")
        print(table_rows([row]))
        return 0 if tests["ok"] and row["demo"]["exit_code"] == 0 else 1
    finally:
        if not args.keep and venv.exists():
            shutil.rmtree(venv)


def _run(cmd: list, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], text=True, capture_output=True, **kwargs)


def build_venv(venv: Path, version: str) -> Path:
    python = venv / "bin" / "python"
    env = {**os.environ, "PIP_CONSTRAINT": "", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    if not python.exists():
        _check(_run([sys.executable, "-m", "venv", venv]), "venv")
    if _run([python, "-c", f"import torch; assert torch.__version__.split('+')[0] == {version!r}"]).returncode:
        # the registry's build (CUDA for most releases; it runs on CPU); pip's cache keeps the download
        _check(_run([python, "-m", "pip", "install", "-q", f"torch=={version}"], env=env), f"torch=={version}")
    _check(_run([python, "-m", "pip", "install", "-q", "-e", REPO, "pytest", "pytest-xdist", "hypothesis"], env=env),
           "the project")
    return python


def _check(proc: subprocess.CompletedProcess, what: str) -> None:
    if proc.returncode:
        sys.exit(f"compat: installing {what} failed:\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}")


def torch_version(python: Path) -> str:
    return _run([python, "-c", "import torch; print(torch.__version__)"]).stdout.strip()


def _env() -> dict:
    # the repository's code, whatever else is installed; one thread per process (2 workers)
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def run_tests(python: Path, version: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        proc = _run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadfile",
                     f"--junitxml={xml}", *INTERNALS], cwd=REPO, env=_env())
        cases = _cases(xml) if xml.exists() else {}
    counts = {k: sum(1 for v in cases.values() if v[0] == k) for k in ("passed", "failed", "skipped")}
    features = {}
    for feature, patterns in FEATURES.items():
        hit = [v for name, v in cases.items() if any(p in name for p in patterns)]
        if not hit:
            features[feature] = "NO (no test ran)"
        elif any(v[0] == "failed" for v in hit):
            features[feature] = "NO"
        elif all(v[0] == "skipped" for v in hit):
            features[feature] = "n/a: " + hit[0][1]
        else:
            features[feature] = "yes"
    failed = sorted(name for name, v in cases.items() if v[0] == "failed")
    return {"features": features, "counts": counts, "failed": failed,
            "ok": proc.returncode == 0 and counts["passed"] > 0,
            "pytest_tail": "" if proc.returncode == 0 else proc.stdout[-3000:]}


def _cases(xml: Path) -> dict[str, tuple[str, str]]:
    cases = {}
    for case in ET.parse(xml).iter("testcase"):
        name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        outcome, reason = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
            elif child.tag == "skipped" and outcome != "failed":
                outcome, reason = "skipped", (child.get("message") or "").strip()
        cases[name] = (outcome, reason)
    return cases


def run_demo(python: Path) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        proc = _run([python, "-m", "ac_diff", "demo", "-o", Path(tmp) / "demo", "--json", report], cwd=tmp, env=_env())
        result = {"exit_code": proc.returncode,
                  "warnings": [line for line in proc.stderr.splitlines() if re.search(r"Warning|warning:", line)]}
        if proc.returncode or not report.exists():
            result["stderr"] = proc.stderr[-3000:]
            return result
        result.update(diagnosis_signature(json.loads(report.read_text())))
    return result


def diagnosis_signature(report: dict) -> dict:
    """What must be the same on every release: the layer, each first divergence, the cause, the positions."""
    regions = [r for r in report["regions"] if r["status"] == "diverged"]
    sig: dict = {"verdict": report["verdict"], "diverged": [r["module"] for r in regions],
                 "torch_error_positions": (report.get("torch_error") or {}).get("positions")}
    if regions:
        r = regions[0]
        for kind in ("value", "discrete", "shape", "control"):
            d = r[f"first_{kind}_divergence"]
            sig[kind] = d and f"{d['op']} in {d['module']} (fwd #{d['forward_index']} / rec #{d['recompute_index']})"
        sig["cause"] = r["cause"] and f"{r['cause']['kind']}: {r['cause']['tensor']}"
        sig["positions"] = len(r["positions"])
        sig["positions_mapped"] = sum(1 for p in r["positions"] if p["op"])
        sig["positions_differ"] = sum(1 for p in r["positions"] if not p["matches"])
    return sig


def write_logs(python: Path, version: str) -> list[str]:
    """This release's own CheckpointError text and debug=True dump of the bundled MoE example (real mechanism:
    the router's bias updated between forward and backward), and what the dropout example, whose divergence torch
    does not see, prints to stderr, as tests/data/logs/torch-VERSION/*."""
    out = REPO / "tests" / "data" / "logs" / f"torch-{version.split('+')[0]}"
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, script, extra in [
            ("moe_bias_update_error.log", "moe_bias_update.py", []),
            ("moe_bias_update_debug.log", "moe_bias_update.py", ["--debug", "--layers", "1", "--experts", "2",
                                                                 "--top-k", "1"]),
            ("dropout_no_rng_silent.log", "dropout_no_rng.py", [])]:  # (a silent divergence: no error to read)
        proc = _run([python, f"examples/{script}", *extra], cwd=REPO, env=_env())
        if not proc.stderr.strip():  # (a release that prints nothing about it: no log to keep)
            continue
        path = out / name
        if name.endswith("debug.log"):  # ~2.5 MB of stack frames: kept gzipped (the parser reads .gz)
            import gzip
            path = path.with_suffix(".log.gz")
            with gzip.open(path, "wt", compresslevel=9) as f:
                f.write(proc.stderr)
        else:
            path.write_text(proc.stderr)
        written.append(f"{path.relative_to(REPO)} (exit {proc.returncode})")
    return written


def table_rows(rows: list[dict]) -> str:
    lines = []
    for row in sorted(rows, key=_release):
        demo = row["demo"]
        demo_cell = (f"{demo.get('verdict')}: {', '.join(demo.get('diverged', []))}; {demo.get('cause')}; "
                     f"{demo.get('positions_mapped')}/{demo.get('positions')} positions mapped"
                     if demo["exit_code"] == 0 else f"exit {demo['exit_code']}")
        c = row["counts"]
        cells = [v.split(":")[0] for v in row["features"].values()]  # "n/a: reason" -> "n/a" (the reason is in the row)
        lines.append(f"| {row['torch']} | " + " | ".join(cells)
                     + f" | {demo_cell} | {c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped |")
    return "\n".join(lines)


def _release(row: dict) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", row["torch"].split("+")[0])]


def table(out: Path) -> str:
    rows = sorted((json.loads(p.read_text()) for p in out.glob("torch-*.json")), key=_release)
    head = "| torch | " + " | ".join(FEATURES) + " | `ac-diff demo` | internals tests |"
    sep = "|" + " --- |" * (len(FEATURES) + 3)
    lines = [head, sep, table_rows(rows)]
    # the demo's whole diagnosis, compared with the first row's
    if rows:
        base = rows[0]["demo"]
        same = [r["torch"] for r in rows if _comparable(r["demo"]) == _comparable(base)]
        other = [r["torch"] for r in rows if r["torch"] not in same]
        lines.append("")
        lines.append(f"Same demo diagnosis (layer, first value/decision/shape divergence with op indices, cause, "
                     f"positions) on: {', '.join(same)}" + (f"; different on: {', '.join(other)}" if other else "."))
    return "\n".join(lines)


def _comparable(demo: dict) -> dict:
    return {k: v for k, v in demo.items() if k not in ("warnings", "exit_code", "stderr")}


if __name__ == "__main__":
    sys.exit(main())
