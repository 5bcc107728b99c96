"""The transformers ``Trainer`` (DDP, gloo, CPU): a tiny ``nn.Module`` that returns
``{"loss": ...}`` as Trainer models do, ``logging_steps=1`` (the Trainer gathers the
loss at every logging step), the fault planted through a ``TrainerCallback`` and in
the model's ``forward``.

torchrun --standalone --nproc-per-node 4 scripts/workloads/hf_trainer.py [--fault kill]

The Trainer starts the process group itself (through accelerate's ``PartialState``,
``ddp_backend="gloo"``, ``ddp_timeout`` from ``WL_PG_TIMEOUT_S``); the recorder is
on before that (``_common.arm``).
"""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Any

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Fault, arm, parse_args, pg_timeout
from transformers import Trainer, TrainerCallback, TrainingArguments


class Net(nn.Module):
    def __init__(self, fault: Fault) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                                 nn.Linear(32, 1))
        self.fault = fault
        self.calls = 0

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        step, self.calls = self.calls, self.calls + 1
        if self.fault.now(step) and self.fault.kind == "raise":
            raise ValueError("bad batch: a label out of range")  # user code raises
        return {"loss": nn.functional.mse_loss(self.net(x), labels)}


class Data(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int) -> None:
        gen = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 16, generator=gen), torch.randn(n, 1, generator=gen)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


class PlantFault(TrainerCallback):
    def __init__(self, fault: Fault) -> None:
        self.fault = fault

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.fault.kind not in ("raise", "stop"):
            self.fault.start_of_step(state.global_step)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.fault.now(state.global_step) and self.fault.kind == "stop":
            control.should_training_stop = True  # a local decision: nobody else hears of it


def main() -> None:
    args = parse_args(__doc__ or "")
    rank = arm()
    fault = Fault(args, rank)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    out = tempfile.mkdtemp(prefix=f"hf-trainer-{rank}-")
    targs = TrainingArguments(
        output_dir=out, per_device_train_batch_size=8, max_steps=args.steps, use_cpu=True,
        ddp_backend="gloo", ddp_timeout=int(pg_timeout().total_seconds()), report_to=[],
        logging_steps=1, save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
        remove_unused_columns=False, seed=0,
    )
    trainer = Trainer(model=Net(fault), args=targs, train_dataset=Data(8 * args.steps * world),
                      callbacks=[PlantFault(fault)])
    trainer.train()
    if rank == 0:
        print(f"done: {trainer.state.global_step} steps", flush=True)


if __name__ == "__main__":
    main()
