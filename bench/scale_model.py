"""A scale model of restore and of the durable commit: 16 to 4,096 nodes, a 1 TB checkpoint (issue 14, item 4).

    .venv/bin/python bench/scale_model.py [--nodes 16,64,256,1024,4096] [--size-tb 1] [--ranks-per-node 8]
                                          [--measure] [--json OUT] [parameter flags, see --help]

Nothing here runs at scale. The model takes the request and byte patterns from the code and multiplies them
by bandwidths and latencies that are parameters. ``--measure`` measures what this machine can measure in
about a minute: the local O_DIRECT read bandwidth, and the latency and single-stream throughput of S3 over
loopback, against a moto server in its own process (started the way ``bench/bench_drain.py`` starts it).
Cluster figures are assumptions, each with its source (``ASSUMPTIONS``). Every figure is printed with
where it comes from. The tables are in docs/benchmarks.md ("Scale model").

What the code does (read at the time of writing; the model follows it)
-----------------------------------------------------------------------
Restore from the durable tier (``resilient_slurm/checkpoint/fetch.py``):
- ``DurableFetcher.steps``: rank 0 lists the run (``manifest.durable_steps``): one LIST of ``<run>/``
  (delimiter ``/``; 1,000 names per page) and one HEAD per step directory listed.
- ``DurableFetcher.fetch``, on the leader of each domain that lacks the step: GET of the root manifest, GET of
  one domain's marker, GET of its ``.metadata`` (``DurableFetcher.source``). The domain fetched from is its own,
  else at the same world size the saved domain that held the same ranks (``_source_domain``: a requeue onto
  other nodes, a replaced node). If its ranks are the ones that wrote that domain's shards (``same_layout``), it
  fetches only those files. Otherwise (another world size, or ranks placed differently) every rank first plans
  against the durable metadata (``Restorer._planned_reads``: the same 3 GETs on every rank of the domain, not
  counted below) and the leader fetches the items the plans read: a file whole when they read at least 3/4
  of it, else only those items (``StorageTier.get_ranges``); with sharded state a node restarted on half the
  nodes reads the files of two saved nodes, whole (dim-0 shards halve evenly: every item of them is read). Before both rules (the "every file" columns) a domain
  that had not written the step fetched every file the metadata points at, the whole checkpoint for sharded
  (FSDP/DTensor) state.
- The files are fetched ``FILES_IN_FLIGHT`` (8) at a time (``DurableFetcher._get_files``; before, one after
  another). Each ``get_file`` does one HEAD (S3; an open on POSIX), then ranged pieces in parallel on the
  tier's pool: ``drain_threads`` (8) at a time across the files under way, pieces of ``s3_part_size``
  (64 MiB, ``S3Tier.get_file``) or 16 MiB (``PosixTier``, ``PIECE``). A file smaller than one piece is one
  request on one connection.
- The fetched files are committed into the local tier; then every rank reads its plan's byte ranges from
  the local copy (``checkpoint/restore.py``). The fetch round is collective (``fetch_round``: all_gather), so
  the restore waits for the slowest node.

The durable commit (``resilient_slurm/daemon/drain.py`` ``StepDrainer``, ``daemon/service.py`` ``Daemon``):
- Each node drains its own shards, then PUTs ``domains/<node>/.metadata``, ``domains/<node>/manifest.json``
  and its commit marker ``commits/<save token>/<node>`` (an empty object). Before that: GET of the root
  manifest (absent), HEAD of its own marker (absent), one LIST of ``commits/`` (its markers of other saves
  of the step are deleted: one LIST page, the saves of this step).
- ``StepDrainer.try_commit``: one paginated LIST of ``commits/<save token>/`` (1,000 names a page); the node
  that finds all N GETs the first domain's manifest and ``.metadata`` and PUTs the root ``.metadata`` and
  ``manifest.json``. Per check: 3 + ceil(N / 1000) requests (GET root manifest, HEAD own marker, the LIST
  pages) after the first, which also has the LIST of ``commits/``.
- The last node to write its marker sees every marker and commits: nobody needs to re-check. A node left
  ``waiting`` re-checks all the same (a node may die between its marker and the commit), after the poll
  interval, then doubling up to 60 s (``drain.recheck_delay``).
- Every pass of every node's daemon, idle or not, also calls ``durable_steps`` (one LIST of ``<run>/`` plus one
  HEAD per step directory) and ``read_durable_tags`` (one GET of ``<run>/tags.json``) for each run it holds.
- The commit before (the "previous" columns): ``try_commit`` GET the marker manifest of *every* domain, one
  after another; every node ran it after its marker and again on every pass while waiting: N + 2 GETs per
  node per check, N^2 per step.

Ranged fetch (issue 14 item 2) and peer replicas (item 3) are built (fetch.py, checkpoint/peers.py). In the
model's cases every file a node touches is read whole, so the code fetches whole files ("today"); the
"ranged" column is the same bytes all as ranged GETs. The model assumes:
- ranged: each node fetches only the byte ranges its ranks' load plans need, as ranged GETs of
  ``piece`` bytes, ``drain_threads`` in flight across files (not file after file), no HEAD (sizes from the
  manifest; one request per file touched is counted all the same).
- peer replicas: every domain's shards are also on one partner node's NVMe (the newest step, sent after each
  save); a replaced node reads its domain from its partner over one gloo connection and nothing from the
  durable tier. When every node is new (a requeue
  onto other nodes, another world size), the partners are gone too, so peer = ranged there; same for a wiped
  NVMe.

The model (simple on purpose; every term is printed in ``--json``)
-----------------------------------------------------------------
Per file fetched on a node, before (files one after another): L (HEAD) + ceil(p / T) * L
+ size / min(B_node, min(T, p) * B_stream), with p = ceil(size / piece), T = drain_threads, L = per-request
latency of the tier, B_stream = one connection's (one thread's) throughput, B_node = min(NIC, NVMe write) (the
fetch lands in the local tier). Per node, before: 3 L + the sum over its files.
Per node, today (f files, 8 at a time): 3 L + ceil(f / 8) L + ceil(f p / T) L + bytes / min(B_node, min(T, f p) * B_stream).
Per node, ranged: 3 L + ceil(f / T) L + ceil(r / T) L + bytes / min(B_node, T * B_stream), f files, r ranges.
Per node, peer: bytes / min(NIC, NVMe read, NVMe write, one gloo stream).
All fetching nodes together: T_fetch = max(slowest node, total bytes / B_aggregate, rate-limited requests / rate).
Restore time = listing ((1 + D) L, D = step directories listed) + T_fetch + local read (N-th of the checkpoint
/ NVMe read). Nodes that fetch nothing read locally; the collective waits for the slowest.
The state is assumed fully sharded: each node's domain holds size / N (with DDP every domain holds a full
copy of the replicated state; the durable tier then holds N copies and is not the case modelled here).

Commit check per step, today: every node 4 + pages requests once (pages = ceil(N / 1000) LIST pages of the
markers; plus the LIST of ``commits/``), then re-checks of 3 + pages while waiting: nodes finish their drain
spread over W seconds (``--finish-spread-s``), so a node waits W/2 on average, re-checking after poll, 2 poll,
4 poll... (at most 60 s apart). The last node commits after its own check (4 + pages requests, 2 GETs and 2
PUTs more). The store serves at most ``rate`` requests/s on one prefix: if the requests of a step do not fit
in the window at that rate, the check takes requests / rate instead. Previous: the same with N + 2 GETs per
check and a re-check every (poll + N L) seconds.
Background: every node, every pass: (1 LIST + D HEAD + 1 GET) per run.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
GB = 1e9
MiB = 2**20
FILES_IN_FLIGHT = 8  # resilient_slurm/checkpoint/fetch.py
TB = 1e12

# ------------------------------------------------------------------------------------------- parameters
# Measured on this machine (2 cores, AMD EPYC, virtualized, ext4 on virtio; moto 5.2.5 over loopback), by
# `bench/scale_model.py --measure` on 2026-11-25; each also in docs/benchmarks.md.
MEASURED = {
    "local_read_gbps": (2.10, "raw O_DIRECT read of 256 MiB, best of 1 and 4 threads, page cache dropped, "
                              "--measure 2026-11-25 (load average 6.5 on 2 cores; 2.23 GB/s in a second run at 7.6); 4.41 GB/s on a quiet machine "
                              "in docs/benchmarks.md 'Checkpoint engine'"),
    "moto_get_latency_s": (0.0121, "median GET of a 2 KB object, moto over loopback, --measure 2026-11-25 "
                                   "(31.9 ms in a second run under a heavier load)"),
    "moto_head_latency_s": (0.0065, "median HEAD, same run (28.3 ms in the second)"),
    "moto_put_latency_s": (0.0167, "median PUT of 1 byte, same run (17.3 ms)"),
    "moto_list_latency_s": (0.985, "median LIST page of 1,000 keys, same run (632 ms; moto builds the XML in "
                                   "Python)"),
    "moto_stream_gbps": (0.129, "one 64 MiB GET on one connection, same run (0.207 GB/s)"),
    "moto_eight_streams_gbps": (0.141, "eight 64 MiB GETs in parallel, same run (0.293 GB/s; moto is CPU-bound)"),
}

# Cluster figures: assumptions, with their sources. Change them with the flags.
ASSUMPTIONS = {
    "nvme_read_gbps": (6.0, "one data-centre NVMe (PCIe 4, e.g. Samsung PM9A3 6.9 GB/s, Micron 7450 6.8 GB/s "
                            "sequential read datasheets); several drives per node go higher"),
    "nvme_write_gbps": (3.0, "the same drives' sequential write (4.1 / 5.3 GB/s datasheets), less for "
                             "sustained writes; here 0.9 GB/s raw write (docs/benchmarks.md)"),
    "nic_gbps": (25.0, "200 Gb/s per node (one HDR/NDR200 InfiniBand or 200 GbE port); "
                       "GPU nodes often have 4-8 x 400 Gb/s for the GPUs, not for storage"),
    "peer_stream_gbps": (3.0, "one gloo TCP connection between two nodes' leaders (the replica transfer is one "
                              "stream): a few GB/s on a 200 Gb/s port (assumption); here 2.7 GB/s one way and "
                              "1.2 GB/s each way both at once over loopback on 2 busy cores"),
    "lustre_aggregate_gbps": (500.0, "a large Lustre file system: hundreds of GB/s aggregate (e.g. "
                                     "Frontier's Orion ~10 TB/s, many sites 100s of GB/s)"),
    "lustre_stream_gbps": (2.0, "one client thread reading one Lustre file stripe-wise: ~1-3 GB/s"),
    "lustre_latency_s": (0.0005, "one metadata round trip (open/stat) to a Lustre MDS: ~0.2-1 ms"),
    "lustre_md_rate": (50000.0, "opens/stats per second one Lustre MDT serves: 10^4-10^5 for one "
                                "directory tree (mdtest/IO500 results vary widely); plug in your own"),
    "s3_latency_s": (0.020, "AWS S3 performance guidelines: for requests under 512 KB 'median latencies are "
                            "often in the tens of milliseconds'"),
    "s3_list_latency_s": (0.1, "one LIST page of 1,000 keys (~250 KB of XML): a few small GETs' worth; a "
                                "guess, AWS publishes no figure"),
    "s3_stream_gbps": (0.088, "AWS S3 performance guidelines: 'one concurrent request for each 85-90 MB/s "
                              "of desired network throughput'"),
    "s3_rate": (5500.0, "AWS S3: '5,500 GET/HEAD requests per second per partitioned prefix' (3,500 "
                        "PUT/COPY/POST/DELETE); S3 adds partitions under sustained load, answering 503 "
                        "SlowDown meanwhile. LIST is counted as a read here"),
    "s3_aggregate_gbps": (float("inf"), "no aggregate bandwidth bound assumed for S3 (the request rate and "
                                        "the per-node connections bound it)"),
    "s3_price_get_per_1k": (0.0004, "AWS S3 Standard us-east-1: GET, SELECT and all other requests, "
                                    "per 1,000"),
    "s3_price_list_per_1k": (0.005, "AWS S3 Standard us-east-1: PUT, COPY, POST, LIST, per 1,000"),
    "interval_min": (30.0, "a checkpoint every 30 minutes (common for large runs; the daemon drains "
                           "every committed step that retention keeps)"),
    "finish_spread_s": (30.0, "seconds between the first and the last node finishing their drain of a "
                              "step (stragglers, uneven shards); a guess"),
}

# From the code's defaults (resilient_slurm/config.py, storage/posix.py).
CODE_DEFAULTS = {
    "threads": (8, "drain_threads (config.py): parallel pieces per node, to and from the durable tier"),
    "s3_part_mib": (64, "s3_part_size (config.py): S3 part and ranged GET size"),
    "posix_piece_mib": (16, "PosixTier PIECE (storage/posix.py)"),
    "poll_s": (5.0, "drain_poll_interval (config.py): seconds between the daemon's passes when idle"),
    "keep_last": (3, "keep_last (config.py): durable step directories = keep_last + 1 in flight"),
}


@dataclasses.dataclass(frozen=True)
class Tier:
    """One durable tier's figures."""

    name: str
    latency: float  # s per request round trip (small object, HEAD, open)
    stream: float  # bytes/s of one connection / thread
    aggregate: float  # bytes/s the whole store serves (inf: no bound)
    rate: float  # rate-limited requests/s (S3: every request on one prefix; POSIX: metadata ops)
    piece: int  # bytes per ranged request
    metadata_only_rate: bool  # POSIX: only opens/stats count against ``rate``; S3: every request
    list_latency: float  # s per LIST page


