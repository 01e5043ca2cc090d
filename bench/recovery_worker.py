"""One rank of the training program of bench/bench_recovery.py: trains, is SIGKILLed once, resumes.

    python bench/recovery_worker.py --log-dir D [--state-mib 192] [--every-steps 10] [--steps 30]
                                    [--crash-at 25] [--crash-rank 1] [--step-s 0.1]

Run under ``rslurm launch`` (``-n 2`` locally, ``-- srun -N2 -n2`` under Slurm). The first thing the
script does, before it imports anything but ``time``, is note the wall-clock time: the process's start as
Python sees it (``/proc/self/stat`` gives the kernel's creation time of the process too, to 10 ms).

Then: ``import torch`` and ``resilient_slurm``; ``init_distributed(backend="gloo")``; build the same
transformer-shaped model + Adam (moments created) as bench/common.py, ``--state-mib`` in all (params + 2
moments; the default 192 MiB is 64 MiB of parameters), identical on every rank, as data-parallel replicas
are, and declared so (``Checkpointer(replicated=["model", "optim"])``: not digested at every save);
``ckpt.restore(state)``; then steps. A step is a small matmul, an ``all_reduce`` of its result across the
ranks (so a dead peer is noticed at a collective, as in training), a nudge of one row of the big model by
that (identical) value, a sleep up to ``--step-s``, and ``ckpt.step(step, state)``: a save every
``--every-steps`` steps. After step ``--crash-at``, rank ``--crash-rank`` SIGKILLs itself, once per
``--log-dir`` (a marker file there), so the resumed run goes past it. The run ends at ``--steps``.

It appends one JSON line per event to ``D/rank<R>.jsonl`` (R: the rank from the environment the launcher
set), every one with ``t`` = ``time.time()``, the ``pid`` and Slurm's restart count: ``proc_start``
(``t`` is the first line of the script; ``created_t`` from /proc), ``imports``, ``init``, ``built``,
``restored`` (``step``; ``restore_s``), one ``step`` per step (``dt``: the whole step; ``ckpt_s``: the
``ckpt.step()`` call; ``save``: whether the cadence saved at this step), ``kill`` (just before the
SIGKILL), ``peer_error`` (a collective failed: the peer is gone; re-raised), ``done``.
"""

import time

T_START = time.time()  # before any other import: the interpreter is up and runs this script

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from typing import Any  # noqa: E402


def _created_t() -> float | None:
    """When the kernel created this process (its fork; the exec follows), to 1/CLK_TCK."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(") ", 1)[1].split()[19])
        with open("/proc/stat") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


class Log:
    def __init__(self, path: str) -> None:
        self.f = open(path, "a")
        self.restart_count = os.environ.get("SLURM_RESTART_COUNT", "0")

    def __call__(self, event: str, t: float | None = None, **fields: Any) -> None:
        rec = {"event": event, "t": time.time() if t is None else t, "pid": os.getpid(),
               "restart_count": int(self.restart_count or 0), **fields}
        self.f.write(json.dumps(rec) + "\n")
        self.f.flush()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--log-dir", required=True, help="per-rank JSON-lines logs and the crash marker")
    ap.add_argument("--state-mib", type=float, default=192.0, help="params + 2 Adam moments, MiB")
    ap.add_argument("--every-steps", type=int, default=10, help="save cadence")
    ap.add_argument("--steps", type=int, default=30, help="the run ends after this step")
    ap.add_argument("--crash-at", type=int, default=25, help="the crash rank SIGKILLs itself after this step")
    ap.add_argument("--crash-rank", type=int, default=1)
    ap.add_argument("--step-s", type=float, default=0.1, help="duration of one training step")
    args = ap.parse_args(argv)
    rank_env = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "x"))
    os.makedirs(args.log_dir, exist_ok=True)
    log = Log(os.path.join(args.log_dir, f"rank{rank_env}.jsonl"))
    log("proc_start", t=T_START, created_t=_created_t(), node=os.environ.get("SLURMD_NODENAME"))

    import torch
    import torch.distributed as dist

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import build_state, describe, state_dict_of

    from resilient_slurm import Checkpointer, init_distributed

    log("imports")
    rank, world, _ = init_distributed(backend="gloo")
    log("init", rank=rank, world=world)
    model, opt = build_state(int(args.state_mib * 2**20), seed=1)  # the same on every rank: replicas
    nudged = next(p for p in model.parameters() if p.dim() == 2)
    state: dict[str, Any] = {"model": model, "optim": opt, "progress": {"step": 0}}
    torch.manual_seed(0)
    x, w = torch.randn(64, 256), torch.randn(256, 256)
    log("built", bytes=describe(state_dict_of(model, opt))["bytes"])
    ckpt = Checkpointer(every_steps=args.every_steps, replicated=["model", "optim"])
    t_r = time.perf_counter()
    step = ckpt.restore(state)
    log("restored", step=step, restore_s=time.perf_counter() - t_r)
    marker = os.path.join(args.log_dir, "crashed")
    try:
        while step < args.steps:
            t0 = time.perf_counter()
            y = (x @ w).sum().reshape(1)  # small compute
            if world > 1:
                dist.all_reduce(y)
            with torch.no_grad():
                nudged[step % nudged.shape[0]].add_(float(y) * 1e-9)
            step += 1
            state["progress"]["step"] = step
            rest = args.step_s - (time.perf_counter() - t0)
            if rest > 0:
                time.sleep(rest)
            t_c = time.perf_counter()
            ckpt.step(step, state)
            ckpt_s = time.perf_counter() - t_c
            log("step", step=step, dt=time.perf_counter() - t0, ckpt_s=ckpt_s,
                save=step % args.every_steps == 0)
            if step == args.crash_at and rank == args.crash_rank and not os.path.exists(marker):
                with open(marker, "w") as f:
                    f.write(str(os.getpid()))
                log("kill", step=step)
                os.kill(os.getpid(), signal.SIGKILL)
            if ckpt.should_stop:
                break
    except Exception as exc:  # a collective failed: the peer died
        log("peer_error", step=step, error=f"{type(exc).__name__}: {str(exc)[:300]}")
        raise
    ckpt.close()
    log("done", step=step)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
