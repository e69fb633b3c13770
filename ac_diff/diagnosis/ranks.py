"""Per-rank verdicts, and what the ranks say together: who diverged, who first, who disagrees.

    rank_summaries(report, runs)
    -> [RankSummary(rank=0, verdict="clean", ...),
        RankSummary(rank=1, verdict="diverged", cause="state_mutation", first_module="layers.1", ...)]
    cross_rank_findings(runs, report).texts
    -> ["diverged: rank 1 (1 of 2 ranks); clean: rank 0",
        "first divergence: rank 1, region 1 (layers.1): state_mutation of `layers.1.moe.expert_bias`",
        "rank-local: region 1 (layers.1) diverged on rank 1 only; it reproduced exactly on rank 0 ...",
        "region 3 (layers.1): ranks 0 and 1 read identical inputs but aten.topk.default in layers.1.moe.router
         (moe.py:40) gave different values: 1 of 256 rows chose other entries ... (replicated computation
         disagrees across ranks)"]

Region numbers count checkpointed regions in forward order on each rank; ranks that run the same
program number the same layer-step alike, so "region 3 on rank 0" and "region 3 on rank 1" are the
same call. "First" therefore means earliest in forward order (lowest region number), then lowest rank.

Replicated computation: the forwards of the same region on two ranks are aligned op by op (the same
alignment and comparison as forward vs recompute, `compare_passes`). An op whose inputs are identical
on both ranks - the same values of the region's inputs, parameters and buffers, flowing through ops
that agreed - must give identical outputs; if it does not, ranks that should agree disagree (a router
replicated under tensor parallelism choosing other experts on one rank, a nondeterministic kernel).
Ops whose inputs differ (data-parallel batches, tensor-parallel shards) are expected to differ and
are never reported. "Identical" is conservative: a difference never heals downstream because a
(sum, abs-sum) fingerprint happened to match, except through a collective whose result every rank of
the group shares (all-reduce, all-gather, broadcast); a rank-specific collective (reduce-scatter,
all-to-all) makes everything after it differ; different non-tensor arguments (rank-dependent split
sizes) are by design; value-only differences below 1e-5 relative are rounding noise; random ops must
agree only where the ranks read the same region inputs (tensor parallel, not data parallel).

Replicated state: a parameter or buffer the region reads that was identical on two ranks in one
region and differs in a later one has drifted apart (sharded tensors differ from the start and are
never reported).
"""

from __future__ import annotations

import os

import re
from dataclasses import dataclass
from typing import Iterable

from ..oprules import COLLECTIVE_RESULT_OPS, COMPILED_GRAPH_OP, UNINITIALISED_OPS, is_collective, packet, state_read
from ..passes import Pass, Region, Run, TensorMeta, error_words
from ..report import (CLEAN, DIVERGED, NEVER_CLEAN, UNCHECKED, CrossRankFinding, RankSummary, Report, RegionReport,
                      reproduced)
from .passdiff import ARGUMENT_KINDS, Tolerance, compare_externals, compare_passes, is_discrete
from .labels import where
from .watched import never_recomputed

MAX_REPLICATED_FINDINGS = 6
# Bound on the ops the cross-rank comparison looks at (it is a Python loop per op): beyond it the
# remaining regions are skipped and a note says so.
OPS_BUDGET = 500_000


def rank_summaries(report: Report, runs: Iterable[Run] = ()) -> list[RankSummary]:
    """One summary per rank of the report's regions and errors, completed with what only the runs know
    (exit status, exit code, trace; a rank whose trace has no region)."""
    by_rank = {rank: _summary(report, rank) for rank in
               {r.rank for r in report.regions} | {e.rank for e in report.torch_errors if e.rank is not None}}
    for run in runs:
        if run.source == "log":  # every rank the log has lines of, with what its traceback ended with
            raised = run.header.get("raised") or {}
            for rank in run.header.get("ranks") or ():
                summary = by_rank.get(rank) or by_rank.setdefault(rank, _summary(report, rank))
                summary.raised = summary.raised or raised.get(str(rank))
                if summary.raised:
                    summary.exit_status = "exception"
            continue
        if run.source != "trace":
            continue
        rank = run.rank or 0
        summary = by_rank.get(rank) or by_rank.setdefault(rank, _summary(report, rank))
        summary.exit_status = run.exit_status
        summary.exit_code = run.exit_code
        summary.truncated, summary.running = run.truncated, bool(run.running)
        summary.trace = run.path
        totals = run.watch["modules"].values() if run.watch else ()
        watched = sum(t[0] - t[1] for t in totals)
        if watched:  # watched regions that reproduced their saved tensors (they have no region report)
            summary.regions += watched
            summary.clean += watched
            if summary.verdict in (UNCHECKED, "no_regions"):
                summary.verdict = CLEAN
        unwritten = sum(t[3] for t in totals)  # diverged after their module's full recording showed it: counted
        never = never_recomputed(run)
        summary.regions += unwritten + never
        summary.diverged += unwritten
        summary.unchecked += never
        stopped = run.exit_status in ("exception", "interrupted") and summary.unchecked
        if summary.verdict == CLEAN and (run.truncated or stopped):  # killed, or stopped before checking it all
            summary.verdict = UNCHECKED
    return [by_rank[r] for r in sorted(by_rank)]


