"""What the launcher's parts read of the launcher: its settings, its job, the Slurm client, the event log and
the timings of the incarnation, as one narrow interface (:class:`LaunchContext`), and the one logger every
part of the launcher writes to.

Who calls what: :class:`~.launch.Launcher` is the one :class:`LaunchContext`; it hands itself to the parts
it calls (:mod:`.stopping`, :mod:`.restart`, :mod:`.outcome`, :mod:`.requeue`, the durability wait, the
health gate), which read it and never import the launcher. Their log lines keep the launcher's logger name
(``resilient_slurm.launcher.launch``), so an incarnation's lines read as one source whichever part wrote them.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from ..config import Settings
from ..slurm import JobInfo, SlurmClient
from ..telemetry import Event, EventLog

# Every line of ``rslurm launch``, whichever module of the launcher writes it.
launch_log = logging.getLogger("resilient_slurm.launcher.launch")


class LaunchContext(Protocol):
    """The launcher as its parts see it (implemented by :class:`~.launch.Launcher`)."""

    cfg: Settings
    env: dict[str, str]  # the launcher's environment, which the ranks inherit (it may change during a run)
    command: list[str]  # the ranks' command (an srun command less the nodes the health gate took out)
    job_id: str | None  # None outside Slurm (a local run)
    srun: bool  # the ranks run as one srun job step
    node: str
    run_id: str
    run_dir: str
    restart_count: int
    events: EventLog
    timings: dict[str, float]  # when each stage of the incarnation happened (epoch seconds)

    @property
    def slurm(self) -> SlurmClient: ...

    def job_info(self) -> JobInfo | None:
        """The job as Slurm sees it now; None outside Slurm or when Slurm does not answer."""

    def multi_node(self) -> bool:
        """True when ranks may run on other nodes."""

    def event(self, kind: Event, **fields: Any) -> None:
        """Append an event with ``source: launcher`` to the run's event log."""


__all__ = ["LaunchContext", "launch_log"]
