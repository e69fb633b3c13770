"""The errors ac-diff reports to the user, and the exit codes of the command line.

    raise InputError("no trace in out/: run `ac-diff run -o out train.py` first")
    # the CLI prints `ac-diff: error: no trace in out/: ...` and exits with InputError.exit_code (2)

Every error the CLI turns into one line derives from `AcDiffError`; the class says the exit code, the
message says what to do. Anything else escaping a command is ac-diff's own bug (exit 3, `EXIT_INTERNAL`).
"""

from __future__ import annotations

EXIT_CLEAN = 0
EXIT_DIVERGED = 1
EXIT_BAD_INPUT = 2
EXIT_INTERNAL = 3
EXIT_UNCHECKED = 4  # no region diverged, but nothing (or not everything: the run crashed) was compared


class AcDiffError(Exception):
    """An error the user can fix; the CLI prints the message as one line and exits with `exit_code`."""

    exit_code: int = EXIT_BAD_INPUT


class InputError(AcDiffError):
    """Bad input named by the user (missing file, not a trace or log): the message says what to do."""


class Terminated(SystemExit):
    """SIGTERM while the script ran (a scheduler's or torchrun's stop): the script ends as with Ctrl-C, the trace is
    finished and the run is reported as interrupted; the exit code is a shell's for SIGTERM (143)."""

    def __init__(self) -> None:
        super().__init__(128 + 15)

    def __str__(self) -> str:
        return "the process received SIGTERM"


INTERRUPTIONS = (KeyboardInterrupt, Terminated)  # what stops a script from outside it: Ctrl-C, SIGTERM
