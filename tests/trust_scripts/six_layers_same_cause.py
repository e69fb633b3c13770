"""Six checkpointed layers, each with a running-scale buffer that a forward hook-free EMA updates
between the forward and the backward: every layer diverges for the same reason."""
import torch
import torch.nn as nn
import torch.utils.checkpoint as cp

torch.manual_seed(0)


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.register_buffer("scale", torch.ones(16))

    def forward(self, x):
        return torch.tanh(self.lin(x) * self.scale)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(6))

    def forward(self, x):
        for layer in self.layers:
            x = cp.checkpoint(layer, x, use_reentrant=False)
        return x


net = Net()
out = net(torch.randn(8, 16))
with torch.no_grad():  # the bug: a statistics update between the forward and the backward
    for layer in net.layers:
        layer.scale.mul_(0.9).add_(0.1 * torch.rand(16))
out.pow(2).mean().backward()
