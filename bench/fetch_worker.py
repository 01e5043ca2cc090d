"""One rank of bench/bench_fetch.py: an FSDP2 MLP with Adam (gloo, CPU), saved once or restored.

    RANK=.. WORLD_SIZE=.. MASTER_ADDR=.. MASTER_PORT=.. RSLURM_NODE_NAME=.. \\
    python bench/fetch_worker.py save|restore --mib M --local-dir D --run-id R --out O

``save`` trains one step (so Adam has its moments) and saves step 1; ``restore`` builds the model afresh
with another seed and a fresh Adam and restores. Both write ``<O>/<mode>.digest`` from rank 0: a sha256 of
the full (unsharded) model and optimizer state, which must be equal. The restore's own figures (time,
bytes fetched) are in each node's event log, where the driver reads them.
"""

from __future__ import annotations

import argparse
import hashlib
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

from resilient_slurm import Checkpointer, init_distributed

LAYERS = 4


def build(mib: float, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    # parameters + two Adam moments, fp32: 12 bytes per parameter
    d = max(64, int((mib * 2**20 / 12 / LAYERS) ** 0.5))
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(d, d, bias=False) for _ in range(LAYERS)])
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def digest(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full: dict[str, Any] = {"model": get_model_state_dict(model, options=opts),
                            "optim": get_optimizer_state_dict(model, opt, options=opts)}
    h = hashlib.sha256()

    def walk(x: Any, path: str) -> None:
        if isinstance(x, torch.Tensor):
            h.update(path.encode())
            h.update(x.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        elif isinstance(x, dict):
            for k in sorted(x, key=str):
                walk(x[k], f"{path}.{k}")
        else:
            h.update(f"{path}={x!r}".encode())

    walk(full, "")
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["save", "restore"])
    ap.add_argument("--mib", type=float, required=True)
    ap.add_argument("--local-dir", required=True)
    ap.add_argument("--run-id", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    init_distributed(backend="gloo", timeout=300)
    model, opt = build(args.mib, seed=1 if args.mode == "save" else 2)
    ckpt = Checkpointer(local_dir=args.local_dir, run_id=args.run_id)  # durable tier, cadence: environment
    state = {"model": model, "optim": opt}
    if args.mode == "save":
        g = torch.Generator().manual_seed(0)
        d = model[0].weight.shape[1]
        model(torch.randn(8, d, generator=g)).square().mean().backward()
        opt.step()
        ckpt.save(1, state)
    else:
        assert ckpt.restore(state) == 1
    text = digest(model, opt)
    if dist.get_rank() == 0:
        with open(os.path.join(args.out, f"{args.mode}.digest"), "w") as f:
            f.write(text)
    ckpt.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
