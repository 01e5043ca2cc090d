"""Failure attribution: which class a run of the ranks ended in, and the evidence it was read from.

Pure functions over what the launcher collected (how each rank ended, the stderr tails, srun's own lines,
the kernel's OOM-kill counters), plus :class:`OomCounters`, the one reader of those counters. The
launcher's :func:`~.outcome.classify_outcome` calls :func:`attribute_failure` once the ranks are gone and
nothing asked them to stop; stops (preemption, time limit, cloud notice) and hangs are classified from
what the launcher saw happen.

The classes, first match wins:

1. ``node_failure``: srun reports a node of the step lost (``srun: error: Node failure on n2``) or a task
   on a node that stopped responding.
2. A rank killed by a signal (the first that ended, not the peers torn down after it):
   ``out_of_memory`` when the kernel's OOM killer acted meanwhile (a memory cgroup's ``oom_kill`` counter
   of this node went up, or srun says ``Out Of Memory``, or slurmstepd reports an oom-kill event);
   ``communicator_error`` for a SIGABRT after a collective's watchdog fired (NCCL's timeout aborts the
   process); a SIGABRT right after the rank's own traceback (``terminate called without an active
   exception``: a C++ thread still running when the interpreter exited on that exception) is read as an
   exit with code 134, a shell's code for an aborted process (3.); else ``killed_by_signal``.
3. Ranks that exited with a code: the last exception line of each one's traceback. A
   ``RendezvousError`` (``init_distributed`` found that the rendezvous address does not resolve, or the
   ranks could not meet there) makes it ``startup``: the job never started, and the error says what to
   set. Any other exception that is neither a communicator error nor out of memory makes it a ``user_error`` (the program's own bug; the
   peers' collective errors that follow it are consequences). Else ``out_of_memory`` (MemoryError, CUDA
   out of memory: raised by the program, so not restarted) before ``communicator_error`` (gloo or NCCL
   errors, collective timeouts, a peer that closed its connection: the network or a peer failed, a restart
   can succeed). A rank that exited with a code and printed no traceback is a ``user_error``.

A hang verdict (:func:`attribute_hang`, the launcher's hang watch found ranks of its node without progress)
is read with what the ranks printed up to that moment, before they are torn down. A collective that had
already failed there (a communicator error's exception line, NCCL's watchdog line) is the cause, and the
hang is how it showed: a rank whose collective timed out can stay alive for minutes, its exit waiting for
its checkpoint writer's collective with the peer that stopped, so whether the launcher sees it exit or
sees it idle past the hang timeout depends only on the machine's load. Both are recorded; the class is the
communicator error. A program's own exception line is not read as the cause of a hang: programs print
tracebacks of errors they handled, and a user error would not be restarted, while a hang and a
communicator error are restarted alike (only their names differ).
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from .policy import Reason
from .processes import Children, LocalRanks, RankExit

# A traceback's last line: "ValueError: bad", "torch.OutOfMemoryError: CUDA out of memory. ...", with the
# optional per-rank prefixes of torch ("[rank1]: ") and srun --label ("1: ").
_PREFIX = r"(?:\[rank(?P<rank>\d+)\]:\s?|(?P<label>\d+): )?"
_TRACEBACK = re.compile(rf"^{_PREFIX}Traceback \(most recent call last\):\s*$", re.M)
_LINE_PREFIX = re.compile(r"^(?:\[rank(?P<rank>\d+)\]:\s?|(?P<label>\d+): )?")

# A communicator error that says a peer's end of the connection went away (closed, or reset: a process that
# exits with unread data in its socket resets it), not that the network stopped answering (a timeout): with
# a rank that exited 0 on its own meanwhile, that rank left early (outcome.py: left_early).
PEER_CLOSED = re.compile(r"(?:closed|reset) by (?:remote )?peer|remote process exited", re.I)
COMMUNICATOR_ERROR = re.compile(
    r"DistBackendError|DistNetworkError|DistStoreError|ProcessGroup(?:NCCL|Gloo)|\bNCCL (?:error|WARN)|"
    r"nccl(?:Internal|System|Remote|Unhandled\w*|InvalidUsage)Error|gloo/transport|"
    r"Connection (?:closed|reset) by peer|Watchdog caught collective operation timeout|"
    r"Timed out waiting \d+ms for (?:send|recv) operation|Socket Timeout|"
    r"\bc10d\b.*(?:timed out|timeout|connect)", re.I)
RENDEZVOUS = re.compile(r"\bRendezvousError\b")
OUT_OF_MEMORY = re.compile(r"\bMemoryError\b|OutOfMemoryError|\bout of memory\b|Cannot allocate memory", re.I)
# slurmstepd (task/cgroup): "slurmstepd: error: Detected 1 oom_kill event in StepId=12.0. Some of the step
# tasks have been OOM Killed." (wording varies by release: oom-kill / oom_kill)
SLURM_OOM = re.compile(r"^.*Detected \d+ oom[-_]kill event.*$", re.M | re.I)
NODE_FAILURE = re.compile(r"^.*(?:srun: error: Node failure on \S+|Task launch .* failed.*Node (?:is )?down|"
                          r"srun: error: .*: Communication connection failure).*$", re.M)
WATCHDOG = re.compile(r"^.*(?:Watchdog caught collective operation timeout|collective operation timeout).*$", re.M | re.I)


@dataclass(frozen=True)
class Attribution:
    """The class of a failed run of the ranks, the rank it is pinned on, and the evidence."""

    reason: Reason
    evidence: str
    failed: RankExit


def exception_lines(text: str, rank: int | None = None) -> list[str]:
    """The exception line of every Python traceback in ``text`` (oldest first): the first line after the
    ``Traceback`` header that is not indented (frames and source lines are). With ``rank``, only tracebacks
    printed with that rank's prefix when any header carries one."""
    lines = text.splitlines()
    out = []
    prefixed = any(m["rank"] or m["label"] for m in _TRACEBACK.finditer(text))
    for i, line in enumerate(lines):
        head = _TRACEBACK.match(line)
        if not head or (rank is not None and prefixed and str(rank) not in (head["rank"], head["label"])):
            continue
        tag = (head["rank"], head["label"])
        for later in lines[i + 1:]:
            p = _LINE_PREFIX.match(later)
            assert p is not None  # the pattern matches the empty prefix
            if prefixed and (p["rank"], p["label"]) != tag:
                continue  # another rank's line interleaved
            body = later[p.end():]
            if body.strip() and not body[0].isspace():
                if not _TRACEBACK.match(later):
                    out.append(body.strip()[:500])
                break
    return out


