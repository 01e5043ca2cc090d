"""One rank of a small job that can hang on purpose, for the hang-detection tests (tests/test_hang.py).

    python hang_worker.py --steps N --out O [--hang-at S --hang-rank R] [--hang-startup --hang-rank R]
                          [--crash-at S --crash-rank R --crash-signal KILL|SEGV|OOM|MEMORYERROR|STOP]
                          [--crash-at S --crash-rank R --failpoint SPEC]
                          [--always] [--step-sleep T] [--section-at S --section-timeout T] [--pg-timeout T]

Each step: a random update of a small model (torch RNG, so a resume must restore it), one all_reduce of
the parameters across ranks, ``ckpt.step``. ``--hang-at S``: rank R sleeps for an hour after step S (its
peers then wait in the next all_reduce: a hung collective). ``--hang-startup``: rank R sleeps after
building its Checkpointer, before the restore (a hang before the first step). ``--crash-at S``: rank R
kills itself with the signal after step S (SEGV: a real segmentation fault, through ctypes), or: OOM
allocates and touches memory until the kernel's OOM killer ends it (run it in a memory-limited cgroup),
MEMORYERROR raises MemoryError, STOP stops itself with SIGSTOP (its peers' next collective then times out
after ``--pg-timeout`` seconds: a communicator error). With ``--failpoint SPEC`` (RSLURM_FAILPOINTS's syntax),
rank R arms those failpoints after step S instead (``after_shard_write=stop``: it stops while its next save is
being committed). Each fault
happens once per output directory (a marker file ``O/fault.<rank>``) unless ``--always``, so a restart
resumes past it. ``--section-at S``: every
rank spends 4 s in ``ckpt.section("eval", timeout=T)`` after step S (no steps, but inside its limit).
Writes ``O/final.<rank>.pt`` (step, parameters, RNG state) when it reaches N.
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import torch
import torch.distributed as dist

from resilient_slurm import Checkpointer, failpoints, init_distributed


def _sleep_forever(label: str) -> None:
    print(f"hanging ({label})", flush=True)
    time.sleep(3600)


def _fault_due(args: argparse.Namespace, rank: int) -> bool:
    """True once per output directory and rank (always with --always); marks it."""
    if args.always:
        return True
    marker = os.path.join(args.out, f"fault.{rank}")
    if os.path.exists(marker):
        return False
    with open(marker, "w") as f:
        f.write(str(os.getpid()))
    return True


def _crash(sig: str) -> None:
    print(f"crashing with {sig}", flush=True)
    if sig == "MEMORYERROR":
        raise MemoryError("hang_worker: out of memory on purpose")
    if sig == "STOP":
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    if sig == "OOM":
        hog = []
        while True:  # 64 MiB at a time, every page touched, until the OOM killer ends this process
            hog.append(bytearray(64 << 20))
            hog[-1][::4096] = b"\x01" * len(hog[-1][::4096])
    if sig == "SEGV":
        import ctypes

        ctypes.string_at(0)  # a real segmentation fault
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--hang-at", type=int, default=None)
    ap.add_argument("--hang-rank", type=int, default=0)
    ap.add_argument("--hang-startup", action="store_true")
    ap.add_argument("--step-sleep", type=float, default=0.02)
    ap.add_argument("--section-at", type=int, default=None)
    ap.add_argument("--section-timeout", type=float, default=None)
    ap.add_argument("--crash-at", type=int, default=None)
    ap.add_argument("--crash-rank", type=int, default=0)
    ap.add_argument("--crash-signal", choices=("KILL", "SEGV", "OOM", "MEMORYERROR", "STOP"), default="KILL")
    ap.add_argument("--pg-timeout", type=float, default=None, help="the process group's collective timeout")
    ap.add_argument("--always", action="store_true", help="fault at every run, not once")
    ap.add_argument("--failpoint", default=None, help="arm these failpoints on --crash-rank after --crash-at")
    ap.add_argument("--crash-after-commit", action="store_true",
                    help="wait for the save in flight to commit before the crash (on a busy node it may not have)")
    args = ap.parse_args()
    rank, world, _ = init_distributed(backend="gloo", timeout=args.pg_timeout)
    torch.manual_seed(1000 + rank)
    model = torch.nn.Linear(8, 8)
    state = {"model": model}
    ckpt = Checkpointer(every_steps=2)
    if args.hang_startup and rank == args.hang_rank and _fault_due(args, rank):
        _sleep_forever("startup")
    step = ckpt.restore(state)
    while step < args.steps:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.01)
                if world > 1:
                    dist.all_reduce(p)
                    p.div_(world)
        step += 1
        ckpt.step(step, state)
        if args.hang_at == step and rank == args.hang_rank and _fault_due(args, rank):
            _sleep_forever(f"after step {step}")
        if args.crash_at == step and rank == args.crash_rank and _fault_due(args, rank):
            if args.crash_after_commit:
                ckpt.wait()
            if args.failpoint:
                failpoints.arm(args.failpoint)
            else:
                _crash(args.crash_signal)
        if args.section_at == step:
            with ckpt.section("eval", timeout=args.section_timeout):
                time.sleep(4)
        time.sleep(args.step_sleep)
        if ckpt.should_stop:
            break
    ckpt.close()
    if step >= args.steps:
        torch.save({"step": step, "model": model.state_dict(), "rng": torch.get_rng_state()},
                   os.path.join(args.out, f"final.{rank}.pt"))
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
