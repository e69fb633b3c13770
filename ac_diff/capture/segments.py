"""Exact and deterministic sums of many tensors at once, each tensor's own (a segment of one flat tensor), and the
weights they use: what lets watch mode and full recordings reduce dozens of tensors in a handful of kernels.

    w = _weights(device, torch.float32, n)            # n fingerprint weights, cached ("float", "int", "odd", ...)
    segment_pairs([bits_a, bits_b], (na, nb))         # (2, 2) int64: [sum v, sum (2k + 1) v] per tensor, exact
    segment_odd_sums([bits_a, bits_b], (na, nb))      # (2,) int64: its second column alone, in fewer kernels
    segment_float_pairs(flat, weights, lengths)       # (k, 2) float64: [sum w1 x, sum w2 x] per segment

`segment_pairs` runs one cumulative sum over all of them: integers, so exact in any order (wrapping), and a tensor's
pair is the difference between its bounds. `segment_float_pairs` sums each segment on its own, in order (CPU
`segment_reduce`), in float64: a tensor's numbers depend on its values only, never on the tensors beside it, so two
passes that reduce the same tensor among other neighbours get bit-identical numbers.
"""

from __future__ import annotations

import torch


# Fingerprint weights: a base per (device, dtype, kind), grown as needed, and its slices by length.
_weight_bases: dict[tuple, torch.Tensor] = {}
_weight_slices: dict[tuple, torch.Tensor] = {}


def _weights(device: torch.device, dtype: torch.dtype, n: int, kind: str = "float") -> torch.Tensor:
    """The first n fingerprint weights, cached per (device, dtype, kind, n) for the whole process: the
    same values for a given length however the base grew, and no slicing dispatch per fingerprint.

    "float": pseudo-random in [1, 2) (`_unit_hash`); "int": 1, 2, 3, ... (int64, exact); "odd": 1, 3, 5, ... (a change
    times an odd weight never vanishes in wrap-around arithmetic); "rows": the (2, n) matrix [ones; float
    weights] that turns row sums into a plain and a weighted total in one kernel; "ones_odd": the (2, n) matrix
    [ones; odd] (watch mode's plain and weighted sums, in one multiplication)."""
    key = (device, dtype, kind, n)
    w = _weight_slices.get(key)
    if w is None:
        if kind == "rows":
            w = torch.stack((torch.ones(n, dtype=dtype, device=device), _weights(device, dtype, n)))
        else:
            base = _weight_bases.get(key[:3])
            if base is None or base.shape[-1] < n:
                k = torch.arange(max(n, 1024), dtype=torch.float64, device=device)  # made there: no copy, no sync
                values = (k + 1 if kind == "int" else 2 * k + 1 if kind in ("odd", "ones_odd")
                          else 1.0 + _unit_hash(k.long()))
                if kind == "ones_odd":
                    values = torch.stack((torch.ones_like(values), values))
                base = _weight_bases[key[:3]] = values.to(device=device, dtype=dtype)
            w = base[..., :n]
        if len(_weight_slices) > 4096:  # many distinct lengths (data-dependent shapes): start over
            _weight_slices.clear()
        _weight_slices[key] = w
    return w


def wrapped(x: int, bits: int) -> int:
    """A Python integer as a `bits`-bit two's-complement integer wraps it (what int32 / int64 sums on a device give)."""
    x &= (1 << bits) - 1
    return x - (1 << bits) if x >> (bits - 1) else x


