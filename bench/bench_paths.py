"""The POSIX tier's link check of every object's path: the root opened and one ``openat2`` beneath it
(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS) against the ``lstat`` of every component below the root (issue 29,
item 5), on this machine's /tmp.

    .venv/bin/python bench/bench_paths.py [--depths 5,12,24] [--objects 2000] [--repeats 5] [--dir /tmp]

For each depth, a tree whose objects sit ``depth`` components below the tier's root (the layout's keys are
5 deep: run/step/domains/node/file; deeper roots are paths like a Lustre project tree below the tier). Timed:
``PosixTier._path`` on every object (an existing object: reads, stats, deletes) and on a new name in each
object's directory (a write: a second ``openat2``, of the directory), with ``openat2`` and with it switched
off (the per-component walk). Medians of
--repeats, microseconds per check, and the ratio walk / openat2. On a network filesystem each ``lstat`` of a
component not in the client's cache is a metadata round trip; here everything is in the dentry cache, so
the figures are the syscalls' own cost.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from common import scratch_dir  # noqa: E402

from resilient_slurm import paths  # noqa: E402
from resilient_slurm.storage.posix import PosixTier  # noqa: E402


def build(root: str, depth: int, objects: int) -> list[str]:
    """``objects`` keys ``depth`` components deep, 100 per leaf directory."""
    keys = []
    for i in range(objects):
        parts = [f"d{j}" for j in range(depth - 2)] + [f"leaf{i // 100}", f"obj{i}"]
        key = "/".join(parts)
        os.makedirs(os.path.join(root, os.path.dirname(key)), exist_ok=True)
        with open(os.path.join(root, key), "wb"):
            pass
        keys.append(key)
    return keys


def timed(tier: PosixTier, keys: list[str]) -> float:
    t0 = time.perf_counter()
    for k in keys:
        tier._path(k)
    return (time.perf_counter() - t0) / len(keys) * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--depths", default="5,12,24")
    ap.add_argument("--objects", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", help="where to work (default: the temporary directory; made if missing)")
    args = ap.parse_args(argv)
    if paths._openat2() is None:
        print("openat2 is not usable on this kernel: the tier walks every path; nothing to compare")
        return 0
    work = scratch_dir(args.dir, "rslurm-paths-")
    print(f"openat2 vs per-component lstat, {args.objects} objects, medians of {args.repeats} ({work})")
    print()
    print("| depth below the root | existing object: openat2 µs | walk µs | walk / openat2 | "
          "new object: openat2 µs | walk µs | walk / openat2 |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    try:
        for depth in [int(x) for x in args.depths.split(",")]:
            root = os.path.join(work, f"depth{depth}")
            keys = build(root, depth, args.objects)
            new = [f"{os.path.dirname(k)}/new-{i}" for i, k in enumerate(keys)]
            tier = PosixTier(root)
            fn = paths._openat2()
            res: dict[tuple[str, bool], list[float]] = {}
            for _ in range(args.repeats):
                for use in (True, False):
                    paths._openat2_state[:] = [fn if use else None]
                    res.setdefault(("old", use), []).append(timed(tier, keys))
                    res.setdefault(("new", use), []).append(timed(tier, new))
            paths._openat2_state[:] = [fn]
            m = {k: statistics.median(v) for k, v in res.items()}
            print(f"| {depth} | {m['old', True]:.2f} | {m['old', False]:.2f} | {m['old', False] / m['old', True]:.1f} | "
                  f"{m['new', True]:.2f} | {m['new', False]:.2f} | {m['new', False] / m['new', True]:.1f} |")
            shutil.rmtree(root)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
