"""`ac-diff compare LOG`: logs torch wrote are explained through the same diagnosis and renderers."""

from __future__ import annotations

import json
import os
import re
import traceback
from pathlib import Path

import pytest
import torch

import ac_diff
from ac_diff.logs import parse_text
from conftest import REAL_LOGS, REPO, checkpoint_error_text, run_cli, torch_debug_logging
from models import NEEDS_SAC

SAMPLE_LOGS = REPO / "sample_logs"


def _real(name: str) -> Path:
    path = REAL_LOGS / name
    assert path.exists(), f"{path} is missing from the repository's real logs"
    return path


def test_origin_thread_log_names_the_split_and_the_decision_behind_it():
    report = ac_diff.diagnose_paths([_real("torchtitan_llama4_rank1_head.log"),
                                     _real("torchtitan_llama4_rank1_tail.log")])
    assert report.verdict == "diverged"
    error = report.torch_error
    assert (error.kind, error.rank) == ("metadata_mismatch", 1)
    assert error.positions == [48, 49, 51, 52, 53, 55, 84, 85, 87, 88, 89, 91]
    region = next(r for r in report.regions if r.status == "diverged")
    shape = region.first_shape_divergence
    assert shape.op == "aten.split_with_sizes.default"
    assert "99→98" in shape.detail["args_diff"] and "105→106" in shape.detail["args_diff"]
    assert region.first_discrete_divergence.op == "aten.topk.default"
    chain = " ".join(region.chain)
    assert chain.index("topk") < chain.index("histc") < chain.index("split_with_sizes")
    assert any("topk" in (s.code or "") for s in region.suggestions)
    assert any("ac-diff run" in n for n in region.notes)  # honest about what a log cannot tell
    import io

    from rich.console import Console

    from ac_diff.render.terminal import render_terminal
    buffer = io.StringIO()
    render_terminal(report, Console(file=buffer, width=120, color_system=None))
    text = buffer.getvalue()
    assert "split_with_sizes" in text and " in None" not in text  # a log's ops have no module name


def test_sample_debug_dump_of_the_moe_example(tmp_path):
    json_path = tmp_path / "r.json"
    proc = run_cli("compare", str(SAMPLE_LOGS / "moe_bias_update_debug.log"), "--json", str(json_path))
    assert proc.returncode == 1, proc.stderr
    import json

    data = json.loads(json_path.read_text())
    region = next(r for r in data["regions"] if r["status"] == "diverged")
    assert region["first_shape_divergence"]["op"] == "aten.split_with_sizes.default"
    assert "tiny_moe.py" in region["first_shape_divergence"]["source"]
    assert region["first_discrete_divergence"]["op"] == "aten.topk.default"
    assert "split_with_sizes" in proc.stdout


def test_sample_error_text():
    report = ac_diff.diagnose_paths([SAMPLE_LOGS / "moe_bias_update_error.log"])
    assert report.verdict == "diverged"
    assert report.torch_error.kind == "metadata_mismatch" and len(report.torch_error.positions) == 12
    assert "debug=True" in report.headline and "ac-diff run" in report.headline  # where more evidence comes from


def test_a_precision_change_is_named_from_the_dtypes_torch_printed():
    """Every position torch names kept its shape and went from float32 to bfloat16: a precision setting changed
    between the forward and the recompute (tests/stacks/precision_schedule.py); shapes that change are not that."""
    report = ac_diff.diagnose_paths([SAMPLE_LOGS / "precision_schedule_error.log"])
    error = report.torch_errors[0]
    assert [(c.saved, c.recomputed) for c in error.changes] == [("f32[16, 128]", "bf16[16, 128]")]
    assert error.cause.startswith("dtype_changed: ") and "(f32 -> bf16)" in error.cause, error.cause
    assert "dtype_changed" in report.headline
    shapes = ac_diff.diagnose_paths([SAMPLE_LOGS / "moe_bias_update_error.log"]).torch_errors[0]
    assert shapes.cause is None or "dtype_changed" not in shapes.cause


@pytest.mark.parametrize("name", sorted(p.name for p in REAL_LOGS.glob("*.log")) or ["<missing>"])
def test_every_real_log_gets_a_report(name, tmp_path, capsys):
    """In process (the CLI's own entry point), so the whole set stays fast."""
    from ac_diff.cli import main

    path = _real(name)
    code = main(["compare", str(path), "--json", str(tmp_path / "r.json")])
    err = capsys.readouterr().err
    assert code in (0, 1, 4), err  # traceback-only pastes too: each gets a report saying what it lacks
    assert (tmp_path / "r.json").exists()
    verdict = json.loads((tmp_path / "r.json").read_text())["verdict"]
    assert code == {"clean": 0, "diverged": 1, "unchecked": 4}[verdict]  # nothing compared is never clean
    assert "Traceback" not in err


def test_garbage_is_bad_input(tmp_path):
    junk = tmp_path / "junk.log"
    junk.write_bytes(os.urandom(2048))
    proc = run_cli("compare", str(junk))
    assert proc.returncode == 2 and proc.stderr.startswith("ac-diff: error:")


def test_a_training_log_without_a_checkpoint_error_proves_nothing(tmp_path):
    """A log whose run raised nothing is nothing to explain, but not a sign that the recomputes matched: a reentrant
    region that diverges raises nothing. The message said "torch prints those only when a recompute differs"; it is
    NOTHING CHECKED (exit 4), never clean, with how to check the recomputes."""
    quiet = tmp_path / "train.log"
    quiet.write_text("".join(f"step {i} loss {1 / (i + 1):.4f}\n" for i in range(50)))
    proc = run_cli("compare", str(quiet))
    assert proc.returncode == 4 and "NOTHING CHECKED" in proc.stdout, proc.stdout + proc.stderr
    assert "only when a recompute differs" not in proc.stdout
    text = " ".join(proc.stdout.split())
    assert "does not show that the recomputes matched" in text and "ac-diff run --check SCRIPT" in text, text


def _debug_log(tmp_path, name: str, fn, x) -> Path:
    """The text torch raises with debug=True for a recompute that diverges, written as a log file."""
    import torch.utils.checkpoint as cp

    with torch_debug_logging(), pytest.raises(cp.CheckpointError) as caught:
        cp.checkpoint(fn, x, use_reentrant=False, debug=True).sum().backward()
    path = tmp_path / name
    path.write_text("".join(traceback.format_exception(caught.value)))  # as python prints it: the chain too
    return path


def _branching(calls: list):
    """Python state: the recompute (second call) takes another branch and saves fewer tensors."""
    import torch

    def fn(x):
        calls.append(1)
        y = torch.sin(x)
        if len(calls) == 1:
            y = torch.relu(y)
        return y.exp()
    return fn


def _buffer_routed(buffer):
    """A buffer changed before backward moves a data-dependent selection (nonzero): other shapes saved."""
    import torch

    def fn(x):
        keep = torch.nonzero(x[:, 0] + buffer > 0).squeeze(1)
        return torch.sigmoid(x[keep]) * 2
    return fn


def test_a_branch_in_a_log_is_control_flow(tmp_path):
    import torch

    torch.manual_seed(0)
    log = _debug_log(tmp_path, "branch.log", _branching([]), torch.randn(4, 4, requires_grad=True))
    region = next(r for r in ac_diff.diagnose_paths([log]).regions if r.status == "diverged")
    assert region.cause.kind == "control_flow" and region.cause.tensor == "aten.relu.default"


