"""`ac-diff export TRACE --what ops|positions|regions --format csv|parquet|jsonl -o FILE`: a trace as a table.

    ac-diff export ac-diff-out --what positions -o positions.csv
    ac-diff export ac-diff-out --what ops -o ops.parquet          # needs pyarrow (or fastparquet)
    ac-diff export ac-diff-out --what regions --format jsonl       # to stdout

The tables are `ac_diff.load(TRACE).ops / .positions / .regions` (pandas), one row each. Cells that
hold lists or mixed scalars (`in_shapes`, `out_shapes`, `out_dtypes`, `args`, `fingerprint`,
`host_value`, `shape`) are JSON text in CSV and parquet (empty cell = null) and native JSON in JSONL;
a NaN inside a fingerprint is written as `NaN` (Python's json and JavaScript read it).
`read_table(path)` reads any of the three back into the same rows:

    df = read_table("ops.csv")            # JSON cells decoded again
    # or by hand: pd.read_csv("ops.csv", keep_default_na=False, na_values=[""],
    #                         converters={c: lambda s: json.loads(s) if s else None for c in JSON_COLUMNS})
"""

from __future__ import annotations

import json
import math
import os
import sys
import warnings
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pandas as pd

from ..errors import AcDiffError
from .choices import EXPORT_FORMATS as FORMATS, EXPORT_TABLES as WHAT
from .common import EXIT_BAD_INPUT, EXIT_CLEAN, fail

# columns whose cells are lists or mixed scalars: JSON text in CSV and parquet
JSON_COLUMNS = ("in_shapes", "out_shapes", "out_dtypes", "args", "fingerprint", "host_value", "shape")
_SUFFIXES = {".csv": "csv", ".parquet": "parquet", ".pq": "parquet", ".jsonl": "jsonl", ".ndjson": "jsonl",
             ".json": "jsonl"}


class ExportError(AcDiffError):
    """Bad export arguments or a missing engine: the message says what to do."""


def export_command(trace: str, what: str, fmt: str | None, output: str | None) -> int:
    from ..api import load

    try:
        fmt = resolve_format(fmt, output)
        if what not in WHAT:
            raise ExportError(f"unknown --what {what!r}; choose one of {', '.join(WHAT)}")
        if fmt == "parquet":
            check_parquet(output)
        with warnings.catch_warnings(record=True) as caught:  # a truncated trace: one line, not Python's warning
            warnings.simplefilter("always")
            table = getattr(load(trace), what)
        for w in caught:
            print(f"ac-diff: warning: {str(w.message).removeprefix('ac-diff: ')}", file=sys.stderr)
        rows = write_table(table, output, fmt)
    except ExportError as exc:
        return fail(str(exc), EXIT_BAD_INPUT)
    if output and output != "-":
        print(f"ac-diff: {rows} {what} row(s) written to {output} ({fmt})", file=sys.stderr)
    return EXIT_CLEAN


def resolve_format(fmt: str | None, output: str | None) -> str:
    """--format if given, else from the output's extension, else csv."""
    if fmt is None:
        return _SUFFIXES.get(Path(output).suffix.lower(), "csv") if output and output != "-" else "csv"
    if fmt not in FORMATS:
        raise ExportError(f"unknown --format {fmt!r}; choose one of {', '.join(FORMATS)}")
    return fmt


def parquet_engine() -> str | None:
    for name in ("pyarrow", "fastparquet"):
        if find_spec(name) is not None:
            return name
    return None


def check_parquet(output: str | None) -> None:
    if parquet_engine() is None:
        raise ExportError("parquet needs pyarrow or fastparquet, and neither is installed: pip install pyarrow "
                          "(or use --format csv / jsonl)")
    if not output or output == "-":
        raise ExportError("parquet is binary and cannot go to stdout: pass -o FILE.parquet")


def json_columns(df: pd.DataFrame) -> list[str]:
    """The known list columns, plus any other column holding lists or dicts."""
    cols = [c for c in df.columns if c in JSON_COLUMNS]
    for c in df.columns:
        if c not in cols and df[c].dtype == object and any(isinstance(v, (list, tuple, dict)) for v in df[c]):
            cols.append(c)
    return cols


def write_table(df: pd.DataFrame, output: str | os.PathLike | None, fmt: str) -> int:
    """Write `df` as csv, parquet or jsonl to a path (or stdout for "-" / None); return the row count."""
    to_stdout = output is None or str(output) == "-"
    if fmt == "jsonl":
        lines = (json.dumps({k: _plain(v) for k, v in row.items()}, ensure_ascii=False)
                 for row in df.to_dict("records"))
        if to_stdout:
            for line in lines:
                sys.stdout.write(line + "\n")
        else:
            with open(output, "w", encoding="utf-8") as f:
                for line in lines:
                    f.write(line + "\n")
        return len(df)
    encoded = df.copy()
    for c in json_columns(df):
        encoded[c] = [None if v is None else json.dumps(_plain(v)) for v in df[c]]
    if fmt == "csv":
        encoded.to_csv(sys.stdout if to_stdout else output, index=False)
    elif fmt == "parquet":
        encoded.to_parquet(output, index=False, engine=parquet_engine() or "auto")
    else:
        raise ExportError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    return len(df)


def read_table(path: str | os.PathLike, fmt: str | None = None) -> pd.DataFrame:
    """Read an exported table back: JSON cells of CSV/parquet decoded, nulls as None/NaN as pandas has them."""
    fmt = fmt or _SUFFIXES.get(Path(path).suffix.lower(), "csv")
    if fmt == "jsonl":
        rows = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
        return pd.DataFrame(rows)
    if fmt == "csv":
        header = pd.read_csv(path, nrows=0).columns
        conv = {c: _decode for c in header if c in JSON_COLUMNS}
        return pd.read_csv(path, keep_default_na=False, na_values=[""], converters=conv)
    df = pd.read_parquet(path)
    for c in df.columns:
        if c in JSON_COLUMNS:
            df[c] = [_decode(v) for v in df[c]]
    return df


def _decode(s: Any) -> Any:
    if s is None or (isinstance(s, float) and math.isnan(s)) or s == "":
        return None
    return json.loads(s)


def _plain(v: Any, top: bool = True) -> Any:
    """Plain JSON values: numpy scalars to python, tuples to lists; a missing cell (NaN/NA) to null.

    A NaN or inf inside a list (a fingerprint of a tensor that holds NaN) is kept: it is written as the
    `NaN` / `Infinity` tokens that Python's json and JavaScript read.
    """
    if v is None or v is pd.NA:
        return None
    if isinstance(v, (list, tuple)):
        return [_plain(x, False) for x in v]
    if isinstance(v, dict):
        return {str(k): _plain(x, False) for k, x in v.items()}
    if hasattr(v, "item") and not isinstance(v, (str, bytes)):
        v = v.item()
    if top and isinstance(v, float) and math.isnan(v):
        return None
    return v
