"""The command line's small things: --version, --help with an example for every command, shell completion."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import ac_diff
from ac_diff.cli import app, main
from conftest import run_cli


def _commands() -> list[str]:
    return [c.name or c.callback.__name__ for c in app.registered_commands if not c.hidden]


def test_version(capsys):
    import torch

    assert main(["--version"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"ac-diff {ac_diff.__version__}") and torch.__version__ in out


def test_main_help_has_example_and_every_command(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "Example" in out and "ac-diff demo" in out and "ac-diff.yaml" in out
    for name in _commands():
        assert name in out
    assert "--install-completion" in out and "--show-completion" in out and "--config" in out


def test_expected_commands():
    assert {"run", "report", "compare", "demo", "export"} <= set(_commands())


@pytest.mark.parametrize("command", _commands())
def test_command_help_has_an_example(command, capsys):
    assert main([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert "Example" in out, f"`ac-diff {command} --help` has no example"
    example = out[out.index("Example"):].splitlines()[1].strip()
    assert example.startswith(f"ac-diff {command}"), example


@pytest.mark.parametrize("command", ["run", "fix"])
def test_the_common_force_option_is_taken_by_each_command_that_writes_runs(command, capsys):
    """The README lists --force among the common options: `fix --force` is no usage error (a stranger's was)."""
    assert main([command, "--help"]) == 0
    assert "--force" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["run", "report", "compare", "demo"])
def test_command_takes_config(command, capsys):
    assert main([command, "--help"]) == 0
    assert "--config" in capsys.readouterr().out


def test_show_completion_script(capsys, monkeypatch):
    # typer's --show-completion is a flag: the shell comes from the process tree (shellingham), which a test
    # runner started outside any shell (a CI container, a detached job) does not have
    import typer.completion

    monkeypatch.setattr(typer.completion, "_get_shell_name", lambda: "bash")
    assert main(["--show-completion"]) == 0
    out = capsys.readouterr().out
    assert "_AC_DIFF_COMPLETE" in out and "complete" in out


@pytest.mark.parametrize("words, cword, expected", [
    ("ac-diff ex", 1, ["export"]),
    ("ac-diff rep", 1, ["report"]),
    ("ac-diff export trace --what po", 4, ["positions"]),
    ("ac-diff export trace --format ", 4, ["csv", "parquet", "jsonl"]),
    ("ac-diff report out --format h", 4, ["html"]),
])
def test_completion(monkeypatch, capsys, words, cword, expected):
    """What bash would get back from `ac-diff` for a partial command line."""
    monkeypatch.setenv("_AC_DIFF_COMPLETE", "complete_bash")
    monkeypatch.setenv("COMP_WORDS", words)
    monkeypatch.setenv("COMP_CWORD", str(cword))
    main([])
    assert capsys.readouterr().out.split() == expected


