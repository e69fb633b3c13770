"""Turn gradient comparisons plus what the run saw into a verdict and reasons (the `reference` section).

    result = explain(steps, findings, report, steps_requested=1)
    result.verdict   -> "differs"
    result.explanations[0].text -> "aten.addmm.default in model.layers.0.mlp.gate (modeling_mixtral.py:88) is made
        inside reentrant region model.layers.0 and leaves it through a list ..., not through its outputs: ..."
    attach(report, result)   # the run is not clean when its gradients differ from the reference

    explain(steps_whose_first_loss_differs, [], report, steps_requested=1, first_forward=first_difference(...))
    result.explanations[0].text -> "the first loss differs (rel. diff 3.1e-07): nondeterministic kernel:
        aten.index_add.default at layers.0.moe (moe.py:88) gives other values from the same inputs from one process
        to the next ..."   (fix: "run with torch.use_deterministic_algorithms(True) (ac-diff fix tries ...)")

Why the two runs can differ, in the order they are checked:
- the loss of the first backward already differs: the forward is not reproducible across processes: not a
  defect, nothing to compare (`not_comparable`). The two runs' first forwards, compared op by op (forwards.py),
  say why: an op that gave other values from identical inputs is a kernel whose result differs from one process
  to the next (`nondeterministic_kernel`: float atomics in index_add_ / scatter_add_ on a GPU; fixed by
  deterministic algorithms); inputs, parameters or random draws that already differed are the script's own
  randomness (`reference_randomness`: seed it); but where a reentrant region branches on grad mode (its cause),
  AC changed the forward itself: use_reentrant=True runs it without autograd (`grad_mode_forward`, differs); and
  where an earlier region was recomputed before that loss (a gradient penalty's torch.autograd.grad inside the step)
  and updated state a second time, the first region to differ runs after it (`repeated_update`, differs);
- a later backward's loss differs while the gradients before it were identical: the state that backward
  starts from differs. Where the recompute repeated an in-place update inside a region (the report's side
  effects, "counted twice"), that is a defect (`repeated_update`): the training departs from the run without
  AC. Where a recompute drew random numbers again instead (a region whose cause is rng, or whose RNG state
  differed between its passes), the comparison stops there, not a gradient defect (`rng_draws`); a recompute that
  drew from a host generator again (Python's `random`, numpy's), which preserve_rng_state never restores, is one
  (`host_draws`), as is one that drew again from a private torch.Generator the code passes (`private_generator`):
  under AC the run goes on from other draws. With
  neither, the loss difference is a defect left unexplained (`state_drift`);
- a diverged region (the recompute differs from the forward): points to it;
- a reentrant region's side output, or a reentrant region without inputs that require grad (leaks.py);
- AC inside compiled graphs that nothing recorded: what the graphs show the regions update (`compiled_ac`);
- parameters that get a gradient in one run only: the graphs reached other parameters (`other_parameters`:
  requires_grad changed between a forward and its backward, or the runs trained other parameters);
- every region reproduced its saved tensors exactly: the backward's own kernels (`backward_kernels`: a
  nondeterministic one, or another order of summing gradient contributions);
- otherwise `unexplained`, with the regions whose parameters differ.
"""

from __future__ import annotations

import re
from typing import Any

from ..diagnosis import REENTRANT_BACKWARD, REPEATED_ASK, held_choice_note
from ..diagnosis.compiled import EAGER_RUN, mutations_text, unrecorded
from ..diagnosis.labels import where
from ..diagnosis.ranks import restate_ranks
from ..report import (CLEAN, DIVERGED, GRAD_MODE, NESTED_RERUN, NO_GRAD_CALL, NOT_REACHED, SIDE_OUTPUT,
                      STATE_READ_AGAIN, UNCHECKED, UPDATED_IN_FORWARD, Divergence, RegionReport, backwards_recorded,
                      diverged_after, recomputed_in)
from .result import (DIFFERS, FAILED, IDENTICAL, NOT_COMPARABLE, Explanation, ReferenceResult, StepComparison)

REENTRANT_FIX = ("use_reentrant=False (Hugging Face: gradient_checkpointing_kwargs={\"use_reentrant\": False}; "
                 "torchtitan and checkpoint_wrapper use it by default)")


