"""Fast file primitives: page-aligned buffers, O_DIRECT writes with a buffered fallback, checksums,
fsync of files and directories, and small atomic writes (temp name, fsync, rename, directory fsync).

Who calls what: the checkpoint engine allocates staging buffers with :func:`aligned_buffer` once per
state layout, and its background thread calls :func:`write_file` per shard. Restore calls
:func:`read_spans` (small items, into a buffer) and :func:`read_through` (large tensors, into themselves). Every function here is safe to call from any thread; none touches the GIL-heavy
parts of torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import mmap
import os
import queue
import shutil
import stat
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import xxhash

from .. import paths
from ..errors import InsufficientSpaceError, StorageError, TransientStorageError, UnsafePathError
from ..flocks import close_locked_fd, open_locked_fd

if TYPE_CHECKING:  # torch is imported where buffers are made, so the launcher can use this module without it
    import torch

log = logging.getLogger(__name__)

BLOCK = 4096  # O_DIRECT alignment that every Linux filesystem we target accepts
_IO_CHUNK = 16 << 20  # bytes per pwrite/pread call: large enough for NVMe, small enough to pipeline
_O_DIRECT = getattr(os, "O_DIRECT", 0)


def round_up(n: int, a: int = BLOCK) -> int:
    """Smallest multiple of ``a`` that is >= ``n``."""
    return (n + a - 1) // a * a


def aligned_buffer(nbytes: int, *, pin: bool = False, prefault: bool = True, huge: bool | None = None) -> torch.Tensor:
    """A page-aligned, zeroed uint8 CPU tensor of at least ``nbytes`` (rounded up to BLOCK).

    ``prefault`` touches every page now: staging buffers are allocated once and reused, and a first
    touch inside a timed save would run at page-fault speed. Read buffers skip it, since the read
    itself writes every page. ``pin`` uses CUDA pinned memory (page aligned too) for device-to-host
    staging.

    ``huge`` (default: ``prefault``) asks for transparent huge pages. A buffer the CPU touches first then
    costs 512 page faults per GiB instead of 262144 (measured here: 0.07 s instead of 0.30 s to allocate
    and touch 1 GiB, and a faster unmap). A read buffer that O_DIRECT fills first does better with 4 KiB
    pages: faulting in huge pages while the reads pin them made a cold 1 GiB read take 0.68-1.17 s
    against 0.64-0.68 s (bench/bench_restore.py's raw read into a fresh buffer, three runs each).
    """
    if huge is None:
        huge = prefault
    import torch

    size = max(round_up(nbytes), BLOCK)
    if pin and torch.cuda.is_available():
        t = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    else:
        mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if huge and hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                mm.madvise(mmap.MADV_HUGEPAGE)
            except OSError:  # THP disabled: fall back to 4 KiB pages
                pass
        t = torch.frombuffer(mm, dtype=torch.uint8)
        t._rslurm_mmap = mm  # type: ignore[attr-defined]  # keep the mapping alive with the tensor
    if prefault:
        t.zero_()
    return t


class HostBuffer:
    """Page-aligned anonymous memory of at least ``nbytes`` (rounded up to BLOCK), read into and parsed without
    torch: restore's small items. ``view`` is a writable memoryview of it, ``address`` its first byte's; a
    uint8 tensor over the same memory is made only when something asks for one (:meth:`tensor`). A restore of
    small tensors in our framing never does: each is copied out with one memmove (checkpoint/apply.py), and
    the first ``torch.frombuffer`` and ``Tensor.numpy`` in a process run code that a node whose pages were
    reclaimed reads from disk (two major faults, 4.6-5.2 ms in a fresh process here, against 0.05 ms warm)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = max(round_up(nbytes), BLOCK)
        self._mm = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.view = memoryview(self._mm)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self.view))
        self._tensor: torch.Tensor | None = None

    def tensor(self) -> torch.Tensor:
        """A uint8 CPU tensor over this memory (made once; it keeps the memory alive)."""
        if self._tensor is None:
            import torch

            self._tensor = torch.frombuffer(self._mm, dtype=torch.uint8)
            self._tensor._rslurm_mmap = self._mm  # type: ignore[attr-defined]
        return self._tensor


def as_memoryview(t: torch.Tensor) -> memoryview:
    """A writable, zero-copy memoryview of a contiguous uint8 CPU tensor (for pwrite/preadv)."""
    return memoryview(cast(Any, t.numpy()))


def checksum(data: memoryview | bytes) -> str:
    """Checksum used in manifests (xxh3_64, hex)."""
    return xxhash.xxh3_64_hexdigest(data)


