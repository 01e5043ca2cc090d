"""A full disk: the pre-check refuses a save that cannot fit, and a save that really hits ENOSPC
mid-file fails cleanly. Either way nothing partial is left and older steps still restore.

Runs on a real 8 MiB tmpfs, so it needs root (CI runs as root)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import checkpoint_entries, mounted_tmpfs

from resilient_slurm import Checkpointer, InsufficientSpaceError

RUN = "full"
MiB = 1 << 20

pytestmark = pytest.mark.root


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    with mounted_tmpfs(tmp_path / "tiny", "8m") as mnt:
        yield mnt


def state_of(step: int, nbytes: int) -> dict[str, object]:
    return {"w": torch.full((nbytes // 4,), float(step)), "tag": f"step{step}"}


def run_entries(root: Path) -> list[str]:
    return checkpoint_entries(root / RUN)


def restore_check(root: Path, want: int, nbytes: int) -> None:
    st = state_of(-1, nbytes)
    with Checkpointer(local_dir=str(root), run_id=RUN) as ck:
        assert ck.restore(st) == want
    assert torch.equal(st["w"], torch.full((nbytes // 4,), float(want)))
    assert st["tag"] == f"step{want}"


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def test_precheck_refuses_a_save_that_cannot_fit(small_fs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RSLURM_FREE_SPACE_MARGIN", str(256 * 1024))
    small = 256 * 1024
    with Checkpointer(local_dir=str(small_fs), run_id=RUN) as ck:
        ck.save(1, state_of(1, small))
        before = run_entries(small_fs)
        free = free_bytes(small_fs)
        with pytest.raises(InsufficientSpaceError) as ei:
            ck.save(2, state_of(2, 12 * MiB))
        msg = str(ei.value)
        assert str(small_fs / RUN) in msg, msg
        assert "step 2" in msg and "needs 12." in msg and "MiB free" in msg
        # refused before writing: no temp directory, no bytes consumed
        assert run_entries(small_fs) == before == ["step_000000000001"]
        assert free_bytes(small_fs) == free
        # the Checkpointer stays usable: a save that fits works
        ck.save(3, state_of(3, small))
    restore_check(small_fs, 3, small)
    assert run_entries(small_fs) == ["step_000000000001", "step_000000000003"]


def test_default_margin_refuses_on_a_tiny_filesystem(small_fs: Path) -> None:
    """The default margin (64 MiB must stay free) alone makes an 8 MiB filesystem too small."""
    with Checkpointer(local_dir=str(small_fs), run_id=RUN) as ck:
        with pytest.raises(InsufficientSpaceError, match="MiB"):
            ck.save(1, state_of(1, 64 * 1024))
    assert run_entries(small_fs) == []


def test_real_enospc_mid_write_fails_cleanly(small_fs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Switch the pre-check off so that the write itself runs out of space (a negative margin did this
    # before settings were range-checked).
    import resilient_slurm.checkpoint.engine as engine

    monkeypatch.setattr(engine, "check_free_space", lambda *a, **k: None)
    small, big = 256 * 1024, 3 * MiB
    with Checkpointer(local_dir=str(small_fs), run_id=RUN) as ck:
        ck.save(1, state_of(1, small))
        filler = small_fs / "filler"
        # Leave about 1.5 MiB free: the 3 MiB shard starts writing and fails half way.
        with open(filler, "wb") as f:
            f.write(b"\0" * (free_bytes(small_fs) - 3 * MiB // 2))
        assert MiB < free_bytes(small_fs) < 2 * MiB
        with pytest.raises(InsufficientSpaceError) as ei:
            ck.save(2, state_of(2, big))
        msg = str(ei.value)
        assert str(small_fs / RUN) in msg and "while writing" in msg, msg
        assert run_entries(small_fs) == ["step_000000000001"], "the temp directory was not removed"
        restore_check(small_fs, 1, small)
        # a non-blocking save hits the same wall; the error comes back on wait()
        ck.save(2, state_of(2, big), blocking=False)
        with pytest.raises(InsufficientSpaceError):
            ck.wait()
        assert run_entries(small_fs) == ["step_000000000001"]
        # free space: the same Checkpointer saves again
        filler.unlink()
        ck.save(2, state_of(2, big))
    assert run_entries(small_fs) == ["step_000000000001", "step_000000000002"]
    restore_check(small_fs, 2, big)