_COUNTED = {CLEAN: "clean", DIVERGED: "diverged", UNCHECKED: "unchecked"}
_FROM_STATUSES = frozenset({"ranks", "first", "same_cause", "torch_errors", "rank_local"})  # (_overview, _rank_local)


def restate_ranks(report: Report, before: dict[int, str]) -> None:
    """The ranks' summaries and what the ranks say together, after regions changed status (`before`: id of each
    region -> its status then; the comparison with the run without AC settles some): counts moved, verdicts and first
    divergences found again. The findings of the traces themselves (which ranks, exits, replicas) stay."""
    by_rank = {s.rank: s for s in getattr(report, "ranks", None) or ()}
    moved = {r.rank for r in report.regions if before.get(id(r), r.status) != r.status and r.rank in by_rank}
    if not moved:
        return
    for r in report.regions:
        old = before.get(id(r), r.status)
        if r.rank in moved and old != r.status:
            s = by_rank[r.rank]
            for status, step in ((old, -1), (r.status, 1)):
                if status in _COUNTED:
                    setattr(s, _COUNTED[status], getattr(s, _COUNTED[status]) + step)
    for rank in moved:
        s, fresh = by_rank[rank], _summary(report, rank)
        for name in ("cause", "first_module", "first_region", "silent", "cause_tensor", "first_op", "first_op_module",
                     "first_source"):
            setattr(s, name, getattr(fresh, name))
        if s.diverged or s.torch_error:
            s.verdict = DIVERGED
        elif s.verdict in (DIVERGED, UNCHECKED) and s.clean and fresh.verdict == CLEAN and not s.truncated:
            s.verdict = CLEAN
        elif s.verdict == DIVERGED:
            s.verdict = UNCHECKED
    if len(report.ranks) >= 2:
        kept = [f for f in report.cross_rank_findings if f.kind not in _FROM_STATUSES]
        report.cross_rank_findings = _overview(report) + _rank_local(report) + kept
        report.cross_rank = [f.text for f in report.cross_rank_findings]


def _summary(report: Report, rank: int) -> RankSummary:
    regions = [r for r in report.regions if r.rank == rank]
    diverged = sorted((r for r in regions if r.status == DIVERGED), key=lambda r: r.region)
    errors = [e for e in report.torch_errors if e.rank == rank]
    first = diverged[0] if diverged else None
    n_clean = sum(1 for r in regions if r.status == CLEAN)
    n_unchecked = sum(1 for r in regions if r.status == UNCHECKED)
    if diverged or errors:
        verdict = DIVERGED
    elif n_clean and not any(r.unchecked_reason in NEVER_CLEAN for r in regions):
        verdict = CLEAN
    elif regions:
        verdict = UNCHECKED
    else:
        verdict = "no_regions"
    summary = RankSummary(
        rank=rank, verdict=verdict, regions=len(regions), diverged=len(diverged),
        cause=first.cause.kind if first and first.cause else (errors[0].kind if errors else None),
        first_module=first.module if first else None, first_region=first.region if first else None,
        clean=n_clean, unchecked=n_unchecked, silent=bool(first and first.silent),
        cause_tensor=first.cause.tensor if first and first.cause else None,
    )
    lead = first.first_divergence() if first else None
    if lead is not None:
        summary.first_op, summary.first_op_module, summary.first_source = lead.op, lead.module, lead.source
    if errors:
        e = errors[0]
        summary.torch_error = e.kind + (f" at positions {_compact(e.positions)}" if e.positions else "")
    return summary


@dataclass(frozen=True)
class CrossRank:
    """What the ranks say together: the findings (structured; `texts` one line each) and notes for the report."""

    findings: list[CrossRankFinding]
    notes: list[str]

    @property
    def texts(self) -> list[str]:
        return [f.text for f in self.findings]