def explain(steps: list[StepComparison], findings: list[dict[str, Any]], report: Any, *, steps_requested: int,
            mode: str = "no-ac", exit_code: int | None = None, command: str | None = None,
            first_forward: RegionReport | None = None, captured: int = 0) -> ReferenceResult:
    """`first_forward`: forwards.first_difference of the run and the reference (read where the first loss differs);
    `captured`: the backward passes whose gradients the run with AC captured."""
    result = ReferenceResult(mode=mode, verdict=FAILED, headline="", steps_requested=steps_requested,
                             command=command, exit_code=exit_code)
    if not steps:
        result.headline = ("no gradients to compare with the run without AC: " + (
            f"the run without AC was stopped by signal {-exit_code} before its first backward finished (killed, or "
            "timed out: nothing about the script)" if exit_code and exit_code < 0 else
            (f"the run without AC exited with {exit_code} before its first backward finished, where the run with AC "
             f"finished {captured}: checkpointing hides an error the run without it raises (its output is above)")
            if exit_code and captured else
            f"the run without AC exited with {exit_code} before its first backward finished (it fails without AC "
            "too: see its output)" if exit_code else "no backward pass ran (or no parameter was seen)"))
        return result
    if not any(s.parameters for s in steps):  # (nothing compared is never "identical")
        result.steps = steps[:1]
        result.headline = ("no gradients to compare with the run without AC: no parameter of a module the script "
                           "called was seen (parameters held outside any called nn.Module, a global nn.Parameter "
                           "a checkpointed function reads, are not captured); compare the losses instead, or hold "
                           "them in a module the script calls")
        return result
    if steps[0].parameters and steps[0].no_grad == steps[0].parameters:
        result.steps = steps[:1]
        result.headline = ("no gradients to compare with the run without AC: every parameter's .grad was None after "
                           "the first backward in both runs (an optimizer step in a backward hook frees them, or the script "
                           "sets them to None before the capture); compare the losses instead")
        return result
    if steps[0].loss_identical is False:
        result.steps = steps[:1]
        ac_made = _grad_mode_forward(steps[0], report) or _recomputed_before_loss(steps[0], report, first_forward)
        result.verdict = DIFFERS if ac_made is not None else NOT_COMPARABLE
        result.explanations.append(ac_made or _first_loss(steps[0], first_forward))
        result.headline = ("gradients not compared: the loss of the first backward already differs from the run "
                           "without AC, " + _FIRST_LOSS_WHY.get(result.explanations[0].kind, _FIRST_LOSS_RANDOM))
        return result
    compared = [steps[0]]
    drift: Explanation | None = None  # why a later loss differs after identical gradients
    drift_step = 0
    for prev, step in zip(steps, steps[1:]):
        if drift is None and step.loss_identical is False and not prev.differing:
            drift, drift_step = _drift(step, prev, report), step.step
            if drift.kind == "rng_draws":
                result.explanations.append(drift)
                break
        compared.append(step)
    result.steps = compared
    differing = [s for s in compared if s.differing]
    if drift is not None and drift.kind != "rng_draws" and not differing:  # (the forward's values only)
        result.verdict = IDENTICAL
        rel = next(c for c in compared if c.step == drift_step).loss_rel_diff
        result.headline = (f"gradients identical to the run without AC ({compared[0].parameters} parameter(s), "
                           f"{len(compared)} backward pass(es)); the loss of backward {drift_step + 1} differs (rel. "
                           f"diff {_num(rel)}): the forward computed other values than without AC, the backward the "
                           "same ones")
        result.notes.append(f"the loss differs from backward {drift_step + 1} on, every gradient does not: "
                            f"{drift.text} The recompute computed what the run without AC computes, so the training "
                            "is the same; the loss the script reads (a log line) is not")
        return result
    if drift is not None and drift.kind != "rng_draws":
        result.verdict = DIFFERS
        result.explanations.insert(0, drift)
        first = differing[0] if differing else None
        result.headline = (f"the loss of backward {drift_step + 1} differs from the run without AC although every "
                           f"gradient of backward {drift_step} was identical"
                           + (f", and {len(first.differing)} of {first.parameters} gradients differ at backward "
                              f"{first.step + 1}" if first else "") + f": {drift.kind.replace('_', ' ')}")
        return result
    if not differing:
        result.verdict = IDENTICAL
        total = compared[0].parameters
        result.headline = (f"gradients identical to the run without AC ({total} parameter(s), "
                           f"{len(compared)} backward pass(es))")
        for f in findings:
            result.notes.append("seen, without changing the compared gradients: " + _finding_text(f))
        return result
    result.verdict = DIFFERS
    first = differing[0]
    rels = [d.rel_diff for d in first.differing if d.rel_diff is not None]
    missing = [d.name for d in first.differing if d.status == "missing_in_run"]
    only = [d.name for d in first.differing if d.status == "missing_in_reference"]
    why = _explanations(first, findings, report)
    result.explanations = why + result.explanations
    result.headline = (f"{len(first.differing)} of {first.parameters} gradients differ from the run without AC at "
                       f"backward {first.step + 1}" + (f" (max rel. diff {_num(max(rels))})" if rels else "")
                       + (f", {len(missing)} get no gradient with AC" if missing else "")
                       + (f", {len(only)} get one only with AC" if only else "")
                       + (f": {why[0].kind.replace('_', ' ')}" if why else ""))
    return result


