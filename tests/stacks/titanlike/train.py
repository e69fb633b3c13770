"""The trainer: `python -m titanlike.train --steps 2 --bias-update forward_hook` (or torchtitan-style
`--activation_checkpoint.mode full`, `--activation_checkpoint.selective_ac_option op`, `--model.bias_update ...`)."""

from __future__ import annotations

import torch

from ac_diff._examples import tiny_moe

from .activation_checkpoint import apply_ac
from .config import parse_args


def build_optimizer(model, job):
    optimizer = torch.optim.AdamW(model.parameters(), lr=job.training.lr)
    if job.model.bias_update == "optimizer_hook":
        # torchtitan: the load-balancing update is an optimizer step pre-hook (after backward)
        def _update_expert_bias(optimizer, args, kwargs):
            for moe in model.moe_layers():
                tiny_moe.update_expert_bias(moe)

        optimizer.register_step_pre_hook(_update_expert_bias)
    return optimizer


def main(argv=None):
    job = parse_args(argv)
    args = tiny_moe.ModelArgs(n_layers=job.model.n_layers, num_experts=job.model.num_experts, top_k=job.model.top_k)
    torch.manual_seed(job.training.seed)
    model = tiny_moe.Transformer(args)
    apply_ac(model, job.activation_checkpoint)
    if job.model.bias_update == "forward_hook":
        for moe in model.moe_layers():
            moe.register_forward_hook(lambda mod, inputs, output: tiny_moe.update_expert_bias(mod))
    elif job.model.bias_update not in ("optimizer_hook", "after_step", "none"):
        raise SystemExit(f"unknown --model.bias_update {job.model.bias_update!r}")
    optimizer = build_optimizer(model, job)
    ac = job.activation_checkpoint
    print(f"titanlike: {args.n_layers} MoE blocks, activation_checkpoint.mode={ac.mode} "
          f"selective_ac_option={ac.selective_ac_option}, expert_bias update: {job.model.bias_update}", flush=True)
    for step in range(job.training.steps):
        inputs, labels = tiny_moe.make_batch(args, step, seed=job.training.seed, batch_size=job.training.batch_size,
                                             seq_len=job.training.seq_len)
        loss = tiny_moe.loss_fn(model(inputs), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if job.model.bias_update == "after_step":
            for moe in model.moe_layers():
                tiny_moe.update_expert_bias(moe)
        print(f"step {step + 1}: loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
