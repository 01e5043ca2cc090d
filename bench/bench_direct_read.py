#!/usr/bin/env python3
"""Can a restore read with O_DIRECT straight into the program's own tensors, instead of through the ring?

The restore reads each large tensor's bytes into a ring of huge-page buffers and copies them into the
program's tensor (storage/fileio.py: ``read_through``; docs/architecture.md, "In-place restore"). The copy
and the ring's first touch are what the restore spends beyond a raw read of the file. Reading straight into
the tensor would spend neither, so this measures the read alone, before any file layout is changed for it:

- ``raw``: the benchmark's baseline (bench_restore.py's ``raw read, prefaulted buffer``): O_DIRECT reads of
  16 MiB, four in flight, into one prefaulted transparent-huge-page buffer;
- ``direct``: the same file read with O_DIRECT, four requests in flight, straight into the large tensors
  (1 MiB or more) of a freshly built model + Adam, already faulted, and each request hashed (xxh3) in order
  as it arrives, as the restore checks every byte. Only each tensor's block-aligned middle is read, at a
  block-aligned file offset: the bytes are not the tensor's own (today's file layout does not line a
  tensor's bytes up with its memory modulo the disk's block), but the requests, their sizes, their
  alignment and the memory they land in are those a restore into the tensors would make;
- ``direct, THP``: ``direct`` with the tensors allocated under ``THP_MEM_ALLOC_ENABLE=1`` (torch's CPU
  allocator then aligns allocations of 2 MiB or more to 2 MiB and asks for transparent huge pages).

Each measurement is a fresh process after the page cache is dropped; the modes take turns round by round.
It needs a state saved by bench_restore.py's preparation (``--prepare`` makes one). Usage::

    .venv/bin/python bench/bench_direct_read.py --dir /tmp/direct-bench --prepare --repeats 5
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

import bench_restore  # noqa: E402
from common import Cache, build_state, open_direct  # noqa: E402

REQUEST = 4 << 20  # the ring's piece (fileio.RING_PIECE)
ALIGN = 512  # the disk's logical block and DMA alignment here (/sys/block/vda/queue)


def direct_read(files: list[str], threads: int) -> float:
    """Seconds to read the large tensors' aligned middles straight into a fresh model + Adam's tensors."""
    import torch
    import xxhash

    model, opt = build_state(1 << 30, seed=2)
    big = [p.data for p in model.parameters()] + [v for s in opt.state.values() for v in s.values()]
    big = sorted((t for t in big if isinstance(t, torch.Tensor) and t.nbytes >= 1 << 20), key=lambda t: -t.nbytes)
    reqs = []  # (file offset, address, bytes)
    cur = 0
    for t in big:  # the file holds the large tensors first, largest first (staging.ShardLayout)
        a = t.data_ptr()
        head = -a % ALIGN
        n = (t.nbytes - head) // ALIGN * ALIGN
        fo = (cur + head + ALIGN - 1) // ALIGN * ALIGN
        reqs += [(fo + x, a + head + x, min(REQUEST, n - x)) for x in range(0, n, REQUEST)]
        cur += t.nbytes
    Cache().drop(*files)
    t0 = time.perf_counter()
    fd, _ = open_direct(files[0], os.O_RDONLY)
    try:
        def view(addr: int, n: int) -> memoryview:
            return memoryview((ctypes.c_char * n).from_address(addr)).cast("B")

        def get(r: tuple[int, int, int]) -> int:
            return os.preadv(fd, [view(r[1], r[2])], r[0])

        h = xxhash.xxh3_64()
        with ThreadPoolExecutor(threads) as pool:
            for r, fut in zip(reqs, [pool.submit(get, r) for r in reqs]):
                fut.result()
                h.update(view(r[1], r[2]))
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def child(args: argparse.Namespace) -> None:
    files = bench_restore.shard_files(args.dir)
    if args.child == "raw":
        Cache().drop(*files)
        print(json.dumps({"s": bench_restore.raw_read_files(files, True, args.io_threads)}))
    else:
        print(json.dumps({"s": direct_read(files, args.io_threads)}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True, help="where the state is (or is made, with --prepare)")
    ap.add_argument("--prepare", action="store_true", help="save the 1 GiB benchmark state into --dir first")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--io-threads", type=int, default=4)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    if args.prepare:
        os.makedirs(args.dir, exist_ok=True)
        bench_restore.prepare(argparse.Namespace(size_gib=1, io_threads=args.io_threads, device="cpu"), args.dir)
    files = bench_restore.shard_files(args.dir)
    if len(files) != 1:
        sys.exit(f"{args.dir}: expected the one shard file of a one-rank save, found {len(files)}")
    modes = {"raw": {}, "direct": {}, "direct, THP": {"THP_MEM_ALLOC_ENABLE": "1"}}
    times: dict[str, list[float]] = {m: [] for m in modes}
    for i in range(args.repeats):
        for mode, env in modes.items():
            out = subprocess.run([sys.executable, __file__, "--dir", args.dir, "--io-threads", str(args.io_threads),
                                  "--child", mode.split(",")[0]], env={**os.environ, **env},
                                 capture_output=True, text=True, check=True)
            times[mode].append(json.loads(out.stdout.strip().splitlines()[-1])["s"])
            print(f"round {i + 1}: {mode} {times[mode][-1]:.3f} s", file=sys.stderr)
    raw = statistics.median(times["raw"])
    print("| read | median | raw / it |\n|---|---:|---:|")
    for mode, ts in times.items():
        m = statistics.median(ts)
        print(f"| {mode} | {m:.3f} s | {raw / m:.2f} |")


if __name__ == "__main__":
    main()
