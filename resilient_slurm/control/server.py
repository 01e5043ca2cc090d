"""Per-node control server: the place where a node's ranks and the launcher meet.

Call order (who calls what, when):

1. The launcher, one per job per node, builds ``ControlServer(default_socket_path(job_id, node))`` and
   calls :meth:`ControlServer.start` before it starts the ranks, then tells them the path.
2. Each rank connects with :class:`~resilient_slurm.control.client.ControlClient`, sends ``hello`` once,
   ``poll`` at step boundaries and ``committed`` after each step it has committed.
3. On a trapped signal the launcher calls :meth:`ControlServer.request_save` (in process) or sends
   ``request_save`` (from another process); ranks see it in their next ``poll``. The launcher then
   watches :meth:`ControlServer.status` until ``last_committed`` is complete or the deadline passes.
4. After the ranks exit, the launcher calls :meth:`ControlServer.stop` (or leaves the ``with`` block),
   which closes every connection and removes the socket file.

One background thread runs a ``selectors`` loop over every connection, so a slow or stuck peer never
holds up the others, and the number of connections and buffered bytes are bounded. All state lives in
:class:`ControlState` behind one lock: the in-process methods and the loop thread share it safely.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import selectors
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .. import paths
from ..errors import ControlProtocolError, ControlSetupError, ControlSocketInUseError
from . import protocol as p

log = logging.getLogger(__name__)

_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_RECV_CHUNK = 64 << 10
_FRAMES_PER_WAKEUP = 32  # then let other connections have a turn
_OUT_LIMIT = 1 << 20  # stop reading from a peer that does not read its replies
_PROBE_TIMEOUT = 1.0


@dataclass(frozen=True)
class PeerCredentials:
    """Who is on the other end of a Unix socket, as the kernel saw it at connect time."""

    pid: int
    uid: int
    gid: int


def peer_credentials(sock: socket.socket) -> PeerCredentials:
    """SO_PEERCRED of a connected Unix socket."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    return PeerCredentials(*_PEERCRED.unpack(raw))


def ensure_private_dir(path: str) -> None:
    """Create ``path`` (and missing parents) mode 0700; refuse it unless it is ours, private and safely placed
    (:func:`resilient_slurm.paths.ensure_private_dir`, which raises :class:`ControlSetupError` here)."""
    paths.ensure_private_dir(path, what="control runtime directory", error=ControlSetupError,
                             why="so that no other user can reach the socket",
                             elsewhere="choose another runtime directory (control_dir, RSLURM_CONTROL_DIR)")


@dataclass
class RankInfo:
    """What this node's server knows about one rank."""

    rank: int
    local_rank: int
    pid: int
    peer_pid: int | None
    step: int
    committed_step: int | None
    registered_at: float
    last_seen: float

    def to_json(self) -> dict[str, Any]:
        """JSON-ready form, as in the ``status`` reply."""
        return {"rank": self.rank, "local_rank": self.local_rank, "pid": self.pid, "peer_pid": self.peer_pid,
                "step": self.step, "committed_step": self.committed_step,
                "registered_at": self.registered_at, "last_seen": self.last_seen}


@dataclass(frozen=True)
class SaveRequest:
    """A pending request for every rank on this node to save."""

    reason: str  # "emergency" or "manual"
    deadline: float  # epoch seconds by which the save must be committed
    requested_at: float


@dataclass
class _StepReports:
    step: int
    reason: str
    ranks: set[int] = field(default_factory=set)
    first_reported_at: float = 0.0


def _still_runs(old: RankInfo, peer_pid: int | None) -> bool:
    """Whether ``old``'s process (another than ``peer_pid``) still runs: its pid names a live process that is
    not a zombie and was started before ``old`` registered (else the pid was reused)."""
    if old.peer_pid is None or peer_pid is None or old.peer_pid == peer_pid:
        return False
    import psutil  # here: the rest of this package needs the standard library only (ranks import it)

    try:
        proc = psutil.Process(old.peer_pid)
        return proc.status() != psutil.STATUS_ZOMBIE and proc.create_time() <= old.registered_at + 1.0
    except psutil.Error:  # gone (or not ours to read): ended
        return False


