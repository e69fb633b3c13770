"""Remedies reach every way a script checkpoints, change only what they say, and compose with SAC policies.

In process, on small seeded models (CPU): `checkpoint()`, `checkpoint_wrapper` (already imported, so its
import-time binding is re-pointed), `checkpoint_sequential`, HF `gradient_checkpointing_enable` and the
torchtitan-shaped `apply_ac` with an op-level SAC policy.
"""

from __future__ import annotations

import sys
from collections import defaultdict

import pytest
import torch
from torch import nn
import torch.utils.checkpoint as cp
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as cw_module

import ac_diff
from ac_diff.capture.torch_compat import sac_policy_answers, selective_contexts
from ac_diff.reference.session import CaptureSession
from ac_diff.remedies import CheckpointPatch, RemedySpec
from stacks import reentrant_side
from stacks.runs import STACKS

sys.path.insert(0, str(STACKS))  # the scripts import their shared loop and model
import delayed_scaling  # noqa: E402
import lora_generator  # noqa: E402


class Block(nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.router = nn.Linear(dim, 4)
        self.fc = nn.Linear(dim, dim)
        self.drop = nn.Dropout(0.2)

    def forward(self, x):
        weights, _ = torch.topk(torch.softmax(self.router(x), -1), 2, dim=-1)
        return x + self.drop(torch.relu(self.fc(x))) * weights.sum(-1, keepdim=True)


class Net(nn.Module):
    def __init__(self, how="checkpoint", context_fn=None, preserve_rng_state=True, layers=2):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([Block() for _ in range(layers)])
        self.how, self.context_fn, self.preserve = how, context_fn, preserve_rng_state
        if how == "wrapper":
            self.layers = nn.ModuleList([cw_module.checkpoint_wrapper(b, preserve_rng_state=preserve_rng_state,
                                                                      **({"context_fn": context_fn} if context_fn else {}))
                                         for b in self.layers])

    def forward(self, x):
        if self.how == "sequential":
            return cp.checkpoint_sequential(nn.Sequential(*self.layers), 2, x, use_reentrant=False)
        for layer in self.layers:
            if self.how == "none" or self.how == "wrapper":
                x = layer(x)
            else:
                kw = {"context_fn": self.context_fn} if self.context_fn else {}
                x = cp.checkpoint(layer, x, use_reentrant=self.how == "reentrant", preserve_rng_state=self.preserve, **kw)
        return x


def grads(net, seed=1):
    torch.manual_seed(seed)
    x = torch.randn(8, 16, requires_grad=True)
    net(x).pow(2).sum().backward()
    return {n.replace("_checkpoint_wrapped_module.", ""): p.grad.clone() for n, p in net.named_parameters()}


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture
def patched():
    patches = []

    def make(spec, **kw):
        p = CheckpointPatch(spec, **kw).install()
        patches.append(p)
        return p
    yield make
    for p in reversed(patches):
        p.uninstall()
    assert not hasattr(cp.checkpoint, "_ac_diff_remedies_original")
    assert not hasattr(cw_module.torch_utils_checkpoint, "_ac_diff_remedies_original")


@pytest.mark.parametrize("how", ["checkpoint", "reentrant", "wrapper", "sequential"])
def test_no_ac_everywhere_gives_the_gradients_of_the_model_without_checkpointing(patched, how):
    reference = grads(Net("none", preserve_rng_state=True))
    patch = patched(RemedySpec(no_ac=["*"]))
    assert same(grads(Net(how)), reference)
    assert sum(r["calls"] for r in patch.summary() if r["remedy"] == "no_ac") >= 1


def test_no_ac_by_glob_names_the_regions_as_the_report_does(patched):
    patch = patched(RemedySpec(no_ac=["layers.1"]))
    grads(Net("wrapper"))
    assert [(r["region"], r["what"]) for r in patch.summary()] == [("layers.1", "AC off")]


def test_no_ac_takes_a_checkpoint_sequential_segment_by_the_name_the_report_gives_it(patched, tmp_path):
    """The report names checkpoint_sequential's regions "segment 0-1"; `fix` tried `--no-ac 'segment 0-1'`, which
    matched nothing (the patch named the segment "0..1" and matched its modules only)."""
    path = tmp_path / "t.jsonl"
    with ac_diff.record(path):
        grads(Net("sequential", layers=4))
    names = sorted({r.module for r in ac_diff.diagnose_paths([path]).regions})
    assert names == ["segment 0-1"], names  # (torch runs the last segment without checkpointing)
    patch = patched(RemedySpec(no_ac=["segment 0-1"]))
    assert same(grads(Net("sequential", layers=4)), grads(Net("none", layers=4)))
    assert [(r["region"], r["what"]) for r in patch.summary()] == [("segment 0-1", "AC off")]


class Trunk(nn.Module):
    """A model that checkpoints one of its own methods (`checkpoint(self.trunk, x)`), run as an unnamed root."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))

    def trunk(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x

    def forward(self, x):
        return cp.checkpoint(self.trunk, x, use_reentrant=False)


def test_no_ac_takes_a_checkpointed_method_of_an_unnamed_root_by_the_name_the_report_gives_it(patched, tmp_path):
    """The report names the region by the model's class ("Trunk"); `fix` tried `--no-ac Trunk`, which matched nothing
    (the patch named it by the method, "Trunk.trunk"), and reported the try as if it had run."""
    path = tmp_path / "t.jsonl"
    with ac_diff.record(path):
        grads(Trunk())
    assert [r.module for r in ac_diff.diagnose_paths([path]).regions] == ["Trunk"]
    patch = patched(RemedySpec(no_ac=["Trunk"]))
    grads(Trunk())
    assert [(r["region"], r["what"], r["calls"]) for r in patch.summary()] == [("Trunk", "AC off", 1)]


def test_preserve_rng_makes_dropout_under_preserve_rng_state_false_match_no_ac(patched):
    reference = grads(Net("none"))
    assert not same(grads(Net("checkpoint", preserve_rng_state=False)), reference)  # the real mechanism
    patch = patched(RemedySpec(preserve_rng=True))
    assert same(grads(Net("checkpoint", preserve_rng_state=False)), reference)
    assert {r["what"] for r in patch.summary()} == {"preserve_rng_state=True"}


def test_must_save_composes_with_the_scripts_own_sac_policy(patched):
    calls = defaultdict(int)

    def user_policy(ctx, op, *args, **kwargs):
        calls[str(op)] += 1
        save, recompute = sac_policy_answers()  # CheckpointPolicy members, booleans before torch 2.5
        return save if op == torch.ops.aten.addmm.default else recompute

    reference = grads(Net("none"))
    patch = patched(RemedySpec(must_save=["aten.topk.default"], must_save_modules=["layers.*.router"]))
    got = grads(Net("wrapper", context_fn=lambda: selective_contexts(user_policy)))
    assert same(got, reference)
    rows = {(r["region"], r["what"]) for r in patch.summary()}
    assert ("layers.0", "composed with the script's SAC policy") in rows
    # topk runs in layers.N (not in the router module): the module glob keeps it out; the user's policy still decides
    assert calls["aten.addmm.default"] >= 2 and calls["aten.topk.default"] >= 2
    patch.uninstall()
    calls.clear()
    patch = patched(RemedySpec(must_save=["aten.topk.default", "addmm"]))
    grads(Net("wrapper", context_fn=lambda: selective_contexts(user_policy)))
    saved = {r["what"] for r in patch.summary() if r["what"].startswith("saved")}
    assert "saved aten.topk.default in layers.0" in saved and "saved aten.addmm.default in layers.1.router" in saved
    assert calls["aten.topk.default"] == 0  # decided by --must-save before the user's policy


def test_must_save_leaves_reentrant_regions_alone_and_says_why(patched):
    patch = patched(RemedySpec(must_save=["topk"]))
    grads(Net("reentrant"))
    assert all("reentrant checkpoint takes no context_fn" in r["what"] for r in patch.summary())


@pytest.mark.skipif(not hasattr(cp, "CheckpointPolicy"), reason="torchtitan's apply_ac needs CheckpointPolicy (torch >= 2.5)")
def test_titanlike_apply_ac_selective_op_policy_is_composed(patched):
    from stacks.titanlike.activation_checkpoint import apply_ac
    from stacks.titanlike.config import parse_args

    from ac_diff._examples import tiny_moe

    patch = patched(RemedySpec(must_save=["aten.topk.default"], must_save_modules=["layers.*.moe.router"]))
    job = parse_args(["--steps", "1"])
    args = tiny_moe.ModelArgs(n_layers=2)
    torch.manual_seed(0)
    model = tiny_moe.Transformer(args)
    apply_ac(model, job.activation_checkpoint)  # ptd_checkpoint_wrapper with torchtitan's op-level SAC policy
    inputs, labels = tiny_moe.make_batch(args, 0, seq_len=32)
    tiny_moe.loss_fn(model(inputs), labels).backward()
    rows = patch.summary()
    assert ("layers.0", "composed with the script's SAC policy") in {(r["region"], r["what"]) for r in rows}
    assert {r["what"] for r in rows if r["what"].startswith("saved")} == {
        "saved aten.topk.default in layers.0.moe.router", "saved aten.topk.default in layers.1.moe.router"}


def test_hf_gradient_checkpointing_is_reached(patched):
    transformers = pytest.importorskip("transformers")
    patch = patched(RemedySpec(no_ac=["model.layers.1"]))
    config = transformers.MixtralConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, num_local_experts=2,
                                        num_experts_per_tok=1, max_position_embeddings=32)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids = torch.randint(0, 32, (1, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    assert [(r["region"], r["what"], r["calls"]) for r in patch.summary()] == [("model.layers.1", "AC off", 1)]


def test_gradient_capture_and_reentrant_watch_leave_training_bit_identical(tmp_path):
    def train(observe):
        torch.manual_seed(0)
        model = reentrant_side.Model()
        model.reentrant = True
        logits = []
        for layer in model.layers:
            layer.gate.register_forward_hook(lambda m, i, o: logits.append(o))
        session = patch = None
        if observe:  # what `ac-diff run --reference` adds to the run
            patch = CheckpointPatch(RemedySpec())
            session = CaptureSession(tmp_path, 2, patch)
            patch.install()
            session.install()
        out = []
        for _ in range(2):
            logits.clear()
            ids = torch.randint(0, 32, (4, 8))
            loss = nn.functional.cross_entropy(model(ids), ids.flatten()) + sum(l.pow(2).mean() for l in logits)
            loss.backward()
            out.append((loss.detach().clone(), {n: p.grad.clone() for n, p in model.named_parameters()}))
            model.zero_grad()
        if session:
            session.finish()
            patch.uninstall()
            assert session.watch.findings()  # it did watch: the gate outputs leave the regions
        return out

    plain, observed = train(False), train(True)
    for (la, ga), (lb, gb) in zip(plain, observed):
        assert torch.equal(la, lb) and same(ga, gb)
    assert (tmp_path / "grads-rank0.pt").exists()


class Biased(nn.Module):
    """A router-like block whose `bias` buffer a forward hook nudges (the update in the wrong place)."""

    def __init__(self, dim=16):
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.register_buffer("bias", torch.zeros(dim))
        self.register_forward_hook(Biased.nudge)

    @staticmethod
    @torch.no_grad()
    def nudge(module, inputs, output):
        module.bias.add_(0.5)

    def forward(self, x):
        return torch.relu(self.fc(x) + self.bias)


class Noisy(nn.Module):
    """A block drawing from its own private torch.Generator."""

    def __init__(self, dim=16):
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self._gen = torch.Generator().manual_seed(3)

    def forward(self, x):
        return torch.tanh(self.fc(x * torch.rand(x.shape, generator=self._gen)))


class Stack(nn.Module):
    def __init__(self, block, reentrant=False, checkpointed=True):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([block(), block()])
        self.reentrant, self.checkpointed = reentrant, checkpointed

    def forward(self, x):
        for layer in self.layers:
            x = cp.checkpoint(layer, x, use_reentrant=self.reentrant) if self.checkpointed else layer(x)
        return x


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("block, name", [(Biased, "layers.*.bias"), (Noisy, "layers.*")])
def test_restore_in_recompute_gives_the_recompute_the_forwards_state(patched, reentrant, block, name):
    reference = grads(Stack(block, checkpointed=False))
    assert not same(grads(Stack(block, reentrant)), reference)  # the real mechanism: the recompute sees new state
    patch = patched(RemedySpec(restore=[name]))
    net = Stack(block, reentrant)
    storage = [layer.fc.weight.data_ptr() for layer in net.layers] + (
        [layer.bias.data_ptr() for layer in net.layers] if block is Biased else [])
    assert same(grads(net), reference)
    assert storage == [layer.fc.weight.data_ptr() for layer in net.layers] + (
        [layer.bias.data_ptr() for layer in net.layers] if block is Biased else [])  # its own storage back
    # after the backward the state is what the forward left (the recompute's own update / draws undone)
    after_forward = Stack(block, checkpointed=False)
    grads(after_forward)
    for a, b in zip(net.layers, after_forward.layers):
        if block is Biased:
            assert torch.equal(a.bias, b.bias) and a.bias[0].item() == 0.5
        else:
            assert torch.equal(a._gen.get_state(), b._gen.get_state())
    rows = [r for r in patch.summary() if r["remedy"] == "restore"]
    held = "bias" if block is Biased else "_gen"
    assert [(r["region"], r["what"]) for r in rows] == [
        (f"layers.{i}", f"forward value restored in the recompute: layers.{i}.{held}") for i in (0, 1)]


_AUG_GEN = torch.Generator()  # a generator of this Python module, as a data-augmentation one is kept


class NoisyGlobal(nn.Module):
    """A block drawing from a generator its forward reads as a global (DropEdge's augmentation generator, 25a)."""

    def __init__(self, dim=16):
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        return torch.tanh(self.fc(x * torch.rand(x.shape, generator=_AUG_GEN)))


@pytest.mark.parametrize("reentrant", [False, True])
def test_restore_reaches_a_generator_the_forward_reads_as_a_global(patched, reentrant):
    """`fix` tried "restore the forward's torch.Generator state of convs.*" on a GNN whose edge dropout draws from a
    module-level generator, reached nothing, and called the remedy that the hand-made change proves right "did not
    help". The generators a module's forward names as globals are restored with its own; and the audit's replays
    put them back (KeptState), so they no longer advance the training's augmentation generator."""
    from ac_diff.remedies.restore import KeptState

    _AUG_GEN.manual_seed(3)
    reference = grads(Stack(NoisyGlobal, checkpointed=False))
    after_forward = _AUG_GEN.get_state()
    _AUG_GEN.manual_seed(3)
    assert not same(grads(Stack(NoisyGlobal, reentrant)), reference)  # the real mechanism: the recompute draws anew
    patch = patched(RemedySpec(restore=["layers.*"]))
    _AUG_GEN.manual_seed(3)
    assert same(grads(Stack(NoisyGlobal, reentrant)), reference)
    assert torch.equal(_AUG_GEN.get_state(), after_forward)  # (the recompute's draws undone)
    rows = [r for r in patch.summary() if r["remedy"] == "restore"]
    assert [(r["region"], r["what"]) for r in rows] == [
        (f"layers.{i}", f"forward value restored in the recompute: layers.{i}.<global _AUG_GEN>") for i in (0, 1)]
    kept = KeptState(Stack(NoisyGlobal))
    torch.rand(4, generator=_AUG_GEN)
    kept.restore()
    assert torch.equal(_AUG_GEN.get_state(), after_forward)


class Spectral(nn.Module):
    """spectral_norm: each training forward updates the parametrization's `_u` and `_v` buffers in place."""

    def __init__(self, dim=16):
        super().__init__()
        self.fc = nn.utils.parametrizations.spectral_norm(nn.Linear(dim, dim))

    def forward(self, x):
        return torch.tanh(self.fc(x))


@pytest.mark.parametrize("reentrant", [False, True])
def test_restore_checks_what_the_first_forward_left_outside_the_regions_ops(tmp_path, reentrant):
    """Restoring `_v` replays the rest of its module's state (`_u`) on the first forward, and compares it with its
    snapshot as that forward ends, inside the region: that comparison (torch.equal) is not one of the region's ops.
    Recorded as the region's, it made every reentrant region read as another sequence of ops (`ac-diff fix` called
    the remedy unhelpful on a stranger's spectral-norm GAN)."""
    assert not same(grads(Stack(Spectral, reentrant)), grads(Stack(Spectral, checkpointed=False)))
    patch = CheckpointPatch(RemedySpec(restore=["layers.*.fc.parametrizations.weight.0._v"])).install()
    try:
        with ac_diff.record(tmp_path / "t.jsonl"):
            grads(Stack(Spectral, reentrant))
    finally:
        patch.uninstall()
    report = ac_diff.diagnose_paths([tmp_path / "t.jsonl"])
    assert report.verdict == "clean", report.headline


def _trained(stack, spec: RemedySpec) -> list[list[torch.Tensor]]:
    """Each step's gradients of a stack script (its `main`, 3 steps) under `spec`'s remedies: `no_ac=["*"]` gives
    the run without AC, an empty spec the script as written."""
    patch = CheckpointPatch(spec).install()
    try:
        return stack.main(["--steps", "3"])
    finally:
        patch.uninstall()


@pytest.mark.parametrize("stack, restore", [
    (lora_generator, ["layers.*.q_proj.lora_dropout.default", "layers.*.v_proj.lora_dropout.default"]),
    (lora_generator, ["layers.*"]),  # the block: the generators its submodules hold
    (delayed_scaling, ["layers.*.amax_history"]),  # filled from the first batch, with a flag, in step 0's forward
])
def test_restore_reaches_the_state_where_it_lives_and_never_undoes_the_first_forward(stack, restore):
    """A LoRA dropout's own generator, two modules below the checkpointed block, is restored from the block's glob
    too; a buffer the module's first forward fills (setting its `initialized` flag) is not put back empty under the
    set flag in step 0's recompute: that recompute replays the filling. Every step then trains as without AC (the
    forward's own updates stand)."""
    reference = _trained(stack, RemedySpec(no_ac=["*"]))
    differs = _trained(stack, RemedySpec())
    assert not all(torch.equal(a, b) for step, ref in zip(differs, reference) for a, b in zip(step, ref))
    restored = _trained(stack, RemedySpec(restore=restore))
    assert [all(map(torch.equal, step, ref)) for step, ref in zip(restored, reference)] == [True] * 3


def test_restore_travels_to_children_and_rebuilds_its_command():
    spec = RemedySpec(restore=["layers.*.moe.expert_bias"])
    assert RemedySpec.from_env({"AC_DIFF_REMEDIES": spec.to_env()}) == spec
    assert spec.cli_args() == ["--restore-in-recompute", "layers.*.moe.expert_bias"]
    assert bool(spec) and "restored in the recompute" in spec.describe()


def _routed_grads(context: str | None) -> tuple[torch.Tensor, ...]:
    """Gradients of a top-k routing whose bias moves between the forward and the backward (the load-balancing
    update in the wrong place): `context` None runs without AC, "plain" with checkpoint(), else it is the code
    of a suggested SAC policy, run as the user would paste it (`block`, `x` given, `out` assigned)."""
    torch.manual_seed(0)
    w = torch.randn(8, 6, requires_grad=True)
    bias = torch.zeros(6)
    x = torch.randn(10, 8, requires_grad=True)

    def block(x):
        scores = x @ w + bias
        picked = torch.topk(scores, 2, dim=-1).indices
        return torch.gather(scores, 1, picked).sum() + x[:, :2].mul(picked.float()).sum()

    if context is None:
        out = block(x)
    elif context == "plain":
        out = cp.checkpoint(block, x, use_reentrant=False)
    else:
        scope = {"block": block, "x": x}
        exec(context, scope)
        out = scope["out"]
    with torch.no_grad():
        bias.add_(torch.linspace(3, -3, 6))  # the recompute would pick other experts
    out.backward()
    return x.grad, w.grad


def test_the_suggested_sac_policy_runs_on_this_torch_and_saves_the_decision():
    """The policy code a report suggests is written for the torch that ran the script (2.4 has no CheckpointPolicy):
    pasted as is, it saves topk and the gradients are those of the run without AC."""
    from ac_diff.diagnosis.suggest import sac_policy

    code = sac_policy(["aten.topk.default"], torch.__version__)
    assert ("CheckpointPolicy.MUST_SAVE" in code) is hasattr(cp, "CheckpointPolicy")
    no_ac = _routed_grads(None)
    assert any(not torch.equal(a, b) for a, b in zip(_routed_grads("plain"), no_ac))  # the divergence is real
    assert all(torch.equal(a, b) for a, b in zip(_routed_grads(code), no_ac))


def test_a_report_writes_the_policy_for_the_torch_in_the_trace(demo, tmp_path):
    """The suggested policy follows the torch the trace was recorded with, not the one reading it."""
    import json

    from ac_diff.diagnosis import diagnose
    from ac_diff.trace import read_run, with_crc

    def policy_code(path):
        report = diagnose([read_run(path)])
        return " ".join(s.code or "" for r in report.regions for s in r.suggestions if "selective" in s.title)

    lines = (demo / "out" / "trace-rank0.jsonl").read_bytes().splitlines(keepends=True)
    header = json.loads(lines[0])
    header.pop("crc", None)

    def recorded_with(version):
        header["torch"] = version
        path = tmp_path / version / "trace-rank0.jsonl"
        path.parent.mkdir()
        path.write_bytes(with_crc(json.dumps(header, separators=(",", ":")).encode()) + b"\n" + b"".join(lines[1:]))
        return path

    assert "CheckpointPolicy.MUST_SAVE" in policy_code(recorded_with("2.13.0+cpu"))
    legacy = policy_code(recorded_with("2.4.1+cu121"))
    assert "_pt2_selective_checkpoint_context_fn_gen" in legacy and "CheckpointPolicy.MUST_SAVE" not in legacy


class _NoisyLayer(nn.Module):
    """Drops units with masks drawn from a generator the whole model shares (preserve_rng_state does not cover it)."""

    def __init__(self, gen: torch.Generator):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.gen = gen

    def forward(self, x):
        keep = torch.rand(x.shape, generator=self.gen) > 0.2
        return torch.tanh(self.lin(x)) * keep / 0.8


def _shared_generator_training(code: str | None) -> tuple[list, torch.Tensor]:
    """Three steps of two layers sharing one generator: without AC (code None), or each layer checkpointed through
    the suggested block_fn (`code` defines it, with `gen` and `block` bound)."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    layers = nn.ModuleList([_NoisyLayer(gen), _NoisyLayer(gen)])
    opt = torch.optim.SGD(layers.parameters(), lr=0.1)
    grads = []
    for step in range(3):
        h = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        for layer in layers:
            if code is None:
                h = layer(h)
            else:
                scope = {"torch": torch, "gen": gen, "block": layer}
                exec(code, scope)  # noqa: S102 - the suggested code, pasted as a user would
                h = cp.checkpoint(scope["block_fn"], h, gen.get_state(), use_reentrant=False)
        opt.zero_grad()
        h.pow(2).sum().backward()
        grads.append([p.grad.clone() for p in layers.parameters()])
        opt.step()
    return grads, gen.get_state()


def test_the_suggested_generator_code_trains_as_without_ac_with_a_shared_generator():
    """The code ac-diff gives for a private generator (and for a verified generator restore), pasted as a user
    would: every step's gradients and the generator's final state equal the run without AC, although both layers
    draw from one generator (setting its state in the recompute without putting it back would rewind it)."""
    from ac_diff.diagnosis.suggest import GENERATOR_SWAP

    reference, ref_state = _shared_generator_training(None)
    grads, state = _shared_generator_training(GENERATOR_SWAP.split("\n\nout = ")[0])
    assert all(torch.equal(a, b) for step_a, step_b in zip(grads, reference) for a, b in zip(step_a, step_b))
    assert torch.equal(state, ref_state)
    rewinding = "def block_fn(x, gen_state):\n    gen.set_state(gen_state)\n    return block(x)\n"  # the old advice
    old_grads, old_state = _shared_generator_training(rewinding)
    assert not torch.equal(old_state, ref_state) or not all(
        torch.equal(a, b) for step_a, step_b in zip(old_grads, reference) for a, b in zip(step_a, step_b))


def test_a_remedy_under_which_torch_raises_on_the_divergence_did_not_help_and_did_not_crash(tmp_path):
    """A stranger's reentrant KV cache: under use_reentrant=False torch's own check raises a CheckpointError on the
    same divergence (the silent one made loud), and the fix table called the try "crashed"."""
    from ac_diff.fix.result import DID_NOT_HELP, Try
    from ac_diff.fix.tries import Measured, judge

    torch.manual_seed(0)
    block, x = nn.Linear(8, 8), torch.randn(4, 8, requires_grad=True)
    grow = {"n": 4}
    path = tmp_path / "t.jsonl"
    with pytest.raises(cp.CheckpointError):
        with ac_diff.record(path):
            y = cp.checkpoint(lambda h: block(torch.cat([h] * (grow["n"] // 4))), x, use_reentrant=False)
            grow["n"] = 8  # the recompute concatenates twice: another shape
            y.sum().backward()
    report = ac_diff.diagnose_paths([path])
    assert report.torch_error is not None
    log = tmp_path / "try.log"
    log.write_text("torch.utils.checkpoint.CheckpointError: ...\n")
    t = Try("use_reentrant=False", ["--non-reentrant"], "the base run diverged silently")
    judge(t, report, None, Measured(1.0, 1, log), Measured(1.0, 0, log), None)
    assert t.status == DID_NOT_HELP and t.reason.startswith("the recompute still differs, and torch now raises"), t


def test_a_restore_that_names_nothing_it_can_restore_says_so():
    """A stranger's `--restore-in-recompute head.logit_scale` (a parameter) did nothing, and nothing said so."""
    patch = CheckpointPatch(RemedySpec(restore=["layers.*.fc.parametrizations.weight.0._v",
                                                "layers.*.fc.parametrizations.weight.original"])).install()
    try:
        grads(Stack(Spectral))
    finally:
        patch.uninstall()
    rows = [r["what"] for r in patch.summary()]
    assert any(w.startswith("forward value restored in the recompute") for w in rows), rows
    assert [w for w in rows if w.startswith("matched nothing")] == [
        "matched nothing: layers.*.fc.parametrizations.weight.original (a buffer, tensor, Python attribute, list or "
        "generator of a checkpointed module is restored; a parameter is not)"], rows


def test_a_no_ac_glob_or_a_saved_op_that_names_nothing_says_so():
    """A stranger's `--no-ac layer.*` (misspelt) and `--must-save aten.bogus.default` were taken silently (the one
    reported "SAC policy added"): each says it matched nothing, beside what the others did."""
    patch = CheckpointPatch(RemedySpec(no_ac=["layer.*", "layers.1"],
                                       must_save=["aten.bogus.default", "aten.tanh.default"])).install()
    try:
        grads(Stack(Spectral))
    finally:
        patch.uninstall()
    rows = [r["what"] for r in patch.summary()]
    assert [w for w in rows if w.startswith("matched nothing")] == [
        "matched nothing: layer.* (a glob over the checkpointed regions' modules, as the report names them)",
        "matched nothing: aten.bogus.default (no op of that name ran in a checkpointed region; `ac-diff export TRACE "
        "--what ops` lists those that did)"], rows
    assert any(w.startswith("saved aten.tanh.default in layers.0") for w in rows), rows


def test_restore_reaches_a_field_of_a_run_config_the_module_holds():
    """`scan.cfg.chunk`: a small config object of the user's held by the module (not a module itself) is state the
    restore reaches, field by field; its other fields and the module's own state are left alone."""
    from ac_diff.remedies.restore import find

    class RunConfig:
        def __init__(self) -> None:
            self.chunk, self.name = 4, "scan"

    model = nn.Sequential(nn.Linear(2, 2))
    model[0].cfg = RunConfig()
    found = find(model, "", ["0.cfg.chunk"])
    assert list(found) == ["0.cfg.chunk"]
    slot = found["0.cfg.chunk"]
    before = slot.swap(8)
    assert (before, model[0].cfg.chunk, model[0].cfg.name) == (4, 8, "scan")


class _WarmedUp(nn.Module):
    """Scales its output by `alpha`, which a warmup pre-hook sets at each call from the calls it counts in its
    closure: the recompute calls the hook again."""

    def __init__(self, dim=16):
        super().__init__()
        self.fc, self.alpha = nn.Linear(dim, dim), 0.0

        def warmup(module, args):
            nonlocal calls
            calls += 1
            module.alpha = min(1.0, calls / 4)
        calls = 0
        self.register_forward_pre_hook(warmup)

    def forward(self, x):
        return torch.tanh(self.fc(x) * self.alpha)


@pytest.mark.parametrize("reentrant", [False, True])
def test_restore_reaches_a_count_a_pre_hook_keeps_in_its_closure(patched, reentrant):
    """`layers.*.<forward pre-hook warmup>.calls`: the hook's closure cell is given the forward's count in the
    recompute, and the forward's count is back after it; the gradients are those of a run without AC."""
    reference = grads(Stack(_WarmedUp, checkpointed=False))
    assert not same(grads(Stack(_WarmedUp, reentrant)), reference)  # the real mechanism: the hook counts again
    patched(RemedySpec(restore=["layers.*.<forward pre-hook warmup>.calls", "layers.*.alpha"]))
    net = Stack(_WarmedUp, reentrant)
    assert same(grads(net), reference)
    from ac_diff.capture.pystate import hook_state

    assert [hook_state(layer) for layer in net.layers] == [{"<forward pre-hook warmup>.calls": 1}] * 2


class _ListCounted(nn.Module):
    """Scales its input by a warmup factor a pre-hook computes from the calls it counts in a list bound as a default
    argument (`calls=[0]`, a common idiom): no `nonlocal`, and the list keeps its item from call to call."""

    def __init__(self, dim=16):
        super().__init__()
        self.fc = nn.Linear(dim, dim)

        def warm(module, args, calls=[0]):
            calls[0] += 1
            return (args[0] * min(1.0, calls[0] / 4),)
        self.register_forward_pre_hook(warm)

    def forward(self, x):
        return torch.tanh(self.fc(x))


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_count_a_pre_hook_keeps_in_a_default_list_is_named_and_restored(patched, reentrant, tmp_path):
    """The item is the hook's state (`<forward pre-hook warm>.calls[0]`): the cause names it and the hook, the fix
    code changes the item (no `nonlocal`), and the restore `fix` would try reaches it (the glob escapes the bracket):
    the gradients are those of a run without AC. It said "a Python value passed to aten.mul.Tensor changed between
    the forward and the recompute", and `fix` found only AC off."""
    import ac_diff
    from ac_diff.fix.candidates import candidates

    reference = grads(Stack(_ListCounted, checkpointed=False))
    assert not same(grads(Stack(_ListCounted, reentrant)), reference)  # the real mechanism: the hook counts again
    path = tmp_path / "t.jsonl"
    with ac_diff.record(path):
        grads(Stack(_ListCounted, reentrant))
    report = ac_diff.diagnose_paths([path])
    region = next(r for r in report.regions if r.status == "diverged")
    assert region.cause.tensor.endswith("<forward pre-hook warm>.calls[0]"), region.cause
    assert "keeps in `calls`, a list or dict its closure or a default argument holds" in region.cause.detail
    fix = region.suggestions[0]
    assert "calls[0] += 1" in fix.code and "nonlocal" not in fix.code, fix.code
    restore = next(c for c in candidates(report) if c.kind == "restore")
    assert restore.spec.restore == ["layers.*.<forward pre-hook warm>.calls[0]"], restore.spec
    patched(restore.spec)
    assert same(grads(Stack(_ListCounted, reentrant)), reference)


class _SegmentMemory(nn.Module):
    """A running sum carried from segment to segment in an attribute, unset (None) before the first segment."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.memory = nn.Linear(8, 8), None

    def forward(self, x):
        h = self.fc(x)
        past = self.memory if self.memory is not None else torch.zeros_like(h)
        self.memory = (past + h).detach()
        return torch.tanh(h + past)


@pytest.mark.parametrize("reentrant", [False, True])
def test_restore_puts_back_an_attribute_the_forward_found_unset(patched, reentrant):
    """Two segments forwarded, then one backward: the first segment's recompute found the memory the second left,
    where its forward found it unset (None). The restore left None out ("nothing to restore"), so that region stayed
    diverged and `fix` found only AC off; None is restored like any value: the gradients of a run without AC."""
    def segments(checkpointed: bool) -> list:
        torch.manual_seed(3)
        block = _SegmentMemory()
        run = (lambda x: cp.checkpoint(block, x, use_reentrant=reentrant)) if checkpointed else block
        sum(run(torch.randn(2, 8, requires_grad=True)).sum() for _ in range(2)).backward()
        return {n: p.grad.clone() for n, p in block.named_parameters()}

    reference = segments(False)
    assert not same(segments(True), reference)  # the real mechanism
    patched(RemedySpec(restore=["memory"]))
    assert same(segments(True), reference)


class _CreatedMemory(nn.Module):
    """A Transformer-XL memory the first segment's forward creates (`self.memory` does not exist before it)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        past = getattr(self, "memory", None)
        past = torch.zeros_like(h) if past is None else past
        self.memory = (past + h).detach()
        return torch.tanh(h + past)


@pytest.mark.parametrize("reentrant", [False, True])
def test_restore_gives_the_recompute_an_attribute_unset_as_its_forward_found_it(patched, reentrant):
    """The attribute did not exist when the first segment's forward began: the restore matched nothing, `fix`
    reported it as "did not help" and concluded only AC off works. It is now taken away for that recompute."""
    def segments(checkpointed: bool) -> list:
        torch.manual_seed(3)
        block = _CreatedMemory()
        run = (lambda x: cp.checkpoint(block, x, use_reentrant=reentrant)) if checkpointed else block
        sum(run(torch.randn(2, 8, requires_grad=True)).sum() for _ in range(2)).backward()
        return {n: p.grad.clone() for n, p in block.named_parameters()}, block

    (reference, _), (diverged, _) = segments(False), segments(True)
    assert not same(diverged, reference)  # the real mechanism
    patch = patched(RemedySpec(restore=["memory"]))
    restored, block = segments(True)
    assert same(restored, reference) and block.memory.shape == (2, 8)  # (the last forward's memory stands)
    assert not any(r["what"].startswith("matched nothing") for r in patch.summary()), patch.summary()


class CarriedState(nn.Module):
    """A state-space block carrying its state to the next chunk as `self.h = h[:, -1].detach()`: the last time step of
    a (batch, time, dim) tensor, strided with gaps (26a's Mamba)."""

    def __init__(self, dim=16):
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.h = None

    def forward(self, x):
        h0 = self.h if self.h is not None else x.new_zeros(x.shape[0], x.shape[-1])
        h = torch.tanh(self.fc(x).cumsum(1) * (1 + h0[:, None]) + h0[:, None] * x)  # (mul saves the view of h0)
        self.h = h[:, -1].detach()
        return h


def test_a_restored_state_keeps_its_layout_so_the_recompute_saves_it_alike(patched, tmp_path):
    """26a: `--restore-in-recompute 'blocks.*.h'` made the gradients bit-identical to the run without AC, and the
    report said "SILENTLY DIVERGED: unknown" at the saved view of h0: the restored copy was contiguous, so the
    recompute's `h0[:, None]` read the same values with other strides than the forward's. `fix` then rejected the
    right remedy. The copy keeps the forward's layout: clean."""
    def train(net):
        torch.manual_seed(1)
        out = []
        for _ in range(2):
            net(torch.randn(4, 5, 16)).pow(2).sum().backward()
            out += [p.grad.clone() for p in net.parameters()]
            net.zero_grad()
        return out

    reference = train(Stack(CarriedState, checkpointed=False))
    assert not all(torch.equal(a, b) for a, b in zip(train(Stack(CarriedState)), reference))  # (the mechanism)
    patched(RemedySpec(restore=["layers.*.h"]))
    path = tmp_path / "t.jsonl"
    with ac_diff.record(path):
        restored = train(Stack(CarriedState))
    assert all(torch.equal(a, b) for a, b in zip(restored, reference))
    report = ac_diff.diagnose_paths([path])
    assert report.verdict == "clean", report.headline


def test_a_checkpointed_partial_is_named_by_its_function_in_the_report_and_by_no_ac(tmp_path):
    """`checkpoint(functools.partial(layer_fn, hp), x)` (hyper-parameters bound in): the report named the region after
    the module its ops ran first (`lin`), `--no-ac lin` matched nothing ("<function>" at the call), and `fix` spent its
    only try on it (27b). Both name it `layer_fn`, as a plain function's region is named."""
    import functools

    from ac_diff.trace import read_run

    torch.manual_seed(0)
    lin = nn.Linear(8, 8)

    def layer_fn(hp, x):
        return x * torch.sigmoid(lin(x) + hp["bias"])

    fn = functools.partial(layer_fn, {"bias": 0.5})
    x = torch.randn(4, 8, requires_grad=True)
    with ac_diff.record(tmp_path / "t.jsonl"):
        cp.checkpoint(fn, x, use_reentrant=False).sum().backward()
    (region,) = read_run(tmp_path / "t.jsonl").regions
    assert region.module.endswith("layer_fn"), region.module
    patch = CheckpointPatch(RemedySpec(no_ac=[region.module])).install()
    try:
        cp.checkpoint(fn, x, use_reentrant=False).sum().backward()
    finally:
        patch.uninstall()
    assert [(r["remedy"], r["what"], r["calls"]) for r in patch.summary()] == [("no_ac", "AC off", 1)]