@dataclass(frozen=True)
class WrittenFile:
    """Result of :func:`write_file`."""

    size: int
    checksum: str
    chunk_checksums: tuple[str, ...]


def fs_free_bytes(path: str) -> int:
    """Free bytes available to this user on the filesystem holding ``path``."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def check_free_space(path: str, need: int, *, what: str) -> None:
    """Raise :class:`InsufficientSpaceError` before writing if ``path`` cannot hold ``need`` bytes."""
    free = fs_free_bytes(path)
    if free < need:
        raise InsufficientSpaceError(
            f"{what}: needs {need / 2**20:.1f} MiB but {path} has {free / 2**20:.1f} MiB free; free space "
            "there (or point RSLURM_LOCAL_DIR elsewhere). Older checkpoints were left intact."
        )


def _open_for_write(path: str) -> tuple[int, bool]:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
    if _O_DIRECT:
        try:
            return os.open(path, flags | _O_DIRECT, 0o600), True
        except OSError as exc:  # tmpfs and some FUSE filesystems refuse O_DIRECT
            if exc.errno != errno.EINVAL:
                raise
    return os.open(path, flags, 0o600), False


def write_file(
    path: str,
    segments: Sequence[tuple[memoryview, int]],
    chunks: Sequence[tuple[int, int]],
    *,
    threads: int = 4,
    before_piece: Callable[[int], None] | None = None,
    after_piece: Callable[[int], None] | None = None,
    piece: int = _IO_CHUNK,
) -> WrittenFile:
    """Write ``segments`` back to back into ``path``, fsync it, and checksum the file and each chunk.

    Each segment is ``(buffer, length)``: a page-aligned buffer with room for ``round_up(length)``
    bytes; every segment but the last must have a block-multiple length, so each O_DIRECT request is
    aligned (the last segment's padding is written, then truncated away). Writes are issued as parallel
    pwrite calls; checksums are computed on the same memory while the writes run. ``chunks`` are
    (file offset, length) ranges, each inside one segment. ``before_piece(n)`` runs on a writer thread
    before each piece (a bandwidth cap); ``after_piece(n)`` on the calling thread after each piece, in
    order (progress; an exception there stops the write, and the caller removes the file).
    """
    fd, direct = _open_for_write(path)
    starts = []
    pos = 0
    for _, n in segments:
        starts.append(pos)
        pos += n
    size = pos

    def view(off: int, n: int) -> memoryview:
        for (buf, length), start in zip(segments, starts):
            if start <= off and off + n <= start + max(length, round_up(length) if direct else length):
                return buf[off - start : off - start + n]
        raise ValueError(f"range {off}+{n} crosses a segment boundary")

    try:
        pieces = []
        for (_, length), start in zip(segments, starts):
            span = round_up(length) if direct else length
            pieces += [(start + o, min(piece, span - o)) for o in range(0, span, piece)]

        def put(piece: tuple[int, int]) -> None:
            off, n = piece
            if before_piece is not None:  # e.g. a bandwidth cap: runs on the writer thread
                before_piece(n)
            pwrite_all(fd, view(off, n), off)

        def digest() -> tuple[str, tuple[str, ...]]:
            h = xxhash.xxh3_64()
            for buf, length in segments:
                h.update(buf[:length])
            return h.hexdigest(), tuple(checksum(view(o, n)) for o, n in chunks)

        with ThreadPoolExecutor(max_workers=max(1, threads) + 1, thread_name_prefix="rslurm-write") as pool:
            sums = pool.submit(digest)
            futs = [(pool.submit(put, p), p) for p in pieces]
            try:
                for f, (off, n) in futs:
                    f.result()
                    if after_piece is not None:  # on the calling thread: it may raise to interrupt the write
                        after_piece(max(0, min(n, size - off)))
            except BaseException:
                for f, _ in futs:
                    f.cancel()
                raise
            file_sum, chunk_sums = sums.result()
        if direct and round_up(size) != size:
            os.ftruncate(fd, size)
        os.fsync(fd)
    except OSError as exc:
        raise write_error(path, exc) from exc
    finally:
        os.close(fd)
    return WrittenFile(size=size, checksum=file_sum, chunk_checksums=chunk_sums)


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """Write all of ``data`` at ``offset`` (pwrite may write less than asked)."""
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)


def write_error(path: str, exc: OSError) -> Exception:
    """The error to raise for a failed write of ``path``: a full filesystem or quota is
    InsufficientSpaceError (older checkpoints are intact), anything else a storage error."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return InsufficientSpaceError(f"{path}: the filesystem filled up while writing ({exc.strerror}); "
                                      "free space there. Older checkpoints were left intact.")
    return storage_error(f"{path}: write failed: {exc}", exc)


