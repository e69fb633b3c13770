"""Two linear layers in one checkpointed block, each centring its output by a running mean buffer (`running`) it
updates in its own forward: the recompute reads both buffers already moved, and updates them again.

Restoring `layers.*.fc1.running` alone leaves fc2's buffer moved (the recompute still differs); the recompute
reproduces the forward only with both restored (`--restore-in-recompute 'layers.*.fc1.running'
--restore-in-recompute 'layers.*.fc2.running'`, i.e. moving both updates after the backward).

    python tests/stacks/two_running_buffers.py [--steps 3]
"""

from __future__ import annotations

import torch
from torch import nn

from small_loop import train
from small_stack import DIM, CheckpointedStack, batch


class CenteredLinear(nn.Linear):
    """linear(x) - running, with `running` (dim,) moved 10% toward this batch's mean output on every call."""

    def __init__(self) -> None:
        super().__init__(DIM, DIM)
        self.register_buffer("running", torch.zeros(DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        out = y * (1 + self.running)  # (saves the buffer: the recompute's saved tensors differ)
        with torch.no_grad():
            self.running.lerp_(y.mean(0), 0.1)
        return out


class Block(nn.Module):
    """x + fc2(tanh(fc1(x))): (batch, dim) -> (batch, dim), both buffers moved by every call."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = CenteredLinear(), CenteredLinear()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


def main(argv: list[str] | None = None) -> list[list[torch.Tensor]]:
    """Each step's gradients."""
    return train(lambda: CheckpointedStack(Block), batch, lr=0.01, argv=argv)


if __name__ == "__main__":
    main()
