"""The `ac-diff` command line: parses arguments and calls the library (one module per subcommand).

Exit codes: `report`/`compare`: 0 clean, 1 divergence found, 2 bad input; `run`: the script's own
exit code (with --check, 1 if the script succeeded but a region diverged); 3: ac-diff failed itself.
"""

from __future__ import annotations

import os
import sys
from typing import List, Optional

import typer

from . import __version__
from .commands.common import EXIT_BAD_INPUT, EXIT_INTERNAL, fail

app = typer.Typer(
    name="ac-diff",
    help="Find where and why an activation-checkpointed region's recompute diverged from its forward.",
    add_completion=True,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

FORMATS = ("terminal", "json", "html")


def _version(value: bool) -> None:
    if value:
        import torch

        print(f"ac-diff {__version__} (torch {torch.__version__}, python {sys.version.split()[0]})")
        raise typer.Exit(0)


@app.callback()
def main_options(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print versions and exit."),
) -> None:
    """Record, diagnose and explain activation-checkpoint recompute divergence."""


def _format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise typer.BadParameter(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    return fmt


def _settings(rtol: float, atol: float):
    from .diagnosis import Settings, Tolerance

    return Settings(tolerance=Tolerance(rtol=rtol, atol=atol))


@app.command(context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True})
def run(
    target: str = typer.Argument(..., metavar="SCRIPT|MODULE", help="The script to run (or module, with -m)."),
    args: Optional[List[str]] = typer.Argument(None, metavar="[ARGS]...", help="Arguments for the script."),
    module: bool = typer.Option(False, "-m", help="TARGET is a module name, run like `python -m TARGET`."),
    output_dir: str = typer.Option("ac-diff-out", "-o", "--output-dir", help="Directory for the trace files."),
    force: bool = typer.Option(False, "--force", help="Overwrite an existing trace."),
    check: bool = typer.Option(False, "--check", help="Exit 1 if the script succeeded but a region diverged."),
    fmt: str = typer.Option("terminal", "--format", help="Report format: terminal, json, html."),
    json_path: Optional[str] = typer.Option(None, "--json", help="Also write the JSON report to this file."),
    report_file: Optional[str] = typer.Option(None, "--report", help="Write the report (--format) to this file."),
    max_regions: Optional[int] = typer.Option(None, "--max-regions", help="Record ops of the first N regions only."),
    keep_values: int = typer.Option(16384, "--keep-values", help="Max elements kept per discrete op output (0: none)."),
    no_fingerprints: bool = typer.Option(False, "--no-fingerprints", help="Metadata only (cheapest; no values)."),
    scope: str = typer.Option("regions", "--scope", help="regions: observe only checkpointed regions; all: also count other ops."),
    nproc_per_node: Optional[int] = typer.Option(None, "--nproc-per-node", help="Launch N processes with torchrun."),
    rtol: float = typer.Option(0.0, "--rtol", help="Relative tolerance for value fingerprints (default exact)."),
    atol: float = typer.Option(0.0, "--atol", help="Absolute tolerance for value fingerprints."),
) -> None:
    """Run a training script like python would, recording every checkpointed region.

    Example: ac-diff run -o out train.py --steps 2    (everything after the script belongs to it)
    """
    from .recorder import RecordOptions

    _format(fmt)
    if scope not in ("regions", "all"):
        raise typer.BadParameter("--scope must be 'regions' or 'all'")
    options = RecordOptions(fingerprints=not no_fingerprints, keep_values=keep_values, max_regions=max_regions,
                            scope=scope)
    if nproc_per_node:
        from .commands.launch_cmd import launch_command

        raise typer.Exit(launch_command(nproc_per_node, sys.argv[1:]))
    from .commands.run_cmd import run_command

    code = run_command(target, list(args or []), module=module, output_dir=output_dir, force=force, check=check,
                       fmt=fmt, json_path=json_path, output=report_file, options=options,
                       settings=_settings(rtol, atol))
    raise typer.Exit(code)


@app.command()
def report(
    paths: List[str] = typer.Argument(..., help="Trace files, directories of traces, or logs."),
    fmt: str = typer.Option("terminal", "--format", help="terminal, json or html."),
    json_path: Optional[str] = typer.Option(None, "--json", help="Also write the JSON report to this file."),
    output: Optional[str] = typer.Option(None, "-o", "--output", help="Write the report (--format) to this file."),
    rtol: float = typer.Option(0.0, "--rtol", help="Relative tolerance for value fingerprints."),
    atol: float = typer.Option(0.0, "--atol", help="Absolute tolerance for value fingerprints."),
) -> None:
    """Diagnose recorded traces and print the report. Exit 0 clean, 1 diverged, 2 bad input.

    Example: ac-diff report ac-diff-out --json report.json
    """
    from .commands.report_cmd import report_command

    raise typer.Exit(report_command(paths, _format(fmt), json_path, output, _settings(rtol, atol)))


@app.command()
def compare(
    paths: List[str] = typer.Argument(..., metavar="LOG_OR_TRACE [OTHER]", help="One log/trace, or two to compare."),
    fmt: str = typer.Option("terminal", "--format", help="terminal, json or html."),
    json_path: Optional[str] = typer.Option(None, "--json", help="Also write the JSON report to this file."),
    output: Optional[str] = typer.Option(None, "-o", "--output", help="Write the report (--format) to this file."),
    rtol: float = typer.Option(0.0, "--rtol", help="Relative tolerance for value fingerprints."),
    atol: float = typer.Option(0.0, "--atol", help="Absolute tolerance for value fingerprints."),
) -> None:
    """Explain a log torch printed (CheckpointError, debug=True dump), or compare two logs/traces.

    Example: ac-diff compare rank1.log
    """
    if len(paths) > 2:
        raise typer.BadParameter("compare takes one or two paths")
    from .commands.compare_cmd import compare_command

    raise typer.Exit(compare_command(paths, _format(fmt), json_path, output, _settings(rtol, atol)))


@app.command()
def demo(
    output_dir: str = typer.Option(os.path.join("ac-diff-out", "demo"), "-o", "--output-dir", help="Where the demo trace goes."),
    fmt: str = typer.Option("terminal", "--format", help="terminal, json or html."),
    json_path: Optional[str] = typer.Option(None, "--json", help="Also write the JSON report to this file."),
    output: Optional[str] = typer.Option(None, "--report", help="Write the report (--format) to this file."),
) -> None:
    """Run the bundled MoE example end to end and print its report (CPU, seconds).

    Example: ac-diff demo
    """
    from .commands.demo_cmd import demo_command

    raise typer.Exit(demo_command(output_dir, _format(fmt), json_path, output))


def main(argv: list[str] | None = None) -> int:
    """Entry point: never lets a traceback of ac-diff's own escape; one line on stderr instead."""
    from .api import InputError
    from .runner import TargetNotFound
    from .trace import TraceFormatError

    try:
        app(args=argv, prog_name="ac-diff", standalone_mode=False)
    except typer.Exit as exc:
        return exc.exit_code
    except SystemExit as exc:  # click's own exits (--help, usage errors after printing)
        return exc.code if isinstance(exc.code, int) else 0
    except (InputError, TraceFormatError, TargetNotFound, FileExistsError) as exc:
        return fail(str(exc))
    except OSError as exc:
        return fail(f"{exc.filename or ''}: {exc.strerror or exc}".lstrip(": ") + "; check the path and permissions")
    except typer.Abort:
        return fail("aborted", 130)
    except Exception as exc:  # click usage errors and ac-diff's own bugs
        import click

        if isinstance(exc, click.ClickException):
            exc.show()
            return EXIT_BAD_INPUT
        if os.environ.get("AC_DIFF_DEBUG"):
            raise
        return fail(f"internal error: {type(exc).__name__}: {exc} (set AC_DIFF_DEBUG=1 for the traceback and "
                    "please report it)", EXIT_INTERNAL)
    return 0


def entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry()