class ShardFile:
    """A file written in parts, one after another from its start (a save staged in waves under a memory
    budget, checkpoint/staging.py): each part is checksummed as it is written, so the file's checksum is
    :func:`write_file`'s. With O_DIRECT every part but the last must have a block-multiple length, in a
    buffer with room for ``round_up(n)`` bytes; :meth:`finish` truncates the last part's padding away and
    fsyncs."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd, self.direct = _open_for_write(path)
        self.size = 0
        self._hash = xxhash.xxh3_64()

    def put(self, buf: memoryview, n: int) -> None:
        """Write ``buf[:n]`` at the end of what is written."""
        self.hash(buf[:n])
        self.write_at(buf, n, self.size - n)

    def hash(self, data: memoryview) -> None:
        """Count ``data`` as the next bytes of the file (its checksum, its size); :meth:`write_at` writes
        them, on any thread, while the caller prepares the next part."""
        self._hash.update(data)
        self.size += len(data)

    def write_at(self, buf: memoryview, n: int, offset: int) -> None:
        """Write ``buf[:n]`` at ``offset`` (a pwrite: any thread)."""
        try:
            pwrite_all(self.fd, buf[:round_up(n) if self.direct else n], offset)
        except OSError as exc:
            raise write_error(self.path, exc) from exc

    def finish(self) -> str:
        """Truncate, fsync and close; the file's checksum."""
        try:
            if self.direct and round_up(self.size) != self.size:
                os.ftruncate(self.fd, self.size)
            os.fsync(self.fd)
        except OSError as exc:
            raise write_error(self.path, exc) from exc
        finally:
            self.close()
        return self._hash.hexdigest()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def read_file_into(
    path: str,
    buf: memoryview,
    size: int,
    *,
    threads: int = 4,
    ranges: Sequence[tuple[int, int]] = (),
) -> list[str]:
    """Read the first ``size`` bytes of ``path`` into page-aligned ``buf`` (O_DIRECT when possible).

    Returns the checksums of ``ranges`` ((offset, length) pairs), each computed as soon as the pieces
    covering it have arrived, so hashing overlaps the remaining reads instead of following them.
    """
    return read_spans(path, [(0, buf)], size, threads=threads, ranges=[(0, off, n) for off, n in ranges])


def _open_for_read(path: str) -> tuple[int, bool]:
    """``path`` opened for reading, with O_DIRECT where the filesystem takes it; the fd and whether it did.
    Only a regular file is read, through :func:`paths.open_regular` (never a final link, never blocking on a
    FIFO): a link or special file put where a shard was raises :class:`UnsafePathError` naming it, whoever
    checked the path before."""
    def opened(flags: int) -> int:
        return paths.open_regular(path, flags, error=UnsafePathError, where="a checkpoint tree (where a shard goes)")

    if _O_DIRECT:
        try:
            return opened(os.O_RDONLY | _O_DIRECT), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    return opened(os.O_RDONLY), False


# Ranges hashed by one task of read_spans: small items go in batches (a task per item cost more in handing
# the GIL between threads than the hashing: 14 ms for restore's 250 small items, measured), large ones alone.
_HASH_BATCH = 4 << 20


# Pauses before reading a piece again after an error that may pass (TRANSIENT_ERRNOS: an EIO of a disk or a
# filesystem that recovers, an interrupted call): a restore that gave up at once would skip a sound step and
# restore an older one. An error that persists costs these 0.35 s per piece in flight, then fails the read.
READ_RETRY_PAUSES = (0.05, 0.3)


def _pread(fd: int, path: str, buf: memoryview, offset: int) -> int:
    """One ``preadv`` of ``buf`` at ``offset`` of file ``path``, read again after each of
    :data:`READ_RETRY_PAUSES` while the error is one that may pass; a failed read raises StorageError naming the
    file and the bytes (TransientStorageError for an I/O error that may pass: :func:`storage_error`)."""
    for pause in (*READ_RETRY_PAUSES, None):
        try:
            return os.preadv(fd, [buf], offset)
        except OSError as exc:
            if pause is None or exc.errno not in TRANSIENT_ERRNOS:
                raise storage_error(f"{path}: reading bytes {offset}+{len(buf)} failed: {exc.strerror or exc}",
                                    exc) from exc
            log.warning("%s: reading bytes %d+%d failed (%s); reading them again in %.2f s", path, offset, len(buf),
                        exc.strerror or exc, pause)
            time.sleep(pause)
    raise AssertionError("unreachable")


