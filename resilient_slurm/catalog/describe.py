"""``rslurm show``: what one step holds, from its manifest and its DCP metadata.

Who calls what: ``cli.py`` opens a :class:`~.source.StepSource` for the step and calls :func:`describe`,
which returns a JSON-able dict: the manifest's facts (reason, world size, versions, domains, every
rank's shard, with the bytes it takes on the tier it is read from: :meth:`~.source.StepSource.stored_bytes`),
the state's top-level keys (items, tensors, plain values, bytes, dtypes), the RNG state captured per rank
(which generators), and the data position (a :class:`ResumableSampler` or torchdata's ``StatefulDataLoader``, found by the fields their ``state_dict`` has). Values of the data position are
read from the shards when they can be read in place (local tier, POSIX durable tier), each item
checked against its checksum; from S3 only their presence is shown. Imports torch (DCP metadata).
"""

from __future__ import annotations

import io
import json
import os
import shlex
from typing import Any

from ..checkpoint.state import DDP_KEY, OPTIM_PARAMS_KEY, RNG_KEY
from ..errors import ResilientSlurmError, UnsafePathError
from ..manifest import PER_RANK_PREFIX, empty_keys
from ..storage.fileio import checksum, open_regular
from .source import StepSource

# Fields that identify a data position by its state_dict (a subset is enough).
RESUMABLE_SAMPLER_FIELDS = {"epoch", "consumed", "seed", "num_replicas", "dataset_len"}
STATEFUL_DATALOADER_FIELDS = {"_num_yielded", "_sampler_iter_state"}
POSITION_VALUES = ("epoch", "consumed", "num_replicas", "dataset_len", "_num_yielded")


def _path(md: Any, fqn: str) -> tuple[Any, ...]:
    p = (md.planner_data or {}).get(fqn)
    return tuple(p) if p else (fqn,)


def _read_value(src: StepSource, md: Any, fqn: str) -> tuple[bool, Any]:
    """(found, value) of a small plain item read in place and checked; (False, None) when not readable."""
    import torch
    from torch.distributed.checkpoint.metadata import MetadataIndex

    info = md.storage_data.get(MetadataIndex(fqn))
    if info is None:
        return False, None
    path = src.in_place(info.relative_path)
    entry = src.shards.get(info.relative_path)
    if path is None or entry is None:
        return False, None
    chunk = next((c for c in entry.chunks if c.offset == info.offset and c.length == info.length), None)
    try:  # never through a link, never blocking on a FIFO: a regular file only (verify names anything else)
        fd = open_regular(path, what="a shard file")
    except (OSError, UnsafePathError):
        return False, None
    try:
        data = os.pread(fd, info.length, info.offset)
    except OSError:
        return False, None
    finally:
        os.close(fd)
    if chunk is None or checksum(data) != chunk.checksum:
        return False, None
    try:
        return True, torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception:  # a value the safe loader refuses is not shown (verify/restore report it)
        return False, None


def _plain(v: Any) -> Any:
    """A JSON-able rendering of a small value."""
    try:
        json.dumps(v)
        return v
    except (TypeError, ValueError):
        return repr(v)


