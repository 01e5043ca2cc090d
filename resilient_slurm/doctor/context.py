"""What ``rslurm doctor``'s checks share: the finding they report and the context they read.

Call order: :func:`resilient_slurm.doctor.run_checks` builds one :class:`DoctorContext` (settings
resolved, where we are, a Slurm client when the tools are installed), then calls each group's check
function in turn (:mod:`.script`, :mod:`.cluster`, :mod:`.storage`, :mod:`.probe`). Each
returns :class:`Finding` rows and may leave figures in :attr:`DoctorContext.facts` for later groups
(the signal's lead time for the bandwidth cross-check, for instance). Everything runs in one thread;
nothing here is shared across processes.
"""

from __future__ import annotations

import enum
import logging
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..config import Settings
from ..errors import SlurmError
from ..slurm import CliSlurmClient, JobInfo

log = logging.getLogger(__name__)


class Status(str, enum.Enum):
    """How a check went. Only FAIL makes ``rslurm doctor`` exit 1."""

    OK = "OK"
    WARN = "WARN"
    FAIL = "FAIL"
    SKIP = "SKIP"


@dataclass
class Finding:
    """One row of the report: which check, how it went, what was found, and what to do about it."""

    check: str                       # "script.signal": group, dot, name
    status: Status
    finding: str                     # one line: what was seen, with the values that matter
    fix: str = ""                    # what to do (empty when nothing needs doing)
    details: dict[str, Any] = field(default_factory=dict)  # figures for --json

    @property
    def group(self) -> str:
        """The check's group (``script``, ``cluster``, ``local``, ``durable``, ``signals``, ``where``)."""
        return self.check.split(".", 1)[0]

    def to_json(self) -> dict[str, Any]:
        """The row as a JSON-able dict."""
        return {"check": self.check, "group": self.group, "status": self.status.value,
                "finding": self.finding, "fix": self.fix, "details": self.details}


@dataclass
class DoctorOptions:
    """What the user asked for on the command line (beyond the settings)."""

    script: str | None = None            # --script FILE
    job_id: str | None = None            # --job ID (default: $SLURM_JOB_ID inside an allocation)
    sbatch_args: tuple[str, ...] = ()    # options given to sbatch on its command line (after --)
    nccl: bool | None = None             # --nccl / --no-nccl; None = detect
    bandwidth_size: int = 256 << 20      # bytes written to measure the local dir; 0 = do not measure
    checkpoint_size: int | None = None   # bytes one node writes per checkpoint, if the user knows
    signal_timeout: float = 15.0         # seconds for every probe to report the signal after scancel
    probe_start_timeout: float = 60.0    # seconds for every probe task to start and report ready
    durable_timeout: float = 60.0        # seconds for the whole durable-tier probe
    skip: frozenset[str] = frozenset()   # checks and groups not to run (--skip)


@dataclass
class DoctorContext:
    """Everything the checks read, gathered once."""

    cfg: Settings                        # resolved settings (config.load)
    env: Mapping[str, str]
    options: DoctorOptions
    node: str                            # this node's name (what %n expands to)
    local_dir: str                       # expanded node-local root
    job_id: str | None                   # the job inspected (own allocation or --job)
    in_allocation: bool                  # this process runs inside that job's allocation
    slurm: CliSlurmClient | None = None  # None when the Slurm client tools are not installed
    local_dir_problem: str | None = None  # why the default local directory is refused (a local.dir FAIL)
    facts: dict[str, Any] = field(default_factory=dict)
    _job: JobInfo | None = None
    _job_error: str | None = None
    _config: dict[str, str] | None = None
    _config_error: str | None = None

    @property
    def slurm_tools(self) -> bool:
        """scontrol is on PATH."""
        return self.slurm is not None

    def job(self) -> JobInfo | None:
        """The inspected job's record (read once), None outside a job or when Slurm cannot say."""
        if self._job is None and self._job_error is None and self.job_id and self.slurm is not None:
            try:
                self._job = self.slurm.job_info(self.job_id)
            except SlurmError as exc:
                self._job_error = one_line(str(exc))
                log.warning("cannot read job %s: %s", self.job_id, exc)
        return self._job

    @property
    def job_error(self) -> str | None:
        """Why :meth:`job` returned None, if Slurm was asked."""
        return self._job_error

    def slurm_config(self) -> dict[str, str] | None:
        """``scontrol show config`` (read once); None when Slurm cannot be asked (see
        :attr:`config_error`)."""
        if self._config is None and self._config_error is None:
            if self.slurm is None:
                self._config_error = "the Slurm client tools (scontrol) are not on PATH"
            else:
                try:
                    self._config = self.slurm.config()
                except SlurmError as exc:
                    self._config_error = one_line(str(exc))
        return self._config

    @property
    def config_error(self) -> str | None:
        """Why :meth:`slurm_config` returned None."""
        return self._config_error


def one_line(text: str, limit: int = 400) -> str:
    """A message for one table cell: whitespace collapsed, cut at ``limit`` characters."""
    s = " ".join(text.split())
    return s if len(s) <= limit else s[: limit - 3] + "..."


def make_slurm_client(env: Mapping[str, str]) -> CliSlurmClient | None:
    """A Slurm client for the doctor: short timeouts and a single retry, since a diagnosis should answer
    quickly; None when scontrol is not installed."""
    if shutil.which("scontrol", path=env.get("PATH", os.defpath)) is None:
        return None
    return CliSlurmClient(timeout=10.0, retries=1, env=env)


__all__ = ["DoctorContext", "DoctorOptions", "Finding", "Status", "make_slurm_client", "one_line"]
