"""A precision schedule applied between the forward and the backward: each checkpointed block computes its gate in
`gate_dtype`, which a schedule lowers from float32 to bfloat16 at the end of the warm-up, from a callback that runs
once the loss is computed (before its backward), as "low precision after warm-up" callbacks do.

From that step on, the recompute computes the gate in bfloat16 where the forward used float32: the saved tensors
keep their shapes and change their dtype, and torch raises a CheckpointError naming those positions (f32 -> bf16).

    python tests/stacks/precision_schedule.py [--steps 4] [--warmup 2]
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

DIM = 32


class GatedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.gate, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)
        self.gate_dtype = torch.float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = torch.sigmoid(self.gate(x)).to(self.gate_dtype)  # the gate kept in low precision (the schedule's)
        return x + self.down(torch.relu(self.up(x)) * g)


class Net(nn.Module):
    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(GatedBlock() for _ in range(layers))
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return self.head(x)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args()
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(args.steps):
        x, y = torch.randn(16, DIM), torch.randn(16, 1)
        loss = nn.functional.mse_loss(model(x), y)
        if step == args.warmup:  # the schedule's callback, on the loss: low precision after the warm-up
            for block in model.blocks:
                block.gate_dtype = torch.bfloat16
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item():.6f}")


if __name__ == "__main__":
    main()
