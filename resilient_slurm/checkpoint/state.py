"""Turning the user's ``state`` dict into a DCP state_dict and back.

* values with ``state_dict()``/``load_state_dict()`` (modules, optimizers, schedulers, GradScaler,
  samplers, StatefulDataLoader, user objects) are captured through them;
* tensors are saved as they are and restored in place;
* plain values (numbers, strings, lists, dicts) are saved and put back into the dict;
* per-rank RNG state lives under ``_rslurm_rng.rank<r>``; ranks never collide on it;
* anything else under one key on several ranks is written once only when its copies are proven equal
  (replication.py); otherwise each rank's copy is stored under ``_rslurm_per_rank.<r>.<key>`` and
  restored to that rank (:func:`prepare_load_target` shapes the target from that copy).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

try:  # DCP's own parameter naming (a private helper): imported once here, not on the first restore's path
    from torch.distributed.checkpoint.state_dict import _get_fqns
except ImportError:  # pragma: no cover - an internal of DCP moved: the names as the modules give them
    _get_fqns = None  # type: ignore[assignment]

from ..errors import ConfigError
from ..manifest import per_rank_fqn, per_rank_path, split_per_rank_fqn
from . import rng

log = logging.getLogger(__name__)

RNG_KEY = "_rslurm_rng"
DDP_KEY = "_rslurm_ddp"  # DDP's gradient bucket layouts (checkpoint/ddp.py), a JSON string
# The parameter behind each index of every optimizer in the state (a JSON string: key -> names in
# ``state_dict()`` order): an optimizer's own state_dict keys its state by index, so a restore into a model
# split differently (another pipeline split, interleaved stages) would load moments into other parameters.
OPTIM_PARAMS_KEY = "_rslurm_optim_params"
RESERVED_KEYS = (RNG_KEY, DDP_KEY, OPTIM_PARAMS_KEY)  # not the user's: compared, shown and exported by their own rules
RESERVED_PREFIX = "_rslurm"


def _stateful(v: Any) -> bool:
    return callable(getattr(v, "state_dict", None)) and callable(getattr(v, "load_state_dict", None))


def check_state(state: Mapping[str, Any]) -> None:
    """Reject what cannot be captured, naming the key."""
    if not isinstance(state, Mapping):
        raise ConfigError(f"state must be a dict of name -> object, got {type(state).__name__}")
    for k in state:
        if not isinstance(k, str):
            raise ConfigError(f"state keys must be strings, got {k!r} ({type(k).__name__})")
        if k.startswith(RESERVED_PREFIX):
            raise ConfigError(f"state key {k!r}: names starting with {RESERVED_PREFIX!r} are reserved")
        if "." in k:
            raise ConfigError(f"state key {k!r}: '.' separates nested names in checkpoints; use another name")


def overlapping_tensors(flat: Mapping[str, Any]) -> list[str]:
    """The keys of a flattened state dict whose tensor has elements that share memory: a dimension of stride 0
    and size over 1, as ``expand()`` and broadcasting make (a DTensor: its local tensor). Such a tensor saves,
    but no restore can write into it (one memory location would take several saved values)."""
    out = []
    for key, v in flat.items():
        to_local = getattr(v, "to_local", None)
        t = to_local() if callable(to_local) and isinstance(v, torch.Tensor) else v
        if (isinstance(t, torch.Tensor) and t.layout == torch.strided
                and any(st == 0 and n > 1 for n, st in zip(t.shape, t.stride()))):
            out.append(key)
    return out


def build_state_dict(state: Mapping[str, Any], *, rank: int, capture_rng: bool) -> dict[str, Any]:
    """The DCP state_dict for ``state`` (aliases live tensors; staging copies them)."""
    check_state(state)
    sd: dict[str, Any] = {}
    for k, v in state.items():
        sd[k] = v.state_dict() if _stateful(v) else v
    names = optimizer_param_names(state)
    if names:
        sd[OPTIM_PARAMS_KEY] = json.dumps(names, sort_keys=True)
    if capture_rng:
        sd[RNG_KEY] = {f"rank{rank}": rng.capture_rng_state()}
    return sd


def optimizer_param_names(state: Mapping[str, Any]) -> dict[str, list[str | None]]:
    """For each optimizer in ``state``, the name of the parameter behind each index of its ``state_dict()``:
    ``<key>.<name>`` of the first module in ``state`` that holds it, as DCP names it (no DDP ``module.``,
    ``torch.compile`` or activation-checkpointing prefixes); None for a parameter no module in ``state``
    holds. Empty when the state has no optimizer or no module."""
    modules = {k: v for k, v in state.items() if isinstance(v, torch.nn.Module)}
    optims = {k: v for k, v in state.items() if isinstance(v, torch.optim.Optimizer)}
    if not modules or not optims:
        return {}
    names: dict[int, str] = {}
    for k, m in modules.items():
        for n, p in m.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), f"{k}.{_canonical_name(m, n)}")
    return {k: [names.get(id(p)) for g in o.param_groups for p in g["params"]] for k, o in optims.items()}


def _canonical_name(module: torch.nn.Module, name: str) -> str:
    if _get_fqns is None:  # pragma: no cover
        return name
    try:
        fqns = _get_fqns(module, name)
        return next(iter(fqns)) if len(fqns) == 1 else name
    except Exception:  # an internal of DCP changed: the name as the module gives it
        return name


def moved_parameters(state: Mapping[str, Any], saved: str, *, skip: Sequence[str] = ()) -> dict[str, str]:
    """Optimizers of ``state`` (but ``skip``) whose parameters at some index are not those saved at that index
    (``saved``: the checkpoint's :data:`OPTIM_PARAMS_KEY`), each with a description of the first difference.
    An optimizer or a parameter the checkpoint did not name is not compared."""
    try:
        before = json.loads(saved)
    except (TypeError, ValueError, RecursionError):  # not what a save wrote: nothing to compare
        return {}
    if not isinstance(before, dict):
        return {}
    out: dict[str, str] = {}
    for k, now in optimizer_param_names(state).items():
        was = before.get(k)
        if k in skip or not isinstance(was, list):
            continue
        if len(was) != len(now):
            out[k] = f"it had {len(was)} parameters, now {len(now)}"
            continue
        for i, (a, b) in enumerate(zip(was, now)):
            if a is not None and b is not None and a != b:
                out[k] = f"index {i} was {a}, is now {b}"
                break
    return out


def prepare_load_target(
    state: Mapping[str, Any], metadata: Metadata, *, rank: int, capture_rng: bool, source_rank: int | None = None,
    extra_keys: tuple[str, ...] = (),
) -> dict[str, Any]:
    """A state_dict to load into: live tensors where possible, fresh ones for state not yet created.

    ``source_rank`` is the rank whose per-rank copies (and RNG state) this rank loads (default: its
    own). ``extra_keys`` are reserved plain values to load too when the checkpoint has them.
    Optimizers that have not stepped yet have no moment tensors to load into; like DCP's
    ``set_state_dict`` we initialize them with a zero-lr step first.
    """
    src = rank if source_rank is None else source_rank
    for k, v in state.items():
        if isinstance(v, torch.optim.Optimizer) and not v.state:
            if any(fqn.startswith(f"{k}.state.") or (split_per_rank_fqn(fqn) or (0, ""))[1].startswith(f"{k}.state.")
                   for fqn in metadata.state_dict_metadata):
                from torch.distributed.checkpoint.state_dict import _init_optim_state

                _init_optim_state(v)
    sd = build_state_dict(state, rank=rank, capture_rng=False)
    for k, v in state.items():
        if not _stateful(v) and not isinstance(v, torch.Tensor):
            # Plain values are replaced wholesale: shape the target like what was saved. One that was not
            # saved keeps its live value here; the compatibility check (compat.py) reports it as missing.
            shaped = _plain_target(k, metadata, src)
            if shaped is not _NOT_SAVED:
                sd[k] = shaped
    for k in (*extra_keys, OPTIM_PARAMS_KEY):
        if k in metadata.state_dict_metadata or per_rank_fqn(src, k) in metadata.state_dict_metadata:
            sd[k] = None
    if capture_rng:
        saved = {tuple(path): fqn for fqn, path in (metadata.planner_data or {}).items()
                 if tuple(path[:2]) == (RNG_KEY, f"rank{src}") and len(path) > 2}
        if saved:
            # Shaped like what was saved, from the metadata (RNG tensors differ in size across devices and
            # versions): capturing this process's generators would only give a template to read into.
            sd[RNG_KEY] = _shaped_like(metadata, saved)[RNG_KEY]
        else:
            log.warning(
                "checkpoint has no RNG state for rank %d (saved with a smaller world size or without "
                "RNG capture); this rank keeps its current RNG state",
                src,
            )
    return sd


_NOT_SAVED = object()


def _plain_target(key: str, md: Metadata, src: int) -> Any:
    """A target shaped like plain value ``key`` as saved: shared entries, or rank ``src``'s own copies;
    ``_NOT_SAVED`` when the checkpoint does not hold ``key``."""
    paths: dict[tuple[Any, ...], str] = {}
    for fqn, path in (md.planner_data or {}).items():
        if not path:
            continue
        own = per_rank_path(src, (key,))
        if path[0] == key or tuple(path[: len(own)]) == own:
            paths[tuple(path) if path[0] == key else tuple(path[len(own) - 1:])] = fqn
    if not paths:
        return _NOT_SAVED
    return _shaped_like(md, paths)[key]


def _shaped_like(md: Metadata, paths: Mapping[tuple[Any, ...], str]) -> dict[str, Any]:
    """A nested target with an entry at each of ``paths`` (path -> the saved key it is read from): an empty
    tensor of the saved size and dtype for a tensor, None for a plain value (read whole)."""
    root: dict[str, Any] = {}
    for path, fqn in sorted(paths.items(), key=lambda kv: [str(p) for p in kv[0]]):
        smd = md.state_dict_metadata.get(fqn)
        value: Any = None
        if isinstance(smd, TensorStorageMetadata):
            value = torch.empty(smd.size, dtype=smd.properties.dtype)
        set_element(root, path, value)
    return root


def apply_loaded(state: MutableMapping[str, Any], loaded: Mapping[str, Any], *, rank: int) -> None:
    """Push a loaded state_dict back into the user's objects and dict (``rank``: whose RNG state was loaded)."""
    for k, v in list(state.items()):
        if k not in loaded:
            continue
        new = loaded[k]
        if _stateful(v):
            if isinstance(v, torch.nn.Module) and _all_tensors(new):
                continue  # module tensors were loaded in place into its parameters and buffers
            v.load_state_dict(new)
        elif isinstance(v, torch.Tensor):
            if new is not v:
                with torch.no_grad():
                    v.copy_(new)
        else:
            state[k] = new
    r = loaded.get(RNG_KEY, {}).get(f"rank{rank}")
    if r is not None:
        rng.restore_rng_state(r)


def empty_state_keys(sd: Mapping[str, Any], planner: Any) -> dict[str, str]:
    """Top-level keys of a state_dict whose value is an empty dict or list (a disabled GradScaler's
    ``{}``) and for which the save ``planner`` (set up on ``sd``) has no item: the manifest names them
    (``EMPTY_KEYS``) for ``rslurm show`` and ``rslurm export`` to keep them. Values: "dict" or "list"."""
    stored = {str(path[0]) for path in getattr(planner, "mappings", {}).values() if path}
    return {k: "dict" if isinstance(v, Mapping) else "list" for k, v in sd.items()
            if isinstance(k, str) and isinstance(v, (Mapping, list, tuple)) and not v and k not in stored}


def _all_tensors(d: Any) -> bool:
    if isinstance(d, Mapping):
        return all(_all_tensors(x) for x in d.values())
    return isinstance(d, torch.Tensor)
