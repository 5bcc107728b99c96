"""Does DDP's reducer survive ``_reconfigure`` of its group? (docs/recovery.md, "DDP across a reconfigure")

    /root/.cache/frforensics/venv-torch-2.15.0/bin/python -m torch.distributed.run \\
        --standalone --nproc-per-node 4 bench/recovery/ddp_across_reconfigure.py same|shrink

4 gloo ranks build one ``DistributedDataParallel``, take 2 steps, then re-form the
default group (``same``: the 4 members again, uuid 2; ``shrink``: without rank 3)
and take one more step with the *same* DDP object and one with a rebuilt one.
Each member prints whether its gradient is the mean over the current members
(``old_ddp_ok``, ``rebuilt_ok``). Measured on torch 2.15.0: true for both, both modes.
"""

import json
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.nn.parallel import DistributedDataParallel as DDP

MODE = sys.argv[1]  # same | shrink
dist.init_process_group("gloo", timeout=timedelta(seconds=20), enable_reconfigure=True)
store = c10d._get_default_store()
me = dist.get_rank()


def reconf(uuid: int, members: list[int]) -> None:
    store.set(f"h{uuid}/{me}", c10d._get_reconfigure_handle(None))
    handles = [store.get(f"h{uuid}/{m}").decode() for m in members]
    c10d._reconfigure(uuid, handles, group=None, timeout=timedelta(seconds=20)).wait()


def step(ddp: DDP, rank: int) -> torch.Tensor:
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(rank))
    model.zero_grad()
    ddp(x).sum().backward()
    return model.weight.grad.clone()


reconf(1, [0, 1, 2, 3])
torch.manual_seed(0)
model = torch.nn.Linear(4, 1, bias=False)
ddp = DDP(model)
for _ in range(2):
    step(ddp, dist.get_rank())
members = [0, 1, 2, 3] if MODE == "same" else [0, 1, 2]
if me in members:
    reconf(2, members)
    rank, world = dist.get_rank(), dist.get_world_size()
    # the mean gradient over the current members
    expected = sum(torch.randn(2, 4, generator=torch.Generator().manual_seed(r)).sum(0)
                   for r in range(world)) / world
    got_old = step(ddp, rank)
    got_new = step(DDP(model), rank)
    print(json.dumps({"me": me, "mode": MODE, "world": world,
                      "old_ddp_ok": torch.allclose(got_old, expected),
                      "rebuilt_ok": torch.allclose(got_new, expected)}), flush=True)
    dist.destroy_process_group()
