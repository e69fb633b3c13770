"""Python state a pass records besides tensors: the attributes of the modules it calls, and the module-level
globals their code reads. Compared between a region's forward and its recompute (diagnosis/attributes.py).

    module_attributes(block)  ->  {"step": 3, "scale": 0.5,
                                   "mems": {"type": "list", "len": 2, "ids": 3240967713}}
    globals_read = GlobalReads()
    globals_read.values(Mlp.forward)  ->  {"model.LOW_PRECISION": (True, ("model.py in forward",))}
    host_draw_sites(Block.forward, Block, ["random"])  ->  ["model.py:20 in forward"]   (`random.random() < p`)
    read_again(Block, "calls")  ->  True   (`if self.calls % 2:` reads the counter `self.calls += 1` updates)

A container attribute (list, tuple, dict, deque) is summarized by its length and the identity of its first
items (a Transformer-XL memory that grows by one tensor per call: 1 -> 2 entries), never by its values. A
global is one a function's code loads by name (`co_names` read by LOAD_GLOBAL) whose value is a plain scalar:
the flag a branch reads (`if LOW_PRECISION:`), in the function itself, the code nested in it, and the user's
functions and methods it calls by name (`self.helper()`, a child's `self.router.logits(x)`). Which globals a
function reads is worked out once per function; the values are read per call of `values()` (the recorder: once
per function and pass).
"""

from __future__ import annotations

import contextvars
import dis
import itertools
import os
import random
import types
import weakref
from collections import OrderedDict, defaultdict, deque
from itertools import islice
from typing import Any, Iterator

import torch
from torch import nn

from .sourceline import code_site, is_internal, short_path

# plain scalars a module keeps (`self.step`, `self.scale`)
SCALAR_TYPES = (int, float, bool, str)
# torch's own values a module or a global keeps that decide what ops do (`self.compute_dtype = torch.bfloat16`):
# recorded by their name, "torch.bfloat16"
NAMED_TYPES = (torch.dtype, torch.device)
CONTAINER_TYPES = (list, tuple, dict, deque, OrderedDict, defaultdict)
MAX_STRING = 200  # characters of a string value kept
NOT_SCALAR = object()  # `recorded_scalar` of a value that is neither a scalar nor one of torch's named values
# torch's own bookkeeping on every module (hook dicts, `_parameters`, ...); the mode is the pass's "training"
_NOT_STATE = frozenset({"training", "_is_full_backward_hook", *vars(nn.Module())})
_GraphModule = torch.fx.GraphModule
Owner = type | tuple[type, ...] | None  # the class(es) whose methods `self.x()` (`self.child.x()`) calls
_IDENTITY_ITEMS = 64  # items of a container whose identity is summarized (its length is always exact)


def container_summary(value: Any) -> dict[str, Any]:
    """`[t1, t2]` -> {"type": "list", "len": 2, "ids": 3240967713}: `ids` digests the first items, a scalar by value,
    a tensor by identity (`_serial`), so a tensor replaced or appended gives other ids, equal numbers rebuilt do not."""
    items = value if type(value) is tuple else tuple(islice(
        value.items() if isinstance(value, dict) else value, _IDENTITY_ITEMS))
    try:
        digest = hash(tuple(_keyed(x) for x in items))
    except Exception:  # an unhashable item (a list in a list): by identity
        digest = hash(tuple((_identity(x[0]), _identity(x[1])) if isinstance(value, dict) else _identity(x)
                            for x in items))
    return {"type": type(value).__name__, "len": len(value), "ids": digest & 0xFFFFFFFF}


def _keyed(x: Any) -> Any:
    """An item as the digest takes it: a tensor by its serial, in a tuple too (a dict's (key, value), an (h, c))."""
    if isinstance(x, torch.Tensor):
        return _serial(x)
    return tuple(_keyed(y) for y in x) if type(x) is tuple else x


_SERIALS: dict[int, tuple[weakref.ref, int]] = {}  # id -> (the tensor, its serial), while it lives
_COUNTER = itertools.count(1)


def _serial(t: torch.Tensor) -> tuple[str, int]:
    """A tensor's identity that outlives its address: CPython hands a freed tensor's address (its id) to a later
    object, so a memory whose item was replaced by a tensor allocated there looked unchanged; a serial does not
    repeat."""
    key = id(t)
    entry = _SERIALS.get(key)
    if entry is None or entry[0]() is not t:
        entry = _SERIALS[key] = (weakref.ref(t, lambda _, key=key: _SERIALS.pop(key, None)), next(_COUNTER))
    return "tensor", entry[1]


