"""`ac-diff demo`: the bundled MoE example end to end (record, diagnose, report), on CPU in seconds.

The example updates an MoE router's load-balancing `expert_bias` between the forward and the
recompute; torch raises CheckpointError, and the report names the buffer, the flipped topk and the
fix. Exit 0 when the demo showed what it should. The example's own output goes to stderr, and its expected
CheckpointError is one line there (the traceback with AC_DIFF_DEBUG=1): stdout holds the report alone, so
`ac-diff demo --format json | jq` works.
"""

from __future__ import annotations

import sys
from importlib.util import find_spec
from pathlib import Path

from ..diagnosis import Settings
from ..capture.recorder import RecordOptions
from .common import EXIT_CLEAN, EXIT_INTERNAL, fail
from .run_cmd import run_command

DEMO_SCRIPT = "moe_bias_update.py"


def example_path(name: str) -> Path:
    """A bundled example: the examples/ of the checkout this ac_diff was imported from, else package data
    `ac_diff._examples` (an editable install's finder would hand out its own checkout's, not this one's)."""
    root = Path(__file__).resolve().parents[2]
    candidates = [root / "examples" / name] if (root / "pyproject.toml").is_file() else []
    spec = find_spec("ac_diff._examples")
    if spec is not None and spec.submodule_search_locations:
        candidates += [Path(p) / name for p in spec.submodule_search_locations]
    for c in candidates:
        if c.is_file():
            return c
    raise FileNotFoundError(name)


def demo_command(output_dir: str, fmt: str, json_path: str | None, output: str | None) -> int:
    try:
        script = example_path(DEMO_SCRIPT)
    except FileNotFoundError:
        return fail("the bundled example is missing from this installation; reinstall ac-diff", EXIT_INTERNAL)
    print(f"ac-diff demo: running {script.name} (a 2-layer MoE whose router bias is updated between forward "
          "and backward) under the recorder...", file=sys.stderr)
    code = run_command(str(script), [], module=False, output_dir=output_dir, force=True, check=False, fmt=fmt,
                       json_path=json_path, output=output, options=RecordOptions(), settings=Settings(),
                       example=True)
    # the example is meant to crash with CheckpointError (exit 1); the demo succeeded if it did
    return EXIT_CLEAN if code == 1 else (code or EXIT_INTERNAL)
