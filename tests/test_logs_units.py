"""Unit tests of the log parser's parts, and of texts the installed torch really produces."""

from __future__ import annotations

import gzip
import io
import json
import platform
from pathlib import Path
from unittest import mock

import pytest
import torch

from ac_diff.logs import UNKNOWN_DEVICE, looks_like_log, parse_log, parse_text
from ac_diff.logs.dump import classify_dump_line, frame_source, S_FOOTER, S_TRACES_FWD
from ac_diff.logs.errors import classify_error_line, refused_op
from ac_diff.logs.lines import ReadStats, iter_lines, split_segments, strip_prefix
from ac_diff.logs.args import parse_args
from ac_diff.logs.meta import DTYPE_ABBRS, parse_device, parse_metadata, parse_shape, short_dtype
from ac_diff.logs.oplines import GARBLED, OK, SALVAGED, looks_like_op, parse_op_line
from ac_diff.passes import TensorMeta
from conftest import checkpoint_error_text, torch_debug_logging


def U(shape, dtype):
    return TensorMeta(tuple(shape), dtype, UNKNOWN_DEVICE)


# ------------------------------------------------------------------ op lines, every LoggingTensor form

def test_op_single_output_with_list_of_ints():
    p = parse_op_line("$1: bf16[1, 128, 5120] = torch._ops.aten.view.default($0, ['1', '128', '5120'])")
    assert (p.status, p.op) == (OK, "aten.view.default")
    assert p.out == [U((1, 128, 5120), "bf16")]
    assert p.args == ["$0", [1, 128, 5120]]
    assert (p.out_ids, p.in_ids) == (["$1"], ["$0"])
    assert p.ordinal is None


def test_op_tuple_outputs():
    p = parse_op_line("('$159: f32[128, 1]', '$160: i64[128, 1]') = torch._ops.aten.topk.default($158, 1, 1)")
    assert p.status == OK and p.op == "aten.topk.default"
    assert p.out == [U((128, 1), "f32"), U((128, 1), "i64")]
    assert p.out_ids == ["$159", "$160"] and p.args == ["$158", 1, 1]


def test_op_list_outputs_with_ordinal_and_odd_suffix():
    p = parse_op_line("['$182: bf16[63, 5120]', '$183: bf16[65, 5120]'] = "
                      "torch._ops.aten.split_with_sizes.default($181, ['63', '65'])   (140 of 177 in original: )")
    assert p.status == OK
    assert p.ordinal == (140, 177, "original")
    assert p.args == ["$181", [63, 65]]
    assert [m.shape for m in p.out] == [(63, 5120), (65, 5120)]


def test_op_recompute_ordinal():
    p = parse_op_line("$815: bf16[8192, 5120] = torch._ops.aten.view.default($814, ['8192', '5120'])"
                      "   (776 of 776 in recompute)")
    assert p.ordinal == (776, 776, "recompute") and p.status == OK


def test_op_kwargs_go_into_one_trailing_dict():
    p = parse_op_line("$243: i64[2] = torch._ops.aten._to_copy.default($221, dtype=torch.int64, "
                      "layout=torch.strided, device=device(type='cpu'))")
    assert p.args == ["$221", {"dtype": "torch.int64", "layout": "torch.strided", "device": "device(type='cpu')"}]
    assert p.in_ids == ["$221"]


def test_op_tensor_list_argument_and_strings():
    p = parse_op_line("$457: bf16[8, 1024, 5120] = torch._ops.aten.cat.default(['$449', '$450', '$451'])")
    assert p.args == [["$449", "$450", "$451"]] and p.in_ids == ["$449", "$450", "$451"]
    p = parse_op_line("$458: bf16[1, 1024, 5120] = torch._ops._c10d_functional.reduce_scatter_tensor.default("
                      "$457, 'sum', 8, '11')")
    assert p.op == "_c10d_functional.reduce_scatter_tensor.default"
    assert p.args == ["$457", "sum", 8, "11"]  # top-level quoted strings stay strings


def test_op_scalars_floats_inf_bool_none():
    p = parse_op_line("$79: f32[] = torch._ops.aten.scalar_tensor.default(-inf, dtype=torch.float32)")
    assert p.out == [U((), "f32")] and p.args == ["-inf", {"dtype": "torch.float32"}]
    p = parse_op_line("$5: f32[1, 1024, 1] = torch._ops.aten.add_.Scalar($5, 9.999999747378752e-06)")
    assert p.args == ["$5", 9.999999747378752e-06] and p.out_ids == ["$5"] and p.in_ids == ["$5"]
    p = parse_op_line("$5: f32[1, 1024, 1] = torch._ops.aten.mean.dim($4, ['2'], True)")
    assert p.args == ["$4", [2], True]
    p = parse_op_line("$2: f32[3] = torch._ops.aten.foo.default($1, None, False, [])")
    assert p.args == ["$1", None, False, []]


def test_op_without_tensor_outputs():
    p = parse_op_line("None = torch._ops.aten._foreach_add_.Scalar(['$1', '$2'], 1)")
    assert p.status == OK and p.out == [] and p.out_ids == [] and p.in_ids == ["$1", "$2"]
    p = parse_op_line("5 = torch._ops.aten._local_scalar_dense.default($3)")
    assert p.status == OK and p.out == [] and p.host_value == 5


def test_op_nested_lists_and_symbolic_shapes():
    p = parse_op_line("$9: f32[s0, 4] = torch._ops.aten.foo.default($1, [['1', '2'], ['3']])")
    assert p.out == [U(("s0", 4), "f32")] and p.args == ["$1", [[1, 2], [3]]]