@pytest.mark.parametrize("argv, words", [
    (["report", "--format", "xml", "out"], ["--format must be one of terminal, json, html", "'xml'"]),
    (["run", "--write", "sometimes", "train.py"], ["--write must be one of all, diverged"]),
    (["run", "--scope", "everything", "train.py"], ["--scope must be one of regions, all"]),
    (["report", "--rtol", "-1", "out"], ["--rtol must be a finite number >= 0 (got -1.0)"]),
    (["report", "--rtol", "nan", "out"], ["--rtol must be a finite number >= 0 (got nan)"]),
    (["compare", "--atol", "inf", "out"], ["--atol must be a finite number >= 0 (got inf)"]),
    (["run", "--max-regions", "-1", "train.py"], ["--max-regions must be an integer >= 0 (got -1)"]),
    (["run", "--keep-values", "-3", "train.py"], ["--keep-values must be an integer >= 0 (got -3)"]),
    (["run", "--nproc-per-node", "0", "train.py"], ["--nproc-per-node must be an integer >= 1 (got 0)"]),
    (["report", "--rtol", "abc", "x"], ["Invalid value for '--rtol'", "ac-diff report --help"]),
    (["report", "--no-such-option", "x"], ["No such option", "ac-diff report --help"]),
])
def test_a_bad_option_value_is_a_usage_error_not_an_internal_one(argv, words, capsys):
    """Bad option values, wherever they are checked: one line on stderr, exit 2."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "internal error" not in err and "Traceback" not in err
    assert all(w in err for w in words), err
    assert err.startswith("ac-diff: error: ") and err.count("\n") == 1, err


def test_short_labels_keep_host_values():
    from ac_diff.render.terminal import _short_label

    assert _short_label("aten._local_scalar_dense.default = 2.7244") == "_local_scalar_dense = 2.7244"
    assert _short_label("aten.topk.default(2, 1) -> f32[256, 2]") == "topk(2, 1) -> f32[256, 2]"
    assert _short_label("aten.view.default -> f32[2]") == "view -> f32[2]"


def test_an_output_file_in_a_missing_folder_stops_before_the_script_runs(tmp_path):
    """--json (and -o, --report, --html) into a folder that does not exist: one line, exit 2, and the training
    script never started (it used to run to the end and then fail to write)."""
    script = tmp_path / "train.py"
    script.write_text("open(__file__ + '.ran', 'w').close()\n")
    proc = run_cli("run", "-o", str(tmp_path / "out"), "--json", str(tmp_path / "nodir" / "r.json"), str(script))
    assert proc.returncode == 2 and "nodir" in proc.stderr and "does not exist" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert not (tmp_path / "train.py.ran").exists()
    exported = run_cli("export", str(tmp_path), "-o", str(tmp_path / "nodir" / "x.csv"))
    assert exported.returncode == 2 and "does not exist" in exported.stderr
    (tmp_path / "afile").write_text("")  # a file where the folder should be: said so, not "does not exist"
    proc = run_cli("run", "-o", str(tmp_path / "out"), "--json", str(tmp_path / "afile" / "r.json"), str(script))
    assert proc.returncode == 2 and "afile is a file, not a folder" in proc.stderr, proc.stderr


def test_a_log_from_standard_input_a_pipe_or_a_fifo_reads_like_the_file(tmp_path, demo):
    """`ac-diff compare -`, `report -`, `<(cmd)`, a named pipe: what is read from them is gone, so they are copied
    once, then read as the file would be (the FIFO used to hang: it was opened again, waiting for a writer)."""
    import os
    import subprocess
    import sys
    import threading

    trace = demo / "out" / "trace-rank0.jsonl"
    env = {**os.environ, "COLUMNS": "120"}
    plain = subprocess.run([sys.executable, "-m", "ac_diff", "report", str(trace), "--format", "json"],
                           capture_output=True, text=True, env=env, timeout=120)
    piped = subprocess.run([sys.executable, "-m", "ac_diff", "report", "-", "--format", "json"], input=trace.read_text(),
                           capture_output=True, text=True, env=env, timeout=120)
    assert piped.returncode == plain.returncode == 1, piped.stderr
    assert json.loads(piped.stdout)["headline"] == json.loads(plain.stdout)["headline"]
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_bytes(trace.read_bytes()))
    writer.start()
    via_fifo = subprocess.run([sys.executable, "-m", "ac_diff", "report", str(fifo), "--format", "json"],
                              capture_output=True, text=True, env=env, timeout=120)
    writer.join(5)
    assert via_fifo.returncode == 1 and json.loads(via_fifo.stdout)["headline"] == json.loads(plain.stdout)["headline"]


def test_the_demo_runs_the_example_of_the_checkout_it_was_imported_from(tmp_path):
    """A second checkout first on PYTHONPATH beside an editable install of another: its own examples/ (a stranger's
    demo ran the installed copy's example, and its `verify` commands pointed there)."""
    root = Path(ac_diff.__file__).resolve().parents[1]
    other = tmp_path / "checkout"
    shutil.copytree(root / "ac_diff", other / "ac_diff", ignore=shutil.ignore_patterns("__pycache__"))
    (other / "pyproject.toml").write_text((root / "pyproject.toml").read_text())
    (other / "examples").mkdir()
    (other / "examples" / "moe_bias_update.py").write_text("# this checkout's\n")
    out = subprocess.run([sys.executable, "-c", "from ac_diff.commands.demo_cmd import DEMO_SCRIPT, example_path; "
                          "print(example_path(DEMO_SCRIPT))"], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(other)}, cwd=tmp_path)
    assert out.stdout.strip() == str(other / "examples" / "moe_bias_update.py"), out.stdout + out.stderr


def test_json_to_stdout_leaves_stdout_to_the_json(demo):
    """35c P3-6: `report --json -` printed the terminal report and the JSON on stdout, which no program can parse: the
    terminal report goes to stderr then."""
    proc = run_cli("report", "--json", "-", str(demo / "out"))
    assert json.loads(proc.stdout)["verdict"] == "diverged", proc.stdout[:300]
    assert "ac-diff: DIVERGED" in proc.stderr and proc.returncode == 1
