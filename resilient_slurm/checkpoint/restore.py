"""Restore: the newest step every rank can read and verify, loaded in place only once all ranks verified.

Who calls what: :meth:`Engine.restore <resilient_slurm.checkpoint.engine.Engine.restore>` delegates to
the engine's :class:`Restorer`, built with the engine's collaborators: the topology and coordinator, the
run directory, the engine itself as :class:`LocalSteps` (its retention methods list committed steps and
remove abandoned temp directories), the engine's :class:`~resilient_slurm.checkpoint.ddp.DDPTracker` and
a :class:`~resilient_slurm.checkpoint.fetch.DurableFetcher` (fetch.py) for the durable tier.

Call order of :meth:`Restorer.restore` (collective, foreground group, every rank):

1. domain leaders remove abandoned temp directories and list the steps committed in their domain; rank 0
   lists the durable tier (:meth:`DurableFetcher.steps`); one all_gather shares both (and a failing
   ``rank_map``). Candidates are the steps committed in every domain and the durable steps, newest first.
2. for each candidate: a domain that lacks it fetches its part (:meth:`DurableFetcher.fetch_round`,
   collective): every rank first makes its load plan (:meth:`Restorer._planned_reads`, against the
   durable metadata when its domain lacks the step) and the leader fetches the items its ranks' plans
   read (fetch.py: a file whole when they read most of it, else only those items); then every rank
   reads and verifies what it needs (:meth:`Restorer._read_round`, collective: :meth:`Restorer._open_step`
   reads the manifest and ``.metadata``, makes the per-rank check and compares the state with the step
   (compat.py); one all_gather says whether every rank could, and where every rank has saved keys it does
   not hold (pipeline stages), one all_reduce finds those no rank holds; then :meth:`Restorer._load_step`
   decides (every missing, unexpected and reshaped key of this rank in one error), makes a DCP load plan
   against the live state, reads the byte ranges it needs into fresh buffers and checks them item by item
   against the manifest's xxh3, plain values decoded with ``weights_only=True``) *before touching any live
   tensor*, under a shared lock on the step so retention cannot delete it; an all_gather of the verdicts
   follows.
   A copy that failed verification is fetched again from the durable tier when the step is there, and
   every rank reads again.
3. an incompatibility anywhere (missing key, shape, per-rank state at another world size without
   ``rank_map``) raises on every rank, each with its own differences and the ranks refused named; corruption anywhere skips the step on every rank, with a warning
   naming the file and the reason; only when every rank verified does each copy into its live state
   (:meth:`_Loaded.apply`, then ``state.apply_loaded``) and hand DDP's recorded layout to the tracker.
4. nothing restored although checkpoints exist (or the durable tier could not be read): every rank raises
   (:meth:`Restorer._no_restore`) unless ``restore_fallback`` is ``fresh``.

What the restore did is kept in :attr:`Restorer.last_restore` (:class:`RestoreOutcome`) for the caller's
event log; nothing here writes events.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import io
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan

from ..errors import (
    CheckpointError,
    ConfigError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    RestoreUnavailableError,
)
from ..manifest import (
    DCP_METADATA_NAME,
    MANIFEST_NAME,
    PARTIAL_SUFFIX,
    Manifest,
    partial_items,
    read_manifest_file,
    split_per_rank_fqn,
)
from ..rundir import RunDir
from ..storage.fileio import BLOCK, aligned_buffer, as_memoryview, read_spans, reading_step, round_up
from . import compat as compat_mod
from . import state as state_mod
from .compat import CompatReport
from .coordination import Coordinator, Topology
from .ddp import DDP_KEY, DDPTracker
from .fetch import DurableFetcher, Planned
from .peers import Held, PeerReplicas, peer_sources
from .planning import SafeLoadPlanner, read_metadata_file
from .staging import framing_for

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RestoreOutcome:
    """What :meth:`Restorer.restore` (``Engine.restore``) did on this rank (for the event log)."""

    step: int  # 0: nothing restored
    tier: str | None  # "local"; "peer" or "durable" when this rank's domain copied the step from a partner's
    # replica or fetched it from the durable tier; None: nothing restored
    seconds: float
    bytes_read: int  # bytes this rank read and verified
    fetched_bytes: int  # bytes this rank fetched from the durable tier (domain leaders only)
    skipped: tuple[int, ...] = ()  # steps tried and found unusable
    provenance: Mapping[str, Any] | None = None  # the restored step's manifest provenance (provenance.py)
    compat: CompatReport | None = None  # what the restore left out on purpose (allow_missing/allow_unexpected)
    adopted_bytes: int = 0  # bytes that became live tensors' memory without a copy (_Loaded.apply)
    peer_bytes: int = 0  # bytes this rank's domain received from a partner's replica (domain leaders only)


class LocalSteps(Protocol):
    """The node-local tier's listing and clean-up, as the engine's retention does them."""

    def committed_steps(self) -> list[int]: ...

    def clean_stale(self, *, spare_current: bool) -> None: ...


class Restorer:
    """Restore for one run from the node-local tier, fetching from the durable tier where needed. One per
    rank, built by the :class:`~.engine.Engine`."""

    def __init__(
        self,
        topo: Topology,
        coord: Coordinator,
        run_id: str,
        run_dir: str,
        *,
        local: LocalSteps,
        fetcher: DurableFetcher,
        ddp: DDPTracker,
        io_threads: int = 4,
        capture_rng: bool = True,
        restore_fallback: str = "fail",
        peers: PeerReplicas | None = None,
    ) -> None:
        self.topo = topo
        self.peers = peers
        self.coord = coord
        self.run_id = run_id
        self.run_dir = run_dir
        self.local = local
        self.fetcher = fetcher
        self.ddp = ddp
        self.io_threads = io_threads
        self.capture_rng = capture_rng
        self.restore_fallback = restore_fallback  # fail | fresh: when checkpoints exist but none restores
        self._source_rank = topo.rank  # whose per-rank state this rank restores (rank_map)
        self._rank_mapped = False
        self.last_restore: RestoreOutcome | None = None
        self.allow_missing: tuple[str, ...] = ()  # compat.py: fnmatch patterns of keys allowed to differ
        self.allow_unexpected: tuple[str, ...] = ()
        self._compat: CompatReport | None = None  # of the step last read on this rank
        self._provenance: Mapping[str, Any] | None = None

    def restore(self, state: MutableMapping[str, Any], rank_map: Callable[[int], int] | None = None, *,
                allow_missing: tuple[str, ...] = (), allow_unexpected: tuple[str, ...] = ()) -> int:
        """Restore the newest step that every rank can read and verify; return it (0 if none).

        Collective (foreground group). Candidates are the steps committed in every domain's local tier
        and the steps committed in the durable tier, newest first. A domain that lacks a candidate, or
        whose copy fails verification, fetches its part from the durable tier into its local tier
        (verified, then committed there) and the ranks read again. Corrupt steps are skipped with a
        warning; an incompatible checkpoint (missing key, shape mismatch, newer schema, per-rank state
        saved at another world size without ``rank_map``) raises on every rank. ``rank_map(rank)`` names
        the saved rank whose per-rank state and RNG state this rank loads. Every key that does not fit is
        listed in one error (compat.py) unless ``allow_missing`` / ``allow_unexpected`` patterns allow it.
        """
        topo = self.topo
        self.allow_missing, self.allow_unexpected = allow_missing, allow_unexpected
        tier = self.fetcher.tier
        self._source_rank = topo.rank
        self._rank_mapped = rank_map is not None
        t0 = time.perf_counter()
        self.last_restore = None
        skipped: list[int] = []

        def listing() -> _Listing:
            """This rank's part of the candidates: its domain's committed steps (leaders), the durable tier's
            (rank 0), the partners' replicas it holds, and which save each local step is."""
            if rank_map is not None:
                try:
                    self._source_rank = int(rank_map(topo.rank))
                except Exception as exc:
                    raise ConfigError(f"rank_map({topo.rank}) failed: {exc!r}") from exc
            if topo.is_leader:
                self.local.clean_stale(spare_current=False)
            mine = self.local.committed_steps() if topo.is_leader else None
            durable, listing_error = self.fetcher.steps() if topo.rank == 0 and tier is not None else (None, None)
            held = self.peers.held() if topo.is_leader and self.peers is not None else []
            return _Listing(mine, durable, listing_error, tuple(held), self._saved_at(mine) if topo.is_leader else {})

        gathered = self.coord.phase("listing the committed steps", listing)
        lists: list[list[int]] = [g.committed or [] for g in gathered]
        durable_set = set(gathered[0].durable or [])
        listing_error = gathered[0].durable_error
        unreachable: list[str] = [listing_error] if listing_error else []  # storage failures, not corruption
        leaders = [r for r in range(topo.world_size) if gathered[r].committed is not None]
        common = set.intersection(*[set(lists[r]) for r in leaders]) if leaders else set()
        union = set().union(*[set(lists[r]) for r in leaders]) if leaders else set()
        replicas = {r: list(gathered[r].held) for r in leaders if gathered[r].held}

        def stamps_of(step: int) -> set[float]:
            """The saves (created_at) of the domains' own copies of ``step`` whose manifests read."""
            return {gathered[r].saved_at[step] for r in leaders if step in gathered[r].saved_at}

        # One step number committed by two different saves in different domains (a run that went back to an
        # older step and saved this one again where only some domains committed it, or were fetched into)
        # would restore a mix of both: never a candidate.
        mixed = {s for s in union if len(stamps_of(s)) > 1}
        if mixed and topo.rank == 0:
            log.warning("steps %s were committed by different saves in different storage domains; they are not "
                        "restored (the previous step is tried)", sorted(mixed))

        def lacking_in(step: int) -> list[int]:
            return [r for r in leaders if step not in set(lists[r])]

        def sources(step: int) -> dict[int, tuple[int, str]]:
            return peer_sources(step, lacking_in(step), replicas, topo, sorted(stamps_of(step))) if replicas else {}

        # Steps every domain has, locally or as a partner's replica of exactly its ranks.
        from_peers = {s for s in (union | {h.step for hs in replicas.values() for h in hs}) - common
                      if len(sources(s)) == len(lacking_in(s))}
        if union - common - durable_set - from_peers and topo.rank == 0:
            lacking = {
                topo.domain_of_rank[r]: sorted(union - set(lists[r])) for r in leaders if union - set(lists[r])
            }
            log.warning(
                "steps %s are committed in some storage domains but missing in others (%s)%s",
                sorted(union - common - durable_set - from_peers),
                ", ".join(f"{d} lacks {s}" for d, s in lacking.items()),
                "" if tier is not None else "; they cannot be restored without a durable tier",
            )
        initialized = [
            v for v in state.values() if isinstance(v, torch.optim.Optimizer) and not v.state
        ]
        try:
            for step in sorted((common | durable_set | from_peers) - mixed, reverse=True):
                fetched = False
                here: int | None = None  # bytes this rank's domain fetched for this step (None: none)
                peer: int | None = None  # bytes it received from a partner's replica (None: none)
                if step not in common:
                    # Some domains lack it locally: each takes it from a partner's replica when one holds
                    # it (peers.py), the others from the durable tier, only the items their ranks'
                    # load plans read.
                    missing = lacking_in(step)
                    pairs = sources(step) if self.peers is not None else {}
                    if pairs:
                        assert self.peers is not None
                        got, peer = self.peers.restore_round(self.coord, step, pairs)
                        missing = [r for r in missing if r not in got]
                    if missing and step not in durable_set:
                        skipped.append(step)
                        continue
                    if missing:
                        lacks = topo.domain_ranks[0] in missing
                        need = topo.is_leader and lacks
                        planned = self._planned_reads(step, state, local=not lacks)
                        ok, here = self.fetcher.fetch_round(step, need, unreachable, planned,
                                                            save_of=next(iter(stamps_of(step)), None))
                        if not ok:
                            skipped.append(step)
                            continue
                        fetched = need
                verdicts, loaded = self._read_round(step, state)
                if not any(s == "incompatible" for s, _ in verdicts) and step in durable_set:
                    bad_here = any(verdicts[r][0] != "ok" for r in topo.domain_ranks)
                    if any(v != "ok" for v, _ in verdicts):
                        # A local copy failed verification: the domains concerned fetch the step again
                        # from the durable tier, then every rank reads again.
                        if topo.rank == 0:
                            for m in (m for v, m in verdicts if v != "ok"):
                                log.warning("step %d: %s; fetching it from the durable tier", step, m)
                        need = topo.is_leader and bad_here and not fetched
                        planned = self._planned_reads(step, state, local=not bad_here)
                        ok, again = self.fetcher.fetch_round(step, need, unreachable, planned,
                                                             save_of=next(iter(stamps_of(step)), None))
                        if again is not None:
                            here = (here or 0) + again
                        if ok:
                            verdicts, loaded = self._read_round(step, state)
                refused = [r for r, (s, _) in enumerate(verdicts) if s == "incompatible"]
                if refused:
                    raise IncompatibleCheckpointError(_refusal(topo.rank, refused, verdicts))
                bad = [m for s, m in verdicts if s != "ok"]
                if bad:
                    if topo.rank == 0:
                        for m in bad:
                            log.warning("skipping step %d: %s; trying the previous step", step, m)
                    skipped.append(step)
                    continue
                assert loaded is not None
                loaded.apply()
                state_mod.apply_loaded(state, loaded.target, rank=self._source_rank)
                self.ddp.expect(state, loaded.target.get(DDP_KEY))
                report = self._compat
                # An optimizer that starts afresh (compat.py) gives back the state restore initialized.
                initialized = [v for k, v in state.items() if report and k in report.fresh and v in initialized]
                if report and topo.rank == 0:
                    _log_compat(step, report)
                tier_used = "durable" if here is not None else "peer" if peer is not None else "local"
                log.info("restored step %d from %s%s", step, self.run_dir,
                         {"durable": " (fetched from the durable tier)", "peer": " (copied from a partner's replica)",
                          "local": ""}[tier_used])
                self.last_restore = RestoreOutcome(
                    step, tier_used, time.perf_counter() - t0, loaded.bytes_read,
                    (here or 0) if topo.is_leader else 0, tuple(skipped), self._provenance, report,
                    loaded.adopted_bytes, (peer or 0) if topo.is_leader else 0)
                return step
        finally:
            for opt in initialized:  # nothing restored: give back a pristine optimizer
                opt.state.clear()
        where = self.run_dir + (f" or {tier.url}" if tier is not None else "")
        self.last_restore = RestoreOutcome(0, None, time.perf_counter() - t0, 0, 0, tuple(skipped))
        if unreachable or union or durable_set:
            self._no_restore(where, sorted(union | durable_set), unreachable)
        return 0

    def _saved_at(self, steps: list[int] | None) -> dict[int, float]:
        """Leader: the ``created_at`` of each local committed step whose manifest reads (which save it is:
        a partner's replica of the same step number must be of the same save, peers.py)."""
        out: dict[int, float] = {}
        for s in steps or []:
            try:
                out[s] = read_manifest_file(RunDir.at(self.run_dir).manifest(s)).created_at
            except Exception:  # unreadable here: the read that follows skips the step with the reason
                continue
        return out

    def _no_restore(self, where: str, steps: list[int], unreachable: list[str]) -> None:
        """Checkpoints exist (or may: the durable tier could not be listed or read) and none was restored.
        Starting from step 0 would silently throw a run away, so this raises on every rank unless
        ``restore_fallback`` is ``fresh``: RestoreUnavailableError (worth a requeue: storage may come back)
        when a storage failure was involved, else CorruptCheckpointError (a person must look)."""
        what = (f"committed steps {steps} exist in {where} but none could be restored" if steps
                else f"no checkpoint could be found in {where}")
        if unreachable:
            what += " because the durable tier failed (" + "; ".join(dict.fromkeys(unreachable)) + ")"
        if self.restore_fallback == "fresh":
            if self.topo.rank == 0:
                log.warning("%s; starting from step 0 (restore_fallback=fresh)", what)
            return
        msg = (f"{what}. Not starting over from step 0: fix the cause and run again, or set restore_fallback=fresh "
               "(RSLURM_RESTORE_FALLBACK) to start from step 0 anyway")
        if unreachable:
            raise RestoreUnavailableError(msg)
        raise CorruptCheckpointError(msg + "; `rslurm verify` names what is wrong with each step")


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
        if saved != now and not self._rank_mapped:
            raise IncompatibleCheckpointError(
                f"step {step} in {step_dir} holds per-rank state ({shown}: values that differed between ranks) "
                f"saved by {saved} ranks; this job has {now}. Pass rank_map= to restore() to say which saved rank "
                "each rank resumes (docs/integration.md), keep that state equal on every rank or in a DTensor so "
                "it reshards, or resume with the same number of ranks")
        if not 0 <= self._source_rank < saved:
            raise IncompatibleCheckpointError(
                f"rank_map maps rank {self.topo.rank} to rank {self._source_rank}, but step {step} in {step_dir} "
                f"was saved by ranks 0..{saved - 1} (per-rank state: {shown})")

    def _setup(self, step: int, where: str, manifest: Manifest, md: Metadata,
               state: MutableMapping[str, Any]) -> _Prepared:
        """This rank's load target and planner for ``step`` (``where``: the step's place, for messages), after
        the per-rank check, and its differences from the step (compat.py: :func:`~.compat.compare`)."""
        self._check_per_rank(step, where, manifest, md, state)
        target = state_mod.prepare_load_target(state, md, rank=self.topo.rank, capture_rng=self.capture_rng,
                                               source_rank=self._source_rank, extra_keys=(DDP_KEY,))
        planner = SafeLoadPlanner(self._source_rank)
        planner.set_up_planner(target, md, is_coordinator=self.topo.rank == 0)
        found = compat_mod.compare(planner, md, source_rank=self._source_rank)
        return _Prepared(step, where, manifest, md, target, planner, found)

    def _finish_plan(self, prep: _Prepared, state: MutableMapping[str, Any], unheld: frozenset[str]) -> LoadPlan:
        """The compatibility decision (``unheld``: saved keys no rank holds now; every difference in one error,
        before anything is read), then the DCP load plan. IncompatibleCheckpointError when the step does not
        fit the state."""
        self._compat = compat_mod.decide(
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

    def _planned_reads(self, step: int, state: MutableMapping[str, Any], *, local: bool) -> Planned | None:
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
            self._compat = None
        reads: dict[str, set[tuple[int, int]]] = {}
        for ri in plan.items:
            info = md.storage_data[ri.storage_index]
            reads.setdefault(info.relative_path, set()).add((info.offset, info.length))
        return {path: frozenset(items) for path, items in reads.items()}

    def _read_round(self, step: int, state: MutableMapping[str, Any]
                    ) -> tuple[list[tuple[str, str]], _Loaded | None]:
        """Read and verify ``step`` on every rank; every rank's verdict ``(status, message)`` and what this rank
        read: status "ok", "corrupt" (skip the step) or "incompatible" (refuse it everywhere). Collective
        (foreground group): three phases, the last one sharing the verdicts.

        Two parts around one exchange: every rank opens the step and compares it with its state
        (:meth:`_open_step`); the ranks share whether that worked and, where every rank has saved keys that
        it does not hold (pipeline stages, per-rank names), which of those no rank holds
        (compat.py: :meth:`~.compat.Findings.mask`, one all_reduce); then each decides and reads
        (:meth:`_load_step`). A rank reads nothing when another could not open the step."""
        status, message, loaded = self._read_here(step, state)
        verdicts = self.coord.phase(f"verifying step {step}", lambda: (status, message))
        return verdicts, loaded

    def _read_here(self, step: int, state: MutableMapping[str, Any]) -> tuple[str, str, _Loaded | None]:
        """This rank's part of :meth:`_read_round` (two phases inside): its verdict and what it read."""
        step_dir = RunDir.at(self.run_dir).step(step)
        with contextlib.ExitStack() as held_open:
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
                return "ok", "", self._load_step(prep, state, unheld)
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
        report = self._compat
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
        self._compat = report
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
        if isinstance(exc, (CorruptCheckpointError, OSError, CheckpointError)):
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
        self._provenance, self._compat = manifest.provenance, None
        md = read_metadata_file(os.path.join(step_dir, DCP_METADATA_NAME), manifest.dcp_metadata)
        return self._setup(step, step_dir, manifest, md, state)

    def _load_step(self, prep: _Prepared, state: MutableMapping[str, Any], unheld: frozenset[str]) -> _Loaded:
        """Decide, plan and read every item this rank loads into fresh buffers, checked against the manifest."""
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
        owners = _Owners(state, planner)
        # State on a GPU: the bytes are read into pinned memory, so that the copies to the device are DMA
        # transfers queued on a side stream (_Loaded.apply), not synchronous copies from pageable memory.
        cuda = torch.cuda.is_available() and _on_cuda(target)
        where: dict[tuple[str, int], tuple[torch.Tensor, int]] = {}  # item -> (buffer, offset of its bytes)
        adopt: dict[tuple[str, int], torch.Tensor] = {}  # item -> the live tensor its buffer may become
        decoded: dict[tuple[str, int], Any] = {}
        for rel, reqs in needed.items():
            path = os.path.join(step_dir, rel if rel in shards else rel + PARTIAL_SUFFIX)
            entry = entries[rel]
            try:
                st = os.stat(path)
            except FileNotFoundError as exc:
                raise CorruptCheckpointError(f"{path}: shard file missing") from exc
            if st.st_size != entry.size:
                raise CorruptCheckpointError(
                    f"{path}: size {st.st_size} bytes, manifest says {entry.size} (truncated or overwritten)"
                )
            for _, info in reqs:
                c = chunk_sums.get((rel, info.offset))
                if c is None or c.length != info.length:
                    raise CorruptCheckpointError(f"{path}: no checksum recorded for bytes {info.offset}+{info.length}")
            # A large tensor that its owner can take over is read into a buffer of its own; the rest shares
            # one buffer at the file's own offsets (pages it never reads cost nothing).
            spans: list[tuple[int, memoryview]] = []
            ranges: dict[int, tuple[int, int, int]] = {}  # item offset -> (span, offset in span, length)
            shared: list[tuple[int, int]] = []
            for ri, info in reqs:
                live = owners.adoptable(planner, md, ri, info.length)
                lo = info.offset // BLOCK * BLOCK
                if live is None:
                    shared.append((lo, round_up(info.offset + info.length)))
                    continue
                own = aligned_buffer(round_up(info.offset + info.length) - lo, prefault=False)
                where[(rel, info.offset)] = (own, info.offset - lo)
                adopt[(rel, info.offset)] = live
                ranges[info.offset] = (len(spans), info.offset - lo, info.length)
                spans.append((lo, as_memoryview(own)))
            if shared:
                regions = _merged(shared)
                # Pages it never reads cost nothing (pinned memory is all allocated and locked: only for CUDA).
                buf = aligned_buffer(regions[-1][1], prefault=False, pin=cuda and PIN_FOR_CUDA)
                mv = as_memoryview(buf)
                first = len(spans)
                spans.extend((a, mv[a:b]) for a, b in regions)
                for _, info in reqs:
                    if (rel, info.offset) in where:
                        continue
                    where[(rel, info.offset)] = (buf, info.offset)
                    k = bisect.bisect_right(regions, (info.offset, 1 << 62)) - 1
                    ranges[info.offset] = (first + k, info.offset - regions[k][0], info.length)
            sums = read_spans(path, spans, entry.size, threads=self.io_threads,
                              ranges=[ranges[info.offset] for _, info in reqs])
            for (ri, info), got in zip(reqs, sums):
                if got != chunk_sums[(rel, info.offset)].checksum:
                    raise CorruptCheckpointError(
                        f"{path}: checksum mismatch in {ri.storage_index.fqn} (bytes {info.offset}+{info.length}): "
                        "the file is corrupt"
                    )
                if ri.type == LoadItemType.BYTE_IO:
                    # Decode plain values now, before anything live is touched: a value the safe loader
                    # refuses makes the step unusable; it must not half-restore the state.
                    b, at = where[(rel, info.offset)]
                    try:
                        decoded[(rel, info.offset)] = torch.load(
                            io.BytesIO(bytes(as_memoryview(b)[at : at + info.length])),
                            map_location="cpu",
                            weights_only=True,
                        )
                    except Exception as exc:
                        last = str(exc).strip().splitlines()[-1] if str(exc).strip() else ""
                        raise CorruptCheckpointError(
                            f"{path}: value {ri.storage_index.fqn} cannot be loaded safely ({type(exc).__name__}: {last})"
                        ) from exc
        self._check_optimizer_params(prep, state, needed, decoded)
        read = sum(info.length for reqs in needed.values() for _, info in reqs)
        return _Loaded(planner=planner, target=target, md=md, needed=needed, where=where, adopt=adopt, cuda=cuda,
                       decoded=decoded, bytes_read=read)




@dataclass(frozen=True)
class _Listing:
    """One rank's part of a restore's candidates (:meth:`Restorer.restore`, its first phase)."""

    committed: list[int] | None  # the steps committed in its domain (leaders; None elsewhere)
    durable: list[int] | None  # the steps committed in the durable tier (rank 0; None elsewhere)
    durable_error: str | None  # why the durable tier could not be listed (rank 0)
    held: tuple[Held, ...]  # partners' replicas its node holds (leaders)
    saved_at: dict[int, float]  # which save each committed step is: its manifest's created_at (leaders)


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


def _refusal(rank: int, refused: list[int], verdicts: list[tuple[str, str]]) -> str:
    """The error of a step refused on ``refused`` ranks, as rank ``rank`` raises it: its own differences (each
    rank lists its own), or those of the first refusing rank."""
    others = [r for r in refused if r != rank]
    also = f"ranks {others}" if len(others) > 1 else f"rank {others[0]}" if others else ""
    if rank in refused:
        return verdicts[rank][1] + (f"\n(The step does not fit on {also} either: each rank's error lists its own "
                                    "differences.)" if others else "")
    first = refused[0]
    return (f"this rank's state fits, but not rank {first}'s" + (f" (nor those of {len(refused) - 1} more)"
                                                                  if len(refused) > 1 else "")
            + f"; rank {first}: {verdicts[first][1]}")


def _log_compat(step: int, report: CompatReport) -> None:
    """Rank 0: what a compatible restore left out on purpose, and the dtypes it converted."""
    def shown(keys: tuple[str, ...]) -> str:
        return ", ".join(keys[:20]) + (f" and {len(keys) - 20} more" if len(keys) > 20 else "")

    if report.kept:
        log.warning("step %d: kept the state's current values for %s (allow_missing)", step, shown(report.kept))
    if report.ignored:
        log.warning("step %d: did not load %s (allow_unexpected)", step, shown(report.ignored))
    for top in report.fresh:
        log.warning("step %d: optimizer %r starts afresh: its parameters changed (allow_missing)", step, top)
    if report.converted:
        log.info("step %d: converted %s to the state's dtype", step, shown(report.converted))


# Read buffers for state on a GPU are pageable by default: a fresh pinned buffer costs more to allocate
# (page-locking every page) than the faster copies save. Measured on an H200, cold restore of 1 GiB of
# model + Adam on the GPU (bench_restore.py --device cuda, docs/benchmarks.md).
PIN_FOR_CUDA = False

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



__all__ = ["LocalSteps", "RestoreOutcome", "Restorer"]
