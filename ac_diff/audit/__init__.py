"""`ac-diff audit`: how close each checkpointed discrete decision is to flipping, and what a flip would do.

    from ac_diff.audit import Auditor, AuditSettings, parse_noise, parse_scale, audit_document
    auditor = Auditor(AuditSettings(parse_noise("1ulp"))).start(); train(); auditor.stop()
    doc = audit_document(auditor, parse_scale("tokens=8192,layers=48"), target="train.py", wall_seconds=9.0)

noise.py (what is injected, ulps), margins.py (per-row margins of a decision), replay.py (a region
replayed on its own inputs, outside the training), engine.py (the auditor: replays, flips, remedy),
extrapolate.py (flips per step at a target scale), result.py (the JSON `audit` section), render.py.
"""

from .engine import Auditor, AuditSettings
from .extrapolate import Scale, parse_scale
from .noise import NoiseSpec, parse_noise
from .result import audit_document

__all__ = ["Auditor", "AuditSettings", "NoiseSpec", "Scale", "audit_document", "parse_noise", "parse_scale"]
