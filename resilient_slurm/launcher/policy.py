"""Requeue policy: what the launcher does once a job incarnation ended. Small pure objects, no I/O.

Who calls what, and when (the launcher, once per incarnation, after its ranks are gone and any emergency
checkpoint committed or its deadline passed):

1. build an ``Outcome`` (why the incarnation ended, the committed/restored steps, SLURM_RESTART_COUNT);
2. read the ``ProgressHistory`` file next to the checkpoints (``ProgressHistory.parse``: a missing or
   unreadable file is an empty history, with a warning; ``strict=True`` raises instead);
3. ``decision = policy.decide(outcome, history)``;
4. write ``history.record(outcome).to_json()`` back (atomically: temp name, fsync, rename);
5. act: ``requeue`` -> ``SlurmClient.requeue``; ``hold`` -> ``SlurmClient.requeue_hold(job, message)``;
   then (or for ``exit``) exit with ``decision.exit_code``. Step 4 comes before step 5 because requeueing a
   running job kills the launcher: nothing after it is guaranteed to run.

Rules (``RequeuePolicy``), first match wins:

* ``completed`` -> exit 0.
* ``cancelled`` (the user's ``scancel``; the emergency checkpoint was taken) -> exit 1, never requeued: the
  user asked for the end.
* ``user_error`` (a rank exited non-zero on its own) -> exit with that rank's exit code, never requeued:
  an error in the program would repeat on every restart.
* ``out_of_memory`` raised by the program (MemoryError, CUDA out of memory: the rank exited with a code)
  -> exit with that code, like a user error: the same batch would run out of memory again.
* ``preempted``, ``time_limit``, ``node_failure``, ``cloud_termination``, ``hang``, ``killed_by_signal``,
  ``out_of_memory`` (a rank killed by the kernel's OOM killer), ``communicator_error``, ``storage_unavailable``
  (a rank raised RestoreUnavailableError: checkpoints exist but storage kept them from being restored),
  ``startup`` (the ranks never started: another allocation may start them; a cause that stays is held by
  the no-progress rule, since a start commits nothing) ->
  requeue, unless a hold rule
  fires: ``NoProgressRule`` (the last K incarnations in a row committed nothing past the step committed
  before each of them) or ``MaxRestartsRule`` (requeueing once more would exceed ``max_restarts``).
  Extra ``HoldRule`` callables can be composed in.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol, TypeGuard

from ..errors import ConfigError, ProgressHistoryError
from ..paths import load_json, valid_time

logger = logging.getLogger(__name__)

# Non-zero on purpose: a batch script that exits 0 is recorded COMPLETED and never requeued, so if the
# requeue call itself fails the job must not look successful. 75 is EX_TEMPFAIL ("try again later").
REQUEUE_EXIT_CODE = 75
# 78 is EX_CONFIG: the job cannot go on until a person changes something.
HOLD_EXIT_CODE = 78
# The run's history: in the run directory of the batch host, and a copy in the durable tier.
HISTORY_FILE = "launcher-history.json"
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
                f"progress history {source}:{where} {what}; delete the file to start counting afresh "
                "(only the no-progress hold count is lost)", source=source, field=fld)

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


class HoldRule(Protocol):
    """A strategy that may hold a restartable job: returns the hold message, or None."""

    def __call__(self, outcome: Outcome, history: ProgressHistory) -> str | None:
        """The hold message, or None to let the job be requeued."""


def _release_hint(outcome: Outcome) -> str:
    return f"`scontrol release {outcome.job_id or '<jobid>'}`"


@dataclass(frozen=True)
class NoProgressRule:
    """Hold when the last ``limit`` incarnations in a row (this one included) committed nothing new.

    This stops the loop where a restart dies before its first new checkpoint every time (a checkpoint that
    makes the program crash right after restore, a restore slower than the time left) instead of burning
    the allocation forever.
    """

    limit: int = 3

    def __post_init__(self) -> None:
        if self.limit < 1:
            raise ConfigError(f"no_progress_limit must be >= 1 (or unset to disable), got {self.limit}")

    def __call__(self, outcome: Outcome, history: ProgressHistory) -> str | None:
        """The hold message once the streak reaches ``limit``."""
        streak = history.no_progress_streak(outcome)
        if streak < self.limit:
            return None
        step = outcome.committed_step
        where = f"past step {step} (last committed)" if step is not None else "to a first committed step"
        return (f"held: {streak} restarts in a row made no progress {where}; the last ended by "
                f"{_describe(outcome)}; fix the cause and {_release_hint(outcome)}")


@dataclass(frozen=True)
class MaxRestartsRule:
    """Hold when requeueing once more would exceed ``limit`` restarts (SLURM_RESTART_COUNT + 1)."""

    limit: int

    def __post_init__(self) -> None:
        if self.limit < 0:
            raise ConfigError(f"max_restarts must be >= 0 (or unset for no limit), got {self.limit}")

    def __call__(self, outcome: Outcome, history: ProgressHistory) -> str | None:
        """The hold message once the restart budget is spent."""
        if outcome.restart_count + 1 <= self.limit:
            return None
        return (f"held: the job was already restarted {outcome.restart_count} times (max_restarts="
                f"{self.limit}) and ended again by {_describe(outcome)}; raise RSLURM_MAX_RESTARTS if more "
                f"restarts are expected, then {_release_hint(outcome)}")


def describe_outcome(outcome: Outcome) -> str:
    """A few words on why the incarnation (or one run of the ranks) ended, for messages and events."""
    return _describe(outcome)


def _describe(outcome: Outcome) -> str:
    """A few words on why the incarnation ended, for messages."""
    r = outcome.reason
    who = f"rank {outcome.rank}" if outcome.rank is not None else "a rank"
    if r is Reason.KILLED_BY_SIGNAL:
        how = f" by {_signal_name(outcome.signal)}" if outcome.signal is not None else ""
        return f"{who} killed{how}, not by rslurm"
    if r is Reason.NODE_FAILURE:
        where = f" ({outcome.node})" if outcome.node else ""
        return f"a node failure{where}"
    if r is Reason.OUT_OF_MEMORY:
        how = "killed by the OOM killer" if outcome.signal is not None else "ran out of memory"
        return f"out of memory ({who} {how})"
    if r is Reason.COMMUNICATOR_ERROR:
        return f"a communicator error ({who}: a collective failed)"
    if r is Reason.HANG:
        return f"a hang ({outcome.detail})" if outcome.detail else "a hang"
    if r is Reason.TIME_LIMIT:
        return "the time limit"
    if r is Reason.CLOUD_TERMINATION:
        return "a cloud termination notice"
    if r is Reason.PREEMPTED:
        return "preemption"
    if r is Reason.STORAGE_UNAVAILABLE:
        return f"a restore that checkpoint storage failed ({who}: RestoreUnavailableError)"
    if r is Reason.STARTUP:
        return f"a failed start ({outcome.detail})" if outcome.detail else "a failed start"
    if r is Reason.CANCELLED:
        return "a cancel (scancel)"
    return REASON_LABELS.get(r, r.value)


def _signal_name(sig: int) -> str:
    import signal as _signal

    try:
        return _signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


@dataclass(frozen=True)
class RequeuePolicy:
    """Decide requeue / hold / exit for an ended incarnation (see the module docstring for the rules).

    ``max_restarts``: None for no limit. ``no_progress_limit``: K, None to disable. ``extra_rules`` are
    further ``HoldRule`` strategies, consulted after the built-in ones.
    """

    max_restarts: int | None = None
    no_progress_limit: int | None = 3
    extra_rules: Sequence[HoldRule] = field(default=())

    @property
    def rules(self) -> tuple[HoldRule, ...]:
        """The hold rules in the order they are consulted."""
        rules: list[HoldRule] = []
        if self.no_progress_limit is not None:
            rules.append(NoProgressRule(self.no_progress_limit))
        if self.max_restarts is not None:
            rules.append(MaxRestartsRule(self.max_restarts))
        return (*rules, *self.extra_rules)

    def __post_init__(self) -> None:
        _ = self.rules  # validates the limits now rather than at the first decision

    def decide(self, outcome: Outcome, history: ProgressHistory) -> Decision:
        """The decision for ``outcome``, given the incarnations before it (``history`` excludes it)."""
        if outcome.reason is Reason.COMPLETED:
            return Decision(Action.EXIT, 0, "completed: every rank exited 0", "completed")
        if outcome.reason is Reason.USER_ERROR:
            who = f"rank {outcome.rank}" if outcome.rank is not None else "a rank"
            at = f" at {outcome.error_location}" if outcome.error_location else ""
            code = outcome.exit_code if outcome.exit_code is not None else 1
            return Decision(
                Action.EXIT, code,
                f"not requeued: {who} failed with exit code {code}{at}; an error in the program "
                "would repeat on every restart; fix it and resubmit", "user_error")
        if outcome.reason is Reason.CANCELLED:
            step = outcome.committed_step
            job = outcome.job_id or "<jobid>"
            return Decision(
                Action.EXIT, 1,
                f"not requeued: job {job} was cancelled (scancel); "
                + (f"step {step} is committed: submit the job again with the same run id to resume from it"
                   if step is not None else "nothing is committed"), "cancelled")
        if raised_by_program(outcome):
            who = f"rank {outcome.rank}" if outcome.rank is not None else "a rank"
            code = outcome.exit_code or 1
            return Decision(
                Action.EXIT, code,
                f"not requeued: {who} ran out of memory and exited with code {code} ({outcome.evidence}); it "
                "would run out again on every restart: lower the memory use (batch size, activation "
                "checkpointing) and resubmit", "out_of_memory")
        for rule in self.rules:
            message = rule(outcome, history)
            if message is not None:
                return Decision(Action.HOLD, HOLD_EXIT_CODE, message, _rule_name(rule))
        step = outcome.committed_step
        return Decision(
            Action.REQUEUE, REQUEUE_EXIT_CODE,
            f"requeued after {_describe(outcome)}; resumes from "
            + (f"step {step}" if step is not None else "the start (nothing committed)"),
            outcome.reason.value)


def _rule_name(rule: HoldRule) -> str:
    if isinstance(rule, NoProgressRule):
        return "no_progress"
    if isinstance(rule, MaxRestartsRule):
        return "max_restarts"
    return getattr(rule, "__name__", type(rule).__name__)


# Optional per-line prefixes: torch's "[rank1]: " and srun --label's "1: ".
_TRACEBACK_LINE = re.compile(
    r'^(?:\[rank(?P<rank>\d+)\]:|(?P<label>\d+): )?\s*File "(?P<file>[^"]+)", line (?P<line>\d+)'
    r'(?:, in (?P<func>\S+))?', re.M)


_RESTORE_UNAVAILABLE = re.compile(r"^(?:\[rank\d+\]:|\d+: )?\s*resilient_slurm\.errors\.RestoreUnavailableError: ", re.M)


def restore_unavailable(text: str) -> bool:
    """Whether a rank's stderr ends in the RestoreUnavailableError traceback that ``Checkpointer.restore``
    raises when storage kept existing checkpoints from being restored (so the job may run again later)."""
    return _RESTORE_UNAVAILABLE.search(text) is not None


_TRACEBACK_START = re.compile(r"^(?:\[rank\d+\]:|\d+: )?\s*Traceback \(most recent call last\):", re.M)


def _library_dirs() -> tuple[str, ...]:
    """Where code that is not the user's lives: this package, the standard library, site-packages."""
    import sysconfig

    dirs = {os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        path = sysconfig.get_paths().get(key)
        if path:
            dirs.add(os.path.abspath(path))
    return tuple(d.rstrip(os.sep) + os.sep for d in dirs)


def traceback_location(text: str, rank: int | None = None) -> str | None:
    """Where the last Python traceback in ``text`` (a rank's stderr) points: the innermost frame in the
    user's code (``file:line in func``), or the innermost frame when every frame is library code. An error
    raised inside rslurm or torch (a restore that refused a checkpoint) then names the user's line that
    called it, with the library frame after it: ``train.py:91 in main (raised in .../restore.py:212)``.

    With ``rank``, lines prefixed for that rank (``[rank1]: ``, ``1: ``) are preferred when there are any,
    so the failing rank's own traceback is named when several ranks print one."""
    starts = [m.start() for m in _TRACEBACK_START.finditer(text)]
    matches = list(_TRACEBACK_LINE.finditer(text))
    if rank is not None:
        own = [m for m in matches if str(rank) in (m["rank"], m["label"])]
        matches = own or matches
    if not matches:
        return None
    begin = max((s for s in starts if s <= matches[-1].start()), default=0)
    frames = [m for m in matches if m.start() >= begin] or matches[-1:]

    def where(m: re.Match[str]) -> str:
        func = f" in {m['func']}" if m["func"] else ""
        return f"{m['file']}:{m['line']}{func}"

    library = _library_dirs()
    inner = frames[-1]
    users = [m for m in frames if not os.path.abspath(m["file"]).startswith(library)]
    if not users or users[-1] is inner:
        return where(inner)
    return f"{where(users[-1])} (raised in {inner['file']}:{inner['line']})"


def replay(policy: RequeuePolicy, outcomes: Iterable[Outcome],
           history: ProgressHistory | None = None) -> list[Decision]:
    """Run ``outcomes`` through ``policy`` as successive incarnations would (decide, then record)."""
    history = history or ProgressHistory()
    decisions = []
    for outcome in outcomes:
        decisions.append(policy.decide(outcome, history))
        history = history.record(outcome)
    return decisions


__all__ = [
    "HISTORY_FILE", "describe_outcome", "raised_by_program", "restartable", "REASON_LABELS", "RankRun",
    "HOLD_EXIT_CODE", "REQUEUE_EXIT_CODE", "RESTARTABLE", "Action", "Decision", "HoldRule", "Incarnation",
    "MaxRestartsRule", "NoProgressRule", "Outcome", "ProgressHistory", "Reason", "RequeuePolicy", "replay",
    "restore_unavailable", "traceback_location",
]