def recorded_scalar(value: Any) -> Any:
    """How every scalar the recorder keeps is kept (a module's attribute, a global, a run config's field, a hook's
    variable): a plain scalar as it is (a string cut at MAX_STRING characters), a dtype or a device by its name
    ("torch.bfloat16"); NOT_SCALAR for anything else."""
    kind = type(value)
    if kind in SCALAR_TYPES:
        return value[:MAX_STRING] if kind is str else value
    return str(value) if kind in NAMED_TYPES else NOT_SCALAR


def _identity(x: Any) -> Any:
    return x if type(x) in SCALAR_TYPES else _serial(x) if isinstance(x, torch.Tensor) else id(x)


def module_attributes(module: nn.Module) -> dict[str, Any]:
    """The module's own scalar attributes, and its containers summarized (`container_summary`; a dict's scalar items
    by key as well, `cfg['stage']`), by name in sorted order. Runs at every module call in a region: torch's ~20 keys
    of every module are left out at C speed."""
    out: dict[str, Any] = {}
    if isinstance(module, _GraphModule):  # (a graph a compiler made: its attributes are the compiler's, `_lineno_map`)
        return out
    space = vars(module)
    for key in sorted(space.keys() - _NOT_STATE):
        value = space[key]
        scalar = recorded_scalar(value)
        if scalar is not NOT_SCALAR:
            out[key] = scalar
        elif type(value) in CONTAINER_TYPES:
            out[key] = container_summary(value)
            if isinstance(value, dict):  # a dict of settings (`self.cfg["stage"]`): its scalar items by key too
                out.update((f"{key}[{item!r}]", v) for item, v in _dict_scalars(value))
        elif run_config(value):
            for name, field in scalar_fields(value):
                out[f"{key}.{name}"] = field
            for name, field in vars(value).items():  # (a cache object's lists: `self.cache.pending.append(...)`)
                if type(field) in CONTAINER_TYPES:
                    out[f"{key}.{name}"] = container_summary(field)
    if module._forward_pre_hooks or module._forward_hooks or getattr(type(module).forward, "__closure__", None):
        out.update(hook_state(module))
    return out


def held_generators(module: nn.Module) -> Iterator[tuple[str, Any]]:
    """(name, object) of the host generators the module keeps as attributes (`self.rng = np.random.RandomState(0)`,
    a `random.Random`): checkpoint's preserve_rng_state restores none of them."""
    for key, value in vars(module).items():
        if isinstance(value, random.Random) or type(value).__module__.startswith("numpy.random"):
            yield key, value


def subclass_attributes(kind: type) -> dict[str, Any]:
    """The scalar class attributes of a tensor subclass (and of its bases up to torch.Tensor), by qualified name:
    what its `__torch_dispatch__` may read as it runs each op ("SimLowPrec.bits": 16, a simulated precision)."""
    out: dict[str, Any] = {}
    for klass in kind.__mro__:
        if klass is torch.Tensor or klass is torch.nn.Parameter:
            break
        for key, value in vars(klass).items():
            scalar = recorded_scalar(value) if not key.startswith("_") else NOT_SCALAR
            if scalar is not NOT_SCALAR:
                out.setdefault(f"{kind.__qualname__}.{key}", scalar)
    return out


CONFIG_FIELDS = 64  # an object a module holds with at most this many attributes is read as a run config


def run_config(value: Any) -> bool:
    """A plain object of the user's a module holds, small enough to be a run config (`self.cfg.chunk`); not a
    module, a tensor, a function or one of torch's objects."""
    space = getattr(value, "__dict__", None)
    kind = type(value)
    return (type(space) is dict and len(space) <= CONFIG_FIELDS and not isinstance(value, (nn.Module, torch.Tensor, type,
            types.FunctionType, types.MethodType, types.ModuleType)) and not kind.__module__.startswith("torch"))


HOOK_STATE = "<{kind} {name}>.{var}"  # how a hook's own variable is named among its module's attributes


def hook_state(module: nn.Module) -> dict[str, Any]:
    """The scalar variables the module's forward (pre-)hooks keep in their closures (a call counter a monitoring hook
    bumps): `<forward pre-hook count>.calls` -> 3. The recompute calls the module, and its hooks, again."""
    return {label: value for label, _, value in hook_cells(module)}


