"""Peer replicas: each committed step of a storage domain is also kept on a partner domain's node, so a
node that comes back empty restores from its partner, not from the durable tier.

Partners: the domain leaders form a ring ordered by node name, shifted by the most domains any node has,
so a domain's partner is on another node whenever the job spans several (:func:`ring`). Each leader sends
its domain's steps to the next leader and keeps the previous one's. ``peer_replicas=auto`` builds the
ring only when the domains span several nodes; ``on`` also between the domains of one node.

Transport: the job's own torch.distributed connections, a dedicated gloo group of every rank
(:meth:`Coordinator.new_peer_group`), point-to-point between leaders. Nothing listens on a new port and
no secret is handed around: the peers are exactly the job's ranks, connected when the Checkpointer
started through the job's rendezvous, the same trust as the gradients the job already exchanges. The
receiver trusts no byte it is sent: the header is bounded and checked (run, step, names that are plain
file names, sizes), every file is hashed as it arrives and checked against the sender's manifest (size
and xxh3 of each shard, of ``.metadata``) before anything is committed, and a replica is committed like
a save (temp directory, fsync, rename), so an interrupted transfer leaves nothing that looks committed.

Who calls what, in which order:

* every rank, once: :meth:`PeerReplicas.connect` (collective: creates the group when any leader has a
  partner);
* writer thread, every domain leader, after each save is handed to the writer (Checkpointer.save):
  :meth:`PeerReplicas.replicate` -- one round per save on every leader (saves are collective, so rounds
  pair up): send this domain's newly committed step to the partner while receiving the previous leader's
  into ``<run_dir>/replicas/<domain>/`` (layout.py), then delete every older replica. An emergency save is
  not sent (the job is leaving; the drain daemon carries it to the durable tier), but its round still runs.
  After a transfer failure (the partner's process gone, the group's timeout) the replicator stops: the
  rounds can no longer pair up;
* restore (restore.py, foreground group, every rank): :meth:`PeerReplicas.held` on domain leaders, in the
  restore's first all_gather; for a step some domain lacks, :func:`peer_sources` picks a holder for each
  such domain (a replica saved by exactly its ranks at this world size) and
  :meth:`PeerReplicas.restore_round` copies it over the foreground group, the pairs in one global order
  (deadlock-free), then one all_gather tells every rank who got the step.

One round (:func:`transfer`): both sides swap a JSON header (what the sender offers, or nothing), the
receiver answers whether it takes it (it declines when its disk lacks the room), then the files go in
pieces of :data:`PIECE` bytes in both directions at once, and a trailer says whether the sender read
every byte. A receiver that fails to write keeps receiving (the stream stays paired) and keeps nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import re
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
import xxhash

from .. import failpoints
from ..errors import CorruptCheckpointError, InsufficientSpaceError
from ..layout import (
    TempKind,
    delete_step,
    list_replicas,
    replica_run_dir,
    temp_dirname,
    valid_domain_name,
)
from ..manifest import DCP_METADATA_NAME, MANIFEST_NAME, Manifest, read_manifest_file, step_dirname
from ..rundir import RunDir
from ..storage.fileio import (
    _O_DIRECT,
    BLOCK,
    aligned_buffer,
    as_memoryview,
    atomic_write,
    check_free_space,
    fsync_dir,
    open_regular,
    reading_step,
    remove_tree_quietly,
    round_up,
)
from .coordination import RANK_WAITS, Coordinator, Topology

log = logging.getLogger(__name__)

PIECE = 8 << 20  # bytes per point-to-point message of a file
HEADER_MAX = 4 << 20  # a header names files and sizes; anything larger is not one
MODES = ("auto", "on", "off")
_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}$")
_MAX_FILE = 1 << 50


class PeerTransferError(Exception):
    """A round could not pair up with its partner (a malformed header, a transfer that failed)."""


@dataclass(frozen=True)
class Ring:
    """This leader's partners: whom it sends its domain's steps to, whose steps it keeps (None: no ring)."""

    send_to: int | None = None
    recv_from: int | None = None


def ring(topo: Topology, mode: str) -> Ring:
    """This rank's place in the ring of domain leaders (the same computation on every rank)."""
    if mode not in MODES:
        raise ValueError(f"peer_replicas must be one of {MODES}, got {mode!r}")
    if not any_ring(topo, mode):
        return Ring()
    leaders, node = _leaders(topo)
    if topo.rank not in leaders:
        return Ring()
    hosts = Counter(node.values())
    order = sorted(leaders, key=lambda r: (node[r], r))
    most = max(hosts.values())
    shift = most if most < len(order) else 1
    i = order.index(topo.rank)
    return Ring(order[(i + shift) % len(order)], order[(i - shift) % len(order)])


