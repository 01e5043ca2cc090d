"""One rank of a model-parallel training job: pipeline (PP), tensor (TP) and data (DP, FSDP2) parallelism.

    python parallel_worker.py --pp P --tp T --dp D [--fsdp] --keys rank|shared|titan [--split 1,3]
                              [--steps N] [--every K] [--log L] [--out O] [--sleep S] [--rank-map 0:0,1:2]

The world is ``P * D * T`` ranks on a (pp, dp, tp) device mesh. The model is ``BLOCKS`` residual MLP blocks
(``w1``: Linear(DIM, 2*DIM), tanh, ``w2``: Linear(2*DIM, DIM)); pipeline stage ``p`` holds the blocks that
``--split`` gives it (default: equal parts), under their global names (``layers.<i>``). Inside a stage,
``w1`` is ColwiseParallel and ``w2`` RowwiseParallel on the ``tp`` mesh dimension when ``T > 1``, and the
blocks are sharded with FSDP2 (``fully_shard``) on the ``dp`` dimension with ``--fsdp`` (else the DP ranks
of a stage keep replicas, their gradients averaged by an all_reduce). Activations go forward to the next
stage and gradients back with send/recv (one micro-batch per step): a real pipeline, so a stage restored
with another stage's values changes every later loss.

How the state is keyed (``--keys``):

* ``rank``: per-stage keys, ``stage<p>`` (the stage module) and ``opt<p>`` (its Adam, keyed by index);
* ``shared``: one key for every stage, ``model`` (each stage a different submodule) and ``optim`` (Adam,
  ``Optimizer.state_dict()``: keyed by parameter index, so each stage's state sits under the same indices);
* ``titan``: torchtitan's wrappers: ``model`` and ``optim`` are objects whose ``state_dict`` /
  ``load_state_dict`` call ``get_model_state_dict`` / ``set_model_state_dict`` and
  ``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` (flattened, keyed by parameter name).

Also in the state: ``best`` (a tensor on the last stage, a float elsewhere: nanoGPT's ``best_val_loss``)
and the RNG streams (captured per rank; the first stage draws the batches from it, seeded by DP index).
Every rank logs ``{"step", "loss"}`` per step (the last stage: the loss; the others: a digest of what they
sent) to ``L`` (``%r``: the rank) and writes its final state by global name to ``O`` (``%r``): full
parameters and Adam moments (DTensors gathered), so runs at different layouts compare. The number of steps
is ``$RSLURM_REHEARSE_STEPS`` when set (``rslurm rehearse --steps``); a run stopped for an emergency
checkpoint (``ckpt.should_stop``) writes nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from worker_exit import leave

from resilient_slurm import Checkpointer, init_distributed

BLOCKS = 4
DIM = 8
BATCH = 4


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = torch.nn.Linear(DIM, 2 * DIM)
        self.w2 = torch.nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(torch.tanh(self.w1(x)))


class Stage(torch.nn.Module):
    """The blocks of one pipeline stage, under their global names."""

    def __init__(self, blocks: list[int]) -> None:
        super().__init__()
        torch.manual_seed(1234)  # every block initialized as in the whole model, whatever the split
        every = [Block() for _ in range(BLOCKS)]
        self.layers = torch.nn.ModuleDict({str(i): every[i] for i in blocks})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.layers.values():
            x = b(x)
        return x


class ModelWrapper:
    """torchtitan's ModelWrapper: the model's state dict by parameter name (DCP's state_dict API)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.model)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(self.model, sd)


class OptimizersContainer:
    """torchtitan's OptimizersContainer: the optimizer's state flattened and keyed by parameter name."""

    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        self.model, self.opt = model, opt
        self.options = StateDictOptions(flatten_optimizer_state_dict=True)

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.model, self.opt, options=self.options)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self.model, self.opt, sd, options=self.options)