class ItemCell:
    """An item of a list or dict a hook keeps (`calls = [0]` in its closure or as a default argument, `calls[0] += 1`),
    read and written as a closure cell is (`cell_contents`)."""

    __slots__ = ("container", "key")

    def __init__(self, container: Any, key: Any) -> None:
        self.container, self.key = container, key

    @property
    def cell_contents(self) -> Any:
        return self.container[self.key]

    @cell_contents.setter
    def cell_contents(self, value: Any) -> None:
        self.container[self.key] = value


_HOOK_ITEMS = 8  # items of a container a hook keeps that are recorded (a counter is one or two)


def hook_cells(module: nn.Module) -> Iterator[tuple[str, Any, Any]]:
    """(label, cell, recorded value) of each scalar variable the module's forward (pre-)hooks keep in their closures,
    and of each scalar item of a small list or dict they keep there or as a default argument: `("<forward pre-hook
    count>.calls", cell, 3)`, `("<forward pre-hook warm>.calls[0]", ItemCell, 3)`; the cell is where a restore puts
    another value."""
    for kind, fn in stateful_functions(module):
        for var, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
            try:
                value = cell.cell_contents
            except ValueError:  # (a cell not yet filled)
                continue
            label = HOOK_STATE.format(kind=kind, name=fn.__name__, var=var)
            scalar = recorded_scalar(value)
            if scalar is not NOT_SCALAR:
                yield label, cell, scalar
            else:
                yield from _container_items(label, value)
        for var, value in _defaults(fn):  # (a mutable default argument keeps its items from call to call)
            yield from _container_items(HOOK_STATE.format(kind=kind, name=fn.__name__, var=var), value)


FORWARD_CLOSURE = "closure of"  # the kind of a module's own forward among the functions keeping state


def forward_hooks(module: nn.Module) -> Iterator[tuple[str, Any]]:
    """(kind, hook) of each forward pre-hook and forward hook registered on `module`, as it holds them."""
    for kind, hooks in (("forward pre-hook", module._forward_pre_hooks), ("forward hook", module._forward_hooks)):
        yield from ((kind, hook) for hook in hooks.values())


def hook_context_vars(module: nn.Module) -> Iterator[contextvars.ContextVar]:
    """The context variables `module`'s forward hooks read as globals, or through a global that wraps one (an output
    collector a model's forward sets for the hooks of its layers: transformers' router logits for the aux loss)."""
    for _, hook in forward_hooks(module):
        fn = _function(hook)
        if fn is None:
            continue
        for name in fn.__code__.co_names:
            value = fn.__globals__.get(name)
            if isinstance(value, contextvars.ContextVar):
                yield value
            elif not isinstance(value, (type, types.ModuleType, types.FunctionType)) and hasattr(value, "__dict__"):
                yield from (v for v in vars(value).values() if isinstance(v, contextvars.ContextVar))


def stateful_functions(module: nn.Module) -> Iterator[tuple[str, types.FunctionType]]:
    """(kind, function) of each function that keeps state for `module` from call to call: its forward (pre-)hooks,
    and its own forward where that is a closure (a class defined inside a factory, reading the factory's `state`
    dict); a callable object or a builtin keeps none here (an object's own state is read as its attributes)."""
    for kind, hook in forward_hooks(module):
        fn = _function(hook)
        if fn is not None:
            yield kind, fn
    forward = _function(getattr(type(module), "forward", None))
    if forward is not None and forward.__closure__:
        yield FORWARD_CLOSURE, forward


def _defaults(fn: types.FunctionType) -> Iterator[tuple[str, Any]]:
    """(parameter, default value) of `fn`'s parameters with defaults."""
    code = fn.__code__
    positional = code.co_varnames[:code.co_argcount]
    yield from zip(positional[len(positional) - len(fn.__defaults__ or ()):], fn.__defaults__ or ())
    yield from (fn.__kwdefaults__ or {}).items()


def _container_items(label: str, value: Any) -> Iterator[tuple[str, ItemCell, Any]]:
    if type(value) is list and len(value) <= _HOOK_ITEMS:
        items: Any = enumerate(value)
    elif type(value) is dict and len(value) <= _HOOK_ITEMS:
        items = value.items()
    else:
        return
    for key, item in list(items):
        scalar = recorded_scalar(item)
        if scalar is not NOT_SCALAR and isinstance(key, (int, str)):
            yield f"{label}[{key!r}]", ItemCell(value, key), scalar


