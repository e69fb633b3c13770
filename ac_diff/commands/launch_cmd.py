"""Multi-rank runs: `ac-diff run --nproc-per-node N`, and what each rank does under torchrun.

torchrun is the launcher; ac-diff never starts processes of its own kind:

    ac-diff run --nproc-per-node 2 -o out train.py --lr 3e-4
    # = python -m torch.distributed.run --standalone --nproc-per-node 2 -m ac_diff run -o out train.py --lr 3e-4
    #   then one cross-rank report over out/trace-rank0.jsonl, out/trace-rank1.jsonl

    torchrun --nproc-per-node 2 -m ac_diff run -o out train.py    # works too: rank 0 reports

Every rank records `OUT/trace-rank{RANK}.jsonl` with a run id in its header (`AC_DIFF_RUN_ID` set by
the launcher, else torchrun's `TORCHELASTIC_RUN_ID`), so a report never mixes in a stale trace an
earlier run left in the same directory.

Who reports: torchrun stops every other rank as soon as one rank exits with an error, so a rank can
be killed before it has anything to say. Under `ac-diff run --nproc-per-node`, the launcher reports
after torchrun returns, whatever happened to the ranks. Under a plain torchrun, rank 0 waits (bounded:
`AC_DIFF_RANK_WAIT` seconds, default 60) for the other ranks' traces to be finished, then reports; a
non-zero rank whose script failed prints one line with the trace and the command to run, since rank 0
may not live to report. A rank torchrun terminates (SIGTERM) still finishes its trace.

Without a shared filesystem (nodes with their own -o directories on local disks), the traces travel through
torchrun's rendezvous store instead (rank_exchange.py): every rank says hello when it starts and hands its
finished trace to rank 0, which writes it into its own directory and says where the full trace is; a rank that
started but sent nothing is named, and the verdict is then never clean. Without a store, rank 0 reads its
directory alone, as above, and says so on stderr.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from .common import EXIT_BAD_INPUT, command_line, emit, fail, print_next, verdict_code
from ..env import process_world_size
from ..errors import Terminated

from .trace_peek import read_end, read_header  # noqa: F401 - also read by rank_exchange
from ..children import (EXIT_TERMINATED, LAUNCHED_ENV, RUN_ID_ENV,  # noqa: F401 - the launch's environment
                        child_command, on_sigterm)
WAIT_ENV = "AC_DIFF_RANK_WAIT"  # seconds rank 0 waits for the other ranks' traces (default 60)
DEFAULT_WAIT_S = 60.0
POLL_S = 0.2


# -- where this process stands ----------------------------------------------------------------
def rank() -> int:
    return int(os.environ.get("RANK", "0") or 0)


def world_size() -> int:
    return process_world_size()


def is_multi_rank() -> bool:
    return world_size() > 1


def launched() -> bool:
    """This rank runs under `ac-diff run --nproc-per-node` (the launcher writes the report)."""
    return bool(os.environ.get(LAUNCHED_ENV))


def run_id() -> str | None:
    """Same for every rank of one launch (and attempt), different for the next launch (None when unknowable): the
    launcher's id, else torchrun's rendezvous id with the launch's token from the agent's store (a fixed --rdzv-id
    or a requeued job reuses the rendezvous id; see `_launch_token`) and the restart count."""
    explicit = os.environ.get(RUN_ID_ENV)
    if explicit:
        return explicit
    elastic = os.environ.get("TORCHELASTIC_RUN_ID")
    if not elastic:
        return None
    token = _launch_token(elastic)
    if token is None and elastic == "none":  # torchrun's default rdzv id is the literal "none"
        return None
    launch = f"{elastic}-{token}" if token else elastic
    return f"{launch}.{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


_tokens: dict[str, str | None] = {}


def _launch_token(elastic: str) -> str | None:
    """This launch's token (rank_exchange.launch_token), asked for once per process; None without a store."""
    if elastic not in _tokens:
        from .rank_exchange import launch_token

        try:
            _tokens[elastic] = launch_token(elastic) if is_multi_rank() else None
        except Exception:  # noqa: BLE001 - no store (or no answer): the rendezvous id alone
            _tokens[elastic] = None
    return _tokens[elastic]


