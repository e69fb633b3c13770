"""The recorder: every checkpointed region's original forward and recompute, op by op, to a trace.

    with ac_diff.record("ac-diff-out/trace-rank0.jsonl") as rec:
        loss = model(x).sum(); loss.backward()
    rec.summary()   # {"regions": 8, "ops_recorded": 4211, ...}

A `TorchDispatchMode` sees each aten op; `CheckpointHooks` (capture/torch_compat.py) says which region and
pass it belongs to and which op each saved position came from; `ModuleStack` names the module.
For each op of a region pass it keeps: op name, module FQN, source line, input/output metadata,
non-tensor arguments, where each input came from, a device-side value fingerprint of every output
(read back once per pass), host values, and, for discrete ops, their small outputs and score inputs.
Per saved position: the op or input it came from and the fingerprint of the tensor saved (`_saved_values`); per
forward: the tensors it made that outlived it (its outputs, what its code kept). Ops outside regions are only
counted. The recorder never changes what it observes: it reads
tensors, never writes them, and consumes no randomness.

Its helpers, one job each: dispatch.py (the dispatch mode, the per-op hot path), rows.py (an op's
row), fingerprint.py (value fingerprints), modules.py and sourceline.py (naming), state.py (state
snapshots), pystate.py (module attributes and the globals their code reads), retention.py (what
write="diverged" keeps), ac_diff/trace.py (the encoding), ac_diff/oprules.py (what an op name says).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import sys
from math import isfinite
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from .compiled import (COMPILED_GRAPH_OP, CompileWatch, EagerStance, compiled_graph_draws, compiled_graph_label,
                       eager_requested, force_eager, is_fake, keep_dynamo_out, route_compiled_code, tracing,
                       wrap_compiled_graphs)
from .kept_inputs import KeptInputs, kept_as
from .modules import ModuleStack, held_by
from .fqn import clean_fqn, segment_name
from .pystate import (UNSET, GlobalReads, Owner, forward_hooks, held_generators, hook_reads_again, host_draw_sites,
                      is_container, method_owners, module_attributes, only_rebinds, read_again, subclass_attributes)
from .fingerprint import FingerprintBatch, _storage_of, wrapped_tensor
from .watch import Watch, WatchedPass
from .spawned import SpawnWatch
from ..errors import INTERRUPTIONS
from ..gc_hold import YoungGenerationHold
from ..passes import NESTED_OUTPUT
from .retention import HeldForward, Retention, updated_externals
from .dispatch import InternalBlock, no_dispatch_modes, RecordingMode, UnguardedRecordingMode
from .state import (argument_items, callable_name, generator_state, global_state, host_draws, host_rng_states,
                    module_hooks, requiring_grad, rng_digest, trainable, training_mode)
from .rows import _E_REF, _E_SLOT, _E_VERSION, _E_WEAKREF, _FLAGS, _MODULE, _OP, _OUT, _P_MEASURED, _P_OP, _P_OUTPUT, _P_REF, _P_SLOT, _P_VERSION, _P_WEAKREF
from .opinfo import BOXED_INPUTS, FLUSH_ALL, OpInfo, draws, op_info, short_dtype
from .sourceline import raised_at, user_source
from .torch_compat import (FORWARD, RECOMPUTE, STOP_RECOMPUTATION, CheckpointHooks, ReentrantFrame, _dispatch_stack_len,
                           checkpointed_module, frame_options, function_name, gradients_computed, graph_task_id,
                           innermost_function, left_a_backward, outside_backward, raised_in_checkpoint,
                           sequential_segment, version_of)
from ..oprules import DETACHED_ALIAS_OPS, holds_values, output_role
from ..trace import (FLAG_CACHED, FLAG_DERIVED, FLAG_DISCRETE, FLAG_RANDOM, TraceWriter, default_header,
                     encode_ops, merge_read, written_meta)


class _OpenPass:
    """Stands in for the frame of a pass that its region left open (see Recorder._close_open_passes)."""

    def __init__(self, region) -> None:
        self._ac_diff_region = region


def _never_raise(method):
    """The recorder must not break the training it observes: a failure inside it is written to the
    trace as a warning (once per kind) and recording goes on; the training never sees it."""
    import functools

    @functools.wraps(method)
    def guarded(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - deliberately broad: this is the training's call path
            self._internal_error(method.__name__, exc)
            return None
    return guarded


@dataclass
class RecordOptions:
    """What to record. The defaults record everything a diagnosis uses."""

    fingerprints: bool = True  # value fingerprints of region op outputs (off: metadata only)
    keep_values: int = 16384  # max elements kept per output/score input of a discrete op (0: none)
    source_lines: bool = True
    max_regions: int | None = None  # record ops of the first N regions only; later ones are listed, not dispatched
    scope: str = "regions"  # "regions": the dispatch mode runs only inside regions; "all": also counts other ops
    discrete_ops: frozenset[str] = frozenset()  # extra op names (e.g. "aten.my_router.default") to treat as discrete
    ignore_ops: frozenset[str] = frozenset()  # op names never recorded
    # "diverged" (default): record everything, but write a region's ops only if its recompute did not reproduce
    # its forward (or it failed, or was never recomputed), plus the first `keep_clean` clean regions of each
    # module (a sample to read); every other clean region gets a summary of ~1 KB (retention.pass_summary), so
    # a trace grows with the regions that diverged, not with the steps. "all": write every recorded pass.
    write: str = "diverged"
    keep_clean: int = 1
    hold_bytes: int = 256 << 20  # write="diverged": forwards held awaiting their recompute (oldest written first)
    # encode and write the trace in a background thread (trace.TraceWriter): measured no faster on CPU (the
    # recording keeps the GIL busy), so off by default; it can help where the step has long GIL-free phases
    writer_thread: bool = False
    # also fingerprint elementwise ops whose inputs were all measured ("derived": their values follow from
    # those inputs; off, the default, saves about a fifth of the fingerprinting)
    fingerprint_derived: bool = False
    # watch mode (capture/watch.py): no dispatch mode; each region's saved tensors are compared between its forward
    # and its recompute on the device; a module whose region diverged is recorded in full from then on (`escalate`)
    watch: bool = False
    escalate: bool = True
    watch_full_steps: int = 1  # watch mode records the first N steps in full: a bug that strikes at once is diagnosed
    # watch mode records a module whose regions it compares by their outputs only (reentrant) in full once every N
    # steps, one such module a step (0: never)
    watch_resample: int = 20
    full_from_step: int | None = None  # record every region in full from this step on (1: the first); watch before

    def __post_init__(self) -> None:
        if self.watch and not self.fingerprints:  # (its full recordings confirm and explain what it finds)
            raise ValueError("--no-fingerprints cannot be combined with --watch: watch records a module that diverged "
                             "in full, with values, to confirm and explain it (watch is the cheap mode already); drop "
                             "--no-fingerprints (or `fingerprints: false` in ac-diff.yaml)")


@dataclass
class _Region:
    number: int
    kind: str
    parent: int | None
    parent_phase: str | None
    options: dict[str, Any]
    module: str | None = None
    caller: str | None = None
    caller_module: Any = None  # weakref to the module that called checkpoint() (`_enter_function_module`)
    # weakref to torch's checkpoint frame: alive while a backward can still recompute the region (its graph holds it)
    frame: Any = None
    fn_site: str | None = None  # the function checkpoint() was given, by name and source line (a lambda's)
    recorded: bool = True
    written: bool = False
    recomputes: int = 0
    fn_name: str | None = None  # the checkpointed function, where it is no module (named after it if it does
    # more than call one module)
    first_module_fqn: str | None = None  # the region was named after the first module its function called
    hold: str = ""  # write="diverged": "held" (forward in memory), "clean" (summarized), "written"
    held: "HeldForward | None" = None  # the forward's records while held (retention.Retention)
    signature: Any = None  # the forward's signature once decided (later recomputes compare with it)
    # watch mode (capture/watch.py): compared by its saved tensors only; its step; the module escalation goes by
    watched: bool = False
    step: int | None = None
    optimizer_steps: int = 0  # optimizer.step() calls before its forward began
    watch_key: str | None = None
    watch_forward: Any = None  # the forward's WatchedPass
    watch_compared: bool = False
    watch_diverged: bool = False  # one of its recomputes diverged (a later one is not written again)
    unwatched: bool = False  # watch mode: a nested checkpoint its parent's recompute ran (not compared, not written)
    # the tensors its forward made that outlived it (a cache its code keeps): id -> (weakref, op, output, version)
    kept: dict[int, tuple] | None = None
    # the modules its forward ran inside ([(module, fqn)]): the recompute, which runs in the backward without them,
    # names what it reads through them as the forward did (a buffer of the model a layer reads by reference)
    outer: tuple = ()


@dataclass
class _Pass:
    region: _Region
    phase: str
    attempt: int
    base_depth: int
    state: dict[str, Any]
    ops: list[tuple] = field(default_factory=list)  # one row per op: see capture/rows.py
    producers: dict[int, tuple] = field(default_factory=dict)  # id(tensor) -> (weakref, op index, output index)
    externals: list[dict] = field(default_factory=list)
    external_ids: dict[int, tuple] = field(default_factory=dict)  # id(tensor) -> see capture/rows.py (_E_*)
    input_ids: dict[int, int] = field(default_factory=dict)  # id(tensor) -> position in the region's inputs
    inputs: tuple = ()  # the region's inputs (a forward's: their versions are noted as it ends, kept_inputs.py)
    # one row per saved position: [position, meta, origin, op index, output, name(, fingerprint slot -> its
    # fingerprint when the pass ends(, view: [offset, *strides] of a view fingerprinted as its base))]
    positions: list[list] = field(default_factory=list)
    batch: FingerprintBatch = field(default_factory=lambda: FingerprintBatch(bits=True))  # (exact: a 1-ulp change)
    fp_slots: list[tuple[int, int, int]] = field(default_factory=list)  # (op index, output index, slot)
    kept: list[tuple[int, str, int]] = field(default_factory=list)  # (op index, key, kept index)
    cached: set[int] = field(default_factory=set)  # ops selective AC saved (forward), marked after recording
    ext_slots: list[tuple[dict, int]] = field(default_factory=list)
    externals_per_kind: dict[str, int] = field(default_factory=dict)
    n_ops: int = 0
    pushed: Any = None  # the module enter() put on the module stack for this pass (see _enter_function_module)
    module_stack: list = field(default_factory=list)  # this thread's ModuleStack.stack() (the same list throughout)
    pushed_mode: bool = False  # enter() put the recording mode on the dispatch stack (and held the GC) for this pass
    nonfinite: bool = False  # a NaN or infinite float among the recorded arguments, host values or fingerprints
    # tensors a nested region's pass made that are still alive when it ended (its outputs): id -> (weakref, name)
    child_outputs: dict[int, tuple] = field(default_factory=dict)
    # scalar Python attributes of the modules the pass called, at their first call: "blocks.0.step" -> 3
    attributes: dict[str, Any] = field(default_factory=dict)
    # attributes a call of their module changed (its forward pre-hooks or forward): name -> [before, after, hooks]
    attribute_updates: dict[str, list] = field(default_factory=dict)
    attribute_calls: list[tuple] = field(default_factory=list)  # (module, fqn, its attributes at the call)
    # scalar module-level globals the code of the pass's modules reads ("model.LOW_PRECISION" -> True), at the
    # first call of each forward, and the functions reading them (pystate.GlobalReads)
    globals: dict[str, Any] = field(default_factory=dict)
    global_readers: dict[str, list] = field(default_factory=dict)
    global_updates: dict[str, list] = field(default_factory=dict)  # those the pass changed: name -> [first, at its end]
    global_functions: list[tuple] = field(default_factory=list)  # (function, owner) whose globals were read
    codes_seen: set = field(default_factory=set)  # (forward function, its module's classes) whose globals were read
    called: dict[int, tuple] = field(default_factory=dict)  # id(module) -> (module, fqn): the modules it called
    host_rng: tuple = ()  # state.host_rng_states() when the pass began
    # the host generators its modules keep (pystate.held_generators), at their first call: name -> (object, state)
    held_rng: dict[str, tuple] = field(default_factory=dict)
    # what the recorder failed to record in this pass (its own errors): {"ops": n, "positions": m, "why": text};
    # such a pass is never compared as whole (see `_lose`)
    lost: dict[str, Any] = field(default_factory=dict)
    watch: WatchedPass | None = None  # a watched region's pass (capture/watch.py)
    watched_outputs: WatchedPass | None = None  # in watch mode, a reentrant region's pass recorded in full: its outputs
    returned: set | None = None  # a reentrant region's recorded forward: the storages of the tensors it returned
    kept_forward: list = field(default_factory=list)  # a recompute: [(input index, weakref to the forward's)]


class Recorder:
    """Records checkpointed regions into a trace file. Use `ac_diff.record(...)` to run one."""

    def __init__(self, path: str | os.PathLike, options: RecordOptions | None = None,
                 header_extra: dict[str, Any] | None = None) -> None:
        self.path = os.fspath(path)
        self.options = options or RecordOptions()
        self.modules = ModuleStack()
        self.modules.on_enter = self._on_module_enter
        self.modules.on_exit = self._on_module_exit
        self.compile_watch = CompileWatch(where=self.modules.current)
        self._stance = EagerStance()  # --scope all, --compiled eager: torch.compile'd code runs eagerly (compiled.py)
        self._gc_hold = YoungGenerationHold()  # fewer collector passes while passes are recorded
        self._launched_as_rank = False
        self.hooks = CheckpointHooks(self)
        self._local = threading.local()
        self._internal_block = InternalBlock(self)
        self._guarded_mode = RecordingMode(self)
        self._unguarded_mode = UnguardedRecordingMode(self)
        self._mode = self._guarded_mode  # the one on the dispatch stack (or to push)
        self._regions = 0
        self.optimizer_steps = 0  # optimizer.step() calls so far (torch.optim's global post hook)
        self._optimizer_hook: Any = None
        self._outputs: dict[int, tuple] = {}  # what forwards made that outlived them (`_note_outputs`)
        self._outputs_pruned_at = 1024
        self._step = 0  # the training step the last region forward began in (see enter())
        self._backwards: dict[int, int] = {}  # autograd graph task -> the backward pass it is, from 1
        # region number -> (region, the forward's saved positions a backward read since they were last written: each
        # None, or (node, the gradients it computed) where its formula computed only some: `gradients_computed`)
        self._unpacked: dict[int, tuple[_Region, dict[int, tuple[str, frozenset[int]] | None]]] = {}
        self._recomputed = False  # a recompute ran since that step began
        # the checkpointed functions of this step's regions no backward reaches (no input requires grad, or under
        # no_grad): one of them begins again, and no recompute ever says a step ended, the next step began
        self._unreached: set[int] = set()
        self._ops_seen = 0
        self.ops_recorded = 0
        self.ops_outside = 0
        self.errors: list[str] = []
        self.lost = {"passes": 0, "ops": 0, "positions": 0}  # what recorder errors cost, for the end record
        self._reported: set[tuple[str, str]] = set()
        self._header_extra = header_extra or {}
        self._writer: TraceWriter | None = None
        self._retention: Retention | None = None  # write="diverged": what is written of each pass (start())
        self._lock = threading.Lock()
        self._spawned = SpawnWatch()  # processes the script starts fresh (mp.spawn): not recorded
        self._started = False
        self._plans: dict[int, tuple] = {}  # id(func) -> `_plan(func)`
        self._global_reads = GlobalReads()  # which globals each forward function reads, worked out once
        self._sites: dict[tuple, list[str]] = {}  # (forward function, class, generators) -> where it draws
        self._source_lines = self.options.source_lines
        self._watch: Watch | None = None  # watch mode (start())
        self._kept = KeptInputs()  # regions awaiting their recompute: their inputs' versions (kept_inputs.py)
        # recorded passes whose read-back is on its way: (Collection, write it, the pass), in the order they ended
        self._landing: collections.deque = collections.deque()
        self._landing_lock = threading.RLock()

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> "Recorder":
        header = default_header(self.options, self._header_extra)
        self._writer = TraceWriter(self.path, header, background=self.options.writer_thread)
        self._retention = Retention(self._writer, self.options.hold_bytes, self.options.keep_clean, _distributed)
        if self.options.watch or self.options.full_from_step is not None:
            self._watch = Watch(self._writer.write, self._region_record, self.options.full_from_step,
                                self.options.escalate, self.options.watch_full_steps if self.options.watch else 0,
                                resample_every=self.options.watch_resample if self.options.watch else 0,
                                flush=self._writer.flush)
        warnings_ = self.hooks.install()
        for w in warnings_:
            self._writer.write({"type": "warning", "message": w})
        self._optimizer_hook = _count_optimizer_steps(self)
        self._spawned.install()
        self.modules.install()
        self.compile_watch.start()
        route_compiled_code(RecordingMode, UnguardedRecordingMode)
        if eager_requested():
            refused = force_eager(self._stance)
            self.compile_watch.eager = refused is None  # (torch < 2.6 has no stance: its compiled code ran compiled)
            if refused:
                self._writer.write({"type": "warning", "message": refused})
        if self.options.scope == "all":
            self._stance.push()
            self._mode.__enter__()
        self._started = True
        self._launched_as_rank = "RANK" in os.environ  # torchrun / ac-diff's launcher started this process
        _ACTIVE.append(self)
        return self

    def stop(self, exc: BaseException | None = None, exit_code: int | None = None) -> None:
        """Uninstall everything and finish the trace (always safe to call, also after a crash)."""
        if not self._started:
            return
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        self._close_open_passes(exc)
        self._started = False
        self._write_landed(wait=True)
        if self._watch is not None:
            self._close_watch()
        if self.options.scope == "all":
            with contextlib.suppress(Exception):
                self._mode.__exit__(None, None, None)
            self._stance.pop()
        if self.compile_watch.eager:
            self._stance.pop()
        self._gc_hold.pop(all_=True)
        self.hooks.uninstall()
        self.modules.uninstall()
        if self._optimizer_hook is not None:
            self._optimizer_hook.remove()
        self._spawned.uninstall()
        self.compile_watch.stop()
        for message in self.compile_watch.messages(self._regions, self.options.scope == "all"):
            self._writer.write({"type": "warning", "message": message})
        message = _unrecorded_ranks(self._launched_as_rank)
        if message:
            self._writer.write({"type": "warning", "message": message})
        compiled = self.compile_watch.summary()  # AC inside compiled graphs, --compiled eager (compiled.py)
        self._retention.release_all()  # forwards never recomputed (or the run stopped first): keep them
        status = "ok"
        if exc is not None:
            status = ("interrupted" if isinstance(exc, INTERRUPTIONS)
                      else "exit" if isinstance(exc, SystemExit) else "exception")
            self._writer.write({"type": "exception", "exc_type": type(exc).__name__,
                                "exc_module": type(exc).__module__, "message": _exception_text(exc),
                                "in_backward": left_a_backward(exc), "in_checkpoint": raised_in_checkpoint(exc),
                                "step": self._step or None,
                                **self._inputs_written()})
        if exit_code not in (None, 0) and status == "ok":
            status = "exit"
        if status == "ok":  # (a run stopped in a backward read only some of what that backward would have)
            self._write_unpacked()
        self._writer.close({
            **self._end_record(status, exit_code),
            "ops_outside": self.ops_outside if self.options.scope == "all" else None,
            **({"spawned": self._spawned.count} if self._spawned.count else {}),
            **({"compiled": compiled} if compiled else {}),
            **({"lost": {**self.lost, "errors": self.errors[:20]}} if self.errors else {}),
        })

    def _end_record(self, status: str, exit_code: int | None) -> dict:
        return {"type": "end", "status": status, "exit_code": exit_code, "regions": self._regions,
                "ops_recorded": self.ops_recorded, "end_time": time.time(), "optimizer_steps": self.optimizer_steps}

    def copy_trace(self, path: str | os.PathLike) -> None:
        """A finished copy of the trace recorded so far at `path` (a `record()` block nested in this run ends: the
        script may read its own trace). Never raises: what went wrong is one line on stderr."""
        try:
            self._write_landed(wait=True)
            self._writer.sync()
            self._writer.copy(path, self._end_record("ok", None))
        except Exception as exc:  # noqa: BLE001 - the training goes on; the run's own trace is whole
            print(f"ac-diff: could not write the copy of the trace to {os.fspath(path)} ({type(exc).__name__}: "
                  f"{exc}); the run's trace {self.path} holds the block", file=sys.stderr)

    def _inputs_written(self) -> dict:
        """The run stopped: the inputs of regions still awaiting their recompute that were written in place since
        their forward ({"inputs_changed": [[region, input index, meta, version then, now], ...]}; what torch's
        version check stops a backward for); a watched region among them has its record and forward written."""
        try:
            written = self._kept.written()
            for region, _ in written:
                if region.watched and self._watch is not None:
                    self._watch.unfinished(region)
            rows = [[region.number, *entry] for region, entries in written for entry in entries]
        except Exception as exc:  # noqa: BLE001 - the trace's end must still be written
            self._internal_error("inputs_written", exc)
            return {}
        return {"inputs_changed": rows} if rows else {}

    @_never_raise
    def _close_watch(self) -> None:
        """Judge the watched regions whose digests are still on their way (one wait), write the totals."""
        with self.quiet():
            self._watch.close()

    def _close_open_passes(self, exc: BaseException | None) -> None:
        """Finish the passes a region left open: torch <= 2.12 does not throw a forward's exception into its
        checkpoint generator, so the region's hooks stay entered (and exit() uncalled) until it is collected."""
        passes = self._passes()
        for _ in range(len(passes)):
            self.exit(_OpenPass(passes[-1].region), passes[-1].phase, exc)

    def _internal_error(self, where: str, exc: Exception) -> None:
        if where in ("enter", "exit"):  # a pass that never started, or ended unwritten (finishing it is counted
            self.lost["passes"] += 1    # by `_write_lost_pass`)
        key = (where, type(exc).__name__)
        if key in self._reported:
            return
        self._reported.add(key)
        message = f"ac-diff recorder error in {where}: {type(exc).__name__}: {exc} (recording continues; please report)"
        self.errors.append(message)
        with contextlib.suppress(Exception):
            self._writer.write({"type": "warning", "message": message})

    @property
    def write_failure(self) -> str | None:
        """Which trace write failed and what was lost (a full disk), or None (see TraceWriter.failure)."""
        writer = getattr(self, "_writer", None)
        return writer.failure if writer is not None else None

    def summary(self) -> dict[str, Any]:
        return {"trace": self.path, "regions": self._regions, "ops_recorded": self.ops_recorded,
                "ops_outside": self.ops_outside}

    # -- thread-local state -------------------------------------------------------------------
    def _passes(self) -> list[_Pass]:
        try:
            return self._local.passes
        except AttributeError:
            self._local.passes = []
            self._local.internal = 0
            return self._local.passes

    def internal(self) -> InternalBlock:
        """Ops dispatched inside this block are torch's checkpoint machinery, not the region's.

        A plain object with __enter__/__exit__ (a generator context manager costs ~3 us per use, and
        torch's recompute pack hook enters this once per saved tensor)."""
        return self._internal_block

    def quiet(self):
        """For the recorder's own tensor work outside its dispatch handler: no dispatch mode may see it.

        A selective-AC caching mode that saw a fingerprint reduction would store it and change what the
        recompute replays; a user's FlopCounter would count it. With no mode on the stack, `internal()` alone
        (a plain object: a generator context manager costs ~3 us, and a watched pass ends in one).
        """
        return self._quiet_modes() if _dispatch_stack_len() else self._internal_block

    @contextlib.contextmanager
    def _quiet_modes(self):
        with self.internal(), no_dispatch_modes():
            yield

    def op_count(self) -> int:
        return self._ops_seen

    # -- listener interface for CheckpointHooks ------------------------------------------------
    @_never_raise
    def enter(self, frame: Any, phase: str) -> None:
        if tracing():  # torch.compile/export tracing checkpoint() with fake tensors: not a real pass
            return
        passes = self._passes()
        if self._landing:
            self._write_landed()
        watch = self._watch
        if watch is not None and watch.pending:
            with self.internal():
                watch.poll()
        if phase == FORWARD:
            self._write_unpacked()
            region = self._new_region(frame, passes)
            attempt = 0
            # steps count from 1: the first region's forward begins step 1, a top-level one that begins after a
            # recompute ran (a backward reached a region) the next, or one no backward reaches that began already
            unreached = not passes and ("no_grad_inputs" in region.options
                                        or not getattr(frame, "grad_enabled", torch.is_grad_enabled()))
            fn_key = id(getattr(frame, "_ac_diff_fn", None))
            if not passes and (self._step == 0 or self._recomputed or unreached and fn_key in self._unreached):
                self._step, self._recomputed = self._step + 1, False
                self._unreached.clear()
            if unreached:
                self._unreached.add(fn_key)
            region.step, region.optimizer_steps = self._step, self.optimizer_steps
            kept_forward = []
        else:
            self._recomputed = True
            region = getattr(frame, "_ac_diff_region", None)
            if region is None:  # a frame created before recording started: nothing to compare with
                region = self._new_region(frame, passes, recorded=False)
                region.options["forward_unrecorded"] = True  # (said so, not blamed on --max-regions)
            attempt = region.recomputes
            region.recomputes += 1
            kept_forward = self._kept.recomputed(region)
        pushed, module = self._enter_function_module(frame, region, phase)
        keep_dynamo_out(Recorder)  # (once Dynamo is loaded: the code of the pack hooks this pass runs)
        self.modules.freeze()  # (after naming the region's module: a root called from nowhere names what it holds)
        if watch is not None and phase == FORWARD:
            self._watch_or_record(region)
        module_stack = self.modules.stack()
        if phase == FORWARD and region.recorded:
            region.outer = tuple(module_stack)
        p = _Pass(region, phase, attempt, len(module_stack), {}, module_stack=module_stack,
                  host_rng=host_rng_states() if region.recorded else ())
        if phase != FORWARD and (task := graph_task_id()) is not None:  # which backward pass recomputes it
            p.state["backward"] = self._backwards.setdefault(task, len(self._backwards) + 1)
        if module is not None and (region.recorded or region.watched):  # (a watched pass: its mode, to explain)
            p.state["training"] = training_mode(module)
            p.state["trainable"] = trainable(module)
            if region.kind == "reentrant":
                p.state["trainable_n"] = requiring_grad(module)
            p.state["hooks"] = module_hooks(module)
        p.kept_forward = kept_forward
        if module is not None and region.recorded:  # (a bound method checkpointed: no module call in the region)
            self._note_generators(p, module, f"{self.modules.name_of(module) or type(module).__name__}.")
        if module is not None and region.recorded and getattr(module, "_compiled_call_impl", None) is not None:
            # (`module.compile()`: its hooks run inside the compiled call, where they do not record: its attributes,
            # which Dynamo guards on, as the pass begins)
            self._note_attributes(p, module, self.modules.name_of(module) or "")
        fn = getattr(frame, "_ac_diff_fn", None)
        if region.recorded and fn is not None and not isinstance(fn, torch.nn.Module):
            self._note_globals(p, fn)  # a checkpointed function (or `partial(layer.forward)`) reads them too
        p.pushed = pushed
        inputs = getattr(frame, "_ac_diff_inputs", None)
        if region.watched:
            p.watch = WatchedPass(p.input_ids)
            p.watch.state = p.state
        if phase == FORWARD and inputs is not None:
            self.pass_inputs(frame, inputs, p)
        # the recording mode goes on the dispatch stack for a recorded pass only: the ops of a region past
        # `max_regions` cost nothing (their pass records then have no op count)
        if region.recorded and not any(q.pushed_mode for q in passes):
            if self.options.scope != "all":
                # without Dynamo nothing can trace the handler: torch's per-op guard is not needed
                dynamo = "torch._dynamo" in sys.modules
                if dynamo:
                    wrap_compiled_graphs()
                self._mode = self._guarded_mode if dynamo else self._unguarded_mode
                self._mode.__enter__()
            self._gc_hold.push()
            p.pushed_mode = True
        passes.append(p)

    def _watch_or_record(self, region: _Region) -> None:
        """Watch mode, a region's forward begins: record it in full (escalated, --full-from-step), or watch it."""
        key = region.watch_key = region.module or region.fn_name or region.caller or region.fn_site
        # (a reentrant region no backward will reach, its inputs not requiring grad: its forward, recorded, is the
        # finding)
        full = self._watch.full(key, region.step, region.kind == "reentrant") or "no_grad_inputs" in region.options
        if not full:
            region.recorded = False
            if region.parent_phase == RECOMPUTE:  # a nested checkpoint its parent's recompute runs: torch never
                region.unwatched = True  # recomputes it again, so there is nothing to compare or write
                self._watch.nested_rerun(key)
                return
            if region.options.get("no_grad_call") and region.parent is None:  # an evaluation pass: no backward
                region.unwatched = True
                return
            region.watched = True
            self._watch.started(key)

    @_never_raise
    def exit(self, frame: Any, phase: str, exc: BaseException | None) -> None:
        passes = self._passes()
        if not passes or passes[-1].region is not getattr(frame, "_ac_diff_region", None):
            return  # a pass enter() did not start (traced by torch.compile)
        p = passes.pop()
        stack = self.modules.stack()
        stopped_early = isinstance(exc, STOP_RECOMPUTATION) if STOP_RECOMPUTATION else False
        if exc is not None and not stopped_early and p.watch is None and p.region.recorded:
            p.state["raised_in"] = {"module": self.modules.raised_in(exc), "source": raised_at(exc)}  # where it raised
        if p.pushed is not None and stack and stack[-1][0] is p.pushed:
            stack.pop()
        if p.pushed_mode and self.options.scope != "all":
            self._mode.__exit__(None, None, None)
        complete = exc is None or stopped_early
        if p.phase == FORWARD:
            self._kept.forward_ended(p.region, p.inputs)
        p.inputs = ()  # (weakly from here: a pass a retention holds must not keep its inputs alive)
        if passes and p.region.recorded and passes[-1].region.recorded:
            self._hand_outputs_to_parent(p, passes[-1])
        try:
            self._finish_pass(p, complete, stopped_early, exc)
        except Exception as error:  # noqa: BLE001 - the pass is lost, but never silently
            self._internal_error("finish_pass", error)
            self._write_lost_pass(p, error)
        finally:
            if p.pushed_mode:  # after the pass's rows are freed: they leave the collector's count unvisited
                self._gc_hold.pop()

    def _lose(self, what: str, exc: Exception) -> None:
        """A recorder error lost one op or saved position of the current pass: count it (the pass then reads as
        incomplete, never as clean) and drop what the failed op had half-queued, so that no fingerprint or kept
        value lands on the op recorded after it."""
        self.lost[what] += 1
        passes = getattr(self._local, "passes", None)
        if not passes:
            return
        p = passes[-1]
        if p.watch is not None:
            p.watch.lost += 1
        p.lost[what] = p.lost.get(what, 0) + 1
        p.lost.setdefault("why", f"{type(exc).__name__}: {_exception_text(exc)[:300]}")
        n = len(p.ops)
        p.fp_slots = [s for s in p.fp_slots if s[0] < n]
        p.kept = [k for k in p.kept if k[0] < n]

    def _write_lost_pass(self, p: _Pass, exc: Exception) -> None:
        """Finishing the pass failed: write what is known of it, marked as lost, so the region reads as unchecked
        with the reason instead of vanishing (a forward that vanished made every region "not recorded")."""
        self.lost["passes"] += 1
        region = p.region
        with contextlib.suppress(Exception):
            self._write_region(region)
            if region.hold == "held":
                self._retention.release(region)
            region.hold = "written"  # later recomputes are written in full
            self._writer.write({
                "type": "pass", "region": region.number, "phase": p.phase, "attempt": p.attempt, "n_ops": p.n_ops,
                "complete": False, "state": {}, "externals": [], "positions": [],
                "lost": {**p.lost, "pass": True, "why": f"{type(exc).__name__}: {_exception_text(exc)[:300]}"}})
            self._writer.flush()

    @staticmethod
    def _hand_outputs_to_parent(p: _Pass, parent: _Pass) -> None:
        """A nested region's outputs reach the enclosing pass as tensors it did not make: name them after
        the region that did ("output of nested region blocks.0.inner"), not "external[0]"; by module, not number, so
        the forward and the recompute (which re-runs the nested region as a new one) agree. Several are told apart
        as the enclosing pass reads them (`_ref`), not by their order among the nested pass's tensors still alive:
        selective AC's cache, or a stash, keeps more of them alive in one pass than in the other."""
        region = p.region
        label = NESTED_OUTPUT + (region.module or region.caller or "?")
        for key, entry in p.producers.items():
            if entry[0]() is not None:
                parent.child_outputs[key] = (entry[0], label)

    @_never_raise
    def pass_inputs(self, frame: Any, inputs: tuple, p: _Pass | None = None) -> None:
        if p is None:
            passes = self._passes()
            if not passes:
                return
            p = passes[-1]
        for i, t in enumerate(inputs):
            if isinstance(t, torch.Tensor):
                p.input_ids[id(t)] = i
        p.inputs = tuple(inputs)
        containers = argument_items(p.inputs)
        if containers:
            p.state["arguments"] = containers
        hooks = getattr(frame, "_ac_diff_saved_hooks", None)
        if hooks is not None and p.phase == FORWARD:  # checkpoint keeps the inputs through the user's hooks
            p.state["saved_hooks"] = [callable_name(h) for h in hooks]
        if p.phase == RECOMPUTE and p.kept_forward:  # what it got back: the forward's tensors, or copies
            p.state["inputs_kept_as"] = kept_as(p.kept_forward, inputs)

    def pack(self, frame: Any, phase: str, position: int, tensor: torch.Tensor) -> None:
        # never raises into the training, like the @_never_raise methods (inlined: this runs per saved tensor)
        try:
            region = getattr(frame, "_ac_diff_region", None)
            passes = getattr(self._local, "passes", None)
            if region is None or not (region.recorded or region.watched) or not passes or (
                    type(tensor) is not _Tensor and (tracing() or is_fake(tensor))):
                return  # (torch.compile tracing a compiled function inside the region packs fake tensors)
            p = passes[-1]
            if p.region is not region:  # a pack of an outer region while an inner one runs
                p = next((q for q in reversed(passes) if q.region is region and q.phase == phase), None)
                if p is None:
                    return
            wp = p.watch
            if wp is not None:
                stack = p.module_stack  # (this thread's module stack, as `modules.current()` reads it)
                name = stack[-1][1] if stack else None
                # (CPU tensors are hashed as they are held, held ones digested when due: no mode may see either)
                if wp.hold(position, tensor, name) if not _dispatch_stack_len() else self._unseen(
                        wp.hold, position, tensor, name):
                    self._unseen(wp.flush)
                return
            ref = self._known_ref(p, tensor)
            if ref is None:  # first sight of this tensor in the pass: fingerprinting it dispatches ops
                with self.quiet():
                    ref = self._ref(p, tensor)
            if ref[0] == "op":
                row = [position, _meta(tensor), "op", ref[1], ref[2], None]
            else:
                row = [position, _meta(tensor), ref[0], None, 0, ref[1]]
            slot, view = self._saved_values(p, tensor, ref) if self.options.fingerprints else (None, None)
            if slot is not None:  # the saved values' fingerprint once the pass ends (`_finish_pass`)
                row += [slot] if view is None else [slot, view]
            p.positions.append(row)
        except Exception as exc:  # noqa: BLE001 - deliberately broad: this is the training's call path
            self._internal_error("pack", exc)
            self._lose("positions", exc)

    def _measure_returned(self, p: _Pass, outputs: Any) -> None:
        """Fingerprint the floating-point tensors a reentrant pass returned that no op's fingerprint covers (an
        elementwise op's, derived): its backward starts at them, so their values are measured, not inferred (a state
        scaled by a buffer the loop moved differs; another branch to the same scale does not)."""
        printed = {(i, j) for i, j, _ in p.fp_slots}
        with self.quiet():
            for t in outputs if isinstance(outputs, (tuple, list)) else (outputs,):
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    ref = self._known_ref(p, t)
                    if ref is not None and ref[0] == "op" and (ref[1], ref[2]) not in printed:
                        slot = self._values_slot(p, t)
                        if slot is not None:
                            p.fp_slots.append((ref[1], ref[2], slot))
                            printed.add((ref[1], ref[2]))

    def _unseen(self, work: Any, *args: Any) -> Any:
        """`work(*args)`, tensor work of watch's, where no mode on the dispatch stack (selective AC's, the recorder's
        around an outer region) sees it; with no mode there, no context at all (this runs per saved tensor)."""
        if not _dispatch_stack_len():
            return work(*args)
        with self.quiet():
            return work(*args)

    def pass_outputs(self, frame: Any, phase: str, outputs: Any) -> None:
        """A reentrant region's pass returned: in watch mode its tensor outputs are what is compared (its forward runs
        without grad and saves nothing), also where the pass is recorded in full (watch's first steps): watch then
        knows whether the recompute reproduced them (`Watch.full_pass`)."""
        try:
            passes = self._passes()
            if not passes or passes[-1].region is not getattr(frame, "_ac_diff_region", None):
                return
            p = passes[-1]
            if phase == FORWARD and p.region.recorded:  # what else outlives it left another way (`side_outputs`)
                p.returned = {_storage_of(t)[0] for t in (outputs if isinstance(outputs, (tuple, list)) else (outputs,))
                              if isinstance(t, torch.Tensor)}
            elif p.region.recorded and p.watch is None:  # (where the backward starts: gradpath.gradient_path)
                p.state["grad_outputs"] = _grad_outputs(p, outputs)
            if p.region.recorded and p.watch is None and self.options.fingerprints:
                self._measure_returned(p, outputs)
            if p.watch is None and (self._watch is None or not p.region.recorded):
                return
            wp = p.watch
            if wp is None:
                wp = p.watched_outputs = WatchedPass()
            tensors = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
            with self.quiet():  # (a pass recorded in full: its recording mode must not see the reductions)
                for i, t in enumerate(tensors):
                    if isinstance(t, torch.Tensor):
                        wp.hold(i, t, p.region.module, "output")  # (backward has no module stack)
                if wp is p.watch:
                    wp.flush()
                else:  # (a pass recorded in full: its outputs' digests are read back with it)
                    wp.launch()
        except Exception as exc:  # noqa: BLE001 - deliberately broad: this is the training's call path
            self._internal_error("pass_outputs", exc)
            self._lose("positions", exc)

    def _saved_values(self, p: _Pass, tensor: torch.Tensor, ref: tuple) -> tuple[int | None, list | None]:
        """(fingerprint slot, view) of a saved tensor's values, so that backward's inputs are compared by value whatever
        the ops before them measured. A view of all of a tensor the pass knows (`w.t()` of a parameter, a reshape) is
        its base's values and how it reads them, view = [offset from the base's, *strides]; anything else, a part of
        a tensor included (a split piece, `cos_cached[:T]`), its own values, view None: a part is saved alike in both
        passes when the rest of its base differs (a cache the forward built, then a longer one built by a later
        micro-batch, which the recompute slices). A slot already filled at this version is reused, else one is added
        (and kept for the next reader). None where selective AC serves the tensor: the recompute takes the forward's
        own from its cache."""
        base = tensor._base if type(tensor) in _PLAIN_TENSORS else None  # (a subclass: its own values, local shard)
        base_ref = self._known_ref(p, base) if type(base) in _PLAIN_TENSORS else None
        if base_ref is not None and tensor.numel() < base.numel():
            base_ref = None  # (a part: its own values, not the rest's)
        if base_ref is not None:
            if base_ref[0] == "op" and (_cached(p, base_ref[1]) or not _values_meaningful(p, base_ref)):
                return None, None
            slot = self._values_slot(p, base)
            if tensor.shape == base.shape and tensor.stride() == base.stride() \
                    and tensor.storage_offset() == base.storage_offset():
                return slot, None  # (all of its base as the base lies: its own values, as where the base is bigger)
            return slot, [tensor.storage_offset() - base.storage_offset(), *tensor.stride()]
        if ref[0] == "op" and (_cached(p, ref[1]) or not _values_meaningful(p, ref)):
            return None, None
        return self._values_slot(p, tensor), None

    def _values_slot(self, p: _Pass, t: torch.Tensor) -> int | None:
        """The slot holding `t`'s fingerprint at its current version: its producer's or first read's, else a new one
        (noted in its producer's entry, so that the next reader reuses it)."""
        key = id(t)
        hit = p.producers.get(key)
        if hit is not None and hit[_P_WEAKREF]() is t:
            if hit[_P_SLOT] is not None and hit[_P_VERSION] == version_of(t):
                return hit[_P_SLOT]
            with self.quiet():
                slot = p.batch.add(t)
            p.producers[key] = (*hit[:_P_SLOT], slot, version_of(t), *hit[_P_VERSION + 1:])
            return slot
        hit = p.external_ids.get(key)
        if hit is not None and hit[_E_WEAKREF]() is t and hit[_E_SLOT] is not None and hit[_E_VERSION] == version_of(t):
            return hit[_E_SLOT]
        with self.quiet():
            return p.batch.add(t)

    def unpacked(self, frame: Any, position: int) -> None:
        """A backward read the saved tensor at `position` of a non-reentrant region (checkpoint's unpack hook): one
        it never reads, its gradient formula never run (a branch only `.item()` reads), cannot change the gradients.
        Written as "unpacked" records once no backward runs (`_write_unpacked`). Per saved tensor: lean."""
        region = getattr(frame, "_ac_diff_region", None)
        if region is not None and region.recorded and not region.watched:
            merge_read(self._unpacked.setdefault(region.number, (region, {}))[1], position, gradients_computed())

    def _write_unpacked(self) -> None:
        """The positions backward passes read since the last call, per region: only outside a backward (one that is
        running would read more), so that a region's positions are whole for every backward that finished."""
        if self._unpacked and outside_backward():
            unpacked, self._unpacked = self._unpacked, {}
            for number, (region, reads) in sorted(unpacked.items(), key=lambda kv: kv[0]):
                if region.hold != "clean":  # (a region summarized as reproduced: its passes are not in the trace)
                    record = {"type": "unpacked", "region": number, "positions": sorted(reads)}
                    partial = [[position, read[0], sorted(read[1])] for position, read in sorted(reads.items())
                               if read is not None]
                    if partial:  # [position, node, [the gradients it computed]]: read where those need it only
                        record["partial"] = partial
                    self._writer.write(record)

    @_never_raise
    def check_failed(self, frame: Any, exc: BaseException) -> None:
        region = getattr(frame, "_ac_diff_region", None)
        if region is not None and region.hold == "held":
            self._retention.release(region)
        if region is not None and region.watched:
            self._watch.torch_raised(region)
        self._writer.write({"type": "check_error", "region": region.number if region else None,
                            "exc_type": type(exc).__name__, "message": _exception_text(exc)})
        self._writer.flush()

    @_never_raise
    def sac_saved(self, func) -> None:
        """Selective AC stored this op's output in the forward: mark the op (the last one of that name)."""
        passes = self._passes()
        if not passes:
            return
        p = passes[-1]
        p.region.options["sac"] = True
        name = op_info(func).name
        ops = p.ops
        for i in range(len(ops) - 1, max(len(ops) - 5, -1), -1):  # the op, maybe followed by SAC's detach
            if ops[i][_OP] == name:
                p.cached.add(i)
                break

    @_never_raise
    def sac_cached(self, func, args, kwargs, out) -> None:
        """Selective AC answered this op from its cache in the recompute: it never reached the recorder."""
        passes = self._passes()
        if passes:
            passes[-1].region.options["sac"] = True
            with self.quiet():
                self._record(passes[-1], func, args, kwargs or {}, out, cached=True)

    # -- module names -------------------------------------------------------------------------
    def _enter_function_module(self, frame: Any, region: _Region, phase: str):
        """Name the region after the module checkpoint() was given; put it on the module stack when its hooks
        do not run in the region (Hugging Face checkpoints `partial(layer.forward)`): returns (what was pushed,
        the module)."""
        fn = getattr(frame, "_ac_diff_fn", None)
        module, hooks_run = checkpointed_module(fn)
        if module is None:
            segment = sequential_segment(fn)
            if segment is not None:  # checkpoint_sequential: modules by their index, the region by its range
                functions, start, end = segment
                self.modules.name_by_index(functions)
                if phase == FORWARD and region.module is None:
                    region.module = segment_name(start, end)
            elif phase == FORWARD:
                region.fn_name = function_name(fn)
                inner = innermost_function(fn)
                name = getattr(inner, "__qualname__", None) or getattr(inner, "__name__", None)
                code = getattr(inner, "__code__", None)
                if code is not None:  # (a lambda's: the same every step; watch keys its module by it)
                    region.fn_site = f"{name} at {os.path.basename(code.co_filename)}:{code.co_firstlineno}"
            else:
                # a function's recompute runs from the backward, outside the module that called checkpoint(): it
                # runs inside it again, so that its ops and the module's tensors are named as in the forward
                caller = region.caller_module() if region.caller_module is not None else None
                stack = self.modules.stack()
                if caller is not None and not (stack and stack[-1][0] is caller):
                    stack.append((caller, region.caller))
                    return caller, None
            return None, None
        name = self.modules.name_of(module)
        if phase == FORWARD and region.module is None:
            region.module = name or type(module).__name__
        stack = self.modules.stack()
        if hooks_run or stack and stack[-1][0] is module:
            return None, module
        stack.append((module, name))
        return module, module

    @_never_raise
    def _on_module_enter(self, module, fqn: str, depth: int) -> None:
        passes = self._passes()
        if self.compile_watch.saw(module, fqn, passes[-1].region if passes else None):
            # Dynamo may have been loaded after the recording began
            self._stance.ensure() if self._stance.active or self.options.scope == "all" else wrap_compiled_graphs()
            keep_dynamo_out(Recorder)
        if passes:
            p = passes[-1]
            if p.region.recorded:
                if depth == p.base_depth and not p.n_ops and "grad_enabled" not in p.state:
                    with self.quiet():  # the region's module begins: torch's modes are in, the user's not yet
                        self._snapshot(p)
                self._note_attributes(p, module, fqn)
            if p.phase == FORWARD and p.region.module is None and depth == p.base_depth:
                p.region.module = fqn or type(module).__name__  # a root module has the empty FQN
                p.region.first_module_fqn = fqn

    def _snapshot(self, p: _Pass) -> None:
        """The pass's global state, once: as its region's module begins (torch restored the RNG and entered the
        grad and autocast modes of the recompute; a `torch.no_grad()` block inside the region's code has not
        begun), else at its first op."""
        p.state.update(global_state(self._mode))
        p.state["rng"] = rng_digest()

    def _note_attributes(self, p: _Pass, module, fqn: str) -> None:
        """The module's attributes as this call begins (before its own forward pre-hooks run), and the globals its
        forward reads (once per forward function and pass)."""
        seen = (vars(module).get("forward") or type(module).forward, method_owners(module))
        if seen not in p.codes_seen:
            p.codes_seen.add(seen)
            self._note_globals(p, *seen)
        for _, hook in forward_hooks(module):  # (a pre-hook counting in a global dict)
            if (hook, None) not in p.codes_seen:
                p.codes_seen.add((hook, None))
                self._note_globals(p, hook)
        attrs = module_attributes(module)
        prefix = f"{fqn or type(module).__name__}."  # (a root module: named as its region is)
        for key, value in attrs.items():
            p.attributes.setdefault(prefix + key, value)
        p.attribute_calls.append((module, prefix, attrs))
        if id(module) not in p.called:
            self._note_generators(p, module, prefix)
        p.called.setdefault(id(module), (module, fqn))

    @staticmethod
    def _note_generators(p: _Pass, module, prefix: str) -> None:
        """Where the host generators the module keeps stand, at its first call in the pass (`_finish_pass` compares:
        a region that draws from `self.rng` draws again in its recompute)."""
        for key, generator in held_generators(module):
            p.held_rng.setdefault(prefix + key, (generator, generator_state(generator)))

    def _draw_sites(self, p: _Pass, drew: list[str]) -> list[str]:
        """The lines of the pass's module code that read a host generator that moved (a few; per code, once)."""
        sites: list[str] = []
        for function, owner in dict.fromkeys([*p.codes_seen, *p.global_functions]):  # (a checkpointed function's)
            key = (function, owner, tuple(drew))
            found = self._sites.get(key)
            if found is None:
                found = self._sites[key] = host_draw_sites(function, owner, drew)
            sites.extend(site for site in found if site not in sites)
        return sites[:4]

    @staticmethod
    def _note_uncalled_children(p: _Pass) -> None:
        """As the pass ends, the attributes of the children its modules hold but never called: a parent's code reads
        them (HF's SDPA attention hands `self.dropout.p` to the kernel)."""
        for module, fqn in p.called.values():
            for key, child in module._modules.items():
                if child is not None and id(child) not in p.called:
                    prefix = clean_fqn(f"{fqn}.{key}" if fqn else key) + "."
                    for name, value in module_attributes(child).items():
                        p.attributes.setdefault(prefix + name, value)
        p.called = {}

    def _note_globals(self, p: _Pass, function: Any, owner: Owner = None) -> None:
        """The scalar globals `function` reads, as they are now: the first reading in the pass counts."""
        p.global_functions.append((function, owner))
        for key, (value, readers) in self._global_reads.values(function, owner).items():
            p.globals.setdefault(key, value)
            known = p.global_readers.setdefault(key, [])
            known.extend(r for r in readers if r not in known)

    def _note_global_updates(self, p: _Pass) -> None:
        """As the pass ends, the globals it changed (a counter its code advances, `PhiloxState.offset += 1`: the
        recompute, which runs that code again, advances it a second time)."""
        for function, owner in p.global_functions:
            for key, (value, _) in self._global_reads.values(function, owner).items():
                first = p.globals.get(key, value)
                if value != first and key not in p.global_updates:
                    p.global_updates[key] = [first, value]

    @_never_raise
    def _on_module_exit(self, module, fqn: str) -> None:
        """A call of a module ended: the scalar attributes it changed (a pre-hook counting calls) are updates
        the recompute, which calls it again, makes a second time."""
        passes = self._passes()
        calls = passes[-1].attribute_calls if passes else None
        if not calls:
            return
        for k in range(len(calls) - 1, -1, -1):
            if calls[k][0] is module:
                break
        else:
            return
        _, prefix, before = calls[k]
        del calls[k:]
        after = module_attributes(module)
        p = passes[-1]
        updates = p.attribute_updates
        for key, value in after.items():
            old = before.get(key, UNSET)
            if old != value and prefix + key not in updates:
                hooks = [callable_name(h) for h in module._forward_pre_hooks.values()]
                # (and whether its code reads it beyond the update: a schedule's counter, not a logged one; a
                # container's updates are method calls, `stats.append(...)`, that read it as they update it)
                attr = key.rsplit(".", 1)[-1]
                updates[prefix + key] = [old, value, hooks, not is_container(value) and (
                    hook_reads_again(module, key) if key.startswith("<") else read_again(type(module), attr)),
                    not key.startswith("<") and only_rebinds(type(module), attr)]
                if old is UNSET:  # made by this call (`self.calls = getattr(self, "calls", 0) + 1`): unset before it
                    p.attributes.setdefault(prefix + key, UNSET)

    # -- ops ----------------------------------------------------------------------------------
    @_never_raise
    def before_write(self, written: tuple, args: tuple, kwargs: dict | None) -> tuple:
        """An op is about to write the arguments `written` ((position, name), ..., FLUSH_ALL or BOXED_INPUTS) in place
        (dispatch.py): the passes' held tensors that share their memory are fingerprinted first, as they are now
        (FingerprintBatch.flush). Returns the arguments to record: `args`, or for a compiled graph call, its input
        list copied (the graph empties the one it is given)."""
        recorded = args
        if written is BOXED_INPUTS:
            written = FLUSH_ALL
            if len(args) > 1 and type(args[1]) is list:
                recorded = (args[0], list(args[1]), *args[2:])
        local = self._local
        passes = getattr(local, "passes", None)
        if not passes or local.internal:
            return recorded
        tensors = None if written is FLUSH_ALL else _written_tensors(written, args, kwargs)
        if tensors:
            for p in passes:
                if p.region.recorded and p.producers:
                    _mark_aliased_outputs_stale(p, tensors)
        batches = [p.batch for p in passes if p.batch.holding]
        if tensors is not None:
            batches = [b for b in batches if any(map(b.holds_memory_of, tensors))]
        for batch in batches:
            with self.quiet():
                batch.flush()
        return recorded

    def _on_op(self, func, args, kwargs, out) -> None:
        # never raises into the training, like the @_never_raise methods (inlined: this runs per op)
        try:
            self._ops_seen += 1
            local = self._local
            passes = getattr(local, "passes", None)
            if not passes or local.internal:
                self.ops_outside += 1
                return
            p = passes[-1]
            if not p.region.recorded:
                p.n_ops += 1
                return
            self._record(p, func, args, kwargs or {}, out)
        except Exception as exc:  # noqa: BLE001 - deliberately broad: this is the training's call path
            self._internal_error("_on_op", exc)
            self._lose("ops", exc)

    def _plan(self, func) -> "_OpPlan":
        """What `_record` does with every call of `func` under this recorder's options, worked out once."""
        info: OpInfo = op_info(func)
        name = info.name
        options = self.options
        discrete = info.discrete or name in options.discrete_ops
        plan = _OpPlan(func, info, name, name in options.ignore_ops, discrete,
                       info.derivable and not options.fingerprint_derived and name not in options.discrete_ops,
                       options.fingerprints and info.fingerprint, info.aliases_input, info.shares_values,
                       info.random or name == COMPILED_GRAPH_OP, info.output_roles)
        self._plans[id(func)] = plan  # keyed by id (an OpOverload hashes in Python); the func is kept in it
        return plan

    def _record(self, p: _Pass, func, args, kwargs, out, cached: bool = False) -> None:
        """One op of a region pass -> one row of plain tuples (no per-op dicts: cheaper to build, and
        tuples of atomic values leave the garbage collector's books at its next pass)."""
        plan = self._plans.get(id(func))
        if plan is None or plan[0] is not func:
            plan = self._plan(func)
        _, info, name, ignored, discrete, derivable, fingerprint, aliases, shares, maybe_random, roles = plan
        if ignored:
            return
        self.ops_recorded += 1
        p.n_ops += 1
        ops = p.ops
        index = len(ops)
        if index == 0 and "grad_enabled" not in p.state:  # no module call began the pass (`_on_module_enter`)
            self._snapshot(p)
        in_meta: list = []
        refs: list = []
        tensor_inputs: list[torch.Tensor] = []
        arg_values: list = []
        producers = p.producers
        known = True  # every tensor input is an output of this pass whose values were measured or follow
        for a in args:  # the common cases inline (this runs for every op of every region pass)
            if isinstance(a, _Tensor):
                in_meta.append((a.size(), a.dtype, a.device))  # as `_meta` (converted in `trace.encode_ops`)
                hit = producers.get(id(a))
                if hit is not None and hit[_P_WEAKREF]() is a:
                    refs.append(hit[_P_REF])
                    known = known and hit[_P_MEASURED]
                else:
                    refs.append(self._ref(p, a))
                    known = False
                tensor_inputs.append(a)
                arg_values.append("$")
            elif type(a) in _PLAIN_ARGS:
                arg_values.append(a)
                if type(a) is float and not isfinite(a):
                    p.nonfinite = True
            elif type(a) in _SEQUENCES and len(a) <= 256 and all(type(x) in _PLAIN_ARGS for x in a):
                arg_values.append(tuple(a))  # sizes, dims, split sizes
                if float in map(type, a) and not all(isfinite(x) for x in a if type(x) is float):
                    p.nonfinite = True
            else:
                n_inputs = len(tensor_inputs)
                arg_values.append(self._arg(p, a, in_meta, refs, tensor_inputs))
                known = known and len(tensor_inputs) == n_inputs
        if kwargs:
            n_inputs = len(tensor_inputs)
            for k, v in kwargs.items():
                arg_values.append({k: self._arg(p, v, in_meta, refs, tensor_inputs)})
            known = known and len(tensor_inputs) == n_inputs
        stack = p.module_stack
        module = stack[-1][1] if stack else None
        src = user_source(3) if self._source_lines else None
        outs = out if isinstance(out, (tuple, list)) else (out,)
        out_meta: list = []
        host = None
        known = known and bool(tensor_inputs) and not cached
        # "derived": an elementwise op of measured inputs is not fingerprinted (its values follow from
        # theirs, so the first divergence is never there; the diagnosis infers whether they differ)
        derived = known and derivable
        fp_wanted = fingerprint and not cached and not derived
        flows = derived or (known and shares)  # outputs whose values follow from measured ones
        drew = maybe_random and (draws(info, args, kwargs) if info.random else bool(args) and
                                 compiled_graph_draws(args[0]))
        for j, o in enumerate(outs):  # positional: one entry per return (trace NOTE [op outputs])
            if isinstance(o, _Tensor):
                out_meta.append((o.size(), o.dtype, o.device))
                slot = None
                if fp_wanted and (j >= len(roles) or holds_values(roles[j], drew)):
                    if aliases and tensor_inputs:
                        slot = _same_memory_slot(producers, tensor_inputs[0], o, index)
                    if slot is None and not flows:
                        slot = p.batch.add(o)
                    if slot is not None:
                        p.fp_slots.append((index, j, slot))
                # (weakref, op index, output index, fingerprint slot, version when fingerprinted, its ref,
                #  values measured or following from measured ones)
                producers[id(o)] = (_weakref(o), index, j, slot, version_of(o) if slot is not None else None,
                                    ("op", index, j), slot is not None or flows)
                if tensor_inputs and o is tensor_inputs[0] and o._base is not None:
                    # written in place through a view (`buf[i] = x`): the base's later readers read this op's write
                    # too; its own values are not this output's (no fingerprint slot of its own yet)
                    base = o._base
                    producers[id(base)] = (_weakref(base), index, j, None, None, ("op", index, j), False)
            elif o is None or type(o) in _PLAIN_ARGS:
                out_meta.append(o)
                if outs is not out:  # the op returned this value alone: the value handed to Python
                    host = o
                if type(o) is float and not isfinite(o):
                    p.nonfinite = True
            else:
                out_meta.append(_describe_output(o))
        flags = FLAG_CACHED if cached else 0
        if drew:
            flags |= FLAG_RANDOM
        if derived:
            flags |= FLAG_DERIVED
        if discrete and not cached:
            flags |= FLAG_DISCRETE
            self._keep_values(p, index, outs, tensor_inputs)
        ops.append((name, module, src, tuple(in_meta), tuple(arg_values), tuple(refs), tuple(out_meta), host,
                    flags))

    def _arg(self, p: _Pass, a: Any, in_meta: list, refs: list, tensor_inputs: list) -> Any:
        if isinstance(a, torch.Tensor):
            in_meta.append((a.size(), a.dtype, a.device))
            refs.append(self._ref(p, a))
            tensor_inputs.append(a)
            return "$"
        if isinstance(a, (int, float, bool, str)) or a is None:
            if isinstance(a, float) and not isfinite(a):
                p.nonfinite = True
            return a
        if isinstance(a, (list, tuple)):
            if len(a) > 256:
                return f"<{type(a).__name__} of {len(a)}>"
            return tuple([self._arg(p, x, in_meta, refs, tensor_inputs) for x in a])
        if isinstance(a, torch.dtype):
            return short_dtype(a)
        if isinstance(a, torch.SymInt):
            return str(a)
        if hasattr(a, "compiled_callable"):  # inductor_compiled_code's graph: no object address in the trace
            return compiled_graph_label(a)
        return str(a)

    def _note_outputs(self, region: _Region) -> None:
        """What a forward made that outlived it, by id -> (weakref, region): a recompute that reads one of another
        region's names it (`made_in`). Dead entries are dropped as the map grows."""
        outputs = self._outputs
        for key, made in region.kept.items():
            outputs[key] = (made[0], region.number)
        if len(outputs) > self._outputs_pruned_at * 2:
            for key in [k for k, (ref, _) in outputs.items() if ref() is None]:
                del outputs[key]
            self._outputs_pruned_at = max(len(outputs), 1024)

    @staticmethod
    def _known_ref(p: _Pass, t: torch.Tensor) -> tuple | None:
        """Where `t` came from if the pass has seen it, without tensor work: ("op", op index, output index)
        or (kind, name, external index)."""
        key = id(t)
        hit = p.producers.get(key)
        if hit is not None and hit[_P_WEAKREF]() is t:
            return hit[_P_REF]
        hit = p.external_ids.get(key)
        if hit is not None and hit[_E_WEAKREF]() is t:
            return hit[_E_REF]
        return None

    def _ref(self, p: _Pass, t: torch.Tensor) -> tuple:
        """Where tensor `t` came from, within pass `p` (producing op, input, parameter, buffer, external)."""
        known = self._known_ref(p, t)
        if known is not None:
            return known
        key = id(t)
        if type(t) not in _PLAIN_TENSORS and key not in p.input_ids and not isinstance(t, torch.nn.Parameter):
            # a wrapper subclass the pass made around an op's output outside dispatch (a float8 tensor an
            # autograd.Function builds from its cast): that op's output, so what changed upstream is followed through
            inner = wrapped_tensor(t)
            made = self._known_ref(p, inner) if inner is not None else None
            if made is not None and made[0] == "op":
                return made
        if key in p.input_ids:
            kind, name = "input", f"input[{p.input_ids[key]}]"
        else:
            outer = p.region.outer if p.phase == RECOMPUTE else ()
            owner = self.modules.owner_name(t, outer)
            child = p.child_outputs.get(key)
            if owner is not None:
                kind, name = owner
            elif child is not None and child[0]() is t:
                n = p.externals_per_kind.get(child[1], 0)  # (the nth output of that region this pass read)
                p.externals_per_kind[child[1]] = n + 1
                kind, name = "external", child[1] + (f" #{n}" if n else "")
            elif type(t) is not torch.nn.Parameter and (held := self.modules.global_name(t, outer)) is not None:
                kind, name = "external", held  # (a module-level context the code reads: `PACK_CTX["doc_ids"]`)
            else:
                kind = "param" if isinstance(t, torch.nn.Parameter) else "external"
                n = p.externals_per_kind.get(kind, 0)
                p.externals_per_kind[kind] = n + 1
                name = f"{kind}[{n}]"
        ext = {"i": len(p.externals), "kind": kind, "name": name, "meta": _meta(t), "first_op": len(p.ops)}
        if kind != "input":  # which tensor object: the same one updated in place, or another bound in its place
            ext["obj"] = key
        if kind == "param":  # whether it was frozen: it decides what its ops save
            ext["rg"] = t.requires_grad
        elif kind == "external" and t.grad_fn is not None:  # (a graph outside the region: a reentrant backward's
            ext["graph"] = True  # runs on into it)
        made = p.region.kept.get(key) if p.phase == RECOMPUTE and p.region.kept else None
        if made is not None and made[0]() is t:  # the forward made it and kept it (a cache): read back, not remade
            ext["made_by"], ext["versions"] = [made[1], made[2]], [made[3], version_of(t)]
        elif p.phase == RECOMPUTE and kind != "param":  # another region's forward made it (state carried in an
            made = self._outputs.get(key)  # attribute from call to call: the latest call's)
            if made is not None and made[0]() is t:
                ext["made_in"] = made[1]
        slot = p.batch.add(t, borrowed=True) if self.options.fingerprints else None
        if slot is not None:
            p.ext_slots.append((ext, slot))
        ref = (kind, name, ext["i"])
        p.external_ids[key] = (weakref.ref(t), ext["i"], ref, slot, version_of(t) if slot is not None else None)
        p.externals.append(ext)
        return ref

    def _keep_values(self, p: _Pass, index: int, outs, inputs: list[torch.Tensor]) -> None:
        limit = self.options.keep_values
        if limit <= 0:
            return
        for j, o in enumerate(outs):
            if isinstance(o, torch.Tensor) and o.numel() <= limit and o.layout == torch.strided:
                p.kept.append((index, f"out{j}", p.batch.keep(o)))
        # the score input lets the diagnosis say by what margin a decision flipped
        if inputs and inputs[0].is_floating_point() and inputs[0].numel() <= limit * 8:
            p.kept.append((index, "in0", p.batch.keep(inputs[0])))

    # -- regions and passes -------------------------------------------------------------------
    def _new_region(self, frame: Any, passes: list[_Pass], recorded: bool = True) -> _Region:
        with self._lock:
            number = self._regions
            self._regions += 1
        parent = passes[-1] if passes else None
        limit = self.options.max_regions
        region = _Region(
            number=number,
            kind="reentrant" if isinstance(frame, ReentrantFrame) else "checkpoint",
            parent=parent.region.number if parent else None,
            parent_phase=parent.phase if parent else None,
            options=frame_options(frame),
            caller=self.modules.current(),
            caller_module=_weakref(stack[-1][0]) if (stack := self.modules.stack()) else None,
            recorded=recorded and (limit is None or number < limit),
        )
        frame._ac_diff_region = region
        region.frame = _weakref(frame)
        return region

    def _finish_pass(self, p: _Pass, complete: bool, stopped_early: bool, exc: BaseException | None) -> None:
        region = p.region
        # what the pass raised (not the early stop that ends a recompute at its last saved tensor)
        error = f"{type(exc).__name__}: {_exception_text(exc)[:2000]}" if exc is not None and not stopped_early \
            else None
        if p.watch is not None:
            with self.quiet():
                self._watch.ended(region, p.watch, p.phase, complete, stopped_early, error,
                                  interrupted=isinstance(exc, INTERRUPTIONS))
            return
        if region.unwatched:
            return
        inner = region.first_module_fqn
        if inner is not None and region.fn_name and not region.written and p.phase == FORWARD:
            if any(row[_MODULE] is None or inner and row[_MODULE] != inner and not row[_MODULE].startswith(inner + ".")
                   for row in p.ops):  # (a root module's FQN is "": every module is inside it)
                region.module = region.fn_name  # the function does more than call that module
        # what only the live state says, now: the Python generators moved, the tensors that outlived the pass
        called = list(p.called.values())  # (the modules it ran: where a side output is kept)
        for kind in p.batch.subclasses:  # (Python state a tensor subclass's ops read: its class attributes)
            for key, value in subclass_attributes(kind).items():
                p.attributes.setdefault(key, value)
        if p.called:
            self._note_uncalled_children(p)
        if p.global_functions:
            self._note_global_updates(p)
        drew = host_draws(p.host_rng, host_rng_states()) if p.host_rng else []
        drew += [name for name, (generator, state) in p.held_rng.items() if generator_state(generator) != state]
        p.held_rng = {}
        outputs = None
        if p.phase == FORWARD and region.recorded:
            region.kept = _outliving(p)
            self._note_outputs(region)
            outputs = sorted([op, out] for _, op, out, _ in region.kept.values())
            if p.returned is not None:
                side = _side_outputs(p, region.kept, called)
                if side:
                    p.state["side_outputs"] = side
            else:
                p.state["held_outputs"] = _held_outputs(region.kept, called)
        collection = None
        if region.recorded:
            with self.quiet():
                collection = p.batch.launch()  # one asynchronous read-back per device: no host sync
        finish = functools.partial(self._write_pass, p, complete, stopped_early, error, drew, outputs, collection)
        if collection is None or (not self._landing and collection.ready()):
            finish()
        else:  # written once the read-back has landed, in the order the passes ended (`_write_landed`)
            self._landing.append((collection, finish, p))

    def _write_landed(self, wait: bool = False) -> None:
        """Write the passes whose read-back has landed (`wait`: all of them, waiting), oldest first."""
        landing = self._landing
        with self._landing_lock:
            while landing and (wait or landing[0][0].ready()):
                _, finish, p = landing.popleft()
                try:
                    finish()
                except Exception as error:  # noqa: BLE001 - the pass is lost, but never silently
                    self._internal_error("finish_pass", error)
                    self._write_lost_pass(p, error)

    def _write_pass(self, p: _Pass, complete: bool, stopped_early: bool, error: str | None, drew: list,
                    outputs: list | None, collection: Any) -> None:
        region = p.region
        writer = self._writer
        self._write_region(region)
        ops_record = None  # () -> the pass's "ops" record, built only when it is written
        fps: dict[int, list] = {}
        kept: list = []
        if collection is not None:
            with self.quiet():
                fingerprints, kept = collection.collect()
            p.nonfinite = p.nonfinite or not p.batch.finite
            for ext, slot in p.ext_slots:
                ext["fp"] = fingerprints[slot]
            updated = None
            for row in p.positions:
                if len(row) > 6:
                    if row[2] != "op":
                        if updated is None:
                            updated = updated_externals(p.ops)
                        if (row[2], row[5]) in updated:
                            # saved before the op that updates it (a batch norm's running statistics, read by no
                            # backward in training): the recompute saves it after the forward's update, a side
                            # effect. No fingerprint, so that watch learns from this pass not to compare it
                            del row[6:]
                            continue
                    row[6] = fingerprints[row[6]]
            fps = _fps_by_op(p, fingerprints)
            if self._watch is not None:  # a region of watch mode's full steps: what watch would have compared
                self._watch.full_pass(region, p.phase, p.positions, complete, stopped_early, error, p.watched_outputs)
            if p.ops:
                ops_record = functools.partial(_ops_record, p, p.ops, fps, kept)
        record = {
            "type": "pass", "region": region.number, "phase": p.phase, "attempt": p.attempt,
            # (an unrecorded region's ops are counted only where a recorded one around it runs the mode)
            "n_ops": p.n_ops if region.recorded or p.n_ops else None, "complete": complete, "stopped_early": stopped_early, "state": p.state,
            "externals": p.externals, "positions": p.positions,
        }
        if drew:
            p.state["host_draws"] = drew  # Python's or numpy's generator moved during the pass
            sites = self._draw_sites(p, drew)
            if sites:
                p.state["host_draw_sites"] = sites  # where the code of its modules reads that generator
        if outputs is not None:
            record["outputs"] = outputs
        if p.attributes:
            record["attributes"] = p.attributes
        if p.attribute_updates:
            record["attribute_updates"] = p.attribute_updates
        if p.globals:
            record["globals"] = p.globals
            record["global_readers"] = p.global_readers
        if p.global_updates:
            record["global_updates"] = p.global_updates
        if p.nonfinite:
            record["nonfinite"] = True  # the trace writer then keeps NaN and infinities (see TraceWriter.write)
        if p.lost:
            record["lost"] = dict(p.lost)
        if error is not None:
            record["error"] = error
        if region.recorded and self.options.write == "diverged":
            self._retention.write(p, ops_record, record, fps, kept,
                                  failed=error is not None or bool(p.lost))
        else:
            if ops_record is not None:
                writer.write(ops_record)  # built (and encoded) by the writer thread
            writer.write(record)
        writer.flush()
        # free what the pass held (the producer map holds weak references only)
        p.producers.clear()
        p.external_ids.clear()
        p.batch = FingerprintBatch(bits=True)
        p.ops = []

    def _write_region(self, region: _Region) -> None:
        """The region's record, once, before its first pass record."""
        if region.written:
            return
        region.written = True
        self._writer.write(self._region_record(region))

    def _region_record(self, region: _Region) -> dict[str, Any]:
        # a watched function's region is named as watch keys it (its function, where it calls more than one module:
        # what full recording names it after seeing its ops), so its escalation and its full recordings match it
        module = region.watch_key if region.watched and region.fn_name and region.watch_key == region.fn_name \
            else region.module or region.caller
        return {
            "type": "region", "region": region.number, "module": module,
            # (a checkpointed function that calls no module is named by its caller: which function it was)
            **({"function": region.fn_name} if region.module is None and region.caller and region.fn_name else {}),
            "kind": region.kind, "parent": region.parent, "parent_phase": region.parent_phase,
            "options": dict(region.options), "recorded": region.recorded,  # copies: encoded later
            **({"compiled": list(self.compile_watch.inside[region.number])}
               if region.number in self.compile_watch.inside else {}),
            **({"watched": True} if region.watched else {}),
            **({"step": region.step} if region.step is not None else {}),
            **({"optimizer_steps": region.optimizer_steps} if region.optimizer_steps else {}),
        }


