"""Every test, and every process a test starts, records on one chosen path.

The recorder's default, ``recorder_path="auto"``, records natively where the native
path is already built on the machine and otherwise starts a background build: a test
run would then depend on what an earlier run left in ``~/.cache``. So the tests run
on the Python wrapper unless ``FRT_RECORDER_PATH`` names another path (``cxx``: the
native lanes of ``.ci/run``); the default itself is tested with a cache of its own
(tests/integration/test_recorder_auto.py, tests/unit/test_cxx_build.py).
"""

from __future__ import annotations

import os

os.environ["FRFORENSICS_RECORDER_PATH"] = os.environ.get("FRT_RECORDER_PATH") or "python"
