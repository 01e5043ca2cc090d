"""Proving replication: which items stored under one key on several ranks really are replicas.

DCP's convention is that an item (a tensor, a chunk of a DTensor, a plain value) under one key on
several ranks is a replica, written once. Programs keep per-rank state under shared keys anyway (a data
cursor, a per-rank generator, a prefetched batch, a BatchNorm buffer between DDP's broadcasts), and one
stored copy restored into every rank of a node silently changes the run. So replication is proven at
every save, not assumed:

* Items held by several ranks are digested (xxh3 of dtype, shape and bytes; 63 bits) on every rank
  that holds them and compared with one ``all_reduce(MAX)`` of ``[d..., -d...]``: the copies are equal
  when the maximum equals the minimum. An item whose copies differ is stored under a per-rank key
  (``_rslurm_per_rank.<rank>.<key>``, named in manifest.py) from then on and restored to its own rank.
* Items replicated by construction (the parameters of a DDP-wrapped module and their optimizer state,
  DTensor chunks with a replicated placement) are written once without a digest at every save. A
  rotating slice of them, at most ``replica_check_bytes`` per rank and save, is digested too, and a copy
  that differs is a *replica mismatch* (a desynchronised rank, silent data corruption): reported with
  the ranks and the majority, and each rank's copy is stored (or the save fails, ``replica_check=fail``).

Call order (training thread, every rank, inside ``Engine.stage``): :meth:`ItemTable.build` from every
rank's plan when any plan changed (the caller gathers them) -> :meth:`ReplicaTracker.select` ->
:func:`digest_value` of each selected item held here -> the caller's all_reduce ->
:meth:`ReplicaTracker.update` -> :attr:`ReplicaTracker.rename` for the global plan. Every input is the
same on every rank, so every rank makes the same decisions without further messages.
"""

from __future__ import annotations

import io
import logging
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType

log = logging.getLogger(__name__)

CHECK_MODES = ("warn", "fail", "off")
_MASK = (1 << 63) - 1
ABSENT = -(1 << 63)  # what a rank that does not hold an item contributes to the all_reduce


def index_key(idx: MetadataIndex) -> tuple[str, tuple[int, ...]]:
    """A sort key (and a readable identity) for an item: its key and, for a chunk, its offset."""
    return (idx.fqn, tuple(idx.offset) if idx.offset is not None else ())


def describe_index(idx: MetadataIndex) -> str:
    """``model.w`` or, for one chunk of a sharded tensor, ``model.w[offset 0, 128]``."""
    off = tuple(idx.offset) if idx.offset is not None else ()
    return f"{idx.fqn}[offset {', '.join(map(str, off))}]" if any(off) else idx.fqn


def digest_value(value: Any) -> int:
    """63-bit digest of a tensor (dtype, shape and bytes) or of a plain value (its structure, types and
    values, tensors inside included). Equal digests mean equal values; unequal digests can also come
    from equal values built in another order (a dict's insertion order, a set), which only stores them
    per rank: never the unsafe direction."""
    h = xxhash.xxh3_64()
    _feed(h, value)
    return h.intdigest() & _MASK


def _feed(h: Any, v: Any) -> None:
    if isinstance(v, torch.Tensor):
        t = v.detach()
        if t.device.type != "cpu":
            t = t.cpu()  # non-CPU tensors here are buffers and per-rank values, small; parameters are proven
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        if t.numel():
            t = t.contiguous()
            try:
                h.update(t.reshape(-1).view(torch.uint8).numpy().data)
            except (RuntimeError, TypeError):  # a dtype without a byte view: hash its serialization
                _feed_serialized(h, t)
    elif v is None or isinstance(v, bool):
        h.update(repr(v).encode())
    elif isinstance(v, int):
        h.update(f"i{v};".encode())
    elif isinstance(v, float):
        h.update(b"f" + struct.pack("<d", v))
    elif isinstance(v, str):
        e = v.encode("utf-8", "surrogatepass")
        h.update(f"s{len(e)}:".encode() + e)
    elif isinstance(v, (bytes, bytearray, memoryview)):
        h.update(f"b{len(v)}:".encode())
        h.update(v)
    elif type(v) in (list, tuple):
        h.update(f"{type(v).__name__[0]}{len(v)}:".encode())
        for x in v:
            _feed(h, x)
    elif type(v) is dict:
        h.update(f"d{len(v)}:".encode())
        for k, x in v.items():
            _feed(h, k)
            _feed(h, x)
    else:  # anything else the safe loader accepts (sets, OrderedDicts, ...): its serialization
        _feed_serialized(h, v)


