"""S3 test support: a moto S3 server on loopback, a fault-injecting HTTP proxy in front of it, and fixtures.

Test modules import the fixtures they use (``from s3_support import moto_server, fault_proxy``, or bind
them as module attributes, ``moto_server = s3_support.moto_server``, which ruff does not flag as unused).

``FaultProxy`` is a real TCP/HTTP reverse proxy (a thread per connection, one request per connection)
whose faults a test programs with :meth:`FaultProxy.inject`: an S3 ``503 SlowDown`` (or any other S3
error answer, e.g. ``404 NoSuchUpload``), a connection reset (RST, via SO_LINGER 0) in the middle of the
request or of the response, or a stall longer than the client's read timeout. It counts what it injected and records what it forwarded, with the S3 operation
each request was (``UploadPart``, ``PutObject``, ...), so tests can assert what reached the store.
"""

from __future__ import annotations

import collections
import http.client
import io
import os
import socket
import struct
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

SLOWDOWN = "slowdown"  # 503 SlowDown with an S3 XML error body
ERROR = "error"  # an S3 error answer of the rule's choosing (status and code); nothing reaches the store
RESET_REQUEST = "reset_request"  # RST after reading half the request body; nothing reaches the store
RESET_RESPONSE = "reset_response"  # forwarded to the store, then RST half-way through the response
STALL = "stall"  # no answer for ``stall_seconds``, then RST; nothing reaches the store
FAULTS = (SLOWDOWN, ERROR, RESET_REQUEST, RESET_RESPONSE, STALL)

FAKE_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_REGION": "us-east-1",
}
# Settings of the machine that must not leak into tests (a real profile, endpoint or config file).
UNSET_ENV = ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_CONFIG_FILE",
             "AWS_SHARED_CREDENTIALS_FILE")

_HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "proxy-authenticate", "proxy-authorization",
               "te", "trailer", "trailers", "transfer-encoding", "upgrade", "expect", "content-length"}


def s3_operation(method: str, path: str, query: dict[str, list[str]], headers: dict[str, str]) -> str:
    """The S3 operation a path-style request is (``UploadPart``, ``GetObject``, ...)."""
    has_key = len([p for p in path.split("/") if p]) > 1
    copy = "x-amz-copy-source" in headers
    if method == "PUT":
        if "partNumber" in query and "uploadId" in query:
            return "UploadPartCopy" if copy else "UploadPart"
        if has_key:
            return "CopyObject" if copy else "PutObject"
        return "CreateBucket"
    if method == "POST":
        if "uploads" in query:
            return "CreateMultipartUpload"
        if "uploadId" in query:
            return "CompleteMultipartUpload"
        if "delete" in query:
            return "DeleteObjects"
        return "Post"
    if method == "DELETE":
        if "uploadId" in query:
            return "AbortMultipartUpload"
        return "DeleteObject" if has_key else "DeleteBucket"
    if method == "GET":
        if "uploads" in query:
            return "ListMultipartUploads"
        if "uploadId" in query:
            return "ListParts"
        return "GetObject" if has_key else "ListObjects"
    if method == "HEAD":
        return "HeadObject" if has_key else "HeadBucket"
    return method


@dataclass
class Request:
    """One request the proxy received."""

    seq: int  # 1-based arrival order
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]  # lower-case names
    op: str
    fault: str | None = None  # what was injected, if anything
    rule: Rule | None = None  # the rule that injected it
    status: int | None = None  # the store's answer, when it was forwarded
    body: bytes | None = None  # the request body when it was forwarded and small (< 1 MiB)


