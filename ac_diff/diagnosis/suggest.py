"""Concrete fixes for a diagnosed region, in the vocabulary the user edits.

    suggestions_for(report, region) -> [Suggestion(title="Update `layers.1.moe.expert_bias` after optimizer.step()",
                                                   text="...", code="optimizer.register_step_post_hook(...)"), ...]

Each cause gets its direct fix; a flipped discrete decision also gets a selective-AC policy that saves
the deciding op (and the matmul feeding it), written for `create_selective_checkpoint_contexts` and in
torchtitan's per-op save-list wording.
"""

from __future__ import annotations

import re

from ..stateflags import KERNEL_FLAGS, flag_label
from ..oprules import (OBSERVER_MODULE, OBSERVER_OPS, is_in_place_method, is_random_name, packet,
                       updates_as_it_computes)
from ..passes import OpRecord, Region, is_log_id
from ..report import (ARGUMENT_ITEMS, CACHE_HIT, GRAD_MODE, HOOKS, KEPT_OUTPUT_WRITTEN, LATER_FORWARD, LAZY_INIT,
                      NO_GRAD_INPUTS, ONE_PASS_DRAW, PRECISION, REBOUND, REQUIRES_GRAD, SAVED_HOOKS, UPDATED_IN_FORWARD,
                      RegionReport, Suggestion)
from .attributes import attribute_suggestion, split_name
from .passdiff import read_after_write, writer_in, writer_op_in
from .labels import backticked, branch_sites, where


def _torch_op(op: str) -> str:
    """"aten.topk.default" -> "torch.ops.aten.topk.default"."""
    return op if op.startswith("torch.ops.") else f"torch.ops.{op}"


def _before_2_5(torch_version: str | None) -> bool:
    """Whether a torch version string ("2.4.1+cu121") names a release before 2.5 (None: unknown, so no)."""
    match = re.match(r"(\d+)\.(\d+)", torch_version or "")
    return match is not None and (int(match.group(1)), int(match.group(2))) < (2, 5)


def sac_policy(ops: list[str], torch_version: str | None = None) -> str:
    """A selective-AC policy that saves `ops`, for the torch that will run it: CheckpointPolicy and
    `create_selective_checkpoint_contexts` (2.5 and later, and where the version is unknown); on 2.4, a policy
    answering "save?" for `_pt2_selective_checkpoint_context_fn_gen`, 2.4's only spelling."""
    listed = "\n".join(f"    {_torch_op(op)}," for op in ops)
    if _before_2_5(torch_version):
        return (
            "from functools import partial\n"
            "import torch\n"
            "# torch 2.4 (2.5 and later: CheckpointPolicy and create_selective_checkpoint_contexts)\n"
            "from torch.utils.checkpoint import _pt2_selective_checkpoint_context_fn_gen, checkpoint\n\n"
            f"SAVE = {{\n{listed}\n}}\n\n"
            "def policy_fn(mode, op, *args, **kwargs):\n"
            "    return op in SAVE  # True: save the output, False: recompute it\n\n"
            "out = checkpoint(block, x, use_reentrant=False,\n"
            "                 context_fn=partial(_pt2_selective_checkpoint_context_fn_gen, policy_fn))"
        )
    return (
        "from functools import partial\n"
        "import torch\n"
        "from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts\n\n"
        f"SAVE = {{\n{listed}\n}}\n\n"
        "def policy_fn(ctx, op, *args, **kwargs):\n"
        "    return CheckpointPolicy.MUST_SAVE if op in SAVE else CheckpointPolicy.PREFER_RECOMPUTE\n\n"
        "out = checkpoint(block, x, use_reentrant=False,\n"
        "                 context_fn=partial(create_selective_checkpoint_contexts, policy_fn))"
    )


# The code that gives a recompute its torch.Generator's forward state, and then puts the generator back where it
# stood (a generator shared by several regions, or drawn from after the backward, must not be rewound).
# Quantization observers off while the backward runs: the recompute quantizes with the ranges the forward left
OBSERVERS_OFF = ("import torch.ao.quantization as tq\n\n"
                 "model.apply(tq.disable_observer)  # the recompute inside the backward leaves the ranges alone\n"
                 "loss.backward()\nmodel.apply(tq.enable_observer)")
# A parametrization's weight (spectral_norm's, which updates its state each time it is computed) computed once per
# step, outside the checkpointed regions: the forward and the recompute read the same cached tensor
PARAMETRIZED_ONCE = (
    "import torch.nn.utils.parametrize as P\n\n"
    "with P.cached():  # the forward and the backward (its recompute) inside\n"
    "    for m in model.modules():\n        if P.is_parametrized(m):\n"
    "            m.weight  # computed here, once, outside every checkpointed region\n"
    "    loss = loss_fn(model(batch))\n    loss.backward()")

GENERATOR_SWAP = (
    "def block_fn(x, gen_state):\n"
    "    now = gen.get_state()\n"
    "    gen.set_state(gen_state)                 # forward and recompute draw from the same state\n"
    "    try:\n"
    "        return block(x)                      # draws with generator=gen\n"
    "    finally:                                 # (also when torch stops a recompute early)\n"
    "        if not torch.equal(now, gen_state):  # the recompute (the forward moved the generator since):\n"
    "            gen.set_state(now)               # put it back where it stood\n\n"
    "out = checkpoint(block_fn, x, gen.get_state(), use_reentrant=False)")


# The title of the one suggestion that changes no code (a CI check), so never the code change a fix points to
LOUDER = "Turn the silent error into a loud one while you fix it"

