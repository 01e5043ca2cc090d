"""A training-like process for crash-consistency tests (run as a script, one rank, no mocks).

Every value of its state is a pure function of the step, so after any crash a restore can be checked
exactly: a restored step must carry that step's content everywhere, never a mix or a partial write.

    python crash_worker.py --local-dir D --run-id R --steps N [--tensors T --tensor-mb M]
                           [--keep-last K] [--arm POINT=ACTION --arm-at S]

Prints one line per event (flushed): ``restored R``, ``verified R`` (or ``MISMATCH ...`` and exit 3),
``leftover K`` (in-progress directories present after the restore), ``saving N``,
``committed N <seconds>``, ``done``. ``--arm`` arms a failpoint (``resilient_slurm.failpoints``) just
before the save of step ``--arm-at``, so earlier steps commit normally in the same process.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shlex
import sys
import time
import traceback
from typing import Any

import torch

from resilient_slurm import Checkpointer, failpoints

MiB = 1 << 20


def tensor_value(step: int, i: int, n: int) -> torch.Tensor:
    """Content of tensor ``i`` at ``step``: differs per element, per tensor and per step."""
    return torch.arange(n, dtype=torch.int64) * 3 + step * 1_000_003 + i * 7919


def plain_value(step: int) -> dict[str, Any]:
    return {"step": step, "tag": f"s{step}", "hist": list(range(step % 5))}


def build_state(n_tensors: int, tensor_mb: float) -> dict[str, Any]:
    n = int(tensor_mb * MiB) // 8
    state: dict[str, Any] = {f"t{i}": torch.empty(n, dtype=torch.int64) for i in range(n_tensors)}
    state["model"] = torch.nn.Linear(32, 32)
    state["meta"] = None
    set_step(state, -1)
    return state


def set_step(state: dict[str, Any], step: int) -> None:
    """Make ``state`` hold the content of ``step`` (in place for tensors, like training does)."""
    with torch.no_grad():
        for k, v in state.items():
            if k.startswith("t"):
                v.copy_(tensor_value(step, int(k[1:]), v.numel()))
        state["model"].weight.fill_(float(step))
        state["model"].bias.fill_(step + 0.5)
    state["meta"] = plain_value(step)


def mismatches(state: dict[str, Any], step: int) -> list[str]:
    bad = []
    for k, v in state.items():
        if k.startswith("t"):
            want = tensor_value(step, int(k[1:]), v.numel())
            if not torch.equal(v, want):
                wrong = int((v != want).sum())
                bad.append(f"{k} ({wrong} of {v.numel()} elements wrong; first element {int(v[0])})")
    m = state["model"]
    if not (torch.all(m.weight == float(step)) and torch.all(m.bias == step + 0.5)):
        bad.append(f"model (weight[0,0]={float(m.weight[0, 0])})")
    if state["meta"] != plain_value(step):
        bad.append(f"meta ({state['meta']!r})")
    return bad


def say(*parts: object) -> None:
    print(*parts, flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--local-dir", required=True)
    ap.add_argument("--run-id", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--tensors", type=int, default=4)
    ap.add_argument("--tensor-mb", type=float, default=1.0)
    ap.add_argument("--keep-last", type=int, default=3)
    ap.add_argument("--arm", default=None, help="failpoint spec, e.g. after_manifest=kill")
    ap.add_argument("--arm-at", type=int, default=2)
    ap.add_argument("--staging-memory-limit", default=None, help="save in waves through a window of this size")
    a = ap.parse_args(argv)
    if a.staging_memory_limit:  # a forked worker: the zygote's environment stays as it was
        os.environ["RSLURM_STAGING_MEMORY_LIMIT"] = a.staging_memory_limit

    state = build_state(a.tensors, a.tensor_mb)
    ckpt = Checkpointer(local_dir=a.local_dir, run_id=a.run_id, keep_last=a.keep_last)
    start = ckpt.restore(state)
    say("restored", start)
    bad = mismatches(state, start if start > 0 else -1)
    if bad:
        say("MISMATCH", start, "; ".join(bad))
        return 3
    say("verified", start)
    run_dir = os.path.join(a.local_dir, a.run_id)
    left = [n for n in os.listdir(run_dir) if ".tmp-" in n] if os.path.isdir(run_dir) else []
    say("leftover", len(left), *left)

    for step in range(start + 1, a.steps + 1):
        if a.arm and step == a.arm_at:
            os.environ[failpoints.ENV] = a.arm
            importlib.reload(failpoints)  # failpoints are read at import; the engine uses this module
            say("armed", a.arm)
        set_step(state, step)
        say("saving", step)
        t0 = time.perf_counter()
        ckpt.save(step, state, blocking=True)
        say("committed", step, f"{time.perf_counter() - t0:.4f}")
    ckpt.close()
    say("done")
    return 0


def zygote() -> int:
    for line in sys.stdin:
        cmd = shlex.split(line)
        if not cmd:
            continue
        if cmd[0] != "run":
            say("error unknown command", cmd[0])
            continue
        pid = os.fork()
        if pid == 0:  # child: a fresh worker process
            rc = 1
            try:
                rc = main(cmd[1:])
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(rc)
        say("child", pid)
        _, status = os.waitpid(pid, 0)
        say("exited", pid, os.waitstatus_to_exitcode(status))
    return 0


if __name__ == "__main__":
    sys.exit(zygote() if sys.argv[1:] == ["--zygote"] else main())
