"""State snapshots: what a pass records about the process around it, to compare forward with recompute.

    global_state(mode) -> {"grad_enabled": True, "deterministic": False, "default_dtype": "f32",
                           "matmul_precision": "highest", "sdp_backends": ["flash", "math"],
                           "cudnn.deterministic": True, ...}   (a backend flag only where not at its usual value:
                                                                ac_diff/stateflags.py names them)
    training_mode(module) -> "train" | "eval" | "train except a.drop, b.bn"
    trainable(module) -> "all" | "none" | "none except mlp.up.weight"   (its parameters that require grad)
    module_hooks(module) -> ["act: <lambda> (train.py:34)"]             (the forward hooks on its modules)
    rng_digest() -> "9f2c4e1a0b7d3c55"    (CPU and, once initialised, CUDA generator states)
    host_draws(host_rng_states() at a pass's start, at its end) -> ["random"]   (the host generators it drew from)
    argument_items((x, mems)) -> {"input[1]": {"type": "list", "len": 2, "ids": 3240967713}}   (a list argument)
"""

from __future__ import annotations

import collections
import contextlib
import weakref
import hashlib
import random
import sys
from typing import Any

import torch

from .fqn import clean_fqn
from .opinfo import short_dtype
from .pystate import container_summary, forward_hooks
from .torch_compat import matmul_precision
from ..stateflags import BACKEND_FLAGS

# torch's own getters of the backend flags, called directly (through torch.backends each read is a Python __getattr__,
# 7x slower)
_GETTERS = [(key, getattr(torch._C, getter), usual) for key, (getter, usual) in BACKEND_FLAGS.items()
            if hasattr(torch._C, getter)]


def autocast_dtypes() -> dict[str, torch.dtype]:
    """The devices autocast is on for now (the CPU, a GPU), with the dtype it casts to."""
    on = {}
    for device in ("cpu", "cuda"):
        with contextlib.suppress(Exception):  # (a build or torch without that device's autocast)
            if torch.is_autocast_enabled(device):
                on[device] = torch.get_autocast_dtype(device)
    return on


def autocast_on() -> bool:
    """Whether autocast is on now, on the CPU or a GPU."""
    return bool(autocast_dtypes())


