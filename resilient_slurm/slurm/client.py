"""The Slurm access interface (``SlurmClient``), the records it returns, and pure helpers.

Only ``resilient_slurm.slurm`` knows Slurm commands; the launcher, daemon and CLI talk to a
``SlurmClient``. Backends: ``CliSlurmClient`` (scontrol/scancel/sbatch, the default) and
``PyslurmSlurmClient`` (libslurm through pyslurm, optional).

Who calls what, and when (one job run; the launcher is the batch shell's ``rslurm launch`` on BatchHost):

1. submitter (``rslurm submit``, login node): ``submit`` once; ``job_info`` to report.
2. launcher, at start: ``job_info(own id)`` (restarts, time limit, partition, nodes), then
   ``partition_info(partition)`` (GraceTime, PreemptMode) and ``config_value("KillWait")`` once each;
   ``hostnames`` to expand a node list when needed; ``node_addresses`` before each start of the ranks
   (the rendezvous address).
3. launcher, on SIGTERM/SIGUSR1: ``job_info(own id)`` again (``preempt_time`` tells preemption from the
   time limit), then ``remaining_seconds`` for the emergency-save deadline; ``signal`` to forward or
   escalate to steps.
4. launcher, after the emergency checkpoint committed: ``requeue(own id)``, or ``requeue_hold(own id,
   reason)`` when restarts make no progress. This is the launcher's LAST Slurm call: requeueing a running
   job kills its processes (the launcher included), so nothing after it is guaranteed to run.
5. launcher teardown, tests, ``rslurm`` commands: ``cancel``.
6. daemon and ``rslurm status``: ``job_info`` (read only), any time, from any node.

Every method is one or two short RPCs; none is atomic with another. Methods are safe to call from several
threads. Errors are ``resilient_slurm.errors.SlurmError`` subclasses: transient ones were already retried
by the backend (bounded), permanent ones never are.
"""

from __future__ import annotations

import math
import re
import signal as _signal
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from os import PathLike

# JobState values after which a job does not change again unless it is requeued.
FINISHED_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
                             "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"})
# Reasons that mean "pending because held" (user/admin hold, requeuehold).
HELD_REASONS = frozenset({"JobHeldUser", "JobHeldAdmin", "job_requeued_in_held_state"})

Signal = int | str | _signal.Signals


@dataclass(frozen=True)
class JobInfo:
    """One job as the controller reports it (``scontrol show job``). Times are timezone-aware.

    ``raw`` holds every field the backend saw, under Slurm's own names, for what is not modelled here.
    """

    job_id: int
    name: str
    state: str                       # JobState: PENDING, RUNNING, COMPLETING, COMPLETED, ...
    reason: str | None               # Reason, None when Slurm says "None"
    restarts: int                    # Restarts: how many times the job was requeued
    requeue: bool                    # Requeue=1: the job may be requeued
    priority: int | None             # 0 = held
    time_limit: float | None         # seconds; None = UNLIMITED
    submit_time: datetime | None
    start_time: datetime | None      # actual start, or the expected one while pending
    end_time: datetime | None        # time limit end; moved to preempt time + GraceTime during preemption
    preempt_time: datetime | None    # set when preemption (with GraceTime) began
    partition: str | None
    nodes: tuple[str, ...]           # expanded NodeList, empty while pending
    node_list: str | None            # NodeList as Slurm prints it (n[1-2])
    batch_host: str | None
    exit_code: int | None            # ExitCode=<code>:<signal>
    exit_signal: int | None
    comment: str | None
    array_job_id: int | None = None
    array_task_id: int | None = None
    raw: Mapping[str, str] = field(default_factory=dict, repr=False, compare=False)

    @property
    def finished(self) -> bool:
        """The job reached an end state (it changes again only if requeued)."""
        return self.state in FINISHED_STATES

    @property
    def held(self) -> bool:
        """Pending and held (priority 0 or a hold reason): it will not start until released."""
        if self.state in ("REQUEUE_HOLD", "SPECIAL_EXIT"):
            return True
        if self.state == "COMPLETING":  # requeuehold of a running job: held once its processes are gone
            return self.reason == "job_requeued_in_held_state"
        return self.state == "PENDING" and (self.priority == 0 or (self.reason or "") in HELD_REASONS)

    @property
    def being_preempted(self) -> bool:
        """Preemption started (GraceTime running) and the job has not ended yet."""
        return self.preempt_time is not None and not self.finished


@dataclass(frozen=True)
class PartitionInfo:
    """One partition (``scontrol show partition``): the settings the launcher's deadlines depend on."""

    name: str
    grace_time: float                # seconds between preemption and SIGTERM to the batch shell
    preempt_mode: str                # OFF, CANCEL, REQUEUE, SUSPEND (possibly with ,GANG)
    max_time: float | None           # seconds; None = UNLIMITED
    default_time: float | None       # seconds; None = NONE
    nodes: tuple[str, ...]
    priority_tier: int | None
    state: str
    raw: Mapping[str, str] = field(default_factory=dict, repr=False, compare=False)


