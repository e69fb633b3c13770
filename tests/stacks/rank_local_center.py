"""Data-parallel blocks on a gloo process group (CPU), gradients averaged with all_reduce as DDP does, where the
blocks of one rank keep a running centre of their input updated in place inside the checkpointed forward: that
rank's recompute moves the centre again and saves other values (shapes unchanged: torch raises nothing), every
other rank reproduces its forward exactly.

    torchrun --nnodes 2 --nproc-per-node 2 ... -m ac_diff run -o out rank_local_center.py --center-rank 3
    ... rank_local_center.py --center-rank -1 --die-rank 3   # rank 3 kills itself (SIGKILL) after its last step
    ... rank_local_center.py --center-rank -1 --steps 3 --raise-rank 1 --raise-step 2   # rank 1 raises after a forward

Seeded: the same weights on every rank, each rank its own batch.
"""

import argparse
import os
import signal

import torch
import torch.distributed as dist
import torch.nn as nn
from small_stack import DIM, CheckpointedStack, batch


class Block(nn.Module):
    def __init__(self, keeps_center: bool) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)
        self.register_buffer("center", torch.zeros(DIM))
        self.keeps_center = keeps_center

    def forward(self, x):
        if self.keeps_center:  # inside the region: the recompute applies this update a second time
            with torch.no_grad():
                self.center.mul_(0.9).add_(x.mean(0), alpha=0.1)
        return x + torch.tanh(self.proj(x - self.center))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--center-rank", type=int, default=3, help="the rank whose blocks keep a running centre")
    p.add_argument("--die-rank", type=int, default=-1, help="the rank that kills itself after its last step")
    p.add_argument("--raise-rank", type=int, default=-1, help="the rank whose loss scale divides by zero ...")
    p.add_argument("--raise-step", type=int, default=0, help="... in this step (from 1), after its forward")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = CheckpointedStack(lambda: Block(rank == args.center_rank))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    torch.manual_seed(1 + rank)
    for step in range(args.steps):
        x, y = batch()
        loss = nn.functional.mse_loss(model(x), y)
        if rank == args.raise_rank:  # a warm-up loss scale whose countdown reaches zero: ZeroDivisionError there
            loss = loss * (1.0 / (args.raise_step - 1 - step))
        opt.zero_grad()
        loss.backward()
        for param in model.parameters():
            dist.all_reduce(param.grad)
            param.grad /= world
        opt.step()
        print(f"[rank {rank}] step {step} loss {loss.item():.6f}", flush=True)
    if rank == args.die_rank:
        os.kill(os.getpid(), signal.SIGKILL)  # before ac-diff finishes its trace: no results from this rank
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
