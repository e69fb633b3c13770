"""The recorder's in-memory op: one tuple per recorded op, indexed by these constants.

    (name, module, src, in, args, refs, out, host, flags)
    ("aten.mm.default", "layers.0.wq", "model.py:40 in forward", [meta, meta], ["$", "$"],
     [("op", 3, 0), ("param", "w", 1)], [meta], None, 0)          flags: see trace.FLAG_*
"""

_OP, _MODULE, _SRC, _IN, _ARGS, _REFS, _OUT, _HOST, _FLAGS = range(9)
