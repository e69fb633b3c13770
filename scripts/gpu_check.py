#!/usr/bin/env python3
"""One prepared end-to-end check of ac-diff on a GPU (issue 29, item 7): every check records a small seeded
bf16 model on CUDA with `ac_diff.record(...)`, diagnoses the trace programmatically (`ac_diff.diagnose`,
the Report's fields, never the terminal text) and compares what ac-diff said with what it should say.

    python3 scripts/gpu_check.py --out DIR                 # on the GPU machine, from the repo root (< 5 min)
    python3 scripts/gpu_check.py --out DIR --device cpu    # the same on CPU in float32 (a dry run, < 2 min)
    python3 scripts/gpu_check.py --out DIR --only sdpa     # only the checks whose name contains "sdpa"

Checks (names as in the table):
  1. sdpa[BACKEND]            flash / efficient / cudnn / math under sdpa_kernel, non-reentrant checkpoint,
                              dropout 0: clean, no recorder warning, every region compared
  2. sac / checkpoint_wrapper / hf_llama   selective AC saving mm, checkpoint_wrapper, a tiny HF Llama with
                              gradient_checkpointing_enable(use_reentrant=False): clean
  3. sdpa_dropout[B,rng=..]   flash / efficient with dropout 0.1: preserve_rng_state=False -> diverged, lead
                              cause rng naming the attention op; preserve_rng_state=True -> clean
  4. example[NAME]            the bundled examples on DEVICE/DTYPE: verdict, lead cause, lead module equal the
                              CPU float32 diagnosis (computed here too)
  5. grads_identical[flash]   every .grad bit-identical with and without the recorder, 3 steps
  6. host_syncs               ac_diff.capture.fingerprint.to_host calls per step, and CUDA syncs per step
                              (torch.cuda.set_sync_debug_mode("warn")) plain vs recorded: reported, no threshold
  7. float8_cast              x.to(float8_e4m3fn).to(bf16) in a region: the f8 _to_copy ops are in the trace
                              with fingerprints, and the run is clean
  timing                      median plain step vs median recorded step (torch.cuda.synchronize around each)

Never crashes as a whole: each check runs in try/except (and under a time limit); a failing check is a row
with its error's one-line text. Writes DIR/table.md (the table printed at the end), DIR/results.json (the
details of every check), DIR/reports/NAME.json (each check's full ac-diff report) and DIR/traces/NAME.jsonl.gz.
The repository root is put on sys.path here: ac-diff need not be installed.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import platform
import re
import signal
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
if str(REPO / "examples") not in sys.path:
    sys.path.insert(1, str(REPO / "examples"))  # the examples import their shared model as `tiny_moe`

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torch.utils.checkpoint as cp  # noqa: E402

ac_diff: Any = None  # imported in main(): an ac-diff that fails to import is a row of the table, not a crash

PASS, FAIL, SKIP, INFO = "PASS", "FAIL", "SKIP", "INFO"
ATTENTION_OP_WORDS = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention")


class Skipped(Exception):
    """The check does not apply here (a backend this GPU / torch lacks, CUDA only on a CPU run)."""


class CheckTimeout(Exception):
    pass


@dataclass
class Row:
    check: str
    expected: str
    said: str = ""
    result: str = FAIL
    seconds: float = 0.0
    error: str | None = None
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class Env:
    device: torch.device
    dtype: torch.dtype
    out: Path
    cuda: bool

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------------------------
# models


class Block(nn.Module):
    """A pre-norm transformer block calling F.scaled_dot_product_attention; optionally a float8 round trip."""

    def __init__(self, dim: int, heads: int, dropout_p: float = 0.0, f8: bool = False) -> None:
        super().__init__()
        self.heads, self.dropout_p, self.f8 = heads, dropout_p, f8
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout_p if self.training else 0.0,
                                           is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        h = F.gelu(self.fc1(self.norm2(x)))
        if self.f8:
            h = h.to(torch.float8_e4m3fn).to(x.dtype)  # a float8 quantize / dequantize round trip
        return x + self.fc2(h)


class Net(nn.Module):
    """`layers.{i}` blocks, each through `wrap(block, x)` (how it is checkpointed)."""

    def __init__(self, wrap: Callable | None, n: int, dim: int, heads: int, **block_kw: Any) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(dim, heads, **block_kw) for _ in range(n))
        self.wrap = wrap

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers:
            x = self.wrap(block, x) if self.wrap is not None else block(x)
        return x


def nonreentrant(preserve_rng_state: bool = True) -> Callable:
    return lambda block, x: cp.checkpoint(block, x, use_reentrant=False, preserve_rng_state=preserve_rng_state)


MM_OPS = None


def _save_mm(ctx, op, *args, **kwargs):
    global MM_OPS
    if MM_OPS is None:
        MM_OPS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}
    return cp.CheckpointPolicy.MUST_SAVE if op in MM_OPS else cp.CheckpointPolicy.PREFER_RECOMPUTE


def selective() -> Callable:
    context_fn = functools.partial(cp.create_selective_checkpoint_contexts, _save_mm)
    return lambda block, x: cp.checkpoint(block, x, use_reentrant=False, context_fn=context_fn)


SIZES = {"dim": 128, "heads": 4, "n": 2, "batch": 2, "seq": 128}  # head_dim 32: every fused kernel takes it


def build(env: Env, wrap: Callable | None, seed: int = 0, sizes: dict | None = None, **block_kw: Any) -> Net:
    s = sizes or SIZES
    torch.manual_seed(seed)
    return Net(wrap, s["n"], s["dim"], s["heads"], **block_kw).to(env.device, env.dtype).train()


def batches(env: Env, steps: int, seed: int = 0, sizes: dict | None = None) -> list[torch.Tensor]:
    s = sizes or SIZES
    g = torch.Generator().manual_seed(1000 + seed)
    return [torch.randn(s["batch"], s["seq"], s["dim"], generator=g).to(env.device, env.dtype) for _ in range(steps)]


def train(model: nn.Module, xs: list[torch.Tensor], ctx: Callable = contextlib.nullcontext, seed: int = 0,
          on_step: Callable | None = None, grads: list | None = None) -> None:
    """Forward + backward + SGD per batch, forward and backward (the recompute) both inside ctx()."""
    torch.manual_seed(seed)  # the same dropout draws in every run
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    for step, x in enumerate(xs):
        with ctx():
            loss = model(x).float().pow(2).mean()
            loss.backward()
        if grads is not None:
            grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad(set_to_none=True)
        if on_step is not None:
            on_step(step)


# ---------------------------------------------------------------------------------------------------------------
# recording and reading the diagnosis


@dataclass
class Diagnosis:
    report: Any
    runs: list
    recorder_errors: list[str]
    exception: str | None  # what the recorded block raised (a CheckpointError), one line
    path: Path

    @property
    def verdict(self) -> str:
        return self.report.verdict

    @property
    def warnings(self) -> list[str]:
        """Every warning record of the trace (recorder errors included) and what the reader could not use."""
        notes = [n for run in self.runs for n in run.notes]
        return notes + [e for e in self.recorder_errors if not any(e in n for n in notes)]

    def statuses(self) -> dict[str, int]:
        by: dict[str, int] = {}
        for r in self.report.regions:
            by[r.status] = by.get(r.status, 0) + 1
        return by

    def lead(self):
        """The lead diverged region (RegionReport) as reports detail it first, or None."""
        groups = self.report.lead_groups()
        return groups[0][0] if groups else None

    def lead_summary(self) -> dict[str, Any]:
        lead = self.lead()
        if lead is None:
            err = self.report.torch_error
            return {"module": None, "cause": err.cause if err else None, "torch_error": err.kind if err else None}
        first = lead.first_divergence()
        c = lead.cause
        return {
            "rank": lead.rank, "region": lead.region, "module": lead.module, "status": lead.status_label,
            "cause": c.kind if c else None, "cause_tensor": c.tensor if c else None,
            "cause_mechanism": c.mechanism if c else None, "cause_detail": c.detail if c else None,
            "first_op": first.op if first else None, "first_op_module": first.module if first else None,
            "first_kind": first.kind if first else None,
        }

    def summary(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "title": self.report.title, "headline": self.report.headline,
                "regions": self.statuses(), "warnings": self.warnings, "exception": self.exception,
                "lead": self.lead_summary(), "trace": str(self.path)}

    def short(self) -> str:
        """What ac-diff said, in one cell."""
        n = len(self.report.regions)
        parts = [self.verdict]
        lead = self.lead_summary()
        if lead.get("cause") or lead.get("module"):
            parts.append(f"{lead.get('cause')} @ {lead.get('module')}"
                         + (f" [{lead['cause_tensor']}]" if lead.get("cause_tensor") else ""))
        by = self.statuses()
        parts.append(f"{by.get('clean', 0)}/{n} regions clean" if by.get("clean", 0) == n else
                     f"{n} regions: " + ", ".join(f"{v} {k}" for k, v in sorted(by.items())))
        if self.warnings:
            parts.append(f"{len(self.warnings)} warning(s): {one_line(self.warnings[0], 120)}")
        return "; ".join(parts)

    def all_compared_clean(self, regions: int | None = None) -> list[str]:
        """Why this is not a clean, fully compared, warning-free run of `regions` regions ([] when it is)."""
        problems = []
        if regions is not None and len(self.report.regions) != regions:
            problems.append(f"{len(self.report.regions)} regions recorded, expected {regions}")
        if self.verdict != "clean":
            problems.append(f"verdict {self.verdict}: {one_line(self.report.headline, 200)}")
        if not self.report.regions:
            problems.append("no region recorded")
        not_clean = {k: v for k, v in self.statuses().items() if k != "clean"}
        if not_clean:
            problems.append(f"regions not clean: {not_clean}")
        if self.warnings:
            problems.append(f"trace warnings: {[one_line(w, 200) for w in self.warnings]}")
        if self.exception:
            problems.append(f"the recorded block raised {self.exception}")
        return problems


def trace_path(env: Env, name: str, gz: bool = True) -> Path:
    """DIR/traces/NAME.jsonl.gz (gzip keeps what comes back small), or .jsonl (the timing: no compression cost)."""
    path = env.out / "traces" / f"{safe(name)}.jsonl{'.gz' if gz else ''}"
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        path.unlink()
    return path


def record(env: Env, name: str, fn: Callable[[], Any], expect_raise: tuple = (), gz: bool = True,
           **options: Any) -> Diagnosis:
    """Run fn() under ac_diff.record (the exception it raises, if of `expect_raise`, leaves the block like an
    uncaught one leaves a script under `ac-diff run`), then read the trace and diagnose it."""
    path = trace_path(env, name, gz)
    raised = None
    rec = None
    try:
        with ac_diff.record(path, **options) as rec:
            fn()
    except expect_raise as exc:  # noqa: B030 - a tuple of exception types (empty: catches nothing)
        raised = one_line(f"{type(exc).__name__}: {exc}")
    env.sync()
    runs = ac_diff.read_runs([path])
    report = ac_diff.diagnose(runs)
    diag = Diagnosis(report, runs, list(rec.errors) if rec is not None else [], raised, path)
    reports = env.out / "reports"
    reports.mkdir(parents=True, exist_ok=True)
    (reports / f"{safe(name)}.json").write_text(json.dumps(report.to_json(), indent=1, default=str))
    return diag


# ---------------------------------------------------------------------------------------------------------------
# SDPA backends


def backends() -> dict[str, Any]:
    from torch.nn.attention import SDPBackend

    names = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION",
             "math": "MATH"}
    return {k: getattr(SDPBackend, v, None) for k, v in names.items()}


def sdpa_ctx(backend_name: str) -> Callable:
    from torch.nn.attention import sdpa_kernel

    backend = backends()[backend_name]
    return lambda: sdpa_kernel(backend)


def probe_backend(env: Env, name: str, dropout_p: float = 0.0) -> None:
    """Raise Skipped when the backend cannot run this model's attention (forward and backward) here."""
    if not env.cuda and name in ("efficient", "cudnn"):
        raise Skipped("skipped (CUDA only)")
    if backends().get(name) is None:
        raise Skipped(f"skipped (not available): this torch has no SDPBackend for {name}")
    s = SIZES
    shape = (s["batch"], s["heads"], s["seq"], s["dim"] // s["heads"])
    q = torch.randn(shape, device=env.device, dtype=env.dtype, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with sdpa_ctx(name)():
                F.scaled_dot_product_attention(q, q, q, dropout_p=dropout_p, is_causal=True).sum().backward()
            env.sync()
        except RuntimeError as exc:
            why = [one_line(str(w.message), 160) for w in caught if "kernel not used" in str(w.message)
                   or "not support" in str(w.message) or "requires" in str(w.message)]
            why = [w for w in why if not w.endswith(":")]  # "Flash attention kernel not used because:" alone
            raise Skipped(f"skipped (not available): {one_line(str(exc), 120)}"
                          + (f" ({'; '.join(why[:3])})" if why else "")) from None


def check_sdpa_clean(env: Env, backend: str) -> tuple[str, str, dict]:
    probe_backend(env, backend)
    xs = batches(env, 2)
    model = build(env, nonreentrant())
    diag = record(env, f"sdpa-{backend}", lambda: train(model, xs, sdpa_ctx(backend)))
    problems = diag.all_compared_clean(regions=4)
    return diag.short(), FAIL if problems else PASS, {"diagnosis": diag.summary(), "problems": problems}


def check_sdpa_dropout(env: Env, backend: str, preserve: bool) -> tuple[str, str, dict]:
    probe_backend(env, backend, dropout_p=0.1)
    xs = batches(env, 2)
    model = build(env, nonreentrant(preserve_rng_state=preserve), dropout_p=0.1)
    diag = record(env, f"sdpa-dropout-{backend}-rng{preserve}", lambda: train(model, xs, sdpa_ctx(backend)))
    details = {"diagnosis": diag.summary()}
    if preserve:
        problems = diag.all_compared_clean(regions=4)
    else:
        lead = diag.lead_summary()
        problems = []
        if diag.verdict != "diverged":
            problems.append(f"verdict {diag.verdict}, expected diverged")
        if lead.get("cause") != "rng":
            problems.append(f"lead cause {lead.get('cause')!r}, expected 'rng'")
        named = [k for k in ("cause_tensor", "cause_detail") if any(
            w in str(lead.get(k) or "").lower() for w in ATTENTION_OP_WORDS)]
        details["attention_op_named_in"] = named
        fused = env.cuda or backend != "math"  # the CPU math path draws in a dropout op, not in a fused attention op
        if fused and not named:
            problems.append(f"the rng cause does not name the attention op (cause.tensor={lead.get('cause_tensor')!r})")
        if [w for w in diag.warnings if "recorder error" in w]:
            problems.append(f"recorder errors: {diag.warnings}")
    details["problems"] = problems
    return diag.short(), FAIL if problems else PASS, details


# ---------------------------------------------------------------------------------------------------------------
# check 2: other AC forms


def check_sac(env: Env) -> tuple[str, str, dict]:
    if not hasattr(cp, "create_selective_checkpoint_contexts"):
        raise Skipped("skipped (not available): torch has no create_selective_checkpoint_contexts")
    xs = batches(env, 2)
    model = build(env, selective())
    diag = record(env, "sac", lambda: train(model, xs))
    problems = diag.all_compared_clean(regions=4)
    cached = sum(bool(getattr(o, "cached", False)) for run in diag.runs for r in run.regions
                 for p in (r.recompute,) if p is not None for o in p.ops)
    return diag.short() + f"; {cached} cached op(s) in recompute", FAIL if problems else PASS, {
        "diagnosis": diag.summary(), "problems": problems, "cached_ops_in_recompute": cached}


def check_checkpoint_wrapper(env: Env) -> tuple[str, str, dict]:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    xs = batches(env, 2)
    model = build(env, None)
    for i, block in enumerate(model.layers):
        model.layers[i] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    diag = record(env, "checkpoint_wrapper", lambda: train(model, xs))
    problems = diag.all_compared_clean(regions=4)
    modules = sorted({r.module for r in diag.report.regions if r.module})
    if any("_checkpoint_wrapped_module" in m for m in modules):
        problems.append(f"module names keep the wrapper: {modules}")
    return diag.short() + f"; modules {modules}", FAIL if problems else PASS, {
        "diagnosis": diag.summary(), "problems": problems, "modules": modules}


def check_hf_llama(env: Env) -> tuple[str, str, dict]:
    try:
        import transformers
        from transformers import LlamaConfig, LlamaForCausalLM
    except Exception as exc:  # noqa: BLE001
        raise Skipped(f"skipped (not available): transformers: {one_line(str(exc), 120)}") from None
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         attention_dropout=0.0, tie_word_embeddings=False, use_cache=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    try:
        model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa")
    except TypeError:
        model = LlamaForCausalLM(config)
    model = model.to(env.device, env.dtype).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    g = torch.Generator().manual_seed(7)
    ids = [torch.randint(0, 128, (2, 64), generator=g).to(env.device) for _ in range(2)]
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)

    def steps() -> None:
        for x in ids:
            out = model(input_ids=x, labels=x, use_cache=False)
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # HF's own notices (use_cache with gradient checkpointing)
        diag = record(env, "hf_llama", steps)
    problems = diag.all_compared_clean(regions=2 * len(ids))  # 2 layers x 2 steps
    modules = sorted({r.module for r in diag.report.regions if r.module})
    return diag.short() + f"; modules {modules}", FAIL if problems else PASS, {
        "diagnosis": diag.summary(), "problems": problems, "modules": modules,
        "transformers": transformers.__version__,
        "attn_implementation": getattr(model.config, "_attn_implementation", None)}


# ---------------------------------------------------------------------------------------------------------------
# check 4: the bundled examples, DEVICE/DTYPE vs CPU float32


def _example(env: Env, name: str, suffix: str = "", **options: Any) -> Diagnosis:
    import tiny_moe

    dev, dtype = env.device, env.dtype
    args = tiny_moe.ModelArgs(dropout=0.1 if name == "dropout_no_rng" else 0.0)
    steps, seq, bias_update, aux = 3, 128, "after_step", None
    model = tiny_moe.build_model(args, seed=0, ac_mode="checkpoint_wrapper",
                                 preserve_rng_state=name != "dropout_no_rng")
    if name == "moe_bias_update":
        bias_update = "forward_hook"
    elif name == "python_state_branch":
        import python_state_branch

        steps = 4
        python_state_branch.use_z_loss_routers(model, warmup=5)
        aux = python_state_branch.z_loss
    model = model.to(dev, dtype).train()
    if bias_update == "forward_hook":
        for moe in model.moe_layers():
            moe.register_forward_hook(lambda mod, inputs, output: tiny_moe.update_expert_bias(mod))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    def loop() -> None:  # tiny_moe.train, on dev
        for step in range(steps):
            inputs, labels = tiny_moe.make_batch(args, step, seed=0, batch_size=2, seq_len=seq)
            inputs, labels = inputs.to(dev), labels.to(dev)
            loss = tiny_moe.loss_fn(model(inputs), labels)
            if aux is not None:
                loss = loss + aux(model).to(loss.device)
            loss.backward()
            opt.step()
            opt.zero_grad()
            if bias_update == "after_step":
                for moe in model.moe_layers():
                    tiny_moe.update_expert_bias(moe)

    torch.manual_seed(0)
    tag = f"{dev.type}-{str(dtype).replace('torch.', '')}"
    return record(env, f"example-{name}-{tag}{suffix}", loop, expect_raise=(cp.CheckpointError,), **options)


CPU_REFERENCE: dict[str, Diagnosis] = {}


def check_example(env: Env, name: str) -> tuple[str, str, dict]:
    cpu_env = Env(torch.device("cpu"), torch.float32, env.out, False)
    if name not in CPU_REFERENCE:
        CPU_REFERENCE[name] = _example(cpu_env, name)
    ref = CPU_REFERENCE[name]
    if not env.cuda:  # a CPU run: the comparison is CPU f32 with itself; still run the example twice
        here = _example(cpu_env, name, "-again")
    else:
        here = _example(env, name)

    def key(d: Diagnosis) -> dict:
        lead = d.lead_summary()
        return {"verdict": d.verdict, "cause": lead.get("cause"), "module": lead.get("module")}

    a, b = key(ref), key(here)
    problems = [f"{k}: {b[k]!r} here vs {a[k]!r} on CPU float32" for k in a if a[k] != b[k]]
    if a["verdict"] == "clean":
        problems.append("the CPU float32 reference itself is clean: the example did not diverge")
    said = f"{b['verdict']} {b['cause']} @ {b['module']} (CPU f32: {a['verdict']} {a['cause']} @ {a['module']})"
    return said, FAIL if problems else PASS, {"here": here.summary(), "cpu_float32": ref.summary(),
                                               "problems": problems}


# ---------------------------------------------------------------------------------------------------------------
# check 5: gradients bit-identical with and without the recorder


def _grad_runs(env: Env, backend: str, steps: int, recorded: bool, name: str) -> tuple[list, Diagnosis | None]:
    xs = batches(env, steps)
    model = build(env, nonreentrant())
    grads: list = []
    fn = lambda: train(model, xs, sdpa_ctx(backend), grads=grads)  # noqa: E731
    if recorded:
        return grads, record(env, name, fn)
    fn()
    env.sync()
    return grads, None


def _first_difference(a: list, b: list) -> str | None:
    for step, (ga, gb) in enumerate(zip(a, b)):
        if ga.keys() != gb.keys():
            return f"step {step}: other parameters have gradients ({sorted(ga.keys() ^ gb.keys())[:4]})"
        for n in ga:
            if not torch.equal(ga[n], gb[n]):
                diff = (ga[n].float() - gb[n].float()).abs().max().item()
                return f"step {step}: {n} differs (max abs diff {diff:.3g})"
    if len(a) != len(b):
        return f"{len(a)} vs {len(b)} steps"
    return None


def check_grads_identical(env: Env, backend: str = "flash") -> tuple[str, str, dict]:
    if not env.cuda:
        try:
            probe_backend(env, backend)
        except Skipped:
            backend = "math"
    else:
        probe_backend(env, backend)
    steps = 3
    details: dict[str, Any] = {"backend": backend, "steps": steps}
    deterministic = False
    plain, _ = _grad_runs(env, backend, steps, False, "")
    control, _ = _grad_runs(env, backend, steps, False, "")
    control_diff = _first_difference(plain, control)
    if control_diff is not None:  # the backend's backward is nondeterministic by itself: compare deterministically
        details["plain_vs_plain"] = control_diff
        deterministic = True
        torch.use_deterministic_algorithms(True, warn_only=True)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # warn_only's notices about ops without a deterministic kernel
                plain, _ = _grad_runs(env, backend, steps, False, "")
                control, _ = _grad_runs(env, backend, steps, False, "")
                details["plain_vs_plain_deterministic"] = _first_difference(plain, control)
                recorded, diag = _grad_runs(env, backend, steps, True, f"grads-{backend}")
        finally:
            torch.use_deterministic_algorithms(False)
    else:
        recorded, diag = _grad_runs(env, backend, steps, True, f"grads-{backend}")
    diff = _first_difference(plain, recorded)
    n = sum(len(g) for g in plain)
    details.update({"recorded_vs_plain": diff, "grads_compared": n, "deterministic_algorithms": deterministic,
                    "diagnosis": diag.summary() if diag else None})
    said = (f"{n} grads over {steps} steps bit-identical" if diff is None else f"differ: {diff}")
    said += f"; verdict {diag.verdict}" if diag else ""
    if deterministic:
        said += " (under use_deterministic_algorithms: plain runs differ by themselves)"
    if deterministic and details.get("plain_vs_plain_deterministic") is not None:
        # two plain runs differ even under use_deterministic_algorithms: nothing to hold the recorder to
        return (f"undecided: plain runs differ by themselves ({details['plain_vs_plain_deterministic']}); "
                + said), INFO, details
    return said, PASS if diff is None else FAIL, details


# ---------------------------------------------------------------------------------------------------------------
# check 6: host syncs per step


def check_host_syncs(env: Env) -> tuple[str, str, dict]:
    from ac_diff.capture import fingerprint

    backend = "flash" if env.cuda else "math"
    steps = 4
    xs = batches(env, steps)
    counts = {"to_host": 0, "syncs": 0}
    real_to_host = fingerprint.to_host

    def counting_to_host(t):
        counts["to_host"] += 1
        return real_to_host(t)

    def per_step(key: str, into: list[int]) -> Callable[[int], None]:
        last = [0]

        def on_step(step: int) -> None:
            into.append(counts[key] - last[0])
            last[0] = counts[key]
        return on_step

    @contextlib.contextmanager
    def counting_syncs():
        """CUDA syncs as warnings of set_sync_debug_mode("warn"), counted into counts["syncs"]."""
        if not env.cuda:
            yield
            return
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield caught
            finally:
                torch.cuda.set_sync_debug_mode(0)

    def run(model: nn.Module, to_host_steps: list[int], sync_steps: list[int]) -> None:
        count_to_host = per_step("to_host", to_host_steps)
        count_syncs = per_step("syncs", sync_steps)
        with counting_syncs() as caught:
            def on_step(step: int) -> None:
                env.sync()  # an explicit synchronize: not a warning of the sync debug mode
                if caught is not None:
                    counts["syncs"] = sum("synchroniz" in str(w.message) for w in caught)
                count_syncs(step)
                count_to_host(step)
            train(model, xs, sdpa_ctx(backend), on_step=on_step)

    plain_syncs: list[int] = []
    run(build(env, nonreentrant()), [], plain_syncs)
    counts.update(to_host=0, syncs=0)
    to_host_steps: list[int] = []
    recorded_syncs: list[int] = []
    model = build(env, nonreentrant())
    fingerprint.to_host = counting_to_host  # FingerprintBatch.collect looks the module's to_host up per call
    try:
        diag = record(env, "host-syncs", lambda: run(model, to_host_steps, recorded_syncs))
    finally:
        fingerprint.to_host = real_to_host
    regions_per_step = len(diag.report.regions) / steps
    if not env.cuda:
        plain_syncs, recorded_syncs = [], []
    details = {"to_host_per_step": to_host_steps, "cuda_syncs_per_step_plain": plain_syncs,
               "cuda_syncs_per_step_recorded": recorded_syncs, "regions_per_step": regions_per_step,
               "to_host_constant_per_step": len(set(to_host_steps)) <= 1, "diagnosis": diag.summary()}
    said = (f"to_host/step {to_host_steps} ({regions_per_step:g} regions/step); CUDA syncs/step plain "
            f"{plain_syncs or 'n/a (CPU)'}, recorded {recorded_syncs or 'n/a (CPU)'}; verdict {diag.verdict}")
    return said, INFO, details


# ---------------------------------------------------------------------------------------------------------------
# check 8: watch mode (no dispatch mode; saved tensors digested on the device, read back without a sync)

WATCH = {"watch": True, "watch_full_steps": 0}  # every step watched: the steady state of a long run


def check_watch_clean(env: Env) -> tuple[str, str, dict]:
    backend = "flash" if env.cuda else "math"
    probe_backend(env, backend)
    xs = batches(env, 3)
    model = build(env, nonreentrant())
    diag = record(env, f"watch-sdpa-{backend}", lambda: train(model, xs, sdpa_ctx(backend)), **WATCH)
    watch = diag.report.watch or {}
    problems = [] if diag.verdict == "clean" else [f"verdict {diag.verdict}: {diag.report.headline}"]
    if watch.get("compared", 0) < 3 or watch.get("diverged") or watch.get("never_compared"):
        problems.append(f"watch totals {watch}")
    return (f"{diag.verdict}: {watch.get('text', 'no watch totals')}", FAIL if problems else PASS,
            {"diagnosis": diag.summary(), "watch": watch, "problems": problems})


def check_watch_example(env: Env, name: str) -> tuple[str, str, dict]:
    """Watch alone (no step in full) reaches the verdict full recording reaches on the same device and dtype."""
    full = _example(env, name, "-full-for-watch")
    watched = _example(env, name, "-watched", **WATCH)
    problems = [] if watched.verdict == full.verdict else [f"watch {watched.verdict} vs full {full.verdict}"]
    modules = sorted({r.module for r in watched.report.regions if r.status == "diverged"})
    full_lead = full.lead_summary().get("module")
    if full.verdict == "diverged" and full_lead not in modules and modules:
        problems.append(f"watch found {modules}, full recording leads with {full_lead}")
    said = f"watch {watched.verdict} @ {', '.join(modules) or '-'}; full {full.verdict} @ {full_lead}"
    return said, FAIL if problems else PASS, {"watch": watched.summary(), "full": full.summary(),
                                               "problems": problems}


def _moe_top4(env: Env, suffix: str, **options: Any) -> Diagnosis:
    """The benchmark's kind of MoE, clean by construction (bias updated after the optimizer step): 16 experts top-4
    (every token's outputs scatter_add-ed from 4 experts: float atomics on a GPU), fp32 weights, bf16 autocast on
    CUDA (float32 on CPU), 4 steps."""
    import tiny_moe

    dev = env.device
    args = tiny_moe.ModelArgs(dim=256, n_layers=2, num_experts=16, top_k=4, hidden_dim=256)
    model = tiny_moe.build_model(args, seed=0, ac_mode="checkpoint_wrapper").to(dev).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    autocast = (functools.partial(torch.autocast, "cuda", dtype=torch.bfloat16) if env.cuda
                else contextlib.nullcontext)

    def loop() -> None:
        for step in range(4):
            inputs, labels = tiny_moe.make_batch(args, step, seed=0, batch_size=2, seq_len=1024)
            with autocast():
                loss = tiny_moe.loss_fn(model(inputs.to(dev)), labels.to(dev))
            loss.backward()
            opt.step()
            opt.zero_grad()
            for moe in model.moe_layers():
                tiny_moe.update_expert_bias(moe)

    torch.manual_seed(0)
    return record(env, f"moe-top4-{dev.type}{suffix}", loop, **options)


def check_watch_moe_top4(env: Env) -> tuple[str, str, dict]:
    """Watch and a full recording of the same clean MoE agree; what each said (a GPU's atomics included)."""
    full = _moe_top4(env, "-full")
    watched = _moe_top4(env, "-watched", **WATCH)
    problems = [] if watched.verdict == full.verdict else [f"watch {watched.verdict} vs full {full.verdict}"]
    watch = watched.report.watch or {}
    lead = full.lead_summary()
    said = (f"full {full.verdict} ({lead.get('cause')} @ {lead.get('module')}: {one_line(full.report.headline, 160)});"
            f" watch {watched.verdict}: {one_line(watch.get('text', 'no watch totals'), 200)}")
    return said, FAIL if problems else PASS, {"watch": watched.summary(), "full": full.summary(),
                                               "watch_totals": watch, "problems": problems}


class SideStreamStack(nn.Module):
    """A region whose first tensor is made on a side stream (as an overlapped all-gather's is) and which saves more
    tensors than watch holds at once (several flushes of the batched kernel per pass); tests/gpu uses it too."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(48))

    def forward(self, x):
        if x.is_cuda:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                x = torch.tanh(x * 2)
            torch.cuda.current_stream().wait_stream(side)
            x.record_stream(torch.cuda.current_stream())
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def check_watch_side_stream(env: Env) -> tuple[str, str, dict]:
    """Watch over tensors made on a side stream, held across several flushes in one pass: clean, every pass compared."""
    torch.manual_seed(0)
    block = SideStreamStack(256).to(env.device)

    def run() -> None:
        for _ in range(3):
            x = torch.randn(4, 512, 256, device=env.device, requires_grad=True)
            with torch.autocast(env.device.type, dtype=env.dtype, enabled=env.dtype != torch.float32):
                y = cp.checkpoint(block, x, use_reentrant=False)
            y.float().pow(2).mean().backward()

    diag = record(env, "watch-side-stream", run, **WATCH)
    watch = diag.report.watch or {}
    problems = [] if diag.verdict == "clean" else [f"verdict {diag.verdict}: {diag.report.headline}"]
    if watch.get("compared") != 3:
        problems.append(f"watch totals {watch}")
    return (f"{diag.verdict}: {watch.get('text', 'no watch totals')}", FAIL if problems else PASS,
            {"diagnosis": diag.summary(), "watch": watch, "problems": problems})


def check_watch_syncs(env: Env) -> tuple[str, str, dict]:
    """Watch mode's device-to-host reads: `to_host` (a sync) never; CUDA syncs per step those of the plain step."""
    from ac_diff.capture import fingerprint

    backend = "flash" if env.cuda else "math"
    xs = batches(env, 6)  # the steady state after a step recorded in full to learn (and the step its results land)
    counts = {"to_host": 0, "later": 0}
    real_to_host, real_later = fingerprint.to_host, fingerprint.to_host_later

    def count(key, real):
        def counted(t):
            counts[key] += 1
            return real(t)
        return counted

    def syncs_per_step(ctx: Callable) -> list[int]:
        per_step: list[int] = []
        model = build(env, nonreentrant())
        if not env.cuda:
            ctx(lambda: train(model, xs, sdpa_ctx(backend)))
            return per_step
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            last = [0]

            def on_step(step: int) -> None:
                seen = sum("synchroniz" in str(w.message) for w in caught)
                per_step.append(seen - last[0])
                last[0] = seen
            try:
                ctx(lambda: train(model, xs, sdpa_ctx(backend), on_step=on_step))
            finally:
                torch.cuda.set_sync_debug_mode(0)
        return per_step

    plain = syncs_per_step(lambda fn: fn())
    fingerprint.to_host, fingerprint.to_host_later = count("to_host", real_to_host), count("later", real_later)
    try:
        holder: list = []
        watched = syncs_per_step(lambda fn: holder.append(record(env, "watch-syncs", fn, **WATCH)))
    finally:
        fingerprint.to_host, fingerprint.to_host_later = real_to_host, real_later
    diag = holder[0]
    problems = []
    # a module whose watched values differed where full recording may not compare them (attention's unused output)
    # is recorded in full once, to learn which positions those are: one step with read-backs, then none
    learning = len(diag.report.regions) and max((r.step or 0) for r in diag.report.regions)
    if counts["to_host"] > 2 * len(diag.report.regions):
        problems.append(f"{counts['to_host']} synchronous read-back(s) (to_host) in watch mode")
    if env.cuda and watched[-2:] != plain[-2:]:
        problems.append(f"CUDA syncs per step {watched} watched vs {plain} plain")
    if diag.verdict != "clean":
        problems.append(f"verdict {diag.verdict}")
    said = (f"to_host {counts['to_host']} (full recording of step {learning or '-'}), async copies "
            f"{counts['later']}; CUDA syncs/step plain {plain or 'n/a'}, watched {watched or 'n/a'}; {diag.verdict}")
    return said, FAIL if problems else PASS, {"counts": counts, "plain": plain, "watched": watched,
                                               "diagnosis": diag.summary(), "problems": problems}


# ---------------------------------------------------------------------------------------------------------------
# check 7: float8 cast in a region


def check_fused_prints(env: Env) -> tuple[str, str, dict]:
    """Full recording's fused fingerprint kernels: they compile and agree with the host here; a full recording of the
    side-stream stack (several flushes per pass, a tensor made on a side stream) is clean; the CUDA kernels a recorded
    step adds to the plain step, per fingerprinted output (profiler), at most one."""
    from torch.profiler import ProfilerActivity, profile

    from ac_diff.capture import fingerprint, fused_prints

    if not env.cuda:
        raise Skipped("CUDA only")
    if fused_prints.FusedPrints.get() is None:
        return "the fused kernels are unavailable (see the warning)", FAIL, {}
    torch.manual_seed(0)
    block = SideStreamStack(256).to(env.device)
    xs = [torch.randn(4, 512, 256, device=env.device, requires_grad=True) for _ in range(3)]

    def step(x: torch.Tensor) -> None:
        with torch.autocast("cuda", dtype=env.dtype, enabled=env.dtype != torch.float32):
            y = cp.checkpoint(block, x, use_reentrant=False)
        y.float().pow(2).mean().backward()

    def kernels(fn: Callable[[], None]) -> int:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            env.sync()
        return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                   and "memcpy" not in e.name.lower() and "memset" not in e.name.lower())

    step(xs[0])
    plain = kernels(lambda: step(xs[1]))
    outputs = [0]
    real_add = fingerprint.FingerprintBatch.add

    def counting_add(self, t, borrowed=False):
        slot = real_add(self, t, borrowed)
        outputs[0] += slot is not None
        return slot

    counted: dict[str, int] = {}

    def recorded() -> None:
        for x in xs[:2]:
            step(x)
        fingerprint.FingerprintBatch.add = counting_add
        try:
            counted["kernels"] = kernels(lambda: step(xs[2]))
        finally:
            fingerprint.FingerprintBatch.add = real_add

    diag = record(env, "fused-side-stream", recorded)
    added = counted.get("kernels", 0) - plain
    per_output = added / max(outputs[0], 1)
    problems = [] if diag.verdict == "clean" else [f"verdict {diag.verdict}: {diag.report.headline}"]
    if per_output > 1:
        problems.append(f"{per_output:.2f} kernels per fingerprinted output")
    said = (f"{diag.verdict}; {added} kernels added for {outputs[0]} fingerprinted outputs: {per_output:.2f} per "
            f"output (plain step {plain} kernels)")
    return said, FAIL if problems else PASS, {"diagnosis": diag.summary(), "plain_kernels": plain,
                                               "recorded_kernels": counted.get("kernels"), "outputs": outputs[0],
                                               "problems": problems}


