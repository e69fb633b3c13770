"""Hugging Face transformers: a tiny MoE built from a config (Mixtral, DeepSeek-V3 classes; no download) trained
with `model.gradient_checkpointing_enable(...)` under `ac-diff run`, asserted on the JSON report.

transformers checkpoints `partial(layer.forward, **kwargs)` (not `__call__`), bound by
`gradient_checkpointing_enable` before ac-diff starts; the decoder layer's own hooks run outside the
region. Real mechanisms only: attention dropout / router jitter noise with `preserve_rng_state=False`
in `gradient_checkpointing_kwargs`, DeepSeek-V3's `e_score_correction_bias` updated in a forward hook.
"""

from __future__ import annotations

import sys

import pytest

pytest.importorskip("transformers")

import ac_diff  # noqa: E402
from ac_diff.diagnosis import diagnose  # noqa: E402
from ac_diff.trace import read_run  # noqa: E402
from stacks.runs import STACKS, Job, run_all  # noqa: E402

pytestmark = pytest.mark.e2e
SCRIPT = str(STACKS / "hf_moe.py")
LAYERS = ["model.layers.0", "model.layers.1"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf")
    jobs = {
        "clean": Job([SCRIPT, "--model", "mixtral"]),
        "dropout": Job([SCRIPT, "--model", "mixtral", "--attention-dropout", "0.1", "--no-preserve-rng"]),
        "reentrant_jitter": Job([SCRIPT, "--model", "mixtral", "--reentrant", "--jitter", "0.1", "--no-preserve-rng"]),
        # library use: gradient_checkpointing_enable() binds partial(checkpoint, ...) BEFORE ac_diff.record() starts
        "bias_hook": Job([SCRIPT, "--model", "deepseek_v3", "--bias-update", "forward_hook",
                          "--record-to", str(out / "bias_hook" / "trace-rank0.jsonl")], plain=True),
    }
    return run_all(out, jobs)


def test_clean_run_every_decoder_layer_is_a_region_with_the_models_own_names(runs):
    r = runs["clean"]
    assert r.returncode == 0, r.explain()
    report = r.report
    assert report["verdict"] == "clean", report["headline"]
    assert [g["module"] for g in report["regions"]] == LAYERS
    for g in report["regions"]:
        assert g["kind"] == "checkpoint" and g["status"] == "clean"
        assert g["forward_ops"] > 50 and 0 < g["recompute_ops"] <= g["forward_ops"]
        # the layer's own ops (residual adds) are named in the recompute too: nothing unaligned
        assert set(g["counts"]) <= {"match", "forward_only", "not_recomputed"}, g["counts"]
        assert g["counts"].get("forward_only", 0) == g["counts"]["not_recomputed"]

    ops = ac_diff.load(r.trace_dir).ops
    modules = set(ops.module.dropna())
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.0.mlp.gate", "model.layers.0.mlp.experts",
                 "model.layers.1.post_attention_layernorm", "model.layers.1.mlp.gate"):
        assert name in modules
    regions = ac_diff.load(r.trace_dir).regions
    for _, region in regions.iterrows():  # every op of both passes is named inside its own layer
        mine = ops[ops.region == region.region]
        assert mine.module.notna().all()
        assert mine.module.str.startswith(region.module).all()
    assert set(regions.preserve_rng_state) == {True}


def test_attention_dropout_without_preserved_rng_is_silent_rng_in_self_attn(runs):
    r = runs["dropout"]
    assert r.returncode == 0, r.explain()  # nothing raised: torch cannot see it
    report = r.report
    assert report["verdict"] == "diverged" and report["torch_error"] is None
    for g in report["regions"]:
        assert g["status"] == "diverged" and g["silent"], g["module"]
        assert g["cause"]["kind"] == "rng"
        assert "bernoulli" in g["cause"]["tensor"] or "dropout" in g["cause"]["tensor"]
        assert g["first_value_divergence"]["module"] == f"{g['module']}.self_attn"
        text = " ".join(s["title"] + s["text"] for s in g["suggestions"])
        assert "preserve_rng_state" in text and "gradient_checkpointing_kwargs" in text
    assert ac_diff.load(r.trace_dir).regions.preserve_rng_state.tolist() == [False, False]


def test_reentrant_router_jitter_is_silent_rng_in_the_moe_block(runs):
    r = runs["reentrant_jitter"]
    assert r.returncode == 0, r.explain()
    report = r.report
    assert [g["module"] for g in report["regions"]] == LAYERS
    for g in report["regions"]:
        assert g["kind"] == "reentrant"
        assert g["status"] == "diverged" and g["silent"]
        assert g["cause"]["kind"] == "rng" and "uniform" in g["cause"]["tensor"]
        assert g["first_value_divergence"]["module"] == f"{g['module']}.mlp"


def test_deepseek_bias_updated_in_a_forward_hook_is_state_mutation_of_that_layer(runs):
    r = runs["bias_hook"]
    assert r.returncode == 0, r.explain()  # silent: the routing of this tiny batch keeps every saved shape
    run = read_run(r.trace_dir / "trace-rank0.jsonl")
    # recorded although checkpoint was bound (gradient_checkpointing_enable) before ac_diff.record() started
    assert [g.module for g in run.regions] == LAYERS
    assert all(g.forward is not None and g.recompute is not None for g in run.regions)
    report = diagnose([run])
    assert report.verdict == "diverged"
    assert {g.module for g in report.regions if g.status == "diverged"} == set(LAYERS)
    for g in report.regions:
        assert g.cause.kind == "state_mutation"
        assert g.cause.tensor == f"{g.module}.mlp.gate.e_score_correction_bias"
        assert g.first_value_divergence.module == f"{g.module}.mlp.gate"
        assert "after the backward" in g.suggestions[0].title


def test_reentrant_router_with_in_place_normalisation_is_clean(tmp_path):
    """HF routers normalise top-k weights in place (`router_top_value /= ...sum(...)`), as here."""
    import torch
    import torch.nn as nn
    import torch.utils.checkpoint as cp

    class Router(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = nn.Linear(16, 4, bias=False)

        def forward(self, x):
            top, _ = torch.topk(self.gate(x).softmax(-1), 2, dim=-1)
            top /= top.sum(dim=-1, keepdim=True)
            return x * top.sum(-1, keepdim=True)

    torch.manual_seed(0)
    router, x = Router(), torch.randn(8, 16, requires_grad=True)
    with ac_diff.record(tmp_path / "t.jsonl"):
        cp.checkpoint(router, x, use_reentrant=True).sum().backward()
    run = read_run(tmp_path / "t.jsonl")
    assert [g.kind for g in run.regions] == ["reentrant"]
    report = diagnose([run])
    assert report.verdict == "clean", report.headline


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
