"""Apply: verified bytes of a step put into the live state, a large tensor's by taking its buffer over.

Who calls what: :class:`~.restore_round.StepReader` (restore_round.py) asks :class:`_Owners` which live
tensor each read item may become (zero-copy restore), reads into the buffers it picks and returns a
:class:`_Loaded`; the :class:`~.restore.Restorer` calls :meth:`_Loaded.apply` only once every rank has
verified everything it read. Nothing here reads files or talks to other ranks.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType

from ..errors import IncompatibleCheckpointError
from .planning import SafeLoadPlanner
from .staging import framing_for

ADOPT_MIN_BYTES = 1 << 20  # smaller tensors are copied: a buffer of their own would cost more than the copy


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


def _release(storages: list[torch.UntypedStorage]) -> None:
    """Drop the references one by one (the interpreter may switch threads between two frees)."""
    while storages:
        storages.pop()


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, non-overlapping cover of ``[a, b)`` spans (touching ones joined)."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _sole_owner(t: torch.Tensor) -> bool:
    """Whether ``t`` can be given new memory without anyone noticing: a plain CPU tensor that is not a view,
    covers the whole of its storage, and is neither shared with other processes nor pinned."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.device.type != "cpu" or t.layout != torch.strided:
        return False
    if t._is_view() or not t.is_contiguous() or t.storage_offset() != 0 or (t.requires_grad and not t.is_leaf):
        return False
    try:
        if t.untyped_storage().nbytes() != t.numel() * t.element_size():
            return False
        return not (t.is_shared() or t.is_pinned())
    except RuntimeError:  # no storage of its own
        return False


