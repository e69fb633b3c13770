"""What an op name says about the op: the rules capture, the log parser and diagnosis share, defined once.

    split_op("aten.max.dim")             -> ("aten", "max", "dim")
    packet("aten.topk.default")          -> "topk"
    is_decision("aten.max.dim")          -> True   (picks indices)
    is_decision("aten.max.other")        -> False  (elementwise maximum: no choice)
    packet(name) in CHOOSER_OPS          topk chooses; histc is a decision too, but only counts
    is_in_place_method("aten.add_.Tensor") -> True
    is_host_read("aten._local_scalar_dense.default") -> True   (`.item()`: the value goes to Python)
    is_outside_update("aten.add_.Tensor", "buffer") -> True  (a counter bumped in place)
    HOOK_ONLY_OPS, REENTRANT_ONLY_OPS    ops one pass has and the other not, values unchanged

    written_arguments("aten.add_.Tensor") -> (0,)   (from the schema; batch norms by their `training` flag)
    written_inputs(name, args, refs)     the references of the arguments an op writes in place (`out=` too)
    is_view_op("aten.view.default")      -> True
    output_roles("aten._scaled_dot_product_efficient_attention.default")
                                         -> ("data", "data", "rng", "rng")   (from the schema's return names)

Works on names alone (recorded or parsed from a log); torch is asked only for a named op's schema.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable


def split_op(name: str) -> tuple[str, str, str]:
    """("aten", "topk", "default") for "aten.topk.default"; a name without dots is its own packet:
    ("", name, "")."""
    parts = name.split(".")
    if len(parts) < 2:
        return "", name, ""
    return parts[0], parts[1], parts[-1] if len(parts) >= 3 else ""


def packet(name: str) -> str:
    """The op without namespace and overload: "aten.topk.default" -> "topk"."""
    return split_op(name)[1]


def namespace(name: str) -> str:
    return split_op(name)[0]


# Ops whose output is a discrete decision taken from values: a near-tie flips them.
DECISION_OPS = frozenset({
    "topk", "sort", "argsort", "argmax", "argmin", "max", "min", "histc", "bincount", "nonzero",
    "nonzero_static", "unique", "_unique", "_unique2", "unique_dim", "unique_consecutive", "where",
    "kthvalue", "mode", "searchsorted", "bucketize", "masked_select", "multinomial", "_local_scalar_dense",
    "eq", "ne", "gt", "lt", "ge", "le", "isin", "cummax", "cummin", "msort",
})
# `max`/`min` decide only in the overloads that return indices (`.dim`, `.dim_max`): the full reduction
# (`.default`) returns a value and the elementwise one (`.other`, like `maximum`) picks nothing.
_DECIDING_OVERLOADS = {"max": frozenset({"dim", "dim_max", "names_dim", "names_dim_max"}),
                       "min": frozenset({"dim", "dim_min", "names_dim", "names_dim_min"})}


def is_decision(name: str) -> bool:
    """An op that picks indices or entries from values (topk, sort, argmax, max.dim, comparisons...)."""
    _, op, overload = split_op(name)
    if op not in DECISION_OPS:
        return False
    overloads = _DECIDING_OVERLOADS.get(op)
    return overloads is None or overload in overloads


# Decisions that choose (which expert, which index); counting ops (histc, bincount) only pass a choice on.
CHOOSER_OPS = frozenset({"topk", "sort", "argsort", "argmax", "argmin", "max", "min", "kthvalue", "multinomial",
                         "nonzero", "unique", "_unique2", "unique_consecutive", "searchsorted", "bucketize", "mode"})
# Choosers whose decision is one of their outputs: which one (topk's indices are output 1, argmax's output 0).
DECISION_OUTPUT = {"topk": 1, "sort": 1, "argsort": 0, "argmax": 0, "argmin": 0, "max": 1, "min": 1, "kthvalue": 1}


# Namespaces of distributed collectives (functional and in-place c10d ops).
ASYNC_COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "c10d_functional", "c10d", "_c10d_functional_autograd"})
# Ops of those namespaces that hold a collective's finished result (after the wait).
COLLECTIVE_RESULT_OPS = frozenset({"wait_tensor", "_wrap_tensor_autograd"})


def is_collective(name: str) -> bool:
    return namespace(name) in ASYNC_COLLECTIVE_NAMESPACES


# Outputs that are uninitialised memory: their values mean nothing.
UNINITIALISED_OPS = frozenset({"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided",
                               "empty_permuted"})

# What an op's outputs are, by position, from the names its schema gives its returns (an output a kernel may
# leave unwritten must never be compared as data):
#   "data"   values the op computed;
#   "rng"    RNG bookkeeping (philox seed/offset, a flash kernel's rng_state): written only when the call draws
#            (dropout_p > 0); then a changed value is evidence that the passes drew differently, otherwise it
#            is uninitialised memory (`at::empty`, CUDA and ROCm alike);
#   "unused" placeholders and debug outputs (flash's `unused`, `debug_attn_mask` unless asked for).
DATA, RNG_BOOKKEEPING, UNUSED = "data", "rng", "unused"
_RNG_RETURNS = frozenset({"philox_seed", "philox_offset", "rng_state", "seed", "offset"})
_UNUSED_RETURNS = frozenset({"unused", "debug_attn_mask"})
# Outputs, by position, whose bytes are not values: a kernel's workspace or reserve space, kept for its own backward
# in its own layout with uninitialised padding (oneDNN's RNN workspace, cuDNN's and MIOpen's RNN reserve, cuDNN batch
# norm's reserve), and CTC's `log_alpha`, at::empty filled only up to each sample's input length. A real difference
# shows in the op's other outputs (the RNN's output and states, the loss).
_NOT_VALUES = {"_ctc_loss": frozenset({1}), "mkldnn_rnn_layer": frozenset({3}), "_cudnn_rnn": frozenset({3}),
               "miopen_rnn": frozenset({3}), "cudnn_batch_norm": frozenset({3})}
_roles: dict[str, tuple[str, ...]] = {}


def output_roles(name: str) -> tuple[str, ...]:
    """The role of each of op `name`'s returns (DATA, RNG_BOOKKEEPING, UNUSED), by position; every output of
    an op that allocates uninitialised memory is UNUSED; () for an op whose schema is unknown (all data)."""
    uninitialised = packet(name) in UNINITIALISED_OPS
    opaque = _NOT_VALUES.get(packet(name), frozenset())
    return _from_schema(_roles, name, lambda schema: tuple(
        UNUSED if uninitialised or r.name in _UNUSED_RETURNS or k in opaque else RNG_BOOKKEEPING
        if r.name in _RNG_RETURNS else DATA for k, r in enumerate(schema.returns)))


def output_role(name: str, output: int) -> str:
    roles = output_roles(name)
    return roles[output] if output < len(roles) else DATA


def holds_values(role: str, drew: bool) -> bool:
    """Whether an output of this role holds values worth comparing in a call that did (not) draw random numbers:
    data does; RNG bookkeeping only when the call drew (else its kernel left it unwritten); unused outputs never."""
    return role is DATA or role is RNG_BOOKKEEPING and drew


# Ops autograd and checkpoint machinery add to one pass and not the other (the recompute's pack hook,
# saved outputs without hooks, selective AC's cache all detach). A detach never changes values.
DETACH = "aten.detach.default"  # also what the recompute's pack hook logs for each saved tensor
CAST = "aten._to_copy.default"  # a dtype or device cast (`x.to(torch.bfloat16)`, autocast's casts of the weights)


# The fused attention kernels scaled_dot_product_attention dispatches to (its math backend runs plain ops instead)
_ATTENTION_KERNELS = ("_scaled_dot_product_", "_flash_attention", "_efficient_attention", "_cudnn_attention")


def is_attention_kernel(name: str) -> bool:
    """A fused attention kernel (flash, memory-efficient, cuDNN, flash for CPU): which one runs, or the math
    decomposition, is the SDPA backend setting's choice."""
    return packet(name).startswith(_ATTENTION_KERNELS)


