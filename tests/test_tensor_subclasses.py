"""Wrapper tensor subclasses (`_make_wrapper_subclass`: no storage of their own) flowing through checkpointed
regions: a simulated-precision wrapper whose `__torch_dispatch__` rounds each op's output to `bits` bits, as a
precision sweep does. The recorder failed on them ("Attempted to access the data pointer on an invalid python
storage", then ".tolist() is not supported for tensor subclasses") and every region read NOTHING CHECKED. Now
their values are measured through the plain tensor they wrap, the training is unchanged, a control is clean, and the
class attribute their dispatch reads, changed between the forward and the backward, is the cause."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint as cp
from torch.utils._pytree import tree_map

import ac_diff


class SimLowPrec(torch.Tensor):
    bits = 16

    @staticmethod
    def __new__(cls, elem):
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype, device=elem.device,
                                                   strides=elem.stride(), requires_grad=elem.requires_grad)

    def __init__(self, elem):
        self.elem = elem

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        out = func(*tree_map(lambda t: t.elem if isinstance(t, SimLowPrec) else t, args),
                   **tree_map(lambda t: t.elem if isinstance(t, SimLowPrec) else t, kwargs or {}))

        def wrap(t):
            if isinstance(t, torch.Tensor) and not isinstance(t, SimLowPrec):
                if t.is_floating_point():
                    t = torch.round(t * 2.0 ** cls.bits) / 2.0 ** cls.bits
                return SimLowPrec(t)
            return t
        return tree_map(wrap, out)


class Scaled(torch.Tensor):
    """A traceable wrapper (float8-style: data and a scale, `__tensor_flatten__`) that computes in plain tensors."""

    @staticmethod
    def __new__(cls, data, scale):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=data.dtype, device=data.device,
                                                   requires_grad=data.requires_grad)

    def __init__(self, data, scale):
        self._data, self._scale = data, scale

    def __tensor_flatten__(self):
        return ["_data", "_scale"], None

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        out = func(*tree_map(lambda t: t._data * t._scale if isinstance(t, Scaled) else t, args),
                   **(kwargs or {}))
        return tree_map(lambda t: Scaled(t, torch.ones(())) if isinstance(t, torch.Tensor)
                        and t.is_floating_point() else t, out)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


def _train(wrap, sweep: bool, path=None):
    torch.manual_seed(0)
    SimLowPrec.bits = 16
    blocks = nn.ModuleList(Block() for _ in range(2))
    recording = ac_diff.record(path) if path is not None else None
    grads = []
    try:
        if recording is not None:
            recording.__enter__()
        for _ in range(2):
            x = wrap(torch.randn(8, 16))
            for b in blocks:
                x = cp.checkpoint(b, x, use_reentrant=False)
            loss = (x * x).mean()
            if sweep:
                SimLowPrec.bits = 12  # the sweep moves on before the backward
            loss.backward()
            grads.append([p.grad.clone() for p in blocks.parameters()])
            SimLowPrec.bits = 16
    finally:
        if recording is not None:
            recording.__exit__(None, None, None)
    return grads


@pytest.mark.parametrize("sweep", [False, True])
def test_a_wrapper_subclass_is_measured_and_its_class_attribute_named(sweep, tmp_path):
    plain = _train(SimLowPrec, sweep)
    recorded = _train(SimLowPrec, sweep, tmp_path / "t.jsonl")
    assert all(torch.equal(a, b) for step_a, step_b in zip(plain, recorded) for a, b in zip(step_a, step_b))
    report = ac_diff.diagnose_paths([tmp_path / "t.jsonl"])
    if not sweep:
        assert report.verdict == "clean", report.headline
        return
    assert report.verdict == "diverged" and report.silent, report.headline
    lead = next(r for r in report.regions if r.status == "diverged")
    assert (lead.cause.kind, lead.cause.tensor) == ("state_mutation", "SimLowPrec.bits"), lead.cause
    assert "was 16 in the forward and 12 in the recompute" in lead.cause.detail


def test_a_traceable_wrapper_subclass_is_measured_through_its_data(tmp_path):
    """Reducing the wrapper itself returns another wrapper (`.tolist()` refuses it): its data is what is measured."""
    _train(lambda x: Scaled(x, torch.ones(())), False, tmp_path / "t.jsonl")
    report = ac_diff.diagnose_paths([tmp_path / "t.jsonl"])
    assert report.verdict == "clean", report.headline
    from ac_diff.trace import read_run

    ops = read_run(tmp_path / "t.jsonl").regions[0].forward.ops
    measured = {o.op for o in ops if o.fingerprint and all(fp is not None for fp in o.fingerprint)}
    assert {"aten.addmm.default", "aten.add.Tensor"} <= measured, [(o.op, o.fingerprint) for o in ops]


class _JaggedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 32), nn.Linear(32, 8)

    def forward(self, x):
        return x + self.fc2(nn.functional.dropout(nn.functional.gelu(self.fc1(x)), 0.2, training=True))


def _jagged_step(preserve_rng_state: bool):
    torch.manual_seed(0)
    blocks = nn.ModuleList(_JaggedBlock() for _ in range(2))
    h = torch.nested.nested_tensor([torch.randn(n, 8) for n in (3, 5, 4)], layout=torch.jagged)
    for block in blocks:
        h = cp.checkpoint(block, h, use_reentrant=False, preserve_rng_state=preserve_rng_state)
    torch.stack([t.mean(0) for t in h.unbind()]).square().sum().backward()
    return [p.grad for p in blocks.parameters()]


@pytest.mark.parametrize("preserve_rng_state", [False, True])
def test_a_jagged_nested_tensor_is_measured_through_its_packed_values(tmp_path, preserve_rng_state):
    """26e: variable-length sequences as a jagged nested tensor, dropout in the checkpointed blocks without their RNG
    state: the gradients differ from the run without AC, and every region read CLEAN, none of its values measured
    (the wrapper holds no plain tensor of its ragged shape; its packed `_values` are the values)."""
    path = tmp_path / "t.jsonl"
    with ac_diff.record(path):
        _jagged_step(preserve_rng_state)
    report = ac_diff.diagnose_paths([path])
    if preserve_rng_state:
        assert report.verdict == "clean", report.headline
        return
    assert report.verdict == "diverged" and all(r.cause.kind == "rng" for r in report.regions), report.headline


class _Float8(Scaled):
    """A float8 weight as delayed-scaling libraries hold it: fp8 data and the scale it was cast with, read as float32."""

    @staticmethod
    def __new__(cls, data, scale):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=torch.float32, device=data.device)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.t.default, torch.ops.aten.detach.default):
            return _Float8(func(args[0]._data), args[0]._scale)
        unwrap = lambda t: t._data.to(torch.float32) / t._scale if isinstance(t, _Float8) else t  # noqa: E731
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))


class _CastToFloat8(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, scale):
        return _Float8((w * scale).clamp(-448, 448).to(torch.float8_e4m3fn), scale)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _Float8Linear(nn.Linear):
    def __init__(self, n: int) -> None:
        super().__init__(n, n)
        self.register_buffer("scale", torch.tensor(1.0))

    def forward(self, x):
        return nn.functional.linear(x, _CastToFloat8.apply(self.weight, self.scale.clone()), self.bias)


@pytest.mark.skipif(not hasattr(torch, "float8_e4m3fn"), reason="this torch has no float8 dtype")
def test_a_wrapper_the_region_builds_from_a_cast_is_that_casts_output_and_the_scale_buffer_is_named(tmp_path):
    """TransformerEngine-style delayed scaling (29a): the weight cast to float8 with a scale kept in a buffer, the
    scales updated from the amax when the fp8 context exits, after the forward and before its backward. The float8
    wrapper an autograd.Function builds inside the region reached the recorder as `external[0]`, blamed as "modified
    between the forward and the backward" and named in the fix; it is the cast's output, and the buffer is the cause."""
    torch.manual_seed(0)
    layer = _Float8Linear(16)
    with ac_diff.record(tmp_path / "t.jsonl"):
        for _ in range(2):
            y = cp.checkpoint(layer, torch.randn(4, 16, requires_grad=True), use_reentrant=False)
            with torch.no_grad():  # (the fp8 context's exit: the scale from the weight's amax)
                layer.scale.fill_(448 / layer.weight.abs().max() / 2)
            y.square().sum().backward()
    report = ac_diff.diagnose_paths([tmp_path / "t.jsonl"])
    lead = next(r for r in report.regions if r.status == "diverged")
    assert (lead.cause.kind, lead.cause.tensor) == ("state_mutation", "scale"), lead.cause
    assert not any(c["name"].startswith("external") for r in report.regions for c in r.changed_inputs)
