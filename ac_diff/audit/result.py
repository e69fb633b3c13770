"""The finished audit as one JSON-ready dict (the `audit` section), built once for every renderer.

    doc = audit_document(auditor, scale, target="train.py", wall_seconds=12.3)
    doc["audit"]["sites"][0]   -> {"module": "layers.1.moe.router", "op": "aten.topk.default",
                                   "margins": {"within_1ulp": 0.0, ..., "histogram": [...]},
                                   "observed_rate": 0.018, "model_rate": 0.019, "consequence": "CheckpointError"}
    doc["audit"]["remedy"]     -> {"save_list": ["aten.topk.default"], "bytes_per_region": 6144, "verified": true, ...}
    doc["audit"]["extrapolation"]["headline"]
    doc["audit"]["recompute"]  -> {"checked": 8, "diverged_count": 6, "diverged": [{"region": 1, "module": "layers.0",
                                   "how": "values", "positions": [3], "detail": "other values at 1 of 12 ..."}, ...]}
    doc["audit"]["headline"]   -> the answer first: "the run already diverges: 6 of 8 recomputed regions ..." when
                                  the real recompute already differs from the forward, else the extrapolation's
"""

from __future__ import annotations

import os
import shlex

import torch

from ..diagnosis.suggest import sac_policy
from .extrapolate import Scale, extrapolate
from .margins import HIST_LABELS

FORMAT = "ac-diff-audit"
VERSION = 1


def _consequence(site) -> str:
    share = site.shape_share()
    if share is None:
        return "unknown" if site.kind is not None else "follows"
    return "CheckpointError" if share > 0.5 else "silent"


def site_json(s) -> dict:
    obs, model = s.observed_rate(), s.model_rate()
    return {
        "module": s.label[0], "op": s.label[1], "source": s.label[2], "kind": s.kind, "dtype": s.dtype,
        "candidates": s.candidates, "k": s.k, "noise_into": s.target, "calls": s.calls, "rows": s.rows,
        "margins": {**s.margin_summary(), "histogram_bins_ulps": list(HIST_LABELS)} if s.kind else None,
        "flips_per_seed": list(s.flips), "observed_rate": obs, "model_rate": model, "tail_rate": s.tail_rate(),
        "density_at_zero": s.density_at_zero(), "rate": s.rate() if s.kind else obs,
        "score_noise_rms": (sum(s.score_noise) / len(s.score_noise)) if s.score_noise else None,
        "shape_share": s.shape_share(), "probe": s.probe, "consequence": _consequence(s),
        "same_as": " ".join(p for p in s.same_as[:2] if p) if s.same_as else None,
    }


def region_json(r) -> dict:
    return {"region": r.index, "module": r.module, "tokens": r.tokens, "ops": r.ops, "decisions": r.decisions,
            "seconds": round(r.seconds, 4), "error": r.error, "flips_per_seed": r.flips,
            "checkpoint_error_per_seed": r.checkpoint_error, "save_list": r.save_list, "save_bytes": r.save_bytes,
            "flips_with_save_list": r.remedy_flips, "stress_flips_without_save_list": r.stress_flips}


def remedy_json(regions) -> dict:
    save = sorted({op for r in regions for op in r.save_list})
    checked = [r for r in regions if r.save_list]
    residual = sum(sum(r.remedy_flips) for r in checked)
    return {"save_list": save, "bytes_per_region": max((r.save_bytes for r in checked), default=0),
            "regions_checked": len(checked), "replays_with_save_list": sum(len(r.remedy_flips) for r in checked),
            "flips_with_save_list": residual,
            "stress_flips_without_save_list": sum(r.stress_flips or 0 for r in checked),
            # an op of the list whose output the forward writes in place: selective AC refuses to serve it
            "refused": {op: how for r in checked for op, how in r.refused.items()},
            "verified": bool(checked) and residual == 0 and not any(r.refused for r in checked),
            "policy": sac_policy(save, torch.__version__) if save else None}