# The recorded value of an attribute a module call created (it did not exist when the call began)
UNSET: dict[str, Any] = {"unset": True}


def is_container(value: Any) -> bool:
    """A recorded attribute value that summarizes a container (see `container_summary`)."""
    return isinstance(value, dict) and "len" in value and "type" in value


_MAX_FUNCTIONS = 32  # functions followed from one root (its helpers, their helpers)


class GlobalReads:
    """The scalar module-level globals a function reads, by name: worked out once per function."""

    def __init__(self) -> None:
        # (code object, owner) -> ((globals dict, name, key, the functions reading it), ...)
        self._reads: dict[tuple, tuple] = {}

    def values(self, fn: Any, owner: Owner = None) -> dict[str, tuple[Any, tuple[str, ...]]]:
        """{"model.LOW_PRECISION": (True, ("model.py in forward",))}: each global `fn` (or what it calls) reads,
        with its value now and the functions reading it; `owner`: the class whose methods `self.x()` calls (and
        its children's, `method_owners`)."""
        fn = _function(fn)
        if fn is None:
            return {}
        reads = self._reads.get((fn.__code__, owner))
        if reads is None:
            reads = self._reads[fn.__code__, owner] = _reads_of(fn, owner)
        out: dict[str, tuple[Any, tuple[str, ...]]] = {}
        for space, name, key, readers in reads:
            value = space.get(name)
            scalar = recorded_scalar(value)
            if scalar is not NOT_SCALAR or value is None:
                out[key] = (scalar if value is not None else None, readers)
            elif isinstance(value, dict):  # a config dict (`GRL["lambda"]`): its scalar items
                for item, v in _dict_scalars(value):
                    out[f"{key}[{item!r}]"] = (v, readers)
            elif type(value) is list:  # a helper's mutable default (`calls=[0]`): its scalar items; a global list
                out.update((label, (v, readers)) for label, _, v in _container_items(key, value))
                out[key] = (container_summary(value), readers)  # (`STATS.append(...)` in the forward: counted twice)
            else:  # a class of the user's or a run config: its scalar fields (`PhiloxState.offset`)
                for field, v in scalar_fields(value):
                    out[f"{key}.{field}"] = (v, readers)
        return out


def method_owners(module: nn.Module) -> tuple[type, ...]:
    """The classes whose methods a module's forward may call by name: its own, then its children's of the user's
    (`self.router.logits(x)`), each once."""
    children = (type(c) for c in module._modules.values() if c is not None)
    return (type(module), *dict.fromkeys(k for k in children if not k.__module__.startswith("torch.")
                                         and k is not type(module)))


def _holds_fields(value: Any, space: dict) -> bool:
    """A global whose scalar fields are state: a class defined in the module that reads it (a counter kept on the
    class, `PhiloxState.offset`), a small run config object, or a small dict of settings (`GRL = {"lambda": 0.0}`, a
    schedule writes it), or one still empty when first read (`COUNTS = {}`, which a hook fills with counts)."""
    if type(value) is dict:
        return not value or len(value) <= CONFIG_FIELDS and any(True for _ in _dict_scalars(value))
    if isinstance(value, type):
        return value.__module__ == space.get("__name__") and len(vars(value)) <= CONFIG_FIELDS
    return run_config(value)


def scalar_fields(value: Any) -> Iterator[tuple[str, Any]]:
    """(name, value) of an object's scalar attributes (a run config's fields, a class's counters), a private one too
    (Hugging Face keeps the attention implementation a model runs in `config._attn_implementation_internal`), not a
    dunder; of an instance, also the defaults its class holds that it has not set itself (`class Cfg: upcast = True`,
    then `cfg.upcast = False` between the passes)."""
    own = vars(value)
    kind = type(value)
    defaults = () if isinstance(value, type) or kind.__module__ in ("builtins", "types") else islice(
        ((k, v) for k, v in vars(kind).items() if k not in own), CONFIG_FIELDS)
    for field, v in (*own.items(), *defaults):
        v = recorded_scalar(v)
        if v is not NOT_SCALAR and not field.startswith("__"):
            yield field, v


