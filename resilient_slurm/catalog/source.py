"""One step's files, read from the tier chosen for it: manifest, DCP metadata and every shard.

Who calls what: ``show`` and ``export`` call :func:`open_source` with a :class:`~.inventory.StepView`
and the tier :meth:`~.inventory.Catalog.choose_tier` picked, then read :meth:`StepSource.metadata`
(checked against the manifest) and each shard through :meth:`StepSource.file` (a context manager that
yields a local path): local copies and POSIX durable tiers are read in place, other durable tiers (S3)
and compressed objects (:mod:`~resilient_slurm.storage.encoding`) are downloaded (decoded) into a scratch directory (size and xxh3 checked on arrival) and deleted on exit, one
file at a time. :meth:`StepSource.copy` puts a verified copy of a shard at a given path instead.

The metadata used is the first domain's (the lowest rank's): the same bytes the durable tier's root
``.metadata`` holds. It maps every item to a file of the step, wherever that file lives.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..errors import (
    CorruptCheckpointError,
    ObjectNotFoundError,
    StorageError,
    UnsafePathError,
)
from ..manifest import DCP_METADATA_NAME, Manifest, ShardEntry, durable_step_key
from ..storage.encoding import get_shard, is_compressed
from ..storage.fileio import checksum, open_regular
from ..storage.tier import StorageTier
from .inventory import Catalog, StepView

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

Progress = Callable[[int], None]


@dataclass
class StepSource:
    """Where each file of one step can be read (see the module docstring)."""

    run_id: str
    step: int
    tier: str  # local | durable
    where: str  # the step directory of the manifest used, or the durable step's URL
    manifest: Manifest
    metadata_bytes: bytes
    shards: dict[str, ShardEntry]  # every rank's shard, by file name
    local_dirs: dict[str, str] = field(default_factory=dict)  # domain -> local step directory
    durable: StorageTier | None = None
    scratch: str | None = None

    def metadata(self) -> Metadata:
        """The DCP metadata (restricted unpickler; imports torch)."""
        from ..checkpoint.planning import load_metadata

        return load_metadata(self.metadata_bytes, source=f"{self.where}/{DCP_METADATA_NAME}")

    def name(self, rel: str) -> str:
        """The full path or URL of a shard, for messages."""
        if self.tier == "local":
            if rel not in self.shards:  # a file the manifest does not list (a damaged .metadata: verify names it)
                return f"{rel} (not in the manifest of {self.where})"
            d = self.local_dirs.get(self.shards[rel].node)
            return os.path.join(d, rel) if d else f"{rel} (domain {self.shards[rel].node}, not here)"
        return f"{self.where}/{rel}"

    def _key(self, rel: str) -> str:
        return f"{durable_step_key(self.run_id, self.step)}/{rel}"

    def in_place(self, rel: str) -> str | None:
        """A local path of the shard that needs no download (local copy, POSIX tier), or None."""
        if rel not in self.shards:  # a file the manifest does not list: nothing of it is read
            return None
        if self.tier == "local":
            d = self.local_dirs.get(self.shards[rel].node)
            return os.path.join(d, rel) if d else None
        from ..storage.posix import PosixTier

        if isinstance(self.durable, PosixTier) and not is_compressed(self.durable, self._key(rel),
                                                                       self.shards[rel].size):
            return os.path.join(self.durable.root, self._key(rel))
        return None

    def stored_bytes(self) -> dict[str, int | None]:
        """Bytes each shard takes where this step is read from, by file name: the local copy's size, or the
        durable object's (compressed objects are smaller than the file: storage.encoding), from a listing of
        the step's prefix (a shard it does not show is asked for by name); None for a shard that is not there
        or not a regular file. Raises StorageError (and what the tier raises) when one cannot be looked at."""
        out: dict[str, int | None] = {}
        if self.tier == "local" or self.durable is None:
            for rel in self.shards:
                path = self.in_place(rel)
                try:
                    st = os.lstat(path) if path is not None else None
                except FileNotFoundError:
                    st = None
                except OSError as exc:
                    raise StorageError(f"{path}: {exc.strerror or exc}") from exc
                out[rel] = st.st_size if st is not None and stat.S_ISREG(st.st_mode) else None
            return out
        listed = {o.key: o.size for o in self.durable.list(durable_step_key(self.run_id, self.step))}
        for rel in self.shards:
            key = self._key(rel)
            if key in listed:
                out[rel] = listed[key]
            else:  # a listing that could not read a directory says nothing: ask for the object by name
                info = self.durable.stat(key)
                out[rel] = info.size if info is not None else None
        return out

    @contextlib.contextmanager
    def file(self, rel: str, progress: Progress | None = None) -> Iterator[tuple[str, bool]]:
        """A local path holding shard ``rel`` and whether its size and whole-file xxh3 were checked on the
        way (downloads) or not yet (files read in place: check them with ``check_file``)."""
        path = self.in_place(rel)
        if path is not None:
            yield path, False
            return
        if self.tier == "local" or self.durable is None:
            raise CorruptCheckpointError(f"{self.name(rel)}: rank {self.shards[rel].rank}'s shard is not reachable "
                                         "from here")
        from ..checkpoint.verify import durable_file

        try:
            with durable_file(self.durable, self._key(rel), self.shards[rel], scratch=self.scratch,
                              progress=progress) as got:
                yield got
        except ObjectNotFoundError as exc:
            raise CorruptCheckpointError(f"{self.name(rel)}: rank {self.shards[rel].rank}'s shard is missing") from exc

    def copy(self, rel: str, dest: str, progress: Progress | None = None) -> None:
        """Copy shard ``rel`` to local file ``dest`` (atomic, fsynced), checking its size and xxh3 as it
        goes; raises CorruptCheckpointError naming the shard when it does not match the manifest."""
        e = self.shards[rel]
        if self.tier == "local":
            from ..storage.posix import PosixTier

            src = self.in_place(rel)
            if src is None:
                raise CorruptCheckpointError(f"{self.name(rel)}: rank {e.rank}'s shard is not reachable from here")
            try:  # a shard that is missing, a link, a directory or a FIFO is damage in the step, as for torch
                os.close(open_regular(src, what=f"rank {e.rank}'s shard"))
            except FileNotFoundError as exc:
                raise CorruptCheckpointError(f"{src}: rank {e.rank}'s shard is missing") from exc
            except UnsafePathError as exc:
                raise CorruptCheckpointError(str(exc)) from exc
            with PosixTier(os.path.dirname(dest), threads=4) as writer:
                writer.put_file(src, os.path.basename(dest), size=e.size, checksum=e.checksum, progress=progress)
            return
        assert self.durable is not None
        try:
            get_shard(self.durable, self._key(rel), dest, size=e.size, checksum=e.checksum, progress=progress)
        except ObjectNotFoundError as exc:
            raise CorruptCheckpointError(f"{self.name(rel)}: rank {e.rank}'s shard is missing") from exc
        except UnsafePathError as exc:
            raise CorruptCheckpointError(str(exc)) from exc


def open_source(catalog: Catalog, view: StepView, tier: str, *, scratch: str | None = None) -> StepSource:
    """The files of ``view`` in ``tier`` ("local": the valid local copies, the first domain's manifest and
    metadata when it is here; "durable": the committed durable step). Raises CorruptCheckpointError when
    the metadata does not match its manifest."""
    if tier == "local":
        copies = catalog.local_copies_by_domain(view)
        if not copies:
            raise CorruptCheckpointError(f"run {view.run_id} step {view.step}: no valid copy in the local tier "
                                         f"({view.local_state[1] or view.local_state[0]})")
        any_m = next(iter(copies.values())).manifest
        assert any_m is not None
        first = copies.get(any_m.first_domain) or copies.get(catalog.node) or next(iter(copies.values()))
        m = first.manifest
        assert m is not None
        mdpath = os.path.join(first.path, DCP_METADATA_NAME)
        try:  # as verify and restore open it: no link, no FIFO (it would block for good), a regular file
            with os.fdopen(open_regular(mdpath, what="the step's DCP metadata"), "rb") as f:
                md = f.read(m.dcp_metadata.length + 1)
        except FileNotFoundError as exc:
            raise CorruptCheckpointError(f"{mdpath}: missing") from exc
        except UnsafePathError as exc:
            raise CorruptCheckpointError(str(exc)) from exc
        except OSError as exc:
            raise CorruptCheckpointError(f"{mdpath}: cannot be read ({exc.strerror or exc})") from exc
        where, md_where = first.path, mdpath
        dirs = {d: c.path for d, c in copies.items()}
        durable = None
    else:
        assert view.durable is not None and view.durable.manifest is not None and catalog.durable is not None
        m = view.durable.manifest
        where = view.durable.where
        md_where = f"{where}/{DCP_METADATA_NAME}"
        try:
            md = catalog.durable.get_bytes(durable_step_key(view.run_id, view.step, DCP_METADATA_NAME),
                                           limit=m.dcp_metadata.length)
        except ObjectNotFoundError as exc:
            raise CorruptCheckpointError(f"{md_where}: missing") from exc
        except UnsafePathError as exc:  # a link or a FIFO where the metadata goes: the step is damaged
            raise CorruptCheckpointError(str(exc)) from exc
        dirs = {}
        durable = catalog.durable
    if len(md) != m.dcp_metadata.length or checksum(md) != m.dcp_metadata.checksum:
        raise CorruptCheckpointError(f"{md_where}: size or checksum does not match the manifest; run "
                                     f"`rslurm verify {view.step}` for details")
    return StepSource(view.run_id, view.step, tier, where, m, md, {s.path: s for s in m.shards}, dirs,
                      durable, scratch)


__all__ = ["StepSource", "open_source"]
