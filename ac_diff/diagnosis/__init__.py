"""The diagnosis engine: from runs (traces or parsed logs) to one finished `Report`.

    report = diagnose([read_run("ac-diff-out/trace-rank0.jsonl")])
    report.verdict    -> "diverged"
    report.headline   -> "layers.1 (rank 0, region 3) diverged: state_mutation: the buffer ..."
    report.regions[3].first_discrete_divergence.summary -> "1 of 256 rows chose other entries ..."

Every source goes through the same steps: attach torch's errors to the regions they concern,
diagnose each region (region.py), then summarise per rank and across ranks (ranks.py).
"""

from __future__ import annotations

import os
from typing import Callable

import contextlib

from ..stateflags import flag_label
from ..trace.format import EXIT_DURING_BACKWARD
from ..gc_hold import collector_paused
from ..passes import NESTED_OUTPUT, InputRef, Pass, Region, Run, TorchError, error_words
from ..report import (NEVER_CLEAN, CLEAN, CUT_SHORT, DAMAGED, DIVERGED, ENCLOSING_RECOMPUTE, FORWARD_UNRECORDED,
                      NO_GRAD_INPUTS, RECEIVED, RECORDER_ERROR, SIDE_OUTPUT, STATE_READ_AGAIN, UNASKED, UNCHECKED,
                      UNREAD, VALUES_NOT_RECORDED, Cause, MetadataChange, Report, RegionReport, TorchErrorSummary,
                      backwards_recorded, missing_ranks, repeated_updates)
from .microbatches import later_forward
from .nested import pair_nested_reruns
from .cause import DTYPE_ONLY, RECOMPILED, dtype_only, emptied, one_optimizer_step, sharded_positions
from .compiled import compiled_summary, eager_prefix, unrecorded, unrecorded_headline
from .passdiff import Tolerance
from ..logs.errors import version_check
from .groups import group_regions
from .labels import module_label, positions_label
from .ranks import cross_rank_findings, failed_at, killed_first, rank_summaries
from .region import NO_GRAD_PASS, Settings, diagnose_region
from .watched import never_recomputed, watch_summary, watched_clean

__all__ = ["diagnose", "Settings", "Tolerance"]


def diagnose(runs: list[Run], settings: Settings = Settings()) -> Report:
    # a lazily read run (read_run(lazy=True)) has its ops decoded per region; with several runs the cross-rank
    # findings compare them after the loop, so they stay loaded until the report is done
    with contextlib.ExitStack() as kept:
        return _diagnose(runs, settings, kept if len(runs) > 1 else None)


def _counts_optimizer_steps(run: Run) -> bool:
    """The run stepped a torch.optim optimizer (its end record's count; a cut trace: a region's count)."""
    return bool(run.optimizer_steps) or run.optimizer_steps is None and any(r.optimizer_steps for r in run.regions)


def _ops_of(run: Run, region, kept: contextlib.ExitStack | None):
    if kept is not None:  # several runs: cross-rank findings read every region's ops at the end
        kept.enter_context(run.loaded(region))
        return contextlib.nullcontext()
    return run.loaded(region)


