"""Slurm access: the ``SlurmClient`` interface, the CLI backend (default) and an optional pyslurm backend.

Only this package knows Slurm commands. ``slurm_client()`` picks a backend by name; the pyslurm backend
is imported on first use, so nothing here needs pyslurm.
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from .cli_backend import CliSlurmClient, parse_scontrol_record, run_process
from .client import (
    FINISHED_STATES,
    JobInfo,
    PartitionInfo,
    SlurmClient,
    expand_hostlist,
    parse_duration,
    remaining_seconds,
    signal_name,
)

BACKENDS = ("cli", "pyslurm")


def slurm_client(backend: str = "cli", **options: Any) -> SlurmClient:
    """A ``SlurmClient``: ``"cli"`` (``CliSlurmClient(**options)``) or ``"pyslurm"``
    (``PyslurmSlurmClient`` over a ``CliSlurmClient(**options)``)."""
    if backend == "cli":
        return CliSlurmClient(**options)
    if backend == "pyslurm":
        from .pyslurm_backend import PyslurmSlurmClient

        return PyslurmSlurmClient(CliSlurmClient(**options))
    raise ConfigError(f"unknown Slurm backend {backend!r}; valid: {', '.join(BACKENDS)}")


__all__ = [
    "BACKENDS",
    "FINISHED_STATES",
    "CliSlurmClient",
    "JobInfo",
    "PartitionInfo",
    "SlurmClient",
    "expand_hostlist",
    "parse_duration",
    "parse_scontrol_record",
    "remaining_seconds",
    "run_process",
    "signal_name",
    "slurm_client",
]