def _count_optimizer_steps(recorder: Recorder) -> Any:
    """Count optimizer.step() calls (every torch.optim optimizer): a region's step counts forward-backward cycles
    (micro-batches under gradient accumulation), the report also names the optimizer step. The hook's handle."""
    def counted(optimizer: Any, args: Any, kwargs: Any) -> None:
        recorder.optimizer_steps += 1

    try:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        return register_optimizer_step_post_hook(counted)
    except Exception:  # noqa: BLE001 - a torch without it: steps are counted as before
        return None


def _mark_aliased_outputs_stale(p: _Pass, tensors: list) -> None:
    """Tensors about to be written in place that the pass made by detaching (`.data`): such an alias has a version
    counter of its own, so the output it aliases sees no new version. The outputs that share its storage are marked
    stale, so that a later reader (a view torch saves) is fingerprinted as the memory is then, not served the
    fingerprint the output had before the write."""
    producers, ops = p.producers, p.ops
    for t in tensors:
        hit = producers.get(id(t))
        if hit is None or hit[_P_WEAKREF]() is not t or ops[hit[_P_OP]][_OP] not in DETACHED_ALIAS_OPS:
            continue
        address = _storage_of(t)[0]
        if address is None:
            continue
        stale = [k for k, e in producers.items() if e[_P_SLOT] is not None and e[_P_VERSION] >= 0
                 and (o := e[_P_WEAKREF]()) is not None and o is not t and _storage_of(o)[0] == address]
        for k in stale:
            e = producers[k]
            producers[k] = (*e[:_P_VERSION], -1, *e[_P_VERSION + 1:])