def _diagnose(runs: list[Run], settings: Settings, kept: contextlib.ExitStack | None) -> Report:
    region_reports = []
    errors: list[TorchError] = []
    error_logs: dict[int, str] = {}  # id(error) -> the log it is from, where several were read
    notes: list[str] = []
    graph_readers: dict[int, dict[str, list[Region]]] = {}  # (`_note_graph_readers`)
    endings: list[str | None] = []  # how each run ended
    summarized_side: list[RegionReport] = []  # reentrant regions summarized, whose forward handed out side outputs
    regions: dict[tuple, Region] = {}  # (path, rank, region) -> what it was diagnosed from
    versions: dict[str, str | None] = {}  # path -> the torch that wrote it
    loaders: dict[tuple, Callable] = {}  # (path, rank) -> its run's `loaded`: a region's ops decoded for a block
    log_errors = [e for run in runs if run.source == "log" for e in run.errors]  # head and tail of one log
    notes.extend(_merge_log_fragments(runs))
    for run in runs:
        if run.source == "log":
            for region in run.regions:
                for p in (region.forward, region.recompute):
                    if p is not None:
                        link_log_ids(p)
        run_errors = list(run.errors)
        errors.extend(run_errors)
        several = len({r.path for r in runs}) > 1
        if several and run.source == "log" and run.path:  # several logs: which one raised each error
            error_logs.update({id(e): os.path.basename(run.path) for e in run_errors})
        # several logs: which one each note is about (a trace's notes name their file themselves)
        notes.extend(f"{os.path.basename(run.path)}: {n}" if several and run.source == "log" and run.path
                     and run.path not in n else n for n in run.notes)
        endings.append(run.exit_status)
        stopped = _how_it_stopped(run) if run.exit_status in ("exception", "interrupted") else None
        check = version_check(run.exc_message) if stopped else None
        stepped = _counts_optimizer_steps(run)
        reruns = pair_nested_reruns(run.regions)
        for region in run.regions:
            err = _error_for(region, run_errors, log_errors if run.source == "log" else [], run)
            # one region's ops are decoded and compared with the collector paused: it would rescan every live object
            # (torch's included) many times per region while finding no cycles; it runs once after instead
            with collector_paused(), _ops_of(run, region, kept):
                report = diagnose_region(region, err, settings, run_stopped=stopped, torch_version=run.torch_version,
                                         version_check=check)
                _note_graph_readers(run, region, graph_readers)
            report.path = run.path or run.source
            if region.region in reruns:
                report.notes.append(f"compared with its rerun in the recompute of region {region.parent}, which ran it "
                                    f"again as region {reruns[region.region]} (this one saved nothing to recompute)")
            if region.kind == "reentrant" and region.forward is not None and not region.ops_written \
                    and region.forward.state.get("side_outputs") and report.status == CLEAN:
                summarized_side.append(report)
            if region.step is not None and stepped and region.optimizer_steps + 1 != region.step:
                report.optimizer_step = region.optimizer_steps + 1  # (several forward-backward cycles a step)
            region_reports.append(report)
            regions[report.path, report.rank, report.region] = region
            loaders[report.path, report.rank] = run.loaded
        versions[run.path or run.source] = run.torch_version
    _like_their_first(summarized_side, region_reports)
    later_forward(region_reports, regions, versions, loaders)
    # a rank that raised makes the run crashed, whatever rank 0 did (torchrun then stops the others: interrupted)
    exit_status = next((e for e in ("exception", "interrupted", "exit") if e in endings), next(
        (e for e in endings if e), None))
    _raised_in_their_backward(runs, region_reports)
    _through_collectives(region_reports)
    _through_nested_regions(region_reports)
    _through_enclosing_regions(region_reports)
    one_optimizer_step(region_reports)
    watch = watch_summary(runs, region_reports)
    errors_summary = [_summary(e, region_reports, error_logs.get(id(e))) for e in errors]
    diverged = [r for r in region_reports if r.status == DIVERGED]
    crash = _crash(runs, region_reports)
    cut = None if crash else _cut_short(runs, region_reports, watch)
    if cut is not None:
        crash, exit_status = cut, exit_status or CUT_SHORT
    lost = _recorder_losses(runs, region_reports)
    damaged = any(r.status == DAMAGED for r in region_reports) or any(run.damaged for run in runs)
    # reproduced, yet never clean; or compared without values (--no-fingerprints)
    # (or recomputed where its forward was not recorded: its gradients were computed, not compared)
    at_risk = any(r.unchecked_reason in NEVER_CLEAN for r in region_reports)
    verdict = (DIVERGED if diverged or errors else DAMAGED if damaged else
               UNCHECKED if crash or lost or at_risk or not (any(r.status == CLEAN for r in region_reports)
                                                             or watched_clean(watch))
               else CLEAN)
    raised = {(e.rank, e.region) for e in errors_summary}
    # a region recorded in full leads over a watched one (which shows no ops)
    groups = group_regions(region_reports, lambda r: ((r.rank, r.region) not in raised, r.watched, r.rank, r.region))
    headline = _headline(region_reports, errors_summary, runs, groups, watched_clean(watch),
                         watch["never_compared"] + watch["nested"] if watch else 0, watch["unwritten"] if watch else 0,
                         watch["outputs_only"] if watch else 0, backwards_recorded(region_reports, watch))
    if crash and not diverged and not errors:
        headline = crash
    freed = _graph_freed_by_reentrant(runs, graph_readers)
    if freed is not None:
        headline += f"; why: {freed[0]}"
        notes.insert(0, freed[1])
    failed = _failed_after(runs) if verdict == CLEAN else None
    if failed:
        headline += f"; but {failed}"
    elif verdict == DIVERGED and not any(r.backward_raised for r in region_reports):
        # (a diverged run the script then stopped in another way: an OOM, Ctrl-C, sys.exit(3); not torch's own error)
        after = _failed_after([run for run in runs if run.exc_type != "CheckpointError"])
        if after:
            notes.append(after)
    compiled = compiled_summary(runs)  # torch.compile around the regions (diagnosis/compiled.py)
    if unrecorded(compiled) and not region_reports and not errors:
        headline = unrecorded_headline(compiled)
    headline = eager_prefix(compiled) + headline if region_reports else headline
    if lost:
        if verdict == UNCHECKED:
            headline = lost + (f"; {crash}" if crash else "")
        else:
            notes.append(lost)
    if verdict == CLEAN and any(r.kind == "reentrant" and r.status == CLEAN for r in region_reports):
        notes.append(REENTRANT_BACKWARD)
    report = Report(verdict=verdict, headline=headline, regions=region_reports,
                    torch_error=errors_summary[0] if errors_summary else None, torch_errors=errors_summary,
                    sources=[r.path or r.source for r in runs], notes=notes, exit_status=exit_status,
                    exit_code=_exit_code(runs), groups=groups,
                    compiled=compiled, watch=watch, script_failed=failed)
    report.ranks = rank_summaries(report, runs)
    cross = cross_rank_findings(runs, report)
    report.cross_rank, report.cross_rank_findings = cross.texts, cross.findings
    report.notes += cross.notes
    # ranks of the run without a trace here, whose trace is a copy cut on its way to rank 0, or whose process was
    # killed before its trace was finished: never clean
    unfinished = [run for run in runs if run.source == "trace" and run.truncated and run.world_size > 1]
    killed = [run.rank or 0 for run in unfinished if not run.header.get("cut") and run.running is not True]
    missing_ranks(report, [r for f in cross.findings if f.kind == "missing_ranks" for r in f.ranks]
                  + [run.rank or 0 for run in runs if run.header.get("cut") or any(run is u for u in unfinished)]
                  + [r for run in runs for r in run.unreadable_ranks], killed=killed)
    return report


