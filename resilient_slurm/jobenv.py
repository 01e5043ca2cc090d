"""The job's environment: every ``SLURM_*`` variable and every rank variable (torchrun's ``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) the library reads,
parsed in one place into :class:`JobEnv`. Standard library only: the lower layers use it.

Lenient parsing: a malformed integer (not an integer, or out of range) is logged once per parse as a
warning that names the variable and its value, then treated as absent. An empty variable is absent,
silently. Code that must refuse a malformed value instead (``distributed.py`` places a process in the
job and reports a bad ``RANK`` as an error) parses with ``warn=False`` and reads the verbatim text
from :attr:`JobEnv.raw`.

Writes stay where they are: the launcher exports rank variables to its ranks (its srun tasks get them
from ``launcher/task_env.sh``), ``init_distributed`` exports them after creating the group; this module
only reads, and holds the pure rules both sides share (:func:`job_master_port`, :func:`tasks_on_node`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

log = logging.getLogger(__name__)

# Every variable JobEnv reads. ``raw`` holds those set (the empty ones included), verbatim.
VARIABLES = (
    "SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "SLURM_STEP_ID", "SLURM_RESTART_COUNT",
    "SLURMD_NODENAME", "SLURM_JOB_NODELIST", "SLURM_STEP_NODELIST", "SLURM_NODELIST",
    "SLURM_JOB_NUM_NODES", "SLURM_NNODES", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_OPEN_MODE",
    "SLURM_NODEID", "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_TASK_PROLOG",
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",  # set by torchrun for its workers
)

# The node count's sources, first set and valid wins.
NODE_COUNT_VARS = ("SLURM_JOB_NUM_NODES", "SLURM_NNODES")

# The rendezvous port derived from a job id (``distributed.py``, and the launcher for its srun steps): every
# task of a job finds the same port without talking. Clear of the privileged range and of Linux's default
# ephemeral range (32768-60999), where outgoing connections could already hold the port: 15000-31999.
PORT_BASE = 15000
PORT_SPAN = 17000
JOB_PORTS = range(PORT_BASE, PORT_BASE + PORT_SPAN)  # also where a local launch or a world of one picks a free port


def job_master_port(job_id: int) -> int:
    """The rendezvous port of job ``job_id``: ``15000 + job_id % 17000``."""
    return PORT_BASE + job_id % PORT_SPAN


def tasks_on_node(tasks_per_node: str, node_index: int) -> int:
    """The task count of node ``node_index`` (0-based, in the step's node order) from Slurm's compressed
    tasks-per-node list: ``2(x2)`` (2 on each of 2 nodes), ``3,1``, ``2(x3),1``. ValueError when the list
    is malformed or has no such node."""
    if node_index < 0:
        raise ValueError(f"node index {node_index} is negative")
    left = node_index
    for item in tasks_per_node.strip().split(","):
        count_text, times, repeat_text = item.strip().partition("(x")
        if times:  # "2(x3)"
            repeat_text = repeat_text[:-1] if repeat_text.endswith(")") else ""
        else:
            repeat_text = "1"
        if not (count_text.isdigit() and repeat_text.isdigit()):
            raise ValueError(f"malformed tasks-per-node list {tasks_per_node!r}: {item!r}")
        repeat = int(repeat_text)
        if left < repeat:
            return int(count_text)
        left -= repeat
    raise ValueError(f"tasks-per-node list {tasks_per_node!r} has no node {node_index}")


def _text(env: Mapping[str, str], var: str) -> str | None:
    """The variable's value; None when unset or empty."""
    return env.get(var) or None


def _int(env: Mapping[str, str], var: str, *, minimum: int = 0, maximum: int | None = None,
         what: str | None = None, warn: bool = True) -> int | None:
    """The variable as an integer in [minimum, maximum]; None when unset or empty, and (with one warning
    naming it) when malformed."""
    raw = env.get(var, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is not None and value >= minimum and (maximum is None or value <= maximum):
        return value
    if not warn:
        return None
    if what is None:
        what = f"an integer >= {minimum}" if maximum is None else f"an integer in {minimum}-{maximum}"
    log.warning("%s=%r is not %s; ignoring it", var, raw, what)
    return None


def _num_nodes(env: Mapping[str, str], warn: bool) -> int | None:
    for var in NODE_COUNT_VARS:
        n = _int(env, var, minimum=1, what="a node count (an integer >= 1)", warn=warn)
        if n is not None:
            return n
    return None


@dataclass(frozen=True)
class JobEnv:
    """This process's place in the Slurm job and in the distributed job, as its environment says.

    Strings are None when the variable is unset or empty; integers also when malformed (warned).
    Build it with :meth:`from_env`; the defaults describe a process outside Slurm and torchrun."""

    job_id: str | None = None
    """``SLURM_JOB_ID``: the job (for an array task, its own job id)."""
    array_job_id: str | None = None
    """``SLURM_ARRAY_JOB_ID``: the array's job id, for an array task."""
    array_task_id: str | None = None
    """``SLURM_ARRAY_TASK_ID``: the task's index in the array."""
    step_id: str | None = None
    """``SLURM_STEP_ID``: the job step (unset in the batch shell)."""
    restart_count: int = 0
    """``SLURM_RESTART_COUNT``: how many times the job was requeued; 0 when unset or malformed."""
    node_name: str | None = None
    """``SLURMD_NODENAME``: Slurm's name of this node."""
    job_nodelist: str | None = None
    """``SLURM_JOB_NODELIST``: the job's nodes, in Slurm's hostlist syntax (``n[1-4]``)."""
    step_nodelist: str | None = None
    """``SLURM_STEP_NODELIST``: the step's nodes, in hostlist syntax."""
    nodelist: str | None = None
    """``SLURM_NODELIST``: the older name of the job's node list."""
    num_nodes: int | None = None
    """``SLURM_JOB_NUM_NODES``, else ``SLURM_NNODES`` (each an integer >= 1); see :meth:`node_count`."""
    procid: int | None = None
    """``SLURM_PROCID``: the task's rank in the step."""
    localid: int | None = None
    """``SLURM_LOCALID``: the task's rank on its node."""
    ntasks: int | None = None
    """``SLURM_NTASKS``: the step's task count (>= 1)."""
    node_id: int | None = None
    """``SLURM_NODEID``: the task's node, as an index into the step's nodes."""
    tasks_per_node: str | None = None
    """``SLURM_STEP_TASKS_PER_NODE``, else ``SLURM_TASKS_PER_NODE``: tasks on each node, compressed
    (``2(x2)``, ``3,1``); see :func:`tasks_on_node`."""
    open_mode: str | None = None
    """``SLURM_OPEN_MODE``: ``a`` (append) or ``t`` (truncate) for the job's output files."""
    rank: int | None = None
    """``RANK`` (torchrun style): the global rank."""
    local_rank: int | None = None
    """``LOCAL_RANK``: the rank on this node."""
    world_size: int | None = None
    """``WORLD_SIZE``: the number of ranks (>= 1)."""
    local_world_size: int | None = None
    """``LOCAL_WORLD_SIZE``: the number of ranks on this node (>= 1)."""
    master_addr: str | None = None
    """``MASTER_ADDR``: the host of rank 0, for the rendezvous."""
    master_port: int | None = None
    """``MASTER_PORT``: the rendezvous port (1-65535)."""
    raw: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}), compare=False, repr=False)
    """The variables of :data:`VARIABLES` that are set (empty ones too), verbatim, for callers that
    validate a value themselves and must report it as given."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, *, warn: bool = True) -> JobEnv:
        """Parse ``env`` (default: ``os.environ`` now). Each malformed integer is warned about once, then
        treated as absent; ``warn=False`` for a caller that reports malformed values itself (from
        :attr:`raw`)."""
        env = os.environ if env is None else env
        return cls(
            job_id=_text(env, "SLURM_JOB_ID"),
            array_job_id=_text(env, "SLURM_ARRAY_JOB_ID"),
            array_task_id=_text(env, "SLURM_ARRAY_TASK_ID"),
            step_id=_text(env, "SLURM_STEP_ID"),
            restart_count=_int(env, "SLURM_RESTART_COUNT", warn=warn) or 0,
            node_name=_text(env, "SLURMD_NODENAME"),
            job_nodelist=_text(env, "SLURM_JOB_NODELIST"),
            step_nodelist=_text(env, "SLURM_STEP_NODELIST"),
            nodelist=_text(env, "SLURM_NODELIST"),
            num_nodes=_num_nodes(env, warn),
            procid=_int(env, "SLURM_PROCID", warn=warn),
            localid=_int(env, "SLURM_LOCALID", warn=warn),
            ntasks=_int(env, "SLURM_NTASKS", minimum=1, warn=warn),
            open_mode=_text(env, "SLURM_OPEN_MODE"),
            node_id=_int(env, "SLURM_NODEID", warn=warn),
            tasks_per_node=_text(env, "SLURM_STEP_TASKS_PER_NODE") or _text(env, "SLURM_TASKS_PER_NODE"),
            rank=_int(env, "RANK", warn=warn),
            local_rank=_int(env, "LOCAL_RANK", warn=warn),
            world_size=_int(env, "WORLD_SIZE", minimum=1, warn=warn),
            local_world_size=_int(env, "LOCAL_WORLD_SIZE", minimum=1, warn=warn),
            master_addr=_text(env, "MASTER_ADDR"),
            master_port=_int(env, "MASTER_PORT", minimum=1, maximum=65535, warn=warn),
            raw=MappingProxyType({v: env[v] for v in VARIABLES if v in env}),
        )

    @property
    def in_slurm(self) -> bool:
        """Inside a Slurm allocation (``SLURM_JOB_ID`` is set)."""
        return self.job_id is not None

    def run_key(self) -> str | None:
        """The job's name for a run: ``<array job>_<task>`` for an array task, else the job id."""
        if self.array_job_id and self.array_task_id:
            return f"{self.array_job_id}_{self.array_task_id}"
        return self.job_id

    def node_count(self, expand: Callable[[str], Sequence[str]]) -> int:
        """Nodes of the job: :attr:`num_nodes`, else the hosts ``expand`` finds in ``SLURM_JOB_NODELIST``
        (a ``ValueError`` from it is warned about, naming the variable), else 1."""
        if self.num_nodes is not None:
            return self.num_nodes
        nodelist = self.job_nodelist or ""
        try:
            hosts = expand(nodelist)
        except ValueError as exc:
            log.warning("SLURM_JOB_NODELIST=%r: %s; assuming one node", nodelist, exc)
            return 1
        return max(1, len(hosts))


__all__ = ["JOB_PORTS", "NODE_COUNT_VARS", "PORT_BASE", "PORT_SPAN", "VARIABLES", "JobEnv", "job_master_port", "tasks_on_node"]
