"""Every real log torch users pasted (tests/data/real_logs, sources in its README.md) parses, and yields
what it holds. If a file is missing these tests FAIL: they are the parser's ground truth.

Argument values: integers that LoggingTensor printed as quoted strings inside lists
(`['14', '99']`) are read back as ints (`[14, 99]`); see ac_diff/logs/args.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ac_diff.logs import UNKNOWN_DEVICE, looks_like_log, parse_log
from ac_diff.passes import Run, TensorMeta
from conftest import REAL_LOGS


LOGS: Path = REAL_LOGS
_CACHE: dict[str, Run] = {}


def run_of(name: str) -> Run:
    if not LOGS.is_dir():
        pytest.fail(f"real logs not found at {LOGS}")
    path = LOGS / name
    if not path.is_file():
        pytest.fail(f"{path} is missing from the real logs directory")
    if name not in _CACHE:
        _CACHE[name] = parse_log(path)
    return _CACHE[name]


def T(shape, dtype, device):
    return TensorMeta(tuple(shape), dtype, device)


def pos_table(err):
    return [(p.position, p.saved, p.recomputed) for p in err.positions]


def bf16(*shape, device="cuda:0"):
    return T(shape, "bf16", device)


# ------------------------------------------------------------------ every file

EXPECTED_FILES = {
    "Joluck_RWKV-PEFT_58.log", "Joluck_RWKV-PEFT_58_part2.log", "Modalities_modalities_361.log",
    "Sompote_SAM3_LoRA_10.log", "Sompote_SAM3_LoRA_10_part2.log", "deepspeedai_DeepSpeed_8130.log",
    "deepspeedai_DeepSpeed_8148.log", "fla-org_native-sparse-attention_24.log", "huggingface_trl_2514.log",
    "huggingface_trl_4314.log", "huggingface_trl_4314_part2.log", "huggingface_trl_5217.log",
    "huggingface_trl_5217_part2.log", "jzhang38_TinyLlama_152.log", "mihirp1998_VADER_9.log",
    "modelscope_DiffSynth-Studio_576.log", "pytorch_pytorch_102241.log", "pytorch_pytorch_144035.log",
    "pytorch_pytorch_155171.log", "pytorch_pytorch_171355.log", "pytorch_torchtitan_1117.log",
    "pytorch_torchtitan_1117_part2.log", "pytorch_torchtitan_1971.log", "pytorch_torchtitan_2771.log",
    "readme_glm4v.log", "torchtitan_llama4_rank1_head.log", "torchtitan_llama4_rank1_tail.log",
}


def test_real_logs_directory_exists():
    assert LOGS.is_dir(), f"real logs not found at {LOGS}"


def test_every_log_has_expectations_here():
    """A log added to the directory must get its own assertions below."""
    present = {p.name for p in LOGS.glob("*.log")} if LOGS.is_dir() else set()
    assert present, f"no .log files in {LOGS}"
    assert present == EXPECTED_FILES, (f"new: {sorted(present - EXPECTED_FILES)}; "
                                       f"gone: {sorted(EXPECTED_FILES - present)}")


@pytest.mark.parametrize("name", sorted(EXPECTED_FILES))
def test_parses_and_is_well_formed(name):
    run = run_of(name)
    assert run.source == "log"
    assert run.path is not None and run.path.endswith(name)
    assert all(isinstance(n, str) and n for n in run.notes)
    for region in run.regions:
        assert region.kind == "log"
        for p in (region.forward, region.recompute):
            if p is not None:
                assert [op.index for op in p.ops] == list(range(len(p.ops)))
                assert all(op.log_ids is not None and not op.op.startswith("torch._ops") for op in p.ops)
    # every paste is read as a log (fla-org's, a traceback through autograd only, like the others)
    assert looks_like_log(LOGS / name)


# ------------------------------------------------------------------ count mismatches

def test_tinyllama_count_27_vs_8():
    run = run_of("jzhang38_TinyLlama_152.log")
    (err,) = run.errors
    assert (err.kind, err.rank, err.saved_count, err.recomputed_count) == ("count_mismatch", None, 27, 8)
    assert not run.truncated and not run.regions


def test_pytorch_171355_count_2634_vs_884_rank0():
    run = run_of("pytorch_pytorch_171355.log")
    (err,) = run.errors
    assert (err.kind, err.rank, err.saved_count, err.recomputed_count) == ("count_mismatch", 0, 2634, 884)
    assert not run.truncated


def test_pytorch_144035_header_only():
    run = run_of("pytorch_pytorch_144035.log")
    (err,) = run.errors
    assert (err.kind, err.saved_count, err.recomputed_count) == ("count_mismatch", None, None)
    assert run.truncated  # the counts that always follow the header are missing
    assert any("before its tensor counts" in n for n in run.notes)


def test_torchtitan_1971_more_saved_indented():
    run = run_of("pytorch_torchtitan_1971.log")
    (err,) = run.errors
    assert (err.kind, err.rank) == ("more_saved_in_recompute", None)
    assert err.message.startswith("torch.utils.checkpoint: trying to save more tensors")
    assert not run.truncated


# ------------------------------------------------------------------ metadata mismatches

def test_rwkv_shape_zero_cut_at_end():
    run = run_of("Joluck_RWKV-PEFT_58.log")
    (err,) = run.errors
    assert (err.kind, err.rank) == ("metadata_mismatch", None)
    assert pos_table(err) == [(5, bf16(1, 1, 2048), bf16(0)), (6, bf16(1, 1, 2048), None)]
    assert run.truncated


def test_rwkv_part2_rank0():
    run = run_of("Joluck_RWKV-PEFT_58_part2.log")
    (err,) = run.errors
    assert err.rank == 0
    assert [p.position for p in err.positions] == [5, 6, 7]
    assert all(p.recomputed.shape == (0,) for p in err.positions)
    # the last dict is cut after "index": shape and dtype survive, the device does not
    assert err.positions[2].recomputed == T((0,), "bf16", UNKNOWN_DEVICE)
    assert run.truncated


def test_pytorch_155171_cut_mid_dict():
    run = run_of("pytorch_pytorch_155171.log")
    (err,) = run.errors
    assert pos_table(err) == [(16, bf16(1, 12, 171, 128), None)]  # recomputed cut at 'dtyp
    assert err.rank is None and run.truncated


def test_torchtitan_1117_rank11_interleaved_with_rank13():
    run = run_of("pytorch_torchtitan_1117.log")
    (err,) = run.errors
    assert (err.kind, err.rank) == ("metadata_mismatch", 11)
    assert pos_table(err) == [(46, bf16(965, 5120, device="xpu:3"), None)]  # recomputed cut by [rank13]
    assert run.truncated
    assert any("rank 11" in n and "rank 13" in n for n in run.notes)


def test_torchtitan_1117_part2_fragment_without_header():
    run = run_of("pytorch_torchtitan_1117_part2.log")
    (err,) = run.errors
    assert err.rank == 1
    assert pos_table(err) == [
        (None, bf16(99, 5120, device="xpu:1"), bf16(98, 5120, device="xpu:1")),
        (49, bf16(99, 8192, device="xpu:1"), bf16(98, 8192, device="xpu:1")),
        (51, bf16(99, 5120, device="xpu:1"), bf16(98, 5120, device="xpu:1")),
        (52, bf16(99, 8192, device="xpu:1"), bf16(98, 8192, device="xpu:1")),
    ]
    assert run.truncated  # ends with "[rank1"


def test_deepspeed_8148_list_then_tip_then_other_rank():
    run = run_of("deepspeedai_DeepSpeed_8148.log")
    (err,) = run.errors
    assert err.rank == 1
    assert pos_table(err) == [(None, bf16(128, device="cuda:1"), bf16(0, device="cuda:1")),
                              (20, bf16(128, device="cuda:1"), bf16(0, device="cuda:1")),
                              (42, bf16(1024, device="cuda:1"), bf16(0, device="cuda:1"))]
    assert run.truncated  # rank 0's traceback is cut
    assert any("rank 0: inside a traceback" in n for n in run.notes)


def test_deepspeed_8130_pytest_prefix():
    run = run_of("deepspeedai_DeepSpeed_8130.log")
    (err,) = run.errors
    assert (err.kind, err.rank) == ("metadata_mismatch", None)
    assert pos_table(err) == [(0, T((8,), "bf16", UNKNOWN_DEVICE), None)]
    assert run.truncated


def test_trl_2514_one_position_cut():
    run = run_of("huggingface_trl_2514.log")
    (err,) = run.errors
    assert err.rank == 0
    assert pos_table(err) == [(4, T((4096,), "bf16", UNKNOWN_DEVICE), None)]
    assert run.truncated


def test_trl_4314_context_parallel_halves():
    run = run_of("huggingface_trl_4314.log")
    (err,) = run.errors
    assert err.rank == 2
    assert pos_table(err) == [
        (25, bf16(1, 8, 24920, 128, device="cuda:2"), bf16(1, 8, 12460, 128, device="cuda:2")),
        (26, bf16(1, 16, 24920, 128, device="cuda:2"), None),  # "torch.b" is not a dtype
    ]


def test_trl_5217_shape_zero_ends_mid_prefix():
    run = run_of("huggingface_trl_5217.log")
    (err,) = run.errors
    assert err.rank == 0
    assert [(p.position, p.saved.shape, p.recomputed.shape) for p in err.positions] == [
        (4, (2048,), (0,)), (22, (128,), (0,)), (40, (128,), (0,)), (82, (2048,), (0,))]
    assert run.truncated  # the last line is "[ra"


def test_modalities_dtype_and_shape():
    run = run_of("Modalities_modalities_361.log")
    (err,) = run.errors
    assert err.rank == 7
    d = "cuda:7"
    assert pos_table(err) == [
        (2, T((4096,), "bf16", d), T((1, 1, 4096, 128), "bf16", d)),
        (3, T((1, 4096, 1), "f32", d), T((1, 1, 4096, 128), "bf16", d)),
        (4, T((1, 4096, 1), "f32", d), T((4096,), "bf16", d)),
        (5, None, None),  # cut mid-dict: "torch.Size([4096, 4096]),"
    ]
    assert run.truncated


def test_vader_two_interleaved_errors():
    run = run_of("mihirp1998_VADER_9.log")
    first, second = run.errors
    assert first.kind == second.kind == "metadata_mismatch"
    assert pos_table(first) == [(54, T((64, 2, 1280), "f16", "cuda:0"), T((320, 2, 2), "f32", "cuda:0")),
                                (55, T((1280, 320), "f16", "cuda:0"), T((320, 2, 64), "f16", "cuda:0"))]
    assert pos_table(second) == [(8, T((4, 320), "f16", "cuda:0"), T((128, 320), "f16", "cuda:0")),
                                 (9, T((320, 320), "f16", "cuda:0"), None)]  # "torch.floa"
    assert run.truncated


def test_sompote_header_and_cut_position():
    run = run_of("Sompote_SAM3_LoRA_10.log")
    (err,) = run.errors
    assert pos_table(err) == [(2, None, None)]
    assert run.truncated


def test_sompote_part2_starts_with_bare_recomputed_line():
    run = run_of("Sompote_SAM3_LoRA_10_part2.log")
    (err,) = run.errors
    d = "cuda:0"
    assert pos_table(err) == [
        (None, None, T((32, 201, 32), "bf16", d)),
        (20, T((256, 32), "bf16", d), T((4, 8, 201, 201), "f32", d)),
        (21, T((32, 256), "bf16", d), T((4, 8, 201, 201), "b8", d)),
        (22, T((201, 4, 256), "b8", d), T((32, 201, 32), "bf16", d)),
        (23, T((256,), "f32", d), T((32, 201, 201), "bf16", d)),
        (24, T((401, 4, 256), "f32", d), T((256, 256), "bf16", UNKNOWN_DEVICE)),
    ]
    assert any("without its CheckpointError header" in n for n in run.notes)


def test_diffsynth_flattened_onto_one_line():
    path = LOGS / "modelscope_DiffSynth-Studio_576.log"
    assert path.read_bytes().count(b"\n") == 0
    run = run_of(path.name)
    (err,) = run.errors
    assert err.rank == 0
    assert pos_table(err) == [(13, bf16(1536), bf16(0)), (23, bf16(1536), bf16(0)),
                              (52, bf16(1536), bf16(0)), (62, None, None)]
    assert run.truncated


def test_glm4v_indented_readme_block_complete():
    run = run_of("readme_glm4v.log")
    (err,) = run.errors
    assert err.rank == 1
    assert [p.position for p in err.positions] == [4, 6, 7, 29, 34, 36]
    assert all(p.saved.dtype == p.recomputed.dtype == "f32" for p in err.positions)
    assert all(p.recomputed.shape == (0,) and p.recomputed.device == "cuda:1" for p in err.positions)
    assert err.positions[5].saved.shape == (27392, 4096)
    assert not run.truncated


# ------------------------------------------------------------------ tracebacks only

@pytest.mark.parametrize("name,rank", [("pytorch_torchtitan_2771.log", 1),
                                       ("fla-org_native-sparse-attention_24.log", 1),
                                       ("huggingface_trl_5217_part2.log", 3)])
def test_traceback_only_pastes(name, rank):
    run = run_of(name)
    assert run.errors == [] and run.regions == []
    assert run.truncated
    assert any(f"rank {rank}: inside a traceback" in n for n in run.notes)
    assert any("found no CheckpointError" in n for n in run.notes)


# ------------------------------------------------------------------ debug dumps

def test_pytorch_102241_op_lists_and_footer():
    run = run_of("pytorch_pytorch_102241.log")
    assert run.errors == []
    (region,) = run.regions
    assert (region.rank, region.region, region.kind, region.module) == (0, 0, "log", None)
    fwd, rec = region.forward, region.recompute
    assert [o.op for o in fwd.ops] == ["aten.sin.default", "aten.exp.default"]
    assert [o.op for o in rec.ops] == ["aten.detach.default"] * 4 + ["aten.sin.default", "aten.lift_fresh.default",
                                                                     "aten.detach.default", "aten.detach.default"]
    assert fwd.ops[1].log_ids == (["$2"], ["$1"])
    assert fwd.ops[1].out == [T((1,), "f32", UNKNOWN_DEVICE)]
    assert rec.ops[5].out == [T((2,), "f32", UNKNOWN_DEVICE)]
    assert fwd.complete and rec.complete
    assert not run.truncated  # cut inside the footer's boilerplate only


def test_trl_4314_part2_forward_list_cut():
    run = run_of("huggingface_trl_4314_part2.log")
    (region,) = run.regions
    assert region.rank == 0
    assert [o.op for o in region.forward.ops] == ["aten.t.default", "aten.view.default", "aten.mm.default",
                                                  "aten._unsafe_view.default"]
    assert region.forward.ops[1].args == ["$2", [7878, 1024]]
    assert not region.forward.complete and region.recompute is None
    assert run.truncated


LLAMA4_SAVED_99 = [48, 49, 51, 52, 53, 55]
LLAMA4_SAVED_105 = [84, 85, 87, 88, 89, 91]


def test_llama4_head_metadata_error():
    run = run_of("torchtitan_llama4_rank1_head.log")
    (err,) = run.errors
    assert (err.kind, err.rank) == ("metadata_mismatch", 1)
    assert [p.position for p in err.positions] == LLAMA4_SAVED_99 + LLAMA4_SAVED_105
    x = "xpu:1"
    for p in err.positions:
        cols = 5120 if p.position in (48, 51, 84, 87) else 8192
        rows_saved, rows_recomputed = (99, 98) if p.position < 80 else (105, 106)
        assert p.recomputed == T((rows_recomputed, cols), "bf16", x), p
        if p.position == 53:
            assert p.saved is None  # "torch.Size([99ug=True` to ..." spliced by another writer
        elif p.position == 91:
            assert p.saved == T((rows_saved, cols), "bf16", UNKNOWN_DEVICE)  # device cut by a C++ frame
        else:
            assert p.saved == T((rows_saved, cols), "bf16", x), p
    assert err.region == 0  # the debug dump that follows is this error's


def test_llama4_head_dump_start():
    run = run_of("torchtitan_llama4_rank1_head.log")
    (region,) = run.regions
    assert (region.rank, region.region) == (1, 0)
    assert region.module == "forward at llama4/model/model.py:337"  # the code checkpoint() ran
    fwd = region.forward
    assert [o.op for o in fwd.ops] == ["aten.view.default", "aten._to_copy.default",
                                       "aten.pow.Tensor_Scalar", "aten.mean.dim"]
    assert fwd.ops[0].source == "llama4/model/model.py:337 in forward"
    assert all(o.source == "llama4/model/model.py:337 in forward" for o in fwd.ops)  # rms_norm's caller
    assert fwd.ops[1].args == ["$2", {"dtype": "torch.float32"}]
    assert fwd.ops[3].args == ["$4", [2], True]
    assert not fwd.complete and region.recompute is None
    assert run.truncated


SPLIT_FWD = [14, 99, 71, 38, 66, 105, 81, 78, 86, 43, 33, 118, 22, 35, 83, 52]
SPLIT_REC = [14, 98, 71, 38, 66, 106, 81, 78, 86, 43, 33, 118, 22, 35, 83, 52]


def test_llama4_tail_split_with_sizes_differs():
    run = run_of("torchtitan_llama4_rank1_tail.log")
    assert run.errors == []
    (region,) = run.regions
    assert (region.rank, region.region) == (1, 0)
    fwd, rec = region.forward, region.recompute
    assert fwd.complete and rec.complete

    (f_split,) = [o for o in fwd.ops if o.op == "aten.split_with_sizes.default"]
    (r_split,) = [o for o in rec.ops if o.op == "aten.split_with_sizes.default"]
    assert f_split.args == ["$181", SPLIT_FWD]
    assert r_split.args == ["$245", SPLIT_REC]
    # the recompute line is whole: 16 outputs whose rows are the sizes
    assert [m.shape for m in r_split.out] == [(n, 5120) for n in SPLIT_REC]
    assert r_split.log_ids == ([f"${i}" for i in range(246, 262)], ["$245"])
    # the forward line was spliced into op $124's line: only its last six outputs survived
    assert f_split.log_ids == ([f"${i}" for i in range(192, 198)], ["$181"])
    assert [m.shape[0] for m in f_split.out] == SPLIT_FWD[-6:]


def test_llama4_tail_router_ops_in_both_passes():
    run = run_of("torchtitan_llama4_rank1_tail.log")
    fwd, rec = run.regions[0].forward, run.regions[0].recompute
    for p in (fwd, rec):
        (topk,) = [o for o in p.ops if o.op == "aten.topk.default"]
        assert [m.dtype for m in topk.out] == ["f32", "i64"] and topk.args[1:] == [1, 1]
        (histc,) = [o for o in p.ops if o.op == "aten.histc.default"]
        assert histc.out == [T((16,), "i64", UNKNOWN_DEVICE)]
        (sort,) = [o for o in p.ops if o.op == "aten.sort.stable"]
        assert sort.args[1:] == [{"stable": True}]
    (f_topk,) = [o for o in fwd.ops if o.op == "aten.topk.default"]
    assert f_topk.log_ids == (["$159", "$160"], ["$158"])
    # an op with a list of tensors as its argument
    cat = next(o for o in fwd.ops if o.op == "aten.cat.default")
    assert cat.args[0] == [f"${i}" for i in range(13, 21)] and cat.log_ids[1] == cat.args[0]
    # collectives keep their string arguments
    rs = next(o for o in fwd.ops if o.op == "_c10d_functional.reduce_scatter_tensor.default")
    assert rs.args[1:] == ["sum", 8, "9"]


def test_llama4_tail_sources_and_counts():
    run = run_of("torchtitan_llama4_rank1_tail.log")
    fwd, rec = run.regions[0].forward, run.regions[0].recompute
    # 289 forward / 649 recompute ops in the original; lines lost to splicing are skipped
    assert 275 <= len(fwd.ops) <= 289 and 630 <= len(rec.ops) <= 649
    by_ids = {tuple(o.log_ids[0]): o for o in rec.ops}
    assert by_ids[("$710",)].source == "llama4/model/moe.py:63 in forward"  # (645 of 649 in recompute)
    assert by_ids[("$712",)].source == "llama4/model/moe.py:63 in forward"
    assert by_ids[("$714",)].source == "llama4/infra/expert_parallel.py:79 in _prepare_output_fn"
    assert by_ids[("$715",)].source == "llama4/model/moe.py:316 in forward"
    assert not run.truncated
    notes = " ".join(run.notes)
    assert "garbled" in notes and "salvaged" in notes and "from the middle" in notes


def test_llama4_head_then_tail_is_one_dump():
    """The two excerpts of one file, concatenated: the error, then one dump with both passes."""
    import io

    data = (LOGS / "torchtitan_llama4_rank1_head.log").read_bytes() + b"\n" + \
        (LOGS / "torchtitan_llama4_rank1_tail.log").read_bytes()
    run = parse_log(io.BytesIO(data))
    (err,) = run.errors
    (region,) = run.regions
    assert err.region == region.region == 0
    assert region.forward.complete and region.recompute.complete
    assert region.forward.ops[0].op == "aten.view.default"