def test_op_spliced_tail_is_salvaged():
    p = parse_op_line("$124: bf16[1, 128, 5120] = t5120]', '$192: bf16[33, 5120]', '$193: bf16[118, 5120]'] "
                      "= torch._ops.aten.split_with_sizes.default($181, ['14', '99'])")
    assert p.status == SALVAGED
    assert p.op == "aten.split_with_sizes.default" and p.args == ["$181", [14, 99]]
    assert p.out_ids == ["$192", "$193"]  # $124 belonged to the line that was cut


def test_op_spliced_arguments_keep_what_came_before_the_damage():
    p = parse_op_line("$155: f32[1024, 16] = torch._ops.aten._to_copy.default($154, dtype=torch.floorch._ops"
                      ".aten.select.int($198, 0, 3)")
    assert p.status == SALVAGED and p.op == "aten._to_copy.default"
    assert p.args == ["$154"] and p.in_ids == ["$154"]
    p = parse_op_line("$1: f32[2] = torch._ops.aten.add.Tensor($0, $12")  # cut: "$12" may be "$123"
    assert p.status == SALVAGED and p.args == ["$0"] and p.in_ids == ["$0"]


@pytest.mark.parametrize("text", [
    "$93: f32[1, 5, 1024, 1024] = torch._opsat32)",
    "orch._ops.aten.view.default($123, ['1', '128', '5120'])",
    "$173: f32[1, 1024, 1] = torch._ops.aten.detach.defauw.default($226, ['-1', '1'])",  # 4-part name
    "$49: c64[1, 1024, 5, 64] = torch._ops.aten.aten.expand.default($91, ['1', '5'])",
    "$142: bf16[5120204)",
    "['$13: bf16[1, 128, 5120]', '$17: bf1",
])
def test_op_garbled(text):
    assert looks_like_op(text)
    assert parse_op_line(text).status == GARBLED


def test_looks_like_op_is_specific():
    assert not looks_like_op("$ python train.py")
    assert not looks_like_op("[rank1] hello")
    assert looks_like_op("$1: f32[1] = x")


# ------------------------------------------------------------------ values and metadata

def test_dtype_table_matches_installed_torch():
    torch = pytest.importorskip("torch")
    try:  # where the debug=True dump's LoggingTensor reads its table (torch >= 2.8; before: a private copy)
        from torch.utils._dtype_abbrs import dtype_abbrs
    except ImportError:
        from torch.testing._internal.logging_tensor import _dtype_abbrs as dtype_abbrs

    # our table spells dtypes as the newest release does; older ones spelled bits16 "b16" (2.9)
    renamed = {("torch.bits16", "b16")}
    ours = {str(d): short_dtype(str(d)) for d in dtype_abbrs if (str(d), dtype_abbrs[d]) not in renamed}
    assert ours == {str(d): a for d, a in dtype_abbrs.items() if (str(d), a) not in renamed}
    assert set(DTYPE_ABBRS.values()) >= {a for d, a in dtype_abbrs.items() if (str(d), a) not in renamed}
    assert short_dtype("torch.float") == "f32" and short_dtype("torch.long") == "i64"
    assert short_dtype("torch.mystery") == "mystery"
    assert torch.bfloat16 in dtype_abbrs


def test_device_and_shape():
    assert parse_device("device(type='xpu', index=1)") == "xpu:1"
    assert parse_device("device(type='cpu')") == "cpu"
    assert parse_device("device(typ") is None
    assert parse_shape("") == () and parse_shape(" 3 , 4") == (3, 4) and parse_shape("99ug") is None


def test_metadata_whole_cut_and_garbled():
    whole = parse_metadata("{'shape': torch.Size([99, 5120]), 'dtype': torch.bfloat16, "
                           "'device': device(type='xpu', index=1)}")
    assert whole.meta == TensorMeta((99, 5120), "bf16", "xpu:1") and whole.complete
    device_cut = parse_metadata("{'shape': torch.Size([105, 8192]), 'dtype': torch.bfloat16, 'device': device(typ")
    assert device_cut.meta == TensorMeta((105, 8192), "bf16", UNKNOWN_DEVICE) and not device_cut.complete
    assert parse_metadata("{'shape': torch.Size([1, 16, 12460, 128]), 'dtype': torch.b").meta is None
    assert parse_metadata("{'shape': torch.Size([964, 5120]),").meta is None
    assert parse_metadata("{'shape': torch.Size([99ug=True` to `torch.utils.checkpoint.checkpoint()`.").meta is None
    assert parse_metadata("{'").meta is None and parse_metadata("").meta is None
    assert parse_metadata("{'shape': torch.Size([]), 'dtype': torch.bool, 'device': device(type='cuda')}").meta \
        == TensorMeta((), "b8", "cuda")


def test_args_general_reader_and_fast_path_agree():
    from ac_diff.logs.args import _fast_args

    for text in ["$181, ['14', '99']", "$3, dtype=torch.float32", "['$149', '$150'], 1", "$158, 1, 1",
                 "$4, ['2'], True", "$1, [], 2", "$164, stable=True"]:
        fast = _fast_args(text)
        assert fast is not None, text
        with mock.patch("ac_diff.logs.args._fast_args", return_value=None):
            slow = parse_args(text)
        assert (fast.values, fast.tensor_ids, fast.complete) == (slow.values, slow.tensor_ids, slow.complete)
    assert parse_args("$0, ['a,b']").values == ["$0", ["a,b"]]
    assert parse_args('["\'sum\'"]').values == [["sum"]]  # a string inside a list: repr of a repr
    assert parse_args("$1, size=['1', '2']").values == ["$1", {"size": [1, 2]}]


