"""Run a script or module exactly as `python` would, with the recorder on, and always finish the trace.

    outcome = run_target("train.py", ["--steps", "2"], module=False, recorder=Recorder(...))
    outcome.exit_code   # what `python train.py --steps 2` would have exited with
    outcome.exception   # the script's uncaught exception (its traceback already printed), or None

Like python: `sys.argv` is [script, *args] (for -m, the module's file), `sys.path[0]` is the
script's directory (for -m, the working directory), `__name__ == "__main__"`, and SystemExit
codes map to exit codes the same way. The script's traceback is printed without ac-diff's frames.
"""

from __future__ import annotations

import os
import runpy
import sys
import threading
import traceback
from dataclasses import dataclass
from importlib.util import find_spec
from typing import Any

from ..errors import AcDiffError
from ..own_files import is_own_file


# Set from the moment the script has ended until run_target returns: ac-diff is finishing the trace, and a
# SIGTERM handler lets that complete instead of raising into it (commands/launch_cmd.sigterm_as_exit).
finishing = threading.Event()


class TargetNotFound(AcDiffError):
    """The script file or module does not exist."""


@dataclass
class Outcome:
    exit_code: int
    exception: BaseException | None
    hard_exit: bool = False  # the script called os._exit: the caller ends the process the same way (`end`)

    def end(self, code: int) -> int:
        """After ac-diff reported: a script that ended with os._exit ends so again (no atexit handlers, which such
        a script skips on purpose: a hanging process group); else the code to return."""
        if self.hard_exit:
            sys.stdout.flush()
            sys.stderr.flush()
            _real_os_exit(code)
        return code


class _HardExit(BaseException):
    """os._exit(code) called by the script's main thread: unwinds to run_target so the trace is finished and
    reported before the process ends (os._exit itself would end it on the spot, losing the report)."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


_real_os_exit = os._exit


def _os_exit(code: int) -> None:
    if threading.current_thread() is threading.main_thread():
        raise _HardExit(code)
    _real_os_exit(code)  # another thread (a watchdog): the main thread cannot be unwound from here


def _exit_code(exc: SystemExit) -> int:
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)  # python prints a non-int exit argument and exits 1
    return 1


def check_target(target: str, module: bool) -> None:
    if module:
        added = os.getcwd() not in sys.path
        if added:  # python -m finds modules in the working directory: look there too
            sys.path.insert(0, os.getcwd())
        try:
            spec = find_spec(target)
        except (ImportError, ValueError):
            spec = None
        finally:
            if added:
                sys.path.remove(os.getcwd())
        if spec is None:
            raise TargetNotFound(f"no module named {target!r} (is the package installed, or the working "
                                 "directory the one python -m would use?)")
    elif not os.path.isfile(target):
        raise TargetNotFound(f"script not found: {target}")


def run_target(target: str, args: list[str], *, module: bool, recorder: Any) -> Outcome:
    """Run the target under the recorder; the recorder is stopped (trace finished) before returning."""
    saved_argv, saved_path0 = list(sys.argv), sys.path[0] if sys.path else None
    if module:
        sys.path[0:1] = [os.getcwd()] if sys.path else [os.getcwd()]
        sys.argv = [target, *args]
    else:
        script = os.path.abspath(target)
        sys.path[0:1] = [os.path.dirname(script)]
        sys.argv = [target, *args]
    recorder.start()
    exception: BaseException | None = None
    exit_code, hard_exit = 0, False
    os._exit = _os_exit
    try:
        if module:
            spec = find_spec(target)
            if spec is not None and spec.origin:
                sys.argv[0] = spec.origin
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(target, run_name="__main__")
    except SystemExit as exc:
        finishing.set()
        exit_code = _exit_code(exc)
        recorder.stop(None if exit_code == 0 else exc, exit_code)
    except _HardExit as exc:
        finishing.set()
        exit_code, hard_exit = exc.code, True
        recorder.stop(None if exit_code == 0 else SystemExit(exit_code), exit_code)
    except KeyboardInterrupt as exc:
        finishing.set()
        exception, exit_code = exc, 130
        recorder.stop(exc, exit_code)
        _print_script_traceback(exc)
    except BaseException as exc:  # the script's own failure: report it as python would
        finishing.set()
        exception, exit_code = exc, 1
        recorder.stop(exc, exit_code)
        _print_script_traceback(exc)
    else:
        finishing.set()
        recorder.stop(None, 0)
    finally:
        os._exit = _real_os_exit
        finishing.clear()
        sys.argv = saved_argv
        if saved_path0 is not None and sys.path:
            sys.path[0] = saved_path0
        sys.stdout.flush()
    return Outcome(exit_code, exception, hard_exit)


def _print_script_traceback(exc: BaseException) -> None:
    """The traceback python would print: frames of ac-diff and runpy dropped from the top."""
    tb = exc.__traceback__
    while tb is not None and (is_own_file(tb.tb_frame.f_code.co_filename)
                              or os.path.basename(tb.tb_frame.f_code.co_filename) == "runpy.py"
                              or tb.tb_frame.f_code.co_filename.startswith("<frozen runpy")):
        tb = tb.tb_next
    sys.stdout.flush()
    shown = traceback.TracebackException(type(exc), exc, tb)
    _drop_own_frames(shown)
    print("".join(shown.format()), end="", file=sys.stderr)
    sys.stderr.flush()


def _drop_own_frames(te: traceback.TracebackException) -> None:
    """ac-diff's wrappers around torch internals are not part of the user's story (its bundled
    examples, installed inside the package, are)."""
    while te is not None:
        te.stack = traceback.StackSummary.from_list(
            [f for f in te.stack if not is_own_file(f.filename)])
        te = te.__cause__ or te.__context__
