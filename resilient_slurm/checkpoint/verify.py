"""Full verification of a committed step, in the node-local tier or in a durable tier.

Who calls what: ``rslurm verify`` (through :mod:`resilient_slurm.catalog`) calls :func:`verify_step_dir`
for each storage domain's copy of a step present here, and :func:`verify_durable_step` for a durable
step; ``rslurm export`` and ``rslurm show`` call :func:`check_file` on each file they read and
:func:`durable_file` to reach a durable object as a local file. Restore verifies only what it reads
(engine.py); this module reads everything. Nothing here writes to a tier.

What is checked:

* a local copy (one domain's ``step_X/``): the manifest (it parses, names this run and step), the
  domain's ``.metadata`` (size and checksum from the manifest; it loads with the restricted unpickler;
  every item it maps into one of the domain's files is a byte range the manifest has a checksum for),
  then every shard of the domain: size, xxh3 of the whole file, xxh3 of each item.
* a durable step: the root manifest (the commit), its list of domains, every domain's manifest (a
  manifest of the same save) and ``.metadata``, the root ``.metadata`` (as above, against every
  rank's shard), then every rank's shard, one at a time. A POSIX tier is read in place; other tiers
  (S3) are downloaded by ``get_file`` (which checks the size and the whole-file xxh3 as the bytes
  arrive) into a scratch directory, checked item by item and deleted before the next shard, so
  verifying never needs more scratch space than the largest shard.

Every problem is a :class:`Fault` that names the file or key, the rank whose shard it is, and what is
wrong; nothing raises for bad data. Storage failures (an unreachable store) are faults too, of kind
``unreadable``: a step that could not be read was not verified.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import mmap
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, BinaryIO

import xxhash

from ..errors import (
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    ObjectNotFoundError,
    ResilientSlurmError,
    StorageError,
    UnsafePathError,
)
from ..manifest import (
    CHECKSUM_ALGORITHM,
    DCP_METADATA_NAME,
    DOMAINS_DIR,
    MANIFEST_NAME,
    PARTIAL_SUFFIX,
    Manifest,
    ShardEntry,
    domain_key,
    durable_step_key,
    partial_items,
    read_durable_manifest,
    read_manifest_file,
    read_regular_file,
)
from ..storage.encoding import get_shard, is_compressed
from ..storage.fileio import check_free_space, checksum, open_regular
from ..storage.tier import StorageTier

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

Progress = Callable[[int], None]
PIECE = 64 << 20  # bytes hashed per call: progress moves at least this often on large shards

MISSING = "missing"
CORRUPT = "corrupt"
UNREADABLE = "unreadable"


@dataclass(frozen=True)
class Fault:
    """One thing wrong with a step: where (a path or a tier URL and key), whose shard, what."""

    where: str
    problem: str
    rank: int | None = None
    kind: str = CORRUPT  # missing | corrupt | unreadable

    def __str__(self) -> str:
        rank = f" (rank {self.rank})" if self.rank is not None else ""
        return f"{self.where}{rank}: {self.problem}"

    def to_json(self) -> dict[str, Any]:
        """The fault as a JSON-able dict."""
        return {"where": self.where, "rank": self.rank, "kind": self.kind, "problem": self.problem}


@dataclass
class StepReport:
    """Outcome of verifying one copy of one step: a local domain's directory, or a durable step."""

    tier: str  # local | durable
    where: str  # step directory, or tier URL and step prefix
    run_id: str | None = None
    step: int | None = None
    domain: str | None = None  # local copies: the storage domain
    manifest: Manifest | None = None
    faults: list[Fault] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    bytes_checked: int = 0
    files_checked: int = 0

    @property
    def ok(self) -> bool:
        """True when nothing is wrong."""
        return not self.faults

    def to_json(self) -> dict[str, Any]:
        """The report as a JSON-able dict."""
        return {"tier": self.tier, "where": self.where, "run_id": self.run_id, "step": self.step,
                "domain": self.domain, "ok": self.ok, "faults": [f.to_json() for f in self.faults],
                "notes": list(self.notes), "bytes_checked": self.bytes_checked, "files_checked": self.files_checked}


