"""Version-guarded patches of `torch.utils.checkpoint` internals that report what a region does.

There is no public API that says "this op runs in the original forward of region 7" or "this tensor
is saved at position 46", so `CheckpointHooks` wraps the private classes that know (DESIGN.md §4):

    _checkpoint_hook        enter/exit = the original forward of a non-reentrant region;
                            its pack hook = one saved position (position = len(frame.weak_holders))
    _recomputation_hook     enter/exit = one recompute; its pack hook = recomputed position
    _CheckpointFrame        save_inputs / recompute_fn = the region's inputs in each pass;
                            check_recomputed_tensors_match = torch's own check (may raise)
    CheckpointFunction      reentrant checkpoint: first call of run_function = forward, later = recompute
    _CachingTorchDispatchMode / _CachedTorchDispatchMode   selective AC: saved / served-from-cache ops

Each wrapper calls a method of a listener (the recorder) and then torch's original, unchanged.
Anything missing in the installed torch is skipped with one warning; nothing here raises into torch.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable

import torch
import torch.utils.checkpoint as _cp

from .compiled import is_compiling

FORWARD = "forward"
RECOMPUTE = "recompute"

_REQUIRED = ("_checkpoint_hook", "_recomputation_hook", "_CheckpointFrame")


class ReentrantFrame:
    """Stands in for `_CheckpointFrame` in a reentrant region (which has no frame of its own)."""

    def __init__(self, preserve_rng_state: bool, fn: Any = None) -> None:
        self.preserve_rng_state = preserve_rng_state
        self.calls = 0
        self._ac_diff_fn = fn  # the checkpointed function (see checkpointed_module)


def checkpointed_module(fn: Any) -> tuple[Any, bool]:
    """The nn.Module a checkpointed function runs, and whether its own `__call__` (hooks) runs in the region.

    `checkpoint(block, x)` -> (block, True); `checkpoint(block.forward, x)` and Hugging Face's
    `partial(forward, layer, **kwargs)` (transformers >= 4.5x checkpoints `forward`, not `__call__`) ->
    (module, False): its module hooks fire only outside the region, so in the recompute nothing says
    which module runs unless the recorder puts it on the module stack. (None, True) when unknown.
    """
    for _ in range(4):
        if isinstance(fn, torch.nn.Module):
            return fn, True
        owner = getattr(fn, "__self__", None)
        if isinstance(owner, torch.nn.Module):
            return owner, getattr(fn, "__name__", "") in ("__call__", "_call_impl", "_wrapped_call_impl")
        if not isinstance(fn, functools.partial):
            break
        if fn.args and isinstance(fn.args[0], torch.nn.Module) and not isinstance(fn.func, torch.nn.Module) \
                and getattr(fn.func, "__self__", None) is None:
            return fn.args[0], False  # partial(forward, module, ...)
        fn = fn.func
    return None, True


def sequential_segment(fn: Any) -> tuple[list, int, int] | None:
    """(the modules, first, last) when `fn` is the function `checkpoint_sequential` checkpoints for one
    segment (a closure over them), else None."""
    if not getattr(fn, "__qualname__", "").startswith("checkpoint_sequential.") or not getattr(fn, "__closure__", None):
        return None
    cells = dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__)))
    functions, start, end = cells.get("functions"), cells.get("start"), cells.get("end")
    if isinstance(functions, (list, tuple)) and isinstance(start, int) and isinstance(end, int):
        return list(functions), start, end
    return None


def frame_options(frame: Any) -> dict[str, Any]:
    """What checkpoint() was called with, as far as the frame tells (None where it does not)."""
    if isinstance(frame, ReentrantFrame):
        return {"use_reentrant": True, "preserve_rng_state": frame.preserve_rng_state}
    meta_fn = getattr(frame, "metadata_fn", None)
    default_fn = getattr(_cp, "_default_meta_extractor", None)
    return {
        "use_reentrant": False,
        "early_stop": bool(getattr(frame, "early_stop", True)),
        "determinism_check": "default" if meta_fn is default_fn else "none",
        "preserve_rng_state": _closure_value(getattr(frame, "_ac_diff_recompute_fn", None), "preserve_rng_state"),
    }


def _closure_value(fn: Any, name: str) -> Any:
    code = getattr(fn, "__code__", None)
    if code is None or name not in code.co_freevars or fn.__closure__ is None:
        return None
    try:
        return fn.__closure__[code.co_freevars.index(name)].cell_contents
    except ValueError:  # empty cell
        return None


class CheckpointHooks:
    """Installs the wrappers; `uninstall()` restores torch exactly as it was."""

    def __init__(self, listener: Any) -> None:
        self.listener = listener
        self._restore: list[tuple[Any, str, Any]] = []
        self.warnings: list[str] = []

    # -- install / uninstall ------------------------------------------------------------------
    def install(self) -> list[str]:
        missing = [name for name in _REQUIRED if not hasattr(_cp, name)]
        if missing:
            self._warn(
                f"torch {torch.__version__} has no torch.utils.checkpoint.{', '.join(missing)}: ac-diff cannot "
                "see non-reentrant checkpoint regions in this version (tested with torch 2.4-2.13)"
            )
        else:
            self._patch_non_reentrant()
        if hasattr(_cp, "CheckpointFunction"):
            self._patch_reentrant()
        else:
            self._warn("torch.utils.checkpoint.CheckpointFunction is missing: reentrant regions are not recorded")
        if hasattr(_cp, "_CachingTorchDispatchMode") and hasattr(_cp, "_CachedTorchDispatchMode"):
            self._patch_sac()
        return self.warnings

    def uninstall(self) -> None:
        for owner, name, original in reversed(self._restore):
            if original is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        self._restore = []

    def _warn(self, message: str) -> None:
        self.warnings.append(message)
        warnings.warn(f"ac-diff: {message}", RuntimeWarning, stacklevel=3)

    def _replace(self, owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        original = owner.__dict__.get(name, _ABSENT)
        current = getattr(owner, name)
        self._restore.append((owner, name, original))
        setattr(owner, name, make(current))

    # -- non-reentrant ------------------------------------------------------------------------
    def _patch_non_reentrant(self) -> None:
        listener = self.listener

        def frame_init(original):
            def __init__(frame, recompute_fn, *args, **kwargs):
                original(frame, recompute_fn, *args, **kwargs)
                frame._ac_diff_recompute_fn = recompute_fn
                frame._ac_diff_fn = _closure_value(recompute_fn, "fn")

                def recompute_with_inputs(*inputs):
                    listener.pass_inputs(frame, inputs)
                    return recompute_fn(*inputs)

                frame.recompute_fn = recompute_with_inputs
            return __init__

        def save_inputs(original):
            def wrapper(frame, *args):
                frame._ac_diff_inputs = args
                return original(frame, *args)
            return wrapper

        def check(original):
            def wrapper(frame, gid):
                try:
                    return original(frame, gid)
                except BaseException as exc:
                    listener.check_failed(frame, exc)
                    raise
            return wrapper

        self._replace(_cp._CheckpointFrame, "__init__", frame_init)
        self._replace(_cp._CheckpointFrame, "save_inputs", save_inputs)
        self._replace(_cp._CheckpointFrame, "check_recomputed_tensors_match", check)

        def forward_hook_init(original):
            def __init__(hook, frame, *args, **kwargs):
                original(hook, frame, *args, **kwargs)
                hook._ac_diff_frame = frame
                pack = hook.pack_hook

                def pack_hook(x):
                    if is_compiling():  # Dynamo traces a compiled function in the region: torch's hook only
                        return pack(x)
                    position = len(frame.weak_holders)
                    listener.pack(frame, FORWARD, position, x)
                    return pack(x)

                hook.pack_hook = pack_hook
            return __init__

        def recompute_hook_init(original):
            def __init__(hook, target_frame_ref, gid, *args, **kwargs):
                original(hook, target_frame_ref, gid, *args, **kwargs)
                frame = target_frame_ref()
                hook._ac_diff_frame = frame
                pack = hook.pack_hook

                def pack_hook(x):
                    if is_compiling():  # (as above)
                        return pack(x)
                    target = target_frame_ref()
                    if target is not None:
                        listener.pack(target, RECOMPUTE, target.recomp_counter[gid], x)
                    with listener.internal():  # torch's own detach in this hook is not the region's
                        return pack(x)

                hook.pack_hook = pack_hook
            return __init__

        base = torch.autograd.graph.saved_tensors_hooks

        def enter(phase):
            def make(_):
                def __enter__(hook):
                    result = base.__enter__(hook)
                    listener.enter(hook._ac_diff_frame, phase)
                    return result
                return __enter__
            return make

        def exit_(phase):
            def make(_):
                def __exit__(hook, *exc_info):
                    try:
                        listener.exit(hook._ac_diff_frame, phase, exc_info[1])
                    finally:
                        # always pop torch's hooks, and never swallow the region's own exception
                        base.__exit__(hook, *exc_info)
                return __exit__
            return make

        self._replace(_cp._checkpoint_hook, "__init__", forward_hook_init)
        self._replace(_cp._recomputation_hook, "__init__", recompute_hook_init)
        self._replace(_cp._checkpoint_hook, "__enter__", enter(FORWARD))
        self._replace(_cp._checkpoint_hook, "__exit__", exit_(FORWARD))
        self._replace(_cp._recomputation_hook, "__enter__", enter(RECOMPUTE))
        self._replace(_cp._recomputation_hook, "__exit__", exit_(RECOMPUTE))

    # -- reentrant ----------------------------------------------------------------------------
    def _patch_reentrant(self) -> None:
        listener = self.listener
        fn_cls = _cp.CheckpointFunction
        original_forward = fn_cls.__dict__["forward"]
        original = original_forward.__func__ if isinstance(original_forward, staticmethod) else original_forward

        def forward(ctx, run_function, preserve_rng_state, *args):
            frame = ReentrantFrame(preserve_rng_state, run_function)

            def run_and_record(*inputs):
                phase = FORWARD if frame.calls == 0 else RECOMPUTE
                frame.calls += 1
                listener.enter(frame, phase)
                listener.pass_inputs(frame, inputs)
                exc = None
                try:
                    return run_function(*inputs)
                except BaseException as e:
                    exc = e
                    raise
                finally:
                    listener.exit(frame, phase, exc)

            return original(ctx, run_and_record, preserve_rng_state, *args)

        self._restore.append((fn_cls, "forward", original_forward))
        fn_cls.forward = staticmethod(forward)

    # -- selective activation checkpoint ------------------------------------------------------
    def _patch_sac(self) -> None:
        listener = self.listener
        storage_key = getattr(_cp, "_sac_storage_key", None)
        recompute_marker = getattr(_cp, "_RECOMPUTE", None)

        def caching(original):
            def __torch_dispatch__(mode, func, types, args=(), kwargs=None):
                out = original(mode, func, types, args, kwargs)
                try:
                    key = storage_key(func, args) if storage_key is not None else func
                    entries = mode.storage.get(key)
                    if entries is not None:
                        entry = entries.get(mode.func_counter[key] - 1) if isinstance(entries, dict) else entries[-1]
                        if entry is not None and entry is not recompute_marker:
                            listener.sac_saved(func)
                except Exception:  # an unknown storage layout only costs the "saved" marker
                    pass
                return out
            return __torch_dispatch__

        def cached(original):
            def __torch_dispatch__(mode, func, types, args=(), kwargs=None):
                token = listener.op_count()
                out = original(mode, func, types, args, kwargs)
                if listener.op_count() == token:
                    listener.sac_cached(func, args, kwargs, out)
                return out
            return __torch_dispatch__

        self._replace(_cp._CachingTorchDispatchMode, "__torch_dispatch__", caching)
        self._replace(_cp._CachedTorchDispatchMode, "__torch_dispatch__", cached)


class _Absent:
    def __repr__(self) -> str:
        return "<absent>"


_ABSENT = _Absent()


# -- selective AC policies of a context_fn's modes (for ac_diff.remedies.must_save) -----------------
_SAC_MODES = ("_CachingTorchDispatchMode", "_CachedTorchDispatchMode")


def wrap_sac_policies(contexts: Any, wrap: Callable[[Any], Any]) -> bool:
    """Replace the policy of each selective-AC mode in `contexts` (what `create_selective_checkpoint_contexts`
    returns, fresh per checkpoint call) by `wrap(policy)`. False when the forward context is not such a mode
    (an unknown `context_fn`), and then nothing is changed."""
    if not isinstance(contexts, tuple) or len(contexts) != 2:
        return False
    forward_mode = contexts[0]
    if type(forward_mode).__name__ != _SAC_MODES[0] or not callable(getattr(forward_mode, "policy_fn", None)):
        return False
    for mode in contexts:  # before torch 2.5 the recompute mode asks the policy too
        if type(mode).__name__ in _SAC_MODES and callable(getattr(mode, "policy_fn", None)):
            mode.policy_fn = wrap(mode.policy_fn)
    return True
