"""The report model: a finished diagnosis, ready for any renderer, and its versioned JSON form.

    Report(verdict="diverged", torch_error=TorchErrorSummary(kind="metadata_mismatch", positions=[37, 38]),
           regions=[RegionReport(rank=0, region=3, module="layers.1", status="diverged", silent=False,
                                 cause=Cause(kind="state_mutation", tensor="layers.1.moe.expert_bias", ...),
                                 first_value_divergence=Divergence(op="aten.add.Tensor", ...), ...)])
    report.to_json()  ->  {"format": "ac-diff-report", "version": 1, "verdict": "diverged", ...}

Renderers (terminal, JSON, HTML) only format this; they never look at traces or logs. What they show
beyond the stored fields is decided here, once: the verdict's `title`, `silent`, the order regions are
detailed in (`diverged_regions`, `lead_groups`). These are derived from the fields, not stored, so a step
that changes the report after diagnosis (the --reference gradients turn a clean verdict into diverged)
never leaves a stale title behind.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

REPORT_FORMAT = "ac-diff-report"
REPORT_VERSION = 2  # 2: verdicts unchecked/damaged, title, groups, reference, remedies, fixes (README)

CLEAN = "clean"
DIVERGED = "diverged"
DAMAGED = "damaged"  # the trace lines of the region failed their checksum: nothing about it can be trusted
UNCHECKED = "unchecked"  # the region was never recomputed (no backward ran), so nothing to compare
# Report verdict `unchecked`: no region diverged, but nothing was compared (a truncated trace, a log without op
# lists) or the run crashed and left regions unchecked: nothing shows the run clean
TWO_RUNS = "two_runs"  # a region's kind in `ac-diff compare A B`: run A's pass against run B's
TWO_RUNS_WORDS = {CLEAN: "match", DIVERGED: "differ"}  # what its statuses mean there
# Every `Report.title`, by verdict (the README lists them: a CI gate can match them all)
TITLES = {
    "diverged": ("DIVERGED", "SILENTLY DIVERGED", "DIVERGED, GRADIENTS MATCH"),
    "clean": ("CLEAN", "CLEAN, SCRIPT FAILED", "CLEAN, SCRIPT INTERRUPTED"),
    "unchecked": ("CRASHED", "INTERRUPTED", "CUT SHORT", "RANKS MISSING", "AC COMPILED, NOT RECORDED",
                  "GRADIENTS AT RISK", "VALUES NOT COMPARED", "NOTHING CHECKED"),
    "damaged": ("TRACE DAMAGED",),
    "compared": ("RUNS DIFFER", "RUNS MATCH", "NOT ALL COMPARED"),  # `ac-diff compare A B` of two traces
}


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


class Mapped(list):
    """`[fn(x) for x in items]` for json's encoder, each item made when it is written, none kept."""

    def __init__(self, items: list, fn: Any) -> None:
        super().__init__()
        self._items, self._fn = items, fn

    def __iter__(self):
        return map(self._fn, self._items)

    def __len__(self) -> int:
        return len(self._items)


def _scalar_fields(row: Any) -> dict[str, Any]:
    """asdict() of a dataclass whose fields all hold str, int, bool or None, without asdict's deep copy
    (a report's position and window rows: most of the JSON of a long run)."""
    names = _FIELD_NAMES.get(type(row))
    if names is None:
        names = _FIELD_NAMES[type(row)] = tuple(f.name for f in fields(row))
    return {name: getattr(row, name) for name in names}


# One object per distinct position or window row: a long run's regions repeat them step after step (the
# same layer saves the same tensors), so a report of many regions holds what differs, not one copy per region.
_SHARED_LIMIT = 1 << 17
_shared: dict[Any, Any] = {}


def shared(row: "PositionRow | AlignedRow") -> Any:
    """The pooled object equal to `row` (rows are frozen: sharing one between regions is safe)."""
    hit = _shared.get(row)
    if hit is None:
        if len(_shared) >= _SHARED_LIMIT:  # many distinct rows (data-dependent shapes): start a new pool
            _shared.clear()
        hit = _shared[row] = row
    return hit


REORDERED_ONLY = "reordered_only"  # a discrete Divergence's detail: the same entries chosen, in another order


@dataclass(slots=True)
class Divergence:
    """One op where the two passes differ, located in both."""

    kind: str  # "value", "discrete", "shape", "control", "argument"
    op: str
    module: str | None
    source: str | None
    forward_index: int | None
    recompute_index: int | None
    summary: str  # one line: what differs
    detail: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def reordered_only(self) -> bool:
        """A top-k whose rows chose the same entries, some in another order (diagnosis/discrete.py)."""
        return bool((self.detail or {}).get(REORDERED_ONLY))

    @property
    def label(self) -> str:
        """The kind as a report names it: "dtype" for a metadata divergence where only dtypes changed."""
        return "dtype" if self.kind == "shape" and "dtype" in self.detail.get("differs", ()) else self.kind


