"""Control socket: real Unix sockets, real client processes (one running as another uid), no mocks."""

from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from resilient_slurm.control import (
    MAX_MESSAGE_BYTES,
    ControlClient,
    ControlServer,
    ControlState,
    ErrorCode,
    default_socket_path,
)
from resilient_slurm.control.server import ensure_private_dir
from resilient_slurm.errors import (
    ControlProtocolError,
    ControlRejectedError,
    ControlSetupError,
    ControlSocketInUseError,
    ControlTimeoutError,
    ControlUnavailableError,
    PermanentError,
    TransientError,
)

REPO = Path(__file__).resolve().parent.parent
NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as uid 65534 (CI runs "
                                "tests as root)")


@pytest.fixture
def base() -> Iterator[Path]:
    """A short private directory: pytest's tmp_path can exceed the 107-byte Unix socket path limit."""
    d = tempfile.mkdtemp(prefix="rsl-", dir="/tmp")
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def sock_path(base: Path) -> str:
    return str(base / "run" / "42.n1.sock")


@pytest.fixture
def server(sock_path: str) -> Iterator[ControlServer]:
    with ControlServer(sock_path) as srv:
        yield srv


def connect(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)  # a server that waits for bytes we never send fails the test instead of hanging
    s.connect(path)
    return s


def frame(body: bytes | dict[str, Any]) -> bytes:
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    return struct.pack(">I", len(data)) + data


