#!/usr/bin/env python3
"""Cold restore: a fresh process, the page cache dropped, restores the benchmark state, against the floors.

Every measurement runs in a new Python process (what a requeued or restarted rank is), after the page cache
is dropped, and the methods take turns round by round, so drift in the disk's speed hits all of them alike:

- ``raw read, prefaulted buffer``: O_DIRECT reads of the step's shard files into memory that was touched
  beforehand (the disk's own speed; the issue's baseline);
- ``raw read, fresh buffer``: the same into a fresh transparent-huge-page buffer, which a fresh process must
  also fault in: the floor for any restore that does not already own the memory;
- ``verified copy through the ring``: the restore's read loop and nothing else (``fileio.read_through`` over
  each whole shard file, its ring made before the clock, every byte hashed with xxh3 and copied into memory
  the process touched beforehand, as the restore copies into the program's tensors): what the disk and this
  machine's memory allow a restore that verifies and places every byte, before any of its fixed costs;
- ``ours``: ``Checkpointer.restore`` into a freshly built model + Adam (verification included: every item's
  xxh3 checked; the large tensors read straight into the model's and the optimizer's own, already faulted
  memory: docs/architecture.md, "In-place restore");
- ``ours, copying``: the same with nothing read in place (every item read into a buffer, verified, then
  copied into the tensors: what ``restore_fallback="fresh"`` does);
- ``torch.load + load_state_dict``: ``torch.load(weights_only=True, mmap=False)`` of a ``torch.save`` file of
  the same state, then ``model.load_state_dict`` and ``optimizer.load_state_dict``;
- ``dcp.load``: ``torch.distributed.checkpoint.load`` of a ``dcp.save`` of the same state, then the optimizer's
  ``load_state_dict``.

Each child checks that what it restored equals the saved state (a digest of every tensor) and reports its
time; building the fresh model is not timed. Usage::

    .venv/bin/python bench/bench_restore.py [--size-gib 1] [--repeats 5] [--device cpu|cuda] [--hog] [--json out.json]

``--compare TREE`` adds ``ours_compare``: the same restore by another checkout of the project (``TREE``: its
root, e.g. a ``git worktree`` of the commit before a change), its child run from that tree against the same
saved step, in turn with the others round by round; each round's ratio against the raw read is printed for
both, so a change is told from the noise of this machine (which moves the ratio of unchanged code by 0.05
between runs) by comparing the two within one run.

``--hog`` measures every method twice a round: on the quiet machine, and with a CPU hog (a process spinning in
a loop, started before the child and killed after it) on one core, as on a node where data loading or another
job shares the cores. Both tables and both sets of ratios are printed.

With ``--device cuda`` the model and Adam live on the GPU: ours reads into pinned memory and copies on a side
stream, torch.load maps to the GPU, dcp.load loads into GPU tensors; each time includes the final
``torch.cuda.synchronize``. The raw reads stay host reads (the disk's floor).
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

import torch  # noqa: E402
from common import (  # noqa: E402
    BLOCK,
    IO_CHUNK,
    Cache,
    add_wait_quiet_arg,
    against_target,
    build_state,
    fmt,
    log,
    machine_facts,
    med,
    now,
    open_direct,
    page_buffer,
    ratio,
    ratio_interval,
    remove,
    scratch_dir,
    state_dict_of,
    tensors_of,
    wait_quiet,
)

MODES = ("raw_prefaulted", "raw_fresh", "verified_copy", "ours", "ours_copying", "torch_load", "dcp_load")
# Not run by default: ours_pinned (--device cuda: read buffers pinned, restore_round.PIN_FOR_CUDA) and
# ours_compare (--compare TREE).
EXTRA_MODES = ("ours_pinned", "ours_compare")
LABELS = {
    "raw_prefaulted": "raw O_DIRECT read, prefaulted buffer",
    "raw_fresh": "raw O_DIRECT read, fresh buffer",
    "verified_copy": "verified copy through the ring (the read loop alone)",
    "ours": "ours: Checkpointer.restore (verified)",
    "ours_copying": "ours, nothing in place (restore_fallback=fresh; verified)",
    "ours_pinned": "ours, pinned read buffers (verified)",
    "ours_compare": "ours, the tree at --compare (verified)",
    "torch_load": "torch.load + load_state_dict",
    "dcp_load": "dcp.load + optimizer.load_state_dict",
}


def digest(sd: dict[str, Any]) -> str:
    h = hashlib.sha256()
    for t in tensors_of(sd):
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def shard_files(root: str) -> list[str]:
    return sorted(f for f in glob.glob(os.path.join(root, "ours", "**", "*.distcp"), recursive=True))


def raw_read_files(files: list[str], prefault: bool, threads: int) -> float:
    """Seconds to read ``files`` with O_DIRECT into one page-aligned buffer (touched first with ``prefault``)."""
    sizes = [os.path.getsize(f) for f in files]
    spans = [-(-n // BLOCK) * BLOCK for n in sizes]
    if prefault:
        mm, mv = page_buffer(sum(spans))
    else:
        from resilient_slurm.storage.fileio import aligned_buffer, as_memoryview

        buf = aligned_buffer(sum(spans), prefault=False)
        mv = as_memoryview(buf)
    t0 = now()
    base = 0
    with ThreadPoolExecutor(threads) as pool:
        for f, span in zip(files, spans):
            fd, _ = open_direct(f, os.O_RDONLY)
            try:
                def get(off: int, fd: int = fd, base: int = base, span: int = span) -> int:
                    return os.preadv(fd, [mv[base + off : base + min(off + IO_CHUNK, span)]], off)

                list(pool.map(get, range(0, span, IO_CHUNK)))
            finally:
                os.close(fd)
            base += span
    return now() - t0


def verified_copy(files: list[str], threads: int) -> tuple[float, bool]:
    """Seconds for the restore's read loop alone over ``files``: each whole file read through the restore's ring
    (made before the clock), hashed and copied into a tensor of its size that was touched beforehand; and
    whether every copy holds its file's bytes and every hash is the file's (checked after the clock)."""
    import ctypes

    from resilient_slurm.storage.fileio import Ring, checksum, read_through

    dests = [torch.ones(os.path.getsize(f), dtype=torch.uint8) for f in files]  # faulted, as a program's are
    ring = Ring().warm()
    for i in [ring.acquire() for _ in range(ring.slots)]:  # every slot made before the clock
        ring.release(i)
    Cache().drop(*files)
    sums = []
    t0 = now()
    for f, dest in zip(files, dests):
        base = dest.data_ptr()

        def sink(k: int, at: int, view: memoryview, base: int = base) -> None:
            ctypes.memmove(base + at, ctypes.addressof(ctypes.c_char.from_buffer(view)), len(view))

        sums += read_through(f, len(dest), [(0, len(dest))], sink, threads=threads, ring=ring)
    s = now() - t0
    ring.done()
    equal = True
    for f, dest, got in zip(files, dests, sums):
        with open(f, "rb") as fh:
            want = checksum(fh.read())
        equal = equal and got == want and checksum(dest.numpy().data) == want
    return s, equal


def child(args: argparse.Namespace) -> None:
    """One measurement in this fresh process: prints {"s": seconds, "equal": bool, ...} as JSON."""
    root, mode, size = args.dir, args.child, int(args.size_gib * 2**30)
    out: dict[str, Any] = {}
    if mode == "verified_copy":
        out["s"], out["equal"] = verified_copy(shard_files(root), args.io_threads)
        print(json.dumps(out))
        return
    if mode.startswith("raw"):
        files = shard_files(root)
        Cache().drop(*files)
        out["s"] = raw_read_files(files, mode == "raw_prefaulted", args.io_threads)
        out["equal"] = None
        print(json.dumps(out))
        return
    model, opt = build_state(size, seed=2, device=args.device)  # other values than the saved ones (untimed)
    cache = Cache()
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    if mode in ("ours", "ours_copying", "ours_pinned"):
        from resilient_slurm import Checkpointer
        from resilient_slurm.checkpoint import restore_round as round_mod

        round_mod.PIN_FOR_CUDA = mode == "ours_pinned"
        cache.drop(os.path.join(root, "ours"))
        ck = Checkpointer(local_dir=os.path.join(root, "ours"), run_id="bench", keep_last=1,
                          io_threads=args.io_threads, restore_fallback="fresh" if mode == "ours_copying" else "fail")
        t0 = now()
        step = ck.restore({"model": model, "optim": opt})
        sync()
        out["s"] = now() - t0
        ck.close()
        from common import read_jsonl

        ev = [e for e in read_jsonl(os.path.join(root, "ours", "bench", "events.jsonl")) if e.get("event") == "restore"]
        out["placed_bytes"] = ev[-1].get("placed_bytes", 0) if ev else 0
        assert step == 1, step
    elif mode == "torch_load":
        path = os.path.join(root, "state.pt")
        cache.drop(path)
        t0 = now()
        sd = torch.load(path, map_location=args.device, weights_only=True)
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])
        sync()
        out["s"] = now() - t0
    else:
        import torch.distributed.checkpoint as dcp

        path = os.path.join(root, "dcp")
        cache.drop(path)
        t0 = now()
        sd = state_dict_of(model, opt)
        dcp.load(sd, checkpoint_id=path, no_dist=True)
        opt.load_state_dict(sd["optim"])
        sync()
        out["s"] = now() - t0
    out["equal"] = digest(state_dict_of(model, opt)) == args.expect
    print(json.dumps(out))


def prepare(args: argparse.Namespace, root: str) -> str:
    """Save the state once each way (untimed); returns its digest."""
    import torch.distributed.checkpoint as dcp

    from resilient_slurm import Checkpointer

    model, opt = build_state(int(args.size_gib * 2**30), seed=1, device=args.device)
    sd = state_dict_of(model, opt)
    with Checkpointer(local_dir=os.path.join(root, "ours"), run_id="bench", keep_last=1,
                      io_threads=args.io_threads) as ck:
        ck.save(1, {"model": model, "optim": opt})
        ck.wait()
    torch.save(sd, os.path.join(root, "state.pt"))
    dcp.save(sd, checkpoint_id=os.path.join(root, "dcp"), no_dist=True)
    os.sync()
    return digest(sd)


HOG = "import os\nwhile True:\n    os.getpid()\n"


def run(args: argparse.Namespace) -> dict[str, Any]:
    root = scratch_dir(args.dir, "rslurm-bench-restore-")
    modes = [(m, False) for m in args.modes] + ([(m, True) for m in args.modes] if args.hog else [])
    r: dict[str, Any] = {"machine": machine_facts(root), "size_gib": args.size_gib, "io_threads": args.io_threads,
                         "device": args.device, "times": {m: [] for m in args.modes},
                         "hog_times": {m: [] for m in args.modes} if args.hog else {}, "errors": [],
                         "placed_bytes": []}
    try:
        log(f"saving the state ({args.size_gib} GiB) with rslurm, torch.save and dcp.save (untimed) ...")
        expect = prepare(args, root)
        r["bytes"] = sum(os.path.getsize(f) for f in shard_files(root))
        for i in range(args.repeats):
            for mode, hogged in modes:
                if args.wait_quiet > 0:
                    wait_quiet(args.wait_quiet)
                script = os.path.abspath(__file__)
                if mode == "ours_compare":  # the other tree's own child, which imports the other tree's code
                    script = os.path.join(os.path.abspath(args.compare), "bench", "bench_restore.py")
                cmd = [sys.executable, script, "--child", "ours" if mode == "ours_compare" else mode, "--dir", root,
                       "--expect", expect,
                       "--size-gib", str(args.size_gib), "--io-threads", str(args.io_threads), "--device", args.device]
                hog = subprocess.Popen([sys.executable, "-c", HOG]) if hogged else None
                try:
                    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
                    res = json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 else None
                    failed = None if p.returncode == 0 else f"exit {p.returncode}: {p.stderr.strip()[-2000:]}"
                except subprocess.TimeoutExpired:
                    failed = "no result within 900 s"
                except (ValueError, IndexError):  # no JSON line last
                    failed = f"unreadable result: {p.stdout.strip()[-500:]!r} {p.stderr.strip()[-1500:]}"
                finally:
                    if hog is not None:
                        hog.kill()
                        hog.wait()
                if failed is not None or res is None:
                    r["errors"].append(f"{mode}: {failed}")
                    log(r["errors"][-1])
                    # None keeps the lists round by round: the ratios and the interval pair each mode's
                    # time with the raw read of the same round, and skip a round where either failed.
                    r["hog_times" if hogged else "times"][mode].append(None)
                    continue
                if res["equal"] is False:
                    r["errors"].append(f"{mode}: restored state differs from the saved one")
                r["hog_times" if hogged else "times"][mode].append(res["s"])
                if "placed_bytes" in res and mode == "ours":
                    r["placed_bytes"].append(res["placed_bytes"])
                log(f"round {i + 1}: {mode}{' (CPU hog)' if hogged else ''} {res['s']:.3f} s")
    finally:
        remove(root)
    return r


def report(r: dict[str, Any]) -> None:
    report_times(r, r["times"], "")
    if r.get("hog_times"):
        report_times(r, r["hog_times"], ", a CPU hog on one core")
    if r["placed_bytes"]:
        print(f"\nbytes read straight into the live tensors: {r['placed_bytes'][0]} of {r.get('bytes', 0)}")
    for e in r["errors"]:
        print("ERROR:", e)
    if not r["errors"]:
        print("every restore returned state equal to what was saved")


def spread(xs: list[float | None]) -> str:
    """The lowest and highest of the rounds' times that were measured (a failed round is None)."""
    got = [x for x in xs if x is not None]
    return f"{min(got):.3f}-{max(got):.3f} s" if got else "n/a"


