"""`ac-diff audit [opts] SCRIPT [ARGS...]` / `-m MODULE`: how close each discrete decision is to flipping.

Runs the target as python would (and under torchrun, on every rank) with the auditor on, then prints
the fragility table, the risk at the target scale and the verified save list (rank 0), and writes
the JSON `audit` section with --json. Exit code: the script's own; with --check, 1 when the script
succeeded but a shape-changing flip (a CheckpointError) is predicted at --scale.

    ac-diff audit --scale tokens=8192,layers=48 --json audit.json train.py --steps 2
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path

from ..audit.engine import Auditor, AuditSettings
from ..audit.extrapolate import parse_scale
from ..audit.html import audit_html
from ..audit.noise import parse_noise
from ..audit.render import render_audit
from ..audit.result import audit_document
from ..capture.runner import check_target, run_target
from . import launch_cmd as launch
from .common import EXIT_DIVERGED, console


def audit_command(target: str, args: list[str], *, module: bool, noise: str, seeds: int, max_regions: int,
                  scale: str | None, check: bool, fmt: str, json_path: str | None, html_path: str | None = None,
                  discrete_ops: frozenset = frozenset()) -> int:
    spec, target_scale = parse_noise(noise), parse_scale(scale)  # bad values: one line, exit 2 (cli)
    check_target(target, module)
    auditor = Auditor(AuditSettings(spec, seeds=seeds, max_regions=max_regions, discrete_ops=discrete_ops))
    multi = launch.is_multi_rank()
    start = time.perf_counter()
    with launch.sigterm_as_exit() if multi else contextlib.nullcontext():
        outcome = run_target(target, args, module=module, recorder=auditor)
    doc = audit_document(auditor, target_scale, target=target, wall_seconds=time.perf_counter() - start,
                         exit_code=outcome.exit_code)
    rank = launch.rank()
    for given, what, text in ((json_path, "JSON", lambda: json.dumps(doc, indent=1)), (html_path, "HTML", lambda: audit_html(doc))):
        if given:
            path = Path(given)
            if multi:  # one file per rank: audit.json -> audit-rank1.json
                path = path.with_name(f"{path.stem}-rank{rank}{path.suffix}")
            path.write_text(text())
            print(f"ac-diff: audit {what} written to {path}", file=sys.stderr)
    if rank == 0:
        if fmt == "json":
            print(json.dumps(doc, indent=1))
        else:
            render_audit(doc, console())
    if check and outcome.exit_code == 0 and doc["audit"]["extrapolation"]["check_failed"]:
        return EXIT_DIVERGED
    return outcome.exit_code