_SDP_BACKENDS = {"flash": "FLASH_ATTENTION", "mem_efficient": "EFFICIENT_ATTENTION", "math": "MATH",
                 "cudnn": "CUDNN_ATTENTION"}  # state.global_state's names -> torch.nn.attention.SDPBackend's


def _set_once(key: str, value: object) -> str:
    """The line that sets a kernel-choosing flag once (to the forward's value), for the whole step."""
    once = "  # once, before the training loop: not between the forward and loss.backward()"
    if key == "deterministic":
        return f"torch.use_deterministic_algorithms({value!r}){once}"
    if key == "matmul_precision":
        if ":" in str(value):  # (set per backend, "cuda: tf32, mkldnn: bf16": matmul_precision() in torch_compat)
            return "\n".join(f"torch.backends.{backend}.matmul.fp32_precision = {setting!r}{once}"
                             for backend, setting in (part.split(": ") for part in str(value).split(", ")))
        return f"torch.set_float32_matmul_precision({value!r}){once}"
    if key == "num_threads":
        return f"torch.set_num_threads({value!r}){once}"
    if key == "sdp_backends":
        backends = ", ".join("SDPBackend." + _SDP_BACKENDS.get(b, b.upper()) for b in value or [])
        return ("from torch.nn.attention import SDPBackend, sdpa_kernel\n\n"
                f"with sdpa_kernel([{backends}]):  # around the whole step\n"
                "    loss = model(batch)\n    loss.backward()  # the recompute runs here: under the same backends")
    return f"torch.backends.{key} = {value!r}{once}"


def repeated_update_suggestion(report: RegionReport, torch_version: str | None = None, *,
                               read_again: bool = False, code: str | None = None, diverged: bool = False) -> Suggestion:
    """A region that reproduced its forward but whose recompute updates state a second time (`report.repeated`: a
    batch norm's running statistics, a counter): the gradients are right, the state the next steps start from is
    not. An op that updates while it computes (a batch norm) is saved with selective AC, so the recompute does not
    run it again; an in-place update (`counter.add_(1)`) is moved out of the checkpointed forward. `diverged`: the
    fix of a region of the same code whose recompute did not reproduce its forward, reading the second value (a
    threshold crossed between its passes): its own gradients are wrong too."""
    saved = list(dict.fromkeys(op for _, op, _ in report.repeated if updates_as_it_computes(op)))
    shown = _names([name for name, op, _ in report.repeated if op in saved or not saved])
    in_place = [f"`{n}` ({op})" for n, op, _ in report.repeated if not updates_as_it_computes(op)]
    after = (" Each step then leaves them other than a run without AC does, and the region's code reads them: the "
             "forwards of later steps compute with other values, so their gradients differ from a run without AC "
             + (", and a recompute that read the second value across a threshold computed otherwise: its step's "
                "gradients differ too." if diverged else "(this step's are right).") if read_again else
             " Each step then leaves them other than a run without AC does (a batch norm's running statistics: "
             "evaluation reads them), though this step's gradients are right.")
    if saved:
        rest = (f" The in-place update{'s' if len(in_place) > 1 else ''} of {', '.join(in_place[:3])} still runs "
                "twice (a batch norm's `num_batches_tracked` only matters with momentum=None): move it out of the "
                "checkpointed forward, or keep the module out of the region." if in_place else "")
        return Suggestion(
            f"Save {', '.join(saved)} with selective activation checkpointing, so the recompute does not update "
            f"{shown} again",
            f"The recompute runs {', '.join(saved)} again, and it updates {shown} as it computes." + after
            + " With its outputs saved (selective AC), the recompute reuses them and does not run it again; or run "
            "that module outside the checkpointed region." + rest,
            sac_policy(saved, torch_version))
    return Suggestion(
        f"Update {shown} before the forward that reads it, outside the checkpointed region" if read_again else
        f"Apply the update of {shown} once per step, outside the checkpointed forward",
        f"The region's code updates {shown} in place, and the recompute runs that code again." + after
        + (" Its code reads the updated value: make the update in the training loop right before the forward (which "
           "then reads what it read without AC; after the backward would be a step late)" if read_again else
           " Move the update after the backward (or into an optimizer step hook)")
        + ", or skip it while the recompute runs (a flag the training loop sets around loss.backward()).", code)


def _names(names: list[str]) -> str:
    return backticked(sorted(set(names)))


def _step_hook_code(name: str) -> str:
    """An optimizer step hook that applies the update of `name` (where to move an update out of the forward)."""
    return ("def update_after_step(optimizer, args, kwargs):\n"
            "    with torch.no_grad():\n"
            f"        ...  # the update of {name.rsplit('.', 1)[-1]} goes here, from what the forward kept\n\n"
            "optimizer.register_step_post_hook(update_after_step)\n"
            "# with gradient accumulation the hook runs once per optimizer step: make the update right after each\n"
            "# micro-batch's loss.backward() instead, where the run without AC made it once per forward")


def _under(name: str, module: str | None) -> str:
    """`name` as the checkpointed module's code reads it, after `self.`: "cfg.amp_dtype" for `blocks.0.cfg.amp_dtype`
    in blocks.0; its last part where the module does not hold it."""
    return name[len(module) + 1:] if module and name.startswith(f"{module}.") else name.rsplit(".", 1)[-1]


