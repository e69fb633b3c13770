"""Watch mode's CUDA path on CPU: run by tests/test_watch.py in a process with TRITON_INTERPRET=1 (Triton's
interpreter runs the batched digest kernel of ac_diff/capture/byte_sums.py on CPU tensors). Prints one word and
"ok" per check; an assertion ends it with a non-zero exit."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from ac_diff.capture import byte_sums, watch  # noqa: E402
from test_watch import MECHANISMS, WATCH, digests, recorded  # noqa: E402


def batched() -> None:
    """Every tensor goes to the batched kernel, three per launch (several launches per pass)."""
    sums = byte_sums.ByteSums(byte_sums._kernel())
    watch._byte_sums = lambda: sums
    watch._batched = lambda t: True
    watch.HOST_CPU = False  # (CPU tensors would be hashed on the host first)
    watch.HOLD = 3


def kernel() -> None:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(32, 8, generator=g).to(torch.bfloat16)
    flipped = a.clone()
    flipped.view(torch.int16)[5, 3] ^= 1  # the last bit of one element
    moved = a[[1, 0, *range(2, 32)]]  # two rows exchanged
    odd = torch.randn(5, 3, generator=g)  # 60 bytes: not a multiple of 16, reduced on its own (row sums)
    got = digests(a, a.clone(), flipped, moved, torch.zeros(0), a.t(), a[:, :3], odd, odd.clone())
    assert got[0] == byte_sums.host_reference(a) == got[1], got[:2]
    assert got[2] != got[0] and got[3] != got[0]
    assert got[4] == [0, 0]
    assert got[5] == got[0]  # a permutation of dense dims: the same memory, read as it lies
    assert got[6] is not None and got[6] != byte_sums.host_reference(a[:, :3].contiguous())  # not dense: row sums
    assert got[7] == got[8] is not None
    long = torch.randint(-2**31, 2**31 - 1, (3 * byte_sums.CHUNK + 1028,), generator=g, dtype=torch.int32)
    small = torch.randint(-2**31, 2**31 - 1, (4,), generator=g, dtype=torch.int32)
    sums = byte_sums.ByteSums(byte_sums._kernel()).launch([small, long, small]).tolist()  # 1 + 4 + 1 programs
    assert sums == [byte_sums.host_reference(small), byte_sums.host_reference(long), byte_sums.host_reference(small)]


def verdicts() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("clean", "buffer_updated_from_step_3", "dropout_without_rng_state"):
            kwargs, expected = MECHANISMS[name]
            _, _, report, _, _ = recorded(Path(tmp), name, kwargs, **WATCH)
            assert report.verdict == expected, (name, report.headline)


def in_place() -> None:
    """A held tensor changed in place after its save, or whose storage was freed (FSDP's reshard frees it outside
    dispatch), before the batch was launched: not compared, and the freed memory is never read."""
    wp = watch.WatchedPass()
    x, gone, kept = torch.randn(4, 4), torch.randn(4, 4), torch.randn(3, 4)
    before = digests(kept.clone())[0]
    for i, t in enumerate((x, gone, kept)):
        wp.hold(i, t, None)
    x.add_(1)
    gone.untyped_storage().resize_(0)
    wp.launch()
    wp.resolve()
    assert wp.digests == [None, None, before], wp.digests


def spans() -> None:
    """Views of one large memory span, held for the kernel, get one digest per version (the kernel reads the memory
    they occupy); a slice of it its own."""
    x = torch.randn(64, 32, 16)  # 128 KiB: over SPAN_MIN
    wp = watch.WatchedPass()
    for i, t in enumerate((x, x.view(-1, 16), x.transpose(0, 1), x[:32])):
        wp.hold(i, t, None)
    wp.launch()
    wp.resolve()
    assert wp.slots == [0, 0, 0, 1], wp.slots
    assert wp.digests[0] == byte_sums.host_reference(x) and wp.digests[3] == byte_sums.host_reference(x[:32])


if __name__ == "__main__":
    batched()
    for check in (kernel, verdicts, in_place, spans):
        check()
        print(check.__name__, "ok", flush=True)
