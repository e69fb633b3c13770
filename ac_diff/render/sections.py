"""The report's run-level sections, for the terminal and HTML renderers: the reference (gradients vs a run
without AC) and the remedies applied (the fixes tried: fixes.py). Formatting only.

    for item in terminal_items(report): console.print(item)
    html_sections(report)  ->  '<section id="remedies">...</section><section id="reference">...'
"""

from __future__ import annotations

from html import escape
from typing import Any

from rich.text import Text

MAX_PARAMS = 6


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def _largest(step: Any) -> list[Any]:
    return sorted(step.differing, key=lambda d: (d.status == "differs", d.rel_diff or 0.0), reverse=True)


def _diff_text(d: Any) -> str:
    if d.status == "differs":
        if getattr(d, "norm_only", False):
            return f"{d.name} differs (values over budget: norm only, >= {_num(d.rel_diff)})"
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
    if report.watch:
        out.append(Text("watch: ", style="bold cyan") + Text(report.watch["text"]))
    text = remedies_text(report)
    if text:
        out.append(Text("remedies applied: ", style="bold cyan") + Text(text))
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


def html_sections(report: Any) -> str:
    parts = []
    if report.watch:
        parts.append(f"<section id=\"watch\"><h2>watch mode</h2><p>{escape(report.watch['text'])}</p></section>")
    text = remedies_text(report)
    if text:
        parts.append(f"<section id=\"remedies\"><h2>remedies applied</h2><p>{escape(text)}</p></section>")
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