def _updated_in_forward(region: Region, name: str) -> Suggestion:
    """The fix for state the region's own forward updates in place, as a run without AC computes: an update the
    forward then reads (a normalizer's statistics) moves before the checkpoint call, or is skipped in the recompute;
    one made after the forward read the state (an EMA, a load-balancing bias) moves after the backward (after the
    checkpoint call is too early: the recompute runs in the backward). A log names the tensor by its number in the
    dump only (`$49`, another in the recompute's list): it is named by the op that updates it."""
    if is_log_id(name):  # (the recompute's list numbers its tensors anew: its update is the same op at that line)
        writer = writer_op_in(region.forward, name)
        shown = (f"`{name}` (torch's number for the tensor "
                 f"{f'{writer.op} at {where(writer.module, writer.source)}' if writer else 'an in-place op'} writes)")
        leaf, owner = "that tensor", ""
        again = writer is not None and region.recompute is not None and any(
            (o.op, o.module, o.source) == (writer.op, writer.module, writer.source) for o in region.recompute.ops)
    else:
        shown, (owner, leaf) = f"`{name}`", split_name(name)
        again = writer_in(region.recompute, name) is not None  # (torch's early stop can end it before the update)
    recompute = ("runs that update a second time, from the updated value, and computes with it" if again else
                 "computes with the updated value, not the one the forward read")
    module = f'model.get_submodule("{owner}")' if owner else "block"
    if read_after_write(region.forward, name):
        return Suggestion(
            f"Update {shown} before the checkpoint call, not inside the checkpointed region",
            f"The region's forward updates {shown} in place and then computes with the updated value; the recompute "
            f"{recompute}. Make the update in the caller, right before the checkpoint call: the forward computes "
            "with the updated value as it did, the recompute reads that same value and updates nothing, and the "
            "training is that of a run without AC. Where the update needs what the region computes first, skip it "
            "while the recompute runs instead (a flag the training loop sets around loss.backward()).",
            f"with torch.no_grad():\n    ...  # the update of {leaf} that forward() made first, moved here\n"
            "out = checkpoint(block, x, use_reentrant=False)  # forward() only reads it now\n"
            "# or, in forward(): `if not self.in_backward: <the update>`, and around the backward:\n"
            f"#   {module}.in_backward = True; loss.backward(); {module}.in_backward = False")
    return Suggestion(
        f"Apply the update of {shown} after the backward, not inside the checkpointed region: its recompute "
        + ("runs it again" if again else "reads the updated value"),
        f"The region's own forward (or a hook inside it) computes with {shown} and then updates it in place, so the "
        f"recompute {recompute}. Keep what the update needs (return it from the checkpointed function), and apply "
        "it after `loss.backward()`, best after `optimizer.step()` from an optimizer step hook: the recompute then "
        "reads the value the forward read (right after the checkpoint call is too early: the recompute runs inside "
        "the backward).",
        _step_hook_code(leaf) + "\n"
        "# or: out, new_state = checkpoint(block_fn, x, use_reentrant=False)  # block_fn returns the new value\n"
        "#     loss.backward()\n"
        "#     with torch.no_grad(): state.copy_(new_state)  # applied once, after the backward")


