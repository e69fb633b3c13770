"""A `checkpoint(debug=True)` dump, section by section, into one Region.

torch's layout (`_checkpoint_error_template` and `get_str_tb` in torch/utils/checkpoint.py):

    An error happened while unpacking tensors; dumping logs of latest computation
    |        1. Stack traces of the operators that ran in the original forward     |
    $1: bf16[1, 128, 5120] = torch._ops.aten.view.default($0, ['1', '128', '5120'])   (1 of 289 in original)
    /home/u/torchtitan/experiments/llama4/model/model.py:337:forward      <- frames, innermost first
    |        2. Stack traces of the operators that ran during recomputation        |
    ...   (k of n in recompute)
    |       3. Log of operators in the original forward and recomputation          |
    Operations executed during the original forward:
    $1: ... (the op list, no suffix)
    Operations executed during recomputation:
    ...
    +------------------------------------------------------------------------------+
     ERROR: Detected non-determinism while running activation checkpointing     <- footer

    DumpBuilder(rank=1, region=0) fed those segments -> .finish() ->
    Region(rank=1, region=0, module=None, kind="log", options={"debug": True},
           forward=Pass("forward", ops=[OpRecord(0, "aten.view.default", out=[bf16[1, 128, 5120]],
                        args=["$0", [1, 128, 5120]], log_ids=(["$1"], ["$0"]),
                        source="llama4/model/model.py:337 in forward"), ...]),
           recompute=Pass("recompute", ops=[...], complete=False))

Each pass comes from the op list of section 3, or from the numbered ops of section 1/2 when those
are all there (they carry explicit indices) or when section 3 is missing. Sources come from the
frames under each numbered op: the innermost Python frame outside torch and the standard library.
OpRecord.index is the op's place in its pass as listed (0-based, contiguous).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ac_diff.align import align
from ac_diff.logs.oplines import OK, ParsedOp
from ac_diff.passes import FORWARD, RECOMPUTE, OpRecord, Pass, Region

# Section markers, checked on segments that reached the dump parser.
START = "An error happened while unpacking tensors"
SECTION1 = "1. Stack traces of the operators that ran in the original forward"
SECTION2 = "2. Stack traces of the operators that ran during recomputation"
SECTION3 = "3. Log of operators in the original forward and recomputation"
FORWARD_LIST = "Operations executed during the original forward"
RECOMPUTE_LIST = "Operations executed during recomputation"
FOOTER = "ERROR: Detected non-determinism while running activation checkpointing"
RULE = "+-----"

# Sections (DumpBuilder.section)
S_START, S_TRACES_FWD, S_TRACES_RECOMPUTE, S_LOG, S_LIST_FWD, S_LIST_RECOMPUTE, S_FOOTER = range(7)
_LABEL_PHASE = {"original": FORWARD, "forward": FORWARD, "recompute": RECOMPUTE, "recomputation": RECOMPUTE}

# path:line:name, where the path holds no colon but a drive's (a C++ frame spliced before it does not match); it
# may hold spaces ("/home/me/My Project/train.py", "C:\\Users\\John Smith\\train.py")
_PY_FRAME = re.compile(r"((?:[A-Za-z]:)?[^:]+?\.py):(\d+):([\w<>.-]+)\Z")
_STDLIB = re.compile(r"/lib/python\d[\d.]*/(?!site-packages/|dist-packages/)")
# nn.Module's call machinery is in every stack, so concurrent writers most often splice its frames
# onto some other path ("/dev-sandbox/ratnam" + "/modules/module.py:1809:inner"): never a source.
_MODULE_CALL = ("module.py", ("_call_impl", "_wrapped_call_impl", "inner", "__call__"))
ENTRY_OPS = 16  # ops whose stacks are read for a dump's entry (`DumpBuilder.entry`) at most
# a decorator's wrapper between checkpoint and the code it ran (transformers' `deprecate_kwarg` wraps a layer's
# forward in `wrapped_func`): not the region's entry
_WRAPPERS = frozenset({"wrapper", "wrapped", "wrapped_func", "inner", "_fn", "decorate_context", "wrapped_fn"})
# torch's checkpoint (or a wrapper's: FSDP's checkpoint_wrapper calls it) in an op's stack: the frames inside it
# are the region's
_CHECKPOINT_FRAME = re.compile(r"torch[/\\]utils[/\\]checkpoint\.py:\d+:")


def classify_dump_line(text: str, in_footer: bool) -> int | None:
    """The section a marker segment opens (S_*), or None if it is not a marker.

    The footer repeats the three section titles as a table of contents; they count only with the
    `|` of the real box, or outside the footer.
    """
    if START in text:
        return S_START
    boxed = text.startswith("|")
    if boxed or not in_footer:
        if SECTION1 in text:
            return S_TRACES_FWD
        if SECTION2 in text:
            return S_TRACES_RECOMPUTE
        if SECTION3 in text:
            return S_LOG
    if text.startswith(FORWARD_LIST):
        return S_LIST_FWD
    if text.startswith(RECOMPUTE_LIST):
        return S_LIST_RECOMPUTE
    if FOOTER in text:
        return S_FOOTER
    return None


def frame_source(text: str, keep: int = 3) -> str | None:
    """`/h/torchtitan/experiments/llama4/model/moe.py:40:forward` -> `llama4/model/moe.py:40 in forward`.

    The path keeps its last `keep` components, as the recorder's `sourceline.short_path` does for
    files outside the working directory. None for frames of torch, of Python itself (the standard
    library, C sources), for C++, and for nn.Module's call machinery.
    """
    if ".py:" not in text:
        return None
    m = _PY_FRAME.match(text)
    if not m:
        return None
    path, line, name = m.group(1), m.group(2), m.group(3)
    norm = path.replace("\\", "/")
    if "/torch/" in norm or norm.startswith("torch/") or _STDLIB.search(norm) or norm.startswith("<"):
        return None
    parts = [p for p in norm.split("/") if p]
    if parts and parts[-1] == _MODULE_CALL[0] and name in _MODULE_CALL[1]:
        return None
    whole = len(parts) <= keep and norm.startswith("/")  # /tmp/x/train.py stays absolute, not tmp/x/...
    return f"{'/' if whole else ''}{'/'.join(parts[-keep:])}:{line} in {name}"


@dataclass(slots=True)
class _Traced:
    """A numbered op of section 1/2 and the source found in the frames under it."""

    op: ParsedOp
    source: str | None = None


@dataclass(slots=True)
class _PassParts:
    traced: dict[int, _Traced] = field(default_factory=dict)
    total: int | None = None
    listed: list[ParsedOp] = field(default_factory=list)
    listed_seen: bool = False
    listed_done: bool = False
    lost: int = 0  # op lines of the list that could not be read (cut into by another writer)
    head_cut: bool = False  # the list's first ops are not in the log (it begins inside the list)


@dataclass(slots=True)
class DumpBuilder:
    """Collects one debug dump of one rank."""

    rank: int | None
    region: int
    section: int = S_START
    started_mid: bool = False  # the log started inside this dump
    cut: bool = False  # something else started on this rank before the footer
    unplaced_ops: int = 0  # op lines in a trace section without their "(i of n in ...)"
    parts: dict[str, _PassParts] = field(default_factory=lambda: {FORWARD: _PassParts(), RECOMPUTE: _PassParts()})
    current: _Traced | None = None
    # the code checkpoint() ran ("forward at llama4/model/moe.py:40"): the outermost user frame under the first
    # checkpoint frame of an op's stack; `_outermost`: the outermost user frame of the current op's stack so far
    entry: str | None = None
    _outermost: str | None = None
    _entry_ops: int = 0  # ops whose stacks were read for the entry (at most ENTRY_OPS: a stack may lack the frame)

    @property
    def closed(self) -> bool:
        """Finished: its footer was read, or it was cut by what came next on its rank."""
        return self.section == S_FOOTER or self.cut

    @property
    def in_footer(self) -> bool:
        return self.section == S_FOOTER

    def marker(self, section: int) -> None:
        """A section header was read."""
        if self.section == S_LIST_FWD and section >= S_LIST_RECOMPUTE:
            self.parts[FORWARD].listed_done = True
        if self.section == S_LIST_RECOMPUTE and section == S_FOOTER:
            self.parts[RECOMPUTE].listed_done = True
        if section == S_LIST_FWD:
            self.parts[FORWARD].listed_seen = True
        elif section == S_LIST_RECOMPUTE:
            self.parts[RECOMPUTE].listed_seen = True
        self.section = section
        self.current = None

    def forward_tail(self, ops: list[ParsedOp]) -> None:
        """The forward list's last ops, read before this dump's recompute list (the log began inside that list)."""
        parts = self.parts[FORWARD]
        parts.listed, parts.listed_seen, parts.listed_done, parts.head_cut = list(ops), True, True, True

    def rule(self) -> None:
        """The `+-----+` line that closes the recompute op list."""
        if self.section == S_LIST_RECOMPUTE:
            self.parts[RECOMPUTE].listed_done = True

    def op(self, parsed: ParsedOp) -> bool:
        """Place one op line; returns False if it could not be placed."""
        if parsed.ordinal is not None:
            i, n, label = parsed.ordinal
            phase = _LABEL_PHASE.get(label)
            if phase is None:
                phase = RECOMPUTE if self.section == S_TRACES_RECOMPUTE else FORWARD
            parts = self.parts[phase]
            parts.total = max(parts.total or 0, n)
            self.current = parts.traced[i] = _Traced(parsed)
            self._outermost = None
            self._entry_ops += self.entry is None
            return True
        self.current = None
        if self.section in (S_LIST_FWD, S_LOG):
            self.parts[FORWARD].listed_seen = True
            self.parts[FORWARD].listed.append(parsed)
            return True
        if self.section == S_LIST_RECOMPUTE:
            self.parts[RECOMPUTE].listed.append(parsed)
            return True
        self.unplaced_ops += 1
        return False

    def lost_line(self) -> None:
        """An op line of an op list that could not be read: that pass may lack an op it ran."""
        if self.section in (S_LIST_FWD, S_LOG):
            self.parts[FORWARD].lost += 1
        elif self.section == S_LIST_RECOMPUTE:
            self.parts[RECOMPUTE].lost += 1

    @property
    def wants_frames(self) -> bool:
        return self.current is not None and not self.cut and (
            self.current.source is None or self.entry is None and self._entry_ops <= ENTRY_OPS)

    def frame(self, text: str) -> None:
        """One frame under the current op, innermost first: its source is the first user frame; the region's
        entry, the last user frame before checkpoint's own (read from the first op whose stack shows it)."""
        source = frame_source(text)
        if source is not None:
            if self.current.source is None:
                self.current.source = source
            if source.rpartition(" in ")[2] not in _WRAPPERS:
                self._outermost = source
        elif self.entry is None and self._outermost is not None and _CHECKPOINT_FRAME.search(text):
            place, _, function = self._outermost.partition(" in ")
            self.entry = f"{function} at {place}"

    def incomplete(self) -> str | None:
        """Why this dump is unfinished if the log stopped now, or None."""
        if self.closed:
            return None
        return "a debug=True dump"

    def finish(self) -> Region:
        region_rank = self.rank if self.rank is not None else 0  # Region.rank is an int
        done = self.section == S_FOOTER
        forward = _build_pass(FORWARD, self.parts[FORWARD], done)
        recompute = _build_pass(RECOMPUTE, self.parts[RECOMPUTE], done)
        _from_the_tail(forward, recompute)
        _same_range(forward, recompute)
        return Region(rank=region_rank, region=self.region, module=self.entry, kind="log",
                      options={"debug": True}, forward=forward, recompute=recompute)