def cross_rank_findings(runs: list[Run], report: Report, tolerance: Tolerance = Tolerance()) -> CrossRank:
    """What the ranks say together, from the runs and a report whose `ranks` are complete (`rank_summaries`
    with the runs). Changes neither."""
    findings: list[CrossRankFinding] = []
    notes: list[str] = []
    findings += _provenance(runs)
    mixed = any(f.kind == "mixed_runs" for f in findings)  # (what the ranks of different runs say together: nothing)
    if len(report.ranks) >= 2:
        findings += _overview(report)
        if not mixed:
            findings += _rank_local(report)
        findings += _exits(report, runs)
        replicated, skipped = _replicated(runs, tolerance) if not mixed else ([], 0)
        findings += replicated
        if skipped:
            notes.append(f"cross-rank comparison stopped after {OPS_BUDGET:,} ops; {skipped} region(s) "
                         "on other ranks were not compared (compare two ranks with `ac-diff compare A B`)")
    return CrossRank(findings, notes)



# -- which traces -------------------------------------------------------------------------------
def _provenance(runs: list[Run]) -> list[CrossRankFinding]:
    """Traces of different launches mixed together; ranks of the world size that have no trace."""
    traces = [r for r in runs if r.source == "trace"]
    if not traces:
        return []
    out: list[CrossRankFinding] = []
    ids: dict[str, list[int]] = {}
    for run in traces:
        rid = run.run_id
        if rid:
            ids.setdefault(str(rid), []).append(run.rank or 0)
        elif any(r.run_id for r in traces) or any(r.world_size != run.world_size for r in traces):
            # a process launched alone has no run id: beside other runs' traces it is a run of its own
            ids.setdefault(f"{run.path or '?'} (one process)", []).append(run.rank or 0)
    if len(ids) > 1:
        parts = "; ".join(f"rank{'s' if len(v) > 1 else ''} {_list(sorted(v))} from run {k}" for k, v in ids.items())
        out.append(CrossRankFinding(
            "mixed_runs", f"these traces come from {len(ids)} different runs ({parts}): ranks of different runs are "
            "not comparable; pass the traces of one run (`ac-diff run --force` replaces a directory's traces)",
            sorted(r for v in ids.values() for r in v), detail={"run_ids": ids}))
    seen: dict[int, int] = {}
    for run in traces:
        rank = run.rank or 0
        seen[rank] = seen.get(rank, 0) + 1
    twice = sorted(r for r, n in seen.items() if n > 1)
    if twice:
        out.append(CrossRankFinding("mixed_runs", f"rank{'s' if len(twice) > 1 else ''} {_list(twice)} appear in more "
                                    "than one trace: traces of different runs are mixed", twice))
    world = max((r.world_size for r in traces), default=1)
    missing = [r for r in range(world) if r not in seen]
    # (one rank's file alone too: its gradients were reduced with those of the ranks not here)
    if world > 1 and missing and len(ids) <= 1:
        out.append(CrossRankFinding(
            "missing_ranks", f"{len(seen)} of {world} ranks have a trace here; no trace from rank"
            f"{'s' if len(missing) > 1 else ''} {_list(missing)} (another node's directory, or the process never "
            "started the recorder)", missing, detail={"world_size": world}))
    return out


