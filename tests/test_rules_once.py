"""Each op rule is defined once, in ac_diff/oprules.py: capture, the log parser and diagnosis import it.

The scan reads every module of ac_diff: a second copy of a rule table, or another way of splitting an op
name into namespace / packet / overload, fails here naming the file and line.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ac_diff import oprules

PACKAGE = Path(oprules.__file__).parent

# what a copy of each rule looks like in source
COPIES = {
    "op packet parsing": re.compile(r"""\.split\(["']\.["']\)\[1\]|\.count\(["']\.["']\)\s*>=\s*2"""),
    "decision table": re.compile(r"""["']argsort["']\s*,\s*["']argmax["']"""),
    "hook-only ops": re.compile(r"""["']aten\.detach\.default["']"""),
    "reentrant-only ops": re.compile(r"""["']aten\.clone\.default["']"""),
    "outside update": re.compile(r"""\(\s*["']buffer["']\s*,\s*["']param["']\s*,\s*["']external["']\s*\)|"""
                                 r"""\{\s*["']buffer["']\s*,\s*["']param["']\s*,\s*["']external["']\s*\}"""),
    "in-place method": re.compile(r"""endswith\(["']_["']\)\s+and\s+not\s+\w+(\(\w+(\.\w+)?\))?\.startswith"""),
    "collective namespaces": re.compile(r"""["']_c10d_functional["']\s*,"""),
    "uninitialised ops": re.compile(r"""["']empty_like["']\s*,\s*["']new_empty["']"""),
    "batch norm stats updates": re.compile(r"""["']native_batch_norm["']\s*,\s*["']cudnn_batch_norm["']"""),
}


def _copies(name: str) -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "oprules.py" and path.parent == PACKAGE:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if COPIES[name].search(line):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{n}: {line.strip()}")
    return found


@pytest.mark.parametrize("name", sorted(COPIES))
def test_rule_is_defined_only_in_oprules(name):
    assert _copies(name) == [], f"{name} is defined again outside ac_diff/oprules.py"


def test_the_scan_finds_a_copy(tmp_path, monkeypatch):
    """A re-added copy is found (the scan is not vacuous)."""
    copy = tmp_path / "ac_diff"
    copy.mkdir()
    (copy / "oprules.py").write_text("")
    (copy / "elsewhere.py").write_text('packet = name.split(".")[1] if name.count(".") >= 2 else name\n'
                                       'SKIP = {"aten.detach.default"}\n')
    monkeypatch.setattr(__import__(__name__), "PACKAGE", copy)
    assert _copies("op packet parsing") and _copies("hook-only ops")


@pytest.mark.parametrize("name, decision", [
    ("aten.topk.default", True), ("aten.sort.stable", True), ("aten.argmax.default", True),
    ("aten.max.dim", True), ("aten.min.dim", True), ("aten.max.default", False),
    ("aten.max.other", False), ("aten.min.other", False), ("aten.maximum.default", False),
    ("aten.mm.default", False),
])
def test_a_decision_picks_indices_or_entries(name, decision):
    assert oprules.is_decision(name) is decision


def test_capture_and_diagnosis_agree_on_decisions():
    """The drift this module ended: capture flagged aten.max.other one way, diagnosis the other."""
    import torch

    from ac_diff.capture.opinfo import op_info
    from ac_diff.diagnosis.passdiff import is_discrete
    from ac_diff.passes import OpRecord

    for op in (torch.ops.aten.max.other, torch.ops.aten.max.dim, torch.ops.aten.max.default,
               torch.ops.aten.topk.default, torch.ops.aten.min.other):
        recorded = op_info(op).discrete
        assert recorded == is_discrete(OpRecord(index=0, op=str(op))) == oprules.is_decision(str(op))