@dataclasses.dataclass(frozen=True)
class Params:
    nodes: tuple[int, ...]
    size: float  # bytes of the checkpoint (unique bytes, fully sharded)
    ranks_per_node: int
    threads: int
    nvme_read: float
    nvme_write: float
    nic: float
    peer_stream: float  # one gloo connection between partner leaders (checkpoint/peers.py)
    poll_s: float
    keep_last: int
    interval_s: float
    finish_spread_s: float
    measured_latency: float  # moto GET latency, for the "at the latency measured here" column (S3 only)
    measured_list_latency: float  # moto LIST page of 1,000 keys
    tiers: tuple[Tier, ...]
    price_get: float
    price_list: float

    @property
    def step_dirs(self) -> int:
        """Step directories of a run in the durable tier: keep_last plus the one being drained."""
        return self.keep_last + 1


# ------------------------------------------------------------------------------------------- the model
@dataclasses.dataclass
class NodeFetch:
    """One node's fetch: seconds, bytes from the durable tier, requests, rate-limited requests."""

    seconds: float = 0.0
    durable_bytes: float = 0.0
    requests: int = 0
    limited: int = 0  # requests that count against the tier's rate


def node_bw(p: Params) -> float:
    """What one node can take in from outside: NIC, and the NVMe the fetch writes to."""
    return min(p.nic, p.nvme_write)


