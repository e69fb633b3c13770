"""The `ac-diff` command line: parses arguments and calls the library (one module per subcommand).

Exit codes: `report`/`compare`: 0 clean, 1 divergence found, 2 bad input, 4 unchecked; `run`: the script's own
exit code (with --check, 1 if the script succeeded but a region diverged); 3: ac-diff failed itself.

One vocabulary on every command: `-o DIR` is the directory a command writes into (run, fix, demo, audit),
`--report FILE` the report in --format, `--json FILE` the JSON besides; every path is resolved when ac-diff starts
and checked before the script runs (commands/outputs.py).
"""

from __future__ import annotations

import contextlib
import difflib
import os
import sys
from typing import Annotated, List, Optional

import typer
from typer.core import TyperArgument, TyperCommand

from ._version import __version__
from .commands.choices import COMPILED, EXPORT_FORMATS, EXPORT_TABLES, REPORT_FORMATS, SCOPES, WRITES, complete
from .commands.common import fail
from .commands.outputs import hold_directory, output_dir as checked_dir, output_file
from .errors import EXIT_INTERNAL, AcDiffError, InputError
from .streams import describe_os_error


class _Command(TyperCommand):
    """A command whose help names an argument by its metavar alone (`SCRIPT|MODULE`, not `SCRIPT|MODULE <str>`)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        for param in self.params:
            if isinstance(param, TyperArgument) and param.metavar:
                param.display_type_rich = lambda ctx: None


app = typer.Typer(
    name="ac-diff",
    help="Find where and why an activation-checkpointed region's recompute diverged from its forward.",
    add_completion=True,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _version(value: bool) -> None:
    if value:
        import torch

        print(f"ac-diff {__version__} (torch {torch.__version__}, python {sys.version.split()[0]})")
        raise typer.Exit(0)


CONFIG_HELP = "Settings file (default: ./ac-diff.yaml when present); options given on the command line win."


@app.callback(epilog="\b\nExample:\n  ac-diff demo\n  ac-diff run -o out train.py && ac-diff report out --format html "
              "--report report.html\n\n\bSettings: ac-diff.yaml in the working directory (or --config FILE) holds rtol, atol, "
              "ignore_ops,\ndiscrete_ops, keep_values, max_regions, output_dir, format, ... (see the README).")
def main_options(
    ctx: typer.Context,
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print versions and exit."),
    config: ConfigOption = None,
) -> None:
    """Record, diagnose and explain activation-checkpoint recompute divergence."""
    ctx.obj = {"config": config}


def _config(ctx: typer.Context, path: Optional[str]):
    """The settings: --config of the command, else of ac-diff, else ./ac-diff.yaml, else the defaults."""
    from .config import load_config

    cfg = load_config(path or (ctx.obj or {}).get("config"))
    if cfg.path is not None:
        print(f"ac-diff: settings from {cfg.path}", file=sys.stderr)
    return cfg


def _report_file(fmt: str, output: Optional[str], output_dir: Optional[str] = None) -> Optional[str]:
    """An HTML page goes to a file: OUTPUT_DIR/report.html for run/demo; never onto a terminal."""
    if fmt != "html" or output:
        return output
    if output_dir:
        return os.path.join(output_dir, "report.html")
    if sys.stdout.isatty():
        raise InputError("an HTML report goes to a file: pass --report report.html (or redirect stdout)")
    return output


def _output_file(ctx: typer.Context, param: typer.CallbackParam, path: Optional[str]) -> Optional[str]:
    """An output file given on the command line: resolved now and shown to be writable before anything runs
    (not after the whole training run); a problem names the option that gave the path. Shell completion, which
    parses the line without running it, checks nothing."""
    if ctx.resilient_parsing:
        return path
    out = ctx.params.get("output_dir")  # (-o is eager: parsed first)
    if path and path != "-" and out:
        folder, out = os.path.dirname(os.path.abspath(path)), os.path.abspath(out)
        if not os.path.isdir(folder) and os.path.commonpath([folder, out]) == out:
            checked_dir(folder, "-o")  # inside the output directory, which the run creates: made now
    return output_file(path, max(param.opts, key=len))


def _script(ctx: typer.Context, target: str) -> str:
    """The script comes after ac-diff's options: an option ac-diff does not know lands here (the script's own
    options follow the script) and is named as an unknown option, not as a missing script."""
    if target.startswith("-") and target != "-":
        known = [name for p in ctx.command.params for name in getattr(p, "opts", []) if name.startswith("-")]
        close = difflib.get_close_matches(target.split("=")[0], known, n=1)
        ctx.fail(f"No such option: {target}{f' (did you mean {close[0]}?)' if close else ''}; ac-diff's options go "
                 "before the script, the script's own after it")
    return target


def _held(directory: str):
    """The output directory held for this process's run (commands/outputs.py); under torchrun the launcher, or
    else rank 0, holds it for every rank."""
    from .commands import launch_cmd as launch

    return hold_directory(directory) if not launch.launched() and launch.rank() == 0 else contextlib.nullcontext()


# Options several commands take, declared once. A value of None means "from the settings" (ac-diff.yaml,
# else the default), which `Config.pick` also checks like the settings key. A default typer shows
# ([default: N]) is not repeated in the help text.
ConfigOption = Annotated[Optional[str], typer.Option("--config", metavar="FILE", help=CONFIG_HELP)]
FormatOption = Annotated[Optional[str], typer.Option(
    "--format", metavar="FORMAT", help=f"Report format: {', '.join(REPORT_FORMATS)} (default {REPORT_FORMATS[0]}).",
    autocompletion=complete(REPORT_FORMATS))]
JsonOption = Annotated[Optional[str], typer.Option("--json", metavar="FILE", help="Also write the JSON report to this file.",
                                                   callback=_output_file)]
RtolOption = Annotated[Optional[float], typer.Option("--rtol", metavar="X", help="Relative tolerance for value fingerprints (default 0: exact).")]
AtolOption = Annotated[Optional[float], typer.Option("--atol", metavar="X", help="Absolute tolerance for value fingerprints (default 0).")]
ReportOption = Annotated[Optional[str], typer.Option("--report", metavar="FILE", help="Write the report (--format, else "
                                                     "the file's suffix) to this file.", callback=_output_file)]
RunReportOption = Annotated[Optional[str], typer.Option(
    "--report", metavar="FILE", help="Write the report (--format) to this file (html: default OUTPUT_DIR/report.html).",
    callback=_output_file)]
# `report` / `compare` wrote the report file with -o before --report was the one name for it: still accepted
OldOutputOption = Annotated[Optional[str], typer.Option("-o", "--output", metavar="FILE", hidden=True,
                                                        callback=_output_file)]
CheckOption = Annotated[bool, typer.Option("--check", help="Accepted as with `run --check`: the exit code always "
                                                           "says the verdict (1 diverged, 4 unchecked).")]

CompiledOption = typer.Option(
    None, "--compiled", metavar="HOW", autocompletion=complete(COMPILED),
    help="keep (default): torch.compile'd code runs compiled; eager: it runs eagerly "
         "(torch.compiler.set_stance('force_eager'), also in the reference run and fix's tries), so checkpointed "
         "regions inside a compiled model are recorded.")


BudgetOption = typer.Option(
    None, "--reference-budget-mb", metavar="MB",
    help="Host memory for gradient values per rank per compared backward (default 64): every gradient is compared "
         "by fingerprint and norm on its device; values (a sample, or all of it) only within this budget.")


def _reference_budget(mb: Optional[float]) -> None:
    """--reference-budget-mb: set for this process and every process it starts ($AC_DIFF_REFERENCE_BUDGET_MB)."""
    from .reference.grads import BUDGET_ENV

    if mb is None:
        return
    if mb < 0:
        raise typer.BadParameter(f"--reference-budget-mb must be >= 0 (got {mb})")
    os.environ[BUDGET_ENV] = str(mb)


def _compiled_stance(compiled: Optional[str]) -> None:
    """--compiled: set for this process and every process it starts ($AC_DIFF_COMPILED, capture/compiled.py)."""
    from .capture.compiled import COMPILED_ENV

    if compiled is None:
        return
    if compiled not in COMPILED:
        raise typer.BadParameter(f"--compiled is one of {', '.join(COMPILED)} (got {compiled!r})")
    if compiled == "eager":
        os.environ[COMPILED_ENV] = "eager"
    else:
        os.environ.pop(COMPILED_ENV, None)


# The script and its arguments, taken the same way by every command that runs one (run, fix, audit).
ScriptTarget = Annotated[str, typer.Argument(metavar="SCRIPT|MODULE", help="The script to run (or module, with -m).",
                                             callback=_script)]
ScriptArgs = Annotated[Optional[List[str]], typer.Argument(metavar="ARGS", help="Arguments for the script.")]
ModuleFlag = Annotated[bool, typer.Option("-m", help="SCRIPT|MODULE is a module name, run like `python -m MODULE`.")]
SCRIPT_COMMAND = {"cls": _Command, "context_settings": {"allow_interspersed_args": False, "ignore_unknown_options": True}}


@app.command(**SCRIPT_COMMAND)
def run(
    ctx: typer.Context,
    target: ScriptTarget,
    args: ScriptArgs = None,
    module: ModuleFlag = False,
    output_dir: Optional[str] = typer.Option(None, "-o", "--output-dir", metavar="DIR", is_eager=True, help="Directory for the trace files (default ac-diff-out)."),
    force: bool = typer.Option(False, "--force", help="Overwrite an existing trace."),
    check: Optional[bool] = typer.Option(None, "--check/--no-check", help="Exit 1 if the script succeeded but a region diverged."),
    fmt: FormatOption = None,
    json_path: JsonOption = None,
    report_file: RunReportOption = None,
    max_regions: Optional[int] = typer.Option(None, "--max-regions", metavar="N", help="Record ops of the first N checkpointed regions only (default: all)."),
    keep_values: Optional[int] = typer.Option(None, "--keep-values", metavar="N", help="Max elements kept per discrete op output (0: none; default 16384)."),
    fingerprints: Optional[bool] = typer.Option(None, "--fingerprints/--no-fingerprints", help="Value fingerprints (--no-fingerprints: metadata only, cheapest)."),
    scope: Optional[str] = typer.Option(None, "--scope", metavar="SCOPE", help="regions (default): observe only checkpointed regions; all: also count other ops.",
                                        autocompletion=complete(SCOPES)),
    write: Optional[str] = typer.Option(None, "--write", metavar="WHICH", help="diverged (default): write the ops of regions that diverged, and of the first --keep-clean clean ones per module; a ~1 KB summary of every other region. all: every region's ops.",
                                        autocompletion=complete(WRITES)),
    keep_clean: Optional[int] = typer.Option(None, "--keep-clean", metavar="N", help="With --write diverged: clean regions per module written in full (default 1)."),
    watch: Optional[bool] = typer.Option(None, "--watch/--no-watch", help="Watch mode, cheap enough to leave on: no dispatch mode; saved tensors compared on the device; a module that diverged is recorded in full from then on."),
    watch_full_steps: Optional[int] = typer.Option(None, "--watch-full-steps", metavar="N", help="With --watch: record the first N steps in full (default 1)."),
    watch_resample: Optional[int] = typer.Option(None, "--watch-resample", metavar="N", help="With --watch: record a module whose regions watch compares by their outputs only (reentrant checkpoints) in full once every N steps, one such module a step (default 20; 0: never)."),
    full_from_step: Optional[int] = typer.Option(None, "--full-from-step", metavar="N", help="Record every region in full from step N on (watched before it); steps count from 1."),
    compiled: Optional[str] = CompiledOption,
    nproc_per_node: Optional[int] = typer.Option(None, "--nproc-per-node", metavar="N", help="Launch N processes with torchrun."),
    rtol: RtolOption = None,
    atol: AtolOption = None,
    config: ConfigOption = None,
    reference: Optional[str] = typer.Option(None, "--reference", metavar="no-ac", help="Then run the script again without AC and compare every parameter's gradient."),
    reference_steps: int = typer.Option(1, "--reference-steps", metavar="N", help="Backward passes compared with --reference."),
    reference_budget: Optional[float] = BudgetOption,
    no_ac: Optional[List[str]] = typer.Option(None, "--no-ac", metavar="GLOB", help="Remedy: run regions whose module matches without checkpointing ('*': all)."),
    preserve_rng: bool = typer.Option(False, "--preserve-rng", help="Remedy: force preserve_rng_state=True."),
    non_reentrant: bool = typer.Option(False, "--non-reentrant", help="Remedy: force use_reentrant=False."),
    deterministic: bool = typer.Option(False, "--deterministic", help="Remedy: torch.use_deterministic_algorithms(True) (+ CUBLAS_WORKSPACE_CONFIG)."),
    must_save: Optional[List[str]] = typer.Option(None, "--must-save", metavar="OP[,OP..]", help="Remedy: selective AC saves these ops (composed with the script's SAC policy)."),
    must_save_module: Optional[List[str]] = typer.Option(None, "--must-save-module", metavar="GLOB", help="With --must-save: only in modules matching GLOB."),
    restore: Optional[List[str]] = typer.Option(None, "--restore-in-recompute", metavar="NAME", help="Remedy: the recompute sees the forward's value of this buffer/attribute/generator (FQN glob; a module: its generators)."),
) -> None:
    """Run a training script like python would, recording every checkpointed region.

    Everything after the script belongs to it.

    \b
    Example:
      ac-diff run -o out train.py --steps 2
    """
    from .capture.runner import check_target

    cfg = _config(ctx, config)
    fmt = cfg.pick("format", fmt)
    _compiled_stance(compiled)
    _reference_budget(reference_budget)
    scope = cfg.pick("scope", scope)  # pick checks a given value like the settings key
    write = cfg.pick("write", write)
    try:
        options = cfg.record_options(keep_values=keep_values, max_regions=max_regions, fingerprints=fingerprints,
                                     scope=scope, write=write, keep_clean=keep_clean, watch=watch,
                                     watch_full_steps=watch_full_steps, watch_resample=watch_resample,
                                     full_from_step=full_from_step)
    except ValueError as exc:  # options that contradict each other (RecordOptions says which)
        raise typer.BadParameter(str(exc)) from None
    from .commands.run_extras import remedy_options

    remedies, reference = remedy_options(reference, reference_steps, no_ac, preserve_rng, non_reentrant,
                                         deterministic, must_save, must_save_module, restore)
    extra = {"remedies": remedies, "reference": reference, "reference_steps": reference_steps}
    if nproc_per_node is not None and nproc_per_node < 1:
        raise typer.BadParameter(f"--nproc-per-node must be an integer >= 1 (got {nproc_per_node})")
    check_target(target, module)  # a missing script first: that is the problem to report
    output_dir = checked_dir(cfg.pick("output_dir", output_dir))
    report_file = output_file(_report_file(fmt, report_file, output_dir), "--report")
    if nproc_per_node:
        from .commands.launch_cmd import launch_command, rank_argv

        argv = rank_argv(target, list(args or []), module=module, output_dir=output_dir, options=options, **extra)
        if cfg.path is not None:  # every rank reads the same settings file (ignore_ops, discrete_ops, ...)
            argv[1:1] = ["--config", str(cfg.path.resolve())]
        with _held(output_dir):
            raise typer.Exit(launch_command(nproc_per_node, argv, output_dir=output_dir, force=force,
                                            check=cfg.pick("check", check), fmt=fmt, json_path=json_path,
                                            output=report_file, settings=cfg.settings(rtol, atol), target=target,
                                            module=module, **extra))
    from .commands.run_cmd import run_command

    with _held(output_dir):
        code = run_command(target, list(args or []), module=module, output_dir=output_dir, force=force,
                           check=cfg.pick("check", check), fmt=fmt, json_path=json_path, output=report_file,
                           options=options, settings=cfg.settings(rtol, atol), **extra)
    raise typer.Exit(code)


@app.command(**SCRIPT_COMMAND)
def fix(
    ctx: typer.Context,
    target: ScriptTarget,
    args: ScriptArgs = None,
    module: ModuleFlag = False,
    output_dir: Optional[str] = typer.Option(None, "-o", "--output-dir", metavar="DIR", is_eager=True, help="Directory for the runs (default ac-diff-out/fix)."),
    max_tries: int = typer.Option(4, "--max-tries", metavar="N", help="Remedies tried at most (cheapest first)."),
    max_modules: Optional[int] = typer.Option(None, "--max-modules", metavar="N", help="Build remedies for the first N modules whose regions diverged (default: all)."),
    old_max_regions: Optional[int] = typer.Option(None, "--max-regions", hidden=True),  # what --max-modules was called
    steps: int = typer.Option(2, "--steps", metavar="N", help="Backward passes whose gradients are compared with the run without AC (a state the recompute updates twice shows in the second)."),
    jobs: int = typer.Option(1, "--jobs", metavar="N", help="Tries run at the same time."),
    compiled: Optional[str] = CompiledOption,
    nproc_per_node: Optional[int] = typer.Option(None, "--nproc-per-node", metavar="N", help="Run the script and every try with torchrun, N processes (1 too: a script that needs torchrun's environment)."),
    reference_budget: Optional[float] = BudgetOption,
    fmt: FormatOption = None,
    json_path: JsonOption = None,
    report_file: RunReportOption = None,
    config: ConfigOption = None,
    force: bool = typer.Option(False, "--force", help="Accepted as by every command: fix always replaces the runs an earlier fix left in its directory."),
) -> None:
    """Try each remedy on the script (one process per try) and say which one works.

    Exit 0 when a remedy was verified (or nothing needs fixing), 1 when none was.

    \b
    Example:
      ac-diff fix -o out --steps 3 train.py --lr 3e-4
    """
    from .capture.runner import check_target
    from .commands.fix_cmd import fix_command

    cfg = _config(ctx, config)
    fmt = cfg.pick("format", fmt)
    _compiled_stance(compiled)
    _reference_budget(reference_budget)
    check_target(target, module)
    if nproc_per_node is not None and nproc_per_node < 1:
        raise typer.BadParameter(f"--nproc-per-node must be an integer >= 1 (got {nproc_per_node})")
    output_dir = checked_dir(output_dir or os.path.join(cfg.output_dir, "fix"))
    with _held(output_dir):
        raise typer.Exit(fix_command(target, list(args or []), module=module, output_dir=output_dir,
                                     max_tries=max_tries, max_regions=max_modules if max_modules is not None
                                     else old_max_regions, steps=steps, jobs=jobs, fmt=fmt, json_path=json_path,
                                     output=output_file(_report_file(fmt, report_file, output_dir), "--report"),
                                     settings=cfg.settings(None, None), nproc=nproc_per_node or 0))


@app.command(**SCRIPT_COMMAND)
def audit(
    ctx: typer.Context,
    target: ScriptTarget,
    args: ScriptArgs = None,
    module: ModuleFlag = False,
    output_dir: Optional[str] = typer.Option(None, "-o", "--output-dir", metavar="DIR", is_eager=True, help="Directory for the HTML page of --format html (default ac-diff-out/audit)."),
    noise: str = typer.Option("1ulp", "--noise", metavar="NOISE", help="Noise injected into the scores of each decision: Nulp, rel:EPS, abs:EPS, or realistic (the rounding of the matmul that made them)."),
    seeds: int = typer.Option(3, "--seeds", metavar="N", help="Noisy replays per region."),
    max_regions: int = typer.Option(4, "--max-regions", metavar="N", help="Replay the first N checkpointed regions."),
    scale: Optional[str] = typer.Option(None, "--scale", metavar="SCALE", help="Target scale: tokens=N,layers=N,experts=N,steps=N (default: as audited)."),
    check: bool = typer.Option(False, "--check", help="Exit 1 if the script succeeded but a CheckpointError is likely (>= 50%) at --scale."),
    fmt: str = typer.Option(REPORT_FORMATS[0], "--format", metavar="FORMAT", help=f"{', '.join(REPORT_FORMATS)} (html: a page with a margin plot per site, OUTPUT_DIR/audit.html unless --report).",
                            autocompletion=complete(REPORT_FORMATS)),
    json_path: Optional[str] = typer.Option(None, "--json", metavar="FILE", help="Also write the audit JSON to this file.", callback=_output_file),
    report_file: ReportOption = None,
    html_path: Optional[str] = typer.Option(None, "--html", hidden=True, callback=_output_file),  # before --format html
    config: ConfigOption = None,
    nproc_per_node: Optional[int] = typer.Option(None, "--nproc-per-node", metavar="N", help="Launch N processes with torchrun (each rank audits its regions)."),
) -> None:
    """Run a training script and measure how close each checkpointed discrete decision is to flipping.

    Everything after the script belongs to it.

    \b
    Example:
      ac-diff audit --scale tokens=8192,layers=48 train.py --steps 2
    """
    if fmt not in REPORT_FORMATS:
        raise typer.BadParameter(f"audit --format is one of {', '.join(REPORT_FORMATS)}")
    if seeds < 1 or max_regions < 1:
        raise typer.BadParameter("--seeds and --max-regions take a number >= 1")
    from .capture.runner import check_target
    from .commands.audit_cmd import audit_command

    cfg = _config(ctx, config)
    check_target(target, module)
    if fmt == "html" and not report_file:
        report_file = output_file(os.path.join(checked_dir(output_dir or os.path.join(cfg.output_dir, "audit")),
                                               "audit.html"), "--report")
    if nproc_per_node is not None:
        from .commands.audit_cmd import launch_audit

        if nproc_per_node < 1:
            raise typer.BadParameter(f"--nproc-per-node must be an integer >= 1 (got {nproc_per_node})")
        argv = ["--noise", noise, "--seeds", str(seeds), "--max-regions", str(max_regions), "--format", fmt,
                *(["--scale", scale] if scale else []), *(["--check"] if check else []),
                *(["--json", json_path] if json_path else []), *(["--report", report_file] if report_file else []),
                *(["--config", str(cfg.path.resolve())] if cfg.path is not None else []), *(["-m"] if module else []),
                target, *(args or [])]
        raise typer.Exit(launch_audit(nproc_per_node, argv))
    raise typer.Exit(audit_command(target, list(args or []), module=module, noise=noise, seeds=seeds,
                                   max_regions=max_regions, scale=scale, check=check, fmt=fmt, json_path=json_path,
                                   html_path=html_path, report_path=report_file,
                                   discrete_ops=cfg.record_options().discrete_ops))


@app.command(cls=_Command)
def report(
    ctx: typer.Context,
    paths: List[str] = typer.Argument(..., metavar="PATH", help="Trace files, directories of traces, or logs ('-': standard input)."),
    fmt: FormatOption = None,
    json_path: JsonOption = None,
    report_file: ReportOption = None,
    output: OldOutputOption = None,
    check: CheckOption = False,
    rtol: RtolOption = None,
    atol: AtolOption = None,
    config: ConfigOption = None,
) -> None:
    """Diagnose recorded traces and print the report. Exit 0 clean, 1 diverged, 2 bad input, 4 unchecked.

    \b
    Example:
      ac-diff report ac-diff-out --format html --report report.html
    """
    from .commands.report_cmd import report_command

    cfg = _config(ctx, config)
    fmt = cfg.pick("format", fmt)
    raise typer.Exit(report_command(paths, fmt, json_path, _report_file(fmt, report_file or output),
                                    cfg.settings(rtol, atol)))


@app.command(cls=_Command)
def compare(
    ctx: typer.Context,
    paths: List[str] = typer.Argument(..., metavar="LOG_OR_TRACE [OTHER ...]", help="One log/trace, two to compare, or several logs (one per rank, say) explained as one report."),
    fmt: FormatOption = None,
    json_path: JsonOption = None,
    report_file: ReportOption = None,
    output: OldOutputOption = None,
    check: CheckOption = False,
    rtol: RtolOption = None,
    atol: AtolOption = None,
    config: ConfigOption = None,
) -> None:
    """Explain a log torch printed (CheckpointError, debug=True dump), or compare two logs/traces (several logs:
    explained together, as one report).

    Exit 0 clean, 1 diverged, 2 bad input, 4 unchecked.

    \b
    Example:
      ac-diff compare rank1.log
    """
    from .commands.compare_cmd import compare_command

    cfg = _config(ctx, config)
    fmt = cfg.pick("format", fmt)
    raise typer.Exit(compare_command(paths, fmt, json_path, _report_file(fmt, report_file or output),
                                     cfg.settings(rtol, atol)))


@app.command(cls=_Command)
def demo(
    ctx: typer.Context,
    output_dir: Optional[str] = typer.Option(None, "-o", "--output-dir", metavar="DIR", is_eager=True, help="Where the demo trace goes (default ac-diff-out/demo)."),
    fmt: FormatOption = None,
    json_path: JsonOption = None,
    report_file: RunReportOption = None,
    config: ConfigOption = None,
) -> None:
    """Run the bundled MoE example end to end and print its report (CPU, seconds).

    \b
    Example:
      ac-diff demo --format html
    """
    from .commands.demo_cmd import demo_command

    cfg = _config(ctx, config)
    fmt = cfg.pick("format", fmt)
    output_dir = checked_dir(output_dir or os.path.join(cfg.output_dir, "demo"))
    with _held(output_dir):
        raise typer.Exit(demo_command(output_dir, fmt, json_path,
                                      output_file(_report_file(fmt, report_file, output_dir), "--report")))


@app.command(cls=_Command)
def export(
    trace: str = typer.Argument(..., metavar="TRACE", help="A trace file, or a directory of traces (what `ac-diff run` wrote)."),
    what: str = typer.Option(EXPORT_TABLES[0], "--what", metavar="TABLE", help=f"{', '.join(EXPORT_TABLES)}.",
                             autocompletion=complete(EXPORT_TABLES)),
    fmt: Optional[str] = typer.Option(None, "--format", metavar="FORMAT", help=f"{', '.join(EXPORT_FORMATS)} (default: from -o's "
                                      "extension, else csv).", autocompletion=complete(EXPORT_FORMATS)),
    output: Optional[str] = typer.Option(None, "-o", "--output", metavar="FILE", help="File to write (default: stdout; not for parquet).",
                                          callback=_output_file),
) -> None:
    """Write a trace's ops, saved positions or regions as a table (the pandas views of ac_diff.load).

    List cells (shapes, args, fingerprints) are JSON text in CSV and parquet, native in JSONL.

    \b
    Example:
      ac-diff export ac-diff-out --what positions -o positions.csv
    """
    from .commands.export_cmd import export_command

    raise typer.Exit(export_command(trace, what, fmt, output))


def main(argv: list[str] | None = None) -> int:
    """Entry point: never lets a traceback of ac-diff's own escape; one line on stderr instead."""
    from .children import remember_start_dir

    remember_start_dir()  # (before a script this process runs can chdir)
    try:
        # without standalone mode click hands typer.Exit's code back as the return value
        code = app(args=argv, prog_name="ac-diff", standalone_mode=False)
        return code if isinstance(code, int) else 0
    except typer.Exit as exc:
        return exc.exit_code
    except SystemExit as exc:  # click's own exits (--help, usage errors after printing)
        return exc.code if isinstance(exc.code, int) else 0
    except AcDiffError as exc:
        return fail(str(exc), exc.exit_code)
    except FileExistsError as exc:
        return fail(str(exc))
    except OSError as exc:
        return fail(describe_os_error(exc))
    except typer.Abort:
        return fail("aborted", 130)
    except Exception as exc:  # click usage errors and ac-diff's own bugs
        if isinstance(exc, _usage_errors()):
            return fail(_usage_line(exc))
        if os.environ.get("AC_DIFF_DEBUG"):
            raise
        return fail(f"internal error: {type(exc).__name__}: {exc} (set AC_DIFF_DEBUG=1 for the traceback and "
                    "please report it)", EXIT_INTERNAL)


def _usage_errors() -> tuple[type, ...]:
    """The usage-error class of the click that typer runs on (its own vendored copy since typer 0.22, or
    the click package before): read from typer's BadParameter, so no click import is needed."""
    return tuple(cls for cls in typer.BadParameter.__mro__ if cls.__name__ == "ClickException")


def _usage_line(exc: Exception) -> str:
    """A click usage error as one line, with where to read the usage."""
    message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
    message = " ".join(message.split())
    if getattr(exc, "param", True) is None and getattr(exc, "param_hint", True) is None:  # (our own check's words)
        message = message.removeprefix("Invalid value: ")
    ctx = getattr(exc, "ctx", None)
    command = getattr(ctx, "command_path", None) or "ac-diff"
    return f"{message} (see `{command} --help`)"


def entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry()
