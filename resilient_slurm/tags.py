"""Tags: names for steps that retention, eviction and ``rslurm gc`` never remove (``ckpt.tag``,
``rslurm tag`` / ``untag``). The owner of the tags file, its format, its copies and its lock.

Where tags live: one small JSON file per run, ``tags.json``, beside the run's steps in every copy of
the run:

* ``<local root>/<run_id>/tags.json`` in each storage domain's run directory (each node's NVMe), read
  by the engine's retention and the daemon's eviction on that node;
* ``<durable>/<run_id>/tags.json`` (:func:`~resilient_slurm.manifest.durable_run_key`), read by the
  daemon's durable retention and by ``rslurm gc`` and ``ls`` from anywhere.

Each copy is a last-writer-wins map: every name records its step and when it was set, and an untag
leaves a removal (a tombstone) with its time. Copies merge name by name, the newest record winning
(a tag wins a tie), so copies written on different nodes at different times agree once merged, and an
untag made on a login node beats the older tag still in a compute node's copy. Who writes:

* ``Checkpointer.tag`` (every rank calls it): each domain leader updates its domain's local copy; rank 0
  then updates the durable copy, best effort, on its writer thread;
* ``rslurm tag`` / ``untag``: every local copy visible from where it runs, and the durable copy;
* the daemon, every pass, merges its node's copy with the durable one and writes back whichever differs
  from the merge (so a tag that could not reach the durable tier gets there, and an untag made
  elsewhere reaches the node).

A local copy changes only under :func:`tags_lock` (an exclusive ``flock`` on the run directory), which
:func:`resilient_slurm.layout.delete_step` also holds while it checks that a step is untagged and
uncommits it: a tag written under the lock is either seen by the deleter, or finds the step gone. The
durable tier has no lock; a durable deletion checks the durable copy just before it deletes.

A copy that cannot be read (a link, too big, not JSON, a bad field, another run's) raises
:class:`~resilient_slurm.errors.TagsFileError` naming it: nothing deletes a step of that run until it is
fixed or moved away, and nothing overwrites it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .errors import ConfigError, ObjectNotFoundError, TagsFileError, UnsafePathError
from .flocks import flocked
from .paths import id_problem, load_json, open_regular, valid_time
from .rundir import TAGS_FILE, RunDir
from .storage.fileio import atomic_write

if TYPE_CHECKING:
    from .storage.tier import StorageTier

TAGS_FORMAT = "rslurm-tags"
TAGS_VERSION = 1
MAX_TAGS_BYTES = 1 << 20  # 2,048 records of 100 bytes are 200 KiB
MAX_TAGS = 1024  # names that tag a step, per run
MAX_REMOVALS = 1024  # untag records kept per run (the oldest go first)
MAX_TAG_LENGTH = 64


def tag_name_problem(name: object) -> str | None:
    """Why ``name`` cannot be a tag (None when it can): a tag is 1 to 64 letters, digits, ``.``, ``_`` and
    ``-``, starting with a letter or digit, and not only digits (so it never reads as a step number). The
    one validation of identifiers, :func:`resilient_slurm.paths.id_problem`."""
    return id_problem("tag", name)


def check_tag_name(name: object) -> str:
    """``name`` if it can be a tag, else :class:`ConfigError` saying why."""
    problem = tag_name_problem(name)
    if problem is not None:
        raise ConfigError(f"invalid tag name: {problem}")
    assert isinstance(name, str)
    return name


@dataclass(frozen=True)
class TagRecord:
    """One name's latest record: the step it tags (or was removed from) and when that was written."""

    step: int
    at: float
    removed: bool = False

    def wins_over(self, other: TagRecord) -> bool:
        """The newer record; at the same time a tag beats a removal (protecting more is the safe side)."""
        return (self.at, not self.removed, self.step) > (other.at, not other.removed, other.step)


