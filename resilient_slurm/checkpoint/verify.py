"""Full verification of a committed step directory: manifest, DCP metadata, every shard's size and
checksum (whole file and each item). Used by ``rslurm verify``; restore verifies only what it reads."""

from __future__ import annotations

import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ..errors import ResilientSlurmError
from ..manifest import DCP_METADATA_NAME, MANIFEST_NAME, Manifest, ShardEntry
from ..storage.fileio import checksum
from .planning import load_metadata


@dataclass
class StepReport:
    """Outcome of verifying one step directory in one storage domain."""

    path: str
    step: int | None = None
    manifest: Manifest | None = None
    problems: list[str] = field(default_factory=list)
    bytes_checked: int = 0

    @property
    def ok(self) -> bool:
        """True when nothing is wrong."""
        return not self.problems


def _check_shard(step_dir: str, s: ShardEntry) -> tuple[list[str], int]:
    path = os.path.join(step_dir, s.path)
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        return [f"{path}: shard of rank {s.rank} is missing"], 0
    if size != s.size:
        return [f"{path}: {size} bytes, manifest says {s.size} (truncated or overwritten)"], 0
    if size == 0:
        return ([] if checksum(b"") == s.checksum else [f"{path}: checksum mismatch"]), 0
    problems = []
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        view = memoryview(mm)
        try:
            if checksum(view) != s.checksum:
                problems.append(f"{path}: whole-file checksum mismatch (the file is corrupt)")
            for c in s.chunks:
                if c.offset + c.length > size or checksum(view[c.offset : c.offset + c.length]) != c.checksum:
                    problems.append(f"{path}: checksum mismatch in the item at bytes {c.offset}+{c.length}")
        finally:
            view.release()
    return problems, size


def verify_step_dir(step_dir: str, *, threads: int = 4) -> StepReport:
    """Verify everything in ``step_dir`` that belongs to its storage domain."""
    rep = StepReport(path=step_dir)
    mpath = os.path.join(step_dir, MANIFEST_NAME)
    try:
        with open(mpath, "rb") as f:
            rep.manifest = Manifest.from_json(f.read(), source=mpath)
    except FileNotFoundError:
        rep.problems.append(f"{mpath}: missing (the step is not committed)")
        return rep
    except ResilientSlurmError as exc:
        rep.problems.append(str(exc))
        return rep
    m = rep.manifest
    rep.step = m.step
    mdpath = os.path.join(step_dir, DCP_METADATA_NAME)
    try:
        with open(mdpath, "rb") as f:
            md_bytes = f.read()
        if len(md_bytes) != m.dcp_metadata.length or checksum(md_bytes) != m.dcp_metadata.checksum:
            rep.problems.append(f"{mdpath}: size or checksum does not match the manifest")
        else:
            load_metadata(md_bytes, source=mdpath)
    except FileNotFoundError:
        rep.problems.append(f"{mdpath}: missing")
    except ResilientSlurmError as exc:
        rep.problems.append(str(exc))
    with ThreadPoolExecutor(max_workers=threads) as pool:
        for problems, n in pool.map(lambda s: _check_shard(step_dir, s), m.shards_of_node(m.node)):
            rep.problems.extend(problems)
            rep.bytes_checked += n
    return rep
