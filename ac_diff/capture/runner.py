"""Run a script or module exactly as `python` would, with the recorder on, and always finish the trace.

    outcome = run_target("train.py", ["--steps", "2"], module=False, recorder=Recorder(...))
    outcome.exit_code   # what `python train.py --steps 2` would have exited with
    outcome.exception   # the script's uncaught exception (its traceback already printed), or None

Like python: `sys.argv` is [script, *args] (for -m, the module's file), `sys.path[0]` is the
script's directory (for -m, the working directory), `__name__ == "__main__"`, and SystemExit
codes map to exit codes the same way. The script's traceback is printed without ac-diff's frames.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import sys
import threading
import traceback
from dataclasses import dataclass
from importlib.util import find_spec
from typing import Any

from ..errors import AcDiffError, Terminated
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


_owner: int | None = None  # the process run_target runs the script in (not a process the script forked)


def _os_exit(code: int) -> None:
    if threading.current_thread() is threading.main_thread() and os.getpid() == _owner:
        raise _HardExit(code)
    # another thread (a watchdog): the main thread cannot be unwound from here; a forked process (a DataLoader
    # worker ends with os._exit): it ends on the spot, as it asked, leaving the parent's trace and report alone
    _real_os_exit(code)


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
        where = spec.submodule_search_locations  # (a package runs its __main__; looked for, not imported)
        if where is not None and not any(os.path.isfile(os.path.join(d, "__main__.py")) for d in where):
            raise TargetNotFound(f"{target!r} is a package without a __main__ module: name the module that trains "
                                 f"(-m {target}.train)")
    elif os.path.isdir(target):
        raise TargetNotFound(f"{target} is a directory: name the training script in it (or a package's module: -m)")
    elif not os.path.isfile(target):
        raise TargetNotFound(f"script not found: {target}")


class _Argv(list):
    """sys.argv as python gives a script, argv[0] as typed, while the script runs from its absolute path (so its
    `__file__` is absolute, as python 3.9+ makes it): runpy writes the path it runs into argv[0]; this keeps what was
    typed there instead. Pickled as the plain list it is (multiprocessing's spawn sends sys.argv)."""

    def __init__(self, items: list[str], *, typed: str, absolute: str) -> None:
        super().__init__(items)
        self._typed, self._absolute = typed, absolute

    def __setitem__(self, index: Any, value: Any) -> None:
        if index == 0 and value == self._absolute:
            value = self._typed
        super().__setitem__(index, value)

    def __reduce__(self) -> tuple:
        return list, (list(self),)


def run_target(target: str, args: list[str], *, module: bool, recorder: Any, example: bool = False) -> Outcome:
    """Run the target under the recorder; the recorder is stopped (trace finished) before returning.

    A process the script forks (a DataLoader worker, `os.fork()`) never returns from here: it ends like the forked
    process it is (`_end_forked_child`), without touching the trace or reporting. `example`: the target is ac-diff's
    bundled example, not the user's script: its stdout goes to stderr (stdout carries only the report) and its
    error is one line (`_print_script_error`)."""
    saved_argv, saved_path0 = list(sys.argv), sys.path[0] if sys.path else None
    if module:
        sys.path[0:1] = [os.getcwd()] if sys.path else [os.getcwd()]
        sys.argv = [target, *args]
    else:
        script = os.path.abspath(target)
        sys.path[0:1] = [os.path.dirname(script)]
        sys.argv = _Argv([target, *args], typed=target, absolute=script)
    global _owner
    _owner = os.getpid()
    recorder.start()
    ended: BaseException | None = None
    os._exit = _os_exit
    try:
        with contextlib.redirect_stdout(sys.stderr) if example else contextlib.nullcontext():
            if module:
                spec = find_spec(target)
                if spec is not None and spec.origin:
                    sys.argv[0] = spec.origin
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(script, run_name="__main__")  # (absolute: `__file__` as python sets it)
    except BaseException as exc:  # noqa: BLE001 - whatever ended the script is reported as python would
        ended = exc
    try:
        exit_code, exception, hard_exit = _how_it_ended(ended)
        if os.getpid() != _owner:
            _end_forked_child(exit_code, exception)
        finishing.set()
        recorder.stop(_stop_reason(ended, exit_code), exit_code)
        if exception is not None:
            _print_script_error(exception, short=example and not os.environ.get("AC_DIFF_DEBUG"))
    finally:
        os._exit = _real_os_exit
        finishing.clear()
        sys.argv = saved_argv
        if saved_path0 is not None and sys.path:
            sys.path[0] = saved_path0
        sys.stdout.flush()
    return Outcome(exit_code, exception, hard_exit)


def _how_it_ended(ended: BaseException | None) -> tuple[int, BaseException | None, bool]:
    """(exit code as python's, the exception to print a traceback for, whether the script called os._exit)."""
    if ended is None:
        return 0, None, False
    if isinstance(ended, _HardExit):
        return ended.code, None, True
    if isinstance(ended, SystemExit):
        return _exit_code(ended), None, False
    return (130 if isinstance(ended, KeyboardInterrupt) else 1), ended, False


class ExitDuringBackward(Exception):
    """The script exited (sys.exit, os._exit) inside a backward: the forwards that backward had yet to reach were
    never recomputed, as after a crash, whatever the exit code (its name: trace.format.EXIT_DURING_BACKWARD)."""


def _stop_reason(ended: BaseException | None, exit_code: int) -> BaseException | None:
    """What the recorder is told ended the script: nothing for a clean exit (code 0), an ExitDuringBackward for an
    exit from inside a backward (a hook's sys.exit); a SIGTERM there is an interruption (Ctrl-C's), not an exit."""
    if isinstance(ended, (SystemExit, _HardExit)) and not isinstance(ended, Terminated):
        from .sourceline import raised_at
        from .torch_compat import left_a_backward

        if left_a_backward(ended):
            where = raised_at(ended)
            return ExitDuringBackward(f"exit code {exit_code}" + (f" from {where}" if where else "")).with_traceback(
                ended.__traceback__)
        if exit_code == 0:
            return None
    return SystemExit(exit_code) if isinstance(ended, _HardExit) else ended


def _end_forked_child(exit_code: int, exception: BaseException | None) -> None:
    """A process the script forked got to the end of the script (its code after fork() returned 0): it ends as
    that process, with python's traceback for an error, but without finishing the parent's trace, reporting, or
    running the exit handlers it inherited from the parent (which would act a second time on the parent's state)."""
    if exception is not None:
        _print_script_error(exception, short=False)
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    _real_os_exit(exit_code)


def _print_script_error(exc: BaseException, short: bool) -> None:
    """The script's error: python's traceback, or (`short`) its last line only, for the bundled example whose
    error is expected (`AC_DIFF_DEBUG=1` shows the traceback)."""
    if short:
        sys.stdout.flush()
        first = (str(exc).strip().splitlines() or [""])[0]
        name = f"{type(exc).__module__}.{type(exc).__qualname__}".removeprefix("builtins.")
        print(f"the example raised {name}: {first}  (as expected; AC_DIFF_DEBUG=1 shows the traceback)",
              file=sys.stderr)
        return
    _print_script_traceback(exc)


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
