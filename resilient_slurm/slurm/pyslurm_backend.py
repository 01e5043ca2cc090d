"""``PyslurmSlurmClient``: job records through libslurm (pyslurm), everything else through the CLI.

Optional. This module imports without pyslurm; ``PYSLURM_AVAILABLE`` says whether pyslurm imported and
``PYSLURM_IMPORT_ERROR`` why not. Constructing the client without pyslurm raises a PermanentSlurmError
with the install hint.

Why it exists: ``job_info`` is the one call the launcher and daemon make repeatedly; through libslurm it
is one RPC instead of a fork+exec of scontrol. Mutating calls (requeue, hold, signal, cancel, submit) and
rare reads (partition, config, hostnames) go through ``CliSlurmClient``, whose timeouts, retries and
error messages are tested against a real cluster. Uses pyslurm's object API (``pyslurm.Job.load``,
pyslurm >= 22.5); pyslurm's version must match the cluster's Slurm major version.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timezone
from os import PathLike
from typing import Any

from ..errors import PermanentSlurmError
from .cli_backend import CliSlurmClient, classify_failure
from .client import JobInfo, PartitionInfo, Signal, SlurmClient, expand_hostlist

try:
    import pyslurm  # type: ignore[import-not-found]
except ImportError as _exc:  # the common case: the CLI backend is the default
    pyslurm = None
    PYSLURM_IMPORT_ERROR: ImportError | None = _exc
else:  # pragma: no cover - pyslurm is not installed in CI
    PYSLURM_IMPORT_ERROR = None

PYSLURM_AVAILABLE = pyslurm is not None
INSTALL_HINT = ("pip install 'pyslurm==<major.minor of your Slurm>.*' (needs libslurm headers), or use "
                "CliSlurmClient, the default")


def _when(epoch: Any) -> datetime | None:
    return datetime.fromtimestamp(epoch, tz=timezone.utc) if epoch else None


class PyslurmSlurmClient(SlurmClient):
    """``job_info`` via ``pyslurm.Job.load``; all other methods delegate to ``cli``."""

    def __init__(self, cli: CliSlurmClient | None = None) -> None:
        if pyslurm is None:
            raise PermanentSlurmError(f"the pyslurm backend needs pyslurm, which did not import "
                                      f"({PYSLURM_IMPORT_ERROR}); {INSTALL_HINT}")
        self.cli = cli or CliSlurmClient()

    def job_info(self, job_id: int | str) -> JobInfo:  # pragma: no cover - needs pyslurm
        if not str(job_id).isdigit():  # array task ids ("12_3") are resolved by scontrol
            return self.cli.job_info(job_id)
        try:
            job = pyslurm.Job.load(int(job_id))
        except Exception as exc:  # pyslurm.RPCError carries Slurm's message (slurm_strerror)
            err = classify_failure(("pyslurm.Job.load", str(job_id)), getattr(exc, "errno", 1) or 1, str(exc))
            raise err from exc
        nodes = job.allocated_nodes
        limit = job.time_limit  # minutes, None when unlimited
        return JobInfo(
            job_id=int(job.id), name=job.name or "", state=job.state,
            reason=None if job.state_reason in (None, "None") else job.state_reason,
            restarts=int(job.requeue_count or 0), requeue=bool(job.is_requeueable), priority=job.priority,
            time_limit=float(limit) * 60 if limit is not None else None,
            submit_time=_when(job.submit_time), start_time=_when(job.start_time), end_time=_when(job.end_time),
            preempt_time=_when(job.preempt_time), partition=job.partition,
            nodes=tuple(expand_hostlist(nodes)) if nodes else (), node_list=nodes, batch_host=job.batch_host,
            exit_code=job.exit_code, exit_signal=job.exit_code_signal, comment=job.comment,
            array_job_id=job.array_id, array_task_id=job.array_task_id,
        )

    def requeue(self, job_id: int | str, *, only_incomplete: bool = True) -> None:
        self.cli.requeue(job_id, only_incomplete=only_incomplete)

    def requeue_hold(self, job_id: int | str, reason: str, *, only_incomplete: bool = True) -> None:
        self.cli.requeue_hold(job_id, reason, only_incomplete=only_incomplete)

    def signal(self, job_id: int | str, sig: Signal, *, batch: bool = False, full: bool = False,
               step: int | str | None = None) -> None:
        self.cli.signal(job_id, sig, batch=batch, full=full, step=step)

    def cancel(self, job_id: int | str) -> None:
        self.cli.cancel(job_id)

    def submit(self, script: str | PathLike[str], args: Sequence[str] = ()) -> int:
        return self.cli.submit(script, args)

    def partition_info(self, name: str) -> PartitionInfo:
        return self.cli.partition_info(name)

    def config_value(self, key: str) -> str:
        return self.cli.config_value(key)

    def hostnames(self, nodelist: str) -> list[str]:
        return self.cli.hostnames(nodelist)

    def node_addresses(self, nodelist: str) -> dict[str, str]:
        return self.cli.node_addresses(nodelist)

    def steps(self, job_id: int | str) -> list[tuple[str, str]]:
        return self.cli.steps(job_id)

    def exclude_nodes(self, job_id: int | str, nodes: Sequence[str]) -> list[str]:
        return self.cli.exclude_nodes(job_id, nodes)


__all__ = ["INSTALL_HINT", "PYSLURM_AVAILABLE", "PYSLURM_IMPORT_ERROR", "PyslurmSlurmClient"]