def _logged_once(ops: list[tuple[ParsedOp, str | None]]) -> list[tuple[ParsedOp, str | None]]:
    """(op, source) without an op logged twice in a row: the same op making the same `$N` ids from the same inputs
    (an id is made once). Nested checkpoints with debug=True log each op of the forward twice, once per capture mode
    it passed through."""
    out: list[tuple[ParsedOp, str | None]] = []
    for p, source in ops:
        last = out[-1][0] if out else None
        if last is None or not p.out_ids or p.status != OK or last.status != OK \
                or (last.op, last.out_ids, last.in_ids, last.args) != (p.op, p.out_ids, p.in_ids, p.args):
            out.append((p, source))
    return out


def _record(index: int, p: ParsedOp, source: str | None) -> OpRecord:
    return OpRecord(index=index, op=p.op, source=source, out=p.out, args=p.args,
                    host_value=p.host_value, log_ids=(p.out_ids, p.in_ids), damaged=p.status != "ok")


def _build_pass(phase: str, parts: _PassParts, footer_read: bool) -> Pass | None:
    traced = parts.traced
    if parts.total and len(traced) == parts.total and all(i in traced for i in range(1, parts.total + 1)):
        ops = [_record(k, p, source) for k, (p, source) in enumerate(
            _logged_once([(traced[i].op, traced[i].source) for i in range(1, parts.total + 1)]))]
        return Pass(phase, ops=ops, complete=True)
    if parts.listed_seen:
        sources: dict[tuple, str] = {}
        for t in traced.values():
            if t.source is not None:
                sources.setdefault(t.op.key, t.source)
        ops = [_record(k, p, source) for k, (p, source) in enumerate(
            _logged_once([(p, sources.get(p.key)) for p in parts.listed]))]
        p = Pass(phase, ops=ops, complete=parts.listed_done or footer_read)
        if parts.lost:
            p.state["lost_lines"] = parts.lost
        if parts.head_cut:
            p.state["head_cut"] = True
        return p
    if traced:  # a fragment: ops keep their numbers ("(20 of 26 in recompute)" is op 19)
        ops = [_record(i - 1, traced[i].op, traced[i].source) for i in sorted(traced)]
        return Pass(phase, ops=ops, complete=False)
    return None


