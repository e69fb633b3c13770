"""The report's run-level sections, for the terminal and HTML renderers: the reference (gradients vs a run
without AC), the remedies applied, and the fixes tried. Formatting only.

    for item in terminal_items(report): console.print(item)
    html_sections(report)  ->  '<section id="reference">...</section><section id="fixes">...'
"""

from __future__ import annotations

from html import escape
from typing import Any

from rich.table import Table
from rich import box
from rich.text import Text

MAX_PARAMS = 6


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def _largest(step: Any) -> list[Any]:
    return sorted(step.differing, key=lambda d: (d.status == "differs", d.rel_diff or 0.0), reverse=True)


def _diff_text(d: Any) -> str:
    if d.status == "differs":
        return f"{d.name} {_num(d.rel_diff)}" + (" (sampled)" if d.sampled else "")
    return f"{d.name} ({d.status.replace('_', ' ')})"


def remedies_text(report: Any) -> str | None:
    rows = report.remedies or []
    if not rows:
        return None
    parts = [f"{r['remedy']}" + (f" in {r['region']}" if r.get("region") else "") + f": {r['what']}"
             + (f" ({r['calls']} call(s))" if r.get("calls") else "") for r in rows]
    return "; ".join(parts)


def terminal_items(report: Any) -> list[Any]:
    out: list[Any] = []
    text = remedies_text(report)
    if text:
        out.append(Text("remedies applied: ", style="bold cyan") + Text(text))
    if report.fixes is not None:  # the answer first
        out.extend(_fixes_terminal(report.fixes))
    ref = report.reference
    if ref is not None:
        style = {"identical": "green", "differs": "bold red"}.get(ref.verdict, "yellow")
        out.append(Text("gradients vs the run without AC: ", style="bold") + Text(ref.headline, style=style))
        differing = next((s for s in ref.steps if s.differing), None)
        if differing is not None and ref.verdict == "differs":
            shown = _largest(differing)
            out.append(Text("  largest: " + ", ".join(_diff_text(d) for d in shown[:MAX_PARAMS])
                            + (f", ... {len(shown) - MAX_PARAMS} more" if len(shown) > MAX_PARAMS else ""),
                            style="dim"))
        for e in ref.explanations:
            out.append(Text(f"  why ({e.kind.replace('_', ' ')}): ", style="bold yellow") + Text(e.text))
            if e.fix:
                out.append(Text("  fix: ", style="bold green") + Text(e.fix))
        for note in ref.notes:
            out.append(Text("  note: " + note, style="dim"))
    return out


def _fixes_terminal(fixes: Any) -> list[Any]:
    out: list[Any] = [Text("fixes tried on your script: ", style="bold") + Text(fixes.headline)]
    table = Table(box=box.SIMPLE_HEAD, show_edge=False)
    for col in ("remedy", "status", "regions diverged before -> after", "gradients vs no-AC run", "extra memory",
                "wall time"):
        table.add_column(col)
    for t in fixes.tries:
        table.add_row(Text(t.remedy), Text(t.status, style={"verified": "green", "did not help": "red"}.get(t.status, "")),
                      Text(t.regions_text()), Text(t.gradients or "-"), Text(t.memory_text()),
                      Text(f"{t.wall_s:.1f} s" if t.wall_s is not None else "-"))
    out.append(table)
    for t in fixes.tries:
        if t.reason:
            out.append(Text(f"  {t.remedy}: ", style="bold") + Text(t.reason))
    if fixes.verified_code:
        out.append(Text("  apply it: ", style="bold green") + Text(fixes.verified_code))
    if fixes.code_change:
        out.append(Text("  code change: ", style="bold yellow") + Text(fixes.code_change))
    return out


def html_sections(report: Any) -> str:
    parts = []
    text = remedies_text(report)
    if text:
        parts.append(f"<section id=\"remedies\"><h2>remedies applied</h2><p>{escape(text)}</p></section>")
    if report.fixes is not None:
        parts.append(_fixes_html(report.fixes))
    ref = report.reference
    if ref is not None:
        body = [f"<section id=\"reference\" data-verdict=\"{escape(ref.verdict)}\"><h2>gradients vs the run without AC"
                f"</h2><p class=\"headline\">{escape(ref.headline)}</p>"]
        for e in ref.explanations:
            body.append(f"<p><b>why ({escape(e.kind.replace('_', ' '))}):</b> {escape(e.text)}</p>")
            if e.fix:
                body.append(f"<p><b>fix:</b> <code>{escape(e.fix)}</code></p>")
        differing = next((s for s in ref.steps if s.differing), None)
        if differing is not None:
            rows = "".join(f"<tr><td>{escape(d.name)}</td><td>{escape(d.status)}</td><td>{_num(d.rel_diff)}</td>"
                           f"<td>{escape(d.region or '')}</td></tr>" for d in _largest(differing))
            body.append(f"<table><thead><tr><th>parameter</th><th>status</th><th>rel. diff</th><th>region</th></tr>"
                        f"</thead><tbody>{rows}</tbody></table>")
        body += [f"<p class=\"dim\">{escape(n)}</p>" for n in ref.notes]
        body.append("</section>")
        parts.append("".join(body))
    return "\n".join(parts)


def _fixes_html(fixes: Any) -> str:
    rows = "".join(f"<tr><td>{escape(t.remedy)}</td><td>{escape(t.status)}</td><td>{escape(t.regions_text())}</td>"
                   f"<td>{escape(t.gradients or '-')}</td><td>{escape(t.memory_text())}</td>"
                   f"<td>{'-' if t.wall_s is None else f'{t.wall_s:.1f} s'}</td></tr>" for t in fixes.tries)
    reasons = "".join(f"<p><b>{escape(t.remedy)}:</b> {escape(t.reason)}</p>" for t in fixes.tries if t.reason)
    code = f"<pre><code>{escape(fixes.verified_code)}</code></pre>" if fixes.verified_code else ""
    if fixes.code_change:
        code += f"<p><b>code change:</b> {escape(fixes.code_change)}</p>"
    return (f"<section id=\"fixes\"><h2>fixes tried on your script</h2><p class=\"headline\">{escape(fixes.headline)}"
            f"</p>{code}<table><thead><tr><th>remedy</th><th>status</th><th>regions diverged before -&gt; after</th>"
            f"<th>gradients vs no-AC run</th><th>extra memory</th><th>wall time</th></tr></thead><tbody>{rows}"
            f"</tbody></table>{reasons}</section>")
