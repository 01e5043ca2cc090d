"""What the node-local and durable tiers hold: runs, steps, and each step's state in each tier.

Who calls what: the ``rslurm`` inspection commands (``cli.py``) open a :class:`Catalog` from resolved
settings (:meth:`Catalog.open`, a context manager that closes the durable tier), pick a run
(:meth:`Catalog.resolve_run`), list steps (:meth:`Catalog.steps`) or fetch one (:meth:`Catalog.step`),
and ask which tier to read it from (:meth:`Catalog.choose_tier`). ``verify``, ``gc``, ``show`` and
``export`` work on the :class:`StepView` objects it returns. Nothing here writes, and nothing imports
torch.

The local tier is every storage domain's directory visible from here: this node's root (``local_dir``
with ``%n`` replaced by this node's name) and, when ``local_dir`` contains ``%n``, every other directory
the template matches (on a shared filesystem every node's; on node-local disks, this node's only).
Each holds the shards of its own domain (``manifest.nodes`` maps domain -> ranks).

States of a step (``StepView.local_state`` / ``StepView.durable_state``):

* local: ``complete`` (every domain's copy of the same save is here), ``partial`` (some domains' copies
  are here, the others are on other nodes or gone), ``invalid`` (a copy here has no readable manifest,
  names another run or step, or domains hold different saves), ``in_progress`` (only a
  ``step_X.tmp-*`` directory: a save being written, or abandoned), ``absent``;
* durable: ``durable`` (its manifest is there: committed), ``partial`` (domain manifests and shards but no
  step manifest: a drain in progress or abandoned; ``markers`` lists the domains whose manifest is there,
  ``committed`` those whose commit marker for that save is), ``invalid`` (the manifest is unreadable or names another
  step), ``absent``, ``unknown`` (the tier could not be listed: ``ls`` reports the error); ``None`` when
  no durable tier is configured.

Peer replicas (``<root>/<run>/replicas/<domain>/step_X/``, :mod:`resilient_slurm.layout`) are spare copies
of a partner domain's steps that a node holds: never one of the run's own steps (:meth:`Catalog.steps`
does not see them), listed apart by :func:`scan_replicas` (``rslurm ls``, ``rslurm status``, and the
daemon's eviction, which removes them first).
"""

from __future__ import annotations

import glob
import os
import stat
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from ..config import Settings
from ..errors import (
    ConfigError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    ObjectNotFoundError,
    StorageError,
    UnsafePathError,
)
from ..layout import (
    NESTED_ROOT,
    RUN_LINK,
    RunListing,
    TempKind,
    list_replicas,
    list_run_dir,
    list_runs,
    nested_roots,
    run_links,
)
from ..manifest import (
    DOMAINS_DIR,
    MANIFEST_NAME,
    Manifest,
    commit_marker_key,
    durable_step_key,
    parse_step_dirname,
    read_durable_manifest,
    read_manifest_file,
    save_token,
)
from ..paths import default_run_id, expand_local_dir, id_problem
from ..rundir import RunDir
from ..storage.tier import StorageTier
from ..tags import RunTags, merge, read_durable_tags, read_local_tags, tag_name_problem


def local_roots(template: str, node: str) -> list[str]:
    """The local tier's domain directories visible from here: this node's first, then the others that
    ``template`` matches when it contains ``%n`` (each once, by real path). The control sockets' directory
    is not a domain, though the default template (``$TMPDIR/rslurm-<uid>/%n``) matches its default place
    (``/tmp/rslurm-<uid>/run``)."""
    from ..control.protocol import default_runtime_dir

    roots = [expand_local_dir(template, node)]
    if "%n" in template:
        base = os.path.abspath(os.path.expanduser(template.replace("%n", "\0")))
        pattern = "*".join(glob.escape(p) for p in base.split("\0"))
        sockets = os.path.realpath(default_runtime_dir())
        roots += sorted(p for p in glob.glob(pattern) if os.path.isdir(p) and os.path.realpath(p) != sockets)
    seen: set[str] = set()
    out = []
    for r in roots:
        real = os.path.realpath(r)
        if real not in seen:
            seen.add(real)
            out.append(r)
    return out


