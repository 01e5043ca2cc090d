"""Client side of the control socket, used by ranks and by tools that talk to a node's launcher.

Call order: a rank builds one ``ControlClient(path)`` at start, calls :meth:`ControlClient.hello` once
(and again if a later call raises :class:`ControlRejectedError` with code ``not_registered``), then
:meth:`ControlClient.poll` at step boundaries and :meth:`ControlClient.committed` after each commit, and
:meth:`ControlClient.close` at exit. The launcher or a tool calls :meth:`ControlClient.request_save`
and :meth:`ControlClient.status`. One client is safe to share between threads: requests are serialized.

Every call is bounded by ``timeout`` (connecting, sending and reading the reply together). If the
connection turns out to be broken (the server restarted, or closed an idle connection), the client
reconnects and resends once; that is safe because every request of the protocol is idempotent.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import threading
import time
from collections.abc import Mapping
from typing import Any

from ..errors import (
    ControlProtocolError,
    ControlRejectedError,
    ControlTimeoutError,
    ControlUnavailableError,
)
from . import protocol as p

log = logging.getLogger(__name__)


# Error replies after which the server closes the connection.
_CLOSING_CODES = frozenset({p.ErrorCode.TOO_LARGE, p.ErrorCode.PERMISSION_DENIED, p.ErrorCode.BUSY})


class _ConnectionLost(Exception):
    """The connection broke in a way that a reconnect may fix."""


class ControlClient:
    """Sends requests to the control server at ``path`` and returns its replies."""

    def __init__(self, path: str, *, timeout: float = 5.0, max_message_bytes: int = p.MAX_MESSAGE_BYTES) -> None:
        p.check_socket_path(path)
        self._path = path
        self._timeout = timeout
        self._max_bytes = max_message_bytes
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._ids = itertools.count(1)

    @property
    def path(self) -> str:
        """Path of the server's socket."""
        return self._path

    def request(self, msg: Mapping[str, Any]) -> dict[str, Any]:
        """Send one request (``v`` and ``id`` are filled in when absent) and return the server's reply.

        Raises :class:`ControlRejectedError` for an error reply, :class:`ControlUnavailableError` when no
        server answers (:class:`ControlTimeoutError` when it does not answer in time) and
        :class:`ControlProtocolError` when the request cannot be encoded or the reply is malformed.
        """
        out = {"v": p.PROTOCOL_VERSION, **msg}
        msg_type = out.get("type")
        with self._lock:
            out.setdefault("id", next(self._ids))
            try:
                frame = p.encode(out, max_bytes=self._max_bytes)
            except ControlProtocolError as exc:
                raise ControlProtocolError(f"control socket {self._path}: {exc}", code=exc.code,
                                           request_id=out["id"]) from exc
            deadline = time.monotonic() + self._timeout
            for attempt in (1, 2):
                try:
                    reply = self._exchange(frame, out["id"], msg_type, deadline)
                    break
                except _ConnectionLost as exc:
                    self._disconnect()
                    if attempt == 2:
                        raise ControlUnavailableError(
                            f"control socket {self._path}: connection lost during {msg_type!r} ({exc}), "
                            "again after reconnecting; is the launcher still running?") from None
                    log.debug("control socket %s: connection lost (%s); reconnecting once", self._path, exc)
                except BaseException:
                    self._disconnect()  # the framing state of the connection is unknown now
                    raise
            code = str(reply.get("code"))
            if reply["type"] == p.ERROR and code in _CLOSING_CODES:
                self._disconnect()
        if reply["type"] == p.ERROR:
            text = f"control server at {self._path} refused {msg_type!r}: [{code}] {reply.get('message')}"
            if code == p.ErrorCode.BUSY:
                raise ControlUnavailableError(text)
            raise ControlRejectedError(text, code=code)
        return reply

    def hello(self, rank: int, local_rank: int, *, step: int = 0, pid: int | None = None) -> None:
        """Register this rank (``pid`` defaults to this process) with the node's server."""
        self.request({"type": p.HELLO, "rank": rank, "local_rank": local_rank,
                      "pid": os.getpid() if pid is None else pid, "step": step})

    def poll(self, rank: int, step: int | None = None) -> dict[str, Any]:
        """The ``state`` reply: ``save_requested``, ``reason``, ``deadline``."""
        msg: dict[str, Any] = {"type": p.POLL, "rank": rank}
        if step is not None:
            msg["step"] = step
        return self.request(msg)

    def committed(self, rank: int, step: int, reason: str) -> None:
        """Report that this rank committed ``step`` (reason: interval, emergency, final or manual)."""
        self.request({"type": p.COMMITTED, "rank": rank, "step": step, "reason": reason})

    def request_save(self, reason: str, deadline: float) -> None:
        """Ask every rank on the node to save ("emergency" or "manual") by ``deadline`` (epoch seconds)."""
        self.request({"type": p.REQUEST_SAVE, "reason": reason, "deadline": deadline})

    def status(self) -> dict[str, Any]:
        """The ``status`` reply: ranks, last_committed, save_requested, save_request."""
        return self.request({"type": p.STATUS})

    def ping(self) -> None:
        """Check that the server answers."""
        self.request({"type": p.PING})

    def close(self) -> None:
        """Close the connection (a later request reconnects)."""
        with self._lock:
            self._disconnect()

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals (called with the lock held) -------------------------------------------------------

    def _disconnect(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _remaining(self, deadline: float, msg_type: object) -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ControlTimeoutError(f"control server at {self._path} did not answer {msg_type!r} within "
                                      f"{self._timeout:g} s; is the launcher stuck?")
        return left

    def _connect(self, deadline: float, msg_type: object) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self._remaining(deadline, msg_type))
            sock.connect(self._path)
        except FileNotFoundError:
            sock.close()
            raise ControlUnavailableError(f"no control server at {self._path} (the socket file does not "
                                          "exist): is the launcher running on this node?") from None
        except ConnectionRefusedError:
            sock.close()
            raise ControlUnavailableError(f"no control server listens on {self._path} (a stale socket "
                                          "file?): is the launcher running on this node?") from None
        except PermissionError as exc:
            sock.close()
            raise ControlRejectedError(f"cannot connect to control socket {self._path}: {exc}; it belongs "
                                       "to another user", code=p.ErrorCode.PERMISSION_DENIED) from exc
        except TimeoutError:
            sock.close()
            raise ControlTimeoutError(f"control server at {self._path} did not accept a connection within "
                                      f"{self._timeout:g} s") from None
        except OSError as exc:
            sock.close()
            raise ControlUnavailableError(f"cannot connect to control socket {self._path}: {exc}") from exc
        except BaseException:
            sock.close()
            raise
        return sock

    def _exchange(self, frame: bytes, request_id: Any, msg_type: object, deadline: float) -> dict[str, Any]:
        if self._sock is None:
            self._sock = self._connect(deadline, msg_type)
        sock = self._sock
        try:
            sock.settimeout(self._remaining(deadline, msg_type))
            sock.sendall(frame)
        except TimeoutError:
            raise ControlTimeoutError(f"control server at {self._path} did not take {msg_type!r} within "
                                      f"{self._timeout:g} s") from None
        except OSError as exc:
            # A server that rejects a peer (wrong uid, too busy) replies and closes at once, maybe
            # before this request was sent: its reply, if there is one, says why.
            try:
                return self._read_reply(sock, request_id, msg_type, deadline)
            except _ConnectionLost:
                raise _ConnectionLost(f"send failed: {exc}") from exc
        return self._read_reply(sock, request_id, msg_type, deadline)

    def _recv_exact(self, sock: socket.socket, n: int, deadline: float, msg_type: object) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            sock.settimeout(self._remaining(deadline, msg_type))
            try:
                chunk = sock.recv(n - len(buf))
            except TimeoutError:
                raise ControlTimeoutError(f"control server at {self._path} did not answer {msg_type!r} "
                                          f"within {self._timeout:g} s; is the launcher stuck?") from None
            except OSError as exc:
                raise _ConnectionLost(f"receive failed: {exc}") from exc
            if not chunk:
                raise _ConnectionLost("the server closed the connection")
            buf += chunk
        return bytes(buf)

    def _read_reply(self, sock: socket.socket, request_id: Any, msg_type: object,
                    deadline: float) -> dict[str, Any]:
        header = self._recv_exact(sock, p.HEADER.size, deadline, msg_type)
        try:
            n = p.body_length(header, max_bytes=self._max_bytes)
            body = self._recv_exact(sock, n, deadline, msg_type)
            return p.parse_reply(body, expected_id=request_id)
        except ControlProtocolError as exc:
            raise ControlProtocolError(f"control server at {self._path} sent a malformed reply to {msg_type!r}: "
                                       f"{exc}", code=exc.code, request_id=request_id) from exc
