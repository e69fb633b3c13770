"""Logs of any size: a CheckpointError printed again and again is one error with its count and first / last line,
the report of N repetitions has as many lines as that of one, a log's regions wait on disk while it is diagnosed,
and the region table's footer counts what it hides by status. Inputs are the real llama4 rank-1 log
(tests/data/real_logs), repeated as a job that raised every step would print it (or as its ranks would, where the
regions must stay apart: a dump printed again on one rank is one region); timing is in benchmarks/compare_bench.py,
never here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ac_diff.diagnosis import diagnose
from ac_diff.logs import parse_log
from ac_diff.render import RENDERERS

REAL = Path(__file__).parent / "data" / "real_logs"
HEAD = (REAL / "torchtitan_llama4_rank1_head.log").read_text(encoding="utf-8")
TAIL = (REAL / "torchtitan_llama4_rank1_tail.log").read_text(encoding="utf-8")
ERROR = "\n".join(HEAD.split("\n")[:44]) + "\n"  # traceback frames, the CheckpointError and its 12 positions
HEADER_LINE = 7  # the line of ERROR that holds "torch.utils.checkpoint.CheckpointError: ..."
ERROR_LINES = ERROR.count("\n")


def _log(tmp_path: Path, text: str, name: str = "rank1.log") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize("n", [1, 3, 200])
def test_repeated_errors_are_one_error_with_their_count_and_first_and_last_line(tmp_path, n):
    run = parse_log(_log(tmp_path, ERROR * n))
    assert len(run.errors) == 1
    err = run.errors[0]
    assert (err.kind, err.rank, err.count) == ("metadata_mismatch", 1, n)
    assert err.first_line == HEADER_LINE and err.last_line == HEADER_LINE + ERROR_LINES * (n - 1)
    assert [p.position for p in err.positions] == [48, 49, 51, 52, 53, 55, 84, 85, 87, 88, 89, 91]
    # the JSON report carries the same, on its one torch_errors entry
    doc = json.loads(RENDERERS["json"].render(diagnose([run])))
    assert [(e["count"], e["first_line"], e["last_line"]) for e in doc["torch_errors"]] == [
        (n, err.first_line, err.last_line)]


def test_errors_that_differ_stay_apart_in_the_order_they_first_came(tmp_path):
    """Another rank, or other shapes at a position, is another error; repetitions interleaved with it still fold."""
    other_rank = ERROR.replace("[rank1]:", "[rank3]:")
    other_shape = ERROR.replace("torch.Size([98, 5120])", "torch.Size([97, 5120])")
    run = parse_log(_log(tmp_path, ERROR + other_rank + ERROR + other_shape + other_rank + ERROR))
    assert [(e.rank, e.count, e.first_line) for e in run.errors] == [
        (1, 3, HEADER_LINE), (3, 2, HEADER_LINE + ERROR_LINES), (1, 1, HEADER_LINE + 3 * ERROR_LINES)]
    assert str(run.errors[2].positions[0].recomputed) == "bf16[97, 5120]"


def _on_ranks(text: str, n: int) -> str:
    """`text` (rank 1's lines) as `n` ranks print it, one after the other."""
    return "".join(text.replace("[rank1]:", f"[rank{r}]:") for r in range(n))


def _terminal(path: Path) -> str:
    return RENDERERS["terminal"].render(diagnose([parse_log(path, lazy=True)]))


def test_the_report_of_n_repetitions_is_as_long_as_that_of_one(tmp_path):
    """40,643 repetitions printed 569,027 lines (a table row and the position list per repetition)."""
    once = _terminal(_log(tmp_path, ERROR, "once.log"))
    many = _terminal(_log(tmp_path, ERROR * 300, "many.log"))
    assert len(many.splitlines()) <= len(once.splitlines()) + 1 < 40  # (+1: the "raised" cell may wrap)
    assert "300 times, lines 7-13,163" in many and "line 7" in once


def test_a_logs_regions_wait_on_disk_and_give_the_same_report(tmp_path):
    """parse_log(lazy=True), as `compare` reads: each finished region's ops go to a temporary file and come back for
    the time its diagnosis runs, so memory holds one region, not the log; the report is the eager one."""
    path = _log(tmp_path, _on_ranks(HEAD + "\n" + TAIL + "\n", 3))
    lazy, eager = parse_log(path, lazy=True), parse_log(path)
    assert len(lazy.regions) == len(eager.regions) == 3
    for region, whole in zip(lazy.regions, eager.regions):
        assert region.forward.ops == [] and region.recompute.ops == []  # on disk
        assert region.forward.state["n_ops"] == len(whole.forward.ops) > 200
        with lazy.loaded(region):
            assert [op.op for op in region.recompute.ops] == [op.op for op in whole.recompute.ops]
            assert all(op.input_refs for op in region.recompute.ops if op.log_ids and op.log_ids[1])  # $N linked
        assert region.recompute.ops == []  # let go again
    assert (RENDERERS["json"].render(diagnose([parse_log(path, lazy=True)]))
            == RENDERERS["json"].render(diagnose([parse_log(path)])))


def test_the_region_tables_footer_counts_what_it_hides_by_status(tmp_path):
    """The table lists the first 40 diverged regions of a long run; the footer called the rest "clean/unchecked" even
    when they were diverged (102,117 of them after a signal). 45 diverged dumps of the real llama4 log's tail."""
    text = _terminal(_log(tmp_path, _on_ranks(TAIL + "\n", 45)))
    assert "5 region(s) not shown (5 diverged)" in text
    assert "clean/unchecked region(s) not shown" not in text
