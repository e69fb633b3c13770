"""Name the class of cause behind a region's divergence, the chain from cause to symptom, and the fix.

    explain(report, region, cmp)
    report.cause   -> Cause(kind="state_mutation", tensor="layers.1.moe.router.expert_bias", ...)
    report.chain   -> ["`layers.1.moe.router.expert_bias` changed between forward and recompute",
                       "aten.add.Tensor in layers.1.moe.router (tiny_moe.py:57) computes different values",
                       "aten.topk.default flipped 1 of 256 rows (margin 3.1e-04)", ...,
                       "saved positions 37, 38 differ in shape -> CheckpointError"]

Order of precedence, each needing its evidence: a tensor read by the region changed (state_mutation;
most parameters at once: an optimizer step, mechanism optimizer_step; a tensor made from host data in the
region: host randomness, rng/host_rng), a parameter that is empty in recompute (sharded_parameter), a random
op drew other numbers (rng: default_generator, or private_generator when it was handed a torch.Generator),
global dispatch state differs (global_state; also on a region whose values matched, where a flag that chooses
kernels differed: `explain_flags`), the op sequence changed before any value did (control_flow),
a Python argument changed (state_mutation/python_value), an op gave other outputs from identical inputs
(nondeterministic_op), else unknown. The chain's steps are producer links (dataflow.data_path).
"""

from __future__ import annotations

import re
from dataclasses import replace

from ..stateflags import KERNEL_FLAGS, first_flag, flag_label
from ..capture.opinfo import draws, op_info
from ..oprules import (CAST, COMPILED_GRAPH_OP, aliases_its_input, is_attention_kernel, is_collective, is_decision,
                       is_host_read, is_in_place_method, is_random_name, is_view_op, op_by_name, packet,
                       written_inputs)
from ..passes import External, OpRecord, Pass, Region, TensorMeta, op_at
from ..report import (ARGUMENT_ITEMS, CACHE_HIT, ENCLOSING_RECOMPUTE, GRAD_MODE, HOOKS, KEPT_OUTPUT_WRITTEN, LAZY_INIT,
                      ONE_PASS_DRAW, PRECISION, REBOUND, REQUIRES_GRAD, SAVED_HOOKS, UPDATED_IN_FORWARD, Cause,
                      Divergence, RECEIVED, RegionReport)
from .attributes import attribute_cause, change_words, saved_before_any_op
from .compiled import EAGER_RUN
from .passdiff import (ARGUMENT_KINDS, PassComparison, is_discrete, is_outside_update, viewed_source, writer_in,
                       written_refs)
from .dataflow import data_path, decision_path, upstream
from .labels import backticked, branch_sites, changed_line, fingerprint_pair, number_ranges, readable_arg, where
from .suggest import suggestions_for


def explain(report: RegionReport, region: Region, cmp: PassComparison, torch_version: str | None = None) -> None:
    report.cause = _cause(report, region, cmp)
    report.chain = _chain(report, region, cmp)
    report.suggestions = suggestions_for(report, region, torch_version)


# what a log's CheckpointError alone tells where its traceback ran through torch.compile's code (TorchError.compiled)
RECOMPILED = ("its traceback runs through torch.compile's code: the recompute may have run another compiled graph "
              "than the forward (a guard on a Python value or a shape that changed between them picks another one; "
              "torch's hint in the log, pytorch issue 166926)")
SHARDED = ("tensors recomputed with shape [0]: parameters were not gathered in the recompute "
           "(ZeRO-3 / FSDP frees them after the forward)")
# what the metadata alone says (a log, a watched region): a batch norm saves the same [0] statistics in eval mode
EMPTIED = (SHARDED + "; or a batch norm's saved statistics, where the module switched to eval mode between the forward "
           "and the backward (eval saves them empty)")

# ... where the emptied tensors look like a batch norm's saved statistics (consecutive pairs of one 1-D size)
EMPTIED_NORM = ("tensors recomputed with shape [0], in pairs of one size: a batch norm's saved mean and inverse std, "
                "where the module switched to eval mode between the forward and the backward (eval saves them empty); "
                "or parameters not gathered in the recompute (ZeRO-3 / FSDP frees them after the forward)")


def emptied(rows: list) -> str:
    """What tensors recomputed empty suggest (`rows` as for sharded_positions): a batch norm's statistics first
    where they come as consecutive pairs of 1-D tensors of one size, as its mean and inverse std are saved."""
    hit = sorted((p.position, p.saved) for p in sharded_positions(rows) if p.position is not None)
    one_dim = all("," not in saved.split("[", 1)[-1] for _, saved in hit)
    paired = len(hit) % 2 == 0 and all(a[0] + 1 == b[0] and a[1] == b[1] for a, b in zip(hit[::2], hit[1::2]))
    return EMPTIED_NORM if hit and one_dim and paired else EMPTIED


DTYPE_ONLY = ("every position torch named kept its shape and changed its dtype ({change}): a precision setting the "
              "region reads differs between the forward and the recompute (an autocast region's `enabled` or dtype, "
              "or a dtype attribute or global that a schedule changed before the backward)")

_MADE_IN_THE_REGION = ("op", "saved", "output")  # position origins of tensors the region computed


def sharded_positions(rows: list) -> list:
    """Rows (with `saved` / `recomputed` metadata text like "f32[4096]") recomputed with shape [0] but
    saved with another: a parameter a ZeRO-3 / FSDP wrapper freed after the forward. Not a tensor the region
    computed (a batch norm in eval mode saves [0]-shaped statistics; watch names no state to say so)."""
    return [p for p in rows if p.recomputed and p.recomputed.endswith("[0]") and p.saved
            and not p.saved.endswith("[0]") and getattr(p, "origin", None) not in _MADE_IN_THE_REGION]


def _grad_mode_flipped(region: Region) -> bool:
    """A reentrant region whose forward ran without autograd and whose recompute with it (as use_reentrant=True
    runs them): code branching on grad mode sees two answers."""
    fwd, rec = region.forward, region.recompute
    return region.kind == "reentrant" and fwd is not None and rec is not None and \
        fwd.state.get("grad_enabled") is False and rec.state.get("grad_enabled") is True


def dtype_only(rows: list) -> str | None:
    """"f32 -> bf16" where every row (`saved` / `recomputed` metadata text like "f32[4, 8]") whose metadata changed
    kept its shape and changed its dtype, to one and the same dtype; else None."""
    changed = [(p.saved.split("[", 1), p.recomputed.split("[", 1)) for p in rows if p.saved and p.recomputed
               and p.saved != p.recomputed]
    if not changed or any(len(a) != 2 or len(b) != 2 or a[1] != b[1] or a[0] == b[0] for a, b in changed):
        return None
    pairs = {(a[0], b[0]) for a, b in changed}
    return f"{', '.join(sorted(a for a, _ in pairs))} -> {changed[0][1][0]}" if len({b for _, b in pairs}) == 1 \
        else None


# A GPU recording fingerprints outputs in batches, up to 64 ops after they are made (capture/fused_prints.py)
_HELD_NOTE = ("; on a GPU also a kernel outside torch's dispatch, a raw Triton or extension kernel, that wrote its "
              "output in place within 64 ops of it: the output's fingerprint is read then")


def _on_gpu(region: Region, value: Divergence) -> bool:
    """The op of divergence `value` wrote a CUDA tensor in the forward (its outputs were fingerprinted in batches)."""
    ops = region.forward.ops if region.forward is not None else []
    i = value.forward_index
    return i is not None and 0 <= i < len(ops) and any(
        m.device.startswith("cuda") for _, m in ops[i].tensor_outputs())


