"""The terminal report (rich): verdict first, then the regions, then each divergence in detail.

    render_terminal(report, Console(width=100))
    ╭─ ac-diff: DIVERGED ───────────────────────────────────────────────╮
    │ layers.1 (rank 0, region 1) diverged: state_mutation: ...          │
    ╰────────────────────────────────────────────────────────────────────╯
    Regions  (table)   ·   Region 1 · layers.1  (cause, divergences, side by side, chain,
    positions, suggestions)

It only formats a finished `Report`. Plain text (no colour, no box characters beyond ASCII-safe
ones rich picks) when the console is not a terminal.
"""

from __future__ import annotations

import os
import re

from rich import box
from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, Group, RenderResult
from rich.measure import Measurement
from rich.panel import Panel
from rich.syntax import Syntax
from rich.table import Table
from rich.text import Text

from ..report import AT_RISK, DAMAGED, DIVERGED, UNCHECKED, Report, RegionReport, Suggestion, count_by_status
from . import positions
from .fixes import fixes_terminal
from .sections import terminal_items

MAX_DETAILED_REGIONS = 3
MAX_POSITION_ROWS = 24
MAX_ERROR_ROWS = 12
_MARKER_STYLE = {"value": "yellow", "discrete": "magenta", "shape": "red", "dtype": "red", "control": "cyan",
                 "cached": "dim", "inferred": "dim yellow", "argument": "blue"}
# "inferred": not fingerprinted (a view, a derived elementwise op), fed by an input that differs
_MARKER_TEXT = {"value": "≠ value", "discrete": "≠ decision", "shape": "≠ shape", "dtype": "≠ dtype",
                "control": "≠ sequence",
                "cached": "cached", "inferred": "≠ (input)", "argument": "≠ argument"}


def _t(value: object, style: str = "") -> Text:
    """A cell from report data: never parsed as rich markup (logs contain `[...]` everywhere)."""
    return Text("" if value is None else str(value), style=style)


class Breakable:
    """A table cell that wraps between words and after the dots and slashes of names, never inside a word:

        Breakable("add.Tensor in layers.1.moe.router") in a 16-column cell ->  add.Tensor in
                                                                               layers.1.moe.
                                                                               router
    Its narrowest width is its longest part, which the table keeps where it can; a part still wider than its
    column (a very narrow terminal) ends in "…" instead of going on in the next line."""

    _PARTS = re.compile(r"[^\s./]+[./]*\s*|[./]+\s*|\s+")

    def __init__(self, value: object, style: str = "") -> None:
        self.text = "" if value is None else str(value)
        self.style = style

    def parts(self) -> list[str]:
        return self._PARTS.findall(self.text)

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        widest = max((cell_len(p.rstrip()) for p in self.parts()), default=0)
        return Measurement(min(widest, options.max_width), min(cell_len(self.text), options.max_width))

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        width, lines, line = options.max_width, [], ""
        for part in self.parts():
            if line.strip() and cell_len((line + part).rstrip()) > width:
                lines.append(line.rstrip())
                line = part.lstrip()
            else:
                line += part
        lines.append(line.rstrip())
        yield Text("\n".join(lines), style=self.style, no_wrap=True, overflow="ellipsis")


def render_terminal(report: Report, console: Console) -> None:
    console.print(_verdict_panel(report))
    for item in fixes_terminal(report) + terminal_items(report):  # fixes tried, remedies applied, reference
        console.print(item)
    if report.torch_errors:
        console.print(_torch_errors(report))
    if len(report.ranks) > 1:
        console.print(_ranks_table(report))
    for finding in report.cross_rank:
        console.print(Text("cross-rank: ", style="bold magenta") + _t(finding))
    if report.regions:
        console.print(_regions_table(report, console.width))
    groups = report.lead_groups()
    shown: set[str] = set()  # fix titles already printed: each fix once
    for lead, members, label in groups[:MAX_DETAILED_REGIONS]:
        _region_detail(lead, report, console, shown)
        if len(members) > 1:
            others = ", ".join(str(m.region) for m in members[1:][:12]) + (" ..." if len(members) > 13 else "")
            console.print(Text.assemble((f"{label}: same cause", "bold"),
                                        f" in {len(members)} regions (also regions {others}); their details are in "
                                        "the JSON / HTML report"))
    if len(groups) > MAX_DETAILED_REGIONS:
        rest = sum(len(m) for _, m, _ in groups[MAX_DETAILED_REGIONS:])
        console.print(Text(f"... {rest} more diverged region(s) with other causes: see the region table, "
                           "or --format json / html for every detail", style="dim"))
    at_risk = [r for r in report.regions if r.unchecked_reason in AT_RISK]
    if at_risk:  # reproduced, yet never clean: the first one's finding and its fix
        _region_detail(at_risk[0], report, console, shown)
    side_effects = sorted({e for r in report.regions for e in r.side_effects})
    for effect in side_effects[:6]:
        console.print(Text("side effect: ", style="bold yellow") + _t(effect))
    if len(side_effects) > 6:
        console.print(_t(f"... {len(side_effects) - 6} more side effects in the JSON report", "dim"))
    repeating = report.repeating()
    if repeating:  # regions that reproduced their forward: the fix for the update they repeat, once
        fix = repeating[0].suggestions[0]
        if fix.title not in shown:
            _suggestion(fix, console, shown)
        others = {s.title for r in repeating for s in r.suggestions} - {fix.title}
        if others:
            console.print(_t(f"... the same for the updates of {len(others)} other module(s): see the JSON report",
                             "dim"))
    for note in report.notes:
        console.print(Text("note: ", style="dim bold") + Text(note, style="dim"))


