"""A rank whose launcher died: it saves, then it is gone within a bound, however busy the machine is.

Nobody else bounds such a rank. The launcher would have given its ranks ``save_timeout`` for the emergency
save and ``term_grace`` to exit after the commit, then killed them; a launcher killed by SIGKILL or the OOM
killer does none of it, and its ranks got only PR_SET_PDEATHSIG's SIGTERM (which their Checkpointer turns
into an emergency save). On a busy node their exit alone (the interpreter's final garbage collection of a
large heap, torch's teardown) took 10 s at a load of 20 on two cores, and over a minute in a loaded CI run:
ranks that hold GPUs and the run's files that long block the next incarnation. Under srun, Slurm ends the
job's steps when the batch script (the launcher) ends; this is for local mode, where the ranks are the
launcher's own children.

Who calls what, and when:

1. The launcher, in local mode only (``rslurm launch -n N``: its ranks run on its host, in sessions of
   their own), sets :data:`LAUNCHER_PID_ENV` for its ranks.
2. The rank's :class:`~resilient_slurm.control.rank.RankLink` builds a :class:`LauncherWatch`
   (:meth:`LauncherWatch.from_env`, None when no launcher set the variable) and :meth:`~LauncherWatch.start`
   s it: a daemon thread that checks every :data:`CHECK_EVERY_S` whether that launcher still runs (the same
   pid with the same start time: pids are reused).
3. :meth:`LauncherWatch.saved` when an emergency checkpoint commits (the link's ``committed``).
4. Once the launcher is gone the thread calls ``on_gone`` (the Checkpointer asks for an emergency save,
   for a rank that heard no SIGTERM: a wrapper shell between the launcher and the rank got it, and writes
   a ``launcher_gone`` event) and gives the rank the launcher's own bounds: ``save_timeout`` for the save,
   ``term_grace`` after its commit. Past the bound it writes every thread's stack to the rank's stack file,
   calls ``on_timeout`` (an ``orphan_timeout`` event) and sends SIGKILL to the rank's process group (the
   session the launcher made for it: the rank and its DataLoader workers).
   Python threads stop running once the interpreter finalizes (where a rank spends most of a slow exit),
   so the bound is also armed with ``faulthandler.dump_traceback_later(..., exit=True)``, a C thread that
   writes the stacks and ends the process even then, :data:`BACKSTOP_S` later.
5. :meth:`LauncherWatch.stop` when the Checkpointer closes while the launcher still runs (nothing left to
   bound: a later death of the launcher ends the process by the default SIGTERM). Once the launcher is
   gone the watch outlives the Checkpointer: the bound covers the program's exit too.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from typing import IO

log = logging.getLogger(__name__)

LAUNCHER_PID_ENV = "RSLURM_LAUNCHER_PID"  # set by a local launcher for its ranks
CHECK_EVERY_S = 0.5
BACKSTOP_S = 2.0  # after the bound, the C-level backstop (the thread acts first while Python runs)


def process_start(pid: int) -> str | None:
    """When ``pid`` started (field 22 of /proc/<pid>/stat, clock ticks since boot), to tell a process from a
    later one with the same pid; "" where there is no /proc (then only the pid is checked); None when no
    such process runs."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    except OSError:
        if not os.path.isdir("/proc"):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return None
            except PermissionError:
                pass
            return ""
        return None
    # the command name (field 2) may hold spaces and parentheses: the fields after it follow its last ")"
    fields = data[data.rfind(b")") + 2:].split()
    if len(fields) < 20 or fields[0] == b"Z":  # a zombie has ended
        return None
    return fields[19].decode()


