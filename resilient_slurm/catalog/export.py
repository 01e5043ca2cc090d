"""``rslurm export``: one step as a plain ``torch.save`` file, model weights as a safetensors file, a
self-contained DCP directory, or a Hugging Face model directory; each with the step's user config.

Who calls what: ``cli.py`` picks the tier (:meth:`~.inventory.Catalog.choose_tier`), opens a
:class:`~.source.StepSource` and calls :func:`export_torch`, :func:`export_safetensors`,
:func:`export_dcp` or :func:`export_hf`. Each checks every byte
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
* ``hf``: a directory with ``model.safetensors`` (the tensors of the one key named, under the module's own
  names, as ``safetensors`` writes them) and ``config.json`` (the step's user config, which must be a JSON
  object), so ``transformers``' ``from_pretrained(out)`` loads it when the config is the model's
  ``json.loads(model.config.to_json_string())`` (what ``save_pretrained`` writes; ``to_dict()`` has integer
  ``id2label`` keys, which a config refuses).

The user config (``Checkpointer(config=...)``, kept in every manifest's provenance with its sha256) goes
with every export: ``config.json`` inside a directory ``out`` (dcp, hf), ``<out without suffix>.config.json``
beside a file ``out`` (torch, safetensors; :func:`config_path`). Its bytes are the canonical JSON whose
sha256 the manifest records, checked against it before anything is read or written
(:func:`~..checkpoint.provenance.stored_config`: a mismatch is CorruptCheckpointError). The sibling file is
part of the export: refused when it exists unless ``force``, never written through a link (new temp file,
renamed), installed before ``out`` and rolled back if ``out`` cannot be; with ``force`` and a step
without config, a sibling left by an earlier export is removed, so the file beside ``out`` is always the
config of the step in ``out``, or absent.
"""

from __future__ import annotations

import io
import json
import mmap
import os
import secrets
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError, CorruptCheckpointError, StorageError
from ..manifest import DCP_METADATA_NAME, MANIFEST_NAME, PER_RANK_PREFIX, empty_keys
from ..paths import describe_path, is_special
from ..storage.fileio import atomic_write, fsync_dir
from .source import StepSource

Progress = Callable[[int], None]
TMP_MARK = ".tmp-rslurm-export-"
#: Formats that write a directory at OUT (the config goes inside it).
DIR_FORMATS = ("dcp", "hf")
#: The config's name inside a directory export (what ``transformers`` reads).
CONFIG_NAME = "config.json"
#: The weights' name in a ``--format hf`` directory (what ``transformers`` reads for one file).
HF_WEIGHTS_NAME = "model.safetensors"
#: The config a transformers model's ``from_pretrained`` needs, as a user passes it to the Checkpointer.
HF_CONFIG_HINT = "json.loads(model.config.to_json_string())"


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
    config: str | None = None  # where the step's user config was written; None: the step has none
    config_sha256: str | None = None
    config_removed: str | None = None  # a config beside OUT from an earlier export, removed (--force)
    notes: list[str] = field(default_factory=list)  # what the user should know (not errors)

    def to_json(self) -> dict[str, Any]:
        """The result as a JSON-able dict."""
        return {"out": self.out, "format": self.format, "run_id": self.run_id, "step": self.step, "tier": self.tier,
                "bytes_read": self.bytes_read, "files": list(self.files), "keys": list(self.keys),
                "config": self.config, "config_sha256": self.config_sha256, "config_removed": self.config_removed,
                "notes": list(self.notes)}


def config_path(out: str, fmt: str) -> str:
    """Where an export to ``out`` in format ``fmt`` puts the step's config: ``out/config.json`` for a
    directory (dcp, hf), else the sibling ``<out without suffix>.config.json`` (model.pt -> model.config.json)."""
    if fmt in DIR_FORMATS:
        return os.path.join(out, CONFIG_NAME)
    return os.path.splitext(out)[0] + ".config.json"


def output_paths(out: str, fmt: str) -> list[str]:
    """The paths an export writes or replaces outside ``out`` itself included: ``out`` and, for a file
    format, its config sibling (each must pass :func:`check_out_of_trees`). An empty ``out`` is refused (it
    would read as the current directory)."""
    if not out:
        raise ConfigError("OUT is empty: give the path to write the export to")
    out = os.path.abspath(out)
    return [out] if fmt in DIR_FORMATS else [out, config_path(out, fmt)]


