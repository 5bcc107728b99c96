"""Shared setup and fault planting for the real-workload corpus (scripts/workloads/).

Every workload is a small real training program run under
``torchrun --standalone --nproc-per-node N`` with gloo on CPU. This module:

* turns the recorder on the way a user would: the zero-code route
  (``FRFORENSICS_ENABLE=1`` + the package's ``torch.backends`` entry point) when
  the entry point is installed, else the same settings through
  ``frforensics.recorder.autoload`` (the entry point's own function; a checkout
  on ``PYTHONPATH`` has no entry point registered);
* initializes the default gloo group with a short timeout (``WL_PG_TIMEOUT_S``)
  so hung jobs end by themselves, and arms a hard exit (``WL_HARD_EXIT_S``) so no
  rank outlives its run even if the runner dies;
* plants one fault (``--fault``) on one rank (``--fault-rank``) at one step
  (``--fault-step``).

Faults (docs/workloads.md):

=========== ===============================================================
none        healthy run
hang        the rank sleeps forever at the start of the step (before its
            collectives)
skip        the rank skips the step's loss all_reduce (the logging collective)
op          the rank calls all_gather where the others call all_reduce
size        the rank all_reduces 2 elements where the others reduce 1
exit        the rank ends with ``os._exit(1)`` at the start of the step
kill        the rank sends itself SIGKILL at the start of the step
raise       the rank raises ``RuntimeError("bad batch")`` at the start of the step
slow        the rank sleeps 40 ms (``WL_SLOW_MS``) before every step (every
            microbatch in the pipeline)
stop_send   (pipeline) the stage stops sending activations from that step on
stop        (frameworks) the rank takes a local early-stopping decision at the
            step: its training loop ends, its peers' goes on
none_return (Lightning) the rank's ``training_step`` returns None at the step:
            Lightning's own error ("Skipping the training_step by returning None
            in distributed training is not supported")
splits      (moe) the rank dispatches with all_to_all split sizes that disagree
            with the counts it announced to its peers
=========== ===============================================================
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

FAULTS = ("none", "hang", "skip", "op", "size", "exit", "kill", "raise", "slow", "stop_send",
          "stop", "none_return", "splits")
#: the ``slow`` fault's sleep (issue 29 also asks for a pipeline stage 10 ms slower per
#: microbatch: ``WL_SLOW_MS=10``)
SLOW_S = float(os.environ.get("WL_SLOW_MS", "40")) / 1e3


def parse_args(description: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--fault", choices=FAULTS, default="none")
    p.add_argument("--fault-rank", type=int, default=1)
    p.add_argument("--fault-step", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    return p.parse_args()


def arm() -> int:
    """The hard exit armed and the recorder on (when asked), before any process group
    exists: the framework workloads call this and let the framework start gloo.
    Returns this process's rank (torchrun's ``RANK``)."""
    hard = threading.Timer(float(os.environ.get("WL_HARD_EXIT_S", "120")), lambda: os._exit(99))
    hard.daemon = True
    hard.start()
    torch.set_num_threads(1)
    if os.environ.get("FRFORENSICS_ENABLE"):
        import frforensics.recorder as recorder

        if not recorder.is_enabled():
            from frforensics.recorder.autoload import autoload

            autoload()
    return int(os.environ.get("RANK", "0"))


def pg_timeout() -> timedelta:
    """The gloo timeout the runner asks for (``WL_PG_TIMEOUT_S``): hung jobs end."""
    return timedelta(seconds=float(os.environ.get("WL_PG_TIMEOUT_S", "8")))


def setup() -> tuple[int, int]:
    """Recorder on (when asked), default gloo group up; returns (rank, world size)."""
    arm()
    dist.init_process_group(
        "gloo", timeout=timedelta(seconds=float(os.environ.get("WL_PG_TIMEOUT_S", "8")))
    )
    torch.manual_seed(0)
    return dist.get_rank(), dist.get_world_size()


class Fault:
    """The planted fault of this run, as seen from one rank."""

    def __init__(self, args: argparse.Namespace, rank: int) -> None:
        self.kind = args.fault
        self.mine = rank == args.fault_rank and args.fault != "none"
        self.step = args.fault_step

    def now(self, step: int) -> bool:
        return self.mine and step == self.step

    def start_of_step(self, step: int) -> None:
        """Hang, die or be slow here, before the step's collectives."""
        if not self.mine:
            return
        if self.kind == "slow":
            time.sleep(SLOW_S)
        if step != self.step:
            return
        if self.kind == "hang":
            time.sleep(3600)
        elif self.kind == "exit":
            os._exit(1)
        elif self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.kind == "raise":
            raise RuntimeError("bad batch")

    def log_loss(self, loss: torch.Tensor, step: int, group: dist.ProcessGroup | None = None) -> float:
        """The step's logging all_reduce of the loss (mean over the group), faults planted."""
        t = loss.detach().reshape(1).clone()
        n = dist.get_world_size(group)
        if self.now(step):
            if self.kind == "skip":
                return float(t)
            if self.kind == "op":
                out = [torch.empty_like(t) for _ in range(n)]
                dist.all_gather(out, t, group=group)
                return float(torch.stack(out).mean())
            if self.kind == "size":
                t = torch.cat([t, t])
        dist.all_reduce(t, group=group)
        return float(t[0]) / n


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, fault: Fault, steps: int,
          gen: torch.Generator, out_features: int, rank: int) -> None:
    """The training loop every collective workload shares: a random batch of 8 per
    step (``gen`` decides which ranks see the same one), MSE loss, backward, step,
    the step's logging all_reduce of the loss; the fault planted at each step's
    start; ends with :func:`finish`."""
    losses = []
    for step in range(steps):
        fault.start_of_step(step)
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, out_features, generator=gen)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(fault.log_loss(loss, step))
    finish(rank, losses)


def finish(rank: int, step_losses: list[float]) -> None:
    if rank == 0:
        print(f"done: {len(step_losses)} steps, last loss {step_losses[-1]:.4f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