@dataclass(slots=True, frozen=True)
class PositionRow:
    """A saved-tensor position, mapped to the op (or input / parameter) that produced it."""

    position: int
    op: str | None
    module: str | None
    source: str | None
    origin: str  # op, input, param, buffer, external, unknown
    name: str | None
    forward_index: int | None
    saved: str | None  # "f32[99, 5120]"
    recomputed: str | None  # None: not recomputed (early stop, or the recompute stopped before it)
    matches: bool | None  # None: cannot tell
    in_torch_error: bool = False
    values_differ: bool | None = None  # same metadata, different values: what torch cannot see
    cached: bool = False  # the recompute's tensor came from selective AC's cache (the forward's own, not recomputed)

    def to_json(self) -> dict[str, Any]:
        return _scalar_fields(self)


# the setting a dtype change names where nothing recorded which one it was (autocast, a dtype attribute, a global)
PRECISION = "the precision"
UPDATED_IN_FORWARD = "updated_in_forward"  # Cause.mechanism: state the region's own forward updates in place
LATER_FORWARD = "later_forward"  # ... state changed at or in a later forward of the module before this recompute
KEPT_OUTPUT_WRITTEN = "kept_output_written"  # ... a tensor the forward made and kept (a cache), changed in place since
REBOUND = "rebound"  # ... the parameters read are other tensor objects in the recompute
REQUIRES_GRAD = "requires_grad"  # ... parameters frozen or unfrozen between the passes
LAZY_INIT = "lazy_init"  # ... the forward initialized state with random draws, the recompute did not
RECEIVED = "received"  # ... the first op to differ computes with what a collective received from other ranks
ONE_PASS_DRAW = "one_pass_draw"  # ... one pass ran a random op the other did not (a cache filled by a draw)
GRAD_MODE = "grad_mode"  # ... a branch on grad mode, which use_reentrant=True turns off in the forward only
CACHE_HIT = "cache_hit"  # ... the recompute read back what the forward cached and skipped the ops that made it
HOOKS = "hooks"  # ... a module forward hook registered or removed between the forward and the backward
SAVED_HOOKS = "saved_hooks"  # ... the region's input came back changed from the user's saved-tensor hooks that kept it
ARGUMENT_ITEMS = "argument_items"  # ... a list or dict the region was given held other items in the recompute
# ... a nested region's input, kept by the enclosing checkpoint, came back from that region's recompute changed (the
# diagnosis then gives it the enclosing region's cause)
ENCLOSING_RECOMPUTE = "enclosing_recompute"


@dataclass(slots=True)
class Cause:
    kind: str  # state_mutation, rng, nondeterministic_op, global_state, control_flow, sharded_parameter, unknown
    tensor: str | None  # the tensor / flag / op it concerns
    detail: str
    evidence: list[str] = field(default_factory=list)
    # how, within the kind: rng -> default_generator, private_generator, host_rng, lazy_init; state_mutation ->
    # optimizer_step (most parameters changed), rebound (other tensors bound in their place), requires_grad
    # (parameters frozen or unfrozen before the backward), python_value (an argument), attribute (a module's Python
    # attribute, also under control_flow), global (a module-level global the module's code reads, also under
    # control_flow), input, input_written (the region writes its own input in place), updated_in_forward
    # (UPDATED_IN_FORWARD), kept_output_written (KEPT_OUTPUT_WRITTEN), saved_hooks (SAVED_HOOKS), tensor; control_flow
    # -> hooks (HOOKS), grad_mode (a branch
    # on grad mode under use_reentrant=True), cache_hit (the recompute read what the forward cached); None otherwise
    mechanism: str | None = None
    source: str | None = None  # where it entered: the line that drew the host value, or passed the generator
    # every piece of state it names, `tensor` first (each dropout's `p` a scheduler moved): what a restore must cover
    names: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class Suggestion:
    title: str
    text: str
    code: str | None = None
    status: str = "untested"  # verified / unverified / did not help / crashed (by an `ac-diff fix` try) / untested
    verify: str | None = None  # the one command that would verify it

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True, frozen=True)
class AlignedRow:
    """One row of the side-by-side view: a forward op, its recompute partner, and what differs."""

    how: str  # match, substituted, forward_only, recompute_only, not_recomputed
    forward_index: int | None
    recompute_index: int | None
    forward: str | None  # "aten.topk.default -> f32[512, 2], i64[512, 2]"
    recompute: str | None
    module: str | None
    marker: str | None  # None, "value", "discrete", "shape", "control", "cached", "inferred" (not measured; an input differs)


