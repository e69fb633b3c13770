"""Issue 31, items 3-7 and 11: real-world script habits (os.chdir, DataLoader workers, two runs into one directory),
output paths checked before the script runs, one command-line vocabulary, and the smaller things.

Every test drives a real script, trace or file; those that spawn the CLI are marked e2e."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest
import typer

from ac_diff.cli import app, main
from conftest import run_cli

TINY = """\
import torch
from torch.utils.checkpoint import checkpoint
torch.manual_seed(0)
lin = torch.nn.Linear(8, 8)
x = torch.randn(4, 8, requires_grad=True)
checkpoint(lambda t: torch.relu(lin(t)), x, use_reentrant=False).sum().backward()
open(__file__ + ".ran", "w").close()
print("tiny done")
"""


@pytest.fixture
def tiny(tmp_path) -> Path:
    script = tmp_path / "tiny.py"
    script.write_text(TINY)
    return script


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> Path:
    """A real trace of a tiny checkpointed model, recorded in this process."""
    import torch
    from torch.utils.checkpoint import checkpoint

    import ac_diff

    path = tmp_path_factory.mktemp("trace") / "trace-rank0.jsonl"
    lin = torch.nn.Linear(4, 4)
    with ac_diff.record(path):
        checkpoint(lambda t: torch.relu(lin(t)), torch.randn(2, 4, requires_grad=True),
                   use_reentrant=False).sum().backward()
    return path


def _one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("ac-diff: error: "), stderr
    assert "Traceback" not in stderr and "[Errno" not in stderr, stderr
    return lines[0]


# -- 3. os.chdir() in the script ------------------------------------------------------------------
@pytest.mark.e2e
def test_paths_given_relative_are_resolved_before_the_script_changes_directory(tmp_path):
    """Hydra-style: the script chdirs into a new folder. -o, --json and --report still mean the folder ac-diff was
    started in (it used to look for rel_out/ in the script's new directory: exit 2, no report)."""
    script = tmp_path / "hydra_like.py"
    script.write_text(TINY.replace("torch.manual_seed(0)\n", "torch.manual_seed(0)\nimport os, tempfile\n"
                                                              "os.chdir(tempfile.mkdtemp())\n"))
    proc = run_cli("run", "-o", "rel_out", "--json", "rel.json", "--report", "rel.txt", script.name, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "error" not in proc.stderr and "CLEAN" in proc.stdout
    assert (tmp_path / "rel_out" / "trace-rank0.jsonl").is_file()
    assert json.loads((tmp_path / "rel.json").read_text())["verdict"] == "clean"
    assert "CLEAN" in (tmp_path / "rel.txt").read_text()


# -- 4. forked children ---------------------------------------------------------------------------
LOADER = """\
import torch
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset
torch.manual_seed(0)
lin = torch.nn.Linear(8, 8)
loader = DataLoader(TensorDataset(torch.randn(16, 8)), batch_size=4, num_workers=2, multiprocessing_context="fork")
for epoch in range(3):
    for (xb,) in loader:
        checkpoint(lambda t: torch.relu(lin(t)), xb.requires_grad_(), use_reentrant=False).sum().backward()
print("loader done")
"""

FORK = """\
import atexit, os, sys
import torch
from torch.utils.checkpoint import checkpoint
here = os.path.dirname(os.path.abspath(__file__))
atexit.register(lambda: open(os.path.join(here, "exit-handlers"), "a").write(f"{os.getpid()}\\n"))
x = torch.ones(3, requires_grad=True)
checkpoint(torch.sin, x, use_reentrant=False).sum().backward()
pid = os.fork()
if pid == 0:
    sys.exit(5)  # the child ends through the script's end, like any script would
_, status = os.waitpid(pid, 0)
open(os.path.join(here, "child-exit"), "w").write(str(os.waitstatus_to_exitcode(status)))
"""


def _reports(proc: subprocess.CompletedProcess) -> int:
    return proc.stdout.count("ac-diff: CLEAN") + proc.stdout.count("ac-diff: DIVERGED")


@pytest.mark.e2e
@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_dataloader_workers_do_not_report_or_write_the_trace(tmp_path):
    """A DataLoader with 2 forked workers over 3 epochs: one report and one end record, as python prints no more
    (every worker used to print a report, write an end record and fail its parent's exit handlers)."""
    script = tmp_path / "loader.py"
    script.write_text(LOADER)
    proc = run_cli("run", "-o", str(tmp_path / "out"), str(script))
    assert proc.returncode == 0, proc.stderr
    assert _reports(proc) == 1, proc.stdout
    assert proc.stderr.count("trace written to") == 1 and proc.stderr.count("next:") == 1, proc.stderr
    assert "AssertionError" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert (tmp_path / "out" / "trace-rank0.jsonl").read_text().count('"type":"end"') == 1


@pytest.mark.e2e
@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_a_forked_child_that_ends_the_script_ends_as_itself(tmp_path):
    """os.fork() in the script, the child exits 5 through sys.exit: the parent sees 5, and neither a second report,
    a second end record nor the parent's atexit handler comes from the child."""
    script = tmp_path / "forks.py"
    script.write_text(FORK)
    proc = run_cli("run", "-o", str(tmp_path / "out"), str(script))
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "child-exit").read_text() == "5"
    assert _reports(proc) == 1 and proc.stderr.count("trace written to") == 1, proc.stdout + proc.stderr
    assert (tmp_path / "out" / "trace-rank0.jsonl").read_text().count('"type":"end"') == 1
    assert len((tmp_path / "exit-handlers").read_text().split()) == 1  # the parent's own, once


# -- 5. two runs into one directory ---------------------------------------------------------------
WAITS = """\
import os, sys, time
import torch
from torch.utils.checkpoint import checkpoint
flag = sys.argv[1]
open(flag + ".started", "w").close()
deadline = time.time() + 120
while not os.path.exists(flag + ".go") and time.time() < deadline:
    time.sleep(0.05)
x = torch.ones(3, requires_grad=True)
checkpoint(torch.sin, x, use_reentrant=False).sum().backward()
"""


@contextlib.contextmanager
def _waiting_run(tmp_path: Path, env: dict) -> Iterator[subprocess.Popen]:
    """`ac-diff run -o same/ waits.py` started, and waiting (its script holds before its region) until the block
    ends; then it finishes."""
    waits = tmp_path / "waits.py"
    waits.write_text(WAITS)
    flag = str(tmp_path / "flag")
    first = subprocess.Popen([sys.executable, "-m", "ac_diff", "run", "-o", str(tmp_path / "same"), str(waits), flag],
                             env={**os.environ, "OMP_NUM_THREADS": "1", **env}, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while not os.path.exists(flag + ".started") and time.time() < deadline and first.poll() is None:
            time.sleep(0.05)
        assert os.path.exists(flag + ".started"), first.communicate()
        yield first
    finally:
        Path(flag + ".go").touch()
        first.out, first.err = first.communicate(timeout=300)


@pytest.mark.e2e
def test_a_second_run_into_a_directory_in_use_stops_with_one_line(tmp_path, tiny):
    """While one run records into same/, a second `run --force -o same` refuses at once (it used to replace the
    first run's trace, which then reported the other run's verdict); the first run reports its own."""
    with _waiting_run(tmp_path, {}) as first:
        second = run_cli("run", "--force", "-o", str(tmp_path / "same"), str(tiny))
        assert second.returncode == 2
        assert "in use by another ac-diff run" in _one_error_line(second.stderr)
        assert not Path(str(tiny) + ".ran").exists()
    assert first.returncode == 0, first.err
    assert "CLEAN" in first.out and "sin" in (tmp_path / "same" / "trace-rank0.jsonl").read_text()
    again = run_cli("run", "--force", "-o", str(tmp_path / "same"), str(tiny))  # free again once it ended
    assert again.returncode == 0, again.stderr


@pytest.mark.e2e
def test_a_rank_under_torchrun_holds_its_own_trace(tmp_path, tiny):
    """Under a plain torchrun only rank 0 held the directory: another launch's rank 1, with --force, replaced rank
    1's trace while the first launch wrote it (a stranger's diverged run then reported CLEAN). Rank 1 holds its
    trace: the second stops at once with one line."""
    rank1 = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"}
    with _waiting_run(tmp_path, rank1) as first:
        second = run_cli("run", "--force", "-o", str(tmp_path / "same"), str(tiny), env=rank1)
        assert second.returncode == 2, second.stderr
        assert "trace-rank1.jsonl is in use by another ac-diff run" in _one_error_line(second.stderr)
        assert not Path(str(tiny) + ".ran").exists()
    assert "sin" in (tmp_path / "same" / "trace-rank1.jsonl").read_text(), first.err[-2000:]


# -- 6. every output path checked before the script runs -------------------------------------------
@pytest.mark.e2e
@pytest.mark.parametrize("option", ["--report", "--json"])
def test_an_unwritable_output_file_stops_before_the_script_and_names_its_option(tmp_path, tiny, option):
    """A directory where the report file should go: found before the training runs, not after it."""
    (tmp_path / "adir").mkdir()
    proc = run_cli("run", "-o", str(tmp_path / "out"), option, str(tmp_path / "adir"), str(tiny))
    assert proc.returncode == 2
    line = _one_error_line(proc.stderr)
    assert option in line and "-o " not in line, line
    assert not Path(str(tiny) + ".ran").exists()


@pytest.mark.e2e
@pytest.mark.parametrize("order", ["o_first", "json_first"])
def test_a_report_file_inside_the_new_output_directory_is_fine(tmp_path, tiny, order):
    """`-o out --json out/r.json` on a fresh machine: the run creates out/, so the file inside it is not refused
    (a folder elsewhere that does not exist still is)."""
    out, report = tmp_path / "out", tmp_path / "out" / "r.json"
    args = ["-o", str(out), "--json", str(report)] if order == "o_first" else ["--json", str(report), "-o", str(out)]
    proc = run_cli("run", *args, str(tiny))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(report.read_text())["verdict"] == "clean"
    proc = run_cli("run", "-o", str(out), "--json", str(tmp_path / "elsewhere" / "r.json"), str(tiny))
    assert proc.returncode == 2 and "does not exist" in _one_error_line(proc.stderr)


@pytest.mark.e2e
@pytest.mark.skipif(not os.path.isdir("/sys/kernel"), reason="a path no one may write")
def test_a_path_no_one_may_write_names_the_option(tmp_path, tiny):
    target = "/sys/kernel/ac-diff-report.txt"
    try:
        open(target, "a").close()
        pytest.skip("this machine lets us write into /sys/kernel")
    except OSError:
        pass
    proc = run_cli("run", "-o", str(tmp_path / "out"), "--report", target, str(tiny))
    assert proc.returncode == 2
    line = _one_error_line(proc.stderr)
    assert "--report" in line and "(-o)" not in line, line
    assert not Path(str(tiny) + ".ran").exists()


# -- 7. the command line ----------------------------------------------------------------------------
@pytest.mark.parametrize("argv, named", [(["run", "--bogus", "tiny.py"], "--bogus"),
                                         (["audit", "--sceds", "2", "tiny.py"], "--sceds"),
                                         (["fix", "--forse", "tiny.py"], "--forse")])
def test_an_unknown_option_is_named_as_one(argv, named, capsys, tiny, monkeypatch):
    monkeypatch.chdir(tiny.parent)
    assert main(argv) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"No such option: {named}" in line and "script not found" not in line, line


def test_a_close_option_is_suggested(capsys, tiny, monkeypatch):
    monkeypatch.chdir(tiny.parent)
    assert main(["run", "--forc", "tiny.py"]) == 2
    assert "did you mean --force?" in capsys.readouterr().err


@pytest.mark.e2e
def test_audit_takes_an_output_directory_and_a_report_file(tmp_path, tiny):
    """`audit -o DIR` (it used to say "script not found: -o"): --format html writes DIR/audit.html; --report FILE
    writes the report in the format its suffix names."""
    proc = run_cli("audit", "-o", str(tmp_path / "out"), "--report", str(tmp_path / "a.json"), "--max-regions", "1",
                   "--seeds", "1", str(tiny))
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "a.json").read_text())["audit"]
    proc = run_cli("audit", "-o", str(tmp_path / "out"), "--format", "html", "--max-regions", "1", "--seeds", "1",
                   str(tiny))
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "out" / "audit.html").read_text().startswith("<!doctype html>")