def nondeterministic_kernel(first: RegionReport | None) -> Divergence | None:
    """The op of forwards.first_difference's region that computed other values from identical inputs (a kernel whose
    result differs from one process to the next); None when something differed before it: a region input or
    parameter (unseeded data or initialisation), a random op's draw (unseeded), or the op sequence (Python took
    another branch)."""
    if first is None or first.changed_inputs or (first.cause is not None
                                                 and first.cause.kind in ("rng", "control_flow")):
        return None
    value, control = first.first_value_divergence, first.first_control_divergence
    if value is None or not value.detail.get("inputs_identical"):
        return None
    if control is not None and (control.forward_index or 0) <= (value.forward_index or 0):
        return None
    return value


def _grad_mode_forward(step: StepComparison, report: Any) -> Explanation | None:
    """The first loss differs because a reentrant region's forward, run without autograd, branched on grad mode
    (its cause): with AC the forward computes other values than without it, a checkpointing defect."""
    region = next((r for r in getattr(report, "regions", []) if r.status == DIVERGED and r.cause is not None
                   and r.cause.mechanism == GRAD_MODE), None)
    if region is None:
        return None
    return Explanation(
        "grad_mode_forward",
        f"the first loss differs (rel. diff {_num(step.loss_rel_diff)}): use_reentrant=True runs the checkpointed "
        f"forward without autograd, and region {region.region} ({region.module or '?'}) branches on grad mode "
        f"({region.cause.source or region.cause.tensor}): with AC the forward itself takes the other branch, so the "
        "training differs from the run without AC from its first step.",
        region=region.module, source=region.cause.source, fix=REENTRANT_FIX)


# why the first loss differs, as the reference's headline says it, by the explanation's kind
_FIRST_LOSS_RANDOM = "before any recompute ran (the script's own randomness)"
_FIRST_LOSS_WHY = {
    "nondeterministic_kernel": "before any recompute ran (a nondeterministic kernel)",
    "grad_mode_forward": "before any recompute ran (AC changed the forward itself: use_reentrant=True runs it without "
                         "autograd, and the region branches on grad mode)",
    "repeated_update": "as AC changed the forward itself: a region recomputed before it (a backward inside the step) "
                       "updated state a second time, which a later forward read",
}


def _recomputed_before_loss(step: StepComparison, report: Any, first: RegionReport | None) -> Explanation | None:
    """The first loss differs because a region recomputed before it (a backward inside the step: a gradient penalty's
    torch.autograd.grad) updated state a second time (spectral norm's `_u`, counted twice), which a later region's
    forward then read: with AC the forward itself computed otherwise, a checkpointing defect. `first`: the two
    runs' first region that differs (forwards.first_difference), after such a region."""
    if first is None or not first.region:
        return None
    regions = getattr(report, "regions", [])
    # (recomputed in an earlier backward than the first region to differ: inside the step, before its forward ran;
    # in a plain step every region is recomputed in the one backward after all the forwards)
    later = next((r for r in regions if (r.rank, r.region) == (first.rank, first.region)), None)
    after = recomputed_in(later) if later is not None else None
    earlier = next((r for r in regions if r.rank == first.rank and r.region < first.region
                    and after is not None and (recomputed_in(r) or after) < after
                    and (r.repeated or r.cause is not None and r.cause.mechanism == UPDATED_IN_FORWARD)), None)
    if earlier is None:
        return None
    state = earlier.repeated[0][0] if earlier.repeated else earlier.cause.tensor
    return Explanation(
        "repeated_update",
        f"the first loss differs (rel. diff {_num(step.loss_rel_diff)}): region {earlier.region} ({earlier.module}) "
        f"was recomputed before it (a backward inside the step, as a gradient penalty's torch.autograd.grad runs) and "
        f"updated `{state}` a second time; region {first.region} ({first.module}), run after it, is the first to "
        "compute otherwise than without AC: with AC the forward itself differs.",
        region=earlier.module, source=earlier.cause.source if earlier.cause is not None else None,
        fix="apply the update once per step, outside the checkpointed region, or not in the recompute (spectral "
            "norm: compute the weight once per step with torch.nn.utils.parametrize.cached())")


