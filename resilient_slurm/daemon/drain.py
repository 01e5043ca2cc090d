"""Moving one committed local step to the durable tier, and the durable commit across nodes.

Who calls what (one node's daemon, one step at a time, on its main thread; each transfer runs its
pieces on the tier's threads):

1. :func:`scan_local` lists committed steps under the local root (the daemon does this on every
   filesystem event and every poll interval).
2. :meth:`StepDrainer.drain` for the step chosen by :func:`drain_order`, holding a shared lock on the
   local manifest so retention and eviction cannot delete the step underneath:

   a. the durable manifest already there for this save -> nothing to do (``durable``);
   b. this domain's commit marker for this save (``commits/<save token>/<domain>``) already there -> skip
      to (e);
   c. this domain's commit markers of *other* saves of the step are deleted first (a re-save of the step
      overwrites this domain's files, so an older save's marker must stop counting), then every shard of
      this domain: skipped if the tier already holds it with the same size and recorded checksum, or
      compressed from the same bytes (a restarted daemon does not re-send verified data), else sent with
      :func:`~resilient_slurm.storage.encoding.put_shard` (``put_file``, compressed first when the tier's
      ``compression`` is zstd and the file's sample pays; verified against the manifest's xxh3 as it is
      read);
   d. this domain's ``.metadata``, its ``manifest.json`` (what fetch and ``rslurm ls`` read), then its
      commit marker (an empty object: "my shards of this save are there");
   e. :meth:`StepDrainer.try_commit`: one paginated LIST of ``commits/<save token>/``; if every domain of
      the save is there, GET the first domain's manifest and ``.metadata`` and write the root ``.metadata``
      and then the durable ``manifest.json``: the commit. The bytes are the same from any node.

The commit is linear in nodes: each node makes a constant number of requests plus one LIST (1,000 names
a page) per check, instead of one GET per domain. Whichever node's LIST comes last sees every marker:
a node LISTs only after its own marker is written, and on a store where a LIST reflects every completed
PUT (S3 since 2020, POSIX), of two nodes that both LIST before the other's marker is visible, one would
have to list before the other's PUT completed and after it, which cannot be. So the last node to finish
commits, and a node left ``waiting`` only re-checks, less and less often (:func:`recheck_delay`), for
the case where that node died between its marker and the commit.

A drain that fails in (c) or (d) removes the step's directories it left empty (a POSIX tier's), so no empty
``step_*`` directory of a failed try stays in the listings; when this copy of the step is damaged (it can
never be drained), it deletes what it sent too, unless a commit marker or the step manifest is there. A
failure of the tier keeps the shards sent, which the retry reuses (:meth:`StepDrainer._discard`).

A step is never durable unless every domain's shards were verified and their markers written before
the manifest. A partial step (markers missing) has no root manifest and is never restored from.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ..checkpoint.metadata_pickle import read_checked_metadata
from ..errors import CorruptCheckpointError, ObjectNotFoundError, ResilientSlurmError
from ..layout import list_run_dir, list_runs
from ..manifest import (
    DCP_METADATA_NAME,
    MANIFEST_NAME,
    Manifest,
    commit_marker_key,
    domain_key,
    durable_step_key,
    durable_steps,
    read_durable_manifest,
    read_manifest_file,
    save_token,
)
from ..rundir import RunDir
from ..storage.encoding import holds, put_shard, remove_scratch
from ..storage.fileio import checksum, reading_step
from ..storage.tier import StorageTier

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LocalStep:
    """A committed step in the node-local tier."""

    run_id: str
    step: int
    path: str
    manifest: Manifest

    @property
    def domain(self) -> str:
        """The storage domain this local copy belongs to."""
        return self.manifest.node

    @property
    def local_bytes(self) -> int:
        """Bytes of this domain's shards."""
        return sum(s.size for s in self.manifest.shards_of_node(self.domain))


def read_manifest(step_dir: str) -> Manifest:
    """Parse a local step's manifest (raises CorruptCheckpointError / OSError)."""
    return read_manifest_file(os.path.join(step_dir, MANIFEST_NAME))