def global_state(own_mode: Any) -> dict[str, Any]:
    """Process-wide settings that change what ops compute (the recorder's own dispatch mode left out)."""
    state: dict[str, Any] = {
        "grad_enabled": torch.is_grad_enabled(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "default_dtype": short_dtype(torch.get_default_dtype()),
        "num_threads": torch.get_num_threads(),  # (a CPU reduction splits its sum by thread)
    }
    precision = matmul_precision()
    if precision is not None:
        state["matmul_precision"] = precision
    with contextlib.suppress(Exception):  # sdpa_kernel(...) flips these process-wide flags
        b = torch.backends.cuda
        state["sdp_backends"] = [name for name, on in (
            ("flash", b.flash_sdp_enabled()), ("mem_efficient", b.mem_efficient_sdp_enabled()),
            ("math", b.math_sdp_enabled()), ("cudnn", b.cudnn_sdp_enabled())) if on]
    for key, get, usual in _GETTERS:  # (~60 ns each)
        try:
            value = get()
        except Exception:  # noqa: BLE001 - a build without the backend: nothing to read
            continue
        if type(value) is tuple:  # the reduced-precision getters (torch >= 2.10): (allowed, allowed with split-K)
            value = value[0]
        if value != usual:
            state[key] = value
    for device, dtype in autocast_dtypes().items():
        state[f"autocast_{device}"] = short_dtype(dtype)
    with contextlib.suppress(Exception):
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

        # (ac-diff's own modes are not the script's: the reference run's watch around reentrant forwards, ...)
        modes = [type(m).__name__ for m in _get_current_dispatch_mode_stack()
                 if m is not own_mode and not type(m).__module__.startswith("ac_diff.")]
        if modes:
            state["dispatch_modes"] = modes
    with contextlib.suppress(Exception):
        from torch.overrides import _get_current_function_mode_stack

        fmodes = [type(m).__name__ for m in _get_current_function_mode_stack()]
        if fmodes:
            state["function_modes"] = fmodes
    return state


_inner_modules: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> [(name, submodule)]
_parameters: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> [(name, parameter)]


def _listed(module: torch.nn.Module) -> list:
    """[(name, submodule)] of `module` and every module inside it, listed once per module (named_modules() costs
    ~40 us for an MoE block, per pass)."""
    inner = _inner_modules.get(module)
    if inner is None:
        inner = _inner_modules[module] = [(clean_fqn(name), m) for name, m in module.named_modules()]
    return inner


_MUTABLE_ARGUMENTS = (list, dict, set, collections.deque)


def argument_items(args: tuple) -> dict[str, dict]:
    """What each mutable container among a region's arguments held as its pass began, summarized as a module's
    container attributes are (`pystate.container_summary`: its type, length and a digest of its first items, tensors by
    identity): {"input[1]": {"type": "list", "len": 2, "ids": 3240967713}}. checkpoint keeps the object for the
    recompute, not a copy, so a caller that appends to a list of memories it passed, or replaces an item, after the
    forward, changes what the recompute reads."""
    return {f"input[{i}]": container_summary(arg) for i, arg in enumerate(args) if type(arg) in _MUTABLE_ARGUMENTS}


def training_mode(module: torch.nn.Module) -> str:
    """"train", "eval", or "train except a.drop, b.bn" / "eval except ...": the modes of the region's
    modules (`model.eval()` between the forward and backward flips what batch norm and dropout do)."""
    with contextlib.suppress(Exception):
        root = module.training
        # (a wrapper: its name)
        others = list(dict.fromkeys(name for name, m in _listed(module) if m is not module and m.training is not root))
        return ("train" if root else "eval") + _except(others)
    return "?"


def _named_parameters(module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The module's parameters by name, listed once per module (as `_listed`; ~1 us a pass for a decoder layer)."""
    params = _parameters.get(module)
    if params is None:
        params = _parameters[module] = [(clean_fqn(name), p) for name, p in module.named_parameters()]
    return params


def requiring_grad(module: torch.nn.Module) -> int:
    """How many of the module's parameters require grad (more in a reentrant recompute than in its forward: unfrozen
    in between, and the backward runs on the recompute's graph)."""
    with contextlib.suppress(Exception):
        return sum(p.requires_grad for _, p in _named_parameters(module))
    return 0


def trainable(module: torch.nn.Module) -> str:
    """"all", "none", or "all except a.weight" / "none except b.bias": which of the region's parameters require grad
    (frozen or unfrozen between the forward and the backward, the recompute saves other tensors)."""
    with contextlib.suppress(Exception):
        params = _named_parameters(module)
        flags = [p.requires_grad for _, p in params]
        needing = sum(flags)
        if not flags:
            return "-"
        most = needing * 2 >= len(flags)
        return ("all" if most else "none") + ("" if needing in (0, len(flags)) else
                                              _except([name for name, p in params if p.requires_grad is not most]))
    return "?"


def module_hooks(module: torch.nn.Module) -> list[str]:
    """The forward hooks and pre-hooks on the region's modules, as "act: <lambda> (train.py:34)": a hook registered
    (or removed) between the forward and the backward runs in one pass only."""
    with contextlib.suppress(Exception):
        return [f"{name or '(the region)'}: {_hook_label(hook)}" for name, m in _listed(module)
                for _, hook in forward_hooks(m)]
    return []


def callable_name(fn: Any) -> str:
    """`OffloadPool.pack` for a bound method or a function (less the `<locals>` path of one defined in a function:
    `<lambda>`), the type's name for anything else (a partial)."""
    name = getattr(fn, "__qualname__", None)
    return name.rsplit("<locals>.", 1)[-1] if isinstance(name, str) else type(fn).__name__


def _hook_label(hook: Any) -> str:
    name = callable_name(hook)
    code = getattr(hook, "__code__", None)
    return f"{name} ({code.co_filename.rsplit('/', 1)[-1]}:{code.co_firstlineno})" if code is not None else name


def _except(names: list[str]) -> str:
    return (" except " + ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
            if names else "")


def host_rng_states() -> tuple:
    """Where the host's own generators stand (Python's `random`, numpy's global one once imported): compared at a
    pass's end with its start, they say whether the region drew host random numbers, which preserve_rng_state does
    not restore (a LayerDrop's `random.random() < p`)."""
    states: list = []
    with contextlib.suppress(Exception):
        states.append(("random", hash(random.getstate())))
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        with contextlib.suppress(Exception):
            states.append(("numpy.random", *_numpy_state(numpy_random.get_state())))
    return tuple(states)


def _numpy_state(state: tuple) -> tuple:
    """A numpy RandomState's `get_state()`, comparable and small: the key's digest, and the position in it (a draw
    moves the position, the key only every 624 words)."""
    _, key, position, has_gauss, gauss = state
    return hashlib.blake2b(key.tobytes(), digest_size=8).hexdigest(), position, has_gauss, gauss


def generator_state(value: Any) -> Any:
    """Where a host generator object stands (a `random.Random`, numpy's `RandomState` or `Generator`, as a module
    keeps one for its own draws), as a comparable digest; None for anything else."""
    if isinstance(value, random.Random):
        return hash(value.getstate())
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is None:
        return None
    if isinstance(value, numpy_random.RandomState):
        return _numpy_state(value.get_state())
    if isinstance(value, numpy_random.Generator):
        return repr(value.bit_generator.state)
    return None


def host_draws(before: tuple, after: tuple) -> list[str]:
    """The host generators that moved between two `host_rng_states()`: ["random"], ["numpy.random"], ..."""
    start = {name: tuple(state) for name, *state in before}
    return [name for name, *state in after if name in start and start[name] != tuple(state)]


def rng_digest() -> str:
    h = hashlib.blake2b(digest_size=8)
    h.update(torch.get_rng_state().numpy().tobytes())
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        with contextlib.suppress(Exception):
            h.update(torch.cuda.get_rng_state().numpy().tobytes())
    return h.hexdigest()