# ------------------------------------------------------------------ lines

@pytest.mark.parametrize("text,rank,body", [
    ("[rank1]: tensor at position 48:", 1, "tensor at position 48:"),
    ("[default1]:[rank1]: Traceback (most recent call last):", 1, "Traceback (most recent call last):"),
    ("[rank1]:[rank1]:   File \"x.py\", line 3", 1, 'File "x.py", line 3'),
    ("[default3]: hello", 3, "hello"),
    ("rank11: raise CheckpointError(", 11, "raise CheckpointError("),
    ("E           torch.utils.checkpoint.CheckpointError: x", None, "torch.utils.checkpoint.CheckpointError: x"),
    ("    [rank1]: tensor at position 4:", 1, "tensor at position 4:"),
    ("[rank1]:orch._ops.aten.view", 1, "orch._ops.aten.view"),
    ("\x1b[31m[rank4]:\x1b[0m hi", 4, "hi"),
    ("Error: not a prefix", None, "Error: not a prefix"),
    ("[ra", None, "[ra"),
    # a timestamp a log collector put first (also before torchrun's prefix)
    ("2025-12-04T08:00:00.123456Z /w/train.py:20:forward", None, "/w/train.py:20:forward"),
    ("[2025-12-04 08:00:00,123] [rank1]: tensor at position 4:", 1, "tensor at position 4:"),
    ("2025-12-04 08:00:00+01:00 saved metadata: {}", None, "saved metadata: {}"),
    ("2025-12-04 is not a timestamp", None, "2025-12-04 is not a timestamp"),
    # mpirun --tag-output: [job,rank]<stream>:
    ("[1,3]<stderr>: tensor at position 4:", 3, "tensor at position 4:"),
    ("[1,0]<stdout>:[rank2]: hi", 2, "hi"),
])
def test_strip_prefix(text, rank, body):
    assert strip_prefix(text) == (rank, body)


def test_split_interleaved_ranks_on_one_line():
    segs, last, by_prefix = split_segments("[rank11]: recomputed metadata: {'shape': torch.Size([964, 5120]),"
                                           "[rank13]: Traceback (most recent call last):", None)
    assert segs == [(11, "recomputed metadata: {'shape': torch.Size([964, 5120]),"),
                    (13, "Traceback (most recent call last):")]
    assert (last, by_prefix) == (13, True)


def test_split_flattened_bare_rank_form_of_the_origin_thread():
    line = ("rank11: File \".../checkpoint.py\", line 902, in check_recomputed_tensors_match rank11: raise "
            "CheckpointError( rank11: torch.utils.checkpoint.CheckpointError: torch.utils.checkpoint: Recomputed "
            "values for the following tensors have different metadata than during the forward pass. rank11: tensor "
            "at position 46: rank11: saved metadata: {'shape': torch.Size([965, 5120]), 'dtype': torch.bfloat16, "
            "'device': device(type='xpu', index=3)} rank11: recomputed metadata: {'shape': torch.Size([964, 5120]),"
            "[rank13]: Traceback (most recent call last):")
    run = parse_text(line)
    (err,) = run.errors
    assert err.rank == 11 and err.positions[0].position == 46
    assert err.positions[0].saved == TensorMeta((965, 5120), "bf16", "xpu:3")
    assert err.positions[0].recomputed is None and run.truncated


def test_split_op_start_inside_a_line():
    segs, _, _ = split_segments("[rank1]: ['$13: bf16[1, 128, 5120]', '$17: bf1 $72: bf16[1, 5, 1024, 128] = "
                                "torch._ops.aten.transpose.int($69, 1, 2)", None)
    assert [s for _, s in segs] == ["['$13: bf16[1, 128, 5120]', '$17: bf1",
                                    "$72: bf16[1, 5, 1024, 128] = torch._ops.aten.transpose.int($69, 1, 2)"]


def test_iter_lines_cr_crlf_long_lines_and_bad_bytes():
    data = b"a\r\nb\rc\n" + b"x" * 25 + b"\n\xff\xfeok"
    stats = ReadStats()
    got = list(iter_lines(io.BytesIO(data), stats, max_line=10))
    assert got[:3] == [("a", True), ("b", True), ("c", True)]
    assert "".join(t for t, _ in got[3:6]) == "x" * 25 and [e for _, e in got[3:6]] == [False, False, True]
    assert got[-1] == ("\ufffd\ufffdok", False)
    assert stats.long_lines == 2 and stats.undecodable_lines == 1 and stats.bytes_read == len(data)


# ------------------------------------------------------------------ error texts

