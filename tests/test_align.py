"""Tests for ac_diff.align (sequence alignment of forward vs recompute ops)."""

from __future__ import annotations

import dataclasses
import doctest
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ac_diff.align as align_mod
from ac_diff.align import Pair, align, first_mismatch, summarize

MM = ("aten.mm.default", "layers.1.moe.router.gate")
VIEW = ("aten.view.default", "layers.1.moe.router.gate")
SOFTMAX = ("aten._softmax.default", "layers.1.moe.router")
TOPK = ("aten.topk.default", "layers.1.moe.router")
ADD = ("aten.add.Tensor", "layers.1")


# ---------------------------------------------------------------- helpers


def lcs_len(a, b) -> int:
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0] * (len(b) + 1)
        for j, y in enumerate(b):
            cur[j + 1] = prev[j] + 1 if x == y else max(prev[j + 1], cur[j])
        prev = cur
    return prev[-1]


def check_valid(a, b, pairs) -> None:
    """Complete, in order, monotone, and every `how` consistent with the keys."""
    fwd = [p.forward for p in pairs if p.forward is not None]
    rec = [p.recompute for p in pairs if p.recompute is not None]
    assert fwd == list(range(len(a)))
    assert rec == list(range(len(b)))
    for p in pairs:
        assert isinstance(p, Pair)
        if p.how == "match":
            assert a[p.forward] == b[p.recompute]
        elif p.how == "substituted":
            assert p.forward is not None and p.recompute is not None
            assert a[p.forward] != b[p.recompute]
        elif p.how == "forward_only":
            assert p.forward is not None and p.recompute is None
        elif p.how == "recompute_only":
            assert p.forward is None and p.recompute is not None
        else:
            pytest.fail(f"unknown how {p.how!r}")


def triples(pairs):
    return [(p.forward, p.recompute, p.how) for p in pairs]


def model_ops(n_layers=4, seed=0):
    """A small realistic op-key sequence with repeated keys."""
    rng = random.Random(seed)
    ops = []
    for layer in range(n_layers):
        for mod in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "moe.router.gate", "mlp.fc1"):
            name = f"layers.{layer}.{mod}"
            ops.append(("aten.view.default", name))
            ops.append(("aten.mm.default", name))
            ops.append(("aten.view.default", name))
            if rng.random() < 0.5:
                ops.append(("aten.add.Tensor", name))
    return ops


# ---------------------------------------------------------------- unit tests


def test_identical():
    a = model_ops()
    b = [tuple(k) for k in a]
    pairs = align(a, b)
    check_valid(a, b, pairs)
    assert triples(pairs) == [(i, i, "match") for i in range(len(a))]
    assert first_mismatch(pairs) is None
    assert summarize(pairs) == {"match": len(a), "substituted": 0, "forward_only": 0, "recompute_only": 0}


def test_prefix_early_stop():
    a = model_ops()
    n = int(len(a) * 0.6)
    b = a[:n]
    pairs = align(a, b)
    check_valid(a, b, pairs)
    assert triples(pairs) == [(i, i, "match") for i in range(n)] + [(i, None, "forward_only") for i in range(n, len(a))]
    assert first_mismatch(pairs) == Pair(n, None, "forward_only")


def test_an_early_stopped_recompute_ends_at_the_earliest_fitting_forward_op():
    """The recompute took another path for its scores (einsum's permutes, not a transpose) and stopped at its last
    saved tensor, `1 + |z|` (an add), before the division and the residual add that end the forward (also an add):
    trimming the common suffix paired it with that residual add, a shape divergence no pass had. With `early_stop`
    the forward's tail after it is left unmatched."""
    MM, T, P, DIV, ABS = (("aten.mm.default", "l"), ("aten.transpose.int", "l"), ("aten.permute.default", "l"),
                          ("aten.div.Tensor", "l"), ("aten.abs.default", "l"))
    add = ("aten.add.Tensor", "l")
    a = [MM, T, MM, ABS, add, DIV, add]
    b = [MM, P, P, MM, ABS, add]
    suffix = align(a, b)
    assert (6, 5, "match") in triples(suffix)  # (what the default, a whole recompute, pairs)
    pairs = align(a, b, early_stop=True)
    check_valid(a, b, pairs)
    assert (4, 5, "match") in triples(pairs) and triples(pairs)[-2:] == [(5, None, "forward_only"),
                                                                        (6, None, "forward_only")]
    assert align(a, a[:5], early_stop=True) == align(a, a[:5])  # a plain early stop: unchanged