# -- who diverged, who first ------------------------------------------------------------------------
def _overview(report: Report) -> list[CrossRankFinding]:
    groups: dict[str, list[int]] = {}
    for s in report.ranks:
        groups.setdefault(s.verdict if not (s.verdict == "no_regions" and s.raised) else "raised", []).append(s.rank)
    total = len(report.ranks)
    diverged = groups.get(DIVERGED, [])
    parts = []
    if diverged:
        parts.append(f"diverged: rank{'s' if len(diverged) > 1 else ''} {_list(diverged)} ({len(diverged)} of {total} ranks)")
    for verdict, label in ((CLEAN, "clean"), (UNCHECKED, "not all checked"), ("no_regions", "no regions")):
        if groups.get(verdict):
            parts.append(f"{label}: rank{'s' if len(groups[verdict]) > 1 else ''} {_list(groups[verdict])}")
    raised = [s for s in report.ranks if s.rank in groups.get("raised", ())]
    if raised:  # (a log's ranks with no checkpoint error: what stopped them, a peer's failure as often as not)
        parts.append("no checkpoint error, raised: " + "; ".join(
            f"rank {s.rank}: {s.raised[:120]}" for s in raised[:4]) + ("; ..." if len(raised) > 4 else ""))
    out = [CrossRankFinding("ranks", "; ".join(parts), diverged, detail={k: v for k, v in groups.items()})]
    lead = _first_diverged_region(report)
    if lead is not None:
        cause = ""
        if lead.cause is not None:
            cause = f": {lead.cause.kind}" + (f" of `{lead.cause.tensor}`" if lead.cause.tensor and
                                               lead.cause.kind in ("state_mutation", "global_state") else
                                               f" at {lead.cause.tensor}" if lead.cause.tensor else "")
        d = lead.first_divergence()
        at = f"; first divergent op {d.op} in {where(d.module, d.source)}" if d else ""
        # (a log's region is the dump's number on its rank: neither the same region on another rank nor an order)
        logged = lead.kind == "log"
        also = [] if logged else sorted(
            {r.rank for r in report.regions if r.status == DIVERGED and r.region == lead.region} - {lead.rank})
        with_others = f" (region {lead.region} diverged on rank{'s' if len(also) > 1 else ''} {_list(also)} too)" if also else ""
        first = ("first divergence (a log has no forward order across ranks: the lowest rank's first dump): "
                 if logged else "first divergence (earliest region in forward order): ")
        out.append(CrossRankFinding(
            "first", f"{first}rank {lead.rank}, region {lead.region} "
            f"({lead.module or '?'}){cause}{at}{with_others}", [lead.rank, *also], region=lead.region,
            module=lead.module, op=d.op if d else None, op_module=d.module if d else None,
            source=d.source if d else None,
            detail={"cause": lead.cause.kind if lead.cause else None,
                    "tensor": lead.cause.tensor if lead.cause else None, "silent": lead.silent}))
    causes = {(s.cause, s.cause_tensor) for s in report.ranks if s.verdict == DIVERGED}
    # (a rank whose cause is only the kind of error torch raised, a log without op lists: nothing diagnosed to share)
    named = all(any(r.rank == s.rank and r.status == DIVERGED and r.cause is not None for r in report.regions)
                for s in report.ranks if s.verdict == DIVERGED)
    if len(diverged) > 1 and len(causes) == 1 and named:
        kind, tensor = next(iter(causes))
        if kind:
            out.append(CrossRankFinding("same_cause", f"every diverged rank has the same cause: {kind}"
                                        + (f" of `{tensor}`" if tensor else ""), diverged, detail={"cause": kind}))
    elif len(causes) > 1:
        text = "; ".join(f"rank {s.rank}: {s.cause or '?'}" + (f" ({s.cause_tensor})" if s.cause_tensor else "")
                         for s in report.ranks if s.verdict == DIVERGED)
        out.append(CrossRankFinding("same_cause", f"the diverged ranks have different causes: {text}", diverged))
    raised = sorted({e.rank for e in report.torch_errors if e.rank is not None})
    if raised and len(raised) < len(report.ranks):
        kinds = sorted({e.kind for e in report.torch_errors})
        out.append(CrossRankFinding("torch_errors", f"torch raised {', '.join(map(error_words, kinds))} on rank"
                                    f"{'s' if len(raised) > 1 else ''} {_list(raised)} only", raised))
    return out


def _first_diverged_region(report: Report) -> RegionReport | None:
    diverged = [r for r in report.regions if r.status == DIVERGED]
    return min(diverged, key=lambda r: (r.rank, r.region) if r.kind == "log" else (r.region, r.rank)) \
        if diverged else None


def _rank_local(report: Report) -> list[CrossRankFinding]:
    """Regions that diverged on some ranks and reproduced exactly on others: something rank-specific."""
    by_region: dict[int, list[RegionReport]] = {}
    for r in report.regions:
        by_region.setdefault(r.region, []).append(r)
    out = []
    for number in sorted(by_region):
        group = by_region[number]
        modules = {r.module for r in group}
        bad = sorted(r.rank for r in group if r.status == DIVERGED)
        good = sorted(r.rank for r in group if reproduced(r))
        if not bad or not good or len(modules) != 1:
            continue
        lead = next(r for r in group if r.status == DIVERGED)
        why = ""
        if lead.cause is not None and lead.cause.tensor:
            why = f" ({lead.cause.kind} of `{lead.cause.tensor}`)" if lead.cause.kind == "state_mutation" else \
                f" ({lead.cause.kind}: {lead.cause.tensor})"
        these = "those ranks" if len(bad) > 1 else f"rank {bad[0]}"
        out.append(CrossRankFinding(
            "rank_local", f"rank-local: region {number} ({lead.module or '?'}) diverged on rank"
            f"{'s' if len(bad) > 1 else ''} {_list(bad)} only{why} and reproduced exactly on rank"
            f"{'s' if len(good) > 1 else ''} {_list(good)}: " + _where_to_look(report, lead, good, these),
            bad, region=number, module=lead.module, detail={"clean_ranks": good}))
        if len(out) >= 3:
            break  # later regions repeat the pattern; the region table has them all
    return out


def _where_to_look(report: Report, lead: RegionReport, good: list[int], these: str) -> str:
    """Where a divergence seen on some ranks only comes from: code or state of those ranks alone, unless the same
    state changes between the passes on the clean ranks too (a region of theirs names it): then the same code ran
    everywhere, and each rank's data decided whether it mattered (the margins of a decision that flipped)."""
    culprit = lead.cause.tensor if lead.cause is not None else None
    same = culprit is not None and any(r.rank in good and _changes(r, culprit) for r in report.regions)
    if not same:
        return f"look for state, hooks or branches that run on {these} alone"
    text = (f"the same code runs on every rank: `{culprit}` changes between the passes on rank {_list(good)} too, "
            "where it changed nothing the backward reads")
    decision = lead.first_discrete_divergence
    if decision is not None:
        text += (f"; the data of {these} put {decision.op} within reach of it (a decision that flipped), that of rank "
                 f"{_list(good)} did not")
    return text + "; the fix above applies to every rank"


