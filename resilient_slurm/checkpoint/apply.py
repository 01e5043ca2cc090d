"""Apply: verified bytes of a step put into the live state; a large tensor's bytes read straight into it.

Who calls what: :class:`~.restore_round.StepReader` (restore_round.py) asks :func:`place_into` which read
items can be read straight into the live tensor they restore (in-place restore), reads those through a
:class:`Placing` sink (storage/fileio.py: :func:`~resilient_slurm.storage.fileio.read_through`) and the rest
into buffers, and returns a :class:`_Loaded`; the :class:`~.restore.Restorer` calls :meth:`_Loaded.apply`
only once every rank has verified everything it read. Nothing here reads files or talks to other ranks.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import io
import itertools
import logging
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType

from ..errors import IncompatibleCheckpointError
from ..storage.fileio import HostBuffer
from ..storage.fileio import merged_spans as _merged
from .planning import SafeLoadPlanner
from .staging import tensor_prefix

log = logging.getLogger(__name__)

PLACE_MIN_BYTES = 1 << 20  # smaller tensors are read with their neighbours into one buffer and copied
# Host-to-GPU copies of at least BOUNCE_MIN_BYTES go through two pinned buffers of BOUNCE_BYTES in turn (a
# host copy into one while the copy engine reads the other): from pageable memory the driver copied at
# about 5 GB/s on an H200 (0.2 s a GiB); page-locking whole read buffers costs more than it saves
# (restore_round.PIN_FOR_CUDA). The pinned buffers come from torch's caching host allocator.
BOUNCE_BYTES = 32 << 20
BOUNCE_MIN_BYTES = 1 << 20


def _on_cuda(obj: Any, depth: int = 0) -> bool:
    """Whether a (nested) load target holds a tensor on a CUDA device."""
    if isinstance(obj, torch.Tensor):
        return obj.device.type == "cuda"
    if depth > 32:
        return False
    if isinstance(obj, Mapping):
        return any(_on_cuda(v, depth + 1) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_on_cuda(v, depth + 1) for v in obj)
    return False


def memory_of(t: torch.Tensor) -> tuple[int, int]:
    """The host memory from a CPU tensor's first element to its last, as ``[start, end)`` addresses."""
    size = t.element_size()
    start = int(t.untyped_storage().data_ptr() + t.storage_offset() * size)
    if t.numel() == 0:
        return start, start
    return start, start + (sum(int(n - 1) * int(st) for n, st in zip(t.shape, t.stride())) + 1) * size