def scan_local(root: str, run_ids: Iterable[str] | None = None,
               invalid: Callable[[str, str], None] | None = None) -> list[LocalStep]:
    """Committed steps under ``root`` (every run, or ``run_ids``). A step whose manifest cannot be read
    is reported through ``invalid(path, reason)`` and left out: it is never drained."""
    out: list[LocalStep] = []
    runs = sorted(run_ids) if run_ids is not None else list_runs(root)
    for run in runs:
        try:
            listing = list_run_dir(RunDir(root, run).path)
        except OSError as exc:
            if invalid:
                invalid(RunDir(root, run).path, f"cannot list it: {exc.strerror}")
            continue
        for step in listing.committed:
            path = listing.step_dir(step)
            try:
                m = read_manifest(path)
            except FileNotFoundError:
                continue  # deleted between listdir and open
            except (OSError, ResilientSlurmError) as exc:
                if invalid:
                    invalid(path, str(exc))
                continue
            if m.step != step or m.run_id != run:
                if invalid:
                    invalid(path, f"manifest says run {m.run_id!r} step {m.step}")
                continue
            out.append(LocalStep(run, step, path, m))
    return out


class DrainPreempted(BaseException):  # noqa: N818 -- a control-flow signal, not an error
    """Raised from a transfer's progress callback to pause it for a more urgent step (or a stop).

    A BaseException so that tiers treat it as an interruption: an S3 multipart upload is kept and
    resumed by the next ``put_file`` (its verified parts are not sent again); a POSIX temp file is
    removed."""


YIELD_CHECK_S = 0.5  # how often a transfer in progress asks whether to yield


@dataclass
class DrainResult:
    """What :meth:`StepDrainer.drain` did for one step."""

    run_id: str
    step: int
    state: str  # durable | waiting (other nodes' shards missing) | preempted (a more urgent step) | superseded
    bytes_sent: int = 0  # bytes stored (compressed ones as compressed)
    file_bytes: int = 0  # the size of the files those bytes hold (bytes_sent / file_bytes: the compression)
    bytes_reused: int = 0
    seconds: float = 0.0
    retries: int = 0
    missing_domains: list[str] = field(default_factory=list)
    committed: bool = False  # this call wrote the durable manifest (the durable commit)

    @property
    def throughput(self) -> float:
        """Bytes per second sent."""
        return self.bytes_sent / self.seconds if self.seconds > 0 else 0.0