def report_times(r: dict[str, Any], times: dict[str, list[float | None]], what: str) -> None:
    n = r.get("bytes", 0)
    t = {m: med(v) for m, v in times.items()}
    print(f"\nCold restore of {n / 2**30:.2f} GiB of shards (fresh process, page cache dropped{what}; "
          f"median of {max(len([x for x in v if x is not None]) for v in times.values())}); "
          f"io_threads={r['io_threads']}\n")
    print("| method | time | throughput |\n|---|---|---|")
    for m, s in t.items():
        print(f"| {LABELS[m]} | {fmt(s, '.3f', ' s')} | {fmt(ratio(n, s) and n / s / 1e9, '.2f', ' GB/s')} |")
    print("\n| ratio | value | target |\n|---|---|---|")
    rows = [
        ("restore throughput / raw read (prefaulted buffer)", ratio(t.get("raw_prefaulted"), t.get("ours")), ">= 0.85"),
        ("restore throughput / raw read (fresh buffer)", ratio(t.get("raw_fresh"), t.get("ours")), ""),
        ("verified copy throughput / raw read (prefaulted buffer): what this machine allows",
         ratio(t.get("raw_prefaulted"), t.get("verified_copy")), ""),
        ("restore throughput / verified copy: the restore's own costs", ratio(t.get("verified_copy"), t.get("ours")), ""),
        ("restore time / (torch.load + load_state_dict)", ratio(t.get("ours"), t.get("torch_load")), "< 1"),
        ("restore time / dcp.load", ratio(t.get("ours"), t.get("dcp_load")), ""),
        ("in-place restore time / copying restore time", ratio(t.get("ours"), t.get("ours_copying")), ""),
        ("the --compare tree's restore throughput / raw read (prefaulted buffer)",
         ratio(t.get("raw_prefaulted"), t.get("ours_compare")), ""),
    ]
    for name, v, target in rows:
        print(f"| {name} | {fmt(v, '.2f')} | {target} |")
    raw = times.get("raw_prefaulted", [])
    # How far the rounds let the ratio move: the disk of a shared VM can move by more than the gap measured.
    for m in ("ours", "ours_compare"):
        if raw and times.get(m):
            iv = ratio_interval(raw, times[m])
            shown = f"{iv[0]:.2f}-{iv[1]:.2f}" if iv else "n/a"
            print(f"\n{LABELS[m]}: throughput / raw read, 95% bootstrap interval over the rounds {shown}; "
                  f"against >= 0.85: {against_target(iv, 0.85)}")
            print(f"raw read over the rounds: {spread(raw)}; {m}: {spread(times[m])}")
    if raw and times.get("ours_compare"):  # round by round: the two trees met the same disk in each
        for m in ("ours", "ours_compare"):
            print(f"\nper round, raw read / {m}: " + " ".join(
                f"{a / b:.2f}" if a is not None and b else "failed" for a, b in zip(raw, times.get(m, []))))


