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
  takes the disk's interrupts would help;
- ``ring, CPU hog`` and ``ring, memory hog``: the reads alone beside another process that keeps one core busy,
  with no memory traffic (a Python loop) or with as much as one core makes (``memmove`` of 64 MiB, over and
  over): whether the disk slows down for the CPU the restore takes beside it or for the memory traffic of its
  hash and copy;
- ``ring, 1 MiB reads``: the reads alone in requests of 1 MiB (sixteen in flight, the same bytes in flight):
  what a read straight into the program's 4 KiB pages would be cut into (at most 254 segments a request on a
  virtio disk, ``/sys/block/*/queue/max_segments``), into the same huge-page slots.

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

VARIANTS = ("ring", "hash", "copy", "hash+copy", "hash+copy, pinned 0", "hash+copy, pinned 1", "ring, CPU hog",
            "ring, memory hog", "ring, 1 MiB reads")
# The hogs of the variants that have one: a process started before the clock and stopped after it.
HOGS = {
    "CPU hog": "while True:\n    pass",
    "memory hog": ("import ctypes, mmap\nn = 64 << 20\na, b = mmap.mmap(-1, n), mmap.mmap(-1, n)\na.write(bytes([1]) * n)\n"
                   "pa, pb = (ctypes.addressof(ctypes.c_char.from_buffer(m)) for m in (a, b))\n"
                   "while True:\n    ctypes.memmove(pb, pa, n)"),
}


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
    piece, readers = RING_PIECE, 4
    if "1 MiB reads" in variant:  # the same slots and bytes in flight, cut into requests of 1 MiB
        piece, readers = 1 << 20, 16
        views = [v[o : o + piece] for v in views for o in range(0, RING_PIECE, piece)]
    slots = len(views)
    Cache().drop(path)
    hog = next((subprocess.Popen([sys.executable, "-c", code]) for name, code in HOGS.items() if name in variant), None)
    if hog is not None:
        time.sleep(0.3)  # running before the clock
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    pieces = range(0, span, piece)

    def get(k: int) -> int:
        at = pieces[k]
        return os.preadv(fd, [views[k % slots][: min(piece, span - at)]], at)

    try:
        t0 = time.perf_counter()
        h = xxhash.xxh3_64()
        with ThreadPoolExecutor(readers) as pool:
            pending = {k: pool.submit(get, k) for k in range(min(slots, len(pieces)))}
            for k, at in enumerate(pieces):
                got = pending.pop(k).result()
                slot = views[k % slots]
                for u in range(0, got, RING_HANDOVER):
                    part = slot[u : min(got, u + RING_HANDOVER)]
                    if hashing:
                        h.update(part)
                    if copying:
                        ctypes.memmove(dest.data_ptr() + at + u, ctypes.addressof(ctypes.c_char.from_buffer(part)),
                                       len(part))
                if k + slots < len(pieces):
                    pending[k + slots] = pool.submit(get, k + slots)
        s = time.perf_counter() - t0
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    os.close(fd)
    ring.done()
    return s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True, help="where the state is (or is made, with --prepare)")
    ap.add_argument("--prepare", action="store_true", help="save the 1 GiB benchmark state into --dir first")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--variant", action="append", choices=VARIANTS, default=None,
                    help="measure only this variant (repeatable; default: all of them)")
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
    variants = args.variant or list(VARIANTS)
    times: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(args.repeats):
        for v in variants:
            out = subprocess.run([sys.executable, __file__, "--dir", args.dir, "--child", path, v],
                                 capture_output=True, text=True, check=True)
            times[v].append(json.loads(out.stdout.strip().splitlines()[-1])["s"])
        print(f"round {r + 1}: " + ", ".join(f"{v} {times[v][-1]:.3f} s" for v in variants), flush=True)
    ring = statistics.median(times["ring"]) if "ring" in times else None
    print(f"\n{os.path.getsize(path) / 2**30:.2f} GiB, {path}, median of {args.repeats}\n")
    print("| loop | median | the ring alone / it |\n|---|---:|---:|")
    for v in variants:
        m = statistics.median(times[v])
        print(f"| {v} | {m:.3f} s | {f'{ring / m:.2f}' if ring else 'n/a (ring not measured)'} |")


if __name__ == "__main__":
    main()