def _extra_in_recompute(calls: list):
    """Python state: only the recompute (second call) runs an extra branch in the middle, which makes torch's check
    fail at the next saved tensor (the recompute ends there)."""
    import torch

    def fn(x):
        calls.append(1)
        h = torch.mm(x, x)
        if len(calls) == 2:
            h = h * torch.sigmoid(h.logsumexp(-1, keepdim=True))  # the recompute's branch
        return torch.mm(torch.nn.functional.gelu(h), x)
    return fn


def test_a_branch_only_the_recompute_ran_is_named_at_its_line_not_the_forwards_tail(tmp_path):
    """29d: the recompute ran logsumexp and sigmoid, then torch's check raised; the forward's gelu and what follows
    were never reached by the recompute. The first divergence read "gelu ran in the forward but not in the recompute"
    at the gelu's line (the fix pointed there too); it is the recompute's logsumexp, at the branch's line."""
    import torch

    torch.manual_seed(0)
    log = _debug_log(tmp_path, "extra.log", _extra_in_recompute([]), torch.randn(8, 8, requires_grad=True))
    region = next(r for r in ac_diff.diagnose_paths([log]).regions if r.status == "diverged")
    first = region.first_control_divergence
    assert first is not None and first.op == "aten.logsumexp.default", first
    assert first.forward_index is None and first.recompute_index is not None
    line = next(i for i, text in enumerate(Path(__file__).read_text().splitlines(), 1) if "# the recompute's branch" in
                text)
    assert f"{Path(__file__).name}:{line}" in region.cause.detail, region.cause.detail


def test_a_recompute_that_saves_past_the_forwards_end_is_named_at_its_line(tmp_path):
    """29d: early stop off, the recompute (a counter's second call) runs a z-loss-like term after everything the forward
    ran, and torch raises "trying to save more tensors during recomputation" with its dump; the dump's recompute ends
    with the pack of that extra save, whose stack names the line. It read "unknown: no recorded evidence"."""
    import torch
    import torch.utils.checkpoint as cp

    calls = []

    def fn(x):
        calls.append(1)
        out = torch.sin(torch.mm(x, x))
        if len(calls) == 2:
            out = out * torch.sigmoid(out.pow(2).mean(-1, keepdim=True))  # only the recompute
        return out

    torch.manual_seed(0)
    with cp.set_checkpoint_early_stop(False):
        log = _debug_log(tmp_path, "more.log", fn, torch.randn(8, 8, requires_grad=True))
    assert "trying to save more tensors" in log.read_text()
    region = next(r for r in ac_diff.diagnose_paths([log]).regions if r.status == "diverged")
    from ac_diff.logs import parse_log

    if parse_log(log).regions[0].recompute.ops[-1].op != "aten.detach.default":
        # (torch 2.4's dump ends with the last op the forward ran too: the extra pack is not in it, only in the
        # traceback; diverged, never clean, the line not named)
        return
    assert region.cause.kind == "control_flow", region.cause
    line = next(i for i, text in enumerate(Path(__file__).read_text().splitlines(), 1)
                if "# only the recompute" in text)
    assert f"{Path(__file__).name}:{line}" in region.cause.detail, region.cause.detail


@pytest.mark.skipif(not hasattr(torch.nn, "attention"), reason="this torch has no torch.nn.attention.sdpa_kernel")
def test_a_log_whose_passes_ran_other_attention_kernels_names_the_sdpa_backends(tmp_path):
    """29a: `sdpa_kernel(MATH)` around the forward only: the forward ran the math decomposition, the recompute the
    fused kernel, and torch's debug dump shows both op lists. It read "control_flow: Python code took another branch";
    it is the SDPA backend setting, with its fix."""
    import torch.utils.checkpoint as cp
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def attend(q):
        return torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)

    torch.manual_seed(0)
    q = torch.randn(2, 4, 16, 8, requires_grad=True)
    with torch_debug_logging(), pytest.raises(cp.CheckpointError) as caught:
        with sdpa_kernel(SDPBackend.MATH):
            out = cp.checkpoint(attend, q, use_reentrant=False, debug=True)
        out.sum().backward()
    log = tmp_path / "sdpa.log"
    log.write_text("".join(traceback.format_exception(caught.value)))
    region = next(r for r in ac_diff.diagnose_paths([log]).regions if r.status == "diverged")
    assert (region.cause.kind, region.cause.tensor) == ("global_state", "sdp_backends"), region.cause
    assert "the math decomposition in the forward" in region.cause.detail, region.cause.detail
    assert region.suggestions[0].title.startswith("Set the SDPA backend choice"), region.suggestions[0].title


