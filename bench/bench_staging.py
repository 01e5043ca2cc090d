"""Saves under a host-memory budget (``staging_memory_limit``): the stall and the peak host memory at 1x,
0.5x and 0.25x of the state's size, against no budget and against a blocking ``torch.save`` of the same state.

    .venv/bin/python bench/bench_staging.py [--size-gib 0.5] [--dir DIR] [--repeats 3]

Each configuration runs in a fresh process (its peak RSS is its own): it builds the transformer-shaped state
(common.build_state: parameters + Adam moments), notes its peak RSS, then saves ``--repeats`` + 1 steps with
``ckpt.save(step, state, blocking=False)``, timing the call (the stall: the copy, and with waves the write),
then ``ckpt.wait()``. The first save (buffer allocation) is reported apart. Peak memory: the process's
peak RSS (VmHWM, reset after the state is built) less its RSS then. The baseline, in a process of its
own too, is ``torch.save`` + fsync of the same state dict (a save that writes while training waits), and the
disk's own speed: the state's bytes written from one buffer with O_DIRECT and fsynced (``raw``).
Prints medians and ratios; see docs/benchmarks.md ("Staging memory budget").
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import (  # noqa: E402
    GB,
    build_state,
    fill_from_state,
    med,
    now,
    page_buffer,
    raw_write,
    state_dict_of,
    torch_save_fsync,
)

from resilient_slurm.storage.fileio import round_up  # noqa: E402

MiB = 1 << 20


def _status(field: str) -> int:
    """A /proc/self/status memory field, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> int:
    """Reset the peak RSS (VmHWM) to the current RSS, which it returns: building the state's transient
    tensors must not hide what the saves add."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def child(args: argparse.Namespace) -> None:
    """One configuration: prints one JSON line."""
    model, opt = build_state(int(args.size_gib * GB), seed=0)
    sd = state_dict_of(model, opt)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters()) * 3
    built = _reset_peak()
    out: dict[str, object] = {"limit": args.limit, "state_bytes": nbytes}
    if args.limit == "torch.save":
        times = [torch_save_fsync(os.path.join(args.dir, f"t{i}.pt"), sd) for i in range(args.repeats)]
        out.update(first_s=times[0], stall_s=med(times), peak_extra=_status("VmHWM") - built)
    elif args.limit == "raw":  # the disk's own speed: the state's bytes from one buffer, O_DIRECT, fsync
        _, mv = page_buffer(round_up(nbytes))
        fill_from_state(mv, sd)
        built = _reset_peak()
        times = [raw_write(os.path.join(args.dir, f"r{i}.bin"), mv, 4)[0] for i in range(args.repeats)]
        out.update(first_s=times[0], stall_s=med(times), peak_extra=_status("VmHWM") - built)
    else:
        from resilient_slurm import Checkpointer  # noqa: PLC0415 - after the state, as a program does

        if args.limit != "none":
            os.environ["RSLURM_STAGING_MEMORY_LIMIT"] = str(int(float(args.limit) * nbytes))
        stalls = []
        with Checkpointer(local_dir=args.dir, run_id="b", capture_rng=False, keep_last=1) as ck:
            for step in range(1, args.repeats + 2):
                t0 = now()
                ck.save(step, sd, blocking=False)
                stalls.append(now() - t0)
                ck.wait()
            staging = ck._engine._staging
        out.update(first_s=stalls[0], stall_s=med(stalls[1:]), peak_extra=_status("VmHWM") - built,
                   staging=type(staging).__name__, staging_bytes=staging.nbytes if staging is not None else 0)
    print(json.dumps(out), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-gib", type=float, default=0.5)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--limit", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.limit is not None:
        child(args)
        return 0
    rows = []
    for limit in ("raw", "torch.save", "none", "1", "0.5", "0.25"):
        work = tempfile.mkdtemp(prefix="rslurm-bench-staging-", dir=args.dir)
        try:
            r = subprocess.run([sys.executable, __file__, "--size-gib", str(args.size_gib), "--dir", work,
                                "--repeats", str(args.repeats), "--limit", limit],
                               capture_output=True, text=True, check=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
    size = rows[0]["state_bytes"]
    base = next(r for r in rows if r["limit"] == "none")
    ts = next(r for r in rows if r["limit"] == "torch.save")
    raw = next(r for r in rows if r["limit"] == "raw")
    print(f"state {size / GB:.2f} GB (parameters + Adam moments), dir {args.dir}, median of {args.repeats} saves")
    print(f"{'budget':>12} {'staging MiB':>12} {'stall s':>8} {'x no budget':>12} {'x torch.save':>13} "
          f"{'x raw write':>12} {'peak extra MiB':>15} {'/ state':>8}")
    for r in rows:
        label = r["limit"] if r["limit"] in ("raw", "torch.save", "none") else f"{r['limit']}x state"
        staging = f"{r.get('staging_bytes', 0) / MiB:.0f}" if "staging_bytes" in r else "-"
        print(f"{label:>12} {staging:>12} {r['stall_s']:>8.3f} {r['stall_s'] / base['stall_s']:>12.2f} "
              f"{r['stall_s'] / ts['stall_s']:>13.2f} {r['stall_s'] / raw['stall_s']:>12.2f} "
              f"{r['peak_extra'] / MiB:>15.0f} {r['peak_extra'] / size:>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