# a region report's first divergences, by kind (what a report built from another one takes over)
DIVERGENCE_FIELDS = ("first_value_divergence", "first_discrete_divergence", "first_shape_divergence",
                     "first_control_divergence", "first_argument_divergence")


@dataclass(slots=True)
class RegionReport:
    rank: int
    region: int
    module: str | None
    kind: str
    status: str
    silent: bool
    cause: Cause | None
    first_value_divergence: Divergence | None
    first_discrete_divergence: Divergence | None
    first_shape_divergence: Divergence | None
    first_control_divergence: Divergence | None
    positions: list[PositionRow]
    suggestions: list[Suggestion]
    chain: list[str]
    changed_inputs: list[dict[str, Any]] = field(default_factory=list)  # externals whose values differ
    state_changes: dict[str, Any] = field(default_factory=dict)  # global state keys that differ
    forward_ops: int = 0
    recompute_ops: int = 0
    counts: dict[str, int] = field(default_factory=dict)  # alignment summary
    window: list[AlignedRow] = field(default_factory=list)  # side-by-side rows around the first divergence
    notes: list[str] = field(default_factory=list)
    side_effects: list[str] = field(default_factory=list)  # in-place state updates the recompute repeats
    # the same, as (tensor, the op updating it, the module it ran in): what `fix` tries to save
    repeated: list[tuple[str, str, str | None]] = field(default_factory=list)
    host_draws: list[str] = field(default_factory=list)  # host generators its recompute drew from ("random")
    function: str | None = None  # a checkpointed function that called no module: `module` is its caller's

    @property
    def cause_label(self) -> str:
        """The cause as a regions table shows it: its kind; on a clean region (a kernel flag that could change its
        values elsewhere) a note ("note: global_state")."""
        if self.cause is None:
            return ""
        return ("note: " if self.status == CLEAN else "") + self.cause.kind

    @property
    def label(self) -> str:
        """How reports name the region: its module, and the function checkpointed in it ("blocks.0 (attention)")."""
        return f"{self.module or '?'} ({self.function})" if self.function else self.module or "?"
    source: str = "trace"  # trace or log
    path: str | None = None  # the trace or log file it was read from
    # a non-tensor, non-size argument (a Python float, a flag) that differs: not a shape divergence
    first_argument_divergence: Divergence | None = None
    unchecked_reason: str | None = None  # status unchecked: why, in a few words ("nested checkpoint inside a recompute")
    # what checkpoint() ran with, as far as the trace tells: {"preserve_rng_state": True, "early_stop": True, ...}
    checkpoint_options: dict[str, Any] = field(default_factory=dict)
    # watch mode compared this region by its saved tensors only (no ops); the step it ran in
    watched: bool = False
    step: int | None = None
    optimizer_step: int | None = None  # the optimizer step it ran in (from 1), where the run's steps are not those
    backward: int | None = None  # the backward pass (from 1) that ran the compared recompute, where torch tells it
    recompute_n: int = 1  # the recompute compared, from 1: a later one where a later backward's diverged
    enclosing: int | None = None  # the region whose forward ran this nested one (not written: the trace has it)
    backward_raised: str | None = None  # what the backward raised after its recompute, torch's check having let it by
    # a clean region's Python value that changed between its passes and reached no saved tensor (its cause and fixes
    # as if it had): what a watched divergence of the same module that did not recur here is named by
    absorbed: tuple | None = None
    # a clean region's chooser whose scores moved between the passes without flipping a choice: what a larger batch,
    # with rows nearer a tie, flips ("topk at moe.py:49: the scores moved by up to 0.001, closest margin 0.03")
    held_choice: str | None = None
    # a clean reentrant region's first op whose values differed in its recompute where no gradient formula reads them
    # (`x + y - shift`: "aten.sub.Tensor at blocks.0 (train.py:13 in forward)")
    unread_values: str | None = None
    # tensors its recompute updates again that its code reads only as a number an op that updates state takes (a
    # batch norm's momentum=None factor): no gradient changes, that op's state does (what `fix` must leave once)
    read_into: list[str] = field(default_factory=list)

    @property
    def has_values(self) -> bool:
        """False for a region read from a log: shapes and arguments, no values."""
        return self.source != "log"

    def first_divergence(self) -> Divergence | None:
        """The divergence to name for the region: the earliest of value / control (in forward order), else
        the discrete decision, else the shape divergence; a shape divergence at an earlier op than all of them
        comes first (a memory that grew: `cat` changed shape before any value differed)."""
        found = [d for d in (self.first_value_divergence, self.first_control_divergence,
                             self.first_argument_divergence) if d is not None]
        lead = min(found, key=lambda d: (d.forward_index is None, d.forward_index or 0)) if found else \
            self.first_discrete_divergence or self.first_shape_divergence
        shape = self.first_shape_divergence
        if lead is not None and shape is not None and shape.forward_index is not None and (
                lead.forward_index is None or shape.forward_index < lead.forward_index) and \
                (self.first_discrete_divergence is None or self.first_discrete_divergence.forward_index is None
                 or shape.forward_index < self.first_discrete_divergence.forward_index):
            return shape
        return lead

    @property
    def status_label(self) -> str:
        """The status as reports show it: "diverged (silent)" when torch raised nothing about it, "nested rerun" for
        a nested checkpoint its parent's recompute ran again."""
        if self.unchecked_reason == NESTED_RERUN:
            return NESTED_LABEL
        if self.unchecked_reason == NO_GRAD_CALL:
            return "no backward (no_grad)"
        if self.kind == TWO_RUNS:  # run A's region against run B's
            return TWO_RUNS_WORDS.get(self.status, self.status)
        return self.status + (" (silent)" if self.silent else "")

    def divergences(self) -> list[Divergence]:
        """Every first divergence found, in the order reports list them: forward order (a changed argument at op 2
        before the value it changed at op 6), kinds in this order at the same op."""
        found = [d for d in (self.first_control_divergence, self.first_value_divergence, self.first_argument_divergence,
                             self.first_discrete_divergence, self.first_shape_divergence) if d is not None]
        return sorted(found, key=lambda d: (d.forward_index is None, d.forward_index or 0))

    def module_of(self, d: Divergence) -> str:
        """Where divergence `d` ran, as a report names it: the root module (FQN "") by the name the region has."""
        return d.module or (self.module if d.module == "" else None) or ""

    def to_json(self) -> dict[str, Any]:
        data = {
            "rank": self.rank, "region": self.region, "module": self.module, "kind": self.kind,
            "status": self.status, "silent": self.silent,
            "cause": self.cause.to_json() if self.cause else None,
        }
        for name in DIVERGENCE_FIELDS:
            d = getattr(self, name)
            data[name] = d.to_json() if d else None
        data.update({
            "positions": [p.to_json() for p in self.positions],
            "suggestions": [s.to_json() for s in self.suggestions],
            "chain": list(self.chain), "changed_inputs": self.changed_inputs, "state_changes": self.state_changes,
            "forward_ops": self.forward_ops, "recompute_ops": self.recompute_ops, "counts": self.counts,
            "window": [_scalar_fields(r) for r in self.window], "notes": list(self.notes),
            "side_effects": list(self.side_effects), "source": self.source, "path": self.path,
            "unchecked_reason": self.unchecked_reason, "checkpoint_options": self.checkpoint_options,
            "watched": self.watched, "step": self.step, "optimizer_step": self.optimizer_step,
            "backward": self.backward, "function": self.function, "recompute_n": self.recompute_n,
            "backward_raised": self.backward_raised, "held_choice": self.held_choice,
            "unread_values": self.unread_values,
        })
        return data


