"""Checkpointed regions inside the graphs Dynamo compiles, and the state they update, read from the graphs.

With torch.compile around checkpointed blocks (`torch.compile(model)`, torchtitan's per-block compile) no
`torch.utils.checkpoint` region runs: Dynamo turns each checkpoint() into a `tag_activation_checkpoint`
higher-order op whose body is a subgraph, and AOTAutograd recomputes that body inside the compiled backward.
The graphs still say what AC does there: how many regions, and which buffers, parameters or tensor attributes
a region's body updates in place (the compiled recompute then starts from, or applies, another value).

    watch = GraphWatch(where=stack.current).install()  # wraps Dynamo's hand-off of each graph to its backend
    ...  # the script: model = torch.compile(model); model(x).sum().backward()
    watch.uninstall()
    watch.summary()  ->  {"regions": 2, "graphs": 1, "mutations": [
        {"name": "layers.0.scale", "kind": "buffer", "op": "mul_"},
        {"name": "layers.1.scale", "kind": "buffer", "op": "mul_"}]}

`where()` names the module being compiled (the module stack's top when Dynamo compiles its frame), so a name
Dynamo writes relative to it (`L['self']._modules['0']._buffers['scale']`) reads `layers.0.scale`. Dynamo is
private API: every step is guarded, and a torch whose graphs look otherwise gives an empty summary.
"""

from __future__ import annotations

import operator
import re
import sys
from typing import Any, Callable

from ..oprules import is_in_place_method
from .fqn import clean_fqn

_HOP = "activation_checkpoint"  # tag_activation_checkpoint (and older wrap_activation_checkpoint)
# ops that return (a view of) their first argument: an in-place op on their result updates that argument
_ALIASING = frozenset({"view", "view_as", "reshape", "narrow", "select", "unsqueeze", "squeeze", "transpose", "t",
                       "permute", "expand", "flatten", "detach", "as_strided", "getitem", "unflatten", "data"})
_NOT_UPDATES = frozenset({"requires_grad_", "retain_grad_", "record_stream_", "share_memory_"})
_KINDS = {"_buffers": "buffer", "_parameters": "parameter"}
_DICT = re.compile(r"\.__dict__\['(\w+)'\]")
_TOKEN = re.compile(r"\[(?:'([^']*)'|(\d+))\]|\.(\w+)")


def _op_name(node: Any) -> str:
    """`mul_` for x.mul_(...), torch.Tensor.mul_, aten.mul_.Tensor; `iadd` for x += y."""
    target = node.target
    if node.op == "call_method":
        return str(target)
    name = getattr(target, "__name__", None) or str(target)
    if getattr(target, "_overloadpacket", None) is not None:  # aten.mul_.Tensor
        name = target._overloadpacket.__name__
    return name.rsplit(".", 1)[-1]


def _updates(node: Any) -> bool:
    """An op that writes its first argument in place."""
    if node.op not in ("call_method", "call_function") or not node.args:
        return False
    name = _op_name(node)
    if node.op == "call_function" and node.target in (operator.iadd, operator.isub, operator.imul,
                                                      operator.itruediv):
        return True
    return is_in_place_method(name) and name not in _NOT_UPDATES


def _root(node: Any) -> Any:
    """The node whose tensor `node` is or views (through in-place ops and views)."""
    for _ in range(64):
        if not hasattr(node, "op") or not node.args:
            return node
        if not (_updates(node) or _op_name(node) in _ALIASING):
            return node
        node = node.args[0]
    return node


_MODULE_TABLES = ("._modules", "._buffers", "._parameters")


def source_name(source: str, module: str | None) -> tuple[str, str]:
    """(fqn, kind) of a Dynamo input source: `L['self']._modules['0']._buffers['scale']` inside `layers` ->
    ("layers.0.scale", "buffer"); a plain input `L['x']` -> ("x", "input"); a global -> (its name, "global")."""
    source = _DICT.sub(r".\1", source)  # `.__dict__['_modules']` is `._modules`
    tokens = [m.group(1) if m.group(1) is not None else m.group(2) if m.group(2) is not None else "." + m.group(3)
              for m in _TOKEN.finditer(source)]
    head, rest = (tokens[0], tokens[1:]) if tokens else (source, [])
    parts: list[str] = []
    kind = "input" if source.startswith("L[") else "global" if source.startswith("G[") else "input"
    # the compiled method's own module: `self`, or whatever its first parameter is called (`def forward(s, x)`),
    # told by what follows it (a module's children, buffers or parameters)
    if head == "self" or (module is not None and kind == "input" and rest and rest[0] in _MODULE_TABLES):
        parts += [module] if module else []
        kind = "attribute"
    else:
        parts.append(head)
    container = None
    for tok in rest:
        if tok.startswith("."):
            attr = tok[1:]
            if attr in ("_modules", "_buffers", "_parameters"):
                container = attr
                continue
            parts.append(attr)
            kind = "attribute" if kind != "global" else kind
        else:
            parts.append(tok)
            if container in _KINDS:
                kind = _KINDS[container]
            container = None
    return clean_fqn(".".join(p for p in parts if p)), kind


