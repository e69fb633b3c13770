"""Watch mode on a GPU: the batched Triton digest compiles and agrees with the host, and a watched CUDA step
reads nothing back synchronously (scripts/gpu_check.py's watch rows check the examples and the sync counts)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import ac_diff
from ac_diff.capture import fingerprint
from ac_diff.capture.byte_sums import CHUNK, ByteSums, host_reference
from ac_diff.trace import read_run

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from gpu_check import SideStreamStack  # noqa: E402


def test_the_batched_kernel_compiles_and_agrees_with_the_host():
    sums = ByteSums.get()
    assert sums is not None, "the batched digest kernel did not compile or did not agree (see the warning)"
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(64, 48, generator=g).to(torch.bfloat16), torch.randint(0, 9, (1000,), generator=g),
               torch.randn(3, 4096, generator=g), torch.randn(3 * CHUNK + 1028, generator=g)]  # 1, 1, 1, 4 chunks
    got = sums.launch([t.cuda() for t in tensors]).cpu().tolist()
    assert got == [host_reference(t) for t in tensors]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(256, 512), nn.Linear(512, 256)
        self.register_buffer("center", torch.zeros(256))
        self.drift = False

    def forward(self, x):
        if self.drift:
            self.center.add_(0.01)  # updated inside the checkpointed forward: the recompute reads the new value
        return self.down(torch.relu(self.up(x - self.center))) + x


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False)
        return x


def _run(tmp_path, drift: bool, monkeypatch, device: str = "cuda") -> tuple:
    reads = []
    real = fingerprint.to_host
    monkeypatch.setattr(fingerprint, "to_host", lambda t: reads.append(1) or real(t))
    torch.manual_seed(0)
    model = Net().to(device)
    path = tmp_path / f"t{drift}.jsonl"
    with ac_diff.record(path, watch=True, watch_full_steps=0):
        for step in range(3):
            for layer in model.layers:
                layer.drift = drift and step == 1
            model(torch.randn(8, 128, 256, device=device, requires_grad=True)).float().pow(2).mean().backward()
    if device == "cuda":
        torch.cuda.synchronize()
    return ac_diff.diagnose([read_run(path)]), len(reads)


def test_a_watched_cuda_run_is_clean_without_reading_back(tmp_path, monkeypatch):
    report, reads = _run(tmp_path, False, monkeypatch)
    assert report.verdict == "clean", report.headline
    assert report.watch["compared"] == 6 and reads == 0


def test_a_watched_cuda_run_finds_a_buffer_updated_in_the_forward(tmp_path, monkeypatch):
    report, _ = _run(tmp_path, True, monkeypatch)
    assert report.verdict == "diverged", report.headline
    assert {r.module for r in report.regions if r.status == "diverged"} == {"layers.0", "layers.1"}


def test_watched_tensors_from_a_side_stream_over_several_flushes_are_clean(tmp_path):
    torch.manual_seed(0)
    block = SideStreamStack(256).cuda()  # (scripts/gpu_check.py's watch[side stream] model)
    path = tmp_path / "side.jsonl"
    with ac_diff.record(path, watch=True, watch_full_steps=0):
        for _ in range(3):
            x = torch.randn(4, 512, 256, device="cuda", requires_grad=True)
            checkpoint(block, x, use_reentrant=False).pow(2).mean().backward()
    torch.cuda.synchronize()
    report = ac_diff.diagnose([read_run(path)])
    assert report.verdict == "clean", report.headline
    assert report.watch["compared"] == 3
