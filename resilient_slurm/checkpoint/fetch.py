"""The durable tier's side of a restore: list its committed steps, fetch one domain's part of a step.

Who calls what: :class:`~resilient_slurm.checkpoint.restore.Restorer` (restore.py) holds one
:class:`DurableFetcher`, built by :class:`~resilient_slurm.checkpoint.engine.Engine` with the engine's
collaborators and its local commit (``Engine._install``, the rename that also commits a save):

1. rank 0: :meth:`DurableFetcher.steps` -- the durable tier's committed steps (``manifest.durable_steps``),
   or none and why the tier could not be listed (a storage failure, never raised: the node-local tier may
   still restore).
2. every rank, collective (foreground group): :meth:`DurableFetcher.fetch_round` -- one all_gather of
   the items (file, offset, length) each rank's load plan reads (the restorer plans against
   :meth:`DurableFetcher.source`'s metadata), then the domain leaders that need ``step`` call
   :meth:`DurableFetcher.fetch` with the union of their ranks' items; one all_gather tells every rank whether every
   fetch succeeded, how many bytes its own domain fetched, and which failures were storage failures
   (an endpoint down, a timeout, a full local disk: the step may restore once storage is back) rather
   than corruption.
3. domain leader: :meth:`DurableFetcher.fetch` -- reads the root manifest and the marker of this domain
   (or of the domain that held the same ranks, when the job was requeued onto other nodes at the same
   world size; or of the first domain, whose metadata leads to every file), checks the domain's ``.metadata``
   against the manifest, downloads what this domain's ranks need into ``step_X.tmp-fetch-<nonce>/``: at
   the same layout the files the domain wrote; at another layout (a reshard, or ranks placed otherwise)
   the items their load plans read -- a file whole when they read most of it, otherwise only those items
   (``get_ranges``: ranged GETs or ``pread``, each item checked against its own checksum, into a sparse
   ``<file>.partial`` listed in the manifest's ``extra["partial"]``, :func:`~resilient_slurm.manifest.partial_items`);
   every file when a plan is missing. Up to :data:`FILES_IN_FLIGHT` files at a time, ``get_file`` checking
   size and xxh3 as the bytes arrive. Then it writes ``.metadata`` and a manifest that names this
   domain, fsyncs, and commits the directory locally like a save (the engine's rename). Nothing is left
   behind on failure.

The fetcher writes only into this rank's node-local run directory; it never writes to the durable tier.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor

from torch.distributed.checkpoint.metadata import Metadata

from ..errors import (
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    InsufficientSpaceError,
    PermanentError,
    ResilientSlurmError,
    StorageError,
    TransientError,
)
from ..layout import TempKind, temp_dirname
from ..manifest import (
    DCP_METADATA_NAME,
    MANIFEST_NAME,
    PARTIAL,
    PARTIAL_SUFFIX,
    Manifest,
    ShardEntry,
    domain_key,
    durable_step_key,
    durable_steps,
    read_durable_manifest,
)
from ..rundir import RunDir
from ..storage.fileio import atomic_write, check_free_space, fsync_dir, remove_tree_quietly
from ..storage.tier import Span, StorageTier
from .coordination import Coordinator, Topology
from .planning import check_metadata

log = logging.getLogger(__name__)

# Files downloaded at once by one fetch. Each file's own pieces go through the tier's pool and budget
# (drain_threads), so this bounds how many files are under way, not how many requests.
FILES_IN_FLIGHT = 8

# A file whose items a resharded plan reads are at least this share of it is fetched whole (one
# request stream, and a complete file that every reader of the step can use); below it, only the items.
WHOLE_FILE_SHARE = 0.75

# (temp directory, step, token): commits a complete temp directory as ``step_X/`` in the local tier.
Install = Callable[[str, int, str], None]

# What load plans read: shard file -> its items (offset, length) read.
Planned = Mapping[str, frozenset[tuple[int, int]]]


def merge_planned(plans: list[Planned | None]) -> dict[str, frozenset[tuple[int, int]]] | None:
    """The union of several ranks' planned reads; None when one of them is unknown."""
    if any(p is None for p in plans):
        return None
    out: dict[str, set[tuple[int, int]]] = {}
    for p in plans:
        assert p is not None
        for path, items in p.items():
            out.setdefault(path, set()).update(items)
    return {path: frozenset(items) for path, items in out.items()}


