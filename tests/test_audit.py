"""`ac-diff audit`: margins, perturbation replays, extrapolation, the verified save list; the training it
observes stays bit-identical; its predicted flip rate matches the flips a real mechanism causes."""

from __future__ import annotations

import json
import random
import sys

import numpy as np
import pytest
import torch
import torch.utils.checkpoint as cp

from ac_diff.audit import Auditor, AuditSettings, audit_document, parse_noise, parse_scale
from ac_diff.audit.extrapolate import ScaleError
from ac_diff.audit.margins import decision_margins, histogram
from ac_diff.audit.noise import NoiseError, ulp
from conftest import EXAMPLES, REPO, run_cli
from models import VARIANTS, Net, train_step

sys.path.insert(0, str(EXAMPLES))
import tiny_moe  # noqa: E402

FIXED = str(EXAMPLES / "moe_bias_update_fixed.py")


# -- units ------------------------------------------------------------------------------------------
def test_noise_and_scale_forms():
    assert parse_noise("1ulp").kind == "ulp" and parse_noise("4ulps").size == 4
    assert (parse_noise("rel:1e-6").kind, parse_noise("1e-6").kind, parse_noise("abs:1e-3").size) == ("rel", "rel", 1e-3)
    assert parse_noise("realistic").at_origin
    for bad in ("loud", "abs:-1", "xyz:3", "0ulp"):
        with pytest.raises(NoiseError):
            parse_noise(bad)
    assert parse_scale("tokens=8192,layers=48").tokens == 8192
    for bad in ("tokens", "tokens=0", "heads=4", "layers=x"):
        with pytest.raises(ScaleError):
            parse_scale(bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_ulp_is_the_spacing_of_the_dtype(dtype):
    x = torch.tensor([0.3, 1.5, 7.0, 1000.0], dtype=dtype)
    above = torch.nextafter(x.float(), torch.tensor(float("inf"))).to(dtype) if dtype != torch.float32 else None
    expected = (torch.nextafter(x, torch.full_like(x, float("inf"))) - x).double() if above is None else None
    got = ulp(x)
    if expected is not None:
        assert torch.equal(got, expected)
    else:  # bf16/f16: the spacing is eps * 2**(exponent)
        eps = torch.finfo(dtype).eps
        assert torch.allclose(got, torch.tensor([eps / 4, eps, 4 * eps, 512 * eps], dtype=torch.float64))


def test_topk_margin_in_ulps():
    one = ulp(torch.tensor([0.5])).item()
    scores = torch.tensor([[0.5, 0.5 + 3 * one, 0.1, 0.2], [0.9, 0.1, 0.5, 0.2]])
    m = decision_margins("aten.topk.default", torch.ops.aten.topk.default, (scores, 1), {})
    assert m.kind == "chooser" and m.k == 1 and m.candidates == 4
    assert m.ulps[0].item() == pytest.approx(3.0)  # the gap between the first and second, in ulps of 0.5
    assert m.margins[1].item() == pytest.approx(0.4)
    assert histogram(m.ulps)[2] == 1  # (1, 4] ulps
    gt = decision_margins("aten.gt.Scalar", torch.ops.aten.gt.Scalar, (scores, 0.5), {})
    assert gt.kind == "comparison" and gt.margins.numel() == 8 and gt.margins.min().item() == 0.0


# -- the training stays bit-identical ----------------------------------------------------------------
def _state(model):
    return {**{n: p.detach().clone() for n, p in model.named_parameters()},
            **{f"buffer:{n}": b.clone() for n, b in model.named_buffers()}}


def _moe_train(audit: bool, dropout: float):
    args = tiny_moe.ModelArgs(dropout=dropout)
    model = tiny_moe.build_model(args, seed=3)
    torch.manual_seed(7)  # dropout draws from the global generator
    auditor = Auditor(AuditSettings(parse_noise("abs:1e-3"), seeds=2, max_regions=3)) if audit else None
    if auditor:
        auditor.start()
    try:
        losses = tiny_moe.train(model=model, args=args, steps=2, seq_len=64, log=lambda s: None)
    finally:
        if auditor:
            auditor.stop()
    return losses, _state(model), torch.get_rng_state(), auditor


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_moe_training_bit_identical_with_and_without_audit(dropout):
    plain_losses, plain_state, plain_rng, _ = _moe_train(False, dropout)
    losses, state, rng, auditor = _moe_train(True, dropout)
    assert losses == plain_losses
    assert torch.equal(rng, plain_rng)
    assert state.keys() == plain_state.keys()
    for name in state:  # parameters after two optimizer steps, expert_bias, tokens_per_expert
        assert torch.equal(state[name], plain_state[name]), name
    # and the audit did replay regions and perturb them (a test that cannot fail is no test)
    assert len(auditor.regions) == 3 and all(r.flips for r in auditor.regions)
    assert any(sum(s.flips) for s in auditor.sites.values())


class _WrappedVar:
    """A context variable behind a wrapper object (transformers' CompileableContextVar)."""

    def __init__(self, name: str) -> None:
        import contextvars

        self.context_var = contextvars.ContextVar(name, default=None)

    def get(self):
        return self.context_var.get()

    def set(self, value):
        return self.context_var.set(value)

    def reset(self, token):
        self.context_var.reset(token)


_COLLECTOR = _WrappedVar("router_logits_collector")


def _collect_logits(module, args, output):
    collected = _COLLECTOR.get()
    if collected is not None:
        collected["router_logits"].append(output)


class _ContextCollectedMoE(torch.nn.Module):
    """Two checkpointed top-1 MoE layers whose gates' forward hooks append their logits to a collector the model's
    forward sets in a context variable (transformers' output capturing), for a load-balancing loss."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_ContextGatedLayer() for _ in range(2))
        for layer in self.layers:
            layer.gate.register_forward_hook(_collect_logits)

    def forward(self, x):
        token = _COLLECTOR.set({"router_logits": []})
        try:
            for layer in self.layers:
                x = cp.checkpoint(layer, x, use_reentrant=False)
            logits = torch.cat(_COLLECTOR.get()["router_logits"])
        finally:
            _COLLECTOR.reset(token)
        return x, logits.softmax(-1).mean(0).square().sum() * len(logits)


class _ContextGatedLayer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate, self.experts = torch.nn.Linear(16, 4), torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(4))

    def forward(self, x):
        choice = self.gate(x).topk(1, dim=-1).indices[:, 0]
        return x + torch.stack([self.experts[int(c)](row) for c, row in zip(choice, x)])


def _two_steps(model: torch.nn.Module, loss_of, audit: bool) -> tuple:
    """Two SGD steps of `model` (`loss_of(model)`: a step's loss), audited or not: (losses, state, auditor)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    auditor = Auditor(AuditSettings(parse_noise("abs:1e-3"), seeds=2, max_regions=2)).start() if audit else None
    losses = []
    try:
        for _ in range(2):
            loss = loss_of(model)
            loss.backward()
            opt.step(), opt.zero_grad()
            losses.append(loss.item())
    finally:
        if auditor:
            auditor.stop()
    return losses, _state(model), auditor


def _context_collected_train(audit: bool):
    torch.manual_seed(0)

    def loss_of(model):
        out, aux = model(torch.randn(12, 16))
        return out.square().mean() + 0.1 * aux

    return _two_steps(_ContextCollectedMoE(), loss_of, audit)


def test_the_replays_leave_nothing_in_an_output_collector_the_hooks_fill():
    """33d: HF Mixtral with output_router_logits: each gate's forward hook appends its logits to the collector the
    model's forward holds in a context variable, for the aux loss. The audit's replays of a layer ran those hooks
    too: the aux loss counted their logits, and 17 of 21 gradients differed from the run without the audit."""
    plain_losses, plain_state, _ = _context_collected_train(False)
    losses, state, auditor = _context_collected_train(True)
    assert len(auditor.regions) == 2  # (it replayed: a test that cannot fail is no test)
    assert losses == plain_losses
    for name in state:
        assert torch.equal(state[name], plain_state[name]), name


@pytest.mark.parametrize("preserve_rng_state", [False, True])
def test_audit_leads_with_a_divergence_the_run_already_has(preserve_rng_state):
    """Dropout in checkpointed blocks without their RNG state (examples/dropout_no_rng.py's mechanism): every
    recompute draws another mask, so the run diverges now; the replays (which start from the forward's RNG state)
    cannot see it, and the audit said "CheckpointError unlikely" alone. Its first line now says so, and the control
    run (RNG state preserved) is checked and found clean."""
    from io import StringIO

    from rich.console import Console

    from ac_diff.audit.render import render_audit

    args = tiny_moe.ModelArgs(dropout=0.1)
    model = tiny_moe.build_model(args, seed=3, preserve_rng_state=preserve_rng_state)
    auditor = Auditor(AuditSettings(parse_noise("1ulp"), seeds=1, max_regions=1)).start()
    try:
        tiny_moe.train(model=model, args=args, steps=2, seq_len=32, log=lambda s: None)
    finally:
        auditor.stop()
    a = audit_document(auditor, parse_scale(None), target="my train.py", wall_seconds=1.0)["audit"]
    out = StringIO()
    render_audit({"audit": a}, Console(file=out, width=800, color_system=None))
    first = out.getvalue().splitlines()[0]
    check = a["recompute"]
    assert check["checked"] == 4  # 2 blocks x 2 steps, every one compared (not only the replayed one)
    if preserve_rng_state:
        assert check["diverged_count"] == 0
        # (tiny_moe counts tokens per expert in a buffer its forward updates: the recompute counts them again)
        assert a["headline"] == a["extrapolation"]["headline"] + "; but " + check["state_note"], a["headline"]
        assert "(first: layers.0, region 0: `moe.tokens_per_expert`)" in check["state_note"], check["state_note"]
        assert first.startswith("ac-diff audit:")
        out = StringIO()  # a narrow terminal: rich cut the module names to "l…" (a site per line now)
        render_audit({"audit": a}, Console(file=out, width=60, color_system=None))
        sites = [s["module"] for s in a["sites"] if s["kind"]]
        assert sites and all(f"{m}  topk" in out.getvalue() for m in sites), out.getvalue()
        return
    assert check["diverged_count"] == 4 and [r["region"] for r in check["diverged"]] == [0, 1, 2, 3]
    assert {r["how"] for r in check["diverged"]} == {"values"}  # same shapes: torch raises nothing
    assert a["headline"] == check["headline"] and first == a["headline"]
    assert first.startswith("the run already diverges: 4 of 4 recomputed region(s)") and "gradients are wrong" in first
    # (a top-k whose same choices came in another order differs too, and reaches no gradient when they are summed:
    # 25j's order-only router read "the gradients are wrong now" over bit-identical ones)
    assert "unless what differs reaches none of them (the same top-k choices in another order" in first
    # a save list only guards the decisions against rounding noise: never offered as the fix of that divergence
    assert a["remedy"]["save_list"] and "fix: save" not in out.getvalue(), out.getvalue()
    assert "fix: against rounding noise only, not the divergence above" in out.getvalue(), out.getvalue()
    assert "`ac-diff run 'my train.py'`" in first


@pytest.mark.parametrize("segments", [True, False])
def test_batch_norms_running_statistics_do_not_make_the_audit_say_the_run_diverges(segments):
    """A ResNet-like stack with batch norm in training, checkpoint_sequential or a checkpoint per block: each pass
    updates the running statistics the norm saves (and its backward does not read), so the recompute saved other
    values there; `audit --check` said "the run already diverges ... the gradients are wrong now" (exit 1) where
    `run` was clean and the gradients bit-identical."""
    from torch.utils.checkpoint import checkpoint, checkpoint_sequential

    torch.manual_seed(0)
    blocks = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Conv2d(4, 4, 3, padding=1), torch.nn.BatchNorm2d(4),
                                                       torch.nn.ReLU()) for _ in range(4)))
    auditor = Auditor(AuditSettings(parse_noise("1ulp"), seeds=1, max_regions=1)).start()
    try:
        for _ in range(2):
            x = torch.randn(2, 4, 6, 6, requires_grad=True)
            out = (checkpoint_sequential(blocks, 2, x, use_reentrant=False) if segments else
                   torch.nn.Sequential(*(_Checkpointed(b, checkpoint) for b in blocks))(x))
            out.square().mean().backward()
    finally:
        auditor.stop()
    check = audit_document(auditor, parse_scale(None), target="train.py", wall_seconds=1.0)["audit"]["recompute"]
    assert check["checked"] > 0 and check["diverged_count"] == 0, check


