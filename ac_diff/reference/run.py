"""Run the reference (AC off everywhere) after the recorded run, and compare their gradients.

    code, command = run_reference("train.py", ["--steps", "2"], module=False, output_dir="out", steps=1,
                                  spec=RemedySpec(deterministic=True))
    result = reference_result(report, "out", ranks=[0], steps=1, exit_code=code, command=command)
    # a first loss that differs: the two runs' first forwards compared op by op (forwards.py) say whether a kernel
    # gave other values from identical inputs, or the script's own randomness differed

The reference is a separate process: the same interpreter, arguments, working directory and environment,
plus the remedy "no AC anywhere" (and the run's other process-wide remedies, e.g. deterministic
algorithms). Under torchrun every rank starts its own reference rank; they meet on a fresh port that
rank 0 publishes in OUT/reference/port (ranks of one node share OUT), not on torchrun's agent store.
Its output goes to stderr, so a JSON report on stdout stays clean.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from ..children import Child, child_command
from ..commands.rank_exchange import OP_S, StoreUnavailable, bounded, job_store
from ..env import process_rank as rank, process_world_size
from ..errors import InputError
from ..diagnosis.compiled import reference_note
from ..diagnosis.labels import number_ranges
from ..report import DIVERGED, diverged_after, recomputed_in
from ..remedies import ENV, RemedySpec
from .graddiff import compare_captures
from .explain import explain
from .forwards import compare_first_forwards
from .grads import load_grads
from .result import DIFFERS, FAILED, IDENTICAL, NOT_COMPARABLE, ReferenceResult
from .paths import REFERENCE_DIR, grads_path, side_path, trace_path
from .session import COMPILED_ENV, DIR_ENV, STEPS_ENV, load_side, read_side

PORT_WAIT_S = 120.0


def reference_spec(spec: RemedySpec) -> RemedySpec:
    """AC off everywhere, plus the run's process-wide remedies (so both runs use the same kernels)."""
    return RemedySpec(no_ac=["*"], deterministic=spec.deterministic)


def reference_command(target: str, args: list[str], *, module: bool, directory: str | os.PathLike, steps: int,
                      spec: RemedySpec, since: float = 0.0, nproc: int = 0) -> tuple[Child, str]:
    """(the process, its description) of the reference writing into `directory`: one process, or with `nproc` a
    torchrun of its own (fix --nproc-per-node), started like every ac-diff child (children.py)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for stale in (grads_path(directory), trace_path(directory)):
        if stale.exists():
            stale.unlink()
    extra = {ENV: reference_spec(spec).to_env(), DIR_ENV: str(directory), STEPS_ENV: str(steps)}
    if "torch._dynamo" in sys.modules:  # (the run compiled something: its reference must turn off AC Dynamo traces)
        extra[COMPILED_ENV] = "1"
    if process_world_size() > 1:
        extra.update(_fresh_group(directory, since))
    child = child_command(["-m", "ac_diff.reference.child", *(["-m"] if module else []), target, *args], nproc=nproc,
                          extra=extra)
    return child, "AC off everywhere: " + " ".join(["python", *(["-m"] if module else []), target, *args])


def run_reference(target: str, args: list[str], *, module: bool, output_dir: str, steps: int,
                  spec: RemedySpec, since: float = 0.0) -> tuple[int, str]:
    """Run the reference; `since`: when this run started (a rendezvous file older than that is stale)."""
    child, command = reference_command(target, args, module=module, directory=Path(output_dir) / REFERENCE_DIR,
                                       steps=steps, spec=spec, since=since)
    print(f"ac-diff: reference run without AC ({steps} backward pass(es)): {command.split(': ', 1)[1]}",
          file=sys.stderr)
    sys.stderr.flush()
    code = child.run(stdout=sys.stderr.fileno())
    if child.interrupted:
        raise KeyboardInterrupt
    return code, command


def _fresh_group(directory: Path, since: float) -> dict[str, str]:
    """The reference ranks' own rendezvous: rank 0 picks a free port and hands it over through torchrun's agent
    store, which every node reaches, and a file in `directory` (a launch without that store; a file older than this
    run's start is an earlier run's); the others read it."""
    tag = _tag()
    port_file = directory / f"port-{tag}"
    key = f"port/{next(_STARTED)}"  # (every rank starts its references in the same order)
    try:
        store = job_store(f"reference/{tag}")
    except StoreUnavailable:
        store = None
    if rank() == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        tmp = port_file.with_suffix(".tmp")
        tmp.write_text(str(port))
        tmp.replace(port_file)
        if store is not None:
            with contextlib.suppress(Exception):
                bounded(lambda: store.set(key, str(port)), OP_S)
        return _group(port)
    deadline = time.monotonic() + PORT_WAIT_S
    while time.monotonic() < deadline:
        if port_file.exists() and port_file.stat().st_mtime >= since:
            return _group(port_file.read_text())
        if store is not None:
            with contextlib.suppress(Exception):
                if bounded(lambda: store.check([key]), OP_S):
                    return _group(bounded(lambda: store.get(key), OP_S).decode())
        time.sleep(0.2)
    raise InputError(f"the reference run's ranks could not meet: rank 0 published no port within {PORT_WAIT_S:.0f} s "
                     "(neither through torchrun's agent store nor in the output directory); run --reference on one "
                     "node, or check that every node runs `ac-diff run --reference` too")


def _tag() -> str:
    """This launch's name for its reference group: its torchrun run id and port."""
    return f"{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}-{os.environ.get('MASTER_PORT', '')}"