class SlurmClient(ABC):
    """Access to one Slurm cluster. See the module docstring for the call order."""

    @abstractmethod
    def job_info(self, job_id: int | str) -> JobInfo:
        """The job's current record. Raises SlurmJobNotFoundError when the controller does not know it."""

    @abstractmethod
    def requeue(self, job_id: int | str, *, only_incomplete: bool = True) -> None:
        """Put the job back in the queue (its processes are killed; it restarts from its script).

        ``only_incomplete``: do nothing to a job that already finished (Slurm's ``Incomplete`` option);
        otherwise a COMPLETED job would be run again."""

    @abstractmethod
    def requeue_hold(self, job_id: int | str, reason: str, *, only_incomplete: bool = True) -> None:
        """Requeue the job held (pending, priority 0, not started until ``scontrol release``), with
        ``reason`` visible in the job's Comment (``squeue -o %k``, ``scontrol show job``)."""

    @abstractmethod
    def signal(self, job_id: int | str, sig: Signal, *, batch: bool = False, full: bool = False,
               step: int | str | None = None) -> None:
        """Send ``sig`` to the job's steps (default), only its batch shell (``batch``), the batch shell,
        its children and all steps (``full``), or one step (``step``)."""

    @abstractmethod
    def cancel(self, job_id: int | str) -> None:
        """Cancel the job. Cancelling a finished or unknown job is not an error."""

    @abstractmethod
    def submit(self, script: str | PathLike[str], args: Sequence[str] = ()) -> int:
        """Submit a batch job: ``script`` is a path (``pathlib.Path``) or the script text (``str``,
        starting with ``#!``); ``args`` are sbatch options. Returns the job id."""

    @abstractmethod
    def partition_info(self, name: str) -> PartitionInfo:
        """The partition's record. Raises PermanentSlurmError when it does not exist."""

    @abstractmethod
    def config_value(self, key: str) -> str:
        """One ``scontrol show config`` value as printed (``"5 sec"``); the key is matched ignoring case.
        Raises PermanentSlurmError naming close keys when Slurm has no such key."""

    @abstractmethod
    def hostnames(self, nodelist: str) -> list[str]:
        """Expand a Slurm node list (``n[1-2],gpu07``) into host names, as Slurm does."""

    @abstractmethod
    def node_addresses(self, nodelist: str) -> dict[str, str]:
        """Each node's address as Slurm knows it (``NodeAddr``) for the nodes of ``nodelist`` (``n[1-2]``), in
        one query: node name -> address. A node Slurm gives no address for is left out. The launcher calls
        it before each start of the ranks, for the rendezvous address (:mod:`resilient_slurm.rendezvous`)."""

    @abstractmethod
    def steps(self, job_id: int | str) -> list[tuple[str, str]]:
        """The job's running steps as ``(step id, step name)``: ``("12.0", "python")``, ``("12.batch",
        "batch")``, ``("12.extern", "extern")``."""

    @abstractmethod
    def exclude_nodes(self, job_id: int | str, nodes: Sequence[str]) -> list[str]:
        """Add ``nodes`` to a pending job's excluded nodes (``ExcNodeList``), so that it is not started on
        them again; returns the whole list. Slurm changes it only while the job is pending (after a requeue):
        a running job raises SlurmJobStateError."""

    def config_seconds(self, key: str) -> float | None:
        """A duration setting in seconds (``KillWait``, ``MessageTimeout``); None for INFINITE/UNLIMITED."""
        return parse_duration(self.config_value(key))


def per_node_step(nodes: int, job_name: str, *command: str, exclude: Sequence[str] = ()) -> list[str]:
    """The ``srun`` line of a helper step inside the job: one task on each of ``nodes`` nodes, ``--overlap``
    so it never takes CPUs the ranks' step holds, a task that fails not ending the others, named
    ``job_name`` (so ``squeue --steps`` and the launcher tell it from the ranks' step), nodes in
    ``exclude`` left out. The one place these lines are built (health checks, the drain daemon, doctor)."""
    cmd = ["srun", "--overlap", f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1",
           "--kill-on-bad-exit=0", f"--job-name={job_name}"]
    if exclude:
        cmd.append(f"--exclude={','.join(exclude)}")
    return [*cmd, *command]


