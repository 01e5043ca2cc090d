"""The ``StorageTier`` interface: one durable store (a POSIX directory or an S3 prefix) seen as keys.

Keys are ``/``-separated paths relative to the tier's root (``<run_id>/step_<N>/__0_0.distcp``). The
tier knows nothing about checkpoints: the drain daemon (:mod:`resilient_slurm.daemon`) decides what
goes where and in which order, and restore decides what to fetch.

Who calls what, and when:

1. A process opens a tier with :func:`resilient_slurm.storage.open_tier` (url -> tier, lazily
   imported). Instances are thread-safe: the daemon calls every method from its worker threads.
2. The drain daemon, per committed local step and storage domain: :meth:`StorageTier.stat` each shard
   key (a key whose recorded checksum matches is not sent again), :meth:`StorageTier.put_file` for the
   others, then :meth:`StorageTier.put_bytes` of the domain marker, and, once every domain's marker is
   there, :meth:`StorageTier.put_bytes` of the step's manifest: that write is the durable commit.
3. Restore (a domain leader): :meth:`StorageTier.list_dirs` / :meth:`StorageTier.get_bytes` to find
   durable steps and read manifests, :meth:`StorageTier.get_file` for shards (verified on arrival), and
   :meth:`StorageTier.get_ranges` for the items of a shard that a resharded load plan reads (each item
   verified against its own checksum, the file kept sparse).
4. Retention: :meth:`StorageTier.delete` of the manifest first (uncommits the step), then
   :meth:`StorageTier.delete_prefix` of the rest.
5. On start-up the daemon calls :meth:`StorageTier.cleanup_incomplete`: temp files (POSIX) or
   multipart uploads (S3) left by a killed daemon.

Atomicity: :meth:`put_file` and :meth:`put_bytes` are atomic per key: a reader sees the old object,
no object, or the complete new one, never a prefix. Nothing is atomic across keys; the commit protocol
gets that from writing the manifest last.

Verification: :meth:`put_file` checksums (xxh3) the bytes it reads from the local file and refuses to
publish a file that does not match the manifest (a corrupt local shard is never made durable); the
store's own check on what arrived is the tier's business (S3: Content-MD5 per part; POSIX: fsync and
size). :meth:`get_file` checksums what it received and refuses a mismatch. The checksum is recorded
with the object (S3 metadata, POSIX extended attribute) so a restarted daemon can tell verified
objects from stale ones without reading them back.
"""

from __future__ import annotations

import abc
import builtins
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import xxhash

from .. import failpoints
from ..errors import CorruptCheckpointError, ObjectNotFoundError

log = logging.getLogger(__name__)

Progress = Callable[[int], None]
"""Called with a number of bytes each time that many more bytes were transferred."""


@dataclass(frozen=True)
class ObjectInfo:
    """What a tier knows about one stored object."""

    key: str
    size: int
    checksum: str | None  # xxh3 recorded at upload; None when the store kept none
    mtime: float


@dataclass(frozen=True)
class Span:
    """One item of an object to fetch by range: its bytes and their xxh3 (a manifest's chunk entry)."""

    offset: int
    length: int
    checksum: str

    @property
    def end(self) -> int:
        return self.offset + self.length


# Items closer than this are fetched in one request (the bytes between them are read and dropped): a
# request costs a round trip, and a few hundred KiB more on the wire costs less than one on S3.
RANGE_GAP = 1 << 20
# Requests of one get_ranges under way at once.
RANGES_IN_FLIGHT = 8
# The most bytes one request asks for (and holds in memory): a group of items is read in requests of at
# most this size, each item hashed across them in order.
MAX_REQUEST = 64 << 20

ReadRange = Callable[[int, int], bytes]
"""Reads ``n`` bytes at ``offset`` of one object (exactly ``n``, or raises)."""