_STARTED = itertools.count()  # the references this process started
_AGREED = itertools.count()  # the references this process asked its peers about


def peers_agree(own: str | None) -> str | None:
    """Under torchrun, whether every rank runs its reference: their reference ranks meet as one group, so a rank that
    does not (its script failed, or finished no backward) would leave the others waiting for it, and a rank whose
    script failed leaves the others' scripts in a collective it no longer joins until torchrun stops them. Each rank
    says through the agent store why it would not (`own`; None: it would). Returns None where every rank will (or
    there is no store: each decides alone), else why none does."""
    world, r = process_world_size(), rank()
    if world <= 1:
        return own
    key = f"agree/{next(_AGREED)}"
    try:
        store = job_store(f"reference/{_tag()}")
        bounded(lambda: store.set(f"{key}/{r}", own or ""), OP_S)
    except Exception:  # noqa: BLE001 - no store (another launcher): each rank decides alone, as before
        return own
    if own:
        return own
    deadline = time.monotonic() + PORT_WAIT_S
    said: dict[int, str] = {}
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            for q in range(world):
                if q not in said and bounded(lambda: store.check([f"{key}/{q}"]), OP_S):
                    said[q] = bounded(lambda: store.get(f"{key}/{q}"), OP_S).decode()
        refused = next((why for q, why in sorted(said.items()) if why), None)
        if refused:
            return refused
        if len(said) == world:
            return None
        time.sleep(0.2)
    missing = [q for q in range(world) if q not in said]
    return (f"rank{'s' if len(missing) > 1 else ''} {number_ranges(missing)} did not finish the script within "
            f"{PORT_WAIT_S:.0f} s of this one")


