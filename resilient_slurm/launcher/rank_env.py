"""torchrun's variables for every task of ``rslurm launch -- srun ...`` (and ``bin/rsrun``).

A program written for torchrun reads ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT`` from its environment and calls ``init_process_group("env://")``.
Under srun, each task's values differ and only Slurm knows them when the task starts, so
:func:`srun_with_rank_env` adds ``--task-prolog=<task_env.sh>`` to the srun command: slurmstepd runs that
script before each task and applies the ``export NAME=value`` lines it prints (see the script for what it
exports from which Slurm variable). What is the same for every task comes from here, in srun's
environment: ``MASTER_PORT`` (:func:`~resilient_slurm.jobenv.job_master_port`, the port
``init_distributed`` derives as well) unless the user set it, and the map of the allocation's node names
to their addresses (:data:`~resilient_slurm.rendezvous.NODE_ADDRS_VAR`), from which the script takes
``MASTER_ADDR``: the address of the step's first node, as Slurm knows it (``NodeAddr``), since node
names need not resolve (:mod:`resilient_slurm.rendezvous`).

Who calls what: the launcher calls :func:`rendezvous_addresses` before each start of the ranks under srun,
which asks Slurm for the allocation's nodes (:func:`allocation_nodes`) and their addresses
(``SlurmClient.node_addresses``, one query) and applies the rendezvous rule (:func:`node_address_map`);
:class:`~.processes.SrunStep` calls :func:`srun_with_rank_env` on the command, environment and map the
launcher gives it.

Rules:

* A variable the user set is kept: ``MASTER_ADDR`` / ``MASTER_PORT`` in the launcher's environment, and
  anything set for the step (``srun --export=ALL,NAME=value``), which the script leaves alone. A program
  that sets its own default (``os.environ.setdefault("MASTER_ADDR", "localhost")``) gets ours: the task
  starts with it set.
* The per-task variables (:data:`PER_TASK_VARS`) in the launcher's own environment are stale, inherited
  from the batch script (one value cannot be each task's): they are taken out of srun's environment,
  with a warning naming them, and every task gets its own.
* The user's own task prolog (``srun --task-prolog=X``, or ``SLURM_TASK_PROLOG``) is chained, not
  dropped: the script runs it last, with the variables set, and passes its output and exit status on.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from ..errors import SlurmError
from ..jobenv import JobEnv, job_master_port
from ..rendezvous import NODE_ADDRS_VAR, encode_node_addresses, rendezvous_address, resolve_error
from ..slurm.client import expand_hostlist
from .context import LaunchContext, launch_log

log = logging.getLogger(__name__)

TASK_PROLOG = Path(__file__).resolve().with_name("task_env.sh")

# Where the user's own task prolog goes for the script to run. Outside the RSLURM_ namespace on purpose:
# settings reject unknown RSLURM_* variables, and this is no setting. The script unsets it for the task.
CHAIN_VAR = "_RSLURM_USER_TASK_PROLOG"

# Exported per task by the script; stale when the launcher inherits them.
PER_TASK_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK")

# srun's options that take their value as the next argument when it is not attached (``-N 2``,
# ``--nodes 2``); from `srun --help` (Slurm 22.05). An option missing here is taken for a flag.
_VALUE_SHORT = frozenset("ABCDGJLMNSTWbcdeimnopqrtwx")
_VALUE_LONG = frozenset("""
    account acctg-freq bb bbf bcast-exclude begin chdir cluster-constraint clusters comment constraint container
    core-spec cores-per-socket cpu-bind cpu-freq cpus-per-gpu cpus-per-task deadline delay-boot dependency
    distribution epilog error exclude export extra-node-info gid gpu-bind gpu-freq gpus gpus-per-node
    gpus-per-socket gpus-per-task gres gres-flags het-group hint input job-name jobid licenses mail-type
    mail-user mcs-label mem mem-bind mem-per-cpu mem-per-gpu mincpus mpi network nodelist nodes ntasks
    ntasks-per-core ntasks-per-gpu ntasks-per-node ntasks-per-socket output partition power priority profile
    prolog qos relative reservation signal slurmd-debug sockets-per-node switches task-epilog task-prolog
    thread-spec threads threads-per-core time time-min tmp tres-per-task uid wait wckey
