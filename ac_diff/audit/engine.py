"""The audit of a training run: every checkpointed region's decisions, their margins and flips.

    auditor = Auditor(AuditSettings(noise=parse_noise("1ulp"), seeds=3, max_regions=4))
    auditor.start(); train(); auditor.stop()
    auditor.sites      -> {label: SiteStats}   one per decision site (module, op, source line), pooled
                                               over the regions that ran it: margins, flips per seed,
                                               whether a flip changed the saved tensors' shapes
    auditor.regions    -> [RegionAudit]        per audited region: module, tokens, cost, remedy check
    auditor.recompute  -> RecomputeCheck       every region's real recompute against its forward: does the
                                               run diverge already (recompute.py)

It listens to the same version-guarded checkpoint hooks as the recorder (capture/torch_compat.py), and when a
region's original forward finishes it replays the region (replay.RegionReplay): once clean, once per
seed with noise injected into the floating outputs that feed each decision, and once per seed with the
suggested save list served from the clean pass. The training then continues, bit-identical.
"""

from __future__ import annotations

import contextlib
import math
import re
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..oprules import DECISION_OUTPUT
from ..capture.modules import ModuleStack, unread_statistics
from ..oprules import is_collective, is_in_place_method
from ..capture.torch_compat import (FORWARD, CheckpointHooks, ReentrantFrame, _closure_value, checkpointed_module,
                                   function_name)
from .margins import packet_of, summarize
from .noise import NoiseSpec
from .recompute import RecomputeCheck
from .replay import PassResult, RegionReplay, RngState, origin_of, producer_of, reachable, rounded_at

_SQRT2 = math.sqrt(2.0)


@dataclass
class AuditSettings:
    noise: NoiseSpec
    seeds: int = 3
    max_regions: int = 4
    discrete_ops: frozenset = frozenset()
    probe: bool = True  # a site that never flipped: one pass at 64x / 4096x the noise says what its flip would do


@dataclass
class SiteStats:
    label: tuple  # (module, op, source)
    kind: str | None  # margins kind, None: no margin of its own (fed by another decision)
    dtype: str | None = None
    candidates: int | None = None
    k: int | None = None
    target: str | None = None  # the op whose output the noise went into
    noise_model: str | None = None
    calls: int = 0
    rows: int = 0  # rows (or elements) per seed, over all calls
    ulps: list = field(default_factory=list)  # margins in ulps, one tensor per call
    margins: list = field(default_factory=list)  # the same in score units
    flips: list = field(default_factory=list)  # flipped rows per seed (summed over calls)
    model_flips: float = 0.0  # sum over rows of P(flip) from the margins and the measured score noise
    shape_events: int = 0  # seeds in which this site flipped and the saved tensors changed shape
    value_events: int = 0  # ... flipped and only values changed
    probe: str | None = None  # "shape" | "values" | "no flip" from the probe at a larger noise
    score_noise: list = field(default_factory=list)  # rms change of the scores per seed and call
    same_as: tuple | None = None  # the label of a site making this decision on the same scores (argmax, max(dim))

    @property
    def layer_kind(self) -> str:
        """The site with layer numbers wildcarded: `layers.*.moe.router topk` (pooled for extrapolation)."""
        return f"{re.sub(r'(?<=[.])[0-9]+(?=[.]|$)', '*', self.label[0])} {packet_of(self.label[1])}"

    def observed_rate(self) -> float | None:
        return sum(self.flips) / (self.rows * len(self.flips)) if self.rows and self.flips else None

    def model_rate(self) -> float | None:
        return self.model_flips / (self.rows * max(len(self.flips), 1)) if self.kind and self.rows else None

    def density_at_zero(self) -> float | None:
        """Margins per score unit near zero: the share of rows below the 5% quantile over that quantile."""
        m = torch.cat(self.margins) if self.margins else None
        if m is None or m.numel() < 20:
            return None
        q = float(torch.quantile(m, 0.05))
        return 0.05 / q if q > 0 else None

    def tail_rate(self) -> float | None:
        """P(flip) per row from the density of margins near zero, for noise smaller than the audited margins:
        P = f(0) * integral of P(the gap closes | margin m) dm = f(0) * s / sqrt(2 pi), s the gap's noise."""
        f0 = self.density_at_zero()
        if f0 is None or not self.score_noise:
            return None
        s = sum(self.score_noise) / len(self.score_noise) * (_SQRT2 if self.kind == "chooser" else 1.0)
        q = 0.05 / f0
        return f0 * s / math.sqrt(2 * math.pi) if s < q else None  # else the rows seen say it all (model)

    def rate(self) -> float:
        """P(flip) per row: observed when at least 5 flips were seen; else the larger of the margin model over
        the rows seen and the near-zero density (rows closer to a tie than any seen, at a larger scale)."""
        obs, model = self.observed_rate(), self.model_rate()
        if obs is not None and (sum(self.flips) >= 5 or model is None):
            return obs
        return max(model or 0.0, self.tail_rate() or 0.0)

    def shape_share(self) -> float | None:
        """Of this site's flips, the share that changed a saved tensor's shape (CheckpointError)."""
        events = self.shape_events + self.value_events
        if events:
            return self.shape_events / events
        return {"shape": 1.0, "values": 0.0}.get(self.probe or "")

    def margin_summary(self) -> dict:
        ulps = torch.cat(self.ulps) if self.ulps else torch.zeros(0, dtype=torch.float64)
        return summarize(ulps)


