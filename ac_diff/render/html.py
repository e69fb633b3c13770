"""The HTML report: one self-contained page (inline CSS and JS, no network), same content as the terminal.
The style and the script are package files (assets/report.css, assets/report.js), inlined into the page.

    render(report, "html", path="report.html")
    ac-diff report ac-diff-out --format html -o report.html

What is where, top to bottom: the verdict banner (headline, silent warning, counts, sources); a
toolbar (text filter on module/op, "diverged only", "differing positions only", expand/collapse);
torch's error; ranks and cross-rank findings; the region table (links to the sections); then one
collapsible section per region: cause and evidence, first divergences, what changed from outside, a
plot of where in the region the divergences are, the side-by-side aligned window with divergent cells
marked, the causal chain, the map of every saved position, and the suggestions with their code.

The filter state lives in the URL hash (`#q=topk&diverged=0&differing=1`), so a link reproduces the
view. Like every renderer it only formats a finished `Report`; every string from it is escaped.
"""

from __future__ import annotations

import difflib
import re
import zlib
from html import escape
from importlib import resources
from typing import Any, Iterable, Iterator

from .._version import __version__
from ..report import CLEAN, DAMAGED, DIVERGED, UNCHECKED, Divergence, PositionRow, RegionReport, Report
from . import positions
from .fixes import fixes_html
from .sections import html_sections
from .terminal import _short_label, _short_op, _short_source

_ASSETS = resources.files(__package__).joinpath("assets")
_CSS = _ASSETS.joinpath("report.css").read_text(encoding="utf-8")  # the page's style and its filter script
_JS = _ASSETS.joinpath("report.js").read_text(encoding="utf-8")
MAX_OTHER_SECTIONS = 200  # clean/unchecked regions that get a section of their own (all are in the table)
_KIND_LABEL = {"value": "value", "discrete": "decision", "shape": "shape", "dtype": "dtype", "control": "sequence",
               "cached": "cached",
               "argument": "argument"}
_LANES = (("control", "sequence"), ("value", "value"), ("argument", "argument"), ("discrete", "decision"),
          ("shape", "shape"),
          ("pos_meta", "saved: metadata ≠"), ("pos_values", "saved: values ≠"))


def e(value: Any) -> str:
    """Escape anything for text and attribute values ("" for None)."""
    return "" if value is None else escape(str(value), quote=True)


def render_html(report: Report) -> str:
    """The whole page as a string."""
    return "".join(html_chunks(report))


def html_chunks(report: Report) -> Iterator[str]:
    """The page in pieces, one region's row or section at a time (what `--format html` writes): the parts of
    the page joined by newlines, an empty part left out."""
    first = True
    for part in _page_parts(report):
        pieces = iter((part,) if isinstance(part, str) else part)
        head = next((x for x in pieces if x), "")
        if not head:
            continue
        yield head if first else "\n" + head
        first = False
        yield from pieces


def _page_parts(report: Report) -> Iterator[str | Iterable[str]]:
    silent = report.silent
    title = report.title
    any_diverged = any(r.status == DIVERGED for r in report.regions)
    yield "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
    # no network, ever: everything the page needs is inline
    yield ("<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'; "
           "script-src 'unsafe-inline'; img-src data:\">")
    yield "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
    yield f"<meta name=\"generator\" content=\"ac-diff {e(__version__)}\">"
    yield f"<title>ac-diff: {e(title)} — {e(report.headline)}</title>"
    yield f"<style>{_CSS}</style></head>"
    yield f"<body data-verdict=\"{e(report.verdict)}\">"
    yield _verdict(report, title, silent)
    yield _toolbar(report, any_diverged)
    yield "<main>"
    yield fixes_html(report)  # the answer first: what `ac-diff fix` tried and what works
    yield html_sections(report)  # remedies applied, gradients vs the run without AC: near the top
    yield _torch_errors(report)
    yield _ranks(report)
    yield _regions_table(report)
    yield _region_sections(report)
    yield _notes(report.notes, "notes")
    yield "</main>"
    yield (f"<footer>ac-diff {e(__version__)} · report format v1 · "
           f"{e(', '.join(report.sources)) if report.sources else ''}</footer>")
    yield f"<script>{_JS}</script>"
    yield "</body></html>\n"