def _storage_ptr(t: Any) -> int | None:
    """Address of a plain CPU tensor's storage; None for anything else (a DTensor or other wrapper has no
    storage of its own, FSDP2 frees an unsharded parameter's)."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.device.type != "cpu":
        return None
    try:
        return int(t.untyped_storage().data_ptr())
    except RuntimeError:
        return None


class _Owners:
    """Which live tensor owns the memory of each tensor in a load target (zero-copy restore).

    A module's ``state_dict()`` holds detached aliases of its parameters and buffers, so an alias is traced
    back to the parameter or buffer that owns its storage; other target tensors (optimizer moments, tensors
    in ``state``) are the live ones, or copies that their owner's ``load_state_dict`` reads. A storage that
    two target tensors point into (tied weights), or that two live tensors share, is never taken over.
    """

    def __init__(self, state: Mapping[str, Any], planner: SafeLoadPlanner) -> None:
        self.live: dict[int, torch.Tensor | None] = {}
        for v in state.values():
            if isinstance(v, torch.nn.Module):
                for t in itertools.chain(v.parameters(), v.buffers()):
                    ptr = _storage_ptr(t)
                    if ptr and self.live.setdefault(ptr, t) is not t:
                        self.live[ptr] = None
        self.claims: dict[int, set[int]] = {}
        for t in getattr(planner, "state_dict", {}).values():
            ptr = _storage_ptr(t)
            if ptr:
                self.claims.setdefault(ptr, set()).add(id(t))

    def adoptable(self, planner: SafeLoadPlanner, md: Metadata, ri: Any, length: int) -> torch.Tensor | None:
        """The live tensor whose memory the bytes of read item ``ri`` may become, or None (copy them)."""
        if ri.type != LoadItemType.TENSOR or length < ADOPT_MIN_BYTES:
            return None
        tmd = md.state_dict_metadata.get(ri.storage_index.fqn)
        if not isinstance(tmd, TensorStorageMetadata):
            return None
        sizes = next((tuple(c.sizes) for c in tmd.chunks if tuple(c.offsets) == tuple(ri.storage_index.offset)), None)
        if sizes is None or tuple(ri.lengths) != sizes or any(ri.storage_offsets) or any(ri.dest_offsets):
            return None  # only a stored chunk that is the whole destination tensor
        dest = planner.resolve_tensor(ri)
        if tuple(dest.shape) != sizes or dest.dtype != tmd.properties.dtype or not _sole_owner(dest):
            return None
        ptr = _storage_ptr(dest)
        if not ptr or len(self.claims.get(ptr, ())) != 1:
            return None
        live = self.live.get(ptr, dest)
        if live is None or (live is not dest and not (_sole_owner(live) and live.shape == dest.shape
                                                       and live.dtype == dest.dtype)):
            return None
        # Nothing else may hold this memory: a view the program keeps, a flat parameter whose pieces the
        # parameters are, a compiled graph's alias. Each holds a reference to the storage; the tensors
        # known here hold one each, and the temporary storage object asked about holds one more.
        use_count = getattr(torch._C, "_storage_Use_Count", None)
        if use_count is None or use_count(dest.untyped_storage()._cdata) != 2 + (live is not dest):
            return None
        return live


@dataclass
class _Loaded:
    """Verified bytes of one step, ready to go into the live state."""

    planner: SafeLoadPlanner
    target: dict[str, Any]
    md: Metadata
    needed: dict[str, list[Any]]
    where: dict[tuple[str, int], tuple[torch.Tensor, int]]  # item -> (buffer, offset of its bytes in it)
    adopt: dict[tuple[str, int], torch.Tensor]  # item -> live tensor whose memory its own buffer becomes
    decoded: dict[tuple[str, int], Any] = field(default_factory=dict)
    bytes_read: int = 0
    adopted_bytes: int = 0  # bytes that became live memory without a copy
    cuda: bool = False  # some of the state is on a GPU: copies go on a side stream (buffers pinned)

    def apply(self) -> None:
        """Put every verified item into the live state. A large tensor read into a buffer of its own takes
        that buffer as its memory (``.data``: the same tensor object, new storage; no copy); the rest is
        copied in place. Called only after every rank verified everything it read.

        The memory a tensor gave up is freed on a background thread, one tensor at a time: unmapping
        1 GiB of 4 KiB pages costs about 0.1 s, which the restore need not wait for."""
        given_up: list[torch.UntypedStorage] = []
        stream = torch.cuda.Stream() if self.cuda else None
        if stream is not None:
            # The side stream writes tensors the program's stream may still be using: it waits for that
            # stream first; at the end the host waits for the side stream, so the buffers outlive the copies.
            stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            self._apply(given_up)
        if stream is not None:
            stream.synchronize()
        if given_up:
            threading.Thread(target=_release, args=(given_up,), name="rslurm-release", daemon=True).start()

    def _apply(self, given_up: list[torch.UntypedStorage]) -> None:
        for rel, reqs in self.needed.items():
            for ri, info in reqs:
                buf, at = self.where[(rel, info.offset)]
                if ri.type == LoadItemType.BYTE_IO:
                    self.planner.set_value(ri, self.decoded[(rel, info.offset)])
                    continue
                stored = self._stored_tensor(ri, buf[at : at + info.length])
                part = narrow_tensor_by_index(stored, ri.storage_offsets, ri.lengths)
                dest = self.planner.resolve_tensor(ri)
                if dest.size() != part.size():
                    raise IncompatibleCheckpointError(
                        f"{ri.dest_index.fqn}: checkpoint has size {tuple(part.size())}, state has {tuple(dest.size())}"
                    )
                live = self.adopt.get((rel, info.offset))
                with torch.no_grad():
                    if (live is not None and part.dtype == dest.dtype
                            and part.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()):
                        given_up.append(live.untyped_storage())
                        live.data = part
                        if dest is not live:
                            dest.data = part  # the alias a module's load_state_dict may still read
                        self.adopted_bytes += part.numel() * part.element_size()
                    else:
                        # To a GPU from pinned memory: asynchronous on the side stream (apply's caller waits).
                        dest.detach().copy_(part, non_blocking=dest.device.type == "cuda")
                self.planner.commit_tensor(ri, dest)

    def _stored_tensor(self, ri: Any, blob: torch.Tensor) -> torch.Tensor:
        tmd = self.md.state_dict_metadata[ri.storage_index.fqn]
        assert isinstance(tmd, TensorStorageMetadata)
        chunk = next(c for c in tmd.chunks if tuple(c.offsets) == tuple(ri.storage_index.offset))
        dtype = tmd.properties.dtype
        fr = framing_for(dtype, tuple(chunk.sizes))
        n = len(fr.prefix)
        nbytes = torch.Size(chunk.sizes).numel() * torch.empty((), dtype=dtype).element_size()
        if blob.numel() == n + nbytes + len(fr.suffix) and bytes(blob[:n].numpy()) == fr.prefix:
            raw = blob[n : n + nbytes]
            return raw.view(dtype).view(tuple(chunk.sizes)) if nbytes else torch.empty(tuple(chunk.sizes), dtype=dtype)
        # Not our framing (e.g. written by plain DCP): let torch parse it, safely.
        return torch.load(io.BytesIO(blob.numpy().tobytes()), map_location="cpu", weights_only=True)


__all__ = ["ADOPT_MIN_BYTES"]