class _Checkpointed(torch.nn.Module):
    def __init__(self, block, checkpoint) -> None:
        super().__init__()
        self.block, self.checkpoint = block, checkpoint

    def forward(self, x):
        return self.checkpoint(self.block, x, use_reentrant=False)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_gradients_bit_identical_for_every_checkpoint_variant(variant):
    torch.manual_seed(1)
    model = Net(VARIANTS[variant])
    plain = train_step(model)
    for p in model.parameters():
        p.grad = None
    auditor = Auditor(AuditSettings(parse_noise("1ulp"), seeds=1)).start()
    try:
        audited = train_step(model)  # selective AC: the replay must not consume the policy's saved ops
    finally:
        auditor.stop()
    assert torch.equal(plain[0], audited[0])
    for name in plain[1]:
        assert torch.equal(plain[1][name], audited[1][name]), name
    assert [r.module for r in auditor.regions] == ["layers.0", "layers.1"]
    # every variant recomputes what its forward saved: none is said to diverge (reentrant ones: by their outputs)
    check = auditor.recompute.result()
    assert check["diverged_count"] == 0 and check["checked"] == 2, check
    assert auditor.notes == ([] if variant != "sac" else [
        "selective AC: the replays serve the outputs of aten.addmm.default from the forward, as the policy's cache "
        "does (every call of these ops)"])