def any_ring(topo: Topology, mode: str) -> bool:
    """Whether the leaders form a ring (so every rank must join the peer group): :func:`ring`'s condition,
    without computing every leader's place."""
    leaders, node = _leaders(topo)
    return mode != "off" and len(leaders) >= 2 and (mode != "auto" or len(set(node.values())) >= 2)


def _leaders(topo: Topology) -> tuple[list[int], dict[int, str]]:
    """The domain leaders (lowest rank of each domain), and each one's node (its domain name when the
    topology does not know nodes)."""
    leaders = sorted({topo.domain_of_rank.index(d) for d in topo.domain_of_rank})
    known = len(topo.node_of_rank) == topo.world_size
    return leaders, {r: topo.node_of_rank[r] if known else topo.domain_of_rank[r] for r in leaders}


# ---------------------------------------------------------------------------------------------- transfer
@dataclass
class Offer:
    """A step directory a sender offers: its header (run, step, the domain the files belong to, files)."""

    step_dir: str
    header: dict[str, Any]

    @property
    def files(self) -> list[tuple[str, int]]:
        return [(str(n), int(s)) for n, s in self.header["files"]]


class Sink(Protocol):
    """The receiving side of a round (:class:`StepSink`)."""

    def accept(self, step: int, domain: str, files: list[tuple[str, int]]) -> str | None: ...  # None: take it
    def write(self, index: int, offset: int, buf: memoryview, n: int) -> None: ...  # buf[:n] is the piece
    def finish(self) -> None: ...  # verify and commit; raises on a bad copy
    def abandon(self) -> None: ...


@dataclass
class RoundResult:
    """What one :func:`transfer` did on this rank."""

    sent: int = 0  # bytes sent
    received: int = 0  # bytes received and committed (0 when nothing was kept)
    header: Mapping[str, Any] | None = None  # what the partner offered
    declined: str | None = None  # why this side (receiving) or the partner did not take the offer
    error: str | None = None  # why what was received was not kept
    seconds: float = 0.0


def _wait(works: Sequence[Any]) -> None:
    with RANK_WAITS.waiting():
        for w in works:
            w.wait()


def _swap_bytes(group: Any, to: int | None, data: bytes | None, frm: int | None) -> bytes | None:
    """Send ``data`` to ``to`` and receive a message from ``frm``, at once (a length, then the bytes)."""
    works = []
    if to is not None:
        assert data is not None
        works.append(dist.isend(torch.tensor([len(data)], dtype=torch.int64), to, group=group))
    n = torch.zeros(1, dtype=torch.int64)
    if frm is not None:
        works.append(dist.irecv(n, frm, group=group))
    _wait(works)
    works = []
    if to is not None and data:
        works.append(dist.isend(torch.frombuffer(bytearray(data), dtype=torch.uint8), to, group=group))
    size = int(n.item())
    buf = torch.empty(max(size, 0), dtype=torch.uint8)
    if frm is not None and size > 0:
        if size > HEADER_MAX:
            raise PeerTransferError(f"rank {frm} announced a {size}-byte header (at most {HEADER_MAX})")
        works.append(dist.irecv(buf, frm, group=group))
    _wait(works)
    return bytes(buf.numpy()) if frm is not None else None


def _swap_flag(group: Any, to: int | None, flag: int | None, frm: int | None) -> int | None:
    """Send a small integer to ``to`` (when not None) and receive one from ``frm``."""
    works = []
    if to is not None:
        works.append(dist.isend(torch.tensor([int(flag or 0)], dtype=torch.int64), to, group=group))
    got = torch.zeros(1, dtype=torch.int64)
    if frm is not None:
        works.append(dist.irecv(got, frm, group=group))
    _wait(works)
    return int(got.item()) if frm is not None else None


def _pieces(files: Sequence[tuple[str, int]]) -> list[tuple[int, int, int]]:
    return [(i, off, min(PIECE, size - off)) for i, (_, size) in enumerate(files) for off in range(0, size, PIECE)]


