"""Acting on how an incarnation ended: the decision (requeue, hold, exit) from the requeue policy and the
run's history, the history record, then the requeue call and keeping a failed node out of the next start.

Who calls what: the launcher calls :func:`act_on_outcome` last, once the ranks are gone and the newest step
had its chance to become durable. Inside Slurm it reads the run's history, asks
:class:`~.policy.RequeuePolicy`, turns a requeue of a job Slurm is already ending into an exit (a requeue
would be ignored), writes the ``decision`` event and records the end in the history (before the requeue
call, which kills the launcher), then calls ``scontrol requeue`` (or requeue-hold) and, after a node
failure, excludes the node from the job. A local run (no Slurm) exits: 0 completed, 75 (130 after Ctrl-C)
when the same command resumes it, the policy's code for a user error; its end is recorded in the history
too.

A job Slurm is already ending (:attr:`~.stopping.StopRequest.ending`) cannot be requeued, and Slurm's
SIGKILL follows KillWait after its SIGTERM, whoever is still running: the launcher calls
:func:`record_ending` as soon as the emergency step committed (or the ranks' deadline passed, or they
exited), before it waits for the ranks to exit, and :func:`act_on_outcome` then returns what was recorded.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field, replace
from typing import Protocol

from ..errors import SlurmError
from ..slurm import JobInfo
from ..telemetry import Event
from .context import LaunchContext
from .context import launch_log as log
from .durability import JobDrain
from .history_io import ranks_resumed_from, read_run_history, record_history
from .policy import (
    REQUEUE_EXIT_CODE,
    Action,
    Decision,
    Outcome,
    ProgressHistory,
    Reason,
    RequeuePolicy,
    describe_outcome,
    restartable,
)
from .restart import InJobRestarts
from .stopping import StopControl, StopRequest, ending

INTERRUPT_EXIT_CODE = 130  # local mode, Ctrl-C: the shell convention


@dataclass
class LaunchResult:
    """What one launcher run ended with (the exit code is also the process's)."""

    exit_code: int
    outcome: Outcome
    decision: Decision | None
    timings: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class RecordedEnd:
    """What :func:`record_ending` recorded: the result, and the history as it was before this end."""

    result: LaunchResult
    history: ProgressHistory


class Incarnation(LaunchContext, Protocol):
    """What acting on an end reads of the launcher (implemented by :class:`~.launch.Launcher`)."""

    policy: RequeuePolicy
    stopping: StopControl
    drain: JobDrain | None
    in_job: InJobRestarts
    recorded_end: RecordedEnd | None  # the end of a job Slurm is ending, recorded before the ranks exited


def _record(run: Incarnation, history: ProgressHistory, outcome: Outcome, decision: Decision | None) -> None:
    record_history(run.run_dir, run.drain, history, outcome, decision, started_at=run.timings.get("start"),
                   in_job=run.in_job.runs)


def act_on_outcome(run: Incarnation, outcome: Outcome) -> LaunchResult:
    """Decide on ``outcome``, record it, and requeue, hold or exit; returns the launcher's result."""
    log.info("incarnation ended: %s (committed step %s; the ranks resumed from %s)", outcome.reason.value,
             outcome.committed_step, ranks_resumed_from(run.run_dir, run.run_id, run.timings.get("start", 0.0)))
    if not run.job_id:
        result = decide_local(run, outcome)
        _record(run, read_run_history(run.run_dir, run.run_id, run.drain), outcome, result.decision)
        return result
    if run.recorded_end is not None:
        return _recorded(run, run.recorded_end, outcome)
    stop = run.stopping.stop
    history = read_run_history(run.run_dir, run.run_id, run.drain)
    # The requeue rules count the earlier incarnations of this job only (a new submission starts afresh).
    decision = run.policy.decide(outcome, history.of_job(run.job_id, run.restart_count))
    cancelled = outcome.reason is Reason.CANCELLED
    job = run.job_info() if decision.action is not Action.EXIT or cancelled else None
    if job is not None and ending(job):
        return _conclude(run, history, outcome, decision, job)
    result = _conclude(run, history, outcome, decision, None)
    if decision.action is Action.EXIT:
        return result
    if job is not None and not job.requeue:
        log.error("job %s was submitted with --no-requeue (or JobRequeue=0): Slurm will not requeue it; "
                  "resubmit it to resume from step %s", run.job_id, outcome.committed_step)
        return result
    run.timings["requeue"] = time.time()
    run.event(Event.REQUEUE_CALL, action=decision.action.value,
              after_signal_s=(run.timings["requeue"] - stop.at) if stop else None)
    sys.stderr.flush()
    try:
        if decision.action is Action.HOLD:
            run.slurm.requeue_hold(run.job_id, decision.message)
        else:
            run.slurm.requeue(run.job_id)
    except SlurmError as exc:
        log.error("requeue of job %s failed: %s; exiting %d so the job is not recorded COMPLETED",
                  run.job_id, exc, decision.exit_code)
    else:
        if outcome.reason is Reason.NODE_FAILURE and outcome.node:
            exclude_from_job(run, outcome.node.split(","))
    return result


def record_ending(run: Incarnation, stop: StopRequest, outcome: Outcome) -> RecordedEnd:
    """The decision, ``not_requeued`` and the history of an incarnation Slurm is ending (``stop.ending``),
    written at once: the launcher calls it before it waits for the ranks to exit, since Slurm's SIGKILL
    comes KillWait after its SIGTERM whether they did or not. Slurm's record from the stop decides (a job
    Slurm is ending stays so), so no Slurm command is waited for."""
    assert run.job_id and stop.ending is not None
    log.info("Slurm is ending job %s (%s): recording the incarnation's end before the ranks exit", run.job_id,
             stop.ending.state)
    history = read_run_history(run.run_dir, run.run_id, run.drain)
    decision = run.policy.decide(outcome, history.of_job(run.job_id, run.restart_count))
    return RecordedEnd(_conclude(run, history, outcome, decision, stop.ending), history)


def _conclude(run: Incarnation, history: ProgressHistory, outcome: Outcome, decision: Decision,
              ending_job: JobInfo | None) -> LaunchResult:
    """Say and record ``decision``; with ``ending_job`` (Slurm is ending the job: `requeue Incomplete` would
    not touch it) it becomes an exit, followed by ``not_requeued``. The events come first (an append each),
    then the history (fsynced, and copied to the durable tier), all before any requeue call: it kills this
    process."""
    cancelled = outcome.reason is Reason.CANCELLED
    if ending_job is not None and not cancelled:
        # A time limit that struck before rslurm heard of it, or the end of a preemption's grace: Slurm is
        # ending the job and `requeue Incomplete` would not touch it. Decided before anything is said
        # or recorded, so that neither claims a requeue that does not happen.
        if ending_job.preempt_time is not None:
            hint = "Slurm requeues a preempted job itself when the partition's PreemptMode is REQUEUE"
        else:
            hint = ("if this was the time limit, ask for a warning signal so rslurm can requeue in time: "
                    "#SBATCH --signal=B:USR1@300")
        decision = replace(decision, action=Action.EXIT, rule="already_ending", message=(
            f"not requeued: job {run.job_id} is already ending ({ending_job.state}) after "
            f"{describe_outcome(outcome)}; {hint}. The last committed step is {outcome.committed_step}"))
    run.event(Event.DECISION, action=decision.action.value, rule=decision.rule, message=decision.message,
              outcome=outcome.reason.value, committed_step=outcome.committed_step,
              restored_step=outcome.restored_step, evidence=outcome.evidence)
    if ending_job is not None:
        run.event(Event.NOT_REQUEUED, state=ending_job.state)
    quiet = cancelled or ending_job is not None  # what the user or Slurm asked for
    (log.error if not quiet and (decision.action is Action.HOLD
                                 or decision.exit_code not in (0, REQUEUE_EXIT_CODE))
     else log.warning if decision.action is Action.REQUEUE or quiet else log.info)("%s", decision.message)
    _record(run, history, outcome, decision)
    return LaunchResult(decision.exit_code, outcome, decision, run.timings)


def _recorded(run: Incarnation, early: RecordedEnd, outcome: Outcome) -> LaunchResult:
    """The end :func:`record_ending` recorded; its history entry is written again when a step committed
    after it (the ranks saved between the records and their teardown). The events stay as they were said."""
    said = early.result.outcome.committed_step
    if outcome.committed_step != said:
        log.info("step %s committed after the incarnation's end was recorded (step %s then): the history says "
                 "step %s", outcome.committed_step, said, outcome.committed_step)
        _record(run, early.history, outcome, early.result.decision)
    return replace(early.result, outcome=outcome)


def exclude_from_job(ctx: LaunchContext, nodes: list[str], wait_s: float = 10.0) -> None:
    """Keep the requeued job off ``nodes``: Slurm changes a job's excluded nodes only once it is pending
    again, which the requeue makes it within moments (this process is killed only after that)."""
    assert ctx.job_id is not None
    end = time.time() + wait_s
    while True:
        try:
            merged = ctx.slurm.exclude_nodes(ctx.job_id, nodes)
        except SlurmError as exc:
            if time.time() < end:
                time.sleep(0.3)
                continue
            log.error("could not exclude %s from job %s (%s): it may start there again; exclude it yourself "
                      "with `scontrol update JobId=%s ExcNodeList=%s`", ",".join(nodes), ctx.job_id, exc,
                      ctx.job_id, ",".join(nodes))
            return
        log.warning("job %s will not run on %s again (ExcNodeList=%s)", ctx.job_id, ",".join(nodes),
                    ",".join(merged))
        return


def decide_local(run: Incarnation, outcome: Outcome) -> LaunchResult:
    """A local run's end: exit 0 when it completed, the policy's code when it cannot go on, else the code
    that says "run the same command again" (75, or 130 after Ctrl-C)."""
    if outcome.reason is Reason.COMPLETED:
        return LaunchResult(0, outcome, None, run.timings)
    if outcome.reason is Reason.USER_ERROR or not restartable(outcome):
        d = run.policy.decide(outcome, ProgressHistory())
        log.error("%s", d.message)
        return LaunchResult(d.exit_code, outcome, d, run.timings)
    stop = run.stopping.stop
    step = outcome.committed_step
    code = INTERRUPT_EXIT_CODE if stop is not None and stop.source == "SIGINT" else REQUEUE_EXIT_CODE
    msg = (f"stopped ({outcome.detail or outcome.reason.value}); "
           + (f"step {step} is committed" if step is not None else "nothing is committed")
           + ": run the same command again to resume")
    log.warning("%s", msg)
    return LaunchResult(code, outcome, Decision(Action.EXIT, code, msg, outcome.reason.value), run.timings)


__all__ = ["INTERRUPT_EXIT_CODE", "Incarnation", "LaunchResult", "RecordedEnd", "act_on_outcome", "decide_local",
           "exclude_from_job", "record_ending"]