class _Adapter(torch.nn.Module):
    """An adapter only the recompute (the second call) runs, in the middle of the block: its `t` is no twin of fc2's."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.adapter, self.fc2 = torch.nn.Linear(16, 32), torch.nn.Linear(32, 32), torch.nn.Linear(32, 16)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        h = self.fc1(x)
        if self.calls == 2:
            h = self.adapter(h)  # the adapter branch
        return self.fc2(torch.relu(h))


def test_a_dumps_ops_align_by_their_lines_so_a_branch_in_the_middle_is_named_there(tmp_path):
    """30b: the recompute ran an adapter in the middle of the block; by op names alone its `t` paired with fc2's `t`
    ("shape aten.t.default at fc2's line ... f32[32, 32] -> ...", cause unknown). The dump's stacks give each op's line:
    the adapter's ops ran in the recompute only, at the branch's line."""
    torch.manual_seed(0)
    log = _debug_log(tmp_path, "adapter.log", _Adapter(), torch.randn(4, 16, requires_grad=True))
    region = next(r for r in ac_diff.diagnose_paths([log]).regions if r.status == "diverged")
    line = next(i for i, text in enumerate(Path(__file__).read_text().splitlines(), 1)
                if "# the adapter branch" in text)
    assert region.cause.kind == "control_flow", region.cause
    assert f"{Path(__file__).name}:{line}" in region.cause.detail, region.cause.detail


def test_two_logs_keep_their_own_errors(tmp_path):
    import torch

    torch.manual_seed(0)
    first = _debug_log(tmp_path, "a.log", _branching([]), torch.randn(4, 4, requires_grad=True))
    buffer = torch.zeros(())
    x = torch.randn(16, 4, requires_grad=True)
    fn = _buffer_routed(buffer)

    def moved(x):  # the forward runs with the buffer at 0; it changes before the recompute
        out = fn(x)
        buffer.fill_(1.0)
        return out
    second = _debug_log(tmp_path, "b.log", moved, x)
    report = ac_diff.diagnose_paths([first, second])
    own = {}
    for path in (first, second):
        single = ac_diff.diagnose_paths([path])
        own[path.name] = [p.position for r in single.regions for p in r.positions if p.in_torch_error]
    both = [[p.position for p in r.positions if p.in_torch_error] for r in report.regions]
    assert own["b.log"] and sorted(both) == sorted(own.values())
    assert sorted(Path(r.path).name for r in report.regions) == ["a.log", "b.log"]  # which file each is from
    # neither names a rank, so both hold "rank 0, region 0": the reports still detail each file's own region
    leads = [lead for lead, _, _ in report.lead_groups()]
    assert len(leads) == 2 and {id(lead) for lead in leads} == {id(r) for r in report.regions}
    from ac_diff.render.html import render_html

    ids = re.findall(r' id="([^"]+)"', render_html(report))
    assert len(ids) == len(set(ids))  # one anchor per region and position


def test_a_dump_cut_in_the_middle_is_not_aligned_from_its_beginning(tmp_path):
    """The origin thread's tail log cut at half its size: the recompute's op list starts mid-way
    ("(k of n)"), so pairing it with the forward's first ops would invent a divergence."""
    raw = _real("torchtitan_llama4_rank1_tail.log").read_bytes()
    cut = tmp_path / "tail_half.log"
    cut.write_bytes(raw[:len(raw) // 2])
    report = ac_diff.diagnose_paths([cut])
    for region in report.regions:
        assert region.first_shape_divergence is None or region.first_shape_divergence.op != "aten.view.default"
        assert region.status != "diverged" or report.torch_error is not None


def test_positions_in_a_log_follow_the_recompute_packs(tmp_path):
    """A buffer moves a nonzero selection: torch names the positions whose shapes changed; the log's
    recompute list detaches each saved tensor, which maps them to their ops (here: sigmoid saves its
    output; a guess by shape alone would take the first [n, 4] output, the linear before it)."""
    import torch

    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)
    buffer = torch.zeros(())

    def fn(x):
        keep = torch.nonzero(x[:, 0] + buffer > 0).squeeze(1)
        out = torch.sigmoid(lin(x[keep]))
        buffer.fill_(-5.0)  # updated after the forward used it: the recompute selects other rows
        return out

    log = _debug_log(tmp_path, "routed.log", fn, torch.randn(16, 4, requires_grad=True))
    region = next(r for r in ac_diff.diagnose_paths([log]).regions if r.status == "diverged")
    mapped = {p.op for p in region.positions if p.in_torch_error and p.origin == "recompute pack"}
    assert "aten.sigmoid.default" in mapped


def test_gzip_and_utf16_logs_read_like_the_plain_one(tmp_path):
    import gzip

    plain = SAMPLE_LOGS / "moe_bias_update_error.log"
    text = plain.read_bytes()
    (tmp_path / "log.gz").write_bytes(gzip.compress(text))
    (tmp_path / "log.utf16").write_bytes(text.decode("utf-8").encode("utf-16"))  # with a byte-order mark
    expected = ac_diff.diagnose_paths([plain]).torch_error
    assert expected is not None
    for name in ("log.gz", "log.utf16"):
        got = ac_diff.diagnose_paths([tmp_path / name]).torch_error
        assert got is not None and (got.kind, got.positions) == (expected.kind, expected.positions), name


def test_a_gzip_log_failing_its_checksum_says_it_was_read_but_is_corrupted(tmp_path):
    """The stored CRC does not match (bits flipped somewhere): gzip reads everything and only then says so; the
    note must not claim the rest was missing."""
    import gzip

    after = b"".join(b"step %d loss 1.0\n" % i for i in range(120_000))  # the training went on (> 1 MiB)
    data = bytearray(gzip.compress((SAMPLE_LOGS / "moe_bias_update_error.log").read_bytes() + after))
    data[-8] ^= 0xFF  # the trailer's CRC32
    (tmp_path / "log.gz").write_bytes(bytes(data))
    report = ac_diff.diagnose_paths([tmp_path / "log.gz"])
    assert report.torch_error is not None
    note = next(n for n in report.notes if "CRC" in n)
    assert "fails its checksum" in note and "read to its end" in note and "read only the first" not in note


def test_a_gzip_log_cut_before_its_first_mib_is_read_as_far_as_it_goes(tmp_path):
    """A gzip copy cut at a third (the error at its start, over 1 MiB of training output after it): the sniff for
    torch's text read its first MiB in one call, which a cut stream fails as a whole, so the log was rejected as
    damaged though most of it reads."""
    import gzip

    after = b"".join(b"step %d loss 1.0\n" % i for i in range(120_000))
    packed = gzip.compress((SAMPLE_LOGS / "moe_bias_update_error.log").read_bytes() + after)
    (tmp_path / "log.gz").write_bytes(packed[: len(packed) // 3])
    report = ac_diff.diagnose_paths([tmp_path / "log.gz"])
    assert report.torch_error is not None and report.verdict == "diverged", report.headline
    assert any("read only the first" in n for n in report.notes), report.notes


@pytest.mark.parametrize("name", ["readme_glm4v.log", "huggingface_trl_5217.log", "Joluck_RWKV-PEFT_58.log"])
def test_a_log_without_op_lists_says_what_torch_printed(name):
    """Saved -> recomputed metadata per position, and what shape [0] means (a parameter not gathered, or a batch norm
    switched to eval mode)."""
    report = ac_diff.diagnose_paths([_real(name)])
    error = report.torch_error
    first = error.changes[0]
    assert first.saved and first.recomputed and first.recomputed.endswith("[0]")
    assert error.cause.startswith("sharded_parameter")
    assert "or a batch norm's saved statistics" in error.cause  # (the metadata alone cannot tell them apart)
    assert f"{first.saved} -> {first.recomputed}" in report.headline and "sharded_parameter" in report.headline
    assert report.to_json()["torch_error"]["changes"][0] == {"position": first.position, "saved": first.saved,
                                                            "recomputed": first.recomputed}


def test_metadata_changes_without_shape_0_name_no_cause():
    report = ac_diff.diagnose_paths([_real("Modalities_modalities_361.log")])
    assert report.torch_error.changes and report.torch_error.cause is None


def test_a_position_list_cut_in_the_headline_ends_with_dots():
    report = ac_diff.diagnose_paths([_real("torchtitan_llama4_rank1_head.log")])  # 12 positions
    assert "at positions 48, 49, 51, 52, 53, 55, ... (12 in all)" in report.headline


def test_head_and_tail_of_one_log_are_one_region_and_damaged_lines_are_no_finding():
    """The tail's op lists lost lines to other writers (`$311: bf16[35, 81s.aten.rsqrt.default($7)`): the
    recompute's rsqrt line is among them, so its absence is not a control-flow divergence."""
    report = ac_diff.diagnose_paths([_real("torchtitan_llama4_rank1_head.log"),
                                     _real("torchtitan_llama4_rank1_tail.log")])
    (region,) = report.regions
    assert region.first_control_divergence is None
    assert region.first_discrete_divergence.op == "aten.topk.default"
    assert region.first_shape_divergence.op == "aten.split_with_sizes.default"
    assert any("hold parts of the same debug=True dump" in n for n in report.notes)


def test_a_log_names_the_random_op_a_changed_shape_depends_on(tmp_path):
    """debug=True dump of a dropout-like mask drawn without preserve_rng_state: no values in a log, but the op lists
    link the changed shape back to aten.rand: rng, with preserve_rng_state as the fix."""
    import torch
    import torch.utils.checkpoint as cp

    torch.manual_seed(0)
    w = torch.randn(16, 16, requires_grad=True)

    def fn(x):
        keep = torch.rand(x.shape[0]) > 0.3  # drawn again, differently, by the recompute
        return torch.relu(x[keep] @ w)

    x = torch.randn(64, 16, requires_grad=True)
    with torch_debug_logging(), pytest.raises(cp.CheckpointError) as caught:
        cp.checkpoint(fn, x, use_reentrant=False, debug=True, preserve_rng_state=False).sum().backward()
    path = tmp_path / "rng.log"
    path.write_text("".join(traceback.format_exception(caught.value)))
    (region,) = ac_diff.diagnose_paths([path]).regions
    assert (region.cause.kind, region.cause.tensor) == ("rng", "aten.rand.default"), region.cause
    assert "test_compare_logs.py" in region.cause.source
    assert any("preserve_rng_state=True" in s.title for s in region.suggestions)


def test_a_log_names_the_private_generator_a_random_op_was_handed(tmp_path):
    """The same mask drawn from a torch.Generator of the script's own (router jitter): preserve_rng_state restores
    only the default generators, and the dump prints `generator=<torch._C.Generator ...>`. `compare` said "Keep the RNG
    state for the recompute: preserve_rng_state=True" (27h), which the script already had; `run` names the generator."""
    import torch
    import torch.utils.checkpoint as cp

    torch.manual_seed(0)
    w, gen = torch.randn(16, 16, requires_grad=True), torch.Generator().manual_seed(1)

    def fn(x):
        keep = torch.rand(x.shape[0], generator=gen) > 0.3  # (the generator kept advancing: other numbers)
        return torch.relu(x[keep] @ w)

    x = torch.randn(64, 16, requires_grad=True)
    with torch_debug_logging(), pytest.raises(cp.CheckpointError) as caught:
        cp.checkpoint(fn, x, use_reentrant=False, debug=True).sum().backward()
    path = tmp_path / "gen.log"
    path.write_text("".join(traceback.format_exception(caught.value)))
    (region,) = ac_diff.diagnose_paths([path]).regions
    assert (region.cause.kind, region.cause.mechanism) == ("rng", "private_generator"), region.cause
    assert not any("preserve_rng_state=True" in s.title for s in region.suggestions), region.suggestions


def test_a_log_whose_forward_detaches_a_tensor_itself_still_maps_positions_to_their_packs(tmp_path):
    """Token dropping on a threshold buffer moved before the backward, whose forward keeps `score.detach()` (27d): the
    forward's own detach turned the pack mapping off, and positions 4 and 6 were guessed by shape ("clone (by
    shape?)": clone saves nothing). A detach a later op reads, or one the forward lists of the same tensor, is the
    code's own; the others are the recompute's packs."""
    import torch

    torch.manual_seed(0)
    fc, state = torch.nn.Linear(16, 16), {"threshold": 3.8, "mean": None}

    def fn(x):
        score = x.norm(dim=-1)
        state["mean"] = score.detach().mean()  # (the code's own detach)
        keep = score > state["threshold"]
        state["threshold"] = 4.0  # (its moving threshold, moved by the forward: the recompute keeps fewer tokens)
        out = x.clone()
        out[keep] = x[keep] + torch.relu(fc(x[keep]))
        return out

    log = _debug_log(tmp_path, "drop.log", fn, torch.randn(64, 16, requires_grad=True))
    region = next(r for r in ac_diff.diagnose_paths([log]).regions if r.status == "diverged")
    reported = {p.position: p for p in region.positions if p.in_torch_error}
    assert reported and all(p.origin == "recompute pack" for p in reported.values()), region.positions
    ops = {p.op for p in reported.values()}  # (torch 2.4 reports the index's position alone, later ones relu's too)
    assert "aten.index.Tensor" in ops and ops <= {"aten.index.Tensor", "aten.relu.default"}, region.positions


@pytest.mark.parametrize("log", sorted((REPO / "tests" / "data" / "logs").glob("torch-*/moe_bias_update_debug.log.gz")),
                         ids=lambda p: p.parent.name)
def test_a_log_names_the_in_place_update_the_routing_depends_on(log):
    """The example's router bias is updated in place inside the region (update_expert_bias, in a forward hook): the
    dump's op lists show the add_ on a tensor from outside that the routing reads, not the tokens-per-expert
    counter's add_, which nothing reads."""
    (region,) = ac_diff.diagnose_paths([log]).regions
    cause = region.cause
    assert cause.kind == "state_mutation" and "update_expert_bias" in cause.source, cause
    assert "aten.add_.Tensor" in cause.detail
    # named by the code checkpoint() ran, the user frame under checkpoint's in the dump's stacks (it read "region
    # 0 · ?"), not by the innermost frame of an op (the rms_norm call)
    assert region.module == "forward at wt-compat/examples/tiny_moe.py:172", region.module
    # all the dump calls the bias is `$N`: the fix names it by the update's op and line, and its code names no `$N`
    # attribute (it read "Update `$49` after the backward, not between forward and backward", "self.$49")
    fix = region.suggestions[0]
    assert fix.title.startswith("Apply the update of `$") and "aten.add_.Tensor at " in fix.title, fix.title
    assert "update_expert_bias" in fix.title and "between forward and backward" not in fix.title
    assert "$" not in (fix.code or ""), fix.code
    assert "f32[2], torch's dump calls it $" in cause.detail


def test_autocasts_cached_weight_casts_are_not_a_divergence_in_a_log(tmp_path):
    """A backward run inside the forward's autocast context: the recompute finds the weights' bf16 casts in
    autocast's cache and makes only the activation's again. From the log (ids only, no values) those forward-only
    casts were aligned with the activation's and read as the first divergence (`_to_copy` bf16[16] -> bf16[4, 16]);
    the divergence is the softmax's dtype, which a Python value changed between forward and backward."""
    import torch

    torch.manual_seed(0)
    lin, state = torch.nn.Linear(16, 16), {"dtype": torch.float32}

    def fn(x):  # (the activation's cast reads the norm's output, the weights' casts read tensors from outside)
        return lin(torch.nn.functional.layer_norm(x, (16,))).to(state["dtype"]).softmax(-1)

    x = torch.randn(4, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        import torch.utils.checkpoint as cp

        with torch_debug_logging(), pytest.raises(cp.CheckpointError) as caught:
            y = cp.checkpoint(fn, x, use_reentrant=False, debug=True).float().sum()
            state["dtype"] = torch.bfloat16  # (before the backward: the recompute softmaxes in bf16)
            y.backward()
    log = tmp_path / "autocast.log"
    log.write_text("".join(traceback.format_exception(caught.value)))
    (region,) = ac_diff.diagnose_paths([log]).regions
    shape = region.first_shape_divergence
    assert shape is not None and shape.op == "aten._softmax.default", shape
    assert "f32[4, 16]→bf16[4, 16]" in shape.summary, shape.summary


def test_a_python_argument_changed_in_a_log_is_python_state_not_a_decision(tmp_path):
    """topk(k) with k from a capacity the loop raises between the forward and the backward: the debug log shows
    topk(4, 1) then topk(5, 1) over inputs of the same shapes. From the log alone that is a Python value that
    changed (it said "the sizes come from the data-dependent decision topk", cause unknown)."""
    import torch

    state = {"k": 4}
    weight = torch.randn(8, 8, requires_grad=True)

    def fn(x):
        scores = x @ weight
        values, _ = scores.topk(state["k"], dim=1)
        state["k"] = 5  # the capacity grows after the forward (the recompute reads it raised)
        return values.exp()

    log = _debug_log(tmp_path, "k.log", fn, torch.randn(4, 8, requires_grad=True))
    region = next(r for r in ac_diff.diagnose_paths([log]).regions if r.status == "diverged")
    assert region.cause.kind == "state_mutation" and region.cause.mechanism == "python_value", region.cause
    assert "aten.topk.default" in region.cause.tensor and "4→5" in region.cause.detail


def test_compare_takes_several_logs_one_per_rank(tmp_path):
    """torchrun --log-dir writes one file per rank: compare reads them all as one report."""
    paths = []
    for rank in range(3):
        paths.append(tmp_path / f"rank{rank}.log")
        text = (SAMPLE_LOGS / "moe_bias_update_error.log").read_text()
        paths[-1].write_text("".join(f"[rank{rank}]:{line}\n" for line in text.splitlines()))
    proc = run_cli("compare", "--format", "json", *map(str, paths))
    assert proc.returncode == 1, proc.stderr
    report = json.loads(proc.stdout)
    assert sorted(e["rank"] for e in report["torch_errors"]) == [0, 1, 2]
    # which file raised each: the line numbers alone do not say (every file's error is on the same line)
    assert sorted((e["rank"], e["log"]) for e in report["torch_errors"]) == [(r, f"rank{r}.log") for r in range(3)]
    text = run_cli("compare", *map(str, paths)).stdout
    assert all(f"rank{r}.log line" in text for r in range(3)), text


def test_with_two_logs_a_note_names_the_log_it_is_about(tmp_path):
    import torch

    torch.manual_seed(0)
    failing = _debug_log(tmp_path, "rank1.log", _branching([]), torch.randn(4, 4, requires_grad=True))
    quiet = tmp_path / "rank0.log"
    quiet.write_text(  # rank 0's log when rank 1 failed (as torchrun's --tee writes it): its peer went away
        "[rank0]: Traceback (most recent call last):\n"
        '[rank0]:   File "train.py", line 60, in main\n'
        "[rank0]:     dist.all_reduce(p.grad)\n"
        "[rank0]: RuntimeError: [../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:10136.\n")
    report = ac_diff.diagnose_paths([quiet, failing])
    note = next(n for n in report.notes if n.startswith("rank0.log: found no CheckpointError text"))
    # and what that rank died of (it said nothing of it)
    assert note.endswith("it ends with rank 0 raising RuntimeError: [../gloo/transport/tcp/pair.cc:553] Connection "
                         "closed by peer [127.0.0.1]:10136."), note


def test_saved_positions_in_a_log_follow_every_pack_in_order(tmp_path):
    """Expert-choice routing with a capacity raised after the forward: the debug log lists the recompute's packs of
    the gate's unsqueeze, the bmm output and the view, not of the gathered tokens saved by bmm. Each reported
    position goes to its own pack in order; greedy pairing gave the gathered tokens' position the bmm output's pack
    (same shape) and shifted the rest to guesses."""
    import torch

    torch.manual_seed(0)
    state = {"capacity": 4}
    router, experts = torch.randn(8, 2, requires_grad=True), torch.randn(2, 8, 8, requires_grad=True)

    def fn(x):
        scores = torch.softmax(x @ router, dim=0)
        gate, idx = torch.topk(scores.t(), state["capacity"], dim=1)
        state["capacity"] = 5  # raised after the forward: the recompute routes more tokens
        tokens = x[idx]
        out = torch.bmm(tokens, experts) * gate.unsqueeze(-1)
        return torch.zeros_like(x).index_add(0, idx.reshape(-1), out.reshape(-1, x.shape[1]))

    # (the tokens require no grad, the experts' weights do: torch's log lists no pack of the gathered tokens)
    log = _debug_log(tmp_path, "capacity.log", fn, torch.randn(8, 8))
    region = next(r for r in ac_diff.diagnose_paths([log]).regions if r.status == "diverged")
    packed = {p.op: p.position for p in region.positions if p.origin == "recompute pack"}
    assert "aten.bmm.default" in packed and "aten.unsqueeze.default" in packed, region.positions
    assert packed["aten.unsqueeze.default"] < packed["aten.bmm.default"]  # the gate's, then the experts' output
    gathered = next(p for p in region.positions if p.recomputed == "f32[2, 5, 8]")  # (the first of that shape)
    assert gathered.position < packed["aten.bmm.default"] and gathered.op == "aten.index.Tensor", region.positions


@pytest.mark.parametrize("log", sorted((REPO / "tests" / "data" / "logs").glob("torch-*/moe_bias_update_debug.log.gz")),
                         ids=lambda p: p.parent.name)
def test_a_log_that_begins_inside_the_forwards_op_list_is_compared_from_there(log, tmp_path):
    """The head of a dump cut off inside section 3's forward list (a log collected from the middle): the forward's
    remaining ops are the tail of that list, compared with the recompute from where they meet (they were dropped as
    "op lines outside any debug=True dump", and nothing was checked)."""
    import gzip

    lines = gzip.open(log, "rt").read().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("Operations executed during the original forward"))
    cut = tmp_path / "cut.log"
    cut.write_text("\n".join(lines[start + 40:]) + "\n")  # (40 forward ops in: the routing is further on)
    whole = ac_diff.diagnose_paths([log]).regions[0]
    (region,) = ac_diff.diagnose_paths([cut]).regions
    assert region.status == "diverged" and region.forward_ops > 0, region
    assert region.first_shape_divergence.op == whole.first_shape_divergence.op == "aten.split_with_sizes.default"
    assert region.first_shape_divergence.summary == whole.first_shape_divergence.summary


def test_two_ranks_whose_errors_only_share_their_kind_are_not_one_cause(tmp_path):
    """Two ranks raising different metadata mismatches (other tensors, other shapes), with no op lists to diagnose
    them: the cross-rank findings do not call the error's kind their shared cause (it said "every diverged rank has
    the same cause: metadata_mismatch")."""
    import torch
    import torch.utils.checkpoint as cp

    def error_text(rows: int, grow: int) -> str:
        state = {"n": rows}

        def fn(x):
            return torch.sin(x[: state["n"]]).exp()

        with pytest.raises(cp.CheckpointError) as caught:
            y = cp.checkpoint(fn, torch.randn(16, 4 * grow, requires_grad=True), use_reentrant=False)
            state["n"] = rows - 1
            y.sum().backward()
        return "".join(traceback.format_exception(caught.value))

    lines = [f"[rank{r}]:{line}" for r, text in ((0, error_text(8, 1)), (1, error_text(12, 2)))
             for line in text.splitlines()]
    log = tmp_path / "ranks.log"
    log.write_text("\n".join(lines) + "\n")
    report = ac_diff.diagnose_paths([log])
    assert {r.rank for r in report.ranks if r.verdict == "diverged"} == {0, 1}
    assert not any(f.kind == "same_cause" and "the same cause" in f.text for f in report.cross_rank_findings), \
        [f.text for f in report.cross_rank_findings]


def test_a_dump_whose_difference_lies_before_where_the_log_begins_is_never_clean(tmp_path):
    """The log begins inside the forward's op list, after the op that differed: the ops it holds match. torch printed
    the dump because the recompute differed, so the region is unchecked, with where the difference must be (it was
    read as CLEAN, exit 0)."""
    import torch

    calls: list = []

    def fn(x):
        calls.append(1)
        y = torch.sin(x)
        if len(calls) == 1:
            y = torch.relu(y)  # (the forward only: the recompute saves one tensor fewer)
        for _ in range(30):
            y = y * 1.01
        return y.exp()

    lines = _debug_log(tmp_path, "whole.log", fn, torch.randn(4, requires_grad=True)).read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("Operations executed during the original forward"))
    cut = tmp_path / "cut.log"
    cut.write_text("\n".join(lines[start + 8:]) + "\n")  # (past the relu)
    (region,) = ac_diff.diagnose_paths([cut]).regions
    assert region.status == "unchecked" and region.forward_ops > 0, region
    assert any("torch printed this debug=True dump because the recompute differed" in n for n in region.notes)
    proc = run_cli("compare", str(cut))
    assert proc.returncode == 4, proc.stdout


def test_a_traceback_through_compiled_code_says_torch_compile_may_have_picked_another_graph():
    """torch appends its hint about torch.compile's graph selection to every CheckpointError; ac-diff repeats it only
    where the traceback ran through compiled code (here AOTAutograd's compiled backward, after a guard on a Python
    float failed in the recompute). Compiled frames in a dump's stack traces are not the traceback's."""
    report = ac_diff.diagnose_paths([SAMPLE_LOGS / "compiled_recompile_error.log"])
    error = report.torch_error
    assert report.verdict == "diverged" and error.kind == "metadata_mismatch" and error.positions == [9]
    assert error.cause.startswith("compiled_graph: its traceback runs through torch.compile's code: the recompute "
                                  "may have run another compiled graph than the forward"), error.cause
    assert "another compiled graph" in report.headline
    for name in ("torchtitan_llama4_rank1_head.log", "pytorch_torchtitan_1117.log"):  # (dynamo frames in its dumps)
        other = ac_diff.diagnose_paths([_real(name)]).torch_error
        assert other is not None and not (other.cause or "").startswith("compiled_graph"), (name, other.cause)
    plain = ac_diff.diagnose_paths([SAMPLE_LOGS / "python_state_branch_error.log"]).torch_error
    assert plain.cause is None  # (the same hint is in this log, from an eager traceback)


@NEEDS_SAC
def test_selective_acs_error_from_eager_code_is_not_said_to_come_from_torch_compile():
    """LayerDrop with Python's `random` under selective AC: the recompute skips a layer the forward ran, and selective
    AC raises "... encountered during backward but not found in storage". Its traceback passes through Dynamo's
    eval_frame.py (checkpoint runs the recompute and its dispatch mode under torch._disable_dynamo), which made the
    error "compiled_graph: ... torch.compile", though nothing was compiled."""
    import functools
    import random

    import torch
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op == torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE

    class LayerDrop(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(8, 8)

        def forward(self, x):
            return x + torch.tanh(self.fc(x)) if random.random() < 0.5 else x * 1.0

    random.seed(1)
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(LayerDrop() for _ in range(4))
    text = None
    for _ in range(20):  # (until a recompute draws another branch than its forward)
        x = torch.randn(4, 8, requires_grad=True)
        for layer in layers:
            x = checkpoint(layer, x, use_reentrant=False,
                           context_fn=functools.partial(create_selective_checkpoint_contexts, policy))
        try:
            x.sum().backward()
        except RuntimeError:
            text = traceback.format_exc()
            break
    assert text is not None and "not found in storage" in text and "_dynamo" in text, text
    report = ac_diff.diagnose([parse_text(text)])
    error = report.torch_error
    assert error is not None and error.kind == "sac_not_found", report.headline
    assert not (error.cause or "").startswith("compiled_graph"), error.cause
    assert "torch.compile" not in report.headline and "not found in storage" in report.headline, report.headline


def test_a_log_torchrun_wrote_per_rank_takes_its_rank_from_its_path(tmp_path):
    """torchrun --log-dir writes each rank's output unprefixed to <dir>/<run>/attempt_0/<rank>/stderr.log: the rank is
    in the path (it read "rank 0"); a log named by its rank (`rank3.log`) too, a plain name names none."""
    from ac_diff.logs.lines import rank_in_path

    assert [rank_in_path(p) for p in ("d/none_x/attempt_0/1/stderr.log", "rank3.log", "train_rank_2.err",
                                      "single.err", "/tmp/rank1/out.log")] == [1, 3, 2, None, None]
    log = tmp_path / "none_x" / "attempt_0" / "3" / "stderr.log"
    log.parent.mkdir(parents=True)
    log.write_bytes(_real("Joluck_RWKV-PEFT_58.log").read_bytes())  # (no rank prefixes)
    assert ac_diff.diagnose_paths([log]).torch_error.rank == 3


def test_a_torchrun_log_directory_is_read_as_its_logs_and_an_empty_one_among_several_is_left_out(tmp_path):
    """26c: `compare DIR` on a torchrun --log-dir tree said "no trace files"; its glob (`attempt_0/*/*.log`) was refused
    whole for torchrun's empty stdout.log. The directory's logs are read (the rank from each path), an empty file
    among several is left out with a note."""
    attempt = tmp_path / "logs" / "none_x" / "attempt_0"
    for rank in (0, 1):
        (attempt / str(rank)).mkdir(parents=True)
        (attempt / str(rank) / "stdout.log").write_bytes(b"")
    (attempt / "1" / "stderr.log").write_bytes(_real("Joluck_RWKV-PEFT_58.log").read_bytes())  # (no rank prefixes)
    (attempt / "0" / "stderr.log").write_text("step 1 loss 0.5\n")  # (rank 0 raised nothing)
    report = ac_diff.diagnose_paths([tmp_path / "logs"])
    assert report.verdict == "diverged" and report.torch_error.rank == 1, report.headline
    files = sorted(attempt.glob("*/*.log"))
    report = ac_diff.diagnose_paths(files)
    assert report.verdict == "diverged" and report.torch_error.rank == 1, report.headline
    assert any(n.endswith("stdout.log: left out, it is empty") for n in report.notes), report.notes
    r = run_cli("compare", str(tmp_path / "logs" / "none_x" / "attempt_0" / "0"))
    assert r.returncode == 2 and "no log with a torch.utils.checkpoint error in this directory" in r.stderr, r.stderr


def test_torchrun_log_dirs_of_two_nodes_give_global_ranks_and_say_how(tmp_path):
    """27h: two nodes' torchrun --log-dir trees (<node dir>/<run>/attempt_0/<local rank>/stderr.log) read as ranks 0
    and 1 twice, node 1's errors under node 0's ranks. Node i's local rank L is rank i x ranks per node + L, the nodes
    in their directories' path order (said in a note); the nodes and ranks per node count the files without an error.
    A log whose lines name their rank (torch's `[rankN]:`) keeps it."""
    error_text = _real("Joluck_RWKV-PEFT_58.log").read_bytes()  # (no rank prefixes)
    for node, run in (("node0", "none_ab"), ("node1", "none_cd")):
        for local in (0, 1):
            (tmp_path / node / run / "attempt_0" / str(local)).mkdir(parents=True)
            (tmp_path / node / run / "attempt_0" / str(local) / "stderr.log").write_text("step 1 loss 0.5\n")
    (tmp_path / "node1" / "none_cd" / "attempt_0" / "1" / "stderr.log").write_bytes(error_text)
    (tmp_path / "node0" / "none_ab" / "attempt_0" / "1" / "stderr.log").write_bytes(error_text)
    report = ac_diff.diagnose_paths(tmp_path)
    assert sorted(e.rank for e in report.torch_errors) == [1, 3], report.torch_errors
    assert any("taken as nodes 0-1 in path order (node0/none_ab = ranks 0-1, node1/none_cd = ranks 2-3)" in n
               for n in report.notes), report.notes
    files = sorted(tmp_path.rglob("stderr.log"))
    assert sorted(e.rank for e in ac_diff.diagnose_paths(files).torch_errors) == [1, 3]
    (tmp_path / "node1" / "none_cd" / "attempt_0" / "1" / "stderr.log").write_bytes(
        b"".join(b"[rank3]: " + line for line in error_text.splitlines(True)))
    report = ac_diff.diagnose_paths(tmp_path)
    assert sorted(e.rank for e in report.torch_errors) == [1, 3], report.torch_errors
    assert not any("in path order" in n for n in report.notes), report.notes


def test_a_log_of_batch_norms_switched_to_eval_leads_with_the_batch_norm(tmp_path):
    """A conv block whose batch norms are switched to eval between the forward and the backward: torch's error lists
    pairs of f32[C] -> f32[0] (each norm's saved mean and inverse std). It led with ZeRO-3 / FSDP."""
    import torch
    import torch.nn as nn
    import torch.utils.checkpoint as cp

    torch.manual_seed(0)
    block = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.BatchNorm2d(8))
    out = cp.checkpoint(block, torch.randn(2, 3, 12, 12, requires_grad=True), use_reentrant=False)
    block.eval()  # e.g. a validation pass between the forward and the backward
    with pytest.raises(cp.CheckpointError) as raised:
        out.sum().backward()
    log = tmp_path / "train.log"
    log.write_text(f"torch.utils.checkpoint.CheckpointError: {raised.value}\n")
    error = ac_diff.diagnose_paths([log]).torch_error
    assert [c.saved for c in error.changes] == ["f32[8]"] * 4 and all(c.recomputed == "f32[0]" for c in error.changes)
    assert "in pairs of one size: a batch norm's saved mean and inverse std" in error.cause, error.cause


def test_autocast_on_in_the_recompute_only_is_a_dtype_change_in_a_log(tmp_path):
    """An AMP warmup that switches autocast on between the forward and the backward: the recompute casts the weights
    and saves bf16 where the forward saved f32, same shapes. From the debug log it read "saved positions differ in
    shape" and "Python code took another branch" (the casts only the recompute ran); it is a dtype change, and the
    cause is autocast's state, as the plain error text already said."""
    import torch
    import torch.utils.checkpoint as cp

    torch.manual_seed(0)
    block, amp = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16)), [False]

    def fn(x):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp[0]):
            return block(x)

    with torch_debug_logging(), pytest.raises(cp.CheckpointError) as caught:
        y = cp.checkpoint(fn, torch.randn(8, 16, requires_grad=True), use_reentrant=False, debug=True).float().sum()
        amp[0] = True  # (the warmup ends before the backward: the recompute runs under autocast)
        y.backward()
    log = tmp_path / "amp.log"
    log.write_text("".join(traceback.format_exception(caught.value)))
    (region,) = ac_diff.diagnose_paths([log]).regions
    assert region.cause.kind == "global_state" and "changed its dtype (f32 -> bf16)" in region.cause.detail, \
        region.cause
    # (which setting, the log does not show: a dtype attribute a schedule changes reads the same; it said "Make
    # `autocast` the same" to a script without autocast)
    assert region.suggestions[0].title == "Make the precision the same in the forward and in the backward"
    assert "a dtype attribute or global" in region.suggestions[0].text
    assert region.first_shape_divergence.label == "dtype" and region.chain[-1].endswith(
        "differ in dtype -> CheckpointError"), region.chain
    assert {row.marker for row in region.window if row.marker in ("shape", "dtype")} == {"dtype"}