def check_header(header: Any, run_id: str) -> tuple[int, str, list[tuple[str, int]]]:
    """The step, domain and files of a received header; PeerTransferError naming what is wrong."""
    if not isinstance(header, dict):
        raise PeerTransferError(f"a header is a JSON object, got {type(header).__name__}")
    step, domain, files, run = header.get("step"), header.get("domain"), header.get("files"), header.get("run")
    if run != run_id:
        raise PeerTransferError(f"the offer is of run {run!r}, not {run_id!r}")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise PeerTransferError(f"bad step {step!r}")
    if not isinstance(domain, str) or not valid_domain_name(domain):
        raise PeerTransferError(f"bad storage domain name {domain!r}")
    if not isinstance(files, list) or not files:
        raise PeerTransferError("no files")
    out: list[tuple[str, int]] = []
    for f in files:
        if (not isinstance(f, list) or len(f) != 2 or not isinstance(f[0], str) or not isinstance(f[1], int)
                or isinstance(f[1], bool)):
            raise PeerTransferError(f"bad file entry {f!r}")
        name, size = f
        if not (_NAME_RE.match(name) or name == DCP_METADATA_NAME) or not 0 <= size <= _MAX_FILE:
            raise PeerTransferError(f"bad file entry {f!r}")
        out.append((name, size))
    names = [n for n, _ in out]
    if len(set(names)) != len(names) or MANIFEST_NAME not in names or DCP_METADATA_NAME not in names:
        raise PeerTransferError(f"files {names[:8]} repeat a name or lack {MANIFEST_NAME} or {DCP_METADATA_NAME}")
    return step, domain, out


def _try_direct(fd: int) -> bool:
    """Switch ``fd`` to O_DIRECT where the filesystem allows it (tmpfs does not); whether it did."""
    if not _O_DIRECT:
        return False
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | _O_DIRECT)
        return True
    except OSError:
        return False


class _Pipeline:
    """The disk side of a round's pieces, overlapped with the network: piece k+1 is read (one thread) while
    piece k travels, and received pieces are written and hashed behind it (another thread, in order, as the
    sink's streaming hash needs). Two buffers each way: a buffer is reused only once its send, or its write,
    is done. A read failure is remembered (:attr:`read_ok`) and the piece still goes out (the stream stays
    paired; the trailer tells the receiver to keep nothing)."""

    DEPTH = 2

    def __init__(self, step_dir: str, files: Sequence[tuple[str, int]], send_p: Sequence[tuple[int, int, int]],
                 sink: Sink | None, recv_p: Sequence[tuple[int, int, int]]) -> None:
        self.step_dir, self.files, self.send_p, self.sink, self.recv_p = step_dir, files, send_p, sink, recv_p
        # Page-aligned and block-rounded, so the files can be read and written with O_DIRECT: through the
        # page cache, a round first faulted in a page-cache page for every byte it read and wrote (about
        # 500 MiB/s for fresh memory here, against 4 GiB/s once warm).
        size = max([n for _, _, n in send_p] + [0])
        self.sbufs = [aligned_buffer(size, prefault=False, huge=False) for _ in range(min(self.DEPTH, len(send_p)))]
        size = max([n for _, _, n in recv_p] + [0])
        self.rbufs = [aligned_buffer(size, prefault=False, huge=False) for _ in range(min(self.DEPTH, len(recv_p)))]
        self.read_ok = True
        self._fds: dict[int, int] = {}
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="rslurm-peer-read") if send_p else None
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="rslurm-peer-write") if recv_p else None
        self._reads: dict[int, Future[None]] = {}
        self._writes: dict[int, Future[None]] = {}

    def __enter__(self) -> _Pipeline:
        for k in range(min(self.DEPTH - 1, len(self.send_p))):
            self._read_ahead(k)
        return self

    def __exit__(self, *exc: object) -> None:
        for ex in (self._reader, self._writer):
            if ex is not None:
                ex.shutdown(wait=True)
        for fd in self._fds.values():
            os.close(fd)
        for f in self._writes.values():
            f.result()  # a write never raises (the sink keeps its first failure); a bug does

    def _read_ahead(self, k: int) -> None:
        assert self._reader is not None
        self._reads[k] = self._reader.submit(self._read, k)

    def _read(self, k: int) -> None:
        i, off, n = self.send_p[k]
        if not self.read_ok:
            return
        try:
            if i not in self._fds:
                self._fds[i] = open_regular(os.path.join(self.step_dir, self.files[i][0]), what="a shard file")
                _try_direct(self._fds[i])
            view = as_memoryview(self.sbufs[k % self.DEPTH])
            if os.preadv(self._fds[i], [view[: min(round_up(n), len(view))]], off) < n:
                raise OSError(f"{self.files[i][0]} is shorter than its manifest says")
        except OSError as exc:
            self.read_ok = False
            log.warning("peer replica: cannot read %s: %s", os.path.join(self.step_dir, self.files[i][0]), exc)

    def outgoing(self, k: int) -> torch.Tensor:
        """Piece k, read (the send of piece k-1 is done: its buffer may be refilled with piece k+1)."""
        self._reads.pop(k).result()
        if k + self.DEPTH - 1 < len(self.send_p):
            self._read_ahead(k + self.DEPTH - 1)
        return self.sbufs[k % self.DEPTH][: self.send_p[k][2]]

    def incoming(self, k: int) -> torch.Tensor:
        """The buffer piece k arrives in (once the write of the piece it held before is done)."""
        done = self._writes.pop(k - self.DEPTH, None)
        if done is not None:
            done.result()
        return self.rbufs[k % self.DEPTH][: self.recv_p[k][2]]

    def received(self, k: int) -> None:
        assert self._writer is not None and self.sink is not None
        i, off, n = self.recv_p[k]
        self._writes[k] = self._writer.submit(self.sink.write, i, off, as_memoryview(self.rbufs[k % self.DEPTH]), n)


