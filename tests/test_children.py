"""Every process ac-diff starts gets one environment (ac_diff/children.py): the launcher's ranks, the reference, fix."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from ac_diff import children
from ac_diff.children import LAUNCHED_ENV, RUN_ID_ENV, child_command

# what a rank's script can tell about how it was started (the run id's value differs per launch: its presence counts)
RELEVANT = ("OMP_NUM_THREADS", "AC_DIFF_COMPILED", "AC_DIFF_REFERENCE_BUDGET_MB", "PYTHONPATH", LAUNCHED_ENV,
            "WORLD_SIZE", "LOCAL_WORLD_SIZE", "threads", "has_run_id")


def test_one_child_inherits_this_environment_and_reaches_this_ac_diff(monkeypatch):
    monkeypatch.setenv("AC_DIFF_COMPILED", "eager")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    child = child_command(["-m", "ac_diff", "run", "x.py"], extra={"EXTRA": "1"})
    assert child.argv == [sys.executable, "-m", "ac_diff", "run", "x.py"] and child.run_id is None
    assert child.env["AC_DIFF_COMPILED"] == "eager" and child.env["EXTRA"] == "1"
    assert "OMP_NUM_THREADS" not in child.env and RUN_ID_ENV not in child.env  # one process: its own thread count
    assert child.env["PYTHONPATH"].split(os.pathsep)[0] == "/somewhere"  # appended: the script's modules first
    assert children._ROOT in child.env["PYTHONPATH"].split(os.pathsep) or children._ROOT in children._site_dirs()


def test_a_torchrun_launch_gets_a_fresh_run_id_and_the_launchers_part(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    a, b = child_command(["-m", "ac_diff", "run"], nproc=2), child_command(["-m", "ac_diff", "run"], nproc=2)
    assert a.argv[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    assert a.env[RUN_ID_ENV] == a.run_id != b.run_id and a.env[LAUNCHED_ENV] == "1"
    assert a.env["OMP_NUM_THREADS"] == "1"
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert child_command(["-m", "ac_diff"], nproc=2).env["OMP_NUM_THREADS"] == "3"  # the user's choice stays


SCRIPT = textwrap.dedent("""
    import json, os, torch
    from torch.utils.checkpoint import checkpoint
    env = {k: os.environ.get(k) for k in %r}
    env.update(threads=str(torch.get_num_threads()), has_run_id=bool(os.environ.get(%r)),
               run_id=os.environ.get(%r), rank=os.environ.get("RANK"),
               role="reference" if os.environ.get("AC_DIFF_GRADS_DIR") else "run")
    out = os.environ["ENV_OUT"]
    with open(os.path.join(out, f"env-{os.getpid()}.json"), "w") as f:
        json.dump(env, f)
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    checkpoint(lin, x, use_reentrant=False).sum().backward()
""") % (RELEVANT[:-2], RUN_ID_ENV, RUN_ID_ENV)


def _ranks_env(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("env-*.json"))]


def test_fix_and_run_start_their_ranks_the_same_way(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", RUN_ID_ENV, LAUNCHED_ENV)}
    env.update(PYTHONUNBUFFERED="1", AC_DIFF_COMPILED="eager", AC_DIFF_REFERENCE_BUDGET_MB="8")
    seen = {}
    for name, args in {"run": ["run", "--nproc-per-node", "2", "-o", str(tmp_path / "run-out")],
                       "fix": ["fix", "--nproc-per-node", "2", "--steps", "1", "--max-tries", "0",
                               "-o", str(tmp_path / "fix-out")]}.items():
        (tmp_path / name).mkdir()
        proc = subprocess.run([sys.executable, "-m", "ac_diff", *args, str(script)], cwd=tmp_path,
                              env={**env, "ENV_OUT": str(tmp_path / name)}, capture_output=True, text=True,
                              timeout=400)
        seen[name] = _ranks_env(tmp_path / name)
        assert seen[name], proc.stderr[-3000:]
    assert {e["role"] for e in seen["fix"]} == {"run", "reference"}  # fix's recorded run and its run without AC
    for rows in seen.values():
        launches: dict[str, set] = {}
        for e in rows:
            launches.setdefault((e["role"], e["run_id"]), set()).add(e["rank"])
        assert all(ranks == {"0", "1"} for ranks in launches.values()), launches  # one run id per launch
    relevant = {name: {tuple((k, e[k]) for k in RELEVANT) for e in rows} for name, rows in seen.items()}
    assert len(relevant["run"]) == 1, relevant["run"]
    assert relevant["fix"] == relevant["run"], (relevant["fix"], relevant["run"])
    (only,) = relevant["run"]
    assert dict(only)["has_run_id"] and dict(only)[LAUNCHED_ENV] == "1" and dict(only)["AC_DIFF_COMPILED"] == "eager"