class _Pruner(torch.nn.Module):
    """Token pruning against a threshold the forward updates in place (an EMA of the norms' median) and then compares
    with: the recompute updates it again, keeps other tokens, and torch raises a metadata mismatch. Dropout before it
    draws the same numbers in both passes (preserve_rng_state)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("thresh", torch.tensor(1.0))
        self.fc = torch.nn.Linear(16, 16)

    def forward(self, x):
        flat = torch.nn.functional.dropout(x, 0.1).reshape(-1, 16)
        norms = flat.norm(dim=-1)
        with torch.no_grad():
            self.thresh.mul_(0.5).add_(0.5 * norms.median())
        idx = (norms > self.thresh).nonzero().squeeze(1)
        return flat.index_add(0, idx, torch.relu(self.fc(flat.index_select(0, idx)))).view(x.shape)


def test_a_log_names_a_buffer_the_region_updates_and_then_reads():
    """The region updates a buffer in place and then computes with it (the update feeds the diverged op through the
    in-place ops, not from outside): the cause was "rng: nonzero depends on the random op bernoulli_", whose fix
    (preserve_rng_state=True, already on) changes nothing."""
    torch.manual_seed(0)
    text = checkpoint_error_text(_Pruner(), torch.randn(4, 8, 16, requires_grad=True))
    report = ac_diff.diagnose([parse_text(text)])
    (region,) = report.regions
    assert region.cause.kind == "state_mutation", region.cause
    assert "aten.mul_.Tensor" in region.cause.detail and "test_compare_logs.py" in region.cause.source
    assert region.suggestions[0].title.startswith("Update `$"), region.suggestions[0].title
    assert not any("preserve_rng_state" in s.title for s in region.suggestions)


def test_a_dtype_a_schedule_switched_before_the_backward_is_a_precision_change_in_a_dump_too():
    """`.to(CFG["gate_dtype"])`: a no-op in the forward (float32), a cast in the recompute (bfloat16 since). The plain
    error's positions (f32 -> bf16, same shapes) read as a precision change; the dump of the same run was "control_flow:
    Python code took another branch" (its sequences differ where the recompute ran the cast)."""
    cfg = {"gate_dtype": torch.float32}
    gate = torch.nn.Linear(8, 8)

    def region(x):
        return torch.sigmoid(gate(x)).to(cfg["gate_dtype"]) * x.to(cfg["gate_dtype"])

    text = checkpoint_error_text(region, torch.randn(4, 8, requires_grad=True),
                                 between=lambda: cfg.update(gate_dtype=torch.bfloat16))
    (region_report,) = ac_diff.diagnose([parse_text(text)]).regions
    cause = region_report.cause
    assert cause.kind == "global_state" and "the recompute ran dtype casts" in cause.detail, cause
    assert "f32 -> bf16" in cause.detail
    assert region_report.suggestions[0].title == "Make the precision the same in the forward and in the backward"


