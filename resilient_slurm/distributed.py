"""Map Slurm's task variables, or torchrun's, to ``torch.distributed.init_process_group``.

Precedence: ``RANK`` and ``WORLD_SIZE`` already set (torchrun, or ``rslurm launch -n N`` local mode) are
used as they are; otherwise a Slurm task (``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``) is
mapped. The rendezvous address is ``MASTER_ADDR`` when set, else an address of the first host of
``SLURM_STEP_NODELIST`` (or ``SLURM_JOB_NODELIST``), where task 0 runs, as Slurm knows it: its
``NodeAddr`` (``scontrol show node``), else its name where the name resolves (the rule of
:mod:`resilient_slurm.rendezvous`, the launcher's too: Slurm's node names need not be host names). The
port is ``MASTER_PORT`` when set, else ``15000 + SLURM_JOB_ID % 17000``, so every task of a job derives
the same port without talking.

Before the group is created, the address must resolve here; and a rendezvous that fails (nothing
answers at the address, a timeout waiting for the other ranks) is a
:class:`~resilient_slurm.errors.RendezvousError` that names the address, the port, where the address
came from and what to set, instead of torch's retries for the whole timeout.

Without any distributed environment, and for a Slurm step of a single task, no process group is
created: single-process training must not need one (nor a free port). That holds too when the task has
``RANK=0``/``WORLD_SIZE=1`` from ``rslurm launch -- srun``'s task prolog (every srun task gets torchrun's
variables there, see docs/integration.md).

After creating the group, ``init_distributed`` exports ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``, as torchrun would have set them.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import socket
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from resilient_slurm.errors import ConfigError, RendezvousError
from resilient_slurm.jobenv import JOB_PORTS, PORT_BASE, PORT_SPAN, JobEnv, job_master_port, tasks_on_node
from resilient_slurm.rendezvous import free_port, resolve_error, slurm_node_addr

logger = logging.getLogger(__name__)

__all__ = [
    "DistributedEnv",
    "expand_nodelist",
    "init_distributed",
    "local_world_size",
    "parse_nodelist",
    "resolve_distributed_env",
    # Ports derived from job ids: PORT_BASE + SLURM_JOB_ID % PORT_SPAN (jobenv.job_master_port, which the
    # launcher uses too, so that its srun tasks get the same MASTER_PORT).
    "PORT_BASE",
    "PORT_SPAN",
]

SCONTROL_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class DistributedEnv:
    """Where this process sits in the job and how the ranks meet."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    source: str  # "torchrun" (RANK/WORLD_SIZE were set) or "slurm"
    addr_source: str = field(default="MASTER_ADDR", compare=False)  # where master_addr came from, in words


# -- node lists -----------------------------------------------------------------------------------

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _split_top_level(text: str, what: str) -> list[str]:
    """Split on commas outside brackets."""
    parts: list[str] = []
    depth = 0
    start = 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
            if depth > 1:
                raise ConfigError(f"malformed Slurm {what} {text!r}: nested brackets")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ConfigError(f"malformed Slurm {what} {text!r}: ']' without '['")
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ConfigError(f"malformed Slurm {what} {text!r}: '[' without ']'")
    parts.append(text[start:])
    return parts


def _expand_ranges(body: str, nodelist: str) -> list[str]:
    """Expand the inside of one bracket, e.g. ``01-03,7`` -> ``01 02 03 7`` (widths kept)."""
    values: list[str] = []
    for item in body.split(","):
        match = _RANGE.match(item.strip())
        if match is None:
            raise ConfigError(f"malformed Slurm node list {nodelist!r}: bad range {item!r}")
        low_text, high_text = match.group(1), match.group(2)
        if high_text is None:
            values.append(low_text)
            continue
        low, high = int(low_text), int(high_text)
        if high < low:
            raise ConfigError(f"malformed Slurm node list {nodelist!r}: range {item!r} runs backwards")
        # Slurm pads to the width of the lower bound: gpu-[01-04] -> gpu-01 ... gpu-04.
        width = len(low_text)
        values.extend(str(v).zfill(width) for v in range(low, high + 1))
    return values