def _written_tensors(written: tuple, args: tuple, kwargs: dict | None) -> list:
    """The tensors an op is given at the argument positions (or names) it writes in place."""
    found = []
    for i, name in written:
        a = args[i] if i < len(args) else (kwargs or {}).get(name)
        found.extend(x for x in (a if isinstance(a, (list, tuple)) else (a,)) if isinstance(x, torch.Tensor))
    return found


def _outliving(p: _Pass) -> dict[int, tuple]:
    """Each tensor the pass made that is still alive as it ends, id -> (weakref, op index, output, its version now):
    the region's outputs and what its code kept (a cache), as opposed to intermediates, freed when the region
    returned. Not a tensor it read and updated in place (a buffer's running statistic: the recompute's second update
    is a side effect)."""
    externals = p.external_ids
    kept = {}
    for key, e in p.producers.items():
        t = e[_P_WEAKREF]()
        if t is not None and not (key in externals and externals[key][_E_WEAKREF]() is t):
            kept[key] = (e[_P_WEAKREF], e[_P_OP], e[_P_OUTPUT], version_of(t))
    return kept


def _side_outputs(p: _Pass, kept: dict[int, tuple], called: list[tuple]) -> list[list]:
    """[[op, output, holder]] of the floating-point tensors a reentrant forward made that outlived it other than
    through what it returned (a list a hook fills, a module attribute): made under no_grad, they carry no gradient to
    whatever the script computes from them. Not one it detached on purpose (logging). `holder` names the attribute or
    global that keeps it (modules.py `held_by`; None: out of reach, a hook's closure)."""
    ops, side = p.ops, []
    for ref, op, out, _ in kept.values():
        t = ref()
        if t is not None and t.is_floating_point() and _storage_of(t)[0] not in p.returned \
                and ops[op][_OP] not in DETACHED_ALIAS_OPS:
            side.append([op, out, held_by(t, called)])
    return sorted(side, key=lambda s: s[:2])


