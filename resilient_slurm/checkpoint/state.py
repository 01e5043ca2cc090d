"""Turning the user's ``state`` dict into a DCP state_dict and back.

* values with ``state_dict()``/``load_state_dict()`` (modules, optimizers, schedulers, GradScaler,
  samplers, StatefulDataLoader, user objects) are captured through them;
* tensors are saved as they are and restored in place;
* plain values (numbers, strings, lists, dicts) are saved and put back into the dict;
* per-rank RNG state lives under ``_rslurm_rng.rank<r>``; ranks never collide on it.

Everything else in a DCP state_dict with the same key on several ranks is taken to be replicated
(DDP) or a DTensor (sharded); that is DCP's contract and ours.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, MutableMapping
from typing import Any

import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from ..errors import ConfigError, IncompatibleCheckpointError
from . import rng

log = logging.getLogger(__name__)

RNG_KEY = "_rslurm_rng"
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


def build_state_dict(state: Mapping[str, Any], *, rank: int, capture_rng: bool) -> dict[str, Any]:
    """The DCP state_dict for ``state`` (aliases live tensors; staging copies them)."""
    check_state(state)
    sd: dict[str, Any] = {}
    for k, v in state.items():
        sd[k] = v.state_dict() if _stateful(v) else v
    if capture_rng:
        sd[RNG_KEY] = {f"rank{rank}": rng.capture_rng_state()}
    return sd


def prepare_load_target(
    state: Mapping[str, Any], metadata: Metadata, *, rank: int, capture_rng: bool
) -> dict[str, Any]:
    """A state_dict to load into: live tensors where possible, fresh ones for state not yet created.

    Optimizers that have not stepped yet have no moment tensors to load into; like DCP's
    ``set_state_dict`` we initialize them with a zero-lr step first.
    """
    for k, v in state.items():
        if isinstance(v, torch.optim.Optimizer) and not v.state:
            if any(fqn.startswith(f"{k}.state.") for fqn in metadata.state_dict_metadata):
                from torch.distributed.checkpoint.state_dict import _init_optim_state

                _init_optim_state(v)
    sd = build_state_dict(state, rank=rank, capture_rng=False)
    for k, v in state.items():
        if not _stateful(v) and not isinstance(v, torch.Tensor):
            # Plain values are replaced wholesale: shape the target like what was saved.
            sd[k] = _plain_target(k, metadata)
    if capture_rng:
        prefix = f"{RNG_KEY}.rank{rank}."
        if any(fqn.startswith(prefix) for fqn in metadata.state_dict_metadata):
            # Shape the target like what was saved (RNG tensors differ in size across devices).
            sd[RNG_KEY] = {f"rank{rank}": rng.capture_rng_state()}
        else:
            log.warning(
                "checkpoint has no RNG state for rank %d (saved with a smaller world size or without "
                "RNG capture); this rank keeps its current RNG state",
                rank,
            )
    return sd


def _plain_target(key: str, md: Metadata) -> Any:
    paths = {fqn: path for fqn, path in (md.planner_data or {}).items() if path and path[0] == key}
    if not paths:
        raise IncompatibleCheckpointError(
            f"state key {key!r} is not in the checkpoint; remove it from state, or start the run afresh"
        )
    root: dict[str, Any] = {}
    for fqn, path in sorted(paths.items(), key=lambda kv: [str(p) for p in kv[1]]):
        smd = md.state_dict_metadata.get(fqn)
        value: Any = None
        if isinstance(smd, TensorStorageMetadata):
            value = torch.empty(smd.size, dtype=smd.properties.dtype)
        set_element(root, path, value)
    return root[key]


def apply_loaded(state: MutableMapping[str, Any], loaded: Mapping[str, Any], *, rank: int) -> None:
    """Push a loaded state_dict back into the user's objects and dict."""
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


def _all_tensors(d: Any) -> bool:
    if isinstance(d, Mapping):
        return all(_all_tensors(x) for x in d.values())
    return isinstance(d, torch.Tensor)