def is_autocast_weight_cast(name: str, autocast: bool, of_leaves: bool) -> bool:
    """Autocast's cast of a leaf (a weight that requires grad): autocast caches it until its context ends, so it
    outlives the region by that cache, not by anything the script keeps (never a side output)."""
    return autocast and of_leaves and name == CAST
HOOK_ONLY_OPS = frozenset({DETACH})
# Ops whose output is a fixed function of their input that keeps the order of a row, ties included (a cast, a softmax):
# a recompute's rounding noise enters before them, where the values were computed (audit.replay.origin_of).
_ORDER_KEEPING = frozenset({"_to_copy", "_softmax", "_log_softmax", "softmax", "log_softmax"})


def keeps_order(name: str) -> bool:
    return packet(name) in _ORDER_KEEPING


# Aliases with a version counter of their own: what `.data` dispatches (a write through one leaves the aliased
# tensor's version as it was).
DETACHED_ALIAS_OPS = frozenset({DETACH, "aten.alias.default"})
# Copies autograd adds in a reentrant recompute only (its forward ran under no_grad, so an in-place op
# on a tensor needed for backward was not guarded by a clone there).
REENTRANT_ONLY_OPS = frozenset({"aten.clone.default"})
# A compiled graph's call (inductor), recorded as one op whose first argument names the graph ("<compiled graph 3>").
COMPILED_GRAPH_OP = "inductor_compiled_code"

