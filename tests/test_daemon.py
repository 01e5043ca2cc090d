"""The drain daemon end to end: real ``rslurm daemon`` processes draining steps that the real engine
committed, into a POSIX durable tier (a directory) and an S3 tier (moto over real HTTP on loopback,
behind a fault-injecting proxy).

Steps are made in-process (world size 1 needs no torch.distributed), or by two real ranks that emulate
two nodes (``RSLURM_NODE_NAME`` per rank, ``--local-dir <dir>/%n``; tests/workers/ddp_worker.py).
Every daemon is a real process; kill -9 is a real SIGKILL; one watermark test mounts a real 64 MiB
tmpfs (root only), the other asks for more free space than the filesystem has (any user).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import s3_support
import torch
import torch.distributed.checkpoint as dcp
import xxhash
from conftest import (
    REPO,
    checkpoint_entries,
    clean_env,
    free_port,
    mounted_tmpfs,
    run_ranks,
    run_rslurm,
    sdir,
)
from s3_support import FAKE_ENV, RESET_REQUEST, RESET_RESPONSE, SLOWDOWN, FaultProxy, MotoServer
from torch.distributed.checkpoint import FileSystemReader

from resilient_slurm import Checkpointer
from resilient_slurm.catalog.inventory import read_durable_copy
from resilient_slurm.daemon import daemon_running
from resilient_slurm.manifest import Manifest
from resilient_slurm.storage.encoding import choose_stride, encode_file, get_shard
from resilient_slurm.storage.posix import PosixTier
from resilient_slurm.storage.s3 import S3Tier
from resilient_slurm.telemetry import EVENTS_FILE

RUN = "drain"
MiB = 1 << 20
WORKER = str(REPO / "tests" / "workers" / "ddp_worker.py")
TMP_MARK = ".tmp-rslurm-"
PREFIX = "ckpt"  # the S3 tier's key prefix inside its bucket

# The S3 fixtures this module uses (pytest finds them as module attributes).
moto_server = s3_support.moto_server
s3_bucket = s3_support.s3_bucket
fault_proxy = s3_support.fault_proxy

pytestmark = [
    pytest.mark.proc,  # every test here starts processes (tests/check_tier.py)
    pytest.mark.skipif(sys.platform != "linux", reason="flock, xattrs and signals as on Linux"),
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
]


# --------------------------------------------------------------------------------------------- helpers
def state_of(step: int, nbytes: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1000 + step)
    return {"w": torch.randn(nbytes // 4, generator=g), "step": step}


def save_steps(root: Path, steps: list[int], nbytes: int, *, keep_last: int = 10,
               keep_every: int | None = None) -> None:
    """Commit ``steps`` in the local tier ``root`` with the real engine (blocking saves: retention done)."""
    with Checkpointer(local_dir=str(root), run_id=RUN, keep_last=keep_last, keep_every=keep_every) as ck:
        for s in steps:
            ck.save(s, state_of(s, nbytes))


@pytest.fixture
def n1(monkeypatch: pytest.MonkeyPatch) -> str:
    """In-process saves belong to node n1 (the daemons below run as n1 too)."""
    monkeypatch.setenv("RSLURM_NODE_NAME", "n1")
    return "n1"


def rslurm(*args: str, node: str = "n1", env: Mapping[str, str] | None = None,
           timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return run_rslurm(*args, env={"RSLURM_NODE_NAME": node, "RSLURM_LOCAL_MIN_FREE": "1M", **(env or {})},
                      timeout=timeout)


def drain(local: Path | str, durable: Path | str, *args: str, node: str = "n1",
          env: Mapping[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``rslurm daemon --once``. ``RSLURM_LOCAL_MIN_FREE=1M`` unless overridden: eviction stays out of
    the tests that are not about it, whatever the free space of the machine running them."""
    return rslurm("daemon", "--local-dir", str(local), "--durable", str(durable), "--once", *args, node=node,
                  env=env, timeout=timeout)


def ok(r: subprocess.CompletedProcess[str]) -> str:
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r.stderr


def ok_out(r: subprocess.CompletedProcess[str]) -> str:
    ok(r)
    return r.stdout


