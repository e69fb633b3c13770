"""torch.compile around and inside checkpointed regions (`tests/stacks/compiled_blocks.py`, backend aot_eager:
through Dynamo and AOTAutograd without a C++ compiler): ac-diff never crashes the run, says which modules
ran compiled and what that means for the recording, and still diagnoses what it can see.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from ac_diff.capture.compiled import CompileWatch, EagerStance, compile_kind, skip_when_compiling, tracing
from ac_diff.trace import read_run
from stacks.runs import STACKS, Job, run_all

SCRIPT = str(STACKS / "compiled_blocks.py")
BUFFER = [SCRIPT, "--compile", "around", "--fullgraph", "--buffer-update", "--steps", "1"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_all(tmp_path_factory.mktemp("compile"), {
        # a compiled submodule (fullgraph=True) inside each checkpointed block, with a real divergence in it
        "inner": Job([SCRIPT, "--compile", "inner", "--fullgraph", "--dropout", "0.1", "--no-preserve-rng"]),
        # ... and without the divergence: the compiled graph saves its activations through `detach`
        "inner_clean": Job([SCRIPT, "--compile", "inner", "--fullgraph", "--dropout", "0.1"]),
        # torchtitan: each layer = torch.compile(checkpoint_wrapper(block), fullgraph=True)
        "block": Job([SCRIPT, "--compile", "block", "--fullgraph"]),
        # the workaround the report gives: --scope all runs compiled code eagerly, regions included
        "around_scope_all": Job([SCRIPT, "--compile", "around"], options=["--scope", "all"]),
        # whole-model compile (fullgraph) over blocks that update a buffer in place in their forward: a real divergence
        "buffer": Job(BUFFER, options=["--reference", "no-ac"]),
        "buffer_eager": Job(BUFFER, options=["--compiled", "eager", "--reference", "no-ac"]),
        # a clean compiled model against the run without AC: the reference's checkpoint() is traced by Dynamo
        "block_reference": Job([SCRIPT, "--compile", "block", "--fullgraph", "--steps", "1"],
                               options=["--reference", "no-ac"]),
    })


def test_a_block_compiled_in_place_and_checkpointed_names_its_ops(tmp_path):
    """checkpoint(block) of a `block.compile()`d module: its call runs the compiled code, not its module hooks, so
    the recorder puts it on the module stack itself (a stranger's first divergence had no module)."""
    import ac_diff

    torch.manual_seed(0)
    blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(2)])
    for block in blocks:
        block.compile(backend="aot_eager")
    try:
        with ac_diff.record(tmp_path / "t.jsonl"):
            x = torch.randn(4, 8, requires_grad=True)
            for block in blocks:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            x.sum().backward()
    finally:
        torch._dynamo.reset()
    run = read_run(tmp_path / "t.jsonl")
    assert [g.module for g in run.regions] == ["blocks.0", "blocks.1"]  # (a ModuleList root: by its variable)
    for g in run.regions:
        ops = [o for p in (g.forward, g.recompute) for o in p.ops if o.op == "aten.addmm.default"]
        assert ops and all(o.module == g.module for o in ops), [(o.op, o.module) for o in ops]


@pytest.mark.e2e
def test_compiled_submodule_inside_regions_is_named_and_the_divergence_still_found(runs):
    r = runs["inner"]
    assert r.returncode == 0, r.explain()
    report = r.report
    assert [g["module"] for g in report["regions"]] == ["layers.0", "layers.1"] * 2
    for g in report["regions"]:
        assert g["status"] == "diverged" and g["silent"]
        assert g["cause"]["kind"] == "rng"
        # the compiled graph's ops (aot_eager runs them as aten ops) belong to the compiled module
        assert g["first_value_divergence"]["module"] == f"{g['module']}.ff"
    note = next(n for n in report["notes"] if n.startswith("torch.compile"))
    assert "layers.0.ff, layers.1.ff" in note and "ran compiled" in note
    run = read_run(r.trace_dir / "trace-rank0.jsonl")
    assert [g.compiled for g in run.regions] == [["layers.0.ff"], ["layers.1.ff"]] * 2
    assert "torch.compile" in r.stdout  # the terminal report shows the note too


@pytest.mark.e2e
def test_a_compiled_submodule_that_saves_through_detach_is_clean_where_nothing_diverged(runs):
    """aot_autograd's graph saves activations through `detach`: the recompute's detach was paired through the op it
    copies, the forward's was not, and its saved positions read as another tensor (a stranger's false alarm)."""
    r = runs["inner_clean"]
    assert r.returncode == 0, r.explain()
    assert r.report["verdict"] == "clean", r.report["headline"]


