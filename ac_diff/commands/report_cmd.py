"""`ac-diff report PATH...`: re-render the diagnosis from traces (files or directories) or logs.

    ac-diff report ac-diff-out                 # terminal report; exit 0 clean, 1 diverged, 2 bad input
    ac-diff report ac-diff-out --json r.json   # also the versioned JSON report
    ac-diff report node0-out node1-out         # one run's ranks, copied together from several nodes: one report

What `ac-diff run` left beside the traces comes back too: the remedies it applied, its comparison with the reference
(`--reference no-ac`: the gradients in DIR and DIR/reference).

A rank of one run found in several of the paths (rank 0's directory holds the copies the other nodes sent it,
each node's directory the full traces) is read once, from its most complete trace: finished and not cut first.
"""

from __future__ import annotations

import time
from pathlib import Path

from ..api import read_runs
from ..diagnosis import diagnose
from ..errors import InputError
from ..fix.statuses import mark_from_runs
from ..passes import Run
from ..reference.paths import grads_path
from .common import emit
from .run_extras import decorate_from_outputs


def report_command(paths: list[str], fmt: str, json_path: str | None, output: str | None, settings) -> int:
    runs, stale = latest_run(read_runs(paths, lazy=True))
    dirs = output_dirs(runs)
    runs, notes = one_trace_per_rank(runs)
    notes = stale + notes
    report = diagnose(runs, settings)
    report.notes += notes
    mark_from_runs(report, runs)  # every suggestion: untested, and the command that would verify it
    decorate_from_outputs(report, dirs)  # remedies applied, the reference
    return emit(report, fmt, json_path, output)


def output_dirs(runs: list[Run]) -> dict[int, Path]:
    """Each rank's directory: where a copy of its trace is that holds its own outputs (its gradients, for the
    reference) too. A node's copy of another node's trace, received without a shared filesystem, holds only that."""
    dirs: dict[int, Path] = {}
    for run in runs:
        if run.source != "trace" or not run.path:
            continue
        r, d = run.rank or 0, Path(run.path).parent
        if r not in dirs or not grads_path(dirs[r], r).exists() and grads_path(d, r).exists():
            dirs[r] = d
    return dirs


def latest_run(runs: list[Run]) -> tuple[list[Run], list[str]]:
    """The traces of the latest launch where the paths hold the same ranks from several launches of one command (a
    directory a relaunch did not clear: with torchrun's c10d rendezvous a node's ranks change from launch to launch,
    so this node's new ranks do not overwrite its old ones), and a line for each trace left out. Launches of other
    commands (two scripts' traces, a stale one beside) are no relaunch: InputError, never one picked silently."""
    launches: dict[str, list[Run]] = {}
    for run in runs:
        if run.source == "trace" and launch_of(run):
            launches.setdefault(launch_of(run), []).append(run)
    if len(launches) < 2:
        return runs, []
    ranks = [{r.rank or 0 for r in group} for group in launches.values()]
    if not any(a & b for i, a in enumerate(ranks) for b in ranks[i + 1:]):
        return runs, []  # (no rank twice: what they are, the mixed-runs finding says)
    commands: dict[tuple, Run] = {}  # the command each launch ran -> a trace of it
    for group in launches.values():
        for r in group:
            commands.setdefault(tuple(r.argv or ()), r)
    if len(commands) > 1:  # (not a relaunch of one job: runs of other scripts or arguments, a stale trace beside)
        shown = "; ".join(f"{commands[c].path}: {' '.join(c) or '?'}" for c in sorted(commands))
        raise InputError(f"the paths hold traces of {len(commands)} different runs ({shown}), the same rank in several:"
                         " report each on its own (`ac-diff report DIR`), or compare two with `ac-diff compare A B`")
    latest = max(launches, key=lambda rid: max(r.start_time or 0.0 for r in launches[rid]))
    left = [r for rid, group in launches.items() if rid != latest for r in group]
    out = {id(r) for r in left}
    return [r for r in runs if id(r) not in out], [
        f"left out {r.path} (rank {r.rank or 0} of an earlier launch, run {launch_of(r)}): the paths hold ranks of "
        f"{len(launches)} launches, and the latest, run {latest}, is reported" for r in left]


def launch_of(run: Run) -> str | None:
    """The launch a trace belongs to: its run id (torchrun); a single process's, which has none, its process (pid on
    host, started at); None for a rank of another launcher (its ranks cannot be told apart from another launch's)."""
    if run.run_id:
        return str(run.run_id)
    header = run.header or {}
    if run.world_size == 1 and header.get("pid") is not None:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(run.start_time or 0))
        return f"pid {header['pid']} on {header.get('host', '?')}, started {started}"
    return None


def one_trace_per_rank(runs: list[Run]) -> tuple[list[Run], list[str]]:
    """One trace per rank of each run (traces with a run id), the most complete where several are given: finished
    before unfinished, whole before cut (rank_exchange.trace_bytes), else the first given. Also what was left out
    for being less complete than another copy, one line each."""
    best: dict[tuple, Run] = {}
    for run in runs:
        key = (launch_of(run), run.rank or 0)
        if run.source != "trace" or not key[0]:
            continue
        if key not in best or _completeness(run) > _completeness(best[key]):
            best[key] = run
    kept, notes = [], []
    for run in runs:
        chosen = best.get((launch_of(run), run.rank or 0)) if run.source == "trace" and launch_of(run) else run
        if chosen is run:
            kept.append(run)
        elif _completeness(run) < _completeness(chosen):
            notes.append(f"rank {run.rank or 0}: read from {chosen.path}, not from {run.path} "
                         f"({'a cut copy' if run.header.get('cut') else 'unfinished'})")
    return kept, notes


def _completeness(run: Run) -> tuple[bool, bool]:
    return not run.truncated, not run.header.get("cut")
