"""The one in-memory model of a checkpointed region's two passes.

Both sources of evidence produce it: the recorder (via trace files, `ac_diff.trace.read_run`) and the
parser of torch's own logs (`ac_diff.logs`). The diagnosis engine reads only this model.

    Run(source="trace", ranks=[0], regions=[
        Region(rank=0, region=3, module="layers.1", kind="checkpoint",
               forward=Pass(phase="forward", ops=[OpRecord(index=0, op="aten.mm.default",
                            module="layers.1.moe.router.gate", out=[TensorMeta((512, 8), "f32")],
                            fingerprint=[(12.5, 801.2)], ...), ...],
                            positions=[Position(position=0, op_index=None, origin="input", ...)]),
               recompute=Pass(phase="recompute", ...))],
        errors=[TorchError(kind="metadata_mismatch", rank=0, positions=[...])])

Values that came from a log rather than a recording are simply absent (`fingerprint=None`).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterable

FORWARD = "forward"
RECOMPUTE = "recompute"
PHASES = (FORWARD, RECOMPUTE)


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """Shape and dtype of one tensor, in PyTorch's short spelling (`f32[8, 8]`)."""

    shape: tuple[int, ...]
    dtype: str  # short name: f32, bf16, i64, b8, ...
    device: str = "cpu"

    def __str__(self) -> str:
        return f"{self.dtype}[{', '.join(str(s) for s in self.shape)}]"

    def to_json(self) -> list:
        return [list(self.shape), self.dtype, self.device]

    @classmethod
    def from_json(cls, data: list) -> TensorMeta:
        return cls(tuple(data[0]), data[1], data[2] if len(data) > 2 else "cpu")


@dataclass(slots=True)
class InputRef:
    """Where one tensor input of an op came from, within the same pass.

    kind: "op" (output `output` of op `op_index`), "param" / "buffer" (named `name`), "input" (the
    region's n-th input), "external" (a tensor made outside the region: captured, global, ...).
    """

    kind: str
    op_index: int | None = None
    output: int = 0
    name: str | None = None
    external: int | None = None  # index into Pass.externals

    def to_json(self) -> dict:
        return {k: v for k, v in (("k", self.kind), ("op", self.op_index), ("o", self.output or None),
                                  ("name", self.name), ("ext", self.external)) if v is not None}

    @classmethod
    def from_json(cls, d: dict) -> InputRef:
        return cls(d["k"], d.get("op"), d.get("o") or 0, d.get("name"), d.get("ext"))