def _grad_outputs(p: _Pass, outputs: Any) -> list[list] | None:
    """[[op, output]] of the tensors a reentrant recompute returned that require grad: its backward starts there
    (an argmax, or what it computed under no_grad, gets no gradient). None where one of them is no op's output."""
    found = []
    for t in outputs if isinstance(outputs, (tuple, list)) else (outputs,):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            ref = Recorder._known_ref(p, t)
            if ref is None or ref[0] != "op":
                return None
            found.append([ref[1], ref[2]])
    return found


def _held_outputs(kept: dict[int, tuple], called: list[tuple]) -> list[list]:
    """[[op, output, holder]] of the tensors a non-reentrant forward made that outlived it because the script keeps
    them (`held_by`: an attribute, a global, an item of one), which its recompute's replace. What the region only
    returned outlives the forward alone: torch drops what the recompute returns."""
    held = []
    for ref, op, out, _ in kept.values():
        t = ref()
        holder = held_by(t, called) if t is not None else None
        if holder is not None:
            held.append([op, out, holder])
    return sorted(held)


def _cached(p: _Pass, index: int) -> bool:
    """Whether selective AC saved op `index` of the pass (forward) or served it from its cache (recompute)."""
    return index in p.cached or bool(p.ops[index][_FLAGS] & FLAG_CACHED)