# What the C++ runtime prints when a thread (gloo's, a checkpoint writer's) is still running as the interpreter
# exits: std::terminate, then SIGABRT. After an uncaught exception's traceback, the exception ended the rank.
TEARDOWN_ABORT = "terminate called without an active exception"


def raised_then_aborted(text: str, rank: int | None = None) -> str | None:
    """The exception line of the traceback that ``text`` (a rank's stderr tail) ends with, when the next line
    printed after it is :data:`TEARDOWN_ABORT`: the rank raised, and its exit was then aborted (so it died by
    SIGABRT). None otherwise, as for a traceback of an error the program handled and lived on after."""
    raised = exception_lines(text, rank)
    if not raised:
        return None
    lines = [body for line in text.splitlines() if (body := _LINE_PREFIX.sub("", line, count=1).strip())]
    for before, line in zip(lines, lines[1:]):
        if line == TEARDOWN_ABORT and before[:500] == raised[-1]:
            return raised[-1]
    return None


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def _first_line(pattern: re.Pattern[str], texts: Iterable[str]) -> str | None:
    for text in texts:
        m = pattern.search(text)
        if m:
            return m.group(0).strip()[:500]
    return None


def attribute_failure(failed: Sequence[RankExit], stderr_of: Callable[[RankExit], str], *,
                      oom_evidence: str | None = None, srun_text: str = "") -> Attribution | None:
    """The class of a run whose ranks ``failed`` (in the order they ended; the first is the root cause
    unless the evidence says otherwise), or None when none failed. ``stderr_of`` gives a rank's stderr
    tail; ``oom_evidence`` is :meth:`OomCounters.evidence`; ``srun_text`` is srun's own stderr tail."""
    if not failed:
        return None
    node_line = _first_line(NODE_FAILURE, [srun_text])
    if node_line:
        return Attribution(Reason.NODE_FAILURE, node_line, failed[0])
    killed = [e for e in failed if e.signal is not None]
    texts = {id(e): stderr_of(e) for e in failed}
    if killed and killed[0] is failed[0]:
        first = killed[0]
        how = f"rank {first.rank}" if first.rank is not None else "a rank"
        where = f" on {first.node}" if first.node else ""
        what = f"{how}{where} killed by {_signal_name(first.signal or 0)}"
        slurm_oom = _first_line(SLURM_OOM, [srun_text, *texts.values()])
        if first.oom or oom_evidence or slurm_oom:
            said = "srun: Out Of Memory" if first.oom else (oom_evidence or slurm_oom)
            return Attribution(Reason.OUT_OF_MEMORY, f"{what}; {said}", first)
        watchdog = _first_line(WATCHDOG, [texts[id(first)], srun_text])
        if first.signal == signal.SIGABRT and watchdog:
            return Attribution(Reason.COMMUNICATOR_ERROR, f"{what}; {watchdog}", first)
        if first.signal != signal.SIGABRT or not raised_then_aborted(texts[id(first)], first.rank):
            return Attribution(Reason.KILLED_BY_SIGNAL, what, first)
        # It raised, and its exit was aborted after the traceback (a C++ thread still running when the
        # interpreter ended): it died of its exception. Read as an exit with the code a shell gives an aborted
        # process (128 + SIGABRT), so that what the program raised is not restarted (policy.raised_by_program).
        raised = dataclasses.replace(first, signal=None, exit_code=128 + int(signal.SIGABRT))
        texts[id(raised)] = texts[id(first)]
        coded = [raised, *(e for e in failed if e.signal is None)]
    else:
        # Exited with a code (or killed after one that did): read the exceptions.
        coded = [e for e in failed if e.signal is None] or list(failed)
    found: list[tuple[RankExit, str]] = []
    for e in coded:
        found += [(e, line) for line in exception_lines(texts[id(e)], e.rank)]
    if not found:
        return Attribution(Reason.USER_ERROR, "", coded[0])
    for e, line in found:
        if RENDEZVOUS.search(line):
            return Attribution(Reason.STARTUP, line, e)
    for e, line in found:
        if not COMMUNICATOR_ERROR.search(line) and not OUT_OF_MEMORY.search(line):
            return Attribution(Reason.USER_ERROR, line, e)
    for e, line in found:
        if OUT_OF_MEMORY.search(line):
            return Attribution(Reason.OUT_OF_MEMORY, line, e)
    e, line = found[0]
    return Attribution(Reason.COMMUNICATOR_ERROR, line, e)


