"""Diagnose one region: its divergences, saved positions, cause, chain and suggestions.

    diagnose_region(region, torch_error=None, settings=Settings())
    -> RegionReport(status="diverged", silent=False, cause=Cause(kind="state_mutation", ...),
                    first_value_divergence=Divergence(op="aten.add.Tensor", ...), positions=[...], ...)
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from typing import Iterator
from itertools import groupby

from ..oprules import DETACH, HOOK_ONLY_OPS, is_autocast_weight_cast, packet, updates_as_it_computes
from ..logs.errors import MORE_SAVED, SAC_MUTATED, SAC_NOT_FOUND, refused_op
from ..passes import InputRef, OpRecord, Pass, Position, Region, TensorMeta, TorchError, op_count
from ..report import (CLEAN, DAMAGED, DIVERGED, FORWARD_UNRECORDED, Cause, NESTED_RERUN, NO_GRAD_CALL, NO_GRAD_INPUTS,
                      NOT_REACHED, RECOMPUTE_RAISED, RECORDER_ERROR, SIDE_OUTPUT, STATE_READ_AGAIN, UNCHECKED,
                      UNASKED, UNREAD, UPDATED_IN_FORWARD, UPDATED_IN_PLACE, PYTHON_UPDATE, VALUES_NOT_RECORDED,
                      AlignedRow, Divergence, PositionRow, RegionReport, shared)
from ..stateflags import PASS_NOTES, flag_value
from .attributes import attribute_cause, counted_twice, function_state_cause, split_name, update_code
from .cause import (drawn_at, drew_again_cause, explain, explain_flags, host_draw_cause, private_draw,
                    reentrant_graph_cause, sac_mutated_cause)
from ..align import RECOMPUTE_ONLY, Pair
from .passdiff import (PairDiff, PassComparison, Tolerance, compare_passes, first_size_change_by_occurrence,
                      is_discrete, read_into_arguments, reads_beyond_update)
from .gradpath import gradient_path, path_ops, read_for_no_computed_gradient
from .discrete import decision_kept, describe_flip, first_flip, held_choice
from .inplace_input import (input_written, input_written_after, name_input_write, name_input_written_after,
                           saved_by_its_ops)
from .suggest import repeated_update_suggestion, suggestions_for
from .watched import WATCHED_ORIGINS, explain_watched
from .labels import args_diff, number_ranges, op_label, outputs_diff, positions_label, where


@dataclass(frozen=True)
class Settings:
    tolerance: Tolerance = Tolerance()
    window_before: int = 3
    window_after: int = 8


def diagnose_region(region: Region, torch_error: TorchError | None = None,
                    settings: Settings = Settings(), run_stopped: str | None = None,
                    torch_version: str | None = None, version_check: tuple | None = None) -> RegionReport:
    """`run_stopped`: how the run ended, when it stopped early ("RuntimeError: ..."), for regions it left
    without their recompute; `torch_version`: the torch that ran it (its suggested code is written for it);
    `version_check`: what autograd's version check that stopped the run names (logs.errors.version_check).
    A region recomputed again by a later backward (retain_graph=True; torch.autograd.grad, then .backward())
    gives that backward the saved tensors of its own recompute: where the first reproduced the forward, the first
    later one that did not is the region's report."""
    if not region.later:
        report = _diagnose_pair(region, torch_error, settings, run_stopped, torch_version, version_check)
        if report.status != CLEAN and region.recompute is not None and region.recompute.attempt:  # (watch writes
            _later_recompute(report, region.recompute.attempt + 1, region.recomputes)  # the one that diverged)
        return report
    first, fwd = region.recompute, region.forward
    summarized = [p.values_digest is not None for p in (fwd, first, *region.later)] if fwd is not None else []
    # (write="diverged") the first recompute summarized as a reproduction, the forward written again in full for a
    # later one that did not reproduce it: that one is compared
    start = 1 if summarized and summarized[1] and not summarized[0] else 0
    report = None
    try:
        for n, p in enumerate((first, *region.later)[start:], start=1 + start):
            if summarized and summarized[0] and not summarized[n]:  # its forward's ops went unkept
                report = report or _diagnose_pair(region, torch_error, settings, run_stopped, torch_version,
                                                  version_check)
                _unchecked(report, "later recompute not compared",
                           f"recompute {n} (another backward through the region) did not reproduce the forward, "
                           "whose ops were not kept; re-run with --write all to compare it")
                return report
            region.recompute = p
            again = _diagnose_pair(region, torch_error, settings, run_stopped, torch_version, version_check)
            if again.status != CLEAN:
                if n > 1:
                    _later_recompute(again, n, 1 + len(region.later))
                return again
            report = report or again
    finally:
        region.recompute = first
    return report


def _later_recompute(report: RegionReport, n: int, of: int) -> None:
    report.recompute_n = n
    report.notes.insert(0, (
        f"recompute {n} of {of} diverged: a later backward through the region (retain_graph=True, or "
        "torch.autograd.grad and then .backward()) recomputed it from the state of then, while the first reproduced "
        "the forward; that backward's gradients come from it"))


