"""``rslurm tag STEP NAME`` and ``rslurm untag STEP NAME``: a run's tags changed in every copy of its tags
file that the command reaches (the format, the merge and the lock: :mod:`resilient_slurm.tags`).

Who calls what: ``cli.py`` opens a :class:`~.inventory.Catalog`, resolves the run and the step
(:meth:`~.inventory.Catalog.resolve_step`: a number or a tag), calls :func:`change_tag` and prints the
:class:`TagChange` it returns. Every copy visible from here must be readable first (none is overwritten
unread): the merged tags are changed, then written to the durable copy, then to each local domain
directory of the run (each under its tags lock). A tag then checks that its step is still committed
somewhere: a deletion that raced the tag would leave it naming nothing.
"""

from __future__ import annotations

import os
import random
import stat
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from ..manifest import MANIFEST_NAME, durable_step_key, step_dirname
from ..rundir import RunDir
from ..storage.tier import StorageTier
from ..tags import (
    RunTags,
    check_tag_name,
    durable_tags_key,
    local_tags_path,
    read_durable_tags,
    update_durable_tags,
    update_local_tags,
)
from .inventory import Catalog


@dataclass(frozen=True)
class TagChange:
    """What ``rslurm tag`` / ``untag`` did."""

    run_id: str
    step: int
    tag: str
    action: str  # tagged | untagged
    moved_from: int | None  # tag: the step the name left (None: new, or already on this step)
    written: tuple[str, ...]  # the copies written: local paths, durable URL

    def to_json(self) -> dict[str, Any]:
        """The change as a JSON-able dict."""
        return {"run_id": self.run_id, "step": self.step, "tag": self.tag, "action": self.action,
                "moved_from": self.moved_from, "written": list(self.written)}


def _local_run_dirs(catalog: Catalog, run: str) -> list[str]:
    """The run's directory in each local domain root that has one (a real directory, never a link)."""
    out = []
    for root in catalog.roots:
        d = RunDir(root, run).path
        try:
            if stat.S_ISDIR(os.lstat(d).st_mode):
                out.append(d)
        except FileNotFoundError:
            continue
    return out


def _committed_somewhere(catalog: Catalog, run: str, step: int, tiers: Iterable[str]) -> bool:
    """A manifest of ``step`` is still in a local domain directory or the durable tier."""
    if "local" in tiers and any(os.path.lexists(os.path.join(d, step_dirname(step), MANIFEST_NAME))
                                for d in _local_run_dirs(catalog, run)):
        return True
    return (catalog.durable is not None and "durable" in tiers
            and catalog.durable.stat(durable_step_key(run, step, MANIFEST_NAME)) is not None)


# The durable copy has no lock: two tag commands at once each read it, merge their own change and write it back,
# and the later write drops the earlier one's change. So a writer reads the copy again after a pause (twice its own
# round trip, at least 0.1 s, times a random 1-2 so two writers part) and writes its records again while the copy
# lacks them, at most this many times; a change still missing after that is an error (change_tag's check).
DURABLE_TAG_ROUNDS = 6


def _sync_durable_until_held(tier: StorageTier, new: RunTags) -> None:
    """Merge ``new`` into the durable copy. Where the tier cannot promise that no other writer came between
    its read and its write (a filesystem without ``flock``: :func:`~resilient_slurm.tags.update_durable_tags`),
    read it again after a pause and merge again until a read shows every record of ``new`` (or a newer one)."""
    t0 = time.monotonic()
    _, exclusive = update_durable_tags(tier, new)
    for _ in range(DURABLE_TAG_ROUNDS if not exclusive else 0):
        time.sleep(max(0.1, 2 * (time.monotonic() - t0)) * random.uniform(1.0, 2.0))
        cur = read_durable_tags(tier, new.run_id)
        if cur is not None and cur.merged(new).records == cur.records:
            return
        t0 = time.monotonic()
        update_durable_tags(tier, new)


def change_tag(catalog: Catalog, run: str, step: int, name: str, *, remove: bool,
               tiers: Iterable[str] = ("local", "durable"), now: float | None = None) -> TagChange:
    """Tag ``step`` of ``run`` as ``name`` (moving the name if it tags another step), or with ``remove``
    untag it, in every copy in ``tiers``. ConfigError for a bad name, a step that is not committed in
    any tier, an untag of a name that is not on ``step``; TagsFileError when a copy cannot be read (nothing
    is written); StorageError when the durable tier fails."""
    check_tag_name(name)
    tiers = set(tiers)
    current = catalog.tags(run)
    moved: int | None = None
    if remove:
        on = current.tags.get(name)
        if on is None:
            have = ", ".join(f"{n} (step {s})" for n, s in current.tags.items()) or "none"
            raise ConfigError(f"run {run} has no tag {name!r}; its tags: {have}")
        if on != step:
            raise ConfigError(f"tag {name!r} of run {run} is on step {on}, not step {step}")
        new = current.untagged(name, now=now)
    else:
        view = catalog.step(run, step)
        if view.manifest is None:
            states = [f"{tier} tier: {state}" + (f", {why}" if why else "")
                      for tier, (state, why) in (("local", view.local_state), ("durable", view.durable_state))
                      if state is not None]
            raise ConfigError(f"run {run} step {step} is not committed in any tier here ({'; '.join(states)}); "
                              "only a committed step can be tagged")
        moved = current.tags.get(name)
        new = current.tagged(name, step, now=now)
    written: list[str] = []
    if "durable" in tiers and catalog.durable is not None:
        _sync_durable_until_held(catalog.durable, new)
        written.append(f"{(catalog.durable_url or catalog.durable.url).rstrip('/')}/{durable_tags_key(run)}")
    if "local" in tiers:
        for run_dir in _local_run_dirs(catalog, run):
            update_local_tags(run_dir, run, lambda cur: cur.merged(new))
            written.append(local_tags_path(run_dir))
    catalog.forget_tags(run)
    if written:  # what every copy says now: a change that did not take is an error, never a success
        after = catalog.tags(run).tags.get(name)
        if after != (None if remove else step):
            raise ConfigError(f"run {run}: {'untag' if remove else 'tag'} {name!r} did not take: the tags files "
                              f"({', '.join(written)}) still give {name!r} "
                              + (f"step {after}" if after is not None else "no step")
                              + "; a record there is newer than this one: another tag or untag of that name since, or clocks "
                              "of the nodes that wrote it that disagree. `rslurm ls` shows them; tag again")
        catalog.forget_tags(run)
    if not written:
        raise ConfigError(f"run {run}: no copy of its tags is reachable here (no run directory in "
                          f"{', '.join(catalog.roots)}" + ("" if catalog.durable is not None and "durable" in tiers
                                                          else "; no durable tier") + ")")
    if not remove and not _committed_somewhere(catalog, run, step, tiers):
        raise ConfigError(f"run {run} step {step} was deleted while it was being tagged (retention or gc at the "
                          f"same moment): tag {name!r} now names a step that is gone; `rslurm untag {step} {name}`")
    return TagChange(run, step, name, "untagged" if remove else "tagged", moved if moved != step else None,
                     tuple(written))


__all__ = ["TagChange", "change_tag"]
