"""Rank coordination for saves and restores: process groups, storage domains, tiny collectives.

Who calls what: every rank constructs one :class:`Coordinator` (collective: it creates two gloo groups
when torch.distributed is initialized). The training thread uses the *foreground* group (save-step
agreement, planning, restore); the background writer uses the *background* group (commit), so the two
threads never interleave collectives on one group. Without torch.distributed everything is local.

A *storage domain* is one real checkpoint directory and the ranks that write into it, whatever their
node names: ranks whose local roots are the same directory (same host, device and inode; or, across
hosts, a shared filesystem, detected with probe files) form one domain, and distinct directories on one
host (one NVMe per GPU) are distinct domains. A domain commits its own manifest listing exactly the
shards in its directory, and replicated state is written once per directory, never twice into one place.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import secrets
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from .. import failpoints
from ..errors import ConfigError, DistributedError, ResilientSlurmError
from ..paths import expand_local_dir

log = logging.getLogger(__name__)


T = TypeVar("T")


@dataclass(frozen=True)
class RankError:
    """What one rank's part of a phase raised, as every rank learns it."""

    rank: int
    kind: str  # the exception's class name
    message: str
    node: str = ""  # the rank's node, when its coordinator knows it

    def describe(self) -> str:
        """``rank 3 (node7): message`` (a message that names its rank already is left as it is)."""
        if self.message.startswith(f"rank {self.rank}"):
            return self.message
        return f"rank {self.rank}{f' ({self.node})' if self.node else ''}: {self.message}"


class PhaseError(DistributedError):
    """A phase failed on ranks whose errors are of different kinds (or not the product's own): raised on every
    rank, naming the phase and each failed rank with its error (:attr:`errors`)."""

    def __init__(self, message: str, errors: tuple[RankError, ...] = ()) -> None:
        super().__init__(message)
        self.errors = errors


def _error_classes() -> dict[str, type[ResilientSlurmError]]:
    """The product's error classes by name: the only ones a phase re-raises by a name another rank sent."""
    out: dict[str, type[ResilientSlurmError]] = {}
    todo: list[type[ResilientSlurmError]] = [ResilientSlurmError]
    while todo:
        cls = todo.pop()
        out.setdefault(cls.__name__, cls)
        todo.extend(cls.__subclasses__())
    return out


def phase_error(name: str, errors: Sequence[RankError]) -> ResilientSlurmError:
    """The error every rank raises when ``errors`` (at least one) happened in phase ``name``: of the failed
    ranks' class when they share one of the product's classes (the launcher classes an incarnation by it:
    a user's configuration error, a storage failure worth a requeue), else :class:`PhaseError`. The message
    is each distinct error once, naming its ranks."""
    by_message: dict[str, list[int]] = {}
    for e in errors:
        by_message.setdefault(e.message, []).append(e.rank)
    node_of = {e.rank: e.node for e in errors}
    text = "; ".join(RankError(rs[0], "", m, node_of[rs[0]]).describe() if len(rs) == 1 else f"ranks {rs}: {m}"
                     for m, rs in by_message.items())
    kinds = {e.kind for e in errors}
    cls = _error_classes().get(next(iter(kinds))) if len(kinds) == 1 else None
    if cls is not None:
        try:
            return cls(text)
        except TypeError:  # a class that needs more than a message
            pass
    return PhaseError(f"{name} failed: {text}", tuple(errors))


class RankWaits:
    """Since when each thread of this process has been waiting for other ranks (a collective, a peer
    transfer). The checkpoint writer's exit (writer.py) takes a long wait of its thread as the evidence that
    they are not coming."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._since: dict[int, float] = {}

    def reset(self) -> None:
        """A forked child: no thread of the parent waits here (and the lock may have been held)."""
        self._lock = threading.Lock()
        self._since = {}

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Around one wait for other ranks (nested waits count from the outer one)."""
        me = threading.get_ident()
        with self._lock:
            outer = me in self._since
            if not outer:
                self._since[me] = time.monotonic()
        try:
            yield
        finally:
            if not outer:
                with self._lock:
                    self._since.pop(me, None)

    def waited(self, thread: int | None, since: float = 0.0) -> float:
        """Seconds thread ``thread`` has been waiting in its wait under way, counted from ``since`` at the
        earliest (a ``time.monotonic()``); 0.0 when it is not waiting."""
        with self._lock:
            began = self._since.get(thread) if thread is not None else None
        return 0.0 if began is None else max(0.0, time.monotonic() - max(began, since))


