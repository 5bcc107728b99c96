"""A real 4-rank gloo job on torch 2.15 that loses rank 2 and keeps training.

    PYTHONPATH=src /root/.cache/frforensics/venv-torch-2.15.0/bin/python bench/recovery/demo.py [stop|kill] [job|dir]

Rank 2 freezes (SIGSTOP: a hung host, nothing in the process runs) or is killed
(SIGKILL) before step 5; ranks 0, 1, 3 recover and train 20 more steps. Prints the
job's log (every rank's stderr/stdout, time-stamped, merged) and the measured times.
The verdict is the job's own (recorder, issue 13) or, with ``dir``, fr-analyze on the
shared dump directory.
Recorder deadline 3 s, gloo op timeout 5 s (the group's timeout), store poll 0.2 s.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

WORKER = r'''
import json, os, signal, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
import frforensics.recorder as recorder
from frforensics import recovery

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
DUMP_DIR, MODE = os.environ["DEMO_DUMPS"], os.environ["DEMO_MODE"]
recorder.enable(DUMP_DIR, timeout_s=3.0, store_poll_interval_s=0.2)
dist.init_process_group("gloo", timeout=timedelta(seconds=5), enable_reconfigure=True)
source = (recovery.verdict_from_dump_dir(DUMP_DIR, world_size=world)
          if os.environ["DEMO_SOURCE"] == "dir" else None)  # None: the job's own verdict
rec = recovery.setup(options=recovery.Options(
    verdict_timeout_s=25, arrival_timeout_s=8, reconfigure_timeout_s=8), source=source)
def say(msg): print(f"{time.time():.3f} step-log rank {rank}: {msg}", flush=True)
step, after = 0, 0
while after < 20:
    if rank == 2 and step == 5:
        say("freezing (SIGSTOP)" if MODE == "stop" else "dying (SIGKILL)")
        os.kill(os.getpid(), signal.SIGSTOP if MODE == "stop" else signal.SIGKILL)
    with rec.guard() as g:
        x = torch.tensor([float(rank + 1)])
        dist.all_reduce(x)
        assert x.item() == sum(m + 1 for m in rec.members)
    if g.reconfigured:
        say(f"RECONFIGURED: rank {g.rank} of {g.world_size}, excluded {g.excluded}, "
            f"recovery took {g.seconds:.2f} s after the step failed")
        continue
    if rec.history:
        if after == 0:
            say(f"first step after recovery done (step {step}, sum {x.item():g})")
        after += 1
    elif step in (0, 4):
        say(f"step {step} done (sum {x.item():g})")
    step += 1
say(f"20 steps after recovery done; members {rec.members}")
rel = os.path.join(os.path.dirname(DUMP_DIR), "release")
end = time.monotonic() + 30
while not os.path.exists(rel) and time.monotonic() < end:
    time.sleep(0.1)
os._exit(0)
'''


def main() -> int:
    mode = sys.argv[1] if len(sys.argv) > 1 else "stop"
    source = sys.argv[2] if len(sys.argv) > 2 else "job"
    root = Path(tempfile.mkdtemp(prefix="frf-recovery-demo-"))
    (root / "dumps").mkdir()
    (root / "worker.py").write_text(WORKER)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    lines: list[tuple[float, str]] = []
    lock = threading.Lock()

    def pump(rank: int, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip()
            if "TCPStore" in line or not line.strip():
                continue
            with lock:
                lines.append((time.time(), f"[rank {rank}] {line}"))

    procs = []
    for rank in range(4):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="4", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), DEMO_DUMPS=str(root / "dumps"), DEMO_MODE=mode, DEMO_SOURCE=source,
                   OMP_NUM_THREADS="1", TORCH_CPP_LOG_LEVEL="ERROR", PYTHONUNBUFFERED="1")
        p = subprocess.Popen([sys.executable, str(root / "worker.py")], env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        procs.append(p)
        threading.Thread(target=pump, args=(rank, p), daemon=True).start()
    end = time.monotonic() + 120
    while time.monotonic() < end and sum("20 steps after recovery done" in t for _, t in lines) < 3:
        time.sleep(0.2)
    if mode == "stop":
        os.kill(procs[2].pid, signal.SIGCONT)
        procs[2].wait(timeout=20)
    (root / "release").write_text("")
    for p in procs:
        p.wait(timeout=30)
    time.sleep(0.5)
    lines.sort()
    t_hang = next((t for t, x in lines if "freezing" in x or "dying" in x), lines[0][0])
    first = [t for t, x in lines if "first step after recovery" in x]
    for t, x in lines:
        print(f"+{t - t_hang:7.3f} s  {x}")
    print(json.dumps({"mode": mode, "verdict_source": source, "exit_codes": [p.returncode for p in procs],
                      "hang_to_first_step_after_s": round(max(first) - t_hang, 3) if first else None}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
