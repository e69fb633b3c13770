"""Does the run diverge already? Each region's recompute (in the backward), saved tensor by saved tensor, against
its forward: shape, dtype and a value fingerprint of every tensor autograd saved, at the same position.

    check = RecomputeCheck()
    check.pack(frame, "forward", 0, x)       # the auditor passes on the checkpoint hooks' calls
    check.exit(frame, "forward", None)       # the forward's fingerprints are read back (one sync per pass)
    ...                                      # the backward recomputes the region
    check.exit(frame, "recompute", None)     # compared, and the forward's figures dropped
    check.result()  ->  {"checked": 8, "diverged": [{"region": 0, "module": "layers.0", "how": "values",
                         "positions": [3, 7], "detail": "other values at 2 of 12 saved positions"}, ...]}

The replays of the audit start from the forward's own state, so they cannot see what changed before the real
recompute (a buffer updated after the forward, dropout without its RNG state): this check can. A region's figures
are held from its forward until its recompute only; what torch's own check raises (`failed`) counts as diverged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ..capture.fingerprint import FingerprintBatch
from ..capture.pystate import module_attributes
from ..capture.state import host_rng_states
from ..capture.torch_compat import FORWARD, RECOMPUTE, version_of


@dataclass
class _Pass:
    batch: FingerprintBatch = field(default_factory=lambda: FingerprintBatch(bits=True))  # (exact, as a recording's)
    meta: list = field(default_factory=list)  # per position: (shape, dtype)
    slots: list = field(default_factory=list)  # per position: its fingerprint's slot, or None
    fingerprints: list | None = None  # read back at the pass's end


@dataclass
class _Region:
    index: int
    module: str
    forward: _Pass = field(default_factory=_Pass)
    recompute: _Pass | None = None
    root: Any = None  # the checkpointed nn.Module (its Python state is compared), None for a function
    state: dict | None = None  # its Python state as the pass now running began
    updated: dict | None = None  # what the forward changed: name -> (before, after)
    outputs: bool = False  # compared by what each pass returned (a reentrant region: its forward saves nothing)


class RecomputeCheck:
    """Compares every recompute with its forward, as it happens; `result()` says which regions diverged."""

    MAX_LISTED = 64  # diverged regions listed one by one (all are counted)
    MAX_OPEN = 4096  # forwards waiting for their recompute (a forward never recomputed is let go past this)

    def __init__(self) -> None:
        self._open: dict[int, _Region] = {}  # id(frame) -> a region whose recompute has not ended
        self.checked = 0
        self.diverged: list[dict] = []
        self.diverged_count = 0
        # regions whose recompute updated state of the module a second time (a counter a schedule reads, a buffer)
        self.state_twice: list[dict] = []
        self.state_twice_count = 0

    def forward(self, frame: Any, index: int, module: str, root: Any = None) -> None:
        """A region's forward begins (`index`: its number in the run; `root`: the checkpointed module)."""
        if len(self._open) >= self.MAX_OPEN:
            del self._open[next(iter(self._open))]
        self._open[id(frame)] = region = _Region(index, module, root=root)
        region.state = _python_state(root)

    def recompute_begins(self, frame: Any) -> None:
        region = self._open.get(id(frame))
        if region is not None:
            region.state = _python_state(region.root)

    def pack(self, frame: Any, phase: str, position: int, x: Any, values: bool = True) -> None:
        """A tensor autograd saved; `values`: compare its values (not: a batch norm's running statistics in training,
        which its backward does not read and each pass updates: capture.modules.unread_statistics)."""
        region = self._open.get(id(frame))
        if region is None or not isinstance(x, torch.Tensor):
            return
        p = region.forward if phase == FORWARD else region.recompute
        if p is None:
            p = region.recompute = _Pass()
        while len(p.meta) <= position:  # positions come in order; a gap stays unknown
            p.meta.append(None)
            p.slots.append(None)
        p.meta[position] = (tuple(x.shape), x.dtype)
        p.slots[position] = p.batch.add(x.detach()) if values else None

    def output(self, frame: Any, phase: str, position: int, x: Any) -> None:
        """What a reentrant pass returned, output by output: its forward runs without grad and saves nothing, so its
        recompute is compared with it by these."""
        region = self._open.get(id(frame))
        if region is not None:
            region.outputs = True
            self.pack(frame, phase, position, x)

    def exit(self, frame: Any, phase: str, exc: BaseException | None) -> None:
        region = self._open.get(id(frame))
        if region is None:
            return
        if phase == FORWARD:
            if exc is not None:
                self._open.pop(id(frame))
            else:
                _read(region.forward)
                region.updated = _changed(region.state, _python_state(region.root))
            return
        if phase != RECOMPUTE:
            return
        self._open.pop(id(frame))
        twice = _changed(region.state, _python_state(region.root)).keys() & (region.updated or {}).keys()
        if twice:
            self.state_twice_count += 1
            if len(self.state_twice) < self.MAX_LISTED:
                self.state_twice.append({"region": region.index, "module": region.module, "names": sorted(twice)})
        if region.recompute is None:  # nothing saved again, nothing returned
            return
        _read(region.recompute)
        self._judge(region, _compare(region.forward, region.recompute, stopped=exc is not None,
                                     what="outputs" if region.outputs else "saved tensors"))

    def failed(self, frame: Any, exc: BaseException) -> None:
        """torch's own check raised: shapes, dtypes or the count of saved tensors differ."""
        region = self._open.pop(id(frame), None)
        if region is not None:
            self._judge(region, ("shapes", [], f"torch raised {type(exc).__name__}: "
                                 + (str(exc).strip().splitlines() or [""])[0][:160]))

    def _judge(self, region: _Region, verdict: tuple | None) -> None:
        self.checked += 1
        if verdict is None:
            return
        self.diverged_count += 1
        if len(self.diverged) < self.MAX_LISTED:
            how, positions, detail = verdict
            self.diverged.append({"region": region.index, "module": region.module, "how": how,
                                  "positions": positions, "detail": detail})

    def result(self) -> dict:
        """{"checked", "diverged_count", "diverged": [{"region", "module", "how", "positions", "detail"}]} in region
        order."""
        return {"checked": self.checked, "diverged_count": self.diverged_count,
                "diverged": sorted(self.diverged, key=lambda r: r["region"]),  # (the backward runs them last first)
                "state_twice_count": self.state_twice_count,
                "state_twice": sorted(self.state_twice, key=lambda r: r["region"])}


