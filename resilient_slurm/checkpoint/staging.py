"""Staging buffers that are the shard file's image: the training stall is one copy per tensor.

A rank's shard file is a sequence of DCP items. Each tensor item is stored as a ``torch.save`` blob
(what DCP's ``FileSystemReader`` expects), whose framing (zip headers, pickle) depends only on dtype and
shape. :class:`ShardLayout` computes that framing once with ``torch.serialization.skip_data`` and fixes
every item's offset. :class:`StagingBuffer` holds one page-aligned buffer laid out exactly like the
file: staging copies each tensor into its data slot, and the background writer sends the buffer to disk
with O_DIRECT, no further copy. Plain values (BYTE_IO items) vary in size per save and are appended
after the tensor region.

Call order (all on the training thread except ``write``): ``ShardLayout.build`` (when the plan
changes) -> ``StagingBuffer.for_layout`` (allocates once, reused while the layout is unchanged) ->
``stage`` (the stall) -> background ``write``.

Under a host-memory budget (``staging_memory_limit``) smaller than the tensor region, :class:`WaveWriter`
takes the buffer's place: one window of the budget's size, through which the region is staged and
written to the shard file in waves while training waits (the stall grows, the memory does not).
"""

from __future__ import annotations

import collections
import io
import math
import pickle
import struct
import sys
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import IO, cast

import torch
import torch.serialization
import torch.utils.serialization  # noqa: F401  # what skip_data reads; imported here, not on a restore's path
import xxhash
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from .. import failpoints
from ..storage.fileio import BLOCK, ShardFile, aligned_buffer, as_memoryview, round_up

_PIECE = 16 << 20  # bytes per pwrite of a wave: as write_file's, large enough for NVMe, small enough to spread
_ALIGN = 64  # blob start alignment: keeps each data region 64-byte aligned in memory and on disk


class _FramingSink(io.RawIOBase):
    """A seekable sink that records what torch.save writes around the (skipped) storage bytes."""

    def __init__(self) -> None:
        self.parts: list[tuple[int, bytes]] = []
        self.pos = 0
        self.end = 0

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, b: bytes | bytearray | memoryview) -> int:  # type: ignore[override]
        data = bytes(b)
        self.parts.append((self.pos, data))
        self.pos += len(data)
        self.end = max(self.end, self.pos)
        return len(data)

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: self.end}[whence]
        self.pos = base + offset
        return self.pos

    def tell(self) -> int:
        return self.pos


@dataclass(frozen=True)
class Framing:
    """torch.save bytes around a tensor's raw data: ``prefix + data + suffix`` is a valid blob."""

    prefix: bytes
    suffix: bytes


_FRAMING_CACHE: dict[tuple[torch.dtype, tuple[int, ...]], Framing] = {}


def framing_for(dtype: torch.dtype, shape: Sequence[int]) -> Framing:
    """Framing of ``torch.save`` for a contiguous CPU tensor of ``dtype`` and ``shape`` (cached)."""
    key = (dtype, tuple(shape))
    fr = _FRAMING_CACHE.get(key)
    if fr is None:
        sink = _FramingSink()
        with torch.serialization.skip_data():
            torch.save(torch.empty(shape, dtype=dtype), cast(IO[bytes], sink))  # untouched pages: no cost
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        # Find the data hole: the gap skipped by seek between two writes.
        covered = sorted((p, p + len(d)) for p, d in sink.parts)
        hole = next(
            (a_end for (_, a_end), (b_start, _) in zip(covered, covered[1:]) if b_start - a_end == nbytes),
            None,
        )
        if hole is None:
            if nbytes != 0:
                raise RuntimeError(f"cannot locate tensor data in torch.save framing for {dtype}{list(shape)}")
            # Empty tensor: no hole; any split works since there is no data.
            hole = sink.end
        # The bytes before and after the hole, never the hole itself: an image of the whole blob would touch
        # as much memory as the tensor (a staging budget is set for tensors larger than the node can copy).
        prefix, suffix, after = bytearray(hole), bytearray(max(0, sink.end - hole - nbytes)), hole + nbytes
        for pos, data in sink.parts:  # in write order: a later write (a patched header) wins
            if pos < hole:
                prefix[pos : pos + len(data)] = data[: hole - pos]
            elif pos >= after:
                suffix[pos - after : pos - after + len(data)] = data
        fr = Framing(prefix=bytes(prefix), suffix=bytes(suffix))
        _FRAMING_CACHE[key] = fr
    return fr