# --- verdict, toolbar, top tables -----------------------------------------------------------------------------

def _verdict(report: Report, title: str, silent: bool) -> str:
    cls = "silent" if silent else {DIVERGED: "diverged", UNCHECKED: "silent", DAMAGED: "silent"}.get(report.verdict,
                                                                                                     "clean")
    out = [f"<header id=\"verdict\" class=\"verdict {cls}\" data-verdict=\"{e(report.verdict)}\">",
           f"<div class=\"verdict-title\">ac-diff: <span id=\"verdict-word\">{e(title)}</span></div>",
           f"<p class=\"headline\" id=\"headline\">{e(report.headline)}</p>"]
    if silent:
        out.append(f"<p class=\"silent-warning\" id=\"silent-warning\">{e(report.silent_warning)}</p>")
    counts = report.status_counts()
    if counts:
        out.append(f"<p class=\"dim\">{e(counts)}</p>")
    if report.sources:
        out.append(f"<p class=\"dim\">from {e(', '.join(report.sources))}</p>")
    if report.exit_status:
        out.append(f"<p class=\"dim\">the script ended with: {e(report.exit_status)}</p>")
    out.append("</header>")
    return "\n".join(out)


def _toolbar(report: Report, any_diverged: bool) -> str:
    if not report.regions:
        return ""
    return (
        "<nav class=\"toolbar\" id=\"toolbar\">"
        "<label>filter <input id=\"filter\" type=\"search\" placeholder=\"module or op, e.g. moe.router or topk\" "
        "autocomplete=\"off\"></label>"
        f"<label><input id=\"diverged-only\" type=\"checkbox\"{' checked' if any_diverged else ''}> diverged only</label>"
        "<label><input id=\"differing-only\" type=\"checkbox\"> differing positions only</label>"
        "<button type=\"button\" id=\"expand-all\">expand all</button>"
        "<button type=\"button\" id=\"collapse-all\">collapse all</button>"
        f"<span id=\"shown-count\" class=\"dim\">{len(report.regions)} region(s)</span>"
        "</nav>")


def _torch_errors(report: Report) -> str:
    if not report.torch_errors:
        return ""
    rows = []
    for err in report.torch_errors:
        counts = f"{err.saved_count}/{err.recomputed_count}" if err.saved_count is not None else ""
        rows.append(f"<tr><td>{e(err.rank)}</td><td>{e(err.region)}</td><td>{e(err.kind)}</td>"
                    f"<td class=\"wrap\">{e(', '.join(map(str, err.positions)))}</td><td>{e(counts)}</td>"
                    f"<td>{e(err.occurrences)}</td></tr>")
    messages = "".join(f"<details class=\"message\"><summary>torch's message (rank {e(err.rank)})</summary>"
                       f"<pre>{e(err.message)}</pre></details>" for err in report.torch_errors if err.message)
    return (f"<section id=\"torch-error\"><h2>torch's error</h2>"
            f"<table><thead><tr><th>rank</th><th>region</th><th>kind</th><th>positions</th>"
            f"<th>counts (saved/recomputed)</th><th>raised</th></tr></thead><tbody>{''.join(rows)}</tbody></table>"
            f"{messages}</section>")


def _ranks(report: Report) -> str:
    out = []
    if len(report.ranks) > 1:
        rows = []
        for r in report.ranks:
            rows.append(f"<tr><td>{e(r.rank)}</td><td><span class=\"badge {_status_class(r.verdict)}\">"
                        f"{e(r.verdict)}</span></td><td>{e(r.regions)}</td><td>{e(r.diverged)}</td>"
                        f"<td>{e(r.cause)}</td><td>{e(r.first_diverged)}</td></tr>")
        out.append("<section id=\"ranks\"><h2>ranks</h2><table><thead><tr><th>rank</th><th>verdict</th>"
                   "<th>regions</th><th>diverged</th><th>cause</th><th>first diverged</th></tr></thead>"
                   f"<tbody>{''.join(rows)}</tbody></table></section>")
    if report.cross_rank:
        items = "".join(f"<li>{e(f)}</li>" for f in report.cross_rank)
        out.append(f"<section id=\"cross-rank\"><h2>cross-rank</h2><ul>{items}</ul></section>")
    return "\n".join(out)