# Kinds of tensor reference that name state the region did not create.
OUTSIDE_KINDS = frozenset({"buffer", "param", "external"})


# torch.ao's fused observer + fake-quantize ops: they update the observer's running range (and scale) in place and
# quantize with it, so a recompute that runs them again computes with the forward's update
OBSERVER_OPS = frozenset({"aten._fused_moving_avg_obs_fq_helper.default", "aten.fused_moving_avg_obs_fake_quant.default",
                          "aten._fused_moving_avg_obs_fq_helper_functional.default"})
# The attribute torch.ao gives a fake-quantize's observer (`act_fq.activation_post_process.max_val`): one that is not
# fused updates its range with plain ops (a moving average's sub, mul, add)
OBSERVER_MODULE = "activation_post_process"


# Ops that hand a tensor's values to Python (`.item()`, `bool(t)`, `torch.equal`): what becomes of them there is not
# in the trace; a use of them by later ops shows as those ops' arguments or sequence.
HOST_READ_OPS = frozenset({"_local_scalar_dense", "is_nonzero", "equal"})


# Ops whose gradient is the identity wherever they leave their input as it was (clamp's backward passes the gradient
# where min <= x <= max, bounds included; not hardtanh's, which drops it at the bounds)
IDENTITY_WHERE_UNCHANGED = frozenset({"clamp", "clamp_min", "clamp_max", "clip"})


# Ops whose gradient reads no floating-point value of their inputs or output, only shapes, scalars and indices (a
# residual's add, a centering's sub, views, casts, sums, gathers): a value that differs in a reentrant recompute and
# reaches only such ops changes the outputs, not the gradients. In-place variants included; mul and div only by a
# Python scalar.
_VALUE_BLIND = frozenset({
    "add", "sub", "rsub", "neg", "sum", "mean", "cumsum", "clone", "contiguous", "_to_copy", "alias", "lift_fresh",
    "view", "_unsafe_view", "reshape", "view_as", "permute", "transpose", "t", "expand", "expand_as", "squeeze",
    "unsqueeze", "flatten", "unflatten", "narrow", "slice", "select", "split", "split_with_sizes", "chunk", "unbind",
    "cat", "stack", "repeat", "constant_pad_nd", "index_select", "gather", "embedding", "where", "roll", "flip",
    "masked_fill", "masked_select", "masked_scatter", "scatter", "scatter_add", "index_add", "index_put", "index_fill",
    "topk", "sort", "kthvalue"})  # (a chooser's gradient goes to the entries its indices name: gradpath checks them)
# Ops whose output follows from their input's shape alone: no value passes through them
_SHAPE_ONLY = frozenset({"zeros_like", "ones_like", "empty_like", "full_like", "new_zeros", "new_ones", "new_empty",
                         "new_full"})
_VALUE_BLIND_BY_SCALAR = frozenset({"mul", "div"})
_VALUE_BLIND_OVERLOADS = {"max": "dim", "min": "dim"}  # (max.dim like topk; a full max's gradient reads ties)
# Ops whose kernels branch on a Python float argument's exact value, before casting it to the tensors' type (pow's
# fast paths for exponents 2, 3, 0.5, ...; float_power computes in double): a float equal in float32 may still compute
# other values
_EXACT_SCALAR_OPS = frozenset({"pow", "pow_", "float_power", "float_power_"})


def reads_scalars_exactly(name: str) -> bool:
    return packet(name) in _EXACT_SCALAR_OPS


# Positions of non-tensor arguments no gradient reads: the scalar an add or sub applies (`x + self.shift`), not its
# alpha, which scales the other operand's gradient
_BLIND_ARGUMENTS = {"add": frozenset({1}), "sub": frozenset({1}), "rsub": frozenset({1})}


def _out_of_place(name: str) -> str:
    """The packet of an op's out-of-place form: "add" for aten.add_.Tensor."""
    base = packet(name)
    return base[:-1] if is_in_place_method(name) else base


