"""``rslurm doctor``, groups ``local`` and ``durable``: can this node save, how fast, and is the durable
tier reachable.

``local``: the node-local root (``local_dir`` with ``%n`` expanded) must exist or be creatable and be
writable; its free space is compared with ``free_space_margin`` (and with ``--checkpoint-size`` times
the checkpoints retention keeps); its filesystem type is read from ``/proc/self/mountinfo`` (a network
filesystem or tmpfs is not node-local NVMe); and a probe file of ``--bandwidth-size`` bytes is written
the way the checkpoint writer writes shards (:func:`resilient_slurm.storage.fileio.write_file`:
O_DIRECT where the filesystem takes it, parallel pwrite, fsync) and removed again.

``durable``: the tier named by ``durable`` is opened (:func:`resilient_slurm.storage.open_durable`) and a
small object is written, read back, compared and deleted under ``.rslurm-doctor/``. Every S3 request is
tried at most 3 times (fewer if ``s3_max_attempts`` says so), and the whole probe is bounded by
``DoctorOptions.durable_timeout``, so an unreachable store fails the check quickly.

Called by :func:`resilient_slurm.doctor.run_checks`: :func:`check_local`, then :func:`check_durable`.
Directories the checks create are removed again when they are left empty; the probe file and probe
object are removed whatever happens.
"""

from __future__ import annotations

import dataclasses
import errno
import mmap
import os
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError, ResilientSlurmError
from ..paths import make_missing_dirs
from ..storage.fileio import BLOCK, round_up, write_file
from .context import DoctorContext, Finding, Status, one_line

PROBE_PREFIX = ".rslurm-doctor"
DOCTOR_S3_ATTEMPTS = 3
_BUFFER = 16 << 20  # one buffer, written again and again: the probe needs no memory of its own size
# Filesystems that are not node-local storage.
NETWORK_FS = frozenset({"nfs", "nfs4", "lustre", "gpfs", "cifs", "smb3", "smbfs", "beegfs", "cephfs", "ceph",
                        "glusterfs", "fuse.glusterfs", "panfs", "wekafs", "9p", "afs", "ocfs2", "gfs2",
                        "fuse.sshfs", "fuse.s3fs", "fuse.gcsfuse", "fuse.juicefs", "fuse.beegfs", "virtiofs"})
RAM_FS = frozenset({"tmpfs", "ramfs"})


@dataclass(frozen=True)
class Mount:
    """One line of /proc/self/mountinfo that matters here."""

    mount_point: str
    fstype: str
    source: str


