"""The recorder never changes the training it observes: losses and gradients are bit-identical."""

from __future__ import annotations

import sys

import pytest
import torch

import ac_diff
from conftest import EXAMPLES
from models import VARIANT_PARAMS, VARIANTS, Net, train_step

sys.path.insert(0, str(EXAMPLES))
import tiny_moe  # noqa: E402


def _assert_identical(a, b):
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    assert torch.equal(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name


@pytest.mark.parametrize("variant", VARIANT_PARAMS)
def test_gradients_bit_identical_with_and_without_recorder(variant, tmp_path):
    torch.manual_seed(1)
    model = Net(VARIANTS[variant])
    plain = train_step(model)
    for p in model.parameters():
        p.grad = None
    with ac_diff.record(tmp_path / "t.jsonl", scope="all"):
        recorded = train_step(model)
    _assert_identical(plain, recorded)


def _moe_step(model, args):
    inputs, labels = tiny_moe.make_batch(args, step=0, seq_len=64)
    loss = tiny_moe.loss_fn(model(inputs), labels)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    return loss.detach(), {**grads, **{f"buffer:{k}": v for k, v in buffers.items()}}


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_moe_training_bit_identical(dropout, tmp_path):
    args = tiny_moe.ModelArgs(dropout=dropout)
    runs = []
    for recorded in (False, True):
        model = tiny_moe.build_model(args, seed=3)
        torch.manual_seed(7)  # dropout draws from the global generator
        if recorded:
            with ac_diff.record(tmp_path / "t.jsonl"):
                runs.append(_moe_step(model, args))
        else:
            runs.append(_moe_step(model, args))
    _assert_identical(*runs)
    # and the recording itself saw the regions
    assert len(ac_diff.load(tmp_path / "t.jsonl").regions) == args.n_layers


def test_rng_stream_is_untouched(tmp_path):
    torch.manual_seed(5)
    model = Net(VARIANTS["non_reentrant"])
    train_step(model)
    expected = torch.rand(3)
    torch.manual_seed(5)
    with ac_diff.record(tmp_path / "t.jsonl"):
        train_step(model)
    assert torch.equal(torch.rand(3), expected)