def _status_class(status: str) -> str:
    return {DIVERGED: "st-diverged", CLEAN: "st-clean"}.get(status, "st-other")


def _region_id(r: RegionReport) -> str:
    """The region in the page's ids, "rank-region": a log's regions also name their file (two logs without rank
    prefixes both hold a "rank 0, region 0")."""
    tag = f"-{zlib.crc32(r.path.encode()):08x}" if r.source == "log" and r.path else ""
    return f"{int(r.rank)}-{int(r.region)}{tag}"


def _anchor(r: RegionReport) -> str:
    return f"region-{_region_id(r)}"


def _search_text(r: RegionReport) -> str:
    """What the text filter matches a region on: its module and every op and module the report names."""
    words: set[str] = {r.module or ""}
    if r.cause:
        words.update((r.cause.kind, r.cause.tensor or ""))
    for d in _divergences(r):
        words.update((d.op, _short_op(d.op), d.module or ""))
    for row in r.window:
        words.update((_label_op(row.forward), _label_op(row.recompute), row.module or ""))
    for p in r.positions:
        words.update((p.op or "", p.module or "", p.name or ""))
    return " ".join(sorted(w for w in words if w)).lower()


def _label_op(label: str | None) -> str:
    """"aten.topk.default(2, 1) -> f32[..]" -> "aten.topk.default"."""
    return re.split(r"[(\s]", label, maxsplit=1)[0] if label else ""


def _regions_table(report: Report) -> Iterator[str]:
    if not report.regions:
        what = ("no region details in this input: torch's error above is what it holds"
                if report.torch_errors else "no checkpointed region was recorded")
        yield f"<section id=\"regions\"><h2>regions</h2><p class=\"dim\">{e(what)}</p></section>"
        return
    yield ("<section id=\"regions\"><h2>regions</h2><table id=\"region-table\"><thead><tr><th>rank</th>"
           "<th>region</th><th>module</th><th>kind</th><th>ops fwd/rec</th><th>status</th><th>cause</th>"
           "<th>first divergence</th></tr></thead><tbody>")
    for r in report.regions:
        first = r.first_divergence()
        status = r.status_label
        module = e(r.module or "?")
        link = f"<a href=\"#{_anchor(r)}\">{module}</a>"
        yield (
            f"<tr class=\"region-row {_status_class(r.status)}\" data-region=\"{_anchor(r)}\" "
            f"data-status=\"{e(r.status)}\" data-search=\"{e(_search_text(r))}\">"
            f"<td>{e(r.rank)}</td><td class=\"num\">{e(r.region)}</td><td>{link}</td><td>{e(r.kind)}</td>"
            f"<td class=\"num\">{e(r.forward_ops)}/{e(r.recompute_ops)}</td>"
            f"<td><span class=\"badge {_status_class(r.status)}\">{e(status)}</span></td>"
            f"<td>{e(r.cause_label)}{_group_html(report, r)}</td>"
            f"<td>{_first_html(first) or (e(r.unchecked_reason) if r.status == UNCHECKED else '')}</td></tr>")
    yield "</tbody></table><p id=\"none-shown\" class=\"dim\" hidden>no region matches the filter</p></section>"


def _group_html(report: Report, r: RegionReport) -> str:
    """"same cause as layers.0-5" for a member of a group of diverged regions."""
    g = report.group_of(r)
    return f" <span class=\"dim\">({e(g.label)}: same cause)</span>" if g is not None else ""


def _first_html(d: Divergence | None) -> str:
    if d is None:
        return ""
    return _op_html(d.op) + (f" in {e(d.module)}" if d.module else "")


def _op_html(op: str | None) -> str:
    if not op:
        return ""
    return f"<code title=\"{e(op)}\">{e(_short_op(op))}</code>"


# --- per region -----------------------------------------------------------------------------------------------

