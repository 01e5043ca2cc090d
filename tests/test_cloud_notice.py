"""TerminationNoticeWatcher against a real HTTP server on 127.0.0.1 playing AWS, GCE or a generic endpoint."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from conftest import free_port

from resilient_slurm.errors import ConfigError
from resilient_slurm.launcher.cloud import Notice, TerminationNoticeWatcher

AWS_PATH = "/latest/meta-data/spot/instance-action"
GCE_PATH = "/computeMetadata/v1/instance/preempted"
SPOT_BODY = json.dumps({"action": "terminate", "time": "2030-01-01T00:00:00Z"})
SPOT_DEADLINE = 1893456000.0  # 2030-01-01T00:00:00Z
LOGGER = "resilient_slurm.launcher.cloud"


@dataclass
class Seen:
    """One request as the server saw it."""

    method: str
    path: str
    headers: dict[str, str]


# A behaviour maps (server, request) to (status, body); it may block on server.release to be slow.
Behaviour = Callable[["MetadataServer", Seen], tuple[int, str]]


@dataclass
class MetadataServer:
    """A real HTTP server in a thread; records every request."""

    behaviour: Behaviour
    port: int = 0
    seen: list[Seen] = field(default_factory=list)
    release: threading.Event = field(default_factory=threading.Event)
    state: dict = field(default_factory=dict)

    def start(self) -> MetadataServer:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _serve(self) -> None:
                req = Seen(self.command, self.path, {k.lower(): v for k, v in self.headers.items()})
                outer.seen.append(req)
                status, body = outer.behaviour(outer, req)
                data = body.encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:
                    pass  # the client gave up (timeout): expected in the slow-server tests

            do_GET = do_PUT = _serve

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.httpd.daemon_threads = True
        self.httpd.block_on_close = False  # slow handlers are released, not waited for
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                       daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def gets(self) -> list[Seen]:
        return [s for s in self.seen if s.method == "GET"]


@pytest.fixture
def serve() -> Iterator[Callable[..., MetadataServer]]:
    servers: list[MetadataServer] = []

    def start(behaviour: Behaviour, port: int = 0) -> MetadataServer:
        server = MetadataServer(behaviour, port).start()
        servers.append(server)
        return server

    yield start
    for s in servers:
        s.stop()


@pytest.fixture
def watchers() -> Iterator[list[TerminationNoticeWatcher]]:
    made: list[TerminationNoticeWatcher] = []
    yield made
    for w in made:
        w.stop()


class Collector:
    """An on_notice callback that records notices and signals the test."""

    def __init__(self) -> None:
        self.notices: list[Notice] = []
        self.event = threading.Event()

    def __call__(self, notice: Notice) -> None:
        self.notices.append(notice)
        self.event.set()


def wait_until(cond: Callable[[], bool], what: str, limit: float = 10.0) -> None:
    """Poll ``cond`` in short steps; fail (not hang) if it never holds."""
    deadline = time.monotonic() + limit
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.01)


def aws_imds(server: MetadataServer, req: Seen) -> tuple[int, str]:
    """IMDSv2: PUT token needs the TTL header; GET needs the current token; 404 until state['notice']."""
    token = server.state.setdefault("token", "tok-1")
    if req.method == "PUT":
        if req.path != "/latest/api/token" or "x-aws-ec2-metadata-token-ttl-seconds" not in req.headers:
            return 400, "missing ttl"
        return 200, token
    if req.headers.get("x-aws-ec2-metadata-token") != token:
        return 401, "unauthorized"
    if req.path != AWS_PATH:
        return 404, "no such path"
    gets = server.state["gets"] = server.state.get("gets", 0) + 1
    if gets > server.state.get("notice_after", 1_000_000):
        return 200, server.state.get("body", SPOT_BODY)
    return 404, "Not Found"


def test_aws_404_then_200_notice_exactly_once(serve, watchers) -> None:
    server = serve(aws_imds)
    server.state["notice_after"] = 2
    got = Collector()
    w = TerminationNoticeWatcher(server.url(AWS_PATH), kind="aws", interval=0.01, on_notice=got)
    watchers.append(w)
    w.start()
    assert got.event.wait(10), "no notice seen"
    # The thread ends by itself after the notice: no second callback can come.
    wait_until(lambda: not w.is_alive(), "the watcher thread to end after the notice")
    assert got.notices == [Notice("aws", "terminate", SPOT_DEADLINE, SPOT_BODY)]
    assert w.notice == got.notices[0]
    assert len(server.gets()) == 3  # 404, 404, 200 and no poll after the notice
    w.stop()
    assert len(got.notices) == 1


def test_aws_imdsv2_token_flow_checked_by_the_server(serve) -> None:
    server = serve(aws_imds)
    now = [1000.0]
    w = TerminationNoticeWatcher(server.url(AWS_PATH), kind="aws", on_notice=print, token_ttl=60,
                                 clock=lambda: now[0])
    assert w.poll_once() is None and w.poll_once() is None
    # One token for both polls, asked for with the TTL header, presented on every GET.
    assert [s.method for s in server.seen] == ["PUT", "GET", "GET"]
    assert server.seen[0].headers["x-aws-ec2-metadata-token-ttl-seconds"] == "60"
    assert all(s.headers["x-aws-ec2-metadata-token"] == "tok-1" for s in server.gets())

    # The metadata service forgets the token (restart): 401, a fresh token, the same poll retried.
    server.state["token"] = "tok-2"
    server.state["notice_after"] = 0
    n = w.poll_once()
    assert n == Notice("aws", "terminate", SPOT_DEADLINE, SPOT_BODY)
    assert [(s.method, s.headers.get("x-aws-ec2-metadata-token")) for s in server.seen[3:]] == [
        ("GET", "tok-1"), ("PUT", None), ("GET", "tok-2")]

    # Renewed before it expires (80% of the TTL), by the injected clock.
    before = len(server.seen)
    now[0] += 47  # tok-2 was fetched at 1000 with a 60 s TTL: still fresh until 1048
    w.poll_once()
    now[0] += 2
    w.poll_once()
    assert [s.method for s in server.seen[before:]] == ["GET", "PUT", "GET"]


def aws_v1_only(server: MetadataServer, req: Seen) -> tuple[int, str]:
    """An IMDS without v2: PUT is refused (or slow, in state['slow_put']); GET works without a token."""
    if req.method == "PUT":
        if server.state.get("slow_put"):
            server.release.wait(5)
        return 405, "Method Not Allowed"
    assert "x-aws-ec2-metadata-token" not in req.headers
    return 200, SPOT_BODY


@pytest.mark.parametrize("slow_put", [False, True], ids=["put-refused", "put-times-out"])
def test_aws_falls_back_to_imdsv1(serve, caplog, slow_put: bool) -> None:
    # A timed-out PUT is what a container sees with the IMDSv2 hop limit at 1.
    caplog.set_level(logging.WARNING, logger=LOGGER)
    server = serve(aws_v1_only)
    server.state["slow_put"] = slow_put
    w = TerminationNoticeWatcher(server.url(AWS_PATH), kind="aws", on_notice=print, timeout=0.3)
    assert w.poll_once() == Notice("aws", "terminate", SPOT_DEADLINE, SPOT_BODY)
    assert [s.method for s in server.seen] == ["PUT", "GET"]
    assert any("using IMDSv1" in r.getMessage() for r in caplog.records)


def gce(server: MetadataServer, req: Seen) -> tuple[int, str]:
    """GCE metadata: 403 without Metadata-Flavor: Google; FALSE until state['preempted']."""
    if req.headers.get("metadata-flavor") != "Google":
        return 403, "Missing Metadata-Flavor:Google header."
    if req.path != GCE_PATH:
        return 404, "not found"
    return 200, "TRUE" if server.state.get("preempted") else "FALSE"


def test_gce_sends_the_metadata_header(serve, caplog) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    server = serve(gce)
    w = TerminationNoticeWatcher(server.url(GCE_PATH), kind="gce", on_notice=print)
    assert w.poll_once() is None
    server.state["preempted"] = True
    assert w.poll_once() == Notice("gce", "preempted", None, "TRUE")
    assert all(s.headers.get("metadata-flavor") == "Google" for s in server.seen)
    # The server really enforces the header: a query without it is refused and logged, not a notice.
    plain = TerminationNoticeWatcher(server.url(GCE_PATH), kind="generic", on_notice=print)
    assert plain.poll_once() is None
    assert any("unexpected HTTP 403" in r.getMessage() for r in caplog.records)


def test_gce_unexpected_body_is_logged_not_a_notice(serve, caplog) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    server = serve(lambda s, r: (200, "maybe"))
    w = TerminationNoticeWatcher(server.url(GCE_PATH), kind="gce", on_notice=print)
    assert w.poll_once() is None and w.errors == 1
    assert any("unexpected body 'maybe'" in r.getMessage() for r in caplog.records)


def test_server_down_then_up_polling_continues(serve, watchers, caplog) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    port = free_port()  # nothing listens here yet
    got = Collector()
    w = TerminationNoticeWatcher(f"http://127.0.0.1:{port}{AWS_PATH}", kind="aws", interval=0.01,
                                 on_notice=got, timeout=1.0)
    watchers.append(w)
    w.start()
    wait_until(lambda: w.errors >= 3, "three failed polls")
    assert w.is_alive() and not got.notices
    server = serve(aws_imds, port=port)
    server.state["notice_after"] = 0
    assert got.event.wait(10), "no notice after the server came up"
    assert got.notices == [Notice("aws", "terminate", SPOT_DEADLINE, SPOT_BODY)]
    # Rate-limited: many failed polls, one warning per kind of failure within log_every (60 s).
    failed = [r for r in caplog.records if "poll of" in r.getMessage() and "ConnectionError" in r.getMessage()]
    assert len(failed) == 1


def test_failure_warnings_are_rate_limited_by_the_injected_clock(caplog) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    now = [0.0]
    w = TerminationNoticeWatcher(f"http://127.0.0.1:{free_port()}/x", kind="generic", on_notice=print,
                                 clock=lambda: now[0], log_every=60.0)
    for _ in range(5):
        assert w.poll_once() is None
    assert len(caplog.records) == 1
    now[0] += 60.0
    w.poll_once()
    assert len(caplog.records) == 2
    assert "4 similar messages suppressed" in caplog.records[1].getMessage()
    assert w.errors == 6 and w.polls == 6


def slow(server: MetadataServer, req: Seen) -> tuple[int, str]:
    server.release.wait(10)  # until the test ends: far beyond the client's timeout
    return 200, "late"


@pytest.mark.timeout(60)
def test_slow_server_timeout_honoured_no_hang(serve, watchers, caplog) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    server = serve(slow)
    w = TerminationNoticeWatcher(server.url("/notice"), kind="generic", on_notice=print, timeout=0.2,
                                 interval=0.01)
    assert w.poll_once() is None and w.errors == 1
    assert any("ReadTimeout" in r.getMessage() for r in caplog.records)
    watchers.append(w)
    w.start()
    wait_until(lambda: w.polls >= 3, "polling to go on after timeouts")
    w.stop()
    assert not w.is_alive()
    assert w.notice is None


@pytest.mark.parametrize(("body", "action", "warning"), [
    ("{not json", "unknown", "not the documented JSON"),
    ('["terminate"]', "unknown", "not the documented JSON"),
    (json.dumps({"action": "stop"}), "stop", "no usable 'time'"),
    (json.dumps({"action": "hibernate", "time": "soon"}), "hibernate", "unparsable 'time'"),
])
def test_aws_malformed_body_is_a_notice_without_deadline(serve, caplog, body: str, action: str,
                                                         warning: str) -> None:
    # Documented choice: the path answers 200 only when an action is scheduled, so act on it anyway.
    caplog.set_level(logging.WARNING, logger=LOGGER)
    server = serve(aws_imds)
    server.state.update(notice_after=0, body=body)
    w = TerminationNoticeWatcher(server.url(AWS_PATH), kind="aws", on_notice=print)
    assert w.poll_once() == Notice("aws", action, None, body)
    assert any(warning in r.getMessage() for r in caplog.records)


def test_aws_time_without_zone_is_utc(serve) -> None:
    body = json.dumps({"action": "terminate", "time": "2030-01-01T00:00:00"})
    server = serve(aws_imds)
    server.state.update(notice_after=0, body=body)
    w = TerminationNoticeWatcher(server.url(AWS_PATH), kind="aws", on_notice=print)
    n = w.poll_once()
    assert n is not None and n.deadline_epoch == SPOT_DEADLINE


def test_generic_any_200_is_a_notice(serve, caplog) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    answers = iter([(404, ""), (500, "oops"), (200, "shutting down")])
    server = serve(lambda s, r: next(answers))
    w = TerminationNoticeWatcher(server.url("/notice"), kind="generic", on_notice=print)
    assert w.poll_once() is None
    assert w.poll_once() is None
    assert any("unexpected HTTP 500" in r.getMessage() for r in caplog.records)
    assert w.poll_once() == Notice("generic", "notice", None, "shutting down")


def test_injected_sleep_gets_the_interval(serve) -> None:
    server = serve(aws_imds)
    server.state["notice_after"] = 2
    slept: list[float] = []
    got = Collector()
    w = TerminationNoticeWatcher(server.url(AWS_PATH), kind="aws", interval=123.0, on_notice=got,
                                 sleep=slept.append)
    w.start()
    assert got.event.wait(10)
    wait_until(lambda: not w.is_alive(), "the watcher thread to end")
    assert slept == [123.0, 123.0]  # after each of the two 404s, none after the notice


def test_callback_error_is_logged_and_does_not_repeat(serve, caplog) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    server = serve(lambda s, r: (200, "go"))
    calls = []

    def boom(n: Notice) -> None:
        calls.append(n)
        raise RuntimeError("launcher bug")

    w = TerminationNoticeWatcher(server.url("/n"), kind="generic", interval=0.01, on_notice=boom).start()
    wait_until(lambda: not w.is_alive(), "the watcher thread to end")
    assert len(calls) == 1 and w.notice == calls[0]
    assert any("on_notice callback failed" in r.getMessage() and r.exc_info for r in caplog.records)


def test_proxy_environment_is_ignored(serve, monkeypatch) -> None:
    # A job's HTTP_PROXY must not route metadata queries (link-local) through a proxy.
    for var in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{free_port()}")
    server = serve(lambda s, r: (200, "go"))
    w = TerminationNoticeWatcher(server.url("/n"), kind="generic", on_notice=print)
    assert w.poll_once() == Notice("generic", "notice", None, "go")


def test_stop_is_prompt_with_the_default_sleep(serve) -> None:
    server = serve(aws_imds)
    w = TerminationNoticeWatcher(server.url(AWS_PATH), kind="aws", interval=3600.0, on_notice=print).start()
    wait_until(lambda: len(server.gets()) >= 1, "the first poll")
    w.stop(join_timeout=30)  # the hour-long interval is cut short by the stop event
    assert not w.is_alive()
    with pytest.raises(RuntimeError, match="twice"):
        w.start()


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"kind": "azure"}, "aws, gce, generic"),
    ({"kind": "generic"}, "needs a url"),
    ({"kind": "aws", "url": "ftp://x/y"}, "http:// or https://"),
    ({"kind": "aws", "interval": 0}, "interval"),
    ({"kind": "gce", "timeout": -1}, "timeout"),
])
def test_bad_configuration(kwargs: dict, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        TerminationNoticeWatcher(on_notice=print, **kwargs)


def test_default_urls() -> None:
    assert TerminationNoticeWatcher(on_notice=print).url == "http://169.254.169.254" + AWS_PATH
    assert TerminationNoticeWatcher(kind="gce", on_notice=print).url == (
        "http://metadata.google.internal" + GCE_PATH)