def live_tensors(state: Mapping[str, Any]) -> dict[int, torch.Tensor]:
    """Storage address -> the program's own tensor that owns it, for the tensors a restore may write in place:
    the parameters and buffers of each module, the state of each optimizer, the tensors at the top of the
    state (a DTensor's local tensor, under the DTensor). Everything else a load target holds (a plain value's
    tensors, what a custom object's ``state_dict()`` returns) may be a copy made for the restore: read into
    a buffer instead, so that what a failed step wrote in place is always memory the program keeps."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - a torch without DTensor
        DTensor = ()  # type: ignore[assignment,misc]  # noqa: N806
    out: dict[int, torch.Tensor] = {}

    def add(t: Any) -> None:
        local = t.to_local() if isinstance(t, DTensor) else t
        if type(local) in (torch.Tensor, torch.nn.Parameter) and local.device.type == "cpu":
            with contextlib.suppress(RuntimeError):  # no storage of its own
                out.setdefault(int(local.untyped_storage().data_ptr()), t)

    for v in state.values():
        if isinstance(v, torch.nn.Module):
            for t in itertools.chain(v.parameters(), v.buffers()):
                add(t)
        elif isinstance(v, torch.optim.Optimizer):
            for st in v.state.values():
                for t in st.values() if isinstance(st, Mapping) else ():
                    if isinstance(t, torch.Tensor):
                        add(t)
        elif isinstance(v, torch.Tensor):
            add(v)
    return out


def shared_mappings() -> list[tuple[int, int]] | None:
    """The address ranges ``[start, end)``, sorted, of this process's shared mappings (``/proc/self/maps``: a
    file mapped MAP_SHARED, as by ``numpy.memmap`` or ``torch.from_file(shared=True)``, shared anonymous
    memory, System V segments): what is written there reaches a file or another process. ``Tensor.is_shared``
    knows only torch's own shared memory. None where ``/proc`` cannot be read: then no memory is known to be
    private, and nothing is read in place (:func:`place_into`)."""
    out = []
    try:
        with open("/proc/self/maps", "rb") as f:
            for line in f:
                span, perms = line.split(b" ", 2)[:2]
                if perms[3:4] == b"s":
                    lo, hi = span.split(b"-")
                    out.append((int(lo, 16), int(hi, 16)))
    except (OSError, ValueError) as exc:
        log.warning("cannot read /proc/self/maps (%s): the restore reads every tensor into a buffer and copies it "
                    "(no in-place reads), since it cannot tell which memory another process or a file shares", exc)
        return None
    return out


def _overlaps(spans: list[tuple[int, int]], lo: int, hi: int) -> bool:
    """Whether ``[lo, hi)`` overlaps one of ``spans`` (sorted, not overlapping)."""
    k = bisect.bisect_right(spans, (lo, 1 << 64)) - 1  # the last span that starts at or before lo
    return (k >= 0 and spans[k][1] > lo) or (k + 1 < len(spans) and spans[k + 1][0] < hi)


@dataclass
class Placement:
    """A read item whose tensor bytes go straight into the live tensor they restore."""

    fqn: str
    owner: torch.Tensor  # the program's tensor whose memory ``dest`` is (live_tensors)
    dest: torch.Tensor  # the live tensor (or the alias its owner's load_state_dict reads)
    address: int  # of ``dest``'s first byte (contiguous: its bytes follow)
    nbytes: int
    length: int  # the item's bytes in the file: prefix, tensor bytes, suffix
    # The item's framing before the tensor bytes (torch.save's), checked as it arrives: made by the sink when
    # the item's first bytes arrive (staging.tensor_prefix: 25 us a shape, no torch.save), not before the read.
    prefix: bytes | None = None
    foreign: torch.Tensor | None = None  # the item's bytes, when they were not in our framing after all


def place_into(planner: SafeLoadPlanner, md: Metadata, ri: Any, length: int,
               live: Mapping[int, torch.Tensor], shared: list[tuple[int, int]] | None) -> Placement | None:
    """How read item ``ri`` (``length`` bytes in the file) can be read straight into the tensor it restores,
    or None (it is read into a buffer and copied at apply): a stored chunk that is the whole destination, a
    contiguous CPU tensor of the same dtype and shape, of at least PLACE_MIN_BYTES, stored in our framing,
    in memory the program keeps (``live``: :func:`live_tensors`) and no other process or file sees (not
    shared memory, nor a range of ``shared``, :func:`shared_mappings`: bytes not yet verified on every rank
    must not reach another process, nor a file the program mapped)."""
    if length <= PLACE_MIN_BYTES:  # (its tensor bytes are fewer still): most items, decided before any look-up
        return None
    if shared is None:
        return None  # which memory is shared cannot be told
    dest = as_stored(md, ri, planner)
    if dest is None:
        return None
    nbytes = dest.numel() * dest.element_size()
    if nbytes < PLACE_MIN_BYTES or length <= nbytes:
        return None
    try:
        owner = live.get(int(dest.untyped_storage().data_ptr()))
        if owner is None or dest.is_shared() or _overlaps(shared, *memory_of(dest)):
            return None
    except RuntimeError:  # no storage of its own
        return None
    # Its address, not a flat byte view of it: the sink copies with memmove (a view costs two torch ops an item).
    return Placement(ri.dest_index.fqn, owner, dest, int(dest.data_ptr()), nbytes, length)


def as_stored(md: Metadata, ri: Any, planner: SafeLoadPlanner) -> torch.Tensor | None:
    """The tensor read item ``ri`` restores when the item's bytes can be copied into it as they are stored: a
    stored chunk that is the whole destination, a dense, contiguous CPU tensor (not a subclass) of the chunk's
    dtype and shape. None for any other item (torch copies it: a part, another dtype, a GPU tensor)."""
    if ri.type != LoadItemType.TENSOR or any(ri.storage_offsets) or any(ri.dest_offsets):
        return None
    tmd = md.state_dict_metadata.get(ri.storage_index.fqn)
    if not isinstance(tmd, TensorStorageMetadata):
        return None
    sizes = next((tuple(c.sizes) for c in tmd.chunks if tuple(c.offsets) == tuple(ri.storage_index.offset)), None)
    if sizes is None or tuple(ri.lengths) != sizes:
        return None
    dest = planner.resolve_tensor(ri)
    if (type(dest) not in (torch.Tensor, torch.nn.Parameter) or dest.device.type != "cpu"
            or dest.layout != torch.strided or dest.is_quantized or not dest.is_contiguous()
            or dest.is_conj() or dest.is_neg() or tuple(dest.shape) != sizes or dest.dtype != tmd.properties.dtype):
        return None
    return dest


Touched = dict[tuple[int, int], tuple[str, "weakref.ref[torch.Tensor]"]]
"""Live tensors written in place: memory range -> (key, the program's tensor owning it, weakly: a tensor the
program dropped since holds nothing of its state)."""


class Placing:
    """The sink of :func:`~resilient_slurm.storage.fileio.read_through` for a file's placed items: checks each
    item's framing as it arrives and copies its tensor bytes into the live tensor. ``touched`` records every
    live tensor a byte was written into, before the write, so a round that fails afterwards still names it;
    each tensor's autograd version is bumped, as an in-place copy would. An item whose framing is not ours
    (a step written by plain DCP) is collected into a buffer of its own instead (:attr:`Placement.foreign`)
    and decoded at apply."""

    def __init__(self, items: list[Placement], touched: Touched) -> None:
        self.items = items
        self.touched = touched

    def __call__(self, k: int, at: int, view: memoryview) -> None:
        p = self.items[k]
        if p.prefix is None:  # its first bytes: is it in our framing at all
            p.prefix = tensor_prefix(p.dest.dtype, tuple(p.dest.shape))
            # The zip's trailer after the tensor bytes is verified by the item's checksum like every byte, and
            # never read here: only the framing before the tensor bytes says where they are.
            if p.length < len(p.prefix) + p.nbytes:
                p.foreign = torch.empty(p.length, dtype=torch.uint8)
        n, end = len(p.prefix), at + len(view)
        if p.foreign is not None:
            p.foreign[at:end].copy_(torch.frombuffer(view, dtype=torch.uint8))
            return
        if at < n and bytes(view[: min(n, end) - at]) != p.prefix[at : min(n, end)]:
            p.foreign = torch.empty(p.length, dtype=torch.uint8)
            if at:  # what arrived before matched the framing
                p.foreign[:at].copy_(torch.frombuffer(bytearray(p.prefix[:at]), dtype=torch.uint8))
            p.foreign[at:end].copy_(torch.frombuffer(view, dtype=torch.uint8))
            return
        a, b = max(at, n), min(end, n + p.nbytes)
        if b > a:
            if a == n:  # its first tensor byte
                r = memory_of(p.dest)
                if (cur := self.touched.get(r)) is None or cur[1]() is None:
                    # A dead entry (its tensor gone, the memory given to a new one) must not hide this write.
                    self.touched[r] = (p.fqn, weakref.ref(p.owner))
                torch.autograd.graph.increment_version(p.dest)
            # One thread's memcpy with the GIL released: torch's copy_ spreads it over the intra-op threads,
            # which then spin against the reads in flight (5 to 10 times slower on a busy node, measured).
            src = ctypes.addressof(ctypes.c_char.from_buffer(view, a - at))
            ctypes.memmove(p.address + (a - n), src, b - a)


@dataclass
class _Loaded:
    """Verified bytes of one step, ready to go into the live state."""

    planner: SafeLoadPlanner
    target: dict[str, Any]
    md: Metadata
    needed: dict[str, list[Any]]
    where: dict[tuple[str, int], tuple[torch.Tensor | HostBuffer, int]]  # item -> (buffer, its bytes' offset)
    placed: dict[tuple[str, int], Placement]  # item -> the live tensor its bytes were read into
    decoded: dict[tuple[str, int], Any] = field(default_factory=dict)
    bytes_read: int = 0
    placed_bytes: int = 0  # bytes read straight into the live tensors (no buffer, no copy)
    cuda: bool = False  # some of the state is on a GPU: copies go on a side stream

    def covers(self) -> list[tuple[int, int]]:
        """The host memory of the CPU tensors this step writes (read in place, or copied at apply): the
        Restorer checks, before applying, that it covers every tensor an earlier, failed round wrote into."""
        out = []
        for rel, reqs in self.needed.items():
            for ri, info in reqs:
                if ri.type == LoadItemType.BYTE_IO:
                    continue
                p = self.placed.get((rel, info.offset))
                dest = p.dest if p is not None else self.planner.resolve_tensor(ri)
                if isinstance(dest, torch.Tensor) and dest.device.type == "cpu" and type(dest) in (
                        torch.Tensor, torch.nn.Parameter):
                    out.append(memory_of(dest))
        return out

    def apply(self) -> None:
        """Put every verified item into the live state: the bytes read in place are there already; the rest
        is copied in place. Called only after every rank verified everything it read."""
        stream = torch.cuda.Stream() if self.cuda else None
        if stream is not None:
            # The side stream writes tensors the program's stream may still be using: it waits for that
            # stream first; at the end the host waits for the side stream, so the buffers outlive the copies.
            stream.wait_stream(torch.cuda.current_stream())
        bounce = _Bounce(stream) if stream is not None else None
        try:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                self._apply(bounce)
        finally:  # also when an item fails: no copy still writes the program's tensors after we return
            if stream is not None:
                stream.synchronize()

    def _apply(self, bounce: _Bounce | None = None) -> None:
        for rel, reqs in self.needed.items():
            for ri, info in reqs:
                key = (rel, info.offset)
                if ri.type == LoadItemType.BYTE_IO:
                    self.planner.set_value(ri, self.decoded[key])
                    continue
                p = self.placed.get(key)
                # A small tensor of the saved dtype and shape: its bytes copied as they are.
                copied = self._copied(ri, *self.where[key], info.length) if p is None else None
                if p is not None and p.foreign is None:
                    dest = p.dest  # its bytes are there
                elif copied is not None:
                    dest = copied
                else:
                    buf, at = (p.foreign, 0) if p is not None and p.foreign is not None else self.where[key]
                    whole = buf.tensor() if isinstance(buf, HostBuffer) else buf
                    stored = self._stored_tensor(ri, whole[at : at + info.length])
                    part = narrow_tensor_by_index(stored, ri.storage_offsets, ri.lengths)
                    dest = self.planner.resolve_tensor(ri)
                    if dest.size() != part.size():
                        raise IncompatibleCheckpointError(
                            f"{ri.dest_index.fqn}: checkpoint has size {tuple(part.size())}, state has "
                            f"{tuple(dest.size())}")
                    with torch.no_grad():
                        if bounce is None or not bounce.copy(dest, part):
                            dest.detach().copy_(part, non_blocking=dest.device.type == "cuda")
                self.planner.commit_tensor(ri, dest)

    def _copied(self, ri: Any, buf: torch.Tensor | HostBuffer, at: int, length: int) -> torch.Tensor | None:
        """Copy read item ``ri`` (``length`` bytes at ``at`` in host buffer ``buf``) into the tensor it restores
        with one memmove, as :class:`Placing` does, and return that tensor, when its bytes can be copied as they
        are stored (:func:`as_stored`) and are in our framing. None, with nothing written, for any other item
        (:meth:`_apply` copies it with torch). Most items of a state are small tensors (biases, norms, an
        optimizer's steps): this spares each the views and the copy dispatch."""
        host = isinstance(buf, HostBuffer) or buf.device.type == "cpu"
        dest = as_stored(self.md, ri, self.planner) if host else None
        if dest is None:
            return None
        nbytes = dest.numel() * dest.element_size()
        if nbytes == 0:
            return None  # nothing to copy (and no prefix to make: an empty tensor's is torch.save's)
        prefix = tensor_prefix(dest.dtype, tuple(dest.shape))
        n = len(prefix)
        if length < n + nbytes:
            return None
        base = (buf.address if isinstance(buf, HostBuffer) else buf.data_ptr()) + at
        if ctypes.string_at(base, n) != prefix:
            return None  # not our framing (a step written by plain DCP): torch parses it
        torch.autograd.graph.increment_version(dest)  # as an in-place copy would
        ctypes.memmove(dest.data_ptr(), base + n, nbytes)
        return dest

    def _stored_tensor(self, ri: Any, blob: torch.Tensor) -> torch.Tensor:
        tmd = self.md.state_dict_metadata[ri.storage_index.fqn]
        assert isinstance(tmd, TensorStorageMetadata)
        chunk = next(c for c in tmd.chunks if tuple(c.offsets) == tuple(ri.storage_index.offset))
        dtype = tmd.properties.dtype
        nbytes = torch.Size(chunk.sizes).numel() * dtype.itemsize
        if nbytes == 0:  # no bytes to take: the tensor is its dtype and shape (the item's bytes were verified)
            return torch.empty(tuple(chunk.sizes), dtype=dtype)
        prefix = tensor_prefix(dtype, tuple(chunk.sizes))
        n = len(prefix)
        if blob.numel() >= n + nbytes and bytes(blob[:n].numpy()) == prefix:
            return blob[n : n + nbytes].view(dtype).view(tuple(chunk.sizes))
        # Not our framing (e.g. written by plain DCP): let torch parse it, safely.
        return torch.load(io.BytesIO(blob.numpy().tobytes()), map_location="cpu", weights_only=True)


class _Bounce:
    """Host-to-GPU copies on ``stream`` (the restore's side stream, current while they are queued) through two
    pinned buffers used in turn: the host copies a chunk into one while the copy engine reads the other,
    and a buffer is refilled only once the copy that read it is done."""

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self.stream = stream
        self.bufs: list[torch.Tensor] = []
        self.done: list[torch.cuda.Event | None] = [None, None]
        self.turn = 0
        self.unpinned = False
        self.chunks = 0  # chunks copied (tests/test_cuda.py)

    def copy(self, dest: torch.Tensor, src: torch.Tensor) -> bool:
        """Copy host tensor ``src`` into GPU tensor ``dest`` (plain tensors of the same dtype and shape, both
        dense and contiguous, ``src`` pageable, ``dest`` on the stream's device, at least BOUNCE_MIN_BYTES);
        False, with nothing copied, for any other pair (a tensor subclass keeps its own ``copy_``)."""
        if (self.unpinned or type(dest) not in (torch.Tensor, torch.nn.Parameter) or type(src) is not torch.Tensor
                or src.device.type != "cpu" or src.is_pinned() or dest.device != self.stream.device
                or dest.dtype != src.dtype
                or dest.shape != src.shape or not dest.is_contiguous() or not src.is_contiguous()
                or dest.layout != torch.strided or src.layout != torch.strided or dest.is_quantized
                or dest.is_conj() or src.is_conj() or dest.is_neg() or src.is_neg()):
            return False
        n = dest.numel() * dest.element_size()
        if n < BOUNCE_MIN_BYTES:
            return False
        if not self.bufs:
            try:
                self.bufs = [torch.empty(BOUNCE_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
            except RuntimeError:  # no page-locked memory to be had: copy directly
                self.unpinned = True
                return False
        d = dest.detach().reshape(-1).view(torch.uint8)
        h = src.detach().reshape(-1).view(torch.uint8)
        for a in range(0, n, BOUNCE_BYTES):
            b = min(n, a + BOUNCE_BYTES)
            k, self.turn = self.turn, self.turn ^ 1
            done = self.done[k]
            if done is not None:
                done.synchronize()  # the copy engine has read this buffer's last chunk
            buf = self.bufs[k][: b - a]
            buf.copy_(h[a:b])
            d[a:b].copy_(buf, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
            self.done[k] = event
            self.chunks += 1
        return True


def held(touched: Touched, state: Mapping[str, Any]) -> dict[tuple[int, int], str]:
    """The entries of ``touched`` (memory range -> key) whose tensor is one of ``state``'s own
    (:func:`live_tensors`); those whose tensor is gone are dropped from ``touched``."""
    for r in [r for r, (_, ref) in touched.items() if ref() is None]:
        del touched[r]
    mine = {id(t) for t in live_tensors(state).values()} if touched else set()
    return {r: key for r, (key, ref) in touched.items() if id(ref()) in mine}


def uncovered(touched: Mapping[tuple[int, int], str], written: list[tuple[int, int]]) -> list[str]:
    """The keys of tensors a failed round wrote into (``touched``: memory range -> key, :func:`held`) that the
    ranges a step writes (``written``) do not cover whole."""
    cover = _merged(written)
    out = []
    for (a, b), key in touched.items():
        i = next((i for i, (x, y) in enumerate(cover) if x <= a < y), None)
        if i is None or cover[i][1] < b:
            out.append(key)
    return sorted(out)


__all__ = ["PLACE_MIN_BYTES", "Placement", "Placing", "Touched", "held", "live_tensors", "memory_of",
           "place_into", "uncovered"]
