"""Tensors and modules a region reads that no single model holds, each from a real mechanism: a frozen teacher read
beside its student in one checkpointed loss (an EMA moves the teacher before the backward: both are unnamed roots
whose parameters share every name), blocks kept in a plain list (each its own root), torch.compile's wrappers of the
model's blocks (the model holds the blocks, not the wrappers), a buffer of the model that a
checkpointed layer reads by reference (the recompute runs in the backward, outside the model), and region inputs that
checkpoint keeps through the user's saved-tensor hooks (an offload pool that reuses its staging buffers hands the
recompute another tensor's values; torch's own save_on_cpu gives them back exactly)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as cp

import ac_diff

# torch's own stack of saved-tensor hooks (torch >= 2.8); older releases name no hook
saved_tensors_hooks_now = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def _distill(tmp_path, ema: bool):
    torch.manual_seed(0)
    student = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    # a teacher of its own initialisation: an EMA of a copy equal to its student rounds to the copy itself on some
    # CPUs (0.99 w + 0.01 w == w, elementwise), so the first step's update would change nothing there
    teacher = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)).requires_grad_(False)

    def distill_loss(x_s, x_t):
        s = F.log_softmax(student(x_s), -1)
        with torch.no_grad():
            t = F.softmax(teacher(x_t) / 0.5, -1)
        return -(t * s).sum(-1).mean()

    with ac_diff.record(tmp_path / "t.jsonl"):
        for _ in range(2):
            x = torch.randn(4, 8)
            loss = cp.checkpoint(distill_loss, x + 0.1, x - 0.1, use_reentrant=False)
            if ema:  # the teacher's EMA update, "overlapped" with the backward
                with torch.no_grad():
                    for pt, ps in zip(teacher.parameters(), student.parameters()):
                        pt.mul_(0.99).add_(ps, alpha=0.01)
            loss.backward()
    return ac_diff.diagnose_paths([tmp_path / "t.jsonl"])


def test_a_teacher_read_beside_its_student_is_named_apart(tmp_path):
    report = _distill(tmp_path, ema=True)
    cause = report.regions[0].cause
    assert report.verdict == "diverged" and cause.kind == "state_mutation", report.headline
    assert cause.tensor == "teacher.0.weight", cause
    changed = [c["name"] for c in report.regions[0].changed_inputs if c["kind"] == "param"]
    assert changed and all(name.startswith("teacher.") for name in changed), changed
    # a change of 1% of the difference still prints as two fingerprints that differ
    forward, recompute = cause.evidence[0].split(" in forward, ")
    assert forward.split("fingerprint ")[1] != recompute.removesuffix(" in recompute")


def test_the_teacher_updated_after_the_backward_is_clean(tmp_path):
    assert _distill(tmp_path, ema=False).verdict == "clean"


def test_a_gans_two_models_are_each_named_by_their_variable(tmp_path):
    """A generator and a discriminator, two roots called from nowhere that both train: each is named by the
    variable that holds it (`G`, `D.0.weight`), not the first bare and the second prefixed. The discriminator's
    optimizer steps between the generator loss's forward and backward, a classic GAN bug: the recompute of the
    discriminator region reads the stepped weights."""
    torch.manual_seed(0)
    G = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8))
    D = nn.Sequential(nn.Linear(8, 8), nn.LeakyReLU(0.2), nn.Linear(8, 1))
    opt_d = torch.optim.SGD(D.parameters(), lr=0.1)
    with ac_diff.record(tmp_path / "t.jsonl"):
        fake = cp.checkpoint(G, torch.randn(6, 4), use_reentrant=False)
        d_loss = F.softplus(cp.checkpoint(D, fake.detach(), use_reentrant=False)).mean()
        g_loss = F.softplus(-cp.checkpoint(D, fake, use_reentrant=False)).mean()
        opt_d.zero_grad()
        d_loss.backward()
        opt_d.step()
        g_loss.backward()
    report = ac_diff.diagnose_paths([tmp_path / "t.jsonl"])
    assert [r.module for r in report.regions] == ["G", "D", "D"], [r.module for r in report.regions]
    assert [r.status for r in report.regions] == ["clean", "clean", "diverged"]
    cause = report.regions[2].cause
    assert cause.mechanism == "optimizer_step" and "`D.0.weight`" in cause.evidence[0], cause


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


def test_blocks_in_a_plain_list_are_named_by_their_place(tmp_path):
    torch.manual_seed(0)
    blocks = [Block() for _ in range(3)]
    x = torch.randn(4, 8, requires_grad=True)
    with ac_diff.record(tmp_path / "t.jsonl"):
        h = x
        for block in blocks:
            h = cp.checkpoint(block, h, use_reentrant=False)
        blocks[1].fc.weight.data.mul_(1.5)  # between the forward and the backward
        h.sum().backward()
    report = ac_diff.diagnose_paths([tmp_path / "t.jsonl"])
    assert [r.module for r in report.regions] == ["blocks[0]", "blocks[1]", "blocks[2]"]
    assert [r.status for r in report.regions] == ["clean", "diverged", "clean"]
    assert report.regions[1].cause.tensor == "blocks[1].fc.weight", report.regions[1].cause


class CompiledBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(2)])
        self.compiled = [torch.compile(b, backend="eager") for b in self.blocks]  # (wrappers the model does not hold)

    def forward(self, x):
        for block in self.compiled:
            x = cp.checkpoint(block, x, use_reentrant=False)
        return x


def test_a_compiled_block_the_model_holds_uncompiled_is_named_by_its_place(tmp_path):
    torch.manual_seed(0)
    model = CompiledBlocks()
    with ac_diff.record(tmp_path / "t.jsonl"):
        model(torch.randn(4, 8, requires_grad=True)).sum().backward()
    report = ac_diff.diagnose_paths([tmp_path / "t.jsonl"])
    assert [(r.module, r.status) for r in report.regions] == [("blocks.0", "clean"), ("blocks.1", "clean")]


class MaskedAttention(nn.Module):
    def __init__(self, owner: nn.Module) -> None:
        super().__init__()
        self.qk, self._owner = nn.Linear(8, 16), [owner]  # (a list: the model is no submodule of its layer)

    def forward(self, x):
        q, k = self.qk(x).chunk(2, -1)
        scores = q @ k.transpose(1, 2) + self._owner[0].pad_mask[:, None, :]
        return scores.softmax(-1) @ x


class Encoder(nn.Module):
    """A key-padding mask kept in one preallocated buffer, rewritten in place for each micro-batch."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("pad_mask", torch.zeros(2, 6))
        self.layers = nn.ModuleList([MaskedAttention(self) for _ in range(2)])

    def set_padding(self, lengths) -> None:
        self.pad_mask.zero_()
        for i, n in enumerate(lengths):
            self.pad_mask[i, n:] = float("-inf")

    def forward(self, x):
        for layer in self.layers:
            x = cp.checkpoint(layer, x, use_reentrant=False)
        return x


