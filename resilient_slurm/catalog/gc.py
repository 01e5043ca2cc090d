"""``rslurm gc``: retention on both tiers, and removal of what interrupted saves and transfers left.

Who calls what: ``cli.py`` calls :func:`plan_gc` (read-only: the exact list of what would be deleted,
and why), prints it for ``--dry-run``, or else calls :func:`run_gc` on the plan. The plan is computed
with the same :class:`~resilient_slurm.checkpoint.policy.RetentionPolicy` the engine and the daemon
apply, per run and per storage domain directory:

Tagged steps (every copy of the run's tags file, local and durable, merged) are never deleted, in
either tier, and nothing of a run whose tags file cannot be read is (the run is reported, not planned).
The deletion protocols check the tags again, under the local tags lock, just before each deletion.

* local steps the policy does not keep, never the newest committed step, and, when a durable tier is
  configured, never the newest local step that is not durable yet (the daemon may still be draining
  it). A step being read (restore, drain: a shared ``flock`` on its manifest) is skipped, as the
  engine's retention and the daemon's eviction do: the exclusive lock is taken without waiting, the
  directory is renamed to ``step_X.tmp-gc-*`` (uncommitted first, so a crash never leaves a half step
  that looks committed), then removed.
* local ``step_X.tmp-*`` directories (killed saves and fetches, interrupted deletions) in which nothing
  changed for ``stale_after`` seconds: a live save writes its files continuously and commits within
  the collective timeout, so such a directory has no writer left.
* durable steps the policy does not keep (never the newest committed one): the manifest is deleted
  first (the step is no longer durable), then the rest of the step.
* durable steps that never committed (shards, domain manifests, commit markers, no step manifest) that retention would not
  keep next to the committed ones (so no daemon will finish them) and in which nothing changed for
  ``stale_after`` seconds.
* incomplete transfers into the durable tier started more than ``stale_after`` seconds ago: POSIX
  temp files, S3 multipart uploads (``StorageTier.cleanup_incomplete``, limited to exactly the ones
  the plan lists).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from .. import failpoints
from ..checkpoint.metadata_pickle import read_checked_metadata
from ..checkpoint.policy import RetentionPolicy
from ..errors import (
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    ResilientSlurmError,
    StorageError,
    TagsFileError,
)
from ..layout import StepBusy, StepTagged, TempKind, delete_durable_step, delete_step
from ..manifest import (
    DCP_METADATA_NAME,
    MANIFEST_NAME,
    durable_step_key,
    parse_step_dirname,
    read_manifest_file,
)
from ..rundir import RunDir
from ..storage.fileio import remove_tree
from ..storage.tier import StorageTier
from .inventory import Catalog, StepView


@dataclass
class GcAction:
    """One thing ``gc`` deletes (or would delete)."""

    tier: str  # local | durable
    kind: str  # step | stale_temp | uncommitted_step | incomplete_upload
    run_id: str
    step: int | None
    where: str  # path, or tier URL and key
    bytes: int | None
    why: str
    key: str | None = None  # durable key (steps: the step prefix; uploads: the object key)
    state: str = "planned"  # planned | deleted | skipped | failed
    detail: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The action as a JSON-able dict."""
        return {"tier": self.tier, "kind": self.kind, "run_id": self.run_id, "step": self.step, "where": self.where,
                "bytes": self.bytes, "why": self.why, "state": self.state, "detail": self.detail}


def _tree_newest(path: str) -> tuple[float | None, int]:
    """Newest mtime of a directory and everything in it (links not followed), and its size in bytes.
    The mtime is None when ``path`` itself cannot be stat'ed (gone: committed or removed meanwhile): its
    age is unknown, never "since 1970"."""
    try:
        newest = os.lstat(path).st_mtime
    except OSError:
        return None, 0
    size = 0
    for dirpath, _, files in os.walk(path):
        for n in (".", *files):
            try:
                st = os.lstat(os.path.join(dirpath, n))
            except OSError:
                continue
            newest = max(newest, st.st_mtime)
            size += st.st_size if n != "." else 0
    return newest, size