_TAIL_ANCHOR = 3  # ops a forward's tail must share with the recompute to be placed (one `view` matches any view)


def _from_the_tail(forward: Pass | None, recompute: Pass | None) -> None:
    """A forward list the log has only from some op on (`head_cut`): the recompute's ops before the first one that
    tail shares have no counterpart in the log; they are dropped, and both passes start there."""
    if forward is None or recompute is None or not forward.state.pop("head_cut", False) or not forward.ops:
        return
    # aligned from their ends, where the two lists correspond: the tail's first op meets its counterpart, not an
    # earlier op of the same kind in the recompute's head
    n, m = len(forward.ops), len(recompute.ops)
    pairs = align([o.key for o in reversed(forward.ops)], [o.key for o in reversed(recompute.ops)])
    matched = [(n - 1 - p.forward, m - 1 - p.recompute) for p in pairs
               if p.forward is not None and p.recompute is not None]
    if len(matched) < min(_TAIL_ANCHOR, m):  # too little in common to tell where the tail sits: nothing compared
        forward.ops, recompute.ops = [], []
        return
    f0, r0 = min(matched)
    start = recompute.ops[r0].index
    recompute.ops = recompute.ops[r0:]
    forward.ops = forward.ops[f0:]
    for k, o in enumerate(forward.ops):  # (its ops numbered as the recompute's counterparts are)
        o.index = start + k
    for p in (forward, recompute):
        p.state["log_starts_at"] = start + 1


def _same_range(forward: Pass | None, recompute: Pass | None) -> None:
    """A log that starts inside a dump holds one pass from op N on: compare only the ops both passes
    have from there (aligning a fragment with a pass's beginning would pair unrelated ops)."""
    if forward is None or recompute is None or not forward.ops or not recompute.ops:
        return
    start = max(forward.ops[0].index, recompute.ops[0].index)
    if start == 0:
        return
    for p in (forward, recompute):
        if p.ops[0].index < start:
            p.ops = [o for o in p.ops if o.index >= start]
        p.state["log_starts_at"] = start + 1
    if not forward.ops or not recompute.ops:  # the two fragments do not overlap: nothing to compare
        forward.ops, recompute.ops = [], []