def suggestions_for(report: RegionReport, region: Region, torch_version: str | None = None) -> list[Suggestion]:
    cause = report.cause
    out: list[Suggestion] = []
    kind = cause.kind if cause else "unknown"
    mechanism = cause.mechanism if cause else None
    attribute = (attribute_suggestion(region, cause.tensor)  # (not set for each forward: that fix is an argument)
                 if kind in ("state_mutation", "control_flow") and cause and cause.tensor
                 and mechanism != LATER_FORWARD else None)
    if kind == "state_mutation" and mechanism == "optimizer_step":
        out.append(Suggestion(
            "Update the parameters only after the backward of every forward that read them",
            "The parameters changed between this region's forward and its backward, so the recompute ran with the "
            "updated weights. Call optimizer.step() (and zero_grad()), clip weights in place (`p.data.clamp_`, "
            "a WGAN critic's), or copy an EMA into the model only after every forward that read them has run its "
            "backward: with gradient accumulation or a micro-batch schedule, after the window's last backward; "
            "never between one forward and its backward.",
            "for micro_batch in window:\n    loss = model(micro_batch).loss / len(window)\n    loss.backward()\n"
            "optimizer.step()       # after the last backward of the window\noptimizer.zero_grad()\n"
            "for p in model.parameters():\n    p.data.clamp_(-c, c)  # weight clipping: here too, not before a backward"))
    elif kind == "rng" and mechanism == LAZY_INIT:
        out.append(Suggestion(
            "Initialize lazy modules before training, outside activation checkpointing",
            "A lazy module (nn.LazyLinear, LazyConv...) materialized and initialized its parameters in its first "
            "forward, inside the checkpointed region: the recompute skipped that initialization, so every random op "
            "after it drew other numbers. Run one forward without checkpointing first (a dry run on a sample "
            "batch), then build the optimizer.",
            "with torch.no_grad():\n    model(sample_batch)   # materializes the lazy modules, outside AC\n"
            "optimizer = torch.optim.AdamW(model.parameters())"))
    elif kind == "rng" and mechanism == ONE_PASS_DRAW and cause is not None:
        maker = (cause.source or "").rpartition(" in ")[2] or "make_value"  # the function that drew it
        out.append(Suggestion(
            f"Make the value {cause.tensor} draws before the checkpoint call, and pass it in",
            f"{cause.tensor} draws from torch's generator in one pass of the region only (a table a cached helper, "
            "`functools.lru_cache` or a dict, makes on its first call: the forward misses the cache, the recompute "
            "finds it filled). checkpoint restores the generator's state for the recompute, but the draws after it "
            "then stand at another offset, so the region's later random ops draw other numbers. Make the value once "
            "outside the region (at model init, or before the checkpoint call) and hand it to the checkpointed "
            "function, or draw it from a torch.Generator of its own.",
            f"value = {maker}(...)   # the draw, made outside the checkpointed region\n"
            "out = checkpoint(block, x, value, use_reentrant=False)   # forward(x, value) reads it"))
    elif kind == "control_flow" and mechanism == HOOKS:
        out.append(Suggestion(
            "Register and remove module hooks between steps, not between a forward and its backward",
            f"The hook `{cause.tensor}` was on the region's modules in one pass only: checkpoint's recompute, in the "
            "backward, runs every hook registered then. Remove a probe's or an ablation's hook before "
            "`loss.backward()` (a context manager around the probe), or run the probe after the step.",
            "handle = model.blocks[1].act.register_forward_hook(ablate)\ntry:\n    with torch.no_grad():\n"
            "        probe_loss = loss_fn(model(x), y)\nfinally:\n    handle.remove()    # before loss.backward()\n"
            "loss.backward()"))
    elif kind == "sac_policy" and cause is not None:
        ops = cause.names or [cause.tensor]
        random = any(is_random_name(op or "") for op in ops)
        writer = ops[-1]
        if len(ops) == 2 and not is_in_place_method(ops[0]):  # (the saved op is the policy's point: keep it saved)
            method = packet(writer)
            out.append(Suggestion(
                f"Make {method} out of place: it changes a tensor the selective-AC policy saves ({ops[0]})",
                f"The policy saves the output of {ops[0]}, and the forward then changes that tensor in place with "
                f"{method}; the cached tensor is no longer what was saved, and the recompute changes it again. "
                f"Compute the new value into a new tensor instead: the policy keeps saving {ops[0]}.",
                f"x = x.{method.rstrip('_')}(...)  # was: x.{method}(...), on the output of {packet(ops[0])}"))
        out.append(Suggestion(
            f"Do not save {' or '.join(ops)} in the selective-AC policy: the forward changes that tensor in place",
            f"The policy's MUST_SAVE of {ops[0]} keeps a tensor that a later op of the forward modifies in place, and "
            "torch refuses a cached tensor that changed. Return PREFER_RECOMPUTE for it and for the op that changes it "
            "(an in-place op is never safe to save); save an out-of-place op after them instead, if memory matters."
            + (" One draws random numbers: recomputed, it must draw what the forward drew, so checkpoint with "
               "preserve_rng_state=True (the default)." if random else ""),
            "from torch.utils.checkpoint import CheckpointPolicy\n\ndef policy(ctx, op, *args, **kwargs):\n"
            f"    if op in ({', '.join(f'torch.ops.{op}' for op in ops)},):  # changed in place after it is made\n"
            "        return CheckpointPolicy.PREFER_RECOMPUTE\n    ...  # the rest of the policy as before\n"
            + ("checkpoint(block, x, use_reentrant=False, context_fn=partial(create_selective_checkpoint_contexts, "
               "policy), preserve_rng_state=True)" if random else "")))
    elif kind == "state_mutation" and mechanism == REQUIRES_GRAD:
        out.append(Suggestion(
            "Freeze or unfreeze parameters between steps, not between a forward and its backward",
            "requires_grad_() changed on parameters the region reads after its forward ran, so its recompute, in the "
            + ("backward, built the graph that backward runs on with the new setting: those parameters get gradients "
               "the forward's setting would not give them. "
               if report.kind == "reentrant" else
               "backward, saved the tensors the new setting needs, not those the forward saved: torch raises, or that "
               "backward's gradients are wrong. ")
            + "Apply a freezing schedule after optimizer.step(), before the next forward.",
            "loss.backward()\noptimizer.step()\noptimizer.zero_grad()\n"
            "if step == unfreeze_step:  # between steps: every forward and its recompute see the same setting\n"
            "    for p in block.parameters():\n        p.requires_grad_(True)"))
    elif kind == "state_mutation" and mechanism == REBOUND and cause.tensor and not cause.tensor.startswith("param"):
        names = cause.names or [cause.tensor]
        attrs = list(dict.fromkeys(re.sub(r"\[\d+\]$", "", n.rsplit(".", 1)[-1]) for n in names))
        text = (f"The region reads {backticked(names)} from attributes that code rebinds between its forward and its "
                "backward (state carried from call to call, a cache rebuilt for a longer input: the region's own code, "
                "or a later call of it). checkpoint keeps its arguments for the recompute, an attribute is read as it "
                "is when the backward runs: hand them in as arguments")
        if len(attrs) == 1:
            attr = attrs[0]
            several = any(re.search(r"\[\d+\]$", n) for n in names)  # (a list or tuple of tensors: `mems[0]`)
            star = "*" if several else ""
            out.append(Suggestion(
                f"Pass `{attr}` into the checkpointed function and return its new value, instead of keeping it on the "
                "module", text + ", return the new state, and rebind the attribute outside the checkpointed function.",
                f"out, {star}{attr} = checkpoint(self.run_chunk, x, {star}self.{attr}, use_reentrant=False)  # "
                f"run_chunk(x, {star}{attr}) returns (out, {star}new_{attr})\n"
                f"self.{attr} = {f'tuple({attr})' if several else attr}  # rebound outside: the recompute uses its "
                f"argument{'s' if several else ''}"))
        else:
            out.append(Suggestion(
                f"Pass {backticked(attrs)} into the checkpointed function, instead of reading them from the module",
                text + " (all of them: each was rebound).",
                f"out = checkpoint(block, x, {', '.join('self.' + a for a in attrs)}, use_reentrant=False)  # block(x, "
                f"{', '.join(attrs)}) uses them, not the attributes"))
    elif kind == "state_mutation" and mechanism == REBOUND:
        out.append(Suggestion(
            "Pass the weights the region computes with to checkpoint as arguments",
            "The region reads its weights from Python state (a dict of weights for torch.func.functional_call, an "
            "attribute) that was bound to other tensors before its recompute ran, so the recompute computed with "
            "the new ones. checkpoint keeps its arguments for every recompute: pass the weights in, and look "
            "nothing up inside the checkpointed function.",
            "names = list(weights)\n\ndef region(x, *tensors):\n"
            "    return functional_call(model, dict(zip(names, tensors)), (x,))\n\n"
            "out = checkpoint(region, x, *weights.values(), use_reentrant=False)"))
    elif attribute is not None:
        out.append(attribute)
    elif kind == "state_mutation" and cause is not None:
        name = cause.tensor or "the tensor"
        if mechanism == "python_value":
            out.append(Suggestion(
                "Update the Python value after the backward, or pass it in as an argument",
                "The region reads a Python number (a schedule, a scale, a temperature) that changed before its "
                "recompute ran, so the recompute computed with the new one. Change it after loss.backward(), or "
                "pass it to the checkpointed function as an argument (checkpoint keeps its arguments for the "
                "recompute). A value drawn at random on the host (np.random, random) inside the region: draw it "
                "before the checkpoint call and pass it in.",
                "out = checkpoint(block, x, scale, use_reentrant=False)  # not self.scale read inside"))
        elif mechanism == UPDATED_IN_FORWARD and (report.first_value_divergence is not None
                                                  and report.first_value_divergence.op in OBSERVER_OPS
                                                  or f".{OBSERVER_MODULE}." in f".{name}"):
            out.append(Suggestion(
                "Turn the quantization observers off while the backward runs",
                f"The fake-quantize op updates its observer's running range (`{name}`) in place each time it runs, "
                "and the recompute runs it again, from the forward's update, so it quantizes with another scale. "
                "With the observers off during loss.backward(), the recompute quantizes with the scale the forward "
                "left, as the forward did.",
                OBSERVERS_OFF))
        elif mechanism == UPDATED_IN_FORWARD and ".parametrizations." in name:
            owner = name.split(".parametrizations.")[0]
            out.append(Suggestion(
                f"Compute `{owner}.weight` once per step, outside the checkpointed region",
                f"A parametrization of `{owner}` (spectral_norm's power iteration) updates `{name}` each time the "
                "weight is computed in training mode, so the recompute, which computes it again, starts from the "
                "updated state and updates it a second time. Enter torch.nn.utils.parametrize.cached() around the "
                "step and compute the parametrized weights before the checkpointed forward: the forward and the "
                "recompute then read the same weight (with several forwards per step, the iteration runs once per "
                "step instead of once per forward).",
                PARAMETRIZED_ONCE))
        elif mechanism == KEPT_OUTPUT_WRITTEN:
            out.append(Suggestion(
                f"Do not modify `{name}` in place: the region keeps it and its recompute reads it back",
                "The region's forward made this tensor and kept it (a cache it fills); code between the forward and "
                "the backward changed it in place, and the recompute, which finds it there instead of making it "
                "again, reads the changed values. Change a copy, or keep a copy in the cache.",
                "cache[key] = cache[key] * scale  # a new tensor: the one the forward made stays as it was\n"
                "# not: cache[key].mul_(scale)"))
        elif mechanism == SAVED_HOOKS:
            pack, unpack = region.forward.state.get("saved_hooks") or ("pack", "unpack")
            out.append(Suggestion(
                f"Make `{pack}` keep what it saves intact until `{unpack}` has returned it",
                "A non-reentrant checkpoint keeps the region's inputs through the saved-tensor hooks active around "
                f"it, and the recompute starts from what `{unpack}` returns. Here that differed from what the forward "
                "received: a staging buffer that a later pack reuses before this region's backward ran, or a lossy "
                "compression (every saved activation can be compressed, not the inputs a recompute starts from). "
                "Give each saved tensor a buffer of its own until it is unpacked, or size the pool by the tensors "
                "saved between a forward and its backward, not by the layers.",
                "def pack(t):\n    buf = free.pop() if free else torch.empty_like(t)  # no buffer another saved "
                "tensor holds\n    buf.copy_(t)\n    return buf\n"
                "# and return each buffer to `free` only once its backward is done (after loss.backward())"))
        elif mechanism == ARGUMENT_ITEMS:
            held = (report.state_changes.get("arguments") or {}).get("forward") or {}
            kind = (held.get(name) or {}).get("type", "list")  # (what the argument is: capture/state.argument_items)
            out.append(Suggestion(
                f"Give the region a copy of its {name} ({kind}), or change it only after the backward",
                f"checkpoint keeps the {kind} it was given for the recompute, not a copy, and the recompute reads it "
                "as it is when the backward runs: a caller that appends to it (a memory of past segments, a cache) "
                "or replaces an item between the forward and loss.backward() changes what the recompute computes. "
                f"Pass a copy of it (the caller's later changes then leave the region's alone), or change it after "
                "the backward.",
                f"out = checkpoint(layer, x, {kind}(mems), use_reentrant=False)  # a copy, not the {kind} itself\n"
                "mems.append(new_memory)  # the region keeps the copy it was given"))
        elif mechanism == "input":
            out.append(Suggestion(
                f"Do not modify the region's input in place after the forward ({report.module or 'region'})",
                "The recompute re-reads the region's inputs. Clone the tensor before the in-place update, or make "
                "the update out of place (`x = x + ...` instead of `x += ...`)."))
        elif mechanism == UPDATED_IN_FORWARD:
            out.append(_updated_in_forward(region, name))
        elif mechanism == LATER_FORWARD:
            attr = name.rsplit('.', 1)[-1]
            out.append(Suggestion(
                f"Pass what `{name}` holds to the checkpointed function as an argument",
                f"`{name}` is set for each forward of {report.module} (by the code around it, or in it), and later "
                "forwards (other micro-batches or chunks) ran before this region's recompute, which reads what the "
                "last one left. An update after "
                "the backward cannot serve each forward: hand the value to the checkpointed function instead "
                "(checkpoint keeps its arguments for the recompute), or run each forward's backward before the next "
                "forward.",
                f"{attr} = ...  # what this forward sets `{attr}` to (a scale, a table for its length), outside the "
                f"region\nout = checkpoint(block, x, {attr}, use_reentrant=False)  # forward(x, {attr}) computes with "
                f"it, not self.{attr}"))
        else:
            out.append(Suggestion(
                f"Update `{name}` after the backward, not between forward and backward",
                f"`{name}` is read by the checkpointed region and changed before its recompute ran, so the "
                "recompute sees another value. Keep in the forward what the update needs, and apply it after "
                "`loss.backward()` - best after `optimizer.step()`, e.g. from an optimizer step hook - not in a "
                "forward hook or inside forward(). Where another forward needs the new value before this backward "
                "(a cache rebuilt for a longer sequence, an adapter switched for another task), pass the value to the "
                "checkpointed function as an argument instead (checkpoint keeps its arguments for the recompute), or "
                "run this forward's backward before changing it.",
                _step_hook_code(name) + "\n# or: out = checkpoint(block, x, value, use_reentrant=False)  # forward(x, "
                f"value) computes with `value`, not self.{_under(name, report.module)}"))
    elif kind == "lost_gradient" and mechanism == "side_output":
        out.append(Suggestion(
            "Use use_reentrant=False: a reentrant region's tensors reach a loss only through its outputs",
            "With use_reentrant=True the region's forward runs under no_grad: a tensor it hands out another way (a "
            "hook's list, as Hugging Face collects router logits for the load-balancing loss, a module attribute) "
            "requires no grad, so an auxiliary loss computed from it trains nothing. use_reentrant=False records "
            "the forward's graph as usual; or return the tensor from the checkpointed function.",
            "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={\"use_reentrant\": False})\n"
            "# or: out = checkpoint(block, x, use_reentrant=False)"))
    elif kind == "lost_gradient" or report.unchecked_reason == NO_GRAD_INPUTS:
        out.append(Suggestion(
            "Use use_reentrant=False, or give the reentrant checkpoint an input that requires grad",
            "With use_reentrant=True, checkpoint's output requires grad only if one of its inputs does: a first "
            "block fed by a frozen embedding or by raw features gets no backward, and its parameters no gradient. "
            "use_reentrant=False tracks the parameters whatever the inputs. To keep use_reentrant=True, make the "
            "input require grad (Hugging Face: model.enable_input_require_grads(), as for LoRA on a frozen model).",
            "out = checkpoint(block, x, use_reentrant=False)\n"
            "# or, with use_reentrant=True: x.requires_grad_(True) before the first checkpointed block"))
    elif kind == "rng" and mechanism == "host_rng":
        out.append(Suggestion(
            f"Draw the host random values outside the checkpointed region ({cause.source or 'see the cause'})",
            "preserve_rng_state restores torch's generators only: numpy's and Python's `random` keep advancing, so "
            "the recompute draws other numbers. Draw them before calling checkpoint and pass the tensor in "
            "(checkpoint keeps its arguments for the recompute), use a torch random op instead (its state is "
            "preserved), or save that generator's state when the forward starts and restore it in the recompute.",
            # (a draw that steers Python, a LayerDrop's branch, or any draw from Python's `random`; else a tensor made
            # from numpy's numbers)
            f"values = self.{held.rsplit('.', 1)[1]}.draw(...)  # `{held}`'s draw (randn, random, ...), moved out of "
            "the region\nout = checkpoint(block, x, torch.as_tensor(values), use_reentrant=False)  # block(x, values)"
            if (held := next((d for d in getattr(report, "host_draws", None) or () if "." in d
                              and d != "numpy.random"), None)) else
            "r = random.random()  # the draw, moved out of the region: the forward and the recompute agree\n"
            "out = checkpoint(block, x, r, use_reentrant=False)  # block(x, r) uses r (a skip, a mask offset)"
            if (cause.tensor or "").startswith("host random numbers")
            or "numpy.random" not in (getattr(report, "host_draws", None) or ()) else
            "noise = torch.from_numpy(np.random.randn(*shape).astype(np.float32))  # outside the region\n"
            "out = checkpoint(block, x, noise, use_reentrant=False)                # block(x, noise) uses it"))
    elif kind == "rng" and mechanism == "private_generator":
        out.append(Suggestion(
            f"Give the recompute the state your torch.Generator had in the forward ({cause.source or 'see the cause'})",
            "preserve_rng_state saves and restores torch's default generators only, not a torch.Generator your code "
            "creates and passes (`generator=`). Pass the generator's state into the checkpointed function and set "
            "it there, so the forward and the recompute draw the same numbers; or draw the random tensor outside "
            "the region and pass it in; or use the default generator.",
            GENERATOR_SWAP))
    elif kind == "rng":
        preserve = region.options.get("preserve_rng_state")
        out.append(Suggestion(
            "Keep the RNG state for the recompute: preserve_rng_state=True",
            "Random ops in the region (dropout, jitter noise) must draw the same numbers in the recompute. "
            "`preserve_rng_state=True` is checkpoint()'s default; something set it to False. Hugging Face: drop "
            "`\"preserve_rng_state\": False` from `gradient_checkpointing_kwargs`; torchtitan: "
            "`activation_checkpoint.preserve_rng_state = true`; `checkpoint_wrapper(block, preserve_rng_state=True)`.",
            f"checkpoint(block, x, use_reentrant={region.kind == 'reentrant'}, preserve_rng_state=True)"
        ) if preserve is not True else Suggestion(
            "Make the recompute start from the forward's RNG state",
            "checkpoint ran with preserve_rng_state=True, yet the random op drew other numbers: the generator it "
            "draws from is not one checkpoint restores. checkpoint saves the CPU generator and those of the devices "
            "its tensor arguments are on; a region whose inputs are all on the CPU but which draws on a GPU (or the "
            "reverse), or code that reseeds or draws between the passes in another thread, escapes it. Pass a "
            "tensor on the drawing device into the checkpointed function, or draw the random tensor outside the "
            "region and pass it in."))
    elif kind == "global_state" and cause is not None and cause.tensor == "training":
        out.append(Suggestion(
            "Keep the model's train/eval mode until the backward has run",
            "The recompute runs the modules in the mode they are in during backward: `model.eval()` (or `train()`) "
            "between the forward and loss.backward() makes batch norm use other statistics and dropout draw "
            "nothing in the recompute. Switch modes after the backward (and the optimizer step).",
            "loss = model(batch).loss\nloss.backward()\noptimizer.step()\nmodel.eval()  # after the backward"))
    elif kind == "global_state" and cause is not None and cause.tensor in KERNEL_FLAGS:
        label = flag_label(cause.tensor)
        change = report.state_changes.get(cause.tensor)  # (none from a log: its ops show the kernels, not the setting)
        out.append(Suggestion(
            f"Set {label} once for the whole step, not between the forward and the backward",
            (f"{label} was {change.get('forward')!r} in the forward and {change.get('recompute')!r} in the recompute: "
             if change else f"{label} differed between the forward and the recompute (they ran other kernels): ")
            + "the recompute runs inside loss.backward() under the setting of that moment, so it can pick other "
            "kernels than the forward did (TF32 or reduced-precision matmuls, another cuDNN or attention algorithm). "
            "Set it once, before the training loop, and leave it for the whole step; or set it back before "
            "loss.backward().", _set_once(cause.tensor, change.get("forward")) if change else None))
    elif kind == "global_state" and cause is not None and cause.tensor == PRECISION:
        out.append(Suggestion(
            "Make the precision the same in the forward and in the backward",
            "The recompute ran in another dtype than the forward, and nothing recorded says which setting chose it: "
            "an autocast entered around the forward only (or around loss.backward() only), its `enabled` or dtype "
            "switched between them, or a dtype attribute or global the region's code reads (a precision schedule) "
            "changed before the backward. Enter the same autocast around both, or inside the checkpointed function; "
            "change a dtype setting after the backward. `ac-diff run` on the script names the setting."))
    elif kind == "global_state" and cause is not None:
        out.append(Suggestion(
            f"Make `{cause.tensor}` the same in the forward and in the backward",
            "The recompute runs under the global state active during backward. Enter the same context "
            "(autocast, deterministic algorithms, dispatch/function modes, default dtype) around both the forward "
            "and loss.backward(), or move the setting inside the checkpointed function so it is replayed."))
    elif kind == "control_flow" and cause is not None and cause.mechanism == CACHE_HIT:
        out.append(Suggestion(
            "Fill the cache before the checkpointed forward, so that the forward and the recompute both read it",
            f"The forward filled a cache ({cause.tensor} at {cause.source or 'the region'}) that the recompute then "
            "read, so the two passes ran different ops. Compute the cached value before the checkpointed blocks run "
            "(inside `torch.nn.utils.parametrize.cached()`, read each parametrized weight once first), or leave this "
            "module out of activation checkpointing. Clearing the cache before the backward instead makes the "
            "recompute fill it again: that reproduces the forward only where filling it changes nothing else (not "
            "spectral_norm's, whose power iteration updates its vectors each time it runs: silently other weights).",
            "with torch.nn.utils.parametrize.cached():\n"
            "    for m in model.modules():          # fill the cache first: forward and recompute hit it alike\n"
            "        if torch.nn.utils.parametrize.is_parametrized(m):\n"
            "            for name in m.parametrizations:\n"
            "                getattr(m, name)\n"
            "    loss = model(batch)\n"
            "    loss.backward()"))
    elif kind == "control_flow" and cause is not None and cause.mechanism == GRAD_MODE:
        out.append(Suggestion(
            "Checkpoint with use_reentrant=False, whose forward runs with autograd on as its recompute does",
            "use_reentrant=True runs the forward under torch.no_grad() and the recompute with grad enabled, so a "
            "branch on torch.is_grad_enabled() (or on requires_grad) goes one way in each. use_reentrant=False runs "
            "both with autograd on. Else branch on `self.training` or an argument, not on grad mode.",
            "out = checkpoint(block, x, use_reentrant=False)"))
    elif kind == "control_flow":
        control = report.first_control_divergence
        out.append(Suggestion(
            "Make the region's control flow depend only on its inputs",
            f"Python code at {branch_sites(region, control) if control else 'the region'} "
            "took another branch in the recompute (a call counter, a cache, a flag flipped by the forward). Compute the "
            "condition outside the checkpointed function and pass it in, or reset the state before backward, or "
            "leave this module out of activation checkpointing."))
    elif kind == "sharded_parameter":
        out.append(Suggestion(
            "Gather sharded parameters in the recompute",
            "Parameters recomputed with shape [0] were freed after the forward (ZeRO-3 / FSDP). Use the framework's "
            "activation-checkpointing integration (DeepSpeed `deepspeed.checkpointing`, FSDP `apply_activation_"
            "checkpointing` / FSDP2 `fully_shard` after `checkpoint_wrapper`) so parameters are all-gathered again."))

    discrete = report.first_discrete_divergence
    value = report.first_value_divergence
    flipped = discrete is not None and discrete.detail.get("changed", discrete.detail.get("rows_changed")) != 0
    if discrete is not None and flipped and kind in ("nondeterministic_op", "unknown", "state_mutation") and (
            kind != "state_mutation" or _decision_carries_the_change(report, region, discrete.forward_index)):
        save = [discrete.op]
        feeder = _feeding_matmul(region, discrete.forward_index)
        if feeder:
            save.append(feeder)
        elif value is not None and value.op != discrete.op:
            save.append(value.op)
        out.append(Suggestion(
            f"Save {discrete.op} with selective activation checkpointing",
            f"{discrete.op} in {discrete.module or 'the region'} took a different discrete decision in the "
            "recompute; everything downstream (counts, split sizes, shapes) follows it. Saving its output"
            + (f" (and that of {save[1]}, the matmul feeding it)" if feeder else
               f" (and that of {save[1]})" if len(save) > 1 else "")
            + " makes the recompute reuse the forward's decision. "
            + (_sac_save_list_text(region, save) if region.options.get("sac") else
               f"In torchtitan: activation_checkpoint.mode = \"selective\", selective_ac_option = \"op\", and add "
               f"{', '.join(_torch_op(s) for s in save)} to the per-op save list (`_save_list` / "
               "`op_sac_save_list` in parallelize.py)."),
            sac_policy(save, torch_version)))
    if kind == "nondeterministic_op" and value is not None:
        out.append(Suggestion(
            f"Make {value.op} deterministic",
            "Call `torch.use_deterministic_algorithms(True)` (and set CUBLAS_WORKSPACE_CONFIG=:4096:8 on CUDA) to "
            "find or replace the nondeterministic kernel; for scatter/index_add style ops, a sort-based or "
            "deterministic variant avoids atomics."))
    if region.kind == "reentrant" and not region.watched and report.first_divergence() is None \
            and not any("use_reentrant=False" in s.title for s in out):  # (every op matched: the graph it runs on)
        out.append(Suggestion(
            "Use use_reentrant=False: the backward then runs on the forward's own graph",
            "Every op of the recompute matched the forward, yet with use_reentrant=True the backward runs on the "
            "graph the recompute built: what the recompute saw there (a value a custom autograd.Function kept on "
            "ctx, which parameters require grad) is what the backward uses. With use_reentrant=False the backward "
            "runs on the forward's graph; the recompute only refills the tensors it saved.",
            "out = checkpoint(block, x, use_reentrant=False)\n"
            "# Hugging Face: model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={\"use_reentrant\": "
            "False})"))
    if report.silent:
        out.append(Suggestion(
            LOUDER,
            "torch compared only shapes (or nothing) and raised no error, so the gradients of this region are wrong. "
            "Keep `ac-diff run --check` in CI to fail on any recompute divergence."))
    return out


