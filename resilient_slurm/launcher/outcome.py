"""Classifying how a run of the ranks ended: the :class:`~.policy.Outcome` (its reason, the rank and node
to blame, the evidence) that the in-job restart and the requeue policy decide on.

Who calls what: the launcher calls :func:`newest_committed` for the baseline when a run starts, and
:func:`classify_outcome` once the ranks are gone (after each run of the ranks, and once more for the
incarnation), handing it what it saw meanwhile (:class:`RanksView`: the stop request, a hang, a failed
start, the nodes the health gate found bad, the ranks found failed first). The order of the checks is the
order of precedence: bad nodes, a hang, a failed start, a stop the launcher asked for, ranks that saved on
a signal Slurm sent them directly, then the failed ranks' own evidence (:func:`~.attribution.
attribute_failure`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Protocol

from ..errors import ResilientSlurmError
from ..layout import list_run_dir
from ..manifest import read_manifest_file
from ..rendezvous import rendezvous_failure_line
from ..rundir import RunDir
from ..slurm.client import remaining_seconds
from .attribution import PEER_CLOSED, HangCause, OomCounters, attribute_failure
from .context import LaunchContext
from .context import launch_log as log
from .hang import Hang
from .health import NodeHealth
from .health import summary as health_summary
from .policy import Outcome, Reason, restore_unavailable, traceback_location
from .processes import Children, LocalRanks, RankExit
from .startup import StartupFailure
from .stopping import TIME_LIMIT_WINDOW, StopControl, stop_evidence


def newest_committed(run_dir: str) -> tuple[int | None, str | None]:
    """The newest step under ``run_dir`` with a readable manifest, and its reason."""
    try:
        committed = list_run_dir(run_dir).committed
    except OSError as exc:
        log.warning("cannot list %s: %s", run_dir, exc)
        return None, None
    for step in reversed(committed):
        path = RunDir.at(run_dir).manifest(step)
        try:
            return step, read_manifest_file(path).reason
        except (OSError, ResilientSlurmError):
            continue
    return None, None


class RanksView(LaunchContext, Protocol):
    """What the launcher saw of the current run of the ranks (implemented by :class:`~.launch.Launcher`)."""

    stopping: StopControl
    unhealthy: list[NodeHealth]  # nodes the last health check found bad and could not exclude
    hang: Hang | None
    hang_cause: HangCause | None  # the hang verdict read with the ranks' output at that moment
    startup_failure: StartupFailure | None
    emergency_seen: bool  # the ranks committed an emergency checkpoint (set here too, from the newest step)
    root_failures: list[RankExit]  # the ranks found failed first, in this run of the ranks
    oom: OomCounters
    ranks_seen: bool  # a rank of this node registered or wrote a heartbeat in this run of the ranks


def stderr_of(children: Children, failed: RankExit) -> str:
    """The stderr tail that speaks for ``failed``: its own for a local rank, srun's under srun."""
    idx = failed.rank if isinstance(children, LocalRanks) and failed.rank is not None else 0
    return children.stderr_tail(idx)


def error_location(children: Children, failed: RankExit) -> str | None:
    """Where the failed rank's traceback points (file:line in the user's code), when it printed one."""
    return traceback_location(stderr_of(children, failed), failed.rank)


def failed_in_order(children: Children, exits: Sequence[RankExit], root_failures: Sequence[RankExit]) -> list[RankExit]:
    """The ranks that failed, the root cause first: those the loop found failed first (before any
    teardown), then the others that failed on their own. When the loop saw none first (every rank
    ended between two polls), ranks killed by a signal come before ranks that exited with a code."""
    failed = [e for e in exits if not e.ok and (e.signal is not None or e.exit_code not in (None, 0))]
    root = list(root_failures)
    if root:
        rest = [e for e in failed if e not in root and (e.signal is None or not children.torn_down)]
        return root + rest
    return [e for e in failed if e.signal is not None] + [e for e in failed if e.signal is None]


