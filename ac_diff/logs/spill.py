"""A log's regions kept on disk while the log is read and diagnosed: memory holds one region's ops, not the log's.

    spill = RegionSpill()
    spill.put(region)             # its passes' ops pickled to a temporary file; the passes keep their op counts
    region.forward.ops            # -> []   (region.forward.state["n_ops"] -> 283)
    with spill.loaded(region):    # Run.ops_loader: the ops are back for the block, their `$N` ids linked
        region.forward.ops        # -> [OpRecord(index=0, op="aten.mm.default", ...), ...]
    region.forward.ops            # -> [] again

A `debug=True` dump lists every op of both passes (a 200 MB log: ~900 regions, ~900k ops, ~1.2 GB as objects);
parse_log(lazy=True) hands each finished region here, and the diagnosis loads one region at a time, as it does for
a trace read lazily. The file is unnamed and goes when the spill is closed or collected.
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
import pickle
import tempfile
from collections.abc import Iterator

from ac_diff.passes import OpRecord, Pass, Region

# An op as the tuple of its fields: pickled twice as fast as the dataclass (whose state pickle asks for in Python)
_FIELDS = tuple(f.name for f in dataclasses.fields(OpRecord) if f.init)
_ROW = operator.attrgetter(*_FIELDS)


class RegionSpill:
    """The ops of a log's regions, in one temporary file."""

    def __init__(self) -> None:
        self._file = tempfile.TemporaryFile(prefix="ac-diff-log-")
        # id(region) -> (offset, length) of its passes' ops, and the region (held: its id is not reused)
        self._at: dict[int, tuple[int, int, Region]] = {}

    def put(self, region: Region, data: bytes | None = None) -> Region:
        """Move the region's ops to the file (a region without ops stays as it is); returns the region. `data`: its
        ops_bytes(), where the caller has them already."""
        passes = _passes(region)
        if not any(p.ops for p in passes):
            return region
        if data is None:
            data = ops_bytes(region)
        offset = self._file.seek(0, 2)
        self._file.write(data)
        self._at[id(region)] = (offset, len(data), region)
        for p in passes:
            p.state["n_ops"] = len(p.ops)
            p.ops = []
        return region

    @contextlib.contextmanager
    def loaded(self, region: Region) -> Iterator[None]:
        """The region's ops for the block (nothing to do for one that was not spilled)."""
        at = self._at.get(id(region))
        if at is None:
            yield
            return
        from ac_diff.diagnosis import link_log_ids  # the diagnosis reads a log's `$N` ids as producers

        self._file.seek(at[0])
        passes = _passes(region)
        for p, rows in zip(passes, pickle.loads(self._file.read(at[1]))):
            p.ops = [OpRecord(*row) for row in rows]
            link_log_ids(p)
        try:
            yield
        finally:
            for p in passes:
                p.ops = []

    def close(self) -> None:
        self._file.close()


def _passes(region: Region) -> list[Pass]:
    return [p for p in (region.forward, region.recompute) if p is not None]


def ops_bytes(region: Region) -> bytes:
    """The ops of the region's passes, pickled as the spill keeps them."""
    return pickle.dumps([[_ROW(op) for op in p.ops] for p in _passes(region)], protocol=pickle.HIGHEST_PROTOCOL)
