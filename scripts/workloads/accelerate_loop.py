"""A hand-written accelerate loop (gloo, CPU): ``Accelerator(cpu=True)``, ``prepare``,
``accelerator.backward``, the loss averaged with ``accelerator.reduce`` at each step,
``wait_for_everyone`` at the end; the fault planted in the loop.

torchrun --standalone --nproc-per-node 4 scripts/workloads/accelerate_loop.py [--fault stop]

accelerate starts the process group itself (``PartialState``; the timeout through
``InitProcessGroupKwargs`` from ``WL_PG_TIMEOUT_S``); the recorder is on before that
(``_common.arm``).
"""

from __future__ import annotations

import os
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Fault, arm, parse_args, pg_timeout
from accelerate import Accelerator, InitProcessGroupKwargs


def main() -> None:
    args = parse_args(__doc__ or "")
    rank = arm()
    fault = Fault(args, rank)
    acc = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo",
                                                                        timeout=pg_timeout())])
    gen = torch.Generator().manual_seed(0)
    n = 8 * args.steps * acc.num_processes
    data = TensorDataset(torch.randn(n, 16, generator=gen), torch.randn(n, 1, generator=gen))
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                          nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt, loader = acc.prepare(model, opt, DataLoader(data, batch_size=8))
    losses = []
    for step, (x, y) in enumerate(loader):
        if step >= args.steps:
            break
        if fault.now(step) and fault.kind == "stop":
            break  # a local decision: nobody else hears of it
        fault.start_of_step(step)
        loss = nn.functional.mse_loss(model(x), y)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(float(acc.reduce(loss.detach(), reduction="mean")))
    acc.wait_for_everyone()
    if rank == 0:
        print(f"done: {len(losses)} steps, last loss {losses[-1]:.4f}", flush=True)
    acc.end_training()


if __name__ == "__main__":
    main()