def check_float8(env: Env) -> tuple[str, str, dict]:
    if not hasattr(torch, "float8_e4m3fn"):
        raise Skipped("skipped (not available): torch has no float8_e4m3fn")
    xs = batches(env, 2)
    model = build(env, nonreentrant(), f8=True)
    diag = record(env, "float8", lambda: train(model, xs), write="all")
    problems = diag.all_compared_clean(regions=4)
    ops = ac_diff.load(diag.path).ops
    f8_rows = ops[(ops.op == "aten._to_copy.default")
                  & ops.out_dtypes.map(lambda ds: any("f8" in str(d) or "float8" in str(d) for d in ds))]
    with_fp = f8_rows[f8_rows.fingerprint.map(lambda fp: fp is not None and fp == fp and len(fp) > 0
                                              if not isinstance(fp, float) else False)]
    phases = sorted(set(f8_rows.phase))
    if f8_rows.empty:
        problems.append("no aten._to_copy.default with a float8 output in the trace")
    elif len(with_fp) != len(f8_rows):
        problems.append(f"{len(f8_rows) - len(with_fp)} of {len(f8_rows)} float8 _to_copy ops have no fingerprint")
    if f8_rows.empty or "recompute" not in phases:
        problems.append(f"float8 _to_copy ops in phases {phases}, expected forward and recompute")
    sample = f8_rows.head(2)[["phase", "module", "out_dtypes", "fingerprint"]].to_dict("records")
    said = diag.short() + f"; {len(f8_rows)} f8 _to_copy ops ({len(with_fp)} fingerprinted)"
    return said, FAIL if problems else PASS, {"diagnosis": diag.summary(), "problems": problems,
                                              "f8_ops": len(f8_rows), "f8_ops_fingerprinted": len(with_fp),
                                              "sample": sample}