def coalesce(spans: Sequence[Span], gap: int = RANGE_GAP, limit: int | None = None) -> list[list[Span]]:
    """``spans`` (sorted, not overlapping) in groups fetched together: a span joins the group before it
    when it starts less than ``gap`` bytes after that group's end and the group then spans at most
    ``limit`` bytes (default :data:`MAX_REQUEST`; a single larger span is a group of its own)."""
    limit = MAX_REQUEST if limit is None else limit
    groups: list[list[Span]] = []
    for sp in spans:
        if groups and sp.offset - groups[-1][-1].end < gap and sp.end - groups[-1][0].offset <= limit:
            groups[-1].append(sp)
        else:
            groups.append([sp])
    return groups


@dataclass(frozen=True)
class IncompleteTransfer:
    """What an interrupted transfer left in the store: a POSIX temp file or an S3 multipart upload."""

    key: str  # the key that was being written
    started: float  # when (unix time; the temp file's mtime, the upload's initiation time)
    size: int | None  # bytes it holds, where the store says without more requests
    handle: str  # the temp file's path, or the upload id


@dataclass
class TransferStats:
    """What one transfer did (for logs, status and benchmarks)."""

    key: str
    bytes: int = 0
    seconds: float = 0.0
    retries: int = 0
    reused_bytes: int = 0  # bytes already in the store (resumed upload) and not sent again

    @property
    def throughput(self) -> float:
        """Bytes per second actually moved."""
        return (self.bytes - self.reused_bytes) / self.seconds if self.seconds > 0 else 0.0


@dataclass
class RateLimiter:
    """Token bucket shared by every transfer of one process: at most ``rate`` bytes/s on average.

    ``clock`` and ``sleep`` are injected so tests need not wait. ``rate=None`` means no limit."""

    rate: float | None
    burst: float = 0.0
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep
    _tokens: float = field(default=0.0, init=False)
    _last: float = field(default=0.0, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)

    def __post_init__(self) -> None:
        if self.rate is not None and self.rate <= 0:
            raise ValueError(f"rate must be > 0 bytes/s or None, got {self.rate}")
        self.burst = self.burst or (self.rate or 0.0) * 0.25
        self._tokens = self.burst
        self._last = self.clock()

    def acquire(self, n: int) -> None:
        """Block until ``n`` bytes may be sent."""
        if self.rate is None or n <= 0:
            return
        with self._lock:
            now = self.clock()
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
            self._last = now
            self._tokens -= n
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
        if wait > 0:
            self.sleep(wait)


