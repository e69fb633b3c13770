"""CUDA's op return structures on a CPU build: positional outputs, per-output roles, and the attention kernels
end to end (tests/cuda_standin.py), so the GPU's main path is tested where CI runs."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts, CheckpointPolicy

import ac_diff
from ac_diff.capture import recorder as recorder_module
from ac_diff.capture.recorder import Recorder, RecordOptions, _fps_by_op, _ops_record, _Pass, _Region
from ac_diff.oprules import DATA, RNG_BOOKKEEPING, UNUSED, output_roles
from ac_diff.passes import TensorMeta
from ac_diff.trace import _ops_from_json, read_run
from cuda_standin import FORWARD_OPS, KERNELS, CudaAttention, attention

_PLAIN = {"int": 7, "SymInt": 7, "float": 0.5, "bool": True, "ScalarType": torch.float32}
_OTHER = {"List[Tensor]", "Optional[Tensor]"}


def _mixed_schemas() -> list:
    """Every aten op whose returns mix Tensor with non-Tensor values, from torch's own schemas (not a hand list)."""
    found = {}
    for schema in torch._C._jit_get_all_schemas():
        if not schema.name.startswith("aten::"):
            continue
        kinds = [str(r.type) for r in schema.returns]
        if "Tensor" in kinds and any(k in _PLAIN or k in _OTHER for k in kinds):
            name = f"aten.{schema.name[6:]}.{schema.overload_name or 'default'}"
            found[name] = kinds
    return sorted(found.items())


MIXED = _mixed_schemas()


def _func(name: str):
    _, op, overload = name.split(".")
    return getattr(getattr(torch.ops.aten, op), overload)


def _record_one(func, out, tmp_path, args=()):
    """Record one op with output `out` in a forward pass, write it and read it back: (row, decoded op)."""
    rec = Recorder(tmp_path / "t.jsonl", RecordOptions(source_lines=False))
    p = _Pass(_Region(0, "checkpoint", None, None, {}), "forward", 0, 0, {})
    rec._record(p, func, args, {}, out)
    fingerprints, kept = p.batch.collect()
    fps = _fps_by_op(p, fingerprints)
    record = _ops_record(p, p.ops, fps, kept)
    record = __import__("json").loads(__import__("json").dumps(record, default=list))  # as the file holds it
    return p, _ops_from_json(record)[0]


def _outputs(kinds: list[str], none_at: set[int]):
    out = []
    for j, kind in enumerate(kinds):
        if kind == "Tensor":
            out.append(None if j in none_at else torch.arange(12.0).reshape(3, 4) + j)
        elif kind == "List[Tensor]":
            out.append([torch.ones(2), torch.zeros(2)])
        elif kind == "Optional[Tensor]":
            out.append(None)
        else:
            out.append(_PLAIN[kind])
    return tuple(out)


def test_torch_has_ops_that_mix_tensor_and_non_tensor_returns():
    names = [n for n, _ in MIXED]
    assert "aten._scaled_dot_product_flash_attention.default" in names
    assert len(MIXED) >= 15


@pytest.mark.parametrize("name,kinds", MIXED, ids=[n for n, _ in MIXED])
def test_every_mixed_return_structure_is_recorded_by_position(name, kinds, tmp_path):
    func = _func(name)
    tensors = [j for j, k in enumerate(kinds) if k == "Tensor"]
    # as declared, and with the tensors after the first None at run time (flash's cum_seq_q/k on CUDA)
    for none_at in (set(), set(tensors[1:2])):
        out = _outputs(kinds, none_at)
        p, op = _record_one(func, out, tmp_path)
        assert len(op.out) == len(kinds)
        for j, value in enumerate(out):
            if isinstance(value, torch.Tensor):
                assert op.out[j] == TensorMeta((3, 4), "f32")
                if p.producers:  # its ref names output j (the same index as the schema's)
                    hit = p.producers[id(value)]
                    assert hit[2] == j and hit[5] == ("op", 0, j)
                if output_roles(name)[j] == DATA:
                    assert op.fingerprint[j] is not None
            elif value is None:
                assert op.out[j] is None and (op.fingerprint is None or op.fingerprint[j] is None)
            elif isinstance(value, list):
                assert op.out[j] == "list[2]"
            else:
                assert op.out[j] == (str(value) if kinds[j] == "ScalarType" else value)
        assert op.fingerprint is None or len(op.fingerprint) == len(kinds)


def _fake_cuda_outputs(kernel: str, dropout_p: float):
    """What the op returns for "cuda" tensors, from torch's meta kernels (FakeTensorMode), as (type, dtype, shape)."""
    with FakeTensorMode():
        q = torch.empty(2, 2, 8, 16, device="cuda")
        out = {"flash": lambda: FORWARD_OPS[kernel](q, q, q, dropout_p, True, False),
               "efficient": lambda: FORWARD_OPS[kernel](q, q, q, None, True, dropout_p, True),
               "cudnn": lambda: FORWARD_OPS[kernel](q, q, q, None, True, dropout_p, True, False)}[kernel]()
    return [(type(o).__name__ if not isinstance(o, torch.Tensor) else "Tensor",
             o.dtype if isinstance(o, torch.Tensor) else o, tuple(o.shape) if isinstance(o, torch.Tensor) else None)
            for o in out]


