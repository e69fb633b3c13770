"""Triton kernels compiled on their first use and checked against a host computation before they are trusted; where
that fails (no Triton, no compiler, another GPU, a wrong number), one warning and the per-tensor path.

    sums = first_use("byte_sums", build, "watch mode reduces each saved tensor on its own")
    # build() once per process (it compiles and checks the kernel, None where it does not apply), or None after a
    # warning that says what runs instead
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

_built: dict[str, Any] = {}


def first_use(name: str, build: Callable[[], Any], instead: str) -> Any:
    """The checked kernel `name` (built once), or None; `instead` says what runs without it."""
    if name not in _built:
        try:
            _built[name] = build()
        except Exception as exc:  # noqa: BLE001 - whatever broke, the per-tensor path works
            warnings.warn(f"ac-diff: {instead} (the batched kernel is unavailable: {type(exc).__name__}: "
                          f"{str(exc)[:200]})", RuntimeWarning, stacklevel=3)
            _built[name] = None
    return _built[name]
