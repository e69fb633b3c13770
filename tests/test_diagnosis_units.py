"""Fast diagnosis tests on factory-built passes: comparison, positions, side effects, causes, labels."""

from __future__ import annotations

import math

from ac_diff.diagnosis.passdiff import Tolerance
from ac_diff.diagnosis.dataflow import decision_path
from ac_diff.diagnosis.discrete import describe_flip
from ac_diff.diagnosis.labels import list_diff
from ac_diff.diagnosis.region import diagnose_region
from ac_diff.oprules import written_inputs
from ac_diff.passes import InputRef, Pass, TensorMeta
from factories import ext, meta, op, positions, ref, region


def test_tolerance():
    exact = Tolerance()
    assert exact.equal([1.0, 2.0], [1.0, 2.0]) and not exact.equal([1.0], [1.0 + 1e-7])
    assert exact.equal([math.nan], [math.nan]) and not exact.equal([math.nan], [0.0])
    assert Tolerance(rtol=1e-5).equal([1.0], [1.0 + 1e-7])
    assert exact.equal(None, [3.0])  # nothing to compare is not a difference


def test_list_diff_marks_only_changed_entries():
    assert list_diff([14, 99, 71], [14, 98, 71]) == "[14, 99→98, 71]"
    long_a = list(range(40))
    long_b = long_a[:20] + [99] + long_a[21:]
    assert list_diff(long_a, long_b) == "[.., 18, 19, 20→99, 21, 22, ..]"


def _two_passes(f_ops, r_ops, f_pos=(), r_pos=(), f_ext=(), r_ext=(), stopped=False):
    return (Pass("forward", ops=list(f_ops), positions=list(f_pos), externals=list(f_ext)),
            Pass("recompute", ops=list(r_ops), positions=list(r_pos), externals=list(r_ext), stopped_early=stopped))


def test_identical_passes_are_clean():
    ops = [op(0, "aten.mm.default", fp=[[1.0, 2.0]]), op(1, "aten.relu.default", refs=[ref(0)], fp=[[1.0, 1.0]])]
    f, r = _two_passes(ops, ops, positions(0, 1), positions(0, 1))
    report = diagnose_region(region(f, r))
    assert report.status == "clean" and report.cause is None


def test_same_shape_different_values_at_a_saved_tensor_is_silent():
    f_ops = [op(0, "aten.mm.default", fp=[[1.0, 2.0]]), op(1, "aten.relu.default", refs=[ref(0)], fp=[[1.0, 1.0]])]
    r_ops = [op(0, "aten.mm.default", fp=[[1.5, 2.5]]), op(1, "aten.relu.default", refs=[ref(0)], fp=[[1.5, 1.5]])]
    f, r = _two_passes(f_ops, r_ops, positions(0, 1), positions(0, 1))
    report = diagnose_region(region(f, r))
    assert report.status == "diverged" and report.silent
    assert report.first_value_divergence.op == "aten.mm.default"
    assert report.first_value_divergence.detail.get("inputs_identical") is None  # no inputs recorded
    assert all(p.values_differ for p in report.positions) and all(p.matches for p in report.positions)


def test_divergence_no_saved_tensor_depends_on_is_harmless():
    f_ops = [op(0, "aten.mm.default", fp=[[1.0, 2.0]]), op(1, "aten.sum.default", refs=[ref(0)], fp=[[3.0, 3.0]])]
    r_ops = [op(0, "aten.mm.default", fp=[[1.0, 2.0]]), op(1, "aten.sum.default", refs=[ref(0)], fp=[[4.0, 4.0]])]
    # op 1 differs, but only op 0 is saved
    f, r = _two_passes(f_ops, r_ops, positions(0), positions(0))
    report = diagnose_region(region(f, r))
    assert report.status == "clean"
    assert any("harmless" in n for n in report.notes)


def test_in_place_counter_is_a_side_effect_not_a_divergence():
    counter = InputRef("buffer", name="moe.tokens_per_expert")
    f_ops = [op(0, "aten.mm.default", fp=[[1.0, 2.0]]),
             op(1, "aten.add_.Tensor", refs=[counter, ref(0)], fp=[[5.0, 5.0]])]
    r_ops = [op(0, "aten.mm.default", fp=[[1.0, 2.0]]),
             op(1, "aten.add_.Tensor", refs=[counter, ref(0)], fp=[[10.0, 10.0]])]
    f, r = _two_passes(f_ops, r_ops, positions(0), positions(0),
                       [ext("buffer", "moe.tokens_per_expert", [0.0, 0.0])],
                       [ext("buffer", "moe.tokens_per_expert", [5.0, 5.0])])
    report = diagnose_region(region(f, r))
    assert report.status == "clean"
    assert report.side_effects and "moe.tokens_per_expert" in report.side_effects[0]