def _merge_log_fragments(runs: list[Run]) -> list[str]:
    """Logs of one rank given as several files (the head and the tail of one huge log) hold parts of the
    same debug dump: a region of a rank that another file has in full (both passes) is the same region,
    so its fragment (a start of the dump without the recompute) is dropped. Returns what was merged."""
    logs = [run for run in runs if run.source == "log"]
    whole = {(r.rank, r.region): run for run in logs for r in run.regions
             if r.forward is not None and r.recompute is not None}
    notes = []
    for run in logs:
        kept = []
        for r in run.regions:
            other = whole.get((r.rank, r.region))
            if other is not None and other is not run and r.recompute is None:
                notes.append(f"rank {r.rank} region {r.region}: {run.path} and {other.path} hold parts of the same "
                             "debug=True dump; read as one region")
                continue
            kept.append(r)
        run.regions = kept
    return notes


def _error_for(region, own: list[TorchError], pooled: list[TorchError], run: Run) -> TorchError | None:
    """The torch error about this region: from its own run first (every log numbers its regions from 0),
    then from the other logs (one log's head holds the error, another's tail the dump); never another rank's."""
    for errors in (own, pooled):
        for err in errors:
            if err.rank is not None and region.rank is not None and err.rank != region.rank:
                continue
            if err.region is not None:
                if err.region == region.region:
                    return err
            elif run.source == "log":
                return err
    return None


def link_log_ids(p: Pass) -> None:
    """Turn a log's `$N` ids into input references (producer op within the pass), once."""
    produced: dict[str, tuple[int, int]] = {}
    for op in p.ops:
        if op.log_ids is None:
            continue
        outs, ins = op.log_ids
        if not op.input_refs:
            refs = []
            for name in ins:
                hit = produced.get(name)
                refs.append(InputRef("op", hit[0], hit[1]) if hit else InputRef("external", name=name))
            op.input_refs = refs
        for j, name in enumerate(outs):
            produced[name] = (op.index, j)


def _summary(err: TorchError, reports: list[RegionReport], log: str | None = None) -> TorchErrorSummary:
    """The error as reports show it; its cause the diagnosis of the region it names where there is one, else what its
    metadata alone suggests (a log without op lists)."""
    changes = [MetadataChange(p.position, str(p.saved) if p.saved else None,
                              str(p.recomputed) if p.recomputed else None) for p in err.positions]
    region = next((r for r in reports if (r.rank, r.region) == (err.rank, err.region) and r.cause is not None
                   and r.cause.kind != "unknown"), None)
    return TorchErrorSummary(kind=err.kind, rank=err.rank, region=err.region,
                             positions=[p.position for p in err.positions if p.position is not None],
                             message=err.message[:4000], saved_count=err.saved_count,
                             recomputed_count=err.recomputed_count, changes=changes,
                             cause=f"{region.cause.kind}: {region.cause.detail}" if region is not None else
                             f"sharded_parameter: {emptied(changes)}" if sharded_positions(changes) else
                             f"compiled_graph: {RECOMPILED}" if err.compiled else
                             f"dtype_changed: {DTYPE_ONLY.format(change=dtypes)}" if (dtypes := dtype_only(changes))
                             else None,
                             count=err.count, first_line=err.first_line, last_line=err.last_line, log=log)


def _through_collectives(reports: list) -> None:
    """A region whose divergence came in through a collective (what an all_reduce received) takes the cause and fixes
    of the same region on a rank that explains its own divergence: that rank's difference reached this one."""
    own = {}
    for r in reports:
        if r.status == DIVERGED and r.cause is not None and r.cause.kind != "unknown":
            own.setdefault((r.region, r.module), r)  # (ranks number the same layer-step alike)
    for r in reports:
        origin = own.get((r.region, r.module))
        if (r.status != DIVERGED or r.cause is None or r.cause.mechanism != RECEIVED or origin is None
                or origin.rank == r.rank):
            continue
        _adopt(r, origin, f"through {r.cause.tensor}, from rank {origin.rank}, whose region {origin.region} "
               f"({origin.module}) diverged", [r.cause.detail])


def _through_nested_regions(reports: list) -> None:
    """A region whose difference is a nested region's output takes that region's cause and fixes: the
    outer recompute only passed on what the nested one computed differently."""
    own = {}
    for r in reports:
        if r.status == DIVERGED and r.cause is not None and not (r.cause.tensor or "").startswith(NESTED_OUTPUT):
            own.setdefault((r.rank, r.module), r)
    for r in reports:
        tensor = r.cause.tensor if r.cause is not None else None
        if not tensor or not tensor.startswith(NESTED_OUTPUT):
            continue
        module = tensor[len(NESTED_OUTPUT):].split(" #")[0]
        child = own.get((r.rank, module))
        if child is None:
            continue
        _adopt(r, child, f"through the nested region {module} (region {child.region})",
               [f"the output of {module} differs between this region's forward and recompute"])


def _adopt(r: RegionReport, origin: RegionReport, how: str, evidence: list[str]) -> None:
    """`r` takes the cause and fixes of `origin`, the region whose difference reached it (`how`: by what way)."""
    cause = origin.cause
    theirs = [f"rank {origin.rank}: {e}" for e in cause.evidence] if origin.rank != r.rank else list(cause.evidence)
    r.cause = Cause(cause.kind, cause.tensor, f"{how}: {cause.detail}", [*evidence, *theirs], cause.mechanism,
                    cause.source, list(cause.names))
    r.suggestions = list(origin.suggestions)


def _through_enclosing_regions(reports: list) -> None:
    """A nested region whose input came back changed from the enclosing region's recompute takes that region's cause
    and fixes: what the enclosing recompute computed differently reached it as its input."""
    by_key = {(r.rank, r.path, r.region): r for r in reports}
    for r in reports:
        parent = by_key.get((r.rank, r.path, r.enclosing)) if r.enclosing is not None else None
        if (r.cause is None or r.cause.mechanism != ENCLOSING_RECOMPUTE or parent is None or parent.cause is None
                or parent.status != DIVERGED or parent.cause.mechanism == ENCLOSING_RECOMPUTE):
            continue
        _adopt(r, parent, f"its {r.cause.tensor} came from the recompute of the enclosing region {parent.module} "
               f"(region {parent.region}), which computed it otherwise", r.cause.evidence)