def _cause(report: RegionReport, region: Region, cmp: PassComparison) -> Cause:
    value = report.first_value_divergence
    control = report.first_control_divergence
    shape = report.first_shape_divergence
    changed = report.changed_inputs

    flags = {k: v for k, v in report.state_changes.items() if k != "rng"}
    sharded = sharded_positions(report.positions)
    if sharded and not changed and not flags:  # (eval mode also saves [0]-shaped batch-norm statistics)
        names = sorted({p.name or p.op or "?" for p in sharded})
        return Cause("sharded_parameter", names[0], SHARDED,
                     [f"position {p.position}: saved {p.saved}, recomputed {p.recomputed}" for p in sharded[:5]])

    if "training" in flags:  # the modules' mode flipped: what batch norm reads and updates follows from it
        return _global_state_cause(flags, "training")

    kept = _kept_output_changed(region, cmp)  # before any branch the cache made: it reproduces where unchanged
    if kept is not None:
        return kept
    rebound = _rebound_state(region, changed)  # (before the cache: the recompute may read its own forward's output)
    if rebound is not None:
        return rebound
    cached = _cache_skipped_saves(region, cmp)
    if cached is not None:  # (a skipped op that drew: what made a later draw differ is the generator's offset)
        random_op = _first_random_divergence(cmp)
        return (_drawn_in_one_pass(region, cmp, random_op) if random_op is not None else None) or cached
    frozen = _requires_grad_changed(region) or _trainable_changed(flags)
    if frozen is not None:
        return frozen
    given = _argument_items_changed(flags.get("arguments"))
    if given is not None:
        return given

    if "default_dtype" in flags and _made_in_default_dtype(cmp):  # torch.tensor([...]) made in another dtype
        return _global_state_cause(flags, "default_dtype")

    first = cmp.first_divergence()
    feeding = set(first.sources) if first is not None else set()
    saved_changed = {p.name for p in report.positions if p.origin != "op" and p.values_differ}
    saved_changed |= _saved_updates(report, region) | _saved_views(report, region)
    reaching = _reaching_saved(report, cmp)
    relevant = [c for c in changed if c["name"] in feeding or c["name"] in saved_changed or c["name"] in reaching]
    initialized = _initialized_in_forward(region, cmp)  # (before "updated in place": the init wrote them)
    if initialized is not None:
        return initialized
    # (after a lazy module's init, whose hook removes itself after the forward); a hook swapped for one that runs the
    # same ops (pruning again: a PruningContainer for the first method) only where no state read explains the values
    if "hooks" in flags and (not changed or control is not None or shape is not None or report.watched):
        return _hooks_changed(flags["hooks"])
    stepped = _whole_model_update(region, changed)
    if stepped is not None and relevant:
        return stepped
    if relevant:
        # prefer what reaches a saved tensor that differs (what backward reads), then model state (buffer/parameter)
        # over an input, then the first one read
        ranked = sorted(relevant, key=lambda c: (c["name"] not in reaching, c["kind"] not in ("buffer", "param"),
                                                 c.get("first_op") or 0))
        top = ranked[0]
        evidence = [changed_line(c, "forward", "recompute") for c in ranked[:4]]
        made = _made_from_host(region, top["name"]) if top["kind"] == "external" else None
        if made is not None:
            # (a Python value that changed before the host code ran steers what it computes: a matcher's cost weight
            # annealed by a counter the recompute advances again, handed to scipy; not a draw)
            earlier = first is not None and first.forward is not None and first.forward.index < made.index
            return (earlier and attribute_cause(region, first)) or _host_rng_cause(made, evidence)
        what = {"buffer": "buffer", "param": "parameter", "input": "region input", "external": "captured tensor"}
        writer = _in_place_writer(region, top["name"])
        if writer:
            evidence.append(f"modified in place by {writer[0]} ({writer[1]})")
        detail = (f"the {what.get(top['kind'], 'tensor')} `{top['name']}` has other values in the recompute than in "
                  + ("the forward: the region's own forward updates it in place "
                     f"({writer[0]}), so the recompute reads it after that update"
                     + (" and applies it a second time" if writer_in(region.recompute, top["name"]) else
                        " (the recompute stops before its own update: torch's early stop ends it at the last "
                        "saved tensor)" if region.recompute is not None and region.recompute.stopped_early else
                        " (the recompute does not update it again)")
                     if writer and writer[1] == "forward" else
                     "the forward: it was modified between the forward and the backward"))
        if top["kind"] == "input":
            hooked = _through_saved_hooks(region, top["name"], evidence)
            if hooked is not None:
                return hooked
            others = [c["name"] for c in changed if c["kind"] == "input" and c["name"] != top["name"]]
            detail = (f"the region's {top['name']}" + (f" (and {', '.join(others)})" if others else "")
                      + f" {'were' if others else 'was'} modified in place after the forward (the recompute reads the "
                      "modified tensor)")
        in_forward = bool(writer and writer[1] == "forward")
        names = [] if top["kind"] == "input" else _module_state(top["name"], changed)
        if in_forward:  # a restore must cover all the state the region updates (spectral norm's _u with its _v)
            names = list(dict.fromkeys([*names, *_updated_state(cmp)]))
        return Cause("state_mutation", top["name"], detail, evidence,
                     mechanism=UPDATED_IN_FORWARD if in_forward else
                     {"input": "input", "param": PARAMETER}.get(top["kind"], "tensor"), names=names)

    # a kernel setting changed (the CPU threads a reduction splits over) and the first op to differ read identical
    # tensors and arguments: no Python value reached it, whatever Python state also changed (a harness's phase flag)
    kernel = [k for k in flags if k in KERNEL_FLAGS]
    if kernel and value is not None and value.detail.get("inputs_identical") and not (
            control or report.first_argument_divergence or set(value.detail.get("differs") or ()) - {"value"}):
        return _global_state_cause(flags, first_flag(kernel))
    drew = region.forward.state.get("host_draws") if region.forward is not None else None
    attribute = attribute_cause(region, first, drew=bool(drew))  # a module's Python attribute (a step counter) changed
    if attribute is not None:
        return attribute

    rng = report.state_changes.get("rng")
    random_op = _first_random_divergence(cmp)
    if random_op is not None:
        return _drawn_in_one_pass(region, cmp, random_op) or _rng_cause(random_op, region, rng)

    # the first op to differ read other tensors than its twin though none it read had diverged: Python handed it
    # others (a shuffled list of chunks, a random pick)
    rewired = report.first_value_divergence if first is not None and first.inputs_same is False and not first.sources \
        and not changed else None
    steered = control or report.first_argument_divergence or shape or rewired
    if drew and steered is not None:  # the host's random numbers steered Python: a branch, a value passed on
        return _host_draw_cause(drew, steered, region.forward.state.get("host_draw_sites") or [])

    if flags:
        return _global_state_cause(flags, first_flag(flags))

    # from a log (no values): only without a data-dependent decision, and before any shape divergence
    # (spliced lines can fake a sequence change)
    log_control = (control is not None and not report.has_values and report.first_discrete_divergence is None
                   and (shape is None or _before(control, shape)))
    if control is not None and (report.has_values or log_control) and (
            value is None or (control.forward_index or 0) <= (value.forward_index or 0)
                                or control.recompute_index is not None and value.recompute_index is not None
                                and control.recompute_index <= value.recompute_index):
        ran = f"the recompute ran a different sequence of ops from {branch_sites(region, control)} before any " \
            "value differed: "
        kernels = _other_attention_kernel(cmp) if not report.has_values else None
        if kernels is not None:  # (a trace records the setting itself: its flags say it)
            return Cause("global_state", "sdp_backends",
                         f"scaled_dot_product_attention ran {kernels} ({branch_sites(region, control)}): the SDPA "
                         "backends differed between the passes (`torch.nn.attention.sdpa_kernel` entered around the "
                         "forward only, or `torch.backends.cuda.enable_*_sdp` changed before the backward)",
                         [control.summary])
        if _grad_mode_flipped(region):
            return Cause("control_flow", control.op,
                         ran + "under use_reentrant=True the forward runs with autograd off (torch.no_grad) and the "
                         "recompute with it on, so code that branches on torch.is_grad_enabled() (an inference fast "
                         "path) or on a tensor's requires_grad / grad_fn takes the other branch in the recompute",
                         [control.summary, "grad mode: off in the forward, on in the recompute (use_reentrant=True)"],
                         mechanism=GRAD_MODE, source=control.source)
        paired = (op_at(region.forward, control.forward_index), op_at(region.recompute, control.recompute_index))
        casts = dtype_only(report.positions) if any(op is not None and op.op == CAST for op in paired) else None
        if casts:  # (autocast on in one pass: it casts the weights before each matmul, the other pass does not; a
            # `.to(dtype)` whose dtype a schedule changed: a no-op in one pass, a cast in the other)
            return Cause("global_state", PRECISION,
                         f"the {'recompute' if paired[1] is not None and paired[1].op == CAST else 'forward'} ran "
                         f"dtype casts the other pass did not, and {DTYPE_ONLY.format(change=casts)}", [control.summary],
                         source=control.source)
        return _bound_since(region, control) or Cause("control_flow", control.op,
                                                      ran + "Python code took another branch", [control.summary])

    if (report.has_values and first is not None and first.kinds & ARGUMENT_KINDS
            and "shape" not in first.kinds and first.inputs_same and first.forward is not None):
        op = first.forward
        if op.op == COMPILED_GRAPH_OP and first.recompute is not None and op.args[:1] != first.recompute.args[:1]:
            return Cause("control_flow", op.op,
                         f"the recompute ran another compiled graph ({op.args[0]} in the forward, "
                         f"{first.recompute.args[0]} in the recompute) at {where(op.module, op.source)}: Dynamo "
                         "compiled the code again between the passes because a guard failed, on Python state the "
                         "code reads (a module attribute, a global, a flag) that changed before the backward; "
                         f"`{EAGER_RUN} ...` runs it eagerly and names that value",
                         [d.summary for d in (report.first_argument_divergence,) if d is not None],
                         source=op.source)
        return Cause("state_mutation", f"an argument of {op.op}",
                     f"a Python value passed to {op.op} at {where(op.module, op.source)} changed between the forward "
                     "and the recompute (identical tensors in): Python state the region reads, a schedule or a float "
                     "attribute, was updated before the backward, or the value is drawn on the host inside the region "
                     "(np.random, random: not covered by preserve_rng_state)",
                     [d.summary for d in (report.first_argument_divergence, report.first_shape_divergence)
                      if d is not None], mechanism="python_value", source=op.source)

    own = _own_state_read(region, cmp, value) if value is not None and value.detail.get("inputs_identical") else None
    if own:  # (its inputs read as identical: state the region updates itself counts as a side effect)
        op = region.forward.ops[value.forward_index]
        return Cause("state_mutation", own[0],
                     f"{value.op} at {where(op.module, op.source)} reads and updates `{own[0]}` in place (an "
                     "observer's running range, a running statistic it computes with): the region's own forward "
                     "updates it, so the recompute starts from the updated state and computes other values",
                     [f"{value.op} writes {', '.join(f'`{n}`' for n in own)}",
                      *(f"{name}: other values when the recompute read it" for name in own[:3])],
                     mechanism=UPDATED_IN_FORWARD, source=op.source,  # (a restore covers every such state)
                     names=list(dict.fromkeys([*own, *_updated_state(cmp)])))

    if shape is not None and shape.detail.get("inputs_identical") and _grad_mode_flipped(region):
        return Cause("control_flow", shape.op,
                     f"{shape.op} at {where(shape.module, shape.source)} returned other outputs from identical inputs "
                     f"({shape.summary}): under use_reentrant=True the forward runs with autograd off and the "
                     "recompute with it on, and its kernel takes another path with autograd on (a training kernel "
                     "that keeps a workspace for the backward, as a CPU LSTM's), which computes other values",
                     [shape.summary, "grad mode: off in the forward, on in the recompute (use_reentrant=True)"],
                     mechanism=GRAD_MODE, source=shape.source)

    if value is not None and value.detail.get("inputs_identical") and _inputs_measured(region.forward,
                                                                                       value.forward_index):
        return Cause("nondeterministic_op", value.op,
                     f"{value.op} returned other values from identical inputs (a nondeterministic kernel"
                     + (_HELD_NOTE if _on_gpu(region, value) else "") + ")",
                     [f"{value.op} at {where(value.module, value.source)}"])

    if rewired is not None:
        return Cause("control_flow", rewired.op,
                     f"the recompute passed {rewired.op} at {where(rewired.module, rewired.source)} other tensors than "
                     "the forward did, none of which had diverged: Python chose them (a list in another order, "
                     "another pick), from state that changed between the passes or a draw no recorded generator "
                     "shows", [rewired.summary])

    if not report.has_values and shape is not None:
        from_log = _log_cause(region, shape) or _log_python_argument(region, shape)
        if from_log is not None:
            return from_log
        decision = report.first_discrete_divergence
        detail = ("a log shows where the shapes diverged, not why: the values that led there are not in it"
                  + (f"; the sizes come from the data-dependent decision {decision.op}" if decision else ""))
        return Cause("unknown", decision.op if decision else shape.op, detail, [shape.summary])
    lead = value or shape
    received = _received_through(region, lead) if lead is not None else None
    if received is not None:  # (diagnosis gives it the cause of a rank that explains the region: _through_collectives)
        return Cause("unknown", received.op,
                     f"{lead.op} at {where(lead.module, lead.source)} computes with what {received.op} at "
                     f"{where(received.module, received.source)} received from the other ranks, whose values this "
                     "rank's trace does not measure: a divergence on another rank reaches this one through it",
                     [d.summary for d in (value, shape, control) if d is not None], mechanism=RECEIVED,
                     source=received.source)
    saved_other = saved_before_any_op(region) if report.has_values else None
    if saved_other is not None:  # (no Python state recorded explains it: a branch on what no recorder sees)
        return Cause("control_flow", None, f"the recompute saved other tensors than the forward before it ran any op "
                     f"({saved_other}): Python code took another branch, on state no recorded value shows",
                     [saved_other])
    unmeasured = report.has_values and not any(o.fingerprint for o in region.forward.ops)
    return Cause("unknown", value.op if value else None, "no recorded evidence explains the divergence" + (
                     ": the run was recorded without values (--no-fingerprints), so which inputs changed between the "
                     "passes is not measured; record it again without that option" if unmeasured else ""),
                 [d.summary for d in (value, shape, control) if d is not None])