def test_changed_buffer_feeding_a_saved_tensor_is_state_mutation():
    bias = InputRef("buffer", name="router.expert_bias")
    f_ops = [op(0, "aten.add.Tensor", refs=[ref(0), bias], fp=[[1.0, 2.0]]),
             op(1, "aten.relu.default", refs=[ref(0)], fp=[[1.0, 1.0]])]
    r_ops = [op(0, "aten.add.Tensor", refs=[ref(0), bias], fp=[[1.2, 2.2]]),
             op(1, "aten.relu.default", refs=[ref(0)], fp=[[1.2, 1.2]])]
    f_ops[0].input_refs = [InputRef("input", name="input[0]"), bias]
    r_ops[0].input_refs = [InputRef("input", name="input[0]"), bias]
    f, r = _two_passes(f_ops, r_ops, positions(1), positions(1),
                       [ext("input", "input[0]", [1.0, 1.0]), ext("buffer", "router.expert_bias", [0.0, 0.0], 1)],
                       [ext("input", "input[0]", [1.0, 1.0]), ext("buffer", "router.expert_bias", [0.1, 0.1], 1)])
    report = diagnose_region(region(f, r))
    assert report.status == "diverged"
    assert report.cause.kind == "state_mutation" and report.cause.tensor == "router.expert_bias"
    assert any("after the backward" in s.title for s in report.suggestions)


def test_extra_saved_tensor_in_recompute_shifts_positions():
    """An extra op early in the recompute takes a position: same shapes, different tensors, torch silent."""
    f_ops = [op(0, "aten.mm.default", fp=[[1.0, 2.0]]), op(1, "aten.relu.default", refs=[ref(0)], fp=[[1.0, 1.0]])]
    r_ops = [op(0, "aten.mm.default", fp=[[1.0, 2.0]]), op(1, "aten.tanh.default", refs=[ref(0)], fp=[[0.5, 0.5]]),
             op(2, "aten.relu.default", refs=[ref(0)], fp=[[1.0, 1.0]])]
    f, r = _two_passes(f_ops, r_ops, positions(0, 1), positions(0, 1), stopped=True)
    report = diagnose_region(region(f, r))
    assert report.status == "diverged" and report.silent
    assert report.cause.kind == "control_flow"
    assert report.first_control_divergence.op == "aten.tanh.default"
    assert report.positions[1].values_differ and report.positions[1].matches


def test_random_op_with_same_inputs_is_rng():
    f_ops = [op(0, "aten.bernoulli_.float", random=True, fp=[[9.0, 9.0]])]
    r_ops = [op(0, "aten.bernoulli_.float", random=True, fp=[[7.0, 7.0]])]
    f, r = _two_passes(f_ops, r_ops, positions(0), positions(0))
    f.state, r.state = {"rng": "aa"}, {"rng": "bb"}
    report = diagnose_region(region(f, r, preserve_rng_state=False))
    assert report.cause.kind == "rng" and "preserve_rng_state=False" in report.cause.detail


def test_a_kernel_flag_set_for_the_backward_where_values_differ_is_global_state():
    """On a GPU: TF32 turned on between the forward and the backward, the recompute's matmul gives other values from
    identical inputs. A pass writes a backend flag only off its usual value; the report gives both values."""
    w = InputRef("param", name="lin.weight")
    f_ops = [op(0, "aten.mm.default", refs=[InputRef("input", name="input[0]"), w], fp=[[1.0, 2.0]])]
    r_ops = [op(0, "aten.mm.default", refs=[InputRef("input", name="input[0]"), w], fp=[[1.0001, 2.0001]])]
    same = [ext("input", "input[0]", [1.0, 1.0]), ext("param", "lin.weight", [3.0, 3.0], 1)]
    f, r = _two_passes(f_ops, r_ops, positions(0), positions(0), same, same)
    f.state = {"grad_enabled": True, "matmul_precision": "highest"}
    r.state = {"grad_enabled": True, "matmul_precision": "high", "cuda.matmul.allow_tf32": True}
    report = diagnose_region(region(f, r))
    assert report.status == "diverged" and report.first_value_divergence.detail["inputs_identical"]
    assert report.state_changes["cuda.matmul.allow_tf32"] == {"forward": False, "recompute": True}
    # (named by the setting scripts make, not by the backend flag it sets with it)
    assert report.cause.kind == "global_state" and report.cause.tensor == "matmul_precision"
    assert report.cause.detail.startswith("the float32 matmul precision (`torch.set_float32_matmul_precision`")
    assert "was 'highest' in the forward and 'high' in the recompute" in report.cause.detail
    assert "`torch.backends.cuda.matmul.allow_tf32`: False -> True" in report.cause.evidence
    fix = report.suggestions[0]
    assert "once for the whole step" in fix.title
    assert fix.code.startswith("torch.set_float32_matmul_precision('highest')  # once, before the training loop")


