"""A POSIX durable tier that holds links, special files, or no free space: nothing outside the tier is
read, written or deleted, the message names the path, and the daemon keeps draining what it can.

* A step directory linked elsewhere (``ln -s /elsewhere D/run/step_...``) is not a step: retention
  (the daemon's and ``rslurm gc``'s) never deletes through it, the daemon never writes through it (the
  step concerned fails, naming the link; the others drain), restore never lists it.
* A FIFO where a durable manifest goes does not hang the listing; the step is skipped with a warning.
* A full tier (a real 8 MiB tmpfs, root only: CI runs as root) gives the real error
  (InsufficientSpaceError: the filesystem filled up) for the daemon and for restore's fetch, never the
  BufferError that used to mask it, and leaves no temp file behind.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import mounted_tmpfs, run_rslurm, sdir

from resilient_slurm import Checkpointer
from resilient_slurm.errors import InsufficientSpaceError, UnsafePathError
from resilient_slurm.manifest import Manifest
from resilient_slurm.storage.posix import PosixTier

RUN = "hostile"
KiB = 1 << 10
MiB = 1 << 20

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="O_NOFOLLOW, FIFOs and tmpfs as on Linux")


def save_steps(root: Path, steps: list[int], nbytes: int) -> None:
    with Checkpointer(local_dir=str(root), run_id=RUN, keep_last=10) as ck:
        for s in steps:
            ck.save(s, {"w": torch.full((nbytes // 4,), float(s)), "step": s})


def rslurm(*args: str, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    r = run_rslurm(*args, env={"RSLURM_NODE_NAME": "n1", "RSLURM_LOCAL_MIN_FREE": "1M", "RSLURM_RUN_ID": RUN,
                               **(env or {})})
    assert "BufferError" not in r.stderr, r.stderr[-3000:]
    return r


def drain(local: Path, dur: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return rslurm("daemon", "--local-dir", str(local), "--durable", str(dur), "--once", env=env)


def tree(root: Path) -> dict[str, str]:
    """Every file under ``root`` (not following links) and a digest of its bytes."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            p = Path(dirpath) / f
            out[str(p.relative_to(root))] = "link" if p.is_symlink() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def committed(dur: Path) -> set[int]:
    d = dur / RUN
    return {int(p.name[5:]) for p in d.glob("step_*") if not p.is_symlink() and (p / "manifest.json").is_file()}