def fetch_before(p: Params, t: Tier, files: int, file_size: float) -> NodeFetch:
    """``DurableFetcher.fetch`` before files went in parallel: 3 small GETs, then ``files`` files one after
    another, each a HEAD then ``min(threads, pieces)`` ranged requests at a time."""
    f = NodeFetch(seconds=3 * t.latency, requests=3, limited=3)
    pieces = max(1, math.ceil(file_size / t.piece))
    par = min(p.threads, pieces)
    per_file = t.latency + math.ceil(pieces / p.threads) * t.latency + file_size / min(node_bw(p), par * t.stream)
    f.seconds += files * per_file
    f.durable_bytes = files * file_size
    f.requests += files * (1 + pieces)
    f.limited += files * (1 if t.metadata_only_rate else 1 + pieces)
    return f


def fetch_today(p: Params, t: Tier, files: int, file_size: float) -> NodeFetch:
    """``DurableFetcher.fetch``: 3 small GETs, then the files ``FILES_IN_FLIGHT`` (8) at a time, each a HEAD then
    its ranged requests on the tier's ``threads``: HEADs in waves of 8, pieces ``threads`` at a time across files."""
    pieces = max(1, math.ceil(file_size / t.piece))
    f = NodeFetch(requests=3 + files * (1 + pieces))
    f.limited = 3 + files * (1 if t.metadata_only_rate else 1 + pieces)
    f.seconds = (3 * t.latency + math.ceil(files / FILES_IN_FLIGHT) * t.latency
                 + math.ceil(files * pieces / p.threads) * t.latency
                 + files * file_size / min(node_bw(p), min(p.threads, files * pieces) * t.stream))
    f.durable_bytes = files * file_size
    return f


