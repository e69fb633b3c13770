"""Diagnoses a user can bet on (issue 15, items 3-5, 7, 9-11; issue 16's `unchecked` verdict), each on a
real mechanism: host randomness, a private torch.Generator, a changed Python float, an optimizer step
between a micro-batch's forward and backward, a crash in the backward, a forward with no backward, an MoE
whose expert loop and token counts read the same top-k, and six layers that diverge for one reason."""

from __future__ import annotations

import copy
import io
import json
import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint as cp
from rich.console import Console

import ac_diff
from ac_diff.render.html import render_html
from ac_diff.render.terminal import render_terminal
from conftest import REPO, run_cli, run_scripts

SCRIPTS = REPO / "tests" / "trust_scripts"
WIDE = {"COLUMNS": "200"}  # the terminal report's table cells unwrapped


def _terminal(report, width: int = 120) -> str:
    buffer = io.StringIO()
    render_terminal(report, Console(file=buffer, width=width, color_system=None, force_terminal=False))
    return buffer.getvalue()


def _record(tmp_path: Path, model: nn.Module, x: torch.Tensor, between=None):
    path = tmp_path / "t.jsonl"
    with ac_diff.record(path):
        y = cp.checkpoint(model, x, use_reentrant=False)
        if between is not None:
            between()
        y.pow(2).sum().backward()
    return ac_diff.diagnose_paths([path])


def _line_of(needle: str) -> int:
    return next(i for i, line in enumerate(Path(__file__).read_text().splitlines(), 1) if needle in line)


@pytest.fixture(scope="module")
def script_runs(tmp_path_factory) -> dict[str, dict]:
    """The scripts of tests/trust_scripts, each run once under `ac-diff run --json`."""
    return run_scripts(tmp_path_factory.mktemp("trust"), SCRIPTS, (
        "crash_in_backward", "optimizer_between", "moe_loop_router", "six_layers_same_cause"), env=WIDE)


# --- 3. host randomness -----------------------------------------------------------------------------------------

class HostNoise(nn.Module):
    """Adds noise drawn on the host: numpy (from_numpy) or Python's random (torch.tensor)."""

    def __init__(self, source: str):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.source = source

    def forward(self, x):
        if self.source == "numpy":
            noise = torch.from_numpy(np.random.randn(8).astype(np.float32))  # host value: numpy
        else:
            noise = torch.tensor([random.gauss(0, 1) for _ in range(8)])  # host value: random
        return torch.tanh(self.lin(x) + noise)


@pytest.mark.parametrize("source", ["numpy", "random"])
def test_host_randomness_is_rng_at_the_line_it_entered(tmp_path, source):
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    report = _record(tmp_path, HostNoise(source), torch.randn(4, 8, requires_grad=True))
    region = report.regions[0]
    assert region.status == "diverged" and region.silent
    cause = region.cause
    assert (cause.kind, cause.mechanism) == ("rng", "host_rng"), cause
    line = _line_of(f"# host value: {source}")
    assert cause.source.startswith(f"test_trust_diagnosis.py:{line} ") or f"test_trust_diagnosis.py:{line} " in cause.source
    assert "preserve_rng_state" in cause.detail and "external[0]" not in cause.detail
    fixes = " ".join(s.title + s.text + (s.code or "") for s in region.suggestions)
    assert "outside the checkpointed region" in fixes and f":{line}" in region.suggestions[0].title
    assert "optimizer" not in fixes and "step hook" not in fixes
    # the example draws from the generator the region drew from (29e: Python's `random` got a numpy example)
    assert ("np.random" in region.suggestions[0].code) is (source == "numpy"), region.suggestions[0].code


@pytest.mark.parametrize("source", ["random", "numpy"])
def test_every_host_draw_moves_the_host_state_not_only_the_first(source):
    """numpy's generator regenerates its key only every 624 words: a draw after the first moves its position alone
    (a stranger's second and later numpy-drawing regions read as 'no evidence')."""
    from ac_diff.capture.state import host_draws, host_rng_states

    (random.seed if source == "random" else np.random.seed)(0)
    draw = random.random if source == "random" else np.random.rand
    draw()
    before = host_rng_states()
    assert host_draws(before, host_rng_states()) == []
    draw()
    assert host_draws(before, host_rng_states()) == [{"random": "random", "numpy": "numpy.random"}[source]]


class LayerDrop(HostNoise):
    """Stochastic depth decided on the host: `random.random()` or numpy picks whether the block runs. (A loop may
    reseed it per step; this one does not: the seeding line, which draws nothing, never runs.)"""

    reseed: int | None = None

    def forward(self, x):
        if self.reseed is not None:
            (random.seed if self.source == "random" else np.random.seed)(self.reseed)
        draw = random.random() if self.source == "random" else float(np.random.rand())  # the draw
        if draw < 0.5:  # the branch: no tensor carries the host value
            return x * 1.0
        return x + torch.tanh(self.lin(x))


@pytest.mark.parametrize("source", ["random", "numpy"])
def test_a_host_draw_that_picks_the_branch_is_rng_not_a_python_counter(tmp_path, source):
    """The host value never becomes a tensor: it only picks the branch. The region's host generator moved during
    its forward, so the other branch in the recompute is host randomness, not control flow of unknown cause."""
    torch.manual_seed(0)
    seed = next(k for k in range(100) if _layerdrop_flips(source, k))
    (random.seed if source == "random" else np.random.seed)(seed)
    model, x, path = LayerDrop(source), torch.randn(4, 8, requires_grad=True), tmp_path / "t.jsonl"
    with ac_diff.record(path):
        y = cp.checkpoint(model, x, use_reentrant=False)
        with pytest.raises(cp.CheckpointError):  # the skipped block saves fewer tensors in the recompute
            y.pow(2).sum().backward()
    region = ac_diff.diagnose_paths([path]).regions[0]
    assert region.status == "diverged"
    cause = region.cause
    assert (cause.kind, cause.mechanism) == ("rng", "host_rng"), cause
    assert {"random": "`random`", "numpy": "`numpy.random`"}[source] in cause.detail
    # named where it draws (a stranger's LayerDrop was pointed at the first op the recompute skipped)
    assert cause.source.endswith(f"test_trust_diagnosis.py:{_line_of('# the draw')} in forward"), cause.source
    fix = region.suggestions[0]
    assert "outside the checkpointed region" in fix.title and cause.source in fix.title
    assert "out = checkpoint(block, x, r, use_reentrant=False)" in fix.code and "np.random.randn" not in fix.code


def _layerdrop_flips(source: str, seed: int) -> bool:
    """Whether after seeding the forward's draw runs the block and the recompute's skips it."""
    if source == "random":
        rng = random.Random(seed)
        a, b = rng.random(), rng.random()
    else:
        rng = np.random.RandomState(seed)
        a, b = rng.rand(), rng.rand()
    return a >= 0.5 > b


# --- 4. private torch.Generator ----------------------------------------------------------------------------------

