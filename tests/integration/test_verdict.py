"""The verdict at hang time, in real multi-process gloo jobs (torchrun and plain processes).

Each job hangs on purpose with a 2 s watchdog deadline and a 0.2 s store poll;
the verdict must be in the job's log within ``timeout_s`` + 10 s of the hang,
agree with ``verdict.json`` and the store key, and the hook must run once.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.slow]

DEADLINE_S = 2.0
STORE_POLL_S = 0.2
STARTUP_S = 90.0  # up to 8 interpreters importing torch on 2 loaded cores

SKIP_SCRIPT = """
import os, sys, time, threading
from datetime import timedelta
threading.Timer(float(os.environ.get("FRT_HARD_EXIT_S", "150")), lambda: os._exit(99)).start()
import torch
import torch.distributed as dist

dist.init_process_group("gloo", timeout=timedelta(seconds=90))
rank = dist.get_rank()
t = torch.ones(8)
for step in range(1, 6):
    if rank == int(os.environ["FRT_BAD"]) and step == 3:
        continue  # this rank skips one all_reduce
    if step == 5:
        print(f"rank {rank} enters its last collective at {time.time():.3f}", flush=True)
    dist.all_reduce(t)
time.sleep(120)  # the skipping rank goes on with something else
"""

# Appends the verdict path it is given to <dump dir>/../hook_calls.
HOOK = ("{python} -c \"import sys, os; open(os.path.join(os.path.dirname(os.path.dirname("
        "sys.argv[1])), 'hook_calls'), 'a').write(sys.argv[1] + chr(10))\"")


def _verdict_env(python: str, **extra: str) -> dict[str, str]:
    return {
        "FRFORENSICS_ENABLE": "1",
        "FRFORENSICS_TIMEOUT_S": str(DEADLINE_S),
        "FRFORENSICS_STORE_POLL_INTERVAL_S": str(STORE_POLL_S),
        "FRFORENSICS_ON_VERDICT": HOOK.format(python=python),
        **extra,
    }


def _wait_for(pred: Any, timeout_s: float, what: str, logs: Any) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}\n{logs()}")
        time.sleep(0.2)


POINTER = re.compile(r"frforensics: verdict by rank (\d+) on (\S+): (.*) — culprits \[([\d, ]*)\] "
                     r"\(([^)]*)\) — (\S+) \(store key (\S+)\)")


def _pointers(log: str) -> list[dict[str, Any]]:
    """The verdicts non-elected ranks read from the store (one log line each)."""
    return [{"elected_rank": int(m.group(1)), "headline": m.group(3),
             "culprit_ranks": [int(x) for x in m.group(4).split(",") if x.strip()],
             "actions": m.group(5), "verdict_json": m.group(6), "key": m.group(7)}
            for m in POINTER.finditer(log)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("nproc", "bad"), [(4, 2), (8, 5)])
def test_skipped_collective_gives_one_verdict_in_the_job_log(run_torchrun, nproc, bad):
    import sys

    job = run_torchrun(SKIP_SCRIPT, nproc=nproc, name=f"skip{nproc}",
                       env={"FRT_BAD": str(bad), **_verdict_env(sys.executable)})
    root = job.dump_dir.parent
    log_path = job.log_dir / "torchrun.log"

    def log() -> str:
        return log_path.read_text(errors="replace")

    _wait_for(lambda: log().count("enters its last collective") == nproc, STARTUP_S,
              "every rank in its last collective", job.logs)
    hang_started = time.monotonic()
    _wait_for(lambda: "frforensics: verdict (incident 0" in log(), DEADLINE_S + 10 + 5,
              "the verdict in the job log", job.logs)
    elapsed = time.monotonic() - hang_started
    assert elapsed <= DEADLINE_S + 10, elapsed
    _wait_for(lambda: len(_pointers(log())) == nproc - 1, 10, "one line per other rank",
              job.logs)
    text = log()
    assert text.count("frforensics: verdict (incident 0") == 1, text[-4000:]
    assert re.search(rf"HANG — missing_rank: Rank {bad} never entered all_reduce #5", text), text
    report = json.loads((job.dump_dir / "verdict.json").read_text())
    assert report["culprit_ranks"] == [bad]
    assert report["actions"][0]["rank"] == bad and report["actions"][0]["action"] == "fix_code"
    headline = (job.dump_dir / "verdict.txt").read_text().splitlines()[0]
    for pointer in _pointers(text):  # what every other rank read from the store key
        assert pointer["verdict_json"] == str(job.dump_dir / "verdict.json")
        assert pointer["culprit_ranks"] == report["culprit_ranks"]
        assert pointer["actions"] == f"rank {bad}: fix_code"
        assert pointer["headline"] == headline
        assert pointer["key"] == "frforensics/0/verdict/0"
    # the hook ran exactly once, with the verdict path
    _wait_for(lambda: (root / "hook_calls").exists(), 10, "the hook", job.logs)
    time.sleep(1.0)
    assert (root / "hook_calls").read_text().splitlines() == [str(job.dump_dir / "verdict.json")]