def _help_records() -> list[tuple[str, str, str]]:
    """(command, option names, help text) of every visible option and argument of every command."""
    group = typer.main.get_command(app)
    rows = []
    for name, command in group.commands.items():
        ctx = command.make_context(name, [], resilient_parsing=True)
        for param in command.params:
            record = param.get_help_record(ctx)
            if record:
                rows.append((name, *record))
    return rows


def test_help_shows_each_default_once_and_names_what_a_value_is():
    """No "(default 3) [default: 3]", and FILE / DIR / GLOB / N instead of typer's <str> / <int>."""
    records = _help_records()
    assert len({name for name, _, _ in records}) >= 7
    twice = [r for r in records if len(re.findall(r"\bdefault\b", r[2])) > 1]
    assert not twice, twice
    typed = [r for r in records if re.search(r"<\w+(\[\w+\])?>", r[1])]
    assert not typed, typed


def test_one_vocabulary_across_commands():
    """-o is a directory wherever a command writes several files; the report file is --report everywhere; and
    --max-regions means the first N checkpointed regions wherever it appears."""
    group = typer.main.get_command(app)
    options: dict[str, dict[str, str]] = {}  # visible option name -> {command: help}
    for command_name, command in group.commands.items():
        for param in command.params:
            if param.param_type_name == "option" and not getattr(param, "hidden", False):
                for name in param.opts:
                    options.setdefault(name, {})[command_name] = param.help or ""
    for command in ("run", "fix", "demo", "audit"):
        assert options["-o"][command].startswith(("Directory", "Where")), (command, options["-o"][command])
        assert command in options["--report"], command
    for command in ("report", "compare"):
        assert command in options["--report"] and command not in options["-o"], command
    assert set(options["--max-regions"]) == {"run", "audit"}
    assert all("first N checkpointed regions" in text for text in options["--max-regions"].values())


