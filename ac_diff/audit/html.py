"""A self-contained HTML page of an audit document: the risk, the fix, and one margin plot per site.

    Path("audit.html").write_text(audit_html(doc))

Formatting only (every number comes from result.py); no script, no network: inline SVG bars of each
site's margin histogram (rows per ulp bin, the bins near a tie in red) beside its flip figures.
"""

from __future__ import annotations

from html import escape

_CSS = """body{font:14px system-ui,sans-serif;margin:2em;max-width:70em;color:#222}
h1{font-size:1.3em}.site{border:1px solid #ccc;border-radius:6px;padding:.8em;margin:1em 0;display:flex;gap:2em}
table{border-collapse:collapse}td{padding:1px 8px}td:first-child{color:#666}pre{background:#f6f6f6;padding:.6em}
.risk{font-weight:bold}.ok{color:#17713a}.bad{color:#a11}"""


def _plot(histogram: list[int], labels: list[str]) -> str:
    width, height, bar = 40 * len(histogram), 120, 30
    top = max(histogram) or 1
    parts = [f'<svg width="{width}" height="{height + 30}" role="img" aria-label="margins in ulps">']
    for i, (count, label) in enumerate(zip(histogram, labels)):
        h = 0 if not count else max(2, round(height * count / top))
        x = 40 * i + 5
        color = "#c33" if i <= 2 else "#4a7"
        parts.append(f'<rect x="{x}" y="{height - h}" width="{bar}" height="{h}" fill="{color}"><title>{count} rows '
                     f'at {escape(label)} ulps</title></rect>')
        parts.append(f'<text x="{x + bar / 2}" y="{height + 14}" font-size="10" text-anchor="middle">{escape(label)}</text>')
        parts.append(f'<text x="{x + bar / 2}" y="{max(10, height - h - 3)}" font-size="9" text-anchor="middle">{count}</text>')
    parts.append(f'<text x="0" y="{height + 28}" font-size="10">margin to a flip, in ulps of the score dtype</text></svg>')
    return "".join(parts)


def _fmt(x) -> str:
    return "-" if x is None else (f"{x:.3g}" if isinstance(x, float) else escape(str(x)))


def audit_html(doc: dict) -> str:
    a = doc["audit"]
    risk, remedy = a["extrapolation"], a["remedy"]
    out = [f"<!doctype html><meta charset=utf-8><title>ac-diff audit: {escape(a['target'])}</title><style>{_CSS}</style>",
           f"<h1>ac-diff audit of {escape(a['target'])}</h1>",
           *([f'<p class="risk bad">{escape(a["recompute"]["headline"])}</p>'] if a["recompute"]["headline"] else []),
           f"<p>noise {escape(a['noise'])} x {a['seeds']} seeds; {a['regions_audited']} of {a['regions_seen']} regions "
           f"replayed; {a['audit_seconds']:.2f} s of replays in a {a['wall_seconds']:.2f} s run</p>",
           f'<p class="risk {"bad" if risk["check_failed"] else "ok"}">{escape(risk["headline"])}</p>']
    if remedy["save_list"]:
        out.append(f'<p class="{"ok" if remedy["verified"] else "bad"}">fix: save {escape(", ".join(remedy["save_list"]))} '
                   f'({remedy["bytes_per_region"]} bytes per region); flips with it: {remedy["flips_with_save_list"]} in '
                   f'{remedy["replays_with_save_list"]} noisy replays</p><pre>{escape(remedy["policy"] or "")}</pre>')
        for op, how in (remedy.get("refused") or {}).items():
            out.append(f'<p class="bad">selective AC would refuse it: the forward writes {escape(op)}\'s output in '
                       f'place ({escape(how)}); make that update out of place or save the op after it</p>')
    for s in a["sites"]:
        if not s["kind"]:
            continue
        m = s["margins"]
        rows = [("source", s["source"]), ("noise into", s["noise_into"]), ("rows", s["rows"]), ("dtype", s["dtype"]),
                ("within 1 / 4 / 16 ulps", " / ".join(_fmt(m[k]) for k in ("within_1ulp", "within_4ulp", "within_16ulp"))),
                ("smallest margin (ulps)", m["min_ulps"]), ("flips per seed", s["flips_per_seed"]),
                ("P(flip) per row: seen / model / near-zero density", " / ".join(
                    _fmt(s[k]) for k in ("observed_rate", "model_rate", "tail_rate"))),
                ("a flip", s["consequence"])]
        table = "".join(f"<tr><td>{escape(k)}</td><td>{_fmt(v)}</td></tr>" for k, v in rows)
        out.append(f'<div class="site"><div><h2>{escape(s["module"])} {escape(s["op"])}</h2><table>{table}</table></div>'
                   f'<div>{_plot(m["histogram"], m["histogram_bins_ulps"])}</div></div>')
    for note in a["notes"]:
        out.append(f"<p>note: {escape(note)}</p>")
    return "\n".join(out) + "\n"
