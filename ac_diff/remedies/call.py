"""One checkpoint call as the remedies see it: the function, its arguments, the region's module name.

    call = CheckpointCall(function, args, kwargs, region="layers.1", reentrant=False)
    call.bypass = True                       # run function(*args) without checkpointing
    call.kwargs["preserve_rng_state"] = True # what torch's checkpoint() gets
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Any


@dataclass
class CheckpointCall:
    function: Any
    args: tuple
    kwargs: dict
    region: str  # the checkpointed module's name ("layers.1"), "" for the root, "<fn>" for a bare function
    reentrant: bool
    bypass: bool = False
    modules: list[str] = field(default_factory=list)  # every module name the call covers (checkpoint_sequential)


def matches(name: str | None, globs: list[str]) -> bool:
    """`name` matches one of the globs: fnmatch on the whole name, or on a dotted prefix of it
    (`layers.1` covers `layers.1.moe.router`); "*" matches everything, nameless regions included."""
    if "*" in globs:
        return True
    if not name:
        return False
    parts = name.split(".")
    prefixes = [".".join(parts[:i]) for i in range(len(parts), 0, -1)]
    return any(fnmatch.fnmatchcase(p, g) for g in globs for p in prefixes)