@pytest.mark.parametrize("text,expected", [
    ("torch.utils.checkpoint.CheckpointError: torch.utils.checkpoint: Recomputed values for the following "
     "tensors have different metadata than during the forward pass.", ("header", "metadata_mismatch")),
    ("torch.utils.checkpoint: A different number of tensors was saved during the original forward and "
     "recomputation.", ("header", "count_mismatch")),
    ("CheckpointError: torch.utils.checkpoint: trying to save more tensors during recomputation than during the "
     "original forward pass.", ("header", "more_saved_in_recompute")),
    ("RuntimeError: aten.mm.default encountered during backward but not found in storage. This can happen if "
     "the operations in the checkpointed region are nondeterministic", ("header", "sac_not_found")),
    ("RuntimeError: aten.mm.default invocation index 1 encountered during backward but not found in storage.",
     ("header", "sac_not_found")),
    ("RuntimeError: aten.mm.default encountered during backward, but not found in storage",  # torch 2.4 wording
     ("header", "sac_not_found")),
    ("RuntimeError: Tensor cached during selective activation checkpoint has been mutated", ("header", "sac_mutated")),
    ("torch.utils.checkpoint.CheckpointError: torch.utils.checkpoint: Unpack is being triggered for a tensor that "
     "was already unpacked once.", ("header", "other")),
    ("tensor at position 48:", ("position", 48)),
    ("tensor at position x:", ("garbled", None)),
    ("Number of tensors saved during recomputation: 884.", ("count_recomputed", 884, True)),
    ("Number of tensors saved during forward: 26", ("count_saved", 26, False)),
    ("tensor at position 4", ("garbled", None)),
    (".", ("end", None)),
    ("Tip: To see a more detailed error message, either pass `debug=True` to", ("end", None)),
])
def test_classify_error_line(text, expected):
    assert classify_error_line(text) == expected


@pytest.mark.parametrize("text,op", [
    ("RuntimeError: aten.arange.start_step encountered during backward but not found in storage. This can happen",
     "aten.arange.start_step"),
    ("aten.mm.default invocation index 1 encountered during backward but not found in storage.", "aten.mm.default"),
    ("RuntimeError: aten.mm.default encountered during backward, but not found in storage", "aten.mm.default"),
    ("RuntimeError: Tensor cached during selective activation checkpoint has been mutated", None),
])
def test_the_op_selective_ac_refused_is_read_from_its_error(text, op):
    assert refused_op(text) == op


@pytest.mark.parametrize("text", [
    "raise CheckpointError(",
    '"torch.utils.checkpoint: Recomputed values for the following tensors "',  # source line of the raise
    "torch.utils.checkpoint.CheckpointError:  An error happened while unpacking tensors; dumping logs of latest",
    "torch.utils.checkpoint.CheckpointError:",
    "hello",
])
def test_not_an_error_line(text):
    assert classify_error_line(text) is None


def test_error_message_keeps_the_raw_text():
    run = parse_text("torch.utils.checkpoint.CheckpointError: torch.utils.checkpoint: Recomputed values for the "
                     "following tensors have different metadata than during the forward pass.\n"
                     "tensor at position 3:\nsaved metadata: {'shape': torch.Size([2]), 'dtype': torch.float32, "
                     "'device': device(type='cpu')}\nrecomputed metadata: {'shape': torch.Size([3]), "
                     "'dtype': torch.float32, 'device': device(type='cpu')}\n.\n")
    (err,) = run.errors
    assert err.message.splitlines()[0].startswith("torch.utils.checkpoint: Recomputed values")
    assert "tensor at position 3:" in err.message and not run.truncated and run.exit_status == "exception"


def test_decreasing_positions_start_a_new_error():
    text = "\n".join(["tensor at position 7:", "saved metadata: {'shape': torch.Size([1]), 'dtype': torch.float32, "
                      "'device': device(type='cpu')}", "recomputed metadata: {'shape': torch.Size([2]), 'dtype': "
                      "torch.float32, 'device': device(type='cpu')}", "tensor at position 2:"]) + "\n"
    run = parse_text(text)
    assert [[p.position for p in e.positions] for e in run.errors] == [[7], [2]]


# ------------------------------------------------------------------ dump pieces

def test_frame_source():
    assert frame_source("/home/u/torchtitan/torchtitan/experiments/llama4/model/moe.py:40:forward") == \
        "llama4/model/moe.py:40 in forward"
    assert frame_source("train.py:650:main") == "train.py:650 in main"
    assert frame_source("/tmp/run/gen.py:15:forward") == "/tmp/run/gen.py:15 in forward"  # short: stays absolute
    assert frame_source("/x/lib/python3.10/site-packages/torch/nn/modules/module.py:1755:_wrapped_call_impl") is None
    assert frame_source("/data/users/weif/pytorch/torch/_tensor.py:648:backward") is None
    assert frame_source("/usr/lib/python3.10/contextlib.py:79:inner") is None
    assert frame_source("/usr/local/src/conda/python-3.10.16/Python/ceval.c:5945:do_call_core") is None
    assert frame_source("??:0:_start") is None
    assert frame_source("/dev-sandbox/ratnam/modules/module.py:1809:inner") is None  # spliced torch frame
    assert frame_source("/dev/PythonFallbackKernel.cpp:149:void c10::make<&(x)::fb4/model/model.py:339:forward") is None
    assert frame_source("/x/lib/python3.12/site-packages/transformers/models/llama/modeling_llama.py:300:forward") \
        == "models/llama/modeling_llama.py:300 in forward"
    assert frame_source("/home/me/My Project/train.py:20:forward") == "me/My Project/train.py:20 in forward"
    assert frame_source("C:\\Users\\John Smith\\train.py:7:main") == "Users/John Smith/train.py:7 in main"


def test_footer_table_of_contents_is_not_a_section():
    toc = "1. Stack traces of the operators that ran in the original forward"
    assert classify_dump_line(toc, in_footer=True) is None
    assert classify_dump_line(toc, in_footer=False) == S_TRACES_FWD
    assert classify_dump_line("|        " + toc + "     |", in_footer=True) == S_TRACES_FWD
    assert classify_dump_line("ERROR: Detected non-determinism while running activation checkpointing", False) \
        == S_FOOTER


