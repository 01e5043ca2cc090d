"""A Checkpointer's telemetry: every event it writes to the run's ``events.jsonl`` and the warnings and
log lines that go with them, from typed outcomes (docs/telemetry.md lists the events and their fields).

Who calls what, and when: the :class:`~resilient_slurm.checkpoint.checkpointer.Checkpointer` builds one
:class:`CheckpointReporter` per rank beside its :class:`~resilient_slurm.telemetry.EventLog` and calls it
after each thing happened: a save's stages (training thread: ``save_started``, ``save_staged``,
``save_failed``; writer thread: ``save_committed``, ``save_failed``, ``retention_deleted``, ``peer_replica``),
a restore (``restore`` / ``restore_none`` / ``restore_failed``, ``code_version_changed``), the resume check
(``resume_verified`` / ``resume_diverged``, from metrics.py's outcomes), an emergency request, a tag, the
default cadence, stragglers (stragglers.py's judgement) and the launcher watch (``launcher_gone``,
``orphan_timeout``). It decides nothing the training acts on: which rank writes which event is decided
here, from the topology, and each method only reports.
"""

from __future__ import annotations

import logging
import os
import shlex
import time
from collections.abc import Mapping, Sequence
from typing import Any

from ..telemetry import Event, EventLog, ExactFloat
from ..terminal import printable
from . import provenance as provenance_mod
from .coordination import Topology
from .engine import PendingSave, SaveOutcome
from .metrics import Divergence, ResumeCheck, ResumeOutcome
from .peers import ReplicaOutcome
from .policy import Cadence
from .replication import ReplicaMismatch
from .restore import RestoreOutcome
from .stragglers import Straggler, StragglerWatch

# The Checkpointer's logger, as before these reports left its module: a program's log filters keep working.
log = logging.getLogger("resilient_slurm.checkpoint.checkpointer")