# ---------------------------------------------------------------------------------------------------------------
# timing


def check_timing(env: Env) -> tuple[str, str, dict]:
    sizes = ({"dim": 512, "heads": 8, "n": 4, "batch": 4, "seq": 512} if env.cuda else
             {"dim": 128, "heads": 4, "n": 2, "batch": 2, "seq": 128})
    backend = "flash" if env.cuda else "math"
    if env.cuda:
        probe_backend(env, backend)
    warm, timed = 2, 6
    xs = batches(env, warm + timed, sizes=sizes)

    def timed_steps(model: nn.Module) -> list[float]:
        times: list[float] = []
        t = [0.0]

        def on_step(step: int) -> None:
            env.sync()
            now = time.perf_counter()
            times.append(now - t[0])
            t[0] = now

        env.sync()
        t[0] = time.perf_counter()
        train(model, xs, sdpa_ctx(backend), on_step=on_step)
        return times[warm:]

    plain = timed_steps(build(env, nonreentrant(), sizes=sizes))
    model = build(env, nonreentrant(), sizes=sizes)
    recorded: list[float] = []
    diag = record(env, "timing", lambda: recorded.extend(timed_steps(model)), gz=False)
    p, r = statistics.median(plain), statistics.median(recorded)
    said = (f"plain {p * 1e3:.1f} ms, recorded {r * 1e3:.1f} ms per step: {r / p:.2f}x "
            f"({backend}, dim {sizes['dim']}, seq {sizes['seq']}, {sizes['n']} layers, batch {sizes['batch']})")
    return said, INFO, {"plain_s": plain, "recorded_s": recorded, "ratio": r / p, "sizes": sizes,
                        "backend": backend, "diagnosis": diag.summary()}


