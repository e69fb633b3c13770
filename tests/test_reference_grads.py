"""Reference gradients summarized on their device, values on the host only within a budget (reference/grads.py)."""

from __future__ import annotations

import pytest
import torch

from ac_diff.capture import fingerprint
from ac_diff.reference.graddiff import compare_step
from ac_diff.reference.grads import SAMPLE, GradCapture, plan_values, summarize_all


def _grads() -> dict[str, torch.Tensor | None]:
    torch.manual_seed(0)
    return {"w": torch.randn(64, 32), "b": torch.randn(32), "big": torch.randn(300, 100), "frozen": None}


def test_the_plan_samples_everything_then_keeps_the_smallest_whole_within_the_budget():
    sizes = {"a": (10, 4), "b": (10 * SAMPLE, 4), "c": (2 * SAMPLE, 4)}
    assert plan_values(sizes, budget=10**9) == {"a": "full", "b": "full", "c": "full"}
    assert plan_values(sizes, budget=40 + 4 * SAMPLE * 3) == {"a": "full", "b": "sample", "c": "full"}
    assert plan_values(sizes, budget=40 + 4 * SAMPLE) == {"a": "full", "b": "sample", "c": "none"}
    assert plan_values(sizes, budget=0) == {"a": "none", "b": "none", "c": "none"}


def test_one_ulp_is_a_difference_and_identical_gradients_need_no_values(monkeypatch):
    copies = []
    monkeypatch.setattr(fingerprint, "to_host", lambda t: copies.append(t.numel()) or t)
    monkeypatch.setattr(fingerprint, "BATCH_CPU", False)  # each tensor on its device, as on a GPU: reads are syncs there
    g = _grads()
    a = summarize_all(g, budget=0)
    assert len(copies) == 2  # fingerprints, norms: one read-back each per device, whatever the number of gradients
    assert a["frozen"] is None and all(a[k]["values"] is None and a[k]["kept"] == "none" for k in ("w", "b", "big"))
    g2 = {k: v.clone() if v is not None else None for k, v in g.items()}
    g2["w"][3, 4] = torch.nextafter(g2["w"][3, 4], torch.tensor(10.0))
    step = compare_step(0, {"grads": a}, {"grads": summarize_all(g2, budget=0)}, [])
    assert step.identical == 3 and [d.name for d in step.differing] == ["w"]  # b, big, frozen (None in both)


def test_relative_difference_exact_sampled_or_from_the_norms_past_the_budget():
    g = _grads()
    g2 = {**g, "w": g["w"] * 1.25, "big": g["big"] * 1.5}
    whole = compare_step(0, {"grads": summarize_all(g, 1 << 30)}, {"grads": summarize_all(g2, 1 << 30)}, [])
    assert {d.name: round(d.rel_diff, 6) for d in whole.differing} == {"w": 0.2, "big": round(1 / 3, 6)}
    assert not any(d.norm_only or d.sampled for d in whole.differing)
    budget = 4 * (64 * 32 + 32) + 100  # w and b whole, big over the budget
    tight = compare_step(0, {"grads": summarize_all(g, budget)}, {"grads": summarize_all(g2, budget)}, [])
    big = next(d for d in tight.differing if d.name == "big")
    assert big.norm_only and abs(big.rel_diff - 1 / 3) < 1e-6  # a pure scaling: the norms' bound is exact here
    from ac_diff.render.sections import _diff_text
    assert "values over budget: norm only" in _diff_text(big)


def _names_of_a_step(step, tmp_path) -> list[str]:

    capture = GradCapture(tmp_path / "grads.pt").install()
    try:
        step()
        return [name for name, _ in capture.named_parameters()]
    finally:
        capture.uninstall()


def test_gradients_of_several_roots_are_named_as_the_report_names_them(tmp_path):
    """A GAN's two models, and blocks a loop calls one by one, by the variables that hold them (`G.0.weight`,
    `blocks.1.weight`), as the report names their modules; not by class and place (`Sequential[1].0.weight`)."""
    torch.manual_seed(0)
    G = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    D = torch.nn.Sequential(torch.nn.Linear(4, 1))

    def gan_step():
        fake = G(torch.randn(3, 4))
        (D(fake).mean() + D(torch.randn(3, 4)).mean()).backward()

    names = _names_of_a_step(gan_step, tmp_path)
    assert names == ["G.0.weight", "G.0.bias", "G.2.weight", "G.2.bias", "D.0.weight", "D.0.bias"]

    blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(2)])

    def blocks_step():
        x = torch.randn(2, 4)
        for block in blocks:
            x = block(x)
        x.sum().backward()

    assert _names_of_a_step(blocks_step, tmp_path) == ["blocks.0.weight", "blocks.0.bias", "blocks.1.weight",
                                                       "blocks.1.bias"]


