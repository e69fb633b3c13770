"""DiT-style blocks, checkpointed non-reentrant, that cache their timestep embedding in a dict (filled by the forward on
a miss); a noise scheduler (a forward hook on the model) rescales the cached conditioning in place after the forward,
before the backward.

The recompute finds the embedding cached and reads the rescaled tensor: its values, and the gradients, are silently
wrong. No remedy that keeps AC can fix it from outside (the fix is in the scheduler: scale a copy); turning AC off for
the blocks makes the gradients right.

    python tests/stacks/scaled_cache.py [--steps 3]
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from small_loop import train


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
        self.t = 2
        self.register_forward_hook(Net.scale_conditioning)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.t += 1  # the diffusion timestep of this batch
        for block in self.blocks:
            x = checkpoint(block, x, self.t, use_reentrant=False)
        return x

    @staticmethod
    def scale_conditioning(model: "Net", args, output) -> None:
        """The scheduler's sigma scaling of the cached conditioning, in place, once the forward has run."""
        for block in model.blocks:
            block.temb_cache[model.t].mul_(1 / math.sqrt(1 + (model.t / 10) ** 2))


if __name__ == "__main__":
    train(Net, lambda: (torch.randn(8, 16), torch.randn(8, 16)), lr=0.01)