@dataclass(frozen=True)
class RunTags:
    """Every tag record of one run (one copy, or several merged)."""

    run_id: str
    records: Mapping[str, TagRecord] = field(default_factory=dict)

    @property
    def tags(self) -> dict[str, int]:
        """Current tags: name -> step, by name."""
        return {n: r.step for n, r in sorted(self.records.items()) if not r.removed}

    @property
    def steps(self) -> frozenset[int]:
        """The tagged steps: never deleted."""
        return frozenset(r.step for r in self.records.values() if not r.removed)

    def names(self, step: int) -> list[str]:
        """The tags of ``step``, sorted."""
        return sorted(n for n, r in self.records.items() if not r.removed and r.step == step)

    def _stamp(self, name: str, now: float | None) -> float:
        # Later than the record it replaces even when that one came from a node whose clock runs ahead (or
        # was stamped far in the future: + 0.001 does not change 1e20, the next float does).
        t = time.time() if now is None else now
        old = self.records.get(name)
        return max(t, old.at + 0.001, math.nextafter(old.at, math.inf)) if old is not None else t

    def tagged(self, name: str, step: int, *, now: float | None = None) -> RunTags:
        """These tags with ``name`` on ``step`` (moved there if it tagged another step)."""
        check_tag_name(name)
        if step < 0:
            raise ConfigError(f"step must be >= 0, got {step}")
        if name not in self.tags and len(self.tags) >= MAX_TAGS:
            raise ConfigError(f"run {self.run_id} already has {MAX_TAGS} tags; untag some first")
        return RunTags(self.run_id, {**self.records, name: TagRecord(step, self._stamp(name, now))})

    def untagged(self, name: str, *, now: float | None = None) -> RunTags:
        """These tags without ``name`` (a removal record, so older copies elsewhere lose to it)."""
        old = self.records.get(name)
        if old is None or old.removed:
            return self
        return _pruned(RunTags(self.run_id, {**self.records, name: TagRecord(old.step, self._stamp(name, now),
                                                                               removed=True)}))

    def merged(self, *others: RunTags | None) -> RunTags:
        """These records and the others', the newest record of each name winning."""
        out = dict(self.records)
        for o in others:
            if o is None:
                continue
            for n, r in o.records.items():
                if n not in out or r.wins_over(out[n]):
                    out[n] = r
        return _pruned(RunTags(self.run_id, out))

    def to_json(self) -> bytes:
        """The file's bytes (stable order: equal tags are equal bytes)."""
        def rec(r: TagRecord) -> dict[str, Any]:
            return {"step": r.step, "at": r.at}

        doc = {"format": TAGS_FORMAT, "version": TAGS_VERSION, "run_id": self.run_id,
               "tags": {n: rec(r) for n, r in sorted(self.records.items()) if not r.removed},
               "removed": {n: rec(r) for n, r in sorted(self.records.items()) if r.removed}}
        return (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode()

    @classmethod
    def parse(cls, data: bytes, *, source: str, run_id: str) -> RunTags:
        """Read a tags file of ``run_id``; :class:`TagsFileError` naming ``source`` for anything that is not
        one rslurm wrote (hostile input is an error, never a crash)."""
        def bad(what: str) -> TagsFileError:
            return _bad(source, run_id, what)

        if len(data) > MAX_TAGS_BYTES:
            raise bad(f"larger than a tags file may be ({MAX_TAGS_BYTES} bytes)")
        d = load_json(data, source=source, error=lambda m: _bad(source, run_id, m.removeprefix(f"{source}: ")
                                                                .removesuffix("; not a file rslurm wrote")))
        if not isinstance(d, dict) or d.get("format") != TAGS_FORMAT:
            raise bad(f"not a JSON object with \"format\": \"{TAGS_FORMAT}\"")
        version = d.get("version")
        if not isinstance(version, int) or isinstance(version, bool):
            raise bad("field 'version' missing or not an integer")
        if version > TAGS_VERSION:
            raise bad(f"version {version} was written by a newer resilient_slurm (this one reads {TAGS_VERSION}); "
                      "upgrade it")
        if d.get("run_id") != run_id:
            raise bad(f"it names run {str(d.get('run_id'))[:80]!r}")
        out: dict[str, TagRecord] = {}
        for key, removed, cap in (("tags", False, MAX_TAGS), ("removed", True, MAX_REMOVALS)):
            section = d.get(key, {})
            if not isinstance(section, dict):
                raise bad(f"field {key!r} must be an object, got {type(section).__name__}")
            if len(section) > cap:
                raise bad(f"field {key!r} holds {len(section)} records, more than {cap}")
            for name, r in section.items():
                problem = tag_name_problem(name)
                if problem is not None:
                    raise bad(f"field {key!r}: {problem}")
                if not isinstance(r, dict) or set(r) != {"step", "at"}:
                    raise bad(f"field {key!r}, tag {name!r}: expected {{step, at}}, got {str(r)[:80]}")
                step, at = r["step"], r["at"]
                if not isinstance(step, int) or isinstance(step, bool) or step < 0:
                    raise bad(f"field {key!r}, tag {name!r}: step {str(step)[:40]} is not a step number")
                if not valid_time(at):
                    raise bad(f"field {key!r}, tag {name!r}: 'at' {str(at)[:40]} is not a time (seconds since "
                              f"1970, before the year 10000)")
                rec = TagRecord(step, float(at), removed)
                if name not in out or rec.wins_over(out[name]):
                    out[name] = rec
        return cls(run_id, out)


_CONSEQUENCE = "No step of run {} is deleted (retention, eviction, rslurm gc) until it is fixed or moved away"


def _bad(source: str, run_id: str, what: str, *, malformed: bool = True) -> TagsFileError:
    why = "; not a tags file rslurm wrote." if malformed else "."
    return TagsFileError(f"tags file {source}: {what}{why} {_CONSEQUENCE.format(run_id)}")


def _unsafe(exc: Exception, run_id: str, where: str) -> TagsFileError:
    """A link or special file where tags file ``where`` goes, or where a directory above it goes (the run
    directory: the message then names the tags file and that directory)."""
    text = str(exc)
    lead = "tags file " if text.startswith(where) else f"tags file {where} cannot be read: "
    return TagsFileError(f"{lead}{text}. {_CONSEQUENCE.format(run_id)}")


def _pruned(t: RunTags) -> RunTags:
    """At most :data:`MAX_REMOVALS` removal records, the newest (an older one is only needed against a copy
    that old, and losing it can only keep a step longer)."""
    removals = sorted(((r.at, n) for n, r in t.records.items() if r.removed), reverse=True)
    if len(removals) <= MAX_REMOVALS:
        return t
    drop = {n for _, n in removals[MAX_REMOVALS:]}
    return RunTags(t.run_id, {n: r for n, r in t.records.items() if n not in drop})


def empty(run_id: str) -> RunTags:
    """No tags."""
    return RunTags(run_id, {})


def merge(run_id: str, copies: Iterable[RunTags | None]) -> RunTags:
    """Every copy merged (copies that do not exist are None)."""
    return empty(run_id).merged(*copies)


# ------------------------------------------------------------------------------ the local copies
def local_tags_path(run_dir: str) -> str:
    """Where a run directory's tags file is."""
    return RunDir.at(run_dir).tags


def read_local_tags(run_dir: str, run_id: str) -> RunTags | None:
    """The tags file of a local run directory; None when there is none. Never through a link nor a FIFO,
    never more than :data:`MAX_TAGS_BYTES`; :class:`TagsFileError` for anything unreadable."""
    path = local_tags_path(run_dir)
    try:
        fd = open_regular(path, os.O_RDONLY, error=TagsFileError, where="the run directory",
                          root=os.path.dirname(os.path.abspath(run_dir)))
    except FileNotFoundError:
        return None
    except TagsFileError as exc:
        raise _unsafe(exc, run_id, path) from None
    except OSError as exc:
        raise _bad(path, run_id, f"cannot be read ({exc.strerror or exc})", malformed=False) from None
    try:
        with os.fdopen(fd, "rb") as f:
            data = f.read(MAX_TAGS_BYTES + 1)
    except OSError as exc:
        raise _bad(path, run_id, f"cannot be read ({exc.strerror or exc})", malformed=False) from None
    return RunTags.parse(data, source=path, run_id=run_id)


def local_tagged_steps(run_dir: str, run_id: str) -> frozenset[int]:
    """The steps the local copy tags (none without a copy); :class:`TagsFileError` when it is unreadable."""
    t = read_local_tags(run_dir, run_id)
    return t.steps if t is not None else frozenset()


@contextlib.contextmanager
def tags_lock(run_dir: str, *, timeout: float | None = None) -> Iterator[bool]:
    """Hold the run directory's tags lock (an exclusive ``flock`` on the directory): every writer of the
    local tags file holds it, and so does :func:`~resilient_slurm.layout.delete_step` from its tag check
    to the uncommit. Waits for it at most ``timeout`` seconds (None: as long as it takes) and yields
    whether it is held. A child forked meanwhile does not keep it (:mod:`~resilient_slurm.flocks`).
    Raises FileNotFoundError when the run directory does not exist, OSError when it is a link (never
    followed)."""
    with flocked(lambda: os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC),
                 fcntl.LOCK_EX, timeout=timeout) as fd:
        yield fd is not None


