"""The job behind tests/data/native_frontiers (README.md there): 4 gloo ranks, an
all_reduce per step and a broadcast every third step; rank 1's fault at step 5.

    FAULT=stop|raise|errpath FRFORENSICS_ENABLE=1 FRFORENSICS_DUMP_DIR=DIR \
    FRFORENSICS_DUMP_ON_EXIT=always FRFORENSICS_VERDICT=0 FRFORENSICS_TIMEOUT_S=5 \
    python -m torch.distributed.run --standalone --nproc-per-node 4 job.py

stop: rank 1 leaves the loop early (a local early-stopping decision) and exits;
raise: rank 1 raises ValueError; errpath: rank 1 ``os._exit(1)``s (no dump), and
each survivor's error handler issues new collectives, rank 0 a barrier first,
ranks 2 and 3 a broadcast first (as a framework's error path does).
"""
import contextlib
import datetime
import os
import time

import torch
import torch.distributed as dist

fault = os.environ.get("FAULT", "none")
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=10))
r = dist.get_rank()
t = torch.ones(16)


def step(i):
    dist.all_reduce(t)
    if i % 3 == 0:
        dist.broadcast(t, 0)


try:
    for i in range(10):
        if r == 1 and i == 5:
            if fault == "raise":
                raise ValueError("planted")
            if fault in ("exit", "errpath"):
                os._exit(1)
            if fault == "stop":
                break
        step(i)
        time.sleep(0.01)
except Exception as e:
    print(r, "exc", type(e).__name__, flush=True)
    if fault == "errpath" and r != 1:
        # a framework's error path: new collectives, in a different order per rank
        calls = [dist.barrier, lambda: dist.broadcast(t, 0)]
        for f in (calls if r == 0 else calls[::-1]):
            with contextlib.suppress(Exception):
                f()
    raise
