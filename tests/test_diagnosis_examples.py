"""Every bundled example gets the right verdict, cause, layer and ops (asserted on the JSON report),
and the MoE example's terminal report is pinned at a fixed width (refresh: AC_DIFF_UPDATE_GOLDEN=1)."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as cp

import ac_diff
from ac_diff.render.terminal import render_terminal
from rich.console import Console


def _region(report: dict, **match) -> dict:
    return next(r for r in report["regions"] if all(r[k] == v for k, v in match.items()))


def test_report_schema(example_reports):
    report = example_reports["moe_bias_update"]["json"]
    assert report["format"] == "ac-diff-report" and report["version"] == 2
    assert report["verdict"] in ("clean", "diverged")
    region = report["regions"][0]
    for key in ("rank", "region", "module", "status", "silent", "cause", "first_value_divergence",
                "first_discrete_divergence", "first_shape_divergence", "positions", "suggestions"):
        assert key in region
    position = next(r for r in report["regions"] if r["positions"])["positions"][0]
    for key in ("position", "op", "module", "source", "saved", "recomputed", "matches"):
        assert key in position


def test_moe_bias_update_is_state_mutation_in_the_router(example_reports):
    ex = example_reports["moe_bias_update"]
    report = ex["json"]
    assert ex["proc"].returncode == 1  # the script's own exit code: it crashed with CheckpointError
    assert report["verdict"] == "diverged"
    assert report["torch_error"]["kind"] == "metadata_mismatch"
    region = _region(report, status="diverged")
    assert region["module"] == "layers.1" and not region["silent"]
    assert region["cause"]["kind"] == "state_mutation"
    assert region["cause"]["tensor"] == "layers.1.moe.expert_bias"
    value = region["first_value_divergence"]
    assert (value["op"], value["module"]) == ("aten.add.Tensor", "layers.1.moe.router")
    assert "tiny_moe.py" in value["source"]
    discrete = region["first_discrete_divergence"]
    assert (discrete["op"], discrete["module"]) == ("aten.topk.default", "layers.1.moe.router")
    assert 1 <= discrete["detail"]["rows_changed"] < discrete["detail"]["rows"]
    assert 0 < discrete["detail"]["margin_min"] < 0.01
    shape = region["first_shape_divergence"]
    assert (shape["op"], shape["module"]) == ("aten.split_with_sizes.default", "layers.1.moe.experts")
    assert "→" in shape["detail"]["args_diff"]
    flagged = sorted(p["position"] for p in region["positions"] if p["matches"] is False)
    assert flagged == sorted(report["torch_error"]["positions"])
    titles = " ".join(s["title"] for s in region["suggestions"])
    codes = " ".join(s["code"] or "" for s in region["suggestions"])
    assert "expert_bias" in titles and "optimizer.step()" in " ".join(s["text"] for s in region["suggestions"])
    assert "torch.ops.aten.topk.default" in codes and "MUST_SAVE" in codes
    assert any("expert_bias" in step for step in region["chain"]) and any("topk" in s for s in region["chain"])


def test_fixed_moe_is_clean_and_names_the_repeated_counter(example_reports):
    ex = example_reports["moe_bias_update_fixed"]
    report = ex["json"]
    assert ex["proc"].returncode == 0
    assert report["verdict"] == "clean", report["headline"]
    assert all(r["status"] == "clean" for r in report["regions"])
    assert any("tokens_per_expert" in e for r in report["regions"] for e in r["side_effects"])


def test_dropout_without_rng_state_is_silent_rng(example_reports):
    report = example_reports["dropout_no_rng"]["json"]
    assert report["verdict"] == "diverged" and report["torch_error"] is None
    diverged = [r for r in report["regions"] if r["status"] == "diverged"]
    assert diverged
    for region in diverged:
        assert region["silent"] is True
        assert region["cause"]["kind"] == "rng"
        value = region["first_value_divergence"]
        assert value["op"].startswith("aten.bernoulli") and value["module"].endswith("dropout")
        assert any("preserve_rng_state=True" in s["title"] for s in region["suggestions"])


def test_python_state_branch_is_control_flow(example_reports):
    report = example_reports["python_state_branch"]["json"]
    assert report["verdict"] == "diverged"
    region = _region(report, status="diverged")
    assert region["cause"]["kind"] == "control_flow"
    control = region["first_control_divergence"]
    assert control["module"].endswith("moe.router") and control["recompute_index"] is not None
    assert control["forward_index"] is None  # an op only the recompute ran


def test_sdpa_backend_flag_differs_between_passes_is_global_state(tmp_path):
    """sdpa_kernel(MATH) around the forward only: the recompute picks another attention kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(16, 48)

        def forward(self, x):
            q, k, v = self.qkv(x).view(2, 8, 3, 2, 8).permute(2, 0, 3, 1, 4)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True).sum(1)

    torch.manual_seed(0)
    model, x = Attention(), torch.randn(2, 8, 16, requires_grad=True)
    with ac_diff.record(tmp_path / "t.jsonl"):
        with sdpa_kernel(SDPBackend.MATH):
            y = cp.checkpoint(model, x, use_reentrant=False)
        try:
            y.sum().backward()
        except cp.CheckpointError:
            pass
    report = ac_diff.diagnose_paths([tmp_path / "t.jsonl"])
    region = report.regions[0]
    assert region.status == "diverged"
    assert region.cause.kind == "global_state" and region.cause.tensor == "sdp_backends"
    assert region.state_changes["sdp_backends"]["forward"] == ["math"]


