"""Fuzzing the log parser with the real logs: it never raises, always returns a well-formed Run, and
keeps what it extracts stable under the damage real logs suffer.

Hypothesis runs derandomized (a fixed seed per test) with bounded example counts, so the file
finishes in well under 20 s and a failure reproduces. The real logs come from tests/data/real_logs;
they are required, as in test_logs_real.py.
"""

from __future__ import annotations

import io
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ac_diff.logs import parse_log
from ac_diff.passes import Run, TensorMeta
from conftest import REAL_LOGS

LOGS = REAL_LOGS
MISSING = f"real logs not found at {LOGS}"

DATA = {p.name: p.read_bytes() for p in sorted(LOGS.glob("*.log"))} if LOGS.is_dir() else {}
SMALL = sorted(n for n, d in DATA.items() if len(d) < 10_000) or ["(missing)"]


@pytest.fixture(autouse=True)
def _require_real_logs():
    """Fail (never skip) every test here when the real logs are missing."""
    if not DATA:
        pytest.fail(MISSING, pytrace=False)
ERROR_LOGS = [
    "Joluck_RWKV-PEFT_58.log", "Joluck_RWKV-PEFT_58_part2.log", "Modalities_modalities_361.log",
    "Sompote_SAM3_LoRA_10_part2.log", "deepspeedai_DeepSpeed_8148.log", "huggingface_trl_4314.log",
    "huggingface_trl_5217.log", "jzhang38_TinyLlama_152.log", "mihirp1998_VADER_9.log", "pytorch_pytorch_155171.log",
    "pytorch_pytorch_171355.log", "pytorch_torchtitan_1117_part2.log", "readme_glm4v.log",
]
_PREFIX = re.compile(rb"^(?:\s*\[(?:rank|default)\d+\]:\s?)+")