@pytest.mark.e2e
def test_torchtitan_per_block_fullgraph_compile_does_not_crash_and_says_why_no_region_ran(runs):
    r = runs["block"]
    assert r.returncode == 0, r.explain()  # the training itself ran, compiled
    assert "step 1: loss" in r.stdout
    report = r.report
    assert report["regions"] == [] and report["verdict"] == "unchecked"
    assert report["title"] == "AC COMPILED, NOT RECORDED"
    assert report["headline"].startswith("AC runs inside compiled graphs (2 checkpointed regions in 2 graphs)"), \
        report["headline"]
    assert "the graphs show no state updated inside the regions" in report["headline"]
    assert "ac-diff run --compiled eager" in report["headline"]
    # (what an eager recording finds is the eager program's: whether the compiled run's gradients are right, the
    # reference on it says)
    assert "the compiler's own recompute may not, which `--reference no-ac` on this compiled run tells" in \
        report["headline"]
    assert report["compiled"] == {"eager": False, "modules": ["layers.0", "layers.1"], "regions": 2, "graphs": 2,
                                  "mutations": [], "can_run_eager": True}
    note = next(n for n in report["notes"] if n.startswith("torch.compile"))
    assert "compiled module(s) layers.0, layers.1 ran outside any recorded region" in note
    assert "no checkpointed region ran" in note and "--compiled eager" in note


@pytest.mark.e2e
def test_a_buffer_updated_in_compiled_regions_is_named_from_the_graphs_and_the_gradients_differ(runs):
    r = runs["buffer"]
    assert r.returncode == 0, r.explain()  # --reference no-ac on a whole-model fullgraph compile: no crash
    report = r.report
    assert report["verdict"] == "diverged" and report["regions"] == []
    assert "no checkpointed region ran" not in report["headline"]
    assert "AC runs inside compiled graphs (2 checkpointed regions in 1 graph)" in report["headline"]
    assert [(m["name"], m["kind"]) for m in report["compiled"]["mutations"]] == [
        ("layers.0.scale", "buffer"), ("layers.1.scale", "buffer")]
    ref = report["reference"]
    assert ref["verdict"] == "differs", ref["headline"]  # the ground truth: compiled AC changes the gradients
    assert [e["kind"] for e in ref["explanations"]] == ["compiled_ac"]
    assert "layers.0.scale, layers.1.scale" in ref["explanations"][0]["text"]
    assert any(n.startswith("both runs ran compiled") for n in ref["notes"])


@pytest.mark.e2e
def test_compiled_eager_records_the_regions_of_a_compiled_model_and_places_the_divergence(runs):
    r = runs["buffer_eager"]
    assert r.returncode == 0, r.explain()
    report = r.report
    assert report["headline"].startswith("Net ran eagerly (--compiled eager: torch.compiler.set_stance('force_eager'); "
                                         "what follows is the eager program's, the compiled one's recompute may "
                                         "differ)"), report["headline"]
    assert [g["module"] for g in report["regions"]] == ["layers.0", "layers.1"]
    for g in report["regions"]:
        assert g["status"] == "diverged" and g["cause"]["kind"] == "state_mutation"
        assert g["cause"]["tensor"] == f"{g['module']}.scale"
    ref = report["reference"]
    assert ref["verdict"] == "differs" and ref["explanations"][0]["kind"] == "recompute_divergence"
    assert any("both runs ran torch.compile'd code eagerly" in n for n in ref["notes"])
    assert report["compiled"]["eager"] is True and report["compiled"]["modules"] == ["Net"]


@pytest.mark.e2e
def test_a_clean_compiled_model_matches_the_run_without_ac(runs):
    r = runs["block_reference"]
    assert r.returncode == 0, r.explain()
    assert r.report["reference"]["verdict"] == "identical", r.report["reference"]["headline"]


