"""``rslurm export``: one step as a plain ``torch.save`` file, model weights as a safetensors file, or a
self-contained DCP directory.

Who calls what: ``cli.py`` picks the tier (:meth:`~.inventory.Catalog.choose_tier`), opens a
:class:`~.source.StepSource` and calls :func:`export_torch` or :func:`export_dcp`. Both check every byte
they export (size, whole-file xxh3, each item's xxh3) against the manifest and write to a temp name next
to ``out`` that is renamed into place only when everything was written and fsynced: a failure (a
corrupt shard, a full disk, Ctrl-C) leaves no ``out`` and no temp file. An existing ``out`` is replaced
only with ``force`` (after the new one is complete).

* ``torch``: the complete state as nested dicts, as the training loop's ``state`` saw it through
  ``state_dict()`` (module weights, optimizer, scheduler, scaler, sampler, plain values, and the RNG
  state of every rank under ``_rslurm_rng``; values that differed between ranks under
  ``_rslurm_per_rank`` -> rank -> key), tensors as plain CPU tensors (sharded tensors assembled
  from their chunks). Every item is decoded with ``torch.load(weights_only=True)``: nothing in a
  checkpoint runs code, and ``torch.load(out, weights_only=True)`` reads the result. Dict keys are as DCP
  records them (strings), except an optimizer's per-parameter state, keyed by parameter index (0, 1, ...)
  as ``Optimizer.state_dict()`` gives, so ``optimizer.load_state_dict(sd["optimizer"])`` restores its
  moments (DCP's own ``dcp_to_torch_save`` leaves "0", "1", ..., which an optimizer accepts and ignores).
  ``_rslurm_step`` is the step exported (left out with ``keys``, which keeps only those top-level keys, e.g.
  just ``model``).
* ``safetensors``: the model weights alone, for other tools (``safetensors.torch.load_file``): every
  top-level key whose value is a module's state_dict (tensors only; not the optimizer, not rslurm's own
  keys), or the ``keys`` named, assembled like ``torch`` (sharded tensors whole). One key: its tensor
  names as the module has them (``model.load_state_dict(load_file(out))``); several: prefixed with the
  key (``model.0.weight``, ``ema.0.weight``). The file's metadata names the run, the step and the keys.
* ``dcp``: ``.metadata`` (the first domain's, which maps every item to a file of the step), every
  rank's shard from every domain, and the step's durable-style ``manifest.json`` (checksums, for
  ``rslurm``-free tools to check), so plain ``torch.distributed.checkpoint.load`` reads it.
"""

from __future__ import annotations

import io
import mmap
import os
import secrets
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError, CorruptCheckpointError, StorageError
from ..manifest import DCP_METADATA_NAME, MANIFEST_NAME, PER_RANK_PREFIX, empty_keys
from ..storage.fileio import atomic_write, fsync_dir
from .source import StepSource

Progress = Callable[[int], None]
TMP_MARK = ".tmp-rslurm-export-"


@dataclass
class ExportResult:
    """What an export wrote."""

    out: str
    format: str
    run_id: str
    step: int
    tier: str
    bytes_read: int = 0
    files: list[str] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """The result as a JSON-able dict."""
        return {"out": self.out, "format": self.format, "run_id": self.run_id, "step": self.step, "tier": self.tier,
                "bytes_read": self.bytes_read, "files": list(self.files), "keys": list(self.keys)}


def check_out(out: str, *, force: bool, fmt: str) -> str:
    """Refuse an ``out`` that exists (unless ``force``) or that cannot be created; return its absolute path."""
    out = os.path.abspath(out)
    parent = os.path.dirname(out)
    if not os.path.isdir(parent):
        raise ConfigError(f"{parent}: no such directory (the parent of OUT must exist)")
    if os.path.lexists(out):
        if not force:
            raise ConfigError(f"{out} exists; pass --force to replace it (only once the export is complete)")
        if fmt != "dcp" and os.path.isdir(out):
            raise ConfigError(f"{out} is a directory; --format {fmt} writes a file (remove it, or choose another OUT)")
    return out