_PREFIX_CACHE: dict[tuple[torch.dtype, tuple[int, ...]], bytes] = {}
_ZIP64_LIMIT = 0xFFFFFFFF  # a record this large gets zip64 fields in its header: left to torch.save


class _Storage:
    """Stands for a tensor's storage in :func:`tensor_prefix`'s pickle: written as torch.save's persistent id."""


class _Tensor:
    """Pickles as torch.save pickles a plain, contiguous CPU tensor without Python state."""

    def __init__(self, args: tuple[object, ...]) -> None:
        self.args = args

    def __reduce_ex__(self, protocol: object) -> tuple[object, tuple[object, ...]]:
        return torch._utils._rebuild_tensor_v2, self.args


class _Pickler(pickle.Pickler):
    def __init__(self, buf: io.BytesIO, storage: _Storage, pid: tuple[object, ...]) -> None:
        super().__init__(buf, protocol=2)  # torch.save's default protocol
        self.storage, self.pid = storage, pid

    def persistent_id(self, obj: object) -> tuple[object, ...] | None:
        return self.pid if obj is self.storage else None


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= max(n, 1)  # as torch strides a dimension of size 0 or 1
    return tuple(reversed(out))


def tensor_prefix(dtype: torch.dtype, shape: Sequence[int]) -> bytes:
    """The bytes :func:`framing_for` puts before the data of a contiguous CPU tensor (``framing_for(dtype,
    shape).prefix``), made with Python's pickle, struct and zlib instead of a ``torch.save``: the zip records
    ``data.pkl``, ``.format_version``, ``.storage_alignment`` and ``byteorder``, then the local header of
    ``data/0``, each padded so that what follows starts on the storage alignment. Cached per dtype and shape.

    Why: a restore checks each large item's framing as its first bytes arrive. A process's first
    ``torch.save`` runs code for the first time (its zip writer and pickler), which a cold node reads from
    disk while the restore's reads keep it busy: 12-23 ms of the calling thread on a 1 GiB restore here,
    beyond what the read ring holds (docs/benchmarks.md). Falls back to :func:`framing_for` for what this does
    not cover (a dtype without a storage type such as float8 or uint16, an empty tensor, a record of 4 GiB or more,
    a storage alignment whose padding does not fit the zip field, CRCs turned off in torch's save
    config, a big-endian host); tests/test_framing.py holds it to ``framing_for`` byte for byte."""
    key = (dtype, tuple(shape))
    got = _PREFIX_CACHE.get(key)
    if got is None:
        got = _made_prefix(dtype, key[1])
        if got is None:
            got = framing_for(dtype, shape).prefix
        _PREFIX_CACHE[key] = got
    return got


def _made_prefix(dtype: torch.dtype, shape: tuple[int, ...]) -> bytes | None:
    config = torch.utils.serialization.config
    name = torch.storage._dtype_to_storage_type_map().get(dtype)
    storage_type = getattr(torch, name, None) if name else None
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    align = torch.serialization._get_storage_alignment()
    if storage_type is None or not nbytes or nbytes >= _ZIP64_LIMIT or not config.save.compute_crc32 or sys.byteorder != "little":
        return None
    storage = _Storage()
    buf = io.BytesIO()
    args: tuple[object, ...] = (storage, 0, shape, _contiguous_strides(shape), False, collections.OrderedDict())
    _Pickler(buf, storage, ("storage", storage_type, "0", "cpu", numel)).dump(_Tensor(args))
    out = bytearray()

    def header(name: str) -> bool:
        """The local header of record ``name``, padded to the alignment; False where the padding cannot be
        said (torch.save's own 16-bit padding field cannot say it either)."""
        raw = f"archive/{name}".encode()
        start = len(out) + 30 + len(raw) + 4  # the local header, the name, the padding field's own 4 bytes
        pad = -start % align
        if pad > 0xFFFF:
            return False
        extra = b"FB" + struct.pack("<H", pad) + b"Z" * pad
        out.extend(b"PK\x03\x04" + struct.pack("<HHHHHIIIHH", 0, 0x0808, 0, 0, 0, 0, 0, 0, len(raw), len(extra)))
        out.extend(raw + extra)
        return True

    for name, data in (("data.pkl", buf.getvalue()), (".format_version", b"1"),
                       (".storage_alignment", str(align).encode()), ("byteorder", b"little")):
        if not header(name):
            return None
        out.extend(data + b"PK\x07\x08" + struct.pack("<III", zlib.crc32(data), len(data), len(data)))
    return bytes(out) if header("data/0") else None