def test_prefix_with_edits_beyond_max_edit():
    # early stop + a substitution: the tail must still come out as forward_only
    a = model_ops(n_layers=20)
    n = int(len(a) * 0.6)
    b = a[:n]
    b[10] = ("aten.gelu.default", "layers.0.mlp.fc1")
    pairs = align(a, b, max_edit=8)
    check_valid(a, b, pairs)
    assert summarize(pairs) == {"match": n - 1, "substituted": 1, "forward_only": len(a) - n, "recompute_only": 0}
    assert triples(pairs)[-(len(a) - n) :] == [(i, None, "forward_only") for i in range(n, len(a))]


def test_one_insertion():
    a = [MM, SOFTMAX, TOPK, ADD]
    b = [MM, SOFTMAX, VIEW, TOPK, ADD]
    pairs = align(a, b)
    check_valid(a, b, pairs)
    assert triples(pairs) == [
        (0, 0, "match"), (1, 1, "match"), (None, 2, "recompute_only"), (2, 3, "match"), (3, 4, "match"),
    ]
    assert first_mismatch(pairs) == Pair(None, 2, "recompute_only")


def test_one_deletion():
    a = [MM, SOFTMAX, VIEW, TOPK, ADD]
    b = [MM, SOFTMAX, TOPK, ADD]
    pairs = align(a, b)
    check_valid(a, b, pairs)
    assert triples(pairs) == [
        (0, 0, "match"), (1, 1, "match"), (2, None, "forward_only"), (3, 2, "match"), (4, 3, "match"),
    ]


def test_one_substitution():
    a = [MM, SOFTMAX, TOPK, ADD]
    b = [MM, VIEW, TOPK, ADD]
    pairs = align(a, b)
    check_valid(a, b, pairs)
    assert triples(pairs) == [(0, 0, "match"), (1, 1, "substituted"), (2, 2, "match"), (3, 3, "match")]
    assert summarize(pairs)["substituted"] == 1
    assert first_mismatch(pairs) == Pair(1, 1, "substituted")


def test_unequal_changed_block_is_not_paired():
    a = ["x", "A", "y"]
    b = ["x", "B", "C", "D", "E", "y"]
    pairs = align(a, b)
    check_valid(a, b, pairs)
    assert triples(pairs) == [
        (0, 0, "match"),
        (1, None, "forward_only"),
        (None, 1, "recompute_only"),
        (None, 2, "recompute_only"),
        (None, 3, "recompute_only"),
        (None, 4, "recompute_only"),
        (2, 5, "match"),
    ]


def test_empty_sides():
    assert align([], []) == []
    assert triples(align([MM, ADD], [])) == [(0, None, "forward_only"), (1, None, "forward_only")]
    assert triples(align([], [MM, ADD])) == [(None, 0, "recompute_only"), (None, 1, "recompute_only")]
    assert first_mismatch([]) is None
    assert summarize([]) == {"match": 0, "substituted": 0, "forward_only": 0, "recompute_only": 0}