def _sac_save_list_text(region: Region, save: list[str]) -> str:
    """For a region already under selective AC: which ops to add to its save list, which it already saves."""
    cached = {o.op for p in (region.forward, region.recompute) if p is not None for o in p.ops if o.cached}
    add = [_torch_op(s) for s in save if s not in cached] or [_torch_op(save[0])]
    have = [_torch_op(s) for s in save if s in cached]
    return ("This region already runs selective AC (torchtitan: activation_checkpoint.mode = \"selective\", "
            f"selective_ac_option = \"op\"): add {', '.join(add)} to the per-op save list (`_save_list` / "
            "`_op_sac_save_list` in parallelize.py, or the set your `context_fn` policy returns MUST_SAVE for)"
            + (f"; {', '.join(have)} is already in it." if have else "."))


def _feeding_matmul(region: Region, index: int | None) -> str | None:
    """The matmul whose output feeds the discrete op (the router gate), if the dataflow shows one."""

    if region.forward is None or index is None:
        return None
    ops = region.forward.ops
    start = next((o for o in ops if o.index == index), None)
    if start is None:
        return None
    for op in reversed(_producer_chain(ops, start, lambda o: "mm" in packet(o.op), limit=8)[:-1]):
        if packet(op.op) in ("mm", "addmm", "bmm", "matmul", "linear", "_grouped_mm"):
            return op.op
    return None


