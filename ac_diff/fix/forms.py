"""The exact form of a verified remedy in the user's code: plain PyTorch, Hugging Face, torchtitan.

    code_for(candidate)  ->  'checkpoint(block, x, use_reentrant=False, preserve_rng_state=True)\\n'
                             '# Hugging Face: model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=...)\\n'
                             '# torchtitan (TOML): [activation_checkpoint] preserve_rng_state = true'
"""

from __future__ import annotations

import torch

from ..diagnosis.suggest import GENERATOR_SWAP, OBSERVERS_OFF, PARAMETRIZED_ONCE, sac_policy
from ..oprules import OBSERVER_MODULE
from .candidates import Candidate


def code_for(c: Candidate) -> str:
    if c.kind == "combined":
        return "\n\n".join(code for code in map(code_for, c.parts) if code)
    if c.kind == "preserve_rng":
        return ("checkpoint(block, x, use_reentrant=False, preserve_rng_state=True)\n"
                "# Hugging Face: model.gradient_checkpointing_enable(gradient_checkpointing_kwargs="
                "{\"use_reentrant\": False, \"preserve_rng_state\": True})\n"
                "# torchtitan (TOML): [activation_checkpoint]\n#   preserve_rng_state = true")
    if c.kind == "non_reentrant":
        return ("checkpoint(block, x, use_reentrant=False)\n"
                "# Hugging Face: model.gradient_checkpointing_enable(gradient_checkpointing_kwargs="
                "{\"use_reentrant\": False})\n"
                "# checkpoint_wrapper / torchtitan: non-reentrant by default (CheckpointImpl.NO_REENTRANT)")
    if c.kind == "deterministic":
        return ("torch.use_deterministic_algorithms(True)  # at the start of the script\n"
                "# and in the environment, before CUDA starts: CUBLAS_WORKSPACE_CONFIG=:4096:8")
    if c.kind == "must_save" and c.op and c.own_policy:  # (ac-diff added it to the script's policy, not replaced it)
        return (f"# your checkpoint calls already pass a selective-AC policy (context_fn): add torch.ops.{c.op} to "
                "what it saves,\n# keeping everything it saves now (ac-diff verified it composed with your policy, "
                f"in {', '.join(c.spec.must_save_modules)}):\n"
                f"#   return CheckpointPolicy.MUST_SAVE if op in SAVE or op == torch.ops.{c.op} else ...\n"
                f"# torchtitan: add torch.ops.{c.op} to the per-op save list (_save_list / _op_sac_save_list in "
                "parallelize.py)")
    if c.kind == "must_save" and c.op:
        return (sac_policy([c.op], torch.__version__) + "\n"  # this torch ran the verifying try
                f"# (ac-diff verified saving it in {', '.join(c.spec.must_save_modules)}; this policy saves it in "
                "the whole region)\n"
                "# Hugging Face: gradient_checkpointing_kwargs={\"use_reentrant\": False, \"context_fn\": context_fn}\n"
                "# torchtitan (TOML): [activation_checkpoint]\n#   mode = \"selective\"\n#   selective_ac_option = \"op\"\n"
                f"#   and add torch.ops.{c.op} to the per-op save list (_save_list in parallelize.py)")
    if c.kind == "restore" and c.state == "generator":
        return ("# ac-diff restored the generator's forward state in every recompute (a simulation): make it so in "
                "the code -\n# hand the generator's state to the checkpointed function, which draws from it and, in the "
                "recompute, puts the generator back\n" + GENERATOR_SWAP + "\n"
                "# or draw from torch's default generator (preserve_rng_state=True restores it)")
    if c.kind == "restore" and all(".parametrizations." in name for name in c.spec.restore):
        return ("# ac-diff restored the forward's parametrization state in every recompute (a simulation): make it so "
                "in the code -\n# compute the parametrized weights once per step, outside the checkpointed regions\n"
                + PARAMETRIZED_ONCE)
    if c.kind == "restore" and all(f".{OBSERVER_MODULE}." in f".{name}" for name in c.spec.restore):
        return ("# ac-diff restored the quantization observers' ranges in every recompute (a simulation): make it so "
                "in the code -\n# turn the observers off while the backward runs\n" + OBSERVERS_OFF)
    if c.kind == "restore":
        names = ", ".join(f"`{name}`" for name in c.spec.restore)
        head = (f"# ac-diff restored the forward's {names} in every recompute (a simulation of the change): "
                "make the change -\n")
        if c.change is not None:  # the diagnosis's fix for that state (where the update goes, read before or after)
            every = [name for name in c.spec.restore if "*" in name]  # (the change names the first module's state)
            also = f"# the same for every module {', '.join(every)} names, not only the one shown\n" if every else ""
            return head + f"# {c.change[0]}\n" + also + c.change[1]
        return (head + f"# keep {names} as the forward saw it until its backward: change it only after "
                "loss.backward(), or pass the value\n# to the checkpointed function as an argument (checkpoint keeps "
                "its arguments for the recompute)\n"
                "out = checkpoint(block, x, value, use_reentrant=False)  # forward(x, value) uses `value`")
    if c.kind == "no_ac":
        module = ", ".join(c.spec.no_ac)
        return (f"# leave {module} out of activation checkpointing (it keeps its activations):\n"
                f"# do not wrap / checkpoint {module}; torchtitan: a selective_ac_option that skips it, "
                "Hugging Face: gradient_checkpointing_enable(every_n_layers=...) or set "
                "`gradient_checkpointing = False` on those layers")
    return ""