def _other_attention_kernel(cmp: PassComparison) -> str | None:
    """Where one pass ran a fused attention kernel the other did not (the math decomposition, or another kernel): "the
    math decomposition in the forward and _scaled_dot_product_flash_attention_for_cpu in the recompute"; else None."""
    ran = [{o.op for o in ops if o.index in unpaired and is_attention_kernel(o.op)} for ops, unpaired in (
        (cmp.forward_ops, {p.forward for p in cmp.pairs if p.how != "match"}),
        (cmp.recompute_ops, {p.recompute for p in cmp.pairs if p.how != "match"}))]
    if ran[0] == ran[1]:
        return None
    forward, recompute = (", ".join(sorted(packet(op) for op in names)) or "the math decomposition" for names in ran)
    return f"{forward} in the forward and {recompute} in the recompute"


def _received_through(region: Region, lead: Divergence) -> OpRecord | None:
    """The collective (an all_reduce, an all_to_all) the forward op `lead` depends on, if any: one it reads, or one that
    wrote in place, before it, a tensor it reads (`allreduce_` fills the tensor the next op reads)."""
    ops, target = _forward_op(region, lead.forward_index)
    if target is None:
        return None
    feeding = {target.index, *(o.index for o in upstream(ops, target))}
    return next((o for o in ops if o.index < target.index and is_collective(o.op) and (
        o.index in feeding or any(w.kind == "op" and w.op_index in feeding
                                  for w in written_inputs(o.op, o.args, o.input_refs)))), None)


# Where host data becomes a tensor inside the region: torch.tensor / torch.as_tensor / torch.from_numpy
# hand the host-made tensor to lift_fresh, the first op that sees it
_HOST_ENTRY_OPS = ("aten.lift_fresh.default", "aten.lift_fresh_copy.default", "aten.lift.default")


# why torch says nothing of a reentrant region's recompute, whatever it saved
_REENTRANT_UNCHECKED = "use_reentrant=True: torch checks no recompute's saved tensors against its forward's"


def _reaching_saved(report: RegionReport, cmp: PassComparison) -> set[str]:
    """The changed outside tensors that reach a saved position that differs (through the ops that made it)."""
    bad = {p.forward_index for p in report.positions
           if p.origin == "op" and (p.values_differ or p.matches is False) and p.forward_index is not None}
    return {name for d in cmp.diffs if d.forward is not None and d.forward.index in bad for name in d.sources}


def _made_from_host(region: Region, name: str) -> OpRecord | None:
    """The op where the captured tensor `name` entered the region from host data, if it was made there."""
    for op in region.forward.ops if region.forward is not None else ():
        if op.op in _HOST_ENTRY_OPS and op.input_refs and op.input_refs[0].kind == "external" \
                and op.input_refs[0].name == name:
            return op
    return None


def _made_in_default_dtype(cmp: PassComparison) -> bool:
    """Some tensor the region read has the same values in both passes in another dtype (torch.tensor / torch.arange
    from host numbers, made in the default dtype), or the first op that diverged changed only its dtype."""
    if any(r is not None and f.meta.dtype != r.meta.dtype and f.fingerprint == r.fingerprint
           for f, r in cmp.changed_externals):
        return True
    first = cmp.first_divergence()
    if first is None or first.forward is None or first.recompute is None:
        return False
    outs = [(a, b) for a, b in zip(first.forward.out, first.recompute.out)
            if isinstance(a, TensorMeta) and isinstance(b, TensorMeta)]
    return bool(outs) and any(a.dtype != b.dtype for a, b in outs) and all(a.shape == b.shape for a, b in outs)


def _host_rng_cause(entry: OpRecord, evidence: list[str]) -> Cause:
    at = where(entry.module, entry.source)
    return Cause("rng", f"host value at {entry.source or at}",
                 f"a tensor made from host data inside the region (torch.tensor / torch.from_numpy at {at}) has other "
                 "values in the recompute: the host code drew other numbers. Host randomness (np.random, Python's "
                 "random) is not covered by preserve_rng_state, which restores torch's generators only",
                 [f"{entry.op} at {at} takes the host-made tensor, in both passes", *evidence],
                 mechanism="host_rng", source=entry.source)


