"""Two micro-batches forwarded before their backward passes (a pipeline-like schedule), with the
optimizer stepped after the first backward: the second micro-batch's recompute runs with updated weights."""
import torch
import torch.nn as nn
import torch.utils.checkpoint as cp

torch.manual_seed(0)
model = nn.Sequential(*(nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16)) for _ in range(2)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)


def forward(x):
    for block in model:
        x = cp.checkpoint(block, x, use_reentrant=False)
    return x.pow(2).mean()


micro_batches = [torch.randn(8, 16) for _ in range(2)]
losses = [forward(mb) for mb in micro_batches]
for loss in losses:
    loss.backward()
    opt.step()  # the bug: inside the loop, between micro-batch 1's forward and its backward
    opt.zero_grad()
