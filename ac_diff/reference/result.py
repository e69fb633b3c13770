"""The `reference` section of a report: the run's gradients against a run without AC, and why they differ.

    ReferenceResult(mode="no-ac", verdict="differs", headline="27 of 35 gradients differ from the run without AC ...",
                    steps=[StepComparison(step=0, loss_identical=True, parameters=35, identical=8,
                                          differing=[ParamDiff("model.layers.0.mlp.gate.weight", "differs", 0.59)])],
                    explanations=[Explanation(kind="side_output", region="model.layers.0", ...)])
    result.to_json()  ->  {"mode": "no-ac", "verdict": "differs", "headline": ..., "steps": [...], ...}

verdict: `identical` (every compared gradient bit-identical), `differs` (a defect: the run is not clean),
`not_comparable` (the reference's own randomness: not a defect), `failed` (the reference did not produce
gradients).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

IDENTICAL = "identical"
DIFFERS = "differs"
NOT_COMPARABLE = "not_comparable"
FAILED = "failed"


@dataclass(slots=True)
class ParamDiff:
    name: str
    status: str  # differs, shape, missing_in_run (no gradient with AC), missing_in_reference
    rel_diff: float | None = None  # ||run - ref|| / ||ref|| (over a strided sample when `sampled`)
    sampled: bool = False
    region: str | None = None  # the checkpointed region whose module holds the parameter
    norm_only: bool = False  # values over the budget (grads.py): rel_diff is | ||run|| - ||ref|| | / ||ref||, a lower bound


@dataclass(slots=True)
class StepComparison:
    step: int  # the index of the backward pass
    loss_identical: bool | None  # None: no single loss tensor was seen
    loss_rel_diff: float | None
    parameters: int
    identical: int
    differing: list[ParamDiff] = field(default_factory=list)
    rank: int = 0
    no_grad: int = 0  # of the identical ones, parameters whose .grad was None in both runs (frozen, or freed)


@dataclass(slots=True)
class Explanation:
    # side_output, no_grad_inputs, recompute_divergence, other_rank_divergence, reference_randomness,
    # nondeterministic_kernel, grad_mode_forward, rng_draws, host_draws, private_generator, repeated_update,
    # state_drift, compiled_ac, other_parameters, backward_kernels, unexplained
    kind: str
    text: str
    region: str | None = None
    module: str | None = None
    source: str | None = None
    parameters: list[str] = field(default_factory=list)
    fix: str | None = None


@dataclass(slots=True)
class ReferenceResult:
    mode: str
    verdict: str
    headline: str
    steps_requested: int
    steps: list[StepComparison] = field(default_factory=list)
    explanations: list[Explanation] = field(default_factory=list)
    command: str | None = None  # how the reference was run
    exit_code: int | None = None  # the reference process's
    notes: list[str] = field(default_factory=list)

    @property
    def defect(self) -> bool:
        return self.verdict == DIFFERS

    @property
    def backwards(self) -> int:
        """The backward passes compared (each rank's comparison of one is one of `steps`)."""
        return len({s.step for s in self.steps})

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        for step in out["steps"]:  # `step` is the index; `backward` counts from 1, as the text and the steps do
            step["backward"] = step["step"] + 1
        return out
