"""Compare two traces: two runs of a script (before/after a change, two seeds) or two ranks of one run.

    report = compare_runs(read_run("a/trace-rank0.jsonl"), read_run("b/trace-rank0.jsonl"))
    report.verdict   -> "diverged" (the runs differ) or "clean" (same values everywhere)
    report.headline  -> "the runs differ from region 2 (layers.0): aten.mm.default in layers.0.attention.wq
                         (model.py:40 in forward) computes other values; the parameter
                         `layers.0.attention.wq.weight` differs between run A and run B"

The regions of the two traces are aligned by order and module (the same sequence alignment as the
ops), then the ORIGINAL FORWARDS of each region pair are aligned and compared op by op with the very
machinery that compares a forward with its recompute (`compare_passes`): here its "forward" column is
run A and its "recompute" column is run B. Where the forwards agree, the recomputes are compared too.
Each region pair becomes one `RegionReport` of kind "two_runs" (`forward_index` = the op's index in
run A, `recompute_index` = in run B); `Report.compared` says which trace is A and which is B.
"""

from __future__ import annotations

from dataclasses import replace

from ..align import align
from ..stateflags import first_flag, flag_label
from ..gc_hold import collector_paused
from ..passes import Region, Run, op_count
from ..report import (CLEAN, DIVERGED, DIVERGENCE_FIELDS, UNCHECKED, Cause, Divergence, RegionReport, Report,
                      Suggestion, TWO_RUNS)
from .passdiff import PassComparison, compare_passes
from .discrete import first_flip
from .labels import changed_line, where
from .region import Settings, diagnose_region, divergence_of, state_changes, window
from .watched import watch_counted

KIND = TWO_RUNS


def compare_runs(run_a: Run, run_b: Run, settings: Settings = Settings()) -> Report:
    label_a, label_b = _label(run_a), _label(run_b)
    # (by step where both runs count them: a watched run writes only the regions that diverged, or were escalated)
    stepped = all(r.step is not None for run in (run_a, run_b) for r in run.regions)
    keys_a = [_region_key(r, stepped) for r in run_a.regions]
    keys_b = [_region_key(r, stepped) for r in run_b.regions]
    regions: list[RegionReport] = []
    only_a: list[Region] = []
    only_b: list[Region] = []
    aligned = list(_aligned(keys_a, keys_b))
    last_match = max((k for k, (_, _, how) in enumerate(aligned) if how == "match"), default=-1)
    for k, (index_a, index_b, how) in enumerate(aligned):
        a = run_a.regions[index_a] if index_a is not None else None
        b = run_b.regions[index_b] if index_b is not None else None
        with collector_paused(), run_a.loaded(a), run_b.loaded(b):  # one region pair at a time (as diagnose)
            if a is not None and b is not None and how == "match":
                regions.append(_compare_region(a, b, settings))
                continue
            # (after the last region both ran, a killed run's trace simply ends: what the other ran there is missing
            # from it, not another region)
            for r, present, absent, other, only in ((a, "A", "B", run_b, only_a), (b, "B", "A", run_a, only_b)):
                if r is not None:
                    cut = k > last_match and other.truncated
                    regions.append(_unmatched(r, present, absent, other, cut=cut))
                    if not cut:
                        only.append(r)
    differ = [r for r in regions if r.status == DIVERGED]
    compared = sum(1 for r in regions if r.status in (CLEAN, DIVERGED) and r.kind == KIND and not _is_unmatched(r))
    notes = [f"run A: {label_a}", f"run B: {label_b}"]
    notes += _exit_notes(run_a, "A") + _exit_notes(run_b, "B")
    if only_a or only_b:
        notes.append(f"{len(only_a)} region(s) only in run A, {len(only_b)} only in run B: the runs checkpointed "
                     "different modules or ran a different number of steps")
    notes += [f"run A: {n}" for n in run_a.notes] + [f"run B: {n}" for n in run_b.notes]
    unchecked = any(r.status == UNCHECKED for r in regions)
    # (a killed run's trace ends early, a watched one's summarized regions carry no ops: what they ran beyond the
    # regions compared was never compared, so the runs cannot be said to match)
    partial = [letter for run, letter in ((run_a, "A"), (run_b, "B")) if run.truncated or watch_counted(run)]
    if partial and not differ:
        notes.append(f"run {' and '.join(partial)} ran regions no op list of which is in the trace (killed before "
                     "they were written, or watched: compared as they ran, not written): not compared here")
    report = Report(
        verdict=DIVERGED if differ else UNCHECKED if unchecked or partial or not compared else CLEAN,
        headline=_headline(regions, compared, label_a, label_b) + (
            f"; but run {' and '.join(partial)} ran more than its trace holds op lists of (killed, or watched): not "
            "all compared" if partial and not differ else ""),
        regions=regions, sources=[run_a.path or "run A", run_b.path or "run B"], notes=notes,
        exit_status=None,
    )
    report.compared = {
        "mode": KIND, "columns": ["run A", "run B"],
        "a": _describe(run_a), "b": _describe(run_b),
        "regions_a": len(run_a.regions), "regions_b": len(run_b.regions), "regions_compared": compared,
        "regions_differ": len(differ), "only_a": [r.region for r in only_a], "only_b": [r.region for r in only_b],
    }
    first = _first_differing(regions)
    if first is not None:
        report.compared["first"] = {"region": first.region, "module": first.module,
                                    "divergence": _lead(first).to_json() if _lead(first) else None,
                                    "cause": first.cause.to_json() if first.cause else None}
    return report