def _feed_serialized(h: Any, v: Any) -> None:
    buf = io.BytesIO()
    torch.save(v, buf)
    h.update(b"z")
    h.update(buf.getvalue())


def _kind(it: Any) -> tuple[Any, ...]:
    """What an item is, as far as a key's metadata goes: a plain value, or a tensor of one global size and dtype."""
    if it.type == WriteItemType.BYTE_IO or it.tensor_data is None:
        return ("value",)
    return ("tensor", tuple(it.tensor_data.size), it.tensor_data.properties.dtype)


def describe_kind(kind: tuple[Any, ...]) -> str:
    if kind[0] == "value":
        return "a plain value"
    return f"a tensor {kind[1]} {str(kind[2]).removeprefix('torch.')}"


@dataclass(frozen=True)
class ItemTable:
    """The items held by several ranks, in one order every rank agrees on, from every rank's plan."""

    order: tuple[MetadataIndex, ...]  # shared items, sorted by key
    holders: Mapping[MetadataIndex, tuple[int, ...]]
    proven: frozenset[MetadataIndex]  # replicated by construction on every rank holding them
    nbytes: Mapping[MetadataIndex, int]
    # Keys whose value is of another kind on some ranks (a tensor here, a float there; tensors of other
    # shapes or dtypes that are not chunks of one tensor): every rank's items under them are stored per rank.
    mixed: frozenset[MetadataIndex] = frozenset()
    mixed_kinds: Mapping[str, Mapping[int, str]] = field(default_factory=dict)  # key -> rank -> kind (for the log)

    @classmethod
    def build(cls, plans: Sequence[SavePlan], proven_fqns: Sequence[Mapping[str, frozenset[int] | None]]
              ) -> ItemTable:
        """``plans[r]`` is rank r's local plan; ``proven_fqns[r]`` the keys it holds replicated by construction,
        each with the global ranks among which it is (None: every rank). An item is proven when every rank
        holding it says so for one group that holds all of them."""
        holders: dict[MetadataIndex, list[int]] = {}
        nbytes: dict[MetadataIndex, int] = {}
        kinds: dict[str, dict[tuple[Any, ...], list[int]]] = {}
        indexes: dict[str, set[MetadataIndex]] = {}
        for r, plan in enumerate(plans):
            for it in plan.items:
                holders.setdefault(it.index, []).append(r)
                kinds.setdefault(it.index.fqn, {}).setdefault(_kind(it), []).append(r)
                indexes.setdefault(it.index.fqn, set()).add(it.index)
                if it.type != WriteItemType.BYTE_IO:
                    nbytes[it.index] = it.tensor_storage_size() or 0
        mixed_fqns = sorted(f for f, ks in kinds.items() if len(ks) > 1)
        mixed = frozenset(i for f in mixed_fqns for i in indexes[f])
        shared = {i: tuple(rs) for i, rs in holders.items() if len(rs) > 1 and i not in mixed}
        order = tuple(sorted(shared, key=index_key))
        proven = frozenset(i for i in order if all(_proves(proven_fqns[r], i.fqn, shared[i]) for r in shared[i]))
        return cls(order=order, holders=shared, proven=proven, nbytes={i: nbytes.get(i, 0) for i in order},
                   mixed=mixed, mixed_kinds={f: {r: describe_kind(k) for k, rs in kinds[f].items() for r in rs}
                                             for f in mixed_fqns})


def _proves(proven: Mapping[str, frozenset[int] | None], fqn: str, holders: Sequence[int]) -> bool:
    if fqn not in proven:
        return False
    group = proven[fqn]
    return group is None or set(holders) <= group


@dataclass(frozen=True)
class ReplicaMismatch:
    """Copies of an item replicated by construction that are not equal on every rank."""

    key: str
    majority: tuple[int, ...]  # the ranks holding the most common copy
    ranks: tuple[int, ...]  # the ranks whose copy differs from it

    def describe(self) -> str:
        """One line for a warning or an error."""
        return (f"{self.key!r}: rank{'s' if len(self.ranks) > 1 else ''} {list(self.ranks)} differ from the majority "
                f"{list(self.majority)}")