# torch.backends flags that choose GPU kernels, readable (and settable) on a CPU build
BACKEND_FLAGS = [("cuda.matmul", "allow_tf32"), ("cuda.matmul", "allow_bf16_reduced_precision_reduction"),
                 ("cuda.matmul", "allow_fp16_reduced_precision_reduction"), ("cudnn", "allow_tf32"),
                 ("cudnn", "benchmark"), ("cudnn", "deterministic"), ("cudnn", "enabled")]


@pytest.mark.parametrize("owner, flag", BACKEND_FLAGS)
def test_backend_flag_set_between_forward_and_backward_is_global_state(tmp_path, owner, flag):
    """A forward hook on the model flips a torch.backends flag once the forward has run (as a "speed up the backward"
    hook would): the recompute runs under the other value. A CPU ignores it, so the values match and the region is
    clean, but the flag is named, with both values and the fix: set it once for the whole step."""
    namespace = {"cuda.matmul": torch.backends.cuda.matmul, "cudnn": torch.backends.cudnn}[owner]
    before = getattr(namespace, flag)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    model.register_forward_hook(lambda *_: setattr(namespace, flag, not before))
    torch.manual_seed(0)
    x = torch.randn(4, 8, requires_grad=True)
    try:
        with ac_diff.record(tmp_path / "t.jsonl"):
            cp.checkpoint(model, x, use_reentrant=False).sum().backward()
    finally:
        setattr(namespace, flag, before)
    report = ac_diff.diagnose_paths([tmp_path / "t.jsonl"])
    region = report.regions[0]
    key, name = f"{owner}.{flag}", f"torch.backends.{owner}.{flag}"
    assert report.verdict == "clean" and region.status == "clean"  # the same values on a CPU
    assert region.state_changes[key] == {"forward": before, "recompute": not before}
    assert region.cause.kind == "global_state"
    if key == "cuda.matmul.allow_tf32":  # (the float32 matmul precision: TF32 allowed reads "high"; named as such)
        assert region.cause.tensor == "matmul_precision" and name in region.cause.detail
        assert region.suggestions[0].code.startswith("torch.set_float32_matmul_precision('highest')  # once")
        assert name in report.headline and report.headline.startswith("clean: ")
        return
    assert region.cause.tensor == key
    assert f"`{name}` was {before!r} in the forward and {not before!r} in the recompute" in region.cause.detail
    fix = region.suggestions[0]
    assert fix.title == f"Set `{name}` once for the whole step, not between the forward and the backward"
    assert fix.code.startswith(f"{name} = {before!r}  # once, before the training loop")
    assert name in report.headline and report.headline.startswith("clean: ")


