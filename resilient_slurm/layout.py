"""The local tier's directory layout: what is in a run directory, and the one way to delete a step.

Owner of discovery and deletion on the node-local tier (docs/architecture.md, "On-disk layout")::

    <root>/<run_id>/step_<step:012d>/                committed (it has a manifest.json)
    <root>/<run_id>/step_<step:012d>.tmp-<token>/    a temp directory; its kind is in the token:

=====================  ===================================================================
token                  kind (:class:`TempKind`)
=====================  ===================================================================
``<nonce>-<seq>``      ``SAVE``: a save being written, or abandoned by a killed process
``fetch-<nonce>``      ``FETCH``: restore copying a step from the durable tier
``replaced-<token>``   ``REPLACED``: the older copy of a step committed again, being deleted
``gc-<tag>``           ``GC``: a step uncommitted by retention or ``rslurm gc``, being deleted
``evict-<tag>``        ``EVICT``: a step uncommitted by the daemon's eviction, being deleted
``peer-<nonce>``       ``PEER``: restore copying a step from a partner node's replica
``replica-<nonce>``    ``REPLICA``: a partner's step being received as a replica
=====================  ===================================================================

Peer replicas (checkpoint/peers.py): a partner domain's committed steps, kept in this node's run
directory and listed with :func:`list_replicas`::

    <root>/<run_id>/replicas/<domain>/step_<step:012d>/      a committed replica (the partner's files)
    <root>/<run_id>/replicas/<domain>/step_X.tmp-replica-<nonce>/   one being received

``replicas/<domain>/`` is a run directory of its own for :func:`list_run_dir` and :func:`delete_step`
(it has no tags file: replicas are never tagged); the drain never reads it, it is not this node's data.

Every scanner (engine retention, restore, the daemon's drain, eviction and status, ``rslurm ls/show/gc``,
the launcher) lists a run directory with :func:`list_run_dir` and runs with :func:`list_runs`; every
deleter of a committed step goes through :func:`delete_step` (tag check, lock, uncommit, fsync, delete),
and of a durable step through :func:`delete_durable_step` (tag check, manifest first, then the prefix):
so no deleter can remove a tagged step (:mod:`resilient_slurm.tags`). Names and
the durable tier's keys are built by :mod:`resilient_slurm.manifest`; manifests are read by
:func:`resilient_slurm.manifest.read_manifest_file`.

Symbolic links are never followed: a run or step "directory" that is a link is not listed, and
:func:`delete_step` renames the entry itself and removes the tree with :func:`shutil.rmtree` (which
unlinks links inside it instead of descending into them), so nothing outside the run directory is
deleted.
"""

from __future__ import annotations

import enum
import errno
import fcntl
import json
import logging
import os
import secrets
import socket
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from . import failpoints
from .errors import ConfigError
from .flocks import close_locked_fd, flock_within, open_locked_fd
from .manifest import (
    MANIFEST_NAME,
    durable_step_key,
    is_tmp_dirname,
    parse_step_dirname,
    split_tmp_dirname,
    tmp_dirname,
)
from .paths import STATE_DIR, check_id, id_problem, load_json, open_parent, open_state_file, valid_time
from .rundir import REPLICAS_DIR, WRITER_LOCK, RunDir
from .storage.fileio import fsync_dir, remove_tree
from .storage.tier import StorageTier
from .tags import durable_tagged_steps, local_tagged_steps, tags_lock
from .terminal import printable

log = logging.getLogger(__name__)


class TempKind(enum.Enum):
    """What a ``step_X.tmp-<token>`` directory is (see the module docstring)."""

    SAVE = "save"
    FETCH = "fetch"
    REPLACED = "replaced"
    GC = "gc"
    EVICT = "evict"
    PEER = "peer"
    REPLICA = "replica"

    @property
    def deleting(self) -> bool:
        """An uncommitted step on its way out (never shown as a save in progress)."""
        return self in (TempKind.REPLACED, TempKind.GC, TempKind.EVICT)


_KIND_PREFIX = {k: f"{k.value}-" for k in TempKind if k is not TempKind.SAVE}


def temp_dirname(step: int, kind: TempKind, tag: str) -> str:
    """Name of a temp directory of ``step`` of ``kind``; ``tag`` tells its owner (a save's token, an
    incarnation's nonce, a random tag)."""
    return tmp_dirname(step, tag if kind is TempKind.SAVE else _KIND_PREFIX[kind] + tag)