def test_a_flag_alone_is_named_and_a_precision_set_per_backend_is_set_back_per_backend():
    """`torch.backends.cuda.matmul.allow_tf32` changed alone; the per-backend precision settings (torch >= 2.9, which
    the legacy getter refuses to read once they are mixed) get a fix line per backend."""
    w = InputRef("param", name="lin.weight")
    f_ops = [op(0, "aten.mm.default", refs=[InputRef("input", name="input[0]"), w], fp=[[1.0, 2.0]])]
    r_ops = [op(0, "aten.mm.default", refs=[InputRef("input", name="input[0]"), w], fp=[[1.0001, 2.0001]])]
    same = [ext("input", "input[0]", [1.0, 1.0]), ext("param", "lin.weight", [3.0, 3.0], 1)]
    for before, after, tensor, code in [
            ({}, {"cuda.matmul.allow_tf32": True}, "cuda.matmul.allow_tf32",
             "torch.backends.cuda.matmul.allow_tf32 = False  # once"),
            ({"matmul_precision": "cuda: ieee, mkldnn: ieee"}, {"matmul_precision": "cuda: tf32, mkldnn: bf16"},
             "matmul_precision", "torch.backends.cuda.matmul.fp32_precision = 'ieee'  # once")]:
        f, r = _two_passes(f_ops, r_ops, positions(0), positions(0), same, same)
        f.state, r.state = {"grad_enabled": True, **before}, {"grad_enabled": True, **after}
        report = diagnose_region(region(f, r))
        assert report.cause.tensor == tensor
        assert report.suggestions[0].code.startswith(code), report.suggestions[0].code
    assert "torch.backends.mkldnn.matmul.fp32_precision = 'ieee'" in report.suggestions[0].code


def test_topk_flip_margin():
    scores_f = [[0.9, 0.5, 0.49, 0.1], [0.8, 0.7, 0.2, 0.1]]
    scores_r = [[0.9, 0.49, 0.5, 0.1], [0.8, 0.7, 0.2, 0.1]]
    f = op(0, "aten.topk.default", args=["$", 2, 1], out=[meta(2, 2), meta(2, 2, dtype="i64")],
           values={"in0": scores_f, "out1": [[0, 1], [0, 1]]})
    f.inputs = [meta(2, 4)]
    r = op(0, "aten.topk.default", args=["$", 2, 1], out=[meta(2, 2), meta(2, 2, dtype="i64")],
           values={"in0": scores_r, "out1": [[0, 2], [0, 1]]})
    flip = describe_flip(f, r)
    assert (flip.rows_changed, flip.rows) == (1, 2)
    assert abs(flip.margin_min - 0.01) < 1e-9
    assert "1 of 2 rows" in flip.summary and "top-2 of 4" in flip.summary


def test_decision_path_through_host_list():
    """topk -> view -> histc -> _to_copy(cpu) -> split_with_sizes, as in a debug=True log."""
    ops = [
        op(0, "aten.topk.default", out=[meta(8, 1), meta(8, 1, dtype="i64")]),
        op(1, "aten.view.default", out=[meta(8, dtype="i64")], refs=[InputRef("op", 0, 1)]),
        op(2, "aten.histc.default", out=[meta(2, dtype="i64")], refs=[ref(1)]),
        op(3, "aten.mul.Tensor", out=[meta(8, 4)]),
        op(4, "aten._to_copy.default", out=[meta(2, dtype="i64")], refs=[ref(2)],
           args=["$", {"device": "device(type='cpu')"}]),
        op(5, "aten.split_with_sizes.default", out=[meta(3, 4), meta(5, 4)], refs=[ref(3)], args=["$", [3, 5]]),
    ]
    path = decision_path(ops, ops[5])
    assert [o.op.split(".")[1] for o in path] == ["topk", "view", "histc", "_to_copy", "split_with_sizes"]


