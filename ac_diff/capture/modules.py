"""Which module is running right now, by fully qualified name, in the forward and in the recompute.

`ModuleStack` installs global `nn.Module` forward pre/post hooks and keeps a per-thread stack of
FQNs. Unlike `ModuleTracker`/`ModTracker` it is right during checkpoint recompute, because the
recompute re-enters the same modules through their ordinary `__call__`:

    stack = ModuleStack(); stack.install()
    model(x)            # while layers.1.moe.router.gate runs: stack.current() == "layers.1.moe.router.gate"
    stack.raised_in(exc)  # the innermost module an exception left: "layers.1.attn.rotary"

Wrapper segments that users never wrote (`_checkpoint_wrapped_module`, `_orig_mod`,
`_fsdp_wrapped_module`) are stripped, so `layers.1._checkpoint_wrapped_module.moe` reads `layers.1.moe`.

A module called from nowhere before the first checkpointed region (a parametrization that `spectral_norm` or
`weight_norm` runs once while the model is built, a block tried on its own) is named as a root for the time being:
the first larger root that holds it names it again, by its path in the model
(`b2.fc1.parametrizations.weight.0`, not `0`). From `freeze()` on (a region began: its forward and its recompute
must name modules alike) names never change. A root the user's code holds in a plain list of blocks is named by its
place there (`blocks[2]`); a second root called from nowhere beside a first (a frozen teacher read beside its student,
the two sharing every parameter name) by the variable that holds it (`teacher.0.weight`), and so is every root beside
which another model trains (a GAN's `G` and `D.0.weight`), or that is a ModuleList the script's loop reads
(`blocks.1`, not `1`); torch.compile's wrapper of a module the model holds by that
module's name.
"""

from __future__ import annotations

import collections
import sys
import threading
import weakref
from itertools import islice

import torch
import torch.fx
from torch import nn

from .compiled import skip_when_compiling
from .fqn import clean_fqn


_CONTAINERS = (dict, list, tuple, collections.OrderedDict, collections.deque)  # a module's own caches, by type
_SEARCHED_ITEMS = 64  # items of one container searched for a tensor the region read


def _held_in(space: dict, tensor: torch.Tensor, prefix: str, plain: bool) -> str | None:
    """The name in `space` (a module's attributes, a module's globals) of `tensor` (where `plain`: as a value of its
    own), of the dict or list item that is `tensor` ("cache[3]"), or of the attribute of a plain object of the user's
    held there that is `tensor` (a holder the blocks share: "holder.temb"), after `prefix`."""
    for key, value in list(space.items()):
        if key.startswith("_"):
            continue
        if plain and value is tensor:
            return f"{prefix}{key}"
        if type(value) in _CONTAINERS:
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for index, item in islice(items, _SEARCHED_ITEMS):
                if item is tensor:
                    return f"{prefix}{key}[{index!r}]"
        elif _plain_object(value):
            for name, item in islice(vars(value).items(), _SEARCHED_ITEMS):
                if item is tensor and not name.startswith("_"):
                    return f"{prefix}{key}.{name}"
    return None


def _plain_object(value: object) -> bool:
    """An object of the user's own class with attributes (not a module, tensor, class, function or module)."""
    return (type(getattr(value, "__dict__", None)) is dict and not isinstance(value, (nn.Module, torch.Tensor, type))
            and not callable(value) and type(value).__module__ not in ("builtins",)
            and not type(value).__module__.startswith("torch"))


def held_by(tensor: torch.Tensor, modules: list[tuple[nn.Module, str]]) -> str | None:
    """Where the script keeps `tensor`, a tensor a region made that outlived it: an attribute of one of `modules`
    (those the region called, [(module, fqn)]) or an item of a list or dict it holds ("blocks.0.fc.weight", which
    torch.nn.utils.prune's forward pre-hook sets at every call), else a module-level global of their code or an
    item of one ("model.ROUTER_LOGITS[0]"). None where it is kept out of reach (a hook's closure)."""
    for module, fqn in modules:
        held = _held_in(vars(module), tensor, fqn + "." if fqn else "", plain=True)
        if held is not None:
            return clean_fqn(held)
    return _global_holding(tensor, modules)


