"""Per-rank verdicts and disagreements between ranks that should have computed the same thing.

    rank_summaries(report)  -> [RankSummary(rank=0, verdict="clean", ...), RankSummary(rank=1, verdict="diverged", ...)]
    cross_rank_findings(runs, report)
    -> ["region 3 (layers.1): ranks 0 and 1 read identical inputs but aten.topk.default in layers.1.moe.router
         gave different values on rank 1 (replicated computation disagrees)"]
"""

from __future__ import annotations

from ..model import Region, Run
from ..report import DIVERGED, Report, RankSummary
from .compare import Tolerance


def rank_summaries(report: Report) -> list[RankSummary]:
    ranks = sorted({r.rank for r in report.regions} | {e.rank for e in report.torch_errors if e.rank is not None})
    out = []
    for rank in ranks:
        regions = [r for r in report.regions if r.rank == rank]
        diverged = [r for r in regions if r.status == DIVERGED]
        errors = [e for e in report.torch_errors if e.rank == rank]
        first = diverged[0] if diverged else None
        out.append(RankSummary(
            rank=rank, verdict=DIVERGED if diverged or errors else "clean", regions=len(regions),
            diverged=len(diverged), cause=first.cause.kind if first and first.cause else (errors[0].kind if errors else None),
            first_module=first.module if first else None, first_region=first.region if first else None,
        ))
    return out


def cross_rank_findings(runs: list[Run], report: Report, tolerance: Tolerance = Tolerance()) -> list[str]:
    """Compare the forward of the same region across ranks where the region's inputs are identical."""
    by_rank: dict[int, dict[int, Region]] = {}
    for run in runs:
        for region in run.regions:
            if region.forward is not None and region.forward.ops:
                by_rank.setdefault(region.rank, {})[region.region] = region
    ranks = sorted(by_rank)
    if len(ranks) < 2:
        return []
    findings = []
    base_rank = ranks[0]
    for number, base in sorted(by_rank[base_rank].items()):
        for other_rank in ranks[1:]:
            other = by_rank[other_rank].get(number)
            if other is None or not _same_inputs(base, other, tolerance):
                continue
            for a, b in zip(base.forward.ops, other.forward.ops):
                if a.key != b.key or [m.shape for m in a.out] != [m.shape for m in b.out]:
                    findings.append(f"region {number} ({base.module}): ranks {base_rank} and {other_rank} read "
                                    f"identical inputs but ran different ops from {a.op} in {a.module}")
                    break
                if a.fingerprint and b.fingerprint and not tolerance.equal(a.fingerprint, b.fingerprint):
                    findings.append(f"region {number} ({base.module}): ranks {base_rank} and {other_rank} read "
                                    f"identical inputs but {a.op} in {a.module} ({a.source}) gave different values "
                                    "(replicated computation disagrees across ranks)")
                    break
    return findings


def _same_inputs(a: Region, b: Region, tolerance: Tolerance) -> bool:
    ea = {(e.kind, e.name): e for e in a.forward.externals}
    eb = {(e.kind, e.name): e for e in b.forward.externals}
    if not ea or ea.keys() != eb.keys():
        return False
    return all(x.meta.shape == eb[k].meta.shape and x.fingerprint is not None and
               tolerance.equal(x.fingerprint, eb[k].fingerprint) for k, x in ea.items())
