"""A seeded model whose first checkpointed region runs a kernel that sums in another order in every process.

    PYTHONHASHSEED=random python unordered_sum.py [--steps N]

`unordered::row_sum(x)` adds up x's rows (float32) in the iteration order of a Python set of the rows' names:
Python's hash randomisation gives every process its own order, as the GPU's scheduler gives float atomics
(`index_add_`, `scatter_add_` with several contributions per row) their own order in every run. From identical
inputs it gives other sums from one process to the next, and the same sums within a process (the recompute
reproduces its forward). Under torch.use_deterministic_algorithms(True) it adds the rows in index order, as torch's
own kernels then take their deterministic path. With PYTHONHASHSEED fixed, every process sums in the same order.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from small_stack import DIM, CheckpointedStack

ROWS = 48


@torch.library.custom_op("unordered::row_sum", mutates_args=())
def row_sum(x: torch.Tensor) -> torch.Tensor:
    """[batch, rows, dim] -> [batch, dim]"""
    if torch.are_deterministic_algorithms_enabled():
        order = list(range(x.shape[1]))
    else:  # a set's order: the strings' hashes, salted per process
        order = [int(name[3:]) for name in {f"row{i}" for i in range(x.shape[1])}]
    out = torch.zeros_like(x[:, 0])
    for i in order:
        out += x[:, i]
    return out


@row_sum.register_fake
def _(x):
    return x.new_empty(x.shape[0], x.shape[2])


def _setup(ctx, inputs, output):
    ctx.rows = inputs[0].shape[1]


def _backward(ctx, grad):
    return grad.unsqueeze(1).expand(-1, ctx.rows, -1).contiguous()


row_sum.register_autograd(_backward, setup_context=_setup)


class Block(nn.Module):
    """Half of the rows it sums are large (x 1e5) and taken away again by the other half: what the sum keeps is the
    small rows' total plus the rounding of the large partial sums, which the order decides (as in a scatter_add_ of
    contributions that largely cancel). The loss then differs by up to a few percent from one order to another."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, ROWS * dim)

    def forward(self, x):
        parts = self.proj(x).view(x.shape[0], ROWS, -1)
        large = parts[:, :ROWS // 2] * 1e5
        return x + torch.tanh(row_sum(torch.cat([large, parts[:, ROWS // 2:] - large], 1)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = CheckpointedStack(lambda: Block(DIM))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    data = torch.randn(8, 16)
    for _ in range(args.steps):
        loss = model(data).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    print(f"loss {loss.item():.6f}")


if __name__ == "__main__":
    main()