def check_out(out: str, *, force: bool, fmt: str) -> str:
    """Refuse an ``out`` that exists (unless ``force``) or that cannot be created; return its absolute path."""
    out = os.path.abspath(out)
    parent = os.path.dirname(out)
    if not os.path.isdir(parent):
        raise ConfigError(f"{parent}: no such directory (the parent of OUT must exist)")
    for path in (out, *([] if fmt in DIR_FORMATS else [config_path(out, fmt)])):
        if is_special(path):  # --force would rename a file over it: /dev/null made a regular file
            raise ConfigError(f"{path} is {describe_path(path)}, not a file an export wrote; give the path of a "
                              "regular file (or a new one), with or without --force")
    if os.path.lexists(out):
        if not force:
            raise ConfigError(f"{out} exists; pass --force to replace it (only once the export is complete)")
        if fmt not in DIR_FORMATS and os.path.isdir(out):
            raise ConfigError(f"{out} is a directory; --format {fmt} writes a file (remove it, or choose another OUT)")
        if fmt in DIR_FORMATS and os.path.isdir(out) and (alien := not_an_export(out, fmt)):
            # --force replaces the directory whole: only an earlier export's, never one that holds anything else.
            shown = ", ".join(alien[:5]) + (f" and {len(alien) - 5} more" if len(alien) > 5 else "")
            raise ConfigError(f"{out} is not an earlier --format {fmt} export (it holds {shown}): --force replaces "
                              "only an export, which replaces the directory whole; remove it yourself, or choose "
                              "another OUT")
    if fmt not in DIR_FORMATS:
        cfg = config_path(out, fmt)
        if os.path.lexists(cfg):
            if not force:
                raise ConfigError(f"{cfg} exists: an export to {out} writes the step's config there; pass --force "
                                  "to replace it (only once the export is complete; removed when the step has no "
                                  "config), or choose another OUT")
            if os.path.isdir(cfg):
                raise ConfigError(f"{cfg} is a directory: an export to {out} writes the step's config file there "
                                  "(remove it, or choose another OUT)")
    return out


def not_an_export(out: str, fmt: str) -> list[str]:
    """The entries of directory ``out`` that an export in ``fmt`` does not write (sorted; [] for an empty
    directory or an earlier export): dcp writes ``.metadata``, ``manifest.json``, ``config.json`` and
    ``*.distcp`` files, hf ``model.safetensors`` and ``config.json``; each a regular file."""
    names = {"dcp": {DCP_METADATA_NAME, MANIFEST_NAME, CONFIG_NAME}, "hf": {HF_WEIGHTS_NAME, CONFIG_NAME}}[fmt]
    alien = []
    try:
        with os.scandir(out) as it:
            for e in it:
                ours = e.name in names or (fmt == "dcp" and e.name.endswith(".distcp"))
                if not ours or not e.is_file(follow_symlinks=False):
                    alien.append(e.name)
    except OSError as exc:
        raise ConfigError(f"{out}: cannot read what it holds ({exc.strerror or exc}); --force replaces only an "
                          "earlier export: choose another OUT") from exc
    return sorted(alien)


def check_out_of_trees(out: str, trees: Sequence[tuple[str, str]], *, flag: str = "OUT",
                       who: str = "an export") -> None:
    """Refuse an ``out`` inside a tier or run tree, or one that holds one: ``trees`` are (what, path) pairs
    (each local root, a POSIX durable tier's root). Compared by real path, so a link to a tree is one too.
    An export writes its temp file next to ``out`` and, with ``--force``, replaces ``out`` whole: inside a
    run it would delete the run's steps, tags and history. Refused with or without ``--force``. ``flag`` and
    ``who`` name the argument and the command in the error (``rslurm report --out`` checks its picture too)."""
    real = os.path.realpath(out)
    force = " (with or without --force)" if flag == "OUT" else ""
    for what, tree in trees:
        t = os.path.realpath(tree)
        if real == t or real.startswith(t.rstrip(os.sep) + os.sep):
            raise ConfigError(f"{flag} {out} is inside the {what} {tree}: {who} never writes into a tier or a run"
                              f"{force}; choose an {flag} outside it")
        if t.startswith(real.rstrip(os.sep) + os.sep):
            raise ConfigError(f"{flag} {out} holds the {what} {tree}: {who} never replaces a tier or a run"
                              f"{force}; choose an {flag} outside it")


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


