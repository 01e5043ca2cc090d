"""The compatibility check of a restore: the state being restored against a step's DCP metadata, every
difference in one error, before anything is planned, read or loaded.

Who calls what: :meth:`Restorer._read_step <.restore.Restorer._read_step>` calls :func:`check_compat` on
every rank with the load planner already set up (``SafeLoadPlanner.set_up_planner``: the target that
:func:`~.state.prepare_load_target` built, flattened into DCP keys, this rank's per-rank copies under
their own keys) and before ``create_local_plan``. DCP's planner stops at the first key that does not
fit; this check lists them all:

- *missing*: in the state, not in the checkpoint (a new head, a new buffer);
- *unexpected*: in the checkpoint, not in the state (a dropped buffer, a removed layer);
- *reshaped*: in both with another shape, or a tensor on one side and a plain value on the other.

A dtype change is not an incompatibility: the saved values are converted as ``Tensor.copy_`` converts
them (what DCP does too); the restore logs which keys were converted.

Intended changes are allowed with fnmatch patterns of the flattened keys (``model.head.*``):
``allow_missing`` covers missing and reshaped keys (the state keeps its current value for them),
``allow_unexpected`` covers unexpected ones (not loaded). Nothing else changes: every other key is
loaded and verified as usual.

Optimizers load whole or not at all: an optimizer's state is keyed by parameter *index*, and
``Optimizer.load_state_dict`` refuses a parameter group whose size changed, which it would do only
after the model was loaded. So when keys under ``<opt>.state.`` are missing or unexpected (its
parameters changed), the optimizer starts afresh if ``allow_missing`` covers every one of its keys
(``allow_missing=["opt.*"]``, with ``allow_unexpected=["opt.*"]`` for a removed parameter's state),
and the restore is refused otherwise. Reshaped moments of a reshaped parameter (a head with another
number of classes) keep the optimizer's current values and the rest loads.

Reserved keys (RNG state, DDP's bucket layout, other ranks' per-rank copies) are not compared: their
own rules apply (state.py, ddp.py, restore.py).
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from ..errors import ConfigError, IncompatibleCheckpointError
from ..manifest import split_per_rank_fqn
from .state import DDP_KEY, RNG_KEY


@dataclass(frozen=True)
class CompatReport:
    """What a compatible restore will not load, and why (for the log)."""

    kept: tuple[str, ...] = ()  # missing or reshaped, allowed: the state keeps its current value
    ignored: tuple[str, ...] = ()  # unexpected, allowed: not loaded
    fresh: tuple[str, ...] = ()  # top-level keys (optimizers) not loaded at all: they start afresh
    converted: tuple[str, ...] = field(default=())  # dtype differs: converted on load


def check_patterns(name: str, patterns: Sequence[str] | None) -> tuple[str, ...]:
    """``patterns`` as a tuple of strings, or ConfigError naming the argument."""
    if patterns is None:
        return ()
    if isinstance(patterns, str) or not all(isinstance(p, str) and p for p in patterns):
        raise ConfigError(f"{name} must be a list of fnmatch patterns of state keys (e.g. ['model.head.*']), "
                          f"got {patterns!r}")
    return tuple(patterns)


def _matches(key: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(key, p) for p in patterns)


def _reserved(key: str) -> bool:
    top = key.split(".", 1)[0]
    return top in (RNG_KEY, DDP_KEY)


def _describe_saved(smd: Any) -> str:
    if isinstance(smd, TensorStorageMetadata):
        return f"tensor {tuple(smd.size)} {str(smd.properties.dtype).removeprefix('torch.')}"
    return "a plain value"


def _describe_live(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"tensor {tuple(v.size())} {str(v.dtype).removeprefix('torch.')}"
    return "a plain value"


def _listing(what: str, items: Sequence[str]) -> str:
    return f"  {what} [{len(items)}]: " + ", ".join(items)


def check_compat(
    planner: Any,
    md: Metadata,
    state: Mapping[str, Any],
    *,
    source_rank: int,
    allow_missing: Sequence[str] = (),
    allow_unexpected: Sequence[str] = (),
    where: str = "the checkpoint",
) -> CompatReport:
    """Compare ``planner.state_dict`` (flattened target) with ``md``; raise IncompatibleCheckpointError
    listing every missing, unexpected and reshaped key that the patterns do not allow, or drop the allowed
    ones from the planner (and optimizers starting afresh from its target) and say what was left out.
    ``where`` names the step in the message. Nothing is loaded here."""
    sd: MutableMapping[str, Any] = planner.state_dict
    live: dict[str, str] = {}  # key as the state names it -> key in the planner
    for fqn in sd:
        split = split_per_rank_fqn(fqn)
        key = split[1] if split is not None else fqn
        if not _reserved(key):
            live[key] = fqn
    saved: dict[str, Any] = {}
    others: set[str] = set()  # keys saved only as other ranks' own copies
    for fqn, smd in md.state_dict_metadata.items():
        split = split_per_rank_fqn(fqn)
        if split is None:
            if not _reserved(fqn):
                saved[fqn] = smd
        elif split[0] == source_rank:
            saved[split[1]] = smd
        else:
            others.add(split[1])
    missing = sorted(k for k in live if k not in saved)
    unexpected = sorted(k for k in (set(saved) | others) if k not in live)
    reshaped: list[str] = []
    converted: list[str] = []
    for key in sorted(set(live) & set(saved)):
        smd, v = saved[key], sd[live[key]]
        is_tensor = isinstance(smd, TensorStorageMetadata)
        if is_tensor != isinstance(v, torch.Tensor) or (is_tensor and tuple(smd.size) != tuple(v.size())):
            reshaped.append(f"{key} (saved {_describe_saved(smd)}, state {_describe_live(v)})")
        elif is_tensor and smd.properties.dtype != v.dtype:
            converted.append(key)
    reshaped_keys = [r.split(" (", 1)[0] for r in reshaped]
    refused_missing = [k for k in missing if not _matches(k, allow_missing)]
    refused_unexpected = [k for k in unexpected if not _matches(k, allow_unexpected)]
    refused_reshaped = [r for r, k in zip(reshaped, reshaped_keys) if not _matches(k, allow_missing)]
    # Optimizers whose parameters changed: whole or not at all.
    fresh: list[str] = []
    partial: list[str] = []
    for top, obj in state.items():
        if not isinstance(obj, torch.optim.Optimizer):
            continue
        prefix = f"{top}.state."
        if not any(k.startswith(prefix) for k in (*missing, *unexpected)):
            continue
        mine = [k for k in live if k.split(".", 1)[0] == top]
        if all(_matches(k, allow_missing) for k in mine):
            fresh.append(top)
        else:
            partial.append(top)
    if refused_missing or refused_unexpected or refused_reshaped or partial:
        lines = [f"{where} does not fit the state being restored; nothing was loaded:"]
        if refused_missing:
            lines.append(_listing("missing (in the state, not in the checkpoint)", refused_missing))
        if refused_unexpected:
            lines.append(_listing("unexpected (in the checkpoint, not in the state)", refused_unexpected))
        if refused_reshaped:
            lines.append(_listing("reshaped", refused_reshaped))
        for top in partial:
            lines.append(f"  optimizer {top!r}: its parameters changed (state keys {top}.state.* missing or "
                         f"unexpected); an optimizer loads whole or not at all: allow_missing=['{top}.*'] "
                         f"(and allow_unexpected=['{top}.*']) starts it afresh")
        lines.append("If these changes are intended, pass restore(state, allow_missing=[...], "
                     "allow_unexpected=[...]) with fnmatch patterns of these keys (a missing or reshaped key keeps "
                     "its current value, an unexpected one is not loaded; docs/integration.md); else restore "
                     "with the model and optimizer that wrote the step, or move the run directory aside to start "
                     "afresh.")
        raise IncompatibleCheckpointError("\n".join(lines))
    kept = [*missing, *reshaped_keys]
    for top in fresh:
        for key in [k for k in live if k.split(".", 1)[0] == top]:
            del sd[live[key]]
            planner.mappings.pop(live[key], None)
        planner.original_state_dict.pop(top, None)
    for key in kept:
        fqn = live[key]
        if fqn in sd:
            del sd[fqn]
            planner.mappings.pop(fqn, None)
    if kept or fresh:
        # DCP's planner takes saved keys that the state holds but its flattened dict lacks for a checkpoint
        # of torch < 2.4 and flattens the state again, which would bring the dropped keys back: it is given
        # the metadata of the keys still to load.
        planner.metadata = dataclasses.replace(
            md, state_dict_metadata={k: v for k, v in md.state_dict_metadata.items() if k in sd})
    return CompatReport(
        kept=tuple(k for k in kept if k.split(".", 1)[0] not in fresh),
        ignored=tuple(unexpected), fresh=tuple(fresh), converted=tuple(converted))


__all__ = ["CompatReport", "check_compat", "check_patterns"]
