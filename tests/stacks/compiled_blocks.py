"""torch.compile with activation-checkpointed blocks, in the places users put it.

    --compile around   torch.compile(model) over checkpoint_wrapper'd blocks (HF torch_compile=True style)
    --compile block    torchtitan's per-block compile: each layer = torch.compile(checkpoint_wrapper(block))
    --compile inside   checkpoint_wrapper(torch.compile(block)): the compiled module runs inside the region
    --compile inner    a compiled submodule inside each checkpointed block (block.ff = torch.compile(block.ff))
    --compile method   block.ff.compile() (in place, no OptimizedModule) inside each checkpointed block
    --compile function a torch.compile'd function called inside each checkpointed block
    --compile none     eager

`--dropout P --no-preserve-rng` puts a real divergence (dropout without preserved RNG state) in the
blocks' feed-forward. `--buffer-update` another: each block normalises its input by a running statistic,
a buffer it updates in place in its forward, so the recompute updates it again and sees another value. `--anneal static`
another: the feed-forward scales its activation by a Python float that a schedule lowers between the forward and the
backward, so the compiled code's guard on it fails in the recompute, which runs a graph compiled again (static shapes:
each value its own graph; `--anneal dynamic`: the value becomes the graph's input, and torch raises). `--rebind`
another: a schedule binds the feed-forward's `gain` buffer to a new tensor between the forward and the backward, and
the compiled code reads it as an input. Default backend "aot_eager" (through Dynamo and AOTAutograd, no C++ compiler);
`--backend inductor` compiles C++ kernels (gcc), whose dropout draws other numbers than eager dropout.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper


@torch.compile(backend="aot_eager")
def gelu_tanh(x):
    return F.gelu(x, approximate="tanh")


class FeedForward(nn.Module):
    def __init__(self, dim, p, use_function):
        super().__init__()
        self.w1 = nn.Linear(dim, 2 * dim)
        self.w2 = nn.Linear(2 * dim, dim)
        self.drop = nn.Dropout(p)
        self.use_function = use_function
        self.act_scale = 1.0  # (--anneal: a schedule lowers it between the forward and the backward)
        self.register_buffer("gain", torch.ones(2 * dim))  # (--rebind: a schedule binds it to a new tensor)

    def forward(self, x):
        h = self.w1(x)
        h = gelu_tanh(h) if self.use_function else F.gelu(h, approximate="tanh")
        return self.drop(self.w2(h * self.act_scale * self.gain))


class Block(nn.Module):
    def __init__(self, dim, p, use_function, buffer_update=False):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.ff = FeedForward(dim, p, use_function)
        self.buffer_update = buffer_update
        if buffer_update:
            self.register_buffer("scale", torch.ones(()))

    def forward(self, x):
        if self.buffer_update:  # a running mean of |x|, updated in place (the recompute updates it again)
            self.scale.mul_(0.5).add_(x.detach().abs().mean(), alpha=0.5)
            x = x / self.scale
        return x + self.ff(self.norm(x))


class Net(nn.Module):
    def __init__(self, dim=32, n_layers=2, p=0.0, use_function=False, buffer_update=False):
        super().__init__()
        self.layers = nn.ModuleList([Block(dim, p, use_function, buffer_update) for _ in range(n_layers)])
        self.out = nn.Linear(dim, 8)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compile", choices=["none", "around", "block", "inside", "inner", "method", "function"],
                   default="inner")
    p.add_argument("--backend", default="aot_eager")
    p.add_argument("--fullgraph", action="store_true", help="torch.compile(..., fullgraph=True) (torchtitan's way)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--no-preserve-rng", action="store_true")
    p.add_argument("--buffer-update", action="store_true", help="a buffer updated in place in each block's forward")
    p.add_argument("--anneal", choices=["static", "dynamic"], help="lower each feed-forward's act_scale before the "
                   "backward; static: each value compiled as a constant; dynamic: after the first recompile the value "
                   "becomes a graph input (automatic dynamic shapes), a tensor the recompute saves that the forward "
                   "did not, and torch raises")
    p.add_argument("--rebind", action="store_true", help="bind each feed-forward's `gain` buffer to a new tensor "
                   "between the forward and the backward")
    args = p.parse_args(argv)
    if args.anneal == "static":
        torch._dynamo.config.automatic_dynamic_shapes = False

    torch.manual_seed(0)
    net = Net(p=args.dropout, use_function=args.compile == "function", buffer_update=args.buffer_update)
    compile_ = lambda m: torch.compile(m, backend=args.backend, fullgraph=args.fullgraph)  # noqa: E731
    wrap = lambda m: checkpoint_wrapper(m, preserve_rng_state=not args.no_preserve_rng)  # noqa: E731
    for i, block in enumerate(list(net.layers)):
        if args.compile == "inside":
            net.layers[i] = wrap(compile_(block))
            continue
        if args.compile == "inner":
            block.ff = compile_(block.ff)
        elif args.compile == "method":
            block.ff.compile(backend=args.backend, fullgraph=args.fullgraph)
        net.layers[i] = compile_(wrap(block)) if args.compile == "block" else wrap(block)
    if args.compile == "around":
        net = compile_(net)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    for step in range(args.steps):
        x = torch.randn(4, 16, 32, generator=g)
        loss = net(x).pow(2).mean()
        if args.anneal or args.rebind:  # a schedule hook that runs before the backward
            for module in net.modules():
                if isinstance(module, FeedForward) and args.anneal:
                    module.act_scale = 1.0 - 0.1 * (step + 1)
                elif isinstance(module, FeedForward):
                    module.gain = module.gain * 0.9
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        print(f"step {step}: loss {loss.item():.5f} (exactly {loss.item().hex()})", flush=True)


if __name__ == "__main__":
    main()
