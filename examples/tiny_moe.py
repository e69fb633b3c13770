"""A tiny torchtitan-llama4-like MoE transformer, shared by the bundled examples.

Small enough to train for a few steps on a CPU in seconds. The MoE layer follows
torchtitan's ``torchtitan/models/moe.py`` (token-choice top-k router with sigmoid scores,
aux-loss-free load balancing through an ``expert_bias`` buffer, ``histc`` token counts,
``argsort`` reordering, gather, the for-loop ``GroupedExperts`` that splits tokens with
``torch.split(x, counts.tolist())`` and a ``scatter_add`` back). Module names match torchtitan:

    tok_embeddings
    layers.{i}                      TransformerBlock (the checkpointed region)
    layers.{i}.attention            causal self-attention (wq, wk, wv, wo)
    layers.{i}.moe                  MoE (buffers expert_bias, tokens_per_expert)
    layers.{i}.moe.router.gate      nn.Linear(dim, num_experts)
    layers.{i}.moe.experts          GroupedExperts (w1, w2, w3)
    norm, output

``apply_ac`` wraps every block for non-reentrant activation checkpointing; with
``mode="checkpoint_wrapper"`` (torchtitan's way) the block moves under
``layers.{i}._checkpoint_wrapped_module``, with ``mode="checkpoint"`` under ``layers.{i}.block``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint, set_checkpoint_debug_enabled


@dataclasses.dataclass
class ModelArgs:
    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    num_experts: int = 8
    top_k: int = 2
    hidden_dim: int = 128  # per-expert FFN hidden size
    dropout: float = 0.0  # residual dropout on the MoE output
    load_balance_coeff: Optional[float] = 1e-3  # torchtitan's default


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads = args.n_heads
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.dim, bias=False)
        self.wk = nn.Linear(args.dim, args.dim, bias=False)
        self.wv = nn.Linear(args.dim, args.dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, seqlen, dim = x.shape
        q, k, v = (w(x).view(bs, seqlen, self.n_heads, self.head_dim).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, dim))


class TokenChoiceTopKRouter(nn.Module):
    def __init__(self, dim: int, num_experts: int, top_k: int):
        super().__init__()
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.num_experts = num_experts
        self.top_k = top_k

    def forward(self, x: torch.Tensor, expert_bias: Optional[torch.Tensor] = None):
        # x: [tokens, dim]
        return self.route(self.gate(x), expert_bias)

    def route(self, logits: torch.Tensor, expert_bias: Optional[torch.Tensor] = None):
        scores = torch.sigmoid(logits.to(torch.float32))
        if expert_bias is not None:
            # the bias only steers the selection; the gate weights stay the raw scores
            _, selected_experts_indices = torch.topk(scores + expert_bias, k=self.top_k, dim=1)
            top_scores = scores.gather(dim=1, index=selected_experts_indices)
        else:
            top_scores, selected_experts_indices = torch.topk(scores, k=self.top_k, dim=1)
        # histc has no integer kernel on CPU, hence the float()
        num_tokens_per_expert = torch.histc(
            selected_experts_indices.view(-1).float(),
            bins=self.num_experts, min=0, max=self.num_experts,
        )
        return top_scores, selected_experts_indices, num_tokens_per_expert


class GroupedExperts(nn.Module):
    """torchtitan's GroupedExperts, for-loop implementation (no grouped_mm)."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        for w in (self.w1, self.w2, self.w3):
            nn.init.trunc_normal_(w, std=0.02)

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        # a host list of sizes: aten.split_with_sizes gets data-dependent shapes
        counts = num_tokens_per_expert.to(torch.int64).tolist()
        out_experts_splits = []
        for expert_idx, x_expert in enumerate(torch.split(x, counts, dim=0)):
            h = F.silu(torch.matmul(x_expert, self.w1[expert_idx].transpose(-2, -1)))
            h = h * torch.matmul(x_expert, self.w3[expert_idx].transpose(-2, -1))
            out_experts_splits.append(torch.matmul(h, self.w2[expert_idx].transpose(-2, -1)))
        return torch.cat(out_experts_splits, dim=0)


