"""Stacks of rank processes from the outside: ``py-spy dump`` (Python and native frames, every thread,
nothing stopped for long), when py-spy is installed.

Who calls what: the launcher, for a hang (:meth:`~.launch.Launcher._dump_stacks`, which falls back to the
ranks' own dump signal) and for a start that failed (:mod:`.startup`, before any rank could register the
dump signal's handler, whose default action would end the process). Each dump goes to
``<run dir>/stacks/rank<R>.py-spy.txt``, written atomically.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess

from ..control.heartbeat import stack_dump_path
from ..errors import ResilientSlurmError
from ..storage.fileio import atomic_write

log = logging.getLogger(__name__)

PYSPY_TIMEOUT_S = 30.0


def pyspy() -> str | None:
    """The py-spy executable on PATH, or None when it is not installed."""
    return shutil.which("py-spy")


def pyspy_path(run_dir: str, rank: int) -> str:
    """Where rank ``rank``'s py-spy dump goes."""
    return stack_dump_path(run_dir, rank).replace(".txt", ".py-spy.txt")


def pyspy_dump(pid: int, run_dir: str, rank: int, *, exe: str | None = None) -> tuple[str, str] | None:
    """``py-spy dump --pid PID`` written to :func:`pyspy_path`; returns (path, text), or None (logged) when
    py-spy is missing or could not read the process (gone, no ptrace permission)."""
    exe = exe or pyspy()
    if exe is None:
        return None
    out = pyspy_path(run_dir, rank)
    try:
        r = subprocess.run([exe, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=PYSPY_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("py-spy dump of rank %d (pid %d): %s", rank, pid, exc)
        return None
    if r.returncode != 0:
        log.warning("py-spy dump of rank %d (pid %d) failed: %s", rank, pid, (r.stderr or r.stdout).strip()[-300:])
        return None
    try:
        # Below the local root: a run directory or stacks/ that is a link is never written through.
        atomic_write(out, r.stdout.encode(), root=os.path.dirname(os.path.normpath(run_dir)))
    except (OSError, ResilientSlurmError) as exc:
        log.warning("cannot write rank %d's stacks to %s: %s", rank, out, exc)
        return None
    return out, r.stdout


__all__ = ["pyspy", "pyspy_dump", "pyspy_path"]