def _region_sections(report: Report) -> Iterator[str]:
    if not report.regions:
        return
    others = [r for r in report.regions if r.status != DIVERGED]
    yield "<section id=\"details\"><h2>regions in detail</h2>"
    for r in report.diverged_regions():
        yield "\n" + _region_section(r, report, open_=True)
    for r in others[:MAX_OTHER_SECTIONS]:
        yield "\n" + _region_section(r, report, open_=False)
    if len(others) > MAX_OTHER_SECTIONS:
        yield (f"\n<p class=\"dim\">{len(others) - MAX_OTHER_SECTIONS} more clean/unchecked region(s) are in the "
               "region table only; the JSON report has every position of every region</p>")
    yield "\n</section>"


def _divergences(r: RegionReport) -> list[Divergence]:
    return r.divergences()


def _region_section(r: RegionReport, report: Report, open_: bool) -> str:
    status = r.status + (" (silent)" if r.silent else "")
    cause = f" · <span class=\"cause-kind\">{e(r.cause.kind)}</span>" if r.cause else ""
    raised = " · <span class=\"dim\">torch raised</span>" if report.raised(r) else ""
    head = (f"<summary><span class=\"badge {_status_class(r.status)}\">{e(status)}</span> "
            f"region {e(r.region)} · <b>{e(r.module or '?')}</b> · rank {e(r.rank)} · {e(r.kind)} · "
            f"<span class=\"dim\">{e(r.forward_ops)} fwd / {e(r.recompute_ops)} rec ops</span>{cause}{raised}</summary>")
    body: list[str] = []
    if r.status == DIVERGED:
        body += [_cause(r), _first_divergences(r), _changed(r), _plot(r), _window(r), _chain(r)]
    elif r.status == CLEAN:
        body.append(f"<p>the recompute reproduced the forward: {e(r.forward_ops)} forward / {e(r.recompute_ops)} "
                    f"recompute ops, {len(r.positions)} saved position(s) match.</p>")
    else:
        body.append(f"<p>{e(r.status)}: the region was never recomputed (no backward ran through it), so there is "
                    "nothing to compare; its saved positions are mapped below.</p>")
    body.append(_positions(r, open_=r.status == DIVERGED))
    body.append(_suggestions(r))
    body.append(_notes(r.notes, None))
    return (f"<details class=\"region {_status_class(r.status)}\" id=\"{_anchor(r)}\" data-region=\"{_anchor(r)}\" "
            f"data-status=\"{e(r.status)}\" data-module=\"{e((r.module or '').lower())}\" "
            f"data-search=\"{e(_search_text(r))}\"{' open' if open_ else ''}>"
            f"{head}<div class=\"region-body\">{''.join(b for b in body if b)}</div></details>")


def _cause(r: RegionReport) -> str:
    if not r.cause:
        return ""
    c = r.cause
    tensor = f" <code>{e(c.tensor)}</code>" if c.tensor else ""
    evidence = "".join(f"<li>{e(ev)}</li>" for ev in c.evidence)
    return (f"<div class=\"cause\" data-cause=\"{e(c.kind)}\"><span class=\"label\">cause</span> "
            f"<b class=\"cause-kind\">{e(c.kind)}</b>{tensor}<p>{e(c.detail)}</p>"
            f"{'<ul class=evidence>' + evidence + '</ul>' if evidence else ''}</div>")


def _first_divergences(r: RegionReport) -> str:
    divergences = _divergences(r)
    if not divergences:
        return ""
    rows = []
    for d in divergences:
        detail = ""
        if d.detail:
            items = "".join(f"<tr><th>{e(k)}</th><td>{e(v)}</td></tr>" for k, v in d.detail.items())
            detail = f"<details class=\"detail\"><summary>detail</summary><table class=\"kv\">{items}</table></details>"
        rows.append(f"<tr class=\"div-{e(d.kind)}\" data-kind=\"{e(d.kind)}\">"
                    f"<td><span class=\"mk mk-{e(d.kind)}\">{e(_KIND_LABEL.get(d.label, d.label))}</span></td>"
                    f"<td class=\"divergent-op\"><code>{e(d.op)}</code></td>"
                    f"<td class=\"num\">{_idx(d.forward_index)}</td><td class=\"num\">{_idx(d.recompute_index)}</td>"
                    f"<td>{e(r.module_of(d))}</td><td class=\"dim src\">{e(d.source)}</td>"
                    f"<td class=\"wrap\">{e(d.summary)}{detail}</td></tr>")
    return ("<h3>first divergences</h3><table class=\"divergences\"><thead><tr><th>kind</th><th>op</th>"
            "<th>fwd#</th><th>rec#</th><th>module</th><th>source</th><th>what differs</th></tr></thead>"
            f"<tbody>{''.join(rows)}</tbody></table>")


