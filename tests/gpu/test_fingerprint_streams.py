"""Fingerprints of a tensor made on a side stream (an FSDP all-gather, an overlapped collective) are read
back only after that stream's work, on the tensor's own device (cuda:1 on LOCAL_RANK 1)."""

from __future__ import annotations

import pytest
import torch

from ac_diff.capture.fingerprint import FingerprintBatch


def _long_work(a: torch.Tensor, steps: int = 40) -> torch.Tensor:
    """About a second of GPU time: a spin kernel (so that the stream is surely still busy when the host reads),
    then the products that make the values (tanh keeps them bounded)."""
    torch.cuda._sleep(2_000_000_000)  # ~1 s of clock cycles on the current stream
    x = a
    for _ in range(steps):
        x = torch.tanh(x @ a)
    return x


def _fingerprint_now(t: torch.Tensor) -> tuple[list, dict]:
    """The fingerprint and kept values of `t`, computed with nothing in flight."""
    torch.cuda.synchronize(t.device)
    batch = FingerprintBatch()
    slot, kept = batch.add(t), batch.keep(t[:2, :2])
    values, kept_values = batch.collect()
    return values[slot], kept_values[kept]


@pytest.mark.parametrize("index", range(max(torch.cuda.device_count(), 1)))
def test_a_fingerprint_queued_on_a_side_stream_is_read_after_it(index):
    device = torch.device("cuda", index)  # not the current device where there are several: no assumption
    a = torch.randn(4096, 4096, device=device) / 64
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # steady state: weights cached, the allocator's pool for this stream filled
        warm = FingerprintBatch()    # (a first cudaMalloc may wait for the device: a training step's first only)
        warm.add(a), warm.keep(a[:2, :2]), warm.collect()
    batch = FingerprintBatch()
    with torch.cuda.stream(side):
        x = _long_work(a)
        assert not side.query(), "the side stream's work ended while the host queued it (blocking launches?)"
        slot, kept = batch.add(x), batch.keep(x[:2, :2])
    assert not side.query(), "queuing the fingerprint waited for the side stream: a host sync in add() or keep()"
    values, kept_values = batch.collect()  # on the default stream of `device`, while side still runs
    with torch.cuda.stream(side):  # the same stream as the reductions above: the same cuBLAS kernels
        expected = _fingerprint_now(x)
    assert (values[slot], kept_values[kept]) == expected