# -- predictions against a real mechanism -------------------------------------------------------------
@pytest.mark.e2e  # trains the broken and the fixed example several times (~40 s on 2 cores)
def test_predicted_flip_rate_matches_the_real_bias_update():
    """The broken example moves expert_bias by about 1e-3 between forward and recompute; the audit of the fixed
    example with that much noise must predict the share of routing rows that really flip (within 2x)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import audit_calibration as cal

    observed = [cal.observe_bias(seed, steps=2) for seed in (0, 1)]
    sigma = sum(o["bias_change_rms"] for o in observed) / len(observed)
    assert 5e-4 < sigma < 2e-3  # torchtitan's coefficient: each expert moves by about 1e-3
    predicted = [cal.predict(seed, steps=2, noise=f"abs:{sigma:.3g}", audit_seeds=2) for seed in (0, 1)]
    real = sum(o["flips"] for o in observed) / sum(o["rows"] for o in observed)
    seen = sum(p["flips"] for p in predicted) / sum(p["rows"] for p in predicted)
    model = sum(p["model_rate"] * p["rows"] for p in predicted) / sum(p["rows"] for p in predicted)
    assert real > 0.003, real  # real flips happened
    assert 0.5 < seen / real < 2.0, (seen, real)
    assert 0.5 < model / real < 2.0, (model, real)


# -- the command ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fixed_audit(tmp_path_factory):
    out = tmp_path_factory.mktemp("audit")
    proc = run_cli("audit", "--noise", "abs:1e-3", "--scale", "tokens=8192,layers=48", "--check", "--json",
                   str(out / "a.json"), "--html", str(out / "a.html"), FIXED, "--steps", "2", cwd=REPO)
    return proc, json.loads((out / "a.json").read_text()), (out / "a.html").read_text()


def test_audit_of_the_fixed_example(fixed_audit):
    proc, doc, page = fixed_audit
    assert doc["format"] == "ac-diff-audit" and doc["version"] == 1
    a = doc["audit"]
    topk = [s for s in a["sites"] if s["op"] == "aten.topk.default"]
    assert [s["module"] for s in topk] == ["layers.0.moe.router", "layers.1.moe.router"]
    for s in topk:
        assert s["kind"] == "chooser" and s["dtype"] == "float32" and s["candidates"] == 8 and s["k"] == 2
        assert s["noise_into"] == "aten.add.Tensor"  # scores + expert_bias: what topk reads
        assert s["rows"] == 512 and sum(s["margins"]["histogram"]) == 512
        assert 0 < s["observed_rate"] < 0.1 and s["consequence"] == "CheckpointError"
    # histc of the chosen ids and the argsort flip only with topk: no margin of their own
    assert {s["op"] for s in a["sites"] if s["kind"] is None} >= {"aten.histc.default", "aten.sort.stable"}
    r = a["remedy"]
    assert r["save_list"] == ["aten.topk.default"] and r["verified"] and r["flips_with_save_list"] == 0
    assert r["bytes_per_region"] == 256 * 2 * (4 + 8)  # topk's values (f32) and indices (i64)
    risk = a["extrapolation"]
    assert risk["expected_flips_per_step"] > 100 and risk["p_checkpoint_error"] > 0.99
    # the fixed example's recomputes reproduce their forwards: the prediction is the headline, with the buffer its
    # recompute updates a second time (the tokens counted per expert, as `ac-diff run` notes too)
    check = a["recompute"]
    assert check["checked"] > 0 and check["diverged_count"] == 0
    assert a["headline"] == risk["headline"] + "; but " + check["state_note"], a["headline"]
    assert "`moe.tokens_per_expert`" in check["state_note"]
    assert proc.returncode == 1, proc.stderr[-2000:]  # --check: a CheckpointError is predicted at that scale
    assert "CheckpointError almost certain" in proc.stdout and "fix: save aten.topk.default" in proc.stdout
    # the HTML page: one margin plot per site with margins, the headline, the policy
    assert page.count("<svg") == 2 and risk["headline"] in page and "torch.ops.aten.topk.default" in page


def test_check_passes_when_no_flip_is_predicted(tmp_path):
    proc = run_cli("audit", "--check", "--max-regions", "2", "--seeds", "1", "--json", str(tmp_path / "a.json"),
                   FIXED, "--steps", "1", cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    a = json.loads((tmp_path / "a.json").read_text())["audit"]
    assert a["noise"] == "1ulp" and a["regions_audited"] == 2
    assert a["extrapolation"]["p_checkpoint_error"] < 0.5
    assert all(s["observed_rate"] == 0 for s in a["sites"])


def test_the_broken_example_still_fails_as_without_audit(tmp_path):
    proc = run_cli("audit", "--max-regions", "2", "--seeds", "1", str(EXAMPLES / "moe_bias_update.py"), cwd=REPO)
    assert proc.returncode == 1 and "CheckpointError" in proc.stderr


@pytest.mark.parametrize("args, message", [
    (["--noise", "loud"], "--noise 'loud' is not a noise size"),
    (["--scale", "heads=4"], "--scale 'heads=4'"),
])
def test_bad_options_one_line_exit_2(args, message):
    proc = run_cli("audit", *args, FIXED, cwd=REPO)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_audit_document_without_regions():
    auditor = Auditor(AuditSettings(parse_noise("1ulp")))
    doc = audit_document(auditor, parse_scale(None), target="x.py", wall_seconds=0.0)
    assert doc["audit"]["sites"] == [] and doc["audit"]["extrapolation"]["expected_flips_per_step"] == 0
    assert doc["audit"]["headline"].startswith("nothing audited: no checkpointed region ran")
    # a script that stopped before any region (a DDP script started without torchrun): no reassuring prediction
    doc = audit_document(auditor, parse_scale(None), target="x.py", wall_seconds=0.0, exit_code=1)
    assert doc["audit"]["headline"].startswith("nothing audited: the script stopped (exit 1) before any")


# -- the stacks: their consequence agrees with what their real mechanism does ----------------------------
@pytest.mark.e2e
def test_audit_on_the_hf_deepseek_stack_predicts_silent_flips(tmp_path):
    """transformers' grouped-mm experts keep every saved shape when routing flips: the real bias update of this
    stack diverges silently (tests/test_stack_hf.py), and the audit says a flip is silent."""
    pytest.importorskip("transformers")
    from stacks.runs import STACKS

    proc = run_cli("audit", "--noise", "abs:1e-3", "--seeds", "2", "--check", "--scale", "tokens=65536,layers=61",
                   "--json", str(tmp_path / "a.json"), str(STACKS / "hf_moe.py"), "--model", "deepseek_v3", cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]  # --check: flips predicted, but none changes a shape
    a = json.loads((tmp_path / "a.json").read_text())["audit"]
    routers = [s for s in a["sites"] if s["kind"] == "chooser"]
    assert {s["module"] for s in routers} == {"model.layers.0.mlp.gate", "model.layers.1.mlp.gate"}
    assert sum(sum(s["flips_per_seed"]) for s in routers) > 0
    assert {s["consequence"] for s in routers} == {"silent"}
    assert a["extrapolation"]["expected_flips_per_step"] > 1 and a["extrapolation"]["p_checkpoint_error"] == 0
    assert a["remedy"]["verified"] and a["remedy"]["save_list"] == ["aten.topk.default"]


@pytest.mark.e2e
def test_audit_on_the_torchtitan_like_stack_with_selective_ac(tmp_path):
    """`-m` like `run`; op-level selective AC saves the matmuls: the replays must not consume its cache (the
    training finishes) and a routing flip is a CheckpointError, as the real forward-hook bias update shows."""
    import os

    from stacks.runs import STACKS

    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(STACKS), str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = run_cli("audit", "--noise", "abs:1e-3", "--seeds", "2", "--json", str(tmp_path / "a.json"),
                   "-m", "titanlike.train", "--steps", "2", cwd=STACKS, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    a = json.loads((tmp_path / "a.json").read_text())["audit"]
    routers = [s for s in a["sites"] if s["kind"] == "chooser"]
    assert {s["module"] for s in routers} == {"layers.0.moe.router", "layers.1.moe.router"}
    assert {s["consequence"] for s in routers} == {"CheckpointError"}
    assert a["remedy"]["verified"]
    # noise at the matmul that makes the router's scores: the policy saves that mm, so the recompute reads the
    # forward's scores and no noise reaches the decision
    proc = run_cli("audit", "--noise", "realistic", "--seeds", "1", "--max-regions", "2", "--json", str(tmp_path / "r.json"),
                   "-m", "titanlike.train", "--steps", "1", cwd=STACKS, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    a = json.loads((tmp_path / "r.json").read_text())["audit"]
    routers = [s for s in a["sites"] if s["kind"] == "chooser"]
    assert routers and all(s["noise_into"] == "aten.mm.default" and s["score_noise_rms"] == 0 for s in routers)
    assert a["remedy"]["save_list"] == [] and any(n.startswith("selective AC") for n in a["notes"])


@pytest.mark.e2e
@pytest.mark.parametrize("launcher", ["torchrun", "ac-diff"])
def test_audit_under_torchrun_with_tensor_parallel_collectives(tmp_path, launcher):
    """Each rank replays its regions (which all_reduce inside) the same number of times: no rank waits forever.
    `ac-diff audit --nproc-per-node 2` launches the same (it took no such option, unlike run and fix)."""
    import os
    import subprocess

    launch = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "ac_diff",
               "audit"] if launcher == "torchrun" else [sys.executable, "-m", "ac_diff", "audit", "--nproc-per-node", "2"])
    cmd = [*launch, "--noise", "abs:1e-3", "--seeds", "2", "--max-regions", "2", "--json", str(tmp_path / "tp.json"),
           str(EXAMPLES / "distributed_tp.py"), "--steps", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    docs = [json.loads((tmp_path / f"tp-rank{r}.json").read_text())["audit"] for r in (0, 1)]
    for a in docs:
        assert a["regions_audited"] == 2 and any("run collectives" in n for n in a["notes"])
        assert {s["module"] for s in a["sites"] if s["kind"] == "chooser"} == {"layers.0.moe.router", "layers.1.moe.router"}
    # the router is replicated and both ranks read the same batch: the same margins on both
    assert [s["margins"] for s in docs[0]["sites"] if s["kind"]] == [s["margins"] for s in docs[1]["sites"] if s["kind"]]
    assert f"[rank1] ac-diff audit: {docs[1]['headline']}" in proc.stderr  # rank 1's finding, not only in its JSON


def _audited(block, inputs: list, seeds: int, max_regions: int, script: list[str] | None = None) -> dict:
    """The audit of `block` checkpointed once per input, each backpropagated from its output's sum."""
    from torch.utils.checkpoint import checkpoint

    auditor = Auditor(AuditSettings(parse_noise("1ulp"), seeds=seeds, max_regions=max_regions)).start()
    try:
        for x in inputs:
            checkpoint(block, x, use_reentrant=False).sum().backward()
    finally:
        auditor.stop()
    return audit_document(auditor, parse_scale(None), target="t.py", wall_seconds=1.0, script=script)["audit"]