# -- one region pair ----------------------------------------------------------------------------
def _compare_summaries(a: Region, b: Region, report: RegionReport) -> None:
    """A region one trace only summarized (write="diverged": it reproduced there): compared by the digests of the
    values its passes measured when both traces summarized it, else unchecked."""
    digests = [(p.values_digest if p is not None else None) for p in (a.forward, a.recompute, b.forward, b.recompute)]
    if a.ops_written != b.ops_written and _reproduced_in_one(a, b, report):
        return
    if a.ops_written or b.ops_written or None in digests:
        report.status = UNCHECKED
        summarized = " and ".join(x for x, r in (("run A", a), ("run B", b)) if not r.ops_written)
        report.notes.append(f"{summarized} kept only a summary of this region (it reproduced there; write: "
                            "diverged): record both runs with `--write all` to compare it op by op")
    elif digests[:2] == digests[2:]:
        report.notes.append("compared by the digests of every value both passes measured (summaries: the ops were "
                            "not written)")
    else:
        report.status = DIVERGED
        report.cause = Cause(kind="unknown", tensor=None, detail=(
            "the values this region computed differ between the runs (the digests of their summaries differ; "
            "the ops were not written: record both runs with `--write all` to see the first op that differs)"))


def _reproduced_in_one(a: Region, b: Region, report: RegionReport) -> bool:
    """One run summarized the region (its recompute reproduced its forward there), the other wrote it in full: where
    that one's recompute did not reproduce its own forward, the runs differ there (True, `report` says how)."""
    full, side, other = (a, "A", "B") if a.ops_written else (b, "B", "A")
    own = diagnose_region(full)
    if own.status != DIVERGED:
        return False
    report.status, report.silent = DIVERGED, own.silent
    for name in DIVERGENCE_FIELDS:
        setattr(report, name, getattr(own, name))
    cause = own.cause or Cause("unknown", None, "")
    report.cause = replace(cause, detail=f"in run {side} this region's recompute did not reproduce its forward"
                           + (f" ({cause.detail})" if cause.detail else "")
                           + f"; in run {other} it did (its trace kept only a summary: write: diverged)",
                           evidence=list(cause.evidence), names=[])
    report.suggestions = list(own.suggestions)
    report.notes.append(f"`ac-diff report` on run {side}'s trace details this region's divergence")
    return True


