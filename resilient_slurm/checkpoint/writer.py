"""A Checkpointer's saves after the decision to save: the staging copy (training thread), then its one
background writer thread and what runs on it: a save's write and commit, then retention and the peer replica
round (domain leaders), the staging buffer's pre-allocation, and the tags' durable copy (rank 0).

Who calls what, and when: the :class:`~resilient_slurm.checkpoint.checkpointer.Checkpointer` (training
thread) submits through :class:`SaveWriter` and waits on it; at most one save is in flight, because the
Checkpointer waits for the previous one (:meth:`SaveWriter.finish_inflight`) before staging the next. A
save's failure is raised where the training thread waits for it; retention, replication, pre-allocation and
the tags' copy are best effort: their failures are logged, never raised.

At the interpreter's exit, a program that did not call ``close()`` still gets its queued work done: the exit
waits for the writer, as it did when the writer was a ``ThreadPoolExecutor``. Except when the program is
ending on an unhandled exception, or closes the Checkpointer because of one (``close(failed=True)``, which
``with Checkpointer(...)`` and the integrations do), and the writer's thread then spends more than
:data:`EXIT_RANK_WAIT_S` waiting for other ranks (a peer stopped or gone while a save was being committed):
nothing more will come of the save. The writer is left, the log names its task, and the rank ends at once
(exit code 1) instead of waiting in that collective for ``collective_timeout`` (600 s by default) while the
launcher waits for it.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any, TypeVar

from ..control.rank import RankLink
from ..errors import ReplicaMismatchError
from ..storage.tier import StorageTier
from .coordination import RANK_WAITS, Topology
from .engine import Engine, PendingSave, SaveOutcome
from .reporting import CheckpointReporter
from .tagging import copy_to_durable

_Found = TypeVar("_Found", PendingSave, SaveOutcome)  # what a save step returns, with its replica mismatches

# The Checkpointer's logger, as before the writer left its module: a program's log filters keep working.
log = logging.getLogger("resilient_slurm.checkpoint.checkpointer")

#: A rank ending on an unhandled exception waits at most this long for other ranks in its writer's collective
#: (a save's commit, a peer round) before it ends anyway (see the module docstring). Local work (writing the
#: shards) is always waited for: it ends by itself.
EXIT_RANK_WAIT_S = 30.0
_T = TypeVar("_T")


class WriterThread:
    """One daemon thread that runs the tasks submitted to it in order, each with a future. A
    ``ThreadPoolExecutor`` of one thread would do but for its exit: the interpreter joins it without a bound,
    whatever the thread is waiting for (:meth:`SaveWriter._at_exit` decides instead)."""

    def __init__(self, name: str) -> None:
        self._tasks: queue.SimpleQueue[tuple[Future[Any], str, Callable[[], Any]] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._queued = 0  # submitted, not finished
        self._shut = False
        self.current = ""  # what the running task is (for the exit's log line)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def ident(self) -> int | None:
        """The thread's id (for :data:`~.coordination.RANK_WAITS`)."""
        return self._thread.ident

    def submit(self, what: str, fn: Callable[..., _T], *args: Any) -> Future[_T]:
        fut: Future[_T] = Future()
        with self._lock:  # the put too: a shutdown between the check and the put would strand the task
            if self._shut:
                raise RuntimeError("the checkpoint writer is closed: no save after close()")
            self._queued += 1
            self._tasks.put((fut, what, lambda: fn(*args)))
        return fut

    def _run(self) -> None:
        while (task := self._tasks.get()) is not None:
            fut, what, call = task
            del task
            self.current = what
            try:
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(call())
                    except BaseException as exc:  # as concurrent.futures does: the waiter re-raises it
                        fut.set_exception(exc)
            finally:
                # Drop the task before waiting for the next: its arguments (a save's staging buffer) must not
                # outlive it while the thread idles.
                del fut, call
                self.current = ""
                with self._idle:
                    self._queued -= 1
                    self._idle.notify_all()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until every task submitted has finished (at most ``timeout`` s); whether they have."""
        with self._idle:
            return self._idle.wait_for(lambda: self._queued == 0, timeout)

    def shutdown(self) -> None:
        """Let the tasks submitted finish, then end the thread. Idempotent."""
        with self._lock:
            first, self._shut = not self._shut, True
        if first:
            self._tasks.put(None)
        self._thread.join()


def _exception_at_exit() -> BaseException | None:
    """The unhandled exception the interpreter is ending on (set before the exit hooks run), if any."""
    return getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)


def _end_now(failing: BaseException | None) -> None:
    """End the process now, without the interpreter's teardown, which would wait for (or abort on) the
    collective the writer's thread is in: exit code 1, or death by SIGINT for an interrupt, as Python's."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    if isinstance(failing, KeyboardInterrupt):
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(1)


