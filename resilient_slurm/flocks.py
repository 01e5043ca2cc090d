"""``flock`` locks that a forked child never keeps.

A ``flock`` belongs to the open file description, and ``fork()`` gives the child a copy of every
descriptor, close-on-exec or not. A child forked while another thread holds such a lock keeps the
description, and with it the lock, for as long as it lives, even after the parent has closed its own
descriptor. In a training process that is not hypothetical: a DataLoader forks its workers at every
epoch while the checkpoint writer thread may hold the run directory's tags lock (retention deleting an
old step); the worker then held the lock for the whole epoch, the next retention waited for it, the
step waited for the writer, and the epoch never ended (a hang found on the test cluster).

Every descriptor that rslurm locks with ``flock`` is opened through :func:`open_locked_fd` and closed
with :func:`close_locked_fd`: they are kept in one set, and a child closes them all right after the
fork (``os.register_at_fork``; a fork from Python, which is how ``multiprocessing`` and DataLoader
workers start). Opening and closing hold a lock that ``fork`` also takes, so no descriptor is copied
between its ``open`` and its registration. A process that forks and then execs needs none of this
(the descriptors are close-on-exec), and a fork made in C (outside Python) is not covered.

Who calls what: :mod:`~resilient_slurm.tags` (the tags lock), :mod:`~resilient_slurm.layout` (a step's
deletion lock), :mod:`~resilient_slurm.storage.fileio` (a reader's shared lock on a manifest) and
:mod:`~resilient_slurm.daemon.service` (the daemon's lock).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
from collections.abc import Callable, Iterator

_guard = threading.Lock()
_fds: set[int] = set()


def _before_fork() -> None:
    _guard.acquire()


def _after_fork_in_parent() -> None:
    _guard.release()


def _after_fork_in_child() -> None:
    for fd in _fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    _fds.clear()
    _guard.release()  # the forking thread took it, and it is the child's only thread


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                    after_in_child=_after_fork_in_child)


def open_locked_fd(opener: Callable[[], int]) -> int:
    """Call ``opener`` (which opens a descriptor and returns it, or raises) and register the descriptor,
    so that a child forked from now on does not keep it. Close it with :func:`close_locked_fd`."""
    with _guard:
        fd = opener()
        _fds.add(fd)
    return fd


def close_locked_fd(fd: int) -> None:
    """Close a descriptor from :func:`open_locked_fd` (which releases its lock)."""
    with _guard:
        _fds.discard(fd)
        os.close(fd)


def held_fds() -> frozenset[int]:
    """The registered descriptors (tests)."""
    with _guard:
        return frozenset(_fds)


def flock_within(fd: int, operation: int, timeout: float | None) -> bool:
    """``flock(fd, operation)``, waiting at most ``timeout`` seconds (None: for as long as it takes).
    False when the lock was not had in time; OSError as ``flock``."""
    if timeout is None:
        fcntl.flock(fd, operation)
        return True
    deadline = time.monotonic() + timeout
    delay = 0.001
    while True:
        try:
            fcntl.flock(fd, operation | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(delay, left))
        delay = min(delay * 2, 0.05)


@contextlib.contextmanager
def flocked(opener: Callable[[], int], operation: int, *, timeout: float | None = None) -> Iterator[int | None]:
    """Open with ``opener`` (see :func:`open_locked_fd`), take ``flock(operation)`` and yield the
    descriptor; yield None when ``timeout`` passed without the lock. The descriptor is closed (and the
    lock released) on the way out."""
    fd = open_locked_fd(opener)
    try:
        yield fd if flock_within(fd, operation, timeout) else None
    finally:
        close_locked_fd(fd)


__all__ = ["close_locked_fd", "flock_within", "flocked", "held_fds", "open_locked_fd"]
