"""CUDA's fused attention kernels on a CPU build: the ops, their return structures and their RNG bookkeeping.

    with CudaAttention():                         # entered before recording: it sits below the recorder
        out = attention(q, k, v, kernel="flash", dropout_p=0.0, is_causal=True)
        out.sum().backward()

On a GPU, `F.scaled_dot_product_attention` dispatches `_scaled_dot_product_flash_attention` (or the cuDNN or
memory-efficient kernel), whose returns mix tensors with None and ints and carry RNG bookkeeping. A CPU build
never runs them (it picks `_scaled_dot_product_flash_attention_for_cpu`), so `attention()` calls the CUDA op
itself, as SDPA does on CUDA, through torch's own autograd formula for it, and `CudaAttention` (a dispatch mode
below the recorder) answers the op and its backward as the CUDA kernel does:

* the return structure torch's meta kernels give for a "cuda" tensor (checked against FakeTensorMode in the
  tests): flash (out, logsumexp, None, None, max_q, max_k, rng_state u64[2], unused u64[], debug mask f[0]),
  efficient (out, logsumexp padded to 32, philox_seed i64[], philox_offset i64[]), cuDNN (out, logsumexp
  [B, H, L, 1], None, None, max_q, max_k, philox_seed, philox_offset, None);
* RNG bookkeeping that the kernel writes only when it draws: with `dropout_p > 0` the seed and offset of the draw
  (the offset advances torch's default generator, as philox advances the CUDA generator's), which the backward
  reads to regenerate the dropout mask; with `dropout_p == 0` memory nobody wrote (`at::empty`), whose contents
  differ from one call to the next;
* values from the math path, with the backward by hand (the mode runs below autograd).
"""

from __future__ import annotations

import itertools
import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten


def _cudnn_takes_a_bias() -> bool:
    """cuDNN attention's op as the stand-in answers it (attn_bias, compute_log_sumexp: torch >= 2.5; torch 2.4's has
    another signature)."""
    schema = getattr(getattr(aten, "_scaled_dot_product_cudnn_attention", None), "default", None)
    return schema is not None and any(a.name == "attn_bias" for a in schema._schema.arguments)


KERNELS = ("flash", "efficient") + (("cudnn",) if _cudnn_takes_a_bias() else ())
FORWARD_OPS = {"flash": aten._scaled_dot_product_flash_attention.default,
               "efficient": aten._scaled_dot_product_efficient_attention.default,
               "cudnn": aten._scaled_dot_product_cudnn_attention.default}
# what uninitialised memory holds: another value at each call (forward 3886945403777, recompute 0 on an H200)
_garbage = itertools.count(3886945403777, 7919)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel: str, dropout_p: float = 0.0,
              is_causal: bool = False) -> torch.Tensor:
    """What `F.scaled_dot_product_attention` calls on CUDA for `kernel` (its first output)."""
    if kernel == "flash":
        return FORWARD_OPS[kernel](q, k, v, dropout_p, is_causal, False)[0]
    if kernel == "efficient":
        return FORWARD_OPS[kernel](q, k, v, None, True, dropout_p, is_causal)[0]
    return FORWARD_OPS[kernel](q, k, v, None, True, dropout_p, is_causal, False)[0]


def _uninitialised(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    return torch.full(shape, next(_garbage) % 2**62, dtype=torch.int64).to(dtype)


def _draw() -> tuple[int, int]:
    """(seed, offset) of one dropout draw: the offset moves torch's default generator forward."""
    return torch.initial_seed() % 2**62, int(torch.randint(0, 2**62, (1,)))


def _mask(shape: tuple, p: float, seed: int, offset: int) -> torch.Tensor:
    g = torch.Generator().manual_seed((seed * 1_000_003 + offset) % 2**63)
    return (torch.rand(shape, generator=g) >= p).float() / (1 - p)


def _scores(q, k, scale, is_causal, bias):
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    s = (q.float() @ k.float().transpose(-2, -1)) * scale
    if is_causal:
        L, S = s.shape[-2:]
        s = s.masked_fill(torch.ones(L, S, dtype=torch.bool).triu(1), float("-inf"))
    if bias is not None:
        s = s + bias.float()
    return s, scale


def _forward(q, k, v, dropout_p, is_causal, scale, bias):
    s, _ = _scores(q, k, scale, is_causal, bias)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None])
    seed = offset = None
    if dropout_p > 0:
        seed, offset = _draw()
        p = p * _mask(p.shape, dropout_p, seed, offset)
    return (p @ v.float()).to(q.dtype), lse, seed, offset


