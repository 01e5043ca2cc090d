"""One rank of a job that restores large tensors in place while another rank finds the step corrupt.

    python in_place_worker.py save    --local-dir D --out O   # steps 1 and 2, other values in each
    python in_place_worker.py restore --local-dir D --out O   # fresh values, then restore
    python in_place_worker.py pair    --local-dir D --out O   # step 1 of a replicated pair of layers

The state (``save``, ``restore``): a replicated ``Linear(1024, 1024)`` (4 MiB of weight, the same on every rank) with Adam's moments,
and a per-rank 2 MiB tensor ``mine`` (other values on each rank): each over the in-place threshold. Each rank
writes ``O/<mode>_rank<r>.pt``: ``save``: ``{1: tensors at step 1, 2: tensors at step 2}``; ``restore``: the
step restored, the tensors after it, and (a restore that raised) the error's text and notes. ``pair`` saves
:func:`pair` (the same on every rank: each item is stored once, the ranks' files sharing them by size) and
writes ``O/pair_rank<r>.pt``: its tensors.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Any

import torch
import torch.distributed as dist

from resilient_slurm import Checkpointer, init_distributed

BIG = 1024


def build(seed: int, rank: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(BIG, BIG)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(4, BIG)).pow(2).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return {"model": model, "optim": opt, "mine": torch.full((BIG, 512), float(seed * 10 + rank))}


def pair(seed: int) -> dict[str, Any]:
    """Two same-shaped layers without bias and their Adam (moments of 4 MiB each), one step trained."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(BIG, BIG, bias=False), torch.nn.Linear(BIG, BIG, bias=False))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(4, BIG)).pow(2).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return {"model": model, "optim": opt}


def tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.detach().clone() for k, v in state["model"].state_dict().items()}
    for i, st in state["optim"].state_dict()["state"].items():
        out.update({f"optim.{i}.{k}": v.clone() for k, v in st.items() if isinstance(v, torch.Tensor)})
    if "mine" in state:
        out["mine"] = state["mine"].clone()
    return out


def main() -> None:
    mode, local_dir, out_dir = sys.argv[1], sys.argv[sys.argv.index("--local-dir") + 1], sys.argv[sys.argv.index("--out") + 1]
    init_distributed(backend="gloo", timeout=120)
    rank = dist.get_rank()
    ckpt = Checkpointer(local_dir=local_dir, run_id="inplace", keep_last=5)
    out: dict[Any, Any] = {}
    if mode == "pair":
        state = pair(1)
        ckpt.save(1, state)
        ckpt.wait()
        out = tensors(state)
    elif mode == "save":
        for step in (1, 2):
            state = build(step, rank)
            ckpt.save(step, state)
            ckpt.wait()
            out[step] = tensors(state)
    else:
        state = build(99, rank)
        try:
            out["step"] = ckpt.restore(state)
        except Exception as exc:
            out["step"], out["error"] = None, f"{type(exc).__name__}: {exc}"
            out["notes"] = "\n".join(getattr(exc, "__notes__", []))
        out["tensors"] = tensors(state)
    torch.save(out, os.path.join(out_dir, f"{mode}_rank{rank}.pt"))
    ckpt.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
