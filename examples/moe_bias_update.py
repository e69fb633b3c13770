"""MoE load-balancing bias updated between the forward and the recompute -> CheckpointError.

Mechanism (state mutated between forward and backward): aux-loss-free load balancing nudges each
MoE layer's ``expert_bias`` buffer towards under-used experts. Here the update runs in a forward
hook on every MoE module (one of the hook placements explored in torchtitan PR 1114), i.e. inside
the checkpointed block, right after the MoE forward. When backward recomputes the block, the router
adds the NEW bias to the same sigmoid scores, ``topk`` picks a different expert for a few near-tie
tokens, the ``histc`` counts change, and ``torch.split`` (``aten.split_with_sizes``) cuts the
routed tokens into different sizes.

What the user sees: the first ``loss.backward()`` raises a real
``torch.utils.checkpoint.CheckpointError: ... Recomputed values for the following tensors have
different metadata than during the forward pass. tensor at position 35: saved metadata:
{'shape': torch.Size([56, 64]), ...} recomputed metadata: {'shape': torch.Size([57, 64]), ...}``
(deterministic on CPU with the defaults; one token moved between experts in the last block, which
is recomputed first). The fix, ``moe_bias_update_fixed.py``, updates the bias after
``optimizer.step()`` instead.

    python examples/moe_bias_update.py            # crashes in the first backward
    python examples/moe_bias_update.py --debug --layers 1 --experts 2 --top-k 1
                                                  # same, with torch's debug=True dump (smallest)
"""

try:
    from . import tiny_moe  # imported as a package (ac_diff._examples)
except ImportError:
    import tiny_moe  # run as a script: examples/ is sys.path[0]


def main(argv=None):
    args = tiny_moe.example_parser(__doc__).parse_args(argv)
    print(f"moe_bias_update: {args.layers}-layer MoE, expert_bias updated in a forward hook "
          "(between forward and recompute); expect CheckpointError in the first backward", flush=True)
    tiny_moe.train(steps=args.steps, seed=args.seed, args=tiny_moe.model_args_from(args),
                   batch_size=args.batch_size, seq_len=args.seq_len, ac_mode=args.ac_mode,
                   bias_update="forward_hook", debug=args.debug)


if __name__ == "__main__":
    main()