def _input_name(node: Any, module: str | None) -> tuple[str, str] | None:
    """(fqn, kind) of a top-level graph input (a placeholder Dynamo lifted, or a get_attr of a module buffer)."""
    if node.op == "placeholder":
        arg = node.meta.get("grapharg")
        source = getattr(arg, "source", None)
        name = getattr(source, "name", None)
        name = name() if callable(name) else name
        return source_name(name, module) if isinstance(name, str) else (node.name, "input")
    if node.op == "get_attr":
        return clean_fqn(".".join(p for p in (module, str(node.target)) if p)), "attribute"
    return None


def scan(gm: Any, module: str | None = None) -> tuple[int, list[dict[str, str]]]:
    """(checkpointed regions in the graph, nested ones included; the inputs their bodies update in place)."""
    found: list[dict[str, str]] = []

    def walk(graph_module: Any, names: dict[Any, tuple[str, str]]) -> int:
        regions = 0
        for node in graph_module.graph.nodes:
            if node.op == "call_function" and _HOP in str(getattr(node.target, "__name__", node.target)):
                body_ref, operands = node.args[0], node.args[1:]
                body = getattr(graph_module, str(getattr(body_ref, "target", "")), None)
                if body is None or not hasattr(body, "graph"):
                    continue
                regions += 1
                inner = {}
                for ph, operand in zip([n for n in body.graph.nodes if n.op == "placeholder"], operands):
                    named = names.get(_root(operand)) if hasattr(operand, "op") else None
                    if named is not None:
                        inner[ph] = named
                for sub in body.graph.nodes:
                    if _updates(sub):
                        named = inner.get(_root(sub.args[0]))
                        if named is not None and named[1] != "input":
                            found.append({"name": named[0], "kind": named[1], "op": _op_name(sub)})
                regions += walk(body, inner)
        return regions

    top = {}
    for node in gm.graph.nodes:
        named = _input_name(node, module)
        if named is not None:
            top[node] = named
    n = walk(gm, top)
    unique: dict[str, dict[str, str]] = {}
    for m in found:  # the first update of each input
        unique.setdefault(m["name"], m)
    return n, list(unique.values())


class GraphWatch:
    """Counts the checkpointed regions of every graph Dynamo compiles while installed (see the module docstring)."""

    def __init__(self, where: Callable[[], str | None] = lambda: None) -> None:
        self.where = where
        self.regions = 0
        self.graphs = 0  # graphs with at least one checkpointed region
        self.compiled = 0  # graphs Dynamo handed to a backend
        self.mutations: list[dict[str, str]] = []
        self._patched: tuple[Any, Any] | None = None
        self._compile: Any = None
        self.installed = False

    def install(self) -> "GraphWatch":
        """Watch now if Dynamo is loaded, else from the first torch.compile() call (which loads it)."""
        self.installed = True
        if not self.ensure():
            import torch

            real = torch.compile

            def compile(*args: Any, **kwargs: Any) -> Any:  # noqa: A001 - stands in for torch.compile
                import torch._dynamo  # noqa: F401 - what torch.compile loads first

                self.ensure()
                return real(*args, **kwargs)

            compile.__wrapped__ = real  # type: ignore[attr-defined]
            compile.__doc__ = real.__doc__
            self._compile = real
            torch.compile = compile
        return self

    def ensure(self) -> bool:
        """Wrap Dynamo's hand-off of graphs to backends if Dynamo is loaded (True when wrapped)."""
        if self._patched is not None or not self.installed:
            return self._patched is not None
        if "torch._dynamo" not in sys.modules:
            return False
        try:
            from torch._dynamo.output_graph import OutputGraph

            real = OutputGraph.call_user_compiler
        except (ImportError, AttributeError):
            return False
        watch = self

        def call_user_compiler(graph: Any, gm: Any, *args: Any, **kwargs: Any) -> Any:
            watch.saw(gm)
            return real(graph, gm, *args, **kwargs)

        OutputGraph.call_user_compiler = call_user_compiler
        self._patched = (OutputGraph, real)
        return True

    def uninstall(self) -> None:
        self.installed = False
        if self._patched is not None:
            cls, real = self._patched
            cls.call_user_compiler = real
            self._patched = None
        if self._compile is not None:
            import torch

            torch.compile = self._compile
            self._compile = None

    def saw(self, gm: Any) -> None:
        try:
            n, mutations = scan(gm, self.where())
        except Exception:  # noqa: BLE001 - another torch's graphs: this one goes uncounted, compiling goes on
            return
        self.compiled += 1
        if n:
            self.regions += n
            self.graphs += 1
            known = {m["name"] for m in self.mutations}
            self.mutations += [m for m in mutations if m["name"] not in known]

    def summary(self) -> dict[str, Any] | None:
        """What the end record keeps (None when no compiled graph held a checkpointed region)."""
        if not self.regions:
            return None
        return {"regions": self.regions, "graphs": self.graphs, "mutations": list(self.mutations)}