@dataclass(slots=True)
class OpRecord:
    """One aten op as it ran in one pass."""

    index: int
    op: str  # "aten.split_with_sizes.default"
    module: str | None = None  # module FQN, wrapper names stripped; None when unknown
    source: str | None = None  # "moe.py:40 in forward" — the innermost user frame
    inputs: list[TensorMeta] = field(default_factory=list)
    # One entry per return of the op, by position (trace format 1.4): a TensorMeta for a tensor, None for
    # None (flash attention's cum_seq_q), the value of an int/float/bool (its max_q), a short text for
    # anything else ("list[3]"). Output j means the same op output in refs, fingerprints, kept values and
    # positions. Logs and traces before 1.4 list tensors only.
    out: list[Any] = field(default_factory=list)
    args: list[Any] = field(default_factory=list)  # non-tensor arguments as JSON values ("$" = a tensor)
    input_refs: list[InputRef] = field(default_factory=list)
    # One entry per output tensor: two position-weighted sums (see fingerprint.py), or None where not
    # fingerprinted (views, uninitialised memory, derived ops, not recorded).
    fingerprint: list[list[float] | None] | None = None
    host_value: Any = None  # for aten._local_scalar_dense and similar: the value handed to Python
    values: dict[str, Any] | None = None  # kept small outputs/inputs: {"out0": [...], "in0": [...]}
    cached: bool = False  # selective AC served it from the cache (recompute) / saved it (forward)
    random: bool = False  # consumes RNG (dropout, rand, bernoulli, ...)
    discrete: bool = False  # a discrete decision taken from values (topk, sort, argmax, histc, comparisons...)
    derived: bool = False  # elementwise op of measured inputs, not fingerprinted: its values follow from theirs
    log_ids: tuple[list[str], list[str]] | None = None  # ($N outputs, $N inputs) when parsed from a log
    damaged: bool = False  # parsed from a log line another writer cut into: outputs/arguments may be incomplete

    @property
    def key(self) -> tuple[str, str | None]:
        """What alignment pairs: the op and its module; from a log, which names no module, the op and its line where
        the dump's stacks give one (fc2's `t` is not an adapter's `t` that only the recompute ran)."""
        return (self.op, self.module if self.module is not None or self.log_ids is None else self.source)

    def tensor_outputs(self) -> list[tuple[int, TensorMeta]]:
        """(output index, meta) of each output that is a tensor."""
        return [(j, m) for j, m in enumerate(self.out) if type(m) is TensorMeta]

    def out_signature(self) -> list[Any]:
        """What the outputs are without their values: (shape, dtype) per tensor, the value of a non-tensor
        return among several (an int like flash attention's max_q is a size), None for None; a value returned
        alone (`.item()`) is the host value, compared as one, so here only its type."""
        if self.host_value is not None and len(self.out) == 1:
            return [type(self.out[0]).__name__]
        return [(m.shape, m.dtype) if type(m) is TensorMeta else m for m in self.out]


# How a nested region's output is named where the enclosing region reads it (recorder -> diagnosis)
NESTED_OUTPUT = "output of nested region "


@dataclass(slots=True)
class Position:
    """One saved-tensor position torch assigns (the i-th pack of the region in that pass)."""

    position: int
    meta: TensorMeta | None
    origin: str  # "op", "param", "buffer", "input", "external", "unknown"; watched passes: "saved", "output"
    op_index: int | None = None
    output: int = 0
    name: str | None = None  # an input's, a parameter's; for a watched pass's "saved" / "output" one, its module
    # the saved tensor's values (see fingerprint.py), None where not measured: a log, selective AC's cache; for a
    # view of a tensor its pass knows, the base's values, and `view` = [its offset from the base's, *its strides]
    fingerprint: list[float] | None = None
    view: list[int] | None = None


@dataclass(slots=True)
class External:
    """A tensor the region read that it did not produce: an input, parameter, buffer or captured one."""

    index: int
    kind: str  # "input", "param", "buffer", "external"
    name: str
    meta: TensorMeta
    fingerprint: list[float] | None = None
    first_op: int | None = None
    # a recompute's external the forward made and kept (a cache its code keeps, found there by the recompute):
    # (op index, output) in the forward, and its version as the forward ended and as the recompute read it
    made_by: tuple[int, int] | None = None
    versions: tuple[int, int] | None = None
    made_in: int | None = None  # a recompute's external another region's forward made (the region number)
    # the tensor object's id in its process (format 1.5, parameters; any but an input since: the same one in both
    # passes, updated in place, or another bound in its place: functional_call with a dict of weights updated
    # since, an attribute a later call rebound); no part of its equality
    obj: int | None = field(default=None, compare=False)
    requires_grad: bool | None = None  # a parameter's, as the pass read it (frozen or not: what its ops save)
    # a tensor from outside the region that requires grad and has a graph of its own (`holder.temb = embed(t)`, read
    # by the region, not passed to it): what a reentrant region's own backward runs on into
    graph: bool = field(default=False, compare=False)


