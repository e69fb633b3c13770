"""The trace format: self-describing header, end record, versions, truncation, gzip, bad input."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest
import torch

import ac_diff
from ac_diff.trace import VERSION, TraceFormatError, read_run
from conftest import run_cli
from models import VARIANTS, Net, record_step, train_step

DATA = Path(__file__).parent / "data"


@pytest.fixture()
def trace(tmp_path):
    torch.manual_seed(0)
    record_step(Net(VARIANTS["non_reentrant"]), tmp_path / "trace-rank0.jsonl")
    return tmp_path / "trace-rank0.jsonl"


def test_header_and_end(trace):
    lines = [json.loads(l) for l in trace.read_text().splitlines()]
    header, end = lines[0], lines[-1]
    assert header["type"] == "header" and header["format"] == "ac-diff-trace" and header["version"] == VERSION
    for key in ("ac_diff", "torch", "python", "argv", "rank", "world_size", "start_time"):
        assert key in header
    assert end["type"] == "end" and end["status"] == "ok" and end["regions"] == 2


def test_pandas_views_have_the_documented_columns(trace):
    t = ac_diff.load(trace)
    assert {"rank", "region", "module", "forward_ops", "recompute_ops"} <= set(t.regions.columns)
    assert {"rank", "region", "phase", "index", "op", "module", "source", "out_shapes", "fingerprint"} <= set(
        t.ops.columns)
    assert set(t.ops.phase) == {"forward", "recompute"}
    assert {"rank", "region", "position", "op_index", "op", "module", "shape"} <= set(t.positions.columns)


def test_every_old_version_file_still_loads():
    files = sorted(DATA.glob("trace-v*.jsonl"))
    assert files, "keep one trace per released format version in tests/data"
    for f in files:
        run = read_run(f)
        assert run.regions and run.regions[0].forward is not None


def test_newer_major_version_is_rejected_with_advice(trace, tmp_path):
    lines = trace.read_text().splitlines()
    header = json.loads(lines[0])
    header["version"] = "2.0"
    newer = tmp_path / "newer.jsonl"
    newer.write_text("\n".join([json.dumps(header)] + lines[1:]) + "\n")
    with pytest.raises(TraceFormatError, match="upgrade ac-diff"):
        read_run(newer)
    proc = run_cli("report", str(newer))
    assert proc.returncode == 2 and "upgrade ac-diff" in proc.stderr and "Traceback" not in proc.stderr


def test_not_a_trace(tmp_path):
    other = tmp_path / "trace-rank0.jsonl"
    other.write_text('{"hello": 1}\n')
    with pytest.raises(TraceFormatError, match="not an ac-diff trace"):
        read_run(other)
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"\x00\x01\x02garbage")
    proc = run_cli("report", str(junk))
    assert proc.returncode == 2 and proc.stderr.startswith("ac-diff: error:") and "Traceback" not in proc.stderr
    proc = run_cli("report", str(tmp_path / "missing"))
    assert proc.returncode == 2 and "no such file" in proc.stderr


def test_truncated_trace_loads_with_warning(trace, tmp_path):
    cut = tmp_path / "cut.jsonl"
    data = trace.read_bytes()
    cut.write_bytes(data[: int(len(data) * 0.7)])
    with pytest.warns(RuntimeWarning, match="truncated"):
        t = ac_diff.load(cut)
    assert len(t.regions) >= 1
    report = ac_diff.diagnose(t.runs)
    assert any("no end record" in n for n in report.notes)


def test_gzip_trace(tmp_path):
    torch.manual_seed(0)
    path = tmp_path / "trace-rank0.jsonl.gz"
    record_step(Net(VARIANTS["non_reentrant"]), path)
    with gzip.open(path, "rt") as f:
        assert json.loads(f.readline())["format"] == "ac-diff-trace"
    assert len(ac_diff.load(tmp_path).regions) == 2


def test_keep_current_version_sample(trace):
    """tests/data holds a trace of the current version (refresh with AC_DIFF_UPDATE_DATA=1)."""
    import os

    target = DATA / f"trace-v{VERSION}.jsonl"
    if os.environ.get("AC_DIFF_UPDATE_DATA"):
        shutil.copy(trace, target)
    assert target.exists()


@pytest.mark.parametrize("fast_writer", [True, False], ids=["orjson", "json"])
def test_nan_and_infinities_survive_the_trace(tmp_path, monkeypatch, fast_writer):
    """orjson writes NaN as null: a pass holding one is written by json, and reads back as NaN."""
    import math

    from ac_diff.trace import lines  # orjson encodes (and decodes) there
    if not fast_writer:
        monkeypatch.setattr(lines, "orjson", None)

    class Masked(torch.nn.Module):
        def forward(self, x):
            scores = x.masked_fill(x < 0, float("-inf"))  # an -inf argument and -inf values
            return torch.softmax(scores, -1) * torch.log(x.abs() - x.abs()).cumsum(-1)  # log(0) = -inf values

    path = tmp_path / "t.jsonl"
    with ac_diff.record(path):
        x = torch.randn(4, 6, requires_grad=True)
        torch.utils.checkpoint.checkpoint(Masked(), x, use_reentrant=False).sum().backward()
    lines = path.read_text().splitlines()
    assert any('"nonfinite":true' in line.replace(" ", "") for line in lines)
    run = read_run(path)
    ops = {o.op: o for o in run.regions[0].forward.ops}
    assert ops["aten.masked_fill.Scalar"].args[-1] == -math.inf
    assert any(v is not None and not math.isfinite(v) for pair in ops["aten.cumsum.default"].fingerprint for v in pair)
    with ac_diff.record(tmp_path / "u.jsonl"):  # a finite pass is written without the flag
        torch.utils.checkpoint.checkpoint(torch.nn.Linear(3, 3), torch.randn(2, 3, requires_grad=True),
                                          use_reentrant=False).sum().backward()
    assert '"nonfinite"' not in (tmp_path / "u.jsonl").read_text()


# -- unknown record types: the minor version says whether they may be skipped -------------------------
def _with_record(trace, tmp_path, version: str, record: dict) -> Path:
    """The trace with its header's version set and `record` written (with its checksum) before the end."""
    from ac_diff.trace import decode_line, with_crc

    lines = trace.read_bytes().splitlines()
    header = decode_line(lines[0])
    header.pop("crc", None)
    header["version"] = version
    encode = lambda rec: with_crc(json.dumps(rec, separators=(",", ":")).encode())  # noqa: E731
    out = tmp_path / f"v{version}.jsonl"
    out.write_bytes(b"\n".join([encode(header), *lines[1:-1], encode(record), lines[-1]]) + b"\n")
    return out