def _diagnose_pair(region: Region, torch_error: TorchError | None, settings: Settings, run_stopped: str | None,
                   torch_version: str | None, version_check: tuple | None) -> RegionReport:
    """The report of the region's forward and its recompute (`region.recompute`)."""
    fwd, rec = region.forward, region.recompute
    report = RegionReport(
        rank=region.rank, region=region.region, module=region.module, function=region.function, kind=region.kind,
        status=CLEAN,
        silent=False, cause=None, first_value_divergence=None, first_discrete_divergence=None,
        first_shape_divergence=None, first_control_divergence=None, positions=[], suggestions=[], chain=[],
        forward_ops=op_count(fwd), recompute_ops=op_count(rec), source=region.source,
        checkpoint_options=dict(region.options),
    )
    if region.damaged:
        report.status = DAMAGED
        report.notes.append(f"not diagnosed: {region.damaged}")
        return report
    report.watched, report.step = region.watched, region.step
    report.backward = region.recompute.state.get("backward") if region.recompute is not None else None
    report.enclosing = region.parent if region.parent_phase == "forward" else None
    if fwd is None and rec is None and run_stopped and region.kind != "log":
        _unchecked(report, "not recorded: the run stopped in its forward",
                   f"the run stopped as this region's forward began, before any of it was written ({run_stopped})")
        return report
    if not region.recorded and not region.watched and region.options.get("forward_unrecorded"):
        _unchecked(report, FORWARD_UNRECORDED, "its forward ran before recording began (before `ac_diff.record()` "
                   "was entered), so there is nothing to compare its recompute with: record the forward too")
        return report
    if not region.recorded and not region.watched:
        _unchecked(report, "past --max-regions", "ops not recorded (beyond --max-regions); only counted")
        return report
    lost = recorder_loss(region)
    if lost and torch_error is None:
        _unchecked(report, RECORDER_ERROR, f"not compared: {lost}")
        return report
    lost = region.options.get("no_grad_inputs") if fwd is not None and rec is None else None
    if lost is not None:
        return _no_grad_inputs(report, region, lost, torch_version)
    if fwd is None or rec is None:
        inside = region.parent_phase == "recompute" and region.parent is not None
        if fwd is None:
            _unchecked(report, "forward not recorded", "the original forward was not recorded")
        elif fwd.complete and not fwd.positions and region.kind not in ("reentrant", "log"):
            _unchecked(report, "saved no tensor: nothing to recompute",
                       "its forward saved no tensor for the backward (it returned its input, or ran under no_grad): "
                       "torch never recomputes it, and nothing can differ")
        elif region.options.get("no_grad_call") and region.parent is None:
            _unchecked(report, NO_GRAD_CALL,
                       "checkpoint() was called under torch.no_grad() (an evaluation pass): no backward runs through "
                       "it, so there is nothing to recompute or compare")
        elif inside:
            _unchecked(report, NESTED_RERUN,
                       f"a nested checkpoint that ran inside region {region.parent}'s recompute; torch did not "
                       "recompute it again, so there is nothing to compare")
        elif run_stopped:
            _unchecked(report, "not recomputed: the run stopped",
                       f"never recomputed: the run stopped first ({run_stopped})")
        else:
            _unchecked(report, NOT_REACHED,
                       "never recomputed: no backward reached this region before the run ended")
        report.positions = position_rows(fwd, None, None, torch_error) if fwd else []
        written = input_written(fwd) if run_stopped and region.source != "log" else None
        after = input_written_after(region, version_check) if run_stopped else None
        if written is not None:  # what stopped the run: the backward found the kept input changed
            name_input_write(report, *written)
        elif after and saved_by_its_ops(region, after):  # not the checkpoint's: its own ops saved that input
            index, meta, then, now = after[0]
            report.notes.append(
                f"its input[{index}] ({meta}) was modified in place after the forward (version {then} -> {now}); the "
                "region's own ops save that input for their backward, so a run without AC stops at the same version "
                "check: the in-place write is the bug (make it out of place, or clone the input first), not the "
                "checkpoint")
        elif after:  # ... changed after the forward
            name_input_written_after(report, after, version_check)
            report.suggestions = suggestions_for(report, region, torch_version)
        return report

    if not region.passes_whole and not fwd.ops and not rec.ops and torch_error is None:
        _unchecked(report, "no op of both passes in the log",
                   "the log holds no op of this region that both passes list (it starts or ends inside the dump), "
                   "and no torch error about it: nothing to compare")
        return report
    rec = with_refused_op(rec, torch_error)
    cmp = compare_passes(fwd, rec, settings.tolerance, whole=region.passes_whole, reentrant=region.kind == "reentrant")
    report.counts = _counts(cmp)
    report.first_value_divergence = divergence_of("value", cmp.first("value"), cmp)
    report.first_discrete_divergence = divergence_of("discrete", first_flip(cmp), cmp)
    report.first_shape_divergence = divergence_of("shape", cmp.first_shape(), cmp)
    if not region.ops_in_order:  # trust size lists paired by call count over the alignment
        by_call = first_size_change_by_occurrence(cmp.forward_ops, cmp.recompute_ops)
        if by_call is not None:
            f, r = by_call
            report.first_shape_divergence = divergence_of(
                "shape", PairDiff(Pair(f.index, r.index, "match"), f, r, kinds={"args"}), cmp)
    refused = _refused_instead(cmp, rec, region.recompute)
    extra = _saved_past_the_forward(cmp, rec, torch_error) if refused is None else None
    report.first_control_divergence = divergence_of("control", refused or extra or cmp.first("control"), cmp)
    if extra is not None and cmp.first("control") is None:
        last, pack = (cmp.forward_ops[-1] if cmp.forward_ops else None), extra.recompute
        report.first_control_divergence.summary = (
            f"the recompute saved one more tensor than the forward at {where(pack.module, pack.source)}"
            + (f", after the forward's last op ({last.op})" if last is not None else "")
            + ": it ran on where the forward had stopped (another branch); torch raised there")
    if refused is not None:
        r = refused.recompute
        report.first_control_divergence.summary = (
            f"the forward ran {op_label(refused.forward)} where the recompute ran {r.op} in {where(r.module, r.source)}, "
            "which selective AC refused (its forward saved no such op): torch raised there")
    report.first_argument_divergence = divergence_of("argument", cmp.first("argument"), cmp)
    report.changed_inputs = [
        {"kind": f.kind, "name": f.name, "meta": str(f.meta), "forward": f.fingerprint,
         "recompute": r.fingerprint if r else None, "first_op": f.first_op}
        for f, r in cmp.changed_externals
    ]
    report.state_changes = state_changes(fwd, rec, region)
    report.positions = position_rows(fwd, rec, cmp, torch_error)

    position_mismatch = any(p.matches is False for p in report.positions)
    # (positions no backward read: their gradient formula never ran, nothing the loss depends on goes through them)
    unread, unasked = _read_by_no_gradient(report, region, fwd)
    position_values = any(p.values_differ for p in report.positions if p not in unread and p not in unasked)
    if unread:
        report.notes.append(
            f"{positions_label(unread)} hold other values in the recompute, {UNREAD} (their gradient formula never "
            "ran: the loss depends on nothing that goes through them, a branch only `.item()` or a decision reads): "
            "harmless for the gradients")
    if unasked:
        report.notes.append(
            f"{positions_label(unasked)} hold other values in the recompute, {UNASKED} (the backward asked for "
            "other inputs' gradients, `torch.autograd.grad(loss, inputs)`, and their formulas read the other saved "
            "tensors of those ops): harmless for the gradients it computed")
    count_mismatch = _count_mismatch(fwd, rec)
    first = cmp.first_divergence()
    if fwd.positions and (region.kind != "reentrant" or region.watched):  # (watched: a reentrant one's outputs)
        # Backward uses the recomputed saved tensors, compared by value; other values elsewhere are harmless only
        # where they reach neither those nor a tensor that outlives the region (its output, state its code keeps)
        escaped = outliving_differ(fwd, cmp, held_only=region.kind != "reentrant")
        diverged = bool(position_mismatch or position_values or count_mismatch or torch_error or escaped)
        if first is not None and not diverged and first.recompute is None:
            report.notes.append(f"{first.forward.op} and later ops ran in the forward only (the recompute took "
                                "another path or found what they made kept), and every saved tensor matched: "
                                "harmless for the gradients")
        elif first is not None and not diverged:
            report.notes.append(f"{first.forward.op if first.forward else first.recompute.op} and later ops computed "
                                "other values in the recompute, but no saved tensor depends on them: harmless "
                                "for the gradients")
            held = held_choice(cmp)
            if held is not None:
                what = next((f"{c['kind']} `{c['name']}`" for c in report.changed_inputs if c.get("name")), None)
                report.held_choice = (f"{held.op.op} at {where(held.op.module, held.op.source)}: its scores moved by "
                                      f"up to {held.moved:.3g} between the forward and the recompute"
                                      + (f" ({what} changed)" if what else "") + f", and no choice flipped: the "
                                      f"closest of its {held.rows} row(s) was {held.margin:.3g} from a tie")
                report.notes.append(f"{report.held_choice}; with more rows (tokens) some fall within {held.moved:.3g} "
                                    "of a tie and flip in the recompute: a CheckpointError where the shapes follow it, "
                                    "else silently other gradients (`ac-diff audit --noise "
                                    f"abs:{held.moved:.3g} --scale tokens=N` estimates how many)")
            absorbed = attribute_cause(region, first)  # (a Python value changed between the passes: named)
            if absorbed is not None:
                report.notes[-1] += f"; what changed: {absorbed.evidence[0]}" if absorbed.evidence else ""
                held, report.cause = report.cause, absorbed  # (its fixes as if it had diverged on it)
                report.absorbed = (absorbed, suggestions_for(report, region, torch_version))
                report.cause = held
        elif escaped and not (position_mismatch or position_values or count_mismatch or torch_error):
            report.notes.append(f"every saved tensor matched, but what {escaped} made in the recompute differs from "
                                "the forward's and outlived the region (its output, or a tensor its code kept)")
    elif region.kind == "reentrant" and (reaches := gradient_path(fwd, rec, cmp.diffs)) is not None:
        # its backward runs on the graph the recompute builds: what differs off that graph (a scale read from a
        # buffer its own forward updated, then detached) leaves the gradients as they were
        diverged = bool(any(reaches(d) for d in cmp.diffs) or torch_error or position_mismatch or count_mismatch)
        if first is not None and not diverged:
            op = first.forward or first.recompute
            report.unread_values = f"{op.op} at {where(op.module, op.source)}"
            what = next((f" ({c['kind']} `{c['name']}` changed)" for c in report.changed_inputs if c.get("name")), "")
            report.notes.append(f"{report.unread_values} and later ops computed other values in the recompute"
                                f"{what}, but no gradient reads them: they are off the gradient's path (they read no "
                                "input or trainable parameter, or a detached copy) or reach only ops whose gradients "
                                "ignore values (an add, a sub, a view, a sum): harmless for the gradients")
    else:
        diverged = bool(first is not None or torch_error or position_mismatch or count_mismatch)
    for name, op in cmp.region_updates():
        report.side_effects.append(
            f"{name or 'a tensor'}{UPDATED_IN_PLACE}{op.op} in {where(op.module, op.source)} "
            "inside the region, so the recompute applies the update a second time (counted twice)")
        report.repeated.append((name or "a tensor", op.op, op.module))
    twice = counted_twice(region)
    for change, how in twice:  # (its values per step: the region's notes)
        report.side_effects.append(
            f"{change.name}, a Python {'global' if change.is_global else 'attribute'}, is changed by the region's "
            "code in each pass: the recompute runs that code again (counted twice)")
        report.notes.append(f"{change.name} changed during each pass: {how}")
        report.repeated.append((change.name, PYTHON_UPDATE, split_name(change.name)[0] or region.module))
    report.host_draws = list(rec.state.get("host_draws") or ())
    if not diverged:
        report.first_value_divergence = report.first_discrete_divergence = None
        report.first_shape_divergence = report.first_control_divergence = report.first_argument_divergence = None
    # (a reentrant region whose every op matched: its backward runs on the recompute's graph)
    held = None if diverged else function_state_cause(region) or reentrant_graph_cause(region)
    diverged = diverged or held is not None
    report.status = DIVERGED if diverged else CLEAN
    read = [(change, how) for change, how in twice if change.read_again]
    # (a tensor it updates in place and computes with: an amax history its scale comes from, a count a branch reads;
    # (name, its update, the op it reaches as a number where that is how the code reads it))
    tensors: list[tuple[str, OpRecord, OpRecord | None]] = []
    report.read_into = []
    for name, op in cmp.region_updates() if not diverged and not read else ():
        if name and reads_beyond_update(fwd, name):
            tensors.append((name, op, None))
            continue
        into = read_into_arguments(cmp, fwd, name) if name else None
        if into is not None and not updates_as_it_computes(into.op):
            tensors.append((name, op, into))
        elif into is not None:  # (BatchNorm(momentum=None)'s 1 / num_batches_tracked: only its statistics differ)
            report.read_into.append(name)
            report.side_effects.append(
                f"{name} is read as a number that {into.op} at {where(into.module, into.source)} gets as an argument, "
                "another one in the recompute: the state that op updates (running statistics) ends each step other "
                "than without AC, though its outputs, and the gradients, do not change")
    if not diverged and report.repeated:
        report.suggestions = [repeated_update_suggestion(report, torch_version, read_again=bool(read or tensors),
                                                         code=update_code(read[0][0]) if read else None)]
    if not diverged and read:
        change, how = read[0]
        _state_read_again(report, change.name, f"the Python {'global' if change.is_global else 'attribute'}", how)
    elif tensors:
        name, op, into = tensors[0]
        kind = next((e.kind for e in fwd.externals if e.name == name), "external")
        _state_read_again(report, name, {"buffer": "the buffer", "param": "the parameter"}.get(kind, "the tensor"),
                          f"{op.op} at {where(op.module, op.source)} in each pass"
                          + (f"; read as a number that {into.op} at {where(into.module, into.source)} got as an "
                             "argument, another one in the recompute" if into is not None else ""))
    if not diverged and report.status == CLEAN and report.host_draws:
        _drew_again(report, region, fwd.state.get("host_draw_sites") or rec.state.get("host_draw_sites") or [],
                    torch_version)
    elif not diverged and report.status == CLEAN and (drawn := private_draw(cmp.diffs)) is not None:
        report.cause = drew_again_cause(drawn, region)
        _unchecked(report, STATE_READ_AGAIN,
                   f"its recompute reproduced its saved tensors, but {drawn.op} at {where(drawn.module, drawn.source)} "
                   "drew again from the private generator it was handed, which preserve_rng_state does not restore: "
                   "the generator advances twice per step under AC, so later draws differ from a run without AC; "
                   "`ac-diff run --reference no-ac --reference-steps N` compares the gradients (N: every backward "
                   "the run makes)")
        report.suggestions = suggestions_for(report, region, torch_version)
    if not diverged and rec.state.get("error") and not rec.stopped_early:  # it raised: the rest never ran
        _unchecked(report, RECOMPUTE_RAISED, f"the recompute raised ({rec.state['error'][:200]}) after "
                   f"{op_count(rec)} of the forward's {op_count(fwd)} op(s): those match, the rest never ran, so "
                   "the saved tensors were never all recomputed and compared")
    if not diverged and region.kind == "log" and region.options.get("debug"):  # torch prints a dump for a difference
        starts = fwd.state.get("log_starts_at") or rec.state.get("log_starts_at")
        _unchecked(report, "torch's difference not in the log",
                   "torch printed this debug=True dump because the recompute differed from the forward, but the ops "
                   "the log holds match" + (f" (it starts inside the dump, at op #{starts}): the difference is in the "
                                            "ops before" if starts and starts > 1 else ": the difference is in what "
                                            "the log does not show") + "; the whole log, or `ac-diff run` on the "
                   "script, shows it")
    if not diverged and (rec.state.get("cut") or fwd.state.get("cut")):  # the rest of the pass is not in the trace
        report.status = UNCHECKED
        report.notes.append("the trace ends inside this region's passes (the process stopped while they were "
                            "written): the ops it has match, the rest were not recorded")
    if diverged and region.sees_torch_silence:
        torch_checks = region.kind == "checkpoint" and region.options.get("determinism_check") != "none"
        report.silent = torch_error is None and not (torch_checks and (position_mismatch or count_mismatch))
        if rec.state.get("error") and not torch_error:
            report.silent = False
    if count_mismatch:
        report.notes.append(count_mismatch)
    cached = [p for p in report.positions if p.cached]
    if cached:
        ops = sorted({p.op for p in cached if p.op})
        report.notes.append(f"saved position{'s' if len(cached) > 1 else ''} {number_ranges([p.position for p in cached])} "
                            f"({', '.join(ops)}) came from selective AC's cache in the recompute: the forward's own "
                            "tensors, not recomputed (never counted as differing)")
    if not region.passes_whole and (fwd.state.get("log_starts_at") or 0) > 1:
        report.notes.append(f"the log starts inside the dump: ops from #{fwd.state['log_starts_at']} on are "
                            "compared, earlier ones are not in it" if fwd.ops else
                            "the log starts inside the dump and its forward and recompute op lists do not "
                            "overlap: no op is compared")
    raised = report.unchecked_reason == RECOMPUTE_RAISED
    if not rec.complete and not rec.stopped_early and not raised:
        report.notes.append("the log ends inside the recompute's op list: later ops are not in it"
                            if not region.passes_whole else
                            "the recompute did not finish (it raised): ops after that point are not compared")
    if cmp.not_recomputed and (region.passes_whole or rec.complete) and not raised:  # a cut log: said above
        report.notes.append(f"{cmp.not_recomputed} forward op(s) have no recompute counterpart in the log (torch "
                            "stops recomputing at the last saved tensor); they are not compared"
                            if region.source == "log" else
                            f"{cmp.not_recomputed} forward op(s) after the last saved tensor were not recomputed "
                            "(torch's early stop); they are not compared")
    if region.source == "log":
        report.notes.append("from a log: shapes and arguments only; `ac-diff run` on the script would add values, "
                            "modules and the cause")
    elif not region.has_values and report.status == CLEAN:
        _unchecked(report, VALUES_NOT_RECORDED, "recorded with --no-fingerprints: its shapes, dtypes and ops match, "
                   "but no values were recorded to compare (a recompute with other values keeps its shapes); record "
                   "without --no-fingerprints, or with --watch, to compare them")
    if not region.has_values and report.first_shape_divergence is not None:  # (a decision whose shape changed, a
        # nonzero, may only follow one before it whose values a log cannot show: topk -> eq -> nonzero)
        upstream = _log_decision(fwd, rec, report.first_discrete_divergence or report.first_shape_divergence,
                                 cmp.rec_to_fwd)
        report.first_discrete_divergence = upstream or report.first_discrete_divergence
    report.window = window(cmp, report, settings)
    if held is not None:
        report.cause, report.silent = held, True
        report.suggestions = suggestions_for(report, region, torch_version)
    elif diverged:
        explain(report, region, cmp, torch_version)
        if region.watched:
            explain_watched(report, region)
        kind = report.cause.kind if report.cause is not None else "unknown"
        refused = torch_error is not None and torch_error.kind == SAC_MUTATED  # torch saw the cached tensor change
        # (its check misses a cached output changed through a view of it: the recompute then changes the forward's
        # tensor again, and an op reads "other values from identical inputs")
        misread = region.options.get("sac") and kind == "nondeterministic_op"
        mutated = sac_mutated_cause(fwd) if refused and kind in ("unknown", "nondeterministic_op") or misread else None
        if mutated is not None:
            report.cause, report.chain = mutated, []
            report.suggestions = suggestions_for(report, region, torch_version)
    elif report.status == CLEAN:
        explain_flags(report, region, torch_version)
        _side_outputs(report, region, torch_version)
    return report