def _dict_scalars(value: dict) -> Iterator[tuple[str, Any]]:
    """(key, value) of a dict's scalar items with string keys (at most CONFIG_FIELDS of them)."""
    for key, v in islice(value.items(), CONFIG_FIELDS):
        v = recorded_scalar(v)
        if isinstance(key, str) and v is not NOT_SCALAR:
            yield key, v


def _function(fn: Any) -> types.FunctionType | None:
    """The plain function behind a bound method or functools.partial; None for anything else (a builtin)."""
    for _ in range(4):
        if isinstance(fn, types.FunctionType):
            return fn
        fn = getattr(fn, "__func__", None) or getattr(fn, "func", None)
    return None


def _user_functions(root: types.FunctionType, owner: Owner
                    ) -> Iterator[tuple[types.FunctionType, list[tuple[types.CodeType, set[str]]]]]:
    """`root` and the user's functions and methods (`self.helper()`) it calls by name, up to _MAX_FUNCTIONS, each with
    its code objects (its own and those nested in it) and the names each loads as globals."""
    todo, seen = [root], set()
    while todo and len(seen) < _MAX_FUNCTIONS:
        fn = todo.pop()
        if fn.__code__ in seen or is_internal(fn.__code__.co_filename):
            continue
        seen.add(fn.__code__)
        space = fn.__globals__
        codes = [(code, _global_names(code)) for code in _codes(fn.__code__)]
        yield fn, codes
        for code, loaded in codes:
            for name in code.co_names:
                if name not in loaded:  # an attribute's name (`self.helper()`, `self.fc`): a method is followed
                    method = _method(owner, name)
                    if isinstance(method, types.FunctionType):
                        todo.append(method)
                elif isinstance(space.get(name), types.FunctionType):
                    todo.append(space[name])
                elif isinstance(space.get(name), type) and issubclass(space[name], torch.autograd.Function):
                    forward = _method(space[name], "forward")  # `MyFn.apply(...)`: its forward runs in the pass
                    if isinstance(forward, types.FunctionType):
                        todo.append(forward)


def _user_codes(root: types.FunctionType, owner: Owner) -> Iterator[tuple[dict, types.CodeType, set[str]]]:
    """(globals, code object, the names it loads as globals) of `root`, the code nested in it, and the user's
    functions and methods it calls (`_user_functions`)."""
    for fn, codes in _user_functions(root, owner):
        for code, loaded in codes:
            yield fn.__globals__, code, loaded


def _reads_of(root: types.FunctionType, owner: Owner) -> tuple:
    found: dict[str, tuple] = {}  # key -> (globals dict, name, readers)
    for fn, codes in _user_functions(root, owner):
        space = fn.__globals__
        module = _module_name(space)
        for param, value in _defaults(fn):  # (a helper's mutable default, `def temp(calls=[0])`, lasts as a global)
            if type(value) in (list, dict) and value and len(value) <= _HOOK_ITEMS:
                found.setdefault(f"{module}.{fn.__qualname__}.{param}", (
                    {param: value}, param, [f"{short_path(fn.__code__.co_filename)} in {fn.__name__}"]))
        for code, loaded in codes:
            reader = (f"{short_path(code.co_filename)}:{_line_span(code)} in {code.co_qualname} {FUNCTION_CODE}"
                      if _is_function_code(code, space) else f"{short_path(code.co_filename)} in {code.co_name}")
            for name in code.co_names:
                value = space.get(name)
                if name in loaded and (value is None or recorded_scalar(value) is not NOT_SCALAR
                                       or type(value) is list or _holds_fields(value, space)) and name in space \
                        and not name.startswith("__"):
                    key = f"{module}.{name}"
                    readers = found.setdefault(key, (space, name, []))[2]
                    if reader not in readers:
                        readers.append(reader)
            for settings, attr in _settings_read(code, space, loaded):  # `hparams.TEMP`, a module of the user's
                readers = found.setdefault(f"{settings.__name__}.{attr}", (vars(settings), attr, []))[2]
                if reader not in readers:
                    readers.append(reader)
    return tuple((space, name, key, tuple(readers)) for key, (space, name, readers) in found.items())


_read_again: dict[tuple[type, str], bool] = {}
_LOADS = frozenset({"LOAD_ATTR", "LOAD_METHOD", "LOAD_CONST"})  # (LOAD_CONST: the name in `getattr(self, "calls", 0)`)
_JUMPS = frozenset(dis.hasjrel) | frozenset(dis.hasjabs)  # (a forward one skips the code up to its target)


