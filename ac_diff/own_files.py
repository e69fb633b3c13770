"""Is a source file ac-diff's own code? Tracebacks, source lines and op origins skip ac-diff's frames.

    is_own_file(".../site-packages/ac_diff/capture/recorder.py")  -> True
    is_own_file(".../site-packages/ac_diff/_examples/moe.py")     -> False  (bundled examples are user code)
    is_own_file("/home/me/train.py")                               -> False
"""

from __future__ import annotations

import os

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_BUNDLED_EXAMPLES = PACKAGE_DIR + "_examples" + os.sep  # installed inside the package (pyproject's package-dir)


def is_own_file(filename: str) -> bool:
    return filename.startswith(PACKAGE_DIR) and not filename.startswith(_BUNDLED_EXAMPLES)
