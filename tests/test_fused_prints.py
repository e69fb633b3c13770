"""A full recording's fused fingerprint kernels (ac_diff/capture/fused_prints.py), the path CUDA tensors take, run on
CPU by Triton's interpreter, which must be switched on before triton is imported: processes of their own."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
ENV = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}


def test_every_fingerprint_test_holds_on_the_fused_path():
    """tests/test_fingerprint.py's tests on the fused path (its `cpu_path` "fused"), but the one whose write behind
    torch's back goes through NumPy, which cannot reach a CUDA tensor's memory (held tensors are read at their flush:
    see FingerprintBatch)."""
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                           str(HERE / "test_fingerprint.py"), "-k", "fused and not write_behind_torchs_back"],
                          env=ENV, cwd=HERE.parent, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    passed = re.search(r"(\d+) passed", done.stdout)
    assert passed and int(passed.group(1)) >= 20 and "failed" not in done.stdout, done.stdout[-2000:]


def test_verdicts_and_kernel_launches_on_the_fused_path():
    """The kernels against the host, each mechanism's verdict and lead as on the per-tensor path, and at most one
    kernel per fingerprinted output (tests/fused_interpreted.py holds the checks)."""
    done = subprocess.run([sys.executable, str(HERE / "fused_interpreted.py")], env=ENV, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    words = done.stdout.split()
    assert [w for w in words if w in ("kernel", "verdicts", "launches", "ok")] == \
        ["kernel", "ok", "verdicts", "ok", "launches", "ok"], done.stdout


def test_the_diagnosis_tests_hold_with_every_tensor_on_the_fused_path():
    """The end-to-end diagnosis tests (every mechanism's verdict, lead, cause and first divergent op; saved values;
    never clean over a divergence) with every tensor a full recording fingerprints on the fused path
    (tests/fused_everywhere.py)."""
    files = ["test_diagnosis_examples.py", "test_trust_diagnosis.py", "test_saved_values.py", "test_never_clean.py",
             "test_inplace_input.py", "test_derived_ops.py"]
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "fused_everywhere",
                           *(str(HERE / f) for f in files)], env={**ENV, "PYTHONPATH": str(HERE)}, cwd=HERE.parent,
                          capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    passed = re.search(r"(\d+) passed", done.stdout)
    assert passed and int(passed.group(1)) >= 40 and "failed" not in done.stdout, done.stdout[-2000:]
