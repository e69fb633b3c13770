"""Causes of a recompute that ran other ops than its forward, each from a real mechanism: a reentrant region that
branches on grad mode (use_reentrant=True runs its forward without autograd), a cache the forward filled that the
recompute read back (spectral norm's weight under torch.nn.utils.parametrize.cached()), a lazy module that
initialized its parameters in the forward only (its random draws moved the generator the dropout after it reads), a
noise table a cached helper drew in the forward only (the same, from a cache miss), and an ablation probe's forward
hook registered after the loss and removed after the backward (the recompute runs it)."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as cp
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import spectral_norm

import ac_diff


class FastPath(nn.Module):
    """A block with an "inference fast path" taken when autograd is off (bf16 matmuls, as a serving kernel)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        if not torch.is_grad_enabled():
            return torch.tanh(self.lin(x.bfloat16().float()))
        return torch.tanh(self.lin(x))


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_branch_on_grad_mode_under_reentrant_checkpoint(reentrant, tmp_path):
    torch.manual_seed(0)
    model, x = FastPath(), torch.randn(4, 16, requires_grad=True)
    with ac_diff.record(tmp_path / "t.jsonl"):
        cp.checkpoint(model, x, use_reentrant=reentrant).sum().backward()
    report = ac_diff.diagnose_paths([tmp_path / "t.jsonl"])
    if not reentrant:  # both passes run with autograd on: the same branch
        assert report.verdict == "clean", report.headline
        return
    region = report.regions[0]
    assert region.status == "diverged" and region.cause.kind == "control_flow", report.headline
    assert region.cause.mechanism == "grad_mode" and "torch.is_grad_enabled()" in region.cause.detail
    assert region.suggestions[0].title.startswith("Checkpoint with use_reentrant=False")
    # (torch checks nothing of a reentrant recompute: not "every saved tensor keeps its shape")
    assert region.chain[-1] == ("torch compares nothing of it (use_reentrant=True: torch checks no recompute's saved "
                                "tensors against its forward's): the gradients are silently wrong"), region.chain


class SpectralBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = spectral_norm(nn.Linear(16, 16))

    def forward(self, x):
        return x + F.leaky_relu(self.fc(x), 0.2)


@pytest.mark.parametrize("warmed", [False, True])
def test_a_cache_the_forward_filled_and_the_recompute_read(warmed, tmp_path):
    """Forward and backward inside parametrize.cached(): the forward computes the spectral-normalised weight (power
    iteration, saving tensors) and caches it, the recompute reads it from the cache and saves fewer: torch raises.
    With the cache filled before the checkpointed forward, both passes read it: clean."""
    torch.manual_seed(0)
    model, x = SpectralBlock(), torch.randn(8, 16, requires_grad=True)
    with ac_diff.record(tmp_path / "t.jsonl"), parametrize.cached():
        if warmed:
            model.fc.weight  # noqa: B018 - fills the cache
        try:
            cp.checkpoint(model, x, use_reentrant=False).sum().backward()
        except cp.CheckpointError:
            assert not warmed
    report = ac_diff.diagnose_paths([tmp_path / "t.jsonl"])
    if warmed:
        assert report.verdict == "clean", report.headline
        return
    region = report.regions[0]
    assert report.torch_error.kind == "count_mismatch"
    assert region.cause.kind == "control_flow" and region.cause.mechanism == "cache_hit", region.cause
    assert "read back 1 tensor(s) the forward made and kept" in region.cause.detail
    assert region.suggestions[0].title.startswith("Fill the cache before the checkpointed forward")
    # clearing spectral_norm's cache before the backward runs its power iteration again in the recompute: silently
    # other weights (a stranger applied "or clear the cache before the backward" and lost the CheckpointError only)
    assert "or clear the cache" not in region.suggestions[0].text
    assert "not spectral_norm's" in region.suggestions[0].text


class LazyBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.drop = nn.LazyLinear(16), nn.Dropout(0.2)

    def forward(self, x):
        return self.drop(torch.tanh(self.fc(x)))


