"""`--no-ac GLOB`: regions whose module matches run without checkpointing (the reference run: "*").

    NoAC(["layers.1"]).apply(call)   # call.bypass is True for layers.1 (and a segment containing it)
    NoAC(["segment 0-3"]).apply(call)  # ... for checkpoint_sequential's segment of modules 0 to 3, as reports name it
"""

from __future__ import annotations

from .call import CheckpointCall, matches


class NoAC:
    kind = "no_ac"

    unmatched_note = "a glob over the checkpointed regions' modules, as the report names them"

    def __init__(self, globs: list[str]) -> None:
        self.globs = list(globs)
        self._matched: set[str] = set()

    def apply(self, call: CheckpointCall) -> str | None:
        """What was done to this call ("AC off"), or None when the region does not match."""
        names = (*call.modules, call.region)  # (a segment by its name too)
        hit = [g for g in self.globs if any(matches(name, [g]) for name in names)]
        if hit:
            self._matched.update(hit)
            call.bypass = True
            return "AC off"
        return None

    def unmatched(self) -> list[str]:
        """The globs that named no checkpointed region (a misspelt module)."""
        return [g for g in self.globs if g not in self._matched]