CUT_SHORT = "cut short"  # Report.exit_status of a run whose trace has no end record (its process was killed)
PYTHON_UPDATE = "Python code"  # the "op" of a repeated update of a Python attribute or global (`counter += 1`)
UPDATED_IN_PLACE = " is updated in place by "  # a side effect's text: "<tensor> is updated in place by <op> in ..."
NESTED_RERUN = "nested checkpoint inside a recompute"  # RegionReport.unchecked_reason of such a region
# how counts and tables show such a region: not a gap in the check (its own forward and recompute are compared as
# the nested region it re-runs), so not "unchecked"
NO_GRAD_CALL = "called under no_grad: no backward"  # RegionReport.unchecked_reason of an evaluation pass's region
NOT_REACHED = "not recomputed: no backward"  # ... of a region no backward reached (its output fed no loss)
NO_GRAD_COUNTED = "called under no_grad (evaluation: nothing to recompute)"
NESTED_LABEL = "nested rerun"
NESTED_COUNTED = "nested rerun(s) in a recompute (nothing to compare)"
RECORDER_ERROR = "recorder error"  # RegionReport.unchecked_reason of a region whose passes ac-diff failed to record
SIDE_OUTPUT = "reproduced; a side output carries no gradient"  # ... of a reentrant region that handed tensors out
# ... of a region that reproduced its forward, whose code reads Python state its recompute updates a second time
STATE_READ_AGAIN = "reproduced; state it reads is updated twice"
UNREAD = "but no backward read them"  # a region's note: saved values that differ where no gradient formula ran
# ... where only the gradients of inputs the backward did not ask for read them (`autograd.grad(loss, x)`)
UNASKED = "but only gradients no backward computed read them"
# ... of a reentrant region called with no input that requires grad, where which parameters it uses is not known (a
# function, not a module; a log's warning): those that require grad get no gradient from it
NO_GRAD_INPUTS = "no backward: its inputs require no grad"
AT_RISK = (SIDE_OUTPUT, STATE_READ_AGAIN, NO_GRAD_INPUTS)  # never clean: what the gradients of the run may lose
FORWARD_UNRECORDED = "forward not recorded"  # ... of a region recomputed in the recording whose forward ran before it
VALUES_NOT_RECORDED = "values not recorded"  # ... of a region recorded with --no-fingerprints whose metadata matched
NEVER_CLEAN = (*AT_RISK, VALUES_NOT_RECORDED, FORWARD_UNRECORDED)  # a run (a rank) with such a region is not clean
RECOMPUTE_RAISED = "the recompute raised"  # ... of a region whose recompute stopped on an exception (compared in part)