@dataclass
class RegionAudit:
    index: int
    module: str
    tokens: int
    ops: int
    decisions: int
    seconds: float
    error: str | None = None
    flips: list = field(default_factory=list)  # per seed: decisions' flipped rows in the region
    checkpoint_error: list = field(default_factory=list)  # per seed: saved tensors changed shape/count
    save_list: list = field(default_factory=list)
    save_bytes: int = 0
    remedy_flips: list = field(default_factory=list)  # per noisy replay (seeds, then stress), with the list served
    stress_flips: int | None = None  # decisions flipped by the first stress noise without the list
    refused: dict = field(default_factory=dict)  # op of the list -> the op of the forward that writes it in place
    collectives: bool = False  # the region calls collectives: only replays every rank makes alike


class Auditor:
    """Listens to checkpoint regions (like the recorder) and audits the first `max_regions` of them."""

    def __init__(self, settings: AuditSettings) -> None:
        self.settings = settings
        self.modules = ModuleStack()
        self.hooks = CheckpointHooks(self)
        self.sites: dict[tuple, SiteStats] = {}
        self.regions: list[RegionAudit] = []
        self.recompute = RecomputeCheck()
        self.notes: list[str] = []
        self.seen = 0
        self.audit_seconds = 0.0
        self._pending: dict[int, tuple] = {}
        self._sac: dict[int, set] = {}  # id(frame) -> ops its selective-AC policy saved
        self._busy = False
        self._probed: set = set()
        self._sac_noted = False

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> "Auditor":
        self.notes.extend(self.hooks.install())
        self.modules.install()
        return self

    def stop(self, exc: BaseException | None = None, exit_code: int | None = None) -> None:
        self.hooks.uninstall()
        self.modules.uninstall()

    def all_notes(self) -> list[str]:
        notes = list(self.notes)
        still = [s for s in self.sites.values() if s.kind and s.score_noise and not any(s.score_noise)]
        if still and self.settings.noise.rounding:  # (rounding noise into an op a recompute rounds alike)
            where = ", ".join(sorted({f"{s.label[0]} {packet_of(s.label[1])} (into {s.target})" for s in still})[:4])
            notes.append(f"the noise moved no score at {len(still)} site(s): {where}: a rounding error of where the "
                         "scores were computed does not survive their rounding to their own dtype there, so those "
                         "decisions flip only where the recompute's inputs differ; `--noise rel:X` moves the scores by "
                         "a drift you name")
        together = [r.index for r in self.regions if r.collectives]
        if not together:
            return notes
        listed = ", ".join(map(str, together[:8])) + (", ..." if len(together) > 8 else "")
        return [*notes, f"regions {listed} run collectives: every rank replays them alike (clean and --seeds "
                        "noisy replays), without the probes and the save-list check, whose count depends on the data"]

    # -- the listener interface of torch_hooks.CheckpointHooks --------------------------------
    def enter(self, frame: Any, phase: str) -> None:
        if self._busy:
            return
        if phase != FORWARD:
            self.recompute.recompute_begins(frame)
            return
        self.modules.freeze()
        index = self.seen  # numbered from 0, as `ac-diff run` numbers the regions
        self.seen += 1
        fn = getattr(frame, "_ac_diff_fn", None)
        self.recompute.forward(frame, index, self._name(fn), checkpointed_module(fn)[0] if fn is not None else None)
        if self.seen > self.settings.max_regions:
            return
        inputs = getattr(frame, "_ac_diff_inputs", None) or ()
        self._pending[id(frame)] = (index, RngState.capture(inputs), inputs)

    def pass_inputs(self, frame: Any, inputs: tuple, p: Any = None) -> None:
        hit = self._pending.get(id(frame))
        if hit is not None and isinstance(frame, ReentrantFrame):  # its inputs (and devices) are known only now
            self._pending[id(frame)] = (hit[0], RngState.capture(tuple(inputs)), tuple(inputs))

    def pass_outputs(self, frame: Any, phase: str, outputs: Any) -> None:
        """A reentrant pass's outputs: what its real recompute is compared with its forward by (the replays need
        none)."""
        if self._busy:
            return
        outs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
        for i, t in enumerate(t for t in outs if isinstance(t, torch.Tensor)):
            self.recompute.output(frame, phase, i, t)

    def exit(self, frame: Any, phase: str, exc: BaseException | None) -> None:
        if self._busy:
            return
        self.recompute.exit(frame, phase, exc)
        if phase != FORWARD:
            return
        hit = self._pending.pop(id(frame), None)
        sac_ops = self._sac.pop(id(frame), set())
        if hit is None or exc is not None:
            return
        index, rng, inputs = hit
        fn = getattr(frame, "_ac_diff_fn", None)
        kwargs = _closure_value(getattr(frame, "_ac_diff_recompute_fn", None), "kwargs") or {}
        if fn is None:
            self.notes.append(f"region {index}: torch did not say which function it checkpoints; not audited")
            return
        self._busy = True
        start = time.perf_counter()
        try:
            self.regions.append(self._audit(index, fn, inputs, kwargs, rng, sac_ops))
        except Exception as e:  # never into the training: say so in the report
            self.notes.append(f"region {index}: not audited ({type(e).__name__}: {e})")
        finally:
            self.audit_seconds += time.perf_counter() - start
            self._busy = False

    def pack(self, frame: Any, phase: str, position: int, x: Any) -> None:
        if not self._busy:
            stack = self.modules.stack()
            self.recompute.pack(frame, phase, position, x,
                                values=not (stack and any(x is s for s in unread_statistics(stack[-1][0]))))

    def check_failed(self, frame: Any, exc: BaseException) -> None:
        self.recompute.failed(frame, exc)

    def sac_saved(self, func) -> None:
        """An op the region's selective-AC policy saved in its forward: its recompute gets the forward's output."""
        if not self._busy and self._pending:
            self._sac.setdefault(next(reversed(self._pending)), set()).add(str(func))

    def sac_cached(self, *args) -> None:
        pass

    def op_count(self) -> int:
        return 0

    def internal(self):
        return contextlib.nullcontext()

    # -- one region ---------------------------------------------------------------------------
    def _audit(self, index: int, fn, inputs: tuple, kwargs: dict, rng: RngState, sac_ops: set) -> RegionAudit:
        start = time.perf_counter()
        module, hooks_run = checkpointed_module(fn)
        replay = RegionReplay(fn, inputs, kwargs, rng, self.modules, self.settings.discrete_ops,
                              module=None if hooks_run else module, sac_ops=sac_ops)
        name = self._name(fn)
        first = next((a for a in inputs if isinstance(a, torch.Tensor)), None)
        tokens = (first.numel() // max(first.shape[-1], 1) if first.dim() >= 2 else first.numel()) if first is not None else 0
        try:
            clean = replay.run()
            region = RegionAudit(index, name or type(module).__name__, tokens, len(clean.rows), len(clean.decisions), 0.0,
                                 clean.error)
            region.collectives = any(is_collective(r.key[0]) for r in clean.rows)
            if clean.error is None:
                self._perturb(region, replay, clean)
            else:  # what the recompute itself would hit: say so, the training goes on
                self.notes.append(f"region {index} ({region.module}): its replay failed without any noise: {clean.error}")
        finally:
            replay.close()
        region.seconds = time.perf_counter() - start
        return region

    def _name(self, fn: Any) -> str:
        """The checkpointed module's name ("layers.0"), else the function's ("?" when unknown)."""
        module, _ = checkpointed_module(fn)
        return self.modules.name_of(module) if module is not None else function_name(fn) or "?"

    def _targets(self, clean: PassResult) -> dict:
        """site key -> (the op row the noise goes into, its slot), for decisions that noise can reach."""
        spec = self.settings.noise
        out = {}
        for key, d in clean.decisions.items():
            if d.margins is None:
                continue
            hit = scores_producer(clean, d)
            if not reachable(clean, hit):
                continue
            out[key] = origin_of(clean, hit) if spec.at_origin else rounded_at(clean, hit) if spec.rounding else hit
        return out

    def _perturb(self, region: RegionAudit, replay: RegionReplay, clean: PassResult) -> None:
        spec, seeds = self.settings.noise, self.settings.seeds
        targets = self._targets(clean)
        noise = {clean.rows[r].key: slot for r, slot in targets.values()}
        for key, d in clean.decisions.items():
            if key not in targets:  # ids converted to floats, a parameter: no recompute noise reaches them
                d.margins = _rows_only(d.margins)
        stats = {key: self._site(clean, key, targets.get(key)) for key in clean.decisions}
        for s in stats.values():
            s.calls += 1
        for key, earlier in _same_decisions(clean, targets).items():
            if stats[key] is not stats[earlier]:
                stats[key].same_as = stats[earlier].label
        flipped_keys: set = set()
        reached: set = set()  # decisions whose scores the noise moved (not behind a saved op)
        for seed in range(seeds):
            noisy = replay.run(noise, spec, seed + 1, keep=False)
            changed = _saved_changed(clean, noisy)
            region.checkpoint_error.append(changed)
            total = 0
            for key, d in clean.decisions.items():
                s = stats[key]
                flips, rows = _flipped_rows(d, noisy.decisions.get(key))
                if seed == 0:
                    s.rows += rows
                    if key in targets:
                        s.ulps.append(d.margins.ulps.cpu())
                        s.margins.append(d.margins.margins.cpu())
                self._grow(s.flips, seed, flips)
                total += flips
                if flips:
                    flipped_keys.add(key)
                    if changed:
                        s.shape_events += 1
                    else:
                        s.value_events += 1
                if key in targets:
                    sigma = _row_noise(d, noisy.decisions.get(key))
                    if sigma is not None and bool((sigma > 0).any()):
                        reached.add(key)
                    if sigma is not None:
                        s.model_flips += _model_flips(d, sigma)
                        s.score_noise.append(float(sigma.pow(2).mean().sqrt()))
            region.flips.append(total)
        if region.collectives:  # a replay count that depends on this rank's data would desynchronize the ranks
            return
        if replay.sac_ops and not self._sac_noted:
            self._sac_noted = True
            self.notes.append("selective AC: the replays serve the outputs of " + ", ".join(sorted(replay.sac_ops))
                              + " from the forward, as the policy's cache does (every call of these ops)")
        if self.settings.probe:
            self._probe(replay, clean, targets, stats, flipped_keys)
        self._remedy(region, replay, clean, noise, stats, flipped_keys, {k: t for k, t in targets.items()
                                                                         if k in reached or k in flipped_keys})

    def _site(self, clean: PassResult, key, target) -> SiteStats:
        d = clean.decisions[key]
        label = (d.module, key[0], d.source)
        s = self.sites.get(label)
        if s is None:
            m = d.margins
            m = m if target is not None else None
            s = self.sites[label] = SiteStats(label, m.kind if m is not None else None,
                                              str(m.score_dtype).replace("torch.", "") if m is not None else None,
                                              m.candidates if m is not None else None, m.k if m is not None else None)
            if target is not None:
                row = clean.rows[target[0]]
                s.target = row.key[0]
                s.noise_model = self.settings.noise.text
        return s

    @staticmethod
    def _grow(values: list, i: int, add: float) -> None:
        while len(values) <= i:
            values.append(0)
        values[i] += add

    def _probe(self, replay: RegionReplay, clean: PassResult, targets: dict, stats: dict, flipped: set) -> None:
        """For a site that never flipped: does a flip change saved shapes? Noise the size of its own margins,
        into the decision's scores, makes some rows flip; what happens to the saved tensors then is the answer."""
        for key, target in targets.items():
            s = stats[key]
            if key in flipped or s.probe is not None or s.label in self._probed:
                continue
            self._probed.add(s.label)
            s.probe = "no flip"
            d = clean.decisions[key]
            at = scores_producer(clean, d)
            margins = d.margins.margins[d.margins.margins > 0]
            for size in (margins.min(), margins.median()) if margins.numel() else ():
                noisy = replay.run({clean.rows[at[0]].key: at[1]}, NoiseSpec("abs", 2.0 * float(size)), 10_000, keep=False)
                flips, _ = _flipped_rows(d, noisy.decisions.get(key))
                if _saved_changed(clean, noisy):
                    s.probe = "shape"
                    break
                if flips:
                    s.probe = "values"

    def _remedy(self, region: RegionAudit, replay: RegionReplay, clean: PassResult, noise: dict, stats: dict,
                flipped: set, targets: dict) -> None:
        """The smallest save list that leaves no decision to flip, verified: under the audit's noise, and under
        a stress noise the size of each decision's own median margin (which flips rows without the list).

        Every decision that noise reaches is at risk at some scale (its margins have a density near zero);
        a decision fed only by another (histc of the chosen ids) needs nothing of its own."""
        save = sorted({k[0] for k in targets})
        region.save_list = save
        if not save:
            return
        region.refused = written_in_place(clean, set(save))
        stress = self._stress(clean, targets)
        for _ in range(3):
            residual, missing = [], set()
            runs = [(noise, self.settings.noise, seed + 1) for seed in range(self.settings.seeds)]
            runs += [(plan, spec, 20_000 + i) for i, (plan, spec) in enumerate(stress)]
            for plan, spec, seed in runs:
                fixed = replay.run(plan, spec, seed, served=set(save), clean=clean, keep=False)
                region.save_bytes = fixed.served_bytes
                total = 0
                for key, d in clean.decisions.items():
                    flips, _ = _flipped_rows(d, fixed.decisions.get(key))
                    total += flips
                    if flips and key in targets:
                        missing.add(key[0])
                residual.append(total + int(_saved_changed(clean, fixed)))
            region.remedy_flips = residual
            if not any(residual) or not (missing - set(save)):
                break
            save = sorted(set(save) | missing)
            region.save_list = save
        if stress:  # the same stress without the list: what the list prevents
            plan, spec = stress[0]
            bare = replay.run(plan, spec, 20_000, keep=False)
            region.stress_flips = sum(_flipped_rows(clean.decisions[k], bare.decisions.get(k))[0] for k in targets)

    def _stress(self, clean: PassResult, targets: dict) -> list:
        """One plan per site: abs noise of twice its median margin into the decision's own scores."""
        plans = []
        for key in targets:
            d = clean.decisions[key]
            at = scores_producer(clean, d)
            margins = d.margins.margins[d.margins.margins > 0]
            if at is not None and margins.numel():
                plans.append(({clean.rows[at[0]].key: at[1]}, NoiseSpec("abs", 2.0 * float(margins.median()))))
        return plans


def written_in_place(clean: PassResult, save: set[str]) -> dict[str, str]:
    """Each op of `save` whose output the forward writes in place later, directly or through a view (a router that
    normalises its top-k weights with `/=`): selective AC refuses to serve that cached tensor in the recompute ("Tensor
    cached during selective activation checkpoint has been mutated"). {op: "aten.div_.Tensor in its module"}"""
    origin: dict[int, int] = {}  # row -> the row of the op of `save` whose output it is, or views
    refused: dict[str, str] = {}
    for i, row in enumerate(clean.rows):
        if row.key[0] in save:
            origin[i] = i
            continue
        first = row.producers[0] if row.producers else None
        source = origin.get(first[0]) if first is not None else None
        if source is None:
            continue
        if is_in_place_method(row.key[0]):
            refused.setdefault(clean.rows[source].key[0], f"{row.key[0]} in {row.module or 'the region'}")
            origin[i] = source
        elif row.views:
            origin[i] = source
    return refused


def _same_decisions(clean: PassResult, targets: dict) -> dict:
    """key -> the key of an earlier decision on the same scores, with the same choice and margins (`argmax` and
    `max(dim)` of one router's probabilities): one decision, which flips in both or neither, counted once."""
    out, seen = {}, {}
    for key, target in targets.items():
        m = clean.decisions[key].margins
        shape = (target, m.kind, m.k, m.dim, m.candidates)
        first = seen.setdefault(shape, key)
        if first is not key and torch.equal(clean.decisions[first].margins.margins, m.margins):
            out[key] = first
    return out


def _saved_changed(clean: PassResult, other: PassResult) -> bool:
    """Would torch's check fail: another count of saved tensors, or another shape or dtype among them."""
    if other.error is not None:
        return True
    return len(clean.saved) != len(other.saved) or any(a != b for a, b in zip(clean.saved, other.saved))


def scores_producer(clean: PassResult, d) -> tuple[int, int] | None:
    """The op (row, slot) whose output decision `d` decides on, where recompute noise can reach it: its scores; for a
    comparison whose scores are the region's input (`x > x.mean()`), its threshold, which the region computes."""
    hit = producer_of(clean, d.index, d.margins.score_arg)
    if not reachable(clean, hit) and d.margins.kind == "comparison":
        other = producer_of(clean, d.index, 1)
        return other if reachable(clean, other) else hit
    return hit


def _rows_view(t: torch.Tensor, dim: int | None) -> torch.Tensor:
    if dim is None or t.dim() == 0:
        return t.reshape(1, -1)
    return t.movedim(dim, -1).reshape(-1, t.shape[dim]) if t.shape[dim] else t.reshape(1, -1)


# Discrete ops whose output is data picked by a decision, not the decision: only their shape can flip.
_DATA_OUTPUTS = frozenset({"where", "masked_select", "_local_scalar_dense"})


def _flipped_rows(clean, noisy) -> tuple[int, int]:
    """(rows whose decision changed, rows): rows of a chooser (its indices), elements of anything else."""
    if not clean.outputs:
        return 0, 0
    m = clean.margins
    packet = packet_of(clean.key[0])
    slot = min(DECISION_OUTPUT.get(packet, 0), len(clean.outputs) - 1)
    a = clean.outputs[slot]
    # a chooser keeps its row's choices along `dim` (topk, sort), unless it reduced that dim away (max.dim,
    # argmax without keepdim: one choice per row, each an element of the output)
    by_row = m is not None and m.kind == "chooser" and not (clean.scores is not None and clean.scores.dim() > a.dim())
    rows = _rows_view(a, m.dim) if by_row else a.reshape(-1, 1)
    total = rows.shape[0] if by_row else max(a.numel(), 1)
    if noisy is None:  # not reached: the noisy pass failed or took another path first (its saved shapes say so)
        return 0, total
    if len(noisy.outputs) <= slot or noisy.outputs[slot].shape != a.shape:
        return total, total
    if packet in _DATA_OUTPUTS:
        return 0, total
    b = noisy.outputs[slot]
    rb = _rows_view(b, m.dim) if by_row else b.reshape(-1, 1)
    same = same_candidates(clean) if by_row and not a.is_floating_point() else None
    if same is not None:  # (one duplicate for another: the same scores, the same values gathered, in any recompute)
        rows, rb = same[rows], same[rb]
    differs = rows != rb
    if a.is_floating_point():
        differs &= ~(rows.isnan() & rb.isnan())
    return int(differs.any(dim=-1).sum()), total


_SAME_CANDIDATES_MAX = 1 << 24  # score elements past which duplicated candidates are not looked for


def same_candidates(clean) -> torch.Tensor | None:
    """Per candidate of a chooser (along its dim), a number it shares with every candidate whose scores equal its own in
    every row (a memory bank that holds the same item twice, in-batch negatives repeated): such candidates tie
    exactly in any recompute, from the same inputs; None where none repeats (or past the size bound)."""
    if clean.candidates is not None:
        return clean.candidates if clean.candidates.numel() else None
    m, scores = clean.margins, clean.scores
    clean.candidates = torch.empty(0, dtype=torch.long)
    if m is None or m.kind != "chooser" or scores is None or scores.numel() > _SAME_CANDIDATES_MAX:
        return None
    columns = _rows_view(scores, m.dim).T.contiguous()
    _, ids = torch.unique(columns, dim=0, return_inverse=True)
    if int(ids.max()) + 1 == columns.shape[0]:
        return None
    clean.candidates = ids
    return ids


def _row_noise(clean, noisy) -> torch.Tensor | None:
    """Per row: the rms change of the decision's scores in this noisy pass (score units)."""
    if clean.scores is None or noisy is None or noisy.scores is None or noisy.scores.shape != clean.scores.shape:
        return None
    delta = (noisy.scores.to(torch.float64) - clean.scores.to(torch.float64))
    m = clean.margins
    if m.kind == "chooser":
        rows = _rows_view(delta, m.dim)
        sigma = rows.pow(2).mean(dim=-1).sqrt()
        if m.pair is None or m.pair.shape[0] != rows.shape[0]:
            return sigma
        # (a tie the noise did not move, two exact zeros a mask put there, or one between duplicated candidates:
        # no summation order parts them)
        pair = m.pair.to(rows.device)
        still = rows.gather(1, pair).eq(0).all(dim=-1)
        same = same_candidates(clean)
        if same is not None:
            ids = same.to(rows.device)[pair]
            still |= ids[:, 0] == ids[:, 1]
        return torch.where(still, torch.zeros_like(sigma), sigma)
    return delta.reshape(-1).abs() if delta.numel() == m.margins.numel() else None


def _model_flips(clean, sigma: torch.Tensor) -> float:
    """Expected flipped rows: a chooser's gap moves by the difference of two scores' noise (std sqrt(2) sigma),
    a threshold's distance by one score's: P(flip) = Phi(-margin / that)."""
    m = clean.margins
    if sigma.numel() != m.margins.numel():
        return 0.0
    scale = sigma.to(m.margins.device) * (_SQRT2 if m.kind == "chooser" else 1.0)
    z = torch.where(scale > 0, m.margins / scale.clamp_min(1e-300), torch.full_like(scale, math.inf))
    p = 0.5 * torch.erfc(z / _SQRT2)
    return float(p.sum())



def _rows_only(m):
    """A decision's row structure without a margin of its own (it flips only when what feeds it does)."""
    return None if m is None else replace(m, margins=m.margins[:0], ulps=m.ulps[:0])
