"""Repeated errors folded into one: the same CheckpointError printed N times is one TorchError with count N.

    tally = ErrorTally()
    tally.add(TorchError("metadata_mismatch", "...", rank=1, positions=[...], first_line=7, last_line=7), seq=0)
    tally.add(TorchError("metadata_mismatch", "...", rank=1, positions=[...], first_line=51, last_line=51), seq=1)
    tally.errors()   # [TorchError("metadata_mismatch", rank=1, ..., count=2, first_line=7, last_line=51)]

Errors are the same when `TorchError.same_as()` is (kind, rank, region, counts, every position's metadata),
whatever text another writer spliced into one of them. The tally holds one TorchError per distinct error,
so reading a log of any number of repetitions takes the memory of its distinct errors; `errors()` lists
them in the order their first repetition started (`seq`).

A `debug=True` dump printed again (an error logged with `logger.exception` and then re-raised, the same failing
step retried) is the same region: `fold_repeated_dumps` keeps its first printing, and its errors fold with it.

    regions, renumbered = fold_repeated_dumps(regions, keys)   # keys: (rank, dump_key()) per region
    # 2 regions of identical text on rank 0 -> 1 region; renumbered {(0, 0): 0, (0, 1): 0}: region 1's errors are
    # region 0's
"""

from __future__ import annotations

import hashlib

from ac_diff.passes import Region, TorchError


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


def dump_key(region: Region, ops: bytes) -> bytes:
    """What makes two printings of a dump the same: a digest of its module, options, passes and `ops` (its ops as
    spill.ops_bytes() pickles them)."""
    passes = [(p.phase, p.complete) if p is not None else None for p in (region.forward, region.recompute)]
    return hashlib.blake2b(repr((region.module, region.options, passes)).encode() + ops, digest_size=16).digest()


def fold_repeated_dumps(regions: list[Region], keys: list[tuple]) -> tuple[list[Region], dict[tuple, int]]:
    """`regions` (in log order; `keys[i]` = (the rank its lines carried, None for unprefixed lines; region i's
    dump_key)) with each rank's repeated dumps left out and the others numbered again from 0 per rank; and
    {(rank as its lines carried it, old region number): new number} for every region."""
    kept: list[Region] = []
    renumbered: dict[tuple, int] = {}
    first_of: dict[tuple, int] = {}  # key -> new number
    per_rank: dict[int | None, int] = {}
    for region, key in zip(regions, keys):
        owner = key[0]
        same = first_of.get(key)
        if same is None:
            same = first_of[key] = per_rank.get(owner, 0)
            per_rank[owner] = same + 1
            kept.append(region)
        renumbered[(owner, region.region)] = same
        region.region = same
    return kept, renumbered