@dataclass(slots=True)
class Pass:
    """One execution of a region: the original forward, or one recompute of it."""

    phase: str
    ops: list[OpRecord] = field(default_factory=list)
    positions: list[Position] = field(default_factory=list)
    externals: list[External] = field(default_factory=list)
    state: dict[str, Any] = field(default_factory=dict)  # global dispatch-relevant state at the start
    complete: bool = True  # False when the recording (or the log) stops inside this pass
    stopped_early: bool = False  # recompute stopped at the last saved position (torch's early stop)
    attempt: int = 0  # recompute number (a region can be recomputed more than once)
    # scalar Python attributes of the modules the pass called, at their first call ("blocks.0.step" -> 3), and
    # those a call changed (a forward pre-hook counting calls): name -> [before, after, the module's pre-hooks]
    attributes: dict[str, Any] = field(default_factory=dict)
    attribute_updates: dict[str, list] = field(default_factory=dict)
    # scalar module-level globals the code of those modules reads ("model.LOW_PRECISION" -> True), at the first
    # call of each forward, and the functions that read each ("model.py in forward")
    globals: dict[str, Any] = field(default_factory=dict)
    global_readers: dict[str, list] = field(default_factory=dict)
    global_updates: dict[str, list] = field(default_factory=dict)  # those the pass changed: [first reading, at its end]
    # a summarized pass (its region reproduced; write="diverged"): a digest of every value it measured
    values_digest: str | None = None
    # a recorded forward (format 1.4): (op index, output) of the tensors it made that outlived it (the region's
    # outputs, tensors its code kept); None where not recorded
    outputs: list[tuple[int, int]] | None = None
    # read_run(lazy=True): (byte offset, line number) of this pass's "ops" and "pass" lines in its trace file, not
    # yet decoded into `ops`, `positions`, `externals` (Run.ops_loader decodes them for the time a region is
    # diagnosed); None: those are complete
    deferred: list[tuple[int, int]] | None = field(default=None, repr=False, compare=False)


def exact_print(fp: Any) -> bool:
    """A float tensor's fingerprint as a recording writes it: its finite pair of weighted sums, then its exact bit
    sum ([s1, s2, bits], fingerprint.py), which tells any change at all where the pair may round one away."""
    return (type(fp) is list and len(fp) == 3 and type(fp[2]) is int and type(fp[0]) is float
            and type(fp[1]) is float and math.isfinite(fp[0]) and math.isfinite(fp[1]))


def is_log_id(name: object) -> bool:
    """Whether `name` is a tensor's number in a debug=True dump ("$49": all a log calls a tensor from outside the
    region), not a name a recording gives it ("layers.0.moe.expert_bias")."""
    return isinstance(name, str) and name.startswith("$")


def op_at(p: Pass | None, index: int | None) -> OpRecord | None:
    """The op of pass `p` at `index` (None if it is not there)."""
    return None if p is None or index is None else next((o for o in p.ops if o.index == index), None)


def ops_feeding(p: Pass, roots: Iterable[int]) -> set[int]:
    """The indices of `p`'s ops whose outputs reach the ops `roots` (indices), these included."""
    ops = {o.index: o for o in p.ops}
    seen: set[int] = set()
    todo = list(roots)
    while todo:
        i = todo.pop()
        if i in seen or i not in ops:
            continue
        seen.add(i)
        todo.extend(r.op_index for r in ops[i].input_refs if r.kind == "op")
    return seen


def op_count(p: Pass | None) -> int:
    """Ops a pass ran: the recorder's count, or the ops listed (0 for no pass, or where neither was measured)."""
    return 0 if p is None else int(p.state.get("n_ops") or len(p.ops))


