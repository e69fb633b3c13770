"""A call counter in forward takes another branch in the recompute -> CheckpointError.

Mechanism (Python control flow on state that the forward mutates): the MoE router adds a router
z-loss (ST-MoE) to the training loss once a warm-up is over. The warm-up is measured with a call
counter that ``forward`` bumps, meant to count training steps. But activation checkpointing calls
the router's ``forward`` a second time, in backward, to recompute the block: the counter advances
twice per step, and on the step where the forward is the last warm-up call the recompute is
already past it. The recompute then runs extra ops (``logsumexp``, ``pow``) that save tensors the
forward never saved, every later saved tensor shifts by three positions, and torch compares
unrelated tensors.

What the user sees (defaults: ``--warmup 5``): steps 0 and 1 train normally, then the backward of
step 2 raises a real ``torch.utils.checkpoint.CheckpointError: ... Recomputed values for the
following tensors have different metadata than during the forward pass. tensor at position 29:
saved metadata: {'shape': torch.Size([256, 2]), 'dtype': torch.int64, ...} recomputed metadata:
{'shape': torch.Size([256]), 'dtype': torch.float32, ...}`` and 44 more mismatched positions; the
first points at the router's topk/gather, nowhere near the counter. Deterministic: the counter, not the data, decides. (With an even
``--warmup`` nothing is raised; the warm-up silently ends after half the intended steps.)

    python examples/python_state_branch.py
"""

import torch

try:
    from . import tiny_moe  # imported as a package (ac_diff._examples)
except ImportError:
    import tiny_moe  # run as a script: examples/ is sys.path[0]

Z_LOSS_COEFF = 1e-3


class ZLossRouter(tiny_moe.TokenChoiceTopKRouter):
    """Token-choice router that adds a z-loss on its logits after `warmup` steps."""

    def __init__(self, dim, num_experts, top_k, warmup):
        super().__init__(dim, num_experts, top_k)
        self.warmup = warmup
        self.calls = 0  # "steps seen", bumped in forward (the bug: the recompute bumps it too)
        self.z_loss = None

    def forward(self, x, expert_bias=None):
        self.calls += 1
        logits = self.gate(x)
        if self.calls > self.warmup:
            self.z_loss = torch.logsumexp(logits.float(), dim=-1).pow(2).mean()
        return self.route(logits, expert_bias)


def use_z_loss_routers(model, warmup):
    for moe in model.moe_layers():
        old = moe.router
        moe.router = ZLossRouter(old.gate.in_features, old.num_experts, old.top_k, warmup)
        moe.router.gate = old.gate


def z_loss(model):
    losses = [moe.router.z_loss for moe in model.moe_layers() if moe.router.z_loss is not None]
    for moe in model.moe_layers():
        moe.router.z_loss = None
    return Z_LOSS_COEFF * sum(losses) if losses else torch.zeros(())


def main(argv=None):
    parser = tiny_moe.example_parser(__doc__, steps=4)
    parser.add_argument("--warmup", type=int, default=5, help="z-loss warm-up, in router calls (default %(default)s)")
    args = parser.parse_args(argv)
    model_args = tiny_moe.model_args_from(args)
    model = tiny_moe.build_model(model_args, seed=args.seed, ac_mode=args.ac_mode)
    use_z_loss_routers(model, args.warmup)
    print(f"python_state_branch: router z-loss enabled after a warm-up of {args.warmup} forward calls, "
          "counted in forward (the recompute counts too)", flush=True)
    tiny_moe.train(steps=args.steps, seed=args.seed, args=model_args, model=model, aux_loss_fn=z_loss,
                   batch_size=args.batch_size, seq_len=args.seq_len, debug=args.debug)
    print(f"python_state_branch: {args.steps} steps without a CheckpointError")


if __name__ == "__main__":
    main()