def reproduced(region: RegionReport) -> bool:
    """The region's recompute reproduced its saved tensors: clean, or at risk (AT_RISK: reproduced, yet never clean)."""
    return region.status == CLEAN or region.unchecked_reason in AT_RISK


def count_by_status(regions: list[RegionReport], counted: dict[str, int] | None = None,
                    words: dict[str, str] | None = None) -> str:
    """"1 diverged, 3 clean": how many of `regions` have each status (empty for none); `counted`: more by status,
    of regions without a report (watch mode's); `words`: a status's word where it means something else (two
    runs compared: "match", "differ")."""
    by: dict[str, int] = {k: v for k, v in (counted or {}).items() if v}
    for r in regions:
        # a nested region re-run by its parent's recompute has nothing to compare: counted apart, not as a gap
        status = {NESTED_RERUN: NESTED_COUNTED, NO_GRAD_CALL: NO_GRAD_COUNTED}.get(r.unchecked_reason, r.status)
        status = (words or {}).get(status, status)
        by[status] = by.get(status, 0) + 1
    return ", ".join(f"{n} {s}" for s, n in sorted(by.items()))


def recomputed_in(r: Any) -> int | None:
    """The backward pass (from 1) that recomputed region report `r`, where the trace tells it (several per step under
    gradient accumulation), else its step."""
    backward = getattr(r, "backward", None)
    return backward if backward is not None else r.step


def diverged_after(regions: list[RegionReport], compared: int) -> list[RegionReport]:
    """The diverged regions recomputed in a backward pass after the `compared` ones (their gradients were not in a
    comparison with the run without AC over `compared` backward passes)."""
    return [r for r in regions if r.status == DIVERGED and (recomputed_in(r) or 0) > compared]


def backwards_recorded(regions: list[RegionReport], watch: dict[str, Any] | None = None) -> int:
    """How many backward passes the run made, as far as its regions tell (the last that recomputed one) and, under
    watch mode, the steps it watched (whose clean regions have no report), else 0."""
    return max(max((n for r in regions if (n := recomputed_in(r)) is not None), default=0),
               (watch or {}).get("steps") or 0)


def repeated_updates(regions: list[RegionReport]) -> set[str]:
    """The tensors some region's recompute updates in place a second time (its side effects, "counted twice")."""
    return {name for r in regions for name, _, _ in r.repeated}


@dataclass(slots=True)
class RegionGroup:
    """Diverged regions that share a cause and culprit: reports show the lead region once for all."""

    label: str  # the modules, "layers.0-5"
    cause: str | None
    culprit: str | None  # the cause's tensor, relative to each region's module ("moe.expert_bias")
    regions: list[tuple[int, int]]  # (rank, region) of every member, the lead first
    lead: tuple[int, int]
    # the members themselves (not written): two logs that name no rank both hold a "rank 0, region 0"
    members: list["RegionReport"] = field(default_factory=list, repr=False, compare=False)

    def to_json(self) -> dict[str, Any]:
        return {"label": self.label, "cause": self.cause, "culprit": self.culprit,
                "regions": [list(r) for r in self.regions], "lead": list(self.lead)}


@dataclass(slots=True)
class MetadataChange:
    """One position torch names, with the metadata it printed: "f32[4096]" saved, "f32[0]" recomputed."""

    position: int | None
    saved: str | None
    recomputed: str | None