class _MaxPool(torch.nn.Module):
    """A head that keeps each row's largest score (`max(dim)`: the chooser reduces its dim away)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, x):
        return self.proj(x).max(-1)[0]


def test_a_chooser_that_reduces_its_dim_is_audited_by_row():
    """max(dim) without keepdim returns one index per row: the audit indexed the reduced dim of that output, raised
    IndexError in every region ("not audited"), then said "no checkpointed region ran"."""
    torch.manual_seed(0)
    block, x = _MaxPool(), torch.randn(32, 16, requires_grad=True)
    a = _audited(block, [x, x], seeds=2, max_regions=2)
    assert a["regions_audited"] == 2 and not a["notes"], a["notes"]
    (site,) = [s for s in a["sites"] if s["kind"]]
    assert site["op"] == "aten.max.dim" and site["rows"] == 64, site


def test_an_audit_of_a_run_that_stopped_before_any_recompute_is_no_all_clear():
    """The script's backward raised (the region's input was modified in place after its forward, torch's version
    check), so no region was recomputed: the audit led with "CheckpointError unlikely"."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    block = _MaxPool()
    auditor = Auditor(AuditSettings(parse_noise("1ulp"), seeds=1, max_regions=1)).start()
    try:
        memory = torch.randn(32, 16, requires_grad=True) * 1.0
        out = checkpoint(block, memory, use_reentrant=False)
        with torch.no_grad():
            memory.add_(1.0)  # a memory updated in place before the backward
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.sum().backward()
    finally:
        auditor.stop()
    a = audit_document(auditor, parse_scale(None), target="t.py", wall_seconds=1.0, exit_code=1)["audit"]
    assert a["regions_audited"] == 1 and a["recompute"]["checked"] == 0
    assert a["headline"].startswith("the script stopped (exit 1): no region was recomputed, so none was checked"), \
        a["headline"]
    assert a["extrapolation"]["unchecked"]


class _Switch(torch.nn.Module):
    """A top-1 router that takes its gate with `max(dim)` and its expert with `argmax` of the same probabilities."""

    def __init__(self) -> None:
        super().__init__()
        self.router, self.experts = torch.nn.Linear(16, 4), torch.nn.Linear(16, 64)

    def forward(self, x):
        probs = self.router(x).softmax(-1)
        gate, expert = probs.max(-1)[0], probs.argmax(-1)
        chosen = self.experts(x).view(-1, 4, 16) * torch.nn.functional.one_hot(expert, 4)[..., None]
        return chosen.sum(1) * gate[:, None]


def test_two_ops_that_make_one_decision_on_the_same_scores_are_counted_once():
    """`argmax` and `max(dim)` of one router's probabilities flip together: the prediction counts that decision once
    (it summed both, doubling the flips to expect), and the second site says which one it repeats."""
    torch.manual_seed(0)
    block, x = _Switch(), torch.randn(64, 16, requires_grad=True)
    a = _audited(block, [x, x], seeds=2, max_regions=2)
    sites = {s["op"]: s for s in a["sites"] if s["kind"]}
    assert set(sites) == {"aten.max.dim", "aten.argmax.default"}, list(sites)
    assert sites["aten.argmax.default"]["same_as"] == "aten.max.dim" and sites["aten.max.dim"]["same_as"] is None
    (kind,) = a["extrapolation"]["kinds"]
    assert kind["site"].endswith(" max") and kind["rows_per_call"] == 64, kind


class _FadeIn(torch.nn.Module):
    """A ProGAN fade-in: counts the images it has seen in its forward and blends by alpha = min(1, seen / ramp)."""

    def __init__(self) -> None:
        super().__init__()
        self.old, self.new, self.imgs_seen = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16), 0

    def forward(self, x):
        self.imgs_seen += x.shape[0]
        alpha = min(1.0, self.imgs_seen / 64)
        return (1 - alpha) * self.old(x) + alpha * torch.tanh(self.new(x))


