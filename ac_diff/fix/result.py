"""The `fixes` section of a report: each remedy `ac-diff fix` tried on the user's script, and what happened.

    FixResult(headline="verified: preserve_rng_state=True (every region clean, gradients bit-identical ...)",
              tries=[Try(remedy="preserve_rng_state=True", args=["--preserve-rng"], status="verified",
                         regions_before=4, regions_after=0, gradients="bit-identical", extra_bytes=0.0, wall_s=6.2)],
              verified_code="checkpoint(block, x, use_reentrant=False, preserve_rng_state=True)\\n# Hugging Face: ...")
    result.to_json()  ->  {"headline": ..., "tries": [...], "verified": "...", "verified_code": ..., ...}

A try's status: `verified` (it ran, every region clean, gradients bit-identical to the run without AC),
`unverified` (it ran, every region clean, but the run without AC finished no backward to compare the gradients
with: it fails where AC hid the error), `did not help` (with the reason when known), `crashed` (the script failed under
it), `untested` (over the --max-tries budget).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


VERIFIED = "verified"
UNVERIFIED = "unverified"
DID_NOT_HELP = "did not help"
CRASHED = "crashed"
UNTESTED = "untested"


@dataclass(slots=True)
class Try:
    remedy: str  # what it does, in words ("save aten.topk.default in layers.1.moe.router")
    args: list[str]  # the `ac-diff run` options that apply it
    why: str  # which diagnosed cause it answers
    status: str = UNTESTED
    regions_before: int | None = None  # diverged regions without the remedy
    regions_after: int | None = None
    gradients: str | None = None  # "bit-identical", "max rel. diff 0.12 (7 of 23 differ)", "not compared"
    extra_bytes: float | None = None  # activation bytes kept per region beyond the base run (fix/memory.py)
    wall_s: float | None = None
    exit_code: int | None = None
    reason: str | None = None  # why it did not help / crashed, when known; for a verified one, what it leaves
    command: str = ""  # the one command that verifies it by hand

    def regions_text(self) -> str:
        if self.regions_after is None:
            return f"{self.regions_before} -> ?" if self.regions_before is not None else "-"
        return f"{self.regions_before} -> {self.regions_after}"


@dataclass(slots=True)
class FixResult:
    headline: str
    tries: list[Try] = field(default_factory=list)
    verified: str | None = None  # the remedy that works (first verified, cheapest)
    keeps_ac: bool = False  # ... and it keeps activation checkpointing (not only turning AC off for the regions)
    verified_code: str | None = None  # its exact form: code, Hugging Face kwargs, torchtitan TOML
    code_change: str | None = None  # when no mechanical remedy can work: the change to make in the code
    baseline_wall_s: float | None = None
    total_wall_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)
