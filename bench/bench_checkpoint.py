"""Checkpoint benchmark: our Checkpointer against the storage and against torch.save / DCP, in one run.

    .venv/bin/python bench/bench_checkpoint.py [--size-gib 1.0] [--dir DIR] [--repeats 3] [--json OUT]

Every phase runs in this process, one after the other, against the same target directory (a fresh
sub-directory of --dir, default /tmp, removed at the end). State building is never timed. Before every
read the page cache is dropped (``/proc/sys/vm/drop_caches`` as root, else ``posix_fadvise(DONTNEED)``
on the files written, which is weaker: say so in the report). Times are medians over ``--repeats``;
first saves (buffer allocation) are reported apart from steady-state saves. See bench/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import mmap
import os
import shutil
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import xxhash

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import (  # noqa: E402
    GB,
    BenchBase,
    Cache,
    add_wait_quiet_arg,
    best_gbps,
    build_state,
    describe,
    fmt,
    machine_facts,
    med,
    now,
    ratio,
    raw_read,
    raw_write,
    release_memory,
    remove,
    run_main,
    same_state,
    state_dict_of,
    tensors_of,
    torch_save_fsync,
)

from resilient_slurm import Checkpointer  # noqa: E402
from resilient_slurm.checkpoint import apply as apply_mod  # noqa: E402
from resilient_slurm.checkpoint import engine as engine_mod  # noqa: E402
from resilient_slurm.checkpoint import restore_round as round_mod  # noqa: E402
from resilient_slurm.checkpoint import state as state_mod  # noqa: E402
from resilient_slurm.storage import fileio  # noqa: E402

# --------------------------------------------------------------------------------------------- phases


class Bench(BenchBase):
    def __init__(self, args: argparse.Namespace) -> None:
        self.threads = args.io_threads
        super().__init__(args, "rslurm-bench-")
        self.cache = Cache()
        self.r: dict[str, Any] = {"errors": {}}
        self.notes: list[str] = [self.cache.note]
        self.ck: Checkpointer | None = None
        self.dcp_stager: Any = None
        self.ours_step = 0

    def phase(self, name: str, fn: Callable[[], None]) -> None:
        self.log(f"phase {name} ...")

        def done(dt: float, load: float | None) -> None:
            self.log(f"phase {name} done in {dt:.1f}s (other processes kept {load:.2f} cores busy)")

        self.guarded(name, fn, done)  # keep going: one broken baseline must not hide the others

    # ---------------------------------------------------------------- setup
    def setup(self) -> None:
        want = int(self.args.size_gib * 2**30)
        self.log(f"building state of ~{want / 2**30:.2f} GiB (untimed) ...")
        self.model, self.opt = build_state(want, seed=1, device=self.args.device)
        self.fresh_model, self.fresh_opt = build_state(want, seed=2, device=self.args.device)  # other values
        sd = state_dict_of(self.model, self.opt)
        self.r["state"] = describe(sd)
        self.nbytes = self.r["state"]["bytes"]
        self.r["machine"] = machine_facts(self.root)
        self.check_free(4 * self.nbytes + (256 << 20))

    def state_dict(self) -> dict[str, Any]:
        return state_dict_of(self.model, self.opt)

    def scramble_fresh(self) -> None:
        """Make the restore target differ from the saved state again (untimed)."""
        with torch.no_grad():
            for t in tensors_of(state_dict_of(self.fresh_model, self.fresh_opt)):
                if t.is_floating_point() and t.dim() > 0:
                    t.fill_(0.5)

    # ---------------------------------------------------------------- micro: the floors
    def micro(self) -> None:
        n = min(self.nbytes, 256 << 20)
        src = torch.empty(n, dtype=torch.uint8).fill_(7)
        dst = fileio.aligned_buffer(n)
        copies = []
        for _ in range(3):
            t0 = now()
            dst[:n].copy_(src)
            copies.append(now() - t0)
        mm = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        fresh = torch.frombuffer(mm, dtype=torch.uint8)
        t0 = now()
        fresh.zero_()
        touch = now() - t0
        del fresh
        mm.close()
        mv = memoryview(src.numpy())
        hashes = []
        for _ in range(3):
            t0 = now()
            xxhash.xxh3_64_hexdigest(mv)
            hashes.append(now() - t0)
        # Does xxhash release the GIL? Two threads hashing at once vs one after the other.
        half = n // 2
        t0 = now()
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda v: xxhash.xxh3_64_hexdigest(v), [mv[:half], mv[half:]]))
        par = now() - t0
        self.r["micro"] = {
            "bytes": n,
            "memcpy_gbps": n / min(copies) / GB,
            "first_touch_gbps": n / touch / GB,
            "xxh3_gbps": n / min(hashes) / GB,
            "xxh3_2threads_speedup": min(hashes) / par,
        }

    # ---------------------------------------------------------------- interleaved rounds
    # Each round runs every method once (order rotated per round), so load from other processes on a
    # shared machine spreads over all methods instead of skewing whichever phase it happened to hit.
    def measured(self, method: str, fn: Callable[[int], None], i: int) -> None:
        if method in self.r["errors"]:
            return

        def done(dt: float, load: float | None) -> None:
            self.log(f"round {i} {method}: {dt:.1f}s (other processes kept {load:.2f} cores busy)")

        self.guarded(method, lambda: fn(i), done)  # keep going: one broken method must not hide the others

    # ---------------------------------------------------------------- raw device
    def raw_round(self, i: int) -> None:
        mv = self.raw_buffer()
        n = len(mv)
        path = os.path.join(self.root, "raw.bin")
        for threads in sorted({1, self.threads}):
            remove(path)
            dt, direct = raw_write(path, mv, threads)
            self.add("raw", f"write_t{threads}_s", dt)
            self.cache.drop(path)
            dt, _ = raw_read(path, mv, threads)
            self.add("raw", f"read_t{threads}_s", dt)
        remove(path)
        self.r["raw"]["bytes"] = n
        self.r["raw"]["o_direct"] = direct

    # ---------------------------------------------------------------- torch.save / torch.load
    def torch_round(self, i: int) -> None:
        path = os.path.join(self.root, "torch_save.pt")
        remove(path)
        sd = self.state_dict()
        self.add("torch", "save_fsync_s", torch_save_fsync(path, sd))
        del sd
        self.r["torch"]["file_bytes"] = os.path.getsize(path)
        self.cache.drop(path)
        self.scramble_fresh()
        t0 = now()
        loaded = torch.load(path, map_location="cpu", weights_only=True)
        t1 = now()
        self.fresh_model.load_state_dict(loaded["model"])
        self.fresh_opt.load_state_dict(loaded["optim"])
        t2 = now()
        self.add("torch", "load_s", t1 - t0)
        self.add("torch", "load_and_apply_s", t2 - t0)
        if i == 0:
            self.r.setdefault("verified", {})["torch.load"] = same_state(
                self.state_dict(), state_dict_of(self.fresh_model, self.fresh_opt)
            )
        del loaded
        remove(path)

    # ---------------------------------------------------------------- DCP
    def dcp_round(self, i: int) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

        out = self.r.setdefault("dcp", {})
        out["writer"] = "FileSystemWriter(thread_count=1, sync_files=True) (defaults)"
        d = os.path.join(self.root, f"dcp_sync_{i}")
        sd = self.state_dict()
        t0 = now()
        dcp.save(sd, storage_writer=FileSystemWriter(d), no_dist=True)
        self.add("dcp", "save_s", now() - t0)
        del sd
        self.cache.drop(d)
        self.scramble_fresh()
        target = state_dict_of(self.fresh_model, self.fresh_opt)
        t0 = now()
        dcp.load(target, storage_reader=FileSystemReader(d), no_dist=True)
        self.fresh_opt.load_state_dict(target["optim"])  # model tensors were loaded in place
        self.add("dcp", "load_s", now() - t0)
        if i == 0:
            self.r.setdefault("verified", {})["dcp.load"] = same_state(
                self.state_dict(), state_dict_of(self.fresh_model, self.fresh_opt)
            )
        del target
        remove(d)

        # async_save with a reused stager: it caches its CPU copy across saves, like our staging buffer.
        if i == 0:
            try:
                from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

                self.dcp_new_stager = lambda: DefaultStager(StagingOptions(False, False, False, False))
                self.dcp_stager = self.dcp_new_stager()
                self.dcp_fresh_stager = False  # set when reusing one fails (torch 2.11, state on a GPU)
                out["async_stager"] = "DefaultStager(no pin, no shm, sync staging), reused across saves"
            except Exception:  # older torch: the writer stages (allocates a fresh copy every time)
                self.dcp_stager = None
                out["async_stager"] = "FileSystemWriter.stage (fresh CPU copy per save)"
        for first in ([True, False] if i == 0 else [False]):
            d = os.path.join(self.root, f"dcp_async_{i}_{int(first)}")
            sd = self.state_dict()
            if self.dcp_stager is not None and self.dcp_fresh_stager:
                self.renew_dcp_stager()
            kw: dict[str, Any] = {"async_stager": self.dcp_stager} if self.dcp_stager is not None else {}
            t0 = now()
            try:
                fut = dcp.async_save(sd, storage_writer=FileSystemWriter(d), no_dist=True, **kw)
            except KeyError as exc:  # torch 2.11, state on a GPU: a reused DefaultStager fails its second save
                if first or self.dcp_stager is None:
                    raise
                out["async_stager"] = (f"DefaultStager(no pin, no shm, sync staging), a fresh one per save: reusing "
                                       f"one failed its second save (KeyError {exc})")
                self.dcp_fresh_stager = True
                self.renew_dcp_stager()
                remove(d)
                t0 = now()
                fut = dcp.async_save(sd, storage_writer=FileSystemWriter(d), no_dist=True,
                                     async_stager=self.dcp_stager)
            t1 = now()
            fut = getattr(fut, "upload_completion", fut)
            fut.result()
            t2 = now()
            if first:
                out["async_first_stall_s"] = t1 - t0
                out["async_first_done_s"] = t2 - t0
            else:
                self.add("dcp", "async_stall_s", t1 - t0)
                self.add("dcp", "async_done_s", t2 - t0)
            del sd, fut
            remove(d)

    def renew_dcp_stager(self) -> None:
        """Close the DCP stager and make a fresh one (a reused one fails on torch 2.11 with GPU state)."""
        with contextlib.suppress(Exception):
            self.dcp_stager.close()
        self.dcp_stager = self.dcp_new_stager()

    # ---------------------------------------------------------------- ours
    def ours_round(self, i: int) -> None:
        local = os.path.join(self.root, "ours")
        state = {"model": self.model, "optim": self.opt}
        if self.ck is None:
            self.ck = Checkpointer(local_dir=local, run_id="bench", keep_last=2, io_threads=self.threads)
        for first in ([True, False] if i == 0 else [False]):
            release_memory()
            self.ours_step += 1
            t0 = now()
            self.ck.save(self.ours_step, state, blocking=False)
            t1 = now()
            stall = self.ck.last_stall_s
            outcome = self.ck.wait()
            t2 = now()
            assert outcome is not None
            rec = {
                "stall_s": stall,
                "save_return_s": t1 - t0,
                "commit_s": t2 - t0,
                "write_s": outcome.write_s,
                "commit_phase_s": outcome.commit_s,
                "bytes_written": outcome.bytes_written,
            }
            if first:
                self.r.setdefault("ours", {})["first"] = rec
            else:
                self.add("ours", "steady", rec)
            self.r["ours"]["shard_bytes"] = outcome.bytes_written
        self.scramble_fresh()
        self.cache.drop(local)
        ck2 = Checkpointer(local_dir=local, run_id="bench", keep_last=2, io_threads=self.threads)
        fresh = {"model": self.fresh_model, "optim": self.fresh_opt}
        t0 = now()
        step = ck2.restore(fresh)
        self.add("ours", "restore_s", now() - t0)
        ck2.close()
        if step != self.ours_step:
            raise RuntimeError(f"restore returned step {step}, expected {self.ours_step}")
        if i == 0:
            self.r.setdefault("verified", {})["ours"] = same_state(
                self.state_dict(), state_dict_of(self.fresh_model, self.fresh_opt)
            )

    def teardown(self) -> None:
        if self.ck is not None:
            with contextlib.suppress(Exception):
                self.ck.close()
            self.ck = None
        if self.dcp_stager is not None:
            with contextlib.suppress(Exception):
                self.dcp_stager.close()
            self.dcp_stager = None
        self.free_raw_buffer()
        remove(os.path.join(self.root, "ours"))
        release_memory()
        raw = self.r.get("raw", {})
        for kind in ("write", "read"):
            bw = best_gbps(raw, kind)
            if bw is not None:
                raw[f"{kind}_gbps"] = bw
        if raw and not raw.get("o_direct", True):
            self.notes.append("O_DIRECT refused by the target filesystem: raw numbers are buffered I/O + fsync")

    # ---------------------------------------------------------------- where our time goes
    def breakdown(self) -> None:
        """Three saves (first, steady, steady with retention) and one restore with timers wrapped around
        the engine's parts, and the minor page faults of each. Not used in the ratios."""
        import resource

        from resilient_slurm.checkpoint import planning as planning_mod
        from resilient_slurm.checkpoint import staging as staging_mod

        local = os.path.join(self.root, "ours")
        acc: dict[str, float] = {}
        cnt: dict[str, int] = {}
        patches: list[tuple[Any, str, Any]] = []

        order: list[str] = []
        kind = {"now": "save"}

        def wrap(owner: Any, name: str, label: str, only: str) -> None:
            orig = getattr(owner, name)
            order.append(label)

            def timed(*a: Any, **k: Any) -> Any:
                t0 = now()
                try:
                    return orig(*a, **k)
                finally:
                    if kind["now"] == only:
                        acc[label] = acc.get(label, 0.0) + now() - t0
                        cnt[label] = cnt.get(label, 0) + 1

            patches.append((owner, name, orig))
            setattr(owner, name, timed)

        E = engine_mod.Engine
        S = "save"
        R = "restore"
        wrap(E, "stage", "stage (the stall, training thread)", S)
        wrap(E, "_plan", "  _plan (capture, plan, replication proofs)", S)
        wrap(engine_mod.state_mod, "build_state_dict", "    build_state_dict (state capture)", S)
        wrap(E, "_digests", "    _digests (replication proof: hashing)", S)
        wrap(staging_mod.StagingBuffer, "__init__", "  StagingBuffer alloc (aligned_buffer + framing)", S)
        wrap(engine_mod.StagingBuffer, "stage", "  StagingBuffer.stage (tensor copies)", S)
        wrap(E, "write_and_commit", "write_and_commit (writer thread)", S)
        wrap(engine_mod, "write_file", "  write_file (pwrite x io_threads, xxh3 beside, fsync)", S)
        wrap(E, "_prepare_domain", "  prepare_domain (shards checked, metadata, manifest, fsyncs)", S)
        wrap(E, "_install", "  install (the commit rename, fsync)", S)
        wrap(E, "apply_retention", "  apply_retention (delete old steps)", S)
        wrap(E, "restore", "restore (engine)", R)
        wrap(round_mod.StepReader, "read_round", "  read_round (open, compare, read, verify)", R)
        wrap(state_mod, "prepare_load_target", "    prepare_load_target", R)
        wrap(round_mod, "aligned_buffer", "    aligned_buffer (mmap + zero_ prefault)", R)
        wrap(round_mod, "read_spans", "    read_spans (O_DIRECT pread x io_threads)", R)
        wrap(engine_mod, "checksum", "    checksum (xxh3 per item, after the read)", R)
        wrap(apply_mod._Loaded, "apply", "  _Loaded.apply (copy into live tensors)", R)
        wrap(apply_mod._Loaded, "_stored_tensor", "    _stored_tensor (framing check, view)", R)
        wrap(planning_mod.SafeLoadPlanner, "load_bytes", "    load_bytes (plain values, torch.load inside)", R)
        wrap(engine_mod.torch, "load", "    torch.load (all calls: byte items + tensor fallbacks)", R)
        wrap(state_mod, "apply_loaded", "  apply_loaded (load_state_dict)", R)

        def faults() -> int:
            return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

        out: dict[str, Any] = {}

        def record(name: str, fn: Callable[[], None]) -> None:
            acc.clear()
            cnt.clear()
            f0 = faults()
            t0 = now()
            fn()
            parts = {k: acc[k] for k in order if k in acc}
            out[name] = {"wall_s": now() - t0, "minor_faults": faults() - f0, "parts_s": parts,
                         "calls": dict(cnt)}

        state = {"model": self.model, "optim": self.opt}
        try:
            ck = Checkpointer(local_dir=local, run_id="bench", keep_last=2, io_threads=self.threads)

            def save(step: int) -> Callable[[], None]:
                return lambda: (ck.save(step, state, blocking=False), ck.wait())  # type: ignore[func-returns-value]

            record("first save (allocates staging)", save(100))
            record("steady save", save(101))
            record("steady save + retention of 1 old step", save(102))
            ck.close()
            self.scramble_fresh()
            self.cache.drop(local)
            ck2 = Checkpointer(local_dir=local, run_id="bench", keep_last=2, io_threads=self.threads)
            kind["now"] = R
            record("restore", lambda: ck2.restore({"model": self.fresh_model, "optim": self.fresh_opt}))
            ck2.close()
        finally:
            for owner, name, orig in reversed(patches):
                setattr(owner, name, orig)
            remove(local)
        self.r["breakdown"] = out

    def run(self) -> dict[str, Any]:
        try:
            self.setup()
            self.phase("micro", self.micro)
            methods = [("raw", self.raw_round), ("torch", self.torch_round), ("dcp", self.dcp_round),
                       ("ours", self.ours_round)]
            try:
                for i in range(self.repeats):
                    k = i % len(methods)
                    for name, fn in methods[k:] + methods[:k]:
                        self.measured(name, fn, i)
            finally:
                self.teardown()
            if self.args.breakdown:
                self.phase("breakdown", self.breakdown)
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
        self.r["notes"] = self.notes
        self.r["config"] = {"size_gib": self.args.size_gib, "repeats": self.repeats, "io_threads": self.threads,
                            "device": self.args.device}
        if self.args.device.startswith("cuda"):
            self.r["config"]["gpu"] = torch.cuda.get_device_name(torch.device(self.args.device))
        self.r["summary"] = summarize(self.r)
        return self.r