def _log_cause(region: Region, shape: Divergence) -> Cause | None:
    """From a log's op lists (shapes, no values): what the forward's first shape divergence depends on that explains
    it. A tensor from outside the region that the region itself updates in place (a router bias a forward hook
    moves): the recompute reads it updated. Else a random op: the recompute drew other numbers."""
    ops, target = _forward_op(region, shape.forward_index)
    # (a forward list the log has from some op on: a tensor whose maker is cut off reads as made outside, and what
    # the chain depends on may be cut off too)
    if target is None or (region.forward.state.get("log_starts_at") or 1) > 1:
        return None
    feeding = upstream(ops, target)
    # tensors from outside whose values the target depends on: read by an op of its chain, not only updated there
    # (a tokens-per-expert counter's add_ feeds nothing)
    read = {r.name for op in [target, *feeding] for k, r in enumerate(op.input_refs)
            if r.kind != "op" and r.name and not (k == 0 and is_in_place_method(op.op))}
    # ...or updated by an op of the chain: the target computes with the updated value (a threshold's EMA, updated and
    # then compared with), which the recompute updates again
    linked = {r.op_index for op in [target, *feeding] for r in op.input_refs if r.kind == "op"}  # (read, not guessed)
    read |= {op.input_refs[0].name for op in feeding if op.index in linked and is_in_place_method(op.op)
             and op.input_refs and op.input_refs[0].kind != "op" and op.input_refs[0].name}
    for op in ops:
        ref = op.input_refs[0] if op.input_refs else None
        if is_in_place_method(op.op) and ref is not None and ref.kind != "op" and ref.name in read:
            at = where(op.module, op.source)
            meta = next((m for m in op.out if isinstance(m, TensorMeta)), None)
            return Cause("state_mutation", ref.name,
                         f"the region updates a tensor made outside it ({f'{meta}, ' if meta else ''}torch's dump calls "
                         f"it {ref.name}) in place, by {op.op} at {at}, and {shape.op} depends on it: the recompute "
                         "reads it after the forward's update (and updates it again)",
                         [f"{op.op} at {at} writes {ref.name}", shape.summary], mechanism=UPDATED_IN_FORWARD,
                         source=op.source)
    drawn = next((op for op in reversed(feeding) if _drew(op)), None)
    if drawn is not None and _generator_arg(drawn) is not None:  # (the dump names the generator it was handed)
        return _rng_cause(drawn, region, None)
    if drawn is not None:
        at = where(drawn.module, drawn.source)
        return Cause("rng", drawn.op,
                     f"{shape.op} depends on the random op {drawn.op} at {at}: the recompute drew other numbers (a "
                     "checkpoint with preserve_rng_state=False, or a generator it does not restore)",
                     [f"{drawn.op} at {at} feeds {shape.op}", shape.summary], source=drawn.source)
    return None


def _drew(op: OpRecord) -> bool:
    """A log's op that drew from a generator: a random op whose arguments do not switch its randomness off (an SDPA
    whose dropout_p the log leaves at its default, 0)."""
    if not is_random_name(op.op):
        return False
    func = op_by_name(op.op)
    return func is None or draws(op_info(func), op.args, {})


def _forward_op(region: Region, index: int | None) -> tuple[list[OpRecord], OpRecord | None]:
    """The forward's ops, and the one at `index` (None if it is not there)."""
    ops = region.forward.ops if region.forward is not None else []
    return ops, op_at(region.forward, index)


def _log_python_argument(region: Region, shape: Divergence) -> Cause | None:
    """From a log: the first shape divergence is an op whose non-tensor arguments changed over inputs of the same
    shapes (topk's k 4 -> 5), and no decision or host read feeds it (split sizes from `counts.tolist()` come from
    data): the value came from Python state that changed before the backward."""
    ops, target = _forward_op(region, shape.forward_index)
    changed = shape.detail.get("args_diff")
    if target is None or not changed or not shape.detail.get("inputs_identical"):
        return None
    if any(is_decision(o.op) or is_host_read(o.op) for o in upstream(ops, target)):
        return None
    at = where(target.module, target.source)
    return Cause("state_mutation", f"an argument of {target.op}",
                 f"a Python value passed to {target.op} at {at} changed between the forward and the recompute "
                 f"({changed}, over inputs of the same shapes): Python state the region reads (a capacity, a k, a "
                 "schedule) was updated before the backward; `ac-diff run` on the script names it",
                 [shape.summary], mechanism="python_value", source=target.source)


def _host_draw_cause(drew: list[str], first: Divergence, sites: list[str]) -> Cause:
    """`sites`: the lines of the region's code that read those generators (the recorder's `host_draw_sites`)."""
    return host_draw_cause(drew, sites, " (its generator moved during the forward), which preserve_rng_state does "
                           "not restore: the recompute drew other numbers, and Python ran another sequence of ops or "
                           f"passed other values from {where(first.module, first.source)}",
                           "the generator's state changed between the start and the end of the forward",
                           [first.summary], first.source)


def drawn_at(drew: list[str], sites: list[str]) -> str:
    """"`random` at model.py:14 in forward": the host generators a region draws from, and where."""
    names = " and ".join(f"`{n}`" for n in drew)
    return names + (f" at {', '.join(sites[:2])}" if sites else "")


def host_draw_cause(drew: list[str], sites: list[str], how: str, moved: str, also: list[str] = (),
                    source: str | None = None) -> Cause:
    """The cause of a region that draws from host generators (`drew`: "random", "numpy.random") at `sites`: "the
    region draws from `random` at <site>" + `how`; its evidence says how they `moved`, where they were drawn, `also`."""
    return Cause("rng", f"host random numbers ({', '.join(drew)})",
                 f"the region draws from {drawn_at(drew, sites)}{how}",
                 [f"{', '.join(drew)}: {moved}", *(f"drawn at {site}" for site in sites), *also],
                 mechanism="host_rng", source=sites[0] if sites else source)


def _generator_arg(op: OpRecord) -> str | None:
    """The generator a random op was handed (`generator=`), if any: a private one, not torch's default."""
    for a in op.args:
        if isinstance(a, dict) and a.get("generator") not in (None, "None"):
            return str(readable_arg(a["generator"]))
    return None


def private_draw(diffs: list) -> OpRecord | None:
    """The forward's first random op handed a private torch.Generator whose draws differ in the recompute (passdiff
    PairDiffs): checkpoint does not restore that generator, so the recompute advanced it a second time."""
    return next((d.forward for d in diffs if d.forward is not None and d.recompute is not None and d.forward.random
                 and "value" in d.kinds and _generator_arg(d.forward)), None)


def _rng_cause(random_op: OpRecord, region: Region, rng: dict | None) -> Cause:
    at = where(random_op.module, random_op.source)
    preserve = region.options.get("preserve_rng_state")
    evidence = [f"{random_op.op} at {at}: identical inputs, other values"]
    if preserve is not None:
        evidence.append(f"checkpoint ran with preserve_rng_state={preserve}")
    generator = _generator_arg(random_op)
    if generator is not None:
        evidence.append(f"generator= {generator}, passed at {at}")
        return Cause("rng", f"the {generator} passed to {random_op.op} at {random_op.source or at}",
                     f"{random_op.op} draws from a {generator} passed to it at {at}, not from torch's default "
                     "generator: preserve_rng_state saves and restores only the default generators, so this one kept "
                     "advancing and the recompute drew other numbers", evidence,
                     mechanism="private_generator", source=random_op.source, names=_drawing_modules(region))
    if rng:
        evidence.append(f"RNG state digest {rng['forward']} in forward, {rng['recompute']} in recompute")
    detail = (f"{random_op.op} drew other random numbers in the recompute"
              + (" because checkpoint ran with preserve_rng_state=False" if preserve is False else
                 " (the RNG state at the start of the recompute differs from the forward's)" if rng else ""))
    return Cause("rng", random_op.op, detail, evidence, mechanism="default_generator", source=random_op.source)


def drew_again_cause(random_op: OpRecord, region: Region) -> Cause:
    """A private generator's draw that reached no saved tensor (`private_draw`): its recompute drew again."""
    cause = _rng_cause(random_op, region, None)
    return replace(cause, detail=cause.detail + " (this time reaching no saved tensor); the generator advances twice "
                   "per step under AC, so its later draws differ from a run without AC")


def _drawing_modules(region: Region) -> list[str]:
    """The modules whose ops draw from a private generator in the region's forward, where such a generator lives
    (a dropout's own, `layers.0.q_proj.lora_dropout.default`): what a restore must cover."""
    ops = region.forward.ops if region.forward is not None else []
    return list(dict.fromkeys(op.module for op in ops if op.random and op.module and _generator_arg(op)))


