"""Across torch releases: the compat layer's probes on the installed torch, its reduced modes, no torch warning of
ac-diff's making, and the logs older and newer releases wrote (tests/data/logs/torch-*/, see its README)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.utils.checkpoint as cp

import ac_diff
from ac_diff.capture import torch_compat
from models import NEEDS_SAC, VARIANTS, Net, record_step, train_step

LOGS = Path(__file__).parent / "data" / "logs"


def test_this_torch_needs_no_reduced_mode(tmp_path):
    """Every release 2.4 .. 2.14 has each mechanism the recorder uses, however it spells it."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with ac_diff.record(tmp_path / "t.jsonl") as rec:
            train_step(Net(VARIANTS["non_reentrant"]))
    assert rec.hooks.warnings == []


def test_region_inputs_are_named_in_both_passes(tmp_path):
    """The forward's inputs come from whichever saver this torch has (`save_inputs`, or `_NoopSaveInputs` before
    2.12), the recompute's from recompute_fn's arguments (`(kwargs, *args)` before 2.12)."""
    torch.manual_seed(0)
    _, run = record_step(Net(VARIANTS["non_reentrant"], n=1), tmp_path / "t.jsonl")
    (region,) = run.regions
    for p in (region.forward, region.recompute):
        assert [(e.kind, e.name) for e in p.externals if e.kind == "input"] == [("input", "input[0]")], p.phase


def test_a_missing_input_saver_is_a_named_reduced_mode(tmp_path, monkeypatch):
    """A release that keeps a region's inputs some third way (the probe finds neither spelling): recorded all the
    same, with one warning line naming what is missing (the forward's inputs are not named)."""
    monkeypatch.setattr(torch_compat, "input_saver", lambda: None)
    with pytest.warns(RuntimeWarning, match="reduced mode no_input_saver"):
        with ac_diff.record(tmp_path / "t.jsonl") as rec:
            torch.manual_seed(0)
            train_step(Net(VARIANTS["non_reentrant"]))
    assert len(rec.hooks.warnings) == 1
    trace = ac_diff.load(tmp_path / "t.jsonl")
    assert len(trace.regions) == 2 and ac_diff.diagnose_paths([tmp_path / "t.jsonl"]).verdict == "clean"


def test_uninstall_restores_torch_exactly(tmp_path):
    names = [(cp._CheckpointFrame, "__init__"), (cp._checkpoint_hook, "__init__"), (cp._recomputation_hook, "__enter__"),
             (cp.CheckpointFunction, "forward")]
    if hasattr(cp, "_NoopSaveInputs"):
        names.append((cp._NoopSaveInputs, "apply"))
    before = [owner.__dict__.get(name) for owner, name in names]
    with ac_diff.record(tmp_path / "t.jsonl"):
        train_step(Net(VARIANTS["non_reentrant"]))
    assert [owner.__dict__.get(name) for owner, name in names] == before


