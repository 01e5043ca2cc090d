"""Compressed shards on the durable tier: zstd over byte-grouped frames, chosen per file, read back
transparently.

Why: the durable tier is where bytes are paid for (S3 storage and transfer, a Lustre quota). Trained
floating-point tensors compress poorly as they are, but grouping the bytes of each element by position
(every element's first byte, then every second byte, ...) puts the exponent bytes together, and zstd
shrinks those well (docs/benchmarks.md, "Compression on the durable tier").

Who calls what:

- the drain (daemon/drain.py): :func:`holds` (does the tier already hold this shard, stored either way?)
  then :func:`put_shard`, which follows the tier's :attr:`~.tier.StorageTier.compression` ("off" or
  "zstd"): with zstd it samples the file, picks the grouping that compresses the sample best (plain,
  2-byte or 4-byte elements), and when that saves at least :data:`MIN_SAVING` of the sample it encodes
  the file into a scratch file beside the step (the raw bytes checked against the manifest's xxh3 as they
  are read, as ``put_file`` does) and uploads that with ``put_file`` (its own xxh3 recorded as the
  object's checksum). A file that does not pay, or a scratch disk that is full, is uploaded as it is.
- restore's fetch, ``rslurm verify`` and ``rslurm export``: :func:`get_shard` (whole file) and
  :func:`get_shard_ranges` (a resharded plan's items), which read either kind.

Which kind an object is: a stored object is compressed exactly when its size differs from the manifest's
size of the file and it ends with this format's footer; the encoder never keeps an encoding that is not
smaller than the file. So a file stored as it is costs readers nothing more than before, and no record
outside the object is needed (the durable manifests are the same bytes either way).

The format (little endian)::

    frame 0 | frame 1 | ... | frame n-1 | index | footer

- frame i: raw bytes ``[i * frame_size, min((i + 1) * frame_size, raw_size))``, stored by its mode: 0 as
  they are, k in (1, 2, 4, 8) as a zstd frame (with zstd's content checksum) of the bytes grouped by
  k-byte element (k = 1: plain);
- index: per frame ``<IB>`` (stored length, mode);
- footer (:data:`FOOTER`): magic, raw size, frame size, frame count, the raw file's xxh3 (hex), the
  index's xxh3, and the xxh3 of the footer's own preceding bytes.

Integrity: every reader checks the raw bytes against the manifest (the whole file's xxh3, or each item's
own xxh3 for ranges), so the checksums that protect a checkpoint are those of the uncompressed bytes,
end to end; zstd's frame checksums and the footer's checks only name a damaged object sooner and more
precisely. A decoded frame larger than it should be is refused before it is allocated (no zip bomb).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import xxhash
import zstandard

from ..errors import CorruptCheckpointError, ObjectNotFoundError, ResilientSlurmError
from ..rundir import ENCODE_SCRATCH
from ..storage.fileio import fsync_dir, open_regular
from .tier import ObjectInfo, Progress, ReadRange, Span, StorageTier, TransferStats

log = logging.getLogger(__name__)

MAGIC = b"RSLZST01"
FOOTER = struct.Struct("<8sQII16sQQ")
INDEX_ENTRY = struct.Struct("<IB")
FRAME = 4 << 20  # raw bytes per frame: the unit of random access (a ranged read decodes whole frames)
MAX_FRAME = 64 << 20  # the largest frame size a reader accepts
MIN_FRAME = 64 << 10  # and the smallest (so an index is at most 5 bytes per 64 KiB of the file)
LEVEL = 1  # zstd level: level 3 saved no more on trained state and encodes slower (docs/benchmarks.md)
STRIDES = (1, 2, 4)  # the groupings tried: plain, 16-bit and 32-bit elements
MODES = (0, 1, 2, 4, 8)
SAMPLE_FRAMES = 8  # frames sampled to choose a file's grouping
SAMPLE_BYTES = 1 << 20  # bytes of each sampled frame
MIN_SAVING = 0.03  # a file is compressed only when its sample shrinks by at least this share
MIN_SIZE = 64 << 10  # smaller files are stored as they are
ENCODE_THREADS = 4  # frames encoded (or decoded) at once by one transfer
READ_BATCH = 64 << 20  # stored bytes one ranged read of a whole-file decode asks for (S3's default part size:
# fewer, larger requests; on moto a request costs time in proportion to the object, and 16 MiB batches made
# a restore 2.6 times slower)
DECODE_BUDGET = 8  # batches being read or decoded at once in this process, over every file it fetches
SCRATCH_PREFIX = ".rslurm-encode-"
COMPRESSIONS = ("off", "zstd")


# ------------------------------------------------------------------------------------------ frame codec
def _group(data: memoryview | bytes, k: int) -> bytes:
    """``data`` with the bytes of its k-byte elements grouped by position (a tail shorter than k stays last):
    the (elements, k) byte matrix transposed (numpy's copy of a transposed view runs at GB/s and releases
    the GIL, so frames are grouped in parallel)."""
    n = len(data) // k * k
    if k == 1 or n == 0:
        return bytes(data)
    return np.frombuffer(data, np.uint8, count=n).reshape(-1, k).T.tobytes() + bytes(data[n:])


def _ungroup(data: bytes, k: int) -> bytes:
    """The inverse of :func:`_group` (column by column: each copy is one long strided run)."""
    n = len(data) // k * k
    if k == 1 or n == 0:
        return data
    src = np.frombuffer(data, np.uint8, count=n).reshape(k, n // k)
    out = np.empty(len(data), np.uint8)
    cols = out[:n].reshape(n // k, k)
    for i in range(k):
        cols[:, i] = src[i]
    out[n:] = np.frombuffer(data, np.uint8)[n:]
    return out.tobytes()


_DECODE_BUDGET = threading.BoundedSemaphore(DECODE_BUDGET)
_local = threading.local()


def _compressor() -> zstandard.ZstdCompressor:
    c = getattr(_local, "c", None)
    if c is None:
        c = _local.c = zstandard.ZstdCompressor(level=LEVEL, write_checksum=True, write_content_size=True)
    return c


def _decompressor() -> zstandard.ZstdDecompressor:
    d = getattr(_local, "d", None)
    if d is None:
        d = _local.d = zstandard.ZstdDecompressor()
    return d


def encode_frame(raw: memoryview | bytes, k: int) -> tuple[bytes, int]:
    """One frame stored with grouping ``k``: (stored bytes, mode); as it is (mode 0) when zstd does not
    make it smaller."""
    blob = _compressor().compress(_group(raw, k))
    if len(blob) >= len(raw):
        return bytes(raw), 0
    return blob, k


def decode_frame(blob: bytes, mode: int, raw_len: int, where: str) -> bytes:
    """The raw bytes of one stored frame; CorruptCheckpointError naming ``where`` if they cannot be."""
    if mode == 0:
        if len(blob) != raw_len:
            raise CorruptCheckpointError(f"{where}: a stored frame is {len(blob)} bytes, not {raw_len}")
        return blob
    try:
        params = zstandard.get_frame_parameters(blob)
        if params.content_size != raw_len:
            raise CorruptCheckpointError(f"{where}: a frame says it holds {params.content_size} bytes, not {raw_len}")
        out = _decompressor().decompress(blob, max_output_size=raw_len)
    except zstandard.ZstdError as exc:
        raise CorruptCheckpointError(f"{where}: a compressed frame cannot be decoded ({exc})") from exc
    if len(out) != raw_len:
        raise CorruptCheckpointError(f"{where}: a frame decoded to {len(out)} bytes, not {raw_len}")
    return _ungroup(out, mode)


# ------------------------------------------------------------------------------------------ layout
@dataclass(frozen=True)
class Layout:
    """Where each frame of a compressed object is (from its footer and index)."""

    raw_size: int
    frame_size: int
    offsets: tuple[int, ...]  # stored offset of each frame, and the index's offset last
    modes: tuple[int, ...]
    raw_checksum: str

    def raw_len(self, i: int) -> int:
        return min(self.frame_size, self.raw_size - i * self.frame_size)

    @property
    def stored_size(self) -> int:
        return self.offsets[-1] + len(self.modes) * INDEX_ENTRY.size + FOOTER.size


def _footer(raw_size: int, frame_size: int, n: int, raw_checksum: str, index: bytes) -> bytes:
    head = struct.pack("<8sQII16sQ", MAGIC, raw_size, frame_size, n, raw_checksum.encode(),
                       xxhash.xxh3_64_intdigest(index))
    return head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head))


class DamagedEncodingError(CorruptCheckpointError):
    """An object that ends in this format's footer (it is a compressed shard) whose footer, index or frames
    are damaged."""


def read_layout(read: ReadRange, stored_size: int, where: str, raw_size: int) -> Layout | None:
    """The layout of a stored object of ``stored_size`` bytes, the encoding of a ``raw_size``-byte file, or
    None when it has no footer of this format (it is not compressed). Raises DamagedEncodingError when
    the footer is there but damaged or names another size (checked before the index is read: a footer
    cannot make a reader read or allocate more than a small share of the file's size)."""
    if stored_size < FOOTER.size:
        return None
    tail = read(stored_size - FOOTER.size, FOOTER.size)
    if len(tail) != FOOTER.size:
        raise CorruptCheckpointError(f"{where}: the object's last {FOOTER.size} bytes came back {len(tail)} bytes "
                                     "long (it shrank while it was read)")
    magic, said_size, frame_size, n, raw_ck, index_ck, own_ck = FOOTER.unpack(tail)
    if magic != MAGIC:
        return None
    if xxhash.xxh3_64_intdigest(tail[:-8]) != own_ck:
        raise DamagedEncodingError(f"{where}: the compressed object's footer is damaged")
    if said_size != raw_size:
        raise DamagedEncodingError(f"{where}: compressed object of a {said_size}-byte file, the manifest says "
                                     f"{raw_size}")
    if stored_size >= raw_size:  # the encoder keeps an encoding only when it is smaller
        raise DamagedEncodingError(f"{where}: a compressed object of {stored_size} bytes for a {raw_size}-byte "
                                     "file; it was not written by rslurm")
    if not (MIN_FRAME <= frame_size <= MAX_FRAME) or n != -(-raw_size // frame_size):
        raise DamagedEncodingError(f"{where}: the compressed object's footer is inconsistent "
                                     f"({raw_size} bytes in {n} frames of {frame_size})")
    index_at = stored_size - FOOTER.size - n * INDEX_ENTRY.size
    if index_at < 0:
        raise DamagedEncodingError(f"{where}: the compressed object is too short for its {n} frames")
    index = read(index_at, n * INDEX_ENTRY.size) if n else b""
    if xxhash.xxh3_64_intdigest(index) != index_ck:
        raise DamagedEncodingError(f"{where}: the compressed object's frame index is damaged")
    offsets, modes, pos = [], [], 0
    for i, (length, mode) in enumerate(INDEX_ENTRY.iter_unpack(index)):
        raw_len = min(frame_size, raw_size - i * frame_size)
        if mode not in MODES or (mode == 0 and length != raw_len) or (mode != 0 and length >= raw_len):
            raise DamagedEncodingError(f"{where}: frame {i} of the compressed object has a bad index entry")
        offsets.append(pos)
        modes.append(mode)
        pos += length
    if pos != index_at:
        raise DamagedEncodingError(f"{where}: the compressed object's frames do not add up to its size")
    offsets.append(pos)
    return Layout(raw_size, frame_size, tuple(offsets), tuple(modes), raw_ck.decode("ascii", "replace"))


# ------------------------------------------------------------------------------------------ encoding
def choose_stride(fd: int, size: int) -> tuple[int | None, float]:
    """The grouping that compresses a sample of the file best, and the sample's ratio; None when no
    grouping saves :data:`MIN_SAVING` (the file is stored as it is)."""
    if size < MIN_SIZE:
        return None, 1.0
    frames = -(-size // FRAME)
    n = min(SAMPLE_FRAMES, frames)  # spread over the file, the first and the last frame included
    picks = sorted({i * (frames - 1) // max(1, n - 1) for i in range(n)})
    sample = [os.pread(fd, min(SAMPLE_BYTES, size - i * FRAME), i * FRAME) for i in picks]
    total = sum(len(s) for s in sample)
    best, best_size = None, total
    for k in STRIDES:
        n = sum(len(_compressor().compress(_group(s, k))) for s in sample)
        if n < best_size:
            best, best_size = k, n
    ratio = best_size / total if total else 1.0
    return (best if ratio <= 1.0 - MIN_SAVING else None), ratio


def encode_file(src: str, dst: str, *, size: int, checksum: str, stride: int,
                threads: int = ENCODE_THREADS, progress: Progress | None = None) -> tuple[int, str] | None:
    """Encode local file ``src`` into new file ``dst``; return (stored size, stored xxh3), or None (dst
    removed) when the encoding is not smaller than the file. The raw bytes are checked against ``size``
    and ``checksum`` as they are read: a mismatch raises CorruptCheckpointError and nothing is kept.
    ``progress(0)`` is called after every frame (nothing is transferred yet): a drain that must yield to
    a more urgent step raises from it, and ``dst`` is removed."""
    raw_h, stored_h = xxhash.xxh3_64(), xxhash.xxh3_64()
    fin = open_regular(src, what="a local shard")
    fout = -1
    ok = False
    try:
        with contextlib.suppress(FileNotFoundError):  # a stale copy (the scratch is this process's)
            os.unlink(dst)
        fout = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        if os.fstat(fin).st_size != size:
            raise CorruptCheckpointError(f"{src}: local shard is {os.fstat(fin).st_size} bytes, the manifest says "
                                         f"{size}; not published")
        n = -(-size // FRAME)
        index, pos = bytearray(), 0

        def one(i: int) -> tuple[bytes, bytes, int]:
            raw = os.pread(fin, min(FRAME, size - i * FRAME), i * FRAME)
            blob, mode = encode_frame(raw, stride)
            return raw, blob, mode

        with ThreadPoolExecutor(max(1, threads), thread_name_prefix="rslurm-encode") as pool:
            window = max(1, threads) * 2
            pending = deque(pool.submit(one, i) for i in range(min(window, n)))
            for i in range(n):
                raw, blob, mode = pending.popleft().result()
                if i + window < n:
                    pending.append(pool.submit(one, i + window))
                if len(raw) != min(FRAME, size - i * FRAME):
                    raise CorruptCheckpointError(f"{src}: local shard changed while it was read; not published")
                raw_h.update(raw)
                stored_h.update(blob)
                _write_all(fout, blob, pos)
                pos += len(blob)
                index += INDEX_ENTRY.pack(len(blob), mode)
                if progress:
                    progress(0)
                if pos >= size:
                    return None
        if raw_h.hexdigest() != checksum:
            raise CorruptCheckpointError(f"{src}: local shard does not match its checksum in the manifest; not "
                                         "published")
        tail = bytes(index) + _footer(size, FRAME, n, checksum, bytes(index))
        if pos + len(tail) >= size:
            return None
        stored_h.update(tail)
        _write_all(fout, tail, pos)
        os.fsync(fout)
        ok = True
        return pos + len(tail), stored_h.hexdigest()
    finally:
        os.close(fin)
        if fout >= 0:
            os.close(fout)
            if not ok:
                with contextlib.suppress(OSError):
                    os.unlink(dst)


def _write_all(fd: int, data: bytes, pos: int) -> None:
    mv, done = memoryview(data), 0
    while done < len(data):
        done += os.pwrite(fd, mv[done:], pos + done)


# ------------------------------------------------------------------------------------------ the drain's side
def holds(tier: StorageTier, key: str, *, size: int, checksum: str) -> bool:
    """The tier already holds this file at ``key``, verified when it was stored: as it is (size and
    recorded checksum match), or compressed from exactly these bytes (its footer names them)."""
    info = tier.stat(key)
    if info is None or info.checksum is None:
        return False
    if info.size == size:
        return info.checksum == checksum
    try:
        with tier.open_ranges(key, info.size) as read:
            layout = read_layout(read, info.size, f"{tier.url}/{key}", size)
    except (CorruptCheckpointError, ObjectNotFoundError):
        return False
    return layout is not None and layout.raw_size == size and layout.raw_checksum == checksum \
        and layout.stored_size == info.size


def put_shard(tier: StorageTier, src: str, key: str, *, size: int, checksum: str, scratch: str,
              progress: Progress | None = None) -> TransferStats:
    """Upload local file ``src`` to ``key``, compressed when the tier's compression is on and it pays
    (see the module docstring). ``scratch``: a directory on the same disk for the encoded copy (created
    and removed here). ``stats.bytes`` counts the bytes stored."""
    if tier.compression != "zstd" or size < MIN_SIZE or len(checksum.encode()) != 16:
        return tier.put_file(src, key, size=size, checksum=checksum, progress=progress)
    fd = open_regular(src, what="a local shard")  # never a link, never blocking on a FIFO
    try:
        stride, ratio = choose_stride(fd, size)
    finally:
        os.close(fd)
    if stride is None:
        log.debug("%s: not compressed (a sample shrank to %.3f of its size)", key, ratio)
        return tier.put_file(src, key, size=size, checksum=checksum, progress=progress)
    tmp = os.path.join(scratch, f"{os.path.basename(src)}.{os.getpid()}.{threading.get_ident()}")
    try:
        try:
            _make_scratch(scratch)
            got = encode_file(src, tmp, size=size, checksum=checksum, stride=stride, progress=progress)
        except OSError as exc:  # a full local disk: upload as it is rather than not at all
            log.warning("%s: cannot write its compressed copy under %s (%s); uploading it uncompressed", src,
                        scratch, exc)
            got = None
        if got is None:
            return tier.put_file(src, key, size=size, checksum=checksum, progress=progress)
        stored, stored_ck = got
        return tier.put_file(tmp, key, size=stored, checksum=stored_ck,
                             progress=_in_raw_bytes(progress, size, stored) if progress else None)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def _in_raw_bytes(progress: Progress, raw: int, stored: int) -> Progress:
    """``progress`` told of the file's raw bytes while ``stored`` compressed bytes are sent: a drain's
    "done of total" (the step's raw bytes) then ends at its total, whichever way each file is stored."""
    sent = told = 0

    def scaled(n: int) -> None:
        nonlocal sent, told
        sent += n
        now = raw if sent >= stored else sent * raw // stored
        progress(now - told)
        told = now

    return scaled


def remove_stale_scratch(state_dir: str) -> None:
    """Remove every daemon's scratch directory in a root's ``state_dir`` (``encode-<pid>``: what a killed
    daemon left; called by the one daemon that drains the root, before it drains anything)."""
    try:
        names = os.listdir(state_dir)
    except OSError:
        return
    for name in names:
        if name.startswith(ENCODE_SCRATCH):
            remove_scratch(os.path.join(state_dir, name))


def _make_scratch(scratch: str) -> None:
    """Create ``scratch`` (a directory of this user's, not a link); OSError when something else is there."""
    os.makedirs(os.path.dirname(scratch), mode=0o700, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(scratch, 0o700)
    st = os.lstat(scratch)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise OSError(errno.EEXIST, "not a directory of this user's (a link or another file is there)", scratch)


def remove_scratch(scratch: str) -> None:
    """Remove a scratch directory of :func:`put_shard` (and what a killed daemon left in it). Never through a
    link: a link or file where the directory goes is left alone (with a warning), and only the directory's
    own entries are unlinked (a link inside it is removed, not followed)."""
    try:
        dfd = os.open(scratch, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    except OSError as exc:
        log.warning("%s: not removed: not a directory of rslurm's (%s); remove it yourself if it is not needed",
                    scratch, exc.strerror)
        return
    try:
        for e in os.scandir(dfd):
            with contextlib.suppress(OSError):
                if e.is_dir(follow_symlinks=False):
                    continue  # rslurm makes no directories in it
                os.unlink(e.name, dir_fd=dfd)
    finally:
        os.close(dfd)
    with contextlib.suppress(OSError):
        os.rmdir(scratch)
        fsync_dir(os.path.dirname(scratch))


# ------------------------------------------------------------------------------------------ the readers' side
def _stored(tier: StorageTier, key: str, size: int) -> tuple[ObjectInfo, Layout | None]:
    """The object at ``key`` and, when it is compressed, its layout. ObjectNotFoundError if absent;
    CorruptCheckpointError if it is neither the file (``size`` bytes) nor an encoding of it."""
    where = f"{tier.url}/{key}"
    info = tier.stat(key)
    if info is None:
        raise ObjectNotFoundError(f"{where}: does not exist")
    if info.size == size:
        return info, None
    with _open_stored(tier, key, info) as read:
        layout = read_layout(read, info.size, where, size)
    if layout is None:
        raise CorruptCheckpointError(f"{where}: durable object is {info.size} bytes, the manifest says {size}")
    return info, layout


def is_compressed(tier: StorageTier, key: str, size: int) -> bool:
    """Whether the object at ``key`` is stored compressed: it ends in this format's footer, sound or damaged
    (:func:`get_shard` then decodes it, or names the damage: a damaged footer is not a truncated file). False
    when it is absent, the file as it is, or neither kind, or cannot be read now: whoever reads it in place
    names that (its size check, or the read's error)."""
    try:
        return _stored(tier, key, size)[1] is not None
    except DamagedEncodingError:
        return True
    except ResilientSlurmError:
        return False


def get_shard(tier: StorageTier, key: str, dest: str, *, size: int, checksum: str,
              progress: Progress | None = None) -> TransferStats:
    """``get_file`` for a shard stored either way: ``dest`` holds the raw file, its size and xxh3 checked
    against the manifest's; ``stats.bytes`` counts the bytes read from the store."""
    info, layout = _stored(tier, key, size)
    if layout is None:
        return tier.get_file(key, dest, size=size, checksum=checksum, progress=progress)
    t0 = time.perf_counter()
    where = f"{tier.url}/{key}"
    stats = TransferStats(key=key, bytes=info.size - layout.offsets[-1])  # the index and footer read
    h = xxhash.xxh3_64()
    held = 0  # batches of the decode budget this call holds
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        n, batches, i = len(layout.modes), [], 0
        while i < n:  # runs of whole frames of at most READ_BATCH stored bytes (or one larger frame)
            j = i + 1
            while (j < n and layout.offsets[j + 1] - layout.offsets[i] <= READ_BATCH
                   and (j + 1 - i) * layout.frame_size <= READ_BATCH):  # and at most READ_BATCH decoded
                j += 1
            batches.append((i, j))
            i = j
        with _open_stored(tier, key, info) as read, \
                ThreadPoolExecutor(ENCODE_THREADS, thread_name_prefix="rslurm-decode") as pool:

            def fetch(i: int, j: int) -> tuple[int, list[bytes]]:
                lo = layout.offsets[i]
                chunk = read(lo, layout.offsets[j] - lo)
                return len(chunk), [_frame_of(chunk, lo, layout, where, f) for f in range(i, j)]

            # Batches are read and decoded up to ENCODE_THREADS at a time (ranged reads in parallel, as
            # get_file makes them) within the process's DECODE_BUDGET, and hashed and written in order here.
            # A decode waits for the budget only when it holds none of it, so decodes of several files
            # cannot wait for each other.
            pending: deque[Future[tuple[int, list[bytes]]]] = deque()
            nxt = 0

            def fill() -> None:
                nonlocal nxt, held
                while nxt < len(batches) and len(pending) < ENCODE_THREADS:
                    if not _DECODE_BUDGET.acquire(blocking=not pending):
                        return
                    held += 1
                    pending.append(pool.submit(fetch, *batches[nxt]))
                    nxt += 1

            fill()
            for i, _j in batches:
                got, raws = pending.popleft().result()
                _DECODE_BUDGET.release()
                held -= 1
                fill()
                stats.bytes += got
                if progress:
                    progress(got)
                for f, raw in enumerate(raws, start=i):
                    h.update(raw)
                    _write_all(fd, raw, f * layout.frame_size)
        if h.hexdigest() != checksum:
            raise CorruptCheckpointError(f"{where}: decoded bytes do not match the manifest's checksum; the durable "
                                         "object is corrupt")
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(dest)
        raise
    finally:
        for _ in range(held):
            _DECODE_BUDGET.release()
    os.close(fd)
    stats.seconds = time.perf_counter() - t0
    return stats


@contextlib.contextmanager
def _open_stored(tier: StorageTier, key: str, info: ObjectInfo) -> Iterator[ReadRange]:
    """``open_ranges`` of the object measured as ``info``; one replaced since then is named as such (the tier's
    own message would compare it with the stored size, not the manifest's)."""
    with contextlib.ExitStack() as stack:
        try:
            read = stack.enter_context(tier.open_ranges(key, info.size))
        except CorruptCheckpointError as exc:
            raise CorruptCheckpointError(f"{tier.url}/{key}: the object changed while it was read (it was "
                                         f"{info.size} bytes): {exc}") from exc
        yield read


def _frame_of(chunk: bytes, lo: int, layout: Layout, where: str, f: int) -> bytes:
    """Frame ``f`` decoded, from ``chunk``: the stored bytes that start at stored offset ``lo``."""
    return decode_frame(chunk[layout.offsets[f] - lo:layout.offsets[f + 1] - lo], layout.modes[f], layout.raw_len(f),
                        where)


@contextlib.contextmanager
def _decoded_reader(tier: StorageTier, key: str, info: ObjectInfo, layout: Layout) -> Iterator[ReadRange]:
    where = f"{tier.url}/{key}"
    with _open_stored(tier, key, info) as read:

        def read_raw(offset: int, n: int) -> bytes:
            if n <= 0:
                return b""
            first, last = offset // layout.frame_size, (offset + n - 1) // layout.frame_size
            lo = layout.offsets[first]
            chunk = read(lo, layout.offsets[last + 1] - lo)
            raw = b"".join(_frame_of(chunk, lo, layout, where, f) for f in range(first, last + 1))
            start = offset - first * layout.frame_size
            return raw[start:start + n]

        yield read_raw


def get_shard_ranges(tier: StorageTier, key: str, dest: str, *, size: int, spans: Sequence[Span],
                     progress: Progress | None = None) -> TransferStats:
    """``get_ranges`` for a shard stored either way (each item checked against its own xxh3)."""
    info, layout = _stored(tier, key, size)
    if layout is None:
        return tier.get_ranges(key, dest, size=size, spans=spans, progress=progress)
    lay = layout
    return tier.get_ranges(key, dest, size=size, spans=spans, progress=progress,
                           reader=lambda: _decoded_reader(tier, key, info, lay))


OpenReader = Callable[[], contextlib.AbstractContextManager[ReadRange]]

__all__ = ["COMPRESSIONS", "Layout", "choose_stride", "decode_frame", "encode_file", "encode_frame", "get_shard",
           "get_shard_ranges", "holds", "is_compressed", "put_shard", "read_layout", "remove_scratch"]
