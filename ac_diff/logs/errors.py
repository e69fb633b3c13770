"""The texts torch.utils.checkpoint raises, recognised line by line, and the TorchError they build.

The exact wording is torch's (torch/utils/checkpoint.py, 2.13; older releases use the same phrases):

    classify_error_line("torch.utils.checkpoint.CheckpointError: torch.utils.checkpoint: Recomputed "
                        "values for the following tensors have different metadata than during the "
                        "forward pass.")                       -> ("header", "metadata_mismatch")
    classify_error_line("tensor at position 48:")              -> ("position", 48)
    classify_error_line("saved metadata: {'shape': ...}")      -> ("saved", "{'shape': ...}")
    classify_error_line("recomputed metadata: {...}")          -> ("recomputed", "{...}")
    classify_error_line("Number of tensors saved during forward: 27")       -> ("count_saved", 27, False)
    classify_error_line("Number of tensors saved during recomputation: 8.") -> ("count_recomputed", 8, True)
        (the flag: something follows the number, so a cut in the line did not shorten it)
    classify_error_line(".")                                   -> ("end", None)
    classify_error_line("Tip: To see a more detailed error message, ...")   -> ("end", None)

ErrorBuilder collects one error's lines into a TorchError:

    TorchError(kind="metadata_mismatch", rank=1, message="torch.utils.checkpoint: Recomputed ...\\n"
               "tensor at position 48:\\n...",
               positions=[PositionMismatch(48, TensorMeta((99, 5120), "bf16", "xpu:1"),
                                               TensorMeta((98, 5120), "bf16", "xpu:1")), ...])

A metadata dict that was cut keeps what could be read (see `meta.parse_metadata`); an entry line
that comes without its header (a paste that starts mid-list) still becomes a PositionMismatch, with
position None when its "tensor at position N:" line is missing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ac_diff.logs.meta import parse_metadata_cached
from ac_diff.passes import PositionMismatch, TorchError

METADATA_MISMATCH = "metadata_mismatch"
COUNT_MISMATCH = "count_mismatch"
MORE_SAVED = "more_saved_in_recompute"
SAC_NOT_FOUND = "sac_not_found"
SAC_MUTATED = "sac_mutated"
OTHER = "other"

# (phrase, kind, where the message torch raised starts relative to the phrase or None): each phrase spans a
# line break of torch's source string literal, so the `raise CheckpointError(` source line a traceback
# shows never matches. CheckpointError's phrases are matched anywhere (torch words them for checkpoint
# alone); selective AC's RuntimeError texts must start the message (`_starts_message`), so prose quoting
# them (a README, a comment) is not read as an error.
HEADER_PHRASES = (
    ("Recomputed values for the following tensors have different metadata", METADATA_MISMATCH, None),
    ("A different number of tensors was saved during the original forward and recomputation",
     COUNT_MISMATCH, None),
    ("trying to save more tensors during recomputation than during the original forward", MORE_SAVED, None),
    # "{func} [invocation index N] encountered during backward[,] but not found in storage"
    ("not found in storage", SAC_NOT_FOUND,
     re.compile(r"[\w.]+(?: invocation index \d+)? encountered during backward,? but $")),
    ("Tensor cached during selective activation checkpoint has been mutated", SAC_MUTATED, re.compile("$")),
)
# what may come before a message torch raised: nothing, an exception's class ("RuntimeError: ", also after
# a JSON log's escaped newline), or a JSON key ('"error": "')
_MESSAGE_LEAD = re.compile(r'(?:^|(?:^|\\n|[\s"])[\w.]*(?:Error|Exception)\s*:\s*|"\w+"\s*:\s*")$')
DUMP_START = "An error happened while unpacking tensors; dumping logs"
_EXCEPTION_TAG = "CheckpointError:"

_POSITION = re.compile(r"tensor at position (\d+):")  # the colon proves the number was not cut short
_COUNT = re.compile(r"Number of tensors saved during (forward|recomputation)\s*:\s*(\d+)(\D?)")
_EXC_PREFIX = re.compile(r"^(?:[\w.]*(?:Error|Exception))\s*:\s*")

MAX_MESSAGE = 64 * 1024  # characters of raw text kept in TorchError.message

# autograd's check that a tensor saved for the backward was not written in place since (torch/csrc/autograd/
# saved_variable.cpp): "... modified by an inplace operation: [torch.cuda.FloatTensor [3, 8, 32]] is at version 1;
# expected version 0 instead.", with ", which is output 0 of MulBackward0," before "is at" for a tensor an op made
_VERSION_CHECK = re.compile(r"modified by an inplace operation: \[[^\[\]]*\[([\d, ]*)\]\]"
                            r"(?:, which is output \d+ of [^,]*,)? is at version (\d+); expected version (\d+)")


def version_check(message: str | None) -> tuple[tuple[int, ...], int, int] | None:
    """(shape, version now, version saved) where `message` is autograd's version check on a saved tensor, else None:
    `version_check("... inplace operation: [torch.FloatTensor [3, 8, 32]] is at version 1; expected version 0 ...")`
    -> ((3, 8, 32), 1, 0)."""
    hit = _VERSION_CHECK.search(message or "")
    if hit is None:
        return None
    shape = tuple(int(n) for n in hit.group(1).replace(" ", "").split(",") if n)
    return shape, int(hit.group(2)), int(hit.group(3))


# autograd's check of a node's gradient against its input's metadata (torch/csrc/autograd/engine.cpp validate_outputs):
# "Function IndexAddBackward0 returned an invalid gradient at index 1 - got [31, 64] but expected shape compatible with
# [12, 64]": what a recompute that computed other shapes ends in when checkpoint compared nothing
_WRONG_GRADIENT_SHAPE = re.compile(r"Function (\w+) returned an invalid gradient at index \d+ - got (\[[\d, ]*\]) but "
                                   r"expected shape compatible with (\[[\d, ]*\])")


def wrong_gradient_shape(message: str | None) -> tuple[str, str, str] | None:
    """(node, shape got, shape expected) where `message` is autograd's gradient shape check, else None."""
    hit = _WRONG_GRADIENT_SHAPE.search(message or "")
    return (hit.group(1), hit.group(2), hit.group(3)) if hit else None