@NEEDS_SAC
def test_sac_regions_set_off_no_torch_warning_of_ours(tmp_path):
    """torch >= 2.14 warns when a saved_tensors_hooks context is around a selective-AC region: the recorder's
    wrapped checkpoint hooks must still read as torch's own (they did not: a FutureWarning on every SAC op)."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, run = record_step(Net(VARIANTS["sac"]), tmp_path / "t.jsonl")
    assert all(r.options.get("sac") for r in run.regions)


@NEEDS_SAC
def test_sac_a_users_own_hooks_still_get_torchs_warning(tmp_path):
    """Only ac-diff's own hooks are hidden from torch: with the user's save_on_cpu around a SAC region, the
    recorder changes nothing about what torch says (a warning on torch >= 2.14, none before)."""
    def step():
        torch.manual_seed(0)
        with torch.autograd.graph.save_on_cpu():
            train_step(Net(VARIANTS["sac"]))

    with warnings.catch_warnings(record=True) as plain:
        warnings.simplefilter("always")
        step()
    with warnings.catch_warnings(record=True) as recorded:
        warnings.simplefilter("always")
        with ac_diff.record(tmp_path / "t.jsonl"):
            step()
    torch_said = sorted({str(w.message) for w in plain if w.category is FutureWarning})
    assert sorted({str(w.message) for w in recorded if w.category is FutureWarning}) == torch_said


# ------------------------------------------------------------------------------------- stored logs

LOG_DIRS = sorted(LOGS.glob("torch-*"))


def test_logs_of_the_oldest_and_newest_release_are_kept():
    assert {"torch-2.4.1", "torch-2.14.1"} <= {d.name for d in LOG_DIRS}


@pytest.mark.parametrize("release", [d.name for d in LOG_DIRS])
def test_stored_logs_error_text(release):
    report = ac_diff.diagnose_paths([LOGS / release / "moe_bias_update_error.log"])
    assert report.verdict == "diverged"
    error = report.torch_error
    assert error.kind == "metadata_mismatch"
    assert error.positions == [35, 36, 38, 39, 40, 42, 62, 63, 65, 66, 67, 69]


@pytest.mark.parametrize("release", [d.name for d in LOG_DIRS])
def test_stored_logs_debug_dump(release):
    report = ac_diff.diagnose_paths([LOGS / release / "moe_bias_update_debug.log.gz"])
    assert report.verdict == "diverged"
    assert report.torch_error.positions[0] == 35
    region = next(r for r in report.regions if r.status == "diverged")
    assert region.first_shape_divergence.op == "aten.split_with_sizes.default"
    assert "tiny_moe.py" in region.first_shape_divergence.source
    assert region.first_discrete_divergence.op == "aten.topk.default"
    # through the recompute's pack detaches (one, two or three per pack, by release), as the recorder maps them:
    # each expert saves its split input, the w1 matmul, its input again, the w3 matmul, silu, then the product
    expert = ["split_with_sizes", "mm", "split_with_sizes", "mm", "silu", "mul"]
    assert [(p.position, p.op.split(".")[1], p.origin) for p in region.positions if p.in_torch_error] == [
        (n, op, "recompute pack") for n, op in zip([35, 36, 38, 39, 40, 42, 44, 45, 47, 48, 49, 51], expert * 2)]


def test_a_silent_divergences_log_is_nothing_to_explain_whatever_release_wrote_it(tmp_path):
    """torch 2.4.1 prints a FutureWarning from torch/utils/checkpoint.py at each recompute, which a later release does
    not: a log that holds no error reads alike either way, NOTHING CHECKED (exit 4, as the README says), with the note
    that it does not show the recomputes matched; binary data is refused (exit 2). Among several logs such a one is
    left out, with a note, and the others explained."""
    from ac_diff.api import NothingToExplain, read_runs

    assert read_runs([]) == []  # (nothing given: nothing read, no note to hang anywhere)

    silent = LOGS / "torch-2.4.1" / "dropout_no_rng_silent.log"
    assert "torch/utils/checkpoint.py" in silent.read_text()  # (the warning line)
    later = tmp_path / "later.log"  # (the same log as a later release prints it: no warning line)
    later.write_text("".join(line for line in silent.read_text().splitlines(keepends=True)
                             if "checkpoint" not in line and "warn" not in line.lower()))
    for log in (silent, later):
        alone = ac_diff.diagnose_paths([log])
        assert alone.verdict == "unchecked", alone.headline
        assert any("does not show that the recomputes matched" in n for n in alone.notes), alone.notes
    binary = tmp_path / "weights.bin"
    binary.write_bytes(bytes(range(256)) * 8)
    with pytest.raises(NothingToExplain, match="does not show the recomputes matched"):
        ac_diff.diagnose_paths([binary])
    from conftest import run_cli

    assert [run_cli("compare", str(p)).returncode for p in (later, binary)] == [4, 2]
    report = ac_diff.diagnose_paths([LOGS / "torch-2.4.1" / "moe_bias_update_error.log", silent])
    assert report.verdict == "diverged", report.headline
    assert any(n.startswith(f"{silent}: left out, no torch.utils.checkpoint error") for n in report.notes), \
        report.notes


@pytest.mark.parametrize("where", ["hook", "recompute", "after"])
def test_an_exit_is_known_to_have_left_a_backward(where):
    """`left_a_backward`: the Python frames through which this torch enters its autograd engine are found in the
    traceback of an exit raised by a tensor hook or inside a recompute (never clean: it stopped a backward), not of
    one raised after the backward."""
    lin = torch.nn.Linear(4, 4)

    def region(t):
        if where == "recompute" and calls:  # (its second call: the recompute)
            raise SystemExit(0)
        calls.append(1)
        return torch.tanh(lin(t))

    calls: list = []
    y = cp.checkpoint(region, torch.randn(2, 4), use_reentrant=False)
    if where == "hook":
        y.register_hook(lambda g: (_ for _ in ()).throw(SystemExit(0)))
    with pytest.raises(SystemExit) as info:
        y.sum().backward()
        raise SystemExit(0)  # (after the backward)
    assert torch_compat.left_a_backward(info.value) is (where != "after")


def test_the_gradients_an_unpacking_node_computes_are_told():
    """`torch.autograd.grad(loss, x)` runs a linear's AddmmBackward0 for its input's gradient alone (edge 1; not the
    bias's, 0, or the weight's, 2); a full backward computes all of them, and outside a backward nothing is running."""
    seen = []
    lin = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4, requires_grad=True)

    def saved(t):
        return t

    def unpacked(t):
        seen.append(torch_compat.gradients_computed())
        return t

    with torch.autograd.graph.saved_tensors_hooks(saved, unpacked):
        loss = lin(torch.tanh(x)).sum()
    torch.autograd.grad(loss, x, retain_graph=True)
    assert ("AddmmBackward0", frozenset({1})) in seen, seen
    seen.clear()
    loss.backward()
    assert seen and all(s is None for s in seen), seen
    assert torch_compat.gradients_computed() is None
