"""What watch mode saw (capture/watch.py): the totals over the steps, each watched region that diverged, and the full
recording of its module that followed (escalation).

    explain_watched(report, region)        # a watched region that diverged: which saved tensors, and where next
    watch = watch_summary(runs, reports)   # -> Report.watch
    {"steps": 1000, "compared": 4000, "diverged": 4, "clean": 3996, "never_compared": 0, "full_steps": 1,
     "full_from_step": None,
     "escalated": [{"module": "layers.1", "diverged_step": 3, "region": 17, "from_step": 4,
                    "full_regions": 8, "full_diverged": 8, "full_clean": 0, "lead": 21}],
     "text": "step 1 recorded in full (--watch-full-steps 1), then watched 4,000 region(s) over 999 step(s): 3,996 ..."}
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..passes import Region, Run
from ..report import CLEAN, DIVERGED, STATE_READ_AGAIN, Cause, RegionReport, reproduced
from .cause import dtype_only
from .labels import module_label, number_ranges
from .suggest import repeated_update_suggestion

WATCHED_ORIGINS = ("saved", "output")  # a watched pass's positions whose `name` is the module they were saved in


def explain_watched(report: RegionReport, region: Region) -> None:
    """A watched region that diverged: watch recorded no ops, so the cause names the saved tensors that differ and
    the module they were saved in, and points to the full recording (escalation, or --full-from-step)."""
    differ = [p for p in report.positions if p.matches is False or p.values_differ]
    shapes = [p for p in differ if p.matches is False]
    modules = sorted({p.module for p in differ if p.module})
    if differ:
        noun = "output" if all(p.origin == "output" for p in differ) else "saved position"  # (a reentrant one's)
        what = (f"{noun}{'s' if len(differ) > 1 else ''} {number_ranges([p.position for p in differ])}"
                + (f" (in {', '.join(modules[:3])}{' ...' if len(modules) > 3 else ''})" if modules else "")
                + (f" changed {'dtype' if dtype_only(shapes) else 'shape'}" if len(shapes) == len(differ) else
                   f" hold other values ({len(shapes)} of them another shape)" if shapes else
                   " holds other values" if len(differ) == 1 else " hold other values"))
    else:
        what = "the recompute did not save the same tensors (another count, or it raised)"
    step = f" in step {region.step}" if region.step is not None else ""
    if report.cause is None or report.cause.kind == "unknown":
        report.cause = Cause("unknown", modules[0] if modules else None,
                             f"watch mode{step}: {what}; watch records no ops",
                             [f"{p.saved} -> {p.recomputed}" + (" (values)" if p.matches is not False else "")
                              for p in differ[:6]])


def watch_summary(runs: list[Run], reports: list[RegionReport]) -> dict[str, Any] | None:
    """Watch mode's totals over the runs, each escalation with what the full recording of its module found; None
    when no run was watched."""
    watched = [run for run in runs if run.watch is not None]
    if not watched:
        return None
    compared = diverged = never = unwritten = nested = outputs = steps = 0
    escalated: list[dict[str, Any]] = []
    for run in watched:
        w = run.watch
        steps = max(steps, int(w.get("step") or 0))
        for c, d, u, k, n, o in w["modules"].values():
            compared, diverged, never, unwritten, nested, outputs = (compared + c, diverged + d, never + u,
                                                                     unwritten + k, nested + n, outputs + o)
        full = [r for r in reports if r.path == run.path and not r.watched]
        for module, e in sorted(w["escalated"].items(), key=lambda kv: kv[1].get("region") or 0):
            mine = [r for r in full if (r.module == module or (r.module or "").startswith(module + "."))
                    and e.get("from_step") is not None and (r.step or 0) >= e["from_step"]]
            bad = [r for r in mine if r.status == DIVERGED]
            escalated.append({"module": module, "rank": run.rank, **{k: e.get(k) for k in
                              ("diverged_step", "region", "from_step", "why", "until_step", "reentrant",
                               "start_at")},
                              "diverged_steps": sorted({r.step for r in reports if r.watched and r.status == DIVERGED
                                                        and r.path == run.path and r.module == module
                                                        and r.step is not None}),
                              "unwritten": (w["modules"].get(module) or [0] * 6)[3],
                              "counted_steps": [list(x) for x in e.get("counted_steps") or ()],
                              "full_regions": len(mine), "full_diverged": len(bad),
                              "full_clean": sum(reproduced(r) for r in mine),  # (clean, or reproduced at risk)
                              "full_at_risk": sum(reproduced(r) and r.status != CLEAN for r in mine),
                              "lead": bad[0].region if bad else None})
    # the step from which nothing was watched any more: every watched module recorded in full from then on
    from_steps = {(run.rank, m): None if e.get("until_step") is not None else e.get("from_step")
                  for run in watched for m in run.watch["modules"] for e in [run.watch["escalated"].get(m) or {}]}
    all_full = max(from_steps.values()) if from_steps and None not in from_steps.values() else None
    summary = {"steps": steps, "compared": compared, "diverged": diverged, "clean": compared - diverged,
               "all_full_from": all_full, "unwritten": unwritten, "nested": nested, "outputs_only": outputs,
               "never_compared": never, "full_steps": max(int(run.watch.get("full_steps") or 0) for run in watched),
               "full_from_step": watched[0].watch.get("full_from_step"), "escalated": escalated,
               "resample_every": max(int(run.watch.get("resample_every") or 0) for run in watched),
               "resampled": sum(sum((run.watch.get("resampled") or {}).values()) for run in watched),
               "stopped": any(run.exit_status in ("exception", "interrupted") for run in watched)}
    summary["text"] = _text(summary)
    _link_escalations(reports, escalated, _script_words(runs))
    return summary


def watch_counted(run: Run) -> int:
    """Regions a watched run compared as they ran and only counted (its totals per module: [compared, ...]; no op list
    in its trace)."""
    return sum(t[0] for t in run.watch["modules"].values()) if run.watch else 0


def never_recomputed(run: Run) -> int:
    """Forwards `run` watched that were never recomputed (its totals per module: [compared, diverged, never compared,
    ...])."""
    return sum(t[2] for t in run.watch["modules"].values()) if run.watch else 0


def watched_clean(summary: dict[str, Any] | None) -> int:
    """Watched regions that reproduced their saved tensors (they have no region report of their own)."""
    return summary["clean"] if summary else 0


def _text(s: dict[str, Any]) -> str:
    full = min(s.get("full_steps") or 0, s["steps"])
    first = (f"step{'s 1-' + str(full) if full > 1 else ' 1'} recorded in full (--watch-full-steps {full}), then "
             if full else "")
    if full and not s["compared"]:
        text = first + f"no region watched after {'them' if full > 1 else 'it'}"
    else:
        last = min([s["steps"], *(x - 1 for x in (s["full_from_step"], s.get("all_full_from")) if x is not None)])
        text = (f"{first}watched {s['compared']:,} region(s) over {max(last - full, 0):,} step(s): "
                f"{s['clean']:,} reproduced their saved tensors exactly"
                + (f", {s['diverged']:,} diverged" if s["diverged"] else "") + _outputs_only(s))
    if s["never_compared"]:
        text += (f"; {s['never_compared']:,} forward(s) never recomputed ("
                 + ("the run stopped first)" if s.get("stopped") else "no backward reached them)"))
    for e in s["escalated"]:
        if s["full_from_step"] is not None and (e["from_step"] or 0) >= s["full_from_step"]:
            continue  # (every region was recorded in full by then: --full-from-step, said below)
        module = module_label(e["module"])
        earlier = [step for step in e.get("diverged_steps") or () if step < (e["diverged_step"] or 0)]
        if earlier:  # (each earlier divergence had its own full recording, which did not see it recur)
            text += (f"; {module} also diverged (watched) in step{'s' if len(earlier) > 1 else ''} "
                     f"{number_ranges(earlier)}: the steps recorded in full after each saw no divergence (it recurs "
                     "less often than they last)")
        if e["from_step"] is None and (e.get("start_at") or 0) > s["steps"]:  # (watch.py: the step its gap predicts)
            text += (f"; {module} diverged in step {e['diverged_step']}, and its next full recording was to begin in "
                     f"step {e['start_at']}, which the run did not reach (the step its earlier divergences' gap "
                     f"predicts): run again with --full-from-step {e['diverged_step']} to record that step in full")
        elif e["from_step"] is None:
            text += (f"; {module} diverged in step {e['diverged_step']} and the run ended before it ran again: "
                     f"run again with --full-from-step {e['diverged_step']} to record that step in full")
        else:
            found = (f"{e['full_diverged']} of {e['full_regions']} diverged (region {e['lead']} leads)"
                     if e["full_diverged"] else _reproduced(e))
            until = e.get("until_step")
            span = (f"recorded in full from step {e['from_step']} on" if until is None else
                    f"recorded in full in step {e['from_step']}" if until - 1 <= e["from_step"] else
                    f"recorded in full in steps {e['from_step']}-{until - 1}")
            if e.get("why") == "full":  # a region recorded in full saved other tensors (watch.keep_full)
                later = until is None or until - 1 > e["diverged_step"] or e["from_step"] != e["diverged_step"]
                other = "returned other outputs" if e.get("reentrant") else "saved other tensors"
                text += (f"; {module}: its recompute in step {e['diverged_step']} (recorded in full) {other} than its "
                         "forward" + (f", so it was {span}: {found}" if later else f": {found}"))
            else:
                text += f"; {module} diverged in step {e['diverged_step']}: {span}: {found}"
            if until is not None:
                counted = _step_ranges(e.get("counted_steps") or ())
                text += f"; watched again from step {until}" + (
                    f": {e['unwritten']} more diverged (counted, not written"
                    + (f"; in step(s) {counted}" if counted else "") + ")" if e.get("unwritten") else "")
    if s["full_from_step"] is not None and s["full_from_step"] > s["steps"]:
        text += f"; --full-from-step {s['full_from_step']}: the run ended in step {s['steps']}, before it"
    elif s["full_from_step"] is not None:
        text += f"; every region recorded in full from step {s['full_from_step']} (--full-from-step)"
    return text


def _step_ranges(ranges: Any, shown: int = 6) -> str:
    """[[first, last], ...] as "3, 5-9, 12" (the first `shown`: a schedule's period over a long run counts a range per
    divergence, and the recorder keeps the first few dozen)."""
    words = [f"{a}" if a == b else f"{a}-{b}" for a, b in ranges]
    return ", ".join(words[:shown]) + (", ... (later ones too)" if len(words) > shown else "")


def _outputs_only(s: dict[str, Any]) -> str:
    """What watch could not compare in reentrant regions: their forward runs without grad and saves nothing, so their
    outputs are what was compared; a recompute that builds another graph from the same outputs (a softmax kept in
    another dtype) changes the gradients unseen."""
    n = s.get("outputs_only") or 0
    if not n:
        return ""
    said = (f" ({'all' if n == s['compared'] else f'{n:,} of them'} reentrant: compared by their outputs only, as "
            "their forward saves nothing; a recompute that computes the same outputs through other saved tensors "
            "changes the gradients unseen")
    every, done = s.get("resample_every") or 0, s.get("resampled") or 0
    if every:  # (watch._resample)
        return (f"{said} by watch: each such module is also recorded in full every {every} steps, in turn "
                f"(--watch-resample; {done:,} time(s) in this run), which sees it)")
    return f"{said}: record them in full, --watch-resample N, --watch-full-steps N or without --watch)"


def _reproduced(e: dict[str, Any]) -> str:
    """What the full recording of an escalated module found where none of its regions diverged."""
    clean, n = e.get("full_clean", e["full_regions"]), e["full_regions"]
    why = "never recomputed, or the recompute stopped early"
    if not n:
        return "no region of it recorded in full is in the report (the run ended first, or its lines are damaged)"
    risk = e.get("full_at_risk") or 0
    if clean == n:
        return f"all {n} reproduced their saved tensors" + (
            f" ({risk} at risk: they read state their recompute updates again)" if risk else "")
    if not clean:
        return f"none of its {n} region(s) was compared ({why})"
    return f"{clean} of {n} reproduced their saved tensors, {n - clean} never compared ({why})"


def _window_after(r: RegionReport, reports: list[RegionReport], diverged_steps: list[int]
                  ) -> tuple[list[RegionReport], list[int]]:
    """The regions of `r`'s module recorded in full after its step and before that module's next watched divergence
    (the full recording its divergence started), and the steps of its later watched divergences (of
    `diverged_steps`, its module's, `watch_summary`)."""
    later = [step for step in diverged_steps if r.step is not None and step > r.step]
    until = later[0] if later else None
    window = sorted((x for x in reports if not x.watched and x.rank == r.rank and x.path == r.path
                     and (x.module == r.module or (x.module or "").startswith(f"{r.module}."))
                     and x.step is not None and r.step is not None
                     and (x.step > r.step or x.step == r.step and x.region > r.region)  # (escalated within its step)
                     and (until is None or x.step < until)), key=lambda x: (x.step, x.region))
    return window, later


_NO_SCRIPT = "SCRIPT ..."  # (a run the library recorded: its header names no script)


def _script_words(runs: list[Run]) -> str:
    """The script and its arguments as the traces' header names them ("train.py --lr 3e-4", "-m pkg.train"), for a
    command to paste; "SCRIPT ..." where no header names one."""
    import shlex

    header = next((run.header for run in runs if run.source == "trace" and run.header.get("target")), None)
    if header is None:
        return _NO_SCRIPT
    return shlex.join([*(["-m"] if header.get("module") else []), header["target"],
                       *(header.get("target_args") or [])])


def _link_escalations(reports: list[RegionReport], escalated: list[dict[str, Any]],
                      script: str = _NO_SCRIPT) -> None:
    """Each watched region that diverged says where its module's full recording is, or why there is none and the
    command that makes one (`script`: what the run ran, `_script_words`); its cause says it too (the headline shows
    the cause)."""
    by_module = {(e["rank"], e["module"]): e for e in escalated}
    # a region recorded in full that random draws made diverge (what a watched one that did not recur may share)
    drawn = next((x for x in reports if x.status == DIVERGED and x.cause is not None and x.cause.kind == "rng"
                  and not x.watched), None)
    for r in reports:
        e = by_module.get((r.rank, r.module)) if r.watched and r.status == DIVERGED else None
        if e is None:
            continue
        window, later = _window_after(r, reports, e["diverged_steps"])
        bad = [w for w in window if w.status == DIVERGED]
        read = _state_read_twice(r, reports) if not bad else None
        lead = bad[0] if bad else None
        if lead is not None and lead.cause is not None and lead.cause.kind != "unknown" and r.cause is not None \
                and r.cause.kind == "unknown":  # the ops of its module's full recording explain it
            seen = r.cause.detail
            r.cause = Cause(lead.cause.kind, lead.cause.tensor,
                            f"as {e['module']}'s region {lead.region} shows, recorded in full in step "
                            f"{lead.step if lead.step is not None else e['from_step']}: {lead.cause.detail} ({seen})",
                            [*lead.cause.evidence],
                            lead.cause.mechanism, lead.cause.source, list(lead.cause.names))
            r.suggestions = list(lead.suggestions)
        ranks = len({x.rank for x in reports})
        launch = f"--nproc-per-node {ranks} " if ranks > 1 else ""  # (as one process, rank 1's data path never runs)
        again = (f"`ac-diff run {launch}--full-from-step {r.step} {script}` records step {r.step} in full (first "
                 "divergent op, decision and cause)" if r.step is not None else
                 "`--full-from-step N` records a step in full")
        if ranks > 1:
            again += f", launched as before (on several nodes, each node's torchrun: it diverged on rank {r.rank})"
        recurs = f"; it diverged again in step{'s' if len(later) > 1 else ''} {number_ranges(later)}" if later else ""
        span = f"step {window[0].step}" if len({w.step for w in window}) == 1 else \
            f"steps {window[0].step}-{window[-1].step}" if window else ""
        if not window and e["from_step"] is None and not later:
            where = f"the run ended before {e['module']} ran again: {again}"
        elif bad:
            where = (f"{e['module']} was recorded in full in {span}: region {bad[0].region} shows the first divergent "
                     "op and the cause")
        elif window and not any(reproduced(w) for w in window):
            where = (f"{e['module']} was recorded in full in {span}, but none of its {len(window)} region(s) was "
                     f"compared (never recomputed, or the recompute stopped early){recurs}: {again}")
        elif window and later:  # it recurs, less often than the full recording lasts: a schedule's period
            where = (f"{e['module']} was recorded in full in {span}: all {len(window)} reproduced their saved "
                     f"tensors{recurs}, each time after its full recording ended: {again}")
        elif window and read is not None:
            where = (f"{e['module']} was recorded in full in {span}: all {len(window)} reproduced their saved tensors: "
                     f"the divergence did not recur there, as a schedule's threshold on `{read.cause.tensor}` is "
                     f"crossed once; {again}")
        elif window and (absorbed := next((w for w in window if getattr(w, "absorbed", None)), None)) is not None:
            seen_there = (absorbed.absorbed[0].evidence or [absorbed.absorbed[0].tensor])[0]
            where = (f"{e['module']} was recorded in full in {span}: all {len(window)} reproduced their saved tensors, "
                     f"but region {absorbed.region} shows a Python value that changed between its passes there too "
                     f"({seen_there}), which reached no saved tensor there: it recurs, and changes what is saved only "
                     f"at times (rounding absorbs it){recurs}; {again}")
            if r.cause is not None and r.cause.kind == "unknown":
                cause, fixes = absorbed.absorbed
                r.cause = Cause(cause.kind, cause.tensor,
                                f"as {module_label(absorbed.module)}'s region {absorbed.region}, recorded in full in "
                                f"step {absorbed.step}, shows: {cause.detail} (there it reached no saved tensor; here "
                                f"it did: {r.cause.detail})", [*cause.evidence], cause.mechanism, cause.source,
                                list(cause.names))
                r.suggestions = list(fixes)
        elif window:
            chance = (f"; elsewhere in this run random draws made a region diverge ({drawn.module or '?'}, region "
                      f"{drawn.region}: {'a host draw' if drawn.cause.mechanism == 'host_rng' else 'a random op'}"
                      + (f" at {drawn.cause.source}" if drawn.cause.source else "")
                      + "): a random decision that differs only sometimes fits" if drawn is not None else "")
            where = (f"{e['module']} was recorded in full in {span}: all {len(window)} reproduced their saved tensors: "
                     f"the divergence did not recur there (a rare event: a near-tie, a nondeterministic kernel, a state "
                     f"that changed once; or a write behind torch's back, through `.data` or numpy, that full "
                     f"recording does not see){chance}; {again}")
        else:
            where = f"{e['module']} was not recorded in full after step {r.step}{recurs}: {again}"
        r.notes.append(where)
        if read is not None and r.cause is not None and r.cause.kind == "unknown":
            seen = r.cause.detail
            r.cause = Cause(read.cause.kind, read.cause.tensor,
                            f"as {module_label(read.module)}'s region {read.region}, recorded in full in step "
                            f"{read.step}, shows, its code reads `{read.cause.tensor}`, which its recompute updates a "
                            "second time: a recompute that reads the second value computes otherwise where a schedule "
                            f"or branch on it changes (at a threshold, then not again) ({seen})",
                            [f"in region {read.region}: {e}" for e in read.cause.evidence], read.cause.mechanism,
                            read.cause.source, list(read.cause.names))
            # (read's fix says its own gradients are right: this region's recompute diverged)
            again = repeated_update_suggestion(read, read_again=True, diverged=True)
            r.suggestions = [replace(s, text=again.text) if s.title == again.title else s for s in read.suggestions]
        elif (shared := _same_step_setting(r, reports)) is not None and r.cause is not None \
                and r.cause.kind == "unknown":
            seen = r.cause.detail
            r.cause = Cause(shared.cause.kind, shared.cause.tensor,
                            f"likely as {module_label(shared.module)}'s region {shared.region}, recorded in full in "
                            "the "
                            f"same step, shows: {shared.cause.detail} (process-wide: {module_label(r.module)} may read "
                            f"it too; {seen})", [*shared.cause.evidence], shared.cause.mechanism,
                            shared.cause.source, list(shared.cause.names))
            r.suggestions = list(shared.suggestions)
        elif (later_full := _later_full_divergence(r, reports)) is not None and r.cause is not None \
                and r.cause.kind == "unknown":
            seen = r.cause.detail
            r.cause = Cause(later_full.cause.kind, later_full.cause.tensor,
                            f"likely as {module_label(later_full.module)}'s region {later_full.region} shows, recorded "
                            f"in full in step {later_full.step} when it diverged again: {later_full.cause.detail} "
                            f"({seen}; {where})", [*later_full.cause.evidence], later_full.cause.mechanism,
                            later_full.cause.source, list(later_full.cause.names))
            r.suggestions = list(later_full.suggestions)
        elif r.cause is not None and r.cause.kind == "unknown":  # (explain_watched's: the ops come from that recording)
            r.cause.detail += f"; {where}"


def _later_full_divergence(r: RegionReport, reports: list[RegionReport]) -> RegionReport | None:
    """The first region of `r`'s module (and rank) recorded in full in a later step that diverged with a named
    cause: a watched divergence its own window did not catch again likely has that cause."""
    later = [x for x in reports if x.rank == r.rank and x.module == r.module and not x.watched
             and x.status == DIVERGED and x.cause is not None and x.cause.kind != "unknown"
             and x.step is not None and r.step is not None and x.step > r.step]
    return min(later, key=lambda x: (x.step, x.region)) if later else None


def _same_step_setting(r: RegionReport, reports: list[RegionReport]) -> RegionReport | None:
    """A region recorded in full in `r`'s step that diverged on a process-wide setting changed between its forward
    and its backward (a module-level global, a global flag): what a watched region of another module diverging in
    that step likely shares."""
    return _recorded_beside(r, reports, lambda x: x.status == DIVERGED and x.step == r.step and (
        x.cause.kind == "global_state" or x.cause.mechanism == "global"))


def _state_read_twice(r: RegionReport, reports: list[RegionReport]) -> RegionReport | None:
    """A region of `r`'s module recorded in full whose code reads Python state its recompute updates a second time
    (region.py's STATE_READ_AGAIN): what explains a watched divergence its full recording did not see again (the
    second update crossed a schedule's threshold once)."""
    return _recorded_beside(r, reports, lambda x: x.module == r.module and x.unchecked_reason == STATE_READ_AGAIN)


def _recorded_beside(r: RegionReport, reports: list[RegionReport], matches) -> RegionReport | None:
    """The first region of `r`'s trace and rank recorded in full, with a cause, that `matches`."""
    return next((x for x in reports if not x.watched and x.rank == r.rank and x.path == r.path
                 and x.cause is not None and matches(x)), None)