class PrivateDropout(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.gen = torch.Generator().manual_seed(1)

    def forward(self, x):
        h = self.lin(x)
        keep = torch.rand(h.shape, generator=self.gen) > 0.3  # private generator
        return h * keep / 0.7


def test_private_generator_is_named_and_not_blamed_on_preserve_rng_state(tmp_path):
    torch.manual_seed(0)
    report = _record(tmp_path, PrivateDropout(), torch.randn(4, 8, requires_grad=True))
    region = report.regions[0]
    cause = region.cause
    assert (cause.kind, cause.mechanism) == ("rng", "private_generator"), cause
    assert "torch.Generator" in cause.tensor and f":{_line_of('# private generator')} " in cause.source
    assert any("preserve_rng_state=True" in e for e in cause.evidence)  # what the trace recorded
    fixes = " ".join(s.title + s.text + (s.code or "") for s in region.suggestions)
    assert "set it to False" not in fixes and "get_state()" in fixes
    # 5. the generator is an argument that did not change: no shape divergence, no object address
    assert region.first_shape_divergence is None and region.first_argument_divergence is None
    assert region.first_value_divergence.op == "aten.rand.generator"
    text = json.dumps(report.to_json()) + _terminal(report) + render_html(report)
    assert " object at 0x" not in text and "generator=torch.Generator" in json.dumps(report.to_json())
    assert "generator=torch." in _terminal(report)  # (a narrow table cell wraps after the dot)


# --- 5. a changed Python float is an argument divergence ---------------------------------------------------------

class Tempered(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.temperature = 0.5

    def forward(self, x):
        return torch.softmax(self.lin(x) * self.temperature, dim=-1)


def test_changed_python_float_is_an_argument_divergence_with_readable_values(tmp_path):
    torch.manual_seed(0)
    model = Tempered()

    def anneal():
        model.temperature = 0.25  # a schedule stepped before the backward

    report = _record(tmp_path, model, torch.randn(4, 8, requires_grad=True), between=anneal)
    region = report.regions[0]
    assert region.status == "diverged"
    arg = region.first_argument_divergence
    assert arg is not None and arg.kind == "argument" and arg.op == "aten.mul.Tensor"
    assert "0.5→0.25" in arg.summary and arg.detail["args_diff"] == "0.5→0.25"
    assert region.first_shape_divergence is None
    # the float is a module attribute: the cause names it (a bare Python argument would be "python_value")
    assert region.cause.mechanism == "attribute" and region.cause.tensor == "Tempered.temperature"
    assert "mk-argument" in render_html(report)  # the aligned view marks the argument, not a shape
    assert "≠ argument" in _terminal(report) and "shape" not in _terminal(report).split("chain")[0].split(
        "first divergences")[1].splitlines()[1]


# --- 7. the optimizer stepped between a micro-batch's forward and backward ----------------------------------------

def test_optimizer_step_between_forward_and_backward_is_a_whole_model_update(script_runs):
    report = script_runs["optimizer_between"]["json"]
    diverged = [r for r in report["regions"] if r["status"] == "diverged"]
    assert diverged and [r["region"] for r in diverged] == [2, 3]  # micro-batch 2's regions only
    for region in diverged:
        assert region["cause"]["kind"] == "state_mutation" and region["cause"]["mechanism"] == "optimizer_step"
        assert "optimizer" in region["cause"]["detail"]
        titles = [s["title"] for s in region["suggestions"]]
        assert titles[0] == "Update the parameters only after the backward of every forward that read them"
        assert "router" not in json.dumps(region["suggestions"])


# --- 9. a crash is not clean; nothing compared is not clean --------------------------------------------------------

def test_crash_in_backward_leads_the_headline_and_is_not_clean(script_runs):
    run = script_runs["crash_in_backward"]
    report = run["json"]
    assert run["proc"].returncode == 1  # the script's own exit code
    assert report["verdict"] == "unchecked" and report["title"] == "CRASHED"
    headline = report["headline"]
    assert headline.startswith("the script crashed in the backward, after region 2")
    assert "RuntimeError: one of the variables needed for gradient computation" in headline
    assert "1 region(s) checked clean, 2 never checked (not recomputed: the run stopped)" in headline
    assert "CRASHED" in run["proc"].stdout and "not recomputed: the run stopped" in run["proc"].stdout
    assert [r["unchecked_reason"] for r in report["regions"][:2]] == ["not recomputed: the run stopped"] * 2
    again = run_cli("report", str(run["dir"]), cwd=REPO)
    assert again.returncode == 4, again.stderr
    html = render_html(ac_diff.diagnose_paths([run["dir"]]))
    assert "CRASHED" in html and "not recomputed: the run stopped" in html


def test_nothing_compared_is_unchecked_and_fails_check(tmp_path):
    script = tmp_path / "forward_only.py"
    script.write_text(
        "import torch, torch.nn as nn, torch.utils.checkpoint as cp\n"
        "torch.manual_seed(0)\n"
        "block = nn.Linear(8, 8)\n"
        "y = cp.checkpoint(block, torch.randn(2, 8, requires_grad=True), use_reentrant=False)\n"
        "print(float(y.sum()))  # evaluation with grad on: the backward never runs\n")
    json_path = tmp_path / "r.json"
    proc = run_cli("run", "--check", "-o", str(tmp_path / "out"), "--json", str(json_path), str(script), cwd=tmp_path,
                   env=WIDE)
    report = json.loads(json_path.read_text())
    assert report["verdict"] == "unchecked" and report["title"] == "NOTHING CHECKED"
    assert report["headline"].startswith("nothing compared")
    assert proc.returncode == 4, proc.stderr  # --check does not pass it as clean
    assert "NOTHING CHECKED" in proc.stdout and "not recomputed: no backward" in proc.stdout
    assert run_cli("report", str(tmp_path / "out"), cwd=tmp_path).returncode == 4


def test_truncated_trace_is_unchecked(script_runs, tmp_path):
    """A trace cut after the first region's forward (a killed writer): nothing compared, never "clean", and said to
    be cut short (as the README says of a trace without its end record)."""
    lines = (script_runs["crash_in_backward"]["dir"] / "trace-rank0.jsonl").read_text().splitlines()
    cut = next(i for i, line in enumerate(lines) if '"type": "pass"' in line or '"type":"pass"' in line)
    (tmp_path / "trace-rank0.jsonl").write_text("\n".join(lines[:cut + 1]) + "\n")
    report = ac_diff.diagnose_paths([tmp_path / "trace-rank0.jsonl"])
    assert report.verdict == "unchecked" and report.title == "CUT SHORT"
    assert "CUT SHORT" in _terminal(report) and "CUT SHORT" in render_html(report)


# --- 10. chains follow the data ----------------------------------------------------------------------------------

def test_chain_follows_producer_links_not_trace_order(script_runs):
    report = script_runs["moe_loop_router"]["json"]
    region = next(r for r in report["regions"] if r["status"] == "diverged")
    assert region["cause"]["kind"] == "state_mutation" and region["cause"]["tensor"] == f"{region['module']}.bias"
    ops = [step.split(" ")[0] for step in region["chain"][1:-1]]
    # bincount runs between topk and eq in the trace, but the nonzero whose shape differs reads eq <- topk
    assert ops[0] == "aten.add.Tensor" and "aten.topk.default" in ops and ops[-1] == "aten.nonzero.default"
    assert "aten.eq.Scalar" in ops and not any("bincount" in op or "_to_copy" in op for op in ops)


# --- 11. say it once ---------------------------------------------------------------------------------------------

def test_regions_with_one_cause_are_grouped_and_fixes_shown_once(script_runs):
    run = script_runs["six_layers_same_cause"]
    report = run["json"]
    assert [g["label"] for g in report["groups"]] == ["layers.0-5"]
    group = report["groups"][0]
    assert group["culprit"] == "scale" and len(group["regions"]) == 6 and group["cause"] == "state_mutation"
    assert "layers.0-5: same cause" in report["headline"]
    assert all(r["suggestions"] for r in report["regions"])  # every region keeps its detail in the JSON
    text = ac_diff.diagnose_paths([run["dir"]])
    out = _terminal(text)
    assert len(re.findall(r"^fix: Update `layers\.\d\.scale`", out, re.M)) == 1
    assert out.count("cause: state_mutation") == 1 and "layers.0-5: same cause in 6 regions" in out
    assert len(out.splitlines()) < 90
    assert render_html(text).count("(layers.0-5: same cause)") == 6  # each row of the HTML table says so


def test_two_runs_that_differ_only_in_a_python_float_differ_by_an_argument(tmp_path):
    """`ac-diff compare A B`, metadata-only traces: the scalar that differs is the difference found."""
    from ac_diff.diagnosis.two_runs import compare_runs
    from ac_diff.trace import read_run

    paths = []
    for temperature in (0.5, 0.25):
        torch.manual_seed(0)
        model = Tempered()
        model.temperature = temperature
        path = tmp_path / f"t{temperature}.jsonl"
        with ac_diff.record(path, fingerprints=False):
            cp.checkpoint(model, torch.randn(4, 8, requires_grad=True), use_reentrant=False).sum().backward()
        paths.append(path)
    report = compare_runs(read_run(paths[0]), read_run(paths[1]))
    assert report.verdict == "diverged" and report.title == "RUNS DIFFER"
    arg = report.regions[0].first_argument_divergence
    assert arg is not None and arg.op == "aten.mul.Tensor" and "0.5→0.25" in arg.summary
    assert report.regions[0].first_shape_divergence is None


class _DropBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.drop = nn.Linear(8, 8), nn.Dropout(0.5)

    def forward(self, x):
        return torch.tanh(self.drop(self.fc(x)))


@pytest.mark.parametrize("preserve", [False, True])
def test_a_trace_recorded_without_fingerprints_is_never_called_clean(tmp_path, preserve):
    """--no-fingerprints records shapes, dtypes and ops only. Dropout without its RNG state recomputes other masks of
    the same shapes, and the report said "clean: all 1 recomputed region(s) reproduced their saved tensors exactly";
    a control is no more proven clean by metadata alone. Both: VALUES NOT COMPARED, unchecked (exit 4)."""
    torch.manual_seed(0)
    block, path = _DropBlock(), tmp_path / "t.jsonl"
    with ac_diff.record(path, fingerprints=False):
        x = torch.randn(4, 8, requires_grad=True)
        cp.checkpoint(block, x, use_reentrant=False, preserve_rng_state=preserve).sum().backward()
    report = ac_diff.diagnose_paths([path])
    assert (report.verdict, report.title) == ("unchecked", "VALUES NOT COMPARED"), report.headline
    assert report.regions[0].unchecked_reason == "values not recorded", report.regions[0]
    assert report.headline.startswith("values not compared: 1 recomputed region(s) match their forward in shapes"), \
        report.headline
    with ac_diff.record(tmp_path / "v.jsonl"):  # the same with values: the control is clean, the other diverged
        torch.manual_seed(0)
        cp.checkpoint(block, x, use_reentrant=False, preserve_rng_state=preserve).sum().backward()
    assert ac_diff.diagnose_paths([tmp_path / "v.jsonl"]).verdict == ("clean" if preserve else "diverged")


def test_watch_refuses_to_run_without_fingerprints():
    """Watch confirms a divergence by recording its module in full; without values that recording found nothing, and
    the watched divergence it was to confirm was counted clean (dropout without RNG state: 6 of 8 regions)."""
    from ac_diff.capture.recorder import RecordOptions

    with pytest.raises(ValueError, match="--no-fingerprints cannot be combined with --watch"):
        RecordOptions(watch=True, fingerprints=False)


# --- a captured tensor the nested recompute cannot name ------------------------------------------------------

class _MaskedLayer(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x, holder):
        return torch.tanh(self.lin(x) + holder.mask[:, :, None])


class _MaskedStack(nn.Module):
    """Caches the additive mask as an attribute (`mask` of the root module), read by inner checkpointed layers through `holder`:
    named from the module stack in the forward, not in the inner recompute, which runs without the stack."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_MaskedLayer() for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = cp.checkpoint(layer, x, self, use_reentrant=False)
        return x


def test_a_refilled_mask_is_the_cause_even_where_the_recompute_cannot_name_it(tmp_path):
    """A GPipe-like schedule (every micro-batch's forward, then their backwards) refills ONE mask buffer per
    micro-batch: the first micro-batch's recompute reads the second's mask. A stranger's script read as a
    nondeterministic kernel (the recompute's `external[0]` was not paired with the forward's `stack.mask`)."""
    torch.manual_seed(0)
    stack = _MaskedStack()
    mask = torch.zeros(2, 8)
    path = tmp_path / "t.jsonl"
    with ac_diff.record(path):
        outs = []
        for fill in (0.0, -3.0):
            mask.fill_(fill)
            stack.mask = mask
            outs.append(cp.checkpoint(stack, torch.randn(2, 8, 16, requires_grad=True), use_reentrant=False))
        for out in outs:
            out.pow(2).sum().backward()
    report = ac_diff.diagnose_paths([path])
    assert report.verdict == "diverged", report.headline
    lead = report.lead_groups()[0][0]
    assert (lead.cause.kind, lead.cause.tensor) == ("state_mutation", "mask"), lead.cause


class _EmaHead(nn.Module):
    """Centers its logits with EMA buffers it updates inside the checkpointed forward, optimizer-like, through
    torch._foreach_mul_ / _foreach_add_ after reading them: the recompute reads them updated."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.register_buffer("center", torch.zeros(8))
        self.register_buffer("scale", torch.ones(8))

    def forward(self, x):
        z = self.proj(x)
        out = torch.log_softmax((z - self.center) / self.scale, dim=-1)
        with torch.no_grad():
            buffers = [self.center, self.scale]
            torch._foreach_mul_(buffers, 0.9)
            torch._foreach_add_(buffers, [z.mean(0) * 0.1, z.std(0) * 0.1])
        return out


def test_buffers_a_foreach_update_in_the_forward_advances_are_named_as_updated_by_the_region_itself(tmp_path):
    """A stranger's DINO-like head: the cause says the region's own forward updates the buffer (a foreach op writes
    each tensor of its first list), not that something modified it between the forward and the backward."""
    torch.manual_seed(0)
    report = _record(tmp_path, _EmaHead(), torch.randn(4, 8))
    lead = report.lead_groups()[0][0]
    assert lead.cause.kind == "state_mutation" and lead.cause.tensor in ("center", "scale"), lead.cause
    assert "the region's own forward updates it in place (aten._foreach_" in lead.cause.detail, lead.cause.detail


class _SpectralBlock(nn.Module):
    """spectral_norm's power iteration updates its `_u`/`_v` buffers in place in every training forward
    (`F.normalize(..., out=self._u)`, under no_grad): the recompute iterates again from the updated buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.utils.parametrizations.spectral_norm(nn.Linear(8, 8))

    def forward(self, x):
        return torch.tanh(self.fc(x))


class _Disc(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.blk, self.reentrant = _SpectralBlock(), reentrant

    def forward(self, x):
        return cp.checkpoint(self.blk, x, use_reentrant=self.reentrant)


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("root", ["model", "region"])
def test_a_buffer_a_parametrization_updates_through_out_is_named_by_its_path_and_updated_by_the_region(
        tmp_path, reentrant, root):
    """A stranger's GAN discriminator: the buffer was named `0._v` (spectral_norm runs its parametrization once while
    the model is built, before any forward: that module was named as a root of its own for good), and the cause said
    it was modified between the forward and the backward (an `out=` write was not seen as one). `root`: the model
    holding the checkpointed block is called, or the block is checkpointed on its own."""
    path = tmp_path / "t.jsonl"
    with ac_diff.record(path):
        torch.manual_seed(0)
        model = _Disc(reentrant) if root == "model" else _SpectralBlock()  # built while recording, as under `run`
        x = torch.randn(4, 8, requires_grad=True)
        y = model(x) if root == "model" else cp.checkpoint(model, x, use_reentrant=reentrant)
        y.pow(2).sum().backward()
    report = ac_diff.diagnose_paths([path])
    lead = report.lead_groups()[0][0]
    prefix = "blk." if root == "model" else ""
    assert lead.cause.kind == "state_mutation", lead.cause
    assert lead.cause.tensor in (f"{prefix}fc.parametrizations.weight.0._u", f"{prefix}fc.parametrizations.weight.0._v"
                                 ), lead.cause
    assert "the region's own forward updates it in place (aten.div.out" in lead.cause.detail, lead.cause.detail


@pytest.mark.parametrize("reentrant", [False, True])
def test_the_fix_for_a_parametrizations_own_update_is_one_that_makes_the_region_clean(tmp_path, reentrant):
    """The fix said "Update `fc.parametrizations.weight.0._v` after the backward", which a user of spectral_norm
    cannot do (torch's parametrization updates it). It now says to compute the weight once per step under
    parametrize.cached(), and doing what it says makes the same region reproduce its forward."""
    import torch.nn.utils.parametrize as P

    torch.manual_seed(0)
    model, x = _Disc(reentrant), torch.randn(4, 8, requires_grad=True)
    path = tmp_path / "before.jsonl"
    with ac_diff.record(path):
        model(x).pow(2).sum().backward()
    fix = ac_diff.diagnose_paths([path]).lead_groups()[0][0].suggestions[0]
    assert fix.title == "Compute `blk.fc.weight` once per step, outside the checkpointed region", fix.title
    assert "P.cached()" in fix.code and "P.is_parametrized(m)" in fix.code
    path = tmp_path / "after.jsonl"
    with ac_diff.record(path), P.cached():  # what the fix's code does
        for m in model.modules():
            if P.is_parametrized(m):
                m.weight
        model(x).pow(2).sum().backward()
    report = ac_diff.diagnose_paths([path])
    assert report.verdict == "clean", report.headline


class _CenterFirst(nn.Module):
    """Updates its EMA center first, then computes with it: the recompute updates it a second time before reading."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.register_buffer("center", torch.zeros(8))

    def forward(self, x):
        with torch.no_grad():
            self.center.mul_(0.9).add_(x.mean(0), alpha=0.1)
        return torch.tanh(self.proj(x) - self.center)


@pytest.mark.parametrize("model", [_CenterFirst, _EmaHead])
def test_the_fix_for_a_buffer_the_regions_forward_updates_keeps_the_training_of_a_run_without_ac(tmp_path, model):
    """_CenterFirst updates its center, then computes with it: the fix said to move the update after the backward
    (then every forward reads the value one step late: other gradients than without AC). It now says to make the
    update right before the checkpoint call, and doing so gives the gradients of a run without AC bit for bit.
    _EmaHead reads, then updates (after its last saved tensor: torch's early stop ends the recompute before it): the
    update moves after the backward. Each fix also says whether the recompute runs the update again."""
    torch.manual_seed(0)
    block, x = model(), torch.randn(4, 8)
    lead = _record(tmp_path, copy.deepcopy(block), x).lead_groups()[0][0]
    fix = lead.suggestions[0]
    first = model is _CenterFirst
    assert fix.title == ("Update `center` before the checkpoint call, not inside the checkpointed region" if first
                         else "Apply the update of `center` after the backward, not inside the checkpointed region: "
                         "its recompute reads the updated value"), fix.title
    assert ("the recompute runs that update a second time" in fix.text) == first, fix.text
    assert ("applies it a second time" in lead.cause.detail) == first, lead.cause.detail
    if not first:
        assert "loss.backward()" in fix.code and "register_step_post_hook" in fix.code, fix.code
        return
    grads = []
    for fixed in (False, True):  # without AC, then with AC and the update made before the checkpoint call
        b = copy.deepcopy(block)
        if fixed:
            with torch.no_grad():
                b.center.mul_(0.9).add_(x.mean(0), alpha=0.1)
            y = cp.checkpoint(lambda t: torch.tanh(b.proj(t) - b.center), x, use_reentrant=False)
        else:
            y = b(x)
        y.pow(2).sum().backward()
        grads.append([p.grad for p in b.parameters()] + [b.center])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


class _CachedEmbedding(nn.Module):
    """Caches a sinusoidal embedding per timestep in a dict, filled by its forward on a miss (a DiT's timestep
    conditioning): the recompute finds it cached."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.cache = nn.Linear(8, 8), {}

    def embedding(self, t: int) -> torch.Tensor:
        if t not in self.cache:
            with torch.no_grad():
                self.cache[t] = torch.sin(torch.arange(8.0) * (t + 1))[None]
        return self.cache[t]

    def forward(self, x):
        e = self.embedding(3)  # (first: the forward's first op runs under no_grad)
        return torch.tanh(self.fc(x) + e)


@pytest.mark.parametrize("scaled", [True, False])
def test_a_cached_tensor_the_forward_made_and_code_then_scales_in_place_is_the_cause(tmp_path, scaled):
    """A stranger's DiT: a scheduler scales the cached conditioning in place between the forward and the backward.
    The report blamed the cache filling up (a dict of 0 entries in the forward, 1 in the recompute: another
    branch), which alone is harmless (the control: no scaling, clean)."""
    torch.manual_seed(0)
    model = _CachedEmbedding()

    def scale():
        if scaled:
            model.cache[3].mul_(0.5)

    report = _record(tmp_path, model, torch.randn(4, 8), between=scale)
    # the state is read as the region's module begins, not at its first op (the cache fill under no_grad)
    assert "grad_enabled" not in report.regions[0].state_changes, report.regions[0].state_changes
    if not scaled:
        assert report.verdict == "clean", report.headline
        return
    lead = report.lead_groups()[0][0]
    assert lead.cause.kind == "state_mutation" and lead.cause.tensor == "cache[3]", lead.cause
    assert "made (aten.unsqueeze.default at" in lead.cause.detail and "version went from 0 to 1" in lead.cause.detail
    assert lead.suggestions[0].title.startswith("Do not modify `cache[3]` in place"), lead.suggestions[0]


class _QatBlock(nn.Module):
    """Quantization-aware training: torch.ao's fused observer + fake-quantize (fbgemm's QAT qconfig) on the block's
    activations; the observer updates its running range in place each time it runs."""

    def __init__(self, fused: bool = True) -> None:
        super().__init__()
        import torch.ao.quantization as tq

        # (not fused: a FakeQuantize whose moving-average observer updates its range with plain ops)
        self.fc, self.fq = nn.Linear(8, 8), tq.get_default_qat_qconfig("fbgemm").activation() if fused else \
            tq.FakeQuantize(observer=tq.MovingAverageMinMaxObserver, quant_min=0, quant_max=255)

    def forward(self, x):
        return x + self.fc(self.fq(x))


@pytest.mark.filterwarnings("ignore:Please use quant_min and quant_max")
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "moving_average"])
def test_a_fake_quantize_observer_the_recompute_updates_again_is_the_cause_and_its_fix_works(tmp_path, fused):
    """A stranger's QAT script: the observer op's inputs read as identical (the region updates its range itself,
    which counted as a side effect), so the report blamed a nondeterministic kernel and suggested deterministic
    algorithms. The observer's range is the cause; turning the observers off for the backward makes it reproduce.
    An observer that is not fused (its moving average in plain ops) gets the same fix (it got "move the update out
    of the checkpointed region")."""
    import torch.ao.quantization as tq

    torch.manual_seed(0)
    model, xs = _QatBlock(fused), [torch.randn(4, 8) * (1 + i) for i in range(2)]  # (a wider range each step)

    def step(path, observers_off: bool):
        with ac_diff.record(path):
            for x in xs:
                loss = cp.checkpoint(model, x, use_reentrant=False).pow(2).sum()
                if observers_off:
                    model.apply(tq.disable_observer)
                loss.backward()
                model.apply(tq.enable_observer)
        return ac_diff.diagnose_paths([path])

    report = step(tmp_path / "qat.jsonl", observers_off=False)
    lead = report.lead_groups()[0][0]
    assert (lead.cause.kind, lead.cause.mechanism) == ("state_mutation", "updated_in_forward"), lead.cause
    assert lead.cause.tensor.startswith("fq.activation_post_process."), lead.cause
    # a restore covers the whole observer (its range, scale and zero point), not only what the first op named
    assert {"fq.activation_post_process.min_val", "fq.activation_post_process.max_val"} <= set(lead.cause.names) \
        and len(lead.cause.names) > 2, lead.cause.names
    assert lead.suggestions[0].title == "Turn the quantization observers off while the backward runs"
    assert "tq.disable_observer" in lead.suggestions[0].code
    fixed = step(tmp_path / "fixed.jsonl", observers_off=True)
    assert fixed.verdict == "clean", fixed.headline


class _FrozenStem(nn.Module):
    """A frozen embedding feeding reentrant-checkpointed blocks: no input of the first checkpoint requires grad."""

    def __init__(self, train_blocks: bool = True) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8).requires_grad_(False)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(2)])
        self.blocks.requires_grad_(train_blocks)
        self.head = nn.Linear(8, 2)

    def forward(self, ids):
        x = self.emb(ids)
        for block in self.blocks:
            x = cp.checkpoint(block, x, use_reentrant=True)
        return self.head(x)


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
@pytest.mark.parametrize("case", ["full", "watch", "frozen_blocks", "no_grad"])
def test_a_reentrant_region_no_input_of_which_requires_grad_loses_its_gradients(tmp_path, case):
    """A stranger's frozen-embedding model: the blocks' parameters got no gradient (torch only warns) and the report
    said NOTHING CHECKED, "no backward reached this region". Controls: blocks frozen too (nothing lost), and the
    same model under no_grad (an evaluation: no gradient wanted)."""
    torch.manual_seed(0)
    model = _FrozenStem(train_blocks=case != "frozen_blocks")
    ids = torch.randint(0, 16, (4, 5))
    with ac_diff.record(tmp_path / "t.jsonl", **({"watch": True, "watch_full_steps": 0} if case == "watch" else {})):
        for _ in range(2):
            if case == "no_grad":
                with torch.no_grad():
                    model(ids)
            else:
                model(ids).pow(2).mean().backward()
    assert model.blocks[0][0].weight.grad is None  # what the report must say
    report = ac_diff.diagnose_paths([tmp_path / "t.jsonl"])
    # no recompute ever ends a step: a block that begins again does (a stranger's four steps all read "step 1")
    assert [r.step for r in report.regions] == [1, 1, 2, 2], [(r.module, r.step) for r in report.regions]
    if case in ("frozen_blocks", "no_grad"):
        assert report.verdict == "unchecked" and not any(r.cause for r in report.regions), report.headline
        if case == "frozen_blocks":
            assert all(r.unchecked_reason == "needs no backward" for r in report.regions)
        return
    assert report.verdict == "diverged", report.headline
    assert [(r.module, r.status, r.cause.kind) for r in report.regions] == \
        [(f"blocks.{i}", "diverged", "lost_gradient") for i in range(2)] * 2
    lead = report.lead_groups()[0][0]
    assert "its 2 parameter(s) that require grad get no gradient" in lead.cause.detail
    assert lead.suggestions[0].title.startswith("Use use_reentrant=False")


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
@pytest.mark.parametrize("trainable", [True, False])
def test_a_checkpointed_function_no_input_of_which_requires_grad_counts_the_parameters_it_read(tmp_path, trainable):
    """A function, not a module, checkpointed reentrantly on a frozen embedding's output: which parameters it uses
    was unknown (NOTHING CHECKED, "a parameter it uses ... gets no gradient"); its recorded forward read them."""
    torch.manual_seed(0)
    emb, lin = nn.Embedding(16, 8).requires_grad_(False), nn.Linear(8, 8).requires_grad_(trainable)
    head = nn.Linear(8, 2)
    with ac_diff.record(tmp_path / "t.jsonl"):
        x = cp.checkpoint(lambda h: torch.tanh(lin(h)), emb(torch.randint(0, 16, (4, 5))), use_reentrant=True)
        head(x).pow(2).mean().backward()
    assert lin.weight.grad is None
    report = ac_diff.diagnose_paths([tmp_path / "t.jsonl"])
    (region,) = report.regions
    if trainable:
        assert (report.verdict, region.status, region.cause.kind) == ("diverged", "diverged", "lost_gradient"), \
            report.headline
        assert "its 2 parameter(s) that require grad get no gradient" in region.cause.detail, region.cause.detail
    else:
        assert (report.verdict, region.unchecked_reason) == ("unchecked", "needs no backward"), report.headline


