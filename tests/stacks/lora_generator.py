"""LoRA adapters whose dropout draws its mask from a private torch.Generator held by the dropout itself, two
levels below the checkpointed block (`layers.N.q_proj.lora_dropout.default`, `layers.N.v_proj...`, PEFT's layout).

preserve_rng_state restores torch's default generators only: each dropout's own generator kept advancing, so the
recompute draws other masks and the gradients differ from a run without AC (silently: same shapes). The remedy
must reach the generators where they live: `--restore-in-recompute 'layers.*.q_proj.lora_dropout.default'` (and
v_proj's); the block's glob `layers.*` holds no generator of its own.

    python tests/stacks/lora_generator.py [--steps 3]
"""

from __future__ import annotations

import torch
from torch import nn

from small_loop import train
from small_stack import DIM, CheckpointedStack, batch


class GeneratorDropout(nn.Module):
    """Dropout whose mask comes from `self.gen` (seeded from torch's seeded default generator): (batch, dim) ->
    (batch, dim), a share `p` zeroed."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p
        self.gen = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = torch.rand(x.shape, generator=self.gen) >= self.p
        return x * keep / (1 - self.p)


class LoraLinear(nn.Module):
    """base(x) + B(A(dropout(x))), with PEFT's per-adapter dicts (`lora_A.default`, `lora_dropout.default`)."""

    def __init__(self, rank: int = 4) -> None:
        super().__init__()
        self.base = nn.Linear(DIM, DIM)
        self.lora_A = nn.ModuleDict({"default": nn.Linear(DIM, rank, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(rank, DIM, bias=False)})
        self.lora_dropout = nn.ModuleDict({"default": GeneratorDropout(0.1)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        adapter = self.lora_B["default"](self.lora_A["default"](self.lora_dropout["default"](x)))
        return self.base(x) + adapter


class Block(nn.Module):
    """x + tanh(q_proj(x)) * sigmoid(v_proj(x)): (batch, dim) -> (batch, dim), two adapters, two generators."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.v_proj = LoraLinear(), LoraLinear()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.q_proj(x)) * torch.sigmoid(self.v_proj(x))


def main(argv: list[str] | None = None) -> list[list[torch.Tensor]]:
    """Each step's gradients."""
    return train(lambda: CheckpointedStack(Block), batch, lr=0.01, argv=argv)


if __name__ == "__main__":
    main()