def _unique_launch() -> str | None:
    """The run id without its restart count where no other launch can share it (the launcher's id, or one with a
    launch token): a trace of another launch in the directory is then known stale. None otherwise."""
    rid = run_id()
    elastic = os.environ.get("TORCHELASTIC_RUN_ID")
    if rid is None or not (os.environ.get(RUN_ID_ENV) or elastic and _launch_token(elastic)):
        return None
    return rid.rsplit(".", 1)[0]


def header_fields() -> dict[str, Any]:
    """What a rank adds to its trace header so the traces of one launch can be found together."""
    fields: dict[str, Any] = {"run_id": run_id()}
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        fields["launcher"] = "ac-diff" if launched() else "torchrun"
        fields["restart"] = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    return fields


# -- the launcher ---------------------------------------------------------------------------
def rank_argv(target: str, args: list[str], *, module: bool, output_dir: str, options: Any,
              remedies: Any = None, reference: str | None = None, reference_steps: int = 1) -> list[str]:
    """The `ac-diff run` arguments each rank gets: where to write, what to record, the remedies, the script and
    its args."""
    argv = ["run", "-o", output_dir, "--keep-values", str(options.keep_values), "--scope", options.scope,
            "--write", options.write]
    if remedies:
        argv += remedies.cli_args()
    if reference:
        argv += ["--reference", reference, "--reference-steps", str(reference_steps)]
    if options.max_regions is not None:
        argv += ["--max-regions", str(options.max_regions)]
    if not options.fingerprints:
        argv.append("--no-fingerprints")
    if options.watch:
        argv += ["--watch", "--watch-full-steps", str(options.watch_full_steps),
                 "--watch-resample", str(options.watch_resample)]
    if options.full_from_step is not None:
        argv += ["--full-from-step", str(options.full_from_step)]
    return argv + (["-m"] if module else []) + [target, *args]


def launch_command(nproc: int, argv: list[str], *, output_dir: str = "ac-diff-out", force: bool = False,
                   check: bool = False, fmt: str = "terminal", json_path: str | None = None,
                   output: str | None = None, settings: Any = None, target: str | None = None,
                   module: bool = False, remedies: Any = None, reference: str | None = None,
                   reference_steps: int = 1) -> int:
    """Run `ac-diff run ARGV` on `nproc` local processes under torchrun, then report across ranks.

    `argv` is the `ac-diff run` argument list each rank gets (`rank_argv`).
    Returns the script's exit code: that of the lowest rank whose script failed, else torchrun's; with
    `check`, 1 when every rank succeeded but a region diverged.
    """
    from ..diagnosis import Settings
    from ..capture.runner import check_target

    if nproc < 1:
        return fail(f"--nproc-per-node must be at least 1, got {nproc}")
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        return fail("--nproc-per-node starts torchrun, but this process already runs under torchrun; drop "
                    "--nproc-per-node (torchrun ... -m ac_diff run SCRIPT records every rank)")
    if target is not None:
        check_target(target, module)
    argv = list(argv)
    out = Path(output_dir)
    refused = clear_traces(out, force)
    if refused:
        return fail(refused)
    if "--force" not in argv:
        argv.insert(1, "--force")  # the directory is clean now; a rank restarted by torchrun may rewrite
    child = child_command(["-m", "ac_diff", *argv], nproc=nproc)  # the same environment as every child (children.py)
    rid = child.run_id
    print(f"ac-diff: launching {nproc} processes with torchrun (run {rid}): {' '.join(child.argv[1:])}",
          file=sys.stderr)
    sys.stderr.flush()
    code = child.run()  # (Ctrl-C: the ranks got it too, and torchrun has wound down)
    if child.terminated:  # passed on to torchrun, which stopped the ranks: they finished their traces
        print("ac-diff: SIGTERM: torchrun stopped the ranks; reporting what they recorded", file=sys.stderr)
    runs_found = collect_traces(out, rid, nproc)
    if not runs_found.paths:
        fail(f"no trace with run id {rid} in {out}: the ranks did not get to start the recorder (see torchrun's "
             "output above)", EXIT_BAD_INPUT)
        return code or EXIT_BAD_INPUT
    from .run_extras import RunExtras

    extras = RunExtras(remedies, reference, reference_steps, output_dir, target, argv_target_args(argv, target),
                       module)  # each rank applied / ran the remedies and references
    report = report_ranks(runs_found, settings or Settings(), fmt, json_path, output, out, extras.decorate)
    script_code = _script_exit_code(runs_found.exit_codes, code, runs_found.end_times)
    if code != 0 and not child.interrupted and not child.terminated and runs_found.exit_codes and all(
            c == 0 for c in runs_found.exit_codes.values()) and len(runs_found.exit_codes) == nproc:
        print(f"ac-diff: torchrun exited {code} although every rank's script finished and its trace is complete: a "
              "process failed after that, as it shut down (torchrun's output above names the rank and signal)",
              file=sys.stderr)
    script_code = child.signalled(script_code)
    if check and script_code == 0 and report.verdict != "clean":
        return verdict_code(report)
    return script_code