def test_torchs_warning_in_a_log_that_no_input_requires_grad_puts_the_gradients_at_risk():
    """The warning is all torch prints for a reentrant region that gets no backward: `compare` on such a log said
    NOTHING CHECKED (exit 4, as for a log with nothing in it), though the region's parameters lost their gradients."""
    import warnings

    from ac_diff.logs import parse_text

    emb, lin = nn.Embedding(16, 8).requires_grad_(False), nn.Linear(8, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cp.checkpoint(lin, emb(torch.randint(0, 16, (4, 5))), use_reentrant=True).sum()
    text = "".join(warnings.formatwarning(w.message, w.category, w.filename, w.lineno) for w in caught)
    assert "None of the inputs have requires_grad=True" in text, text
    report = ac_diff.diagnose([parse_text("step 0 loss 1.0\n" + text + "step 1 loss 0.9\n")])
    assert (report.verdict, report.title) == ("unchecked", "GRADIENTS AT RISK"), (report.title, report.headline)
    assert report.headline.startswith("gradients at risk: 1 reentrant region(s) got no input that requires grad")
    assert report.regions[0].suggestions[0].title.startswith("Use use_reentrant=False"), report.regions[0].suggestions
    # torch prints the same warning for a validation pass under no_grad (26c: a timm-style model validated in train
    # mode): the log alone cannot tell them apart, and the report says so
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        cp.checkpoint(lin, torch.randn(4, 8), use_reentrant=True)
    assert "None of the inputs have requires_grad=True" in str(caught[0].message)
    assert "a checkpointed call under torch.no_grad() (a validation or inference pass)" in report.headline


def test_a_log_file_holding_only_that_warning_is_read(tmp_path):
    """A run that finished, its log holding torch's warning and no error (25g): `compare LOG` refused it ("neither an
    ac-diff trace nor a log with a torch.utils.checkpoint error", exit 2), the silent case the warning is for."""
    import warnings

    emb, lin = nn.Embedding(16, 8).requires_grad_(False), nn.Linear(8, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cp.checkpoint(lin, emb(torch.randint(0, 16, (4, 5))), use_reentrant=True).sum()
    log = tmp_path / "train.log"
    log.write_text("step 0 loss 1.0\n" + "".join(warnings.formatwarning(w.message, w.category, w.filename, w.lineno)
                                                 for w in caught) + "step 1 loss 0.9\n")
    report = ac_diff.diagnose_paths([log])
    assert (report.verdict, report.title) == ("unchecked", "GRADIENTS AT RISK"), (report.title, report.headline)


class _AnnealedMatcher(nn.Module):
    """A DETR-like matcher: the class cost's weight ramps with a call counter, and the assignment is made on the host
    (numpy), handed back with torch.as_tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    @torch.no_grad()
    def forward(self, logits, box_cost):
        self.calls += 1
        cost = -(1.0 + 4.0 * self.calls) * logits.softmax(-1) + box_cost
        return torch.as_tensor(cost.numpy().argmin(1))


class _MatchedHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.matcher = nn.Linear(8, 6), _AnnealedMatcher()

    def forward(self, h, box_cost):
        logits = self.fc(h)
        return logits.log_softmax(-1).gather(1, self.matcher(logits, box_cost)[:, None]).mean()


def test_a_counter_that_steers_host_code_is_named_not_taken_for_a_host_draw(tmp_path):
    """The matcher's weight changed (-5 -> -9, `calls` counted again by the recompute) before the numpy assignment
    that turned it into another index: it said "rng: ... the host code drew other numbers", fix "draw the host random
    values outside the region", though nothing was drawn."""
    torch.manual_seed(0)
    head = _MatchedHead()
    with ac_diff.record(tmp_path / "t.jsonl"):
        h, box = torch.randn(16, 8, requires_grad=True), torch.rand(16, 6) * 3
        cp.checkpoint(head, h, box, use_reentrant=False).backward()
    (region,) = ac_diff.diagnose_paths([tmp_path / "t.jsonl"]).regions
    assert (region.status, region.cause.kind, region.cause.tensor) == ("diverged", "state_mutation", "matcher.calls"), \
        region.cause


class _TemperedRouter(nn.Module):
    """A router whose softmax temperature a schedule anneals: the top-2 weights change with it, the choice does not."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.temperature = nn.Linear(8, 4), 1.0

    def forward(self, x):
        weights, _ = torch.softmax(self.gate(x) / self.temperature, -1).topk(2, -1)
        return x * weights.sum(-1, keepdim=True)


def test_a_top_k_whose_scores_moved_but_whose_choice_held_is_no_flipped_decision(tmp_path):
    """A stranger's report showed "decision aten.topk.default: 0 of 128 rows chose other entries" and a fix saving
    topk: its values output differed, its indices did not."""
    torch.manual_seed(0)
    model = _TemperedRouter()
    report = _record(tmp_path, model, torch.randn(6, 8), between=lambda: setattr(model, "temperature", 1.1))
    region = report.regions[0]
    assert region.status == "diverged" and region.cause.tensor == "_TemperedRouter.temperature", region.cause
    assert region.first_discrete_divergence is None, region.first_discrete_divergence
    assert not any("topk" in s.title for s in region.suggestions), [s.title for s in region.suggestions]
    assert "discrete" not in {row.marker for row in region.window}


def test_a_region_that_saved_no_tensor_is_not_said_to_wait_for_a_recompute(tmp_path):
    """A layer LayerDrop skipped returns its input: it saves nothing, and torch never recomputes it. It read as
    "not recomputed: the run stopped" (or "no backward reached this region")."""
    torch.manual_seed(0)
    layers = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(2)])
    path = tmp_path / "t.jsonl"
    with ac_diff.record(path):
        x = torch.randn(4, 8, requires_grad=True)
        y = cp.checkpoint(layers[0], x, use_reentrant=False)
        y = cp.checkpoint(lambda h: h, y, use_reentrant=False)  # the skipped layer
        y.pow(2).sum().backward()
    report = ac_diff.diagnose_paths([path])
    assert report.verdict == "clean", report.headline
    assert [r.unchecked_reason for r in report.regions] == [None, "saved no tensor: nothing to recompute"]


def test_two_region_inputs_written_behind_autograds_back_are_both_named(tmp_path):
    """A stranger's truncated BPTT: the carried (h, c) are the region's inputs, overwritten through `.data` (no
    version bump: torch says nothing) before the backward. Only input[1] was named."""
    torch.manual_seed(0)
    cell = nn.LSTMCell(8, 8)
    x, h, c = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8), torch.randn(4, 8)
    path = tmp_path / "t.jsonl"
    with ac_diff.record(path):
        nh, nc = cp.checkpoint(lambda x, h, c: cell(x, (h, c)), x, h, c, use_reentrant=False)
        h.data.copy_(nh.detach())
        c.data.copy_(nc.detach())
        (nh.sum() + nc.sum()).backward()
    lead = ac_diff.diagnose_paths([path]).lead_groups()[0][0]
    assert lead.cause.mechanism == "input" and "input[1] (and input[2]) were modified in place" in lead.cause.detail, \
        lead.cause.detail


class _Capacity(nn.Module):
    """Keeps the tokens under a capacity a schedule sets (`capacity`), and writes how many it dropped (`dropped`)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.capacity, self.dropped = nn.Linear(8, 8), 1.0, 0.0

    def forward(self, x):
        keep = (torch.arange(x.shape[0]) < int(x.shape[0] * self.capacity)).float()[:, None]
        self.dropped = 1.0 - float(keep.mean())  # a statistic the forward writes, logged later
        return torch.tanh(self.fc(x) * keep)


def test_a_statistic_the_forward_writes_is_not_in_the_fix_for_an_attribute_changed_between_the_passes(tmp_path):
    """A stranger's capacity-factor MoE: the fix said "Change `capacity_factor`, `last_drop_rate` after the
    backward", naming the drop rate its own forward writes."""
    torch.manual_seed(0)
    model = _Capacity()
    model.capacity = 0.5
    lead = _record(tmp_path, model, torch.randn(8, 8), between=lambda: setattr(model, "capacity", 1.0)) \
        .lead_groups()[0][0]
    assert lead.cause.tensor == "_Capacity.capacity" and lead.cause.names == ["_Capacity.capacity"], lead.cause
    assert lead.suggestions[0].title == "Change `_Capacity.capacity` after the backward, not between forward and " \
        "backward", lead.suggestions[0].title


@pytest.mark.parametrize("backward_inside", [True, False])
def test_autocast_around_the_backward_too_is_clean(tmp_path, backward_inside):
    """A stranger's bf16 training wraps the backward in the same torch.autocast as the forward: autocast's cache keeps
    the bf16 casts of the weights, so the recompute reads them back instead of casting again. It read as another op
    sequence (control_flow) on every region, the gradients bit-identical."""
    torch.manual_seed(0)  # (a pre-norm block: the recompute's first cast, of the normed input, has no twin)
    model = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 48), nn.GELU(), nn.Linear(48, 16))
    x, path = torch.randn(4, 6, 16, requires_grad=True), tmp_path / "t.jsonl"
    with ac_diff.record(path):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = cp.checkpoint(model, x, use_reentrant=False).float().pow(2).mean()
            if backward_inside:
                loss.backward()
        if not backward_inside:
            loss.backward()
    report = ac_diff.diagnose_paths([path])
    assert report.verdict == "clean", report.headline


