"""A custom autograd.Function inside checkpointed blocks keeps a gradient warm-up factor on ctx, computed from a
module-level step counter the training loop advances right after the forward (a logging callback), before the
backward. Under use_reentrant=True the backward runs on the graph the recompute built: its ctx holds the next step's
factor, and the gradients are silently wrong although every op matches. Under use_reentrant=False the backward runs on
the forward's graph: clean.

    python tests/trust_scripts/function_ctx_global.py [--reentrant]
"""

import argparse

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

GLOBAL_STEP = 0


class WarmupLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        ctx.scale = min(1.0, (GLOBAL_STEP + 1) / 8)  # the gradient warm-up of this step
        return x @ w.t()

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        grad = grad * ctx.scale
        return grad @ w, grad.t() @ x


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w, self.fc = nn.Parameter(torch.randn(8, 8) * 0.1), nn.Linear(8, 8)

    def forward(self, x):
        return x + self.fc(torch.tanh(WarmupLinear.apply(x, self.w)))


def main() -> None:
    global GLOBAL_STEP
    p = argparse.ArgumentParser()
    p.add_argument("--reentrant", action="store_true")
    args = p.parse_args()
    torch.manual_seed(0)
    blocks = nn.ModuleList([Block() for _ in range(2)])
    for _ in range(2):
        x = torch.randn(4, 8, requires_grad=True)
        for block in blocks:
            x = checkpoint(block, x, use_reentrant=args.reentrant)
        loss = x.pow(2).mean()
        GLOBAL_STEP += 1  # the logging callback, before the backward
        loss.backward()


if __name__ == "__main__":
    main()
