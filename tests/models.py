"""Small real models for recorder tests: every checkpoint variant over the same two-block network."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint as cp
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

import ac_diff
from ac_diff.trace import read_run

# Hugging Face binds checkpoint with its kwargs once, long before a recorder could start.
BOUND_CHECKPOINT = functools.partial(cp.checkpoint, use_reentrant=False)


class Block(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.up = nn.Linear(dim, dim)
        self.down = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x))).sin()


class Net(nn.Module):
    """`layers.{i}` blocks; `checkpoint_fn(block, x)` decides how each block is checkpointed."""

    def __init__(self, checkpoint_fn, n: int = 2, dim: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(dim) for _ in range(n))
        self.checkpoint_fn = checkpoint_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers:
            x = self.checkpoint_fn(block, x)
        return x


class Scaled(nn.Module):
    """A linear layer scaled by a buffer: what changing `scale` between the forward and the backward does."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.register_buffer("scale", torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


def _save_addmm(ctx, op, *args, **kwargs):
    return cp.CheckpointPolicy.MUST_SAVE if op == torch.ops.aten.addmm.default else cp.CheckpointPolicy.PREFER_RECOMPUTE


def _early_stop_off(block, x):
    # the context manager (torch >= 2.1), not checkpoint(early_stop=False) (torch >= 2.11 only)
    with cp.set_checkpoint_early_stop(False):
        return cp.checkpoint(block, x, use_reentrant=False)


VARIANTS = {
    "non_reentrant": lambda b, x: cp.checkpoint(b, x, use_reentrant=False),
    "reentrant": lambda b, x: cp.checkpoint(b, x, use_reentrant=True),
    "early_stop_off": _early_stop_off,
    "determinism_none": lambda b, x: cp.checkpoint(b, x, use_reentrant=False, determinism_check="none"),
    "bound_partial": lambda b, x: BOUND_CHECKPOINT(b, x),
    "sac": lambda b, x: cp.checkpoint(b, x, use_reentrant=False, context_fn=functools.partial(
        cp.create_selective_checkpoint_contexts, _save_addmm)),
}


# selective AC's public API came in torch 2.5: on 2.4 the variant is not applicable (reported as skipped)
NEEDS_SAC = pytest.mark.skipif(not hasattr(cp, "create_selective_checkpoint_contexts"),
                               reason="this torch has no create_selective_checkpoint_contexts (torch < 2.5)")
VARIANT_PARAMS = [pytest.param(v, marks=NEEDS_SAC) if v == "sac" else v for v in sorted(VARIANTS)]


def wrapped_net(n: int = 2) -> nn.Module:
    """torchtitan's way: each block replaced by a CheckpointWrapper module."""
    net = Net(lambda b, x: b(x), n)
    for i, block in enumerate(net.layers):
        net.layers[i] = checkpoint_wrapper(block)
    return net


def train_step(model: nn.Module, seed: int = 0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(seed)
    x = torch.randn(4, 8, requires_grad=True)
    loss = model(x).pow(2).sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    grads["input"] = x.grad.clone()
    return loss.detach(), grads


def record_step(model: nn.Module, path, **options):
    with ac_diff.record(path, **options):
        result = train_step(model)
    return result, read_run(path)


def steps_with_and_without_ac(make, path, steps: int, batch=(2, 8), **record) -> tuple[list, list]:
    """Train a block `make()` builds for `steps` steps with checkpoint (recorded to `path`) and without: the
    gradients of its parameters at each step, for each run (the ground truth a state-drift test compares)."""
    import contextlib

    runs = []
    for ac in (True, False):
        torch.manual_seed(0)
        block, grads = make(), []
        with ac_diff.record(path, **record) if ac else contextlib.nullcontext():
            for _ in range(steps):
                x = torch.randn(*batch, requires_grad=True)
                (cp.checkpoint(block, x, use_reentrant=False) if ac else block(x)).sum().backward()
                grads.append([p.grad.clone() for p in block.parameters()])
                block.zero_grad()
        runs.append(grads)
    return runs[0], runs[1]


def same_steps(a: list, b: list) -> list[bool]:
    """Per step: whether every gradient of run `a` equals run `b`'s, bit for bit."""
    return [all(torch.equal(x, y) for x, y in zip(p, q)) for p, q in zip(a, b)]
