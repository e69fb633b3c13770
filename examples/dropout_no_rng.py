"""Dropout in a checkpointed block with preserve_rng_state=False -> silently wrong gradients.

Mechanism (RNG not restored for the recompute): every block ends with a residual dropout on the
MoE output. ``checkpoint(..., preserve_rng_state=False)`` does not save and restore the RNG state,
so when backward recomputes a block, dropout draws a NEW mask from wherever the global RNG happens
to be. The mask has the same shape and dtype as the forward's, so torch's check (shapes, dtypes,
count) passes and nothing is raised, but backward multiplies the gradient by a mask that the
forward never used: the gradients are wrong.

What the user sees: training runs without any error. The script then computes one batch's
gradients three ways from the same weights, seed and batch (no checkpointing = reference,
checkpointing with ``preserve_rng_state=True``, and with ``False``) and prints the relative
gradient error of each, overall and for the worst parameter. With the defaults the ``False`` run's
MoE gradients (router gate, experts, ffn_norm) are off by ~35-40% (~1% over all parameters, as
the residual path carries most of the gradient); the ``True`` run matches exactly. Exits 0.

    python examples/dropout_no_rng.py
"""

import torch

try:
    from . import tiny_moe  # imported as a package (ac_diff._examples)
except ImportError:
    import tiny_moe  # run as a script: examples/ is sys.path[0]

DROPOUT = 0.1


def gradients(model_args, seed, ac_mode, preserve_rng_state, batch_size, seq_len):
    """One forward/backward on the first batch; returns {parameter FQN: gradient}."""
    model = tiny_moe.build_model(model_args, seed=seed, ac_mode=ac_mode, preserve_rng_state=preserve_rng_state)
    inputs, labels = tiny_moe.make_batch(model_args, 0, seed=seed, batch_size=batch_size, seq_len=seq_len)
    torch.manual_seed(seed)  # same dropout masks in every forward
    tiny_moe.loss_fn(model(inputs), labels).backward()
    return {name.replace("_checkpoint_wrapped_module.", "").replace(".block.", "."): p.grad
            for name, p in model.named_parameters()}


def relative_error(grads, ref):
    """(error over all parameters, worst parameter FQN, its error)."""
    per_param = {n: ((grads[n] - ref[n]).norm() / ref[n].norm()).item() for n in ref}
    worst = max(per_param, key=per_param.get)
    flat = lambda gs: torch.cat([g.flatten() for g in gs.values()])
    total = ((flat(grads) - flat(ref)).norm() / flat(ref).norm()).item()
    return total, worst, per_param[worst]


def main(argv=None):
    args = tiny_moe.example_parser(__doc__).parse_args(argv)
    model_args = tiny_moe.model_args_from(args, dropout=DROPOUT)
    shape = dict(batch_size=args.batch_size, seq_len=args.seq_len)

    # 1. train: no error, no warning
    model = tiny_moe.build_model(model_args, seed=args.seed, ac_mode=args.ac_mode, preserve_rng_state=False)
    tiny_moe.train(steps=args.steps, seed=args.seed, args=model_args, model=model, debug=args.debug, **shape)

    # 2. but the gradients are not those of the model that was run
    ref = gradients(model_args, args.seed, "none", True, **shape)
    print("gradients of one batch, same weights, seed and dropout masks in the forward:")
    for preserve in (True, False):
        total, worst, worst_err = relative_error(
            gradients(model_args, args.seed, args.ac_mode, preserve, **shape), ref)
        result = (f"{total:.2%} overall, {worst_err:.2%} worst ({worst})" if worst_err > 0
                  else "0 (bit-identical)")
        print(f"  checkpoint(preserve_rng_state={preserve}): relative gradient error vs. no checkpointing {result}")
    print(f"dropout_no_rng: trained {args.steps} steps with dropout p={DROPOUT} in {args.layers} checkpointed "
          "blocks and preserve_rng_state=False: no error raised, but the gradients above are wrong")

if __name__ == "__main__":
    main()
