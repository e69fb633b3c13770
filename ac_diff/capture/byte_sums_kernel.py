"""The Triton kernel of byte_sums.py (imported only when watch mode digests CUDA tensors: it imports Triton).

    word_sums[(n, G)](addrs, sizes, out, G=G, BLOCK=BLOCK)
    # program (t, g) strides over tensor t's 32-bit words from word g * BLOCK: out[t, g] = [sum w_i, sum (2i+1) w_i]

At module level, not in a function: Triton's interpreter before 3.1 requires `triton.language` among the kernel's
globals. The two sums accumulate in wrap-around int32; their last reduction runs in int64 and is cast back (the
same numbers modulo 2**32: interpreters that sum int32 through numpy widen the result and refuse to narrow it).
"""

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # (byte_sums._kernel() imports this module, and watch falls back without Triton)
    raise ImportError("triton is not installed") from exc


@triton.jit
def word_sums(addrs, sizes, out, G: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    g = tl.program_id(1)
    base = tl.load(addrs + t).to(tl.pointer_type(tl.int32))
    base = tl.multiple_of(base, 16)
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