@pytest.mark.parametrize("reentrant,in_dict", [(True, False), (False, False), (True, True)])
def test_a_custom_functions_ctx_value_from_a_global_changed_before_the_backward(tmp_path, reentrant, in_dict):
    """A stranger's gradient warm-up: a custom autograd.Function keeps a factor from a global step counter on ctx,
    and the loop advances the counter before the backward. Reentrant: the backward runs on the recompute's graph and
    its factor, every op matched, and the report said CLEAN. Non-reentrant: the forward's graph, clean. The counter
    as an item of a module-level dict (a schedule's settings) read as clean too: a dict global was not recorded."""
    out, json_path = tmp_path / "out", tmp_path / "r.json"
    proc = run_cli("run", "-o", str(out), "--json", str(json_path), str(SCRIPTS / "function_ctx_global.py"),
                   *(["--reentrant"] if reentrant else []), *(["--dict"] if in_dict else []), cwd=REPO)
    report = json.loads(json_path.read_text())
    assert proc.returncode == 0, proc.stderr[-2000:]
    if not reentrant:
        assert report["verdict"] == "clean", report["headline"]
        return
    assert report["verdict"] == "diverged", report["headline"]
    cause = report["regions"][0]["cause"]
    name = "function_ctx_global.SCHEDULE['step']" if in_dict else "function_ctx_global.GLOBAL_STEP"
    assert (cause["kind"], cause["tensor"]) == ("state_mutation", name), cause
    assert "read by a custom autograd.Function" in cause["detail"] and "ctx" in cause["detail"]
    # the remedy that keeps AC (27c: neither the report nor `fix` named it): the forward's own graph in the backward
    titles = [s["title"] for s in report["regions"][0]["suggestions"]]
    assert any(t.startswith("Use use_reentrant=False") for t in titles), titles
    from ac_diff.fix.candidates import candidates

    assert "non_reentrant" in [c.kind for c in candidates(ac_diff.diagnose_paths([out / "trace-rank0.jsonl"]))]


class _RunningNorm(nn.Module):
    """Normalizes by a running mean it updates in its own forward (an RL observation normalizer)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(8))

    def forward(self, x):
        self.mean.mul_(0.9).add_(x.detach().mean(0), alpha=0.1)
        return x - self.mean


def test_fix_does_not_try_to_restore_state_inside_a_checkpoint_sequential_segment(tmp_path):
    """A stranger's ResNet stages under checkpoint_sequential: `ac-diff fix` tried restoring the buffers of a segment,
    which the restore cannot reach (a segment is no module), and then said only turning AC off works."""
    from ac_diff.fix.candidates import candidates

    torch.manual_seed(0)
    model = nn.Sequential(_RunningNorm(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    path = tmp_path / "t.jsonl"
    with ac_diff.record(path):
        cp.checkpoint_sequential(model, 2, torch.randn(4, 8, requires_grad=True), use_reentrant=False) \
            .pow(2).sum().backward()
    report = ac_diff.diagnose_paths([path])
    lead = report.lead_groups()[0][0]
    assert lead.module == "segment 0-1" and lead.cause.kind == "state_mutation", (lead.module, lead.cause)
    kinds = [c.kind for c in candidates(report)]
    assert "restore" not in kinds and "no_ac" in kinds, kinds


class _Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(2)])

    def forward(self, x):
        for layer in self.layers:
            x = cp.checkpoint(layer, x, use_reentrant=False)
        return x


class _Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder, self.head = _Encoder(), nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.encoder(x))


@pytest.mark.parametrize("watch", [False, True])
def test_module_names_stay_as_a_region_began_under_them_when_a_larger_root_is_called_before_its_backward(
        tmp_path, watch):
    """The encoder is called on its own first (a root from nowhere, its regions named `layers.0`), then the whole
    model, before the encoder's backward: its recompute names its modules as its forward did (renaming them
    `encoder.layers.0` now would read as other saved tensors to watch, which compares the module of each)."""
    path = tmp_path / "t.jsonl"
    with ac_diff.record(path, **({"watch": True, "watch_full_steps": 0} if watch else {})):
        torch.manual_seed(0)
        model = _Outer()
        first = model.encoder(torch.randn(4, 8, requires_grad=True)).sum()
        second = model(torch.randn(4, 8, requires_grad=True)).sum()
        (first + second).backward()
    report = ac_diff.diagnose_paths([path])
    assert report.verdict == "clean", report.headline


class _Classifier(nn.Module):
    """A stem with one parameter, two blocks with several, a head with one weight (its `t` is what it saves)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(4, 8, bias=False)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.GELU()) for _ in range(2)])
        self.head = nn.Linear(8, 3, bias=False)

    def forward(self, x):
        for m in (self.stem, *self.blocks, self.head):
            x = cp.checkpoint(m, x, use_reentrant=False)
        return x


def test_regions_with_one_changed_parameter_share_the_optimizer_step_other_regions_show(tmp_path):
    """Two micro-batches' forwards first, then each backward followed by opt.step() (a stranger's accumulation
    loop): the second micro-batch's regions recompute with stepped weights. The blocks showed the optimizer step
    (most of their parameters changed); the stem, one parameter, was told to update `stem.weight` after the
    backward, and the head, whose only differing saved tensor is its weight's transpose, had no cause at all."""
    torch.manual_seed(0)
    model = _Classifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = tmp_path / "t.jsonl"
    with ac_diff.record(path):
        losses = [model(torch.randn(4, 4, requires_grad=True)).logsumexp(-1).mean() for _ in range(2)]
        for loss in losses:
            loss.backward()
            opt.step()
            opt.zero_grad()
    report = ac_diff.diagnose_paths([path])
    diverged = {r.module: r for r in report.regions if r.status == "diverged"}
    assert {"stem", "blocks.0", "blocks.1", "head"} <= set(diverged), sorted(diverged)
    for name in ("stem", "head"):
        cause = diverged[name].cause
        assert (cause.kind, cause.mechanism, cause.tensor) == ("state_mutation", "optimizer_step", f"{name}.weight"), \
            (name, cause)
        assert diverged[name].suggestions[0].title.startswith("Update the parameters only after the backward")


class _ClipOnce(nn.Module):
    """Reads its `clip` flag first; a forward hook on its ffn turns the flag on the first time the output is large."""

    def __init__(self) -> None:
        super().__init__()
        self.ffn = nn.Linear(8, 8)
        self.clip = False
        self.ffn.register_forward_hook(self._watch)

    def _watch(self, module, args, out) -> None:
        if out.abs().max() > 0.1:
            self.clip = True

    def forward(self, x):
        if self.clip:
            x = x.clamp(-1, 1)
        return torch.tanh(self.ffn(x))


def test_an_attribute_the_regions_own_forward_changes_after_reading_it_is_said_so(tmp_path):
    """A stranger's clipping switch: the hook flips the flag during the forward, after the block read it; the cause
    said it was changed between the forward and the backward."""
    torch.manual_seed(0)
    model, path = _ClipOnce(), tmp_path / "t.jsonl"
    with pytest.raises(cp.CheckpointError):  # the recompute's clamp saves one more tensor
        with ac_diff.record(path):
            cp.checkpoint(model, torch.randn(4, 8, requires_grad=True), use_reentrant=False).sum().backward()
    lead = ac_diff.diagnose_paths([path]).lead_groups()[0][0]
    assert lead.cause.tensor.endswith("clip"), lead.cause
    assert "the region's forward changed it (False -> True" in lead.cause.detail, lead.cause.detail


class _CachedBias(nn.Module):
    """Builds a position-bias table the first time it sees a length and keeps it (an ALiBi / rotary cache): the
    forward builds it, the recompute finds it cached and builds nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.tables: dict[int, torch.Tensor] = {}

    def forward(self, x):
        n = x.shape[0]
        if n not in self.tables:
            pos = torch.arange(n, dtype=torch.float32)
            self.tables[n] = (pos[None, :] - pos[:, None]).abs().neg().masked_fill(torch.eye(n, dtype=torch.bool), 0)
        return torch.tanh(self.tables[n] @ self.fc(x))


def test_a_table_the_forward_builds_and_the_recompute_finds_cached_is_not_a_divergence(tmp_path):
    """A stranger's cached ALiBi table: the forward's table outlives the region (the module keeps it); the recompute
    does not rebuild it. It read as a silent control-flow divergence, although every saved tensor and the gradients
    matched: what the forward kept was never replaced."""
    torch.manual_seed(0)
    report = _record(tmp_path, _CachedBias(), torch.randn(6, 8, requires_grad=True))
    assert report.verdict == "clean", report.headline


# --- a buffer the region updates itself, read for Python ------------------------------------------------------

class LoggedNorm(nn.Module):
    """A conv + batch norm block that reads its running mean for Python before the norm updates it: for a log line
    (`use=False`), or as a scale of what the relu saves (`use=True`)."""

    def __init__(self, use: bool) -> None:
        super().__init__()
        self.conv, self.bn, self.use = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), use

    def forward(self, x):
        seen = self.bn.running_mean[0].item()  # the recompute reads it after the forward's norm updated it
        self.last_log = f"running_mean[0]={seen:.6f}"
        y = self.bn(self.conv(x))
        return torch.relu(y * (1.0 + seen) if self.use else y)  # (relu saves its output)


def test_a_batch_norm_statistic_read_for_a_log_line_is_no_divergence(tmp_path):
    """`.item()` of a running statistic the region's own batch norm updates gives Python another number in the
    recompute; used only for a log line it reaches no saved tensor: clean, the repeated update a side effect (a
    stranger's CNN, gradients bit-identical to the run without AC). Used as a scale, the same read diverges."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 6, 6, requires_grad=True)
    logged = _record(tmp_path, LoggedNorm(use=False), x).regions[0]
    assert logged.status == "clean", (logged.cause, logged.positions)
    assert any("harmless for the gradients" in n for n in logged.notes)
    assert any("running_mean" in s and "a second time" in s for s in logged.side_effects)
    (tmp_path / "t.jsonl").unlink()
    used = _record(tmp_path, LoggedNorm(use=True), x).regions[0]
    assert used.status == "diverged" and used.cause.kind == "state_mutation"
    assert "running_mean" in used.cause.detail


# --- the default dtype changed around the backward ---------------------------------------------------------------

class AlibiScores(nn.Module):
    """Attention scores plus an ALiBi-like bias whose slopes come from host floats (`torch.tensor`: the default
    dtype)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        slopes = torch.tensor([0.5, 0.25])  # the default dtype, whatever it is when this runs
        scores = self.proj(x) @ x.transpose(-2, -1) + slopes[:, None, None]
        mixed = torch.softmax(scores, -1) @ x  # (float64 weights meet float32 values: the recompute raises here)
        return torch.tanh(self.proj(mixed))


def test_a_default_dtype_changed_around_the_backward_is_the_cause_not_host_randomness(tmp_path):
    """`loss.backward()` inside `set_default_dtype(float64)` (a 'stable' float64 loss): the recompute makes the slopes
    in float64 from the same host numbers. The cause is the default dtype (global state), not host randomness; the
    chain says the recompute raised before torch's check (torch raised no CheckpointError)."""
    torch.manual_seed(0)
    model, x = AlibiScores(), torch.randn(2, 4, 8, requires_grad=True)
    path = tmp_path / "t.jsonl"
    with ac_diff.record(path):
        y = cp.checkpoint(model, x, use_reentrant=False)
        torch.set_default_dtype(torch.float64)
        try:
            y.pow(2).sum().backward()
        except RuntimeError as exc:  # (not torch's CheckpointError: the recompute itself raised)
            assert "expected" in str(exc) and "Double" in str(exc), exc
        finally:
            torch.set_default_dtype(torch.float32)
    region = ac_diff.diagnose_paths([path]).regions[0]
    assert region.status == "diverged"
    assert region.cause.kind == "global_state" and region.cause.tensor == "default_dtype", region.cause
    assert not any("raised_in" in e for e in region.cause.evidence)
    assert "torch raises CheckpointError" not in " ".join(region.chain)


class EvalBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4)

    def forward(self, x):
        return torch.nn.functional.max_pool2d(torch.relu(self.bn(self.conv(x))), 2)


