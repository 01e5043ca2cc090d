"""A small rank program for tests/test_hostile_round2.py, run under ``rslurm launch -n N``: a tensor and
a counter as the state, a save every ``--every`` steps, a ``loss`` metric per step (metrics/rank<r>.jsonl).

``--sleep S`` slows each step (a launcher gets time to send a signal).
``--restart-counter``: after restoring, number the steps from 1 again, as a framework that restarts its
own step counter does (the Checkpointer must refuse the first such step, naming both numbers)."""

from __future__ import annotations

import argparse
import sys
import time

import torch

from resilient_slurm import Checkpointer, init_distributed


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--every", type=int, default=2)
    ap.add_argument("--restart-counter", action="store_true")
    ap.add_argument("--sleep", type=float, default=0.0, help="seconds per step")
    args = ap.parse_args()
    init_distributed(backend="gloo")
    state = {"w": torch.zeros(1024), "n": 0}
    ckpt = Checkpointer(every_steps=args.every)
    start = ckpt.restore(state)
    first = 1 if args.restart_counter else start + 1
    for step in range(first, args.steps + 1):
        state["w"] += 1.0
        state["n"] = step
        ckpt.step(step, state, metrics={"loss": float(step)})
        if ckpt.should_stop:
            break
        time.sleep(args.sleep)
    ckpt.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
