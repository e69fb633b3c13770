"""The streaming state machine: logical segments in, one Run(source="log") out.

    p = LogParser(path="rank1.log")
    for text, ended in iter_lines(stream, p.read_stats):
        p.feed(text, ended)
    run = p.finish()
    # Run(source="log", errors=[TorchError("metadata_mismatch", rank=1, positions=[...], region=0)],
    #     regions=[Region(rank=1, region=0, kind="log", forward=Pass(...), recompute=Pass(...))],
    #     notes=["skipped 7 garbled lines (op lines or metadata entries that could not be read)", ...],
    #     truncated=True)

Every rank has its own state (an open error, an open dump, an open traceback), so lines of
several ranks interleaved in one file continue their own structures. A line without a rank prefix
belongs to the rank of the line before it. Nothing here raises on content: what cannot be used is
counted and reported in Run.notes.

An error or a dump is final when the next one begins on its rank (or the log ends): the error is then
counted in (repetitions fold into one TorchError with their count, repeats.py), the dump becomes its
Region, whose ops go to the spill when there is one (spill.py). So the parser holds one open error and
one open dump per rank, whatever the length of the log.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ac_diff.logs import dump as D
from ac_diff.logs.errors import (COUNT_MISMATCH, METADATA_MISMATCH, ErrorBuilder, classify_error_line,
                                 reentrant_output_shapes, wrong_gradient_shape)
from ac_diff.logs.lines import (ReadStats, global_ranks, node_and_local, per_node, rank_in_path, split_segments,
                               srun_label)
from ac_diff.logs.memo import short_text_memo
from ac_diff.logs.oplines import GARBLED, OK, SALVAGED, looks_like_op, parse_op_line
from ac_diff.logs.repeats import ErrorTally, dump_key, fold_errors, fold_repeated_dumps
from ac_diff.logs.spill import RegionSpill, ops_bytes
from ac_diff.passes import Pass, Region, Run

_EXCEPTION_LINE = re.compile(r"[A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit)\b")
_TRACEBACK = "Traceback (most recent call last)"
_CHAINED = ("The above exception was the direct cause", "During handling of the above exception")
# where a traceback passes through code torch.compile made or runs (AOTAutograd's compiled backward, Dynamo, inductor);
# not Dynamo's eval_frame.py alone, whose wrapper also runs what torch._disable_dynamo keeps from it (checkpoint's
# recompute, its selective-AC dispatch mode: eager code)
_COMPILED_FRAMES = re.compile(r"torch[/\\]_(?:functorch[/\\]_aot_autograd|dynamo[/\\](?!eval_frame\.py)|inductor)[/\\]?"
                              r"|compiled_function_backward")
# the frame of reentrant checkpoint's backward (CheckpointFunction.backward), where it runs the recompute's backward
_REENTRANT_BACKWARD_FRAME = re.compile(r"torch[/\\]utils[/\\]checkpoint\.py\", line \d+, in backward$")
# torch's UserWarning where checkpoint(use_reentrant=True) got no input that requires grad (printed once per process)
_NO_GRAD_INPUTS = "None of the inputs have requires_grad=True"
_NO_GRAD_WARNING = re.compile(r"\.py:\d+: UserWarning: " + re.escape(_NO_GRAD_INPUTS))  # (as warnings prints it)
_segments_of = short_text_memo(split_segments)  # a log repeats its lines: each distinct one is split once


MAX_ORPHANS = 1 << 20  # op lines kept as a possible forward tail (a log that starts inside a dump's op list)


@dataclass(slots=True)
class _RankState:
    rank: int | None
    error: ErrorBuilder | None = None  # the error being read (or last read)
    dump: D.DumpBuilder | None = None  # the dump being read (or last read, in its footer)
    dump_at: int = 0  # its place in the log's regions
    dumps: int = 0
    traceback_open: bool = False
    compiled_frames: bool = False  # the last traceback passed through torch.compile's code (`_COMPILED_FRAMES`)
    seen: bool = False  # any error or dump started on this rank
    # op lines of an op list read before any dump began on this rank (the log starts inside a dump's forward list):
    # the forward's tail if its recompute's list follows (`_dump_marker`)
    orphans: list = field(default_factory=list)


@dataclass(slots=True)
class _Counts:
    garbled: int = 0  # op lines / entries that could not be read at all
    salvaged_ops: int = 0
    cut_entries: int = 0  # metadata dicts cut or garbled (counted by ErrorBuilder)
    ops_outside: int = 0  # op lines outside any debug dump
    unplaced_ops: int = 0  # op lines in a stack-trace section without "(i of n in ...)" (from the dumps)
    # who had each kind of trouble, and how often: {"rank 1": 3}
    headerless_errors: dict[str, int] = field(default_factory=dict)
    mid_dumps: dict[str, int] = field(default_factory=dict)
    cut_dumps: dict[str, int] = field(default_factory=dict)


def _who(rank: int | None) -> str:
    placed = node_and_local(rank)  # (read before the ranks per node are known)
    if placed is not None:
        return f"node {placed[0]}'s local rank {placed[1]}"
    return f"rank {rank}" if rank is not None else "the unprefixed output"


class LogParser:
    """Feed it physical lines in order; `finish()` returns the Run."""

    def __init__(self, path: str | None = None, spill: RegionSpill | None = None) -> None:
        """`spill`: where each finished region's ops go (parse_log(lazy=True)); None keeps them in the Run."""
        self.path = path
        self._spill = spill
        self.read_stats = ReadStats()
        self._ranks: dict[int | None, _RankState] = {}
        self._errors = ErrorTally()  # the errors read to their end, repetitions folded
        self._errors_started = 0
        self._dumps: list[D.DumpBuilder | Region] = []  # in the order they started; a Region once read to its end
        self._dump_keys: dict[int, tuple] = {}  # index in _dumps -> (rank as its lines carry it, dump_key)
        self._counts = _Counts()
        self._home = rank_in_path(path)  # (unprefixed lines: the rank the file's path names)
        self._last_rank: int | None = self._home
        self._seen: set[int] = set()  # ranks the lines named, up to two (a log of several ranks' lines)
        self._by_prefix = False  # a launcher's prefix named _last_rank (not a logger's tag, not the path)
        self._tail: tuple[int | None, str, bool] | None = None  # last line if it had no newline
        self._at_cut = False
        self._raised: tuple[int | None, str] | None = None  # the last exception a traceback in the log ended with
        self._raised_by: dict[int, str] = {}  # rank -> the first exception a traceback of its ended with
        self._reentrant_backward = False  # a traceback ran through reentrant checkpoint's backward
        self._line = ""  # the physical line being read
        self._labelled: bool | None = None  # every line starts with srun --label's `N: ` (its first line says)

    # ------------------------------------------------------------------ input

    def feed(self, text: str, ended: bool = True) -> None:
        """One physical line (without its newline); `ended` is False if no newline followed it."""
        try:
            self._line = text
            if self._labelled is None and text.strip():
                self._labelled = srun_label(text) is not None
            labelled = srun_label(text) if self._labelled else None
            if labelled is not None:
                self._last_rank, text = labelled
            segments, self._last_rank, self._by_prefix = _segments_of(text, self._last_rank, self._home,
                                                                      len(self._seen) > 1, self._by_prefix,
                                                                      labelled[0] if labelled else None)
            if self._last_rank is not None and len(self._seen) < 2:
                self._seen.add(self._last_rank)
            complete = True
            last = len(segments) - 1
            for i, (rank, body) in enumerate(segments):
                self._at_cut = not ended and i == last  # this segment's end may be cut short
                complete = self._segment(rank, body)
            self._at_cut = False
            if ended or not segments:
                self._tail = None
            else:
                self._tail = (segments[-1][0], segments[-1][1], complete)
        except Exception:  # noqa: BLE001 - the contract is to never raise on content
            self._counts.garbled += 1

    def _state(self, rank: int | None) -> _RankState:
        st = self._ranks.get(rank)
        if st is None:
            st = self._ranks[rank] = _RankState(rank)
        return st

    def _segment(self, rank: int | None, body: str) -> bool:
        """Handle one logical line; returns True if it was a whole structural element."""
        st = self._state(rank)
        c = body[0]
        if _NO_GRAD_INPUTS in body and _NO_GRAD_WARNING.search(body):  # (its line starts with torch's path)
            self._no_grad_inputs(st)
            return True
        if c == "/" or c == "?":  # stack frames: by far the most lines of a dump
            if st.dump is not None and st.dump.wants_frames:
                st.dump.frame(body)
            return False
        if looks_like_op(body):
            return self._op(st, body)
        cls = classify_error_line(body)
        if cls is not None:
            return self._error_line(st, body, cls)
        in_footer = st.dump is not None and st.dump.in_footer
        section = D.classify_dump_line(body, in_footer)
        if section is not None:
            self._dump_marker(st, section)
            return True
        if body.startswith(D.RULE):
            if st.dump is not None:
                st.dump.rule()
            return True
        if c == "T" and body.startswith(_TRACEBACK):
            self._close_error(st)
            self._cut_dump(st)
            st.traceback_open, st.compiled_frames = True, False
            return True
        if st.traceback_open and c == "F" and _COMPILED_FRAMES.search(body):
            st.compiled_frames = True
            return True
        if st.traceback_open and c == "F" and _REENTRANT_BACKWARD_FRAME.search(body):
            self._reentrant_backward = True
            return True
        if c in "TD" and body.startswith(_CHAINED):
            self._close_error(st)
            st.compiled_frames = False
            return True
        if st.traceback_open and _EXCEPTION_LINE.match(body):
            st.traceback_open = False
            whole = self._line[self._line.find(body):] if body in self._line else body  # (a "[file:line]" in the
            self._raised = (rank, whole.strip())  # message reads as a prefix: the physical line keeps it)
            if rank is not None:  # (its first: torchrun's own traceback follows, unprefixed, after the last rank's)
                self._raised_by.setdefault(rank, whole.strip()[:300])
            return True
        if st.dump is not None and st.dump.wants_frames:
            st.dump.frame(body)  # a frame with a relative path
        return False

    # ------------------------------------------------------------------ errors

    def _close_error(self, st: _RankState) -> None:
        if st.error is not None:
            st.error.closed = True

    def _cut_dump(self, st: _RankState) -> None:
        """An error or traceback began on this rank: a dump still open there was cut short."""
        d = st.dump
        if d is not None and not d.closed:
            d.cut = True
            _tally(self._counts.cut_dumps, _who(st.rank))

    def _new_error(self, st: _RankState, kind: str, header: str | None) -> ErrorBuilder:
        self._cut_dump(st)
        self._retire_error(st)
        b = ErrorBuilder.start(kind, st.rank, header, line=self.read_stats.lines, seq=self._errors_started)
        self._errors_started += 1
        if header is None:
            _tally(self._counts.headerless_errors, _who(st.rank) + (" (the log starts inside it)" if not st.seen else ""))
        st.error = b
        st.seen = True
        return b

    def _retire_error(self, st: _RankState) -> None:
        """The rank's last error is read to its end (another begins, or the log ends): count it in."""
        b = st.error
        if b is not None:
            st.error = None
            self._counts.cut_entries += b.cut_entries
            self._errors.add(b.finish(), b.seq)

    def _error_line(self, st: _RankState, body: str, cls: tuple) -> bool:
        what, value = cls[0], cls[1]
        b = st.error
        if what == "header":
            st.traceback_open = False  # (the traceback's frames are read: whether they passed compiled code stays)
            self._new_error(st, value, body).error.compiled = st.compiled_frames  # type: ignore[arg-type]
            return True
        if what == "position":
            if (b is None or b.closed or b.error.kind != METADATA_MISMATCH
                    or (b.last_position is not None and value <= b.last_position)):  # type: ignore[operator]
                b = self._new_error(st, METADATA_MISMATCH, None)
            b.position(value)  # type: ignore[arg-type]
            b.add_text(body)
            return True
        if what == "saved" or what == "recomputed":
            if b is None or b.closed or b.error.kind != METADATA_MISMATCH:
                b = self._new_error(st, METADATA_MISMATCH, None)
            whole = b.metadata(what, value)  # type: ignore[arg-type]
            b.add_text(body)
            return whole
        if what == "count_saved" or what == "count_recomputed":
            if self._at_cut and not cls[2]:
                self._counts.garbled += 1  # "...forward: 26" at the cut may have been 2634
                return False
            if b is None or b.closed or b.error.kind != COUNT_MISMATCH:
                b = self._new_error(st, COUNT_MISMATCH, None)
            b.count(what, value)  # type: ignore[arg-type]
            b.add_text(body)
            return True
        if what == "end":
            if b is not None:
                b.closed = True
            return True
        self._counts.garbled += 1  # "garbled": an entry line whose number could not be read
        return False

    def _no_grad_inputs(self, st: _RankState) -> None:
        """torch's warning that a reentrant checkpoint got no input requiring grad: a region of its own, its forward
        marked as the recorder marks one (region.options["no_grad_inputs"], -1: which parameters it read is not in
        the log), for diagnosis to say its parameters may get no gradient."""
        region = Region(rank=st.rank, region=st.dumps, module=None, kind="log",  # type: ignore[arg-type]
                        options={"no_grad_inputs": -1}, forward=Pass("forward"))
        self._dump_keys[len(self._dumps)] = (st.rank, dump_key(region, b""))
        self._dumps.append(region)
        st.dumps += 1
        st.seen = True

    # ------------------------------------------------------------------ dumps

    def _new_dump(self, st: _RankState, started_mid: bool) -> D.DumpBuilder:
        self._cut_dump(st)
        self._retire_dump(st)
        d = D.DumpBuilder(st.rank, st.dumps, started_mid=started_mid)
        st.dumps += 1
        if started_mid:
            _tally(self._counts.mid_dumps, _who(st.rank))
        # the error printed just before a dump is the one the dump explains ("direct cause")
        if st.error is not None and st.error.error.region is None:
            st.error.error.region = d.region
        self._close_error(st)
        st.dump, st.dump_at = d, len(self._dumps)
        st.seen = True
        self._dumps.append(d)
        return d

    def _retire_dump(self, st: _RankState) -> None:
        """The rank's last dump is read to its end (another begins, or the log ends): its region is final."""
        d = st.dump
        if d is not None:
            st.dump = None
            self._counts.unplaced_ops += d.unplaced_ops
            region = d.finish()
            ops = ops_bytes(region)
            self._dump_keys[st.dump_at] = (st.rank, dump_key(region, ops))
            self._dumps[st.dump_at] = self._spill.put(region, ops) if self._spill is not None else region

    def _dump_marker(self, st: _RankState, section: int) -> None:
        d = st.dump
        if section == D.S_START:  # "CheckpointError: An error happened ...": also ends the traceback
            st.traceback_open = False
            self._new_dump(st, started_mid=False)
            return
        if section == D.S_FOOTER and (d is None or d.closed):
            return  # a footer on its own: nothing to collect
        if d is None or d.closed or (section <= d.section and d.section != D.S_START):
            orphans, st.orphans = st.orphans, []
            d = self._new_dump(st, started_mid=section != D.S_TRACES_FWD)
            if section == D.S_LIST_RECOMPUTE and orphans:  # the forward list's tail: the log began inside it
                d.forward_tail(orphans)
                self._counts.ops_outside -= len(orphans)
        d.marker(section)

    def _op(self, st: _RankState, body: str) -> bool:
        parsed = parse_op_line(body)
        if parsed.status == GARBLED:
            self._counts.garbled += 1
            if st.dump is not None and not st.dump.closed:
                st.dump.lost_line()
            return False
        if parsed.status == SALVAGED:
            self._counts.salvaged_ops += 1
        d = st.dump
        if parsed.ordinal is not None:
            if d is None or d.closed or d.section >= D.S_LOG:
                d = self._new_dump(st, started_mid=parsed.ordinal[0] != 1 or parsed.ordinal[2] != "original")
            if parsed.ordinal[2] == "recompute" and d.section < D.S_TRACES_RECOMPUTE:
                d.section = D.S_TRACES_RECOMPUTE
        elif d is None or d.closed:
            self._counts.ops_outside += 1
            if not st.seen and len(st.orphans) < MAX_ORPHANS:
                st.orphans.append(parsed)
            return False
        d.op(parsed)  # an op it cannot place is counted in d.unplaced_ops
        if parsed.trailing:  # a flattened log: the frames follow on the same line
            for token in parsed.trailing.split():
                if not d.wants_frames:
                    break
                d.frame(token)
        return parsed.status == OK

    # ------------------------------------------------------------------ output

    def finish(self) -> Run:
        """Close every open structure and build the Run (never raises)."""
        run = Run(source="log", path=self.path)
        try:
            self._finish(run)
        except Exception as exc:  # noqa: BLE001 - report instead of raising
            run.notes.append(f"internal parser error while finishing: {type(exc).__name__}: {exc}")
        return run

    def _finish(self, run: Run) -> None:
        stopped: list[str] = []
        for st in self._ranks.values():
            who = _who(st.rank)
            if st.error is not None and (why := st.error.incomplete()):
                stopped.append(f"{who}: inside {why}")
            elif (self._tail is not None and st.error is not None and not st.error.closed
                  and self._tail[0] == st.rank and not self._tail[2]):
                stopped.append(f"{who}: inside a CheckpointError message (last line cut: {self._tail[1][:40]!r})")
            if st.dump is not None and (why := st.dump.incomplete()):
                stopped.append(f"{who}: inside {why}")
            if st.traceback_open:
                stopped.append(f"{who}: inside a traceback, before its exception line")
        for st in self._ranks.values():
            self._retire_error(st)
            self._retire_dump(st)
        # every dump retired: all Regions
        run.regions, renumbered = fold_repeated_dumps(self._dumps, [self._dump_keys[i]  # type: ignore[arg-type]
                                                                    for i in range(len(self._dumps))])
        errors = self._errors.errors()
        for err in errors:
            if err.region is not None:
                err.region = renumbered.get((err.rank, err.region), err.region)
        run.errors = fold_errors(errors)
        if self._spill is not None:
            run.ops_loader = self._spill.loaded
        run.truncated = bool(stopped)
        to_global = global_ranks(list(self._ranks))  # (local ranks srun labels placed on their nodes)
        if to_global:
            for item in [*run.regions, *run.errors]:
                item.rank = to_global.get(item.rank, item.rank)
        ranks = sorted(to_global.get(r, r) for r in self._ranks if r is not None)
        rs = self.read_stats
        run.header = {"parser": "ac_diff.logs", "bytes": rs.bytes_read, "lines": rs.lines, "ranks": ranks,
                      "raised": {str(to_global.get(r, r)): text for r, text in sorted(self._raised_by.items())}}
        run.exit_status = "exception" if run.errors else None
        run.notes = self._notes(stopped)
        if to_global:
            run.notes.append(f"ranks: each line's srun label is its node and torchrun's [defaultN] its local rank, "
                             f"{per_node(to_global)} per node (the most any "
                             "node showed): global rank = node x that + local rank")

    def _notes(self, stopped: list[str]) -> list[str]:
        c = self._counts
        rs = self.read_stats
        notes: list[str] = []
        if c.garbled:
            notes.append(f"skipped {c.garbled} garbled line{'s' * (c.garbled != 1)} "
                         "(op lines or metadata entries that could not be read)")
        if c.salvaged_ops:
            notes.append(f"salvaged {c.salvaged_ops} op line{'s' * (c.salvaged_ops != 1)} that were cut or "
                         "spliced with other output; their outputs or arguments may be incomplete")
        if c.cut_entries:
            notes.append(f"{c.cut_entries} metadata entr{'ies' if c.cut_entries != 1 else 'y'} cut or garbled; "
                         "kept what could be read")
        if c.unplaced_ops:
            notes.append(f"ignored {c.unplaced_ops} op line{'s' * (c.unplaced_ops != 1)} in a stack-trace "
                         "section without their '(i of n in ...)' number")
        if c.ops_outside:
            notes.append(f"ignored {c.ops_outside} op line{'s' * (c.ops_outside != 1)} outside any debug=True dump")
        if c.headerless_errors:
            notes.append("error text without its CheckpointError header: " + _summary(c.headerless_errors))
        if c.mid_dumps:
            notes.append("debug=True dump read from the middle (its start is not in the log): "
                         + _summary(c.mid_dumps))
        if c.cut_dumps:
            notes.append("debug=True dump cut short by what followed it: " + _summary(c.cut_dumps))
        if rs.long_lines:
            notes.append(f"split {rs.long_lines} line{'s' * (rs.long_lines != 1)} longer than 1 MiB")
        if rs.undecodable_lines:
            notes.append(f"replaced bytes that are not UTF-8 on {rs.undecodable_lines} "
                         f"line{'s' * (rs.undecodable_lines != 1)}")
        if rs.stream_damaged and "CRC check failed" in rs.stream_damaged:  # checked once the data was all read
            notes.append(f"the compressed file fails its checksum ({rs.stream_damaged}): it was read to its end "
                         f"({rs.bytes_read} bytes), but some of it is corrupted; what this report shows may be wrong "
                         "where it was (copy the file again from where it was written)")
        elif rs.stream_damaged:
            notes.append(f"read only the first {rs.bytes_read} bytes: the rest could not be read "
                         f"({rs.stream_damaged}); what follows them is missing from this report")
        if stopped:
            notes.append("the log ends mid-structure: " + "; ".join(stopped))
        if not self._errors_started and not self._dumps:
            raised = self._raised
            notes.append("found no CheckpointError text and no debug=True dump" + (
                ", which does not show that the recomputes matched (use_reentrant=True and determinism_check='none' "
                "raise nothing when they differ): `ac-diff run --check SCRIPT` compares them" if raised is None else (
                    f"; it ends with {'rank ' + str(raised[0]) + ' raising ' if raised[0] is not None else ''}"
                    f"{raised[1][:160]}" + ("..." if len(raised[1]) > 160 else ""))))
            mismatch = reentrant_output_shapes(raised[1] if raised is not None else None)
            if mismatch is not None and self._reentrant_backward:
                notes.append(f"the backward of a use_reentrant=True checkpoint got a gradient of shape {mismatch[0]} "
                             f"(its forward's output) for its recompute's output of shape {mismatch[1]}: the "
                             "recompute computed other shapes than the forward (reentrant checkpoint compares nothing "
                             "else); `ac-diff run` on the script names the op and the cause")
            shapes = wrong_gradient_shape(raised[1] if raised is not None else None)
            if shapes is not None:
                notes.append(f"{shapes[0]} returned a gradient of shape {shapes[1]} for an input of shape {shapes[2]}: "
                             "that is how a recompute that computed other shapes than its forward ends where "
                             "checkpoint compared nothing (determinism_check=\"none\"); with torch's check on, the "
                             "backward raises a CheckpointError naming the positions, and `ac-diff run` on the script "
                             "names the op and the cause")
        return notes


def _tally(counts: dict[str, int], who: str) -> None:
    counts[who] = counts.get(who, 0) + 1


def _summary(counts: dict[str, int], limit: int = 5) -> str:
    """`rank 1, rank 3 (x2)` in first-seen order, at most `limit` distinct entries."""
    parts = [k + (f" (x{n})" if n > 1 else "") for k, n in counts.items()]
    more = len(parts) - limit
    return ", ".join(parts[:limit]) + (f", and {more} more" if more > 0 else "")
