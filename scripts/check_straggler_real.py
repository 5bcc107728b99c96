"""Real 4-rank gloo jobs for the straggler rule (docs/detectors.md, "Significance").

Each scenario runs 4 processes on CPU (gloo), recorded by the frforensics recorder
(``frforensics.recorder.enable``) and by PyTorch's own flight recorder
(``_dump_fr_trace``, saved after ours), then ``fr-analyze`` judges both:

- ``slow``: rank 2 sleeps 40 ms before its collective every step (named);
- ``spikes``: rank 2 sleeps 3 ms before 5 % of its collectives (healthy);
- ``mesh2d``: a (dp, tp) 2x2 job, rank 3 40 ms late at its dp all_gather and tp
  all_reduce every step (named, from our dumps and from PyTorch's);
- ``pipeline``: 4 stages sending activations 0 -> 1 -> 2 -> 3 each microbatch,
  stage 2 40 ms slow per microbatch; one loss all_reduce per step (named from
  our dumps: they hold the send/recv; PyTorch's gloo recorder does not).

Usage: ``python scripts/check_straggler_real.py OUT_DIR [scenario ...]``
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

WORLD = 4
STEPS = 60


def worker(kind: str, out: Path) -> None:
    rank = int(os.environ["RANK"])
    import torch
    import torch.distributed as dist

    import frforensics.recorder as recorder

    recorder.enable(out / "frdump", timeout_s=60.0, save_native=False)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rng = random.Random(rank)
    t = torch.ones(1024)
    if kind == "mesh2d":
        dp = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        tp = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        my_dp, my_tp = dp[rank % 2], tp[rank // 2]
        out_t = [torch.zeros(1024) for _ in range(2)]
    for _ in range(STEPS):
        time.sleep(0.01)  # every rank's own work per step
        if kind == "slow" and rank == 2:
            time.sleep(0.04)
        if kind == "spikes" and rank == 2 and rng.random() < 0.05:
            time.sleep(0.003)
        if kind in ("slow", "spikes", "healthy"):
            dist.all_reduce(t)
            dist.all_reduce(t)
        elif kind == "mesh2d":
            if rank == 3:
                time.sleep(0.04)
            dist.all_gather(out_t, t, group=my_dp)
            time.sleep(0.005)
            if rank == 3:
                time.sleep(0.04)
            dist.all_reduce(t, group=my_tp)
        elif kind == "pipeline":
            for _mb in range(4):
                if rank > 0:
                    dist.recv(t, src=rank - 1)
                time.sleep(0.005 + (0.04 if rank == 2 else 0.0))
                if rank < WORLD - 1:
                    dist.send(t, dst=rank + 1)
            dist.all_reduce(t)
    dist.barrier()
    recorder.dump("api", "end of run")
    data = torch._C._distributed_c10d._dump_fr_trace()
    (out / "native").mkdir(parents=True, exist_ok=True)
    (out / "native" / f"nccl_trace_rank_{rank}").write_bytes(bytes(data))
    dist.destroy_process_group()


def run(kind: str, out: Path) -> dict[str, object]:
    out.mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FRFORENSICS_", "TORCH_"))}
    env.update({"WORLD_SIZE": str(WORLD), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": "1", "TORCH_FR_BUFFER_SIZE": "2000",
                "TORCH_CPP_LOG_LEVEL": "ERROR", "GLOO_SOCKET_IFNAME": "lo"})
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", kind, str(out)],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)})
             for r in range(WORLD)]
    for p in procs:
        p.wait(timeout=240)
    result: dict[str, object] = {}
    fr = Path(sys.executable).with_name("fr-analyze")
    for sub in ("frdump", "native"):
        got = subprocess.run([str(fr), str(out / sub), "--world-size", str(WORLD), "--format", "json"],
                             capture_output=True, text=True, check=False)
        try:
            doc = json.loads(got.stdout)
            result[sub] = {"status": doc["status"], "culprits": doc["culprit_ranks"],
                           "findings": [f["message"][:300] for f in doc["findings"]],
                           "notes": [n[:300] for n in doc.get("notes", []) if "straggler" in n]}
        except (ValueError, KeyError):
            result[sub] = {"rc": got.returncode, "out": got.stdout[-500:], "err": got.stderr[-500:]}
    return result


if __name__ == "__main__":
    if sys.argv[1] == "--worker":
        worker(sys.argv[2], Path(sys.argv[3]))
        sys.exit(0)
    root = Path(sys.argv[1])
    for kind in sys.argv[2:] or ["slow", "spikes", "mesh2d", "pipeline"]:
        started = time.monotonic()
        print(kind, json.dumps(run(kind, root / kind), indent=1),
              f"({time.monotonic() - started:.0f} s)", flush=True)
