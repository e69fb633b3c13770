"""Remember what a function made of a short text: a log repeats its lines (the same error, the same frames,
printed again every step and by every rank), so each distinct line is read once.

    segments = short_text_memo(split_segments)
    segments("[rank1]: tensor at position 48:", None)   # -> ([(1, "tensor at position 48:")], 1), computed
    segments("[rank1]: tensor at position 48:", None)   # the same objects again, from the memo

The memo keeps the last `maxsize` distinct calls of texts up to `max_len` characters (longer texts are
computed each time), so its memory is bounded whatever the log. What it returns is shared between calls:
callers read it and never change it.
"""

from __future__ import annotations

import functools
from typing import Callable, TypeVar

R = TypeVar("R")


def short_text_memo(fn: Callable[..., R], maxsize: int = 4096, max_len: int = 512) -> Callable[..., R]:
    """`fn(text, *args)`, remembered for texts of up to `max_len` characters (the args must be hashable)."""
    cached = functools.lru_cache(maxsize=maxsize)(fn)

    @functools.wraps(fn)
    def call(text: str, *args):
        return cached(text, *args) if len(text) <= max_len else fn(text, *args)

    return call
