"""One rank of a small DDP training job that saves or restores with Checkpointer.

    python ddp_worker.py save    --local-dir D --run-id R --out O --tag T   # train 3 steps, save step 3
    python ddp_worker.py restore --local-dir D --run-id R --out O --tag T   # fresh model, restore

Every rank seeds its generators differently (``save``: rank-dependent seeds; ``restore``: one other
seed on every rank), so per-rank RNG capture is visible. Each rank writes ``O/<T>_rank<r>.pt``:

* ``step``: 3 after a save, what ``restore`` returned otherwise;
* ``model``: the module's weights after the save / right after the restore;
* ``rng_torch``, ``rng_py``, ``rng_np``: the generators' state at save time / right after the restore;
* ``untouched``: (restore) whether the weights are still the fresh initialization;
* ``extra``: the plain values in the state dict after the save / restore;
* ``payload_bytes``: bytes of one copy of the replicated tensors (weights + Adam's two moments).

The node name comes from ``RSLURM_NODE_NAME`` (set per rank by the test to emulate several nodes).
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import sys
import traceback
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from resilient_slurm import Checkpointer, init_distributed

WIDTH = 256
SAVE_STEP = 3


def build(seed: int) -> tuple[DDP, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    net = torch.nn.Sequential(
        torch.nn.Linear(WIDTH, WIDTH),
        torch.nn.ReLU(),
        torch.nn.Linear(WIDTH, WIDTH),
        torch.nn.ReLU(),
        torch.nn.Linear(WIDTH, WIDTH),
        torch.nn.ReLU(),
        torch.nn.Linear(WIDTH, 10),
    )
    model = DDP(net)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def train_step(model: DDP, opt: torch.optim.Optimizer) -> None:
    x = torch.randn(4, WIDTH)  # from this rank's own generator: ranks see different data
    y = torch.randint(0, 10, (4,))
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def weights(model: DDP) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.module.state_dict().items()}


def rng_snapshot() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    _, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    return {
        "rng_torch": torch.get_rng_state().clone(),
        "rng_py": [version, list(internal), gauss],
        "rng_np": [torch.from_numpy(np.asarray(keys, dtype=np.int64)), int(pos), int(has_gauss), float(cached)],
    }


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["save", "restore"])
    ap.add_argument("--local-dir", required=True)
    ap.add_argument("--run-id", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tag", required=True)
    args = ap.parse_args()
    logging.basicConfig(
        level=logging.INFO, format=f"[rank {os.environ.get('RANK')}] %(levelname)s %(name)s: %(message)s"
    )

    init_distributed(backend="gloo", timeout=120)
    rank = dist.get_rank()
    model, opt = build(seed=1 if args.mode == "save" else 2)
    ckpt = Checkpointer(local_dir=args.local_dir, run_id=args.run_id)
    payload = 3 * sum(p.numel() * p.element_size() for p in model.parameters())
    out: dict[str, Any] = {"payload_bytes": payload}
    if args.mode == "save":
        seed_all(1000 + 17 * rank)
        for _ in range(SAVE_STEP):
            train_step(model, opt)
        state: dict[str, Any] = {"model": model, "optim": opt, "extra": {"epoch": 1, "tag": args.tag}}
        out.update(rng_snapshot())  # the generators as the save captures them
        ckpt.save(SAVE_STEP, state)
        out.update(step=SAVE_STEP, model=weights(model), extra=state["extra"])
    else:
        seed_all(4242)
        state = {"model": model, "optim": opt, "extra": {"epoch": -1}}
        fresh = weights(model)
        step = ckpt.restore(state)
        out.update(rng_snapshot())
        now = weights(model)
        out.update(
            step=step,
            model=now,
            extra=state["extra"],
            untouched=all(torch.equal(fresh[k], now[k]) for k in fresh),
        )
        train_step(model, opt)  # training goes on (DDP collectives still line up on every rank)
    torch.save(out, os.path.join(args.out, f"{args.tag}_rank{rank}.pt"))
    ckpt.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        # A restore refused on every rank: report it and exit 1 here. Left to interpreter teardown, gloo's
        # threads sometimes abort the process instead ("terminate called without an active exception").
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