def start_daemon(local: Path, durable: Path | str, log: Path, *args: str, node: str = "n1",
                 env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
    e = clean_env({"RSLURM_NODE_NAME": node, "RSLURM_LOCAL_MIN_FREE": "1M", **(env or {})})
    with open(log, "wb") as f:
        return subprocess.Popen([sys.executable, "-m", "resilient_slurm.cli", "daemon", "--local-dir", str(local),
                                 "--durable", str(durable), *args], env=e, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)


def status(local: Path | str, durable: Path | str, node: str = "n1", run: str = RUN,
           env: Mapping[str, str] | None = None) -> dict[int, dict[str, Any]]:
    """``rslurm status --json``: step -> row."""
    out = ok_out(rslurm("status", "--json", "--local-dir", str(local), "--durable", str(durable), "--run-id", run,
                        node=node, env=env))
    return {r["step"]: r for r in json.loads(out)["steps"]}


def durable_steps(dur: Path, run: str = RUN) -> set[int]:
    """Steps with a durable manifest (committed) in a POSIX tier."""
    d = dur / run
    return {int(p.name[5:]) for p in d.glob("step_*") if (p / "manifest.json").exists()} if d.exists() else set()


def step_dirs(dur: Path, run: str = RUN) -> set[int]:
    """Every step directory in a POSIX tier, committed or not."""
    d = dur / run
    return {int(p.name[5:]) for p in d.glob("step_*")} if d.exists() else set()


def local_steps(root: Path, run: str = RUN) -> set[int]:
    names = checkpoint_entries(root / run)
    assert not [n for n in names if ".tmp-" in n], f"temp directories in the local tier: {names}"
    return {int(n[5:]) for n in names}


def assert_same_bytes(local_step: Path, durable_step: Path) -> Manifest:
    """Every shard of the local step's domain is in the durable step with the same bytes."""
    m = Manifest.from_json((local_step / "manifest.json").read_bytes())
    shards = m.shards_of_node(m.node)
    assert shards
    for s in shards:
        a, b = (local_step / s.path).read_bytes(), (durable_step / s.path).read_bytes()
        assert len(a) == len(b) == s.size and a == b, f"{durable_step / s.path} differs from {local_step / s.path}"
    return m


def sent_steps(err: str) -> list[int]:
    """Steps a daemon's log says it sent bytes of, in order."""
    out = []
    for ln in err.splitlines():
        if f"run {RUN} step " in ln and " MiB sent, " in ln:
            out.append(int(ln.split(f"run {RUN} step ")[1].split()[0]))
    return out


def assert_loads(durable_step: Path, step: int, nbytes: int) -> None:
    """Plain DCP reads the durable step's root; the tensor is the one saved."""
    md = FileSystemReader(str(durable_step)).read_metadata()
    assert "w" in md.state_dict_metadata, sorted(md.state_dict_metadata)
    target = {"w": torch.zeros(nbytes // 4)}
    dcp.load(target, checkpoint_id=str(durable_step))
    assert torch.equal(target["w"], state_of(step, nbytes)["w"]), f"durable step {step} does not load back"


def tmp_files(d: Path) -> list[Path]:
    return [p for p in d.rglob(f"*{TMP_MARK}*")] if d.exists() else []


def snapshot(d: Path) -> dict[str, tuple[int, int, bytes | None]]:
    """Every file under ``d`` but the run's event log (the daemon appends to it): inode, mtime and
    recorded checksum (a rewrite changes the first two)."""
    out = {}
    for p in sorted(d.rglob("*")):
        if p.is_file() and p.name != EVENTS_FILE:
            st = p.stat()
            try:
                x: bytes | None = os.getxattr(p, "user.rslurm.xxh3")
            except OSError:
                x = None
            out[str(p.relative_to(d))] = (st.st_ino, st.st_mtime_ns, x)
    return out


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def wait_progress(local: Path, proc: subprocess.Popen[bytes], log: Path, timeout: float = 60) -> dict[str, Any]:
    """Block until the daemon's status file shows bytes of a transfer done; return its ``current``."""
    path = local / ".rslurm" / "daemon.json"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"daemon exited ({proc.returncode}) before any progress: {log.read_text()[-3000:]}")
        try:
            cur = json.loads(path.read_text()).get("current")
        except (OSError, ValueError):
            cur = None
        if cur and cur.get("bytes_done", 0) > 0:
            return cur
        time.sleep(0.01)
    proc.kill()
    pytest.fail(f"no drain progress within {timeout}s: {log.read_text()[-3000:]}")


def stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGKILL) -> int:
    try:
        os.kill(proc.pid, sig)
    except ProcessLookupError:
        pass
    return proc.wait(timeout=60)


# ------------------------------------------------------------------------------------------ 1. one node
def test_once_drains_a_step_to_posix(tmp_path: Path, n1: str) -> None:
    local, dur = tmp_path / "nvme", tmp_path / "lustre"
    nbytes = 3 * MiB
    save_steps(local, [7], nbytes)
    err = ok(drain(local, dur))
    sd = dur / RUN / sdir(7)
    assert durable_steps(dur) == {7}, err
    dm = Manifest.from_json((sd / "manifest.json").read_bytes())
    assert dm.step == 7 and dm.run_id == RUN and dm.extra["durable"] == {"domains": ["n1"]}
    lm = assert_same_bytes(local / RUN / sdir(7), sd)
    assert dm.save_id == lm.save_id
    assert (sd / "domains" / "n1" / "manifest.json").exists()  # the domain's marker
    # The checksum is recorded with the object (a restarted daemon trusts it without reading back).
    for s in lm.shards:
        assert os.getxattr(sd / s.path, "user.rslurm.xxh3").decode() == s.checksum
    assert_loads(sd, 7, nbytes)
    assert not tmp_files(dur)
    assert local_steps(local) == {7}  # draining does not remove the local copy

    row = status(local, dur)[7]
    assert (row["local"], row["drain"], row["durable"]) == ("committed", "durable", "durable"), row
    daemon_status = json.loads((local / ".rslurm" / "daemon.json").read_text())
    assert daemon_status["node"] == "n1" and daemon_status["current"] is None
    assert [(s["step"], s["state"]) for s in daemon_status["steps"]] == [(7, "durable")]
    assert "is durable in" in err and "step 7" in err


# ----------------------------------------------------------------------------------------- 2. two nodes
def test_two_nodes_commit_only_when_both_drained_and_rerun_changes_nothing(tmp_path: Path) -> None:
    run, nodes, dur = "ddp", tmp_path / "%n", tmp_path / "lustre"
    out = tmp_path / "out"
    out.mkdir()
    run_ranks([WORKER, "save", "--local-dir", str(nodes), "--run-id", run, "--out", str(out), "--tag", "save"], 2,
              tmp_path, timeout=120, env={"RSLURM_COLLECTIVE_TIMEOUT": "60"},
              per_rank_env=[{"RSLURM_NODE_NAME": "n1"}, {"RSLURM_NODE_NAME": "n2"}])
    saved = torch.load(out / "save_rank0.pt", weights_only=True)
    sd = dur / run / sdir(3)

    # Only n1's daemon ran: its shard and marker are there, the step is not durable.
    err = ok(drain(nodes, dur, "--run-id", run, node="n1"))
    assert not (sd / "manifest.json").exists() and not (sd / ".metadata").exists(), err
    assert (sd / "domains" / "n1" / "manifest.json").exists()
    assert not (sd / "domains" / "n2").exists()
    assert (sd / "__0_0.distcp").exists() and not (sd / "__1_0.distcp").exists()
    row = status(nodes, dur, node="n1", run=run)[3]
    assert row["durable"] == "partial 1/2" and row["drain"] == "waiting", row
    copy = read_durable_copy(PosixTier(str(dur)), run, 3)
    assert (copy.state, copy.markers, copy.committed, copy.domains) == ("partial", ["n1"], ["n1"], 2), copy
    assert copy.problem is not None and "1/2 domain manifests (n1), 1/2 commit markers of save" in copy.problem
    assert row["waiting_for"] == ["n2"], row
    assert "waiting for n2" in err

    # n2's daemon: its shard, its marker, then the commit.
    err = ok(drain(nodes, dur, "--run-id", run, node="n2"))
    assert (sd / "manifest.json").exists(), err
    assert status(nodes, dur, node="n2", run=run)[3]["durable"] == "durable"
    for node in ("n1", "n2"):
        assert_same_bytes(tmp_path / node / run / sdir(3), sd)
    dm = Manifest.from_json((sd / "manifest.json").read_bytes())
    assert dm.extra["durable"] == {"domains": ["n1", "n2"]} and dict(dm.nodes) == {"n1": (0,), "n2": (1,)}
    # Plain DCP loads the model from the durable root (metadata points at both nodes' shards).
    target = {f"model.module.{k}": torch.zeros_like(v) for k, v in saved["model"].items()}
    dcp.load(target, checkpoint_id=str(sd))
    for k, v in saved["model"].items():
        assert torch.equal(target[f"model.module.{k}"], v), k

    # n1 again: the step is durable; nothing is written again.
    before = snapshot(dur)
    ok(drain(nodes, dur, "--run-id", run, node="n1"))
    assert snapshot(dur) == before
    assert status(nodes, dur, node="n1", run=run)[3]["drain"] == "durable"


# ------------------------------------------------------------------------- 3. kill -9 mid-drain, restart
def test_kill9_mid_drain_then_restart_posix(tmp_path: Path, n1: str) -> None:
    local, dur = tmp_path / "nvme", tmp_path / "lustre"
    nbytes = 40 * MiB  # three 16 MiB pieces at 8 MiB/s on one thread: ~3 s left after the first one
    save_steps(local, [5], nbytes)
    log = tmp_path / "daemon.log"
    proc = start_daemon(local, dur, log, "--drain-bandwidth", "8M", "--drain-threads", "1")
    cur = wait_progress(local, proc, log)
    stop(proc)
    assert (cur["run_id"], cur["step"]) == (RUN, 5) and 0 < cur["bytes_done"] < cur["bytes_total"], cur
    sd = dur / RUN / sdir(5)
    # Killed mid-copy: a temp file, no published shard, no marker, no commit.
    assert tmp_files(sd), f"the kill did not land mid-transfer: {log.read_text()[-2000:]}"
    assert not (sd / "manifest.json").exists()
    assert not (sd / "domains").exists()
    assert not (sd / "__0_0.distcp").exists()
    assert status(local, dur)[5]["durable"] != "durable"

    err = ok(drain(local, dur))
    assert durable_steps(dur) == {5}, err
    assert_same_bytes(local / RUN / sdir(5), sd)
    assert_loads(sd, 5, nbytes)
    assert not tmp_files(dur), tmp_files(dur)


# ------------------------------------------------------------------ 4. a daemon started after the job
def test_daemon_started_after_the_job_drains_what_retention_keeps(tmp_path: Path, n1: str) -> None:
    local, dur = tmp_path / "nvme", tmp_path / "lustre"
    nbytes = MiB
    save_steps(local, [1, 2, 3, 4, 5], nbytes, keep_last=4)  # the job's local retention: 2..5 left
    assert local_steps(local) == {2, 3, 4, 5}
    err = ok(drain(local, dur, env={"RSLURM_KEEP_LAST": "2", "RSLURM_KEEP_EVERY": "3"}))
    # Durable retention keeps the newest two and the multiples of 3: 3, 4, 5. Step 2 is never sent.
    assert durable_steps(dur) == {3, 4, 5}, err
    assert step_dirs(dur) == {3, 4, 5}, "a step that durable retention does not keep was uploaded"
    assert sent_steps(err) == [5, 4, 3], err  # newest first; step 2 not sent (and then deleted) either
    assert "retention: removed" not in err, err
    for s in (3, 4, 5):
        assert_same_bytes(local / RUN / sdir(s), dur / RUN / sdir(s))
    assert_loads(dur / RUN / sdir(5), 5, nbytes)
    assert local_steps(local) == {2, 3, 4, 5}  # the daemon's passes leave the local tier alone here
    rows = status(local, dur)
    assert rows[2]["drain"] == "local" and rows[2]["durable"] == "-", rows[2]
    assert all(rows[s]["durable"] == "durable" for s in (3, 4, 5))


# -------------------------------------------------------------------------- 5. retention on both tiers
@pytest.mark.parametrize("keep_every", [None, 2])
def test_retention_on_both_tiers(tmp_path: Path, n1: str, keep_every: int | None) -> None:
    local, dur = tmp_path / "nvme", tmp_path / "lustre"
    env = {"RSLURM_KEEP_LAST": "2"} | ({"RSLURM_KEEP_EVERY": str(keep_every)} if keep_every else {})
    for s in range(1, 6):
        save_steps(local, [s], 256 * 1024, keep_last=2, keep_every=keep_every)
        err = ok(drain(local, dur, env=env))
        want = set(range(max(1, s - 1), s + 1)) | {k for k in range(1, s + 1) if keep_every and k % keep_every == 0}
        assert durable_steps(dur) == want, f"after save {s}: {err}"
        assert step_dirs(dur) == want, f"after save {s}: a removed step left objects behind"
        assert local_steps(local) == want, f"after save {s}"
        assert s in durable_steps(dur)
    assert durable_steps(dur) == ({4, 5} if keep_every is None else {2, 4, 5})
    for s in durable_steps(dur):
        assert_same_bytes(local / RUN / sdir(s), dur / RUN / sdir(s))


def test_newest_durable_step_survives_a_newer_step_that_cannot_be_drained(tmp_path: Path, n1: str) -> None:
    local, dur = tmp_path / "nvme", tmp_path / "lustre"
    env = {"RSLURM_KEEP_LAST": "1"}
    save_steps(local, [1], 256 * 1024)
    ok(drain(local, dur, env=env))
    save_steps(local, [2], 256 * 1024)
    flip_byte(local / RUN / sdir(2) / "__0_0.distcp", 100)
    r = drain(local, dur, env=env)
    assert r.returncode == 1, r.stderr
    assert durable_steps(dur) == {1}, "keep_last=1 counted a step that is not durable"
    assert_same_bytes(local / RUN / sdir(1), dur / RUN / sdir(1))
    assert local_steps(local) == {1, 2}


# ------------------------------------------------------------------------------------- 6. watermark
@pytest.fixture
def tmpfs64(tmp_path: Path) -> Iterator[Path]:
    with mounted_tmpfs(tmp_path / "tiny", "64m") as mnt:
        yield mnt


STEP_BYTES = 8 * MiB


def watermark_setup(local: Path, dur: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps 1, 2 durable; 3, 4 committed locally but the durable tier cannot take them (a file sits
    where their directory would go)."""
    monkeypatch.setenv("RSLURM_FREE_SPACE_MARGIN", "0")
    save_steps(local, [1, 2], STEP_BYTES)
    ok(drain(local, dur))
    assert durable_steps(dur) == {1, 2}
    for s in (3, 4):
        (dur / RUN / sdir(s)).write_text("not a directory")
    save_steps(local, [3, 4], STEP_BYTES)
    assert local_steps(local) == {1, 2, 3, 4}


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def evictions(err: str) -> list[int]:
    return [int(ln.split("evicted run ")[1].split()[2]) for ln in err.splitlines() if "evicted run " in ln]


@pytest.mark.root
def test_watermark_evicts_durable_steps_oldest_first_until_met(tmpfs64: Path, tmp_path: Path,
                                                               n1: str, monkeypatch: pytest.MonkeyPatch) -> None:
    local, dur = tmpfs64, tmp_path / "lustre"
    watermark_setup(local, dur, monkeypatch)
    # Half a step more than is free: evicting one step is enough.
    need = free_bytes(local) + STEP_BYTES // 2
    r = drain(local, dur, "--local-min-free", str(need))
    assert r.returncode == 1, r.stderr  # steps 3 and 4 could not be drained
    assert evictions(r.stderr) == [1], r.stderr
    assert local_steps(local) == {2, 3, 4}
    assert free_bytes(local) >= need
    assert durable_steps(dur) == {1, 2}

    # The durable tier takes 3 and 4 now: every local step is durable. Short of space again, the oldest
    # goes, not the newest (the one a resume reads locally).
    for s in (3, 4):
        (dur / RUN / sdir(s)).unlink()
    ok(drain(local, dur))
    assert durable_steps(dur) == {2, 3, 4}  # durable retention (keep_last=3) removed step 1 there
    need = free_bytes(local) + STEP_BYTES // 2
    r = drain(local, dur, "--local-min-free", str(need))
    assert r.returncode == 0, r.stderr
    assert evictions(r.stderr) == [2], r.stderr
    assert local_steps(local) == {3, 4}


def test_watermark_never_evicts_the_newest_step_not_yet_durable(tmp_path: Path, n1: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    local, dur = tmp_path / "nvme", tmp_path / "lustre"
    watermark_setup(local, dur, monkeypatch)
    st = os.statvfs(local)
    impossible = str(2 * st.f_blocks * st.f_frsize)  # more than the filesystem holds
    r = drain(local, dur, "--local-min-free", impossible)
    assert r.returncode == 1, r.stderr
    # Durable steps first, oldest first; then the older step that is not durable; never step 4.
    assert evictions(r.stderr) == [1, 2, 3], r.stderr
    assert local_steps(local) == {4}
    assert "nothing more can be evicted" in r.stderr and "not yet durable is kept" in r.stderr, r.stderr
    assert durable_steps(dur) == {1, 2}  # eviction is local only
    m = Manifest.from_json((local / RUN / sdir(4) / "manifest.json").read_bytes())
    for s in m.shards:  # step 4 intact
        assert (local / RUN / sdir(4) / s.path).stat().st_size == s.size
    # Again: still violated, still kept.
    r = drain(local, dur, "--local-min-free", impossible)
    assert local_steps(local) == {4} and "nothing more can be evicted" in r.stderr


# ------------------------------------------------------------------------------------- 7. bad input
def test_corrupt_local_shard_is_never_made_durable(tmp_path: Path, n1: str) -> None:
    local, dur = tmp_path / "nvme", tmp_path / "lustre"
    save_steps(local, [1], MiB)
    shard = local / RUN / sdir(1) / "__0_0.distcp"
    flip_byte(shard, shard.stat().st_size // 2)
    r = drain(local, dur)
    assert r.returncode == 1, r.stderr
    assert str(shard) in r.stderr and "checksum" in r.stderr, r.stderr
    sd = dur / RUN / sdir(1)
    assert not (sd / "manifest.json").exists()
    assert not (sd / "__0_0.distcp").exists() and not (sd / "domains").exists()
    assert not tmp_files(dur)
    row = status(local, dur)[1]
    assert row["drain"] == "failed" and str(shard) in row["error"], row
    assert row["durable"] != "durable"


def test_garbage_local_manifest_is_skipped_others_drained(tmp_path: Path, n1: str) -> None:
    local, dur = tmp_path / "nvme", tmp_path / "lustre"
    save_steps(local, [1, 2, 3], 256 * 1024)
    bad = local / RUN / sdir(2) / "manifest.json"
    bad.write_text("{not json")
    r = drain(local, dur)
    assert str(local / RUN / sdir(2)) in r.stderr and "not valid JSON" in r.stderr, r.stderr
    assert durable_steps(dur) == {1, 3}
    assert step_dirs(dur) == {1, 3}
    for s in (1, 3):
        assert_same_bytes(local / RUN / sdir(s), dur / RUN / sdir(s))


def test_second_daemon_on_the_same_dir_is_refused(tmp_path: Path, n1: str) -> None:
    local, dur = tmp_path / "nvme", tmp_path / "lustre"
    save_steps(local, [1], 256 * 1024)
    log = tmp_path / "first.log"
    first = start_daemon(local, dur, log, env={"RSLURM_DRAIN_POLL_INTERVAL": "0.2"})
    try:
        deadline = time.monotonic() + 60
        while not daemon_running(str(local)):
            assert first.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "the first daemon never took its lock"
            time.sleep(0.01)
        r = drain(local, dur)
        assert r.returncode == 2, r.stderr
        assert str(local / ".rslurm" / "daemon.lock") in r.stderr and "another rslurm daemon" in r.stderr, r.stderr
        r = rslurm("daemon", "--local-dir", str(local), "--durable", str(dur), "--job-step")
        assert r.returncode == 0, r.stderr
        assert "already drains" in r.stderr, r.stderr
        while durable_steps(dur) != {1}:  # the first daemon does its job meanwhile
            assert first.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.02)
    finally:
        code = stop(first, signal.SIGTERM)
    assert code == 0, log.read_text()
    assert not daemon_running(str(local))
    ok(drain(local, dur))  # the lock is free again


def test_unknown_rslurm_variable_is_refused(tmp_path: Path, n1: str) -> None:
    local, dur = tmp_path / "nvme", tmp_path / "lustre"
    save_steps(local, [1], 256 * 1024)
    r = drain(local, dur, env={"RSLURM_DRAIN_BANDWITH": "1M"})
    assert r.returncode == 2, r.stderr
    assert "RSLURM_DRAIN_BANDWITH" in r.stderr and "RSLURM_DRAIN_BANDWIDTH" in r.stderr, r.stderr
    assert not step_dirs(dur)
    assert local_steps(local) == {1}


# -------------------------------------------------------------------------------------------------- S3
def s3_env(endpoint: str, **extra: str) -> dict[str, str]:
    """A daemon's settings for the S3 tier at ``endpoint`` (fake credentials, 5 MiB parts)."""
    return {**FAKE_ENV, "RSLURM_S3_ENDPOINT_URL": endpoint, "RSLURM_S3_PART_SIZE": "5M", **extra}


def s3_key(step: int, name: str) -> str:
    return f"{PREFIX}/{RUN}/{sdir(step)}/{name}"


def s3_keys(server: MotoServer, bucket: str) -> set[str]:
    out: set[str] = set()
    for page in server.client().get_paginator("list_objects_v2").paginate(Bucket=bucket):
        out |= {o["Key"] for o in page.get("Contents", [])}
    return out


def s3_durable(server: MotoServer, bucket: str) -> set[int]:
    keys = s3_keys(server, bucket)
    return {int(k.split("/")[2][5:]) for k in keys if k.count("/") == 3 and k.endswith("/manifest.json")}


def assert_same_bytes_s3(server: MotoServer, bucket: str, local_step: Path, tmp: Path) -> None:
    """Every shard of the local step's domain is in S3 with the same bytes (decoded, where it was stored
    compressed) and the xxh3 of what is stored recorded with it."""
    m = Manifest.from_json((local_step / "manifest.json").read_bytes())
    with S3Tier(f"{bucket}/{PREFIX}", endpoint_url=server.endpoint) as tier:
        for s in m.shards_of_node(m.node):
            obj = server.client().get_object(Bucket=bucket, Key=s3_key(m.step, s.path))
            data = obj["Body"].read()
            assert obj["Metadata"].get("xxh3") == xxhash.xxh3_64(data).hexdigest()
            if len(data) != s.size:  # stored compressed (durable_compression auto: zstd on S3)
                get_shard(tier, s3_key(m.step, s.path)[len(PREFIX) + 1:], str(tmp / "decoded"), size=s.size,
                          checksum=s.checksum)
                data = (tmp / "decoded").read_bytes()
            assert data == (local_step / s.path).read_bytes(), f"{s3_key(m.step, s.path)} differs from the local shard"
    dm = Manifest.from_json(server.client().get_object(Bucket=bucket, Key=s3_key(m.step, "manifest.json"))["Body"]
                            .read())
    assert dm.save_id == m.save_id


def sent_mib(err: str, what: str) -> float:
    """The MiB a daemon logged as ``sent`` or ``already there`` (summed over its drains)."""
    total = 0.0
    for ln in err.splitlines():
        if " MiB sent, " in ln:
            part = ln.split(" MiB sent, ")
            total += float(part[0].split()[-1]) if what == "sent" else float(part[1].split(" MiB already")[0])
    return total


@pytest.mark.parametrize("compression", ["off", "zstd"])
def test_kill9_mid_drain_then_restart_s3_resumes_parts(tmp_path: Path, n1: str, moto_server: MotoServer,
                                                       s3_bucket: str, fault_proxy: FaultProxy,
                                                       compression: str) -> None:
    """Compressed, the restarted daemon encodes the shard again into the same bytes (the encoding is
    deterministic), so the parts already uploaded are reused just the same."""
    local, url = tmp_path / "nvme", f"s3://{s3_bucket}/{PREFIX}"
    save_steps(local, [5], 24 * MiB)
    m = Manifest.from_json((local / RUN / sdir(5) / "manifest.json").read_bytes())
    size = m.shards[0].size
    if compression == "zstd":
        shard = str(local / RUN / sdir(5) / m.shards[0].path)
        fd = os.open(shard, os.O_RDONLY)
        stride = choose_stride(fd, size)[0]
        os.close(fd)
        assert stride is not None
        got = encode_file(shard, str(tmp_path / "encoded"), size=size, checksum=m.shards[0].checksum, stride=stride)
        assert got is not None
        size = got[0]
    nparts = -(-size // (5 * MiB))
    assert nparts == 5 if compression == "off" else 3 <= nparts <= 5, (nparts, size)
    env = s3_env(fault_proxy.endpoint, RSLURM_DURABLE_COMPRESSION=compression)
    log = tmp_path / "daemon.log"
    proc = start_daemon(local, url, log, "--drain-bandwidth", "4M", "--drain-threads", "1", env=env)
    cur = wait_progress(local, proc, log)
    stop(proc)
    assert 0 < cur["bytes_done"] < cur["bytes_total"], cur
    # Killed mid-upload: one incomplete multipart upload holding some parts; nothing published.
    uploads = moto_server.uploads(s3_bucket)
    assert [u["Key"] for u in uploads] == [s3_key(5, "__0_0.distcp")], (uploads, log.read_text()[-2000:])
    there = moto_server.client().list_parts(Bucket=s3_bucket, Key=uploads[0]["Key"],
                                            UploadId=uploads[0]["UploadId"]).get("Parts", [])
    assert 1 <= len(there) < nparts, there
    assert not s3_keys(moto_server, s3_bucket), "the killed daemon published objects"
    assert status(local, url, env=env)[5]["durable"] != "durable"

    since = len(fault_proxy.requests)
    err = ok(drain(local, url, env=env))
    assert s3_durable(moto_server, s3_bucket) == {5}, err
    assert_same_bytes_s3(moto_server, s3_bucket, local / RUN / sdir(5), tmp_path)
    # The restart sent only the parts that were not there; the log says so.
    assert fault_proxy.count("UploadPart", since=since) == nparts - len(there), err
    assert fault_proxy.count("CreateMultipartUpload", since=since) == 0
    assert sent_mib(err, "already") >= 5 * len(there) - 0.1, err
    assert moto_server.uploads(s3_bucket) == []
    if compression == "zstd":  # `rslurm verify` reads the compressed shard, and names it once a byte flips
        verify = ("verify", "--json", "--tier", "durable", "--local-dir", str(local), "--durable", url, "5")
        ok(rslurm(*verify, env=env))
        key = s3_key(5, m.shards[0].path)
        blob = bytearray(moto_server.client().get_object(Bucket=s3_bucket, Key=key)["Body"].read())
        assert len(blob) == size
        blob[len(blob) // 2] ^= 0x20
        moto_server.client().put_object(Bucket=s3_bucket, Key=key, Body=bytes(blob))
        r = rslurm(*verify, env=env)
        assert r.returncode == 1, r.stdout + r.stderr
        faults = [f for rep in json.loads(r.stdout)["reports"] for f in rep["faults"]]
        assert [(f["where"].endswith(key), f["kind"]) for f in faults] == [(True, "corrupt")], faults
    assert status(local, url, env=env)[5]["durable"] == "durable"


def test_dead_s3_endpoint_fails_bounded_and_names_it(tmp_path: Path, n1: str) -> None:
    local = tmp_path / "nvme"
    save_steps(local, [1], MiB)
    before = snapshot(local / RUN)
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens: connection refused
    r = drain(local, "s3://nobody-listens/ckpt", env=s3_env(endpoint, RSLURM_S3_MAX_ATTEMPTS="2"))
    assert r.returncode == 1, r.stderr
    err = r.stderr
    assert endpoint in err and f"{RUN}/{sdir(1)}" in err, err
    assert "after 2 attempt(s)" in err and "attempt 2/2" not in err, err
    assert snapshot(local / RUN) == before  # the local step is intact


def test_always_503_fails_bounded_and_names_it(tmp_path: Path, n1: str, moto_server: MotoServer, s3_bucket: str,
                                               fault_proxy: FaultProxy) -> None:
    local, url = tmp_path / "nvme", f"s3://{s3_bucket}/{PREFIX}"
    save_steps(local, [1], 6 * MiB)
    before = snapshot(local / RUN)
    fault_proxy.inject(SLOWDOWN)
    r = drain(local, url, env=s3_env(fault_proxy.endpoint, RSLURM_S3_MAX_ATTEMPTS="2"))
    assert r.returncode == 1, r.stderr
    assert "SlowDown" in r.stderr and fault_proxy.endpoint in r.stderr and s3_key(1, "") in r.stderr, r.stderr
    assert fault_proxy.count() == 0 and fault_proxy.received() > 0  # nothing reached the store
    # Bounded: no request was tried more than twice.
    tries: dict[tuple[str, str, str], int] = {}
    for q in fault_proxy.requests:
        k = (q.method, q.path, json.dumps(q.query, sort_keys=True))
        tries[k] = tries.get(k, 0) + 1
    assert max(tries.values()) <= 2, {k: n for k, n in tries.items() if n > 2}
    assert not s3_keys(moto_server, s3_bucket) and moto_server.uploads(s3_bucket) == []
    assert snapshot(local / RUN) == before


def test_s3_drain_through_503s_and_resets(tmp_path: Path, n1: str, moto_server: MotoServer, s3_bucket: str,
                                          fault_proxy: FaultProxy) -> None:
    local, url = tmp_path / "nvme", f"s3://{s3_bucket}/{PREFIX}"
    save_steps(local, [1, 2], 12 * MiB)  # three parts each
    injected = {
        SLOWDOWN: [fault_proxy.inject(SLOWDOWN, op="UploadPart", every=2, times=2),
                   fault_proxy.inject(SLOWDOWN, op="HeadObject", times=2),
                   fault_proxy.inject(SLOWDOWN, op="ListObjects", times=1)],
        RESET_REQUEST: [fault_proxy.inject(RESET_REQUEST, op="UploadPart", times=1)],
        RESET_RESPONSE: [fault_proxy.inject(RESET_RESPONSE, op="PutObject", times=2),
                         fault_proxy.inject(RESET_RESPONSE, op="CompleteMultipartUpload", times=1)],
    }
    env = s3_env(fault_proxy.endpoint)
    err = ok(drain(local, url, env=env))
    for fault, rules in injected.items():
        assert all(r.injected == r.times for r in rules), (fault, [(r.injected, r.times) for r in rules], err)
    assert s3_durable(moto_server, s3_bucket) == {1, 2}, err
    for s in (1, 2):
        assert_same_bytes_s3(moto_server, s3_bucket, local / RUN / sdir(s), tmp_path)
    assert moto_server.uploads(s3_bucket) == []
    daemon_status = json.loads((local / ".rslurm" / "daemon.json").read_text())
    assert sum(s["retries"] for s in daemon_status["steps"]) >= 3, daemon_status
    rows = status(local, url, env=env)
    assert rows[1]["durable"] == rows[2]["durable"] == "durable", rows


@pytest.mark.proc
@pytest.mark.parametrize("after", [0.1, 0.25, 0.5, 1.5])
def test_the_job_daemon_stopped_while_it_starts_ends_quietly(tmp_path: Path, after: float) -> None:
    """The launcher stops the drain daemon it started with SIGINT. A job that ended at once (a program that
    failed on its arguments) sent it while the daemon still imported: a KeyboardInterrupt traceback then ended
    the job's output, under the program's own error. Heard at any moment, it ends the daemon quietly."""
    from conftest import clean_env

    env = clean_env({"RSLURM_NODE_NAME": "n1"})
    proc = subprocess.Popen([sys.executable, "-m", "resilient_slurm.cli", "daemon", "--job-step", "--run-id", "r",
                             "--local-dir", str(tmp_path / "nvme"), "--durable", str(tmp_path / "durable")],
                            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    time.sleep(after)  # the imports take from a few hundred milliseconds to seconds on a busy node
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode in (0, 1), (proc.returncode, err[-3000:])
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
