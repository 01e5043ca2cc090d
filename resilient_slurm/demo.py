"""The README demo: train, get SIGKILLed mid-run, resume, and finish exactly like a run never stopped.

    python -m resilient_slurm.demo [--ranks N] [--steps S] [--out DIR]

Runs the small training program (``resilient_slurm.examples.train_toy``: MLP with dropout, Adam, LR
schedule, GradScaler, shuffled resumable sampler over DataLoader workers; DDP over gloo when --ranks >
1) twice in local mode: once straight through, once SIGKILLed at a random step and restarted, which
resumes from the last committed checkpoint on the (emulated) node-local NVMe. It then compares final
parameters, optimizer state and the loss of every step, and exits non-zero on any difference.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

from .manifest import MANIFEST_NAME, Manifest


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(ranks: int, workdir: Path, steps: int, every: int, sleep: float) -> list[subprocess.Popen[bytes]]:
    port = _port()
    procs = []
    for r in range(ranks):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RSLURM_", "SLURM_"))}
        env.update(RSLURM_LOCAL_DIR=str(workdir / "nvme" / "%n"), RSLURM_RUN_ID="demo", OMP_NUM_THREADS="1")
        if ranks > 1:
            env.update(RANK=str(r), WORLD_SIZE=str(ranks), LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port))
        cmd = [sys.executable, "-m", "resilient_slurm.examples.train_toy", "--steps", str(steps),
               "--every-steps", str(every), "--log", str(workdir / "log.%r.jsonl"),
               "--out", str(workdir / "final.%r.pt"), "--step-sleep", str(sleep)]
        if ranks > 2:
            cmd += ["--grad-sync", "allreduce"]
        procs.append(subprocess.Popen(cmd, env=env, start_new_session=True))
    return procs


def _wait(procs: list[subprocess.Popen[bytes]]) -> None:
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"a rank failed with exit codes {codes}")


def _losses(log: Path) -> dict[int, float]:
    out: dict[int, float] = {}
    for line in log.read_text().splitlines():
        try:
            e = json.loads(line)
        except ValueError:
            continue  # a torn last line from the SIGKILL
        if "loss" in e:
            out[e["step"]] = e["loss"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=1, help="local ranks (DDP over gloo when > 1)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--every-steps", type=int, default=10)
    ap.add_argument("--out", default="demo-output", help="working directory (wiped first)")
    args = ap.parse_args(argv)

    out = Path(args.out).resolve()
    shutil.rmtree(out, ignore_errors=True)
    straight, killed = out / "uninterrupted", out / "killed-and-resumed"
    straight.mkdir(parents=True)
    killed.mkdir(parents=True)

    print(f"[1/3] training {args.steps} steps without interruption ({args.ranks} rank(s))")
    _wait(_start(args.ranks, straight, args.steps, args.every_steps, 0.0))

    kill_at = random.randint(args.every_steps + 1, args.steps - 5)
    print(f"[2/3] training again; SIGKILL at step {kill_at} (checkpoints every {args.every_steps} steps)")
    procs = _start(args.ranks, killed, args.steps, args.every_steps, 0.03)
    log0 = killed / "log.0.jsonl"
    while not (log0.exists() and max(_losses(log0), default=0) >= kill_at):
        if any(p.poll() is not None for p in procs):
            raise SystemExit("the run ended before it could be killed")
        time.sleep(0.005)
    for p in procs:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    steps_dir = next((killed / "nvme").iterdir()) / "demo"
    committed = sorted(d.name for d in steps_dir.iterdir() if (d / MANIFEST_NAME).exists())
    print(f"      killed. Committed checkpoints on node-local storage: {', '.join(committed)}")
    newest = Manifest.from_json((steps_dir / committed[-1] / MANIFEST_NAME).read_text())
    print(f"      newest: step {newest.step}, {len(newest.shards)} shard(s), {newest.total_bytes / 1024:.0f} KiB, "
          f"checksums {newest.shards[0].algorithm}")
    print("[3/3] restarting the same command: it resumes from the newest valid checkpoint")
    _wait(_start(args.ranks, killed, args.steps, args.every_steps, 0.0))

    a, b = _losses(straight / "log.0.jsonl"), _losses(log0)
    starts = [json.loads(line) for line in log0.read_text().splitlines() if '"start"' in line]
    resumed_from = starts[-1]["step"]
    fa = torch.load(straight / "final.0.pt", weights_only=True)
    fb = torch.load(killed / "final.0.pt", weights_only=True)
    same_params = all(torch.equal(fa["model"][k], fb["model"][k]) for k in fa["model"])
    same_opt = all(
        torch.equal(x, fb["optimizer"]["state"][i][k])
        for i, st in fa["optimizer"]["state"].items() for k, x in st.items()
    )
    same_losses = a == b
    print()
    print(f"  resumed from step {resumed_from} (killed at step {kill_at}: lost {kill_at - resumed_from} step(s))")
    print(f"  final loss, uninterrupted:      {a[args.steps]:.10f}")
    print(f"  final loss, killed and resumed: {b[args.steps]:.10f}")
    print(f"  every step's loss identical: {same_losses}; parameters bitwise identical: {same_params}; "
          f"Adam moments bitwise identical: {same_opt}")
    ok = same_losses and same_params and same_opt
    print("  RESULT:", "IDENTICAL" if ok else "DIFFERENT")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