@dataclass(frozen=True)
class HangCause:
    """The class of a run the hang watch ended, its evidence, and the rank it is pinned on (None: no one)."""

    reason: Reason
    evidence: str
    rank: int | None = None


def attribute_hang(watch_said: str, outputs: Sequence[tuple[int | None, str]]) -> HangCause:
    """The class of a run of the ranks that the hang watch ended (see the module docstring): ``watch_said``
    is the watch's verdict in words (:meth:`~.hang.Hang.describe`); ``outputs`` are the ranks' stderr
    tails as they were at the verdict, each with its rank (None: srun's, every rank's lines together)."""
    for rank, text in outputs:
        for line in exception_lines(text, rank):
            if COMMUNICATOR_ERROR.search(line) and not OUT_OF_MEMORY.search(line):
                who = f"rank {rank}: " if rank is not None else ""
                return HangCause(Reason.COMMUNICATOR_ERROR,
                                 f"{who}{line}; then no progress past the hang timeout: {watch_said}", rank)
    for rank, text in outputs:
        watchdog = _first_line(WATCHDOG, [text])
        if watchdog:
            return HangCause(Reason.COMMUNICATOR_ERROR, f"{watchdog}; then no progress past the hang timeout: "
                             f"{watch_said}", rank)
    return HangCause(Reason.HANG, watch_said)


# --------------------------------------------------------------------------- the kernel's OOM kills
CGROUP_ROOT = "/sys/fs/cgroup"


def _memory_cgroup_dirs(pid: int | str = "self") -> list[str]:
    """The memory cgroup directories of ``pid``: the v2 unified one and the v1 memory controller's."""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        path = path.lstrip("/")
        if controllers == "":  # v2: memory.events there (the unified mount is /sys/fs/cgroup or .../unified)
            for base in (CGROUP_ROOT, os.path.join(CGROUP_ROOT, "unified")):
                d = os.path.join(base, path)
                if os.path.isfile(os.path.join(d, "memory.events")):
                    out.append(d)
                    break
        elif "memory" in controllers.split(","):
            d = os.path.join(CGROUP_ROOT, "memory", path)
            if os.path.isfile(os.path.join(d, "memory.oom_control")):
                out.append(d)
    return out


def _oom_kills(d: str) -> int | None:
    """The ``oom_kill`` count of one memory cgroup (v2 ``memory.events``, v1 ``memory.oom_control``)."""
    for name in ("memory.events", "memory.oom_control"):
        try:
            with open(os.path.join(d, name)) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            continue
    return None


class OomCounters:
    """The kernel's OOM-kill counters of the memory cgroups this node's ranks run in.

    ``watch(pids)`` when the ranks start (the launcher's own cgroup and each local rank's), then
    ``evidence()`` after they ended: the first cgroup whose ``oom_kill`` count went up, in words, or None.
    Ranks on other nodes are not seen here: for them srun's ``Out Of Memory`` task line or slurmstepd's
    oom-kill message is the evidence."""

    def __init__(self) -> None:
        self._start: dict[str, int] = {}

    def watch(self, pids: Iterable[int | str] = ()) -> None:
        for pid in ("self", *pids):
            for d in _memory_cgroup_dirs(pid):
                if d not in self._start and (n := _oom_kills(d)) is not None:
                    self._start[d] = n

    def evidence(self) -> str | None:
        for d, before in self._start.items():
            now = _oom_kills(d)
            if now is not None and now > before:
                return f"memory cgroup {d}: oom_kill {before} -> {now}"
        return None


def rank_outputs(children: Children) -> list[tuple[int | None, str]]:
    """Each local rank's stderr tail with its rank; under srun, srun's (every task's lines, one stream): what
    :func:`attribute_hang` reads."""
    if isinstance(children, LocalRanks):
        return [(r, children.stderr_tail(r)) for r in range(len(children.pids))]
    return [(None, children.stderr_tail(0))]


__all__ = ["Attribution", "HangCause", "OomCounters", "attribute_failure", "attribute_hang", "exception_lines",
           "rank_outputs"]
