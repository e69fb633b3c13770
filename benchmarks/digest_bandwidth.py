"""How fast watch mode's batched digest reads saved tensors on a GPU (not a test; CUDA only).

    python benchmarks/digest_bandwidth.py [--reps 20]

For batches shaped like a GPU-bound MoE's saved tensors (a few large ones; many middling; many small), one table:
GB/s of ac-diff's kernel (`byte_sums.ByteSums.launch`: one program per 128 KiB chunk), of the fixed split it
replaced (64 programs per tensor, whatever its size; kept here only to compare), and of torch reading the same
bytes (`t.view(torch.int32).sum()` per tensor: one reduction kernel each) as the reference for this GPU's bandwidth.
Bytes counted once (each word is read once). CUDA events around `--reps` launches, after two warm-ups.
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from ac_diff.capture import byte_sums  # noqa: E402

BATCHES = {  # name -> (count, bytes each): what watch holds per flush (<= 64 tensors, <= 256 MiB)
    "4 x 64 MiB": (4, 64 << 20),
    "1 x 64 MiB + 63 x 1 MiB": None,
    "64 x 4 MiB": (64, 4 << 20),
    "64 x 64 KiB": (64, 64 << 10),
    "64 x 4 KiB": (64, 4 << 10),
}


try:  # at module level: Triton resolves a kernel's names among its module's globals
    import triton
    import triton.language as tl
except ImportError:  # (main() says what is missing)
    triton = None

if triton is not None:
    @triton.jit
    def fixed_split(addrs, sizes, out, G: tl.constexpr, BLOCK: tl.constexpr):
        """The kernel before chunking: a (tensors, 64) grid, each program striding over its tensor by 64K words."""
        t = tl.program_id(0)
        g = tl.program_id(1)
        base = tl.multiple_of(tl.load(addrs + t).to(tl.pointer_type(tl.int32)), 16)
        n = tl.multiple_of(tl.load(sizes + t), 4)
        offs = tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK), BLOCK), BLOCK)
        s1 = tl.zeros([BLOCK], dtype=tl.int32)
        s2 = tl.zeros([BLOCK], dtype=tl.int32)
        start = g * BLOCK
        while start < n:
            idx = start + offs
            w = tl.load(base + idx, mask=idx < n, other=0)
            s1 += w
            s2 += w * (2 * idx + 1)
            start += G * BLOCK
        at = (t * G + g) * 2
        tl.store(out + at, tl.sum(s1.to(tl.int64), axis=0).to(tl.int32))
        tl.store(out + at + 1, tl.sum(s2.to(tl.int64), axis=0).to(tl.int32))


def fixed_split_launch(tensors: list[torch.Tensor]) -> torch.Tensor:
    meta = torch.tensor([[t.data_ptr() for t in tensors], [t.numel() * t.element_size() // 4 for t in tensors]],
                        dtype=torch.int64).pin_memory().cuda(non_blocking=True)
    out = torch.empty((len(tensors), 64, 2), dtype=torch.int32, device="cuda")
    fixed_split[(len(tensors), 64)](meta[0], meta[1], out, G=64, BLOCK=1024)
    return out.sum(1, dtype=torch.int32)


def timed(fn, reps: int) -> float:
    for _ in range(2):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps / 1e3


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--tiles", default="", help="CHUNK:BLOCK:WARPS,... to try instead of byte_sums' own (a sweep)")
    cli = p.parse_args(argv)
    if not torch.cuda.is_available() or triton is None:
        raise SystemExit("digest_bandwidth.py needs a CUDA GPU and Triton")
    sums = byte_sums.ByteSums.get()
    if sums is None:
        raise SystemExit("the batched kernel failed its check on this GPU (see the warning)")
    old = fixed_split_launch
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for tile in cli.tiles.split(",") if cli.tiles else [None]:
        if tile:
            byte_sums.CHUNK, byte_sums.BLOCK, byte_sums.WARPS = map(int, tile.split(":"))
        print(f"chunk {byte_sums.CHUNK} words, block {byte_sums.BLOCK}, {byte_sums.WARPS} warps")
        table(sums, old, cli.reps)


def table(sums, old, reps: int) -> None:
    print(f"{'batch':<26} {'MiB':>6} {'chunked GB/s':>13} {'fixed split GB/s':>17} {'torch sum GB/s':>15} {'same':>5}")
    for name, shape in BATCHES.items():
        sizes = [64 << 20] + [1 << 20] * 63 if shape is None else [shape[1]] * shape[0]
        tensors = [torch.randint(-2**31, 2**31 - 1, (n // 4,), dtype=torch.int32, device="cuda") for n in sizes]
        total = sum(sizes)
        same = torch.equal(sums.launch(tensors), old(tensors))
        rates = [total / timed(fn, reps) / 1e9 for fn in (
            lambda: sums.launch(tensors), lambda: old(tensors), lambda: [t.sum() for t in tensors])]
        print(f"{name:<26} {total / 2**20:>6.0f} {rates[0]:>13.0f} {rates[1]:>17.0f} {rates[2]:>15.0f} {str(same):>5}")


if __name__ == "__main__":
    main()