def _one_region(model, x, tmp_path, clean: bool):
    """Record one checkpoint of `model` on `x` and its backward: None where the run must be (and is) clean, else the
    diagnosed region."""
    with ac_diff.record(tmp_path / "t.jsonl"):
        cp.checkpoint(model, x, use_reentrant=False).sum().backward()
    report = ac_diff.diagnose_paths([tmp_path / "t.jsonl"])
    if clean:
        assert report.verdict == "clean", report.headline
        return None
    return report.regions[0]


@pytest.mark.parametrize("materialized", [False, True])
def test_a_lazy_module_initialized_inside_the_region(materialized, tmp_path):
    """nn.LazyLinear initializes its weight (uniform_, from the default generator) in its first forward, inside the
    region; the recompute skips that, so the dropout after it draws another mask. Materialized first: clean."""
    torch.manual_seed(0)
    model, x = LazyBlock(), torch.randn(8, 12)
    if materialized:
        with torch.no_grad():
            model(x)
    region = _one_region(model, x, tmp_path, clean=materialized)
    if region is None:
        return
    assert (region.cause.kind, region.cause.mechanism) == ("rng", "lazy_init"), region.cause
    assert region.cause.tensor == "fc.weight" and "lazy module" in region.cause.detail
    assert region.suggestions[0].title == "Initialize lazy modules before training, outside activation checkpointing"


class CachedNoise(nn.Module):
    """A block that adds a noise table a cached helper draws on its first call (a cache miss in the forward, a hit in
    the recompute), then dropout."""

    def __init__(self, table, saved: bool = False) -> None:
        super().__init__()
        self.fc, self.drop, self.table, self.saved = nn.Linear(16, 16), nn.Dropout(0.2), table, saved

    def forward(self, x):
        table = self.table(x.shape[0], x.shape[1])
        # (a product saves the table for its backward: the recompute reads the cached one back instead of drawing it)
        return self.drop(torch.relu(self.fc(x) * table if self.saved else self.fc(x + table)))


@pytest.mark.parametrize("warmed,saved", [(False, False), (True, False), (False, True)])
def test_a_draw_the_forward_made_on_a_cache_miss_moves_the_dropout_of_the_recompute(warmed, saved, tmp_path):
    """functools.lru_cache's table is drawn (randn) in the forward and found cached by the recompute, whose dropout then
    draws from another offset of the restored generator: the cause was "the generator it draws from is not one
    checkpoint restores ... a region that draws on a GPU", on a CPU. The table drawn before the step: clean. A table
    the forward saved for its backward (a product, random features' `q @ W`, 27b) was named a cache that skipped saved
    tensors (control_flow), pointing away from the draw."""
    import functools

    @functools.lru_cache(maxsize=None)
    def noise_table(n, d):
        return torch.randn(n, d) * 0.02

    torch.manual_seed(0)
    model, x = CachedNoise(noise_table, saved), torch.randn(8, 16)
    if warmed:
        noise_table(8, 16)
    region = _one_region(model, x, tmp_path, clean=warmed)
    if region is None:
        return
    assert (region.cause.kind, region.cause.mechanism) == ("rng", "one_pass_draw"), region.cause
    assert region.cause.tensor.startswith("aten.randn.default at ") and "in noise_table" in region.cause.tensor
    assert "which the recompute did not run" in region.cause.detail and "aten.bernoulli_" in region.cause.detail
    fix = region.suggestions[0]
    assert fix.title.startswith("Make the value aten.randn.default") and "noise_table(...)" in fix.code
    assert not any("drawing device" in s.text for s in region.suggestions)


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.act, self.down = nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)

    def forward(self, x):
        return x + self.down(self.act(self.up(x)))