def _compare_region(a: Region, b: Region, settings: Settings) -> RegionReport:
    report = RegionReport(
        rank=a.rank, region=a.region, module=a.module, kind=KIND, status=CLEAN, silent=False, cause=None,
        first_value_divergence=None, first_discrete_divergence=None, first_shape_divergence=None,
        first_control_divergence=None, positions=[], suggestions=[], chain=[],
        forward_ops=op_count(a.forward), recompute_ops=op_count(b.forward),
    )
    if b.region != a.region or b.rank != a.rank:
        report.notes.append(f"run A rank {a.rank} region {a.region} | run B rank {b.rank} region {b.region}")
    if a.watched or b.watched:  # (watch's digests of saved tensors are not the full recording's fingerprints)
        report.status = UNCHECKED
        report.notes.append(" and ".join(x for x, r in (("run A", a), ("run B", b)) if r.watched)
                            + " watched this region (its recompute compared with its forward, no op written): record "
                            "both runs in full to compare them")
        return report
    if a.forward is None or b.forward is None or not a.recorded or not b.recorded:
        report.status = UNCHECKED
        report.notes.append("the forward of this region was not recorded in "
                            + ("run A" if a.forward is None or not a.recorded else "run B"))
        return report
    if not a.ops_written or not b.ops_written:
        _compare_summaries(a, b, report)
        return report
    cmp = compare_passes(a.forward, b.forward, settings.tolerance)
    phase = "forward"
    if _first_any(cmp) is None and not cmp.changed_externals and a.recompute is not None \
            and b.recompute is not None:
        # identical forwards: do the recomputes differ (one run's recompute diverged, the other's not)?
        rcmp = compare_passes(a.recompute, b.recompute, settings.tolerance)
        if _first_any(rcmp) is not None or rcmp.changed_externals:
            cmp, phase = rcmp, "recompute"
            report.forward_ops, report.recompute_ops = op_count(a.recompute), op_count(b.recompute)
            report.notes.append("the forwards of the two runs are identical; their RECOMPUTES differ (shown here): "
                                "one run's recompute diverged from its forward - `ac-diff report` on each trace says why")
    report.counts = {**_counts(cmp), "phase_" + phase: 1}
    report.first_value_divergence = divergence_of("value", cmp.first("value"), cmp)
    report.first_discrete_divergence = divergence_of("discrete", first_flip(cmp), cmp)
    report.first_shape_divergence = divergence_of("shape", cmp.first_shape(), cmp)
    report.first_control_divergence = divergence_of("control", cmp.first("control"), cmp)
    report.first_argument_divergence = divergence_of("argument", cmp.first("argument"), cmp)
    for d in report.divergences():
        _relabel(d, phase)
    report.changed_inputs = [
        {"kind": x.kind, "name": x.name, "meta": str(x.meta), "run_a": x.fingerprint,
         "run_b": y.fingerprint if y else None, "first_op": x.first_op}
        for x, y in cmp.changed_externals
    ]
    pa, pb = (a.forward, b.forward) if phase == "forward" else (a.recompute, b.recompute)
    report.state_changes = {k: {"run_a": v["forward"], "run_b": v["recompute"]}
                            for k, v in state_changes(pa, pb, a).items()}
    options = {k: (a.options.get(k), b.options.get(k)) for k in _CHECKPOINT_OPTIONS
               if a.options.get(k) != b.options.get(k)}
    if options:
        report.notes.append("the runs checkpoint this region with other options: " + ", ".join(
            f"{k}={va!r} in run A, {vb!r} in run B" for k, (va, vb) in options.items()))
    differs = bool(report.divergences() or report.changed_inputs)
    report.status = DIVERGED if differs else CLEAN
    if differs:
        report.window = window(cmp, report, settings)
        report.cause = _cause(report, cmp, phase, options)
        report.chain = _chain(report)
        report.suggestions = _suggestions(report)
    elif report.state_changes:
        report.notes.append("global state differs between the runs (" + ", ".join(sorted(report.state_changes))
                            + ") but every value is the same")
    if not pa.complete or not pb.complete:
        report.notes.append("the pass did not finish in " + ("run A" if not pa.complete else "run B")
                            + " (it raised): ops after that point are not compared")
    return report


