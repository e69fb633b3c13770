"""A full recording's fingerprints of many CUDA tensors in ONE kernel launch per dtype (fused_prints_kernel.py), where
reducing each tensor on its own takes 3-5 kernels per tensor: every number of a tensor's fingerprint from one pass
over its memory.

    prints = FusedPrints.get()                   # None without Triton or a CUDA device (the per-tensor path then)
    FusedPrints.takes(torch.bfloat16)            # float32, bfloat16, float16 and the integer dtypes
    parts = prints.launch(device, dtype, [(address, rows, cols), ...])   # on the device, no sync: (n, G, 2) sums
                                                 # per tile, and for floats (n, G) int32 bit sums, else None
    combine(sums_host, bits_host)                # per tensor: floats [s1, s2, bits], integers [s1, s2]

A float tensor is read as the (rows, cols) matrix M of its memory (fingerprint._rows): s1 = sum wc[j] M[i, j] and
s2 = sum wr[i] wc[j] M[i, j] (the float weights of segments._weights, in float32) are the pair that the per-tensor
path defines too, summed in float32 over fixed tiles and in float64 across them, in a fixed order: the same values and
shape give the same numbers in forward and recompute, whatever else shared the launch. bits = sum (2i + 1) bits(M[i,
j]) in wrap-around int32 is the per-tensor path's exact number. An integer tensor's [sum v_k, sum (k + 1) v_k] in
wrap-around int64 is the per-tensor path's exact pair. (Which path a tensor takes depends on its dtype and layout
only, the same in both passes.)

The kernels are checked against a float64 host computation the first time they run (kernel_check.first_use).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from .kernel_check import first_use
from .segments import _weights, wrapped

G = 64  # programs per tensor (each strides over the tensor's elements), as many partial sums
BLOCK = 1024  # elements per program per iteration
MAX_ELEMENTS = 1 << 31  # int32 element indices in the float kernel

_VALUE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # how the float kernel reads the bit patterns
_INTS = {torch.bool: (1, False), torch.uint8: (1, False), torch.int8: (1, True), torch.int16: (2, True),
         torch.int32: (4, True), torch.int64: (8, True)}  # width in bytes, signed


def _kernels() -> tuple[Any, Any]:
    try:  # CUDA builds of torch bring Triton; without it each tensor is reduced on its own
        from .fused_prints_kernel import float_prints, int_prints
    except ImportError as exc:
        raise RuntimeError("triton is not installed") from exc
    return float_prints, int_prints


class FusedPrints:
    """The compiled kernels, and launching them over tensors of one device and dtype."""

    def __init__(self, kernels: tuple[Any, Any]) -> None:
        self.floats, self.ints = kernels

    @classmethod
    def get(cls) -> "FusedPrints | None":
        return first_use("fused_prints", cls._checked, "a full recording reduces each CUDA tensor on its own")

    @classmethod
    def _checked(cls) -> "FusedPrints | None":
        if not torch.cuda.is_available():
            return None
        prints = cls(_kernels())
        prints.check(torch.device("cuda", torch.cuda.current_device()))
        return prints

    @staticmethod
    def takes(dtype: torch.dtype) -> bool:
        return dtype in _VALUE or dtype in _INTS

    def launch(self, device: torch.device, dtype: torch.dtype, entries: list[tuple[int, int, int]]
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The partial sums of tensors of `dtype` on `device`, given as (address, rows, cols) of their memory in order
        (integers: (address, elements, 1)); queued on the current stream."""
        n = len(entries)
        meta = torch.tensor(list(zip(*entries)), dtype=torch.int64)
        if device.type == "cuda":
            meta = meta.pin_memory().to(device, non_blocking=True)
        value = _VALUE.get(dtype)
        if value is not None:
            weights = _weights(device, torch.float32, max(max(r, c) for _, r, c in entries))
            sums = torch.empty((n, G, 2), dtype=torch.float32, device=device)
            bits = torch.empty((n, G), dtype=torch.int32, device=device)
            with _on(device):
                self.floats[(n, G)](meta, weights, sums, bits, n, VALUE=value, G=G, BLOCK=BLOCK)
            return sums, bits
        width, signed = _INTS[dtype]
        sums = torch.empty((n, G, 2), dtype=torch.int64, device=device)
        with _on(device):
            self.ints[(n, G)](meta, sums, n, WIDTH=width, SIGNED=signed, G=G, BLOCK=BLOCK)
        return sums, None

    def check(self, device: torch.device) -> None:
        """Raise unless the kernels give what a float64 host computation gives (bit sums and integers exactly)."""
        g = torch.Generator().manual_seed(0)
        floats = [torch.randn(37, 19, generator=g), torch.randn(3000, generator=g) * 1e3,
                  torch.randn(64, 33, generator=g).to(torch.bfloat16), torch.randn(5, 7, generator=g).half()]
        floats[0][3, 4] = float("-inf")
        ints = [torch.randint(-2**40, 2**40, (70000,), generator=g), torch.randint(-128, 127, (33,), generator=g,
                dtype=torch.int8), torch.rand(100, generator=g) > 0.5, torch.randint(0, 255, (9,), generator=g,
                dtype=torch.uint8)]
        for t in floats + ints:
            on = t.to(device)
            rows, cols = (on.numel(), 1) if t.dim() < 2 or t.dtype in _INTS else on.shape
            sums, bits = self.launch(device, t.dtype, [(on.data_ptr(), rows, cols)])
            got = combine(sums.cpu(), None if bits is None else bits.cpu())[0]
            want = host_reference(t)
            exact = got[2:] == want[2:] if bits is not None else got == want
            close = all(abs(a - b) <= 1e-4 * (abs(b) + 1) or a == b for a, b in zip(got[:2], want[:2]))
            if not (exact and close):
                raise RuntimeError(f"{t.dtype} {tuple(t.shape)}: {got} != {want}")