@pytest.mark.parametrize("old_kept", [False, True])
def test_a_model_re_created_mid_training_keeps_its_name_whether_the_old_one_lives_or_not(tmp_path, old_kept):
    """Resuming from a checkpoint: `m = Net(); m.load_state_dict(...)` between steps, beside an EMA copy. Each
    backward's gradients are those of the models that ran since the last one, named by their variables: the old
    model, alive in one run (something still holds it) and collected in the other, shifted the new one to
    `Net[1]` in one run and `m` in the other, and 32 of 48 gradients "differed" (missing on one side)."""
    import copy


    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    ema = copy.deepcopy(m)
    capture, kept = GradCapture(tmp_path / "grads.pt", steps=3).install(), []
    try:
        for step in range(2):
            m(torch.randn(3, 4)).sum().backward()
            with torch.no_grad():
                ema(torch.randn(3, 4))
            if step == 0:  # resume: a new model from the old one's state
                if old_kept:
                    kept.append(m)
                state, m = m.state_dict(), torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
                                                                torch.nn.Linear(8, 2))
                m.load_state_dict(state)
    finally:
        capture.uninstall()
    names = list(capture.snapshots[1]["grads"])  # (the second backward's: after the re-creation)
    assert sorted(names) == sorted(f"{model}.{i}.{p}" for model in ("m", "ema") for i in (0, 2)
                                   for p in ("weight", "bias")), names


def test_a_reference_that_ran_more_backward_passes_than_this_run_was_asked_for_is_no_failure(tmp_path):
    """`fix` runs its reference for as many backward passes as reach the base run's divergence, more than the base
    run captured: the base's comparison said "backward 3 failed only with AC" (and, since, 'differs') although
    nothing failed. A run that stopped short of what it was asked for still says so."""
    from types import SimpleNamespace

    from ac_diff.reference.run import reference_result
    from ac_diff.reference.paths import grads_path

    def captured(directory, steps: int, backwards: int) -> None:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        capture = GradCapture(grads_path(directory, 0), steps=steps).install()
        try:
            for _ in range(backwards):
                model(torch.randn(3, 4)).sum().backward()
        finally:
            capture.finish()

    captured(tmp_path / "run", 2, 4)
    captured(tmp_path / "ref", 3, 4)
    report = SimpleNamespace(regions=[], compiled=None)
    asked = reference_result(report, tmp_path / "run", [0], 2, 0, None, reference_dir=tmp_path / "ref")
    assert asked.verdict == "identical" and "failed only" not in asked.headline, asked.headline
    short = reference_result(report, tmp_path / "run", [0], 3, 1, None, reference_dir=tmp_path / "ref")
    assert short.verdict == "differs" and "backward 3 failed only with AC" in short.headline, short.headline


def test_models_trained_on_two_threads_at_once_are_not_compared(tmp_path):
    """Two models train side by side, one per thread: which backward finishes n-th, and what the other thread has
    accumulated when its gradients are read, differs from run to run, and the comparison said '14 of 28 gradients
    differ' (or 'identical') of bit-identical training, by chance. Now: not compared, and why."""
    import threading
    from types import SimpleNamespace

    from ac_diff.reference.run import reference_result
    from ac_diff.reference.paths import grads_path

    def captured(directory, threads: int) -> None:
        models = [torch.nn.Linear(4, 2) for _ in range(threads)]
        capture = GradCapture(grads_path(directory, 0), steps=2).install()

        both = threading.Barrier(threads)

        def train(model):
            for _ in range(2):
                loss = model(torch.randn(3, 4)).sum()
                both.wait()  # (every thread's forward has run before any backward: side by side)
                loss.backward()
        try:
            workers = [threading.Thread(target=train, args=(m,)) for m in models]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
        finally:
            capture.finish()

    report = SimpleNamespace(regions=[], compiled=None)
    for threads, verdict in ((1, "identical"), (2, "not_comparable")):
        torch.manual_seed(0)
        captured(tmp_path / f"run{threads}", threads)
        torch.manual_seed(0)
        captured(tmp_path / f"ref{threads}", threads)
        result = reference_result(report, tmp_path / f"run{threads}", [0], 2, 0, None,
                                  reference_dir=tmp_path / f"ref{threads}")
        assert result.verdict == verdict, result.headline
    assert "models trained on 2 threads at once" in result.headline, result.headline


