"""The save/restore engine over one node-local tier: staging, background write, commit, restore.

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

Restore (:meth:`Engine.restore`, collective): domain leaders list committed steps; ranks try the
newest common step, each reading and verifying (per-item checksums) the byte ranges it needs *before
touching any live tensor*; only when every rank verified does anyone copy into the model. A corrupt or
partial step is skipped with a warning naming the file and the reason. Items stored per rank are read
from the copy of the rank that saved them (``rank_map`` when the world size changed). What a save or
restore did (bytes, times, where a restore read from, replica mismatches) is returned
(:class:`SaveOutcome`, :class:`PendingSave`) or kept (:attr:`Engine.last_restore`) for the caller's
event log; the engine itself writes no events.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import time
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, SavePlan, WriteItem, WriteItemType

from .. import __version__, failpoints
from ..errors import (
    CheckpointError,
    ConfigError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    InsufficientSpaceError,
    PermanentError,
    ReplicaMismatchError,
    ResilientSlurmError,
    RestoreUnavailableError,
    SaveError,
    StorageError,
    TransientError,
)
from ..layout import StepBusy, TempKind, delete_step, list_run_dir, temp_dirname
from ..manifest import (
    CHECKSUM_ALGORITHM,
    DCP_METADATA_NAME,
    MANIFEST_NAME,
    ChunkEntry,
    Manifest,
    ShardEntry,
    durable_step_key,
    durable_steps,
    read_durable_manifest,
    read_manifest_file,
    split_per_rank_fqn,
    step_dirname,
)
from ..storage.fileio import (
    BLOCK,
    aligned_buffer,
    as_memoryview,
    atomic_write,
    check_free_space,
    checksum,
    fsync_dir,
    read_file_into,
    reading_step,
    remove_tree,
    round_up,
    write_file,
)
from ..storage.tier import StorageTier
from . import state as state_mod
from .coordination import Coordinator, Topology
from .ddp import DDP_KEY, DDPTracker
from .planning import (
    GlobalSavePlan,
    SafeLoadPlanner,
    check_metadata,
    create_global_save_plan,
    domain_storage_data,
    dump_metadata,
    original_index,
    read_metadata_file,
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
from .staging import ShardLayout, StagingBuffer, framing_for

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
    staging: StagingBuffer
    stall_s: float = 0.0
    stats: dict[str, float] = field(default_factory=dict)
    mismatches: tuple[ReplicaMismatch, ...] = ()  # replicas found unequal while staging

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


@dataclass(frozen=True)
class RestoreOutcome:
    """What :meth:`Engine.restore` did on this rank (for the event log)."""

    step: int  # 0: nothing restored
    tier: str | None  # "local", or "durable" when this rank's node fetched the step; None: nothing restored
    seconds: float
    bytes_read: int  # bytes this rank read and verified
    fetched_bytes: int  # bytes this rank fetched from the durable tier (domain leaders only)
    skipped: tuple[int, ...] = ()  # steps tried and found unusable


class Engine:
    """Save and restore for one run in the node-local tier. One instance per rank."""

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
    ) -> None:
        self.topo = topo
        self.coord = coord
        self.run_id = run_id
        self.retention = retention
        self.io_threads = io_threads
        self.free_space_margin = free_space_margin
        self.capture_rng = capture_rng
        self.durable = durable
        self.run_dir = os.path.join(topo.root, run_id)
        self._seq = 0
        self._cached_local_plan: SavePlan | None = None
        self._base_plans: list[SavePlan] = []  # every rank's plan, items under their own keys
        self._table: ItemTable | None = None
        self._table_version = 0
        self._by_index: dict[MetadataIndex, WriteItem] = {}
        self._global_key: tuple[int, frozenset[MetadataIndex]] | None = None
        self._cached_global: GlobalSavePlan | None = None
        self._cached_layout: ShardLayout | None = None
        self._originals: dict[MetadataIndex, WriteItem] = {}  # per-rank item -> the item under its own key
        self._staging: StagingBuffer | None = None
        self._pin = torch.cuda.is_available()
        self.replicas = ReplicaTracker(replica_check, replica_check_bytes)
        self.replicated = replicated  # state keys the program declares replicated
        self.restore_fallback = restore_fallback  # fail | fresh: when checkpoints exist but none restores
        self.ddp = DDPTracker()
        self._source_rank = topo.rank  # whose per-rank state this rank restores (rank_map)
        self._rank_mapped = False
        self.last_restore: RestoreOutcome | None = None

    # ------------------------------------------------------------------ save, foreground
    def plan_layout(self, state: Mapping[str, Any]) -> ShardLayout:
        """Plan a save of ``state`` now (cached for the next :meth:`stage`) and return this rank's shard
        layout, so the staging buffer can be allocated ahead of the first save. Collective (foreground)."""
        return self._plan(state).layout

    def ensure_staging(self, layout: ShardLayout) -> StagingBuffer:
        """The staging buffer for ``layout``, allocated and pre-faulted if it is not there yet.

        Thread-safe with respect to :meth:`stage` only if the caller waits for it before staging (the
        Checkpointer runs it on its writer thread after a restore and waits before the next save)."""
        if self._staging is None or self._staging.layout.key != layout.key:
            self._staging = None  # drop the old buffer before allocating the new one
            self._staging = StagingBuffer(layout, pin=self._pin)
        return self._staging

    def _plan(self, state: Mapping[str, Any]) -> _Plan:
        """Plan a save: this rank's items, the replication proofs, the global plan. Collective (foreground)."""
        topo = self.topo
        if self._table is None:
            self.ddp.scan(state)
        sd = state_mod.build_state_dict(state, rank=topo.rank, capture_rng=self.capture_rng)
        layouts = self.ddp.layouts()
        if layouts is not None:
            sd[DDP_KEY] = layouts
        planner = DefaultSavePlanner()
        planner.set_up_planner(sd, is_coordinator=topo.rank == 0)
        local_plan = planner.create_local_plan()
        changed = self._cached_local_plan is None or not _same_plan(local_plan, self._cached_local_plan)
        reduced: list[int] = []
        selected: list[MetadataIndex] = []
        mine: dict[MetadataIndex, int] = {}
        timing = {"digest_s": 0.0, "reduce_s": 0.0}
        if self._table is not None:
            # Steady state: one all_reduce carries "my plan changed" and this save's digests.
            self._by_index = {it.index: it for it in local_plan.items}
            selected = self.replicas.select(self._table)
            mine = self._digests(selected, planner, timing)
            t = time.perf_counter()
            vec = self.coord.all_max([int(changed), *digest_vector(selected, mine)])
            timing["reduce_s"] += time.perf_counter() - t
            changed, reduced = bool(vec[0]), vec[1:]
        if changed:
            if self._table is not None:
                self.ddp.scan(state)
            exact, prefixes = self.ddp.replicated_keys(state)
            missing = [k for k in self.replicated if k not in state]
            if missing:
                raise ConfigError(f"replicated={list(self.replicated)}: {missing} not in the state (keys: {sorted(state)})")
            prefixes += tuple(f"{k}." for k in self.replicated)
            proven = frozenset(
                fqn for fqn, v in planner.state_dict.items()
                if fqn in exact or fqn.startswith(prefixes) or fqn in self.replicated or _is_dtensor(v))
            gathered = self.coord.all_gather((local_plan, proven))
            self._base_plans = [g[0] for g in gathered]
            self._table = ItemTable.build(self._base_plans, [g[1] for g in gathered])
            self._table_version += 1
            self._report_unproven(self._table)
            self._cached_local_plan = local_plan
            self._by_index = {it.index: it for it in local_plan.items}
            selected = self.replicas.select(self._table)
            mine = self._digests(selected, planner, timing)
            t = time.perf_counter()
            reduced = self.coord.all_max(digest_vector(selected, mine))
            timing["reduce_s"] += time.perf_counter() - t
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
            every = self.coord.all_gather({i: mine[i] for i in mismatched if i in mine})
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
        return _Plan(planner, self._cached_global, self._cached_layout, mismatches, timing)

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
        staging.stage(resolve)
        bytes_items = []
        for it in mine:
            if it.type == WriteItemType.BYTE_IO:
                data = resolve(it)
                assert isinstance(data, io.BytesIO)
                bytes_items.append((it, data.getvalue()))
        self._seq += 1
        t1 = time.perf_counter()
        return PendingSave(
            step=step,
            reason=reason,
            token=f"{self.topo.nonce}-{self._seq}",
            created_at=time.time(),
            bytes_items=bytes_items,
            plan=plan,
            staging=staging,
            stall_s=t1 - t0,
            stats={"plan_s": t_plan - t0, "copy_s": t1 - t_plan, **pl.timing},
            mismatches=pl.mismatches,
        )

    # ------------------------------------------------------------------ save, background
    def write_and_commit(self, p: PendingSave) -> SaveOutcome:
        """Write this rank's shard and commit the step in every domain. Collective (background group).

        Never leaves a partial step that looks committed: a failure on any rank, or a shard missing from
        its domain's directory, means no domain commits; the temp directories are removed and every
        rank raises :class:`SaveError` naming the rank and the path.
        """
        topo = self.topo
        tmp = os.path.join(self.run_dir, temp_dirname(p.step, TempKind.SAVE, p.token))
        fname = shard_filename(topo.rank)
        t0 = time.perf_counter()
        result: dict[str, Any]
        try:
            os.makedirs(self.run_dir, mode=0o700, exist_ok=True)
            os.makedirs(tmp, mode=0o700, exist_ok=True)
            failpoints.hit("before_shard_write", os.path.join(tmp, fname))
            result = self._write_shard(p, tmp, fname)
            failpoints.hit("after_shard_write", os.path.join(tmp, fname))
        except Exception as exc:  # reported to every rank below; never lost
            log.error("step %d: rank %d could not write its shard %s: %s", p.step, topo.rank,
                      os.path.join(tmp, fname), exc)
            result = {"ok": False, "error": f"rank {topo.rank} could not write {os.path.join(tmp, fname)}: {exc}",
                      "space": isinstance(exc, InsufficientSpaceError)}
        t1 = time.perf_counter()
        results = self.coord.all_gather(result, background=True)
        failed = [r for r in results if not r["ok"]]
        errors: list[str] = [r["error"] for r in failed]
        mismatches: tuple[ReplicaMismatch, ...] = ()
        if not failed:
            # Phase 1 (prepare): every leader checks its directory and writes .metadata and the manifest
            # into the temp directory; nothing is committed until every domain has prepared.
            error: str | None = None
            if topo.is_leader:
                try:
                    mismatches = _cross_domain_mismatches(results)
                    if mismatches and self.replicas.check == "fail":
                        raise ReplicaMismatchError(
                            "copies of replicated state differ between storage domains: "
                            + "; ".join(m.describe() for m in mismatches) + " (replica_check=fail)", mismatches)
                    self._prepare_domain(p, tmp, results, mismatches)
                except Exception as exc:
                    log.error("step %d: preparing the commit in %s failed: %s", p.step, tmp, exc)
                    error = f"domain {topo.domain} ({tmp}): {exc}"
            errors = [e for e in self.coord.all_gather(error, background=True) if e]
        commit_error: str | None = None
        if not errors and topo.is_leader:
            try:  # phase 2: every domain prepared; the rename is the commit
                self._install(tmp, p.step, p.token)
            except Exception as exc:
                log.error("step %d: commit in %s failed: %s", p.step, self.run_dir, exc)
                commit_error = f"domain {topo.domain}: renaming {tmp} failed: {exc}"
        if (errors or commit_error) and topo.is_leader:
            _remove_quietly(tmp)
        if errors:
            msg = f"save of step {p.step} (run {self.run_id}) failed, no domain committed it: " + "; ".join(errors)
            if mismatches and self.replicas.check == "fail":
                raise ReplicaMismatchError(msg, mismatches)
            raise (InsufficientSpaceError if any(r.get("space") for r in failed) else SaveError)(msg)
        renames = [e for e in self.coord.all_gather(commit_error, background=True) if e]
        if renames:  # rare: a rename failed after every domain prepared; restore needs the step in every domain
            raise SaveError(f"save of step {p.step} (run {self.run_id}) is committed in some storage domains only, "
                            "so restore will not use it: " + "; ".join(renames))
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
        if tensor_len:
            segments.append((p.staging.memoryview(), tensor_len))
        for s in layout.slots:
            chunks.append((s.offset, s.length))
            infos[s.item.index] = (fname, s.offset, s.length)
        if p.bytes_items:
            for it, b in p.bytes_items:
                # Restore loads plain values with weights_only=True: refuse now (off the training
                # thread) what restore would refuse, so a committed step is always restorable.
                try:
                    torch.load(io.BytesIO(b), map_location="cpu", weights_only=True)
                except Exception as exc:
                    raise ConfigError(
                        f"state value {it.index.fqn!r} cannot be restored safely (use tensors, numbers, "
                        f"strings, bytes, None and lists/tuples/dicts/sets of them): {type(exc).__name__}; "
                        "convert it, e.g. float(x) for a NumPy scalar, str(p) for a path"
                    ) from exc
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
        size = sum(n for _, n in segments)
        # Ranks of a domain write at the same time into the same filesystem: check for all of them.
        need = size * len(self.topo.domain_ranks) + self.free_space_margin
        check_free_space(tmp, need, what=f"step {p.step} shard of rank {self.topo.rank}")
        path = os.path.join(tmp, fname)
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
            extra={"replica_mismatch": [dataclasses.asdict(m) for m in found]} if found else {},
        )
        atomic_write(os.path.join(tmp, MANIFEST_NAME), manifest.to_json().encode())
        fsync_dir(tmp)
        failpoints.hit("after_manifest")

    def _install(self, tmp: str, step: int, token: str) -> None:
        """Rename a complete temp directory to ``step_X/`` (the local commit) and fsync the run directory.

        An existing copy of the step (a re-save right after a restore, or a corrupt copy replaced by a
        fetch from the durable tier) is swapped atomically enough that no other step is ever affected,
        then removed."""
        final = os.path.join(self.run_dir, step_dirname(step))
        if os.path.exists(final):
            aside = os.path.join(self.run_dir, temp_dirname(step, TempKind.REPLACED, token))
            os.rename(final, aside)
            os.rename(tmp, final)
            fsync_dir(self.run_dir)
            _remove_quietly(aside)
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
                _remove_quietly(listing.temp_path(t))

    def apply_retention(self) -> list[int]:
        """Delete steps the policy does not keep (never the newest, never one being read)."""
        self.clean_stale(spare_current=True)
        deleted = []
        for s in self.retention.deletable(self.committed_steps()):
            try:
                if delete_step(self.run_dir, s, TempKind.GC, self.topo.nonce):
                    deleted.append(s)
            except StepBusy:
                log.info("retention: step %d is being read; keeping it for now", s)
            except OSError as exc:
                # Uncommitted but not all removed: an abandoned temp directory, removed by the next
                # clean_stale. Not even uncommitted: kept, and tried again at the next save.
                log.warning("retention: cannot remove step %d from %s: %s", s, self.run_dir, exc)
        if deleted:
            log.info("retention removed steps %s from %s", deleted, self.run_dir)
        return deleted

    # ------------------------------------------------------------------ restore
    def restore(self, state: MutableMapping[str, Any], rank_map: Callable[[int], int] | None = None) -> int:
        """Restore the newest step that every rank can read and verify; return it (0 if none).

        Collective (foreground group). Candidates are the steps committed in every domain's local tier
        and the steps committed in the durable tier, newest first. A domain that lacks a candidate, or
        whose copy fails verification, fetches its part from the durable tier into its local tier
        (verified, then committed there) and the ranks read again. Corrupt steps are skipped with a
        warning; an incompatible checkpoint (missing key, shape mismatch, newer schema, per-rank state
        saved at another world size without ``rank_map``) raises on every rank. ``rank_map(rank)`` names
        the saved rank whose per-rank state and RNG state this rank loads.
        """
        topo = self.topo
        self._source_rank = topo.rank
        self._rank_mapped = rank_map is not None
        map_error: str | None = None
        if rank_map is not None:
            try:
                self._source_rank = int(rank_map(topo.rank))
            except Exception as exc:  # every rank must learn of it, or the others wait in the gather below
                map_error = f"rank_map({topo.rank}) failed: {exc!r}"
        t0 = time.perf_counter()
        self.last_restore = None
        skipped: list[int] = []
        if topo.is_leader:
            self.clean_stale(spare_current=False)
        mine = self.committed_steps() if topo.is_leader else None
        durable: list[int] | None = None
        listing_error: str | None = None
        if topo.rank == 0 and self.durable is not None:
            durable, listing_error = self._durable_steps()
        gathered = self.coord.all_gather((mine, durable, map_error, listing_error))
        errors = [g[2] for g in gathered if g[2]]
        if errors:
            raise ConfigError("; ".join(errors))
        lists = [g[0] for g in gathered]
        durable_set = set(gathered[0][1] or [])
        listing_error = gathered[0][3]
        unreachable: list[str] = [listing_error] if listing_error else []  # storage failures, not corruption
        leaders = [r for r in range(topo.world_size) if lists[r] is not None]
        common = set.intersection(*[set(lists[r]) for r in leaders]) if leaders else set()
        union = set().union(*[set(lists[r]) for r in leaders]) if leaders else set()
        if union - common - durable_set and topo.rank == 0:
            lacking = {
                topo.domain_of_rank[r]: sorted(union - set(lists[r])) for r in leaders if union - set(lists[r])
            }
            log.warning(
                "steps %s are committed in some storage domains but missing in others (%s)%s",
                sorted(union - common - durable_set),
                ", ".join(f"{d} lacks {s}" for d, s in lacking.items()),
                "" if self.durable is not None else "; they cannot be restored without a durable tier",
            )
        initialized = [
            v for v in state.values() if isinstance(v, torch.optim.Optimizer) and not v.state
        ]
        try:
            for step in sorted(common | durable_set, reverse=True):
                fetched = False
                here: int | None = None  # bytes this rank's domain fetched for this step (None: none)
                if step not in common:
                    # Some domain lacks it locally: its leader fetches it from the durable tier.
                    need = topo.is_leader and step not in (mine or [])
                    ok, here = self._fetch_round(step, need, unreachable)
                    if not ok:
                        skipped.append(step)
                        continue
                    fetched = need
                status, message, loaded = self._try_read(step, state)
                verdicts = self.coord.all_gather((status, message))
                if not any(s == "incompatible" for s, _ in verdicts) and step in durable_set:
                    bad_here = any(verdicts[r][0] != "ok" for r in topo.domain_ranks)
                    if any(v != "ok" for v, _ in verdicts):
                        # A local copy failed verification: the domains concerned fetch the step again
                        # from the durable tier, then every rank reads again.
                        if topo.rank == 0:
                            for m in (m for v, m in verdicts if v != "ok"):
                                log.warning("step %d: %s; fetching it from the durable tier", step, m)
                        need = topo.is_leader and bad_here and not fetched
                        ok, again = self._fetch_round(step, need, unreachable)
                        if again is not None:
                            here = (here or 0) + again
                        if ok:
                            status, message, loaded = self._try_read(step, state)
                            verdicts = self.coord.all_gather((status, message))
                incompatible = [m for s, m in verdicts if s == "incompatible"]
                if incompatible:
                    raise IncompatibleCheckpointError(incompatible[0])
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
                initialized = []
                log.info("restored step %d from %s%s", step, self.run_dir,
                         " (fetched from the durable tier)" if step not in common else "")
                self.last_restore = RestoreOutcome(
                    step, "durable" if here is not None else "local", time.perf_counter() - t0, loaded.bytes_read,
                    (here or 0) if topo.is_leader else 0, tuple(skipped))
                return step
        finally:
            for opt in initialized:  # nothing restored: give back a pristine optimizer
                opt.state.clear()
        where = self.run_dir + (f" or {self.durable.url}" if self.durable is not None else "")
        self.last_restore = RestoreOutcome(0, None, time.perf_counter() - t0, 0, 0, tuple(skipped))
        if unreachable or union or durable_set:
            self._no_restore(where, sorted(union | durable_set), unreachable)
        return 0

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

    def _durable_steps(self) -> tuple[list[int], str | None]:
        """The durable tier's committed steps, or none and why they could not be listed."""
        assert self.durable is not None
        try:
            return durable_steps(self.durable, self.run_id), None
        except ResilientSlurmError as exc:
            log.warning("cannot list the durable tier %s (%s); trying the node-local tier", self.durable.url, exc)
            return [], f"cannot list {self.durable.url}: {exc}"

    def _fetch_round(self, step: int, need: bool, unreachable: list[str]) -> tuple[bool, int | None]:
        """Collective: leaders with ``need`` fetch ``step`` from the durable tier. Returns whether every
        fetch succeeded, and the bytes this rank's domain fetched (None when it fetched nothing). Fetches
        that failed for a storage reason (not corruption) are appended to ``unreachable``."""
        err: str | None = None
        transient = False
        n: int | None = None
        if need:
            try:
                t0 = time.perf_counter()
                n = self._fetch(step)
                dt = time.perf_counter() - t0
                log.info("step %d: fetched %.1f MiB for %s from %s in %.2f s (%.1f MiB/s)", step, n / 2**20,
                         self.topo.domain, self.durable.url if self.durable else "?", dt, n / 2**20 / max(dt, 1e-9))
            except Exception as exc:  # every rank must learn of it, or the others hang
                err = f"{self.topo.domain}: fetching step {step} from the durable tier failed: {exc}"
                transient = _storage_failure(exc)
                log.error("%s", err)
                n = None
        gathered = self.coord.all_gather((err, n, transient))
        errors = [e for e, _, _ in gathered if e]
        unreachable += [e for e, _, t in gathered if e and t]
        if errors and self.topo.rank == 0:
            for e in errors:
                log.warning("skipping step %d: %s", step, e)
        return not errors, gathered[self.topo.domain_ranks[0]][1]

    def _fetch(self, step: int) -> int:
        """Leader: copy this domain's part of ``step`` from the durable tier into the local tier (verified,
        then committed like a save: temp directory, manifest last, rename). Returns bytes fetched."""
        from ..manifest import domain_key

        tier = self.durable
        assert tier is not None
        topo = self.topo
        root_m = read_durable_manifest(tier, self.run_id, step)
        src = topo.domain if topo.domain in root_m.nodes else root_m.first_domain
        dm = read_durable_manifest(tier, self.run_id, step, src)
        if dm.save_id != root_m.save_id:
            raise CorruptCheckpointError(f"{tier.url}: step {step}: the marker of {src} belongs to another save")
        md_key = domain_key(self.run_id, step, src, DCP_METADATA_NAME)
        md_bytes = tier.get_bytes(md_key)
        md = check_metadata(md_bytes, dm.dcp_metadata, source=f"{tier.url}/{md_key}")
        same_layout = (src == topo.domain and dm.world_size == topo.world_size
                       and tuple(dm.nodes.get(src, ())) == tuple(topo.domain_ranks))
        if same_layout:  # the ranks here are the ones that wrote this domain's shards: they need only those
            wanted = {s.path for s in dm.shards_of_node(src)}
        else:  # other nodes or another world size: every file this metadata points at
            wanted = {info.relative_path for info in md.storage_data.values()}
        by_path = {s.path: s for s in dm.shards}
        missing = wanted - set(by_path)
        if missing:
            raise CorruptCheckpointError(f"{tier.url}: step {step}: files {sorted(missing)} are not in the manifest")
        os.makedirs(self.run_dir, mode=0o700, exist_ok=True)
        total = sum(by_path[p].size for p in wanted)
        check_free_space(self.run_dir, total + self.free_space_margin, what=f"fetching step {step}")
        tmp = os.path.join(self.run_dir, temp_dirname(step, TempKind.FETCH, topo.nonce))
        _remove_quietly(tmp)
        os.makedirs(tmp, mode=0o700)
        prefix = durable_step_key(self.run_id, step)
        try:
            for p in sorted(wanted):
                e = by_path[p]
                tier.get_file(f"{prefix}/{p}", os.path.join(tmp, p), size=e.size, checksum=e.checksum)
            atomic_write(os.path.join(tmp, DCP_METADATA_NAME), md_bytes)
            shards = tuple(dataclasses.replace(s, node=topo.domain) if s.path in wanted else s for s in dm.shards)
            local = dataclasses.replace(dm, node=topo.domain, shards=shards)
            atomic_write(os.path.join(tmp, MANIFEST_NAME), local.to_json().encode())
            fsync_dir(tmp)
            self._install(tmp, step, f"fetch-{topo.nonce}")
        except BaseException:
            _remove_quietly(tmp)
            raise
        return total

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

    def _try_read(self, step: int, state: MutableMapping[str, Any]) -> tuple[str, str, _Loaded | None]:
        step_dir = os.path.join(self.run_dir, step_dirname(step))
        try:
            with reading_step(step_dir):
                return "ok", "", self._read_step(step, step_dir, state)
        except IncompatibleCheckpointError as exc:
            return "incompatible", str(exc), None
        except (CorruptCheckpointError, OSError, CheckpointError) as exc:
            return "corrupt", f"rank {self.topo.rank}: {exc}", None
        except Exception as exc:  # unexpected: every rank must still learn of it, or the others hang
            log.exception("step %d: unexpected error while reading %s", step, step_dir)
            return "incompatible", f"rank {self.topo.rank}: reading step {step} failed: {exc!r}", None

    def _read_step(self, step: int, step_dir: str, state: MutableMapping[str, Any]) -> _Loaded:
        mpath = os.path.join(step_dir, MANIFEST_NAME)
        try:
            manifest = read_manifest_file(mpath)
        except FileNotFoundError as exc:
            raise CorruptCheckpointError(f"{mpath}: missing") from exc
        if manifest.step != step or manifest.run_id != self.run_id:
            raise CorruptCheckpointError(
                f"{mpath}: says run {manifest.run_id!r} step {manifest.step}, expected {self.run_id!r} step {step}"
            )
        md = read_metadata_file(os.path.join(step_dir, DCP_METADATA_NAME), manifest.dcp_metadata)
        self._check_per_rank(step, step_dir, manifest, md, state)
        target = state_mod.prepare_load_target(state, md, rank=self.topo.rank, capture_rng=self.capture_rng,
                                               source_rank=self._source_rank, extra_keys=(DDP_KEY,))
        planner = SafeLoadPlanner(self._source_rank)
        planner.set_up_planner(target, md, is_coordinator=self.topo.rank == 0)
        try:
            plan = planner.create_local_plan()
        except (RuntimeError, ValueError, KeyError) as exc:
            raise IncompatibleCheckpointError(
                f"step {step} in {step_dir} does not fit the state being restored: {exc}. Restore with the "
                "same model/optimizer structure, or move the run directory aside to start afresh."
            ) from exc
        plan = planner.finish_plan(plan)
        shards = {s.path: s for s in manifest.shards_of_node(manifest.node)}
        chunk_sums = {(s.path, c.offset): c for s in shards.values() for c in s.chunks}
        # Group what we need by file, then read each file's needed span once.
        needed: dict[str, list[Any]] = {}
        for ri in plan.items:
            info = md.storage_data[ri.storage_index]
            if info.relative_path not in shards:
                raise CorruptCheckpointError(
                    f"{step_dir}: {ri.storage_index.fqn} lives in {info.relative_path}, which is not stored on "
                    f"this node ({self.topo.domain}); it must come from another node or the durable tier"
                )
            needed.setdefault(info.relative_path, []).append((ri, info))
        buffers: dict[str, tuple[torch.Tensor, int]] = {}
        decoded: dict[tuple[str, int], Any] = {}
        for rel, reqs in needed.items():
            path = os.path.join(step_dir, rel)
            entry = shards[rel]
            try:
                st = os.stat(path)
            except FileNotFoundError as exc:
                raise CorruptCheckpointError(f"{path}: shard file missing") from exc
            if st.st_size != entry.size:
                raise CorruptCheckpointError(
                    f"{path}: size {st.st_size} bytes, manifest says {entry.size} (truncated or overwritten)"
                )
            end = max(info.offset + info.length for _, info in reqs)
            for _, info in reqs:
                c = chunk_sums.get((rel, info.offset))
                if c is None or c.length != info.length:
                    raise CorruptCheckpointError(f"{path}: no checksum recorded for bytes {info.offset}+{info.length}")
            buf = aligned_buffer(end, prefault=False)  # the read writes every page
            mv = as_memoryview(buf)
            sums = read_file_into(
                path, mv, end, threads=self.io_threads, ranges=[(info.offset, info.length) for _, info in reqs]
            )
            for (ri, info), got in zip(reqs, sums):
                if got != chunk_sums[(rel, info.offset)].checksum:
                    raise CorruptCheckpointError(
                        f"{path}: checksum mismatch in {ri.storage_index.fqn} (bytes {info.offset}+{info.length}): "
                        "the file is corrupt"
                    )
                if ri.type == LoadItemType.BYTE_IO:
                    # Decode plain values now, before anything live is touched: a value the safe loader
                    # refuses makes the step unusable; it must not half-restore the state.
                    try:
                        decoded[(rel, info.offset)] = torch.load(
                            io.BytesIO(bytes(mv[info.offset : info.offset + info.length])),
                            map_location="cpu",
                            weights_only=True,
                        )
                    except Exception as exc:
                        last = str(exc).strip().splitlines()[-1] if str(exc).strip() else ""
                        raise CorruptCheckpointError(
                            f"{path}: value {ri.storage_index.fqn} cannot be loaded safely ({type(exc).__name__}: {last})"
                        ) from exc
            buffers[rel] = (buf, end)
        read = sum(info.length for reqs in needed.values() for _, info in reqs)
        return _Loaded(planner=planner, target=target, md=md, needed=needed, buffers=buffers, decoded=decoded,
                       bytes_read=read)


