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


def _record(path, steps: int = 2, options=None):
    torch.manual_seed(0)
    model = Net()
    with ac_diff.record(path, options):
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


def test_compare_of_two_traces_reads_one_region_pair_at_a_time(tmp_path):
    from ac_diff.diagnosis.two_runs import compare_runs

    a = _record(tmp_path / "a.jsonl", steps=2)
    b = _record(tmp_path / "b.jsonl", steps=2)
    with ac_diff.record(tmp_path / "c.jsonl", ac_diff.RecordOptions(write="all")):  # another run: other values
        torch.manual_seed(1)
        model = Net()
        for _ in range(2):
            model(torch.randn(4, 8, requires_grad=True)).sum().backward()
    for other in (b, tmp_path / "c.jsonl"):
        eager = compare_runs(read_run(a), read_run(other)).to_json()
        run_a, run_b = read_run(a, lazy=True), read_run(other, lazy=True)
        passes = [p for run in (run_a, run_b) for r in run.regions for p in (r.forward, r.recompute) if p is not None]
        held = []
        for run in (run_a, run_b):
            def watched(region, loader=run.ops_loader):
                held.append(sum(1 for p in passes if p.ops))
                return loader(region)

            run.ops_loader = watched
        assert compare_runs(run_a, run_b).to_json() == eager
        assert held and max(held) <= 2  # at most the other run's region of the same pair (one pass each)
        assert all(not p.ops for p in passes)
    assert compare_runs(read_run(a), read_run(tmp_path / "c.jsonl")).verdict == DIVERGED


def test_rows_repeated_from_step_to_step_are_one_object(tmp_path):
    """A long run's report holds each distinct position row once, not once per region (memory), and its JSON
    is unchanged."""
    path = _record(tmp_path / "t.jsonl", steps=4, options=ac_diff.RecordOptions(write="all"))
    report = diagnose([read_run(path, lazy=True)])
    clean = [r for r in report.regions if r.module == "clean"]
    assert len(clean) == 4 and all(r.positions for r in clean)
    assert all(a is b for r in clean[1:] for a, b in zip(r.positions, clean[0].positions))
    assert report.to_json() == diagnose([read_run(path)]).to_json()


def test_json_report_is_written_one_region_at_a_time(tmp_path, monkeypatch):
    """The JSON renderer writes exactly json.dumps's text, making each region's dict as it writes it."""
    import json

    from ac_diff.render import RENDERERS, render
    from ac_diff.report import RegionReport

    path = _record(tmp_path / "t.jsonl", steps=3, options=ac_diff.RecordOptions(write="all"))
    report = diagnose([read_run(path, lazy=True)])
    whole = json.dumps(report.to_json(), indent=2, default=str, allow_nan=True) + "\n"
    made, written = [], []
    to_json = RegionReport.to_json
    monkeypatch.setattr(RegionReport, "to_json", lambda self: made.append(len(written)) or to_json(self))
    chunks = RENDERERS["json"].chunks(report)
    for chunk in chunks:
        written.append(chunk)
    assert "".join(written) == whole
    assert len(made) == len(report.regions) > 2
    assert made == sorted(made) and len(set(made)) == len(made)  # each made after the previous one was written
    render(report, "json", path=str(tmp_path / "r.json"))
    assert (tmp_path / "r.json").read_text() == whole


def test_html_report_is_written_one_region_at_a_time(tmp_path, monkeypatch):
    """The HTML page comes in pieces: each region's table row and section is made after the previous piece was
    written, and the pieces make the page render_html gives."""
    from ac_diff.render import RENDERERS, render
    from ac_diff.render import html

    path = _record(tmp_path / "t.jsonl", steps=3, options=ac_diff.RecordOptions(write="all"))
    report = diagnose([read_run(path, lazy=True)])
    whole = html.render_html(report)
    made, written = [], []
    section = html._region_section
    monkeypatch.setattr(html, "_region_section", lambda r, *a, **k: made.append(len(written)) or section(r, *a, **k))
    for chunk in RENDERERS["html"].chunks(report):
        written.append(chunk)
    assert "".join(written) == whole and whole.endswith("</body></html>\n")
    assert len(made) == len(report.regions) > 2 and len(set(made)) == len(made)
    assert sum(chunk.startswith("<tr class=\"region-row") for chunk in written) == len(report.regions)
    render(report, "html", path=str(tmp_path / "r.html"))
    assert (tmp_path / "r.html").read_text() == whole
