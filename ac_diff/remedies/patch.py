"""Puts the remedies between the user's script and `torch.utils.checkpoint.checkpoint`, at process start.

    patch = CheckpointPatch(RemedySpec(no_ac=["layers.1"], preserve_rng=True)).install()
    ...  # the script runs; every checkpoint call goes through patch._call
    patch.summary()  ->  [{"remedy": "no_ac", "region": "layers.1", "what": "AC off", "calls": 2}, ...]
    patch.uninstall()

`checkpoint()` is replaced in `torch.utils.checkpoint` (so `checkpoint_sequential` and every later
`from torch.utils.checkpoint import checkpoint` get it), and every reference an already-imported module
holds is re-pointed (`checkpoint_wrapper` binds it at import time as `torch_utils_checkpoint`, HF's
modeling_utils as `checkpoint`). That covers `checkpoint()`, `checkpoint_wrapper` (torchtitan's
apply_ac), `checkpoint_sequential` and HF `gradient_checkpointing_enable`. Watchers (`watch(call, run)`)
see each call that still checkpoints (the reference run's reentrant-leak watch); bypass watchers, each call run
without checkpointing (the reference run records its first forward: reference/forwards.py).
"""

from __future__ import annotations

import functools
import inspect
import sys
from typing import Any, Callable

import torch
import torch.utils.checkpoint as _cp

from ..capture.compiled import is_compiling
from ..capture.fqn import segment_name
from ..capture.modules import ModuleStack
from ..capture.torch_compat import checkpointed_module, dynamo_traces_through, function_name, sequential_segment
from . import deterministic
from .call import CheckpointCall
from .must_save import MustSave
from .no_ac import NoAC
from .reentrant import NonReentrant
from .restore import RestoreInRecompute
from .rng import PreserveRng
from .spec import RemedySpec

_MARK = "_ac_diff_remedies_original"
MATCHED_NOTHING = "matched nothing"  # how a summary row of a remedy that named nothing begins (fix: not applied)


def traced_call(original: Callable, own: set[str], everywhere: bool, function: Any, args: tuple, kwargs: dict) -> Any:
    """A checkpoint() call as Dynamo traces it (torch.compile around checkpointed blocks): "AC off everywhere" (the
    reference) inlines the function, so the compiled graph has no checkpointed region; every other remedy needs
    module names the hooks cannot give inside a compiled graph, so the call stays the checkpoint Dynamo compiles
    (`ac-diff run --compiled eager` runs such code eagerly, where every remedy applies)."""
    if everywhere:
        return function(*args, **{k: v for k, v in kwargs.items() if k not in own})
    return original(function, *args, **kwargs)


