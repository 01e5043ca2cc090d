"""Manifest schema, on-disk layout names and validation (the contract that tools read).

Layout of one tier::

    <root>/<run_id>/step_<step:012d>/            committed: manifest.json present (written last)
    <root>/<run_id>/step_<step:012d>.tmp-<tok>/  in progress or abandoned; never read, removed by GC

The manifest is JSON (never pickle), versioned by ``schema_version``. A reader refuses versions newer
than it knows, and names the file and the field when anything is malformed.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from .errors import CorruptCheckpointError, IncompatibleCheckpointError

SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"
DCP_METADATA_NAME = ".metadata"
CHECKSUM_ALGORITHM = "xxh3_64"
REASONS = ("interval", "emergency", "final", "manual")

_STEP_RE = re.compile(r"^step_(\d{12})$")
_TMP_RE = re.compile(r"^step_(\d{12})\.tmp-[A-Za-z0-9_.-]+$")


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
        """Parse and validate; errors name ``source`` and the offending field."""
        try:
            d = json.loads(text)
        except (ValueError, UnicodeDecodeError) as exc:
            raise CorruptCheckpointError(f"{source}: not valid JSON ({exc}); the step is not usable") from exc
        if not isinstance(d, dict):
            raise CorruptCheckpointError(f"{source}: expected a JSON object, got {type(d).__name__}")
        version = d.get("schema_version")
        if not isinstance(version, int):
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
                    chunks=tuple(ChunkEntry(**c) for c in s.get("chunks", ())),
                )
                for s in d["shards"]
            )
            m = cls(
                run_id=_str(d, "run_id", source),
                step=_int(d, "step", source),
                world_size=_int(d, "world_size", source),
                created_at=float(d["created_at"]),
                reason=_str(d, "reason", source),
                torch_version=_str(d, "torch_version", source),
                library_version=_str(d, "library_version", source),
                shards=shards,
                nodes={str(k): tuple(int(r) for r in v) for k, v in d["nodes"].items()},
                node=_str(d, "node", source),
                dcp_metadata=ChunkEntry(**d["dcp_metadata"]),
                format=_str(d, "format", source),
                schema_version=version,
                extra=dict(d.get("extra", {})),
            )
        except CorruptCheckpointError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CorruptCheckpointError(f"{source}: malformed manifest ({type(exc).__name__}: {exc})") from exc
        if m.reason not in REASONS:
            raise CorruptCheckpointError(f"{source}: field 'reason' is {m.reason!r}, expected one of {REASONS}")
        for s in m.shards:
            if os.path.isabs(s.path) or ".." in s.path.split("/"):
                raise CorruptCheckpointError(f"{source}: shard path {s.path!r} escapes the step directory")
        return m


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