def main() -> None:
    os.environ["RSLURM_AUTO_CADENCE"] = "off"  # the one save is the bench's own
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--io-threads", type=int, default=4)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="where the restored state lives: cuda restores into a model and Adam on the GPU (the "
                         "bytes are read into pinned memory and copied on a side stream); the raw reads stay host reads")
    ap.add_argument("--modes", type=lambda s: tuple(s.split(",")), default=MODES)
    ap.add_argument("--dir", default=None, help="where to write (default: the temporary directory)")
    ap.add_argument("--hog", action="store_true", help="also measure each method with a CPU hog on one core")
    ap.add_argument("--compare", default=None, metavar="TREE",
                    help="also restore with the project checked out at TREE (mode ours_compare, added to --modes)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--expect", default="", help=argparse.SUPPRESS)
    add_wait_quiet_arg(ap)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    if "ours_compare" in args.modes and not args.compare:
        ap.error("mode ours_compare restores with another checkout: give it with --compare TREE")
    if args.compare:
        if not os.path.isfile(os.path.join(args.compare, "bench", "bench_restore.py")):
            ap.error(f"--compare {args.compare}: not a checkout of the project (no bench/bench_restore.py there)")
        args.modes = (*(m for m in args.modes if m != "ours_compare"), "ours_compare")
    t0 = now()
    r = run(args)
    report(r)
    print(f"\nwall time {now() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