def update_local_tags(run_dir: str, run_id: str, change: Callable[[RunTags], RunTags]) -> RunTags:
    """Under :func:`tags_lock`: read the local copy (empty when there is none), apply ``change`` and write the
    result atomically when it differs. Returns the result. ``change`` runs under the lock, so a check it
    makes (is the step still committed?) holds against every deleter. TagsFileError when the copy is
    unreadable (it is never overwritten), StorageError when it cannot be written."""
    with tags_lock(run_dir):
        cur = read_local_tags(run_dir, run_id)
        new = change(cur if cur is not None else empty(run_id))
        if cur is None or new.records != cur.records:
            atomic_write(local_tags_path(run_dir), new.to_json(), root=os.path.dirname(os.path.abspath(run_dir)))
        return new


# ------------------------------------------------------------------------------ the durable copy
def durable_tags_key(run_id: str) -> str:
    """The durable copy's key."""
    return RunDir("", run_id).durable_key(TAGS_FILE)


def read_durable_tags(tier: StorageTier, run_id: str) -> RunTags | None:
    """The durable copy of a run's tags; None when there is none. TagsFileError when it is unreadable,
    StorageError when the tier cannot be read."""
    key = durable_tags_key(run_id)
    where = f"{tier.url.rstrip('/')}/{key}"
    try:
        data = tier.get_bytes(key, limit=MAX_TAGS_BYTES)
    except ObjectNotFoundError:
        return None
    except UnsafePathError as exc:
        raise _unsafe(exc, run_id, where) from None
    return RunTags.parse(data, source=where, run_id=run_id)


