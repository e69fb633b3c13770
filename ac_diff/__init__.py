"""ac-diff: find where and why an activation-checkpointed region's recompute diverged from its forward.

    import ac_diff
    with ac_diff.record("ac-diff-out/trace-rank0.jsonl"):
        loss = model(batch).sum(); loss.backward()
    report = ac_diff.diagnose_paths(["ac-diff-out"])
    print(report.headline)
    trace = ac_diff.load("ac-diff-out"); trace.ops  # pandas
"""

__version__ = "0.2.0"

from .api import InputError, Trace, diagnose_paths, load, read_runs  # noqa: E402
from .diagnosis import diagnose  # noqa: E402
from .capture.recorder import Recorder, RecordOptions, record  # noqa: E402
from .report import Report  # noqa: E402
from .trace import TraceFormatError  # noqa: E402

__all__ = ["record", "Recorder", "RecordOptions", "load", "Trace", "read_runs", "diagnose", "diagnose_paths",
           "Report", "InputError", "TraceFormatError", "__version__"]