def _earlier(lead: RegionReport, diverged: list[RegionReport]) -> str:
    """Where the run first diverged, when that was a step before the lead's (the region torch raised about leads;
    a silent divergence may have come before it): "; the first, silently, in step 20: layers.0 (region 38)"."""
    first = min((r for r in diverged if r.step is not None), key=lambda r: (r.step, r.rank, r.region), default=None)
    if first is None or lead.step is None or first.step >= lead.step:
        return ""
    where = module_label(first.module) if first.module else "a region"
    rank = f"rank {first.rank}, " if first.rank != lead.rank else ""
    how = ", silently," if first.silent else ""
    return f"; the first{how} in step {first.step}: {where} ({rank}region {first.region})"


def _how_it_stopped(run: Run) -> str:
    if run.exit_status == "exit" and run.exc_type in (None, "SystemExit"):
        return f"exit code {run.exit_code}"
    message = (run.exc_message or "").strip().splitlines()
    first = message[0] if message else ""
    if run.exc_type == EXIT_DURING_BACKWARD and first:
        return first
    return f"{run.exc_type or run.exit_status}" + (f": {first[:160]}" + ("..." if len(first) > 160 else "")
                                                       if first else "")


_GRAPH_FREED = "backward through the graph a second time"


def _note_graph_readers(run: Run, region: Region, readers: dict) -> None:
    """While its passes are decoded: the tensors with a graph of their own made outside a reentrant region that it
    read, by run and name (`_graph_freed_by_reentrant`)."""
    if region.kind == "reentrant" and region.forward is not None and _GRAPH_FREED in (run.exc_message or ""):
        prefix = f"{region.module}." if region.module else ""
        for e in region.forward.externals:
            if e.kind == "external" and e.graph:  # (by its name in the module: one holder its blocks share)
                name = e.name.removeprefix(prefix)
                readers.setdefault(id(run), {}).setdefault(name, []).append(region)


def _graph_freed_by_reentrant(runs: list[Run], graph_readers: dict) -> tuple[str, str] | None:
    """(a short reason, the note) where a run's backward raised "Trying to backward through the graph a second time"
    and reentrant regions read a tensor that requires grad, made by ops outside them and not passed to checkpoint (a
    holder's embedding the blocks share): each reentrant region's backward is a backward of its own, through its
    recompute and on into that tensor's graph, which it frees; the next backward to reach it raises."""
    for run in runs:
        readers = graph_readers.get(id(run))
        if not readers:
            continue
        name, regions = max(readers.items(), key=lambda item: len(item[1]))
        modules = _listed(list(dict.fromkeys(module_label(r.module) for r in regions if r.module)))
        leaf = name.rsplit(".", 1)[-1]
        return (f"reentrant regions read `{name}`, a tensor with a graph of its own that they are not given",
                f"the backward raised because reentrant regions ({modules}) read `{name}`, a tensor that requires "
                "grad, made by ops outside them and not passed to checkpoint: use_reentrant=True runs each region's "
                "backward as a backward of its own (torch.autograd.backward through its recompute), which goes on "
                f"into `{name}`'s graph and frees it, so the next backward to reach that graph raises. Pass it to "
                f"checkpoint as an argument (`checkpoint(fn, x, {leaf})`: its gradient then leaves the region through "
                "checkpoint's own node), or use use_reentrant=False")
    return None


def _listed(items: list, limit: int = 6) -> str:
    """The first `limit` items, with "..." when there are more."""
    return ", ".join(map(str, items[:limit])) + (f", ... ({len(items)} in all)" if len(items) > limit else "")


def _crash(runs: list[Run], regions: list[RegionReport]) -> str | None:
    """A headline for a run that raised before every region was checked: the exception, where in the
    run it struck, and how many regions were never checked and why. Several ranks: every rank that stopped counts
    (the one a gloo error stopped after another rank died as well as that rank), and the headline leads with the
    rank whose stop left regions unchecked, the first to end among them."""
    stopped_runs = [r for r in runs if r.source == "trace" and r.exit_status in ("exception", "interrupted")]
    if not stopped_runs:
        return None
    unchecked = [r for r in regions if r.status == UNCHECKED]

    def left(run: Run) -> int:
        return never_recomputed(run) + sum(1 for r in unchecked if r.rank == run.rank and r.path == run.path)

    never = sum(never_recomputed(r) for r in stopped_runs)
    if not (unchecked or never):
        return None
    stopped = _first_to_end([r for r in stopped_runs if left(r)] or stopped_runs)
    at = _where_it_stopped(stopped)
    step = (stopped.watch or {}).get("step")
    if step and not any(r.step == step for r in stopped.regions):  # watched: its regions are counted, not written
        at = f"in step {step}"
    # (every rank's regions, as the unchecked ones and the report's counts are)
    totals = [t for run in runs if run.watch for t in run.watch["modules"].values()]
    checked = sum(1 for r in regions if r.status in (CLEAN, DIVERGED)) + sum(t[0] - t[1] for t in totals)
    why: dict[str, int] = {}
    for r in unchecked:
        reason = r.unchecked_reason or "not compared"
        why[reason] = why.get(reason, 0) + 1
    if never:
        why["watched, not recomputed"] = never
    reasons = "; ".join(f"{n} {reason}" if len(why) > 1 else reason for reason, n in why.items())
    verb = ("was interrupted" if stopped.exit_status == "interrupted" else "stopped"
            if stopped.exc_type == EXIT_DURING_BACKWARD else "crashed")
    killed = killed_first(runs)
    on = _on_rank(stopped, runs)
    first = (f"rank {killed} was killed first (its trace ends without an end record: SIGKILL, the out-of-memory "
             f"killer?); then " if killed is not None else "")
    return (f"{first}the script {verb}{on}{(' ' + at) if at else ''}: {_how_it_stopped(stopped)}; "
            f"{checked} region(s) checked clean, {len(unchecked) + never} never checked ({reasons})")