def test_a_buffer_of_the_model_a_layer_reads_by_reference_is_named_in_both_passes(tmp_path):
    """Two micro-batches forward before one backward; the second rewrites the mask the first one's regions read.
    The forward runs inside the model, the recompute in the backward: both name the buffer `pad_mask`."""
    torch.manual_seed(0)
    model = Encoder()
    with ac_diff.record(tmp_path / "t.jsonl"):
        loss = 0
        for lengths in ([6, 3], [4, 5]):
            model.set_padding(lengths)
            loss = loss + model(torch.randn(2, 6, 8)).pow(2).mean()
        loss.backward()
    report = ac_diff.diagnose_paths([tmp_path / "t.jsonl"])
    assert [r.status for r in report.regions] == ["diverged", "diverged", "clean", "clean"], report.headline
    cause = report.regions[0].cause
    assert (cause.kind, cause.tensor) == ("state_mutation", "pad_mask"), cause


class ReusedPool:
    """Saved activations staged in preallocated buffers, reused round-robin: sized one per layer, too few."""

    def __init__(self, slots: int) -> None:
        self.slots, self.buffers, self.count = slots, {}, 0

    def pack(self, t):
        key = (tuple(t.shape), t.dtype, self.count % self.slots)
        self.count += 1
        buf = self.buffers.setdefault(key, torch.empty(t.shape, dtype=t.dtype))
        buf.copy_(t)
        return buf

    def unpack(self, buf):
        return buf


def _offloaded(tmp_path, hooks) -> ac_diff.Report:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), *[Block() for _ in range(3)])
    with ac_diff.record(tmp_path / "t.jsonl"):
        with hooks:
            h = model[0](torch.randn(4, 4))
            for block in model[1:]:
                h = cp.checkpoint(block, h, use_reentrant=False)
        h.pow(2).sum().backward()
    return ac_diff.diagnose_paths([tmp_path / "t.jsonl"])


def test_a_region_input_an_offload_pool_overwrote_names_the_hooks(tmp_path):
    pool = ReusedPool(slots=2)
    report = _offloaded(tmp_path, torch.autograd.graph.saved_tensors_hooks(pool.pack, pool.unpack))
    lead = next(r for r in report.regions if r.status == "diverged")
    assert report.verdict == "diverged" and lead.cause.mechanism == "saved_hooks", report.headline
    assert lead.cause.tensor == "input[0]" and "the recompute got a copy, not the forward's tensor" in lead.cause.detail
    pack, unpack = ("ReusedPool.pack", "ReusedPool.unpack") if saved_tensors_hooks_now is not None else \
        ("pack", "unpack")  # (torch <= 2.7 cannot say which hooks were active: the next test's case)
    assert pack == "pack" or f"`{pack}`" in lead.cause.detail
    assert lead.suggestions[0].title == f"Make `{pack}` keep what it saves intact until `{unpack}` has returned it"


def test_without_torchs_hook_stack_the_kept_input_still_reads_as_the_hooks(tmp_path, monkeypatch):
    """torch <= 2.7 cannot say which saved-tensor hooks were active: the recompute got a copy in other memory than the
    forward's input, so what came back changed is what checkpoint kept of it, not the input."""
    from ac_diff.capture import torch_compat

    monkeypatch.setattr(torch_compat, "saved_tensors_hooks_now", lambda: None)
    pool = ReusedPool(slots=2)
    report = _offloaded(tmp_path, torch.autograd.graph.saved_tensors_hooks(pool.pack, pool.unpack))
    lead = next(r for r in report.regions if r.status == "diverged")
    assert lead.cause.mechanism == "saved_hooks" and "the recompute got a copy, not the forward's tensor" in lead.cause.detail, lead.cause


def test_inputs_kept_through_save_on_cpu_are_clean(tmp_path):
    assert _offloaded(tmp_path, torch.autograd.graph.save_on_cpu()).verdict == "clean"