def _expand_host(expression: str, nodelist: str) -> list[str]:
    """Expand one host expression; several bracket groups multiply (``r[1-2]n[1-2]`` -> 4 hosts)."""
    hosts = [""]
    rest = expression
    while rest:
        open_at = rest.find("[")
        if open_at < 0:
            hosts = [h + rest for h in hosts]
            break
        close_at = rest.index("]", open_at)  # balanced brackets were checked by _split_top_level
        prefix, body = rest[:open_at], rest[open_at + 1 : close_at]
        hosts = [h + prefix + v for h in hosts for v in _expand_ranges(body, nodelist)]
        rest = rest[close_at + 1 :]
    return hosts


def parse_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm node list such as ``n[1-3,5]``, ``gpu-[01-04]`` or ``a1,b2`` into host names."""
    text = nodelist.strip()
    if not text:
        raise ConfigError("malformed Slurm node list '': it names no host")
    hosts: list[str] = []
    for expression in _split_top_level(text, "node list"):
        if not expression or expression.startswith("["):
            raise ConfigError(f"malformed Slurm node list {nodelist!r}: empty host name in {expression!r}")
        hosts.extend(_expand_host(expression, nodelist))
    return hosts


def expand_nodelist(
    nodelist: str, *, scontrol: str = "scontrol", timeout_s: float = SCONTROL_TIMEOUT_S
) -> list[str]:
    """Expand a node list with ``scontrol show hostnames``, falling back to :func:`parse_nodelist`."""
    if "[" not in nodelist:
        # Plain comma-separated names need no help from Slurm; save the subprocess.
        return parse_nodelist(nodelist)
    try:
        completed = subprocess.run(
            [scontrol, "show", "hostnames", nodelist],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except FileNotFoundError:
        logger.debug("%s not found; expanding node list %r in Python", scontrol, nodelist)
        return parse_nodelist(nodelist)
    except subprocess.TimeoutExpired:
        # scontrol can hang when slurmctld is unreachable; the list itself is still parseable.
        logger.warning(
            "%s show hostnames timed out after %.1f s; expanding %r in Python", scontrol, timeout_s, nodelist
        )
        return parse_nodelist(nodelist)
    hosts = completed.stdout.split()
    if completed.returncode != 0 or not hosts:
        logger.warning(
            "%s show hostnames %r failed (exit %d: %s); expanding it in Python",
            scontrol,
            nodelist,
            completed.returncode,
            completed.stderr.strip()[:200],
        )
        return parse_nodelist(nodelist)
    return hosts


# -- environment ----------------------------------------------------------------------------------


def _int_var(env: Mapping[str, str], name: str, *, minimum: int) -> int:
    raw = env.get(name)
    if raw is None:
        raise ConfigError(f"{name} is not set; it is needed to place this process in the distributed job")
    try:
        value = int(raw.strip())
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise ConfigError(f"{name}={raw!r} must be >= {minimum}")
    return value


def _port_var(env: Mapping[str, str], name: str) -> int:
    port = _int_var(env, name, minimum=1)
    if port > 65535:
        raise ConfigError(f"{name}={port} is not a TCP port (1-65535)")
    return port


def resolve_distributed_env(
    env: Mapping[str, str],
    *,
    expand: Callable[[str], list[str]] = expand_nodelist,
    node_addr: Callable[[str], str | None] = slurm_node_addr,
) -> DistributedEnv | None:
    """Work out rank, world size, local rank and rendezvous from ``env``; None if not distributed.

    Strict, unlike :class:`JobEnv`'s own parsing: a malformed value is a :class:`ConfigError` that quotes
    it, so the variables are read verbatim from :attr:`JobEnv.raw`. ``node_addr`` gives a node's
    ``NodeAddr`` (None: Slurm does not say; the node's name is used then, and :func:`init_distributed`
    checks that it resolves)."""
    job = JobEnv.from_env(env, warn=False)
    raw = job.raw
    has_rank, has_world = "RANK" in raw, "WORLD_SIZE" in raw
    if has_rank != has_world:
        present, missing = ("RANK", "WORLD_SIZE") if has_rank else ("WORLD_SIZE", "RANK")
        raise ConfigError(
            f"{present} is set but {missing} is not; set both (torchrun style) or neither (to map Slurm's "
            "task variables)"
        )
    if has_rank:
        source = "torchrun"
        world_size = _int_var(raw, "WORLD_SIZE", minimum=1)
        rank = _int_var(raw, "RANK", minimum=0)
        rank_var = "RANK"
        if "LOCAL_RANK" in raw:
            local_rank = _int_var(raw, "LOCAL_RANK", minimum=0)
        elif "SLURM_LOCALID" in raw:
            local_rank = _int_var(raw, "SLURM_LOCALID", minimum=0)
        else:
            local_rank = 0
        if world_size == 1 and job.step_id is not None and job.ntasks == 1 and "TORCHELASTIC_RUN_ID" not in raw:
            # The only task of a Slurm step, with RANK=0/WORLD_SIZE=1 from `rslurm launch -- srun`'s task
            # prolog: single-process, like the Slurm case below. (A worker of torchrun, which sets
            # TORCHELASTIC_RUN_ID, still gets its group of one, as it always did.)
            return None
    elif "SLURM_PROCID" in raw and "SLURM_NTASKS" in raw:
        source = "slurm"
        world_size = _int_var(raw, "SLURM_NTASKS", minimum=1)
        rank = _int_var(raw, "SLURM_PROCID", minimum=0)
        rank_var = "SLURM_PROCID"
        local_rank = _int_var(raw, "SLURM_LOCALID", minimum=0)
        if world_size == 1:
            # One task (often plain `python train.py` in the batch script): no group, no port needed.
            return None
    else:
        return None
    if rank >= world_size:
        raise ConfigError(f"{rank_var}={rank} is not below the world size {world_size}")

    addr_source = "MASTER_ADDR, set in the environment"
    if job.master_addr:
        master_addr = job.master_addr
    else:
        list_var = "SLURM_STEP_NODELIST" if job.step_nodelist else "SLURM_JOB_NODELIST"
        nodelist = job.step_nodelist or job.job_nodelist
        if nodelist:
            try:
                first = expand(nodelist)[0]
            except ConfigError as exc:
                raise ConfigError(f"{list_var}: {exc}") from exc
            addr = node_addr(first) if world_size > 1 else None
            master_addr = addr or first
            addr_source = (f"NodeAddr of node {first}, the first of {list_var}, from Slurm" if addr
                           else f"node {first}, the first of {list_var}: Slurm gave no NodeAddr for it")
        elif world_size == 1:
            master_addr = "127.0.0.1"
            addr_source = "loopback: a group of one"
        else:
            raise ConfigError(
                "MASTER_ADDR is not set and neither SLURM_STEP_NODELIST nor SLURM_JOB_NODELIST names the "
                "nodes; set MASTER_ADDR to the host of rank 0"
            )

    if raw.get("MASTER_PORT"):
        master_port = _port_var(raw, "MASTER_PORT")
    elif job.job_id:
        master_port = job_master_port(_int_var(raw, "SLURM_JOB_ID", minimum=0))
    elif world_size == 1:
        master_port = free_port(JOB_PORTS)
    else:
        raise ConfigError(
            "MASTER_PORT is not set and SLURM_JOB_ID is not there to derive one from; set MASTER_PORT to a "
            "free port on the host of rank 0"
        )
    return DistributedEnv(rank, world_size, local_rank, master_addr, master_port, source, addr_source)


def local_world_size(env: Mapping[str, str]) -> int:
    """Ranks on this node, as torchrun's ``LOCAL_WORLD_SIZE``: that variable when set (strict: a malformed
    value is a :class:`ConfigError`), else this node's entry in Slurm's tasks-per-node list
    (``SLURM_STEP_TASKS_PER_NODE``, else ``SLURM_TASKS_PER_NODE``, such as ``2(x2)`` or ``3,1``) at
    ``SLURM_NODEID``, else 1."""
    job = JobEnv.from_env(env, warn=False)
    raw = job.raw
    if raw.get("LOCAL_WORLD_SIZE", "").strip():
        return _int_var(raw, "LOCAL_WORLD_SIZE", minimum=1)
    if job.tasks_per_node is None:
        return 1
    try:
        return tasks_on_node(job.tasks_per_node, job.node_id or 0)
    except ValueError as exc:
        # Only informative (the group forms without it): warn, do not fail the job.
        logger.warning("cannot tell the ranks on this node (%s); LOCAL_WORLD_SIZE=1", exc)
        return 1


def _local_rank_of_initialized(env: Mapping[str, str]) -> int:
    raw = JobEnv.from_env(env, warn=False).raw
    for name in ("LOCAL_RANK", "SLURM_LOCALID"):
        if name in raw:
            return _int_var(raw, name, minimum=0)
    return 0


def init_distributed(
    backend: str | None = None, timeout: datetime.timedelta | float | None = None
) -> tuple[int, int, int]:
    """Initialize torch.distributed from Slurm's or torchrun's variables; return (rank, world_size, local_rank)."""
    if isinstance(timeout, (int, float)):
        timeout = datetime.timedelta(seconds=timeout)
    if dist.is_available() and dist.is_initialized():
        rank, world_size = dist.get_rank(), dist.get_world_size()
        local_rank = _local_rank_of_initialized(os.environ)
        if torch.cuda.is_available():
            torch.cuda.set_device(local_rank)
        return rank, world_size, local_rank

    resolved = resolve_distributed_env(os.environ)
    if resolved is None:
        logger.debug(
            "no distributed environment (no RANK/WORLD_SIZE, no multi-task Slurm step): single process"
        )
        return 0, 1, 0
    if not dist.is_available():
        raise ConfigError(
            "this PyTorch build has no torch.distributed, but the environment asks for "
            f"{resolved.world_size} ranks; install a PyTorch build with distributed support"
        )

    ranks_here = local_world_size(os.environ)  # before anything is exported: a bad value changes nothing
    check_rendezvous_address(resolved)
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        # Before init: NCCL binds each rank to the current device.
        torch.cuda.set_device(resolved.local_rank)

    # Exported so that code using env:// later (new groups, other libraries) sees the same job layout.
    os.environ["RANK"] = str(resolved.rank)
    os.environ["WORLD_SIZE"] = str(resolved.world_size)
    os.environ["LOCAL_RANK"] = str(resolved.local_rank)
    os.environ["LOCAL_WORLD_SIZE"] = str(ranks_here)
    os.environ["MASTER_ADDR"] = resolved.master_addr
    os.environ["MASTER_PORT"] = str(resolved.master_port)

    logger.info(
        "job %s rank %d/%d (local %d): init_process_group backend=%s via %s:%d (from %s variables)",
        JobEnv.from_env(warn=False).raw.get("SLURM_JOB_ID", "-"),
        resolved.rank,
        resolved.world_size,
        resolved.local_rank,
        backend,
        resolved.master_addr,
        resolved.master_port,
        resolved.source,
    )
    try:
        dist.init_process_group(
            backend=backend,
            init_method="env://",
            rank=resolved.rank,
            world_size=resolved.world_size,
            timeout=timeout,
        )
    except (dist.DistNetworkError, dist.DistStoreError) as exc:
        # torch's store errors at this point are the rendezvous: nothing answered at the address, or the
        # other ranks never came. Said once, with what to set, instead of only torch's socket error.
        raise RendezvousError(
            f"rank {resolved.rank} of {resolved.world_size} could not meet the other ranks at "
            f"{resolved.master_addr}:{resolved.master_port} (the address: {resolved.addr_source}): "
            f"{(str(exc).splitlines() or [type(exc).__name__])[0].rstrip('.')}. {_RENDEZVOUS_HINT}"
        ) from exc
    return resolved.rank, resolved.world_size, resolved.local_rank


_RENDEZVOUS_HINT = (
    "Set MASTER_ADDR to an address of the node that runs rank 0 that every node reaches (e.g. "
    "`export MASTER_ADDR=$(srun -N1 -n1 -w <first node> hostname --ip-address)` in the batch script), and "
    "MASTER_PORT to a port free there; under `rslurm launch -- srun` leave both unset: the launcher derives "
    "them from Slurm (NodeAddr)"
)


def check_rendezvous_address(resolved: DistributedEnv) -> None:
    """Raise :class:`RendezvousError` when the rendezvous address does not resolve on this node: torch would
    retry it for the whole timeout (30 minutes by default) with a warning a second, and no rank would
    start. The message names the address, the port, where the address came from and what to set."""
    why = resolve_error(resolved.master_addr)
    if why is None:
        return
    node = JobEnv.from_env(warn=False).node_name or socket.gethostname()
    raise RendezvousError(
        f"rank {resolved.rank} of {resolved.world_size}: the rendezvous address {resolved.master_addr!r} (port "
        f"{resolved.master_port}; from {resolved.addr_source}) does not resolve on {node}: {why}. {_RENDEZVOUS_HINT}"
    )
