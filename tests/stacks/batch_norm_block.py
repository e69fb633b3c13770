"""Blocks with a batch norm, checkpointed non-reentrant, in training mode.

The recompute runs the batch norm again, and it updates its running statistics a second time: every
recompute reproduces its forward and the gradients equal a run without AC, but after each step
`running_mean` and `running_var` are not what a run without AC leaves (evaluation reads them). Saving the
batch norm's outputs with selective AC keeps the recompute from running it; `ac-diff fix` verifies that.

    python tests/stacks/batch_norm_block.py [--steps 2]   (private_generator.py's net and loop)
"""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.bn = nn.BatchNorm1d(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.bn(self.fc(x)))


if __name__ == "__main__":
    from private_generator import main  # (the same net and loop, with these blocks)

    main(block=lambda dim, i: Block(dim), batch=32)
