"""What reentrant checkpoint silently drops, in a small seeded MoE-style model (real mechanisms only).

    python reentrant_side.py --reentrant                  # router logits collected by a forward hook -> aux loss:
                                                          # under use_reentrant=True they carry no gradient
    python reentrant_side.py                              # use_reentrant=False: the aux loss has a gradient
    python reentrant_side.py --reentrant --frozen-embedding --no-aux
                                                          # frozen embedding + adapters: no region input requires
                                                          # grad, the adapters get no gradient (torch warns once)
    python reentrant_side.py --no-aux --dropout 0.1 --no-preserve-rng
                                                          # dropout in the region, preserve_rng_state=False: the
                                                          # recompute draws another mask (a recompute divergence)
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


class Block(nn.Module):
    def __init__(self, dim: int, experts: int) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList([nn.Linear(dim, dim) for _ in range(experts)])
        self.adapter = nn.Linear(dim, dim, bias=False)
        self.dropout = nn.Dropout(0.0)

    def forward(self, x):
        logits = self.gate(x)
        weights, index = torch.topk(torch.softmax(logits, -1), 2, dim=-1)
        out = torch.zeros_like(x)
        for k in range(2):
            for e, expert in enumerate(self.experts):
                mask = (index[:, k] == e).unsqueeze(-1).to(x.dtype)
                out = out + mask * weights[:, k:k + 1] * expert(x)
        return x + self.dropout(out) + self.adapter(x)


class Model(nn.Module):
    def __init__(self, dim: int = 16, experts: int = 4, layers: int = 2, vocab: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([Block(dim, experts) for _ in range(layers)])
        self.head = nn.Linear(dim, vocab)
        self.reentrant = False
        self.preserve_rng_state = True

    def forward(self, ids):
        h = self.embed(ids).flatten(0, 1)
        for layer in self.layers:
            h = checkpoint(layer, h, use_reentrant=self.reentrant, preserve_rng_state=self.preserve_rng_state)
        return self.head(h)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--reentrant", action="store_true")
    p.add_argument("--frozen-embedding", action="store_true", help="freeze the embedding; train the adapters only")
    p.add_argument("--no-aux", action="store_true", help="no router aux loss")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--no-preserve-rng", action="store_true", help="preserve_rng_state=False")
    p.add_argument("--unseeded", action="store_true", help="no torch.manual_seed (two processes differ)")
    args = p.parse_args(argv)
    if not args.unseeded:
        torch.manual_seed(0)
    model = Model()
    model.reentrant = args.reentrant
    model.preserve_rng_state = not args.no_preserve_rng
    for layer in model.layers:
        layer.dropout.p = args.dropout
    router_logits = []
    for layer in model.layers:  # what HF's output_router_logits does: collect the gate's output on the side
        layer.gate.register_forward_hook(lambda m, i, o: router_logits.append(o))
    if args.frozen_embedding:
        for name, param in model.named_parameters():
            param.requires_grad_(name.startswith("embed") is False and "adapter" in name or name.startswith("head"))
        model.embed.weight.requires_grad_(False)
    opt = torch.optim.SGD([q for q in model.parameters() if q.requires_grad], lr=0.1)
    for step in range(args.steps):
        ids = torch.randint(0, 32, (4, 8))
        router_logits.clear()
        logits = model(ids)
        loss = nn.functional.cross_entropy(logits, ids.flatten())
        if not args.no_aux:
            aux = sum(torch.logsumexp(r, -1).pow(2).mean() for r in router_logits)  # router z-loss
            loss = loss + 0.1 * aux
        loss.backward()
        opt.step()
        opt.zero_grad()
        print(f"step {step}: loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