def _exit_code(runs: list[Run]) -> int | None:
    """The script's exit code as the traces say: the first rank's that is not 0, else 0 (None: none says)."""
    codes = [run.exit_code for run in runs if run.source == "trace" and run.exit_code is not None]
    return next((c for c in codes if c), codes[0] if codes else None)


def _failed_after(runs: list[Run]) -> str | None:
    """How the script failed where every region it ran was compared (clean), the first rank to fail first: "the script
    failed on rank 3: exit code 7 (its last region ran in step 30; ...)". None where every run ended normally. (Where
    in the step it failed is unknown: an exception outside any region, DDP's in its forward, leaves no record.)"""
    failed = [r for r in runs if r.source == "trace" and (r.exit_status in ("exception", "interrupted") or (
        r.exit_status == "exit" and r.exit_code not in (None, 0)))]
    if not failed:
        return None
    first = _first_to_end(failed)
    verb = "was interrupted" if first.exit_status == "interrupted" else "failed"
    steps = [r.step for r in first.regions if r.step is not None] + [(first.watch or {}).get("step") or 0]
    last = f"its last region ran in step {max(steps)}: " if max(steps) else ""
    return (f"the script {verb}{_on_rank(first, runs)}: {_how_it_stopped(first)} ({last}the trace covers what it ran "
            "until it stopped)")


def _first_to_end(runs: list[Run]) -> Run:
    """Of runs that stopped, the one whose trace ended first (the lowest rank among those without an end time)."""
    return min(runs, key=lambda r: (r.end_time is None, r.end_time or 0.0, r.rank or 0))


def _on_rank(run: Run, runs: list[Run]) -> str:
    """" on rank 3" where the traces are of several ranks, else nothing."""
    return f" on rank {run.rank or 0}" if len({r.rank for r in runs if r.source == "trace"}) > 1 else ""


def _like_their_first(summarized: list[RegionReport], reports: list[RegionReport]) -> None:
    """A reentrant region summarized (write="diverged": its recompute reproduced) whose forward handed out side outputs
    that its module's first region written in full handed out too (the recorder writes the first of each in full): its
    ops are not in the trace to tell whether a gradient reaches them, so it shares that region's finding (it read
    clean, and the same script written in full read at risk)."""
    if not summarized:
        return
    firsts: dict[tuple, RegionReport] = {}  # (path, rank, module) -> its first region at risk (one pass, not one each)
    for r in reports:
        if r.unchecked_reason == SIDE_OUTPUT:
            key = (r.path, r.rank, r.module)
            if key not in firsts or r.region < firsts[key].region:
                firsts[key] = r
    for report in summarized:
        first = firsts.get((report.path, report.rank, report.module))
        if first is None or first.region > report.region:
            continue
        report.status, report.unchecked_reason, report.silent = first.status, first.unchecked_reason, first.silent
        report.cause, report.suggestions = first.cause, list(first.suggestions)
        report.notes.append(f"its forward handed out the tensors region {first.region}'s did, other than through its "
                            f"outputs: that region, written in full, shows the finding (this one's ops were not "
                            "written: its recompute reproduced its forward)")


def _cut_short(runs: list[Run], regions: list[RegionReport], watch: dict | None) -> str | None:
    """A headline for a run whose trace ends without its end record (its process was killed: SIGKILL, the
    out-of-memory killer, a lost node; or it is still running): what ran after its last record was never checked
    (watch mode writes a clean region only in its totals, every 100 steps or 30 seconds), so the run is not clean.
    Several ranks: missing_ranks says it per rank."""
    cut = next((r for r in runs if r.source == "trace" and r.truncated and r.world_size <= 1), None)
    if cut is None or not (cut.regions or cut.watch):
        return None
    checked = sum(1 for r in regions if r.status in (CLEAN, DIVERGED)) + watched_clean(watch)
    how = ("its process is still running on this host (the report reads what it has written so far)" if cut.running
           else "the process was killed (SIGKILL, the out-of-memory killer, a lost node) or is still running, or the "
           "copy is cut")
    if not checked:  # (a record the cut went through reads as never written: the region's forward "not recorded")
        return (f"{cut.path} ends without its end record: {how}; it ends before any region's forward and recompute "
                "were both written, so nothing was checked: copy the trace again, or re-run")
    return (f"{cut.path} ends without its end record: {how}; {checked} region(s) checked clean before its last "
            "record, and what ran after it was never checked")