@pytest.mark.parametrize("watch", [False, True])
@pytest.mark.parametrize("removed_before_backward", [False, True])
def test_a_probe_hook_left_on_until_after_the_backward(watch, removed_before_backward, tmp_path):
    """A unit-ablation probe: a forward hook zeroes half the hidden units while the probe's no-grad forward scores
    them. Removed in the step's `finally`, after the backward, the recompute runs it too."""
    torch.manual_seed(0)
    model, mask = Mlp(), torch.cat([torch.zeros(8), torch.ones(8)])
    options = {"watch": True, "watch_full_steps": 1} if watch else {}
    with ac_diff.record(tmp_path / "t.jsonl", **options):
        for step in range(2):
            x = torch.randn(4, 8)
            loss = cp.checkpoint(model, x, use_reentrant=False).pow(2).mean()
            handle = model.act.register_forward_hook(lambda m, i, o: o * mask) if step == 1 else None
            if handle is not None:
                with torch.no_grad():
                    model(x)  # the probe
                if removed_before_backward:
                    handle.remove()
            try:
                loss.backward()  # the hook's multiply saves its mask: the recompute saves one tensor more
            except cp.CheckpointError:
                assert not removed_before_backward
            finally:
                if handle is not None and not removed_before_backward:
                    handle.remove()
    report = ac_diff.diagnose_paths([tmp_path / "t.jsonl"])
    if removed_before_backward:
        assert report.verdict == "clean", report.headline
        return
    region = report.regions[1]
    assert region.watched is watch and region.status == "diverged", report.headline
    assert (region.cause.kind, region.cause.mechanism) == ("control_flow", "hooks"), region.cause
    assert "was registered between the forward and the backward (act: <lambda> (test_branch_causes.py:" \
        in region.cause.detail
    assert region.suggestions[0].title.startswith("Register and remove module hooks between steps")


def test_pruning_again_before_the_backward_is_the_mask_not_the_hook(tmp_path):
    """torch.nn.utils.prune applied a second time swaps the module's pruning hook for a PruningContainer that runs
    the same ops: what differs is the mask buffer it multiplies by, so the cause names the mask."""
    from torch.nn.utils import prune

    torch.manual_seed(0)
    model = Mlp()
    prune.l1_unstructured(model.up, "weight", amount=0.2)
    with ac_diff.record(tmp_path / "t.jsonl"):
        loss = cp.checkpoint(model, torch.randn(4, 8), use_reentrant=False).pow(2).mean()
        prune.l1_unstructured(model.up, "weight", amount=0.2)  # the schedule, before the backward
        loss.backward()
    region = ac_diff.diagnose_paths([tmp_path / "t.jsonl"]).regions[0]
    assert region.status == "diverged" and region.state_changes["hooks"], region.state_changes
    assert (region.cause.kind, region.cause.tensor) == ("state_mutation", "up.weight_mask"), region.cause


class RoutedBlock(nn.Module):
    """A router whose logits a forward hook collects for a load-balancing loss (as Hugging Face's MoE models do), or
    for logging, detached."""

    def __init__(self, collected: list, detach: bool, counts: bool = False, amax: bool = False) -> None:
        super().__init__()
        self.router, self.expert = nn.Linear(8, 4), nn.Linear(8, 8)
        self.router.register_forward_hook(lambda m, i, out: collected.append(
            torch.bincount(out.argmax(-1), minlength=4).float() if counts else out.detach().abs().max() if amax
            else out.detach() if detach else out))

    def forward(self, x):
        gate = self.router(x).softmax(-1).max(-1, keepdim=True).values
        return x + gate * self.expert(x)


@pytest.mark.parametrize("case", ["aux_loss", "autocast_aux_loss", "logged_detached", "autocast_logged_detached",
                                  "expert_counts", "amax_of_detached", "non_reentrant"])
