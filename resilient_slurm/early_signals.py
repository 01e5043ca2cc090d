"""The launcher's stop signals trapped first, before the CLI and the launcher are imported.

``rslurm launch`` must not die of a stop signal in its first instants: Slurm may send ``--signal`` up to
60 s before the time asked for, so a short job can get its time-limit USR1 while the launcher starts, and
a preemption can come at any moment. Before anything else is imported (the CLI and the launcher take a
few hundred milliseconds, seconds on a busy node), :func:`trap_early` installs handlers, standard library
only, that record each signal; :class:`~resilient_slurm.launcher.signals.SignalTrap` takes them over when
the launcher installs its own (:func:`take_early`). Called by the console scripts (:mod:`resilient_slurm.entry`)
and, for ``python -m resilient_slurm.cli launch``, at the top of the CLI module; the same for the drain daemon
a launcher starts (``python -m resilient_slurm.cli daemon --job-step``), whose own handlers take them over in
the same way. Other commands keep the default handlers. Standard library only, imported by nothing of the product but those and the trap.
"""

from __future__ import annotations

import signal
import time
from types import FrameType
from typing import Any

# What the launcher traps (design.md): preemption and time-limit signals, Ctrl-C, and SIGHUP (the terminal of
# a local run went away), which would otherwise end the launcher and orphan its ranks.
TRAPPED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT, signal.SIGHUP)

_early: list[tuple[int, float]] = []  # (signal, epoch seconds) heard before the launcher's own trap
_previous: dict[int, Any] = {}  # the handlers trap_early replaced


def _record(signum: int, frame: FrameType | None) -> None:
    _early.append((signum, time.time()))  # list.append: atomic, no lock (async-signal-safe enough for CPython)


def trap_early() -> None:
    """Record :data:`TRAPPED` signals until the launcher's trap takes them (main thread only); again: nothing."""
    for sig in TRAPPED:
        prev = signal.signal(sig, _record)
        if prev is not _record:
            _previous[sig] = prev


def release_early() -> None:
    """Put back the handlers :func:`trap_early` replaced where its own is still in place (the launcher's trap
    restores it when it ends), and forget what it heard: the end of an in-process ``rslurm launch``."""
    for sig, prev in _previous.items():
        if signal.getsignal(sig) is _record:
            signal.signal(sig, prev)
    _previous.clear()
    _early.clear()


def take_early() -> list[tuple[int, float]]:
    """The signals recorded so far, oldest first, forgotten here (called once the launcher's trap is in)."""
    taken = []
    while _early:
        taken.append(_early.pop(0))
    return taken


def _command(argv: list[str]) -> str | None:
    """The command of ``argv`` (after the program name): its first word after ``[--config FILE |
    --config=FILE]``, ``--config`` as argparse takes it abbreviated (``--conf``)."""
    i = 0
    while i < len(argv) and len(argv[i].split("=", 1)[0]) > 2 and "--config".startswith(argv[i].split("=", 1)[0]):
        i += 1 if "=" in argv[i] else 2
    return argv[i] if i < len(argv) else None


def is_launch(argv: list[str]) -> bool:
    """``argv`` (after the program name) is ``[--config FILE | --config=FILE] launch ...``."""
    return _command(argv) == "launch"


def is_job_daemon(argv: list[str]) -> bool:
    """``argv`` is the drain daemon a launcher starts (``daemon ... --job-step``): the launcher stops it with
    SIGINT, which may come while it still imports (a job that ended at once); heard early, it ends the daemon
    quietly (daemon/service.py: ``Daemon.run`` takes it), not with a KeyboardInterrupt traceback in the job's
    output under the program's own error."""
    return _command(argv) == "daemon" and "--job-step" in argv