def _local_plan(catalog: Catalog, run: str, durable: set[int] | None, policy: RetentionPolicy,
                tagged: frozenset[int], stale_after: float, now: float) -> list[GcAction]:
    out: list[GcAction] = []
    for _, run_dir, listing in catalog.listings(run):
        committed = listing.committed
        invalid = {s: why for s in committed if (why := _local_step_problem(run_dir, run, s))}
        protect: set[int] = set()
        if durable is not None:
            pending = [s for s in committed if s not in durable and s not in invalid]
            if pending:
                protect.add(max(pending))
        for s in policy.deletable(committed, invalid, protected=tagged):
            path = RunDir.at(run_dir).step(s)
            if s in protect:
                continue
            _, size = _tree_newest(path)
            if s in invalid:
                why = f"invalid ({invalid[s]}) and older than the newest valid step kept"
            else:
                where = "durable" if durable is not None and s in durable else (
                    "not durable" if durable is not None else "no durable tier")
                why = f"retention ({_policy_text(policy)}) does not keep it; {where}"
            out.append(GcAction("local", "step", run, s, path, size, why))
        for t in listing.temps:
            path = listing.temp_path(t)
            failpoints.hit("gc_before_age", path)
            newest, size = _tree_newest(path)
            if newest is None:
                continue  # gone since the listing (its save committed, or its writer removed it)
            age = now - newest
            if age >= stale_after:
                out.append(GcAction("local", "stale_temp", run, t.step, path, size,
                                    f"in-progress directory unchanged for {_age(age)} (>= {_age(stale_after)}): "
                                    "its save or deletion was interrupted"))
    return out


def _local_step_problem(run_dir: str, run: str, step: int) -> str | None:
    """Why a committed local step is invalid (its manifest or ``.metadata`` fails the checks restore
    makes), or None when it is valid. Shards are not read: ``rslurm verify`` does that."""
    d = RunDir.at(run_dir).step(step)
    try:
        m = read_manifest_file(os.path.join(d, MANIFEST_NAME))
        if m.run_id != run or m.step != step:
            return f"its manifest says run {m.run_id!r} step {m.step}"
        read_checked_metadata(os.path.join(d, DCP_METADATA_NAME), m.dcp_metadata)
    except (CorruptCheckpointError, IncompatibleCheckpointError) as exc:
        return str(exc)
    except OSError as exc:
        return f"{d}: cannot read it: {exc}"
    return None


def _policy_text(p: RetentionPolicy) -> str:
    return f"keep_last={p.keep_last}" + (f", keep_every={p.keep_every}" if p.keep_every else "")


def _age(s: float) -> str:
    s = max(0, int(s))
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= n:
            return f"{s / n:.1f}{unit}".replace(".0", "")
    return f"{s}s"


def _incomplete(tier: StorageTier, prefix: str, older_than: float, now: float) -> list[tuple[str, float, int | None]]:
    """Incomplete transfers under ``prefix`` started more than ``older_than`` s ago: (key, started, bytes)."""
    return [(t.key, t.started, t.size) for t in tier.list_incomplete(prefix) if now - t.started >= older_than]


def _durable_plan(catalog: Catalog, run: str, views: list[StepView], policy: RetentionPolicy,
                  tagged: frozenset[int], stale_after: float, now: float) -> list[GcAction]:
    tier = catalog.durable
    assert tier is not None
    out: list[GcAction] = []
    # A step with a manifest object is committed; an unreadable one never counts toward keep_last.
    committed = sorted(v.step for v in views if v.durable is not None and v.durable.state in ("durable", "invalid"))
    invalid = {v.step: v.durable.problem for v in views if v.durable is not None and v.durable.state == "invalid"}
    for s in policy.deletable(committed, invalid, protected=tagged):
        v = next(x for x in views if x.step == s)
        m = v.durable.manifest if v.durable else None
        why = (f"invalid ({invalid[s]}) and older than the newest valid step kept" if s in invalid
               else f"retention ({_policy_text(policy)}) does not keep it")
        out.append(GcAction("durable", "step", run, s, f"{tier.url}/{durable_step_key(run, s)}",
                            m.total_bytes if m else None, why, key=durable_step_key(run, s)))
    keep_with = set(committed)
    for v in views:
        if (v.durable is None or v.durable.state != "partial" or v.step in tagged
                or v.step in policy.keep(keep_with | {v.step})):
            continue
        prefix = durable_step_key(run, v.step)
        objs = list(tier.list(prefix))
        newest = max((o.mtime for o in objs), default=0.0)
        if now - newest < stale_after:
            continue
        out.append(GcAction("durable", "uncommitted_step", run, v.step, f"{tier.url}/{prefix}",
                            sum(o.size for o in objs),
                            f"never committed ({v.durable.problem}), unchanged for {_age(now - newest)}, and retention "
                            "would not keep it next to the committed steps", key=prefix))
    for key, started, size in _incomplete(tier, run, stale_after, now):
        out.append(GcAction("durable", "incomplete_upload", run, parse_step_dirname(key.split("/")[1])
                            if key.count("/") >= 2 else None, f"{tier.url}/{key}", size,
                            f"incomplete transfer started {_age(now - started)} ago (>= {_age(stale_after)})", key=key))
    return out


