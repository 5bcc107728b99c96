"""The baseline: the same 4-rank gloo job restarted by torchrun when rank 2 dies.

    /root/.cache/frforensics/venv-torch-2.15.0/bin/python bench/recovery/torchrun_restart.py

Generation 0: rank 2 SIGKILLs itself before step 5 (the others block in all_reduce);
the elastic agent sees the dead worker, stops the others and starts 4 new
processes (--max-restarts 1), each generation with its own store; each imports torch, rendezvous, inits gloo and runs
step 0. Measured: from the kill to the last rank's first step of generation 1 (no
checkpoint load or data-loader warm-up counted, which favours the restart).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TRAIN = r'''
import os, signal, time
from datetime import timedelta
import torch, torch.distributed as dist
gen = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
rank = int(os.environ["RANK"])
OUT = os.environ["DEMO_OUT"]
# A store per generation: with the agent's store (env://), generation 1's gloo
# connectFullMesh timed out here, dialing generation 0's ports ("Connection refused").
store = dist.TCPStore("127.0.0.1", int(os.environ["DEMO_PORT"]) + gen, 4, rank == 0,
                      timeout=timedelta(seconds=60))
dist.init_process_group("gloo", store=store, rank=rank, world_size=4,
                        timeout=timedelta(seconds=30))
for step in range(10 if gen == 0 else 3):
    if gen == 0 and rank == 2 and step == 5:
        open(os.path.join(OUT, "killed"), "w").write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    x = torch.ones(1)
    dist.all_reduce(x)
    if gen == 1 and step == 0:
        open(os.path.join(OUT, f"first_{rank}"), "w").write(repr(time.time()))
dist.destroy_process_group()
'''


def main() -> int:
    root = Path(tempfile.mkdtemp(prefix="frf-torchrun-restart-"))
    (root / "train.py").write_text(TRAIN)
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    port, store_port = ports
    env = dict(os.environ, DEMO_OUT=str(root), OMP_NUM_THREADS="1", TORCH_CPP_LOG_LEVEL="ERROR",
               GLOO_SOCKET_IFNAME="lo", DEMO_PORT=str(store_port))
    t0 = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
         "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--max-restarts", "1",
         str(root / "train.py")], env=env, capture_output=True, text=True, timeout=300,
        check=False)
    killed = float((root / "killed").read_text())
    firsts = [float((root / f"first_{r}").read_text()) for r in range(4)
              if (root / f"first_{r}").exists()]
    if len(firsts) < 4:
        print(proc.stderr[:6000])
    print(json.dumps({"torchrun_exit": proc.returncode, "ranks_restarted": len(firsts),
                      "kill_to_first_step_after_restart_s": round(max(firsts) - killed, 3)
                      if len(firsts) == 4 else None,
                      "job_wall_s": round(time.time() - t0, 3)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
