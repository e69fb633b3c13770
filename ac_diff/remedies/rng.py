"""`--preserve-rng`: every checkpoint call gets `preserve_rng_state=True`, so the recompute replays the
forward's CPU and device RNG (dropout, router jitter noise).

    PreserveRng().apply(call)   # -> "preserve_rng_state=True" when the call had it off, else None
"""

from __future__ import annotations

from .call import CheckpointCall


class PreserveRng:
    kind = "preserve_rng"

    def apply(self, call: CheckpointCall) -> str | None:
        if call.kwargs.get("preserve_rng_state", True):
            return None  # torch's default: already on
        call.kwargs["preserve_rng_state"] = True
        return "preserve_rng_state=True"
