"""DCP planning with storage-domain-aware deduplication, and safe (de)serialization of DCP metadata.

We use torch.distributed.checkpoint's planners and on-disk metadata so that a step directory is a
valid DCP checkpoint (``dcp.load`` with a ``FileSystemReader`` reads it) and so that DTensor/FSDP2 state
reshards on load. What we change:

* Deduplication of replicated state (DDP weights, optimizer moments, plain values) happens *per
  storage domain* (one node-local directory), spread across the ranks of that domain. Every domain thus
  holds a complete copy of the replicated state and a node can restore from its own NVMe; DCP's
  default dedup is global, which would leave node B needing bytes that only exist on node A's disk.
* Each domain's ``.metadata`` maps every item to the copy stored in that domain when there is one.
* Items whose copies differ between ranks (replication.py proves which) are stored under per-rank keys
  (``_rslurm_per_rank.<rank>.<key>``, nested as ``{_rslurm_per_rank: {rank: ...}}`` for plain DCP
  readers) and loaded by :class:`SafeLoadPlanner` from the copy of the rank that saved them.
* ``.metadata`` is read with a restricted unpickler (an allow-list of DCP metadata classes); plain
  values are loaded by :func:`load_value`: ``torch.load(weights_only=True)``, or, for a value made only of
  Python's own types (the numbers, strings, lists and dicts a state holds), the same pickle read by
  Python's unpickler with a smaller allow-list. No checkpoint content runs code on load.
"""

from __future__ import annotations

import collections
import dataclasses
import io
import pickle
import zipfile
from collections import ChainMap
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

import torch
from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    create_default_global_save_plan,
)
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import ReadItem, SavePlan, WriteItemType

from ..errors import CorruptCheckpointError
from ..manifest import ChunkEntry, per_rank_fqn, per_rank_path, split_per_rank_fqn
from .metadata_pickle import allowed, check_metadata_bytes, read_checked_metadata


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if allowed(module, name):  # the one allow-list (metadata_pickle.py), also checked without torch
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in DCP metadata")


# What a plain value's pickle may name on the fast path of load_value: classes of Python's own whose
# instances hold data only, each also on torch's weights_only allow-list. Anything else (a dtype, a tensor,
# bytes, which protocol 2 pickles through _codecs.encode) goes to torch.load(weights_only=True).
_PLAIN_GLOBALS: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("builtins", "set"): set,
    ("__builtin__", "set"): set,  # protocol 2 names Python 3's builtins so
}


class _NotPlain(Exception):
    """The value is not one load_value reads without torch: torch.load(weights_only=True) reads it."""


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        try:
            return _PLAIN_GLOBALS[(module, name)]
        except KeyError:
            raise _NotPlain(f"{module}.{name}") from None

    def persistent_load(self, pid: Any) -> Any:  # a storage: the value holds a tensor
        raise _NotPlain("a persistent id")