def recv_exact(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        assert chunk, f"server closed the connection after {len(buf)} of {n} bytes"
        buf += chunk
    return buf


def read_frame(s: socket.socket) -> dict[str, Any]:
    (n,) = struct.unpack(">I", recv_exact(s, 4))
    return json.loads(recv_exact(s, n))


def is_closed(s: socket.socket) -> bool:
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


def wait_until(cond: Callable[[], bool], what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.005)


def ping(path: str) -> None:
    with ControlClient(path, timeout=10) as c:
        c.ping()


# -- round trips -------------------------------------------------------------------------------------


def test_round_trip_of_every_message_type(server: ControlServer) -> None:
    with ControlClient(server.path, timeout=10) as c:
        assert c.request({"type": "ping"}) == {"v": 1, "type": "pong", "id": 1}
        assert c.request({"type": "hello", "rank": 0, "local_rank": 0, "pid": os.getpid(), "step": 5}) == \
            {"v": 1, "type": "ok", "id": 2}
        assert c.request({"type": "poll", "rank": 0, "id": "p-1"}) == \
            {"v": 1, "type": "state", "id": "p-1", "save_requested": False, "reason": None, "deadline": None}
        deadline = time.time() + 60
        assert c.request({"type": "request_save", "reason": "manual", "deadline": deadline})["type"] == "ok"
        state = c.poll(0, step=6)
        assert (state["type"], state["save_requested"], state["reason"], state["deadline"]) == \
            ("state", True, "manual", deadline)
        assert c.request({"type": "committed", "rank": 0, "step": 7, "reason": "manual"})["type"] == "ok"
        status = c.status()
    assert status["type"] == "status"
    rank0 = status["ranks"]["0"]
    assert (rank0["local_rank"], rank0["pid"], rank0["peer_pid"], rank0["step"], rank0["committed_step"]) == \
        (0, os.getpid(), os.getpid(), 7, 7)
    assert status["last_committed"] == {"step": 7, "reason": "manual", "ranks_reported": [0], "complete": True}
    # The manual save committed on every registered rank, so the request is cleared.
    assert status["save_requested"] is False and status["save_request"] is None
    assert server.status() == {k: v for k, v in status.items() if k not in ("v", "type", "id")}


@pytest.mark.proc
def test_request_save_is_seen_by_a_rank_polling_from_another_process(server: ControlServer) -> None:
    # The package root imports lazily: a rank or tool that only talks to the control socket must not
    # pay for importing torch.
    script = textwrap.dedent("""
        import json, os, sys, time
        sys.path.insert(0, sys.argv[2])
        from resilient_slurm.control import ControlClient
        assert "torch" not in sys.modules, "importing the control package imported torch"
        with ControlClient(sys.argv[1], timeout=10) as c:
            c.hello(rank=3, local_rank=1, step=7)
            while not (state := c.poll(3, step=7))["save_requested"]:
                time.sleep(0.005)
            c.committed(3, 8, state["reason"])
        print(json.dumps(state))
    """)
    proc = subprocess.Popen([sys.executable, "-c", script, server.path, str(REPO)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: "3" in server.status()["ranks"] or proc.poll() is not None, "rank 3's hello")
        assert proc.poll() is None, proc.communicate()
        deadline = time.time() + 120
        with ControlClient(server.path, timeout=10) as launcher:
            launcher.request_save("emergency", deadline)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    state = json.loads(out)
    assert (state["save_requested"], state["reason"], state["deadline"]) == (True, "emergency", deadline)
    status = server.status()
    assert status["ranks"]["3"]["pid"] == proc.pid and status["ranks"]["3"]["peer_pid"] == proc.pid
    assert status["last_committed"] == {"step": 8, "reason": "emergency", "ranks_reported": [3],
                                        "complete": True}
    assert status["save_requested"] is False


def test_poll_and_committed_need_hello_first(server: ControlServer) -> None:
    with ControlClient(server.path, timeout=10) as c:
        for call in (lambda: c.poll(1), lambda: c.committed(1, 3, "interval")):
            with pytest.raises(ControlRejectedError, match="hello first") as info:
                call()
            assert info.value.code == ErrorCode.NOT_REGISTERED
        c.hello(1, 1, step=2)
        assert c.poll(1)["save_requested"] is False


def test_in_process_request_save_validates_like_the_socket(server: ControlServer) -> None:
    with pytest.raises(ControlProtocolError, match="'reason'") as info:
        server.request_save("because", time.time())
    assert info.value.code == ErrorCode.BAD_FIELD
    server.request_save("emergency", 123.0)
    with ControlClient(server.path, timeout=10) as c:
        c.hello(0, 0)
        assert c.poll(0)["deadline"] == 123.0


# -- save-request state machine (ControlState alone, with an injected clock) ------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_save_requests_merge_emergency_wins_and_earlier_deadline_wins() -> None:
    st = ControlState(clock=FakeClock())
    st.request_save("manual", 50.0)
    merged = st.request_save("emergency", 80.0)
    assert (merged.reason, merged.deadline) == ("emergency", 50.0)
    merged = st.request_save("manual", 40.0)
    assert (merged.reason, merged.deadline) == ("emergency", 40.0)


def test_save_request_clears_only_when_every_rank_commits_the_requested_save() -> None:
    clock = FakeClock()
    st = ControlState(clock=clock)
    st.hello(0, 0, 100, 0)
    st.hello(1, 1, 101, 0)
    st.committed(0, 10, "interval")  # a save already under way when the request comes
    clock.now += 1
    st.request_save("emergency", 2000.0)
    clock.now += 1
    st.committed(1, 10, "interval")
    st.committed(0, 11, "emergency")
    assert st.save_request is not None, "one rank of two has committed the emergency save"
    assert st.status()["last_committed"] == {"step": 11, "reason": "emergency", "ranks_reported": [0],
                                             "complete": False}
    st.committed(0, 9, "interval")  # late report of an older step: ignored
    st.committed(1, 11, "emergency")
    assert st.save_request is None
    assert st.status()["last_committed"]["complete"] is True


def test_a_step_first_reported_before_the_request_does_not_clear_it() -> None:
    clock = FakeClock()
    st = ControlState(clock=clock)
    st.hello(0, 0, 100, 0)
    st.hello(1, 1, 101, 0)
    st.committed(0, 5, "manual")
    clock.now += 1
    st.request_save("manual", 2000.0)
    st.committed(1, 5, "manual")
    assert st.save_request is not None
    st.clear_save_request()
    assert st.save_request is None


# -- permissions ---------------------------------------------------------------------------------------


def test_socket_is_0600_in_a_0700_directory_whatever_the_umask(base: Path) -> None:
    path = str(base / "a" / "b" / "run" / "1.n1.sock")
    old = os.umask(0)
    try:
        with ControlServer(path):
            assert stat.S_ISSOCK(os.stat(path).st_mode)
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
            for d in ("a", "a/b", "a/b/run"):
                assert stat.S_IMODE(os.stat(base / d).st_mode) == 0o700, d
    finally:
        os.umask(old)


def test_runtime_directory_that_others_can_reach_is_refused(base: Path) -> None:
    run = base / "run"
    run.mkdir(mode=0o755)
    run.chmod(0o755)
    with pytest.raises(ControlSetupError, match=r"mode 0755.*chmod 700"):
        ControlServer(str(run / "1.n1.sock")).start()
    assert not (run / "1.n1.sock").exists()


def test_runtime_directory_under_a_directory_others_can_write_is_refused(base: Path) -> None:
    shared = base / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # world-writable without the sticky bit: others could swap our directory
    with pytest.raises(ControlSetupError, match="another user could modify"):
        ControlServer(str(shared / "run" / "1.n1.sock")).start()
    shared.chmod(0o1777)  # like /tmp: accepted
    ensure_private_dir(str(shared / "run"))


def test_symlinked_runtime_directory_is_refused(base: Path) -> None:
    real = base / "real"
    real.mkdir(mode=0o700)
    (base / "run").symlink_to(real)
    with pytest.raises(ControlSetupError, match="symlink"):
        ControlServer(str(base / "run" / "1.n1.sock")).start()


@needs_root
def test_runtime_directory_of_another_user_is_refused(base: Path) -> None:
    run = base / "run"
    run.mkdir(mode=0o700)
    os.chown(run, NOBODY, NOBODY)
    with pytest.raises(ControlSetupError, match=f"belongs to uid {NOBODY}"):
        ControlServer(str(run / "1.n1.sock")).start()


NOBODY_CLIENT = textwrap.dedent("""
    import json, os, socket, struct, sys
    os.setgroups([]); os.setgid(65534); os.setuid(65534)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    try:
        s.connect(sys.argv[1])
    except PermissionError:
        print(json.dumps({"uid": os.getuid(), "connect": "EACCES"}))
        sys.exit(0)
    def rx(n):
        buf = b""
        while len(buf) < n:
            chunk = s.recv(n - len(buf))
            if not chunk:
                raise SystemExit("server closed the connection without a reply")
            buf += chunk
        return buf
    (n,) = struct.unpack(">I", rx(4))
    reply = json.loads(rx(n))
    print(json.dumps({"uid": os.getuid(), "connect": "ok", "reply": reply, "closed": s.recv(1) == b""}))
""")


def run_as_nobody(path: str) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-I", "-c", NOBODY_CLIENT, path], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.proc
@needs_root
def test_peer_with_another_uid_is_rejected_even_if_file_modes_let_it_in(
        base: Path, server: ControlServer, caplog: pytest.LogCaptureFixture) -> None:
    # Loosen every file mode so that uid 65534 can connect at all: the SO_PEERCRED check must stop it.
    base.chmod(0o711)
    (base / "run").chmod(0o711)
    os.chmod(server.path, 0o666)
    with caplog.at_level(logging.WARNING, logger="resilient_slurm.control.server"):
        result = run_as_nobody(server.path)
    assert result["uid"] == NOBODY and result["connect"] == "ok"
    assert result["reply"]["type"] == "error" and result["reply"]["code"] == ErrorCode.PERMISSION_DENIED
    assert f"you are uid {NOBODY}" in result["reply"]["message"]
    assert result["closed"] is True
    assert any(f"running as uid {NOBODY}" in r.getMessage() for r in caplog.records)
    ping(server.path)


@pytest.mark.proc
@needs_root
def test_peer_with_another_uid_cannot_reach_the_socket_with_default_modes(base: Path,
                                                                          server: ControlServer) -> None:
    base.chmod(0o711)  # only the runtime directory (0700, made by the server) stands in the way
    assert run_as_nobody(server.path) == {"uid": NOBODY, "connect": "EACCES"}


# -- malformed frames ---------------------------------------------------------------------------------


def body(obj: Any) -> bytes:
    return json.dumps(obj).encode()


HELLO = {"v": 1, "type": "hello", "id": 1, "rank": 0, "local_rank": 0, "pid": 1, "step": 0}
MALFORMED = [
    # (case, body, expected code, text the message must contain, id the reply must carry)
    ("zero length", b"", ErrorCode.BAD_LENGTH, "zero-length", None),
    ("not UTF-8", b'{"v": 1, "type": "\xff"}', ErrorCode.BAD_ENCODING, "not UTF-8", None),
    ("pickle", pickle.dumps({"v": 1, "type": "ping", "id": 1}), ErrorCode.BAD_ENCODING, "never pickle", None),
    ("invalid JSON", b'{"v": 1, "type": "ping",', ErrorCode.BAD_JSON, "not valid JSON", None),
    ("NaN", b'{"v": 1, "type": "request_save", "id": 1, "reason": "manual", "deadline": NaN}',
     ErrorCode.BAD_JSON, "NaN", None),
    ("deep nesting", b"[" * 100_000, ErrorCode.BAD_JSON, "nested too deeply", None),
    ("not an object", b"[1, 2]", ErrorCode.NOT_OBJECT, "got list", None),
    ("no version", body({"type": "ping", "id": 1}), ErrorCode.UNSUPPORTED_VERSION,
     "supported versions: [1]", 1),
    ("future version", body({"v": 2, "type": "ping", "id": 1}), ErrorCode.UNSUPPORTED_VERSION,
     "unsupported version: message has version 2; supported versions: [1]", 1),
    ("string version", body({"v": "1", "type": "ping", "id": 1}), ErrorCode.UNSUPPORTED_VERSION,
     "version '1'", 1),
    ("no type", body({"v": 1, "id": 1}), ErrorCode.MISSING_TYPE, 'no "type"', 1),
    ("unknown type", body({"v": 1, "type": "reboot", "id": 1}), ErrorCode.UNKNOWN_TYPE,
     "'reboot' is not a known message type", 1),
    ("reply type", body({"v": 1, "type": "ok", "id": 1}), ErrorCode.UNKNOWN_TYPE, "a reply type", 1),
    ("no id", body({"v": 1, "type": "ping"}), ErrorCode.BAD_FIELD, 'needs an "id"', None),
    ("missing field", body({k: v for k, v in HELLO.items() if k != "pid"}), ErrorCode.BAD_FIELD,
     "missing field 'pid'", 1),
    ("string rank", body({**HELLO, "rank": "0"}), ErrorCode.BAD_FIELD, "'rank' = '0' must be an integer", 1),
    ("bool rank", body({**HELLO, "rank": True}), ErrorCode.BAD_FIELD, "'rank' = True must be an integer", 1),
    ("negative step", body({**HELLO, "step": -1}), ErrorCode.BAD_FIELD, "'step' = -1 must be >= 0", 1),
    ("step past twelve digits", body({**HELLO, "step": 10**20}), ErrorCode.BAD_FIELD,
     "'step' = 100000000000000000000 must be <= 999999999999", 1),
    ("committed step past twelve digits",
     body({"v": 1, "type": "committed", "id": 1, "rank": 0, "step": 10**12, "reason": "emergency"}),
     ErrorCode.BAD_FIELD, "'step' = 1000000000000 must be <= 999999999999", 1),
    ("bad reason", body({"v": 1, "type": "committed", "id": 1, "rank": 0, "step": 1, "reason": "why"}),
     ErrorCode.BAD_FIELD, "'reason' = 'why' must be one of", 1),
    ("deadline past any year", body({"v": 1, "type": "request_save", "id": 1, "reason": "manual", "deadline": 1e308}),
     ErrorCode.BAD_FIELD, "'deadline' = 1e+308 must be <= 1e+11 (epoch seconds)", 1),
]


@pytest.mark.parametrize("case,data,code,text,reply_id", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_frame_gets_an_error_reply_and_the_server_keeps_serving(
        server: ControlServer, caplog: pytest.LogCaptureFixture,
        case: str, data: bytes, code: str, text: str, reply_id: Any) -> None:
    with caplog.at_level(logging.WARNING, logger="resilient_slurm.control.server"), connect(server.path) as s:
        s.sendall(frame(data))
        reply = read_frame(s)
        assert reply["v"] == 1 and reply["type"] == "error" and reply["code"] == code, reply
        assert text in reply["message"], reply
        assert reply["id"] == reply_id
        if code == ErrorCode.UNSUPPORTED_VERSION:
            assert reply["supported"] == [1]
        # The framing is intact, so the same connection still works.
        s.sendall(frame({"v": 1, "type": "ping", "id": "after"}))
        assert read_frame(s) == {"v": 1, "type": "pong", "id": "after"}
    assert any(f"[{code}]" in r.getMessage() for r in caplog.records), "the bad message was not logged"
    ping(server.path)


@pytest.mark.parametrize("length", [MAX_MESSAGE_BYTES + 1, 0xFFFFFFFF])
def test_oversized_length_is_rejected_without_reading_the_body(server: ControlServer, length: int) -> None:
    with connect(server.path) as s:
        s.sendall(struct.pack(">I", length))  # and no body: a server that waits for it fails the test
        reply = read_frame(s)
        assert (reply["type"], reply["code"]) == ("error", ErrorCode.TOO_LARGE)
        assert str(length) in reply["message"] and str(MAX_MESSAGE_BYTES) in reply["message"]
        assert is_closed(s), "the framing is lost, so the server must close the connection"
    ping(server.path)


def test_message_size_limit_is_exact(sock_path: str) -> None:
    limit = 64
    with ControlServer(sock_path, max_message_bytes=limit) as srv, connect(srv.path) as s:
        msg = {"v": 1, "type": "ping", "id": "x"}
        msg["id"] = "x" * (limit - len(json.dumps(msg).encode()) + 1)
        assert len(json.dumps(msg).encode()) == limit
        s.sendall(frame(msg))
        assert read_frame(s)["type"] == "pong"
        msg["id"] += "y"
        s.sendall(frame(msg))
        assert read_frame(s)["code"] == ErrorCode.TOO_LARGE


def test_client_refuses_to_send_an_oversized_message(server: ControlServer) -> None:
    with ControlClient(server.path, timeout=10) as c:
        with pytest.raises(ControlProtocolError, match=server.path) as info:
            c.request({"type": "ping", "pad": "x" * MAX_MESSAGE_BYTES})
        assert info.value.code == ErrorCode.TOO_LARGE
        c.ping()


def test_frame_cut_off_by_the_peer_is_dropped_and_logged(server: ControlServer,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="resilient_slurm.control.server"):
        with connect(server.path) as s:
            s.sendall(struct.pack(">I", 100) + b'{"v": 1')
        wait_until(lambda: any("middle of a frame" in r.getMessage() for r in caplog.records),
                   "the log line about the cut-off frame")
    ping(server.path)


def test_a_half_sent_frame_does_not_block_other_clients(server: ControlServer) -> None:
    data = frame({"v": 1, "type": "ping", "id": 7})
    with connect(server.path) as slow:
        slow.sendall(data[:6])  # header and part of the body
        ping(server.path)
        slow.sendall(data[6:])
        assert read_frame(slow) == {"v": 1, "type": "pong", "id": 7}


def test_pipelined_requests_are_answered_in_order(server: ControlServer) -> None:
    with connect(server.path) as s:
        s.sendall(b"".join(frame({"v": 1, "type": "ping", "id": i}) for i in range(20)))
        assert [read_frame(s)["id"] for _ in range(20)] == list(range(20))


def test_client_reports_unsupported_version_with_the_supported_ones(server: ControlServer) -> None:
    with ControlClient(server.path, timeout=10) as c:
        with pytest.raises(ControlRejectedError, match=r"version 2; supported versions: \[1\]") as info:
            c.request({"type": "ping", "v": 2})
        assert info.value.code == ErrorCode.UNSUPPORTED_VERSION
        assert isinstance(info.value, PermanentError)
        c.ping()


# -- stale and live sockets ---------------------------------------------------------------------------


def test_stale_socket_file_is_replaced(base: Path, sock_path: str, caplog: pytest.LogCaptureFixture) -> None:
    os.mkdir(base / "run", 0o700)
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(sock_path)
    dead.close()  # the file stays; nothing listens: what a SIGKILLed launcher leaves behind
    assert stat.S_ISSOCK(os.stat(sock_path).st_mode)
    with caplog.at_level(logging.INFO, logger="resilient_slurm.control.server"), ControlServer(sock_path):
        ping(sock_path)
    assert any("removed stale control socket" in r.getMessage() for r in caplog.records)


def test_live_server_is_not_replaced(server: ControlServer) -> None:
    with pytest.raises(ControlSocketInUseError, match=f"pid {os.getpid()}.*{server.path}"):
        ControlServer(server.path).start()
    ping(server.path)


def test_file_that_is_not_a_socket_is_left_alone(base: Path, sock_path: str) -> None:
    os.mkdir(base / "run", 0o700)
    Path(sock_path).write_text("keep me")
    with pytest.raises(ControlSetupError, match=f"{sock_path} exists and is not a socket"):
        ControlServer(sock_path).start()
    assert Path(sock_path).read_text() == "keep me"


def test_stop_leaves_a_socket_file_that_a_newer_server_bound(sock_path: str) -> None:
    old = ControlServer(sock_path)
    old.start()
    os.unlink(sock_path)
    with ControlServer(sock_path):
        old.stop()
        assert os.path.exists(sock_path)
        ping(sock_path)


# -- concurrency, lifecycle, client behaviour ---------------------------------------------------------


def test_concurrent_clients_are_all_served(server: ControlServer) -> None:
    def rank(r: int) -> list[bool]:
        with ControlClient(server.path, timeout=30) as c:
            c.hello(r, r, step=0)
            polls = [c.poll(r, step=i)["save_requested"] for i in range(50)]
            c.committed(r, 10, "interval")
            return polls

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(rank, range(8)))
    assert results == [[False] * 50] * 8
    status = server.status()
    assert sorted(status["ranks"]) == [str(r) for r in range(8)]
    assert status["last_committed"] == {"step": 10, "reason": "interval", "ranks_reported": list(range(8)),
                                        "complete": True}


def test_one_client_shared_by_threads(server: ControlServer) -> None:
    with ControlClient(server.path, timeout=30) as c, ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda _: c.request({"type": "ping"}), range(200)))
    assert sorted(r["id"] for r in replies) == list(range(1, 201))


