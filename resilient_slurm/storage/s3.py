"""``S3Tier``: a durable tier on an S3 bucket prefix (AWS S3 or any S3-compatible store).

Uploads are verified end to end. Every request body carries ``Content-MD5`` so the store checks what
arrived, and every part's returned ETag is compared with the MD5 computed here. The whole file's xxh3 is
computed on the same buffers, in order, while the parts are in flight; an upload whose source does not
match the manifest is aborted and nothing is published. Objects carry their xxh3 in the ``xxh3`` user
metadata so a restarted daemon can :meth:`~S3Tier.stat` instead of reading them back.

Multipart uploads also use S3's flexible checksums, as plain headers (never aws-chunked bodies with
trailers): the upload is created with ``ChecksumAlgorithm=CRC32``, every part carries the CRC32 computed
here (``x-amz-checksum-crc32``) next to its Content-MD5, and CompleteMultipartUpload lists each part's
CRC32, so the store checks every part twice and records a composite CRC32 for the object. Without an
algorithm, AWS (and moto, which imitates it) computes a full-object CRC64NVME when the upload completes;
moto does it by copying the whole object twice more and hashing it, which doubled its CPU per upload in
bench/bench_drain.py. A store that refuses these headers (some S3-compatible ones answer NotImplemented or
InvalidArgument) is detected on the first multipart upload: the tier logs it once, aborts that upload and
goes on with Content-MD5 alone. Bodies that carry Content-MD5 (parts, single PUTs) are sent with
``UNSIGNED-PAYLOAD`` also over plain HTTP, as botocore already does over HTTPS: the signed Content-MD5 and
CRC32 headers cover them, and SHA-256 payload signing cost the client about 0.3 s of CPU per 512 MiB.

Files larger than ``part_size`` go up as multipart uploads, ``threads`` parts at a time. An upload
interrupted by a transient failure (or a killed daemon) is left in place: the next ``put_file`` of the
same key finds it, keeps every part whose size and MD5 match the local bytes (and its CRC32, where the
store lists one), and sends only the rest, with the checksum algorithm the upload was created with.
The daemon's :meth:`~S3Tier.cleanup_incomplete` aborts those it will not resume.

Retries are ours, not botocore's (its own are turned off): tenacity with full-jitter exponential backoff,
bounded by ``max_attempts`` and a time limit, and only for transient failures (5xx, throttling, timeouts,
dropped connections). Everything else fails at once with a message that says what to fix.
"""

from __future__ import annotations

import base64
import builtins
import contextlib
import dataclasses
import hashlib
import logging
import math
import os
import random
import secrets
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any, TypeVar

import xxhash
from tenacity import RetryCallState, Retrying, retry_if_exception, stop_after_attempt, stop_after_delay
from tenacity.stop import stop_base
from tenacity.wait import wait_random_exponential

from ..errors import (
    ConfigError,
    CorruptCheckpointError,
    ObjectNotFoundError,
    ResilientSlurmError,
    StorageError,
    TransientStorageError,
)
from .fileio import fsync_dir, open_regular, unpublished_on_error
from .posix import TMP_MARK
from .tier import (
    IncompleteTransfer,
    ObjectInfo,
    Progress,
    RateLimiter,
    ReadRange,
    StorageTier,
    TransferStats,
    join_key,
)

try:
    import botocore.loaders  # installed with boto3 (resilient_slurm[s3]); clients are botocore's
    import botocore.session
    import urllib3.exceptions
    from botocore.config import Config
    from botocore.exceptions import (
        BotoCoreError,
        ChecksumError,
        ClientError,
        HTTPClientError,
        IncompleteReadError,
        NoCredentialsError,
        PartialCredentialsError,
        SSLError,
    )
    from botocore.exceptions import ConnectionError as BotoConnectionError
except ImportError as exc:  # pragma: no cover - the registry turns this into an install hint
    raise ImportError("S3 durable storage needs boto3: pip install 'resilient_slurm[s3]'", name="boto3") from exc

log = logging.getLogger(__name__)

T = TypeVar("T")

MIN_PART = 5 << 20  # S3's smallest part (every part but the last)
MAX_PART = 5 << 30  # S3's largest part, and largest single PUT
MAX_PARTS = 10_000  # S3's most parts per upload
MAX_OBJECT = 5 << 40  # S3's largest object
META = "xxh3"  # user metadata key holding the object's xxh3 (x-amz-meta-xxh3)

# Error codes worth retrying. RequestTimeout, BadDigest and IncompleteBody are 400s, but they mean the
# body was cut or damaged on the way (the Content-MD5 check caught it), so sending it again can succeed.
TRANSIENT_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "RequestThrottled", "TooManyRequests",
    "RequestLimitExceeded", "RequestTimeout", "RequestTimeoutException", "InternalError",
    "ServiceUnavailable", "BadDigest", "IncompleteBody", "OperationAborted",
})
ACCESS_CODES = frozenset({"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
                          "InvalidToken", "TokenRefreshRequired", "AllAccessDisabled", "AccountProblem"})
NOT_FOUND_CODES = frozenset({"NoSuchKey", "404", "NotFound"})
# A conditional write the store refused for its condition (409: two conditional writes of the key at once, AWS).
_CONDITION_CODES = frozenset({"PreconditionFailed", "412", "ConditionalRequestConflict", "409"})
UPDATE_ATTEMPTS = 20  # update_bytes: reads again after another writer came first, at most this many times
# With these server-side encryptions the ETag is not the MD5 of the body (Content-MD5 still is checked).
_OPAQUE_ETAG_SSE = frozenset({"aws:kms", "aws:kms:dsse"})
CHECKSUM_ALGORITHM = "CRC32"  # the flexible checksum of multipart uploads (see the module docstring)
# How stores that do not implement flexible checksums refuse their headers (with "checksum" in the message).
_REFUSAL_CODES = frozenset({"NotImplemented", "InvalidArgument", "InvalidRequest"})

_TRANSIENT_TYPES: tuple[type[BaseException], ...] = (
    HTTPClientError,  # ConnectionClosedError, ReadTimeoutError, ResponseStreamingError
    BotoConnectionError,  # EndpointConnectionError, ConnectTimeoutError, ProxyConnectionError
    IncompleteReadError,  # a body shorter than its Content-Length
    ChecksumError,
    urllib3.exceptions.ProtocolError,  # connection reset / aborted while sending or reading
    urllib3.exceptions.TimeoutError,
    ConnectionError,  # the builtin one: ConnectionResetError, BrokenPipeError, ...
    TimeoutError,
)


_LOADER_LOCK = threading.Lock()
_LOADER: Any = None


