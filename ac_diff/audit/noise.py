"""The perturbations an audit injects, and the unit they are measured in (ulps of a dtype).

    spec = parse_noise("1ulp")        # NoiseSpec(kind="ulp", size=1.0): every element moved by 1 ulp, random sign
                                      # (rounding noise: exact zeros stay)
    spec = parse_noise("rel:1e-6")    # x * (1 + 1e-6 * N(0, 1))
    spec = parse_noise("abs:1e-3")    # x + 1e-3 * N(0, 1)   (e.g. the per-step change of a bias)
    spec = parse_noise("realistic")   # at the op that produced the scores: the rounding of its reduction
                                      # in another order (matmuls: u * sqrt(K) * |a_i * b_j|_2, else 1 ulp)
    ulp(torch.tensor([1.0, 1000.0]))  # tensor([1.1921e-07, 6.1035e-05]): the spacing of f32 at each value
    perturb(out, spec, generator)     # the noise to add to `out` (same shape/dtype), seeded
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import AcDiffError
from ..oprules import packet

# Reduction ops whose rounding depends on the summation order: (index of A, index of B) in their arguments.
MATMULS = {"mm": (0, 1), "addmm": (1, 2), "bmm": (0, 1), "baddbmm": (1, 2), "matmul": (0, 1)}


class NoiseError(AcDiffError, ValueError):
    """A --noise value that is not one of the documented forms."""


@dataclass(frozen=True)
class NoiseSpec:
    kind: str  # "ulp" | "rel" | "abs" | "realistic"
    size: float = 1.0

    @property
    def text(self) -> str:
        if self.kind == "ulp":
            return f"{self.size:g}ulp"
        return "realistic" if self.kind == "realistic" else f"{self.kind}:{self.size:g}"

    @property
    def rounding(self) -> bool:
        """The noise of another summation order (ulps, realistic), not a drift the user names (rel, abs)."""
        return self.kind in ("ulp", "realistic")

    @property
    def at_origin(self) -> bool:
        """Injected at the op that computed the scores (a matmul), not at the decision's own input."""
        return self.kind == "realistic"


def parse_noise(text: str) -> NoiseSpec:
    t = text.strip().lower()
    try:
        if t == "realistic":
            return NoiseSpec("realistic")
        if t.endswith("ulps") or t.endswith("ulp"):
            size = float(t[: -4 if t.endswith("ulps") else -3] or 1)
            kind = "ulp"
        elif ":" in t:
            kind, _, value = t.partition(":")
            size = float(value)
        else:
            kind, size = "rel", float(t)
    except ValueError:
        kind, size = "?", 0.0
    if kind not in ("ulp", "rel", "abs") or not math.isfinite(size) or size <= 0:
        raise NoiseError(f"--noise {text!r} is not a noise size: use e.g. 1ulp, 4ulp, rel:1e-6 (or 1e-6), "
                         "abs:1e-3 or realistic")
    return NoiseSpec(kind, size)


