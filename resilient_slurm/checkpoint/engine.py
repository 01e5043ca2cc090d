"""The save/restore engine over one node-local tier: staging, background write, commit, retention;
restore delegated to restore.py (and the durable fetch to fetch.py).

Call order for a save (every rank, same order):

1. training thread: :meth:`Engine.stage` -- builds (or reuses) the DCP plan, proves which items held by
   several ranks are replicas (replication.py: digests compared in one all_reduce; items replicated by
   construction checked a slice per save), copies tensors into the staging buffer (the stall),
   serializes plain values. Collective on the foreground group: one all_reduce per save, plus a gather
   when any rank's plan changed and when a replica mismatch is found.
2. writer thread: :meth:`Engine.write_and_commit` -- writes this rank's shard file into
   ``step_X.tmp-<token>/`` (O_DIRECT, checksummed, fsynced) and gathers every rank's result on the
   background group. If every rank wrote, each domain leader checks that every shard of its domain is
   in the directory with the recorded size, then writes ``.metadata`` and ``manifest.json`` (temp name,
   fsync, rename) and fsyncs the directory (prepare); a second gather tells every rank whether every
   domain prepared; only then do leaders rename the directory to ``step_X/`` and fsync the run
   directory (commit). A third gather tells every rank that all domains committed. One rank's failure
   anywhere means no domain commits the step, and the error names the rank and the path.

Retention (:meth:`Engine.apply_retention`, domain leader, on the writer thread after a save) deletes
the steps the policy does not keep, never a tagged one (the run directory's ``tags.json``; nothing
while it cannot be read); :meth:`Engine.clean_stale` removes abandoned temp directories.

Restore (:meth:`Engine.restore`, collective) is delegated to the engine's :class:`~.restore.Restorer`
(restore.py), built here with the engine's collaborators; it lists committed steps through this
engine's :meth:`Engine.committed_steps` and :meth:`Engine.clean_stale`, and reaches the durable tier
through a :class:`~.fetch.DurableFetcher` (fetch.py), which commits a fetched step with the same
rename as a save (:meth:`Engine._install`). Domain leaders list committed steps; ranks try the newest
common step (or a durable one, fetched by the domains that lack it), each reading and verifying
(per-item checksums) the byte ranges it needs, the large tensors straight into the live ones; only
when every rank verified does anyone apply the step (restore.py says what a failed step leaves). A corrupt or partial step is skipped with a warning naming
the file and the reason. What a save or restore did (bytes, times, where a restore read from, replica
mismatches) is returned (:class:`SaveOutcome`, :class:`PendingSave`) or kept
(:attr:`Engine.last_restore`, a :class:`~.restore.RestoreOutcome`) for the caller's event log; the
engine itself writes no events.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import time
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

from .. import __version__, failpoints
from ..errors import (
    ConfigError,
    InsufficientSpaceError,
    ReplicaMismatchError,
    ResilientSlurmError,
    SaveError,
    TagsFileError,
)
from ..layout import StepBusy, StepTagged, TempKind, delete_step, list_run_dir, temp_dirname
from ..manifest import (
    CHECKSUM_ALGORITHM,
    DCP_METADATA_NAME,
    EMPTY_KEYS,
    MANIFEST_NAME,
    ChunkEntry,
    Manifest,
    ShardEntry,
    split_per_rank_fqn,
)
from ..rundir import RunDir
from ..storage.fileio import (
    BLOCK,
    ShardFile,
    WrittenFile,
    aligned_buffer,
    as_memoryview,
    atomic_write,
    check_free_space,
    checksum,
    fsync_dir,
    remove_tree_quietly,
    round_up,
    write_file,
)
from ..storage.tier import StorageTier
from ..tags import RunTags, local_tagged_steps, update_local_tags
from . import state as state_mod
from .coordination import Coordinator, RankError, Topology
from .ddp import DDP_KEY, DDPTracker
from .fetch import DurableFetcher
from .peers import PeerReplicas
from .planning import (
    GlobalSavePlan,
    create_global_save_plan,
    domain_storage_data,
    dump_metadata,
    original_index,
)
from .policy import RetentionPolicy
from .replication import (
    ItemTable,
    ReplicaMismatch,
    ReplicaTracker,
    describe_index,
    digest_value,
    digest_vector,
    equal_from_reduced,
    mismatch_from_digests,
)
from .restore import RestoreOutcome, Restorer
from .staging import ShardLayout, StagingBuffer, WaveWriter

log = logging.getLogger(__name__)


def shard_filename(rank: int) -> str:
    """DCP's file naming: one file per rank."""
    return f"__{rank}_0.distcp"


