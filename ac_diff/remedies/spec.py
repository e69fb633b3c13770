"""Which remedies a process applies, as one value that travels to child processes and torchrun ranks.

    spec = RemedySpec(no_ac=["layers.1"], preserve_rng=True, must_save=["aten.topk.default"],
                      must_save_modules=["layers.*.moe.router"], restore=["layers.*.moe.expert_bias"])
    os.environ[ENV] = spec.to_env()        # a child / every rank reads it back: RemedySpec.from_env()
    spec.cli_args()  ->  ["--no-ac", "layers.1", "--preserve-rng", "--must-save", "aten.topk.default", ...]
    spec.describe()  ->  "no AC in layers.1; preserve_rng_state=True; save aten.topk.default in layers.*.moe.router"
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields

ENV = "AC_DIFF_REMEDIES"


@dataclass
class RemedySpec:
    no_ac: list[str] = field(default_factory=list)  # module-name globs run without checkpointing ("*": all)
    preserve_rng: bool = False  # force preserve_rng_state=True
    non_reentrant: bool = False  # force use_reentrant=False
    deterministic: bool = False  # torch.use_deterministic_algorithms(True) + CUBLAS_WORKSPACE_CONFIG
    must_save: list[str] = field(default_factory=list)  # ops every SAC policy must save ("aten.topk.default")
    must_save_modules: list[str] = field(default_factory=list)  # ... only in these modules (globs; empty: all)
    restore: list[str] = field(default_factory=list)  # state (FQN globs) the recompute sees at its forward value

    def __bool__(self) -> bool:
        return bool(self.no_ac or self.preserve_rng or self.non_reentrant or self.deterministic or self.must_save
                    or self.restore)

    def merged(self, other: "RemedySpec") -> "RemedySpec":
        return RemedySpec(no_ac=_union(self.no_ac, other.no_ac), preserve_rng=self.preserve_rng or other.preserve_rng,
                          non_reentrant=self.non_reentrant or other.non_reentrant,
                          deterministic=self.deterministic or other.deterministic,
                          must_save=_union(self.must_save, other.must_save),
                          must_save_modules=_union(self.must_save_modules, other.must_save_modules),
                          restore=_union(self.restore, other.restore))

    def to_env(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_env(cls, environ: dict | None = None) -> "RemedySpec":
        text = (environ if environ is not None else os.environ).get(ENV)
        if not text:
            return cls()
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"{ENV} is not valid JSON ({exc}); unset it") from None
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def cli_args(self) -> list[str]:
        """The `ac-diff run` options that apply this spec (what a user types to verify a remedy)."""
        out: list[str] = []
        for glob in self.no_ac:
            out += ["--no-ac", glob]
        if self.preserve_rng:
            out.append("--preserve-rng")
        if self.non_reentrant:
            out.append("--non-reentrant")
        if self.deterministic:
            out.append("--deterministic")
        if self.must_save:
            out += ["--must-save", ",".join(self.must_save)]
        for glob in self.must_save_modules:
            out += ["--must-save-module", glob]
        for name in self.restore:
            out += ["--restore-in-recompute", name]
        return out

    def describe(self) -> str:
        parts = []
        if self.no_ac:
            parts.append("no AC " + ("anywhere" if "*" in self.no_ac else "in " + ", ".join(self.no_ac)))
        if self.preserve_rng:
            parts.append("preserve_rng_state=True")
        if self.non_reentrant:
            parts.append("use_reentrant=False")
        if self.deterministic:
            parts.append("deterministic algorithms")
        if self.must_save:
            parts.append("save " + ", ".join(self.must_save)
                         + (" in " + ", ".join(self.must_save_modules) if self.must_save_modules else ""))
        if self.restore:
            parts.append("the forward's " + ", ".join(self.restore) + " restored in the recompute")
        return "; ".join(parts) or "none"


def split_ops(values: list[str] | None) -> list[str]:
    """`--must-save a,b --must-save c` -> [a, b, c]."""
    return [v.strip() for value in values or [] for v in value.split(",") if v.strip()]


def _union(a: list[str], b: list[str]) -> list[str]:
    return list(dict.fromkeys([*a, *b]))
