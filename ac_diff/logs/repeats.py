"""Repeated errors folded into one: the same CheckpointError printed N times is one TorchError with count N.

    tally = ErrorTally()
    tally.add(TorchError("metadata_mismatch", "...", rank=1, positions=[...], first_line=7, last_line=7), seq=0)
    tally.add(TorchError("metadata_mismatch", "...", rank=1, positions=[...], first_line=51, last_line=51), seq=1)
    tally.errors()   # [TorchError("metadata_mismatch", rank=1, ..., count=2, first_line=7, last_line=51)]

Errors are the same when `TorchError.same_as()` is (kind, rank, region, counts, every position's metadata),
whatever text another writer spliced into one of them. The tally holds one TorchError per distinct error,
so reading a log of any number of repetitions takes the memory of its distinct errors; `errors()` lists
them in the order their first repetition started (`seq`).
"""

from __future__ import annotations

from ac_diff.passes import TorchError


class ErrorTally:
    """Distinct errors, each with how often it came and where it came first and last."""

    __slots__ = ("_by_key",)

    def __init__(self) -> None:
        self._by_key: dict[tuple, tuple[int, TorchError]] = {}  # same_as() -> (seq of the first, the error)

    def __len__(self) -> int:
        return len(self._by_key)

    def add(self, err: TorchError, seq: int) -> None:
        """Count `err` (the `seq`-th error started); the first started stands for the others."""
        key = err.same_as()
        held = self._by_key.get(key)
        if held is None:
            self._by_key[key] = (seq, err)
            return
        first_seq, kept = held
        if seq < first_seq:  # errors are finished out of order when ranks interleave
            err.count += kept.count
            err.first_line, err.last_line = _span(err, kept)
            self._by_key[key] = (seq, err)
            return
        kept.count += err.count
        kept.first_line, kept.last_line = _span(kept, err)

    def errors(self) -> list[TorchError]:
        """The distinct errors, in the order their first repetition started."""
        return [err for _, err in sorted(self._by_key.values(), key=lambda held: held[0])]


def fold_errors(errors: list[TorchError]) -> list[TorchError]:
    """`errors` with repetitions folded into their first (the counts and lines added up)."""
    tally = ErrorTally()
    for seq, err in enumerate(errors):
        tally.add(err, seq)
    return tally.errors()


def _span(a: TorchError, b: TorchError) -> tuple[int | None, int | None]:
    """(first line, last line) of two repetitions together; None where neither knows its line."""
    firsts = [x for x in (a.first_line, b.first_line) if x is not None]
    lasts = [x for x in (a.last_line, b.last_line) if x is not None]
    return (min(firsts) if firsts else None), (max(lasts) if lasts else None)