def check_out_of_trees(out: str, trees: Sequence[tuple[str, str]]) -> None:
    """Refuse an ``out`` inside a tier or run tree, or one that holds one: ``trees`` are (what, path) pairs
    (each local root, a POSIX durable tier's root). Compared by real path, so a link to a tree is one too.
    An export writes its temp file next to ``out`` and, with ``--force``, replaces ``out`` whole: inside a
    run it would delete the run's steps, tags and history. Refused with or without ``--force``."""
    real = os.path.realpath(out)
    for what, tree in trees:
        t = os.path.realpath(tree)
        if real == t or real.startswith(t.rstrip(os.sep) + os.sep):
            raise ConfigError(f"OUT {out} is inside the {what} {tree}: an export never writes into a tier or a run "
                              "(with or without --force); choose an OUT outside it")
        if t.startswith(real.rstrip(os.sep) + os.sep):
            raise ConfigError(f"OUT {out} holds the {what} {tree}: an export never replaces a tier or a run (with "
                              "or without --force); choose an OUT outside it")


def _install(tmp: str, out: str) -> None:
    """Move the finished ``tmp`` to ``out``, replacing what is there (files atomically)."""
    parent = os.path.dirname(out)
    if os.path.isdir(tmp) and os.path.lexists(out):
        aside = f"{out}{TMP_MARK}old-{secrets.token_hex(4)}"
        os.rename(out, aside)
        os.rename(tmp, out)
        fsync_dir(parent)
        if os.path.isdir(aside) and not os.path.islink(aside):
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.unlink(aside)
        return
    os.replace(tmp, out)
    fsync_dir(parent)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _faults(fs: Sequence[Any]) -> str:
    return "; ".join(str(f) for f in fs)


#: The step an export was taken from, in a ``--format torch`` file.
STEP_KEY = "_rslurm_step"


def _optimizer_keys(v: Any) -> None:
    """Key an optimizer's per-parameter state by parameter index (int), as ``Optimizer.state_dict()`` does
    and ``load_state_dict()`` needs (DCP records the keys as strings: loaded as they are, an optimizer
    silently attaches no moments). An optimizer state dict is recognized by its shape: ``state`` and
    ``param_groups``, every group with integer ``params``."""
    if not isinstance(v, dict) or not isinstance(v.get("state"), dict) or not isinstance(v.get("param_groups"), list):
        return
    groups = v["param_groups"]
    if not all(isinstance(g, dict) and isinstance(g.get("params"), list)
               and all(isinstance(i, int) and not isinstance(i, bool) for i in g["params"]) for g in groups):
        return
    if all(isinstance(k, str) and k.isdigit() for k in v["state"]):
        v["state"] = {int(k): st for k, st in sorted(v["state"].items(), key=lambda kv: int(kv[0]))}


def export_torch(src: StepSource, out: str, *, keys: Sequence[str] | None = None,
                 progress: Progress | None = None) -> ExportResult:
    """Write the step's state as one ``torch.save`` file at ``out`` (see the module docstring)."""
    import torch

    sd, res = _assemble(src, out, "torch", keys, progress)
    if not keys and STEP_KEY not in sd:  # --only KEY: what was asked for, nothing more
        sd[STEP_KEY] = src.step

    def write(w: Any) -> None:
        torch.save(sd, w)

    _write_file(out, write)
    return res


def export_safetensors(src: StepSource, out: str, *, keys: Sequence[str] | None = None,
                       progress: Progress | None = None) -> ExportResult:
    """Write the model weights of the step as one safetensors file at ``out`` (see the module docstring)."""
    try:
        from safetensors.torch import save as st_save
    except ImportError:
        raise ConfigError("--format safetensors needs the safetensors package: pip install 'resilient-slurm[export]' "
                          "(or pip install safetensors)") from None
    sd, res = _assemble(src, out, "safetensors", keys, progress)
    chosen = list(keys) if keys else [k for k, v in sd.items() if _weights(k, v)]
    if not chosen:
        raise ConfigError(f"run {src.run_id} step {src.step} holds no module weights (a top-level key whose values "
                          f"are all tensors); its keys are {', '.join(sorted(sd))}: name one with --only KEY")
    tensors: dict[str, Any] = {}
    for k in chosen:
        if not _weights(k, sd[k]) and not _is_tensor(sd[k]):
            raise ConfigError(f"--only {k}: not module weights (it holds more than tensors); safetensors stores "
                              "tensors only: use --format torch for it")
        _flatten(sd[k], "" if len(chosen) == 1 else f"{k}.", tensors, k if len(chosen) == 1 else "")
    res.keys = sorted(chosen)
    meta = {"format": "pt", "rslurm_run_id": src.run_id, "rslurm_step": str(src.step), "rslurm_keys": ",".join(chosen)}
    data = st_save(tensors, metadata=meta)
    _write_file(out, lambda w: w.write(data))
    return res