def fetch_plan(p: Params, t: Tier, files: int, nbytes: float) -> NodeFetch:
    """Every byte by ranges: ``nbytes`` in ranged requests over ``files`` files, ``threads`` in flight
    across files."""
    per_file = nbytes / files
    ranges = files * max(1, math.ceil(per_file / t.piece))
    f = NodeFetch(requests=3 + files + ranges)
    f.limited = 3 + files + (0 if t.metadata_only_rate else ranges)
    f.seconds = (3 * t.latency + math.ceil(files / p.threads) * t.latency + math.ceil(ranges / p.threads) * t.latency
                 + nbytes / min(node_bw(p), p.threads * t.stream))
    f.durable_bytes = nbytes
    return f


def fetch_peer(p: Params, nbytes: float) -> NodeFetch:
    """Peer replica (``PeerReplicas.restore_round``): the node's domain from its partner's NVMe, over one gloo
    connection of the job, read, sent, written and hashed overlapped (O_DIRECT both ends)."""
    return NodeFetch(seconds=nbytes / min(p.nic, p.nvme_read, p.nvme_write, p.peer_stream))


def aggregate(t: Tier, fetches: Sequence[NodeFetch]) -> dict[str, Any]:
    """Every fetching node at once: the slowest node, the store's bandwidth, its request rate."""
    if not fetches:
        return {"seconds": 0.0, "node_s": 0.0, "bandwidth_s": 0.0, "rate_s": 0.0, "durable_bytes": 0.0,
                "requests": 0, "bound": "none"}
    node_s = max(f.seconds for f in fetches)
    total = sum(f.durable_bytes for f in fetches)
    limited = sum(f.limited for f in fetches)
    bw_s = total / t.aggregate if t.aggregate != float("inf") else 0.0
    rate_s = limited / t.rate
    terms = {"node": node_s, "aggregate bandwidth": bw_s, "request rate": rate_s}
    bound = max(terms, key=lambda k: terms[k])
    return {"seconds": max(terms.values()), "node_s": node_s, "bandwidth_s": bw_s, "rate_s": rate_s,
            "durable_bytes": total, "requests": sum(f.requests for f in fetches), "bound": bound}


SCENARIOS = {
    "other_nodes": "requeue onto other nodes, same world size: every node fetches",
    "one_replaced": "one node replaced: it fetches, the others read their local copy",
    "same_nodes_wiped": "requeue onto the same nodes, local copies gone (e.g. an epilog wiped the NVMe)",
    "resharded": "restart on half the nodes (another world size): every node fetches",
}


