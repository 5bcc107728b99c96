"""The job behind tests/data/native_frontiers/lightning_stacks (README.md there): the
Lightning DDP job of scripts/workloads/lightning_ddp.py (gloo, 4 ranks, 10 steps,
``self.log(loss, sync_dist=True)``), *without* frforensics' recorder: each rank
writes PyTorch's own dump, ``torch._C._distributed_c10d._dump_fr_trace()`` with its
defaults (stack traces included), from its excepthook, its SIGTERM handler, or after
``trainer.fit`` returns. FAULT=exit: rank 1 ``os._exit(1)``s at the start of step 3.

    FAULT=exit|none OUT=DIR python -m torch.distributed.run --standalone \
        --nproc-per-node 4 lightning_stacks.py
"""

import os
import signal
import sys
import threading
from datetime import timedelta

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

OUT = os.environ["OUT"]
RANK = int(os.environ["RANK"])
FAULT = os.environ.get("FAULT", "exit")
done = threading.Event()


def dump(why):
    if done.is_set():
        return
    done.set()
    data = torch._C._distributed_c10d._dump_fr_trace()
    with open(os.path.join(OUT, f"nccl_trace_rank_{RANK}"), "wb") as f:
        f.write(data)
    print(f"rank {RANK} dumped ({why})", flush=True)


signal.signal(signal.SIGTERM, lambda *a: (dump("sigterm"), os._exit(143)))
hook = sys.excepthook
sys.excepthook = lambda *a: (dump("exception"), hook(*a))
threading.Timer(60, lambda: os._exit(99)).start()


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                                 nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Plant(L.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if RANK == 1 and batch_idx == 3 and FAULT == "exit":
            os._exit(1)


torch.set_num_threads(1)
world = int(os.environ["WORLD_SIZE"])
gen = torch.Generator().manual_seed(0)
n = 8 * 10 * world
data = TensorDataset(torch.randn(n, 16, generator=gen), torch.randn(n, 1, generator=gen))
trainer = L.Trainer(accelerator="cpu", devices=world, num_nodes=1, max_steps=10, max_epochs=1,
                    strategy=DDPStrategy(process_group_backend="gloo",
                                         timeout=timedelta(seconds=8)),
                    callbacks=[Plant()], logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False,
                    num_sanity_val_steps=0)
trainer.fit(Net(), DataLoader(data, batch_size=8))
dump("end")
os._exit(0)
