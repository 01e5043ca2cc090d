"""Signal traps for the launcher: handlers only record what arrived; the main loop acts on it.

Who calls what, and when: the launcher builds one ``SignalTrap`` before it starts the ranks,
:meth:`SignalTrap.install` s it on the main thread, calls :meth:`SignalTrap.wait` in its loop (which
wakes on a signal, a :meth:`SignalTrap.notify` from another thread such as the cloud watcher, or the
timeout) and :meth:`SignalTrap.pop` to take the events, and :meth:`SignalTrap.restore` at the end. At its
start it calls :func:`warn_if_not_exec`: a launcher the batch script did not ``exec`` never hears a
``--signal=B:...`` signal.
"""

from __future__ import annotations

import os
import signal
import time
from collections import deque
from dataclasses import dataclass
from types import FrameType
from typing import Any

import psutil

from ..early_signals import TRAPPED, take_early
from ..sigsafe import WakeFlag
from .context import launch_log


@dataclass(frozen=True)
class TrapEvent:
    """One thing that asks the launcher to stop: a signal name (``SIGTERM``...) or another ``source``
    (``cloud``; ``slurm``: the health check found Slurm preempting or ending the job), when it arrived
    (epoch seconds), and an optional deadline it announced."""

    source: str
    at: float
    deadline: float | None = None


class SignalTrap:
    """Records trapped signals and notifications; thread-safe, async-signal-safe enough for CPython
    (a handler appends to a deque and sets a :class:`~resilient_slurm.sigsafe.WakeFlag`; never a lock)."""

    def __init__(self, signals: tuple[signal.Signals, ...] = TRAPPED) -> None:
        self._signals = signals
        self._events: deque[TrapEvent] = deque()
        self._wake = WakeFlag()
        self._previous: dict[int, Any] = {}

    def install(self) -> SignalTrap:
        """Install the handlers (main thread only); a second call does nothing."""
        if self._previous:
            return self
        for sig in self._signals:
            self._previous[sig] = signal.signal(sig, self._handler)
        # What the console script's early handlers heard while the CLI and the launcher were imported
        # (resilient_slurm/early_signals.py): taken after this trap is in, so none falls between the two.
        early = take_early()
        for signum, at in early:
            self._events.append(TrapEvent(signal.Signals(signum).name, at))
        if early:
            self._wake.set()
        return self

    def restore(self) -> None:
        """Put back the handlers that were there before :meth:`install`."""
        for sig, prev in self._previous.items():
            signal.signal(sig, prev)
        self._previous.clear()

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        self._events.append(TrapEvent(signal.Signals(signum).name, time.time()))
        self._wake.set()

    def notify(self, source: str, deadline: float | None = None) -> None:
        """Record a stop request from another thread (e.g. a cloud termination notice)."""
        self._events.append(TrapEvent(source, time.time(), deadline))
        self._wake.set()

    def wait(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds for an event; True if one is pending."""
        if self._events:
            return True
        self._wake.wait(timeout)
        self._wake.clear()
        return bool(self._events)

    def pending(self) -> bool:
        """Whether an event waits to be taken (:meth:`pop`); takes nothing."""
        return bool(self._events)

    def pop(self) -> list[TrapEvent]:
        """Take every pending event, oldest first."""
        out = []
        while self._events:
            out.append(self._events.popleft())
        return out


def warn_if_not_exec(job_id: str | None) -> None:
    """``--signal=B:...`` reaches the batch shell only: a launcher under it never hears the signal."""
    if not job_id:
        return
    try:
        parent = psutil.Process(os.getppid()).cmdline()
    except (psutil.Error, OSError):
        return
    if any(os.path.basename(a) == "slurm_script" for a in parent):
        launch_log.warning("rslurm launch runs as a child of the batch script: a `--signal=B:...` signal reaches "
                           "the shell, not rslurm. Start it with `exec rslurm launch ...` (or `exec rsrun ...`)")
