"""The one version-aware place that knows how each torch release spells the checkpoint internals ac-diff uses.

There is no public API that says "this op runs in the original forward of region 7" or "this tensor
is saved at position 46", so `CheckpointHooks` wraps the private classes that know (this table):

    _checkpoint_hook        enter/exit = the original forward of a non-reentrant region;
                            its pack hook = one saved position (position = len(frame.weak_holders))
    _recomputation_hook     enter/exit = one recompute; its pack hook = recomputed position
    _CheckpointFrame        __init__ / recompute_fn = the region and its inputs in the recompute;
                            check_recomputed_tensors_match = torch's own check (may raise)
    region inputs (forward) `_CheckpointFrame.save_inputs` (torch >= 2.12), or
                            `_NoopSaveInputs.apply(dummy, kwargs, *args)` (2.4-2.11, right after the frame)
    CheckpointFunction      reentrant checkpoint: first call of run_function = forward, later = recompute
    _CachingTorchDispatchMode / _CachedTorchDispatchMode   selective AC: saved / served-from-cache ops
                            (storage: a list per op (<= 2.12) or a dict by call index (>= 2.13))
    _StopRecomputationError early stop ends a recompute with it (not a failure)
    pack_hook attributes    torch >= 2.14 marks its own hooks (`_checkpoint_internal`) to tell them from a user's
                            saved_tensors_hooks around a selective-AC region: the wrapped hooks keep the marks

Each release is told apart by probing for the feature (a method, a closure variable), never by its
version string. Each wrapper calls a method of a listener (the recorder) and then torch's original,
unchanged. What the installed torch lacks runs in a reduced mode with one warning line naming it
(`CheckpointHooks.install()` returns them; `REDUCED_MODES` lists every one); nothing here raises into torch.

    hooks = CheckpointHooks(recorder); hooks.install()   # -> [] on torch 2.4 .. 2.14
    ...                                                 # listener.enter/pack/exit/... calls
    hooks.uninstall()                                   # torch exactly as it was
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import warnings
from typing import Any, Callable

import torch
import torch.utils.checkpoint as _cp

from .compiled import is_compiling

FORWARD = "forward"
RECOMPUTE = "recompute"

_REQUIRED = ("_checkpoint_hook", "_recomputation_hook", "_CheckpointFrame")
_dispatch_stack_len = torch._C._len_torch_dispatch_stack  # (in every supported release)

# The exception early stop ends a recompute with (every release since 2.1; () matches nothing).
STOP_RECOMPUTATION: Any = getattr(_cp, "_StopRecomputationError", ())

# What each reduced mode costs; `install()` warns with these words when the installed torch lacks a mechanism.
REDUCED_MODES = {
    "no_frame": "ac-diff cannot see non-reentrant checkpoint regions",
    "no_input_saver": "a region's inputs are not named (both passes read them as outside tensors)",
    "no_reentrant": "reentrant regions are not recorded",
    "no_sac_modes": "ops that selective AC saves or serves from its cache are not marked",
}


class ReentrantFrame:
    """Stands in for `_CheckpointFrame` in a reentrant region (which has no frame of its own)."""

    def __init__(self, preserve_rng_state: bool, fn: Any = None, lost_grad: int | None = None,
                 grad_enabled: bool = True) -> None:
        self.preserve_rng_state = preserve_rng_state
        self.grad_enabled = grad_enabled  # at the checkpoint() call (its forward then runs under no_grad)
        self.calls = 0
        self._ac_diff_fn = fn  # the checkpointed function (see checkpointed_module)
        # called with grad enabled and no input that requires grad: its output needs no backward, so the
        # parameters it holds get no gradient from it; how many of them require grad (None: not a module)
        self.lost_grad = lost_grad


def no_grad_inputs(fn: Any, args: tuple, grad_enabled: bool) -> int | None:
    """For a reentrant checkpoint called with `args`: where grad was enabled at the call and no input requires grad,
    the number of the checkpointed module's parameters that do (they get no gradient through it: torch only warns
    "None of the inputs have requires_grad=True"); -1 where the function is no module; else None."""
    if not grad_enabled:
        return None
    lost = parameters_losing_grad(fn, args)
    return None if lost is None else -1 if lost[0] is None else len(lost[1])


def parameters_losing_grad(fn: Any, args: Any) -> tuple[Any, list[str]] | None:
    """A reentrant checkpoint of `fn` called with `args` under grad mode: where no tensor argument requires grad (torch
    looks at the arguments themselves, not into containers), (the checkpointed module or None, the names of its parameters that require grad: no
    gradient reaches them through the region); else None."""
    if any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        return None
    module, _ = checkpointed_module(fn)
    return module, [] if module is None else [n for n, p in module.named_parameters() if p.requires_grad]


def checkpointed_module(fn: Any) -> tuple[Any, bool]:
    """The nn.Module a checkpointed function runs, and whether its own `__call__` (hooks) runs in the region.

    `checkpoint(block, x)` -> (block, True), (block, False) after `block.compile()`; `checkpoint(block.forward, x)`
    and Hugging Face's `partial(forward, layer, **kwargs)` (transformers >= 4.5x checkpoints `forward`) ->
    (module, False): its module hooks fire only outside the region, so in the recompute nothing says
    which module runs unless the recorder puts it on the module stack. (None, True) when unknown.
    """
    fn = getattr(fn, "_ac_diff_checkpointed", fn)  # a remedy's wrapper (remedies/restore.py)
    for _ in range(4):
        if isinstance(fn, torch.nn.Module):  # (`module.compile()`: its call runs the compiled code, not its hooks)
            return fn, getattr(fn, "_compiled_call_impl", None) is None
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


def innermost_function(fn: Any) -> Any:
    """The function a checkpointed callable runs, through a remedy's wrapper and `functools.partial` wrappers
    (`partial(layer_fn, hparams)` -> layer_fn)."""
    fn = getattr(fn, "_ac_diff_checkpointed", fn)
    for _ in range(4):
        if not isinstance(fn, functools.partial):
            break
        fn = fn.func
    return fn


def function_name(fn: Any) -> str | None:
    """The name a checkpointed function is known by (innermost_function's `__qualname__`: "layer_fn"); None for a
    lambda and for what has no name."""
    fn = innermost_function(fn)
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    return name if isinstance(name, str) and "<lambda>" not in name else None


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
        return {"use_reentrant": True, "preserve_rng_state": frame.preserve_rng_state,
                **({"no_grad_inputs": frame.lost_grad} if frame.lost_grad is not None else {}),
                **({} if frame.grad_enabled else {"no_grad_call": True})}  # (an evaluation pass: no backward)
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
        self._pending = threading.local()  # the frame whose inputs torch <= 2.11 saves next

    # -- install / uninstall ------------------------------------------------------------------
    def install(self) -> list[str]:
        missing = [name for name in _REQUIRED if not hasattr(_cp, name)]
        if missing:
            self._reduced("no_frame", missing)
        else:
            self._patch_non_reentrant()
        if hasattr(_cp, "CheckpointFunction"):
            self._patch_reentrant()
        else:
            self._reduced("no_reentrant", ["CheckpointFunction"])
        if all(hasattr(_cp, name) for name in _SAC_MODES):
            self._patch_sac()
        elif _has_sac_api():  # a release with SAC but other mode classes
            self._reduced("no_sac_modes", [name for name in _SAC_MODES if not hasattr(_cp, name)])
        return self.warnings

    def uninstall(self) -> None:
        for owner, name, original in reversed(self._restore):
            if original is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        self._restore = []

    def _reduced(self, mode: str, missing: list[str]) -> None:
        names = ", ".join(f"torch.utils.checkpoint.{name}" for name in missing)
        self._warn(f"torch {torch.__version__} has no {names}: reduced mode {mode}: {REDUCED_MODES[mode]}")

    def _warn(self, message: str) -> None:
        self.warnings.append(message)
        warnings.warn(f"ac-diff: {message}", RuntimeWarning, stacklevel=4)

    def _replace(self, owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        original = owner.__dict__.get(name, _ABSENT)
        current = getattr(owner, name)
        self._restore.append((owner, name, original))
        setattr(owner, name, make(current))

    # -- non-reentrant ------------------------------------------------------------------------
    def _patch_non_reentrant(self) -> None:
        listener = self.listener
        pending = self._pending
        frame_cls = _cp._CheckpointFrame
        saver = input_saver()

        def frame_init(original):
            def __init__(frame, recompute_fn, *args, **kwargs):
                original(frame, recompute_fn, *args, **kwargs)
                frame._ac_diff_recompute_fn = recompute_fn
                frame._ac_diff_fn = _closure_value(recompute_fn, "fn")
                # torch <= 2.11 passes (kwargs, *args) to recompute_fn; later ones keep kwargs in its closure
                code = getattr(recompute_fn, "__code__", None)
                skip = 1 if code is not None and "kwargs" not in code.co_freevars else 0

                def recompute_with_inputs(*inputs):
                    if saver is not None:  # else neither pass names them: the two passes still agree
                        listener.pass_inputs(frame, inputs[skip:])
                    return recompute_fn(*inputs)

                frame.recompute_fn = recompute_with_inputs
                if saver == "noop":
                    pending.frame = frame  # its input saver runs next, in this thread
            return __init__

        def save_inputs(original):
            def wrapper(frame, *args):
                frame._ac_diff_inputs = args
                frame._ac_diff_saved_hooks = saved_tensors_hooks_now()
                return original(frame, *args)
            return wrapper

        def noop_save_inputs(original):  # torch 2.4-2.11: _NoopSaveInputs.apply(dummy, kwargs, *args)
            def apply(*args):
                frame, pending.frame = getattr(pending, "frame", None), None
                if frame is not None:
                    frame._ac_diff_inputs = args[2:]
                    frame._ac_diff_saved_hooks = saved_tensors_hooks_now()
                return original(*args)
            return staticmethod(apply)

        def check(original):
            def wrapper(frame, gid):
                try:
                    return original(frame, gid)
                except BaseException as exc:
                    listener.check_failed(frame, exc)
                    raise
            return wrapper

        self._replace(frame_cls, "__init__", frame_init)
        if saver == "save_inputs":
            self._replace(frame_cls, "save_inputs", save_inputs)
        elif saver == "noop":
            self._replace(_cp._NoopSaveInputs, "apply", noop_save_inputs)
        else:
            self._reduced("no_input_saver", ["_CheckpointFrame.save_inputs", "_NoopSaveInputs"])
        self._replace(frame_cls, "check_recomputed_tensors_match", check)

        def forward_hook_init(original):
            def __init__(hook, frame, *args, **kwargs):
                original(hook, frame, *args, **kwargs)
                hook._ac_diff_frame = frame
                pack, unpack = hook.pack_hook, hook.unpack_hook

                def pack_hook(x):
                    if is_compiling():  # Dynamo traces a compiled function in the region: torch's hook only
                        return pack(x)
                    position = len(frame.weak_holders)
                    listener.pack(frame, FORWARD, position, x)
                    holder = pack(x)
                    with contextlib.suppress(AttributeError):  # (which saved tensor a backward reads: `unpack_hook`)
                        holder._ac_diff_position = position
                    return holder

                def unpack_hook(holder):
                    position = getattr(holder, "_ac_diff_position", None)
                    if position is not None:
                        with contextlib.suppress(Exception):  # (nothing here raises into torch)
                            read(frame, position)
                    return unpack(holder)

                hook.pack_hook = _as_torch_hook(pack_hook, pack)
                read = getattr(listener, "unpacked", None)  # (a listener that asks which saved tensors are read)
                if read is not None:
                    hook.unpack_hook = _as_torch_hook(unpack_hook, unpack)
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
                    if not _dispatch_stack_len():  # no mode to hide it from (a watched pass)
                        return pack(x)
                    with listener.internal():  # torch's own detach in this hook is not the region's
                        return pack(x)

                hook.pack_hook = _as_torch_hook(pack_hook, pack)
            return __init__

        # torch's own __enter__/__exit__ (saved_tensors_hooks', or from 2.14 _checkpoint_internal_hook's, which
        # records the user's hooks around the region for selective AC)
        def enter(phase):
            def make(original):
                def __enter__(hook):
                    result = original(hook)
                    listener.enter(hook._ac_diff_frame, phase)
                    return result
                return __enter__
            return make

        def exit_(phase):
            def make(original):
                def __exit__(hook, *exc_info):
                    try:
                        listener.exit(hook._ac_diff_frame, phase, exc_info[1])
                    finally:
                        # always pop torch's hooks, and never swallow the region's own exception
                        original(hook, *exc_info)
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
        pending = self._pending
        fn_cls = _cp.CheckpointFunction
        original_forward = fn_cls.__dict__["forward"]
        original = original_forward.__func__ if isinstance(original_forward, staticmethod) else original_forward

        def forward(ctx, run_function, preserve_rng_state, *args):
            grad_enabled, pending.grad_enabled = getattr(pending, "grad_enabled", None) is not False, None
            frame = ReentrantFrame(preserve_rng_state, run_function, no_grad_inputs(run_function, args, grad_enabled),
                                   grad_enabled)

            def run_and_record(*inputs):
                phase = FORWARD if frame.calls == 0 else RECOMPUTE
                frame.calls += 1
                listener.enter(frame, phase)
                listener.pass_inputs(frame, inputs)
                exc = None
                try:
                    out = run_function(*inputs)
                    listener.pass_outputs(frame, phase, out)
                    return out
                except BaseException as e:
                    exc = e
                    raise
                finally:
                    listener.exit(frame, phase, exc)

            return original(ctx, run_and_record, preserve_rng_state, *args)

        self._restore.append((fn_cls, "forward", original_forward))
        fn_cls.forward = staticmethod(forward)

        def apply(original):  # the grad mode at the call (its forward runs under no_grad, whatever the caller's)
            def wrapper(cls, *args, **kwargs):
                pending.grad_enabled = torch.is_grad_enabled()
                return original(*args, **kwargs)
            return classmethod(wrapper)

        self._replace(fn_cls, "apply", apply)

    # -- selective activation checkpoint ------------------------------------------------------
    def _patch_sac(self) -> None:
        listener = self.listener
        storage_key = getattr(_cp, "_sac_storage_key", None)
        recompute_marker = getattr(_cp, "_RECOMPUTE", None)

        def stored(mode, func, args):
            """How many of `func`'s outputs the storage holds, or for a dict by call index (torch >= 2.13) whether
            the last call's entry is a saved output."""
            key = storage_key(func, args) if storage_key is not None else func
            entries = mode.storage.get(key)
            if isinstance(entries, dict):
                entry = entries.get(mode.func_counter[key] - 1)
                return entry is not None and entry is not recompute_marker
            return len(entries) if entries is not None else 0

        def caching(original):
            def __torch_dispatch__(mode, func, types, args=(), kwargs=None):
                try:
                    before = stored(mode, func, args)
                except Exception:
                    before = None
                out = original(mode, func, types, args, kwargs)
                try:
                    after = stored(mode, func, args)
                    if after is True or (before is not None and after is not True and after > before):
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


_ENGINE_ENTRIES = frozenset({"_engine_run_backward", "backward", "grad"})  # torch.autograd's Python entries


_GRAPH_TASK_ID = getattr(torch._C, "_current_graph_task_id", None)  # (looked up once: read at every recompute)


def graph_task_id() -> int | None:
    """The backward pass running now (autograd's graph task: one per backward() or autograd.grad() call, the same for
    every node it runs, a reentrant recompute's too), None outside one or where torch has no such getter."""
    if _GRAPH_TASK_ID is None:
        return None
    try:
        task = _GRAPH_TASK_ID()
    except Exception:  # noqa: BLE001 - a build whose getter fails: the backward is not told
        return None
    return task if task >= 0 else None


_CURRENT_NODE = getattr(torch._C, "_current_autograd_node", None)
_WILL_EXECUTE = getattr(torch._C, "_will_engine_execute_node", None)


def gradients_computed() -> tuple[str, frozenset[int]] | None:
    """Which of its inputs' gradients the autograd node running now (one unpacking a saved tensor for its formula)
    computes in this backward, where not all of them: (node name, their indexes among its `next_functions`).
    `torch.autograd.grad(loss, x)` runs a linear's MmBackward0 for x's gradient alone, and the saved input, which
    only the weight's gradient reads, is unpacked all the same. None where it computes all of them, or where torch
    cannot say (outside a backward, a build without these getters)."""
    if _CURRENT_NODE is None or _WILL_EXECUTE is None:
        return None
    try:
        node = _CURRENT_NODE()
        if node is None:
            return None
        edges = node.next_functions
        computed = frozenset(i for i, (fn, _) in enumerate(edges) if fn is not None and _computes(fn))
        return None if len(computed) == len(edges) else (node.name(), computed)
    except Exception:  # noqa: BLE001 - a build whose getters fail: every gradient counts as computed
        return None


def _computes(fn: Any) -> bool:
    try:
        return bool(_WILL_EXECUTE(fn))
    except RuntimeError:  # (the leaf of an input `autograd.grad` asked for: torch will not say; it is computed)
        return True


def outside_backward() -> bool:
    """True only where torch says no backward runs now (False also where it cannot say)."""
    try:
        return _GRAPH_TASK_ID is not None and _GRAPH_TASK_ID() < 0
    except Exception:  # noqa: BLE001 - a build whose getter fails: it cannot say
        return False


def left_a_backward(exc: BaseException) -> bool:
    """Whether `exc` unwound out of torch's autograd engine: raised by a hook or a recompute while `loss.backward()`
    or `torch.autograd.grad()` ran (its traceback keeps the Python frames that called into the engine)."""
    autograd_dir = os.path.dirname(torch.autograd.__file__) + os.sep
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_name in _ENGINE_ENTRIES and code.co_filename.startswith(autograd_dir):
            return True
        tb = tb.tb_next
    return False


def raised_in_checkpoint(exc: BaseException) -> bool:
    """Whether `exc` came out of torch.utils.checkpoint's own code (a checkpoint() call torch refused: under
    torch.func.grad, "don't yet support saved tensor hooks"), whatever called it."""
    path = os.path.normcase(os.path.abspath(torch.utils.checkpoint.__file__))
    tb = exc.__traceback__
    while tb is not None:
        if os.path.normcase(os.path.abspath(tb.tb_frame.f_code.co_filename)) == path:
            return True
        tb = tb.tb_next
    return False


def _as_torch_hook(wrapper: Callable, original: Callable) -> Callable:
    """`wrapper` carries `original`'s name and attributes: torch >= 2.14 tells its own checkpoint hooks from a
    user's saved_tensors_hooks by `pack_hook._checkpoint_internal`, and warns about a user's hook around a
    selective-AC region (a FutureWarning the user did not cause) when the wrapper lacks it."""
    return functools.update_wrapper(wrapper, original)


def saved_tensors_hooks_now() -> tuple[Any, Any] | None:
    """(pack, unpack) of the innermost `torch.autograd.graph.saved_tensors_hooks` active now, or None: the hooks a
    non-reentrant checkpoint keeps its region's inputs through (an offload pool, a compression of activations)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:  # (torch <= 2.7: the cause then names no hook, only that the kept input came back changed)
        return None
    try:
        hooks = top(False)
    except TypeError:
        hooks = top()
    except RuntimeError:
        return None
    if not (isinstance(hooks, tuple) and len(hooks) == 2 and hooks[0] is not None):
        return None
    # (an enclosing checkpoint's own hooks, around a nested region: not the user's)
    return None if getattr(hooks[0], "__module__", "") == _cp.__name__ else hooks


def input_saver() -> str | None:
    """How this torch keeps a non-reentrant region's inputs for its recompute: "save_inputs" (a frame method,
    torch >= 2.12), "noop" (`_NoopSaveInputs.apply(dummy, kwargs, *args)` right after the frame, 2.4-2.11) or None."""
    if hasattr(_cp._CheckpointFrame, "save_inputs"):
        return "save_inputs"
    return "noop" if hasattr(getattr(_cp, "_NoopSaveInputs", None), "apply") else None


def dynamo_traces_through(replacement: Callable) -> Callable[[], None] | str:
    """Have Dynamo trace `replacement` (ac-diff's checkpoint(), installed as torch.utils.checkpoint.checkpoint) as
    Python code instead of taking it for torch's checkpoint operator, which it tells by identity with that attribute
    (torch._dynamo.utils.is_utils_checkpoint): the reference's "AC off" then reaches code torch.compile traces, where
    it was traced as AC on. Returns what undoes it, or one warning where this torch has no such test."""
    try:
        import torch._dynamo.utils as dynamo_utils
        from torch._dynamo.variables import builder
    except Exception as exc:  # (a torch whose Dynamo fails to import: nothing compiles either)
        return f"Dynamo could not be prepared for the run without AC ({type(exc).__name__}: {exc})"
    original = getattr(dynamo_utils, "is_utils_checkpoint", None)
    if original is None:
        return ("this torch's Dynamo has no is_utils_checkpoint: torch.compile'd code may keep AC in the run without "
                "AC")

    def is_utils_checkpoint(obj: Any) -> bool:
        return obj is not replacement and original(obj)

    owners = [m for m in (dynamo_utils, builder) if getattr(m, "is_utils_checkpoint", None) is original]
    for m in owners:
        m.is_utils_checkpoint = is_utils_checkpoint

    def undo() -> None:
        for m in owners:
            m.is_utils_checkpoint = original
    return undo


def _has_sac_api() -> bool:
    return hasattr(_cp, "create_selective_checkpoint_contexts") or hasattr(_cp, "_pt2_selective_checkpoint_context_fn_gen")


class _Absent:
    def __repr__(self) -> str:
        return "<absent>"


_ABSENT = _Absent()


# -- selective AC policies of a context_fn's modes (for ac_diff.remedies.must_save) -----------------
_SAC_MODES = ("_CachingTorchDispatchMode", "_CachedTorchDispatchMode")


def sac_policy_answers() -> tuple[Any, Any]:
    """(save, recompute) as this torch's selective-AC policy answers them: `CheckpointPolicy.MUST_SAVE` /
    `PREFER_RECOMPUTE` (torch >= 2.5), True / False before (a policy then returns whether to save)."""
    policy = getattr(_cp, "CheckpointPolicy", None)
    if policy is not None:
        return policy.MUST_SAVE, policy.PREFER_RECOMPUTE
    return True, False


def selective_contexts(policy_fn: Callable) -> Any:
    """The (forward, recompute) context pair of a selective-AC region deciding by `policy_fn`:
    `create_selective_checkpoint_contexts` (torch >= 2.5) or `_pt2_selective_checkpoint_context_fn_gen` (2.4)."""
    create = getattr(_cp, "create_selective_checkpoint_contexts", None)
    if create is not None:
        return create(policy_fn)
    return _cp._pt2_selective_checkpoint_context_fn_gen(policy_fn)


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


_flatten_dense = getattr(getattr(torch._C, "_nn", None), "flatten_dense_tensors", None)


def version_of(t: torch.Tensor) -> int:
    """A tensor's version counter (`t._version`: how many in-place writes it has had), or -1 for an inference tensor
    (made under torch.inference_mode, which keeps none: reading it raises); such a tensor is never written outside
    inference mode, so one constant is its version."""
    try:
        return t._version
    except RuntimeError:
        return -1


def flatten_dense(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Contiguous tensors of one dtype as one flat tensor (one C++ call, one copy; one tensor: a view of it), as
    torch's own `_flatten_dense_tensors` (DDP's buckets) does."""
    if _flatten_dense is not None:
        return _flatten_dense(tensors)
    return torch.cat([t.reshape(-1) for t in tensors]) if len(tensors) > 1 else tensors[0].reshape(-1)


# The float32 matmul precision: per backend ("cuda", "mkldnn": a CPU with bf16 or AMX units runs fp32 matmuls in
# bfloat16 under "medium") where torch has the fp32_precision settings (>= 2.9); one legacy setting before.
_PRECISION_GET = getattr(torch._C, "_get_fp32_precision_getter", None)
_PRECISION_SET = getattr(torch._C, "_set_fp32_precision_setter", None)
_MATMUL_BACKENDS = ("cuda", "mkldnn")
_EXACT = ("ieee", "none")  # (per backend: "none" takes its parent's, "ieee" unless set otherwise: then it reads so)


def matmul_precision() -> str | None:
    """The float32 matmul precision as the script set it: "highest" / "high" / "medium", or per backend where it
    was set through the per-backend settings, which the legacy getter refuses to read ("cuda: tf32, mkldnn: bf16",
    "ieee" where exact); None where this torch says nothing."""
    try:
        return torch.get_float32_matmul_precision()
    except RuntimeError:  # (the legacy and the per-backend settings were mixed)
        pass
    if _PRECISION_GET is None:
        return None
    try:
        return ", ".join(f"{b}: {_PRECISION_GET(b, 'matmul')}" for b in _MATMUL_BACKENDS)
    except RuntimeError:
        return None


class ExactMatmuls:
    """`with EXACT_MATMULS:` ac-diff's own matmuls (a fingerprint's weighted row sums) run in full float32 precision
    whatever the script set, and its settings are back as they were after: a fingerprint must be the same function
    of the values in a forward and in a recompute run after the script changed the precision. Costs two getter calls
    where the precision is exact already (the usual case: nothing is set). The settings are process-wide: for the
    microseconds of the fingerprint another thread's float32 matmul would run exact too, hence only CPU tensors'
    fingerprints use it (a GPU's fused kernels and float32 matrix-vector products use no reduced-precision units)."""

    def __init__(self) -> None:
        self._changed: list[tuple[str, str]] = []
        self._legacy: str | None = None
        self._depth = 0

    def __enter__(self) -> None:
        self._depth += 1
        if self._depth > 1:
            return
        if _PRECISION_GET is not None and _PRECISION_SET is not None:
            for backend in _MATMUL_BACKENDS:
                try:
                    value = _PRECISION_GET(backend, "matmul")
                    if value not in _EXACT:
                        _PRECISION_SET(backend, "matmul", "ieee")
                        self._changed.append((backend, value))
                except RuntimeError:  # (a backend this build lacks)
                    continue
            return
        value = torch.get_float32_matmul_precision()
        if value != "highest":
            self._legacy = value
            torch.set_float32_matmul_precision("highest")

    def __exit__(self, *exc: Any) -> None:
        self._depth -= 1
        if self._depth:
            return
        for backend, value in reversed(self._changed):
            _PRECISION_SET(backend, "matmul", value)
        self._changed = []
        if self._legacy is not None:
            torch.set_float32_matmul_precision(self._legacy)
            self._legacy = None


EXACT_MATMULS = ExactMatmuls()