def _aligned(keys_a: list, keys_b: list):
    """(index in run A, index in run B, how) per step: the alignment's forward/recompute columns are the runs."""
    return ((pair.forward, pair.recompute, pair.how) for pair in align(keys_a, keys_b))


def _relabel(d: Divergence, phase: str) -> None:
    """The detail keys of a forward-vs-recompute comparison, renamed for two runs."""
    for old, new in (("forward", "run_a"), ("recompute", "run_b")):
        if old in d.detail:
            d.detail[new] = d.detail.pop(old)
    fp = d.detail.get("fingerprint")
    if isinstance(fp, dict):
        d.detail["fingerprint"] = {"run_a": fp.get("forward"), "run_b": fp.get("recompute")}
    d.detail["phase"] = phase


def _first_any(cmp: PassComparison):
    first = getattr(cmp, "first_divergence", None)
    if first is not None:
        return first()
    return next((d for d in cmp.diffs if d.kinds), None)


def _counts(cmp: PassComparison) -> dict[str, int]:
    counts: dict[str, int] = {}
    for d in cmp.diffs:
        counts[d.pair.how] = counts.get(d.pair.how, 0) + 1
    return counts


def _unmatched(r: Region, present: str, absent: str, other: Run, cut: bool = False) -> RegionReport:
    """A region only run `present` has: another region (control flow), unless run `absent` was watched (it writes only
    what diverged) or its trace was `cut` before it (killed): then not compared."""
    if other.watch is not None or cut:  # (a region watch saw reproduce is counted, not written)
        report = RegionReport(
            rank=r.rank, region=r.region, module=r.module, kind=KIND, status=UNCHECKED, silent=False, cause=None,
            first_value_divergence=None, first_discrete_divergence=None, first_shape_divergence=None,
            first_control_divergence=None, positions=[], suggestions=[], chain=[])
        report.notes.append(
            f"run {absent}'s trace ends before this region (the process was killed): not compared" if cut else
            f"run {absent} was watched (--watch), which writes only the regions that diverged or were recorded in "
            "full: this one is not in its trace; record both runs in full to compare them")
        if cut:
            report.unchecked_reason = "cut short"
        return report
    report = RegionReport(
        rank=r.rank, region=r.region, module=r.module, kind=KIND, status=DIVERGED, silent=False,
        cause=Cause("control_flow", r.module, f"region {r.region} ({r.module or '?'}) ran in run {present} only"),
        first_value_divergence=None, first_discrete_divergence=None, first_shape_divergence=None,
        first_control_divergence=None, positions=[], suggestions=[], chain=[],
        forward_ops=op_count(r.forward) if present == "A" else 0, recompute_ops=op_count(r.forward) if present == "B" else 0,
    )
    report.notes.append(f"only in run {present}: no region of run {absent} matches it")
    report.counts = {"only_" + present.lower(): 1}
    return report


def _is_unmatched(r: RegionReport) -> bool:
    return "only_a" in r.counts or "only_b" in r.counts


# -- cause, chain, suggestions for two runs -----------------------------------------------------
_CHECKPOINT_OPTIONS = ("preserve_rng_state", "use_reentrant", "determinism_check", "early_stop")  # (Region.options)