def _decision_carries_the_change(report: RegionReport, region: Region, decision: int | None) -> bool:
    """Would saving the decision make the recompute reproduce the forward? Only if the changed tensors
    reach no saved tensor that differs except through the decision (a bias used only to pick experts);
    where they also shift saved values directly, reusing the forward's decision would hide a divergence
    torch might have raised about, and leave the gradients silently wrong."""
    if region.forward is None or decision is None:
        return False
    changed = {c["name"] for c in report.changed_inputs}
    bypass: set[int] = set()  # forward ops the changed tensors reach without going through the decision
    for op in region.forward.ops:
        if op.index != decision and any(
                (r.kind == "op" and r.op_index in bypass) or (r.kind != "op" and r.name in changed)
                for r in op.input_refs):
            bypass.add(op.index)
    for p in report.positions:
        if not (p.values_differ or p.matches is False):
            continue
        if p.origin != "op" and p.name in changed or p.origin == "op" and p.forward_index in bypass:
            return False
    return True


def _producer_chain(ops: list[OpRecord], start: OpRecord, stop, limit: int = 8) -> list[OpRecord]:
    """Follow the first tensor input of `start` back through its producers until `stop(op)` holds."""
    by_index = {o.index: o for o in ops}
    chain = [start]
    current = start
    for _ in range(limit):
        ref = next((r for r in current.input_refs if r.kind == "op" and r.op_index in by_index), None)
        if ref is None:
            break
        current = by_index[ref.op_index]
        chain.append(current)
        if stop(current):
            break
    return list(reversed(chain))