def test_two_dumps_on_two_ranks_interleaved():
    def dump(rank, n):
        p = f"[rank{rank}]: "
        return [p + "Operations executed during the original forward:",
                p + f"$1: f32[{n}] = torch._ops.aten.sin.default($0)",
                p + "Operations executed during recomputation:",
                p + f"$1: f32[{n + 1}] = torch._ops.aten.sin.default($0)",
                p + "+------------------------------------------------------------------------------+",
                p + " ERROR: Detected non-determinism while running activation checkpointing"]
    a, b = dump(0, 2), dump(1, 5)
    lines = [x for pair in zip(a, b) for x in pair]
    run = parse_text("\n".join(lines) + "\n")
    assert [(r.rank, r.forward.ops[0].out[0].shape, r.recompute.ops[0].out[0].shape) for r in run.regions] == \
        [(0, (2,), (3,)), (1, (5,), (6,))]
    assert not run.truncated


def test_dump_cut_by_the_next_error_on_its_rank():
    text = "\n".join([
        "[rank2]: Operations executed during the original forward:",
        "[rank2]: $1: f32[2] = torch._ops.aten.sin.default($0)",
        "[rank2]: Traceback (most recent call last):",
        "[rank2]: torch.utils.checkpoint.CheckpointError: torch.utils.checkpoint: trying to save more tensors "
        "during recomputation than during the original forward pass.",
    ]) + "\n"
    run = parse_text(text)
    (region,) = run.regions
    assert len(region.forward.ops) == 1 and not region.forward.complete and region.recompute is None
    assert [e.kind for e in run.errors] == ["more_saved_in_recompute"]
    assert not run.truncated  # the log went on after the dump: it does not end inside it
    assert any("cut short by what followed it: rank 2" in n for n in run.notes)


# ------------------------------------------------------------------ API

def test_parse_log_accepts_paths_and_streams(tmp_path):
    text = ("[rank0]: torch.utils.checkpoint.CheckpointError: torch.utils.checkpoint: A different number of "
            "tensors was saved during the original forward and recomputation.\n"
            "[rank0]: Number of tensors saved during forward: 27\n"
            "[rank0]: Number of tensors saved during recomputation: 8.\n")
    path = tmp_path / "x.log"
    path.write_text(text)
    seen = []
    runs = [parse_log(path), parse_log(str(path), progress=lambda done, total: seen.append((done, total))),
            parse_log(io.StringIO(text)), parse_log(io.BytesIO(text.encode())), parse_text(text)]
    for run in runs:
        (err,) = run.errors
        assert (err.kind, err.rank, err.saved_count, err.recomputed_count) == ("count_mismatch", 0, 27, 8)
        assert not run.truncated
    assert seen[-1] == (len(text), len(text))
    with open(path) as f:
        assert parse_log(f).path == str(path)


def test_progress_callback_errors_do_not_break_parsing(tmp_path):
    path = tmp_path / "x.log"
    path.write_bytes(b"x\n" * (1 << 20))  # 2 MiB: called more than once
    calls = []

    def progress(done, total):
        calls.append(done)
        raise RuntimeError("broken progress bar")

    run = parse_log(path, progress=progress)
    assert len(calls) >= 2 and calls[-1] == 2 << 20
    assert len(run.notes) == 1 and run.notes[0].startswith("found no CheckpointError text and no debug=True dump")


def test_looks_like_log(tmp_path):
    log = tmp_path / "a.log"
    log.write_text("noise\n" * 10 + "[rank0]: tensor at position 1:\n")
    assert looks_like_log(log)
    trace = tmp_path / "trace.jsonl"
    trace.write_text(json.dumps({"format": "ac-diff-trace", "message": "tensor at position 1:"}) + "\n")
    assert not looks_like_log(trace)
    plain = tmp_path / "b.txt"
    plain.write_text("hello\n")
    assert not looks_like_log(plain)
    with pytest.raises(FileNotFoundError):  # the CLI names the file and the problem, not "neither ... nor"
        looks_like_log(tmp_path / "missing.log")
    big = tmp_path / "big.log"  # the marker only in the last MiB
    with open(big, "wb") as f:
        f.write(b"x" * (3 << 20) + b"\nOperations executed during the original forward:\n")
    assert looks_like_log(big)


def _labelled(text: str, how: str) -> str:
    """One rank's log as a launcher or a log collector hands it on."""
    lines = text.splitlines()
    if how == "docker":
        return "".join(json.dumps({"log": line + "\n", "stream": "stderr", "time": "2026-12-06T17:55:00Z"}) + "\n"
                       for line in lines)
    if how == "fluent":
        return "".join(json.dumps({"@timestamp": "2026-12-06T17:55:00Z", "message": line, "rank": 1}) + "\n"
                       for line in lines)
    if how == "srun":
        return "".join(f"1: {line}\n" for line in lines)
    return "".join(f"[7,1]<stderr>:{line}\n" for line in lines)  # mpirun --tag-output


