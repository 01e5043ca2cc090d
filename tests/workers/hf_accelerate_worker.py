"""A hand-written Accelerate loop resumed by rslurm (tests/test_hf.py), run under ``rslurm launch -n 2``.

A small MLP with dropout, AdamW and a linear warm-up scheduler, all through ``accelerator.prepare`` (DDP
over gloo on CPU), with a shuffling DataLoader (Accelerate's seedable sampler) of 48 samples, 4 per rank
and step: 6 steps per epoch, 3 epochs (``$RSLURM_REHEARSE_STEPS`` steps when set). A counter registered with ``accelerator.register_for_checkpointing``
is saved too. The rslurm lines: ``AcceleratorCheckpointer(accelerator, ...)``, ``restore()``,
``batches(loader, epochs)``, ``step(...)``, ``close()``.

Every step is logged as a JSON line (step, a checksum of the batch, the loss); a run that reaches the last
step writes each rank's final weights, optimizer and scheduler state for a bitwise comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from accelerate import Accelerator, DataLoaderConfiguration

import resilient_slurm
from resilient_slurm.integrations.hf import AcceleratorCheckpointer


class Counter:
    """A user object registered for checkpointing: how many samples this rank trained on."""

    def __init__(self) -> None:
        self.samples = 0

    def state_dict(self) -> dict[str, int]:
        return {"samples": self.samples}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.samples = int(sd["samples"])


def _path(template: str, rank: int) -> str:
    """``%r``: the rank; ``%d``: the directory above ``$RSLURM_LOCAL_DIR`` (each run of ``rslurm rehearse``
    has its own), so that a rehearsal's runs keep their logs apart."""
    run_dir = os.path.dirname(os.environ.get("RSLURM_LOCAL_DIR", "").rstrip("/")) or "."
    return template.replace("%r", str(rank)).replace("%d", run_dir)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--log", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--every-steps", type=int, default=None)
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    args = ap.parse_args()

    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    rank = accelerator.process_index
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(48, 8, generator=g)
    data = torch.utils.data.TensorDataset(x, x[:, :2].sum(dim=1, keepdim=True), torch.arange(48))
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True, num_workers=args.workers)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                                torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    torch.manual_seed(100 + rank)  # per-rank dropout streams

    log = open(_path(args.log, rank), "a")
    ckpt = AcceleratorCheckpointer(accelerator, every_steps=args.every_steps)
    step = restored = ckpt.restore()
    log.write(json.dumps({"event": "start", "step": step, "pid": os.getpid(), "rslurm": resilient_slurm.__file__,
                          "world": accelerator.num_processes, "samples": counter.samples}) + "\n")
    log.flush()
    total = int(os.environ.get("RSLURM_REHEARSE_STEPS") or 0) or args.epochs * len(loader)
    for xb, yb, idx in ckpt.batches(loader, epochs=args.epochs):
        if step >= total:  # rslurm rehearse --steps: fewer steps
            break
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        accelerator.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        counter.samples += len(idx)
        step += 1
        log.write(json.dumps({"step": step, "loss": loss.item(), "batch": idx.tolist(), "epoch": ckpt.epoch,
                              "samples": counter.samples}) + "\n")
        log.flush()
        ckpt.step(step, metrics={"loss": loss.item()})
        if args.step_sleep:
            time.sleep(args.step_sleep)
    ckpt.close()
    done = not ckpt.should_stop and step == total
    if done:
        inner = accelerator.unwrap_model(model)
        torch.save({"model": inner.state_dict(), "optimizer": opt.optimizer.state_dict(),
                    "scheduler": sched.scheduler.state_dict(), "samples": counter.samples},
                   _path(args.out, rank))
    log.write(json.dumps({"event": "exit", "step": step, "done": done, "restored": restored,
                          "stopped": ckpt.should_stop}) + "\n")
    log.close()
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main())