def _first_loss(step: StepComparison, first: RegionReport | None) -> Explanation:
    """Why the first loss differs between two processes: an op that gives other values from identical inputs, else
    the script's own randomness (see the module docstring)."""
    differs = f"the first loss differs (rel. diff {_num(step.loss_rel_diff)})"
    kernel = nondeterministic_kernel(first)
    if kernel is not None:
        return Explanation(
            "nondeterministic_kernel",
            f"{differs}: nondeterministic kernel: {kernel.op} at {where(kernel.module, kernel.source)} gives other "
            f"values from the same inputs from one process to the next (the first op whose values differ in the two "
            f"runs' first forward, region {first.region}: every input identical). Not a checkpointing defect, but "
            "the gradients cannot be compared while it stays nondeterministic.",
            region=first.module, module=kernel.module, source=kernel.source,
            fix="run with torch.use_deterministic_algorithms(True) (ac-diff fix tries --deterministic)")
    seen = ""
    if first is not None:  # what the two runs' first forwards show
        names = [c["name"] for c in first.changed_inputs]
        lead, kind = first.first_divergence(), first.cause.kind if first.cause is not None else None
        what = (f"already reads other values of {', '.join(names[:3])}"
                + (f" and {len(names) - 3} more" if len(names) > 3 else "") if names
                else f"draws other random numbers in {lead.op}" if kind == "rng" and lead is not None
                else f"runs other ops from {lead.op}" if kind == "control_flow" and lead is not None
                else f"differs first at {lead.op}" if lead is not None else "differs")
        seen = f"; in the two runs' first forwards, region {first.region} ({first.module or '?'}) {what}"
    return Explanation(
        "reference_randomness",
        f"{differs}: the forward is not reproducible from one process to the next (unseeded random ops, data order, "
        f"nondeterministic kernels){seen}. That is the reference's own randomness, not a checkpointing defect.",
        fix="seed the script (torch.manual_seed, the generators and data loaders it uses) and run again")


def _drift(step: StepComparison, prev: StepComparison, report: Any) -> Explanation:
    """Why backward `step`'s loss differs although every gradient of backward `prev` was identical (see the module
    docstring), from what the report saw in the regions."""
    regions = getattr(report, "regions", [])
    start = (f"backward {step.step + 1}: the loss differs although every gradient of backward {prev.step + 1} was "
             "identical, "
             "so the state it starts from differs from the run without AC")
    repeated = sorted({e for r in regions for e in r.side_effects})
    if repeated:
        more = f" (and {len(repeated) - 1} more)" if len(repeated) > 1 else ""
        return Explanation(
            "repeated_update", f"{start}: {repeated[0]}{more}. Later backwards start from that state.",
            fix="apply the update once per step: outside the checkpointed region (after the backward, e.g. in an "
                "optimizer step hook), or not in the recompute")
    rng = [r.cause for r in regions if r.cause is not None and r.cause.kind == "rng"]
    # Python's or NumPy's generator, which torch restores for neither pass: a recompute that drew from it (the same
    # decisions as its forward, or another) leaves the run's later draws other than the run without AC's
    redrew = any(r.host_draws for r in regions)
    if any(c.mechanism == "host_rng" for c in rng) or redrew:
        source = next((c.source for c in rng if c.mechanism == "host_rng" and c.source), None)
        return Explanation(
            "host_draws", f"{start}: the recompute drew from a host generator (Python's random, NumPy) again"
            + (f" at {source}" if source else "") + ", so under AC the generator advances twice per step and the run "
            "goes on from other random numbers than without AC (preserve_rng_state restores torch's generators "
            "only): checkpointing changes the training from here",
            fix="draw the host random values outside the checkpointed region and pass them in")
    private = next((c for c in rng if c.mechanism == "private_generator"), None)
    if private is not None:  # (a torch.Generator the code passes: preserve_rng_state restores only the default ones)
        return Explanation(
            "private_generator", f"{start}: the recompute drew again from {private.tensor}, which preserve_rng_state "
            "does not restore, so under AC that generator advances twice per step and the run goes on from other "
            "random numbers than without AC: checkpointing changes the training from here",
            fix="pass the generator's state into the checkpointed function and set it there (ac-diff run "
                "--restore-in-recompute MODULE simulates it), or draw outside the region and pass the tensor in")
    if rng or any("rng" in r.state_changes for r in regions):
        return Explanation(
            "rng_draws", f"{start}: the two runs drew other random numbers in between (a recompute without "
            "preserve_rng_state draws again). Not a gradient defect; later backwards are not compared.",
            fix="preserve_rng_state=True (ac-diff run --preserve-rng)")
    return Explanation(
        "state_drift", f"{start}: something other than the parameters (a buffer, a Python attribute, a generator) "
        "evolved differently with AC, and the recorded regions show no update repeated by the recompute and no "
        "random draws")