_STATE_NAME = re.compile(r"[\w.]+")  # a module's buffer or tensor attribute (not `input[0]`, `external[3]`)


def _inputs_measured(p: Pass, index: int | None, depth: int = 0) -> bool:
    """Whether every input of op `index` of pass `p` had its values measured (a fingerprint, kept values, or a view or
    elementwise op of measured inputs): "identical inputs" needs that, which a run with --no-fingerprints lacks."""
    if index is None or index >= len(p.ops) or depth > 64:
        return False
    for ref in p.ops[index].input_refs:
        if ref.kind != "op":
            ext = p.externals[ref.external] if ref.external is not None and ref.external < len(p.externals) else None
            if ext is None or ext.fingerprint is None:
                return False
            continue
        src = p.ops[ref.op_index] if ref.op_index is not None and ref.op_index < len(p.ops) else None
        if src is None:
            return False
        measured = (src.fingerprint and ref.output < len(src.fingerprint) and src.fingerprint[ref.output] is not None) \
            or f"out{ref.output}" in (src.values or {})
        carried = src.derived or is_view_op(src.op) or aliases_its_input(src.op)  # (values from its inputs)
        if not measured and not (carried and _inputs_measured(p, src.index, depth + 1)):
            return False
    return True


def _kept_output_changed(region: Region, cmp: PassComparison) -> Cause | None:
    """A tensor the region's forward made and kept (a cache it fills), which the recompute read back instead of
    making it again, and which holds other values than the forward made (changed in place since: its version)."""
    changed = [(name, made) for name, (made, unchanged) in cmp.kept.items() if not unchanged]
    if not changed:
        return None
    name, (index, out) = changed[0]
    op = next(o for o in region.forward.ops if o.index == index)
    ext = next(e for e in region.recompute.externals if e.name == name)
    fp = op.fingerprint[out] if op.fingerprint and out < len(op.fingerprint) else None
    written = ext.versions is not None and ext.versions[1] != ext.versions[0]
    named = not name.startswith("external[")
    versions = f" (its version went from {ext.versions[0]} to {ext.versions[1]})" if written else ""
    made, read = fingerprint_pair(fp, ext.fingerprint)
    return Cause("state_mutation", name if named else f"{op.op} #{op.index}",
                 f"the tensor the region's forward made ({op.op} at {where(op.module, op.source)}) and kept"
                 + (f" in `{name}`" if named else "") + f" was modified in place after the forward{versions}: "
                 "the recompute reads it back instead of making it again, and gets other values",
                 [f"forward: made by {op.op} #{op.index}, fingerprint {made}",
                  f"recompute: read as `{name}`, fingerprint {read}"],
                 mechanism=KEPT_OUTPUT_WRITTEN, source=op.source)


def _drawn_in_one_pass(region: Region, cmp: PassComparison, random_op: OpRecord) -> Cause | None:
    """Before `random_op` drew other numbers, one pass ran a random op the other did not (a table drawn on a cache
    miss, `functools.lru_cache`, in the forward, which the recompute found cached): both started from the same
    generator state, so every later draw of the region stood at another offset."""
    both = [p for p in cmp.pairs if p.forward is not None and p.recompute is not None]
    twin = next((p.recompute for p in both if p.forward == random_op.index), None)
    fwd, rec = {p.forward for p in both}, {p.recompute for p in both}
    unpaired = [("forward", o) for o in region.forward.ops if o.random and o.index < random_op.index
                and o.index not in fwd]
    if twin is not None and region.recompute is not None:
        unpaired += [("recompute", o) for o in region.recompute.ops
                     if o.random and o.index < twin and o.index not in rec]
    if not unpaired:
        return None
    side, op = unpaired[0]
    other = "recompute" if side == "forward" else "forward"
    at = where(op.module, op.source)
    return Cause("rng", f"{op.op} at {op.source or at}",
                 f"the {side} drew random numbers with {op.op} at {at}, which the {other} did not run (a value made on "
                 f"a cache miss, which the {other} found cached; or a branch): both passes start from the same "
                 f"generator state, so {random_op.op} at {where(random_op.module, random_op.source)} drew from "
                 "another offset of it, and other numbers",
                 [f"{o.op} #{o.index} at {where(o.module, o.source)}: in the {s} only" for s, o in unpaired[:3]]
                 + [f"{random_op.op} at {where(random_op.module, random_op.source)}: identical inputs, other values"],
                 mechanism=ONE_PASS_DRAW, source=op.source)


def _initialized_in_forward(region: Region, cmp: PassComparison) -> Cause | None:
    """The forward ran random ops that wrote parameters or buffers in place (a lazy module materialized and
    initialized on its first call, inside the region), which the recompute, finding them initialized, did not run:
    the generator it restored then stood elsewhere, and its random ops (dropout) drew other numbers."""
    recomputed = {p.forward for p in cmp.pairs if p.forward is not None and p.recompute is not None}
    init = [o for o in region.forward.ops if o.index not in recomputed and is_random_name(o.op)
            and any(ref.kind in ("param", "buffer") for ref in written_refs(o))]
    if not init or _first_random_divergence(cmp) is None:
        return None
    names = list(dict.fromkeys(ref.name for o in init for ref in written_refs(o) if ref.kind in ("param", "buffer")))
    op = init[0]
    return Cause("rng", names[0],
                 f"the region's forward initialized {backticked(names)} with random draws ({op.op} at "
                 f"{where(op.module, op.source)}: a lazy module materialized on its first call, inside the region); "
                 "the recompute found them initialized and did not, so the generator state it restored was not "
                 "where the forward's later random ops drew from, and they drew other numbers",
                 [f"{o.op} #{o.index} wrote {', '.join(r.name for r in written_refs(o))} in the forward only"
                  for o in init[:4]], mechanism=LAZY_INIT, source=op.source, names=names)


def sac_mutated_cause(fwd: Pass) -> Cause | None:
    """torch refused the recompute a tensor selective AC cached ("has been mutated"): the forward op whose output the
    policy saved, and the later op of the forward that changed that output in place (dropout's `bernoulli_` then its
    `div_`); None where the trace shows no such pair."""
    ops = {o.index: o for o in fwd.ops}

    def base(index: int | None) -> OpRecord | None:  # (through the views and in-place ops of its output)
        op = ops.get(index)
        while op is not None and not op.cached and aliases_its_input(op.op) and op.input_refs \
                and op.input_refs[0].kind == "op":
            op = ops.get(op.input_refs[0].op_index)
        return op

    for writer in fwd.ops:
        for ref in written_inputs(writer.op, writer.args, writer.input_refs or ()):
            saved = base(ref.op_index) if getattr(ref, "kind", None) == "op" else None
            if saved is not None and saved.cached and saved.index < writer.index:
                return Cause(
                    "sac_policy", saved.op,
                    f"the selective-AC policy saves the output of {saved.op} ({where(saved.module, saved.source)}), "
                    f"and the forward then changes that tensor in place ({writer.op}, "
                    f"{where(writer.module, writer.source)}"
                    "): torch refuses to hand the recompute a cached tensor that changed after it was saved, or, "
                    "where its check does not see the change, the recompute reads the changed tensor and changes it "
                    "again",
                    [f"saved by the policy: {saved.op} #{saved.index}",
                     f"changed in place: {writer.op} #{writer.index}"],
                    source=saved.source, names=list(dict.fromkeys([saved.op, writer.op])))
    return None


def reentrant_graph_cause(region: Region) -> Cause | None:
    """A reentrant region whose recompute matched its forward op by op, where parameters it reads were frozen or
    unfrozen between the passes: the backward runs on the graph the recompute built, so they get gradients a run
    without AC does not give them. None otherwise; also for parameters frozen in between, whose gradient both runs
    drop (autograd accumulates none into a leaf that no longer requires grad)."""
    if region.kind != "reentrant" or region.forward is None or region.recompute is None:
        return None
    before, after = (p.state.get("trainable_n") for p in (region.forward, region.recompute))
    if region.watched and before is not None and after is not None and after > before:  # (watch reads no parameter)
        flags = {"trainable": {"forward": region.forward.state.get("trainable"),
                               "recompute": region.recompute.state.get("trainable")}}
        return _trainable_changed(flags, f"{after - before} of the region's parameters were unfrozen",
                                  _GRAPH_OF_THE_RECOMPUTE)
    return _requires_grad_changed(region, _GRAPH_OF_THE_RECOMPUTE, unfrozen_only=True)


_GRAPH_OF_THE_RECOMPUTE = (": with use_reentrant=True the backward runs on the graph the recompute builds, so they get "
                           "gradients a run without AC does not give them, though every op and value matched")


