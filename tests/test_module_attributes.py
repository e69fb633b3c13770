"""A module's Python attribute as state: a forward pre-hook counts calls in `self.step`, and a residual
scale computed from it feeds a saved activation. The recompute calls the module (and the hook) again, so
it computes with step 1 where the forward used 0: the cause is the attribute, counted twice, not "an
argument of aten.mul.Tensor". Recording the attributes changes nothing in the training.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import ac_diff
from ac_diff.report import STATE_READ_AGAIN
from ac_diff.trace import read_run


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.step = 0
        self.name = "residual"
        self.register_forward_pre_hook(Block.bump_step)

    @staticmethod
    def bump_step(module, args):
        module.step += 1

    def forward(self, x):
        scale = 1.0 / (1 + 0.1 * self.step)  # a residual scale warmed up over the steps
        return torch.tanh(x + scale * self.fc(x))


class Net(nn.Module):
    def __init__(self, ac: bool = True) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(2)])
        self.ac = ac

    def forward(self, x):
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.ac else block(x)
        return x


def _step(net: Net):
    torch.manual_seed(1)
    x = torch.randn(4, 8, requires_grad=True)
    loss = net(x).pow(2).sum()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in net.parameters()] + [x.grad]


def test_a_pre_hook_counter_is_named_as_the_cause_counted_twice(tmp_path):
    torch.manual_seed(0)
    plain = _step(Net())
    torch.manual_seed(0)
    net = Net()
    with ac_diff.record(tmp_path / "trace-rank0.jsonl"):
        recorded = _step(net)
    assert torch.equal(plain[0], recorded[0]) and all(torch.equal(a, b) for a, b in zip(plain[1], recorded[1]))
    assert [b.step for b in net.blocks] == [2, 2]  # forward + recompute: the user's own state, untouched

    region = read_run(tmp_path / "trace-rank0.jsonl").regions[0]
    assert region.forward.attributes["blocks.0.step"] == 0 and region.recompute.attributes["blocks.0.step"] == 1
    assert region.forward.attributes["blocks.0.name"] == "residual"
    assert region.forward.attribute_updates["blocks.0.step"][:2] == [0, 1]

    report = ac_diff.diagnose_paths([str(tmp_path)]).to_json()
    first = report["regions"][0]
    assert first["status"] == "diverged"
    cause = first["cause"]
    assert cause["kind"] == "state_mutation" and cause["tensor"] == "blocks.0.step"
    assert "counts twice" in cause["detail"] and "(by its forward pre-hook `Block.bump_step` or" in cause["detail"]
    assert any("0 -> 1 in the forward, 1 -> 2 in the recompute" in e for e in cause["evidence"])
    assert first["suggestions"][0]["title"].startswith("Do not update `blocks.0.step`")


def test_an_attribute_the_region_only_reads_is_no_cause_when_nothing_diverges(tmp_path):
    net = Net()
    for block in net.blocks:  # the counter moves once per step, outside the region: nothing to report
        block._forward_pre_hooks.clear()
    with ac_diff.record(tmp_path / "trace-rank0.jsonl"):
        _step(net)
    report = ac_diff.diagnose_paths([str(tmp_path)]).to_json()
    assert report["verdict"] == "clean", report["headline"]


class LazyBlock(Block):
    """The counter does not exist before the first call: the pre-hook creates it (`getattr(module, "step", 0) + 1`)."""

    def __init__(self) -> None:
        super().__init__()
        del self.step
        self._forward_pre_hooks.clear()
        self.register_forward_pre_hook(LazyBlock.bump_lazily)

    @staticmethod
    def bump_lazily(module, args):
        module.step = getattr(module, "step", 0) + 1

    def forward(self, x):
        scale = 1.0 / (1 + 0.1 * self.step)
        return torch.tanh(x + scale * self.fc(x))


def test_a_counter_the_first_call_creates_is_named_too(tmp_path):
    """In the first step the attribute is made by the forward's call (unset before it), then updated by the
    recompute's: the same counted-twice cause as in later steps, not an unexplained Python argument."""
    torch.manual_seed(0)
    net = Net()
    net.blocks = nn.ModuleList([LazyBlock() for _ in range(2)])
    with ac_diff.record(tmp_path / "trace-rank0.jsonl"):
        _step(net)
    region = read_run(tmp_path / "trace-rank0.jsonl").regions[0]
    assert region.forward.attribute_updates["blocks.0.step"][:2] == [{"unset": True}, 1]
    cause = ac_diff.diagnose_paths([str(tmp_path)]).to_json()["regions"][0]["cause"]
    assert cause["kind"] == "state_mutation" and cause["tensor"] == "blocks.0.step", cause
    assert "was unset in the forward and 1 in the recompute" in cause["detail"] and "counts twice" in cause["detail"]