@dataclass(frozen=True)
class _Plan:
    """One save's plan on this rank."""

    planner: DefaultSavePlanner
    plan: GlobalSavePlan
    layout: ShardLayout
    mismatches: tuple[ReplicaMismatch, ...]
    timing: dict[str, float]  # digest_s (hashing) and reduce_s (the all_reduce) of the replication proofs


def _is_dtensor(v: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return False
    return isinstance(v, DTensor)


@dataclass
class _Loaded:
    """Verified bytes of one step, ready to be copied into the live state."""

    planner: SafeLoadPlanner
    target: dict[str, Any]
    md: Metadata
    needed: dict[str, list[Any]]
    buffers: dict[str, tuple[torch.Tensor, int]]
    decoded: dict[tuple[str, int], Any] = field(default_factory=dict)
    bytes_read: int = 0

    def apply(self) -> None:
        for rel, reqs in self.needed.items():
            buf, _ = self.buffers[rel]
            for ri, info in reqs:
                blob = buf[info.offset : info.offset + info.length]
                if ri.type == LoadItemType.BYTE_IO:
                    self.planner.set_value(ri, self.decoded[(rel, info.offset)])
                    continue
                stored = self._stored_tensor(ri, blob)
                part = narrow_tensor_by_index(stored, ri.storage_offsets, ri.lengths)
                dest = self.planner.resolve_tensor(ri).detach()
                if dest.size() != part.size():
                    raise IncompatibleCheckpointError(
                        f"{ri.dest_index.fqn}: checkpoint has size {tuple(part.size())}, state has {tuple(dest.size())}"
                    )
                with torch.no_grad():
                    dest.copy_(part)
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


def _storage_failure(exc: BaseException) -> bool:
    """A failure that says nothing about the checkpoint (an endpoint down, a timeout, a full local disk),
    as opposed to corruption or a missing object: the step may restore once storage is back."""
    if isinstance(exc, (CorruptCheckpointError, IncompatibleCheckpointError, PermanentError)):
        return isinstance(exc, InsufficientSpaceError)
    return isinstance(exc, (StorageError, OSError, TransientError))


def _remove_quietly(path: str) -> None:
    try:
        remove_tree(path)
    except OSError as exc:
        log.warning("could not remove %s: %s", path, exc)


__all__ = ["Engine", "PendingSave", "RestoreOutcome", "SaveOutcome", "ResilientSlurmError", "shard_filename"]
