"""One rank of a program that walks through every cross-rank phase of the engine, once with each phase made to
fail on rank 1 only (tests/test_phases.py).

    python phase_worker.py --root DIR --out O.%r.json [--only NAME]

For each scenario (a phase's name, and what reaches it: building a Checkpointer, a save, a restore, a tag, a
step at a sync point, a restore that fetches from the durable tier or copies a partner's replica), rank 1
arms the failpoint
``phase:<name>`` (resilient_slurm.failpoints), every rank runs the scenario in a run of its own, and records
what it raised: ``{"phase": ..., "error": "Type: message" | null, "seconds": ...}``. Between scenarios the
ranks meet (a gloo barrier): a rank that hung would hold the others there, and the test's timeout says so.
Two storage domains (ranks on emulated nodes n1 and n2, ``SLURMD_NODENAME``), a POSIX durable tier under
``DIR/durable``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from resilient_slurm import Checkpointer, failpoints, init_distributed


def state_of(rank: int, *, per_rank_key: bool = False) -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    state: dict[str, Any] = {"model": model, "optim": opt, "x": float(rank)}
    if per_rank_key:
        state[f"stage{rank}"] = torch.full((2,), float(rank))
    return state


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", default=None)
    args = ap.parse_args()
    rank, world, _ = init_distributed(backend="gloo")
    durable = os.path.join(args.root, "durable")
    nodes = [f"n{r + 1}" for r in range(world)]  # SLURMD_NODENAME of each rank (the test sets it)

    def ckpt(run: str, **kw: Any) -> Checkpointer:
        return Checkpointer(local_dir=os.path.join(args.root, "nvme", "%n"), run_id=run, **kw)

    def drain(run: str) -> None:
        """Both domains drained to the durable tier (the daemon's --once, one per node)."""
        if rank == 0:
            env = {k: v for k, v in os.environ.items() if not k.startswith(("RSLURM_", "SLURM"))}
            for node in nodes:
                subprocess.run([sys.executable, "-m", "resilient_slurm.cli", "daemon", "--once"], check=True,
                               capture_output=True, timeout=120,
                               env={**env, "RSLURM_LOCAL_DIR": os.path.join(args.root, "nvme", node),
                                    "RSLURM_NODE_NAME": node, "RSLURM_RUN_ID": run, "RSLURM_DURABLE": durable})
        dist.barrier()

    def saved(run: str, steps: tuple[int, ...] = (1,), **kw: Any) -> None:
        """A run with ``steps`` committed (no phase armed)."""
        with ckpt(run, **kw) as c:
            for s in steps:
                c.save(s, state_of(rank), blocking=True)

    def construct(run: str) -> None:
        with ckpt(run):
            pass

    def save(run: str) -> None:
        with ckpt(run) as c:
            c.save(1, state_of(rank), blocking=True)

    def save_replicated(run: str) -> None:  # "x" differs between ranks: a false claim, named by digests
        with ckpt(run, replicated=["x"]) as c:
            c.save(1, state_of(rank), blocking=True)

    def save_again(run: str) -> None:  # a run with committed steps, saved into without a restore
        with ckpt(run) as c:
            c.save(5, state_of(rank), blocking=True)

    def step(run: str) -> None:
        with ckpt(run, every_steps=1000) as c:
            for s in range(1, 3):
                c.step(s, state_of(rank))

    def restore(run: str) -> None:
        with ckpt(run) as c:
            c.restore(state_of(rank))

    def restore_per_rank(run: str) -> None:
        with ckpt(run) as c:
            c.restore(state_of(rank, per_rank_key=True))

    def tag(run: str) -> None:
        with ckpt(run) as c:
            c.tag(1, "best")

    def lose_n2(run: str) -> None:
        import shutil

        if rank == 1:
            shutil.rmtree(os.path.join(args.root, "nvme", nodes[1], run))
        dist.barrier()

    def restore_fetch(run: str) -> None:
        """Rank 1's domain lost the step, and there is no partner's replica: it comes from the durable tier."""
        lose_n2(run)
        os.environ["RSLURM_PEER_REPLICAS"] = "off"
        try:
            with ckpt(run, durable=durable) as c:
                c.restore(state_of(rank))
        finally:
            del os.environ["RSLURM_PEER_REPLICAS"]

    def restore_peer(run: str) -> None:
        """Rank 1's domain lost the step: it comes from n1's replica of it (peer replicas, the default)."""
        lose_n2(run)
        with ckpt(run) as c:
            c.restore(state_of(rank))

    def saved_drained(run: str) -> None:
        os.environ["RSLURM_PEER_REPLICAS"] = "off"
        try:
            saved(run)
        finally:
            del os.environ["RSLURM_PEER_REPLICAS"]
        drain(run)

    def per_rank_setup(run: str) -> None:
        with ckpt(run) as c:
            c.save(1, state_of(rank, per_rank_key=True), blocking=True)

    # (phase name prefix, set-up without faults, the scenario that reaches the phase)
    scenarios: list[tuple[str, Callable[[str], None] | None, Callable[[str], None]]] = [
        ("choosing the local checkpoint directories", None, construct),
        ("claiming the run", None, construct),
        ("planning the save", None, save),
        ("proving replicas", None, save),
        ("naming the replicas that differ", None, save_replicated),
        ("writing the shards", None, save),
        ("preparing the commit", None, save),
        ("committing the step", None, save),
        ("agreeing on the newest committed step", saved, save_again),
        ("agreeing on a save at this step", None, step),
        ("listing the committed steps", saved, restore),
        ("opening step", saved, restore),
        ("comparing the keys of step", per_rank_setup, restore_per_rank),
        ("verifying step", saved, restore),
        ("tagging the step", saved, tag),
        ("planning the fetch of step", saved_drained, restore_fetch),
        ("fetching step", saved_drained, restore_fetch),
        ("preparing the transfers of step", saved, restore_peer),
        ("receiving step", saved, restore_peer),
    ]
    results = []
    for i, (name, setup, scenario) in enumerate(scenarios):
        if args.only and not name.startswith(args.only):
            continue
        run = f"p{i}"
        if setup is not None:
            setup(run)
        point = failpoints.PHASE + name
        if rank == 1:
            failpoints._ACTIVE[point] = "raise"  # this rank only
        t0 = time.monotonic()
        error = None
        try:
            scenario(run)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        failpoints._ACTIVE.pop(point, None)
        results.append({"phase": name, "error": error, "seconds": time.monotonic() - t0})
        dist.barrier()  # a rank still inside the scenario would hold the others here
    with open(args.out.replace("%r", str(rank)), "w") as f:
        json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