def _minor(delta: int) -> str:
    from ac_diff.trace import MAJOR, MINOR

    return f"{MAJOR}.{MINOR + delta}"


@pytest.mark.parametrize("delta", [0, -1], ids=["same minor", "older minor"])
def test_unknown_record_of_a_known_minor_is_corruption(trace, tmp_path, delta, capsys):
    path = _with_record(trace, tmp_path, _minor(delta), {"type": "hologram", "region": 0})
    run = read_run(path)
    assert run.damaged == 1
    assert any("unknown type 'hologram'" in n for n in run.notes)
    assert "upgrade ac-diff" not in capsys.readouterr().err


def test_unknown_records_of_a_newer_minor_are_skipped_with_one_warning(trace, tmp_path, capsys):
    path = _with_record(trace, tmp_path, _minor(1), {"type": "hologram", "region": 0})
    lines = path.read_bytes().splitlines()
    path.write_bytes(b"\n".join([*lines[:-1], lines[-2], lines[-1]]) + b"\n")  # two of them
    run = read_run(path)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "upgrade ac-diff" in err[0]
    assert _minor(1) in err[0] and VERSION in err[0] and "skipped 2 records" in err[0]
    assert not run.damaged and len(run.regions) == 2 and run.regions[0].forward is not None
    proc = run_cli("report", str(path), "--format", "json", "-o", str(tmp_path / "r.json"))
    assert proc.returncode in (0, 1) and proc.stderr.count("upgrade ac-diff") == 1, proc.stderr


