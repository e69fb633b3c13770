"""A pass's ops as ONE "ops" trace record, and a tensor's meta as the trace writes it.

    encode_ops(0, "forward", 0, ops, fps, vals, cached, nonfinite=False)
    -> {"type": "ops", "region": 0, "phase": "forward", "attempt": 0, "start": 0, "fields": [...],
        "strings": ["aten.mm.default", ...], "rows": [[0, 1, 2, [[[512, 64], "f32", "cpu"]], ...], ...]}
    written_meta((torch.Size([512, 64]), torch.float32, device("cpu"))) -> ((512, 64), "f32", "cpu")

reader.py reads the record back (`_ops_from_json`); the format's spec is in format.py.
"""

from __future__ import annotations

from typing import Any

from ..dtypes import short_dtype
from .format import FLAG_CACHED, OPS_FIELDS


def encode_ops(region: int, phase: str, attempt: int, ops: list[tuple], fps: dict[int, list],
               vals: dict[int, dict], cached: Any, nonfinite: bool) -> dict[str, Any]:
    """All ops of a pass as ONE trace record (format 1.0 wrote one "op" record per op; both load):

        {"type": "ops", "region": 0, "phase": "forward", "attempt": 0, "start": 0,
         "fields": ["op", "module", "src", "in", "args", "refs", "out", "fp", "host", "flags", "vals"],
         "strings": ["aten.mm.default", "layers.0.attention.wq", "model.py:40 in forward", ...],
         "rows": [[0, 1, 2, [[[512, 64], "f32", "cpu"]], ["$", "$"], [["op", 3, 0], ["param", "w", 1]],
                   [[[512, 64], "f32", "cpu"]], [[12.5, 801.2]], null, 0, {"out1": {...}}], ...]}

    Each row is one recorder op tuple; `cached` holds the indices of ops selective AC served. `op`, `module` and `src` are indices into `strings`; refs are ["op", op index, output index] or
    [kind, name, external index]; flags: 1 cached (selective AC), 2 random, 4 discrete, 8 derived
    (elementwise op of measured inputs: not fingerprinted, see recorder `_record`); trailing empty
    fields are left off. One JSON encoding per pass instead of one per op, and a third of the bytes.
    """
    strings: dict[str, int] = {}
    rows = []
    for index, (name, module, src, in_meta, args, refs, out_meta, host, flags) in enumerate(ops):
        op_id = strings.get(name)
        if op_id is None:
            op_id = strings[name] = len(strings)
        module_id = None
        if module is not None:
            module_id = strings.get(module)
            if module_id is None:
                module_id = strings[module] = len(strings)
        src_id = None
        if src is not None:
            src_id = strings.get(src)
            if src_id is None:
                src_id = strings[src] = len(strings)
        if cached and index in cached:
            flags |= FLAG_CACHED
        row = [op_id, module_id, src_id, _written_metas(in_meta), args, refs, _written_outs(out_meta),
               fps.get(index), host, flags,
               vals.get(index)]
        if row[10] is None:  # leave off empty trailing fields: no vals, no flags, no host, no fp
            row.pop()
            if not flags:
                row.pop()
                while len(row) > 7 and row[-1] is None:
                    row.pop()
        rows.append(row)
    record = {"type": "ops", "region": region, "phase": phase, "attempt": attempt, "start": 0,
              "fields": OPS_FIELDS, "strings": list(strings), "rows": rows}
    if nonfinite:
        record["nonfinite"] = True
    return record


# (size, dtype, device) as the recorder keeps it -> its written form (size, short dtype, device name); the
# same few metas recur in every pass, so each is converted once (bounded: data-dependent shapes vary)
_written: dict[tuple, tuple] = {}


def _written_meta(meta: tuple) -> tuple:
    size, dtype, device = meta
    if len(_written) > 8192:
        _written.clear()
    w = _written[meta] = (tuple(size), short_dtype(dtype), "cpu" if device.type == "cpu" else str(device))
    return w


def written_meta(meta: tuple) -> tuple:
    """(size, dtype, device) -> (size as a tuple, short dtype, device name), as the trace holds a tensor's meta."""
    w = _written.get(meta)
    return w if w is not None else _written_meta(meta)


def _written_metas(metas: tuple) -> list:
    get = _written.get
    return [get(m) or _written_meta(m) for m in metas]


def _written_outs(outs: tuple) -> list:
    """An op's outputs by position (NOTE [op outputs]): tensor metas converted, other returns as they are."""
    get = _written.get
    return [(get(m) or _written_meta(m)) if type(m) is tuple else m for m in outs]