def test_a_backward_that_fails_on_a_gradients_shape_where_checkpoint_compared_nothing():
    """determinism_check="none": the pruner's recompute keeps other tokens, torch compares nothing, and the backward
    fails in autograd's shape check ("IndexAddBackward0 returned an invalid gradient ... got [29, 16] but expected
    shape compatible with [32, 16]"). Nothing is checked from such a log, and the note says what the error means."""
    torch.manual_seed(0)
    text = checkpoint_error_text(_Pruner(), torch.randn(4, 8, 16, requires_grad=True), debug=False,
                                 determinism_check="none")
    assert "returned an invalid gradient" in text
    report = ac_diff.diagnose([parse_text(text)])
    assert report.verdict == "unchecked", report.headline
    assert any("that is how a recompute that computed other shapes than its forward ends" in n
               and 'determinism_check="none"' in n for n in report.notes), report.notes


class _OddCallBranch(torch.nn.Module):
    """A pre-layer that adds a tanh projection on even calls (a call counter): the recompute (call 2) runs it where the
    forward (call 1) went on to the block's layer norm."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.calls = torch.nn.Linear(16, 16), 0

    def forward(self, x):
        self.calls += 1
        if self.calls % 2 == 0:
            x = x + 0.1 * self.proj(torch.tanh(x))  # the branch
        return x


def test_a_branch_in_a_dump_is_named_by_the_line_of_each_pass():
    """The forward ran the block's layer norm where the recompute ran the extra branch's tanh: the cause and the fix
    named only the forward's line (the layer norm's call), where no branch is; now the recompute's line too."""
    import inspect

    torch.manual_seed(0)
    block = torch.nn.Sequential(_OddCallBranch(), torch.nn.LayerNorm(16), torch.nn.Linear(16, 32))
    # the forward (call 1) skips the branch, the recompute (call 2) runs it
    text = checkpoint_error_text(block, torch.randn(4, 16, requires_grad=True))
    (region,) = ac_diff.diagnose([parse_text(text)]).regions
    lines, first = inspect.getsourcelines(_OddCallBranch.forward)
    branch = first + next(i for i, line in enumerate(lines) if "# the branch" in line)
    assert region.cause.kind == "control_flow", region.cause
    # (a log's ops align by their lines too: the recompute's tanh is its own, at the branch, not the layer norm's twin)
    assert f"test_compare_logs.py:{branch} in forward" in region.cause.detail, region.cause.detail
    assert region.cause.tensor == "aten.tanh.default", region.cause
    assert f"test_compare_logs.py:{branch}" in region.suggestions[0].text


