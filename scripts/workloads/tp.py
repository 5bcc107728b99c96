"""DTensor tensor parallel: ``parallelize_module`` with ColwiseParallel / RowwiseParallel
on ``init_device_mesh("cpu", (world,))``, SGD, every rank fed the same batch.

torchrun --standalone --nproc-per-node 4 scripts/workloads/tp.py [--fault ...]
"""

from __future__ import annotations

import os
import sys

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Fault, parse_args, setup, train


def main() -> None:
    args = parse_args(__doc__ or "")
    rank, world = setup()
    fault = Fault(args, rank)
    mesh = init_device_mesh("cpu", (world,))
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(100)  # tensor parallel: the same batch on every rank
    train(model, opt, fault, args.steps, gen, 16, rank)


if __name__ == "__main__":
    main()
