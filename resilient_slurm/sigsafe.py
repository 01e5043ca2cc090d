"""A flag that signal handlers set and threads wait on: :class:`WakeFlag`, with no lock on the setting side.

A Python signal handler runs in the main thread, between two bytecodes of whatever that thread was doing.
``threading.Event.set()`` takes the lock of the Event's Condition; if the signal arrives while the main
thread holds that lock (inside ``set()``, ``wait()`` or ``clear()`` of the same Event, or inside a handler
that was itself in ``set()`` when the next signal came), ``set()`` waits forever for a lock its own thread
holds, and every other thread that sets the Event waits behind it. Seen in a rank whose launcher was
killed: SIGTERM (PR_SET_PDEATHSIG) and the save signal arrived one after the other, the main thread hung
in the second handler's ``Event.set()`` nested in the first's, and the rank's launcher watch, setting the
same Event, hung behind it (only the watch's C-level backstop ended the rank, without its report).

:class:`WakeFlag` sets a plain attribute and writes a byte to a non-blocking pipe (``os.write``: no Python
lock, and a full pipe already holds a wake-up); :meth:`WakeFlag.wait` selects on the pipe. Used by every
handler the product installs that something waits on: a rank's save and stop signals
(checkpoint/checkpointer.py through control/rank.py), the launcher's trap (launcher/signals.py), the
daemon's stop (daemon/service.py). The console script's early trap (early_signals.py) only appends to a
list that nothing waits on; the trap that takes over from it wakes itself for what it finds there.
"""

from __future__ import annotations

import os
import select


class WakeFlag:
    """``set()`` from a signal handler or any thread; ``is_set()``, ``wait(timeout)`` and ``clear()`` from
    threads. ``wait`` returns True as soon as the flag is set (or is already). :meth:`close` releases the
    pipe; a closed flag still sets and reads, it no longer wakes a waiter before its timeout."""

    __slots__ = ("_flag", "_r", "_w")

    def __init__(self) -> None:
        self._flag = False
        self._r, self._w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def set(self) -> None:
        self._flag = True
        try:
            os.write(self._w, b"\0")
        except OSError:  # full (a wake-up is pending already) or closed
            pass

    def is_set(self) -> bool:
        return self._flag

    def clear(self) -> None:
        self._flag = False
        try:
            while os.read(self._r, 4096):
                pass
        except OSError:  # drained (EAGAIN) or closed
            pass

    def wait(self, timeout: float | None = None) -> bool:
        if self._flag:
            return True
        try:
            select.select([self._r], [], [], timeout)  # retried on EINTR with the time left (PEP 475)
        except (OSError, ValueError):  # closed
            pass
        return self._flag

    def close(self) -> None:
        for fd in (self._r, self._w):
            try:
                os.close(fd)
            except OSError:
                pass
        self._r = self._w = -1

    def __del__(self) -> None:
        if getattr(self, "_r", -1) >= 0:
            self.close()


__all__ = ["WakeFlag"]