def argv_target_args(argv: list[str], target: str | None) -> list[str]:
    """The script's own arguments: what follows the target in a rank's argv."""
    if target is None or target not in argv:
        return []
    return argv[argv.index(target) + 1:]


def _script_exit_code(exit_codes: dict[int, int | None], torchrun_code: int,
                      end_times: dict[int, float] | None = None) -> int:
    """The exit code of the rank whose script failed first (not one torchrun stopped; ties: the lowest
    rank), else torchrun's."""
    end_times = end_times or {}
    failed = sorted((end_times.get(r, float("inf")), r, c) for r, c in exit_codes.items()
                    if c not in (None, 0, EXIT_TERMINATED))
    if failed:
        return failed[0][2]
    return torchrun_code


# -- finding the traces of one launch ---------------------------------------------------------
@dataclass
class RankTraces:
    paths: dict[int, Path] = field(default_factory=dict)  # rank -> trace of this launch
    ended: set[int] = field(default_factory=set)  # ranks whose trace has its end record
    finished: set[int] = field(default_factory=set)  # ended, or the process is gone (nothing more will come)
    exit_codes: dict[int, int | None] = field(default_factory=dict)
    end_times: dict[int, float] = field(default_factory=dict)
    missing: list[int] = field(default_factory=list)  # expected ranks without a trace of this launch
    stale: list[Path] = field(default_factory=list)  # traces in the directory from another launch


def clear_traces(output_dir: str | os.PathLike, force: bool) -> str | None:
    """Before a run that writes every trace of `output_dir` (a launch, or one process): with --force, remove every
    trace an earlier run left there, also of ranks this run will not have (a report would mix them in); without
    it, the refusal to print when there is one."""
    out = Path(output_dir)
    existing = _trace_paths(out)
    if existing and not force:
        return (f"{existing[0]} already exists; pass --force to overwrite the traces in {out}, or -o DIR for another "
                "directory")
    for stale in existing:
        with contextlib.suppress(OSError):
            stale.unlink()
    return None


def _trace_paths(directory: Path) -> list[Path]:
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if p.is_file() and p.name.startswith("trace")
                  and (p.name.endswith(".jsonl") or p.name.endswith(".jsonl.gz")))


    return None


def collect_traces(directory: Path, rid: str | None, expected: int, *, since: float | None = None) -> RankTraces:
    """The traces of launch `rid` in `directory`, one per rank (without a run id: those started after `since`)."""
    found = RankTraces()
    for path in _trace_paths(directory):
        header = read_header(path)
        if header is None or header.get("format") != "ac-diff-trace":
            continue
        same = (header.get("run_id") == rid) if rid is not None else (
            since is None or float(header.get("start_time", 0)) >= since)
        r = int(header.get("rank", 0) or 0)
        if not same or r >= expected:
            found.stale.append(path)
            continue
        if r in found.paths:  # two files for one rank (.jsonl and .jsonl.gz): keep the newer
            if path.stat().st_mtime <= found.paths[r].stat().st_mtime:
                continue
        found.paths[r] = path
        end = read_end(path)
        found.ended.discard(r)
        found.finished.discard(r)
        if end is not None:
            found.ended.add(r)
            found.finished.add(r)
            found.exit_codes[r] = end.get("exit_code")
            if isinstance(end.get("end_time"), (int, float)):
                found.end_times[r] = float(end["end_time"])
        else:
            found.exit_codes[r] = None
            if header.get("pid") and header.get("host") == _host() and not _alive(int(header["pid"])):
                found.finished.add(r)  # died without finishing its trace (killed): nothing more will come
    found.missing = [r for r in range(expected) if r not in found.paths]
    return found


