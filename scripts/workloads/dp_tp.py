"""2-D parallelism: a ``("dp", "tp")`` mesh, tensor parallel on "tp" and FSDP2 on "dp".

torchrun --standalone --nproc-per-node 4 scripts/workloads/dp_tp.py      # 2 x 2
torchrun --standalone --nproc-per-node 8 scripts/workloads/dp_tp.py      # 2 x 4
"""

from __future__ import annotations

import os
import sys

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Fault, parse_args, setup, train


def main() -> None:
    args = parse_args(__doc__ or "")
    rank, world = setup()
    fault = Fault(args, rank)
    dp = 2
    mesh = init_device_mesh("cpu", (dp, world // dp), mesh_dim_names=("dp", "tp"))
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    # the same batch within a tp group, another one per dp rank
    gen = torch.Generator().manual_seed(100 + mesh.get_local_rank("dp"))
    train(model, opt, fault, args.steps, gen, 16, rank)


if __name__ == "__main__":
    main()
