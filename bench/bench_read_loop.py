#!/usr/bin/env python3
"""What the restore's own work beside the reads costs the reads: a ring read of one shard with and without it.

The restore reads a shard's large tensors with O_DIRECT through a ring of eight 4 MiB huge-page slots, four
requests in flight, and its calling thread hashes (xxh3) each piece in order and copies it into the program's
tensor before the slot is read into again (storage/fileio.py: ``read_through``). This measures that loop
without the rest of the restore (no manifest, plan, small items or apply), each variant in a fresh process
after the page cache is dropped, the variants taking turns round by round:

- ``ring``: the reads alone, each slot handed back at once (the disk's speed through the ring);
- ``hash``: each piece hashed in 1 MiB parts, as the restore hands them over;
- ``copy``: each piece copied into an already-faulted buffer as large as the file (the program's tensors:
  4 KiB pages, as torch's allocator gives them unless the program asks for transparent huge pages);
- ``hash+copy``: both, as the restore does;
- ``hash+copy, pinned N``: both, with the calling thread pinned to CPU N (the readers are not pinned): if the
  reads slowed because the calling thread took the core a reader needed, pinning it away from the core that
  takes the disk's interrupts would help.

It reads the largest ``*.distcp`` file under ``--dir`` (a state saved by bench_restore.py; ``--prepare`` makes
one). Usage::

    .venv/bin/python bench/bench_read_loop.py --dir /tmp/loop-bench --prepare --repeats 5
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

VARIANTS = ("ring", "hash", "copy", "hash+copy", "hash+copy, pinned 0", "hash+copy, pinned 1")


def child(path: str, variant: str) -> float:
    import torch
    import xxhash
    from common import Cache

    from resilient_slurm.storage.fileio import RING_HANDOVER, RING_PIECE, RING_SLOTS, Ring

    size = os.path.getsize(path)
    span = -(-size // 4096) * 4096
    dest = torch.empty(span, dtype=torch.uint8)
    dest.fill_(1)  # the program's tensors are faulted in before a restore
    ring = Ring().warm()
    # every slot made before the clock, held by this loop: this measures the loop, not fresh memory
    views = [ring.views[ring.acquire()] for _ in range(RING_SLOTS)]
    if "pinned" in variant:
        os.sched_setaffinity(0, {int(variant.rsplit(" ", 1)[1])})  # this thread only
    hashing, copying = "hash" in variant, "copy" in variant
    Cache().drop(path)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    pieces = range(0, span, RING_PIECE)

    def get(k: int) -> int:
        at = pieces[k]
        return os.preadv(fd, [views[k % RING_SLOTS][: min(RING_PIECE, span - at)]], at)

    t0 = time.perf_counter()
    h = xxhash.xxh3_64()
    with ThreadPoolExecutor(4) as pool:
        pending = {k: pool.submit(get, k) for k in range(min(RING_SLOTS, len(pieces)))}
        for k, at in enumerate(pieces):
            got = pending.pop(k).result()
            slot = views[k % RING_SLOTS]
            for u in range(0, got, RING_HANDOVER):
                part = slot[u : min(got, u + RING_HANDOVER)]
                if hashing:
                    h.update(part)
                if copying:
                    ctypes.memmove(dest.data_ptr() + at + u, ctypes.addressof(ctypes.c_char.from_buffer(part)),
                                   len(part))
            if k + RING_SLOTS < len(pieces):
                pending[k + RING_SLOTS] = pool.submit(get, k + RING_SLOTS)
    s = time.perf_counter() - t0
    os.close(fd)
    ring.done()
    return s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True, help="where the state is (or is made, with --prepare)")
    ap.add_argument("--prepare", action="store_true", help="save the 1 GiB benchmark state into --dir first")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--child", nargs=2, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps({"s": child(*args.child)}))
        return
    if args.prepare:
        import bench_restore

        os.makedirs(args.dir, exist_ok=True)
        bench_restore.prepare(argparse.Namespace(size_gib=1, io_threads=4, device="cpu"), args.dir)
    files = glob.glob(os.path.join(args.dir, "**", "*.distcp"), recursive=True)
    if not files:
        sys.exit(f"no *.distcp under {args.dir}: run with --prepare")
    path = max(files, key=os.path.getsize)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(args.repeats):
        for v in VARIANTS:
            out = subprocess.run([sys.executable, __file__, "--dir", args.dir, "--child", path, v],
                                 capture_output=True, text=True, check=True)
            times[v].append(json.loads(out.stdout.strip().splitlines()[-1])["s"])
        print(f"round {r + 1}: " + ", ".join(f"{v} {times[v][-1]:.3f} s" for v in VARIANTS), flush=True)
    ring = statistics.median(times["ring"])
    print(f"\n{os.path.getsize(path) / 2**30:.2f} GiB, {path}, median of {args.repeats}\n")
    print("| loop | median | the ring alone / it |\n|---|---:|---:|")
    for v in VARIANTS:
        m = statistics.median(times[v])
        print(f"| {v} | {m:.3f} s | {ring / m:.2f} |")


if __name__ == "__main__":
    main()