def _same_memory_slot(producers: dict, source: torch.Tensor, out: torch.Tensor, index: int) -> int | None:
    """The fingerprint slot of `source` if `out` is the very same memory with the same last dimension and
    `source` was made by the op just before (nothing can have written it since it was fingerprinted):
    then both reductions (the sum over contiguous memory; the bilinear form over rows of the last
    dimension) see identical data in identical order and give bit-identical numbers, so `out` need not
    be reduced again (mm -> _unsafe_view in every linear and matmul of a 3-D input)."""
    hit = producers.get(id(source))
    if (hit is None or hit[_P_SLOT] is None or hit[_P_OP] != index - 1 or hit[_P_WEAKREF]() is not source
            or version_of(source) != hit[_P_VERSION]):
        return None
    if (out.dtype is not source.dtype or out.dim() < 2 or source.dim() < 2 or out.shape[-1] != source.shape[-1]
            or out.numel() != source.numel() or not out.numel() or out.data_ptr() != source.data_ptr()
            or not out.is_contiguous() or not source.is_contiguous() or type(out) is not torch.Tensor
            or type(source) is not torch.Tensor):
        return None
    return hit[_P_SLOT]


class _OpPlan(NamedTuple):
    """What `Recorder._record` does with every call of one op (unpacked in the hot path: no attribute lookups)."""

    func: Any
    info: OpInfo
    name: str
    ignored: bool
    discrete: bool
    derivable: bool  # its outputs need no fingerprint when all its inputs were measured
    fingerprint: bool
    aliases_input: bool
    shares_values: bool
    maybe_random: bool
    output_roles: tuple[str, ...]  # oprules.output_roles, by position