@dataclass(frozen=True)
class TempDir:
    """One ``step_X.tmp-<token>`` directory of a run directory."""

    name: str
    step: int
    kind: TempKind
    token: str  # everything after ".tmp-"

    def owned_by(self, nonce: str) -> bool:
        """Made by the incarnation whose nonce is ``nonce`` (its saves, fetches and deletions)."""
        return nonce in self.token


def parse_temp_dirname(name: str) -> TempDir | None:
    """The temp directory ``name`` names, or None if it is not one."""
    split = split_tmp_dirname(name)
    if split is None:
        return None
    step, token = split
    kind = next((k for k, prefix in _KIND_PREFIX.items() if token.startswith(prefix)), TempKind.SAVE)
    return TempDir(name, step, kind, token)


@dataclass
class RunListing:
    """What :func:`list_run_dir` found in one run directory."""

    run_dir: str
    committed: list[int] = field(default_factory=list)  # ascending; a manifest entry exists (not validated)
    uncommitted: list[int] = field(default_factory=list)  # step_X directories without a manifest entry
    temps: list[TempDir] = field(default_factory=list)  # sorted by name
    foreign: list[str] = field(default_factory=list)  # step or temp names that are links or files: never read

    def step_dir(self, step: int) -> str:
        return RunDir.at(self.run_dir).step(step)

    def temp_path(self, t: TempDir) -> str:
        return RunDir.at(self.run_dir).file(t.name)

    def in_progress(self) -> list[TempDir]:
        """Saves and fetches being written (or abandoned): every temp directory but deletions."""
        return [t for t in self.temps if not t.kind.deleting]


RUN_LINK = "a symbolic link where a run directory goes; rslurm does not follow it"  # why one is not listed


def list_run_dir(run_dir: str) -> RunListing:
    """The committed steps and temp directories of ``run_dir`` (empty when it does not exist or is not a
    directory). Entries named like steps that are symbolic links or files go to ``foreign``: they were
    not made by rslurm and are never followed. Raises OSError when it cannot be listed."""
    out = RunListing(run_dir)
    try:
        if stat.S_ISLNK(os.lstat(run_dir).st_mode):
            raise OSError(errno.ELOOP, RUN_LINK, run_dir)
        entries = list(os.scandir(run_dir))
    except (FileNotFoundError, NotADirectoryError):
        return out
    for e in entries:
        step = parse_step_dirname(e.name)
        if step is None and not is_tmp_dirname(e.name):
            continue
        try:
            real_dir = e.is_dir(follow_symlinks=False)
        except OSError:
            continue  # gone while listing
        if not real_dir:
            out.foreign.append(e.name)
        elif step is not None:
            has_manifest = os.path.lexists(os.path.join(e.path, MANIFEST_NAME))
            (out.committed if has_manifest else out.uncommitted).append(step)
        elif (t := parse_temp_dirname(e.name)) is not None:
            out.temps.append(t)
    out.committed.sort()
    out.uncommitted.sort()
    out.temps.sort(key=lambda t: t.name)
    out.foreign.sort()
    return out


def list_runs(root: str) -> list[str]:
    """Run directories under a local root, sorted: real directories whose name is a run id
    (:func:`~resilient_slurm.paths.id_problem`: ``.rslurm`` and the daemon's files are not runs, nor a
    name no command could be given; a symbolic link is not followed). Empty when ``root`` does not
    exist; OSError when it cannot be listed."""
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return []
    out = []
    for e in entries:
        try:
            if id_problem("run id", e.name) is None and e.is_dir(follow_symlinks=False):
                out.append(e.name)
        except OSError:
            continue
    return sorted(out)


class StepBusy(Exception):  # noqa: N818 -- an expected outcome, not an error
    """:func:`delete_step` found the step locked by a reader (a restore or a drain holds it), or could not
    have its run's tags lock within :data:`TAGS_LOCK_WAIT_S`. ``args``: the step's path, and why."""

    @property
    def why(self) -> str:
        return str(self.args[1]) if len(self.args) > 1 else "a reader holds it (a restore or a drain)"


# How long a deletion waits for its run's tags lock (held by a tag being written or another deletion,
# each a few milliseconds) before it gives up and keeps the step for now: retention runs on the
# checkpoint writer thread, and a step must never wait on a lock for longer than that.
TAGS_LOCK_WAIT_S = 10.0


class StepTagged(Exception):  # noqa: N818 -- an expected outcome, not an error
    """:func:`delete_step` or :func:`delete_durable_step` found the step tagged: it is never deleted."""


def run_links(root: str) -> list[str]:
    """The names of symbolic links under a local root that are named like runs, sorted: never followed, so
    never runs (:func:`list_runs` leaves them out); the commands that list runs name them. Empty when ``root``
    does not exist; OSError when it cannot be listed."""
    try:
        with os.scandir(root) as it:
            return sorted(e.name for e in it if e.is_symlink() and id_problem("run id", e.name) is None)
    except FileNotFoundError:
        return []


