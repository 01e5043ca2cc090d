"""The run's history as the launcher reads and writes it: the earlier ends the requeue policy counts, this
incarnation's end appended to it, and what the ranks said they restored.

Who calls what: the launcher reads the run's history (:func:`read_run_history`) and appends this
incarnation's end to it (:func:`record_history`) before it acts on the decision (a requeue kills it, so the
record comes first); :class:`ObservedFailures` reads it once per launcher run for the default checkpoint
cadence; :func:`ranks_resumed_from` words the ``restore`` events of this node's ranks for the log line that
ends the incarnation. The history's format and its readers are :mod:`resilient_slurm.run_history` and
:mod:`resilient_slurm.catalog.history`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

from ..errors import ConfigError, ResilientSlurmError
from ..paths import load_json, open_regular
from ..rundir import RunDir
from ..storage.fileio import atomic_write
from ..telemetry import events_path
from .context import launch_log as log
from .durability import JobDrain
from .policy import HISTORY_FILE, Action, Decision, Outcome, ProgressHistory, RankRun


class ObservedFailures:
    """The run's mean time between unannounced failures, for the default checkpoint cadence."""

    def __init__(self, run_dir: str, run_id: str) -> None:
        self.run_dir = run_dir
        self.run_id = run_id
        self._history: ProgressHistory | None = None  # read once, at the first ask

    def interval(self, *, started_at: float | None, in_job: Sequence[RankRun]) -> float | None:
        """From the run's history and this incarnation's in-job restarts so far (``in_job``); None before
        the first failure (the rank's default then applies). The history is read once per launcher run,
        from this node only (a durable tier that does not answer must not delay the ranks' start for a
        cadence hint); empty, with a warning, when it cannot be read."""
        if self._history is None:
            from ..catalog.history import read_history

            try:
                self._history = read_history(os.path.dirname(self.run_dir), self.run_id, None).history
            except Exception as exc:  # a cadence hint is not worth a launch
                log.warning("cannot read the run's history for the default cadence: %s", exc)
                self._history = ProgressHistory()
        return self._history.failure_interval(now=time.time(), started_at=started_at, in_job=in_job)


def read_run_history(run_dir: str, run_id: str, drain: JobDrain | None) -> ProgressHistory:
    """The run's history: this node's copy or the durable tier's (requeued onto another batch host, the
    history follows the run there), whichever ended last. An unreadable copy is logged and skipped:
    a broken history must not keep a preempted job from being requeued (it only resets the counts)."""
    from ..catalog.history import read_history

    try:
        run = read_history(os.path.dirname(run_dir), run_id, drain.tier if drain is not None else None)
    except Exception as exc:  # the contract: a damaged run file never changes the exit code (75 stays 75)
        log.warning("cannot read the run's history (%s: %s); counting restarts without it", type(exc).__name__,
                    exc)
        return ProgressHistory()
    for err in run.errors:
        log.warning("%s; counting restarts without it", err)
    return run.history


def record_history(run_dir: str, drain: JobDrain | None, history: ProgressHistory, outcome: Outcome,
                   decision: Decision | None, *, started_at: float | None, in_job: Sequence[RankRun]) -> None:
    """Append this incarnation's end (class, evidence, in-job restarts, the action) to the run's history
    in the run directory and, when there is one, the durable tier (best effort: a failure is logged)."""
    data = history.record(outcome, started_at=started_at, ended_at=time.time(),
                          action=decision.action.value if decision else Action.EXIT.value,
                          in_job=in_job).to_json().encode()
    try:  # never through a link at the run directory or the file (ConfigError naming it)
        atomic_write(RunDir.at(run_dir).history, data, root=os.path.dirname(run_dir))
    except (OSError, ResilientSlurmError) as exc:
        log.warning("cannot write the run's history in %s: %s", run_dir, exc)
    if drain is not None:
        drain.write_object(HISTORY_FILE, data)


def ranks_resumed_from(run_dir: str, run_id: str, started: float) -> str:
    """What this node's ranks reported restoring since ``started`` (their ``restore`` events; the last run
    of the ranks after in-job restarts), in words: the step on disk at the start is only what they could
    resume from."""
    last: dict[int, int] = {}
    try:
        fd = open_regular(events_path(os.path.dirname(run_dir), run_id), os.O_RDONLY,
                          root=os.path.dirname(run_dir))
        with os.fdopen(fd, "rb") as f:
            lines = f.read(64 << 20).splitlines()
    except (OSError, ConfigError):  # none yet, or a link or special file there
        return "unknown (no event log)"
    for line in lines:
        try:
            rec = load_json(line, source="events.jsonl")
        except ConfigError:
            continue
        if (isinstance(rec, dict) and rec.get("source") == "rank" and rec.get("event") in ("restore", "restore_none")
                and isinstance(rec.get("t"), (int, float)) and rec["t"] >= started and isinstance(rec.get("rank"), int)):
            step = rec.get("step")  # a damaged line must not change the exit code: whole numbers only
            last[rec["rank"]] = step if rec["event"] == "restore" and isinstance(step, int) else 0
    if not last:
        return "nothing (no rank on this node reported a restore)"
    steps = sorted(set(last.values()))
    if steps == [0]:
        return "nothing (a fresh start)"
    return f"step {steps[0]}" if len(steps) == 1 else "steps " + ", ".join(map(str, steps))


__all__ = ["ObservedFailures", "ranks_resumed_from", "read_run_history", "record_history"]
