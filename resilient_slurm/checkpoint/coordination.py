"""Rank coordination for saves and restores: process groups, storage domains, tiny collectives.

Who calls what: every rank constructs one :class:`Coordinator` (collective: it creates two gloo groups
when torch.distributed is initialized). The training thread uses the *foreground* group (save-step
agreement, planning, restore); the background writer uses the *background* group (commit), so the two
threads never interleave collectives on one group. Without torch.distributed everything is local.

A *storage domain* is one node-local checkpoint directory and the ranks that write to it. Normally a
domain is a node; nodes whose ``local_dir`` is the same shared directory form one domain (detected with
probe files), so replicated state is written once per directory, never twice into the same place.
"""

from __future__ import annotations

import datetime
import logging
import os
import secrets
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

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
        if self.distributed and self.world_size > 1:
            timeout = datetime.timedelta(seconds=timeout_s)
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

    def all_true(self, flag: bool, *, background: bool = False) -> bool:
        """True if ``flag`` is true on every rank."""
        return self.all_max([0 if flag else 1], background=background)[0] == 0

    def barrier(self, *, background: bool = False) -> None:
        """Wait for every rank."""
        if self.multi:
            self.all_max([0], background=background)


@dataclass(frozen=True)
class Topology:
    """Where each rank's shards go: storage domain per rank, this rank's domain root and leader role."""

    rank: int
    world_size: int
    node: str
    domain_of_rank: tuple[str, ...]
    root: str  # this domain's local root directory (node name expanded)
    nonce: str  # agreed per job incarnation; makes temp names unique across restarts

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


def discover_topology(coord: Coordinator, local_dir_template: str, node: str) -> Topology:
    """Collective: agree on storage domains. Creates the local root (mode 0700) on every node."""
    root = expand_local_dir(local_dir_template, node)
    os.makedirs(root, mode=0o700, exist_ok=True)
    nonce = secrets.token_hex(4)
    infos = coord.all_gather((node, root, nonce))
    nonce = infos[0][2]
    nodes = [i[0] for i in infos]
    first_rank_of_node = {n: nodes.index(n) for n in nodes}
    distinct = list(dict.fromkeys(nodes))
    domain_of_node = {n: n for n in distinct}
    if len(distinct) > 1:
        # Do two nodes' local roots resolve to one shared directory? Each node leader drops a probe
        # file and looks for the others'. Union the nodes that see each other's probes.
        is_node_leader = first_rank_of_node[node] == coord.rank
        probe = os.path.join(root, f".rslurm-probe-{nonce}-{node}")
        if is_node_leader:
            with open(probe, "w") as f:
                f.write(node)
        coord.barrier()
        seen = (
            [n for n in distinct if os.path.exists(os.path.join(root, f".rslurm-probe-{nonce}-{n}"))]
            if is_node_leader
            else []
        )
        all_seen = coord.all_gather(seen)
        coord.barrier()
        if is_node_leader:
            os.unlink(probe)
        for seen_list in all_seen:
            if len(seen_list) > 1:
                group = sorted({domain_of_node[n] for n in seen_list}, key=first_rank_of_node.__getitem__)
                target = group[0]
                for n, d in list(domain_of_node.items()):
                    if d in group:
                        domain_of_node[n] = target
        shared = [n for n, d in domain_of_node.items() if d != n]
        if shared:
            log.info("nodes %s share a local checkpoint directory with another node", shared)
    return Topology(
        rank=coord.rank,
        world_size=coord.world_size,
        node=node,
        domain_of_rank=tuple(domain_of_node[n] for n in nodes),
        root=root,
        nonce=nonce,
    )
