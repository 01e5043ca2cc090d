"""A stop request: what a trapped signal (or a cloud notice) means, by when the ranks must have saved, how
the save request reaches them, and tearing their process trees down.

Who calls what: the launcher's loop hands every trapped signal to :meth:`StopControl.on_event`. The first
one becomes the :class:`StopRequest` (its class read from what Slurm says about the job, its deadline the
job's end less ``requeue_margin``, ``save_timeout`` when Slurm gives none; KillWait less
:func:`records_reserve` after the signal when Slurm is already ending the job); the request goes to this node's
ranks over the control socket and, when ranks may run elsewhere (or none registered yet), as the save
signal to every task through Slurm, held back (:meth:`StopControl.send_deferred_signal`, called on every
turn of the loop) while no rank registered. Later signals may only bring the deadline closer. SIGINTs (but
a repeated SIGTERM or SIGHUP are not) are counted as interrupts: the second one tears the ranks down at once.
:func:`teardown` is how the launcher ends ranks, whatever the reason (deadline, hang, failed start, a
failed peer); :func:`stop_evidence` says what a stop's class was read from, for the outcome.
"""

from __future__ import annotations

import math
import signal
import time
from dataclasses import dataclass

from ..control import ControlServer
from ..errors import SlurmError
from ..slurm import JobInfo
from ..slurm.client import remaining_seconds
from ..telemetry import Event
from .context import LaunchContext
from .context import launch_log as log
from .durability import DAEMON_STEP_NAME
from .policy import Reason
from .processes import Children
from .signals import SignalTrap, TrapEvent

# A stop signal with the job's end this close is the time limit (USR1 from --signal, or SIGTERM at the
# end); further away it is a preemption or an operator's request.
TIME_LIMIT_WINDOW = 15 * 60.0
# Of the KillWait between the SIGTERM of a job Slurm is ending and its SIGKILL, what the ranks' save may
# not use: the launcher's own records of the end (decision, not_requeued, history) and the teardown. At
# most half of KillWait.
RECORDS_RESERVE_S = 2.0


@dataclass
class StopRequest:
    """Why and by when the ranks were asked to stop."""

    source: str  # SIGTERM, SIGUSR1, SIGUSR2, SIGINT, SIGHUP, cloud, slurm (seen by the health check)
    at: float
    deadline: float
    reason: Reason
    job: JobInfo | None = None
    # Slurm's record of the job when a signal found Slurm already ending it (a cancel, a time limit without
    # a warning signal, the end of a preemption's grace): no requeue is possible, and the SIGKILL follows
    # KillWait after that signal, so the launcher records the end before it waits for the ranks to exit.
    ending: JobInfo | None = None


def ending(job: JobInfo) -> bool:
    """Slurm is killing the job or has ended it: a requeue request would be ignored."""
    return job.finished or job.state == "COMPLETING"


def records_reserve(kill_wait: float) -> float:
    """What a job Slurm is ending keeps of ``kill_wait`` for the launcher's records and teardown."""
    return min(RECORDS_RESERVE_S, kill_wait / 2)


def stop_reason(ev: TrapEvent, job: JobInfo | None) -> Reason:
    """The class of a stop: a cloud notice, a preemption, the time limit or a cancel, from the job's state."""
    if ev.source == "cloud":
        return Reason.CLOUD_TERMINATION
    if job is not None:
        if job.preempt_time is not None:
            return Reason.PREEMPTED
        if ending(job):
            # Slurm is killing the job: at the time limit it says so (Reason=TimeLimit, state TIMEOUT);
            # a job the user cancelled has no such reason (state CANCELLED, or COMPLETING while its
            # processes end). EndTime cannot tell them apart: a cancel moves it to now.
            if job.state == "TIMEOUT" or job.reason == "TimeLimit":
                return Reason.TIME_LIMIT
            if job.state == "CANCELLED" or (job.state == "COMPLETING" and job.reason is None):
                return Reason.CANCELLED
        rem = remaining_seconds(job, time.time())
        if rem <= TIME_LIMIT_WINDOW:
            return Reason.TIME_LIMIT
    return Reason.PREEMPTED


