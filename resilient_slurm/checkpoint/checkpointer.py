"""The public API: :class:`Checkpointer`.

Usage (every rank calls the same methods in the same order)::

    ckpt = Checkpointer(every_steps=100)
    start = ckpt.restore(state)
    for step in range(start, total):
        train_one_step()
        ckpt.step(step + 1, state)   # async save on cadence, or an emergency save when requested
        if ckpt.should_stop:
            break
    ckpt.close()

Threads: the training thread calls every method. One background writer thread per Checkpointer runs
the shard write and commit. At most one save is in flight: a new save first waits for the previous one
(that wait is reported as part of the stall). An error in the background surfaces on the next call.

What the facade is made of: :mod:`.wiring` puts it together (settings, topology, the run's claim, provenance,
engine, event log, the rank's links to a launcher) and takes it apart; :mod:`.boundary` runs the per-step
agreement; :mod:`.writer` stages saves and owns the writer thread; :mod:`.ordering` refuses step numbers that
go back; :mod:`.metrics` (RankMetrics) records metrics and checks a resume; :mod:`.stragglers`
(RankStragglers) times steps; :mod:`.tagging` tags steps; :mod:`.reporting` writes every event below.

Events (docs/telemetry.md) go to the run's ``events.jsonl`` on this node: every rank writes its own
``save_staged`` (training thread, one append after the stall is measured), ``save_committed`` /
``save_failed`` (writer thread), ``restore`` / ``restore_none`` / ``restore_failed``, ``emergency_requested`` and, after a
resume that trains recorded steps again, ``resume_verified`` / ``resume_diverged`` (metrics.py); the node's
leader rank also writes ``save_started``, ``retention_deleted`` (local tier) and ``tagged``; rank 0 writes
``code_version_changed`` after restoring a step saved at another git commit (provenance.py).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from types import TracebackType
from typing import Any

from .. import config as settings_mod  # ``config`` is also Checkpointer's argument (the user's run config)
from ..control.heartbeat import unregister_stack_dump
from ..errors import (
    CheckpointError,
    ConfigError,
    CorruptCheckpointError,
    RestoreUnavailableError,
)
from ..paths import check_id
from ..sigsafe import WakeFlag
from ..tags import check_tag_name
from . import wiring
from .boundary import StepBoundary
from .compat import check_patterns
from .engine import SaveOutcome
from .metrics import RankMetrics, check_metrics
from .ordering import StepOrder
from .reporting import CheckpointReporter
from .tagging import tag_domains
from .writer import SaveWriter

log = logging.getLogger(__name__)

class Checkpointer:
    """Saves and restores the complete training state, sharded per rank, on node-local storage."""

    def __init__(
        self,
        local_dir: str | None = None,
        durable: str | None = None,
        run_id: str | None = None,
        every_steps: int | None = None,
        every_seconds: float | None = None,
        keep_last: int | None = None,
        keep_every: int | None = None,
        *,
        capture_rng: bool | None = None,
        sync_every: int | None = None,
        io_threads: int | None = None,
        config_path: str | None = None,
        replicated: Sequence[str] = (),
        restore_fallback: str | None = None,
        config: Any = None,
    ) -> None:
        """``replicated``: state keys your program keeps equal on every rank without DDP (an EMA of a DDP
        model, a frozen model, gradients averaged by your own all_reduce). Their copies are then not
        digested at every save, only checked like DDP's (``replica_check``); undeclared, they are proven
        equal at every save, which costs a hash of each copy.

        ``restore_fallback``: "fail" (default) or "fresh", what :meth:`restore` does when checkpoints
        exist but none can be restored (docs/configuration.md).

        ``config``: your run's configuration (hyper-parameters, data paths...), JSON-serialisable and at
        most 64 KiB as JSON; stored with its sha256 in every manifest's provenance, beside the code version
        and the job's facts (``rslurm show``, ``rslurm diff``). Checked here: ConfigError when it is not JSON."""
        p = wiring.build(dict(local_dir=local_dir, durable=durable, run_id=run_id, every_steps=every_steps,
                              every_seconds=every_seconds, keep_last=keep_last, keep_every=keep_every,
                              capture_rng=capture_rng, sync_every=sync_every, io_threads=io_threads,
                              restore_fallback=restore_fallback),
                         config_path=config_path, replicated=replicated, config=config)
        self._parts = p
        self.config: settings_mod.Settings = p.config
        self.run_id: str = p.run_id
        self.durable: str | None = p.config.durable
        self._durable_tier, self.retention, self.cadence = p.durable_tier, p.retention, p.cadence
        self._coord, self.topology, self._claim = p.coord, p.topology, p.claim
        self.provenance: dict[str, Any] | None = p.provenance
        self._engine, self.events = p.engine, p.events
        self._report = CheckpointReporter(self.events, self.topology, self.provenance, self._engine.replicas.check)
        if self.cadence.auto:
            self._report.cadence("start", self.cadence)
        self._stacks = wiring.stack_dump(p)
        # Per-step metrics (metrics.py): this rank's file, and the check of the steps a resume trains again.
        self._metrics = RankMetrics(self.run_dir, self.topology.rank, self.topology.world_size,
                                    p.config.resume_tolerance)
        self._emergency = WakeFlag()  # set by signal handlers and the launcher watch: never a lock (sigsafe.py)
        self._should_stop = self._closed = False
        self._order = StepOrder(self.run_id)  # the floor and the newest step saved (ordering.py)
        self.last_outcome: SaveOutcome | None = None
        self.last_stall_s: float = 0.0
        self.last_stage_stats: dict[str, float] = {}  # the last stall's parts: plan_s, digest_s, reduce_s, copy_s
        # Built last: a signal from here on only sets a flag.
        self._link = wiring.rank_link(p, self.request_emergency_save, self._report, lambda: self._should_stop)
        self._writer = SaveWriter(self._engine, self.topology, self._report, self._link, self._durable_tier,
                                  self.run_id)
        stragglers = wiring.stragglers(p, self.run_dir)  # every rank times its steps; rank 0 judges
        self._clock = stragglers.clock if stragglers is not None else None
        self._boundary = StepBoundary(self._coord, self._link, lambda: self.cadence, p.config.sync_every,
                                      self._emergency, self._engine.ddp, stragglers, self._report)

    # ------------------------------------------------------------------ properties
    @property
    def should_stop(self) -> bool:
        """True once an emergency checkpoint has committed: leave the training loop."""
        return self._should_stop

    @property
    def run_dir(self) -> str:
        """This rank's node-local run directory."""
        return self._engine.run_dir

    @property
    def rank(self) -> int:
        """This process's rank (0 when not distributed)."""
        return self.topology.rank

    _inflight = property(lambda self: self._writer.inflight)  # the save in flight (tests)
    _prepared = property(lambda self: self._writer.prepared)  # the staging buffer's pre-allocation (bench)

    # ------------------------------------------------------------------ API
    def request_emergency_save(self) -> None:
        """Ask for an emergency save at the next step boundary (safe from signal handlers/threads)."""
        self._emergency.set()

    def restore(self, state: MutableMapping[str, Any], *, rank_map: Callable[[int], int] | None = None,
                allow_missing: Sequence[str] | None = None, allow_unexpected: Sequence[str] | None = None) -> int:
        """Restore ``state`` in place from the newest valid step; return that step (0 if none).

        State that differed between ranks was saved per rank and is restored to the rank that saved it.
        Resuming such state with another number of ranks needs ``rank_map``: a function from this rank to
        the saved rank whose per-rank state (and RNG state) it loads (docs/integration.md).

        0 means nothing was there to restore. When committed steps exist (or the durable tier cannot be
        listed) and none restores, every rank raises RestoreUnavailableError (storage failed: run again
        later; `rslurm launch` requeues) or CorruptCheckpointError (every step is corrupt), unless
        ``restore_fallback="fresh"``: then 0 with a warning.

        A step that does not fit ``state`` raises IncompatibleCheckpointError listing every missing,
        unexpected and reshaped key, with nothing loaded. Intended changes: ``allow_missing`` (fnmatch
        patterns of state keys, ``["model.head.*"]``: missing or reshaped, they keep their current value)
        and ``allow_unexpected`` (saved keys not loaded); see docs/integration.md."""
        missing_ok = check_patterns("allow_missing", allow_missing)
        unexpected_ok = check_patterns("allow_unexpected", allow_unexpected)
        self._check_open()
        self._finish_inflight()
        self._writer.finish_retention()
        try:
            step = self._engine.restore(state, rank_map=rank_map, allow_missing=missing_ok,
                                        allow_unexpected=unexpected_ok)
        except (RestoreUnavailableError, CorruptCheckpointError) as exc:
            self._report.restore_failed(exc, isinstance(exc, RestoreUnavailableError), self._engine.last_restore)
            raise
        self._order.restored(step)
        self._report.restore(self._engine.last_restore)
        self._metrics.restored(step)
        self.cadence.saved()
        # The staging buffer is planned at the first step(), as in a fresh run, not here: planning calls
        # state_dict() on every stateful value, and some must not run it between load_state_dict() and the
        # program's own set-up (torchdata's StatefulDataLoader would build its resumed iterator here,
        # before the program sets the sampler's epoch, and draw its workers' seed from the just-restored
        # torch RNG).
        self._boundary.restored(step)
        return step

    def step(self, step: int, state: Mapping[str, Any], metrics: Mapping[str, Any] | None = None) -> None:
        """Call after each optimizer step with the number of steps completed.

        Saves asynchronously when the cadence says so, or synchronously (then sets
        :attr:`should_stop`) when an emergency save was requested on any rank.

        ``metrics``: a few numbers this rank computed for this step (``{"loss": loss.item()}``), at most
        32, recorded in the rank's metrics file. After a resume, the steps trained again are compared
        with what was recorded for them before the stop (``resume_verified`` / ``resume_diverged``
        events), and ``rslurm rehearse`` compares them with a run that never stopped
        (docs/integration.md). A tensor of one element is read with ``.item()``, which on a CUDA tensor
        waits for the GPU.
        """
        self._check_open()
        values = check_metrics(step, metrics) if metrics is not None else None  # before any collective
        self._order.check(step, self.run_dir, self._coord)  # a counter that went back is refused at once
        self._report.resume_ended(self._metrics.record(step, values))
        if self._clock is not None:
            self._clock.entered(time.perf_counter())
            try:
                self._step(step, state)
            finally:
                self._clock.left(time.perf_counter())
        else:
            self._step(step, state)

    def _step(self, step: int, state: Mapping[str, Any]) -> None:
        self._boundary.enter(step)
        if not self._writer.staging_planned:
            self._writer.prepare(state)  # collective, on every rank alike
        d = self._boundary.decide(step, lambda: self._writer.failed)
        if d.failed:
            self._finish_inflight()
        if d.emergency:
            self._report.emergency(step, self._link.signals_seen, d.heard_here, d.heard_socket)
        requested = "emergency" if d.emergency else "manual" if d.manual else None  # manual: a tool's request
        if requested and step == self._order.saved_step:
            # Already saved (the request arrived right after the restore, or at a step whose interval save is in
            # flight): wait for that commit instead of writing it twice.
            self._finish_inflight()
            self._link.committed(step, requested)
        elif requested or d.due:  # a manual save goes on in the background like a due one: training goes on
            self.save(step, state, blocking=d.emergency, reason=requested or "interval")
        if d.emergency:
            self._emergency.clear()
            self._should_stop = True
            self._report.emergency_saved(step)

    @contextlib.contextmanager
    def section(self, name: str, timeout: float | None = None) -> Iterator[None]:
        """Mark a phase without ``step()`` calls (evaluation, a long data reload) for the launcher's hang
        detection: inside it a rank counts as hung only after ``timeout`` seconds (None: the general hang
        timeout, counted from the start of the section)::

            with ckpt.section("eval", timeout=1800):
                evaluate(model)
        """
        hb = self._link.heartbeat
        prev = hb.section(name, timeout) if hb is not None else None
        try:
            yield
        finally:
            if hb is not None and prev is not None and self._link.heartbeat is hb:
                hb.resume(prev)
            if self._clock is not None:  # a section is not a step's work: not a straggler sample
                self._clock.pause()

    def save(self, step: int, state: Mapping[str, Any], blocking: bool = True, *, reason: str = "manual") -> None:
        """Save ``state`` as ``step``. With ``blocking=False`` only the staging copy runs now.

        A blocking save returns once the step is committed and retention has run after it.
        """
        self._check_open()
        check_id("step", step, error=ConfigError)
        self._order.check(step, self.run_dir, self._coord)
        t0 = time.perf_counter()
        self._report.save_started(step, reason)
        self._finish_inflight()  # back-pressure: at most one save in flight
        self._writer.finish_prepared()
        t_wait = time.perf_counter() - t0
        pending = self._writer.stage(step, state, reason)  # reports its replica mismatches and failure
        self._order.saved_step = step
        self.last_stall_s = time.perf_counter() - t0
        self.last_stage_stats = dict(pending.stats)
        self._report.save_staged(step, reason, pending, self.last_stall_s, t_wait)
        self._writer.submit(pending, step, reason, t0)
        self.cadence.saved()
        if blocking:
            self._finish_inflight()
            self._writer.finish_retention()

    def tag(self, step: int, name: str) -> None:
        """Tag committed ``step`` as ``name`` (``"best"``, ``"v1.0"``): retention, the daemon's eviction and
        ``rslurm gc`` never remove a tagged step, on any tier, until ``rslurm untag`` removes the tag. A
        name tags one step: tagging another step with it moves it there (and the step it left is retained
        as usual again), so ``ckpt.tag(step, "best")`` after each better evaluation keeps exactly the best.

        Every rank calls it, like every method (one tiny collective). The step must be committed: tagging
        the step whose save is in flight waits for that save's commit first (and raises its error); an
        older step must still be in this run's local tier (``rslurm tag`` also tags steps that are only
        durable). Each storage domain's leader writes its domain's tags file under the lock every deleter
        holds, so once this returns no retention can remove the step; rank 0 then copies the tags to the
        durable tier on its writer thread (best effort: the daemon copies them at its next pass
        otherwise). Raises ConfigError (a bad name, a step not committed) or TagsFileError (the run's tags
        file cannot be read) on every rank alike."""
        self._check_open()
        check_tag_name(name)
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ConfigError(f"step must be an integer >= 0, got {step!r}")
        if self._writer.inflight is not None and self._order.saved_step == step:
            self._finish_inflight()  # the step's own save must commit first
        moved = tag_domains(self._coord, self.topology, self._engine, step, name)
        self._report.tagged(self.run_id, step, name, moved)
        if self.rank == 0 and self._durable_tier is not None:
            self._writer.copy_tags()

    def wait(self) -> SaveOutcome | None:
        """Wait until the save in flight (if any) is committed; raise its error if it failed.

        Retention of older steps may still be running on the writer thread; ``close()`` waits for it.
        """
        self._check_open()
        return self._finish_inflight()

    def close(self, *, failed: bool = False) -> None:
        """Wait for in-flight saves and release the writer thread. Idempotent. ``failed`` (closing on an error):
        a writer stuck 30 s waiting for other ranks is left, with the groups and tiers it uses (writer.py)."""
        if self._closed or (failed and self._writer.left_stuck("closing after an error", self._link)):
            self._closed = True
            return
        try:
            self._finish_inflight()
        finally:
            self._closed = True
            self._writer.close()
            self._link.close()
            unregister_stack_dump(self._stacks)
            self._stacks = None
            self._report.resume_ended(self._metrics.close())  # stopped before every repeated step was trained
            wiring.release(self._parts)  # last: the event log, the tiers, the coordinator, the run's claim

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None:
            self.close()
            return
        try:
            self.close(failed=True)
        except CheckpointError as inner:  # do not mask the exception that ended the block
            log.error("while closing after %s: %s", exc_type.__name__ if exc_type else "error", inner)

    # ------------------------------------------------------------------ internals
    def _finish_inflight(self) -> SaveOutcome | None:
        outcome = self._writer.finish_inflight()  # re-raises the background error here, on the training thread
        if outcome is None:
            return None
        self.last_outcome = outcome
        if outcome.reason == "interval" and self.cadence.observe(outcome.stall_s, outcome.write_s + outcome.commit_s):
            self._report.cadence("measured", self.cadence)
        return outcome

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this Checkpointer is closed; create a new one")
