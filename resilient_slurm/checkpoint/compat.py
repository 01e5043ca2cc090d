"""The compatibility check of a restore: the state being restored against a step's DCP metadata, every
difference in one error, before anything is read or loaded.

Who calls what: :meth:`StepReader.read_round <.restore_round.StepReader.read_round>` runs it on every rank in two
parts around one exchange between the ranks. :func:`compare` (this rank, with the load planner set up:
``SafeLoadPlanner.set_up_planner`` on the target that :func:`~.state.prepare_load_target` built, this
rank's per-rank copies under their own keys) finds this rank's differences; the ranks then learn which
saved keys no rank holds now (:meth:`Findings.mask`, one ``all_reduce(MAX)`` of a byte per saved key, only
when every rank has keys it does not hold); :func:`decide` refuses with this rank's differences, or drops
the allowed ones from the planner, before ``create_local_plan``. DCP's planner stops at the first key that
does not fit; this check lists them all:

- *missing*: in this rank's state, not in the checkpoint (a new head, a new buffer);
- *unexpected*: in the checkpoint, held by no rank's state now (a dropped buffer, a removed layer). Ranks
  hold different keys in pipeline parallelism (each stage its own layers) or under per-rank names
  (``data{rank}``): a key another rank holds is not unexpected here. A per-rank copy (a value that
  differed between ranks, stored per rank) is this rank's own: one the state lacks is unexpected here;
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

Reserved keys (RNG state, DDP's bucket layout, the optimizers' parameter names) are not compared: their
own rules apply (state.py, ddp.py, restore.py).
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from ..errors import ConfigError, IncompatibleCheckpointError
from ..manifest import split_per_rank_fqn
from .state import RESERVED_KEYS


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


def matches(key: str, patterns: Sequence[str]) -> bool:
    """Whether ``key`` matches one of the fnmatch ``patterns``."""
    return any(fnmatch.fnmatchcase(key, p) for p in patterns)


def _reserved(key: str) -> bool:
    top = key.split(".", 1)[0]
    return top in RESERVED_KEYS


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


@dataclass(frozen=True)
class Findings:
    """This rank's differences from a step, before the ranks compare which saved keys they hold
    (:func:`compare`)."""

    live: Mapping[str, str]  # key as the state names it -> key in the planner
    missing: tuple[str, ...]  # in the state, not saved
    reshaped: tuple[tuple[str, str], ...]  # (key, description)
    converted: tuple[str, ...]
    own_unexpected: tuple[str, ...]  # this rank's own per-rank copies that its state lacks
    candidates: tuple[str, ...]  # shared saved keys this rank does not hold: unexpected if no rank does
    keyspace: tuple[str, ...]  # every shared saved key, sorted: the same list on every rank for one step

    @property
    def digest(self) -> int:
        """Identifies :attr:`keyspace` (equal on ranks that read the same step's metadata)."""
        h = xxhash.xxh3_64()
        for k in self.keyspace:
            h.update(k.encode("utf-8", "surrogatepass") + b"\0")
        return h.intdigest()

    def mask(self) -> bytes:
        """One byte per :attr:`keyspace` key: 1 where this rank's state holds it."""
        return bytes(1 if k in self.live else 0 for k in self.keyspace)

    def unheld(self, held: bytes) -> frozenset[str]:
        """The keys of :attr:`keyspace` that no rank holds, from every rank's :meth:`mask` combined (max)."""
        return frozenset(k for k, h in zip(self.keyspace, held) if not h)


def compare(planner: Any, md: Metadata, *, source_rank: int) -> Findings:
    """This rank's state (``planner.state_dict``, flattened target) against ``md``. Nothing is decided here."""
    sd: Mapping[str, Any] = planner.state_dict
    live: dict[str, str] = {}
    for fqn in sd:
        split = split_per_rank_fqn(fqn)
        key = split[1] if split is not None else fqn
        if not _reserved(key):
            live[key] = fqn
    shared: dict[str, Any] = {}
    own: dict[str, Any] = {}  # this rank's (its source rank's) per-rank copies
    for fqn, smd in md.state_dict_metadata.items():
        split = split_per_rank_fqn(fqn)
        if split is None:
            if not _reserved(fqn):
                shared[fqn] = smd
        elif split[0] == source_rank and not _reserved(split[1]):
            own[split[1]] = smd
    saved = {**shared, **own}
    reshaped: list[tuple[str, str]] = []
    converted: list[str] = []
    for key in sorted(set(live) & set(saved)):
        smd, v = saved[key], sd[live[key]]
        is_tensor = isinstance(smd, TensorStorageMetadata)
        if is_tensor != isinstance(v, torch.Tensor) or (is_tensor and tuple(smd.size) != tuple(v.size())):
            reshaped.append((key, f"{key} (saved {_describe_saved(smd)}, state {_describe_live(v)})"))
        elif is_tensor and smd.properties.dtype != v.dtype:
            converted.append(key)
    return Findings(
        live=live, missing=tuple(sorted(k for k in live if k not in saved)), reshaped=tuple(reshaped),
        converted=tuple(converted), own_unexpected=tuple(sorted(k for k in own if k not in live)),
        candidates=tuple(sorted(k for k in shared if k not in live and k not in own)),
        keyspace=tuple(sorted(shared)))


def decide(
    planner: Any,
    md: Metadata,
    state: Mapping[str, Any],
    found: Findings,
    unheld: frozenset[str],
    *,
    allow_missing: Sequence[str] = (),
    allow_unexpected: Sequence[str] = (),
    where: str = "the checkpoint",
    rank: int | None = None,
) -> CompatReport:
    """Raise IncompatibleCheckpointError listing every missing, unexpected and reshaped key of this rank that
    the patterns do not allow (``unheld``: the saved keys no rank holds now), or drop the allowed ones from
    the planner (and optimizers starting afresh from its target) and say what was left out. ``where`` names
    the step in the message, ``rank`` this rank. Nothing is loaded here."""
    sd: MutableMapping[str, Any] = planner.state_dict
    live = found.live
    missing = list(found.missing)
    unexpected = sorted({*found.own_unexpected, *(k for k in found.candidates if k in unheld)})
    reshaped = [d for _, d in found.reshaped]
    reshaped_keys = [k for k, _ in found.reshaped]
    refused_missing = [k for k in missing if not matches(k, allow_missing)]
    refused_unexpected = [k for k in unexpected if not matches(k, allow_unexpected)]
    refused_reshaped = [d for d, k in zip(reshaped, reshaped_keys) if not matches(k, allow_missing)]
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
        if all(matches(k, allow_missing) for k in mine):
            fresh.append(top)
        else:
            partial.append(top)
    if refused_missing or refused_unexpected or refused_reshaped or partial:
        who = f" on rank {rank}" if rank is not None else ""
        lines = [f"{where} does not fit the state being restored{who}; nothing was loaded:"]
        if refused_missing:
            lines.append(_listing("missing (in the state, not in the checkpoint)", refused_missing))
        own = set(found.own_unexpected)
        if any(k not in own for k in refused_unexpected):
            lines.append(_listing("unexpected (in the checkpoint, held by no rank's state)",
                                  [k for k in refused_unexpected if k not in own]))
        if any(k in own for k in refused_unexpected):
            lines.append(_listing("unexpected (this rank's own copy in the checkpoint, not in its state)",
                                  [k for k in refused_unexpected if k in own]))
        if refused_reshaped:
            lines.append(_listing("reshaped", refused_reshaped))
        for top in partial:
            lines.append(f"  optimizer {top!r}: its parameters changed (state keys {top}.state.* missing or "
                         f"unexpected); an optimizer loads whole or not at all: allow_missing=['{top}.*'] "
                         f"(and allow_unexpected=['{top}.*']) starts it afresh. An optimizer's own state_dict() "
                         "keys its state by parameter index: to restore it into a model split differently "
                         "(another pipeline split), keep it keyed by parameter name with "
                         "torch.distributed.checkpoint.state_dict.get_optimizer_state_dict (docs/integration.md, "
                         "Model parallelism)")
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
        ignored=tuple(unexpected), fresh=tuple(fresh), converted=found.converted)


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
    """:func:`compare` and :func:`decide` on this rank alone, as if every saved key this rank does not hold
    were held by another rank (a load plan made before the ranks compare notes: the durable fetch's)."""
    found = compare(planner, md, source_rank=source_rank)
    return decide(planner, md, state, found, frozenset(), allow_missing=allow_missing,
                  allow_unexpected=allow_unexpected, where=where)


__all__ = ["CompatReport", "Findings", "check_compat", "check_patterns", "compare", "decide"]
