"""ac-diff: find where and why an activation-checkpointed region's recompute diverged from its forward.

    import ac_diff
    with ac_diff.record("ac-diff-out/trace-rank0.jsonl"):
        loss = model(batch).sum(); loss.backward()
    report = ac_diff.diagnose_paths(["ac-diff-out"])
    print(report.headline)
    trace = ac_diff.load("ac-diff-out"); trace.ops  # pandas
"""

from ._version import __version__
from .api import InputError, Trace, diagnose_paths, load, read_runs
from .diagnosis import diagnose
from .errors import AcDiffError
from .capture.recorder import Recorder, RecordOptions, record
from .report import Report
from .trace import TraceFormatError

__all__ = ["record", "Recorder", "RecordOptions", "load", "Trace", "read_runs", "diagnose", "diagnose_paths",
           "Report", "AcDiffError", "InputError", "TraceFormatError", "__version__"]