# --------------------------------------------------------------------------------------------- report


def summarize(r: dict[str, Any]) -> dict[str, Any]:
    """Medians, throughputs and the target ratios (None where a phase failed)."""
    n = r["state"]["bytes"]
    s: dict[str, Any] = {"state_bytes": n}

    def get(*path: str) -> Any:
        cur: Any = r
        for p in path:
            if not isinstance(cur, dict) or p not in cur:
                return None
            cur = cur[p]
        return cur

    s["raw_write_gbps"] = get("raw", "write_gbps")
    s["raw_read_gbps"] = get("raw", "read_gbps")
    s["torch_save_fsync_s"] = med(get("torch", "save_fsync_s") or [])
    s["torch_load_s"] = med(get("torch", "load_s") or [])
    s["torch_load_apply_s"] = med(get("torch", "load_and_apply_s") or [])
    s["dcp_save_s"] = med(get("dcp", "save_s") or [])
    s["dcp_load_s"] = med(get("dcp", "load_s") or [])
    s["dcp_async_first_stall_s"] = get("dcp", "async_first_stall_s")
    s["dcp_async_stall_s"] = med(get("dcp", "async_stall_s") or [])
    s["dcp_async_done_s"] = med(get("dcp", "async_done_s") or [])
    steady = get("ours", "steady") or []
    s["ours_first_stall_s"] = get("ours", "first", "stall_s")
    s["ours_first_commit_s"] = get("ours", "first", "commit_s")
    s["ours_stall_s"] = med([x["stall_s"] for x in steady])
    s["ours_commit_s"] = med([x["commit_s"] for x in steady])
    s["ours_write_s"] = med([x["write_s"] for x in steady])
    s["ours_restore_s"] = med(get("ours", "restore_s") or [])
    s["ours_commit_gbps"] = ratio(n, s["ours_commit_s"]) and n / s["ours_commit_s"] / GB
    s["ours_restore_gbps"] = ratio(n, s["ours_restore_s"]) and n / s["ours_restore_s"] / GB
    s["ratios"] = {
        "stall / (torch.save+fsync)": {"value": ratio(s["ours_stall_s"], s["torch_save_fsync_s"]),
                                       "target": "<= 0.05", "ok": None},
        "commit throughput / raw write": {"value": ratio(s["ours_commit_gbps"], s["raw_write_gbps"]),
                                          "target": ">= 0.90", "ok": None},
        "restore throughput / raw read": {"value": ratio(s["ours_restore_gbps"], s["raw_read_gbps"]),
                                          "target": ">= 0.85", "ok": None},
    }
    for k, lim, le in (("stall / (torch.save+fsync)", 0.05, True),
                       ("commit throughput / raw write", 0.90, False),
                       ("restore throughput / raw read", 0.85, False)):
        v = s["ratios"][k]["value"]
        s["ratios"][k]["ok"] = None if v is None else (v <= lim if le else v >= lim)
    s["comparisons"] = {
        "our stall / dcp.async_save stall (steady)": ratio(s["ours_stall_s"], s["dcp_async_stall_s"]),
        "our first stall / dcp.async_save first stall": ratio(s["ours_first_stall_s"],
                                                              s["dcp_async_first_stall_s"]),
        "our commit / dcp.save": ratio(s["ours_commit_s"], s["dcp_save_s"]),
        "our commit / dcp.async_save done": ratio(s["ours_commit_s"], s["dcp_async_done_s"]),
        "our restore / dcp.load": ratio(s["ours_restore_s"], s["dcp_load_s"]),
        "our restore / torch.load": ratio(s["ours_restore_s"], s["torch_load_s"]),
        "our restore / (torch.load+load_state_dict)": ratio(s["ours_restore_s"], s["torch_load_apply_s"]),
    }
    return s


