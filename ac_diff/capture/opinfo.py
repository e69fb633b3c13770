"""What ac-diff needs to know about an aten op, computed once per overload and cached.

    op_info(torch.ops.aten.topk.default)
    -> OpInfo(name="aten.topk.default", fingerprint=True, random=False, discrete=True)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..dtypes import dtype_from_short, short_dtype  # noqa: F401 - their importers import them from here
from ..oprules import (COLLECTIVE_RESULT_OPS, COMPILED_GRAPH_OP, UNINITIALISED_OPS, is_collective, is_decision,
                       output_roles, split_op)


# Not views to autograd, but their output is their input's memory reshaped.
ALIASING_COPIES = frozenset({"_unsafe_view"})


@dataclass(frozen=True, slots=True)
class OpInfo:
    name: str
    fingerprint: bool  # worth a value fingerprint (not a view, not uninitialised memory)
    random: bool  # consumes the RNG
    discrete: bool
    # the output is its first input's memory under another shape (aten._unsafe_view, which `linear` and
    # `matmul` put after every mm of a 3-D input): its fingerprint can be the input's (see recorder)
    aliases_input: bool = False
    # an elementwise op that writes no input and draws no random numbers: its output is a function of its
    # inputs, bit for bit (the same kernel runs each element alike in both passes), so it cannot be where
    # values first diverge if its inputs were measured equal (see recorder: "derived" outputs)
    derivable: bool = False
    shares_values: bool = False  # a view or an aliasing copy: its values are its input's
    # a random op's arguments that can switch its drawing off: ((position, name), ...) of `dropout_p`
    # (SDPA: 0 draws nothing) and `train`/`training` (dropout, rrelu: False draws nothing); see `draws`
    random_switches: tuple[tuple[int, str], ...] = ()
    # the role of each return, by position (oprules.output_roles: data, RNG bookkeeping, unused)
    output_roles: tuple[str, ...] = ()
    # what must be fingerprinted before the op runs (fingerprint.FingerprintBatch holds CPU tensors until a flush):
    # None, nothing; ((position, name), ...), the tensors of those arguments it writes in place; FLUSH_ALL, everything
    # held (a framework hook's scope begins: FSDP frees an all-gathered parameter's storage in its post-forward hook);
    # BOXED_INPUTS, everything held, and the op's input list is copied for the record (a compiled graph call)
    before: tuple | None = None


FLUSH_ALL = ("all",)
# FLUSH_ALL for a compiled graph call, whose graph takes its inputs as one list it empties as it frees them
# (inductor's boxed calling convention): the recorder keeps a copy of that list to record what the call read
BOXED_INPUTS = ("all", "boxed")


# id(op) -> (op, OpInfo): keyed by id because an OpOverload's __hash__ is a Python function and this
# runs for every recorded op; the op is kept in the value, so its id is never reused
_cache: dict[int, tuple] = {}


def op_info(func) -> OpInfo:
    hit = _cache.get(id(func))
    if hit is None or hit[0] is not func:
        hit = _cache[id(func)] = (func, _compute(func))
    return hit[1]


def _compute(func) -> OpInfo:
    name = str(func)
    _, packet, _ = split_op(name)
    tags = getattr(func, "tags", ()) or ()
    is_view = bool(getattr(func, "is_view", False))
    random = torch.Tag.nondeterministic_seeded in tags if hasattr(torch, "Tag") else False
    discrete = is_decision(name)
    # c10d collectives run asynchronously: their outputs are not written until the wait, so a
    # fingerprint taken when the op returns reads memory still being filled (garbage, different
    # every pass). The values reach the next ops after the wait; those are fingerprinted.
    async_collective = is_collective(name) and packet not in COLLECTIVE_RESULT_OPS
    fingerprint = not is_view and packet not in UNINITIALISED_OPS and not async_collective
    schema = getattr(func, "_schema", None)
    mutates = bool(getattr(schema, "is_mutable", True))
    pointwise = hasattr(torch, "Tag") and torch.Tag.pointwise in tags
    switches = ()
    if random and schema is not None:
        switches = tuple((i, a.name) for i, a in enumerate(schema.arguments) if a.name in _RANDOM_SWITCHES)
    before = None
    if name == COMPILED_GRAPH_OP:
        before = BOXED_INPUTS
    elif packet.startswith("_record_function_enter"):
        before = FLUSH_ALL
    elif mutates:
        written = tuple((i, a.name) for i, a in enumerate(getattr(schema, "arguments", ()))
                        if a.alias_info is not None and a.alias_info.is_write)
        before = written or FLUSH_ALL
    return OpInfo(
        name=name,
        fingerprint=fingerprint,
        before=before,
        random=random,
        random_switches=switches,
        discrete=discrete,
        aliases_input=packet in ALIASING_COPIES,
        derivable=pointwise and fingerprint and not random and not discrete and not mutates,
        shares_values=is_view or packet in ALIASING_COPIES,
        output_roles=output_roles(name),
    )


_RANDOM_SWITCHES = frozenset({"dropout_p", "train", "training"})


def draws(info: OpInfo, args: tuple | list, kwargs: dict) -> bool:
    """Does this call of a random op really draw from a generator? Not an SDPA with `dropout_p=0`, not a
    dropout with `train=False`: their results are deterministic functions of their inputs."""
    if not info.random:
        return False
    for i, name in info.random_switches:
        value = args[i] if i < len(args) else kwargs.get(name)
        if value is None:  # left at its default (dropout_p=0.0, train unset: torch's default draws)
            if name == "dropout_p":
                return False
            continue
        if value == 0 or value is False:
            return False
    return True