@dataclass
class LocalCopy:
    """One storage domain's copy of a step in the local tier (``<root>/<run>/step_X/``)."""

    root: str
    path: str
    manifest: Manifest | None
    problem: str | None = None  # why the copy is not valid (names the file)

    @property
    def domain(self) -> str | None:
        """The storage domain the manifest says this copy belongs to."""
        return self.manifest.node if self.manifest else None

    @property
    def bytes(self) -> int:
        """Bytes of the shards this copy holds."""
        return sum(s.size for s in self.manifest.shards_of_node(self.manifest.node)) if self.manifest else 0


@dataclass
class DurableCopy:
    """A step in the durable tier."""

    state: str  # durable | partial | invalid
    where: str  # tier URL and step prefix
    manifest: Manifest | None = None
    markers: list[str] = field(default_factory=list)  # domains whose domain manifest is there (partial steps)
    committed: list[str] = field(default_factory=list)  # of those, domains whose commit marker for the save is there
    domains: int | None = None  # how many domains the step has, when known
    problem: str | None = None


@dataclass
class StepView:
    """Everything known about one step of one run, in both tiers."""

    run_id: str
    step: int
    local: list[LocalCopy] = field(default_factory=list)
    in_progress: list[str] = field(default_factory=list)  # step_X.tmp-* directories (saves, fetches)
    durable: DurableCopy | None = None
    durable_configured: bool = False
    durable_unreadable: str | None = None  # why the durable tier could not be listed (state unknown)

    @property
    def valid_local(self) -> list[LocalCopy]:
        """Local copies with a valid manifest."""
        return [c for c in self.local if c.manifest is not None]

    @property
    def manifest(self) -> Manifest | None:
        """The step's manifest: the durable one, else a local copy's (the first domain's if it is here)."""
        if self.durable is not None and self.durable.manifest is not None:
            return self.durable.manifest
        valid = self.valid_local
        if not valid:
            return None
        first = valid[0].manifest
        assert first is not None
        return next((c.manifest for c in valid if c.manifest and c.manifest.node == first.first_domain), first)

    @property
    def missing_domains(self) -> list[str]:
        """Domains of the step with no valid local copy here."""
        m = self.manifest
        if m is None:
            return []
        have = {c.domain for c in self.valid_local}
        return sorted(d for d in m.nodes if d not in have)

    @property
    def local_state(self) -> tuple[str, str | None]:
        """(state, why) in the local tier (see the module docstring)."""
        if not self.local:
            if not self.in_progress:
                return "absent", None
            n = len(self.in_progress)
            return "in_progress", f"{n} temp director{'y' if n == 1 else 'ies'}: a save in progress, or abandoned"
        bad = [c for c in self.local if c.manifest is None]
        if bad:
            return "invalid", "; ".join(str(c.problem) for c in bad)
        saves = {c.manifest.save_id for c in self.valid_local if c.manifest}
        if len(saves) > 1:
            return "invalid", "domains hold different saves of this step: " + ", ".join(
                f"{c.domain} created {c.manifest.created_at:.3f}" for c in self.valid_local if c.manifest)
        m = self.valid_local[0].manifest
        assert m is not None
        missing = sorted(set(m.nodes) - {c.domain for c in self.valid_local})
        if missing:
            return "partial", (f"{len(m.nodes) - len(missing)}/{len(m.nodes)} domains here; "
                               f"{', '.join(missing)} not here")
        return "complete", None

    @property
    def durable_state(self) -> tuple[str | None, str | None]:
        """(state, why) in the durable tier; (None, None) when no durable tier is configured."""
        if not self.durable_configured:
            return None, None
        if self.durable_unreadable is not None:
            return "unknown", self.durable_unreadable
        if self.durable is None:
            return "absent", None
        return self.durable.state, self.durable.problem

    @property
    def local_bytes(self) -> int:
        """Bytes of the shards in valid local copies."""
        return sum(c.bytes for c in self.valid_local)

    def to_json(self, now: float | None = None, tags: list[str] | None = None) -> dict[str, Any]:
        """One step as a JSON-able dict (the rows of ``rslurm ls --json``), with its ``tags``."""
        now = time.time() if now is None else now
        m = self.manifest
        lstate, lwhy = self.local_state
        dstate, dwhy = self.durable_state
        doc: dict[str, Any] = {
            "run_id": self.run_id, "step": self.step, "tags": list(tags or []),
            "reason": m.reason if m else None, "created_at": m.created_at if m else None,
            "age_s": round(max(0.0, now - m.created_at), 1) if m else None,
            "world_size": m.world_size if m else None, "bytes": m.total_bytes if m else None,
            "domains": sorted(m.nodes) if m else None,
            "local": {"state": lstate, "why": lwhy, "domains": sorted(c.domain for c in self.valid_local if c.domain),
                      "missing_domains": self.missing_domains if self.local else [],
                      "bytes": self.local_bytes, "paths": [c.path for c in self.local],
                      "in_progress": list(self.in_progress)},
            "durable": None,
        }
        if dstate is not None:
            d = self.durable
            doc["durable"] = {"state": dstate, "why": dwhy, "where": d.where if d else None,
                              "markers": list(d.markers) if d else [], "committed": list(d.committed) if d else [],
                              "domains": d.domains if d else None}
        return doc


