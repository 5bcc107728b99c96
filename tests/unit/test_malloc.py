"""``keep_freed_memory``: a freed big temporary's pages are reused, not faulted in again."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

_CHILD = r"""
import json, resource, sys
from frforensics._malloc import keep_freed_memory
took = keep_freed_memory() if sys.argv[1] == "keep" else None
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):  # ten 48 MiB temporaries, one at a time, as the analysis makes them
    a = b"\x01" * (48 * 2**20)  # above glibc's largest mmap threshold (32 MiB); written
    del a
print(json.dumps({"took": took, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


def _faults(mode: str) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-c", _CHILD, mode], capture_output=True, text=True,
                         check=True, timeout=120).stdout
    return json.loads(out)


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                    reason="mallopt is glibc's")
def test_freed_temporaries_are_reused_not_faulted_again() -> None:
    default, kept = _faults("default"), _faults("keep")
    assert kept["took"] is True
    # default: each 48 MiB temporary is a fresh mapping, 12,288 page faults apiece
    # (numpy's own big arrays may get huge pages, hence bytes here); kept: the
    # first one faults, the other nine reuse its pages
    assert default["faults"] > 100_000, default  # type: ignore[operator]
    assert kept["faults"] < default["faults"] / 4, (kept, default)  # type: ignore[operator]
