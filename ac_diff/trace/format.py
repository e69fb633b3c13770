"""The trace file: versioned, self-describing JSON Lines (optionally gzip), streamed and flushed per pass.

    {"type": "header", "format": "ac-diff-trace", "version": "1.4", "torch": "2.13.0", "rank": 0, ...}
    {"type": "region", "region": 0, "module": "layers.0", "kind": "checkpoint", "options": {...}}
    {"type": "op", "region": 0, "phase": "forward", "attempt": 0, "i": 0, "op": "aten.mm.default",
     "module": "layers.0.moe.router.gate", "src": "model.py:40 in forward", "in": [[[512, 64], "f32", "cpu"], ...],
     "out": [...], "args": ["$", "$"], "refs": [{"k": "op", "op": 3}, {"k": "param", "name": "..."}],
     "fp": [[12.5, 801.2]], "vals": {"out1": {"dtype": "i64", "shape": [512, 2], "b64": "..."}}}
    {"type": "pass", "region": 0, "phase": "forward", "n_ops": 57, "complete": true, "positions": [...], ...}
    {"type": "check_error" | "exception" | "warning", ...}
    {"type": "end", "status": "ok" | "exception" | "interrupted" | "exit", "exit_code": 0, ...}

Kept values (`vals`) are raw little-endian bytes in base64 with their dtype and shape (older traces
stored nested lists; both load). `read_run(path)` turns a file back into the model
(`ac_diff.passes.Run`); `read_run(path, lazy=True)` (what `ac-diff report` reads with) only checksums and
indexes the "ops" lines and leaves ops, positions and externals to be decoded one region at a time
(`Run.ops_loader`), so memory follows the largest region, not the file. A file of another format or of a newer major version raises
`TraceFormatError` saying what it is and what to do; a file without its end record (the process
died) loads with `Run.truncated` set and a note.

Integrity: since 1.1 every line ends with `"crc": N`, the CRC-32 of the line's bytes without that
field (`{..., "crc": N}` -> `{...}`). A line whose checksum does not match, that does not parse, or
that lacks the checksum in a 1.1 trace is damaged: it is skipped, counted, and every region that was
being recorded when it was written (its region record before the line, its last recompute pass record not)
is marked damaged (`Region.damaged`), and so is the region whose recompute ended just
before the line (a torch error or exception record is about it); so is a region named only by records
whose region record was lost. The diagnosis reports such a region as "damaged", never as clean or diverged. A
damaged header, or one whose fields have the wrong types, raises `TraceFormatError`.

Format history (every version stays readable; tests/data keeps a file of each):
  1.0  header, region, op (one per op, later one "ops" record per pass), pass, end records
  1.1  a CRC-32 per line (`crc`); readers of 1.0 ignore it
  1.2  record types are checked against the minor version (the lines are those of 1.1)
  1.3  a summarized pass (`"ops_written": false`; `write: diverged`, the default since) carries its `verdict`
       and a `values_digest`, and no attributes; in a distributed run a forward's summary keeps the parameters
       and buffers it reads; readers of 1.2 ignore the new keys
  1.4  an op's "out" lists every return by position (NOTE [op outputs]); the end record and a pass record count
       what the recorder lost (`lost`); a pass keeps the module-level globals its modules' forwards read
       (`globals`, `global_readers`) and container attributes as {type, len, hash}; readers of 1.3 read tensor
       entries and skip the rest. A saved position
       ([position, meta, origin, op index, output, name]) may carry a 7th entry, the fingerprint of the tensor
       saved there (of its base for a view, whose [offset, *strides] are then an 8th); a forward's pass record lists the tensors it made that outlived it
       (`outputs`: [[op index, output], ...]); readers of 1.3 ignore both. The end record may say what
       torch.compile did (`compiled`: capture/compiled.py, `Run.compiled`); readers that predate it ignore it
  1.5  watch mode (capture/watch.py): a region record may say `"watched": true` (its passes list saved positions
       only, `n_ops` null: origin "saved" for a tensor the region made, named after the module it was saved in,
       its 7th entry a digest [sum, row-weighted sum] of its bit patterns (a CPU tensor's: [hash of its bytes,
       their count]), compared for equality only; "param", "input" as before; "output"
       for a reentrant region's outputs) and the `step` it ran in; new record types "watch" (totals per module:
       [compared, diverged, never compared], the escalations, the last step) and "escalate" (a module recorded
       in full from `from_step` on, after its region `region` diverged in step `diverged_step`); the exception
       record may list the inputs of regions still awaiting their recompute that were written in place since their
       forward ended (`inputs_changed`: [[region, input index, meta, version then, version now], ...]: what torch's
       version check stops a backward for); readers that predate it ignore it. A pass may list the globals it
       changed (`global_updates`: name -> [first reading, at its end]), and a region record the function checkpointed
       where it called no module (`function`; its `module` is then its caller's); readers that predate it ignore them
  1.6  "unpacked" records: the saved positions of a region that backward passes read (checkpoint's unpack hook),
       written outside a backward; `partial` lists those read only by autograd nodes computing some of their
       inputs' gradients ([position, node name, [their indexes]]: `torch.autograd.grad(loss, x)`); readers of
       1.6 that predate `partial` count those as read; the exception record names the `step` whose forward began
       last when it struck

NOTE [op outputs]: an op's outputs are positional. `out[j]` is the op's j-th return: [shape, dtype, device]
for a tensor, null for None, the number for an int/float/bool, a short text for anything else ("list[3]").
On CUDA, `_scaled_dot_product_flash_attention` returns (out, logsumexp, None, None, max_q, max_k, rng_state,
unused, debug_attn_mask): its rng_state is out[6] and a ref ["op", i, 6] names it. The output index means
the same thing in refs, `fp` (one entry per return, null where not fingerprinted), `vals` ("out6") and
positions. Traces before 1.4 listed tensors only (their indices agree wherever an op returned tensors only,
the only case they recorded whole).

NOTE [versions and record types]: the major version changes when a reader of the old one would
misread the file; it is refused with advice ("upgrade ac-diff" / "re-record it"). A minor version may
add record types. A record type this reader does not know is therefore corruption in a trace of its own
minor version or an older one (an error), but new data in a trace of a newer minor: those records are
skipped with one line on stderr naming both versions and saying "upgrade ac-diff". (Readers before 1.2
skipped unknown types silently: an older ac-diff read a newer trace as empty regions.)
"""