def test_a_step_that_takes_its_gradients_with_autograd_grad_is_captured_and_a_penalty_is_not(tmp_path):
    """Training that calls torch.autograd.grad(loss, params) and sets `.grad` itself (26d): `--reference no-ac` said
    the run finished no backward pass and compared nothing. Its gradients are those of the parameters among the
    inputs, by the report's names; a gradient penalty's call (create_graph=True, for an input) is no step."""
    from ac_diff.reference.grads import GradCapture, load_grads

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    capture = GradCapture(tmp_path / "g.pt", steps=2).install()
    try:
        taken = []
        for _ in range(2):
            x = torch.randn(3, 4, requires_grad=True)
            out = net(x).sum()
            (penalty,) = torch.autograd.grad(out, x, create_graph=True)
            loss = out + penalty.square().sum()
            taken.append(torch.autograd.grad(loss, list(net.parameters())))
    finally:
        capture.finish()
    data = load_grads(tmp_path / "g.pt")
    assert len(data["steps"]) == 2
    for step, grads in zip(data["steps"], taken):
        assert list(step["grads"]) == ["0.weight", "0.bias", "2.weight", "2.bias"], list(step["grads"])
        for summary, g in zip(step["grads"].values(), grads):
            assert torch.equal(torch.as_tensor(summary["values"]).reshape(g.shape), g)
    assert torch.autograd.grad.__module__ == "torch.autograd"  # (put back)
    # a functional loop's own leaves (torch.func.functional_call over detached copies, 27f: "this run finished no
    # backward pass"): by their place
    params = {k: v.detach().clone().requires_grad_() for k, v in net.named_parameters()}
    capture = GradCapture(tmp_path / "f.pt", steps=1).install()
    try:
        out = torch.func.functional_call(net, params, (torch.randn(3, 4),)).sum()
        (g0, *_) = torch.autograd.grad(out, list(params.values()))
    finally:
        capture.finish()
    (step,) = load_grads(tmp_path / "f.pt")["steps"]
    assert list(step["grads"]) == [f"autograd.grad input[{i}]" for i in range(4)], list(step["grads"])
    assert torch.equal(torch.as_tensor(step["grads"]["autograd.grad input[0]"]["values"]).reshape(g0.shape), g0)


def test_the_gradient_of_an_input_alone_is_compared_with_the_next_steps(tmp_path):
    """33a: FGSM takes `autograd.grad(loss, x)` (an input, no parameter), then trains on the adversarial example:
    the regions that gradient recomputed diverged and changed it alone, and `--reference no-ac` said "gradients
    identical". It is no step of its own (the steps stay those of the parameters' gradients): it goes with the
    next step's gradients, under its call's number."""
    from ac_diff.reference.grads import GradCapture, load_grads

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    capture = GradCapture(tmp_path / "g.pt", steps=2).install()
    taken = []
    try:
        for _ in range(2):
            x = torch.randn(3, 4, requires_grad=True)
            (gx,) = torch.autograd.grad(net(x).sum(), x)
            taken.append(gx)
            net(x + 0.1 * gx.sign()).sum().backward()
    finally:
        capture.finish()
    steps = load_grads(tmp_path / "g.pt")["steps"]
    assert len(steps) == 2
    for step, gx in zip(steps, taken):
        assert list(step["grads"]) == ["0.weight", "0.bias", "2.weight", "2.bias", "autograd.grad 1, input 0"]
        kept = step["grads"]["autograd.grad 1, input 0"]
        assert torch.equal(torch.as_tensor(kept["values"]).reshape(gx.shape), gx)


def test_a_second_backward_through_a_recompute_names_the_same_parameters(tmp_path):
    """35e P1-1: two backwards through one checkpointed graph (retain_graph=True): the second's recompute calls the
    checkpointed module, which counted as the only model that ran since the first backward, so the gradients of the
    others were "missing" with AC and the run DIVERGED by `--reference`. A recompute is no model the step ran."""
    from torch.utils.checkpoint import checkpoint

    def two_backwards(ac: bool) -> list:
        torch.manual_seed(0)
        emb, blk, ha, hb = (torch.nn.Linear(4, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 1),
                            torch.nn.Linear(8, 1))
        capture = GradCapture(tmp_path / f"grads-{ac}.pt", steps=2).install()
        try:
            h = emb(torch.randn(4, 4))
            h = checkpoint(blk, h, use_reentrant=False) if ac else blk(h)
            la, lb = ha(h).pow(2).mean(), hb(h).pow(2).mean()
            la.backward(retain_graph=True)
            lb.backward()
        finally:
            capture.uninstall()
        return [sorted(s["grads"]) for s in capture.snapshots]

    with_ac, without = two_backwards(True), two_backwards(False)
    assert len(with_ac) == 2 and with_ac == without and len(with_ac[1]) == 8, (with_ac, without)