def _global_holding(tensor: torch.Tensor, modules: list[tuple[nn.Module, str]]) -> str | None:
    """A module-level global of the code of `modules` ([(module, fqn)], searched in that order) that is `tensor` or
    holds it ("train.PACK_CTX['doc_ids']")."""
    from .pystate import _module_name

    seen = set()
    for module, _ in modules:
        space = getattr(getattr(type(module), "forward", None), "__globals__", None)
        if isinstance(space, dict) and id(space) not in seen:
            seen.add(id(space))
            held = _held_in(space, tensor, _module_name(space) + ".", plain=True)
            if held is not None:
                return held
    return None


_CALLERS = 24  # frames searched above a module called from nowhere, for the model that holds it


def _holder_in_callers(module: nn.Module) -> nn.Module | None:
    """The largest module that the user's calling frames hold (a local, `self`) and that holds `module`: the model
    whose path names it (`blocks.2`, where it would be a root named by its class). None if there is none."""
    from .sourceline import is_internal

    best, size = None, 0
    frame = sys._getframe(2)
    for _ in range(_CALLERS):
        if frame is None:
            break
        if not is_internal(frame.f_code.co_filename):
            for value in list(frame.f_locals.values()):
                if isinstance(value, nn.Module) and value is not module:
                    subs = list(value.modules())
                    if len(subs) > size and any(m is module for m in subs):
                        best, size = value, len(subs)
        frame = frame.f_back
    return best


def _trained_apart(value: object, module: nn.Module, own: set[int]) -> bool:
    """Whether `value` is another model that trains beside `module` (a GAN's discriminator beside its generator):
    a module with a parameter that requires grad and none of `module`'s (`own`: their ids). A wrapper holding
    `module` (DDP, a compiled module) shares them; a frozen teacher or EMA copy trains nothing."""
    if not isinstance(value, nn.Module) or value is module:
        return False
    params = list(value.parameters())
    return any(p.requires_grad for p in params) and not any(id(p) in own for p in params)


def _root_name_in_callers(module: nn.Module, taken: bool) -> str:
    """The name the user's calling frames hold a root `module` by: an item of a list or tuple of several modules
    (`blocks[2]`: blocks that no module holds, each its own root); where `taken` (another root already reads as the
    unnamed root), where another model trains beside it (a GAN's generator and discriminator, which would
    otherwise read `a` and `d.a`), or where it is a ModuleList or ModuleDict (its blocks would read `1`), a variable
    (`teacher`, a frozen copy read beside the student; `blocks.1`). "" if none."""
    from .sourceline import is_internal

    variable, peer = "", taken or isinstance(module, (nn.ModuleList, nn.ModuleDict))  # (never called: only a list)
    own = {id(p) for p in module.parameters()}
    frame = sys._getframe(2)
    for _ in range(_CALLERS):
        if frame is None:
            break
        if not is_internal(frame.f_code.co_filename):
            code = frame.f_code  # (a helper's parameter, `fn` of `def ckpt(fn, *args)`, names what it is given)
            passed = set(code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]) if frame.f_locals is not \
                frame.f_globals else set()
            for space in (frame.f_locals, frame.f_globals):
                for key, value in list(space.items()):
                    if key.startswith("_") or (key in passed and space is frame.f_locals):
                        continue
                    if type(value) in (list, tuple) and sum(isinstance(v, nn.Module) for v in value) > 1:
                        for index, item in enumerate(value):
                            if item is module:
                                return f"{key}[{index}]"
                    elif not variable and value is module:
                        variable = key
                    elif not peer and own and _trained_apart(value, module, own):
                        peer = True
        frame = frame.f_back
    return variable if peer else ""


def unread_statistics(module: nn.Module) -> tuple:
    """The running statistics a batch norm (any of torch's, `_NormBase`) updates in training and saves for a backward
    that does not read them: each pass updates them, so the recompute saves other values, harmlessly."""
    if isinstance(module, nn.modules.batchnorm._NormBase) and module.training and module.track_running_stats:
        return tuple(t for t in (module.running_mean, module.running_var) if t is not None)
    return ()


