"""Full recording reads each pass back asynchronously (fingerprint.Collection) and writes the pass once the copy has
landed, in the order the passes ended: on a GPU that is later, on CPU at once. Here the copies are made to land
late (as on a GPU), and the trace and its diagnosis must be those of an immediate read-back."""

from __future__ import annotations

import pytest
import torch

import ac_diff
from ac_diff.capture import fingerprint
from ac_diff.trace import read_run
from models import VARIANT_PARAMS, VARIANTS, record_step
from models import Net as ModelNet
from test_watch import MECHANISMS, Net, train


def _report(tmp_path, name: str, kwargs: dict):
    torch.manual_seed(0)
    model = Net(**kwargs)
    path = tmp_path / f"{name}.jsonl"
    with ac_diff.record(path):
        train(model, steps=3)
    return ac_diff.diagnose([read_run(path)]).to_json()


def _summary(report: dict) -> list:
    return [report["verdict"]] + [(r["region"], r["module"], r["status"], (r["cause"] or {}).get("kind"),
                                   (r["first_value_divergence"] or {}).get("op"), r["forward_ops"], r["recompute_ops"],
                                   [p["values_differ"] for p in r["positions"]]) for r in report["regions"]]


@pytest.mark.parametrize("name", sorted(MECHANISMS))
def test_a_read_back_that_lands_late_writes_the_same_trace(name, tmp_path, monkeypatch):
    kwargs = MECHANISMS[name][0]
    at_once = _report(tmp_path, f"{name}-now", kwargs)
    landed = []
    monkeypatch.setattr(fingerprint.Collection, "ready", lambda self: landed.append(1) and False)
    late = _report(tmp_path, f"{name}-late", kwargs)
    assert landed, "the read-backs were never asked whether they had landed"
    assert _summary(late) == _summary(at_once)
    assert late["verdict"] == MECHANISMS[name][1]


def test_passes_still_on_their_way_when_the_script_crashes_are_written(tmp_path, monkeypatch):
    monkeypatch.setattr(fingerprint.Collection, "ready", lambda self: False)
    torch.manual_seed(0)
    model = Net(drift_after=2)
    path = tmp_path / "t.jsonl"
    with pytest.raises(RuntimeError, match="stopped"):
        with ac_diff.record(path):
            train(model, steps=2)
            raise RuntimeError("stopped")
    run = read_run(path)
    assert not run.truncated and len(run.regions) == 4
    assert all(r.forward is not None and r.recompute is not None for r in run.regions)
    assert ac_diff.diagnose([run]).verdict == "diverged"


@pytest.mark.parametrize("variant", VARIANT_PARAMS)
def test_every_checkpoint_variant_is_recorded_alike_when_read_backs_land_late(variant, tmp_path, monkeypatch):
    def summary(run) -> list:
        report = ac_diff.diagnose([run]).to_json()
        ops = [[(o.op, o.fingerprint) for o in p.ops] for r in run.regions for p in (r.forward, r.recompute) if p]
        return [_summary(report), ops, [[(q.position, q.fingerprint) for q in r.forward.positions]
                                        for r in run.regions if r.forward]]

    torch.manual_seed(0)
    _, at_once = record_step(ModelNet(VARIANTS[variant]), tmp_path / "now.jsonl", write="all")
    monkeypatch.setattr(fingerprint.Collection, "ready", lambda self: False)
    torch.manual_seed(0)
    _, late = record_step(ModelNet(VARIANTS[variant]), tmp_path / "late.jsonl", write="all")
    assert summary(late) == summary(at_once)
