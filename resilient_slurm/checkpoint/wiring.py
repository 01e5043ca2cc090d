"""How a Checkpointer is put together (and taken apart): settings, topology, the run's claim, provenance, the engine, the
event log, and the rank's links to a launcher (stack dumps, the launcher watch, signals and the control
socket).

Who calls what, and when: :class:`~resilient_slurm.checkpoint.checkpointer.Checkpointer` calls
:func:`build` first thing in its constructor (on every rank: it runs the topology and claim phases, so
every rank calls it alike), then :func:`stack_dump`, :func:`rank_link` (from then on a signal only sets
the Checkpointer's flag) and :func:`stragglers`; its ``close()`` calls :func:`release` last.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import IO, Any

from .. import config as settings_mod
from ..control.heartbeat import open_stack_file, register_stack_dump
from ..control.orphan import LauncherWatch
from ..control.rank import RankLink, socket_for_this_node
from ..errors import ConfigError, ResilientSlurmError
from ..jobenv import JobEnv
from ..layout import WRITER_ENV, RunClaim, RunWriter, claim_run
from ..paths import check_id, default_local_dir, default_run_id, node_name
from ..rundir import RunDir
from ..storage.registry import open_durable
from ..storage.tier import StorageTier
from ..telemetry import EventLog
from . import provenance as provenance_mod
from .coordination import Coordinator, Topology, discover_topology
from .engine import Engine
from .policy import Cadence, RetentionPolicy
from .reporting import CheckpointReporter
from .stragglers import RankStragglers


@dataclass
class Parts:
    """What :func:`build` made, in the order it made them."""

    config: settings_mod.Settings
    run_id: str
    durable_tier: StorageTier | None
    retention: RetentionPolicy
    cadence: Cadence
    coord: Coordinator
    job: JobEnv
    topology: Topology
    claim: RunClaim | None
    provenance: dict[str, Any] | None
    engine: Engine
    events: EventLog


def build(args: dict[str, Any], *, config_path: str | None, replicated: Sequence[str], config: Any) -> Parts:
    """The Checkpointer's settings (``args``: its keyword arguments, over ``config_path`` and the
    environment; ``config``: the user's run config) and everything built from them. Raises ConfigError
    for a bad argument, before anything is written."""
    if isinstance(replicated, str) or not all(isinstance(k, str) for k in replicated):
        raise ConfigError(f"replicated must be a list of state keys, got {replicated!r}")
    user_config = provenance_mod.check_user_config(config) if config is not None else None
    cfg = settings_mod.load(args, config_path=config_path)
    run_id = check_id("run id", cfg.run_id or default_run_id())  # the one validation (paths.py)
    # Restore reads the durable tier when a step is missing or corrupt locally; `rslurm daemon`
    # writes it. Opening it makes no request (S3: the client only), so a dead endpoint costs nothing
    # until a restore needs it; then local steps still restore, and with none, restore_fallback says.
    durable_tier = open_durable(cfg, upload_cap=False) if cfg.durable else None
    retention = RetentionPolicy(cfg.keep_last, cfg.keep_every)
    auto = cfg.auto_cadence == "on" and cfg.every_steps is None and cfg.every_seconds is None
    cadence = Cadence(cfg.every_steps, cfg.every_seconds, auto=auto, failure_interval=cfg.failure_interval)
    coord = Coordinator(timeout_s=cfg.collective_timeout, node=node_name(cfg.node_name))
    job = JobEnv.from_env()
    if not coord.distributed and (job.world_size or 1) > 1:
        # Several ranks each acting as "rank 0" would write over one another's shards.
        raise ConfigError(
            f"WORLD_SIZE={job.raw['WORLD_SIZE']} but torch.distributed is not initialized; call "
            "resilient_slurm.init_distributed() (or torch.distributed.init_process_group) before "
            "creating the Checkpointer"
        )
    template: str | Exception
    try:  # an unsafe default directory on one rank must stop every rank, not leave them waiting
        template = cfg.local_dir or default_local_dir()
    except ResilientSlurmError as exc:
        template = exc
    topology = discover_topology(coord, template, node_name(cfg.node_name))
    claim = _claim_run(coord, topology, run_id, job)
    # Gathered once (git runs here, with a timeout), where it is used: domain leaders write manifests,
    # rank 0 compares code versions at a restore.
    provenance: dict[str, Any] | None = None
    if topology.is_leader or topology.rank == 0:
        provenance = provenance_mod.gather(
            world_size=topology.world_size, nodes=topology.domain_of_rank, job=job,
            user_config=user_config, has_config=config is not None)
    engine = Engine(
        topology,
        coord,
        run_id,
        retention=retention,
        io_threads=cfg.io_threads,
        free_space_margin=cfg.free_space_margin,
        capture_rng=cfg.capture_rng,
        durable=durable_tier,
        replica_check=cfg.replica_check,
        replica_check_bytes=cfg.replica_check_bytes,
        replicated=tuple(replicated),
        restore_fallback=cfg.restore_fallback,
        provenance=provenance,
        peer_replicas=cfg.peer_replicas,
        staging_memory_limit=cfg.staging_memory_limit,
    )
    events = EventLog(
        topology.root, run_id, source="rank", node=topology.node,
        job_id=job.job_id, restart_count=job.restart_count, rank=topology.rank)
    return Parts(cfg, run_id, durable_tier, retention, cadence, coord, job, topology, claim, provenance, engine,
                 events)


def _claim_run(coord: Coordinator, topology: Topology, run_id: str, job: JobEnv) -> RunClaim | None:
    """One writer per run (:func:`~resilient_slurm.layout.claim_run`): under ``rslurm launch`` the ranks
    share their launcher's claim (its token in ``RSLURM_RUN_WRITER``); a rank set started alone claims
    the run itself, through each storage domain's leader, until the Checkpointer's ``close()``. A run that
    another launcher or rank set writes raises RunInUseError on every rank alike (one all_gather), before
    anything is written."""
    claim: RunClaim | None = None

    def take() -> None:
        nonlocal claim
        if topology.is_leader:
            me = RunWriter.this_process(job.job_id, os.environ.get(WRITER_ENV) or None)
            claim = claim_run(topology.root, run_id, me)

    try:
        coord.phase("claiming the run", take)
    except BaseException:
        if claim is not None:
            claim.release()
        raise
    return claim


def stack_dump(p: Parts) -> IO[str] | None:
    """Under `rslurm launch` (which sets control_socket for every rank, on every node), the launcher asks
    for every thread's stack when it finds the job hung (control/heartbeat.py): the registered file."""
    under_launcher = (p.config.control_socket or "off").strip().lower() != "off"
    return register_stack_dump(RunDir(p.topology.root, p.run_id).path, p.topology.rank) if under_launcher else None


