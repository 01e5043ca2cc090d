"""A child forked while a thread holds one of rslurm's ``flock`` locks never keeps it (``resilient_slurm.flocks``).

The case that made this a test: a DataLoader forks its workers at each epoch while the checkpoint
writer thread holds the run's tags lock (retention deleting an old step). A flock belongs to the open
file description, which the child shares: the worker held the lock for its whole life, the next
retention waited for it, the training step waited for the writer, and the epoch never ended (a hang
on the test cluster, stacks in tags_lock). Here with real Checkpointers, real DataLoader workers
(forked) and a real second process holding the lock."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import checkpoint_entries
from torch.utils.data import DataLoader

from resilient_slurm import Checkpointer, layout
from resilient_slurm.flocks import held_fds
from resilient_slurm.layout import StepBusy, TempKind, delete_step
from resilient_slurm.storage.fileio import reading_step

pytestmark = pytest.mark.proc  # every test here starts processes (tests/check_tier.py)

RUN = "forklock"


def state(step: int) -> dict[str, object]:
    return {"w": torch.full((64,), float(step)), "step": step}


def steps_on_disk(root: Path) -> set[int]:
    return {int(n.split("_")[1]) for n in checkpoint_entries(root / RUN) if ".tmp-" not in n}


def worker_iter() -> Iterator[torch.Tensor]:
    """An iterator over a DataLoader with one worker process, forked when the iterator is made (as at the
    start of every epoch); the worker lives as long as the iterator."""
    it = iter(DataLoader(list(range(64)), batch_size=1, num_workers=1, multiprocessing_context="fork"))
    next(it)  # the worker runs
    return it


def test_a_worker_forked_while_retention_holds_the_tags_lock_does_not_stall_the_next_retention(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "nvme"
    inside, forked = threading.Event(), threading.Event()
    real = layout.local_tagged_steps

    def tag_check_that_waits_for_a_fork(run_dir: str, run_id: str) -> frozenset[int]:
        # Called under the tags lock: the first deletion holds the lock until the main thread has forked.
        if not inside.is_set():
            inside.set()
            assert forked.wait(30)
        return real(run_dir, run_id)

    monkeypatch.setattr(layout, "local_tagged_steps", tag_check_that_waits_for_a_fork)
    monkeypatch.setattr(layout, "TAGS_LOCK_WAIT_S", 5.0)  # a kept lock shows as a kept step, not a hang
    with Checkpointer(local_dir=str(root), run_id=RUN, keep_last=1) as ck:
        ck.save(1, state(1))
        ck.save(2, state(2), blocking=False)  # the writer thread deletes step 1 under the tags lock
        assert inside.wait(30)
        it = worker_iter()  # forked while the writer holds the lock
        forked.set()
        ck.wait()  # the commit; retention goes on until the lock is let go
        deadline = time.monotonic() + 30
        while steps_on_disk(root) != {2}:
            assert time.monotonic() < deadline, steps_on_disk(root)
            time.sleep(0.05)
        ck.save(3, state(3))  # the worker is alive: step 2 goes only if it did not keep the lock
        assert steps_on_disk(root) == {3}
        next(it)
        del it
    assert not held_fds()


def test_a_worker_forked_while_a_reader_holds_a_step_does_not_keep_it_from_retention(tmp_path: Path) -> None:
    root = tmp_path / "nvme"
    with Checkpointer(local_dir=str(root), run_id=RUN, keep_last=1) as ck:
        ck.save(1, state(1))
        ck.wait()
        with reading_step(str(root / RUN / f"step_{1:012d}")):
            it = worker_iter()
        ck.save(2, state(2))
        ck.wait()
        assert steps_on_disk(root) == {2}
        next(it)
    assert not held_fds()


def test_a_tags_lock_held_elsewhere_keeps_the_step_and_says_why(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process holds the run's tags lock and does not let go: a deletion gives up after
    TAGS_LOCK_WAIT_S (retention runs on the writer thread; a step must not wait forever) and the step
    stays committed."""
    root = tmp_path / "nvme"
    with Checkpointer(local_dir=str(root), run_id=RUN, keep_last=3) as ck:
        ck.save(1, state(1))
        ck.wait()
    run_dir = str(root / RUN)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys\n"
         f"fd = os.open({run_dir!r}, os.O_RDONLY | os.O_DIRECTORY)\n"
         "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('held', flush=True)\nsys.stdin.read()\n"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        monkeypatch.setattr(layout, "TAGS_LOCK_WAIT_S", 0.3)
        with pytest.raises(StepBusy) as busy:
            delete_step(run_dir, 1, TempKind.GC)
        assert "tags lock was held for more than" in busy.value.why
        assert steps_on_disk(root) == {1}
    finally:
        holder.communicate("", timeout=30)
    assert delete_step(run_dir, 1, TempKind.GC) and steps_on_disk(root) == set()