def blind_arguments(name: str) -> frozenset[int]:
    """The positions of an op's arguments whose value no gradient formula reads (see _BLIND_ARGUMENTS)."""
    return _BLIND_ARGUMENTS.get(_out_of_place(name), frozenset())


def reads_shape_only(name: str) -> bool:
    """An op whose output depends on its input's shape only (`zeros_like`): it passes no value on."""
    return packet(name) in _SHAPE_ONLY


def reads_values_in_backward(name: str) -> bool:
    """Whether an op's gradient may read the values it computed with (a mul.Tensor, a relu, a matmul; any op not
    known to be blind to them: see _VALUE_BLIND)."""
    base, overload = _out_of_place(name), split_op(name)[2]
    if base in _VALUE_BLIND or _VALUE_BLIND_OVERLOADS.get(base) == overload:
        return False
    return not (base in _VALUE_BLIND_BY_SCALAR and overload == "Scalar")


# Ops whose autograd node saves an input for other inputs' gradients alone: (node, saved input -> the inputs whose
# gradients read it). `autograd.grad(loss, x)` runs a linear's MmBackward0 for x's gradient, which reads the weight;
# it unpacks the saved input too, which only the weight's gradient reads.
_SAVED_FOR_OTHERS = {
    "aten.mm.default": ("MmBackward0", {0: {1}, 1: {0}}),
    "aten.bmm.default": ("BmmBackward0", {0: {1}, 1: {0}}),
    "aten.addmm.default": ("AddmmBackward0", {1: {2}, 2: {1}}),
    "aten.baddbmm.default": ("BaddbmmBackward0", {1: {2}, 2: {1}}),
    "aten.mul.Tensor": ("MulBackward0", {0: {1}, 1: {0}}),
    "aten.div.Tensor": ("DivBackward0", {0: {1}, 1: {0, 1}}),
    "aten.convolution.default": ("ConvolutionBackward0", {0: {1}, 1: {0}}),
}


def gradients_reading_input(name: str, node: str, index: int) -> set[int] | None:
    """The inputs (by index) whose gradients read op `name`'s tensor input `index` that its autograd node `node`
    saved; None where not known (any gradient of the node may read it)."""
    rule = _SAVED_FOR_OTHERS.get(name)
    return rule[1].get(index) if rule is not None and rule[0] == node else None


def is_host_read(name: str) -> bool:
    return packet(name) in HOST_READ_OPS


def updates_as_it_computes(name: str) -> bool:
    """An op that updates state while it computes a new output (a batch norm's running statistics): selective AC can
    save its outputs, and the recompute then does not run it (nor update the state) again. An in-place method's
    output is the state itself: saving it is refused ("Tensor cached during selective activation checkpoint has been
    mutated")."""
    return not is_in_place_method(name) and (packet(name) in _UNANNOTATED_STATS_UPDATES
                                             or bool(written_arguments(name)))


def is_in_place_method(name: str) -> bool:
    """An in-place method (`add_`, `lerp_`): its output is its first input, updated."""
    op = packet(name)
    return op.endswith("_") and not op.startswith("_")