""".split())

_TASK_PROLOG_OPT = "--task-prolog"


def _is_task_prolog(name: str) -> bool:
    """``--task-prolog``, or an abbreviation srun accepts for it (``--task-p``: ``--task-`` is ambiguous)."""
    return len(name) >= len("--task-p") and _TASK_PROLOG_OPT.startswith(name)


def srun_options(argv: Sequence[str]) -> tuple[list[tuple[str, str | None, int, int]], int]:
    """srun's own options in ``argv`` (``srun [options] program ...``) as (name, value, first index, last
    index): long options by their full name (``--nodes``), short ones as ``-N`` (a cluster ``-lN2`` gives
    ``-l`` and ``-N``); value None for a flag. Also the index where the program starts (after ``--`` or at
    the first argument that is not an option; ``len(argv)`` when there is none). The one reader of srun
    command lines: the task prolog's chaining here, the node count and ``--exclude`` in health.py."""
    opts: list[tuple[str, str | None, int, int]] = []
    i = 1
    while i < len(argv):
        a = argv[i]
        if a == "--":
            return opts, i + 1
        if not a.startswith("-") or a == "-":
            return opts, i
        if a.startswith("--"):
            name, eq, value = a.partition("=")
            if eq:
                opts.append((name, value, i, i))
            elif (name[2:] in _VALUE_LONG or _is_task_prolog(name)) and i + 1 < len(argv):
                opts.append((name, argv[i + 1], i, i + 1))
                i += 1
            else:
                opts.append((name, None, i, i))
        else:
            # A cluster of short options: the first one that takes a value takes the rest of the word,
            # or the next argument when nothing follows it (-lN 2, -lN2).
            first = i
            for j, ch in enumerate(a[1:], start=1):
                if ch in _VALUE_SHORT:
                    if j == len(a) - 1 and i + 1 < len(argv):
                        opts.append((f"-{ch}", argv[i + 1], first, i + 1))
                        i += 1
                    else:
                        opts.append((f"-{ch}", a[j + 1:], first, first))
                    break
                opts.append((f"-{ch}", None, first, first))
        i += 1
    return opts, len(argv)


def split_task_prolog(argv: Sequence[str]) -> tuple[list[str], str | None]:
    """``argv`` (``srun [options] program ...``) without srun's own ``--task-prolog`` options, and the
    value of the last one (srun uses the last), or None. The program's arguments are never touched: the
    scan stops at ``--`` or at the first argument that is not an option."""
    opts, _ = srun_options(argv)
    drop: set[int] = set()
    prolog: str | None = None
    for name, value, first, last in opts:
        if name.startswith("--") and _is_task_prolog(name):
            prolog = value
            drop |= set(range(first, last + 1))
    return [a for i, a in enumerate(argv) if i not in drop], prolog