class LauncherWatch:
    """Watches the launcher of this rank and bounds the rank once it is gone (see the module docstring)."""

    def __init__(self, launcher_pid: int, *, save_timeout: float, term_grace: float,
                 on_gone: Callable[[int, float], None], on_timeout: Callable[[int, float], None],
                 stack_file: Callable[[], IO[str] | None] = lambda: None,
                 check_every: float = CHECK_EVERY_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.launcher_pid = launcher_pid
        self.save_timeout = save_timeout
        self.term_grace = term_grace
        self._on_gone = on_gone
        self._on_timeout = on_timeout
        self._stack_file = stack_file
        self._check_every = check_every
        self._clock = clock
        self._start = process_start(launcher_pid)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._saved_at: float | None = None
        self._gone_at: float | None = None
        self._deadline: float | None = None
        self._file: IO[str] | None = None
        self._thread: threading.Thread | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str], **kw: object) -> LauncherWatch | None:
        """The watch of the launcher named in ``env`` (:data:`LAUNCHER_PID_ENV`); None when none is (not
        under a local launcher) or the value is not a pid."""
        value = env.get(LAUNCHER_PID_ENV, "").strip()
        if not value.isdigit() or int(value) <= 1:
            if value:
                log.warning("%s=%r is not a process id; this rank does not watch its launcher", LAUNCHER_PID_ENV,
                            value)
            return None
        return cls(int(value), **kw)  # type: ignore[arg-type]

    @property
    def gone(self) -> bool:
        """True once the launcher was found gone."""
        return self._gone_at is not None

    @property
    def deadline(self) -> float | None:
        """When this rank is ended (``clock`` time), once the launcher is gone."""
        return self._deadline

    def start(self) -> LauncherWatch:
        """Start the watching thread (a daemon: it never keeps the program alive)."""
        if self._start is None:  # gone before this rank looked: it is an orphan from the start
            self._found_gone()
        self._thread = threading.Thread(target=self._run, name="rslurm-launcher-watch", daemon=True)
        self._thread.start()
        return self

    def saved(self) -> None:
        """An emergency checkpoint committed: from now on (or from the launcher's end, if later) the rank
        has ``term_grace`` seconds to exit."""
        with self._lock:
            now = self._clock()
            self._saved_at = now
            if self._gone_at is not None:
                self._arm(min(self._deadline or now + self.term_grace, now + self.term_grace))

    def stop(self) -> None:
        """Stop watching, unless the launcher is gone (then the bound stays: see the module docstring). It
        looks once more first: a rank that saved on the launcher's SIGTERM closes before the thread's next
        look, and its exit is what must be bounded."""
        if not self.check():
            self._stop.set()

    def check(self) -> bool:
        """Look once: True when the launcher is gone (``on_gone`` is then called, once)."""
        if self._gone_at is None and process_start(self.launcher_pid) != self._start:
            self._found_gone()
        return self._gone_at is not None

    # ------------------------------------------------------------------ internals
    def _found_gone(self) -> None:
        with self._lock:
            if self._gone_at is not None:
                return
            now = self._gone_at = self._clock()
            bound = self.term_grace if self._saved_at is not None else self.save_timeout + self.term_grace
            self._arm(now + bound)
        log.error("the launcher of this rank (pid %d) is gone: saving and exiting within %.0f s (save_timeout + "
                  "term_grace, or term_grace once the emergency checkpoint is committed); past that the rank and "
                  "its child processes are killed", self.launcher_pid, bound)
        try:
            self._on_gone(self.launcher_pid, bound)
        except Exception as exc:  # the bound matters more than the report
            log.warning("reporting the lost launcher failed: %s", exc)

    def _arm(self, deadline: float) -> None:
        """Set the bound (called with the lock held), and the C-level backstop that outlives Python threads."""
        self._deadline = deadline
        if self._file is None:
            self._file = self._stack_file()
        try:
            faulthandler.dump_traceback_later(max(0.0, deadline - self._clock()) + BACKSTOP_S, exit=True,
                                              file=self._file if self._file is not None else 2)
        except (OSError, ValueError, RuntimeError) as exc:
            log.warning("cannot arm the backstop of the orphan bound: %s", exc)

    def _run(self) -> None:
        wait = self._check_every
        while not self._stop.wait(wait):
            wait = self._check_every
            if not self.check():
                continue
            deadline = self._deadline
            if deadline is not None:
                left = deadline - self._clock()
                if left <= 0:
                    self._end()
                    return
                wait = min(wait, left)

    def _end(self) -> None:
        """The bound passed: stacks, the report, then SIGKILL to the rank's process group."""
        bound = (self._deadline or 0.0) - (self._gone_at or 0.0)
        if self._file is not None:
            try:
                self._file.write(f"--- rank ended {bound:.0f} s after its launcher (pid {self.launcher_pid}) was "
                                 f"found gone, at {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
                self._file.flush()
                faulthandler.dump_traceback(file=self._file, all_threads=True)
            except (OSError, ValueError):
                pass
        try:
            self._on_timeout(self.launcher_pid, bound)
        except Exception as exc:
            log.warning("reporting the orphan bound failed: %s", exc)
        # The rank's own process group when the launcher made a session for it (each local rank has one):
        # the rank, a wrapper shell, its DataLoader workers. Else the rank alone.
        if os.getpgrp() == os.getsid(0):
            os.killpg(os.getpgrp(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)


__all__ = ["BACKSTOP_S", "CHECK_EVERY_S", "LAUNCHER_PID_ENV", "LauncherWatch", "process_start"]
