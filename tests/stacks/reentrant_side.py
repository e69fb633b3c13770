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
    python reentrant_side.py --no-aux --bias-update [--inplace-norm]
                                                          # load-balancing router bias updated in a forward hook:
                                                          # topk flips in the recompute; --inplace-norm normalises
                                                          # the top-k weights in place (as HF Mixtral does)
    python reentrant_side.py --no-aux --bias-update --gather-weights
                                                          # the weights are gathered from the biased scores:
                                                          # saving topk leaves them different in the recompute
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
        self.register_buffer("expert_bias", torch.zeros(experts))
        self.inplace_norm = False
        self.gather_weights = False

    def forward(self, x):
        logits = self.gate(x)
        scores = torch.softmax(logits, -1) + self.expert_bias
        if self.gather_weights:  # the decision's input feeds the weights too, not only through topk
            index = torch.topk(scores, 2, dim=-1).indices
            weights = scores.gather(-1, index)
        else:
            weights, index = torch.topk(scores, 2, dim=-1)
        if self.inplace_norm:
            weights /= weights.sum(-1, keepdim=True)
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


_bias_rng = torch.Generator().manual_seed(7)


@torch.no_grad()
def update_bias(block, inputs, output):
    """A load-balancing nudge of the router bias, in a forward hook: the recompute then sees the new bias."""
    block.expert_bias.add_(0.05 * torch.randn(block.expert_bias.shape, generator=_bias_rng))


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--reentrant", action="store_true")
    p.add_argument("--frozen-embedding", action="store_true", help="freeze the embedding; train the adapters only")
    p.add_argument("--no-aux", action="store_true", help="no router aux loss")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--no-preserve-rng", action="store_true", help="preserve_rng_state=False")
    p.add_argument("--bias-update", action="store_true", help="update expert_bias in a forward hook (wrong place)")
    p.add_argument("--inplace-norm", action="store_true", help="normalise the top-k weights in place")
    p.add_argument("--gather-weights", action="store_true", help="gather the top-k weights from the biased scores")
    p.add_argument("--unseeded", action="store_true", help="no torch.manual_seed (two processes differ)")
    p.add_argument("--distributed", action="store_true", help="under torchrun: gloo, gradients all-reduced as DDP does")
    args = p.parse_args(argv)
    rank = 0
    if args.distributed:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank = dist.get_rank()
    if not args.unseeded:
        torch.manual_seed(0)
    model = Model()
    model.reentrant = args.reentrant
    model.preserve_rng_state = not args.no_preserve_rng
    for layer in model.layers:
        layer.dropout.p = args.dropout
        layer.inplace_norm = args.inplace_norm
        layer.gather_weights = args.gather_weights
        if args.bias_update:  # aux-loss-free load balancing, but between the forward and the recompute
            layer.register_forward_hook(update_bias)
    router_logits = []
    for layer in model.layers:  # what HF's output_router_logits does: collect the gate's output on the side
        layer.gate.register_forward_hook(lambda m, i, o: router_logits.append(o))
    if args.frozen_embedding:
        for name, param in model.named_parameters():
            param.requires_grad_(name.startswith("embed") is False and "adapter" in name or name.startswith("head"))
        model.embed.weight.requires_grad_(False)
    opt = torch.optim.SGD([q for q in model.parameters() if q.requires_grad], lr=0.1)
    data = torch.Generator().manual_seed(100 + rank)  # each rank its own batches
    for step in range(args.steps):
        ids = torch.randint(0, 32, (4, 8), generator=data)
        router_logits.clear()
        logits = model(ids)
        loss = nn.functional.cross_entropy(logits, ids.flatten())
        if not args.no_aux:
            aux = sum(torch.logsumexp(r, -1).pow(2).mean() for r in router_logits)  # router z-loss
            loss = loss + 0.1 * aux
        loss.backward()
        if args.distributed:
            for q in model.parameters():
                if q.grad is not None:
                    dist.all_reduce(q.grad)
                    q.grad /= dist.get_world_size()
        opt.step()
        opt.zero_grad()
        print(f"step {step}: loss {loss.item():.4f}")
    if args.distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