def _changed(r: RegionReport) -> str:
    out = []
    if r.changed_inputs:
        rows = []
        for c in r.changed_inputs:
            rows.append(f"<tr><td>{e(c.get('kind'))}</td><td><code>{e(c.get('name'))}</code></td><td>{e(c.get('meta'))}</td>"
                        f"<td>{e(c.get('forward'))}</td><td>{e(c.get('recompute'))}</td>"
                        f"<td class=\"num\">{_idx(c.get('first_op'))}</td></tr>")
        out.append("<h3>changed from outside the region</h3><table><thead><tr><th>kind</th><th>name</th>"
                   "<th>meta</th><th>forward fingerprint</th><th>recompute fingerprint</th><th>first op</th></tr>"
                   f"</thead><tbody>{''.join(rows)}</tbody></table>")
    if r.state_changes:
        rows = "".join(f"<tr><th>{e(k)}</th><td>{e(v)}</td></tr>" for k, v in r.state_changes.items())
        out.append(f"<h3>global state that differs</h3><table class=\"kv\">{rows}</table>")
    return "".join(out)


def _idx(i: Any) -> str:
    return "-" if i is None else e(i)


def _row_id(r: RegionReport, forward_index: int | None, recompute_index: int | None) -> str:
    if forward_index is not None:
        return f"w-{_region_id(r)}-f{int(forward_index)}"
    return f"w-{_region_id(r)}-r{int(recompute_index or 0)}"


def _forward_x(r: RegionReport, forward_index: int | None, recompute_index: int | None) -> float | None:
    """A place on the forward-op axis: the forward index, or for a recompute-only op that the window shows,
    just after the forward op aligned before it. None when it cannot be placed honestly."""
    if forward_index is not None:
        return float(forward_index)
    if recompute_index is None or not any(row.recompute_index == recompute_index for row in r.window):
        return None
    before = [row for row in r.window if row.forward_index is not None and row.recompute_index is not None
              and row.recompute_index < recompute_index]
    if not before:
        return None
    return max(before, key=lambda row: row.recompute_index).forward_index + 0.5