def test_the_chain_follows_the_data_in_forward_order(tmp_path):
    """`model.eval()` for a validation batch between the forward and the backward: the chain goes mode -> batch norm
    (its training argument and statistics' shapes) -> the pool it feeds -> the saved positions, in that order."""
    torch.manual_seed(0)
    model, path = EvalBlock(), tmp_path / "t.jsonl"
    with ac_diff.record(path):
        y = cp.checkpoint(model, torch.randn(2, 3, 8, 8, requires_grad=True), use_reentrant=False)
        model.eval()
        with pytest.raises(cp.CheckpointError):  # the statistics batch norm saves: [4] in the forward, [0] now
            y.sum().backward()
    region = ac_diff.diagnose_paths([path]).regions[0]
    assert region.cause.kind == "global_state" and region.cause.tensor == "training"
    ops = [next((o for o in ("native_batch_norm", "max_pool2d", "relu") if o in link), None) for link in region.chain]
    named = [o for o in ops if o]
    assert named and named[0] == "native_batch_norm", region.chain
    assert named == sorted(named, key=["native_batch_norm", "relu", "max_pool2d"].index), region.chain


class ThreeStages(nn.Module):
    """Three checkpointed stages that read different parameters with different ops (a U-Net's down, mid, up)."""

    def __init__(self) -> None:
        super().__init__()
        self.down = nn.Sequential(nn.Linear(8, 8), nn.GELU())
        self.mid = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8), nn.Tanh())
        self.up = nn.Sequential(nn.Linear(8, 8), nn.Sigmoid())

    def forward(self, x):
        for stage in (self.down, self.mid, self.up):
            x = cp.checkpoint(stage, x, use_reentrant=False)
        return x


def test_the_parameters_updated_before_the_backward_are_one_cause_across_stages(tmp_path):
    """An EMA copied into the model (through `.data`) between the forward and the backward: every stage diverges
    for that one reason, whatever parameters and ops it has; the headline groups them all (it grouped "down, up"
    and left "mid", which read another count of parameters, as if it were another cause)."""
    torch.manual_seed(0)
    model = ThreeStages()
    ema = [p.detach() * 0.9 for p in model.parameters()]

    def swap_in_ema():
        for p, e in zip(model.parameters(), ema):
            p.data.copy_(e)

    path = tmp_path / "t.jsonl"
    with ac_diff.record(path):
        y = model(torch.randn(4, 8, requires_grad=True))
        swap_in_ema()
        y.pow(2).sum().backward()
    report = ac_diff.diagnose_paths([path])
    assert [r.status for r in report.regions] == ["diverged"] * 3
    assert {r.cause.mechanism for r in report.regions} == {"optimizer_step"}
    assert "[3 of 3 regions diverged; down, mid, up: same cause]" in report.headline, report.headline


class BiasLast(nn.Module):
    """A block whose last parameter is read by an op that saves nothing (`+ b`): torch's early stop ends the
    recompute at the last saved tensor, before that op."""

    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Parameter(torch.randn(8, 8) * 0.3), nn.Parameter(torch.randn(8, 8) * 0.3)
        self.b = nn.Parameter(torch.randn(8))

    def forward(self, x):
        return torch.tanh(x @ self.w1) @ self.w2 + self.b


def test_parameters_the_early_stopped_recompute_never_read_are_not_counted_as_unchanged(tmp_path):
    """Every parameter was updated before the backward; the recompute stopped before reading `b`. The update is
    still the whole model's (it said nothing of an optimizer step: 2 of 3 parameters read changed, under the share
    for a whole-model update; elsewhere "5 of the 6 parameters" where all 6 changed)."""
    torch.manual_seed(0)
    model = BiasLast()
    path = tmp_path / "t.jsonl"
    with ac_diff.record(path):
        y = cp.checkpoint(model, torch.randn(4, 8, requires_grad=True), use_reentrant=False)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.9)
        y.pow(2).sum().backward()
    cause = ac_diff.diagnose_paths([path]).regions[0].cause
    assert cause.mechanism == "optimizer_step", cause
    assert cause.detail.startswith("all 2 parameters the recompute read again have other values in the recompute "
                                   "(torch's early stop ended the recompute before it read the other 1)"), cause.detail


# --- delayed scaling: the state that reaches a saved tensor is the cause ------------------------------------------

class DelayedScaled(nn.Linear):
    """Simulated FP8 with delayed scaling (Transformer Engine's recipe): the input is quantized with the scale of
    earlier steps; the forward then rolls its amax history and sets the next scale, inside the region."""

    def __init__(self, i: int, o: int) -> None:
        super().__init__(i, o)
        self.register_buffer("amax_history", torch.zeros(4))
        self.register_buffer("scale", torch.ones(()))

    def forward(self, x):
        s = self.scale.clone()
        xs = x * s
        xq = xs + (xs.to(torch.float8_e4m3fn).to(x.dtype) - xs).detach()
        with torch.no_grad():
            self.amax_history.copy_(torch.roll(self.amax_history, 1))
            self.amax_history[0] = x.abs().amax()
            self.scale.copy_(448.0 / self.amax_history.amax().clamp(min=1e-6))
        return nn.functional.linear(xq / s, self.weight, self.bias)


class ScaledBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = DelayedScaled(16, 32), DelayedScaled(32, 16)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def test_the_changed_state_named_is_the_one_that_reaches_a_saved_tensor(tmp_path):
    """Both linears' scaling state moves in each forward; in a step where fc1's scale comes out the same in the
    recompute, only fc2's scale reaches the saved tensors that differ: the cause names fc2's scale, not fc1's amax
    history, whose roll is the first op that differs but reaches nothing backward reads (a stranger's FP8 MLP)."""
    torch.manual_seed(0)
    block, path = ScaledBlock(), tmp_path / "t.jsonl"
    g = torch.Generator().manual_seed(1)
    with ac_diff.record(path):
        for _ in range(4):
            cp.checkpoint(block, torch.randn(8, 16, generator=g) * 3, use_reentrant=False).pow(2).mean().backward()
    report = ac_diff.diagnose_paths([path])
    diverged = [r for r in report.regions if r.status == "diverged"]
    assert diverged
    for r in diverged:
        reaching = {p.op for p in r.positions if p.values_differ or p.matches is False}
        assert r.cause.tensor.endswith(".scale"), (r.region, r.cause.tensor, reaching)


# --- a counter kept on a class, advanced by the region's own code ----------------------------------------------

class OffsetState:
    """The host-side offset of a counter-based RNG (a fused kernel's Philox offset), advanced at each call."""

    offset = 0

    @classmethod
    def next(cls) -> int:
        cls.offset += 1
        return cls.offset


class HashDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        seed = OffsetState.next()  # the recompute advances it again
        keep = torch.sin(torch.arange(x.numel(), dtype=torch.float32).view(x.shape) * 12.9898 + seed).abs() > 0.3
        return self.lin(x) * keep


def test_a_counter_kept_on_a_class_is_named(tmp_path):
    """`OffsetState.offset`, a class attribute the region's code advances (and the recompute again): the cause
    names it (it said "a Python value passed to aten.add.Tensor changed")."""
    torch.manual_seed(0)
    OffsetState.offset = 0
    report = _record(tmp_path, HashDropout(), torch.randn(4, 8, requires_grad=True))
    cause = report.regions[0].cause
    assert report.regions[0].status == "diverged"
    assert cause.tensor.endswith("OffsetState.offset") and "was 0 in the forward and 1 in the recompute" in \
        cause.detail, cause
    # the region's own code advanced it, and the recompute advances it again: the fix takes it out of the region,
    # in the code's own name for it (it said "keep the global `offset` as the forward saw it", `offset = 0`)
    assert "the update counts twice" in cause.detail and "0 -> 1 in the forward" in cause.detail, cause.detail
    fix = report.regions[0].suggestions[0]
    assert fix.title.startswith("Do not change the global `OffsetState.offset` in the checkpointed forward"), fix
    assert "value = OffsetState.offset" in fix.code and "OffsetState.offset += 1" in fix.code, fix.code


class NormedUntilEval(nn.Module):
    """Its forward saves a norm's statistics only while a flag is set: the recompute, after the flag flipped, saves
    fewer tensors (torch: "a different number of tensors was saved")."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.norm, self.normed = nn.Linear(8, 8), nn.LayerNorm(8), True

    def forward(self, x):
        h = self.lin(x)
        return torch.tanh(self.norm(h) if self.normed else h)


def test_a_count_mismatch_says_the_count_differs_not_that_positions_paired_by_number_do(tmp_path):
    """Past the first tensor the recompute did not save, positions paired by number pair unrelated tensors: the chain
    ends on the count (it said "saved positions 2-4 differ in metadata")."""
    torch.manual_seed(0)
    block = NormedUntilEval()

    def flip():
        block.normed = False

    with pytest.raises(cp.CheckpointError, match="different number of tensors"):
        _record(tmp_path, block, torch.randn(4, 8, requires_grad=True), between=flip)
    region = ac_diff.diagnose_paths([tmp_path / "t.jsonl"]).regions[0]
    assert region.chain[-1].startswith("the recompute saved "), region.chain
    assert "tensors where the forward saved " in region.chain[-1] and "differ in metadata" not in region.chain[-1]
    # positions paired through the aligned ops: the linear's weight matches, what the norm saved (its input, its
    # statistics, its weight) was not saved again, the tanh's output (saved after them) holds other values; paired
    # by number, the tanh's was read as the norm's input and the rest as the norm's
    rows = {r.position: r for r in region.positions}
    assert rows[1].op == "aten.t.default" and rows[1].matches and not rows[1].values_differ
    assert [rows[k].recomputed for k in (2, 3, 4, 5, 6)] == [None] * 5, region.positions
    assert rows[7].op == "aten.tanh.default" and rows[7].matches and rows[7].values_differ, rows[7]


def test_a_tensor_only_the_recompute_saved_is_a_position_of_its_own(tmp_path):
    """`model.eval()` before the backward: the recompute runs no dropout, and its second linear saves the relu's
    output where the forward's saved the dropout's. Paired through the ops, that save has no forward counterpart: a
    row of its own (nothing saved -> its metadata), and the region diverges on it."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Dropout(0.5), nn.Linear(8, 8))
    with pytest.raises(cp.CheckpointError):
        _record(tmp_path, block, torch.randn(4, 8, requires_grad=True), between=block.eval)
    region = ac_diff.diagnose_paths([tmp_path / "t.jsonl"]).regions[0]
    assert region.status == "diverged"
    new = [r for r in region.positions if r.saved is None and r.recomputed is not None]
    assert new and all(r.matches is False for r in new), region.positions
    assert region.chain[-1].startswith("the recompute saved "), region.chain


class _QueueHead(nn.Module):
    """MoCo's contrastive head: logits against a queue of keys, then the batch's keys enqueued into a slice of the
    queue inside the forward, after the last tensor it saves."""

    def __init__(self, d: int = 8, size: int = 16) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d)
        self.register_buffer("queue", torch.randn(d, size))
        self.ptr = 0

    def forward(self, q, k):
        q = self.proj(q)
        logits = torch.cat([(q * k).sum(1, keepdim=True), q @ self.queue.clone()], 1)
        with torch.no_grad():
            self.queue[:, self.ptr:self.ptr + k.shape[0]] = k.T
        self.ptr = (self.ptr + k.shape[0]) % self.queue.shape[1]
        return logits


def test_a_queue_the_forward_enqueues_into_through_a_slice_is_named_with_its_write(tmp_path):
    """The write goes through a view of the buffer (`queue[:, p:p + n] = k.T`: a copy_ into a slice): named with its
    op and line as the region's own update (it said "modified between the forward and the backward"), and the
    recompute, which torch's early stop ends before that write, is not said to apply it again."""
    torch.manual_seed(0)
    head = _QueueHead()
    with ac_diff.record(tmp_path / "t.jsonl"):
        q, k = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8)
        cp.checkpoint(head, q, k, use_reentrant=False).logsumexp(1).mean().backward()
    lead = ac_diff.diagnose_paths([tmp_path / "t.jsonl"]).lead_groups()[0][0]
    assert (lead.cause.kind, lead.cause.tensor) == ("state_mutation", "queue"), lead.cause
    assert "the region's own forward updates it in place (aten.copy_.default at" in lead.cause.detail, lead.cause
    assert "torch's early stop ends it at the last saved tensor" in lead.cause.detail, lead.cause.detail
    fix = lead.suggestions[0]  # its fix says the same: the recompute reads the update, it does not run it again
    assert fix.title == ("Apply the update of `queue` after the backward, not inside the checkpointed region: its "
                         "recompute reads the updated value"), fix.title
    assert "a second time" not in fix.text, fix.text


class _ChunkedRNN(nn.Module):
    """A long sequence in chunks, one checkpoint per chunk; the running (h, c) lives on the module (`self.state`,
    rebound by each chunk), or goes in and out of the checkpointed function (the control)."""

    def __init__(self, carry: str) -> None:
        super().__init__()
        self.cell, self.carry, self.state = nn.LSTMCell(8, 8), carry, None

    def chunk_from_attribute(self, x):
        h, c = self.state
        outs = []
        for t in range(x.shape[1]):
            h, c = self.cell(x[:, t], (h, c))
            outs.append(h)
        self.state = (h, c)
        return torch.stack(outs, 1)

    def chunk_from_arguments(self, x, h, c):
        outs = []
        for t in range(x.shape[1]):
            h, c = self.cell(x[:, t], (h, c))
            outs.append(h)
        return torch.stack(outs, 1), h, c

    def forward(self, x):
        h = c = x.new_zeros(x.shape[0], 8)
        self.state, outs = (h, c), []
        for s in range(0, x.shape[1], 3):
            if self.carry == "attribute":
                outs.append(cp.checkpoint(self.chunk_from_attribute, x[:, s:s + 3], use_reentrant=False))
            else:
                o, h, c = cp.checkpoint(self.chunk_from_arguments, x[:, s:s + 3], h, c, use_reentrant=False)
                outs.append(o)
        return torch.cat(outs, 1)


