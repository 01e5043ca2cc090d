"""What every rank agrees on at a step boundary: is a save due, was an emergency save requested on any rank,
did a background save fail on any rank; with the launcher's hello and heartbeat, and straggler times riding
on the same agreement.

Who calls what, and when: the :class:`~resilient_slurm.checkpoint.checkpointer.Checkpointer` keeps one
:class:`StepBoundary` per rank. In each ``step()`` it calls :meth:`StepBoundary.enter`, then (after the
collective planning of the first save) :meth:`StepBoundary.decide`, and acts on the :class:`Decision`;
after a restore it calls :meth:`StepBoundary.restored`. Every ``sync_every`` steps ``decide`` runs one tiny
collective (a phase): time cadence, emergency requests and background failures are per-rank facts, and
acting on them must be unanimous. Between those steps only the deterministic step cadence applies.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..control.rank import RankLink
from ..sigsafe import WakeFlag
from .coordination import Coordinator
from .ddp import DDPTracker
from .policy import Cadence
from .reporting import CheckpointReporter
from .stragglers import RankStragglers


@dataclass(frozen=True)
class Decision:
    """What this step does, the same on every rank (``heard_*``: how this rank itself heard a request)."""

    due: bool
    emergency: bool
    failed: bool
    heard_here: bool
    heard_socket: bool
    manual: bool = False  # a tool asked for a save over a control socket (not an emergency: training goes on)


class StepBoundary:
    """One rank's side of the per-step agreement (see the module docstring)."""

    def __init__(self, coord: Coordinator, link: RankLink, cadence: Callable[[], Cadence], sync_every: int,
                 emergency: WakeFlag, ddp: DDPTracker, stragglers: RankStragglers | None,
                 report: CheckpointReporter) -> None:
        self._coord = coord
        self._link = link
        self._cadence = cadence  # the Checkpointer's public ``cadence``, read at each step (it may be replaced)
        self._sync_every = sync_every
        self._emergency = emergency
        self._ddp = ddp
        self._stragglers = stragglers
        self._report = report
        self.hello_sent = False
        self._steps_since_restore = 0

    def hello(self, step: int) -> None:
        self._link.hello(step)
        self.hello_sent = True

    def restored(self, step: int) -> None:
        """After a restore of ``step``: tell the launcher (if any)."""
        self._steps_since_restore = 0
        self.hello(step)

    def enter(self, step: int) -> None:
        """First thing in ``step()``: the launcher's heartbeat, and the hello of a single rank."""
        if self._link.heartbeat is not None:
            self._link.heartbeat.beat(step)  # about a microsecond: the launcher's hang detection
        if not self.hello_sent and not self._coord.multi:
            self.hello(0)
        self._steps_since_restore += 1
        if self._steps_since_restore == 2:
            self._ddp.close()  # a DDP that ran no forward by now is not in use: stop waiting for it

    def decide(self, step: int, save_failed: Callable[[], bool]) -> Decision:
        """This step's decision; ``save_failed``: whether this rank's save in flight has failed."""
        cadence = self._cadence()
        due = cadence.due(step)
        requested: str | None = None
        sync = step % self._sync_every == 0
        if sync and self.hello_sent:  # a poll registers: not before the hello
            requested = self._link.poll(step)  # a launcher's emergency request sets the emergency flag
        heard_socket = requested is not None
        manual = requested == "manual"
        emergency = heard_here = self._emergency.is_set()
        failed = save_failed()
        if self._coord.multi:
            if sync:
                # One tiny collective: time cadence, save requests and background failures are per-rank facts;
                # acting on them must be unanimous.
                flags = [int(due), int(emergency), int(failed), int(manual)]
                s = self._stragglers
                report = s is not None and s.clock.report_due()
                if s is not None and report:  # every rank alike: the count of step() calls is the same everywhere
                    flags += s.slots(self._ddp.gradient_wait_s(s.clock.window))
                agreed = self._coord.phase_max("agreeing on a save at this step", lambda: flags, len(flags))
                due, emergency, failed, manual = (bool(v) for v in agreed[:4])
                if s is not None and report and s.watch is not None:
                    new, current, cleared = s.judge(agreed[4:])
                    self._report.stragglers(step, s.watch, new, cleared)
                    s.record(step, current, changed=bool(new or cleared))
                if not self.hello_sent:
                    # After a collective: every rank has built its Checkpointer, so its signal traps are
                    # in place. The launcher takes a hello as "the save signal no longer kills a rank".
                    self.hello(0)
            else:  # between sync points only the deterministic step cadence applies
                due = cadence.every_steps is not None and step % cadence.every_steps == 0
                emergency = failed = manual = False
        return Decision(due, emergency, failed, heard_here, heard_socket, manual)
