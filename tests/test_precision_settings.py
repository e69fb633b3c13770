"""Settings that choose kernels, changed by the script between a forward and its recompute: fingerprints that do not
depend on them (torch_compat.EXACT_MATMULS), the per-backend precision read where the legacy getter refuses, and a
CPU backend flag (oneDNN) named as the cause."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import ac_diff
from ac_diff.capture import torch_compat
from ac_diff.capture.fingerprint import SMALL, FingerprintBatch
from ac_diff.capture.state import global_state
from ac_diff.trace import read_run

_PER_BACKEND = hasattr(torch._C, "_set_fp32_precision_setter")  # torch >= 2.9: fp32_precision per backend


def _effective() -> str:
    """The precision a float32 matmul runs in now: per backend where torch has those settings (the legacy getter
    goes on reading the legacy setting after they change)."""
    if _PER_BACKEND:
        return ", ".join(f"{b}: {torch._C._get_fp32_precision_getter(b, 'matmul')}" for b in ("cuda", "mkldnn"))
    return torch.get_float32_matmul_precision()


_EXACT = {"highest", "cuda: ieee, mkldnn: ieee"}


@contextlib.contextmanager
def _precision(legacy: str | None = None, **per_backend: str):
    """Set the float32 matmul precision the legacy way or per backend, and put torch's defaults back after."""
    try:
        if legacy is not None:
            torch.set_float32_matmul_precision(legacy)
        for backend, value in per_backend.items():
            getattr(torch.backends, backend).matmul.fp32_precision = value
        yield
    finally:
        if _PER_BACKEND:
            for backend in ("cuda", "mkldnn"):
                torch._C._set_fp32_precision_setter(backend, "matmul", "none")
        torch.set_float32_matmul_precision("highest")


def test_a_fingerprint_is_taken_in_full_precision_whatever_the_script_set(monkeypatch):
    """A script sets "medium" between a forward and its backward (an eval helper): a CPU with bf16 units would then
    run the fingerprint's own matrix-vector product in bfloat16, and values that did not change read as changed.
    Every fingerprint matmul runs exact, and the script's setting is back after."""
    seen = []
    mv = torch.mv

    def watched_mv(*args, **kwargs):
        seen.append(_effective())
        return mv(*args, **kwargs)

    torch.manual_seed(0)
    t = torch.randn(512, 96)  # (past SMALL: reduced by a matrix-vector product when added)
    assert t.numel() * t.element_size() > SMALL
    exact = FingerprintBatch()
    slot = exact.add(t)
    expected = exact.collect()[0][slot]
    with _precision("medium"):
        monkeypatch.setattr(torch, "mv", watched_mv)
        batch = FingerprintBatch()
        slot = batch.add(t)
        monkeypatch.setattr(torch, "mv", mv)
        assert batch.collect()[0][slot] == expected
        assert torch.get_float32_matmul_precision() == "medium"
    assert seen and set(seen) <= _EXACT, seen


def test_the_precision_set_per_backend_is_recorded_and_put_back():
    """Set per backend, the legacy getter raises ("mix of the legacy and new APIs"): the pass still records it, and
    a fingerprint's exact matmuls leave it as the script set it. Before torch 2.9, the legacy setting alone."""
    if _PER_BACKEND:
        with _precision(mkldnn="bf16"):
            before = _effective()
            assert global_state(None)["matmul_precision"] == before and before.endswith("mkldnn: bf16"), before
            with torch_compat.EXACT_MATMULS:
                assert _effective() in _EXACT
            assert _effective() == before
    with _precision("medium"):
        assert global_state(None)["matmul_precision"] == "medium"
        before = _effective()
        with torch_compat.EXACT_MATMULS:
            assert _effective() in _EXACT
        assert torch.get_float32_matmul_precision() == "medium" and _effective() == before


class ConvBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(8, 16, 3, padding=1)
        self.norm = nn.GroupNorm(4, 16)

    def forward(self, x):
        return torch.relu(self.norm(self.conv(x)))


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="a torch built without oneDNN has no such flag")
def test_onednn_turned_off_for_the_backward_is_named(tmp_path):
    """`torch.backends.mkldnn.flags(enabled=False)` around the backward: the recompute's convolution runs ATen's own
    kernel instead of oneDNN's. The report names the flag (the cause where the values differ, a note where this CPU's
    kernels agree), never a nondeterministic kernel."""
    torch.manual_seed(0)
    block, head = ConvBlock(), nn.Conv2d(16, 4, 1)
    with ac_diff.record(tmp_path / "t.jsonl"):
        for _ in range(2):
            x = torch.randn(4, 8, 24, 24)
            loss = head(checkpoint(block, x, use_reentrant=False)).square().mean()
            with torch.backends.mkldnn.flags(enabled=False):
                loss.backward()
    report = ac_diff.diagnose([read_run(tmp_path / "t.jsonl")])
    regions = report.regions
    assert regions and all(r.state_changes.get("mkldnn.enabled") == {"forward": True, "recompute": False}
                           for r in regions), [r.state_changes for r in regions]
    assert all(r.cause is not None and (r.cause.kind, r.cause.tensor) == ("global_state", "mkldnn.enabled")
               for r in regions), [r.cause for r in regions]
    assert "torch.backends.mkldnn.enabled" in report.headline