def _raised_in_their_backward(runs: list[Run], reports: list[RegionReport]) -> None:
    """A run whose exception left a backward in the step of regions that diverged where torch said nothing (their
    recompute saved tensors of other shapes past determinism_check="none", and autograd found a gradient of the wrong
    shape; values that anomaly mode found NaN): those divergences were not silent, the backward raised after them.
    Not where another rank stopped first (killed, or failed earlier): a collective lost its peer, the backward raised
    that."""
    killed = killed_first(runs)
    for run in runs:
        if run.source != "trace" or not run.exc_in_backward or run.errors or killed not in (None, run.rank) \
                or _failed_before(run, runs):
            continue
        own = [r for r in reports if r.path == (run.path or run.source) and r.rank == run.rank and r.status == DIVERGED
               and r.silent and not r.watched]
        # (the step it struck in; older traces: the last step a recompute was recorded in, not where watch
        # records only what diverged)
        steps = [run.exc_step] if run.exc_step is not None else [
            r.step for r in run.regions if r.recompute is not None and r.step is not None]
        for report in own:
            if report.step is None or not steps or report.step == max(steps):
                report.silent = False
                report.backward_raised = _how_it_stopped(run)
                report.chain.append(f"the backward raised after its recompute: {report.backward_raised}")


def _failed_before(run: Run, runs: list[Run]) -> bool:
    """Another rank's script failed before this one's did (both traces ended with their exceptions)."""
    return run.end_time is not None and any(
        other is not run and other.rank != run.rank and (t := failed_at(other)) is not None and t < run.end_time
        for other in runs)


def _where_it_stopped(run: Run) -> str:
    """Where in the run an exception struck, from its regions: in a recompute, in a forward, between a forward and
    its backward, or in the backward after a recompute."""
    def name(r) -> str:
        return f"region {r.region}" + (f" ({module_label(r.module)})" if r.module else "")

    raised = next((r for r in run.regions if r.recompute is not None and r.recompute.state.get("error")), None)
    if raised is not None:
        return f"in the recompute of {name(raised)}"
    if run.regions and run.regions[-1].forward is None and run.regions[-1].recompute is None:
        return f"as the forward of {name(run.regions[-1])} began"  # (nothing of it written: reader.py)
    forwards = [r for r in run.regions if r.forward is not None]
    last = forwards[-1] if forwards else None
    if last is not None and last.forward.state.get("error"):
        return f"in the forward of {name(last)}"
    recomputed = [r for r in run.regions if r.recompute is not None]
    if last is not None and last.recompute is None and (not recomputed or recomputed[-1].region < last.region):
        if run.exc_in_backward:
            return f"in a backward, before the recompute of {name(last)}"
        return (f"after the forward of {name(last)}, before its backward" if recomputed else
                "before any region was recomputed")
    if recomputed:
        return f"in the backward, after {name(recomputed[-1])} was recomputed"
    return ""


def _recorder_losses(runs: list[Run], regions: list[RegionReport]) -> str | None:
    """What ac-diff's own recorder errors left unrecorded, naming the regions that could not be compared and
    why; None when it recorded everything. Data lost this way never reads as clean."""
    totals: dict[str, int] = {}
    errors: list[str] = []
    for run in runs:
        for key, value in (run.recorder_lost or {}).items():
            if key == "errors":
                errors += [e for e in value if e not in errors]
            elif isinstance(value, int):
                totals[key] = totals.get(key, 0) + value
    hit = [r for r in regions if r.unchecked_reason == RECORDER_ERROR]
    if not hit and not any(totals.values()):
        return None
    counts = ", ".join(f"{n} {key if n != 1 else key[:-1]}" for key, n in totals.items() if n)
    where = (f"region{'s' if len(hit) > 1 else ''} {_listed([r.region for r in hit])} not compared"
             if hit else "some ops went unrecorded")
    first = errors[0] if errors else (hit[0].notes[-1] if hit and hit[0].notes else "")
    return (f"ac-diff's recorder failed ({counts or 'data lost'}): {where}; NOT CHECKED, not clean"
            + (f" [{first}]" if first else "") + "; please report it with the trace")


def _others_clean(at_risk: list[RegionReport], checked: int, runs: list[Run]) -> str:
    """"; 2 other region(s) clean" beside regions at risk: not the watched regions of the same modules, which watch
    compared by what it sees (outputs, saved tensors) and which carry the same risk ("; the 3 watched region(s) of
    those modules carry it too")."""
    modules = {r.module for r in at_risk}
    same = sum(t[0] - t[1] for run in runs if run.watch for module, t in run.watch.get("modules", {}).items()
               if module in modules)
    other = checked - same
    return ((f"; {other} other region(s) clean" if other > 0 else "")
            + (f"; the {same} watched region(s) of those modules carry it too (what watch compares does not show it)"
               if same > 0 else ""))


# a clean run whose recomputes repeated in-place updates of state: whether anything the training computes reads the
# twice-updated values (a balancing update from counts, a loss) is for a comparison over more than one step to tell
REPEATED_ASK = " (`ac-diff run --reference no-ac --reference-steps {n}` tells whether the training reads them)"


def repeated_ask(regions: list[RegionReport]) -> str:
    """REPEATED_ASK with the backward passes to compare: the first optimizer step's and one more, where the run
    accumulates gradients (the state the recompute left updated twice is read by the next step's first forward)."""
    first = min((r.optimizer_step for r in regions if r.optimizer_step), default=None)
    per_step = max((r.backward or 0 for r in regions if first is not None and r.optimizer_step == first), default=1)
    return REPEATED_ASK.format(n=max(2, per_step + 1))


def held_choice_note(regions: list[RegionReport]) -> str:
    """A clean headline's note on the clean regions whose chooser's scores moved between the passes without a flip
    (RegionReport.held_choice): the origin thread's MoE, clean at a small size, raising at a larger one."""
    held = [r for r in regions if r.status == CLEAN and r.held_choice]
    if not held:
        return ""
    return (f"; but in {len(held)} of them the scores of a choice moved between the forward and the recompute without "
            f"flipping it (region {held[0].region}, {held[0].held_choice}): with more tokens a choice near a tie "
            "flips (`ac-diff audit` estimates when)")