def plan_gc(catalog: Catalog, policy: RetentionPolicy, *, tiers: Iterable[str] = ("local", "durable"),
            run_id: str | None = None, stale_after: float, now: float | None = None) -> list[GcAction]:
    """Everything ``gc`` would delete, per run (``run_id`` or every run), in the order it deletes."""
    now = time.time() if now is None else now
    tiers = set(tiers)
    actions: list[GcAction] = []
    runs = [run_id] if run_id else catalog.runs()
    for run in runs:
        try:
            tagged = catalog.tags(run).steps
        except TagsFileError as exc:  # a fault in the data (its message says nothing of the run is deleted)
            catalog.faults.append(f"run {run}: {exc}")
            continue
        views = catalog.steps(run)
        durable: set[int] | None = None
        if catalog.durable is not None:
            durable = {v.step for v in views if v.durable is not None and v.durable.state == "durable"}
        if "local" in tiers:
            actions += _local_plan(catalog, run, durable, policy, tagged, stale_after, now)
        if "durable" in tiers and catalog.durable is not None:
            actions += _durable_plan(catalog, run, views, policy, tagged, stale_after, now)
    return actions


def _delete_local_step(path: str, step: int) -> tuple[str, str | None]:
    try:
        gone = delete_step(os.path.dirname(path), step, TempKind.GC)
    except StepBusy as busy:
        return "skipped", f"busy ({busy.why}); run gc again later"
    except StepTagged:
        return "skipped", "tagged since the plan was made"
    return ("deleted", None) if gone else ("skipped", "already gone")


def _not_in(keys: set[str]) -> Callable[[str], bool]:
    return lambda key: key not in keys


def run_gc(catalog: Catalog, actions: list[GcAction], *, stale_after: float) -> list[GcAction]:
    """Carry out a plan from :func:`plan_gc`; each action's ``state`` says what happened."""
    uploads: dict[str, set[str]] = {}
    for a in actions:
        try:
            if a.tier == "local" and a.kind == "step":
                assert a.step is not None
                a.state, a.detail = _delete_local_step(a.where, a.step)
            elif a.tier == "local":
                newest, _ = _tree_newest(a.where)  # again: the plan is a moment old
                if newest is None:
                    a.state, a.detail = "skipped", "gone since the plan (committed or removed by its writer)"
                elif time.time() - newest < stale_after:
                    a.state, a.detail = "skipped", "changed since the plan: its writer is back"
                else:
                    remove_tree(a.where)
                    a.state = "deleted"
            elif a.kind == "incomplete_upload":
                uploads.setdefault(a.run_id, set()).add(str(a.key))
            else:
                assert catalog.durable is not None and a.step is not None
                delete_durable_step(catalog.durable, a.run_id, a.step)
                a.state = "deleted"
        except StepTagged:
            a.state, a.detail = "skipped", "tagged since the plan was made"
        except (OSError, ResilientSlurmError) as exc:
            a.state, a.detail = "failed", str(exc)
    for run, keys in uploads.items():
        tier = catalog.durable
        assert tier is not None
        try:
            tier.cleanup_incomplete(run, older_than=stale_after, keep=_not_in(keys))  # exactly what the plan lists
            for a in actions:
                if a.kind == "incomplete_upload" and a.run_id == run:
                    a.state = "deleted"
        except StorageError as exc:
            for a in actions:
                if a.kind == "incomplete_upload" and a.run_id == run:
                    a.state, a.detail = "failed", str(exc)
    return actions


__all__ = ["GcAction", "plan_gc", "run_gc"]