def stop_evidence(stop: StopRequest, cloud_notice: str) -> str:
    """What a stop's class was read from: the signal, and what Slurm said about the job then."""
    parts = [f"{stop.source} at {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(stop.at))}"]
    job = stop.job
    if stop.reason is Reason.CLOUD_TERMINATION:
        parts.append(f"termination notice from {cloud_notice} metadata")
    elif job is not None and job.preempt_time is not None:
        parts.append("Slurm set the job's PreemptTime")
    elif job is not None:
        rem = remaining_seconds(job, stop.at)
        if not math.isinf(rem):
            parts.append(f"{max(rem, 0.0):.0f} s of the time limit left")
    return "; ".join(parts)


class StopControl:
    """The incarnation's stop request and interrupts, and the save signal held back for it."""

    def __init__(self, ctx: LaunchContext) -> None:
        self.ctx = ctx
        self.stop: StopRequest | None = None
        self.interrupts = 0
        self._deferred_signal: int | None = None  # save signal held back until a rank registers
        self._deferred_check_at = 0.0
        self._kill_wait_s: float | None = None
        # Signals this launcher itself sent the ranks for the stop (forwarded SIGTERM, the save signal through
        # Slurm), each with why: a rank that ends on one was not killed from outside.
        self.sent_to_ranks: dict[int, str] = {}

    def before_start(self, trap: SignalTrap, server: ControlServer, restored: int | None) -> bool:
        """A stop that came before a run of the ranks starts (during the health check, an in-job restart's
        backoff, the set-up) is taken now, and True says not to start the ranks: they would only restore
        ``restored`` and save it again, inside the stop's deadline (where a preemption's grace ends in a
        SIGKILL, and a large model takes minutes to load). The run then ends as the stop says."""
        if not trap.pending():
            return False
        events = trap.pop()
        for ev in events:
            self.on_event(ev, None, server)
        if self.stop is None:
            return False
        self.not_started(restored)
        return True

    def not_started(self, restored: int | None) -> None:
        """Say that the ranks are not started for the stop (here, or in an in-job restart's backoff)."""
        assert self.stop is not None
        log.warning("%s before the ranks started: not starting them (the run goes on from %s)", self.stop.source,
                    f"step {restored}" if restored is not None else "its start")
        self.ctx.event(Event.RANKS_NOT_STARTED, signal=self.stop.source, restored_step=restored)
        self.withhold_deferred_signal("ranks_not_started")  # no task of this run will ever trap it

    def on_event(self, ev: TrapEvent, children: Children | None, server: ControlServer) -> None:
        """A trapped signal (or cloud notice): the stop request, or an earlier deadline for the one made."""
        ctx = self.ctx
        log.warning("received %s", ev.source)
        ctx.event(Event.SIGNAL, signal=ev.source, at=ev.at)
        # A person's Ctrl-C, twice: tear down at once. A SIGTERM (or SIGHUP) twice is no such request: two
        # deliveries of one stop (to the process group and to the launcher, two supervisors) a few ms apart
        # tore the ranks down in the middle of their emergency save; the deadline bounds that save anyway.
        if ev.source == "SIGINT":
            self.interrupts += 1
        if self.stop is not None:
            if ev.deadline is not None or ev.source == "SIGTERM":
                job = ctx.job_info()
                new = self.deadline(ev, job)
                if job is not None and ending(job) and self.stop.ending is None:
                    self.stop.ending = job  # e.g. the end of a preemption's grace, after its USR1
                if new < self.stop.deadline:
                    self.stop.deadline = new
                    server.request_save("emergency", new)
            return
        job = ctx.job_info()
        deadline = self.deadline(ev, job)
        reason = stop_reason(ev, job)
        self.stop = StopRequest(ev.source, ev.at, deadline, reason, job,
                                ending=job if job is not None and ending(job) else None)
        ctx.timings["signal"] = ev.at
        server.request_save("emergency", deadline)
        ctx.timings["save_requested"] = time.time()
        ctx.event(Event.SAVE_REQUESTED, signal=ev.source, reason=reason.value, deadline=deadline,
                  deadline_in_s=deadline - time.time())
        log.warning("%s: emergency checkpoint requested (%s); deadline in %.1f s", ev.source, reason.value,
                    deadline - time.time())
        sig_name = ctx.cfg.save_signal
        if sig_name != "none":
            sig = int(getattr(signal, "SIG" + sig_name))
            registered = bool(server.status()["ranks"])
            if ctx.srun and ctx.job_id and (ctx.multi_node() or not registered):
                # Ranks on other nodes have no socket to this launcher (and on this node, none may have
                # registered): reach them through Slurm.
                if not registered and ctx.env.get("RSLURM_CONTROL_SOCKET", "").strip().lower() != "off":
                    # No rank said hello yet: they are still starting (importing torch, restoring), where
                    # the save signal's default action would kill them. A hello comes after a collective
                    # every rank enters with its traps installed, so the signal waits for the first one
                    # (or half the time to the deadline); the request is already on the socket, and the
                    # ranks' first step shares it with every rank.
                    self._deferred_signal = sig
                    log.info("no rank registered yet (still starting): SIG%s goes to the job's tasks once one "
                             "does", sig_name)
                    ctx.event(Event.SAVE_SIGNAL_DEFERRED, signal=f"SIG{sig_name}")
                else:
                    self.send_save_signal(sig)
            elif not ctx.srun and not registered and children is not None:
                # No rank registered on the socket (still starting, socket off, or a program without a
                # Checkpointer): forward SIGTERM, which a Checkpointer traps like the save signal and
                # which means "stop" to any other program (a rank still importing torch just ends,
                # with nothing lost since nothing was trained yet).
                self.sent_to_ranks[int(signal.SIGTERM)] = f"{ev.source}: {reason.value}"
                children.signal_ranks(signal.SIGTERM)

    def deadline(self, ev: TrapEvent, job: JobInfo | None) -> float:
        """By when the ranks must have saved: ``save_timeout`` from now, or the notice's or the job's end
        less ``requeue_margin`` when sooner; KillWait after the signal less :func:`records_reserve` when
        Slurm is already ending the job."""
        cfg = self.ctx.cfg
        now = time.time()
        deadline = now + cfg.save_timeout
        margin = cfg.requeue_margin
        if ev.deadline is not None:
            deadline = min(deadline, ev.deadline - margin)
        if job is not None and ending(job):
            # Slurm is already killing the job (scancel, the time limit without --signal, the end of a
            # preemption's grace): its SIGKILL follows the SIGTERM after KillWait. Save within that, less
            # what the launcher's records of the end and the teardown need; no requeue is possible any
            # more, so no margin is kept for one.
            kill_wait = self._kill_wait()
            return max(now, ev.at + kill_wait - records_reserve(kill_wait))
        if job is not None:
            rem = remaining_seconds(job, now)
            if not math.isinf(rem):
                deadline = min(deadline, now + rem - margin)
        return max(deadline, now)

    def _kill_wait(self) -> float:
        if self._kill_wait_s is None:
            try:
                self._kill_wait_s = self.ctx.slurm.config_seconds("KillWait") or 30.0
            except SlurmError as exc:
                log.warning("cannot read KillWait from Slurm (%s); assuming 30 s", exc)
                self._kill_wait_s = 30.0
        return self._kill_wait_s

    def send_save_signal(self, sig: int) -> None:
        """The save signal to every task of the job, through Slurm."""
        ctx = self.ctx
        assert ctx.job_id is not None
        name = signal.Signals(sig).name
        if self.stop is not None:
            self.sent_to_ranks[int(sig)] = f"{self.stop.source}: {self.stop.reason.value}"
        ctx.event(Event.SAVE_SIGNAL_SENT, signal=name)
        try:
            ctx.slurm.signal(ctx.job_id, sig)
        except SlurmError as exc:
            log.warning("could not forward %s to the job's tasks: %s; ranks on this node still got the request "
                        "over the control socket", name, exc)

    def send_deferred_signal(self, server: ControlServer, now: float) -> None:
        """Send the save signal held back while no rank had registered, once one has (every rank traps it
        then), or at half the time to the deadline (ranks that never register: no Checkpointer)."""
        stop = self.stop
        if self._deferred_signal is None or stop is None or now < self._deferred_check_at:
            return
        self._deferred_check_at = now + 0.5
        registered = bool(server.status()["ranks"])
        if registered and not self.ctx.multi_node():
            self.withhold_deferred_signal("socket")  # one node: the socket reached every rank
            return
        if registered or now >= stop.at + (stop.deadline - stop.at) / 2:
            sig, self._deferred_signal = self._deferred_signal, None
            self.send_save_signal(sig)

    def committed(self, step: int | None, now: float) -> None:
        """The launcher saw the stop's save committed (step ``step``): say so (event ``committed``); a save
        signal still held back is withheld, as no rank needs it any more."""
        stop = self.stop
        assert stop is not None
        log.info("emergency checkpoint of step %s committed %.2f s after %s", step, now - stop.at, stop.source)
        self.ctx.event(Event.COMMITTED, step=step, after_signal_s=now - stop.at)
        self.withhold_deferred_signal("committed")

    def withhold_deferred_signal(self, reason: str) -> None:
        """The save signal held back is not needed after all, and is never sent (event
        ``save_signal_withheld``): ``socket``, a rank registered and the job has one node, whose ranks the
        socket reaches; ``committed``, the save the stop asked for is committed on every rank (they shared the
        request over their steps' collectives); ``ranks_exited``, the ranks ended (or were torn down) before it was
        sent; ``ranks_not_started``, the stop came before this run of the ranks started, and they are not. Nothing when no signal is held back."""
        if self._deferred_signal is None:
            return
        sig, self._deferred_signal = self._deferred_signal, None
        self.ctx.event(Event.SAVE_SIGNAL_WITHHELD, signal=signal.Signals(sig).name, reason=reason)