def test_a_reentrant_regions_side_output_is_never_clean(case, tmp_path):
    """The router logits leave the reentrant region through the hook's list, made under no_grad: the aux loss
    computed from them trains nothing (the router gets no gradient from it), yet the recompute reproduces the forward
    exactly; under autocast too. Clean: detached on purpose for logging; the per-expert counts of the chosen experts
    (made from integer indices: no gradient could reach them in any run); a statistic computed from a detached copy
    (fp8's amax, `out.detach().abs().max()`: it was held at risk); checkpointed with use_reentrant=False; and under
    autocast, its cache of the weights' and input's casts, which outlive the region until the context ends."""
    torch.manual_seed(0)
    collected: list = []
    model = RoutedBlock(collected, detach="detached" in case, counts=case == "expert_counts", amax="amax" in case)
    x = torch.randn(6, 8, requires_grad=True)
    autocast = torch.autocast("cpu", torch.bfloat16) if "autocast" in case else contextlib.nullcontext()
    with ac_diff.record(tmp_path / "t.jsonl"):
        with autocast:
            y = cp.checkpoint(model, x, use_reentrant=case != "non_reentrant")
        aux = sum(logits.softmax(-1).pow(2).sum() for logits in collected)
        (y.float().pow(2).mean() + 0.1 * aux).backward()
    report = ac_diff.diagnose_paths([tmp_path / "t.jsonl"])
    if not case.endswith("aux_loss"):
        assert report.verdict == "clean", report.headline
        return
    assert not collected[0].requires_grad  # what makes the aux loss train nothing
    assert (report.verdict, report.title) == ("unchecked", "GRADIENTS AT RISK"), report.headline
    region = report.regions[0]
    assert (region.cause.kind, region.cause.mechanism) == ("lost_gradient", "side_output"), region.cause
    assert region.cause.tensor == "aten.addmm.default" and "router" in region.cause.detail
    assert region.suggestions[0].title.startswith("Use use_reentrant=False")


def test_watched_regions_of_a_module_at_risk_are_not_called_clean(tmp_path):
    """Watch mode records the first step in full (the side output found there) and then compares the same module's
    reentrant regions by their outputs, which a side output does not change: the headline says they carry the risk
    too, not "1 other region(s) clean"."""
    torch.manual_seed(0)
    collected: list = []
    model = RoutedBlock(collected, detach=False, counts=False)
    with ac_diff.record(tmp_path / "t.jsonl", watch=True, watch_full_steps=1):
        for _ in range(3):
            collected.clear()
            y = cp.checkpoint(model, torch.randn(6, 8, requires_grad=True), use_reentrant=True)
            (y.pow(2).mean() + 0.1 * sum(c.softmax(-1).pow(2).sum() for c in collected)).backward()
    report = ac_diff.diagnose_paths([tmp_path / "t.jsonl"])
    assert report.title == "GRADIENTS AT RISK", report.headline
    assert "other region(s) clean" not in report.headline, report.headline
    assert "watched region(s) of those modules carry it too" in report.headline, report.headline


def test_every_region_of_a_module_that_hands_out_a_side_output_is_at_risk_written_in_full_or_not(tmp_path):
    """The recorder writes a module's first region with a given side output in full and summarizes the later ones
    that reproduced (write="diverged"): those read clean, while the same script written with write="all" read at
    risk in every region."""
    torch.manual_seed(0)
    collected: list = []
    model = RoutedBlock(collected, detach=False)
    statuses = {}
    for write in ("diverged", "all"):
        with ac_diff.record(tmp_path / f"{write}.jsonl", write=write):
            for _ in range(4):
                collected.clear()
                y = cp.checkpoint(model, torch.randn(6, 8, requires_grad=True), use_reentrant=True)
                (y.pow(2).mean() + 0.1 * sum(c.softmax(-1).pow(2).sum() for c in collected)).backward()
        report = ac_diff.diagnose_paths([tmp_path / f"{write}.jsonl"])
        statuses[write] = [(r.status, r.unchecked_reason) for r in report.regions]
    assert statuses["diverged"] == statuses["all"] == [("unchecked", "reproduced; a side output carries no gradient")] \
        * 4, statuses


ROUTER_LOGITS: list = []  # a module-level list a router fills for the load-balancing loss


class GlobalRouter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router, self.expert = nn.Linear(8, 4), nn.Linear(8, 8)

    def forward(self, x):
        logits = self.router(x)
        ROUTER_LOGITS.append(logits)
        return x + logits.softmax(-1).max(-1, keepdim=True).values * self.expert(x)