# --------------------------------------------------------------------------------------------- one file
def check_file(path: str, entry: ShardEntry, *, where: str | None = None, whole_file: bool = True,
               item_names: Mapping[int, str] | None = None, progress: Progress | None = None) -> tuple[list[Fault], int]:
    """Check the shard file at ``path`` against its manifest entry: size, the whole file's xxh3 (unless
    ``whole_file`` is False because the download already checked it) and every item's xxh3. Returns the
    faults (``where`` names the file in them, default ``path``) and the bytes checked. ``item_names``
    maps an item's offset to its name in the state (for messages)."""
    where = where or path
    if entry.algorithm != CHECKSUM_ALGORITHM:
        return [Fault(where, f"checksum algorithm {entry.algorithm!r} is unknown to this version "
                             f"(expected {CHECKSUM_ALGORITHM})", entry.rank)], 0
    try:
        fd = open_regular(path, what="a shard")
    except FileNotFoundError:
        return [Fault(where, "the shard file is missing", entry.rank, MISSING)], 0
    except UnsafePathError as exc:
        return [Fault(where, str(exc).removeprefix(f"{path}: "), entry.rank)], 0
    except OSError as exc:
        return [Fault(where, f"cannot read it: {exc.strerror}", entry.rank, UNREADABLE)], 0
    with os.fdopen(fd, "rb") as f:
        return _check_open_file(f, where, entry, whole_file, item_names, progress)


def _check_open_file(f: BinaryIO, where: str, entry: ShardEntry, whole_file: bool,
                     item_names: Mapping[int, str] | None, progress: Progress | None) -> tuple[list[Fault], int]:
    size = os.fstat(f.fileno()).st_size
    if size != entry.size:
        return [Fault(where, f"{size} bytes, the manifest says {entry.size} (truncated or overwritten)",
                      entry.rank)], 0
    if size == 0:
        ok = checksum(b"") == entry.checksum
        return ([] if ok else [Fault(where, "whole-file checksum mismatch", entry.rank)]), 0
    faults: list[Fault] = []
    h = xxhash.xxh3_64()

    def whole(view: memoryview, start: int, end: int) -> None:
        for off in range(start, end, PIECE):
            h.update(view[off : min(off + PIECE, end)])
            if progress is not None:
                progress(min(PIECE, end - off))

    try:
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            if hasattr(mmap, "MADV_SEQUENTIAL"):
                mm.madvise(mmap.MADV_SEQUENTIAL)
            view = memoryview(mm)
            try:
                # One pass in file order: each item is hashed, then fed to the whole-file hash while its
                # pages are still cached, so every byte is read from storage once.
                pos = 0
                for c in sorted(entry.chunks, key=lambda c: c.offset):
                    name = (item_names or {}).get(c.offset)
                    what = f"item {name!r} (bytes {c.offset}+{c.length})" if name else f"the item at bytes {c.offset}+{c.length}"
                    if c.offset + c.length > size:
                        faults.append(Fault(where, f"{what} lies beyond the end of the file", entry.rank))
                        continue
                    if checksum(view[c.offset : c.offset + c.length]) != c.checksum:
                        faults.append(Fault(where, f"checksum mismatch in {what}", entry.rank))
                    if whole_file and c.offset >= pos:
                        whole(view, pos, c.offset + c.length)
                        pos = c.offset + c.length
                if whole_file:
                    whole(view, pos, size)
                    if h.hexdigest() != entry.checksum:
                        faults.insert(0, Fault(where, f"whole-file checksum mismatch (xxh3 {h.hexdigest()}, the "
                                                      f"manifest says {entry.checksum}): the file is corrupt", entry.rank))
            finally:
                view.release()
    except OSError as exc:
        return [Fault(where, f"cannot read it: {exc.strerror or exc}", entry.rank, UNREADABLE)], 0
    return faults, size


def provenance_faults(prov: Any, where: str) -> list[Fault]:
    """The manifest's recorded config checked against its ``config_sha256``, as export and rehearse read it
    (provenance.py: :func:`~.provenance.stored_config`): a mismatch is a fault of the manifest ``where``."""
    from .provenance import stored_config

    try:
        stored_config(prov, where=where)
    except CorruptCheckpointError as exc:
        return [Fault(where, str(exc).removeprefix(f"{where}: "))]
    return []


