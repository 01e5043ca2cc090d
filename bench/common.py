"""Helpers shared by the benchmark scripts of this folder; not a benchmark itself.

The scripts import it as a top-level module (``from common import ...``), as they imported each other before:
a script's own folder is first on ``sys.path`` when it runs as ``python bench/<script>.py``, and the scripts
also put this folder and the repository root on ``sys.path`` themselves. This module does not import
``resilient_slurm``, so a script may import it before the repository root is on ``sys.path``.

What is here: timing and formatting (``now``, ``med``, ``ratio``, ``fmt``, ``log``); reading logs (``read_jsonl``,
``tail``); machine and noise facts
(``cpu_sample``, ``foreign_load``, ``wait_quiet``, ``machine_facts``, ``git_facts``); page-cache dropping
(``Cache``); the transformer-shaped model + Adam state every benchmark measures (``build_state`` and its
helpers); the raw I/O baselines (``page_buffer``, ``raw_write``, ``buffered_write``, ``raw_read``,
``torch_save_fsync``); and what the scripts' ``Bench`` classes and ``main`` functions share (``BenchBase``,
``run_main``, ``add_wait_quiet_arg``).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import gc
import glob
import hashlib
import json
import mmap
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

# Every benchmark process runs with warnings off (DCP warns about no_dist / experimental async on every call).
warnings.filterwarnings("ignore")

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

IO_CHUNK = 16 << 20
BLOCK = 4096
O_DIRECT = getattr(os, "O_DIRECT", 0)
GB = 1e9
MiB = 2**20

# --------------------------------------------------------------------------------------------- timing, report


def now() -> float:
    return time.perf_counter()


def med(xs: list[Any]) -> float | None:
    """Median of the values that are not None; None if there are none."""
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def ratio_interval(num: list[float], den: list[float], *, resamples: int = 2000, level: float = 0.95,
                   seed: int = 0) -> tuple[float, float] | None:
    """A bootstrap interval of ``median(num) / median(den)``: the rounds are resampled with replacement
    (``num[i]`` and ``den[i]`` measured in the same round stay together, so drift that hit both hits both
    again), the ratio of medians taken each time, and the central ``level`` of those ratios returned. None
    with fewer than three rounds. On a machine whose disk moves from round to round the interval is wide,
    and a ratio that seems to meet a target may not."""
    pairs = [(a, b) for a, b in zip(num, den) if a is not None and b]
    if len(pairs) < 3:
        return None
    rng = random.Random(seed)
    got = sorted(statistics.median(a for a, _ in draw) / statistics.median(b for _, b in draw)
                 for draw in ([rng.choice(pairs) for _ in pairs] for _ in range(resamples)))
    cut = int(resamples * (1 - level) / 2)
    return got[cut], got[resamples - 1 - cut]


def against_target(interval: tuple[float, float] | None, target: float) -> str:
    """What an interval of a ratio says of ``ratio >= target``: met, missed, or not told apart here."""
    if interval is None:
        return "too few rounds to say"
    lo, hi = interval
    if lo >= target:
        return "met"
    if hi < target:
        return "missed"
    return "not told apart from the target on this machine (more rounds, or a quieter disk)"


def fmt(v: float | None, spec: str, suffix: str = "") -> str:
    """``v`` formatted with ``spec``, then ``suffix``; "n/a" for None."""
    return "n/a" if v is None else format(v, spec) + suffix


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------- logs


def read_jsonl(path: str) -> list[dict[str, Any]]:
    """A JSON-lines file's records (none when it is missing); torn or malformed lines are skipped (a
    writer may have been SIGKILLed mid-line)."""
    out = []
    with contextlib.suppress(FileNotFoundError), open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                with contextlib.suppress(json.JSONDecodeError):
                    out.append(json.loads(line))
    return out


def tail(path: str, n: int = 4000) -> str:
    """The last ``n`` characters of a text file (a job's output), for a PROBLEM report."""
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return f"({path} unreadable)"


# --------------------------------------------------------------------------------------------- machine


def release_memory() -> None:
    """Free what the previous phase left behind (Python objects, then glibc's free lists)."""
    gc.collect()
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def cpu_sample() -> tuple[float, float, float]:
    """(busy CPU seconds of the whole machine, this process's CPU seconds, wall) for noise accounting."""
    hz = os.sysconf("SC_CLK_TCK")
    with open("/proc/stat") as f:
        vals = [int(v) for v in f.readline().split()[1:]]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
    busy = (sum(vals[:8]) - idle) / hz
    t = os.times()
    return busy, t.user + t.system, now()


def foreign_load(a: tuple[float, float, float], b: tuple[float, float, float]) -> float:
    """Average number of cores other processes kept busy between two samples."""
    wall = max(b[2] - a[2], 1e-9)
    return max(0.0, ((b[0] - a[0]) - (b[1] - a[1])) / wall)


def wait_quiet(limit_s: float, cores: float = 0.3) -> None:
    """Wait (at most ``limit_s``) until other processes use less than ``cores`` CPUs over 3 s."""
    t_end = now() + limit_s
    while True:
        a = cpu_sample()
        time.sleep(3)
        load = foreign_load(a, cpu_sample())
        if load < cores or now() > t_end:
            log(f"other processes use {load:.2f} cores; starting")
            return


def remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    os.sync()


def scratch_dir(where: str | None, prefix: str) -> str:
    """A new directory whose name starts with ``prefix`` under ``where`` (a benchmark's ``--dir``; default: the
    temporary directory), made first where it does not exist yet: a ``--dir`` not made yet is made, not a
    FileNotFoundError."""
    base = where or tempfile.gettempdir()
    os.makedirs(base, exist_ok=True)
    return tempfile.mkdtemp(prefix=prefix, dir=base)


def free_port() -> int:
    """A loopback port outside the kernel's ephemeral range (the product's rule for its own listeners)."""
    from resilient_slurm.rendezvous import (
        free_port as product_free_port,  # the caller has put the repo on sys.path
    )

    return product_free_port(range(8000, 15000))


def fs_type(path: str) -> str:
    path = os.path.realpath(path)
    best, kind, dev = "", "?", "?"
    with open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) < 3:
                continue
            mnt = parts[1].replace("\\040", " ")
            if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                best, kind, dev = mnt, parts[2], parts[0]
    return f"{kind} ({dev} on {best})"


