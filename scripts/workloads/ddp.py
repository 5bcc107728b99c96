"""DistributedDataParallel: a 3-layer MLP, SGD, one logging all_reduce of the loss per step.

torchrun --standalone --nproc-per-node 4 scripts/workloads/ddp.py [--fault hang --fault-rank 1]
"""

from __future__ import annotations

import os
import sys

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Fault, parse_args, setup, train


def main() -> None:
    args = parse_args(__doc__ or "")
    rank, _world = setup()
    fault = Fault(args, rank)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                              nn.Linear(32, 1)), bucket_cap_mb=0.001)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(100 + rank)
    train(model, opt, fault, args.steps, gen, 1, rank)


if __name__ == "__main__":
    main()
