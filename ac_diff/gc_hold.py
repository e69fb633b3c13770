"""Fewer garbage-collector passes where the collector has nothing to find.

    with collector_paused():   # no collection at all (the caller makes no reference cycles)
        pairs = build_many_objects()

    hold = YoungGenerationHold()   # while region passes are recorded:

    hold.push()      # the first push raises generation 0's threshold (700 -> 50,000 allocations)
    ...              # record a pass (passes may nest, and run on several threads)
    hold.pop()       # the last pop puts the user's thresholds back

Recording an op leaves a few small container objects behind (its row, its producer entry), so at
CPython's default threshold the collector runs every few dozen ops and costs about as much as the
recording itself. Raising the threshold only while passes run changes no value the training computes,
and not whether cyclic garbage made inside a region is freed, only when (a pass later at most).
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

RECORDING_THRESHOLD = 50_000


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic collector off inside (as the caller found it afterwards). For code that allocates many
    objects and makes no cycles: with torch loaded, each collection would rescan ~200k old objects."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class YoungGenerationHold:
    def __init__(self, threshold: int = RECORDING_THRESHOLD) -> None:
        self._threshold = threshold
        self._depth = 0
        self._prior: tuple[int, ...] | None = None
        self._lock = threading.Lock()

    def push(self) -> None:
        with self._lock:
            self._depth += 1
            if self._depth == 1:
                prior = gc.get_threshold()
                if 0 < prior[0] < self._threshold:  # 0: collection is off; a higher one: the user's choice
                    self._prior = prior
                    gc.set_threshold(self._threshold, *prior[1:])

    def pop(self, all_: bool = False) -> None:
        """Undo one push (`all_`: every push still open, when recording stops inside a pass)."""
        with self._lock:
            if self._depth == 0:
                return
            self._depth = 0 if all_ else self._depth - 1
            if self._depth == 0 and self._prior is not None:
                if gc.get_threshold()[0] == self._threshold:  # unless the user set another one meanwhile
                    gc.set_threshold(*self._prior)
                self._prior = None
