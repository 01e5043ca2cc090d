"""Manifest schema, on-disk layout names and validation (the contract that tools read).

Layout of the node-local tier (one per storage domain)::

    <root>/<run_id>/step_<step:012d>/            committed: manifest.json present (written last)
    <root>/<run_id>/step_<step:012d>.tmp-<tok>/  in progress or abandoned; never read, removed by GC

Layout of a durable tier (every domain's shards in one place)::

    <root>/<run_id>/step_<step:012d>/__<rank>_0.distcp       every rank's shard (names are unique)
    <root>/<run_id>/step_<step:012d>/domains/<d>/.metadata   domain d's DCP metadata
    <root>/<run_id>/step_<step:012d>/domains/<d>/manifest.json
                                            domain d's manifest: its marker, written after its shards
    <root>/<run_id>/step_<step:012d>/.metadata               the first domain's DCP metadata
    <root>/<run_id>/step_<step:012d>/manifest.json           written LAST: the step is durable

The durable manifest is the first domain's manifest with ``extra["durable"]`` listing the domains; its
bytes depend only on the step, so every node's daemon writes the same object (idempotent commit). The
root ``.metadata`` maps every item to a file in the step directory, so plain ``dcp.load`` reads it.

The manifest is JSON (never pickle), versioned by ``schema_version``. A reader refuses versions newer
than it knows, and names the file and the field when anything is malformed.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from . import paths
from .errors import CorruptCheckpointError, IncompatibleCheckpointError, UnsafePathError

if TYPE_CHECKING:
    from .storage.tier import StorageTier

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"
DCP_METADATA_NAME = ".metadata"
CHECKSUM_ALGORITHM = "xxh3_64"
REASONS = ("interval", "emergency", "final", "manual")

_STEP_RE = re.compile(r"^step_(\d{12})$")
_TMP_RE = re.compile(r"^step_(\d{12})\.tmp-([A-Za-z0-9_.-]+)$")  # the one pattern of temp names (layout.py parses them)


DOMAINS_DIR = "domains"
# Commit markers of the durable commit (daemon/drain.py): ``<step>/commits/<save token>/<domain>``, one empty
# object per domain whose shards, ``.metadata`` and marker manifest of that save are in place. One LIST of
# ``commits/<save token>/`` tells a node whether every domain of that save is done.
COMMITS_DIR = "commits"


# Values that differed between ranks are stored under each rank's own key (checkpoint/replication.py).
PER_RANK_PREFIX = "_rslurm_per_rank"


def per_rank_fqn(rank: int, fqn: str) -> str:
    """The DCP key under which ``rank``'s own copy of ``fqn`` is stored."""
    return f"{PER_RANK_PREFIX}.{rank}.{fqn}"


def per_rank_path(rank: int, path: Sequence[Any]) -> tuple[Any, ...]:
    """The nested path of a per-rank copy (what plain DCP readers see: ``{_rslurm_per_rank: {rank: ...}}``)."""
    return (PER_RANK_PREFIX, str(rank), *path)


def split_per_rank_fqn(fqn: str) -> tuple[int, str] | None:
    """``(rank, key)`` of a per-rank key, or None for any other key."""
    head, sep, rest = fqn.partition(".")
    if head != PER_RANK_PREFIX or not sep:
        return None
    rank, sep, key = rest.partition(".")
    return (int(rank), key) if sep and rank.isdigit() and key else None


def durable_step_key(run_id: str, step: int, *names: str) -> str:
    """Key of ``step`` of ``run_id`` in a durable tier: the step's prefix, or with ``names`` a file below it
    (``durable_step_key(run, 5, MANIFEST_NAME)``, ``durable_step_key(run, 5, DOMAINS_DIR)``). The one place
    durable step keys are built."""
    return "/".join((run_id, step_dirname(step), *names))


def durable_run_key(run_id: str, name: str) -> str:
    """Key of a run-level object (``history.json``...) beside the run's steps in a durable tier."""
    return f"{run_id}/{name}"


