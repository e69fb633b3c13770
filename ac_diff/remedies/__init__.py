"""Remedies: change how checkpointing runs in the user's unmodified script, from process start.

    spec = RemedySpec(no_ac=["*"])                 # the reference run: AC off everywhere
    patch = CheckpointPatch(spec).install()        # before the script runs (ac-diff run, the reference child)
    patch.summary()                                # which remedy was applied to which region, how often

One module per remedy kind (`no_ac`, `rng`, `reentrant`, `deterministic`, `must_save`, `restore`), `spec`
(the value that travels to children and torchrun ranks in $AC_DIFF_REMEDIES) and `patch` (the one place
that reaches checkpoint(), checkpoint_wrapper, checkpoint_sequential and HF gradient checkpointing).
"""

from .patch import CheckpointPatch
from .spec import ENV, RemedySpec, split_ops

__all__ = ["CheckpointPatch", "ENV", "RemedySpec", "split_ops"]