def _explanations(step: StepComparison, findings: list[dict[str, Any]], report: Any) -> list[Explanation]:
    out: list[Explanation] = []
    differing = {d.name for d in step.differing}
    by_module: dict[Any, list[Any]] = {}
    for r in getattr(report, "regions", []):
        if r.status == DIVERGED:
            by_module.setdefault((r.rank, r.module), []).append(r)
    for (rank, module), regions in by_module.items():
        r = regions[0]
        inside = sorted(n for n in differing if module and n.startswith(module + "."))
        cause = r.cause.kind if r.cause else "unknown cause"
        more = f"; also regions {', '.join(str(x.region) for x in regions[1:])}" if len(regions) > 1 else ""
        out.append(Explanation(
            "recompute_divergence",
            f"region {r.region} ({module}, rank {rank}{more}) diverged in its recompute ({cause}): its gradients, and "
            "those of everything before it, follow from that divergence (see that region in this report)",
            region=module, parameters=inside))
    for f in findings:
        if f["kind"] == "no_grad_inputs":
            params = [p for p in f["parameters"] if p in differing] or f["parameters"]
            out.append(Explanation("no_grad_inputs", _finding_text(f), region=f["region"], parameters=params,
                                   fix=REENTRANT_FIX + "; or make the region's input require grad (Hugging Face: "
                                   "model.enable_input_require_grads())"))
        elif f["kind"] == "side_output":
            out.append(Explanation("side_output", _finding_text(f), region=f["region"], module=f.get("module"),
                                   source=f.get("source"),
                                   fix=REENTRANT_FIX + "; or return the tensor through the region's outputs"))
    others = getattr(report, "other_ranks_diverged", [])
    if not out and others:  # gradients reduced across ranks (DDP, FSDP) carry another rank's divergence here
        ranks = sorted({r.rank for r in others})
        first = min(others, key=lambda r: (r.rank, r.region))
        out.append(Explanation(
            "other_rank_divergence",
            f"this rank's regions reproduced their forward, but rank{'s' if len(ranks) > 1 else ''} "
            f"{', '.join(map(str, ranks))} diverged (first region {first.region}, {first.module or '?'}, rank {first.rank}"
            f"{': ' + first.cause.kind if first.cause else ''}): gradients reduced across ranks (DDP's all-reduce, "
            "FSDP's reduce-scatter) bring that error here", region=first.module, parameters=sorted(differing)[:20]))
    compiled = getattr(report, "compiled", None)
    if not out and unrecorded(compiled):  # AC inside compiled graphs: what the graphs show
        found = mutations_text(compiled)
        out.append(Explanation(
            "compiled_ac",
            f"AC runs inside compiled graphs ({compiled['regions']} checkpointed region(s)), recomputed by the compiler "
            "(AOTAutograd) where ac-diff records nothing; " + (
                f"from the graphs: {found}; record them eagerly to place the divergence: {EAGER_RUN} ..." if found else
                "the graphs show no state updated inside the regions, so the difference may be rounding: the compiled "
                "backward recomputes and fuses the regions' ops otherwise than the run without AC, or a kernel is "
                "nondeterministic (then two runs without AC differ too; `--deterministic` runs both with "
                f"deterministic algorithms); record them eagerly to compare the regions: {EAGER_RUN} ..."),
            parameters=[d.name for d in step.differing[:20]],
            fix="update state outside the checkpointed region (after the backward, e.g. in an optimizer step hook)"
            if found else "ac-diff run --deterministic --reference no-ac ... (what differs then is not a kernel's "
            "nondeterminism)"))
    if not out:
        inside = sorted({d.region for d in step.differing if d.region})
        outside = sum(1 for d in step.differing if not d.region)
        where = ("the differing gradients are those of checkpointed region(s) " + ", ".join(inside[:8]) if inside else
                 "the differing gradients") + (f"{' and of' if inside else ' are of'} {outside} parameter(s) outside "
                                               "any checkpointed region" if outside else "")
        regions = getattr(report, "regions", [])
        compared = [r for r in regions if r.status in (CLEAN, DIVERGED)]
        one_sided = [d for d in step.differing if d.status in ("missing_in_run", "missing_in_reference")]
        if one_sided:  # (no arithmetic makes a gradient appear or vanish)
            only = sum(d.status == "missing_in_reference" for d in one_sided)
            out.append(Explanation(
                "other_parameters",
                f"{len(one_sided)} parameter(s) get a gradient in one run only ({only} only with AC, "
                f"{len(one_sided) - only} only without it: {', '.join(d.name for d in one_sided[:4])}"
                f"{' ...' if len(one_sided) > 4 else ''}): no rounding does that; the graphs the backward ran on "
                "reached "
                "other parameters: requires_grad changed between a forward and its backward (a freezing schedule; "
                "with use_reentrant=True the recompute builds the graph with the setting of the backward's time), or "
                f"the two runs trained other parameters (a model re-created, a parameter replaced); {where}",
                parameters=[d.name for d in one_sided[:20]],
                fix="change requires_grad between steps (after optimizer.step(), before the next forward)"))
        elif compared and all(r.status == CLEAN for r in regions if r.unchecked_reason not in _NO_GRADIENT_THROUGH):
            flag = next((r.state_changes["deterministic"] for r in regions if "deterministic" in r.state_changes), None)
            reentrant = sum(1 for r in compared if getattr(r, "kind", None) == "reentrant")
            out.append(Explanation(
                "backward_kernels",
                "every checkpointed region's recompute reproduced its saved tensors exactly, so the backward got the "
                "same tensors as without AC: gradients that still differ come from the backward's own arithmetic, a "
                "nondeterministic kernel (atomic adds in the backward of index_add_, scatter_add_, index_put_ with "
                "accumulate: from one run to the next, with or without AC) or another order of summing a parameter's "
                "gradient contributions in the graph AC builds (rounding only)"
                + (f"; deterministic algorithms were {flag['forward']!r} in the forward and {flag['recompute']!r} in "
                   "the backward" if flag else "")
                + (f"; {reentrant} of the regions are reentrant (use_reentrant=True): each runs its backward as a "
                   "backward of its own, whose sums land in another order than in the step's graph" if reentrant
                   else "") + f"; {where}",
                parameters=[d.name for d in step.differing[:20]],
                fix=("use_reentrant=False (`ac-diff run --non-reentrant` tries it): the backward of a non-reentrant "
                     "region runs in the step's own graph, in the order a run without AC sums; " if reentrant else "")
                + "torch.use_deterministic_algorithms(True) for the whole step (`ac-diff run --deterministic` runs "
                  "both with it): differences that remain are rounding in the order of the sums"))
        else:
            out.append(Explanation(
                "unexplained",
                f"the recompute matched the forward and ac-diff saw no side output or input without grad; {where}",
                parameters=[d.name for d in step.differing[:20]]))
    return out