def _cause(report: RegionReport, cmp: PassComparison, phase: str, options: dict | None = None) -> Cause:
    value, control = report.first_value_divergence, report.first_control_divergence
    changed = report.changed_inputs
    if changed:
        # model state (parameters, buffers) first: a differing region input is usually their consequence
        feeding = set((value.detail.get("changed_inputs") if value else None) or [])
        ranked = sorted(changed, key=lambda c: (c["kind"] not in ("param", "buffer"), c["name"] not in feeding,
                                                c.get("first_op") or 0))
        top = ranked[0]
        what = {"buffer": "buffer", "param": "parameter", "input": "region input", "external": "captured tensor"}
        state = [c for c in changed if c["kind"] in ("param", "buffer")]
        evidence = [changed_line(c, "run_a", "run_b") for c in ranked[:4]]
        if len(changed) > 4:
            evidence.append(f"... {len(changed)} tensors read by this region differ in all")
        if not state:
            detail = (f"the region's {top['name']} differs between the runs: the difference entered before this "
                      "region (an earlier region, the data, or code outside checkpointed regions)")
        else:
            more = f" (and {len(state) - 1} more parameter(s)/buffer(s))" if len(state) > 1 else ""
            inputs = [c["name"] for c in changed if c["kind"] == "input"]
            detail = (f"the {what.get(top['kind'], 'tensor')} `{top['name']}`{more} has other values in run B than in "
                      "run A (another initialisation, seed, learning rate or state update)"
                      + (f"; the region's {', '.join(inputs)} differs too" if inputs else ""))
        return Cause("different_inputs", top["name"], detail, evidence)
    flags = {k: v for k, v in report.state_changes.items() if k != "rng"}
    random_first = value is not None and value.detail.get("inputs_identical") and _is_random(cmp, value)
    if random_first:
        rng = report.state_changes.get("rng")
        preserve = (options or {}).get("preserve_rng_state")
        return Cause("rng", value.op, f"{value.op} drew other random numbers in run B from identical inputs"
                     + (f" (checkpoint ran with preserve_rng_state={preserve[0]!r} in run A and {preserve[1]!r} in "
                        "run B: without it, a recompute draws from wherever the generator is)" if preserve and
                        phase == "recompute" else
                        " (the RNG state at the start of the region differs: another seed?)" if rng else ""),
                     [f"{value.op} at {where(value.module, value.source)}"])
    if flags:
        key = first_flag(flags)
        return Cause("global_state", key, f"{flag_label(key)} was {flags[key]['run_a']!r} in run A and "
                     f"{flags[key]['run_b']!r} in run B",
                     [f"{flag_label(k)}: {v['run_a']!r} -> {v['run_b']!r}" for k, v in flags.items()])
    if control is not None and (value is None or (control.forward_index or 0) <= (value.forward_index or 0)):
        return Cause("control_flow", control.op, f"the runs ran different ops from {where(control.module, control.source)} "
                     "before any value differed: Python code took another branch", [control.summary])
    if value is not None and value.detail.get("inputs_identical"):
        return Cause("nondeterministic_op", value.op, f"{value.op} returned other values from identical inputs in the "
                     "two runs (a nondeterministic kernel)", [f"{value.op} at {where(value.module, value.source)}"])
    lead = _lead(report)
    return Cause("unknown", lead.op if lead else None, "no recorded evidence explains the difference",
                 [d.summary for d in (value, report.first_shape_divergence, control) if d is not None])


def _is_random(cmp: PassComparison, d: Divergence) -> bool:
    for diff in cmp.diffs:
        op = diff.forward  # run A's op
        if op is not None and op.index == d.forward_index:
            return op.random
    return False


def _chain(report: RegionReport) -> list[str]:
    chain = [report.cause.detail] if report.cause else []
    seen: set = set()
    for d in (report.first_control_divergence if report.cause and report.cause.kind == "control_flow" else None,
              report.first_value_divergence, report.first_discrete_divergence, report.first_shape_divergence):
        if d is None or d.forward_index in seen:
            continue
        seen.add(d.forward_index)
        chain.append(f"{d.op} in {where(d.module, d.source)}: {d.summary}")
    return chain


