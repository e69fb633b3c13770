"""Faults while recording, and bad input on the command line: the script's exit code wins, nothing is
lost silently, every problem is one line on stderr with exit code 2 (never a traceback or exit 3)."""

from __future__ import annotations

import gzip
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import EXAMPLES, REAL_LOGS, REPO, run_cli


def _one_error_line(proc, *words):
    err = proc.stderr
    assert "Traceback" not in err and "internal error" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("ac-diff: error:")]
    assert len(lines) == 1, err
    assert all(w in lines[0] for w in words), err


def test_a_full_disk_keeps_the_scripts_exit_code_and_says_what_was_lost(tmp_path):
    """A file-size limit makes the trace's writes fail (EFBIG) like a full disk (ENOSPC) does."""
    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))

    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "ac_diff", "run", "-o", str(out),
                           str(EXAMPLES / "moe_bias_update_fixed.py")], cwd=REPO, capture_output=True, text=True,
                          preexec_fn=limit, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert proc.returncode == 0, proc.stderr  # the script succeeded: its code, not ac-diff's
    trace = out / "trace-rank0.jsonl"
    _one_error_line(proc, str(trace), "could not write the trace", "record(s) after it were lost")
    assert "trace written" not in proc.stderr
    assert 0 < trace.stat().st_size <= 20_000
    assert "ac-diff:" in proc.stdout  # the report on what was written


def _sigterm_when_ready(script: Path, out: Path) -> tuple[str, str]:
    """`ac-diff run -o OUT SCRIPT`, sent SIGTERM once the script prints "ready": (stdout, stderr) after it exits 143."""
    proc = subprocess.Popen([sys.executable, "-m", "ac_diff", "run", "-o", str(out), str(script)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143, stderr
    return stdout, stderr


def test_sigterm_finishes_a_single_process_trace(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        "import sys, time, torch\n"
        "from torch.utils.checkpoint import checkpoint\n"
        "lin = torch.nn.Linear(4, 4)\n"
        "checkpoint(lin, torch.randn(2, 4, requires_grad=True), use_reentrant=False).sum().backward()\n"
        "print('ready', flush=True)\n"
        "time.sleep(120)\n")
    out = tmp_path / "out"
    _, stderr = _sigterm_when_ready(script, out)
    assert "trace written" in stderr and "Traceback" not in stderr
    end = json.loads((out / "trace-rank0.jsonl").read_text().splitlines()[-1])
    assert end["type"] == "end" and end["exit_code"] == 143
    assert end["status"] == "interrupted"  # like Ctrl-C (the region was checked before: the report is clean)
    exc = next(json.loads(line) for line in (out / "trace-rank0.jsonl").read_text().splitlines()
               if '"exception"' in line)
    assert exc["exc_type"] == "Terminated" and "SIGTERM" in exc["message"]


def test_sigterm_in_a_backward_is_an_interruption_not_an_exit(tmp_path):
    """SIGTERM landing in a backward (a preemption mid-step) read as the script exiting there: CRASHED, "exit code 143
    from train.py:N", the signal never named. It is an interruption, as Ctrl-C's."""
    script = tmp_path / "train.py"
    script.write_text(
        "import time, torch\n"
        "from torch.utils.checkpoint import checkpoint\n"
        "class Slow(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.lin, self.calls = torch.nn.Linear(4, 4), 0\n"
        "    def forward(self, x):\n"
        "        self.calls += 1\n"
        "        if self.calls == 2:  # its recompute, in the backward\n"
        "            print('ready', flush=True)\n"
        "            time.sleep(120)\n"
        "        return self.lin(x)\n"
        "checkpoint(Slow(), torch.randn(2, 4, requires_grad=True), use_reentrant=False).sum().backward()\n")
    out = tmp_path / "out"
    stdout, _ = _sigterm_when_ready(script, out)
    end = json.loads((out / "trace-rank0.jsonl").read_text().splitlines()[-1])
    assert end["status"] == "interrupted", end
    said = " ".join(stdout.replace("│", " ").split())
    assert "INTERRUPTED" in said and "SIGTERM" in said and "exit code 143" not in said, said


def test_sigterm_to_the_launcher_stops_the_ranks_and_reports(tmp_path):
    """SIGTERM to `ac-diff run --nproc-per-node 2` (a scheduler preempting the job) killed the launcher alone: no
    report, exit -15, and the ranks trained on as orphans. It is passed on to torchrun now, which stops the ranks;
    they finish their traces, the launcher reports them and exits 143."""
    script = tmp_path / "train.py"
    script.write_text(
        "import time, torch, torch.distributed as dist\n"
        "from torch.utils.checkpoint import checkpoint\n"
        "dist.init_process_group('gloo')\n"
        "lin = torch.nn.Linear(4, 4)\n"
        "checkpoint(lin, torch.randn(2, 4, requires_grad=True), use_reentrant=False).sum().backward()\n"
        "dist.barrier()\n"
        "if dist.get_rank() == 0:\n"
        "    print('ready', flush=True)\n"
        "time.sleep(120)\n")
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "ac_diff", "run", "--nproc-per-node", "2", "-o", str(out),
                             str(script)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "AC_DIFF_RANK_WAIT": "20"})
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143, stderr[-3000:]
    assert "ac-diff: CLEAN, SCRIPT INTERRUPTED" in stdout.replace("─", "").replace("╭", ""), stdout
    for rank in (0, 1):  # both stopped, traces finished (not orphans still sleeping)
        end = json.loads((out / f"trace-rank{rank}.jsonl").read_text().splitlines()[-1])
        assert end["type"] == "end" and end["status"] == "interrupted", end


