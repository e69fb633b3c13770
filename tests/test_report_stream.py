"""`ac-diff report` reads traces lazily (read_run(lazy=True)): the same report as an eager read, with one
region's ops, positions and externals decoded at a time."""

from __future__ import annotations

import gzip
import shutil

import torch
import torch.nn as nn
import torch.utils.checkpoint as cp

import ac_diff
from ac_diff.diagnosis import diagnose
from ac_diff.report import DIVERGED, DAMAGED
from ac_diff.trace import read_run


class Counted(nn.Module):
    """Adds a buffer it bumps in place: the recompute sees the bumped value (a real divergence)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return torch.relu(self.lin(x)) * self.calls


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.clean = nn.Sequential(nn.Linear(8, 8), nn.GELU())
        self.counted = Counted()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = cp.checkpoint(self.clean, x, use_reentrant=False)
        return cp.checkpoint(self.counted, x, use_reentrant=False)


def _record(path, steps: int = 2):
    torch.manual_seed(0)
    model = Net()
    with ac_diff.record(path):
        for _ in range(steps):
            model(torch.randn(4, 8, requires_grad=True)).sum().backward()
    return path


def test_lazy_read_gives_the_eager_report(tmp_path):
    path = _record(tmp_path / "t.jsonl")
    eager = diagnose([read_run(path)])
    lazy = diagnose([read_run(path, lazy=True)])
    assert [r.status for r in lazy.regions].count(DIVERGED) >= 1
    assert lazy.to_json() == eager.to_json()
    # several runs keep their ops for the cross-rank findings: still the same report
    assert diagnose([read_run(path, lazy=True), read_run(path, lazy=True)]).to_json() == \
        diagnose([read_run(path), read_run(path)]).to_json()


def test_one_region_held_at_a_time(tmp_path):
    path = _record(tmp_path / "t.jsonl", steps=3)
    run = read_run(path, lazy=True)
    passes = [p for r in run.regions for p in (r.forward, r.recompute) if p is not None]
    assert passes and all(p.deferred and not p.ops and not p.positions for p in passes)
    loader, held = run.ops_loader, []

    def watched(region):
        held.append(sum(1 for p in passes if p.ops))  # what other regions still hold when this one loads
        return loader(region)

    run.ops_loader = watched
    diagnose([run])
    assert held == [0] * len(run.regions)
    assert all(not p.ops and not p.positions and not p.externals for p in passes)  # dropped after


def test_compressed_trace_is_read_whole(tmp_path):
    path = _record(tmp_path / "t.jsonl")
    packed = tmp_path / "t.jsonl.gz"
    with open(path, "rb") as src, gzip.open(packed, "wb") as dst:
        shutil.copyfileobj(src, dst)
    run = read_run(packed, lazy=True)
    assert run.ops_loader is None
    passes = [p for r in run.regions for p in (r.forward, r.recompute)]
    assert all(p.deferred is None for p in passes) and any(p.ops for p in passes)
    def regions(report):  # each names its file
        return [{k: v for k, v in r.items() if k != "path"} for r in report.to_json()["regions"]]

    assert regions(diagnose([run])) == regions(diagnose([read_run(path)]))


def test_ops_line_changed_after_reading_makes_its_region_damaged(tmp_path):
    path = _record(tmp_path / "t.jsonl")
    run = read_run(path, lazy=True)
    at, _ = run.regions[0].forward.deferred[0]
    with open(path, "r+b") as f:  # the file is rewritten between the index and the diagnosis
        f.seek(at)
        f.write(b"#" * 8)
    report = diagnose([run])
    assert report.regions[0].status == DAMAGED
    assert report.regions[1].status != DAMAGED