def classify_outcome(run: RanksView, children: Children | None, baseline: int | None) -> Outcome:
    """Why the run of the ranks ended, with ``baseline`` the step it restored (None: none)."""
    committed, newest_reason = newest_committed(run.run_dir)
    if newest_reason == "emergency" and committed is not None and committed != baseline:
        run.emergency_seen = True
    base = Outcome(Reason.COMPLETED, committed_step=committed, restored_step=baseline,
                   restart_count=run.restart_count, job_id=run.job_id)
    stop = run.stopping.stop
    if run.unhealthy or (children is None and stop is None):
        bad = run.unhealthy
        return replace(base, reason=Reason.NODE_FAILURE, node=",".join(h.node for h in bad) or None,
                       evidence=f"node health check: {health_summary(bad)}", detail=health_summary(bad))
    if run.hang is not None:
        cause = run.hang_cause or HangCause(Reason.HANG, run.hang.describe())
        detail = run.hang.describe() if cause.reason is Reason.HANG else cause.evidence
        return replace(base, reason=cause.reason, rank=cause.rank, detail=detail, evidence=cause.evidence)
    if run.startup_failure is not None and stop is None:
        f = run.startup_failure
        where = f"{f.addr}:{f.port}" if f.addr and f.port else "an unknown address"
        return replace(base, reason=Reason.STARTUP, node=f.node, evidence=f.message(),
                       detail=f"no rank started within {f.bound_s:.0f} s; rendezvous at {where}")
    if stop is not None or children is None:
        # We asked the ranks to stop (or tore them down, or did not start them): whatever their exit codes,
        # the job was stopped from outside and can go on from the last commit.
        assert stop is not None
        return replace(base, reason=stop.reason, detail=f"stopped by {stop.source}",
                       evidence=stop_evidence(stop, run.cfg.cloud_notice))
    exits = children.exits()
    failed = failed_in_order(children, exits, run.root_failures)
    if run.emergency_seen and not any(e.exit_code not in (None, 0) for e in exits):
        # Slurm signalled the ranks directly (preemption without --signal): they saved and left.
        job = run.job_info()
        reason = Reason.PREEMPTED
        if job is not None and job.preempt_time is None and remaining_seconds(job, time.time()) <= TIME_LIMIT_WINDOW:
            reason = Reason.TIME_LIMIT
        source = "a signal from Slurm" if run.job_id else "a signal sent to the ranks, not to the launcher"
        detail = f"ranks took an emergency checkpoint on {source}"
        return replace(base, reason=reason, detail=detail, evidence=detail)
    if not failed:
        return replace(base, reason=Reason.COMPLETED, evidence="every rank exited 0")
    first = failed[0]
    if first.signal is not None:
        job = run.job_info()
        if job is not None and job.preempt_time is not None:
            return replace(base, reason=Reason.PREEMPTED, rank=first.rank, signal=first.signal, node=first.node,
                           evidence=f"{first.describe()}; Slurm set the job's PreemptTime")
    coded = [e for e in failed if e.exit_code not in (None, 0)]
    if any(restore_unavailable(stderr_of(children, e)) for e in coded):
        return replace(base, reason=Reason.STORAGE_UNAVAILABLE, rank=coded[0].rank,
                       detail="a rank could not restore: checkpoint storage failed (RestoreUnavailableError)",
                       evidence="resilient_slurm.errors.RestoreUnavailableError")
    att = attribute_failure(failed, lambda e: stderr_of(children, e), oom_evidence=run.oom.evidence(),
                            srun_text=children.stderr_tail(0) if run.srun else "")
    assert att is not None
    who = att.failed
    if att.reason is Reason.COMMUNICATOR_ERROR and not run.ranks_seen and (
            said := rendezvous_failure_line([stderr_of(children, who), children.stderr_tail(0)])):
        # The collective that failed was the rendezvous: no rank had started, and torch said it could
        # not reach the store. The address is the cause, not the network of a running job.
        return replace(base, reason=Reason.STARTUP, rank=who.rank, exit_code=who.exit_code, node=who.node,
                       evidence=f"{att.evidence}; before it: {said[0]}",
                       detail=f"the rendezvous failed before any rank started: {att.evidence}")
    if att.reason is Reason.USER_ERROR:
        return replace(base, reason=Reason.USER_ERROR, rank=who.rank, exit_code=who.exit_code, node=who.node,
                       error_location=error_location(children, who),
                       evidence=att.evidence or f"exit code {who.exit_code}, no Python traceback")
    if att.reason is Reason.COMMUNICATOR_ERROR and children.left_early and PEER_CLOSED.search(att.evidence):
        return left_early(replace(base, rank=who.rank, exit_code=who.exit_code or None, node=who.node),
                          children.left_early, f"{who.describe()}: {att.evidence}")
    return replace(base, reason=att.reason, rank=who.rank, signal=who.signal, exit_code=who.exit_code,
                   node=who.node, evidence=att.evidence, detail=att.evidence)


def left_early(base: Outcome, ranks: Mapping[int, float], then: str) -> Outcome:
    """A run in which ``ranks`` exited 0 on their own while their peers still trained (local ranks:
    :attr:`~.processes.LocalRanks.left_early`), and a peer then failed in a collective because a peer closed
    or reset its connections (``then``; ``base`` names the peer that failed): the program ended on some ranks
    before the others (uneven data across ranks is the usual cause), and a restart would end the same way, so
    it is the program's error, with this account as its detail (the policy's message). A collective that
    timed out (the network), and a hang (a rank may hang in its own I/O after the others finished), are left
    as they are."""
    first = min(ranks, key=lambda r: ranks[r])
    who = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, sorted(ranks)))}"
    when = time.strftime("%H:%M:%S", time.localtime(ranks[first]))
    detail = (f"{who} exited 0 (at {when}) while the rest of the job still ran, and a peer then failed in a "
              "collective: the program ends on some ranks before the others (uneven data across ranks? "
              "torch.distributed.algorithms.Join, drop_last); a restart would end the same way")
    return replace(base, reason=Reason.USER_ERROR, detail=detail, evidence=f"{who} exited 0 while the others ran; then {then}")


__all__ = ["RanksView", "classify_outcome", "error_location", "failed_in_order", "left_early", "newest_committed",
           "stderr_of"]