def restore(p: Params, t: Tier, n: int, scenario: str) -> dict[str, Any]:
    """Restore time, durable bytes and requests at ``n`` restoring nodes: what the code does today, every file
    (what it did before it chose files by saved domain and by load plan), ranged fetch and peer replicas."""
    saved = 2 * n if scenario == "resharded" else n
    share = p.size / n  # what one restoring node's ranks hold (fully sharded state)
    files_all = saved * p.ranks_per_node
    file_size = p.size / files_all
    listing = (1 + p.step_dirs) * t.latency  # rank 0: durable_steps (LIST + one HEAD per step dir)
    list_reqs = 1 + p.step_dirs
    local_read = share / p.nvme_read
    out: dict[str, Any] = {"nodes": n, "saved_nodes": saved, "local_only_s": local_read}
    own = fetch_today(p, t, p.ranks_per_node, file_size)  # the saved domain that held the same ranks
    every = fetch_before(p, t, files_all, file_size)
    if scenario == "other_nodes":
        fetching = n
        today, plan, peer = own, fetch_plan(p, t, p.ranks_per_node, share), None  # the partners are gone
    elif scenario == "one_replaced":
        fetching = 1
        today, plan = own, fetch_plan(p, t, p.ranks_per_node, share)
        peer = fetch_peer(p, share) if n > 1 else None  # one node alone has no partner
    elif scenario == "same_nodes_wiped":
        fetching = n
        today, plan, peer = own, fetch_plan(p, t, p.ranks_per_node, share), None  # the partners' NVMe too
        every = fetch_before(p, t, p.ranks_per_node, file_size)  # same names, same ranks: always its own files
    elif scenario == "resharded":
        # Each new node's ranks plan to read what two saved nodes held: their files, whole (fetch.py, the
        # plans' files). Dim-0 shards halve evenly here; uneven shards add up to one file per rank.
        fetching = n
        touched = 2 * p.ranks_per_node
        today, plan, peer = fetch_today(p, t, touched, file_size), fetch_plan(p, t, touched, share), None
    else:
        raise ValueError(scenario)
    for name, f in (("today", today), ("every_file", every), ("plan", plan), ("peer", peer if peer else plan)):
        a = aggregate(t, [f] * fetching)
        out[name] = {
            "restore_s": listing + a["seconds"] + local_read,
            "fetch_s": a["seconds"], "bound": a["bound"], "node_s": a["node_s"], "bandwidth_s": a["bandwidth_s"],
            "rate_s": a["rate_s"], "durable_bytes": a["durable_bytes"],
            "durable_requests": int(a["requests"]) + list_reqs,
        }
    return out


def rechecks_within(wait_s: float, poll_s: float, cap_s: float = 60.0) -> int:
    """Re-checks a waiting node makes in ``wait_s`` (``drain.recheck_delay``: poll, doubling, capped)."""
    k, t = 0, 0.0
    while True:
        t += min(poll_s * 2 ** k, max(poll_s, cap_s))
        if t > wait_s:
            return k
        k += 1


def commit(p: Params, t: Tier, n: int) -> dict[str, Any]:
    """The durable commit's small requests per step at ``n`` nodes (see the module docstring)."""
    pages = math.ceil(n / 1000)
    check_reqs = 3 + pages  # GET root manifest, HEAD own marker, LIST pages of commits/<save>/
    check_s = 2 * t.latency + pages * t.list_latency
    rechecks = rechecks_within(p.finish_spread_s / 2, p.poll_s)  # per node, on average, while waiting
    per_step = n * (check_reqs + 1 + rechecks * check_reqs) + 4  # + LIST of commits/; the committer's 2 GET 2 PUT
    window = p.finish_spread_s + check_s
    rate_s = per_step / t.rate
    commit_s = max(check_s + 4 * t.latency, rate_s - p.finish_spread_s)
    per_pass = 1 + p.step_dirs + 1  # durable_steps: LIST + HEAD per step dir; read_durable_tags: GET
    bg_rate = n * per_pass / p.poll_s
    steps_day = 86400 / p.interval_s
    per_day = per_step * steps_day + bg_rate * 86400
    list_day = n / p.poll_s * 86400 + n * (1 + pages * (1 + rechecks)) * steps_day  # LISTs
    dollars = (per_day - list_day) / 1000 * p.price_get + list_day / 1000 * p.price_list if t.name == "S3" else None
    # The previous commit: N + 2 GETs per check, every node, again on every pass while waiting.
    prev_check_s = (n + 2) * t.latency
    prev_rechecks = (p.finish_spread_s / 2) / (p.poll_s + prev_check_s)
    prev_per_step = n * (n + 2) * (1 + prev_rechecks)
    prev_commit_s = max(prev_check_s, prev_per_step / t.rate - p.finish_spread_s)
    # (2) a per-step counter object with conditional writes (GET + PUT If-Match per node): serialized,
    # one success per 2 L at best, N of them.
    counter_s = n * 2 * t.latency
    return {
        "nodes": n, "requests_per_check": check_reqs, "list_pages_per_check": pages, "check_s": check_s,
        "check_s_measured_latency": (2 * p.measured_latency + pages * p.measured_list_latency
                                     if t.name == "S3" else None),
        "rechecks_per_node": rechecks, "requests_per_step": per_step, "window_s": window,
        "rate_bound_s": rate_s, "commit_after_last_marker_s": commit_s,
        "background_req_per_s": bg_rate, "requests_per_day": per_day, "dollars_per_day": dollars,
        "previous_gets_per_check": n + 2, "previous_check_s": prev_check_s,
        "previous_rechecks_per_node": prev_rechecks, "previous_requests_per_step": prev_per_step,
        "previous_commit_after_last_marker_s": prev_commit_s,
        "counter_serialized_s": counter_s,
    }


def run_model(p: Params) -> dict[str, Any]:
    out: dict[str, Any] = {"params": _params_json(p), "restore": {}, "commit": {}}
    for t in p.tiers:
        out["restore"][t.name] = {s: [restore(p, t, n, s) for n in p.nodes] for s in SCENARIOS}
        out["commit"][t.name] = [commit(p, t, n) for n in p.nodes]
    return out