def _requires_grad_changed(region: Region, why: str | None = None, unfrozen_only: bool = False) -> Cause | None:
    """Parameters the region reads whose requires_grad differs between the forward and the recompute (frozen or
    unfrozen before the backward; `unfrozen_only`: those that require grad in the recompute only): an op saves what
    only a gradient needs where one is needed, so the recompute saves other tensors (`why`: what it does
    otherwise)."""
    # (by tensor object: two models' parameters can share names, a frozen teacher's `0.weight` and its student's)
    before = {e.obj: e.requires_grad for e in region.forward.externals if e.kind == "param" and e.obj is not None}
    changed = [(e.name, before[e.obj], e.requires_grad) for e in region.recompute.externals if e.kind == "param"
               and e.requires_grad is not None and before.get(e.obj) is not None
               and before[e.obj] != e.requires_grad and (e.requires_grad or not unfrozen_only)]
    if not changed:
        return None
    names = [name for name, _, _ in changed]
    now = "unfrozen" if changed[0][2] else "frozen"
    return Cause("state_mutation", f"requires_grad of {names[0]}" + (f" and {len(names) - 1} more" if len(names) > 1
                                                                      else ""),
                 f"{len(names)} parameter(s) the region reads were {now} between the forward and the backward "
                 f"(requires_grad {changed[0][1]} in the forward, {changed[0][2]} in the recompute: "
                 f"{backticked(names)})"
                 + (why or _SAVES_WHAT_GRADS_NEED),
                 [f"{name}: requires_grad {a} -> {b}" for name, a, b in changed[:6]], mechanism=REQUIRES_GRAD)


_SAVES_WHAT_GRADS_NEED = (": an op saves the tensors a gradient needs only where one is needed, so the recompute saved "
                          "other tensors than the forward")


def _trainable_changed(flags: dict[str, dict], what: str = "the region's parameters were frozen or unfrozen",
                       why: str = _SAVES_WHAT_GRADS_NEED) -> Cause | None:
    """The region's parameters that require grad, as a watched pass notes them (`trainable`: no op recorded, so no
    parameter read), differ between the passes."""
    change = flags.get("trainable")
    if change is None:
        return None
    was, now = change["forward"], change["recompute"]
    return Cause("state_mutation", "requires_grad of the region's parameters",
                 f"{what} between the forward and the backward (those that require grad: {was} in the forward, {now} "
                 f"in the recompute){why}", [f"parameters that require grad: {was} -> {now}"], mechanism=REQUIRES_GRAD)


def _hooks_changed(change: dict[str, list | None]) -> Cause:
    """Forward hooks on the region's modules that one pass ran and the other did not: registered (or removed)
    between the forward and the backward, as a probe, an ablation or a logging hook is."""
    was, now = change["forward"] or [], change["recompute"] or []
    added, removed = [h for h in now if h not in was], [h for h in was if h not in now]
    hook = (added or removed or now or was or ["?"])[0]
    return Cause("control_flow", hook.split(" (")[0],
                 f"a forward hook on the region's modules was {'registered' if added else 'removed'} between the "
                 f"forward and the backward ({hook}): the {'recompute' if added else 'forward'} ran it, the "
                 f"{'forward' if added else 'recompute'} did not, so the recompute computed other values",
                 [f"hooks in the forward: {', '.join(was) or 'none'}",
                  f"hooks in the recompute: {', '.join(now) or 'none'}"],
                 mechanism=HOOKS)


def _cache_skipped_saves(region: Region, cmp: PassComparison) -> Cause | None:
    """The recompute read back tensors the forward made and kept (a cache the forward filled:
    torch.nn.utils.parametrize.cached(), a memo dict), so it skipped the ops that made them, and those ops had saved
    tensors in the forward: the recompute saves fewer (torch's count check), from the cache's state, not the inputs."""
    fwd, rec = region.forward, region.recompute
    skipped = {p.op_index for p in fwd.positions if p.origin == "op" and p.op_index in cmp.read_back}
    read = [e for e in rec.externals if e.made_by is not None and e.made_by[0] in cmp.read_back]
    if not skipped or not read:
        return None
    made = {o.index: o for o in fwd.ops}
    op = made.get(read[0].made_by[0])
    if op is None:
        return None
    kept = ", ".join(f"{made[e.made_by[0]].op} #{e.made_by[0]}" for e in read[:3] if e.made_by[0] in made)
    return Cause("control_flow", f"{op.op} #{op.index}",
                 f"the recompute read back {len(read)} tensor(s) the forward made and kept ({kept}, made at "
                 f"{where(op.module, op.source)}: a cache the forward filled, as torch.nn.utils.parametrize.cached() "
                 f"or a memo dict keeps one) instead of making them again, so it skipped the {len(cmp.read_back)} "
                 "op(s) that made them and the tensors they saved for the backward: the forward missed the cache, "
                 "the recompute hit it",
                 [f"forward: {len(cmp.read_back)} op(s) made what the recompute read back; {len(skipped)} of them "
                  "saved tensors",
                  f"recompute: read {', '.join(e.name for e in read[:3])} (made by the forward)"],
                 mechanism=CACHE_HIT, source=op.source)


def _own_state_read(region: Region, cmp: PassComparison, value: Divergence) -> list[str]:
    """The outside tensors the op of `value` writes in place and computes with, where the region updates them itself
    and they held other values when the recompute read them (fingerprinted at first read), else []."""
    fwd, rec = region.forward, region.recompute
    i = value.forward_index
    if i is None or not 0 <= i < len(fwd.ops):
        return []
    prints = {(e.kind, e.name): e.fingerprint for e in fwd.externals}
    again = {(e.kind, e.name): e.fingerprint for e in rec.externals}
    names = []
    for ref in written_refs(fwd.ops[i]):
        key = (ref.kind, ref.name)
        if ref.kind != "op" and key in cmp.self_updated and prints.get(key) and again.get(key) \
                and not cmp.tolerance.equal(prints[key], again[key]):
            names.append(ref.name)
    return names


def _updated_state(cmp: PassComparison) -> list[str]:
    """The module state (buffers, tensor attributes) the region's own ops update in place: what a restore covers."""
    return [n for n, _ in cmp.region_updates() if n and _STATE_NAME.fullmatch(n)]


def _module_state(lead: str, changed: list[dict]) -> list[str]:
    """`lead` and every other buffer / tensor attribute of a module whose values differ in the recompute (two
    layers each updating a running buffer): what a restore must cover."""
    return list(dict.fromkeys([lead, *(c["name"] for c in changed if c["kind"] in ("buffer", "external")
                                        and _STATE_NAME.fullmatch(c["name"]))]))


PARAMETER = "parameter"  # Cause.mechanism: one parameter changed between the forward and the recompute
_UPDATED = ("the parameters were updated in place between this forward and its backward (an optimizer step, weight "
            "clipping, an EMA copied into the model)")
OPTIMIZER_STEP = "optimizer_step"  # ... most of those it reads (an optimizer step)


def one_optimizer_step(reports: list[RegionReport]) -> None:
    """Regions that read one changed parameter each (a stem conv, a head's weight), in a run where other regions
    show most of their parameters changed: the same optimizer step ran between their forward and their backward,
    with its fix, not "update the parameter after the backward" as if the script updated that one tensor."""
    stepped = {}
    for r in reports:
        if r.cause is not None and r.cause.mechanism == OPTIMIZER_STEP:
            stepped.setdefault((r.path, r.rank), r)
    for r in reports:
        lead = stepped.get((r.path, r.rank))
        if lead is None or r.cause is None or r.cause.mechanism != PARAMETER:
            continue
        r.cause = Cause("state_mutation", r.cause.tensor,
                        f"the parameter `{r.cause.tensor}` has other values in the recompute: {_UPDATED} (region "
                        f"{lead.region}, {lead.module or '?'}: {lead.cause.tensor} changed)", list(r.cause.evidence),
                        OPTIMIZER_STEP)
        r.suggestions = list(lead.suggestions)


# Parameters changed between a region's forward and its recompute, as a share of those it read, from
# which the cause is a whole-model update (an optimizer step) rather than one tensor's update
_WHOLE_MODEL_SHARE = 0.75