@dataclass(slots=True)
class TorchErrorSummary:
    kind: str
    rank: int | None
    region: int | None
    positions: list[int]
    message: str
    saved_count: int | None = None
    recomputed_count: int | None = None
    changes: list[MetadataChange] = field(default_factory=list)  # what torch printed per position
    cause: str | None = None  # what the changes alone tell ("sharded_parameter: ..."), when no region explains it
    count: int = 1  # times torch raised (a log printed) this same error
    first_line: int | None = None  # the log line where its first / last repetition starts; None: not from a log
    last_line: int | None = None
    log: str | None = None  # the log's file name, where a report explains several

    @property
    def occurrences(self) -> str:
        """Where and how often, as every renderer shows it: "4,513 times, lines 7-198,535", "line 7",
        "rank3.log line 7" (several logs), or ""."""
        if self.first_line is None:
            return f"{self.count:,} times" if self.count > 1 else ""
        where = f"{self.log} " if self.log else ""
        if self.count == 1 or self.last_line == self.first_line:
            return (f"{self.count:,} times, " if self.count > 1 else "") + f"{where}line {self.first_line:,}"
        return f"{self.count:,} times, {where}lines {self.first_line:,}-{self.last_line:,}"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class RankSummary:
    """One rank at a glance: its verdict, and where and why it diverged first (in forward order)."""

    rank: int
    verdict: str  # clean, diverged, unchecked (not everything compared), no_regions
    regions: int
    diverged: int
    cause: str | None
    first_module: str | None  # the checkpointed layer of the first diverged region ("layers.1")
    first_region: int | None
    clean: int = 0  # (with the watched regions that reproduced their saved tensors, as `regions`)
    unchecked: int = 0
    silent: bool = False  # the first diverged region diverged without torch raising
    cause_tensor: str | None = None  # the tensor / flag / op the cause names
    first_op: str | None = None  # first divergent op of that region, with its module and source
    first_op_module: str | None = None
    first_source: str | None = None
    torch_error: str | None = None  # "metadata_mismatch at positions 35, 36" when torch raised on this rank
    exit_status: str | None = None  # ok, exception, interrupted, exit (from the trace's end record); CUT_SHORT
    exit_code: int | None = None
    truncated: bool = False  # the trace has no end record (the process was killed, or still runs: `running`)
    running: bool = False  # its process is alive on this host (a slow rank, a run still going)
    trace: str | None = None
    raised: str | None = None  # from a log: the exception the rank's traceback ended with ("RuntimeError: ...")

    @property
    def first_diverged(self) -> str:
        """"layers.1 (region 1)", or "" when the rank did not diverge."""
        return f"{self.first_module} (region {self.first_region})" if self.first_module is not None else ""

    @property
    def ending(self) -> str:
        """How the rank's script ended, in a word: running or killed (no end record), stopped (SIGTERM), raised,
        exit N."""
        if self.truncated:
            return "running" if self.running else "killed"
        if self.exit_code == 143:
            return "stopped"
        if self.exit_status == "exception":
            return "raised"
        return f"exit {self.exit_code}" if self.exit_code not in (None, 0) else self.exit_status or ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class CrossRankFinding:
    """One statement about the ranks together: who diverged, who first, who disagrees with whom."""

    kind: str  # ranks, first, rank_local, same_cause, torch_errors, exits, replicated_disagreement, replicated_rng, mixed_runs, missing_ranks
    text: str
    ranks: list[int] = field(default_factory=list)
    region: int | None = None
    module: str | None = None
    op: str | None = None
    op_module: str | None = None
    source: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class Report:
    verdict: str  # clean, diverged or unchecked (nothing, or not all, could be compared; never "clean")
    headline: str  # the one-line answer
    regions: list[RegionReport]
    torch_error: TorchErrorSummary | None = None
    torch_errors: list[TorchErrorSummary] = field(default_factory=list)
    ranks: list[RankSummary] = field(default_factory=list)
    cross_rank: list[str] = field(default_factory=list)  # disagreements between ranks that should agree
    cross_rank_findings: list[CrossRankFinding] = field(default_factory=list)  # the same, structured
    compared: dict[str, Any] | None = None  # `ac-diff compare A B` of two traces: which is A, which is B
    sources: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    exit_status: str | None = None  # ok, exception, interrupted, exit, CUT_SHORT: how the script ended
    exit_code: int | None = None  # the script's exit code (the first rank's that is not 0), where a trace says
    groups: list[RegionGroup] = field(default_factory=list)  # diverged regions that share a cause, lead first
    reference: Any = None  # reference.result.ReferenceResult: gradients vs a run without AC (--reference)
    remedies: list[dict[str, Any]] | None = None  # remedies applied in the run, and where (ac_diff.remedies)
    fixes: Any = None  # fix.result.FixResult: remedies tried by `ac-diff fix`
    missing_ranks: list[int] = field(default_factory=list)  # ranks whose results are not all here (missing_ranks)
    compiled: dict[str, Any] | None = None  # torch.compile in the run: Run.compiled (diagnosis/compiled.py)
    watch: dict[str, Any] | None = None  # watch mode's totals and escalations (diagnosis/watched.py)
    script_failed: str | None = None  # clean, but the script failed after its last compared region: how

    @property
    def diverged(self) -> bool:
        return self.verdict == DIVERGED

    @property
    def silent(self) -> bool:
        """A region diverged and torch raised nothing about it: the gradients are silently wrong."""
        return not self.torch_errors and any(r.silent for r in self.regions if r.status == DIVERGED)

    @property
    def silent_warning(self) -> str:
        """What a silent divergence means for the gradients, as every renderer says it: wrong, unless the run without
        AC was compared and they matched (a decision that only swapped the order of the same experts)."""
        if self.compared:  # (`ac-diff compare A B`: two runs, neither of them a recompute)
            return ("the two runs part there: that says where they differ, not whether either run's gradients are "
                    "wrong (`ac-diff run` on each checks its recomputes).")
        if self.gradients_match:
            return ("torch raised no error; the diverged region(s) saved other tensors, yet the gradients match the run "
                    "without AC over the compared backward passes.")
        if all(r.first_discrete_divergence is not None and r.first_discrete_divergence.reordered_only
               for r in self.regions if r.status == DIVERGED):
            return ("torch raised no error: the diverged region(s) chose the same entries in another order, so their "
                    "gradients are silently wrong only where the code uses that order (`--reference no-ac` tells).")
        return "torch raised no error: the gradients of the diverged region(s) are silently wrong."

    @property
    def gradients_match(self) -> bool:
        """The run without AC was compared (`--reference no-ac`) and the gradients matched it bitwise over every
        backward pass that recomputed a diverged region: what they saved differed, to no effect that was seen."""
        from .reference.result import IDENTICAL  # (the reference section is attached after diagnosis)

        ref = self.reference
        return ref is not None and getattr(ref, "verdict", None) == IDENTICAL and not diverged_after(
            self.regions, ref.backwards)

    @property
    def title(self) -> str:
        """The verdict in a few words, as every renderer shows it ("SILENTLY DIVERGED", "CRASHED", ...)."""
        if self.compared:  # `ac-diff compare A B` of two traces
            return {DIVERGED: "RUNS DIFFER", CLEAN: "RUNS MATCH"}.get(self.verdict, "NOT ALL COMPARED")
        if self.verdict == DIVERGED:
            if self.silent and self.gradients_match:
                return "DIVERGED, GRADIENTS MATCH"
            return "SILENTLY DIVERGED" if self.silent else "DIVERGED"
        if self.verdict == DAMAGED:
            return "TRACE DAMAGED"
        if self.verdict == UNCHECKED:
            if self.crashed:
                return "INTERRUPTED" if self.exit_status == "interrupted" else "CRASHED"
            if self.exit_status == CUT_SHORT:
                return "CUT SHORT"
            if self.missing_ranks:
                return "RANKS MISSING"
            if not self.regions and self.compiled and self.compiled.get("regions") and not self.compiled.get("eager"):
                return "AC COMPILED, NOT RECORDED"
            if any(r.unchecked_reason in AT_RISK for r in self.regions):
                return "GRADIENTS AT RISK"
            if any(r.unchecked_reason == VALUES_NOT_RECORDED for r in self.regions):
                return "VALUES NOT COMPARED"
            return "NOTHING CHECKED"
        if self.script_failed:
            return "CLEAN, SCRIPT INTERRUPTED" if self.exit_status == "interrupted" else "CLEAN, SCRIPT FAILED"
        return "CLEAN"

    @property
    def crashed(self) -> bool:
        """The script raised (or was interrupted) before every region was checked."""
        return self.exit_status in ("exception", "interrupted") and (
            any(r.status == UNCHECKED for r in self.regions) or bool(self.watch and self.watch.get("never_compared")))

    def raised(self, region: RegionReport) -> bool:
        """torch raised a CheckpointError about this region."""
        return any(e.region == region.region and e.rank == region.rank for e in self.torch_errors)

    def diverged_regions(self) -> list[RegionReport]:
        """The diverged regions in the order reports detail them: those torch raised about first, then by
        rank and region (the order diagnosis picks group leads by)."""
        return sorted((r for r in self.regions if r.status == DIVERGED),
                      key=lambda r: (not self.raised(r), r.rank, r.region))

    def lead_groups(self) -> list[tuple[RegionReport, list[RegionReport], str]]:
        """(lead region, members, label) per group of diverged regions, the lead detailed for all; one group
        per diverged region where the report has none (two traces compared)."""
        by_key = {(r.rank, r.region): r for r in self.regions}
        if self.groups:
            return [(g.members[0], g.members, g.label) if g.members else
                    (by_key[g.lead], [by_key[k] for k in g.regions if k in by_key], g.label) for g in self.groups
                    if g.members or g.lead in by_key]
        return [(r, [r], r.module or "?") for r in self.diverged_regions()]

    def group_of(self, region: RegionReport) -> RegionGroup | None:
        """The group of several diverged regions this one belongs to, if any."""
        return next((g for g in self.groups if len(g.regions) > 1 and (
            any(m is region for m in g.members) if g.members else (region.rank, region.region) in g.regions)), None)

    def repeated_updates(self) -> set[str]:
        return repeated_updates(self.regions)

    def repeating(self) -> list[RegionReport]:
        """Clean regions whose recompute repeats an update, with its fix ("though this step's gradients are right"),
        but not an update a diverged region's cause names: its own fix says what to do there, and a later step's
        divergence shows the gradients were not right."""
        causes = {n for r in self.regions if r.status == DIVERGED and r.cause is not None
                  for n in (r.cause.tensor, *r.cause.names) if n}
        return [r for r in self.regions if r.status == CLEAN and r.repeated and r.suggestions
                and not {name for name, _, _ in r.repeated} & causes]

    def status_counts(self) -> str:
        """How many regions have each status, e.g. "4 region(s): 1 diverged, 3 clean" (empty without regions); watch
        mode's clean and never recomputed regions, which have no report of their own, counted in ("30 region(s): 24
        diverged, 6 clean (watched)")."""
        w = self.watch or {}
        counted = {"clean (watched)": w.get("clean", 0), "diverged (watched, counted)": w.get("unwritten", 0),
                   "unchecked (watched, never recomputed)": w.get("never_compared", 0),
                   NESTED_COUNTED: w.get("nested", 0)}
        counts = count_by_status(self.regions, counted, TWO_RUNS_WORDS if self.compared else None)
        n = len(self.regions) + sum(counted.values())
        return f"{n} region(s): {counts}" if n else ""

    def to_json(self, lazy: bool = False) -> dict[str, Any]:
        """The JSON form. `lazy`: its regions as a `Mapped` list, each region's dict made while the encoder
        writes it (the JSON renderer's way: a report of many regions is written without its whole tree)."""
        return {
            "format": REPORT_FORMAT, "version": REPORT_VERSION, "verdict": self.verdict,
            "title": self.title, "headline": self.headline,
            "torch_error": self.torch_error.to_json() if self.torch_error else None,
            "torch_errors": [e.to_json() for e in self.torch_errors],
            "regions": Mapped(self.regions, RegionReport.to_json) if lazy else [r.to_json() for r in self.regions],
            "ranks": [r.to_json() for r in self.ranks], "cross_rank": list(self.cross_rank),
            "cross_rank_findings": [f.to_json() for f in self.cross_rank_findings], "compared": self.compared,
            "sources": list(self.sources), "notes": list(self.notes), "exit_status": self.exit_status,
            "exit_code": self.exit_code,
            "script_failed": self.script_failed,
            "groups": [g.to_json() for g in self.groups],
            "reference": self.reference.to_json() if self.reference is not None else None,
            "remedies": self.remedies, "fixes": self.fixes.to_json() if self.fixes is not None else None,
            "missing_ranks": list(self.missing_ranks),
            "compiled": self.compiled, "watch": self.watch,
        }