def nested_roots(root: str, runs: list[str]) -> list[str]:
    """Those of ``runs`` (directories :func:`list_runs` found under ``root``) that hold a local root's own
    ``.rslurm/`` (:data:`~resilient_slurm.paths.STATE_DIR`): nodes' local roots, not runs. A run directory never
    holds one; a local directory given one level too high (the parent of the nodes' roots, ``%n`` left out)
    lists each node's root where its runs should be."""
    out = []
    for name in runs:
        try:
            if stat.S_ISDIR(os.lstat(os.path.join(root, name, STATE_DIR)).st_mode):
                out.append(name)
        except OSError:
            continue
    return out


NESTED_ROOT = (f"it holds {STATE_DIR}/: a node's local root, not a run, so the local directory given (--local-dir "
               "or RSLURM_LOCAL_DIR) is the one above the nodes' roots; end it with /%n (the node's name)")


def root_runs(root: str) -> list[str]:
    """:func:`list_runs` for a command that takes the runs of one local root as they are: ConfigError naming the
    directory when the root holds nodes' local roots where its runs go (:func:`nested_roots`)."""
    runs = list_runs(root)
    if nested := nested_roots(root, runs):
        raise ConfigError(f"local tier {os.path.join(root, nested[0])}: {NESTED_ROOT}")
    return runs


def delete_step(run_dir: str, step: int, kind: TempKind, tag: str | None = None) -> bool:
    """Delete the committed ``step`` of ``run_dir``: the one deletion protocol of the local tier.

    1. tags: under the run's tags lock (held until the uncommit; waited for at most
       :data:`TAGS_LOCK_WAIT_S`, else :class:`StepBusy`), a step the run's local tags file tags is
       refused (:class:`StepTagged`), and so is every step while that file cannot be read
       (:class:`~resilient_slurm.errors.TagsFileError`);
    2. lock: a non-blocking exclusive ``flock`` on its manifest (readers hold a shared one), else
       :class:`StepBusy`;
    3. uncommit: rename the directory to a ``kind`` temp directory and fsync the run directory, so a
       crash from here on leaves a temp directory (removed later as abandoned), never a half step;
    4. delete the temp directory's tree (links inside it are unlinked, never followed).

    Returns False when the step is already gone. A failure to remove the uncommitted tree is raised
    (OSError) after the step is uncommitted. A step directory that is a symbolic link is refused
    (OSError ELOOP): it was not made by rslurm, and it is never followed."""
    path = RunDir.at(run_dir).step(step)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISDIR(st.st_mode):
        raise OSError(errno.ELOOP, "not a directory made by rslurm (a symbolic link or a file); not deleted", path)
    with tags_lock(run_dir, timeout=TAGS_LOCK_WAIT_S) as held:
        if not held:
            raise StepBusy(path, f"its run's tags lock was held for more than {TAGS_LOCK_WAIT_S:.0f} s")
        if step in local_tagged_steps(run_dir, os.path.basename(os.path.normpath(run_dir))):
            raise StepTagged(path)
        gone = _uncommit(run_dir, path, step, kind, tag)
    if gone is None:
        return False
    failpoints.hit("during_retention")
    remove_tree(gone)
    return True


def _uncommit(run_dir: str, path: str, step: int, kind: TempKind, tag: str | None) -> str | None:
    """Steps 2 and 3 of :func:`delete_step`: the temp directory the step now is, or None when it is gone."""
    manifest = os.path.join(path, MANIFEST_NAME)
    fd: int | None
    try:
        fd = open_locked_fd(lambda: os.open(manifest, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK))
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        fd = None  # the manifest is a symbolic link: no reader opens it (O_NOFOLLOW), so nothing to lock
    try:
        if fd is not None and not flock_within(fd, fcntl.LOCK_EX, 0):
            raise StepBusy(path, "a reader holds it (a restore or a drain)")
        gone = RunDir.at(run_dir).file(temp_dirname(step, kind, tag or secrets.token_hex(4)))
        os.rename(path, gone)
    finally:
        if fd is not None:
            close_locked_fd(fd)
    fsync_dir(run_dir)
    return gone


REPLICAS_DIRNAME = REPLICAS_DIR
def valid_domain_name(name: str) -> bool:
    """A storage domain name that can name a replica directory (a node name, or ``<node>-r<rank>``)."""
    return id_problem("node name", name) is None


