"""The model of the small stack scripts: blocks of width 16, each checkpointed (non-reentrant), then a linear head.

    CheckpointedStack(lambda: Block(16), layers=3)   # (batch, 16) -> (batch, 1); the blocks are `layers.N`
"""

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

DIM = 16


class CheckpointedStack(nn.Module):
    def __init__(self, make_block, layers: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(make_block() for _ in range(layers))
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False)
        return self.head(x)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """One (input, target) batch of 8."""
    return torch.randn(8, DIM), torch.randn(8, 1)