def transfer(group: Any, *, to: int | None, offer: Offer | None, frm: int | None, sink: Sink | None,
             run_id: str) -> RoundResult:
    """One round with a partner: send ``offer`` (or nothing) to ``to`` and receive what ``frm`` offers into
    ``sink``, both at once. Raises what the group raises (the partner gone, its timeout); a bad copy or a
    local write failure is reported in the result, the stream kept paired."""
    t0 = time.perf_counter()
    res = RoundResult()
    hdr = json.dumps(offer.header if offer is not None else None).encode() if to is not None else None
    raw = _swap_bytes(group, to, hdr, frm)
    incoming: list[tuple[str, int]] = []
    take = 0
    offered = False  # the partner offered something (then it waits for an answer, whatever we make of it)
    if frm is not None:
        assert raw is not None and sink is not None
        offered = raw.strip() != b"null"
        try:
            if offered:
                res.header = json.loads(raw.decode())
                step, domain, incoming = check_header(res.header, run_id)
                res.declined = sink.accept(step, domain, incoming)
        except Exception as exc:  # a bad offer or a sink that cannot take it: declined, the stream stays paired
            res.declined = f"refused the offer of rank {frm}: {exc}"
        take = 1 if offered and not res.declined else 0
    reply = _swap_flag(group, frm if offered else None, take, to if offer is not None and to is not None else None)
    outgoing = offer.files if offer is not None and to is not None and reply == 1 else []
    if offer is not None and reply == 0:
        res.declined = f"rank {to} did not take step {offer.header['step']}"
    send_p, recv_p = _pieces(outgoing), _pieces(incoming) if take else []
    with _Pipeline(offer.step_dir if offer is not None else "", outgoing, send_p, sink, recv_p) as pipe:
        for k in range(max(len(send_p), len(recv_p))):
            works = []
            if k < len(send_p):
                works.append(dist.isend(pipe.outgoing(k), to, group=group))
                res.sent += send_p[k][2]
            if k < len(recv_p):
                works.append(dist.irecv(pipe.incoming(k), frm, group=group))
            _wait(works)
            if k == 0 and send_p:
                assert offer is not None
                failpoints.hit("during_peer_send", offer.step_dir)
            if k < len(recv_p):
                pipe.received(k)
    read_ok = pipe.read_ok
    ok = _swap_flag(group, to if outgoing else None, 0 if read_ok else 1, frm if take else None)
    if take:
        assert sink is not None
        if ok != 0:
            res.error = f"rank {frm} could not read every file it offered"
            sink.abandon()
        else:
            try:
                sink.finish()
                res.received = sum(s for _, s in incoming)
            except Exception as exc:
                res.error = str(exc)
                sink.abandon()
    res.seconds = time.perf_counter() - t0
    return res