@dataclass
class PendingSave:
    """A staged save waiting for (or in) the background write."""

    step: int
    reason: str
    token: str
    created_at: float
    bytes_items: list[tuple[WriteItem, bytes]]
    plan: GlobalSavePlan
    staging: StagingBuffer | WaveWriter
    stall_s: float = 0.0
    stats: dict[str, float] = field(default_factory=dict)
    mismatches: tuple[ReplicaMismatch, ...] = ()  # replicas found unequal while staging
    empty: dict[str, str] = field(default_factory=dict)  # top-level keys whose state is empty (no items)
    # Saved in waves (staging_memory_limit): the shard file with its tensor region written, and each slot's
    # checksum; or what stopped the waves, raised in the write phase so that every rank learns of it.
    waved: tuple[ShardFile, tuple[str, ...]] | BaseException | None = None

    @property
    def tensor_bytes(self) -> int:
        """Bytes of the shard's tensor region (padded to a block when plain values follow)."""
        n = self.staging.layout.tensor_region
        return round_up(n, BLOCK) if self.bytes_items else n

    @property
    def shard_bytes(self) -> int:
        """Size of this rank's shard file once written (the manifest's ``size`` for this rank)."""
        return self.tensor_bytes + sum(len(b) for _, b in self.bytes_items)


@dataclass(frozen=True)
class SaveOutcome:
    """What a finished save did."""

    step: int
    reason: str
    bytes_written: int  # this rank's shard
    stall_s: float
    write_s: float
    commit_s: float
    step_bytes: int = 0  # every rank's shards together
    mismatches: tuple[ReplicaMismatch, ...] = ()  # copies of one item unequal across domains (on domain leaders)


def check_plain_values(items: list[tuple[WriteItem, bytes]]) -> None:
    """ConfigError naming the first plain value of ``items`` (serialized) that restore's ``weights_only`` loader
    would refuse, and saying what to keep in the state instead."""
    for it, b in items:
        try:
            torch.load(io.BytesIO(b), map_location="cpu", weights_only=True)
        except Exception as exc:
            raise ConfigError(
                f"state value {it.index.fqn!r} cannot be restored safely (use tensors, numbers, strings, bytes, None "
                f"and lists/tuples/dicts/sets of them): {type(exc).__name__}; convert it, e.g. float(x) for a NumPy "
                "scalar, str(p) for a path, g.get_state() for a torch.Generator (g.set_state() it back after the "
                "restore), r.getstate() for a random.Random, rng.bit_generator.state for a NumPy Generator, or "
                "give an object of your own state_dict() and load_state_dict() (docs/integration.md)"
            ) from exc


