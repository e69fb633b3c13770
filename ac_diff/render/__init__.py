"""Renderers: each formats a finished `Report` as text and nothing else; `render` writes it.

    render(report, "terminal", console=Console())     # rich report on stdout (the console's colours, width)
    render(report, "json", path="report.json")         # versioned JSON (schema in the README)
    render(report, "html", path="report.html")         # one self-contained page
    RENDERERS["html"].render(report)                   # -> "<!DOCTYPE html>..." (suffix ".html")

A renderer follows `Renderer`: a `suffix`, `render(report) -> str` and `chunks(report)`, the same text in
pieces (JSON: region by region, so a report of thousands of regions is written without building its whole
text). It only formats: the verdict, its title, the silent flag and the order of the regions are the
report's (`ac_diff.report`). `render` is the one writer: a file for a path, stdout for none (or "-").
"""

from __future__ import annotations

import io
import json
import sys
from typing import Iterator, Protocol

from rich.console import Console

from ..report import Report
from .terminal import render_terminal


class Renderer(Protocol):
    suffix: str

    def render(self, report: Report) -> str: ...

    def chunks(self, report: Report) -> Iterator[str]: ...


class _WholeText:
    """`chunks` for renderers that build their text in one piece."""

    def chunks(self, report: Report) -> Iterator[str]:
        yield self.render(report)  # type: ignore[attr-defined]


class TerminalRenderer(_WholeText):
    """The rich report as text: plain and 120 columns wide (a file), or with the colours and width of
    `console` (what stdout is)."""

    suffix = ".txt"

    def __init__(self, console: Console | None = None):
        self.console = console

    def render(self, report: Report) -> str:
        out = io.StringIO()
        like = self.console
        if like is None:
            console = Console(file=out, width=120, color_system=None, soft_wrap=False)
        else:
            console = Console(file=out, width=like.width, color_system=like.color_system,
                              force_terminal=like.is_terminal, soft_wrap=like.soft_wrap, legacy_windows=False)
        render_terminal(report, console)
        return out.getvalue()


class JsonRenderer:
    suffix = ".json"
    # json.dumps(..., indent=2) runs this same (pure Python) encoder: chunks are exactly its text, in pieces
    _encoder = json.JSONEncoder(indent=2, default=str, allow_nan=True)

    def render(self, report: Report) -> str:
        return "".join(self.chunks(report))

    def chunks(self, report: Report) -> Iterator[str]:
        yield from self._encoder.iterencode(report.to_json(lazy=True))
        yield "\n"


class HtmlRenderer:
    """The page, written one region's row or section at a time."""

    suffix = ".html"

    def render(self, report: Report) -> str:
        return "".join(self.chunks(report))

    def chunks(self, report: Report) -> Iterator[str]:
        from .html import html_chunks

        return html_chunks(report)


RENDERERS: dict[str, Renderer] = {"terminal": TerminalRenderer(), "json": JsonRenderer(), "html": HtmlRenderer()}


def render(report: Report, fmt: str = "terminal", *, path: str | None = None, console: Console | None = None) -> None:
    """Write the report in `fmt` to `path`, or to stdout when there is none (or it is "-"); the terminal
    report with no path takes `console`'s colours and width, and its stream (stderr's console: stderr)."""
    try:
        renderer = RENDERERS[fmt]
    except KeyError:
        raise ValueError(f"unknown report format {fmt!r}; choose one of {', '.join(sorted(RENDERERS))}") from None
    if fmt == "terminal" and not path:
        renderer = TerminalRenderer(console or Console())
    if path and path != "-":
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(renderer.chunks(report))
    else:
        stream = sys.stderr if fmt == "terminal" and console is not None and console.stderr else sys.stdout
        stream.writelines(renderer.chunks(report))
        stream.flush()