def replica_run_dir(run_dir: str, domain: str) -> str:
    """The directory holding this node's replicas of ``domain``'s steps of the run in ``run_dir``."""
    if not valid_domain_name(domain):
        raise ValueError(f"{domain!r} cannot name a replica directory")
    return RunDir.at(run_dir).replica(domain)


def list_replicas(run_dir: str) -> dict[str, RunListing]:
    """The partner domains whose replicas ``run_dir`` holds, each with its listing (committed replica
    steps, replicas being received). Links and files are never followed; names that cannot be domains
    are left out. Empty when there are none; OSError when the replicas directory cannot be listed."""
    top = RunDir.at(run_dir).replicas
    try:
        if stat.S_ISLNK(os.lstat(top).st_mode):
            return {}
        entries = list(os.scandir(top))
    except (FileNotFoundError, NotADirectoryError):
        return {}
    out: dict[str, RunListing] = {}
    for e in sorted(entries, key=lambda e: e.name):
        try:
            if not valid_domain_name(e.name) or not e.is_dir(follow_symlinks=False):
                continue
        except OSError:
            continue
        out[e.name] = list_run_dir(e.path)
    return out


# ------------------------------------------------------------------------------ one writer per run
# <root>/.rslurm/run-<run_id>.lock: who writes the run on this node, under flock. In the local root's private
# state directory (the daemon's lock and status are there too), not in the run directory, whose entries are
# steps and the run's own files.
WRITER_FILE = WRITER_LOCK
WRITER_ENV = "RSLURM_RUN_WRITER"  # the launcher's token, handed to its ranks: they write for it
_WRITER_MAX_BYTES = 4096


@dataclass(frozen=True)
class RunWriter:
    """Who writes a run's local directory: a launcher, or a rank set started without one (its domain
    leader). ``token`` identifies the launcher (its ranks get it in :data:`WRITER_ENV`) or the rank set."""

    job_id: str | None
    host: str
    pid: int
    token: str
    started_at: float

    @classmethod
    def this_process(cls, job_id: str | None, token: str | None = None) -> RunWriter:
        """This process as a writer (``token``: its launcher's, else its own)."""
        host, pid = socket.gethostname(), os.getpid()
        return cls(job_id, host, pid, token or f"{host}:{pid}:{secrets.token_hex(4)}", time.time())

    def describe(self) -> str:
        """``Slurm job 123 on host n1 (pid 456)`` / ``a local run on host n1 (pid 456)``."""
        what = f"Slurm job {self.job_id}" if self.job_id else "a local run"
        return printable(f"{what} on host {self.host} (pid {self.pid})")

    def same_writer(self, other: RunWriter) -> bool:
        """The same launcher or rank set, or another process of the same Slurm job (one launcher per
        node, a requeued incarnation): the lock is per run per job, not per process."""
        return (self.token == other.token or (self.job_id is not None and self.job_id == other.job_id)
                or (self.host, self.pid) == (other.host, other.pid))

    def to_json(self) -> bytes:
        return json.dumps({"job_id": self.job_id, "host": self.host, "pid": self.pid, "token": self.token,
                           "started_at": self.started_at}).encode()

    @classmethod
    def from_json(cls, data: bytes, source: str) -> RunWriter | None:
        """The record in a writer lock; None when it is empty or not one rslurm wrote."""
        try:
            d = load_json(data, source=source)
        except ConfigError:
            return None
        if not isinstance(d, dict):
            return None
        job, host, pid, token, at = (d.get(k) for k in ("job_id", "host", "pid", "token", "started_at"))
        if not (isinstance(host, str) and isinstance(token, str) and isinstance(pid, int) and not isinstance(pid, bool)
                and (job is None or isinstance(job, str)) and valid_time(at)):
            return None
        return cls(job, host[:256], pid, token[:256], float(at or 0.0))


class RunInUseError(ConfigError):
    """Another launcher or rank set writes this run (the message names it: job id, host, pid)."""


class RunClaim:
    """This process's claim on a run (:func:`claim_run`); :meth:`release` gives it back."""

    def __init__(self, path: str, writer: RunWriter, fd: int | None) -> None:
        self.path = path
        self.writer = writer
        self._fd = fd  # None: another process of the same writer holds the lock

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Clear the record and unlock (a writer that ended cleanly leaves nothing to take over)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            os.ftruncate(fd, 0)
        except OSError:
            pass
        close_locked_fd(fd)