@pytest.mark.parametrize("how", ["docker", "fluent", "srun", "mpirun"])
def test_a_log_as_collectors_and_launchers_store_it_reads_like_the_plain_one(tmp_path, how):
    """Docker's json-file and fluent-bit keep each line as a JSON record ({"log": ...}, {"message": ...}): such a
    log was rejected ("neither ... a log with a torch.utils.checkpoint error"). srun --label's `1: ` and mpirun
    --tag-output's `[7,1]<stderr>:` were not read as ranks: every stack trace was lost, and two ranks' dumps merged."""
    plain = gzip.decompress((Path(__file__).parent / "data" / "logs" / "torch-2.14.1" / "moe_bias_update_debug.log.gz")
                            .read_bytes())
    expected = parse_text(plain.decode())
    path = tmp_path / f"{how}.log"
    path.write_text(_labelled(plain.decode(), how))
    assert looks_like_log(path)
    run = parse_log(path)
    assert [(e.kind, [p.position for p in e.positions]) for e in run.errors] == [
        (e.kind, [p.position for p in e.positions]) for e in expected.errors]
    assert {e.rank for e in run.errors} == ({None} if how == "docker" else {1}), [e.rank for e in run.errors]
    assert [(len(r.forward.ops), len(r.recompute.ops)) for r in run.regions] == [
        (len(r.forward.ops), len(r.recompute.ops)) for r in expected.regions]
    sources = [op.source for r in run.regions for op in r.forward.ops]
    assert sources == [op.source for r in expected.regions for op in r.forward.ops] and any(sources)


def test_srun_labels_are_read_only_in_a_file_that_starts_with_one():
    """Any line may start with a number and a colon ("3: loss 1.2"): where the first line has no label, none is a
    rank."""
    run = parse_text("epoch start\n3: loss 1.2\n[rank0]: tensor at position 4:\n")
    assert all(e.rank != 3 for e in run.errors)


def test_torchrun_local_ranks_under_srun_labels_are_global_ranks_by_node():
    """torchrun --tee 3 under `srun -l`, one task per node: `1: [default0]: ...` is node 1's local rank 0, global
    rank 2 of a job with 2 per node. The local rank was read as the global one (27h: the clean global rank 0 named
    diverged, ranks 2 and 3 lost, "2 of 2 ranks" for a 4-rank job); a `[rankN]` torch printed still wins."""
    plain = gzip.decompress((Path(__file__).parent / "data" / "logs" / "torch-2.14.1" / "moe_bias_update_debug.log.gz")
                            .read_bytes()).decode().splitlines()
    error = [line for line in plain if line.strip()]
    lines = ["0: [default0]: step 0 ok", "0: [default1]: step 0 ok", "1: [default0]: step 0 ok"]
    lines += [f"1: [default1]: {line}" for line in error]  # (node 1's local rank 1: global rank 3)
    run = parse_text("\n".join(lines) + "\n")
    assert {e.rank for e in run.errors} == {3}, [e.rank for e in run.errors]
    assert run.header["ranks"] == [0, 1, 2, 3] and {r.rank for r in run.regions} == {3}
    assert any("global rank = node x that + local rank" in n and "2 per node" in n for n in run.notes), run.notes
    tagged = parse_text("\n".join(["0: [default0]: step 0 ok", "1: [default0]: step 0 ok"]
                                  + [f"1: [default1]:[rank7]: {line}" for line in error]) + "\n")
    assert {e.rank for e in tagged.errors} == {7}


@pytest.mark.parametrize("data", [b"", b"\n\n", b"\x00\xff" * 1000, b"[rank", b"tensor at position",
                                  b"$1: f32[", b"Operations executed during recomputation:"])
def test_degenerate_inputs(data):
    run = parse_log(io.BytesIO(data))
    assert run.source == "log" and isinstance(run.notes, list)


# ------------------------------------------------------------------ texts the installed torch produces