def test_newer_major_is_one_clear_error_line(trace, tmp_path):
    from ac_diff.trace import MAJOR

    path = _with_record(trace, tmp_path, f"{MAJOR + 1}.0", {"type": "hologram"})
    with pytest.raises(TraceFormatError, match="upgrade ac-diff"):
        read_run(path)
    proc = run_cli("report", str(path))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "upgrade ac-diff" in proc.stderr


def test_header_read_in_one_place(trace, tmp_path):
    """launch_cmd reads a rank's header through trace.read_header: a file that is not a trace has none."""
    from ac_diff.commands.launch_cmd import read_header

    assert read_header(trace)["version"] == VERSION
    other = tmp_path / "trace-rank1.jsonl"
    other.write_text('{"hello": 1}\n')
    assert read_header(other) is None


def test_the_regions_table_says_which_regions_diverged(tmp_path):
    """`export --what regions` is the regions table: each region's status, whether it was silent, and its cause's
    kind, as the report gives them (the table had none: an export could not show which regions diverged)."""
    import torch.nn as nn
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    block, path = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5)), tmp_path / "t.jsonl"
    with ac_diff.record(path):
        for preserve in (True, False):  # (dropout without its RNG state: another mask in the recompute)
            checkpoint(block, torch.randn(4, 8, requires_grad=True), use_reentrant=False,
                       preserve_rng_state=preserve).sum().backward()
    table = ac_diff.load(path).regions
    rows = table[["region", "status", "silent"]].values.tolist()
    assert rows == [[0, "clean", False], [1, "diverged", True]], rows
    assert table.cause.isna().tolist() == [True, False] and table.cause[1] == "rng", table.cause


@pytest.mark.parametrize("outer, copy", [("t.jsonl", "c.jsonl.gz"), ("t.jsonl.gz", "c.jsonl")])
def test_a_copy_of_a_trace_still_being_written_is_a_finished_trace(tmp_path, outer, copy):
    """`record()` nested in `ac-diff run` gets a copy of the run's trace when its block ends (27d): what was queued is
    written first, a gzip stream still open (no trailer yet) is read to its last line, the copy ends with its end
    record, in the compression its own name asks for."""
    from ac_diff.capture.recorder import Recorder

    recorder = Recorder(tmp_path / outer).start()
    try:
        train_step(Net(VARIANTS["non_reentrant"]))
        recorder.copy_trace(tmp_path / copy)
        with open(tmp_path / copy, "rb") as f:
            assert (f.read(2) == b"\x1f\x8b") == copy.endswith(".gz")
        run = read_run(tmp_path / copy)
        assert run.regions and not run.truncated and run.exit_status == "ok", (run.notes, run.exit_status)
    finally:
        recorder.stop()
    assert len(read_run(tmp_path / outer).regions) == len(run.regions)


def test_unpacked_records_merge_over_backwards():
    """A position read for some gradients in one backward and for all in another counts as read for all; reads of
    the same node for some gradients add up; a record without `partial` (a 1.6 trace before it) reads all."""
    from ac_diff.trace.reader import _merge_reads

    reads: dict = {}
    _merge_reads(reads, {"positions": [0, 1, 2], "partial": [[0, "MmBackward0", [0]], [1, "MmBackward0", [1]]]})
    _merge_reads(reads, {"positions": [0, 1], "partial": [[1, "MmBackward0", [0]]]})
    assert reads == {0: None, 1: ("MmBackward0", frozenset({0, 1})), 2: None}
    _merge_reads(reads, {"positions": [1], "partial": [[1, "AddmmBackward0", [2]]]})
    assert reads[1] is None