class ControlState:
    """What ranks and the launcher told this node's server; every method is thread-safe.

    The ranks a save request waits for are the registered ones, so a ``hello`` is refused
    (``unknown_rank``) when it cannot come from one of the job's ranks: its rank is outside the world size
    the launcher gave :meth:`expect_ranks`."""

    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._ranks: dict[int, RankInfo] = {}
        self._save: SaveRequest | None = None
        self._last: _StepReports | None = None
        self._world_size: int | None = None
        self._run_started = -math.inf  # when the launcher started this run of the ranks (expect_ranks)

    def expect_ranks(self, world_size: int | None) -> None:
        """The world size of the ranks the launcher is starting (None: unknown, as under srun, where it is the
        step's). A later call replaces it (a new run of the ranks)."""
        with self._lock:
            self._world_size = world_size
            self._run_started = self._clock()

    def _refusal(self, rank: int, pid: int, peer_pid: int | None, old: RankInfo | None) -> str | None:
        """Why a ``hello`` as ``rank`` from ``peer_pid`` cannot come from one of the job's ranks, or None (called
        with the lock held; ``old``: the rank's entry). A rank outside the world size; or one registered in this
        run of the ranks by another process that still runs (a restarted rank's old process has ended; one of
        an earlier run, an in-job restart's, is replaced whatever it does: it may be on its way out). Not
        checked against the launched processes, which a container runtime or a rank re-parented to init would
        make refuse real ranks."""
        world = self._world_size
        if world is not None and rank >= world:
            return (f"rank {rank} is outside the job's world size {world} (ranks 0-{world - 1}); "
                    f"hello from peer pid {peer_pid} (says pid {pid}) refused")
        if old is not None and old.registered_at >= self._run_started and _still_runs(old, peer_pid):
            return (f"rank {rank} is registered by a process that still runs (peer pid {old.peer_pid}, says pid "
                    f"{old.pid}); hello as rank {rank} from peer pid {peer_pid} (says pid {pid}) refused: a rank "
                    "registers again only once its old process has ended")
        return None

    def hello(self, rank: int, local_rank: int, pid: int, step: int, peer_pid: int | None = None) -> None:
        """Register ``rank`` (again, if it restarted: the new process replaces the old entry); raises
        :class:`ControlProtocolError` (``unknown_rank``) for a hello that cannot come from one of the job's
        ranks (:meth:`expect_ranks`), which is then not registered and never waited for."""
        now = self._clock()
        with self._lock:
            old = self._ranks.get(rank)
            problem = self._refusal(rank, pid, peer_pid, old)
            if problem is None:
                self._ranks[rank] = RankInfo(rank, local_rank, pid, peer_pid, step,
                                             old.committed_step if old else None, now, now)
        if problem is not None:
            log.warning("control socket: %s", problem)
            raise ControlProtocolError(problem, code=p.ErrorCode.UNKNOWN_RANK)
        if old is not None and old.pid != pid:
            log.info("rank %d re-registered: pid %d replaces pid %d (step %d)", rank, pid, old.pid, step)
        else:
            log.info("rank %d registered (local rank %d, pid %d, step %d)", rank, local_rank, pid, step)

    def _registered(self, rank: int, what: str) -> RankInfo:
        info = self._ranks.get(rank)
        if info is None:
            raise ControlProtocolError(f"rank {rank} sent {what} before hello; send hello first",
                                       code=p.ErrorCode.NOT_REGISTERED)
        return info

    def poll(self, rank: int, step: int | None = None) -> SaveRequest | None:
        """Record that ``rank`` is alive (at ``step``) and return the pending save request, if any."""
        with self._lock:
            info = self._registered(rank, "poll")
            info.last_seen = self._clock()
            if step is not None:
                info.step = step
            return self._save

    def committed(self, rank: int, step: int, reason: str) -> None:
        """Record that ``rank`` committed ``step``; clear a save request that this commit completes."""
        now = self._clock()
        with self._lock:
            info = self._registered(rank, "committed")
            info.last_seen = now
            info.step = max(info.step, step)
            info.committed_step = step if info.committed_step is None else max(info.committed_step, step)
            last = self._last
            if last is None or step > last.step:
                last = self._last = _StepReports(step, reason, first_reported_at=now)
            elif step < last.step:
                log.debug("rank %d reported step %d, older than step %d; ignored", rank, step, last.step)
                return
            elif reason != last.reason:
                if reason == "emergency":
                    # An emergency request that met a step already saved (or in flight) for another
                    # reason: that step is the emergency checkpoint now.
                    last.reason, last.first_reported_at = reason, now
                else:
                    log.debug("rank %d reported step %d as %r, which is already %r", rank, step, reason,
                              last.reason)
            last.ranks.add(rank)
            save = self._save
            done = (save is not None and last.reason == save.reason
                    and last.first_reported_at >= save.requested_at and set(self._ranks) <= last.ranks)
            if done:
                self._save = None
        log.debug("rank %d committed step %d (%s)", rank, step, reason)
        if done:
            log.info("%s save request satisfied: every registered rank committed step %d", reason, step)

    def request_save(self, reason: str, deadline: float) -> SaveRequest:
        """Ask every rank to save; merges with a pending request (emergency wins, earlier deadline wins)."""
        now = self._clock()
        with self._lock:
            old = self._save
            if old is not None:
                reason = "emergency" if "emergency" in (reason, old.reason) else reason
                deadline = min(deadline, old.deadline)
            self._save = SaveRequest(reason, deadline, now)
            save = self._save
        log.info("%s save requested; deadline in %.1f s", reason, deadline - now)
        return save

    def clear_save_request(self) -> None:
        """Withdraw the pending save request (e.g. the launcher gave up on it)."""
        with self._lock:
            self._save = None

    @property
    def save_request(self) -> SaveRequest | None:
        """The pending save request, or None."""
        with self._lock:
            return self._save

    def status(self) -> dict[str, Any]:
        """Everything known, JSON-ready: the body of a ``status`` reply."""
        with self._lock:
            last = self._last
            save = self._save
            return {
                "ranks": {str(r): info.to_json() for r, info in sorted(self._ranks.items())},
                "last_committed": None if last is None else {
                    "step": last.step, "reason": last.reason, "ranks_reported": sorted(last.ranks),
                    "complete": bool(self._ranks) and set(self._ranks) <= last.ranks},
                "save_requested": save is not None,
                "save_request": None if save is None else {
                    "reason": save.reason, "deadline": save.deadline, "requested_at": save.requested_at},
            }