# autograd's check of a gradient handed to backward (torch/autograd/__init__.py _make_grads): "Mismatch in shape:
# grad_output[0] has a shape of torch.Size([21, 32]) and output[0] has a shape of torch.Size([16, 32])."; raised in
# reentrant checkpoint's backward, the forward output's gradient against the recompute's output
_OUTPUT_SHAPE_MISMATCH = re.compile(r"Mismatch in shape: grad_output\[\d+\] has a shape of "
                                    r"torch\.Size\((\[[\d, ]*\])\) and output\[\d+\] has a shape of "
                                    r"torch\.Size\((\[[\d, ]*\])\)")


def reentrant_output_shapes(message: str | None) -> tuple[str, str] | None:
    """(the gradient's shape, the output's) where `message` is autograd's shape check of a gradient handed to
    backward, else None."""
    hit = _OUTPUT_SHAPE_MISMATCH.search(message or "")
    return (hit.group(1), hit.group(2)) if hit else None


_REFUSED_OP = re.compile(r"([A-Za-z_][\w.]*)(?: invocation index \d+)? encountered during backward,? but not found in storage")


def refused_op(message: str | None) -> str | None:
    """The op selective AC's recompute ran that its forward did not save, where `message` is that error (the
    recompute took another path): `refused_op("aten.arange.start_step encountered during backward but not found in
    storage. ...")` -> "aten.arange.start_step"."""
    hit = _REFUSED_OP.search(message or "")
    return hit.group(1) if hit else None


def classify_error_line(text: str) -> tuple | None:
    """What an error-related segment is, or None (see the module docstring)."""
    c = text[0]
    if c == "t" and text.startswith("tensor at position"):
        m = _POSITION.match(text)
        return ("position", int(m.group(1))) if m else ("garbled", None)
    if c == "s" and text.startswith("saved metadata:"):
        return ("saved", text[15:].strip())
    if c == "r" and text.startswith("recomputed metadata:"):
        return ("recomputed", text[20:].strip())
    if c == "N" and text.startswith("Number of tensors saved during"):
        m = _COUNT.match(text)
        if not m:
            return ("garbled", None)
        kind = "count_saved" if m.group(1) == "forward" else "count_recomputed"
        return (kind, int(m.group(2)), m.group(3) != "")  # (.., .., followed by something: not cut)
    if text == "." or text.startswith("Tip: To see a more detailed error message"):
        return ("end", None)
    for phrase, kind, start in HEADER_PHRASES:
        at = text.find(phrase)
        if at >= 0 and (start is None or _starts_message(text[:at], start)):
            return ("header", kind)
    tag = text.find(_EXCEPTION_TAG)
    if tag >= 0 and DUMP_START not in text and _raised_by_torch(text, tag):
        return ("header", OTHER)
    return None