class SdpaBlock(nn.Module):
    """Attention that hands its dropout module's `p` to the fused kernel and never calls that module (as HF's SDPA
    attention does): its probability is read by the parent's code."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.dropout = nn.Linear(8, 24), nn.Dropout(0.1)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        p = self.dropout.p if self.training else 0.0
        return x + nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=p)


def test_an_annealed_probability_of_a_dropout_module_never_called_is_named(tmp_path):
    """A dropout schedule sets every nn.Dropout's `p` for the next step before the backward: the recompute draws with
    another probability. The changed `p` belongs to a module the region never calls; it was reported as "a Python
    value passed to aten.bernoulli_.float"."""
    torch.manual_seed(0)
    block = SdpaBlock()
    with ac_diff.record(tmp_path / "trace-rank0.jsonl"):
        loss = checkpoint(block, torch.randn(2, 5, 8, requires_grad=True), use_reentrant=False).pow(2).sum()
        for m in block.modules():
            if isinstance(m, nn.Dropout):
                m.p = 0.08  # the next step's probability
        loss.backward()
    report = ac_diff.diagnose_paths([tmp_path])
    lead = report.lead_groups()[0][0]
    assert report.verdict == "diverged" and lead.cause.kind == "state_mutation", report.headline
    assert lead.cause.tensor == "dropout.p", lead.cause  # (named as the module would name it, were it called)
    assert "0.1 in the forward and 0.08 in the recompute" in lead.cause.detail