def domain_key(run_id: str, step: int, domain: str, name: str) -> str:
    """Key of a domain's own ``manifest.json`` or ``.metadata`` in a durable step."""
    return durable_step_key(run_id, step, DOMAINS_DIR, domain, name)


def save_token(m: Manifest) -> str:
    """One save of a step as a key component: its ``created_at`` written exactly (``repr`` round-trips a
    float), so markers of another save of the same step are under another prefix and never count."""
    return repr(float(m.created_at))


def commit_marker_key(run_id: str, step: int, token: str | None = None, domain: str | None = None) -> str:
    """Key of the commit markers of ``step``: all saves' (no ``token``), one save's (a prefix to LIST), or
    one domain's marker of that save."""
    names = [n for n in (token, domain) if n is not None]
    return durable_step_key(run_id, step, COMMITS_DIR, *names)


def step_dirname(step: int) -> str:
    """Name of the committed directory of ``step``."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step_{step:012d}"


def tmp_dirname(step: int, token: str) -> str:
    """Name of the in-progress directory of ``step`` for the save identified by ``token``."""
    return f"{step_dirname(step)}.tmp-{token}"


def parse_step_dirname(name: str) -> int | None:
    """Step number of a committed-directory name, or None if ``name`` is not one."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def is_tmp_dirname(name: str) -> bool:
    """True for in-progress / abandoned step directories (``step_X.tmp-*``)."""
    return _TMP_RE.match(name) is not None


def split_tmp_dirname(name: str) -> tuple[int, str] | None:
    """``(step, token)`` of a temp directory's name (``step_X.tmp-<token>``), or None if it is not one."""
    m = _TMP_RE.match(name)
    return (int(m.group(1)), m.group(2)) if m else None


@dataclass(frozen=True)
class ChunkEntry:
    """One written item inside a shard file: byte range and its checksum."""

    offset: int
    length: int
    checksum: str


@dataclass(frozen=True)
class ShardEntry:
    """One shard file of a step."""

    path: str  # relative to the step directory
    rank: int
    node: str
    size: int
    checksum: str
    algorithm: str = CHECKSUM_ALGORITHM
    chunks: tuple[ChunkEntry, ...] = ()


