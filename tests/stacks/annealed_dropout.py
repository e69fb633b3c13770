"""A schedule anneals every dropout's probability between the forward and `backward()` (a dropout warm-down
stepped per micro-batch, in the wrong place): the recompute draws with the new `p`, so each checkpointed block
recomputes other masks and other values. Silent: the shapes stay the same. preserve_rng_state is on (the
default); the RNG is not what differs.

    python tests/stacks/annealed_dropout.py [--steps 2]
"""

import argparse

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


class Mixer(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.mix = nn.Linear(dim, dim)
        self.after_mix = nn.Dropout(0.2)

    def forward(self, x):
        return self.after_mix(self.mix(x))


class FeedForward(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)
        self.hidden_dropout = nn.Dropout(0.2)

    def forward(self, x):
        return self.down(self.hidden_dropout(torch.relu(self.up(x))))


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.mixer = Mixer(dim)
        self.ffn = FeedForward(dim)

    def forward(self, x):
        x = x + self.mixer(x)
        return x + self.ffn(x)


class Net(nn.Module):
    def __init__(self, dim: int = 16, depth: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(dim) for _ in range(depth)])

    def forward(self, x):
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return x


def anneal(model: nn.Module, factor: float = 0.9) -> None:
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p *= factor


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(args.steps):
        loss = model(torch.randn(8, 16)).pow(2).mean()
        anneal(model)  # the bug: stepped between the forward and its backward
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        print(f"step {step}: loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
