"""One rank of a small DDP job for the replication tests (tests/test_replication.py).

    python replica_worker.py MODE --out O [--perturb-rank R] [--map K]

Modes:
* ``topology``: create a Checkpointer and write its storage domains to ``O/topology.<rank>.json``.
* ``save``: train 2 steps under DDP (per-rank ``cursor`` under a shared key), then save step 2 and 3
  (``--first F``: steps F..F+2, saving F+1 and F+2: a later run of the same job numbers on).
  With ``--perturb-rank R`` rank R adds 1e-3 to one parameter of the DDP model before saving step 3:
  a desynchronised replica. Writes ``O/save.<rank>.pt`` (the state as saved at step 3, and whether
  the save of step 3 failed with which error). ``--declare KEY``: ``Checkpointer(replicated=[KEY])``.
* ``restore``: build the same objects, restore (``--map K``: ``rank_map=lambda r: r % K``) and write
  ``O/restore.<rank>.pt`` (the step, the restored state) or the error it raised.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from resilient_slurm import Checkpointer, init_distributed


def build() -> tuple[torch.nn.Module, Any, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    wrapped = DDP(net) if dist.is_initialized() else net
    return net, wrapped, torch.optim.SGD(net.parameters(), lr=0.1)


def snapshot(state: dict[str, Any]) -> dict[str, Any]:
    return {"model": {k: v.clone() for k, v in state["model"].state_dict().items()},
            "cursor": state["cursor"], "rng": torch.get_rng_state()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["topology", "save", "restore"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--perturb-rank", type=int, default=None)
    ap.add_argument("--map", type=int, default=None)
    ap.add_argument("--declare", action="append", default=[], help="Checkpointer(replicated=[...])")
    ap.add_argument("--first", type=int, default=1, help="save: the first step's number (a later run of the job)")
    args = ap.parse_args()
    rank, world, _ = init_distributed(backend="gloo")
    net, wrapped, opt = build()
    state: dict[str, Any] = {"model": net, "optim": opt, "cursor": {"pos": 10 * rank + 1}}
    torch.manual_seed(100 + rank)
    out: dict[str, Any] = {}
    with Checkpointer(replicated=args.declare) as ckpt:
        if args.mode == "topology":
            t = ckpt.topology
            with open(os.path.join(args.out, f"topology.{rank}.json"), "w") as f:
                json.dump({"domain": t.domain, "domains": list(t.domain_of_rank), "leader": t.is_leader,
                           "root": t.root}, f)
        elif args.mode == "save":
            for step in range(args.first, args.first + 3):
                wrapped(torch.randn(4, 8)).sum().backward()
                opt.step()
                opt.zero_grad()
                state["cursor"]["pos"] += rank + 1
                if step == args.first + 2 and args.perturb_rank == rank:
                    with torch.no_grad():
                        net[0].weight[0, 0] += 1e-3
                if step >= args.first + 1:
                    try:
                        ckpt.save(step, state)
                        out["error"] = None
                    except Exception as exc:
                        out["error"] = f"{type(exc).__name__}: {exc}"
            out.update(snapshot(state))
            torch.save(out, os.path.join(args.out, f"save.{rank}.pt"))
        else:
            rank_map = (lambda r: r % args.map) if args.map else None
            try:
                out["step"] = ckpt.restore(state, rank_map=rank_map)
                out.update(snapshot(state))
                out["error"] = None
            except Exception as exc:
                out["error"] = f"{type(exc).__name__}: {exc}"
            torch.save(out, os.path.join(args.out, f"restore.{rank}.pt"))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