def _step_config(src: StepSource, out: str) -> tuple[str | None, str | None]:
    """The step's user config as the canonical JSON its manifest's sha256 covers (checked) and that sha256,
    or (None, None) when it has none; CorruptCheckpointError naming the step and the manifest when it does
    not match."""
    from ..checkpoint.provenance import stored_config

    where = (os.path.join(src.where, MANIFEST_NAME) if src.tier == "local" else f"{src.where}/{MANIFEST_NAME}")
    try:
        text = stored_config(src.manifest.provenance, where=where)
    except CorruptCheckpointError as exc:
        raise CorruptCheckpointError(f"run {src.run_id} step {src.step}: {exc}; nothing was written to {out}") from None
    if text is None:
        return None, None
    return text, (src.manifest.provenance or {}).get("config_sha256")


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

    config, sha = _step_config(src, out)  # before anything is read
    sd, res = _assemble(src, out, "torch", keys, progress)
    res.config_sha256 = sha
    if not keys and STEP_KEY not in sd:  # --only KEY: what was asked for, nothing more
        sd[STEP_KEY] = src.step

    def write(w: Any) -> None:
        torch.save(sd, w)

    _write_file(out, write, config, res)
    return res


def export_safetensors(src: StepSource, out: str, *, keys: Sequence[str] | None = None,
                       progress: Progress | None = None) -> ExportResult:
    """Write the model weights of the step as one safetensors file at ``out`` (see the module docstring)."""
    st_save = _safetensors_save("safetensors")
    config, sha = _step_config(src, out)  # before anything is read
    sd, res = _assemble(src, out, "safetensors", keys, progress)
    res.config_sha256 = sha
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
    _write_file(out, lambda w: w.write(data), config, res)
    return res


def _safetensors_save(fmt: str) -> Callable[..., bytes]:
    try:
        from safetensors.torch import save as st_save
    except ImportError:
        raise ConfigError(f"--format {fmt} needs the safetensors package: pip install 'resilient-slurm[export]' "
                          "(or pip install safetensors)") from None
    return st_save  # type: ignore[no-any-return]


def _not_weights(key: str, v: Any) -> str:
    """Why ``v`` (top-level key ``key``) is not a module's state_dict, for an error message."""
    if key.startswith("_rslurm"):
        return "it is resilient_slurm's own key"
    if _is_tensor(v):
        return "it is a single tensor, not a module's state_dict"
    if not isinstance(v, dict):
        return f"it holds a {type(v).__name__}, not a module's state_dict"
    if "state" in v and "param_groups" in v:
        return "it is an optimizer's state"
    if not v:
        return "it is empty"

    def first_other(x: Any, path: str) -> str | None:
        if isinstance(x, dict) and x:
            for k, y in x.items():
                found = first_other(y, f"{path}.{k}" if path else str(k))
                if found:
                    return found
            return None
        return None if _is_tensor(x) else f"{path or key} is {'an empty dict' if isinstance(x, dict) else type(x).__name__}"

    return f"it holds more than tensors ({first_other(v, '')})"


def export_hf(src: StepSource, out: str, *, key: str, progress: Progress | None = None) -> ExportResult:
    """Write a Hugging Face model directory at ``out``: ``model.safetensors`` with the tensors of top-level
    key ``key`` under the module's own names, and ``config.json``, the step's user config (see the module
    docstring). Refused (ConfigError, nothing read) when the step has no config or it is not a JSON object."""
    st_save = _safetensors_save("hf")
    config, sha = _step_config(src, out)
    if config is None:
        raise ConfigError(f"run {src.run_id} step {src.step} was saved without a config: --format hf writes the "
                          "config as config.json, which transformers needs (save with "
                          f"Checkpointer(..., config={HF_CONFIG_HINT})); for the weights alone use --format "
                          f"safetensors --only {key}")
    value = json.loads(config)
    if not isinstance(value, dict):
        kind = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean"}.get(
            type(value), "null")
        raise ConfigError(f"run {src.run_id} step {src.step}: its config is {kind} in JSON, not an "
                          "object: transformers reads config.json as an object holding the model's settings and its "
                          f"model_type (save with Checkpointer(..., config={HF_CONFIG_HINT})); --format torch "
                          "or safetensors write this config as it is")
    sd, res = _assemble(src, out, "hf", [key], progress)
    res.config_sha256 = sha
    if not _weights(key, sd[key]):
        raise ConfigError(f"--only {key}: {_not_weights(key, sd[key])}; --format hf writes one module's weights "
                          "(a state_dict of tensors only), e.g. --only model; use --format torch for the rest")
    tensors: dict[str, Any] = {}
    _flatten(sd[key], "", tensors, key)
    meta = {"format": "pt", "rslurm_run_id": src.run_id, "rslurm_step": str(src.step), "rslurm_keys": key}
    data = st_save(tensors, metadata=meta)
    del sd, tensors
    if not isinstance(value.get("model_type"), str):
        res.notes.append("the config has no model_type: transformers' Auto classes (AutoModelForCausalLM, ...) "
                         "cannot tell the model from it; load it with the model's own class "
                         f"(e.g. GPT2LMHeadModel.from_pretrained), or save config={HF_CONFIG_HINT}")
    tmp = f"{out}{TMP_MARK}{secrets.token_hex(4)}"
    try:
        os.makedirs(tmp, mode=0o755)
        _write_new(os.path.join(tmp, HF_WEIGHTS_NAME), data)
        _write_new(os.path.join(tmp, CONFIG_NAME), config.encode())
        fsync_dir(tmp)
        _install(tmp, out)
    except BaseException as exc:
        _remove(tmp)
        if isinstance(exc, OSError):
            raise StorageError(f"writing {out} failed: {exc}; nothing was written") from exc
        raise
    res.config = os.path.join(out, CONFIG_NAME)
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