def _load_plain(data: bytes) -> Any:
    """A ``torch.save`` blob (zip, protocol-2 pickle) of a value made only of Python's own types, unpickled
    without torch; _NotPlain for anything else."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            names = [n for n in z.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
            if len(names) != 1:
                raise _NotPlain("not one data.pkl")
            info = z.getinfo(names[0])
            # torch.save stores, never compresses: a compressed entry (which could inflate far past the item's
            # size) is torch's to read or refuse, as every value was before
            if info.compress_type != zipfile.ZIP_STORED or info.file_size > len(data):
                raise _NotPlain("a compressed entry")
            pkl = z.read(names[0])
    except (zipfile.BadZipFile, KeyError, ValueError, OSError, EOFError) as exc:
        raise _NotPlain(str(exc)) from exc
    if not pkl.startswith(b"\x80\x02"):  # what torch.save writes (protocol 2); torch reads any other
        raise _NotPlain("pickle protocol")
    try:
        return _PlainUnpickler(io.BytesIO(pkl)).load()
    except _NotPlain:
        raise
    except Exception as exc:  # noqa: BLE001 - torch.load reads it, or says what is wrong with it
        raise _NotPlain(repr(exc)) from exc


def load_value(data: bytes) -> Any:
    """A plain value's ``torch.save`` bytes, decoded safely: nothing in them runs code.

    Most plain values of a state (step counters, learning rates, an optimizer's parameter groups, names) are
    made of Python's own types only. Those are unpickled by Python's unpickler, whose only globals are
    ``OrderedDict`` and ``set`` (:data:`_PLAIN_GLOBALS`) and which refuses persistent ids:
    the same objects ``torch.load(weights_only=True)`` makes of them, without torch's zip reader and
    pure-Python unpickler, whose first run in a fresh process took 6-11 ms for the benchmark's 19 values
    (0.8-1.3 ms this way; docs/benchmarks.md). Anything else, and anything this path cannot read, is
    ``torch.load(weights_only=True)``'s, which reads it or raises as before."""
    try:
        return _load_plain(data)
    except _NotPlain:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def dump_metadata(md: Metadata) -> bytes:
    """Serialize DCP metadata exactly as DCP's FileSystemWriter does (pickle), so plain DCP reads it."""
    return pickle.dumps(md)


def load_metadata(data: bytes, *, source: str) -> Metadata:
    """Deserialize DCP metadata with an allow-list of classes; anything else is corruption."""
    try:
        md = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as exc:  # any unpickling failure means the file is not what we wrote
        raise CorruptCheckpointError(f"{source}: unreadable DCP metadata ({type(exc).__name__}: {exc})") from exc
    if not isinstance(md, Metadata):
        raise CorruptCheckpointError(f"{source}: DCP metadata has type {type(md).__name__}, expected Metadata")
    return md


def check_metadata(data: bytes, expected: ChunkEntry, *, source: str) -> Metadata:
    """The one check of a step's ``.metadata`` where it is loaded from bytes (fetch, verify, show,
    export; restore reads a local file with :func:`read_metadata_file`): :func:`~.metadata_pickle.check_metadata_bytes` (size, checksum, allowed globals: what the
    daemon and ``gc`` check without torch), then the restricted unpickler. Raises CorruptCheckpointError
    naming ``source``: such a step is never restored, drained, or kept in place of a valid one."""
    check_metadata_bytes(data, expected, source=source)
    return load_metadata(data, source=source)


def read_metadata_file(path: str, expected: ChunkEntry) -> Metadata:
    """:func:`~.metadata_pickle.read_checked_metadata` of a local ``.metadata`` file (regular file, size,
    checksum), then the restricted unpickler, which refuses every global off the allow-list as it meets it
    (the static scan, for readers without torch, would check the same list a second time)."""
    return load_metadata(read_checked_metadata(path, expected, scanned=False), source=path)


@dataclasses.dataclass(frozen=True)
class GlobalSavePlan:
    """What every rank writes, and the state_dict metadata common to all domains."""

    plans: list[SavePlan]  # per rank: the items this rank writes (index hints rewritten)
    metadata: Metadata  # state_dict_metadata + planner_data; storage_data is filled per domain


def create_global_save_plan(
    all_plans: Sequence[SavePlan],
    domain_of_rank: Sequence[str],
    per_rank: AbstractSet[MetadataIndex] = frozenset(),
) -> GlobalSavePlan:
    """Store ``per_rank`` items under each rank's own key, deduplicate the rest within each storage domain
    (balanced by size across its ranks), and build the metadata.

    Deterministic: every rank can run it on the same gathered plans and get the same answer.
    """
    all_plans = [_rename_per_rank(p, r, per_rank) for r, p in enumerate(all_plans)] if per_rank else list(all_plans)
    domains = sorted(set(domain_of_rank), key=lambda d: domain_of_rank.index(d))
    write_plans: list[SavePlan] = list(all_plans)
    for dom in domains:
        ranks = [r for r, d in enumerate(domain_of_rank) if d == dom]
        for r, p in zip(ranks, dedup_save_plans([all_plans[r] for r in ranks])):
            write_plans[r] = p
    # The metadata must list each chunk once: take every domain's items but drop those an earlier
    # domain already holds.
    seen: set[MetadataIndex] = set()
    meta_plans: list[SavePlan] = []
    for p in write_plans:
        keep = []
        for item in p.items:
            if item.index not in seen:
                seen.add(item.index)
                keep.append(item)
        meta_plans.append(dataclasses.replace(p, items=keep))
    _, md = create_default_global_save_plan(meta_plans)
    mappings = dict(ChainMap(*[p.planner_data for p in all_plans if p.planner_data]))
    if per_rank:  # keys now stored only per rank have no entry of their own
        mappings = {k: v for k, v in mappings.items() if k in md.state_dict_metadata}
    md = dataclasses.replace(md, planner_data=mappings)
    # Byte items and index hints: rewrite each rank's write items with the metadata's chunk positions.
    hints: dict[MetadataIndex, int | None] = {}
    for fqn, smd in md.state_dict_metadata.items():
        chunks = getattr(smd, "chunks", None)
        if chunks is None:
            hints[MetadataIndex(fqn)] = None
        else:
            for i, c in enumerate(chunks):
                hints[MetadataIndex(fqn, c.offsets)] = i
    final = []
    for p in write_plans:
        items = [
            dataclasses.replace(it, index=dataclasses.replace(it.index, index=hints.get(it.index)))
            if it.type != WriteItemType.BYTE_IO
            else it
            for it in p.items
        ]
        final.append(dataclasses.replace(p, items=items))
    return GlobalSavePlan(plans=final, metadata=md)


def _rename_per_rank(plan: SavePlan, rank: int, per_rank: AbstractSet[MetadataIndex]) -> SavePlan:
    """Rank ``rank``'s plan with its copies of ``per_rank`` items under its own keys (and nested paths)."""
    items, data = [], dict(plan.planner_data or {})
    for it in plan.items:
        if it.index in per_rank:
            fqn = per_rank_fqn(rank, it.index.fqn)
            items.append(dataclasses.replace(it, index=dataclasses.replace(it.index, fqn=fqn)))
            if it.index.fqn in data:
                data[fqn] = per_rank_path(rank, data[it.index.fqn])
        else:
            items.append(it)
    return dataclasses.replace(plan, items=items, planner_data=data)


def original_index(idx: MetadataIndex) -> MetadataIndex:
    """The key a per-rank item has in the rank's own state (other items: unchanged)."""
    split = split_per_rank_fqn(idx.fqn)
    return idx if split is None else dataclasses.replace(idx, fqn=split[1])


def domain_storage_data(
    results: Sequence[Mapping[MetadataIndex, tuple[str, int, int]]],
    domain_of_rank: Sequence[str],
    domain: str,
) -> dict[MetadataIndex, _StorageInfo]:
    """Map every item to a stored copy, preferring the copy in ``domain`` (then the lowest rank)."""
    out: dict[MetadataIndex, _StorageInfo] = {}
    order = sorted(range(len(results)), key=lambda r: (domain_of_rank[r] != domain, r))
    for r in order:
        for idx, (path, off, length) in results[r].items():
            if idx not in out:
                out[idx] = _StorageInfo(path, off, length)
    return out


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that loads plain values with ``weights_only=True`` (no arbitrary code), and that
    reads items stored per rank from the copy of ``source_rank`` (this rank, unless ranks are mapped)."""

    def __init__(self, source_rank: int = 0) -> None:
        super().__init__()
        self.source_rank = source_rank

    def set_up_planner(self, state_dict: Any, metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        assert metadata is not None
        for fqn in list(self.state_dict):
            own = per_rank_fqn(self.source_rank, fqn)
            if fqn not in metadata.state_dict_metadata and own in metadata.state_dict_metadata:
                self.state_dict[own] = self.state_dict.pop(fqn)
                self.mappings[own] = self.mappings.pop(fqn)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.set_value(read_item, load_value(value.getvalue() if isinstance(value, io.BytesIO) else value.read()))

    def set_value(self, read_item: ReadItem, obj: Any) -> None:
        """Put an already (safely) decoded plain value in place."""
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
