"""Terminal rendering of an audit document (formatting only: every number comes from result.py).

    render_audit(doc, console)
    ╭ ac-diff audit: 2 decision sites, 4 regions, noise abs:0.001 x 3 seeds ╮
    site                          op      dtype rows  ≤1ulp ≤4ulp ≤16ulp min ulps  margins (0 … >1k ulps)  flips/row  model   if it flips
    layers.0.moe.router (tiny_moe.py:81) topk f32   512   0%    0%    0%     1759   ▁▁▁▁▁▁▁█               0.018      0.019   CheckpointError
    at 8192 tokens x 48 layers: expect about 3.1 decision flips per step ... CheckpointError almost certain
    fix: save aten.topk.default (6.0 KiB per region): 0 flips in 12 replays with it
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..oprules import packet
from ..render.units import byte_size

_BARS = "▁▂▃▄▅▆▇█"
MAX_DIVERGED_SHOWN = 4


def sparkline(counts: list[int]) -> str:
    top = max(counts) if counts else 0
    if not top:
        return " " * len(counts)
    return "".join(" " if c == 0 else _BARS[min(len(_BARS) - 1, int((len(_BARS) - 1) * c / top + 0.5))] for c in counts)


def _pct(x) -> str:
    """A share in whole percent; one that is not 0 never rounds to "0%" (two tied rows of 512 are "<1%")."""
    if x is None:
        return "-"
    return "<1%" if 0 < x < 0.005 else f"{100 * x:.0f}%"


def _rate(x) -> str:
    return "-" if x is None else ("0" if x == 0 else f"{x:.2g}")


_CONSEQUENCE = {"CheckpointError": "error", "silent": "silent", "unknown": "?"}


def _consequence(site: dict) -> str:
    """What a flip does, as the table says it: "error" / "silent", with the share of flips that changed a saved shape
    where some did and some did not ("silent (40% error)")."""
    label = _CONSEQUENCE.get(site["consequence"], site["consequence"])
    share = site.get("shape_share")
    return f"{label} ({share:.0%} error)" if share is not None and 0 < share < 1 else label


def _table(columns: tuple, rows: list[tuple], width: int) -> Table:
    """One row per site; narrower than the table (a narrow terminal), each site on a line of its own with its
    numbers under it: rich would cut the module names first."""
    needed = sum(max(len(c), *(len(r[i]) for r in rows)) + 1 for i, (c, _) in enumerate(columns)) if rows else 0
    if needed <= width:
        table = Table(box=None, pad_edge=False, show_edge=False, header_style="bold")
        for col, just in columns:
            table.add_column(col, justify=just, no_wrap=True)
        for row in rows:
            table.add_row(*row)
        return table
    table = Table.grid(padding=(0, 0))
    for row in rows:
        table.add_row(Text(f"{row[0]}  {row[1]}", style="bold"))
        table.add_row(Text("  " + ", ".join(f"{c}: {v}" for (c, _), v in zip(columns[2:], row[2:]))))
    return table


def render_audit(doc: dict, console: Console) -> None:
    a = doc["audit"]
    sites = a["sites"]
    scored = [s for s in sites if s["kind"]]
    title = (f"ac-diff audit: {len(scored)} decision sites with margins, {a['regions_audited']} of "
             f"{a['regions_seen']} regions replayed, noise {a['noise']} x {a['seeds']} seeds")
    columns = (("site", "left"), ("op", "left"), ("rows", "right"), ("% ≤1/4/16ulp", "right"), ("min ulp", "right"),
               ("margins", "left"), ("P(flip) seen", "right"), ("predicted", "right"), ("a flip", "left"))
    rows = []
    for s in scored:
        m = s["margins"] or {}
        shares = "/".join(_pct(m.get(k)).rstrip("%") for k in ("within_1ulp", "within_4ulp", "within_16ulp"))
        rows.append((s["module"], packet(s["op"]), str(s["rows"]), shares,
                     "exact" if m.get("exact") else "-" if m.get("min_ulps") is None else f"{m['min_ulps']:.3g}",
                     sparkline(m.get("histogram") or []), _rate(s["observed_rate"]), _rate(s["rate"]),
                     _consequence(s)))
    table = _table(columns, rows, console.width)
    follow = [s for s in sites if not s["kind"] and any(s["flips_per_seed"])]
    lines = [Text("margins: a histogram over 0, ≤1, ≤4, ≤16, ≤64, ≤256, ≤1k, >1k ulps; predicted: P(flip) per row from "
                  "the flips seen, the margins and their density near zero; a flip: what it does to the saved tensors "
                  "(error: their shapes change, torch raises CheckpointError; silent: values only)", style="dim")]
    lines += [Text(f"  {s['module']} {s['op']} at {s['source']} (noise into {s['noise_into']})"
                   + (f"; the decision {s['same_as']} makes, on the same scores: counted once" if s.get("same_as")
                      else ""), style="dim") for s in scored]
    lines.append(Text(a["extrapolation"]["headline"], style="bold"))
    if a["recompute"].get("state_note") and not a["recompute"]["headline"]:
        lines.append(Text(f"but {a['recompute']['state_note']}", style="bold yellow"))
    for k in a["extrapolation"]["kinds"]:
        lines.append(Text(f"  {k['site']}: P(flip)/row {k['p_flip_per_row']:.2g} x {k['rows_per_call']:.0f} rows"
                          f"{'' if k['tokens_factor'] == 1 else ' x %.3g (tokens)' % k['tokens_factor']} x "
                          f"{k['layers']} layers -> {k['expected_flips_per_step']:.2g} per step ({k['consequence']})"))
    if follow:
        lines.append(Text("flipped with them (fed by a decision above): "
                          + ", ".join(f"{s['module']} {packet(s['op'])}" for s in follow)))
    r = a["remedy"]
    if r["save_list"]:
        refused = "; ".join(f"the forward writes {op}'s output in place ({how})" for op, how in
                            (r.get("refused") or {}).items())
        state = (f"selective AC would refuse it: {refused}, and a cached tensor must not change (\"has been mutated\"):"
                 " make that update out of place (`x = x / s`, not `x /= s`) or save the op after it" if refused else
                 f"0 flips in {r['replays_with_save_list']} noisy replays with it (the stress noise alone flips "
                 f"{r['stress_flips_without_save_list']} rows)" if r["verified"]
                 else f"still {r['flips_with_save_list']} flips with it")
        # (the run diverges already: a save list guards the decisions against rounding, not against what the
        # recompute reads otherwise)
        ahead = ("against rounding noise only, not the divergence above (`ac-diff run` explains that one): "
                 if a["recompute"].get("headline") else "")
        lines.append(Text(f"fix: {ahead}save {', '.join(r['save_list'])} with selective AC "
                          f"({byte_size(r['bytes_per_region'])} per region): {state}",
                          style="green" if r["verified"] and not ahead else "yellow"))
    lines.append(Text(f"cost: {a['audit_seconds']:.2f} s of replays in a {a['wall_seconds']:.2f} s run "
                      f"(--max-regions {a['max_regions']}, --seeds {a['seeds']})", style="dim"))
    for note in a["notes"]:
        lines.append(Text(f"note: {note}", style="yellow"))
    body = Table.grid()
    body.add_row(table if scored else Text("no discrete decision fed by floating scores ran in the audited regions"))
    for line in lines:
        body.add_row(line)
    diverged = a["recompute"]
    if diverged["headline"]:  # the run diverges already: that comes before any prediction
        console.print(Text(diverged["headline"], style="bold red"))
        for r in diverged["diverged"][:MAX_DIVERGED_SHOWN]:
            console.print(Text(f"  region {r['region']} ({r['module']}): {r['detail']}", style="red"))
        more = diverged["diverged_count"] - min(len(diverged["diverged"]), MAX_DIVERGED_SHOWN)
        if more > 0:
            console.print(Text(f"  ... {more} more in the JSON (--json)", style="dim"))
    console.print(Text(title, style="bold"))
    console.print(body)