def _new_file(path: str) -> Any:
    """A new file at ``path`` for writing, never an existing one nor through a link (O_EXCL, O_NOFOLLOW)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o666)
    return os.fdopen(fd, "wb")


def _write_new(path: str, data: bytes) -> None:
    with _new_file(path) as w:
        w.write(data)
        w.flush()
        os.fsync(w.fileno())


def _temp_beside(path: str, write: Callable[[Any], Any]) -> str:
    """A new temp file next to ``path`` written through ``write(file)`` and fsynced; its name."""
    tmp = f"{path}{TMP_MARK}{secrets.token_hex(4)}"
    try:
        with _new_file(tmp) as w:
            write(w)
            w.flush()
            os.fsync(w.fileno())
    except BaseException:
        _remove(tmp)
        raise
    return tmp


def _write_file(out: str, write: Callable[[Any], Any], config: str | None, res: ExportResult) -> None:
    """Write ``out`` through ``write(file)`` and the step's ``config`` (canonical JSON, or None) to its
    sibling (:func:`config_path`), each at a temp name, fsynced, then renamed into place: the config first,
    ``out`` last (atomically replacing an old one). On failure nothing new is left and an old config is put
    back. With no config, a sibling from an earlier export (check_out allowed it: ``--force``) is removed."""
    cfg = config_path(out, res.format)
    tmps: list[str] = []
    aside: str | None = None
    placed = False
    try:
        if config is not None:
            tmps.append(_temp_beside(cfg, lambda w: w.write(config.encode())))
        tmps.append(_temp_beside(out, write))
        if os.path.lexists(cfg):
            aside = f"{cfg}{TMP_MARK}old-{secrets.token_hex(4)}"
            os.rename(cfg, aside)
        if config is not None:
            os.rename(tmps[0], cfg)
            placed = True
        os.replace(tmps[-1], out)
    except BaseException as exc:
        if placed:
            _remove(cfg)
        if aside is not None:
            try:
                os.rename(aside, cfg)
            except OSError:
                pass
        for t in tmps:
            _remove(t)
        if isinstance(exc, OSError):
            raise StorageError(f"writing {out} failed: {exc}; nothing was written") from exc
        raise
    fsync_dir(os.path.dirname(out))
    if aside is not None:
        _remove(aside)
        if config is None:
            res.config_removed = cfg
    res.config = cfg if config is not None else None


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

    config, sha = _step_config(src, out)  # before anything is read
    if config is not None and CONFIG_NAME in src.shards:
        raise CorruptCheckpointError(f"run {src.run_id} step {src.step}: the manifest names a shard {CONFIG_NAME}, "
                                     f"the name of the config in a DCP export; nothing was written to {out}")
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
        if config is not None:
            atomic_write(os.path.join(tmp, CONFIG_NAME), config.encode())
            res.files.append(CONFIG_NAME)
        fsync_dir(tmp)
        _install(tmp, out)
    except BaseException as exc:
        _remove(tmp)
        if isinstance(exc, CorruptCheckpointError) and "nothing was written" not in str(exc):
            raise CorruptCheckpointError(f"{exc}; nothing was written to {out}") from exc
        if isinstance(exc, OSError):
            raise StorageError(f"writing {out} failed: {exc}; nothing was written") from exc
        raise
    res.config_sha256 = sha
    res.config = os.path.join(out, CONFIG_NAME) if config is not None else None
    return res


__all__ = ["CONFIG_NAME", "DIR_FORMATS", "ExportResult", "check_out", "check_out_of_trees", "config_path",
           "export_dcp", "export_hf", "export_safetensors", "export_torch", "output_paths"]
