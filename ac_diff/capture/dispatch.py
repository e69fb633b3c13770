"""Dispatch: the TorchDispatchMode that hands every aten op to the recorder (the per-op hot path), and
the recorder's own blocks kept out of it.

    mode = RecordingMode(recorder)        # __torch_dispatch__: run the op, then recorder._on_op(...)
                                          # (an op writing in place: recorder.before_write(...) first)
    with InternalBlock(recorder): ...          # the recorder's own ops: not recorded (and the mode popped)
    with no_dispatch_modes(): ...         # no outer mode sees the recorder's reductions
"""

from __future__ import annotations

import contextlib
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .opinfo import op_info


# (named as the method it becomes: frames of `__torch_dispatch__` read as a mode passing an op on, see reference/leaks.py)
def __torch_dispatch__(self, func, types, args=(), kwargs=None):
    """Run the op, then hand it to the recorder. Before an op that writes in place, the recorder fingerprints the
    tensors it holds there (fingerprint.FingerprintBatch): the op is about to change them (OpInfo.before)."""
    before = op_info(func).before
    if _inference_mode_on():
        return _in_inference_mode(self, func, before, args, kwargs)
    recorded = args
    if before is not None:
        recorded = self.recorder.before_write(before, args, kwargs)
    out = func(*args, **(kwargs or {}))
    self._on_op(func, recorded, kwargs, out)
    return out


_inference_mode_on = torch.is_inference_mode_enabled


def _in_inference_mode(mode, func, before, args, kwargs):
    """An op under torch.inference_mode runs so; the recorder's own work runs outside it: tensors made there (its
    fingerprint buffers) would be inference tensors, which nothing may write once the mode is left."""
    recorded = args
    if before is not None:
        with torch.inference_mode(False):
            recorded = mode.recorder.before_write(before, args, kwargs)
    out = func(*args, **(kwargs or {}))
    with torch.inference_mode(False):
        mode._on_op(func, recorded, kwargs, out)
    return out


# `recorder` is a capture.recorder.Recorder: annotated, not imported (the recorder imports this module).
class RecordingMode(TorchDispatchMode):
    """Hands every op to the recorder; never alters arguments or results."""

    def __init__(self, recorder: "Recorder") -> None:
        super().__init__()
        self.recorder = recorder
        self._on_op = recorder._on_op  # bound once: one attribute lookup less per op

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """torch.compile'd code inside a region compiles and runs as without the recorder (compiled.py)."""
        return True

    __torch_dispatch__ = __torch_dispatch__


class UnguardedRecordingMode(RecordingMode):
    """The same handler without the `torch._disable_dynamo` wrapper TorchDispatchMode puts around every
    `__torch_dispatch__` (~0.5 us per op on torch 2.13). Pushed only while Dynamo is not loaded (no compiled
    code can run, so nothing can trace the handler): a region entered without `checkpoint()` (a direct
    `CheckpointFunction.apply`), since `checkpoint()` itself is wrapped by `_disable_dynamo`, which loads Dynamo."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:  # read by TorchDispatchMode.__init_subclass__: do not wrap
        return False

    __torch_dispatch__ = __torch_dispatch__  # (its own attribute: the base class's is the wrapped one)


try:  # private, guarded: without it the recorder's own reductions could be seen by outer modes
    from torch.utils._python_dispatch import _disable_current_modes as _disable_modes
except ImportError:  # pragma: no cover - older torch
    _disable_modes = None


@contextlib.contextmanager
def no_dispatch_modes():
    if _disable_modes is None or not torch._C._len_torch_dispatch_stack():
        yield
    else:
        with _disable_modes():
            yield


_C = torch._C
_CAN_POP_MODE = all(hasattr(_C, n) for n in (
    "_len_torch_dispatch_stack", "_get_dispatch_stack_at", "_pop_torch_dispatch_stack", "_push_on_torch_dispatch_stack"))


class InternalBlock:
    """`Recorder.internal()`: counts nesting in the recorder's thread-local state (re-entrant).

    When the recording mode is the top of the dispatch stack (and only regions are recorded), it is
    also taken off the stack for the block: torch's own detach in each recompute pack hook then costs
    ~1 us instead of a round trip through a Python dispatch mode (~30 us, once per saved tensor)."""

    __slots__ = ("_recorder",)

    def __init__(self, recorder: "Recorder") -> None:
        self._recorder = recorder

    def __enter__(self) -> None:
        recorder = self._recorder
        local = recorder._local
        try:
            local.internal += 1
        except AttributeError:
            recorder._passes()
            local.internal += 1
        popped = None
        if _CAN_POP_MODE and recorder.options.scope != "all":
            n = _C._len_torch_dispatch_stack()
            if n and _C._get_dispatch_stack_at(n - 1) is recorder._mode:
                popped = _C._pop_torch_dispatch_stack(None)
        try:
            local.popped.append(popped)
        except AttributeError:
            local.popped = [popped]

    def __exit__(self, *exc_info) -> None:
        local = self._recorder._local
        popped = local.popped.pop()
        if popped is not None:
            _C._push_on_torch_dispatch_stack(popped)
        local.internal -= 1