def recompute_json(check, script: list[str]) -> dict:
    """Every region's real recompute against its forward (recompute.py), with the headline it calls for."""
    doc = check.result()
    n, checked = doc["diverged_count"], doc["checked"]
    first = doc["diverged"][0] if doc["diverged"] else None
    doc["headline"] = None if not n else (
        f"the run already diverges: {n} of {checked} recomputed region(s) saved other tensors than their forward "
        f"(first: {first['module']}, region {first['region']}: {first['detail']}); "
        + ("torch raises CheckpointError now" if first["how"] in ("shapes", "count") else
           "torch raises nothing and the gradients are wrong now, unless what differs reaches none of them (the same "
           "top-k choices in another order, summed: `--reference no-ac` tells)")
        + f", whatever the margins below predict; `{_run(script)}` names the cause")
    twice = doc["state_twice"][0] if doc["state_twice"] else None
    doc["state_note"] = None if twice is None else (
        f"{doc['state_twice_count']} recompute(s) updated state of their module (Python attributes, buffers) or a "
        f"host generator a second time (first: "
        f"{twice['module']}, region {twice['region']}: {', '.join(f'`{n}`' for n in twice['names'][:3])}), which the "
        "replays cannot see: where the code reads it (a schedule, a branch), later steps compute otherwise than "
        f"without AC; `{_run(script, '--reference no-ac --reference-steps 3')}` compares the gradients")
    return doc


def audit_document(auditor, scale: Scale, *, target: str, wall_seconds: float, exit_code: int = 0,
                   script: list[str] | None = None) -> dict:
    """`script`: the words that ran the script, as the commands it suggests run it (`-m pkg.train --lr 3`; default:
    `target` alone)."""
    sites = sorted(auditor.sites.values(), key=lambda s: (s.label[0], s.label[1]))
    settings = auditor.settings
    risk = extrapolate(sites, auditor.regions, scale, settings.noise.text)
    script = script or [target]
    recompute = recompute_json(auditor.recompute, script)
    fix_it = (f"fix what stopped it (its error is above; `{_run(script)}` explains a stop in the "
              "backward), then audit again")
    stopped = f"the script stopped (exit {exit_code})"
    if not auditor.regions:  # no prediction from nothing: say why nothing was audited
        risk["headline"] = "nothing audited: " + (
            f"{auditor.seen} checkpointed region(s) ran, and none could be replayed (the notes say why)"
            + (f"; {stopped}: {fix_it}" if exit_code else "") if auditor.seen else
            f"{stopped} before any checkpointed region ran; {fix_it}" if exit_code else
            "no checkpointed region ran (is activation checkpointing on?)")
    elif exit_code and not recompute["headline"]:  # a prediction for a run that did not finish is no all-clear
        risk["headline"] = (f"{stopped}: " + (
            "no region was recomputed, so none was checked against its forward" if not recompute["checked"] else
            f"only the {recompute['checked']} region(s) recomputed before that were checked")
            + f"; {fix_it}; the prediction covers what ran until then: " + risk["headline"])
    risk["unchecked"] = not auditor.regions or bool(exit_code and not recompute["checked"])
    headline = recompute["headline"] or risk["headline"]
    if recompute["state_note"] and not recompute["headline"]:  # (the margins' prediction is no all-clear then)
        headline += f"; but {recompute['state_note']}"
    return {"format": FORMAT, "version": VERSION, "audit": {
        "headline": headline,
        "target": target, "noise": settings.noise.text, "seeds": settings.seeds, "max_regions": settings.max_regions,
        "regions_seen": auditor.seen, "regions_audited": len(auditor.regions),
        "wall_seconds": round(wall_seconds, 3), "audit_seconds": round(auditor.audit_seconds, 3),
        "exit_status": exit_code,
        "sites": [site_json(s) for s in sites],
        "regions": [region_json(r) for r in auditor.regions],
        "remedy": remedy_json(auditor.regions),
        "extrapolation": risk,
        "recompute": recompute,
        "notes": auditor.all_notes(),
    }}


def _run(script: list[str], options: str = "") -> str:
    """The `ac-diff run` command for the audited script, launched as the audit was (its ranks on this node)."""
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    launch = f"--nproc-per-node {ranks} " if ranks > 1 else ""
    return f"ac-diff run {launch}{options + ' ' if options else ''}{shlex.join(script)}"