class CastBlock(nn.Module):
    """Computes in `self.compute_dtype` (a mixed-precision switch a training loop flips)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.compute_dtype = torch.float32

    def forward(self, x):
        return torch.tanh(self.fc(x.to(self.compute_dtype)).float())


def test_a_dtype_attribute_changed_before_the_backward_is_named(tmp_path):
    """`self.compute_dtype` switched to bfloat16 between the forward and the backward: the recompute casts where the
    forward did not. The cause names the attribute and both dtypes (it said only "Python code took another branch":
    a dtype was no value the recorder kept)."""
    torch.manual_seed(0)
    block, path = CastBlock(), tmp_path / "t.jsonl"
    with ac_diff.record(path):
        y = checkpoint(block, torch.randn(2, 8, requires_grad=True), use_reentrant=False)
        block.compute_dtype = torch.bfloat16
        try:
            y.sum().backward()
        except Exception:  # noqa: BLE001 - (torch's check, or the bf16 linear meeting f32 weights: either way)
            pass
    region = ac_diff.diagnose_paths([path]).regions[0]
    assert region.status == "diverged"
    assert "compute_dtype` was 'torch.float32' in the forward and 'torch.bfloat16'" in region.cause.detail, \
        region.cause


def _warmup_hook(warm: int):
    """A monitoring-style forward pre-hook that warms its module's input up over its first calls, counting them in
    its own closure."""
    calls = 0

    def warmup(module, args):
        nonlocal calls
        calls += 1
        return (args[0] * min(1.0, calls / warm),)
    return warmup


def test_a_counter_a_hook_keeps_in_its_closure_is_named_with_its_hook(tmp_path):
    """The recompute calls the module and its pre-hook again, so the closure's counter moves and the input scale
    with it: the cause names the variable, the hook and its module, counted twice (it said "a Python value passed to
    aten.mul.Tensor changed"), and the fix is about the hook, not a restore that has nothing to restore."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    block[0].register_forward_pre_hook(_warmup_hook(warm=10))
    path = tmp_path / "t.jsonl"
    with ac_diff.record(path):
        for _ in range(2):
            checkpoint(block, torch.randn(2, 8, requires_grad=True), use_reentrant=False).sum().backward()
    report = ac_diff.diagnose_paths([path])
    region = report.regions[0]
    assert region.status == "diverged" and region.silent
    cause = region.cause
    assert "`calls`, which the forward pre-hook `warmup` of 0 keeps in its closure" in cause.detail, cause.detail
    assert "counts twice" in cause.detail
    assert region.suggestions[0].title.startswith("Do not count `calls` in the forward pre-hook `warmup` of 0")
    from ac_diff.fix.candidates import candidates

    restore = next(c for c in candidates(report) if c.kind == "restore")  # (the closure's cell is restored)
    assert restore.spec.restore == ["*.<forward pre-hook warmup>.calls"], restore.spec
    assert restore.change[0] == region.suggestions[0].title  # (the code it simulates: the diagnosis's own)


def _halving_until(limit: int):
    """A warmup pre-hook that halves its module's input for its first `limit` calls, counted in its closure."""
    calls = 0

    def warmup(module, args):
        nonlocal calls
        calls += 1
        return (args[0] * (0.5 if calls <= limit else 1.0),)
    return warmup


def _halved_grads(checkpointed: bool, path=None) -> list:
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    block[0].register_forward_pre_hook(_halving_until(4))
    grads = []
    with ac_diff.record(path) if path else contextlib.nullcontext():
        for _ in range(3):
            x = torch.randn(2, 8, requires_grad=True)
            (checkpoint(block, x, use_reentrant=False) if checkpointed else block(x)).sum().backward()
            grads.append([p.grad.clone() for p in block.parameters()])
            block.zero_grad()
    return grads


def test_a_closure_counter_its_hook_reads_crossing_its_threshold_between_steps_puts_gradients_at_risk(tmp_path):
    """Under AC the hook runs twice a step: calls 1, 2 | 3, 4 | 5, 6 against 1 | 2 | 3 without AC. Each step's two
    passes agree (both halve, then both do not), so every region reproduces its forward; step 3's gradients differ
    all the same. The hook reads its count beyond counting it: never clean (it said CLEAN, `fix` "nothing to fix")."""
    from ac_diff.capture.pystate import hook_reads_again

    path = tmp_path / "t.jsonl"
    with_ac, without = _halved_grads(True, path), _halved_grads(False)
    assert [all(torch.equal(a, b) for a, b in zip(x, y)) for x, y in zip(with_ac, without)] == [True, True, False]
    report = ac_diff.diagnose_paths([path])
    assert (report.verdict, report.title) == ("unchecked", "GRADIENTS AT RISK"), report.headline
    assert "<forward pre-hook warmup>.calls" in report.headline and "--reference-steps 3`" in report.headline
    block = nn.Linear(2, 2)
    block.register_forward_pre_hook(_halving_until(4))
    block.register_forward_pre_hook(_warmup_hook(4))
    counting = nn.Linear(2, 2)
    counting.register_forward_pre_hook(_counting_hook())
    assert hook_reads_again(block, "<forward pre-hook warmup>.calls")
    assert not hook_reads_again(counting, "<forward pre-hook count>.calls")


def _counting_hook():
    """A hook that only counts (for a log line elsewhere): its count is never read by the hook itself."""
    calls = 0

    def count(module, args):
        nonlocal calls
        calls += 1
    return count


class Gated(nn.Module):
    """A residual gate `alpha` that a warmup pre-hook sets at each call from the calls it counts in its closure."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.alpha = nn.Linear(8, 8), 0.0

    def forward(self, x):
        return x + torch.tanh(self.alpha * self.fc(x))


def _gate_warmup():
    calls = 0

    def warmup(module, args):
        nonlocal calls
        calls += 1
        module.alpha = min(1.0, calls / 10)
    return warmup


def test_an_attribute_a_counting_pre_hook_sets_is_explained_by_the_count(tmp_path):
    """The pre-hook sets `alpha` from its closure's count: the cause is the count the recompute advances again, and
    `alpha` holds the values each pass computed with (0.1, 0.2; it said 0.0 and 0.1, the values before each pass,
    and named `alpha` only: its fix moved `alpha += 0.1` out of the region, which the hook undoes)."""
    torch.manual_seed(0)
    block = Gated()
    block.register_forward_pre_hook(_gate_warmup())
    path = tmp_path / "t.jsonl"
    with ac_diff.record(path):
        checkpoint(block, torch.randn(2, 8, requires_grad=True), use_reentrant=False).sum().backward()
    region = ac_diff.diagnose_paths([path]).regions[0]
    assert region.status == "diverged"
    cause = region.cause
    assert cause.tensor == "Gated.<forward pre-hook warmup>.calls", cause
    assert cause.names == ["Gated.<forward pre-hook warmup>.calls", "Gated.alpha"], cause.names
    assert "`Gated.alpha` was 0.1 in the forward and 0.2 in the recompute: Gated's forward pre-hook `warmup` " \
        "sets it at each call from `calls`" in cause.detail, cause.detail
    assert region.suggestions[0].title.startswith("Do not count `calls` in the forward pre-hook `warmup`")
    assert "    if not IN_BACKWARD:  # the recompute reuses the count its forward reached\n        calls += 1" in \
        region.suggestions[0].code, region.suggestions[0].code


class LazyRotary(nn.Module):
    """Rotary tables built lazily for the longest sequence seen so far, their base scaled with the length
    (dynamic NTK): a longer micro-batch rebuilds them."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.cached_len = 0
        self.register_buffer("cos_cached", torch.zeros(0, 8), persistent=False)

    def forward(self, x):
        n = x.shape[0]
        if n > self.cached_len:
            with torch.no_grad():
                base = 10000.0 * n / 16
                pos = torch.arange(n, dtype=torch.float32)[:, None] / base ** (torch.arange(8) / 8)
                self.cos_cached, self.cached_len = pos.cos(), n
        return torch.tanh(self.proj(x) * self.cos_cached[:n])


def test_a_cache_a_later_micro_batch_rebuilds_is_said_to_be_rebuilt(tmp_path):
    """Two micro-batches' forwards, then their backwards: the second, longer one rebuilds the rotary tables the
    first region's recompute then reads. The cause says the forward set `cached_len` and a later forward set it
    again (it said "changed between the forward and the backward", with a fix to change it after the backward)."""
    torch.manual_seed(0)
    rotary, path = LazyRotary(), tmp_path / "t.jsonl"
    with ac_diff.record(path):
        losses = [checkpoint(rotary, torch.randn(n, 8, requires_grad=True), use_reentrant=False).sum()
                  for n in (16, 24)]
        sum(losses).backward()
    region = next(r for r in ac_diff.diagnose_paths([path]).regions if r.region == 0)
    assert region.status == "diverged"
    assert "set it (0 -> 16" in region.cause.detail and "set again (16 -> 24)" in region.cause.detail, region.cause
    assert region.suggestions[0].title.startswith("Build what sets `LazyRotary.cached_len` once")


class _AttentionConfig:
    """A model config as Hugging Face keeps it: the attention implementation in a private field."""

    def __init__(self) -> None:
        self.hidden = 8
        self._attn_implementation_internal = "sdpa"


class ConfiguredAttention(nn.Module):
    def __init__(self, config: _AttentionConfig) -> None:
        super().__init__()
        self.config, self.proj = config, nn.Linear(8, 8)

    def forward(self, x):
        h = self.proj(x)
        if self.config._attn_implementation_internal == "eager":
            return torch.softmax(h, -1) * h
        return torch.tanh(h)


def test_a_private_field_of_the_config_a_module_holds_is_named(tmp_path):
    """`config._attn_implementation = "eager"` between the forward and the backward (a callback preparing an
    evaluation): the field is named (private config fields were not recorded: "Python code took another branch")."""
    torch.manual_seed(0)
    config = _AttentionConfig()
    block, path = ConfiguredAttention(config), tmp_path / "t.jsonl"
    with ac_diff.record(path):
        y = checkpoint(block, torch.randn(2, 8, requires_grad=True), use_reentrant=False)
        config._attn_implementation_internal = "eager"
        y.sum().backward()
    cause = ac_diff.diagnose_paths([path]).regions[0].cause
    assert cause.tensor == "ConfiguredAttention.config._attn_implementation_internal", cause
    assert "was 'sdpa' in the forward and 'eager' in the recompute" in cause.detail


def test_a_compilers_graph_module_keeps_no_attributes_of_the_users():
    """A GraphModule a compiler runs inside a compiled block (aot_eager's) takes its caller's name; its attributes
    (`_lineno_map`, which grows when Dynamo recompiles on a guard) are the compiler's: they are not read as the
    block's state (a stranger's compiled block led with `mix.1._lineno_map` instead of its `tau`)."""
    from ac_diff.capture.pystate import module_attributes

    graph = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(4, 4), nn.Tanh()))
    graph.tau = 0.9
    assert "_lineno_map" in vars(graph) or hasattr(graph, "_code")  # (what a compiler's graph carries)
    assert module_attributes(graph) == {}
    block = nn.Linear(4, 4)
    block.tau = 0.9
    assert module_attributes(block)["tau"] == 0.9


