"""Shared test helpers: tiny real models, a recorder wrapper, and running the CLI in a subprocess."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
REAL_LOGS = REPO / "tests" / "data" / "real_logs"  # public pastes of torch's errors; sources in its README.md
sys.path.insert(0, str(REPO / "tests"))


def run_cli(*args: str, cwd: str | os.PathLike | None = None, env: dict | None = None,
            timeout: int = 300) -> subprocess.CompletedProcess:
    """`python -m ac_diff ARGS` in a subprocess, as a user would run it."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "ac_diff", *args], cwd=cwd, env=full_env, capture_output=True,
                          text=True, timeout=timeout)


@contextlib.contextmanager
def torch_debug_logging():
    """Run checkpoint(debug=True) without the test runner's log handlers on torch's "LoggingTensor" logger.

    torch logs each op there with arguments its message does not format (`info(name, args, kwargs, out)`),
    for its own handler, which reads them raw. torch's capture_logs leaves the logger non-propagating,
    and pytest >= 9.2 attaches its capture handler to every non-propagating logger at the start of each
    test phase; formatting those records then raises TypeError inside the checkpointed forward (only
    after another test has run debug=True: an order-dependent failure). Foreign handlers are detached
    for the block and put back after it."""
    logger = logging.getLogger("LoggingTensor")
    foreign = list(logger.handlers)
    for handler in foreign:
        logger.removeHandler(handler)
    try:
        yield
    finally:
        for handler in foreign:
            if handler not in logger.handlers:
                logger.addHandler(handler)


def checkpoint_error_text(fn, *inputs, between=None, **options) -> str:
    """What a training script prints for the CheckpointError that the backward of `checkpoint(fn, *inputs,
    debug=True, **options)` raises (the traceback, the error, the dump); `between()` runs after the forward, before
    the backward. Fails when the backward raised nothing."""
    import traceback

    from torch.utils.checkpoint import checkpoint
    with torch_debug_logging():
        try:
            loss = checkpoint(fn, *inputs, **{"use_reentrant": False, "debug": True, **options}).sum()
            if between is not None:
                between()
            loss.backward()
        except Exception as exc:  # noqa: BLE001 - the text is the subject
            return "".join(traceback.format_exception(exc))
    raise AssertionError("the recompute reproduced the forward")


def report_json(path: str | os.PathLike) -> dict:
    return json.loads(Path(path).read_text())


def run_scripts(out: Path, folder: Path, names: tuple[str, ...], env: dict | None = None) -> dict[str, dict]:
    """Each `folder/NAME.py` run once under `ac-diff run --json`: {name: {"json", "proc", "dir"}}."""
    reports = {}
    for name in names:
        json_path = out / f"{name}.json"
        proc = run_cli("run", "-o", str(out / name), "--json", str(json_path), str(folder / f"{name}.py"),
                       cwd=REPO, env=env)
        assert json_path.exists(), f"{name}: no report\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        reports[name] = {"json": report_json(json_path), "proc": proc, "dir": out / name}
    return reports


@pytest.fixture(scope="session")
def example_reports(tmp_path_factory) -> dict[str, dict]:
    """Every bundled example run once under `ac-diff run --json`, shared by the tests that read them."""
    return run_scripts(tmp_path_factory.mktemp("examples"), EXAMPLES,
                       ("moe_bias_update", "moe_bias_update_fixed", "dropout_no_rng", "python_state_branch"))


@pytest.fixture(scope="session")
def demo(tmp_path_factory) -> Path:
    """The bundled MoE demo, recorded once per test run: shared by test files and xdist workers (lock + marker)."""
    from filelock import FileLock  # a dependency of torch

    root = tmp_path_factory.getbasetemp()
    base = (root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root) / "ac-diff-demo"
    base.mkdir(exist_ok=True)
    with FileLock(str(base) + ".lock"):
        if not (base / "done").exists():
            proc = subprocess.run([sys.executable, "-m", "ac_diff", "demo", "-o", str(base / "out"), "--json",
                                   str(base / "r.json"), "--format", "html", "--report", str(base / "demo.html")],
                                  capture_output=True, text=True, timeout=600)
            assert proc.returncode == 0, proc.stderr[-3000:]
            (base / "done").write_text("ok")
    return base