def _suggestions(report: RegionReport) -> list[Suggestion]:
    cause = report.cause
    if cause is None:
        return []
    if cause.kind == "nondeterministic_op":
        return [Suggestion("Make the op deterministic",
                           f"{cause.tensor} gave other values from identical inputs. "
                           "torch.use_deterministic_algorithms(True) makes torch pick deterministic kernels (or raise "
                           "where none exists); on GPU also set CUBLAS_WORKSPACE_CONFIG=:4096:8.",
                           "torch.use_deterministic_algorithms(True)")]
    if cause.kind == "rng" and "preserve_rng_state=" in cause.detail:  # (the runs' checkpoint options differ)
        return [Suggestion("Checkpoint with preserve_rng_state=True (torch's default)",
                           "The run that checkpoints without it recomputes its random ops from another generator state "
                           "than its forward drew from: its recompute diverges (`ac-diff report` on its trace).",
                           "checkpoint(block, x, use_reentrant=False, preserve_rng_state=True)")]
    if cause.kind == "rng":
        return [Suggestion("Seed both runs alike", "seed every RNG the same way in both runs (torch.manual_seed, "
                           "and the device generators) to compare them value for value")]
    return []


# -- the report's frame ---------------------------------------------------------------------------
def _lead(r: RegionReport) -> Divergence | None:
    candidates = [d for d in (r.first_value_divergence, r.first_control_divergence, r.first_shape_divergence,
                              r.first_argument_divergence) if d is not None]
    if not candidates:
        return r.first_discrete_divergence
    return min(candidates, key=lambda d: (d.forward_index is None, d.forward_index or 0))


def _first_differing(regions: list[RegionReport]) -> RegionReport | None:
    return next((r for r in regions if r.status == DIVERGED), None)


def _headline(regions: list[RegionReport], compared: int, label_a: str, label_b: str) -> str:
    first = _first_differing(regions)
    if first is None:
        if not compared:
            return "nothing to compare: no region of the two runs has a recorded forward in both"
        unchecked = sum(1 for r in regions if r.status == UNCHECKED)
        return (f"same: all {compared} region(s) of the two runs computed identical values"
                + (f" ({unchecked} not comparable)" if unchecked else ""))
    differ = sum(1 for r in regions if r.status == DIVERGED)
    lead = _lead(first)
    where_ = f"region {first.region} ({first.module or '?'})"
    if lead is None:
        text = f"the runs differ from {where_}: {first.cause.detail if first.cause else 'see the region'}"
    else:
        text = f"the runs differ from {where_}: {lead.op} in {where(lead.module, lead.source)}: {lead.summary}"
        if first.cause and first.cause.kind != "unknown":
            text += f"; {first.cause.kind}: {first.cause.detail}"
    more = f" [{differ} of {len(regions)} regions differ]" if differ > 1 else ""
    return text + more


def _label(run: Run) -> str:
    argv = run.argv or []
    bits = [run.path or "?"]
    if run.rank is not None:
        bits.append(f"rank {run.rank}")
    if argv:
        bits.append("argv " + " ".join(str(a) for a in argv)[:120])
    return ", ".join(bits)


def _describe(run: Run) -> dict:
    return {"path": run.path, "rank": run.rank, "argv": run.argv, "run_id": run.run_id,
            "start_time": run.start_time, "exit_status": run.exit_status, "regions": len(run.regions)}


def _exit_notes(run: Run, letter: str) -> list[str]:
    if run.exc_type is not None:
        first_line = (run.exc_message or "").strip().splitlines()[:1]
        return [f"run {letter} ended with {run.exc_type}" + (f": {first_line[0][:160]}" if first_line else "")]
    if run.truncated:
        return [f"run {letter}'s trace is truncated (the process was killed): regions after that point are missing"]
    return []


def _region_key(r: Region, stepped: bool) -> tuple:
    return (r.module, r.kind, r.parent is not None, r.step if stepped else None)