def test_cached_ops_missing_in_middle():
    # selective AC served the mm ops of two modules from its cache
    a = model_ops(n_layers=3)
    cached = {i for i, k in enumerate(a) if k[0] == "aten.mm.default" and k[1].startswith("layers.1.")}
    b = [k for i, k in enumerate(a) if i not in cached]
    pairs = align(a, b)
    check_valid(a, b, pairs)
    assert {p.forward for p in pairs if p.how == "forward_only"} == cached
    assert summarize(pairs) == {"match": len(b), "substituted": 0, "forward_only": len(cached), "recompute_only": 0}


def test_repeated_keys():
    a = [MM] + [VIEW] * 50 + [ADD] + [VIEW] * 30 + [MM]
    b = [MM] + [VIEW] * 48 + [ADD] + [VIEW] * 31 + [MM]
    pairs = align(a, b)
    check_valid(a, b, pairs)
    s = summarize(pairs)
    assert s["match"] == lcs_len(a, b) == len(b) - 1
    assert s["forward_only"] + s["recompute_only"] + 2 * s["substituted"] == len(a) + len(b) - 2 * s["match"]


def test_non_list_inputs_and_strings():
    pairs = align("abcde", ("a", "c", "d", "e", "f"))
    check_valid("abcde", "acdef", pairs)
    assert summarize(pairs)["match"] == 4


def test_pair_is_frozen_and_slotted():
    p = align(["a"], ["a"])[0]
    assert p == Pair(0, 0, "match")
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.how = "x"  # type: ignore[misc]
    assert not hasattr(p, "__dict__")
    assert hash(p) == hash(Pair(0, 0, "match"))


def test_bad_max_edit():
    with pytest.raises(ValueError):
        align([1], [1], max_edit=-1)


