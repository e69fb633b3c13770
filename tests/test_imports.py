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
