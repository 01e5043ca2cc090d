"""Tagging a committed step from the training program (``ckpt.tag(step, name)``): every storage domain's
tags file in one phase, then the tags' durable copy.

Who calls what, and when: the :class:`~resilient_slurm.checkpoint.checkpointer.Checkpointer`'s ``tag()``
calls :func:`tag_domains` on every rank (a phase: every rank raises alike, or none), then, on rank 0 with a
durable tier, hands :func:`copy_to_durable` to its writer thread (writer.py). The tags file itself
(format, lock, merge) is ``resilient_slurm.tags``; the engine writes a domain's under the deleters' lock.
"""

from __future__ import annotations

import logging

from ..errors import CheckpointError, ConfigError, ResilientSlurmError, TagsFileError
from ..storage.tier import StorageTier
from ..tags import read_local_tags, sync_durable_tags
from .coordination import Coordinator, Topology
from .engine import Engine

# The Checkpointer's logger, as before tagging left its module: a program's log filters keep working.
log = logging.getLogger("resilient_slurm.checkpoint.checkpointer")


def tag_domains(coord: Coordinator, topology: Topology, engine: Engine, step: int, name: str) -> int | None:
    """Each storage domain's leader tags ``step`` as ``name`` in its domain's tags file; the step the tag
    moved from (None: a new tag), on the leaders. Raises ConfigError, TagsFileError or CheckpointError
    naming the domain, on every rank alike."""
    moved: int | None = None

    def tag_domain() -> None:
        nonlocal moved
        if not topology.is_leader:
            return
        try:
            moved = engine.tag(step, name)
        except (ResilientSlurmError, OSError) as exc:
            cls = type(exc) if isinstance(exc, (TagsFileError, ConfigError)) else CheckpointError
            raise cls(f"domain {topology.domain}: {exc}") from exc

    coord.phase("tagging the step", tag_domain)  # every rank raises alike, or none
    return moved


def copy_to_durable(run_dir: str, run_id: str, tier: StorageTier) -> None:
    """Writer thread (rank 0): merge this domain's tags file into the durable copy. Never raises: the drain
    daemon copies them at its next pass."""
    try:
        local = read_local_tags(run_dir, run_id)
        if local is not None:
            sync_durable_tags(tier, local)
    except ResilientSlurmError as exc:
        log.warning("could not copy the tags of run %s to %s: %s; the drain daemon copies them at its next "
                    "pass", run_id, tier.url, exc)
