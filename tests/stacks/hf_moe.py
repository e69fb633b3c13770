"""A tiny Hugging Face transformers MoE (Mixtral or DeepSeek-V3 classes, built from a config, no download)
trained for a step or two with `gradient_checkpointing_enable`, exactly as a user's script would.

    ac-diff run --json r.json hf_moe.py --model mixtral                        # clean
    ac-diff run --json r.json hf_moe.py --model mixtral --attention-dropout 0.1 --no-preserve-rng
                                                       # silent rng: attention dropout not replayed
    ac-diff run --json r.json hf_moe.py --model mixtral --jitter 0.1 --no-preserve-rng
                                                       # silent rng: router jitter noise not replayed
    ac-diff run --json r.json hf_moe.py --model deepseek_v3 --bias-update forward_hook
                                                       # state_mutation: e_score_correction_bias
    python hf_moe.py --record-to DIR ...               # gradient_checkpointing_enable() BEFORE ac_diff.record()

Real mechanisms only (DESIGN.md section 5): the model's own dropout / `router_jitter_noise` with
`preserve_rng_state=False` passed through `gradient_checkpointing_kwargs`, and DeepSeek-V3's
aux-loss-free load-balancing `e_score_correction_bias` updated in a forward hook on the MoE block
(between the forward and the recompute) instead of after `optimizer.step()`.
"""

from __future__ import annotations

import argparse
import warnings

import torch


def build(args):
    if args.model == "mixtral":
        from transformers import MixtralConfig, MixtralForCausalLM

        config = MixtralConfig(
            vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=args.layers,
            num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
            max_position_embeddings=256, attention_dropout=args.attention_dropout,
            router_jitter_noise=args.jitter, tie_word_embeddings=False,
            output_router_logits=args.router_aux, router_aux_loss_coef=0.02,
        )
        config._attn_implementation = args.attn
        return MixtralForCausalLM(config)
    if args.model == "deepseek_v3":
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

        config = DeepseekV3Config(
            vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
            num_hidden_layers=args.layers, first_k_dense_replace=0, num_attention_heads=4, num_key_value_heads=4,
            n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
            kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
            max_position_embeddings=256, attention_dropout=args.attention_dropout, tie_word_embeddings=False,
        )
        config._attn_implementation = args.attn
        return DeepseekV3ForCausalLM(config)
    raise SystemExit(f"unknown --model {args.model}")


def routers(model):
    """(MoE block, its router) for every MoE layer of the model."""
    for name, module in model.named_modules():
        gate = getattr(module, "gate", None)
        if gate is not None and hasattr(gate, "e_score_correction_bias"):
            yield module, gate


@torch.no_grad()
def update_bias(moe, router, top_k_index, coeff=1e-2):
    """DeepSeek-V3's aux-loss-free load balancing: push the bias towards under-used experts."""
    counts = torch.bincount(top_k_index.flatten(), minlength=router.e_score_correction_bias.numel()).float()
    router.e_score_correction_bias.add_(coeff * torch.sign(counts.mean() - counts))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["mixtral", "deepseek_v3"], default="mixtral")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--attn", default="eager", help="attention implementation (eager, sdpa)")
    p.add_argument("--attention-dropout", type=float, default=0.0)
    p.add_argument("--jitter", type=float, default=0.0, help="Mixtral router_jitter_noise")
    p.add_argument("--reentrant", action="store_true", help="use_reentrant=True (older transformers' default)")
    p.add_argument("--router-aux", action="store_true",
                   help="Mixtral output_router_logits=True: the router aux loss joins the loss")
    p.add_argument("--no-preserve-rng", action="store_true", help="preserve_rng_state=False in the checkpoint kwargs")
    p.add_argument("--bias-update", choices=["none", "after_step", "forward_hook"], default="none",
                   help="where DeepSeek-V3's e_score_correction_bias is updated")
    p.add_argument("--record-to", default=None,
                   help="record with ac_diff.record() into this trace file, started AFTER gradient_checkpointing_enable")
    args = p.parse_args(argv)

    torch.manual_seed(0)
    model = build(args)
    gc_kwargs = {"use_reentrant": args.reentrant}
    if args.no_preserve_rng:
        gc_kwargs["preserve_rng_state"] = False
    with warnings.catch_warnings():  # 5.x deprecates the name in favour of activation_checkpointing_enable
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=gc_kwargs)
    model.train()

    last_routing = {}
    if args.bias_update != "none":
        for moe, router in routers(model):
            def remember(module, inputs, output, router=router, moe=moe):
                last_routing[moe] = output[2]  # top-k expert indices of this forward
            router.register_forward_hook(remember)
            if args.bias_update == "forward_hook":  # WRONG: between the forward and the backward's recompute
                moe.register_forward_hook(lambda m, i, o, router=router: update_bias(m, router, last_routing[m]))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def train():
        g = torch.Generator().manual_seed(1)
        for step in range(args.steps):
            ids = torch.randint(0, model.config.vocab_size, (args.batch_size, args.seq_len), generator=g)
            out = model(input_ids=ids, labels=ids)
            out.loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if args.bias_update == "after_step":  # right: the next forward sees the new bias
                for moe, router in routers(model):
                    update_bias(moe, router, last_routing[moe])
            print(f"step {step}: loss {out.loss.item():.4f}", flush=True)

    if args.record_to:
        import ac_diff

        with ac_diff.record(args.record_to):
            train()
    else:
        train()


if __name__ == "__main__":
    main()
