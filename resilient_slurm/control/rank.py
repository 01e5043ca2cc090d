"""The rank's end of the launcher link: signal traps and the control-socket client, in one object.

Who calls what, and when (the :class:`~resilient_slurm.checkpoint.checkpointer.Checkpointer` does all
of it; user code never needs to):

1. ``RankLink(...)`` when the Checkpointer is built: installs the signal traps (main thread only, and
   only where the program kept the default handler) and, when the launcher published a control socket
   for this node (``RSLURM_CONTROL_SOCKET``), prepares a client for it.
2. :meth:`RankLink.hello` once the restore is done, with the step restored. ``link.heartbeat`` (when the
   node has a socket) is the rank's progress record for the launcher's hang detection
   (:mod:`~resilient_slurm.control.heartbeat`): the Checkpointer beats it at every step.
3. :meth:`RankLink.poll` at step boundaries where ranks agree (every ``sync_every`` steps): True when a
   trapped signal or the launcher asks for an emergency save.
4. :meth:`RankLink.committed` after each committed step (the writer thread may call it).
5. :meth:`RankLink.close` when the Checkpointer closes: restores the previous SIGTERM handler and leaves
   the save signal ignored (see :meth:`RankLink.close`).

Under a local launcher the link also holds the rank's :class:`~.orphan.LauncherWatch`: if the launcher dies,
the rank saves and is gone within the launcher's own bounds (:mod:`~resilient_slurm.control.orphan`).

Two ways in, on purpose: the control socket reaches the ranks on the launcher's node without a signal
(a signal can kill a helper process that does not expect it), and a signal reaches ranks on nodes the
launcher does not run on (``scancel --signal``) and ranks that Slurm itself signals (on preemption,
Slurm 22.05 sends SIGTERM to the step tasks, not to the batch shell). Ranks then agree on one step with
their usual per-step collective, so one rank that heard the request is enough.

Signal handlers only set a flag; the save happens at the next step boundary on the training thread.
The link never stops training: if the socket stops answering, the rank logs it once and carries on
with signals alone, retrying the socket now and then.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from types import FrameType
from typing import Any

from ..errors import ControlError, ControlRejectedError
from ..jobenv import JobEnv
from . import protocol as p
from .client import ControlClient
from .heartbeat import HeartbeatWriter, heartbeat_path
from .orphan import LauncherWatch

log = logging.getLogger(__name__)

_RETRY_AFTER_S = 30.0  # after a failed socket call, how long to rely on signals alone
# Save signals a closed link left ignored (SIG_IGN) in this process: a later link traps them again as if the
# program had kept their default handler.
_IGNORED_AFTER_CLOSE: set[int] = set()


def _signal_number(name: str) -> int:
    return int(getattr(signal, "SIG" + name))


CONTROL_NODE_ENV = "RSLURM_CONTROL_NODE"  # set by a launcher under srun: the Slurm node its socket is on


def socket_for_this_node(socket_path: str | None, env: Mapping[str, str]) -> str | None:
    """``socket_path``, or None for a task on another Slurm node than the launcher's (the launcher sets
    ``RSLURM_CONTROL_NODE`` under srun; ``SLURMD_NODENAME`` is this task's node). The socket is node-local:
    elsewhere its path names nothing, or, where the runtime directory is shared or two Slurm nodes share a
    host, a socket this task must not use; such a task hears a save request by signal or from its peers."""
    there, here = env.get(CONTROL_NODE_ENV, "").strip(), JobEnv.from_env(env).node_name or ""
    if socket_path and there and here and there != here:
        log.debug("the control socket is on node %s and this task on %s: signals only", there, here)
        return None
    return socket_path


class RankLink:
    """Signal traps plus an optional control-socket client for one rank.

    ``on_request`` is called (possibly from a signal handler: it must only set a flag) when an
    emergency save is requested. ``socket_path`` None or ``"off"``: signals only.
    """

    def __init__(self, rank: int, local_rank: int, *, on_request: Callable[[], None],
                 socket_path: str | None = None, timeout: float = 2.0, trap_signals: bool = True,
                 save_signal: str = "USR2", clock: Callable[[], float] = time.monotonic,
                 launcher_watch: LauncherWatch | None = None) -> None:
        self.rank = rank
        self.local_rank = local_rank
        self._on_request = on_request
        self._clock = clock
        self._client: ControlClient | None = None
        self.heartbeat: HeartbeatWriter | None = None
        if socket_path and socket_path.lower() != "off":
            try:
                p.check_socket_path(socket_path)
            except ControlError as exc:
                log.warning("rank %d: ignoring control socket: %s", rank, exc)
            else:
                if os.path.exists(socket_path):
                    self._client = ControlClient(socket_path, timeout=timeout)
                    try:  # progress for the launcher's hang detection: a mapped record, no system call per step
                        self.heartbeat = HeartbeatWriter(heartbeat_path(socket_path, rank))
                    except OSError as exc:
                        log.warning("rank %d: no heartbeat record next to %s (%s); the launcher cannot tell "
                                    "whether this rank hangs", rank, socket_path, exc)
                else:
                    # Normal on every node but the launcher's: the socket is node-local.
                    log.debug("rank %d: no control socket at %s on this node; signals only", rank, socket_path)
        self._registered = False
        self._hello_step = 0
        self._manual_taken: object = None  # the deadline of the manual request this rank saved for
        self._down_until = 0.0
        self._warned = False
        self._signals_seen: list[str] = []
        self._previous: dict[int, Any] = {}
        self._save_num = _signal_number(save_signal) if save_signal not in ("none", "TERM") else None
        if trap_signals:
            names = ["TERM"] + ([save_signal] if save_signal not in ("none", "TERM") else [])
            self._install(names)
        # A local launcher's ranks bound themselves if it dies (orphan.py); started last, like the traps.
        self.launcher_watch = launcher_watch.start() if launcher_watch is not None else None

    # ------------------------------------------------------------------ signals
    def _install(self, names: list[str]) -> None:
        if threading.current_thread() is not threading.main_thread():
            log.info("rank %d: Checkpointer built off the main thread; signal traps not installed (the "
                     "control socket still works)", self.rank)
            return
        for name in names:
            num = _signal_number(name)
            current = signal.getsignal(num)
            if current is signal.SIG_IGN and num in _IGNORED_AFTER_CLOSE:
                current = signal.SIG_DFL  # left ignored by an earlier Checkpointer of this program
            if current is not signal.SIG_DFL:
                # The program (or a framework) handles it; it stays in charge of this signal.
                log.info("rank %d: SIG%s already has a handler; leaving it in place", self.rank, name)
                continue
            self._previous[num] = signal.signal(num, self._handler)

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        # Only set flags: the save runs at the next step boundary, on the training thread.
        self._signals_seen.append(signal.Signals(signum).name)
        self._on_request()

    @property
    def signals_seen(self) -> list[str]:
        """Names of the trapped signals received so far (for logs and tests)."""
        return list(self._signals_seen)

    @property
    def connected(self) -> bool:
        """True when a control socket was found for this node."""
        return self._client is not None

    # ------------------------------------------------------------------ socket
    def _usable(self) -> bool:
        return self._client is not None and self._clock() >= self._down_until

    def _failed(self, what: str, exc: Exception) -> None:
        self._down_until = self._clock() + _RETRY_AFTER_S
        self._registered = False
        level = logging.DEBUG if self._warned else logging.WARNING
        self._warned = True
        log.log(level, "rank %d: control socket %s: %s failed (%s); relying on signals, retrying in %.0f s",
                self.rank, self._client.path if self._client else "-", what, exc, _RETRY_AFTER_S)

    def hello(self, step: int) -> None:
        """Register with the node's launcher, reporting the step this rank resumed from."""
        self._hello_step = step
        if not self._usable():
            return
        assert self._client is not None
        try:
            self._client.hello(self.rank, self.local_rank, step=step)
            self._registered = True
        except ControlError as exc:
            self._failed("hello", exc)

    def poll(self, step: int) -> str | None:
        """The save requested over the node's control socket, if any: ``"emergency"`` (the launcher's: the
        emergency flag is set, the rank saves and stops) or ``"manual"`` (a tool's: the rank saves and goes
        on; the request is cleared once every rank reported that save committed; returned once per request)."""
        if not self._usable():
            return None
        assert self._client is not None
        try:
            if not self._registered:
                self._client.hello(self.rank, self.local_rank, step=self._hello_step)
                self._registered = True
            reply = self._client.poll(self.rank, step)
        except ControlRejectedError as exc:
            if exc.code == p.ErrorCode.NOT_REGISTERED:  # the server restarted; register again next time
                self._registered = False
                return None
            self._failed("poll", exc)
            return None
        except ControlError as exc:
            self._failed("poll", exc)
            return None
        if not reply.get("save_requested"):
            return None
        if reply.get("reason") == "manual":
            # Once per request: it stays pending until every rank's save of it committed, and the polls at
            # the steps in between must not start another save each (a request is told by its deadline).
            if reply.get("deadline") == self._manual_taken:
                return None
            self._manual_taken = reply.get("deadline")
            return "manual"
        self._on_request()
        return "emergency"

    def committed(self, step: int, reason: str) -> None:
        """Tell the launcher this rank's part of ``step`` is committed."""
        if reason == "emergency" and self.launcher_watch is not None:
            self.launcher_watch.saved()  # without a launcher, the rank now has term_grace to exit
        if not self._usable() or not self._registered:
            return
        assert self._client is not None
        try:
            self._client.committed(self.rank, step, reason)
        except ControlError as exc:
            self._failed("committed", exc)

    def close(self) -> None:
        """Restore the SIGTERM handler this link replaced, leave the save signal ignored, and close the
        socket.

        A save signal can arrive after the save it asked for has committed: ``scancel --signal`` goes
        through slurmctld and slurmd, which take seconds on a busy node, while the ranks hear the same
        request over the socket and their collective at once. Its default action (USR2: terminate) would
        then end a rank that had finished its work, before its final output and its exit. So the signal
        is ignored from here on (SIG_IGN, not a Python handler: the interpreter puts those back to the
        default action at the start of its shutdown, which lasts seconds on a busy node); a later
        Checkpointer traps it again. SIGTERM gets its previous handler back: it must still end the process."""
        if threading.current_thread() is threading.main_thread():
            for num, prev in self._previous.items():
                if signal.getsignal(num) == self._handler:
                    if num == self._save_num and prev is signal.SIG_DFL:
                        signal.signal(num, signal.SIG_IGN)
                        _IGNORED_AFTER_CLOSE.add(num)
                    else:
                        signal.signal(num, prev)
        self._previous.clear()
        if self.launcher_watch is not None:
            self.launcher_watch.stop()  # kept when the launcher is gone: the bound covers the exit too
        if self.heartbeat is not None:
            self.heartbeat.close()
            self.heartbeat = None
        if self._client is not None:
            self._client.close()