class _Capture(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self, func):
        super().__init__()
        self.func, self.out = func, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is self.func:
            self.out = out
        return out


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
def test_stand_in_returns_what_torch_says_cuda_returns(kernel, dropout_p):
    """The stand-in is faithful: its return structure is the one torch's meta kernels give a "cuda" tensor."""
    q = torch.randn(2, 2, 8, 16)
    with CudaAttention(), _Capture(FORWARD_OPS[kernel]) as seen:
        attention(q, q, q, kernel, dropout_p, True)
    mine = [(type(o).__name__ if not isinstance(o, torch.Tensor) else "Tensor",
             o.dtype if isinstance(o, torch.Tensor) else o, tuple(o.shape) if isinstance(o, torch.Tensor) else None)
            for o in seen.out]
    assert mine == _fake_cuda_outputs(kernel, dropout_p)


@pytest.mark.parametrize("kernel", KERNELS)
def test_attention_outputs_by_role(kernel, tmp_path):
    """RNG bookkeeping is fingerprinted only when the call draws; unused and debug outputs never are."""
    roles = output_roles(str(FORWARD_OPS[kernel]))
    assert RNG_BOOKKEEPING in roles
    q = torch.randn(2, 2, 8, 16)
    for dropout_p in (0.0, 0.2):
        with CudaAttention(), _Capture(FORWARD_OPS[kernel]) as seen:
            attention(q, q, q, kernel, dropout_p, True)
        args = (q, q, q, dropout_p) if kernel == "flash" else (q, q, q, None, True, dropout_p)
        _, op = _record_one(FORWARD_OPS[kernel], seen.out, tmp_path, args)
        for j, role in enumerate(roles):
            if not isinstance(seen.out[j], torch.Tensor):
                continue
            measured = op.fingerprint[j] is not None
            assert measured == (role == DATA or role == RNG_BOOKKEEPING and dropout_p > 0), (j, role)
            if role == UNUSED:
                assert not measured


# -- end to end: checkpointed attention blocks, recorded and diagnosed -------------------------------------------
class Block(nn.Module):
    def __init__(self, kernel: str, dropout_p: float) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(32, 96), nn.Linear(32, 32)
        self.kernel, self.dropout_p = kernel, dropout_p

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, 2, 16).permute(2, 0, 3, 1, 4)
        o = attention(q, k, v, self.kernel, self.dropout_p, is_causal=True)
        return x + self.proj(o.transpose(1, 2).reshape(b, n, d))


