"""Align the op sequence of a checkpoint recompute with the original forward.

A checkpointed region runs twice: the original forward (sequence ``a``) and
the recompute during backward (sequence ``b``).  :func:`align` pairs the ops of
both passes.  Keys can be any hashable value, typically ``(op, module)``
tuples such as ``("aten.mm.default", "layers.1.moe.router.gate")``.

Example::

    >>> fwd = ["mm", "relu", "mm", "add", "view", "view"]
    >>> rec = ["mm", "gelu", "mm", "add"]                 # substituted, early stop
    >>> for p in align(fwd, rec):
    ...     print(p)
    Pair(forward=0, recompute=0, how='match')
    Pair(forward=1, recompute=1, how='substituted')
    Pair(forward=2, recompute=2, how='match')
    Pair(forward=3, recompute=3, how='match')
    Pair(forward=4, recompute=None, how='forward_only')
    Pair(forward=5, recompute=None, how='forward_only')
    >>> pairs = align(["mm", "view", "mm"], ["mm", "mm", "add"])
    >>> [(p.forward, p.recompute, p.how) for p in pairs]
    [(0, 0, 'match'), (1, None, 'forward_only'), (2, 1, 'match'), (None, 2, 'recompute_only')]
    >>> summarize(pairs)
    {'match': 2, 'substituted': 0, 'forward_only': 1, 'recompute_only': 1}
    >>> first_mismatch(pairs)
    Pair(forward=1, recompute=None, how='forward_only')

Guarantees
----------
* The output covers every index of ``a`` and of ``b`` exactly once, and is
  monotone: over the non-``None`` entries both indices strictly increase.
* ``"match"`` pairs always have equal keys, ``"substituted"`` pairs never do.
* When the indel edit distance ``D = len(a) + len(b) - 2 * LCS`` is at most
  ``max_edit`` (a substitution counts 2), the number of ``"match"`` pairs is a
  longest common subsequence (optimal).

Algorithm
---------
1. Trim the common prefix and suffix (galloping slice compares, so identical
   or early-stopped sequences cost a few C-level passes).
2. Exact Myers O((N+M)·D) diff on the middle, restricted to the diagonal
   band that can still finish within the cap, with iterative deepening of the
   cap (lb+16, lb+64, ... max_edit), so a handful of edits costs little.
   Diagonal runs ("snakes") are followed with galloping slice compares, so
   long agreeing stretches cost almost nothing.  Cheap caps are tried on the
   raw keys first; only then are keys interned to ints and the lower bounds
   ``sum_k |count_a(k) - count_b(k)|`` (>= ``|n - m|``) and a third of the
   same sum over bigrams computed, which skip a Myers run that cannot succeed
   within ``max_edit``.
3. Beyond ``max_edit`` (heuristic, not guaranteed optimal):

   * if the forward is longer by more than ``max_edit`` (early stop), align
     the recompute against a prefix of the forward with a free-end Myers
     (same cap); the rest of the forward becomes trailing ``forward_only``
     entries (and symmetrically for a longer recompute);
   * otherwise anchor and recurse (patience / histogram diff): keys that occur
     once (or twice) on both sides; else q-grams (q=4) unique on both sides;
     else keys with the same, smallest possible, count (<= 64) on both sides
     (k-th occurrence paired with k-th, kept only where the neighbours agree
     too).  A longest increasing chain of anchors is
     kept and the gaps between anchors are solved recursively (depth <= 24).
     Gaps get an exact Myers with a cap of ~2·sqrt(size) when their lower
     bound allows.  Blocks with no anchors get a sliding-window free-end
     Myers (256 ops per side, <= 64 edits per window) that falls back to a
     greedy next-occurrence walk (O(log n) per step) where windows fail, or
     straight to that walk when most ops have no partner key at all.

   Worst-case cost: about ``max_edit**2 / 2`` Python steps for a failed exact
   attempt, plus O((N+M) log(N+M)) per recursion level.
4. ``_tidy`` slides insertions/deletions across short runs of repeated keys so
   that "insert x, match x, delete y" reads as one substituted op (same number
   of matches).  Unmatched gaps are paired position-wise as ``"substituted"``
   when both sides have nearly the same size (difference <= max(1, 25%)),
   otherwise emitted as ``forward_only`` then ``recompute_only`` entries.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections import Counter, deque
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from itertools import chain, compress, count, islice, repeat
from math import isqrt
from operator import add, eq, mul

from .gc_hold import collector_paused

__all__ = ["Pair", "align", "summarize", "first_mismatch", "HOWS"]

MATCH = "match"
SUBSTITUTED = "substituted"
FORWARD_ONLY = "forward_only"
RECOMPUTE_ONLY = "recompute_only"
HOWS = (MATCH, SUBSTITUTED, FORWARD_ONLY, RECOMPUTE_ONLY)


@dataclass(frozen=True, slots=True)
class Pair:
    """One step of the alignment.

    ``forward`` is an index into ``a`` (None if the op only exists in the
    recompute), ``recompute`` an index into ``b`` (None if only in the
    forward); ``how`` is one of ``"match"``, ``"substituted"``,
    ``"forward_only"``, ``"recompute_only"``.
    """

    forward: int | None
    recompute: int | None
    how: str


# --------------------------------------------------------------------------
# Small C-speed helpers
# --------------------------------------------------------------------------

_LINEAR = 8  # element-wise steps before switching to galloping slice compares


def _prefix_len(a: list, i: int, b: list, j: int, limit: int) -> int:
    """Largest L <= limit with a[i:i+L] == b[j:j+L]."""
    n = 0
    while n < limit:
        if a[i + n] != b[j + n]:
            return n
        n += 1
        if n == _LINEAR:
            break
    else:
        return n
    # gallop: the block [n, hi) is compared with one C-level slice compare
    step = 16
    while True:
        hi = n + step
        if hi > limit:
            hi = limit
        if a[i + n : i + hi] == b[j + n : j + hi]:
            n = hi
            if n == limit:
                return n
            step <<= 1
        else:
            break
    # first mismatch lies in [n, hi)
    while hi - n > _LINEAR:
        mid = (n + hi) >> 1
        if a[i + n : i + mid] == b[j + n : j + mid]:
            n = mid
        else:
            hi = mid
    while a[i + n] == b[j + n]:
        n += 1
    return n


def _suffix_len(a: list, i: int, b: list, j: int, limit: int) -> int:
    """Largest L <= limit with a[i-L:i] == b[j-L:j]."""
    n = 0
    while n < limit:
        if a[i - n - 1] != b[j - n - 1]:
            return n
        n += 1
        if n == _LINEAR:
            break
    else:
        return n
    step = 16
    while True:
        hi = n + step
        if hi > limit:
            hi = limit
        if a[i - hi : i - n] == b[j - hi : j - n]:
            n = hi
            if n == limit:
                return n
            step <<= 1
        else:
            break
    while hi - n > _LINEAR:
        mid = (n + hi) >> 1
        if a[i - mid : i - n] == b[j - mid : j - n]:
            n = mid
        else:
            hi = mid
    while a[i - n - 1] == b[j - n - 1]:
        n += 1
    return n


def _count_lower_bound(ca: Counter, cb: Counter, n: int, m: int) -> int:
    """sum_k |ca[k] - cb[k]|: every indel script needs at least that many edits.

    Computed as ``n + m - 2 * sum_k min(ca[k], cb[k])`` with C-level loops.
    """
    common = ca.keys() & cb.keys()
    both = sum(map(min, map(ca.__getitem__, common), map(cb.__getitem__, common)))
    return n + m - 2 * both


# --------------------------------------------------------------------------
# Myers' O((N+M)·D) diff with an edit cap
# --------------------------------------------------------------------------

_UNREACHED = -2
_SENTINEL_A = object()
_SENTINEL_B = object()


def _myers(A: list, alo: int, ahi: int, B: list, blo: int, bhi: int, cap: int, end: str = "both"):
    """Shortest edit script between A[alo:ahi] and B[blo:bhi] with at most ``cap`` indels.

    Returns the matched diagonal runs as absolute ``(i, j, length)`` triples in
    increasing order, or None when more than ``cap`` edits are needed.

    ``end`` selects where the path may stop: ``"both"`` (global alignment, the
    usual diff), ``"a"`` (stop as soon as B is used up; the rest of A is left
    unmatched, for early stop), ``"b"`` (the symmetric case) or ``"either"``
    (stop when either side is used up; for sliding windows).
    """
    a = A[alo:ahi]
    b = B[blo:bhi]
    N = len(a)
    M = len(b)
    a.append(_SENTINEL_A)  # never equal to anything: stops every snake at the end
    b.append(_SENTINEL_B)
    big = N + M + 2
    delta = N - M
    glob = end == "both"
    end_a = end == "a"
    either = end == "either"
    if glob and abs(delta) > cap:
        return None
    if cap > N + M:
        cap = N + M  # no script needs more edits than that
    off = cap + 3
    V = [_UNREACHED] * (2 * cap + 7)
    trace: list[tuple[int, int, array]] = []  # per round: (lo, hi, V[lo..hi step 2])
    plo = phi = 0
    fin = None
    for d in range(cap + 1):
        lo = -d if d <= M else -M
        hi = d if d <= N else N
        if glob:
            rest = cap - d
            if lo < delta - rest:
                lo = delta - rest
            if hi > delta + rest:
                hi = delta + rest
        if (lo - d) & 1:
            lo += 1
        if (hi - d) & 1:
            hi -= 1
        if lo > hi:
            return None
        if d == 0:
            x = _prefix_len(a, 0, b, 0, big)
            V[off] = x
            if (
                (glob and delta == 0 and x >= N)
                or (end_a and x >= M)
                or (end == "b" and x >= N)
                or (either and (x >= N or x >= M))
            ):
                fin = (0, 0, x)
                break
        else:
            # neighbours outside the previous band are unreachable
            if lo - 1 < plo:
                V[lo - 1 + off] = _UNREACHED
            if hi + 1 > phi:
                V[hi + 1 + off] = _UNREACHED
            for k in range(lo, hi + 1, 2):
                ko = k + off
                xd = V[ko + 1]  # down: from diagonal k+1 (insertion of b[y])
                if xd - k > M:
                    xd = _UNREACHED
                xr = V[ko - 1] + 1  # right: from diagonal k-1 (deletion of a[x])
                if xr > N:
                    xr = _UNREACHED
                x = xd if xd >= xr else xr
                if x < 0:
                    V[ko] = _UNREACHED
                    continue
                # follow the snake; the sentinels stop it at the ends
                if a[x] == b[x - k]:
                    x += 1
                    if a[x] == b[x - k]:
                        x += _prefix_len(a, x, b, x - k, big)
                V[ko] = x
                if x >= N or x - k >= M:  # reached an edge
                    if (k == delta) if glob else True if either else (x - k >= M) if end_a else (x >= N):
                        fin = (d, k, x)
                        break
            if fin is not None:
                break
        trace.append((lo, hi, array("q", V[lo + off : hi + off + 1 : 2])))
        plo, phi = lo, hi
    if fin is None:
        return None

    # ---- reconstruct the path backwards
    d, k, x = fin
    runs = []
    while d > 0:
        qlo, qhi, prev = trace[d - 1]
        xd = prev[(k + 1 - qlo) >> 1] if qlo <= k + 1 <= qhi else _UNREACHED
        if xd - k > M:
            xd = _UNREACHED
        xr = prev[(k - 1 - qlo) >> 1] + 1 if qlo <= k - 1 <= qhi else _UNREACHED
        if xr > N:
            xr = _UNREACHED
        if xd >= xr:
            xs, pk = xd, k + 1
        else:
            xs, pk = xr, k - 1
        if x > xs:
            runs.append((alo + xs, blo + xs - k, x - xs))
        x = prev[(pk - qlo) >> 1]
        k = pk
        d -= 1
    if x > 0:
        runs.append((alo, blo, x))
    runs.reverse()
    return runs


def _myers_deepening(A: list, alo: int, ahi: int, B: list, blo: int, bhi: int, lb: int, cap: int, end: str = "both"):
    """:func:`_myers` with caps ``lb + 16``, ``lb + 64``, ... up to ``cap``.

    ``lb`` is a lower bound on the edit count.  The diagonal band pruning makes
    an attempt with cap ``c`` cost about ``c * (c - |N - M|)`` steps, so a
    difference that is mostly a length change (early stop inside the cap) or
    a handful of edits is found without paying ``cap**2``.
    """
    cap = min(cap, (ahi - alo) + (bhi - blo))
    for c in _caps(lb, cap):
        r = _myers(A, alo, ahi, B, blo, bhi, c, end)
        if r is not None:
            return r
    return None


# --------------------------------------------------------------------------
# Heuristic for large differences
# --------------------------------------------------------------------------

_MAX_DEPTH = 24
_TIERS = (1, 2, 4, 8, 16, 32, 64)
_MAX_PAIRED_COUNT = _TIERS[-1]  # keys repeated more often than this are not paired by occurrence
_GRAM = 4  # q-gram length for anchors when single keys repeat a lot
_GREEDY_LOOKAHEAD = 1024
_WINDOW = 256  # ops per side in the sliding-window fallback
_WINDOW_CAP = 64  # edit cap per window


def _lis(values: list[int]) -> list[int]:
    """Indices of one longest strictly increasing subsequence of ``values``."""
    tails: list[int] = []  # tails[p]: smallest tail of an increasing run of length p+1
    tails_at: list[int] = []  # index of that tail
    prev = [-1] * len(values)
    bl = bisect_left
    last = None
    for t, v in enumerate(values):
        if last is None or v > last:
            if tails_at:
                prev[t] = tails_at[-1]
            tails.append(v)
            tails_at.append(t)
            last = v
        else:
            p = bl(tails, v)
            tails[p] = v
            tails_at[p] = t
            if p:
                prev[t] = tails_at[p - 1]
            if p == len(tails) - 1:
                last = v
    out = []
    t = tails_at[-1] if tails_at else -1
    while t >= 0:
        out.append(t)
        t = prev[t]
    out.reverse()
    return out


def _unique_keys(c: Counter) -> set:
    return set(compress(c.keys(), map((1).__eq__, c.values())))


class _Heuristic:
    """Anchor-and-recurse alignment for differences beyond ``max_edit``.

    Produces monotone, non-overlapping match runs in ``self.runs``.
    """

    def __init__(self, A: list, B: list, max_edit: int):
        self.A = A
        self.B = B
        self.max_edit = max_edit
        self.runs: list[tuple[int, int, int]] = []

    def _add(self, i: int, j: int, L: int) -> None:
        runs = self.runs
        if runs:
            qi, qj, qL = runs[-1]
            if qi + qL == i and qj + qL == j:
                runs[-1] = (qi, qj, qL + L)
                return
        runs.append((i, j, L))

    def solve(self, alo: int, ahi: int, blo: int, bhi: int, depth: int) -> None:
        A, B = self.A, self.B
        lim = min(ahi - alo, bhi - blo)
        p = _prefix_len(A, alo, B, blo, lim) if lim else 0
        if p:
            self._add(alo, blo, p)
            alo += p
            blo += p
            lim -= p
        s = _suffix_len(A, ahi, B, bhi, lim) if lim else 0
        ahi -= s
        bhi -= s
        n = ahi - alo
        m = bhi - blo
        if n and m:
            if n == 1 or m == 1:
                self._single(alo, ahi, blo, bhi)
            else:
                self._block(alo, ahi, blo, bhi, depth)
        if s:
            self._add(ahi, bhi, s)

    def _single(self, alo: int, ahi: int, blo: int, bhi: int) -> None:
        # one side has a single op: the LCS is 1 iff it occurs on the other side
        A, B = self.A, self.B
        try:
            if ahi - alo == 1:
                self._add(alo, B.index(A[alo], blo, bhi), 1)
            else:
                self._add(A.index(B[blo], alo, ahi), blo, 1)
        except ValueError:
            pass

    def _block(self, alo: int, ahi: int, blo: int, bhi: int, depth: int) -> None:
        A, B = self.A, self.B
        n = ahi - alo
        m = bhi - blo
        ca = cb = None
        if depth > 0:
            # exact diff for small / similar blocks, with a cap ~ 2*sqrt(size)
            # so that a failed attempt costs O(size)
            cap = min(self.max_edit, max(32, 2 * isqrt(n + m)))
            if abs(n - m) <= cap:
                lb = abs(n - m)
                if n + m > 64:
                    ca = Counter(A[alo:ahi])
                    cb = Counter(B[blo:bhi])
                    lb = _count_lower_bound(ca, cb, n, m)
                if lb <= cap:
                    r = _myers_deepening(A, alo, ahi, B, blo, bhi, lb, cap)
                    if r is not None:
                        for run in r:
                            self._add(*run)
                        return
        if depth < _MAX_DEPTH:
            if ca is None:
                ca = Counter(A[alo:ahi])
                cb = Counter(B[blo:bhi])
            anchors = self._anchors(alo, ahi, blo, bhi, ca, cb)
            if anchors:
                del ca, cb
                pa, pb = alo, blo
                for i, j, L in anchors:
                    if pa < i and pb < j:
                        self.solve(pa, i, pb, j, depth + 1)
                    self._add(i, j, L)
                    pa, pb = i + L, j + L
                if pa < ahi and pb < bhi:
                    self.solve(pa, ahi, pb, bhi, depth + 1)
                return
        self._scan(alo, ahi, blo, bhi)

    # -- anchors ------------------------------------------------------------

    def _anchors(self, alo, ahi, blo, bhi, ca: Counter, cb: Counter) -> list[tuple[int, int, int]]:
        """Monotone anchor runs for a block, or [] if none can be found.

        Preference: keys unique (or twice) on both sides; else unique q-grams
        when they cover a useful part of the block; else keys with the same,
        smallest possible, count on both sides (histogram diff, k-th
        occurrence paired with k-th occurrence).
        """
        common = list(ca.keys() & cb.keys())
        if not common:
            return []
        va = list(map(ca.__getitem__, common))
        mask = list(map(eq, va, map(cb.__getitem__, common)))
        equal_keys = list(compress(common, mask))  # same count on both sides
        equal_counts = list(compress(va, mask))
        del common, va, mask
        cmin = min(equal_counts) if equal_counts else 0
        if equal_keys and cmin <= 2:
            return self._key_anchors(alo, ahi, blo, bhi, equal_keys, equal_counts, cmin)
        gram_runs: list[tuple[int, int, int]] = []
        if min(ahi - alo, bhi - blo) >= 2 * _GRAM:
            gram_runs = self._gram_anchors(alo, ahi, blo, bhi, _GRAM)
            covered = sum(L for _, _, L in gram_runs)
            if covered * 8 >= min(ahi - alo, bhi - blo) or not equal_keys or cmin > _MAX_PAIRED_COUNT:
                return gram_runs
        if equal_keys and cmin <= _MAX_PAIRED_COUNT:
            return self._key_anchors(alo, ahi, blo, bhi, equal_keys, equal_counts, cmin)
        return gram_runs

    def _key_anchors(self, alo, ahi, blo, bhi, keys, counts, cmin) -> list[tuple[int, int, int]]:
        tier = next(t for t in _TIERS if t >= cmin)
        keep = set(compress(keys, map(tier.__ge__, counts)))
        A, B = self.A, self.B
        ia = list(compress(range(alo, ahi), map(keep.__contains__, A[alo:ahi])))
        jb = list(compress(range(blo, bhi), map(keep.__contains__, B[blo:bhi])))
        if tier == 1:
            posb = dict(zip(map(B.__getitem__, jb), jb))
            js = list(map(posb.__getitem__, map(A.__getitem__, ia)))
        else:
            # stable sorts group occurrences per key, in order: k-th with k-th
            pairing = dict(zip(sorted(ia, key=A.__getitem__), sorted(jb, key=B.__getitem__)))
            js = list(map(pairing.__getitem__, ia))
            # An edit shifts the k-th pairing of a repeated key, so only trust a
            # pair whose neighbours agree too (a wrong pair rarely has both).
            ia2: list[int] = []
            js2: list[int] = []
            for i, j in zip(ia, js):
                if (i == alo or j == blo or A[i - 1] == B[j - 1]) and (
                    i + 1 == ahi or j + 1 == bhi or A[i + 1] == B[j + 1]
                ):
                    ia2.append(i)
                    js2.append(j)
            ia, js = ia2, js2
        return [(ia[t], js[t], 1) for t in _lis(js)]

    def _gram_anchors(self, alo, ahi, blo, bhi, q: int) -> list[tuple[int, int, int]]:
        """Anchors on q-grams occurring exactly once on each side."""
        A, B = self.A, self.B
        # hashes of the q-grams starting at alo .. ahi-q (collisions are re-checked)
        ga = list(map(hash, zip(*(A[alo + t : ahi - q + 1 + t] for t in range(q)))))
        gb = list(map(hash, zip(*(B[blo + t : bhi - q + 1 + t] for t in range(q)))))
        keep = _unique_keys(Counter(ga)) & _unique_keys(Counter(gb))
        if not keep:
            return []
        mask_a = list(map(keep.__contains__, ga))
        mask_b = list(map(keep.__contains__, gb))
        ia = list(compress(range(alo, ahi - q + 1), mask_a))
        posb = dict(zip(compress(gb, mask_b), compress(range(blo, bhi - q + 1), mask_b)))
        js = list(map(posb.__getitem__, compress(ga, mask_a)))
        runs: list[tuple[int, int, int]] = []
        for t in _lis(js):
            i, j = ia[t], js[t]
            if A[i : i + q] != B[j : j + q]:
                continue  # hash collision
            if runs:
                ri, rj, rL = runs[-1]
                if i - j == ri - rj and i <= ri + rL:
                    runs[-1] = (ri, rj, max(rL, i + q - ri))  # same diagonal: extend
                    continue
                if i < ri + rL or j < rj + rL:
                    continue  # overlaps the previous run on another diagonal
            runs.append((i, j, q))
        return runs

    # -- sliding-window fallback --------------------------------------------

    def _scan(self, alo: int, ahi: int, blo: int, bhi: int) -> None:
        """Banded local alignment for blocks without anchors (many repeated keys).

        Align a window of ``_WINDOW`` ops per side with a free-end Myers capped
        at ``_WINDOW_CAP`` edits, keep the runs that start in the first half of
        the window and slide on.  A window that needs more edits is crossed
        with greedy steps (half a window, doubling while windows keep failing),
        which also re-synchronises after long insertions or deletions.
        Cost: O(_WINDOW_CAP**2) per half window at most.
        """
        A, B = self.A, self.B
        sa = A[alo:ahi]
        sb = B[blo:bhi]
        common = set(sa).intersection(sb)
        if not common:
            return  # nothing can match
        na = sum(map(common.__contains__, sa))
        nb = sum(map(common.__contains__, sb))
        if 2 * na < len(sa) or 2 * nb < len(sb):
            # mostly unrelated ops: walk only those that could match
            self._greedy_sparse(alo, ahi, blo, bhi, common)
            return
        del sa, sb, common
        add = self._add
        W, C = _WINDOW, _WINDOW_CAP
        half = W >> 1
        span = half
        greedy = None
        i, j = alo, blo
        while i < ahi and j < bhi:
            L = _prefix_len(A, i, B, j, min(ahi - i, bhi - j))
            if L:
                add(i, j, L)
                i += L
                j += L
                continue
            wa = min(W, ahi - i)
            wb = min(W, bhi - j)
            last = i + wa == ahi and j + wb == bhi
            r = _myers(A, i, i + wa, B, j, j + wb, C, "both" if last else "either")
            if r:
                if last:
                    for run in r:
                        add(*run)
                    return
                span = half
                ilim, jlim = i + (wa >> 1), j + (wb >> 1)
                for t, (ri, rj, rL) in enumerate(r):
                    if t and (ri >= ilim or rj >= jlim):
                        break
                    add(ri, rj, rL)
                    i, j = ri + rL, rj + rL
                continue
            if r is not None and last:
                return  # exact: nothing in common
            # too different here: greedy steps, for longer after repeated failures
            if greedy is None:
                greedy = _GreedyWalker(A, alo, ahi, B, blo, bhi)
            i, j = greedy.walk(i, j, i + span, j + span, add)
            span = min(2 * span, 64 * W)

    # -- greedy fallback ----------------------------------------------------

    def _greedy_sparse(self, alo: int, ahi: int, blo: int, bhi: int, common: set) -> None:
        """Greedy walk over the ops whose key occurs on both sides only."""
        A, B = self.A, self.B
        ia = list(compress(range(alo, ahi), map(common.__contains__, A[alo:ahi])))
        jb = list(compress(range(blo, bhi), map(common.__contains__, B[blo:bhi])))
        ka = list(map(A.__getitem__, ia))
        kb = list(map(B.__getitem__, jb))
        matches: list[tuple[int, int]] = []
        walker = _GreedyWalker(ka, 0, len(ka), kb, 0, len(kb))
        walker.walk(0, 0, len(ka), len(kb), lambda x, y, _: matches.append((x, y)))
        add = self._add
        for x, y in matches:
            add(ia[x], jb[y], 1)


class _GreedyWalker:
    """O(log n) per step: match equal heads, else skip to the nearer next occurrence."""

    def __init__(self, A: list, alo: int, ahi: int, B: list, blo: int, bhi: int):
        self.A, self.B = A, B
        self.ahi, self.bhi = ahi, bhi
        posa: dict = {}
        for i in range(alo, ahi):
            posa.setdefault(A[i], []).append(i)
        posb: dict = {}
        for j in range(blo, bhi):
            posb.setdefault(B[j], []).append(j)
        self.posa, self.posb = posa, posb

    def walk(self, i: int, j: int, istop: int, jstop: int, add) -> tuple[int, int]:
        """Walk from (i, j) until i >= istop or j >= jstop (or an end); return the position."""
        A, B = self.A, self.B
        posa, posb = self.posa, self.posb
        ahi, bhi = self.ahi, self.bhi
        istop = min(istop, ahi)
        jstop = min(jstop, bhi)
        empty: list[int] = []
        look = _GREEDY_LOOKAHEAD
        big = 1 << 62
        while i < istop and j < jstop:
            kx, ky = A[i], B[j]
            if kx == ky:
                add(i, j, 1)
                i += 1
                j += 1
                continue
            pb = posb.get(kx, empty)
            t = bisect_left(pb, j)
            db = pb[t] - j if t < len(pb) else big
            pa = posa.get(ky, empty)
            t = bisect_left(pa, i)
            da = pa[t] - i if t < len(pa) else big
            if db <= da and db <= look:
                j += db  # skip recompute-only ops
            elif da < db and da <= look:
                i += da  # skip forward-only ops
            else:
                i += 1  # substitution
                j += 1
        return i, j


# --------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------


def _match_runs(A: list, B: list, max_edit: int, early_stop: bool = False) -> list[tuple[int, int, int]]:
    N, M = len(A), len(B)
    lim = min(N, M)
    p = _prefix_len(A, 0, B, 0, lim) if lim else 0
    # (an early-stopped B ends where the forward made its last save, not where A ends: no common suffix)
    s = _suffix_len(A, N, B, M, lim - p) if lim - p and not early_stop else 0
    runs: list[tuple[int, int, int]] = []
    if p:
        runs.append((0, 0, p))
    ahi, bhi = N - s, M - s
    if p < ahi and p < bhi:
        middle = _diff_middle(A[p:ahi], B[p:bhi], p, max_edit)
        if early_stop:  # as many matches, against the shortest prefix of A: the free end's, where it has as many
            # (exact up to _FREE_END_CAP edits: no band prunes a free end, each try costs ~cap**2 steps)
            free_end = _myers_deepening(A, p, ahi, B, p, bhi, 0, min(max_edit, _FREE_END_CAP), end="a")
            if free_end is not None and sum(r[2] for r in free_end) >= sum(r[2] for r in middle):
                middle = free_end
        runs.extend(middle)
    if s:
        runs.append((ahi, bhi, s))
    return runs


def _caps(lo: int, cap: int):
    """Iterative-deepening caps lo+16, lo+64, lo+256, ... ending with ``cap``."""
    slack = 16
    while lo + slack < cap:
        yield lo + slack
        slack <<= 2
    yield cap


def _diff_middle(a: list, b: list, offset: int, max_edit: int) -> list[tuple[int, int, int]]:
    n, m = len(a), len(b)
    delta = abs(n - m)
    cap = min(max_edit, n + m)
    runs = None
    tried = -1
    # 1. cheap exact attempts straight on the keys: attempts whose cost
    #    (~ c * (c - delta) Python steps) stays below a linear pass
    if delta <= cap:
        for c in _caps(delta, cap):
            if c > delta + 16 and (c - delta) * c > (n + m) // 2:
                break
            runs = _myers(a, 0, n, b, 0, m, c)
            tried = c
            if runs is not None:
                break
    elif n > m:
        runs = _myers_deepening(a, 0, n, b, 0, m, 0, cap, end="a")  # early stop
    else:
        runs = _myers_deepening(a, 0, n, b, 0, m, 0, cap, end="b")
    if runs is None:
        # intern keys to ints: cheap hashing and comparisons from here on
        ids = dict(zip(dict.fromkeys(chain(a, b)), count()))
        A = list(map(ids.__getitem__, a))
        B = list(map(ids.__getitem__, b))
        del ids
        # 2. exact, up to max_edit, unless a lower bound rules it out
        if delta <= cap and tried < cap:
            lb = _count_lower_bound(Counter(A), Counter(B), n, m)
            if lb <= cap and n > 1 and m > 1 and n + m > 256:
                # one indel changes at most 3 bigrams: D >= sum_g |ca(g) - cb(g)| / 3.
                # Catches reorderings (same multiset of keys) before a doomed Myers.
                K = n + m  # > any interned id
                ga = Counter(map(add, map(mul, A, repeat(K)), islice(A, 1, None)))
                gb = Counter(map(add, map(mul, B, repeat(K)), islice(B, 1, None)))
                lb = max(lb, -(-_count_lower_bound(ga, gb, n - 1, m - 1) // 3))
            if lb <= cap:
                runs = _myers_deepening(A, 0, n, B, 0, m, max(lb, tried), cap)
        # 3. heuristic
        if runs is None:
            h = _Heuristic(A, B, max_edit)
            h.solve(0, n, 0, m, 0)
            runs = h.runs
    if offset:
        runs = [(i + offset, j + offset, L) for i, j, L in runs]
    return runs


_SLIDE_MAX = 16
_FREE_END_CAP = 256  # edits an early-stopped recompute is aligned with exactly against a free forward tail


def _tidy(runs: list, A: list, B: list, N: int, M: int, early_stop: bool = False) -> list[tuple[int, int, int]]:
    """Merge touching runs and slide indels across short runs of repeated keys.

    With repeated keys an optimal script may come out as "insert x, match y,
    delete z" where y == x; sliding the insertion across the run joins it with
    the deletion into one changed block (shown as a substitution).  The number
    of matches never changes, only their placement among equal keys.  After an
    early stop the forward's tail is no gap: the last run never slides into it.
    """
    out: list[tuple[int, int, int]] = []
    nruns = len(runs)
    for idx in range(nruns):
        i, j, L = runs[idx]
        if out:
            qi, qj, qL = out[-1]
            pa, pb = qi + qL, qj + qL
        else:
            pa = pb = 0
        if L <= _SLIDE_MAX:
            na, nb = (runs[idx + 1][0], runs[idx + 1][1]) if idx + 1 < nruns else (i + L if early_stop else N, M)
            ga1, gb1 = i - pa, j - pb  # gap before the run
            ga2, gb2 = na - i - L, nb - j - L  # gap after the run
            if ga1 == 0 and gb1 and ga2 and B[pb : pb + L] == B[j : j + L]:
                j = pb  # insertion before -> after the run
            elif gb1 == 0 and ga1 and gb2 and A[pa : pa + L] == A[i : i + L]:
                i = pa  # deletion before -> after the run
            elif ga2 == 0 and gb2 and ga1 and B[j : j + L] == B[j + gb2 : j + gb2 + L]:
                j += gb2  # insertion after -> before the run
            elif gb2 == 0 and ga2 and gb1 and A[i : i + L] == A[i + ga2 : i + ga2 + L]:
                i += ga2  # deletion after -> before the run
        if out and i == pa and j == pb:
            out[-1] = (qi, qj, qL + L)
        else:
            out.append((i, j, L))
    return out


def _near_equal(na: int, nb: int) -> bool:
    return abs(na - nb) <= max(1, max(na, nb) // 4)


def align(a: Sequence[Hashable], b: Sequence[Hashable], *, max_edit: int = 2000,
          early_stop: bool = False) -> list[Pair]:
    """Align recompute ops ``b`` to forward ops ``a``; see the module docstring.

    ``max_edit`` bounds the exact search: if ``a`` and ``b`` differ by at most
    that many insertions + deletions (a substitution counts 2), the number of
    ``"match"`` pairs is a longest common subsequence.  Beyond it a bounded
    heuristic is used.  The exact search costs up to ~``max_edit**2 / 2``
    Python steps, so very large values trade speed for optimality.

    ``early_stop``: ``b`` stopped before its end (torch's early stop ends a
    recompute at its last saved tensor), so ``a``'s end is not ``b``'s: no
    common suffix is paired, and where aligning ``b`` against the prefix of
    ``a`` that costs the fewest edits (the rest of ``a`` free) keeps as many
    matches, that alignment is taken (a trailing op of ``b`` pairs with the
    earliest op of ``a`` that fits, not with ``a``'s last one only because both
    sequences end with that key).
    """
    if not isinstance(max_edit, int) or max_edit < 0:
        raise ValueError(f"max_edit must be a non-negative int, got {max_edit!r}")
    A = a if type(a) is list else list(a)
    B = b if type(b) is list else list(b)
    N, M = len(A), len(B)
    runs = _tidy(_match_runs(A, B, max_edit, early_stop), A, B, N, M, early_stop)

    F: list = []
    R: list = []
    H: list = []

    def gap(a0: int, a1: int, b0: int, b1: int, recompute_first: bool = False) -> None:
        na, nb = a1 - a0, b1 - b0
        if na and nb and _near_equal(na, nb) and not recompute_first:
            q = na if na < nb else nb
            F.extend(range(a0, a0 + q))
            R.extend(range(b0, b0 + q))
            # in heuristic mode a positional pair may happen to be equal
            H.extend([MATCH if x == y else SUBSTITUTED for x, y in zip(A[a0 : a0 + q], B[b0 : b0 + q])])
            a0 += q
            b0 += q
            na -= q
            nb -= q
        if nb and recompute_first:
            F.extend(repeat(None, nb))
            R.extend(range(b0, b1))
            H.extend(repeat(RECOMPUTE_ONLY, nb))
            nb = 0
        if na:
            F.extend(range(a0, a1))
            R.extend(repeat(None, na))
            H.extend(repeat(FORWARD_ONLY, na))
        if nb:
            F.extend(repeat(None, nb))
            R.extend(range(b0, b1))
            H.extend(repeat(RECOMPUTE_ONLY, nb))

    pa = pb = 0
    for i, j, L in runs:
        if i > pa or j > pb:
            gap(pa, i, pb, j)
        F.extend(range(i, i + L))
        R.extend(range(j, j + L))
        H.extend(repeat(MATCH, L))
        pa, pb = i + L, j + L
    if pa < N or pb < M:  # (after an early stop the recompute's own ops come first: the forward's tail is where
        gap(pa, N, pb, M, recompute_first=early_stop)  # it never got to)
    return _build_pairs(F, R, H)


def _build_pairs(F: list, R: list, H: list) -> list[Pair]:
    # Bulk construction with C-level loops: about 3x faster than calling the
    # frozen dataclass __init__ per pair.  The cyclic GC is paused meanwhile
    # (the new objects cannot form cycles) to avoid repeated gen-0 sweeps.
    with collector_paused():
        out = list(map(object.__new__, repeat(Pair, len(F))))
        deque(map(_SET_FORWARD, out, F), maxlen=0)
        deque(map(_SET_RECOMPUTE, out, R), maxlen=0)
        deque(map(_SET_HOW, out, H), maxlen=0)
    return out


_SET_FORWARD = Pair.forward.__set__  # type: ignore[attr-defined]
_SET_RECOMPUTE = Pair.recompute.__set__  # type: ignore[attr-defined]
_SET_HOW = Pair.how.__set__  # type: ignore[attr-defined]


def summarize(pairs: Iterable[Pair]) -> dict[str, int]:
    """Count pairs per ``how``: always the four keys of :data:`HOWS`, in that order."""
    c = Counter(p.how for p in pairs)
    return {h: c.get(h, 0) for h in HOWS}


def first_mismatch(pairs: Iterable[Pair]) -> Pair | None:
    """First pair whose ``how`` is not ``"match"``, or None if everything matched."""
    for p in pairs:
        if p.how != MATCH:
            return p
    return None
