"""A run's history of incarnations: how each one ended, with its evidence, and the progress it made.

The launcher writes it (``launcher/policy.py`` decides with it: the no-progress rule, the default cadence's
failure interval) into ``launcher-history.json`` in the run directory of the batch host, and a copy in the
durable tier; ``rslurm history`` / ``status`` and the daemon read it (``catalog/history.py``). A model and its
file format only: no I/O but parsing and serializing, no launcher, so the readers need not import the
launcher (docs/architecture.md, "Layers").
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, TypeGuard

from .errors import ProgressHistoryError
from .paths import load_json, valid_time
from .rundir import HISTORY_FILE as HISTORY_FILE  # re-exported: the history model names its file

logger = logging.getLogger(__name__)

# The run's history: in the run directory of the batch host, and a copy in the durable tier.
# Bounds the history file; far more than any sensible no_progress_limit.
HISTORY_MAX_ENTRIES = 64
HISTORY_VERSION = 2  # 2 added the attribution (job, times, evidence, where, the action, in-job restarts)


class Reason(str, Enum):
    """Why a job incarnation ended."""

    PREEMPTED = "preempted"                  # Slurm preemption (SIGTERM with GraceTime)
    TIME_LIMIT = "time_limit"                # the job's time limit (SIGUSR1 from --signal, or SIGTERM)
    NODE_FAILURE = "node_failure"            # Slurm reports a node of the job lost (srun's "Node failure")
    KILLED_BY_SIGNAL = "killed_by_signal"    # a rank killed by a signal nobody in rslurm sent (SIGKILL, SIGSEGV)
    OUT_OF_MEMORY = "out_of_memory"          # the OOM killer (cgroup counter, srun), or MemoryError / CUDA OOM
    COMMUNICATOR_ERROR = "communicator_error"  # a rank's collective failed (gloo/NCCL error, timeout, peer gone)
    HANG = "hang"                            # no progress on the launcher's node past the hang timeout
    CLOUD_TERMINATION = "cloud_termination"  # the cloud provider announced the instance's end
    STORAGE_UNAVAILABLE = "storage_unavailable"  # a rank could not restore: checkpoint storage failed
    STARTUP = "startup"                      # the ranks never started: the rendezvous failed, or nothing
                                             # registered within startup_timeout
    CANCELLED = "cancelled"                  # the user's scancel (no --signal): saved, never requeued
    USER_ERROR = "user_error"                # a rank exited non-zero on its own
    COMPLETED = "completed"                  # every rank exited 0


# Reasons caused by the environment, not the program: a restart can succeed.
RESTARTABLE = frozenset({Reason.PREEMPTED, Reason.TIME_LIMIT, Reason.NODE_FAILURE, Reason.HANG, Reason.CLOUD_TERMINATION,
                         Reason.STORAGE_UNAVAILABLE, Reason.KILLED_BY_SIGNAL, Reason.OUT_OF_MEMORY,
                         Reason.COMMUNICATOR_ERROR, Reason.STARTUP})

# Ends that came without a warning: the work since the last commit is lost. The default cadence plans for
# these (a preemption, a time limit or a cloud notice is announced, and saved for).
UNANNOUNCED = frozenset({Reason.NODE_FAILURE, Reason.KILLED_BY_SIGNAL, Reason.OUT_OF_MEMORY,
                         Reason.COMMUNICATOR_ERROR, Reason.HANG})

# How `rslurm history` and `rslurm status` name each class.
REASON_LABELS = {
    Reason.PREEMPTED: "preempted", Reason.TIME_LIMIT: "time limit", Reason.NODE_FAILURE: "node failure",
    Reason.KILLED_BY_SIGNAL: "killed by signal", Reason.OUT_OF_MEMORY: "out of memory",
    Reason.COMMUNICATOR_ERROR: "communicator error", Reason.HANG: "hang",
    Reason.CLOUD_TERMINATION: "cloud termination", Reason.STORAGE_UNAVAILABLE: "storage unavailable",
    Reason.STARTUP: "startup failure", Reason.CANCELLED: "cancelled",
    Reason.USER_ERROR: "user error", Reason.COMPLETED: "completed",
}


def raised_by_program(outcome: Outcome) -> bool:
    """An out-of-memory the program raised and exited on (MemoryError, CUDA OOM): it would repeat."""
    return outcome.reason is Reason.OUT_OF_MEMORY and outcome.signal is None and outcome.exit_code is not None


def restartable(outcome: Outcome) -> bool:
    """Whether the environment, not the program, ended the incarnation: a restart can succeed."""
    return outcome.reason in RESTARTABLE and not raised_by_program(outcome)


class Action(str, Enum):
    """What the launcher does after an incarnation."""

    REQUEUE = "requeue"
    HOLD = "hold"
    EXIT = "exit"


@dataclass(frozen=True)
class Outcome:
    """How one job incarnation ended.

    ``committed_step``: the newest committed checkpoint step after this incarnation (None: none exists).
    ``restored_step``: the step this incarnation resumed from (None: it started fresh).
    ``restart_count``: SLURM_RESTART_COUNT of this incarnation (0 for the first run).
    For ``user_error``: ``rank``, ``exit_code`` (1..255; None is read as 1) and ``error_location``
    (``"train.py:57 in forward"``, see ``traceback_location``). For ``killed_by_signal``: ``rank`` and
    ``signal`` when known. ``evidence``: what the class was read from (the signal and who sent it, the
    matched line of a rank's stderr or srun's, the OOM counter), shown by ``rslurm history``; ``node``: where
    the failing rank ran, when known.
    """

    reason: Reason
    committed_step: int | None = None
    restored_step: int | None = None
    restart_count: int = 0
    rank: int | None = None
    exit_code: int | None = None
    error_location: str | None = None
    signal: int | None = None
    job_id: str | None = None
    detail: str = ""
    evidence: str = ""
    node: str | None = None

    def __post_init__(self) -> None:
        try:
            reason = Reason(self.reason)
        except ValueError:
            raise ValueError(
                f"unknown outcome reason {self.reason!r}; valid: " + ", ".join(r.value for r in Reason)
            ) from None
        object.__setattr__(self, "reason", reason)
        if reason is Reason.USER_ERROR:
            code = 1 if self.exit_code is None else self.exit_code
            if not 1 <= code <= 255:
                raise ValueError(f"a user_error needs an exit code in 1..255, got {self.exit_code}")
            object.__setattr__(self, "exit_code", code)
        if self.restart_count < 0:
            raise ValueError(f"restart_count must be >= 0, got {self.restart_count}")


@dataclass(frozen=True)
class Decision:
    """What to do: ``action``, the launcher's ``exit_code``, a ``message`` naming the reason for people
    (also the hold reason shown by ``scontrol show job``), and ``rule``, a short machine-readable name."""

    action: Action
    exit_code: int
    message: str
    rule: str


@dataclass(frozen=True)
class RankRun:
    """One run of the ranks inside an incarnation that ended in an in-job restart."""

    reason: str
    evidence: str = ""
    committed_step: int | None = None
    ended_at: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"reason": self.reason, "evidence": self.evidence, "committed_step": self.committed_step,
                "ended_at": self.ended_at}


@dataclass(frozen=True)
class Incarnation:
    """One past incarnation as the history keeps it: why it ended (the class and its evidence), and the
    runs of its ranks that ended in an in-job restart before that (``in_job``, oldest first)."""

    restart_count: int
    reason: str
    restored_step: int | None
    committed_step: int | None
    job_id: str | None = None
    started_at: float | None = None
    ended_at: float | None = None
    evidence: str = ""
    rank: int | None = None
    node: str | None = None
    action: str | None = None  # requeue, hold or exit; None before the decision
    in_job: tuple[RankRun, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"restart_count": self.restart_count, "reason": self.reason, "restored_step": self.restored_step,
                "committed_step": self.committed_step, "job_id": self.job_id, "started_at": self.started_at,
                "ended_at": self.ended_at, "evidence": self.evidence, "rank": self.rank, "node": self.node,
                "action": self.action, "in_job": [r.to_dict() for r in self.in_job]}


def _made_progress(committed: int | None, baseline: int | None) -> bool:
    """Progress = a committed step past the baseline (the step committed before the incarnation)."""
    if committed is None:
        return False
    return baseline is None or committed > baseline


@dataclass(frozen=True)
class ProgressHistory:
    """Restored/committed steps of previous incarnations, oldest first; serialized as JSON.

    It lives in a file next to the checkpoints so that consecutive restarts without progress can be
    counted across requeues (each incarnation is a new process).
    """

    incarnations: tuple[Incarnation, ...] = ()

    def record(self, outcome: Outcome, *, max_entries: int = HISTORY_MAX_ENTRIES, started_at: float | None = None,
               ended_at: float | None = None, action: str | None = None,
               in_job: Sequence[RankRun] = ()) -> ProgressHistory:
        """A new history with ``outcome`` appended (oldest entries dropped beyond ``max_entries``)."""
        entry = Incarnation(outcome.restart_count, outcome.reason.value, outcome.restored_step,
                            outcome.committed_step, job_id=outcome.job_id, started_at=started_at,
                            ended_at=ended_at, evidence=outcome.evidence or outcome.detail, rank=outcome.rank,
                            node=outcome.node, action=action, in_job=tuple(in_job))
        return ProgressHistory((*self.incarnations, entry)[-max_entries:])

    def of_job(self, job_id: str | None, restart_count: int) -> ProgressHistory:
        """The entries the requeue rules count for this incarnation: the earlier incarnations of the same
        Slurm job (a requeue keeps the job id). A new submission that reuses the run id starts afresh; so
        does a first incarnation (restart count 0) where older entries carry no job id."""
        if job_id is not None and any(e.job_id is not None for e in self.incarnations):
            tail: list[Incarnation] = []
            for e in reversed(self.incarnations):
                if e.job_id != job_id:
                    break
                tail.append(e)
            return ProgressHistory(tuple(reversed(tail)))
        return ProgressHistory() if restart_count == 0 else self

    def failure_interval(self, *, now: float | None = None, started_at: float | None = None,
                         in_job: Sequence[RankRun] = ()) -> float | None:
        """The run's mean time between unannounced failures (:data:`UNANNOUNCED`, in-job restarts
        included): its run time, over every incarnation recorded plus the current one (from
        ``started_at`` to ``now``, with its in-job restarts so far ``in_job``), divided by the failures.
        None before the first failure."""
        unannounced = {r.value for r in UNANNOUNCED}
        run_s = sum(max(0.0, e.ended_at - e.started_at) for e in self.incarnations
                    if e.started_at is not None and e.ended_at is not None)
        failures = sum((e.reason in unannounced) + sum(r.reason in unannounced for r in e.in_job)
                       for e in self.incarnations)
        if started_at is not None and now is not None:
            run_s += max(0.0, now - started_at)
        failures += sum(r.reason in unannounced for r in in_job)
        return run_s / failures if failures and run_s > 0 else None

    def last_committed(self) -> int | None:
        """The committed step after the most recent incarnation (None: no history or nothing committed)."""
        return self.incarnations[-1].committed_step if self.incarnations else None

    def no_progress_streak(self, outcome: Outcome | None = None) -> int:
        """How many incarnations in a row, ending with ``outcome`` if given, made no progress.

        An incarnation's baseline is the previous incarnation's committed step; for the oldest entry
        (or a current outcome with no history) it is its own restored step.
        """
        entries = list(self.incarnations)
        if outcome is not None:
            entries = list(self.record(outcome, max_entries=len(entries) + 1).incarnations)
        streak = 0
        for i in range(len(entries) - 1, -1, -1):
            baseline = entries[i - 1].committed_step if i > 0 else entries[i].restored_step
            if _made_progress(entries[i].committed_step, baseline):
                break
            streak += 1
        return streak

    def to_json(self) -> str:
        """The history as a JSON document (versioned)."""
        return json.dumps({"version": HISTORY_VERSION, "incarnations": [e.to_dict() for e in self.incarnations]},
                          indent=1)

    @classmethod
    def from_json(cls, text: str, *, source: str = "<string>") -> ProgressHistory:
        """Parse ``to_json`` output. Raises ProgressHistoryError naming ``source`` (the file) and field."""

        def fail(what: str, fld: str | None) -> ProgressHistoryError:
            where = f" field {fld!r}" if fld else ""
            return ProgressHistoryError(
                f"progress history {source}:{where} {what}; the next `rslurm launch` of the run starts counting "
                "afresh and replaces it (only the no-progress hold count is lost)", source=source, field=fld)

        # Bounded nesting, no NaN, numbers in range: a hostile file is an error naming it, never a crash
        # (a RecursionError here once turned a requeue into exit 1).
        doc = load_json(text, source=source, error=lambda m: fail(m.removeprefix(f"{source}: "), None))
        if not isinstance(doc, dict):
            raise fail(f"expected a JSON object, got {type(doc).__name__}", None)
        if doc.get("version") not in (1, HISTORY_VERSION):
            raise fail(f"unsupported version {doc.get('version')!r} (this rslurm reads 1 to {HISTORY_VERSION})",
                       "version")
        items = doc.get("incarnations")
        if not isinstance(items, list):
            raise fail("missing or not a list", "incarnations")
        out = []
        for i, item in enumerate(items):
            fld = f"incarnations[{i}]"
            if not isinstance(item, dict):
                raise fail("not an object", fld)
            restart_count = item.get("restart_count")
            if not _is_int(restart_count) or restart_count < 0:
                raise fail(f"expected an integer >= 0, got {restart_count!r}", f"{fld}.restart_count")
            reason = item.get("reason")
            if reason not in {r.value for r in Reason}:
                raise fail(f"unknown reason {reason!r}", f"{fld}.reason")
            steps = []
            for key in ("restored_step", "committed_step"):
                v = item.get(key)
                if v is not None and (not _is_int(v) or v < 0):
                    raise fail(f"expected a step number or null, got {v!r}", f"{fld}.{key}")
                steps.append(v)
            out.append(Incarnation(restart_count, reason, steps[0], steps[1], **_attribution_fields(item, fld, fail)))
        return cls(tuple(out))

    @classmethod
    def parse(cls, text: str | None, *, source: str = "<string>", strict: bool = False) -> ProgressHistory:
        """The launcher's reader: None (no file yet) is empty; unreadable text is empty with a warning
        unless ``strict``.

        Why lenient by default: the launcher reads this after a preemption, with the emergency checkpoint
        committed; crashing there would leave the job un-requeued. Treating the file as empty only resets
        the no-progress count (the file is rewritten with this incarnation), and ``max_restarts`` is counted
        by Slurm, not by this file, so a runaway loop stays bounded when it is set.
        """
        if text is None:
            return cls()
        try:
            return cls.from_json(text, source=source)
        except ProgressHistoryError as exc:
            if strict:
                raise
            logger.warning("%s; treating it as empty", exc)
            return cls()


def _is_int(v: Any) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


_TEXT_MAX = 4096  # evidence is a line or two; a longer one is cut, not refused


def _attribution_fields(item: dict[str, Any], fld: str,
                        fail: Callable[[str, str | None], ProgressHistoryError]) -> dict[str, Any]:
    """The version-2 fields of one history entry, checked (absent in version 1: defaults)."""
    out: dict[str, Any] = {}
    for key in ("job_id", "evidence", "node", "action"):
        v = item.get(key)
        if v is not None and not isinstance(v, str):
            raise fail(f"expected a string or null, got {v!r}", f"{fld}.{key}")
        if v is not None:
            out[key] = v[:_TEXT_MAX]
    for key in ("started_at", "ended_at"):
        v = item.get(key)
        if v is not None and not valid_time(v):
            raise fail(f"expected a time (seconds since 1970, before the year 10000) or null, got {str(v)[:40]}",
                       f"{fld}.{key}")
        out[key] = v
    rank = item.get("rank")
    if rank is not None and (not _is_int(rank) or rank < 0):
        raise fail(f"expected a rank or null, got {rank!r}", f"{fld}.rank")
    out["rank"] = rank
    runs = item.get("in_job", [])
    if not isinstance(runs, list):
        raise fail("expected a list", f"{fld}.in_job")
    parsed = []
    for j, run in enumerate(runs):
        where = f"{fld}.in_job[{j}]"
        if not isinstance(run, dict) or run.get("reason") not in {r.value for r in Reason}:
            raise fail("expected an object with a known reason", where)
        ev, step, at = run.get("evidence", ""), run.get("committed_step"), run.get("ended_at")
        if not isinstance(ev, str) or (step is not None and (not _is_int(step) or step < 0)) or (
                at is not None and not valid_time(at)):
            raise fail("evidence must be a string, committed_step a step or null, ended_at a time or null", where)
        parsed.append(RankRun(run["reason"], ev[:_TEXT_MAX], step, at))
    out["in_job"] = tuple(parsed)
    return out
