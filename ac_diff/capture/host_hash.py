"""CPU tensors' bytes hashed on the host, with no kernel and no dispatch: how watch mode digests a CPU tensor as torch
saves it (watch.host_digest).

    hash_bytes(t, nbytes)   # int: the hash of a contiguous CPU tensor's bytes, in order

xxhash's XXH3 (64 bits) hashes about 30 GB/s on one core, as fast as torch's vectorized reduction of the same bytes on
one thread, without its dispatch (microseconds per tensor); without xxhash, zlib's crc32 (about 5 GB/s). Either sees
every change of a byte, and values moved within a row, at any size: a large tensor is hashed here too, though torch
running several threads would reduce it faster, since a reduction by rows does not see values moved within a row (a
shuffle of channels inside the region). The bytes are read in place, through a slice of one read-only memoryview of
the whole address space: no copy, and nothing torch can see (a NumPy view would mark the storage as not resizable for
good, and FSDP's reshard, `untyped_storage().resize_(0)`, would then fail).
"""

from __future__ import annotations

import ctypes
import zlib

import torch

try:
    from xxhash import xxh3_64_intdigest as _hash
except ImportError:  # pragma: no cover - xxhash is a dependency; crc32 is the fallback
    _hash = None

if _hash is None:
    _hash = zlib.crc32

try:  # ONE read-only memoryview of the whole address space (CPython's C API): a tensor's bytes are a slice of it
    _from_memory = ctypes.pythonapi.PyMemoryView_FromMemory
    _from_memory.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)
    _from_memory.restype = ctypes.py_object
    # (slicing it makes a view object and reads nothing, ~0.07 us; a memoryview per tensor through ctypes, ~0.4 us)
    _ALL_MEMORY = _from_memory(0, 1 << 62, 0x100)  # PyBUF_READ
except (AttributeError, OverflowError, ValueError):  # pragma: no cover - no CPython C API: a copy (one memcpy)
    _ALL_MEMORY = None


def hash_bytes(t: torch.Tensor, nbytes: int) -> int:
    """The hash of the `nbytes` bytes of `t` (a contiguous CPU tensor with plain values), in memory order."""
    if not nbytes:
        return 0
    address = t.data_ptr()
    if _ALL_MEMORY is None:
        return _hash(ctypes.string_at(address, nbytes))
    return _hash(_ALL_MEMORY[address:address + nbytes])