def _shifted(z: torch.Tensor, s: int) -> torch.Tensor:
    """z >> s as unsigned 64-bit integers (torch's >> on int64 copies the sign bit)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _unit_hash(k: torch.Tensor) -> torch.Tensor:
    """float64 in [0, 1) per int64 index: splitmix64's finalizer (wrap-around int64 products), its top 53 bits. Unlike
    an additive sequence such as frac(k * golden ratio), whose w_i + w_j equals w_k + w_l whenever i + j = k + l (a
    zero-sum update at such positions, +c -c -c +c, would leave a weighted sum unchanged), hashed weights have no
    linear relations between positions."""
    z = k * -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed int64
    z = (z ^ _shifted(z, 30)) * -4658895280553007687  # 0xBF58476D1CE4E5B9
    z = (z ^ _shifted(z, 27)) * -7723592293110705685  # 0x94D049BB133111EB
    z = z ^ _shifted(z, 31)
    return _shifted(z, 11).double() * 2.0 ** -53


_bounds_cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # (device, row counts) -> `_bounds`


def _bounds(device: torch.device, lengths: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """For tensors of `lengths` rows concatenated after one leading zero row: the index of that zero row and of each
    tensor's last row, and -2 x (index of each tensor's first row), both int64 on `device`; made once per layout
    (the same every step for a fixed model), copied from pinned memory without a sync."""
    key = (device, lengths)
    bounds = _bounds_cache.get(key)
    if bounds is None:
        ends = [0]
        for n in lengths:
            ends.append(ends[-1] + n)
        host = torch.tensor([ends, [0] + [-2 * (e + 1) for e in ends[:-1]]], dtype=torch.int64)
        if device.type == "cuda":
            host = host.pin_memory().to(device, non_blocking=True)
        bounds = (host[0], host[1, 1:])
        if len(_bounds_cache) > 256:
            _bounds_cache.clear()
        _bounds_cache[key] = bounds
    return bounds


_ZERO_ROW: dict[tuple, torch.Tensor] = {}


def _zero_row(like: torch.Tensor) -> torch.Tensor:
    """One zero of `like`'s dtype on its device, made once: the row a segmented cumulative sum starts from."""
    key = (like.device, like.dtype)
    zero = _ZERO_ROW.get(key)
    if zero is None:
        zero = _ZERO_ROW[key] = torch.zeros(1, dtype=like.dtype, device=like.device)
    return zero


def segment_pairs(rows: list[torch.Tensor], lengths: tuple[int, ...]) -> torch.Tensor:
    """(k, 2) int64: per tensor [sum of its row sums, sum of (2i + 1) x its i-th row sum], for the row sums of k
    tensors (`lengths` rows each, any of them empty) given as pieces in order. One cumulative sum for all of them:
    a tensor's pair is its difference between its bounds, its weights restarted at its first row. Exact (int64,
    wrapping), on the rows' device, seven kernels, no sync."""
    device = rows[0].device
    # a zero row first: a tensor starting at row 0 has a bound to subtract
    flat = torch.cat([_zero_row(rows[0]), *rows])
    cum = torch.cumsum(flat.unsqueeze(0) * _weights(device, torch.int64, flat.numel(), "ones_odd"), dim=1)
    ends, shift = _bounds(device, lengths)
    seg = cum.index_select(1, ends).diff(dim=1)
    # a tensor's first row (index start + 1 after the zero row) has the global weight 2 * start + 3: shift it to 1
    return torch.stack((seg[0], torch.addcmul(seg[1], shift, seg[0])), dim=1)


_odd_cache: dict[tuple, torch.Tensor] = {}  # (device, row counts) -> `segment_odd_sums`' weights


def segment_odd_sums(rows: list[torch.Tensor], lengths: tuple[int, ...]) -> torch.Tensor:
    """(k,) int64: per tensor sum of (2i + 1) x its i-th row sum, the second column of `segment_pairs` alone, in five
    kernels: its weights restart at each tensor's first row (made once per layout), so no shift is needed. Exact
    modulo 2**64 (wrapping): modulo 2**32 it is the wrap-around int32 dot of those rows and odd weights."""
    device = rows[0].device
    key = (device, lengths)
    weights = _odd_cache.get(key)
    if weights is None:
        if len(_odd_cache) > 256:
            _odd_cache.clear()
        pieces = [torch.zeros(1, dtype=torch.int64, device=device)]
        pieces += [_weights(device, torch.int64, n, "odd") for n in lengths if n]
        weights = _odd_cache[key] = torch.cat(pieces)
    cum = torch.cumsum(torch.cat([_zero_row(rows[0]), *rows]) * weights, dim=0)
    return cum.index_select(0, _bounds(device, lengths)[0]).diff()


_lengths_cache: dict[tuple, torch.Tensor] = {}


def segment_float_pairs(flat: torch.Tensor, weights: torch.Tensor, lengths: tuple[int, ...]) -> torch.Tensor:
    """(k, 2) float64: per segment of `flat` (`lengths` elements each, none empty), [sum w1 x, sum w2 x] with
    `weights` (n, 2) float64 per element. Each segment is summed on its own, in order: deterministic, and independent
    of the other segments (CPU only: a GPU's segmented reductions may order a segment's sum by its alignment)."""
    lengths_t = _lengths_cache.get(lengths)
    if lengths_t is None:
        if len(_lengths_cache) > 256:
            _lengths_cache.clear()
        lengths_t = _lengths_cache[lengths] = torch.tensor(lengths, dtype=torch.int64)
    return torch.segment_reduce(flat.unsqueeze(1) * weights, "sum", lengths=lengths_t, axis=0)