from __future__ import annotations

import os
import platform
import sys
import time
from typing import Any

from .._version import __version__
from ..env import process_rank
from ..errors import AcDiffError

FORMAT = "ac-diff-trace"
VERSION = "1.6"
MAJOR, MINOR = (int(x) for x in VERSION.split("."))


class TraceFormatError(AcDiffError, ValueError):
    """The file is not an ac-diff trace this version can read. The message says what to do."""


# flags of an op row (see encode.encode_ops)
FLAG_CACHED, FLAG_RANDOM, FLAG_DISCRETE, FLAG_DERIVED = 1, 2, 4, 8
OPS_FIELDS = ("op", "module", "src", "in", "args", "refs", "out", "fp", "host", "flags", "vals")
# every record type a trace of this version may hold
RECORD_TYPES = frozenset({"header", "region", "op", "ops", "pass", "check_error", "exception", "warning", "end",
                          "watch", "escalate", "unpacked"})
def merge_read(reads: dict[int, tuple[str, frozenset[int]] | None], position: int,
               read: tuple[str, frozenset[int]] | None) -> None:
    """Count one more backward's read of a saved position into `reads` ("unpacked" records): None, read for all of
    its node's inputs' gradients, stays so; reads of the same node for some of them add those up; reads of two nodes
    (not one position's) count as read for all."""
    before = reads.get(position, _UNSEEN)
    if before is _UNSEEN:
        reads[position] = read
    elif read is None or before is None or before[0] != read[0]:
        reads[position] = None
    else:
        reads[position] = (read[0], before[1] | read[1])


_UNSEEN = object()
# an "exception" record's exc_type where the script exited (sys.exit, os._exit) inside a backward: stopped, as a crash
EXIT_DURING_BACKWARD = "ExitDuringBackward"


def default_header(options: Any, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    import torch

    rank = process_rank()
    header = {
        "type": "header", "format": FORMAT, "version": VERSION, "ac_diff": __version__,
        "torch": torch.__version__, "python": platform.python_version(), "argv": list(sys.argv),
        "rank": rank, "world_size": int(os.environ.get("WORLD_SIZE", "1") or 1),
        "local_rank": int(os.environ.get("LOCAL_RANK", "0") or 0),
        "local_world_size": int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1), "pid": os.getpid(),
        "host": platform.node(), "start_time": time.time(), "cwd": os.getcwd(),
        "options": {k: sorted(v) if isinstance(v, frozenset) else v for k, v in vars(options).items()},
    }
    header.update(extra or {})
    return header
