"""In-job restart: after a hang, a rank killed by a signal (the kernel's OOM killer included) or a
communicator error, start the ranks again inside the same allocation, from the last commit, instead of
requeueing the job.

Who calls what: the launcher, after each run of the ranks that nothing asked to stop, calls
:meth:`InJobRestarts.restart` with the run's outcome. It says no when the outcome is not one for that
(:data:`IN_JOB_RESTARTABLE`), ``in_job_restarts`` are used up, or restarts in a row commit nothing new
(``no_progress_limit``): the usual requeue path decides then. Otherwise it waits an exponential backoff,
during which a stop signal still ends the run as that stop, and records the run (:attr:`InJobRestarts.runs`,
which go into the run's history and the default checkpoint cadence).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ..telemetry import Event
from .context import LaunchContext
from .context import launch_log as log
from .policy import Outcome, RankRun, Reason, describe_outcome, restartable
from .signals import SignalTrap, TrapEvent
from .stopping import StopControl

IN_JOB_BACKOFF_S = 2.0  # before the first in-job restart; doubled for each next one
IN_JOB_BACKOFF_MAX_S = 60.0
# Ends the ranks can come back from inside the allocation: the job and its nodes are fine, a rank was not
# (an out-of-memory only when the kernel killed the rank: one the program raised would repeat). A lost
# node is not among them: a new step would be placed on it again.
IN_JOB_RESTARTABLE = frozenset({Reason.HANG, Reason.KILLED_BY_SIGNAL, Reason.OUT_OF_MEMORY,
                                Reason.COMMUNICATOR_ERROR})


class InJobRestarts:
    """The in-job restarts of one incarnation: how many, how many in a row committed nothing new, and the
    runs of the ranks they ended."""

    def __init__(self, ctx: LaunchContext, stopping: StopControl) -> None:
        self.ctx = ctx
        self.stopping = stopping
        self.restarts = 0
        self.stalled = 0  # restarts in a row whose run committed nothing new
        self.runs: list[RankRun] = []  # runs of the ranks that ended in an in-job restart (or a stop in its backoff)
        self._backoff_stopped = False

    def restart(self, outcome: Outcome, baseline: int | None, trap: SignalTrap,
                on_event: Callable[[TrapEvent], None]) -> bool:
        """After the backoff, True when the ranks are to start again (the run that ended, with ``baseline``
        the step it restored, is then recorded); False when the requeue path decides. Trapped signals
        during the backoff go to ``on_event``."""
        if not self._wait(outcome, baseline, trap, on_event):
            if self.stopping.stop is not None and self._backoff_stopped:  # the run ended, its restart did not come
                self.runs.append(RankRun(outcome.reason.value, outcome.evidence or outcome.detail,
                                         outcome.committed_step, time.time()))
            return False
        self.runs.append(RankRun(outcome.reason.value, outcome.evidence or outcome.detail,
                                 outcome.committed_step, time.time()))
        self.stalled = self.stalled + 1 if outcome.committed_step == baseline else 0
        self.restarts += 1
        return True

    def _wait(self, outcome: Outcome, baseline: int | None, trap: SignalTrap,
              on_event: Callable[[TrapEvent], None]) -> bool:
        cfg, restarts, stopping = self.ctx.cfg, self.restarts, self.stopping
        if (outcome.reason not in IN_JOB_RESTARTABLE or not restartable(outcome) or stopping.stop is not None
                or stopping.interrupts):
            return False
        what = describe_outcome(outcome)
        if restarts >= cfg.in_job_restarts:
            log.error("in-job restarts used up (%d, in_job_restarts=%d) after %s; falling back to requeue",
                      restarts, cfg.in_job_restarts, what)
            return False
        no_progress = self.stalled + 1 if outcome.committed_step == baseline else 0
        if cfg.no_progress_limit and restarts and no_progress >= cfg.no_progress_limit:
            log.error("the last %d runs of the ranks committed nothing new (no_progress_limit=%d); falling back "
                      "to requeue", no_progress, cfg.no_progress_limit)
            return False
        backoff = min(IN_JOB_BACKOFF_MAX_S, IN_JOB_BACKOFF_S * 2 ** restarts)
        log.warning("%s; restarting the ranks in this allocation from step %s in %.0f s (in-job restart %d of %d)",
                    what, outcome.committed_step, backoff, restarts + 1, cfg.in_job_restarts)
        self.ctx.event(Event.IN_JOB_RESTART, attempt=restarts + 1, limit=cfg.in_job_restarts,
                       outcome=outcome.reason.value, detail=what, evidence=outcome.evidence,
                       committed_step=outcome.committed_step, backoff_s=backoff)
        end = time.time() + backoff
        while time.time() < end:  # a stop signal during the backoff ends the run as that stop
            if trap.wait(min(0.2, max(0.0, end - time.time()))):
                for ev in trap.pop():
                    on_event(ev)
            if stopping.stop is not None or stopping.interrupts:
                if stopping.stop is not None:
                    self._backoff_stopped = True
                    stopping.not_started(outcome.committed_step)
                return False
        return True


__all__ = ["IN_JOB_BACKOFF_MAX_S", "IN_JOB_BACKOFF_S", "IN_JOB_RESTARTABLE", "InJobRestarts"]
