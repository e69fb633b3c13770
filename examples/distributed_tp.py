"""Tensor-parallel MoE transformer (DTensor) with checkpointed blocks, on CPU/gloo.

Every rank holds one tensor-parallel shard of each attention layer (``wq``/``wk``/``wv`` column-wise,
``wo`` row-wise, via ``torch.distributed.tensor.parallel``, so the forward runs an ``all_reduce``
inside every checkpointed block); the MoE router and experts are replicated. All ranks read the same
batch, as tensor parallelism requires, so the router on every rank must choose the same experts.

Mechanism (replicated computation disagrees across ranks): the router multiplies its input by
Switch-Transformer-style jitter noise (``--jitter``, a random op inside the checkpointed block).
With ``--per-rank-seed`` every rank seeds its RNG with ``seed + rank`` - the usual data-parallel
recipe for different dropout masks, wrong under tensor parallelism: the ranks draw different noise,
the routers pick different experts, and each shard computes the MoE for a different routing. No rank
raises anything, and each rank's recompute reproduces its own forward exactly (checkpoint restores
the RNG), so activation checkpointing is clean; the cross-rank report shows the disagreement at the
jitter op in ``layers.0.moe.router`` and, from the second step on, the replicated router and expert
weights that drifted apart (each rank trained them on its own routing).

    torchrun --nproc-per-node 2 -m ac_diff run -o out examples/distributed_tp.py                 # clean
    torchrun --nproc-per-node 2 -m ac_diff run -o out examples/distributed_tp.py --jitter 0.01 --per-rank-seed
"""

import torch
import torch.nn.functional as F

try:
    from . import tiny_moe  # imported as a package (ac_diff._examples)
    from .distributed_common import finish_distributed, init_distributed
except ImportError:
    import tiny_moe  # run as a script: examples/ is sys.path[0]
    from distributed_common import finish_distributed, init_distributed


class LocalHeadsAttention(tiny_moe.Attention):
    """tiny_moe's attention, shaped by its local number of heads, so it runs on a tensor-parallel shard."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        q, k, v = (w(x).view(bs, seqlen, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))


def add_router_jitter(model: tiny_moe.Transformer, eps: float) -> None:
    """Multiply each router's input by uniform noise in [1 - eps, 1 + eps] (Switch Transformer)."""
    def jitter(router, args):
        x = args[0]
        return (x * torch.empty_like(x).uniform_(1.0 - eps, 1.0 + eps), *args[1:])

    for moe in model.moe_layers():
        moe.router.register_forward_pre_hook(jitter)


def parallelize(model: tiny_moe.Transformer, mesh) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for block in model.layers.values():
        inner = getattr(block, "_checkpoint_wrapped_module", block)
        inner.attention.__class__ = LocalHeadsAttention  # same parameters; local heads after sharding
        parallelize_module(inner.attention, mesh, {"wq": ColwiseParallel(), "wk": ColwiseParallel(),
                                                   "wv": ColwiseParallel(), "wo": RowwiseParallel()})


def main(argv=None):
    parser = tiny_moe.example_parser(__doc__, steps=2)
    parser.add_argument("--jitter", type=float, default=0.0, help="router jitter noise eps (default %(default)s)")
    parser.add_argument("--per-rank-seed", action="store_true",
                        help="seed each rank's RNG with seed + rank (wrong under tensor parallelism)")
    args = parser.parse_args(argv)
    rank, world = init_distributed()
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model_args = tiny_moe.model_args_from(args)
    if model_args.n_heads % world:
        raise SystemExit(f"{model_args.n_heads} heads do not split over {world} ranks")
    model = tiny_moe.build_model(model_args, seed=args.seed, ac_mode=args.ac_mode)
    parallelize(model, mesh)
    if args.jitter:
        add_router_jitter(model, args.jitter)
    torch.manual_seed(args.seed + (rank if args.per_rank_seed else 0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(args.steps):
        # tensor parallelism: every rank reads the same batch
        inputs, labels = tiny_moe.make_batch(model_args, step, seed=args.seed, batch_size=args.batch_size,
                                             seq_len=args.seq_len)
        loss = tiny_moe.loss_fn(model(inputs), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        for moe in model.moe_layers():
            tiny_moe.update_expert_bias(moe)
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)
    finish_distributed()


if __name__ == "__main__":
    main()
