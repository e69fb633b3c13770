"""torch.compile and the recorder: what ac-diff cannot see, and saying so instead of crashing.

The recorder sees ops through a TorchDispatchMode and regions through torch.utils.checkpoint's own
classes. torch.compile changes both:

* compile AROUND checkpointed blocks (`torch.compile(model)`, torchtitan's per-block compile of the
  `checkpoint_wrapper` modules, HF `torch_compile=True`): Dynamo turns each checkpoint() into a
  `tag_activation_checkpoint` higher-order op and AOTAutograd recomputes it inside the compiled backward
  graph. No `_CheckpointFrame` ever runs, so there is no region to record.
* compile INSIDE a region (`checkpoint(torch.compile(block), x)`, a compiled submodule or function):
  the compiled code must stay compiled, or the recorder would change the numbers it observes (inductor's
  dropout draws other numbers than eager dropout). The recording mode says `ignore_compile_internals()`
  (torch >= 2.9): Dynamo then compiles under it as without it, and the mode sees only what runs at run
  time. `route_compiled_code` has inductor hand each compiled graph call to the mode as ONE op,
  `inductor_compiled_code` (its inputs and outputs fingerprinted like any op, so a divergence is placed
  at that call); `compiled_graph_draws` says whether that graph draws random numbers. With other
  backends (aot_eager) the graph's aten ops reach the mode one by one.
  On older torch Dynamo skips frames under a dispatch mode: that code runs eagerly (said in a note).
* `ac-diff run --compiled eager` ($AC_DIFF_COMPILED=eager, inherited by the reference run and `fix`'s tries) and
  `--scope all` (the mode on for the whole run) have `EagerStance` run compiled code eagerly on purpose, so that
  checkpoint() inside a compiled model runs as a region ac-diff can see. Without it, `GraphWatch`
  (compiled_graphs.py) counts the checkpointed regions in the graphs Dynamo compiles and the state they update.

`CompileWatch` notes both: modules that are compiled (`OptimizedModule`, `module.compile()`) as the
module hooks see them, inside a region or outside, and how many frames Dynamo compiled during the
recording. The recorder writes its findings into the region records (`"compiled": [...]`) and as
trace warnings, which every report shows as notes.

`skip_when_compiling(hook)` keeps the recorder's global module hooks out of Dynamo's traces: traced
hooks would be baked into compiled graphs (and Dynamo trips over their weak-keyed state).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import warnings
from typing import Any, Callable

import torch

from ..oprules import COMPILED_GRAPH_OP  # (the op a compiled graph call is recorded as)

# torch warns once per compiled module that global module hooks (ours) fire an extra time for the
# OptimizedModule wrapper; ac-diff's module stack handles that, and the user did not register them.
_GLOBAL_HOOKS_WARNING = r"Using `torch.compile\(module\)` when there are global hooks on modules"


def _never() -> bool:
    return False


# True while Dynamo traces the calling code (False in eager code and in compiled code at run time)
is_compiling: Callable[[], bool] = getattr(getattr(torch, "compiler", None), "is_compiling", _never)


def tracing() -> bool:
    """True while torch.compile/export traces: Dynamo, or AOTAutograd running code on fake/proxy tensors.

    checkpoint() itself runs during AOTAutograd's trace of a `tag_activation_checkpoint` op; that is
    not a pass of the real run (and its tensors have no values), so the recorder ignores it.
    """
    try:
        if is_compiling():
            return True
        keys = torch._C._TorchDispatchModeKey
        get = torch._C._get_dispatch_mode
        return get(keys.FAKE) is not None or get(keys.PROXY) is not None
    except Exception:  # pragma: no cover - torch without these internals
        return False


def is_fake(t: Any) -> bool:
    """A tensor without values that a compiler traces with (torch 2.6 packs AOTAutograd's fake tensors, symbolic
    sizes and all, while no fake mode is on the dispatch stack)."""
    try:
        from torch._subclasses.fake_tensor import is_fake as fake  # (through functional and wrapper tensors)

        return bool(fake(t))
    except Exception:  # pragma: no cover - torch without these internals
        return False


def skip_when_compiling(hook: Callable[..., Any]) -> Callable[..., Any]:
    """`hook`, but a no-op while Dynamo traces it (it is then absent from the compiled graph)."""

    @functools.wraps(hook)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if is_compiling():
            return None
        return hook(*args, **kwargs)

    return wrapper


class EagerStance:
    """Run torch.compile'd code eagerly while a region pass runs (`torch.compiler.set_stance("force_eager")`).

    Under the recorder's dispatch mode Dynamo would skip those frames anyway, but on its way it traces the
    recorder's own dispatch handler and, with `fullgraph=True`, raises ("found no compiled frames" /
    recompile limit). force_eager keeps Dynamo out entirely. Nested `push()`es count; the stance the
    user had is restored by the last `pop()`. Does nothing if Dynamo was never imported.
    """

    def __init__(self) -> None:
        self._depth = 0
        self._prior: Any = None
        self.active = False

    def push(self) -> None:
        self._depth += 1
        self.ensure()

    def ensure(self) -> None:
        """Take the stance now if pushed but Dynamo was not loaded yet at the push."""
        if self._depth == 0 or self.active:
            return
        eval_frame = sys.modules.get("torch._dynamo.eval_frame")
        if eval_frame is None:
            return
        try:
            self._prior = eval_frame._set_stance(eval_frame.DynamoStance("force_eager"))
            self.active = True
        except Exception:  # inside a compiled frame (set_stance refuses), or another torch
            self._prior, self.active = None, False

    def pop(self) -> None:
        if self._depth == 0:
            return
        self._depth -= 1
        if self._depth == 0 and self.active:
            eval_frame = sys.modules.get("torch._dynamo.eval_frame")
            try:
                eval_frame._set_stance(self._prior)
            except Exception:
                pass
            self._prior, self.active = None, False


COMPILED_ENV = "AC_DIFF_COMPILED"  # "eager": `ac-diff run --compiled eager` (inherited by the processes it starts)


def eager_requested() -> bool:
    """`ac-diff run --compiled eager` asked for torch.compile'd code to run eagerly in this process."""
    return os.environ.get(COMPILED_ENV, "") == "eager"