def test_a_torchrun_log_names_every_rank_it_has_lines_of():
    """Four ranks: 1 and 3 raise the CheckpointError (a real one, printed with their prefixes), 0 and 2 die on the
    collective their peers left (gloo's "Connection closed by peer"). The report said "diverged: ranks 1, 3 (2 of 2
    ranks)": ranks 0 and 2 were in no row."""
    torch.manual_seed(0)
    error = checkpoint_error_text(_Pruner(), torch.randn(4, 8, 16, requires_grad=True), debug=False)
    peer = ("Traceback (most recent call last):\n  File \"train.py\", line 21, in <module>\n    loss.backward()\n"
            "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
            "[127.0.0.1]:33458\n")

    def prefixed(text: str, rank: int) -> str:
        return "".join(f"[rank{rank}]: {line}\n" for line in text.splitlines())

    log = prefixed(error, 3) + prefixed(error, 1) + prefixed(peer, 2) + prefixed(peer, 0)
    report = ac_diff.diagnose([parse_text(log)])
    assert [(s.rank, s.verdict) for s in report.ranks] == [(0, "no_regions"), (1, "diverged"), (2, "no_regions"),
                                                           (3, "diverged")]
    assert all("Connection closed by peer" in s.raised for s in report.ranks if s.rank in (0, 2))
    overview = report.cross_rank_findings[0].text
    assert "(2 of 4 ranks)" in overview and "no checkpoint error, raised: rank 0: RuntimeError" in overview, overview


