"""The README's first screen and CI: the quick test command leaves the end-to-end tests out and `.ci/run` runs every
test; the install line asks for the torch build the user trains with, not this machine's CPU build."""

from __future__ import annotations

import re
import shlex

from conftest import REPO

README = (REPO / "README.md").read_text(encoding="utf-8")
FIRST_BLOCK = README.split("```bash\n", 1)[1].split("```", 1)[0]


def _commands(block: str) -> list[list[str]]:
    """The commands of a shell block, comments dropped, each split as the shell would."""
    return [shlex.split(line, comments=True) for line in block.splitlines() if line.strip()]


def test_the_first_screens_test_command_is_the_quick_one():
    tests = [c for c in _commands(FIRST_BLOCK) if c[:3] == ["python", "-m", "pytest"]]
    assert len(tests) == 1 and tests[0][tests[0].index("-m", 3) + 1] == "not e2e"
    assert ["ac-diff", "demo"] in _commands(FIRST_BLOCK)
    assert re.search(r"-m \"not e2e\".*\(about \d+ minutes on 2 CPU cores\)", FIRST_BLOCK)


def test_ci_runs_every_test_the_end_to_end_ones_included():
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    runs = [shlex.split(line) for line in ci.splitlines() if " pytest " in line and not line.lstrip().startswith("#")]
    options = [r[r.index("pytest") + 1:] for r in runs]
    assert options and all("-m" not in o and "-k" not in o for o in options)  # no marker or name filter


def test_the_install_line_asks_for_the_torch_build_the_user_trains_with():
    installs = [c for c in _commands(FIRST_BLOCK) if c[:2] == ["pip", "install"]]
    assert installs[0][2:] == ["torch"] and installs[1][2:] == ["-e", ".[dev]"]  # torch first, unpinned
    assert "CPU torch first" not in README and "CUDA or CPU" in FIRST_BLOCK