@dataclass(frozen=True)
class Manifest:
    """Everything needed to validate, list and restore one committed step."""

    run_id: str
    step: int
    world_size: int
    created_at: float
    reason: str
    torch_version: str
    library_version: str
    shards: tuple[ShardEntry, ...]
    nodes: Mapping[str, tuple[int, ...]]  # storage domain -> ranks whose shards live there
    node: str  # the storage domain this copy of the manifest belongs to
    dcp_metadata: ChunkEntry  # the DCP ``.metadata`` file of this domain: offset 0, size, checksum
    format: str = "dcp-torch_save"
    schema_version: int = SCHEMA_VERSION
    extra: Mapping[str, Any] = field(default_factory=dict)
    # What produced the step (checkpoint/provenance.py: code version, command line, versions, Slurm job);
    # None in manifests written before it existed. Read with :func:`parse_provenance`: never a reason to
    # refuse a step.
    provenance: Mapping[str, Any] | None = None

    @property
    def first_domain(self) -> str:
        """The domain of the lowest rank: its manifest and metadata become the durable step's."""
        return min(self.nodes, key=lambda d: min(self.nodes[d]) if self.nodes[d] else 1 << 30)

    @property
    def save_id(self) -> tuple[str, int, float]:
        """Identifies one save across domains (a re-save of the same step has another ``created_at``)."""
        return (self.run_id, self.step, self.created_at)

    def as_durable(self) -> Manifest:
        """The durable step's manifest: this (first) domain's, marked durable (deterministic bytes)."""
        from dataclasses import replace

        return replace(self, extra={**dict(self.extra), "durable": {"domains": sorted(self.nodes)}})

    def shards_of_node(self, node: str) -> list[ShardEntry]:
        """Shards stored in storage domain ``node``."""
        return [s for s in self.shards if s.node == node]

    @property
    def total_bytes(self) -> int:
        """Sum of all shard sizes across all domains."""
        return sum(s.size for s in self.shards)

    def to_json(self) -> str:
        """Serialize (stable key order, so identical manifests are identical bytes)."""
        d = asdict(self)
        d["nodes"] = {k: list(v) for k, v in self.nodes.items()}
        return json.dumps(d, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes, *, source: str = "manifest.json") -> Manifest:
        """Parse and validate; errors name ``source`` and the offending field.

        Hostile input is corruption, never a crash: more than :data:`MAX_MANIFEST_BYTES`, nesting deeper
        than Python's recursion limit, NaN or Infinity, a NUL in a name, negative sizes, ranks outside
        the world, a domain list that is empty or does not name this copy's domain."""
        if len(text) > MAX_MANIFEST_BYTES:
            raise CorruptCheckpointError(f"{source}: larger than a manifest may be (more than {MAX_MANIFEST_BYTES} "
                                         "bytes); the step is not usable")
        try:
            d = json.loads(text, parse_constant=_no_constant)
        except RecursionError:
            raise CorruptCheckpointError(f"{source}: nested too deeply to be a manifest; the step is not usable") from None
        except (ValueError, UnicodeDecodeError) as exc:
            raise CorruptCheckpointError(f"{source}: not valid JSON ({_short(exc)}); the step is not usable") from exc
        if not isinstance(d, dict):
            raise CorruptCheckpointError(f"{source}: expected a JSON object, got {type(d).__name__}")
        version = d.get("schema_version")
        if not isinstance(version, int) or isinstance(version, bool):
            raise CorruptCheckpointError(f"{source}: field 'schema_version' missing or not an integer")
        if version > SCHEMA_VERSION:
            raise IncompatibleCheckpointError(
                f"{source}: schema_version {version} is newer than this resilient_slurm understands "
                f"({SCHEMA_VERSION}); upgrade resilient_slurm to read it"
            )
        try:
            shards = tuple(
                ShardEntry(
                    path=_str(s, "path", source),
                    rank=_int(s, "rank", source),
                    node=_str(s, "node", source),
                    size=_int(s, "size", source),
                    checksum=_str(s, "checksum", source),
                    algorithm=_str(s, "algorithm", source),
                    chunks=tuple(_chunk(c, "chunks", source) for c in _list(s, "chunks", source, ())),
                )
                for s in _list(d, "shards", source)
            )
            m = cls(
                run_id=_str(d, "run_id", source),
                step=_int(d, "step", source),
                world_size=_int(d, "world_size", source),
                created_at=_float(d, "created_at", source),
                reason=_str(d, "reason", source),
                torch_version=_str(d, "torch_version", source),
                library_version=_str(d, "library_version", source),
                shards=shards,
                nodes=_nodes(d, source),
                node=_str(d, "node", source),
                dcp_metadata=_chunk(d["dcp_metadata"], "dcp_metadata", source),
                format=_str(d, "format", source),
                schema_version=version,
                extra=_extra(d, source),
                provenance=parse_provenance(d.get("provenance"), source=source),
            )
        except CorruptCheckpointError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CorruptCheckpointError(f"{source}: malformed manifest ({type(exc).__name__}: {_short(exc)})") from exc
        _check(m, source)
        return m


MAX_MANIFEST_BYTES = 256 << 20  # a 4,096-rank FSDP save of 1,000 items per rank is about 400 MB of JSON: not yet


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number a manifest may hold")


def _short(v: Any, n: int = 120) -> str:
    r = str(v)
    return r if len(r) <= n else r[:n] + f"... ({len(r)} characters)"


EMPTY_KEYS = "empty_keys"  # extra: top-level state keys saved with an empty value -> "dict" | "list"