def _unescape(s: str) -> str:
    return s.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def mount_of(path: str, mountinfo: str = "/proc/self/mountinfo") -> Mount | None:
    """The mount holding ``path`` (the longest mount point that is a prefix of its real path)."""
    real = os.path.realpath(path)
    best: Mount | None = None
    try:
        with open(mountinfo, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 2:
            continue
        mp = _unescape(fields[4])
        inside = real == mp or real.startswith(mp.rstrip("/") + "/")
        # Later lines are mounted over earlier ones at the same point: >= keeps the last.
        if inside and (best is None or len(mp) >= len(best.mount_point)):
            best = Mount(mp, tail[0], _unescape(tail[1]))
    return best


def _existing_ancestor(path: str) -> str:
    d = path
    while not os.path.lexists(d):
        parent = os.path.dirname(d)
        if parent == d:
            break
        d = parent
    return d


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


# ---------------------------------------------------------------------------------------------- local
def check_local(ctx: DoctorContext) -> list[Finding]:
    """Every ``local.*`` finding: dir, space, filesystem, bandwidth."""
    root = ctx.local_dir
    if ctx.local_dir_problem is not None:
        fix = ("remove or fix it as the message says, or point RSLURM_LOCAL_DIR (or --local-dir) at a private "
               "node-local directory")
        return [Finding("local.dir", Status.FAIL, ctx.local_dir_problem, fix, {"path": root}),
                *(Finding(c, Status.SKIP, f"{root} is not usable, nothing measured")
                  for c in ("local.space", "local.filesystem", "local.bandwidth"))]
    created: list[str] = []
    try:
        dir_finding = _check_dir(root, created)
        findings = [dir_finding, _check_space(ctx, root), _check_filesystem(root)]
        if dir_finding.status is Status.FAIL:
            findings.append(Finding("local.bandwidth", Status.SKIP, f"{root} is not usable, nothing measured"))
        else:
            findings.append(_check_bandwidth(ctx, root))
        return findings
    finally:
        for d in reversed(created):  # deepest first; only what the check made, and only when still empty
            try:
                os.rmdir(d)
            except OSError:
                break


def _check_dir(root: str, created: list[str]) -> Finding:
    name = "local.dir"
    fix = "point RSLURM_LOCAL_DIR (or --local-dir) at a writable node-local directory, e.g. /local/nvme/$USER/%n"
    if os.path.lexists(root) and not os.path.isdir(root):
        return Finding(name, Status.FAIL, f"{root} exists but is not a directory", fix, {"path": root})
    if not os.path.isdir(root):
        try:  # mode 0700 under the umask, as the checkpoint engine makes a run's directory
            make_missing_dirs(root, created, exact_mode=False)
        except OSError as exc:
            return Finding(name, Status.FAIL, f"cannot create {root}: {exc.filename}: {exc.strerror}", fix,
                           {"path": root, "errno": exc.errno})
    probe = os.path.join(root, f"{PROBE_PREFIX}-{os.getpid()}-{secrets.token_hex(4)}.w")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
        try:
            os.write(fd, b"\0" * BLOCK)
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as exc:
        return Finding(name, Status.FAIL, f"{root} is not writable: {exc.strerror}", fix,
                       {"path": root, "errno": exc.errno})
    how = "created it (and removed it again), writable" if created else "exists, writable"
    return Finding(name, Status.OK, f"{root}: {how}", "", {"path": root, "created": bool(created)})


def _check_space(ctx: DoctorContext, root: str) -> Finding:
    name = "local.space"
    where = _existing_ancestor(root)
    try:
        st = os.statvfs(where)
    except OSError as exc:
        return Finding(name, Status.FAIL, f"cannot read the free space of {where}: {exc.strerror}")
    free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    margin = ctx.cfg.free_space_margin
    keep = ctx.cfg.keep_last
    size = ctx.options.checkpoint_size
    details: dict[str, Any] = {"free_bytes": free, "total_bytes": total, "free_space_margin": margin,
                               "keep_last": keep, "checkpoint_size": size}
    ctx.facts["local_free"] = free
    what = f"{_gib(free)} free of {_gib(total)} on {where}"
    if free < margin:
        return Finding(name, Status.FAIL, f"{what}: less than free_space_margin={_gib(margin)}, so every save "
                       "fails its space check", "free space there or choose another local_dir", details)
    if size:
        one, steady = size + margin, (keep + 1) * size + margin
        if free < one:
            return Finding(name, Status.FAIL, f"{what}: a {_gib(size)} checkpoint plus the {_gib(margin)} "
                           "margin does not fit", "free space there or choose another local_dir", details)
        if free < steady:
            return Finding(name, Status.WARN, f"{what}: holds {int((free - margin) // size)} checkpoints of "
                           f"{_gib(size)}, but keep_last={keep} plus the one being written need {_gib(steady)}",
                           "lower keep_last or free space", details)
        return Finding(name, Status.OK, f"{what}: room for keep_last={keep} checkpoints of {_gib(size)} plus "
                       "the one being written", "", details)
    return Finding(name, Status.OK, what, "", details)


def _check_filesystem(root: str) -> Finding:
    name = "local.filesystem"
    m = mount_of(_existing_ancestor(root))
    if m is None:
        return Finding(name, Status.SKIP, "cannot read /proc/self/mountinfo")
    details = {"fstype": m.fstype, "mount_point": m.mount_point, "source": m.source}
    what = f"{m.fstype} ({m.source} on {m.mount_point})"
    if m.fstype in NETWORK_FS or (m.fstype.startswith("fuse.") and m.fstype != "fuse.lxcfs"):
        return Finding(name, Status.WARN, f"{what}: a network filesystem, not node-local storage; every node's "
                       "saves compete for it, and it is what the durable tier is for",
                       "use node-local NVMe for local_dir and this filesystem as the durable tier", details)
    if m.fstype in RAM_FS:
        return Finding(name, Status.WARN, f"{what}: RAM; checkpoints take memory from the job and are gone "
                       "after a reboot", "use node-local NVMe if the node has it, and set a durable tier",
                       details)
    if m.fstype == "overlay":
        return Finding(name, Status.WARN, f"{what}: a container's writable layer, gone with the container and "
                       "usually slow", "mount node-local NVMe into the container for local_dir", details)
    return Finding(name, Status.OK, what, "", details)


def measure_write(directory: str, size: int, *, threads: int = 4) -> tuple[float, bool]:
    """Write ``size`` bytes (rounded up to 4 KiB) to a probe file in ``directory`` the way shards are
    written, fsync it, remove it; return (seconds, whether O_DIRECT was used)."""
    size = max(BLOCK, round_up(size))
    path = os.path.join(directory, f"{PROBE_PREFIX}-{os.getpid()}-{secrets.token_hex(4)}.bw")
    buflen = min(size, _BUFFER)
    mm = mmap.mmap(-1, buflen)
    try:
        pattern = os.urandom(1 << 20)  # incompressible, so compressing or deduplicating stores do not flatter it
        for off in range(0, buflen, len(pattern)):
            mm[off:off + min(len(pattern), buflen - off)] = pattern[:buflen - off]
        direct = _direct_supported(path)
        with memoryview(mm) as mv:
            segments = [(mv, buflen)] * (size // buflen)
            if size % buflen:
                segments.append((mv, size % buflen))
            t0 = time.perf_counter()
            try:
                write_file(path, segments, (), threads=threads)
                seconds = time.perf_counter() - t0
            finally:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
    finally:
        mm.close()
    return seconds, direct


def _direct_supported(path: str) -> bool:
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flag, 0o600)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False
        raise
    os.close(fd)
    return True


def _check_bandwidth(ctx: DoctorContext, root: str) -> Finding:
    name = "local.bandwidth"
    size = ctx.options.bandwidth_size
    if name in ctx.options.skip:
        return Finding(name, Status.SKIP, f"skipped (--skip {name})")
    if size <= 0:
        return Finding(name, Status.SKIP, "not measured (--bandwidth-size 0)")
    margin = ctx.cfg.free_space_margin
    free = ctx.facts.get("local_free")
    if isinstance(free, int) and free < size + margin:
        return Finding(name, Status.SKIP, f"not measured: writing {_gib(size)} would leave less than "
                       f"free_space_margin={_gib(margin)} free", "--bandwidth-size with a smaller size")
    try:
        seconds, direct = measure_write(root, size, threads=ctx.cfg.io_threads)
    except (OSError, ResilientSlurmError) as exc:
        return Finding(name, Status.FAIL, f"writing a {_gib(size)} probe file in {root} failed: {exc}",
                       "check the filesystem (dmesg) and its free space")
    rate = size / seconds if seconds > 0 else float("inf")
    ctx.facts["local_bandwidth"] = rate
    details: dict[str, Any] = {"bytes": size, "seconds": round(seconds, 4), "mib_per_s": round(rate / 2**20, 1),
                               "o_direct": direct, "threads": ctx.cfg.io_threads}
    what = (f"{rate / 2**20:.0f} MiB/s writing {_gib(size)} ({'O_DIRECT' if direct else 'buffered'}, "
            f"{ctx.cfg.io_threads} threads, fsync included)")
    ckpt = ctx.options.checkpoint_size
    if not ckpt:
        return Finding(name, Status.OK, what, "", details)
    est = ckpt / rate
    details["checkpoint_seconds"] = round(est, 2)
    what += f"; a {_gib(ckpt)} checkpoint takes about {est:.1f} s"
    window = ctx.facts.get("save_window")
    grace = ctx.facts.get("grace_time")
    limits = []
    if isinstance(window, (int, float)) and est > window:
        limits.append(f"the {window:.0f} s your --signal leaves")
    if isinstance(grace, (int, float)) and grace > 0 and est > grace - ctx.cfg.requeue_margin:
        limits.append(f"the partition's GraceTime={grace:g} s")
    if limits:
        return Finding(name, Status.WARN, what + ", more than " + " and ".join(limits),
                       "signal earlier (--signal=B:USR1@<more>), or save more often so less is lost", details)
    return Finding(name, Status.OK, what, "", details)


# ---------------------------------------------------------------------------------------------- durable
def check_durable(ctx: DoctorContext) -> list[Finding]:
    """The ``durable`` finding: not set, unreachable, or its round-trip latencies."""
    name = "durable"
    url = ctx.cfg.durable
    if not url:
        return [Finding(name, Status.WARN, "no durable tier: checkpoints live only on each node's local_dir, so "
                        "losing a node loses its shards", "set RSLURM_DURABLE=/lustre/$USER/ckpt or "
                        "s3://bucket/prefix (and see docs/daemon.md)")]
    result: dict[str, Any] = {}
    error: list[BaseException] = []

    def probe() -> None:
        try:
            result.update(_probe_durable(ctx))
        except BaseException as exc:  # reported by the caller; the thread must not die silently
            error.append(exc)

    t = threading.Thread(target=probe, name="rslurm-doctor-durable", daemon=True)
    t.start()
    t.join(ctx.options.durable_timeout)
    fix = ("check the URL, the network path to the store, and the credentials (AWS_PROFILE, "
           "AWS_ACCESS_KEY_ID, the instance role) or the directory's permissions")
    if t.is_alive():
        return [Finding(name, Status.FAIL, f"{url}: no answer within {ctx.options.durable_timeout:g} s", fix,
                        {"url": url})]
    if error:
        exc = error[0]
        if isinstance(exc, ConfigError):
            raise exc
        if not isinstance(exc, (ResilientSlurmError, OSError)):
            raise exc
        return [Finding(name, Status.FAIL, f"{url}: {one_line(str(exc), 600)}", fix, {"url": url})]
    details = {"url": url, **result}
    lat = result["latency_ms"]
    what = (f"{result['tier']}: put {lat['put']:.0f} ms, get {lat['get']:.0f} ms, delete {lat['delete']:.0f} ms "
            f"({result['bytes'] // 1024} KiB probe under {PROBE_PREFIX}/)")
    if result.get("same_device_as_local"):
        return [Finding(name, Status.WARN, what + f"; but it is on the same filesystem as local_dir "
                        f"({ctx.local_dir}), so it does not survive the loss of this node's disk",
                        "put the durable tier on shared storage (Lustre, GPFS, NFS) or S3", details)]
    if result.get("fstype") and result["fstype"] not in NETWORK_FS and ctx.in_allocation:
        return [Finding(name, Status.WARN, what + f"; it is on {result['fstype']}, a node-local filesystem that "
                        "other nodes cannot read after a requeue", "use shared storage or S3", details)]
    return [Finding(name, Status.OK, what, "", details)]


def _probe_durable(ctx: DoctorContext) -> dict[str, Any]:
    from ..storage.registry import open_durable, parse_url

    cfg = dataclasses.replace(ctx.cfg, s3_max_attempts=min(ctx.cfg.s3_max_attempts, DOCTOR_S3_ATTEMPTS))
    scheme, location = parse_url(str(cfg.durable))
    tier = open_durable(cfg, upload_cap=False)
    assert tier is not None
    unique = f"{ctx.node}-{os.getpid()}-{secrets.token_hex(4)}"
    key = f"{PROBE_PREFIX}/{unique}/probe"
    data = os.urandom(64 << 10)
    lat: dict[str, float] = {}
    out: dict[str, Any] = {"scheme": scheme, "bytes": len(data), "tier": tier.url}
    try:
        t0 = time.perf_counter()
        tier.put_bytes(key, data)
        lat["put"] = (time.perf_counter() - t0) * 1000
        try:
            t0 = time.perf_counter()
            back = tier.get_bytes(key)
            lat["get"] = (time.perf_counter() - t0) * 1000
            if back != data:
                raise ResilientSlurmError(f"{key}: read back {len(back)} bytes that differ from the {len(data)} "
                                          "written; the store does not return what it was given")
        finally:
            t0 = time.perf_counter()
            tier.delete([key])
            lat["delete"] = (time.perf_counter() - t0) * 1000
        if scheme == "file":
            root = getattr(tier, "root", location)
            for d in (os.path.join(root, PROBE_PREFIX, unique), os.path.join(root, PROBE_PREFIX)):
                try:
                    os.rmdir(d)
                except OSError:
                    break  # another node's probe may still use the parent
            m = mount_of(root)
            out["fstype"] = m.fstype if m else None
            try:
                local_dev = os.stat(_existing_ancestor(ctx.local_dir)).st_dev
                out["same_device_as_local"] = os.stat(root).st_dev == local_dev
            except OSError:
                pass
        else:
            out["endpoint"] = getattr(tier, "endpoint", None)
    finally:
        tier.close()
    out["latency_ms"] = {k: round(v, 2) for k, v in lat.items()}
    return out
