"""Processes the script starts with multiprocessing's spawn or forkserver: fresh interpreters that ac-diff does not
record (mp.spawn, torch.multiprocessing.spawn, a Process of a "spawn" context). A DataLoader's workers are left out:
they run no model.

    watch = SpawnWatch().install()     # while the recorder runs
    ...                                # the script: torch.multiprocessing.spawn(train, nprocs=2)
    watch.uninstall()
    watch.count  ->  2                 # written in the trace's end record ("spawned"), named by the report
"""

from __future__ import annotations

import multiprocessing
from multiprocessing.process import BaseProcess
from typing import Any

_FRESH_INTERPRETERS = ("spawn", "forkserver")


class SpawnWatch:
    def __init__(self) -> None:
        self.count = 0
        self._original: Any = None

    def install(self) -> "SpawnWatch":
        if self._original is not None:
            return self
        self._original = original = BaseProcess.start
        watch = self

        def start(process: BaseProcess) -> None:
            if _fresh_interpreter(process) and not _data_loader_worker(process):
                watch.count += 1
            return original(process)

        BaseProcess.start = start
        return self

    def uninstall(self) -> None:
        if self._original is not None:
            BaseProcess.start = self._original
            self._original = None


def _fresh_interpreter(process: BaseProcess) -> bool:
    method = getattr(process, "_start_method", None) or multiprocessing.get_start_method(allow_none=True)
    return method in _FRESH_INTERPRETERS


def _data_loader_worker(process: BaseProcess) -> bool:
    return str(getattr(getattr(process, "_target", None), "__module__", "")).startswith("torch.utils.data")