class MoE(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.experts = GroupedExperts(args.dim, args.hidden_dim, args.num_experts)
        self.router = TokenChoiceTopKRouter(args.dim, args.num_experts, args.top_k)
        self.top_k = args.top_k
        self.load_balance_coeff = args.load_balance_coeff
        if self.load_balance_coeff is not None:
            self.register_buffer("expert_bias", torch.zeros(args.num_experts), persistent=True)
        else:
            self.expert_bias = None
        # counted in forward, consumed by update_expert_bias (like torchtitan)
        self.register_buffer("tokens_per_expert", torch.zeros(args.num_experts), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, slen, dim = x.shape
        x = x.view(-1, dim)
        top_scores, selected_experts_indices, num_tokens_per_expert = self.router(x, self.expert_bias)
        with torch.no_grad():
            self.tokens_per_expert.add_(num_tokens_per_expert)

        # reorder token -> expert assignments so each expert's tokens are contiguous
        token_indices_experts_sorted = torch.argsort(selected_experts_indices.view(-1), stable=True)
        top_scores_experts_sorted = top_scores.view(-1)[token_indices_experts_sorted]
        token_indices_experts_sorted = token_indices_experts_sorted // self.top_k
        token_indices_experts_sorted = token_indices_experts_sorted.reshape(-1, 1).expand(-1, dim)

        routed_input = torch.gather(x, dim=0, index=token_indices_experts_sorted)
        routed_output = self.experts(routed_input, num_tokens_per_expert)
        routed_output = (routed_output.to(torch.float32)
                         * top_scores_experts_sorted.reshape(-1, 1)).to(x.dtype)

        out = torch.zeros_like(x).scatter_add(dim=0, index=token_indices_experts_sorted, src=routed_output)
        return out.reshape(bs, slen, dim)


@torch.no_grad()
def update_expert_bias(moe: MoE) -> None:
    """torchtitan's aux-loss-free load-balancing update, for one MoE layer."""
    if moe.load_balance_coeff is None:
        return
    tpe = moe.tokens_per_expert
    delta = moe.load_balance_coeff * torch.sign(tpe.mean() - tpe)
    moe.expert_bias.add_(delta - delta.mean())
    tpe.zero_()


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim)
        self.moe = MoE(args)
        self.dropout = nn.Dropout(args.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.dropout(self.moe(self.ffn_norm(h)))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))

    def moe_layers(self):
        return [m for m in self.modules() if isinstance(m, MoE)]


class CheckpointedBlock(nn.Module):
    """Plain wrapper that runs the wrapped block under torch.utils.checkpoint.checkpoint."""

    def __init__(self, block: nn.Module, preserve_rng_state: bool = True):
        super().__init__()
        self.block = block
        self.preserve_rng_state = preserve_rng_state

    def forward(self, *args, **kwargs):
        return checkpoint(self.block, *args, use_reentrant=False,
                          preserve_rng_state=self.preserve_rng_state, **kwargs)


def apply_ac(model: Transformer, mode: str = "checkpoint_wrapper", preserve_rng_state: bool = True) -> Transformer:
    """Wrap every transformer block for (full, non-reentrant) activation checkpointing."""
    if mode == "none":
        return model
    for layer_id, block in list(model.layers.named_children()):
        if mode == "checkpoint":
            wrapped = CheckpointedBlock(block, preserve_rng_state=preserve_rng_state)
        elif mode == "checkpoint_wrapper":
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
                CheckpointImpl, checkpoint_wrapper)
            wrapped = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                                         preserve_rng_state=preserve_rng_state)
        else:
            raise ValueError(f"unknown AC mode {mode!r}: use checkpoint, checkpoint_wrapper or none")
        model.layers.register_module(layer_id, wrapped)
    return model


def build_model(args: ModelArgs, seed: int = 0, ac_mode: str = "checkpoint_wrapper",
                preserve_rng_state: bool = True) -> Transformer:
    torch.manual_seed(seed)
    return apply_ac(Transformer(args), mode=ac_mode, preserve_rng_state=preserve_rng_state)