def read_again(owner: type, name: str) -> bool:
    """Whether the forward of `owner` (with the code nested in it and the methods it calls) reads its attribute `name`
    on every call other than to update it: more loads of the name than stores outside any code a jump can skip
    (`self.calls += 1` loads and stores it once; a branch `if self.calls % 2` or a blend `self.seen / 64` loads it
    again; a read behind another condition, `if self.warmup is not None and self.calls < self.warmup`, may never run,
    and is not counted). A counter a schedule reads changes what later steps compute when the recompute advances it
    again; one kept only to be logged does not. Once per class and name; a forward that is no plain function counts
    as reading it."""
    key = (owner, name)
    hit = _read_again.get(key)
    if hit is None:
        forward = _function(getattr(owner, "forward", None))
        codes = [code for _, code, _ in _user_codes(forward, owner)] if forward is not None else []
        hit = _read_again[key] = forward is None or _loaded_beyond_stores(codes, name, _LOADS, "STORE_ATTR")
    return hit


def only_rebinds(owner: type, name: str) -> bool:
    """Whether the forward of `owner` (and the code it calls) only binds its attribute `name`, never reads it
    (`self.pending = (x.detach(), idx)` for after the step): its new value comes from the forward's inputs alone, so a
    recompute that reproduced the forward binds it to the same values again, not twice over."""
    key = (owner, name)
    hit = _only_rebinds.get(key)
    if hit is None:
        forward = _function(getattr(owner, "forward", None))
        codes = [code for _, code, _ in _user_codes(forward, owner)] if forward is not None else []
        loads, stores = _loads_and_stores(codes, name, _LOADS, "STORE_ATTR")
        hit = _only_rebinds[key] = forward is not None and stores > 0 and not loads
    return hit


_only_rebinds: dict[tuple[type, str], bool] = {}


def hook_reads_again(module: nn.Module, label: str) -> bool:
    """read_again for a variable a hook of `module` keeps in its closure (`label` as hook_cells names it), or an item
    of a list it keeps: whether the hook reads it beyond updating it (`nonlocal calls; calls += 1; scale = 0.5 if
    calls <= warmup else 1.0`; `calls[0] += 1; s = min(1.0, calls[0] / warmup)`)."""
    head, item, _ = label.partition("[")
    for kind, fn in stateful_functions(module):
        for var in (*fn.__code__.co_freevars, *fn.__code__.co_varnames[:fn.__code__.co_argcount]):
            if HOOK_STATE.format(kind=kind, name=fn.__name__, var=var) != head:
                continue
            codes = list(_codes(fn.__code__))
            if item:
                return _read_on_other_lines(codes, var)
            return _loaded_beyond_stores(codes, var, _DEREF_LOADS, "STORE_DEREF")
    return False


_DEREF_LOADS = frozenset({"LOAD_DEREF", "LOAD_CLOSURE", "LOAD_CLASSDEREF"})
_VARIABLE_LOADS = _DEREF_LOADS | {"LOAD_FAST"}


def _read_on_other_lines(codes: list[types.CodeType], var: str) -> bool:
    """Whether a container `var` is read on a line that does not write an item of it (`calls[0] += 1` reads and writes
    it on one line; `if calls[0] < warmup` reads it), outside code a forward jump can skip (see read_again)."""
    for code in codes:
        instructions = list(dis.get_instructions(code))
        skipped = _skipped(instructions)
        line, lines, writes = None, {}, set()
        for ins in instructions:
            line = _line_of(ins, line)
            if ins.opname in _VARIABLE_LOADS and ins.argval == var:
                lines.setdefault(line, ins.offset)
            elif ins.opname == "STORE_SUBSCR":
                writes.add(line)
        if any(not skipped(offset) for line, offset in lines.items() if line not in writes):
            return True
    return False


def _loaded_beyond_stores(codes: list[types.CodeType], name: str, loads_by: frozenset, store_by: str) -> bool:
    """More loads of `name` than stores in `codes`, outside any code a forward jump can skip (see read_again)."""
    loads, stores = _loads_and_stores(codes, name, loads_by, store_by, unconditional=True)
    return loads > stores