@pytest.mark.parametrize("counting", [True, False])
def test_an_audit_says_which_recomputes_update_python_state_a_second_time(counting):
    """The recompute counts the images again: its saved tensors match the forward's (the scalar blend saves none), so
    the margins' prediction read as an all-clear while the gradients differ from a run without AC from step 2 on.
    The headline adds what the replays cannot see; a block whose forward updates nothing gets no such line."""
    torch.manual_seed(0)
    block = _FadeIn() if counting else torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh())
    a = _audited(block, [torch.randn(8, 16, requires_grad=True) for _ in range(3)], seeds=1, max_regions=2,
                 script=["-m", "pkg.train", "--lr", "3"])
    assert a["recompute"]["diverged_count"] == 0
    if counting:  # (the command it suggests runs the script as the audit did, 27g: `-m` and its arguments dropped)
        assert "`ac-diff run --reference no-ac --reference-steps 3 -m pkg.train --lr 3`" in a["headline"], a["headline"]
        assert a["recompute"]["state_twice_count"] == 3, a["recompute"]
        assert a["recompute"]["state_twice"][0]["names"] == ["imgs_seen"]
        assert "; but 3 recompute(s) updated state of their module (Python attributes, buffers) or a host generator " \
            "a second time" in a["headline"], a["headline"]
        assert block.imgs_seen == 8 * 6  # (the replays left it as the training made it: forward and recompute)
    else:
        assert a["recompute"]["state_twice_count"] == 0 and "a second time" not in a["headline"]


@pytest.mark.parametrize("training", [True, False])
def test_an_audit_counts_buffers_its_recompute_updates_a_second_time(training):
    """A batch norm in training inside the region: the recompute applies its running-statistics update a second time
    (momentum twice per step: the statistics an evaluation reads differ from a run without AC). The audit counted
    Python attributes only and said nothing (24f). In eval mode nothing is written: no such line."""
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16), torch.nn.Tanh()).train(training)
    plain = torch.nn.BatchNorm1d(16).train(training)
    a = _audited(block, [torch.randn(8, 16, requires_grad=True) for _ in range(2)], seeds=1, max_regions=2)
    assert block[1].num_batches_tracked.item() == (4 if training else 0)  # (forward and recompute, per call)
    assert plain.num_batches_tracked.item() == 0
    if training:
        assert a["recompute"]["state_twice_count"] == 2, a["recompute"]
        assert a["recompute"]["state_twice"][0]["names"] == ["1.num_batches_tracked", "1.running_mean",
                                                             "1.running_var"], a["recompute"]["state_twice"]
        assert "`1.num_batches_tracked`, `1.running_mean`" in a["headline"], a["headline"]
    else:
        assert a["recompute"]["state_twice_count"] == 0 and "a second time" not in a["headline"]


class _QuarterScores(torch.nn.Module):
    """Keeps the tokens whose score, a sum of four quarters (exact in any order), is at least 0: many scores are 0,
    exactly on the threshold, and no reduction order can move them."""

    def forward(self, x):
        score = (torch.round(x * 4) / 4).sum(-1)
        return x * (score >= 0).unsqueeze(-1)


def test_exact_scores_on_their_threshold_are_no_near_ties():
    """A control whose recompute cannot differ: 1-ulp noise moved the exact zeros across `>= 0`, and `audit --check`
    said "CheckpointError almost certain" (exit 1) on a run whose gradients are bit-identical. Rounding noise leaves
    exact values alone; a drift the user names (abs) still moves them."""
    from ac_diff.audit.noise import exact_values
    from torch.utils.checkpoint import checkpoint

    assert exact_values(torch.tensor([0.0, 0.25, -3.5, 100.75]))
    assert not exact_values(torch.randn(64)) and not exact_values(torch.tensor([0.0, 0.5], dtype=torch.bfloat16))

    def audit(noise: str) -> dict:
        torch.manual_seed(0)
        auditor = Auditor(AuditSettings(parse_noise(noise), seeds=2, max_regions=1)).start()
        try:
            checkpoint(_QuarterScores(), torch.randn(256, 4, requires_grad=True), use_reentrant=False).sum().backward()
        finally:
            auditor.stop()
        (site,) = audit_document(auditor, parse_scale(None), target="t.py", wall_seconds=1.0)["audit"]["sites"]
        return site

    site = audit("1ulp")
    assert site["margins"]["exact"] and site["margins"]["min_ulps"] is None, site["margins"]
    assert site["flips_per_seed"] == [0, 0] and site["rate"] == 0, site
    assert any(audit("abs:1e-3")["flips_per_seed"])  # (the zeros on the threshold do move under a named drift)


class _Bf16Router(torch.nn.Module):
    """A router whose logits are bf16 (autocast) and whose top-2 is taken of `.float().softmax()`: about one row in a
    hundred holds an exact tie of two bf16 logits, which float32 rounding noise added after the cast always breaks."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(64, 8, bias=False)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = self.gate(x)
        return x * logits.float().softmax(-1).topk(2, dim=-1).values.sum(-1, keepdim=True)


def _reordered_flips(x: torch.Tensor, weight: torch.Tensor) -> tuple[int, int]:
    """(top-2 rows that change, rows) when the bf16 logits are summed in another order (two halves of K, each in
    float32, as another kernel would): what a recompute that rounds otherwise really does."""
    xb, wb = x.bfloat16(), weight.bfloat16()
    kernel = (xb @ wb.T).float().softmax(-1).topk(2, dim=-1).indices
    xf, wf = xb.float(), wb.float()
    halves = (xf[:, :32] @ wf[:, :32].T + xf[:, 32:] @ wf[:, 32:].T).bfloat16()
    other = halves.float().softmax(-1).topk(2, dim=-1).indices
    return int((kernel != other).any(-1).sum()), x.shape[0]


def test_rounding_noise_enters_bf16_scores_before_their_rounding():
    """A clean bf16 router (24f): 1-ulp float32 noise went into the softmax after the cast, broke the exact ties of
    bf16 logits, and `audit --check` said "CheckpointError likely" (0.26% of rows) where summing in another order flips
    no row. The noise now goes into the matmul that made the bf16 logits, as a float32 ulp before their rounding."""
    from ac_diff.audit.noise import perturb
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    router, x = _Bf16Router(), torch.randn(1024, 64)
    scores = router.gate(x).detach().bfloat16().float().softmax(-1)
    ties = int((scores.topk(3, dim=-1).values.diff(dim=-1) == 0).any(-1).sum())
    assert ties >= 5, ties  # (the case: exact ties among the first three scores)
    flips, rows = _reordered_flips(x, router.gate.weight.detach())
    assert flips <= 2, (flips, rows)

    auditor = Auditor(AuditSettings(parse_noise("1ulp"), seeds=3, max_regions=1)).start()
    try:
        checkpoint(router, x.requires_grad_(), use_reentrant=False).sum().backward()
    finally:
        auditor.stop()
    doc = audit_document(auditor, parse_scale(None), target="t.py", wall_seconds=1.0)["audit"]
    (site,) = [s for s in doc["sites"] if s["op"] == "aten.topk.default"]
    assert site["noise_into"] == "aten.mm.default", site
    assert site["margins"]["within_1ulp"] > 0, site["margins"]  # (the ties are there, and counted)
    assert sum(site["flips_per_seed"]) <= 2 and site["rate"] * rows <= 2, site

    out = torch.randn(4096).bfloat16()
    moved = perturb(out, parse_noise("1ulp"), torch.Generator().manual_seed(0))
    assert moved.dtype == torch.bfloat16 and int((moved != 0).sum()) <= 8  # (2**-16 of the elements, at 1 ulp of f32)
    assert int((perturb(out, parse_noise("256ulp"), torch.Generator().manual_seed(0)) != 0).sum()) > 8


class _BiasInForward(torch.nn.Module):
    """A router whose load-balancing bias is updated in place inside its own forward (the recompute updates it again):
    each replay of the region writes it too."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(16, 8, bias=False)
        self.register_buffer("expert_bias", torch.zeros(8))

    def forward(self, x):
        scores = self.gate(x) + self.expert_bias
        idx = scores.topk(2, dim=-1).indices
        counts = torch.bincount(idx.flatten(), minlength=8).float()
        with torch.no_grad():
            self.expert_bias.add_(0.05 * torch.sign(counts.mean() - counts))
        return x * scores.gather(-1, idx).sum(-1, keepdim=True)


