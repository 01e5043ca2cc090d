"""Progress heartbeats: each rank's step and time in a shared-memory record its node's launcher reads.

Who calls what, and when:

1. The rank's :class:`~resilient_slurm.checkpoint.checkpointer.Checkpointer` builds a
   :class:`HeartbeatWriter` next to the node's control socket (``<socket>.hb.<rank>``, in the launcher's
   0700 runtime directory) when the launcher published one, in section ``startup``.
2. ``writer.beat(step)`` at every ``ckpt.step()``: one ``struct.pack_into`` into a mapped page, no system
   call, no lock (about a microsecond; measured in docs/benchmarks.md). ``writer.section(name, timeout)``
   around phases with their own time limit (``restore``, a blocking ``save``, the program's ``eval``).
3. The launcher's :class:`~resilient_slurm.launcher.hang.HangWatch` lists and reads the records of its
   job (:func:`read_heartbeats`) about once a second.

A record is 128 bytes: a sequence number (odd while the writer is mid-update, so a reader retries), the
pid, the step (-1 before the first ``step()``), the time of the last beat and of the last change of
section, the section's own timeout (0: none) and its name. Standard library only: the launcher imports
this without torch.
"""

from __future__ import annotations

import errno
import faulthandler
import mmap
import os
import signal
import struct
import time
from dataclasses import dataclass
from typing import IO

from ..errors import ConfigError
from ..paths import open_regular
from ..rundir import STACKS_DIR as STACKS_DIR  # re-exported: the launcher reads the stacks
from ..rundir import RunDir

RECORD = struct.Struct("<qqqdddd16s")  # seq, pid, step, beat_t, section_t, section_timeout, step_t, name
SIZE = 128
assert RECORD.size <= SIZE
SUFFIX = ".hb."
_SEQ = struct.Struct("<q")


def heartbeat_path(socket_path: str, rank: int) -> str:
    """Where rank ``rank`` of the job whose node socket is ``socket_path`` keeps its record."""
    return f"{socket_path}{SUFFIX}{rank}"


@dataclass(frozen=True)
class Heartbeat:
    """One rank's last record, as read by the launcher."""

    rank: int
    pid: int
    step: int               # -1: no step() yet
    beat_t: float           # time.time() of the last write (a beat, or a section entered or left)
    section: str            # "" outside a section; "startup" until the first step()
    section_t: float        # when that section began
    section_timeout: float  # the section's own limit in seconds (0: the general hang timeout)
    step_t: float = 0.0     # time.time() of the beat that recorded ``step`` (0: no step yet)

    @property
    def reached_t(self) -> float:
        """When ``step`` was reached: its beat, not a later section change (a record of an older writer,
        without it: the last write)."""
        return self.step_t or self.beat_t


class HeartbeatWriter:
    """The rank's end: a mapped 128-byte record it updates in place."""

    def __init__(self, path: str) -> None:
        self.path = path
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, SIZE)
            self._mm = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)
        self._seq = 0
        self._pid = os.getpid()
        self._step = -1
        self._step_t = 0.0
        self._section = b"startup"
        self._section_t = time.time()
        self._section_timeout = 0.0
        self._write(self._section_t)

    def _write(self, now: float) -> None:
        # A seqlock: odd while the body changes. The body is packed aside and copied in (struct.pack_into
        # would zero the whole record first, which a reader could take for a finished one with seq 0).
        mm = self._mm
        body = RECORD.pack(0, self._pid, self._step, now, self._section_t, self._section_timeout, self._step_t,
                           self._section)
        self._seq += 1
        mm[0:8] = _SEQ.pack(self._seq)  # odd: being written (an aligned 8-byte store)
        mm[8:RECORD.size] = body[8:]
        self._seq += 1
        mm[0:8] = _SEQ.pack(self._seq)

    def beat(self, step: int) -> None:
        """Record that ``step`` steps are done (called by ``ckpt.step()``); ends the ``startup`` section."""
        now = time.time()
        self._step, self._step_t = step, now
        if self._section == b"startup":
            self._section, self._section_timeout = b"", 0.0
        self._write(now)

    def section(self, name: str, timeout: float | None = None) -> tuple[bytes, float, float]:
        """Enter section ``name`` (``""``: leave it) with its own time limit in seconds (None: the general
        one). Returns the section left, for :meth:`resume`."""
        now = time.time()
        prev = (self._section, self._section_t, self._section_timeout)
        self._section = name.encode("utf-8", "replace")[:16]
        self._section_t = now
        self._section_timeout = float(timeout or 0.0)
        self._write(now)
        return prev

    def resume(self, prev: tuple[bytes, float, float]) -> None:
        """Go back to the section :meth:`section` left (its clock keeps running from when it began)."""
        self._section, self._section_t, self._section_timeout = prev
        self._write(time.time())

    def close(self, *, remove: bool = True) -> None:
        """Unmap the record and, by default, remove it (a rank that ends on its own is not hung)."""
        try:
            self._mm.close()
        except (ValueError, BufferError):
            pass
        if remove:
            try:
                os.unlink(self.path)
            except OSError:
                pass