@dataclass(slots=True)
class Region:
    """One checkpointed region: the call of checkpoint() and everything it ran."""

    rank: int
    region: int
    module: str | None
    kind: str = "checkpoint"  # "checkpoint" (non-reentrant), "reentrant", "log"
    parent: int | None = None
    options: dict[str, Any] = field(default_factory=dict)  # early_stop, determinism_check, preserve_rng_state, sac
    # what the trace says about the recording of the region
    recorded: bool = True  # False: the recorder saw the region but recorded none of its ops
    parent_phase: str | None = None  # the enclosing region's pass this one ran in (forward / recompute)
    ops_written: bool = True  # False: a clean region's ops were not kept (RecordOptions(write="diverged"))
    recomputes: int = 0  # recompute passes recorded
    damaged: str | None = None  # why its trace lines cannot be trusted ("line 12 of the trace, ...")
    forward: Pass | None = None
    recompute: Pass | None = None  # the first (torch compares each recompute's metadata with the forward's)
    later: list[Pass] = field(default_factory=list)  # recomputes after it, in order: each later backward through the
    # region (retain_graph=True, torch.autograd.grad then .backward()) recomputes it again, from the state of then
    compiled: list[str] = field(default_factory=list)  # modules run under torch.compile (invisible inside)
    # watch mode (capture/watch.py): the passes hold saved positions only (their digests), no ops; the step it ran in
    watched: bool = False
    step: int | None = None
    optimizer_steps: int = 0  # optimizer.step() calls before its forward (the recorder's count)
    function: str | None = None  # a checkpointed function that called no module (named by its caller, `module`)
    # the run stopped before its recompute: its inputs written in place since its forward ended (what torch's version
    # check stops a backward for), [(input index, meta, version at the forward's end, version when the run stopped)]
    inputs_written: list[tuple[int, TensorMeta, int, int]] = field(default_factory=list)
    values_recorded: bool = True  # False: recorded with --no-fingerprints (shapes, dtypes and op order; no values)
    # the forward's saved positions the backward passes read (checkpoint's unpack hook), over every backward that
    # finished; None where the trace does not say (a log, an older trace, a run stopped in its backward)
    unpacked: set[int] | None = None
    # of those, the ones only autograd nodes that computed some of their inputs' gradients read (`autograd.grad(loss,
    # x)` runs a linear's node for x's alone): position -> (node, the gradients' indexes among its inputs)
    partial_reads: dict[int, tuple[str, frozenset[int]]] = field(default_factory=dict)

    # NOTE [what the evidence can show]: diagnosis asks these, never where a region came from. A trace
    # records values, op order and whole passes, and knows every error torch raised; a debug=True log lists
    # shapes and arguments only, its ranks' lines can interleave, it can start or end inside a dump, and
    # it cannot show whether torch stayed silent about a region.
    @property
    def source(self) -> str:
        return "log" if self.kind == "log" else "trace"

    @property
    def has_values(self) -> bool:
        return self.kind != "log" and self.values_recorded

    @property
    def ops_in_order(self) -> bool:
        return self.kind != "log"

    @property
    def passes_whole(self) -> bool:
        return self.kind != "log"

    @property
    def sees_torch_silence(self) -> bool:
        return self.kind != "log"


@dataclass(slots=True)
class PositionMismatch:
    position: int | None
    saved: TensorMeta | None
    recomputed: TensorMeta | None


def error_words(kind: str) -> str:
    """What torch raised, by the kind of its TorchError, in words for a sentence ("torch raised ...")."""
    return _ERROR_WORDS.get(kind, kind.replace("_", " "))


_ERROR_WORDS = {
    "metadata_mismatch": "a metadata mismatch (CheckpointError)",
    "count_mismatch": "a count mismatch (CheckpointError: another number of tensors saved)",
    "more_saved_in_recompute": "CheckpointError: more tensors saved in the recompute than in the forward",
    "sac_not_found": "selective AC's \"not found in storage\" (the recompute ran an op the forward did not save)",
    "sac_mutated": "selective AC's \"cached tensor has been mutated\"",
    "other": "an error",
}


