"""The Triton kernels of fused_prints.py (imported only when a full recording fingerprints CUDA tensors: it imports
Triton).

    float_prints[(n, G)](meta, weights, sums, bits, VALUE=0|1|2, G=G, BLOCK=BLOCK)
    # program (t, g) strides over tensor t, a (rows, cols) matrix M of float32 (VALUE 0), bfloat16 (1) or float16 (2)
    # in memory order, from element g * BLOCK: sums[t, g] = [sum wc[j] M[i, j], sum wr[i] wc[j] M[i, j]] (float32,
    # wc = wr = `weights`), bits[t, g] = sum (2i + 1) bits(M[i, j]) (wrap-around int32)
    int_prints[(n, G)](meta, sums, G=G, BLOCK=BLOCK)
    # the same for integers (any width, read as the pointer dtype meta's addresses are cast to): sums[t, g] =
    # [sum v_k, sum (k + 1) v_k] in wrap-around int64

`meta` is (3, n) int64: the tensors' addresses, rows and columns (integers: elements and 1). Every number of the
fingerprint comes from ONE pass over the data; each program's part is a fixed tree of a fixed tile, so a tensor's
parts depend on its own values and shape only, never on its neighbours in the launch. The bit sums accumulate in
int32 and are reduced in int64 then cast back (the same numbers modulo 2**32: interpreters that sum int32 through
numpy widen the result and refuse to narrow it). At module level: Triton's interpreter before 3.1 requires
`triton.language` among the kernel's globals.
"""

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # (fused_prints imports this module lazily; without Triton the per-tensor path runs)
    raise ImportError("triton is not installed") from exc


@triton.jit(do_not_specialize=["n_tensors"])  # (one compiled kernel whatever a launch's size: 1 would be a constant)
def float_prints(meta, weights, sums, bits, n_tensors, VALUE: tl.constexpr, G: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    g = tl.program_id(1)
    cols = tl.load(meta + 2 * n_tensors + t).to(tl.int32)
    n = tl.load(meta + n_tensors + t).to(tl.int32) * cols
    if VALUE == 0:
        base = tl.load(meta + t).to(tl.pointer_type(tl.int32))
    else:
        base = tl.load(meta + t).to(tl.pointer_type(tl.int16))
    offs = tl.arange(0, BLOCK)
    s1 = tl.zeros([BLOCK], dtype=tl.float32)
    s2 = tl.zeros([BLOCK], dtype=tl.float32)
    s3 = tl.zeros([BLOCK], dtype=tl.int32)
    start = g * BLOCK
    while start < n:
        idx = start + offs
        mask = idx < n
        raw = tl.load(base + idx, mask=mask, other=0)
        word = raw.to(tl.int32)  # (int16 bit patterns sign-extended, as `_bit_rows` sums them)
        if VALUE == 0:
            x = raw.to(tl.float32, bitcast=True)
        elif VALUE == 1:  # bfloat16: the upper half of a float32, exactly
            x = (word << 16).to(tl.float32, bitcast=True)
        else:
            x = raw.to(tl.float16, bitcast=True).to(tl.float32)
        i = idx // cols
        j = idx - i * cols
        wc = tl.load(weights + j, mask=mask, other=0.0)
        wr = tl.load(weights + i, mask=mask, other=0.0)
        cx = wc * x  # (masked lanes: x 0, weights 0)
        s1 += cx
        s2 += wr * cx
        s3 += (2 * i + 1) * word
        start += G * BLOCK
    at = t * G + g
    tl.store(sums + 2 * at, tl.sum(s1, axis=0))
    tl.store(sums + 2 * at + 1, tl.sum(s2, axis=0))
    tl.store(bits + at, tl.sum(s3.to(tl.int64), axis=0).to(tl.int32))


@triton.jit(do_not_specialize=["n_tensors"])
def int_prints(meta, sums, n_tensors, WIDTH: tl.constexpr, SIGNED: tl.constexpr, G: tl.constexpr,
               BLOCK: tl.constexpr):
    t = tl.program_id(0)
    g = tl.program_id(1)
    n = tl.load(meta + n_tensors + t)
    if WIDTH == 1:
        if SIGNED:
            base = tl.load(meta + t).to(tl.pointer_type(tl.int8))
        else:
            base = tl.load(meta + t).to(tl.pointer_type(tl.uint8))
    elif WIDTH == 2:
        base = tl.load(meta + t).to(tl.pointer_type(tl.int16))
    elif WIDTH == 4:
        base = tl.load(meta + t).to(tl.pointer_type(tl.int32))
    else:
        base = tl.load(meta + t).to(tl.pointer_type(tl.int64))
    offs = tl.arange(0, BLOCK).to(tl.int64)
    s1 = tl.zeros([BLOCK], dtype=tl.int64)
    s2 = tl.zeros([BLOCK], dtype=tl.int64)
    start = (g * BLOCK).to(tl.int64)
    while start < n:
        idx = start + offs
        v = tl.load(base + idx, mask=idx < n, other=0).to(tl.int64)
        s1 += v
        s2 += v * (idx + 1)
        start += G * BLOCK
    at = t * G + g
    tl.store(sums + 2 * at, tl.sum(s1, axis=0))
    tl.store(sums + 2 * at + 1, tl.sum(s2, axis=0))