def item_names_by_file(md: Metadata) -> dict[str, dict[int, str]]:
    """For each file a DCP metadata maps items into: item offset -> the item's name in the state."""
    out: dict[str, dict[int, str]] = {}
    for idx, info in (md.storage_data or {}).items():
        out.setdefault(info.relative_path, {})[info.offset] = idx.fqn
    return out


def check_metadata_ranges(md: Metadata, shards: Mapping[str, ShardEntry], *, where: str) -> list[Fault]:
    """Every item the DCP metadata maps into a file of the step (any domain's: the manifest lists every
    rank's shard) lies in a byte range the manifest has a checksum for."""
    faults = []
    chunks = {(p, c.offset): c.length for p, s in shards.items() for c in s.chunks}
    for idx, info in (md.storage_data or {}).items():
        rel = info.relative_path
        if rel not in shards:
            faults.append(Fault(where, f"item {idx.fqn!r} is stored in {rel}, a file the manifest does not list"))
        elif chunks.get((rel, info.offset)) != info.length:
            faults.append(Fault(where, f"item {idx.fqn!r} maps to {rel} bytes {info.offset}+{info.length}, a range "
                                       "the manifest has no checksum for", shards[rel].rank))
    return faults


def _load_md(data: bytes, expected: Any, where: str, rep: StepReport) -> Metadata | None:
    from .planning import check_metadata  # imports torch

    try:
        return check_metadata(data, expected, source=where)
    except CorruptCheckpointError as exc:
        rep.faults.append(Fault(where, str(exc).removeprefix(f"{where}: ")))
        return None


# --------------------------------------------------------------------------------------------- local copy
def verify_step_dir(step_dir: str, *, run_id: str | None = None, step: int | None = None, threads: int = 4,
                    progress: Progress | None = None) -> StepReport:
    """Verify one storage domain's copy of a step (``<root>/<run>/step_X/``): everything it should hold.
    ``run_id`` and ``step``, when given, must be what the manifest says."""
    rep = StepReport(tier="local", where=step_dir, run_id=run_id, step=step)
    mpath = os.path.join(step_dir, MANIFEST_NAME)
    try:
        rep.manifest = read_manifest_file(mpath)
    except FileNotFoundError:
        rep.faults.append(Fault(mpath, "missing: this domain's copy of the step is not committed (a step "
                                       "directory always has its manifest)", kind=MISSING))
        return rep
    except (CorruptCheckpointError, IncompatibleCheckpointError) as exc:
        rep.faults.append(Fault(mpath, str(exc).removeprefix(f"{mpath}: ")))
        return rep
    except OSError as exc:
        rep.faults.append(Fault(mpath, f"cannot read it: {exc.strerror}", kind=UNREADABLE))
        return rep
    m = rep.manifest
    rep.domain = m.node
    if (run_id is not None and m.run_id != run_id) or (step is not None and m.step != step):
        rep.faults.append(Fault(mpath, f"says run {m.run_id!r} step {m.step}, but lives in run {run_id!r} step {step}"))
    rep.run_id, rep.step = m.run_id, m.step
    rep.faults += provenance_faults(m.provenance, mpath)
    mine = m.shards_of_node(m.node)
    by_path = {s.path: s for s in m.shards}
    mdpath = os.path.join(step_dir, DCP_METADATA_NAME)
    names: dict[str, dict[int, str]] = {}
    try:
        md = _load_md(read_regular_file(mdpath, m.dcp_metadata.length, what="DCP metadata"), m.dcp_metadata,
                      mdpath, rep)
        if md is not None:
            rep.faults += check_metadata_ranges(md, by_path, where=mdpath)
            names = item_names_by_file(md)
    except FileNotFoundError:
        rep.faults.append(Fault(mdpath, "missing", kind=MISSING))
    except CorruptCheckpointError as exc:  # a link, a special file, or longer than the manifest says
        rep.faults.append(Fault(mdpath, str(exc).removeprefix(f"{mdpath}: ")))
    except OSError as exc:
        rep.faults.append(Fault(mdpath, f"cannot read it: {exc.strerror}", kind=UNREADABLE))

    def one(s: ShardEntry) -> tuple[list[Fault], int]:
        return check_file(os.path.join(step_dir, s.path), s, item_names=names.get(s.path), progress=progress)

    def part(s: ShardEntry) -> tuple[list[Fault], int]:
        # A file a resharded fetch took in part (manifest.partial_items): the items it holds, each against
        # its checksum (the rest of the file is a hole, so there is no whole-file checksum to check).
        held = partial[s.path]
        kept = tuple(c for c in s.chunks if (c.offset, c.length) in held)
        path = os.path.join(step_dir, s.path + PARTIAL_SUFFIX)
        faults, _ = check_file(path, dataclasses.replace(s, chunks=kept), whole_file=False,
                               item_names=names.get(s.path), progress=progress)
        faults += [Fault(path, f"holds bytes {o}+{n}, which are no item of {s.path} in the manifest", s.rank)
                   for o, n in sorted(held - {(c.offset, c.length) for c in kept})]
        return faults, sum(c.length for c in kept)

    partial = partial_items(m)
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        for faults, n in itertools.chain(pool.map(one, mine), pool.map(part, [by_path[p] for p in sorted(partial)])):
            rep.faults += faults
            rep.bytes_checked += n
            rep.files_checked += 1
    return rep


