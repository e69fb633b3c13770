"""Non-finite values do not hide a change, and an op without dropout is not random.

The mechanism: an attention block reads an additive padding mask (-inf at padded keys) that the data
loader refills in place with the next batch's padding before the backward. The recompute then attends
over other keys. The mask's fingerprint must change (a plain sum is -inf either way) so the cause is the
mask, not "SDPA drew other random numbers": SDPA with dropout_p=0 draws nothing.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import ac_diff
from ac_diff.capture.fingerprint import FingerprintBatch
from ac_diff.trace import read_run


def _fingerprint(t: torch.Tensor) -> list:
    batch = FingerprintBatch()
    slot = batch.add(t)
    return batch.collect()[0][slot]


def _mask(lengths: list[int], seq: int = 6) -> torch.Tensor:
    mask = torch.zeros(len(lengths), 1, seq, seq)
    for i, n in enumerate(lengths):
        mask[i, :, :, n:] = float("-inf")
    return mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_a_change_among_non_finite_values_changes_the_fingerprint(dtype):
    masks = [_mask([6, 4]), _mask([5, 6]), _mask([4, 6])]
    moved = _mask([6, 4])
    moved[1, 0, 2, 1] = 0.5  # one finite element elsewhere
    nan = torch.full((3, 4), float("nan"))
    nan_moved = nan.clone()
    nan_moved[1, 2] = 1.0
    huge = torch.full((2, 8), torch.finfo(torch.float32).min)  # a finfo.min mask: its sums overflow
    huge_moved = huge.clone()
    huge_moved[1, 3] = 0.0
    tensors = [*masks, moved, nan, nan_moved, huge, huge_moved]
    fps = [_fingerprint(t.to(dtype)) for t in tensors]
    assert len({tuple(map(str, fp)) for fp in fps}) == len(fps), fps
    assert _fingerprint(_mask([6, 4]).to(dtype)) == fps[0]  # still a fingerprint: same bits, same numbers


def test_finite_tensors_keep_their_two_numbers():
    fp = _fingerprint(torch.randn(4, 5))
    assert len(fp) == 2 and all(math.isfinite(x) for x in fp)


class Attention(nn.Module):
    def __init__(self, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(attended.transpose(1, 2).reshape(b, s, d))


def _fill(mask: torch.Tensor, lengths: list[int]) -> None:
    mask.zero_()
    for i, n in enumerate(lengths):
        mask[i, :, :, n:] = float("-inf")


def test_a_padding_mask_refilled_before_the_backward_is_the_cause(tmp_path):
    torch.manual_seed(0)
    block = Attention()
    x = torch.randn(2, 6, 16, requires_grad=True)
    mask = torch.empty(2, 1, 6, 6)
    _fill(mask, [6, 4])
    with ac_diff.record(tmp_path / "trace-rank0.jsonl"):
        out = checkpoint(lambda h: block(h, mask), x, use_reentrant=False)
        _fill(mask, [5, 6])  # the loader prefetches the next batch's padding into the same buffer
        out.pow(2).sum().backward()

    run = read_run(tmp_path / "trace-rank0.jsonl")
    sdpa = [o for o in run.regions[0].forward.ops if "scaled_dot_product" in o.op]
    assert sdpa and not any(o.random for o in sdpa)  # dropout_p=0: draws nothing

    region = ac_diff.diagnose_paths([str(tmp_path)]).to_json()["regions"][0]
    assert region["status"] == "diverged"
    cause = region["cause"]
    assert cause["kind"] == "state_mutation", cause
    changed = [c for c in region["changed_inputs"] if c["name"] == cause["tensor"]]
    assert changed and changed[0]["meta"] == "f32[2, 1, 6, 6]"
    assert region["first_value_divergence"]["detail"]["inputs_identical"] is False


def test_sdpa_with_dropout_draws(tmp_path):
    torch.manual_seed(0)
    q = torch.randn(1, 2, 4, 8, requires_grad=True)
    with ac_diff.record(tmp_path / "t.jsonl"):
        out = checkpoint(lambda t: F.scaled_dot_product_attention(t, t, t, dropout_p=0.5), q, use_reentrant=False)
        out.sum().backward()
    random = [o.op for o in read_run(tmp_path / "t.jsonl").regions[0].forward.ops if o.random]
    assert random  # (on CPU the math kernel's bernoulli_; a fused kernel with dropout_p > 0 elsewhere)


def test_a_random_op_draws_only_when_its_switches_say_so():
    from ac_diff.capture.opinfo import draws, op_info

    sdpa = op_info(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default)
    assert sdpa.random  # tagged nondeterministic_seeded by torch, whatever its dropout_p
    assert not draws(sdpa, ("$", "$", "$", 0.0), {}) and not draws(sdpa, ("$", "$", "$"), {})
    assert draws(sdpa, ("$", "$", "$", 0.1), {}) and draws(sdpa, ("$", "$", "$"), {"dropout_p": 0.1})
    dropout = op_info(torch.ops.aten.native_dropout.default)
    assert draws(dropout, ("$", 0.1, True), {}) and not draws(dropout, ("$", 0.1, False), {})
    assert draws(op_info(torch.ops.aten.bernoulli_.float), ("$", 0.5), {})
