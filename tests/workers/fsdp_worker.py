"""One rank of a small FSDP2 (fully_shard) training job that saves or restores with Checkpointer.

    python fsdp_worker.py save    --local-dir D --run-id R --out O   # train 3 steps, save step 3
    python fsdp_worker.py restore --local-dir D --run-id R --out O   # fresh model, restore, 1 more step
    ... [--width K]   # every dim times K (shards large enough for the durable tier to compress)

Rank 0 writes to ``O``:
* ``<mode>_w<world>.pt``: the FULL (unsharded) model and optimizer state right after the save / the
  restore (gathered with ``get_{model,optimizer}_state_dict(full_state_dict=True, cpu_offload=True)``),
  the ``extra`` plain values and the step ``restore`` returned;
* ``<mode>_w<world>_next.pt``: the full model/optimizer state after one more training step.

Every layer's output dim (and several input dims) is not a multiple of 2 or 4, so shards are uneven
and, with 4 ranks, one rank holds an empty shard of the last layer.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from worker_exit import leave

from resilient_slurm import Checkpointer, init_distributed

DIMS = [13, 37, 21, 9, 5]  # 4 Linear layers; the last one has 5 rows: ranks get 2, 2, 1, 0 of it
BATCH = 8
SAVE_STEP = 3


def build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model, sharded over every rank, and an Adam optimizer without state."""
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for i, (a, b) in enumerate(zip(DIMS, DIMS[1:])):
        layers.append(torch.nn.Linear(a, b))
        if i < len(DIMS) - 2:
            layers.append(torch.nn.Tanh())
    model = torch.nn.Sequential(*layers)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, betas=(0.8, 0.95), weight_decay=0.01)
    return model, opt


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``, split by rank (the same global data whatever the world size)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(BATCH, DIMS[0], generator=g)
    y = torch.randn(BATCH, DIMS[-1], generator=g)
    rank, world = dist.get_rank(), dist.get_world_size()
    per = BATCH // world
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> float:
    x, y = batch(step)
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return float(loss.detach())


def full_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Collective: the unsharded model and optimizer state (complete on rank 0 only)."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {
        "model": get_model_state_dict(model, options=opts),
        "optim": get_optimizer_state_dict(model, opt, options=opts),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["save", "restore"])
    ap.add_argument("--local-dir", required=True)
    ap.add_argument("--run-id", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--width", type=int, default=1, help="every dim times this")
    args = ap.parse_args()
    DIMS[:] = [d * args.width for d in DIMS]
    logging.basicConfig(level=logging.INFO, format=f"[rank {os.environ.get('RANK')}] %(levelname)s %(name)s: %(message)s")

    init_distributed(backend="gloo", timeout=120)
    rank, world = dist.get_rank(), dist.get_world_size()
    # A different init per mode: a restore that does not load would be visible.
    model, opt = build(seed=1 if args.mode == "save" else 2)
    ckpt = Checkpointer(local_dir=args.local_dir, run_id=args.run_id)
    result: dict[str, Any] = {}
    if args.mode == "save":
        for s in range(SAVE_STEP):
            train_step(model, opt, s)
        extra = {"epoch": 7, "name": "fsdp-run", "lrs": [0.1, 0.01], "best": {"loss": 0.25, "at": 2}}
        state: dict[str, Any] = {"model": model, "optim": opt, "extra": extra}
        ckpt.save(SAVE_STEP, state)
        step = SAVE_STEP
    else:
        state = {"model": model, "optim": opt, "extra": {"epoch": -1}}
        assert not opt.state, "a fresh optimizer must have no state before restore"
        step = ckpt.restore(state)
    result["step"] = step
    result["extra"] = state["extra"]
    result.update(full_state(model, opt))
    if rank == 0:
        torch.save(result, os.path.join(args.out, f"{args.mode}_w{world}.pt"))
    # Training goes on from where the checkpoint left off.
    loss = train_step(model, opt, step)
    assert loss == loss, "NaN loss after restore"
    nxt = full_state(model, opt)
    if rank == 0:
        torch.save(nxt, os.path.join(args.out, f"{args.mode}_w{world}_next.pt"))
    ckpt.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    leave(0)