def can_force_eager() -> bool:
    """Whether this torch can run compiled code eagerly (torch.compiler.set_stance, torch >= 2.6)."""
    try:
        import torch._dynamo.eval_frame as eval_frame

        return hasattr(eval_frame, "DynamoStance")
    except ImportError:  # pragma: no cover
        return False


def force_eager(stance: EagerStance) -> str | None:
    """Run torch.compile'd code eagerly from now on (`torch.compiler.set_stance("force_eager")`), so that checkpoint()
    inside a compiled model runs as a torch.utils.checkpoint region. Returns a warning where this torch cannot."""
    if not can_force_eager():
        return (f"--compiled eager: torch {torch.__version__} has no torch.compiler.set_stance (torch >= 2.6), so "
                "compiled code ran compiled and checkpointed regions inside compiled graphs were not recorded")
    stance.push()
    return None if stance.active else "--compiled eager: torch.compiler.set_stance('force_eager') was refused"


def keeps_compiled_code() -> bool:
    """Whether this torch compiles under a dispatch mode that ignores compile internals (torch >= 2.9)."""
    try:
        from torch.utils._python_dispatch import TorchDispatchMode

        return hasattr(TorchDispatchMode, "ignore_compile_internals")
    except ImportError:  # pragma: no cover
        return False


def route_compiled_code(*mode_classes: type) -> bool:
    """Have inductor's compiled graphs reach these dispatch modes as one `inductor_compiled_code` op each
    (private torch API, guarded). Graphs compiled from now on are wrapped (their numbers do not change:
    the same kernels run); False where this torch cannot."""
    try:
        from torch._higher_order_ops.utils import redirect_to_mode
        from torch._higher_order_ops.wrap import inductor_compiled_code
    except ImportError:
        return False
    for cls in mode_classes:
        if cls not in getattr(inductor_compiled_code, "python_key_table", {}):
            try:
                redirect_to_mode(inductor_compiled_code, cls)
            except Exception:
                return False
    return wrap_compiled_graphs()


# what runs inside checkpoint's pack hooks on real tensors: Dynamo must not compile it as a frame of its own
_HOOK_MODULES = ("ac_diff.capture.watch", "ac_diff.capture.host_hash", "ac_diff.capture.byte_sums",
                 "ac_diff.capture.fingerprint", "ac_diff.capture.segments", "ac_diff.capture.fused_prints")
_HOOK_METHODS = ("pack", "pass_outputs", "_unseen", "_saved_values", "_values_slot", "_ref", "_known_ref",
                 "_measure_returned")
_kept_out: list[bool] = []


