"""Module names as users wrote them: wrapper segments they never wrote are stripped.

    clean_fqn("layers.1._checkpoint_wrapped_module.moe") -> "layers.1.moe"
    clean_fqn("_orig_mod.layers.0")                      -> "layers.0"
    segment_name(0, 3) -> "segment 0-3"                  (a checkpoint_sequential segment, as reports name it)
"""

from __future__ import annotations

WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module", "_fsdp_module")


def clean_fqn(name: str) -> str:
    """`layers.1._checkpoint_wrapped_module.moe` -> `layers.1.moe`."""
    if not any(seg in name for seg in WRAPPER_SEGMENTS):
        return name
    return ".".join(p for p in name.split(".") if p not in WRAPPER_SEGMENTS)


SEGMENT = "segment "  # how a checkpoint_sequential segment's region is named: by its range of modules


def segment_name(start: int, end: int) -> str:
    return f"{SEGMENT}{start}-{end}"


def is_segment(name: str | None) -> bool:
    """`name` is a checkpoint_sequential segment's (`segment_name`), not a module's."""
    return bool(name) and name.startswith(SEGMENT) and name[len(SEGMENT):].replace("-", "").isdigit()