def test_each_replay_starts_from_the_state_the_forward_left():
    """The replays wrote the region's buffer in place one after the other, so each noisy replay read the bias the one
    before it left and 'flipped' decisions no noise could move (abs:1e-12, hundreds of ulps from any tie). Each
    replay now starts from the state the forward left (what the recompute reads): no flip, and the training's bias
    ends where it does without the audit."""
    from torch.utils.checkpoint import checkpoint

    def train(audited: bool):
        torch.manual_seed(0)
        model, x = _BiasInForward(), torch.randn(64, 16, requires_grad=True)
        auditor = Auditor(AuditSettings(parse_noise("abs:1e-12"), seeds=2, max_regions=1)).start() if audited else None
        try:
            checkpoint(model, x, use_reentrant=False).sum().backward()
        finally:
            if auditor is not None:
                auditor.stop()
        return model, auditor

    plain, _ = train(False)
    model, auditor = train(True)
    assert torch.equal(model.expert_bias, plain.expert_bias)
    sites = audit_document(auditor, parse_scale(None), target="t.py", wall_seconds=1.0)["audit"]["sites"]
    topk = next(s for s in sites if s["op"] == "aten.topk.default")
    assert topk["margins"]["min_ulps"] > 100, topk["margins"]
    assert all(s["flips_per_seed"] == [0, 0] for s in sites), sites  # (topk, and the counts that follow it)


def test_the_commands_an_audit_under_torchrun_suggests_launch_the_ranks_again(monkeypatch):
    """`audit --nproc-per-node 2` (25b): "`ac-diff run train.py` names the cause", pasted as printed, ran one process
    and the script failed in init_process_group. The commands carry the launch."""
    from ac_diff.audit.result import _run

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert _run(["my train.py"]) == "ac-diff run --nproc-per-node 2 'my train.py'"
    assert _run(["t.py"], "--reference no-ac") == "ac-diff run --nproc-per-node 2 --reference no-ac t.py"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert _run(["t.py"]) == "ac-diff run t.py"
    assert _run(["-m", "pkg.train", "--lr", "3"]) == "ac-diff run -m pkg.train --lr 3"


def test_a_site_whose_flips_change_shapes_only_sometimes_says_how_often():
    """A site whose flips changed a saved shape in 40% of the seeds read "a flip: silent" (25e), beside a headline
    predicting CheckpointError: the table gives the share."""
    from ac_diff.audit.render import _consequence

    assert _consequence({"consequence": "silent", "shape_share": 0.4}) == "silent (40% error)"
    assert _consequence({"consequence": "CheckpointError", "shape_share": 1.0}) == "error"
    assert _consequence({"consequence": "unknown", "shape_share": None}) == "?"


def test_the_audited_tokens_are_a_count_of_tokens():
    """Regions of two sizes (ranks with other batches, 25b) made the headline read "at 15.5 tokens": the median of an
    even number of counts. It is one of the counts audited."""
    from types import SimpleNamespace

    from ac_diff.audit.extrapolate import extrapolate

    regions = [SimpleNamespace(tokens=t) for t in (15, 16)]
    risk = extrapolate([], regions, parse_scale(None), "1ulp")
    assert risk["audited_tokens"] == 15, risk


def _train_blocks(make, rows: int, noise: str | None, after_step=lambda blocks: None):
    """Three steps of two checkpointed blocks `make()` builds, under an audit with `noise` (None: none): the losses,
    the blocks' buffers after them, and the auditor."""
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(make() for _ in range(2))
    opt = torch.optim.SGD(blocks.parameters(), lr=0.1)
    auditor = Auditor(AuditSettings(parse_noise(noise), seeds=2)).start() if noise else None
    losses = []
    try:
        for _ in range(3):
            h = torch.randn(rows, 16)
            for block in blocks:
                h = cp.checkpoint(block, h, use_reentrant=False)
            loss = h.square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            after_step(blocks)
            losses.append(loss.item())
    finally:
        if auditor:
            auditor.stop()
    return losses, [b.clone() for b in blocks.buffers()], auditor


class _DelayedScaling(torch.nn.Module):
    """fp8 delayed scaling, emulated: the scale comes from an amax history the forward rolls and then writes its
    current amax into, through a view (`hist[0] = amax`): a buffer written whole, then through a view of it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)
        self.register_buffer("amax_history", torch.zeros(4))

    def forward(self, x):
        amax = x.detach().abs().max()
        scale = 448.0 / torch.where(self.amax_history.max() > 0, self.amax_history.max(), amax)
        with torch.no_grad():
            self.amax_history.copy_(torch.roll(self.amax_history, 1))
            self.amax_history[0] = amax
        q = (x * scale).to(torch.float8_e4m3fn).to(x.dtype) / scale
        return torch.relu(self.fc(q))


def test_an_audit_replay_puts_back_a_buffer_written_whole_and_then_through_a_view():
    """26e: the audit's replays put back what they wrote in the order they first wrote it, the base before its view:
    the view's copy (taken after the roll) overwrote the base's, and the training changed (another loss in step 2)."""
    plain, plain_history, _ = _train_blocks(_DelayedScaling, 8, None)
    audited, history, auditor = _train_blocks(_DelayedScaling, 8, "1ulp")
    assert auditor.regions, "the audit replayed nothing"
    assert audited == plain
    assert all(torch.equal(a, b) for a, b in zip(history, plain_history))


class _CountingRouter(torch.nn.Module):
    """Top-1 routing whose forward keeps the tokens per expert for a balancing update after the step
    (`self.last_counts = counts`: another tensor bound each call, not written in place)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.experts = torch.nn.Linear(16, 4), torch.nn.Linear(16, 64)
        self.register_buffer("bias", torch.zeros(4))
        self.last_counts = None

    def forward(self, x):
        idx = (self.gate(x) + self.bias).argmax(-1)
        out = self.experts(x).view(-1, 4, 16)
        y = x + out[torch.arange(x.shape[0]), idx]
        self.last_counts = torch.bincount(idx, minlength=4)  # (after the last op that saves: early stop skips it)
        return y


def _balance(routers) -> None:
    with torch.no_grad():
        for router in routers:
            counts = router.last_counts.float()
            router.bias += 0.05 * torch.sign(counts.mean() - counts)