# a clean run's reentrant regions: their recompute reproduced the forward, but their backward runs as a backward of
# its own, which can add gradients in another order than one backward through the whole graph
REENTRANT_BACKWARD = ("reentrant regions (use_reentrant=True) reproduced their forward, but each runs its backward as "
                      "a backward of its own, which can sum gradients in another order than a run without AC: the "
                      "last bits of some gradients may differ; `ac-diff run --reference no-ac` compares them")


# regions recomputed but not compared, each reason's headline ({n}: how many)
_NOT_COMPARED = (
    (VALUES_NOT_RECORDED, "values not compared: {n} recomputed region(s) match their forward in shapes, dtypes and "
     "ops, but they were recorded with --no-fingerprints, which records no values (a recompute with other values "
     "keeps its shapes): record without it to compare them"),
    (FORWARD_UNRECORDED, "not all compared: {n} region(s) were recomputed whose forward ran before recording began "
     "(before `ac_diff.record()` was entered), so their recompute, and the gradients it gave, were not compared: "
     "record the forward too"))


def _headline(regions, errors, runs, groups, watched: int = 0, never: int = 0, unwritten: int = 0,
              outputs_only: int = 0, backwards: int = 0) -> str:
    """`watched`: regions watch mode compared and found clean, `never`: those it watched that were never recomputed
    (or ran nested in a recompute), `unwritten`: those that diverged after their module's full recording ended (none
    has a report of its own), `outputs_only`: reentrant ones among the compared, by their outputs only; `backwards`:
    the backward passes the run made."""
    diverged = [r for r in regions if r.status == DIVERGED]
    if not diverged:
        if errors:
            e = errors[0]
            changed = [c for c in e.changes if c.saved and c.recomputed]
            return (f"torch raised {error_words(e.kind)}"
                    + (f" on rank {e.rank}" if e.rank is not None else "")
                    + (f" at positions {_listed(e.positions)}" if e.positions else "")
                    + (": " + _listed([f"{c.saved} -> {c.recomputed}" for c in changed], 3) if changed else "")
                    + (f"; {e.cause}" if e.cause else "")
                    + "; no region's op lists were available to explain it (checkpoint(..., debug=True) puts "
                      "them in the log; `ac-diff run` on the script records values, modules and the cause)")
        if not regions and not watched and all(r.source == "trace" for r in runs):
            killed = next((r for r in runs if r.truncated and not r.running), None)
            if killed is not None and len(runs) > 1 and all(  # (the others' stop, torchrun's SIGTERM, followed it)
                    r.exit_status in ("exception", "interrupted") or r.truncated for r in runs):
                return (f"no checkpointed region ran: rank {killed.rank or 0}'s process was killed before any did "
                        "(its trace ends without an end record: SIGKILL, the out-of-memory killer?), and the other "
                        "ranks were stopped after it")
            stopped = next((r for r in runs if r.exit_status in ("exception", "exit", "interrupted")), None)
            if stopped is not None and stopped.exc_in_checkpoint:
                return (f"no checkpointed region ran: the first checkpoint() call raised ({_how_it_stopped(stopped)}): "
                        "torch refused it before its region began; without AC the script may run (`ac-diff run "
                        "--reference no-ac` tells)")
            if stopped is not None:
                return f"no checkpointed region ran: the script stopped before any did ({_how_it_stopped(stopped)})"
            cut = next((r for r in runs if r.truncated), None)
            if cut is not None:
                return (f"nothing to check: {cut.path} ends before any region was written, without its end record "
                        "(the process was killed early, or the copy is cut): copy it again, or re-run")
            spawned = sum(r.spawned for r in runs)
            if spawned:
                return (f"no checkpointed region ran in the process ac-diff recorded: the script started {spawned} "
                        "process(es) with multiprocessing's spawn (mp.spawn, torch.multiprocessing.spawn), fresh "
                        "interpreters ac-diff does not record: start one process per rank with `ac-diff run "
                        "--nproc-per-node N` (torchrun) instead, or record inside each with ac_diff.record()")
            return ("no checkpointed region ran: is activation checkpointing on? (torch.utils.checkpoint.checkpoint, "
                    "checkpoint_wrapper, model.gradient_checkpointing_enable(); regions under torch.no_grad() are "
                    "not checkpointed)")
        checked = sum(1 for r in regions if r.status == CLEAN) + watched
        damaged = sum(1 for r in regions if r.status == DAMAGED)
        if damaged or any(run.damaged for run in runs):
            return (f"damaged: {damaged} region(s) could not be read intact from the trace (damaged lines) and "
                    f"were not diagnosed" + (f"; {checked} other region(s) clean" if checked else "")
                    + "; copy the trace again from where it was written, or re-record it")
        read = [r for r in regions if r.unchecked_reason == STATE_READ_AGAIN]
        if read:
            first = read[0]
            steps = max(3, backwards)
            return (f"gradients at risk: {len(read)} region(s) reproduced their forward, but their code reads "
                    f"state their recompute updates a second time (the first: {module_label(first.module)}, region "
                    f"{first.region}: `{first.cause.tensor}`), so later steps compute with other values than a run "
                    f"without AC: `ac-diff run --reference no-ac --reference-steps {steps}` compares the gradients of "
                    "every backward this run made (past a threshold only a late one's may differ)"
                    + _others_clean(read, checked, runs))
        at_risk = [r for r in regions if r.unchecked_reason == SIDE_OUTPUT]
        if at_risk:
            first = at_risk[0]
            at = f" at {first.cause.source}" if first.cause.source else ""
            return (f"gradients at risk: {len(at_risk)} reentrant region(s) reproduced their forward but handed out "
                    f"tensors other than through their outputs, made without grad (the first: {first.module}, region "
                    f"{first.region}: {first.cause.tensor}{at}); a loss computed from them gives no gradient: "
                    "`ac-diff run --reference no-ac` compares the gradients" + _others_clean(at_risk, checked, runs))
        unreached = [r for r in regions if r.unchecked_reason == NO_GRAD_INPUTS]
        if unreached:
            return (f"gradients at risk: {len(unreached)} reentrant region(s) got no input that requires grad, so no "
                    "backward reaches them (torch only warns: None of the inputs have requires_grad=True): a parameter "
                    "they use that requires grad gets no gradient from them; `ac-diff run` on the script names the "
                    "region and counts those parameters" + (f" ({NO_GRAD_PASS})" if all(
                        r.source == "log" for r in unreached) else "") + _others_clean(unreached, checked, runs))
        for reason, what in _NOT_COMPARED:
            n = sum(1 for r in regions if r.unchecked_reason == reason)
            if n:
                return what.format(n=n) + (f"; {checked} other region(s) reproduced their saved tensors exactly"
                                           if checked else "")
        if not checked:
            why = next((r.notes[0] for r in regions if r.unchecked_reason and r.notes),
                       next((r.notes[-1] for r in regions if r.notes), ""))
            return (f"nothing compared: {len(regions)} region(s), none with a forward and a recompute to compare"
                    + (f" ({why})" if why else ""))
        repeated = repeated_updates(regions)
        extra = (f"; note: the recompute repeats the updates of {', '.join(sorted(repeated)[:3])}"
                 + (" ..." if len(repeated) > 3 else "")
                 + ", so they end each step other than a run without AC leaves them" + repeated_ask(regions)
                 if repeated else "")
        extra += held_choice_note(regions)
        unread = [r for r in regions if r.status == CLEAN and any(UNREAD in n or UNASKED in n for n in r.notes)]
        if unread:
            # (a clean region's positions that hold other values are those: one a backward read would diverge it)
            shown = positions_label([p for p in unread[0].positions if p.values_differ])
            extra += (f"; {len(unread)} of them saved other values too, which no gradient a backward computed read "
                      f"(region {unread[0].region}: {shown}): harmless for the gradients")
        blind = [r for r in regions if r.status == CLEAN and r.unread_values]
        if blind:
            extra += (f"; in {len(blind)} of them the recompute computed other values, which no gradient reads "
                      f"(region {blind[0].region}: {blind[0].unread_values}): harmless for the gradients")
        flagged = [r for r in regions if r.status == CLEAN and r.cause is not None]  # cause.explain_flags
        if flagged:
            key = flagged[0].cause.tensor
            change = flagged[0].state_changes.get(key) or {}
            extra += (f"; but in {len(flagged)} of them a flag that chooses kernels differed between the forward and "
                      f"the recompute ({flag_label(key)}: {change.get('forward')!r} -> {change.get('recompute')!r}): "
                      "the same values on this device, not where a kernel depends on it")
        how = f" ({watched} of them watched)" if watched else ""
        which = "the" if outputs_only >= watched else f"{outputs_only} of the"
        only = (f" ({which} watched reentrant ones: their outputs; their forward saves nothing)" if outputs_only
                else "")
        what = ("the saved tensors a backward read" if unread else "every value their gradients read" if blind
                else "their saved tensors")
        return f"clean: all {checked} recomputed region(s){how} reproduced {what} exactly{only}{extra}"
    # lead with the region torch complained about, else the first in forward order (a watched one too: its cause
    # names its module's full recording); the lowest rank first, as the report's details and cross-rank lines (a
    # log may print rank 1's dump before rank 0's)
    errored = [r for r in diverged if any(e.region == r.region and e.rank == r.rank for e in errors)]
    lead = min(errored or diverged, key=lambda r: (r.rank, r.region))
    step = (f", step {lead.step}" if lead.step is not None else "") + (
        f" (optimizer step {lead.optimizer_step})" if lead.optimizer_step is not None else "") + (
        f", recompute {lead.recompute_n} (a later backward's)" if lead.recompute_n > 1 else "")
    where = f"{module_label(lead.module)} (rank {lead.rank}, region {lead.region}{step})" if lead.module else \
        f"region {lead.region} (rank {lead.rank}{step})"
    silent = " SILENTLY" if lead.silent else ""
    cause = f": {lead.cause.kind}: {lead.cause.detail}" if lead.cause else ""
    same = next((g for g in groups if any(m is lead for m in g.members) and len(g.regions) > 1), None)
    more = (f" [{len(diverged) + unwritten} of {len(regions) + watched + never + unwritten} regions diverged"
            + (f"; {module_label(same.label)}: same cause" if same else "") + _earlier(lead, diverged) + "]"
            if len(diverged) + unwritten > 1 else "")
    damaged = sum(1 for r in regions if r.status == DAMAGED)
    more += f" [{damaged} region(s) damaged in the trace, not diagnosed]" if damaged else ""
    reported = {(r.rank, r.region) for r in regions}
    unwritten_error = next((e for e in errors if e.region is not None and (e.rank or 0, e.region) not in reported
                            and not errored), None) if any(run.watch for run in runs) else None  # (counted only)
    more += (f" [torch raised {error_words(unwritten_error.kind)} about region {unwritten_error.region}, a "
             "watched region (counted, not written)]" if unwritten_error is not None else "")
    raised = f"; then the backward raised {lead.backward_raised}" if lead.backward_raised else ""
    return f"{where} diverged{silent}{cause}{raised}{more}"