# --------------------------------------------------------------------------------------------- durable step
def _posix_root(tier: StorageTier) -> str | None:
    from ..storage.posix import PosixTier

    return tier.root if isinstance(tier, PosixTier) else None


@contextlib.contextmanager
def durable_file(tier: StorageTier, key: str, entry: ShardEntry, *, scratch: str | None = None,
                 progress: Progress | None = None) -> Iterator[tuple[str, bool]]:
    """A local path holding durable object ``key``, and whether its whole-file checksum was checked on the
    way. A POSIX tier's file stored as it is is used in place (not checked yet); anything else (S3, a
    compressed object) is downloaded with :func:`~resilient_slurm.storage.encoding.get_shard` (decoded,
    size and xxh3 checked) into a fresh directory under ``scratch`` that is removed on exit.
    Raises what ``get_file`` raises: CorruptCheckpointError, ObjectNotFoundError, StorageError."""
    root = _posix_root(tier)
    if root is not None and not is_compressed(tier, key, entry.size):
        yield os.path.join(root, key), False
        return
    try:
        d = tempfile.mkdtemp(prefix="rslurm-fetch-", dir=scratch)
    except OSError as exc:
        raise StorageError(f"cannot make a scratch directory to download {tier.url}/{key} into, under "
                           f"{scratch or tempfile.gettempdir()}: {exc.strerror}; pass --scratch-dir DIR "
                           "(a directory with room for the largest shard)") from exc
    try:
        check_free_space(d, entry.size, what=f"downloading {tier.url}/{key} (scratch directory {d})")
        path = os.path.join(d, os.path.basename(key))
        get_shard(tier, key, path, size=entry.size, checksum=entry.checksum, progress=progress)
        yield path, True
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _storage_fault(where: str, exc: BaseException, rank: int | None = None) -> Fault:
    said = str(exc)
    said = said.removeprefix(f"{where}: ")  # the fault names the object once (Fault.__str__)
    if isinstance(exc, ObjectNotFoundError):
        return Fault(where, "missing", rank, MISSING)
    if isinstance(exc, CorruptCheckpointError):
        return Fault(where, said, rank, CORRUPT)
    return Fault(where, f"could not be read: {said}", rank, UNREADABLE)