def _loads_and_stores(codes: list[types.CodeType], name: str, loads_by: frozenset, store_by: str,
                      unconditional: bool = False) -> tuple[int, int]:
    """How many times `codes` load and store `name`; `unconditional`: only loads that run whenever a store of it
    runs (every jump that can skip the load can skip that store too: `if self.warm: self.calls += 1; a = self.calls`
    reads it whenever it counts), and stores outside code a forward jump can skip."""
    loads = stores = 0
    for code in codes:
        instructions = list(dis.get_instructions(code))
        guards = _guards(instructions) if unconditional else None
        found = [ins for ins in instructions if ins.argval == name and (ins.opname in loads_by or
                                                                          ins.opname == store_by)]
        stored = [guards(ins.offset) for ins in found if ins.opname == store_by] if guards else []
        for ins in found:
            if guards is None:
                loads += ins.opname in loads_by
                stores += ins.opname == store_by
            elif ins.opname == store_by:
                stores += not guards(ins.offset)
            else:
                loads += any(guards(ins.offset) <= g for g in stored) or not guards(ins.offset)
    return loads, stores


def _guards(instructions: list[dis.Instruction]):
    """For an offset, the forward jumps of `instructions` that can skip it (a branch's body), as a frozenset; not a
    jump on the module's training flag alone (`if self.training and ...`: taken only in evaluation)."""
    spans = []
    for i, ins in enumerate(instructions):
        if ins.opcode in _JUMPS and isinstance(ins.argval, int) and ins.argval > ins.offset:
            if not ("IF_FALSE" in ins.opname and i and instructions[i - 1].argval == "training"
                    and instructions[i - 1].opname in ("LOAD_ATTR", "LOAD_METHOD")):
                spans.append((ins.offset, ins.argval))
    return lambda offset: frozenset(k for k, (start, end) in enumerate(spans) if start < offset < end)


def _skipped(instructions: list[dis.Instruction]):
    """A test of whether an offset lies in code a forward jump of `instructions` can skip (see _guards)."""
    guards = _guards(instructions)
    return lambda offset: bool(guards(offset))


def _line_of(ins: dis.Instruction, line: int | None) -> int | None:
    """The source line `ins` belongs to, given the line of the instruction before it (Python >= 3.11 tells each
    instruction's; before, only the first of a line's, and 3.13's `starts_line` is a flag)."""
    start = getattr(getattr(ins, "positions", None), "lineno", None) or getattr(ins, "starts_line", None)
    return start if isinstance(start, int) and not isinstance(start, bool) and start else line


def _settings_read(code: types.CodeType, space: dict, loaded: set[str]) -> list[tuple[types.ModuleType, str]]:
    """(module, name) of each scalar a user's own module holds that `code` reads as `module.NAME` (a settings module,
    `import hparams` ... `x / hparams.TEMP`); not an installed package's."""
    modules = {name for name in loaded if isinstance(space.get(name), types.ModuleType) and _users_module(space[name])}
    if not modules:
        return []
    out = []
    instructions = list(dis.get_instructions(code))
    for i, ins in enumerate(instructions):
        if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME") and ins.argval in modules:
            attrs = _attributes_after(instructions, i)
            settings = space[ins.argval]
            if attrs and not attrs[0].startswith("__") and attrs[0] in vars(settings) and \
                    recorded_scalar(vars(settings)[attrs[0]]) is not NOT_SCALAR and (settings, attrs[0]) not in out:
                out.append((settings, attrs[0]))
    return out


def _users_module(module: types.ModuleType) -> bool:
    path = getattr(module, "__file__", None) or ""
    return bool(path) and not is_internal(path) and "site-packages" not in path and "dist-packages" not in path


def global_state_read(fn: Any, owner: Owner) -> list[tuple[dict, str]]:
    """(namespace, name) of the module-level state `fn` (and the user's code it calls) loads by name: scalars and
    containers (a counter `global calls`, a dict cache, a list collected into), not modules, functions or classes."""
    fn = _function(fn)
    found: dict[tuple[int, str], tuple[dict, str]] = {}
    for space, code, loaded in _user_codes(fn, owner) if fn is not None else ():
        for name in loaded:
            value = space.get(name)
            if name in space and not name.startswith("__") and (
                    recorded_scalar(value) is not NOT_SCALAR or isinstance(value, (list, dict, deque))):
                found.setdefault((id(space), name), (space, name))
    return list(found.values())