@pytest.fixture(autouse=True)
def _node(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RSLURM_NODE_NAME", "n1")


@pytest.fixture
def drained(tmp_path: Path) -> tuple[Path, Path]:
    """Steps 1-3 committed locally and drained to a POSIX tier."""
    local, dur = tmp_path / "nvme", tmp_path / "lustre"
    save_steps(local, [1, 2, 3], 64 * KiB)
    r = drain(local, dur)
    assert r.returncode == 0, r.stderr
    assert committed(dur) == {1, 2, 3}
    return local, dur


@pytest.mark.proc
def test_retention_and_gc_never_delete_through_a_linked_step_directory(drained: tuple[Path, Path],
                                                                         tmp_path: Path) -> None:
    local, dur = drained
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(dur / RUN / sdir(1), elsewhere / "old")  # looks like a committed step in every way
    shutil.copytree(dur / RUN / sdir(1), elsewhere / "new")
    before = tree(elsewhere)
    (dur / RUN / sdir(0)).symlink_to(elsewhere / "old")  # older than every step: retention's first target
    (dur / RUN / sdir(99)).symlink_to(elsewhere / "new")  # newer than every step
    r = drain(local, dur, RSLURM_KEEP_LAST="1")
    assert r.returncode == 0, r.stderr
    gc = rslurm("gc", "--local-dir", str(local), "--durable", str(dur), "--keep-last", "1")
    assert gc.returncode == 0, gc.stderr
    assert tree(elsewhere) == before, "something outside the durable tier was deleted or changed"
    assert (dur / RUN / sdir(0)).is_symlink() and (dur / RUN / sdir(99)).is_symlink()
    assert committed(dur) == {3}, "retention must act on the real steps"


@pytest.mark.proc
def test_the_daemon_never_writes_through_a_link_and_drains_the_rest(drained: tuple[Path, Path],
                                                                     tmp_path: Path) -> None:
    local, dur = drained
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (dur / RUN / sdir(4)).symlink_to(elsewhere)
    save_steps(local, [4, 5], 64 * KiB)
    r = drain(local, dur, RSLURM_KEEP_LAST="10")
    assert r.returncode == 1, r.stderr  # docs/daemon.md: 1 when some step could not be drained
    assert str(dur / RUN / sdir(4)) in r.stderr and "symbolic link" in r.stderr, r.stderr
    assert not list(elsewhere.iterdir()), "the daemon wrote through the link"
    assert committed(dur) == {1, 2, 3, 5}


@pytest.mark.proc
def test_a_file_where_the_commit_markers_go_is_named_with_what_to_do(drained: tuple[Path, Path]) -> None:
    """A file planted at ``step_N/commits``, where the drain makes the directory of the step's commit markers:
    the drain of that step fails naming the file and what to do (not a bare "Not a directory"), leaves the
    file as it was, and drains the other steps; once the file is moved away, the next pass commits the step."""
    local, dur = drained
    save_steps(local, [4, 5], 64 * KiB)
    (dur / RUN / sdir(4)).mkdir()
    planted = dur / RUN / sdir(4) / "commits"
    planted.write_text("not rslurm's")
    r = drain(local, dur, RSLURM_KEEP_LAST="10")
    assert r.returncode == 1, r.stderr
    assert f"{planted} is a file where the layout has a directory" in r.stderr, r.stderr[-3000:]
    assert "move it away" in r.stderr and "Not a directory" not in r.stderr, r.stderr[-3000:]
    assert planted.read_text() == "not rslurm's"
    assert committed(dur) == {1, 2, 3, 5}
    planted.rename(dur / "moved-away")
    r = drain(local, dur, RSLURM_KEEP_LAST="10")
    assert r.returncode == 0, r.stderr
    assert committed(dur) == {1, 2, 3, 4, 5}


@pytest.mark.proc
def test_restore_and_listing_skip_links_and_special_files(drained: tuple[Path, Path], tmp_path: Path,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    local, dur = drained
    shutil.copytree(dur / RUN / sdir(3), tmp_path / "copy")
    (dur / RUN / sdir(50)).symlink_to(tmp_path / "copy")  # a linked "newer step" is not a step
    fifo_step = dur / RUN / sdir(40)
    fifo_step.mkdir()
    os.mkfifo(fifo_step / "manifest.json")
    shutil.rmtree(local)
    state: dict[str, Any] = {"w": torch.zeros(16 * KiB), "step": 0}
    with caplog.at_level("WARNING", logger="resilient_slurm"):
        with Checkpointer(local_dir=str(local), run_id=RUN, durable=str(dur)) as ck:
            assert ck.restore(state) == 3
    assert state["step"] == 3 and torch.equal(state["w"], torch.full((16 * KiB,), 3.0))
    assert str(fifo_step / "manifest.json") in caplog.text
    st = rslurm("status", "--json", "--local-dir", str(local), "--durable", str(dur))
    assert st.returncode == 0, st.stderr
    ls = rslurm("ls", "--local-dir", str(local), "--durable", str(dur))
    assert ls.returncode == 0, ls.stderr


def test_reads_refuse_links_and_fifos_inside_the_tier(tmp_path: Path) -> None:
    tier = PosixTier(str(tmp_path / "tier"))
    (tmp_path / "secret").write_bytes(b"outside")
    (tmp_path / "tier" / "run").mkdir()
    (tmp_path / "tier" / "run" / "link").symlink_to(tmp_path / "secret")
    os.mkfifo(tmp_path / "tier" / "run" / "fifo")
    for key in ("run/link", "run/fifo"):
        with pytest.raises(UnsafePathError, match=key.split("/")[1]):
            tier.get_bytes(key)
        with pytest.raises(UnsafePathError):
            tier.get_file(key, str(tmp_path / "dest"), size=7, checksum="0")
    assert [o.key for o in tier.list("run")] == []
    with pytest.raises(UnsafePathError):
        tier.put_bytes("run/link/x", b"data")
    assert (tmp_path / "secret").read_bytes() == b"outside"


# ------------------------------------------------------------------------------------------ a full tier
@pytest.fixture
def tiny(tmp_path: Path) -> Any:
    with mounted_tmpfs(tmp_path / "tiny", "8m") as mnt:
        yield mnt


def test_a_durable_filesystem_unmounted_under_the_tier_is_never_made_again_on_the_nodes_disk(tmp_path: Path) -> None:
    """The durable tier's filesystem unmounted while a daemon ran: its mount point stayed, empty, on the node's
    own disk, and the next drain made the tier's root again there and reported the steps durable. A root that is
    gone since the tier was opened, or a mount point left empty, is an error that may pass; nothing is written.
    A filesystem mounted there again (an automounter's) is written into as before."""
    from resilient_slurm.errors import TransientStorageError

    def mount(where: Path) -> None:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(where)], check=True)

    src = tmp_path / "shard"
    src.write_bytes(b"x" * 5000)
    with mounted_tmpfs(tmp_path / "lustre", "8m") as mnt:
        for root in (mnt / "durable", mnt):  # the tier below the mount point, and the mount point itself
            tier = PosixTier(str(root), max_attempts=1)
            tier.put_bytes("r/step_000000000001/manifest.json", b"{}")
            subprocess.run(["umount", str(mnt)], check=True)
            try:
                said = "is gone since rslurm opened it" if root != mnt else "is no longer a mount point since"
                with pytest.raises(TransientStorageError, match=f"durable tier {root} {said}"):
                    tier.put_bytes("r/step_000000000002/manifest.json", b"{}")
                with pytest.raises(TransientStorageError, match=said):
                    tier.put_file(str(src), "r/step_000000000002/__0_0.distcp", size=5000,
                                  checksum=hashlib.sha256().hexdigest()[:16])
                assert not any(mnt.iterdir()), "the tier was made again on the node's disk"
            finally:
                mount(mnt)  # mounted again: another device where the tier was
            root.mkdir(exist_ok=True)  # the filesystem back, with the tier's root on it (a fresh tmpfs has none)
            tier.put_bytes("r/tags.json", b"{}")  # an automounter's remount is the tier's filesystem again
            assert (root / "r" / "tags.json").read_bytes() == b"{}"
    # A reader's tier whose root did not exist yet makes it at the first write, as before.
    late = PosixTier(str(tmp_path / "late"), create=False)
    late.put_bytes("r/tags.json", b"{}")
    assert (tmp_path / "late" / "r" / "tags.json").read_bytes() == b"{}"