def fmt_bw(n: int, t: float | None) -> str:
    return "" if not t else f"{n / t / GB:6.2f} GB/s"


def print_report(r: dict[str, Any]) -> None:
    s = r["summary"]
    n = s["state_bytes"]
    m = r.get("machine", {})
    st = r["state"]
    print()
    print("== machine")
    print(f"  cpu {m.get('cpu')}, {m.get('usable_cores')}/{m.get('cores')} cores usable, "
          f"torch threads {m.get('torch_threads')}, memory {m.get('memory_gib')} GiB")
    print(f"  kernel {m.get('kernel')}, python {m.get('python')}, torch {m.get('torch')}")
    print(f"  1-min load average at start {m.get('loadavg_at_start', 0):.2f}")
    print(f"  target {m.get('target_dir')}: {m.get('filesystem')}, {m.get('free_gib')} GiB free")
    print("== state")
    print(f"  {n / 2**30:.3f} GiB in {st['tensors']} tensors (params {st['params_bytes'] / 2**30:.3f} GiB "
          f"+ Adam exp_avg/exp_avg_sq); largest {st['largest_mib']} MiB, {st['tensors_over_10mib']} >= 10 MiB, "
          f"{st['tensors_under_64kib']} < 64 KiB; repeats {r['config']['repeats']}, "
          f"io_threads {r['config']['io_threads']}")
    fl = r.get("foreign_cpu_load", {})
    if fl:
        worst = max(max(v) for v in fl.values())
        print("  CPU cores kept busy by other processes while measuring (per round): "
              + "; ".join(f"{k} {' '.join(f'{x:.2f}' for x in v)}" for k, v in fl.items())
              + ("  <- NOISY machine: compare ratios with care" if worst > 0.25 else ""))
    for note in r.get("notes", []):
        print(f"  note: {note}")
    if "micro" in r:
        mi = r["micro"]
        print(f"  memory: memcpy {mi['memcpy_gbps']:.2f} GB/s, first touch of fresh pages "
              f"{mi['first_touch_gbps']:.2f} GB/s, xxh3_64 {mi['xxh3_gbps']:.2f} GB/s/thread "
              f"(2 threads: x{mi['xxh3_2threads_speedup']:.2f})")
    print()
    print(f"{'measurement (median)':58s} {'time':>10s} {'throughput':>12s}")
    print("-" * 82)
    raw = r.get("raw", {})

    def row(label: str, t: float | None, bw: bool = True) -> None:
        print(f"{label:58s} {fmt(t, '8.3f', ' s'):>10s} {fmt_bw(n, t) if bw else '':>12s}")

    for k in sorted(raw):
        if k.endswith("_s") and isinstance(raw[k], list):
            kind, th = k.split("_")[0], k.split("_")[1][1:]
            mode = "O_DIRECT" if raw.get("o_direct") else "buffered"
            row(f"raw {mode} {kind}, {th} thread(s){' + fsync' if kind == 'write' else ''}", med(raw[k]))
    row("torch.save + fsync", s["torch_save_fsync_s"])
    row("torch.load (weights_only, cache dropped)", s["torch_load_s"])
    row("torch.load + load_state_dict", s["torch_load_apply_s"])
    row("dcp.save (FileSystemWriter)", s["dcp_save_s"])
    row("dcp.async_save: returns (stall), first", s["dcp_async_first_stall_s"], bw=False)
    row("dcp.async_save: returns (stall), steady", s["dcp_async_stall_s"], bw=False)
    row("dcp.async_save: future done, steady", s["dcp_async_done_s"])
    row("dcp.load + optimizer.load_state_dict", s["dcp_load_s"])
    row("ours: stall (last_stall_s), first save", s["ours_first_stall_s"], bw=False)
    row("ours: save -> wait() (local commit), first save", s["ours_first_commit_s"])
    row("ours: stall (last_stall_s), steady", s["ours_stall_s"], bw=False)
    row("ours: outcome.write_s, steady", s["ours_write_s"])
    row("ours: save -> wait() (local commit), steady", s["ours_commit_s"])
    row("ours: restore (cache dropped)", s["ours_restore_s"])
    print()
    print(f"{'target ratio':44s} {'value':>10s} {'target':>10s}  verdict")
    print("-" * 82)
    for k, v in s["ratios"].items():
        val = "n/a" if v["value"] is None else f"{v['value']:.3f}"
        verdict = "n/a" if v["ok"] is None else ("MET" if v["ok"] else "MISSED")
        print(f"{k:44s} {val:>10s} {v['target']:>10s}  {verdict}")
    print()
    print(f"{'comparison (ours / baseline, < 1 = ours faster)':58s} {'ratio':>10s}")
    print("-" * 82)
    for k, v in s["comparisons"].items():
        print(f"{k:58s} {'n/a' if v is None else f'{v:10.3f}':>10s}")
    if "verified" in r:
        print()
        print("restored state equals saved state: " + ", ".join(f"{k} {v}" for k, v in r["verified"].items()))
    if "breakdown" in r:
        print()
        print("== where our time goes: engine parts timed in one extra run (indented = inside the line above;")
        print("   the writer thread hashes (xxh3) beside its pwrite threads; not used in the ratios)")
        for name, b in r["breakdown"].items():
            print(f"  {name}: wall {b['wall_s']:.3f} s, {b['minor_faults']} minor page faults")
            for k, v in b["parts_s"].items():
                c = b["calls"].get(k, 0)
                print(f"    {k:66s} {v:7.3f} s{f'  ({c} calls)' if c > 1 else ''}")
    if r["errors"]:
        print()
        for k, v in r["errors"].items():
            print(f"ERROR in phase {k}: {v}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=1.0, help="state size: params + 2 Adam moments")
    ap.add_argument("--device", default="cpu", help="where the training state lives: cpu or cuda (the stall "
                    "then includes the device-to-host copy into pinned staging buffers)")
    ap.add_argument("--dir", default=None, help="target directory (a fresh sub-directory is used and removed)")
    ap.add_argument("--repeats", type=int, default=3, help="repeats per measurement (medians are reported)")
    ap.add_argument("--io-threads", type=int, default=4, help="our io_threads and the raw multi-thread run")
    ap.add_argument("--json", default=None, help="write every number here as JSON")
    add_wait_quiet_arg(ap)
    ap.add_argument("--no-breakdown", dest="breakdown", action="store_false",
                    help="skip the timed-parts run of our save and restore")
    args = ap.parse_args(argv)
    r = run_main(args, Bench, print_report)
    return 1 if r["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