_MISSING_LEAD = "results missing from rank"  # how missing_ranks leads the headline of a run it made unchecked


def missing_ranks(report: Report, ranks: list[int], notes: list[str] = (), killed: list[int] = ()) -> None:
    """The one rule for ranks of the run whose results are not all in the report (no trace, one never finished, a
    copy cut on its way to rank 0): a missing rank is never clean. `notes` (which ranks, and why) join the report's;
    a clean verdict becomes unchecked, its headline led by the ranks missing (`killed`: those whose process was
    killed, which the headline says), since what they ran was not all compared; diverged and damaged stay. Applied again (the diagnosis, then the launch that knows more), it adds to
    what it said."""
    report.notes.extend(notes)
    new = sorted(set(ranks) - set(report.missing_ranks))
    if not new:
        return
    had = bool(report.missing_ranks)
    report.missing_ranks = sorted(set(report.missing_ranks) | set(new))
    n = len(report.missing_ranks)
    dead = [r for r in report.missing_ranks if r in killed]
    lead = (f"{_MISSING_LEAD}{'s' if n > 1 else ''} {', '.join(map(str, report.missing_ranks))}"
            + (f" (killed: the trace of rank{'s' if len(dead) > 1 else ''} {', '.join(map(str, dead))} has no end "
               "record, as after SIGKILL or the out-of-memory killer; what the other ranks raised after it may be "
               "their peer's loss)" if dead else "")
            + f": what {'they' if n > 1 else 'it'} ran was not all compared")
    if report.verdict == CLEAN:
        report.verdict = UNCHECKED
        report.headline = f"{lead}; {report.headline}"
    elif report.verdict == UNCHECKED and had and report.headline.startswith(_MISSING_LEAD):
        report.headline = lead + report.headline[report.headline.index(";"):]