@pytest.mark.proc
def test_a_full_durable_tier_is_named_not_masked(tmp_path: Path, tiny: Path) -> None:
    local = tmp_path / "nvme"
    save_steps(local, [1], 16 * MiB)
    r = drain(local, tiny)
    assert r.returncode == 1
    assert "filled up" in r.stderr, r.stderr[-3000:]
    # It names the file being written, not its temporary name (removed already).
    said = [line for line in r.stderr.splitlines() if "filled up" in line]
    assert all(".tmp-rslurm-" not in line and f" to {tiny}" in line for line in said), said
    assert not [p for p in tree(tiny) if ".tmp-rslurm-" in p], tree(tiny)
    assert committed(tiny) == set()


@pytest.mark.proc
def test_a_fetch_into_a_full_local_disk_is_named_not_masked(tmp_path: Path, tiny: Path) -> None:
    local, dur = tmp_path / "nvme", tmp_path / "lustre"
    save_steps(local, [1], 16 * MiB)
    assert drain(local, dur).returncode == 0
    m = Manifest.from_json((dur / RUN / sdir(1) / "manifest.json").read_bytes())
    shard = max(m.shards, key=lambda s: s.size)
    tier = PosixTier(str(dur))
    with pytest.raises(InsufficientSpaceError, match="filled up") as err:
        tier.get_file(f"{RUN}/{sdir(1)}/{shard.path}", str(tiny / "shard"), size=shard.size,
                      checksum=shard.checksum)
    assert ".tmp-rslurm-" not in str(err.value) and str(tiny / "shard") in str(err.value), err.value
    assert not list(tiny.iterdir()), "the temp file of the failed fetch was left behind"
