"""The user's source line for the op dispatching now: the innermost frame outside torch and ac-diff.

    user_source()  ->  "examples/tiny_moe.py:57 in forward"
    raised_at(exc) ->  "examples/rope.py:23 in _inv"   (where an exception left the user's code)

Results are cached per (code object, line), so the cost per op is a short frame walk.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

from ..own_files import is_own_file

_TORCH_ROOT = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_STDLIB_MODULES = ("contextlib.py", "functools.py", "runpy.py", "threading.py")

_internal_file: dict[str, bool] = {}
_formatted: dict[tuple, str] = {}


def is_internal(filename: str) -> bool:
    """Code of torch, ac-diff, the standard library's plumbing, or no file: not the user's."""
    internal = _internal_file.get(filename)
    if internal is None:
        internal = (
            filename.startswith(_TORCH_ROOT) or is_own_file(filename)
            or filename.startswith("<")
            or os.path.basename(filename) in _STDLIB_MODULES
        )
        _internal_file[filename] = internal
    return internal


def short_path(filename: str) -> str:
    """A path a reader recognises: relative to the working directory when inside it; an installed package's by its
    tail (`models/llama/modeling_llama.py`); else whole, so that it opens from anywhere."""
    try:
        rel = os.path.relpath(filename)
    except ValueError:
        rel = filename
    if not rel.startswith(".."):
        return rel
    parts = filename.replace("\\", "/").split("/")
    if "site-packages" in parts or "dist-packages" in parts or not os.path.isabs(filename):
        return "/".join(parts[-3:])
    return filename


_internal_code: dict = {}  # code object -> internal? (one dict hit per frame on the per-op walk)


def user_source(start_depth: int = 2) -> str | None:
    frame = sys._getframe(start_depth)
    internal_code = _internal_code
    while frame is not None:
        code = frame.f_code
        internal = internal_code.get(code)
        if internal is None:
            internal = internal_code[code] = is_internal(code.co_filename)
        if not internal:
            break
        frame = frame.f_back
    if frame is None:
        return None
    return code_site(frame.f_code, frame.f_lineno)


def code_site(code: Any, line: int) -> str:
    """"model.py:57 in forward": a line of a code object as reports name it (cached per code object and line)."""
    key = (code, line)
    text = _formatted.get(key)
    if text is None:
        text = _formatted[key] = f"{short_path(code.co_filename)}:{line} in {code.co_name}"
    return text


def raised_at(exc: BaseException) -> str | None:
    """The innermost user frame of `exc`'s traceback (where it left the user's code), or None."""
    tb, hit = exc.__traceback__, None
    while tb is not None:
        code = tb.tb_frame.f_code
        if not is_internal(code.co_filename):
            hit = (code, tb.tb_lineno)
        tb = tb.tb_next
    if hit is None:
        return None
    return code_site(*hit)
