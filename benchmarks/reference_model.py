"""A ~300M-parameter model trained one step on CPU, every block checkpointed (for benchmarks/reference_cost.py).

    python benchmarks/reference_model.py [--blocks 24] [--dim 1024]   # 24 blocks of 1024: 302M parameters

Each block: four dim x dim projections (1M elements each at 1024: gradients small enough to be kept whole) and a
4*dim MLP; SGD without momentum, so the plain run's memory is parameters + gradients + activations.
"""

import argparse

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.o(torch.tanh(self.q(h)) * self.v(h) + self.k(h))
        return h + self.down(torch.relu(self.up(h)))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--blocks", type=int, default=24)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--steps", type=int, default=1)
    a = p.parse_args()
    torch.manual_seed(0)
    blocks = nn.ModuleList(Block(a.dim) for _ in range(a.blocks))
    opt = torch.optim.SGD(blocks.parameters(), lr=1e-3)
    x = torch.randn(2, 32, a.dim)
    for _ in range(a.steps):
        h = x
        for b in blocks:
            h = checkpoint(b, h, use_reentrant=False)
        h.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


if __name__ == "__main__":
    main()
