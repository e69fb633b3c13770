"""`ac-diff export`: a trace's tables written as csv / jsonl / parquet read back to the same rows."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest

import ac_diff
from ac_diff.cli import main
from ac_diff.commands import export_cmd
from ac_diff.commands.export_cmd import JSON_COLUMNS, read_table, resolve_format

WHAT = ("ops", "positions", "regions")


@pytest.fixture(scope="module")
def trace(demo):
    return ac_diff.load(demo / "out")


def _value(v):
    if v is None or v is pd.NA:
        return None
    if isinstance(v, float) and math.isnan(v):
        return None
    if hasattr(v, "item") and not isinstance(v, (str, bytes, list, dict)):
        return _value(v.item())
    if isinstance(v, tuple):
        return list(v)
    return v


def rows(df: pd.DataFrame) -> list[dict]:
    return [{k: _value(v) for k, v in rec.items()} for rec in df.to_dict("records")]


@pytest.mark.parametrize("fmt", ["csv", "jsonl", "parquet"])
@pytest.mark.parametrize("what", WHAT)
def test_round_trip(trace, demo, tmp_path, capsys, what, fmt):
    out = tmp_path / f"{what}.{fmt}"
    assert main(["export", str(demo / "out"), "--what", what, "--format", fmt, "-o", str(out)]) == 0
    expected = getattr(trace, what)
    assert f"{len(expected)} {what} row(s) written" in capsys.readouterr().err
    back = read_table(out)
    assert list(back.columns) == list(expected.columns)
    assert len(expected) > 0
    assert rows(back) == rows(expected)


def test_csv_list_cells_are_json_text(trace, demo, tmp_path):
    out = tmp_path / "ops.csv"
    assert main(["export", str(demo / "out"), "-o", str(out)]) == 0  # ops, csv from the extension
    # the documented recipe, by hand, without ac-diff
    df = pd.read_csv(out, keep_default_na=False, na_values=[""],
                     converters={c: (lambda s: json.loads(s) if s else None) for c in JSON_COLUMNS
                                 if c in trace.ops.columns})
    assert rows(df) == rows(trace.ops)
    raw = pd.read_csv(out)
    first = raw["out_shapes"][0]
    assert isinstance(first, str) and json.loads(first) == trace.ops["out_shapes"][0]


def test_stdout(demo, capsys):
    assert main(["export", str(demo / "out"), "--what", "regions", "--format", "jsonl"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [json.loads(line)["module"] for line in lines] == ["layers.0", "layers.1"]


def test_parquet_without_engine(demo, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(export_cmd, "parquet_engine", lambda: None)
    assert main(["export", str(demo / "out"), "-o", str(tmp_path / "ops.parquet")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install pyarrow" in err
    assert not (tmp_path / "ops.parquet").exists()


def test_bad_arguments(demo, tmp_path, capsys):
    assert main(["export", str(demo / "out"), "--what", "kernels"]) == 2
    assert "choose one of ops, positions, regions" in capsys.readouterr().err
    assert main(["export", str(demo / "out"), "--format", "xlsx"]) == 2
    assert "choose one of csv, parquet, jsonl" in capsys.readouterr().err
    if export_cmd.parquet_engine() is not None:
        assert main(["export", str(demo / "out"), "--format", "parquet"]) == 2
        assert "-o FILE.parquet" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "missing")]) == 2
    assert "no trace found" in capsys.readouterr().err


def test_format_from_extension():
    assert resolve_format(None, "x.parquet") == "parquet"
    assert resolve_format(None, "x.jsonl") == "jsonl"
    assert resolve_format(None, "x.CSV") == "csv"
    assert resolve_format(None, None) == "csv"
    assert resolve_format("jsonl", "x.csv") == "jsonl"


def test_index_columns_with_gaps_stay_integers(trace, demo, tmp_path):
    positions = trace.positions
    assert positions["op_index"].isna().any() and positions["op_index"].notna().any()  # inputs, params: no op
    out = tmp_path / "positions.csv"
    assert main(["export", str(demo / "out"), "--what", "positions", "-o", str(out)]) == 0
    cells = [line.split(",")[4] for line in out.read_text().splitlines()[1:]]
    assert all("." not in c for c in cells) and any(c.isdigit() for c in cells)  # 4, not 4.0


def test_a_damaged_line_is_said_not_silently_dropped(demo, tmp_path, capsys):
    """One ops line of the trace edited (its checksum no longer matches): export writes the rows it can trust and
    says which region's ops are incomplete."""
    lines = (demo / "out" / "trace-rank0.jsonl").read_text().splitlines(keepends=True)
    ops = next(i for i, line in enumerate(lines) if '"type":"ops"' in line.replace(" ", ""))
    lines[ops] = lines[ops].replace('"aten.', '"aten_', 1)
    damaged = tmp_path / "trace-rank0.jsonl"
    damaged.write_text("".join(lines))
    assert main(["export", str(damaged), "-o", str(tmp_path / "ops.csv")]) == 0
    err = capsys.readouterr().err
    assert "1 damaged line(s) skipped" in err and "are incomplete" in err, err
    assert len(read_table(tmp_path / "ops.csv")) < len(ac_diff.load(demo / "out").ops)


def test_the_library_reads_one_path_given_alone(demo):
    """`ac_diff.diagnose_paths("out")` iterated the string's characters ("t: no such file or directory", 27d): one
    path alone, a string or a Path, is one path."""
    import ac_diff

    out = demo / "out"
    for given in (str(out), out):
        assert ac_diff.diagnose_paths(given).verdict == ac_diff.diagnose_paths([out]).verdict == "diverged"