def keep_dynamo_out(recorder_class: type) -> None:
    """Mark the code of ac-diff's pack hooks (`_HOOK_MODULES`, `_HOOK_METHODS` of `recorder_class`) for Dynamo to
    skip, once it is loaded: torch 2.6 compiled watch's `hold`, called from the pack hook of a region around a
    compiled module, on fake tensors with symbolic sizes (the position was lost). Never inlined in a user's graph."""
    if _kept_out or "torch._dynamo" not in sys.modules:
        return
    _kept_out.append(True)
    try:
        from torch._dynamo.eval_frame import skip_code
    except Exception:  # pragma: no cover - torch without it: nothing to keep out
        return
    functions = [getattr(recorder_class, name) for name in _HOOK_METHODS if hasattr(recorder_class, name)]
    for name in _HOOK_MODULES:
        module = sys.modules.get(name)
        for value in vars(module).values() if module is not None else ():
            if getattr(value, "__module__", None) == name:
                functions.extend(vars(value).values() if isinstance(value, type) else [value])
    codes = [f.__code__ for f in (getattr(f, "__func__", f) for f in functions) if hasattr(f, "__code__")]
    while codes:
        code = codes.pop()
        with contextlib.suppress(Exception):
            skip_code(code)
        codes.extend(c for c in code.co_consts if isinstance(c, type(code)))


def wrap_compiled_graphs() -> bool:
    """Switch inductor's `wrap_inductor_compiled_regions` on once its config is loaded (importing it costs
    over a second, so this waits for the script to load it: torch.compile does)."""
    config = sys.modules.get("torch._inductor.config")
    if config is None or not hasattr(config, "wrap_inductor_compiled_regions"):
        return False
    if not config.wrap_inductor_compiled_regions:
        config.wrap_inductor_compiled_regions = True
    return True


_draws: dict[int, tuple[Any, bool]] = {}


def compiled_graph_draws(compiled: Any) -> bool:
    """Whether a compiled graph (`inductor_compiled_code`'s first argument) draws random numbers: any node
    of its original FX graph is a random op (or inductor's seeds for one)."""
    hit = _draws.get(id(compiled))
    if hit is not None and hit[0]() is compiled:
        return hit[1]
    found = False
    try:
        graph = getattr(compiled, "original_gm", None)
        for node in graph.graph.nodes if graph is not None else ():
            target = node.target
            tags = getattr(target, "tags", ()) or ()
            if torch.Tag.nondeterministic_seeded in tags or "inductor_seed" in str(target) \
                    or "inductor_random" in str(target):
                found = True
                break
    except Exception:
        found = False
    try:
        import weakref

        _draws[id(compiled)] = (weakref.ref(compiled), found)
    except TypeError:
        pass
    return found


def compiled_graph_label(compiled: Any) -> str:
    """How a compiled graph argument is written in the trace: stable across passes, no object address."""
    name = getattr(compiled, "compile_region_name", None)
    idx = getattr(compiled, "idx", compiled if isinstance(compiled, int) else None)
    return f"<compiled graph {name or idx}>"


def compile_kind(module: Any) -> str | None:
    """"torch.compile(module)" for an OptimizedModule, "module.compile()" for an in-place compiled one."""
    if type(module).__name__ == "OptimizedModule" and hasattr(module, "_orig_mod"):
        return "torch.compile(module)"
    if module.__dict__.get("_compiled_call_impl") is not None:
        return "module.compile()"
    return None