@pytest.mark.parametrize("carry", ["attribute", "arguments"])
def test_state_a_chunk_rebinds_on_its_module_is_named_as_rebound_with_the_fix_that_passes_it(tmp_path, carry):
    """Each chunk reads `self.state` and rebinds it to its (h, c): every recompute reads the last chunk's state. It
    said "the captured tensor `state[0]` ... was modified between the forward and the backward" (fix: update it
    after the backward) and, for the last chunk, "a cache the forward filled" (fix: parametrize.cached())."""
    torch.manual_seed(0)
    model, path = _ChunkedRNN(carry), tmp_path / "t.jsonl"
    with ac_diff.record(path):
        loss = model(torch.randn(2, 9, 8)).pow(2).sum()
        if carry == "arguments":
            loss.backward()
        else:  # the first chunk's recompute starts from the last chunk's (h, c)
            with pytest.raises(cp.CheckpointError):
                loss.backward()
    report = ac_diff.diagnose_paths([path])
    if carry == "arguments":
        assert report.verdict == "clean", report.headline
        return
    assert report.verdict == "diverged" and len(report.regions) == 3
    for r in report.regions:
        assert (r.status, r.cause.kind, r.cause.mechanism, r.cause.tensor) == (
            "diverged", "state_mutation", "rebound", "state[0]"), (r.region, r.cause)
        made = ("what this region's own forward made" if r.region == 2 else "the output of region 2's forward")
        assert made in r.cause.detail, r.cause.detail
        assert r.suggestions[0].title == ("Pass `state` into the checkpointed function and return its new value, "
                                          "instead of keeping it on the module"), r.suggestions[0]


class _SegmentMemory(nn.Module):
    """Transformer-XL-like segments: a running key-value sum kept on the module, None until the first segment binds
    it (`carry="attribute"`), or handed in and out of the checkpointed function (the control)."""

    def __init__(self, carry: str) -> None:
        super().__init__()
        self.kv, self.carry, self.memory = nn.Linear(8, 8), carry, None

    def segment(self, x, memory=None):
        if self.carry == "attribute":
            memory = self.memory
        start = memory if memory is not None else x.new_zeros(x.shape[-1])
        running = torch.cumsum(torch.tanh(self.kv(x) + start), 0)
        if self.carry == "attribute":
            self.memory = running[-1].detach()
        return running, running[-1].detach()

    def forward(self, x):
        self.memory, memory, outs = None, None, []
        for segment in x.split(4):
            args = (segment,) if self.carry == "attribute" else (segment, memory)
            out, memory = cp.checkpoint(self.segment, *args, use_reentrant=False)
            outs.append(out)
        return torch.cat(outs)


@pytest.mark.parametrize("carry", ["attribute", "arguments"])
def test_an_attribute_that_held_none_in_the_forward_is_named_as_rebound(tmp_path, carry):
    """The first segment's forward found `self.memory` None and made zeros; its recompute found the last segment's
    memory and read it. That region was "control_flow: Python code took another branch", naming nothing, while the
    later segments' regions named `memory` rebound: both are the same attribute, with the fix that passes it in."""
    torch.manual_seed(0)
    model, path = _SegmentMemory(carry), tmp_path / "t.jsonl"
    with ac_diff.record(path):
        model(torch.randn(12, 8)).pow(2).sum().backward()
    report = ac_diff.diagnose_paths([path])
    if carry == "arguments":
        assert report.verdict == "clean", report.headline
        return
    first = report.regions[0]
    assert (first.status, first.cause.kind, first.cause.mechanism, first.cause.names) == (
        "diverged", "state_mutation", "rebound", ["memory"]), first.cause
    assert "held no tensor when the forward ran" in first.cause.detail, first.cause.detail
    assert first.suggestions[0].title == ("Pass `memory` into the checkpointed function and return its new value, "
                                          "instead of keeping it on the module"), first.suggestions[0]
    assert {(r.cause.kind, r.cause.tensor) for r in report.regions if r.status == "diverged"} == {
        ("state_mutation", "memory")}, [r.cause for r in report.regions]


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_clean_run_with_reentrant_regions_says_their_gradients_can_differ_in_the_last_bits(tmp_path, reentrant):
    """A ConvNeXt-like block with layer scale, checkpointed reentrantly: every recompute reproduced its forward (clean)
    while one parameter's gradient differed from a run without AC in its last bits, as its backward ran apart."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
    with ac_diff.record(tmp_path / "t.jsonl"):
        x = torch.randn(4, 8, requires_grad=True)
        cp.checkpoint(block, x, use_reentrant=reentrant).sum().backward()
    report = ac_diff.diagnose_paths([tmp_path / "t.jsonl"])
    assert report.verdict == "clean", report.headline
    assert any("the last bits of some gradients may differ" in n for n in report.notes) == reentrant, report.notes


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("scale", torch.ones(8))

    def forward(self, x):
        return torch.tanh(self.fc(x) * self.scale)


@pytest.mark.parametrize("accumulate", [4, 1])
def test_under_gradient_accumulation_the_headline_names_the_optimizer_step(tmp_path, accumulate):
    """Four micro-batches per optimizer step; from optimizer step 3 a buffer is updated between a micro-batch's
    forward and its backward. A step counts forward-backward cycles, so the headline said "step 9" where the training
    loop printed optimizer step 3; it names both now (one micro-batch per step: the step alone)."""
    torch.manual_seed(0)
    model = _Scaled()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ac_diff.record(tmp_path / "t.jsonl"):
        for step in range(1, 4):
            for _ in range(accumulate):
                out = cp.checkpoint(model, torch.randn(4, 8), use_reentrant=False)
                if step == 3:
                    with torch.no_grad():
                        model.scale.mul_(1.01)
                out.pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
    report = ac_diff.diagnose_paths([tmp_path / "t.jsonl"])
    lead = report.lead_groups()[0][0]
    assert lead.step == 2 * accumulate + 1, lead.step
    assert lead.optimizer_step == (3 if accumulate > 1 else None)
    at = f"step {lead.step} (optimizer step 3)" if accumulate > 1 else f"step {lead.step})"
    assert at in report.headline, report.headline


class _Rotary(nn.Module):
    """A rotary cache rebuilt (rebound to new cos and sin tensors) when a longer input arrives."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.cos, self.sin, self.base = nn.Linear(8, 8), None, None, 10000.0

    def forward(self, x):
        if self.cos is None or self.cos.shape[0] < x.shape[1]:  # (dynamic scaling: the angles depend on the length)
            t = torch.arange(x.shape[1], dtype=torch.float32)[:, None] * (self.base * x.shape[1]) ** -0.5
            self.cos, self.sin = t.cos(), t.sin()
        h = self.fc(x)
        n = x.shape[1]
        return torch.tanh(h * self.cos[:n] + h.flip(-1) * self.sin[:n])


def test_every_rebound_attribute_is_passed_in_by_the_fix(tmp_path):
    """A longer micro-batch rebuilds the rotary cos and sin before the first one's backward: the fix named `cos`
    only (passing it alone leaves the gradients wrong)."""
    torch.manual_seed(0)
    model, path = _Rotary(), tmp_path / "t.jsonl"
    with torch.no_grad():
        model(torch.randn(1, 6, 8))  # the cache built for 6 positions (an earlier step)
    with ac_diff.record(path):
        first = cp.checkpoint(model, torch.randn(2, 6, 8), use_reentrant=False)
        second = cp.checkpoint(model, torch.randn(2, 8, 8), use_reentrant=False)
        (first.sum() + second.sum()).backward()
    lead = ac_diff.diagnose_paths([path]).lead_groups()[0][0]
    assert (lead.cause.mechanism, sorted(lead.cause.names)) == ("rebound", ["cos", "sin"]), lead.cause
    fix = lead.suggestions[0]
    assert fix.title == "Pass `cos`, `sin` into the checkpointed function, instead of reading them from the module", fix
    assert "self.cos, self.sin" in fix.code, fix.code


def test_each_recompute_says_which_backward_pass_ran_it_and_the_reference_counts_by_it(tmp_path):
    """Two micro-batches forwarded, then backpropagated one by one, the optimizer stepping between them (the bug):
    both forwards are step 1, the second region is recomputed in backward 2. The reference, having compared backward
    1 only, names that region as recomputed after what it compared (it named a region of step 2: by step, region 1
    looked compared)."""
    from types import SimpleNamespace

    from ac_diff.report import diverged_after

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ac_diff.record(tmp_path / "t.jsonl"):
        for _ in range(2):
            losses = [cp.checkpoint(model, torch.randn(4, 8), use_reentrant=False).pow(2).mean() for _ in range(2)]
            for i, loss in enumerate(losses):
                loss.backward()
                if i == 0:
                    opt.step()
    report = ac_diff.diagnose_paths([tmp_path / "t.jsonl"])
    assert [(r.region, r.step, r.backward) for r in report.regions] == [(0, 1, 1), (1, 1, 2), (2, 2, 3), (3, 2, 4)]
    assert report.regions[1].status == "diverged"
    assert [r.region for r in diverged_after(report.regions, 1)] == [1, 3]
    legacy = SimpleNamespace(status="diverged", step=2, region=7)  # (a trace without backward numbers: by step)
    assert diverged_after([legacy], 1) == [legacy] and diverged_after([legacy], 2) == []


class _SelectionBiasRouter(nn.Module):
    """DeepSeek-style routing: a bias steers which experts are chosen, the weights come from the unbiased scores, and
    the weighted outputs of the k choices are summed (their order does not matter to the result)."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.Linear(8, 4 * 8)
        self.register_buffer("bias", torch.zeros(4))

    def forward(self, x, scores):
        idx = (scores + self.bias).topk(2, dim=-1).indices
        weights = scores.softmax(-1).gather(-1, idx)
        outs = self.experts(x).view(-1, 4, 8).gather(1, idx[..., None].expand(-1, -1, 8))
        return (weights[..., None] * outs).sum(1)


def test_a_top_k_that_chose_the_same_entries_in_another_order_says_so(tmp_path):
    """A load-balancing bias moved between forward and backward swaps the two experts one token chose (25f): the
    report said "1 of 64 rows chose other entries" and "the gradients ... are silently wrong", where they are
    bit-identical to a run without AC (the k choices are summed). It says the same entries were chosen in another
    order, and that the gradients are wrong only where the code uses that order."""
    scores = torch.zeros(6, 4)
    scores[:, 0], scores[:, 1] = 1.0, 0.9  # experts 0 and 1 chosen, 0 first ...
    scores[3, 1] = 0.999  # ... and in one row nearly tied: a bias of 0.01 on expert 1 puts it first there
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(0))

    def grads(ac: bool):
        torch.manual_seed(0)
        router = _SelectionBiasRouter()
        xs = x.clone().requires_grad_()
        out = cp.checkpoint(router, xs, scores, use_reentrant=False) if ac else router(xs, scores)
        router.bias[1] += 0.01  # (the balancing update, before the backward)
        out.square().sum().backward()
        return [p.grad for p in router.parameters()] + [xs.grad]

    assert all(torch.equal(a, b) for a, b in zip(grads(True), grads(False)))  # (the ground truth)
    path = tmp_path / "t.jsonl"
    with ac_diff.record(path):
        grads(True)
    report = ac_diff.diagnose_paths([path])
    (region,) = report.regions
    assert region.status == "diverged"
    flip = region.first_discrete_divergence
    assert flip.reordered_only and flip.summary.startswith("1 of 6 rows chose the same entries in another order"), \
        flip.summary
    assert "only where the code uses that order" in report.silent_warning
    assert "silently wrong where the backward uses the order of the choices" in region.chain[-1], region.chain


def _swapping_steps(ac: bool, steps: int, nudged: int | None = None) -> list[torch.Tensor]:
    """Optimizer steps (lr 0) of a _SelectionBiasRouter whose balancing bias moves before each backward: row 3 swaps
    its two experts in the recompute (the same two, in another order), in the first `nudged` steps (all by default);
    the gradients of every step."""
    scores = torch.zeros(6, 4)
    scores[:, 0], scores[:, 1] = 1.0, 0.9
    scores[3, 1] = 0.999  # (nearly tied: a bias of 0.01 on expert 1 puts it first there)
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    router, grads = _SelectionBiasRouter(), []
    opt = torch.optim.SGD(router.parameters(), lr=0.0)
    for step in range(steps):
        nudge = 0.01 if nudged is None or step < nudged else 0.0
        xs = x.clone().requires_grad_()
        out = cp.checkpoint(router, xs, scores, use_reentrant=False) if ac else router(xs, scores)
        router.bias[1] += nudge  # (the balancing update, before the backward)
        out.square().sum().backward()
        grads += [p.grad.clone() for p in router.parameters()] + [xs.grad]
        router.bias[1] -= nudge
        opt.step()
        opt.zero_grad()
    return grads


@pytest.mark.parametrize("compared", [1, 2])
def test_choices_made_in_another_order_settle_clean_once_every_backwards_gradients_match(tmp_path, compared):
    """25j: the same experts chosen in another order, summed, the gradients bit-identical to the run without AC: the
    run stayed SILENTLY DIVERGED with `--check` exit 1 after its own `--reference no-ac` compared every backward pass
    and found them identical. Over every backward pass the run made, that settles it: clean, the regions noted, the
    cause and its fix kept (a larger bias step flips a choice). Over fewer it cannot: a later one may flip a set."""
    from ac_diff.reference.explain import attach
    from ac_diff.reference.result import IDENTICAL, ReferenceResult, StepComparison
    from ac_diff.reference.run import diverged_later
    from ac_diff.report import diverged_after

    assert all(torch.equal(a, b) for a, b in zip(_swapping_steps(True, 2), _swapping_steps(False, 2)))  # (truth)
    path = tmp_path / "t.jsonl"
    with ac_diff.record(path):
        _swapping_steps(True, 2)
    report = ac_diff.diagnose_paths([path])
    assert [r.status for r in report.regions] == ["diverged"] * 2
    attach(report, ReferenceResult("no-ac", IDENTICAL, "gradients identical", compared,
                                   steps=[StepComparison(i, True, 0.0, 2, 2) for i in range(compared)]))
    if compared < 2:
        assert (report.verdict, report.title) == ("diverged", "SILENTLY DIVERGED"), report.headline
        # the reference's headline: region 0 diverged in the compared backward, region 1 after it (it named region 1
        # "the first region that diverged")
        said = diverged_later(report.regions, diverged_after(report.regions, 1), captured=2)
        assert said.startswith("; 1 region(s) diverged in the compared backward pass(es) without changing the "
                               "gradients, but region 1 (") and "`--reference-steps 2` compares it" in said, said
        return
    assert (report.verdict, report.title) == ("clean", "CLEAN"), report.headline
    assert "chose the same top-k entries in another order" in report.headline, report.headline
    for region in report.regions:
        assert region.cause.tensor == "bias" and region.suggestions, region.cause
        assert any("match the run without AC over all 2 backward passes" in n for n in region.notes), region.notes


def test_choices_made_in_another_order_settle_clean_when_every_later_region_reproduced_its_forward(tmp_path):
    """27e: the same experts chosen in another order in step 1 only, the gradients compared over 2 of the 3 backward
    passes and bit-identical; step 3's regions reproduced their saved tensors exactly. The run stayed SILENTLY
    DIVERGED (`--check` exit 1) for want of a comparison of backward 3, where nothing diverged to compare."""
    from ac_diff.reference.explain import attach
    from ac_diff.reference.result import IDENTICAL, ReferenceResult, StepComparison

    assert all(torch.equal(a, b) for a, b in zip(_swapping_steps(True, 3, nudged=1), _swapping_steps(False, 3)))
    path = tmp_path / "t.jsonl"
    with ac_diff.record(path):
        _swapping_steps(True, 3, nudged=1)
    report = ac_diff.diagnose_paths([path])
    assert [r.status for r in report.regions] == ["diverged", "clean", "clean"]
    attach(report, ReferenceResult("no-ac", IDENTICAL, "gradients identical", 2,
                                   steps=[StepComparison(i, True, 0.0, 2, 2) for i in range(2)]))
    assert (report.verdict, report.title) == ("clean", "CLEAN"), report.headline
    assert "over the 2 compared backward passes" in report.headline and "1 later backward pass(es) reproduced" in \
        report.headline, report.headline


def test_a_watched_region_whose_module_chose_the_same_entries_in_another_order_settles_with_it(tmp_path):
    """26h: under watch the first divergent step is compared by its saved tensors only (no ops, no decision), its
    module recorded in full from the next step on, where the top-k choice shows as the same entries in another order.
    The gradients matched the run without AC over every backward pass, yet the watched region stayed SILENTLY
    DIVERGED: it had no decision of its own to show. Its module's recording in full shows it, for both."""
    from ac_diff.reference.explain import attach
    from ac_diff.reference.result import IDENTICAL, ReferenceResult, StepComparison

    assert all(torch.equal(a, b) for a, b in zip(_swapping_steps(True, 3), _swapping_steps(False, 3)))
    path = tmp_path / "t.jsonl"
    with ac_diff.record(path, watch=True, watch_full_steps=0):
        _swapping_steps(True, 3)
    report = ac_diff.diagnose_paths([path])
    watched, full = report.regions[0], report.regions[1]
    assert (watched.watched, full.watched, watched.status, full.status) == (True, False, "diverged", "diverged")
    assert watched.first_discrete_divergence is None and full.first_discrete_divergence.reordered_only
    attach(report, ReferenceResult("no-ac", IDENTICAL, "gradients identical", 3,
                                   steps=[StepComparison(i, True, 0.0, 2, 2) for i in range(3)]))
    assert (report.verdict, report.title) == ("clean", "CLEAN"), report.headline
    assert watched.status == "clean" and any("as its module's recording in full shows" in n for n in watched.notes), \
        watched.notes