class Catalog:
    """Read-only view of the local tier (every visible domain directory) and the durable tier."""

    def __init__(self, local_template: str, node: str, durable: StorageTier | None = None, *,
                 durable_url: str | None = None) -> None:
        self.local_template = local_template
        self.node = node
        self.durable = durable
        self.durable_url = durable_url or (durable.url if durable is not None else None)
        self.roots = local_roots(local_template, node)
        self.errors: list[str] = []  # what could not be read while listing (ls reports them)
        # Data that was found but could not be read (a run's tags file): `ls` and `runs` report them with the
        # errors, and exit 1 for them (a fault in the data), 2 only for a store they could not list.
        self.faults: list[str] = []
        self._tags: dict[str, RunTags] = {}

    @classmethod
    def open(cls, cfg: Settings, *, local_template: str, node: str) -> Catalog:
        """A catalog over ``local_template`` and the durable tier named by ``cfg``."""
        from ..storage import open_durable

        tier = open_durable(cfg, upload_cap=False, create=False)  # a reader: a mistyped path is not made
        return cls(local_template, node, tier, durable_url=cfg.durable)

    def close(self) -> None:
        """Close the durable tier."""
        if self.durable is not None:
            self.durable.close()

    def __enter__(self) -> Catalog:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    @property
    def this_root(self) -> str:
        """This node's local root."""
        return self.roots[0]

    # ------------------------------------------------------------------ runs
    def local_runs(self) -> list[str]:
        """Runs with a directory in some local domain root. A run-named symbolic link there is not one (never
        followed) and is recorded in :attr:`errors`, as when its run is asked for by name."""
        runs: set[str] = set()
        for root in self.roots:
            try:
                found = list_runs(root)
                links = run_links(root)
            except OSError as exc:
                self._error(f"local tier {root}: cannot list it: {exc.strerror}")
                continue
            nested = nested_roots(root, found)
            runs |= set(found) - set(nested)
            for n in links:
                self._error(f"local tier {RunDir(root, n).path}: cannot list it: {RUN_LINK}")
            for n in nested:
                self._error(f"local tier {RunDir(root, n).path}: {NESTED_ROOT}")
        return sorted(runs)

    def durable_runs(self) -> list[str]:
        """Runs with a directory in the durable tier (raises StorageError when it cannot be listed); a name
        that is not a run id (:func:`~resilient_slurm.paths.id_problem`) is not a run."""
        names = self.durable.list_dirs("") if self.durable is not None else []
        return [n for n in names if id_problem("run id", n) is None]

    def runs(self, *, strict: bool = True) -> list[str]:
        """Every run in either tier. With ``strict`` False a durable listing failure is recorded in
        :attr:`errors` instead of raised."""
        durable: list[str] = []
        try:
            durable = self.durable_runs()
        except StorageError as exc:
            if strict:
                raise
            self._error(f"durable tier {self.durable_url}: {exc}")
        return sorted(set(self.local_runs()) | set(durable))

    def _error(self, message: str) -> None:
        """Record what could not be read, once (a listing may be made more than once by a command)."""
        if message not in self.errors:
            self.errors.append(message)

    def has_run(self, run: str) -> bool | None:
        """Whether a tier this catalog reads has ``run``'s own entry (a local ``<root>/<run>``, a link too, or
        anything under ``<run>/`` in the durable tier); None when a place that could hold it cannot be read.
        Looks at ``run`` only: other runs' problems are not its."""
        unknown = False
        for root in self.roots:
            try:
                os.lstat(RunDir(root, run).path)
                return True
            except FileNotFoundError:
                continue
            except OSError:
                unknown = True
        if self.durable is not None:
            try:
                if self.durable.list_dirs(run) or self.durable.list_names(run):
                    return True
            except StorageError:
                unknown = True  # the listing of the run's steps names the error
        return None if unknown else False

    def given_run(self, run: str, *, strict: bool = True) -> str:
        """``run`` when a tier has it (its directory, also before its first save), or when that cannot be told;
        else, with ``strict`` (a ``--run-id`` typed on the command line), a ConfigError naming the runs there: a
        misspelt run id is an error, never an empty listing. Not ``strict`` (a run id from the environment or
        the config file: a job names its run before the run's first save), ``run`` is returned. A ``run`` that
        cannot be a run id (``../x``, a path) is a ConfigError before any tier is looked at."""
        if (problem := id_problem("run id", run)) is not None:
            raise ConfigError(f"run {problem}")
        if not strict or self.has_run(run) is not False:
            return run
        before = list(self.errors)
        try:
            runs = self.runs(strict=False)  # for the message only: their problems are not this run's
        finally:
            self.errors[:] = before
        where = "the local tier " + ", ".join(self.roots) + (
            f" or the durable tier {self.durable_url}" if self.durable is not None and self.durable_url else "")
        there = f"the runs there: {', '.join(runs)}" if runs else "there are no runs there"
        raise ConfigError(f"no run {run!r} in {where} ({there}); check the run id (--run-id)")

    def resolve_run(self, run_id: str | None, *, strict: bool = True) -> str:
        """The run a single-step command works on: ``run_id`` if given; else this Slurm job's if it has
        checkpoints; else the only run there is. Raises ConfigError naming the runs otherwise (also for a
        ``run_id`` no tier has: :meth:`given_run`)."""
        if run_id:
            return self.given_run(run_id, strict=strict)
        runs = self.runs()
        job = default_run_id()
        if job in runs:
            return job
        if len(runs) == 1:
            return runs[0]
        where = ", ".join(self.roots) + (f" or {self.durable_url}" if self.durable_url else "")
        if not runs:
            # What could not be listed (a run directory that is a link, a root one level too high) is why.
            why = "".join(f"; {e}" for e in self.errors)
            raise ConfigError(f"no checkpoints in {where} (set --local-dir/RSLURM_LOCAL_DIR and "
                              f"--durable/RSLURM_DURABLE to where the run saves){why}")
        raise ConfigError(f"several runs in {where}: {', '.join(runs)}; pick one with --run-id or RSLURM_RUN_ID")

    # ------------------------------------------------------------------ steps
    def listings(self, run: str) -> Iterator[tuple[str, str, RunListing]]:
        """``(root, run directory, listing)`` of ``run`` in each local root that has it; a directory that
        cannot be listed (a link, no permission) is recorded in :attr:`errors` and skipped."""
        for root in self.roots:
            run_dir = RunDir(root, run).path
            try:
                listing = list_run_dir(run_dir)
            except OSError as exc:
                self._error(f"local tier {run_dir}: cannot list it: {exc.strerror}")
                continue
            yield root, run_dir, listing

    def _scan_local(self, run: str, views: dict[int, StepView]) -> None:
        for root, run_dir, listing in self.listings(run):
            for step in sorted(listing.committed + listing.uncommitted):
                copy = _read_local_copy(root, listing.step_dir(step), run, step)
                if copy is not None:
                    views.setdefault(step, StepView(run, step)).local.append(copy)
            for name in listing.foreign:
                if (n := parse_step_dirname(name)) is not None:
                    views.setdefault(n, StepView(run, n)).local.append(LocalCopy(
                        root, RunDir.at(run_dir).file(name), None,
                        f"{RunDir.at(run_dir).file(name)}: a symbolic link or a file, not a step directory rslurm "
                        "wrote; it is never read"))
            for t in listing.in_progress():
                views.setdefault(t.step, StepView(run, t.step)).in_progress.append(listing.temp_path(t))

    def _scan_durable(self, run: str, views: dict[int, StepView]) -> None:
        tier = self.durable
        assert tier is not None
        names = [(n, s) for n in tier.list_dirs(run) if (s := parse_step_dirname(n)) is not None]
        with ThreadPoolExecutor(max_workers=8) as pool:
            copies = list(pool.map(lambda ns: read_durable_copy(tier, run, ns[1]), names))
        for (_, step), copy in zip(names, copies):
            views.setdefault(step, StepView(run, step)).durable = copy

    def steps(self, run: str, *, strict: bool = True) -> list[StepView]:
        """Every step of ``run`` found in either tier, ascending. With ``strict`` False a durable tier
        that cannot be read is recorded in :attr:`errors` and only the local tier is listed."""
        views: dict[int, StepView] = {}
        self._scan_local(run, views)
        unreadable = None
        if self.durable is not None:
            try:
                self._scan_durable(run, views)
            except StorageError as exc:
                if strict:
                    raise
                self._error(f"durable tier {self.durable_url}, run {run}: {exc}")
                unreadable = "the durable tier could not be read (see errors)"
        for v in views.values():
            v.durable_configured = self.durable is not None
            v.durable_unreadable = unreadable
        return [views[s] for s in sorted(views)]

    def replicas(self, run: str) -> list[ReplicaSet]:
        """The replicas of partner domains' steps of ``run`` that this node holds (in :attr:`this_root`
        only: the other roots are other nodes' disks, whose replicas those nodes hold). Never among
        :meth:`steps`. A directory that cannot be listed is recorded in :attr:`errors`."""
        return scan_replicas(self.this_root, run, self.errors)

    # ------------------------------------------------------------------ tags
    def tag_copies(self, run: str) -> list[tuple[str, RunTags | None]]:
        """``(where, copy)`` of every tags file of ``run`` visible from here: each local domain directory's,
        then the durable one (None where there is none). TagsFileError names a copy that cannot be read;
        StorageError when the durable tier cannot be."""
        out: list[tuple[str, RunTags | None]] = []
        for root in self.roots:
            run_dir = RunDir(root, run).path
            out.append((run_dir, read_local_tags(run_dir, run)))
        if self.durable is not None:
            out.append((self.durable_url or self.durable.url, read_durable_tags(self.durable, run)))
        return out

    def tags(self, run: str) -> RunTags:
        """``run``'s tags: every copy merged (see :meth:`tag_copies` for what raises)."""
        if run not in self._tags:
            self._tags[run] = merge(run, (t for _, t in self.tag_copies(run)))
        return self._tags[run]

    def forget_tags(self, run: str) -> None:
        """Read the tags again next time (after writing them)."""
        self._tags.pop(run, None)

    def resolve_step(self, run: str, step: int | str) -> int:
        """The step a STEP argument names: a step number, or a tag of ``run``. ConfigError for a tag the run
        does not have (naming those it has), or a text that is neither."""
        if isinstance(step, int):
            return step
        if step.isdigit():
            return int(step)
        problem = tag_name_problem(step)
        if problem is not None:
            raise ConfigError(f"STEP {step[:80]!r} is neither a step number nor a tag ({problem})")
        tags = self.tags(run).tags
        if step not in tags:
            have = ", ".join(f"{n} (step {s})" for n, s in tags.items()) or "none"
            raise ConfigError(f"run {run} has no tag {step!r}; its tags: {have}")
        return tags[step]

    def step(self, run: str, step: int | str) -> StepView:
        """One step, by number or by tag (:meth:`resolve_step`); ConfigError naming the steps there are when
        it exists in neither tier."""
        named = f" (tag {step!r})" if isinstance(step, str) and not step.isdigit() else ""
        step = self.resolve_step(run, step)
        views = {v.step: v for v in self.steps(run)}
        if step not in views:
            dirs = [os.path.join(r, run) for r in self.roots]
            where = ", ".join(dirs)
            if self.durable_url:
                where += f" or {self.durable_url}/{run}"
            have = sorted(views)
            # A run directory that could not be listed (a link, no permission: listings()) is why.
            unlisted = "".join(f"; {e}" for e in self.errors if any(e.startswith(f"local tier {d}:") for d in dirs))
            raise ConfigError(f"step {step}{named} not found in {where}; steps there: {have or 'none'}{unlisted}")
        return views[step]

    def choose_tier(self, view: StepView, tier: str = "auto") -> str:
        """The tier to read a whole step from: ``local`` when every domain's copy is here, else
        ``durable`` when it is committed there. An explicit ``tier`` is checked. Raises
        CorruptCheckpointError when the copies that would be read are damaged, ConfigError when the step
        is not whole in the tiers asked for (domains on other nodes, not drained, not configured)."""
        lstate, lwhy = view.local_state
        dstate, dwhy = view.durable_state
        if tier in ("auto", "local") and lstate == "complete":
            return "local"
        if tier in ("auto", "durable") and dstate == "durable":
            return "durable"
        what = f"run {view.run_id} step {view.step}"
        local_desc = f"local tier: {lstate}" + (f" ({lwhy})" if lwhy else "")
        durable_desc = ("durable tier: not configured (--durable / RSLURM_DURABLE)" if dstate is None
                        else f"durable tier: {dstate}" + (f" ({dwhy})" if dwhy else ""))
        if (tier != "durable" and lstate == "invalid") or (tier != "local" and dstate == "invalid"):
            # A damaged copy is a fault in the data, not in how the command was called.
            raise CorruptCheckpointError(f"{what} cannot be read: {local_desc}; {durable_desc}. Run `rslurm verify "
                                         f"{view.step}` for every fault")
        if tier == "local":
            raise ConfigError(f"{what} is not complete in the local tier: {local_desc}")
        if tier == "durable":
            raise ConfigError(f"{what} is not committed in the durable tier: {durable_desc}")
        raise ConfigError(f"{what} is not complete in any tier: {local_desc}; {durable_desc}")

    def local_copies_by_domain(self, view: StepView) -> dict[str, LocalCopy]:
        """Valid local copies of a step, by storage domain."""
        return {c.domain: c for c in view.valid_local if c.domain is not None}


