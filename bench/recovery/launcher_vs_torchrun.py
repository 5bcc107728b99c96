"""Crash → first training step after: frforensics-run against torchrun --max-restarts 1.

    PYTHONPATH=src /root/.cache/frforensics/venv-torch-2.15.0/bin/python \\
        bench/recovery/launcher_vs_torchrun.py [--repeat N]

Both in one run, same machine, same 4-rank gloo job (all_reduce steps), rank 2
SIGKILLed before step 5:

- ``frforensics-run --nproc-per-node 4 --standalone``: the recorder on (deadline
  3 s), op timeout 5 s, ``recovery.guard`` around each step; the agent records the
  death, the survivors re-form as 3 ranks. Measured: from the kill (the victim's
  own timestamp just before ``os.kill``) to the last survivor's first step after.
- ``torchrun --max-restarts 1`` (``torchrun_restart.py``): the agent stops the
  others and starts 4 new processes. Measured: from the kill to the last rank's
  first step of the new generation (no checkpoint load, which favours it).

Prints one JSON line per run and a summary line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

WORKER = r'''
import json, os, signal, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
import frforensics.recorder as recorder
from frforensics import recovery
OUT = os.environ["BENCH_OUT"]
recorder.enable(os.path.join(OUT, "dumps"), timeout_s=3.0, store_poll_interval_s=0.2)
dist.init_process_group("gloo", timeout=timedelta(seconds=5), enable_reconfigure=True)
rec = recovery.setup(options=recovery.Options(verdict_timeout_s=25, arrival_timeout_s=8,
                                              reconfigure_timeout_s=8))
step, after = 0, 0
while after < 5:
    if rec.me == 2 and step == 5:
        open(os.path.join(OUT, "killed"), "w").write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    with rec.guard() as g:
        x = torch.ones(1)
        dist.all_reduce(x)
    if g.reconfigured:
        continue
    if rec.history:
        if after == 0:
            open(os.path.join(OUT, f"first_{rec.me}"), "w").write(repr(time.time()))
        after += 1
    step += 1
sys.stdout.flush()
os._exit(0)
'''


def frforensics_run() -> dict[str, object]:
    root = Path(tempfile.mkdtemp(prefix="frf-launcher-bench-"))
    (root / "train.py").write_text(WORKER)
    env = dict(os.environ, BENCH_OUT=str(root), OMP_NUM_THREADS="1",
               TORCH_CPP_LOG_LEVEL="ERROR", GLOO_SOCKET_IFNAME="lo", PYTHONWARNINGS="ignore")
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "frforensics.run", "--nproc-per-node", "4",
                           "--standalone", "--monitor-interval", "0.1", str(root / "train.py")],
                          env=env, capture_output=True, text=True, timeout=300, check=False)
    killed = float((root / "killed").read_text())
    firsts = [float((root / f"first_{r}").read_text()) for r in (0, 1, 3)
              if (root / f"first_{r}").exists()]
    if len(firsts) < 3:
        print(proc.stderr[-6000:], file=sys.stderr)
    return {"launcher": "frforensics-run", "exit": proc.returncode,
            "kill_to_first_step_after_s": round(max(firsts) - killed, 3)
            if len(firsts) == 3 else None, "job_wall_s": round(time.time() - t0, 3)}


def torchrun_restart() -> dict[str, object]:
    proc = subprocess.run([sys.executable, str(HERE / "torchrun_restart.py")],
                          capture_output=True, text=True, timeout=400, check=False)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"launcher": "torchrun --max-restarts 1", "exit": out["torchrun_exit"],
            "kill_to_first_step_after_s": out["kill_to_first_step_after_restart_s"],
            "job_wall_s": out["job_wall_s"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    rows: dict[str, list[float]] = {}
    for _ in range(args.repeat):
        for fn in (frforensics_run, torchrun_restart):
            row = fn()
            print(json.dumps(row), flush=True)
            if row["kill_to_first_step_after_s"] is not None:
                rows.setdefault(str(row["launcher"]), []).append(
                    float(row["kill_to_first_step_after_s"]))  # type: ignore[arg-type]
    print(json.dumps({"summary": {k: sorted(v) for k, v in rows.items()}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