def _changes(region: RegionReport, name: str) -> bool:
    """Whether `name` (a buffer, an attribute) differs between the region's passes, diverged or not."""
    return (region.cause is not None and region.cause.tensor == name) or \
        any(c.get("name") == name for c in region.changed_inputs)


def _exits(report: Report, runs: list[Run]) -> list[CrossRankFinding]:
    """How each rank's script ended; a failure that followed another rank's (a collective whose peer died)
    is told apart from the first one by the time the traces were finished."""
    ends: dict[int, tuple] = {}
    alive: dict[int, bool] = {}
    for run in runs:
        if run.source != "trace":
            continue
        rank = run.rank or 0
        ends[rank] = (run.exit_status, run.exit_code, run.truncated, run.end_time,
                      run.exc_type, (run.exc_message or "").strip().splitlines()[:1])
        alive[rank] = bool(run.running)
    if len(ends) < 2:
        return []
    failed = [r for r, e in ends.items() if e[0] not in (None, "ok") and e[1] != 143 and not e[2]]
    stopped = sorted(r for r, e in ends.items() if e[1] == 143 or e[2])
    ok = sorted(r for r, e in ends.items() if e[0] == "ok" and not e[2])
    if not failed and not stopped:
        return []
    failed.sort(key=lambda r: (ends[r][3] is None, ends[r][3] or 0.0, r))
    killed = killed_first(runs)
    parts = []
    if killed is not None:
        stopped = [s for s in stopped if s != killed]
        parts.append(f"rank {killed} stopped first: its trace ends without an end record, before any other rank "
                     "failed (the process was killed: SIGKILL, the out-of-memory killer?)")
        failed = [killed, *failed]

    def why(r: int) -> str:
        exc_type, message = ends[r][4], ends[r][5]
        if not exc_type:
            return f"exit {ends[r][1]}" if ends[r][1] not in (None, 0) else ""
        first_line = re.sub(r"^(\[[^\]]*\]\s*)+", "", message[0]) if message else ""  # gloo's [file:line] prefix
        text = f"{exc_type}: {first_line}" if first_line else exc_type
        return text if len(text) <= 100 else text[:97] + "..."

    running = [r for r in stopped if ends[r][2] and alive.get(r)]  # not killed: still running (a slow rank)
    if running:
        stopped = [s for s in stopped if s not in running]
        parts.append(f"rank{'s' if len(running) > 1 else ''} {_list(running)}: the trace has no end record yet, and "
                     f"{'their processes are' if len(running) > 1 else 'its process is'} still running on this host "
                     + (f"(most likely blocked in a collective, waiting for rank {_list(failed)}, which failed: "
                        "torchrun stops it next)" if failed else "(slower than AC_DIFF_RANK_WAIT, or the run goes on)")
                     + "; what "
                     f"{'they' if len(running) > 1 else 'it'} recorded until then is compared")
    # no rank failed: torchrun stopped nobody, so a trace without its end record is a process killed outright
    outright = [r for r in stopped if ends[r][2]] if not failed and killed is None else []
    if outright:
        stopped = [s for s in stopped if s not in outright]
        parts.append(f"rank{'s' if len(outright) > 1 else ''} {_list(outright)}: the trace ends without an end record "
                     "and no rank failed (the process was killed: SIGKILL, the out-of-memory killer?); what "
                     f"{'they' if len(outright) > 1 else 'it'} recorded until then is compared")
        failed = outright
    if failed and killed is not None:
        parts.append("then on " + ", ".join(f"rank {r}" + (f" ({why(r)})" if why(r) else "") for r in failed[1:]))
    elif failed and not outright:
        first = failed[0]
        parts.append(f"the script failed first on rank {first}" + (f" ({why(first)})" if why(first) else ""))
        if len(failed) > 1:
            parts.append("then on " + ", ".join(f"rank {r}" + (f" ({why(r)})" if why(r) else "") for r in failed[1:]))
    if stopped:
        parts.append(f"rank{'s' if len(stopped) > 1 else ''} {_list(stopped)} {'were' if len(stopped) > 1 else 'was'} "
                     "stopped before finishing " + ("(torchrun ends every rank when one fails)" if failed else
                                                    "(by SIGTERM: sent to the launcher, or by a job scheduler; no "
                                                    "rank failed)")
                     + "; what they recorded until then is compared")
    if ok:
        parts.append(f"rank{'s' if len(ok) > 1 else ''} {_list(ok)} finished normally")
    return [CrossRankFinding("exits", "; ".join(parts), failed + stopped,
                             detail={"failed_in_order": failed, "stopped": stopped, "ok": ok})]


