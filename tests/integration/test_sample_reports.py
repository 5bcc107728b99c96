"""No refactoring changes a verdict: the JSON report of every ``sample_dumps/``
directory is byte-identical to the one committed in ``tests/data/sample_reports/``
(``scripts/sample_reports.py``; a change meant to alter a report rewrites them
with ``--write`` and shows the difference in its commit)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_sample_report_is_byte_identical_to_the_committed_one() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "sample_reports.py"), "--check"],
                          capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "sample reports identical" in proc.stdout