def _group(port: int | str) -> dict[str, str]:
    """The reference ranks' environment: their own group on `port`, not torchrun's agent store."""
    return {"MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "False"}


def _check_outputs(report: Any, r: int, run_path: Path, run: dict | None, ref_path: Path, ref: dict | None,
                   reference_dir: Path) -> None:
    """What the comparison reads back, as `ac-diff run --reference` wrote it: InputError naming a file cut, replaced
    or removed since (a clean run read "backward 1 failed only with AC" for a missing gradients file). This run's
    file is missing only where its process did not finish (killed before a backward)."""
    finished = any(s.rank == r and s.exit_status == "ok" for s in getattr(report, "ranks", ()))
    damaged = [p for p, data in ((run_path, run), (ref_path, ref)) if data is None and p.exists()]
    if read_side(reference_dir, r) is None:
        damaged.append(side_path(reference_dir, r))
    why = (f"{damaged[0]}: not a file ac-diff wrote, or cut (damaged since the run)" if damaged else
           f"{run_path}: missing, though rank {r}'s run finished" if run is None and finished else None)
    if why:
        raise InputError(f"{why}; the comparison with the run without AC needs it: re-run `ac-diff run --reference "
                         "no-ac ...` to write it again")


def reference_result(report: Any, output_dir: str | os.PathLike | dict[int, Path], ranks: list[int], steps: int,
                     exit_code: int | None, command: str | None,
                     reference_dir: str | os.PathLike | None = None) -> ReferenceResult:
    """Compare each rank's gradients with its reference rank's; one result across ranks. `output_dir`: the run's
    directory, or each rank's (a run's ranks copied from several nodes); the reference's is REFERENCE_DIR in it."""
    dirs = output_dir if isinstance(output_dir, dict) else {r: Path(output_dir) for r in ranks}
    given = reference_dir
    results = []
    unreached: set[int] = set()  # ranks with a region that diverged after the backward passes compared
    elsewhere: list[int] = []  # ranks whose gradients another node holds (no shared filesystem)
    for r in ranks:
        output_dir = dirs[r]
        reference_dir = Path(given) if given is not None else Path(output_dir) / REFERENCE_DIR
        run = load_grads(grads_path(output_dir, r))
        ref_path = grads_path(reference_dir, r)
        # (another rank's reference may still be writing; a rank whose own gradients are not here is another node's)
        deadline = time.monotonic() + (PORT_WAIT_S if r != rank() and exit_code == 0 and run else 0.0)
        while not ref_path.exists() and time.monotonic() < deadline:  # another rank's reference still writing
            time.sleep(0.2)
        ref = load_grads(ref_path)
        if exit_code is None:  # (read back later, `ac-diff report`: the files may have been damaged since)
            _check_outputs(report, r, grads_path(output_dir, r), run, ref_path, ref, reference_dir)
        modules = sorted({x.module for x in getattr(report, "regions", []) if x.rank == r and x.module})
        compared = compare_captures(run, ref, modules) if run and ref else []
        for s in compared:
            s.rank = r
        findings = load_side(output_dir, r).get("reentrant", [])
        rank_report = _RankView(report, r)
        first = compare_first_forwards(output_dir, reference_dir, r) \
            if compared and compared[0].loss_identical is False else None  # why the runs differ from the start
        result = explain(compared, findings, rank_report, steps_requested=steps, exit_code=exit_code, command=command,
                         first_forward=first, captured=len(run["steps"]) if run else 0)
        turned_off = sum(row.get("calls") or 0 for row in load_side(reference_dir, r).get("applied", [])
                         if row.get("remedy") == "no_ac")
        if turned_off == 0 and rank_report.regions and result.verdict != FAILED:
            result.verdict = FAILED
            result.headline = ("the reference could not turn AC off (no checkpoint call went through ac-diff: was "
                               "checkpoint bound before ac-diff started?), so the comparison shows nothing")
        elif turned_off:
            result.notes.append(f"the reference ran {turned_off} checkpoint call(s) without AC")
        threads = max((g.get("threads") or 1) if g else 1 for g in (run, ref))
        if threads > 1:  # (which model's backward comes n-th, and what the other holds then, differs from run to run)
            result.verdict, result.explanations = NOT_COMPARABLE, []
            result.headline = (f"gradients not compared: models trained on {threads} threads at once, so which "
                               "backward finishes n-th, and what the other thread has accumulated when its gradients "
                               "are read, differs from run to run; run each model's training on its own to compare it "
                               "with the run without AC")
        done = len(run["steps"]) if run else 0  # (the run with AC stopped before its next backward finished)
        ref_done = len(ref["steps"]) if ref else 0
        # (the run without AC stopped first: its own error, which AC hides; more steps would not compare more)
        failed_without = exit_code not in (None, 0) and ref_done < min(done, steps)
        later = diverged_after(rank_report.regions, result.backwards)
        if result.verdict == IDENTICAL and result.steps and later:  # what diverged was not in what was compared
            unreached.add(r)
            result.headline += diverged_later(rank_report.regions, later, done if not failed_without else 0)
        # (not a difference by itself: the run without AC may fail for want of the memory AC saves)
        if failed_without and result.verdict == IDENTICAL:
            result.headline += (f"; backward {ref_done + 1} failed only without AC: the run without AC exited with "
                                f"{exit_code} there (its error is in its output above) and the run with AC finished "
                                "it, so checkpointing hides an error the run without it raises")
        # (the run with AC stopped short of the backward passes asked of it, which the run without AC finished; a
        # reference asked for more than this run captured, `fix`'s for its tries, is no failure)
        if ref and len(ref["steps"]) > done and done < steps and (result.verdict == IDENTICAL or not done):
            only = (f"backward {done + 1} failed only with AC: the run without AC finished it, so the failure is the "
                    "checkpointing's")
            result.headline = f"{result.headline}; {only}" if done else only
            result.verdict = DIFFERS  # (checkpointing changes the training, whatever the gradients before it say)
        if run is None and ref is None and r != rank() and exit_code is not None:
            elsewhere.append(r)
            result.headline = (f"rank {r}'s gradients are not in {output_dir} (written on another node, with no "
                               "shared filesystem): `ac-diff report` of a directory holding that node's output "
                               "compares them")
        elif run is None:
            result.notes.append(f"rank {r}: this run captured no gradients (no backward pass ran)")
        compiled = reference_note(rank_report.compiled)
        if compiled and compared:
            result.notes.append(compiled)
        results.append((r, result))
    remote = None
    if elsewhere and len(elsewhere) < len(results):  # (compared here: the others; where those are, a note)
        results = [(r, res) for r, res in results if r not in elsewhere]
        remote = (f"rank{'s' if len(elsewhere) > 1 else ''} {number_ranges(elsewhere)}: gradients on another node "
                  "(no shared filesystem), not compared here: `ac-diff report` of every node's directory together "
                  "compares them")
    if len(results) == 1:
        results[0][1].notes += [remote] if remote else []
        return results[0][1]
    order = {DIFFERS: 0, NOT_COMPARABLE: 1, FAILED: 2, IDENTICAL: 3}
    # the headline: the rank whose gradients differ for a reason of its own before one that only received them; of
    # ranks whose gradients match, one whose divergence came after the compared passes (which the headline says)
    r0, worst = min(results, key=lambda x: (order[x[1].verdict], any(
        e.kind == "other_rank_divergence" for e in x[1].explanations), x[0] not in unreached, x[0]))
    alike = [r for r, res in results if res.verdict == worst.verdict]  # (a stranger read "rank 0" as all it compared)
    label = (f"rank {r0}" if len(alike) == 1 else f"every rank ({len(results)})" if len(alike) == len(results)
             else f"ranks {', '.join(map(str, alike))}") + (f", rank {r0}'s figures" if len(alike) > 1 and
                                                              worst.verdict != IDENTICAL else "")
    merged = ReferenceResult(mode=worst.mode, verdict=worst.verdict, headline=f"{label}: {worst.headline}",
                             steps_requested=steps, command=command, exit_code=exit_code)
    seen = set()
    for r, res in results:
        merged.steps += res.steps
        merged.notes += [f"rank {r}: {n}" for n in res.notes]
        for e in res.explanations:
            if e.text not in seen:
                seen.add(e.text)
                merged.explanations.append(e)
    merged.notes += [remote] if remote else []
    return merged


class _RankView:
    """The report's regions of one rank (what explain() reads)."""

    def __init__(self, report: Any, r: int) -> None:
        self.regions = [x for x in getattr(report, "regions", []) if x.rank == r]
        self.compiled = getattr(report, "compiled", None)  # torch.compile in the run (diagnosis/compiled.py)
        self.other_ranks_diverged = [x for x in getattr(report, "regions", []) if x.rank != r and x.status == DIVERGED]


def diverged_later(regions: list, later: list, captured: int) -> str:
    """What the headline of identical gradients adds where regions diverged after the compared backward passes
    (`later`): the first of them, with `--reference-steps N` where this run captured backward N (`captured`); regions
    that diverged within the compared passes did not change the gradients, and it says so (it named the first later
    one "the first region that diverged")."""
    first = min(later, key=lambda x: x.region)
    when = recomputed_in(first)
    within = sum(1 for x in regions if x.status == DIVERGED) - len(later)
    at = f"backward {first.backward} (step {first.step})" if first.backward is not None else f"step {first.step}"
    said = (f"; {within} region(s) diverged in the compared backward pass(es) without changing the gradients, but "
            f"region {first.region} ({first.module or '?'}) diverged in {at}" if within else
            f"; but the first region that diverged (region {first.region}, {first.module or '?'}) was recomputed "
            f"in {at}")
    return said + ", after the compared backward pass(es)" + (
        f": `--reference-steps {when}` compares it" if when <= captured else "")