def _values_meaningful(p: _Pass, ref: tuple) -> bool:
    """Whether output ref = ("op", i, j) holds values worth comparing: data, or RNG bookkeeping of a call that drew;
    not memory its kernel may leave unwritten (flash attention's `unused`, the philox seed of a call that drew
    nothing), which autograd saves for backward all the same (oprules.output_roles)."""
    row = p.ops[ref[1]]
    return holds_values(output_role(row[_OP], ref[2]), bool(row[_FLAGS] & FLAG_RANDOM))


def _describe_output(o: Any) -> str:
    """A return that is neither a tensor nor a plain value, as the trace lists it ("list[3]", "SymInt")."""
    return f"{type(o).__name__}[{len(o)}]" if isinstance(o, (list, tuple)) else type(o).__name__


def _fps_by_op(p: _Pass, fingerprints: list) -> dict[int, list]:
    """op index -> its outputs' fingerprints (None where an output was not fingerprinted)."""
    fps: dict[int, list] = {}
    ops = p.ops
    for index, j, slot in p.fp_slots:
        fp = fps.get(index)
        if fp is None:
            fp = fps[index] = [None] * len(ops[index][_OUT])
        fp[j] = fingerprints[slot]
    return fps


def _ops_record(p: _Pass, ops: list[tuple], fps: dict[int, list], kept: list) -> dict[str, Any]:
    """The pass's ops as one trace record (see trace.encode_ops), with the values it kept."""
    vals: dict[int, dict] = {}
    for index, key, idx in p.kept:
        vals.setdefault(index, {})[key] = kept[idx]
    return encode_ops(p.region.number, p.phase, p.attempt, ops, fps, vals, p.cached, p.nonfinite)