def test_an_audit_replay_binds_back_a_tensor_the_forward_kept_for_after_the_step():
    """26d: the replays left their own `last_counts` (from perturbed scores) on the module; the recompute, stopped
    early, never bound it again, so the balancing update after the step read the audit's counts and the training
    changed (another loss in step 2)."""
    plain, plain_bias, _ = _train_blocks(_CountingRouter, 32, None, _balance)
    audited, bias, auditor = _train_blocks(_CountingRouter, 32, "abs:0.05", _balance)
    assert any(sum(s.flips) for s in auditor.sites.values()), "no replay flipped a choice"  # (else nothing to leave)
    assert audited == plain
    assert all(torch.equal(a, b) for a, b in zip(bias, plain_bias))


class _Bf16BiasedRouter(torch.nn.Module):
    """A router kept in bf16 whose scores get a balancing bias added (a bf16 add, computed exactly and rounded once)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(16, 8, bias=False)
        self.register_buffer("bias", torch.zeros(8))

    def forward(self, x):
        idx = (torch.sigmoid(self.gate(x)) + self.bias).topk(2, dim=-1).indices
        return x * idx.sum(-1, keepdim=True).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rounding_noise_that_moves_no_score_is_said(dtype):
    """26e: on a model kept in bf16 the ulp noise went into a bf16 add, where a float32 ulp does not survive the
    rounding: no score moved (score_noise_rms 0.0), and the audit said "CheckpointError unlikely" with no word of it."""
    torch.manual_seed(0)
    router = _Bf16BiasedRouter().to(dtype)
    auditor = Auditor(AuditSettings(parse_noise("1ulp"), seeds=2)).start()
    try:
        x = torch.randn(64, 16, dtype=dtype, requires_grad=True)
        cp.checkpoint(router, x, use_reentrant=False).float().sum().backward()
    finally:
        auditor.stop()
    said = [n for n in auditor.all_notes() if n.startswith("the noise moved no score at 1 site(s)")]
    assert bool(said) == (dtype == torch.bfloat16), auditor.all_notes()


class _CollectingMoE(torch.nn.Module):
    """A soft MoE appending its router logits to a list its parent holds and clears each forward, for the
    load-balancing loss (Hugging Face's pattern)."""

    def __init__(self, sink: list) -> None:
        super().__init__()
        self.gate, self.expert, self.sink = torch.nn.Linear(16, 4), torch.nn.Linear(16, 16), sink

    def forward(self, x):
        logits = self.gate(x)
        self.sink.append(logits)
        return x + logits.softmax(-1)[:, :1] * self.expert(x)


def test_an_audit_replay_puts_a_collected_list_back_in_place():
    """26g: the replays appended their logits to the list; putting it back bound a copy to the router and left the
    parent's list (the same object, which the aux loss reads) holding the replays' entries: the loss changed, then
    `torch.stack` of an emptied list crashed the script."""
    def train(audit: bool):
        torch.manual_seed(0)
        collected: list = []
        layers = torch.nn.ModuleList(_CollectingMoE(collected) for _ in range(2))
        opt = torch.optim.SGD(layers.parameters(), lr=0.1)
        auditor = Auditor(AuditSettings(parse_noise("1ulp"), seeds=2)).start() if audit else None
        out = []
        try:
            for _ in range(3):
                collected.clear()
                h = torch.randn(8, 16)
                for layer in layers:
                    h = cp.checkpoint(layer, h, use_reentrant=False)
                aux = torch.stack([(x.softmax(-1).mean(0) ** 2).sum() for x in collected]).mean()
                loss = h.square().mean() + 0.1 * aux
                loss.backward()
                opt.step()
                opt.zero_grad()
                out.append((loss.item(), len(collected)))
        finally:
            if auditor:
                auditor.stop()
        return out, auditor

    plain, _ = train(False)
    audited, auditor = train(True)
    assert auditor.regions, "the audit replayed nothing"
    assert audited == plain


_CALLS = 0  # a module-level count the block keeps
_SEEN: dict = {}  # a module-level cache it fills


class _GlobalStateBlock(torch.nn.Module):
    """A block counting its calls in a module-level global, caching in a module-level dict and drawing from numpy's
    global generator: state the audit's replays advanced and left advanced (26g)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)

    def forward(self, x):
        global _CALLS
        _CALLS += 1
        _SEEN[_CALLS] = x.shape[0]
        scale = 1.0 + 0.01 * (_CALLS % 3) + 0.01 * float(np.random.rand()) + 0.001 * len(_SEEN)
        return torch.tanh(self.fc(x) * scale)


def test_an_audit_replay_puts_back_module_level_state_and_numpys_generator():
    """26g: a module-level counter, a module-level dict cache and numpy's global generator were left advanced by the
    replays (12 calls counted where 4 were made, numpy's state moved): the losses differed from step 1."""
    def run(audit: bool):
        global _CALLS
        _CALLS = 0
        _SEEN.clear()
        np.random.seed(0)
        return _train_blocks(_GlobalStateBlock, 8, "1ulp" if audit else None)

    plain, _, _ = run(False)
    audited, _, auditor = run(True)
    assert auditor.regions, "the audit replayed nothing"
    assert audited == plain


class _HostScaled(torch.nn.Module):
    """A residual scaled by a draw from Python's `random` inside the block (26i)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)

    def forward(self, x):
        return x + random.uniform(0.9, 1.0) * torch.tanh(self.fc(x))


def test_an_audit_says_a_recompute_drew_from_a_host_generator_again():
    """26i: the recompute draws from `random` again (preserve_rng_state restores torch's generators only), so the
    training goes on from other draws than without AC; `run` put it at risk, the audit said "CheckpointError unlikely"
    alone."""
    random.seed(0)
    a = _audited(_HostScaled(), [torch.randn(8, 16, requires_grad=True) for _ in range(2)], seeds=1, max_regions=2)
    assert a["recompute"]["state_twice"] and a["recompute"]["state_twice"][0]["names"] == ["<host generator random>"]
    assert "or a host generator a second time" in a["headline"], a["headline"]


class _RobustDrop(torch.nn.Module):
    """Per row, the 4 smallest scores dropped below a threshold taken from the same scores (`z < z.kthvalue(5)`),
    put at exact zeros by `where`, then the row sorted (top-8 summed): nothing rounding can flip."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(64, 64)

    def forward(self, x):
        z = self.fc(x)
        kth = z.kthvalue(5, dim=1, keepdim=True).values
        z = torch.where(z < kth, torch.zeros_like(z), z)
        return x + z.sort(dim=1, descending=True).values[:, :8].sum(1, keepdim=True)


def test_a_threshold_taken_from_the_scores_and_ties_of_exact_zeros_are_no_near_flips():
    """27c: `z < z.kthvalue(k)` has a margin of 0 at the element the threshold is (it moves with the scores: no flip),
    and the sort of where's exact zeros ties them (no summation order moves a zero); the audit modelled both as
    coin flips: "expect about 7.9e+02 decision flips per step, 4.2e+02 of them shape-changing: CheckpointError almost
    certain", `--check` exit 1, on a script whose gradients are bit-identical. The comparison's noise is its gap's;
    a chooser's tie that the noise left in place has none."""
    torch.manual_seed(0)
    block = _RobustDrop()
    a = _audited(block, [torch.randn(256, 64, requires_grad=True) for _ in range(2)], seeds=3, max_regions=2)
    sites = {s["op"]: s for s in a["sites"] if s["kind"]}
    lt, sort = sites["aten.lt.Tensor"], sites["aten.sort.default"]
    assert lt["margins"]["min_ulps"] == 0 and sort["margins"]["min_ulps"] == 0  # (the zero margins are there)
    assert lt["rate"] < 1e-3 and sort["rate"] < 1e-3, (lt["rate"], sort["rate"])
    assert "CheckpointError unlikely" in a["headline"], a["headline"]


class _AboveMean(torch.nn.Module):
    """Keeps the inputs above their own mean (`x > x.mean()` on the region's input): the threshold is the one value
    the region computes, and quantized inputs put many elements exactly on it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)

    def forward(self, x):
        return self.fc(x * (x > x.mean()).float() + 0.1 * x)


def test_a_comparison_of_the_regions_input_with_a_threshold_it_computes_is_audited():
    """27c: `img > img.mean()` on 8-bit pixels, thousands on the mean: a thread count that changes the mean's rounding
    flips them, yet the audit found "0 decision sites with margins" (its scores, the input, are nothing the recompute
    computes). The noise goes into the threshold the region computes."""
    g = torch.Generator().manual_seed(0)
    d = torch.randint(0, 8, (256 * 8,), generator=g)
    x = (torch.cat([128 + d, 128 - d])[torch.randperm(256 * 16, generator=g)].view(256, 16).float() / 255.0)
    a = _audited(_AboveMean(), [x.requires_grad_()], seeds=3, max_regions=1)
    (site,) = [s for s in a["sites"] if s["op"] == "aten.gt.Tensor"]
    assert site["kind"] == "comparison" and site["margins"]["min_ulps"] <= 1, site
    assert sum(site["flips_per_seed"]) > 0 and site["rate"] > 0, site


class _BankTopK(torch.nn.Module):
    """Hard negatives: the top-4 of a memory bank by similarity, where the bank holds every item twice (enqueued
    again before it was dequeued)."""

    def __init__(self, bank: torch.Tensor) -> None:
        super().__init__()
        self.q = torch.nn.Linear(16, 16)
        self.register_buffer("bank", bank)

    def forward(self, x):
        q = self.q(x)
        idx = (q @ self.bank.T).topk(4, dim=-1).indices
        return q * self.bank[idx].mean(1)


def test_a_tie_between_duplicated_candidates_is_no_near_flip():
    """27a, 27f: a memory bank holding items twice ties each pair exactly in every row: the audit's independent noise
    per score broke those ties ("85 silent flips per step", save topk), where any recompute scores both copies alike,
    from the same inputs, and a swap of copies gathers the same values. Candidates whose scores are equal in every
    row are one candidate to it."""
    torch.manual_seed(0)
    items = torch.randn(32, 16)
    block = _BankTopK(torch.cat([items, items]))
    a = _audited(block, [torch.randn(64, 16, requires_grad=True) for _ in range(2)], seeds=3, max_regions=2)
    (site,) = [s for s in a["sites"] if s["op"] == "aten.topk.default"]
    assert site["margins"]["min_ulps"] == 0 and site["flips_per_seed"] == [0, 0, 0] and site["rate"] == 0, site


class _NormalizingRouter(torch.nn.Module):
    """Mixtral's router: top-2 of 8 experts, the chosen weights normalised in place (`top /= top.sum(...)`)."""

    def __init__(self, in_place: bool) -> None:
        super().__init__()
        self.gate, self.experts, self.in_place = torch.nn.Linear(16, 8), torch.nn.Linear(16, 128), in_place

    def forward(self, x):
        top, chosen = self.gate(x).softmax(-1).topk(2, dim=-1)
        if self.in_place:
            top /= top.sum(-1, keepdim=True)
        else:
            top = top / top.sum(-1, keepdim=True)
        out = self.experts(x).view(-1, 8, 16).gather(1, chosen[..., None].expand(-1, -1, 16))
        return (out * top[..., None]).sum(1)


@pytest.mark.parametrize("in_place", [True, False])
def test_a_save_list_whose_op_the_forward_writes_in_place_is_not_verified(in_place):
    """29c: the audit of stock HF Mixtral called saving topk with selective AC verified and printed its policy, but
    Mixtral divides topk's weights in place, and selective AC then raises "Tensor cached during selective activation
    checkpoint has been mutated" in the first backward. The remedy says so, unverified; out of place it stands."""
    torch.manual_seed(0)
    block, x = _NormalizingRouter(in_place), torch.randn(64, 16, requires_grad=True)
    remedy = _audited(block, [x, x], seeds=2, max_regions=2)["remedy"]
    assert remedy["save_list"] == ["aten.topk.default"], remedy
    if in_place:
        assert not remedy["verified"] and remedy["refused"] == {"aten.topk.default": "aten.div_.Tensor in the region"}
    else:
        assert remedy["refused"] == {}


@pytest.mark.parametrize("preserve_rng_state", [False, True])
def test_the_audit_compares_a_reentrant_recompute_by_its_outputs(preserve_rng_state):
    """34d: under use_reentrant=True (HF's older default) the audit compared nothing ("checked": 0: a reentrant
    forward saves no tensor), said "CheckpointError unlikely" and `--check` passed a run whose dropout, without its
    RNG state, made every gradient wrong. It compares what each pass returned."""
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Dropout(0.2))
                                 for _ in range(2))
    auditor = Auditor(AuditSettings(parse_noise("1ulp"), seeds=1, max_regions=1)).start()
    try:
        for _ in range(2):
            h = torch.randn(8, 16, requires_grad=True)
            for block in blocks:
                h = cp.checkpoint(block, h, use_reentrant=True, preserve_rng_state=preserve_rng_state)
            h.square().sum().backward()
    finally:
        auditor.stop()
    check = audit_document(auditor, parse_scale(None), target="t.py", wall_seconds=1.0)["audit"]["recompute"]
    assert check["checked"] == 4, check
    if preserve_rng_state:
        assert check["diverged_count"] == 0, check
        return
    assert check["diverged_count"] == 4, check
    assert all(r["detail"].startswith("other values at 1 of 1 outputs") for r in check["diverged"]), check


@pytest.mark.parametrize("parametrized", [False, True])
def test_the_replays_leave_spectral_norms_power_iteration_as_it_was(parametrized):
    """34d: spectral norm's power iteration writes `u` and `v` through `normalize(..., out=u)` (a keyword argument):
    the replays undid in-place writes of positional arguments only, so each replay advanced the iteration and the
    audited run trained other weights (the first loss already differed)."""
    norm = torch.nn.utils.parametrizations.spectral_norm if parametrized else torch.nn.utils.spectral_norm

    def loss_of(blocks):
        h = torch.randn(8, 16)
        for block in blocks:
            h = cp.checkpoint(block, h, use_reentrant=False).relu()
        return h.square().mean()

    def train(audit: bool):
        torch.manual_seed(0)
        return _two_steps(torch.nn.ModuleList(norm(torch.nn.Linear(16, 16)) for _ in range(2)), loss_of, audit)

    plain_losses, plain_state, _ = train(False)
    losses, state, auditor = train(True)
    assert len(auditor.regions) == 2  # (it replayed)
    assert losses == plain_losses
    for name in state:
        assert torch.equal(state[name], plain_state[name]), name