def test_module_docstring_example():
    result = doctest.testmod(align_mod, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize("max_edit", [0, 4, 2000])
def test_large_near_identical_is_exact(max_edit):
    rng = random.Random(1)
    a = model_ops(n_layers=400, seed=3)  # ~6.5k ops
    b = list(a)
    for _ in range(3):
        del b[rng.randrange(len(b))]
    for _ in range(3):
        b.insert(rng.randrange(len(b)), ("aten.clone.default", "layers.7.mlp.fc1"))
    for _ in range(3):
        b[rng.randrange(len(b))] = ("aten.gelu.default", "layers.7.mlp.fc1")
    pairs = align(a, b, max_edit=max_edit)
    check_valid(a, b, pairs)
    s = summarize(pairs)
    assert s["match"] >= len(a) - 6
    if max_edit == 2000:
        # exact: at most 3 deletions and 3 substitutions cost matches
        assert s["match"] + s["substituted"] + s["forward_only"] == len(a)


def test_heuristic_paths_stay_valid():
    rng = random.Random(7)
    # heavy disagreement over a small alphabet: no unique keys, greedy fallback
    a = [rng.randrange(3) for _ in range(3000)]
    b = [rng.randrange(4) for _ in range(2500)]
    check_valid(a, b, align(a, b, max_edit=10))
    # unique keys with shuffled blocks: anchor recursion
    a = list(range(2000))
    b = a[1000:] + a[:1000]
    pairs = align(a, b, max_edit=10)
    check_valid(a, b, pairs)
    assert summarize(pairs)["match"] == 1000


def test_heuristic_quality_on_scattered_edits():
    # 5% random edits with repeated keys: beyond max_edit the heuristic should
    # still recover nearly all of the LCS
    rng = random.Random(11)
    a = model_ops(n_layers=60, seed=5)
    b = list(a)
    for _ in range(len(a) // 20):
        r = rng.random()
        pos = rng.randrange(len(b))
        if r < 1 / 3:
            del b[pos]
        elif r < 2 / 3:
            b.insert(pos, ("aten.clone.default", f"layers.{rng.randrange(60)}.mlp.fc1"))
        else:
            b[pos] = ("aten.relu.default", f"layers.{rng.randrange(60)}.mlp.fc1")
    exact = summarize(align(a, b))["match"]
    heur = summarize(align(a, b, max_edit=2))["match"]
    check_valid(a, b, align(a, b, max_edit=2))
    assert heur >= 0.98 * exact


def test_heuristic_quality_with_few_distinct_keys():
    # beyond max_edit with a 3-key alphabet (no anchors): sliding-window fallback
    rng = random.Random(5)
    a = [rng.randrange(3) for _ in range(1200)]
    b = list(a)
    for _ in range(60):
        pos = rng.randrange(len(b))
        r = rng.random()
        if r < 1 / 3:
            del b[pos]
        elif r < 2 / 3:
            b.insert(pos, rng.randrange(3))
        else:
            b[pos] = rng.randrange(3)
    exact = summarize(align(a, b, max_edit=10_000))["match"]
    pairs = align(a, b, max_edit=8)
    check_valid(a, b, pairs)
    assert summarize(pairs)["match"] >= 0.97 * exact


def test_inputs_not_mutated():
    a = model_ops()
    b = a[:40] + [ADD] + a[45:]
    a0, b0 = list(a), list(b)
    align(a, b, max_edit=1)
    align(a, b)
    assert a == a0 and b == b0


# ---------------------------------------------------------------- properties

small_seq = st.lists(st.integers(0, 3), max_size=25)


@settings(max_examples=100, deadline=None)
@given(a=small_seq, b=small_seq, max_edit=st.sampled_from([0, 1, 3, 8, 2000]), early_stop=st.booleans())
def test_prop_monotone_complete(a, b, max_edit, early_stop):
    pairs = align(a, b, max_edit=max_edit, early_stop=early_stop)
    check_valid(a, b, pairs)
    # strict monotonicity over the non-None entries
    last_f = last_r = -1
    for p in pairs:
        if p.forward is not None:
            assert p.forward > last_f
            last_f = p.forward
        if p.recompute is not None:
            assert p.recompute > last_r
            last_r = p.recompute


@settings(max_examples=100, deadline=None)
@given(a=small_seq, b=small_seq)
def test_prop_match_count_is_lcs(a, b):
    pairs = align(a, b)
    assert summarize(pairs)["match"] == lcs_len(a, b)


@settings(max_examples=60, deadline=None)
@given(a=small_seq, b=small_seq, data=st.data())
def test_prop_lcs_whenever_within_max_edit(a, b, data):
    lcs = lcs_len(a, b)
    d = len(a) + len(b) - 2 * lcs
    max_edit = data.draw(st.integers(d, d + 3))
    assert summarize(align(a, b, max_edit=max_edit))["match"] == lcs


@settings(max_examples=80, deadline=None)
@given(
    base=st.lists(st.sampled_from([MM, VIEW, SOFTMAX, TOPK, ADD]), max_size=40),
    edits=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 1000), st.sampled_from([MM, VIEW, ADD])), max_size=6),
    max_edit=st.sampled_from([0, 2, 2000]),
)
def test_prop_edited_copies(base, edits, max_edit):
    b = list(base)
    for kind, pos, key in edits:
        if kind == 0:
            b.insert(pos % (len(b) + 1), key)
        elif b and kind == 1:
            del b[pos % len(b)]
        elif b:
            b[pos % len(b)] = key
    pairs = align(base, b, max_edit=max_edit)
    check_valid(base, b, pairs)
    assert summarize(pairs)["match"] <= lcs_len(base, b)
    fm = first_mismatch(pairs)
    assert fm is None or fm.how != "match"
    assert (fm is None) == (base == b)


@settings(max_examples=150, deadline=None)
@given(a=small_seq, b=small_seq)
def test_prop_an_early_stop_keeps_the_most_matches(a, b):
    """With `early_stop` the alignment keeps a longest common subsequence (as many matches as without it): only
    which of the equally many it pairs changes."""
    pairs = align(a, b, early_stop=True)
    check_valid(a, b, pairs)
    assert summarize(pairs)["match"] == lcs_len(a, b)