class DurableFetcher:
    """Lists and fetches steps of one run from the durable tier into this node's local tier. One per rank.

    ``tier`` is None when the run has no durable tier: :meth:`fetch_round` still takes part in the
    collective (every rank must), and a fetch asked of it fails like any other fetch."""

    def __init__(
        self,
        tier: StorageTier | None,
        topo: Topology,
        coord: Coordinator,
        run_id: str,
        run_dir: str,
        *,
        install: Install,
        free_space_margin: int,
    ) -> None:
        self.tier = tier
        self.topo = topo
        self.coord = coord
        self.run_id = run_id
        self.run_dir = run_dir
        self.install = install
        self.free_space_margin = free_space_margin

    def steps(self) -> tuple[list[int], str | None]:
        """The durable tier's committed steps, or none and why they could not be listed."""
        assert self.tier is not None
        try:
            return durable_steps(self.tier, self.run_id), None
        except ResilientSlurmError as exc:
            log.warning("cannot list the durable tier %s (%s); trying the node-local tier", self.tier.url, exc)
            return [], f"cannot list {self.tier.url}: {exc}"

    def fetch_round(self, step: int, need: bool, unreachable: list[str],
                    planned: Planned | None = None, *, save_of: float | None = None) -> tuple[bool, int | None]:
        """Collective: leaders with ``need`` fetch ``step`` from the durable tier. ``planned``: the items
        this rank's load plan reads (None: unknown); a leader fetches the union over its domain's ranks
        (every file when one of them does not know). Returns whether every fetch succeeded, and the bytes
        this rank's domain fetched (None when it fetched nothing). Fetches that failed for a storage reason
        (not corruption) are appended to ``unreachable``. ``save_of``: the ``created_at`` of the other domains'
        own copies of ``step``; a durable step of another save is refused (it would restore a mix of two)."""
        plans = self.coord.phase(f"planning the fetch of step {step}", lambda: planned)

        def fetch_here() -> tuple[str | None, int | None, bool]:
            """(error, bytes fetched, whether the error is the storage's): a failed fetch skips the step."""
            if not need:
                return None, None, False
            try:
                union = merge_planned([plans[r] for r in self.topo.domain_ranks])
                t0 = time.perf_counter()
                n = self.fetch(step, union, save_of=save_of)
                dt = time.perf_counter() - t0
                log.info("step %d: fetched %.1f MiB for %s from %s in %.2f s (%.1f MiB/s)", step, n / 2**20,
                         self.topo.domain, self.tier.url if self.tier else "?", dt, n / 2**20 / max(dt, 1e-9))
                return None, n, False
            except Exception as exc:  # a value, not an error: the step is skipped on every rank
                err = f"{self.topo.domain}: fetching step {step} from the durable tier failed: {exc}"
                log.error("%s", err)
                return err, None, _storage_failure(exc)

        gathered = self.coord.phase(f"fetching step {step} from the durable tier", fetch_here)
        errors = [e for e, _, _ in gathered if e]
        unreachable += [e for e, _, t in gathered if e and t]
        if errors and self.topo.rank == 0:
            for e in errors:
                log.warning("skipping step %d: %s", step, e)
        return not errors, gathered[self.topo.domain_ranks[0]][1]

    def source(self, step: int) -> Source:
        """Read which saved domain this domain fetches ``step`` from: the root manifest, that domain's
        marker (of the same save) and its ``.metadata`` (checked against the marker). Three small GETs."""
        tier = self.tier
        assert tier is not None
        topo = self.topo
        root_m = read_durable_manifest(tier, self.run_id, step)
        src = _source_domain(root_m.nodes, root_m.world_size, root_m.first_domain, topo.domain,
                             tuple(topo.domain_ranks), topo.world_size)
        dm = read_durable_manifest(tier, self.run_id, step, src)
        if dm.save_id != root_m.save_id:
            raise CorruptCheckpointError(f"{tier.url}: step {step}: the marker of {src} belongs to another save")
        md_key = domain_key(self.run_id, step, src, DCP_METADATA_NAME)
        md_bytes = tier.get_bytes(md_key)
        md = check_metadata(md_bytes, dm.dcp_metadata, source=f"{tier.url}/{md_key}")
        same_layout = dm.world_size == topo.world_size and tuple(dm.nodes.get(src, ())) == tuple(topo.domain_ranks)
        return Source(src, dm, md_bytes, md, same_layout)

    def fetch(self, step: int, planned: Planned | None = None, *, save_of: float | None = None) -> int:
        """Leader: copy this domain's part of ``step`` from the durable tier into the local tier (verified,
        then committed like a save: temp directory, manifest last, rename). Returns bytes fetched.

        What: with the layout that saved the step (same world size, same ranks on this node) the files
        this domain's ranks wrote; otherwise ``planned``, the items the load plans of this domain's ranks
        read (another world size, or ranks placed differently): each file whole when they read at least
        :data:`WHOLE_FILE_SHARE` of it, else only those items; without a plan, every file of the step."""
        tier = self.tier
        assert tier is not None
        topo = self.topo
        source = self.source(step)
        dm, md = source.marker, source.md
        if save_of is not None and dm.created_at != save_of:
            raise CorruptCheckpointError(
                f"{tier.url}: step {step} there is another save of that step (created at {dm.created_at}) than the "
                f"copies the other storage domains hold (created at {save_of}); restoring it would mix the two")
        by_path = {s.path: s for s in dm.shards}
        ranged: dict[str, list[Span]] = {}
        if source.same_layout:  # the ranks here are the ones that wrote src's shards: they need only those
            wanted = {s.path for s in dm.shards_of_node(source.domain)}
        elif planned is not None:  # what this domain's ranks will read, and nothing else
            wanted = set(planned) - set(by_path)  # not in the manifest: reported below
            for path, items in planned.items():
                if path in by_path:
                    spans = _item_spans(by_path[path], items)
                    if spans is None or sum(sp.length for sp in spans) >= WHOLE_FILE_SHARE * by_path[path].size:
                        wanted.add(path)  # whole (an item without a checksum: the read that follows says so)
                    else:
                        ranged[path] = spans
        else:  # every file this metadata points at
            wanted = {info.relative_path for info in md.storage_data.values()}
        missing = wanted - set(by_path)
        if missing:
            raise CorruptCheckpointError(f"{tier.url}: step {step}: files {sorted(missing)} are not in the manifest")
        os.makedirs(self.run_dir, mode=0o700, exist_ok=True)
        total = sum(by_path[p].size for p in wanted) + sum(sp.length for spans in ranged.values() for sp in spans)
        check_free_space(self.run_dir, total + self.free_space_margin, what=f"fetching step {step}")
        tmp = RunDir.at(self.run_dir).file(temp_dirname(step, TempKind.FETCH, topo.nonce))
        remove_tree_quietly(tmp)
        os.makedirs(tmp, mode=0o700)
        try:
            fetched = self._get_files(step, [by_path[p] for p in sorted(wanted)],
                                      [(by_path[p], ranged[p]) for p in sorted(ranged)], tmp)
            atomic_write(os.path.join(tmp, DCP_METADATA_NAME), source.md_bytes)
            shards = tuple(dataclasses.replace(s, node=topo.domain) if s.path in wanted else s for s in dm.shards)
            extra = {k: v for k, v in dm.extra.items() if k != PARTIAL}
            if ranged:
                extra[PARTIAL] = {p: [[sp.offset, sp.length] for sp in spans] for p, spans in sorted(ranged.items())}
            local = dataclasses.replace(dm, node=topo.domain, shards=shards, extra=extra)
            atomic_write(os.path.join(tmp, MANIFEST_NAME), local.to_json().encode())
            fsync_dir(tmp)
            self.install(tmp, step, f"fetch-{topo.nonce}")
        except BaseException:
            remove_tree_quietly(tmp)
            raise
        return fetched


    def _get_files(self, step: int, entries: list[ShardEntry], parts: list[tuple[ShardEntry, list[Span]]],
                   tmp: str) -> int:
        """Download ``entries`` whole and the spans of ``parts`` (into ``<path>.partial``) into ``tmp``, up
        to :data:`FILES_IN_FLIGHT` files at a time (a file smaller than one piece is one request on one
        connection: one after another, a node restoring its share of a large job would wait on latency,
        not bandwidth). Everything is checked as it arrives (``get_file``, ``get_ranges``); after a failure
        no new file starts, and the first failure is raised once the files under way have ended. Returns
        the bytes fetched."""
        from ..storage.encoding import get_shard, get_shard_ranges  # zstandard: only when a step is fetched

        tier = self.tier
        assert tier is not None
        failed = threading.Event()
        jobs: list[tuple[ShardEntry, list[Span] | None]] = [(e, None) for e in entries] + list(parts)

        def one(e: ShardEntry, spans: list[Span] | None) -> int:
            if failed.is_set():
                return 0
            key = durable_step_key(self.run_id, step, e.path)
            try:
                if spans is None:
                    get_shard(tier, key, os.path.join(tmp, e.path), size=e.size, checksum=e.checksum)
                    return e.size
                return get_shard_ranges(tier, key, os.path.join(tmp, e.path + PARTIAL_SUFFIX), size=e.size,
                                        spans=spans).bytes
            except BaseException:
                failed.set()
                raise

        if len(jobs) <= 1:
            return sum(one(e, spans) for e, spans in jobs)
        with ThreadPoolExecutor(max_workers=min(FILES_IN_FLIGHT, len(jobs)), thread_name_prefix="rslurm-fetch") as ex:
            futures = [ex.submit(one, e, spans) for e, spans in jobs]
        return sum(f.result() for f in futures)


