"""Three checkpointed blocks; a tensor saved by an op between block 0 and block 1 is modified in place
before the backward, so autograd raises in the middle of the backward: blocks 2 and 1 were recomputed
and checked, block 0 never is."""
import torch
import torch.nn as nn
import torch.utils.checkpoint as cp

torch.manual_seed(0)
blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3))
x = torch.randn(4, 8, requires_grad=True)
h = cp.checkpoint(blocks[0], x, use_reentrant=False)
e = h.exp()  # exp saves its output for backward
h = cp.checkpoint(blocks[1], e, use_reentrant=False)
h = cp.checkpoint(blocks[2], h, use_reentrant=False)
with torch.no_grad():
    e.add_(1.0)  # the saved output changes: autograd raises when the backward reaches exp
h.sum().backward()
