"""What the launcher told this process through its environment.

    process_rank() -> 0         (torchrun's RANK; 0 when run alone)
    process_world_size() -> 1   (torchrun's WORLD_SIZE; 1 when run alone)
"""

from __future__ import annotations

import os


def process_rank() -> int:
    """This process's rank in its launch (torchrun, ac-diff's launcher): RANK, 0 when unset or empty."""
    return int(os.environ.get("RANK", "0") or 0)


def process_world_size() -> int:
    """How many ranks this process's launch has: WORLD_SIZE, 1 when unset or empty."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1)