def _on(device: torch.device) -> Any:
    """The launch's device context (a CUDA device other than the current one); nothing for the interpreter's CPU."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def combine(sums: torch.Tensor, bits: torch.Tensor | None) -> list[list]:
    """Per tensor of a launch, from its host copies: floats [s1, s2, bits], the tiles' float32 sums added in float64
    in tile order (one fixed order, whatever the launch's size); integers [s1, s2]."""
    parts = sums.numpy()
    if bits is None:  # (int64: numpy's sums wrap, as the kernel's do)
        return parts.sum(axis=1).tolist()
    total = parts[:, 0].astype("float64")
    for g in range(1, parts.shape[1]):
        total += parts[:, g]
    wrapped = bits.numpy().astype("int64").sum(axis=1).astype("int32")  # (exact, then modulo 2**32)
    return [[s1, s2, b] for (s1, s2), b in zip(total.tolist(), wrapped.tolist())]


def host_reference(t: torch.Tensor) -> list:
    """What `combine` gives for `t`, computed on the host in float64 (the kernels' check): floats as (rows, cols) of
    their last dimension, [s1, s2, bits]; integers [sum v_k, sum (k + 1) v_k] modulo 2**64."""
    t = t.detach().cpu().contiguous()
    if t.dtype in _INTS:
        v = t.reshape(-1).to(torch.int64)
        k = torch.arange(1, v.numel() + 1, dtype=torch.int64)
        return [int(v.sum()), int((v * k).sum())]
    m = t.reshape(-1, t.shape[-1]) if t.dim() > 1 else t.reshape(-1, 1)
    w = _weights(torch.device("cpu"), torch.float32, max(m.shape)).double()
    wc, wr = w[:m.shape[1]], w[:m.shape[0]]
    values = m.double() * wc
    words = m.view(torch.int16 if m.element_size() == 2 else torch.int32).to(torch.int64).sum(1)
    odd = torch.arange(m.shape[0], dtype=torch.int64) * 2 + 1
    return [float(values.sum()), float((values.sum(1) * wr).sum()), wrapped(int((words * odd).sum()), 32)]