@pytest.mark.e2e
def test_fix_on_a_compiled_model_records_it_eagerly_and_verifies_a_remedy(tmp_path):
    import json
    import os
    import subprocess
    import sys

    json_path = tmp_path / "fix.json"
    proc = subprocess.run([sys.executable, "-m", "ac_diff", "fix", "-o", str(tmp_path / "fix"), "--steps", "1",
                           "--max-tries", "1", "--json", str(json_path), *BUFFER], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "recording again with compiled code run eagerly" in proc.stderr
    report = json.loads(json_path.read_text())
    fixes = report["fixes"]
    assert fixes["verified"] == "restore the forward's layers.*.scale in the recompute", fixes["headline"]
    assert "--compiled eager" in fixes["tries"][0]["command"]
    assert report["notes"][0].startswith("the compiled run (before --compiled eager): ")
    assert "layers.0.scale, layers.1.scale" in report["notes"][0]


@pytest.mark.e2e
def test_scope_all_records_the_regions_of_a_compiled_model_eagerly(runs):
    r = runs["around_scope_all"]
    assert r.returncode == 0, r.explain()
    report = r.report
    assert report["verdict"] == "clean", report["headline"]
    assert [g["module"] for g in report["regions"]] == ["layers.0", "layers.1"] * 2
    assert any(n.startswith("torch.compile: Net ran eagerly") for n in report["notes"])


# -- in process ---------------------------------------------------------------------------------------
def _blocks(compile_how: str) -> nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch.manual_seed(0)
    layers = nn.Sequential(*[nn.Sequential(nn.LayerNorm(8), nn.Sequential(nn.Linear(8, 8), nn.GELU()))
                             for _ in range(2)])
    for i, block in enumerate(layers):
        if compile_how == "method":  # (fullgraph=True fails here without ac-diff too: torch 2.13 meets the
            block[1].compile(backend="aot_eager")  # region's pack hook, a skipped frame, inside the graph)
        layers[i] = checkpoint_wrapper(block)
    return torch.compile(layers, backend="aot_eager") if compile_how == "around" else layers


@pytest.mark.parametrize("how", ["method", "around"])
def test_in_process_recording_of_compiled_models(tmp_path, how):
    import ac_diff

    model = _blocks(how)
    try:
        with ac_diff.record(tmp_path / "t.jsonl"):
            for _ in range(2):
                model(torch.randn(4, 8)).sum().backward()
    finally:
        torch._dynamo.reset()
    run = read_run(tmp_path / "t.jsonl")
    if how == "method":  # block[1].compile(): compiled in place, runs compiled inside the regions; its module
        # hooks are part of the compiled code, so its ops (the graph's, run by aot_eager) belong to the block
        assert [g.module for g in run.regions] == ["0", "1"] * 2
        linear = [o for o in run.regions[0].forward.ops if o.op == "aten.addmm.default"]
        assert linear and linear[0].module == "0"
        assert ac_diff.diagnose([run]).verdict == "clean"
    else:  # torch.compile(model) over checkpoint_wrapper'd blocks: no crash, no region, and why
        note = next(n for n in run.notes if n.startswith("torch.compile"))
        assert run.regions == []
        assert run.compiled["regions"] == 2 and run.compiled["mutations"] == []  # read from Dynamo's graph
        assert "Sequential ran outside any recorded region" in note and "no checkpointed region ran" in note


class _Counted(nn.Module):
    """Updates two buffers and a view of a plain tensor attribute in place. (`self.seen += 1` would be a
    reassignment: Dynamo then leaves the region uncompiled, and it runs as an ordinary recorded region.)"""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("seen", torch.zeros(()))
        self.register_buffer("amax", torch.zeros(8))
        self.history = torch.zeros(4)

    def forward(self, x):
        self.seen.add_(1)
        self.amax.copy_(torch.maximum(self.amax, x.detach().abs().amax(0)))
        self.history[1:].zero_()
        return torch.tanh(self.lin(x / (self.amax + 1)))


def test_graph_watch_counts_compiled_regions_and_names_what_they_update_in_place():
    from torch.utils.checkpoint import checkpoint

    from ac_diff.capture.compiled_graphs import GraphWatch

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([_Counted(), nn.Linear(8, 8)])

        def forward(self, x):
            x = checkpoint(self.blocks[0], x, use_reentrant=False)
            # nested: an outer region around a clean one
            return checkpoint(lambda y: checkpoint(self.blocks[1], y, use_reentrant=False), x, use_reentrant=False)

    watch = GraphWatch(where=lambda: "model").install()
    try:
        torch.compile(Net(), backend="aot_eager")(torch.randn(4, 8)).sum().backward()
    finally:
        watch.uninstall()
        torch._dynamo.reset()
    summary = watch.summary()
    assert summary["regions"] == 3 and summary["graphs"] == 1, summary
    assert [(m["name"], m["kind"]) for m in summary["mutations"]] == [
        ("model.blocks.0.seen", "buffer"), ("model.blocks.0.amax", "buffer"), ("model.blocks.0.history", "attribute")]
    assert torch.compile.__name__ == "compile" and not hasattr(torch.compile, "__wrapped__")  # put back


def test_source_name_reads_dynamo_sources():
    from ac_diff.capture.compiled_graphs import source_name

    assert source_name("L['self']._modules['layers']._modules['0'].__dict__['_modules']['_checkpoint_wrapped_module']"
                       "._buffers['scale']", "") == ("layers.0.scale", "buffer")
    assert source_name("L['self']._modules['w']._parameters['weight']", "layers.1") == ("layers.1.w.weight",
                                                                                        "parameter")
    assert source_name("L['self'].cache", "attn") == ("attn.cache", "attribute")
    # (a forward whose first parameter is not called `self`: `def forward(s, x)`, 25c)
    assert source_name("L['s']._modules['blocks']._modules['0']._buffers['calls']", "") == ("blocks.0.calls", "buffer")
    assert source_name("L['s']._modules['inner']._buffers['calls']", "blocks.0") == ("blocks.0.inner.calls", "buffer")
    assert source_name("L['x']", "layers.0") == ("x", "input")
    assert source_name("G['STATS']", None) == ("STATS", "global")


# -- units ------------------------------------------------------------------------------------------
def test_compile_kind():
    plain = nn.Linear(2, 2)
    assert compile_kind(plain) is None
    assert compile_kind(torch.compile(nn.Linear(2, 2), backend="eager")) == "torch.compile(module)"
    in_place = nn.Linear(2, 2)
    in_place.compile(backend="eager")
    assert compile_kind(in_place) == "module.compile()"


def test_skip_when_compiling_and_tracing_are_false_in_eager_code():
    calls = []
    hook = skip_when_compiling(lambda *a: calls.append(a) or "ran")
    assert hook(1, 2) == "ran" and calls == [(1, 2)]
    assert tracing() is False
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        assert tracing() is True


def test_eager_stance_nests_and_restores():
    import torch._dynamo.eval_frame as ef

    before = ef._stance
    stance = EagerStance()
    stance.push()
    stance.push()
    assert ef._stance.stance == "force_eager"
    stance.pop()
    assert ef._stance.stance == "force_eager"
    stance.pop()
    assert ef._stance is before
    stance.pop()  # unbalanced pops are harmless
    assert ef._stance is before


def test_compile_watch_messages():
    class Region:
        number = 3

    watch = CompileWatch()
    compiled = torch.compile(nn.Linear(2, 2), backend="eager")
    assert watch.saw(nn.Linear(2, 2), "layers.0.ff", Region()) is None
    assert watch.saw(compiled, "layers.0.ff", Region()) == "torch.compile(module)"
    assert watch.saw(compiled, "", None) == "torch.compile(module)"
    assert watch.inside == {3: ["layers.0.ff"]} and watch.outside == {"Linear": "torch.compile(module)"}
    inside, outside = watch.messages(regions_seen=1)
    assert "layers.0.ff ran inside checkpointed region(s) 3" in inside
    assert "Linear ran outside any recorded region" in outside


def test_compiled_eager_on_a_torch_without_set_stance_says_the_code_ran_compiled(tmp_path, monkeypatch):
    """33b (torch 2.4): `--compiled eager` without torch.compiler.set_stance ran compiled code compiled, yet the report
    said "Net ran eagerly (--compiled eager ...)" over "no checkpointed region ran: is activation checkpointing on?";
    and AC COMPILED, NOT RECORDED told the user to run that flag. Neither, where this torch cannot."""
    from ac_diff.capture import compiled
    from ac_diff.capture.recorder import Recorder
    from ac_diff.diagnosis.compiled import unrecorded_headline

    monkeypatch.setattr(compiled, "can_force_eager", lambda: False)
    monkeypatch.setenv(compiled.COMPILED_ENV, "eager")
    recorder = Recorder(tmp_path / "t.jsonl").start()
    try:
        assert recorder.compile_watch.eager is False
    finally:
        recorder.stop()
    assert any("has no torch.compiler.set_stance" in n for n in read_run(tmp_path / "t.jsonl").notes)
    summary = {"eager": False, "modules": ["Net"], "regions": 2, "graphs": 1, "mutations": [], "can_run_eager": False}
    headline = unrecorded_headline(summary)
    assert "--compiled eager" not in headline and "record them without torch.compile" in headline, headline
    assert "--compiled eager" in unrecorded_headline({**summary, "can_run_eager": True})


class _CountingBlock(nn.Module):
    """Counts its calls in a buffer and divides by the count: the compiled recompute (functional) reads the count the
    forward read, eager AC does not; either way compiled AC and compiled no-AC give other gradients."""

    def __init__(self, dim=32):
        super().__init__()
        self.norm, self.w1, self.w2 = nn.LayerNorm(dim), nn.Linear(dim, 64), nn.Linear(64, dim)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        h = self.w2(torch.nn.functional.gelu(self.w1(self.norm(x))))
        self.calls.add_(1)
        return x + h / self.calls


class _CountingNet(nn.Module):
    def __init__(self, ac: bool):
        super().__init__()
        self.ac, self.blocks, self.head = ac, nn.ModuleList(_CountingBlock() for _ in range(2)), nn.Linear(32, 1)

    def forward(self, x):
        for b in self.blocks:
            x = torch.utils.checkpoint.checkpoint(b, x, use_reentrant=False) if self.ac else b(x)
        return self.head(x)


def _compiled_grads(ac: bool) -> list[torch.Tensor]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    net = _CountingNet(ac)
    torch.compile(net, backend="aot_eager")(torch.randn(16, 32)).square().mean().backward()
    return [p.grad.clone() for p in net.parameters()]


def test_the_reference_turns_off_ac_that_dynamo_traces(tmp_path):
    """torch.compile(model) around checkpointed blocks (25c): Dynamo tells torch's checkpoint by identity with
    `torch.utils.checkpoint.checkpoint`, which is ac-diff's replacement in the reference, so the reference's "AC off
    everywhere" was traced as AC on: its gradients were the AC run's, and `--reference no-ac` said "identical" where
    compiled AC changes them. With `compiled` (set for the reference of a run that imported Dynamo) the replacement
    is traced as Python, and the reference's gradients are those of the compiled model without AC."""
    from ac_diff.reference.run import reference_command
    from ac_diff.reference.session import COMPILED_ENV
    from ac_diff.remedies import CheckpointPatch, RemedySpec

    with_ac, without = _compiled_grads(True), _compiled_grads(False)
    assert not all(torch.equal(a, b) for a, b in zip(with_ac, without))  # (the ground truth: AC changes them)
    patch = CheckpointPatch(RemedySpec(no_ac=["*"]), compiled=True).install()
    try:
        reference = _compiled_grads(True)
    finally:
        patch.uninstall()
    assert all(torch.equal(a, b) for a, b in zip(reference, without))
    assert _compiled_grads(True)[0].equal(with_ac[0])  # (uninstalled: Dynamo takes checkpoint for AC again)
    child, _ = reference_command("t.py", [], module=False, directory=tmp_path, steps=1, spec=RemedySpec())
    assert child.env.get(COMPILED_ENV) == "1"  # (this process imported Dynamo, as a run that compiled does)


@pytest.mark.e2e
def test_fix_leaves_a_compiled_model_whose_gradients_match_the_run_without_ac(tmp_path):
    """The whole model compiled around checkpointed blocks, a float attribute lowered before the backward (25i): the
    compiled recompute reads the graph's constant, so its gradients match the run without AC; `fix` switched to the
    eager program, which diverges, and called the gradients "silently wrong". The compiled run's comparison stands."""
    import json
    import os
    import subprocess
    import sys

    json_path = tmp_path / "fix.json"
    proc = subprocess.run([sys.executable, "-m", "ac_diff", "fix", "-o", str(tmp_path / "fix"), "--json",
                           str(json_path), SCRIPT, "--compile", "around", "--fullgraph", "--anneal", "static",
                           "--steps", "2"], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "recording again with compiled code run eagerly" not in proc.stderr
    report = json.loads(json_path.read_text())
    assert report["reference"]["verdict"] == "identical", report["reference"]["headline"]
    assert report["fixes"]["headline"].startswith("nothing to fix: the compiled run's gradients match the run without "
                                                  "AC"), report["fixes"]["headline"]


def test_dynamo_compiles_no_frame_of_the_pack_hooks(tmp_path):
    """31b, torch 2.6: checkpoint's pack hook, in a region around a compiled module, called watch's `hold` with Dynamo's
    callback on; Dynamo compiled `hold` as a frame of its own, on fake tensors with symbolic sizes, which raised (the
    saved position was lost, and the watched region read DIVERGED). The hooks' code is marked for Dynamo to skip."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from ac_diff.capture.compiled import keep_dynamo_out
    from ac_diff.capture.recorder import Recorder
    from ac_diff.capture.watch import WatchedPass

    keep_dynamo_out(Recorder)
    torch._dynamo.reset()
    counters.clear()
    held = WatchedPass()
    torch.compile(lambda t: held.hold(0, t, "block"), backend="eager")(torch.randn(4, 4))
    assert held.entries and held.entries[0][3] == "block"  # (it ran, eagerly)
    assert counters["frames"]["total"] <= 2, dict(counters["frames"])  # (the lambda's frame, not hold's and below)