# ------------------------------------------------------------------------------------------- receiving
class StepSink:
    """Receives one step's files into a temp directory of ``parent`` (a run directory, or a replica
    directory decided from the header by ``parent_of``), hashes each file as it arrives, and on
    :meth:`finish` checks them against the received manifest and commits the directory with ``commit``
    (temp path, step, manifest). Never raises from :meth:`write`: the first failure is kept for finish."""

    def __init__(self, run_id: str, parent_of: Callable[[str], str], kind: TempKind, nonce: str, *,
                 free_space_margin: int, commit: Callable[[str, int, Manifest], None],
                 step: int | None = None) -> None:
        self.run_id, self.parent_of, self.kind, self.nonce = run_id, parent_of, kind, nonce
        self.margin, self.commit, self.want_step = free_space_margin, commit, step
        self.tmp: str | None = None
        self.files: list[tuple[str, int]] = []
        self.step = -1
        self.domain = ""
        self._fds: dict[int, int] = {}
        self._direct: dict[int, bool] = {}
        self._hash: dict[int, Any] = {}
        self._error: str | None = None

    def accept(self, step: int, domain: str, files: list[tuple[str, int]]) -> str | None:
        """Make the temp directory for a checked offer (:func:`check_header`), or say why not."""
        self.step, self.domain, self.files = step, domain, files
        if self.want_step is not None and self.step != self.want_step:
            return f"offered step {self.step}, expected {self.want_step}"
        parent = self.parent_of(self.domain)
        try:
            os.makedirs(os.path.dirname(parent), mode=0o700, exist_ok=True)  # replicas/ too: 0700, like a run
            os.makedirs(parent, mode=0o700, exist_ok=True)
            check_free_space(parent, sum(s for _, s in self.files) + self.margin,
                             what=f"a peer copy of step {self.step} of {self.domain}")
            self.tmp = os.path.join(parent, temp_dirname(self.step, self.kind, self.nonce))
            remove_tree_quietly(self.tmp)
            os.makedirs(self.tmp, mode=0o700)
        except (OSError, InsufficientSpaceError) as exc:
            self.tmp = None
            return f"cannot keep step {self.step} of {self.domain} in {parent}: {exc}"
        return None

    def write(self, index: int, offset: int, buf: memoryview, n: int) -> None:
        """Write ``buf[:n]`` at ``offset`` of file ``index`` and hash it (pieces arrive in order). With
        O_DIRECT the last piece of a file is written block-rounded, and the file cut to its size."""
        if self._error is not None or self.tmp is None:
            return
        try:
            if index not in self._fds:
                path = os.path.join(self.tmp, self.files[index][0])
                self._fds[index] = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                                           0o600)
                self._hash[index] = xxhash.xxh3_64()
                self._direct[index] = _try_direct(self._fds[index])
            direct = self._direct[index] and offset % BLOCK == 0 and round_up(n) <= len(buf)
            data = buf[: round_up(n) if direct else n]
            if not direct and self._direct[index]:  # an unaligned piece: write it through the page cache
                fcntl.fcntl(self._fds[index], fcntl.F_SETFL, fcntl.fcntl(self._fds[index], fcntl.F_GETFL) & ~_O_DIRECT)
                self._direct[index] = False
            done = 0
            while done < len(data):
                done += os.pwrite(self._fds[index], data[done:], offset + done)
            if len(data) != n:
                os.ftruncate(self._fds[index], offset + n)
            self._hash[index].update(buf[:n])
        except OSError as exc:
            self._error = f"writing {self.files[index][0]} into {self.tmp}: {exc}"

    def _close(self, sync: bool) -> None:
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            try:
                if sync:
                    os.fsync(fd)
            finally:
                os.close(fd)

    def finish(self) -> None:
        assert self.tmp is not None
        self._close(sync=self._error is None)
        if self._error is not None:
            raise OSError(self._error)
        where = f"peer copy of step {self.step} of {self.domain}"
        for name, size in self.files:  # empty files got no piece
            if size == 0:
                os.close(os.open(os.path.join(self.tmp, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                                 0o600))
        m = read_manifest_file(os.path.join(self.tmp, MANIFEST_NAME))
        if m.run_id != self.run_id or m.step != self.step or m.node != self.domain:
            raise CorruptCheckpointError(f"{where}: its manifest is of run {m.run_id} step {m.step} domain {m.node}")
        sizes = dict(self.files)
        digests = {self.files[i][0]: h.hexdigest() for i, h in self._hash.items()}
        digests.update({n: xxhash.xxh3_64_hexdigest(b"") for n, s in self.files if s == 0})
        shards = {s.path: s for s in m.shards_of_node(self.domain)}
        extra = set(sizes) - set(shards) - {MANIFEST_NAME, DCP_METADATA_NAME}
        if extra or set(shards) - set(sizes):
            raise CorruptCheckpointError(f"{where}: files {sorted(extra)} are not in its manifest, or "
                                         f"{sorted(set(shards) - set(sizes))} are missing")
        md = m.dcp_metadata
        checks = [(p, s.size, s.checksum) for p, s in shards.items()] + [(DCP_METADATA_NAME, md.length, md.checksum)]
        for name, size, digest in checks:
            if sizes[name] != size or digests.get(name) != digest:
                raise CorruptCheckpointError(f"{where}: {name} does not match its manifest (size {sizes[name]}, "
                                             f"expected {size}; checksum {digests.get(name)}, expected {digest})")
        fsync_dir(self.tmp)
        self.commit(self.tmp, self.step, m)
        self.tmp = None

    def abandon(self) -> None:
        self._close(sync=False)
        if self.tmp is not None:
            remove_tree_quietly(self.tmp)
            self.tmp = None


# ------------------------------------------------------------------------------------------ replicator
@dataclass(frozen=True)
class Held:
    """A committed replica this leader holds: whose domain, which step, saved at which world size by
    which ranks."""

    domain: str
    step: int
    world_size: int
    ranks: tuple[int, ...]
    created_at: float  # with the run and step, identifies the save (Manifest.save_id)


@dataclass
class ReplicaOutcome:
    """What one :meth:`PeerReplicas.replicate` round did on this leader (for the event log)."""

    step: int
    sent: int
    received: int
    received_step: int | None
    from_domain: str | None
    seconds: float
    problem: str | None


def offer_of(step_dir: str, run_id: str, step: int, domain: str, manifest: Manifest) -> Offer:
    """The offer of a committed step directory: its manifest, ``.metadata`` and ``domain``'s shards."""
    files = [(MANIFEST_NAME, os.path.getsize(os.path.join(step_dir, MANIFEST_NAME))),
             (DCP_METADATA_NAME, manifest.dcp_metadata.length)]
    files += [(s.path, s.size) for s in manifest.shards_of_node(domain)]
    return Offer(step_dir, {"v": 1, "run": run_id, "step": step, "domain": domain, "files": [list(f) for f in files]})


class PeerReplicas:
    """Peer replicas of one run on one rank (active on domain leaders with a partner)."""

    def __init__(self, topo: Topology, run_id: str, run_dir: str, *, mode: str, free_space_margin: int,
                 install: Callable[[str, int, str], None]) -> None:
        self.topo, self.run_id, self.run_dir, self.mode = topo, run_id, run_dir, mode
        self.margin = free_space_margin
        self.install = install  # the engine's local commit (rename) of a complete temp directory
        self.ring = ring(topo, mode)
        self.group: Any = None
        self.broken: str | None = None

    @property
    def active(self) -> bool:
        """This rank sends and keeps replicas (a domain leader with a partner, connected, not broken)."""
        return self.group is not None and self.ring.send_to is not None and self.broken is None

    def connect(self, coord: Coordinator) -> None:
        """Collective (every rank): join the peer group when some leader has a partner."""
        if coord.multi and any_ring(self.topo, self.mode):
            self.group = coord.new_peer_group()
            if self.ring.send_to is not None:
                log.info("peer replicas: domain %s sends its steps to rank %d's domain %s and keeps rank %d's",
                         self.topo.domain, self.ring.send_to, self.topo.domain_of_rank[self.ring.send_to],
                         self.ring.recv_from)

    def release(self) -> None:
        """Forget the peer group (the Checkpointer closes; :meth:`Coordinator.close` destroys it)."""
        self.group = None

    # -- writer thread, leaders
    def replicate(self, step: int, reason: str) -> ReplicaOutcome | None:
        """One round: send ``step`` (committed here; not an emergency save's) to the partner, keep the
        previous leader's newest step. Never raises: a failure stops replication and is returned."""
        if not self.active:
            return None
        step_dir = RunDir.at(self.run_dir).step(step)
        problem: str | None = None
        with contextlib.ExitStack() as stack:
            offer = None
            if reason != "emergency" and stack.enter_context(reading_step(step_dir)):
                try:
                    m = read_manifest_file(os.path.join(step_dir, MANIFEST_NAME))
                    offer = offer_of(step_dir, self.run_id, step, self.topo.domain, m)
                except Exception as exc:  # the round still runs: the partner waits for it
                    problem = f"cannot offer step {step} from {step_dir}: {exc}"
                    log.warning("peer replicas: %s", problem)
            sink = StepSink(self.run_id, lambda d: replica_run_dir(self.run_dir, d), TempKind.REPLICA,
                            self.topo.nonce, free_space_margin=self.margin, commit=self._commit_replica)
            try:
                res = transfer(self.group, to=self.ring.send_to, offer=offer, frm=self.ring.recv_from, sink=sink,
                               run_id=self.run_id)
            except Exception as exc:
                sink.abandon()
                self.broken = f"step {step}: {exc}"
                log.warning("peer replicas stop for this job: the exchange with ranks %s/%s failed at step %d: %s",
                            self.ring.send_to, self.ring.recv_from, step, exc)
                return ReplicaOutcome(step, 0, 0, None, None, 0.0, self.broken)
        hdr = res.header or {}
        for why in (res.declined, res.error):
            if why:
                log.warning("peer replicas: step %d: %s", step, why)
        got = res.received > 0
        return ReplicaOutcome(step, res.sent, res.received, hdr.get("step") if got else None,
                              hdr.get("domain") if got else None, res.seconds, problem or res.error or res.declined)

    def _commit_replica(self, tmp: str, step: int, m: Manifest) -> None:
        """Rename a verified replica into place, then keep no other replica of this run on this node."""
        parent = os.path.dirname(tmp)
        final = os.path.join(parent, step_dirname(step))
        if os.path.lexists(final):
            delete_step(parent, step, TempKind.GC, self.topo.nonce)
        os.rename(tmp, final)
        fsync_dir(parent)
        self.prune(keep=(m.node, step))

    def prune(self, keep: tuple[str, int] | None) -> None:
        """Delete every replica but ``keep`` (and replicas being received by another incarnation)."""
        try:
            held = list_replicas(self.run_dir)
        except OSError as exc:
            log.warning("peer replicas: cannot list %s: %s", self.run_dir, exc)
            return
        for domain, listing in held.items():
            for s in listing.committed:
                if (domain, s) == keep:
                    continue
                try:
                    delete_step(listing.run_dir, s, TempKind.GC, self.topo.nonce)
                except Exception as exc:  # busy (a restore reads it) or unremovable: the next round tries again
                    log.info("peer replicas: keeping %s step %d for now: %s", domain, s, exc)
            for t in listing.temps:
                if not t.owned_by(self.topo.nonce):
                    remove_tree_quietly(listing.temp_path(t))

    # -- restore, foreground
    def held(self) -> list[Held]:
        """Leader: the committed replicas on this node, with who saved them (none with ``peer_replicas=off``:
        then replicas are neither made nor used)."""
        out: list[Held] = []
        if self.mode == "off":
            return out
        try:
            listed = list_replicas(self.run_dir)
        except OSError as exc:
            log.warning("peer replicas: cannot list %s: %s", self.run_dir, exc)
            return out
        for domain, listing in listed.items():
            for s in listing.committed:
                try:
                    m = read_manifest_file(os.path.join(listing.step_dir(s), MANIFEST_NAME))
                except Exception as exc:
                    log.warning("peer replicas: skipping %s: %s", listing.step_dir(s), exc)
                    continue
                if m.step == s and m.node == domain and m.run_id == self.run_id:
                    out.append(Held(domain, s, m.world_size, tuple(m.nodes.get(domain, ())), m.created_at))
        return out

    def restore_round(self, coord: Coordinator, step: int,
                      sources: Mapping[int, tuple[int, str]]) -> tuple[set[int], int | None]:
        """Collective (foreground group, every rank): each domain leader in ``sources`` (needing leader ->
        (holding leader, replica domain)) receives its part of ``step`` from the holder's replica and
        commits it in its local tier. Returns the leaders that got it, and the bytes this rank's domain
        received (None when it received nothing)."""
        topo = self.topo
        group = coord.group()
        offers: dict[int, Offer | None] = {}  # needer -> what this rank (its holder) offers it
        sinks: dict[int, StepSink] = {}  # holder -> where this rank (its needer) receives
        held_open = contextlib.ExitStack()

        def prepare() -> None:
            """This rank's side of each of its transfers (an offer it cannot make is offered as nothing)."""
            for needer, (holder, domain) in sorted(sources.items()):
                if topo.rank == holder:
                    sdir = RunDir.at(replica_run_dir(self.run_dir, domain)).step(step)
                    offers[needer] = None
                    try:
                        if held_open.enter_context(reading_step(sdir)):
                            offers[needer] = offer_of(sdir, self.run_id, step, domain,
                                                      read_manifest_file(os.path.join(sdir, MANIFEST_NAME)))
                    except Exception as exc:
                        log.warning("peer replicas: cannot offer %s: %s", sdir, exc)
                elif topo.rank == needer:
                    sinks[holder] = StepSink(self.run_id, lambda _d: self.run_dir, TempKind.PEER, topo.nonce,
                                             free_space_margin=self.margin, commit=self._commit_restored, step=step)

        got_here: int | None = None
        with held_open:
            # Both sides of every transfer are ready, or every rank raises here: a rank never waits in a
            # transfer whose partner failed before it (the transfers themselves keep their streams paired).
            coord.phase(f"preparing the transfers of step {step} from partners' replicas", prepare)
            for needer, (holder, domain) in sorted(sources.items()):
                if topo.rank == holder:
                    transfer(group, to=needer, offer=offers[needer], frm=None, sink=None, run_id=self.run_id)
                elif topo.rank == needer:
                    t0 = time.perf_counter()
                    res = transfer(group, to=None, offer=None, frm=holder, sink=sinks[holder], run_id=self.run_id)
                    if res.received and not res.error:
                        got_here = res.received
                        dt = time.perf_counter() - t0
                        log.info("step %d: received %.1f MiB for %s from rank %d's replica of %s in %.2f s "
                                 "(%.1f MiB/s)", step, res.received / 2**20, topo.domain, holder, domain, dt,
                                 res.received / 2**20 / max(dt, 1e-9))
                    else:
                        err = res.error or res.declined or f"rank {holder} offered nothing"
                        log.warning("step %d: %s could not restore from rank %d's replica of %s: %s", step,
                                    topo.domain, holder, domain, err)
        gathered = coord.phase(f"receiving step {step} from partners' replicas", lambda: got_here)
        got = {r for r, n in enumerate(gathered) if n is not None}
        return got, gathered[topo.domain_ranks[0]]

    def _commit_restored(self, tmp: str, step: int, m: Manifest) -> None:
        """A replica received at restore becomes this domain's committed step: its manifest names this
        domain (as a durable fetch's does), then the engine's rename commits it."""
        mine = self.topo.domain
        shards = tuple(dataclasses.replace(s, node=mine) if s.node == m.node else s for s in m.shards)
        local = dataclasses.replace(m, node=mine, shards=shards)
        atomic_write(os.path.join(tmp, MANIFEST_NAME), local.to_json().encode())
        fsync_dir(tmp)
        self.install(tmp, step, f"peer-{self.topo.nonce}")


def peer_sources(step: int, lacking: Sequence[int], held: Mapping[int, Sequence[Held]],
                 topo: Topology, saved_at: Sequence[float]) -> dict[int, tuple[int, str]]:
    """For each leader in ``lacking`` (its domain lacks ``step``), a leader holding a replica of ``step``
    written by exactly that domain's ranks at this world size, and the replica's domain. ``saved_at``: the
    ``created_at`` of the domains' own copies of ``step``; a replica of another save of the same step
    number (the run went back to an older step and saved this one again while the replica could not be
    replaced) is never mixed with them. The same on every rank: every input is gathered."""
    stamps = set(saved_at)
    if len(stamps) > 1:  # the domains' own copies disagree already: no replica can complete them
        return {}
    out: dict[int, tuple[int, str]] = {}
    for need in lacking:
        ranks = tuple(r for r, d in enumerate(topo.domain_of_rank) if d == topo.domain_of_rank[need])
        for holder in sorted(held):
            match = next((h for h in held[holder] if h.step == step and h.world_size == topo.world_size
                          and h.ranks == ranks and (not stamps or h.created_at in stamps)), None)
            if holder != need and match is not None:
                out[need] = (holder, match.domain)
                stamps = {match.created_at}  # every other replica used must be of the same save
                break
    return out


__all__ = ["PIECE", "Held", "Offer", "PeerReplicas", "PeerTransferError", "ReplicaOutcome", "Ring", "RoundResult",
           "StepSink", "any_ring", "check_header", "peer_sources", "ring", "transfer"]