def test_another_branch_running_the_same_op_says_where_each_pass_ran_it():
    """A Python branch picks another submodule: the first ops read alike (a transpose of a same-sized weight), so
    the divergence names the module and line each pass ran it in."""
    f_ops = [op(0, "aten.native_layer_norm.default", fp=[[1.0, 1.0]]),
             op(1, "aten.t.default", module="mix.a", fp=[[2.0, 2.0]]),
             op(2, "aten.relu.default", module="mix", refs=[ref(1)], fp=[[3.0, 3.0]])]
    r_ops = [op(0, "aten.native_layer_norm.default", fp=[[1.0, 1.0]]),
             op(1, "aten.t.default", module="mix.b", fp=[[5.0, 5.0]]),
             op(2, "aten.tanh.default", module="mix", refs=[ref(1)], fp=[[4.0, 4.0]])]
    r_ops[1].source = "model.py:12 in forward (the other branch)"
    f, r = _two_passes(f_ops, r_ops, positions(1, 2), positions(1, 2))
    report = diagnose_region(region(f, r))
    assert report.status == "diverged" and report.cause.kind == "control_flow"
    first = report.first_divergence()
    assert first.op == "aten.t.default", first
    assert "in mix.a (model.py:11 in forward) where the recompute ran aten.t.default -> f32[4, 4] in mix.b " \
           "(model.py:12 in forward (the other branch))" in first.summary, first.summary


def test_a_bare_sequential_index_reads_as_a_module_in_sentences():
    from ac_diff.diagnosis.labels import module_label

    assert module_label("1") == "module `1`" and module_label("0.2") == "module `0.2`"
    assert module_label("layers.1") == "layers.1" and module_label("1.fc") == "1.fc"


def test_other_values_from_identical_inputs_on_a_gpu_also_name_a_write_around_dispatch():
    """A nondeterministic kernel, and on a GPU, where outputs are fingerprinted in batches (fused_prints.py), also a
    raw kernel that wrote the output in place before its batch was read."""
    def passes(device: str):
        out = [TensorMeta((4, 4), "f32", device)]
        f_ops = [op(0, "aten.mm.default", fp=[[1.0, 2.0]], out=out),
                 op(1, "aten.relu.default", refs=[ref(0)], fp=[[1.0, 1.0]], out=out)]
        r_ops = [op(0, "aten.mm.default", fp=[[1.0, 2.0]], out=out),
                 op(1, "aten.relu.default", refs=[ref(0)], fp=[[1.5, 1.5]], out=out)]
        return _two_passes(f_ops, r_ops, positions(0, 1), positions(0, 1))

    cpu, gpu = (diagnose_region(region(*passes(d))).cause for d in ("cpu", "cuda:0"))
    assert cpu.kind == gpu.kind == "nondeterministic_op" and cpu.tensor == gpu.tensor == "aten.relu.default"
    assert "raw Triton" in gpu.detail and "raw Triton" not in cpu.detail


def test_externals_pair_by_name_or_where_one_pass_could_not_name_it():
    """`external[0]`: the recorder found no owner in that pass (a nested recompute without the module stack that names
    it in the forward); it is the forward's unmatched external of its kind. Two names are two tensors."""
    from ac_diff.diagnosis.passdiff import Tolerance, compare_externals

    def passes(f_name: str, r_name: str, kind: str = "external"):
        return (Pass("forward", externals=[ext("param", "w", [1.0, 1.0]), ext(kind, f_name, [0.0, 0.0], 1)]),
                Pass("recompute", externals=[ext("param", "w", [1.0, 1.0]), ext(kind, r_name, [2.0, 3.0], 1)]))

    changed, status, renamed = compare_externals(*passes("stack.mask", "external[0]"), Tolerance())
    assert [(f.name, r.name) for f, r in changed] == [("stack.mask", "external[0]")]
    assert status[("external", "stack.mask")] and renamed == {("external", "external[0]"): "stack.mask"}
    changed, status, renamed = compare_externals(*passes("a.buf", "b.buf", "buffer"), Tolerance())
    assert changed == [] and ("buffer", "a.buf") not in status and renamed == {}


