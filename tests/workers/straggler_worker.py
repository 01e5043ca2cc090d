"""One rank of a small job in which one rank is slower than the others, for tests/test_stragglers.py.

    python straggler_worker.py --steps N [--ddp] [--slow-rank R --slow-s S --slow-until K --where W]

Every rank spends ``--base-s`` per step in its own work before the collective (so that a slow rank's peers
really wait for it), then the ranks synchronize: with ``--ddp`` through a DistributedDataParallel model's
gradient all-reduce, else through an explicit all_reduce of the gradients. Rank R spends ``--slow-s`` more
per step until step K: ``--where forward`` inside its forward pass (before the collective: a slow GPU, a
slow data loader), ``--where after`` after the collective (a slow optimizer step, logging, I/O). The
Checkpointer only takes ``step()`` calls (no save is due); settings come from the environment
(RSLURM_STRAGGLER_RATIO, RSLURM_STRAGGLER_WINDOW, RSLURM_LOCAL_DIR, RSLURM_RUN_ID).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from resilient_slurm import Checkpointer, init_distributed


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--ddp", action="store_true")
    ap.add_argument("--base-s", type=float, default=0.01)
    ap.add_argument("--slow-rank", type=int, default=-1)
    ap.add_argument("--slow-s", type=float, default=0.0)
    ap.add_argument("--slow-until", type=int, default=1 << 30)
    ap.add_argument("--where", choices=("forward", "after"), default="forward")
    args = ap.parse_args()
    rank, world, _ = init_distributed(backend="gloo")
    torch.manual_seed(0)
    net = torch.nn.Linear(32, 32)
    step = 0

    def slow_here(where: str) -> None:
        if rank == args.slow_rank and args.where == where and step < args.slow_until:
            time.sleep(args.slow_s)

    net.register_forward_pre_hook(lambda _m, _a: slow_here("forward"))
    model = DDP(net) if args.ddp else net
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ckpt = Checkpointer(every_steps=10**9)
    state = {"model": model, "optim": opt}
    ckpt.restore(state)
    while step < args.steps:
        time.sleep(args.base_s)
        loss = model(torch.randn(8, 32)).square().mean()
        loss.backward()
        if not args.ddp:
            for p in net.parameters():
                dist.all_reduce(p.grad)
                p.grad.div_(world)
        slow_here("after")
        opt.step()
        opt.zero_grad()
        step += 1
        ckpt.step(step, state)
    ckpt.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