def _usable_prolog() -> str | None:
    """The script's path, made executable if it is not (an install that lost the mode bit); None, with a
    warning, when it cannot be run."""
    path = TASK_PROLOG
    try:
        if not os.access(path, os.X_OK):
            mode = path.stat().st_mode
            path.chmod(mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        return str(path)
    except OSError as exc:
        log.warning("cannot use %s as srun's task prolog (%s): the tasks do not get RANK, LOCAL_RANK, WORLD_SIZE, "
                    "LOCAL_WORLD_SIZE (init_distributed() still maps Slurm's variables)", path, exc)
        return None


# Without an answer from Slurm, how many of the allocation's first nodes get their name checked here (a name
# that does not resolve can take the resolver seconds; task 0 runs on the first node of the step).
RESOLVE_CHECKS = 16


def node_address_map(nodes: Sequence[str], query: Callable[[], Mapping[str, str]],
                     resolve: Callable[[str], str | None] = resolve_error) -> dict[str, str | None]:
    """The rendezvous address of each of ``nodes`` (the allocation's, in Slurm's order): its ``NodeAddr`` from
    ``query`` (``SlurmClient.node_addresses``), else its name where the name resolves, else None. When
    Slurm does not answer, the names of the first :data:`RESOLVE_CHECKS` nodes are checked and the rest
    left to their names; every node without a working address is named in a warning."""
    try:
        addrs = dict(query())
    except SlurmError as exc:
        log.warning("cannot read the nodes' addresses from Slurm (%s); MASTER_ADDR falls back to the node's "
                    "name where it resolves", exc)
        addrs = None
    out: dict[str, str | None] = {}
    for i, node in enumerate(nodes):
        if addrs is None and i >= RESOLVE_CHECKS:
            out[node] = node
            continue
        out[node] = rendezvous_address(node, (addrs or {}).get(node), resolve)
    bad = [n for n, a in out.items() if a is None]
    if bad:
        log.warning("no rendezvous address for node(s) %s: Slurm gives no NodeAddr and the name does not resolve "
                    "here; a step whose first node is one of them gets no MASTER_ADDR: set MASTER_ADDR for the "
                    "job to an address of that node (`srun -N1 -n1 -w NODE hostname --ip-address`)",
                    ", ".join(bad[:8]) + (f" and {len(bad) - 8} more" if len(bad) > 8 else ""))
    return out


def srun_with_rank_env(argv: Sequence[str], env: Mapping[str, str],
                       node_addrs: Mapping[str, str | None] | None = None) -> tuple[list[str], dict[str, str]]:
    """The srun command and environment that give every task torchrun's variables (module docstring);
    ``node_addrs`` is :func:`node_address_map`'s result (None: the tasks fall back to the node's name)."""
    out_env = dict(env)
    out_env.pop(NODE_ADDRS_VAR, None)
    job = JobEnv.from_env(env, warn=False)
    if node_addrs and not job.master_addr:
        text, left_out = encode_node_addresses(node_addrs)
        if text:
            out_env[NODE_ADDRS_VAR] = text
        if left_out:
            log.warning("the task prolog cannot carry the address of node(s) %s (%d bytes of addresses at most, "
                        "or characters a shell word cannot hold): a step whose first node is one of them gets "
                        "that node's name as MASTER_ADDR", ", ".join(left_out[:8]), len(text))
    stale = {k: out_env.pop(k) for k in PER_TASK_VARS if k in out_env}
    if stale:
        log.warning("not passing %s from the launcher's environment to the tasks: each task gets its own "
                    "(set per-task values in your own srun --task-prolog)",
                    ", ".join(f"{k}={v!r}" for k, v in stale.items()))
    if not job.raw.get("MASTER_PORT", "").strip() and job.job_id:
        try:
            out_env["MASTER_PORT"] = str(job_master_port(int(job.job_id)))
        except ValueError:
            pass  # a malformed SLURM_JOB_ID: init_distributed names it in the task
    script = _usable_prolog()
    if script is None:
        return list(argv), out_env
    command, user_prolog = split_task_prolog(argv)
    if user_prolog is None:  # srun's own variable for --task-prolog, which ours on the command line overrides
        user_prolog = job.raw.get("SLURM_TASK_PROLOG") or None
    if user_prolog is not None and os.path.realpath(user_prolog) == script:
        user_prolog = None  # ours already: never run it twice
    out_env.pop(CHAIN_VAR, None)
    if user_prolog is not None:
        out_env[CHAIN_VAR] = user_prolog
    return [command[0], f"{_TASK_PROLOG_OPT}={script}", *command[1:]], out_env


def allocation_nodes(ctx: LaunchContext) -> list[str]:
    """The hosts of the job's allocation (SLURM_JOB_NODELIST), as Slurm names them."""
    nodelist = JobEnv.from_env(ctx.env).job_nodelist or ""
    try:
        return ctx.slurm.hostnames(nodelist) if nodelist else []
    except SlurmError:
        return expand_hostlist(nodelist)


def rendezvous_addresses(ctx: LaunchContext, env: Mapping[str, str],
                         excluded: Sequence[str]) -> dict[str, str | None] | None:
    """The rendezvous address of each node of the allocation (:func:`node_address_map`: one
    ``scontrol show node``), for the task prolog's MASTER_ADDR; None when the user set MASTER_ADDR (in
    ``env``, the ranks' environment). ``excluded``: nodes the ranks start without."""
    job = JobEnv.from_env(env, warn=False)
    if job.master_addr:
        return None
    nodes = allocation_nodes(ctx)
    nodelist = JobEnv.from_env(ctx.env).job_nodelist or ""
    if not nodes or not nodelist:
        return None
    addrs = node_address_map(nodes, lambda: ctx.slurm.node_addresses(nodelist))
    first = next((n for n in nodes if n not in excluded), nodes[0])
    launch_log.info("rendezvous: each task's MASTER_ADDR is the address of its step's first node as Slurm knows "
                    "it (NodeAddr; %s -> %s), MASTER_PORT %s", first, addrs.get(first) or "none",
                    job.master_port or "derived from the job id")
    return addrs


__all__ = ["CHAIN_VAR", "PER_TASK_VARS", "TASK_PROLOG", "allocation_nodes", "node_address_map", "rendezvous_addresses",
           "split_task_prolog", "srun_with_rank_env"]