def claim_run(root: str, run_id: str, me: RunWriter, *,
              job_ended: Callable[[str], bool] = lambda job_id: False) -> RunClaim:
    """Claim ``run_id`` under the local root ``root`` for ``me``: one writer per run.

    ``<root>/.rslurm/run-<run_id>.lock`` holds the writer's record under an exclusive ``flock`` for as long
    as it runs. A lock held by the same writer (:meth:`RunWriter.same_writer`: its launcher, another node's
    launcher of the same job) is shared. A lock that is free but still names another writer (a process
    killed, a job requeued) is taken over with a warning, and so is one held by a process whose Slurm
    job has ended (``job_ended``). Anything else raises :class:`RunInUseError` naming the holder (job id,
    host, pid), having changed nothing. The run directory is made if missing and must be a real directory
    below ``root`` (a link there is a ConfigError naming it). The state directory is the daemon's
    (:func:`~resilient_slurm.paths.open_state_file`: private, never a link)."""
    run = RunDir(root, check_id("run id", run_id))
    state_dir, name = run.state_dir, run.writer_lock_name
    path = os.path.join(state_dir, name)
    # The run directory itself: a real directory below the root (made if missing), never a link to elsewhere
    # (ConfigError naming it), so nothing of the run is written through one.
    pfd, _ = open_parent(root, run.file(name), make_dirs=True, where="the run directory")
    os.close(pfd)
    fd = open_locked_fd(lambda: open_state_file(state_dir, name, os.O_RDWR | os.O_CREAT, create=True))
    try:
        holder = RunWriter.from_json(os.pread(fd, _WRITER_MAX_BYTES, 0), path)
        if flock_within(fd, fcntl.LOCK_EX, 0):
            if holder is not None and not holder.same_writer(me):
                log.warning("run %s: taking it over from %s, which no longer runs (its lock %s was free)", run_id,
                            holder.describe(), path)
            _write_record(fd, me)
            return RunClaim(path, me, fd)
        if holder is not None and holder.same_writer(me):
            close_locked_fd(fd)
            return RunClaim(path, me, None)
        if holder is not None and holder.job_id is not None and job_ended(holder.job_id):
            log.warning("run %s: taking it over from %s: that job has ended, though its process still holds %s",
                        run_id, holder.describe(), path)
            close_locked_fd(fd)
            return _replace_lock(state_dir, name, me)
    except BaseException:
        close_locked_fd(fd)
        raise
    close_locked_fd(fd)
    who = holder.describe() if holder is not None else "a process whose record in the lock cannot be read"
    raise RunInUseError(
        f"run {run_id} in {root} is in use by {who} (lock {path}); nothing was started or changed. Wait for it "
        "to end or stop it, or give this run another id (--run-id / RSLURM_RUN_ID). A writer that no longer "
        "runs is taken over by itself")


def _write_record(fd: int, me: RunWriter) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, me.to_json(), 0)
    os.fsync(fd)


def _replace_lock(state_dir: str, name: str, me: RunWriter) -> RunClaim:
    """A new lock file with ``me``'s record, locked, renamed over the old one (whose holder keeps a lock on
    a file no one opens any more)."""
    tmp, path = f"{name}.tmp-{os.getpid()}", os.path.join(state_dir, name)
    fd = open_locked_fd(lambda: open_state_file(state_dir, tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        _write_record(fd, me)
        os.replace(os.path.join(state_dir, tmp), path)
    except BaseException:
        close_locked_fd(fd)
        raise
    return RunClaim(path, me, fd)


def delete_durable_step(tier: StorageTier, run_id: str, step: int) -> None:
    """Delete ``step`` of ``run_id`` from a durable tier: the one deletion protocol of that tier. A step
    the durable tags file tags is refused (:class:`StepTagged`; the file is read just before, as the
    tier has no lock), and every step while it cannot be read (TagsFileError). The manifest goes first
    (the step stops being durable, so a crash never leaves a half step that looks committed), then
    everything under the step's prefix. The tier refuses keys through links (PosixTier) and never
    deletes outside its root. Raises StorageError."""
    if step in durable_tagged_steps(tier, run_id):
        raise StepTagged(f"{tier.url}/{durable_step_key(run_id, step)}")
    tier.delete([durable_step_key(run_id, step, MANIFEST_NAME)])
    tier.delete_prefix(durable_step_key(run_id, step))


__all__ = ["WRITER_ENV", "WRITER_FILE", "RunClaim", "RunInUseError", "RunWriter", "claim_run", "REPLICAS_DIRNAME", "TAGS_LOCK_WAIT_S", "RunListing", "StepBusy", "StepTagged", "TempDir", "TempKind", "delete_durable_step", "delete_step", "list_run_dir", "run_links", "RUN_LINK",
           "list_replicas", "list_runs",
           "parse_temp_dirname", "replica_run_dir", "temp_dirname", "valid_domain_name"]
