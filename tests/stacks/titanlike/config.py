"""torchtitan-style job config: dataclass sections set from `--section.field value` flags."""

from __future__ import annotations

import argparse
import dataclasses


@dataclasses.dataclass
class ActivationCheckpoint:
    mode: str = "selective"  # "none", "full" or "selective"
    selective_ac_option: str = "op"  # "op" (per-op save list) or N (checkpoint every N-th block)
    preserve_rng_state: bool = False  # torchtitan's default
    early_stop: bool = True
    determinism_check: str = "default"


@dataclasses.dataclass
class Training:
    steps: int = 2
    seed: int = 0
    batch_size: int = 2
    seq_len: int = 64
    lr: float = 3e-3


@dataclasses.dataclass
class Model:
    n_layers: int = 2
    num_experts: int = 8
    top_k: int = 2
    # where the load-balancing expert_bias update runs:
    #   optimizer_hook  an optimizer step pre-hook (torchtitan's placement: after backward)
    #   after_step      after optimizer.step() in the train loop
    #   forward_hook    a forward hook on every MoE module: between the forward and the recompute (wrong)
    bias_update: str = "optimizer_hook"


@dataclasses.dataclass
class JobConfig:
    activation_checkpoint: ActivationCheckpoint = dataclasses.field(default_factory=ActivationCheckpoint)
    training: Training = dataclasses.field(default_factory=Training)
    model: Model = dataclasses.field(default_factory=Model)


_TYPES = {"str": str, "int": int, "float": float, "bool": bool}
_SHORTCUTS = {"steps": "training.steps", "seed": "training.seed", "bias_update": "model.bias_update",
              "layers": "model.n_layers", "ac_mode": "activation_checkpoint.mode"}


def parse_args(argv=None) -> JobConfig:
    job = JobConfig()
    p = argparse.ArgumentParser(prog="python -m titanlike.train")
    for section in dataclasses.fields(job):
        for f in dataclasses.fields(getattr(job, section.name)):
            kind = _TYPES[f.type] if isinstance(f.type, str) else f.type
            conv = (lambda s: s.lower() in ("1", "true", "yes")) if kind is bool else kind
            p.add_argument(f"--{section.name}.{f.name}", dest=f"{section.name}.{f.name}", type=conv, default=None)
    for short, full in _SHORTCUTS.items():
        p.add_argument(f"--{short.replace('_', '-')}", dest=full, default=None,
                       type=int if full in ("training.steps", "training.seed", "model.n_layers") else str)
    for key, value in vars(p.parse_args(argv)).items():
        if value is not None:
            section, name = key.split(".")
            setattr(getattr(job, section), name, value)
    return job
