"""A curriculum over checkpointed blocks compiled in place (`block.compile()`, inductor): each block keeps a Python
int, `keep`, the number of leading positions whose update it adds; the curriculum raises it right after the forward,
before the backward. Dynamo guards on it, so the recompute runs a graph compiled again, with the new value: the
gradients are silently wrong. `--fixed`: the curriculum steps after the backward.

    python tests/stacks/compiled_guard.py [--fixed]
"""

import sys

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


class Block(torch.nn.Module):
    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.keep, self.norm = 4, torch.nn.LayerNorm(dim)
        self.w1, self.w2 = torch.nn.Linear(dim, 64), torch.nn.Linear(64, dim)

    def forward(self, x):
        h = self.w2(F.gelu(self.w1(self.norm(x))))
        mask = (torch.arange(x.shape[1]) < self.keep).to(x.dtype)[None, :, None]
        return x + h * mask


def main() -> None:
    fixed = "--fixed" in sys.argv
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(Block() for _ in range(2))
    for b in blocks:
        b.compile()
    head = torch.nn.Linear(32, 1)
    opt = torch.optim.SGD([*blocks.parameters(), *head.parameters()], lr=1e-2)
    for step in range(2):
        x = torch.randn(16, 8, 32)
        for b in blocks:
            x = checkpoint(b, x, use_reentrant=False)
        loss = head(x).mean(1).square().mean()
        if not fixed:
            for b in blocks:
                b.keep = min(b.keep + 2, 8)  # the curriculum, before the backward
        loss.backward()
        opt.step()
        opt.zero_grad()
        if fixed:
            for b in blocks:
                b.keep = min(b.keep + 2, 8)
        print(f"step {step}: loss {loss.item():.6f}")


if __name__ == "__main__":
    main()
