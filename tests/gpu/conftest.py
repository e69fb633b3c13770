"""Tests that need a CUDA GPU: every test in this directory is skipped where torch sees none.

    python -m pytest -q tests/gpu        # on a GPU machine: runs them; elsewhere: all skipped
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:  # only this directory's tests
            item.add_marker(skip)