def _starts_message(before: str, start: re.Pattern) -> bool:
    """Whether the text `before` a phrase ends with the start of torch's message (`start`, anchored at the
    phrase) led by what a log prints before a raised message (`_MESSAGE_LEAD`)."""
    m = start.search(before)
    return m is not None and _MESSAGE_LEAD.search(before[:m.start()].rstrip(" ")) is not None


def _raised_by_torch(text: str, tag: int) -> bool:
    """Whether "CheckpointError:" at `tag` starts an error torch raised, not prose that names one (a README,
    a comment, "`CheckpointError: ... position 46`"): torch prints the class qualified
    ("torch.utils.checkpoint.CheckpointError: ...") and starts every message with "torch.utils.checkpoint:"."""
    message = text[tag + len(_EXCEPTION_TAG):].strip()
    return bool(message) and (text[:tag].endswith("checkpoint.") or message.startswith("torch.utils.checkpoint"))


@dataclass(slots=True)
class _Entry:
    """One "tensor at position" entry while it is being read."""

    mismatch: PositionMismatch
    saved_seen: bool = False
    recomputed_seen: bool = False


@dataclass(slots=True)
class ErrorBuilder:
    """Collects the lines of one CheckpointError (or a fragment of one) for one rank."""

    error: TorchError
    has_header: bool = True
    closed: bool = False
    entry: _Entry | None = None
    cut_entries: int = 0  # metadata dicts that were cut or garbled
    last_dict_cut: bool = False
    seq: int = 0  # errors started before this one (in the log, over all ranks)
    # The highest position number so far (torch lists them in increasing order; a fragment whose number was cut
    # off does not reset it, so a second paste of the same error starts a new one)
    last_position: int | None = None
    _message: list[str] = field(default_factory=list)
    _message_len: int = 0

    @classmethod
    def start(cls, kind: str, rank: int | None, header_text: str | None, line: int | None = None,
              seq: int = 0) -> ErrorBuilder:
        """The builder of an error that starts on log line `line`, the `seq`-th error started."""
        b = cls(TorchError(kind=kind, message="", rank=rank, first_line=line, last_line=line),
                has_header=header_text is not None, seq=seq)
        if header_text is not None:
            b.add_text(_EXC_PREFIX.sub("", header_text, count=1))
        return b

    def add_text(self, text: str) -> None:
        if self._message_len < MAX_MESSAGE:
            self._message.append(text)
            self._message_len += len(text) + 1

    def position(self, n: int) -> None:
        self.entry = _Entry(PositionMismatch(n, None, None))
        self.error.positions.append(self.entry.mismatch)
        self.last_dict_cut = False
        if self.last_position is None or n > self.last_position:
            self.last_position = n

    def metadata(self, which: str, dict_text: str) -> bool:
        """Add a saved/recomputed metadata line; returns whether its dict was whole."""
        entry = self.entry
        seen = "saved_seen" if which == "saved" else "recomputed_seen"
        if entry is None or getattr(entry, seen) or (which == "saved" and entry.recomputed_seen):
            # a fragment: its "tensor at position" line is missing or belongs to another entry
            self.entry = entry = _Entry(PositionMismatch(None, None, None))
            self.error.positions.append(entry.mismatch)
        setattr(entry, seen, True)
        parsed = parse_metadata_cached(dict_text)
        if which == "saved":
            entry.mismatch.saved = parsed.meta
        else:
            entry.mismatch.recomputed = parsed.meta
        if not parsed.complete:
            self.cut_entries += 1
        self.last_dict_cut = not parsed.complete
        return parsed.complete

    def count(self, which: str, n: int) -> None:
        if which == "count_saved":
            self.error.saved_count = n
        else:
            self.error.recomputed_count = n

    def incomplete(self) -> str | None:
        """Why this error is unfinished if the log stopped now, or None when it reads as whole."""
        if self.closed:
            return None
        kind = self.error.kind
        if kind == COUNT_MISMATCH and (self.error.saved_count is None or self.error.recomputed_count is None):
            return "a CheckpointError message before its tensor counts"
        if kind == METADATA_MISMATCH:
            if not self.error.positions:
                return "a CheckpointError message before its first tensor position"
            e = self.entry
            where = f"position {e.mismatch.position}" if e and e.mismatch.position is not None else "an entry"
            if e is not None and (not e.saved_seen or not e.recomputed_seen):
                return f"a CheckpointError message ({where} is missing its metadata)"
            if self.last_dict_cut:
                return f"a CheckpointError message ({where}: metadata cut off)"
        return None

    def finish(self) -> TorchError:
        self.error.message = "\n".join(self._message)
        return self.error
