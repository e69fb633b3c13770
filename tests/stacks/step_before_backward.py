"""Gradient accumulation over two micro-batches with the optimizer step placed before the last micro-batch's backward
(a refactoring mistake). Without AC, torch's version counter catches it: the backward reads weights the step wrote
in place ("modified by an inplace operation"). With AC the recompute reads the stepped weights and the backward
finishes: its gradients are silently those of other weights.

    ac-diff run --reference no-ac --reference-steps 2 step_before_backward.py
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)) for _ in range(2))

    def forward(self, x):  # (every parameter in a checkpointed block: nothing else saves a weight the step writes)
        for block in self.blocks:
            x = x + checkpoint(block, x, use_reentrant=False)
        return x[:, :4]


def main() -> None:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        for micro in range(2):
            x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
            loss = F.cross_entropy(model(x), y) / 2
            if micro == 1:
                opt.step()  # the mistake: it belongs after the backward below
            loss.backward()
        opt.zero_grad()
        print(f"step {step} loss {loss.item():.6f}", flush=True)


if __name__ == "__main__":
    main()