def _side_outputs(report: RegionReport, region: Region, torch_version: str | None) -> None:
    """A reentrant region whose recompute reproduced its forward, but whose forward handed out a tensor computed from
    what requires grad other than through its outputs (a list a hook fills, as Mixtral's router logits for the
    load-balancing loss): made under no_grad, a loss computed from it gives no gradient. Whether the script computes
    a loss from it, the recompute cannot tell: never clean."""
    fwd = region.forward
    side = fwd.state.get("side_outputs") if region.kind == "reentrant" and fwd is not None else None
    if not side:
        return
    ops = {o.index: o for o in fwd.ops}
    sources = {("param", e.name) for e in fwd.externals if e.kind == "param" and e.requires_grad}
    if "no_grad_inputs" not in region.options:
        sources |= {("input", e.name) for e in fwd.externals if e.kind == "input"}
    on_path = path_ops(fwd, sources)  # (None: a path value went into outside state: each may carry one)
    autocast = any(key.startswith("autocast_") for key in fwd.state)

    def carries_grad(op: OpRecord) -> bool:
        if is_autocast_weight_cast(op.op, autocast, bool(op.input_refs) and all(r.kind != "op" for r in op.input_refs)):
            return False
        return on_path is None or op.index in on_path

    # ([op, output, holder]; older traces: [op, output])
    lost = [(ops[entry[0]], entry[2] if len(entry) > 2 else None) for entry in side
            if entry[0] in ops and carries_grad(ops[entry[0]])]
    if not lost:
        return
    op, holder = lost[0]
    at = f"{op.op} at {where(op.module, op.source)}"
    kept = f"kept as `{holder}`" if holder else "kept by the script: a list a hook fills, a module attribute"
    _unchecked(report, SIDE_OUTPUT,
               f"its recompute reproduced its forward, but {len(lost)} tensor(s) its forward made left it other than "
               f"through its outputs (the first: {at}, {kept}); ac-diff cannot tell whether a loss is computed from "
               "them: `ac-diff run --reference no-ac` compares the gradients")
    report.cause = Cause(
        "lost_gradient", op.op,
        f"the region's forward hands out a tensor other than through its outputs ({at}, {kept}); under "
        "use_reentrant=True the forward runs under no_grad, so that tensor requires no grad, and a loss computed "
        "from it (a router's load-balancing loss) gives no gradient to the region's parameters or anything before it",
        [f"{o.op} (forward op #{o.index}) at {where(o.module, o.source)}: outlived the region, not an output"
         + (f", kept as `{h}`" if h else "") for o, h in lost[:4]],
        mechanism="side_output", source=op.source)
    report.suggestions = suggestions_for(report, region, torch_version)


