"""An HSDP training job that heals: FSDP2 (``fully_shard``) over a 2 x 2 device mesh,
replicate x shard. A lost rank's place is taken by a standby that joins the mesh's
groups in its place and receives its *shard* -- parameters and Adam state -- from
the replica peer that holds the same shard; the run ends where a fault-free run
ends. Runs on CPU (gloo) with torch 2.15:

    frforensics-run --standalone --nproc-per-node 4 --spares 1 examples/hsdp_heal.py

Plant a fault to watch it heal (rank 3 SIGKILLed before step 6; its shard lives on
rank 1 too):

    EXAMPLE_FAULT=kill EXAMPLE_FAULT_RANK=3 EXAMPLE_FAULT_STEP=6 \\
        frforensics-run --standalone --nproc-per-node 4 --spares 1 examples/hsdp_heal.py

What differs from a DDP job (examples/ddp_heal.py): the mesh is made with
``rec.device_mesh`` (recovery re-forms its groups around the standby), and the
model is built on it lazily -- a standby has no mesh until it is admitted, so it
builds the model when the hand-over first asks for its state. A fully sharded
model (a 1-D mesh: no replica of any shard) that loses a rank is refused with one
line, and so is an HSDP job with no standby free: restore those from a checkpoint.

Each rank prints ``final: {...}`` with the full parameters' checksum (gathered
across the mesh); every rank of the healed run prints the fault-free run's.
``EXAMPLE_OUT=DIR`` also saves each rank's final full parameters there.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

import frforensics.recorder as recorder
from frforensics import recovery

STEPS = int(os.environ.get("EXAMPLE_STEPS", "20"))
FAULT = os.environ.get("EXAMPLE_FAULT", "")  # "kill" or "stop": plant a fault
FAULT_RANK = int(os.environ.get("EXAMPLE_FAULT_RANK", "3"))
FAULT_STEP = int(os.environ.get("EXAMPLE_FAULT_STEP", "6"))
DUMPS = os.environ.get("EXAMPLE_DUMPS") or tempfile.mkdtemp(prefix="frforensics-example-")

recorder.enable(DUMPS, timeout_s=3.0)
dist.init_process_group("gloo", timeout=timedelta(seconds=5), enable_reconfigure=True)

job: dict[str, Any] = {"model": None, "optim": None, "step": 0}


def build() -> None:
    """The model on the 2 x 2 mesh (members at start; an admitted standby when first asked)."""
    mesh = rec.device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)  # the same initial model everywhere
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    fully_shard(model, mesh=mesh)
    job["model"], job["optim"] = model, torch.optim.Adam(model.parameters(), lr=1e-2)


# The training state as DTensors: each rank's shard travels, from a replica peer.
def state_dict() -> dict:
    if job["model"] is None:
        build()
    model_sd, optim_sd = get_state_dict(job["model"], job["optim"])
    return {"model": model_sd, "optim": optim_sd, "step": job["step"]}


def load_state_dict(sd: dict) -> None:
    if job["model"] is None:
        build()
    set_state_dict(job["model"], job["optim"], model_state_dict=sd["model"],
                   optim_state_dict=sd["optim"])
    job["step"] = sd["step"]


# A step that failed mid-flight leaves FSDP2's per-iteration state undefined: the
# guard calls reset_step before the recovery (FSDPModule.reset_iter_state, torch 2.15).
rec = recovery.setup(state_dict=state_dict, load_state_dict=load_state_dict,
                     reset_step=lambda: job["model"].reset_iter_state())
if rec.me in rec.spares:
    joined = rec.standby()  # returns once a recovery admitted it, with its shard loaded
    if not joined.reconfigured:
        raise SystemExit(0)  # the job finished without needing this standby
else:
    build()


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic data per (step, group rank): the replacement gets the lost rank's."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, 16, generator=gen)
    return x, torch.sin(x.sum(dim=1, keepdim=True))


while job["step"] < STEPS:
    if FAULT and rec.me == FAULT_RANK and job["step"] == FAULT_STEP and not rec.history:
        os.kill(os.getpid(), signal.SIGKILL if FAULT == "kill" else signal.SIGSTOP)
    with rec.guard():
        x, y = batch(job["step"], rec.rank)
        job["optim"].zero_grad()
        torch.nn.functional.mse_loss(job["model"](x), y).backward()
        job["optim"].step()
        job["step"] += 1  # inside the guard: a failed step is redone

full = [p.full_tensor().detach().reshape(-1) for p in job["model"].parameters()]
flat = torch.cat(full)
print("final: " + json.dumps({"member": rec.me, "rank": rec.rank, "world_size": rec.world_size,
                              "step": job["step"], "sum": flat.sum().item(),
                              "l2": flat.norm().item(), "recoveries": len(rec.history)}),
      flush=True)
if os.environ.get("EXAMPLE_OUT"):
    torch.save(flat, os.path.join(os.environ["EXAMPLE_OUT"], f"params_member{rec.me}.pt"))
rec.close()
dist.destroy_process_group()
