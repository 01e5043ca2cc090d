"""One rank of a training job whose state mixes every kind the topology matrix checks.

    python topology_worker.py --steps N --every K --kinds ddp,obj,plain,repl,fsdp --log L --out O [--sleep S]

State kinds (``--kinds``), each one used by the training so a wrong restore changes the result:

* ``ddp``: an MLP with dropout under DistributedDataParallel, and Adam (the unwrapped module in the state);
  with 3 or more ranks its gradient all-reduce rounds differently unless the bucket layout is restored;
* ``obj``: a per-rank object under the shared key ``data``: a cursor and a generator of its own, seeded
  by rank, that adds noise to every batch;
* ``plain``: per-rank plain values under shared keys: ``pos`` (an int that indexes a table) and ``buf``
  (a tensor: the batch prefetched for the next step, as a data pipeline would);
* ``repl``: a replicated plain value under ``progress`` (the same on every rank), that scales the loss;
* ``fsdp``: a second model sharded with FSDP2 (fully_shard, DTensor parameters) and its Adam (2+ ranks).

Batches also draw from the global torch RNG, seeded by rank (captured per rank by the Checkpointer).
Every rank logs ``{"step", "loss"}`` per step to ``L`` (``%r``: the rank) and writes its final state to
``O`` (``%r``): parameters, optimizer state, local FSDP shards, the per-rank values and the RNG state.
Nodes are emulated with SLURMD_NODENAME per rank; the directory layout comes from RSLURM_LOCAL_DIR.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from worker_exit import leave

from resilient_slurm import Checkpointer, init_distributed

TABLE = torch.linspace(-1.0, 1.0, 97 * 16).reshape(97, 16)


class Cursor:
    """A per-rank data source: where it is and a generator of its own."""

    def __init__(self, rank: int) -> None:
        self.pos = 0
        self.gen = torch.Generator().manual_seed(7000 + rank)

    def noise(self) -> torch.Tensor:
        self.pos += 1
        return 0.1 * torch.randn(8, 16, generator=self.gen)

    def state_dict(self) -> dict[str, Any]:
        return {"pos": self.pos, "gen": self.gen.get_state()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.pos = sd["pos"]
        self.gen.set_state(sd["gen"])


def fsdp_model(world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(11)
    model = torch.nn.Sequential(torch.nn.Linear(16, 23), torch.nn.Tanh(), torch.nn.Linear(23, 5))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def local(t: Any) -> Any:
    return t.to_local().clone() if hasattr(t, "to_local") else t.clone() if isinstance(t, torch.Tensor) else t


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--every", type=int, default=3)
    ap.add_argument("--kinds", default="ddp")
    ap.add_argument("--log", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--sleep", type=float, default=0.0)
    args = ap.parse_args()
    kinds = set(args.kinds.split(","))
    rank, world, _ = init_distributed(backend="gloo")
    torch.set_num_threads(1)

    state: dict[str, Any] = {}
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                              torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    ddp = DDP(net) if world > 1 else net
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    if "ddp" in kinds:
        state.update(model=net, optim=opt)
    if "obj" in kinds:
        state["data"] = Cursor(rank)
    if "plain" in kinds:
        state["pos"] = 3 * rank
        state["buf"] = torch.full((8, 16), float(rank))
    if "repl" in kinds:
        state["progress"] = {"tokens": 0, "scale": 1.0}
    if "fsdp" in kinds:
        fmodel, fopt = fsdp_model(world)
        state.update(fsdp=fmodel, fsdp_optim=fopt)
    torch.manual_seed(100 + rank)  # per-rank dropout and data streams

    with Checkpointer(every_steps=args.every, keep_last=2) as ckpt:
        start = ckpt.restore(state)
        logf = open(args.log.replace("%r", str(rank)), "a")
        logf.write(json.dumps({"event": "start", "step": start}) + "\n")
        logf.flush()
        for step in range(start, args.steps):
            x = torch.randn(8, 16)
            if "obj" in kinds:
                x = x + state["data"].noise()
            if "plain" in kinds:
                x = x + TABLE[state["pos"] % len(TABLE)]
                state["pos"] += rank + 1
                x, nxt = state["buf"].clone(), x
                state["buf"].copy_(nxt)  # prefetched: this batch is used at the next step
            scale = 1.0
            if "repl" in kinds:
                state["progress"]["tokens"] += 8 * world
                state["progress"]["scale"] = 1.0 / (1.0 + state["progress"]["tokens"] / 1000.0)
                scale = state["progress"]["scale"]
            loss = x.sum() * scale
            if "ddp" in kinds:
                loss = (ddp(x) ** 2).mean() * scale
                opt.zero_grad()
                loss.backward()
                opt.step()
            if "fsdp" in kinds:
                floss = (state["fsdp"](x) ** 2).mean() * scale
                state["fsdp_optim"].zero_grad()
                floss.backward()
                state["fsdp_optim"].step()
            logf.write(json.dumps({"step": step + 1, "loss": float(loss)}) + "\n")
            logf.flush()
            if args.sleep:
                import time

                time.sleep(args.sleep)
            ckpt.step(step + 1, state)
        logf.close()
    out: dict[str, Any] = {"rng": torch.get_rng_state()}
    if "ddp" in kinds:
        out["model"] = {k: v.clone() for k, v in net.state_dict().items()}
        out["optim"] = {i: {k: local(v) for k, v in s.items()} for i, s in enumerate(opt.state.values())}
    if "obj" in kinds:
        out["data"] = state["data"].state_dict()
    if "plain" in kinds:
        out["pos"], out["buf"] = state["pos"], state["buf"].clone()
    if "repl" in kinds:
        out["progress"] = dict(state["progress"])
    if "fsdp" in kinds:
        out["fsdp"] = {k: local(v) for k, v in state["fsdp"].state_dict().items()}
        out["fsdp_optim"] = {i: {k: local(v) for k, v in s.items()}
                             for i, s in enumerate(state["fsdp_optim"].state.values())}
    torch.save(out, args.out.replace("%r", str(rank)))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    leave(main())
