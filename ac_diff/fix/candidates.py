"""Candidate remedies for what a run's report diagnosed, cheapest first.

    candidates(report)  ->  [Candidate("preserve_rng_state=True", RemedySpec(preserve_rng=True), why="rng in layers.0"),
                             Candidate("save aten.topk.default in layers.1.moe.router", RemedySpec(must_save=[...]), ...),
                             Candidate("restore the forward's layers.*.moe.expert_bias in the recompute", ...),
                             Candidate("no AC in layers.1", RemedySpec(no_ac=["layers.1"]), ...)]

Per diverged region's cause: rng -> preserve_rng_state (not where the region already ran with it);
nondeterministic op / deterministic flag, or gradients that differ from the run without AC through a
nondeterministic kernel (the reference's explanation: a first loss that differs, or every region reproduced its
forward and the backward's own kernels differ) -> deterministic algorithms; a flipped discrete decision ->
save that op in its module (selective AC, non-reentrant regions only; in every layer: `layers.*.moe.router`);
gradients that differ through a reentrant region's side output or inputs without grad -> use_reentrant=False; a
buffer, tensor or Python attribute updated between forward and backward (every one the causes name, in one
restore for all the diverged regions), or a private torch.Generator (at the module drawing from it, where it lives)
-> its forward state restored in the recompute (`layers.*.moe.expert_bias`: simulates the code change, moving the
update after backward or handing the generator's state to the checkpoint); and last, turning AC
off in the region (it always removes a recompute divergence, at the cost of the region's activations). The order
is the cost order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..capture.fqn import is_segment
from ..diagnosis.attributes import hook_variable, split_name
from ..oprules import updates_as_it_computes
from ..remedies import RemedySpec
from ..report import DIVERGED, GRAD_MODE, LATER_FORWARD, REBOUND, UNCHECKED, UPDATED_IN_FORWARD

# cost order: a flag, a process setting, the reentrant variant, extra saved tensors, a region's activations
# a code change the restore simulates
ORDER = {"preserve_rng": 0, "deterministic": 1, "non_reentrant": 2, "must_save": 3, "restore": 4, "combined": 5,
         "no_ac": 6}


def layer_glob(module: str | None) -> str:
    """`layers.1.moe.router` -> `layers.*.moe.router`: the same module in every layer of a stack (a decision
    that flipped in one layer can flip in any)."""
    return ".".join("*" if part.isdigit() else part for part in (module or "").split(".")) or "*"


@dataclass
class Candidate:
    name: str
    spec: RemedySpec
    why: str
    kind: str
    op: str | None = None  # the op a must-save candidate saves
    state: str | None = None  # what a restore candidate restores: "generator", or the states' FQN globs
    parts: tuple = ()  # a "combined" candidate: the candidates it applies together
    # the state the base run's recompute updated a second time that this candidate is to stop (a try that leaves one
    # of them updated twice is not verified)
    repeats: frozenset = frozenset()
    own_policy: bool = False  # a must-save candidate where the script's regions already run a selective-AC policy
    # a restore candidate: the code change it simulates, as the diagnosis wrote it for that state (title, code)
    change: tuple[str, str] | None = None


def combined(found: list[Candidate], did_not_help: list[bool], revealed: list[Any]) -> Candidate | None:
    """Remedies that did not help alone, applied together: a block with two causes (dropout without its RNG state
    and a step counter) needs one remedy for each. The second cause may show only once the first is remedied:
    `revealed` holds each try's report, whose own candidates join. None with fewer than two parts (turning AC off
    is never one)."""
    failed = [c for c, no in zip(found, did_not_help) if no and c.kind != "no_ac"]
    tried = {c.spec.to_env() for c in found}
    more = [c for report, no in zip(revealed, did_not_help) if no and report is not None
            for c in candidates(report) if c.kind != "no_ac" and c.spec.to_env() not in tried]
    parts = list({c.spec.to_env(): c for c in failed + more}.values())
    if len(parts) < 2:
        return None
    spec = parts[0].spec
    for c in parts[1:]:
        spec = spec.merged(c.spec)
    return Candidate(" + ".join(c.name for c in parts), spec, "; ".join(c.why for c in parts), "combined",
                     parts=tuple(parts))


def _restore(r: Any) -> tuple[str, list[str]] | None:
    """("generator" | "state", globs) for a cause the restore simulates, at the modules that own what it names (in
    every layer): a private generator, where it lives (the module that draws from it: `layers.*.q_proj.lora_dropout
    .default`, not the block), or a buffer / tensor / Python attribute updated between forward and backward (every
    one the cause names: both linears' running buffers, each dropout's `p` a scheduler moved), or bound to another
    tensor (an annealed temperature `self.tau = self.tau * 0.9`: the forward's is put back)."""
    c = r.cause
    if c is None or is_segment(r.module):  # (a checkpoint_sequential segment: no module to restore state into)
        return None
    if c.kind == "rng" and c.mechanism == "private_generator" and r.module:
        return "generator", [layer_glob(name) for name in c.names or [r.module]]
    if c.kind in ("state_mutation", "control_flow") and c.mechanism in ("tensor", "attribute", UPDATED_IN_FORWARD,
                                                                        LATER_FORWARD, REBOUND) \
            and c.tensor:
        return "state", [layer_glob(name) for name in dict.fromkeys([c.tensor, *c.names])]
    return None


def _restores(regions: list[Any]) -> list[Candidate]:
    """One restore for every diverged region's state (all the updates the report found, in every region), one for
    their private generators."""
    by_state: dict[str, list[tuple[Any, list[str]]]] = {}  # "generator" / "state" -> (region, its globs)
    for r in regions:
        restore = _restore(r)
        if restore is not None:
            by_state.setdefault(restore[0], []).append((r, restore[1]))
    out = []
    for state, found in by_state.items():
        globs = sorted({glob for _, some in found for glob in some})
        kinds = ", ".join(dict.fromkeys(r.cause.kind for r, _ in found))
        modules = ", ".join(dict.fromkeys(r.module for r, _ in found))
        names = ", ".join(globs)
        what = f"torch.Generator state of {names}" if state == "generator" else names
        change = next(((f.title, f.code) for r, _ in found for f in r.suggestions
                       if f.code and r.cause.tensor and _fixes(f.title, r.cause.tensor)), None)
        out.append(Candidate(f"restore the forward's {what} in the recompute", RemedySpec(restore=globs),
                             f"{kinds} in {modules}", "restore", state="generator" if state == "generator" else names,
                             change=change))
    return out


def _fixes(title: str, name: str) -> bool:
    """Whether a suggestion's title names the state `name` as the diagnosis names it: `blocks.0.step`, or a hook's
    closure variable by the variable and its hook (`calls` in the forward pre-hook `warmup` of blocks.0)."""
    hook = hook_variable(name)
    if hook is None:
        return f"`{name}`" in title
    return f"`{hook[2]}`" in title and f"`{hook[1]}`" in title and split_name(name)[0] in title


def _repeating(regions: list[Any]) -> dict[str, tuple[list[str], set[str]]]:
    """op -> (module globs, tensors) of each op the regions' recomputes ran again and that updated state as it
    computed (a batch norm's running statistics: oprules.updates_as_it_computes), outside reentrant regions (no
    context_fn there)."""
    out: dict[str, tuple[list[str], set[str]]] = {}
    for r in regions:
        for name, op, module in r.repeated if r.kind != "reentrant" else ():
            if updates_as_it_computes(op):
                where_, names = out.setdefault(op, ([], set()))
                glob = layer_glob(module or r.module)
                if glob not in where_:
                    where_.append(glob)
                names.add(name)
    return out


def candidates(report: Any, max_regions: int | None = None, failed_with_ac: bool = False) -> list[Candidate]:
    """`failed_with_ac`: the run failed where the run without AC did not (fix/ac_only.py), so the regions it left
    unchecked are suspects even where none was seen to diverge."""
    out: dict[str, Candidate] = {}

    def add(c: Candidate) -> None:
        out.setdefault(c.spec.to_env(), c)

    diverged = [r for r in report.regions if r.status == DIVERGED]
    # a run torch stopped in its first diverged recompute leaves the other regions unchecked: they may hide the
    # same mechanism, so turning AC off covers them too
    modules = list(dict.fromkeys(r.module for r in diverged if r.module))[:max_regions]
    unchecked = [r.module for r in report.regions if r.module and r.status == UNCHECKED
                 and (diverged or failed_with_ac)]
    silenced = list(dict.fromkeys(modules + unchecked))
    if any(r.cause is not None and r.cause.kind == "rng" for r in diverged):  # which layers draw differently is
        silenced = list(dict.fromkeys(map(layer_glob, silenced)))  # chance: every layer of the stack (blocks.*)
    saves: dict[str, list[str]] = {}  # flipped op -> the modules it flipped in
    for r in diverged:
        if r.module not in modules:
            continue
        kind = r.cause.kind if r.cause else "unknown"
        where = f"{kind} in {r.module}"
        if kind == "rng" and r.checkpoint_options.get("preserve_rng_state") is not True:  # (not one in effect)
            add(Candidate("preserve_rng_state=True", RemedySpec(preserve_rng=True), where, "preserve_rng"))
        # (or every op matched and still it diverged: a reentrant backward runs on the graph its recompute built, with
        # what a custom Function kept on ctx there; without reentrancy it runs on the forward's own)
        if kind == "lost_gradient" or r.cause is not None and r.cause.mechanism == GRAD_MODE or (
                r.kind == "reentrant" and r.first_divergence() is None):
            add(Candidate("use_reentrant=False", RemedySpec(non_reentrant=True), where, "non_reentrant"))
        if kind == "nondeterministic_op" or (kind == "global_state" and "determinis" in (r.cause.tensor or "")):
            add(Candidate("deterministic algorithms", RemedySpec(deterministic=True), where, "deterministic"))
        d = r.first_discrete_divergence
        if d is not None and d.op and r.kind != "reentrant":
            glob = layer_glob(d.module or r.module)
            saves.setdefault(d.op, [])
            if glob not in saves[d.op]:
                saves[d.op].append(glob)
    for c in _restores([r for r in diverged if r.module in modules]):
        add(c)
    own = any(r.checkpoint_options.get("sac") for r in report.regions)  # (the try composes with that policy)

    def save(op: str, where_: list[str], why: str, repeats: frozenset = frozenset()) -> Candidate:
        return Candidate(f"save {op} in {', '.join(where_)}", RemedySpec(must_save=[op], must_save_modules=where_),
                         why, "must_save", op, repeats=repeats, own_policy=own)

    for op, where_ in saves.items():  # one try per op, in every module where it flipped
        add(save(op, where_, f"{op} flipped in {', '.join(where_)}"))
    for op, (where_, names) in _repeating(report.regions).items():  # its outputs saved, the recompute skips it
        add(save(op, where_, f"the recompute updates {', '.join(sorted(names)[:3])} a second time", frozenset(names)))
    ref = getattr(report, "reference", None)
    kernel = next((e for e in getattr(ref, "explanations", None) or []
                   if e.kind in ("nondeterministic_kernel", "backward_kernels")), None)
    if kernel is not None:  # the gradients can be compared once both runs use deterministic kernels
        add(Candidate("deterministic algorithms", RemedySpec(deterministic=True),
                      (f"nondeterministic kernel in {kernel.module or kernel.region or '?'}"
                       + (f" ({kernel.source})" if kernel.source else "")) if kernel.kind == "nondeterministic_kernel"
                      else "every region reproduced its forward, the backward's own kernels differ", "deterministic"))
    summed = kernel is not None and kernel.kind == "backward_kernels" and any(
        getattr(r, "kind", None) == "reentrant" for r in report.regions)  # (their own backward sums in another order)
    if ref is not None and ref.defect and (summed or any(e.kind in ("side_output", "no_grad_inputs")
                                                         for e in ref.explanations)):
        add(Candidate("use_reentrant=False", RemedySpec(non_reentrant=True),
                      "gradients differ through reentrant regions (" + ", ".join(
                          sorted({e.kind.replace("_", " ") for e in ref.explanations})) + ")", "non_reentrant"))
    if silenced:  # last: the diverged regions keep their activations (always removes their recompute divergence)
        add(Candidate(f"no AC in {', '.join(silenced)}", RemedySpec(no_ac=silenced),
                      "the diverged regions" if modules else "the run fails only with AC", "no_ac"))
    return sorted(out.values(), key=lambda c: ORDER[c.kind])