def _dynamo_counts() -> tuple[int, int]:
    """(frames Dynamo compiled, graphs it produced) so far in this process; (0, 0) if Dynamo never loaded."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return 0, 0
    try:
        counters = utils.counters
        return int(counters["frames"]["ok"]), int(counters["stats"]["unique_graphs"])
    except Exception:
        return 0, 0


class CompileWatch:
    """Collects what torch.compile did during one recording; `messages()` says what it means."""

    def __init__(self, where: Callable[[], str | None] = lambda: None) -> None:
        from .compiled_graphs import GraphWatch

        self.inside: dict[int, list[str]] = {}  # region number -> compiled modules run in it
        self.outside: dict[str, str] = {}  # compiled module FQN run outside any region -> kind
        self.graphs = GraphWatch(where)  # checkpointed regions inside the graphs Dynamo compiles
        self.eager = False  # compiled code runs eagerly (--compiled eager)
        self._start = (0, 0)
        self._filter: tuple | None = None

    def start(self) -> None:
        self._start = _dynamo_counts()
        self.graphs.install()
        warnings.filterwarnings("ignore", message=_GLOBAL_HOOKS_WARNING)
        self._filter = warnings.filters[0]

    def stop(self) -> None:
        self.graphs.uninstall()
        if self._filter is not None:
            try:
                warnings.filters.remove(self._filter)
                warnings._filters_mutated()  # type: ignore[attr-defined]
            except (ValueError, AttributeError):
                pass
            self._filter = None

    def saw(self, module: Any, fqn: str, region: Any | None) -> str | None:
        """Called for every module the module hooks see; records it if it is compiled. Returns its kind."""
        kind = compile_kind(module)
        if kind is None:
            return None
        self.graphs.ensure()  # Dynamo may have been loaded after the recording began
        name = fqn or type(getattr(module, "_orig_mod", module)).__name__
        if region is None:
            self.outside.setdefault(name, kind)
        else:
            names = self.inside.setdefault(region.number, [])
            if name not in names:
                names.append(name)
        return kind

    def summary(self) -> dict[str, Any] | None:
        """The end record's `compiled`: {"eager", "modules", "regions", "graphs", "mutations", "can_run_eager"} (None:
        no compile)."""
        modules = sorted(set(self.outside) | {n for ns in self.inside.values() for n in ns})
        graphs = self.graphs.summary() or {}
        if not (modules or graphs or self.eager):
            return None
        return {"eager": self.eager, "modules": modules, "regions": graphs.get("regions", 0),
                "graphs": graphs.get("graphs", 0), "mutations": graphs.get("mutations", []),
                "can_run_eager": can_force_eager()}

    def compiled_frames(self) -> tuple[int, int]:
        frames, graphs = _dynamo_counts()
        return max(0, frames - self._start[0]), max(0, graphs - self._start[1])

    def messages(self, regions_seen: int, scope_all: bool = False) -> list[str]:
        out: list[str] = []
        frames, graphs = self.compiled_frames()
        if scope_all:  # the recorder's dispatch mode was active all the time: Dynamo compiled nothing new
            names = sorted(set(self.outside) | {n for ns in self.inside.values() for n in ns})
            if names:
                out.append(f"torch.compile: {_list(names)} ran eagerly: with --scope all ac-diff's dispatch mode is "
                           "always active and torch.compile does not compile under it, so the regions recorded are "
                           "those of the eager model (a divergence only the compiled code has is not reproduced)")
            return out
        if self.eager:  # --compiled eager
            names = sorted(set(self.outside) | {n for ns in self.inside.values() for n in ns})
            if names:
                out.append(f"torch.compile: {_list(names)} ran eagerly (--compiled eager: torch.compiler.set_stance("
                           f"'force_eager')), so the {regions_seen} checkpointed region(s) recorded are those of the "
                           "eager model; a divergence only the compiled code has (AOTAutograd's recompute, inductor's "
                           "kernels) is not reproduced")
            return out
        if self.inside:
            names = sorted({n for ns in self.inside.values() for n in ns})
            regions = sorted(self.inside)
            text = (f"torch.compile: compiled module(s) {_list(names)} ran inside checkpointed region(s) "
                    f"{_list(map(str, regions))}")
            if keeps_compiled_code():
                text += (": their code ran compiled, as without ac-diff; each call of an inductor graph is recorded "
                         f"as one step ({COMPILED_GRAPH_OP}) whose inputs and outputs are fingerprinted, so a "
                         "divergence is placed at that call, not at an op inside it")
            else:
                text += (f". torch {torch.__version__} does not compile under a dispatch mode, so that code ran eagerly "
                         "while ac-diff recorded: its numbers may differ from a run without ac-diff (torch >= 2.9 "
                         "keeps it compiled)")
            out.append(text)
        if self.outside:
            names = sorted(self.outside)
            text = (f"torch.compile: compiled module(s) {_list(names)} ran outside any recorded region "
                    f"({_list(sorted(set(self.outside.values())))})")
            if regions_seen == 0:
                text += ("; no checkpointed region ran: checkpoint() inside a compiled graph is recomputed by the "
                         f"compiler (AOTAutograd) and ac-diff cannot see it. Run {_eager_or_not()} "
                         "(torchtitan: --compile.enable false; HF Trainer: torch_compile=False)")
            else:
                text += ("; checkpointed regions inside them are recomputed by the compiler, not by "
                         "torch.utils.checkpoint, and are not in this trace")
            out.append(text)
        elif frames and regions_seen == 0:
            out.append(f"torch.compile: Dynamo compiled {frames} frame(s) ({graphs} graph(s)) during the recording "
                       "and no checkpointed region ran: checkpoint() inside a compiled function is recomputed by the "
                       f"compiler and ac-diff cannot see it; run {_eager_or_not()}")
        return out


def _eager_or_not() -> str:
    """How to record checkpointed regions that ran inside compiled graphs, on this torch."""
    if can_force_eager():
        return ("with `ac-diff run --compiled eager` (compiled code then runs eagerly, with its checkpointed regions) "
                "or without compile")
    return (f"without compile (torch {torch.__version__} cannot run compiled code eagerly: --compiled eager is "
            "torch >= 2.6)")


def _list(items: Any, limit: int = 6) -> str:
    items = list(items)
    shown = ", ".join(items[:limit])
    return shown + (f" (+{len(items) - limit} more)" if len(items) > limit else "")
