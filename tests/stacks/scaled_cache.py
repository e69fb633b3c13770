"""DiT-style blocks, checkpointed non-reentrant, that cache their timestep embedding in a dict (filled by the forward on
a miss); a noise scheduler rescales the cached conditioning in place after the forward, before the backward.

The recompute finds the embedding cached and reads the rescaled tensor: its values, and the gradients, are silently
wrong. No remedy that keeps AC can fix it from outside (the fix is in the scheduler: scale a copy); turning AC off for
the blocks makes the gradients right.

    python tests/stacks/scaled_cache.py [--steps 2]
"""

from __future__ import annotations

import argparse
import math

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc, self.ada = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.temb_cache: dict[int, torch.Tensor] = {}

    def embedding(self, t: int, dim: int) -> torch.Tensor:
        if t not in self.temb_cache:
            with torch.no_grad():
                freqs = torch.exp(-math.log(1e4) * torch.arange(dim // 2) / (dim // 2))
                self.temb_cache[t] = torch.cat([(t * freqs).sin(), (t * freqs).cos()])[None]
        return self.temb_cache[t]

    def forward(self, x: torch.Tensor, t: int) -> torch.Tensor:
        shift = self.ada(nn.functional.silu(self.embedding(t, x.shape[-1])))
        return x + torch.tanh(self.fc(x) + shift)


class Net(nn.Module):
    def __init__(self, dim: int = 16, layers: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))

    def forward(self, x: torch.Tensor, t: int) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, t, use_reentrant=False)
        return x


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=2)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(args.steps):
        t = 3 + step
        loss = model(torch.randn(8, 16), t).pow(2).mean()
        for block in model.blocks:  # the scheduler's sigma scaling, in place
            block.temb_cache[t].mul_(1 / math.sqrt(1 + (t / 10) ** 2))
        loss.backward()
        opt.step()
        opt.zero_grad()


if __name__ == "__main__":
    main()