# --------------------------------------------------------------------------------------- stack dumps
#: The signal that makes a rank write every thread's Python stack (faulthandler) to its stack file. A
#: real-time signal no library here uses; its default action ends a process that did not register it,
#: which only happens when the launcher is about to tear the ranks down anyway.
DUMP_SIGNAL = signal.SIGRTMIN + 4


def stack_dump_path(run_dir: str, rank: int) -> str:
    """Where rank ``rank`` writes its stacks when asked (``<run dir>/stacks/rank<r>.txt``)."""
    return RunDir.at(run_dir).stack_file(rank)


def register_stack_dump(run_dir: str, rank: int) -> IO[str] | None:
    """Make :data:`DUMP_SIGNAL` write this process's stacks (all threads) to :func:`stack_dump_path`; the
    returned file must stay open. None (and nothing changed) when the program handles that signal itself
    or the file cannot be opened."""
    if signal.getsignal(DUMP_SIGNAL) not in (signal.SIG_DFL, None):
        return None
    f = open_stack_file(run_dir, rank)
    if f is not None:
        faulthandler.register(DUMP_SIGNAL, file=f, all_threads=True, chain=False)
    return f


def open_stack_file(run_dir: str, rank: int) -> IO[str] | None:
    """:func:`stack_dump_path` opened for appending (made with its directory when missing), or None when it
    cannot be. Never through a link at the run directory, ``stacks/`` or the file (paths.open_regular)."""
    try:
        fd = open_regular(stack_dump_path(run_dir, rank), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600,
                          root=os.path.dirname(os.path.abspath(run_dir)), make_dirs=True)
    except (OSError, ConfigError):
        return None
    return os.fdopen(fd, "a")


def unregister_stack_dump(f: IO[str] | None) -> None:
    if f is not None:
        faulthandler.unregister(DUMP_SIGNAL)
        f.close()


def clear_heartbeats(socket_path: str) -> int:
    """Remove every rank record of the job whose node socket is ``socket_path`` (the launcher does, before
    it starts ranks: records of ranks that were killed stay behind). Returns how many were removed."""
    d, base = os.path.split(socket_path)
    prefix = base + SUFFIX
    n = 0
    try:
        names = os.listdir(d or ".")
    except OSError:
        return 0
    for name in names:
        if name.startswith(prefix) and name[len(prefix):].isdigit():
            try:
                os.unlink(os.path.join(d, name))
                n += 1
            except OSError:
                pass
    return n


def _read_one(path: str, rank: int) -> Heartbeat | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not os.path.samestat(os.fstat(fd), os.lstat(path)) or os.fstat(fd).st_size < SIZE:
            return None
        for _ in range(5):  # a writer mid-update: read again
            data = os.pread(fd, SIZE, 0)
            if len(data) < RECORD.size:
                return None
            seq, pid, step, beat_t, section_t, section_timeout, step_t, name = RECORD.unpack_from(data)
            if seq > 0 and seq % 2 == 0 and _SEQ.unpack(os.pread(fd, 8, 0))[0] == seq:
                return Heartbeat(rank, pid, step, beat_t, name.rstrip(b"\0").decode("utf-8", "replace"),
                                 section_t, section_timeout, step_t)
        return None
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ESTALE):
            return None
        raise
    finally:
        os.close(fd)


def read_heartbeats(socket_path: str) -> dict[int, Heartbeat]:
    """Every rank record of the job whose node socket is ``socket_path``, by rank (unreadable ones left out)."""
    d, base = os.path.split(socket_path)
    prefix = base + SUFFIX
    out: dict[int, Heartbeat] = {}
    try:
        names = os.listdir(d or ".")
    except OSError:
        return out
    for n in names:
        if n.startswith(prefix) and n[len(prefix):].isdigit():
            rank = int(n[len(prefix):])
            hb = _read_one(os.path.join(d, n), rank)
            if hb is not None:
                out[rank] = hb
    return out


__all__ = ["DUMP_SIGNAL", "Heartbeat", "clear_heartbeats", "HeartbeatWriter", "heartbeat_path", "open_stack_file",
           "read_heartbeats", "register_stack_dump",
           "stack_dump_path", "unregister_stack_dump"]