def _host() -> str:
    import platform

    return platform.node()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_terminated = threading.Event()  # set when torchrun asks this rank to stop while it waits


def wait_for_ranks(directory: Path, rid: str | None, expected: int, timeout: float, *,
                   since: float | None = None, exchange: Any = None) -> RankTraces:
    """Poll until every rank's trace of this launch is finished, or `timeout` seconds have passed. With an
    `exchange` (rank_exchange.Exchange), the traces that arrive through the store are written into `directory`
    as they come, and a rank is also finished once it said so there.

    If SIGTERM arrives meanwhile (torchrun stops every rank), wait at most 3 s more: the other ranks
    finish their traces on the same signal."""
    start = time.monotonic()
    deadline = start + max(0.0, timeout)
    told = last = False
    while True:
        done: set[int] = set()
        if exchange is not None:
            try:
                done = exchange.receive(directory, rid, scan=last)
            except Exception as exc:  # noqa: BLE001 - the store went away: what is on disk is all there is
                print(f"ac-diff: lost the rendezvous store ({type(exc).__name__}: {str(exc).strip()[:200]}); "
                      f"the report covers the traces in {directory}", file=sys.stderr)
                exchange = None
        found = collect_traces(directory, rid, expected, since=since)
        pending = sorted(set(range(expected)) - found.finished - done)
        now = time.monotonic()
        if _terminated.is_set():
            deadline = min(deadline, now + 3.0)
        if not pending or last:
            return found
        if now >= deadline:
            last = True  # one more look: a trace that arrived meanwhile still counts
            continue
        if not told and now - start > 2.0:
            print(f"ac-diff: waiting up to {timeout:.0f} s for rank{'s' if len(pending) > 1 else ''} "
                  f"{_ranks_text(pending)} to finish {'their traces' if len(pending) > 1 else 'its trace'}...",
                  file=sys.stderr)
            told = True
        _terminated.wait(POLL_S)


