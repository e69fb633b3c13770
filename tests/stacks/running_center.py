"""A top-1 router centred by a running mean of its logits, which a forward hook updates inside the
checkpointed block: the recompute runs the hook again, so the buffer moves twice per step (counted twice).

    python running_center.py [--steps 3]

Saving the router's argmax (`--must-save aten.argmax.default --must-save-module 'layers.*.router'`) makes every
recompute reproduce its forward, yet the next step starts from another centre than without AC: its loss differs
although the first backward's gradients were identical. Restoring the buffer in the recompute
(`--restore-in-recompute 'layers.*.router.center'`) keeps one update per step.
"""

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from small_loop import train

DIM, EXPERTS = 16, 4


class Router(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(DIM, EXPERTS, bias=False)
        self.register_buffer("center", torch.zeros(EXPERTS))

    def forward(self, x):
        logits = self.gate(x)
        return logits, (logits - self.center).argmax(-1)


def update_center(router, inputs, output):
    with torch.no_grad():
        router.center.mul_(0.9).add_(output[0].mean(0), alpha=0.1)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = Router()
        self.router.register_forward_hook(update_center)
        self.experts = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(EXPERTS))

    def forward(self, x):
        logits, choice = self.router(x)
        weight = torch.softmax(logits, -1).gather(-1, choice[:, None])
        every = torch.stack([expert(x) for expert in self.experts], 1)  # (tokens, experts, dim)
        chosen = every.gather(1, choice[:, None, None].expand(-1, 1, DIM)).squeeze(1)
        return x + chosen * weight


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(DIM, 1)

    def forward(self, h):
        for layer in self.layers:
            h = checkpoint(layer, h, use_reentrant=False)
        return self.head(h)


if __name__ == "__main__":
    train(Model, lambda: (torch.randn(256, DIM), torch.randn(256, 1)), lr=0.05)
