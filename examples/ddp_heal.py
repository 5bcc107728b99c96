"""A DDP training job that heals: a lost rank's place is taken by a standby that
receives the survivors' model, optimizer and step, and the run ends where a
fault-free run ends. Runs on CPU (gloo) with torch 2.15:

    frforensics-run --standalone --nproc-per-node 4 --spares 1 examples/ddp_heal.py

Plant a fault to watch it heal (rank 3 SIGKILLed before step 6):

    EXAMPLE_FAULT=kill EXAMPLE_FAULT_RANK=3 EXAMPLE_FAULT_STEP=6 \\
        frforensics-run --standalone --nproc-per-node 4 --spares 1 examples/ddp_heal.py

A GPU that is slow, not dead (``EXAMPLE_FAULT=slow``: rank 3 takes 40 % longer per
step) is named by the recorder's live straggler rule and excluded at a step
boundary (``EXAMPLE_STRAGGLER_S`` sets the rule's window, 30 s by default).

Each rank prints ``final: {...}`` with its parameters' checksum; every rank of the
healed run prints the fault-free run's. ``EXAMPLE_OUT=DIR`` also saves each
rank's final parameters there. docs/recovery.md, "The state hand-over", says
what happens.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP

import frforensics.recorder as recorder
from frforensics import recovery

STEPS = int(os.environ.get("EXAMPLE_STEPS", "30"))
FAULT = os.environ.get("EXAMPLE_FAULT", "")  # "kill", "stop" or "slow": plant a fault
FAULT_RANK = int(os.environ.get("EXAMPLE_FAULT_RANK", "3"))
FAULT_STEP = int(os.environ.get("EXAMPLE_FAULT_STEP", "6"))
DUMPS = os.environ.get("EXAMPLE_DUMPS") or tempfile.mkdtemp(prefix="frforensics-example-")

# The recorder's verdict says whom to exclude; the group timeout is the hang budget
# (a little above the recorder's deadline: docs/recovery.md, "Getting out").
# The live straggler rule feeds the slow-GPU exclusion: a rank it names in two
# consecutive windows is proposed, and excluded at the next planned check.
recorder.enable(DUMPS, timeout_s=3.0,
                straggler_interval_s=float(os.environ.get("EXAMPLE_STRAGGLER_S", "30")),
                on_verdict=recovery.exclude_stragglers(windows=2))
dist.init_process_group("gloo", timeout=timedelta(seconds=5), enable_reconfigure=True)

torch.manual_seed(0)  # the same initial model on every process, standbys included
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
optim = torch.optim.Adam(model.parameters(), lr=1e-2)
progress = {"step": 0}


# The training state, handed to an admitted standby (torchft's shape). get_state_dict
# gives model and optimizer state by parameter name, with the optimizer's state
# initialised even before its first step, so a fresh standby's state has the same
# shape as a survivor's.
def state_dict() -> dict:
    model_sd, optim_sd = get_state_dict(model, optim)
    return {"model": model_sd, "optim": optim_sd, "step": progress["step"]}


def load_state_dict(sd: dict) -> None:
    set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    progress["step"] = sd["step"]


rec = recovery.setup(state_dict=state_dict, load_state_dict=load_state_dict,
                     options=recovery.Options(plan_check_every=5))
if rec.me in rec.spares:
    joined = rec.standby()  # returns once a recovery admitted it, with the survivors' state
    if not joined.reconfigured:
        raise SystemExit(0)  # the job finished without needing this standby
ddp = DDP(model)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic data per (step, group rank): the replacement gets the lost rank's."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, 16, generator=gen)
    return x, torch.sin(x.sum(dim=1, keepdim=True))


while progress["step"] < STEPS:
    if FAULT == "slow":  # every step 100 ms of other work; the slow GPU's 140 ms
        time.sleep(0.14 if rec.me == FAULT_RANK else 0.1)
    elif FAULT and rec.me == FAULT_RANK and progress["step"] == FAULT_STEP and not rec.history:
        os.kill(os.getpid(), signal.SIGKILL if FAULT == "kill" else signal.SIGSTOP)
    with rec.guard() as g:
        x, y = batch(progress["step"], rec.rank)
        optim.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        optim.step()
        progress["step"] += 1  # inside the guard: a failed step is redone
    if g.reconfigured:
        ddp = DDP(model)  # DDP's reducer belongs to the old group: build it again

flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
print("final: " + json.dumps({"member": rec.me, "rank": rec.rank, "world_size": rec.world_size,
                              "step": progress["step"], "sum": flat.sum().item(),
                              "l2": flat.norm().item(), "recoveries": len(rec.history)}),
      flush=True)
if os.environ.get("EXAMPLE_OUT"):
    torch.save(flat, os.path.join(os.environ["EXAMPLE_OUT"], f"params_member{rec.me}.pt"))
rec.close()
dist.destroy_process_group()