class ModuleStack:
    """A per-thread stack of (module, fqn) maintained by global module hooks."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._names: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
        self._handles: list = []
        self._provisional: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # roots named before `freeze()`
        self._called_roots: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # modules called from nowhere
        self._frozen = False
        self.on_enter = None  # optional callback(module, fqn, depth_before) for the recorder
        self.on_exit = None  # optional callback(module, fqn) after the module's forward (and its hooks)

    # -- installation -------------------------------------------------------------------------
    def install(self) -> None:
        # Dynamo must not trace these hooks into compiled graphs: it trips over their weak-keyed state
        # ("... is already tracked for mutation") and would bake them in (compiled.skip_when_compiling)
        pre = nn.modules.module.register_module_forward_pre_hook(skip_when_compiling(self._pre))
        post_hook = skip_when_compiling(self._post)
        try:
            post = nn.modules.module.register_module_forward_hook(post_hook, always_call=True)
        except TypeError:  # torch < 2.1 has no always_call: an exception inside a module leaves it
            post = nn.modules.module.register_module_forward_hook(post_hook)
        self._handles = [pre, post]

    def uninstall(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def freeze(self) -> None:
        """Names are final from now on (a checkpointed region began)."""
        if not self._frozen:
            self._frozen = True
            running = [m for m, _ in self.stack()]
            for module in list(self._provisional):  # (a parametrization run once while the model was built)
                if not any(m is module for m in running):
                    self._called_roots.discard(module)
            self._provisional = weakref.WeakSet()

    # -- queries ------------------------------------------------------------------------------
    def stack(self) -> list[tuple[nn.Module, str]]:
        try:
            return self._local.stack
        except AttributeError:
            self._local.stack = []
            return self._local.stack

    def raised_in(self, exc: BaseException) -> str | None:
        """The innermost module `exc` left, as this thread's exit hooks saw it pass (None if none did)."""
        raised = getattr(self._local, "raised", None)
        return raised[1] if raised is not None and raised[0] == id(exc) else None

    def current(self) -> str | None:
        s = self.stack()
        return s[-1][1] if s else None

    def name_of(self, module: nn.Module) -> str:
        name = self._names.get(module)
        if name is None:
            name = self._discover(module)
        return name

    def owner_name(self, tensor: torch.Tensor, outer: tuple = ()) -> tuple[str, str] | None:
        """("param"|"buffer", fqn) if `tensor` is a parameter or buffer of a module on the stack (or in `outer`: the
        modules a recompute's forward ran inside); ("external", fqn) if it is a plain tensor attribute of one
        (`self.scale = torch.ones(64)`), or an item of a dict or list one holds (`self.cache[3]`: a cache its forward
        fills)."""
        stack = [*outer, *self.stack()] if outer else self.stack()
        for module, fqn in reversed(stack):
            for kind, table in (("param", module._parameters), ("buffer", module._buffers), ("external", vars(module))):
                for key, value in table.items():
                    if value is tensor:
                        return kind, f"{fqn}.{key}" if fqn else key
        if stack:  # a child the running module reads but never calls (a fake-quantize module's observer buffers)
            module, fqn = stack[-1]
            for kind, named in (("buffer", module.named_buffers), ("param", module.named_parameters)):
                for key, value in named():
                    if value is tensor:
                        return kind, clean_fqn(f"{fqn}.{key}" if fqn else key)
        for module, fqn in reversed(stack):
            held = _held_in(vars(module), tensor, fqn + "." if fqn else "", plain=False)
            if held is not None:
                return "external", held
        return None

    def global_name(self, tensor: torch.Tensor, outer: tuple = ()) -> str | None:
        """A module-level global of the code of the modules on the stack (or in `outer`) that is `tensor` or holds it
        in a dict or list (a context the code stashes there for the attention to read): "train.PACK_CTX['doc_ids']"."""
        return _global_holding(tensor, list(reversed([*outer, *self.stack()])))

    def name_by_index(self, modules: list) -> None:
        """Name modules that have no name yet (checkpoint_sequential's list of a Sequential's children, whose parent
        is never called): by their place in the model a calling frame holds (`net.4`, the loop's `model`), else by
        their index in `modules` ("3", "3.fc" as the Sequential would)."""
        for j, module in enumerate(modules):
            if isinstance(module, nn.Module) and module not in self._names:
                holder = _holder_in_callers(module)
                if holder is not None and holder not in self._names:
                    self._discover_root(holder)
                if module not in self._names:
                    self._index(module, str(j))

    # -- hooks --------------------------------------------------------------------------------
    def _pre(self, module: nn.Module, args) -> None:
        stack = self.stack()
        name = self._names.get(module)
        if name is None:
            name = self._discover(module)
        if not stack:
            self._called_roots.add(module)
        if self.on_enter is not None:
            self.on_enter(module, name, len(stack))
        stack.append((module, name))

    def _post(self, module: nn.Module, args, output) -> None:
        stack = self.stack()
        if output is None:  # (after an exception torch calls this hook inside its `except`, with no output)
            exc = sys.exc_info()[1]
            if exc is not None and getattr(self._local, "raised", (None,))[0] != id(exc):
                self._local.raised = (id(exc), self._names.get(module))  # the innermost module it left
        # Pop down to this module: a module whose forward raised may not have been popped.
        while stack:
            top, name = stack.pop()
            if top is module:
                if self.on_exit is not None:
                    self.on_exit(module, name)
                break

    def _discover(self, module: nn.Module) -> str:
        """Name `module` relative to the modules on the stack; a module called from nowhere is a root. A
        graph the compiler runs (aot_eager's GraphModule, inside a compiled module) is not the user's: its
        ops belong to the module that called it, and it keeps no name of its own."""
        stack = self.stack()
        for parent, parent_name in reversed(stack):
            self._index(parent, parent_name)
            name = self._names.get(module)
            if name is not None:
                return name
        if stack and isinstance(module, torch.fx.GraphModule):
            return stack[-1][1]
        original = getattr(module, "_orig_mod", None)  # torch.compile's wrapper of a module the model holds: its name
        if isinstance(original, nn.Module) and self._names.get(original):
            self._index(module, self._names[original])
            return self._names[module]
        # called from a plain function (`for block in model.blocks: checkpoint(block, x)`), or a module of another
        # model the running one reads (a teacher's `feat` that a student's checkpointed closure calls)
        holder = _holder_in_callers(module)
        if holder is not None and holder not in self._names:
            self._discover_root(holder)
            name = self._names.get(module)
            if name is not None:
                return name
        return self._discover_root(module)

    def _discover_root(self, module: nn.Module) -> str:
        """Name `module` a root: unnamed ("", reports show its class), unless the user's code holds it as one of a
        list of blocks, or another root is unnamed already (a student and its teacher would share every name)."""
        if not self._frozen:
            self._adopt(module)
            self._provisional.add(module)
        taken = any(m is not module and self._names.get(m) == "" for m in self._called_roots)
        name = _root_name_in_callers(module, taken)
        # (a root of that name before: the variable now holds this one, a model re-created from a checkpoint)
        if name and any(n == name and not (other in self._called_roots and other is not module)
                        for other, n in self._names.items()):
            name = ""
        self._index(module, name)
        return self._names[module]

    def _adopt(self, root: nn.Module) -> None:
        """`root`, a new root, holds modules named earlier as roots of their own: they lose those names, and
        `_index(root)` names them by their place in it."""
        for sub in root.modules():
            if sub is not root and sub in self._provisional:
                self._provisional.discard(sub)
                self._called_roots.discard(sub)
                for inner in sub.modules():
                    self._names.pop(inner, None)

    def _index(self, root: nn.Module, prefix: str) -> None:
        for sub_name, sub in root.named_modules(prefix=prefix, remove_duplicate=False):
            if sub not in self._names:
                self._names[sub] = clean_fqn(sub_name)
