"""The recorder's default path (``recorder_path="auto"``, docs/recorder-native.md) as a
user meets it: a job under torchrun with the recorder turned on by the environment
only. On a machine where the native path is not built the job records with the
Python wrapper and one background build per machine makes it; the next job records
natively. A build that fails is left marked and never retried by later jobs.

A real compile into a cache of the test's own (about 20-40 s here): where it cannot
be built the test fails with the build's log, never skips.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from frforensics.recorder import _cxx

pytestmark = [pytest.mark.slow]

BUILD = str(Path(sys.executable).parent / "frforensics-native-build")  # the console script

NATIVE = "recorded on the native path (recorder_path=cxx)"
STARTED = "the native recording path is not built on this machine yet: building it"
TRAIN = r"""
import torch, torch.distributed as dist
import frforensics.recorder as recorder
dist.init_process_group("gloo")
t = torch.ones(4)
for _ in range(3):
    dist.all_reduce(t)
recorder.dump()
dist.destroy_process_group()
"""


def _job(run_torchrun: Any, cache: Path, name: str, **extra: str) -> tuple[Any, str]:
    # the recorder's default: no path asked for (tests/conftest.py pins one otherwise)
    env = {"FRFORENSICS_ENABLE": "1", "FRFORENSICS_RECORDER_PATH": "",
           "FRFORENSICS_CXX_CACHE": str(cache), **extra}
    job = run_torchrun(TRAIN, nproc=2, env=env, name=name)
    assert job.wait(120) == [0], job.logs()
    for r in range(2):
        ops = [job.decode(r).string(int(i)) for i in job.decode(r).entries.op]
        assert ops == ["all_reduce"] * 3, (r, ops)
    return job, job.logs()


def _wait_for(path_glob: str, cache: Path, timeout_s: float) -> Path:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = sorted(cache.glob(path_glob))
        if found:
            return found[0]
        time.sleep(0.5)
    logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in cache.glob(f"*/{_cxx.LOG}"))
    raise AssertionError(f"no {path_glob} under {cache} after {timeout_s:g} s; build log:\n{logs}")


@pytest.mark.timeout(400)
def test_the_first_job_records_in_python_and_builds_the_native_path_for_the_next(
        run_torchrun, tmp_path):
    cache = tmp_path / "cache"
    job, logs = _job(run_torchrun, cache, "first")
    assert logs.count(STARTED) == 1, logs  # one line, from local rank 0 only
    for r in range(2):
        notes = job.decode(r).notes
        assert NATIVE not in notes
        # rank 0 started it; rank 1 asked before (not built yet) or after (being built)
        assert {"recorded with the Python wrapper (native path: not built on this machine "
                "yet)", "recorded with the Python wrapper (native path: being built on this "
                "machine)"} & set(notes), notes
    _wait_for(f"*/{_cxx.MODULE}.so", cache, 300)
    job, logs = _job(run_torchrun, cache, "second")
    assert STARTED not in logs and "native recording path" not in logs, logs
    assert all(NATIVE in job.decode(r).notes for r in range(2))
    # what an image's build step runs: the build is there, said with its place
    out = subprocess.run([BUILD], capture_output=True, text=True,
                         env={**_env(), "FRFORENSICS_CXX_CACHE": str(cache)}, timeout=120)
    assert out.returncode == 0 and "native recording path built: " in out.stdout, out


@pytest.mark.timeout(300)
def test_a_failed_build_is_marked_and_later_jobs_do_not_retry_it(run_torchrun, tmp_path):
    cache = tmp_path / "cache"
    broken = {"CXX": "/bin/false"}  # a compiler that always fails
    job, logs = _job(run_torchrun, cache, "first", **broken)
    assert logs.count(STARTED) == 1, logs
    marker = _wait_for(f"*/{_cxx.FAILED}", cache, 180)
    assert marker.read_text().startswith("building it failed"), marker.read_text()
    job, logs = _job(run_torchrun, cache, "second", **broken)
    assert STARTED not in logs, logs
    for r in range(2):
        notes = job.decode(r).notes
        assert any(n.startswith("recorded with the Python wrapper (native path: an earlier "
                                "build failed (building it failed") for n in notes), notes
    out = subprocess.run([BUILD], capture_output=True, text=True,
                         env={**_env(), "FRFORENSICS_CXX_CACHE": str(cache), **broken},
                         timeout=120)
    assert out.returncode == 1, out
    assert out.stderr.startswith("frforensics: the native recording path cannot be built "
                                 "here: building it failed"), out.stderr
    assert out.stderr.count("\n") == 1, out.stderr


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("FRFORENSICS_")}
