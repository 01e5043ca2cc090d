"""A training program whose data comes from torchdata's ``StatefulDataLoader``, checkpointed as a value of
the Checkpointer's state next to the model and optimizer. Run by tests/test_stateful_dataloader.py under
``rslurm launch -n 2``.

The pattern it follows (the one docs/integration.md recommends):

* the loader shuffles through ``StatefulDistributedSampler`` and has worker processes; its position in
  the epoch (and the workers' base seed) is the loader's own state;
* it is stored under one key on every rank (``loader``): its state differs between ranks, so the
  Checkpointer stores it per rank and each rank resumes its own (both ranks share one directory here);
* the epoch is a plain value of the state, set on the sampler (and the dataset) before each epoch;
* creating the epoch's iterator draws the workers' base seed from the global torch RNG; it is made
  RNG-neutral (``fork_rng``) so that a resumed run, which creates its iterator mid-epoch, keeps the
  same dropout stream as a run that never stopped.

Each sample gets augmentation noise drawn in the worker from a generator seeded by (seed, epoch,
index), so a batch depends only on which samples were asked for. The model has dropout.

Every step is logged as a JSON line (sample ids, a checksum of the batch as received, loss); a run that
reaches the last step writes each rank's final model, optimizer and RNG state for a bitwise comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

import torch
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from resilient_slurm import Checkpointer, init_distributed, protect_dataloader

warnings.filterwarnings("ignore", message=".*set_vital.*")  # torchdata 0.11 on torch 2.13


class NoisyPoints(Dataset[tuple[torch.Tensor, torch.Tensor, int]]):
    """Fixed points plus augmentation noise that depends only on (seed, epoch, index)."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x[:, :2].sum(dim=1, keepdim=True)
        self.seed = seed
        self.epoch = 0  # set before each epoch's iterator (and its worker processes) is created

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch * 10_007 + i)
        return self.x[i] + 0.05 * torch.randn(8, generator=g), self.y[i], i


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every-steps", type=int, default=6)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--samples", type=int, default=56)
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--log", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    rank, world, _ = init_distributed(backend="gloo")
    data = NoisyPoints(args.samples, seed=5)
    sampler = StatefulDistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=11)
    loader = StatefulDataLoader(data, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                                drop_last=True)
    protect_dataloader(loader)  # workers must outlive the signal that asks their rank to save

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                                torch.nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    net = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    torch.manual_seed(100 + rank)  # per-rank dropout streams
    state = {"model": model, "optimizer": opt, "loader": loader, "progress": {"epoch": 0}}

    ckpt = Checkpointer(every_steps=args.every_steps)
    step = ckpt.restore(state)
    log = open(args.log.replace("%r", str(rank)), "a")
    log.write(json.dumps({"event": "start", "step": step, "pid": os.getpid(),
                          "epoch": state["progress"]["epoch"]}) + "\n")
    log.flush()
    while step < args.steps and not ckpt.should_stop:
        epoch = state["progress"]["epoch"]  # a plain value: restore() replaces the dict
        sampler.set_epoch(epoch)
        data.epoch = epoch
        with torch.random.fork_rng(devices=[]):  # the workers' base seed must not shift the dropout stream
            batches = iter(loader)
        for x, y, idx in batches:
            loss = torch.nn.functional.mse_loss(net(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            log.write(json.dumps({"step": step, "loss": loss.item(), "batch": idx.tolist(), "epoch": epoch,
                                  "x": x.double().sum().item()}) + "\n")
            log.flush()
            ckpt.step(step, state)
            if args.step_sleep:
                time.sleep(args.step_sleep)
            if ckpt.should_stop or step >= args.steps:
                break
        else:
            state["progress"]["epoch"] = epoch + 1
    ckpt.close()
    if step >= args.steps:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "rng": torch.get_rng_state()},
                   args.out.replace("%r", str(rank)))
    log.write(json.dumps({"event": "exit", "step": step, "stopped": ckpt.should_stop}) + "\n")
    log.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