@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor item lives in the shard file."""

    item: WriteItem
    offset: int  # blob start
    length: int  # blob length (framing + data)
    data_offset: int  # absolute offset of the raw data
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ShardLayout:
    """Fixed placement of a rank's tensor items in its shard file."""

    slots: tuple[TensorSlot, ...]
    tensor_region: int  # bytes used by the tensor blobs; byte items start at round_up(tensor_region)
    key: tuple[object, ...]

    @classmethod
    def build(cls, items: Sequence[WriteItem]) -> ShardLayout:
        """Place tensor items (largest first, so big copies start early) at 64-byte aligned offsets."""
        tensors = [it for it in items if it.type != WriteItemType.BYTE_IO]
        tensors.sort(key=lambda it: (-(it.tensor_storage_size() or 0), it.index.fqn))
        slots = []
        off = 0
        for it in tensors:
            td = it.tensor_data
            assert td is not None
            shape = tuple(td.chunk.sizes)
            dtype = td.properties.dtype
            fr = framing_for(dtype, shape)
            nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            off = round_up(off, _ALIGN)
            slots.append(
                TensorSlot(
                    item=it,
                    offset=off,
                    length=len(fr.prefix) + nbytes + len(fr.suffix),
                    data_offset=off + len(fr.prefix),
                    nbytes=nbytes,
                    dtype=dtype,
                    shape=shape,
                )
            )
            off += slots[-1].length
        key = tuple((s.item.index.fqn, s.item.index.offset, s.dtype, s.shape) for s in slots)
        return cls(slots=tuple(slots), tensor_region=off, key=key)


class StagingBuffer:
    """A reusable page-aligned image of a shard file's tensor region (pinned when CUDA is in use)."""

    def __init__(self, layout: ShardLayout, *, pin: bool) -> None:
        self.layout = layout
        self.buf = aligned_buffer(round_up(layout.tensor_region, BLOCK), pin=pin)
        for s in layout.slots:  # framing never changes for a layout: write it once
            fr = framing_for(s.dtype, s.shape)
            self.buf[s.offset : s.data_offset].copy_(torch.frombuffer(bytearray(fr.prefix), dtype=torch.uint8))
            if fr.suffix:
                end = s.data_offset + s.nbytes
                self.buf[end : end + len(fr.suffix)].copy_(
                    torch.frombuffer(bytearray(fr.suffix), dtype=torch.uint8)
                )
        self._views = [self._view(s) for s in layout.slots]

    def _view(self, s: TensorSlot) -> torch.Tensor:
        raw = self.buf[s.data_offset : s.data_offset + s.nbytes]
        if s.nbytes == 0:
            return torch.empty(s.shape, dtype=s.dtype)
        return raw.view(s.dtype).view(s.shape)

    @property
    def nbytes(self) -> int:
        """Size of the tensor region."""
        return self.layout.tensor_region

    def stage(self, resolve: Callable[[WriteItem], torch.Tensor]) -> None:
        """Copy every tensor item into its slot: the only work done while training waits.

        CUDA tensors are copied device-to-host on a side stream that first waits for the current
        stream (so kernels still writing parameters finish first); we synchronize that stream once at
        the end rather than per tensor.
        """
        side: torch.cuda.Stream | None = None
        for s, view in zip(self.layout.slots, self._views):
            src = resolve(s.item)
            if src.is_cuda:
                if side is None:
                    side = torch.cuda.Stream(device=src.device)
                    side.wait_stream(torch.cuda.current_stream(src.device))
                with torch.cuda.stream(side):
                    view.copy_(src.detach(), non_blocking=True)
            else:
                view.copy_(src.detach())
        if side is not None:
            side.synchronize()

    def memoryview(self) -> memoryview:
        """The buffer as a writable memoryview (for pwrite)."""
        return as_memoryview(self.buf)


