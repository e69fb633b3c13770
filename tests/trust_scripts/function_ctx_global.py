"""A custom autograd.Function inside checkpointed blocks keeps a gradient warm-up factor on ctx, computed from a
module-level step counter the training loop advances right after the forward (a logging callback), before the
backward. Under use_reentrant=True the backward runs on the graph the recompute built: its ctx holds the next step's
factor, and the gradients are silently wrong although every op matches. Under use_reentrant=False the backward runs on
the forward's graph: clean.

    python tests/trust_scripts/function_ctx_global.py [--reentrant] [--dict]   # --dict: the step in a config dict
"""

import argparse

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

GLOBAL_STEP = 0
SCHEDULE = {"step": 0, "name": "warmup"}  # (--dict: the step kept here)
USE_DICT = False


class WarmupLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        step = SCHEDULE["step"] if USE_DICT else GLOBAL_STEP
        ctx.scale = min(1.0, (step + 1) / 8)  # the gradient warm-up of this step
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
    global GLOBAL_STEP, USE_DICT
    p = argparse.ArgumentParser()
    p.add_argument("--reentrant", action="store_true")
    p.add_argument("--dict", action="store_true", help="the step counter is an item of a module-level dict")
    args = p.parse_args()
    USE_DICT = args.dict
    torch.manual_seed(0)
    blocks = nn.ModuleList([Block() for _ in range(2)])
    for _ in range(2):
        x = torch.randn(4, 8, requires_grad=True)
        for block in blocks:
            x = checkpoint(block, x, use_reentrant=args.reentrant)
        loss = x.pow(2).mean()
        if USE_DICT:  # the logging callback, before the backward
            SCHEDULE["step"] += 1
        else:
            GLOBAL_STEP += 1
        loss.backward()


if __name__ == "__main__":
    main()
