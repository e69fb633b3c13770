"""Every module ac_diff imports is the standard library, a declared runtime dependency, ac_diff itself,
or guarded as optional (imported inside `try: ... except ImportError`): a plain `pip install ac-diff`
(without [dev]) has everything the command line needs. `.ci/run` checks the same in a fresh venv."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

from conftest import REPO

# distribution name -> the top-level module it installs, where they differ
IMPORT_NAMES = {"pyyaml": "yaml"}
# modules that come with a declared dependency: numpy with pandas (and torch's .numpy())
BROUGHT_BY = {"numpy": "pandas"}


def _declared() -> dict[str, str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    out = {}
    for requirement in project["dependencies"]:
        name = re.match(r"[A-Za-z0-9_.\-]+", requirement).group(0).lower()
        out[IMPORT_NAMES.get(name, name.replace("-", "_"))] = requirement
    return out


def _guarded(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """Inside a `try` whose handlers catch ImportError (or ModuleNotFoundError)."""
    while node in parents:
        child, node = node, parents[node]
        if isinstance(node, ast.Try) and child in node.body:
            for handler in node.handlers:
                names = ({n.id for n in ast.walk(handler.type) if isinstance(n, ast.Name)}
                         if handler.type is not None else {"*"})
                if {"ImportError", "ModuleNotFoundError", "*"} & names:
                    return True
    return False


def _imports(path: Path):
    tree = ast.parse(path.read_text(), str(path))
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name.split(".")[0], node, parents
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            yield node.module.split(".")[0], node, parents


def test_every_import_is_stdlib_declared_or_optional():
    declared = _declared()
    problems = []
    files = sorted((REPO / "ac_diff").rglob("*.py"))
    assert len(files) > 20
    for path in files:
        for name, node, parents in _imports(path):
            if name in sys.stdlib_module_names or name == "ac_diff" or name in declared or name == "__future__":
                continue
            if BROUGHT_BY.get(name) in declared:
                continue
            if _guarded(node, parents):
                continue
            problems.append(f"{path.relative_to(REPO)}:{node.lineno}: import of {name!r}, which is neither the "
                            "standard library nor declared in pyproject.toml's dependencies (nor guarded)")
    assert not problems, "\n".join(problems)


def test_the_check_sees_an_undeclared_import(tmp_path):
    """The walk above finds a module-level and a function-level import, and honours a guard."""
    source = tmp_path / "m.py"
    source.write_text("import click\n\ndef f():\n    from rich import box\n\ntry:\n    import fancy\n"
                      "except ImportError:\n    fancy = None\n")
    found = {(name, _guarded(node, parents)) for name, node, parents in _imports(source)}
    assert found == {("click", False), ("rich", False), ("fancy", True)}


def test_lower_bounds_are_pinned():
    for name, requirement in _declared().items():
        assert ">=" in requirement, f"{requirement}: pin the oldest version the code needs"


def test_every_subpackage_is_installed():
    """A subpackage missing from pyproject's list is absent from a non-editable install (`pip install .`)."""
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "ac_diff").rglob("__init__.py")}
    assert found - listed == set(), f"add to [tool.setuptools] packages in pyproject.toml: {sorted(found - listed)}"


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    """ac_diff module -> the ac_diff modules it imports (at any depth of the file, functions included).
    `from .pkg import name` is an edge to `pkg.name` where that is a module, else to `pkg`."""
    modules = {_module_name(p): p for p in (REPO / "ac_diff").rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
                source = ".".join(base + ([node.module] if node.module else []))
                targets |= {f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names}
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (a path that ends where it starts), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_the_import_graph_has_no_cycles():
    graph = _import_graph()
    assert "ac_diff.diagnosis.suggest" in graph["ac_diff.diagnosis.cause"]  # relative imports resolve
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_check_sees_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_capture_imports_neither_diagnosis_nor_renderers():
    bad = {f"{module} imports {target}" for module, targets in _import_graph().items()
           if module.startswith("ac_diff.capture") for target in targets
           if target.startswith(("ac_diff.diagnosis", "ac_diff.render"))}
    assert not bad, "\n".join(sorted(bad))