def killed_first(runs: list[Run]) -> int | None:
    """The rank that was killed outright before any other rank failed, or None. A killed process (SIGKILL, the
    out-of-memory killer) writes no end record, where torchrun's own stop (SIGTERM) lets the recorder finish; its
    trace was last written (the file's time) before the first failure another rank recorded."""
    traces = [run for run in runs if run.source == "trace"]
    failures = [t for run in traces if (t := failed_at(run)) is not None]
    if len(traces) < 2 or not failures:
        return None
    killed = sorted((written, run.rank or 0) for run in traces if run.truncated and not run.running
                    for written in [_last_write(run)] if written is not None and written < min(failures))
    return killed[0][1] if killed else None


def failed_at(run: Run) -> float | None:
    """When a rank's script failed: its trace's end, where it ended on an error (not torchrun's SIGTERM stop)."""
    failed = (run.source == "trace" and not run.truncated and run.exit_status not in (None, "ok")
              and run.exit_code != 143)
    return run.end_time if failed else None


def _last_write(run: Run) -> float | None:
    try:
        return os.path.getmtime(run.path) if run.path else None
    except OSError:
        return None


# -- replicated computation ---------------------------------------------------------------------
def _replicated(runs: list[Run], tolerance: Tolerance) -> tuple[list[CrossRankFinding], int]:
    """Ops that read identical inputs on two ranks but gave different outputs (first per region and rank),
    and replicated parameters / buffers that were identical on two ranks and later were not."""
    by_rank: dict[int, dict[int, Region]] = {}
    for run in runs:
        if run.source != "trace":
            continue  # a log has no values: nothing to say about agreement
        for region in run.regions:
            if region.forward is not None and (region.forward.ops or not region.ops_written):
                by_rank.setdefault(region.rank, {})[region.region] = region
    ranks = sorted(by_rank)
    if len(ranks) < 2:
        return [], 0
    # (kind, op, module, source) -> finding: the same op disagreeing on many ranks / steps is one line
    found: dict[tuple, CrossRankFinding] = {}
    makers: dict[tuple, object] = {}
    drift = _Drift()
    budget = OPS_BUDGET
    skipped = 0
    for number in sorted({n for regions in by_rank.values() for n in regions}):
        present = [r for r in ranks if number in by_rank[r]]
        if len(present) < 2:
            continue
        base_rank = present[0]
        base = by_rank[base_rank][number]
        for other_rank in present[1:]:
            other = by_rank[other_rank][number]
            if other.module != base.module:
                continue
            if not base.forward.ops or not other.forward.ops:  # a summary: its inputs' fingerprints only
                drift.observe(base, other, compare_externals(base.forward, other.forward, tolerance)[0])
                continue
            cost = len(base.forward.ops) + len(other.forward.ops)
            if cost > budget:
                skipped += 1
                continue
            budget -= cost
            cmp = compare_passes(base.forward, other.forward, tolerance)
            drift.observe(base, other, cmp.changed_externals)
            if sum(1 for f in found.values() if f.kind != "replicated_state") >= MAX_REPLICATED_FINDINGS:
                continue
            hit = _first_disagreement(base, other, cmp)
            if hit is None:
                continue
            key, make, op, what = hit
            if key in found:  # the same op of the same code disagreeing again (another rank, a later step)
                if other_rank not in found[key].ranks:
                    found[key].ranks.append(other_rank)
                regions_seen = found[key].detail.setdefault("regions", [found[key].region])
                if number not in regions_seen:
                    regions_seen.append(number)
            else:
                found[key] = CrossRankFinding(
                    key[0], "", [base_rank, other_rank], region=number, module=base.module, op=op.op,
                    op_module=op.module, source=op.source,
                    detail={"base_rank": base_rank, "differs": what, "forward_index": op.index})
                makers[key] = make
            found[key].text = makers[key](found[key].ranks, found[key].detail.get("regions"))
    return list(found.values()) + drift.findings(), skipped


# Collectives whose result is the same on every rank of the group (given the same group argument); any
# other collective (reduce-scatter, all-to-all, scatter, send/recv) hands each rank its own part.
_SYMMETRIC_COLLECTIVES = frozenset({
    "all_reduce", "all_reduce_", "allreduce_", "all_reduce_coalesced", "all_reduce_coalesced_", "allreduce_coalesced_",
    "all_gather_into_tensor", "all_gather_into_tensor_coalesced", "all_gather_into_tensor_out", "allgather_",
    "_allgather_base_", "allgather_coalesced_", "allgather_into_tensor_coalesced_", "broadcast", "broadcast_",
})
# A value-only difference smaller than this (relative, on the fingerprint) after inputs that look identical
# is treated as rounding noise from an upstream difference too small for the fingerprints to show.
_NOISE = 1e-5