def _whole_model_update(region: Region, changed: list[dict]) -> Cause | None:
    """Most or all parameters the region read changed: the optimizer (or something else that updates
    every parameter) ran between this forward and its backward."""
    params = {e.name for e in region.forward.externals if e.kind == "param"} if region.forward is not None else set()
    rec = region.recompute
    reread = {e.name for e in rec.externals if e.kind == "param"} if rec is not None and rec.stopped_early else set()
    unread = len(params - reread) if reread else 0  # torch's early stop ended the recompute before it read them
    params = params & reread if reread else params
    moved = [c for c in changed if c["kind"] == "param"]
    if len(moved) < 2 or len(moved) < _WHOLE_MODEL_SHARE * len(params):
        return None
    names = [c["name"] for c in moved]
    shown = backticked(names)
    share = f"all {len(moved)}" if len(moved) >= len(params) else f"{len(moved)} of the {len(params)}"
    read = "the recompute read again" if unread else "the region reads"
    stopped = (f" (torch's early stop ended the recompute before it read the other {unread})" if unread else "")
    if _rebound(region, names):
        return Cause("state_mutation", f"parameters ({share} {read})",
                     f"{share} parameters {read} are other tensors in the recompute, with other values{stopped}: new "
                     "tensors were bound in their place between this forward and its backward (torch.func."
                     "functional_call with a dict of weights updated since, a parameter reassigned), not updated in "
                     "place", [f"rebound parameters: {shown}"], mechanism=REBOUND)
    return Cause("state_mutation", f"parameters ({share} {read})",
                 f"{share} parameters {read} have other values in the recompute{stopped}: " + _UPDATED,
                 [f"changed parameters: {shown}"], mechanism=OPTIMIZER_STEP)


def _rebound_state(region: Region, changed: list[dict]) -> Cause | None:
    """A tensor the region reads from an attribute (not a parameter) is another object in the recompute, with other
    values: the attribute was bound to another tensor before the backward, most often by the region's own code,
    which carries state from call to call (`self.state = (h, c)` in a chunked RNN): the recompute reads the state
    the latest call left, another region's output or its own."""
    fwd = {e.name: e for e in region.forward.externals if e.kind in ("external", "buffer")}
    rec = {e.name: e for e in region.recompute.externals if e.kind in ("external", "buffer")}
    moved = [c["name"] for c in changed if c["kind"] in ("external", "buffer") and _attribute_named(c["name"])
             and fwd.get(c["name"]) is not None and rec.get(c["name"]) is not None
             and None not in (fwd[c["name"]].obj, rec[c["name"]].obj) and fwd[c["name"]].obj != rec[c["name"]].obj]
    if not moved:
        return None
    name = moved[0]
    return Cause("state_mutation", name,
                 f"`{name}` is another tensor in the recompute than in the forward: the attribute holding it was bound "
                 f"to another tensor between this forward and its backward, so the recompute read "
                 f"{_made(rec[name]) or 'another tensor bound in its place'}, not what the forward read",
                 [f"rebound: {backticked(moved[:4])}",
                  changed_line(next(c for c in changed if c["name"] == name), "forward", "recompute")],
                 mechanism=REBOUND, names=moved)


def _bound_since(region: Region, control: Divergence) -> Cause | None:
    """The recompute took another branch to read a tensor attribute the forward did not read, and no recorded
    state explains the branch: the attribute held no tensor when the forward ran (`self.S = None` until the first
    segment binds it: `S = self.S if self.S is not None else zeros`) and holds one in the recompute."""
    fwd = {e.name for e in region.forward.externals}
    bound = [e.name for e in region.recompute.externals if e.kind in ("external", "buffer") and e.name not in fwd
             and _attribute_named(e.name)]
    if not bound:
        return None
    made = _made(next(e for e in region.recompute.externals if e.name == bound[0]))
    return Cause("state_mutation", bound[0],
                 f"the recompute read `{bound[0]}`, which the forward did not: the attribute held no tensor when the "
                 "forward ran (None, or not set yet) and was bound to one before its backward, so the recompute's "
                 f"code took another branch at {where(control.module, control.source)}" + (f" and read {made}"
                                                                                           if made else ""),
                 [f"read by the recompute only: {backticked(bound[:4])}", f"{control.op}: {control.summary}"],
                 mechanism=REBOUND, names=bound, source=control.source)


def _made(read: External) -> str | None:
    """Where a tensor the recompute read from an attribute was made, where the trace knows."""
    return (f"the output of region {read.made_in}'s forward (a later call of the same code rebound it)"
            if read.made_in is not None else
            "what this region's own forward made (its code rebinds the attribute to its output)"
            if read.made_by is not None else None)


def _attribute_named(name: str) -> bool:
    """A tensor read from a named attribute (unnamed ones, `external[3]`, were made in the region, by from_numpy)."""
    return not re.fullmatch(r"external\[\d+\]", name)


def _rebound(region: Region, names: list[str]) -> bool:
    """Every named parameter is another tensor object in the recompute than in the forward (both recorded)."""
    fwd = {e.name: e.obj for e in region.forward.externals if e.kind == "param"}
    rec = {e.name: e.obj for e in region.recompute.externals if e.kind == "param"}
    return all(fwd.get(n) is not None and rec.get(n) is not None and fwd[n] != rec[n] for n in names)


def _saved_views(report: RegionReport, region: Region) -> set[str]:
    """Externals whose view the region saved where the saved values differ (`weight.t()` saved by a linear: the
    weight changed)."""
    ops = {op.index: op for op in region.forward.ops} if region.forward is not None else {}
    out = set()
    for p in report.positions:
        op = ops.get(p.forward_index) if p.origin == "op" and p.values_differ else None
        if op is not None and is_view_op(op.op) and op.input_refs:
            source = viewed_source(ops, op.input_refs[0])
            if source.kind != "op" and source.name:
                out.add(source.name)
    return out


def _saved_updates(report: RegionReport, region: Region) -> set[str]:
    """Externals saved for backward as the result of an in-place update in the region (`avg.lerp_(x)`
    then `y / avg` saves `avg`), where the saved values differ."""
    ops = {o.index: o for o in region.forward.ops} if region.forward is not None else {}
    names = set()
    for p in report.positions:
        op = ops.get(p.forward_index) if p.origin == "op" and p.values_differ else None
        if is_outside_update(op):
            names.add(op.input_refs[0].name)
    return names


def _argument_items_changed(change: dict | None) -> Cause | None:
    """A list or dict the region was given held other items when its recompute began than when its forward did
    (capture/state.argument_items: each summarized as a container attribute is): the caller changed it after the
    forward."""
    if not change:
        return None
    before, after = change["forward"] or {}, change["recompute"] or {}
    names = [k for k in sorted(set(before) | set(after)) if before.get(k) != after.get(k)]
    if not names:
        return None
    name = names[0]
    was, now = before.get(name) or {}, after.get(name) or {}
    kind = (was or now).get("type", "list")
    count_was, count_now = was.get("len", "?"), now.get("len", "?")
    how = (f"held {count_was} item(s) in the forward and {count_now} in the recompute: items were added or taken "
           "after the forward began" if count_was != count_now else
           "held other items in the recompute than in the forward (as many): some were replaced after the forward "
           "began")
    how += " (by the caller before the backward, or by the region itself, filling a cache)"
    return Cause("state_mutation", name, f"the region's {name}, a {kind}, {how} (checkpoint keeps the {kind} itself "
                 "for the recompute, not a copy of it)",
                 [f"{n}: {change_words(before.get(n), after.get(n))}" for n in names], mechanism=ARGUMENT_ITEMS)


def _global_state_cause(flags: dict, key: str) -> Cause:
    return Cause("global_state", key,
                 f"{flag_label(key)} was {flags[key]['forward']!r} in the forward and {flags[key]['recompute']!r} in "
                 "the recompute" + (": changed between the forward and the backward, so the recompute ran under "
                                    "another setting than the forward" if key in KERNEL_FLAGS else ""),
                 [f"{flag_label(k)}: {v['forward']!r} -> {v['recompute']!r}" for k, v in flags.items()])


def explain_flags(report: RegionReport, region: Region, torch_version: str | None = None) -> None:
    """A region that reproduced its forward although a flag that chooses kernels differed between its passes (a CPU
    ignores the GPU's TF32 and cuDNN flags): the global_state cause it has where a kernel depends on the flag, with
    its fix, and a note that this run's values matched."""
    flags = {k: v for k, v in report.state_changes.items() if k in KERNEL_FLAGS}
    if not flags:
        return
    report.cause = _global_state_cause(flags, first_flag(flags))
    report.suggestions = suggestions_for(report, region, torch_version)
    report.notes.append(f"no value differed in this run (no kernel it ran depends on "
                        f"{flag_label(report.cause.tensor)}), but where one does (a GPU: TF32 or reduced-precision "
                        "matmuls, cuDNN's algorithm, the attention kernel) the recompute computes other values than the "
                        "forward")