# torch's warning read from a log alone: it is printed for a checkpointed call under no_grad as well
NO_GRAD_PASS = ("torch prints the same warning for a checkpointed call under torch.no_grad() (a validation or "
                "inference pass), where no gradient is wanted: if it came from such a pass, nothing is at risk")


def _no_grad_inputs(report: RegionReport, region: Region, trainable: int, torch_version: str | None) -> RegionReport:
    """A reentrant region called with grad enabled and no input that requires grad (`no_grad_inputs`: how many of its
    module's parameters require grad, -1 not a module): its output requires no grad, so no backward reaches it."""
    report.positions = position_rows(region.forward, None, None, None)
    read = [e for e in region.forward.externals if e.kind == "param"]
    if trainable < 0 and read:  # (a function, not a module: the parameters its forward read, as recorded)
        trainable = sum(1 for e in read if e.requires_grad)
    why = ("checkpoint(use_reentrant=True) got no input that requires grad, so its output does not require grad "
           "either: no backward reaches this region")
    if trainable == 0:
        _unchecked(report, "needs no backward", f"{why}, and none of its parameters requires grad (frozen): nothing "
                   "is lost, and there is no recompute to compare")
        return report
    if trainable < 0:
        _unchecked(report, NO_GRAD_INPUTS,
                   f"{why}; a parameter it uses that requires grad gets no gradient from it (torch only warns: None of "
                   "the inputs have requires_grad=True"
                   + (f"; which parameters it uses is not in a log); {NO_GRAD_PASS}" if region.kind == "log" else ")"))
        report.suggestions = suggestions_for(report, region, torch_version)
        return report
    report.status, report.silent = DIVERGED, True
    report.cause = Cause("lost_gradient", region.module,
                         f"{why}, and its {trainable} parameter(s) that require grad get no gradient from it (torch "
                         "only warns: None of the inputs have requires_grad=True. Gradients will be None)",
                         [f"{trainable} parameter(s) of {region.module or 'the region'} require grad",
                          "no input of the checkpoint call requires grad (grad enabled at the call)"],
                         mechanism="no_grad_inputs")
    report.suggestions = suggestions_for(report, region, torch_version)
    return report


