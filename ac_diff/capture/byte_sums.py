"""Watch mode's digests of many CUDA tensors in ONE kernel launch: per tensor, the sum of its 32-bit words and their
odd-weighted sum, over the memory it occupies (a Triton kernel; the tensors' addresses are its input).

    sums = ByteSums.get()                  # None without Triton or a CUDA device (watch then reduces per tensor)
    sums.fits(t)                           # dense, its bytes a multiple of 16 from a 16-byte aligned start
    out = sums.launch([t1, t2, ...])       # an (n, 2) int32 tensor on the device: [sum w_i, sum (2i + 1) w_i] per
                                           # tensor, w_i its i-th 32-bit word, in wrap-around int32; no host sync

Exact in any order (integers modulo 2**32), so a recompute that saved the same bits gets the same numbers; one
changed bit changes both (the weights are odd, so invertible modulo 2**32), words moved to other places change
the weighted one. A reduction launched per saved tensor costs the host 20-30 us on a GPU: this costs one launch
per batch, and reads the memory once at full width (aligned 16-byte loads).

The kernel is checked against a host computation the first time it runs; if it fails to compile or to agree,
watch mode reduces per tensor instead, with one warning.
"""

from __future__ import annotations

from typing import Any

import torch

from .fingerprint import in_memory_order
from .kernel_check import first_use
from .segments import wrapped

# Measured on an H100 (benchmarks/digest_bandwidth.py --tiles): smaller chunks spend their time starting programs,
# larger ones leave SMs idle on a 256 MiB batch
CHUNK = 262144  # words per program (1 MiB): a 64 MiB tensor is read by 64 programs, each over 32 iterations
BLOCK = 8192  # words per program per iteration (32 KiB in flight per program)
WARPS = 8


def _kernel():
    try:  # CUDA builds of torch bring Triton; without it watch mode reduces each tensor on its own
        from .byte_sums_kernel import word_sums
    except ImportError as exc:
        raise RuntimeError("triton is not installed") from exc
    return word_sums


def dense(t: torch.Tensor) -> bool:
    """`t` covers exactly numel * itemsize bytes from its data pointer (contiguous, or contiguous dims permuted)."""
    return t.is_contiguous() or in_memory_order(t).is_contiguous()


def host_reference(t: torch.Tensor) -> list[int]:
    """[sum w_i, sum (2i + 1) w_i] of `t`'s 32-bit words, on the host, wrapped to int32 (the check)."""
    words = t.detach().cpu().contiguous().view(torch.uint8).reshape(-1).view(torch.int32).tolist()
    return [wrapped(sum(words), 32), wrapped(sum((2 * i + 1) * w for i, w in enumerate(words)), 32)]


class ByteSums:
    """The compiled kernel, and launching it over a batch of tensors of one CUDA device."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel

    @classmethod
    def get(cls) -> "ByteSums | None":
        return first_use("byte_sums", cls._checked, "watch mode reduces each saved tensor on its own")

    @classmethod
    def _checked(cls) -> "ByteSums | None":
        if not torch.cuda.is_available():
            return None
        sums = cls(_kernel())
        g = torch.Generator().manual_seed(0)
        samples = [torch.randint(-2**31, 2**31 - 1, (n,), generator=g, dtype=torch.int32) for n in (4, 4100, 70000)]
        got = sums.launch([s.cuda() for s in samples]).cpu().tolist()
        want = [host_reference(s) for s in samples]
        if got != want:
            raise RuntimeError(f"digests {got} != {want}")
        return sums

    @staticmethod
    def fits(t: torch.Tensor) -> bool:
        """Dense, and its bytes a multiple of 16 from a 16-byte aligned start (allocations are aligned further: the
        offset decides, the same in both passes)."""
        size = t.element_size()
        nbytes = t.numel() * size
        return nbytes % 16 == 0 and nbytes < 1 << 33 and (t.storage_offset() * size) % 16 == 0 and dense(t)

    def launch(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """(n, 2) int32 on the tensors' device (all `fits`, one device); the host's address and chunk lists travel
        in one pinned copy."""
        device = tensors[0].device
        words = [t.numel() * t.element_size() // 4 for t in tensors]
        owners: list[int] = []
        numbers: list[int] = []
        for i, w in enumerate(words):
            k = -(-w // CHUNK)
            owners += [i] * k
            numbers += range(k)
        n_chunks = len(owners)
        out = torch.zeros((len(tensors), 2), dtype=torch.int32, device=device)
        if not n_chunks:  # (empty tensors only)
            return out
        cuda = device.type == "cuda"
        meta = torch.tensor([t.data_ptr() for t in tensors] + words + owners + numbers, dtype=torch.int64,
                            pin_memory=cuda)
        n = len(tensors)
        if cuda:
            meta = meta.to(device, non_blocking=True)
        args = (meta[:n], meta[n:2 * n], meta[2 * n:], n_chunks, out)
        if cuda:
            with torch.cuda.device(device):
                self.kernel[(n_chunks,)](*args, CHUNK=CHUNK, BLOCK=BLOCK, num_warps=WARPS)
        else:  # Triton's interpreter (TRITON_INTERPRET=1): the tests run the kernel on CPU tensors
            self.kernel[(n_chunks,)](*args, CHUNK=CHUNK, BLOCK=BLOCK, num_warps=WARPS)
        return out