def _new_client(**kwargs: Any) -> Any:
    """An S3 client from a botocore session of our own (the default one is not safe to create clients
    from in several threads). Sessions share one model loader per process, since parsing the S3 service
    model costs ~0.1 s each time otherwise; credentials and configuration are still resolved afresh for
    every tier. The lock covers the loader's cache; the client itself is thread-safe."""
    global _LOADER
    with _LOADER_LOCK:
        if _LOADER is None:
            _LOADER = botocore.loaders.create_loader()
        session = botocore.session.get_session()
        session.register_component("data_loader", _LOADER)
        return session.create_client("s3", **kwargs)


class _Retryable(Exception):
    """A failure we detect ourselves that is worth another attempt (e.g. keys a batch delete skipped)."""


class _Cancelled(Exception):
    """A part of a transfer that was not attempted because another part already failed."""


class _ChecksumsRefused(StorageError):
    """A multipart upload failed because the store refuses flexible checksums; it was aborted."""


class _StopWhenSet(stop_base):
    """Stop retrying once ``event`` is set (another part of the same transfer failed for good)."""

    def __init__(self, event: threading.Event) -> None:
        self.event = event

    def __call__(self, retry_state: RetryCallState) -> bool:
        return self.event.is_set()


def _error_code(exc: BaseException) -> str:
    if isinstance(exc, ClientError):
        return str(exc.response.get("Error", {}).get("Code", "") or "")
    return ""


def _http_status(exc: BaseException) -> int:
    if isinstance(exc, ClientError):
        return int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    return 0


def is_transient(exc: BaseException) -> bool:
    """Whether an S3 call that raised ``exc`` may succeed when tried again."""
    if isinstance(exc, ClientError):
        status = _http_status(exc)
        if status == 501 or _error_code(exc) == "NotImplemented":
            return False  # a feature the store lacks stays lacking
        return status >= 500 or status == 429 or _error_code(exc) in TRANSIENT_CODES
    if isinstance(exc, SSLError) and "CERTIFICATE" in str(exc).upper():
        return False  # a certificate the client refuses stays refused
    return isinstance(exc, (_Retryable, *_TRANSIENT_TYPES))


def _describe(exc: BaseException | None) -> str:
    if exc is None:
        return "no error"
    if isinstance(exc, ClientError):
        err = exc.response.get("Error", {})
        msg = err.get("Message") or ""
        return f"HTTP {_http_status(exc)} {err.get('Code', '?')}" + (f": {msg}" if msg else "")
    return f"{type(exc).__name__}: {exc}"


def _md5(data: bytes | bytearray) -> bytes:
    # MD5 here is S3's integrity check, not security: say so, or FIPS-mode hosts refuse it.
    return hashlib.md5(data, usedforsecurity=False).digest()


def _md5_b64(digest: bytes) -> str:
    return base64.b64encode(digest).decode("ascii")


def _crc32_b64(data: bytes | bytearray) -> str:
    """The CRC32 of ``data`` as S3 writes it (``x-amz-checksum-crc32``: base64 of the 4 big-endian bytes)."""
    return base64.b64encode(zlib.crc32(data).to_bytes(4, "big")).decode("ascii")