def with_refused_op(rec: Pass, torch_error: TorchError | None) -> Pass:
    """The recompute with, last, the op selective AC refused to run in it (its error names it: the forward saved no
    such op there, the recompute took another path), where it raised: in the module and at the line the recorder
    noted. The recompute as it is where its error is another."""
    op = refused_op(torch_error.message) if torch_error is not None and torch_error.kind == SAC_NOT_FOUND else None
    if op is None or not rec.state.get("error") or rec.complete:
        return rec
    where = rec.state.get("raised_in") or {}
    index = rec.ops[-1].index + 1 if rec.ops else op_count(rec)
    return replace(rec, ops=[*rec.ops, OpRecord(index, op, where.get("module"), where.get("source"))])


def _saved_past_the_forward(cmp: PassComparison, rec: Pass, torch_error: TorchError | None) -> PairDiff | None:
    """Where torch raised "trying to save more tensors during recomputation": the recompute's last op, the pack of the
    tensor it saved past the forward's last (a log's `detach`; the op that saved it never finished), when it comes
    after every op both passes ran. None otherwise."""
    if torch_error is None or torch_error.kind != MORE_SAVED or not rec.ops:
        return None
    last = rec.ops[-1]
    if last.index <= max((p.recompute for p in cmp.pairs if p.forward is not None and p.recompute is not None),
                         default=-1):
        return None
    return PairDiff(Pair(None, last.index, RECOMPUTE_ONLY), None, last, kinds={"control"})


def _refused_instead(cmp: PassComparison, rec: Pass, recorded: Pass) -> PairDiff | None:
    """Where the recompute ends on the op selective AC refused (`with_refused_op`): that op in place of the forward's
    next one after the last both ran (the branch the recompute took there), or None."""
    if rec is recorded or not rec.ops:
        return None
    refused = rec.ops[-1]
    last = max((f for r, f in cmp.rec_to_fwd.items() if r < refused.index), default=-1)
    instead = next((f for f in cmp.forward_ops if f.index > last), None)
    if instead is None:
        return None
    return PairDiff(Pair(instead.index, refused.index, "substituted"), instead, refused, kinds={"control"})


def outliving_differ(fwd: Pass, cmp: PassComparison, held_only: bool = False) -> str | None:
    """The forward's ops whose tensors outlived its pass (`Pass.outputs`) and differ in the recompute ("aten.add.Tensor
    #7"), or None. Not one the recompute did not run at all: what it made then stands (a table the forward builds and
    caches, which the recompute finds cached). `held_only` (non-reentrant): only those the script keeps (the forward's
    "held_outputs"; traces before it: all), as the recompute's replace them; torch drops what the recompute returns."""
    ops = {o.index: o for o in cmp.forward_ops}
    rerun = set(cmp.rec_to_fwd.values())
    outputs = fwd.outputs or ()
    held = fwd.state.get("held_outputs") if held_only else None
    if held is not None:
        kept = {(op, out) for op, out, *_ in held}
        outputs = [(i, j) for i, j in outputs if (i, j) in kept]
    hit = sorted({i for i, j in outputs if i in ops and i in rerun
                  and cmp.tainted_outputs.get((i, j), cmp.tainted.get(i, False))})
    return ", ".join(f"{ops[i].op} #{i}" for i in hit) or None


def recorder_loss(region: Region) -> str | None:
    """What ac-diff's recorder failed to record in the region's passes ("the recompute lost 2 op(s) to
    ac-diff's own error (KeyError: 1)"), or None. Such a region is never reported clean."""
    parts = []
    for p in (region.forward, region.recompute):
        lost = p.state.get("lost") if p is not None else None
        if not lost:
            continue
        what = "its record" if lost.get("pass") else " and ".join(
            f"{lost[k]} {k[:-1] if lost[k] == 1 else k}" for k in ("ops", "positions") if lost.get(k)) or "data"
        parts.append(f"the {p.phase} lost {what} to an error of ac-diff's recorder ({lost.get('why', '?')})")
    return "; ".join(parts) or None


def _state_read_again(report: RegionReport, name: str, what: str, how: str) -> None:
    """The region reproduced its forward, but its code reads state it also updates (`what`: a Python attribute, a
    schedule's counter, a call count a branch reads; a buffer, fp8's amax history its scale comes from), and the
    recompute updated it a second time: later steps' forwards read other values than a run without AC. Never clean;
    the gradients of later steps settle it (reference/explain.py)."""
    _unchecked(report, STATE_READ_AGAIN,
               f"its recompute reproduced its forward, but its code reads `{name}`, which the recompute updates a second "
               f"time ({how}): from the next step on its forward computes with other values than a run without AC; "
               "`ac-diff run --reference no-ac --reference-steps N` compares the gradients (N: every backward the "
               "run makes; past a threshold only a late one's may differ)")
    report.cause = Cause("state_mutation", name,
                         f"the region's code updates {what} `{name}` and reads it (a schedule, a branch on a count, a "
                         "scale from a history); the recompute runs that code again, so under AC it advances twice per "
                         "step and the forwards of later steps read other values than a run without AC",
                         [f"{name}: {how}"], mechanism=UPDATED_IN_FORWARD, names=[name])


def _drew_again(report: RegionReport, region: Region, sites: list[str], torch_version: str | None) -> None:
    """The region reproduced its forward, but its recompute drew from a host generator (Python's `random`, numpy's)
    again, which preserve_rng_state does not restore: the draw happened to steer nothing this time (a LayerDrop's
    `random.random() < p` on the same side), yet the generator advanced twice per step, so every later draw (the next
    step's LayerDrop, the data order) differs from a run without AC. Never clean; the gradients of later steps settle
    it (reference/explain.py), as for state a recompute updates a second time."""
    report.cause = host_draw_cause(report.host_draws, sites, ", which preserve_rng_state does not restore: the "
                                   "recompute drew again (this time steering nothing), so the generator advances "
                                   "twice per step and later draws differ from a run without AC",
                                   "drawn in the forward and again in the recompute")
    _unchecked(report, STATE_READ_AGAIN,
               f"its recompute reproduced its forward, but drew from {drawn_at(report.host_draws, sites)} again, "
               "which preserve_rng_state does not restore: the generator advances twice per step under AC, so later "
               "draws (the next step's, the data order) differ from a run without AC; `ac-diff run --reference no-ac "
               "--reference-steps N` compares the gradients (N: every backward the run makes)")
    report.suggestions = suggestions_for(report, region, torch_version)


def _unchecked(report: RegionReport, reason: str, note: str) -> None:
    report.status = UNCHECKED
    report.unchecked_reason = reason
    report.notes.append(note)