def _verdict_panel(report: Report) -> Panel:
    style = {DIVERGED: "bold red", UNCHECKED: "bold yellow", DAMAGED: "bold yellow"}.get(report.verdict, "bold green")
    body = [Text(report.headline, style="bold")]
    if report.silent:
        body.append(Text(report.silent_warning, style="red"))
    counts = report.status_counts()
    if counts:
        body.append(Text(counts, style="dim"))
    if report.sources:
        body.append(Breakable("from " + ", ".join(report.sources), style="dim"))  # paths wrap after a "/"
    return Panel(Group(*body), title=f"ac-diff: {report.title}", title_align="left", border_style=style, box=box.ROUNDED)


def _torch_errors(report: Report) -> Table | Group:
    table = Table(title="torch's error", title_justify="left", box=box.SIMPLE_HEAD, show_edge=False)
    errors = report.torch_errors[:MAX_ERROR_ROWS]  # one row per distinct error (repetitions are counted in it)
    seen = any(e.occurrences for e in errors)
    for col in ("rank", "kind", "positions", "counts (saved/recomputed)") + (("raised",) if seen else ()):
        table.add_column(col)
    for e in errors:
        counts = f"{e.saved_count}/{e.recomputed_count}" if e.saved_count is not None else ""
        table.add_row(_t(e.rank), _t(e.kind), _t(_compact(e.positions)), _t(counts),
                      *((_t(e.occurrences),) if seen else ()))
    if len(report.torch_errors) > len(errors):
        table.caption = f"{len(report.torch_errors) - len(errors)} more distinct error(s) in the JSON report"
    lines = []
    mapped = any(r.positions for r in report.regions)  # else the positions table below shows them with their ops
    for e in [] if mapped else errors:  # what torch printed per position: all a bare error text has
        shown = [c for c in e.changes if c.saved or c.recomputed][:12]
        lines += [Text(f"  position {c.position}: saved {c.saved} -> recomputed {c.recomputed}", style="dim")
                  for c in shown]
        if len(e.changes) > len(shown) and shown:
            lines.append(Text(f"  ... {len(e.changes) - len(shown)} more in the JSON report", style="dim"))
        if e.cause:
            lines.append(Text(f"  {e.cause}"))
    return Group(table, *lines) if lines else table


def _compact(numbers: list[int], limit: int = 12) -> str:
    if not numbers:
        return ""
    shown = ", ".join(map(str, numbers[:limit]))
    return shown + (f", ... ({len(numbers)} in all)" if len(numbers) > limit else "")


def _ranks_table(report: Report) -> Table:
    table = Table(title="ranks", title_justify="left", box=box.SIMPLE_HEAD, show_edge=False)
    for col in ("rank", "verdict", "diverged", "cause", "first diverged", "exit"):
        table.add_column(col, no_wrap=col != "first diverged")
    for r in report.ranks:
        style = {"diverged": "red", "clean": "green"}.get(r.verdict, "dim")
        count = f"{r.diverged} of {r.regions}" if r.regions else "no regions"  # (a log without op lists: its error)
        table.add_row(_t(r.rank), _t(r.verdict, style), _t(count), _t(r.cause), _t(r.first_diverged), _t(r.ending, "dim"))
    return table


FIRST_DIVERGENCE_MIN = 16  # columns below which the regions table leaves the first divergence out