def stragglers(p: Parts, run_dir: str) -> RankStragglers | None:
    """Straggler detection (stragglers.py) when straggler_ratio is set and the job has several ranks:
    every rank times its own steps; rank 0 compares them."""
    cfg = p.config
    if cfg.straggler_ratio is None or not p.coord.multi:
        return None
    return RankStragglers(cfg.straggler_ratio, cfg.straggler_window, p.topology.rank, p.topology.world_size,
                          p.topology.domain_of_rank, run_dir, p.job.job_id, p.job.restart_count)


def rank_link(p: Parts, on_request: Callable[[], None], report: CheckpointReporter,
              saved: Callable[[], bool]) -> RankLink:
    """Emergency requests: SIGTERM and save_signal (from Slurm or the launcher), and the launcher's control
    socket on this node (``on_request``); under a local launcher, the watch that bounds this rank if the
    launcher dies (control/orphan.py), with the launcher's own bounds (save_timeout for the save,
    term_grace after it; ``saved``: whether the emergency save committed, for its event)."""

    def gone(pid: int, bound: float) -> None:
        on_request()  # a wrapper shell may have taken the launcher's SIGTERM
        report.launcher_gone(pid, bound)

    def timeout(pid: int, bound: float) -> None:
        report.orphan_timeout(pid, bound, saved=saved())

    cfg = p.config
    run_dir = RunDir(p.topology.root, p.run_id).path
    rank = p.topology.rank
    watch = LauncherWatch.from_env(os.environ, save_timeout=cfg.save_timeout, term_grace=cfg.term_grace,
                                   on_gone=gone, on_timeout=timeout,
                                   stack_file=lambda: open_stack_file(run_dir, rank))
    return RankLink(
        rank, p.job.local_rank or 0,
        on_request=on_request, socket_path=socket_for_this_node(cfg.control_socket, os.environ),
        timeout=cfg.control_timeout, trap_signals=cfg.trap_signals, save_signal=cfg.save_signal,
        launcher_watch=watch,
    )


def release(p: Parts) -> None:
    """At the Checkpointer's ``close()``, once its writer thread is shut down: what :func:`build` opened, last
    the peers, the coordinator and the run's claim (nothing of this Checkpointer runs a collective any more)."""
    p.events.close()
    if p.durable_tier is not None:
        p.durable_tier.close()
    p.engine.peers.release()
    p.coord.close()
    if p.claim is not None:
        p.claim.release()
