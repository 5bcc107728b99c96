"""``torch.distributed.pipelining``: one stage per rank, ``Schedule1F1B``, 4 microbatches;
the last stage broadcasts the step's loss (logging) to every rank.

torchrun --standalone --nproc-per-node 4 scripts/workloads/pipeline.py [--fault ...]
Faults as in _common.py; ``slow`` sleeps in the stage's forward (every microbatch);
``stop_send`` makes the stage send no activations from ``--fault-step`` on.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import SLOW_S, Fault, finish, parse_args, setup

MICROBATCHES = 4


class Block(nn.Module):
    def __init__(self, slow: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.slow = slow

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.slow:
            time.sleep(SLOW_S)
        return torch.relu(self.lin(x))


def main() -> None:
    args = parse_args(__doc__ or "")
    rank, world = setup()
    fault = Fault(args, rank)
    block = Block(slow=fault.mine and fault.kind == "slow")
    stage = PipelineStage(block, stage_index=rank, num_stages=world, device=torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=MICROBATCHES, loss_fn=nn.functional.mse_loss)
    state = {"step": 0}
    if fault.mine and fault.kind == "stop_send":
        real_send_ops = stage.get_fwd_send_ops

        def get_fwd_send_ops(*a, **kw):  # type: ignore[no-untyped-def]
            ops = real_send_ops(*a, **kw)
            return [] if state["step"] >= fault.step else ops

        stage.get_fwd_send_ops = get_fwd_send_ops  # type: ignore[method-assign]
    opt = torch.optim.SGD(block.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(100)
    losses = []
    for step in range(args.steps):
        if fault.kind == "stop_send":
            state["step"] = step
        elif fault.kind != "slow":
            fault.start_of_step(step)
        x, y = torch.randn(16, 16, generator=gen), torch.randn(16, 16, generator=gen)
        opt.zero_grad()
        step_losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            schedule.step(target=y, losses=step_losses)
        else:
            schedule.step()
        opt.step()
        loss = torch.stack(step_losses).mean().reshape(1) if step_losses else torch.zeros(1)
        dist.broadcast(loss, src=world - 1)
        losses.append(float(loss))
    finish(rank, losses)


if __name__ == "__main__":
    main()
