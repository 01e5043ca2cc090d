"""Training program for bench/bench_emergency.py: ~1 GiB of state, a fixed short step, a Checkpointer.

    python bench/emergency_worker.py --size-gib 1.0 --step-s 0.05 --log worker.jsonl
                                     [--prime-save | --save-and-exit] [--expect-restore] [--ready-s S]

Run under ``rslurm launch``. It builds the same transformer-shaped model + Adam (moments created) as
bench/common.py, then trains: every step runs a small forward/backward on a head that is part of the
state, nudges one row of the big model (so every step really changes the state), sleeps to ``--step-s``
and calls ``ckpt.step(step, state)``. ``Checkpointer(every_steps=None)`` with the default cadence off: no interval saves, so the
emergency save the launcher requests is the only save unless ``--prime-save`` asks for one blocking save
at step 1 (the staging buffer is then allocated before the signal, as in a job with periodic saves).

Before training it always calls ``ckpt.restore(state)``. In an empty run directory that returns 0. When
the run directory holds a committed step (the benchmark's ``restored`` mode: a priming run with
``--save-and-exit`` saved one step and exited 0), training resumes from that step. At the first ``ckpt.step()`` (after a restore or not) the Checkpointer
plans the save and allocates + pre-faults the staging buffer on its writer thread in the background. The
worker logs when that background allocation finished (a done-callback on the Checkpointer's private
``_prepared`` future: read only, for the log), so a benchmark can tell whether the emergency save found
the buffer ready. ``--expect-restore`` makes a run that restored nothing exit 4.

It appends JSON lines to ``--log`` (wall-clock ``time.time()`` stamps, comparable with the launcher's
events on the same host): ``built``, ``restored`` (step, how long ``restore()`` took), ``training`` (the first step starts), ``prepared`` (the background
allocation finished; logged at the next step boundary with the time it finished), ``ready`` (after
``--ready-steps`` steps and ``--ready-s`` seconds of training), one ``step`` line per step with its
duration, ``emergency`` (when ``ckpt.step`` was entered on the step that saved, when it returned, and the
save's outcome) and ``exit``. It exits 0 once ``ckpt.should_stop`` is set (or after the save of
``--save-and-exit``), or after ``--max-seconds`` without a stop request (exit 3: the benchmark never
signalled).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import build_state, describe, state_dict_of  # noqa: E402

from resilient_slurm import Checkpointer  # noqa: E402


class Log:
    def __init__(self, path: str) -> None:
        self.f = open(path, "a")

    def __call__(self, event: str, **fields: Any) -> None:
        self.f.write(json.dumps({"event": event, "t": time.time(), "pid": os.getpid(), **fields}) + "\n")
        self.f.flush()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=1.0, help="params + 2 Adam moments")
    ap.add_argument("--step-s", type=float, default=0.05, help="duration of one training step")
    ap.add_argument("--log", required=True, help="JSON-lines log")
    ap.add_argument("--prime-save", action="store_true", help="one blocking save at step 1 (warm staging)")
    ap.add_argument("--save-and-exit", action="store_true",
                    help="after --ready-steps steps, one blocking save, then exit 0 (primes a run directory)")
    ap.add_argument("--expect-restore", action="store_true", help="exit 4 if restore() finds no committed step")
    ap.add_argument("--ready-steps", type=int, default=5, help="steps before logging 'ready'")
    ap.add_argument("--ready-s", type=float, default=0.0, help="also at least this much training before 'ready'")
    ap.add_argument("--max-seconds", type=float, default=300.0, help="give up without a stop request")
    args = ap.parse_args(argv)
    logging.basicConfig(level=os.environ.get("RSLURM_LOG_LEVEL", "WARNING"), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s worker %(name)s: %(message)s")
    log = Log(args.log)
    t0 = time.perf_counter()
    model, opt = build_state(int(args.size_gib * 2**30), seed=1)
    torch.manual_seed(0)
    head = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    head_opt = torch.optim.SGD(head.parameters(), lr=1e-3)
    x, y = torch.randn(32, 256), torch.randn(32, 1)
    nudged = next(p for p in model.parameters() if p.dim() == 2)
    state: dict[str, Any] = {"model": model, "optim": opt, "head": head, "head_optim": head_opt,
                             "progress": {"step": 0}}
    info = describe(state_dict_of(model, opt))
    log("built", build_s=time.perf_counter() - t0, bytes=info["bytes"], tensors=info["tensors"],
        torch_threads=torch.get_num_threads())

    os.environ.setdefault("RSLURM_AUTO_CADENCE", "off")  # the emergency save is the only save measured
    ckpt = Checkpointer(every_steps=None)
    t_r = time.perf_counter()
    step = ckpt.restore(state)
    restore_s = time.perf_counter() - t_r
    restored_at = time.time()
    prepared_at: list[float] = []  # set on the writer thread when the background allocation is done
    watching = False  # the first ckpt.step() starts the allocation: watch it from then on
    log("restored", step=step, restore_s=restore_s)
    if args.expect_restore and step == 0:
        log("nothing_restored")
        ckpt.close()
        return 4
    started = time.time()
    log("training", step=step)
    prepared_logged = ready_logged = False
    primed = not args.prime_save
    trained = 0  # steps of this process that were logged as training steps
    while True:
        if prepared_at and not prepared_logged:
            log("prepared", t_done=prepared_at[0], after_restore_s=prepared_at[0] - restored_at,
                after_training_start_s=prepared_at[0] - started)
            prepared_logged = True
        t_step = time.perf_counter()
        loss = torch.nn.functional.mse_loss(head(x), y)
        head_opt.zero_grad(set_to_none=True)
        loss.backward()
        head_opt.step()
        with torch.no_grad():
            nudged[step % nudged.shape[0]].add_(1e-6)
        step += 1
        state["progress"]["step"] = step
        rest = args.step_s - (time.perf_counter() - t_step)
        if rest > 0:
            time.sleep(rest)
        if not primed:
            t = time.time()
            ckpt.save(step, state, blocking=True, reason="interval")
            o = ckpt.last_outcome
            log("primed", step=step, save_s=time.time() - t, stall_s=ckpt.last_stall_s,
                write_s=o.write_s if o else None, commit_s=o.commit_s if o else None)
            primed = True
            continue  # the save is not a training step: keep it out of the step times
        if args.save_and_exit and trained >= args.ready_steps:
            t = time.time()
            ckpt.save(step, state, blocking=True, reason="interval")
            log("saved", step=step, save_s=time.time() - t, stall_s=ckpt.last_stall_s)
            break
        t_call = time.time()
        ckpt.step(step, state)
        t_ret = time.time()
        fut = getattr(ckpt, "_prepared", None)
        if not watching and fut is not None:
            fut.add_done_callback(lambda _f: prepared_at.append(time.time()))
            watching = True
        if ckpt.should_stop:
            o = ckpt.last_outcome
            log("emergency", step=step, t_call=t_call, t_return=t_ret, save_s=t_ret - t_call,
                stall_s=ckpt.last_stall_s, write_s=o.write_s if o else None,
                commit_phase_s=o.commit_s if o else None, bytes_written=o.bytes_written if o else None,
                saved_step=o.step if o else None, prepared_done_t=prepared_at[0] if prepared_at else None)
            break
        log("step", step=step, dt=time.perf_counter() - t_step)
        trained += 1
        if not ready_logged and trained >= args.ready_steps and time.time() - started >= args.ready_s:
            log("ready", step=step, trained_s=time.time() - started)
            ready_logged = True
        if time.time() - started > args.max_seconds:
            log("timeout", step=step)
            ckpt.close()
            return 3
    ckpt.close()
    log("exit", step=step)
    return 0


if __name__ == "__main__":
    sys.exit(main())
