"""fp8-style delayed scaling: each checkpointed linear quantises its input with a scale from `amax_history`, a
buffer filled from the first batch's amax on the module's first forward (`initialized` flips then) and rolled by
every forward (the newest amax in front).

Step 0's recompute reads the history the forward filled and rolled, which holds that batch's amax in every slot:
it reproduces the forward. Every later recompute reads the history rolled once more (this batch's amax in front
instead of the last one's) and quantises with another scale: 6 of the 9 regions of 3 steps diverge. Restoring
`layers.*.amax_history` in the recompute must not undo step 0's filling: the recompute would read the empty history
with `initialized` already set.

    python tests/stacks/delayed_scaling.py [--steps 3]
"""

from __future__ import annotations

import torch
from torch import nn

from small_loop import train
from small_stack import DIM, CheckpointedStack, batch

FP8_MAX = 448.0  # e4m3
STEPS = 8.0  # quantisation levels between 0 and FP8_MAX / scale (coarse, so a scale change shows)


class DelayedScalingLinear(nn.Linear):
    """linear(quantise(x)), the scale FP8_MAX / amax_history[0] (the most recent amax before this call)."""

    def __init__(self, history: int = 4) -> None:
        super().__init__(DIM, DIM)
        self.register_buffer("amax_history", torch.zeros(history))
        self.initialized = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        amax = x.detach().abs().max()
        with torch.no_grad():
            if not self.initialized:  # lazily, from the first batch
                self.amax_history.fill_(amax)
                self.initialized = True
        recent = self.amax_history[0]
        scale = torch.where(recent > 0, FP8_MAX / recent, torch.ones_like(recent))
        q = torch.round(x * scale * STEPS / FP8_MAX).clamp(-STEPS, STEPS) * FP8_MAX / (STEPS * scale)
        out = super().forward(x + (q - x).detach())  # straight-through
        with torch.no_grad():
            self.amax_history.copy_(torch.roll(self.amax_history, 1))
            self.amax_history[0] = amax
        return out


def main(argv: list[str] | None = None) -> list[list[torch.Tensor]]:
    """Each step's gradients."""
    return train(lambda: CheckpointedStack(DelayedScalingLinear, layers=3), batch, lr=0.01, argv=argv)


if __name__ == "__main__":
    main()