@pytest.mark.parametrize("holder", ["prune", "global_list"])
def test_a_side_output_names_the_attribute_or_global_that_keeps_it(holder, tmp_path):
    """torch.nn.utils.prune's forward pre-hook sets `fc.weight = weight_orig * weight_mask` at every call: under
    use_reentrant=True that tensor, made under no_grad, outlives the region as a module attribute; router logits kept
    in a module-level list the same way. The report names where it is kept, not "a list a hook fills, a module
    attribute"."""
    from torch.nn.utils import prune

    torch.manual_seed(0)
    if holder == "prune":
        model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        prune.l1_unstructured(model[0], "weight", amount=0.3)
        expected = "0.weight"
    else:
        model, expected = GlobalRouter(), "test_branch_causes.ROUTER_LOGITS[0]"
        ROUTER_LOGITS.clear()
    with ac_diff.record(tmp_path / "t.jsonl"):
        y = cp.checkpoint(model, torch.randn(6, 8, requires_grad=True), use_reentrant=True)
        y.pow(2).mean().backward()
    ROUTER_LOGITS.clear()
    region = ac_diff.diagnose_paths([tmp_path / "t.jsonl"]).regions[0]
    assert (region.cause.kind, region.cause.mechanism) == ("lost_gradient", "side_output"), region.cause
    assert f"kept as `{expected}`" in region.cause.detail, region.cause.detail
    assert f"kept as `{expected}`" in region.cause.evidence[0], region.cause.evidence