def test_written_inputs_are_the_references_an_op_writes_its_out_and_each_of_a_foreach_list_included():
    refs = ["a", "b", "c", "d"]
    assert written_inputs("aten.add_.Tensor", ["$", "$"], refs[:2]) == ["a"]
    assert written_inputs("aten._foreach_mul_.Scalar", [["$", "$"], 0.9], refs[:2]) == ["a", "b"]
    # F.normalize(x, out=buf) -> div.out: the keyword argument comes last, as {name: value}
    assert written_inputs("aten.div.out", ["$", "$", {"out": "$"}], refs[:3]) == ["c"]
    assert written_inputs("aten.div.Tensor", ["$", "$"], refs[:2]) == []
    assert written_inputs("aten.max.dim_max", ["$", 1, False, {"max": "$"}, {"max_values": "$"}], refs[:3]) == ["b", "c"]


def test_the_regions_first_divergence_is_a_shape_change_before_any_value_differed():
    """A memory that grew between the passes: `cat` changed shape at op 1, the attention after it computed other
    values at op 17. The regions table named the attention (value divergences came first whatever their place); a
    decision before the shape change still leads, and a value before it too."""
    from ac_diff.report import Divergence, RegionReport

    def d(kind, index):
        return Divergence(kind, f"aten.{kind}", "blocks.1", None, index, index, kind)

    def lead(**divergences):
        fields = {f"first_{k}_divergence": None for k in ("value", "discrete", "shape", "control")}
        r = RegionReport(rank=0, region=0, module="blocks.1", kind="checkpoint", status="diverged", silent=True,
                         cause=None, positions=[], suggestions=[], chain=[], **{**fields, **divergences})
        return r.first_divergence().kind, r.first_divergence().forward_index

    assert lead(first_shape_divergence=d("shape", 1), first_value_divergence=d("value", 17)) == ("shape", 1)
    assert lead(first_shape_divergence=d("shape", 9), first_value_divergence=d("value", 3)) == ("value", 3)
    assert lead(first_shape_divergence=d("shape", 9), first_discrete_divergence=d("discrete", 4)) == ("discrete", 4)


def test_a_source_outside_the_working_directory_is_named_so_that_it_opens():
    """A script in /tmp/job/scripts run from another directory read `job/scripts/train.py:15` (the last three parts:
    neither absolute nor relative to where the user is); an installed package's file keeps its tail."""
    import os

    from ac_diff.capture.sourceline import short_path

    outside = os.path.join(os.path.dirname(os.getcwd()) or "/", "elsewhere", "job", "scripts", "train.py")
    assert short_path(outside) == outside
    package = "/usr/lib/python3/site-packages/transformers/models/llama/modeling_llama.py"
    assert short_path(package) == "models/llama/modeling_llama.py"
    assert short_path(os.path.join(os.getcwd(), "train.py")) == "train.py"


def test_a_logged_sdpa_left_at_its_default_dropout_draws_nothing():
    """A `debug=True` log of a ViT whose token-merge count changed before the backward (25h): the log's SDPA call
    lists three tensors (dropout_p left at its default, 0), yet the cause read "rng: ... depends on the random op
    aten._scaled_dot_product_flash_attention_for_cpu". An op that can draw, drew only where its arguments say so."""
    from ac_diff.diagnosis.cause import _drew
    from ac_diff.passes import OpRecord

    sdpa = "aten._scaled_dot_product_flash_attention_for_cpu.default"
    assert not _drew(OpRecord(index=0, op=sdpa, args=["$", "$", "$"]))
    assert _drew(OpRecord(index=0, op=sdpa, args=["$", "$", "$", 0.1]))
    assert _drew(OpRecord(index=0, op="aten.bernoulli_.float", args=["$", 0.5]))
    assert not _drew(OpRecord(index=0, op="aten.mm.default", args=["$", "$"]))


def test_the_step_hook_fix_warns_about_gradient_accumulation():
    """An observation normalizer updated between forward and backward, 4 micro-batches per step (25i): the step-hook
    code, applied as given, updated once per optimizer step where the run without AC updated once per micro-batch,
    and the gradients differed from backward 2 on. The code says where the update goes with accumulation."""
    from ac_diff.diagnosis.suggest import _step_hook_code

    code = _step_hook_code("norm.mean")
    assert "optimizer.register_step_post_hook(update_after_step)" in code
    assert "with gradient accumulation" in code and "each\n# micro-batch's loss.backward()" in code