def test_the_cpu_thread_count_changed_before_the_backward_is_named(tmp_path):
    """A stranger's metrics helper sets torch.set_num_threads(1) between the forward and the backward: a CPU matmul
    then splits its reduction otherwise, so the recompute's values may differ in the last bits. The count is named
    in both passes (here as the cause of a divergence where the values differed, else on the clean region)."""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(512, 512), nn.Tanh()), torch.randn(64, 512, requires_grad=True)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with ac_diff.record(tmp_path / "t.jsonl"):
            loss = cp.checkpoint(model, x, use_reentrant=False).sum()
            torch.set_num_threads(1)
            loss.backward()
    finally:
        torch.set_num_threads(before)
    region = ac_diff.diagnose_paths([tmp_path / "t.jsonl"]).regions[0]
    assert region.state_changes["num_threads"] == {"forward": 2, "recompute": 1}
    assert region.cause.kind == "global_state" and region.cause.tensor == "num_threads", region.cause
    assert region.suggestions[0].code.startswith("torch.set_num_threads(2)  # once")


PHASE = "forward"  # a training harness's label, which the layer below reads (for its own bookkeeping only)
SEEN: list = []


class CenteredByWholeMean(nn.Module):
    """Subtracts the mean of the whole activation (a reduction CPU threads split) and notes the harness's phase."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        SEEN.append(PHASE)
        h = self.fc(x)
        return torch.tanh(h - h.mean())


def test_a_thread_count_changed_with_a_global_the_region_reads_is_the_cause(tmp_path):
    """The thread count and a harness's phase label both change before the backward; the first op to differ (the
    whole-tensor mean) read identical tensors and arguments, which no Python value reaches: the threads are the
    cause. The cause was "state_mutation: the module-level global PHASE", whose fix changes nothing."""
    global PHASE
    torch.manual_seed(0)
    model, x = CenteredByWholeMean(), torch.randn(65536, 16, requires_grad=True)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with ac_diff.record(tmp_path / "t.jsonl"):
            PHASE = "forward"
            loss = cp.checkpoint(model, x, use_reentrant=False).square().mean()
            torch.set_num_threads(1)
            PHASE = "backward"
            loss.backward()
    finally:
        torch.set_num_threads(before)
        PHASE = "forward"
    region = ac_diff.diagnose_paths([tmp_path / "t.jsonl"]).regions[0]
    assert region.status == "diverged", region  # (the mean of 1M floats sums otherwise on 1 thread than on 2)
    assert region.cause.kind == "global_state" and region.cause.tensor == "num_threads", region.cause


def test_tf32_switched_on_for_the_backward_names_the_flag_in_the_report(tmp_path):
    """The training loop turns TF32 on between the forward and loss.backward(): set_float32_matmul_precision("high")
    sets torch.backends.cuda.matmul.allow_tf32 too; both are named, the precision the script set first, in every
    renderer."""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)), torch.randn(4, 8, requires_grad=True)
    before = torch.get_float32_matmul_precision()
    try:
        with ac_diff.record(tmp_path / "t.jsonl"):
            loss = cp.checkpoint(model, x, use_reentrant=False).sum()
            torch.set_float32_matmul_precision("high")
            loss.backward()
    finally:
        torch.set_float32_matmul_precision(before)
    report = ac_diff.diagnose_paths([tmp_path / "t.jsonl"])
    region = report.regions[0]
    assert region.status == "clean" and region.cause.tensor == "matmul_precision"
    assert region.state_changes["matmul_precision"] == {"forward": "highest", "recompute": "high"}
    assert any("torch.set_float32_matmul_precision" in e and "'highest' -> 'high'" in e
               for e in region.cause.evidence)
    assert "`torch.backends.cuda.matmul.allow_tf32`: False -> True" in region.cause.evidence
    assert any("no value differed in this run" in n for n in region.notes)
    out = io.StringIO()
    render_terminal(report, Console(file=out, width=200))
    assert "torch.backends.cuda.matmul.allow_tf32" in out.getvalue() and "global_state" in out.getvalue()
    assert "note: global_state" in out.getvalue()  # (the regions table: a clean region's cause is a note)


def test_flags_that_stay_set_for_the_whole_step_are_not_named(tmp_path):
    """The same flag set once, before the step: the forward and the recompute agree, nothing to report."""
    torch.manual_seed(0)
    model, x = nn.Linear(8, 8), torch.randn(4, 8, requires_grad=True)
    try:
        torch.backends.cudnn.deterministic = True
        with ac_diff.record(tmp_path / "t.jsonl"):
            cp.checkpoint(model, x, use_reentrant=False).sum().backward()
    finally:
        torch.backends.cudnn.deterministic = False
    region = ac_diff.diagnose_paths([tmp_path / "t.jsonl"]).regions[0]
    assert region.status == "clean" and region.cause is None and not region.state_changes


def test_reentrant_divergence_is_silent(tmp_path):
    """Reentrant checkpoint has no check at all: a buffer changed before backward goes unnoticed by torch."""
    from models import Scaled

    torch.manual_seed(0)
    model, x = Scaled(), torch.randn(4, 8, requires_grad=True)
    with ac_diff.record(tmp_path / "t.jsonl"):
        y = cp.checkpoint(model, x, use_reentrant=True)
        with torch.no_grad():
            model.scale.mul_(1.5)  # e.g. an EMA/statistics update between forward and backward
        y.sum().backward()
    report = ac_diff.diagnose_paths([tmp_path / "t.jsonl"])
    region = report.regions[0]
    assert region.kind == "reentrant" and region.status == "diverged" and region.silent
    assert region.cause.kind == "state_mutation" and region.cause.tensor == "scale"


GOLDEN = Path(__file__).parent / "golden" / "moe_bias_update.txt"


def test_moe_terminal_report_matches_golden(example_reports):
    report = ac_diff.diagnose_paths([example_reports["moe_bias_update"]["dir"]])
    report.sources = ["ac-diff-out/trace-rank0.jsonl"]
    buffer = io.StringIO()
    render_terminal(report, Console(file=buffer, width=100, color_system=None, force_terminal=False))
    text = buffer.getvalue()
    if os.environ.get("AC_DIFF_UPDATE_GOLDEN"):
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text()
    # and it says what a stranger needs: the layer, the op, why, and what to change
    for needle in ("DIVERGED", "layers.1", "expert_bias", "topk", "split_with_sizes", "position", "fix:"):
        assert needle in text


def test_a_narrow_terminal_leaves_the_first_divergence_to_the_region_details(example_reports):
    """In a narrow terminal the regions table has no room for the first divergence: it leaves it out and says where
    it is, rather than wrapping it one word fragment a line; a wide terminal shows it in the table."""
    report = ac_diff.diagnose_paths([example_reports["moe_bias_update"]["dir"]])

    def regions_table(width: int) -> list[str]:
        buffer = io.StringIO()
        render_terminal(report, Console(file=buffer, width=width, color_system=None, force_terminal=False))
        lines = buffer.getvalue().splitlines()
        start = lines.index(next(line for line in lines if line.startswith("regions")))
        end = next(i for i in range(start + 1, len(lines)) if not lines[i].strip() or lines[i].startswith("╭"))
        return lines[start:end]

    narrow, wide = regions_table(64), regions_table(140)
    assert "first divergence" not in narrow[1] and any("in the region details below" in line for line in narrow)
    assert "first divergence" in wide[1] and any(".Tensor in layers.1" in line for line in wide)
    assert all(len(line.rstrip()) <= 64 for line in narrow)


def test_the_headline_names_an_earlier_silent_step_before_the_error(tmp_path):
    """torch raised in step 3, a Python attribute changed values only in step 2: the headline leads with the region
    torch raised about, names its step, and says the run first diverged (silently) a step before."""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.gain, self.keep = 1.0, 4

        def forward(self, x):
            return self.lin(x[:self.keep] * self.gain).relu()

    torch.manual_seed(0)
    model = Block()
    with ac_diff.record(tmp_path / "t.jsonl"):
        for step in (1, 2, 3):
            y = cp.checkpoint(model, torch.randn(4, 8, requires_grad=True), use_reentrant=False)
            if step == 2:
                model.gain = 0.5  # a schedule applied before the backward: other values, same shapes
            if step == 3:
                model.keep = 3  # ... and one that changes a shape: torch raises
            try:
                y.sum().backward()
            except cp.CheckpointError:
                assert step == 3
    report = ac_diff.diagnose_paths([tmp_path / "t.jsonl"])
    assert [(r.step, r.status, r.silent) for r in report.regions] == [
        (1, "clean", False), (2, "diverged", True), (3, "diverged", False)]
    assert "(rank 0, region 2, step 3) diverged" in report.headline.split(":")[0], report.headline
    assert "the first, silently, in step 2" in report.headline, report.headline
