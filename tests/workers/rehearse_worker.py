"""A small DDP training program (gloo, CPU) in four variants, for ``rslurm rehearse`` and the post-resume check.

    python rehearse_worker.py --mode exact|prefetch|rng|rank [--steps N] [--every-steps K] [--sleep S]
                              [--crash-after STEP]

Every rank trains a linear model on batches drawn from the global torch RNG (which rslurm captures) and
records its loss and the batch's sum at every step (``ckpt.step(..., metrics=...)``):

- ``exact``: nothing outside ``state``: a resume reproduces every value;
- ``prefetch``: nanoGPT's loop: the next batch is drawn before ``ckpt.step()``, so the checkpoint's RNG
  state is after that draw, and a resumed run trains its first step on the batch after the right one;
- ``rng``: a noise term from a ``random.Random`` of the program's own, not in ``state``: it starts over
  at a resume;
- ``rank``: rank 1 keeps a private counter (a per-rank data offset) outside ``state``; rank 0 does not:
  at the first step after a resume only rank 1 differs.

The number of steps is ``$RSLURM_REHEARSE_STEPS`` when set (``rslurm rehearse --steps``), else
``--steps``. ``--crash-after STEP`` makes every rank exit 3 right after recording that step (without a
save), but only in a run that started from step 0: the next run resumes from the last interval
checkpoint and trains the steps after it again.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

import torch
import torch.distributed as dist

from resilient_slurm import Checkpointer, init_distributed


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=("exact", "prefetch", "rng", "rank"), required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--every-steps", type=int, default=None)
    p.add_argument("--sleep", type=float, default=0.02)
    p.add_argument("--crash-after", type=int, default=None)
    a = p.parse_args()
    steps = int(os.environ.get("RSLURM_REHEARSE_STEPS") or a.steps)
    init_distributed()
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.manual_seed(1234)  # the same initial weights everywhere; the data stream is per rank below
    model = torch.nn.Linear(8, 1)
    ddp: torch.nn.Module = torch.nn.parallel.DistributedDataParallel(model) if dist.is_initialized() else model
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    torch.manual_seed(99 + rank)
    state = {"model": model, "optimizer": opt}
    private = random.Random(7 + rank)  # mode rng: a generator rslurm does not see
    counter = 0  # mode rank: a per-rank value outside state (used on rank 1 only)

    def batch() -> torch.Tensor:
        return torch.randn(4, 9)

    with Checkpointer(every_steps=a.every_steps) as ckpt:
        start = ckpt.restore(state)
        nxt = batch() if a.mode == "prefetch" else None
        for step in range(start + 1, steps + 1):
            if a.mode == "prefetch":
                assert nxt is not None
                x = nxt
            else:
                x = batch()
            if a.mode == "rng":
                x = x + private.random()
            if a.mode == "rank" and rank == 1:
                x = x + 0.01 * counter
                counter += 1
            loss = ((ddp(x[:, :8]).squeeze(1) - x[:, 8]) ** 2).mean()
            if a.mode == "prefetch":
                nxt = batch()  # the next batch, drawn before this step is saved
            opt.zero_grad()
            loss.backward()
            opt.step()
            time.sleep(a.sleep)
            ckpt.step(step, state, metrics={"loss": loss, "batch": float(x.sum())})
            if a.crash_after is not None and start == 0 and step == a.crash_after:
                ckpt.wait()
                os._exit(3)
            if ckpt.should_stop:
                break
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