def _is_tensor(v: Any) -> bool:
    import torch

    return isinstance(v, torch.Tensor)


def _weights(key: str, v: Any) -> bool:
    """A module's state_dict: a (nested) dict with tensors only, not an optimizer's, not rslurm's own."""
    if key.startswith("_rslurm") or not isinstance(v, dict) or not v or ("state" in v and "param_groups" in v):
        return False

    def tensors_only(x: Any) -> bool:
        return all(tensors_only(y) for y in x.values()) if isinstance(x, dict) and x else _is_tensor(x)

    return tensors_only(v)


def _flatten(v: Any, prefix: str, out: dict[str, Any], name: str) -> None:
    """Tensors of ``v`` under dotted names (``prefix`` + path), each contiguous and owning its storage
    (safetensors refuses views and shared storage)."""
    if isinstance(v, dict):
        for k, x in v.items():
            _flatten(x, f"{prefix}{k}.", out, name)
        return
    key = prefix[:-1] if prefix.endswith(".") else (prefix or name)
    t = v.detach().contiguous()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size() or t.storage_offset():
        t = t.clone()
    out[key] = t


def _write_file(out: str, write: Callable[[Any], Any]) -> None:
    """Write ``out`` through ``write(file)`` at a temp name, fsync, rename into place; nothing on failure."""
    tmp = f"{out}{TMP_MARK}{secrets.token_hex(4)}"
    try:
        with open(tmp, "wb") as w:
            write(w)
            w.flush()
            os.fsync(w.fileno())
        _install(tmp, out)
    except BaseException as exc:
        _remove(tmp)
        if isinstance(exc, OSError):
            raise StorageError(f"writing {out} failed: {exc}; nothing was written") from exc
        raise


