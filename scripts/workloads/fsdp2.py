"""FSDP2 ``fully_shard``: each linear layer and the root sharded over all ranks, AdamW.

torchrun --standalone --nproc-per-node 4 scripts/workloads/fsdp2.py [--fault ...]
(``torch.distributed.fsdp.fully_shard`` on torch 2.13 and 2.15.)
"""

from __future__ import annotations

import os
import sys

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Fault, parse_args, setup, train


def main() -> None:
    args = parse_args(__doc__ or "")
    rank, world = setup()
    fault = Fault(args, rank)
    mesh = init_device_mesh("cpu", (world,))
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                          nn.Linear(32, 1))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(100 + rank)
    train(model, opt, fault, args.steps, gen, 1, rank)


if __name__ == "__main__":
    main()
