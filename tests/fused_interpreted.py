"""A full recording's CUDA path on CPU: run by tests/test_fused_prints.py in a process with TRITON_INTERPRET=1 (Triton's
interpreter runs the fused fingerprint kernels of ac_diff/capture/fused_prints.py on CPU tensors). Prints one word and
"ok" per check; an assertion ends it with a non-zero exit."""

from __future__ import annotations

import collections
import functools
import sys
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).parent))

from ac_diff.capture import fingerprint, fused_prints  # noqa: E402
from test_watch import _NO_KERNEL, MECHANISMS, recorded  # noqa: E402

_INTERPRETER = "INTERPRETED_KERNEL"
PRINTS = fused_prints.FusedPrints(fused_prints._kernels())
LAUNCHES = collections.Counter()


class _Counted:
    """A kernel whose launches (`kernel[grid](...)`) are counted."""

    def __init__(self, kernel, name: str) -> None:
        self.kernel, self.name = kernel, name

    def __getitem__(self, grid):
        LAUNCHES[self.name] += 1
        launcher = self.kernel[grid]

        def launch(*args, **kwargs):
            with record_function(_INTERPRETER):  # (its copies of the arguments are not kernels a GPU runs)
                return launcher(*args, **kwargs)
        return launch


def fused(on: bool) -> None:
    """Every tensor a full recording fingerprints on the fused kernels' path (`on`), or each reduced on its own (the
    path without them), as CUDA tensors are."""
    fingerprint.BATCH_CPU = False
    fingerprint._fused = (lambda t: PRINTS) if on else (lambda t: None)


def kernel() -> None:
    """The kernels agree with the host at the GPU's tile count; a tensor's numbers do not depend on its neighbours in a
    launch; the check refuses a kernel that reads a dtype wrongly."""
    PRINTS.check(torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(70, 33, generator=g), torch.randn(5000, generator=g)
    alone = fused_prints.combine(*PRINTS.launch(a.device, a.dtype, [(a.data_ptr(), 70, 33)]))
    among = fused_prints.combine(*PRINTS.launch(a.device, a.dtype, [(b.data_ptr(), 5000, 1), (a.data_ptr(), 70, 33)]))
    assert alone[0] == among[1], (alone, among)
    wrong = dict(fused_prints._VALUE)
    fused_prints._VALUE[torch.bfloat16] = 2  # bfloat16 bits read as float16
    try:
        PRINTS.check(torch.device("cpu"))
        raise AssertionError("the check passed a kernel that reads bfloat16 as float16")
    except RuntimeError:
        pass
    finally:
        fused_prints._VALUE.update(wrong)


def verdicts() -> None:
    """Each mechanism's verdict, lead module, cause and first divergent op are those of the per-tensor path."""
    with tempfile.TemporaryDirectory() as tmp:
        for name, (kwargs, expected) in sorted(MECHANISMS.items()):
            fused(False)
            _, _, alone, alone_losses, _ = recorded(Path(tmp), f"{name}-alone", kwargs)
            fused(True)
            rec, _, report, losses, _ = recorded(Path(tmp), name, kwargs)
            assert rec.errors == [], rec.errors
            assert report.verdict == alone.verdict == expected, (name, report.headline)
            assert losses == alone_losses  # the recorder changes nothing it observes
            if expected == "diverged":
                lead, want = report.lead_groups()[0][0], alone.lead_groups()[0][0]
                assert (lead.module, lead.cause.kind, lead.first_divergence().op) == \
                    (want.module, want.cause.kind, want.first_divergence().op), name


def launches() -> None:
    """Kernels a recorded step adds per fingerprinted output, counted with the profiler (torch's kernels inside the
    fingerprint batch) and at the fused kernels' launches: at most one; each reduced on its own, about three."""
    from test_watch import Net, train
    import ac_diff

    def count(on: bool) -> tuple[int, int]:
        fused(on)
        outputs, inside = [0], "ACDIFF"

        def scoped(fn, counts: bool = False):
            @functools.wraps(fn)
            def wrapper(*a, **k):
                with record_function(inside):
                    r = fn(*a, **k)
                if counts and r is not None:
                    outputs[0] += 1
                return r
            return wrapper

        methods = {name: getattr(fingerprint.FingerprintBatch, name) for name in ("add", "flush", "launch", "keep")}
        for name, fn in methods.items():
            setattr(fingerprint.FingerprintBatch, name, scoped(fn, counts=name == "add"))
        LAUNCHES.clear()
        try:
            torch.manual_seed(0)
            model = Net()
            with tempfile.TemporaryDirectory() as tmp:
                with ac_diff.record(Path(tmp) / "t.jsonl", write="all"):
                    train(model, steps=1)  # (warm)
                    outputs[0] = 0
                    LAUNCHES.clear()
                    with profile(activities=[ProfilerActivity.CPU]) as prof:
                        train(model, steps=1)
        finally:
            for name, fn in methods.items():
                setattr(fingerprint.FingerprintBatch, name, fn)
        kernels = sum(1 for e in prof.events() if _kernel_inside(e, inside)) + sum(LAUNCHES.values())
        return kernels, outputs[0]

    PRINTS.floats, PRINTS.ints = _Counted(PRINTS.floats, "floats"), _Counted(PRINTS.ints, "ints")
    try:
        (alone, n_alone), (kernels, n) = count(False), count(True)
    finally:
        PRINTS.floats, PRINTS.ints = PRINTS.floats.kernel, PRINTS.ints.kernel
    assert n == n_alone > 20, (n, n_alone)
    assert LAUNCHES["floats"] >= 1
    assert kernels <= n, f"{kernels} kernels for {n} fingerprinted outputs"
    assert alone >= 2 * n, f"{alone} kernels for {n} outputs each reduced on its own"
    print(f"launches: per fingerprinted output {kernels / n:.2f} fused, {alone / n:.2f} each on its own", end=" ")


def _kernel_inside(e, scope: str) -> bool:
    """An outermost aten op that launches a kernel, under `scope`."""
    if not e.name.startswith("aten::") or e.name in _NO_KERNEL:
        return False
    p = e.cpu_parent
    while p is not None and p.name != scope:
        if p.name.startswith("aten::") or p.name == _INTERPRETER:
            return False
        p = p.cpu_parent
    return p is not None


if __name__ == "__main__":
    kernel()  # (at the GPU's tile count)
    print("kernel ok", flush=True)
    fused_prints.G = 4  # fewer programs to interpret: each still strides over many tiles
    for check in (verdicts, launches):
        check()
        print(check.__name__, "ok", flush=True)
