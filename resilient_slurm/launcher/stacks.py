"""Stacks of rank processes from the outside: ``py-spy dump`` (Python and native frames, every thread,
nothing stopped for long), when py-spy is installed.

Who calls what: the launcher, for a hang (:func:`dump_rank_stacks`, which falls back to the ranks' own
dump signal, and asks the ranks on other nodes through Slurm) and for a start that failed
(:mod:`.startup`, before any rank could register the dump signal's handler, whose default action would
end the process). Each dump goes to
``<run dir>/stacks/rank<R>.py-spy.txt``, written atomically.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import time
from collections.abc import Mapping

from ..control.heartbeat import DUMP_SIGNAL, open_stack_file, stack_dump_path
from ..errors import ResilientSlurmError, SlurmError
from ..rundir import RunDir
from ..storage.fileio import atomic_write
from .context import LaunchContext, launch_log

log = logging.getLogger(__name__)

PYSPY_TIMEOUT_S = 30.0
STACK_DUMP_WAIT_S = 2.0  # after asking for the stacks, before the teardown


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


def dump_rank_stacks(ctx: LaunchContext, pids: Mapping[int, int]) -> list[str]:
    """Ask every rank for its stacks: py-spy for this node's ranks (``pids``, by rank) when installed, else
    the dump signal (faulthandler, registered by each Checkpointer), through Slurm for ranks on other
    nodes. Returns the files written on this node, into ``ctx.run_dir``."""
    exe = pyspy()
    asked = time.time()
    written = []
    for rank, pid in sorted(pids.items()):
        if exe and (dumped := pyspy_dump(pid, ctx.run_dir, rank, exe=exe)) is not None:
            written.append(dumped[0])
            continue
        # The rank appends its stacks to its file (faulthandler): a line before each dump tells one dump from
        # the next (a second hang after an in-job restart writes below the first).
        if (f := open_stack_file(ctx.run_dir, rank)) is not None:
            with f:
                f.write(f"\n--- stacks asked for by the launcher at {time.strftime('%Y-%m-%d %H:%M:%S')} "
                        f"(pid {pid}) ---\n")
        try:
            os.kill(pid, DUMP_SIGNAL)
        except ProcessLookupError:
            pass
    if ctx.srun and ctx.job_id and ctx.multi_node():
        try:
            ctx.slurm.signal(ctx.job_id, DUMP_SIGNAL)
        except SlurmError as exc:
            launch_log.warning("could not ask the ranks on other nodes for their stacks: %s", exc)
    time.sleep(STACK_DUMP_WAIT_S)  # faulthandler writes from the signal handler, at once
    stacks = RunDir.at(ctx.run_dir).stacks
    try:  # the files the ranks of this node wrote (a rank writes into its own node's run directory)
        written += sorted(e.path for e in os.scandir(stacks)
                          if e.name.endswith(".txt") and not e.name.endswith(".py-spy.txt")
                          and e.stat(follow_symlinks=False).st_mtime >= asked - 1)
    except OSError:
        pass
    return written


__all__ = ["STACK_DUMP_WAIT_S", "dump_rank_stacks", "pyspy", "pyspy_dump", "pyspy_path"]
