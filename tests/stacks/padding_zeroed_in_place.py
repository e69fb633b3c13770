"""A sequence encoder that zeroes padding positions in place on each checkpointed block's output (a stranger's,
25i). Without AC, the block's own tanh saved that output for its backward, and the in-place write fails torch's
version check; with AC the block saved only its input, so the run finishes and its gradients equal those of the
same model written out of place (`--out-of-place`). AC hides the error the run without it raises."""

import argparse

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

parser = argparse.ArgumentParser()
parser.add_argument("--out-of-place", action="store_true")
args = parser.parse_args()
torch.manual_seed(0)


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln, self.fc = nn.LayerNorm(d), nn.Linear(d, d)

    def forward(self, x):
        return torch.tanh(self.fc(self.ln(x)))


class Encoder(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.emb, self.out = nn.Linear(8, d), nn.Linear(d, 1)
        self.blocks = nn.ModuleList(Block(d) for _ in range(2))

    def forward(self, x, pad):
        h = self.emb(x)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=False)
            h = h.masked_fill(pad[..., None], 0.0) if args.out_of_place else h.masked_fill_(pad[..., None], 0.0)
        return self.out(h.mean(1))


model = Encoder()
opt = torch.optim.SGD(model.parameters(), lr=0.05)
for step in range(2):
    x, lens = torch.randn(4, 10, 8), torch.randint(5, 11, (4,))
    pad = torch.arange(10)[None] >= lens[:, None]
    loss = (model(x, pad) - torch.randn(4, 1)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.6f}")