def durable_tagged_steps(tier: StorageTier, run_id: str) -> frozenset[int]:
    """The steps the durable copy tags (none without a copy)."""
    t = read_durable_tags(tier, run_id)
    return t.steps if t is not None else frozenset()


def write_durable_tags(tier: StorageTier, tags: RunTags) -> None:
    """Store the durable copy (atomic per key; StorageError)."""
    tier.put_bytes(durable_tags_key(tags.run_id), tags.to_json())


def update_durable_tags(tier: StorageTier, tags: RunTags) -> tuple[RunTags, bool]:
    """Merge ``tags`` into the durable copy and write it when that changes it, in one read-modify-write of the
    tier (:meth:`~resilient_slurm.storage.tier.StorageTier.update_bytes`: a conditional write on S3, a lock
    on POSIX, so that a tag or untag written meanwhile by another process is merged, not dropped); return the
    merge, and whether the tier could promise that (False: a filesystem without ``flock``; the caller reads
    the copy again to check). TagsFileError for a copy that cannot be read (nothing is written), StorageError
    when the tier fails."""
    key = durable_tags_key(tags.run_id)
    where = f"{tier.url.rstrip('/')}/{key}"
    merged = [tags]

    def change(data: bytes | None) -> bytes | None:
        cur = None if data is None else RunTags.parse(data, source=where, run_id=tags.run_id)
        merged[0] = new = tags.merged(cur)
        return new.to_json() if cur is None or new.records != cur.records else None

    try:
        exclusive = tier.update_bytes(key, change, limit=MAX_TAGS_BYTES)
    except UnsafePathError as exc:
        raise _unsafe(exc, tags.run_id, where) from None
    return merged[0], exclusive


def sync_durable_tags(tier: StorageTier, tags: RunTags) -> RunTags:
    """Merge ``tags`` into the durable copy and write it when that changes it; return the merge
    (:func:`update_durable_tags`)."""
    return update_durable_tags(tier, tags)[0]


__all__ = ["MAX_TAGS", "MAX_TAG_LENGTH", "TAGS_FILE", "RunTags", "TagRecord", "check_tag_name", "durable_tagged_steps",
           "durable_tags_key", "empty", "local_tagged_steps", "local_tags_path", "merge", "read_durable_tags",
           "read_local_tags", "sync_durable_tags", "tag_name_problem", "tags_lock", "update_durable_tags",
           "update_local_tags",
           "write_durable_tags"]