@dataclass
class Rule:
    """Inject ``fault`` into requests that ``match`` (all when None): every ``every``-th matching one, at most
    ``times`` times (None: no limit). Built by :meth:`FaultProxy.inject`."""

    fault: str
    match: Callable[[Request], bool] | None = None
    times: int | None = None
    every: int = 1
    status: int = 503  # for ERROR (SLOWDOWN is always 503 SlowDown)
    code: str = "SlowDown"
    seen: int = 0
    injected: int = 0

    def applies(self, req: Request) -> bool:
        if self.times is not None and self.injected >= self.times:
            return False
        if self.match is not None and not self.match(req):
            return False
        self.seen += 1
        if self.seen % self.every:
            return False
        self.injected += 1
        return True


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True
    proxy: FaultProxy


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # so that Expect: 100-continue is answered
    timeout = 30  # a client that vanishes mid-request does not hold a thread forever
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _reset(self) -> None:
        """Abort the connection with an RST (SO_LINGER 0), as a crashing middlebox would."""
        self.close_connection = True
        try:
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
        # The socket closes for real (and sends the RST) only once the file objects made from it are closed.
        for f in (self.rfile, self.wfile):
            try:
                f.close()
            except OSError:
                pass
        self.connection.close()
        self.wfile = io.BytesIO()  # what BaseHTTPRequestHandler still flushes after us goes nowhere

    def _read_body(self, limit: int | None = None) -> bytes:
        """The request body (de-chunked); with ``limit``, stop after about that many bytes."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            out = bytearray()
            while limit is None or len(out) < limit:
                line = self.rfile.readline(65537)
                size = int(line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline(65537) not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    break
                out += self.rfile.read(size)
                self.rfile.readline(3)  # CRLF after the chunk
            return bytes(out)
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n if limit is None else min(n, limit))

    def _handle(self) -> None:
        proxy = self.server.proxy
        split = urlsplit(self.path)
        query = parse_qs(split.query, keep_blank_values=True)
        headers = {k.lower(): v for k, v in self.headers.items()}
        req = proxy._admit(self.command, split.path, query, headers)
        try:
            if req.fault == RESET_REQUEST:
                n = int(self.headers.get("Content-Length") or 0)
                self._read_body(limit=n // 2)
                self._reset()
                return
            body = self._read_body()
            if req.fault == STALL:
                proxy._stopping.wait(proxy.stall_seconds)
                self._reset()
                return
            if req.fault in (SLOWDOWN, ERROR):
                rule = req.rule if req.fault == ERROR else None
                self._send_error(rule.status if rule else 503, rule.code if rule else "SlowDown")
                return
            status, reason, rheaders, rbody = proxy._forward(self.command, self.path, self.headers.items(), body)
            req.status = status
            req.body = body if len(body) < (1 << 20) else None
            raw = self._response_bytes(status, reason, rheaders, rbody)
            if req.fault == RESET_RESPONSE:
                self.wfile.write(raw[: len(raw) // 2])
                self.wfile.flush()
                self._reset()
                return
            self.wfile.write(raw)
            self.wfile.flush()
            self.close_connection = True
        except (ConnectionError, TimeoutError, OSError):
            self.close_connection = True

    def _response_bytes(self, status: int, reason: str, headers: list[tuple[str, str]], body: bytes) -> bytes:
        lines = [f"HTTP/1.1 {status} {reason}"]
        length = None
        for k, v in headers:
            if k.lower() == "content-length":
                length = v
            if k.lower() in _HOP_BY_HOP:
                continue
            lines.append(f"{k}: {v}")
        if self.command == "HEAD" or status in (204, 304):
            if length is not None:  # HEAD: the object's size, which the client reads from here
                lines.append(f"Content-Length: {length}")
            body = b""
        else:
            lines.append(f"Content-Length: {len(body)}")
        lines.append("Connection: close")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body

    def _send_error(self, status: int, code: str) -> None:
        message = "Please reduce your request rate." if code == "SlowDown" else f"{code} (injected)"
        body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
                "<RequestId>FAULTPROXY</RequestId></Error>").encode()
        if self.command == "HEAD":
            body = b""
        self.send_response_only(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)
        self.close_connection = True

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle


class FaultProxy:
    """A reverse proxy on 127.0.0.1 in front of ``upstream`` (``http://host:port``) that injects faults.

    Program it with :meth:`inject`; read :attr:`requests` (everything received, in order),
    :meth:`count` (what reached the store) and :attr:`injected` (fault -> how many)."""

    def __init__(self, upstream: str, *, stall_seconds: float = 3.0) -> None:
        u = urlsplit(upstream)
        self.upstream = (u.hostname or "127.0.0.1", u.port or 80)
        self.stall_seconds = stall_seconds
        self.requests: list[Request] = []
        self.injected: collections.Counter[str] = collections.Counter()
        self._rules: list[Rule] = []
        self._lock = threading.RLock()  # a rule's match may call count()
        self._stopping = threading.Event()
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.proxy = self
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="fault-proxy", daemon=True)

    @property
    def endpoint(self) -> str:
        """The URL clients should use instead of the upstream's."""
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> FaultProxy:
        """Start serving (returns self)."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving; stalled requests end at once."""
        self._stopping.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def trickle(self) -> None:
        """A steady trickle of faults, as a busy store and a lossy network give: about one request in six
        fails (503 SlowDown, a reset while sending the request, a reset while reading the response)."""
        self.inject(SLOWDOWN, every=13)
        self.inject(RESET_REQUEST, every=15)
        self.inject(RESET_RESPONSE, every=17)

    def inject(self, fault: str, *, times: int | None = None, every: int = 1, op: str | None = None,
               match: Callable[[Request], bool] | None = None, status: int = 503,
               code: str = "SlowDown") -> Rule:
        """Inject ``fault`` into every ``every``-th request that is the S3 operation ``op`` (if given) and
        satisfies ``match`` (if given), at most ``times`` times. ``status`` and ``code``: the answer an
        ERROR fault gives. Rules are tried in the order added; the first that applies wins."""
        if fault not in FAULTS:
            raise ValueError(f"unknown fault {fault!r}; use one of {FAULTS}")

        def matches(req: Request) -> bool:
            return (op is None or req.op == op) and (match is None or match(req))

        rule = Rule(fault, matches, times, every, status, code)
        with self._lock:
            self._rules.append(rule)
        return rule

    def clear(self) -> None:
        """Remove every rule (the proxy forwards everything from now on)."""
        with self._lock:
            self._rules.clear()

    def count(self, op: str | None = None, *, since: int = 0) -> int:
        """How many requests (of operation ``op``) reached the store, from request number ``since`` on."""
        with self._lock:
            return sum(1 for r in self.requests[since:] if r.status is not None and (op is None or r.op == op))

    def received(self, op: str | None = None) -> int:
        """How many requests (of operation ``op``) the proxy received, faulty or not."""
        with self._lock:
            return sum(1 for r in self.requests if op is None or r.op == op)

    def _admit(self, method: str, path: str, query: dict[str, list[str]], headers: dict[str, str]) -> Request:
        with self._lock:
            req = Request(len(self.requests) + 1, method, path, query, headers,
                          s3_operation(method, path, query, headers))
            self.requests.append(req)
            for rule in self._rules:
                if rule.applies(req):
                    req.fault, req.rule = rule.fault, rule
                    self.injected[rule.fault] += 1
                    break
        return req

    def _forward(self, method: str, target: str, headers: Any, body: bytes
                 ) -> tuple[int, str, list[tuple[str, str]], bytes]:
        conn = http.client.HTTPConnection(*self.upstream, timeout=60)
        try:
            conn.putrequest(method, target, skip_host=True, skip_accept_encoding=True)
            for k, v in headers:
                if k.lower() not in _HOP_BY_HOP:
                    conn.putheader(k, v)
            if body or method in ("PUT", "POST"):
                conn.putheader("Content-Length", str(len(body)))
            conn.putheader("Connection", "close")
            conn.endheaders(body or None)
            resp = conn.getresponse()
            data = resp.read()  # de-chunked if the store answered chunked; re-framed with Content-Length
            return resp.status, resp.reason, resp.getheaders(), data
        finally:
            conn.close()


class MotoServer:
    """moto's S3 (in this process, threaded werkzeug server) on 127.0.0.1 and a free port."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.endpoint = ""
        self._client: Any = None

    def start(self) -> MotoServer:
        """Start it (returns self)."""
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        return self

    def stop(self) -> None:
        """Stop it."""
        self._server.stop()

    def client(self, endpoint: str | None = None) -> Any:
        """A plain boto3 S3 client talking to the server (or to ``endpoint``), botocore retries off."""
        import boto3
        from botocore.config import Config

        if endpoint is None and self._client is not None:
            return self._client  # clients are thread-safe, and making one costs ~0.1 s
        client = boto3.session.Session().client(
            "s3", endpoint_url=endpoint or self.endpoint, region_name="us-east-1",
            config=Config(retries={"total_max_attempts": 1, "mode": "standard"}))
        if endpoint is None:
            self._client = client
        return client

    def new_bucket(self) -> str:
        """Create a bucket with a fresh name and return the name."""
        name = f"rslurm-test-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def uploads(self, bucket: str, prefix: str = "") -> list[dict[str, Any]]:
        """The incomplete multipart uploads in ``bucket`` (under ``prefix``)."""
        return list(self.client().list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", []))


@pytest.fixture(scope="session")
def moto_server() -> Iterator[MotoServer]:
    """A moto S3 server for the whole session, with fake credentials in this process's environment."""
    saved = {k: os.environ.get(k) for k in (*FAKE_ENV, *UNSET_ENV)}
    os.environ.update(FAKE_ENV)
    for k in UNSET_ENV:
        os.environ.pop(k, None)
    server = MotoServer().start()
    try:
        yield server
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def s3_bucket(moto_server: MotoServer) -> str:
    """A fresh, empty bucket for one test."""
    return moto_server.new_bucket()


@pytest.fixture
def fault_proxy(moto_server: MotoServer) -> Iterator[FaultProxy]:
    """A fault proxy in front of the moto server, with no rules yet, for one test."""
    proxy = FaultProxy(moto_server.endpoint).start()
    try:
        yield proxy
    finally:
        proxy.stop()


@dataclass
class FakeClock:
    """A clock and a sleep for :class:`~resilient_slurm.storage.tier.RateLimiter` that never wait: sleeping
    advances the clock and is recorded."""

    now: float = 1000.0
    slept: list[float] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def clock(self) -> float:
        with self._lock:
            return self.now

    def sleep(self, seconds: float) -> None:
        with self._lock:
            self.slept.append(seconds)
            self.now += seconds


__all__ = ["ERROR", "FAULTS", "FakeClock", "FaultProxy", "MotoServer", "RESET_REQUEST", "RESET_RESPONSE", "Request",
           "Rule", "SLOWDOWN", "STALL", "fault_proxy", "moto_server", "s3_bucket", "s3_operation"]