@pytest.fixture(scope="module")
def torch_texts():
    """str() of real CheckpointErrors raised by the installed torch, one of each kind we can provoke."""
    torch = pytest.importorskip("torch")
    from torch.utils.checkpoint import CheckpointError, checkpoint

    texts = {}
    x = torch.randn(4, requires_grad=True)
    calls = {"n": 0}

    def shape_changes(t):  # the slice is one element shorter in the recompute
        calls["n"] += 1
        y = t.sin()
        z = y[:3 if calls["n"] == 1 else 2].exp()
        return z.sum() + y.cos().sum()

    def fewer_saved(t):  # the recompute saves fewer tensors
        calls["n"] += 1
        return t.sin().exp().sum() if calls["n"] == 1 else t.sin().sum()

    for name, fn, debug in [("metadata", shape_changes, False), ("dump", shape_changes, True),
                            ("count", fewer_saved, False)]:
        calls["n"] = 0
        # no C++ frames in the dump: symbolising them takes seconds and is not what we parse
        with mock.patch.object(platform, "machine", return_value="riscv"), torch_debug_logging():
            try:
                checkpoint(fn, x, use_reentrant=False, debug=debug).backward()
            except CheckpointError as e:
                texts[name] = str(e)

    import functools

    import torch.utils.checkpoint as cp
    if not hasattr(cp, "create_selective_checkpoint_contexts"):  # torch < 2.5: no selective AC
        return texts
    ctx = functools.partial(cp.create_selective_checkpoint_contexts, [torch.ops.aten.mm.default])
    a, w = torch.randn(4, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
    y, out = checkpoint(lambda a, w: ((h := a @ w), h.sin()), a, w, use_reentrant=False, context_fn=ctx)
    with torch.no_grad():
        y.mul_(2)
    try:
        out.sum().backward()
    except RuntimeError as e:
        texts["sac_mutated"] = f"RuntimeError: {e}"
    return texts


def test_torch_metadata_error(torch_texts):
    run = parse_text(torch_texts["metadata"])
    (err,) = run.errors
    assert err.kind == "metadata_mismatch" and err.rank is None
    (p,) = err.positions
    assert (p.saved, p.recomputed) == (TensorMeta((3,), "f32", "cpu"), TensorMeta((2,), "f32", "cpu"))
    assert not run.truncated and run.notes == []


def test_torch_count_error(torch_texts):
    (err,) = parse_text(torch_texts["count"]).errors
    assert (err.kind, err.saved_count, err.recomputed_count) == ("count_mismatch", 2, 1)


def test_torch_sac_mutated(torch_texts):
    if "sac_mutated" not in torch_texts:
        pytest.skip("this torch has no create_selective_checkpoint_contexts (torch < 2.5)")
    (err,) = parse_text(torch_texts["sac_mutated"]).errors
    assert err.kind == "sac_mutated"


def test_torch_debug_dump_with_sources(torch_texts):
    run = parse_text(torch_texts["dump"])
    assert not run.truncated and run.notes == [] and run.errors == []
    (region,) = run.regions
    fwd, rec = region.forward, region.recompute
    assert [o.op for o in fwd.ops] == ["aten.sin.default", "aten.slice.Tensor", "aten.exp.default",
                                       "aten.sum.default", "aten.cos.default", "aten.sum.default", "aten.add.Tensor"]
    assert fwd.ops[1].args == ["$1", 0, 0, 3]
    # the recompute's ids depend on how many detaches this torch's pack hook logs (one per pack; two before 2.12)
    sin = next(o for o in rec.ops if o.op == "aten.sin.default")
    assert [o.args for o in rec.ops if o.op == "aten.slice.Tensor"] == [[sin.log_ids[0][0], 0, 0, 2]]
    assert rec.ops[0].op == "aten.detach.default"
    assert [o.op for o in rec.ops if o.op != "aten.detach.default"] == [
        "aten.sin.default", "aten.slice.Tensor", "aten.exp.default", "aten.sum.default"]
    assert fwd.complete and rec.complete
    for op in fwd.ops + rec.ops:
        assert op.source is not None and op.source.endswith(".py:" + op.source.split(".py:")[1])
        assert "tests/test_logs_units.py:" in op.source and op.source.endswith("in shape_changes"), op.source


def test_torch_dump_flattened_and_crlf(torch_texts):
    dump = torch_texts["dump"]
    for variant in (" ".join(ln for ln in dump.splitlines() if ln.strip()), dump.replace("\n", "\r\n")):
        run = parse_text(variant)
        (region,) = run.regions
        assert len(region.forward.ops) == 7
        assert len([o for o in region.recompute.ops if o.op != "aten.detach.default"]) == 4
        assert all(o.source and o.source.endswith("in shape_changes") for o in region.forward.ops)
        assert run.notes == [] and not run.truncated


def test_torch_dump_and_error_interleaved_with_prefixes(torch_texts):
    """Two ranks print their error and dump at the same time, line by line."""
    a = ["[rank0]: " + s for s in (torch_texts["metadata"] + "\n" + torch_texts["dump"]).splitlines()]
    b = ["[rank1]: " + s for s in (torch_texts["count"] + "\n" + torch_texts["dump"]).splitlines()]
    lines = [x for i in range(max(len(a), len(b))) for x in (a[i:i + 1] + b[i:i + 1])]
    run = parse_text("\n".join(lines) + "\n")
    assert sorted((e.rank, e.kind, e.region) for e in run.errors) == [(0, "metadata_mismatch", 0),
                                                                     (1, "count_mismatch", 0)]
    assert sorted(r.rank for r in run.regions) == [0, 1]
    assert all(len(r.forward.ops) == 7 and r.forward.ops[0].source for r in run.regions)
    assert not run.truncated


def test_a_log_pasted_twice_gives_two_errors_not_one_with_repeated_positions(tmp_path):
    """A fragment that starts on a metadata line (its position cut off), pasted twice into one file."""
    from ac_diff.logs import parse_log

    meta = "{'shape': torch.Size([%d, 4]), 'dtype': torch.float32, 'device': device(type='cpu')}"
    fragment = ""
    for n in (None, 49, 51):
        fragment += (f"[rank1]: tensor at position {n}:\n" if n else "") + \
            f"[rank1]: saved metadata: {meta % 9}\n[rank1]: recomputed metadata: {meta % 8}\n"
    path = tmp_path / "dup.log"
    path.write_text(fragment + fragment)
    errors = parse_log(path).errors
    assert [[p.position for p in e.positions if p.position is not None] for e in errors] == [[49, 51], [49, 51]]


def test_a_traces_checkpoint_error_text_is_parsed_once_when_read():
    """The text a recorder kept (check_error records first, else the uncaught exception) becomes the Run's
    TorchErrors with the trace's rank and the region the record names; a non-checkpoint exception adds none."""
    from conftest import REPO

    from ac_diff.logs import recorded_errors
    from ac_diff.passes import Run

    text = (REPO / "tests/data/logs/torch-2.14.1/moe_bias_update_error.log").read_text()
    message = text.split("CheckpointError: ", 1)[1]
    run = Run(source="trace", rank=3, exc_type="CheckpointError", exc_message=message)
    [err] = recorded_errors(run, [])
    assert (err.kind, err.rank, err.region, err.positions[0].position) == ("metadata_mismatch", 3, None, 35)
    [err] = recorded_errors(run, [{"message": message, "region": 7}])
    assert err.region == 7
    assert recorded_errors(Run(source="trace", exc_type="ValueError", exc_message=message), []) == []


@pytest.mark.parametrize("text, header", [
    ("torch.utils.checkpoint.CheckpointError: torch.utils.checkpoint: Unpack is being triggered for a tensor", True),
    ("CheckpointError: torch.utils.checkpoint: a message a newer torch words differently", True),
    ("torch.utils.checkpoint.CheckpointError: a message without torch's prefix", True),
    # prose that names the error (a README, a comment, a chat paste): not an error torch raised
    ("`CheckpointError: ... tensor at position 46` — or nothing at all while the gradients go wrong.", False),
    ("we kept hitting CheckpointError: no idea why", False),
])
def test_an_unrecognised_checkpoint_error_is_one_torch_raised(text, header):
    assert (classify_error_line(text) == ("header", "other")) is header


_MUTATED = "Tensor cached during selective activation checkpoint has been mutated"
_NOT_FOUND = "aten.mm.default invocation index 1 encountered during backward but not found in storage."


@pytest.mark.parametrize("text, kind", [
    (f"RuntimeError: {_MUTATED}", "sac_mutated"),
    (_MUTATED, "sac_mutated"),
    (f"[rank1]: RuntimeError: {_NOT_FOUND}", "sac_not_found"),
    (f'{{"level": "ERROR", "exc_info": "Traceback (most recent call last):\\nRuntimeError: {_MUTATED}"}}',
     "sac_mutated"),  # a structured log: the traceback in one JSON string
    (f'{{"error": "{_NOT_FOUND}"}}', "sac_not_found"),
    # prose quoting torch's words (this README's fix section), a source line a traceback shows: no error
    (f'the script\'s error (e.g. SAC\'s "{_MUTATED}" when the script normalises', None),
    (f'                    "{_MUTATED}"', None),
    ("the checkpoint file was not found in storage", None),
])
def test_selective_ac_errors_start_the_message(text, kind):
    assert classify_error_line(text) == (("header", kind) if kind else None)


def test_the_readme_is_not_a_log():
    run = parse_text(Path(__file__).resolve().parent.parent.joinpath("README.md").read_text())
    assert run.errors == [] and run.regions == []


def test_a_dumps_entry_skips_a_decorators_wrapper():
    """The frames under a dump's op, innermost first: the region's entry is the user frame under torch's checkpoint,
    past a decorator's wrapper (transformers wraps a layer's forward in `wrapped_func`)."""
    from ac_diff.logs.dump import DumpBuilder
    from ac_diff.logs.oplines import parse_op_line

    d = DumpBuilder(rank=0, region=0)
    d.op(parse_op_line("$1: f32[2, 4] = torch._ops.aten.mul.Tensor($0, 2)   (1 of 3 in original)"))
    for frame in ("/venv/lib/python3.11/site-packages/transformers/models/llama/modeling_llama.py:297:forward",
                  "/venv/lib/python3.11/site-packages/transformers/utils/deprecation.py:173:wrapped_func",
                  "/venv/lib/python3.11/site-packages/torch/nn/modules/module.py:1786:_call_impl",
                  "/venv/lib/python3.11/site-packages/torch/utils/checkpoint.py:496:checkpoint"):
        d.frame(frame)
    assert d.entry == "forward at models/llama/modeling_llama.py:297"


class _Narrows(torch.nn.Module):
    """A layer whose every second call keeps half its features (a Python counter steers the branch): its recompute
    runs the other branch than its forward, so torch raises a metadata mismatch."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.width, self.calls = width, 0

    def forward(self, x):
        self.calls += 1
        h = self.lin(x)
        return (h[:, :self.width] if self.calls % 2 == 0 else h).relu()


def _debug_error_text(width: int) -> str:
    """The text a training script prints for the CheckpointError its step raises under checkpoint(debug=True)."""
    torch.manual_seed(0)
    return checkpoint_error_text(_Narrows(width), torch.randn(4, 8, requires_grad=True))


def test_a_dump_printed_again_is_one_region_raised_twice():
    """logger.exception("step failed") and then the re-raise print the same error and dump twice: one region, its
    error raised 2 times (it was two regions, "2 of 2 regions diverged"); a dump of other content stays a region of
    its own, numbered after the first."""
    once = _debug_error_text(width=4)
    run = parse_text("ERROR train: step failed\n" + once + "\n" + once)
    assert [r.region for r in run.regions] == [0]
    assert [(e.region, e.count) for e in run.errors] == [(0, 2)]
    other = _debug_error_text(width=2)
    run = parse_text(once + "\n" + other + "\n" + once)
    assert [r.region for r in run.regions] == [0, 1]
    assert sorted((e.region, e.count, e.positions[0].recomputed.shape) for e in run.errors) == [
        (0, 2, (4, 4)), (1, 1, (4, 2))]


def test_a_small_compressed_error_log_cut_short_is_read_as_far_as_it_goes(tmp_path):
    """An error log of a few KB gzips to about 1 KB (25g): cut anywhere, the sniff read one 64 KiB block, lost all it
    had decompressed to the cut, and refused the file as damaged, though the whole CheckpointError was readable."""
    import ac_diff

    text = (Path(__file__).parent / "data" / "logs" / "torch-2.4.1" / "moe_bias_update_error.log").read_bytes()
    packed = gzip.compress(text)
    cut = tmp_path / "error.log.gz"
    cut.write_bytes(packed[: int(len(packed) * 0.9)])
    with pytest.raises(EOFError):
        gzip.decompress(cut.read_bytes())  # (the case: it is cut)
    report = ac_diff.diagnose_paths([cut])
    assert report.verdict == "diverged" and report.torch_error is not None, report.headline
