"""The start-up bound: a run of the ranks that never starts ends with one message instead of waiting.

A rank set whose rendezvous cannot work (a ``MASTER_ADDR`` that does not resolve or that the other nodes
cannot reach) never builds a Checkpointer: no rank registers with the launcher, no heartbeat appears, so
the hang detector has nothing to judge, and torch retries for its whole timeout (30 minutes by default).
This module decides when such a start has failed, and says why.

Who calls what, and when (the launcher, for each srun step of ranks it starts):

1. ``StartupWatch(bound_s, marker=..., node=...)`` when the step starts; ``marker`` is the value of
   :data:`RANKS_MARKER_VAR` the launcher put in the step's environment, so the step's tasks on this node
   can be found (:func:`local_tasks`): they are slurmstepd's children, not the launcher's.
2. ``watch.due(now, started)`` from the launcher's loop: True once, when ``bound_s`` passed since the
   start and ``started`` is still False (no rank of this node registered on the control socket or wrote
   a heartbeat, which a rank does when it builds its Checkpointer, after the rendezvous).
3. ``watch.examine(stderr_text, run_dir, ...)``: finds this node's tasks, writes their stacks (py-spy, when
   installed: the ranks have no dump-signal handler yet), reads the ranks' stderr for torch's c10d lines
   (``cannot be retrieved``, ``failed to connect``) and probes the address they tried. Returns a
   :class:`StartupFailure` (the launcher tears the ranks down and ends the incarnation as ``startup``),
   or a :class:`NotJudged` saying why the start cannot be judged from this node; then the launcher logs
   it and stops watching this run. The launcher does this step through :func:`judge_start`, which also
   logs the verdict, records it as an event and tears a failed start down.

The verdict: the start failed, unless this node runs no task of the step (nothing to judge here), the
step has one task (no rendezvous), or the stacks show every task here past the rendezvous with no
c10d failure in the output (a program that builds no Checkpointer: it may run as long as it likes).
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import psutil

from ..jobenv import JobEnv
from ..rendezvous import probe, rendezvous_failure_line
from ..telemetry import Event
from .context import LaunchContext, launch_log
from .processes import Children
from .stacks import pyspy, pyspy_dump
from .stopping import teardown

log = logging.getLogger(__name__)

# Set by the launcher in each ranks' step's environment, with a value of its own for that step: the step's
# tasks carry it in /proc/<pid>/environ. Outside the RSLURM_ namespace: settings reject unknown RSLURM_*.
RANKS_MARKER_VAR = "_RSLURM_RANKS"
AUTO_BASE_S = 300.0
AUTO_NODES_PER_S = 4  # auto adds 1 s for every this many nodes: srun's launch and the imports grow with them

# Frames of torch.distributed's rendezvous, as py-spy prints them.
_RENDEZVOUS_FRAMES = re.compile(r"\b(?:init_process_group|_env_rendezvous_handler|_create_c10d_store|"
                                r"_store_based_barrier|rendezvous|TCPStore)\b")


def startup_bound(setting: float | None, nodes: int) -> float:
    """The start-up bound in seconds: the ``startup_timeout`` setting (None: auto, inf: off); auto is
    :data:`AUTO_BASE_S` plus 1 s for every :data:`AUTO_NODES_PER_S` nodes of the job."""
    if setting is not None:
        return setting
    return AUTO_BASE_S + max(0, nodes) / AUTO_NODES_PER_S


@dataclass(frozen=True)
class LocalTask:
    """A task of the step on this node: its pid, and the job environment it started with (its rank, the
    step's size, the rendezvous variables)."""

    pid: int
    job: JobEnv = field(default_factory=JobEnv)

    @property
    def rank(self) -> int | None:
        """The task's rank: ``RANK`` (the task prolog's), else ``SLURM_PROCID``."""
        return self.job.rank if self.job.rank is not None else self.job.procid


def local_tasks(marker: str, node: str | None) -> list[LocalTask]:
    """The step's tasks on this node: processes whose environment has ``RANKS_MARKER_VAR=marker`` and a step
    id (and, when it says, ``SLURMD_NODENAME=node``), whose parent does not (a task's own children inherit
    the marker)."""
    found: dict[int, tuple[int, JobEnv]] = {}
    for p in psutil.process_iter(["pid", "ppid"]):
        try:
            env = p.environ()
        except (psutil.Error, OSError):
            continue
        if env.get(RANKS_MARKER_VAR) != marker:
            continue
        job = JobEnv.from_env(env, warn=False)
        # srun itself carries the marker too (the launcher's child, with the batch shell's variables and
        # no step id); a task has its step's id and another parent: slurmstepd.
        if job.step_id is None or p.info["ppid"] == os.getpid() or (node and job.node_name not in (None, node)):
            continue
        found[p.info["pid"]] = (p.info["ppid"], job)
    return [LocalTask(pid, job) for pid, (ppid, job) in sorted(found.items()) if ppid not in found]


@dataclass(frozen=True)
class StartupFailure:
    """Why a start failed: the bound, the address and port tried, what failed, and where the stacks are."""

    bound_s: float
    node: str
    addr: str | None
    port: int | None
    addr_source: str          # where the address came from, in words
    failed: str               # what did not resolve or connect, in words ("" when nothing said)
    rank_said: str            # the last c10d failure line of the ranks' output ("" when none)
    ranks: tuple[int, ...]    # this node's ranks that were found
    in_rendezvous: tuple[int, ...]  # of those, the ones whose stacks are in the rendezvous
    stacks: tuple[str, ...]   # files written
    stacks_note: str = ""     # why there are no stacks, when there are none

    def message(self) -> str:
        """The one message: what was waited for, the rendezvous tried, what failed, what to set."""
        where = f"{self.addr}:{self.port}" if self.addr and self.port else (self.addr or "unknown")
        parts = [f"the ranks did not start: no rank on {self.node} built its Checkpointer within "
                 f"{self.bound_s:.0f} s of the step's start (startup_timeout)",
                 f"rendezvous MASTER_ADDR:MASTER_PORT = {where} ({self.addr_source})"]
        if self.failed:
            parts.append(f"from {self.node}, {self.failed}")
        if self.rank_said:
            parts.append(f"a rank said: {self.rank_said}")
        if self.in_rendezvous:
            parts.append(f"rank(s) {_ranks(self.in_rendezvous)} on {self.node} are waiting in the rendezvous "
                         "(init_process_group)")
        if self.stacks:
            parts.append(f"stacks: {os.path.dirname(self.stacks[0])}")
        elif self.stacks_note:
            parts.append(self.stacks_note)
        if "set for the job" in self.addr_source:
            todo = ("set MASTER_ADDR to an address of the node that runs rank 0 that every node reaches, or "
                    "unset it (rslurm then derives it from Slurm's NodeAddr of that node)")
        else:
            todo = ("make the address Slurm gives for rank 0's node (NodeAddr in slurm.conf) reachable from every "
                    "node, or set MASTER_ADDR for the job to one that is")
        return ("; ".join(parts) + f". To fix: {todo}; if the ranks only need longer to start, raise "
                "startup_timeout (RSLURM_STARTUP_TIMEOUT); a program that builds no Checkpointer needs "
                "startup_timeout=off")

    def to_json(self) -> dict[str, Any]:
        return {"bound_s": round(self.bound_s, 3), "node": self.node, "addr": self.addr, "port": self.port,
                "addr_source": self.addr_source, "failed": self.failed, "rank_said": self.rank_said,
                "ranks": list(self.ranks), "in_rendezvous": list(self.in_rendezvous), "stacks": list(self.stacks)}


@dataclass(frozen=True)
class NotJudged:
    """The start cannot be judged from this node; ``why`` says so (logged by the launcher)."""

    why: str


def _ranks(ranks: Sequence[int]) -> str:
    shown = ", ".join(map(str, ranks[:8]))
    return shown + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")


class StartupWatch:
    """The start-up bound of one step of ranks (see the module docstring for the call order)."""

    def __init__(self, bound_s: float, *, marker: str, node: str, started_at: float,
                 user_addr: str | None = None, expected: Mapping[str, str | None] | None = None) -> None:
        self.bound_s = bound_s
        self.marker = marker
        self.node = node
        self.started_at = started_at
        self.user_addr = user_addr      # MASTER_ADDR the user set for the job, if any
        self.expected = dict(expected or {})  # the launcher's node -> address map
        self.done = math.isinf(bound_s)

    def due(self, now: float, started: Callable[[], bool]) -> bool:
        """True once: the bound passed and ``started()`` (asked only then) is still False."""
        if self.done or now < self.started_at + self.bound_s:
            return False
        self.done = True
        return not started()

    def examine(self, stderr_text: str, run_dir: str, *,
                tasks: Callable[[str, str | None], list[LocalTask]] = local_tasks,
                dump: Callable[[int, str, int], tuple[str, str] | None] | None = None,
                prober: Callable[[str, int], str | None] = probe) -> StartupFailure | NotJudged:
        """The verdict on a start past its bound (module docstring), with its evidence."""
        found = tasks(self.marker, self.node)
        if not found:
            return NotJudged(f"no task of the ranks' step runs on {self.node}, so the start-up bound is not "
                             "judged from here (the ranks on other nodes carry on)")
        world = found[0].job.world_size or found[0].job.ntasks
        if world == 1:
            return NotJudged("the step has one task, which needs no rendezvous; it built no Checkpointer within "
                             f"{self.bound_s:.0f} s (startup_timeout), so rslurm cannot detect its hangs")
        said = rendezvous_failure_line([stderr_text])
        if dump is None:
            exe = pyspy()
            dump = (lambda pid, d, r: pyspy_dump(pid, d, r, exe=exe)) if exe else None
        written: list[str] = []
        in_rdzv: list[int] = []
        dumped = 0
        for t in found:
            rank = t.rank if t.rank is not None else -1
            got = dump(t.pid, run_dir, rank) if dump is not None else None
            if got is None:
                continue
            dumped += 1
            written.append(got[0])
            if _RENDEZVOUS_FRAMES.search(got[1]):
                in_rdzv.append(rank)
        if said is None and dumped == len(found) and not in_rdzv:
            return NotJudged(f"no rank on {self.node} built its Checkpointer within {self.bound_s:.0f} s "
                             "(startup_timeout), but their stacks show them past the rendezvous (a program "
                             "without a Checkpointer?): rslurm cannot detect their hangs or ask them to save over "
                             "the control socket; they still get the save signal")
        job = found[0].job
        addr = (said[1] if said and said[1] else None) or job.master_addr
        port = (said[2] if said and said[2] else None) or job.master_port
        if self.user_addr:
            source = "MASTER_ADDR set for the job, kept by rslurm"
        elif addr and addr in self.expected.values():
            node = next(n for n, a in self.expected.items() if a == addr)
            source = f"derived by rslurm: NodeAddr of {node}" if addr != node else f"derived by rslurm: node {node}"
        elif addr:
            source = "MASTER_ADDR as the tasks started with it"
        else:
            source = "the tasks have no MASTER_ADDR: rslurm found no address for the step's first node"
        failed = ""
        if addr and port:
            failed = prober(addr, port) or (f"{addr}:{port} answers (so the ranks fail elsewhere: from another "
                                            "node, or before they reach the rendezvous)")
        note = "" if written else (
            "no stacks: py-spy is not on PATH (pip install py-spy)" if dump is None
            else "no stacks: py-spy could not read the ranks (ptrace permission?)")
        return StartupFailure(self.bound_s, self.node, addr, port, source, failed, said[0] if said else "",
                              tuple(sorted(t.rank for t in found if t.rank is not None)), tuple(sorted(in_rdzv)),
                              tuple(written), note)


def judge_start(ctx: LaunchContext, watch: StartupWatch, children: Children) -> StartupFailure | None:
    """The start-up bound passed with no rank of this node started: judge it (:meth:`StartupWatch.examine`);
    a failed start is said in one message, recorded as a ``startup_failed`` event, and the ranks torn down
    (returns it); one that cannot be judged is logged and recorded as ``startup_not_judged`` (None)."""
    verdict = watch.examine(children.stderr_tail(0), ctx.run_dir)
    if isinstance(verdict, NotJudged):
        launch_log.warning("%s", verdict.why)
        ctx.event(Event.STARTUP_NOT_JUDGED, why=verdict.why)
        return None
    launch_log.error("%s", verdict.message())
    ctx.event(Event.STARTUP_FAILED, message=verdict.message(), **verdict.to_json())
    teardown(ctx, children, grace=ctx.cfg.term_grace)
    return verdict


__all__ = ["AUTO_BASE_S", "LocalTask", "NotJudged", "RANKS_MARKER_VAR", "StartupFailure",
           "StartupWatch", "judge_start", "local_tasks", "startup_bound"]
