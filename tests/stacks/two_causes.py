"""Two causes in one checkpointed block: dropout under preserve_rng_state=False, and a call counter that sets a
schedule value in forward (the recompute reads it counted twice).

    python two_causes.py [--steps 3]

Restoring the counter in the recompute leaves the dropout masks differing, and preserve_rng_state=True leaves the
counter: only both together make the recompute reproduce the forward.
"""

import math

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from small_loop import train


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(0.2)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        scale = 1.0 + 0.1 * math.sin(self.calls)
        return x + self.fc2(self.drop(torch.relu(self.fc1(x) * scale)))


class Model(nn.Module):
    def __init__(self, dim: int = 16):
        super().__init__()
        self.layers = nn.ModuleList(Block(dim) for _ in range(2))
        self.head = nn.Linear(dim, 1)

    def forward(self, x):
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False, preserve_rng_state=False)
        return self.head(x)


if __name__ == "__main__":
    train(Model, lambda: (torch.randn(16, 16), torch.randn(16, 1)), lr=0.05)
