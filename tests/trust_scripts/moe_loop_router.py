"""A token-choice MoE whose experts run in a Python loop over `nonzero` masks, with tokens-per-expert
counted by `bincount` on the side; the router's load-balancing bias is updated between the forward and
the backward (a real state mutation), so the top-k choice flips in the recompute."""
import torch
import torch.nn as nn
import torch.utils.checkpoint as cp

torch.manual_seed(0)
N_EXPERTS, DIM = 4, 16


class MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(DIM, N_EXPERTS, bias=False)
        self.experts = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(N_EXPERTS))
        self.register_buffer("bias", torch.zeros(N_EXPERTS))
        self.register_buffer("tokens_per_expert", torch.zeros(N_EXPERTS))

    def forward(self, x):
        scores = self.gate(x) + self.bias
        top = scores.topk(1, dim=-1).indices.squeeze(-1)
        counts = torch.bincount(top, minlength=N_EXPERTS).float()
        self.tokens_per_expert.add_(counts)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows = (top == e).nonzero().squeeze(-1)
            out = out.index_add(0, rows, expert(x[rows]))
        return out


model = nn.Sequential(MoE(), MoE())
x = torch.randn(64, DIM)
h = x
for layer in model:
    h = cp.checkpoint(layer, h, use_reentrant=False)
with torch.no_grad():  # the bug: the bias update runs before the backward
    for layer in model:
        layer.bias.add_(0.05 * (layer.tokens_per_expert / layer.tokens_per_expert.mean() - 1))
h.pow(2).mean().backward()
