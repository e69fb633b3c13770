"""Every parameter's gradient after each of the first N backward passes, summarized on its device, bounded on the host.

    capture = GradCapture("out/grads-rank0.pt", steps=1).install()   # wraps torch.autograd.backward
    ...  # the script: loss.backward() -> one summary of every parameter's .grad
    capture.finish()                                                 # writes the file (if not yet)
    load_grads("out/grads-rank0.pt")  ->  {"steps": [{"loss": Summary, "grads": {"layers.0.w": Summary}}]}

    summarize_all({"w": grad, "b": None}, budget=64 << 20)
    ->  {"w": {"shape": [4096, 1024], "dtype": "float32", "fp": [0.12, 3.4, 81234], "norm": 2.5,
               "values": <16384 host floats>, "kept": "sample", "sampled": True}, "b": None}

Per gradient (a DTensor's local shard: what this rank holds), on its device: a fingerprint (capture/fingerprint.py,
with its exact bit sum always: equal fingerprints mean bit-identical up to a 2**-32 chance) and its norm, read back
in one batched copy per device per step. Values reach the host only within `budget` bytes per step
($AC_DIFF_REFERENCE_BUDGET_MB, `--reference-budget-mb`, default 64): first a strided sample of every gradient
(all of it when it has at most `SAMPLE` elements), then the whole of the smallest ones while the budget lasts;
gradients past it keep fingerprint and norm only (`kept: "none"`). The rule depends on the names and sizes only,
so both runs keep the same values. Never the whole model on the host. `None` gradients are kept as such.

Parameters are named from the root modules the script called (the modules no other called module
contains), as `named_parameters()` names them with wrapper segments dropped, after the root's name where there are
several, as the report names modules (`G.0.weight`, `blocks.1.fc.weight`; else `Disc[1].`, by its place): the same
names in both runs.
"""

from __future__ import annotations

import os
import threading
import weakref
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..capture.compiled import is_fake, skip_when_compiling, tracing
from ..capture.fingerprint import FingerprintBatch, _local, host_copies
from ..capture.modules import ModuleStack, clean_fqn
from ..capture.torch_compat import graph_task_id

BUDGET_ENV = "AC_DIFF_REFERENCE_BUDGET_MB"  # host bytes for gradient values per compared step, in MB
DEFAULT_BUDGET_MB = 64
SAMPLE = 1 << 14  # elements of a gradient's strided sample
FORMAT_VERSION = 2


def budget_bytes() -> int:
    """The host budget for gradient values per step ($AC_DIFF_REFERENCE_BUDGET_MB, default 64 MB)."""
    try:
        return max(0, int(float(os.environ.get(BUDGET_ENV, DEFAULT_BUDGET_MB)) * (1 << 20)))
    except ValueError:
        return DEFAULT_BUDGET_MB << 20


def plan_values(sizes: dict[str, tuple[int, int]], budget: int) -> dict[str, str]:
    """What to keep of each gradient, from {name: (elements, bytes per element)}: "full", "sample" or "none".

        plan_values({"a": (10, 4), "b": (10**6, 4)}, budget=100_000)  ->  {"a": "full", "b": "sample"}

    Samples first (in order), then whole gradients, smallest first, while `budget` bytes last."""
    plan: dict[str, str] = {}
    left = budget
    for name, (n, size) in sizes.items():
        cost = min(n, SAMPLE) * size
        if cost <= left:
            left -= cost
            plan[name] = "full" if n <= SAMPLE else "sample"
        else:
            plan[name] = "none"
    for name, (n, size) in sorted(((k, v) for k, v in sizes.items() if plan[k] == "sample"), key=lambda kv: kv[1][0]):
        extra = (n - SAMPLE) * size
        if extra > left:
            break
        left -= extra
        plan[name] = "full"
    return plan