def test_a_log_that_keeps_one_op_of_the_forwards_list_places_it_nowhere():
    """A log collector kept the last kilobytes: the dump's forward list has its last op only (a `view`), which matched
    the recompute's first `view` by name and read as "a Python value passed to aten.view.default changed" (a made-up
    state mutation). Too little of the forward is left to place: nothing is compared, and no cause is claimed."""
    torch.manual_seed(0)
    lines = checkpoint_error_text(_Pruner(), torch.randn(4, 8, 16, requires_grad=True)).splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("Operations executed during recomputation"))
    last_forward_op = max(i for i in range(at) if lines[i].startswith("$"))
    tail = lines[last_forward_op - 1][-30:] + "\n" + "\n".join(lines[last_forward_op:])  # (cut inside the op before)
    report = ac_diff.diagnose([parse_text(tail)])
    assert report.verdict == "unchecked", report.headline
    assert not any(r.cause is not None and r.cause.kind == "state_mutation" for r in report.regions)


def test_a_nested_checkpoints_dump_lists_each_forward_op_once():
    """An outer checkpoint around the pruner's inner one, both with debug=True: torch logs every op of the forward
    twice in a row (once per capture mode it passed through), and the alignment read the second copies as ops "ran in
    the forward but not in the recompute" (a first divergence `native_layer_norm`, where the recompute ran every one).
    Each op is read once: the first divergence is the decision that changed the shapes."""
    import torch.utils.checkpoint as cp

    torch.manual_seed(0)
    inner, norm = _Pruner(), torch.nn.LayerNorm(16)

    def outer(x):
        return cp.checkpoint(inner, norm(x), use_reentrant=False, debug=True)

    text = checkpoint_error_text(outer, torch.randn(4, 8, 16, requires_grad=True))
    forward = text[text.index("Operations executed during the original forward"):]
    first = next(line for line in forward.splitlines() if "= torch._ops." in line)
    assert forward.count(first + "\n" + first) == 1  # (torch's own doubling: what this test is about)
    report = ac_diff.diagnose([parse_text(text)])
    region = next(r for r in report.regions if r.status == "diverged")
    assert region.first_control_divergence is None, region.first_control_divergence
    assert region.first_shape_divergence is not None, region


