"""Fuzzing the trace reader: cut files, flipped bits, wrong header types, deep nesting.

Whatever happens to a trace file, reading and diagnosing it either works or raises the one error of
bad input (TraceFormatError: exit 2); damage never becomes a finding. A region is either diagnosed
exactly as in the intact trace, or reported "damaged" (format 1.1's per-line checksum), or, for a
file cut short, left without the passes that were lost (never diverged where it was clean).
Hypothesis runs derandomized with bounded example counts (a few seconds).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.checkpoint import checkpoint

import ac_diff
from ac_diff.api import InputError
from ac_diff.cli import main
from ac_diff.report import DAMAGED, DIVERGED, TITLES
from ac_diff.trace import TraceFormatError

FUZZ = settings(max_examples=60, derandomize=True, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


def _record(path) -> None:
    """Three regions: two diverge (dropout recomputed without preserve_rng_state: a real RNG divergence),
    the one between them is clean."""
    torch.manual_seed(0)
    lin, other = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    with ac_diff.record(path):
        y = checkpoint(lambda t: F.dropout(lin(t), 0.5, training=True).relu(), x, use_reentrant=False,
                       preserve_rng_state=False)
        z = checkpoint(lambda t: other(t).tanh(), y, use_reentrant=False)
        w = checkpoint(lambda t: F.dropout(lin(t), 0.5, training=True).relu(), z, use_reentrant=False,
                       preserve_rng_state=False)
        w.sum().backward()


@pytest.fixture(scope="module")
def intact(tmp_path_factory):
    path = tmp_path_factory.mktemp("fuzz") / "trace-rank0.jsonl"
    _record(path)
    data = path.read_bytes()
    report = ac_diff.diagnose_paths([path])
    assert [r.status for r in report.regions] == [DIVERGED, "clean", DIVERGED]
    return data, _findings(report)


def _findings(report) -> dict:
    return {r.region: (r.status, r.cause.kind if r.cause else None, json.dumps(r.to_json()["first_value_divergence"]),
                       json.dumps(r.to_json()["positions"])) for r in report.regions}


def _diagnose(tmp_path, data: bytes):
    """The report of damaged bytes, or None when the damage is refused as bad input (exit 2)."""
    path = tmp_path / "trace-rank0.jsonl"
    path.write_bytes(data)
    try:
        return ac_diff.diagnose_paths([path])
    except (TraceFormatError, InputError):
        return None


def _no_damage_becomes_a_finding(report, base: dict, cut: bool = False) -> None:
    if report is None:
        return
    for region, finding in _findings(report).items():
        status = finding[0]
        if status == DAMAGED:
            continue
        assert region in base, f"region {region} appeared from damage"
        if cut and status != base[region][0]:
            assert status == "unchecked", (region, status, base[region])  # its recompute was lost
            continue
        if status == DIVERGED and base[region][0] == DIVERGED and cut:
            continue  # a pass cut short: fewer ops, the same divergence
        assert finding == base[region], (region, finding, base[region])


def test_cut_at_every_record_boundary(intact, tmp_path):
    data, base = intact
    ends = [i + 1 for i, b in enumerate(data) if b == ord("\n")]
    for end in ends[:-1]:
        report = _diagnose(tmp_path, data[:end])
        _no_damage_becomes_a_finding(report, base, cut=True)
        assert report is None or report.to_json()["regions"] is not None


@FUZZ
@given(st.floats(0.0, 1.0))
def test_cut_inside_a_record(intact, tmp_path, where):
    data, base = intact
    report = _diagnose(tmp_path, data[:int(len(data) * where)])
    _no_damage_becomes_a_finding(report, base, cut=True)


@FUZZ
@given(st.data())
def test_bit_flips_are_reported_as_damage(intact, tmp_path, draw):
    data, base = intact
    damaged = bytearray(data)
    for _ in range(draw.draw(st.integers(1, 3))):
        at = draw.draw(st.integers(0, len(data) - 1))
        damaged[at] ^= 1 << draw.draw(st.integers(0, 7))
    report = _diagnose(tmp_path, bytes(damaged))
    _no_damage_becomes_a_finding(report, base)
    if report is not None and bytes(damaged) != data:
        assert report.verdict != "clean"
    if report is not None:  # (a damaged trace's banner said CLEAN)
        assert report.title in TITLES[report.verdict], (report.verdict, report.title)


HEADER_VALUES = ["abc", -1, 0, 2**70, 1.5, None, True, [], {}, [1, "x"], {"a": 1}, "", "1.0"]


def test_wrong_types_in_every_header_field(intact, tmp_path):
    data, base = intact
    lines = data.split(b"\n")
    header = json.loads(lines[0])
    header.pop("crc")
    for key in list(header):
        for value in HEADER_VALUES:
            changed = {**header, key: value}
            for with_crc in (False, True):  # a hand-edited header, and one written with a valid checksum
                line = json.dumps(changed, separators=(",", ":")).encode()
                if with_crc:
                    from ac_diff.trace import with_crc as add_crc

                    line = add_crc(line)
                report = _diagnose(tmp_path, b"\n".join([line] + lines[1:]))
                if report is not None:
                    assert _findings(report) == base, (key, value)


@pytest.mark.parametrize("junk", [b"1", b"null", b"[]", b'"text"', b"[" * 100_000 + b"]" * 100_000,
                                  b'{"type": "ops", "region": "x", "rows": 5}', b"\x00\xff\xfe"],
                         ids=["int", "null", "list", "string", "deep", "wrong-types", "binary"])
def test_junk_lines_are_damage_never_a_finding(intact, tmp_path, junk):
    data, base = intact
    lines = data.split(b"\n")
    for at in range(1, len(lines)):
        report = _diagnose(tmp_path, b"\n".join(lines[:at] + [junk] + lines[at:]))
        _no_damage_becomes_a_finding(report, base)


def test_cli_never_exits_3_on_damage(intact, tmp_path, capsys):
    import gzip

    data, _ = intact
    packed = gzip.compress(data)
    cases = {"cut.jsonl.gz": packed[:len(packed) // 2], "flipped.jsonl.gz": packed[:100] + bytes([packed[100] ^ 4])
             + packed[101:], "deep.jsonl": data.split(b"\n")[0] + b"\n" + b"[" * 100_000 + b"\n"}
    for name, content in cases.items():
        (tmp_path / name).write_bytes(content)
        code = main(["report", str(tmp_path / name)])
        err = capsys.readouterr().err
        assert code in (0, 1, 2, 4) and "Traceback" not in err and "internal error" not in err, (name, code, err)