def _log_decision(fwd: Pass, rec: Pass, shape: Divergence, rec_to_fwd: dict[int, int]) -> Divergence | None:
    """In a log there are no values: name the discrete op the divergent shapes depend on, by dataflow.

    Tried in both passes (a line spliced into the wrong place breaks the path in one of them)."""
    from .dataflow import decision_path, is_chooser

    for p, index in ((fwd, shape.forward_index), (rec, shape.recompute_index)):
        target = next((o for o in p.ops if o.index == index), None)
        path = decision_path(p.ops, target) if target is not None else []
        if len(path) >= 2 and is_chooser(path[0]):
            break
    else:
        return None
    for _ in range(8):  # the decision at the head of the chain (topk -> eq -> nonzero: topk), whose output, kept,
        # makes the rest reproduce: a log shows no values to tell which one flipped
        upstream = decision_path(p.ops, path[0])
        if len(upstream) < 2 or not is_chooser(upstream[0]) or any(o is upstream[0] for o in path):
            break
        path = upstream[:-1] + path
    op = path[0]
    if p is fwd:  # the other pass's index through the alignment
        indices = (op.index, next((r for r, f in rec_to_fwd.items() if f == op.index), None))
    else:
        indices = (rec_to_fwd.get(op.index), op.index)
    return Divergence(kind="discrete", op=op.op, module=op.module, source=op.source,
                      forward_index=indices[0], recompute_index=indices[1],
                      summary=f"the data-dependent decision behind {shape.op} (via "
                              f"{' -> '.join(packet(o.op) for o in path[1:-1]) or 'direct'}); a log has no values: "
                              "`ac-diff run` would show how many elements flipped and by what margin",
                      detail={"path": [o.op for o in path], "from_log": True,
                              "found_in": "forward" if p is fwd else "recompute"})



def _counts(cmp: PassComparison) -> dict[str, int]:
    counts: dict[str, int] = {}
    for d in cmp.diffs:
        counts[d.pair.how] = counts.get(d.pair.how, 0) + 1
    counts["not_recomputed"] = cmp.not_recomputed
    return counts


def _read_by_no_gradient(report: RegionReport, region: Region, fwd: Pass) -> tuple[list, list]:
    """The saved positions that differ yet fed no gradient a backward computed: (those no backward read, those read
    only for gradients it did not compute: `gradpath.read_for_no_computed_gradient`). A non-reentrant region's only:
    a reentrant one's backward reads the graph its recompute builds."""
    if region.unpacked is None or region.kind == "reentrant" or region.watched:
        return [], []
    differ = [p for p in report.positions if p.values_differ]
    unread = [p for p in differ if p.position not in region.unpacked]
    saved = {p.position: p for p in fwd.positions}
    unasked = [p for p in differ if p.position in region.partial_reads and p.position in saved
               and read_for_no_computed_gradient(fwd, saved[p.position], region.partial_reads[p.position])]
    return unread, unasked


def _count_mismatch(fwd: Pass, rec: Pass) -> str | None:
    if not fwd.positions:
        return None
    n_f, n_r = len(fwd.positions), len(rec.positions)
    if n_r > n_f:
        return f"the recompute saved more tensors ({n_r}) than the forward ({n_f})"
    if n_r < n_f and rec.complete and not rec.stopped_early:
        return f"the recompute saved fewer tensors ({n_r}) than the forward ({n_f})"
    return None


def divergence_of(kind: str, d: PairDiff | None, cmp: PassComparison) -> Divergence | None:
    """The report's entry for one differing op pair (`kind`: value, discrete, shape, control, argument)."""
    if d is None:
        return None
    op = d.forward or d.recompute
    assert op is not None
    detail: dict = {"how": d.pair.how, "differs": sorted(d.kinds)}
    f, r = d.forward, d.recompute
    if f is not None and r is not None:
        detail["forward"] = op_label(f, with_args=True)
        detail["recompute"] = op_label(r, with_args=True)
        if d.inputs_same is not None:
            detail["inputs_identical"] = d.inputs_same
        if d.changed_inputs:
            detail["changed_inputs"] = d.changed_inputs
    if kind == "value":
        changed = args_diff(f, r) if f is not None and r is not None and "argument" in d.kinds else None
        summary = (f"values differ: argument {changed}, its tensor inputs identical" if changed and d.inputs_same
                   else "values differ although every input is identical" if d.inputs_same
                   else "values differ (an input already differed)" if d.inputs_same is False
                   else "values differ")
        if f is not None and r is not None and f.fingerprint and r.fingerprint:
            detail["fingerprint"] = {"forward": f.fingerprint, "recompute": r.fingerprint}
    elif kind == "discrete":
        flip = describe_flip(f, r) if f is not None and r is not None else None
        summary = flip.summary if flip else "the decision changed"
        if flip is not None:
            detail.update({k: v for k, v in vars(flip).items() if k not in ("summary", "detail") and v is not None})
            detail.update(flip.detail)
    elif kind == "argument":
        changed = args_diff(f, r) if f is not None and r is not None else None
        summary = f"argument {changed} (identical tensors in)" if changed and d.inputs_same else \
            f"argument {changed}" if changed else "an argument differs"
        detail["args_diff"] = changed
    elif kind == "shape":
        parts = []
        if f is not None and r is not None and _dtype_only(f, r):  # (autocast on in one pass: same shapes)
            detail["differs"] = sorted(set(detail["differs"]) - {"shape"} | {"dtype"})
        if f is not None and r is not None:
            outs = outputs_diff(f, r) if not (f.damaged or r.damaged) else None
            if outs:
                parts.append(outs)
            changed = args_diff(f, r)
            if changed:
                parts.append(f"arguments {changed}")
                detail["args_diff"] = changed
        summary = "; ".join(parts) or "shapes differ"
    else:
        summary = {"forward_only": "ran in the forward but not in the recompute",
                   "recompute_only": "ran in the recompute but not in the forward",
                   "substituted": _substituted(f, r)}.get(d.pair.how, "the op sequence differs here")
    return Divergence(kind=kind, op=op.op, module=op.module, source=op.source, forward_index=d.pair.forward,
                      recompute_index=d.pair.recompute, summary=summary, detail=detail)


def _dtype_only(f, r) -> bool:
    """The outputs of a pair whose metadata differ kept their shapes and changed their dtypes."""
    pairs = [(a, b) for a, b in zip(f.out, r.out) if str(a) != str(b)]
    return len(f.out) == len(r.out) and bool(pairs) and all(
        isinstance(a, TensorMeta) and isinstance(b, TensorMeta) and a.shape == b.shape and a.dtype != b.dtype
        for a, b in pairs)


def _substituted(f, r) -> str:
    """"the forward ran X where the recompute ran Y": with where each ran where that differs (the same op of another
    module, or another op from another line: another branch of the Python code, whose line is the recompute's)."""
    a, b = op_label(f), op_label(r)
    if f is not None and r is not None and (f.module, f.source) != (r.module, r.source):
        a, b = f"{a} in {where(f.module, f.source)}", f"{b} in {where(r.module, r.source)}"
    return f"the forward ran {a} where the recompute ran {b}"


def state_changes(fwd: Pass, rec: Pass, region: Region) -> dict[str, dict]:
    """Global state that differs between the passes' first ops (RNG handled by the cause), with both values."""
    # bookkeeping of the reader, what a pass drew and where (the cause reads them), where it raised, how checkpoint
    # kept its inputs: not state
    ignore = {"n_ops", "error", "rng", "cut", "lost_lines", "host_draws", "host_draw_sites", "lost", "raised_in",
              *PASS_NOTES}
    if region.kind == "reentrant":
        ignore.add("grad_enabled")  # reentrant forward runs under no_grad by design
    keys = (set(fwd.state) | set(rec.state)) - ignore
    if not fwd.state or not rec.state:
        return {}
    if "grad_enabled" not in fwd.state or "grad_enabled" not in rec.state:
        keys &= set(fwd.state) & set(rec.state)  # a pass that ran no op took no snapshot: only what both say
    out = {k: {"forward": flag_value(fwd.state, k), "recompute": flag_value(rec.state, k)}
           for k in sorted(keys) if fwd.state.get(k) != rec.state.get(k)}
    if fwd.state.get("rng") and rec.state.get("rng") and fwd.state["rng"] != rec.state["rng"]:
        out["rng"] = {"forward": fwd.state["rng"], "recompute": rec.state["rng"]}
    return out