def test_a_loggers_copy_of_an_error_is_the_rank_its_record_names(tmp_path):
    """25g: under torchrun, a trainer's `log.exception` prints each rank's error unprefixed after its own record
    (`[ERROR] [rank1] trainer: training failed`), then torchrun prints it again `[rank1]:`-prefixed. The unprefixed
    copy took the rank of the `[rank0]:` block before it: rank 1's error under rank 0, 4 errors for 2. The logger's
    record names the rank; a traceback starting unprefixed after another rank's prefixed lines is not theirs."""
    log = REPO / "tests" / "data" / "logs" / "torchrun-logger" / "torchrun_2r.log"
    r = run_cli("compare", str(log), "--json", str(tmp_path / "r.json"))
    assert r.returncode == 1, r.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    shapes = {e["rank"]: e["changes"][0]["saved"] for e in report["torch_errors"]}
    assert len(report["torch_errors"]) == 2 and shapes == {0: "f32[27, 32]", 1: "f32[30, 32]"}, report["torch_errors"]


def test_a_reentrant_recompute_of_another_shape_is_named_from_its_traceback():
    """26c: a use_reentrant=True region whose recompute kept fewer tokens (a keep count changed before the backward)
    fails in checkpoint's backward with autograd's "Mismatch in shape: grad_output[0] ... and output[0] ...": the log
    read only "found no CheckpointError text". The traceback through checkpoint.py's backward names it."""
    import torch.nn as nn
    import torch.utils.checkpoint as cp

    class Keep(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.keep = nn.Linear(8, 8), 6

        def forward(self, x):
            return self.fc(x)[: self.keep]

    block = Keep()
    out = cp.checkpoint(block, torch.randn(8, 8, requires_grad=True), use_reentrant=True)
    block.keep = 4  # (a schedule's step, before the backward)
    try:
        out.sum().backward()
    except RuntimeError:
        text = traceback.format_exc()
    assert "Mismatch in shape" in text and "checkpoint.py" in text, text
    report = ac_diff.diagnose([parse_text("step 0 loss 1.0\n" + text)])
    assert any(n.startswith("the backward of a use_reentrant=True checkpoint got a gradient of shape [6, 8] (its "
                            "forward's output) for its recompute's output of shape [4, 8]") for n in report.notes), \
        report.notes