#: This process's waits for other ranks, by thread.
RANK_WAITS = RankWaits()
os.register_at_fork(after_in_child=RANK_WAITS.reset)


class Coordinator:
    """Collectives on dedicated gloo groups; trivial when not distributed.

    Every cross-rank step of the engine is a *phase* (:meth:`phase`, :meth:`phase_max`, :meth:`phase_flags`):
    each rank runs its part, and if it raised on any rank, every rank raises the same error naming every
    failed rank; a rank never waits in a collective that a failed rank will not join."""

    def __init__(self, timeout_s: float = 600.0, node: str = "") -> None:
        self.node = node  # this rank's node name, in the errors of its failed phases
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        self._fg: Any = None
        self._bg: Any = None
        self._peer: Any = None
        if self.distributed and self.world_size > 1:
            timeout = datetime.timedelta(seconds=timeout_s)
            self._timeout = timeout
            # Two groups: collectives from the writer thread must never interleave with the trainer's.
            self._fg = dist.new_group(backend="gloo", timeout=timeout)
            self._bg = dist.new_group(backend="gloo", timeout=timeout)

    @property
    def multi(self) -> bool:
        """True when there is more than one rank to coordinate with."""
        return self._fg is not None

    def phase(self, name: str, fn: Callable[[], T], *, background: bool = False,
              error: Callable[[str, list[RankError]], Exception] = phase_error) -> list[T]:
        """Run ``fn`` here and share every rank's result (one all_gather): the results in rank order. If ``fn``
        raised on any rank, every rank raises ``error(name, errors)`` (default :func:`phase_error`; a failed
        rank's own exception is its cause). ``name`` names the phase in errors; ``background``: the writer
        thread's group."""
        mine: T | None = None
        err: RankError | None = None
        exc: Exception | None = None
        try:
            failpoints.hit_phase(name)
            mine = fn()
        except Exception as e:  # every rank must learn of it, or the others wait in the gather below
            exc, err = e, RankError(self.rank, type(e).__name__, str(e), self.node)
        gathered = self._all_gather((mine, err), background=background)
        errors = [e for _, e in gathered if e is not None]
        if errors:
            raise error(name, errors) from exc
        return [g for g, _ in gathered]

    def phase_max(self, name: str, fn: Callable[[], Sequence[int]], length: int, *,
                  background: bool = False) -> list[int]:
        """Run ``fn`` here (``length`` integers, the same length on every rank) and return their element-wise
        maximum across ranks: one all_reduce, the size of the vector. If ``fn`` raised (or returned another
        length) on any rank, every rank raises as :meth:`phase` does (a second collective, on failure only,
        tells every rank what failed where)."""
        values: list[int] = [0] * length
        err: RankError | None = None
        exc: Exception | None = None
        try:
            failpoints.hit_phase(name)
            got = [int(v) for v in fn()]
            if len(got) != length:
                raise DistributedError(f"{name}: {len(got)} values on rank {self.rank}, {length} expected")
            values = got
        except Exception as e:  # every rank must learn of it, or the others wait in the reduce below
            exc, err = e, RankError(self.rank, type(e).__name__, str(e), self.node)
        reduced = self._all_max([int(err is not None), *values], background=background)
        if reduced[0]:
            errors = [e for e in self._all_gather(err, background=background) if e is not None]
            raise phase_error(name, errors) from exc
        return reduced[1:]

    def phase_flags(self, name: str, fn: Callable[[], bytes], length: int) -> bytes:
        """:meth:`phase_max` for long vectors of one-byte flags (foreground group): their element-wise
        maximum (a flag set on any rank), ``length`` bytes."""
        flags = bytes(length)
        err: RankError | None = None
        exc: Exception | None = None
        try:
            failpoints.hit_phase(name)
            got = bytes(fn())
            if len(got) != length:
                raise DistributedError(f"{name}: {len(got)} flags on rank {self.rank}, {length} expected")
            flags = got
        except Exception as e:  # every rank must learn of it, or the others wait in the reduce below
            exc, err = e, RankError(self.rank, type(e).__name__, str(e), self.node)
        reduced = self._bytes_max(bytes([int(err is not None)]) + flags)
        if reduced[0]:
            errors = [e for e in self._all_gather(err) if e is not None]
            raise phase_error(name, errors) from exc
        return reduced[1:]

    def barrier(self, name: str, *, background: bool = False) -> None:
        """Wait for every rank (a phase with nothing to share)."""
        if self.multi:
            self._all_max([0], background=background)

    # The primitives: only the phases above call them, so that every cross-rank step is failure-safe
    # (tests/test_layering.py checks that no other module makes a collective call).
    def _all_gather(self, obj: Any, *, background: bool = False) -> list[Any]:
        if not self.multi:
            return [obj]
        out: list[Any] = [None] * self.world_size
        with RANK_WAITS.waiting():
            dist.all_gather_object(out, obj, group=self._bg if background else self._fg)
        return out

    def _all_max(self, values: list[int], *, background: bool = False) -> list[int]:
        if not self.multi:
            return list(values)
        t = torch.tensor(values, dtype=torch.int64)
        with RANK_WAITS.waiting():
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._bg if background else self._fg)
        return [int(v) for v in t.tolist()]

    def _bytes_max(self, values: bytes) -> bytes:
        if not self.multi:
            return bytes(values)
        t = torch.frombuffer(bytearray(values), dtype=torch.uint8) if values else torch.zeros(0, dtype=torch.uint8)
        with RANK_WAITS.waiting():
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._fg)
        return bytes(t.numpy().tobytes())

    def group(self, *, background: bool = False) -> Any:
        """The gloo group of the training thread (foreground) or of the writer thread (background), for
        point-to-point transfers made in that thread's order (peers.py); None when not distributed."""
        return self._bg if background else self._fg

    def new_peer_group(self) -> Any:
        """Collective (every rank): a third gloo group, for the transfers of peer replicas that domain
        leaders make on the writer thread after a commit, so they never interleave with the commit's
        collectives on the background group. None when not distributed."""
        if not self.multi:
            return None
        self._peer = dist.new_group(backend="gloo", timeout=self._timeout)
        return self._peer

    def close(self) -> None:
        """Destroy the groups this coordinator made (its caller's own groups are untouched) and drop them,
        so that gloo's threads end now. A group left alive until the interpreter's teardown can abort the
        process there ("terminate called without an active exception": gloo's threads still hold work whose
        tensors need the interpreter), which a program that called ``destroy_process_group()`` itself does
        not prevent, as long as a reference keeps the group object. Call it once every collective on these
        groups has returned on this rank (the Checkpointer's ``close``). Idempotent."""
        groups = [g for g in (self._fg, self._bg, self._peer) if g is not None]
        self._fg = self._bg = self._peer = None
        if not groups or not (dist.is_available() and dist.is_initialized()):
            return  # the program destroyed every group already: nothing of ours is registered
        for g in groups:
            try:
                dist.destroy_process_group(g)
            except Exception as exc:  # already destroyed by the program (a named group): nothing to release
                log.debug("releasing a checkpoint process group: %s", exc)


