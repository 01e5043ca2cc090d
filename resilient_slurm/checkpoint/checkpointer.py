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
import os
import time
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType
from typing import Any

from .. import config as settings_mod  # ``config`` is also Checkpointer's argument (the user's run config)
from ..control.heartbeat import open_stack_file, register_stack_dump, unregister_stack_dump
from ..control.orphan import LauncherWatch
from ..control.rank import RankLink
from ..errors import (
    CheckpointError,
    ConfigError,
    CorruptCheckpointError,
    ReplicaMismatchError,
    ResilientSlurmError,
    RestoreUnavailableError,
    StepOrderError,
    TagsFileError,
)
from ..jobenv import JobEnv
from ..layout import WRITER_ENV, RunClaim, RunWriter, claim_run, list_run_dir
from ..paths import check_id, default_local_dir, default_run_id, node_name
from ..sigsafe import WakeFlag
from ..storage.registry import open_durable
from ..tags import check_tag_name, read_local_tags, sync_durable_tags
from ..telemetry import EventLog, ExactFloat
from . import provenance as provenance_mod
from .compat import check_patterns
from .coordination import Coordinator, Topology, discover_topology
from .engine import Engine, PendingSave, SaveOutcome
from .metrics import Divergence, MetricsLog, ResumeCheck, Values, check_metrics
from .policy import Cadence, RetentionPolicy
from .replication import ReplicaMismatch
from .stragglers import StepClock, StragglerWatch, write_status

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
        if isinstance(replicated, str) or not all(isinstance(k, str) for k in replicated):
            raise ConfigError(f"replicated must be a list of state keys, got {replicated!r}")
        args = dict(
            local_dir=local_dir,
            durable=durable,
            run_id=run_id,
            every_steps=every_steps,
            every_seconds=every_seconds,
            keep_last=keep_last,
            keep_every=keep_every,
            capture_rng=capture_rng,
            sync_every=sync_every,
            io_threads=io_threads,
            restore_fallback=restore_fallback,
        )
        user_config = provenance_mod.check_user_config(config) if config is not None else None
        cfg = settings_mod.load(args, config_path=config_path)
        self.config: settings_mod.Settings = cfg
        self.run_id: str = check_id("run id", cfg.run_id or default_run_id())  # the one validation (paths.py)
        self.durable: str | None = cfg.durable
        # Restore reads the durable tier when a step is missing or corrupt locally; `rslurm daemon`
        # writes it. Opening it makes no request (S3: the client only), so a dead endpoint costs nothing
        # until a restore needs it; then local steps still restore, and with none, restore_fallback says.
        self._durable_tier = open_durable(cfg, upload_cap=False) if self.durable else None
        self.retention = RetentionPolicy(cfg.keep_last, cfg.keep_every)
        auto = cfg.auto_cadence == "on" and cfg.every_steps is None and cfg.every_seconds is None
        self.cadence = Cadence(cfg.every_steps, cfg.every_seconds, auto=auto, failure_interval=cfg.failure_interval)
        self._coord = Coordinator(timeout_s=cfg.collective_timeout, node=node_name(cfg.node_name))
        job = JobEnv.from_env()
        if not self._coord.distributed and (job.world_size or 1) > 1:
            # Several ranks each acting as "rank 0" would write over one another's shards.
            raise ConfigError(
                f"WORLD_SIZE={job.raw['WORLD_SIZE']} but torch.distributed is not initialized; call "
                "resilient_slurm.init_distributed() (or torch.distributed.init_process_group) before "
                "creating the Checkpointer"
            )
        template: str | Exception
        try:  # an unsafe default directory on one rank must stop every rank, not leave them waiting
            template = cfg.local_dir or default_local_dir()
        except ResilientSlurmError as exc:
            template = exc
        self.topology: Topology = discover_topology(self._coord, template, node_name(cfg.node_name))
        self._claim = self._claim_run(job)
        # Gathered once (git runs here, with a timeout), where it is used: domain leaders write manifests,
        # rank 0 compares code versions at a restore.
        self.provenance: dict[str, Any] | None = None
        if self.topology.is_leader or self.topology.rank == 0:
            self.provenance = provenance_mod.gather(
                world_size=self.topology.world_size, nodes=self.topology.domain_of_rank, job=job,
                user_config=user_config, has_config=config is not None)
        self._engine = Engine(
            self.topology,
            self._coord,
            self.run_id,
            retention=self.retention,
            io_threads=cfg.io_threads,
            free_space_margin=cfg.free_space_margin,
            capture_rng=cfg.capture_rng,
            durable=self._durable_tier,
            replica_check=cfg.replica_check,
            replica_check_bytes=cfg.replica_check_bytes,
            replicated=tuple(replicated),
            restore_fallback=cfg.restore_fallback,
            provenance=self.provenance,
            peer_replicas=cfg.peer_replicas,
        )
        self.events = EventLog(
            self.topology.root, self.run_id, source="rank", node=self.topology.node,
            job_id=job.job_id, restart_count=job.restart_count, rank=self.topology.rank)
        self._sync_every: int = cfg.sync_every
        self._cadence_reported = 0.0
        if self.cadence.auto:
            self._report_cadence("start")
        # Under `rslurm launch` (which sets control_socket for every rank, on every node), the launcher asks
        # for every thread's stack when it finds the job hung (control/heartbeat.py).
        under_launcher = (cfg.control_socket or "off").strip().lower() != "off"
        self._stacks = (register_stack_dump(os.path.join(self.topology.root, self.run_id), self.topology.rank)
                        if under_launcher else None)
        # Per-step metrics (metrics.py): this rank's file, and the check of the steps a resume trains again.
        self._metrics = MetricsLog(self._engine.run_dir, self.topology.rank, self.topology.world_size)
        self._metrics_opened = False
        self._resume_check: ResumeCheck | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rslurm-ckpt")
        self._inflight: Future[SaveOutcome] | None = None
        self._retention: Future[list[int]] | None = None
        self._tags_copy: Future[None] | None = None  # rank 0: the tags' durable copy, after a tag()
        self._replication: Future[Any] | None = None  # domain leaders: the peer replica round of the last save
        self._prepared: Future[Any] | None = None
        self._staging_planned = False  # the same on every rank: _prepare is collective
        self._emergency = WakeFlag()  # set by signal handlers and the launcher watch: never a lock (sigsafe.py)
        self._should_stop = False
        self._closed = False
        # Newest step restored or handed to the writer. The same on every rank (saves are collective),
        # so an emergency request at that step is skipped by all ranks alike, never by some.
        self._saved_step: int | None = None
        # The run's history before this Checkpointer wrote: the step restored, else (found at the first
        # save) the newest step committed on any rank's node. A save at or below it is refused (_check_order).
        self._floor: int | None = None
        self._floor_known = False
        self._floor_restored = False
        self.last_outcome: SaveOutcome | None = None
        self.last_stall_s: float = 0.0
        self.last_stage_stats: dict[str, float] = {}  # the last stall's parts: plan_s, digest_s, reduce_s, copy_s
        # Emergency requests: SIGTERM and save_signal (from Slurm or the launcher), and the launcher's
        # control socket on this node. Built last: a signal from here on only sets a flag.
        self._link = RankLink(
            self.topology.rank, job.local_rank or 0,
            on_request=self.request_emergency_save, socket_path=cfg.control_socket,
            timeout=cfg.control_timeout, trap_signals=cfg.trap_signals, save_signal=cfg.save_signal,
            launcher_watch=self._launcher_watch(cfg),
        )
        self._hello_sent = False
        self._signals_reported = 0
        self._emergency_reported = False
        self._steps_since_restore = 0
        # Straggler detection (stragglers.py): every rank times its own steps; rank 0 compares them.
        self._job = job
        self._clock: StepClock | None = None
        self._stragglers: StragglerWatch | None = None
        if cfg.straggler_ratio is not None and self._coord.multi:
            self._clock = StepClock(cfg.straggler_window)
            if self.topology.rank == 0:
                self._stragglers_recorded = False
                self._stragglers = StragglerWatch(cfg.straggler_ratio, cfg.straggler_window,
                                                  self.topology.domain_of_rank)

    def _launcher_watch(self, cfg: settings_mod.Settings) -> LauncherWatch | None:
        """Under a local launcher: the watch that bounds this rank if the launcher dies (control/orphan.py),
        with the launcher's own bounds (save_timeout for the save, term_grace after it)."""
        run_dir = os.path.join(self.topology.root, self.run_id)
        rank = self.topology.rank

        def gone(pid: int, bound: float) -> None:
            self.request_emergency_save()  # a wrapper shell may have taken the launcher's SIGTERM
            self.events.emit("launcher_gone", launcher_pid=pid, bound_s=bound)

        def timeout(pid: int, bound: float) -> None:
            self.events.emit("orphan_timeout", launcher_pid=pid, bound_s=bound,
                             saved=self._should_stop)

        return LauncherWatch.from_env(os.environ, save_timeout=cfg.save_timeout, term_grace=cfg.term_grace,
                                      on_gone=gone, on_timeout=timeout,
                                      stack_file=lambda: open_stack_file(run_dir, rank))

    def _claim_run(self, job: JobEnv) -> RunClaim | None:
        """One writer per run (:func:`~resilient_slurm.layout.claim_run`): under ``rslurm launch`` the ranks
        share their launcher's claim (its token in ``RSLURM_RUN_WRITER``); a rank set started alone claims
        the run itself, through each storage domain's leader, until :meth:`close`. A run that another
        launcher or rank set writes raises RunInUseError on every rank alike (one all_gather), before
        anything is written."""
        claim: RunClaim | None = None

        def take() -> None:
            nonlocal claim
            if self.topology.is_leader:
                me = RunWriter.this_process(job.job_id, os.environ.get(WRITER_ENV) or None)
                claim = claim_run(self.topology.root, self.run_id, me)

        try:
            self._coord.phase("claiming the run", take)
        except BaseException:
            if claim is not None:
                claim.release()
            raise
        return claim

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
        self._finish_retention()
        try:
            step = self._engine.restore(state, rank_map=rank_map, allow_missing=missing_ok,
                                        allow_unexpected=unexpected_ok)
        except (RestoreUnavailableError, CorruptCheckpointError) as exc:
            if self.topology.rank == 0:
                last = self._engine.last_restore
                self.events.emit("restore_failed", error=str(exc), retry=isinstance(exc, RestoreUnavailableError),
                                 skipped=list(last.skipped) if last else [])
            raise
        self._steps_since_restore = 0
        self._floor, self._floor_known, self._floor_restored = (step or None), True, bool(step)
        self._report_restore()
        self._start_resume_check(step)
        self.cadence.saved()
        if step:
            self._saved_step = step
        # The staging buffer is planned at the first step(), as in a fresh run, not here: planning calls
        # state_dict() on every stateful value, and some must not run it between load_state_dict() and the
        # program's own set-up (torchdata's StatefulDataLoader would build its resumed iterator here,
        # before the program sets the sampler's epoch, and draw its workers' seed from the just-restored
        # torch RNG).
        self._link.hello(step)
        self._hello_sent = True
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
        self._check_order(step)  # a step counter that went back is refused at once, not at the next save
        self._record_metrics(step, values)
        if self._clock is not None:
            self._clock.entered(time.perf_counter())
            try:
                self._step(step, state)
            finally:
                self._clock.left(time.perf_counter())
        else:
            self._step(step, state)

    def _step(self, step: int, state: Mapping[str, Any]) -> None:
        if self._link.heartbeat is not None:
            self._link.heartbeat.beat(step)  # about a microsecond: the launcher's hang detection
        if not self._hello_sent and not self._coord.multi:
            self._link.hello(0)
            self._hello_sent = True
        self._steps_since_restore += 1
        if self._steps_since_restore == 2:
            self._engine.ddp.close()  # a DDP that ran no forward by now is not in use: stop waiting for it
        if not self._staging_planned:
            self._prepare(state)
        due = self.cadence.due(step)
        heard_socket = False
        if step % self._sync_every == 0 and self._hello_sent:  # a poll registers: not before the hello
            heard_socket = self._link.poll(step)  # a launcher request sets the emergency flag
        emergency = self._emergency.is_set()
        heard_here = emergency
        failed = self._inflight is not None and self._inflight.done() and self._inflight.exception() is not None
        if self._coord.multi:
            if step % self._sync_every == 0:
                # One tiny collective: time cadence, emergency requests and background failures are
                # per-rank facts; acting on them must be unanimous.
                flags = [int(due), int(emergency), int(failed)]
                report = self._clock is not None and self._clock.report_due()
                if report:  # every rank alike: the count of step() calls is the same everywhere
                    flags += self._straggler_slots()
                agreed = self._coord.phase_max("agreeing on a save at this step", lambda: flags, len(flags))
                due, emergency, failed = (bool(v) for v in agreed[:3])
                if report and self._stragglers is not None:
                    self._judge_stragglers(step, agreed[3:])
                if not self._hello_sent:
                    # After a collective: every rank has built its Checkpointer, so its signal traps are
                    # in place. The launcher takes a hello as "the save signal no longer kills a rank".
                    self._link.hello(0)
                    self._hello_sent = True
            else:  # between sync points only the deterministic step cadence applies
                due = self.cadence.every_steps is not None and step % self.cadence.every_steps == 0
                emergency = failed = False
        if failed:
            self._finish_inflight()
        if emergency:
            self._report_emergency(step, heard_here, heard_socket)
            if step == self._saved_step:
                # Already saved (the request arrived right after the restore, or at a step whose
                # interval save is in flight): wait for that commit instead of writing it twice.
                self._finish_inflight()
                self._link.committed(step, "emergency")
            else:
                self.save(step, state, blocking=True, reason="emergency")
            self._emergency.clear()
            self._emergency_reported = False
            self._should_stop = True
            log.warning("rank %d: emergency checkpoint of step %d committed; should_stop is set",
                        self.rank, step)
        elif due:
            self.save(step, state, blocking=False, reason="interval")

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

    def _straggler_slots(self) -> list[int]:
        """This rank's own step time over the window (microseconds) in its slot, 0 in the others'."""
        assert self._clock is not None
        slots = [0] * self.topology.world_size
        wait = self._engine.ddp.gradient_wait_s(self._clock.window)
        # No new DDP sample (the same on every rank: DDP's iterations are in step): not judged this window.
        slots[self.topology.rank] = self._clock.take(wait) if wait is not None else self._clock.take_none()
        return slots

    def _judge_stragglers(self, step: int, times_us: list[int]) -> None:
        """Rank 0, after a window: event and warning for each new straggler, the run's stragglers.json."""
        assert self._stragglers is not None
        new, current, cleared = self._stragglers.update(times_us)
        window = self._stragglers.window
        for s in new:
            self.events.emit("straggler", step=step, window=window, threshold=self._stragglers.ratio,
                             straggler_rank=s.rank, straggler_node=s.node, step_time_s=round(s.step_time_s, 6),
                             peer_median_s=round(s.peer_median_s, 6), ratio=round(s.ratio, 3))
            log.warning("straggler at step %d: %s, the median over the last %d steps", step, s.describe(),
                        window)
        for r in cleared:
            self.events.emit("straggler_cleared", step=step, window=window, straggler_rank=r,
                             straggler_node=self._stragglers.nodes[r])
        if new or cleared or not self._stragglers_recorded:  # the first window replaces an old run's record
            self._stragglers_recorded = True
            try:
                write_status(self.run_dir, step=step, window=window, ratio=self._stragglers.ratio,
                             stragglers=current, job_id=self._job.job_id, restart_count=self._job.restart_count)
            except Exception as exc:  # a status line is not worth a training step
                log.warning("could not record stragglers in %s: %s", self.run_dir, exc)

    def save(self, step: int, state: Mapping[str, Any], blocking: bool = True, *, reason: str = "manual") -> None:
        """Save ``state`` as ``step``. With ``blocking=False`` only the staging copy runs now.

        A blocking save returns once the step is committed and retention has run after it.
        """
        self._check_open()
        check_id("step", step, error=ConfigError)
        self._check_order(step)
        t0 = time.perf_counter()
        if self.topology.is_leader:
            self.events.emit("save_started", step=step, reason=reason)
        self._finish_inflight()  # back-pressure: at most one save in flight
        self._finish_prepared()
        t_wait = time.perf_counter() - t0
        try:
            pending = self._engine.stage(step, state, reason)
        except ReplicaMismatchError as exc:
            self._report_mismatches(step, exc.mismatches, "digest")
            self.events.emit("save_failed", step=step, reason=reason, error=str(exc))
            raise
        except Exception as exc:
            self.events.emit("save_failed", step=step, reason=reason, error=str(exc))
            raise
        self._report_mismatches(step, pending.mismatches, "digest")
        self._saved_step = step
        self.last_stall_s = time.perf_counter() - t0
        self.last_stage_stats = dict(pending.stats)
        self.events.emit("save_staged", step=step, reason=reason, bytes=pending.shard_bytes,
                         stall_s=self.last_stall_s, wait_s=t_wait, digest_s=pending.stats["digest_s"],
                         reduce_s=pending.stats["reduce_s"])
        self._inflight = self._pool.submit(self._write_and_report, pending, step, reason, t0)
        if self.topology.is_leader:
            # Retention runs after the commit is reported, on the same single writer thread: deleting
            # a large step can take as long as writing one (discard-mounted filesystems), and the
            # caller waiting for the commit should not wait for it. The next save queues behind it.
            self._retention = self._pool.submit(self._retain)
        if self._engine.peers.active:
            # The partner's copy (peers.py), after the commit and retention on the same writer thread:
            # one round per save on every leader, so the rounds pair up; the next save queues behind it.
            self._replication = self._pool.submit(self._replicate, step, reason)
        self.cadence.saved()
        if blocking:
            self._finish_inflight()
            self._finish_retention()

    def _check_order(self, step: int) -> None:
        """Refuse (StepOrderError, on every rank alike) a save at or below the run's history before this
        Checkpointer (the step restored, else the newest committed step, agreed by one all_max at the first
        save), or below a step saved here: a program that restarted its own step counter would replace
        committed steps with another history, and retention would then delete the newest ones."""
        if not self._floor_known:
            try:
                committed = list_run_dir(self.run_dir).committed
            except OSError:
                committed = []
            newest = committed[-1] if committed else -1
            newest = self._coord.phase_max("agreeing on the newest committed step", lambda: [newest], 1)[0]
            self._floor, self._floor_known = (newest if newest >= 0 else None), True
        floor = self._floor
        if floor is not None and step <= floor:
            what = "resumed from" if self._floor_restored else "already has committed"
            raise StepOrderError(
                f"step {step} refused: run {self.run_id} {what} step {floor}, and a save at or below it "
                f"would replace that run's steps with another history. Number steps on from {floor} (the step "
                "restore() returned plus the steps trained since; a framework that restarts its own counter "
                "needs that offset), or give this run a new id (RSLURM_RUN_ID / --run-id)")
        own = self._saved_step
        if own is not None and (floor is None or own > floor) and step < own:
            raise StepOrderError(f"step {step} refused: run {self.run_id} already saved step {own}; step numbers "
                                 "must not go back (a save would replace a newer history's steps)")

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
        if self._inflight is not None and self._saved_step == step:
            self._finish_inflight()  # the step's own save must commit first
        moved: int | None = None

        def tag_domain() -> None:
            nonlocal moved
            if not self.topology.is_leader:
                return
            try:
                moved = self._engine.tag(step, name)
            except (ResilientSlurmError, OSError) as exc:
                cls = type(exc) if isinstance(exc, (TagsFileError, ConfigError)) else CheckpointError
                raise cls(f"domain {self.topology.domain}: {exc}") from exc

        self._coord.phase("tagging the step", tag_domain)  # every rank raises alike, or none
        if self.topology.is_leader:
            self.events.emit("tagged", step=step, tag=name, moved_from=moved)
        if self.rank == 0:
            log.info("run %s: step %d tagged %r%s", self.run_id, step, name,
                     f" (moved from step {moved})" if moved is not None else "")
            if self._durable_tier is not None:
                self._tags_copy = self._pool.submit(self._copy_tags_to_durable)

    def wait(self) -> SaveOutcome | None:
        """Wait until the save in flight (if any) is committed; raise its error if it failed.

        Retention of older steps may still be running on the writer thread; ``close()`` waits for it.
        """
        self._check_open()
        return self._finish_inflight()

    def close(self) -> None:
        """Wait for in-flight saves and release the writer thread. Idempotent."""
        if self._closed:
            return
        try:
            self._finish_inflight()
        finally:
            self._closed = True
            self._finish_prepared()
            self._finish_retention()
            fut, self._tags_copy = self._tags_copy, None
            _settle(fut, "copying the tags to the durable tier")
            fut, self._replication = self._replication, None
            _settle(fut, "the peer replica of the last save")
            self._pool.shutdown(wait=True)
            self._link.close()
            unregister_stack_dump(self._stacks)
            self._stacks = None
            if self._resume_check is not None and self._resume_check.compared:
                self._report_verified(self._resume_check)  # stopped before every repeated step was trained
            self._resume_check = None
            self._metrics.close()
            self.events.close()
            if self._durable_tier is not None:
                self._durable_tier.close()
            # Last: nothing of this Checkpointer runs a collective any more (the writer thread is shut down).
            self._engine.peers.release()
            self._coord.close()
            if self._claim is not None:
                self._claim.release()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None:
            self.close()
            return
        try:
            self.close()
        except CheckpointError as inner:  # do not mask the exception that ended the block
            log.error("while closing after %s: %s", exc_type.__name__ if exc_type else "error", inner)

    # ------------------------------------------------------------------ internals
    def _write_and_report(self, pending: PendingSave, step: int, reason: str, t0: float) -> SaveOutcome:
        """Writer thread: write and commit, then tell the launcher (if any) the step is committed."""
        try:
            outcome = self._engine.write_and_commit(pending)
        except Exception as exc:
            if isinstance(exc, ReplicaMismatchError):
                self._report_mismatches(step, exc.mismatches, "commit")
            self.events.emit("save_failed", step=step, reason=reason, error=str(exc))
            raise
        self._report_mismatches(step, outcome.mismatches, "commit")
        self._link.committed(step, reason)
        self.events.emit("save_committed", step=step, reason=reason, bytes=outcome.bytes_written,
                         step_bytes=outcome.step_bytes, write_s=outcome.write_s, commit_s=outcome.commit_s,
                         throughput_bytes_s=outcome.bytes_written / outcome.write_s if outcome.write_s > 0 else 0.0,
                         total_s=time.perf_counter() - t0)
        return outcome

    def _copy_tags_to_durable(self) -> None:
        """Writer thread (rank 0): merge this domain's tags file into the durable copy."""
        assert self._durable_tier is not None
        try:
            local = read_local_tags(self.run_dir, self.run_id)
            if local is not None:
                sync_durable_tags(self._durable_tier, local)
        except ResilientSlurmError as exc:
            log.warning("could not copy the tags of run %s to %s: %s; the drain daemon copies them at its next "
                        "pass", self.run_id, self._durable_tier.url, exc)

    def _retain(self) -> list[int]:
        """Writer thread (domain leader): local retention after a save. Its failure is logged here: the
        next non-blocking save replaces this future without waiting for it."""
        try:
            deleted = self._engine.apply_retention()
        except Exception as exc:
            log.warning("retention in %s failed: %s; older steps were kept (the next save retries)", self.run_dir, exc)
            return []
        if deleted:
            self.events.emit("retention_deleted", tier="local", steps=deleted)
        return deleted

    def _replicate(self, step: int, reason: str) -> None:
        """Writer thread (domain leader with a partner): one peer replica round (peers.py) after a save,
        and its ``peer_replica`` event (what was sent, what was kept, and why not)."""
        out = self._engine.peers.replicate(step, reason)
        if out is not None:
            self.events.emit("peer_replica", step=step, sent_bytes=out.sent, received_bytes=out.received,
                             received_step=out.received_step, of=out.from_domain, seconds=out.seconds,
                             problem=out.problem)

    def _report_mismatches(self, step: int, mismatches: Sequence[ReplicaMismatch], found_by: str) -> None:
        """One ``replica_mismatch`` event per mismatched item in each node's log, and one warning (rank 0)."""
        if not mismatches:
            return
        if self.topology.is_leader:
            for m in mismatches:
                self.events.emit("replica_mismatch", step=step, key=m.key, ranks=list(m.ranks),
                                 majority=list(m.majority), found_by=found_by, action=self._engine.replicas.check)
        if self.rank == 0:
            if self._engine.replicas.check == "fail":
                what = "The save was refused (replica_check=fail)."
            elif found_by == "commit":
                what = ("Each storage domain kept the copy of the rank that wrote it there; replica_check=fail "
                        "fails the save instead.")
            else:
                what = "Each rank's copy was saved and restores to that rank; replica_check=fail fails the save instead."
            log.warning("step %d: replicas that should be equal differ between ranks (a desynchronised rank or "
                        "silent data corruption): %s. %s", step, "; ".join(m.describe() for m in mismatches), what)

    def _report_restore(self) -> None:
        r = self._engine.last_restore
        if r is None:
            return
        if r.step:
            self.events.emit("restore", step=r.step, tier=r.tier, seconds=r.seconds, bytes=r.bytes_read,
                             fetched_bytes=r.fetched_bytes, skipped=list(r.skipped), adopted_bytes=r.adopted_bytes,
                             peer_bytes=r.peer_bytes)
            self._report_code_version(r.step, r.provenance)
        else:
            self.events.emit("restore_none", seconds=r.seconds, skipped=list(r.skipped))

    def _report_code_version(self, step: int, saved: Mapping[str, Any] | None) -> None:
        """Rank 0: a ``code_version_changed`` event and a warning when the restored step was written by
        another git commit than the running program's (both known)."""
        if self.topology.rank != 0:
            return
        before, now = provenance_mod.git_commit(saved), provenance_mod.git_commit(self.provenance)
        if before is None or now is None or before == now:
            return
        self.events.emit("code_version_changed", step=step, saved_commit=before, commit=now)
        log.warning("step %d was saved by code at git commit %s; this program runs %s. Resuming with changed "
                    "code may change the results (`rslurm show %d` shows the step's provenance)",
                    step, before[:12], now[:12], step)

    def _start_resume_check(self, restored: int) -> None:
        """After a restore: take the steps recorded after ``restored`` off this rank's metrics file; the
        resumed run must record the same values for them (a run that stopped after its newest checkpoint:
        a crash, a hang, a lost node)."""
        self._metrics_opened = True
        check = ResumeCheck(restored, self._metrics.resume(restored), self.topology.world_size,
                            self.config.resume_tolerance)
        self._resume_check = check if check.pending else None

    def _record_metrics(self, step: int, values: Values | None) -> None:
        if not self._metrics_opened and values is not None:
            self._metrics_opened = True
            self._metrics.resume(step - 1)  # no restore() in this program: its record starts over here
        if values is not None:
            self._metrics.record(step, values)
        check = self._resume_check
        if check is None:
            return
        found = check.observe(step, values or {})
        if found is not None:
            self._resume_check = None
            self._report_divergence(check, found)
        elif check.finished(step):
            self._resume_check = None
            if check.compared:
                self._report_verified(check)

    def _report_verified(self, check: ResumeCheck) -> None:
        self.events.emit("resume_verified", restored_step=check.restored_step, first_step=check.compared[0],
                         last_step=check.compared[-1], steps=len(check.compared), values=check.values)
        log.info("rank %d: the resume from step %d is exact: steps %d-%d recorded the same metrics as before the "
                 "stop", self.rank, check.restored_step, check.compared[0], check.compared[-1])

    def _report_divergence(self, check: ResumeCheck, d: Divergence) -> None:
        self.events.emit("resume_diverged", restored_step=check.restored_step, step=d.step, metric=d.metric,
                         before=_exact(d.before), after=_exact(d.after), tolerance=check.tolerance)
        first = d.step == check.restored_step + 1
        log.warning(
            "rank %d: the resumed run is not exact: step %d recorded %s=%r before the stop and %r after the resume "
            "from step %d (resume_tolerance=%g). %s", self.rank, d.step, d.metric, d.before, d.after,
            check.restored_step, check.tolerance,
            "It differs at the first step after the resume: likely a batch fetched before ckpt.step() and lost "
            "with the stop (a prefetching loop; docs/integration.md, Prefetching loops), or randomness from a "
            "generator that is not in state, or a value kept outside state (a counter, per-rank data)."
            if first else
            "Earlier repeated steps agreed: likely a value kept outside state that matters only later, or "
            "non-deterministic kernels (then set resume_tolerance). `rslurm rehearse` shows the first step "
            "that differs from an uninterrupted run.")

    def _report_emergency(self, step: int, heard_here: bool, heard_socket: bool) -> None:
        """One ``emergency_requested`` per request and rank, saying how this rank heard of it."""
        if self._emergency_reported:
            return
        self._emergency_reported = True
        seen = self._link.signals_seen
        new, self._signals_reported = seen[self._signals_reported:], len(seen)
        if new:
            how = new[0]  # SIGTERM, SIGUSR2...
        elif heard_socket:
            how = "control_socket"
        elif heard_here:
            how = "api"  # request_emergency_save() called by the program
        else:
            how = "peer"  # another rank heard it; this one learnt it at the step agreement
        self.events.emit("emergency_requested", step=step, how=how)

    def _finish_inflight(self) -> SaveOutcome | None:
        fut, self._inflight = self._inflight, None
        if fut is None:
            return None
        outcome = fut.result()  # re-raises the background error here, on the training thread
        self.last_outcome = outcome
        if outcome.reason == "interval" and self.cadence.observe(outcome.stall_s, outcome.write_s + outcome.commit_s):
            self._report_cadence("measured")
        return outcome

    def _report_cadence(self, basis: str) -> None:
        """Rank 0: log the default cadence's interval and write a ``cadence`` event, at the start and when
        the measured costs move it by a quarter or more."""
        interval = self.cadence.every_seconds or 0.0
        if self.topology.rank != 0 or (basis != "start" and abs(interval - self._cadence_reported)
                                       < 0.25 * self._cadence_reported):
            return
        self._cadence_reported = interval
        stall, write = self.cadence.costs()
        mtbf = self.cadence.planned_failure_interval
        self.events.emit("cadence", basis=basis, interval_s=round(interval, 3), stall_s=round(stall, 6),
                         write_s=round(write, 6), failure_interval_s=mtbf)
        if basis == "start":
            log.info("no every_steps or every_seconds: saving every %.0f s at first, then on Daly's interval "
                     "for the measured save cost and a failure every %.1f h (auto_cadence=off turns this off)",
                     interval, mtbf / 3600)
        else:
            log.info("default cadence: saving every %.0f s (save stall %.3f s, background write %.1f s, a "
                     "failure every %.1f h)", interval, stall, write, mtbf / 3600)

    def _prepare(self, state: Mapping[str, Any]) -> None:
        """Plan a save of ``state`` now (collective) and allocate the staging buffer in the background.

        An emergency save that comes before the first interval save (a preemption soon after the start
        or a restart) then pays only the copy, not the allocation and page faults of a buffer as large
        as the state (about 1.3 s per GiB here); and the memory is reserved while training, not at
        the moment the job is told to leave."""
        self._staging_planned = True
        layout = self._engine.plan_layout(state)
        self._prepared = self._pool.submit(self._engine.ensure_staging, layout)

    def _finish_prepared(self) -> None:
        # A failure here is not fatal: the save allocates the buffer itself, and reports a real failure.
        fut, self._prepared = self._prepared, None
        _settle(fut, "pre-allocating the staging buffer")

    def _finish_retention(self) -> None:
        # Retention failing must not fail training; it is retried after the next save.
        fut, self._retention = self._retention, None
        _settle(fut, f"retention in {self.run_dir}")

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this Checkpointer is closed; create a new one")


def _exact(v: float | int | None) -> float | int | None:
    """A recorded metric for an event, every bit of it (events round other floats)."""
    return ExactFloat(v) if isinstance(v, float) else v


def _settle(fut: Future[Any] | None, what: str) -> None:
    """Wait for a best-effort background task; log (do not raise) its failure."""
    if fut is None:
        return
    try:
        fut.result()
    except Exception as exc:
        log.warning("%s failed: %s", what, exc)
