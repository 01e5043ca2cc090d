"""Restore: the newest step every rank can read and verify, loaded in place only once all ranks verified.

Who calls what: :meth:`Engine.restore <resilient_slurm.checkpoint.engine.Engine.restore>` delegates to
the engine's :class:`Restorer`, built with the engine's collaborators: the topology and coordinator, the
run directory, the engine itself as :class:`LocalSteps` (its retention methods list committed steps and
remove abandoned temp directories), the engine's :class:`~resilient_slurm.checkpoint.ddp.DDPTracker` and
a :class:`~resilient_slurm.checkpoint.fetch.DurableFetcher` (fetch.py) for the durable tier. The Restorer
keeps the orchestration, the phases in order; what it decides and reads lives beside it: the candidates in
restore_plan.py (pure), one restore round of a step in restore_round.py (:class:`~.restore_round.StepReader`),
the in-place reads and the copies into the live state in apply.py.

Call order of :meth:`Restorer.restore` (collective, foreground group, every rank):

1. domain leaders remove abandoned temp directories and list the steps committed in their domain; rank 0
   lists the durable tier (:meth:`DurableFetcher.steps`); one all_gather shares both (and a failing
   ``rank_map``). :func:`~.restore_plan.plan_restore` makes the candidates of them: the steps committed
   in every domain, those every lacking domain can take from a partner's replica, and the durable steps,
   newest first.
2. for each candidate: a domain that lacks it fetches its part (:meth:`DurableFetcher.fetch_round`,
   collective): every rank first makes its load plan (:meth:`StepReader.planned_reads
   <.restore_round.StepReader.planned_reads>`, against the durable metadata when its domain lacks the
   step) and the leader fetches the items its ranks' plans read (fetch.py: a file whole when they read
   most of it, else only those items); then every rank reads and verifies what it needs
   (:meth:`StepReader.read_round <.restore_round.StepReader.read_round>`, collective: it reads the
   manifest and ``.metadata``, makes the per-rank check and compares the state with the step (compat.py);
   one all_gather says whether every rank could, and where every rank has saved keys it does not hold
   (pipeline stages), one all_reduce finds those no rank holds; then it decides (every missing,
   unexpected and reshaped key of this rank in one error), makes a DCP load plan against the live state,
   reads the byte ranges it needs and checks them item by item against the manifest's xxh3: small items
   and plain values (decoded with ``weights_only=True``) into a buffer before any live tensor is written,
   then each large CPU tensor straight into itself (in place, apply.py), under a shared lock on the step
   so retention cannot delete it; an all_gather of the verdicts follows.
   A copy that failed verification is fetched again from the durable tier when the step is there, and
   every rank reads again.
3. an incompatibility anywhere (missing key, shape, per-rank state at another world size without
   ``rank_map``) raises on every rank, each with its own differences and the ranks refused named; corruption anywhere skips the step on every rank, with a warning
   naming the file and the reason; only when every rank verified does each copy the rest into its live state
   (:meth:`_Loaded.apply <.apply._Loaded.apply>`, then ``state.apply_loaded``) and hand DDP's recorded
   layout to the tracker.
4. nothing restored although checkpoints exist (or the durable tier could not be read): every rank raises
   (:func:`~.restore_plan.no_restore`) unless ``restore_fallback`` is ``fresh``.

What a failed round leaves: its large tensors may already hold some of its bytes. Every tensor written in
place is recorded (:attr:`StepReader.touched <.restore_round.StepReader.touched>`, kept across restores of
this Checkpointer); a step that verifies must write every recorded tensor of the state, or its verdict is
"mixed" and every rank raises (:meth:`StepReader.left_mixed <.restore_round.StepReader.left_mixed>`); a
restore that raises names them on each rank (:meth:`Restorer._say_touched`). ``restore_fallback=fresh`` reads nothing in place,
so that a restore that finds nothing leaves the program's state as it was.

What the restore did is kept in :attr:`Restorer.last_restore` (:class:`RestoreOutcome`) for the caller's
event log; nothing here writes events.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..errors import ConfigError, CorruptCheckpointError, IncompatibleCheckpointError, add_note
from ..manifest import read_manifest_file
from ..rundir import RunDir
from . import state as state_mod
from .apply import PLACE_MIN_BYTES, _Loaded, held
from .compat import CompatReport
from .coordination import Coordinator, Topology
from .ddp import DDP_KEY, DDPTracker
from .fetch import DurableFetcher
from .peers import PeerReplicas
from .restore_plan import Listing, no_restore, plan_restore
from .restore_round import PIN_FOR_CUDA, StepReader

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
    placed_bytes: int = 0  # bytes read straight into the live tensors (apply.py: place_into)
    peer_bytes: int = 0  # bytes this rank's domain received from a partner's replica (domain leaders only)


class LocalSteps(Protocol):
    """The node-local tier's listing and clean-up, as the engine's retention does them."""

    def committed_steps(self) -> list[int]: ...

    def clean_stale(self, *, spare_current: bool) -> None: ...


class Restorer:
    """Restore for one run from the node-local tier, fetching from the durable tier where needed. One per
    rank, built by the :class:`~.engine.Engine`. The candidates come from :func:`~.restore_plan.plan_restore`
    (restore_plan.py), each step is read by a :class:`~.restore_round.StepReader` (restore_round.py)."""

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
        self.restore_fallback = restore_fallback  # fail | fresh: when checkpoints exist but none restores
        self.reader = StepReader(topo, coord, run_id, run_dir, fetcher=fetcher, io_threads=io_threads,
                                 capture_rng=capture_rng)
        self.last_restore: RestoreOutcome | None = None

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
        topo, reader = self.topo, self.reader
        reader.allow_missing, reader.allow_unexpected = allow_missing, allow_unexpected
        # Large tensors are read straight into the live state, so a failed candidate can leave bytes there:
        # not where a failed restore must leave the program's own state (restore_fallback=fresh).
        reader.in_place = self.restore_fallback != "fresh"
        tier = self.fetcher.tier
        reader.source_rank = topo.rank
        reader.rank_mapped = rank_map is not None
        t0 = time.perf_counter()
        self.last_restore = None
        skipped: list[int] = []

        def listing() -> Listing:
            """This rank's part of the candidates: its domain's committed steps (leaders), the durable tier's
            (rank 0), the partners' replicas it holds, and which save each local step is."""
            if rank_map is not None:
                try:
                    reader.source_rank = int(rank_map(topo.rank))
                except Exception as exc:
                    raise ConfigError(f"rank_map({topo.rank}) failed: {exc!r}") from exc
            if topo.is_leader:
                self.local.clean_stale(spare_current=False)
            mine = self.local.committed_steps() if topo.is_leader else None
            durable, listing_error = self.fetcher.steps() if topo.rank == 0 and tier is not None else (None, None)
            held = self.peers.held() if topo.is_leader and self.peers is not None else []
            return Listing(mine, durable, listing_error, tuple(held), self._saved_at(mine) if topo.is_leader else {})

        plan = plan_restore(self.coord.phase("listing the committed steps", listing), topo)
        unreachable: list[str] = list(plan.unreachable)  # storage failures, not corruption
        if plan.mixed and topo.rank == 0:
            log.warning("steps %s were committed by different saves in different storage domains; they are not "
                        "restored (the previous step is tried)", list(plan.mixed))
        if plan.stranded and topo.rank == 0:
            log.warning(
                "steps %s are committed in some storage domains but missing in others (%s)%s",
                list(plan.stranded),
                ", ".join(f"{d} lacks {s}" for d, s in plan.lacks.items()),
                "" if tier is not None else "; they cannot be restored without a durable tier",
            )
        initialized = [
            v for v in state.values() if isinstance(v, torch.optim.Optimizer) and not v.state
        ]
        reader.fresh_optimizers = frozenset(k for k, v in state.items() if any(v is o for o in initialized))
        try:
            for cand in plan.candidates:
                step = cand.step
                fetched = False
                here: int | None = None  # bytes this rank's domain fetched for this step (None: none)
                peer: int | None = None  # bytes it received from a partner's replica (None: none)
                if not cand.local:
                    # Some domains lack it locally: each takes it from a partner's replica when one holds
                    # it (peers.py), the others from the durable tier, only the items their ranks'
                    # load plans read.
                    missing = list(cand.lacking)
                    pairs = dict(cand.peers) if self.peers is not None else {}
                    if pairs:
                        assert self.peers is not None
                        got, peer = self.peers.restore_round(self.coord, step, pairs)
                        missing = [r for r in missing if r not in got]
                    if missing and not cand.durable:
                        skipped.append(step)
                        continue
                    if missing:
                        lacks = topo.domain_ranks[0] in missing
                        need = topo.is_leader and lacks
                        planned = reader.planned_reads(step, state, local=not lacks)
                        ok, here = self.fetcher.fetch_round(step, need, unreachable, planned, save_of=cand.save_of)
                        if not ok:
                            skipped.append(step)
                            continue
                        fetched = need
                verdicts, loaded = reader.read_round(step, state)
                if not any(s in ("incompatible", "mixed") for s, _ in verdicts) and cand.durable:
                    bad_here = any(verdicts[r][0] != "ok" for r in topo.domain_ranks)
                    if any(v != "ok" for v, _ in verdicts):
                        # A local copy failed verification: the domains concerned fetch the step again
                        # from the durable tier, then every rank reads again.
                        if topo.rank == 0:
                            for m in (m for v, m in verdicts if v != "ok"):
                                log.warning("step %d: %s; fetching it from the durable tier", step, m)
                        need = topo.is_leader and bad_here and not fetched
                        planned = reader.planned_reads(step, state, local=not bad_here)
                        ok, again = self.fetcher.fetch_round(step, need, unreachable, planned, save_of=cand.save_of)
                        if again is not None:
                            here = (here or 0) + again
                        if ok:
                            verdicts, loaded = reader.read_round(step, state)
                refused = [r for r, (s, _) in enumerate(verdicts) if s == "incompatible"]
                if refused:
                    raise IncompatibleCheckpointError(_refusal(topo.rank, refused, verdicts))
                mixed = [m for s, m in verdicts if s == "mixed"]
                if mixed:
                    raise CorruptCheckpointError("\n".join([*mixed, (
                        f"Step {step} is not restored over them. Move the failed step aside (the warnings above name "
                        "it; rslurm verify says what is wrong with it) and restore again with the state built "
                        "again (a new process does)")]))
                bad = [m for s, m in verdicts if s != "ok"]
                if bad:
                    if topo.rank == 0:
                        for m in bad:
                            log.warning("skipping step %d: %s; trying the previous step", step, m)
                    skipped.append(step)
                    continue
                assert loaded is not None
                self._apply(step, state, loaded)
                report = reader.compat
                # An optimizer that starts afresh (compat.py) gives back the state restore initialized.
                initialized = [v for k, v in state.items() if report and k in report.fresh and v in initialized]
                tier_used = "durable" if here is not None else "peer" if peer is not None else "local"
                log.info("restored step %d from %s%s", step, self.run_dir,
                         {"durable": " (fetched from the durable tier)", "peer": " (copied from a partner's replica)",
                          "local": ""}[tier_used])
                self.last_restore = RestoreOutcome(
                    step, tier_used, time.perf_counter() - t0, loaded.bytes_read,
                    (here or 0) if topo.is_leader else 0, tuple(skipped), reader.provenance, report,
                    loaded.placed_bytes, (peer or 0) if topo.is_leader else 0)
                return step
        except Exception as exc:
            self._say_touched(exc, state)
            raise
        finally:
            for opt in initialized:  # nothing restored: give back a pristine optimizer
                opt.state.clear()
        where = self.run_dir + (f" or {tier.url}" if tier is not None else "")
        self.last_restore = RestoreOutcome(0, None, time.perf_counter() - t0, 0, 0, tuple(skipped))
        try:
            if held(reader.touched, state):
                # Nothing restored, and the state holds bytes of a failed step: never a fresh start over it.
                outcome = no_restore(where, list(plan.existing), unreachable, "fail")
                raise (outcome.error if outcome is not None and outcome.error is not None
                       else CorruptCheckpointError(f"nothing to restore in {where}"))
            self._no_restore(where, list(plan.existing), unreachable)
        except Exception as exc:
            self._say_touched(exc, state)
            raise
        return 0

    def _say_touched(self, exc: BaseException, state: Mapping[str, Any]) -> None:
        """A restore that raises after a failed round wrote into live tensors: say which, on this rank."""
        touched = sorted(set(held(self.reader.touched, state).values()))
        if not touched:
            return
        shown = ", ".join(touched[:8]) + (f" and {len(touched) - 8} more" if len(touched) > 8 else "")
        note = (f"rank {self.topo.rank}: the state's tensors {shown} hold bytes of a step that was not restored "
                "(read into them in place before the restore failed): build the state again before using it (a "
                "requeued or restarted job does, in its new process)")
        add_note(exc, note)
        log.error("%s", note)

    def _apply(self, step: int, state: MutableMapping[str, Any], loaded: _Loaded) -> None:
        """Every rank verified ``step``: put what this rank read into its live state, hand DDP's recorded
        layout to the tracker, and (rank 0) log what the restore left out on purpose. Every tensor a failed
        round wrote into is written by this step (the verdict checked it: StepReader.left_mixed)."""
        try:
            loaded.apply()
            state_mod.apply_loaded(state, loaded.target, rank=self.reader.source_rank)
        except Exception as exc:
            note = (f"rank {self.topo.rank}: applying step {step} failed after every rank verified it: the state may "
                    f"hold part of step {step} and part of what it held before; build the state again before using "
                    "it (a requeued or restarted job does, in its new process)")
            add_note(exc, note)
            log.error("%s", note)
            raise
        # The state's tensors a failed round wrote into hold this step now (the verdict checked that it writes them
        # all: StepReader.left_mixed); tensors of a state not restored here still hold the failed step's bytes.
        for r in held(self.reader.touched, state):
            del self.reader.touched[r]
        self.ddp.expect(state, loaded.target.get(DDP_KEY))
        report = self.reader.compat
        if report and self.topo.rank == 0:
            _log_compat(step, report)

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
        """Checkpoints exist (or may) and none was restored: raise on every rank, or (``restore_fallback``
        ``fresh``) warn on rank 0 and start from step 0 (:func:`~.restore_plan.no_restore` decides)."""
        outcome = no_restore(where, steps, unreachable, self.restore_fallback)
        if outcome is None:
            return
        if outcome.error is not None:
            raise outcome.error
        if self.topo.rank == 0:
            log.warning("%s; starting from step 0 (restore_fallback=fresh)", outcome.message)


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


# Moved to restore_round.py, restore_plan.py and apply.py; importable from here as before.
_Listing = Listing
__all__ = ["PIN_FOR_CUDA", "PLACE_MIN_BYTES", "LocalSteps", "RestoreOutcome", "Restorer", "_Loaded"]
