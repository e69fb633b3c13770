"""What the distributed examples share: joining the process group torchrun describes (gloo on CPU).

    rank, world = init_distributed()     # under torchrun: RANK/WORLD_SIZE/MASTER_* from the environment
    ...
    finish_distributed()

Run as a plain script (no torchrun) it forms a world of one process, so every example also runs
with `python examples/<name>.py`.
"""

from __future__ import annotations

import os
import socket

import torch.distributed as dist


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(backend: str = "gloo") -> tuple[int, int]:
    """Join the default process group; returns (rank, world size)."""
    if "RANK" not in os.environ:  # plain `python example.py`: a world of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    if not dist.is_initialized():
        dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size()


def finish_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def rank_list(text: str) -> set[int]:
    """"1" / "1,3" / "" -> the set of ranks."""
    return {int(x) for x in text.split(",") if x.strip()}
