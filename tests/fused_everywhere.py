"""A pytest plugin (`-p fused_everywhere`, tests/ on the path, TRITON_INTERPRET=1): every tensor a full recording
fingerprints takes the fused kernels' path, the one CUDA tensors take, run on CPU by Triton's interpreter.
tests/test_fused_prints.py runs the diagnosis tests so."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _fused_everywhere(monkeypatch):
    from ac_diff.capture import fingerprint, fused_prints

    prints = fused_prints.FusedPrints(fused_prints._kernels())
    monkeypatch.setattr(fingerprint, "BATCH_CPU", False)
    monkeypatch.setattr(fingerprint, "_fused", lambda t: prints)
    monkeypatch.setattr(fused_prints, "G", 4)  # (fewer programs to interpret; each still strides over many tiles)