def empty_keys(m: Manifest) -> dict[str, str]:
    """The top-level state keys a step saved as an empty dict or list (``extra["empty_keys"]``); anything
    malformed there is ignored (the step's items do not depend on it)."""
    v = m.extra.get(EMPTY_KEYS)
    if not isinstance(v, dict):
        return {}
    return {k: t for k, t in v.items() if isinstance(k, str) and len(k) <= 256 and t in ("dict", "list")}


PARTIAL = "partial"  # extra: other domains' shard files this copy holds some items of -> [[offset, length], ...]
PARTIAL_SUFFIX = ".partial"  # where: ``<shard path>.partial`` in the step directory, each item at its own offset


def partial_items(m: Manifest) -> dict[str, frozenset[tuple[int, int]]]:
    """The items (offset, length) of shard files of other storage domains that this local copy holds only
    in part (``extra["partial"]``): a resharded fetch (checkpoint/fetch.py) takes from such a file just the
    items its ranks' load plans read, into ``<path>.partial`` at their own offsets (the rest is a hole).
    Only the restore reads them, item by item against the manifest's checksums; every other reader of the
    step (drain, verify, export, replication) sees the file as another domain's, not held here. A path
    that is not another domain's shard, or anything malformed, holds nothing."""
    v = m.extra.get(PARTIAL)
    if not isinstance(v, dict):
        return {}
    others = {s.path: s for s in m.shards if s.node != m.node}
    out: dict[str, frozenset[tuple[int, int]]] = {}
    for path, items in v.items():
        sh = others.get(path)
        if sh is None or not isinstance(items, list):
            continue
        held = {(it[0], it[1]) for it in items if isinstance(it, list) and len(it) == 2
                and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in it)
                and it[0] + it[1] <= sh.size}
        out[path] = frozenset(held)
    return out


def _extra(d: Mapping[str, Any], source: str) -> dict[str, Any]:
    v = d.get("extra", {})
    if not isinstance(v, dict):
        raise CorruptCheckpointError(f"{source}: field 'extra' must be an object, got {type(v).__name__}")
    return dict(v)


# Provenance fields and the JSON types they may hold (checkpoint/provenance.py writes them). A field of
# another type is replaced by None (its neighbours are kept); unknown fields are kept as they are.
_PROVENANCE_FIELDS: dict[str, tuple[type, ...]] = {
    "command_line": (list,), "python": (str,), "torch": (str,), "cuda": (str,), "nccl": (str,),
    "rslurm": (str,), "world_size": (int,), "nodes": (list,), "config_sha256": (str,), "integration": (str,),
}
_PROVENANCE_PARTS: dict[str, dict[str, tuple[type, ...]]] = {
    "code": {"git_commit": (str,), "git_dirty": (bool,), "git_root": (str,), "program": (str,)},
    "slurm": {"job_id": (str,), "array_job_id": (str,), "array_task_id": (str,), "restart_count": (int,),
              "job_nodelist": (str,)},
    "frameworks": {"lightning": (str,), "transformers": (str,), "accelerate": (str,)},
}


def _typed(v: Any, types: tuple[type, ...]) -> Any:
    if v is None or (isinstance(v, bool) and bool not in types):
        return None
    if not isinstance(v, types):
        return None
    if isinstance(v, list) and not all(isinstance(x, str) for x in v):
        return None
    return v


def parse_provenance(v: Any, *, source: str = "manifest.json") -> dict[str, Any] | None:
    """A manifest's ``provenance`` made safe to read: None when absent (older manifests) or not an object
    (warned, naming ``source``); known fields of the wrong type become None. It is descriptive only, so
    a hostile value never makes a step unusable nor a command crash."""
    if v is None:
        return None
    if not isinstance(v, dict):
        log.warning("%s: field 'provenance' is %s, not an object; ignoring it", source, type(v).__name__)
        return None
    out = dict(v)
    for k, types in _PROVENANCE_FIELDS.items():
        out[k] = _typed(v.get(k), types)
    for part, fields in _PROVENANCE_PARTS.items():
        sub = v.get(part)
        out[part] = {k: _typed(sub.get(k), t) for k, t in fields.items()} if isinstance(sub, dict) else None
    return out


