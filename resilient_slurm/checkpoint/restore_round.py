"""One restore round: open a step on every rank, compare its keys with the state, read it and verify it.

Who calls what: the :class:`~.restore.Restorer` (restore.py) holds one :class:`StepReader` per rank and,
for each candidate step of its plan (restore_plan.py), calls :meth:`StepReader.planned_reads` before a
domain fetches the step (fetch.py) and :meth:`StepReader.read_round` to read it (collective, foreground
group: the phases "opening step N", "comparing the keys of step N" and "verifying step N" through the
:class:`~.coordination.Coordinator`). :meth:`StepReader._open_step` reads the manifest and ``.metadata``,
makes the per-rank check and compares the state with the step (compat.py); :meth:`StepReader._load_step`
decides, plans against the live state and reads the byte ranges it needs, checking each item against the
manifest's xxh3: small items and plain values into a buffer, decoded before any live tensor is written,
then each large CPU tensor's bytes straight into that tensor (apply.py: :func:`~.apply.place_into`; what a
failed round leaves there is the Restorer's to handle, restore.py). What it read comes back as an
:class:`~.apply._Loaded` (apply.py), which the Restorer applies once every rank verified.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import logging
import os
import stat
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan

from ..errors import CheckpointError, CorruptCheckpointError, IncompatibleCheckpointError, StorageError
from ..manifest import (
    DCP_METADATA_NAME,
    MANIFEST_NAME,
    PARTIAL_SUFFIX,
    Manifest,
    partial_items,
    read_manifest_file,
    split_per_rank_fqn,
)
from ..paths import describe_path
from ..rundir import RunDir
from ..storage.fileio import (
    BLOCK,
    HostBuffer,
    ReadThrough,
    Ring,
    aligned_buffer,
    as_memoryview,
    read_spans,
    reading_step,
    round_up,
)
from . import compat as compat_mod
from . import state as state_mod
from .apply import (
    PLACE_MIN_BYTES,
    Placement,
    Placing,
    Touched,
    _Loaded,
    _merged,
    _on_cuda,
    held,
    live_tensors,
    place_into,
    shared_mappings,
    uncovered,
)
from .compat import CompatReport
from .coordination import Coordinator, Topology
from .ddp import DDP_KEY
from .fetch import DurableFetcher, Planned
from .planning import SafeLoadPlanner, load_value, read_metadata_file

log = logging.getLogger(__name__)

# Read buffers for state on a GPU are pageable by default: a fresh pinned buffer costs more to allocate
# (page-locking every page) than the faster copies save. Measured on an H200, cold restore of 1 GiB of
# model + Adam on the GPU (bench_restore.py --device cuda, docs/benchmarks.md).
PIN_FOR_CUDA = False
# The small items of a step are hundreds of ranges between the large tensors, each a request of its own: the
# disk's latency, not its bandwidth, is their limit, so this many times io_threads are kept in flight (16 with
# the default 4; 2-3 ms instead of 7-11 for the benchmark's 230 small items, docs/benchmarks.md).
SMALL_READS_PER_THREAD = 4


class StepReader:
    """Reads and verifies one step at a time on this rank, for the :class:`~.restore.Restorer` of the same
    rank. The Restorer sets :attr:`allow_missing`, :attr:`allow_unexpected`, :attr:`source_rank` and
    :attr:`rank_mapped` at the start of each restore; :attr:`compat` and :attr:`provenance` describe the
    step last read."""

    def __init__(self, topo: Topology, coord: Coordinator, run_id: str, run_dir: str, *, fetcher: DurableFetcher,
                 io_threads: int = 4, capture_rng: bool = True) -> None:
        self.topo = topo
        self.coord = coord
        self.run_id = run_id
        self.run_dir = run_dir
        self.fetcher = fetcher
        self.io_threads = io_threads
        self.capture_rng = capture_rng
        self.source_rank = topo.rank  # whose per-rank state this rank restores (rank_map)
        self.rank_mapped = False
        self.allow_missing: tuple[str, ...] = ()  # compat.py: fnmatch patterns of keys allowed to differ
        self.allow_unexpected: tuple[str, ...] = ()
        self.compat: CompatReport | None = None  # of the step last read on this rank
        self.provenance: Mapping[str, Any] | None = None
        # Large CPU tensors are read straight into the live state (apply.py: place_into); the Restorer turns
        # it off where a failed restore must leave the state as it was (restore_fallback=fresh).
        self.in_place = True
        # Live tensors a failed round wrote into (apply.py: Placing), kept across restores in this process
        # until a step that writes them all is applied; optimizers a restore initialized (their state is
        # cleared again if it starts them afresh): the Restorer sets them.
        self.touched: Touched = {}
        self.fresh_optimizers: frozenset[str] = frozenset()

    def _check_per_rank(self, step: int, step_dir: str, manifest: Manifest, md: Metadata,
                        state: Mapping[str, Any]) -> None:
        """Per-rank state is loaded from the rank that saved it: refuse a world-size change that leaves
        ranks without their state (or drops some), unless ``rank_map`` says which saved rank each resumes."""
        keys = sorted({split[1] for fqn in md.state_dict_metadata
                       if (split := split_per_rank_fqn(fqn)) is not None and split[1].split(".")[0] in state})
        if not keys:
            return
        saved, now = manifest.world_size, self.topo.world_size
        shown = ", ".join(repr(k) for k in keys[:8]) + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")
        if saved != now and not self.rank_mapped:
            raise IncompatibleCheckpointError(
                f"step {step} in {step_dir} holds per-rank state ({shown}: values that differed between ranks) "
                f"saved by {saved} ranks; this job has {now}. Pass rank_map= to restore() to say which saved rank "
                "each rank resumes (docs/integration.md), keep that state equal on every rank or in a DTensor so "
                "it reshards, or resume with the same number of ranks")
        if not 0 <= self.source_rank < saved:
            raise IncompatibleCheckpointError(
                f"rank_map maps rank {self.topo.rank} to rank {self.source_rank}, but step {step} in {step_dir} "
                f"was saved by ranks 0..{saved - 1} (per-rank state: {shown})")

    def _setup(self, step: int, where: str, manifest: Manifest, md: Metadata,
               state: MutableMapping[str, Any]) -> _Prepared:
        """This rank's load target and planner for ``step`` (``where``: the step's place, for messages), after
        the per-rank check, and its differences from the step (compat.py: :func:`~.compat.compare`)."""
        self._check_per_rank(step, where, manifest, md, state)
        target = state_mod.prepare_load_target(state, md, rank=self.topo.rank, capture_rng=self.capture_rng,
                                               source_rank=self.source_rank, extra_keys=(DDP_KEY,))
        planner = SafeLoadPlanner(self.source_rank)
        planner.set_up_planner(target, md, is_coordinator=self.topo.rank == 0)
        found = compat_mod.compare(planner, md, source_rank=self.source_rank)
        return _Prepared(step, where, manifest, md, target, planner, found)

    def _finish_plan(self, prep: _Prepared, state: MutableMapping[str, Any], unheld: frozenset[str]) -> LoadPlan:
        """The compatibility decision (``unheld``: saved keys no rank holds now; every difference in one error,
        before anything is read), then the DCP load plan. IncompatibleCheckpointError when the step does not
        fit the state."""
        self.compat = compat_mod.decide(
            prep.planner, prep.md, state, prep.found, unheld, allow_missing=self.allow_missing,
            allow_unexpected=self.allow_unexpected, where=f"step {prep.step} in {prep.where}",
            rank=self.topo.rank if self.topo.world_size > 1 else None)
        try:
            plan = prep.planner.create_local_plan()
        except (RuntimeError, ValueError, KeyError) as exc:
            raise IncompatibleCheckpointError(
                f"step {prep.step} in {prep.where} does not fit the state being restored: {exc}. Restore with the "
                "same model/optimizer structure, or move the run directory aside to start afresh."
            ) from exc
        return prep.planner.finish_plan(plan)

    def planned_reads(self, step: int, state: MutableMapping[str, Any], *, local: bool) -> Planned | None:
        """The items (file -> offsets and lengths) this rank's load plan for ``step`` reads, so that a domain
        fetching the step takes only those (a run resharded to another world size, or moved onto nodes that
        hold other ranks). Planned against the local copy's metadata when this domain has the step
        (``local``), else the durable tier's (:meth:`DurableFetcher.source`). Every rank plans, so every rank calls its state's
        ``state_dict()`` alike. None when it cannot be planned: the fetch then takes every file, and the
        read that follows says what is wrong."""
        try:
            if local:
                step_dir = RunDir.at(self.run_dir).step(step)
                manifest = read_manifest_file(os.path.join(step_dir, MANIFEST_NAME))
                md = read_metadata_file(os.path.join(step_dir, DCP_METADATA_NAME), manifest.dcp_metadata)
                where = step_dir
            else:
                source = self.fetcher.source(step)
                manifest, md = source.marker, source.md
                where = f"{self.fetcher.tier.url if self.fetcher.tier else 'the durable tier'}"
            # Planned on this rank alone: a saved key it does not hold is taken to be another rank's.
            plan = self._finish_plan(self._setup(step, where, manifest, md, state), state, frozenset())
        except Exception as exc:  # the fetch takes every file; the read reports the problem
            log.debug("step %d: no load plan before the fetch (%s); the fetch takes every file", step, exc)
            return None
        finally:
            self.compat = None
        reads: dict[str, set[tuple[int, int]]] = {}
        for ri in plan.items:
            info = md.storage_data[ri.storage_index]
            reads.setdefault(info.relative_path, set()).add((info.offset, info.length))
        return {path: frozenset(items) for path, items in reads.items()}

    def read_round(self, step: int, state: MutableMapping[str, Any]
                    ) -> tuple[list[tuple[str, str]], _Loaded | None]:
        """Read and verify ``step`` on every rank; every rank's verdict ``(status, message)`` and what this rank
        read: status "ok", "corrupt" (skip the step), "incompatible" (refuse it everywhere) or "mixed" (it verified,
        but it would leave a tensor a failed step was read into holding that step's bytes: refused everywhere,
        :meth:`left_mixed`). Collective
        (foreground group): three phases, the last one sharing the verdicts.

        Two parts around one exchange: every rank opens the step and compares it with its state
        (:meth:`_open_step`); the ranks share whether that worked and, where every rank has saved keys that
        it does not hold (pipeline stages, per-rank names), which of those no rank holds
        (compat.py: :meth:`~.compat.Findings.mask`, one all_reduce); then each decides and reads
        (:meth:`_load_step`). A rank reads nothing when another could not open the step."""
        # Only tensors an earlier round wrote can be left mixed: those this round writes, it writes whole.
        earlier = bool(self.touched)
        status, message, loaded = self._read_here(step, state)
        if status == "ok" and loaded is not None and earlier and (left := self.left_mixed(loaded, state)):
            shown = ", ".join(left[:8]) + (f" and {len(left) - 8} more" if len(left) > 8 else "")
            status, message = "mixed", (
                f"rank {self.topo.rank}: step {step} verified, but it does not hold {shown}, which a step that failed "
                "verification had already been read into; restoring it would leave them holding that step's bytes")
        verdicts = self.coord.phase(f"verifying step {step}", lambda: (status, message))
        return verdicts, loaded

    def left_mixed(self, loaded: _Loaded, state: Mapping[str, Any]) -> list[str]:
        """The keys of ``state``'s tensors a failed round wrote into that ``loaded`` does not write (an
        optimizer this restore initialized and that starts afresh is cleared again: not counted)."""
        fresh = set(self.fresh_optimizers) & set(self.compat.fresh if self.compat else ())
        touched = {r: k for r, k in held(self.touched, state).items() if k.split(".", 1)[0] not in fresh}
        return uncovered(touched, loaded.covers()) if touched else []

    def _read_here(self, step: int, state: MutableMapping[str, Any]) -> tuple[str, str, _Loaded | None]:
        """This rank's part of :meth:`read_round` (two phases inside): its verdict and what it read."""
        step_dir = RunDir.at(self.run_dir).step(step)
        # The program's large tensors are read through a ring of buffers (storage/fileio.py: Ring), faulted in on
        # a thread of its own while the step is opened and its reads planned (where the state already holds a
        # large tensor; else the first read makes it).
        ring = None
        if self.in_place and any(t.nelement() * t.element_size() >= PLACE_MIN_BYTES
                                 for t in live_tensors(state).values()):
            ring = Ring().warm()
        with contextlib.ExitStack() as held_open:
            if ring is not None:
                held_open.callback(ring.done)  # no slot is faulted in once this round's reads are over
            prep: _Prepared | None = None
            status, message = "ok", ""
            try:
                held_open.enter_context(reading_step(step_dir))
                prep = self._open_step(step, step_dir, state)
            except Exception as exc:
                status, message = self._verdict(step, step_dir, exc)
            mine = (status, prep.found.digest if prep else None, bool(prep and prep.found.candidates))
            opened = self.coord.phase(f"opening step {step}", lambda: mine)
            if prep is None:
                return status, message, None
            if any(o[0] != "ok" for o in opened):
                return "ok", "", None  # another rank could not open the step: its verdict decides
            if opened[0][1] != prep.found.digest:
                return ("corrupt", f"rank {self.topo.rank}: {step_dir}: its DCP metadata lists other keys than "
                        f"the copy rank 0 read (a damaged or foreign .metadata)", None)
            unheld: frozenset[str] = frozenset()
            if len({o[1] for o in opened}) == 1 and all(o[2] for o in opened):
                # Every rank has saved keys it does not hold: those no rank holds are unexpected.
                found = prep.found
                unheld = found.unheld(self.coord.phase_flags(f"comparing the keys of step {step}", found.mask,
                                                             len(found.keyspace)))
            try:
                return "ok", "", self._load_step(prep, state, unheld, ring)
            except Exception as exc:
                status, message = self._verdict(step, step_dir, exc)
                return status, message, None

    def _check_optimizer_params(self, prep: _Prepared, state: Mapping[str, Any], needed: dict[str, list[Any]],
                                decoded: dict[tuple[str, int], Any]) -> None:
        """An optimizer keyed by parameter index whose parameters moved since the step was saved (a model
        split differently) would load moments into other parameters: refused, or started afresh where
        ``allow_missing`` covers all of it (its items are then dropped from ``needed``)."""
        saved = next((decoded[(rel, info.offset)] for rel, reqs in needed.items() for ri, info in reqs
                      if _plain_key(ri.dest_index.fqn) == state_mod.OPTIM_PARAMS_KEY), None)
        report = self.compat
        if saved is None or report is None:
            return
        moved = state_mod.moved_parameters(state, saved, skip=report.fresh)
        refused = []
        for top, why in moved.items():
            mine = [k for k in prep.found.live if k.split(".", 1)[0] == top]
            if mine and all(compat_mod.matches(k, self.allow_missing) for k in mine):
                for rel in list(needed):
                    needed[rel] = [(ri, info) for ri, info in needed[rel]
                                   if _plain_key(ri.dest_index.fqn).split(".", 1)[0] != top]
                prep.target.pop(top, None)
                report = dataclasses.replace(report, fresh=(*report.fresh, top),
                                             kept=tuple(k for k in report.kept if k.split(".", 1)[0] != top))
            else:
                refused.append(
                    f"  optimizer {top!r} keys its state by parameter index, and its parameters moved since the step "
                    f"was saved ({why}): its moments would load into other parameters")
        self.compat = report
        if refused:
            raise IncompatibleCheckpointError("\n".join([
                f"step {prep.step} in {prep.where} does not fit the state being restored"
                f"{f' on rank {self.topo.rank}' if self.topo.world_size > 1 else ''}; nothing was loaded:", *refused,
                "A model split differently (another pipeline split, interleaved stages) needs the optimizer's state "
                "keyed by parameter name: put an object in the state whose state_dict()/load_state_dict() call "
                "torch.distributed.checkpoint.state_dict.get_optimizer_state_dict/set_optimizer_state_dict "
                "(docs/integration.md, Model parallelism). Else restore with the layout that saved the step, or "
                f"pass allow_missing=['{next(iter(moved))}.*'] to start the optimizer afresh."]))

    def _verdict(self, step: int, step_dir: str, exc: Exception) -> tuple[str, str]:
        if isinstance(exc, IncompatibleCheckpointError):
            return "incompatible", str(exc)
        if isinstance(exc, (CorruptCheckpointError, OSError, CheckpointError, StorageError)):
            return "corrupt", f"rank {self.topo.rank}: {exc}"
        # unexpected: every rank must still learn of it, or the others hang
        log.error("step %d: unexpected error while reading %s", step, step_dir, exc_info=exc)
        return "incompatible", f"rank {self.topo.rank}: reading step {step} failed: {exc!r}"

    def _open_step(self, step: int, step_dir: str, state: MutableMapping[str, Any]) -> _Prepared:
        """Manifest and DCP metadata of ``step`` in this rank's domain, and this rank's differences from it."""
        mpath = os.path.join(step_dir, MANIFEST_NAME)
        try:
            manifest = read_manifest_file(mpath)
        except FileNotFoundError as exc:
            raise CorruptCheckpointError(f"{mpath}: missing") from exc
        if manifest.step != step or manifest.run_id != self.run_id:
            raise CorruptCheckpointError(
                f"{mpath}: says run {manifest.run_id!r} step {manifest.step}, expected {self.run_id!r} step {step}"
            )
        self.provenance, self.compat = manifest.provenance, None
        md = read_metadata_file(os.path.join(step_dir, DCP_METADATA_NAME), manifest.dcp_metadata)
        return self._setup(step, step_dir, manifest, md, state)

    def _load_step(self, prep: _Prepared, state: MutableMapping[str, Any], unheld: frozenset[str],
                   ring: Ring | None) -> _Loaded:
        """Decide, plan and read every item this rank loads, each checked against the manifest's xxh3: first
        the small items and plain values into one buffer per file (decoded, and the optimizer's parameters
        checked, before a live tensor is written into), then each large CPU tensor straight into itself."""
        plan = self._finish_plan(prep, state, unheld)
        step_dir, manifest, md, target, planner = prep.where, prep.manifest, prep.md, prep.target, prep.planner
        shards = {s.path: s for s in manifest.shards_of_node(manifest.node)}
        # Files of other domains of which a resharded fetch took only the items this domain reads.
        partial = partial_items(manifest)
        entries = {s.path: s for s in manifest.shards if s.path in shards or s.path in partial}
        chunk_sums = {(s.path, c.offset): c for s in entries.values() for c in s.chunks}
        # Group what we need by file, then read each file's needed span once.
        needed: dict[str, list[Any]] = {}
        for ri in plan.items:
            info = md.storage_data[ri.storage_index]
            rel = info.relative_path
            if rel not in shards and (info.offset, info.length) not in partial.get(rel, ()):
                raise CorruptCheckpointError(
                    f"{step_dir}: {ri.storage_index.fqn} lives in {rel}, which is not stored on "
                    f"this node ({self.topo.domain}); it must come from another node or the durable tier"
                )
            needed.setdefault(rel, []).append((ri, info))
        # State on a GPU: the bytes are read into host buffers and copied to the device on a side stream
        # (_Loaded.apply). A large CPU tensor's bytes are read straight into it (apply.py: place_into).
        cuda = torch.cuda.is_available() and _on_cuda(target)
        placed: dict[tuple[str, int], Placement] = {}
        if self.in_place:
            # Taken now, after the load target was made: it made the moments of an optimizer not stepped yet.
            live, shared = live_tensors(state), shared_mappings()
            for rel, reqs in needed.items():
                for ri, info in reqs:
                    if (p := place_into(planner, md, ri, info.length, live, shared)) is not None:
                        placed[(rel, info.offset)] = p
        where: dict[tuple[str, int], tuple[torch.Tensor | HostBuffer, int]] = {}  # item -> (buffer, its bytes' offset)
        decoded: dict[tuple[str, int], Any] = {}
        paths: dict[str, str] = {}
        for rel, reqs in needed.items():
            path = paths[rel] = os.path.join(step_dir, rel if rel in shards else rel + PARTIAL_SUFFIX)
            entry = entries[rel]
            try:
                st = os.lstat(path)
            except FileNotFoundError as exc:
                raise CorruptCheckpointError(f"{path}: shard file missing") from exc
            if not stat.S_ISREG(st.st_mode):  # its size would be a directory's or a FIFO's, not the file's
                raise CorruptCheckpointError(f"{path} is {describe_path(path)}, not a regular file: the shard is "
                                             "damaged; remove it (and find out who made it)")
            if st.st_size != entry.size:
                raise CorruptCheckpointError(
                    f"{path}: size {st.st_size} bytes, manifest says {entry.size} (truncated or overwritten)"
                )
            for _, info in reqs:
                c = chunk_sums.get((rel, info.offset))
                if c is None or c.length != info.length:
                    raise CorruptCheckpointError(f"{path}: no checksum recorded for bytes {info.offset}+{info.length}")
        with contextlib.ExitStack() as reading:
            # The first file's large reads are queued now, into the ring (as many as it has slots), while the small
            # items are read and checked: the disk is otherwise idle until then. Only reads: no live tensor is
            # written before the checks below pass (ReadThrough.finish does that).
            ahead = next(((rel, m) for rel in needed if (m := self._in_place(rel, needed, placed))), None)
            early: ReadThrough | None = None
            if ahead is not None:
                ring = ring or Ring()
                early = reading.enter_context(self._reads_of(paths[ahead[0]], entries[ahead[0]].size, ahead[1], ring))
                early.start()
            # Then what is not read in place, before a live tensor is written into: one buffer per file at the
            # file's own offsets (pages it never reads cost nothing), every item verified, every plain value
            # decoded, and the optimizer's parameters checked.
            for rel, reqs in needed.items():
                rest = [(ri, info) for ri, info in reqs if (rel, info.offset) not in placed]
                if rest:
                    self._read_small(paths[rel], entries[rel].size, rest, rel, chunk_sums, where, decoded,
                                     pin=cuda and PIN_FOR_CUDA)
            kept = {(rel, info.offset) for rel, reqs in needed.items() for _, info in reqs}
            self._check_optimizer_params(prep, state, needed, decoded)
            # An optimizer started afresh (allow_missing) keeps its own tensors: its items dropped from `needed`
            # are not read into them.
            for key in kept - {(rel, info.offset) for rel, reqs in needed.items() for _, info in reqs}:
                placed.pop(key, None)
            if early is not None and ahead is not None and self._in_place(ahead[0], needed, placed) != ahead[1]:
                # Items dropped since (an optimizer started afresh): its file is read again for what is left, and
                # the reads queued ahead give their slots back first (another read of the ring would wait for them).
                early.close()
                early = None
            # Then the large tensors, straight into the live ones (checked against the manifest as they arrive;
            # a round that fails after this leaves them written: the Restorer's rule, restore.py).
            for rel in list(needed):
                mine = self._in_place(rel, needed, placed)
                if not mine:
                    continue
                reads = early if early is not None and ahead is not None and rel == ahead[0] else None
                if reads is None:
                    ring = ring or Ring()
                    reads = reading.enter_context(self._reads_of(paths[rel], entries[rel].size, mine, ring))
                sums = reads.finish(Placing([placed[(rel, info.offset)] for _, info in mine], self.touched))
                for (ri, info), got in zip(mine, sums):
                    self._check_sum(paths[rel], ri, info, got, chunk_sums[(rel, info.offset)].checksum)
        read = sum(info.length for reqs in needed.values() for _, info in reqs)
        in_place = sum(p.nbytes for rel, reqs in needed.items() for _, info in reqs
                       if (p := placed.get((rel, info.offset))) is not None and p.foreign is None)
        return _Loaded(planner=planner, target=target, md=md, needed=needed, where=where, placed=placed, cuda=cuda,
                       decoded=decoded, bytes_read=read, placed_bytes=in_place)

    @staticmethod
    def _in_place(rel: str, needed: dict[str, list[Any]], placed: dict[tuple[str, int], Placement]) -> list[Any]:
        """The items of file ``rel`` read straight into the live tensors (in the order of ``needed``)."""
        return [(ri, info) for ri, info in needed[rel] if (rel, info.offset) in placed]

    def _reads_of(self, path: str, size: int, mine: list[Any], ring: Ring) -> ReadThrough:
        """The ring read of items ``mine`` of file ``path`` (storage/fileio.py: ReadThrough)."""
        return ReadThrough(path, size, [(info.offset, info.length) for _, info in mine], threads=self.io_threads,
                           ring=ring)

    def _read_small(self, path: str, size: int, rest: list[Any], rel: str, chunk_sums: Mapping[Any, Any],
                    where: dict[tuple[str, int], tuple[torch.Tensor | HostBuffer, int]], decoded: dict[tuple[str, int], Any],
                    *, pin: bool) -> None:
        """Read items ``rest`` of file ``path`` into one buffer at the file's own offsets, each checked against
        the manifest, plain values decoded (``where`` and ``decoded`` take them)."""
        regions = _merged([(info.offset // BLOCK * BLOCK, round_up(info.offset + info.length)) for _, info in rest])
        # Pinned memory is all allocated and locked: only for CUDA, and off by default (PIN_FOR_CUDA). Else plain
        # memory, no torch tensor unless apply needs one (fileio.HostBuffer).
        buf: torch.Tensor | HostBuffer
        if pin:
            buf = aligned_buffer(regions[-1][1], prefault=False, pin=True)
            mv = as_memoryview(buf)
        else:
            buf = HostBuffer(regions[-1][1])
            mv = buf.view
        ranges = []
        for _, info in rest:
            where[(rel, info.offset)] = (buf, info.offset)
            k = bisect.bisect_right(regions, (info.offset, 1 << 62)) - 1
            ranges.append((k, info.offset - regions[k][0], info.length))
        sums = read_spans(path, [(a, mv[a:b]) for a, b in regions], size,
                          threads=self.io_threads * SMALL_READS_PER_THREAD, ranges=ranges)
        for (ri, info), got in zip(rest, sums):
            self._check_sum(path, ri, info, got, chunk_sums[(rel, info.offset)].checksum)
            if ri.type == LoadItemType.BYTE_IO:
                # Decode plain values now, before anything live is touched: a value the safe loader
                # refuses makes the step unusable; it must not half-restore the state.
                try:
                    decoded[(rel, info.offset)] = load_value(bytes(mv[info.offset : info.offset + info.length]))
                except Exception as exc:
                    last = str(exc).strip().splitlines()[-1] if str(exc).strip() else ""
                    raise CorruptCheckpointError(
                        f"{path}: value {ri.storage_index.fqn} cannot be loaded safely ({type(exc).__name__}: {last})"
                    ) from exc

    @staticmethod
    def _check_sum(path: str, ri: Any, info: Any, got: str, want: str) -> None:
        if got != want:
            raise CorruptCheckpointError(
                f"{path}: checksum mismatch in {ri.storage_index.fqn} (bytes {info.offset}+{info.length}): "
                "the file is corrupt")


@dataclass(frozen=True)
class _Prepared:
    """A step opened on this rank: its manifest and metadata, the load target and planner, its differences."""

    step: int
    where: str  # the step's directory (or the durable tier), for messages
    manifest: Manifest
    md: Metadata
    target: dict[str, Any]
    planner: SafeLoadPlanner
    found: compat_mod.Findings


def _plain_key(fqn: str) -> str:
    """A key as the state names it (a per-rank copy's key without its prefix)."""
    split = split_per_rank_fqn(fqn)
    return split[1] if split is not None else fqn


__all__ = ["PIN_FOR_CUDA", "StepReader"]