def _ranks_text(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def rank_wait_seconds() -> float:
    given = os.environ.get(WAIT_ENV)
    try:
        wait = float(given if given is not None else DEFAULT_WAIT_S)
    except ValueError:
        wait = -1.0
    if not (0 <= wait < float("inf")):
        print(f"ac-diff: warning: {WAIT_ENV}={given!r} is not a number of seconds >= 0; waiting the default "
              f"{DEFAULT_WAIT_S:g} s", file=sys.stderr)
        return DEFAULT_WAIT_S
    return wait


# -- reporting --------------------------------------------------------------------------------
def report_ranks(found: RankTraces, settings: Any, fmt: str, json_path: str | None, output: str | None,
                 output_dir: Path, decorate: Any = None, exchange: Any = None):
    """Diagnose every rank's trace of this launch together and print the cross-rank report. A rank without a
    finished trace makes it unchecked at best (report.missing_ranks); `exchange`: what came through the store."""
    from ..diagnosis import diagnose
    from ..report import missing_ranks
    from ..trace import read_run

    runs = [read_run(p, lazy=True) for _, p in sorted(found.paths.items())]
    ranks = sorted(found.paths)
    print(f"ac-diff: {len(ranks)} trace{'s' if len(ranks) > 1 else ''} written to {str(output_dir).rstrip('/')}/ "
          f"(rank{'s' if len(ranks) > 1 else ''} {_ranks_text(ranks)})", file=sys.stderr)
    report = diagnose(runs, settings)
    notes = _received_notes(exchange) if exchange is not None else []
    if found.missing and exchange is not None:
        notes += _unheard_notes(exchange, found.missing)
    elif found.missing:
        notes.append(f"no trace from rank{'s' if len(found.missing) > 1 else ''} "
                     f"{_ranks_text(found.missing)} of this run in {output_dir} (the process did not start "
                     "the recorder, or it wrote to another directory / node)")
    unfinished = sorted(set(found.paths) - found.ended)
    if unfinished:
        notes.append(f"rank{'s' if len(unfinished) > 1 else ''} {_ranks_text(unfinished)} had not finished "
                     f"{'their traces' if len(unfinished) > 1 else 'its trace'} when this report was made "
                     f"(still running, or killed); `{command_line('ac-diff', 'report', output_dir)}` later "
                     "shows what they recorded")
    missing_ranks(report, sorted(set(found.missing) | set(unfinished)), notes)
    if found.stale:
        report.notes.append(f"ignored {len(found.stale)} trace file(s) in {output_dir} from an earlier run: "
                            + ", ".join(p.name for p in found.stale[:4]))
    if decorate is not None:  # the reference section, the remedies applied (run_extras)
        decorate(report, ranks)
    emit(report, fmt, json_path, output)
    print_next(output_dir, json_path,
               f"   (one rank: {command_line('ac-diff', 'report', found.paths[ranks[-1]])}; two ranks that compute the "
               "same, as tensor parallelism does (data-parallel ranks read other batches), side by side: "
               f"{command_line('ac-diff', 'compare', found.paths[ranks[0]], found.paths[ranks[-1]])})"
               if len(ranks) > 1 else "")
    return report


def _received_notes(exchange: Any) -> list[str]:
    """Where the full trace of each rank that came through the store is: one line per node and directory."""
    groups: dict[tuple, list[int]] = {}
    for r, meta in sorted(exchange.arrived.items()):
        groups.setdefault((meta.get("node"), meta.get("host"), meta.get("dir"), bool(meta.get("cut"))), []).append(r)
    notes = []
    for (node, host, directory, cut), ranks in groups.items():
        many = len(ranks) > 1
        cut_text = (f", cut to {'their' if many else 'its'} records without op lists (over the "
                    f"{exchange.cap / (1 << 20):.0f} MiB a rank may send)") if cut else ""
        notes.append(f"rank{'s' if many else ''} {_ranks_text(ranks)}: trace{'s' if many else ''} received from "
                     f"{_place(node, host, directory)}{cut_text}; "
                     f"{'their full traces are' if many else 'its full trace is'} there")
    for r, why in sorted(exchange.damaged.items()):
        notes.append(f"rank {r}'s trace arrived incomplete through the rendezvous store ({why}); its full trace is "
                     "where that rank wrote it")
    for r, meta in sorted(exchange.arrived.items()):
        behind = [*(meta.get("left") or ()), *(meta.get("lost") or ())]
        if behind:
            notes.append(f"rank {r}: {', '.join(behind[:3])}{' ...' if len(behind) > 3 else ''} stayed on its node "
                         f"({_place(meta.get('node'), meta.get('host'), meta.get('dir'))}): over the "
                         f"{exchange.cap / (1 << 20):.0f} MiB a rank may send, or cut on the way; `ac-diff report` of "
                         "that directory beside this one reads them")
    return notes


def _unheard_notes(exchange: Any, missing: list[int]) -> list[str]:
    """The ranks that sent no trace: those that said hello (they started, then died or hung), and the others."""
    try:
        hellos = exchange.hellos(missing)
    except Exception:  # noqa: BLE001 - the store is gone: say what is known without it
        hellos = {}
    groups: dict[tuple, list[int]] = {}
    for r in missing:
        if r in hellos and r not in exchange.damaged:
            groups.setdefault((hellos[r].get("node"), hellos[r].get("host"), hellos[r].get("dir")), []).append(r)
    notes = []
    for (node, host, directory), ranks in groups.items():
        many = len(ranks) > 1
        where = ", ".join(x for x in (f"node {node}" if node is not None else "", f"host {host}" if host else "") if x)
        notes.append(f"rank{'s' if many else ''} {_ranks_text(ranks)}{f' ({where})' if where else ''} started but sent "
                     f"no results: {'they' if many else 'it'} may have died (or not finished within the wait); what "
                     f"{'they' if many else 'it'} recorded "
                     f"is in {directory} on {host or 'its host'}")
    silent = [r for r in missing if r not in hellos and r not in exchange.damaged]
    if silent:
        notes.append(f"no trace from rank{'s' if len(silent) > 1 else ''} {_ranks_text(silent)} of this run: never "
                     "heard of through the rendezvous store (the process did not start the recorder, or could not "
                     "reach the store)")
    return notes


def _place(node: Any, host: Any, directory: Any) -> str:
    """"node 1 (host h, /scratch/out)"; "host h (/scratch/out)" where the node is not known."""
    return f"node {node} (host {host}, {directory})" if node is not None else f"host {host} ({directory})"


# -- what a rank does (called by run_cmd) ------------------------------------------------------
def prepare_rank(output_dir: str | os.PathLike, trace_path: Path, force: bool) -> None:
    """Before recording: keep an earlier attempt's trace when torchrun restarted this rank; with --force,
    rank 0 removes traces of ranks this run will not have (left by a bigger earlier run) and, where the run id is
    this launch's alone, every trace an earlier launch left (copies received from other nodes too); under torchrun, say
    hello in the rendezvous store (rank_exchange.py: rank 0 can then name a rank that started and never delivered)."""
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if restart and trace_path.exists():
        header = read_header(trace_path) or {}
        base = (run_id() or "").rsplit(".", 1)[0]
        if base and str(header.get("run_id") or "").rsplit(".", 1)[0] == base:
            with contextlib.suppress(OSError):  # the failure that caused the restart stays readable
                trace_path.rename(trace_path.with_name(f"{trace_path.name}.attempt{header.get('restart', restart - 1)}"))
    if force and rank() == 0 and is_multi_rank():
        size, launch = world_size(), _unique_launch()
        for path in _trace_paths(Path(output_dir)):
            header = read_header(path)
            if header is None:  # (a rank of this launch that has just opened its file)
                continue
            earlier = launch is not None and str(header.get("run_id") or "").rsplit(".", 1)[0] != launch
            if earlier or int(header.get("rank", 0) or 0) >= size:
                with contextlib.suppress(OSError):
                    path.unlink()
    if is_multi_rank() and not launched():
        with contextlib.suppress(Exception):  # no store: rank 0 reads the filesystem, and says so when it reports
            _exchange().hello(output_dir)


def _exchange():
    """This rank's side of the rendezvous store (rank_exchange.py); StoreUnavailable where there is none."""
    from .rank_exchange import connect

    return connect(run_id() or f"restart{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", rank(), world_size())


def _connected(r: int, output_dir: str, trace_path: Path):
    """At a rank's end: its side of the rendezvous store, or None (rank 0 then reads its directory alone and says
    so; another rank says so only where a store was named but could not be reached)."""
    from .rank_exchange import StoreUnavailable

    try:
        return _exchange()
    except StoreUnavailable as exc:
        if r == 0:
            print(f"ac-diff: {exc}; rank 0 reads the other ranks' traces from {output_dir} alone (on several nodes: "
                  "give every rank a directory they all share)", file=sys.stderr)
        elif exc.failed:
            print(f"[rank{r}] ac-diff: {exc}; rank 0 gets no trace from rank {r}: it stays in {trace_path}",
                  file=sys.stderr)
        return None


def _hand_over(exchange: Any, r: int, trace_path: Path, output_dir: str) -> None:
    """A non-zero rank's finished trace to rank 0 (rank_exchange.Exchange.send), within SEND_S; a failure is one line."""
    from ..reference.paths import rank_outputs
    from .rank_exchange import SEND_S, bounded

    try:
        with sigterm_stops_waiting():  # torchrun's SIGTERM waits for the trace to be handed over
            bounded(lambda: exchange.send(trace_path, output_dir, rank_outputs(output_dir, r)), SEND_S)
    except Exception as exc:  # noqa: BLE001 - one line; the trace stays where it is
        print(f"[rank{r}] ac-diff: could not send the trace to rank 0 through the rendezvous store "
              f"({type(exc).__name__}: {str(exc).strip()[:200]}); it stays in {trace_path}", file=sys.stderr)


@contextlib.contextmanager
def sigterm_as_exit() -> Iterator[None]:
    """While the script runs on a rank: SIGTERM (torchrun stopping the ranks after one failed) raises
    SystemExit(143) so the trace gets finished; the previous handler comes back afterwards."""
    from ..capture.runner import finishing

    def handler(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process as usual
        _terminated.set()
        if not finishing.is_set():  # else ac-diff is already finishing the trace (the script has ended)
            raise Terminated()

    with on_sigterm(handler):
        yield


@contextlib.contextmanager
def sigterm_stops_waiting() -> Iterator[None]:
    """While rank 0 waits for the other ranks: SIGTERM cuts the wait short, the report still comes."""
    def handler(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        _terminated.set()

    with on_sigterm(handler):
        yield


def finish_rank(outcome_code: int, trace_path: Path, output_dir: str, *, check: bool, fmt: str,
                json_path: str | None, output: str | None, settings: Any, decorate: Any = None) -> int:
    """After a rank's script ended under torchrun: the others hand their trace to rank 0 through the rendezvous store
    (rank_exchange.py) and stay quiet; rank 0 waits for them and reports across ranks."""
    r = rank()
    if launched():
        return outcome_code  # the launcher reports once torchrun is done
    exchange = _connected(r, output_dir, trace_path)
    if r != 0:
        if exchange is not None:
            _hand_over(exchange, r, trace_path, output_dir)
        if outcome_code not in (0, EXIT_TERMINATED):
            # torchrun now stops the other ranks, rank 0 included: it may not live to report
            print(f"[rank{r}] ac-diff: the script failed on rank {r}; trace: {trace_path}. torchrun stops the other "
                  f"ranks now; for the report across ranks run: {command_line('ac-diff', 'report', output_dir)}",
                  file=sys.stderr)
        elif check and exchange is not None:
            return _checked_code(exchange, r, outcome_code)
        return outcome_code
    header = read_header(trace_path) or {}
    rid = header.get("run_id")
    since = float(header.get("start_time", 0)) - 120.0 if rid is None else None
    # Rank 0's own failure makes torchrun stop the others, who may be blocked waiting for it: don't wait long.
    timeout = rank_wait_seconds() if outcome_code == 0 else min(rank_wait_seconds(), 3.0)
    with sigterm_stops_waiting():
        found = wait_for_ranks(Path(output_dir), rid, world_size(), timeout, since=since, exchange=exchange)
        found.paths.setdefault(0, trace_path)
        report = report_ranks(found, settings, fmt, json_path, output, Path(output_dir), decorate, exchange)
    code = verdict_code(report) if check and outcome_code == 0 and report.verdict != "clean" else outcome_code
    if check and exchange is not None:
        _publish_code(exchange, code)
    return code


VERDICT_KEY = "check/code"  # rank 0's exit code under --check, which every rank exits with


def _publish_code(exchange: Any, code: int) -> None:
    """Rank 0's --check code for the other ranks (`_checked_code`). Never raises: they then keep their own."""
    from .rank_exchange import OP_S, bounded

    with contextlib.suppress(Exception):
        bounded(lambda: exchange.store.set(VERDICT_KEY, str(code)), OP_S)


def _checked_code(exchange: Any, r: int, own: int) -> int:
    """Under --check every rank exits with rank 0's code: where some ranks exit 1 and the others 0, torchrun's agents
    of the nodes whose ranks all succeeded wait in their exit barrier for the failed node's, which never comes (five
    minutes, then an error naming the wrong node). Waits for rank 0's report (its ranks' wait, then a diagnosis);
    its own code where rank 0 says nothing in time."""
    from .rank_exchange import OP_S, bounded

    wait = rank_wait_seconds() + REPORT_WAIT_S
    deadline = time.monotonic() + wait
    with sigterm_stops_waiting(), contextlib.suppress(Exception):  # (rank 0 stopped: this rank's own code)
        while time.monotonic() < deadline and not _terminated.is_set():
            if bounded(lambda: exchange.store.check([VERDICT_KEY]), OP_S):
                code = int(bounded(lambda: exchange.store.get(VERDICT_KEY), OP_S))
                if code:  # (rank 0 exits first: torchrun stops the others at the first failure, rank 0 included)
                    _terminated.wait(EXIT_AFTER_S)
                return code
            time.sleep(0.5)
    if not _terminated.is_set():
        print(f"[rank{r}] ac-diff: rank 0's --check verdict did not come within {wait:.0f} s; this rank exits with "
              "its own code", file=sys.stderr)
    return own


EXIT_AFTER_S = 5.0  # how long the other ranks leave rank 0 to exit first with a failing --check code
REPORT_WAIT_S = 600.0  # how long the other ranks wait for rank 0's diagnosis under --check, after its ranks' wait