def _check(m: Manifest, source: str) -> None:
    """What the types alone do not say: names usable as paths and keys, numbers in range, domains that
    hold the shards."""
    def bad(what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{source}: {what}; the step is not usable")

    names = [("run_id", m.run_id), ("node", m.node), ("reason", m.reason), ("format", m.format)]
    names += [("nodes", n) for n in m.nodes] + [("shards[].path", s.path) for s in m.shards]
    names += [("shards[].node", s.node) for s in m.shards]
    for field_name, v in names:
        if not v or "\0" in v:
            raise bad(f"field {field_name!r} is {'empty' if not v else 'holding a NUL byte'} ({_short(repr(v))})")
    if m.reason not in REASONS:
        raise bad(f"field 'reason' is {_short(repr(m.reason))}, expected one of {REASONS}")
    if not paths.valid_time(m.created_at):
        raise bad(f"field 'created_at' is {m.created_at!r}, not a time (seconds since 1970, before the year 10000)")
    if m.step < 0 or m.world_size < 1:
        raise bad(f"step {m.step} / world_size {m.world_size} out of range")
    if not m.nodes:
        raise bad("field 'nodes' names no storage domain")
    # 'node' is the domain holding this copy: one of 'nodes', or another one for a copy that restore fetched
    # from the durable tier onto other nodes (its shards then name that domain too).
    holders = {*m.nodes, m.node}
    for d, ranks in m.nodes.items():
        if any(not 0 <= r < m.world_size for r in ranks):
            raise bad(f"domain {_short(repr(d))} lists ranks {_short(list(ranks))} outside world size {m.world_size}")
    if m.dcp_metadata.offset != 0 or m.dcp_metadata.length < 0:
        raise bad("field 'dcp_metadata' does not describe a whole file")
    for sh in m.shards:
        if os.path.isabs(sh.path) or ".." in sh.path.split("/"):
            raise bad(f"shard path {_short(repr(sh.path))} escapes the step directory")
        if not 0 <= sh.rank < m.world_size or sh.size < 0 or sh.node not in holders:
            raise bad(f"shard {_short(repr(sh.path))} has rank {sh.rank}, size {sh.size} or domain "
                      f"{_short(repr(sh.node))} out of range")
        if any(c.offset < 0 or c.length < 0 or c.offset + c.length > sh.size for c in sh.chunks):
            raise bad(f"shard {_short(repr(sh.path))} lists an item outside its {sh.size} bytes")


def read_manifest_file(path: str, *, max_bytes: int = MAX_MANIFEST_BYTES) -> Manifest:
    """Read and validate a manifest from the local filesystem (:func:`read_regular_file`: a regular file
    only, never through a link, never more than ``max_bytes``). Raises FileNotFoundError when it is not
    there, CorruptCheckpointError when it is not a manifest, and OSError when it cannot be read."""
    return Manifest.from_json(read_regular_file(path, max_bytes, what="a manifest"), source=path)


def read_regular_file(path: str, max_bytes: int, *, what: str, root: str | None = None) -> bytes:
    """The bytes of a file in a checkpoint tree, read defensively (:func:`resilient_slurm.paths.read_regular`):
    never through a symbolic link (the last component; with ``root``, any component below it), never a
    FIFO or a device (opened non-blocking, checked with ``fstat`` before a byte is read), never more than
    ``max_bytes``. ``what`` names the file's role in messages. Raises FileNotFoundError,
    CorruptCheckpointError (a link, a special file, too big) or OSError."""
    def corrupt(message: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{message}; the step is not usable")

    return paths.read_regular(path, max_bytes, root=root, error=corrupt, what=what,
                              where=f"a checkpoint tree (where {what} goes)")


def _float(d: Mapping[str, Any], key: str, source: str) -> float:
    v = d[key]
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise CorruptCheckpointError(f"{source}: field {key!r} must be a number, got {type(v).__name__}")
    return float(v)


def _list(d: Mapping[str, Any], key: str, source: str, *default: Any) -> list[Any]:
    v = d.get(key, *default) if default else d[key]
    if not isinstance(v, (list, tuple)):
        raise CorruptCheckpointError(f"{source}: field {key!r} must be a list, got {type(v).__name__}")
    return list(v)


def _chunk(c: Any, key: str, source: str) -> ChunkEntry:
    if not isinstance(c, dict) or set(c) != {"offset", "length", "checksum"}:
        raise CorruptCheckpointError(f"{source}: field {key!r}: expected {{offset, length, checksum}}, got {_short(repr(c))}")
    try:
        return ChunkEntry(_int(c, "offset", source), _int(c, "length", source), _str(c, "checksum", source))
    except CorruptCheckpointError as exc:
        raise CorruptCheckpointError(f"{exc} (in field {key!r})") from None


def _nodes(d: Mapping[str, Any], source: str) -> dict[str, tuple[int, ...]]:
    v = d["nodes"]
    if not isinstance(v, dict) or not all(
        isinstance(rs, list) and all(isinstance(r, int) and not isinstance(r, bool) for r in rs) for rs in v.values()
    ):
        raise CorruptCheckpointError(f"{source}: field 'nodes' must map node names to lists of ranks, got {_short(repr(v))}")
    return {str(k): tuple(rs) for k, rs in v.items()}


def _str(d: Mapping[str, Any], key: str, source: str) -> str:
    v = d[key]
    if not isinstance(v, str):
        raise CorruptCheckpointError(f"{source}: field {key!r} must be a string, got {type(v).__name__}")
    return v


def _int(d: Mapping[str, Any], key: str, source: str) -> int:
    v = d[key]
    if not isinstance(v, int) or isinstance(v, bool):
        raise CorruptCheckpointError(f"{source}: field {key!r} must be an integer, got {type(v).__name__}")
    return v


# ---------------------------------------------------------------------------------- durable steps
def durable_steps(tier: StorageTier, run_id: str) -> list[int]:
    """Steps of ``run_id`` committed in the durable tier (root manifest present), ascending. A link or a
    special file where a manifest goes (POSIX) is not a step: warned about and left out."""
    steps = []
    for name in tier.list_dirs(run_id):
        s = parse_step_dirname(name)
        if s is None:
            continue
        try:
            if tier.stat(durable_step_key(run_id, s, MANIFEST_NAME)) is not None:
                steps.append(s)
        except UnsafePathError as exc:
            log.warning("durable step %s of run %s is not usable: %s", name, run_id, exc)
    return sorted(steps)


def durable_partial_steps(tier: StorageTier, run_id: str) -> dict[int, list[str]]:
    """Steps of ``run_id`` in the durable tier that are not committed (no root manifest): each with the
    domain markers drained so far (a drain in progress or abandoned)."""
    committed = set(durable_steps(tier, run_id))
    out = {}
    for name in tier.list_dirs(run_id):
        s = parse_step_dirname(name)
        if s is not None and s not in committed:
            out[s] = tier.list_dirs(durable_step_key(run_id, s, DOMAINS_DIR))
    return out


def read_durable_manifest(tier: StorageTier, run_id: str, step: int, domain: str | None = None) -> Manifest:
    """The durable step's manifest, or one domain's marker manifest when ``domain`` is given."""
    key = (domain_key(run_id, step, domain, MANIFEST_NAME) if domain
           else durable_step_key(run_id, step, MANIFEST_NAME))
    data = tier.get_bytes(key, limit=MAX_MANIFEST_BYTES)  # from_json refuses more than that
    return Manifest.from_json(data, source=f"{tier.url}/{key}")