def _through_saved_hooks(region: Region, name: str, evidence: list[str]) -> Cause | None:
    """The region's input `name` reads other values in the recompute, and checkpoint kept it through the user's
    saved-tensor hooks (an offload pool, a compression of activations): the recompute starts from what their unpack
    returned. Where that is a copy, not the forward's tensor, the hooks changed it, named or not (torch <= 2.7 does
    not say which hooks were active); where it is the forward's tensor itself, they did not (it was written)."""
    hooks = region.forward.state.get("saved_hooks") if region.forward is not None else None
    index = name[len("input["):-1] if name.startswith("input[") else ""
    kept = (region.recompute.state.get("inputs_kept_as") or []) if region.recompute is not None else []
    how = kept[int(index)] if index.isdigit() and int(index) < len(kept) else None
    if how == "same" or not hooks and how != "copy":
        return None
    if not hooks and region.parent is not None and region.parent_phase == "forward":
        # (nested: no user hook but the enclosing checkpoint's kept it, and its recompute gave the copy)
        return Cause("state_mutation", name, f"the region's {name} is a tensor the enclosing checkpoint (region "
                     f"{region.parent}) kept, and that region's recompute computed it again with other values",
                     [*evidence, "the recompute's input is a copy in other memory than the forward's input tensor"],
                     mechanism=ENCLOSING_RECOMPUTE)
    through = (f"through the saved-tensor hooks active around it (`{hooks[0]}`, `{hooks[1]}`), and `{hooks[1]}` gave "
               if hooks else "through the saved-tensor hooks active around it (an offload, a compression), which gave ")
    return Cause("state_mutation", name,
                 f"checkpoint kept the region's {name} {through}the recompute other values than the forward received"
                 + (": the recompute got a copy, not the forward's tensor, so the hooks did not give back what they "
                    "were given (a buffer a later pack reuses, a lossy compression)" if how == "copy" else
                    ": the hooks did not give back what they were given (a buffer a later pack reuses, a lossy "
                    "compression), or the input was modified in place after the forward"),
                 [*evidence]
                 + ([f"saved-tensor hooks around the region's forward: pack `{hooks[0]}`, unpack `{hooks[1]}`"]
                    if hooks else [])
                 + (["the recompute's input is a copy in other memory than the forward's input tensor"]
                    if how == "copy" else []),
                 mechanism=SAVED_HOOKS)


def _before(a, b) -> bool:
    """Divergence `a` comes no later than `b` in either pass."""
    return any(x is not None and y is not None and x <= y for x, y in
               ((a.forward_index, b.forward_index), (a.recompute_index, b.recompute_index)))


def _first_random_divergence(cmp: PassComparison) -> OpRecord | None:
    for d in cmp.diffs:
        if d.side_effect:
            continue
        if "value" in d.kinds and d.forward is not None and d.forward.random and d.inputs_same is not False:
            # drawn with another argument (a dropout's probability): the argument's change is the cause
            return None if d.kinds & ARGUMENT_KINDS else d.forward
        if "value" in d.kinds and d.inputs_same:
            return None  # a non-random op diverged on its own first
    return None


def _in_place_writer(region: Region, name: str) -> tuple[str, str] | None:
    """An op recorded writing the tensor inside this region (an in-place method, a foreach update, an `out=`: the
    mutation itself, when it is visible), or a view of it (`queue[ptr:ptr + n] = keys`, a copy_ into a slice):
    ("aten.mul_.Tensor at blk (train.py:9 in forward)", the pass it ran in)."""
    for p in (region.forward, region.recompute):
        found = writer_in(p, name)
        if found is not None:
            return found, p.phase
    return None


def _chain(report: RegionReport, region: Region, cmp: PassComparison) -> list[str]:
    if not report.has_values:
        return _log_chain(report, region)
    chain: list[str] = []
    cause = report.cause
    if cause is not None and cause.kind in ("state_mutation", "global_state", "sharded_parameter"):
        chain.append(cause.detail)
    elif cause is not None and cause.kind == "rng":
        chain.append(cause.detail)
    steps: dict[int, str] = {}  # forward op index -> its link: the links follow the data, in forward order
    for div in (report.first_control_divergence if cause and cause.kind == "control_flow" else None,
                report.first_value_divergence, report.first_discrete_divergence, report.first_shape_divergence):
        if div is None or div.forward_index in steps:
            continue
        label = {"value": "computes different values", "discrete": div.summary,
                 "control": div.summary}.get(div.kind, div.summary)
        steps[div.forward_index] = f"{div.op} in {where(div.module, div.source)}: {label}"
    for op in _between(report, region, cmp):
        steps.setdefault(op.index, f"{op.op} in {where(op.module, op.source)}: different result")
    chain += [steps[i] for i in sorted(steps, key=lambda i: (i is None, i or 0))]
    bad = [p.position for p in report.positions if p.matches is False]
    raised = region.recompute.state.get("error") if region.recompute is not None else None
    saved = [len(p.positions) for p in (region.forward, region.recompute) if p is not None]
    if len(saved) == 2 and saved[0] != saved[1] and saved[1] and not raised:
        # (positions paired by number past the first one missing pair unrelated tensors: the count is what differs)
        chain.append(f"the recompute saved {saved[1]} tensors where the forward saved {saved[0]} -> torch raises "
                     "CheckpointError (a different number of tensors)")
    elif bad:
        chain.append(f"saved position{'s' if len(bad) > 1 else ''} {number_ranges(bad)} differ in metadata -> "
                     + (f"the recompute raised before torch's check: {raised[:160]}"
                        if raised and not any(p.in_torch_error for p in report.positions)
                        else "torch does not compare them (determinism_check=\"none\"): the backward reads tensors "
                        "of other shapes" if region.options.get("determinism_check") == "none"
                        else f"torch does not compare them ({_REENTRANT_UNCHECKED}): the backward reads tensors of "
                        "other shapes" if region.kind == "reentrant"
                        else "torch raises CheckpointError"))
    elif report.silent and region.kind == "reentrant":
        chain.append(f"torch compares nothing of it ({_REENTRANT_UNCHECKED}): the gradients are silently wrong")
    elif report.silent and report.first_discrete_divergence is not None and \
            report.first_discrete_divergence.reordered_only:
        chain.append("every saved tensor keeps its shape, so torch raises nothing: the gradients are silently wrong "
                     "where the backward uses the order of the choices")
    elif report.silent:
        chain.append("every saved tensor keeps its shape, so torch raises nothing: the gradients are silently wrong")
    return chain


def _log_chain(report: RegionReport, region: Region) -> list[str]:
    """From a log: the dataflow from the decision to the op whose shapes/arguments differ, then positions."""
    chain: list[str] = []
    shape = report.first_shape_divergence
    decision = report.first_discrete_divergence
    if shape is not None and region.forward is not None and decision is not None:
        in_recompute = decision.detail.get("found_in", "recompute" if decision.forward_index is None else
                                           "forward") == "recompute"
        p = region.recompute if in_recompute else region.forward
        target = next((o for o in p.ops if o.index == (shape.recompute_index if in_recompute else shape.forward_index)),
                      None)
        if target is not None:
            path = decision_path(p.ops, target)
            for op in path[:-1]:
                ids = ", ".join(op.log_ids[0]) if op.log_ids else ""
                chain.append(f"{op.op}{f' ({ids})' if ids else ''}{_at(op.module, op.source)}")
    if shape is not None:
        chain.append(f"{shape.op}{_at(shape.module, shape.source)}: {shape.summary}")
    bad = [p.position for p in report.positions if p.matches is False]
    if bad:
        what = "dtype" if dtype_only(report.positions) else "shape"
        chain.append(f"saved position{'s' if len(bad) > 1 else ''} {number_ranges(bad)} differ in {what} "
                     "-> CheckpointError")
    return chain


def _at(module: str | None, source: str | None) -> str:
    return f" at {where(module, source)}" if module or source else ""


def _between(report: RegionReport, region: Region, cmp: PassComparison, limit: int = 4) -> list[OpRecord]:
    """The data-dependent steps (counts, copies to the host, other decisions) on the data path from the
    discrete flip (or first value divergence) to the shape divergence: each arrow of the chain a real
    producer link, through ops whose outputs differ."""
    start = report.first_discrete_divergence or report.first_value_divergence
    end = report.first_shape_divergence
    if start is None or end is None or start.forward_index is None or end.forward_index is None \
            or region.forward is None:
        return []
    ops = region.forward.ops
    target = next((o for o in ops if o.index == end.forward_index), None)
    if target is None:
        return []
    sources = {d.forward_index for d in (report.first_discrete_divergence, report.first_value_divergence)
               if d is not None and d.forward_index is not None}
    path = data_path(ops, target, sources, lambda op: bool(cmp.tainted.get(op.index)))
    picked = []
    for f in path[1:-1]:
        metas = [m for _, m in f.tensor_outputs()]
        integer_out = any(m.dtype[0] in "iub" for m in metas)
        host = f.host_value is not None or any(m.device == "cpu" for m in metas) and "_to_copy" in f.op
        if is_discrete(f) or integer_out or host:
            picked.append(f)
    return picked[:limit]