def _checkpoint_each(blocks, x):
    """A plain function running the blocks (no parent module is called: its hooks never see them)."""
    for block in blocks:
        x = checkpoint(block, x, use_reentrant=False)
    return x


def test_blocks_run_from_a_plain_function_are_named_by_the_model_that_holds_them(tmp_path):
    """The regions are named by their path in the model the caller holds (`0`, `1`, `2`), not all by their class
    (every region read `Block`, and the three could not be told apart)."""
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3)])
    path = tmp_path / "t.jsonl"
    with ac_diff.record(path):
        _checkpoint_each(net, torch.randn(2, 8, requires_grad=True)).sum().backward()
    assert [r.module for r in read_run(path).regions] == ["0", "1", "2"]


class _CallCounter:
    """A forward pre-hook that is an object, not a function (a profiler's, a monitoring library's)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, module, args):
        self.calls += 1


def test_a_hook_that_is_an_object_costs_nothing_recorded(tmp_path):
    """A callable object as a forward pre-hook has no closure to read: the recorder reads the module's attributes as
    ever, loses nothing, and the clean region stays clean (reading its closure raised inside the recorder, and every
    region with such a hook lost its attributes to a recorder error)."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    block[0].register_forward_pre_hook(_CallCounter())
    path = tmp_path / "t.jsonl"
    with ac_diff.record(path) as rec:
        checkpoint(block, torch.randn(2, 8, requires_grad=True), use_reentrant=False).sum().backward()
    assert rec.errors == []
    assert ac_diff.diagnose_paths([path]).verdict == "clean"


def _scaled_tanh(h):
    """A checkpointed plain function that calls no module."""
    return torch.tanh(h) * 2