def _first_disagreement(base: Region, other: Region, cmp):
    """The first op whose inputs are identical on both ranks as far as the recording can tell, and whose
    outputs are not. "Identical" is conservative: a difference never heals downstream (a fingerprint
    that happens to match proves nothing), except through a collective whose result every rank of the
    group shares by construction (all-reduce, all-gather, broadcast)."""
    changed = {(x.kind, x.name) for x, _ in cmp.changed_externals}
    other_ext = {(e.kind, e.name) for e in other.forward.externals}
    # The ranks feed this region the same data (tensor parallel, not data parallel): only then must their
    # random ops agree too (data-parallel ranks draw different dropout masks / noise on purpose).
    inputs = [e for e in base.forward.externals if e.kind == "input"]
    same_data = bool(inputs) and not any(("input", e.name) in changed for e in inputs)
    bad: dict[int, bool] = {}  # base op index -> its outputs may differ between the ranks
    for d in cmp.diffs:
        f, o = d.forward, d.recompute
        if f is None:
            continue
        if o is None or d.pair.how != "match":
            bad[f.index] = True
            continue
        differs = bool(d.kinds & {"value", "shape", "host"} or d.kinds & ARGUMENT_KINDS)
        # (a compiled graph's call records no inputs: what it read is unknown, not identical)
        inputs_bad = len(f.input_refs) != len(o.input_refs) or (f.op == COMPILED_GRAPH_OP and not f.input_refs)
        for ref, theirs in zip(f.input_refs, o.input_refs):
            if ref.kind != theirs.kind:
                inputs_bad = True
            elif ref.kind == "op":  # the same producer (aligned) on both ranks, and it agreed
                inputs_bad = (inputs_bad or cmp.rec_to_fwd.get(theirs.op_index) != ref.op_index
                              or bad.get(ref.op_index, True))
            elif (ref.kind, ref.name) in changed or (ref.kind, ref.name) not in other_ext or ref.name != theirs.name:
                inputs_bad = True
        short = packet(f.op)
        if is_collective(f.op):
            if short in COLLECTIVE_RESULT_OPS:
                bad[f.index] = differs or inputs_bad
            else:  # the same group and arguments: a symmetric collective's result is the same everywhere
                bad[f.index] = bool(d.kinds & ARGUMENT_KINDS) or short not in _SYMMETRIC_COLLECTIVES
            continue
        if short in UNINITIALISED_OPS:
            bad[f.index] = "shape" in d.kinds  # its values are garbage anyway: only the shape counts
            continue
        bad[f.index] = differs or inputs_bad
        if not differs or inputs_bad or d.kinds & ARGUMENT_KINDS or getattr(d, "side_effect", False):
            continue  # different arguments: the ranks asked for different things (by design)
        if "shape" not in d.kinds and not is_discrete(f) and not _significant(f, o):
            continue
        if f.random and not same_data:
            continue
        kind = "replicated_rng" if f.random else "replicated_disagreement"
        what = "shapes" if "shape" in d.kinds else "values"
        flip = None
        if is_discrete(f) and what == "values":
            from .discrete import describe_flip

            flip = describe_flip(f, o).summary
        key = (kind, f.op, f.module, f.source)

        def make(ranks: list[int], regions: list[int] | None = None, f=f, kind=kind, what=what, flip=flip) -> str:
            return _disagreement_text(ranks, base, f, kind, what, flip, regions)

        return key, make, f, what
    return None


def _disagreement_text(ranks: list[int], base: Region, f, kind: str, what: str, flip: str | None,
                       regions: list[int] | None = None) -> str:
    base_rank, others = ranks[0], ranks[1:]
    who = f"rank{'s' if len(others) > 1 else ''} {_list(others)}"
    place = f"{f.op} in {f.module or '?'}" + (f" ({f.source})" if f.source else "")
    later = [r for r in (regions or []) if r != base.region]
    also = f" (again in region{'s' if len(later) > 1 else ''} {_list(later)})" if later else ""
    if kind == "replicated_rng":
        return (f"region {base.region} ({base.module or '?'}){also}: the random op {place} drew other numbers on "
                f"{who} than on rank {base_rank} from identical inputs (the ranks' RNG states differ; ranks that "
                "should compute the same thing need the same seed)")
    detail = f": {flip}" if flip else ""
    return (f"region {base.region} ({base.module or '?'}){also}: ranks {base_rank} and {_list(others)} read identical "
            f"inputs but {place} gave different {what} on {who}{detail} (replicated computation disagrees across "
            "ranks)")


