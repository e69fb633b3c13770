"""Activation checkpointing the way torchtitan applies it (`torchtitan/distributed/activation_checkpoint.py`).

mode "full": every block in `ptd_checkpoint_wrapper`; mode "selective" with selective_ac_option "op":
per-op SAC, the outputs of the ops in `_save_list` are saved (every second mm is recomputed), the
rest recomputed; selective_ac_option N: every N-th block fully checkpointed.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper as ptd_checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts


def _ops(*names):
    out = set()
    for name in names:
        packet, overload = name.rsplit(".", 1)
        op = getattr(torch.ops.aten, packet, None)
        if op is not None and hasattr(op, overload):
            out.add(getattr(op, overload))
    return out


# for selective op activation checkpointing: the ops whose outputs are saved, not recomputed
_save_list = {
    torch.ops.aten.mm.default,
    *_ops("_scaled_dot_product_efficient_attention.default", "_scaled_dot_product_flash_attention.default",
          "_scaled_dot_product_flash_attention_for_cpu.default", "_scaled_dot_product_cudnn_attention.default"),
    # for low precision training, it's useful to always save the result of max(abs(tensor))
    torch.ops.aten.abs.default,
    torch.ops.aten.max.default,
}


def _apply_op_sac(module: nn.Module, ac_config) -> nn.Module:
    def _get_custom_policy(meta):
        def _custom_policy(ctx, func, *args, **kwargs):
            mode = "recompute" if ctx.is_recompute else "forward"
            mm_count_key = f"{mode}_mm_count"
            if func == torch.ops.aten.mm.default:
                meta[mm_count_key] += 1
            # saves the output of all compute ops in the list, except every second mm
            to_save = func in _save_list and not (func == torch.ops.aten.mm.default and meta[mm_count_key] % 2 == 0)
            return CheckpointPolicy.MUST_SAVE if to_save else CheckpointPolicy.PREFER_RECOMPUTE
        return _custom_policy

    def selective_checkpointing_context_fn():
        meta = defaultdict(int)
        return create_selective_checkpoint_contexts(_get_custom_policy(meta))

    return ptd_checkpoint_wrapper(module, context_fn=selective_checkpointing_context_fn,
                                  preserve_rng_state=ac_config.preserve_rng_state,
                                  determinism_check=ac_config.determinism_check, early_stop=ac_config.early_stop)


def _apply_ac_to_transformer_block(module: nn.Module, ac_config, layer_index: int) -> nn.Module:
    if ac_config.mode == "full":
        return ptd_checkpoint_wrapper(module, preserve_rng_state=ac_config.preserve_rng_state,
                                      determinism_check=ac_config.determinism_check, early_stop=ac_config.early_stop)
    if ac_config.mode != "selective":
        raise ValueError(f"Invalid AC mode: {ac_config.mode}. Valid modes: full, selective, none")
    if ac_config.selective_ac_option == "op":
        return _apply_op_sac(module, ac_config)
    every = int(ac_config.selective_ac_option)
    if every and layer_index % every == 0:
        return ptd_checkpoint_wrapper(module, preserve_rng_state=ac_config.preserve_rng_state)
    return module


def apply_ac(model: nn.Module, ac_config) -> None:
    if ac_config.mode == "none":
        return
    for i, (layer_id, block) in enumerate(list(model.layers.named_children())):
        model.layers.register_module(layer_id, _apply_ac_to_transformer_block(block, ac_config, i))
