"""ac-diff.yaml: parsing, errors (unknown key, wrong type, malformed YAML), and command-line overrides."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from ac_diff.cli import main
from ac_diff.config import CONFIG_NAME, KEYS, Config, ConfigError, load_config, parse_config
from ac_diff.diagnosis import Settings, Tolerance
from ac_diff.capture.recorder import RecordOptions


def write(tmp_path: Path, text: str, name: str = CONFIG_NAME) -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(text), encoding="utf-8")
    return p


# --- parsing --------------------------------------------------------------------------------------------------

def test_defaults_match_the_library():
    cfg = Config()
    assert cfg.record_options() == RecordOptions()
    assert cfg.settings() == Settings()
    assert set(KEYS) >= {"rtol", "atol", "ignore_ops", "discrete_ops", "keep_values", "max_regions", "output_dir",
                         "format"}


def test_every_key(tmp_path):
    cfg = load_config(write(tmp_path, """
        rtol: 1e-6            # PyYAML reads this as a string; accepted as a number
        atol: 0.5
        ignore_ops: [aten.detach.default, mylib.noise.default]
        discrete_ops: topk    # a short name: every overload torch knows
        keep_values: 128
        max_regions: 4
        fingerprints: false
        source_lines: false
        scope: all
        output_dir: runs/ac
        format: html
        check: true
        window_before: 1
        window_after: 2
    """))
    assert cfg.rtol == 1e-6 and cfg.atol == 0.5 and cfg.format == "html" and cfg.output_dir == "runs/ac"
    assert cfg.check is True and cfg.path == tmp_path / CONFIG_NAME
    opts = cfg.record_options()
    assert opts == RecordOptions(fingerprints=False, keep_values=128, source_lines=False, max_regions=4, scope="all",
                                 discrete_ops=frozenset({"aten.topk.default", "aten.topk.values"}),
                                 ignore_ops=frozenset({"aten.detach.default", "mylib.noise.default"}))
    assert cfg.settings() == Settings(tolerance=Tolerance(rtol=1e-6, atol=0.5), window_before=1, window_after=2)


def test_command_line_values_win():
    cfg = parse_config("keep_values: 8\nrtol: 0.1\nscope: all\nfingerprints: false\nmax_regions: 3\n")
    opts = cfg.record_options(keep_values=0, scope="regions", fingerprints=True, max_regions=None)
    assert (opts.keep_values, opts.scope, opts.fingerprints, opts.max_regions) == (0, "regions", True, 3)
    assert cfg.settings(rtol=0.0).tolerance == Tolerance(rtol=0.0, atol=0.0)
    assert cfg.settings().tolerance.rtol == 0.1


def test_found_in_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert load_config() == Config() and load_config().path is None
    write(tmp_path, "format: json\n")
    assert load_config().format == "json"
    assert load_config(write(tmp_path, "format: html\n", "other.yaml")).format == "html"  # --config wins


def test_empty_file_is_the_defaults():
    assert parse_config("") == Config() and parse_config("# nothing yet\n") == Config()


# --- errors ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("rtoll: 1e-6\n", ["unknown key 'rtoll'", "did you mean rtol?", "valid keys: rtol, atol, ignore_ops"]),
    ("colour: red\n", ["unknown key 'colour'", "valid keys:", "format"]),
    ("rtol: abc\n", ["rtol must be a number", "got a string 'abc'"]),
    ("rtol: -1\n", ["rtol must be a finite number >= 0"]),
    ("keep_values: 1.5\n", ["keep_values must be an integer >= 0", "got a number 1.5"]),
    ("keep_values: true\n", ["keep_values must be an integer >= 0", "got a boolean"]),
    ("format: pdf\n", ["format must be one of terminal, json, html", "'pdf'"]),
    ("scope: everything\n", ["scope must be one of regions, all"]),
    ("fingerprints: maybe\n", ["fingerprints must be true or false"]),
    ("ignore_ops: [1, 2]\n", ["ignore_ops must be a list of op names"]),
    ("discrete_ops: [no_such_op_anywhere]\n", ["discrete_ops:", "'no_such_op_anywhere' is not an op torch knows",
                                                "aten.topk.default"]),
    ("output_dir: {a: 1}\n", ["output_dir must be a non-empty string", "got a mapping"]),
    ("- rtol\n- atol\n", ["expected a mapping", "got a list"]),
    ("rtol: [1\n", ["malformed YAML at line 2", "fix the syntax"]),
    ("rtol: 1\n  atol: 2\n", ["malformed YAML at line 2"]),
    ("format: 'json\n", ["malformed YAML"]),
])
def test_errors_name_the_key_and_the_choices(text, expected):
    with pytest.raises(ConfigError) as info:
        parse_config(text, origin="ac-diff.yaml")
    message = str(info.value)
    assert message.startswith("ac-diff.yaml: ") and "\n" not in message
    for part in expected:
        assert part in message


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")


@pytest.mark.parametrize("text, key", [("rtoll: 1\n", "rtoll"), ("atol: high\n", "atol"), ("rtol: [\n", "malformed")])
def test_cli_rejects_bad_config_with_one_line(demo, tmp_path, capsys, monkeypatch, text, key):
    monkeypatch.chdir(tmp_path)
    write(tmp_path, text)
    assert main(["report", str(demo / "out")]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ac-diff: error: ") and key in lines[0]


# --- the command line over the config --------------------------------------------------------------------------

def test_cli_format_from_config_and_override(demo, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "format: json\n")
    assert main(["report", str(demo / "out")]) == 1
    captured = capsys.readouterr()
    assert json.loads(captured.out)["verdict"] == "diverged"
    assert f"settings from {tmp_path / CONFIG_NAME}" in captured.err
    assert main(["report", str(demo / "out"), "--format", "terminal"]) == 1
    assert "ac-diff: DIVERGED" in capsys.readouterr().out


def test_cli_tolerance_from_config_and_override(demo, tmp_path, capsys):
    """A huge atol hides the float divergence of the router's add (topk's indices still differ); --atol 0 wins."""
    cfg = write(tmp_path, "atol: 1.0e9\nformat: json\n", "loose.yaml")
    assert main(["report", "--config", str(cfg), str(demo / "out")]) == 1
    region = [r for r in json.loads(capsys.readouterr().out)["regions"] if r["status"] == "diverged"][0]
    assert region["first_value_divergence"]["op"] == "aten.topk.default"
    assert main(["--config", str(cfg), "report", str(demo / "out"), "--atol", "0"]) == 1  # global --config
    region = [r for r in json.loads(capsys.readouterr().out)["regions"] if r["status"] == "diverged"][0]
    assert region["first_value_divergence"]["op"] == "aten.add.Tensor"


def test_command_config_beats_global_config(demo, tmp_path, capsys):
    bad = write(tmp_path, "colour: red\n", "bad.yaml")
    good = write(tmp_path, "format: json\n", "good.yaml")
    assert main(["--config", str(bad), "report", "--config", str(good), str(demo / "out")]) == 1
    assert json.loads(capsys.readouterr().out)["verdict"] == "diverged"


@pytest.mark.parametrize("how", ["flags", "config"])
def test_run_refuses_watch_without_fingerprints_with_one_line(tmp_path, capsys, monkeypatch, how):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    if how == "config":
        write(tmp_path, "fingerprints: false\nwatch: true\n")
    assert main(["run", *(["--watch", "--no-fingerprints"] if how == "flags" else []), "train.py"]) == 2
    err = capsys.readouterr().err
    assert "--no-fingerprints cannot be combined with --watch" in err and "Traceback" not in err, err
    assert "ac-diff: error: --no-fingerprints" in err, err  # (not click's "Invalid value: " before ac-diff's words)
    assert not (tmp_path / "ac-diff-out").exists()


def test_run_passes_config_and_overrides_to_the_recorder(tmp_path, monkeypatch):
    """`run` builds RecordOptions / Settings from the config, with the options given on the command line on top."""
    from ac_diff.commands import run_cmd

    calls = []
    monkeypatch.setattr(run_cmd, "run_command", lambda target, args, **kw: calls.append((target, args, kw)) or 0)
    monkeypatch.chdir(tmp_path)
    write(tmp_path, """
        ignore_ops: [aten.mul.Tensor]
        discrete_ops: [aten.add.Tensor]
        keep_values: 64
        scope: all
        write: diverged
        output_dir: traces
        format: json
        check: true
        rtol: 0.01
    """)
    (tmp_path / "train.py").write_text("")  # the script must exist: it is checked before anything runs
    assert main(["run", "train.py", "--lr", "3"]) == 0
    target, args, kw = calls[-1]
    assert (target, args) == ("train.py", ["--lr", "3"])
    assert kw["options"] == RecordOptions(keep_values=64, scope="all", ignore_ops=frozenset({"aten.mul.Tensor"}),
                                          discrete_ops=frozenset({"aten.add.Tensor"}), write="diverged")
    assert kw["settings"].tolerance == Tolerance(rtol=0.01, atol=0.0)
    # every path is resolved when ac-diff starts (a script's os.chdir() must not move them)
    assert (kw["output_dir"], kw["fmt"], kw["check"], kw["output"]) == (str(tmp_path / "traces"), "json", True, None)

    assert main(["run", "--keep-values", "0", "--scope", "regions", "--no-check", "--rtol", "0", "--format", "html",
                 "-o", "elsewhere", "--no-fingerprints", "--write", "all", "train.py"]) == 0
    _, _, kw = calls[-1]
    assert (kw["options"].keep_values, kw["options"].scope, kw["options"].fingerprints) == (0, "regions", False)
    assert kw["options"].write == "all"
    assert kw["options"].ignore_ops == frozenset({"aten.mul.Tensor"})  # not overridden: still the config's
    assert kw["settings"].tolerance.rtol == 0.0 and kw["check"] is False
    assert (kw["output_dir"], kw["fmt"]) == (str(tmp_path / "elsewhere"), "html")
    assert kw["output"] == str(tmp_path / "elsewhere" / "report.html")  # an HTML page needs a file