def verify_durable_step(tier: StorageTier, run_id: str, step: int, *, scratch: str | None = None,
                        progress: Progress | None = None) -> StepReport:
    """Verify a durable step: commit, markers, metadata and every rank's shard (see the module docstring)."""
    prefix = durable_step_key(run_id, step)
    url = f"{tier.url}/{prefix}"
    rep = StepReport(tier="durable", where=url, run_id=run_id, step=step)
    mkey = durable_step_key(run_id, step, MANIFEST_NAME)
    try:
        root = read_durable_manifest(tier, run_id, step)
    except ObjectNotFoundError:
        try:
            markers = tier.list_dirs(durable_step_key(run_id, step, DOMAINS_DIR))
        except StorageError:
            markers = []
        rep.faults.append(Fault(f"{tier.url}/{mkey}", "missing: the step is not committed in the durable tier "
                                f"(domain manifests there: {', '.join(markers) or 'none'})", kind=MISSING))
        return rep
    except (CorruptCheckpointError, IncompatibleCheckpointError) as exc:
        rep.faults.append(Fault(f"{tier.url}/{mkey}", str(exc).removeprefix(f"{tier.url}/{mkey}: ")))
        return rep
    except ResilientSlurmError as exc:
        rep.faults.append(_storage_fault(f"{tier.url}/{mkey}", exc))
        return rep
    rep.manifest = root
    if root.run_id != run_id or root.step != step:
        rep.faults.append(Fault(f"{tier.url}/{mkey}", f"says run {root.run_id!r} step {root.step}"))
    rep.faults += provenance_faults(root.provenance, f"{tier.url}/{mkey}")
    listed = (root.extra.get("durable") or {}).get("domains") if isinstance(root.extra.get("durable"), dict) else None
    if listed is None:
        rep.faults.append(Fault(f"{tier.url}/{mkey}", "is not a durable manifest (no extra.durable.domains)"))
    elif sorted(listed) != sorted(root.nodes):
        rep.faults.append(Fault(f"{tier.url}/{mkey}", f"lists domains {sorted(listed)}, the step has {sorted(root.nodes)}"))
    for d in sorted(root.nodes):
        ranks = list(root.nodes[d])
        k = domain_key(run_id, step, d, MANIFEST_NAME)
        try:
            marker = read_durable_manifest(tier, run_id, step, d)
        except (CorruptCheckpointError, IncompatibleCheckpointError) as exc:
            rep.faults.append(Fault(f"{tier.url}/{k}", f"marker of domain {d} (ranks {ranks}): {exc}"))
            continue
        except ResilientSlurmError as exc:
            f = _storage_fault(f"{tier.url}/{k}", exc)
            rep.faults.append(Fault(f.where, f"marker of domain {d} (ranks {ranks}) is {f.problem}", kind=f.kind))
            continue
        if marker.save_id != root.save_id:
            rep.faults.append(Fault(f"{tier.url}/{k}", f"marker of domain {d} belongs to another save of this step "
                                                       f"(created_at {marker.created_at}, the commit says {root.created_at})"))
            continue
        mk = domain_key(run_id, step, d, DCP_METADATA_NAME)
        try:
            _load_md(tier.get_bytes(mk), marker.dcp_metadata, f"{tier.url}/{mk}", rep)
        except ResilientSlurmError as exc:
            rep.faults.append(_storage_fault(f"{tier.url}/{mk}", exc))
    by_path = {s.path: s for s in root.shards}
    names: dict[str, dict[int, str]] = {}
    mdkey = durable_step_key(run_id, step, DCP_METADATA_NAME)
    try:
        md = _load_md(tier.get_bytes(mdkey), root.dcp_metadata, f"{tier.url}/{mdkey}", rep)
        if md is not None:
            rep.faults += check_metadata_ranges(md, by_path, where=f"{tier.url}/{mdkey}")
            names = item_names_by_file(md)
    except ResilientSlurmError as exc:
        rep.faults.append(_storage_fault(f"{tier.url}/{mdkey}", exc))
    for s in sorted(root.shards, key=lambda x: x.rank):
        key = durable_step_key(run_id, step, s.path)
        where = f"{tier.url}/{key}"
        try:
            with durable_file(tier, key, s, scratch=scratch, progress=progress) as (path, checked):
                faults, n = check_file(path, s, where=where, whole_file=not checked, item_names=names.get(s.path),
                                       progress=progress)
        except ResilientSlurmError as exc:
            faults, n, checked = [_storage_fault(where, exc, s.rank)], 0, False
        rep.faults += faults
        rep.bytes_checked += n if not checked else s.size
        rep.files_checked += 1  # a file found damaged was checked too, as on the local tier
    return rep


__all__ = ["Fault", "StepReport", "check_file", "check_metadata_ranges", "durable_file", "item_names_by_file",
           "verify_durable_step", "verify_step_dir"]
