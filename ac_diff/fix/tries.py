"""Run the script once per remedy, each in its own process, and judge the outcome.

    base = run_measured(child_command(["-m", "ac_diff", "run", ...]), log)   # -> Measured(wall_s, code, log)
    outcome = judge(try_, report_of_try, reference_result_of_try, measured, base_measured, op, extra_bytes)

A process is timed by a small wrapper process, so tries can run side by side without mixing their figures.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..children import Child, stdin_for_child
from ..report import recomputed_in
from ..report import DIVERGED, STATE_READ_AGAIN
from ..logs.errors import COUNT_MISMATCH, METADATA_MISMATCH, MORE_SAVED
from ..remedies.patch import MATCHED_NOTHING
from .result import CRASHED, DID_NOT_HELP, UNVERIFIED, VERIFIED, Try

NO_BACKWARD = "not compared (no backward finished)"  # (the run without AC: none to compare with)

_ERROR = re.compile(r"^[\w.]*(Error|Exception|Interrupt)\b.*:")
_WRAPPER = """
import json, subprocess, sys, time
t = time.perf_counter()
with open(sys.argv[1], "w") as log:
    code = subprocess.run(sys.argv[2:], stdout=log, stderr=subprocess.STDOUT).returncode
print(json.dumps({"wall_s": time.perf_counter() - t, "code": code}))
"""


@dataclass
class Measured:
    wall_s: float
    code: int
    log: Path

    def last_line(self) -> str:
        """The script's error (the last `SomeError: ...` line of its output), else its last line."""
        try:
            lines = [line.strip() for line in self.log.read_text(errors="replace").splitlines() if line.strip()]
        except OSError:
            return ""
        lines = [line for line in lines if not line.startswith("ac-diff:")]  # (ac-diff's own, "next: ...")
        errors = [line for line in lines if _ERROR.match(line)]
        return (errors or lines or [""])[-1]


# what torch raises where a recompute saved other tensors than its forward (not an error the remedy itself caused)
LOUD = frozenset({METADATA_MISMATCH, COUNT_MISMATCH, MORE_SAVED})


