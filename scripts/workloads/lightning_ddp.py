"""Lightning ``Trainer`` with ``strategy="ddp"`` (gloo, CPU): a LightningModule MLP,
SGD, the loss logged with ``self.log(..., sync_dist=True)`` (Lightning's logging
all_reduce), the fault planted through a ``Callback`` and in ``training_step``.

torchrun --standalone --nproc-per-node 4 scripts/workloads/lightning_ddp.py [--fault raise]

Lightning finds torchrun's environment (``TorchElasticEnvironment``) and starts the
process group itself; the recorder is on before that (``_common.arm``).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lightning as L
from _common import Fault, arm, parse_args, pg_timeout
from lightning.pytorch.strategies import DDPStrategy


class Net(L.LightningModule):
    def __init__(self, fault: Fault) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                                 nn.Linear(32, 1))
        self.fault = fault

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        if self.fault.now(batch_idx):
            if self.fault.kind == "raise":
                raise ValueError("bad batch: a label out of range")  # user code raises
            if self.fault.kind == "none_return":
                return None  # Lightning raises under DDP
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class PlantFault(L.Callback):
    """Hang, die, be slow or stop early at a step's start (``Fault.start_of_step``)."""

    def __init__(self, fault: Fault) -> None:
        self.fault = fault

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        if self.fault.now(batch_idx) and self.fault.kind == "stop":
            trainer.should_stop = True  # a local decision: nobody else hears of it
            return
        if self.fault.kind not in ("raise", "none_return"):
            self.fault.start_of_step(batch_idx)


def main() -> None:
    args = parse_args(__doc__ or "")
    rank = arm()
    fault = Fault(args, rank)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    gen = torch.Generator().manual_seed(0)
    n = 8 * args.steps * world
    data = TensorDataset(torch.randn(n, 16, generator=gen), torch.randn(n, 1, generator=gen))
    trainer = L.Trainer(
        accelerator="cpu", devices=world, num_nodes=1, max_steps=args.steps, max_epochs=1,
        strategy=DDPStrategy(process_group_backend="gloo", timeout=pg_timeout()),
        callbacks=[PlantFault(fault)], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    trainer.fit(Net(fault), DataLoader(data, batch_size=8))
    if rank == 0:
        print(f"done: {trainer.global_step} steps", flush=True)


if __name__ == "__main__":
    main()
