"""The library API: load traces as pandas tables, read any evidence, diagnose it.

    trace = ac_diff.load("ac-diff-out")          # a file or a directory of per-rank traces
    trace.regions   # rank, region, module, kind, forward_ops, recompute_ops, ...
    trace.ops       # rank, region, phase, attempt, index, op, module, source, out_shapes, fingerprint, ...
    trace.positions # rank, region, phase, position, op_index, op, module, source, shape, dtype, origin, name
    report = ac_diff.diagnose_paths(["ac-diff-out"])     # or a log: ["rank1.log"]
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from .diagnosis import Settings, diagnose
from .errors import InputError
from .passes import PHASES, Run, TensorMeta, op_count
from .report import Report
from .streams import STDIN, readable_file, source_name
from .trace import TraceFormatError, is_trace, read_run, trace_files

if TYPE_CHECKING:
    import pandas as pd


def _frame(rows: list[dict], columns: list[str]) -> "pd.DataFrame":
    import pandas as pd  # imported on first use: the CLI's startup does not pay for it

    frame = pd.DataFrame(rows, columns=columns)
    for column in _NULLABLE_INTS.intersection(columns):  # an index column with gaps stays integer (not 4.0)
        frame[column] = frame[column].astype("Int64")
    return frame


_NULLABLE_INTS = frozenset({"op_index", "position", "index", "rank", "region", "attempt", "parent",
                            "forward_ops", "recompute_ops", "forward_positions", "recompute_positions", "recomputes"})


_NO_ERROR = ("no torch.utils.checkpoint error or debug dump in it (a rank that stopped before it raised, or one whose "
             "recomputes raised nothing: that does not show they matched)")


def read_runs(paths: Iterable[str | os.PathLike] | str | os.PathLike, progress=None, lazy: bool = False) -> list[Run]:
    """Read every path: a trace, a directory of traces, or a log torch printed (lazy: see read_run); one path alone
    is one path, not its characters. Among several, a log with nothing to explain (a rank torchrun stopped before it
    raised) is left out with a note."""
    paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    runs: list[Run] = []
    nothing: list[NothingToExplain] = []
    seen: list[str] = []  # every file read or below a directory read (the nodes of torchrun --log-dir files)
    for path in paths:
        p = readable_file(path)
        first = len(runs)
        try:
            runs.extend(_read_path(p, source_name(p), progress, lazy, seen))
        except NothingToExplain as exc:
            if len(paths) == 1 and exc.text:  # a training log without an error: NOTHING CHECKED (the parser's note)
                from .logs import parse_log

                runs.append(parse_log(p, progress=progress, lazy=lazy))
            elif len(paths) == 1:
                raise
            else:
                nothing.append(exc)
        for run in runs[first:]:  # standard input is called <stdin>, not by the temporary copy read
            _rename(run, str(p), source_name(p))
        if not p.is_dir():
            seen.append(str(p))
    if nothing and not runs:
        raise nothing[0]
    if nothing:
        runs[0].notes.extend(f"{exc.name}: left out, {exc.why}" for exc in nothing)
    from .logs import place_log_dir_ranks

    place_log_dir_ranks(runs, seen)
    return runs


class NothingToExplain(InputError):
    """A file that is neither a trace nor a log with checkpoint error text or a debug dump (or an empty one)."""

    def __init__(self, name: str, message: str, why: str = _NO_ERROR, text: bool = False) -> None:
        super().__init__(message)
        self.name, self.why, self.text = name, why, text  # text: a log a program printed, not binary data


_LOG_SUFFIXES = (".log", ".txt", ".err", ".out", ".gz", ".zst", ".bz2", ".xz")
_LOGS_SEARCHED = 512  # files below a directory looked at for logs, at most


def _logs_below(directory: Path, seen: list[str]) -> list[Path]:
    """The logs with checkpoint error text or a debug dump in the files below `directory` (a torchrun --log-dir
    tree: <run>/attempt_0/<local rank>/stderr.log), in path order; empty files and other text are not logs. Every
    file looked at goes to `seen` (a node's files without an error count its ranks)."""
    from .logs import looks_like_log

    found = []
    for f in itertools.islice((f for f in sorted(directory.rglob("*")) if f.suffix in _LOG_SUFFIXES), _LOGS_SEARCHED):
        seen.append(str(f))
        with contextlib.suppress(OSError):
            if f.is_file() and f.stat().st_size and looks_like_log(f):
                found.append(f)
    return found


def _read_path(p: Path, name: str, progress, lazy: bool, seen: list[str]) -> list[Run]:
    """The runs in one path: the traces of a directory, a trace, or a log (bad input: InputError naming `name`);
    the files looked at below a directory of logs go to `seen`."""
    if not p.exists():
        raise InputError(f"{name}: no such file or directory; pass a trace written by `ac-diff run` "
                         "(default ac-diff-out/) or a log torch printed")
    if p.is_dir():
        files = trace_files(p)
        if not files:
            inside = sorted(d.name for d in p.iterdir() if d.is_dir() and trace_files(d))
            if inside:  # (`ac-diff fix`'s output: base/, try-1/, ...; per-rank directories copied from nodes)
                raise InputError(f"{name}: no trace files in this directory itself, but in its subdirectories "
                                 f"{', '.join(inside[:4])}{' ...' if len(inside) > 4 else ''}: pass one of them "
                                 f"(`ac-diff report {os.path.join(name, inside[0])}`)")
            logs = _logs_below(p, seen)
            if logs:  # (torchrun --log-dir: <dir>/<run>/attempt_0/<rank>/stderr.log)
                from .logs import parse_log

                return [parse_log(f, progress=progress, lazy=lazy) for f in logs]
            raise InputError(f"{name}: no trace files (trace-rank*.jsonl) and no log with a torch.utils.checkpoint "
                             "error in this directory; run `ac-diff run SCRIPT` first, or pass a log file")
        return _read_directory(files, name, lazy)
    if p.stat().st_size == 0:
        raise NothingToExplain(name, f"{name}: {'nothing came in' if name == STDIN else 'the file is empty'}; pass a "
                               "trace written by `ac-diff run` or a log torch printed", why="it is empty")
    if is_trace(p):
        return [read_run(p, lazy)]
    from .logs import is_text, looks_like_log, parse_log

    if not looks_like_log(p):
        from .streams import stream_damage

        damage = stream_damage(p)
        if damage:
            raise InputError(f"{name}: the compressed file is damaged ({damage}); copy it again from where it "
                             "was written (or decompress what is readable: zcat FILE > FILE.log)")
        raise NothingToExplain(name, f"{name}: neither an ac-diff trace nor a log with a torch.utils.checkpoint "
                               "error or debug dump in it, so there is nothing in it to explain; a log without one "
                               "does not show the recomputes matched (use_reentrant=True and determinism_check=\"none\" "
                               "raise nothing when they differ): pass the log that holds the CheckpointError, or check "
                               "the script with `ac-diff run --check` (`--reference no-ac` compares its gradients)",
                               text=is_text(p))
    return [parse_log(p, progress=progress, lazy=lazy)]


def _read_directory(files: list[Path], name: str, lazy: bool) -> list[Run]:
    """The traces of a directory: one that cannot be read (empty, its header cut or damaged: a rank killed as it
    began, a copy cut short) is left out with a note, and its rank, missing from the run, keeps the report from
    being clean; where none can be read, the first one's error."""
    runs: list[Run] = []
    unread: list[tuple[Path, Exception]] = []
    for f in files:
        try:
            runs.append(read_run(f, lazy))
        except TraceFormatError as exc:
            unread.append((f, exc))
    if not runs:
        first, exc = unread[0]
        if first.stat().st_size == 0:
            raise InputError(f"{first}: the file is empty (its rank wrote nothing: killed as it began?); pass a "
                             "trace written by `ac-diff run`")
        raise exc
    for f, exc in unread:
        why = "it is empty" if f.stat().st_size == 0 else str(exc).split(";")[0].replace(str(f), "its header")
        runs[0].notes.append(f"{f} was left out ({why}): that rank's results are missing, so the report is never "
                             "clean")
        match = re.fullmatch(r"trace-rank(\d+)\.jsonl(?:\.gz)?", f.name)
        if match:
            runs[0].unreadable_ranks.append(int(match[1]))
    return runs


def _rename(run: Run, read_as: str, name: str) -> None:
    """Call a run by the name the user knows (`<stdin>`) where it was read from a temporary copy."""
    if name != read_as:
        run.path = name
        run.notes = [note.replace(read_as, name) for note in run.notes]


def diagnose_paths(paths: Iterable[str | os.PathLike] | str | os.PathLike, settings: Settings = Settings(),
                   progress=None) -> Report:
    return diagnose(read_runs(paths, progress=progress, lazy=True), settings)


@dataclass
class Trace:
    """A loaded trace (one or more ranks): the header and pandas views of regions, ops and positions."""

    runs: list[Run]
    header: dict[str, Any] = field(default_factory=dict)

    @functools.cached_property
    def report(self) -> Report:
        """The diagnosis of these runs (what `ac-diff report` prints)."""
        return diagnose(self.runs)

    @property
    def regions(self) -> "pd.DataFrame":
        rows = []
        diagnosed = {(r.rank, r.region): r for r in self.report.regions}
        for run in self.runs:
            for r in run.regions:
                found = diagnosed.get((r.rank, r.region))
                rows.append({
                    "status": found.status if found else None, "silent": found.silent if found else None,
                    "cause": found.cause.kind if found and found.cause else None,
                    "rank": r.rank, "region": r.region, "module": r.module, "kind": r.kind, "parent": r.parent,
                    "forward_ops": op_count(r.forward), "recompute_ops": op_count(r.recompute),
                    "forward_positions": len(r.forward.positions) if r.forward else 0,
                    "recompute_positions": len(r.recompute.positions) if r.recompute else 0,
                    "recomputes": r.recomputes, "early_stop": r.options.get("early_stop"),
                    "determinism_check": r.options.get("determinism_check"),
                    "preserve_rng_state": r.options.get("preserve_rng_state"), "sac": bool(r.options.get("sac")),
                    "watched": r.watched, "step": r.step,
                })
        return _frame(rows, _REGION_COLUMNS)

    @property
    def ops(self) -> "pd.DataFrame":
        rows = []
        for run, r, p in self._passes():
            for o in p.ops:
                rows.append({
                    "rank": r.rank, "region": r.region, "phase": p.phase, "attempt": p.attempt, "index": o.index,
                    "op": o.op, "module": o.module, "source": o.source,
                    "in_shapes": [list(m.shape) for m in o.inputs],
                    "out_shapes": [list(m.shape) if type(m) is TensorMeta else None for m in o.out],
                    "out_dtypes": [m.dtype if type(m) is TensorMeta else None if m is None else type(m).__name__
                                   for m in o.out], "args": o.args, "fingerprint": o.fingerprint,
                    "host_value": o.host_value, "cached": o.cached, "random": o.random, "discrete": o.discrete,
                    "derived": o.derived,
                })
        return _frame(rows, _OP_COLUMNS)

    @property
    def positions(self) -> "pd.DataFrame":
        rows = []
        for run, r, p in self._passes():
            ops = {o.index: o for o in p.ops}
            for pos in p.positions:
                op = ops.get(pos.op_index) if pos.origin == "op" else None
                rows.append({
                    "rank": r.rank, "region": r.region, "phase": p.phase, "position": pos.position,
                    "op_index": pos.op_index, "op": op.op if op else None, "module": op.module if op else None,
                    "source": op.source if op else None, "origin": pos.origin, "name": pos.name,
                    "shape": list(pos.meta.shape) if pos.meta else None, "dtype": pos.meta.dtype if pos.meta else None,
                })
        return _frame(rows, _POSITION_COLUMNS)

    def _passes(self):
        for run in self.runs:
            for r in run.regions:
                for phase in PHASES:
                    p = getattr(r, phase)
                    if p is not None:
                        yield run, r, p
                for p in r.later:  # recomputes by later backwards (their `attempt` says which)
                    yield run, r, p


_REGION_COLUMNS = ["rank", "region", "module", "kind", "status", "silent", "cause", "parent", "forward_ops",
                   "recompute_ops", "forward_positions",
                   "recompute_positions", "recomputes", "early_stop", "determinism_check", "preserve_rng_state", "sac",
                   "watched", "step"]
_OP_COLUMNS = ["rank", "region", "phase", "attempt", "index", "op", "module", "source", "in_shapes", "out_shapes",
               "out_dtypes", "args", "fingerprint", "host_value", "cached", "random", "discrete", "derived"]
_POSITION_COLUMNS = ["rank", "region", "phase", "position", "op_index", "op", "module", "source", "origin", "name",
                     "shape", "dtype"]



def load(path: str | os.PathLike) -> Trace:
    """Load a trace file or a directory of per-rank traces. Warns if a trace is truncated or has damaged lines."""
    files = trace_files(path)
    if not files or not Path(files[0]).exists():
        raise InputError(f"{path}: no trace found; pass a file or directory written by `ac-diff run`")
    runs = [read_run(f) for f in files]
    for run in runs:
        if run.truncated:
            warnings.warn(f"ac-diff: {run.path} is truncated (no end record): the process stopped before the "
                          "trace was finished; what was recorded up to then is loaded", RuntimeWarning, stacklevel=2)
        if run.damaged:
            hit = [r.region for r in run.regions if r.damaged]
            warnings.warn(f"ac-diff: {run.path}: {run.damaged} damaged line(s) skipped (checksum or JSON): the ops of "
                          + (f"region(s) {', '.join(map(str, hit[:8]))}{', ...' if len(hit) > 8 else ''} are "
                             "incomplete" if hit else "a region are missing") + "; re-record to have them all",
                          RuntimeWarning, stacklevel=2)
    return Trace(runs=runs, header=runs[0].header if runs else {})


__all__ = ["load", "Trace", "read_runs", "diagnose_paths", "InputError", "TraceFormatError"]
