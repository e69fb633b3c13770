"""The recorder's in-memory op: one tuple per recorded op, indexed by these constants, and what it knows of the
tensors a pass made.

    (name, module, src, in, args, refs, out, host, flags)
    ("aten.mm.default", "layers.0.wq", "model.py:40 in forward", [meta, meta], ["$", "$"],
     [("op", 3, 0), ("param", "w", 1)], [meta], None, 0)          flags: see trace.FLAG_*

`out` holds one entry per return (trace NOTE [op outputs]): a meta tuple, None, or the non-tensor value.

A pass's producer map: id(tensor) -> (weakref, op index, output index, fingerprint slot or None, the tensor's
version when fingerprinted, its ref ("op", op index, output index), whether its values were measured or follow
from measured ones), indexed by the _P_* constants; and its externals (tensors it read but did not make):
id(tensor) -> (weakref, external index, its ref, fingerprint slot or None, its version when fingerprinted), indexed
by the _E_* constants.
"""

_OP, _MODULE, _SRC, _IN, _ARGS, _REFS, _OUT, _HOST, _FLAGS = range(9)
_P_WEAKREF, _P_OP, _P_OUTPUT, _P_SLOT, _P_VERSION, _P_REF, _P_MEASURED = range(7)
_E_WEAKREF, _E_INDEX, _E_REF, _E_SLOT, _E_VERSION = range(5)
