"""Retention: the pure policy, and the engine applying it to real step directories (including a step
that a reader holds open with the shared lock of ``fileio.reading_step``)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from conftest import checkpoint_entries

from resilient_slurm import Checkpointer, ConfigError
from resilient_slurm.checkpoint.policy import RetentionPolicy
from resilient_slurm.manifest import Manifest
from resilient_slurm.storage.fileio import reading_step as reading

RUN = "ret"


# ---------------------------------------------------------------------------------------- policy
def test_keep_last() -> None:
    p = RetentionPolicy(keep_last=3)
    assert p.keep(range(1, 8)) == {5, 6, 7}
    assert p.deletable(range(1, 8)) == [1, 2, 3, 4]
    assert p.keep([2, 1]) == {1, 2}
    assert p.deletable([]) == [] and p.keep([]) == set()


def test_deletable_is_oldest_first_for_unsorted_input_with_duplicates() -> None:
    p = RetentionPolicy(keep_last=2)
    assert p.deletable([30, 10, 50, 10, 20, 40, 50]) == [10, 20, 30]
    assert p.keep([30, 10, 50, 10, 20, 40, 50]) == {40, 50}


def test_keep_every_milestones() -> None:
    p = RetentionPolicy(keep_last=2, keep_every=4)
    assert p.keep(range(1, 11)) == {4, 8, 9, 10}
    assert p.deletable(range(1, 11)) == [1, 2, 3, 5, 6, 7]
    # milestones among sparse, irregular steps (cadence by time)
    p = RetentionPolicy(keep_last=1, keep_every=1000)
    assert p.keep([999, 1000, 1998, 2000, 2500]) == {1000, 2000, 2500}


def test_newest_is_always_kept() -> None:
    for p in (RetentionPolicy(keep_last=1), RetentionPolicy(keep_last=1, keep_every=10)):
        for steps in ([7], [3, 5, 7], [10, 11], list(range(1, 100))):
            assert max(steps) in p.keep(steps)
            assert max(steps) not in p.deletable(steps)


@pytest.mark.parametrize("kw", [{"keep_last": 0}, {"keep_last": -2}, {"keep_every": 0}, {"keep_every": -5}])
def test_invalid_arguments_raise_config_error(kw: dict[str, int]) -> None:
    with pytest.raises(ConfigError, match=next(iter(kw))):
        RetentionPolicy(**kw)


def test_checkpointer_rejects_invalid_retention(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="keep_last"):
        Checkpointer(local_dir=str(tmp_path), run_id=RUN, keep_last=0)


# ---------------------------------------------------------------------------------------- engine
def small_state(step: int) -> dict[str, object]:
    return {"w": torch.full((64,), float(step)), "step": step}


def on_disk(root: Path) -> list[str]:
    return checkpoint_entries(root / RUN)


def steps_on_disk(root: Path) -> set[int]:
    names = on_disk(root)
    assert not [n for n in names if ".tmp-" in n], f"temp directories left behind: {names}"
    return {int(n.split("_")[1]) for n in names}


def test_engine_keep_last_2_every_4_over_ten_steps(tmp_path: Path) -> None:
    root = tmp_path / "nvme"
    with Checkpointer(local_dir=str(root), run_id=RUN, keep_last=2, keep_every=4) as ck:
        for s in range(1, 11):
            ck.save(s, small_state(s))
    assert steps_on_disk(root) == {4, 8, 9, 10}
    st = small_state(0)
    with Checkpointer(local_dir=str(root), run_id=RUN, keep_last=2, keep_every=4) as ck:
        assert ck.restore(st) == 10
    assert torch.equal(st["w"], torch.full((64,), 10.0)) and st["step"] == 10
    # a kept milestone is still a complete step
    d = root / RUN / f"step_{4:012d}"
    m = Manifest.from_json((d / "manifest.json").read_bytes())
    assert m.step == 4
    for sh in m.shards:
        assert (d / sh.path).stat().st_size == sh.size


def test_retention_spares_temp_directories_of_this_incarnation_and_restore_removes_all(tmp_path: Path) -> None:
    """Retention runs on the leader's writer thread while other ranks of its domain may already write the
    next save into its temp directory: it removes only what earlier incarnations left. A restore (before
    any save of its incarnation) removes every temp directory."""
    root = tmp_path / "nvme"
    with Checkpointer(local_dir=str(root), run_id=RUN, keep_last=1) as ck:
        ck.save(1, small_state(1))
        run = root / RUN
        in_flight = run / f"step_{2:012d}.tmp-{ck.topology.nonce}-9"  # another rank's save under way
        in_flight.mkdir()
        (in_flight / "__1_0.distcp").write_bytes(b"x" * 100)
        abandoned = run / f"step_{1:012d}.tmp-0badcafe-3"  # a killed earlier incarnation's
        abandoned.mkdir()
        ck.save(3, small_state(3))  # retention after it
        ck.wait()
        assert sorted(on_disk(root)) == [in_flight.name, f"step_{3:012d}"]
    with Checkpointer(local_dir=str(root), run_id=RUN, keep_last=1) as ck:
        assert ck.restore(small_state(0)) == 3
    assert steps_on_disk(root) == {3}


def test_step_being_read_survives_retention_until_released(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="resilient_slurm")
    root = tmp_path / "nvme"
    with Checkpointer(local_dir=str(root), run_id=RUN, keep_last=2) as ck:
        ck.save(1, small_state(1))
        ck.save(2, small_state(2))
        held = root / RUN / f"step_{1:012d}"
        with reading(str(held)):
            ck.save(3, small_state(3))  # retention wants step 1: it is being read
            assert steps_on_disk(root) == {1, 2, 3}
            ck.save(4, small_state(4))  # step 2 goes, step 1 still held
            assert steps_on_disk(root) == {1, 3, 4}
            assert (held / "manifest.json").exists() and (held / "__0_0.distcp").exists()
        assert any("step 1 is busy (a reader holds it" in r.getMessage() for r in caplog.records)
        ck.save(5, small_state(5))  # released: now it goes
        assert steps_on_disk(root) == {4, 5}


def test_reader_lock_is_shared_between_readers(tmp_path: Path) -> None:
    """Two readers at once must not block each other (LOCK_SH), and a missing step is tolerated."""
    root = tmp_path / "nvme"
    with Checkpointer(local_dir=str(root), run_id=RUN, keep_last=1) as ck:
        ck.save(1, small_state(1))
        d = str(root / RUN / f"step_{1:012d}")
        with reading(d), reading(d):
            ck.save(2, small_state(2))
            assert steps_on_disk(root) == {1, 2}
        with reading(str(root / RUN / "step_000000000077")):
            pass
        ck.save(3, small_state(3))
        assert steps_on_disk(root) == {3}
