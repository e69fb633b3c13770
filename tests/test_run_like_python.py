"""`ac-diff run` behaves like `python` for the script: __name__, argv, sys.path[0], exit codes, -m."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

import ac_diff
from conftest import run_cli

PROBE = textwrap.dedent("""
    import json, os, sys
    print("PROBE " + json.dumps({"name": __name__, "argv": sys.argv, "path0": sys.path[0], "file": __file__}))
    mode = os.environ.get("PROBE_MODE", "ok")
    if mode == "exit3":
        sys.exit(3)
    if mode == "raise":
        raise ValueError("boom from the script")
    if mode == "exit_msg":
        sys.exit("fatal: a message")
""")


def _probe(output: str) -> dict:
    line = next(l for l in output.splitlines() if l.startswith("PROBE "))
    return json.loads(line[len("PROBE "):])


@pytest.fixture()
def script(tmp_path):
    path = tmp_path / "scripts" / "probe.py"
    path.parent.mkdir()
    path.write_text(PROBE)
    return path


def test_a_script_given_by_a_relative_path_sees_what_python_gives_it(script, tmp_path):
    """python makes the main script's `__file__` absolute (3.9+) and keeps argv[0] as typed: a script that finds
    its files from `__file__` and then changes directory (as Hydra does) works the same under ac-diff."""
    relative = str(script.relative_to(tmp_path))
    plain = subprocess.run([sys.executable, relative], capture_output=True, text=True, cwd=tmp_path)
    ours = run_cli("run", "-o", str(tmp_path / "out"), relative, cwd=tmp_path)
    assert _probe(ours.stdout) == _probe(plain.stdout) and _probe(plain.stdout)["file"] == str(script)


@pytest.mark.parametrize("mode,code", [("ok", 0), ("exit3", 3), ("raise", 1), ("exit_msg", 1)])
def test_matches_python(script, tmp_path, mode, code):
    env = {"PROBE_MODE": mode}
    plain = subprocess.run([sys.executable, str(script), "--lr", "3", "-o", "x"], capture_output=True, text=True,
                           env={**__import__("os").environ, **env}, cwd=tmp_path)
    ours = run_cli("run", "-o", str(tmp_path / "out"), str(script), "--lr", "3", "-o", "x", cwd=tmp_path, env=env)
    assert plain.returncode == code
    assert ours.returncode == code, ours.stderr
    assert _probe(ours.stdout) == _probe(plain.stdout)
    if mode == "raise":
        assert "ValueError: boom from the script" in ours.stderr
        assert "ac_diff" not in ours.stderr.split("ValueError")[0].replace("ac_diff run", "")
    if mode == "exit_msg":
        assert "fatal: a message" in ours.stderr
    trace = ac_diff.load(tmp_path / "out")  # always finished, whatever the script did
    assert trace.runs[0].exit_status == {"ok": "ok", "exit3": "exit", "raise": "exception",
                                         "exit_msg": "exit"}[mode]  # sys.exit() is an exit, not a crash
    assert not trace.runs[0].truncated


def test_module_mode_matches_python_dash_m(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text(PROBE)
    plain = subprocess.run([sys.executable, "-m", "pkg.train", "--flag", "v"], capture_output=True, text=True,
                           cwd=tmp_path)
    ours = run_cli("run", "-o", str(tmp_path / "out"), "-m", "pkg.train", "--flag", "v", cwd=tmp_path)
    assert ours.returncode == 0, ours.stderr
    assert _probe(ours.stdout) == _probe(plain.stdout)


def test_a_package_without_main_is_one_line_and_exit_2(tmp_path):
    """35c P3-8: `-m pkg` whose package has no __main__ ran, printed runpy's traceback, wrote a trace that checked
    nothing and exited 1; as a module not found: one line naming the fix, exit 2, no trace. With a __main__ it runs."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text(PROBE)
    proc = run_cli("run", "-o", str(tmp_path / "out"), "-m", "pkg", cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "a package without a __main__ module" in proc.stderr and "-m pkg.train" in proc.stderr
    assert not (tmp_path / "out").exists()
    (pkg / "__main__.py").write_text(PROBE)
    assert run_cli("run", "-o", str(tmp_path / "out"), "-m", "pkg", cwd=tmp_path).returncode == 0


def test_existing_trace_needs_force(script, tmp_path):
    out = tmp_path / "out"
    assert run_cli("run", "-o", str(out), str(script), cwd=tmp_path).returncode == 0
    again = run_cli("run", "-o", str(out), str(script), cwd=tmp_path)
    assert again.returncode == 2
    assert "--force" in again.stderr and "Traceback" not in again.stderr
    assert run_cli("run", "--force", "-o", str(out), str(script), cwd=tmp_path).returncode == 0


def test_missing_script_is_one_line(tmp_path):
    proc = run_cli("run", "-o", str(tmp_path / "o"), str(tmp_path / "nope.py"), cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "not found" in proc.stderr
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "trace-rank0.jsonl").write_text("")  # an earlier run's trace: still the missing script
    proc = run_cli("run", "-o", str(tmp_path / "o"), str(tmp_path / "nope.py"), cwd=tmp_path)
    assert proc.returncode == 2 and "not found" in proc.stderr


def test_crashed_run_leaves_a_loadable_trace(tmp_path):
    """A real CheckpointError mid-backward: the trace is finished and says what crashed."""
    from conftest import EXAMPLES

    proc = run_cli("run", "-o", str(tmp_path / "out"), str(EXAMPLES / "moe_bias_update.py"), "--steps", "1",
                   cwd=tmp_path)
    assert proc.returncode == 1
    assert "CheckpointError" in proc.stderr
    trace = ac_diff.load(tmp_path / "out")
    assert trace.runs[0].exc_type == "CheckpointError"
    assert len(trace.regions) == 2 and (trace.regions.recompute_ops > 0).sum() == 1


def test_killed_process_leaves_readable_trace(tmp_path):
    """SIGKILL after some regions: what was flushed is readable, and the loader warns it is truncated."""
    script = tmp_path / "killed.py"
    script.write_text(textwrap.dedent("""
        import os, signal, torch
        import torch.utils.checkpoint as cp
        lin = torch.nn.Linear(4, 4)
        x = torch.randn(2, 4, requires_grad=True)
        for _ in range(3):
            cp.checkpoint(lin, x, use_reentrant=False).sum().backward()
        os.kill(os.getpid(), signal.SIGKILL)
    """))
    proc = run_cli("run", "-o", str(tmp_path / "out"), str(script), cwd=tmp_path)
    assert proc.returncode != 0
    with pytest.warns(RuntimeWarning, match="truncated"):
        trace = ac_diff.load(tmp_path / "out")
    assert len(trace.regions) == 3
    assert (trace.regions.recompute_ops > 0).all()
    # never clean: what ran after the last record was never checked (the report said CLEAN, `--check` exit 0)
    report = run_cli("report", "--check", str(tmp_path / "out"), "--json", str(tmp_path / "r.json"), cwd=tmp_path)
    assert report.returncode == 4, report.stdout + report.stderr
    headline = json.loads((tmp_path / "r.json").read_text())["headline"]
    assert "CUT SHORT" in report.stdout and "ends without its end record: the process was killed" in headline
    assert "3 region(s) checked clean before its last record" in headline, headline


_CHDIR_TRAIN = """
import os, sys, torch
from torch.utils.checkpoint import checkpoint

run_dir = sys.argv[sys.argv.index("--run-dir") + 1]
os.makedirs(run_dir, exist_ok=True)
os.chdir(run_dir)  # as Hydra and many trainers do
torch.manual_seed(0)
lin = torch.nn.Linear(4, 4)
for _ in range(2):
    x = torch.randn(2, 4, requires_grad=True)
    (checkpoint(lin, x, use_reentrant=False) if os.environ.get("NOAC") is None else lin(x)).sum().backward()
"""


def test_the_reference_starts_where_the_run_started_not_where_the_script_moved(tmp_path):
    """`-m pkg.train --run-dir runs/a` chdirs into runs/a: the reference without AC (a child started after the script
    ran in this process) started there, could not import pkg, and the report said the script "fails without AC
    too"."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text(_CHDIR_TRAIN)
    proc = run_cli("run", "-o", str(tmp_path / "out"), "--reference", "no-ac", "--format", "json", "-m", "pkg.train",
                   "--run-dir", "runs/a", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    reference = json.loads(proc.stdout)["reference"]
    assert reference["verdict"] == "identical", reference
    assert (tmp_path / "runs" / "a").is_dir() and not (tmp_path / "runs" / "a" / "runs").exists()


DIVERGES_THEN_EXITS = """
import sys, torch
from torch.utils.checkpoint import checkpoint

torch.manual_seed(0)
layer = torch.nn.Linear(8, 8)
x = torch.randn(4, 8, requires_grad=True)
# dropout without its RNG state: the recompute draws another mask (silently)
y = checkpoint(lambda t: torch.nn.functional.dropout(layer(t), 0.5), x, use_reentrant=False, preserve_rng_state=False)
y.sum().backward()
sys.exit(3)   # the script's own failure code (a failed validation, say)
"""


def test_a_diverged_run_the_script_then_ended_with_an_exit_code_says_so(tmp_path):
    """The report of a diverged run said nothing of how the script ended afterwards (only `exit_status`: "exit"); the
    JSON now carries the exit code and the report a note."""
    script = tmp_path / "diverges_then_exits.py"
    script.write_text(DIVERGES_THEN_EXITS)
    json_path = tmp_path / "r.json"
    proc = run_cli("run", "-o", str(tmp_path / "out"), "--json", str(json_path), str(script))
    assert proc.returncode == 3, proc.stderr[-2000:]
    report = json.loads(json_path.read_text())
    assert report["verdict"] == "diverged" and (report["exit_status"], report["exit_code"]) == ("exit", 3)
    assert any(n.startswith("the script failed") and "exit code 3" in n for n in report["notes"]), report["notes"]