def _read_local_copy(root: str, path: str, run: str, step: int) -> LocalCopy | None:
    mpath = os.path.join(path, MANIFEST_NAME)
    try:
        m = read_manifest_file(mpath)
    except FileNotFoundError:
        if not os.path.isdir(path):
            return None  # deleted (retention, eviction) while we listed
        return LocalCopy(root, path, None, f"{mpath}: missing, so this copy is not committed (a step directory "
                                           "always has one)")
    except (CorruptCheckpointError, IncompatibleCheckpointError) as exc:
        return LocalCopy(root, path, None, str(exc))
    except OSError as exc:
        return LocalCopy(root, path, None, f"{mpath}: cannot be read: {exc.strerror}")
    if m.run_id != run or m.step != step:
        return LocalCopy(root, path, None, f"{mpath}: says run {m.run_id!r} step {m.step}")
    return LocalCopy(root, path, m)


def read_durable_copy(tier: StorageTier, run: str, step: int) -> DurableCopy:
    """The state of ``step`` of ``run`` in the durable tier (raises StorageError when it cannot be read)."""
    prefix = durable_step_key(run, step)
    where = f"{tier.url}/{prefix}"
    try:
        m = read_durable_manifest(tier, run, step)
    except UnsafePathError as exc:  # a link or special file where the manifest goes
        return DurableCopy("invalid", where, problem=str(exc))
    except (CorruptCheckpointError, IncompatibleCheckpointError) as exc:
        return DurableCopy("invalid", where, problem=str(exc))
    except ObjectNotFoundError:
        markers = tier.list_dirs(durable_step_key(run, step, DOMAINS_DIR))
        domains = None
        token = None
        for d in markers:
            try:
                dm = read_durable_manifest(tier, run, step, d)
            except (ObjectNotFoundError, UnsafePathError, CorruptCheckpointError, IncompatibleCheckpointError):
                continue
            domains, token = len(dm.nodes), save_token(dm)
            break
        # The commit markers of the save that domain manifest belongs to: all n there and still no step
        # manifest means the last node died between its marker and the commit (the next drain pass commits).
        done = sorted(set(tier.list_names(commit_marker_key(run, step, token))) & set(markers)) if token else []
        n = "?" if domains is None else str(domains)
        return DurableCopy("partial", where, markers=markers, domains=domains, committed=done,
                           problem=f"not committed: {len(markers)}/{n} domain manifests "
                                   f"({', '.join(markers) or 'none'}), {len(done)}/{n} commit markers"
                                   f"{f' of save {token}' if token else ''}, no step manifest; "
                                   "a drain in progress or abandoned")
    if m.run_id != run or m.step != step:
        return DurableCopy("invalid", where, problem=f"{where}/{MANIFEST_NAME} says run {m.run_id!r} step {m.step}")
    return DurableCopy("durable", where, m, markers=sorted(m.nodes), domains=len(m.nodes))