def test_a_trace_whose_process_still_runs_is_told_from_a_killed_one(tmp_path):
    """A rank slower than AC_DIFF_RANK_WAIT (or `report` on a run still writing) was reported as killed: "SIGKILL,
    the out-of-memory killer?". The header's pid, alive on this host, says it is still running; once killed, it
    is not."""
    from ac_diff.trace import read_run

    trace = tmp_path / "trace-rank0.jsonl"
    proc = subprocess.Popen([sys.executable, "-c",
                             "import time, torch, ac_diff\n"
                             "from torch.utils.checkpoint import checkpoint\n"
                             f"with ac_diff.record({str(trace)!r}):\n"
                             "    lin = torch.nn.Linear(4, 4)\n"
                             "    checkpoint(lin, torch.randn(2, 4, requires_grad=True), use_reentrant=False).sum()"
                             ".backward()\n"
                             "    print('ready', flush=True)\n"
                             "    time.sleep(120)\n"], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        assert proc.stdout.readline().strip() == "ready"
        run = read_run(trace)
        assert run.truncated and run.running is True
        assert any("is still running" in note for note in run.notes), run.notes
    finally:
        proc.kill()
        proc.wait(timeout=60)
    run = read_run(trace)
    assert run.truncated and run.running is False
    assert any("(killed?)" in note for note in run.notes), run.notes


def test_a_rank_that_aborts_after_its_trace_is_complete_is_named(tmp_path):
    """Rank 1 aborts as its interpreter shuts down (gloo's "terminate called without an active exception"), after its
    script finished and its trace was complete: the ranks table says ok, torchrun says 1, and nothing said why."""
    script = tmp_path / "train.py"
    script.write_text(
        "import atexit, os, torch, torch.distributed as dist\n"
        "from torch.utils.checkpoint import checkpoint\n"
        "dist.init_process_group('gloo')\n"
        "lin = torch.nn.Linear(4, 4)\n"
        "checkpoint(lin, torch.randn(2, 4, requires_grad=True), use_reentrant=False).sum().backward()\n"
        "dist.barrier()\n"
        "if dist.get_rank() == 1:\n"
        "    atexit.register(os.abort)\n")
    proc = subprocess.run([sys.executable, "-m", "ac_diff", "run", "--nproc-per-node", "2", "-o", str(tmp_path / "out"),
                           str(script)], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "AC_DIFF_RANK_WAIT": "20"})
    assert proc.returncode != 0, proc.stderr[-2000:]
    assert "although every rank's script finished and its trace is complete" in proc.stderr, proc.stderr[-3000:]


