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

import logging
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ..errors import ConfigError
from ..run_history import (  # the history model, below the launcher (catalog/history.py reads it too)
    HISTORY_FILE,
    REASON_LABELS,
    RESTARTABLE,
    Action,
    Decision,
    Incarnation,
    Outcome,
    ProgressHistory,
    RankRun,
    Reason,
    raised_by_program,
    restartable,
)

logger = logging.getLogger(__name__)

# Non-zero on purpose: a batch script that exits 0 is recorded COMPLETED and never requeued, so if the
# requeue call itself fails the job must not look successful. 75 is EX_TEMPFAIL ("try again later").
REQUEUE_EXIT_CODE = 75
# 78 is EX_CONFIG: the job cannot go on until a person changes something.
HOLD_EXIT_CODE = 78
class HoldRule(Protocol):
    """A strategy that may hold a restartable job: returns the hold message, or None."""

    def __call__(self, outcome: Outcome, history: ProgressHistory) -> str | None:
        """The hold message, or None to let the job be requeued."""


def _release_hint(outcome: Outcome) -> str:
    return f"`scontrol release {outcome.job_id or '<jobid>'}`"


# The exception line of a rank whose restore refused the checkpoints (resilient_slurm.errors): damaged or not
# fitting the program. The launcher does not requeue it either, but the program is not what is wrong.
_CANNOT_RESTORE = re.compile(r"\b(CorruptCheckpointError|IncompatibleCheckpointError|TagsFileError)\b")


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
            if outcome.detail:  # the classification's own account (outcome.py: left_early)
                return Decision(Action.EXIT, code, f"not requeued: {outcome.detail}; fix it and resubmit",
                                "user_error")
            if (m := _CANNOT_RESTORE.search(outcome.evidence or "")) is not None:
                # Not the program's bug: the checkpoints it would restore. A restart would read the same steps.
                return Decision(
                    Action.EXIT, code,
                    f"not requeued: {who} could not restore a checkpoint ({m.group(1)}, exit code {code}{at}); a "
                    "restart would read the same steps: the rank's error above names the step and file; `rslurm "
                    "verify` lists the damaged steps, and `rslurm ls` what is left", "user_error")
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