def _params_json(p: Params) -> dict[str, Any]:
    d = dataclasses.asdict(p)
    for t in d["tiers"]:
        for k, v in list(t.items()):
            if v == float("inf"):
                t[k] = None
    return d


# ------------------------------------------------------------------------------------------- output
def human_s(s: float) -> str:
    if s < 1:
        return f"{s * 1000:.0f} ms" if s >= 0.001 else "<1 ms"
    if s < 120:
        return f"{s:.1f} s" if s < 10 else f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


def human_b(b: float) -> str:
    if b == 0:
        return "0"
    for unit, f in (("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if b >= f:
            v = b / f
            return f"{v:.0f} {unit}" if v >= 10 else f"{v:.1f} {unit}"
    return f"{b / 1e3:.0f} kB"


def human_n(x: float) -> str:
    if x < 1000:
        return f"{x:.0f}"
    for unit, f in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= f:
            v = x / f
            return f"{v:.0f}{unit}" if v >= 10 else f"{v:.1f}{unit}"
    return f"{x:.0f}"


def _opt(v: Any, f: Any) -> str:
    return "-" if v is None else str(f(v))


def print_tables(res: dict[str, Any], p: Params) -> None:
    print(f"Checkpoint {human_b(p.size)}, fully sharded, {p.ranks_per_node} ranks (shard files) per node; "
          f"NVMe read {p.nvme_read / GB:g} GB/s, write {p.nvme_write / GB:g} GB/s; NIC {p.nic / GB:g} GB/s; "
          f"peer stream {p.peer_stream / GB:g} GB/s; "
          f"{p.threads} transfers in flight per node.")
    for t in p.tiers:
        agg = "unbounded" if t.aggregate == float("inf") else f"{t.aggregate / GB:g} GB/s"
        print(f"- {t.name}: latency {t.latency * 1000:g} ms, one stream {t.stream / GB:g} GB/s, aggregate {agg}, "
              f"{t.rate:g} {'metadata ops' if t.metadata_only_rate else 'requests'}/s, pieces of "
              f"{t.piece / MiB:g} MiB")
    print()
    for t in p.tiers:
        for s, title in SCENARIOS.items():
            print(f"### {t.name}: {title}")
            print()
            print("| nodes | local only | today: restore | durable bytes | requests | before: restore | "
                  "durable bytes | requests | ranged: restore | durable bytes | requests | peer replicas: restore | "
                  "durable bytes | requests |")
            print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
            for row in res["restore"][t.name][s]:
                cells = [str(row["nodes"]), human_s(row["local_only_s"])]
                for k in ("today", "every_file", "plan", "peer"):
                    r = row[k]
                    bound = {"node": "", "aggregate bandwidth": " (bw)", "request rate": " (rate)"}.get(r["bound"], "")
                    cells += [human_s(r["restore_s"]) + bound, human_b(r["durable_bytes"]),
                              human_n(r["durable_requests"])]
                print("| " + " | ".join(cells) + " |")
            print()
    print("Restore time = listing + fetch + local read; '(bw)': the store's aggregate bandwidth bounds the fetch, "
          "'(rate)': its request rate; otherwise the slowest node does.")
    print()
    for t in p.tiers:
        print(f"### {t.name}: the durable commit's small requests per step")
        print()
        get = "GETs" if t.name == "S3" else "reads"
        print(f"| nodes | requests per check | LIST pages | one check | at moto's latency | rechecks per node | "
              "requests per step | commit after the last marker | background requests/s | requests per day | "
              f"$ per day | previous: marker {get} per check | requests per step | commit after the last marker | "
              "counter object: serialized |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for c in res["commit"][t.name]:
            print("| " + " | ".join([
                str(c["nodes"]), str(c["requests_per_check"]), str(c["list_pages_per_check"]), human_s(c["check_s"]),
                _opt(c["check_s_measured_latency"], human_s), str(c["rechecks_per_node"]),
                human_n(c["requests_per_step"]), human_s(c["commit_after_last_marker_s"]),
                human_n(c["background_req_per_s"]), human_n(c["requests_per_day"]),
                _opt(c["dollars_per_day"], lambda d: f"{d:,.0f}"),
                human_n(c["previous_gets_per_check"]), human_n(c["previous_requests_per_step"]),
                human_s(c["previous_commit_after_last_marker_s"]), human_s(c["counter_serialized_s"]),
            ]) + " |")
        print()


# ------------------------------------------------------------------------------------------- measuring
def measure_local_read(directory: str, mib: int) -> dict[str, Any]:
    """O_DIRECT read of a fresh file, 1 and 4 threads, like bench/common.py's raw_read (whose helpers it uses)."""
    sys.path[:0] = [HERE, REPO]
    from common import Cache, page_buffer, raw_read, raw_write  # imports torch: only here

    path = os.path.join(directory, f"rslurm-scale-{os.getpid()}.bin")
    mm, mv = page_buffer(mib * MiB)
    cache = Cache()
    out: dict[str, Any] = {"bytes": mib * MiB, "cache": cache.method}
    try:
        raw_write(path, mv, 1)
        for threads in (1, 4, 1, 4):
            cache.drop(path)
            s, direct = raw_read(path, mv, threads)
            out.setdefault(f"read_t{threads}_s", []).append(s)
            out["o_direct"] = direct
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
        mv.release()
        mm.close()
    out["read_gbps"] = max(mib * MiB / min(v) / GB for k, v in out.items() if k.startswith("read_t"))
    return out


def measure_s3(root: str, gets: int = 200) -> dict[str, Any]:
    """moto over loopback, in its own process (as bench/bench_drain.py starts it): small-object GET and HEAD
    latency, a LIST page of 1,000 keys, one 64 MiB GET on one connection, eight in parallel."""
    sys.path[:0] = [HERE, REPO]
    from concurrent.futures import ThreadPoolExecutor

    import boto3
    from bench_drain import Moto
    from botocore.config import Config

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    moto = Moto(root)
    try:
        c = boto3.session.Session().client("s3", endpoint_url=moto.url, config=Config(max_pool_connections=16))
        c.create_bucket(Bucket="scale")
        c.put_object(Bucket="scale", Key="run/step_1/domains/n0/manifest.json", Body=b"x" * 2048)

        def timed(fn: Any, k: int) -> list[float]:
            xs = []
            for _ in range(k):
                t0 = time.perf_counter()
                fn()
                xs.append(time.perf_counter() - t0)
            return xs

        get = timed(lambda: c.get_object(Bucket="scale", Key="run/step_1/domains/n0/manifest.json")["Body"].read(),
                    gets)
        head = timed(lambda: c.head_object(Bucket="scale", Key="run/step_1/domains/n0/manifest.json"), gets)
        put = timed(lambda: c.put_object(Bucket="scale", Key=f"many/{time.perf_counter_ns()}", Body=b"m"), 999)
        lst = timed(lambda: c.list_objects_v2(Bucket="scale", Prefix="many/"), 20)
        big = os.urandom(1 << 20) * 64
        c.put_object(Bucket="scale", Key="big", Body=big)
        one = timed(lambda: c.get_object(Bucket="scale", Key="big")["Body"].read(), 3)
        with ThreadPoolExecutor(8) as pool:
            def eight() -> None:
                list(pool.map(lambda _: c.get_object(Bucket="scale", Key="big")["Body"].read(), range(8)))
            par = timed(eight, 2)
    finally:
        moto.stop()
    return {
        "get_latency_s": statistics.median(get), "head_latency_s": statistics.median(head),
        "put_latency_s": statistics.median(put), "list_1000_latency_s": statistics.median(lst),
        "stream_gbps": 64 * MiB / statistics.median(one) / GB,
        "eight_streams_gbps": 8 * 64 * MiB / statistics.median(par) / GB,
    }


# ------------------------------------------------------------------------------------------- command line
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a, m, c = ASSUMPTIONS, MEASURED, CODE_DEFAULTS
    ap.add_argument("--nodes", default="16,64,256,1024,4096", help="node counts, comma-separated")
    ap.add_argument("--size-tb", type=float, default=1.0, help="checkpoint size (TB, 10^12 bytes)")
    ap.add_argument("--ranks-per-node", type=int, default=8, help="ranks, and so shard files, per node")
    ap.add_argument("--threads", type=int, default=c["threads"][0], help=c["threads"][1])
    ap.add_argument("--nvme-read-gbps", type=float, default=a["nvme_read_gbps"][0], help=a["nvme_read_gbps"][1])
    ap.add_argument("--nvme-write-gbps", type=float, default=a["nvme_write_gbps"][0], help=a["nvme_write_gbps"][1])
    ap.add_argument("--nic-gbps", type=float, default=a["nic_gbps"][0], help="GB/s per node: " + a["nic_gbps"][1])
    ap.add_argument("--peer-stream-gbps", type=float, default=a["peer_stream_gbps"][0],
                    help="GB/s of one gloo connection between partner nodes: " + a["peer_stream_gbps"][1])
    ap.add_argument("--lustre-aggregate-gbps", type=float, default=a["lustre_aggregate_gbps"][0],
                    help=a["lustre_aggregate_gbps"][1])
    ap.add_argument("--lustre-stream-gbps", type=float, default=a["lustre_stream_gbps"][0],
                    help=a["lustre_stream_gbps"][1])
    ap.add_argument("--lustre-latency-ms", type=float, default=a["lustre_latency_s"][0] * 1000,
                    help=a["lustre_latency_s"][1])
    ap.add_argument("--lustre-md-rate", type=float, default=a["lustre_md_rate"][0], help=a["lustre_md_rate"][1])
    ap.add_argument("--s3-latency-ms", type=float, default=a["s3_latency_s"][0] * 1000, help=a["s3_latency_s"][1])
    ap.add_argument("--s3-list-latency-ms", type=float, default=a["s3_list_latency_s"][0] * 1000,
                    help=a["s3_list_latency_s"][1])
    ap.add_argument("--s3-stream-gbps", type=float, default=a["s3_stream_gbps"][0], help=a["s3_stream_gbps"][1])
    ap.add_argument("--s3-rate", type=float, default=a["s3_rate"][0], help=a["s3_rate"][1])
    ap.add_argument("--s3-partitions", type=int, default=1, help="S3 prefix partitions serving the run (x rate)")
    ap.add_argument("--measured-latency-ms", type=float, default=m["moto_get_latency_s"][0] * 1000,
                    help=m["moto_get_latency_s"][1])
    ap.add_argument("--measured-list-latency-ms", type=float, default=m["moto_list_latency_s"][0] * 1000,
                    help=m["moto_list_latency_s"][1])
    ap.add_argument("--poll-s", type=float, default=c["poll_s"][0], help=c["poll_s"][1])
    ap.add_argument("--keep-last", type=int, default=c["keep_last"][0], help=c["keep_last"][1])
    ap.add_argument("--interval-min", type=float, default=a["interval_min"][0], help=a["interval_min"][1])
    ap.add_argument("--finish-spread-s", type=float, default=a["finish_spread_s"][0], help=a["finish_spread_s"][1])
    ap.add_argument("--measure", action="store_true",
                    help="measure the local O_DIRECT read and moto's latency here first, and use them "
                         "(local read as NVMe read; moto's GET/LIST latency for the 'measured latency' column)")
    ap.add_argument("--measure-dir", default=tempfile.gettempdir(), help="where --measure writes its file")
    ap.add_argument("--measure-mib", type=int, default=256, help="size of --measure's read file")
    ap.add_argument("--json", metavar="OUT", help="write parameters, measurements and every term here")
    return ap


def params_from(args: argparse.Namespace) -> Params:
    s3_list = args.s3_list_latency_ms
    lustre = Tier("Lustre (POSIX tier)", args.lustre_latency_ms / 1000, args.lustre_stream_gbps * GB,
                  args.lustre_aggregate_gbps * GB, args.lustre_md_rate, int(CODE_DEFAULTS["posix_piece_mib"][0]) * MiB,
                  True, args.lustre_latency_ms / 1000)
    s3 = Tier("S3", args.s3_latency_ms / 1000, args.s3_stream_gbps * GB, ASSUMPTIONS["s3_aggregate_gbps"][0],
              args.s3_rate * args.s3_partitions, int(CODE_DEFAULTS["s3_part_mib"][0]) * MiB, False, s3_list / 1000)
    return Params(
        nodes=tuple(int(x) for x in str(args.nodes).split(",") if x.strip()),
        size=args.size_tb * TB, ranks_per_node=args.ranks_per_node, threads=args.threads,
        nvme_read=args.nvme_read_gbps * GB, nvme_write=args.nvme_write_gbps * GB, nic=args.nic_gbps * GB,
        peer_stream=args.peer_stream_gbps * GB,
        poll_s=args.poll_s, keep_last=args.keep_last, interval_s=args.interval_min * 60,
        finish_spread_s=args.finish_spread_s, measured_latency=args.measured_latency_ms / 1000,
        measured_list_latency=args.measured_list_latency_ms / 1000,
        tiers=(lustre, s3), price_get=ASSUMPTIONS["s3_price_get_per_1k"][0],
        price_list=ASSUMPTIONS["s3_price_list_per_1k"][0])


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    measured: dict[str, Any] = {}
    if args.measure:
        measured["loadavg_at_start"] = os.getloadavg()
        root = tempfile.mkdtemp(prefix="rslurm-scale-", dir=args.measure_dir)
        try:
            measured["local"] = measure_local_read(root, args.measure_mib)
            print(f"measured: local O_DIRECT read {measured['local']['read_gbps']:.2f} GB/s "
                  f"({args.measure_mib} MiB, cache: {measured['local']['cache']})", file=sys.stderr)
            measured["s3_moto"] = measure_s3(root)
            s = measured["s3_moto"]
            print(f"measured: moto over loopback: GET {s['get_latency_s'] * 1000:.1f} ms, HEAD "
                  f"{s['head_latency_s'] * 1000:.1f} ms, PUT {s['put_latency_s'] * 1000:.1f} ms, LIST of 1,000 keys "
                  f"{s['list_1000_latency_s'] * 1000:.1f} ms; one 64 MiB GET {s['stream_gbps']:.3f} GB/s, eight "
                  f"{s['eight_streams_gbps']:.3f} GB/s", file=sys.stderr)
        finally:
            import shutil

            shutil.rmtree(root, ignore_errors=True)
        args.measured_latency_ms = measured["s3_moto"]["get_latency_s"] * 1000
        args.measured_list_latency_ms = measured["s3_moto"]["list_1000_latency_s"] * 1000
        print("(the local read here is a virtio disk, not a cluster NVMe: the model keeps --nvme-read-gbps; "
              "moto's GET and LIST latencies are used for the 'at moto's latency' columns)", file=sys.stderr)
    p = params_from(args)
    res = run_model(p)
    res["measured"] = measured
    res["sources"] = {"measured": MEASURED,
                      "assumptions": {k: (None if v == float("inf") else v, src) for k, (v, src) in ASSUMPTIONS.items()},
                      "code_defaults": CODE_DEFAULTS}
    print_tables(res, p)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, default=lambda o: None if o == float("inf") else str(o))
    return 0


if __name__ == "__main__":
    sys.exit(main())