def _batches(order: Sequence[int], lengths: Sequence[int], limit: int) -> list[list[int]]:
    """The indices ``order``, in that order, cut into runs whose ``lengths`` add up to at most ``limit`` bytes
    (a longer one is a run of its own)."""
    out: list[list[int]] = []
    total = 0
    for j in order:
        if not out or total + lengths[j] > limit:
            out.append([])
            total = 0
        out[-1].append(j)
        total += lengths[j]
    return out


def read_spans(
    path: str,
    spans: Sequence[tuple[int, memoryview]],
    size: int,
    *,
    threads: int = 4,
    ranges: Sequence[tuple[int, int, int]] = (),
) -> list[str]:
    """Read parts of file ``path`` (``size`` bytes long) into separate page-aligned buffers.

    Each span is ``(file offset, buffer)``: the offset is a multiple of BLOCK and the buffer page aligned,
    so every request can bypass the page cache; the span ends at the end of its buffer or of the file.
    Restore reads a large tensor into a buffer of its own (it then becomes that tensor's memory, see
    checkpoint/restore.py) and the small items into one shared buffer. Spans may overlap by a block where
    two of them share one.

    ``ranges`` are ``(span index, offset in that span, length)``; their checksums are returned, each
    computed as soon as the pieces covering it have arrived, so hashing overlaps the remaining reads.
    A span that ends short of what the file should hold raises StorageError (the file is truncated).
    """
    fd, direct = _open_for_read(path)
    try:
        # What each span must receive, and what it asks for (O_DIRECT rounds the tail up to a block).
        want = [max(0, min(len(buf), size - off)) for off, buf in spans]
        ask = [min(len(buf), round_up(w)) if direct else w for (_, buf), w in zip(spans, want)]
        plan = [(i, o) for i, n in enumerate(ask) for o in range(0, n, _IO_CHUNK)]
        first: dict[int, int] = {}  # span index -> index of its first piece in plan
        last: dict[int, int] = {}
        for k, (i, _) in enumerate(plan):
            first.setdefault(i, k)
            last[i] = k

        def get(piece: tuple[int, int]) -> int:
            i, off = piece
            base, buf = spans[i]
            n = min(_IO_CHUNK, ask[i] - off)
            got = 0
            while got < n:
                r = _pread(fd, path, buf[off + got : off + n], base + off + got)
                if r == 0:
                    break
                got += r
            return min(got, want[i] - off)

        workers = max(1, threads)
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rslurm-read") as readers, \
                ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rslurm-hash") as hashers:
            pieces = [readers.submit(get, p) for p in plan]

            def needs(r: tuple[int, int, int]) -> range:
                """The pieces range ``r`` lies in (none where its span asked for nothing)."""
                i, off, n = r
                if i not in first:
                    return range(0)
                lo = first[i] + off // _IO_CHUNK
                hi = min(last[i], first[i] + (off + max(n, 1) - 1) // _IO_CHUNK)
                return range(min(lo, hi), hi + 1)

            waits = [needs(r) for r in ranges]
            sums: list[str] = [""] * len(ranges)

            def digest(batch: Sequence[int]) -> None:
                for j in batch:
                    for k in waits[j]:
                        pieces[k].result()  # wait for exactly the pieces this range lies in
                    i, off, n = ranges[j]
                    sums[j] = checksum(spans[i][1][off : off + n])

            # Batched in the order their last pieces arrive, so that no range waits behind a later one.
            order = sorted(range(len(ranges)), key=lambda j: waits[j].stop)
            tasks = [hashers.submit(digest, batch) for batch in _batches(order, [r[2] for r in ranges], _HASH_BATCH)]
            got = [0] * len(spans)
            for (i, _), f in zip(plan, pieces):
                got[i] += f.result()
            for (off, _), w, g in zip(spans, want, got):
                if g < w:
                    raise StorageError(f"{path}: short read ({off + g} of {size} bytes): the file is truncated")
            for task in tasks:
                task.result()
            return sums
    finally:
        os.close(fd)


# The ring is memory a fresh process touches for the first time: its pages are faulted in by the first reads
# (0.16-0.18 s for 128 MiB of huge pages on a VM whose host backs guest memory lazily, measured here), so it is
# kept small. 4 MiB requests read as fast as 16 MiB ones here (docs/benchmarks.md, "In place").
RING_PIECE = 4 << 20  # bytes per read of read_through: a ring slot
RING_SLOTS = 8  # reads in flight or waiting for the caller: 32 MiB of ring in all
RING_HANDOVER = 1 << 20  # bytes hashed and handed to the sink at a time: within a core's cache


class Ring:
    """The read buffers of :func:`read_through`: up to ``slots`` page-aligned buffers of ``piece`` bytes each, on
    huge pages, reused read after read. One ring serves every file a restore reads; its first touch is the slow
    part (the ring's comment above), which :meth:`warm` does on a thread of its own while the caller prepares
    the reads (restore: while it opens the step and plans its reads, checkpoint/restore_round.py).

    A read takes whichever slot is free (:meth:`acquire`) and gives it back once its bytes are handed over
    (:meth:`release`): the reads start with the first slot made and go on through the slots made so far while
    the others are faulted in. On a VM whose host backs guest memory lazily, making a slot took 0.5 to 10 ms
    here, run to run; reads that each waited for a slot of their own stood idle while the later ones were made."""

    def __init__(self, piece: int = RING_PIECE, slots: int = RING_SLOTS) -> None:
        self.piece, self.slots = piece, slots
        self._bufs: list[Any] = [None] * slots
        self.views: list[memoryview] = [memoryview(b"")] * slots
        self._warming: threading.Thread | None = None
        self._stopped = False
        self._lock = threading.Lock()
        self._unclaimed = list(range(slots - 1, -1, -1))  # slots no thread has set out to make (popped from the end)
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()  # made and not in use

    def warm(self) -> Ring:
        """Start faulting in every slot, one after the other, on a thread of its own (once: a ring warmed already
        is left as it is); returns the ring. Each slot is free for a read as soon as it is made."""
        if self._warming is not None or self._stopped:
            return self

        def run() -> None:
            while not self._stopped and (i := self._claim()) is not None:
                try:
                    self._make(i, prefault=True)
                except Exception as exc:  # noqa: BLE001 - a slot not made now is made by a read that finds none free
                    self._unclaim(i)
                    log.debug("read ring not warmed: %s", exc)
                    return
                self._free.put(i)

        self._warming = threading.Thread(target=run, name="rslurm-ring", daemon=True)
        self._warming.start()
        return self

    def done(self) -> None:
        """The caller's reads are over: the warming thread makes no further slot (it ends after the one it
        is making, if any, and is waited for), so it does not go on touching memory beside the program."""
        self._stopped = True
        if self._warming is not None:
            self._warming.join()

    def _claim(self) -> int | None:
        with self._lock:
            return self._unclaimed.pop() if self._unclaimed else None

    def _unclaim(self, i: int) -> None:
        with self._lock:
            self._unclaimed.append(i)

    def _make(self, i: int, prefault: bool = False) -> None:
        # A plain mapping, not a tensor: the warming thread then never holds the GIL for long (a first
        # torch.frombuffer in a process runs torch code for the first time, which a cold node reads from disk,
        # while the restore's own thread waits for the GIL), and the first touch is one memset with the GIL
        # released, not a torch op spread over the intra-op threads.
        buf = mmap.mmap(-1, round_up(self.piece), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            with contextlib.suppress(OSError):  # THP disabled: 4 KiB pages
                buf.madvise(mmap.MADV_HUGEPAGE)
        view = memoryview(buf)
        if prefault:
            ctypes.memset(ctypes.addressof(ctypes.c_char.from_buffer(view)), 0, len(view))
        self.views[i] = view
        self._bufs[i] = buf

    def acquire(self) -> int:
        """A free slot (its index; its buffer is ``views[i]``), for one reader until :meth:`release`: one made
        already, else one made now where no thread is making any (not warmed, stopped, or its thread failed),
        else the next one freed or made."""
        while True:
            try:
                return self._free.get_nowait()
            except queue.Empty:
                pass
            warming = self._warming is not None and self._warming.is_alive()
            if not warming and (i := self._claim()) is not None:
                try:
                    self._make(i)
                except BaseException:
                    self._unclaim(i)
                    raise
                return i
            try:
                return self._free.get(timeout=0.05 if warming else None)
            except queue.Empty:
                continue  # the warming thread may have ended without making the rest: look again

    def release(self, i: int) -> None:
        """Slot ``i`` is free again."""
        self._free.put(i)


def read_through(
    path: str,
    size: int,
    items: Sequence[tuple[int, int]],
    sink: Callable[[int, int, memoryview], None],
    *,
    threads: int = 4,
    ring: Ring | None = None,
    handover: int = RING_HANDOVER,
) -> list[str]:
    """Read byte ranges of file ``path`` (``size`` bytes long) through a small ring of page-aligned buffers,
    handing each range's bytes to ``sink`` in order, and return each range's checksum.

    ``items`` are ``(file offset, length)``, not overlapping; ``sink(k, at, view)`` is called with an item's
    index, the offset in the item and a view of its next bytes (valid only during the call), from the
    calling thread, in file order, ``handover`` bytes at a time. The file is read in requests of a ring slot's
    size over the spans the items cover (neighbouring items share requests, as a raw read of the file would),
    O_DIRECT where the file allows, ``threads`` of them in flight, into the slots of ``ring`` (:class:`Ring`;
    a new one by default), reused: the memory the caller places the bytes into is the only memory a large
    read touches (restore reads a tensor's bytes straight into the program's own tensor,
    checkpoint/restore_round.py). Each checksum is computed while the next pieces are read. A range that
    ends past what the file holds raises StorageError (the file is truncated); an exception of ``sink`` ends
    the read and propagates.
    """
    with ReadThrough(path, size, items, threads=threads, ring=ring, handover=handover) as reads:
        return reads.finish(sink)


def _update_all(hashes: list[Any], parts: list[tuple[int, int, memoryview]]) -> None:
    """Each part's bytes into its item's running hash, in order (ReadThrough's hash thread)."""
    for k, _, view in parts:
        hashes[k].update(view)


class ReadThrough:
    """One :func:`read_through` of a file: :meth:`finish` opens it, queues the requests (as many ahead as the
    ring has slots), hands every range's bytes to the sink and returns the checksums; :meth:`close` (also on
    leaving it as a context manager) waits for the requests in flight, gives their slots back and closes the
    file."""

    def __init__(self, path: str, size: int, items: Sequence[tuple[int, int]], *, threads: int = 4,
                 ring: Ring | None = None, handover: int = RING_HANDOVER) -> None:
        if handover <= 0:
            raise ValueError(f"read_through: handover must be a positive number of bytes, not {handover}")
        for off, n in items:
            if off < 0 or n < 0 or off + n > size:
                raise StorageError(f"{path}: bytes {off}+{n} lie past its end ({size} bytes): the file is truncated")
        self.path, self.size, self.items, self.handover = path, size, list(items), handover
        self.threads = max(1, threads)
        self.order = sorted((k for k, (_, n) in enumerate(self.items) if n), key=lambda k: self.items[k][0])
        self.ring = ring or Ring()
        self.plan: list[tuple[int, int]] = []  # (offset, asked) of each request
        self.depth = 0  # requests queued ahead of the caller (each holds a slot once it runs)
        self._fd: int | None = None
        self._readers: ThreadPoolExecutor | None = None
        self._pending: dict[int, Any] = {}
        self._turn = threading.Condition()
        self._next = 0  # the request whose turn it is to take a slot

    def __enter__(self) -> ReadThrough:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        """Open the file and queue the first reads (once; :meth:`finish` does it where it was not done): as
        many as the ring has slots, read while the caller does other work. Nothing is handed to a sink before
        :meth:`finish`; :meth:`close` ends the reads unused."""
        if self._fd is not None or not self.order:
            return
        self._fd, direct = _open_for_read(self.path)
        spans = merged_spans([((off // BLOCK * BLOCK, round_up(off + n)) if direct else (off, off + n))
                              for off, n in (self.items[k] for k in self.order)])
        piece = self.ring.piece
        self.plan = [(at, min(piece, hi - at)) for lo, hi in spans for at in range(lo, hi, piece)]
        # The slots are on huge pages: O_DIRECT pins every page of its buffer for each request, and 4 KiB pages
        # made a cold 1 GiB read take 1.1 s instead of 0.5 s here. A request takes any free slot (Ring.acquire):
        # the first reads go through the slots made so far while the warming makes the others.
        self.depth = min(self.ring.slots, len(self.plan))
        self._readers = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="rslurm-read")
        self._pending = {i: self._readers.submit(self._get, i) for i in range(self.depth)}

    def _get(self, idx: int) -> tuple[int, int]:
        """Request ``idx`` read into a free slot: (the slot, bytes read). The slot is the caller's to release."""
        at, n = self.plan[idx]
        # Slots are taken in the order of the requests: the request the caller waits for next never waits for a
        # slot that a later one took (nor, with the warming stalled, for one that is never made).
        with self._turn:
            self._turn.wait_for(lambda: self._next == idx)
        try:
            slot = self.ring.acquire()
        finally:
            with self._turn:
                self._next += 1
                self._turn.notify_all()
        try:
            buf = self.ring.views[slot]
            got = 0
            assert self._fd is not None
            while got < n:
                r = _pread(self._fd, self.path, buf[got:n], at + got)
                if r == 0:
                    break
                got += r
        except BaseException:
            self.ring.release(slot)
            raise
        return slot, got

    def finish(self, sink: Callable[[int, int, memoryview], None]) -> list[str]:
        """Hand every range's bytes to ``sink`` (from this thread, in file order; see :func:`read_through`) and
        return each range's checksum. Call once; the reads are over (and the file closed) when it returns.

        Where the file takes more than one request, a slot's bytes are hashed on a thread of its own while this
        thread hands them to the sink (xxh3 and the sink's copy both release the GIL): the two passes over the
        slot run side by side instead of one after the other, and the slot is given back once both are over.
        A file of one request is hashed here, part by part, as it is handed over."""
        hashes = [xxhash.xxh3_64() for _ in self.items]
        self.start()
        plan, depth, pending = self.plan, self.depth, self._pending
        hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rslurm-hash") if len(plan) > 1 else None
        try:
            first = 0  # the first item (in file order) not yet wholly handed over
            for idx, (at, asked) in enumerate(plan):
                slot, got = pending.pop(idx).result()
                hashed = None
                try:
                    parts, done = self._parts(first, slot, at, asked, at + got)
                    if hasher is None:
                        for k, u, view in parts:
                            hashes[k].update(view)
                            sink(k, u, view)
                    else:
                        hashed = hasher.submit(_update_all, hashes, parts)
                        for k, u, view in parts:
                            sink(k, u, view)
                        hashed.result()
                    first = done
                finally:
                    if hashed is not None:  # the slot's bytes are being read until its hash is over, whatever befell
                        futures_wait([hashed])
                    self.ring.release(slot)
                if idx + depth < len(plan):  # a slot is free again
                    assert self._readers is not None
                    pending[idx + depth] = self._readers.submit(self._get, idx + depth)
        finally:
            if hasher is not None:
                hasher.shutdown(wait=True)
            self.close()
        return [h.hexdigest() for h in hashes]

    def _parts(self, first: int, slot: int, at: int, asked: int,
               end: int) -> tuple[list[tuple[int, int, memoryview]], int]:
        """The bytes of the request at ``at`` (``asked`` long, read up to ``end``) in ``slot``, item by item from
        ``first`` (the first item not yet wholly handed over), in parts of at most ``handover`` bytes: ``(item,
        offset in the item, view)`` each, and the new ``first``. Parts are small enough to stay in a core's cache
        between the hash and the sink's copy where both run on the calling thread (a file of one request)."""
        items, order = self.items, self.order
        parts: list[tuple[int, int, memoryview]] = []
        view_of = self.ring.views[slot]
        j = first
        while j < len(order):
            k = order[j]
            off, n = items[k]
            if off >= at + asked:
                break  # this item begins in a later piece
            x, y = max(off, at), min(off + n, end)
            if min(off + n, at + asked) > end:
                raise StorageError(f"{self.path}: short read ({end} of {self.size} bytes): the file is truncated")
            parts.extend((k, u - off, view_of[u - at : min(y, u + self.handover) - at])
                         for u in range(x, y, self.handover))
            if off + n <= at + asked:
                first = j + 1  # wholly handed over
            j += 1
        return parts, first

    def close(self) -> None:
        """No further read is issued; those in flight are waited for (they write into the ring) and their slots
        given back, then the file is closed. Idempotent."""
        pending, self._pending = self._pending, {}
        for f in pending.values():
            f.cancel()
        if self._readers is not None:
            self._readers.shutdown(wait=True)
            self._readers = None
        for f in pending.values():
            if not f.cancelled() and f.exception() is None:
                self.ring.release(f.result()[0])
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def merged_spans(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, non-overlapping cover of ``[a, b)`` spans (touching ones joined)."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def fsync_dir(path: str) -> None:
    """fsync a directory so that renames and creations inside it are durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def unpublished_on_error(tmp: str, what: str, *, dir_fd: int | None = None) -> Iterator[None]:
    """Around writing ``tmp`` (relative to ``dir_fd`` when given) and renaming it into place: on any failure
    (or interruption) remove ``tmp``, and turn OS errors into :class:`InsufficientSpaceError` /
    :class:`StorageError` (:class:`TransientStorageError` for an error that may pass, such as a
    read-only or unreachable filesystem) that name ``what``. Nothing partial is ever left under the final
    name."""
    try:
        yield
    except BaseException as exc:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        # A write of ``tmp`` that failed (write_file: write_error) names the temporary file, which is gone now:
        # the error names what was being written instead, with the cause. (Other errors that name it, such as
        # an UnsafePathError for a link found in its place, say what they mean and stay as they are.)
        written = type(exc) in (InsufficientSpaceError, StorageError, TransientStorageError)
        cause = exc.__cause__ if written and str(exc).startswith(f"{tmp}:") else exc
        if isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT):
            raise InsufficientSpaceError(f"{what}: the filesystem filled up ({cause.strerror}); free space there. "
                                         "Nothing partial was published; older checkpoints were left intact.") from exc
        if isinstance(cause, OSError):
            raise storage_error(f"{what} failed: {cause}", cause) from exc
        raise


# errno values of a storage fault that may pass: a filesystem remounted read-only for a moment, a
# Lustre/NFS server that does not answer, a stale handle after a failover. Retried (daemon, tiers).
TRANSIENT_ERRNOS = frozenset({errno.EROFS, errno.EIO, errno.ETIMEDOUT, errno.ESTALE, errno.ENOTCONN,
                              errno.ESHUTDOWN, errno.EAGAIN, errno.EBUSY, errno.EHOSTDOWN, errno.EHOSTUNREACH,
                              errno.ENETDOWN, errno.ENETUNREACH, errno.ECONNRESET, errno.ECONNREFUSED,
                              errno.EINTR, errno.ENOLINK, errno.ECOMM})


def storage_error(message: str, exc: BaseException | None = None) -> StorageError:
    """:class:`TransientStorageError` when ``exc`` (or its cause) is an OSError of
    :data:`TRANSIENT_ERRNOS`, else :class:`StorageError`; with ``message``."""
    cur: BaseException | None = exc
    while cur is not None:
        if isinstance(cur, OSError) and cur.errno in TRANSIENT_ERRNOS:
            return TransientStorageError(message)
        cur = cur.__cause__
    return StorageError(message)


def atomic_write(path: str, data: bytes, *, tmp: str | None = None, root: str | None = None) -> None:
    """Write ``data`` to ``path`` atomically: temp name (``tmp``, default ``<path>.tmp-<pid>``), fsync,
    rename, fsync of the directory.

    ``root``: ``path`` lies below it (a local root) and no component below ``root`` may be a link or
    anything but a directory (:func:`resilient_slurm.paths.open_parent`, which also creates missing
    directories): the temp file is created and renamed relative to the directory reached that way, so a
    run directory or ``metrics/`` replaced by a link is never written through (ConfigError naming it)."""
    if root is not None:
        _atomic_write_below(root, path, data)
        return
    d = os.path.dirname(path) or "."
    tmp = tmp or f"{path}.tmp-{os.getpid()}"
    with unpublished_on_error(tmp, f"writing {path}"):
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        fsync_dir(d)


def _atomic_write_below(root: str, path: str, data: bytes) -> None:
    pfd, name = paths.open_parent(root, path, make_dirs=True)
    tmp = f"{name}.tmp-{os.getpid()}-{os.urandom(3).hex()}"
    try:
        with unpublished_on_error(tmp, f"writing {path}", dir_fd=pfd):
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=pfd)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, name, src_dir_fd=pfd, dst_dir_fd=pfd)
            os.fsync(pfd)
    finally:
        os.close(pfd)


def open_regular(path: str, *, what: str = "a file") -> int:
    """Open a file of a checkpoint tree (local or POSIX durable) read-only, through
    :func:`resilient_slurm.paths.open_regular`: never through a final symbolic link, never blocking on
    a FIFO, only a regular file. A link or special file raises :class:`UnsafePathError` naming the path
    and ``what`` should be there; FileNotFoundError and OSError as ``os.open``."""
    return paths.open_regular(path, os.O_RDONLY, error=UnsafePathError, where=f"a checkpoint tree (where {what} goes)")


@contextlib.contextmanager
def reading_step(step_dir: str) -> Iterator[bool]:
    """Hold a shared lock on a committed step's manifest while reading it, so retention and eviction
    (which take the lock exclusively, without waiting) never delete it underneath. Yields False when
    the step has no manifest (gone or never committed). A child forked meanwhile does not keep the lock
    (:mod:`~resilient_slurm.flocks`)."""
    manifest = os.path.join(step_dir, "manifest.json")
    try:  # never blocks on a FIFO nor follows a link: a special file is then refused by the reader
        fd = open_locked_fd(lambda: os.open(manifest, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC))
    except OSError as exc:
        yield exc.errno == errno.ELOOP
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        yield True
    finally:
        close_locked_fd(fd)


def remove_tree(path: str) -> None:
    """Remove a directory tree, tolerating concurrent removal. A link or a file at ``path`` is removed itself,
    never what a link points to (rmtree refused a link: a step directory that was one stayed behind)."""
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            os.unlink(path)
            return
    except FileNotFoundError:
        return
    shutil.rmtree(path, ignore_errors=False, onerror=_ignore_missing)


def remove_tree_quietly(path: str) -> None:
    """:func:`remove_tree` for clean-ups whose failure must not fail the caller: an OSError is logged."""
    try:
        remove_tree(path)
    except OSError as exc:
        log.warning("could not remove %s: %s", path, exc)


def _ignore_missing(func: object, path: str, exc_info: tuple) -> None:  # type: ignore[type-arg]
    exc = exc_info[1]
    if isinstance(exc, FileNotFoundError):
        return
    raise exc