def _assemble(src: StepSource, out: str, fmt: str, keys: Sequence[str] | None,
              progress: Progress | None) -> tuple[dict[str, Any], ExportResult]:
    """Every item of the step (of ``keys`` only, when given), checked and decoded, as nested dicts."""
    import torch
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        MetadataIndex,
        TensorStorageMetadata,
    )

    from ..checkpoint.verify import check_file, item_names_by_file

    md = src.metadata()
    paths = {fqn: tuple((md.planner_data or {}).get(fqn) or (fqn,)) for fqn in md.state_dict_metadata}

    def key_of(p: tuple[Any, ...]) -> str:  # a rank's own copy counts under its key
        return str(p[2]) if str(p[0]) == PER_RANK_PREFIX and len(p) > 2 else str(p[0])

    empty = empty_keys(src.manifest)  # saved as {} or []: no items, kept all the same
    tops = sorted({key_of(p) for p in paths.values()} | set(empty))
    if keys:
        unknown = sorted(set(keys) - set(tops))
        if unknown:
            raise ConfigError(f"--only {', '.join(unknown)}: not in run {src.run_id} step {src.step}; its keys are "
                              f"{', '.join(tops)}")
        paths = {f: p for f, p in paths.items() if key_of(p) in keys}
    # Every stored piece we need: file -> [(fqn, offset in the tensor or None, offset, length)].
    wanted: dict[str, list[tuple[str, tuple[int, ...] | None, int, int]]] = {}
    for fqn in paths:
        smd = md.state_dict_metadata[fqn]
        pieces = ([(MetadataIndex(fqn, c.offsets), tuple(c.offsets)) for c in smd.chunks]
                  if isinstance(smd, TensorStorageMetadata) else [(MetadataIndex(fqn), None)])
        for idx, offsets in pieces:
            info = md.storage_data.get(idx)
            if info is None:
                raise CorruptCheckpointError(f"{src.where}/{DCP_METADATA_NAME}: {fqn} has no stored data for chunk "
                                             f"{offsets}; the step is incomplete")
            if info.relative_path not in src.shards:
                raise CorruptCheckpointError(f"{src.where}/{DCP_METADATA_NAME}: {fqn} is stored in "
                                             f"{info.relative_path}, a file the manifest does not list")
            wanted.setdefault(info.relative_path, []).append((fqn, offsets, info.offset, info.length))
    names = item_names_by_file(md)
    values: dict[str, Any] = {}
    res = ExportResult(out, fmt, src.run_id, src.step, src.tier, keys=sorted({str(p[0]) for p in paths.values()}))
    for rel in sorted(wanted):
        entry = src.shards[rel]
        with src.file(rel, progress) as (path, checked):
            faults, _ = check_file(path, entry, where=src.name(rel), whole_file=not checked, item_names=names.get(rel),
                                   progress=progress)
            if faults:
                raise CorruptCheckpointError(f"{_faults(faults)}; nothing was written to {out}")
            with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                for fqn, offsets, off, length in wanted[rel]:
                    where = f"{src.name(rel)}: item {fqn!r} (bytes {off}+{length})"
                    try:
                        obj = torch.load(io.BytesIO(mm[off : off + length]), map_location="cpu", weights_only=True)
                    except Exception as exc:
                        raise CorruptCheckpointError(f"{where} cannot be loaded safely ({type(exc).__name__}: {exc})"
                                                     ) from exc
                    smd = md.state_dict_metadata[fqn]
                    if isinstance(smd, BytesStorageMetadata) or offsets is None:
                        values[fqn] = obj
                        continue
                    if not isinstance(obj, torch.Tensor):
                        raise CorruptCheckpointError(f"{where} is a {type(obj).__name__}, the metadata says a tensor")
                    if len(smd.chunks) == 1 and tuple(obj.shape) == tuple(smd.size) and not any(offsets):
                        values[fqn] = obj
                        continue
                    full = values.get(fqn)
                    if full is None:
                        full = values[fqn] = torch.empty(tuple(smd.size), dtype=smd.properties.dtype)
                    dst = full
                    for dim, (o, n) in enumerate(zip(offsets, obj.shape)):
                        dst = dst.narrow(dim, o, n)
                    dst.copy_(obj)
        res.bytes_read += entry.size
        res.files.append(rel)
    sd: dict[str, Any] = {}
    for fqn, path_ in sorted(paths.items(), key=lambda kv: [str(p) for p in kv[1]]):
        set_element(sd, path_, values[fqn])
    for k, kind in sorted(empty.items()):
        if k not in sd and (not keys or k in keys):
            sd[k] = {} if kind == "dict" else []
    for v in sd.values():
        _optimizer_keys(v)
    return sd, res


def export_dcp(src: StepSource, out: str, *, progress: Progress | None = None) -> ExportResult:
    """Write the step as a self-contained DCP checkpoint directory at ``out`` (see the module docstring)."""
    from ..checkpoint.verify import check_file, item_names_by_file

    md = src.metadata()
    names = item_names_by_file(md)
    tmp = f"{out}{TMP_MARK}{secrets.token_hex(4)}"
    res = ExportResult(out, "dcp", src.run_id, src.step, src.tier,
                       keys=sorted({str(((md.planner_data or {}).get(f) or (f,))[0]) for f in md.state_dict_metadata}))
    try:
        os.makedirs(tmp, mode=0o755)
        for rel in sorted(src.shards, key=lambda r: src.shards[r].rank):
            entry = src.shards[rel]
            dest = os.path.join(tmp, rel)
            src.copy(rel, dest, progress)
            faults, _ = check_file(dest, entry, where=src.name(rel), whole_file=False, item_names=names.get(rel))
            if faults:
                raise CorruptCheckpointError(f"{_faults(faults)}; nothing was written to {out}")
            res.bytes_read += entry.size
            res.files.append(rel)
        atomic_write(os.path.join(tmp, DCP_METADATA_NAME), src.metadata_bytes)
        atomic_write(os.path.join(tmp, MANIFEST_NAME), src.manifest.as_durable().to_json().encode())
        res.files += [DCP_METADATA_NAME, MANIFEST_NAME]
        fsync_dir(tmp)
        _install(tmp, out)
    except BaseException as exc:
        _remove(tmp)
        if isinstance(exc, CorruptCheckpointError) and "nothing was written" not in str(exc):
            raise CorruptCheckpointError(f"{exc}; nothing was written to {out}") from exc
        if isinstance(exc, OSError):
            raise StorageError(f"writing {out} failed: {exc}; nothing was written") from exc
        raise
    return res


__all__ = ["ExportResult", "check_out", "export_dcp", "export_torch"]
