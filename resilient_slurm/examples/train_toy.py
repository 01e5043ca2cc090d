"""A small but complete training program: MLP with dropout, Adam, LR schedule, GradScaler, a shuffled
ResumableSampler over a DataLoader with worker processes, DDP when launched with several ranks.

It logs every step (batch indices and loss) as JSON lines and writes its final parameters and
optimizer state, so a run that was killed and resumed can be compared bit for bit with one that never
stopped. Used by the README demo and the end-to-end tests::

    python -m resilient_slurm.examples.train_toy --steps 40 --every-steps 5 --log run.%r.jsonl
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

from resilient_slurm import Checkpointer, ResumableSampler, init_distributed


class IndexedDataset(TensorDataset):
    """TensorDataset that also returns the sample index (so the batch sequence can be checked)."""

    def __getitem__(self, i: int):  # type: ignore[no-untyped-def]
        x, y = super().__getitem__(i)
        return x, y, i


def build(hidden: int, seed: int, rank: int):  # type: ignore[no-untyped-def]
    """Model, optimizer, scheduler and scaler, identically initialized on every rank."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, hidden),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.2),
        torch.nn.Linear(hidden, hidden),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.2),
        torch.nn.Linear(hidden, 1),
    )
    opt = torch.optim.Adam(model.parameters(), lr=3e-3, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.05 * s))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=7)
    torch.manual_seed(seed + 1000 + rank)  # per-rank dropout streams: RNG state must be per rank
    return model, opt, sched, scaler


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every-steps", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep per step (tests)")
    ap.add_argument("--log", default=None, help="JSON-lines step log; %%r expands to the rank")
    ap.add_argument("--out", default=None, help="final state file; %%r expands to the rank")
    ap.add_argument("--grad-sync", choices=("ddp", "allreduce"), default="ddp",
                    help="DDP, or one explicit all_reduce of the flattened gradients per step")
    ap.add_argument("--fail-at-step", type=int, default=None, help="raise an error after this step")
    args = ap.parse_args(argv)
    logging.basicConfig(level=os.environ.get("RSLURM_LOG_LEVEL", "WARNING"), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s rank" + os.environ.get("RANK", "0") + " %(name)s: %(message)s")

    rank, world, _ = init_distributed(backend="gloo")
    g = torch.Generator().manual_seed(1234)
    xs = torch.randn(args.samples, 16, generator=g)
    ys = (xs[:, :4].sum(dim=1, keepdim=True) + 0.1 * torch.randn(args.samples, 1, generator=g))
    data = IndexedDataset(xs, ys)
    sampler = ResumableSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        drop_last=True, persistent_workers=False)
    model, opt, sched, scaler = build(args.hidden, args.seed, rank)
    # DDP at any number of ranks resumes bitwise: the Checkpointer restores DDP's gradient bucket
    # layout (docs/integration.md#ddp). ``--grad-sync allreduce`` averages gradients with one explicit
    # all_reduce per step instead, for programs that do not use DDP.
    use_ddp = world > 1 and args.grad_sync == "ddp"
    net = torch.nn.parallel.DistributedDataParallel(model) if use_ddp else model
    state = {"model": model, "optimizer": opt, "scheduler": sched, "scaler": scaler, "sampler": sampler,
             "progress": {"samples_seen": 0}}

    ckpt = Checkpointer(every_steps=args.every_steps)
    step = ckpt.restore(state)
    log = open(args.log.replace("%r", str(rank)), "a") if args.log else None
    if log:
        log.write(json.dumps({"event": "start", "step": step, "pid": os.getpid()}) + "\n")
        log.flush()
    done = step >= args.steps
    while not done:
        sampler.set_epoch(sampler.epoch)
        for x, y, idx in sampler.track(loader):
            with torch.autocast("cpu", enabled=False):
                loss = torch.nn.functional.mse_loss(net(x), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            if world > 1 and not use_ddp:
                grads = [p.grad for p in model.parameters()]
                flat = torch.cat([g.reshape(-1) for g in grads])
                dist.all_reduce(flat)
                flat /= world
                for g, new in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                    g.copy_(new)
            scaler.step(opt)
            scaler.update()
            sched.step()
            step += 1
            state["progress"]["samples_seen"] += len(idx) * world
            if log:
                log.write(json.dumps({"step": step, "loss": loss.item(), "batch": idx.tolist(),
                                      "epoch": sampler.epoch}) + "\n")
                log.flush()
            if args.fail_at_step is not None and step == args.fail_at_step:
                raise RuntimeError(f"deliberate failure at step {step}")
            ckpt.step(step, state)
            if args.step_sleep:
                time.sleep(args.step_sleep)
            if ckpt.should_stop or step >= args.steps:
                done = True
                break
    ckpt.close()
    if args.out and step >= args.steps:
        torch.save({"step": step, "model": model.state_dict(), "optimizer": opt.state_dict(),
                    "scheduler": sched.state_dict(), "scaler": scaler.state_dict(),
                    "progress": state["progress"], "rng": torch.get_rng_state()},
                   args.out.replace("%r", str(rank)))
    if log:
        log.write(json.dumps({"event": "exit", "step": step, "stopped": ckpt.should_stop}) + "\n")
        log.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