def test_report_help_lists_every_exit_code(capsys):
    assert main(["report", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert all(f"{code} {what}" in out for code, what in ((0, "clean"), (1, "diverged"), (2, "bad input"),
                                                          (4, "unchecked"))), out


def test_report_accepts_check_and_report(trace, tmp_path, capsys):
    """`report --check` (as `run --check`) exits as `report` does; `--report FILE` writes the report there."""
    plain = main(["report", str(trace)])
    capsys.readouterr()
    assert main(["report", "--check", "--report", str(tmp_path / "r.json"), str(trace)]) == plain == 0
    assert json.loads((tmp_path / "r.json").read_text())["verdict"] == "clean"


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full, a device every write to fails with ENOSPC")
def test_a_report_file_that_cannot_be_written_loses_nothing_the_terminal_shows(trace, capsys):
    """26d: `--json` on a full disk printed no report at all, and its line named `-o`: the terminal report comes first,
    then one line naming the option and the file."""
    assert main(["report", str(trace), "--json", "/dev/full"]) == 2
    captured = capsys.readouterr()
    assert "CLEAN" in captured.out, captured.out
    line = _one_error_line(captured.err)
    assert line.startswith("ac-diff: error: --json /dev/full: No space left on device") and "(--json)" in line, line


# -- 11. the smaller ones ---------------------------------------------------------------------------
@pytest.mark.e2e
def test_the_next_command_is_shell_quoted(tmp_path, tiny):
    out = tmp_path / "out ü dir"
    proc = run_cli("run", "-o", str(out), str(tiny))
    assert proc.returncode == 0, proc.stderr
    line = next(line for line in proc.stderr.splitlines() if "next:" in line)
    assert f"ac-diff report '{out}'" in line, line


@pytest.mark.e2e
def test_standard_input_is_called_stdin(trace):
    proc = subprocess.run([sys.executable, "-m", "ac_diff", "report", "-"], input=trace.read_bytes(),
                          capture_output=True, timeout=300)
    stdout = proc.stdout.decode()
    assert proc.returncode == 0, proc.stderr
    assert "from <stdin>" in stdout and "ac-diff-input" not in stdout, stdout


def test_an_empty_file_is_called_empty(tmp_path, capsys):
    empty = tmp_path / "rank0.log"
    empty.write_bytes(b"")
    assert main(["report", str(empty)]) == 2
    assert "the file is empty" in _one_error_line(capsys.readouterr().err)


@pytest.mark.e2e
def test_an_output_directory_that_is_a_file_is_one_line(tmp_path, tiny):
    (tmp_path / "results.txt").write_text("mine")
    proc = run_cli("run", "-o", str(tmp_path / "results.txt"), str(tiny))
    assert proc.returncode == 2
    assert "not a directory" in _one_error_line(proc.stderr)
    assert (tmp_path / "results.txt").read_text() == "mine"


def test_a_newer_minor_version_loads_with_a_warning(trace, tmp_path, capsys):
    """A 1.9 trace with nothing this reader does not know: it loads, and the README's warning says so."""
    from ac_diff.trace import MAJOR, MINOR, decode_line, with_crc

    lines = trace.read_bytes().splitlines()
    header = decode_line(lines[0])
    header.pop("crc", None)
    header["version"] = f"{MAJOR}.{MINOR + 5}"
    newer = tmp_path / "newer.jsonl"
    newer.write_bytes(b"\n".join([with_crc(json.dumps(header, separators=(",", ":")).encode()), *lines[1:]]) + b"\n")
    assert main(["report", str(newer), "--json", str(tmp_path / "r.json")]) == 0
    err = capsys.readouterr().err
    assert "warning" in err and f"{MAJOR}.{MINOR + 5}" in err and "upgrade ac-diff" in err, err
    notes = json.loads((tmp_path / "r.json").read_text())["notes"]  # (a CI job reads the JSON, not stderr)
    assert any(f"format {MAJOR}.{MINOR + 5}" in n and "upgrade ac-diff" in n for n in notes), notes


@pytest.fixture(scope="module")
def demo_json(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path_factory.mktemp("demo") / "out"
    return run_cli("demo", "-o", str(out), "--format", "json"), out


@pytest.mark.e2e
def test_demo_json_is_json_on_stdout(demo_json):
    proc, _ = demo_json
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["verdict"] == "diverged"


@pytest.mark.e2e
def test_demo_shows_torchs_error_in_one_line_not_a_traceback(demo_json):
    proc, _ = demo_json
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "CheckpointError:" in line]
    assert len(errors) == 1 and "AC_DIFF_DEBUG=1" in errors[0], proc.stderr
    assert len(proc.stderr.splitlines()) <= 8, proc.stderr


@pytest.mark.e2e
def test_cells_do_not_break_mid_word_at_80_columns(demo_json):
    """The demo's report at 80 columns: a module name in a table wraps after a dot ("layers.1.moe." / "router")
    or not at all; never "layers.1.moe.r" / "outer", nor cut to "layers.1.moe.ex…"."""
    from rich.console import Console

    from ac_diff.api import read_runs
    from ac_diff.diagnosis import diagnose
    from ac_diff.render.terminal import render_terminal

    _, out = demo_json
    report = diagnose(read_runs([out], lazy=True))
    names = {r.module for r in report.regions if r.module}
    for r in report.regions:
        names |= {d.module for d in r.divergences() if d.module} | {p.module for p in r.positions if p.module}
    assert any(len(n) > 16 for n in names), names
    console = Console(width=80, file=io.StringIO(), record=True, color_system=None)
    render_terminal(report, console)
    broken = set()
    for line in console.export_text().splitlines():
        for token in re.findall(r"[\w.]+", line.replace("…", " ")):
            for name in names:
                if token != name and name.startswith(token) and name[len(token)] not in "./" \
                        and not token.endswith("."):
                    broken.add((token, name))
    assert not broken, broken


def test_a_region_begun_as_the_run_stopped_is_never_counted_clean(tmp_path):
    """Ctrl-C can land after the recorder began a region and before any of it was written (inside torch's
    checkpoint hooks): the end record counts it, the trace has nothing of it. The report counts it unchecked and
    says INTERRUPTED; it read CLEAN, and `report --check` passed (a stranger's runs, 2 of 7)."""
    import torch
    import torch.utils.checkpoint as cp
    from torch import nn

    import ac_diff

    torch.manual_seed(0)
    blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
    path = tmp_path / "t.jsonl"
    with pytest.raises(KeyboardInterrupt):
        with ac_diff.record(path):
            x = torch.randn(2, 8)
            for block in blocks:
                x = cp.checkpoint(block, x, use_reentrant=False)
            x.sum().backward()
            cp.checkpoint(blocks[0], x.detach(), use_reentrant=False)  # the next step's first region...
            raise KeyboardInterrupt  # ... and Ctrl-C
    lines = path.read_text().splitlines()
    # what the trace would hold had the interrupt come before the last region was written: nothing of region 2
    kept = [line for line in lines if json.loads(line).get("region") != 2]
    assert len(kept) < len(lines) and json.loads(kept[-1])["regions"] == 3
    path.write_text("\n".join(kept) + "\n")
    report = ac_diff.diagnose_paths([path])
    assert report.verdict == "unchecked" and report.title == "INTERRUPTED", report.headline
    assert [r.status for r in report.regions] == ["clean", "clean", "unchecked"]
    assert "the run stopped in its forward" in report.regions[2].unchecked_reason


@pytest.mark.parametrize("watch", [False, True])
def test_a_crash_between_the_forward_and_the_backward_is_placed_there(tmp_path, watch):
    """The script's own check raises after a step's forward, before its backward: the headline says so (it said
    "in the backward, after region N was recomputed"), and watch mode titles it CRASHED as full recording does
    (it said NOTHING CHECKED)."""
    import torch
    import torch.utils.checkpoint as cp
    from torch import nn

    import ac_diff

    torch.manual_seed(0)
    blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
    path = tmp_path / "t.jsonl"
    with pytest.raises(ValueError):
        with ac_diff.record(path, watch=watch):
            for step in range(3):
                x = torch.randn(2, 8)
                for block in blocks:
                    x = cp.checkpoint(block, x, use_reentrant=False)
                loss = x.pow(2).mean()
                if step == 2:
                    raise ValueError("loss check failed")
                loss.backward()
    report = ac_diff.diagnose_paths([path])
    assert report.title == "CRASHED", report.headline
    where = "crashed in step 3:" if watch else "crashed after the forward of region 5 (blocks.1), before its backward"
    assert where in report.headline, report.headline


def test_a_directory_given_as_the_script_is_called_one(tmp_path):
    (tmp_path / "scripts").mkdir()
    result = run_cli("run", "-o", str(tmp_path / "out"), str(tmp_path / "scripts"))
    assert result.returncode == 2
    assert "is a directory: name the training script in it" in result.stderr and "Traceback" not in result.stderr


def test_a_trace_cut_after_its_header_is_called_cut(trace, tmp_path):
    """Not "is activation checkpointing on?": the trace says nothing either way."""
    cut = tmp_path / "cut.jsonl"
    cut.write_text(Path(trace).read_text().splitlines()[0] + "\n")
    result = run_cli("report", str(cut))
    assert result.returncode == 4, result.stderr
    said = " ".join(result.stdout.replace("│", " ").split())  # (the headline box wraps a long path anywhere)
    assert "ends before any region was written" in said and "is activation checkpointing on" not in said


def test_report_of_a_directory_whose_traces_are_in_subdirectories_names_them(tmp_path):
    """`ac-diff fix -o out` writes out/base, out/try-1, ...: `report out` said "run `ac-diff run SCRIPT` first"."""
    for sub in ("base", "try-1"):
        (tmp_path / "out" / sub).mkdir(parents=True)
        (tmp_path / "out" / sub / "trace-rank0.jsonl").write_text("{}\n")
    proc = run_cli("report", str(tmp_path / "out"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "in its subdirectories base, try-1: pass one of them" in proc.stderr, proc.stderr


_RECORDS_ITSELF = """
import sys, torch, ac_diff
from torch.utils.checkpoint import checkpoint
torch.manual_seed(0)
blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(2))
scale = torch.ones(16)
with ac_diff.record(sys.argv[1]):
    for step in range(2):
        h = torch.randn(8, 16, requires_grad=True)
        for b in blocks:
            h = checkpoint(lambda x, b=b: torch.relu(b(x)) * scale, h, use_reentrant=False)
        scale.mul_(1.5)  # the recompute reads the scale the step's backward finds: every region diverges silently
        h.sum().backward()
"""


def test_a_script_that_records_itself_under_ac_diff_run_is_recorded_once(tmp_path):
    """A script using the library's `record` run under `ac-diff run` (24c): two recorders on one process, each seeing
    the other's work, and the run read NOTHING CHECKED (every region "unchecked", forward op counts doubled). The
    block now goes into the run's trace, and one line on stderr says so; its own path gets a copy of it when it ends."""
    script = tmp_path / "records_itself.py"
    script.write_text(_RECORDS_ITSELF)
    own, out = tmp_path / "own" / "trace-rank0.jsonl", tmp_path / "out"
    alone = subprocess.run([sys.executable, str(script), str(own)], capture_output=True, text=True, timeout=300)
    assert alone.returncode == 0 and own.exists(), alone.stderr
    assert run_cli("report", "--json", str(tmp_path / "alone.json"), str(own)).returncode == 1
    assert json.loads((tmp_path / "alone.json").read_text())["verdict"] == "diverged"
    own.unlink()
    r = run_cli("run", "--check", "-o", str(out), "--json", str(tmp_path / "run.json"), str(script), str(own))
    assert r.returncode == 1, r.stdout + r.stderr
    doc = json.loads((tmp_path / "run.json").read_text())
    assert doc["verdict"] == "diverged" and [r["status"] for r in doc["regions"]] == ["diverged"] * 4, doc["regions"]
    assert (f"recorded into that run's trace ({out / 'trace-rank0.jsonl'}), and a copy of it as it is when the block "
            f"ends is written to {own}") in r.stderr
    # (27d: the script that read its own trace next failed under `ac-diff run`: a finished copy is there to read)
    assert run_cli("report", "--json", str(tmp_path / "own.json"), str(own)).returncode == 1
    copied = json.loads((tmp_path / "own.json").read_text())
    assert copied["verdict"] == "diverged" and len(copied["regions"]) == 4, copied["headline"]
    assert copied["exit_status"] in (None, "ok") and "CUT SHORT" not in copied["title"], copied["title"]


_TRAINS_IN_SPAWNED = """
import torch, torch.multiprocessing as mp
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader
def worker(rank):
    torch.manual_seed(rank)
    block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.3))
    checkpoint(block, torch.randn(4, 8, requires_grad=True), use_reentrant=False,
               preserve_rng_state=False).sum().backward()
if __name__ == "__main__":
    for _ in DataLoader(list(range(4)), num_workers=1, multiprocessing_context="spawn"):
        pass  # (a spawned DataLoader worker is no training process)
    mp.spawn(worker, nprocs=2)
"""


def test_a_script_that_trains_in_spawned_processes_is_told_how_to_record_them(tmp_path):
    """mp.spawn (25d): the ranks ran AC in fresh interpreters ac-diff does not record, and the report asked "is
    activation checkpointing on?". It says the script spawned them, and how to record them; a spawned DataLoader
    worker is not counted."""
    script = tmp_path / "spawns.py"
    script.write_text(_TRAINS_IN_SPAWNED)
    r = run_cli("run", "-o", str(tmp_path / "out"), "--json", str(tmp_path / "r.json"), str(script), timeout=400)
    assert r.returncode == 0, r.stderr
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["verdict"] == "unchecked"
    assert doc["headline"].startswith("no checkpointed region ran in the process ac-diff recorded: the script started "
                                      "2 process(es) with multiprocessing's spawn"), doc["headline"]
    assert "--nproc-per-node N" in doc["headline"] and "is activation checkpointing on" not in doc["headline"]


_FUNC_GRAD_OVER_CHECKPOINT = """
import torch
from torch.utils.checkpoint import checkpoint

torch.manual_seed(0)
block = torch.nn.Linear(8, 8)
params = dict(block.named_parameters())

def loss(p, x):
    y = checkpoint(lambda t: torch.func.functional_call(block, p, (t,)).tanh(), x, use_reentrant=False)
    return y.square().mean()

for _ in range(2):
    grads = torch.func.grad(loss)(params, torch.randn(4, 8))
"""


def test_a_checkpoint_call_torch_refuses_is_named_as_such(tmp_path):
    """33a: torch.func.grad over checkpointed code: torch raises in the first checkpoint() call ("torch.func
    transforms don't yet support saved tensor hooks"), which ac-diff read as "the script stopped before any [region]
    ran": the call that raised is AC's own."""
    script = tmp_path / "func_grad.py"
    script.write_text(_FUNC_GRAD_OVER_CHECKPOINT)
    r = run_cli("run", "-o", str(tmp_path / "out"), "--json", str(tmp_path / "r.json"), str(script), timeout=300)
    assert r.returncode != 0 and "Traceback" not in r.stderr.split("ac-diff:")[-1], r.stderr[-2000:]
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["headline"].startswith("no checkpointed region ran: the first checkpoint() call raised ("), \
        report["headline"]
    assert "saved tensor hooks" in report["headline"]