class StepDrainer:
    """Drains local steps of one node into one durable tier (see the module docstring)."""

    def __init__(self, tier: StorageTier, *, should_yield: Callable[[LocalStep], bool] | None = None,
                 progress: Callable[[int], None] | None = None) -> None:
        self.tier = tier
        self.should_yield = should_yield  # asked between shards: a more urgent step is waiting
        self.progress = progress

    def drain(self, ls: LocalStep) -> DrainResult:
        """Drain ``ls`` (this node's share of it) and try the durable commit."""
        t0 = time.perf_counter()
        res = DrainResult(ls.run_id, ls.step, "waiting")
        with reading_step(ls.path) as present:
            if not present:
                res.state = "superseded"  # deleted by retention or eviction before we got to it
                return res
            m = read_manifest(ls.path)  # re-read under the lock: the step may have been re-saved
            if m.save_id != ls.manifest.save_id:
                ls = LocalStep(ls.run_id, ls.step, ls.path, m)
            durable = self._durable_manifest(ls)
            if durable is not None:
                if durable.save_id != m.save_id:
                    log.info("run %s step %d is already durable from an earlier save of the same step; the local "
                             "re-save is not drained again", ls.run_id, ls.step)
                res.state = "durable"
                return res
            marker = commit_marker_key(ls.run_id, ls.step, save_token(m), ls.domain)
            if self.tier.stat(marker) is None:
                written: list[str] = []  # this attempt's objects, for _discard
                try:
                    self._forget_other_saves(ls.run_id, ls.step, m, ls.domain)
                    if not self._send_shards(ls, m, res, written):
                        res.seconds = time.perf_counter() - t0
                        return res
                    md = read_checked_metadata(os.path.join(ls.path, DCP_METADATA_NAME), m.dcp_metadata)
                    for key, data in ((domain_key(ls.run_id, ls.step, ls.domain, DCP_METADATA_NAME), md),
                                      (domain_key(ls.run_id, ls.step, ls.domain, MANIFEST_NAME),
                                       m.to_json().encode())):
                        written.append(key)  # before the put: a put that fails part way may leave it
                        self.tier.put_bytes(key, data)
                    self.tier.put_bytes(marker, b"")
                except Exception as exc:
                    # This copy of the step can never be drained (damaged here): what it sent goes too. Any other
                    # failure (the tier) keeps the shards sent, which the retry reuses.
                    self._discard(ls, written if isinstance(exc, CorruptCheckpointError) else [])
                    raise
        res.missing_domains = self.try_commit(ls.run_id, ls.step, m)
        res.committed = not res.missing_domains
        res.state = "durable" if not res.missing_domains else "waiting"
        res.seconds = time.perf_counter() - t0
        return res

    def _discard(self, ls: LocalStep, written: list[str]) -> None:
        """After a failed drain: delete the objects this attempt wrote (``written``: given when this copy of
        the step is damaged and can never be drained), unless something of the step is committed there (a
        commit marker of any domain and save, or the step manifest), then the step's directories left empty
        (a POSIX tier's: an empty ``step_*`` directory listed as a step). Only this attempt's own objects are
        deleted, and a directory only while empty: another node's files of the step are never touched. A
        failure here is logged; the drain's own error is what the caller reports."""
        step_key = durable_step_key(ls.run_id, ls.step)
        try:
            if written and not self.tier.list_dirs(commit_marker_key(ls.run_id, ls.step)) and \
                    self.tier.stat(durable_step_key(ls.run_id, ls.step, MANIFEST_NAME)) is None:
                self.tier.delete(written)
            self.tier.remove_empty_dirs(step_key)
        except (ResilientSlurmError, OSError) as exc:
            log.warning("run %s step %d: the failed drain's objects in %s/%s could not all be removed (%s); they "
                        "are reused or replaced by the next drain", ls.run_id, ls.step, self.tier.url, step_key, exc)
            return
        if written:
            log.info("run %s step %d: removed what the failed drain wrote to %s/%s (this copy of the step is damaged)",
                     ls.run_id, ls.step, self.tier.url, step_key)

    def _send_shards(self, ls: LocalStep, m: Manifest, res: DrainResult, written: list[str]) -> bool:
        """Step (c): every shard of this domain that the tier does not hold yet, compressed where the tier's
        compression says (:mod:`~resilient_slurm.storage.encoding`); False when told to yield. ``written``
        collects the keys this call writes (each before its transfer starts)."""
        progress = self._progress(ls)
        scratch = RunDir.at(os.path.dirname(ls.path)).encode_scratch(os.getpid())
        try:
            for s in m.shards_of_node(ls.domain):
                if self.should_yield is not None and self.should_yield(ls):
                    res.state = "preempted"
                    return False
                key = f"{durable_step_key(ls.run_id, ls.step)}/{s.path}"
                if holds(self.tier, key, size=s.size, checksum=s.checksum):
                    res.bytes_reused += s.size
                    continue
                written.append(key)
                try:
                    st = put_shard(self.tier, os.path.join(ls.path, s.path), key, size=s.size,
                                   checksum=s.checksum, scratch=scratch, progress=progress)
                except DrainPreempted:
                    res.state = "preempted"
                    return False
                res.bytes_sent += st.bytes - st.reused_bytes
                res.file_bytes += s.size
                res.bytes_reused += st.reused_bytes
                res.retries += st.retries
            return True
        finally:
            remove_scratch(scratch)

    def _progress(self, ls: LocalStep) -> Callable[[int], None]:
        """The progress callback for ``ls``'s transfers: reports bytes, and every ``YIELD_CHECK_S``
        asks ``should_yield``, pausing the transfer (``DrainPreempted``) when told to."""
        last = [time.monotonic()]

        def progress(n: int) -> None:
            if self.progress is not None:
                self.progress(n)
            now = time.monotonic()
            if self.should_yield is not None and now - last[0] >= YIELD_CHECK_S:
                last[0] = now
                if self.should_yield(ls):
                    raise DrainPreempted()

        return progress

    def _durable_manifest(self, ls: LocalStep) -> Manifest | None:
        try:
            return read_durable_manifest(self.tier, ls.run_id, ls.step)
        except ObjectNotFoundError:
            return None
        except CorruptCheckpointError as exc:  # a storage failure propagates: it is not a bad manifest
            # A garbage durable manifest is not a commit: overwrite it with a good one.
            log.warning("durable manifest of run %s step %d is unreadable (%s); draining it again",
                        ls.run_id, ls.step, exc)
            return None

    def _forget_other_saves(self, run_id: str, step: int, m: Manifest, domain: str) -> None:
        """Delete ``domain``'s commit markers of other saves of ``step`` before its files are overwritten
        with save ``m``'s: one LIST of the saves' prefixes (almost always just this one)."""
        mine = save_token(m)
        stale = [commit_marker_key(run_id, step, t, domain) for t in self.tier.list_dirs(commit_marker_key(run_id, step))
                 if t != mine]
        if stale:
            log.info("run %s step %d: another save of this step was drained before; its commit marker of domain "
                     "%s no longer counts", run_id, step, domain)
            self.tier.delete(stale)

    def try_commit(self, run_id: str, step: int, m: Manifest) -> list[str]:
        """Commit the durable step if every domain's commit marker is there for save ``m``; return the
        domains still missing (empty: the step is durable). One LIST, and 2 GETs + 2 PUTs when it commits."""
        done = set(self.tier.list_names(commit_marker_key(run_id, step, save_token(m))))
        missing = sorted(set(m.nodes) - done)
        if missing:
            return missing
        first = m.first_domain
        try:
            head = read_durable_manifest(self.tier, run_id, step, first)
        except (ObjectNotFoundError, CorruptCheckpointError):
            return [first]  # a marker without its manifest: that node is re-draining; it commits or re-checks
        if head.save_id != m.save_id:
            return [first]  # that domain drained another save of this step meanwhile; it will drain this one
        md = self.tier.get_bytes(domain_key(run_id, step, first, DCP_METADATA_NAME))
        if checksum(md) != head.dcp_metadata.checksum:
            raise CorruptCheckpointError(f"{self.tier.url}/{domain_key(run_id, step, first, DCP_METADATA_NAME)}: "
                                         "does not match its domain manifest; the step is not committed")
        self.tier.put_bytes(durable_step_key(run_id, step, DCP_METADATA_NAME), md)
        self.tier.put_bytes(durable_step_key(run_id, step, MANIFEST_NAME), head.as_durable().to_json().encode())
        return []


