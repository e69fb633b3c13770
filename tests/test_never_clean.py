"""A run is never reported clean over what was not compared: a recompute that died part of the way."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

_DIES_IN_RECOMPUTE = """
import sys, torch
from torch.utils.checkpoint import checkpoint

calls = 0

def block(x):
    global calls
    calls += 1
    if calls == 2:  # the recompute
        {death}
    return torch.sin(x).cos() * x

x = torch.randn(4, 8, requires_grad=True)
checkpoint(block, x, use_reentrant=False).sum().backward()
"""


@pytest.mark.parametrize("death,code", [("sys.exit(7)", 7), ("raise RuntimeError('lost the cache')", 1)],
                         ids=["sys.exit", "raise"])
def test_a_script_that_dies_inside_a_recompute_is_not_clean(death, code, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(_DIES_IN_RECOMPUTE.replace("{death}", death))
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, "-m", "ac_diff", "run", "-o", str(out), str(script)],
                         capture_output=True, text=True)
    assert run.returncode == code, run.stdout + run.stderr  # the script's own exit code
    assert "CLEAN" not in run.stdout and "the recompute raised" in run.stdout
    report = subprocess.run([sys.executable, "-m", "ac_diff", "report", "--format", "json", str(out)],
                            capture_output=True, text=True)
    assert report.returncode == 4, report.stdout + report.stderr
    assert '"verdict": "unchecked"' in report.stdout


@pytest.mark.e2e
def test_audit_check_fails_on_a_run_that_already_diverges():
    """Dropout in checkpointed blocks without their RNG state: every recompute differs now, whatever the
    prediction at scale says; `audit --check` must not pass it."""
    from conftest import EXAMPLES

    done = subprocess.run([sys.executable, "-m", "ac_diff", "audit", "--check", str(EXAMPLES / "dropout_no_rng.py")],
                          capture_output=True, text=True)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert "the run already diverges" in done.stdout


_FAILS_AFTER_ITS_REGIONS = """
import sys, torch
from torch.utils.checkpoint import checkpoint

x = torch.randn(4, 8, requires_grad=True)
checkpoint(lambda t: torch.sin(t).cos() * t, x, use_reentrant=False).sum().backward()
{end}
"""


@pytest.mark.parametrize("end,title", [("raise RuntimeError('the eval loader is gone')", "CLEAN, SCRIPT FAILED"),
                                       ("sys.exit(3)", "CLEAN, SCRIPT FAILED"), ("sys.exit(0)", "CLEAN")],
                         ids=["raise", "exit-3", "exit-0"])
def test_a_script_that_fails_after_its_regions_were_compared_says_so(end, title, tmp_path):
    """Every region that ran reproduced itself, then the script failed: the verdict stays clean, but the title and
    headline say that the run stopped there, not that training was checked to its end, and a CI gate does not pass
    it (exit 4, as for a run with nothing compared)."""
    script = tmp_path / "train.py"
    script.write_text(_FAILS_AFTER_ITS_REGIONS.replace("{end}", end))
    out = tmp_path / "out"
    subprocess.run([sys.executable, "-m", "ac_diff", "run", "-o", str(out), str(script)], capture_output=True)
    report = subprocess.run([sys.executable, "-m", "ac_diff", "report", "--check", "--format", "json", str(out)],
                            capture_output=True, text=True)
    assert report.returncode == (0 if title == "CLEAN" else 4), report.stdout + report.stderr
    data = json.loads(report.stdout)
    assert data["verdict"] == "clean" and data["title"] == title, data["headline"]
    assert ("but the script failed" in data["headline"]) == (title != "CLEAN"), data["headline"]


def test_every_title_belongs_to_one_verdict_and_the_readme_lists_them_all():
    """A CI gate matches titles: the README's list is closed, and it is the one the report draws from."""
    import inspect
    import re
    from pathlib import Path

    from ac_diff.report import TITLES, Report

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    listed = readme[readme.index("one of these and\nno other"):]
    listed = listed[:listed.index(".\n")]
    assert set(re.findall(r"`([A-Z][A-Z ,]+)`", listed)) == {t for titles in TITLES.values() for t in titles}
    returned = set(re.findall(r'"([A-Z][A-Z ,]{3,})"', inspect.getsource(Report.title.fget)))
    assert returned == {t for titles in TITLES.values() for t in titles}


@pytest.mark.parametrize("watch", [False, True])
def test_an_evaluation_pass_through_reentrant_regions_is_no_gap(watch, tmp_path):
    """Validation under torch.no_grad() through reentrant checkpoints: no backward runs through those calls. They
    were counted "unchecked" ("never recomputed: no backward reached them") on a clean control; they are evaluation
    calls, counted as such, and the run is clean. A script that only evaluates still checks nothing."""
    import torch
    import torch.nn as nn
    import torch.utils.checkpoint as cp

    import ac_diff

    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(8, 8), nn.GELU())
    path = tmp_path / "t.jsonl"
    with ac_diff.record(path, watch=watch):
        for _ in range(3):
            cp.checkpoint(block, torch.randn(4, 8, requires_grad=True), use_reentrant=True).sum().backward()
            with torch.no_grad():
                cp.checkpoint(block, torch.randn(4, 8), use_reentrant=True)
    report = ac_diff.diagnose_paths([path])
    assert (report.verdict, report.title) == ("clean", "CLEAN"), report.headline
    assert "unchecked" not in report.status_counts(), report.status_counts()
    assert "called under no_grad (evaluation: nothing to recompute)" in report.status_counts()
    only = tmp_path / "eval.jsonl"
    with ac_diff.record(only, watch=watch), torch.no_grad():
        cp.checkpoint(block, torch.randn(4, 8), use_reentrant=True)
    assert ac_diff.diagnose_paths([only]).verdict == "unchecked"


def test_a_recompute_whose_forward_ran_before_recording_says_so(tmp_path):
    """A forward run before `ac_diff.record()` was entered and its backward inside it (29f): nothing to compare, never
    clean, and said so; it read "ops not recorded (beyond --max-regions)", a setting the script never used."""
    import torch
    import torch.utils.checkpoint as cp

    import ac_diff

    torch.manual_seed(0)
    block = torch.nn.Linear(8, 8)
    loss = cp.checkpoint(block, torch.randn(4, 8, requires_grad=True), use_reentrant=False).square().sum()
    with ac_diff.record(tmp_path / "t.jsonl"):
        loss.backward()
        # (a later step recorded whole, and clean: the run read CLEAN over the first one's uncompared gradients, 30c)
        cp.checkpoint(block, torch.randn(4, 8, requires_grad=True), use_reentrant=False).square().sum().backward()
    report = ac_diff.diagnose_paths([tmp_path / "t.jsonl"])
    assert report.verdict == "unchecked", report.headline
    assert [r.unchecked_reason for r in report.regions] == ["forward not recorded", None]
    assert "max-regions" not in report.headline and "before recording began" in report.headline, report.headline