def host_draw_sites(fn: Any, owner: Owner, generators: list[str]) -> list[str]:
    """Where `fn` (or what it calls) reads one of the host `generators` that moved ("random", "numpy.random", a module's
    own, "policy.rng": where an attribute of that name is loaded):
    ["model.py:20 in forward"], the lines that load the `random` or `numpy` module, or a function bound to their
    generator (`from random import random`)."""
    fn = _function(fn)
    sites: list[str] = []
    held = {g.rsplit(".", 1)[1] for g in generators if "." in g and g != "numpy.random"}  # (`held_generators`)
    for space, code, loaded in _user_codes(fn, owner) if fn is not None else ():
        line = code.co_firstlineno
        instructions = list(dis.get_instructions(code))
        for i, ins in enumerate(instructions):
            line = _line_of(ins, line)
            if (ins.opname in ("LOAD_GLOBAL", "LOAD_NAME") and _draws(space.get(ins.argval), generators, code)
                    or ins.opname in ("LOAD_ATTR", "LOAD_METHOD") and ins.argval in held) \
                    and not _SEEDING & set(_attributes_after(instructions, i)):
                site = code_site(code, line)
                if site not in sites:
                    sites.append(site)
    return sites


# what a line that loads a generator's module may call that draws nothing (`random.seed(step)`)
_SEEDING = frozenset({"seed", "setstate", "getstate", "set_state", "get_state"})


def _attributes_after(instructions: list, i: int) -> list[str]:
    """The attribute names loaded right after instruction `i` (`random.seed` -> ["seed"], `np.random.rand` ->
    ["random", "rand"])."""
    names = []
    for ins in instructions[i + 1:]:
        if ins.opname not in ("LOAD_ATTR", "LOAD_METHOD"):
            break
        names.append(ins.argval)
    return names


def _draws(value: Any, generators: list[str], code: types.CodeType) -> bool:
    """`value`, a global the code loads, reads one of the host generators that moved."""
    name = getattr(value, "__name__", None) if isinstance(value, types.ModuleType) else None
    owner = getattr(value, "__self__", None)
    if name == "random" or type(owner).__module__ == "random":
        return "random" in generators
    if name == "numpy.random" or name == "numpy" and "random" in code.co_names or \
            type(owner).__module__.startswith("numpy.random"):
        return "numpy.random" in generators
    return False


# how a global's reader is marked where it is a custom autograd.Function's forward: a value it computes from the
# global may go to its backward on `ctx`, from the pass that built the graph the backward runs
FUNCTION_CODE = "(autograd.Function)"


def _is_function_code(code: types.CodeType, space: dict) -> bool:
    """`code` is the forward of a torch.autograd.Function subclass defined in the module of `space`."""
    owner = space.get(getattr(code, "co_qualname", "").rsplit(".", 1)[0]) if "." in getattr(
        code, "co_qualname", "") else None
    return code.co_name == "forward" and isinstance(owner, type) and issubclass(owner, torch.autograd.Function)


def _line_span(code: types.CodeType) -> str:
    """"24-28": the lines of `code` (a Function's forward: whether it ran in a pass is told by the lines its ops were
    recorded at)."""
    lines = [line for *_, line in code.co_lines() if line]
    return f"{min(lines, default=code.co_firstlineno)}-{max(lines, default=code.co_firstlineno)}"


def _global_names(code: types.CodeType) -> set[str]:
    """The names `code` loads as globals (not attribute names, which `co_names` lists too)."""
    return {ins.argval for ins in dis.get_instructions(code) if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME")}


def _codes(code: types.CodeType) -> list[types.CodeType]:
    """The code object and those nested in it (comprehensions, inner functions, lambdas)."""
    out, todo = [], [code]
    while todo:
        c = todo.pop()
        out.append(c)
        todo.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    return out


def _method(owner: Owner, name: str) -> Any:
    """The function `owner.name` (a method `self.name()` calls), without running descriptors. `owner` may be a
    module's class followed by its children's (`self.router.logits(x)` calls a child's method, not its forward, so
    no module call records it): the first class that defines `name` wins."""
    for kind in owner if type(owner) is tuple else (owner,) if owner is not None else ():
        for klass in kind.__mro__:
            if name in vars(klass):
                value = vars(klass)[name]
                return value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
    return None


def _module_name(space: dict) -> str:
    """The module a globals dict belongs to, as a user names it: a script's file name, not `__main__`."""
    name = space.get("__name__") or "?"
    if name == "__main__" and isinstance(space.get("__file__"), str):
        return os.path.splitext(os.path.basename(space["__file__"]))[0]
    return name
