"""A program written for torchrun, unchanged: no resilient_slurm, no Slurm variable.

    python torchrun_style.py OUT_DIR [NAME ...]

It reads torchrun's variables at import (a KeyError if one is missing; ``MASTER_ADDR`` and ``MASTER_PORT``
default to ``localhost:29500`` with ``os.environ.setdefault``, as many programs written for one machine
do, which is wrong on two nodes), forms a gloo group with ``init_method="env://"``, all-reduces ``rank + 1`` and writes what it saw to ``OUT_DIR/rank<RANK>.json``
(``saw``: the torchrun variables; ``slurm``: Slurm's task variables, for the test to check them against;
``extra``: the variables NAME ...; ``sum``: the all-reduce result, ``WORLD_SIZE * (WORLD_SIZE + 1) / 2``
when the group is right).
"""

from __future__ import annotations

import datetime
import json
import os
import sys

os.environ.setdefault("MASTER_ADDR", "localhost")
os.environ.setdefault("MASTER_PORT", "29500")
RANK = int(os.environ["RANK"])
LOCAL_RANK = int(os.environ["LOCAL_RANK"])
WORLD_SIZE = int(os.environ["WORLD_SIZE"])
LOCAL_WORLD_SIZE = int(os.environ["LOCAL_WORLD_SIZE"])
MASTER_ADDR = os.environ["MASTER_ADDR"]
MASTER_PORT = int(os.environ["MASTER_PORT"])

NAMES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR",
         "MASTER_PORT")
SLURM = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_NODEID", "SLURMD_NODENAME", "SLURM_JOB_ID",
         "SLURM_STEP_NODELIST")


def main() -> None:
    import torch
    import torch.distributed as dist

    out = sys.argv[1]
    dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=120))
    value = torch.tensor([float(RANK + 1)])
    dist.all_reduce(value)
    record = {
        "saw": {k: os.environ.get(k) for k in NAMES},
        "slurm": {k: os.environ.get(k) for k in SLURM},
        "extra": {k: os.environ.get(k) for k in sys.argv[2:]},
        "group": [dist.get_rank(), dist.get_world_size()],
        "sum": value.item(),
    }
    dist.destroy_process_group()
    with open(os.path.join(out, f"rank{RANK}.json"), "w") as f:
        json.dump(record, f)
    print(f"rank {RANK}/{WORLD_SIZE} (local {LOCAL_RANK}/{LOCAL_WORLD_SIZE}) via {MASTER_ADDR}:{MASTER_PORT}: "
          f"sum {value.item()}", flush=True)


if __name__ == "__main__":
    main()
