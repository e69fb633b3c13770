"""`--non-reentrant`: every checkpoint call runs with `use_reentrant=False`, so tensors a region hands out
other than through its outputs (router logits a hook collects) keep their gradient, and a region without
inputs that require grad still gives its parameters gradients.

    NonReentrant().apply(call)   # -> "use_reentrant=False" when the call was reentrant, else None
"""

from __future__ import annotations

from .call import CheckpointCall


class NonReentrant:
    kind = "non_reentrant"

    def apply(self, call: CheckpointCall) -> str | None:
        if not call.reentrant or call.bypass:
            return None
        call.kwargs["use_reentrant"] = False
        call.reentrant = False
        return "use_reentrant=False"