def _regions_table(report: Report, width: int, limit: int = 40) -> Table:
    table = Table(title="regions", title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, collapse_padding=True)
    ops = "ops A/B" if report.regions and all(r.kind == "two_runs" for r in report.regions) else "ops fwd/rec"
    rows = report.regions
    shown = [r for r in rows if r.status == DIVERGED][:limit] if len(rows) > limit else rows
    # the module is what the user looks for: it keeps up to 28 columns, the first divergence wraps instead
    module_width = min(28, max((len(r.label) for r in shown), default=6))
    cells = [[_t(r.rank), _t(r.region), Breakable(r.label), _t(f"{r.forward_ops}/{r.recompute_ops}"),
              Text(r.status_label, style={"diverged": "red", "clean": "green"}.get(r.status, "dim")),
              _t(r.cause_label)] for r in shown]
    columns = [("rank", {}), ("region", {"justify": "right"}), ("module", {"min_width": module_width}), (ops, {}),
               ("status", {"no_wrap": True}), ("cause", {"no_wrap": True})]
    fixed = sum(max([len(name)] + [c[i].cell_len for c in cells]) + 2
                for i, (name, _) in enumerate(columns) if name != "module") + module_width + 2
    # too narrow for the first divergence to read (one word a line): the region details below give it
    with_first = width - fixed >= FIRST_DIVERGENCE_MIN
    for col, kw in columns + ([("first divergence", {"ratio": 1})] if with_first else []):
        table.add_column(col, **kw)
    for r, row in zip(shown, cells):
        first = r.first_divergence()
        what = (Breakable(_short_op(first.op) + (f" in {first.module}" if first.module else "")) if first else
                Breakable(r.unchecked_reason, "dim") if r.status == UNCHECKED else _t(""))  # why it was not checked
        table.add_row(*row, *([what] if with_first else []))
    notes = [] if with_first or not any(r.status == DIVERGED for r in shown) else [
        f"first divergences: in the region details below (this table shows them in a terminal of "
        f"{fixed + FIRST_DIVERGENCE_MIN} columns or more)"]
    if len(shown) < len(rows):
        hidden = [r for r in rows if r.status != DIVERGED] + [r for r in rows if r.status == DIVERGED][limit:]
        notes.insert(0, f"{len(hidden)} region(s) not shown ({count_by_status(hidden)})")  # what it hides, by status
    if notes:
        table.caption = " ".join(notes)
    return table


def _region_detail(r: RegionReport, report: Report, console: Console, shown: set[str]) -> None:
    head = f"region {r.region} · {r.label} · rank {r.rank} · {r.kind}" + (f" · step {r.step}" if r.step else "")
    if len(report.sources) > 1 and r.path:  # several logs or traces: which one this region is from
        head += f" · {os.path.basename(r.path)}"
    parts = []
    if r.cause:
        cause = Text.assemble(("cause: ", "bold"), (r.cause.kind, "bold red"), "  ", r.cause.detail)
        parts.append(cause)
        for ev in r.cause.evidence:
            parts.append(Text("  · " + ev, style="dim"))
    console.print(Panel(Group(*parts) if parts else Text(""), title=_t(head), title_align="left", border_style="red"))

    divergences = r.divergences()
    if divergences:
        console.print(Text("first divergences", style="bold"))
    for d in divergences:
        label = _MARKER_TEXT.get(d.label, d.label).replace("≠ ", "")
        a, b = ("A", "B") if r.kind == "two_runs" else ("fwd", "rec")  # two traces compared: run A | run B
        console.print(Text.assemble(
            ("  " + label.ljust(9), _MARKER_STYLE.get(d.kind, "")), (d.op, "bold"),
            f"  {a} #{_idx(d.forward_index)} / {b} #{_idx(d.recompute_index)}  ", (r.module_of(d), "cyan"),
            (f"  {d.source}" if d.source else "", "dim")))
        console.print(Text("           " + d.summary))

    if r.window:
        console.print(_window_table(r))
    if r.chain:
        console.print(Text("chain", style="bold"))
        for i, step in enumerate(r.chain):
            console.print(Text(("   " if i == 0 else " → ") + step))
    position_table = _positions_table(r)
    if position_table is not None:
        console.print(position_table)
    for s in r.suggestions:
        _suggestion(s, console, shown)
    for note in r.notes:
        console.print(Text("note: " + note, style="dim"))