class StorageTier(abc.ABC):
    """A durable store addressed by keys (see the module docstring for the call order)."""

    #: The URL the tier was opened with (for messages).
    url: str
    #: How the drain stores shards here: "off" (as they are) or "zstd" (compressed where it pays;
    #: :mod:`resilient_slurm.storage.encoding`). Readers read either kind whatever this says.
    compression: str = "off"

    @abc.abstractmethod
    def put_file(self, src: str, key: str, *, size: int, checksum: str,
                 progress: Progress | None = None) -> TransferStats:
        """Copy local file ``src`` to ``key`` atomically, checking its bytes against ``checksum`` (xxh3)
        as they are read; raise :class:`~resilient_slurm.errors.CorruptCheckpointError` (nothing is
        published) when ``src`` does not match, :class:`~resilient_slurm.errors.StorageError` when the
        store fails (transient failures are retried first)."""

    @abc.abstractmethod
    def get_file(self, key: str, dest: str, *, size: int, checksum: str,
                 progress: Progress | None = None) -> TransferStats:
        """Download ``key`` into local file ``dest`` (created or truncated, fsynced) and check it against
        ``size`` and ``checksum``; raise :class:`~resilient_slurm.errors.CorruptCheckpointError` on a
        mismatch, :class:`~resilient_slurm.errors.ObjectNotFoundError` if the key is absent."""

    @abc.abstractmethod
    def open_ranges(self, key: str, size: int) -> contextlib.AbstractContextManager[ReadRange]:
        """A reader of byte ranges of ``key`` as it is now (S3: the ranges must come from the object just
        measured, not one replaced meanwhile). Raises :class:`~resilient_slurm.errors.ObjectNotFoundError`
        if the key is absent, :class:`~resilient_slurm.errors.CorruptCheckpointError` if it is not ``size``
        bytes."""

    def get_ranges(self, key: str, dest: str, *, size: int, spans: Sequence[Span],
                   progress: Progress | None = None,
                   reader: Callable[[], contextlib.AbstractContextManager[ReadRange]] | None = None) -> TransferStats:
        """Download only ``spans`` of ``key`` into a new local file ``dest`` of ``size`` bytes, each at its
        own offset (the rest of the file is a hole), fsynced. Spans are fetched in parallel, nearby ones
        in one request (:func:`coalesce`); each is checked against its own checksum as it arrives, and a
        request whose bytes do not match is made once more (a bad transfer) before the object is declared
        corrupt (:class:`~resilient_slurm.errors.CorruptCheckpointError`, naming the bytes). ``dest`` is
        removed on any failure. ``stats.bytes``: bytes requested from the store (spans and the gaps
        between the spans of one request). ``reader``: opens the byte ranges to read instead of
        :meth:`open_ranges` (a compressed object's decoded bytes, :mod:`~resilient_slurm.storage.encoding`)."""
        t0 = time.perf_counter()
        stats = TransferStats(key=key)
        spans = sorted(spans, key=lambda sp: sp.offset)
        for a, b in zip(spans, spans[1:]):
            if b.offset < a.end:
                raise ValueError(f"{key}: spans {a} and {b} overlap")
        if spans and (spans[0].offset < 0 or spans[-1].end > size or min(sp.length for sp in spans) < 0):
            raise ValueError(f"{key}: spans outside its {size} bytes")
        lock = threading.Lock()
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, size)
            with (reader() if reader is not None else self.open_ranges(key, size)) as read:

                failed = threading.Event()

                def one(group: list[Span]) -> None:
                    if failed.is_set():
                        return
                    try:
                        fetch(group)
                    except BaseException:
                        failed.set()
                        raise

                def fetch(group: list[Span]) -> None:
                    # In requests of at most MAX_REQUEST bytes, in order; each item's bytes are written at
                    # their offset (a temp file: removed if the step turns out corrupt) and hashed as they
                    # come, and the group is judged once all of it arrived.
                    lo, hi = group[0].offset, group[-1].end
                    for attempt in (1, 2):
                        hashes = [xxhash.xxh3_64() for _ in group]
                        for pos in range(lo, hi, MAX_REQUEST):
                            n = min(MAX_REQUEST, hi - pos)
                            data: bytes | bytearray = read(pos, n)
                            if len(data) != n:
                                raise CorruptCheckpointError(f"{self.url}/{key}: bytes {pos}+{n} came back "
                                                             f"{len(data)} bytes long")
                            if failpoints.armed("during_range_fetch"):
                                data = bytearray(data)
                                failpoints.hit("during_range_fetch", data=data)
                            mv = memoryview(data)
                            for sp, h in zip(group, hashes):
                                a, b = max(sp.offset, pos), min(sp.end, pos + n)
                                if a >= b:
                                    continue
                                h.update(mv[a - pos:b - pos])
                                done = 0
                                while a + done < b:
                                    done += os.pwrite(fd, mv[a - pos + done:b - pos], a + done)
                            with lock:
                                stats.bytes += n
                            if progress:
                                progress(n)
                        bad = [sp for sp, h in zip(group, hashes) if h.hexdigest() != sp.checksum]
                        with lock:
                            stats.retries += attempt - 1
                        if not bad:
                            break
                        if attempt == 1:
                            log.warning("%s/%s: bytes %d+%d do not match their checksum in the manifest; fetching "
                                        "them again", self.url, key, bad[0].offset, bad[0].length)
                    else:
                        raise CorruptCheckpointError(
                            f"{self.url}/{key}: bytes {bad[0].offset}+{bad[0].length} do not match their checksum "
                            "in the manifest, fetched twice; the durable object is corrupt, nothing of it was kept")

                groups = coalesce(spans)
                if len(groups) <= 1:
                    for g in groups:
                        one(g)
                else:
                    with ThreadPoolExecutor(min(RANGES_IN_FLIGHT, len(groups)),
                                            thread_name_prefix="rslurm-range") as ex:
                        futures = [ex.submit(one, g) for g in groups]
                    for f in futures:
                        f.result()
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(dest)
            raise
        os.close(fd)
        stats.seconds = time.perf_counter() - t0
        return stats

    @abc.abstractmethod
    def put_bytes(self, key: str, data: bytes) -> None:
        """Store a small object atomically (markers, manifests, metadata)."""

    @abc.abstractmethod
    def get_bytes(self, key: str, *, limit: int | None = None) -> bytes:
        """Read a small object; :class:`~resilient_slurm.errors.ObjectNotFoundError` if absent. With
        ``limit``, at most ``limit + 1`` bytes are read: a caller that caps a size (a manifest) sees an
        oversized object by its length, without reading all of it."""

    def update_bytes(self, key: str, change: Callable[[bytes | None], bytes | None], *,
                     limit: int | None = None) -> bool:
        """Read-modify-write of small object ``key``: read it (None when it does not exist; ``limit`` as in
        :meth:`get_bytes`), call ``change`` with what was read, and store what it returns (None: nothing to
        store). ``change`` may be called more than once, each time with what the object holds then, so it must
        compute from what it is given (a merge). True when no other update_bytes of the same key could have come
        between the read and the write (a conditional write, or a lock: the tier's own method); False where
        the tier can promise no such thing (this default: a plain read then write), so the caller checks
        afterwards. What ``change`` raises propagates, with nothing written."""
        try:
            cur: bytes | None = self.get_bytes(key, limit=limit)
        except ObjectNotFoundError:
            cur = None
        new = change(cur)
        if new is not None:
            self.put_bytes(key, new)
        return False

    @abc.abstractmethod
    def stat(self, key: str) -> ObjectInfo | None:
        """Size, recorded checksum and time of ``key``; None if it does not exist."""

    @abc.abstractmethod
    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        """Every complete object under ``prefix/`` (recursive), in no particular order."""

    @abc.abstractmethod
    def list_dirs(self, prefix: str) -> builtins.list[str]:
        """Names of the immediate sub-"directories" of ``prefix`` (``""`` is the root), sorted."""

    @abc.abstractmethod
    def list_names(self, prefix: str) -> builtins.list[str]:
        """Names of the complete objects directly below ``prefix/`` (not recursive), sorted: one
        paginated LIST on S3, one directory read on POSIX (no per-object stat)."""

    @abc.abstractmethod
    def delete(self, keys: Sequence[str]) -> None:
        """Delete these keys; keys that do not exist are ignored. In the order given."""

    @abc.abstractmethod
    def delete_prefix(self, prefix: str) -> int:
        """Delete everything under ``prefix/``; return how many objects were removed."""

    @abc.abstractmethod
    def list_incomplete(self, prefix: str = "") -> Iterator[IncompleteTransfer]:
        """What interrupted transfers left under ``prefix`` (temp files, multipart uploads), in no
        particular order: what :meth:`cleanup_incomplete` would consider (``rslurm gc --dry-run``)."""

    @abc.abstractmethod
    def cleanup_incomplete(self, prefix: str = "", *, older_than: float = 0.0,
                           keep: Callable[[str], bool] | None = None) -> int:
        """Remove what interrupted transfers left under ``prefix`` (temp files, multipart uploads)
        started more than ``older_than`` seconds ago, except those whose key ``keep`` returns True
        for (uploads this process will resume); return how many were removed."""

    def remove_empty_dirs(self, prefix: str) -> None:  # noqa: B027 -- optional hook
        """Remove the directories at and below ``prefix`` that hold nothing, deepest first (a directory
        that is not empty, or no longer there, is left as it is). An object store has no directories: the
        default does nothing."""

    def close(self) -> None:  # noqa: B027 -- optional hook
        """Release connections and thread pools."""

    def __enter__(self) -> StorageTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def join_key(*parts: str) -> str:
    """Join key parts with ``/``, ignoring empty parts and stray slashes."""
    return "/".join(p.strip("/") for p in parts if p and p.strip("/"))


__all__ = ["IncompleteTransfer", "ObjectInfo", "Progress", "RateLimiter", "ReadRange", "Span", "StorageTier",
           "TransferStats", "coalesce", "join_key"]