def ulp(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The spacing of `dtype` (default: t's) at the magnitude of each element of t, as float64."""
    dtype = dtype or t.dtype
    info = torch.finfo(dtype)
    x = t.detach().to(torch.float64).abs()
    _, exp = torch.frexp(x)  # x = m * 2**exp, m in [0.5, 1)
    spacing = torch.ldexp(torch.full_like(x, info.eps), (exp - 1).to(torch.int32))
    return spacing.clamp_min(info.tiny * info.eps)


ROUNDING_HEADROOM = 12  # bits a value leaves free in its dtype's mantissa for it to count as exact (exact_values)


def exact_values(t: torch.Tensor) -> bool:
    """Every element of floating `t` has at most (its dtype's significant bits - ROUNDING_HEADROOM) significant bits,
    as float32 scores that are sums of quarters or of int8-quantized products: a sum of thousands of such values is
    exact in any order, so no reduction order (the rounding an ulp of noise stands for) moves them. Never true of
    bf16 or fp16 (8 and 11 bits), nor of values with rounding in them."""
    if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.numel() == 0:
        return False
    bits = round(-math.log2(torch.finfo(t.dtype).eps)) + 1 - ROUNDING_HEADROOM  # (float32: 24 - 12)
    x = t.detach().to(torch.float64)
    if bits <= 0 or not bool(torch.isfinite(x).all()):
        return False
    mantissa, _ = torch.frexp(x)  # x = m * 2**e, |m| in [0.5, 1): `bits` bits hold m where m * 2**bits is whole
    scaled = torch.ldexp(mantissa, torch.full_like(mantissa, bits, dtype=torch.int32))
    return bool((scaled == scaled.round()).all())


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The precision a kernel computes a narrow output in before rounding it (bf16, fp16 and fp8 accumulate in
    float32)."""
    return torch.float32 if dtype.is_floating_point and torch.finfo(dtype).bits < 32 else dtype


def perturb(out: torch.Tensor, spec: NoiseSpec, generator: torch.Generator,
            sigma: torch.Tensor | None = None) -> torch.Tensor:
    """Seeded noise for `out` (same shape and dtype). `sigma`: the realistic per-element scale. Rounding noise (ulps,
    realistic) leaves exact values alone (exact_values); a drift the user names (rel, abs) moves them too.

    Rounding noise into a narrow output (bf16) is an ulp of the precision it was computed in (float32), added before
    its rounding: where in its rounding interval the value was is not known, so it is drawn (a dither); the output
    moves by a whole bf16 ulp only where that pushes it across the interval's edge, as another summation order does."""
    rounding = spec.rounding
    if rounding and exact_values(out):
        return torch.zeros_like(out)
    acc = accumulation_dtype(out.dtype)
    x = out.detach().to(torch.float64)
    if rounding and acc != out.dtype:
        x = _dithered(out, generator)
    if spec.kind == "ulp":
        sign = torch.randint(0, 2, out.shape, generator=generator, device=out.device).to(torch.float64) * 2 - 1
        delta = sign * spec.size * ulp(x, acc)
    else:
        g = torch.randn(out.shape, generator=generator, device=out.device, dtype=torch.float64)
        if spec.kind == "rel":
            delta = g * spec.size * x.abs()
        elif spec.kind == "abs":
            delta = g * spec.size
        else:
            delta = g * spec.size * (sigma if sigma is not None else ulp(x, acc))
    if not rounding:
        return delta.to(out.dtype)
    if acc != out.dtype:
        delta = (x + delta).to(out.dtype).to(torch.float64) - out.detach().to(torch.float64)
    # (an exact zero is a mask's or a constant's, `torch.where(m, 0, z)`, relu's: no summation order moves it, and
    # noise there breaks ties between zeros that every recompute keeps)
    return torch.where(out.detach() == 0, torch.zeros((), dtype=torch.float64, device=out.device), delta).to(out.dtype)


def _dithered(out: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """A value (float64) drawn uniformly from the interval that rounds to each element of `out` in its dtype."""
    up = torch.nextafter(out.detach(), torch.full_like(out.detach(), math.inf)).to(torch.float64)
    down = torch.nextafter(out.detach(), torch.full_like(out.detach(), -math.inf)).to(torch.float64)
    x = out.detach().to(torch.float64)
    u = torch.rand(out.shape, generator=generator, device=out.device, dtype=torch.float64) * 0.998 + 0.001
    lo, hi = (x + down) / 2, (x + up) / 2  # strictly inside: the midpoints themselves may round either way
    return torch.where(torch.isfinite(lo) & torch.isfinite(hi), lo + u * (hi - lo), x)


def reduction_sigma(name: str, args: tuple, out: torch.Tensor) -> tuple[torch.Tensor, str]:
    """The per-element scale of a recompute that sums in another order, and how it was modelled.

    A K-term dot product rounded in another order moves by about u * sqrt(K) * |a_i * b_j|_2 (the
    rounding errors of the partial sums add like a random walk); other ops: 1 ulp of their output."""
    pair = MATMULS.get(packet(name))
    if pair is not None and len(args) > max(pair):
        a, b = args[pair[0]], args[pair[1]]
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.is_floating_point():
            k = a.shape[-1]
            with torch.no_grad():
                terms = torch.matmul(a.detach().double().square(), b.detach().double().square()).sqrt()
            if terms.shape == out.shape:
                acc = accumulation_dtype(out.dtype)
                u = torch.finfo(acc).eps / 2
                return (u * math.sqrt(k) * terms).clamp_min(0.0), f"{packet(name)} over K={k} in {str(acc)[6:]}"
    return ulp(out, accumulation_dtype(out.dtype)), "1 ulp of the precision it computes in"