def _sac_context():
    def policy(ctx, func, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if func is torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE
    return create_selective_checkpoint_contexts(policy)


class Net(nn.Module):
    def __init__(self, kernel: str, dropout_p: float, preserve: bool, sac: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(kernel, dropout_p) for _ in range(2))
        self.preserve, self.sac = preserve, sac

    def forward(self, x):
        for layer in self.layers:
            extra = {"context_fn": _sac_context} if self.sac else {}
            x = checkpoint(layer, x, use_reentrant=False, preserve_rng_state=self.preserve, **extra)
        return x


def _step(model: Net) -> list[torch.Tensor]:
    torch.manual_seed(1)
    x = torch.randn(2, 8, 32)
    with CudaAttention():
        model(x).pow(2).sum().backward()
    return [p.grad.clone() for p in model.parameters()]


def _recorded(kernel, dropout_p, preserve, tmp_path, sac=False):
    torch.manual_seed(0)
    model = Net(kernel, dropout_p, preserve, sac)
    path = tmp_path / f"{kernel}.jsonl"
    with ac_diff.record(path) as rec:
        grads = _step(model)
    return rec, read_run(path), grads


@pytest.mark.parametrize("sac", [False, True], ids=["checkpoint", "sac"])
@pytest.mark.parametrize("kernel", KERNELS)
def test_attention_kernels_without_dropout_are_compared_and_clean(kernel, sac, tmp_path):
    rec, run, _ = _recorded(kernel, 0.0, True, tmp_path, sac)
    assert rec.errors == []
    report = ac_diff.diagnose([run])
    assert report.verdict == "clean", report.headline
    assert [r.status for r in report.regions] == ["clean", "clean"]
    ops = [o for o in run.regions[0].forward.ops if o.op == str(FORWARD_OPS[kernel])]
    assert len(ops) == 1 and ops[0].fingerprint[0] is not None  # the attention output itself was compared


@pytest.mark.parametrize("kernel", KERNELS)
def test_dropout_without_rng_state_is_rng_naming_the_attention_op(kernel, tmp_path):
    rec, run, _ = _recorded(kernel, 0.2, False, tmp_path)
    assert rec.errors == []
    report = ac_diff.diagnose([run])
    assert report.verdict == "diverged"
    lead = report.regions[0]
    assert lead.cause.kind == "rng" and str(FORWARD_OPS[kernel]) in lead.cause.detail
    assert any("preserve_rng_state" in s.text for s in lead.suggestions)


@pytest.mark.parametrize("kernel", KERNELS)
def test_dropout_with_rng_state_preserved_is_clean(kernel, tmp_path):
    rec, run, _ = _recorded(kernel, 0.2, True, tmp_path)
    assert rec.errors == []
    assert ac_diff.diagnose([run]).verdict == "clean"


@pytest.mark.parametrize("kernel", KERNELS)
def test_recording_cuda_kernels_changes_no_gradient(kernel, tmp_path):
    torch.manual_seed(0)
    plain = _step(Net(kernel, 0.2, True))
    _, _, recorded = _recorded(kernel, 0.2, True, tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(plain, recorded))


# -- a recorder error is never silent -----------------------------------------------------------------------------
def _broken(*args, **kwargs):
    raise RuntimeError("forced recorder failure")


def test_a_pass_the_recorder_failed_to_finish_is_unchecked_and_fails_check(tmp_path, monkeypatch):
    monkeypatch.setattr(recorder_module, "_fps_by_op", _broken)
    rec, run, _ = _recorded("flash", 0.0, True, tmp_path)
    assert rec.errors and "forced recorder failure" in rec.errors[0]
    assert run.recorder_lost["passes"] == 4
    report = ac_diff.diagnose([run])
    assert report.verdict == "unchecked"
    assert "recorder failed" in report.headline and "regions 0, 1 not compared" in report.headline
    assert all(r.unchecked_reason == "recorder error" for r in report.regions)
    done = subprocess.run([sys.executable, "-m", "ac_diff", "report", str(run.path)], capture_output=True, text=True)
    assert done.returncode == 4, done.stdout + done.stderr


_SCRIPT = """
import torch
from torch.utils.checkpoint import checkpoint
from ac_diff.capture import recorder

def broken(*args, **kwargs):
    raise RuntimeError("forced recorder failure")

recorder._fps_by_op = broken  # the recorder fails while finishing every pass
layer = torch.nn.Linear(8, 8)
x = torch.randn(4, 8, requires_grad=True)
checkpoint(layer, x, use_reentrant=False).sum().backward()
"""


def test_run_check_fails_when_the_recorder_lost_data(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    done = subprocess.run([sys.executable, "-m", "ac_diff", "run", "--check", "-o", str(tmp_path / "out"),
                           str(script)], capture_output=True, text=True)
    assert done.returncode == 4, done.stdout + done.stderr
    assert "recorder failed" in done.stdout and "NOT CHECKED" in done.stdout


def test_an_op_the_recorder_failed_on_leaves_its_region_unchecked(tmp_path, monkeypatch):
    real = recorder_module.Recorder._record

    def fail_in_region_1s_recompute(self, p, func, *args, **kwargs):
        if "addmm" in str(func) and p.phase == "recompute" and p.region.number == 1:
            raise KeyError(1)
        return real(self, p, func, *args, **kwargs)

    monkeypatch.setattr(recorder_module.Recorder, "_record", fail_in_region_1s_recompute)
    _, run, _ = _recorded("efficient", 0.0, True, tmp_path)
    report = ac_diff.diagnose([run])
    assert report.verdict == "unchecked"
    assert [r.status for r in report.regions] == ["clean", "unchecked"]
    assert "the recompute lost 1 op" in report.regions[1].notes[-1] and "KeyError" in report.regions[1].notes[-1]


def test_workspaces_and_partly_written_outputs_are_not_compared_and_an_lstm_ctc_region_is_clean(tmp_path):
    """CTC's log_alpha (saved for its backward) is at::empty, filled only up to each sample's input length: the rest
    held other garbage in the recompute, and a BiLSTM + CTC region was SILENTLY DIVERGED, "a nondeterministic kernel",
    with gradients bit-identical to a run without AC; so was an LSTM by oneDNN's workspace (cuDNN's and MIOpen's RNN
    reserve on a GPU alike). The loss and the RNN's outputs still show any real difference."""
    assert output_roles("aten._ctc_loss.default") == (DATA, UNUSED)
    assert output_roles("aten._ctc_loss.Tensor") == (DATA, UNUSED)
    assert output_roles("aten.mkldnn_rnn_layer.default") == (DATA, DATA, DATA, UNUSED)
    assert output_roles("aten._cudnn_rnn.default") == (DATA, DATA, DATA, UNUSED, DATA)
    torch.manual_seed(0)
    encoder, head = nn.LSTM(8, 8, batch_first=True), nn.Linear(8, 6)

    def region(x, targets, input_lengths, target_lengths):
        log_probs = head(encoder(x)[0]).log_softmax(-1).transpose(0, 1)
        return nn.functional.ctc_loss(log_probs, targets, input_lengths, target_lengths)

    x, targets = torch.randn(3, 12, 8), torch.randint(1, 6, (3, 4))
    lengths, target_lengths = torch.tensor([12, 7, 5]), torch.tensor([4, 3, 2])
    with ac_diff.record(tmp_path / "t.jsonl"):
        for _ in range(2):
            checkpoint(region, x, targets, lengths, target_lengths, use_reentrant=False).backward()
    report = ac_diff.diagnose_paths([tmp_path / "t.jsonl"])
    assert report.verdict == "clean", report.headline
