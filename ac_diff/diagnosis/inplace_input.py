"""A region that writes its own input in place: a checkpointing defect the forward alone shows.

    written = input_written(region.forward)   # -> (OpRecord(op="aten.add_.Tensor", ...), "input[0]") or None
    name_input_write(report, *written)        # the report: diverged, its cause, the out-of-place fix
    after = input_written_after(region, check)  # check: logs.errors.version_check(the run's exception message)
    name_input_written_after(report, after, check)  # its input written between its forward and its recompute
    saved_by_its_ops(region, after)  # True: its own ops saved that input, so the run fails without AC too

checkpoint keeps the region's inputs and recomputes from them in backward. `x += self.pos` as a block's first
line writes the very tensor it kept: torch's version check then stops the backward ("modified by an inplace
operation") before any recompute, while a run without AC, where nothing reads the old value, trains on.
"""

from __future__ import annotations

from ..oprules import is_in_place_method, packet
from ..passes import OpRecord, Pass, Region
from ..report import DIVERGED, Cause, RegionReport, Suggestion
from .labels import where
from .passdiff import viewed_source, written_refs

INPUT_WRITTEN = "input_written"  # Cause.mechanism (kind state_mutation)

_OPERATORS = {"add": "+", "sub": "-", "mul": "*", "div": "/"}


def input_written(fwd: Pass | None) -> tuple[OpRecord, str] | None:
    """(the first forward op that writes one of the region's inputs in place, or a view of one, that input's name)
    or None."""
    ops = {op.index: op for op in fwd.ops} if fwd is not None else {}
    for op in ops.values():
        hit = next((ref for ref in (viewed_source(ops, r) for r in written_refs(op)) if ref.kind == "input"), None)
        if hit is not None:
            return op, hit.name or "input"
    return None


def name_input_write(report: RegionReport, op: OpRecord, name: str) -> None:
    """Make `report` say the region modifies its input `name` in place with `op`, and how to write it instead."""
    at = where(op.module, op.source)
    report.status = DIVERGED
    report.silent = False  # torch's version check raises in the backward
    report.unchecked_reason = None
    report.cause = Cause(
        "state_mutation", name,
        f"the region modifies its own input in place: {op.op} writes {name} at {at}; checkpoint keeps the region's "
        "inputs to recompute from them, so the backward finds the kept tensor changed and torch stops it (\"modified "
        "by an inplace operation\"); without AC nothing reads the old value",
        [f"{op.op} (forward op #{op.index}) writes {name}, the tensor checkpoint keeps for the recompute"],
        INPUT_WRITTEN, op.source, [name])
    report.chain = [f"{op.op} writes the region's {name} in place at {at}",
                    "the tensor checkpoint kept for the recompute changed: torch raises in the backward"]
    report.suggestions = [Suggestion(
        f"Make the update of the region's input out of place ({op.source or report.module or 'the region'})",
        f"{op.op} changes the region's input, the tensor checkpoint keeps to recompute from. Compute a new tensor "
        "instead (the input stays as the forward received it), or clone the input first.",
        out_of_place(op))]


def input_written_after(region: Region, check: tuple[tuple[int, ...], int, int] | None) -> list[tuple] | None:
    """The region's inputs written in place after its forward (`Region.inputs_written`) that the run's stop is
    about: autograd's version check (`check`: the shape it names, logs.errors.version_check) over a tensor of their
    shape. None where there is none, or the run stopped for another reason."""
    if check is None:
        return None
    hit = [entry for entry in region.inputs_written if entry[1].shape == check[0]]
    return hit or None


def saved_by_its_ops(region: Region, written: list[tuple]) -> bool:
    """Every input in `written` is one the region's own ops saved for their backward (a linear keeps its input):
    a run without AC keeps it too and stops at the same version check."""
    saved = {p.name for p in region.forward.positions if p.origin == "input"} if region.forward is not None else set()
    return all(f"input[{index}]" in saved for index, *_ in written)


def name_input_written_after(report: RegionReport, written: list[tuple], check: tuple) -> None:
    """Make `report` say the region's input was written in place between its forward and its recompute, which stopped
    the backward (`input_written_after`); the fix is suggest.py's for an input modified after the forward."""
    index, meta, then, now = written[0]
    name = f"input[{index}]"
    report.status = DIVERGED
    report.silent = False
    report.unchecked_reason = None
    report.cause = Cause(
        "state_mutation", name,
        f"the region's {name} ({meta}) was modified in place after the forward, before its recompute (its version "
        f"went from {then} to {now}): checkpoint keeps the region's inputs to recompute from, so torch's version "
        "check stopped the backward (\"modified by an inplace operation\"); without that check the recompute would "
        "have read the new values",
        [f"torch: a tensor saved for the backward, {list(check[0])}, is at version {check[1]}, expected "
         f"{check[2]}"] + [f"input[{i}] {m}: version {a} when the forward ended, {b} when the run stopped"
                           for i, m, a, b in written],
        "input", None, [])
    report.chain = [f"the region's {name} {meta} was written in place after its forward",
                    "the tensor checkpoint kept for the recompute changed: torch raises in the backward"]


def out_of_place(op: OpRecord) -> str:
    """The out-of-place form of the update ("x = x + self.pos   # not: x += self.pos")."""
    name = packet(op.op)
    base = name[:-1] if is_in_place_method(op.op) else name
    symbol = _OPERATORS.get(base)
    y = _operand(op)
    if symbol is not None:
        return f"x = x {symbol} {y}   # not: x {symbol}= {y}"
    return f"x = x.{base}({y})   # not: x.{name}({y})"


def _operand(op: OpRecord) -> str:
    """The update's second tensor as the module's code names it (`self.pos` for layers.0.pos in layers.0), else
    "..."."""
    ref = op.input_refs[1] if len(op.input_refs) > 1 else None
    prefix = f"{op.module}." if op.module else ""
    if ref is not None and ref.kind in ("param", "buffer") and ref.name and ref.name.startswith(prefix):
        return "self." + ref.name[len(prefix):]
    return "..."