class CheckpointPatch:
    def __init__(self, spec: RemedySpec, watchers: list[Callable] | None = None, *, names: bool | None = None,
                 compiled: bool = False) -> None:
        """`compiled`: the script uses torch.compile (the reference of a run that did): AC off everywhere also reaches
        the checkpoint() calls Dynamo traces."""
        self.spec = spec
        self.compiled = compiled
        self._undo_dynamo: Callable | None = None
        self.watchers = list(watchers or [])
        self.bypass_watchers: list[Callable] = []  # `watch(call, run)` around each call run without checkpointing
        self.stack = ModuleStack()
        # module names are needed to match globs; "no AC anywhere" alone does not need them
        self._names = names if names is not None else bool(
            self.watchers or spec.must_save or spec.restore or [g for g in spec.no_ac if g != "*"])
        self.remedies: list[Any] = []
        if spec.no_ac:
            self.remedies.append(NoAC(spec.no_ac))
        if spec.non_reentrant:
            self.remedies.append(NonReentrant())
        if spec.preserve_rng:
            self.remedies.append(PreserveRng())
        if spec.must_save:
            self.remedies.append(MustSave(spec.must_save, spec.must_save_modules, self.stack.current))
        if spec.restore:
            self.remedies.append(RestoreInRecompute(spec.restore, self.stack.name_of))
        self.applied: dict[tuple[str, str, str], int] = {}
        self.process: list[str] = []  # process-wide remedies ("deterministic algorithms")
        self._restore: list[tuple[dict, str, Any]] = []

    def add_watcher(self, watch: Callable) -> None:
        """`watch(call, run)` sees every call that still checkpoints (before install)."""
        self.watchers.append(watch)
        self._names = True

    def add_bypass_watcher(self, watch: Callable) -> None:
        """`watch(call, run)` sees every call run without checkpointing (a remedy bypassed it)."""
        self.bypass_watchers.append(watch)

    # -- install / uninstall ------------------------------------------------------------------
    def install(self) -> "CheckpointPatch":
        if self.spec.deterministic:
            self.process.append(deterministic.enable())
        if not (self.remedies or self.watchers):
            return self
        original = getattr(_cp.checkpoint, _MARK, _cp.checkpoint)
        own = {name for name, p in inspect.signature(original).parameters.items()
               if p.kind is inspect.Parameter.KEYWORD_ONLY} | {"preserve_rng_state"}

        everywhere = "*" in self.spec.no_ac

        @functools.wraps(original)
        def checkpoint(function, *args, **kwargs):
            if is_compiling():  # Dynamo traces this call into a graph: no Python state here, no module names
                return traced_call(original, own, everywhere, function, args, kwargs)
            return self._call(original, own, function, args, kwargs)

        setattr(checkpoint, _MARK, original)
        for module in list(sys.modules.values()):  # re-point references bound at import time
            table = getattr(module, "__dict__", None)
            if not isinstance(table, dict):
                continue
            for key, value in list(table.items()):
                if value is original:
                    self._restore.append((table, key, value))
                    table[key] = checkpoint
        if everywhere and self.compiled:
            undo = dynamo_traces_through(checkpoint)
            if isinstance(undo, str):
                print(f"ac-diff: warning: {undo}", file=sys.stderr)
            else:
                self._undo_dynamo = undo
        if self._names:
            self.stack.install()
        return self

    def uninstall(self) -> None:
        for table, key, value in reversed(self._restore):
            table[key] = value
        self._restore = []
        if self._undo_dynamo is not None:
            self._undo_dynamo()
            self._undo_dynamo = None
        self.stack.uninstall()

    # -- one checkpoint call ------------------------------------------------------------------
    def _call(self, original: Callable, own: set[str], function: Any, args: tuple, kwargs: dict) -> Any:
        self.stack.freeze()
        region, modules = self._region(function)
        call = CheckpointCall(function, args, dict(kwargs), region=region, modules=modules,
                              reentrant=kwargs.get("use_reentrant") in (None, True))
        for remedy in self.remedies:
            what = remedy.apply(call)
            if what:
                key = (remedy.kind, region, what)
                self.applied[key] = self.applied.get(key, 0) + 1
        if call.bypass:
            def run():
                return function(*args, **{k: v for k, v in call.kwargs.items() if k not in own})
            watchers = self.bypass_watchers
        else:
            def run():
                return original(call.function, *args, **call.kwargs)
            watchers = self.watchers
        for watch in watchers:
            run = functools.partial(watch, call, run)
        return run()

    def _region(self, function: Any) -> tuple[str, list[str]]:
        if not self._names:
            return "", []
        segment = sequential_segment(function)
        if segment is not None:
            functions, start, end = segment
            self.stack.name_by_index(functions)
            names = [self.stack.name_of(m) for m in functions[start:end + 1] if isinstance(m, torch.nn.Module)]
            if names:
                return segment_name(start, end), names  # (the recorder's name for it, which the report shows)
        module, _ = checkpointed_module(function)
        if module is not None:
            name = self.stack.name_of(module) or type(module).__name__  # (an unnamed root: as reports name it)
            return name, [name]
        stack = self.stack.stack()  # (a function the module running now calls: that module's region, by its name)
        if stack:
            current = stack[-1][1] or type(stack[-1][0]).__name__
            return current, [current]
        return function_name(function) or "<function>", []

    # -- what was done ------------------------------------------------------------------------
    def summary(self) -> list[dict[str, Any]]:
        rows = [{"remedy": "deterministic", "region": None, "what": what, "calls": None} for what in self.process]
        rows += [{"remedy": kind, "region": region, "what": what, "calls": n}
                 for (kind, region, what), n in sorted(self.applied.items())]
        for remedy in self.remedies:
            for key, n in sorted(getattr(remedy, "saved", {}).items()):
                rows.append({"remedy": "must_save", "region": None, "what": f"saved {key}", "calls": n})
            for glob in remedy.unmatched() if hasattr(remedy, "unmatched") else ():
                rows.append({"remedy": remedy.kind, "region": None, "calls": 0,
                             "what": f"{MATCHED_NOTHING}: {glob} ({remedy.unmatched_note})"})

        return rows