def _same_meta(a: TensorMeta | None, b: TensorMeta | None) -> bool | None:
    if a is None or b is None:
        return None
    if "unknown" in (a.device, b.device):  # a log line cut before the device: compare what is known
        return (a.shape, a.dtype) == (b.shape, b.dtype)
    return (a.shape, a.dtype, a.device) == (b.shape, b.dtype, b.device)


def position_rows(fwd: Pass | None, rec: Pass | None, cmp: PassComparison | None,
                  torch_error: TorchError | None) -> list[PositionRow]:
    """Every saved position of the forward, mapped to its op, with the recompute's tensor beside it."""
    reported = {p.position: p for p in (torch_error.positions if torch_error else []) if p.position is not None}
    if fwd is None:
        return []
    ops = {o.index: o for o in fwd.ops}
    rec_positions = {p.position: p for p in rec.positions} if rec else {}
    extra: list[Position] = []  # the recompute's positions no forward one pairs with (it saved something new)
    if rec is not None and cmp is not None and len(fwd.positions) != len(rec.positions) and rec.positions \
            and not rec.state.get("error"):  # (a recompute that raised saved a prefix: by number, as torch pairs)
        rec_positions = _paired_by_op(fwd, rec, cmp)
        paired = {id(p) for p in rec_positions.values()}
        extra = [p for p in rec.positions if id(p) not in paired]
    rec_cached = {o.index for o in rec.ops if o.cached} if rec else set()
    rows: list[PositionRow] = []
    for pos in fwd.positions:
        op = ops.get(pos.op_index) if pos.origin == "op" else None
        other = rec_positions.get(pos.position)
        recomputed = other.meta if other else None
        err = reported.get(pos.position)
        if err is not None and recomputed is None:
            recomputed = err.recomputed
        matches = _same_meta(pos.meta, recomputed)
        values_differ = None
        if cmp is not None and other is not None:
            values_differ = _position_values_differ(pos, other, cmp)
        rows.append(shared(PositionRow(
            position=pos.position, op=op.op if op else None,
            module=op.module if op else pos.name if pos.origin in WATCHED_ORIGINS else None,
            source=op.source if op else None, origin=pos.origin, name=pos.name, forward_index=pos.op_index,
            saved=str(pos.meta) if pos.meta else None, recomputed=str(recomputed) if recomputed else None,
            matches=matches, in_torch_error=err is not None, values_differ=values_differ,
            cached=other is not None and other.origin == "op" and other.op_index in rec_cached,
        )))
    rec_ops = {o.index: o for o in rec.ops} if extra else {}
    for pos in extra:
        op = rec_ops.get(pos.op_index) if pos.origin == "op" else None
        rows.append(PositionRow(
            position=pos.position, op=op.op if op else None, module=op.module if op else pos.name, source=op.source
            if op else None, origin=pos.origin, name=pos.name, forward_index=None, saved=None,
            recomputed=str(pos.meta) if pos.meta else None, matches=False, in_torch_error=False))
    if not fwd.positions and reported:
        by_pack = _positions_by_pack(fwd, rec, cmp, reported) if rec is not None and cmp is not None else {}
        rows.extend(by_pack.values())
        rows.extend(_positions_by_shape(fwd, {k: v for k, v in reported.items() if k not in by_pack}))
        rows.sort(key=lambda r: r.position)
    known = {r.position for r in rows}
    for position, err in sorted(reported.items()):  # positions torch named that the recording lacks
        if position not in known:
            rows.append(PositionRow(position=position, op=None, module=None, source=None, origin="unknown",
                                    name=None, forward_index=None,
                                    saved=str(err.saved) if err.saved else None,
                                    recomputed=str(err.recomputed) if err.recomputed else None,
                                    matches=_same_meta(err.saved, err.recomputed), in_torch_error=True))
    return rows


def _paired_by_op(fwd: Pass, rec: Pass, cmp: PassComparison) -> dict[int, Position]:
    """Where the passes saved different numbers of tensors, positions paired by number pair unrelated tensors past
    the first one missing: each forward position -> the recompute's that its aligned op saved (an input, a parameter:
    by its name; a watched pass's: by the module it was saved in), in order. One the alignment leaves out (a detach
    the autograd engine made, autograd.grad inside the region): by its op and tensor, in order."""
    queue: dict[tuple, list[Position]] = {}
    aligned = set(cmp.rec_to_fwd.values())
    f_ops, r_ops = {o.index: o.op for o in fwd.ops}, {o.index: o.op for o in rec.ops}

    def key(p: Position, op_index: int | None, ops: dict) -> tuple:
        if p.origin != "op":
            return p.origin, p.name
        return ("op", op_index, p.output) if op_index is not None else (ops.get(p.op_index), p.output, p.meta)

    for p in rec.positions:
        queue.setdefault(key(p, cmp.rec_to_fwd.get(p.op_index), r_ops), []).append(p)
    out = {}
    for p in fwd.positions:
        hit = queue.get(key(p, p.op_index if p.op_index in aligned else None, f_ops))
        if hit:
            out[p.position] = hit.pop(0)
    return out


