"""Every position in torch's own CheckpointError maps, in the trace, to an op with torch's saved shape."""

from __future__ import annotations

import re
import sys

import pytest
import torch

import ac_diff
from conftest import EXAMPLES

sys.path.insert(0, str(EXAMPLES))
import tiny_moe  # noqa: E402

_ENTRY = re.compile(r"tensor at position (\d+):\s*saved metadata: \{'shape': torch\.Size\(\[([\d, ]*)\]\)")


def test_torch_positions_map_to_ops_with_the_saved_shape(tmp_path):
    path = tmp_path / "t.jsonl"
    with pytest.raises(torch.utils.checkpoint.CheckpointError) as caught:
        with ac_diff.record(path):
            tiny_moe.train(steps=1, bias_update="forward_hook", log=lambda _: None)
    torch_positions = {int(p): [int(s) for s in shape.split(",") if s.strip()]
                       for p, shape in _ENTRY.findall(str(caught.value))}
    assert len(torch_positions) >= 2, str(caught.value)[:500]

    trace = ac_diff.load(path)
    positions = trace.positions
    # the region torch checked is the one the recorder saw fail its check
    failing = trace.runs[0].errors[0].region
    saved = positions[(positions.region == failing) & (positions.phase == "forward")].set_index("position")
    for position, shape in torch_positions.items():
        row = saved.loc[position]
        assert row["shape"] == shape, (position, row.to_dict())
        assert row["origin"] == "op" and row["op"].startswith("aten."), row.to_dict()
        assert str(row["module"]).startswith(f"layers.{failing}"), row.to_dict()
        assert "tiny_moe.py" in row["source"]

    report = ac_diff.diagnose(trace.runs)
    region = next(r for r in report.regions if r.region == failing)
    flagged = {p.position for p in region.positions if p.matches is False}
    assert flagged == set(torch_positions)
    assert {p.position for p in region.positions if p.in_torch_error} == set(torch_positions)
