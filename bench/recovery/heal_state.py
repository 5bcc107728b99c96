"""Kill → first step after, with the training state handed over: frforensics-run --spares 1
against torchrun --max-restarts 1 reloading a checkpoint of the same state, per state size.

    PYTHONPATH=src /root/.cache/frforensics/venv-torch-2.15.0/bin/python \\
        bench/recovery/heal_state.py [--sizes-mb 1,10,100,1000] [--repeat 1]

Both in one run, same machine, the same 4-rank gloo job whose state is one float32
tensor of the given size (plus the step), updated every step; rank 3 SIGKILLed
before step 5:

- ``frforensics-run --standalone --nproc-per-node 4 --spares 1``: the recorder on
  (deadline 3 s), op timeout 5 s, ``recovery.setup(state_dict=..., load_state_dict=...)``;
  the standby is admitted and receives the state over the re-formed group.
  Reported: kill → the last member's first step after (the standby's included),
  split into the guard's phases (verdict, re-form, hand-over: the slowest member's),
  the redone step, and the hand-over's MB/s; and whether every member ends with
  the same state.
- ``torchrun --max-restarts 1``: rank 0 wrote the state with ``torch.save`` before
  the fault (page cache warm: this favours the restart); the agent stops the
  others and starts 4 new processes, each ``torch.load``s the state, then steps.
  Reported: kill → the last rank's first step of the new generation.

Prints one JSON line per run and a table at the end (docs/recovery.md).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HEAL = r'''
import json, os, signal, time
from datetime import timedelta
import torch, torch.distributed as dist
import frforensics.recorder as recorder
from frforensics import recovery
OUT, MB = os.environ["BENCH_OUT"], int(os.environ["BENCH_MB"])
recorder.enable(os.path.join(OUT, "dumps"), timeout_s=3.0)
dist.init_process_group("gloo", timeout=timedelta(seconds=5), enable_reconfigure=True)
state = {"w": torch.zeros(MB * (1 << 20) // 4), "step": 0}
def load(sd):
    state["w"], state["step"] = sd["w"], sd["step"]
rec = recovery.setup(state_dict=lambda: state, load_state_dict=load,
                     options=recovery.Options(arrival_timeout_s=30))  # 1 GB standbys start slowly
info = {}
if rec.me in rec.spares:
    g = rec.standby()
    if not g.reconfigured:
        raise SystemExit(0)
    info = {"phases": g.phases, "recovered_at": time.time()}
after = 0
while after < 3:
    if rec.me == 3 and state["step"] == 5 and not rec.history:
        open(os.path.join(OUT, "killed"), "w").write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    t_step = time.time()
    with rec.guard() as g:
        x = torch.ones(1)
        dist.all_reduce(x)
        state["w"].add_(1.0)
        state["step"] += 1
    if g.reconfigured:
        info = {"phases": g.phases, "recovered_at": time.time()}
        continue
    if rec.history:
        if after == 0:
            info.update(first_after=time.time(), redone_step_s=time.time() - t_step)
        after += 1
info.update(me=rec.me, step=state["step"], w0=state["w"][0].item(), wsum=state["w"].sum().item())
open(os.path.join(OUT, f"member_{rec.me}.json"), "w").write(json.dumps(info))
rec.close()
dist.destroy_process_group()
'''

RESTART = r'''
import os, signal, time
from datetime import timedelta
import torch, torch.distributed as dist
gen = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
rank, OUT, MB = int(os.environ["RANK"]), os.environ["BENCH_OUT"], int(os.environ["BENCH_MB"])
ckpt = os.path.join(OUT, "ckpt.pt")
# A store per generation: with the agent's store (env://), generation 1's gloo
# connectFullMesh timed out here, dialing generation 0's ports (torchrun_restart.py).
store = dist.TCPStore("127.0.0.1", int(os.environ["BENCH_PORT"]) + gen, 4, rank == 0,
                      timeout=timedelta(seconds=120))
dist.init_process_group("gloo", store=store, rank=rank, world_size=4,
                        timeout=timedelta(seconds=60))
if gen == 0:
    state = {"w": torch.zeros(MB * (1 << 20) // 4), "step": 0}
    if rank == 0:
        torch.save(state, ckpt + ".tmp")
        os.replace(ckpt + ".tmp", ckpt)
    dist.barrier()
else:
    state = torch.load(ckpt)  # the checkpoint reload a restart needs
for step in range(8 if gen == 0 else 1):
    if gen == 0 and rank == 3 and step == 5:
        open(os.path.join(OUT, "killed"), "w").write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    x = torch.ones(1)
    dist.all_reduce(x)
    state["w"].add_(1.0)
    if gen == 1:
        open(os.path.join(OUT, f"first_{rank}"), "w").write(repr(time.time()))
dist.destroy_process_group()
'''


def _env(root: Path, mb: int, **extra: str) -> dict[str, str]:
    return dict(os.environ, BENCH_OUT=str(root), BENCH_MB=str(mb), OMP_NUM_THREADS="1",
                TORCH_CPP_LOG_LEVEL="ERROR", GLOO_SOCKET_IFNAME="lo", PYTHONWARNINGS="ignore",
                **extra)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def heal(mb: int) -> dict[str, object]:
    root = Path(tempfile.mkdtemp(prefix="frf-heal-bench-"))
    (root / "train.py").write_text(HEAL)
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "frforensics.run", "--nproc-per-node", "4",
                           "--standalone", "--monitor-interval", "0.1", "--spares", "1",
                           str(root / "train.py")], env=_env(root, mb), capture_output=True,
                          text=True, timeout=900, check=False)
    killed = float((root / "killed").read_text())
    members = [json.loads(p.read_text()) for p in sorted(root.glob("member_*.json"))]
    if len(members) < 4:
        print(proc.stderr[-6000:], file=sys.stderr)
        return {"launcher": "frforensics-run --spares 1", "state_mb": mb, "exit": proc.returncode,
                "members": len(members)}

    def slowest(phase: str) -> float:
        return round(max(float(m["phases"].get(phase, 0.0)) for m in members), 3)

    handover = slowest("handover_s")
    return {"launcher": "frforensics-run --spares 1", "state_mb": mb, "exit": proc.returncode,
            "kill_to_first_step_after_s": round(max(m["first_after"] for m in members) - killed, 3),
            "verdict_s": slowest("verdict_s"), "reform_s": slowest("reform_s"),
            "handover_s": handover, "redone_step_s": round(max(m["redone_step_s"]
                                                               for m in members), 3),
            "handover_mb_per_s": round(mb / handover, 1) if handover else None,
            "same_state": len({(m["step"], m["w0"], m["wsum"]) for m in members}) == 1,
            "members": sorted(m["me"] for m in members), "job_wall_s": round(time.time() - t0, 1)}


def restart(mb: int) -> dict[str, object]:
    root = Path(tempfile.mkdtemp(prefix="frf-restart-bench-"))
    (root / "train.py").write_text(RESTART)
    t0 = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
         "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_port()}",
         "--max-restarts", "1", str(root / "train.py")],
        env=_env(root, mb, BENCH_PORT=str(_port())), capture_output=True, text=True,
        timeout=900, check=False)
    killed = float((root / "killed").read_text())
    firsts = [float((root / f"first_{r}").read_text()) for r in range(4)
              if (root / f"first_{r}").exists()]
    if len(firsts) < 4:
        print(proc.stderr[-6000:], file=sys.stderr)
    return {"launcher": "torchrun --max-restarts 1 + checkpoint reload", "state_mb": mb,
            "exit": proc.returncode,
            "kill_to_first_step_after_s": round(max(firsts) - killed, 3)
            if len(firsts) == 4 else None, "job_wall_s": round(time.time() - t0, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--sizes-mb", default="1,10,100,1000")
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    rows = []
    for _ in range(args.repeat):
        for mb in (int(s) for s in args.sizes_mb.split(",")):
            for fn in (heal, restart):
                row = fn(mb)
                rows.append(row)
                print(json.dumps(row), flush=True)
    print("| state | launcher | kill → first step after | verdict | re-form | hand-over "
          "| redone step | MB/s | same state |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['state_mb']} MB | {r['launcher']} | {r.get('kill_to_first_step_after_s')} s "
              f"| {r.get('verdict_s', '')} | {r.get('reform_s', '')} | {r.get('handover_s', '')} "
              f"| {r.get('redone_step_s', '')} | {r.get('handover_mb_per_s', '')} "
              f"| {r.get('same_state', '')} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