def machine_facts(target: str) -> dict[str, Any]:
    mem = 0
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
    cpu = platform.processor() or "?"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    st = os.statvfs(target)
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_gib": round(mem / 2**30, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "target_dir": target,
        "filesystem": fs_type(target),
        "free_gib": round(st.f_bavail * st.f_frsize / 2**30, 1),
        "loadavg_at_start": os.getloadavg()[0],
    }


def git_facts() -> dict[str, Any]:
    """HEAD, and a digest of the library's working-tree sources: the code the launched processes import."""
    def git(*a: str) -> str:
        cp = subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True, timeout=30)
        return cp.stdout.strip()

    out: dict[str, Any] = {}
    with contextlib.suppress(Exception):
        out = {"head": git("rev-parse", "--short", "HEAD"),
               "dirty_files_in_resilient_slurm": len(git("status", "--porcelain", "resilient_slurm").splitlines())}
    h = hashlib.sha256()
    for path in sorted(glob.glob(os.path.join(REPO, "resilient_slurm", "**", "*.py"), recursive=True)):
        with contextlib.suppress(OSError), open(path, "rb") as f:
            h.update(path.encode() + b"\0" + f.read())
    out["sources_sha256"] = h.hexdigest()[:16]
    return out


class Cache:
    """Drops the page cache: globally when allowed, else per file with posix_fadvise(DONTNEED)."""

    def __init__(self) -> None:
        self.method = "drop_caches"
        try:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
        except OSError:
            self.method = "fadvise"

    def drop(self, *paths: str) -> None:
        os.sync()
        if self.method == "drop_caches":
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
            return
        for p in paths:
            for f in _files(p):
                with contextlib.suppress(OSError):
                    fd = os.open(f, os.O_RDONLY)
                    try:
                        os.fdatasync(fd)
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    finally:
                        os.close(fd)

    @property
    def note(self) -> str:
        if self.method == "drop_caches":
            return "page cache dropped before each read (echo 3 > /proc/sys/vm/drop_caches)"
        return ("not root: page cache evicted per file with posix_fadvise(DONTNEED); buffered reads "
                "(torch.load, dcp.load) may still hit cached pages")


