"""Tensor-parallel blocks on a gloo process group (CPU): each rank holds a column shard of the first linear and a row
shard of the second, and the block all-reduces the partial sums inside the checkpointed forward (Megatron-style, with
torch.distributed.all_reduce). Each block scales its hidden activation by a Python attribute `gain` that a warmup
counter of the rank's own raises once it ends (`--warm-rank`'s warmup is one step shorter): on that rank the gain
changes between the forward and the backward, so its recompute computes other partial sums, and every rank's
recompute all-reduces them: the other ranks diverge too, through the all_reduce, with no change of their own.

    torchrun --nproc-per-node 2 -m ac_diff run -o out tests/stacks/tp_rank_gain.py --warm-rank 1

Seeded: the same full weights on every rank, sharded; every rank reads the same batch (tensor parallelism).
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

DIM, HIDDEN = 16, 32


class ReduceForward(torch.autograd.Function):
    """all_reduce in the forward, identity in the backward (Megatron's g)."""

    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


class TPBlock(nn.Module):
    def __init__(self, rank: int, world: int) -> None:
        super().__init__()
        full_up, full_down = nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM, bias=False)
        shard = HIDDEN // world
        cols = slice(rank * shard, (rank + 1) * shard)
        self.up, self.down = nn.Linear(DIM, shard), nn.Linear(shard, DIM, bias=False)
        with torch.no_grad():
            self.up.weight.copy_(full_up.weight[cols])
            self.up.bias.copy_(full_up.bias[cols])
            self.down.weight.copy_(full_down.weight[:, cols])
        self.norm = nn.LayerNorm(DIM)
        self.gain = 1.0

    def forward(self, x):
        h = torch.nn.functional.gelu(self.up(x)) * self.gain
        return self.norm(x + ReduceForward.apply(self.down(h)))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--warm-rank", type=int, default=1, help="the rank whose warmup ends a step early (-1: none)")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    blocks = nn.ModuleList([TPBlock(rank, world) for _ in range(2)])
    opt = torch.optim.SGD(blocks.parameters(), lr=0.1)
    warmup = 1 if rank == args.warm_rank else args.steps + 1
    for step in range(args.steps):
        x = torch.randn(8, DIM, generator=torch.Generator().manual_seed(step))
        for b in blocks:
            x = checkpoint(b, x, use_reentrant=False)
        loss = x.square().mean()
        if step + 1 >= warmup:  # the warmup ends: the gain steps up (before the backward: the bug)
            for b in blocks:
                b.gain = 1.1
        loss.backward()
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