def _plot(r: RegionReport) -> str:
    """Where in the region the divergences are: x = forward op index, one lane per kind of mark."""
    marks: dict[str, list[tuple[float, str, str | None]]] = {k: [] for k, _ in _LANES}
    unplaced: list[str] = []
    for row in r.window:
        if row.marker in ("value", "argument", "discrete", "shape", "dtype", "control"):
            x = _forward_x(r, row.forward_index, row.recompute_index)
            where = f"fwd #{row.forward_index}" if row.forward_index is not None else f"rec #{row.recompute_index}"
            label = f"{where} {_short_label(row.forward or row.recompute)} ≠ {_KIND_LABEL[row.marker]}"
            if x is None:
                unplaced.append(label)
            else:  # (a dtype-only metadata change is on the shape lane)
                lane = "shape" if row.marker == "dtype" else row.marker
                marks[lane].append((x, label, _row_id(r, row.forward_index, row.recompute_index)))
    inputs = 0
    for p in r.positions:
        lane = "pos_meta" if p.matches is False else ("pos_values" if p.values_differ else None)
        if lane is None:
            continue
        if p.forward_index is None:
            inputs += 1
            continue
        what = _short_op(p.op) if p.op else f"{p.origin} {p.name or ''}"
        label = f"position {p.position}: {what} at op #{p.forward_index} ({p.saved} -> {p.recomputed})"
        marks[lane].append((float(p.forward_index), label, f"p-{_region_id(r)}-{int(p.position)}"))
    firsts = []
    for d in _divergences(r):
        x = _forward_x(r, d.forward_index, d.recompute_index)
        at = f"#{d.forward_index}" if d.forward_index is not None else f"rec #{d.recompute_index}"
        label = f"{_KIND_LABEL.get(d.label, d.label)}: {_short_op(d.op)} {at}"
        if x is None:
            unplaced.append(label)
        else:
            firsts.append((x, label, d.kind))
    lanes = [(k, name) for k, name in _LANES if marks[k]]
    if not lanes and not firsts:
        return ""
    xs = [x for k in marks for x, _, _ in marks[k]] + [x for x, _, _ in firsts]
    n = max(r.forward_ops or r.recompute_ops, int(max(xs, default=0)) + 1, 1)
    left, right, lane_h = 130, 790, 22
    top = 20 + 13 * len(firsts)  # one label row per first divergence above the lanes
    height = top + lane_h * max(len(lanes), 1) + 30
    width = right - left

    def sx(x: float) -> float:
        return left + width * (x + 0.5) / n

    svg = [f"<svg class=\"plot\" viewBox=\"0 0 800 {height}\" role=\"img\" aria-label=\"where in the region the "
           f"divergences are\" data-ops=\"{n}\">"]
    idx = [row.forward_index for row in r.window if row.forward_index is not None]
    if idx:  # the side-by-side window below
        x0, x1 = sx(min(idx)) - width / n / 2, sx(max(idx)) + width / n / 2
        svg.append(f"<rect class=\"win\" x=\"{x0:.1f}\" y=\"{top - 6}\" width=\"{max(x1 - x0, 2):.1f}\" "
                   f"height=\"{lane_h * max(len(lanes), 1) + 6}\"><title>the aligned window shown below "
                   f"(forward ops {min(idx)}-{max(idx)})</title></rect>")
    for i, (k, name) in enumerate(lanes):
        y = top + i * lane_h + lane_h / 2
        svg.append(f"<text class=\"lane\" x=\"{left - 8}\" y=\"{y + 4:.1f}\" text-anchor=\"end\">{e(name)}</text>")
        svg.append(f"<line class=\"lane-line\" x1=\"{left}\" x2=\"{right}\" y1=\"{y:.1f}\" y2=\"{y:.1f}\"/>")
        for x, label, target in sorted(marks[k]):
            mark = (f"<rect class=\"mark mk-{k}\" data-kind=\"{k}\" x=\"{sx(x) - 2.5:.1f}\" y=\"{y - 7:.1f}\" "
                    f"width=\"5\" height=\"14\" rx=\"1\"><title>{e(label)}</title></rect>")
            svg.append(f"<a href=\"#{target}\">{mark}</a>" if target else mark)
    for j, (x, label, kind) in enumerate(firsts):
        px = sx(x)
        svg.append(f"<line class=\"first mk-{e(kind)}\" x1=\"{px:.1f}\" x2=\"{px:.1f}\" y1=\"{16 + 13 * j}\" "
                   f"y2=\"{height - 24}\"/>")
        anchor, tx = ("end", px - 3) if px > right - 7 * len(label) else ("start", px + 3)
        svg.append(f"<text class=\"first-label mk-{e(kind)}\" x=\"{tx:.1f}\" y=\"{13 + 13 * j}\" "
                   f"text-anchor=\"{anchor}\">{e(label)}</text>")
    axis_y = height - 22
    svg.append(f"<line class=\"axis\" x1=\"{left}\" x2=\"{right}\" y1=\"{axis_y}\" y2=\"{axis_y}\"/>")
    for t in sorted({0, n // 4, n // 2, 3 * n // 4, n - 1}):
        svg.append(f"<line class=\"axis\" x1=\"{sx(t):.1f}\" x2=\"{sx(t):.1f}\" y1=\"{axis_y}\" y2=\"{axis_y + 4}\"/>"
                   f"<text class=\"tick\" x=\"{sx(t):.1f}\" y=\"{axis_y + 15}\" text-anchor=\"middle\">{t}</text>")
    svg.append(f"<text class=\"tick\" x=\"{left - 8}\" y=\"{axis_y + 15}\" text-anchor=\"end\">forward op #</text>")
    svg.append("</svg>")
    notes = []
    if inputs:
        notes.append(f"{inputs} differing position(s) hold region inputs or parameters (no op index): see the "
                     "position map")
    if unplaced:
        notes.append("not placed (recompute-only, outside the window): " + "; ".join(unplaced))
    caption = f"<figcaption class=\"dim small\">{e('. '.join(notes))}</figcaption>" if notes else ""
    return f"<h3>where in the region</h3><figure class=\"plot-box\">{''.join(svg)}{caption}</figure>"


_TOKEN = re.compile(r"\w+|[^\w\s]|\s+")


def _diff_cells(a: str, b: str) -> tuple[str, str]:
    """Both labels escaped, with the tokens that differ wrapped in <mark>."""
    ta, tb = _TOKEN.findall(a), _TOKEN.findall(b)
    sm = difflib.SequenceMatcher(None, ta, tb, autojunk=False)
    oa, ob = [], []
    for tag, i1, i2, j1, j2 in sm.get_opcodes():
        sa, sb = e("".join(ta[i1:i2])), e("".join(tb[j1:j2]))
        if tag == "equal":
            oa.append(sa)
            ob.append(sb)
        else:
            oa.append(f"<mark>{sa}</mark>" if sa else "")
            ob.append(f"<mark>{sb}</mark>" if sb else "")
    return "".join(oa), "".join(ob)


def _window(r: RegionReport) -> str:
    if not r.window:
        return ""
    rows = []
    for row in r.window:
        if row.how == "gap":
            rows.append("<tr class=\"gap\"><td>⋮</td><td></td><td>⋮</td><td></td><td></td><td></td></tr>")
            continue
        fwd = _short_label(row.forward) if row.forward is not None else None
        if row.recompute is not None:
            rec = _short_label(row.recompute)
        else:
            rec = None
        marker = row.marker or ""
        divergent = marker in ("value", "argument", "discrete", "shape", "dtype", "control")
        if fwd is not None and rec is not None and divergent and fwd != rec:
            fwd_html, rec_html = _diff_cells(fwd, rec)
        else:
            fwd_html = e(fwd) if fwd is not None else "<i class=\"dim\">(missing)</i>"
            rec_html = e(rec) if rec is not None else (
                "<i class=\"dim\">(not recomputed: early stop)</i>" if row.how == "not_recomputed"
                else "<i class=\"dim\">(missing)</i>")
        cell_cls = f" class=\"cell div-{marker}\"" if divergent else (" class=\"cell cached\"" if marker == "cached" else " class=\"cell\"")
        mk = f"<span class=\"mk mk-{marker}\">≠ {e(_KIND_LABEL[marker])}</span>" if divergent else (
            "<span class=\"dim\">cached</span>" if marker == "cached" else
            "<span class=\"dim\">≠ (input)</span>" if marker == "inferred" else "")
        rows.append(f"<tr id=\"{_row_id(r, row.forward_index, row.recompute_index)}\" class=\"how-{e(row.how)}"
                    f"{' divergent' if divergent else ''}\" data-marker=\"{e(marker)}\">"
                    f"<td class=\"num\">{_idx(row.forward_index)}</td>"
                    f"<td{cell_cls} title=\"{e(row.forward)}\">{fwd_html}</td>"
                    f"<td class=\"num\">{_idx(row.recompute_index)}</td>"
                    f"<td{cell_cls} title=\"{e(row.recompute)}\">{rec_html}</td><td>{mk}</td>"
                    f"<td class=\"dim\">{e(row.module)}</td></tr>")
    span = [x for row in r.window for x in (row.forward_index,) if x is not None]
    where = f" (forward ops {min(span)}-{max(span)} of {r.forward_ops})" if span else ""
    return (f"<details class=\"window\" open><summary><h3>forward | recompute, aligned{e(where)}</h3></summary>"
            "<table class=\"aligned\"><thead><tr><th>fwd#</th><th>forward</th><th>rec#</th><th>recompute</th>"
            f"<th></th><th>module</th></tr></thead><tbody>{''.join(rows)}</tbody></table>"
            "<p class=\"dim small\">the rows around the first divergences; a config with larger window_before / "
            "window_after widens it</p></details>")


def _chain(r: RegionReport) -> str:
    if not r.chain:
        return ""
    items = "".join(f"<li>{e(step)}</li>" for step in r.chain)
    return f"<h3>chain</h3><ol class=\"chain\">{items}</ol>"


def _positions(r: RegionReport, open_: bool) -> str:
    if not r.positions:
        return ""
    meta, value_only = positions.split(r)
    title = positions.title(r)
    rows = "".join(_position_row(r, p) for p in r.positions)
    note = ("<p class=\"dim small\">values differ with unchanged shapes: torch cannot see this</p>"
            if value_only and not meta else "")
    return (f"<details class=\"positions\"{' open' if open_ else ''}><summary><h3>{e(title)}</h3></summary>{note}"
            "<table class=\"positions\"><thead><tr><th>pos</th><th>op / origin</th><th>module</th><th>fwd op#</th>"
            "<th>saved</th><th>recomputed</th><th>match</th><th>source</th></tr></thead>"
            f"<tbody>{rows}</tbody></table></details>")


def _position_row(r: RegionReport, p: PositionRow) -> str:
    if p.matches is False:
        cls, verdict = "pos-mismatch", "metadata ≠"
    elif p.values_differ:
        cls, verdict = "pos-values", "values ≠"
    elif p.matches is None:
        cls, verdict = "pos-unknown", "?" if p.recomputed is not None else "not recomputed"
    else:
        cls, verdict = "pos-match", "="
    if p.in_torch_error:
        cls += " pos-torch"
        verdict += " · torch"
    what = f"<code title=\"{e(p.op)}\">{e(_short_op(p.op))}</code>" if p.op else e(f"{p.origin} {p.name or ''}".strip())
    if p.matches is False and p.saved and p.recomputed:
        saved, recomputed = _diff_cells(p.saved, p.recomputed)
    else:
        saved, recomputed = e(p.saved or "?"), e(p.recomputed or "-")
    differing = "1" if (p.matches is False or p.values_differ or p.in_torch_error) else "0"
    search = " ".join(x for x in (p.op, p.module, p.name, p.origin, p.source) if x).lower()
    return (f"<tr id=\"p-{_region_id(r)}-{positions.label(p)}\" class=\"pos {cls}\" "
            f"data-differing=\"{differing}\" data-search=\"{e(search)}\">"
            f"<td class=\"num\">{e(positions.label(p))}</td><td>{what}</td><td>{e(p.module)}</td>"
            f"<td class=\"num\">{_idx(p.forward_index)}</td><td class=\"meta\">{saved}</td>"
            f"<td class=\"meta\">{recomputed}</td><td class=\"verdict-cell\">{e(verdict)}</td>"
            f"<td class=\"dim src\" title=\"{e(p.source)}\">{e(_short_source(p.source))}</td></tr>")


def _suggestions(r: RegionReport) -> str:
    if not r.suggestions:
        return ""
    out = ["<h3>suggestions</h3>"]
    for s in r.suggestions:
        code = (f"<div class=\"code\"><button type=\"button\" class=\"copy\">copy</button>"
                f"<pre><code class=\"language-python\">{e(s.code)}</code></pre></div>") if s.code else ""
        verify = f"<p class=\"dim\">verify: <code>{e(s.verify)}</code></p>" if s.verify else ""
        out.append(f"<div class=\"fix\"><div class=\"fix-title\"><span class=\"label ok\">fix</span> "
                   f"<b>{e(s.title)}</b> <span class=\"dim\">[{e(s.status)}]</span></div><p>{e(s.text)}</p>{code}"
                   f"{verify}</div>")
    return "".join(out)


def _notes(notes: Iterable[str], section_id: str | None) -> str:
    items = "".join(f"<li>{e(n)}</li>" for n in notes)
    if not items:
        return ""
    if section_id:
        return f"<section id=\"{section_id}\"><h2>notes</h2><ul class=\"notes\">{items}</ul></section>"
    return f"<ul class=\"notes\">{items}</ul>"