def run_measured(child: Child, log: Path, cwd: str | None = None) -> Measured:
    """Run `child` (children.py: its command and environment) timed, its output into `log`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with stdin_for_child() or contextlib.nullcontext() as stdin:
        proc = subprocess.run([sys.executable, "-c", _WRAPPER, str(log), *child.argv], env=child.env, cwd=cwd,
                              stdin=stdin, capture_output=True, text=True, check=False)
    try:
        data = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return Measured(0.0, proc.returncode or 1, log)
    return Measured(data["wall_s"], data["code"], log)


def diverged(report: Any) -> int:
    return sum(1 for r in report.regions if r.status == DIVERGED)


REACH_MAX = 32  # backward passes a try compares at most: each one's gradients are kept, in every run


def reach(report: Any, steps: int) -> int:
    """The backward passes each try compares with the run without AC: `steps`, or as many as reach the backward pass
    that recomputed the base run's first divergence (a schedule that crosses its threshold in backward 10), up to
    REACH_MAX; a try verified over fewer would leave the backward it is to fix uncompared."""
    return max(steps, min(first_recomputed_in(report), REACH_MAX))


def first_recomputed_in(report: Any) -> int:
    """The backward pass that recomputed the first diverged region (0: none)."""
    return min((n for r in report.regions if r.status == DIVERGED and (n := recomputed_in(r)) is not None), default=0)


def judge(t: Try, report: Any | None, reference: Any | None, m: Measured, base: Measured, op: str | None,
          extra_bytes: float | None = None, culprits: frozenset[str] = frozenset()) -> None:
    """Fill in the try's outcome: status, regions after, gradients, memory, wall time, reason. `culprits`: the
    tensors the base run's causes name; a try whose recompute still updates one of them a second time is not
    verified, however many backwards matched (the drift it causes can take more steps to show)."""
    t.wall_s = m.wall_s
    t.exit_code = m.code
    t.extra_bytes = extra_bytes
    if report is None:
        t.status, t.reason = CRASHED, f"no trace (exit {m.code}): {m.last_line()}"
        return
    t.regions_after = diverged(report)
    rows = report.remedies or []
    unmatched = [row["what"] for row in rows if str(row.get("what", "")).startswith(MATCHED_NOTHING)]
    if unmatched and not any(row.get("calls") for row in rows):  # (the run went as the base run did)
        t.status, t.gradients = DID_NOT_HELP, "not compared (not applied)"
        t.reason = f"not applied: the remedy {unmatched[0]}"
        return
    if reference is not None and reference.steps:
        step = next((s for s in reference.steps if s.differing), reference.steps[0])
        rels = [d.rel_diff for d in step.differing if d.rel_diff is not None]
        t.gradients = ("bit-identical" if not step.differing else
                       f"{len(step.differing)} of {step.parameters} differ"
                       + (f", max rel. diff {max(rels):.3g}" if rels else ""))
    elif reference is not None:
        t.gradients = NO_BACKWARD
    else:
        t.gradients = "not compared"
    if m.code != 0 and t.regions_after and report.torch_error is not None \
            and report.torch_error.kind in LOUD:  # (a silent divergence made loud: torch's check on the recompute)
        t.status = DID_NOT_HELP
        t.reason = (f"the recompute still differs, and torch now raises ({report.torch_error.kind}, exit {m.code}): "
                    + _reason(report, reference, op, m))
        return
    # (the script's own `sys.exit(n)`, as it ended without the remedy: how it ends, not a failure the remedy caused)
    own_exit = m.code != 0 and m.code == base.code and report.exit_status == "exit"
    if m.code != 0 and not own_exit and (base.code == 0 or (report.torch_error is None and not t.regions_after)):
        t.status, t.reason = CRASHED, f"the script failed under this remedy (exit {m.code}): {m.last_line()}"
        t.regions_after, t.gradients = None, "not compared (it crashed)"  # (what ran before the crash proves nothing)
        return
    if t.regions_after == 0 and t.gradients == NO_BACKWARD and (m.code == 0 or own_exit):
        t.status = UNVERIFIED
        t.reason = ("every recompute now matches its forward, but the run without AC finished no backward (it fails "
                    "where AC hid the error), so the gradients have nothing to be compared with: compare them with a "
                    "correct version of the script")
        return
    t.status = DID_NOT_HELP
    if t.regions_after == 0 and t.gradients == "bit-identical" and (m.code == 0 or own_exit):
        twice = sorted(report.repeated_updates() & culprits)
        read = next((r for r in report.regions if r.unchecked_reason == STATE_READ_AGAIN), None)
        if not twice and read is None:
            t.status = VERIFIED
            others = sorted(report.repeated_updates())
            if others:  # (a batch norm's statistics: harmless; a count a later update reads: a drift steps later)
                n = getattr(reference, "backwards", None) or len(reference.steps)
                t.reason = (f"verified over {n} backward pass(es); the recompute still updates "
                            f"{', '.join(others[:3])} a second time (counted twice): where a later step reads it (a "
                            "load-balancing update from token counts), compare more with `ac-diff fix --steps "
                            f"{n + 2}`")
            return
        t.reason = ("every recompute matches and the compared gradients too, but the recompute still updates "
                    + (f"{', '.join(twice[:3])} in place a second time (counted twice): the steps after start from "
                       "another state than without AC" if twice else
                       f"state that region {read.region} ({read.module}) reads a second time (`{read.cause.tensor}`): "
                       f"the steps after the {reference.backwards} compared compute with other values than without "
                       "AC"))
        return
    t.reason = _reason(report, reference, op, m)


def without_ac_too(t: Try, base: Any, no_ac: list[str]) -> None:
    """A verified "no AC" where the base run's parameters were updated in place between the forward and the backward
    (an EMA copied in through `.data`, weight clipping): the run without AC reads those parameters in its backward
    too (a matmul saves its weight as it is), so matching it proves nothing: not verified, and why."""
    from ..diagnosis.cause import OPTIMIZER_STEP
    from ..remedies.call import matches

    if t.status != VERIFIED or not any(r.cause is not None and r.cause.mechanism == OPTIMIZER_STEP
                                       and matches(r.module, no_ac) for r in base.regions):
        return
    t.status = DID_NOT_HELP
    t.reason = ("no recompute is left to differ, but the run without AC is wrong too: its backward reads the "
                "parameters as they were changed in place before it (ops save them as they are), so matching it "
                "proves nothing; change them after the backward (the code change below)")


def _reason(report: Any, reference: Any | None, op: str | None, m: Measured) -> str:
    still = [r for r in report.regions if r.status == DIVERGED]
    if still:
        r = still[0]
        first = r.first_divergence()
        where = f"{first.op} in {first.module or r.module}" + (f" ({first.source})" if first.source else "") \
            if first else "its recompute"
        cause = f"{r.cause.kind}" + (f": {r.cause.tensor}" if r.cause and r.cause.tensor else "") if r.cause else "?"
        grads = "; the gradients do match the run without AC" if reference is not None and reference.steps and \
            not any(s.differing for s in reference.steps) else ""
        if op and first is not None and first.op != op:
            return (f"{op} saved, but its input already differed: region {r.region} ({r.module}) still diverges, "
                    f"first at {where} ({cause}); {len(still)} region(s) still diverge{grads}")
        return f"{len(still)} region(s) still diverge; first region {r.region} ({r.module}) at {where} ({cause}){grads}"
    if m.code != 0:
        return f"the script failed (exit {m.code}): {m.last_line()}"
    if reference is not None and reference.defect:
        return "every recompute matches, but the gradients still differ from the run without AC: " + reference.headline
    return "the gradients could not be compared with the run without AC"