def _item_spans(entry: ShardEntry, items: frozenset[tuple[int, int]]) -> list[Span] | None:
    """``items`` of ``entry`` with their checksums from the manifest; None when one has no checksum there."""
    sums = {(c.offset, c.length): c.checksum for c in entry.chunks}
    if any(it not in sums for it in items):
        return None
    return [Span(o, n, sums[(o, n)]) for o, n in sorted(items)]


@dataclasses.dataclass(frozen=True)
class Source:
    """Where a domain fetches a step from (:meth:`DurableFetcher.source`)."""

    domain: str  # the saved domain whose marker and metadata lead to the files
    marker: Manifest  # that domain's manifest
    md_bytes: bytes  # its DCP .metadata, as stored
    md: Metadata  # ... and decoded (checked against the marker)
    same_layout: bool  # the ranks of this domain are the ones that wrote the saved domain's files


def _source_domain(saved: Mapping[str, tuple[int, ...]], saved_world: int, first: str, domain: str,
                   ranks: tuple[int, ...], world: int) -> str:
    """The saved domain whose part of a step this domain fetches: its own; else, at the same world size,
    the domain that held exactly the ranks it holds now (a job requeued onto other nodes: each new node
    needs only what one old node wrote, not every file of the step); else the first domain, whose
    metadata then leads to every file."""
    if domain in saved:
        return domain
    if saved_world == world:
        for d in sorted(saved):
            if tuple(saved[d]) == ranks:
                return d
    return first


def _storage_failure(exc: BaseException) -> bool:
    """A failure that says nothing about the checkpoint (an endpoint down, a timeout, a full local disk),
    as opposed to corruption or a missing object: the step may restore once storage is back."""
    if isinstance(exc, (CorruptCheckpointError, IncompatibleCheckpointError, PermanentError)):
        return isinstance(exc, InsufficientSpaceError)
    return isinstance(exc, (StorageError, OSError, TransientError))


__all__ = ["DurableFetcher", "Install", "Source"]