def _exit_hook(ref: weakref.ref[SaveWriter]) -> Callable[[], None]:
    pid = os.getpid()

    def hook() -> None:  # a weak reference: the hook does not keep a dropped Checkpointer's writer alive
        if os.getpid() != pid:  # a forked child (a DataLoader worker) inherits the hook, not the thread
            return
        writer = ref()
        if writer is not None:
            writer._at_exit()
    return hook


def _register_exit_hook(hook: Callable[[], None]) -> None:
    # threading's exit hooks run newest first: registered after concurrent.futures' own (imported here so that
    # it is), this one runs while its pools still take work, which a save finished at exit needs. atexit where
    # threading has no such hook.
    import concurrent.futures.thread  # noqa: F401  (registers concurrent.futures' exit hook)

    register = getattr(threading, "_register_atexit", None)
    try:
        (register or atexit.register)(hook)
    except RuntimeError:  # created while the interpreter is already ending
        pass


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
        self._pool = WriterThread("rslurm-ckpt")
        self._closed = False
        self._abandoned = False  # closed after an error with its thread still waiting for other ranks
        self._exc_before = _exception_at_exit()  # an interactive session's earlier error is not this exit's
        _register_exit_hook(_exit_hook(weakref.ref(self)))
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
        self.inflight = self._pool.submit(f"the save of step {step}", self._write_and_report, pending, step, reason, t0)
        if self._topology.is_leader:
            # Retention runs after the commit is reported, on the same single writer thread: deleting
            # a large step can take as long as writing one (discard-mounted filesystems), and the
            # caller waiting for the commit should not wait for it. The next save queues behind it.
            self.retention = self._pool.submit(f"retention after step {step}", self._retain)
        if self._engine.peers.active:
            # The partner's copy (peers.py), after the commit and retention on the same writer thread:
            # one round per save on every leader, so the rounds pair up; the next save queues behind it.
            self.replication = self._pool.submit(f"the peer replica round of step {step}", self._replicate, step,
                                                 reason)

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
        self.prepared = self._pool.submit("allocating the staging buffer", self._engine.ensure_staging, layout)

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
        self.tags_copy = self._pool.submit("copying the tags to the durable tier", copy_to_durable,
                                           self._engine.run_dir, self._run_id, self._durable_tier)

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
        self._closed = True
        self._pool.shutdown()

    def settle(self, *, bounded: bool) -> bool:
        """Wait for every task submitted. ``bounded`` (the program is ending on an error): stop waiting once the
        writer's thread has spent :data:`EXIT_RANK_WAIT_S` since this call waiting for other ranks. Whether
        every task finished."""
        start = time.monotonic()
        if not bounded:
            return self._pool.wait_idle()
        while not self._pool.wait_idle(0.2):
            if RANK_WAITS.waited(self._pool.ident, start) > EXIT_RANK_WAIT_S:
                return False
        return True

    def left_stuck(self, why: str, link: RankLink) -> bool:
        """``Checkpointer.close(failed=True)``: :meth:`settle`, bounded; when it gives up, :meth:`abandon` the
        writer and close the rank's link (what does not wait for the writer). Whether it was left."""
        if self.settle(bounded=True):
            return False
        self.abandon(why)
        link.close()
        return True

    def abandon(self, why: str) -> None:
        """Leave the writer's thread where it waits (``close(failed=True)``, or the exit, after :meth:`settle`
        gave up): nothing more will come of its task."""
        self._closed = self._abandoned = True
        log.error("%s while the checkpoint writer (%s) has waited more than %.0f s for other ranks, who are not "
                  "coming: it is left. The step of a save not committed is lost; every step committed before it is "
                  "intact.", why, self._pool.current or "idle", EXIT_RANK_WAIT_S)

    def _at_exit(self) -> None:
        """The interpreter is ending: wait for the writer's tasks unless ``close()`` did, except as the module
        docstring says. A writer left by ``close(failed=True)`` still waiting ends the process at once."""
        if self._closed and not (self._abandoned and not self._pool.wait_idle(0)):
            return
        failing = _exception_at_exit()
        if failing is self._exc_before:
            failing = None
        if not self._abandoned:
            if self.settle(bounded=failing is not None):
                return
            self.abandon(f"this rank is ending on {type(failing).__name__}")
        _end_now(failing)
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