def _significant(f, o) -> bool:
    """A value difference beyond rounding noise (integer and bool outputs: any difference)."""
    if f.host_value is not None or o.host_value is not None:
        return f.host_value != o.host_value
    for meta, a, b in zip(f.out, f.fingerprint or [], o.fingerprint or []):
        if a is None or b is None or type(meta) is not TensorMeta:
            continue
        if meta.dtype[:1] in ("i", "u", "b"):
            if a != b:
                return True
            continue
        for x, y in zip(a, b):
            try:
                x, y = float(x), float(y)
            except (TypeError, ValueError):
                continue
            if abs(x - y) > _NOISE * max(abs(x), abs(y)):
                return True
    return False


class _Drift:
    """Parameters / buffers that were identical on two ranks in one region and differ in a later one:
    state that should stay replicated has drifted apart (sharded tensors differ from the start: never
    reported)."""

    def __init__(self) -> None:
        self.agreed: dict[tuple, int] = {}  # (base rank, other rank, kind, name) -> region where equal
        self.hits: dict[tuple, CrossRankFinding] = {}  # (kind, name) -> finding

    def observe(self, base: Region, other: Region, changed_externals: list) -> None:
        read = _read_state(base.forward)
        status = {}
        for x, y in changed_externals:
            status[(x.kind, x.name)] = True
        theirs = {(e.kind, e.name): e for e in other.forward.externals}
        for e in base.forward.externals:
            key = (e.kind, e.name)
            if e.kind not in ("param", "buffer") or key not in read or key not in theirs:
                continue
            pair = (base.rank, other.rank, *key)
            if not status.get(key):
                if e.fingerprint is not None and theirs[key].fingerprint is not None:
                    self.agreed.setdefault(pair, base.region)
                continue
            if pair not in self.agreed:
                continue  # different from the start: sharded (or never replicated)
            hit = self.hits.get(key)
            if hit is None:
                what = "parameter" if e.kind == "param" else "buffer"
                self.hits[key] = CrossRankFinding(
                    "replicated_state", "", [base.rank, other.rank], region=base.region, module=base.module,
                    op=None, op_module=None, source=None,
                    detail={"tensor": e.name, "kind": e.kind, "agreed_in_region": self.agreed[pair],
                            "differs_in_region": base.region, "what": what})
            elif other.rank not in hit.ranks:
                hit.ranks.append(other.rank)

    def findings(self) -> list[CrossRankFinding]:
        """One line for all drifted tensors, led by the earliest."""
        hits = sorted(self.hits.values(), key=lambda f: (f.detail["differs_in_region"], f.detail["agreed_in_region"]))
        if not hits:
            return []
        first = hits[0]
        ranks = sorted({r for f in hits for r in f.ranks})
        names = [f"`{f.detail['tensor']}`" for f in hits]
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        others = [r for r in ranks if r != first.ranks[0]]
        text = (f"replicated state drifted apart: {shown} {'were' if len(names) > 1 else 'was'} identical on ranks "
                f"{_list(ranks)} in region {first.detail['agreed_in_region']} and differ"
                f"{'' if len(names) > 1 else 's'} on rank{'s' if len(others) > 1 else ''} {_list(others)} from region "
                f"{first.detail['differs_in_region']} ({first.module or '?'}) on: an update or gradient that differs "
                "by rank (expected only for per-rank statistics such as token counters or batch-norm running stats)")
        return [CrossRankFinding("replicated_state", text, ranks, region=first.detail["differs_in_region"],
                                 module=first.module,
                                 detail={"tensors": [f.detail["tensor"] for f in hits],
                                         "agreed_in_region": first.detail["agreed_in_region"],
                                         "differs_in_region": first.detail["differs_in_region"]})]


def _read_state(p: Pass) -> set[tuple]:
    """Parameters and buffers the pass reads as an input (not only updates in place: a counter). A summarized
    pass (write="diverged") kept only the externals it reads."""
    if not p.ops:
        return {(e.kind, e.name) for e in p.externals if e.kind in ("param", "buffer")}
    return {key for op in p.ops for key in state_read(op.op, [(ref.kind, ref.name) for ref in op.input_refs])}


def _list(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    ranks = sorted(set(ranks))
    if not ranks:
        return ""
    parts, start, prev = [], ranks[0], ranks[0]
    for r in ranks[1:] + [None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        parts.append(f"{start}" if start == prev else (f"{start}, {prev}" if prev == start + 1 else f"{start}-{prev}"))
        if r is not None:
            start = prev = r
    return ", ".join(parts)


def _compact(numbers: list[int], limit: int = 8) -> str:
    shown = ", ".join(map(str, numbers[:limit]))
    return shown + (f", ... ({len(numbers)} in all)" if len(numbers) > limit else "")
