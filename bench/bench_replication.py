"""What proving replication adds to a save's stall: N ranks on one node, each holding the same 1 GiB state.

    .venv/bin/python bench/bench_replication.py [--ranks 2] [--size-gib 1.0] [--saves 6] [--json OUT]

Every rank builds the benchmarks' transformer-shaped state (common.py) (parameters + Adam's two moments, the
same on every rank) plus a per-rank cursor under a shared key, and saves it ``--saves`` times
(non-blocking, then ``wait()``) under three set-ups, in rotated order:

* ``ddp``: the model wrapped in DistributedDataParallel. Its parameters and their moments are replicated
  by construction: only the small items are digested every save, plus the replica check's slice of
  ``replica_check_bytes`` (default 32 MiB) per rank;
* ``ddp, replica_check=off``: the same without the check slice;
* ``no DDP``: the same tensors without a DDP wrapper (replicated by the program, as with a manual
  all_reduce): every tensor is digested at every save;
* ``no DDP, declared``: the same, declared with ``Checkpointer(replicated=["model", "optim"])``: checked
  like DDP's state.

For each, the median stall (``Checkpointer.last_stall_s``) of the steady saves, and its parts from
``last_stage_stats``: ``digest_s`` (hashing this rank's copies) and ``reduce_s`` (the one all_reduce that
compares them; it also carries the "did any plan change" flag that a single all_reduce carried before,
so counting all of it as overhead overstates the cost). The overhead ratio is
``(digest_s + reduce_s) / (stall - digest_s - reduce_s)``: the stall with the proof against the stall
without it. Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import free_port, scratch_dir  # noqa: E402

SETUPS = ("ddp", "ddp-check-off", "no-ddp", "no-ddp-declared")


def worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, os.path.dirname(HERE))
    from common import build_state

    from resilient_slurm import Checkpointer, init_distributed

    rank, world, _ = init_distributed(backend="gloo")
    torch.set_num_threads(1)
    model, opt = build_state(int(args.size_gib * 2**30), seed=0)
    results: dict[str, dict[str, list[float]]] = {s: {} for s in SETUPS}
    order = list(SETUPS)
    for rnd in range(args.rounds):
        for setup in order[rnd % len(order):] + order[: rnd % len(order)]:
            ddp = torch.nn.parallel.DistributedDataParallel(model) if setup.startswith("ddp") else None
            state = {"model": model, "optim": opt, "cursor": {"pos": rank * 1000 + rnd}}
            os.environ["RSLURM_REPLICA_CHECK"] = "off" if setup == "ddp-check-off" else "warn"
            declared = ["model", "optim"] if setup == "no-ddp-declared" else []
            with Checkpointer(local_dir=args.dir, run_id=f"{setup}-{rnd}", keep_last=2, replicated=declared) as ck:
                for i in range(args.saves):
                    state["cursor"]["pos"] += 1
                    ck.save(i + 1, state, blocking=False)
                    ck.wait()
                    if i:  # the first save plans, gathers and allocates: not the steady state
                        stats = {"stall_s": ck.last_stall_s, **ck.last_stage_stats}
                        for k, v in stats.items():
                            results[setup].setdefault(k, []).append(v)
            del ddp
            gc.collect()  # no stale wrapper may be found around the model by the next set-up
            shutil.rmtree(os.path.join(args.dir, f"{setup}-{rnd}"), ignore_errors=True)
            dist.barrier()
    every = [None] * world
    dist.all_gather_object(every, results)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(every, f)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def summarize(per_rank: list[dict[str, dict[str, list[float]]]]) -> dict[str, dict[str, float]]:
    out = {}
    for setup in SETUPS:
        med = {k: statistics.median(v for r in per_rank for v in r[setup][k]) for k in per_rank[0][setup]}
        proof = med["digest_s"] + med["reduce_s"]
        med["proof_s"] = proof
        med["overhead"] = proof / max(med["stall_s"] - proof, 1e-9)
        out[setup] = med
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--saves", type=int, default=6, help="saves per set-up and round (the first is not counted)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dir", default=None, help="local tier (default: a fresh directory under /tmp)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    base = scratch_dir(args.dir, "rslurm-bench-repl-")
    out = os.path.join(base, "results.json")
    port = free_port()
    t0 = time.time()
    procs = []
    for r in range(args.ranks):
        env = {**os.environ, "RANK": str(r), "WORLD_SIZE": str(args.ranks), "LOCAL_RANK": str(r),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", "--size-gib", str(args.size_gib),
                                       "--saves", str(args.saves), "--rounds", str(args.rounds),
                                       "--dir", os.path.join(base, "nvme"), "--out", out], env=env))
    codes = [p.wait() for p in procs]
    if any(codes):
        print(f"ranks failed: {codes}", file=sys.stderr)
        return 1
    with open(out) as f:
        summary = summarize(json.load(f))
    shutil.rmtree(base, ignore_errors=True)
    print(f"replication proofs: {args.ranks} ranks on one node, {args.size_gib:.3f} GiB state per rank, "
          f"{args.rounds} rounds x {args.saves - 1} steady saves, {time.time() - t0:.0f} s")
    print(f"{'set-up':<16}{'stall':>10}{'digest_s':>10}{'reduce_s':>10}{'copy_s':>10}{'overhead':>10}")
    for setup, m in summary.items():
        print(f"{setup:<16}{m['stall_s']:>10.4f}{m['digest_s']:>10.4f}{m['reduce_s']:>10.4f}{m['copy_s']:>10.4f}"
              f"{m['overhead']:>10.1%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ranks": args.ranks, "size_gib": args.size_gib, "summary": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
