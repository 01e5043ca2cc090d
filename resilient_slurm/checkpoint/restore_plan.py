"""Restore plan: which steps a restore tries, newest first, and where each domain takes each from.

Who calls what: the :class:`~.restore.Restorer` (restore.py) gathers every rank's :class:`Listing` in its
first phase ("listing the committed steps") and passes them to :func:`plan_restore`, which returns the
:class:`RestorePlan`: the candidates (:class:`Candidate`: committed in every domain, or taken from a
partner's replica (peers.py: :func:`~.peers.peer_sources`) or the durable tier where a domain lacks it),
the steps left out and why. When no candidate restores, :func:`no_restore` says what ``restore_fallback``
makes of it. Pure: plain data in, plain data out, the same on every rank (every input is gathered); it
reads nothing, logs nothing and talks to no other rank, so tests/test_restore_plan.py checks it in process.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..errors import CorruptCheckpointError, RestoreUnavailableError
from .coordination import Topology
from .peers import Held, peer_sources


@dataclass(frozen=True)
class Listing:
    """One rank's part of a restore's candidates (:meth:`Restorer.restore <.restore.Restorer.restore>`, its
    first phase)."""

    committed: list[int] | None  # the steps committed in its domain (leaders; None elsewhere)
    durable: list[int] | None  # the steps committed in the durable tier (rank 0; None elsewhere)
    durable_error: str | None  # why the durable tier could not be listed (rank 0)
    held: tuple[Held, ...]  # partners' replicas its node holds (leaders)
    saved_at: dict[int, float]  # which save each committed step is: its manifest's created_at (leaders)


@dataclass(frozen=True)
class Candidate:
    """A step the restore tries, and where the domains that lack it locally take it from."""

    step: int
    lacking: tuple[int, ...]  # leaders whose domain has not committed it locally (empty: every domain has)
    peers: Mapping[int, tuple[int, str]]  # lacking leader -> (leader holding a replica for it, replica's domain)
    durable: bool  # committed in the durable tier
    save_of: float | None  # the save (created_at) of the domains' own copies; None: no copy's manifest read

    @property
    def local(self) -> bool:
        """Committed in every domain's local tier."""
        return not self.lacking


@dataclass(frozen=True)
class RestorePlan:
    """What the listings allow: the candidates newest first, and the steps left out."""

    candidates: tuple[Candidate, ...]  # newest first
    existing: tuple[int, ...]  # every step committed somewhere (a domain or the durable tier), sorted
    unreachable: tuple[str, ...]  # why the durable tier could not be listed (storage failures, not corruption)
    mixed: tuple[int, ...]  # committed by different saves in different domains: never candidates
    stranded: tuple[int, ...]  # committed in some domains only, with no replica or durable copy for the rest
    lacks: Mapping[str, list[int]]  # domain -> the steps other domains committed that it lacks


def plan_restore(listings: Sequence[Listing], topo: Topology) -> RestorePlan:
    """The restore plan of every rank's :class:`Listing` (``listings[r]``: rank r's), for ``topo``."""
    lists: list[list[int]] = [g.committed or [] for g in listings]
    durable_set = set(listings[0].durable or [])
    listing_error = listings[0].durable_error
    leaders = [r for r in range(topo.world_size) if listings[r].committed is not None]
    common = set.intersection(*[set(lists[r]) for r in leaders]) if leaders else set()
    union = set().union(*[set(lists[r]) for r in leaders]) if leaders else set()
    replicas = {r: list(listings[r].held) for r in leaders if listings[r].held}

    def stamps_of(step: int) -> set[float]:
        """The saves (created_at) of the domains' own copies of ``step`` whose manifests read."""
        return {listings[r].saved_at[step] for r in leaders if step in listings[r].saved_at}

    # One step number committed by two different saves in different domains (a run that went back to an
    # older step and saved this one again where only some domains committed it, or were fetched into)
    # would restore a mix of both: never a candidate.
    mixed = {s for s in union if len(stamps_of(s)) > 1}

    def lacking_in(step: int) -> list[int]:
        return [r for r in leaders if step not in set(lists[r])]

    def sources(step: int) -> dict[int, tuple[int, str]]:
        return peer_sources(step, lacking_in(step), replicas, topo, sorted(stamps_of(step))) if replicas else {}

    # Steps every domain has, locally or as a partner's replica of exactly its ranks.
    from_peers = {s for s in (union | {h.step for hs in replicas.values() for h in hs}) - common
                  if len(sources(s)) == len(lacking_in(s))}
    stranded = union - common - durable_set - from_peers
    lacks = {topo.domain_of_rank[r]: sorted(union - set(lists[r])) for r in leaders if union - set(lists[r])}
    candidates = tuple(
        Candidate(step, () if step in common else tuple(lacking_in(step)),
                  {} if step in common else sources(step), step in durable_set,
                  next(iter(stamps_of(step)), None))
        for step in sorted((common | durable_set | from_peers) - mixed, reverse=True))
    return RestorePlan(candidates, tuple(sorted(union | durable_set)), (listing_error,) if listing_error else (),
                       tuple(sorted(mixed)), tuple(sorted(stranded)), lacks)


@dataclass(frozen=True)
class NoRestore:
    """What a restore that restored nothing although checkpoints exist does (:func:`no_restore`)."""

    message: str  # what happened (rank 0 logs it as a warning when ``error`` is None)
    error: Exception | None  # raised on every rank; None: start from step 0 (restore_fallback=fresh)


def no_restore(where: str, steps: Sequence[int], unreachable: Sequence[str], restore_fallback: str
               ) -> NoRestore | None:
    """Checkpoints exist (``steps``, or may: the durable tier could not be listed or read, ``unreachable``)
    and none was restored. Starting from step 0 would silently throw a run away, so every rank raises unless
    ``restore_fallback`` is ``fresh``: RestoreUnavailableError (worth a requeue: storage may come back) when
    a storage failure was involved, else CorruptCheckpointError (a person must look). None when there is
    nothing to restore (a fresh run)."""
    if not (unreachable or steps):
        return None
    what = (f"committed steps {list(steps)} exist in {where} but none could be restored" if steps
            else f"no checkpoint could be found in {where}")
    if unreachable:
        what += " because the durable tier failed (" + "; ".join(dict.fromkeys(unreachable)) + ")"
    if restore_fallback == "fresh":
        return NoRestore(what, None)
    msg = (f"{what}. Not starting over from step 0: fix the cause and run again, or set restore_fallback=fresh "
           "(RSLURM_RESTORE_FALLBACK) to start from step 0 anyway")
    if unreachable:
        return NoRestore(msg, RestoreUnavailableError(msg))
    return NoRestore(msg, CorruptCheckpointError(msg + "; `rslurm verify` names what is wrong with each step"))


__all__ = ["Candidate", "Listing", "NoRestore", "RestorePlan", "no_restore", "plan_restore"]