# regions that give no gradient, so none of the gradients compared: never reached by a backward, evaluation passes,
# nested reruns compared as the region they re-run
_NO_GRADIENT_THROUGH = (NOT_REACHED, NO_GRAD_CALL, NESTED_RERUN)


def _finding_text(f: dict[str, Any]) -> str:
    if f["kind"] == "no_grad_inputs":
        params = f["parameters"]
        return (f"reentrant region {f['region']}: none of its inputs requires grad, so its {len(params)} parameter(s) "
                f"get no gradient ({', '.join(params[:6])}{', ...' if len(params) > 6 else ''})")
    return (f"{f['op']} in {f.get('module') or f['region']}" + (f" ({f['source']})" if f.get("source") else "")
            + f", {list(f['shape'])}, is made inside reentrant region {f['region']} and leaves it through "
            f"{f['holder']}, not through the region's outputs: under use_reentrant=True it has requires_grad=False, "
            "so what the script computes from it (an aux loss) adds no gradient")


def _num(x: float | None) -> str:
    return "?" if x is None else f"{x:.3g}"


def _state_read_again_settled(report: Any, result: ReferenceResult) -> None:
    """Regions that reproduced their forward, held unchecked because their code reads Python state the recompute
    updates a second time: where the gradients differ from the run without AC, they diverged (silently); where they
    match over the compared steps, a note says so (the state may matter only in a later step: a threshold). Per rank:
    gradients that are another rank's figures (reduced across ranks) and that rank diverged say nothing of this one."""
    at_risk = [r for r in report.regions if r.unchecked_reason == STATE_READ_AGAIN]
    made = backwards_recorded(report.regions, getattr(report, "watch", None))
    own = _own_differences(report, result)
    # the same modules' regions of later steps, held clean (their recompute reproduced the forward, which read the
    # state the earlier ones left twice updated): from the first backward that differs, they computed other gradients
    reading = {(r.rank, r.module): r for r in reversed(at_risk)}
    if result.verdict == DIFFERS:
        for r in report.regions:
            origin, first = reading.get((r.rank, r.module)), own.get(r.rank)
            if r.status == CLEAN and origin is not None and first is not None and (recomputed_in(r) or 0) >= first:
                r.status, r.silent = DIVERGED, True
                r.cause, r.suggestions = origin.cause, list(origin.suggestions)
                r.notes.append(f"its recompute reproduced its forward, but the forward read `{origin.cause.tensor}` "
                               "as the earlier steps' recomputes left it, updated twice: the run without AC has other "
                               f"gradients from backward {first}")
    # those recomputed before the first backward whose gradients differ computed right: the state they left twice
    # updated changed a later one (a threshold), which diverged, unless no region says so (never clean)
    later = [r for r in at_risk if r.rank in own and (recomputed_in(r) or 0) >= own[r.rank]]
    if result.verdict == DIFFERS and own and not later and not any(r.status == DIVERGED for r in report.regions):
        later = [r for r in at_risk if r.rank in own]
    for r in at_risk:
        if result.verdict == DIFFERS and r.rank not in own:
            r.notes.append(f"the gradients on rank {r.rank} differ from the run without AC only as another rank's do "
                           "(reduced across ranks), whose diverged regions explain them: they say nothing of this "
                           "region, whose code reads state updated twice under AC")
        elif result.verdict == DIFFERS and r not in later:
            r.notes.append(f"its own gradients match the run without AC (backward {recomputed_in(r)}); the state its "
                           f"code reads, updated twice under AC, changed what backward {own[r.rank]} computed")
        elif result.verdict == DIFFERS:
            r.status, r.silent, r.unchecked_reason = DIVERGED, True, None
            r.notes.append("the run without AC has other gradients: the state its code reads, updated twice under "
                           "AC, changed what it computed")
        elif result.verdict == IDENTICAL and result.backwards >= max(2, made):  # (step 2 reads what step 1 left)
            r.status, r.unchecked_reason, r.suggestions = CLEAN, None, []
            r.notes.append(f"the gradients match the run without AC over all {result.backwards} backward passes: the "
                           "state its code reads, updated twice under AC, did not change what it computed")
        elif result.verdict == IDENTICAL and result.backwards >= 2:  # (a counter may cross its threshold later)
            r.notes.append(f"the gradients match the run without AC over {result.backwards} of the {made} backward "
                           "passes this run made: the state its code reads, updated twice under AC, may change what a "
                           f"later one computes (past a threshold): compare them all (--reference-steps {made})")
        elif result.verdict == IDENTICAL:
            r.notes.append("the gradients match the run without AC over 1 backward pass, before the state updated "
                           f"twice is read again: compare 2 or more (--reference-steps {max(3, made)})")
    if at_risk and report.verdict == UNCHECKED and all(r.status == CLEAN for r in report.regions) \
            and not report.crashed:
        report.verdict = CLEAN
        report.headline = (f"clean: all {len(report.regions)} recomputed region(s) reproduced their saved tensors "
                           f"exactly; the state {len(at_risk)} of them update twice under AC did not change "
                           f"the gradients over all {result.backwards} backward passes (they match the run without "
                           "AC)" + held_choice_note(report.regions))