def split_blocks(pp: int, split: str | None) -> list[list[int]]:
    if split and "/" in split:  # the blocks of each stage: "0,2/1,3" (interleaved stages)
        stages = [[int(b) for b in part.split(",")] for part in split.split("/")]
        assert len(stages) == pp and sorted(sum(stages, [])) == list(range(BLOCKS)), split
        return stages
    sizes = [int(s) for s in split.split(",")] if split else [BLOCKS // pp] * pp
    assert len(sizes) == pp and sum(sizes) == BLOCKS, f"--split {split} must give {pp} stages {BLOCKS} blocks"
    out, at = [], 0
    for n in sizes:
        out.append(list(range(at, at + n)))
        at += n
    return out


def full(t: Any) -> Any:
    """A tensor as a plain full tensor (a DTensor gathered)."""
    if hasattr(t, "full_tensor"):
        return t.full_tensor().detach().clone()
    return t.detach().clone() if isinstance(t, torch.Tensor) else t


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--fsdp", action="store_true")
    ap.add_argument("--keys", choices=("rank", "shared", "titan"), default="shared")
    ap.add_argument("--split", default=None, help="blocks per stage (1,3), or each stage's blocks (0,2/1,3)")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--every", type=int, default=3)
    ap.add_argument("--log", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--sleep", type=float, default=0.0)
    ap.add_argument("--rank-map", default=None, help="new:saved,... (the saved rank whose per-rank state each loads)")
    args = ap.parse_args()
    steps = int(os.environ.get("RSLURM_REHEARSE_STEPS") or args.steps)  # rslurm rehearse --steps
    rank, world, _ = init_distributed(backend="gloo")
    if not dist.is_initialized():  # one rank: a device mesh still needs a process group
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.set_num_threads(1)
    pp, tp, dp = args.pp, args.tp, args.dp
    assert pp * tp * dp == world, f"pp {pp} x dp {dp} x tp {tp} != world {world}"
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    p, d, t = (mesh.get_local_rank(n) for n in ("pp", "dp", "tp"))
    coords = mesh.mesh
    prev = int(coords[p - 1, d, t]) if p > 0 else None
    nxt = int(coords[p + 1, d, t]) if p < pp - 1 else None

    model = Stage(split_blocks(pp, args.split)[p])
    if tp > 1:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        for block in model.layers.values():
            parallelize_module(block, mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    if args.fsdp:
        from torch.distributed.fsdp import fully_shard

        for block in model.layers.values():
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    state: dict[str, Any] = {}
    if args.keys == "rank":
        state[f"stage{p}"], state[f"opt{p}"] = model, opt
    elif args.keys == "shared":
        state["model"], state["optim"] = model, opt
    else:
        state["model"], state["optim"] = ModelWrapper(model), OptimizersContainer(model, opt)
    last = p == pp - 1
    state["best"] = torch.tensor(1e9) if last else 1e9
    torch.manual_seed(100 + d)  # the batches: drawn by the first stage, one stream per DP index

    with Checkpointer(every_steps=args.every, keep_last=2) as ckpt:
        mapping = dict(tuple(map(int, kv.split(":"))) for kv in args.rank_map.split(",")) if args.rank_map else None
        start = ckpt.restore(state, rank_map=mapping.__getitem__ if mapping else None)
        logf = open(args.log.replace("%r", str(rank)) if args.log else os.devnull, "a")
        logf.write(json.dumps({"event": "start", "step": start}) + "\n")
        logf.flush()
        for step in range(start, steps):
            if prev is None:
                x = torch.randn(BATCH, DIM)
            else:
                x = torch.empty(BATCH, DIM)
                dist.recv(x, prev)
                x.requires_grad_(True)
            y = model(x)
            if last:
                loss = (y ** 2).mean()
                loss.backward()
                value = float(loss)
                if value < float(state["best"]):
                    state["best"].fill_(value)
            else:
                dist.send(y.detach(), nxt)
                grad = torch.empty_like(y)
                dist.recv(grad, nxt)
                y.backward(grad)
                value = float(y.detach().double().sum())
            if prev is not None:
                assert x.grad is not None
                dist.send(x.grad, prev)
            if dp > 1 and not args.fsdp:
                for prm in model.parameters():
                    assert prm.grad is not None
                    dist.all_reduce(prm.grad, group=mesh["dp"].get_group())
                    prm.grad.div_(dp)
            opt.step()
            opt.zero_grad()
            logf.write(json.dumps({"step": step + 1, "loss": value}) + "\n")
            logf.flush()
            if args.sleep:
                time.sleep(args.sleep)
            ckpt.step(step + 1, state, metrics={"loss": value})
            if ckpt.should_stop:
                break
        logf.close()
    if ckpt.should_stop:  # stopped for an emergency checkpoint: the launcher requeues, nothing to write
        dist.destroy_process_group()
        return 0
    names = {id(prm): n for n, prm in model.named_parameters()}
    out: dict[str, Any] = {"rng": torch.get_rng_state(), "best": full(state["best"])}
    out["params"] = {n: full(prm) for n, prm in model.named_parameters()}
    out["adam"] = {names[id(prm)]: {k: full(v) for k, v in s.items()} for prm, s in opt.state.items()}
    if args.out:
        torch.save(out, args.out.replace("%r", str(rank)))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    leave(main())