def remaining_seconds(job: JobInfo, now: float, *, grace_time: float | None = None,
                      kill_wait: float | None = None) -> float:
    """Seconds from ``now`` (epoch seconds) until Slurm starts killing the running ``job``.

    That is the job's EndTime (its time limit) or, once preemption began, ``preempt_time + grace_time``,
    whichever comes first; with ``kill_wait`` (the KillWait setting) the time until SIGKILL instead of
    SIGTERM. Never negative; ``math.inf`` when the job has no time limit and is not being preempted.
    Slurm 22.05 already moves EndTime to preempt time + GraceTime when preemption starts, so
    ``grace_time`` only matters for a record read before that update or from another Slurm version.
    OverTimeLimit is not added: it is a grace Slurm may grant, not one to plan on.
    """
    deadline = math.inf
    if job.end_time is not None:
        deadline = job.end_time.timestamp()
    if job.preempt_time is not None and grace_time is not None:
        deadline = min(deadline, job.preempt_time.timestamp() + grace_time)
    if math.isinf(deadline):
        return math.inf
    if kill_wait:
        deadline += kill_wait
    return max(0.0, deadline - now)


_DURATION_WORDS = {"sec": 1, "secs": 1, "min": 60, "mins": 60, "hour": 3600, "hours": 3600}
_UNLIMITED = frozenset({"UNLIMITED", "INFINITE", "NONE", "PARTITION_LIMIT", "N/A", "(NULL)", "INVALID", ""})


def parse_duration(text: str) -> float | None:
    """Seconds in a Slurm duration: ``[D-]HH:MM:SS``, ``MM:SS``, ``"5 sec"``, ``"0 min"``, a number of
    seconds; None for UNLIMITED, INFINITE, NONE, Partition_Limit."""
    s = text.strip()
    if s.upper() in _UNLIMITED:
        return None
    m = re.fullmatch(r"(\d+)\s+([A-Za-z]+)", s)
    if m and m.group(2).lower() in _DURATION_WORDS:
        return float(int(m.group(1)) * _DURATION_WORDS[m.group(2).lower()])
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", s)
    if not m:
        raise ValueError(f"not a Slurm duration: {text!r}")
    days = int(m.group(1) or 0)
    parts = [int(p) for p in m.group(2, 3, 4) if p is not None]
    if m.group(1) is not None:  # D-HH[:MM[:SS]]
        parts += [0] * (3 - len(parts))
        h, mi, sec = parts
    elif len(parts) == 3:
        h, mi, sec = parts
    elif len(parts) == 2:
        h, (mi, sec) = 0, parts
    else:
        return float(parts[0])  # a bare number: seconds (GraceTime=10)
    return float(((days * 24 + h) * 60 + mi) * 60 + sec)


def expand_hostlist(nodelist: str) -> list[str]:
    """Expand a Slurm host list (``n[1-2],gpu[01-03,7]-ib,login``) without asking Slurm.

    Handles comma lists, zero-padded ranges and several bracket groups in one name (expanded as a
    product, like Slurm). More lenient than Slurm 22.05, which rejects text after the last bracket
    (``a[1-2]-ib``). ``SlurmClient.hostnames`` asks Slurm itself."""
    s = nodelist.strip()
    if s in ("", "(null)", "None assigned"):
        return []
    names: list[str] = []
    for item in _split_top_level(s):
        names.extend(_expand_one(item))
    return names


def _split_top_level(s: str) -> list[str]:
    items: list[str] = []
    cur: list[str] = []
    depth = 0
    for ch in s:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in host list {s!r}")
        if ch == "," and depth == 0:
            items.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth != 0:
        raise ValueError(f"unbalanced '[' in host list {s!r}")
    items.append("".join(cur))
    return [i for i in items if i]


def _expand_one(item: str) -> list[str]:
    m = re.search(r"\[([^\]]*)\]", item)
    if not m:
        return [item]
    head, tail = item[: m.start()], item[m.end():]
    out = []
    for part in m.group(1).split(","):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise ValueError(f"bad range {part!r} in host list {item!r}")
        if hi and int(hi) < int(lo):
            raise ValueError(f"reversed range {part!r} in host list {item!r}")
        width = len(lo)
        for n in range(int(lo), int(hi or lo) + 1):
            for rest in _expand_one(tail):
                out.append(f"{head}{n:0{width}d}{rest}")
    return out


def signal_name(sig: Signal) -> str:
    """A signal as scancel takes it: ``USR1`` for 10, ``"SIGUSR1"``, ``"usr1"`` or ``signal.SIGUSR1``."""
    if isinstance(sig, _signal.Signals):
        return sig.name.removeprefix("SIG")
    if isinstance(sig, int):
        try:
            return _signal.Signals(sig).name.removeprefix("SIG")
        except ValueError:
            return str(sig)
    name = sig.strip().upper().removeprefix("SIG")
    if not name or not re.fullmatch(r"[A-Z0-9+]+", name):
        raise ValueError(f"not a signal name: {sig!r}")
    return name
