"""`ac-diff fix [opts] SCRIPT [ARGS...]` / `-m MODULE`: try each remedy on the user's own script.

    ac-diff fix -o out --steps 3 train.py --lr 3e-4
    fixes tried on your script: verified: preserve_rng_state=True - every region clean, gradients bit-identical ...
     remedy                  status        regions diverged   gradients vs no-AC run   extra memory     wall time
     preserve_rng_state=True verified      4 -> 0             bit-identical            +0 B/region      6.1 s
     no AC in layers.0       did not help  4 -> 2             ...

Steps: one recorded run (OUT/base) and one run without AC (OUT/reference), both capturing the first
--steps backward passes' gradients (a try with deterministic algorithms is compared with a run without AC that
uses them too, OUT/reference-deterministic); candidate remedies for the diagnosed causes (fix/candidates.py),
cheapest first, at most --max-tries, stopping at the first verified one that keeps AC (with --jobs 1);
each try is `ac-diff run <remedy options>` in its own process (OUT/try-N, same arguments, environment and
seeds), --jobs at a time. With --nproc-per-node N every run is `ac-diff run --nproc-per-node N` and the run
without AC is a torchrun of N ranks too. The report is the base run's, with
a `fixes` section and every suggestion's status. Where the base run's AC ran inside compiled graphs (nothing recorded,
remedies would not reach it), the base run, the run without AC and every try run compiled code eagerly
(`--compiled eager`), and the compiled run's headline is kept as the report's first note. Exit 0 when a remedy that keeps AC was verified (or nothing needed
fixing), 1 when none was (turning AC off for the regions, verified or not, is not such a remedy).
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..capture.compiled import COMPILED_ENV, eager_requested
from ..children import child_command, share_stdin
from ..diagnosis import Settings, diagnose
from ..diagnosis.suggest import LOUDER
from ..report import DIVERGED, UNCHECKED
from ..diagnosis.compiled import unrecorded
from ..fix.ac_only import fails_only_with_ac
from ..fix.candidates import candidates, combined
from ..fix.forms import code_for
from ..fix.memory import extra_bytes_per_region
from ..fix.result import CRASHED, DID_NOT_HELP, UNTESTED, UNVERIFIED, VERIFIED, FixResult, Try
from ..fix.statuses import mark, run_command
from ..fix.tries import REACH_MAX, Measured, diverged, first_recomputed_in, judge, reach, run_measured, without_ac_too
from ..reference.explain import attach
from ..reference.result import DIFFERS, IDENTICAL
from ..reference.run import reference_command, reference_result
from ..remedies import RemedySpec
from ..capture.runner import check_target
from ..trace import read_run
from .common import EXIT_CLEAN, EXIT_DIVERGED, emit, fail, verdict_code
from .run_extras import CAPTURE_ENV, applied_remedies

ORDER = {VERIFIED: 0, UNVERIFIED: 1, DID_NOT_HELP: 2, CRASHED: 3, UNTESTED: 4}


def _report_of(directory: Path, settings: Settings) -> tuple[Any, Any] | tuple[None, None]:
    """(the report of every rank, rank 0's run) of a recorded directory; (None, None) without rank 0's trace."""
    if not (directory / "trace-rank0.jsonl").exists():
        return None, None
    try:
        runs = [read_run(path, lazy=True) for path in sorted(directory.glob("trace-rank*.jsonl"))]
        return diagnose(runs, settings), next(r for r in runs if int(r.header.get("rank", 0) or 0) == 0)
    except Exception:  # a trace the try could not finish: judged as crashed
        return None, None


def fix_command(target: str, args: list[str], *, module: bool, output_dir: str, max_tries: int,
                max_regions: int | None, steps: int, jobs: int, fmt: str, json_path: str | None,
                output: str | None, settings: Settings, nproc: int = 0) -> int:
    check_target(target, module)
    share_stdin()  # (every try runs the script again)
    if max_tries < 0 or steps < 1 or jobs < 1 or nproc < 0:
        return fail("--max-tries must be >= 0, --steps, --jobs and --nproc-per-node >= 1")
    out = Path(output_dir)
    for stale in [out / "base", out / "reference", out / "reference-deterministic", *out.glob("try-*")]:
        shutil.rmtree(stale, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    capture = {CAPTURE_ENV: str(steps)}  # every run's environment: children.py's, and this
    tail = [*(["-m"] if module else []), target, *args]
    # every region's ops and saved positions: a try's extra memory is read from them (fix/memory.py), and a summarized
    # clean region (the default --write diverged) has none; fix runs a few steps, so the traces stay small
    run = ["-m", "ac_diff", "run", "--force", "--write", "all",
           *(["--nproc-per-node", str(nproc)] if nproc else [])]
    print(f"ac-diff fix: recording one run and one run without AC of {' '.join(tail)}", file=sys.stderr)
    references: dict[bool, tuple[Path, Measured, str]] = {}
    lock = threading.Lock()

    def reference(deterministic: bool) -> tuple[Path, Measured, str]:
        """(directory, measured, command) of the run without AC, with deterministic algorithms where the try uses
        them (its kernels then match the try's); each one run once."""
        with lock:
            if deterministic not in references:
                directory = out / ("reference-deterministic" if deterministic else "reference")
                # the reference's ranks: a torchrun of their own, started like the launcher's (children.py)
                child, text = reference_command(target, args, module=module, directory=directory, steps=try_steps,
                                                spec=RemedySpec(deterministic=deterministic),
                                                nproc=nproc)
                references[deterministic] = directory, run_measured(child, out / f"{directory.name}.log"), text
            return references[deterministic]

    compiled_run = None
    while True:
        base_m = run_measured(child_command([*run, "-o", str(out / "base"), *tail], extra=capture), out / "base.log")
        report, base_run = _report_of(out / "base", settings)
        if report is None:
            return fail(f"the script did not start the recorder (exit {base_m.code}): {base_m.last_line()} "
                        f"(see {out / 'base.log'})")
        try_steps = reach(report, steps)
        if try_steps > steps:
            first = first_recomputed_in(report)
            print(f"ac-diff fix: the first divergence is in backward {first}: each try compares "
                  + (f"{try_steps} backward passes with the run without AC" if try_steps >= first else
                     f"the first {try_steps} backward passes (at most {REACH_MAX}) with the run without AC, before it: "
                     "a try's regions show whether it matched, its gradients do not reach that far"), file=sys.stderr)
        ref_dir, ref_m, ref_text = reference(False)
        ranks = sorted({r.rank for r in report.regions}) or [0]
        attach(report, reference_result(report, out / "base", ranks, steps, ref_m.code, ref_text,
                                         reference_dir=ref_dir))
        if eager_requested() or not unrecorded(report.compiled):
            break
        if report.reference is not None and report.reference.verdict == IDENTICAL:
            break  # (the compiled run's gradients match: what the eager program would do is not what it trains)
        # AC inside compiled graphs: remedies need regions, so from here on every run runs compiled code eagerly
        print("ac-diff fix: AC runs inside compiled graphs; recording again with compiled code run eagerly "
              "(--compiled eager), as the run without AC and every try will", file=sys.stderr)
        compiled_run = f"the compiled run (before --compiled eager): {report.headline}"
        os.environ[COMPILED_ENV] = "eager"  # (every child's environment starts from this one's)
        references.clear()
    if compiled_run:
        report.notes.insert(0, compiled_run)
    ac_only = fails_only_with_ac(base_m, out / "base", ref_m, ref_dir)  # a checkpointing defect, named or not
    found = candidates(report, max_regions, failed_with_ac=ac_only)
    before = diverged(report)
    culprits = frozenset([*(r.cause.tensor for r in report.regions if r.cause is not None and r.cause.tensor),
                          *(name for r in report.regions for name in r.read_into)])
    tries = [Try(c.name, c.spec.cli_args(), c.why, regions_before=before,
                 command=run_command(c.spec.cli_args(), target, args, module, nproc)) for c in found]

    reports: dict[int, Any] = {}  # each try's report: what it still diagnosed

    def one(i: int) -> None:
        c, t = found[i], tries[i]
        print(f"ac-diff fix: try {i + 1}/{min(len(found), max_tries)}: {c.name}", file=sys.stderr)
        d = out / f"try-{i + 1}"
        m = run_measured(child_command([*run, "-o", str(d), *t.args, *tail], extra={CAPTURE_ENV: str(try_steps)}),
                         out / f"try-{i + 1}.log")
        r, rank0 = _report_of(d, settings)
        reports[i] = r
        try_dir, try_m, try_text = reference(c.spec.deterministic)
        ref = reference_result(r, d, ranks, try_steps, try_m.code, try_text, reference_dir=try_dir) \
            if r is not None else None
        judge(t, r, ref, m, base_m, c.op,
              extra_bytes_per_region(rank0, base_run, c.spec.no_ac) if rank0 is not None else None,
              culprits | c.repeats)
        if c.kind == "no_ac":
            without_ac_too(t, report, c.spec.no_ac)
            applied = applied_remedies({rank: d for rank in ranks})
            if r is not None and not any(row.get("remedy") == "no_ac" and row.get("calls") for row in applied):
                t.status, t.gradients = DID_NOT_HELP, "not compared"
                t.reason = (f"not applied: --no-ac {' '.join(c.spec.no_ac)} matched no checkpoint call (the regions "
                            "ran with AC as before)")

    budget = range(min(len(found), max_tries))
    if jobs == 1:  # cheapest first; a verified remedy that keeps AC ends the search (the rest stay untested)
        for i in budget:
            one(i)
            # (a verified save is a workaround that costs memory: the restore after it simulates the code change)
            if tries[i].status == VERIFIED and found[i].kind != "no_ac" and not (
                    found[i].kind == "must_save" and any(c.kind == "restore" for c in found[i + 1:])):
                break
    else:
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            list(pool.map(one, budget))
    ran = [i for i in budget if tries[i].status != UNTESTED]
    keeps_ac = any(tries[i].status == VERIFIED and found[i].kind != "no_ac" for i in ran)
    together = None
    if not keeps_ac and len(ran) < max_tries:  # two causes in one block: their remedies, tried together
        together = combined([found[i] for i in ran], [tries[i].status == DID_NOT_HELP for i in ran],
                            [reports.get(i) for i in ran])
    if together is not None:
        found.append(together)
        tries.append(Try(together.name, together.spec.cli_args(), together.why, regions_before=before,
                         command=run_command(together.spec.cli_args(), target, args, module, nproc)))
        one(len(found) - 1)
    result = _result(report, found, tries, base_m, time.perf_counter() - started, ac_only)
    report.fixes = result
    mark(report, target, args, module, list(zip(found, tries)), nproc)
    emit(report, fmt, json_path, output)
    if not result.keeps_ac and not found and report.verdict == UNCHECKED and (
            report.reference is None or report.reference.verdict != IDENTICAL):
        return verdict_code(report)  # (nothing was compared, not even the gradients: not "nothing to fix")
    return EXIT_CLEAN if result.keeps_ac or (not found and not report.diverged and not ac_only) else EXIT_DIVERGED


def _result(report: Any, found: list, tries: list[Try], base: Measured, total: float,
            ac_only: bool = False) -> FixResult:
    pairs = sorted(zip(found, tries), key=lambda p: ORDER[p[1].status])
    result = FixResult(headline="", tries=[t for _, t in pairs], baseline_wall_s=base.wall_s, total_wall_s=total)
    verified = [(c, t) for c, t in pairs if t.status == VERIFIED]
    # the code change a restore simulates leads a save that also worked (selective AC keeps more memory)
    keeps_ac = sorted([(c, t) for c, t in verified if c.kind != "no_ac"], key=lambda ct: ct[0].kind != "restore")
    # the diverged regions' code change first (a clean region's is for an update its recompute repeats)
    change = next((s.title + ": " + s.text for r in sorted(report.regions, key=lambda r: r.status != DIVERGED)
                   for s in r.suggestions if s.title != LOUDER), None)
    ref = report.reference
    if not found:
        if ac_only and not report.diverged:
            result.headline = (f"the script fails only with AC (exit {base.code}: {base.last_line()}) while the run "
                               "without AC passed: a checkpointing defect ac-diff could not name; see " + str(base.log))
        elif base.code != 0 and not report.diverged:
            result.headline = (f"the script failed on its own (exit {base.code}: {base.last_line()}), before any "
                               "remedy could be tried; see " + str(base.log))
        elif report.diverged:
            result.headline = "no mechanical remedy applies to what was diagnosed" + (
                "; make the code change below" if change else ", and ac-diff knows no code change for it")
            result.code_change = change
        elif unrecorded(report.compiled) and ref is not None and ref.verdict == IDENTICAL:
            result.headline = (f"nothing to fix: the compiled run's gradients match the run without AC over "
                               f"{ref.backwards} backward pass(es) (AC runs inside compiled graphs, where ac-diff "
                               "records no region; `ac-diff run --compiled eager` shows what the eager program does)")
        else:
            result.headline = ("nothing to fix: every region reproduced its forward"
                               + (f" and the gradients match the run without AC over {ref.backwards} backward "
                                  "pass(es)" if ref is not None and ref.verdict == IDENTICAL else
                                  f" (the gradients were not compared: {ref.headline})" if ref is not None
                                  and not ref.defect else ""))
        return result
    if keeps_ac:
        c, t = keeps_ac[0]
        result.verified, result.verified_code, result.keeps_ac = c.name, code_for(c), True
        n = len(tries) - sum(t.status == UNTESTED for t in tries)
        stopped = f", and the recompute no longer updates {', '.join(sorted(c.repeats)[:3])} again" if c.repeats else ""
        result.headline = (f"verified: {c.name} - every region clean, gradients bit-identical to the run without AC"
                           f"{stopped} ({n} remed{'y' if n == 1 else 'ies'} tried)"
                           + ("; a simulation of a code change: make the change below" if c.kind == "restore" else ""))
    elif verified:
        c, t = verified[0]
        result.verified, result.verified_code = c.name, code_for(c)
        result.code_change = change
        result.headline = (f"only turning AC off works ({c.name}): no remedy that keeps AC made the recompute match"
                           + ("; the code change below keeps AC" if change else
                              ", and ac-diff knows no code change that keeps AC for what it diagnosed"))
    else:
        result.code_change = change
        open_ = next((c for c, t in pairs if t.status == UNVERIFIED), None)
        result.headline = (
            f"not verified: {open_.name} made every region clean, but the run without AC finished no backward to "
            "compare the gradients with (it fails where AC hid the error)" if open_ is not None else
            "no remedy tried made every region clean with gradients bit-identical to the run without AC"
        ) + ("; make the code change below" if change else "")
    if ref is not None and ref.verdict == DIFFERS and not verified:
        result.headline += f" (before: {ref.headline})"
    return result