class Engine:
    """Save, commit and retention for one run in the node-local tier; restore through its
    :class:`~.restore.Restorer`. One instance per rank."""

    def __init__(
        self,
        topo: Topology,
        coord: Coordinator,
        run_id: str,
        *,
        retention: RetentionPolicy,
        io_threads: int = 4,
        free_space_margin: int = 64 << 20,
        capture_rng: bool = True,
        durable: StorageTier | None = None,
        replica_check: str = "warn",
        replica_check_bytes: int = 32 << 20,
        replicated: tuple[str, ...] = (),
        restore_fallback: str = "fail",
        provenance: Mapping[str, Any] | None = None,
        peer_replicas: str = "off",
        staging_memory_limit: int = 0,
    ) -> None:
        self.topo = topo
        self.staging_memory_limit = staging_memory_limit  # 0: none
        self.provenance = provenance  # written into every manifest (provenance.py); None: not recorded
        self.coord = coord
        self.run_id = run_id
        self.retention = retention
        self.io_threads = io_threads
        self.free_space_margin = free_space_margin
        self.capture_rng = capture_rng
        self.durable = durable
        self.run_dir = RunDir(topo.root, run_id).path
        self._seq = 0
        self._foreign_named: set[str] = set()  # step-named links and files already warned about
        self._cached_local_plan: SavePlan | None = None
        self._base_plans: list[SavePlan] = []  # every rank's plan, items under their own keys
        self._table: ItemTable | None = None
        self._table_version = 0
        self._by_index: dict[MetadataIndex, WriteItem] = {}
        self._global_key: tuple[int, frozenset[MetadataIndex]] | None = None
        self._cached_global: GlobalSavePlan | None = None
        self._cached_layout: ShardLayout | None = None
        self._originals: dict[MetadataIndex, WriteItem] = {}  # per-rank item -> the item under its own key
        self._staging: StagingBuffer | WaveWriter | None = None
        self._pin = torch.cuda.is_available()
        self.replicas = ReplicaTracker(replica_check, replica_check_bytes)
        self.replicated = replicated  # state keys the program declares replicated
        self.ddp = DDPTracker()
        self._tags_warned: str | None = None
        # Restore and the durable fetch share this engine's collaborators; a fetched step is committed
        # by the same rename as a save (looked up at each call, as the save path looks it up).
        self.fetcher = DurableFetcher(
            durable, topo, coord, run_id, self.run_dir,
            install=lambda tmp, step, token: self._install(tmp, step, token),
            free_space_margin=free_space_margin,
        )
        # Peer replicas (peers.py): a partner's steps kept here, ours kept there; collective to connect.
        self.peers = PeerReplicas(topo, run_id, self.run_dir, mode=peer_replicas, free_space_margin=free_space_margin,
                                  install=lambda tmp, step, token: self._install(tmp, step, token))
        self.peers.connect(coord)
        self.restorer = Restorer(
            topo, coord, run_id, self.run_dir, local=self, fetcher=self.fetcher, ddp=self.ddp,
            io_threads=io_threads, capture_rng=capture_rng, restore_fallback=restore_fallback, peers=self.peers,
        )

    # ------------------------------------------------------------------ save, foreground
    def plan_layout(self, state: Mapping[str, Any]) -> ShardLayout:
        """Plan a save of ``state`` now (cached for the next :meth:`stage`) and return this rank's shard
        layout, so the staging buffer can be allocated ahead of the first save. Collective (foreground)."""
        return self._plan(state).layout

    def ensure_staging(self, layout: ShardLayout) -> StagingBuffer | WaveWriter:
        """The staging buffer for ``layout``, allocated and pre-faulted if it is not there yet: the file's
        image, or a window of ``staging_memory_limit`` bytes when the tensor region is larger (waves).

        Thread-safe with respect to :meth:`stage` only if the caller waits for it before staging (the
        Checkpointer runs it on its writer thread after a restore and waits before the next save)."""
        if self._staging is None or self._staging.layout.key != layout.key:
            self._staging = None  # drop the old buffer before allocating the new one
            limit = self.staging_memory_limit
            if limit and layout.tensor_region > limit:
                self._staging = WaveWriter(layout, limit, pin=self._pin)
                log.info("rank %d: the tensor state (%d bytes) is larger than staging_memory_limit (%d): saves "
                         "stage and write it in %d waves while training waits", self.topo.rank,
                         layout.tensor_region, limit, -(-layout.tensor_region // self._staging.window))
            else:
                self._staging = StagingBuffer(layout, pin=self._pin)
        return self._staging

    def _plan(self, state: Mapping[str, Any]) -> _Plan:
        """Plan a save: this rank's items, the replication proofs, the global plan. Collective (foreground):
        one phase in the steady state (plan changed? and the digests), three when a plan changed."""
        topo = self.topo
        timing = {"digest_s": 0.0, "reduce_s": 0.0}
        local: dict[str, Any] = {}  # this rank's state_dict, planner, plan (filled inside the phases)

        def plan_here() -> bool:
            """This rank's plan of the save; whether it differs from the cached one."""
            t0 = time.perf_counter()
            if self._table is None:
                self.ddp.scan(state)
            sd = state_mod.build_state_dict(state, rank=topo.rank, capture_rng=self.capture_rng)
            layouts = self.ddp.layouts()
            if layouts is not None:
                sd[DDP_KEY] = layouts
            planner = DefaultSavePlanner()
            planner.set_up_planner(sd, is_coordinator=topo.rank == 0)
            local.update(sd=sd, planner=planner, plan=planner.create_local_plan())
            self._by_index = {it.index: it for it in local["plan"].items}
            local["plan_s"] = time.perf_counter() - t0  # not the collective's time
            return self._cached_local_plan is None or not _same_plan(local["plan"], self._cached_local_plan)

        def digests(selected: list[MetadataIndex]) -> list[int]:
            local["mine"] = self._digests(selected, local["planner"], timing)
            return digest_vector(selected, local["mine"])

        reduced: list[int] = []
        selected: list[MetadataIndex] = []
        changed = True
        if self._table is not None:
            # Steady state: one all_reduce carries "my plan changed" and this save's digests.
            selected = self.replicas.select(self._table)
            t = time.perf_counter()
            vec = self.coord.phase_max("planning the save", lambda: [int(plan_here()), *digests(selected)],
                                       1 + 2 * len(selected))
            timing["reduce_s"] += time.perf_counter() - t - timing["digest_s"] - local.get("plan_s", 0.0)
            changed, reduced = bool(vec[0]), vec[1:]
        if changed:
            def plan_and_proven() -> tuple[SavePlan, dict[str, frozenset[int] | None]]:
                if "plan" not in local:
                    plan_here()
                elif self._table is not None:
                    self.ddp.scan(state)
                missing = [k for k in self.replicated if k not in state]
                if missing:
                    raise ConfigError(f"replicated={list(self.replicated)}: {missing} not in the state "
                                      f"(keys: {sorted(state)})")
                if shared := state_mod.overlapping_tensors(local["planner"].state_dict):
                    shown = ", ".join(repr(k) for k in shared[:8]) + (f" and {len(shared) - 8} more"
                                                                       if len(shared) > 8 else "")
                    raise ConfigError(
                        f"state {shown}: a tensor whose elements share memory (a dimension of stride 0, as expand() "
                        "or broadcasting makes) could never be restored into (one memory location would take "
                        "several saved values), so the save is refused. Keep a tensor that owns its memory in the "
                        "state (x.clone(), or the tensor it was expanded from)")
                # A plain value restore would refuse fails this save, on every rank, not the next one's (the write
                # phase checks each save's values again: one that changes kind under the same plan).
                check_plain_values([(it, local["planner"].resolve_data(it).getvalue()) for it in local["plan"].items
                                    if it.type == WriteItemType.BYTE_IO])
                return local["plan"], _proven_keys(local["planner"].state_dict, self.ddp.replicated_keys(state),
                                                   self.replicated)

            gathered = self.coord.phase("planning the save", plan_and_proven)
            self._base_plans = [g[0] for g in gathered]
            self._table = ItemTable.build(self._base_plans, [g[1] for g in gathered])
            self._table_version += 1
            self._report_unproven(self._table)
            if self._table.mixed_kinds and topo.rank == 0:
                for name, by_rank in self._table.mixed_kinds.items():
                    kinds: dict[str, list[int]] = {}
                    for r, kind in sorted(by_rank.items()):
                        kinds.setdefault(kind, []).append(r)
                    log.info("state %r is %s: stored and restored per rank", name,
                             " and ".join(f"{k} on rank{'s' if len(rs) > 1 else ''} {rs}" for k, rs in kinds.items()))
            self._cached_local_plan = local["plan"]
            selected = self.replicas.select(self._table)
            t = time.perf_counter()
            digest_s = timing["digest_s"]
            reduced = self.coord.phase_max("proving replicas", lambda: digests(selected), 2 * len(selected))
            timing["reduce_s"] += time.perf_counter() - t - (timing["digest_s"] - digest_s)
        planner, sd = local["planner"], local["sd"]
        mine: dict[MetadataIndex, int] = local.get("mine", {})
        table = self._table
        assert table is not None
        equal = equal_from_reduced(reduced, len(selected))
        newly, mismatched = self.replicas.update(table, selected, equal)
        if newly and topo.rank == 0:
            log.info("state %s differs between ranks: stored and restored per rank",
                     ", ".join(repr(describe_index(i)) for i in newly[:8]) + (f" and {len(newly) - 8} more"
                                                                              if len(newly) > 8 else ""))
        mismatches: tuple[ReplicaMismatch, ...] = ()
        if mismatched:
            every = self.coord.phase("naming the replicas that differ",
                                     lambda: {i: mine[i] for i in mismatched if i in mine})
            mismatches = tuple(mismatch_from_digests(i, {r: d[i] for r, d in enumerate(every) if i in d})
                               for i in mismatched)
            if self.replicas.check == "fail":
                raise ReplicaMismatchError(
                    "replicas that DDP or a DTensor keeps equal differ between ranks: "
                    + "; ".join(m.describe() for m in mismatches)
                    + ". The save was refused (replica_check=fail); set replica_check=warn to save each rank's copy",
                    mismatches)
        rename = self.replicas.rename(mismatched)
        key = (self._table_version, rename)
        if self._global_key != key or self._cached_global is None:
            self._cached_global = create_global_save_plan(self._base_plans, topo.domain_of_rank, rename)
            mine_items = self._cached_global.plans[topo.rank].items
            self._cached_layout = ShardLayout.build(mine_items)
            self._originals = {it.index: dataclasses.replace(it, index=original_index(it.index))
                               for it in mine_items if split_per_rank_fqn(it.index.fqn) is not None}
            self._global_key = key
        assert self._cached_layout is not None
        return _Plan(planner, self._cached_global, self._cached_layout, mismatches, timing,
                     state_mod.empty_state_keys(sd, planner))

    def _report_unproven(self, table: ItemTable) -> None:
        """Say once per plan what replication proofs cost: large shared state hashed at every save."""
        big = [i for i in table.order if i not in table.proven and i not in self.replicas.per_rank]
        total = sum(table.nbytes[i] for i in big)
        if self.topo.rank == 0 and total >= 64 << 20:
            keys = sorted({i.fqn.split(".")[0] for i in big if table.nbytes[i]})
            log.info("%.0f MiB of state under %s is held by several ranks and not replicated by construction: every "
                     "save hashes each rank's copy to prove it equal (about 0.1 s per GiB on a CPU core). If your "
                     "program keeps it equal on every rank, declare it: Checkpointer(replicated=%r)",
                     total / 2**20, keys, keys)

    def _digests(self, selected: list[MetadataIndex], planner: DefaultSavePlanner,
                 timing: dict[str, float]) -> dict[MetadataIndex, int]:
        """This rank's digest of each selected item it holds (plain values digested as objects, not serialized)."""
        t0 = time.perf_counter()
        out: dict[MetadataIndex, int] = {}
        for idx in selected:
            it = self._by_index.get(idx)
            if it is not None:
                obj = planner.lookup_object(idx) if it.type == WriteItemType.BYTE_IO else planner.resolve_data(it)
                out[idx] = digest_value(obj)
        timing["digest_s"] += time.perf_counter() - t0
        return out

    def stage(self, step: int, state: Mapping[str, Any], reason: str) -> PendingSave:
        """Plan and copy ``state`` into staging buffers. Collective (foreground group)."""
        t0 = time.perf_counter()
        pl = self._plan(state)
        planner, plan, layout = pl.planner, pl.plan, pl.layout
        mine = plan.plans[self.topo.rank].items
        staging = self.ensure_staging(layout)
        t_plan = time.perf_counter()
        originals = self._originals
        resolve: Callable[[WriteItem], Any] = (
            (lambda it: planner.resolve_data(originals.get(it.index, it))) if originals else planner.resolve_data)
        bytes_items = []
        for it in mine:
            if it.type == WriteItemType.BYTE_IO:
                data = resolve(it)
                assert isinstance(data, io.BytesIO)
                bytes_items.append((it, data.getvalue()))
        self._seq += 1
        p = PendingSave(step=step, reason=reason, token=f"{self.topo.nonce}-{self._seq}", created_at=time.time(),
                        bytes_items=bytes_items, plan=plan, staging=staging, mismatches=pl.mismatches,
                        empty=pl.empty)
        if isinstance(staging, WaveWriter):
            p.waved = self._write_waves(p, staging, resolve)
        else:
            staging.stage(resolve)
        t1 = time.perf_counter()
        p.stall_s = t1 - t0
        p.stats = {"plan_s": t_plan - t0, "copy_s": t1 - t_plan, **pl.timing}
        return p

    def _write_waves(self, p: PendingSave, waves: WaveWriter, resolve: Callable[[WriteItem], Any],
                     ) -> tuple[ShardFile, tuple[str, ...]] | BaseException:
        """The tensor region written to the shard file through the window, now (the stall). A failure is
        kept, not raised: the write phase raises it, so that no rank waits for this one."""
        tmp = RunDir.at(self.run_dir).file(temp_dirname(p.step, TempKind.SAVE, p.token))
        path = os.path.join(tmp, shard_filename(self.topo.rank))
        out: ShardFile | None = None
        try:
            os.makedirs(self.run_dir, mode=0o700, exist_ok=True)
            os.makedirs(tmp, mode=0o700, exist_ok=True)
            need = p.shard_bytes * len(self.topo.domain_ranks) + self.free_space_margin
            check_free_space(tmp, need, what=f"step {p.step} shard of rank {self.topo.rank}")
            out = ShardFile(path)
            return out, waves.write(resolve, out, p.tensor_bytes, threads=self.io_threads)
        except Exception as exc:
            if out is not None:
                out.close()
            log.error("step %d: rank %d could not write its shard %s in waves: %s", p.step, self.topo.rank, path, exc)
            return exc

    # ------------------------------------------------------------------ save, background
    def write_and_commit(self, p: PendingSave) -> SaveOutcome:
        """Write this rank's shard and commit the step in every domain. Collective (background group).

        Never leaves a partial step that looks committed: a failure on any rank, or a shard missing from
        its domain's directory, means no domain commits; the temp directories are removed and every
        rank raises :class:`SaveError` naming the rank and the path.
        """
        topo = self.topo
        tmp = RunDir.at(self.run_dir).file(temp_dirname(p.step, TempKind.SAVE, p.token))
        fname = shard_filename(topo.rank)
        t0 = time.perf_counter()

        def write() -> dict[str, Any]:
            try:
                os.makedirs(self.run_dir, mode=0o700, exist_ok=True)
                os.makedirs(tmp, mode=0o700, exist_ok=True)
                failpoints.hit("before_shard_write", os.path.join(tmp, fname))
                result = self._write_shard(p, tmp, fname)
                failpoints.hit("after_shard_write", os.path.join(tmp, fname))
            except Exception as exc:
                log.error("step %d: rank %d could not write its shard %s: %s", p.step, topo.rank,
                          os.path.join(tmp, fname), exc)
                cls = InsufficientSpaceError if isinstance(exc, InsufficientSpaceError) else SaveError
                raise cls(f"rank {topo.rank} could not write {os.path.join(tmp, fname)}: {exc}") from exc
            finally:
                if isinstance(p.waved, tuple):  # written in waves: its file is closed whatever happened
                    p.waved[0].close()
            return result

        def failed(name: str, errors: list[RankError]) -> Exception:
            msg = (f"save of step {p.step} (run {self.run_id}) failed, no domain committed it: "
                   + "; ".join(dict.fromkeys(e.describe() for e in errors)))
            return (InsufficientSpaceError if any(e.kind == "InsufficientSpaceError" for e in errors) else SaveError)(msg)

        mismatches: tuple[ReplicaMismatch, ...] = ()
        try:
            results = self.coord.phase("writing the shards", write, background=True, error=failed)
            t1 = time.perf_counter()
            # Items written once per domain whose copies differ (every rank finds the same from the results).
            mismatches = _cross_domain_mismatches(results)
            if mismatches and self.replicas.check == "fail":
                raise ReplicaMismatchError(
                    f"save of step {p.step} (run {self.run_id}) failed, no domain committed it: copies of "
                    "replicated state differ between storage domains: "
                    + "; ".join(m.describe() for m in mismatches) + " (replica_check=fail)", mismatches)

            def prepare() -> None:
                # Every leader checks its directory and writes .metadata and the manifest into the temp
                # directory; nothing is committed until every domain has prepared.
                if not topo.is_leader:
                    return
                try:
                    self._prepare_domain(p, tmp, results, mismatches)
                except Exception as exc:
                    log.error("step %d: preparing the commit in %s failed: %s", p.step, tmp, exc)
                    raise SaveError(f"domain {topo.domain} ({tmp}): {exc}") from exc

            self.coord.phase("preparing the commit", prepare, background=True, error=failed)
        except BaseException:
            if topo.is_leader:
                remove_tree_quietly(tmp)
            raise

        def install() -> None:
            if not topo.is_leader:
                return
            try:  # every domain prepared; the rename is the commit
                self._install(tmp, p.step, p.token)
            except Exception as exc:
                log.error("step %d: commit in %s failed: %s", p.step, self.run_dir, exc)
                remove_tree_quietly(tmp)
                raise SaveError(f"domain {topo.domain}: renaming {tmp} failed: {exc}") from exc

        def partly(name: str, errors: list[RankError]) -> Exception:
            # rare: a rename failed after every domain prepared; restore needs the step in every domain
            return SaveError(f"save of step {p.step} (run {self.run_id}) is committed in some storage domains "
                             "only, so restore will not use it: " + "; ".join(e.describe() for e in errors))

        self.coord.phase("committing the step", install, background=True, error=partly)
        result = results[topo.rank]
        t2 = time.perf_counter()
        if topo.is_leader:
            failpoints.hit("after_commit_rename")
        total = sum(r["size"] for r in results)
        log.info(
            "step %d committed (%s): %.1f MiB in all ranks, stall %.3fs (plan %.3fs, copy %.3fs), write %.3fs, "
            "commit %.3fs",
            p.step, p.reason, total / 2**20, p.stall_s, p.stats["plan_s"], p.stats["copy_s"], t1 - t0, t2 - t1,
        )
        return SaveOutcome(p.step, p.reason, result["size"], p.stall_s, t1 - t0, t2 - t1, total, mismatches)

    def _write_shard(self, p: PendingSave, tmp: str, fname: str) -> dict[str, Any]:
        layout = p.staging.layout
        segments: list[tuple[memoryview, int]] = []
        chunks: list[tuple[int, int]] = []
        infos: dict[MetadataIndex, tuple[str, int, int]] = {}
        tensor_len = p.tensor_bytes
        if isinstance(p.waved, BaseException):
            raise p.waved
        if tensor_len and p.waved is None:
            assert isinstance(p.staging, StagingBuffer)
            segments.append((p.staging.memoryview(), tensor_len))
        for s in layout.slots:
            chunks.append((s.offset, s.length))
            infos[s.item.index] = (fname, s.offset, s.length)
        if p.bytes_items:
            # Restore loads plain values with weights_only=True: refuse now (off the training thread) what
            # restore would refuse, so a committed step is always restorable (the planning phase checked them when
            # the plan was made, on every rank: a value that changes kind later under the same plan is caught here).
            check_plain_values(p.bytes_items)
            total_b = sum(len(b) for _, b in p.bytes_items)
            bbuf = aligned_buffer(total_b)
            mv = as_memoryview(bbuf)
            off = 0
            for it, b in p.bytes_items:
                mv[off : off + len(b)] = b
                chunks.append((tensor_len + off, len(b)))
                infos[it.index] = (fname, tensor_len + off, len(b))
                off += len(b)
            segments.append((mv, total_b))
        path = os.path.join(tmp, fname)
        if p.waved is not None:  # the tensor region is written: the plain values follow, then the checksums
            out, slot_sums = p.waved
            try:
                for mv, n in segments:
                    out.put(mv, n)
                total = out.finish()
            finally:
                out.close()
            sums = (*slot_sums, *(checksum(b) for _, b in p.bytes_items))
            written = WrittenFile(size=out.size, checksum=total, chunk_checksums=sums)
        else:
            size = sum(n for _, n in segments)
            # Ranks of a domain write at the same time into the same filesystem: check for all of them.
            need = size * len(self.topo.domain_ranks) + self.free_space_margin
            check_free_space(tmp, need, what=f"step {p.step} shard of rank {self.topo.rank}")
            written = write_file(path, segments, chunks, threads=self.io_threads)
        entry = ShardEntry(
            path=fname,
            rank=self.topo.rank,
            node=self.topo.domain,
            size=written.size,
            checksum=written.checksum,
            algorithm=CHECKSUM_ALGORITHM,
            chunks=tuple(ChunkEntry(o, n, c) for (o, n), c in zip(chunks, written.chunk_checksums)),
        )
        return {"ok": True, "entry": entry, "infos": infos, "size": written.size, "created_at": p.created_at}

    def _prepare_domain(self, p: PendingSave, tmp: str, results: list[dict[str, Any]],
                        mismatches: tuple[ReplicaMismatch, ...]) -> None:
        """Leader: check that every shard of this domain is in ``tmp`` with its recorded size, then write
        ``.metadata`` and ``manifest.json`` there and fsync the directory. The rename commits later."""
        topo = self.topo
        for res in results:
            e: ShardEntry = res["entry"]
            if e.node != topo.domain:
                continue
            path = os.path.join(tmp, e.path)
            try:
                st = os.stat(path)
            except FileNotFoundError:
                raise SaveError(f"rank {e.rank} reported its shard written, but {path} is not there (did that rank "
                                "write into another directory?)") from None
            if st.st_size != e.size:
                raise SaveError(f"rank {e.rank}'s shard {path} has {st.st_size} bytes, the rank wrote {e.size}")
        md = p.plan.metadata
        storage = domain_storage_data([r["infos"] for r in results], topo.domain_of_rank, topo.domain)
        dom_md = Metadata(
            state_dict_metadata=md.state_dict_metadata,
            planner_data=md.planner_data,
            storage_data=storage,
        )
        md_bytes = dump_metadata(dom_md)
        atomic_write(os.path.join(tmp, DCP_METADATA_NAME), md_bytes)
        failpoints.hit("after_dcp_metadata")
        nodes: dict[str, list[int]] = {}
        for r, d in enumerate(topo.domain_of_rank):
            nodes.setdefault(d, []).append(r)
        found = [*p.mismatches, *mismatches]
        manifest = Manifest(
            run_id=self.run_id,
            step=p.step,
            world_size=topo.world_size,
            created_at=results[0]["created_at"],
            reason=p.reason,
            torch_version=torch.__version__,
            library_version=__version__,
            shards=tuple(r["entry"] for r in results),
            nodes={d: tuple(rs) for d, rs in nodes.items()},
            node=topo.domain,
            dcp_metadata=ChunkEntry(0, len(md_bytes), checksum(md_bytes)),
            extra={**({"replica_mismatch": [dataclasses.asdict(m) for m in found]} if found else {}),
                   **({EMPTY_KEYS: p.empty} if p.empty else {})},
            provenance=self.provenance,
        )
        atomic_write(os.path.join(tmp, MANIFEST_NAME), manifest.to_json().encode())
        fsync_dir(tmp)
        failpoints.hit("after_manifest")

    def _install(self, tmp: str, step: int, token: str) -> None:
        """Rename a complete temp directory to ``step_X/`` (the local commit) and fsync the run directory.

        An existing copy of the step (a re-save right after a restore, or a corrupt copy replaced by a
        fetch from the durable tier) is swapped atomically enough that no other step is ever affected,
        then removed."""
        final = RunDir.at(self.run_dir).step(step)
        if os.path.exists(final):
            aside = RunDir.at(self.run_dir).file(temp_dirname(step, TempKind.REPLACED, token))
            os.rename(final, aside)
            os.rename(tmp, final)
            fsync_dir(self.run_dir)
            remove_tree_quietly(aside)
        else:
            os.rename(tmp, final)
            fsync_dir(self.run_dir)

    # ------------------------------------------------------------------ retention / listing
    def committed_steps(self) -> list[int]:
        """Steps with a manifest in this domain's run directory (not validated), ascending."""
        return list_run_dir(self.run_dir).committed

    def clean_stale(self, *, spare_current: bool) -> None:
        """Remove abandoned temp directories (saves, fetches and deletions of killed processes). Leader only.

        ``spare_current``: keep every temp directory of this job incarnation (its name carries the
        incarnation's nonce). Retention runs on the leader's writer thread while the other ranks of its
        domain may already write the next save into its temp directory; only a restore, before any
        save of this incarnation, removes them all."""
        listing = list_run_dir(self.run_dir)
        for t in listing.temps:
            if not (spare_current and t.owned_by(self.topo.nonce)):
                log.info("removing abandoned %s directory %s", t.kind.value, listing.temp_path(t))
                remove_tree_quietly(listing.temp_path(t))
        for name in listing.foreign:
            if name not in self._foreign_named:  # once per entry and process: this runs at every save
                self._foreign_named.add(name)
                log.warning("%s: a symbolic link or a file where rslurm keeps a step's directory; it is never read "
                            "(a step there is not restored) nor followed: remove it, and find out who made it",
                            RunDir.at(self.run_dir).file(name))

    def apply_retention(self) -> list[int]:
        """Delete steps the policy does not keep (never the newest, never a tagged one, never one being
        read; nothing while the run's tags file cannot be read)."""
        self.clean_stale(spare_current=True)
        deleted: list[int] = []
        try:
            tagged = local_tagged_steps(self.run_dir, self.run_id)
        except TagsFileError as exc:
            self._tags_unreadable(exc)
            return deleted
        for s in self.retention.deletable(self.committed_steps(), protected=tagged):
            try:
                if delete_step(self.run_dir, s, TempKind.GC, self.topo.nonce):
                    deleted.append(s)
            except StepBusy as busy:
                log.info("retention: step %d is busy (%s); keeping it for now", s, busy.why)
            except StepTagged:
                log.info("retention: step %d was tagged meanwhile; keeping it", s)
            except TagsFileError as exc:
                self._tags_unreadable(exc)
                break
            except OSError as exc:
                # Uncommitted but not all removed: an abandoned temp directory, removed by the next
                # clean_stale. Not even uncommitted: kept, and tried again at the next save.
                log.warning("retention: cannot remove step %d from %s: %s", s, self.run_dir, exc)
        if deleted:
            log.info("retention removed steps %s from %s", deleted, self.run_dir)
        return deleted

    def tag(self, step: int, name: str) -> int | None:
        """Domain leader: tag ``step`` as ``name`` in this domain's tags file, checking under the tags lock
        (which every deleter holds while it deletes) that the step is committed here. Returns the step
        the name moved from (None: it was new, or already there). ConfigError when the step is not
        committed here, TagsFileError when the tags file cannot be read."""
        moved: list[int | None] = [None]

        def change(cur: RunTags) -> RunTags:
            committed = self.committed_steps()
            if step not in committed:
                raise ConfigError(f"cannot tag step {step} of run {self.run_id}: it is not committed in "
                                  f"{self.run_dir} (committed there: {committed or 'none'}); `rslurm tag` tags "
                                  "a step that is only in the durable tier")
            moved[0] = cur.tags.get(name)
            return cur.tagged(name, step)

        try:
            update_local_tags(self.run_dir, self.run_id, change)
        except FileNotFoundError:
            raise ConfigError(f"cannot tag step {step} of run {self.run_id}: nothing is committed in "
                              f"{self.run_dir}") from None
        return moved[0] if moved[0] != step else None

    def _tags_unreadable(self, exc: TagsFileError) -> None:
        """Warn once per message: retention deletes nothing while the tags file cannot be read."""
        if str(exc) != self._tags_warned:
            self._tags_warned = str(exc)
            log.warning("retention in %s is off: %s", self.run_dir, exc)

    # ------------------------------------------------------------------ restore (restore.py, fetch.py)
    def restore(self, state: MutableMapping[str, Any], rank_map: Callable[[int], int] | None = None, *,
                allow_missing: tuple[str, ...] = (), allow_unexpected: tuple[str, ...] = ()) -> int:
        """Restore the newest step that every rank can read and verify; return it (0 if none).

        Collective (foreground group); :meth:`Restorer.restore <.restore.Restorer.restore>` does the work
        and says what raises. ``rank_map(rank)`` names the saved rank whose per-rank state and RNG state
        this rank loads; ``allow_missing`` / ``allow_unexpected``: keys allowed to differ (compat.py)."""
        return self.restorer.restore(state, rank_map, allow_missing=allow_missing,
                                     allow_unexpected=allow_unexpected)

    @property
    def last_restore(self) -> RestoreOutcome | None:
        """What the last :meth:`restore` did on this rank (for the event log); None before the first, and when
        the last one raised before it had tried every candidate (an incompatible step, a failing rank_map)."""
        return self.restorer.last_restore


@dataclass(frozen=True)
class _Plan:
    """One save's plan on this rank."""

    planner: DefaultSavePlanner
    plan: GlobalSavePlan
    layout: ShardLayout
    mismatches: tuple[ReplicaMismatch, ...]
    timing: dict[str, float]  # digest_s (hashing) and reduce_s (the all_reduce) of the replication proofs
    empty: dict[str, str] = field(default_factory=dict)  # state.empty_state_keys: manifest extra


_NOT_PROVEN = object()


def _mesh_ranks(v: Any) -> Any:
    """For a DTensor, the global ranks of its device mesh (None: every rank); ``_NOT_PROVEN`` for anything else."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return _NOT_PROVEN
    if not isinstance(v, DTensor):
        return _NOT_PROVEN
    ranks = frozenset(int(r) for r in v.device_mesh.mesh.flatten().tolist())
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    return None if len(ranks) == world else ranks


def _proven_keys(sd: Mapping[str, Any], ddp: Mapping[str, frozenset[int] | None],
                 replicated: Sequence[str]) -> dict[str, frozenset[int] | None]:
    """This rank's keys whose items are replicated by construction, each with the ranks among which it is
    (None: every rank): a DDP's parameters and their optimizer state (its process group; keys ending in
    ``.`` are prefixes), the chunks of a DTensor (its device mesh: ranks holding a chunk at the same offsets
    are its replicas), and what the user declared ``replicated`` (every rank). Items under one key held by
    ranks outside one such group (two pipeline stages with an optimizer keyed by index) are proven by
    digests instead (replication.py)."""
    prefixes = [(k, g) for k, g in ddp.items() if k.endswith(".")]
    declared = tuple(f"{k}." for k in replicated)
    out: dict[str, frozenset[int] | None] = {}
    for fqn, v in sd.items():
        group: Any = ddp[fqn] if fqn in ddp else next((g for p, g in prefixes if fqn.startswith(p)), _NOT_PROVEN)
        if group is _NOT_PROVEN and (fqn in replicated or fqn.startswith(declared)):
            group = None
        if group is _NOT_PROVEN:
            group = _mesh_ranks(v)
        if group is not _NOT_PROVEN:
            out[fqn] = group
    return out


def _cross_domain_mismatches(results: list[dict[str, Any]]) -> tuple[ReplicaMismatch, ...]:
    """Items written once per domain whose copies have different checksums: a free check, at every
    save, of state replicated by construction (the digests of the others proved them equal before)."""
    copies: dict[MetadataIndex, dict[int, str]] = {}
    for r in results:
        e: ShardEntry = r["entry"]
        sums = {c.offset: c.checksum for c in e.chunks}
        for idx, (_, off, _) in r["infos"].items():
            copies.setdefault(idx, {})[e.rank] = sums[off]
    out = []
    for idx, by_rank in copies.items():
        if len(by_rank) > 1 and len(set(by_rank.values())) > 1:
            ids = {v: i for i, v in enumerate(sorted(set(by_rank.values())))}
            out.append(mismatch_from_digests(idx, {r: ids[v] for r, v in by_rank.items()}))
    return tuple(sorted(out, key=lambda m: m.key))


def _same_plan(a: SavePlan, b: SavePlan) -> bool:
    if len(a.items) != len(b.items):
        return False
    for x, y in zip(a.items, b.items):
        if x.index != y.index or x.type != y.type:
            return False
        if (x.tensor_data is None) != (y.tensor_data is None):
            return False
        if x.tensor_data is not None and y.tensor_data is not None:
            if x.tensor_data.chunk != y.tensor_data.chunk or x.tensor_data.properties.dtype != y.tensor_data.properties.dtype:
                return False
    return True


__all__ = ["Engine", "PendingSave", "SaveOutcome", "ResilientSlurmError", "shard_filename"]
