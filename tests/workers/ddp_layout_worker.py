"""DDP alone (no Checkpointer): does re-wrapping a module in DDP mid-run change the result, and does
re-applying the recorded bucket layout to the new wrapper undo that?

    python ddp_layout_worker.py compare OUT DDP_OPTION[,DDP_OPTION...]  # under RANK/WORLD_SIZE/MASTER_*
    python ddp_layout_worker.py predict OUT                # one process: predicted vs actual rebuild
    python ddp_layout_worker.py find OUT                   # one process: which DDP wraps a module

``compare`` trains 12 steps of SGD on per-rank data three times from the same start: with one DDP
wrapper; with a new wrapper at step 6 (what a resume does); and with a new wrapper at step 6 that gets
the first wrapper's layout (resilient_slurm.checkpoint.ddp), for each ``DDP_OPTION`` in turn (each run
seeds its model and data afresh). Rank 0 writes ``{option: {run: parameters}}`` to OUT. ``DDP_OPTION``
is ``plain``, ``static`` (static_graph), ``tiny`` (bucket_cap_mb=0.0001) or ``multi`` (a model of
several buckets after the rebuild).

``predict`` builds DDPs over a one-process group and records, before and after each of three
iterations, the layout the engine would store (predicted from the gradient-ready order until DDP has
rebuilt, then the rebuilt one), for each configuration. ``find`` records whether
resilient_slurm.checkpoint.ddp.find_ddp finds the wrapper of a module wrapped directly, through
``torch.compile``, and of a module no DDP wraps.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from resilient_slurm.checkpoint.ddp import apply_layout, current_layout, find_ddp

OPTIONS = {"plain": {}, "static": {"static_graph": True}, "tiny": {"bucket_cap_mb": 0.0001},
           "multi": {"bucket_cap_mb": 0.05}, "unused": {"find_unused_parameters": True}}


def model(option: str) -> torch.nn.Module:
    torch.manual_seed(0)
    width = 320 if option == "multi" else 32
    return torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                               torch.nn.ReLU(), torch.nn.Linear(width, 4))


def train(option: str, rewrap: bool, fix: bool) -> torch.Tensor:
    m = model(option)
    d = DDP(m, **OPTIONS[option])
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(dist.get_rank())
    for step in range(12):
        if rewrap and step == 6:
            layout, _ = current_layout(d)
            d = DDP(m, **OPTIONS[option])
            if fix and layout:
                assert apply_layout(d, layout)
        x, y = torch.randn(16, 16, generator=g), torch.randn(16, 4, generator=g)
        loss = ((d(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return torch.cat([p.detach().flatten() for p in m.parameters()])


def main() -> int:
    mode, out = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    if mode == "compare":
        dist.init_process_group("gloo")
        runs = {option: {name: train(option, rewrap, fix) for name, rewrap, fix in
                         (("once", False, False), ("rewrapped", True, False), ("restored", True, True))}
                for option in sys.argv[3].split(",")}
        if dist.get_rank() == 0:
            torch.save(runs, out)
        dist.barrier()
        dist.destroy_process_group()
        return 0
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    if mode == "find":
        plain, compiled, alone = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)
        d1, d2 = DDP(plain), DDP(torch.compile(compiled, backend="eager"))
        found = {"plain": find_ddp(plain) is d1, "compiled": find_ddp(compiled) is d2, "alone": find_ddp(alone) is None}
        with open(out, "w") as f:
            json.dump(found, f)
        dist.destroy_process_group()
        return 0
    result = {}
    for option in OPTIONS:
        d = DDP(model(option), **OPTIONS[option])
        seen = [current_layout(d)]
        for _ in range(3):
            d(torch.randn(4, 16)).sum().backward()
            seen.append(current_layout(d))
        result[option] = {"layouts": seen, "params": len(list(d.parameters()))}
    with open(out, "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