_ACTIVE: list[Recorder] = []  # recorders started in this process and not stopped yet (record() inside `ac-diff run`)
_PLAIN_ARGS = frozenset({int, float, bool, str, type(None)})
_PLAIN_TENSORS = frozenset({torch.Tensor, torch.nn.Parameter})  # memory of their own: offsets and strides say it all
_SEQUENCES = frozenset({list, tuple})
_Tensor = torch.Tensor
_weakref = weakref.ref


def _meta(t: torch.Tensor) -> tuple:
    """(shape, short dtype, device name); op rows hold (size, dtype, device), converted alike when written."""
    return written_meta((t.size(), t.dtype, t.device))


def _process_group_size() -> int:
    """Ranks in this process's initialized process group (1 without one)."""
    with contextlib.suppress(Exception):
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size()
    return 1


def _unrecorded_ranks(launched_as_rank: bool) -> str | None:
    """A process group of several ranks that this process's launcher did not start (Lightning and
    Accelerate spawn their other ranks themselves, without ac-diff): only this rank was recorded."""
    n = 1 if launched_as_rank else _process_group_size()
    if n > 1:
        return (f"the process group has {n} ranks but only this one was recorded (its launcher started the "
                f"others without ac-diff): run `ac-diff run --nproc-per-node {n} script.py` to record every rank")
    return None


