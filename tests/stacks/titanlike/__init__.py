"""A tiny torchtitan-shaped training package, launched like torchtitan (`python -m titanlike.train --flag value`).

Only what matters for activation checkpointing is reproduced: blocks wrapped with
`checkpoint_wrapper` (torchtitan's `ptd_checkpoint_wrapper`), op-level selective AC through
`create_selective_checkpoint_contexts` with a per-op `_save_list`, and MoE layers with an aux-loss-free
load-balancing `expert_bias` (the model is ac-diff's bundled tiny MoE, `ac_diff._examples.tiny_moe`).
"""