def test_sigterm_while_the_trace_is_finished_lets_it_complete(monkeypatch):
    """Once the script has ended, the runner's `finishing` flag says ac-diff is writing the end of the trace:
    a SIGTERM then only stops the waiting; while the script runs it ends the script with 143."""
    from ac_diff.capture.runner import finishing
    from ac_diff.commands import launch_cmd

    monkeypatch.setattr(launch_cmd, "_terminated", type(launch_cmd._terminated)())  # this test's own event
    with launch_cmd.sigterm_as_exit():
        finishing.set()
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)  # the handler runs here, and does not raise
        finally:
            finishing.clear()
    assert launch_cmd._terminated.is_set()
    with pytest.raises(SystemExit) as stopped, launch_cmd.sigterm_as_exit():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
    assert stopped.value.code == 143 and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


@pytest.fixture(scope="module")
def trace_lines(tmp_path_factory) -> list[bytes]:
    import torch
    from torch.utils.checkpoint import checkpoint

    import ac_diff

    path = tmp_path_factory.mktemp("t") / "trace-rank0.jsonl"
    with ac_diff.record(path):
        checkpoint(torch.nn.Linear(4, 4), torch.randn(2, 4, requires_grad=True), use_reentrant=False).sum().backward()
    return path.read_bytes().splitlines()


