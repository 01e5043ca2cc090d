"""The in-process tier, `make check`: tests that start no process of their own, in a few minutes.

`make check` runs ``pytest -m "not proc and not slow"`` with ``RSLURMTEST_CHECK=1``. In that mode
:func:`install` makes every process start in the test process fail the test at once, naming the command,
unless the program is one of :data:`CHEAP` (git, which provenance runs, and the like). A test that starts
ranks, a launcher, an interpreter, a Slurm command or a server process is marked ``proc`` (per test, or
``pytestmark`` for a file); the guard is what keeps the mark honest: a test that starts one without it fails
`make check` with a message that says to mark it. `make test` runs everything, marks or not.
"""

from __future__ import annotations

import multiprocessing.util
import os
import subprocess
from collections.abc import Sequence
from typing import Any

ENV = "RSLURMTEST_CHECK"
#: Programs a test of the in-process tier may run: quick, and no interpreter behind them. ``fc-list``:
#: matplotlib (imported with lightning) lists the system's fonts on its first import on a fresh machine.
CHEAP = frozenset({"git", "df", "sync", "true", "false", "id", "hostname", "uname", "nproc", "stat", "ls",
                   "chmod", "mount", "umount", "findmnt", "lsblk", "getconf", "fc-list"})


class ProcessInCheckTier(BaseException):  # noqa: N818 - not an Exception, so no `except Exception` hides it
    """A test of the in-process tier started a process."""


def _refuse(what: str) -> None:
    if log := os.environ.get(ENV + "_LOG"):  # which test started what: for marking a file's tests at once
        with open(log, "a") as f:
            f.write(f"{os.environ.get('PYTEST_CURRENT_TEST', '?')}\t{what[:300]}\n")
    raise ProcessInCheckTier(
        f"this test starts a process ({what}) but is not marked `proc`: mark it @pytest.mark.proc (or set "
        "pytestmark in its file) so that `make check` leaves it to `make test`")


def _program(args: Any) -> str:
    if isinstance(args, (str, bytes, os.PathLike)):
        first = os.fsdecode(args).split()[0] if os.fsdecode(args).split() else ""
    else:
        first = os.fsdecode(list(args)[0]) if list(args) else ""
    return os.path.basename(first)


def install() -> None:
    """Refuse process starts in this (the pytest) process: subprocess, multiprocessing's spawn and
    forkserver, and os.fork (multiprocessing's fork, DataLoader workers)."""
    orig_execute = subprocess.Popen._execute_child  # type: ignore[attr-defined]

    def execute_child(self: subprocess.Popen[Any], args: Sequence[str] | str, *rest: Any, **kw: Any) -> Any:
        if _program(args) not in CHEAP:  # with shell=True, the command line's first word
            _refuse(" ".join(map(str, args)) if not isinstance(args, str) else args)
        return orig_execute(self, args, *rest, **kw)

    subprocess.Popen._execute_child = execute_child  # type: ignore[attr-defined]

    def spawnv_passfds(path: str, args: Sequence[str], passfds: Sequence[int]) -> int:
        _refuse(f"multiprocessing: {' '.join(map(str, args))[:200]}")
        raise AssertionError  # unreachable

    multiprocessing.util.spawnv_passfds = spawnv_passfds  # type: ignore[assignment]

    def fork() -> int:
        _refuse("os.fork")
        raise AssertionError  # unreachable

    os.fork = fork