class OptionalNorm(nn.Module):
    """A curriculum flag that turns on a LayerNorm in front of the block."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.ln, self.use_norm = nn.Linear(8, 8), nn.LayerNorm(8), False

    def forward(self, x):
        if self.use_norm:
            x = self.ln(x)
        return x + torch.relu(self.fc(x))


def test_a_branch_whose_first_op_ends_the_recompute_names_the_attribute(tmp_path):
    """The flag is switched on between the forward and the backward. The forward saved three tensors; the recompute's
    first op, the LayerNorm it takes now, saves its input, weight and bias before its kernel runs (autograd saves an
    op's inputs first), so torch's early stop ends the recompute there and raises: no op of the recompute reached the
    recorder, and the cause read "unknown". Its saved tensors tell the branch (the forward saved the block's input
    first, the recompute the norm's bias), and the attribute that changed is named."""
    torch.manual_seed(0)
    model = OptionalNorm()
    with ac_diff.record(tmp_path / "t.jsonl"):
        y = cp.checkpoint(model, torch.randn(4, 8, requires_grad=True), use_reentrant=False)
        model.use_norm = True
        with pytest.raises(cp.CheckpointError):
            y.sum().backward()
    region = ac_diff.diagnose_paths([tmp_path / "t.jsonl"]).regions[0]
    assert region.status == "diverged"
    assert (region.cause.kind, region.cause.mechanism) == ("control_flow", "attribute"), region.cause
    assert region.cause.tensor.endswith("use_norm"), region.cause
    assert "position 0: input[0] in the forward" in region.cause.detail and "ln.bias" in region.cause.detail
    assert region.suggestions[0].title.startswith("Change `") and "use_norm" in region.suggestions[0].title


class EnvNorm(OptionalNorm):
    def forward(self, x):
        if os.environ.get("AC_DIFF_TEST_NORM") == "1":  # a switch no recorded Python state shows
            x = self.ln(x)
        return x + torch.relu(self.fc(x))


def test_a_branch_on_state_nothing_records_whose_first_op_ends_the_recompute_is_control_flow(tmp_path, monkeypatch):
    """The same branch, switched by an environment variable: nothing recorded names the switch, but the saved
    tensors show that Python took another branch (it read "unknown: no recorded evidence")."""
    torch.manual_seed(0)
    model = EnvNorm()
    monkeypatch.setenv("AC_DIFF_TEST_NORM", "0")
    with ac_diff.record(tmp_path / "t.jsonl"):
        y = cp.checkpoint(model, torch.randn(4, 8, requires_grad=True), use_reentrant=False)
        monkeypatch.setenv("AC_DIFF_TEST_NORM", "1")
        with pytest.raises(cp.CheckpointError):
            y.sum().backward()
    region = ac_diff.diagnose_paths([tmp_path / "t.jsonl"]).regions[0]
    assert region.cause.kind == "control_flow", region.cause
    assert "before it ran any op (position 0: input[0] in the forward, ln.bias in the recompute)" \
        in region.cause.detail, region.cause.detail


class TwoKernels(nn.Module):
    """Attention scores by matmul or by einsum (a profiling switch), normalized by `1 + |sum|`: the two paths give
    bit-identical values here."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(24, 24), nn.Linear(24, 24), nn.Linear(24, 24)
        self.use_einsum = False

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        a = torch.einsum("btd,bsd->bts", q, k) if self.use_einsum else q @ k.transpose(1, 2)
        o = a.softmax(-1) @ v
        return x + o / (1 + o.sum().abs())


def test_another_path_to_the_same_saved_tensors_is_clean_not_a_tail_mismatch(tmp_path):
    """The switch flips between the forward and the backward: the recompute runs einsum's permutes, saves the same
    tensors bit for bit, and stops (torch's early stop) at its last saved tensor, `1 + |sum|`, an add. Aligned with
    the forward's last op, the residual add (another add) it never reached, it read as a shape divergence of the
    region's output and SILENTLY DIVERGED, with gradients bit-identical. Now the forward's tail is left unmatched."""
    torch.manual_seed(0)
    model, x = TwoKernels(), torch.randn(4, 9, 24, requires_grad=True)
    plain = cp.checkpoint(model, x, use_reentrant=False)
    plain.pow(2).mean().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with ac_diff.record(tmp_path / "t.jsonl"):
        y = cp.checkpoint(model, x, use_reentrant=False)
        model.use_einsum = True
        y.pow(2).mean().backward()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), expected))  # (the truth: identical)
    report = ac_diff.diagnose_paths([tmp_path / "t.jsonl"])
    assert report.verdict == "clean", report.headline
    assert any("ran in the forward only" in n and "every saved tensor matched" in n for n in report.regions[0].notes)


class _Holder:
    emb = None  # the time embedding the blocks share (a diffusion UNet's stages reach it through a holder)


class _EmbBlock(nn.Module):
    def __init__(self, holder: _Holder) -> None:
        super().__init__()
        self.fc, self.proj, self.holder = nn.Linear(8, 8), nn.Linear(4, 8), holder

    def forward(self, x):
        return x + torch.tanh(self.fc(x) + self.proj(self.holder.emb))


def test_reentrant_regions_that_read_a_shared_tensor_with_a_graph_explain_the_backward_that_raises(tmp_path):
    """Each block reads the time embedding from a holder, not as an argument of checkpoint: under use_reentrant=True
    the first block's own backward runs on into the embedding's graph and frees it, and the next one raises "Trying to
    backward through the graph a second time". The crash said only that; it now names the tensor (`holder.emb`, not
    "the captured tensor external[0]") and the fix."""
    torch.manual_seed(0)
    holder = _Holder()
    embed, blocks = nn.Sequential(nn.Linear(1, 4), nn.SiLU()), nn.ModuleList(_EmbBlock(holder) for _ in range(2))
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        with ac_diff.record(tmp_path / "t.jsonl"):
            holder.emb = embed(torch.rand(6, 1))
            x = torch.randn(6, 8, requires_grad=True)
            for block in blocks:
                x = cp.checkpoint(block, x, use_reentrant=True)
            x.sum().backward()
    report = ac_diff.diagnose_paths([tmp_path / "t.jsonl"])
    assert "why: reentrant regions read `holder.emb`" in report.headline, report.headline
    note = report.notes[0]
    assert note.startswith("the backward raised because reentrant regions (blocks.0, blocks.1) read `holder.emb`"), note
    assert "`checkpoint(fn, x, emb)`" in note and "use_reentrant=False" in note, note
