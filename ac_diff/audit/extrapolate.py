"""From the flip rate per row at the audited scale to the flips to expect per step at a target scale.

    scale = parse_scale("tokens=8192,layers=48")          # Scale(tokens=8192, layers=48, experts=None, steps=1)
    risk = extrapolate(auditor.sites.values(), auditor.regions, scale)
    risk["expected_flips_per_step"]       -> 3.1
    risk["p_checkpoint_error"]            -> 0.95   (over `steps` steps)
    risk["headline"] -> "at 8192 tokens x 48 layers: expect about 3.1 decision flips per step, 2.9 of them
                         shape-changing: CheckpointError almost certain"

The model: expected flips per step = sum over decision kinds (a site with its layer number wildcarded,
`layers.*.moe.router topk`) of P(flip per row) x rows per call x (target tokens / audited tokens) x
target layers. Rows grow with tokens; each layer adds its own rows. With `experts=E` a chooser's
P(flip) is scaled by E / (its audited candidates): among n roughly exchangeable scores the gap
between the k-th and (k+1)-th shrinks like 1/n, so the density of margins near zero grows like n.
Flips are rare and independent, so P(at least one shape-changing flip in S steps) = 1 - exp(-S x rate).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import median_low

from ..errors import AcDiffError

SCALE_KEYS = ("tokens", "layers", "experts", "steps")


class ScaleError(AcDiffError, ValueError):
    """A --scale value that is not KEY=N[,KEY=N...]."""


@dataclass(frozen=True)
class Scale:
    tokens: int | None = None
    layers: int | None = None
    experts: int | None = None
    steps: int = 1


def parse_scale(text: str | None) -> Scale:
    if not text:
        return Scale()
    values: dict = {}
    for part in text.split(","):
        key, sep, value = part.strip().partition("=")
        key = key.strip().lower()
        try:
            number = int(float(value)) if sep else -1
        except ValueError:
            number = -1
        if key not in SCALE_KEYS or number <= 0:
            raise ScaleError(f"--scale {text!r}: use KEY=N pairs separated by commas, keys {', '.join(SCALE_KEYS)} "
                             "(e.g. tokens=8192,layers=48)")
        values[key] = number
    return Scale(**values)


def likelihood(p: float) -> str:
    if p >= 0.99:
        return "almost certain"
    if p >= 0.5:
        return "likely"
    if p >= 0.01:
        return "possible"
    return "unlikely"


def extrapolate(sites, regions, scale: Scale, noise: str | None = None) -> dict:
    audited_tokens = median_low([r.tokens for r in regions if r.tokens]) if any(r.tokens for r in regions) else None
    groups: dict[str, list] = {}
    for s in sites:
        if s.kind is not None and s.rows and s.same_as is None:  # (a decision another site makes: counted there)
            groups.setdefault(s.layer_kind, []).append(s)
    kinds, total, shape_total = [], 0.0, 0.0
    for name, members in sorted(groups.items()):
        rows = sum(s.rows for s in members)
        calls = sum(s.calls for s in members)
        rate = sum(s.rate() * s.rows for s in members) / rows
        layers_audited = len({s.label[0] for s in members})
        candidates = next((s.candidates for s in members if s.candidates), None)
        experts_factor = scale.experts / candidates if scale.experts and candidates and members[0].kind == "chooser" else 1.0
        tokens_factor = scale.tokens / audited_tokens if scale.tokens and audited_tokens else 1.0
        layers = scale.layers or layers_audited
        p = min(1.0, rate * experts_factor)
        per_step = p * (rows / calls) * tokens_factor * layers
        shares = [(s.shape_share(), s.rows) for s in members if s.shape_share() is not None]
        share = sum(a * w for a, w in shares) / sum(w for _, w in shares) if shares else None
        shape = per_step * share if share is not None else None
        total += per_step
        shape_total += shape or 0.0
        kinds.append({"site": name, "p_flip_per_row": p, "rows_per_call": rows / calls, "tokens_factor": tokens_factor,
                      "layers": layers,
                      "expected_flips_per_step": per_step, "shape_share": share,
                      "expected_shape_flips_per_step": shape,
                      "consequence": "unknown" if share is None else ("CheckpointError" if share > 0.5 else "silent")})
    p_error = 1.0 - math.exp(-shape_total * scale.steps)
    where = []
    if scale.tokens or audited_tokens:
        where.append(f"{scale.tokens or audited_tokens:g} tokens")
    if scale.layers:
        where.append(f"{scale.layers} layers")
    if scale.experts:
        where.append(f"{scale.experts} experts")
    at = " x ".join(where) or "the audited scale"
    steps = f" over {scale.steps} steps" if scale.steps > 1 else ""
    headline = (f"at {at}: expect about {total:.2g} decision flips per step, {shape_total:.2g} of them "
                f"shape-changing: CheckpointError{steps} {likelihood(p_error)}"
                + (f" if the scores drift by {noise} in the recompute (--noise)" if noise else ""))
    return {"scale": {"tokens": scale.tokens, "layers": scale.layers, "experts": scale.experts, "steps": scale.steps},
            "audited_tokens": audited_tokens, "kinds": kinds, "expected_flips_per_step": total,
            "expected_shape_flips_per_step": shape_total, "p_checkpoint_error": p_error,
            "check_failed": p_error >= 0.5, "headline": headline}