def _own_differences(report: Any, result: ReferenceResult) -> dict[int, int]:
    """rank -> the first backward (from 1) whose gradients differ from the run without AC on that rank for a reason
    of its own: not where another rank has a region that diverged by then, whose error the reduction across ranks
    brings in (DDP's all-reduce hands every rank the same figures; FSDP's reduce-scatter each rank its shard of them,
    so the figures differ and say nothing either way)."""
    diverged: dict[int, int] = {}
    for r in report.regions:
        if r.status == DIVERGED:
            backward = recomputed_in(r) or 1
            diverged[r.rank] = min(diverged.get(r.rank, backward), backward)
    own: dict[int, int] = {}
    for s in sorted(result.steps, key=lambda s: s.step):
        if not s.differing or s.rank in own:
            continue
        carried = any(rank != s.rank and first <= s.step + 1 for rank, first in diverged.items())
        if not carried:
            own[s.rank] = s.step + 1
    return own


def _side_outputs_settled(report: Any, result: ReferenceResult) -> None:
    """Regions whose recompute reproduced their forward, held unchecked only for a side output that could have fed a
    loss (diagnosis/region.py `_side_outputs`), once the gradients are compared: where they differ and the reference
    saw the side output, the region diverged (silently); where they match, none fed a loss: they are clean, and so
    is the run where nothing else kept it unchecked."""
    at_risk = [r for r in report.regions if r.unchecked_reason == SIDE_OUTPUT]
    if not at_risk:
        return
    asked = "`ac-diff run --reference no-ac` compares the gradients"
    if result.verdict == DIFFERS:
        seen = {e.region for e in result.explanations if e.kind == "side_output"}
        for r in at_risk:
            if r.module in seen:
                r.status, r.silent, r.unchecked_reason = DIVERGED, True, None
                r.notes = [n.replace(asked, "the run without AC has other gradients: diverged") for n in r.notes]
        return
    if result.verdict != IDENTICAL:
        return
    for r in at_risk:
        r.status, r.unchecked_reason, r.cause, r.suggestions = CLEAN, None, None, []
        r.notes = [n for n in r.notes if "other than through its outputs" not in n]
        r.notes.append("its forward handed out tensors other than through its outputs, but the gradients match the run "
                       "without AC: no loss is computed from them")
    if report.verdict == UNCHECKED and all(r.status == CLEAN for r in report.regions) and not report.crashed:
        report.verdict = CLEAN
        report.headline = (f"clean: all {len(report.regions)} recomputed region(s) reproduced their saved tensors "
                           f"exactly; the tensors {len(at_risk)} reentrant region(s) handed out other than through "
                           "their outputs feed no loss (the gradients match the run without AC)"
                           + held_choice_note(report.regions))