def _refuses_checksums(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or the S3 error it wraps) is a store refusing the flexible-checksum headers."""
    cause = exc.__cause__ if isinstance(exc, ResilientSlurmError) else exc
    if not isinstance(cause, ClientError) or _error_code(cause) not in _REFUSAL_CODES:
        return False
    return "checksum" in str(cause.response.get("Error", {}).get("Message") or "").lower()


def _sign_without_payload(config: Any) -> Callable[..., None]:
    """A ``before-sign`` hook: sign the request with ``UNSIGNED-PAYLOAD`` (see the module docstring). Only
    for requests whose body carries Content-MD5; botocore itself does this over HTTPS, not over HTTP."""
    unsigned = config.merge(Config(s3={"payload_signing_enabled": False}))

    def hook(request: Any, **_: Any) -> None:
        if "Content-MD5" in request.headers:
            request.context["client_config"] = unsigned

    return hook


def _etag(value: str | None) -> str:
    return (value or "").strip('"').lower()


def _opaque_etag(response: dict[str, Any]) -> bool:
    return response.get("ServerSideEncryption") in _OPAQUE_ETAG_SSE or "SSECustomerAlgorithm" in response


def _check_key(key: str) -> str:
    # The same rules as PosixTier, so a key means the same object on every tier.
    parts = [p for p in key.split("/") if p]
    if not parts or any(p in (".", "..") for p in parts):
        raise StorageError(f"invalid key {key!r}: empty or escapes the tier root")
    return "/".join(parts)


def _first_cause(exc: BaseException, pending: list[Future[Any]]) -> BaseException:
    """The error to report for a parallel transfer that failed with ``exc`` while ``pending`` (finished
    now) were in flight: not a part skipped because of another's failure, and a permanent failure before
    a transient one (parts cut short by the cancellation report transient errors)."""
    if not isinstance(exc, Exception):
        return exc  # KeyboardInterrupt and the like win
    errors = [exc] + [e for f in pending if not f.cancelled() and (e := f.exception()) is not None]
    real = [e for e in errors if not isinstance(e, _Cancelled)]
    if not real:
        return exc
    return next((e for e in real if not isinstance(e, TransientStorageError)), real[0])


@dataclass
class _Part:
    number: int
    size: int
    buf: bytearray
    md5: bytes
    etag: str
    reused: bool
    crc: str | None = None  # its CRC32 (base64), in an upload created with ChecksumAlgorithm=CRC32


class S3Tier(StorageTier):
    """An S3 bucket prefix as a durable tier (see the module docstring).

    ``location`` is ``bucket/prefix`` (what follows ``s3://``). Credentials come from boto3's usual chain
    (environment, profile, instance role); ``endpoint_url`` (or ``AWS_ENDPOINT_URL_S3`` /
    ``AWS_ENDPOINT_URL``, which boto3 reads itself) points at an S3-compatible store. ``part_size`` is
    the multipart part size (raised automatically for files that would need more than 10,000 parts).
    One request is tried at most ``max_attempts`` times and for at most ``retry_timeout`` seconds, with
    full-jitter exponential backoff starting at ``backoff`` seconds and capped at ``max_backoff``.
    ``client``: a ready boto3 S3 client to use instead (tests); it is not closed by :meth:`close`.
    """

    def __init__(self, location: str, *, threads: int = 8, limiter: RateLimiter | None = None,
                 endpoint_url: str | None = None, region: str | None = None, part_size: int = 64 << 20,
                 max_attempts: int = 8, connect_timeout: float = 10, read_timeout: float = 60,
                 client: Any = None, backoff: float = 0.5, max_backoff: float = 20.0,
                 retry_timeout: float = 300.0) -> None:
        bucket, _, prefix = location.strip("/").partition("/")
        if not bucket:
            raise ConfigError(f"durable=s3://{location}: no bucket; use s3://bucket/prefix")
        if not MIN_PART <= part_size <= MAX_PART:
            raise ConfigError(f"S3 part_size={part_size}: must be between {MIN_PART} (5 MiB) and {MAX_PART} "
                              "(5 GiB) bytes, S3's limits for a part")
        if max_attempts < 1:
            raise ConfigError(f"S3 max_attempts={max_attempts}: must be >= 1")
        self.bucket = bucket
        self.prefix = "/".join(p for p in prefix.split("/") if p)
        self.url = f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"
        self.threads = max(1, threads)
        self.limiter = limiter or RateLimiter(None)
        self.part_size = part_size
        self.max_attempts = max_attempts
        self.retry_timeout = retry_timeout
        self._wait = wait_random_exponential(multiplier=backoff, max=max_backoff)
        self._own_client = client is None
        if client is None:
            config = Config(
                # Retries are ours (tenacity, counted in TransferStats): botocore's would hide them and
                # multiply with ours. (Its "max_attempts" counts retries, not attempts: 1 would still
                # retry once; "total_max_attempts" counts the first attempt.)
                retries={"total_max_attempts": 1, "mode": "standard"},
                connect_timeout=connect_timeout,
                read_timeout=read_timeout,
                # Every worker thread holds a connection, and the daemon's other threads stat/put_bytes
                # meanwhile: a smaller pool would make them queue (and warn) inside urllib3.
                max_pool_connections=max(10, 2 * self.threads),
                # Content-MD5 already protects every body we send; the newer default CRC32 headers are
                # extra work and are refused by some S3-compatible stores.
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
            )
            client = _new_client(endpoint_url=endpoint_url, region_name=region, config=config)
            for op in ("UploadPart", "PutObject"):
                client.meta.events.register(f"before-sign.s3.{op}", _sign_without_payload(config))
        self._client = client
        # Multipart uploads use CRC32 flexible checksums until the store refuses them (see the docstring).
        self._flexible = True
        self._lock = threading.Lock()  # guards TransferStats counters updated from worker threads
        self._pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="rslurm-s3")
        # Part buffers in memory, all transfers of the tier together: the daemon runs several at once,
        # and each may otherwise hold 2 x threads parts (1 GiB at the defaults).
        self._budget = threading.Semaphore(2 * self.threads)
        # Full-size part buffers kept across transfers: fresh 64 MiB buffers cost page faults on every
        # file (measured: reading 512 MiB into fresh buffers 0.38 s, into reused ones 0.08 s).
        self._spare: dict[int, list[bytearray]] = {}

    def _take_buffer(self, n: int) -> bytearray:
        with self._lock:
            spare = self._spare.get(n)
            if spare:
                return spare.pop()
        return bytearray(n)

    def _give_buffer(self, buf: bytearray) -> None:
        with self._lock:
            spare = self._spare.setdefault(len(buf), [])
            if len(spare) < 2 * self.threads:
                spare.append(buf)

    def _reserve(self, pending: Callable[[], int], drain_one: Callable[[], None]) -> None:
        """Take one part buffer from the tier's budget. While it has parts in flight, a transfer drains its
        own oldest part instead of waiting: two transfers each waiting for the other's buffers would
        never finish."""
        while not self._budget.acquire(blocking=False):
            if pending():
                drain_one()
            else:
                self._budget.acquire()
                return

    # ------------------------------------------------------------------ keys and messages
    def _full(self, key: str) -> str:
        return join_key(self.prefix, _check_key(key))

    def _rel(self, full: str) -> str:
        return full[len(self.prefix) + 1:] if self.prefix else full

    def _base(self, prefix: str) -> str:
        """The listing prefix for everything under ``prefix/`` (``""``: the whole tier)."""
        if prefix.strip("/"):
            return self._full(prefix) + "/"
        return self.prefix + "/" if self.prefix else ""

    def _where(self, full: str) -> str:
        return f"s3://{self.bucket}/{full}"

    @property
    def endpoint(self) -> str:
        """The endpoint the client talks to (for messages)."""
        return str(getattr(getattr(self._client, "meta", None), "endpoint_url", "") or "the default S3 endpoint")

    # ------------------------------------------------------------------ retries
    def _call(self, what: str, full: str, fn: Callable[[], T], *, stats: TransferStats | None = None,
              cancel: threading.Event | None = None) -> T:
        """Run ``fn`` (one S3 request) with our retries; wrap its final failure in a StorageError.

        ``what`` and ``full`` name the request in logs and messages ("upload part 3/7 of", full key).
        Errors of this package raised by ``fn`` pass through unchanged."""
        attempts = 0

        def attempt() -> T:
            nonlocal attempts
            attempts += 1
            return fn()

        def before_sleep(state: RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome is not None else None
            if stats is not None:
                with self._lock:
                    stats.retries += 1
            delay = state.next_action.sleep if state.next_action is not None else 0.0
            log.warning("S3 %s %s: attempt %d/%d failed (%s); retrying in %.2fs", what, self._where(full),
                        state.attempt_number, self.max_attempts, _describe(exc), delay)

        stop: stop_base = stop_after_attempt(self.max_attempts) | stop_after_delay(self.retry_timeout)
        if cancel is not None:
            stop = stop | _StopWhenSet(cancel)
        retrying = Retrying(stop=stop, wait=self._wait, retry=retry_if_exception(is_transient), reraise=True,
                            before_sleep=before_sleep)
        try:
            return retrying(attempt)
        except ResilientSlurmError:
            raise
        except (ClientError, BotoCoreError, urllib3.exceptions.HTTPError, OSError, _Retryable) as exc:
            raise self._wrap(exc, what, full, attempts) from exc

    def _wrap(self, exc: BaseException, what: str, full: str, attempts: int) -> StorageError:
        """The error to raise for ``exc``, naming the object and what to do about it."""
        where = self._where(full)
        code = _error_code(exc)
        if is_transient(exc):
            return TransientStorageError(
                f"S3 {what} {where} failed after {attempts} attempt(s) ({_describe(exc)}): the store at "
                f"{self.endpoint} is throttling or unreachable. Try again later, or check the network and "
                "the endpoint (max_attempts raises the retry budget)."
            )
        if code in NOT_FOUND_CODES:
            return ObjectNotFoundError(f"{where}: does not exist")
        if code == "NoSuchBucket":
            return StorageError(f"S3 {what} {where}: bucket {self.bucket!r} does not exist at {self.endpoint}; "
                                "create it or fix the durable URL (RSLURM_DURABLE)")
        if code == "NoSuchUpload":
            # Someone (another daemon's cleanup_incomplete) aborted the upload under us: a new put_file
            # starts a fresh one, so this is worth retrying at the caller's level.
            return TransientStorageError(f"S3 {what} {where}: the multipart upload was aborted meanwhile "
                                         "(by another process's cleanup?); put_file again starts a new one")
        if code == "PreconditionFailed":
            return TransientStorageError(f"S3 {what} {where}: the object was replaced while it was being read; "
                                         "read it again")
        if code in ACCESS_CODES or _http_status(exc) == 403:
            return StorageError(f"S3 {what} {where}: access denied ({_describe(exc)}); check the credentials "
                                "(AWS_PROFILE, AWS_ACCESS_KEY_ID, the instance role) and the bucket policy")
        if isinstance(exc, (NoCredentialsError, PartialCredentialsError)):
            return StorageError(f"S3 {what} {where}: no usable AWS credentials ({exc}); set AWS_ACCESS_KEY_ID "
                                "and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE, or run with an instance role")
        return StorageError(f"S3 {what} {where} failed: {_describe(exc)}. Not retried (retrying cannot fix "
                            f"it): check the request, the bucket's settings and the store at {self.endpoint}")

    def _pages(self, what: str, full: str, method: Callable[..., dict[str, Any]], args: dict[str, Any],
               markers: dict[str, str], *, stats: TransferStats | None = None) -> Iterator[dict[str, Any]]:
        """Every page of a paginated listing, each page fetched with retries. ``markers`` maps a request
        parameter to the response field that continues the listing."""
        args = dict(args)
        while True:
            page = self._call(what, full, lambda: method(**args), stats=stats)
            yield page
            if not page.get("IsTruncated"):
                return
            nxt = {req: page.get(resp) for req, resp in markers.items()}
            if not any(nxt.values()):  # truncated without a marker: a broken store; do not loop forever
                return
            args.update({k: v for k, v in nxt.items() if v})

    # ------------------------------------------------------------------ uploads
    def put_file(self, src: str, key: str, *, size: int, checksum: str,
                 progress: Progress | None = None) -> TransferStats:
        """See :meth:`StorageTier.put_file`: one PUT up to ``part_size``, a (resumed) multipart upload above."""
        full = self._full(key)
        t0 = time.perf_counter()
        stats = TransferStats(key=key)
        try:
            fd = open_regular(src, what="a local shard")  # never a link, never blocking on a FIFO
        except FileNotFoundError as exc:
            raise ObjectNotFoundError(f"{src}: does not exist") from exc
        except OSError as exc:
            raise StorageError(f"{src}: cannot open it for upload to {self._where(full)}: {exc}") from exc
        try:
            actual = os.fstat(fd).st_size
            if actual != size:
                raise CorruptCheckpointError(f"{src}: local shard is {actual} bytes, the manifest says {size}; "
                                             f"it was not uploaded to {self._where(full)}")
            if size > MAX_OBJECT:
                raise StorageError(f"{src}: {size} bytes is more than S3's largest object (5 TiB); split it")
            if size <= self.part_size:
                with self._budget:
                    self._put_single(fd, src, full, size, checksum, stats)
                if progress and size:
                    progress(size)
            else:
                try:
                    self._put_multipart(fd, src, full, size, checksum, progress, stats)
                except _ChecksumsRefused:
                    # That upload was aborted and the tier no longer sends flexible checksums: once more.
                    stats.bytes = stats.reused_bytes = 0
                    self._put_multipart(fd, src, full, size, checksum, progress, stats)
        finally:
            os.close(fd)
        stats.seconds = time.perf_counter() - t0
        return stats

    def _no_flexible(self, full: str, exc: BaseException) -> None:
        if self._flexible:
            self._flexible = False
            log.warning("S3 %s: the store at %s refuses flexible checksums (%s); multipart uploads go on "
                        "with Content-MD5 alone", self._where(full), self.endpoint,
                        _describe(exc.__cause__ if isinstance(exc, ResilientSlurmError) else exc))

    def _read(self, fd: int, src: str, buf: bytearray | memoryview, off: int) -> None:
        mv = memoryview(buf)
        got = 0
        try:
            while got < len(mv):
                r = os.preadv(fd, [mv[got:]], off + got)
                if r == 0:
                    raise CorruptCheckpointError(f"{src}: local shard shrank while being uploaded")
                got += r
        except OSError as exc:
            raise StorageError(f"{src}: read failed: {exc}") from exc

    def _put_single(self, fd: int, src: str, full: str, size: int, checksum: str, stats: TransferStats) -> None:
        data = bytearray(size)
        self._read(fd, src, data, 0)
        actual = xxhash.xxh3_64_hexdigest(data)
        if actual != checksum:
            raise CorruptCheckpointError(f"{src}: local shard does not match its checksum in the manifest (xxh3 "
                                         f"{actual} != {checksum}); it was not uploaded to {self._where(full)}")
        md5 = _md5(data)

        def once() -> dict[str, Any]:
            self.limiter.acquire(size)  # per attempt: a re-sent body uses bandwidth too
            return self._client.put_object(Bucket=self.bucket, Key=full, Body=data, ContentMD5=_md5_b64(md5),
                                            Metadata={META: checksum})

        resp = self._call("PUT", full, once, stats=stats)
        self._check_etag(resp, md5, full, "object")
        stats.bytes = size

    def _check_etag(self, resp: dict[str, Any], md5: bytes, full: str, what: str) -> None:
        # The store already checked Content-MD5; the ETag tells us it stored what it checked.
        if not _opaque_etag(resp) and _etag(resp.get("ETag")) != md5.hex():
            raise StorageError(f"S3 {self._where(full)}: the store answered ETag {resp.get('ETag')} for the "
                               f"{what} we sent with MD5 {md5.hex()}; it does not store what it received, or "
                               "it encrypts with ETags that are not MD5s (unsupported)")

    def _part_size_for(self, size: int) -> int:
        ps = self.part_size
        if math.ceil(size / ps) > MAX_PARTS:  # grow parts (in whole MiB) to stay within 10,000 of them
            ps = math.ceil(size / MAX_PARTS / (1 << 20)) * (1 << 20)
        return ps

    def _uploads_of(self, full: str, stats: TransferStats | None = None) -> list[dict[str, Any]]:
        """The incomplete multipart uploads of exactly ``full``, oldest first."""
        found: list[dict[str, Any]] = []
        for page in self._pages("list uploads of", full, self._client.list_multipart_uploads,
                                {"Bucket": self.bucket, "Prefix": full},
                                {"KeyMarker": "NextKeyMarker", "UploadIdMarker": "NextUploadIdMarker"},
                                stats=stats):
            found.extend(u for u in page.get("Uploads", []) if u.get("Key") == full)
        # Listing order breaks ties: S3 lists a key's uploads by initiation time already.
        order = {id(u): i for i, u in enumerate(found)}

        def initiated(u: dict[str, Any]) -> float:
            t = u.get("Initiated")
            return float(t.timestamp()) if t is not None else 0.0

        return sorted(found, key=lambda u: (initiated(u), order[id(u)]))

    def _abort(self, full: str, upload_id: str, stats: TransferStats | None = None) -> bool:
        """Abort one upload; False if someone else had already removed it."""
        attempts = 0

        def once() -> bool:
            nonlocal attempts
            attempts += 1
            try:
                self._client.abort_multipart_upload(Bucket=self.bucket, Key=full, UploadId=upload_id)
            except ClientError as exc:
                if _error_code(exc) == "NoSuchUpload":
                    # Gone: on a retry, most likely by our own earlier attempt whose answer was lost.
                    return attempts > 1
                raise
            return True

        return self._call("abort upload of", full, once, stats=stats)

    def _resumable(self, full: str, stats: TransferStats
                   ) -> tuple[str | None, bool, dict[int, tuple[int, str, str | None]]]:
        """An incomplete upload of ``full`` to resume, whether it was created with our flexible checksum
        (its parts then carry CRC32s), and its parts (number -> (size, ETag, listed CRC32 or None))."""
        uploads = self._uploads_of(full, stats)
        if not uploads:
            return None, False, {}
        newest = uploads[-1]
        for u in uploads[:-1]:
            log.info("aborting an older incomplete upload %s of %s", u["UploadId"], self._where(full))
            self._abort(full, u["UploadId"], stats)
        upload_id = str(newest["UploadId"])
        algorithm = newest.get("ChecksumAlgorithm")
        if algorithm not in (None, CHECKSUM_ALGORITHM):
            # Not one of ours (we use CRC32 or none): its parts would need checksums we do not compute.
            log.info("aborting incomplete upload %s of %s (checksum algorithm %s)", upload_id, self._where(full),
                     algorithm)
            self._abort(full, upload_id, stats)
            return None, False, {}
        parts: dict[int, tuple[int, str, str | None]] = {}
        try:
            for page in self._pages("list parts of", full, self._client.list_parts,
                                    {"Bucket": self.bucket, "Key": full, "UploadId": upload_id},
                                    {"PartNumberMarker": "NextPartNumberMarker"}, stats=stats):
                for p in page.get("Parts", []):
                    parts[int(p["PartNumber"])] = (int(p["Size"]), _etag(p.get("ETag")), p.get("ChecksumCRC32"))
        except TransientStorageError as exc:
            if isinstance(exc.__cause__, ClientError) and _error_code(exc.__cause__) == "NoSuchUpload":
                return None, False, {}  # aborted between the two listings
            raise
        return upload_id, algorithm == CHECKSUM_ALGORITHM, parts

    def _create_upload(self, full: str, checksum: str, stats: TransferStats) -> tuple[str, bool]:
        """A new upload of ``full``, and whether it was created with our flexible checksum."""
        attempts = 0
        flexible = self._flexible

        def once() -> dict[str, Any]:
            nonlocal attempts, flexible
            attempts += 1
            if flexible:
                try:
                    return self._client.create_multipart_upload(Bucket=self.bucket, Key=full, Metadata={META: checksum},
                                                                ChecksumAlgorithm=CHECKSUM_ALGORITHM)
                except ClientError as exc:
                    if not _refuses_checksums(exc):
                        raise
                    self._no_flexible(full, exc)
                    flexible = False
            return self._client.create_multipart_upload(Bucket=self.bucket, Key=full, Metadata={META: checksum})

        upload_id = str(self._call("create upload of", full, once, stats=stats)["UploadId"])
        if attempts > 1:
            # An earlier attempt may have created an upload whose answer was lost: abort it now rather
            # than leave it to be resumed (or billed) later.
            for u in self._uploads_of(full, stats):
                if u["UploadId"] != upload_id:
                    self._abort(full, u["UploadId"], stats)
        return upload_id, flexible

    def _put_multipart(self, fd: int, src: str, full: str, size: int, checksum: str,
                       progress: Progress | None, stats: TransferStats) -> None:
        psize = self._part_size_for(size)
        nparts = math.ceil(size / psize)
        upload_id, flexible, existing = self._resumable(full, stats)
        if upload_id is None:
            upload_id, flexible = self._create_upload(full, checksum, stats)
        else:
            log.info("resuming upload %s of %s (%d part(s) already there)", upload_id, self._where(full),
                     len(existing))
        cancel = threading.Event()
        where = self._where(full)

        def work(number: int, off: int, buf: bytearray) -> _Part:
            try:
                if cancel.is_set():
                    raise _Cancelled
                n = len(buf)
                self._read(fd, src, buf, off)
                md5 = _md5(buf)
                crc = _crc32_b64(buf) if flexible else None
                # A part already in the store is kept only if it is byte for byte ours: same size and
                # same MD5 (its ETag), and the same CRC32 if the store lists one. Anything else is sent
                # again, which replaces it.
                old = existing.get(number)
                if old is not None and old[:2] == (n, md5.hex()) and (old[2] is None or old[2] == crc):
                    return _Part(number, n, buf, md5, md5.hex(), reused=True, crc=crc)
                extra = {"ChecksumCRC32": crc} if crc is not None else {}

                def once() -> dict[str, Any]:
                    self.limiter.acquire(n)
                    return self._client.upload_part(Bucket=self.bucket, Key=full, UploadId=upload_id,
                                                    PartNumber=number, Body=buf, ContentMD5=_md5_b64(md5), **extra)

                resp = self._call(f"upload part {number}/{nparts} of", full, once, stats=stats, cancel=cancel)
                self._check_etag(resp, md5, full, f"part {number}")
                return _Part(number, n, buf, md5, _etag(resp.get("ETag")), reused=False, crc=crc)
            except BaseException:
                cancel.set()  # the other parts stop retrying and the rest are not started
                raise

        h = xxhash.xxh3_64()
        window: deque[Future[_Part]] = deque()
        done: list[_Part] = []

        def drain_one() -> None:
            try:
                part = window.popleft().result()
            finally:
                self._budget.release()
            h.update(part.buf)  # in part order: xxh3 streams
            if part.size == psize:
                self._give_buffer(part.buf)
            done.append(dataclasses.replace(part, buf=bytearray()))  # keep the etag, not the bytes
            stats.bytes += part.size
            if part.reused:
                stats.reused_bytes += part.size
            if progress:
                progress(part.size)

        try:
            for i in range(nparts):
                off = i * psize
                n = min(psize, size - off)
                self._reserve(lambda: len(window), drain_one)
                # Full parts reuse buffers; the last one gets its own, exactly sized, so the body is the
                # buffer itself (no copy).
                buf = self._take_buffer(n) if n == psize else bytearray(n)
                try:
                    window.append(self._pool.submit(work, i + 1, off, buf))
                except BaseException:
                    self._budget.release()
                    raise
            while window:
                drain_one()
            if h.hexdigest() != checksum:
                raise CorruptCheckpointError(
                    f"{src}: local shard does not match its checksum in the manifest (xxh3 {h.hexdigest()} != "
                    f"{checksum}); the upload to {where} was aborted and nothing was published")
        except BaseException as exc:
            cancel.set()
            wait_futures(list(window))
            for _ in window:
                self._budget.release()
            real = _first_cause(exc, list(window))
            gone = isinstance(real.__cause__, ClientError) and _error_code(real.__cause__) == "NoSuchUpload"
            refused = flexible and _refuses_checksums(real)
            if isinstance(real, TransientStorageError) and not gone:
                log.info("left upload %s of %s for a later put_file to resume (%d part(s) verified)",
                         upload_id, where, len(done))
                raise TransientStorageError(f"{real} Nothing was published; the upload is kept and the next "
                                            "put_file of this key resumes it.") from real
            if gone:
                raise real from None
            if not isinstance(real, Exception):
                log.info("left upload %s of %s for a later put_file to resume (interrupted)", upload_id, where)
            else:  # corrupt source or a permanent error: nothing to resume
                try:
                    self._abort(full, upload_id, stats)
                except StorageError as abort_exc:
                    log.warning("could not abort upload %s of %s (cleanup_incomplete will): %s", upload_id,
                                where, abort_exc)
            if refused:
                self._no_flexible(full, real)
                raise _ChecksumsRefused(str(real)) from real
            if real is exc:
                raise
            raise real from None
        try:
            self._complete(full, upload_id, done, size, checksum, stats)
        except StorageError as exc:
            if not (flexible and _refuses_checksums(exc)):
                raise
            self._no_flexible(full, exc)
            self._abort(full, upload_id, stats)
            raise _ChecksumsRefused(str(exc)) from exc

    def _complete(self, full: str, upload_id: str, parts: list[_Part], size: int, checksum: str,
                  stats: TransferStats) -> None:
        where = self._where(full)
        expected_etag = _md5(b"".join(p.md5 for p in parts)).hex() + f"-{len(parts)}"
        attempts = 0

        def once() -> dict[str, Any]:
            nonlocal attempts
            attempts += 1
            try:
                return self._client.complete_multipart_upload(
                    Bucket=self.bucket, Key=full, UploadId=upload_id,
                    MultipartUpload={"Parts": [{"PartNumber": p.number, "ETag": f'"{p.etag}"',
                                                **({"ChecksumCRC32": p.crc} if p.crc is not None else {})}
                                               for p in parts]})
            except ClientError as exc:
                # A retry after an answer that was lost: the first attempt completed the upload.
                if attempts > 1 and _error_code(exc) == "NoSuchUpload":
                    head = self._client.head_object(Bucket=self.bucket, Key=full)
                    if _etag(head.get("ETag")) == expected_etag:
                        return head
                raise

        self._call("complete upload of", full, once, stats=stats)
        head = self._call("HEAD", full, lambda: self._client.head_object(Bucket=self.bucket, Key=full),
                          stats=stats)
        if int(head.get("ContentLength", -1)) != size:
            # Should not happen (every part was verified): remove what must not pass for the shard.
            self.delete([self._rel(full)])
            raise StorageError(f"S3 {where}: the completed object is {head.get('ContentLength')} bytes, not "
                               f"{size}; it was deleted. The store at {self.endpoint} misassembled the upload.")
        if (head.get("Metadata") or {}).get(META) != checksum:
            self._fix_metadata(full, size, checksum, head)

    def _fix_metadata(self, full: str, size: int, checksum: str, head: dict[str, Any]) -> None:
        # The resumed upload was started for other contents of this key (the metadata of an upload in
        # progress cannot be read, and its parts that we kept matched our bytes). The bytes are ours, the
        # recorded checksum is not: rewrite the metadata with a server-side copy onto itself.
        where = self._where(full)
        stale = (head.get("Metadata") or {}).get(META)
        log.warning("S3 %s: resumed upload carried xxh3 %s instead of %s; rewriting the metadata", where, stale,
                    checksum)
        if size <= MAX_PART:
            self._call("rewrite metadata of", full, lambda: self._client.copy_object(
                Bucket=self.bucket, Key=full, CopySource={"Bucket": self.bucket, "Key": full},
                MetadataDirective="REPLACE", Metadata={META: checksum}))
            return
        # Too large for one copy: remove it so that the next put_file uploads it afresh (no upload is
        # left to resume now, so it will not come back with the stale checksum).
        self.delete([self._rel(full)])
        raise TransientStorageError(f"S3 {where}: the resumed upload recorded a stale checksum and the object "
                                    "is too large to rewrite in place; it was deleted, put_file again")

    # ------------------------------------------------------------------ downloads
    def get_file(self, key: str, dest: str, *, size: int, checksum: str,
                 progress: Progress | None = None) -> TransferStats:
        """See :meth:`StorageTier.get_file`: ranged GETs in parallel, written in place, verified."""
        full = self._full(key)
        where = self._where(full)
        t0 = time.perf_counter()
        stats = TransferStats(key=key)
        head = self._call("HEAD", full, lambda: self._client.head_object(Bucket=self.bucket, Key=full),
                          stats=stats)
        actual = int(head.get("ContentLength", -1))
        if actual != size:
            raise CorruptCheckpointError(f"{where}: durable object is {actual} bytes, the manifest says {size}; "
                                         "it was not downloaded")
        # Every range must come from the object we just measured, not from one replaced meanwhile.
        etag = head.get("ETag")
        dest = os.path.abspath(dest)
        tmp = f"{dest}{TMP_MARK}{secrets.token_hex(4)}"
        psize = self._part_size_for(size)
        cancel = threading.Event()
        with unpublished_on_error(tmp, f"downloading {where} to {dest}"):
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            fout = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                def fetch(off: int, n: int) -> bytes:
                    try:
                        if cancel.is_set():
                            raise _Cancelled
                        data = self._get_range(full, off, n, etag, stats=stats, cancel=cancel)
                        mv = memoryview(data)
                        written = 0
                        while written < n:
                            written += os.pwrite(fout, mv[written:], off + written)
                        return data
                    except BaseException:
                        cancel.set()
                        raise

                h = xxhash.xxh3_64()
                window: deque[tuple[Future[bytes], int]] = deque()

                def drain_one() -> None:
                    fut, n = window.popleft()
                    try:
                        h.update(fut.result())  # in order: xxh3 streams
                    finally:
                        self._budget.release()
                    stats.bytes += n
                    if progress:
                        progress(n)

                try:
                    for off in range(0, size, psize):
                        self._reserve(lambda: len(window), drain_one)
                        n = min(psize, size - off)
                        try:
                            window.append((self._pool.submit(fetch, off, n), n))
                        except BaseException:
                            self._budget.release()
                            raise
                    while window:
                        drain_one()
                except BaseException as exc:
                    cancel.set()
                    wait_futures([f for f, _ in window])
                    for _ in window:
                        self._budget.release()
                    real = _first_cause(exc, [f for f, _ in window])
                    if real is exc:
                        raise
                    raise real from None
                if h.hexdigest() != checksum:
                    raise CorruptCheckpointError(
                        f"{where}: durable object does not match its checksum in the manifest (xxh3 "
                        f"{h.hexdigest()} != {checksum}); it was not kept at {dest}")
                os.fsync(fout)
            finally:
                os.close(fout)
            os.replace(tmp, dest)
            fsync_dir(os.path.dirname(dest))
        stats.seconds = time.perf_counter() - t0
        return stats

    @contextlib.contextmanager
    def open_ranges(self, key: str, size: int) -> Iterator[ReadRange]:
        """See :meth:`StorageTier.open_ranges`: one HEAD, then ranged GETs of that version (If-Match its
        ETag), each retried like every request of this tier."""
        full = self._full(key)
        where = self._where(full)
        head = self._call("HEAD", full, lambda: self._client.head_object(Bucket=self.bucket, Key=full))
        actual = int(head.get("ContentLength", -1))
        if actual != size:
            raise CorruptCheckpointError(f"{where}: durable object is {actual} bytes, the manifest says {size}")
        etag = head.get("ETag")
        yield lambda offset, n: self._get_range(full, offset, n, etag) if n else b""

    def _get_range(self, full: str, offset: int, n: int, etag: str | None, *, stats: TransferStats | None = None,
                   cancel: threading.Event | None = None) -> bytes:
        """``n`` bytes at ``offset`` of ``full``, of the version whose ETag is ``etag`` (one GET, retried)."""
        rng = f"bytes={offset}-{offset + n - 1}"

        def once() -> bytes:
            self.limiter.acquire(n)
            kw: dict[str, Any] = {"IfMatch": etag} if etag else {}
            body = self._client.get_object(Bucket=self.bucket, Key=full, Range=rng, **kw)["Body"]
            try:
                data: bytes = body.read()
            finally:
                body.close()
            if len(data) != n:
                raise StorageError(f"S3 GET {rng} of {self._where(full)} returned {len(data)} bytes instead of {n}; "
                                   f"the store at {self.endpoint} ignores Range")
            return data

        return self._call(f"GET {rng} of", full, once, stats=stats, cancel=cancel)

    # ------------------------------------------------------------------ small objects
    def put_bytes(self, key: str, data: bytes) -> None:
        """See :meth:`StorageTier.put_bytes` (one PUT with Content-MD5 and the xxh3 metadata)."""
        self._put_small(self._full(key), data)

    def _put_small(self, full: str, data: bytes, **condition: str) -> bool:
        """One PUT of ``data`` with Content-MD5 and the xxh3 metadata; with ``condition`` (``IfMatch=etag``,
        ``IfNoneMatch="*"``) a conditional one, and False when the store refused it for the condition."""
        md5 = _md5(data)
        meta = {META: xxhash.xxh3_64_hexdigest(data)}

        def once() -> dict[str, Any] | None:
            self.limiter.acquire(len(data))
            try:
                return self._client.put_object(Bucket=self.bucket, Key=full, Body=data, ContentMD5=_md5_b64(md5),
                                               Metadata=meta, **condition)
            except ClientError as exc:
                if condition and _error_code(exc) in _CONDITION_CODES:
                    return None  # another writer came first: the caller reads again (retrying cannot help)
                raise

        resp = self._call("PUT", full, once)
        if resp is None:
            return False
        self._check_etag(resp, md5, full, "object")
        return True

    def update_bytes(self, key: str, change: Callable[[bytes | None], bytes | None], *,
                     limit: int | None = None) -> bool:
        """See :meth:`StorageTier.update_bytes`: a GET, then a conditional PUT (``If-Match`` the ETag read,
        ``If-None-Match: *`` where there was no object); when another writer came between the two, read again,
        at most :data:`UPDATE_ATTEMPTS` times (then TransientStorageError). A store that ignores conditional
        writes (some S3-compatible ones) makes this a plain read then write."""
        full = self._full(key)
        for attempt in range(UPDATE_ATTEMPTS):
            def get() -> tuple[bytes, str]:
                resp = self._client.get_object(Bucket=self.bucket, Key=full)
                body = resp["Body"]
                try:
                    data: bytes = body.read() if limit is None else body.read(limit + 1)
                finally:
                    body.close()
                return data, str(resp.get("ETag") or "")

            try:
                cur: bytes | None
                cur, etag = self._call("GET", full, get)
            except ObjectNotFoundError:
                cur, etag = None, ""
            new = change(cur)
            if new is None:
                return True
            if self._put_small(full, new, **({"IfMatch": etag} if etag else {"IfNoneMatch": "*"})):
                return True
            log.debug("S3 %s: changed by another writer between the read and the write (attempt %d); reading again",
                      self._where(full), attempt + 1)
            time.sleep(random.uniform(0.01, 0.05) * (attempt + 1))
        raise TransientStorageError(f"S3 {self._where(full)}: other writers changed it {UPDATE_ATTEMPTS} times "
                                    "between a read and a write; try again")

    def get_bytes(self, key: str, *, limit: int | None = None) -> bytes:
        """See :meth:`StorageTier.get_bytes`."""
        full = self._full(key)

        def once() -> bytes:
            body = self._client.get_object(Bucket=self.bucket, Key=full)["Body"]
            try:
                data: bytes = body.read() if limit is None else body.read(limit + 1)
            finally:
                body.close()
            return data

        return self._call("GET", full, once)

    # ------------------------------------------------------------------ listing
    def stat(self, key: str) -> ObjectInfo | None:
        """See :meth:`StorageTier.stat` (one HEAD)."""
        full = self._full(key)
        try:
            head = self._call("HEAD", full, lambda: self._client.head_object(Bucket=self.bucket, Key=full))
        except ObjectNotFoundError:
            return None
        return ObjectInfo(key=self._rel(full), size=int(head.get("ContentLength", 0)),
                          checksum=(head.get("Metadata") or {}).get(META),
                          mtime=head["LastModified"].timestamp() if head.get("LastModified") else 0.0)

    def _objects(self, base: str) -> Iterator[dict[str, Any]]:
        for page in self._pages("list", base, self._client.list_objects_v2,
                                {"Bucket": self.bucket, "Prefix": base},
                                {"ContinuationToken": "NextContinuationToken"}):
            yield from page.get("Contents", [])

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        """See :meth:`StorageTier.list`. Checksums are not listed by S3 (None here; :meth:`stat` has them)."""
        for obj in self._objects(self._base(prefix)):
            lm = obj.get("LastModified")
            yield ObjectInfo(key=self._rel(obj["Key"]), size=int(obj.get("Size", 0)), checksum=None,
                             mtime=lm.timestamp() if lm else 0.0)

    def list_dirs(self, prefix: str) -> builtins.list[str]:  # (``list`` is the method above here)
        """See :meth:`StorageTier.list_dirs` (common prefixes one level below ``prefix``)."""
        base = self._base(prefix)
        names: builtins.list[str] = []
        for page in self._pages("list", base, self._client.list_objects_v2,
                                {"Bucket": self.bucket, "Prefix": base, "Delimiter": "/"},
                                {"ContinuationToken": "NextContinuationToken"}):
            names.extend(cp["Prefix"][len(base):].rstrip("/") for cp in page.get("CommonPrefixes", []))
        return sorted(n for n in names if n)

    def list_names(self, prefix: str) -> builtins.list[str]:
        """See :meth:`StorageTier.list_names` (delimiter ``/``: the objects one level below ``prefix``)."""
        base = self._base(prefix)
        names: builtins.list[str] = []
        for page in self._pages("list", base, self._client.list_objects_v2,
                                {"Bucket": self.bucket, "Prefix": base, "Delimiter": "/"},
                                {"ContinuationToken": "NextContinuationToken"}):
            names.extend(obj["Key"][len(base):] for obj in page.get("Contents", []))
        return sorted(n for n in names if n and "/" not in n)

    # ------------------------------------------------------------------ deletion
    def delete(self, keys: Sequence[str]) -> None:
        """See :meth:`StorageTier.delete`. Keys go in batches of at most 1000, one batch after the other, in
        the order given; S3 promises no order inside a batch, so a key that must be gone before others
        (a manifest) goes in an earlier call, as retention does."""
        fulls = list(dict.fromkeys(self._full(k) for k in keys))
        for i in range(0, len(fulls), 1000):
            self._delete_batch(fulls[i:i + 1000])

    def _delete_batch(self, batch: Sequence[str]) -> None:
        remaining = batch

        def once() -> None:
            nonlocal remaining
            resp = self._client.delete_objects(
                Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in remaining], "Quiet": True})
            errors = [e for e in resp.get("Errors", []) if e.get("Code") not in NOT_FOUND_CODES]
            if not errors:
                return
            permanent = [e for e in errors if e.get("Code") not in TRANSIENT_CODES]
            if permanent:
                e = permanent[0]
                raise StorageError(f"S3 DELETE {self._where(str(e.get('Key')))} failed: {e.get('Code')}: "
                                   f"{e.get('Message')} ({len(permanent)} key(s) not deleted); check the "
                                   "credentials and the bucket policy (s3:DeleteObject)")
            remaining = tuple(str(e["Key"]) for e in errors)
            raise _Retryable(f"{len(remaining)} key(s) not deleted yet ({errors[0].get('Code')})")

        self._call(f"DELETE ({len(batch)} keys from)", batch[0], once)

    def delete_prefix(self, prefix: str) -> int:
        """See :meth:`StorageTier.delete_prefix`. Incomplete uploads under it are aborted too (nobody will
        resume an upload into a deleted step), but not counted."""
        base = self._full(prefix) + "/"
        keys = [str(o["Key"]) for o in self._objects(base)]
        for i in range(0, len(keys), 1000):
            self._delete_batch(keys[i:i + 1000])
        for page in self._pages("list uploads under", base, self._client.list_multipart_uploads,
                                {"Bucket": self.bucket, "Prefix": base},
                                {"KeyMarker": "NextKeyMarker", "UploadIdMarker": "NextUploadIdMarker"}):
            for u in page.get("Uploads", []):
                self._abort(str(u["Key"]), str(u["UploadId"]))
        return len(keys)

    def list_incomplete(self, prefix: str = "") -> Iterator[IncompleteTransfer]:
        """See :meth:`StorageTier.list_incomplete`: the multipart uploads (size unknown without a
        ``ListParts`` per upload, so None)."""
        base = self._base(prefix)
        for page in self._pages("list uploads under", base, self._client.list_multipart_uploads,
                                {"Bucket": self.bucket, "Prefix": base},
                                {"KeyMarker": "NextKeyMarker", "UploadIdMarker": "NextUploadIdMarker"}):
            for u in page.get("Uploads", []):
                initiated = u.get("Initiated")
                yield IncompleteTransfer(self._rel(str(u["Key"])), initiated.timestamp() if initiated else 0.0,
                                         None, str(u["UploadId"]))

    def cleanup_incomplete(self, prefix: str = "", *, older_than: float = 0.0,
                           keep: Callable[[str], bool] | None = None) -> int:
        """See :meth:`StorageTier.cleanup_incomplete`: aborts multipart uploads (by their initiation time)."""
        now = time.time()
        removed = 0
        for t in list(self.list_incomplete(prefix)):
            # older_than <= 0 means all of them, even one the store's clock dates a little ahead of ours
            if older_than > 0 and t.started and now - t.started < older_than:
                continue
            if keep is not None and keep(t.key):
                continue
            full = f"{self.prefix}/{t.key}" if self.prefix else t.key  # exactly the listed key (see _rel)
            if self._abort(full, t.handle):
                removed += 1
                log.info("aborted an interrupted upload %s of %s", t.handle, self._where(full))
        return removed

    def close(self) -> None:
        """See :meth:`StorageTier.close`."""
        self._pool.shutdown(wait=True)
        if self._own_client:
            self._client.close()


__all__ = ["S3Tier", "is_transient"]
