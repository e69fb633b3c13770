"""The `fixes` section (what `ac-diff fix` tried on the script), for the terminal and the HTML page. Formatting only.

    fixes_terminal(report)  ->  [Text("fixes tried on your script: verified: ..."), Table(...), Text("  apply it: ...")]
    fixes_html(report)      ->  '<section id="fixes"><h2>fixes tried on your script</h2>...</section>'  ("" without)

Table: remedy | status | regions diverged before -> after | gradients vs no-AC run | extra memory (activation bytes
kept per region beyond the base run) | wall time; then why each remedy did not help or crashed, the command
that runs each untested one, the verified remedy's exact form, or the code change.
"""

from __future__ import annotations

from html import escape
from typing import Any

from rich import box
from rich.table import Table
from rich.text import Text

from .units import byte_size

COLUMNS = ("remedy", "status", "regions diverged before -> after", "gradients vs no-AC run", "extra memory",
           "wall time")
_STYLE = {"verified": "green", "unverified": "yellow", "did not help": "red", "crashed": "red"}


def _extra_memory(n: float | None) -> str:
    """`+6.0 KiB/region`, `+0 B/region`, `-` (unknown)."""
    return "-" if n is None else ("-" if n < 0 else "+") + byte_size(abs(n)) + "/region"


def _cells(t: Any) -> list[str]:
    return [t.remedy, t.status, t.regions_text(), t.gradients or "-", _extra_memory(t.extra_bytes),
            "-" if t.wall_s is None else f"{t.wall_s:.1f} s"]


def fixes_terminal(report: Any) -> list[Any]:
    fixes = report.fixes
    if fixes is None:
        return []
    out: list[Any] = [Text("fixes tried on your script: ", style="bold") + Text(fixes.headline)]
    table = Table(box=box.SIMPLE_HEAD, show_edge=False)
    for col in COLUMNS:
        table.add_column(col)
    for t in fixes.tries:
        cells = [Text(c) for c in _cells(t)]
        cells[1].stylize(_STYLE.get(t.status, "dim"))
        table.add_row(*cells)
    out.append(table)
    for t in fixes.tries:
        if t.reason:
            out.append(Text(f"  {t.remedy} ({t.status}): ", style="bold") + Text(t.reason))
        elif t.status == "untested":
            out.append(Text(f"  {t.remedy} (untested): try it: ", style="bold") + Text(t.command))
    if fixes.verified_code:
        out.append(Text("  apply it: ", style="bold green") + Text(fixes.verified_code))
    if fixes.code_change:
        out.append(Text("  code change: ", style="bold yellow") + Text(fixes.code_change))
    return out


def fixes_html(report: Any) -> str:
    fixes = report.fixes
    if fixes is None:
        return ""
    rows = "".join("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in _cells(t))
                   + f"<td><code>{escape(t.command)}</code></td></tr>" for t in fixes.tries)
    reasons = "".join(f"<p><b>{escape(t.remedy)} ({escape(t.status)}):</b> {escape(t.reason)}</p>"
                      for t in fixes.tries if t.reason)
    code = f"<pre><code>{escape(fixes.verified_code)}</code></pre>" if fixes.verified_code else ""
    if fixes.code_change:
        code += f"<p><b>code change:</b> {escape(fixes.code_change)}</p>"
    head = "".join(f"<th>{escape(c)}</th>" for c in (*COLUMNS, "command"))
    return (f"<section id=\"fixes\"><h2>fixes tried on your script</h2><p class=\"headline\">{escape(fixes.headline)}"
            f"</p>{code}<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>{reasons}</section>")
