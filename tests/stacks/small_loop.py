"""The training loop of the small stack scripts: seeded, SGD, one mean-squared-error step per batch, the loss
printed per step (`--steps N`, default 3).

    train(Model, lambda: (torch.randn(256, 16), torch.randn(256, 1)), lr=0.05)
    -> [[each parameter's gradient] per step]   (what a test compares with and without AC)
"""

import argparse

import torch
import torch.nn as nn


def train(make_model, make_batch, lr: float, argv: list[str] | None = None) -> list[list[torch.Tensor]]:
    """`argv`: the script's arguments (default: the command line's)."""
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    grads = []
    for step in range(args.steps):
        x, y = make_batch()
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        print(f"step {step} loss {loss.item():.6f}")
    return grads