class WaveWriter:
    """The tensor region of a shard file staged and written through one window of ``window`` bytes, for a
    state larger than the staging memory budget. :meth:`write` copies each window's part of the file image
    (framing, tensor bytes, zero padding) from the tensors, checksums it and writes it, window after window,
    before it returns: training waits for the whole region's write, and memory stays one window (plus a
    contiguous copy of a non-contiguous tensor while it is copied)."""

    def __init__(self, layout: ShardLayout, window: int, *, pin: bool) -> None:
        self.layout = layout
        self.window = max(BLOCK, window - window % BLOCK)
        self.buf = aligned_buffer(self.window, pin=pin)
        self._framing = [(torch.frombuffer(bytearray(fr.prefix), dtype=torch.uint8) if fr.prefix else None,
                          torch.frombuffer(bytearray(fr.suffix), dtype=torch.uint8) if fr.suffix else None)
                         for fr in (framing_for(s.dtype, s.shape) for s in layout.slots)]

    @property
    def nbytes(self) -> int:
        """The memory it holds: one window."""
        return self.window

    def write(self, resolve: Callable[[WriteItem], torch.Tensor], out: ShardFile, total: int, *,
              threads: int = 4) -> tuple[str, ...]:
        """Write bytes ``[0, total)`` of the file image (``total``: the tensor region, padded to a block when
        plain values follow) to ``out``; return each slot's checksum, in slot order. The window's two halves
        take turns: while one is checksummed (the file's and its items', a thread each, in file order) and
        written (``threads`` parallel pwrites of at most 16 MiB; all release the GIL), the next part is copied
        into the other."""
        slots = self.layout.slots
        hashes = [xxhash.xxh3_64() for _ in slots]
        flat: dict[int, torch.Tensor] = {}  # slot -> its tensor's bytes, while the slot spans parts
        half = self.window // 2 - (self.window // 2) % BLOCK
        size = half if half >= BLOCK else self.window
        halves = [self.buf[i * size:(i + 1) * size] for i in range(self.window // size)][:2]
        pending: list[list[Future[None]]] = [[] for _ in halves]  # each half's checksum and writes in flight

        def checksum(mv: memoryview, ranges: list[tuple[int, int, int]]) -> None:
            for i, a, b in ranges:
                hashes[i].update(mv[a:b])

        first = 0  # slots before it are written
        with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="rslurm-waves") as pool, \
                ThreadPoolExecutor(max_workers=1, thread_name_prefix="rslurm-waves-file-sum") as file_sum, \
                ThreadPoolExecutor(max_workers=1, thread_name_prefix="rslurm-waves-item-sum") as item_sum:
            try:
                for k, w in enumerate(range(0, total, size)):
                    n = min(size, total - w)
                    h = k % len(halves)
                    for f in pending[h]:  # this half's last part: checksummed and written
                        f.result()
                    if pending[h]:
                        failpoints.hit("during_waves", out.path)
                    buf, mv = halves[h], as_memoryview(halves[h])
                    ranges: list[tuple[int, int, int]] = []
                    cursor = w  # bytes before it are in the buffer
                    for i in range(first, len(slots)):
                        s = slots[i]
                        if s.offset >= w + n:
                            break
                        a, b = max(s.offset, w), min(s.offset + s.length, w + n)
                        if a < b:
                            if a > cursor:
                                buf[cursor - w:a - w].zero_()  # an alignment gap
                            self._copy(i, s, a - s.offset, b - s.offset, buf[a - w:b - w], resolve, flat)
                            ranges.append((i, a - w, b - w))
                            cursor = b
                        if s.offset + s.length <= w + n:
                            flat.pop(i, None)
                            first = i + 1
                    if cursor < w + n:
                        buf[cursor - w:n].zero_()  # the padding after the last slot
                    pending[h] = [file_sum.submit(out.hash, mv[:n]), item_sum.submit(checksum, mv, ranges),
                                  *(pool.submit(out.write_at, mv[o:], min(_PIECE, n - o), w + o)
                                    for o in range(0, n, _PIECE))]
            finally:
                for fs in pending:
                    for f in fs:
                        f.exception()  # wait: the buffers are in use until then
            for fs in pending:
                for f in fs:
                    f.result()
        return tuple(h.hexdigest() for h in hashes)

    def _copy(self, i: int, s: TensorSlot, a: int, b: int, dst: torch.Tensor,
              resolve: Callable[[WriteItem], torch.Tensor], flat: dict[int, torch.Tensor]) -> None:
        """Bytes ``[a, b)`` of slot ``s``'s blob (prefix, tensor bytes, suffix) into ``dst``."""
        prefix, suffix = self._framing[i]
        p = 0 if prefix is None else prefix.numel()
        parts = ((0, p, prefix), (p, p + s.nbytes, None), (p + s.nbytes, s.length, suffix))
        for lo, hi, src in parts:
            x, y = max(a, lo), min(b, hi)
            if x >= y:
                continue
            if src is None:  # the tensor's own bytes
                if i not in flat:  # a conjugate or negative view's bit is resolved, as copy_() resolves it
                    t = resolve(s.item).detach().resolve_conj().resolve_neg()
                    flat[i] = t.contiguous().reshape(-1).view(torch.uint8)
                src = flat[i]
            dst[x - a:y - a].copy_(src[x - lo:y - lo])