@dataclass(slots=True)
class TorchError:
    """An error torch.utils.checkpoint raised (recorded at the crash, or parsed from a log).

    One TorchError stands for every identical repetition of the error (`same_as`: kind, rank, region,
    counts and every position's metadata; the raw text may differ where another writer cut into it):
    a log that prints it 40,643 times gives TorchError(count=40643, first_line=7, last_line=1788249).
    """

    kind: str  # metadata_mismatch, count_mismatch, more_saved_in_recompute, sac_not_found, sac_mutated, other
    message: str
    rank: int | None = None
    positions: list[PositionMismatch] = field(default_factory=list)
    saved_count: int | None = None
    recomputed_count: int | None = None
    region: int | None = None  # region that raised it, when the recorder knows
    count: int = 1  # how many times it was raised (printed) identically
    first_line: int | None = None  # line of the log where its first / last repetition starts (None: not from a log)
    last_line: int | None = None
    compiled: bool = False  # the log's traceback before it runs through torch.compile's code (its compiled backward)

    def same_as(self) -> tuple:
        """What makes two errors the same error (hashable): repetitions share it, whatever their lines."""
        return (self.kind, self.rank, self.region, self.saved_count, self.recomputed_count,
                tuple((p.position, p.saved, p.recomputed) for p in self.positions))


@dataclass(slots=True)
class Run:
    """Everything known about one run (one rank's trace, or one log): regions and errors."""

    source: str  # "trace" or "log"
    path: str | None = None
    header: dict[str, Any] = field(default_factory=dict)  # a trace's header record, as written
    # what the trace says about the process (None where it does not say, and for logs)
    rank: int | None = None
    world_size: int = 1
    run_id: str | None = None  # the launch's id, the same in the traces of all its ranks
    argv: list[str] | None = None
    start_time: float | None = None
    torch_version: str | None = None  # the torch that ran it ("2.13.0+cpu"); None for a log
    exc_type: str | None = None  # the uncaught exception ("CheckpointError"), None when none was raised
    exc_message: str | None = None
    exc_in_backward: bool = False  # it unwound out of a backward (a hook's, a recompute's): the rest never recomputed
    exc_in_checkpoint: bool = False  # it came out of torch.utils.checkpoint's code (a checkpoint() call torch refused)
    exc_step: int | None = None  # the step whose forward began last when it struck (None: an older trace, a log)
    exit_code: int | None = None  # from the end record
    end_time: float | None = None
    regions: list[Region] = field(default_factory=list)
    errors: list[TorchError] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what the reader could not use, truncation, ...
    unreadable_ranks: list[int] = field(default_factory=list)  # ranks whose trace beside this one could not be read
    truncated: bool = False
    optimizer_steps: int | None = None  # optimizer.step() calls in the run (the end record's)
    spawned: int = 0  # processes the script started with spawn / forkserver, which ac-diff did not record
    # a truncated trace's process, by the pid and host its header names: True alive on this host (still running: a
    # slow rank, a live run), False gone, None unknown (another host, this process)
    running: bool | None = None
    exit_status: str | None = None  # "ok", "exception", "interrupted", "exit N"; None if unknown
    damaged: int = 0  # trace lines that failed their checksum or did not parse (see trace.py)
    # what the recorder's own errors cost (the end record's "lost"): {"passes": n, "ops": m, "positions": k,
    # "errors": [messages]}; None when it recorded everything
    recorder_lost: dict[str, Any] | None = None
    # torch.compile in the run (the end record's "compiled", capture/compiled.py): {"eager": --compiled eager,
    # "modules": compiled modules seen, "regions"/"graphs": checkpointed regions inside the graphs Dynamo compiled,
    # "mutations": [{"name", "kind", "op"}] state their bodies update in place}; None without compile
    compiled: dict[str, Any] | None = None
    # watch mode: {"step": last step, "full_from_step": N or None, "modules": {module: [compared, diverged, never
    # compared]}, "escalated": {module: {"diverged_step", "region", "from_step"}}} (the last "watch" record)
    watch: dict[str, Any] | None = None
    # read_run(lazy=True): `with run.ops_loader(region):` fills the region's deferred passes' ops, empties them after
    ops_loader: Callable[[Region], ContextManager[None]] | None = field(default=None, repr=False, compare=False)

    def loaded(self, region: Region | None) -> ContextManager[None]:
        """`with run.loaded(region):` the region's ops are there (decoded for the block where read lazily)."""
        if self.ops_loader is None or region is None:
            return contextlib.nullcontext()
        return self.ops_loader(region)
