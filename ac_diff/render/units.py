"""Sizes as people read them, for every report: `byte_size(6144)` -> "6.0 KiB", `byte_size(512)` -> "512 B"."""

from __future__ import annotations


def byte_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