def test_a_choice_whose_scores_moved_without_flipping_is_noted_on_a_clean_run(tmp_path):
    """The origin thread's MoE at a small size (27e): the balancing bias moved between forward and backward, the
    recompute's top-k scores moved with it, and no row was near enough a tie to flip: CLEAN, with the router input's
    change called "harmless for the gradients". The same script raises at 256 tokens. The clean headline says the
    choice held by a margin, what moved it and by how much; a run whose scores did not move says nothing of it."""
    scores = torch.zeros(6, 4)
    scores[:, 0], scores[:, 1] = 1.0, 0.5  # (every row far from a tie: 0.5)
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(0))

    def step(nudge: float, path):
        torch.manual_seed(0)
        router = _SelectionBiasRouter()
        with ac_diff.record(path):
            out = cp.checkpoint(router, x.clone().requires_grad_(), scores, use_reentrant=False)
            router.bias[1] += nudge  # (the balancing update, before the backward)
            out.square().sum().backward()
        return ac_diff.diagnose_paths([path])

    report = step(0.001, tmp_path / "moved.jsonl")
    assert report.verdict == "clean", report.headline
    (region,) = report.regions
    assert region.held_choice.startswith("aten.topk.default at ") and "moved by up to 0.001" in region.held_choice
    assert "buffer `bias` changed" in region.held_choice and "0.5 from a tie" in region.held_choice, region.held_choice
    assert "the scores of a choice moved between the forward and the recompute without flipping it" in \
        report.headline, report.headline
    still = step(0.0, tmp_path / "still.jsonl")
    assert still.verdict == "clean" and still.regions[0].held_choice is None and "choice" not in still.headline


class _TemperedTopK(nn.Module):
    """Scores divided by a temperature buffer, top-4 of 64 kept: a temperature nudged before the backward moves every
    score, and keeps every choice (the margins are far larger than the move)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 64)
        self.register_buffer("temperature", torch.ones(()))

    def forward(self, x):
        values, idx = (self.proj(x) / self.temperature).topk(4, dim=-1)
        return values.sum(-1, keepdim=True) * x + idx.float().mean()


def test_a_decision_whose_values_were_not_kept_is_not_named_a_flip_when_its_fingerprint_held(tmp_path):
    """Past --keep-values the decision's outputs are not kept (25e): the report named "decision aten.topk.default ...
    its output values changed" and `fix` tried saving topk, where every row kept its indices (only the scores moved).
    The indices' fingerprint is exact: where it held, no decision flipped."""
    torch.manual_seed(0)
    block, x = _TemperedTopK(), torch.randn(256, 16, requires_grad=True)
    path = tmp_path / "t.jsonl"
    with ac_diff.record(path, keep_values=64):
        out = cp.checkpoint(block, x, use_reentrant=False)
        truth = (block.proj(x) / block.temperature).topk(4, dim=-1).indices
        block.temperature.mul_(1.0001)  # (a schedule's step, before the backward)
        assert torch.equal((block.proj(x) / block.temperature).topk(4, dim=-1).indices, truth)  # (no flip)
        out.sum().backward()
    report = ac_diff.diagnose_paths([path])
    (region,) = report.regions
    assert region.status == "diverged" and region.cause.tensor == "temperature", region.cause
    assert region.first_discrete_divergence is None, region.first_discrete_divergence
    assert not any("topk" in step and "values changed" in step for step in region.chain), region.chain


class _BiasedTop2(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(16, 8)
        self.register_buffer("bias", torch.zeros(8))

    def forward(self, x):
        idx = (self.gate(x) + self.bias).topk(2, dim=-1).indices
        return x * idx.float().mean(-1, keepdim=True)


def test_without_fingerprints_a_flip_is_not_blamed_on_a_nondeterministic_kernel(tmp_path):
    """--no-fingerprints (25d): a router bias moved before the backward flips topk, and the report said
    "nondeterministic_op: aten.topk.default returned other values from identical inputs", since inputs whose values
    were not measured read as identical. Identical inputs need measured ones; the unknown cause says to record again."""
    torch.manual_seed(0)
    block, path = _BiasedTop2(), tmp_path / "t.jsonl"
    with ac_diff.record(path, fingerprints=False):
        out = cp.checkpoint(block, torch.randn(64, 16, requires_grad=True), use_reentrant=False)
        block.bias.add_(torch.linspace(-0.5, 0.5, 8))  # (the balancing update, before the backward)
        out.sum().backward()
    (region,) = ac_diff.diagnose_paths([path]).regions
    assert region.status == "diverged" and region.first_discrete_divergence is not None
    assert region.cause.kind != "nondeterministic_op", region.cause
    assert "--no-fingerprints" in region.cause.detail, region.cause


class _DocMasked(nn.Module):
    """Sequence packing: the block masks attention-like mixing by the document ids of its batch, an attribute the
    loop rebinds for the next micro-batch before the first one's backward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.doc_ids = torch.zeros(6, dtype=torch.long)

    def forward(self, x):
        same = (self.doc_ids[:, None] == self.doc_ids[None, :]).float()
        return torch.tanh(self.fc(same @ x))


def test_the_fix_for_one_rebound_tensor_passes_it_whole(tmp_path):
    """The fix for a single tensor attribute rebound before the backward (25a, 25b) read
    `checkpoint(self.run_chunk, x, *self.doc_ids, ...)`: `*` splits one tensor into its rows."""
    torch.manual_seed(0)
    block, path = _DocMasked(), tmp_path / "t.jsonl"
    with ac_diff.record(path):
        out = cp.checkpoint(block, torch.randn(6, 8, requires_grad=True), use_reentrant=False)
        block.doc_ids = torch.tensor([0, 0, 1, 1, 1, 2])  # (the next micro-batch's, bound before this backward)
        out.sum().backward()
    (region,) = ac_diff.diagnose_paths([path]).regions
    assert region.cause.mechanism == "rebound", region.cause
    fix = next(s for s in region.suggestions if "doc_ids" in s.title)
    assert "checkpoint(self.run_chunk, x, self.doc_ids, use_reentrant=False)" in fix.code and "*" not in fix.code, \
        fix.code


class _ModeSwitchedAttention(nn.Module):
    """Attention whose path depends on the training flag (dropout on the weights in training, the fused kernel in
    evaluation), as Hugging Face's attention does: eval() between forward and backward makes the recompute save
    other tensors, fewer of them."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x):
        q, k, v = self.qkv(x).view(2, 6, 3, 8).unbind(2)
        if self.training:
            weights = torch.nn.functional.dropout((q @ k.transpose(-1, -2) / 8 ** 0.5).softmax(-1), 0.1)
            return weights @ v
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)


def test_positions_the_recompute_alone_saved_are_numbered_apart(tmp_path):
    """BART with eval() between forward and backward (25a): the table listed positions 6-10 twice (the forward's
    tensors and the other ones the recompute saved there) and counted "62 in all" where torch counted 52 and 46.
    Rows of tensors only the recompute saved read r<position>, and the title counts each pass's."""
    from ac_diff.render import positions

    torch.manual_seed(0)
    block, path = _ModeSwitchedAttention(), tmp_path / "t.jsonl"
    with ac_diff.record(path):
        out = cp.checkpoint(block, torch.randn(12, 8, requires_grad=True), use_reentrant=False)
        block.eval()  # (a validation pass between forward and backward that forgets train())
        with pytest.raises(Exception):  # (torch's own check: another number of tensors, or other metadata)
            out.sum().backward()
    (region,) = ac_diff.diagnose_paths([path]).regions
    extra = [p for p in region.positions if positions.recompute_only(p)]
    forward = [p for p in region.positions if not positions.recompute_only(p)]
    assert extra and [p.position for p in forward] == list(range(len(forward))), region.positions
    assert all(positions.label(p) == f"r{p.position}" for p in extra)
    assert positions.title(region).endswith(f"({len(forward)} saved by the forward, {len(extra)} more by the "
                                            "recompute only, shown as r<its position>)"), positions.title(region)


_FUNCTION_IN_A_BRANCH = """
import torch
from torch.utils.checkpoint import checkpoint
LAMBDA = 0.1
class GradReverse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.lam = LAMBDA
        return x.view_as(x)
    @staticmethod
    def backward(ctx, g):
        return -ctx.lam * g
class Block(torch.nn.Module):
    def __init__(self, reverse):
        super().__init__()
        self.fc, self.reverse = torch.nn.Linear(8, 8), reverse
    def forward(self, x):
        x = torch.tanh(self.fc(x))
        if self.reverse:  # (only the last block takes it)
            x = GradReverse.apply(x)
        return x
torch.manual_seed(0)
blocks = torch.nn.ModuleList([Block(False), Block(True)])
for step in range(2):
    h = torch.randn(4, 8, requires_grad=True)
    for b in blocks:
        h = checkpoint(b, h, use_reentrant=True)
    LAMBDA = 0.1 * (step + 2)  # the schedule, before the backward
    h.sum().backward()
"""


def test_a_function_in_a_branch_the_region_never_takes_is_not_its_cause(tmp_path):
    """DANN (25h): a gradient-reversal Function reads an annealed global; every block's code names it, only the last
    block runs it. The first blocks read "SILENTLY DIVERGED: ... read by a custom autograd.Function" over bit-identical
    gradients (with the Function applied outside every region, the whole run did). The Function must have run in the
    region: an op recorded at one of its forward's lines."""
    script, json_path = tmp_path / "dann.py", tmp_path / "r.json"
    script.write_text(_FUNCTION_IN_A_BRANCH)
    proc = run_cli("run", "-o", str(tmp_path / "out"), "--json", str(json_path), str(script))
    assert proc.returncode == 0, proc.stderr[-2000:]
    regions = json.loads(json_path.read_text())["regions"]
    status = {(r["module"], r["status"]) for r in regions}
    assert status == {("blocks.0", "clean"), ("blocks.1", "diverged")}, status
    cause = next(r["cause"] for r in regions if r["status"] == "diverged")
    assert "dann.py:6-9 in GradReverse.forward)" in cause["detail"], cause["detail"]


