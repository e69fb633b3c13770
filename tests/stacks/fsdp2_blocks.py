"""FSDP2 (`fully_shard`) blocks, each checkpointed (non-reentrant) the way torchtitan composes them, trained on
every rank of a gloo process group (CPU): clean, so a report of it must be clean on every rank.

    ac-diff run --nproc-per-node 2 fsdp2_blocks.py --steps 1

FSDP2 all-gathers a block's parameters in its pre-forward hook, inside the region in the forward and not in the
recompute (backward's pre-hook gathered them first): those hook ops are not the region's control flow.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from small_stack import DIM, CheckpointedStack, batch


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm, self.up, self.drop, self.down = nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.Dropout(0.1), \
            nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.down(self.drop(torch.relu(self.up(self.norm(x)))))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=2)
    args = p.parse_args()
    dist.init_process_group("gloo")
    try:
        torch.manual_seed(0)  # the same initial weights on every rank, as FSDP2 expects
        model = CheckpointedStack(lambda: Block(DIM))
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        torch.manual_seed(1 + dist.get_rank())  # each rank its own batch
        for step in range(args.steps):
            x, y = batch()
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            print(f"rank {dist.get_rank()} step {step} loss {loss.item():.6f}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
