"""Run a training script with every non-reentrant checkpoint() it makes switched to another AC mode.

    python ac_modes.py --ac sac    script.py [args]     selective AC, op level: topk and the matmuls saved
    python ac_modes.py --ac sac --save mm script.py     ... only the matmuls
    python ac_modes.py --ac nested -m pkg.train [args]  each checkpointed function checkpointed again inside
    python ac_modes.py --ac full   script.py [args]     as the script does it

Used by tests/test_clean_everywhere.py: a run that is clean stays clean in every mode. The script's own
`context_fn` (torchtitan's op-level save list) is kept; reentrant checkpoints are left alone.
"""

from __future__ import annotations

import argparse
import functools
import runpy
import sys
from pathlib import Path

import torch
import torch.distributed.algorithms._checkpoint.checkpoint_wrapper as _wrapper
import torch.utils.checkpoint as cp

MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}
SAVED = set(MATMULS) | {torch.ops.aten.topk.default}
CHECKPOINT_OPTIONS = ("preserve_rng_state", "determinism_check", "debug", "early_stop")


def _save_topk_and_matmuls(ctx, op, *args, **kwargs):
    return cp.CheckpointPolicy.MUST_SAVE if op in SAVED else cp.CheckpointPolicy.PREFER_RECOMPUTE


def install(mode: str) -> None:
    real = cp.checkpoint

    @functools.wraps(real)
    def checkpoint(function, *args, use_reentrant=None, context_fn=cp.noop_context_fn, **kwargs):
        if use_reentrant is not False or mode == "full":
            return real(function, *args, use_reentrant=use_reentrant, context_fn=context_fn, **kwargs)
        options = {k: kwargs.pop(k) for k in CHECKPOINT_OPTIONS if k in kwargs}
        if mode == "sac" and context_fn is cp.noop_context_fn:
            context_fn = functools.partial(cp.create_selective_checkpoint_contexts, _save_topk_and_matmuls)
        if mode == "nested":
            inner = function

            def function(*a, **k):
                return real(inner, *a, use_reentrant=False, **k)
        return real(function, *args, use_reentrant=False, context_fn=context_fn, **options, **kwargs)

    cp.checkpoint = checkpoint
    _wrapper.torch_utils_checkpoint = checkpoint  # checkpoint_wrapper binds it at import


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ac", choices=["full", "sac", "nested"], required=True)
    p.add_argument("--save", choices=["topk,mm", "mm"], default="topk,mm",
                   help="what selective AC saves (a script that updates topk's values in place needs mm: SAC "
                        "refuses a cached tensor that was mutated)")
    p.add_argument("-m", dest="module", default=None, help="run a module, like python -m")
    p.add_argument("target", nargs="?", help="the script (everything after it, or after -m MODULE, is its own)")
    argv = sys.argv[1:]
    cut = next((i + 2 for i, a in enumerate(argv) if a == "-m"), None)
    if cut is None:
        cut = next((i + 1 for i, a in enumerate(argv) if not a.startswith("-") and (i == 0 or argv[i - 1] not in
                                                                                 ("--ac", "--save"))), len(argv))
    args = p.parse_args(argv[:cut])
    rest = argv[cut:]
    if args.save == "mm":
        SAVED.discard(torch.ops.aten.topk.default)
    install(args.ac)
    if args.module:
        sys.argv = [args.module, *rest]
        runpy.run_module(args.module, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [args.target, *rest]
        sys.path.insert(0, str(Path(args.target).resolve().parent))
        runpy.run_path(args.target, run_name="__main__")


if __name__ == "__main__":
    main()
