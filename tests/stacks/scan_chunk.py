"""A chunked scan (an S4/Mamba-like recurrence) whose chunk size comes from a run config that a scheduler raises
between the second step's forward and its backward: that recompute takes other chunks, saves another number of
tensors, and torch raises in the second backward. Without AC every step finishes.

    python scan_chunk.py [--steps 2]        (FLIP_AT=1: before the first backward instead)
"""

import os

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from small_loop import train

DIM = 16


class RunConfig:
    def __init__(self) -> None:
        self.chunk = 4
        self.forwards = 0


class Scan(nn.Module):
    def __init__(self, cfg: RunConfig) -> None:
        super().__init__()
        self.cfg, self.inp, self.decay = cfg, nn.Linear(DIM, DIM), nn.Parameter(torch.full((DIM,), 0.9))

    def forward(self, x):
        h, out = torch.zeros(DIM), []
        u = self.inp(x)
        for start in range(0, x.shape[0], self.cfg.chunk):
            h = h * self.decay + u[start:start + self.cfg.chunk].sum(0)
            out.append(torch.tanh(h).expand(min(self.cfg.chunk, x.shape[0] - start), DIM))
        return torch.cat(out)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cfg = RunConfig()
        self.scan, self.head = Scan(self.cfg), nn.Linear(DIM, 1)

    def forward(self, x):
        y = checkpoint(self.scan, x, use_reentrant=False) if AC else self.scan(x)
        self.cfg.forwards += 1
        if self.cfg.forwards == int(os.environ.get("FLIP_AT", "2")):
            self.cfg.chunk = 8  # the scheduler's step, between the second forward and its backward
        return self.head(y)


AC = True

if __name__ == "__main__":
    train(Model, lambda: (torch.randn(16, DIM), torch.randn(16, 1)), lr=0.05)
