"""Capture: what ac-diff hooks into torch to see checkpointed regions (`torch_compat`, the one place that
knows torch's private checkpoint internals, release by release).

    from ac_diff.capture import CheckpointHooks
    hooks = CheckpointHooks(listener); warnings = hooks.install()   # [] or one line per reduced mode
"""

from .torch_compat import REDUCED_MODES, CheckpointHooks

__all__ = ["CheckpointHooks", "REDUCED_MODES"]
