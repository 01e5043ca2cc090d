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

import datetime
import logging
import os
import secrets
import socket
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..errors import ConfigError, ResilientSlurmError
from ..paths import expand_local_dir

log = logging.getLogger(__name__)


class Coordinator:
    """Collectives on dedicated gloo groups; trivial when not distributed."""

    def __init__(self, timeout_s: float = 600.0) -> None:
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

    def all_gather(self, obj: Any, *, background: bool = False) -> list[Any]:
        """Every rank's ``obj``, in rank order."""
        if not self.multi:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self._bg if background else self._fg)
        return out

    def all_max(self, values: list[int], *, background: bool = False) -> list[int]:
        """Element-wise max of small integer vectors across ranks (one tiny all_reduce)."""
        if not self.multi:
            return list(values)
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._bg if background else self._fg)
        return [int(v) for v in t.tolist()]

    def any_max(self, values: bytes) -> bytes:
        """Element-wise max of byte vectors across ranks (foreground group): flags of one byte per item,
        for vectors too long to send as integers."""
        if not self.multi:
            return bytes(values)
        t = torch.frombuffer(bytearray(values), dtype=torch.uint8) if values else torch.zeros(0, dtype=torch.uint8)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._fg)
        return bytes(t.numpy().tobytes())

    def all_true(self, flag: bool, *, background: bool = False) -> bool:
        """True if ``flag`` is true on every rank."""
        return self.all_max([0 if flag else 1], background=background)[0] == 0

    def barrier(self, *, background: bool = False) -> None:
        """Wait for every rank."""
        if self.multi:
            self.all_max([0], background=background)

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
    directory). That error, or one creating the directory, goes through the collective: every rank
    raises, naming the ranks and their problems, instead of the others waiting for the collective
    timeout. The rank that met it raises its own error.

    Ranks whose roots are one directory on one host (same device and inode) are grouped first. When
    the groups span several hosts, each group's first rank drops a probe file into its root and lists
    the root for the others' probes: groups that see each other share a filesystem directory and are
    merged. A domain is named after the node of its lowest rank, or ``<node>-r<lowest rank>`` when that
    node has several domains (per-GPU directories).
    """
    own: Exception | None = local_dir_template if isinstance(local_dir_template, Exception) else None
    root, dev, ino = "", 0, 0
    if own is None:
        assert isinstance(local_dir_template, str)
        try:
            root = expand_local_dir(local_dir_template, node)
            os.makedirs(root, mode=0o700, exist_ok=True)
            st = os.stat(root)
            dev, ino = st.st_dev, st.st_ino
        except (OSError, ResilientSlurmError) as exc:
            own = exc
    host = socket.gethostname()  # the real host: (device, inode) identify a directory on one host only
    problem = None if own is None else f"{own}"
    gathered = coord.all_gather((node, root, secrets.token_hex(4), host, dev, ino, problem))
    bad = [(r, g[0], g[6]) for r, g in enumerate(gathered) if g[6] is not None]
    if bad:
        if own is not None:
            raise own
        raise ConfigError("local checkpoint directory unusable on "
                          + "; ".join(f"rank {r} ({n}): {p}" for r, n, p in bad[:8])
                          + (f"; and {len(bad) - 8} more ranks" if len(bad) > 8 else "")
                          + "; every rank stops (see that rank's error for what to do)")
    infos = [g[:6] for g in gathered]
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
        if leader:
            with open(probe, "w") as f:
                f.write(node)
        coord.barrier()
        seen: list[int] = []
        if leader:
            prefix = f"{_PROBE}{nonce}-"
            seen = sorted(int(n[len(prefix):]) for n in os.listdir(root)
                          if n.startswith(prefix) and n[len(prefix):].isdigit())
        all_seen = coord.all_gather(seen)
        coord.barrier()
        if leader:
            os.unlink(probe)
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