class CallsAFunction(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return checkpoint(_scaled_tanh, self.proj(x), use_reentrant=False)


def test_a_checkpointed_function_that_calls_no_module_is_told_from_its_caller(tmp_path):
    """The function's region is named by the module that called it, as the module's own region is: the report
    shows which function it was ("blocks.0 (attention)"; both read "blocks.0")."""
    torch.manual_seed(0)
    net, path = nn.Sequential(CallsAFunction()), tmp_path / "t.jsonl"
    with ac_diff.record(path):
        checkpoint(net[0], torch.randn(2, 8, requires_grad=True), use_reentrant=False).sum().backward()
    regions = ac_diff.diagnose_paths([path]).regions
    assert sorted(r.label for r in regions) == ["0", "0 (_scaled_tanh)"], [r.label for r in regions]


class ClippedAttention(nn.Module):
    """QK-clip: a monitor keeps the largest attention logit of the step (`max_logit`, written in the forward, read by
    nothing but the loop), and the loop lowers `logit_scale` after the forward when it passed a threshold."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.qkv, self.o = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.logit_scale, self.max_logit = dim ** -0.5, 0.0

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        a = (q @ k.transpose(-1, -2)) * self.logit_scale
        self.max_logit = max(self.max_logit, float(a.detach().amax()))
        return self.o(a.softmax(-1) @ v)


def test_the_attribute_passed_to_the_op_is_the_cause_not_a_monitor_the_forward_writes(tmp_path):
    """Where the scale changed and the monitor's value differs too, the cause is the scale: its two values are the
    argument that differs at the first divergent op; the monitor is only written."""
    torch.manual_seed(0)
    layers = nn.ModuleList(ClippedAttention() for _ in range(2))
    with ac_diff.record(tmp_path / "t.jsonl"):
        for _ in range(4):
            h = torch.randn(4, 6, 16) * 3
            for layer in layers:
                h = checkpoint(layer, h, use_reentrant=False)
            loss = h.pow(2).mean()
            for layer in layers:  # the clip, between the forward and the backward
                if layer.max_logit > 1.2:
                    layer.logit_scale *= 1.2 / layer.max_logit
                layer.max_logit = 0.0
            loss.backward()
    report = ac_diff.diagnose_paths([tmp_path / "t.jsonl"])
    diverged = [r for r in report.regions if r.status == "diverged"]
    assert len(diverged) >= 3 and all(r.cause.tensor.endswith(".logit_scale") for r in diverged), \
        [(r.region, r.cause.tensor) for r in diverged]


class FadeIn(nn.Module):
    """ProGAN's fade-in: a counter of the images seen, advanced by the forward, sets how much of the new layer is
    blended in. The blend weight enters only as a number the forward's graph keeps, so every recompute reproduces
    its saved tensors; but under AC the recompute advances the counter again, and later steps blend with another
    weight than a run without AC."""

    def __init__(self) -> None:
        super().__init__()
        self.old, self.new = nn.Linear(8, 8), nn.Linear(8, 8)
        self.imgs_seen = 0

    def forward(self, x):
        self.imgs_seen += x.shape[0]
        alpha = min(1.0, self.imgs_seen / 64)
        return (1 - alpha) * self.old(x) + alpha * torch.tanh(self.new(x))


class CountedCalls(nn.Module):
    """A block that counts its calls for a log line, and reads the count nowhere else."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return torch.tanh(self.lin(x))


def test_a_counter_the_recompute_advances_again_and_the_region_reads_is_never_clean(tmp_path):
    """The fade-in's counter advances twice per step under AC, and the blend reads it: the gradients of the next
    steps differ from a run without AC (every recompute reproduced its own forward). Gradients at risk, with the
    counter named and the fix; a counter only logged (below) stays a note on a clean run."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"grow": FadeIn()})
    with ac_diff.record(tmp_path / "t.jsonl"):
        for _ in range(2):
            checkpoint(model["grow"], torch.randn(4, 8), use_reentrant=False).pow(2).sum().backward()
    assert model["grow"].imgs_seen == 16  # twice the 8 images a run without AC counts
    report = ac_diff.diagnose_paths([tmp_path / "t.jsonl"])
    assert (report.verdict, report.title) == ("unchecked", "GRADIENTS AT RISK"), report.headline
    assert "reads state their recompute updates a second time" in report.headline, report.headline
    assert "`model.grow.imgs_seen`" in report.headline
    region = report.regions[0]
    assert region.side_effects == ["model.grow.imgs_seen, a Python attribute, is changed by the region's code in each pass: the "
                                   "recompute runs that code again (counted twice)"], region.side_effects
    assert "model.grow.imgs_seen changed during each pass: 0 -> 4 in the forward, 4 -> 8 in the recompute" in region.notes
    assert (region.cause.kind, region.cause.tensor) == ("state_mutation", "model.grow.imgs_seen")
    fix = region.suggestions[0]  # the blend reads the counted value: the count moves before the forward, not after
    # the backward (a step late: 18c's fade-in trained another schedule than without AC, from step 1)
    assert fix.title == "Update `model.grow.imgs_seen` before the forward that reads it, outside the checkpointed " \
                        "region", fix.title
    assert "their gradients differ from a run without AC" in fix.text
    assert "before the forward that reads it" in fix.code and '("model.grow").imgs_seen += 4' in fix.code, fix.code
    grads = []
    for fixed in (False, True):  # what the fix's code does, against a run without AC
        torch.manual_seed(0)
        block, steps = FadeIn(), [torch.randn(4, 8) for _ in range(3)]
        if fixed:
            counted = block.forward.__func__

            def reads_only(self, x):  # forward() with its `+=` taken out: the loop counts before the forward
                self.imgs_seen -= x.shape[0]
                return counted(self, x)
            block.forward = reads_only.__get__(block)
        for x in steps:
            if fixed:
                block.imgs_seen += 4
                checkpoint(block, x, use_reentrant=False).pow(2).sum().backward()
            else:
                block(x).pow(2).sum().backward()
        grads.append([p.grad.clone() for p in block.parameters()] + [torch.tensor(block.imgs_seen)])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


class LoggedStats(nn.Module):
    """A block that appends a statistic of its activations to a list, for a log line (updated, never read)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.calls, self.stats = 0, []

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        self.calls += 1
        self.stats.append(float(h.abs().mean()))
        return h


@pytest.mark.parametrize("kind", [CountedCalls, LoggedStats])
def test_a_counter_only_logged_is_a_note_on_a_clean_run(tmp_path, kind):
    torch.manual_seed(0)
    block = kind()
    with ac_diff.record(tmp_path / "t.jsonl"):
        for _ in range(2):
            checkpoint(block, torch.randn(4, 8), use_reentrant=False).pow(2).sum().backward()
    assert block.calls == 4
    report = ac_diff.diagnose_paths([tmp_path / "t.jsonl"])
    assert report.verdict == "clean", report.headline
    assert "note: the recompute repeats the updates of" in report.headline and "calls" in report.headline
    assert "though this step's gradients are right" in report.regions[0].suggestions[0].text


def test_a_counter_is_read_again_where_the_code_loads_it_beyond_its_update():
    """`self.calls += 1` loads and stores it once (only counted); a branch or a blend reading it loads it again."""
    from ac_diff.capture.pystate import read_again

    class Branches(nn.Module):
        def forward(self, x):
            self.calls = getattr(self, "calls", 0) + 1
            return x * 2 if self.calls % 2 else x

    class Lazy(nn.Module):
        def forward(self, x):
            self.calls = getattr(self, "calls", 0) + 1
            return x

    class Guarded(nn.Module):  # (read only behind another condition: it may never be)
        def forward(self, x):
            self.calls += 1
            if self.warmup is not None and self.calls < self.warmup:
                return x * 0.5
            return x

    class InTraining(nn.Module):  # (28e: SpecAugment after a warmup; the guard holds whenever it trains)
        def forward(self, x):
            self.num_updates += 1
            if self.training and self.num_updates > 2:
                return x * 0.5
            return x

    class Ramped(nn.Module):  # (28c: counted and read behind one condition: read whenever it counts; `s`, not self)
        def forward(s, x):
            alpha = 1.0
            if s.warm:
                s.calls += 1
                alpha = min(1.0, s.calls / 10)
            return x * alpha

    assert read_again(FadeIn, "imgs_seen") and read_again(Branches, "calls")
    assert not read_again(CountedCalls, "calls") and not read_again(Lazy, "calls")
    assert not read_again(Guarded, "calls")
    assert read_again(InTraining, "num_updates") and read_again(Ramped, "calls")


@pytest.mark.parametrize("before, after, read_again", [(3, 4, True), (0.5, 0.4147, False)])
def test_the_fix_code_for_an_attribute_moves_each_layers_update_as_the_value_it_is(before, after, read_again):
    """A counter of every layer advances by its own step; a float (an EMA kept in Python) by what its update computes:
    the code said `blocks.0.ema += -0.0853`, one observed change as a constant, for the first layer only."""
    from ac_diff.diagnosis.attributes import AttributeChange, update_code

    code = update_code(AttributeChange("blocks.0.ema", after, after, forward_update=[before, after],
                                       recompute_update=[after, after], read_again=read_again))
    assert 'for m in model.get_submodule("blocks"):  # every layer' in code, code
    assert ("    m.ema += 1" in code) if type(before) is int else ("    m.ema = ...  # the update its forward made" in code)
    assert ("before the forward that reads it" in code) == read_again and "-0.08" not in code, code


def _gain_hook(flag: dict, guard: str):
    """A pre-hook that rescales its module's input by a gain that jumps after 2 calls, counting calls in its closure;
    `guard`: "count" leaves the count alone while flag["in_backward"] (the fix ac-diff prints), "hook" skips the hook
    (the fix it printed before), "" neither."""
    calls = 0

    def warmup(module, args):
        nonlocal calls
        if guard == "hook" and flag["in_backward"]:
            return None
        if not (guard == "count" and flag["in_backward"]):
            calls += 1
        return (args[0] * (0.5 if calls <= 2 else 1.0),)
    return warmup


@pytest.mark.parametrize("guard", ["count", "hook"])
def test_the_printed_fix_for_a_counting_pre_hook_keeps_what_the_hook_does(guard):
    """The fix for a count a pre-hook keeps: the recompute reuses the count its forward reached, and the hook still
    rescales the input. Skipping the whole hook in the recompute (the fix printed before) drops the rescaling there:
    its gradients differ from a run without AC from the first step."""
    def grads(checkpointed: bool, guard: str) -> list:
        torch.manual_seed(0)
        block, flag = nn.Sequential(nn.Linear(8, 8), nn.Tanh()), {"in_backward": False}
        block.register_forward_pre_hook(_gain_hook(flag, guard))
        out = []
        for _ in range(4):
            x = torch.randn(2, 8, requires_grad=True)
            y = checkpoint(block, x, use_reentrant=False) if checkpointed else block(x)
            flag["in_backward"] = True
            y.sum().backward()
            flag["in_backward"] = False
            out.append(block[0].weight.grad.clone())
            block.zero_grad()
        return out

    same = all(torch.equal(a, b) for a, b in zip(grads(True, guard), grads(False, "")))
    assert same is (guard == "count")
    assert not all(torch.equal(a, b) for a, b in zip(grads(True, ""), grads(False, "")))  # (the bug it fixes)


class Stashing(nn.Module):
    """fp8's amax or a VQ codebook's statistics stashed in the forward for an update after the step: the forward only
    binds the attribute, from its inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.pending = nn.Linear(8, 8), None

    def forward(self, x):
        y = self.fc(x)
        if self.training:
            self.pending = (y.detach().abs().max(), y.shape[0])
        return torch.tanh(y)


def test_an_attribute_the_forward_only_rebinds_is_not_counted_twice(tmp_path):
    """The recompute binds `pending` again, to the same values: nothing advances twice (it said "the recompute repeats
    the updates of pending ... other than a run without AC" and offered to move the update out of the forward)."""
    from ac_diff.capture.pystate import only_rebinds

    torch.manual_seed(0)
    block, path = Stashing(), tmp_path / "t.jsonl"
    with ac_diff.record(path):
        for _ in range(2):
            checkpoint(block, torch.randn(2, 8, requires_grad=True), use_reentrant=False).sum().backward()
    report = ac_diff.diagnose_paths([path])
    assert report.verdict == "clean" and "repeats the updates" not in report.headline, report.headline
    assert not any(r.side_effects or r.suggestions for r in report.regions)
    assert only_rebinds(Stashing, "pending") and not only_rebinds(Stashing, "fc")
    assert not only_rebinds(FadeIn, "imgs_seen") and not only_rebinds(CountedCalls, "calls")


class GuardedWarmup(nn.Module):
    """Halves its input for its first `warmup` calls; the count is read behind another condition (read_again cannot
    count on that read: a step that reproduces is clean, its update only repeated)."""

    def __init__(self, warmup: int) -> None:
        super().__init__()
        self.fc, self.calls, self.warmup = nn.Linear(8, 8), 0, warmup

    def forward(self, x):
        self.calls += 1
        if self.warmup is not None and self.calls <= self.warmup:
            x = x * 0.5
        return torch.tanh(self.fc(x))


def test_a_divergence_of_a_counted_state_keeps_its_clean_steps_fix_out_of_the_report(tmp_path):
    """Step 1 reproduces (calls 1, 2: both halve), step 2 does not (3 halves, 4 does not): the report leads with step
    2's cause and fix, and no longer also prints step 1's "though this step's gradients are right" fix."""
    from ac_diff.render import render

    torch.manual_seed(0)
    block, path = GuardedWarmup(3), tmp_path / "t.jsonl"
    with ac_diff.record(path):
        for _ in range(2):
            checkpoint(block, torch.randn(2, 8, requires_grad=True), use_reentrant=False).sum().backward()
    report = ac_diff.diagnose_paths([path])
    assert [r.status for r in report.regions] == ["clean", "diverged"], report.headline
    assert report.regions[0].repeated and report.regions[0].suggestions and report.repeating() == []
    render(report, "terminal", path=tmp_path / "r.txt")
    assert "though this step's gradients are right" not in (tmp_path / "r.txt").read_text()


def _curriculum_block(threshold: int):
    """A block class made by a factory whose forward reads and advances a count kept in the factory's dict (a
    closure, no attribute of the module): the count read first, then advanced by two micro-batches' worth."""
    state = {"seen": 0}

    class CurriculumBlock(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            hard = state["seen"] >= threshold
            state["seen"] += 2
            return x + (0.5 if hard else 1.0) * torch.tanh(self.fc(x))
    return CurriculumBlock()


def test_a_count_a_forward_keeps_in_its_factorys_closure_puts_gradients_at_risk(tmp_path):
    """Under AC the count advances twice a step (reads 0, 2 | 4, 6 against 0 | 2): each step's passes agree, step 2's
    gradients differ. The forward's closure is state like a hook's: at risk, named, with code that guards the count
    (it said CLEAN)."""
    from models import same_steps, steps_with_and_without_ac

    with_ac, without = steps_with_and_without_ac(lambda: _curriculum_block(4), tmp_path / "t.jsonl", steps=3)
    assert same_steps(with_ac, without) == [True, False, True]
    report = ac_diff.diagnose_paths([tmp_path / "t.jsonl"])
    assert (report.verdict, report.title) == ("unchecked", "GRADIENTS AT RISK"), report.headline
    assert "<closure of forward>.state['seen']" in report.headline, report.headline
    fix = report.regions[0].suggestions[0]
    assert "state['seen'] += 2" in fix.code and "if not IN_BACKWARD" in fix.code and ".<" not in fix.code, fix.code


class DelayedScaleLinear(nn.Linear):
    """fp8-style delayed scaling kept in a Python float: the forward quantizes with the scale the last call left, then
    sets it from this input's amax (so the recompute quantizes with another)."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.x_scale = 448.0

    def forward(self, x):
        scale = self.x_scale
        xq = x + ((x * scale).to(torch.float8_e4m3fn).to(x.dtype) / scale - x).detach()
        self.x_scale = 448.0 / max(x.detach().abs().max().item(), 1e-12)
        return nn.functional.linear(xq, self.weight, self.bias)


class DelayedScaleBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = DelayedScaleLinear(8, 16), DelayedScaleLinear(16, 8)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


def test_the_same_state_of_each_linear_is_named_for_the_restore(tmp_path):
    """Both linears of the block set their scale in the forward: the cause named fc1's only (the other was taken for a
    statistic the forward writes), so `fix`'s restore of it did not help, and its "verified" fix was a combination
    that led with a selective-AC save of `.item()` that does nothing."""
    torch.manual_seed(0)
    block = DelayedScaleBlock()
    with ac_diff.record(tmp_path / "t.jsonl"):
        checkpoint(block, torch.randn(4, 8, requires_grad=True), use_reentrant=False).square().mean().backward()
    (region,) = ac_diff.diagnose_paths([tmp_path / "t.jsonl"]).regions
    assert region.status == "diverged", region
    assert {n.rsplit(".", 2)[-2:][0] for n in region.cause.names} == {"fc1", "fc2"}, region.cause.names


class CountNormalized(nn.Module):
    """An auxiliary loss divided by the tokens the module has counted (a load-balancing loss normalised per optimizer
    step): the division comes after the last tensor the backward saves, so the recompute stops before it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.seen = nn.Linear(8, 8), 0

    def forward(self, x):
        self.seen += x.shape[0]
        h = torch.tanh(self.lin(x))
        return h, h.sum() / self.seen


def test_every_region_of_a_counter_read_beyond_its_recompute_is_at_risk_not_only_the_first(tmp_path):
    """27f: a counter-normalised aux loss under accumulation: the first region was GRADIENTS AT RISK, the next ten,
    summarized as reproductions (their ops not kept), were listed clean, though each reads the count the previous
    recompute bumped again. A summary keeps the state its pass updated."""
    torch.manual_seed(0)
    block = CountNormalized()
    with ac_diff.record(tmp_path / "t.jsonl"):
        for _ in range(5):
            h, aux = checkpoint(block, torch.randn(4, 8, requires_grad=True), use_reentrant=False)
            (h.pow(2).sum() + aux).backward()
    run = read_run(tmp_path / "t.jsonl")
    assert [r.ops_written for r in run.regions][-1] is False  # (summarized)
    report = ac_diff.diagnose_paths(tmp_path / "t.jsonl")
    assert [r.unchecked_reason for r in report.regions] == [STATE_READ_AGAIN] * 5, report.regions
    assert all(r.cause.tensor == "CountNormalized.seen" for r in report.regions), report.regions[-1].cause


class _Cache:
    """A KV cache object the attention layers share: this segment's keys wait in `pending` until after the step."""

    def __init__(self) -> None:
        self.pending, self.segments = [], 0


class Remembering(nn.Module):
    def __init__(self, cache: _Cache) -> None:
        super().__init__()
        self.lin, self.cache = nn.Linear(8, 8), cache

    def forward(self, x):
        k = self.lin(x)
        self.cache.pending.append(k.detach())  # (the recompute appends it again)
        return torch.tanh(k)


def test_a_list_of_a_cache_object_the_forward_appends_to_is_a_repeated_update(tmp_path):
    """28e: a cache object's `pending` list (one level below the module), appended in the forward, got a duplicate
    from each recompute, and the memory built from it after the step differed: CLEAN with no note. The object's
    containers are recorded as the module's own: the repeated update is named, with its fix."""
    torch.manual_seed(0)
    cache = _Cache()
    block = Remembering(cache)
    with ac_diff.record(tmp_path / "t.jsonl"):
        checkpoint(block, torch.randn(4, 8, requires_grad=True), use_reentrant=False).sum().backward()
    assert len(cache.pending) == 2
    report = ac_diff.diagnose_paths(tmp_path / "t.jsonl")
    assert report.verdict == "clean" and "the recompute repeats the updates of Remembering.cache.pending" in \
        report.headline, report.headline