_FUZZ = settings(derandomize=True, deadline=None, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def fuzz(n: int) -> settings:
    """Derandomized settings with `n` examples."""
    return settings(_FUZZ, max_examples=n)


def parse_bytes(data: bytes) -> Run:
    return parse_log(io.BytesIO(data))


def assert_well_formed(run: Run) -> None:
    assert isinstance(run, Run) and run.source == "log"
    assert isinstance(run.truncated, bool)
    assert all(isinstance(n, str) and n for n in run.notes)
    for err in run.errors:
        assert err.kind in ("metadata_mismatch", "count_mismatch", "more_saved_in_recompute", "sac_not_found",
                            "sac_mutated", "other")
        assert err.rank is None or isinstance(err.rank, int)
        for p in err.positions:
            assert p.position is None or (isinstance(p.position, int) and p.position >= 0)
            for m in (p.saved, p.recomputed):
                assert m is None or (isinstance(m, TensorMeta) and isinstance(m.dtype, str) and m.dtype)
    for region in run.regions:
        assert isinstance(region.rank, int) and region.kind == "log"
        for p in (region.forward, region.recompute):
            if p is None:
                continue
            assert [o.index for o in p.ops] == list(range(len(p.ops)))
            for o in p.ops:
                assert o.op.count(".") == 2 and o.log_ids is not None
                assert all(isinstance(m, TensorMeta) for m in o.out)


def summary(run: Run, rank_filter=None) -> list:
    """What must survive damage: per error, its kind, rank and position entries."""
    return [(e.kind, e.rank, [(p.position, p.saved, p.recomputed) for p in e.positions])
            for e in run.errors if rank_filter is None or e.rank == rank_filter]


def lines_of(data: bytes) -> list[bytes]:
    return data.split(b"\n")


def reprefix(data: bytes, prefix: bytes) -> bytes:
    """Every line with its launcher prefix replaced by `prefix` (blank lines stay blank)."""
    return b"\n".join(prefix + _PREFIX.sub(b"", ln) if ln.strip() else ln for ln in lines_of(data))


# ------------------------------------------------------------------ arbitrary input

@fuzz(150)
@given(st.binary(max_size=4000))
def test_binary_junk_never_raises(data):
    assert_well_formed(parse_bytes(data))


@fuzz(120)
@given(st.lists(st.sampled_from([
    "[rank1]: ", "rank3: ", "[default0]:", "E   ", "tensor at position ", "saved metadata: {'shape': torch.Size([",
    "recomputed metadata: ", "'dtype': torch.", "bfloat16", "float32", "}", "])", "), ", "'device': device(type='cuda'",
    ", index=0)", "Number of tensors saved during forward: ", "recomputation: ", "$", "12", ": ", "f32[", "bf16[",
    "['$", "('$", " = torch._ops.", "aten.view.default(", "['1', '2']", ")", "   (3 of 9 in original)",
    "Operations executed during the original forward:", "Operations executed during recomputation:",
    "|        1. Stack traces of the operators that ran in the original forward     |",
    "ERROR: Detected non-determinism while running activation checkpointing", "+------+", "\n", "\n", "\r",
    "/home/u/model.py:3:forward", "Traceback (most recent call last):", "CheckpointError: ", "\x00", "\u2011", ".",
]), max_size=80))
def test_marker_soup_never_raises(parts):
    assert_well_formed(parse_bytes("".join(parts).encode("utf-8")))


# ------------------------------------------------------------------ damage to real logs

@fuzz(120)
@given(st.sampled_from(sorted(DATA) or ["(missing)"]), st.floats(0, 1))
def test_random_cut(name, where):
    data = DATA[name]
    cut = data[:int(len(data) * where)]
    run = parse_bytes(cut)
    assert_well_formed(run)
    full = parse_bytes(data)
    full_positions = {p.position for e in full.errors for p in e.positions}
    assert {p.position for e in run.errors for p in e.positions} <= full_positions | {None}
    assert {e.kind for e in run.errors} <= {e.kind for e in full.errors} | {"other", "metadata_mismatch",
                                                                            "count_mismatch"}
    for rc, rf in zip(run.regions, full.regions):
        for pc, pf in ((rc.forward, rf.forward), (rc.recompute, rf.recompute)):
            assert pc is None or pf is not None and len(pc.ops) <= len(pf.ops) + 1


@fuzz(60)
@given(st.sampled_from(ERROR_LOGS), st.sampled_from(ERROR_LOGS), st.randoms(use_true_random=False))
def test_two_ranks_interleaved_line_by_line(name_a, name_b, rnd):
    a = lines_of(reprefix(DATA[name_a], b"[rank4]: "))
    b = lines_of(reprefix(DATA[name_b], b"[rank9]: "))
    merged, i, j = [], 0, 0
    while i < len(a) or j < len(b):
        if j >= len(b) or (i < len(a) and rnd.random() < 0.5):
            merged.append(a[i]); i += 1
        else:
            merged.append(b[j]); j += 1
    run = parse_bytes(b"\n".join(merged) + b"\n")
    assert_well_formed(run)
    alone_a = parse_bytes(b"\n".join(a) + b"\n")
    alone_b = parse_bytes(b"\n".join(b) + b"\n")
    assert summary(run, 4) == summary(alone_a)
    assert summary(run, 9) == summary(alone_b)


@fuzz(40)
@given(st.sampled_from(ERROR_LOGS), st.sampled_from([b"[rank5]: ", b"[default2]:[rank5]: ", b"[rank5]:[rank5]: ",
                                                      b"rank5: ", b"    [rank5]: ", b"E       [rank5]: "]),
       st.randoms(use_true_random=False))
def test_random_prefixes_and_indentation(name, prefix, rnd):
    base = parse_bytes(reprefix(DATA[name], b"[rank5]: "))
    lines = []
    for ln in lines_of(DATA[name]):
        body = _PREFIX.sub(b"", ln)
        if not body.strip():
            lines.append(body)
            continue
        p = prefix if rnd.random() < 0.8 else b"[rank5]: " + b" " * rnd.randint(0, 6)
        lines.append(p + body)
    run = parse_bytes(b"\n".join(lines))
    assert_well_formed(run)
    assert summary(run) == summary(base)
    assert all(e.rank == 5 for e in run.errors)


@fuzz(30)
@given(st.sampled_from(ERROR_LOGS), st.sampled_from([b" ", b"  ", b" \t "]))
def test_flattened_onto_one_line(name, sep):
    data = DATA[name]
    flat = sep.join(ln for ln in lines_of(data) if ln.strip())
    run = parse_bytes(flat + (b"\n" if data.endswith(b"\n") else b""))  # a cut end stays a cut end
    assert_well_formed(run)
    # what a flattened paste keeps: the same entries (a header lost with the traceback noise before it
    # is fine: position numbers, shapes and counts are what matter)
    flat = [(p.position, p.saved, p.recomputed) for e in run.errors for p in e.positions]
    orig = [(p.position, p.saved, p.recomputed) for e in parse_bytes(data).errors for p in e.positions]
    assert flat == orig
    assert [(e.saved_count, e.recomputed_count) for e in run.errors if e.kind == "count_mismatch"] == \
        [(e.saved_count, e.recomputed_count) for e in parse_bytes(data).errors if e.kind == "count_mismatch"]


@fuzz(40)
@given(st.sampled_from(SMALL), st.lists(st.tuples(st.floats(0, 1), st.one_of(
    st.binary(max_size=200), st.text(max_size=200).map(lambda s: s.encode("utf-8", "surrogatepass")),
    st.sampled_from([b"\x00" * 50, b"\xff\xfe\xfd", b"[rank", b"$12: f32[", b"tensor at position 99",
                     b"saved metadata: {", b"Operations executed during recomputation:"]))), max_size=8))
def test_garbage_inserted_anywhere(name, inserts):
    data = DATA[name]
    for where, junk in inserts:
        k = int(len(data) * where)
        data = data[:k] + junk + data[k:]
    assert_well_formed(parse_bytes(data))


@fuzz(15)
@given(st.sampled_from(["torchtitan_llama4_rank1_head.log", "torchtitan_llama4_rank1_tail.log"]),
       st.lists(st.floats(0, 1), min_size=1, max_size=6), st.randoms(use_true_random=False))
def test_llama4_spliced_lines(name, points, rnd):
    """Concurrent writers: pieces of lines moved into the middle of other lines."""
    data = bytearray(DATA[name])
    for p in points:
        src = int(len(data) * p)
        piece = bytes(data[src:src + rnd.randint(1, 200)])
        dst = rnd.randrange(len(data))
        data[dst:dst] = piece
    assert_well_formed(parse_bytes(bytes(data)))


def test_very_long_line_is_split_not_loaded_whole():
    data = b"[rank0]: " + b"x" * (3 << 20) + b"\n" + DATA["jzhang38_TinyLlama_152.log"]
    run = parse_bytes(data)
    assert_well_formed(run)
    assert any("longer than 1 MiB" in n for n in run.notes)
    (err,) = run.errors
    assert (err.saved_count, err.recomputed_count) == (27, 8)