def _distributed() -> bool:
    """Whether other ranks' traces may be compared with this one (torchrun's WORLD_SIZE, or a process group)."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1) > 1 or _process_group_size() > 1


def _exception_text(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:  # a broken __str__ must not lose the trace
        return repr(exc)


@contextlib.contextmanager
def record(path: str | os.PathLike = "ac-diff-out/trace-rank0.jsonl", options: RecordOptions | None = None,
           **option_overrides: Any):
    """Record every checkpointed region run inside the block into the trace file at `path`.

    The trace is finished even if the block raises; the exception then propagates unchanged.
    """
    if _ACTIVE:  # inside `ac-diff run`: a second recorder would see the first's hooks and modes, and both go wrong
        outer = _ACTIVE[-1]
        message = (f"ac_diff.record({os.fspath(path)!r}) runs inside a run ac-diff records already: the block is "
                   f"recorded into that run's trace ({outer.path}), and a copy of it as it is when the block ends is "
                   f"written to {os.fspath(path)}")
        print(f"ac-diff: {message}", file=sys.stderr)
        outer._writer.write({"type": "warning", "message": message})
        try:
            yield outer
        finally:
            outer.copy_trace(path)
        return
    if option_overrides:
        base = options or RecordOptions()
        options = RecordOptions(**{**base.__dict__, **option_overrides})
    recorder = Recorder(path, options).start()
    try:
        yield recorder
    except BaseException as exc:
        recorder.stop(exc)
        raise
    else:
        recorder.stop()


__all__ = ["Recorder", "RecordOptions", "record"]