def _positions_by_pack(fwd: Pass, rec: Pass, cmp: PassComparison, reported: dict) -> dict[int, PositionRow]:
    """A debug=True log lists the recompute's pack hooks: saved tensors are detached in position order
    (`$15 = detach($14)`; integer tensors are not always listed, so the k-th detach is not position k).
    Each position torch reported is matched, in order, to the next detached tensor whose recompute shape
    is the recomputed one AND whose aligned forward op made the saved shape. A detach of the code's own (`.detach()`
    in forward()) is one a later op reads, or one of those the forward lists of the same tensor: not a pack's. How
    many detaches one pack logs depends on the release (found from the log)."""
    detach = DETACH
    f_ops = {o.index: o for o in cmp.forward_ops}
    r_ops = {o.index: o for o in rec.ops}
    own_left = Counter(ref.op_index for o, ref in _unread_detaches(fwd.ops))  # (the forward lists no pack's)
    packs = []  # (what was detached, its producer in the recompute or None) per pack detach, in order
    for pack, ref in _unread_detaches(rec.ops):
        twin = cmp.rec_to_fwd.get(ref.op_index)
        if ref.kind == "op" and own_left[twin] > 0:  # (one the forward lists too)
            own_left[twin] -= 1
            continue
        producer = r_ops.get(ref.op_index) if ref.kind == "op" else None
        if producer is None or producer.op != detach:  # a detach of a detach is the same pack's (2.4, 2.7)
            packs.append(((ref.kind, ref.op_index, ref.name, ref.output), producer, ref.output))
    # torch 2.4 detaches a saved tensor twice per pack (once when its holder is gone): runs of one tensor are
    # then mostly of length 2; later releases detach once
    runs = [(producer, j, len(list(group))) for (_, producer, j), group in groupby(packs)]
    lengths = Counter(n for *_, n in runs)
    per_pack = max(lengths, key=lengths.get) if lengths else 1
    candidates = []  # (producer in the recompute, its aligned forward op, output number)
    for producer, j, n in runs:
        if producer is not None:
            candidates += [(producer, f_ops.get(cmp.rec_to_fwd.get(producer.index, -1)), j)] * -(-n // per_pack)
    def fits(err, candidate) -> bool:
        producer, forward, j = candidate
        return (forward is not None and j < len(producer.out) and j < len(forward.out)
                and type(producer.out[j]) is TensorMeta and type(forward.out[j]) is TensorMeta
                and (producer.out[j].shape, producer.out[j].dtype) == (err.recomputed.shape, err.recomputed.dtype)
                and (forward.out[j].shape, forward.out[j].dtype) == (err.saved.shape, err.saved.dtype))

    errs = [(position, err) for position, err in sorted(reported.items())
            if err.saved is not None and err.recomputed is not None]
    rows: dict[int, PositionRow] = {}
    for (position, err), (_, forward, _) in _in_order(errs, candidates, lambda e, c: fits(e[1], c)):
        rows[position] = PositionRow(
            position=position, op=forward.op, module=forward.module, source=forward.source,
            origin="recompute pack", name=None, forward_index=forward.index, saved=str(err.saved),
            recomputed=str(err.recomputed), matches=_same_meta(err.saved, err.recomputed), in_torch_error=True)
    return rows


def _unread_detaches(ops: list[OpRecord]) -> Iterator[tuple[OpRecord, InputRef]]:
    """(detach, what it detached) of a logged pass, for each detach whose output no op of the pass reads but a
    detach (torch 2.4 and 2.7 detach a saved tensor's detached copy again)."""
    read = {ref for o in ops if o.log_ids is not None and o.op != DETACH for ref in o.log_ids[1]}  # (their $N)
    for op in ops:
        if op.op == DETACH and op.input_refs and not (op.log_ids is not None and read.intersection(op.log_ids[0])):
            yield op, op.input_refs[0]


def _in_order(a: list, b: list, fits) -> list[tuple]:
    """The most pairs (x of `a`, y of `b`) that `fits`, both in order (a longest common subsequence): a pack the
    log did not list skips a position, a position torch did not report skips a pack; greedy pairing let one
    tensor take a later pack of the same shape and shift every position after it."""
    if len(a) * len(b) > 4_000_000:  # (a dump of thousands of both: pair greedily, in order)
        out, k = [], 0
        for x in a:
            hit = next((i for i in range(k, len(b)) if fits(x, b[i])), None)
            if hit is not None:
                out.append((x, b[hit]))
                k = hit + 1
        return out
    best = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]
    for i in range(len(a) - 1, -1, -1):
        for j in range(len(b) - 1, -1, -1):
            best[i][j] = max(best[i + 1][j], best[i][j + 1], best[i + 1][j + 1] + 1 if fits(a[i], b[j]) else 0)
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        if fits(a[i], b[j]) and best[i][j] == best[i + 1][j + 1] + 1:
            out.append((a[i], b[j]))
            i, j = i + 1, j + 1
        elif best[i + 1][j] >= best[i][j + 1]:
            i += 1
        else:
            j += 1
    return out


def _positions_by_shape(fwd: Pass, reported: dict) -> list[PositionRow]:
    """A log has no saved-tensor bookkeeping: match torch's positions, in order, to forward outputs of the
    same shape and dtype. A guess, labelled as one (origin "shape match")."""
    outputs = [(op, meta) for op in fwd.ops if op.op not in HOOK_ONLY_OPS for _, meta in op.tensor_outputs()]
    rows, cursor = [], 0
    for position, err in sorted(reported.items()):
        if err.saved is None:
            continue
        hit = next((k for k in range(cursor, len(outputs)) if (outputs[k][1].shape, outputs[k][1].dtype) ==
                    (err.saved.shape, err.saved.dtype)), None)
        if hit is None:
            continue
        cursor = hit + 1
        op = outputs[hit][0]
        rows.append(PositionRow(position=position, op=op.op, module=op.module, source=op.source,
                                origin="shape match", name=None, forward_index=op.index, saved=str(err.saved),
                                recomputed=str(err.recomputed) if err.recomputed else None,
                                matches=_same_meta(err.saved, err.recomputed), in_torch_error=True))
    return rows


def _position_values_differ(pos, other, cmp: PassComparison) -> bool:
    """Does the recompute save other values at this position: another op's tensor, or a changed one?"""
    hook_view = cmp.hook_views.get(pos.op_index) if pos.origin == "op" else None
    if hook_view is not None:  # a framework hook's view of an input in the forward: compare as that input
        pos = Position(pos.position, pos.meta, hook_view.kind, name=hook_view.name)
    # measured: what backward will read
    measured = pos.fingerprint is not None and other.fingerprint is not None and (pos.view is None) == (
        other.view is None)
    alike = measured and cmp.tolerance.equal(pos.fingerprint, other.fingerprint) and pos.view == other.view
    if pos.origin == "op":
        # a copy op a hook made (a compiled graph's saved `detach`) stands for what it copies, in either pass
        paired = cmp.rec_to_fwd.get(other.op_index)
        if other.origin != "op" or paired not in (pos.op_index, cmp.forward_through.get(pos.op_index, pos.op_index)):
            # a different tensor took this position (a shifted sequence torch may not see), unless its values are
            # measured alike (a table the forward built and kept, which the recompute reads as it is)
            return not alike
    elif other.origin != pos.origin or other.name != pos.name and pos.origin != "input":
        return not alike
    elif (pos.origin, pos.name) in cmp.self_updated:
        return False  # read only by the op that updates it (a batch norm's running statistics): the side effect
    if measured:
        return not alike
    if pos.origin == "op":
        return bool(cmp.tainted_outputs.get((pos.op_index, pos.output), cmp.tainted.get(pos.op_index, False)))
    changed = {(f.kind, f.name) for f, _ in cmp.changed_externals}
    return (pos.origin, pos.name) in changed


def window(cmp: PassComparison, report: RegionReport, settings: Settings) -> list[AlignedRow]:
    """Side-by-side rows around the first divergence (and around the first shape divergence if far)."""
    marks: dict[int, str] = {}
    for k, d in enumerate(cmp.diffs):
        op = d.forward or d.recompute
        if d.kinds & {"shape", "args"}:
            marks[k] = "dtype" if "args" not in d.kinds and d.forward is not None and d.recompute is not None \
                and _dtype_only(d.forward, d.recompute) else "shape"
        elif "argument" in d.kinds:
            marks[k] = "argument"
        elif "value" in d.kinds:
            flipped = op is not None and is_discrete(op) and not decision_kept(d.forward, d.recompute)
            marks[k] = "discrete" if flipped else "value"
        elif "control" in d.kinds:
            marks[k] = "control"
    if not marks:
        return []
    first = min(marks)
    centres = [first]
    shape_rows = [k for k, m in marks.items() if m in ("shape", "dtype")]
    if shape_rows and shape_rows[0] - first > settings.window_after:
        centres.append(shape_rows[0])
    rows: list[AlignedRow] = []
    last = -1
    for c in centres:
        lo, hi = max(0, c - settings.window_before), min(len(cmp.diffs), c + settings.window_after + 1)
        lo = max(lo, last + 1)
        if rows and lo > last + 1:
            rows.append(AlignedRow("gap", None, None, None, None, None, None))
        for k in range(lo, hi):
            d = cmp.diffs[k]
            f, r = d.forward, d.recompute
            how = d.pair.how
            if r is None and "control" not in d.kinds and f is not None:
                how = "not_recomputed"
            marker = marks.get(k) or ("cached" if r is not None and r.cached else
                                      "inferred" if f is not None and cmp.tainted.get(f.index) else None)
            rows.append(shared(AlignedRow(how, d.pair.forward, d.pair.recompute, op_label(f, True),
                                          op_label(r, True), (f or r).module if (f or r) else None, marker)))
        last = hi - 1
    return rows