def test_stop_removes_the_socket_and_clients_get_a_clear_error(sock_path: str) -> None:
    srv = ControlServer(sock_path)
    srv.start()
    assert srv.running
    connected = ControlClient(sock_path, timeout=10)
    connected.ping()
    srv.stop()
    srv.stop()  # a second stop is harmless
    assert not srv.running
    assert not os.path.exists(sock_path)
    for c in (connected, ControlClient(sock_path, timeout=10)):
        with pytest.raises(ControlUnavailableError, match=f"no control server at {sock_path}") as info:
            c.ping()
        assert isinstance(info.value, TransientError)
    connected.close()


def test_client_reconnects_once_when_the_server_was_restarted(sock_path: str) -> None:
    c = ControlClient(sock_path, timeout=10)
    with ControlServer(sock_path):
        c.ping()
    with ControlServer(sock_path) as second:
        c.ping()  # the old connection is dead; the client reconnects to the new server
        c.hello(0, 0)
        assert "0" in second.status()["ranks"]
    c.close()


def test_client_times_out_on_a_server_that_never_answers(base: Path) -> None:
    path = str(base / "mute.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as mute:
        mute.bind(path)
        mute.listen()  # connections queue in the backlog; nothing ever reads or answers them
        with ControlClient(path, timeout=0.2) as c, pytest.raises(ControlTimeoutError, match=path) as info:
            c.ping()
    assert isinstance(info.value, ControlUnavailableError)


def test_client_rejects_a_reply_to_another_request(base: Path) -> None:
    path = str(base / "liar.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as liar:
        liar.bind(path)
        liar.listen()

        def answer_wrong_id() -> None:
            conn, _ = liar.accept()
            with conn:
                read_frame(conn)
                conn.sendall(frame({"v": 1, "type": "pong", "id": 999}))
                conn.recv(1)

        t = threading.Thread(target=answer_wrong_id)
        t.start()
        try:
            with ControlClient(path, timeout=10) as c, pytest.raises(ControlProtocolError, match="999"):
                c.ping()
        finally:
            t.join(30)


def test_too_many_connections_get_busy(sock_path: str) -> None:
    with ControlServer(sock_path, max_connections=1) as srv, ControlClient(srv.path, timeout=10) as first:
        first.ping()
        with connect(srv.path) as extra:
            reply = read_frame(extra)
            assert (reply["type"], reply["code"]) == ("error", ErrorCode.BUSY)
            assert is_closed(extra)
        with ControlClient(srv.path, timeout=10) as second, pytest.raises(ControlUnavailableError,
                                                                           match="busy"):
            second.ping()
        first.ping()


def test_on_message_sees_each_request_with_its_peer_and_cannot_break_the_server(
        sock_path: str, caplog: pytest.LogCaptureFixture) -> None:
    seen: list[tuple[str, int, int]] = []

    def hook(msg: dict[str, Any], peer: Any) -> None:
        seen.append((msg["type"], peer.pid, peer.uid))
        if msg["type"] == "ping":
            raise RuntimeError("hook bug")

    with caplog.at_level(logging.ERROR, logger="resilient_slurm.control.server"), \
            ControlServer(sock_path, on_message=hook), ControlClient(sock_path, timeout=10) as c:
        c.ping()
        c.hello(0, 0)
        c.status()
    assert seen == [(t, os.getpid(), os.getuid()) for t in ("ping", "hello", "status")]
    assert any("on_message hook failed" in r.getMessage() for r in caplog.records)


# -- paths ---------------------------------------------------------------------------------------------


def test_default_socket_path(base: Path) -> None:
    uid = os.geteuid()
    assert default_socket_path("123_4", "n1", env={"XDG_RUNTIME_DIR": str(base)}) == \
        str(base / "rslurm" / "123_4.n1.sock")
    # srun often carries the login node's XDG_RUNTIME_DIR, which does not exist on the compute node.
    assert default_socket_path(123, "gpu-7", env={"XDG_RUNTIME_DIR": str(base / "missing")}) == \
        f"/tmp/rslurm-{uid}/run/123.gpu-7.sock"
    assert default_socket_path(5, "n1", env={}) == f"/tmp/rslurm-{uid}/run/5.n1.sock"
    assert default_socket_path(5, "n1", runtime_dir="/x") == "/x/5.n1.sock"


@pytest.mark.parametrize("job,node", [("../1", "n1"), ("1", "a/b"), ("", "n1"), ("1", ".hidden")])
def test_default_socket_path_refuses_unsafe_names(job: str, node: str) -> None:
    with pytest.raises(ControlSetupError, match="cannot name a control socket"):
        default_socket_path(job, node, runtime_dir="/x")


def test_socket_path_too_long_for_unix_sockets_is_refused() -> None:
    with pytest.raises(ControlSetupError, match="at most 107"):
        default_socket_path(1, "n1", runtime_dir="/" + "d" * 100)
    with pytest.raises(ControlSetupError, match="at most 107"):
        ControlClient("/" + "d" * 120)
