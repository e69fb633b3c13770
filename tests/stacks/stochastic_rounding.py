"""Stochastic rounding in a custom autograd.Function whose private generator is seeded from a call counter.

Each call seeds `torch.Generator()` from `StochasticRound.calls`, so the recompute (another call) draws other
rounding noise than the forward. The noise reaches the saved tensors only through ops the recorder does not
fingerprint (a bit-level add and mask, `view.dtype`, `detach`, `view`), and torch's early stop ends the recompute
at the last saved tensor, before the next linear: the recompute's own ops look clean, only the tensor saved for
the second linear differs. Gradients differ from a run without AC; torch raises nothing.

    python tests/stacks/stochastic_rounding.py [--steps 3]
"""

from __future__ import annotations

import torch
from torch import nn

from small_loop import train
from small_stack import DIM, CheckpointedStack, batch


class StochasticRound(torch.autograd.Function):
    """float32 rounded to bfloat16 precision, stochastically (straight-through gradient)."""

    calls = 0

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        StochasticRound.calls += 1
        gen = torch.Generator(device=x.device).manual_seed(1234 + StochasticRound.calls)
        noise = torch.randint(0, 1 << 16, x.shape, generator=gen, dtype=torch.int32, device=x.device)
        bits = x.detach().contiguous().view(torch.int32)
        return ((bits + noise) & -65536).view(torch.float32).view(x.shape)  # keep the bfloat16 bits

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, DIM)
        self.down = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(StochasticRound.apply(self.up(x)))


def main(argv: list[str] | None = None) -> None:
    train(lambda: CheckpointedStack(Block, layers=3), batch, lr=0.01, argv=argv)


if __name__ == "__main__":
    main()
