"""Every parameter's gradient after each of the first N backward passes, bounded in memory.

    capture = GradCapture("out/grads-rank0.pt", steps=1).install()   # wraps torch.autograd.backward
    ...  # the script: loss.backward() -> one snapshot of every parameter's .grad
    capture.finish()                                                 # writes the file (if not yet)
    load_grads("out/grads-rank0.pt")  ->  {"steps": [{"loss": Summary, "grads": {"layers.0.w": Summary}}]}

A summary is the gradient's shape, dtype, a hash of its bytes, its norm, and its values: all of them up to
`FULL_LIMIT` elements (the relative difference is then exact), else `SAMPLE` elements at a fixed stride
(marked `sampled`). `None` gradients are kept as such (a parameter that got no gradient).

Parameters are named from the root modules the script called (the modules no other called module
contains), as `named_parameters()` names them with wrapper segments dropped: the same names in both runs.
"""

from __future__ import annotations

import hashlib
import os
import weakref
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..capture.modules import clean_fqn

FULL_LIMIT = int(os.environ.get("AC_DIFF_REFERENCE_FULL", 1 << 20))  # elements kept whole per gradient
SAMPLE = 1 << 14


def summarize(t: torch.Tensor | None) -> dict[str, Any] | None:
    if t is None:
        return None
    t = t.detach()
    if hasattr(t, "to_local"):  # DTensor: this rank's shard
        t = t.to_local()
    flat = t.reshape(-1).cpu()
    raw = flat.contiguous().view(torch.uint8) if flat.numel() else flat
    digest = hashlib.blake2b(raw.numpy().tobytes(), digest_size=16).hexdigest()
    values = flat if flat.dtype.is_floating_point else flat.double()  # compared in float64 (graddiff.py)
    sampled = values.numel() > FULL_LIMIT
    if sampled:
        values = values[:: max(1, values.numel() // SAMPLE)][:SAMPLE]
    return {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""), "hash": digest,
            "norm": float(flat.double().norm()) if flat.numel() else 0.0, "values": values.clone(),
            "sampled": sampled}


class GradCapture:
    def __init__(self, path: str | os.PathLike, steps: int = 1, *, on_done: Any = None) -> None:
        self.path = Path(path)
        self.steps = max(1, int(steps))
        self.on_done = on_done  # called after the N-th backward (the reference child stops there)
        self.snapshots: list[dict[str, Any]] = []
        self._seen: list[weakref.ref] = []
        self._seen_ids: set[int] = set()
        self._hook = None
        self._original = None
        self._depth = 0
        self.written = False

    def install(self) -> "GradCapture":
        self._hook = nn.modules.module.register_module_forward_pre_hook(self._pre)
        self._original = torch.autograd.backward
        original = self._original

        def backward(*args, **kwargs):
            # reentrant checkpoint's recompute calls torch.autograd.backward inside the outer backward
            self._depth += 1
            try:
                result = original(*args, **kwargs)
            finally:
                self._depth -= 1
            if self._depth == 0 and len(self.snapshots) < self.steps:
                self._snapshot(args[0] if args else kwargs.get("tensors"))
            return result

        torch.autograd.backward = backward
        return self

    def uninstall(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._original is not None:
            torch.autograd.backward = self._original
            self._original = None

    def _pre(self, module: nn.Module, args) -> None:
        if id(module) not in self._seen_ids:
            self._seen_ids.add(id(module))
            self._seen.append(weakref.ref(module))

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        modules = [m for m in (r() for r in self._seen) if m is not None]
        inner: set[int] = set()
        for m in modules:
            inner.update(id(sub) for sub in m.modules() if sub is not m)
        roots = [m for m in modules if id(m) not in inner and any(True for _ in m.parameters())]
        out: list[tuple[str, nn.Parameter]] = []
        seen: set[int] = set()
        for i, root in enumerate(roots):
            prefix = "" if len(roots) == 1 else f"{type(root).__name__}[{i}]."
            for name, p in root.named_parameters():
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    out.append((prefix + clean_fqn(name), p))
        return out

    def _snapshot(self, tensors: Any) -> None:
        roots = [tensors] if isinstance(tensors, torch.Tensor) else [t for t in (tensors or ())
                                                                      if isinstance(t, torch.Tensor)]
        self.snapshots.append({
            "loss": summarize(roots[0]) if len(roots) == 1 else None,
            "grads": {name: summarize(p.grad) for name, p in self.named_parameters()},
        })
        if len(self.snapshots) >= self.steps:
            self.finish()
            if self.on_done is not None:
                self.on_done()

    def finish(self) -> None:
        if self.written:
            return
        self.written = True
        self.uninstall()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"format": "ac-diff-grads", "version": 1, "steps": self.snapshots}, self.path)


def load_grads(path: str | os.PathLike) -> dict[str, Any] | None:
    try:
        data = torch.load(path, weights_only=True)
    except (OSError, RuntimeError, EOFError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("format") == "ac-diff-grads" else None
