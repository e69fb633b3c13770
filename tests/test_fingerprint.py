"""Fingerprints: equal for equal values and layouts, different for the changes AC divergence makes."""

from __future__ import annotations

import pytest
import torch

from ac_diff.capture.fingerprint import FingerprintBatch, _rows


def fp(*tensors: torch.Tensor) -> list:
    batch = FingerprintBatch()
    slots = [batch.add(t) for t in tensors]
    values, _ = batch.collect()
    return [values[s] if s is not None else None for s in slots]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_same_values_same_fingerprint_and_changes_show(dtype):
    torch.manual_seed(0)
    a = torch.randn(64, 32).to(dtype)
    zero_sum = a.clone()
    zero_sum[3, :] += 0.5
    zero_sum[40, :] -= 0.5  # the sum is unchanged: (sum, abs-sum) fingerprints missed this
    swapped = a.clone()
    swapped[[5, 6]] = a[[6, 5]]  # a token routed to another slot: same multiset of values
    first, again, moved, permuted = fp(a, a.clone(), zero_sum, swapped)
    assert first == again
    assert moved != first
    assert permuted != first


def test_a_vector_gives_its_sum_and_a_weighted_sum():
    bias = torch.zeros(8)
    updated = bias + torch.tensor([1.0, -1.0, 0, 0, 0, 0, 0, 0])  # a load-balancing update: zero sum
    (s0, w0), (s1, w1) = fp(bias, updated)
    assert s0 == s1 == 0.0
    assert w1 != w0


def test_integers_are_exact_and_order_sensitive():
    idx = torch.tensor([[0, 3], [1, 2]])
    (a_sum, a_w), (b_sum, b_w) = fp(idx, idx.flip(-1))
    assert a_sum == b_sum == 6
    assert a_w != b_w


def test_a_dense_non_contiguous_tensor_is_reduced_in_memory_order_without_a_copy():
    base = torch.randn(2, 8, 16, 4)
    t = base.permute(0, 2, 1, 3)  # an attention output (batch, heads, seq, dim) seen as (batch, seq, ...)
    assert not t.is_contiguous()
    rows = _rows(t)
    assert rows.data_ptr() == base.data_ptr()  # a view: no copy of the activation
    assert fp(t) == fp(base.permute(0, 2, 1, 3))  # same layout, same numbers
    expanded = torch.randn(4, 1).expand(4, 6)  # not dense: reduced through a copy, still deterministic
    assert fp(expanded) == fp(expanded.contiguous())


def test_tensors_that_cannot_be_reduced_get_no_slot():
    assert fp(torch.randn(3, dtype=torch.complex64), torch.empty(2, 2, device="meta")) == [None, None]
    assert fp(torch.zeros(0, 3))[0] is not None  # empty: a fingerprint all the same
