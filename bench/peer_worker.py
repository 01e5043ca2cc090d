"""One rank of bench/bench_peers.py: a DDP-wrapped transformer-shaped model with Adam (gloo, CPU), trained
for ``--steps`` steps of ``--step-ms`` each and saved every ``--every`` steps through ``ckpt.step``.

    RANK=.. WORLD_SIZE=.. MASTER_ADDR=.. MASTER_PORT=.. RSLURM_NODE_NAME=.. RSLURM_PEER_REPLICAS=auto|off \\
    python bench/peer_worker.py --mib M --steps N --every K --step-ms T --local-dir D --run-id R --out O

A step is ``--step-ms`` of waiting, not of computing: the model of a GPU job, whose CPU cores are free
while the GPU trains (the save's stall and the peer replica round then compete only with each other).
Rank r writes ``<O>/steps.<r>.json``: the wall time of each step, ``ckpt.step`` included. The saves'
figures (stall, peer replica rounds) are in each node's event log, where the driver reads them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import build_state  # noqa: E402

from resilient_slurm import Checkpointer, init_distributed  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=float, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--every", type=int, required=True)
    ap.add_argument("--step-ms", type=float, required=True)
    ap.add_argument("--local-dir", required=True)
    ap.add_argument("--run-id", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    init_distributed(backend="gloo", timeout=300)
    model, opt = build_state(int(args.mib * 2**20), seed=0)
    state = {"model": DDP(model), "optim": opt}
    ckpt = Checkpointer(local_dir=args.local_dir, run_id=args.run_id, every_steps=args.every)
    times = []
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        time.sleep(args.step_ms / 1000)
        ckpt.step(step, state)
        times.append(time.perf_counter() - t0)
    ckpt.close()
    with open(os.path.join(args.out, f"steps.{dist.get_rank()}.json"), "w") as f:
        json.dump(times, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