def _reordered_settled(report: Any, result: ReferenceResult) -> None:
    """A run whose only divergences are top-k choices made again in another order (the same entries: a sum weighted
    by their scores does not see the order) and whose gradients match the run without AC over every backward pass it
    made: those regions' recomputes saved other tensors that reach no gradient. They are clean, with a note, their
    cause and its fix kept (what moved the scores may flip a choice in another step); so is the run."""
    diverged = [r for r in report.regions if r.status == DIVERGED]
    made = backwards_recorded(report.regions, getattr(report, "watch", None))
    # (fewer compared than made: enough where every diverged region was recomputed in a compared one, the later ones
    # all reproduced their saved tensors)
    uncompared = result.backwards < made and (diverged_after(report.regions, result.backwards)
                                              or (report.watch or {}).get("unwritten"))
    if not diverged or result.verdict != IDENTICAL or uncompared or report.torch_errors \
            or report.verdict != DIVERGED or report.crashed or (report.watch or {}).get("never_compared") \
            or any(r.status == UNCHECKED for r in report.regions):
        return
    flips = [_reordered_flip(r, report.regions) for r in diverged]
    if any(flip is None for flip in flips):
        return
    over = f"all {result.backwards}" if result.backwards >= made else f"the {result.backwards} compared"
    for r, flip in zip(diverged, flips):
        r.status, r.silent = CLEAN, False
        r.notes.append(f"its recompute chose the same top-k entries in another order ({flip.summary}"
                       + (", as its module's recording in full shows" if flip is not r.first_discrete_divergence
                          else "") + f"): the gradients match the run without AC over {over} backward passes, so "
                       "nothing this run computes uses that order")
    report.verdict = CLEAN
    report.headline = (f"clean: the gradients match the run without AC over {over} backward passes; the "
                       f"recompute of {len(diverged)} region(s) chose the same top-k entries in "
                       "another order (other saved tensors, which torch does not check), and nothing uses that "
                       "order" + (f"; the regions of the {made - result.backwards} later backward pass(es) reproduced "
                                  "their saved tensors exactly" if result.backwards < made else "")
                       + (f"; what moved the scores ({diverged[0].cause.kind}) may flip a choice in "
                          "another step: see its fix" if diverged[0].cause is not None else ""))


def _reordered_flip(r: RegionReport, regions: list[RegionReport]) -> Divergence | None:
    """The top-k choice `r`'s recompute made in another order (the same entries); for a watched region (saved tensors
    only, no ops), the one its module's recording in full shows (the escalation after it, or a step recorded in
    full), if that recording diverged only so."""
    flip = r.first_discrete_divergence
    if flip is not None or not r.watched:
        return flip if flip is not None and flip.reordered_only else None
    full = [x.first_discrete_divergence for x in regions if not x.watched and x.status == DIVERGED
            and (x.rank, x.module, x.path) == (r.rank, r.module, r.path)]
    return full[0] if full and all(f is not None and f.reordered_only for f in full) else None


def attach(report: Any, result: ReferenceResult) -> None:
    """The report carries the reference section; gradients that differ make it not clean."""
    report.reference = result
    before = {id(r): r.status for r in report.regions}
    _settle(report, result)
    restate_ranks(report, before)


def _settle(report: Any, result: ReferenceResult) -> None:
    """attach's work on the report: regions and verdict settled by the comparison."""
    asked = re.escape(REPEATED_ASK).replace(re.escape("{n}"), r"(\d+)")
    if result.verdict == IDENTICAL and (hit := re.search(asked, report.headline)) and result.backwards >= int(hit[1]):
        report.headline = report.headline.replace(hit[0], f" (the gradients match the run without AC over "
                                                          f"{result.backwards} backward passes)")
    if result.verdict in (IDENTICAL, DIFFERS) and REENTRANT_BACKWARD in report.notes:  # (the comparison it asks for ran)
        report.notes[report.notes.index(REENTRANT_BACKWARD)] = REENTRANT_BACKWARD.split("; `ac-diff run")[0] + (
            "; the comparison with the run without AC below says whether they do")
    _side_outputs_settled(report, result)
    _state_read_again_settled(report, result)
    _reordered_settled(report, result)
    if not result.defect:
        return
    if report.verdict != DIVERGED:  # (AC inside compiled graphs: what they show stays in the headline)
        report.headline = result.headline + (f"; {report.headline}" if unrecorded(getattr(report, "compiled", None))
                                             else "")
    else:
        report.headline = f"{report.headline}; {result.headline}"
    report.verdict = DIVERGED
