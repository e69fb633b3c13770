"""Renderers: each formats a finished `Report` and nothing else. Pick one by name.

    render(report, "terminal", console=Console())     # rich report on the terminal
    render(report, "json", path="report.json")         # versioned JSON (schema in the README)
    render(report, "html", path="report.html")         # one self-contained page, when installed

A renderer is a callable `(report, *, console, path) -> None`, registered in RENDERERS.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from rich.console import Console

from ..report import Report
from .terminal import render_terminal

Renderer = Callable[..., None]


def _terminal(report: Report, *, console: Console | None = None, path: str | None = None) -> None:
    if path:
        with open(path, "w", encoding="utf-8") as f:
            render_terminal(report, Console(file=f, width=120, color_system=None, soft_wrap=False))
    else:
        render_terminal(report, console or Console())


def _json(report: Report, *, console: Console | None = None, path: str | None = None) -> None:
    text = json.dumps(report.to_json(), indent=2, default=str, allow_nan=True)
    if path and path != "-":
        Path(path).write_text(text + "\n", encoding="utf-8")
    else:
        print(text)


def _html(report: Report, *, console: Console | None = None, path: str | None = None) -> None:
    from .html import render_html_file

    render_html_file(report, path=path)


RENDERERS: dict[str, Renderer] = {"terminal": _terminal, "json": _json, "html": _html}


def register(name: str, renderer: Renderer) -> None:
    RENDERERS[name] = renderer


def render(report: Report, fmt: str = "terminal", **kwargs) -> None:
    try:
        renderer = RENDERERS[fmt]
    except KeyError:
        raise ValueError(f"unknown report format {fmt!r}; choose one of {', '.join(sorted(RENDERERS))}") from None
    renderer(report, **kwargs)