class _DelayedScaling(nn.Module):
    """fp8-style delayed scaling: the forward rolls its amax history and writes it back (its own update, read by no
    saved tensor), then scales its input by `scale`, a buffer the loop updates from that history."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("amax_hist", torch.zeros(4))
        self.register_buffer("scale", torch.tensor(1.0))

    def forward(self, x):
        with torch.no_grad():
            self.amax_hist.copy_(torch.roll(self.amax_hist, 1))
            self.amax_hist[0] = x.detach().abs().max()
        return self.fc(torch.tanh(x * self.scale))


def test_the_first_divergence_is_the_one_the_backward_reads_not_a_state_the_region_writes_back(tmp_path):
    """30c P2-c: the scale updated between the forward and the backward made the recompute differ at `x * scale`; the
    history the forward rolled and wrote back differs too, earlier, and reaches no saved tensor. The first divergence
    and the chain named `roll`, sending the user to the amax code."""
    torch.manual_seed(0)
    block, path = _DelayedScaling(), tmp_path / "t.jsonl"
    with ac_diff.record(path):
        x = torch.randn(4, 8, requires_grad=True)
        y = cp.checkpoint(block, x, use_reentrant=False)
        with torch.no_grad():
            block.scale.fill_(448 / block.amax_hist.max())
        y.sum().backward()
    report = ac_diff.diagnose_paths([path])
    (region,) = report.regions
    assert region.status == "diverged" and region.cause.tensor == "scale", region.cause
    first = region.first_value_divergence
    assert first.op == "aten.mul.Tensor" and "x * self.scale" not in (first.source or "x"), first
    assert first.source and first.source.endswith("in forward"), first
    line = int(first.source.split(":")[1].split()[0])
    assert "x * self.scale" in Path(__file__).read_text().splitlines()[line - 1]


class _NoisyPolicy(nn.Module):
    """Exploration noise added to the logits inside the region, from a generator the module keeps: a private
    torch.Generator, or numpy's RandomState. The noise reaches no saved tensor (an add saves nothing)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.trunk, self.pi = nn.Linear(6, 16), nn.Linear(16, 4)
        self.kind = kind
        self.gen = torch.Generator().manual_seed(1)
        self.rs = np.random.RandomState(1)

    def heads(self, x):
        shape = (x.shape[0], 4)  # (drawn before the last saved tensor: the recompute, which stops there, draws too)
        if self.kind == "torch":
            noise = torch.randn(shape, generator=self.gen)
        else:
            noise = torch.from_numpy(self.rs.randn(*shape).astype(np.float32))
        return self.pi(torch.tanh(self.trunk(x))) + 0.5 * noise


def _noisy_steps(kind: str, ac: bool) -> list:
    torch.manual_seed(0)
    policy, grads = _NoisyPolicy(kind), []
    x = torch.randn(8, 6)
    for _ in range(2):
        logits = cp.checkpoint(policy.heads, x, use_reentrant=False) if ac else policy.heads(x)
        torch.log_softmax(logits, -1)[:, 0].sum().backward()
        grads.append([p.grad.clone() for p in policy.parameters()])
        policy.zero_grad()
    return grads


@pytest.mark.parametrize("kind", ["torch", "numpy"])
def test_a_region_drawing_again_from_a_generator_checkpoint_does_not_restore_is_never_clean(tmp_path, kind):
    """31f: the recompute draws again from a private torch.Generator (or a RandomState the module keeps): its noise
    reached no saved tensor, so the first step's gradients match, but the generator advanced twice and the next
    step's noise, and gradients, differ from a run without AC. It read CLEAN."""
    with_ac, without = _noisy_steps(kind, True), _noisy_steps(kind, False)
    assert all(torch.equal(a, b) for a, b in zip(with_ac[0], without[0]))  # (the truth: step 1 alike, step 2 not)
    assert not all(torch.equal(a, b) for a, b in zip(with_ac[1], without[1]))
    path = tmp_path / "t.jsonl"
    with ac_diff.record(path):
        _noisy_steps(kind, True)
    report = ac_diff.diagnose_paths([path])
    assert report.verdict == "unchecked" and report.title == "GRADIENTS AT RISK", report.headline
    first = report.regions[0]
    assert first.unchecked_reason == "state read again" or first.status == "unchecked", first.unchecked_reason
    assert first.cause.kind == "rng", first.cause
    if kind == "torch":
        assert first.cause.mechanism == "private_generator" and "torch.Generator" in first.cause.detail
    else:
        assert first.cause.mechanism == "host_rng" and "_NoisyPolicy.rs" in first.cause.detail
    line = int(first.cause.source.split(":")[1].split()[0])
    assert ("randn" in Path(__file__).read_text().splitlines()[line - 1]), first.cause.source


class _Halting(nn.Module):
    """Adaptive computation time: a halting score decides when the loop stops (`.item()` of a count); `ponder`
    adds the scores to the output (a ponder cost the loss reads), else nothing differentiable reads them."""

    def __init__(self, ponder: bool) -> None:
        super().__init__()
        self.cell, self.halt = nn.Linear(16, 16), nn.Linear(16, 1)
        self.register_buffer("halt_bias", torch.tensor(0.0))
        self.ponder = ponder

    def forward(self, x):
        cum, h = torch.zeros(x.shape[0]), x
        for _ in range(6):
            h = torch.tanh(self.cell(h)) + x
            cum = cum + torch.sigmoid(self.halt(h).squeeze(-1) + self.halt_bias)
            if bool((cum > 1.5).float().mean() > 0.5):
                break
        return h + cum[:, None] if self.ponder else h


def _flat(grads: list) -> list:
    """A step function's gradients, one list (those of several steps listed step by step)."""
    return [t for g in grads for t in (g if isinstance(g, list) else [g])]


def _same_without_ac(steps, *args) -> bool:
    """Whether `steps(*args, ac)` gives bit-identical gradients with AC and without (the truth a verdict meets)."""
    with_ac, without = _flat(steps(*args, True)), _flat(steps(*args, False))
    return len(with_ac) == len(without) and all(torch.equal(a, b) for a, b in zip(with_ac, without))


def _diagnosed_with_ac(tmp_path: Path, steps, *args):
    """`steps(*args, True)` recorded, and its report."""
    path = tmp_path / "t.jsonl"
    with ac_diff.record(path):
        steps(*args, True)
    return ac_diff.diagnose_paths([path])


def _halting_steps(ponder: bool, ac: bool) -> list:
    torch.manual_seed(0)
    block, grads = _Halting(ponder), []
    for _ in range(2):
        x = torch.randn(8, 16, requires_grad=True)
        out = cp.checkpoint(block, x, use_reentrant=False) if ac else block(x)
        with torch.no_grad():
            block.halt_bias += 0.01  # (a ponder schedule stepped before the backward: the loop count holds)
        out.pow(2).mean().backward()
        grads.append([x.grad.clone(), *(p.grad.clone() for p in block.cell.parameters())])
        block.zero_grad()
    return grads


@pytest.mark.parametrize("ponder", [False, True])
def test_saved_values_no_backward_reads_leave_the_gradients_as_they_were(tmp_path, ponder):
    """31d: the halting branch's sigmoid saves its output, which the moved bias changes in the recompute; the branch
    only decides when the loop stops (`.item()`), so its gradient formula never runs and no backward reads that saved
    tensor: the gradients are bit-identical, and it read SILENTLY DIVERGED. Where a ponder cost adds the scores to
    the output, the backward reads them: diverged."""
    same = _same_without_ac(_halting_steps, ponder)
    assert same is not ponder  # (the truth)
    report = _diagnosed_with_ac(tmp_path, _halting_steps, ponder)
    assert report.verdict == ("diverged" if ponder else "clean"), report.headline
    if not ponder:
        assert "no gradient a backward computed read" in report.headline, report.headline
        assert "aten.sigmoid.default" in report.headline, report.headline


class _Shifted(nn.Module):
    """A conv and a linear after a buffer the loop moves between the forward and the backward: added (only the
    weights' gradients read the inputs the two save) or multiplied (the input's gradient reads the saved scale)."""

    def __init__(self, scaled: bool):
        super().__init__()
        self.conv, self.fc, self.scaled = nn.Conv2d(2, 3, 3), nn.Linear(3 * 4 * 4, 5), scaled
        self.register_buffer("shift", torch.ones(2, 1, 1))

    def forward(self, x):
        h = self.conv(x * self.shift if self.scaled else x + self.shift)
        return self.fc(h.flatten(1))


def _input_gradients(asked: str, ac: bool) -> list:
    torch.manual_seed(0)
    block, grads = _Shifted(asked == "scaled input"), []
    for _ in range(2):
        x = torch.randn(4, 2, 6, 6, requires_grad=True)
        loss = (cp.checkpoint(block, x, use_reentrant=False) if ac else block(x)).square().mean()
        block.shift = block.shift + 0.25  # (a schedule stepped before the backward; in place, autograd would object)
        if asked == "everything":
            loss.backward()
            grads.append([p.grad.clone() for p in block.parameters()])
            block.zero_grad()
        else:  # (a saliency map, an adversarial example: the input's gradient alone)
            grads.append(list(torch.autograd.grad(loss, x)))
    return grads


@pytest.mark.parametrize("asked", ["input", "scaled input", "everything"])
def test_saved_tensors_only_unasked_gradients_read_leave_the_gradients_as_they_were(tmp_path, asked):
    """33a P1-1: `torch.autograd.grad(loss, x)` runs the conv's and the linear's nodes for x's gradient alone, which
    reads their weights; torch unpacks their saved inputs too, which the moved buffer changed and only the weights'
    gradients read: the input gradients are bit-identical, and it read SILENTLY DIVERGED. Where the buffer scales
    the input (the scale, saved, is read by x's gradient), or every gradient is computed, it diverged."""
    same = _same_without_ac(_input_gradients, asked)
    assert same is (asked == "input")  # (the truth)
    report = _diagnosed_with_ac(tmp_path, _input_gradients, asked)
    assert report.verdict == ("clean" if same else "diverged"), report.headline
    if same:
        assert "which no gradient a backward computed read" in report.headline, report.headline
        notes = " ".join(report.regions[0].notes)
        assert "only gradients no backward computed read them" in notes, notes


def _masked_steps(draw: str, ac: bool) -> list:
    """A DropPath-style mask, `x + h * (rand < 0.5) / 0.5`, in a reentrant region: drawn from the default generator
    with preserve_rng_state=False, or from a private generator (which no checkpoint restores)."""
    torch.manual_seed(0)
    lin, private = nn.Linear(16, 16), torch.Generator().manual_seed(1)

    def block(x):
        h = lin(x)
        m = torch.rand(x.shape[0], 1, generator=private if draw == "private" else None)
        return x + h * (m < 0.5).to(h.dtype) / 0.5

    x = torch.randn(8, 16, requires_grad=True)
    y = cp.checkpoint(block, x, use_reentrant=True, preserve_rng_state=False) if ac else block(x)
    y.square().sum().backward()
    return [lin.weight.grad, x.grad]


@pytest.mark.parametrize("draw", ["default", "private"])
def test_a_mask_drawn_again_in_a_reentrant_recompute_diverges(tmp_path, draw):
    """35a P1: the mask is a comparison of the draw (no gradient flows through it) cast back to float, and the mul's
    gradient reads it: the recompute's other mask makes other gradients. It read CLEAN ("the recompute computed other
    values, which no gradient reads"), with the private generator GRADIENTS AT RISK: the mul's output, derived from its
    inputs and never measured, did not count as differing."""
    assert not _same_without_ac(_masked_steps, draw)
    report = _diagnosed_with_ac(tmp_path, _masked_steps, draw)
    assert report.verdict == "diverged", report.headline
    assert report.regions[0].cause.kind == "rng", report.regions[0].cause


def _lstm_gradients(ac: bool) -> list:
    torch.manual_seed(0)
    lstm = nn.LSTM(24, 24, batch_first=True)
    x = torch.randn(4, 16, 24, requires_grad=True)
    y = cp.checkpoint(lambda t: lstm(t)[0], x, use_reentrant=True) if ac else lstm(x)[0]
    y.square().sum().backward()
    return [p.grad for p in lstm.parameters()]


def test_a_kernel_that_takes_its_training_path_in_the_reentrant_recompute_is_named(tmp_path):
    """35a P2-3: a CPU LSTM runs oneDNN's inference kernel without autograd (the reentrant forward) and its training
    kernel, which keeps a workspace, with it (the recompute): other values, from identical inputs. The cause read
    "unknown: no recorded evidence explains the divergence", with no fix; it is grad mode, fixed by use_reentrant=False.
    (A build whose LSTM computes alike in both modes: clean.)"""
    same = _same_without_ac(_lstm_gradients)
    report = _diagnosed_with_ac(tmp_path, _lstm_gradients)
    if same:
        assert report.verdict == "clean", report.headline
        return
    lead = report.lead_groups()[0][0]
    assert lead.cause.mechanism == "grad_mode" and "returned other outputs from identical inputs" in \
        lead.cause.detail, lead.cause
    assert lead.suggestions[0].title.startswith("Checkpoint with use_reentrant=False"), lead.suggestions[0].title


def _thresholded(thr: float, masked: str, ac: bool) -> list:
    """A reentrant block `h * (h > thr)` or `where(h > thr, h, 0.1 * h)` whose threshold the loop moves before the
    backward: by 1e-7 no element crosses it (the same mask), by 0.3 some do."""
    torch.manual_seed(0)
    fc1, fc2 = nn.Linear(16, 16), nn.Linear(16, 16)
    state = {"thr": 0.0}

    def block(x):
        h = fc1(x)
        h = torch.where(h > state["thr"], h, 0.1 * h) if masked == "where" else h * (h > state["thr"]).float()
        return fc2(h)

    x = torch.randn(8, 16, requires_grad=True)
    y = cp.checkpoint(block, x, use_reentrant=True) if ac else block(x)
    state["thr"] = thr
    y.square().mean().backward()
    return [p.grad for p in (*fc1.parameters(), *fc2.parameters())]


@pytest.mark.parametrize("masked", ["where", "mul"])
@pytest.mark.parametrize("thr", [1e-7, 0.3])
def test_a_threshold_that_moved_without_changing_the_mask_is_no_divergence(tmp_path, thr, masked):
    """36a P1-B: in a reentrant region the comparison's threshold moved 0 -> 1e-7 and no element crossed it: the same
    mask, identical gradients, and it read SILENTLY DIVERGED (`argument aten.gt.Scalar 0.0→1e-07`): a comparison
    passes no gradient, and its mask, measured equal, was counted as differing for its argument. By 0.3 the mask
    changes: diverged."""
    same = _same_without_ac(_thresholded, thr, masked)
    assert same is (thr < 1e-3)
    report = _diagnosed_with_ac(tmp_path, _thresholded, thr, masked)
    assert report.verdict == ("clean" if same else "diverged"), report.headline