def recheck_delay(checks: int, poll_interval: float) -> float:
    """How long a node whose step is ``waiting`` waits before its ``checks``-th re-check of the commit:
    the poll interval, doubling up to ``RECHECK_MAX_S``. The last node to finish commits without anyone
    re-checking; re-checks are for a node that died between its marker and the commit."""
    return min(poll_interval * 2 ** max(0, checks - 1), max(poll_interval, RECHECK_MAX_S))


RECHECK_MAX_S = 60.0


def drain_lag(local: Iterable[tuple[int, float]], durable: Iterable[int], now: float) -> tuple[float, int | None]:
    """How far the durable tier trails one run on one node: the age of the oldest committed local step
    newer than the newest durable step, and that step (``(0.0, None)`` when the durable tier is caught up).

    ``local``: (step, created_at) of the run's committed local steps; ``durable``: its durable steps."""
    newest = max(durable, default=-1)
    behind = [(created, step) for step, created in local if step > newest]
    if not behind:
        return 0.0, None
    created, step = min(behind)
    return max(0.0, now - created), step


def drain_order(steps: Iterable[LocalStep]) -> list[LocalStep]:
    """The order in which pending steps are drained: emergency checkpoints first, then newest first
    (an older step is likely to be superseded, and the newest is what a resume needs)."""
    return sorted(steps, key=lambda s: (s.manifest.reason != "emergency", -s.manifest.created_at, -s.step))


__all__ = ["DrainPreempted", "DrainResult", "LocalStep", "StepDrainer", "drain_lag", "drain_order", "durable_steps", "read_durable_manifest",
           "read_manifest", "scan_local"]
