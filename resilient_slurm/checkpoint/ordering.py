"""The order of a run's step numbers: no save at or below the run's history, no step number going back.

Who calls what, and when: the :class:`~resilient_slurm.checkpoint.checkpointer.Checkpointer` keeps one
:class:`StepOrder` per rank. It calls :meth:`StepOrder.restored` after a restore, :meth:`StepOrder.check`
in ``step()`` and ``save()`` before anything is saved (the first check on a rank that restored nothing
runs one collective, on every rank alike), and sets :attr:`StepOrder.saved_step` when a save is handed to
the writer. Every rank holds the same values (saves and restores are collective), so every rank refuses
alike.
"""

from __future__ import annotations

from ..errors import StepOrderError
from ..layout import list_run_dir
from .coordination import Coordinator


class StepOrder:
    """The floor below which no step is saved, and the newest step restored or saved here."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        # Newest step restored or handed to the writer. The same on every rank (saves are collective),
        # so an emergency request at that step is skipped by all ranks alike, never by some.
        self.saved_step: int | None = None
        # The run's history before this Checkpointer wrote: the step restored, else (found at the first
        # save) the newest step committed on any rank's node. A save at or below it is refused (check).
        self._floor: int | None = None
        self._floor_known = False
        self._floor_restored = False

    def restored(self, step: int) -> None:
        """After a restore of ``step`` (0: nothing restored)."""
        self._floor, self._floor_known, self._floor_restored = (step or None), True, bool(step)
        if step:
            self.saved_step = step

    def check(self, step: int, run_dir: str, coord: Coordinator) -> None:
        """Refuse (StepOrderError, on every rank alike) a save at or below the run's history before this
        Checkpointer (the step restored, else the newest committed step, agreed by one all_max at the first
        save), or below a step saved here: a program that restarted its own step counter would replace
        committed steps with another history, and retention would then delete the newest ones."""
        if not self._floor_known:
            try:
                committed = list_run_dir(run_dir).committed
            except OSError:
                committed = []
            newest = committed[-1] if committed else -1
            newest = coord.phase_max("agreeing on the newest committed step", lambda: [newest], 1)[0]
            self._floor, self._floor_known = (newest if newest >= 0 else None), True
        floor = self._floor
        if floor is not None and step <= floor:
            what = "resumed from" if self._floor_restored else "already has committed"
            raise StepOrderError(
                f"step {step} refused: run {self.run_id} {what} step {floor}, and a save at or below it "
                f"would replace that run's steps with another history. Number steps on from {floor} (the step "
                "restore() returned plus the steps trained since; a framework that restarts its own counter "
                "needs that offset), or give this run a new id (RSLURM_RUN_ID / --run-id)")
        own = self.saved_step
        if own is not None and (floor is None or own > floor) and step < own:
            raise StepOrderError(f"step {step} refused: run {self.run_id} already saved step {own}; step numbers "
                                 "must not go back (a save would replace a newer history's steps)")