def _bad_inputs(tmp_path: Path, lines: list[bytes]) -> dict[str, tuple[Path, list[str]]]:
    data = b"\n".join(lines) + b"\n"
    packed = gzip.compress(data)
    header = json.loads(lines[0])
    cases = {
        "cut.jsonl.gz": (packed[: len(packed) // 2], []),
        "corrupt.jsonl.gz": (packed[:40] + bytes([packed[40] ^ 0x10]) + packed[41:], ["damaged"]),
        "corrupt.log.gz": (bytes(b ^ 0x55 if 30 < i < 60 else b for i, b in enumerate(
            gzip.compress((REAL_LOGS / "readme_glm4v.log").read_bytes()))), ["compressed file is damaged"]),
        "rank.jsonl": (json.dumps({**header, "rank": "abc"}).encode() + b"\n" + b"\n".join(lines[1:]),
                       ["header is damaged", "'rank'"]),
        # the header line edited into text that no longer parses: damaged, not "not an ac-diff trace"
        "cut_header.jsonl": (lines[0][:120] + b"}{garbage\n" + b"\n".join(lines[1:]),
                             ["header (its first line) is damaged"]),
    }
    out = {}
    for name, (content, words) in cases.items():
        (tmp_path / name).write_bytes(content)
        out[name] = (tmp_path / name, words)
    return out


def test_bad_files_get_one_line_and_exit_2_or_a_report(tmp_path, trace_lines):
    for name, (path, words) in _bad_inputs(tmp_path, trace_lines).items():
        proc = run_cli("report", str(path))
        assert proc.returncode in (0, 2, 4) if not words else proc.returncode == 2, (name, proc.returncode, proc.stderr)
        assert "Traceback" not in proc.stderr and "aborted" not in proc.stderr, (name, proc.stderr)
        if words:
            _one_error_line(proc, *words)
        if name == "cut.jsonl.gz":  # killed while writing it, or an incomplete copy: never only "killed?"
            assert "its compressed stream is cut short" in proc.stdout.replace("\n", " "), proc.stdout


def test_os_errors_get_the_advice_of_their_kind(tmp_path):
    import errno

    from ac_diff.streams import describe_os_error

    def raised(fn):
        try:
            fn()
        except OSError as exc:
            return describe_os_error(exc)
        raise AssertionError("no error")

    assert raised(lambda: open(tmp_path)).endswith("Is a directory; pass a file, not a directory")
    assert raised(lambda: open(tmp_path / "missing")).endswith("No such file or directory; check the path")
    bad = tmp_path / "bad.gz"
    bad.write_bytes(b"\x1f\x8bnot gzip at all")
    assert "damaged" in raised(lambda: gzip.open(bad).read())
    # root reads any file, so EACCES is built here: the advice must differ from the one for a full disk
    denied = describe_os_error(PermissionError(errno.EACCES, "Permission denied", "rank1.log"))
    full = describe_os_error(OSError(errno.ENOSPC, "No space left on device", "trace-rank0.jsonl"))
    assert denied == "rank1.log: Permission denied; check the file's permissions"
    assert full.startswith("trace-rank0.jsonl: No space left on device; the disk is full")


def test_export_of_a_truncated_trace_warns_in_one_line(tmp_path, trace_lines):
    cut = tmp_path / "cut.jsonl"
    cut.write_bytes(b"\n".join(trace_lines[:-1]) + b"\n")
    proc = run_cli("export", str(cut), "-o", str(tmp_path / "ops.csv"))
    assert proc.returncode == 0
    assert "RuntimeWarning" not in proc.stderr and ".py:" not in proc.stderr
    assert [line for line in proc.stderr.splitlines() if "truncated" in line][0].startswith("ac-diff: warning:")


def test_a_script_ending_with_os_exit_is_still_reported_and_checked(tmp_path):
    """os._exit(code) at the end of a script (common where a process group could hang at exit): the trace is
    finished and reported, --check still fails a silent divergence, the process then ends with os._exit's code
    without running atexit handlers, as the script asked."""
    script = tmp_path / "train.py"
    script.write_text(
        "import atexit, os, torch\n"
        "from torch.utils.checkpoint import checkpoint\n"
        "atexit.register(lambda: print('atexit ran', flush=True))\n"
        "x, b = torch.randn(4, 4, requires_grad=True), torch.zeros(4)\n"
        "y = checkpoint(lambda t: torch.sin(t) * (b + 1), x, use_reentrant=False)\n"
        "b += 1.0  # changed between the forward and the backward: a silent divergence\n"
        "y.sum().backward()\n"
        "os._exit(int(os.environ.get('CODE', '0')))\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    checked = subprocess.run([sys.executable, "-m", "ac_diff", "run", "--check", "-o", str(tmp_path / "a"),
                              str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert checked.returncode == 1, checked.stderr  # --check: the script succeeded, a region diverged
    assert "SILENTLY DIVERGED" in checked.stdout and "atexit ran" not in checked.stdout
    code = subprocess.run([sys.executable, "-m", "ac_diff", "run", "-o", str(tmp_path / "b"), str(script)],
                          capture_output=True, text=True, env={**env, "CODE": "7"}, timeout=120)
    assert code.returncode == 7 and "SILENTLY DIVERGED" in code.stdout and "atexit ran" not in code.stdout


@pytest.mark.parametrize("how, watch", [("sys.exit(0)", False), ("os._exit(7)", False), ("sys.exit(0)", True)])
def test_an_exit_inside_a_backward_is_never_clean(tmp_path, how, watch):
    """A hook that ends the script in the middle of a backward (sys.exit, os._exit): the forwards that backward had
    yet to reach were never recomputed, so the run stopped as after a crash, whatever the exit code; the headline
    says where it stopped. An exit after the backward (the test above) is an ordinary end."""
    script = tmp_path / "train.py"
    script.write_text(
        "import os, sys, torch\n"
        "from torch.utils.checkpoint import checkpoint\n"
        "blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))\n"
        "for step in range(3):\n"
        "    h = torch.randn(4, 8)\n"
        "    for block in blocks:\n"
        "        h = checkpoint(block, h, use_reentrant=False)\n"
        "    if step == 2:\n"
        f"        h.register_hook(lambda g: {how})\n"
        "    h.sum().backward()\n")
    proc = run_cli("run", "--check", *(["--watch"] if watch else []), "-o", "out", "train.py", cwd=tmp_path,
                   timeout=120)
    assert proc.returncode == (7 if "7" in how else 4), proc.stdout + proc.stderr
    assert "CRASHED" in proc.stdout and "CLEAN" not in proc.stdout, proc.stdout
    said = " ".join(proc.stdout.replace("│", " ").split())  # (the headline box wraps it)
    assert f"exit code {7 if '7' in how else 0} from train.py:9" in said, said
    if not watch:
        assert "stopped in a backward, before the recompute of region 5 (blocks.1)" in said, said
    report = run_cli("report", "--check", str(tmp_path / "out"), timeout=120)
    assert report.returncode == 4, report.stdout + report.stderr


def test_a_shape_divergence_past_a_check_turned_off_that_the_backward_raises_about_is_not_silent(tmp_path):
    """determinism_check="none" and a capacity lowered between the forward and the backward (a curriculum): the
    recompute routes fewer tokens, torch compares nothing, and autograd raises about a gradient of the wrong shape.
    The divergence is not "silent" (torch raised no CheckpointError, but the backward did): the headline says what
    the backward raised, the chain does not claim a CheckpointError, the JSON keeps it."""
    script = tmp_path / "train.py"
    script.write_text(
        "import torch\n"
        "from torch.utils.checkpoint import checkpoint\n"
        "class Routed(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.router, self.mlp, self.capacity = torch.nn.Linear(8, 1), torch.nn.Linear(8, 8), 0.5\n"
        "    def forward(self, x):\n"
        "        k = max(1, int(self.capacity * x.shape[1]))\n"
        "        idx = self.router(x).squeeze(-1).topk(k, dim=1).indices.sort(1).values[..., None].expand(-1, -1, 8)\n"
        "        return x.scatter_add(1, idx, self.mlp(x.gather(1, idx)))\n"
        "torch.manual_seed(0)\n"
        "block = Routed()\n"
        "for step in range(2):\n"
        "    y = checkpoint(block, torch.randn(2, 8, 8, requires_grad=True), use_reentrant=False,\n"
        "                   determinism_check='none')\n"
        "    if step == 1:\n"
        "        block.capacity = 0.25\n"
        "    y.square().mean().backward()\n")
    proc = run_cli("run", "--json", "r.json", "-o", "out", "train.py", cwd=tmp_path, timeout=120)
    said = " ".join(proc.stdout.replace("│", " ").split())
    assert "invalid gradient" in proc.stderr and "SILENTLY" not in said and "torch raised no error" not in said, said
    assert "then the backward raised RuntimeError: Function ScatterAddBackward0 returned an invalid gradient" in said
    lead = next(r for r in json.loads((tmp_path / "r.json").read_text())["regions"] if r["status"] == "diverged")
    assert lead["silent"] is False and lead["cause"]["tensor"].endswith("capacity"), lead["cause"]
    assert lead["backward_raised"].startswith("RuntimeError: Function ScatterAddBackward0")
    assert not any("torch raises CheckpointError" in step for step in lead["chain"]), lead["chain"]
    assert any('determinism_check="none"' in step for step in lead["chain"]), lead["chain"]


@pytest.mark.parametrize("given", ["abc", "-1", "inf"])
def test_a_bad_rank_wait_is_named_not_ignored(monkeypatch, capsys, given):
    from ac_diff.commands.launch_cmd import DEFAULT_WAIT_S, rank_wait_seconds

    monkeypatch.setenv("AC_DIFF_RANK_WAIT", given)
    assert rank_wait_seconds() == DEFAULT_WAIT_S
    assert f"AC_DIFF_RANK_WAIT={given!r} is not a number of seconds >= 0" in capsys.readouterr().err
    monkeypatch.setenv("AC_DIFF_RANK_WAIT", "2.5")
    assert rank_wait_seconds() == 2.5 and not capsys.readouterr().err


def test_a_trace_cut_before_any_region_was_compared_is_cut_short(tmp_path):
    """A copy cut inside the first region's records: CUT SHORT, exit 4 with --check (it read NOTHING CHECKED, "the
    original forward was not recorded": the cut went through that record)."""
    import torch
    import torch.nn as nn
    import torch.utils.checkpoint as cp

    import ac_diff

    torch.manual_seed(0)
    block, path = nn.Sequential(nn.Linear(8, 8), nn.Tanh()), tmp_path / "t.jsonl"
    with ac_diff.record(path, write="all"):
        for _ in range(2):
            cp.checkpoint(block, torch.randn(4, 8, requires_grad=True), use_reentrant=False).sum().backward()
    lines = path.read_text().splitlines(keepends=True)
    cut = tmp_path / "cut.jsonl"
    cut.write_text("".join(lines[:3]) + lines[3][: len(lines[3]) // 2])
    report = ac_diff.diagnose_paths([cut])
    assert report.title == "CUT SHORT" and "nothing was checked" in report.headline, (report.title, report.headline)
    proc = run_cli("report", "--check", str(cut))
    assert proc.returncode == 4, proc.stderr
