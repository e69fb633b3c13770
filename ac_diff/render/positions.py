"""The saved-positions table's rows and title, for the terminal and HTML renderers alike:

    shown, value_only = split(region)   # positions whose metadata differ (or torch named), those whose values do
    title(region)  ->  "saved positions: 2 differ in metadata, 1 more holds other values (46 in all)"
                       "saved positions: 1 holds other values, none differ in metadata (12 in all)"
    label(row)     ->  "6", or "r6" for a tensor the recompute alone saved, at its position 6
"""

from __future__ import annotations

from typing import Any


def split(r: Any) -> tuple[list, list]:
    shown = [p for p in r.positions if p.matches is False or p.in_torch_error]
    value_only = [p for p in r.positions if p.values_differ and p.matches is not False and not p.in_torch_error]
    return shown, value_only


def title(r: Any) -> str:
    shown, value_only = split(r)
    values = f"{len(value_only)} {'holds' if len(value_only) == 1 else 'hold'} other values"
    if not shown:
        text = f"{values}, none differ in metadata" if value_only else "none differ"
    else:
        text = f"{len(shown)} differ{'s' if len(shown) == 1 else ''} in metadata"
        if value_only:
            text += f", {len(value_only)} more {'holds' if len(value_only) == 1 else 'hold'} other values"
    extra = [p for p in r.positions if recompute_only(p)]
    if extra:  # (numbered as the recompute saved them: a number can appear twice, once per pass)
        return (f"saved positions: {text} ({len(r.positions) - len(extra)} saved by the forward, {len(extra)} more by "
                "the recompute only, shown as r<its position>)")
    return f"saved positions: {text} ({len(r.positions)} in all)"


def recompute_only(p: Any) -> bool:
    """A tensor the recompute saved that no forward position pairs with (it saved other tensors)."""
    return p.saved is None and p.forward_index is None and p.origin != "unknown" and p.recomputed is not None


def label(p: Any) -> str:
    """How a table numbers the row: the position, `r` before one the recompute alone saved."""
    return f"r{p.position}" if recompute_only(p) else str(p.position)