def mismatch_from_digests(idx: MetadataIndex, digests: Mapping[int, int]) -> ReplicaMismatch:
    """Group the ranks of ``idx`` by digest: the largest group (ties: the one with the lowest rank) wins."""
    groups: dict[int, list[int]] = {}
    for r in sorted(digests):
        groups.setdefault(digests[r], []).append(r)
    best = max(groups.values(), key=lambda rs: (len(rs), -rs[0]))
    others = tuple(r for r in sorted(digests) if r not in best)
    return ReplicaMismatch(key=describe_index(idx), majority=tuple(best), ranks=others)


@dataclass
class ReplicaTracker:
    """The decisions that replication proofs lead to, kept across saves (identical on every rank)."""

    check: str = "warn"  # warn | fail | off: what a replica mismatch does
    check_bytes: int = 32 << 20  # proven bytes digested per rank and save for the mismatch check
    per_rank: set[MetadataIndex] = field(default_factory=set)  # copies differed once: stored per rank
    suspect: set[MetadataIndex] = field(default_factory=set)  # proven items that mismatched: digested every save
    _cursor: int = 0
    _table: ItemTable | None = None

    def __post_init__(self) -> None:
        if self.check not in CHECK_MODES:
            raise ValueError(f"replica_check must be one of {', '.join(CHECK_MODES)}, got {self.check!r}")

    def select(self, table: ItemTable) -> list[MetadataIndex]:
        """The items to digest at this save: unproven shared items not yet per rank, suspects, and the
        next slice of proven items."""
        if table is not self._table:
            self._table = table
            self._cursor = 0
            self.per_rank |= table.mixed  # a key of another kind on some ranks: per rank, without digests
        sel = [i for i in table.order if i not in table.proven and i not in self.per_rank]
        if self.check == "off":
            return sel
        sel += [i for i in table.order if i in self.suspect]
        pool = [i for i in table.order if i in table.proven and i not in self.suspect]
        if pool and self.check_bytes > 0:
            budget, n = self.check_bytes, 0
            start = self._cursor % len(pool)
            while n < len(pool):
                i = pool[(start + n) % len(pool)]
                if n and table.nbytes[i] > budget:
                    break
                budget -= table.nbytes[i]
                sel.append(i)
                n += 1
            self._cursor = start + n
        return sel

    def update(self, table: ItemTable, selected: Sequence[MetadataIndex], equal: Sequence[bool]
               ) -> tuple[list[MetadataIndex], list[MetadataIndex]]:
        """Record what the digests showed. Returns (items now stored per rank, proven items that differ)."""
        newly, mismatched = [], []
        for i, same in zip(selected, equal):
            if i in table.proven:
                if same:
                    self.suspect.discard(i)
                else:
                    self.suspect.add(i)
                    mismatched.append(i)
            elif not same and i not in self.per_rank:
                self.per_rank.add(i)
                newly.append(i)
        return newly, mismatched

    def rename(self, mismatched: Iterable[MetadataIndex] = ()) -> frozenset[MetadataIndex]:
        """Items stored per rank at this save: every item whose copies ever differed, and mismatched replicas."""
        return frozenset(self.per_rank) | frozenset(mismatched)


def equal_from_reduced(reduced: Sequence[int], n: int) -> list[bool]:
    """Decode ``all_reduce(MAX)`` of ``[d_0..d_n-1, -d_0..-d_n-1]``: item i is equal on its holders when max == min."""
    return [reduced[i] == -reduced[n + i] for i in range(n)]


def digest_vector(selected: Sequence[MetadataIndex], mine: Mapping[MetadataIndex, int]) -> list[int]:
    """This rank's contribution: its digests, then their negations; :data:`ABSENT` where it holds no copy."""
    ds = [mine.get(i, ABSENT) for i in selected]
    return ds + [ABSENT if d == ABSENT else -d for d in ds]


__all__ = ["ItemTable", "ReplicaMismatch", "ReplicaTracker", "digest_value", "digest_vector", "equal_from_reduced",
           "mismatch_from_digests"]