# ---------------------------------------------------------------------------------------------------------------
# the runner


def one_line(text: str, limit: int = 300) -> str:
    text = re.sub(r"\s*\(Triggered internally at [^)]*\)\.?", "", str(text))  # torch's C++ source locations
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    line = lines[0] if lines else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


def safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in name).strip("-")


@contextlib.contextmanager
def time_limit(seconds: float):
    if seconds <= 0 or not hasattr(signal, "SIGALRM"):
        yield
        return

    def on_alarm(signum, frame):
        raise CheckTimeout(f"timed out after {seconds:.0f} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def plan(env: Env) -> list[tuple[str, str, Callable[[], tuple[str, str, dict]]]]:
    checks: list = []
    for b in ("flash", "efficient", "cudnn", "math"):
        checks.append((f"1 sdpa[{b}]", "clean, no warnings, all regions compared",
                       functools.partial(check_sdpa_clean, env, b)))
    checks += [
        ("2 sac[save mm]", "clean, all regions compared", functools.partial(check_sac, env)),
        ("2 checkpoint_wrapper", "clean, modules without the wrapper",
         functools.partial(check_checkpoint_wrapper, env)),
        ("2 hf_llama[sdpa]", "clean, 4 regions compared", functools.partial(check_hf_llama, env)),
    ]
    dropout_backends = ("flash", "efficient") if env.cuda else ("math", "flash", "efficient")
    for b in dropout_backends:
        checks.append((f"3 sdpa_dropout[{b},rng=False]",
                       "diverged, lead cause rng naming the attention op" if (env.cuda or b != "math")
                       else "diverged, lead cause rng (CPU math: a dropout op draws)",
                       functools.partial(check_sdpa_dropout, env, b, False)))
        checks.append((f"3 sdpa_dropout[{b},rng=True]", "clean, all regions compared",
                       functools.partial(check_sdpa_dropout, env, b, True)))
    for name in ("moe_bias_update", "dropout_no_rng", "python_state_branch"):
        checks.append((f"4 example[{name}]", "verdict, lead cause, lead module = CPU float32's",
                       functools.partial(check_example, env, name)))
    checks += [
        ("5 grads_identical[flash]", "every .grad bit-identical with/without recorder",
         functools.partial(check_grads_identical, env, "flash")),
        ("6 host_syncs", "a constant number per step (reported)", functools.partial(check_host_syncs, env)),
        ("7 float8_cast", "f8 _to_copy ops fingerprinted in the trace; clean", functools.partial(check_float8, env)),
        ("8 watch[sdpa clean]", "clean, every region compared by watch", functools.partial(check_watch_clean, env)),
        ("8 watch[syncs]", "no to_host; CUDA syncs/step = plain's", functools.partial(check_watch_syncs, env)),
        ("8 watch[side stream]", "clean, 3 compared (side-stream tensor, 2 flushes per pass)",
         functools.partial(check_watch_side_stream, env)),
    ]
    for name in ("moe_bias_update", "dropout_no_rng", "python_state_branch"):
        checks.append((f"8 watch[{name}]", "verdict = full recording's, same module",
                       functools.partial(check_watch_example, env, name)))
    checks.append(("8 watch[moe top-4, autocast]", "verdict = full recording's (what each said)",
                   functools.partial(check_watch_moe_top4, env)))
    checks.append(("9 fused_prints[side stream]", "kernels pass their check; clean; <= 1 kernel per output",
                   functools.partial(check_fused_prints, env)))
    checks.append(("timing[plain vs recorded]", "ratio (reported)", functools.partial(check_timing, env)))
    return checks


def run_check(env: Env, name: str, expected: str, fn: Callable, limit: float) -> Row:
    row = Row(name, expected)
    t0 = time.perf_counter()
    try:
        with time_limit(limit):
            row.said, row.result, row.details = fn()
    except Skipped as s:
        row.result, row.said = SKIP, str(s)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - a check must never end the script
        row.result = FAIL
        row.error = one_line(f"{type(exc).__name__}: {exc}")
        row.said = row.said or f"error: {row.error}"
        row.details["traceback"] = traceback.format_exc()
    finally:
        with contextlib.suppress(BaseException):
            env.sync()
        row.seconds = time.perf_counter() - t0
        with contextlib.suppress(BaseException):
            torch.use_deterministic_algorithms(False)
            if env.cuda:
                torch.cuda.set_sync_debug_mode(0)
        gc.collect()
        if env.cuda:
            with contextlib.suppress(BaseException):
                torch.cuda.empty_cache()
    if row.result == FAIL and not row.error and row.details.get("problems"):
        row.error = one_line("; ".join(row.details["problems"]))
    return row


def table(rows: list[Row]) -> str:
    header = ["check", "expected", "ac-diff said", "result", "seconds"]

    def cell(text: Any) -> str:
        return str(text).replace("|", "/").replace("\n", " ")

    body = [[cell(r.check), cell(r.expected), cell(r.said + (f" [{r.error}]" if r.error and r.error not in r.said
                                                                 else "")),
             r.result, f"{r.seconds:.1f}"] for r in rows]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    return "\n".join(lines)


def environment(env: Env) -> dict[str, Any]:
    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                            "device": str(env.device), "dtype": str(env.dtype),
                            "ac_diff": getattr(ac_diff, "__version__", None), "repo": str(REPO)}
    with contextlib.suppress(Exception):
        info["git"] = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                                     timeout=10).stdout.strip()
        info["git_dirty_files"] = len(subprocess.run(["git", "-C", str(REPO), "status", "--porcelain"],
                                                     capture_output=True, text=True, timeout=10).stdout.splitlines())
    if env.cuda:
        with contextlib.suppress(Exception):
            info.update({"gpu": torch.cuda.get_device_name(), "capability": torch.cuda.get_device_capability(),
                         "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version()})
    with contextlib.suppress(Exception):
        import transformers

        info["transformers"] = transformers.__version__
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="gpu-check-out", help="output directory (default %(default)s)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cuda (bf16, the real check) or cpu (float32, a dry run)")
    parser.add_argument("--only", action="append", default=[],
                        help="run only checks whose name contains this text (repeatable)")
    parser.add_argument("--budget", type=float, default=270.0,
                        help="seconds for all checks; later checks are skipped past it (default %(default)s)")
    parser.add_argument("--check-limit", type=float, default=90.0,
                        help="seconds one check may take before it is stopped (default %(default)s)")
    args = parser.parse_args(argv)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    rows: list[Row] = []
    env = None
    global ac_diff
    try:
        import ac_diff as imported

        ac_diff = imported
    except BaseException as exc:  # noqa: BLE001
        rows.append(Row("import ac_diff", "imports", f"error: {type(exc).__name__}", FAIL,
                        error=one_line(f"{type(exc).__name__}: {exc}"), details={"traceback": traceback.format_exc()}))
    try:
        if ac_diff is None:
            pass
        elif args.device == "cuda" and not torch.cuda.is_available():
            rows.append(Row("setup", "a CUDA device", "torch.cuda.is_available() is False", FAIL,
                            error="no CUDA device: run with --device cpu for a dry run"))
        else:
            cuda = args.device == "cuda"
            env = Env(torch.device("cuda" if cuda else "cpu"), torch.bfloat16 if cuda else torch.float32, out, cuda)
            if cuda:
                torch.ones(1, device=env.device).sum().item()  # CUDA initialised before the first timed check
            for name, expected, fn in plan(env):
                if args.only and not any(o in name for o in args.only):
                    continue
                left = args.budget - (time.perf_counter() - started)
                if left <= 5:
                    rows.append(Row(name, expected, "skipped (time budget spent)", SKIP))
                    continue
                print(f"[gpu_check] {name} ...", flush=True)
                row = run_check(env, name, expected, fn, min(args.check_limit, left))
                print(f"[gpu_check] {name}: {row.result} ({row.seconds:.1f} s) {row.said[:160]}", flush=True)
                rows.append(row)
    except BaseException as exc:  # noqa: BLE001 - the table is printed whatever happened
        rows.append(Row("runner", "no crash", f"error: {type(exc).__name__}", FAIL,
                        error=one_line(f"{type(exc).__name__}: {exc}"), details={"traceback": traceback.format_exc()}))

    text = table(rows)
    counts = {k: sum(r.result == k for r in rows) for k in (PASS, FAIL, SKIP, INFO)}
    total = time.perf_counter() - started
    footer = f"{counts[PASS]} PASS, {counts[FAIL]} FAIL, {counts[SKIP]} SKIP, {counts[INFO]} INFO in {total:.0f} s"
    print("\n" + text + "\n\n" + footer)
    try:
        info = environment(env) if env is not None else {"torch": torch.__version__}
        (out / "table.md").write_text(f"# ac-diff gpu_check ({info.get('gpu', info.get('device'))}, "
                                      f"torch {info.get('torch')})\n\n{text}\n\n{footer}\n")
        results = {"environment": info, "seconds": total, "counts": counts,
                   "checks": [{"check": r.check, "expected": r.expected, "said": r.said, "result": r.result,
                               "seconds": round(r.seconds, 2), "error": r.error, "details": r.details} for r in rows]}
        (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
        print(f"written: {out / 'table.md'}, {out / 'results.json'}, {out / 'reports'}/, {out / 'traces'}/")
    except Exception as exc:  # noqa: BLE001
        print(f"could not write the results to {out}: {exc}", file=sys.stderr)
    return 1 if counts[FAIL] else 0


if __name__ == "__main__":
    sys.exit(main())