def _backward(grad, q, k, v, dropout_p, is_causal, scale, bias, seed, offset):
    s, scale = _scores(q, k, scale, is_causal, bias)
    p = torch.softmax(s, -1)
    mask = _mask(p.shape, dropout_p, seed, offset) if dropout_p > 0 else None
    pd = p * mask if mask is not None else p
    g = grad.float()
    dv = pd.transpose(-2, -1) @ g
    dpd = g @ v.float().transpose(-2, -1)
    dp = dpd * mask if mask is not None else dpd
    ds = p * (dp - (dp * p).sum(-1, keepdim=True))
    dq = ds @ k.float() * scale
    dk = ds.transpose(-2, -1) @ q.float() * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _seed_offset(seed, offset, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    if seed is None:
        return _uninitialised((), dtype), _uninitialised((), dtype)
    return torch.tensor(seed, dtype=dtype), torch.tensor(offset, dtype=dtype)


class CudaAttention(TorchDispatchMode):
    """Answers the CUDA attention kernels (forward and backward) on CPU tensors, as described above; every
    other op runs as usual."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func)
        return handler(*args, **kwargs) if handler is not None else func(*args, **kwargs)


def _flash(q, k, v, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    out, lse, seed, offset = _forward(q, k, v, dropout_p, is_causal, scale, None)
    if seed is None:
        rng_state = _uninitialised((2,), torch.uint64)
    else:
        rng_state = torch.tensor([seed, offset], dtype=torch.uint64)
    return (out, lse, None, None, q.shape[-2], k.shape[-2], rng_state, torch.empty((), dtype=torch.uint64),
            torch.empty(0, dtype=q.dtype))


def _flash_backward(grad, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, rng_state, unused,
                    *, scale=None):
    seed, offset = (int(x) for x in rng_state.tolist()) if dropout_p > 0 else (None, None)
    return _backward(grad, q, k, v, dropout_p, is_causal, scale, None, seed, offset)


def _efficient(q, k, v, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *, scale=None):
    out, lse, seed, offset = _forward(q, k, v, dropout_p, is_causal, scale, attn_bias)
    padded = -(-q.shape[-2] // 32) * 32  # the kernel's logsumexp is padded to a multiple of 32 rows
    lse = torch.nn.functional.pad(lse, (0, padded - lse.shape[-1]))
    return (out, lse, *_seed_offset(seed, offset, torch.int64))


def _efficient_backward(grad, q, k, v, attn_bias, out, lse, seed, offset, dropout_p, grad_input_mask,
                        is_causal=False, *, scale=None):
    draw = (int(seed), int(offset)) if dropout_p > 0 else (None, None)
    dq, dk, dv = _backward(grad, q, k, v, dropout_p, is_causal, scale, attn_bias, *draw)
    return dq, dk, dv, None


def _cudnn(q, k, v, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, return_debug_mask=False, *,
           scale=None):
    out, lse, seed, offset = _forward(q, k, v, dropout_p, is_causal, scale, attn_bias)
    return (out, lse[..., None], None, None, q.shape[-2], k.shape[-2], *_seed_offset(seed, offset, torch.int64), None)


def _cudnn_backward(grad, q, k, v, out, lse, seed, offset, attn_bias, cum_q, cum_k, max_q, max_k, dropout_p,
                    is_causal, *, scale=None):
    draw = (int(seed), int(offset)) if dropout_p > 0 else (None, None)
    return _backward(grad, q, k, v, dropout_p, is_causal, scale, attn_bias, *draw)


_HANDLERS = {
    aten._scaled_dot_product_flash_attention.default: _flash,
    aten._scaled_dot_product_flash_attention_backward.default: _flash_backward,
    aten._scaled_dot_product_efficient_attention.default: _efficient,
    aten._scaled_dot_product_efficient_attention_backward.default: _efficient_backward,
    aten._scaled_dot_product_cudnn_attention.default: _cudnn,
    aten._scaled_dot_product_cudnn_attention_backward.default: _cudnn_backward,
}
