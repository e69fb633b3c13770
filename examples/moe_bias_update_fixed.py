"""The fix for moe_bias_update.py: update the MoE load-balancing bias after optimizer.step().

Same model, data and training loop as ``moe_bias_update.py``; the only difference is where the
aux-loss-free load-balancing update of ``expert_bias`` runs: after ``optimizer.step()`` (where
torchtitan runs it), so the forward and the backward's recompute of a step see the same bias and
route every token to the same experts. The next step's forward picks up the new bias.

What the user sees: a few training steps with a falling loss and no error.

    python examples/moe_bias_update_fixed.py
"""

try:
    from . import tiny_moe  # imported as a package (ac_diff._examples)
except ImportError:
    import tiny_moe  # run as a script: examples/ is sys.path[0]


def main(argv=None):
    args = tiny_moe.example_parser(__doc__).parse_args(argv)
    losses = tiny_moe.train(steps=args.steps, seed=args.seed, args=tiny_moe.model_args_from(args),
                            batch_size=args.batch_size, seq_len=args.seq_len, ac_mode=args.ac_mode,
                            bias_update="after_step", debug=args.debug)
    print(f"moe_bias_update_fixed: {len(losses)} steps, expert_bias updated after optimizer.step(); "
          "recompute matched the forward (no CheckpointError)")


if __name__ == "__main__":
    main()