def _python_state(root: Any) -> dict | None:
    """The state of the checkpointed module and its submodules, by FQN under it: Python attributes
    (capture.pystate.module_attributes) and each buffer (a batch norm's running statistics, a router's load-balancing
    bias: _buffer_states); None for a checkpointed function."""
    if not isinstance(root, torch.nn.Module):
        return None
    state = {f"{name}.{key}" if name else key: value for name, sub in root.named_modules()
             for key, value in module_attributes(sub).items()}
    state.update(_buffer_states(root))
    # (a recompute that draws from Python's `random` or numpy's generator again, which preserve_rng_state does not
    # restore, advances it a second time)
    state.update((f"<host generator {name}>", tuple(rest)) for name, *rest in host_rng_states())
    return state


def _buffer_states(root: torch.nn.Module) -> dict:
    """name -> (version, sum) of each buffer: the version counts writes in place, the sum catches kernels that write
    without bumping it (a batch norm's running statistics: native_batch_norm does not declare them written). One
    read back of all the sums per call."""
    buffers = [(name, b) for name, b in root.named_buffers() if b is not None and b.numel()]
    if not buffers:
        return {}
    with torch.no_grad():
        sums = [b.detach().to(torch.float64).sum() for _, b in buffers]
        sums = torch.stack([s.to(sums[0].device) for s in sums]).tolist()
    return {name: ("buffer", version_of(b), s if s == s else "nan") for (name, b), s in zip(buffers, sums)}


def _changed(before: dict | None, after: dict | None) -> dict:
    if before is None or after is None:
        return {}
    return {k: (before.get(k), v) for k, v in after.items() if before.get(k, v) != v}


def _read(p: _Pass) -> None:
    if p.fingerprints is None:
        p.fingerprints, _ = p.batch.collect()
        p.batch = FingerprintBatch(bits=True)  # the reductions' results are read: let them go


def _compare(fwd: _Pass, rec: _Pass, stopped: bool, what: str = "saved tensors") -> tuple | None:
    """(how, positions, detail) of the first kind of difference, None when the recompute saved (`what`: or returned)
    what the forward did. `stopped`: the recompute ended on an exception (torch's early stop after the last saved
    tensor, or an error)."""
    n_fwd, n_rec = len(fwd.meta), len(rec.meta)
    if n_rec > n_fwd or (n_rec < n_fwd and not stopped):
        return ("count", [], f"{n_rec} {what} in the recompute, {n_fwd} in the forward")
    at = "saved positions" if what == "saved tensors" else what
    shapes = [i for i in range(n_rec) if rec.meta[i] is not None and rec.meta[i] != fwd.meta[i]]
    if shapes:
        return ("shapes", shapes, f"other shapes or dtypes at {len(shapes)} of {n_fwd} {at}")
    values = [i for i in range(n_rec) if _fingerprint(rec, i) is not None and _fingerprint(fwd, i) is not None
              and not _same(_fingerprint(rec, i), _fingerprint(fwd, i))]
    if values:
        return ("values", values, f"other values at {len(values)} of {n_fwd} {at}")
    return None


def _fingerprint(p: _Pass, i: int) -> list | None:
    slot = p.slots[i]
    return None if slot is None or p.fingerprints is None else p.fingerprints[slot]


def _same(a: list, b: list) -> bool:
    """Bit-identical fingerprints (NaN where both have it counts as the same)."""
    return len(a) == len(b) and all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b))
