"""ac-diff on CUDA in bf16 with F.scaled_dot_product_attention (the pytest form of scripts/gpu_check.py's checks
1, 3 and 5): each SDPA backend records clean, attention dropout without the RNG state is diagnosed as rng at the
attention op, and the recorder leaves every gradient bit-identical."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as cp

import ac_diff

DIM, HEADS, SEQ, BATCH = 64, 4, 64, 2  # head_dim 16: every fused kernel takes it
ATTENTION_OP_WORDS = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention")


def _backend(name: str):
    from torch.nn.attention import SDPBackend

    attr = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION",
            "math": "MATH"}[name]
    backend = getattr(SDPBackend, attr, None)
    if backend is None:
        pytest.skip(f"this torch has no SDPBackend.{attr}")
    return backend


def _kernel(name: str):
    from torch.nn.attention import sdpa_kernel

    return sdpa_kernel(_backend(name))


def _require(name: str, dropout_p: float = 0.0) -> None:
    """Skip unless the backend runs this attention (forward and backward) on this GPU."""
    q = torch.randn(BATCH, HEADS, SEQ, DIM // HEADS, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with _kernel(name):
                F.scaled_dot_product_attention(q, q, q, dropout_p=dropout_p, is_causal=True).sum().backward()
            torch.cuda.synchronize()
        except RuntimeError as exc:
            pytest.skip(f"SDPA backend {name} not available here: {str(exc).splitlines()[0][:200]}")


class Block(nn.Module):
    def __init__(self, dropout_p: float = 0.0) -> None:
        super().__init__()
        self.dropout_p = dropout_p
        self.norm = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, s, 3, HEADS, d // HEADS).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout_p, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        return x + self.fc(F.gelu(x))


class Net(nn.Module):
    def __init__(self, dropout_p: float = 0.0, preserve_rng_state: bool = True) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(dropout_p) for _ in range(2))
        self.preserve_rng_state = preserve_rng_state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers:
            x = cp.checkpoint(block, x, use_reentrant=False, preserve_rng_state=self.preserve_rng_state)
        return x


def _model(**kw) -> Net:
    torch.manual_seed(0)
    return Net(**kw).to("cuda", torch.bfloat16).train()


def _train(model: Net, backend: str, steps: int = 2, grads: list | None = None) -> None:
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(BATCH, SEQ, DIM, generator=g).to("cuda", torch.bfloat16) for _ in range(steps)]
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    for x in xs:
        with _kernel(backend):  # the forward and the backward (where the recompute runs) alike
            model(x).float().pow(2).mean().backward()
        if grads is not None:
            grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()


def _recorded(tmp_path, model, backend):
    """Train `model` under the recorder with `backend`, diagnose the trace: (report, the trace's notes, recorder
    errors)."""
    with ac_diff.record(tmp_path / "t.jsonl") as rec:
        _train(model, backend)
    runs = ac_diff.read_runs([tmp_path / "t.jsonl"])
    return ac_diff.diagnose(runs), [n for run in runs for n in run.notes], rec.errors


@pytest.mark.parametrize("backend", ["flash", "efficient", "cudnn", "math"])
def test_each_sdpa_backend_records_clean(backend, tmp_path):
    _require(backend)
    report, notes, errors = _recorded(tmp_path, _model(), backend)
    assert errors == [] and notes == [], notes or errors
    assert report.verdict == "clean", report.headline
    assert len(report.regions) == 4 and all(r.status == "clean" for r in report.regions), report.status_counts()


@pytest.mark.parametrize("backend", ["flash", "efficient"])
def test_attention_dropout_without_rng_state_is_rng_at_the_attention_op(backend, tmp_path):
    _require(backend, dropout_p=0.1)
    report, notes, errors = _recorded(tmp_path, _model(dropout_p=0.1, preserve_rng_state=False), backend)
    assert not [n for n in notes if "recorder error" in n] and errors == [], notes
    assert report.verdict == "diverged", report.headline
    lead = report.lead_groups()[0][0]
    assert lead.cause is not None and lead.cause.kind == "rng", lead.cause
    assert any(w in (lead.cause.tensor or "").lower() for w in ATTENTION_OP_WORDS), lead.cause


@pytest.mark.parametrize("backend", ["flash", "efficient"])
def test_attention_dropout_with_rng_state_is_clean(backend, tmp_path):
    _require(backend, dropout_p=0.1)
    report, notes, errors = _recorded(tmp_path, _model(dropout_p=0.1, preserve_rng_state=True), backend)
    assert errors == [] and notes == [], notes or errors
    assert report.verdict == "clean", report.headline
    assert all(r.status == "clean" for r in report.regions), report.status_counts()


def _first_difference(a: list, b: list) -> str | None:
    assert len(a) == len(b)
    for step, (ga, gb) in enumerate(zip(a, b)):
        assert ga.keys() == gb.keys()
        for name in ga:
            if not torch.equal(ga[name], gb[name]):
                return f"step {step}: {name}"
    return None


def test_gradients_are_bit_identical_with_and_without_the_recorder(tmp_path):
    _require("flash")
    plain: list = []
    control: list = []
    recorded: list = []
    _train(_model(), "flash", steps=3, grads=plain)
    _train(_model(), "flash", steps=3, grads=control)
    if _first_difference(plain, control) is not None:
        pytest.skip("two plain runs of the flash backend already differ (a nondeterministic backward)")
    with ac_diff.record(tmp_path / "t.jsonl"):
        _train(_model(), "flash", steps=3, grads=recorded)
    assert _first_difference(plain, recorded) is None
