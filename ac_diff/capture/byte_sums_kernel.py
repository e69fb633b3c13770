"""The Triton kernel of byte_sums.py (imported only when watch mode digests CUDA tensors: it imports Triton).

    out = torch.zeros((n, 2), dtype=torch.int32)
    word_sums[(n_chunks,)](addrs, sizes, chunks, n_chunks, out, CHUNK=CHUNK, BLOCK=BLOCK)
    # program c reads words [k * CHUNK, (k + 1) * CHUNK) of tensor t (chunks[c] = t, chunks[n_chunks + c] = k), adds
    # [sum w_i, sum (2i+1) w_i] over them to out[t]

One program per chunk, not a fixed number per tensor: a large tensor gets as many programs as it has chunks, so its
memory is read by the whole GPU, not by the few SMs a fixed split gives it. The two sums accumulate in wrap-around
int32 and reach out[t] through integer atomics: the same numbers in any order. Their last reduction inside a program
runs in int64 and is cast back (interpreters that sum int32 through numpy widen the result and refuse to narrow it).
At module level, not in a function: Triton's interpreter before 3.1 requires `triton.language` among the kernel's
globals.
"""

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # (byte_sums._kernel() imports this module, and watch falls back without Triton)
    raise ImportError("triton is not installed") from exc


@triton.jit
def word_sums(addrs, sizes, chunks, n_chunks, out, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    c = tl.program_id(0)
    t = tl.load(chunks + c)
    # (a chunk's number, not its first word: a multiple of CHUNK the compiler can see keeps the loads 16 bytes wide)
    start = tl.load(chunks + n_chunks + c).to(tl.int32) * CHUNK  # words < 2**31 (byte_sums.fits)
    base = tl.load(addrs + t).to(tl.pointer_type(tl.int32))
    base = tl.multiple_of(base, 16)
    n = tl.multiple_of(tl.load(sizes + t).to(tl.int32), 4)
    offs = tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK), BLOCK), BLOCK)
    s1 = tl.zeros([BLOCK], dtype=tl.int32)
    s2 = tl.zeros([BLOCK], dtype=tl.int32)
    for j in range(0, CHUNK, BLOCK):
        idx = start + j + offs
        w = tl.load(base + idx, mask=idx < n, other=0)
        s1 += w
        s2 += w * (2 * idx + 1)
    tl.atomic_add(out + 2 * t, tl.sum(s1.to(tl.int64), axis=0).to(tl.int32))
    tl.atomic_add(out + 2 * t + 1, tl.sum(s2.to(tl.int64), axis=0).to(tl.int32))
