"""`ac-diff audit [opts] SCRIPT [ARGS...]` / `-m MODULE`: how close each discrete decision is to flipping.

Runs the target as python would (and under torchrun, on every rank) with the auditor on, then prints
the fragility table, the risk at the target scale and the verified save list (rank 0), and writes
the JSON `audit` section with --json, and the audit in --format to --report FILE (html: OUT/audit.html by
default). Exit code: the script's own; with --check, 1 when the script succeeded but a region's recompute already
differs from its forward, or a shape-changing flip (a CheckpointError) is predicted at --scale; 4 when nothing was
audited.

    ac-diff audit --scale tokens=8192,layers=48 --json audit.json train.py --steps 2
    ac-diff audit --format html -o out train.py        # out/audit.html
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import time
from pathlib import Path

from rich.console import Console

from ..audit.engine import Auditor, AuditSettings
from ..audit.extrapolate import parse_scale
from ..audit.html import audit_html
from ..audit.noise import parse_noise
from ..audit.render import render_audit
from ..audit.result import audit_document
from ..capture.runner import check_target, run_target
from . import launch_cmd as launch
from .common import EXIT_DIVERGED, EXIT_UNCHECKED, console, format_of


def _terminal_text(doc: dict) -> str:
    """The terminal table as plain text (for a --report FILE that is not .json / .html)."""
    plain = Console(record=True, width=120, file=io.StringIO(), color_system=None)
    render_audit(doc, plain)
    return plain.export_text()


# what each --format writes: the audit document as text
_TEXT = {"json": lambda doc: json.dumps(doc, indent=1), "html": audit_html, "terminal": _terminal_text}


def audit_command(target: str, args: list[str], *, module: bool, noise: str, seeds: int, max_regions: int,
                  scale: str | None, check: bool, fmt: str, json_path: str | None, html_path: str | None = None,
                  discrete_ops: frozenset = frozenset(), report_path: str | None = None) -> int:
    """`report_path` gets the audit in `fmt` (terminal text, json or html; the terminal table is then printed as
    well), `json_path` the JSON and `html_path` the HTML page besides; without a file, `fmt` goes to stdout."""
    spec, target_scale = parse_noise(noise), parse_scale(scale)  # bad values: one line, exit 2 (cli)
    check_target(target, module)
    auditor = Auditor(AuditSettings(spec, seeds=seeds, max_regions=max_regions, discrete_ops=discrete_ops))
    multi = launch.is_multi_rank()
    start = time.perf_counter()
    with launch.sigterm_as_exit() if multi else contextlib.nullcontext():
        outcome = run_target(target, args, module=module, recorder=auditor)
    doc = audit_document(auditor, target_scale, target=target, wall_seconds=time.perf_counter() - start,
                         exit_code=outcome.exit_code, script=[*(["-m"] if module else []), target, *args])
    rank = launch.rank()
    if report_path and fmt == "terminal":
        fmt = format_of(report_path)
    for given, kind in ((json_path, "json"), (html_path, "html"), (report_path, fmt)):
        if given:
            path = Path(given)
            if multi:  # one file per rank: audit.json -> audit-rank1.json
                path = path.with_name(f"{path.stem}-rank{rank}{path.suffix}")
            path.write_text(_TEXT[kind](doc), encoding="utf-8")
            print(f"ac-diff: audit {kind.upper() if kind != 'terminal' else 'report'} written to {path}",
                  file=sys.stderr)
    if rank == 0:
        if fmt == "terminal" or report_path:
            render_audit(doc, console())
        else:
            print(_TEXT[fmt](doc))
    elif multi:  # rank 0 prints its table; every other rank its headline, which may differ (a rank's own data path)
        print(f"[rank{rank}] ac-diff audit: {doc['audit']['headline']}", file=sys.stderr)
    audit = doc["audit"]
    diverges_now = bool((audit.get("recompute") or {}).get("diverged_count"))
    if check and outcome.exit_code == 0 and (diverges_now or audit["extrapolation"]["check_failed"]):
        return EXIT_DIVERGED
    if check and outcome.exit_code == 0 and audit["extrapolation"]["unchecked"]:
        return EXIT_UNCHECKED  # nothing audited: never a pass
    return outcome.exit_code


def launch_audit(nproc: int, argv: list[str]) -> int:
    """`ac-diff audit --nproc-per-node N ...`: the audit under torchrun, N local ranks (rank 0 prints its table, the
    others their headlines; each writes its own JSON); torchrun's exit code."""
    from ..children import child_command

    child = child_command(["-m", "ac_diff", "audit", *argv], nproc=nproc)
    print(f"ac-diff: launching {nproc} processes with torchrun: {' '.join(child.argv[1:])}", file=sys.stderr)
    sys.stderr.flush()
    return child.signalled(child.run())