# ------------------------------------------------------------------ peer replicas
def tree_bytes(path: str) -> int:
    """Bytes of the regular files in the directory tree ``path``: links are neither followed nor counted
    (``os.walk`` does not enter linked directories; files are ``lstat``-ed), and a file gone meanwhile
    counts 0."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                total += st.st_size
    return total


@dataclass
class ReplicaStep:
    """One committed replica: a partner domain's copy of a step, held in this node's run directory."""

    run_id: str
    domain: str  # the partner storage domain whose step this is
    step: int
    path: str
    bytes: int  # every regular file in the step directory (tree_bytes)
    created_at: float | None = None  # of the save, from the replica's manifest; None when it cannot be read
    problem: str | None = None  # why its manifest is not usable (names the file), else None

    def to_json(self, now: float | None = None) -> dict[str, Any]:
        now = time.time() if now is None else now
        return {"step": self.step, "bytes": self.bytes, "path": self.path, "created_at": self.created_at,
                "age_s": round(max(0.0, now - self.created_at), 1) if self.created_at is not None else None,
                "problem": self.problem}


@dataclass
class ReplicaSet:
    """The replicas of one partner domain's steps of one run held in one local root
    (``<root>/<run>/replicas/<domain>/``)."""

    run_id: str
    domain: str
    path: str
    steps: list[ReplicaStep] = field(default_factory=list)  # committed, ascending
    receiving: list[tuple[int, str]] = field(default_factory=list)  # (step, temp path) being received

    @property
    def bytes(self) -> int:
        return sum(r.bytes for r in self.steps)

    def to_json(self, now: float | None = None) -> dict[str, Any]:
        """One entry of ``replicas`` in ``rslurm ls --json``."""
        return {"run_id": self.run_id, "domain": self.domain, "path": self.path, "bytes": self.bytes,
                "steps": [r.to_json(now) for r in self.steps],
                "receiving": [{"step": s, "path": p} for s, p in self.receiving]}


def _read_replica(run: str, domain: str, path: str, step: int) -> ReplicaStep:
    out = ReplicaStep(run, domain, step, path, tree_bytes(path))
    mpath = os.path.join(path, MANIFEST_NAME)
    try:
        m = read_manifest_file(mpath)
    except (CorruptCheckpointError, IncompatibleCheckpointError) as exc:
        out.problem = str(exc)
        return out
    except OSError as exc:  # FileNotFoundError too: evicted or replaced while listed
        out.problem = f"{mpath}: cannot be read: {exc.strerror}"
        return out
    if m.run_id != run or m.step != step:
        out.problem = f"{mpath}: says run {m.run_id!r} step {m.step}"
    elif m.node != domain:
        out.problem = f"{mpath}: is domain {m.node!r}'s copy, not {domain!r}'s"
    else:
        out.created_at = m.created_at
    return out


def scan_replicas(root: str, run: str, errors: list[str] | None = None) -> list[ReplicaSet]:
    """The partner domains' replicas of ``run`` held in the local root ``root``, by domain (sorted): their
    committed steps with their size, and the replicas being received (``TempKind.REPLICA`` temp
    directories). A domain with neither is left out. Links and files where a ``replicas`` directory, a
    domain directory or a replica step goes are never followed (:func:`~resilient_slurm.layout.list_replicas`).
    A directory that cannot be listed is named in ``errors`` (when given) and skipped."""
    run_dir = RunDir(root, run).path
    try:
        by_domain = list_replicas(run_dir)
    except OSError as exc:
        if errors is not None:
            errors.append(f"local tier {RunDir.at(run_dir).replicas}: cannot list it: {exc.strerror}")
        return []
    out = []
    for domain, listing in by_domain.items():
        rs = ReplicaSet(run, domain, listing.run_dir,
                        [_read_replica(run, domain, listing.step_dir(s), s) for s in listing.committed],
                        [(t.step, listing.temp_path(t)) for t in listing.temps if t.kind is TempKind.REPLICA])
        if rs.steps or rs.receiving:
            out.append(rs)
    return out


__all__ = ["Catalog", "DurableCopy", "LocalCopy", "ReplicaSet", "ReplicaStep", "StepView", "local_roots",
           "read_durable_copy", "scan_replicas", "tree_bytes"]