def _files(path: str) -> Iterator[str]:
    if os.path.isfile(path):
        yield path
        return
    for root, _, names in os.walk(path):
        for n in names:
            yield os.path.join(root, n)


# --------------------------------------------------------------------------------------------- state


class Block(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(d)
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.proj = torch.nn.Linear(d, d)
        self.ln2 = torch.nn.LayerNorm(d)
        self.up = torch.nn.Linear(d, 4 * d)
        self.down = torch.nn.Linear(4 * d, d)


class TinyLM(torch.nn.Module):
    """Transformer-shaped parameters (never run forward): big embedding/head, 4 Linears + 2 LNs a layer."""

    def __init__(self, vocab: int, d: int, layers: int, ctx: int) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Embedding(ctx, d)
        self.blocks = torch.nn.ModuleList(Block(d) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab, bias=False)


def shape_for(total_bytes: int) -> tuple[int, int, int, int]:
    """(vocab, d, layers, ctx) whose params + 2 Adam moments (fp32) come to about ``total_bytes``."""
    params = total_bytes // 12  # 4 bytes each, three copies (param, exp_avg, exp_avg_sq)
    for d in (1024, 768, 512, 256, 128, 64):
        ctx = min(1024, 4 * d)
        per_layer = 12 * d * d + 13 * d
        fixed = ctx * d + 2 * d
        min_vocab = 2048
        layers = (params - fixed - 2 * min_vocab * d) // per_layer
        if layers >= 2 or d == 64:
            layers = max(1, layers)
            vocab = max(min_vocab, (params - fixed - layers * per_layer) // (2 * d))
            return vocab, d, layers, ctx
    raise AssertionError("unreachable")


def build_state(total_bytes: int, seed: int, device: str = "cpu") -> tuple[TinyLM, torch.optim.Adam]:
    """Model + Adam with exp_avg/exp_avg_sq materialized by one optimizer step, on ``device``."""
    torch.manual_seed(seed)
    vocab, d, layers, ctx = shape_for(total_bytes)
    with torch.no_grad():
        model = TinyLM(vocab, d, layers, ctx).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p).mul_(1e-2)
    opt.step()
    for p in model.parameters():
        p.grad = None
    return model, opt


def state_dict_of(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def tensors_of(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors_of(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors_of(v)


def describe(sd: dict[str, Any]) -> dict[str, Any]:
    ts = list(tensors_of(sd))
    sizes = sorted((t.numel() * t.element_size() for t in ts), reverse=True)
    return {
        "tensors": len(ts),
        "bytes": sum(sizes),
        "params_bytes": sum(t.numel() * t.element_size() for t in tensors_of(sd["model"])),
        "largest_mib": round(sizes[0] / MiB, 1),
        "tensors_over_10mib": sum(1 for s in sizes if s >= 10 * MiB),
        "tensors_under_64kib": sum(1 for s in sizes if s < 64 * 1024),
    }


def same_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    ta, tb = list(tensors_of(a)), list(tensors_of(b))
    return len(ta) == len(tb) and all(torch.equal(x, y) for x, y in zip(ta, tb))


# --------------------------------------------------------------------------------------------- raw I/O


def page_buffer(nbytes: int) -> tuple[mmap.mmap, memoryview]:
    """Page-aligned anonymous buffer, every page faulted in.

    Transparent huge pages, like the engine's own buffers: O_DIRECT pins every page of the user buffer,
    and with 4 KiB pages that pinning, not the disk, can be what limits the "raw" figure.
    """
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):
            mm.madvise(mmap.MADV_HUGEPAGE)
    mv = memoryview(mm)
    for off in range(0, nbytes, IO_CHUNK):
        n = min(IO_CHUNK, nbytes - off)
        mv[off : off + n] = b"\x5a" * n
    return mm, mv


def fill_from_state(mv: memoryview, sd: dict[str, Any]) -> None:
    """Put the state's own bytes in the buffer (non-zero, incompressible-ish data)."""
    off = 0
    for t in tensors_of(sd):
        b = memoryview(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())  # a GPU tensor too
        n = min(len(b), len(mv) - off)
        mv[off : off + n] = b[:n]
        off += n


def open_direct(path: str, flags: int) -> tuple[int, bool]:
    if O_DIRECT:
        try:
            return os.open(path, flags | O_DIRECT, 0o600), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    return os.open(path, flags, 0o600), False


def _write_all(fd: int, mv: memoryview, threads: int) -> None:
    """``mv`` into ``fd`` in IO_CHUNK pwrites, from ``threads`` threads, then fsync."""
    def put(off: int) -> None:
        v = mv[off : off + IO_CHUNK]
        done = 0
        while done < len(v):
            done += os.pwrite(fd, v[done:], off + done)

    offs = range(0, len(mv), IO_CHUNK)
    if threads <= 1:
        for off in offs:
            put(off)
    else:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(put, offs))
    os.fsync(fd)


def raw_write(path: str, mv: memoryview, threads: int) -> tuple[float, bool]:
    """(seconds, whether O_DIRECT was used) to write ``mv`` into ``path`` with O_DIRECT where the filesystem
    allows it (buffered otherwise), fsync included."""
    t0 = now()
    fd, direct = open_direct(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        _write_all(fd, mv, threads)
    finally:
        os.close(fd)
    return now() - t0, direct


def buffered_write(path: str, mv: memoryview, threads: int) -> float:
    """Buffered 16 MiB pwrites from memory, then fsync (the I/O path PosixTier uses)."""
    t0 = now()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        _write_all(fd, mv, threads)
    finally:
        os.close(fd)
    return now() - t0


def raw_read(path: str, mv: memoryview, threads: int) -> tuple[float, bool]:
    t0 = now()
    fd, direct = open_direct(path, os.O_RDONLY)
    try:
        def get(off: int) -> int:
            v = mv[off : off + IO_CHUNK]
            got = 0
            while got < len(v):
                r = os.preadv(fd, [v[got:]], off + got)
                if r == 0:
                    break
                got += r
            return got

        offs = range(0, len(mv), IO_CHUNK)
        if threads <= 1:
            total = sum(get(o) for o in offs)
        else:
            with ThreadPoolExecutor(threads) as pool:
                total = sum(pool.map(get, offs))
        assert total == len(mv), f"short read {total} of {len(mv)}"
    finally:
        os.close(fd)
    return now() - t0, direct


def torch_save_fsync(path: str, sd: dict[str, Any]) -> float:
    """Seconds to ``torch.save`` ``sd`` into a new file ``path``, flush and fsync it."""
    t0 = now()
    with open(path, "wb") as f:
        torch.save(sd, f)
        f.flush()
        os.fsync(f.fileno())
    return now() - t0


def best_gbps(raw: dict[str, Any], kind: str) -> float | None:
    """The best raw ``kind`` ("write", "read") bandwidth in GB/s over the thread counts of ``raw``
    (``raw["<kind>_t<threads>_s"]``: lists of seconds for ``raw["bytes"]``); None if none was measured."""
    bws = [raw["bytes"] / med(v) / GB for k, v in raw.items() if k.startswith(kind + "_t")]
    return max(bws) if bws else None


# --------------------------------------------------------------------------------------------- Bench, main


class BenchBase:
    """What the benchmarks' ``Bench`` classes share. A subclass sets ``self.r`` (a dict with an "errors"
    dict), and for the raw baselines ``self.model``, ``self.opt`` and ``self.nbytes``."""

    r: dict[str, Any]
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    nbytes: int

    def __init__(self, args: argparse.Namespace, prefix: str) -> None:
        """``args.repeats``, and a fresh run directory ``self.root`` under ``args.dir`` (default: the
        temporary directory) whose name starts with ``prefix``."""
        self.args = args
        self.repeats = max(1, args.repeats)
        self.root = scratch_dir(args.dir, prefix)
        self.raw_buf: tuple[mmap.mmap, memoryview] | None = None

    log = staticmethod(log)

    def add(self, section: str, key: str, value: Any) -> None:
        self.r.setdefault(section, {}).setdefault(key, []).append(value)

    def check_free(self, need: int) -> None:
        """Exit unless ``r["machine"]`` says ``need`` bytes are free under the run directory."""
        if self.r["machine"]["free_gib"] * 2**30 < need:
            raise SystemExit(f"{self.root}: needs ~{need / 2**30:.1f} GiB free for this size")

    def guarded(self, name: str, fn: Callable[[], None], done: Callable[[float, float | None], None], *,
                error_list: bool = False, cpu_load: bool = True) -> None:
        """Run ``fn``. An exception is printed and recorded as ``r["errors"][name]`` (appended to a list
        there with ``error_list``), not raised: one broken method must not hide the others. Then, always:
        with ``cpu_load``, the cores other processes kept busy meanwhile are appended to
        ``r["foreign_cpu_load"][name]``; memory is released; ``done(seconds, load)`` is called (load None
        without ``cpu_load``)."""
        c0 = cpu_sample() if cpu_load else None
        t0 = now()
        try:
            fn()
        except Exception as exc:
            traceback.print_exc()
            msg = f"{type(exc).__name__}: {exc}"
            if error_list:
                self.r["errors"].setdefault(name, []).append(msg)
            else:
                self.r["errors"][name] = msg
        finally:
            load = None
            if c0 is not None:
                load = foreign_load(c0, cpu_sample())
                self.r.setdefault("foreign_cpu_load", {}).setdefault(name, []).append(round(load, 2))
            release_memory()
            done(now() - t0, load)

    def raw_buffer(self) -> memoryview:
        """The raw baselines' buffer: page-aligned, the state's bytes rounded up to BLOCK (made once)."""
        if self.raw_buf is None:
            self.raw_buf = page_buffer(-(-self.nbytes // BLOCK) * BLOCK)
            fill_from_state(self.raw_buf[1], state_dict_of(self.model, self.opt))
        return self.raw_buf[1]

    def free_raw_buffer(self) -> None:
        if self.raw_buf is not None:
            mm, mv = self.raw_buf
            mv.release()
            mm.close()
            self.raw_buf = None

    def run(self) -> dict[str, Any]:
        raise NotImplementedError


def add_wait_quiet_arg(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--wait-quiet", type=float, default=0.0, metavar="S",
                    help="first wait up to S seconds for other processes to leave the CPUs idle")


def run_main(args: argparse.Namespace, bench: Callable[[argparse.Namespace], BenchBase],
             print_report: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """A benchmark's run: wait for a quiet machine if ``--wait-quiet`` asks, ``bench(args).run()``, print the
    report and the total wall time, write ``--json``. Returns the results."""
    t0 = now()
    if args.wait_quiet > 0:
        wait_quiet(args.wait_quiet)
    r = bench(args).run()
    r["wall_s"] = now() - t0
    print_report(r)
    print(f"\n(total benchmark wall time {r['wall_s']:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2, default=str)
    return r