def state_read(name: str, inputs: Iterable[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """The parameters and buffers an op reads, of its inputs' (kind, name): not the one an in-place method only
    updates (a counter's `add_`), which no value of the region depends on."""
    in_place = is_in_place_method(name)
    return [(kind, n) for i, (kind, n) in enumerate(inputs)
            if kind in ("param", "buffer") and not (in_place and i == 0)]


def is_outside_update(name: str, first_input_kind: str | None) -> bool:
    """An in-place op on a tensor the region did not create (its first input is a buffer, parameter or
    external): state updated as a side effect (a tokens-per-expert counter). The recompute repeats it,
    but no saved activation depends on it."""
    return first_input_kind in OUTSIDE_KINDS and is_in_place_method(name)


_written: dict[str, tuple[int, ...]] = {}
# Ops that update their running statistics (arguments 3 and 4) when `training` (argument 5) is true,
# without saying so in their schema.
_UNANNOTATED_STATS_UPDATES = frozenset({"native_batch_norm", "cudnn_batch_norm", "miopen_batch_norm",
                                        "_batch_norm_impl_index", "batch_norm"})


def written_arguments(name: str, args: list | tuple = ()) -> tuple[int, ...]:
    """Positions of the arguments an op writes in place, by op name (and its recorded arguments):
    (0,) for "aten.add_.Tensor", (3, 4) for a batch norm in training (its running statistics), from
    the schema's `Tensor(a!)` or, for the batch norms that do not declare it, their `training` flag;
    () for unknown ops and ops that write nothing."""
    if name.count(".") == 2 and packet(name) in _UNANNOTATED_STATS_UPDATES:
        return (3, 4) if len(args) > 5 and args[5] is True else ()
    if namespace(name) == "c10d" and packet(name).endswith("_"):
        return (0,)  # c10d's in-place collectives (allreduce_, alltoall_base_...) write their first argument, unsaid
    return _from_schema(_written, name, lambda schema: tuple(
        i for i, a in enumerate(schema.arguments)
        if not a.kwarg_only and a.alias_info is not None and a.alias_info.is_write))


def _from_schema(cache: dict[str, tuple], name: str, read: Any) -> tuple:
    """`read(schema)` of the op named `name`, once per name; () for an unknown op or an odd schema."""
    hit = cache.get(name)
    if hit is None:
        hit = ()
        with contextlib.suppress(Exception):  # an odd schema: nothing known
            schema = getattr(op_by_name(name), "_schema", None)
            if schema is not None:
                hit = read(schema)
        cache[name] = hit
    return hit


_random: dict[str, bool] = {}


def is_random_name(name: str) -> bool:
    """Whether the op named "aten.rand.default" draws from a generator (its schema's nondeterministic_seeded tag):
    what a log's op list says of randomness, where no recorder flagged it."""
    hit = _random.get(name)
    if hit is None:
        hit = False
        with contextlib.suppress(Exception):
            import torch

            hit = torch.Tag.nondeterministic_seeded in (getattr(op_by_name(name), "tags", ()) or ())
        _random[name] = hit
    return hit


def op_by_name(name: str):
    """The OpOverload named "aten.topk.default", or None (a library not loaded here, not an op name)."""
    import torch  # only for the schema of an op known by name (in-place writes, views)

    if name.count(".") != 2:
        return None
    ns, op, overload = split_op(name)
    try:
        return getattr(getattr(getattr(torch.ops, ns), op), overload)
    except (AttributeError, RuntimeError):
        return None


def written_keywords(name: str) -> tuple[str, ...]:
    """Names of the keyword-only arguments an op writes (`out` of "aten.div.out"), from its schema."""
    return _from_schema(_written_keywords, name, lambda schema: tuple(
        a.name for a in schema.arguments if a.kwarg_only and a.alias_info is not None and a.alias_info.is_write))


_written_keywords: dict[str, tuple] = {}


def written_inputs(name: str, args: list | tuple, refs: list | tuple) -> list:
    """The tensor references (recorder refs or `InputRef`s) of the arguments op `name` writes in place, its `out=`
    included: the recorded arguments hold "$" for each tensor, in the order of `refs`, keyword arguments last as
    {name: value}."""
    if not refs:
        return []
    positions = written_arguments(name, args)
    keywords = written_keywords(name)
    if not positions and not keywords:
        return []
    out = []
    ref = 0
    for i, a in enumerate(args):
        n = _tensor_count(a)
        if isinstance(a, dict):
            written = any(k in keywords for k in a)
        else:  # (a foreach op writes each of a list)
            written = i in positions and (n == 1 or isinstance(a, (list, tuple)))
        if written:
            out.extend(refs[ref:ref + n])
        ref += n
    return out


def _tensor_count(a) -> int:
    if isinstance(a, str):
        return int(a == "$")
    if isinstance(a, (list, tuple)):
        return sum(_tensor_count(x) for x in a)
    if isinstance(a, dict):
        return sum(_tensor_count(x) for x in a.values())
    return 0


_views: dict[str, bool] = {}


_SHARES_STORAGE = frozenset({"aten._unsafe_view.default"})  # not declared a view, yet its output is its input's memory


def aliases_its_input(name: str) -> bool:
    """Whether op `name`'s output is its first input's memory: a view, `_unsafe_view` (matmul's reshape of its
    result), an in-place method (`mul_`)."""
    return is_view_op(name) or name in _SHARES_STORAGE or is_in_place_method(name)


def is_view_op(name: str) -> bool:
    """Whether the op named "aten.view.default" returns a view of its input (False for unknown ops)."""
    hit = _views.get(name)
    if hit is None:
        hit = _views[name] = bool(getattr(op_by_name(name), "is_view", False))
    return hit
