"""A checkpointed block whose first line adds its position embedding to its input in place (`x += self.pos`).

checkpoint keeps the block's input to recompute from it; the in-place add changes that very tensor, so the backward
raises "one of the variables needed for gradient computation has been modified by an inplace operation" before any
recompute. Without AC nothing reads the old value (the residual stream before the add is saved by no op) and the
script trains. The fix, `x = x + self.pos`, is `OUT_OF_PLACE = True`.

    python tests/stacks/inplace_input.py [--steps 3]
"""

from __future__ import annotations

import torch
from torch import nn

from small_loop import train
from small_stack import DIM, CheckpointedStack, batch

OUT_OF_PLACE = False


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.randn(DIM) * 0.02)
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if OUT_OF_PLACE:
            x = x + self.pos
        else:
            x += self.pos  # writes the tensor checkpoint keeps
        return x + torch.tanh(self.fc(x))


def main(argv: list[str] | None = None) -> None:
    train(lambda: CheckpointedStack(Block), batch, lr=0.01, argv=argv)


if __name__ == "__main__":
    main()