class CheckpointReporter:
    """One rank's events and log lines for its Checkpointer (see the module docstring)."""

    def __init__(self, events: EventLog, topology: Topology, provenance: Mapping[str, Any] | None,
                 replica_check: str) -> None:
        self.events = events
        self.topology = topology
        self.provenance = provenance
        self.replica_check = replica_check
        self._cadence_reported = 0.0
        self._signals_reported = 0
        self._emergency_reported = False

    # ------------------------------------------------------------------ saves
    def save_started(self, step: int, reason: str) -> None:
        if self.topology.is_leader:
            self.events.emit(Event.SAVE_STARTED, step=step, reason=reason)

    def save_failed(self, step: int, reason: str, exc: BaseException) -> None:
        self.events.emit(Event.SAVE_FAILED, step=step, reason=reason, error=str(exc))

    def save_staged(self, step: int, reason: str, pending: PendingSave, stall_s: float, wait_s: float) -> None:
        self.events.emit(Event.SAVE_STAGED, step=step, reason=reason, bytes=pending.shard_bytes,
                         stall_s=stall_s, wait_s=wait_s, digest_s=pending.stats["digest_s"],
                         reduce_s=pending.stats["reduce_s"])

    def save_committed(self, step: int, reason: str, outcome: SaveOutcome, t0: float) -> None:
        self.events.emit(Event.SAVE_COMMITTED, step=step, reason=reason, bytes=outcome.bytes_written,
                         step_bytes=outcome.step_bytes, write_s=outcome.write_s, commit_s=outcome.commit_s,
                         throughput_bytes_s=outcome.bytes_written / outcome.write_s if outcome.write_s > 0 else 0.0,
                         total_s=time.perf_counter() - t0)

    def retention_deleted(self, deleted: list[int]) -> None:
        if deleted:
            self.events.emit(Event.RETENTION_DELETED, tier="local", steps=deleted)

    def peer_replica(self, step: int, out: ReplicaOutcome | None) -> None:
        if out is not None:
            self.events.emit(Event.PEER_REPLICA, step=step, sent_bytes=out.sent, received_bytes=out.received,
                             received_step=out.received_step, of=out.from_domain, seconds=out.seconds,
                             problem=out.problem)

    def mismatches(self, step: int, mismatches: Sequence[ReplicaMismatch], found_by: str) -> None:
        """One ``replica_mismatch`` event per mismatched item in each node's log, and one warning (rank 0)."""
        if not mismatches:
            return
        if self.topology.is_leader:
            for m in mismatches:
                self.events.emit(Event.REPLICA_MISMATCH, step=step, key=m.key, ranks=list(m.ranks),
                                 majority=list(m.majority), found_by=found_by, action=self.replica_check)
        if self.topology.rank == 0:
            if self.replica_check == "fail":
                what = "The save was refused (replica_check=fail)."
            elif found_by == "commit":
                what = ("Each storage domain kept the copy of the rank that wrote it there; replica_check=fail "
                        "fails the save instead.")
            else:
                what = "Each rank's copy was saved and restores to that rank; replica_check=fail fails the save instead."
            log.warning("step %d: replicas that should be equal differ between ranks (a desynchronised rank or "
                        "silent data corruption): %s. %s", step, "; ".join(m.describe() for m in mismatches), what)

    # ------------------------------------------------------------------ restores
    def restore(self, r: RestoreOutcome | None) -> None:
        if r is None:
            return
        if r.step:
            self.events.emit(Event.RESTORE, step=r.step, tier=r.tier, seconds=r.seconds, bytes=r.bytes_read,
                             fetched_bytes=r.fetched_bytes, skipped=list(r.skipped), placed_bytes=r.placed_bytes,
                             peer_bytes=r.peer_bytes, integration=(self.provenance or {}).get("integration"))
            self.code_version(r.step, r.provenance)
        else:
            self.events.emit(Event.RESTORE_NONE, seconds=r.seconds, skipped=list(r.skipped))

    def restore_failed(self, exc: BaseException, retry: bool, last: RestoreOutcome | None) -> None:
        if self.topology.rank == 0:
            self.events.emit(Event.RESTORE_FAILED, error=str(exc), retry=retry, skipped=list(last.skipped) if last else [])

    def code_version(self, step: int, saved: Mapping[str, Any] | None) -> None:
        """Rank 0: a ``code_version_changed`` event and a warning when the restored step was written by
        another git commit than the running program's (both known); ``command_line_changed`` when by another
        command line (another experiment resuming this run's state, when both kept the default run id)."""
        if self.topology.rank != 0:
            return
        self._command_line(step, saved)
        before, now = provenance_mod.git_commit(saved), provenance_mod.git_commit(self.provenance)
        if before is None or now is None or before == now:
            return
        self.events.emit(Event.CODE_VERSION_CHANGED, step=step, saved_commit=before, commit=now)
        log.warning("step %d was saved by code at git commit %s; this program runs %s. Resuming with changed "
                    "code may change the results (`rslurm show %d` shows the step's provenance)",
                    step, before[:12], now[:12], step)

    def _command_line(self, step: int, saved: Mapping[str, Any] | None) -> None:
        before, now = (saved or {}).get("command_line"), (self.provenance or {}).get("command_line")
        if not before or not now or _same_command(before, now):
            return
        self.events.emit(Event.COMMAND_LINE_CHANGED, step=step, saved_command_line=before, command_line=now)
        log.warning("step %d was saved by `%s`; this program is `%s`. If it is another experiment, it resumed the "
                    "other one's state: give each its own run id (RSLURM_RUN_ID, or Checkpointer(run_id=...))",
                    step, printable(shlex.join(before)), printable(shlex.join(now)))

    # ------------------------------------------------------------------ the resume check (metrics.py)
    def resume_ended(self, outcome: ResumeOutcome | None) -> None:
        """The resume check's outcome, when it ended: verified, or diverged."""
        if outcome is None:
            return
        if outcome.divergence is None:
            self.verified(outcome.check)
        else:
            self.divergence(outcome.check, outcome.divergence)

    def verified(self, check: ResumeCheck) -> None:
        self.events.emit(Event.RESUME_VERIFIED, restored_step=check.restored_step, first_step=check.compared[0],
                         last_step=check.compared[-1], steps=len(check.compared), values=check.values)
        log.info("rank %d: the resume from step %d is exact: steps %d-%d recorded the same metrics as before the "
                 "stop", self.topology.rank, check.restored_step, check.compared[0], check.compared[-1])

    def divergence(self, check: ResumeCheck, d: Divergence) -> None:
        self.events.emit(Event.RESUME_DIVERGED, restored_step=check.restored_step, step=d.step, metric=d.metric,
                         before=_exact(d.before), after=_exact(d.after), tolerance=check.tolerance)
        first = d.step == check.restored_step + 1
        log.warning(
            "rank %d: the resumed run is not exact: step %d recorded %s=%r before the stop and %r after the resume "
            "from step %d (resume_tolerance=%g). %s", self.topology.rank, d.step, d.metric, d.before, d.after,
            check.restored_step, check.tolerance,
            "It differs at the first step after the resume: likely a batch fetched before ckpt.step() and lost "
            "with the stop (a prefetching loop; docs/integration.md, Prefetching loops), or randomness from a "
            "generator that is not in state, or a value kept outside state (a counter, per-rank data)."
            if first else
            "Earlier repeated steps agreed: likely a value kept outside state that matters only later, or "
            "non-deterministic kernels (then set resume_tolerance). `rslurm rehearse` shows the first step "
            "that differs from an uninterrupted run.")

    # ------------------------------------------------------------------ emergencies, tags, cadence
    def emergency(self, step: int, signals_seen: Sequence[str], heard_here: bool, heard_socket: bool) -> None:
        """One ``emergency_requested`` per request and rank, saying how this rank heard of it
        (``signals_seen``: every signal the rank's link trapped so far)."""
        if self._emergency_reported:
            return
        self._emergency_reported = True
        new, self._signals_reported = signals_seen[self._signals_reported:], len(signals_seen)
        if new:
            how = new[0]  # SIGTERM, SIGUSR2...
        elif heard_socket:
            how = "control_socket"
        elif heard_here:
            how = "api"  # request_emergency_save() called by the program
        else:
            how = "peer"  # another rank heard it; this one learnt it at the step agreement
        self.events.emit(Event.EMERGENCY_REQUESTED, step=step, how=how)

    def emergency_saved(self, step: int) -> None:
        """The emergency save committed: the next request is a new one."""
        self._emergency_reported = False
        log.warning("rank %d: emergency checkpoint of step %d committed; should_stop is set",
                    self.topology.rank, step)

    def tagged(self, run_id: str, step: int, name: str, moved: int | None) -> None:
        if self.topology.is_leader:
            self.events.emit(Event.TAGGED, step=step, tag=name, moved_from=moved)
        if self.topology.rank == 0:
            log.info("run %s: step %d tagged %r%s", run_id, step, name,
                     f" (moved from step {moved})" if moved is not None else "")

    def cadence(self, basis: str, cadence: Cadence) -> None:
        """Rank 0: log the default cadence's interval and write a ``cadence`` event, at the start and when
        the measured costs move it by a quarter or more."""
        interval = cadence.every_seconds or 0.0
        if self.topology.rank != 0 or (basis != "start" and abs(interval - self._cadence_reported)
                                       < 0.25 * self._cadence_reported):
            return
        self._cadence_reported = interval
        stall, write = cadence.costs()
        mtbf = cadence.planned_failure_interval
        self.events.emit(Event.CADENCE, basis=basis, interval_s=round(interval, 3), stall_s=round(stall, 6),
                         write_s=round(write, 6), failure_interval_s=mtbf)
        if basis == "start":
            log.info("no every_steps or every_seconds: saving every %.0f s at first, then on Daly's interval "
                     "for the measured save cost and a failure every %.1f h (auto_cadence=off turns this off)",
                     interval, mtbf / 3600)
        else:
            log.info("default cadence: saving every %.0f s (save stall %.3f s, background write %.1f s, a "
                     "failure every %.1f h)", interval, stall, write, mtbf / 3600)

    # ------------------------------------------------------------------ stragglers, the launcher watch
    def stragglers(self, step: int, watch: StragglerWatch, new: Sequence[Straggler], cleared: Sequence[int]) -> None:
        """Rank 0, after a window: an event and a warning for each new straggler, an event for each cleared."""
        window = watch.window
        for s in new:
            self.events.emit(Event.STRAGGLER, step=step, window=window, threshold=watch.ratio,
                             straggler_rank=s.rank, straggler_node=s.node, step_time_s=round(s.step_time_s, 6),
                             peer_median_s=round(s.peer_median_s, 6), ratio=round(s.ratio, 3))
            log.warning("straggler at step %d: %s, the median over the last %d steps", step, s.describe(),
                        window)
        for r in cleared:
            self.events.emit(Event.STRAGGLER_CLEARED, step=step, window=window, straggler_rank=r,
                             straggler_node=watch.nodes[r])

    def launcher_gone(self, pid: int, bound: float) -> None:
        self.events.emit(Event.LAUNCHER_GONE, launcher_pid=pid, bound_s=bound)

    def orphan_timeout(self, pid: int, bound: float, saved: bool) -> None:
        self.events.emit(Event.ORPHAN_TIMEOUT, launcher_pid=pid, bound_s=bound, saved=saved)


def _exact(v: float | int | None) -> float | int | None:
    """A recorded metric for an event, every bit of it (events round other floats)."""
    return ExactFloat(v) if isinstance(v, float) else v


def _same_command(a: Sequence[str], b: Sequence[str]) -> bool:
    """One program with the same arguments, however its path was spelled (``train.py``, ``./train.py``, the
    absolute path ``python -m`` gives)."""
    return len(a) == len(b) and os.path.basename(a[0]) == os.path.basename(b[0]) and list(a[1:]) == list(b[1:])