MessageHook = Callable[[dict[str, Any], PeerCredentials], None]


class _Conn:
    __slots__ = ("sock", "peer", "inbuf", "body_len", "out", "closing", "events")

    def __init__(self, sock: socket.socket, peer: PeerCredentials) -> None:
        self.sock = sock
        self.peer = peer
        self.inbuf = bytearray()
        self.body_len: int | None = None  # None while reading a header
        self.out = bytearray()
        self.closing = False  # close once ``out`` is sent
        self.events = 0


class ControlServer:
    """Serves the control protocol on a Unix socket from one background thread.

    ``on_message(message, peer)`` is called on the server thread after each valid request has been
    applied; it must be quick, since every client waits while it runs. Exceptions in it are logged.
    """

    def __init__(self, path: str, *, on_message: MessageHook | None = None, state: ControlState | None = None,
                 max_connections: int = 64, max_message_bytes: int = p.MAX_MESSAGE_BYTES) -> None:
        p.check_socket_path(path)
        self._path = path
        self._on_message = on_message
        self._state = state or ControlState()
        self._max_connections = max_connections
        self._max_bytes = max_message_bytes
        self._uid = os.geteuid()
        self._lifecycle = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._listener: socket.socket | None = None
        self._selector: selectors.BaseSelector | None = None
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._conns: dict[int, _Conn] = {}
        self._file_id: tuple[int, int] | None = None

    @property
    def path(self) -> str:
        """Path of the socket file."""
        return self._path

    @property
    def state(self) -> ControlState:
        """The shared state (thread-safe)."""
        return self._state

    @property
    def running(self) -> bool:
        """True between :meth:`start` and :meth:`stop`."""
        return self._thread is not None and self._thread.is_alive()

    def request_save(self, reason: str, deadline: float) -> SaveRequest:
        """In-process ``request_save``: ask every rank on this node to save by ``deadline`` (epoch s)."""
        p.validate_fields(p.REQUEST_SAVE, {"reason": reason, "deadline": deadline})
        return self._state.request_save(reason, float(deadline))

    def status(self) -> dict[str, Any]:
        """In-process ``status``: the body of a ``status`` reply."""
        return self._state.status()

    def start(self) -> None:
        """Create the runtime directory and socket, and start serving in a background thread."""
        with self._lifecycle:
            if self._thread is not None:
                raise ControlSetupError(f"control server on {self._path} was already started")
            ensure_private_dir(os.path.dirname(self._path))
            self._remove_stale_socket()
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                # On Linux the mode of an unbound socket's inode becomes the mode of the file bind()
                # creates, so the socket is never reachable with a looser mode, whatever the umask.
                os.fchmod(listener.fileno(), 0o600)
                try:
                    listener.bind(self._path)
                except OSError as exc:
                    if exc.errno == errno.EADDRINUSE:
                        raise ControlSocketInUseError(
                            f"control socket {self._path} was created by another process while this "
                            "server was starting; is another launcher running for this job on this node?"
                        ) from exc
                    raise ControlSetupError(f"cannot bind control socket {self._path}: {exc}") from exc
                os.chmod(self._path, 0o600)
                st = os.stat(self._path)
                self._file_id = (st.st_dev, st.st_ino)
                listener.listen(128)
                listener.setblocking(False)
            except BaseException:
                listener.close()
                raise
            self._listener = listener
            self._wake_r, self._wake_w = socket.socketpair()
            self._wake_r.setblocking(False)
            self._selector = selectors.DefaultSelector()
            self._selector.register(listener, selectors.EVENT_READ, "listener")
            self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
            self._stopping = False
            self._thread = threading.Thread(target=self._serve, daemon=True,
                                            name=f"rslurm-control:{os.path.basename(self._path)}")
            self._thread.start()
        log.info("control server listening on %s", self._path)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop serving, close every connection and remove the socket file; safe to call twice."""
        with self._lifecycle:
            thread = self._thread
            if thread is None or self._stopping:
                return
            self._stopping = True
            assert self._wake_w is not None
            try:
                self._wake_w.send(b"x")
            except OSError:  # the loop already ended
                pass
            thread.join(timeout)
            if thread.is_alive():
                log.error("control server thread for %s did not stop within %.0f s", self._path, timeout)
            self._wake_w.close()
            self._remove_own_socket_file()
        log.info("control server on %s stopped", self._path)

    def __enter__(self) -> ControlServer:
        if self._thread is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- socket file ---------------------------------------------------------------------------------

    def _remove_stale_socket(self) -> None:
        try:
            st = os.lstat(self._path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise ControlSetupError(f"{self._path} exists and is not a socket; refusing to replace it: "
                                    "remove it or choose another path")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(_PROBE_TIMEOUT)
            try:
                probe.connect(self._path)
            except ConnectionRefusedError:
                pass  # nothing listens: left behind by a process that died
            except TimeoutError as exc:  # a listener whose backlog is full is still a live server
                raise ControlSocketInUseError(f"a control server is listening on {self._path} (it did not "
                                              "accept a test connection in time); is another launcher "
                                              "running for this job on this node?") from exc
            except OSError as exc:
                raise ControlSetupError(f"cannot tell whether {self._path} is in use: {exc}") from exc
            else:
                pid = peer_credentials(probe).pid
                raise ControlSocketInUseError(
                    f"a control server (pid {pid}) is already listening on {self._path}; is another "
                    "launcher running for this job on this node? Stop it or choose another path")
        os.unlink(self._path)
        log.info("removed stale control socket %s (no server answered there)", self._path)

    def _remove_own_socket_file(self) -> None:
        try:
            st = os.lstat(self._path)
        except FileNotFoundError:
            return
        # Leave a file that another server bound after ours was removed.
        if (st.st_dev, st.st_ino) == self._file_id:
            os.unlink(self._path)

    # -- loop (server thread only) -------------------------------------------------------------------

    def _serve(self) -> None:
        assert self._selector is not None
        try:
            while not self._stopping:
                for key, events in self._selector.select():
                    if key.data == "listener":
                        self._accept()
                    elif key.data == "wake":
                        self._drain_wake()
                    else:
                        conn: _Conn = key.data
                        if conn.sock.fileno() < 0:  # closed earlier in this batch
                            continue
                        if events & selectors.EVENT_READ and not conn.closing:
                            self._read(conn)
                        if events & selectors.EVENT_WRITE and conn.sock.fileno() >= 0:
                            self._flush(conn)
        except Exception:
            log.exception("control server loop on %s failed; clients will see the socket closed", self._path)
        finally:
            for conn in list(self._conns.values()):
                self._close(conn)
            self._selector.close()
            if self._listener is not None:
                self._listener.close()
            if self._wake_r is not None:
                self._wake_r.close()

    def _drain_wake(self) -> None:
        assert self._wake_r is not None
        try:
            self._wake_r.recv(64)
        except BlockingIOError:
            pass

    def _accept(self) -> None:
        assert self._listener is not None and self._selector is not None
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # e.g. EMFILE: the level-triggered selector will offer it again
                log.warning("control socket %s: accept failed: %s", self._path, exc)
                time.sleep(0.05)  # without a pause, that retry would spin at full CPU until an fd frees
                return
            sock.setblocking(False)
            try:
                peer = peer_credentials(sock)
            except OSError as exc:  # without credentials the peer cannot be trusted
                log.warning("control socket %s: cannot read a peer's credentials (%s); closing", self._path, exc)
                sock.close()
                continue
            conn = _Conn(sock, peer)
            self._conns[sock.fileno()] = conn
            if conn.peer.uid != self._uid:
                log.warning("control socket %s: rejected a connection from pid %d running as uid %d "
                            "(this server accepts uid %d only)", self._path, conn.peer.pid, conn.peer.uid,
                            self._uid)
                self._reject(conn, p.ErrorCode.PERMISSION_DENIED,
                             f"this control socket accepts uid {self._uid} only; you are uid {conn.peer.uid}")
            elif len(self._conns) > self._max_connections:
                log.warning("control socket %s: rejected a connection from pid %d: %d connections open",
                            self._path, conn.peer.pid, self._max_connections)
                self._reject(conn, p.ErrorCode.BUSY,
                             f"too many connections ({self._max_connections}); close idle ones and retry")
            else:
                log.debug("control socket %s: connection from pid %d", self._path, conn.peer.pid)
            self._update_events(conn)

    def _reject(self, conn: _Conn, code: str, message: str) -> None:
        self._queue(conn, p.make_error(ControlProtocolError(message, code=code)))
        conn.closing = True
        self._flush(conn)

    def _read(self, conn: _Conn) -> None:
        frames = 0
        while frames < _FRAMES_PER_WAKEUP and not conn.closing and len(conn.out) < _OUT_LIMIT:
            want = (p.HEADER.size if conn.body_len is None else conn.body_len) - len(conn.inbuf)
            try:
                # Never more than the current header or body needs: an oversized frame is refused
                # after its 4-byte header, with none of its body read.
                chunk = conn.sock.recv(min(want, _RECV_CHUNK))
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                log.debug("control socket %s: connection from pid %d failed: %s", self._path, conn.peer.pid, exc)
                self._close(conn)
                return
            if not chunk:
                if conn.inbuf or conn.body_len is not None:
                    log.warning("control socket %s: pid %d closed its connection in the middle of a frame; "
                                "the partial frame was dropped", self._path, conn.peer.pid)
                self._close(conn)
                return
            conn.inbuf += chunk
            if len(chunk) < want:
                continue
            if conn.body_len is None:
                header = bytes(conn.inbuf)
                conn.inbuf.clear()
                try:
                    conn.body_len = p.body_length(header, max_bytes=self._max_bytes)
                except ControlProtocolError as exc:
                    self._protocol_error(conn, exc)
                    frames += 1
                    if exc.code == p.ErrorCode.TOO_LARGE:
                        conn.closing = True  # the body was not read, so the framing is lost
                continue
            body = bytes(conn.inbuf)
            conn.inbuf.clear()
            conn.body_len = None
            self._frame(conn, body)
            frames += 1
        self._flush(conn)

    def _protocol_error(self, conn: _Conn, exc: ControlProtocolError) -> None:
        log.warning("control socket %s: bad message from pid %d: [%s] %s", self._path, conn.peer.pid,
                    exc.code, exc)
        self._queue(conn, p.make_error(exc))

    def _frame(self, conn: _Conn, body: bytes) -> None:
        try:
            msg = p.parse_request(body)
        except ControlProtocolError as exc:
            self._protocol_error(conn, exc)
            return
        try:
            reply = self._dispatch(msg, conn.peer)
        except ControlProtocolError as exc:
            exc.request_id = msg["id"]
            if exc.code == p.ErrorCode.UNKNOWN_RANK:  # a refused hello: ControlState.hello logged it
                self._queue(conn, p.make_error(exc))
            else:
                self._protocol_error(conn, exc)
            return
        except Exception as exc:
            log.exception("control socket %s: failed to handle %r from pid %d", self._path, msg["type"],
                          conn.peer.pid)
            reply = p.make_error(ControlProtocolError(f"server error handling {msg['type']!r}: {exc}",
                                                      code=p.ErrorCode.INTERNAL, request_id=msg["id"]))
            self._queue(conn, reply)
            return
        self._queue(conn, reply)
        if self._on_message is not None:
            try:
                self._on_message(msg, conn.peer)
            except Exception:
                log.exception("control socket %s: on_message hook failed for %r", self._path, msg["type"])

    def _dispatch(self, msg: dict[str, Any], peer: PeerCredentials) -> dict[str, Any]:
        t, rid, st = msg["type"], msg["id"], self._state
        if t == p.PING:
            return p.make_reply(p.PONG, rid)
        if t == p.HELLO:
            st.hello(msg["rank"], msg["local_rank"], msg["pid"], msg["step"], peer.pid)
            return p.make_reply(p.OK, rid)
        if t == p.POLL:
            save = st.poll(msg["rank"], msg.get("step"))
            return p.make_reply(p.STATE, rid, save_requested=save is not None,
                                reason=save.reason if save else None, deadline=save.deadline if save else None)
        if t == p.COMMITTED:
            st.committed(msg["rank"], msg["step"], msg["reason"])
            return p.make_reply(p.OK, rid)
        if t == p.REQUEST_SAVE:
            log.debug("control socket %s: pid %d requests a save (%s)", self._path, peer.pid, msg["reason"])
            st.request_save(msg["reason"], float(msg["deadline"]))
            return p.make_reply(p.OK, rid)
        if t == p.STATUS:
            return p.make_reply(p.STATUS, rid, **st.status())
        raise AssertionError(f"request type {t!r} passed validation but has no handler")

    def _queue(self, conn: _Conn, reply: dict[str, Any]) -> None:
        try:
            # Replies are bounded by the protocol's limit, which every client accepts, not by the
            # (possibly lower) limit this server applies to what it reads.
            conn.out += p.encode(reply)
        except ControlProtocolError as exc:
            log.error("control socket %s: cannot send a %r reply: %s", self._path, reply.get("type"), exc)
            conn.out += p.encode(p.make_error(ControlProtocolError(
                f"server could not encode its reply: {exc}", code=p.ErrorCode.INTERNAL,
                request_id=reply.get("id"))))

    def _flush(self, conn: _Conn) -> None:
        while conn.out:
            try:
                n = conn.sock.send(conn.out)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                log.debug("control socket %s: pid %d went away before its reply was sent: %s", self._path,
                          conn.peer.pid, exc)
                self._close(conn)
                return
            del conn.out[:n]
        if conn.closing and not conn.out:
            self._close(conn)
        else:
            self._update_events(conn)

    def _update_events(self, conn: _Conn) -> None:
        assert self._selector is not None
        if conn.sock.fileno() < 0:
            return
        events = 0
        if not conn.closing and len(conn.out) < _OUT_LIMIT:
            events |= selectors.EVENT_READ
        if conn.out:
            events |= selectors.EVENT_WRITE
        if events == conn.events:
            return
        if conn.events == 0:
            self._selector.register(conn.sock, events, conn)
        else:
            self._selector.modify(conn.sock, events, conn)
        conn.events = events

    def _close(self, conn: _Conn) -> None:
        fd = conn.sock.fileno()
        if fd < 0:
            return
        if conn.events and self._selector is not None:
            self._selector.unregister(conn.sock)
            conn.events = 0
        self._conns.pop(fd, None)
        conn.sock.close()
