"""Data-parallel MoE where only rank 1 updates its router bias between forward and recompute.

Mechanism (state mutated between forward and backward, on one rank): aux-loss-free load balancing
nudges each MoE layer's ``expert_bias`` buffer towards under-used experts. Here the update runs in a
forward hook (inside the checkpointed block, as in ``moe_bias_update.py``), but the hook is
registered only on the ranks in ``--hook-ranks`` (default: rank 1) - as happens when registration
sits behind a rank check, or in code only some ranks run. Every rank holds the same model (same
seed) and trains on its own batch; gradients are averaged with ``all_reduce`` like DDP does.

On rank 1 the recompute of the last block adds the NEW bias to the same router scores, ``topk``
picks other experts for a few near-tie tokens, and ``torch.split`` (``aten.split_with_sizes``) cuts
the routed tokens differently: rank 1 raises a real CheckpointError in the first backward. Rank 0's
recompute reproduces its forward exactly; it then waits for rank 1's gradients, loses its peer and
fails too (or torchrun stops it). ac-diff reports rank 1 diverged (state_mutation of
``layers.1.moe.expert_bias``, first divergent op the ``add`` in ``layers.1.moe.router``), rank 0
clean, and that rank 1 failed first.

    torchrun --nproc-per-node 2 -m ac_diff run -o out examples/distributed_bias_update.py
    ac-diff run --nproc-per-node 2 -o out examples/distributed_bias_update.py     # the same
    ac-diff report out                                                           # again, later
"""

import torch
import torch.distributed as dist

try:
    from . import tiny_moe  # imported as a package (ac_diff._examples)
    from .distributed_common import finish_distributed, init_distributed, rank_list
except ImportError:
    import tiny_moe  # run as a script: examples/ is sys.path[0]
    from distributed_common import finish_distributed, init_distributed, rank_list


def main(argv=None):
    parser = tiny_moe.example_parser(__doc__, steps=1)
    parser.add_argument("--hook-ranks", default="1",
                        help="ranks that update expert_bias in a forward hook (default %(default)s; '' for none)")
    args = parser.parse_args(argv)
    rank, world = init_distributed()
    hook_ranks = rank_list(args.hook_ranks)
    model_args = tiny_moe.model_args_from(args)
    model = tiny_moe.build_model(model_args, seed=args.seed, ac_mode=args.ac_mode)  # same weights on every rank
    if rank in hook_ranks:
        for moe in model.moe_layers():
            moe.register_forward_hook(lambda mod, inputs, output: tiny_moe.update_expert_bias(mod))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    print(f"[rank {rank}/{world}] expert_bias update in a forward hook: "
          f"{'yes (expect CheckpointError in backward)' if rank in hook_ranks else 'no'}", flush=True)
    for step in range(args.steps):
        # each data-parallel rank trains on its own batch
        inputs, labels = tiny_moe.make_batch(model_args, step, seed=args.seed + 1000 * rank,
                                             batch_size=args.batch_size, seq_len=args.seq_len)
        loss = tiny_moe.loss_fn(model(inputs), labels)
        loss.backward()
        for p in model.parameters():  # what DDP does: average the gradients over the ranks
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= world
        optimizer.step()
        optimizer.zero_grad()
        print(f"[rank {rank}] step {step}: loss {loss.item():.4f}", flush=True)
    finish_distributed()


if __name__ == "__main__":
    main()
