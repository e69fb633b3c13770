"""A plain custom training loop with gradient accumulation over several micro-batches, checkpointed MoE blocks.

Schedules (micro-batches k = 1..N, F = forward, B = backward of that micro-batch's loss):
    summed       F1 F2 F3, loss = sum, one backward       (recomputes run mb3, mb2, mb1: reverse order)
    interleaved  F1 B1 F2 B2 F3 B3                        (the usual `loss / N; loss.backward()` loop)
    pipelined    F1 F2 B1 F3 B2 B3                        (1F1B-like: two micro-batches in flight)

`--update-bias-after N` runs the MoE load-balancing `expert_bias` update right after micro-batch N's
forward, before its backward (a real mistake: the update belongs after `optimizer.step()`). Every
micro-batch forwarded before the update and recomputed after it diverges; with `interleaved` that is
micro-batch N only.

    ac-diff run --json r.json grad_accum.py --schedule summed
    ac-diff run --json r.json grad_accum.py --schedule interleaved --update-bias-after 2
"""

from __future__ import annotations

import argparse

import torch

from ac_diff._examples import tiny_moe


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--schedule", choices=["summed", "interleaved", "pipelined"], default="summed")
    p.add_argument("--micro-batches", type=int, default=3)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--update-bias-after", type=int, default=None, metavar="N",
                   help="update expert_bias right after micro-batch N's forward (1-based)")
    args = p.parse_args(argv)

    margs = tiny_moe.ModelArgs(n_layers=2, num_experts=8, top_k=2)
    model = tiny_moe.build_model(margs, seed=0, ac_mode="checkpoint_wrapper")
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    n = args.micro_batches

    def forward(k):
        inputs, labels = tiny_moe.make_batch(margs, 100 * step + k, seed=0, batch_size=1, seq_len=args.seq_len)
        loss = tiny_moe.loss_fn(model(inputs), labels) / n
        print(f"step {step} micro-batch {k}: forward, loss {loss.item() * n:.4f}", flush=True)
        if args.update_bias_after == k:
            for moe in model.moe_layers():
                tiny_moe.update_expert_bias(moe)
        return loss

    def backward(k, loss):
        loss.backward()
        print(f"step {step} micro-batch {k}: backward", flush=True)

    for step in range(args.steps):
        if args.schedule == "summed":
            total = sum(forward(k) for k in range(1, n + 1))
            total.backward()
            print(f"step {step}: one backward for micro-batches 1-{n}", flush=True)
        elif args.schedule == "interleaved":
            for k in range(1, n + 1):
                backward(k, forward(k))
        else:  # pipelined: keep two micro-batches in flight
            in_flight = [(1, forward(1))]
            for k in range(2, n + 1):
                in_flight.append((k, forward(k)))
                backward(*in_flight.pop(0))
            for item in in_flight:
                backward(*item)
        optimizer.step()
        optimizer.zero_grad()
        if args.update_bias_after is None:  # the right place: after the optimizer step
            for moe in model.moe_layers():
                tiny_moe.update_expert_bias(moe)


if __name__ == "__main__":
    main()
