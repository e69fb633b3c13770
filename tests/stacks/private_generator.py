"""A block that draws its noise from its own torch.Generator (`self.gen`), checkpointed non-reentrant.

preserve_rng_state restores torch's default generators only: the recompute draws the next numbers from
`self.gen`, so its noise (and everything after it) differs from the forward's. Gradients end up wrong
silently (the shapes are the same: no CheckpointError). The fix: hand the generator's state to the
checkpointed function; `ac-diff fix` simulates it with --restore-in-recompute on the block.

    python tests/stacks/private_generator.py [--steps 2]
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


class NoisyBlock(nn.Module):
    def __init__(self, dim: int, seed: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.gen = torch.Generator().manual_seed(seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        noise = torch.rand(x.shape, generator=self.gen)
        return x + torch.tanh(self.fc(x * (1 + 0.1 * noise)))


class Net(nn.Module):
    """`layers` blocks (`block(dim, i)`), each checkpointed non-reentrant, and a head."""

    def __init__(self, dim: int = 16, layers: int = 2, block=lambda dim, i: NoisyBlock(dim, seed=i)) -> None:
        super().__init__()
        self.layers = nn.ModuleList(block(dim, i) for i in range(layers))
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False)
        return self.head(x)


def main(argv=None, block=None, batch: int = 8) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=2)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    model = Net() if block is None else Net(block=block)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(args.steps):
        loss = model(torch.randn(batch, 16)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()


if __name__ == "__main__":
    main()
