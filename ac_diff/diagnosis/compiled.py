"""What torch.compile means for a report: AC inside compiled graphs that nothing recorded, or regions recorded
with compiled code forced eager, and which evidence came from where.

    summary = compiled_summary(runs)   # the end record's "compiled" of the first run that has one
    -> {"eager": False, "modules": ["Net"], "regions": 2, "graphs": 1,
        "mutations": [{"name": "layers.0.scale", "kind": "buffer", "op": "mul_"}]}
    unrecorded_headline(summary)
    -> "AC runs inside compiled graphs (2 checkpointed regions in 1 graph), recomputed by the compiler in its own
        backward where ac-diff records nothing; from the graphs: the regions' forward updates the buffer
        layers.0.scale in place (mul_) ...; record them eagerly: ac-diff run --compiled eager ..."
    eager_prefix(summary)  -> "Net ran eagerly (--compiled eager: torch.compiler.set_stance('force_eager')): "
"""

from __future__ import annotations

from typing import Any

EAGER_RUN = "ac-diff run --compiled eager --reference no-ac"
STANCE = "torch.compiler.set_stance('force_eager')"


def compiled_summary(runs: list[Any]) -> dict[str, Any] | None:
    """The first run's (lowest rank first) account of torch.compile; None where no run compiled anything."""
    ordered = sorted(runs, key=lambda r: (r.rank is None, r.rank or 0))
    return next((r.compiled for r in ordered if getattr(r, "compiled", None)), None)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _names(items: list[str], limit: int = 4) -> str:
    return ", ".join(items[:limit]) + (f" (+{len(items) - limit} more)" if len(items) > limit else "")


def mutations_text(summary: dict[str, Any]) -> str:
    """What the compiled graphs show the checkpointed regions update in place ("" when nothing)."""
    mutations = summary.get("mutations") or []
    if not mutations:
        return ""
    kinds = sorted({m.get("kind", "tensor") for m in mutations})
    ops = sorted({m.get("op", "?") for m in mutations})
    return (f"the regions' forward updates the {'/'.join(kinds)}(s) {_names([m['name'] for m in mutations])} in "
            f"place ({', '.join(ops)}), so the compiled recompute can start from (or apply again) another value "
            "than the forward: a state mutation")


def unrecorded(summary: dict[str, Any] | None) -> bool:
    """AC ran inside compiled graphs and was not recorded (compiled code was not forced eager)."""
    return bool(summary) and bool(summary.get("regions")) and not summary.get("eager")


def unrecorded_headline(summary: dict[str, Any]) -> str:
    """The headline of a run whose checkpointed regions all ran inside compiled graphs."""
    found = mutations_text(summary)
    return (f"AC runs inside compiled graphs ({_plural(summary['regions'], 'checkpointed region')} in "
            f"{_plural(summary.get('graphs') or 1, 'graph')}), recomputed by the compiler in its own backward where "
            "ac-diff records nothing"
            + (f"; from the graphs: {found}" if found else "; the graphs show no state updated inside the regions")
            + (f"; record them eagerly ({STANCE}): {EAGER_RUN} ... (it finds what the eager program does; the "
               "compiler's own recompute may not, which `--reference no-ac` on this compiled run tells)"
               if summary.get("can_run_eager", True) else "; this torch cannot run compiled code eagerly "
               "(torch.compiler.set_stance: torch >= 2.6): record them without torch.compile, and "
               "`ac-diff run --reference no-ac` compares this compiled run's gradients with a run without AC"))


def eager_prefix(summary: dict[str, Any] | None) -> str:
    """Said before the headline of a run whose compiled code ran eagerly (--compiled eager), "" otherwise."""
    if not summary or not summary.get("eager") or not summary.get("modules"):
        return ""
    return (f"{_names(summary['modules'])} ran eagerly (--compiled eager: {STANCE}; what follows is the eager "
            "program's, the compiled one's recompute may differ): ")


def reference_note(summary: dict[str, Any] | None) -> str | None:
    """Which gradients `--reference no-ac` compared, where torch.compile ran (None without compile)."""
    if not summary or not (summary.get("modules") or summary.get("regions")):
        return None
    if summary.get("eager"):
        return ("both runs ran torch.compile'd code eagerly (--compiled eager): these are the eager model's gradients "
                "with and without AC; without --compiled eager the compiled model's are compared")
    return ("both runs ran compiled: the compiled model with AC (recomputed by AOTAutograd) against the compiled "
            "model without AC; with --compiled eager the regions are also recorded, eagerly")