def make_batch(args: ModelArgs, step: int, seed: int = 0, batch_size: int = 2, seq_len: int = 128):
    """Deterministic, learnable token sequences (inputs, next-token labels) for one step.

    Each row follows t[i+1] = (5 * t[i] + 3) % vocab_size from a random start, so the loss drops.
    """
    g = torch.Generator().manual_seed(seed * 1000 + step)
    tokens = torch.empty(batch_size, seq_len + 1, dtype=torch.int64)
    tokens[:, 0] = torch.randint(0, args.vocab_size, (batch_size,), generator=g)
    for i in range(seq_len):
        tokens[:, i + 1] = (5 * tokens[:, i] + 3) % args.vocab_size
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


def train(*, steps: int = 3, seed: int = 0, args: Optional[ModelArgs] = None,
          bias_update: Optional[str] = "after_step", ac_mode: str = "checkpoint_wrapper",
          preserve_rng_state: bool = True, batch_size: int = 2, seq_len: int = 128,
          lr: float = 3e-3, debug: bool = False, model: Optional[Transformer] = None,
          aux_loss_fn: Optional[Callable[[Transformer], torch.Tensor]] = None,
          log: Callable[[str], None] = print) -> list[float]:
    """Train a few steps; returns the losses.

    bias_update: where the aux-loss-free load-balancing update of ``expert_bias`` happens:
      "after_step"   after optimizer.step() (correct: the next forward sees the new bias)
      "forward_hook" in a forward hook on each MoE module (wrong: the bias changes between the
                     forward and the backward's recompute of the same step)
      None           never
    aux_loss_fn: called after each forward; its result is added to the loss.
    debug: run under torch.utils.checkpoint.set_checkpoint_debug_enabled(True).
    """
    args = args or ModelArgs()
    if model is None:
        model = build_model(args, seed=seed, ac_mode=ac_mode, preserve_rng_state=preserve_rng_state)
    if bias_update == "forward_hook":
        for moe in model.moe_layers():
            moe.register_forward_hook(lambda mod, inputs, output: update_expert_bias(mod))
    elif bias_update not in ("after_step", None):
        raise ValueError(f"unknown bias_update {bias_update!r}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)

    losses = []
    debug_ctx = set_checkpoint_debug_enabled(True) if debug else contextlib.nullcontext()
    with debug_ctx:
        for step in range(steps):
            inputs, labels = make_batch(args, step, seed=seed, batch_size=batch_size, seq_len=seq_len)
            loss = loss_fn(model(inputs), labels)
            if aux_loss_fn is not None:
                loss = loss + aux_loss_fn(model)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if bias_update == "after_step":
                for moe in model.moe_layers():
                    update_expert_bias(moe)
            losses.append(loss.item())
            log(f"step {step}: loss {loss.item():.4f}")
    return losses


def example_parser(description: str, steps: int = 3) -> argparse.ArgumentParser:
    """The command-line flags every bundled example takes."""
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=steps, help="training steps (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default %(default)s)")
    p.add_argument("--debug", action="store_true",
                   help="run under torch.utils.checkpoint.set_checkpoint_debug_enabled(True)")
    p.add_argument("--layers", type=int, default=ModelArgs.n_layers,
                   help="transformer blocks (default %(default)s)")
    p.add_argument("--experts", type=int, default=ModelArgs.num_experts,
                   help="experts per MoE layer (default %(default)s)")
    p.add_argument("--top-k", type=int, default=ModelArgs.top_k, help="experts per token (default %(default)s)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default %(default)s)")
    p.add_argument("--batch-size", type=int, default=2, help="sequences per step (default %(default)s)")
    p.add_argument("--ac-mode", choices=["checkpoint_wrapper", "checkpoint"], default="checkpoint_wrapper",
                   help="how blocks are wrapped for activation checkpointing (default %(default)s)")
    return p


def model_args_from(cli: argparse.Namespace, **overrides) -> ModelArgs:
    """ModelArgs from the example_parser flags (--layers, --experts, --top-k)."""
    return ModelArgs(n_layers=cli.layers, num_experts=cli.experts, top_k=cli.top_k, **overrides)
