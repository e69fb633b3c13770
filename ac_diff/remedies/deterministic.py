"""`--deterministic`: deterministic algorithms for the whole process, set before the script starts.

    enable()  ->  "torch.use_deterministic_algorithms(True), CUBLAS_WORKSPACE_CONFIG=:4096:8"

The cuBLAS variable only takes effect before CUDA initialises, which is why it is set at process start.
"""

from __future__ import annotations

import os

import torch

CUBLAS_ENV = "CUBLAS_WORKSPACE_CONFIG"


def enable() -> str:
    os.environ.setdefault(CUBLAS_ENV, ":4096:8")
    torch.use_deterministic_algorithms(True)
    return f"torch.use_deterministic_algorithms(True), {CUBLAS_ENV}={os.environ[CUBLAS_ENV]}"
