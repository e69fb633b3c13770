"""`--must-save OP[,OP..]` (+ `--must-save-module GLOB`): a selective-AC policy that saves these ops in
matching modules, composed with the script's own SAC `context_fn` (its policy decides every other op).

    MustSave(["aten.topk.default"], ["layers.*.moe.router"], current_module).apply(call)
    # call.kwargs["context_fn"] now returns SAC modes whose policy says MUST_SAVE for topk in the router

Reentrant regions cannot take a `context_fn` (torch raises): they are left alone and reported.
"""

from __future__ import annotations

from typing import Any, Callable

from torch.utils.checkpoint import noop_context_fn

from ..capture.torch_compat import sac_policy_answers, selective_contexts, wrap_sac_policies
from .call import CheckpointCall, matches

_SAVE, _RECOMPUTE = sac_policy_answers()  # this torch's spelling (asked once: the policy runs per op)


def op_matches(op: Any, names: list[str]) -> bool:
    """`aten.topk.default` matches "aten.topk.default", "aten.topk" and "topk"."""
    full = str(op)
    parts = full.split(".")
    return any(n == full or n == ".".join(parts[:2]) or (len(parts) > 1 and n == parts[1]) for n in names)


class MustSave:
    kind = "must_save"

    def __init__(self, ops: list[str], module_globs: list[str], current_module: Callable[[], str | None]) -> None:
        self.ops = list(ops)
        self.module_globs = list(module_globs)
        self.current_module = current_module
        self.saved: dict[str, int] = {}  # "op in module" -> times the policy said MUST_SAVE
        self._matched: set[str] = set()
        self._added = False  # the policy went on some region

    unmatched_note = ("no op of that name ran in a checkpointed region; `ac-diff export TRACE --what ops` lists those "
                      "that did")

    def unmatched(self) -> list[str]:
        """The ops asked for that no region the policy was added to ran (a misspelt overload); none where it was added
        to no region (each call says why)."""
        return [op for op in self.ops if op not in self._matched] if self._added else []

    def apply(self, call: CheckpointCall) -> str | None:
        if call.bypass:
            return None
        if call.reentrant:
            return "not applied: reentrant checkpoint takes no context_fn (pass use_reentrant=False)"
        if call.kwargs.get("debug"):
            return "not applied: checkpoint(debug=True) takes no context_fn"
        user_fn = call.kwargs.get("context_fn", noop_context_fn)
        # checkpoint() calls context_fn exactly once per call: make the pair now, hand the same pair over
        if user_fn is noop_context_fn:
            contexts = selective_contexts(self._wrap(_recompute_everything))
            done = "SAC policy added"
        else:
            contexts = user_fn()
            if not wrap_sac_policies(contexts, self._wrap):
                call.kwargs["context_fn"] = lambda: contexts
                return "not applied: the region's context_fn is not a selective-AC policy"
            done = "composed with the script's SAC policy"
        call.kwargs["context_fn"] = lambda: contexts
        self._added = True
        return done

    def _wrap(self, policy: Callable) -> Callable:
        def policy_fn(ctx, op, *args, **kwargs):
            if op_matches(op, self.ops):
                module = self.current_module()
                if not self.module_globs or matches(module, self.module_globs):
                    key = f"{op} in {module or '?'}"
                    self.saved[key] = self.saved.get(key, 0) + 1
                    self._matched.update(g for g in self.ops if g not in self._matched and op_matches(op, [g]))
                    return _SAVE
            return policy(ctx, op, *args, **kwargs)
        return policy_fn


def _recompute_everything(ctx, op, *args, **kwargs):
    return _RECOMPUTE