def _sample(flat: torch.Tensor) -> torch.Tensor:
    """`SAMPLE` elements of a 1-d tensor at a fixed stride (a view: copied by the read-back)."""
    return flat[:: max(1, flat.numel() // SAMPLE)][:SAMPLE]


def _norm(t: torch.Tensor) -> torch.Tensor:
    """The 2-norm of `t` on its device, as a 0-d float64 tensor (float32 arithmetic below float64)."""
    if not (t.dtype.is_floating_point or t.dtype.is_complex):
        t = t.double()
    wide = torch.float64 if t.dtype in (torch.float64, torch.complex128) else torch.float32
    return torch.linalg.vector_norm(t, dtype=wide if not t.dtype.is_complex else None).double()


def summarize_all(tensors: dict[str, torch.Tensor | None], budget: int) -> dict[str, dict[str, Any] | None]:
    """Summaries of named tensors (gradients): fingerprint and norm of each, values within `budget` bytes."""
    shaped = {}  # the plain tensors (a DTensor's local shard), in their own shape: fingerprinted as matrices
    for name, t in tensors.items():
        t = _local(t.detach()) if t is not None else None
        if t is not None and t.layout is torch.strided:
            shaped[name] = t
    local = {k: v.reshape(-1) for k, v in shaped.items()}
    plan = plan_values({k: (v.numel(), v.element_size()) for k, v in local.items()}, budget)
    batch = FingerprintBatch(bits=True)
    slots = {k: batch.add(v) for k, v in shaped.items()}
    names = list(local)
    by_device: dict[torch.device, list[str]] = {}
    for k in names:
        by_device.setdefault(local[k].device, []).append(k)
    norms = [torch.stack([_norm(local[k]) for k in group]) for group in by_device.values()]
    kept = [k for k in names if plan[k] != "none"]
    fps, _ = batch.collect()  # the fingerprints: one read-back per device
    host = host_copies([*norms, *(local[k] if plan[k] == "full" else _sample(local[k]) for k in kept)])
    norm_of = {k: float(x) for group, n in zip(by_device.values(), host) for k, x in zip(group, n.tolist())}
    values = dict(zip(kept, host[len(norms):]))
    out: dict[str, dict[str, Any] | None] = {}
    for name, t in tensors.items():
        flat = local.get(name)
        if t is None or flat is None:
            out[name] = None
            continue
        out[name] = {"shape": list(shaped[name].shape), "dtype": str(flat.dtype).replace("torch.", ""),
                     "fp": fps[slots[name]] if slots[name] is not None else None, "norm": norm_of[name],
                     "values": values.get(name), "kept": plan[name], "sampled": plan[name] == "sample"}
    return out


class GradCapture:
    def __init__(self, path: str | os.PathLike, steps: int = 1, *, on_done: Any = None) -> None:
        self.path = Path(path)
        self.steps = max(1, int(steps))
        self.on_done = on_done  # called after the N-th backward (the reference child stops there)
        self.snapshots: list[dict[str, Any]] = []
        self._seen: list[weakref.ref] = []
        self._seen_ids: set[int] = set()
        self._ran: set[int] = set()  # the modules that ran a forward since the last backward
        self._names = ModuleStack()  # names the roots as the report does (`D.0.weight`, `blocks[2].fc.weight`)
        self._hook = None
        self._original = None
        self._original_grad = None
        self._depth = 0
        self.written = False
        self.threads: set[int] = set()  # the threads that ran forwards or backwards (two models trained side by side)
        # gradients of inputs that are no parameters (an adversarial example's, a saliency map's) taken since the last
        # step's: compared with that step's gradients ({"autograd.grad 1, input 0": summary})
        self._inputs: dict[str, dict[str, Any] | None] = {}

    def install(self) -> "GradCapture":
        # (compiled modules: Dynamo must not trace it; the compiled module itself is seen, called eagerly)
        self._hook = nn.modules.module.register_module_forward_pre_hook(skip_when_compiling(self._pre))
        self._names.install()
        self._original, self._original_grad = torch.autograd.backward, torch.autograd.grad

        def after_backward(result, *args, **kwargs):
            self._snapshot(args[0] if args else kwargs.get("tensors"))

        def after_grad(result, outputs, inputs, *args, **kwargs):
            # (the gradients a training step takes: not a penalty's, whose graph a backward goes on through)
            if not kwargs.get("create_graph", args[2] if len(args) > 2 else False):
                self._snapshot_of_grad(outputs, inputs, result)

        torch.autograd.backward = self._outermost(self._original, after_backward)
        torch.autograd.grad = self._outermost(self._original_grad, after_grad)
        return self

    def _outermost(self, original: Any, then: Any) -> Any:
        """`original`, calling `then(result, *args)` after an outermost call while steps are still to be captured
        (reentrant checkpoint's recompute calls torch.autograd.backward inside the outer backward)."""
        def call(*args, **kwargs):
            self._depth += 1
            try:
                result = original(*args, **kwargs)
            finally:
                self._depth -= 1
            if self._depth == 0 and len(self.snapshots) < self.steps:
                then(result, *args, **kwargs)
            return result

        return call

    def uninstall(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
            self._names.uninstall()
        if self._original is not None:
            torch.autograd.backward = self._original
            torch.autograd.grad = self._original_grad
            self._original = None

    def _pre(self, module: nn.Module, args) -> None:
        if graph_task_id() is not None:  # (a recompute in a backward, only in the run with AC: no model the step ran)
            return
        self._ran.add(id(module))
        self.threads.add(threading.get_ident())
        if id(module) not in self._seen_ids:
            self._seen_ids.add(id(module))
            self._seen.append(weakref.ref(module))

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The parameters of the models that ran since the last backward (a model re-created from a checkpoint
        leaves the old one behind, alive in one run and collected in the other: it would shift every name), by the
        report's names; of every model seen where none ran (a backward without a forward through a module)."""
        alive = [m for m in (r() for r in self._seen) if m is not None]
        modules = [m for m in alive if id(m) in self._ran] or alive
        inner: set[int] = set()
        for m in modules:
            inner.update(id(sub) for sub in m.modules() if sub is not m)
        roots = [m for m in modules if id(m) not in inner and any(True for _ in m.parameters())]
        out: list[tuple[str, nn.Parameter]] = []
        seen: set[int] = set()
        names = [self._names.name_of(root) for root in roots]
        for i, (root, name) in enumerate(zip(roots, names)):
            if len(roots) > 1 and (not name or names.count(name) > 1):
                name = f"{type(root).__name__}[{i}]"  # (no variable holds it: by its place among the roots)
            prefix = f"{name}." if name else ""
            for name, p in root.named_parameters():
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    out.append((prefix + clean_fqn(name), p))
        return out

    def _snapshot(self, tensors: Any, grads: dict[str, torch.Tensor | None] | None = None) -> None:
        roots = [tensors] if isinstance(tensors, torch.Tensor) else [t for t in (tensors or ())
                                                                      if isinstance(t, torch.Tensor)]
        self.snapshots.append({
            "loss": summarize_all({"loss": roots[0]}, budget_bytes())["loss"] if len(roots) == 1 else None,
            "grads": {**summarize_all(grads if grads is not None else {name: p.grad for name, p in
                                                                       self.named_parameters()}, budget_bytes()),
                      **self._inputs},
        })
        self._ran, self._inputs = set(), {}
        if len(self.snapshots) >= self.steps:
            self.finish()
            if self.on_done is not None:
                self.on_done()

    def _snapshot_of_grad(self, outputs: Any, inputs: Any, result: Any) -> None:
        """A step that takes its gradients with torch.autograd.grad (then sets `.grad` itself, or hands them to a
        functional optimizer): those of the parameters among `inputs`, by the report's names; where none is a module's
        parameter, several leaves (a functional loop's, torch.func.functional_call's dict) by their place. The gradient
        of one input alone (an adversarial example's, a saliency map) is no training step: it is compared with the
        next step's gradients (a checkpointed region that backward recomputed may have changed it alone)."""
        inputs = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)
        named = {id(p): name for name, p in self.named_parameters()}
        grads = {named[id(t)]: g for t, g in zip(inputs, result) if id(t) in named}
        if not grads and len(inputs) > 1:  # (a functional loop's own leaves, torch.func.functional_call's: by place)
            grads = {f"autograd.grad input[{i}]": g for i, (t, g) in enumerate(zip(inputs, result))
                     if isinstance(t, torch.Tensor) and t.is_leaf and t.is_floating_point()}
        if grads:
            self._snapshot(outputs, grads)
            return
        if tracing() or any(is_fake(g) for g in result if isinstance(g, torch.Tensor)):
            return  # (AOTAutograd tracing a compiled backward calls it on fake tensors: no gradient of the script)
        call = 1 + len({name.split(",")[0] for name in self._inputs})
        self._inputs.update(summarize_all({f"autograd.grad {call}, input {i}": g for i, g in enumerate(result)
                                           if isinstance(g, torch.Tensor) and g.is_floating_point()}, budget_bytes()))

    def finish(self) -> None:
        if self.written:
            return
        self.written = True
        self.uninstall()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"format": "ac-diff-grads", "version": FORMAT_VERSION, "steps": self.snapshots,
                    "threads": len(self.threads)}, self.path)
        for step in self.snapshots:  # written: the values are read back from the file, not kept in this process
            for summary in [step.get("loss"), *step["grads"].values()]:
                if summary is not None:
                    summary["values"] = None


def load_grads(path: str | os.PathLike) -> dict[str, Any] | None:
    try:
        data = torch.load(path, weights_only=True, mmap=True)  # values paged in as compared, not all at once
    except (OSError, RuntimeError, EOFError, ValueError):
        return None
    ok = isinstance(data, dict) and data.get("format") == "ac-diff-grads" and data.get("version") == FORMAT_VERSION
    return data if ok else None