def describe(src: StepSource) -> dict[str, Any]:
    """The ``show`` document for one step (see the module docstring)."""
    import torch
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    m = src.manifest
    md = src.metadata()
    keys: dict[str, dict[str, Any]] = {}
    rng: dict[str, set[str]] = {}
    ddp_layout = False
    children: dict[tuple[Any, ...], set[str]] = {}
    for fqn, smd in md.state_dict_metadata.items():
        path = _path(md, fqn)
        top = str(path[0])
        if top == RNG_KEY:
            if len(path) >= 3:
                rng.setdefault(str(path[1]), set()).add(str(path[2]))
            continue
        if top == DDP_KEY:  # DDP's gradient bucket layout, re-applied at the resume
            ddp_layout = True
            continue
        if top == OPTIM_PARAMS_KEY or (top == PER_RANK_PREFIX and len(path) >= 3 and path[2] == OPTIM_PARAMS_KEY):
            continue  # the parameter behind each optimizer index, checked at the restore
        owner = None
        if top == PER_RANK_PREFIX and len(path) >= 3 and str(path[1]).isdigit():  # a rank's own copy: under its key
            owner, top = int(path[1]), str(path[2])
        k = keys.setdefault(top, {"key": top, "items": 0, "tensors": 0, "values": 0, "tensor_bytes": 0,
                                  "dtypes": set(), "per_rank": set()})
        if owner is not None:
            k["per_rank"].add(owner)
        k["items"] += 1
        if isinstance(smd, TensorStorageMetadata):
            k["tensors"] += 1
            dtype = smd.properties.dtype
            k["tensor_bytes"] += torch.Size(smd.size).numel() * torch.empty((), dtype=dtype).element_size()
            k["dtypes"].add(str(dtype).removeprefix("torch."))
        elif isinstance(smd, BytesStorageMetadata):
            k["values"] += 1
        children.setdefault(path[:-1], set()).add(str(path[-1]))
    for top, saved_as in empty_keys(m).items():  # saved as {} or [] (a disabled GradScaler): no items, still a key
        keys.setdefault(top, {"key": top, "items": 0, "tensors": 0, "values": 0, "tensor_bytes": 0,
                              "dtypes": set(), "per_rank": set(), "empty": saved_as})
    positions = []
    notes = []
    for parent, names in sorted(children.items(), key=lambda kv: [str(p) for p in kv[0]]):
        kind = ("ResumableSampler" if RESUMABLE_SAMPLER_FIELDS <= names
                else "StatefulDataLoader" if STATEFUL_DATALOADER_FIELDS <= names else None)
        if kind is None:
            continue
        name = ".".join(str(p) for p in parent)
        values: dict[str, Any] = {}
        for field_name in POSITION_VALUES:
            if field_name in names:
                fqn = ".".join([*(str(p) for p in parent), field_name])
                found, v = _read_value(src, md, fqn)
                if found:
                    values[field_name] = _plain(v)
        if not values:
            notes.append(f"data position {name}: values are not read from {src.tier} tier {src.where} here "
                         "(use `rslurm export` to read them)")
        positions.append({"key": name, "kind": kind, "fields": sorted(names), "values": values})
    ranks_with_rng = sorted(rng, key=lambda r: (len(r), r))
    try:
        stored = src.stored_bytes()
    except ResilientSlurmError as exc:  # the listing failed: the rest of the step can still be shown
        stored = dict.fromkeys(src.shards)
        notes.append(f"stored sizes not listed from {src.tier} tier {src.where}: {exc}")
    return {
        "run_id": m.run_id, "step": m.step, "tier": src.tier, "where": src.where, "reason": m.reason,
        "created_at": m.created_at, "world_size": m.world_size, "bytes": m.total_bytes,
        "stored_bytes": sum(v for v in stored.values() if v is not None) if None not in stored.values() else None,
        "torch_version": m.torch_version, "library_version": m.library_version, "format": m.format,
        "schema_version": m.schema_version,
        "domains": {d: list(r) for d, r in sorted(m.nodes.items())},
        "shards": [{"path": s.path, "rank": s.rank, "domain": s.node, "bytes": s.size,
                    "stored_bytes": stored.get(s.path), "items": len(s.chunks),
                    "checksum": f"{s.algorithm}:{s.checksum}", "reachable": src.in_place(s.path) is not None
                    or src.tier == "durable"} for s in sorted(m.shards, key=lambda x: x.rank)],
        "keys": [{**k, "dtypes": sorted(k["dtypes"]), "per_rank": sorted(k["per_rank"])}
                 for k in sorted(keys.values(), key=lambda x: x["key"])],
        "rng": {"present": bool(rng), "ranks": ranks_with_rng,
                "generators": {r: sorted(g) for r, g in sorted(rng.items())},
                "missing_ranks": [r for r in range(m.world_size) if f"rank{r}" not in rng] if rng else []},
        "data_position": positions,
        "ddp_bucket_layout": ddp_layout,
        "notes": notes,
        "provenance": m.provenance,
        "manifest": json.loads(m.to_json()),
    }


def _or(v: Any, unknown: str = "unknown") -> str:
    return unknown if v is None else str(v)


def provenance_lines(prov: Any) -> list[str]:
    """``show``'s text for a manifest's provenance (already made safe by ``manifest.parse_provenance``)."""
    if not isinstance(prov, dict):
        return ["provenance: none usable (saved by a resilient_slurm before provenance existed, or a damaged "
                "field: a warning names the manifest)"]
    code = prov.get("code") or {}
    slurm = prov.get("slurm") or {}
    flag = code.get("git_dirty")
    dirty = " (uncommitted changes)" if flag is True else " (clean)" if flag is False else ""
    commit = code.get("git_commit")
    out = [f"code: git {commit}{dirty} in {_or(code.get('git_root'))}" if commit
           else "code: not in a git repository (or git unavailable)",
           f"program: {_or(code.get('program'))}",
           "command: " + (shlex.join(prov["command_line"]) if prov.get("command_line") else "unknown"),
           f"python {_or(prov.get('python'))}  torch {_or(prov.get('torch'))}  cuda {_or(prov.get('cuda'), '-')}  "
           f"nccl {_or(prov.get('nccl'), '-')}  resilient_slurm {_or(prov.get('rslurm'))}",
           f"world size {_or(prov.get('world_size'))}  nodes {', '.join(prov.get('nodes') or []) or 'unknown'}"]
    if slurm.get("job_id"):
        array = (f"  array {slurm.get('array_job_id')}_{slurm.get('array_task_id')}"
                 if slurm.get("array_task_id") is not None else "")
        out.append(f"slurm job {slurm['job_id']}{array}  restart {_or(slurm.get('restart_count'))}  "
                   f"nodes {_or(slurm.get('job_nodelist'))}")
    else:
        out.append("slurm: not under Slurm")
    if prov.get("config_sha256"):
        text = json.dumps(prov.get("config"), sort_keys=True)
        out.append(f"config sha256 {prov['config_sha256'][:16]}: "
                   + (text if len(text) <= 400 else text[:400] + f"... ({len(text)} characters; --json has it all)"))
    else:
        out.append("config: none given (Checkpointer(config=...))")
    return out


__all__ = ["describe", "provenance_lines"]
