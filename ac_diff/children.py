"""Every process ac-diff starts, started one way: the launcher's ranks, the reference run, fix's runs.

    child = child_command(["-m", "ac_diff.reference.child", "train.py"], extra={"AC_DIFF_GRADS_DIR": "out/reference"})
    child.argv  ->  [sys.executable, "-m", "ac_diff.reference.child", "train.py"]
    child = child_command(["-m", "ac_diff", "run", ...], nproc=2)
    child.argv  ->  [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "ac_diff", ...]
    child.env   ->  os.environ + OMP_NUM_THREADS=1 (unless set) + AC_DIFF_RUN_ID=<fresh> + AC_DIFF_LAUNCHED=1 + PYTHONPATH
    child.run(stdout=sys.stderr.fileno())  ->  exit code (Ctrl-C: the child winds down first, child.interrupted)

The environment, the same for all: this process's (with $AC_DIFF_COMPILED, $AC_DIFF_REFERENCE_BUDGET_MB and the
rest that --compiled and --reference-budget-mb set), PYTHONPATH reaching this ac_diff (appended, so the child imports
the same one without shadowing the script's modules), `extra`; and for a torchrun of N ranks the launcher's part:
a fresh run id ($AC_DIFF_RUN_ID, one per launch), $AC_DIFF_LAUNCHED (ac-diff reports, not the ranks) and
OMP_NUM_THREADS=1 unless set (torchrun's own default, without its warning).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import site
import subprocess
import sys
import tempfile
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

EXIT_TERMINATED = 128 + signal.SIGTERM  # what a shell reports for a process ended by SIGTERM
EXIT_INTERRUPTED = 128 + signal.SIGINT  # ... by Ctrl-C
RUN_ID_ENV = "AC_DIFF_RUN_ID"
LAUNCHED_ENV = "AC_DIFF_LAUNCHED"  # set by ac-diff's torchrun launches: the launcher reports, ranks don't
_ROOT = str(Path(__file__).resolve().parents[1])  # the directory holding this ac_diff package


_start_dir: str | None = None  # where the command started (`remember_start_dir`)


def remember_start_dir() -> None:
    """Take the working directory now, as the command starts: every child starts there, whatever directory the script
    (run in this process before them: `--reference`) moved to with os.chdir(): `python -m pkg.train` and the script's
    relative arguments then mean what they meant to the run."""
    global _start_dir
    try:
        _start_dir = os.getcwd()
    except OSError:  # (removed under it: children start where this process is then)
        _start_dir = None


_stdin_copy: str | None = None  # a copy of standard input that every run of the script reads (`share_stdin`)


def share_stdin() -> None:
    """Let every run of the script read the same standard input (`run --reference`, `fix`: the script runs again in a
    child, which would find it consumed): what is left of it is copied to a temporary file, which each child reads
    from its start (`stdin_for_child`); a pipe, which this process's own run would consume, is replaced by the copy
    as descriptor 0. A terminal is left alone."""
    global _stdin_copy
    try:
        if _stdin_copy is not None or os.isatty(0):
            return
        start = os.lseek(0, 0, os.SEEK_CUR)
    except OSError:  # not seekable (a pipe), or closed
        start = None
    try:
        fd, path = tempfile.mkstemp(prefix="ac-diff-stdin-")
        with os.fdopen(os.dup(0), "rb") as given, os.fdopen(fd, "wb") as copy:
            shutil.copyfileobj(given, copy)
        if start is None:
            replacement = os.open(path, os.O_RDONLY)
            os.dup2(replacement, 0)
            os.close(replacement)
        else:
            os.lseek(0, start, os.SEEK_SET)
    except OSError:
        return
    _stdin_copy = path
    atexit.register(lambda: os.path.exists(path) and os.unlink(path))


def stdin_for_child():
    """What a child's standard input is: the copy `share_stdin` made, opened afresh (None: inherited)."""
    return open(_stdin_copy, "rb") if _stdin_copy is not None else None


@dataclass
class Child:
    argv: list[str]
    env: dict[str, str]
    run_id: str | None = None  # a torchrun launch's run id
    interrupted: bool = False  # after run(): Ctrl-C arrived meanwhile
    terminated: bool = False  # after run(): SIGTERM arrived meanwhile (passed on to the child)

    def run(self, **popen: object) -> int:
        """Run it to the end, its exit code; on Ctrl-C (the child got it too: same process group) wait for it to
        wind down and note `interrupted`; SIGTERM (a scheduler's, sent to this process alone) is passed on to the
        child (torchrun stops its ranks, which finish their traces), waited for, and noted as `terminated`."""
        popen.setdefault("cwd", _start_dir)
        with stdin_for_child() or contextlib.nullcontext() as stdin:
            popen.setdefault("stdin", stdin)
            return self._wait(subprocess.Popen(self.argv, env=self.env, **popen))  # type: ignore[call-overload]

    def _wait(self, proc: subprocess.Popen) -> int:
        def pass_on(signum, frame):
            self.terminated = True
            with contextlib.suppress(OSError):
                proc.send_signal(signal.SIGTERM)

        with on_sigterm(pass_on):
            try:
                return proc.wait()
            except KeyboardInterrupt:
                self.interrupted = True
                with contextlib.suppress(KeyboardInterrupt):
                    return proc.wait()
                return proc.poll() or EXIT_INTERRUPTED

    def signalled(self, code: int) -> int:
        """`code` as the job ended: 143 after SIGTERM, whatever the child said (torchrun's own is 1); 130 after
        Ctrl-C where the child said 0."""
        return EXIT_TERMINATED if self.terminated else EXIT_INTERRUPTED if self.interrupted and code == 0 else code


@contextlib.contextmanager
def on_sigterm(handler) -> Iterator[None]:
    """Install `handler` for SIGTERM if nobody else handles it (main thread only); restore afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    try:
        previous = signal.getsignal(signal.SIGTERM)
    except (ValueError, OSError):
        yield
        return
    if previous not in (signal.SIG_DFL, None):
        yield  # the script or its framework handles SIGTERM itself
        return
    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError, OSError):
            if signal.getsignal(signal.SIGTERM) is handler:
                signal.signal(signal.SIGTERM, previous)


def child_command(args: list[str], *, nproc: int = 0, extra: dict[str, str] | None = None) -> Child:
    """`python ARGS`, or with `nproc` >= 1 a torchrun of `nproc` local ranks each running `python ARGS`."""
    env = child_env(extra)
    if nproc < 1:
        return Child([sys.executable, *args], env)
    rid = uuid.uuid4().hex[:12]
    env.update({RUN_ID_ENV: rid, LAUNCHED_ENV: "1"})
    env.setdefault("OMP_NUM_THREADS", "1")
    return Child([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args],
                 env, rid)


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment, PYTHONPATH reaching this ac_diff, and `extra`."""
    env = {**os.environ, **(extra or {})}
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if _ROOT not in paths and _ROOT not in _site_dirs():
        env["PYTHONPATH"] = os.pathsep.join([*paths, _ROOT])
    return env


def _site_dirs() -> set[str]:
    dirs = set(site.getsitepackages()) if hasattr(site, "getsitepackages") else set()
    with contextlib.suppress(Exception):
        dirs.add(site.getusersitepackages())
    return {str(Path(d).resolve()) for d in dirs}