@dataclass(frozen=True)
class Topology:
    """Where each rank's shards go: storage domain per rank, this rank's domain root and leader role."""

    rank: int
    world_size: int
    node: str
    domain_of_rank: tuple[str, ...]
    root: str  # this rank's local root directory (node name expanded)
    nonce: str  # agreed per job incarnation; makes temp names unique across restarts
    node_of_rank: tuple[str, ...] = ()  # each rank's node name (empty: unknown, as in tests that build one)

    @property
    def domain(self) -> str:
        """This rank's storage domain."""
        return self.domain_of_rank[self.rank]

    @property
    def domain_ranks(self) -> list[int]:
        """Ranks writing into this rank's domain."""
        return [r for r, d in enumerate(self.domain_of_rank) if d == self.domain]

    @property
    def is_leader(self) -> bool:
        """The lowest rank of the domain: it creates, commits and garbage-collects directories."""
        return self.domain_ranks[0] == self.rank


_PROBE = ".rslurm-probe-"


def discover_topology(coord: Coordinator, local_dir_template: str | Exception, node: str) -> Topology:
    """Collective: agree on storage domains. Creates the local root (mode 0700) of every rank.

    ``local_dir_template`` may be the error this rank met choosing its directory (an unsafe default
    directory). That error, or one creating the directory (a ConfigError naming the rank and node), goes
    through the phase: every rank raises it, naming the ranks and their problems, instead of the others
    waiting for the collective timeout (the rank that met it has its own error as the cause).

    Ranks whose roots are one directory on one host (same device and inode) are grouped first. When
    the groups span several hosts, each group's first rank drops a probe file into its root and lists
    the root for the others' probes: groups that see each other share a filesystem directory and are
    merged. A domain is named after the node of its lowest rank, or ``<node>-r<lowest rank>`` when that
    node has several domains (per-GPU directories).
    """
    host = socket.gethostname()  # the real host: (device, inode) identify a directory on one host only

    def mine() -> tuple[str, str, str, str, int, int]:
        if isinstance(local_dir_template, Exception):
            raise local_dir_template
        try:
            where = expand_local_dir(local_dir_template, node)
            os.makedirs(where, mode=0o700, exist_ok=True)
            st = os.stat(where)
        except OSError as exc:
            raise ConfigError(f"local checkpoint directory unusable on rank {coord.rank} ({node}): {exc}; every "
                              "rank stops (set RSLURM_LOCAL_DIR to a writable node-local directory)") from exc
        return node, where, secrets.token_hex(4), host, st.st_dev, st.st_ino

    infos = coord.phase("choosing the local checkpoint directories", mine)
    root = infos[coord.rank][1]
    nonce = infos[0][2]
    nodes = [i[0] for i in infos]
    group_of_rank: list[int] = []
    first_of_key: dict[tuple[str, int, int], int] = {}
    for r, (_, _, _, h, dev, ino) in enumerate(infos):
        group_of_rank.append(first_of_key.setdefault((h, dev, ino), r))
    groups = sorted(set(group_of_rank))
    parent = {g: g for g in groups}

    def find(g: int) -> int:
        while parent[g] != g:
            g = parent[g]
        return g

    if len({infos[g][3] for g in groups}) > 1:
        # Several hosts: a shared filesystem directory is seen from each host under its own inode
        # numbers. Group leaders drop probes and look for each other's.
        leader = group_of_rank[coord.rank] == coord.rank
        probe = os.path.join(root, f"{_PROBE}{nonce}-{coord.rank}")

        def drop_probe() -> None:
            if leader:
                with open(probe, "w") as f:
                    f.write(node)

        def look() -> list[int]:
            if not leader:
                return []
            prefix = f"{_PROBE}{nonce}-"
            return sorted(int(n[len(prefix):]) for n in os.listdir(root)
                          if n.startswith(prefix) and n[len(prefix):].isdigit())

        def remove_probe() -> None:
            if leader:
                os.unlink(probe)

        coord.phase("probing for shared checkpoint directories", drop_probe)
        all_seen = coord.phase("listing the probes of other nodes", look)
        coord.phase("removing the probes", remove_probe)
        for seen_list in all_seen:
            roots = sorted({find(g) for g in seen_list if g in parent})
            for g in roots[1:]:
                parent[g] = roots[0]
    domain_first = [find(g) for g in group_of_rank]  # lowest rank of each rank's domain
    firsts = sorted(set(domain_first))
    per_node = Counter(nodes[f] for f in firsts)
    name = {f: nodes[f] if per_node[nodes[f]] == 1 else f"{nodes[f]}-r{f}" for f in firsts}
    shared = sorted({nodes[r] for r, f in enumerate(domain_first) if nodes[r] != nodes[f]})
    if shared and coord.rank == 0:
        log.info("nodes %s write into a checkpoint directory shared with another node", shared)
    if coord.rank == 0 and any(per_node[n] > 1 for n in per_node):
        log.info("nodes with several checkpoint directories (one storage domain each): %s",
                 sorted(n for n in per_node if per_node[n] > 1))
    return Topology(
        rank=coord.rank,
        world_size=coord.world_size,
        node=node,
        domain_of_rank=tuple(name[f] for f in domain_first),
        root=root,
        nonce=nonce,
        node_of_rank=tuple(nodes),
    )
