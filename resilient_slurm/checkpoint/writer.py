"""A Checkpointer's saves after the decision to save: the staging copy (training thread), then its one
background writer thread and what runs on it: a save's write and commit, then retention and the peer replica
round (domain leaders), the staging buffer's pre-allocation, and the tags' durable copy (rank 0).

Who calls what, and when: the :class:`~resilient_slurm.checkpoint.checkpointer.Checkpointer` (training
thread) submits through :class:`SaveWriter` and waits on it; at most one save is in flight, because the
Checkpointer waits for the previous one (:meth:`SaveWriter.finish_inflight`) before staging the next. A
save's failure is raised where the training thread waits for it; retention, replication, pre-allocation and
the tags' copy are best effort: their failures are logged, never raised.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from ..control.rank import RankLink
from ..errors import ReplicaMismatchError
from ..storage.tier import StorageTier
from .coordination import Topology
from .engine import Engine, PendingSave, SaveOutcome
from .reporting import CheckpointReporter
from .tagging import copy_to_durable

_Found = TypeVar("_Found", PendingSave, SaveOutcome)  # what a save step returns, with its replica mismatches

# The Checkpointer's logger, as before the writer left its module: a program's log filters keep working.
log = logging.getLogger("resilient_slurm.checkpoint.checkpointer")


class SaveWriter:
    """The writer thread and its futures (see the module docstring)."""

    def __init__(self, engine: Engine, topology: Topology, report: CheckpointReporter, link: RankLink,
                 durable_tier: StorageTier | None, run_id: str) -> None:
        self._engine = engine
        self._topology = topology
        self._report = report
        self._link = link
        self._durable_tier = durable_tier
        self._run_id = run_id
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rslurm-ckpt")
        self.inflight: Future[SaveOutcome] | None = None
        self.retention: Future[list[int]] | None = None
        self.tags_copy: Future[None] | None = None  # rank 0: the tags' durable copy, after a tag()
        self.replication: Future[Any] | None = None  # domain leaders: the peer replica round of the last save
        self.prepared: Future[Any] | None = None
        self.staging_planned = False  # the same on every rank: prepare is collective

    @property
    def failed(self) -> bool:
        """The save in flight has failed (its error not raised yet)."""
        return self.inflight is not None and self.inflight.done() and self.inflight.exception() is not None

    def submit(self, pending: PendingSave, step: int, reason: str, t0: float) -> None:
        """Write and commit a staged save; then retention and the peer replica round, on the same thread."""
        self.inflight = self._pool.submit(self._write_and_report, pending, step, reason, t0)
        if self._topology.is_leader:
            # Retention runs after the commit is reported, on the same single writer thread: deleting
            # a large step can take as long as writing one (discard-mounted filesystems), and the
            # caller waiting for the commit should not wait for it. The next save queues behind it.
            self.retention = self._pool.submit(self._retain)
        if self._engine.peers.active:
            # The partner's copy (peers.py), after the commit and retention on the same writer thread:
            # one round per save on every leader, so the rounds pair up; the next save queues behind it.
            self.replication = self._pool.submit(self._replicate, step, reason)

    def finish_inflight(self) -> SaveOutcome | None:
        """Wait for the save in flight; re-raises its error here, on the training thread."""
        fut, self.inflight = self.inflight, None
        return fut.result() if fut is not None else None

    def prepare(self, state: Mapping[str, Any]) -> None:
        """Plan a save of ``state`` now (collective) and allocate the staging buffer in the background.

        An emergency save that comes before the first interval save (a preemption soon after the start
        or a restart) then pays only the copy, not the allocation and page faults of a buffer as large
        as the state (about 1.3 s per GiB here); and the memory is reserved while training, not at
        the moment the job is told to leave."""
        self.staging_planned = True
        layout = self._engine.plan_layout(state)
        self.prepared = self._pool.submit(self._engine.ensure_staging, layout)

    def finish_prepared(self) -> None:
        # A failure here is not fatal: the save allocates the buffer itself, and reports a real failure.
        fut, self.prepared = self.prepared, None
        _settle(fut, "pre-allocating the staging buffer")

    def finish_retention(self) -> None:
        # Retention failing must not fail training; it is retried after the next save.
        fut, self.retention = self.retention, None
        _settle(fut, f"retention in {self._engine.run_dir}")

    def copy_tags(self) -> None:
        """Rank 0, after a tag: the tags' durable copy, in the background (tagging.py)."""
        assert self._durable_tier is not None
        self.tags_copy = self._pool.submit(copy_to_durable, self._engine.run_dir, self._run_id, self._durable_tier)

    def stage(self, step: int, state: Mapping[str, Any], reason: str) -> PendingSave:
        """Training thread: the engine's staging copy of ``state`` (collective), with its replica mismatches
        and failure reported."""
        return self._reported(step, reason, "digest", lambda: self._engine.stage(step, state, reason))

    def _reported(self, step: int, reason: str, found_by: str, run: Callable[[], _Found]) -> _Found:
        """``run()`` (staging, or writing and committing) with its replica mismatches and failure reported."""
        try:
            result = run()
        except Exception as exc:
            if isinstance(exc, ReplicaMismatchError):
                self._report.mismatches(step, exc.mismatches, found_by)
            self._report.save_failed(step, reason, exc)
            raise
        self._report.mismatches(step, result.mismatches, found_by)
        return result

    def close(self) -> None:
        """After the last save was waited for: the best-effort tasks, then the thread."""
        self.finish_prepared()
        self.finish_retention()
        fut, self.tags_copy = self.tags_copy, None
        _settle(fut, "copying the tags to the durable tier")
        fut, self.replication = self.replication, None
        _settle(fut, "the peer replica of the last save")
        self._pool.shutdown(wait=True)

    # ------------------------------------------------------------------ on the writer thread
    def _write_and_report(self, pending: PendingSave, step: int, reason: str, t0: float) -> SaveOutcome:
        """Write and commit, then tell the launcher (if any) the step is committed."""
        outcome = self._reported(step, reason, "commit", lambda: self._engine.write_and_commit(pending))
        self._link.committed(step, reason)
        self._report.save_committed(step, reason, outcome, t0)
        return outcome

    def _retain(self) -> list[int]:
        """Domain leader: local retention after a save. Its failure is logged here: the next non-blocking
        save replaces this future without waiting for it."""
        try:
            deleted = self._engine.apply_retention()
        except Exception as exc:
            log.warning("retention in %s failed: %s; older steps were kept (the next save retries)",
                        self._engine.run_dir, exc)
            return []
        self._report.retention_deleted(deleted)
        return deleted

    def _replicate(self, step: int, reason: str) -> None:
        """Domain leader with a partner: one peer replica round (peers.py) after a save, and its
        ``peer_replica`` event (what was sent, what was kept, and why not)."""
        self._report.peer_replica(step, self._engine.peers.replicate(step, reason))


def _settle(fut: Future[Any] | None, what: str) -> None:
    """Wait for a best-effort background task; log (do not raise) its failure."""
    if fut is None:
        return
    try:
        fut.result()
    except Exception as exc:
        log.warning("%s failed: %s", what, exc)