def teardown(ctx: LaunchContext, children: Children, grace: float) -> None:
    """End the ranks: under srun every task of their steps on every node (through Slurm), then the
    children's process trees here, with ``grace`` seconds between SIGTERM and SIGKILL."""
    if ctx.srun and ctx.job_id:
        try:  # every task of the ranks' steps on every node; srun then exits
            kill_rank_steps(ctx)
        except SlurmError as exc:
            log.warning("could not kill the job's steps through Slurm: %s", exc)
    children.teardown(grace)


def kill_rank_steps(ctx: LaunchContext) -> None:
    """SIGKILL to the job's steps but the batch script (this launcher), the extern step and the drain
    daemon's step: `scancel --signal=KILL <job>` would cancel the whole job, and the launcher must
    outlive the ranks to restart them in-job or requeue."""
    assert ctx.job_id is not None
    keep = (".batch", ".extern")
    steps = [sid for sid, name in ctx.slurm.steps(ctx.job_id)
             if not sid.endswith(keep) and name != DAEMON_STEP_NAME]
    for sid in steps:
        ctx.slurm.signal(ctx.job_id, signal.SIGKILL, step=sid.split(".", 1)[1])
    log.info("SIGKILL to the ranks' job steps %s", ", ".join(steps) or "(none left)")


__all__ = ["RECORDS_RESERVE_S", "TIME_LIMIT_WINDOW", "StopControl", "StopRequest", "ending", "kill_rank_steps",
           "records_reserve", "stop_evidence", "stop_reason", "teardown"]
