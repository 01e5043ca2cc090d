"""A PyTorch Lightning program checkpointed by rslurm through its one line, ``callbacks=[ResilientSlurm(...)]``.
Run by tests/test_lightning.py under ``rslurm launch -n 2`` (and on the Slurm test cluster).

As a user writes it: a LightningModule with dropout, a map-style dataset in a plain ``DataLoader(shuffle=True)``
(the integration replaces Lightning's DistributedSampler with a ResumableSampler), ``strategy="ddp"`` over
gloo on CPU, several epochs (44 samples, 2 ranks, batches of 4: 6 steps per epoch, the last batch partial).

Each step is logged as a JSON line per rank (global step, epoch, sample ids, loss); a run that reaches the
last step writes each rank's final model and optimizer state for a bitwise comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import warnings
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

import resilient_slurm
from resilient_slurm.checkpoint.ddp import find_ddp
from resilient_slurm.integrations.lightning import ResilientSlurm

warnings.filterwarnings("ignore", category=UserWarning)  # Lightning's advice on workers and logging
warnings.filterwarnings("ignore", category=DeprecationWarning)


class Points(Dataset[tuple[torch.Tensor, torch.Tensor, int]]):
    def __init__(self, n: int, augment: bool = False) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x[:, :2].sum(dim=1, keepdim=True)
        self.augment = augment

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        x = self.x[i]
        if self.augment:  # an augmentation drawn from Python's global RNG when the sample is read
            x = x * (1.0 + random.random() / 10)
        return x, self.y[i], i


def noisy_collate(samples: list[tuple[torch.Tensor, torch.Tensor, int]]) -> tuple[torch.Tensor, ...]:
    """A collator that draws from torch's global RNG (input noise), as masking collators do."""
    x, y, i = torch.utils.data.default_collate(samples)
    return x + 0.01 * torch.randn_like(x), y, i


class Model(L.LightningModule):
    def __init__(self, samples: int, batch_size: int, workers: int, random_data: bool = False) -> None:
        super().__init__()
        self.random_data = random_data
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                                       torch.nn.Linear(32, 1))
        self.samples, self.batch_size, self.workers = samples, batch_size, workers

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, _ = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(Points(self.samples, self.random_data), batch_size=self.batch_size, shuffle=True,
                          num_workers=self.workers, persistent_workers=False,
                          collate_fn=noisy_collate if self.random_data else None)


class StepLog(L.Callback):
    """The test's record of every step (after ResilientSlurm's own on_train_batch_end)."""

    def __init__(self, path: str, sleep: float, pause_at: int) -> None:
        self.path, self.sleep, self.pause_at = path, sleep, pause_at

    def _write(self, record: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # The Checkpointer's DDP support (the replication proof, the bucket layout re-applied on resume) finds
        # the DistributedDataParallel Lightning wrapped the module in.
        self._write({"event": "start", "step": trainer.global_step, "pid": os.getpid(),
                     "epoch": trainer.current_epoch, "module_file": resilient_slurm.__file__,
                     "ddp_found": find_ddp(pl_module) is trainer.strategy.model})

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._write({"step": trainer.global_step, "epoch": trainer.current_epoch, "batch_idx": batch_idx,
                     "batch": batch[2].tolist(), "loss": outputs["loss"].item()})
        if self.sleep:
            time.sleep(self.sleep)
        if trainer.global_step == self.pause_at:
            time.sleep(3.0)  # a stop asked for now is saved at the next step boundary: the test sends it here


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--every-steps", type=int, default=None)
    ap.add_argument("--samples", type=int, default=44)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--num-nodes", type=int, default=1)
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--pause-at", type=int, default=-1)
    ap.add_argument("--reload", action="store_true", help="reload_dataloaders_every_n_epochs=1")
    ap.add_argument("--random-data", action="store_true",
                    help="draw from the global RNGs while reading a batch (the dataset, the collator)")
    ap.add_argument("--log", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    steps = int(os.environ.get("RSLURM_REHEARSE_STEPS") or args.steps)
    rank = int(os.environ.get("RANK", "0"))
    for name in ("log", "out"):  # "{local}": the run's node-local directory (rslurm rehearse runs twice)
        setattr(args, name, getattr(args, name).replace("{local}", os.environ.get("RSLURM_LOCAL_DIR", ".")))

    L.seed_everything(0, verbose=False)
    model = Model(args.samples, args.batch_size, args.workers, args.random_data)
    plugin = ResilientSlurm(every_steps=args.every_steps)
    trainer = L.Trainer(
        accelerator="cpu", devices=args.devices, num_nodes=args.num_nodes,
        strategy="ddp" if args.devices * args.num_nodes > 1 else "auto",
        max_steps=steps, max_epochs=args.epochs, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        reload_dataloaders_every_n_epochs=1 if args.reload else 0,
        callbacks=[plugin, StepLog(args.log.replace("%r", str(rank)), args.step_sleep, args.pause_at)],  # the one line
    )
    trainer.fit(model)
    done = trainer.global_step >= steps
    if done and not plugin.should_stop:
        opt = trainer.optimizers[0]
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                    "scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict()},
                   args.out.replace("%r", str(rank)))
    with open(args.log.replace("%r", str(rank)), "a") as f:
        f.write(json.dumps({"event": "exit", "step": trainer.global_step, "stopped": plugin.should_stop}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