def _suggestion(s: Suggestion, console: Console, shown: set[str]) -> None:
    """One fix: its title, status, text, how to verify it and its code (each title once per report)."""
    if s.title in shown:
        console.print(Text.assemble(("fix: ", "bold green"), (s.title, "bold"), (" (as above)", "dim")))
        return
    shown.add(s.title)
    console.print(Text.assemble(("fix: ", "bold green"), (s.title, "bold"),
                                (f"  [{s.status}]", {"verified": "green", "did not help": "red"}.get(s.status, "dim"))))
    console.print(Text("     " + s.text))
    if s.verify:
        console.print(Text(f"     {'verified by' if s.status == 'verified' else 'verify'}: {s.verify}", style="dim"))
    if s.code:  # highlighted, never wrapped or cropped by rich: the lines copy as they are
        code = Syntax(s.code, "python", theme="ansi_dark", background_color="default").highlight(s.code)
        code.rstrip()
        console.print(Text("     ") + Text("\n     ").join(code.split("\n")), soft_wrap=True)


def _idx(i: int | None) -> str:
    return "-" if i is None else str(i)


def _short_label(label: str | None) -> str | None:
    """"aten.topk.default(2, 1) -> f32[256, 2]" -> "topk(2, 1) -> f32[256, 2]"."""
    if not label or not label.startswith("aten."):
        return label
    name_end = min((i for i in (label.find("("), label.find(" -> "), label.find(" = ")) if i >= 0), default=len(label))
    return _short_op(label[:name_end]) + label[name_end:]  # "..._local_scalar_dense.default = 2.7" keeps 2.7


def _window_table(r: RegionReport) -> Table:
    two = r.kind == "two_runs"  # two traces compared: the columns are run A | run B
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, title_justify="left",
                  title="run A | run B, aligned" if two else "forward | recompute, aligned")
    table.add_column("A#" if two else "fwd#", justify="right")
    table.add_column("run A" if two else "forward", ratio=1)
    table.add_column("B#" if two else "rec#", justify="right")
    table.add_column("run B" if two else "recompute", ratio=1)
    table.add_column("")
    for row in r.window:
        if row.how == "gap":
            table.add_row("⋮", "", "⋮", "", "")
            continue
        style = _MARKER_STYLE.get(row.marker or "", "")
        marker = Text(_MARKER_TEXT.get(row.marker or "", ""), style=style)
        recompute = row.recompute if row.recompute is not None else (
            "(not recomputed: early stop)" if row.how == "not_recomputed" else "(missing)")
        table.add_row(_t(_idx(row.forward_index)), Breakable(_short_label(row.forward) or "(missing)", style),
                      _t(_idx(row.recompute_index)), Breakable(_short_label(recompute), style), marker)
    return table


def _positions_table(r: RegionReport) -> Table | None:
    """Positions whose metadata differ or that torch named; a count of those whose values differ."""
    shown, value_only = positions.split(r)
    if not shown and not value_only:
        return None
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, title_justify="left", title=positions.title(r))
    for col, kw in (("pos", {"justify": "right"}), ("op / origin", {}), ("module", {}),
                    ("saved -> recomputed", {}), ("source", {})):
        table.add_column(col, **kw)
    rows = shown + value_only  # metadata first, then the positions torch cannot see
    for p in rows[:MAX_POSITION_ROWS]:
        what = _short_op(p.op) if p.op else f"{p.origin} {p.name or ''}".strip()
        if p.origin == "shape match":  # a log without pack records: the first op with that shape, a guess
            what += " (by shape?)"
        change = f"{p.saved or '?'} -> {p.recomputed or '-'}"
        if p in value_only:
            change += ", other values"
        table.add_row(_t(positions.label(p)), Breakable(what), Breakable(p.module),
                      Breakable(change, "red" if p.matches is False else "yellow"), Breakable(_short_source(p.source), "dim"))
    if len(rows) > MAX_POSITION_ROWS:
        table.caption = f"{len(rows) - MAX_POSITION_ROWS} more; every position is in the JSON/HTML report"
    elif not shown:
        table.caption = "values differ with unchanged shapes: torch cannot see this"
    return table


def _short_op(op: str | None) -> str:
    """"aten.split_with_sizes.default" -> "split_with_sizes"; other namespaces stay qualified."""
    if not op:
        return ""
    parts = op.split(".")
    if parts[0] == "aten" and len(parts) >= 2:
        return parts[1] if parts[-1] == "default" or len(parts) == 2 else f"{parts[1]}.{parts[-1]}"
    return op


def _short_source(source: str | None) -> str:
    """"examples/tiny_moe.py:108 in forward" -> "tiny_moe.py:108"."""
    if not source:
        return ""
    return source.split(" in ")[0].rsplit("/", 1)[-1]
