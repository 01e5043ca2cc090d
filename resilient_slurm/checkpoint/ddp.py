"""DistributedDataParallel: what it replicates by construction, and its gradient bucket layout across a restart.

**Bucket layout.** DDP all-reduces gradients in flat buckets. Its first iteration uses one bucket in
parameter order (torch 2.13 puts every parameter in it); after the first backward the reducer rebuilds
the buckets in the order in which gradients became ready. The position of an element in its bucket
decides which chunk of the ring all-reduce it falls in, and so the order in which the ranks' values are
added. With 3 or more ranks, float addition in another order rounds differently (with 2, ``a + b`` is
the same either way). A resumed run builds a new DDP: its first step used the initial layout where the
uninterrupted run used the rebuilt one, and the two runs drifted apart from that step
(tests/test_ddp_layout.py reproduces it with DDP alone, without rslurm). So every save records the
layout of the DDP that wraps each module in the state (``_rslurm_ddp``, a JSON string), and a restore
re-applies it to the DDP wrapping the restored module before that DDP's first forward: a global
forward pre-hook, installed by the restore and removed once every recorded DDP was handled, builds the
DDP's reducer again with the recorded buckets. The reducer still rebuilds after its first backward;
the gradient-ready order is the same, so it rebuilds to the same layout.

**Replicated by construction.** The parameters DDP synchronizes (every parameter it does not ignore:
gradients are all-reduced, frozen ones were broadcast at construction) and the optimizer state of those
parameters are equal on every rank of the DDP, so :mod:`replication` need not digest them at every save.

This uses DDP internals of torch 2.13 (``_get_ddp_logging_data``, ``_build_params_for_reducer``,
``_ddp_init_helper``, ``reducer._remove_autograd_hooks``); tests/test_ddp_layout.py checks them. Where
they are missing or the model changed, a warning says the first step after the resume may differ in
the last bits with 3 or more ranks, and nothing else changes.

Who calls what: the engine calls :meth:`DDPTracker.scan` when its plan changes, :meth:`DDPTracker.layouts`
at every save (it asks a DDP until its layout is final), and :meth:`DDPTracker.expect` after a restore;
the hook then calls :func:`apply_layout` on the training thread inside the DDP's first forward.
:meth:`DDPTracker.close` removes the hook.
"""

from __future__ import annotations

import gc
import json
import logging
import weakref
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from .state import DDP_KEY

log = logging.getLogger(__name__)

__all__ = ["DDP_KEY", "DDPTracker", "apply_layout", "current_layout", "find_ddp"]


def _ddp_class() -> Any:
    try:
        from torch.nn.parallel import DistributedDataParallel
    except ImportError:  # pragma: no cover - torch built without distributed
        return None
    return DistributedDataParallel


def find_ddp(module: torch.nn.Module) -> Any | None:
    """The DistributedDataParallel that wraps ``module`` (directly, or through ``torch.compile``'s
    wrapper), or None.

    A module does not point back to its wrapper, so this walks referrers: the wrapper's ``_modules``
    dict holds the module, the wrapper (or its ``__dict__``) holds that dict. Each step is one
    ``gc.get_referrers`` pass (about 50 ms with two million live objects); it runs when a save plan
    changes, not at every save."""
    ddp_cls = _ddp_class()
    if ddp_cls is None:
        return None
    targets = {id(module)}
    frontier: list[Any] = [module]
    seen: set[int] = set()
    for _ in range(6):
        nxt: list[Any] = []
        for ref in gc.get_referrers(*frontier):
            if isinstance(ref, ddp_cls) and id(ref.module) in targets:
                return ref
            if isinstance(ref, torch.nn.Module) and id(getattr(ref, "_orig_mod", None)) in targets:
                targets.add(id(ref))  # torch.compile's OptimizedModule around the module: look for its wrapper
                nxt.append(ref)
            elif type(ref) is dict and id(ref) not in seen:
                seen.add(id(ref))
                nxt.append(ref)
        if not nxt:
            break
        frontier = nxt
    return None


def _group_ranks(pg: Any) -> frozenset[int] | None:
    """The global ranks of a process group; None for the default group (every rank) or when unknown."""
    if pg is None or not dist.is_available() or not dist.is_initialized():
        return None
    try:
        ranks = frozenset(dist.get_process_group_ranks(pg))
    except Exception:  # not a group this rank knows
        return None
    return None if len(ranks) == dist.get_world_size() else ranks


def _logging_data(ddp: Any, refresh: bool = False) -> dict[str, Any]:
    """DDP's logging data. It is brought up to date at each forward, before that forward's rebuild, so
    after iteration k it shows iteration k-1; ``refresh`` brings it up to the last backward (the same
    call DDP makes at its next forward; it records statistics only)."""
    try:
        if refresh:
            ddp.logger.set_runtime_stats_and_log()
        return dict(ddp._get_ddp_logging_data())
    except Exception:  # internals changed: no layout
        return {}


def current_layout(ddp: Any) -> tuple[list[list[int]] | None, bool]:
    """``(buckets, final)``: the rebuilt bucket layout of ``ddp`` (parameter indices per bucket), or the
    one its rebuild will produce when one iteration ran but the rebuild (at the next forward) did not;
    ``final`` once rebuilt (the layout never changes after that). ``(None, False)`` before any iteration."""
    data = _logging_data(ddp, refresh=True)
    rebuilt = data.get("rebuilt_per_bucket_param_indices")
    if data.get("has_rebuilt_buckets") and isinstance(rebuilt, str) and rebuilt.strip():
        return [[int(x) for x in b.split()] for b in rebuilt.split(",")], True
    order = data.get("prev_iteration_grad_ready_order_indices")
    if not isinstance(order, str) or not order.strip():
        return None, False
    if getattr(ddp, "find_unused_parameters", False) and not getattr(ddp, "static_graph", False):
        return None, True  # this DDP never rebuilds: its initial layout is the layout
    return _would_rebuild(ddp, [int(x) for x in order.split(",")]), False


def _would_rebuild(ddp: Any, ready: list[int]) -> list[list[int]] | None:
    """The layout DDP's reducer computes at its rebuild from the first iteration's gradient-ready order:
    the same assignment function, with the reducer's rebuild limits (first bucket cap, then bucket cap)."""
    import torch.distributed as dist

    try:
        params, sparse = ddp._build_params_for_reducer()
        cfg = ddp._bucket_config
        limits = (list(cfg.per_bucket_bytes_caps) if cfg.has_custom_per_bucket_caps
                  else [cfg.first_bucket_bytes_cap, cfg.bucket_bytes_cap])
        if sorted(ready) != list(range(len(params))):
            return None
        buckets, _ = dist._compute_bucket_assignment_by_size(
            [params[i] for i in ready], limits, [sparse[i] for i in ready], ready)
    except Exception as exc:
        log.debug("cannot compute DDP's rebuilt bucket layout: %s", exc)
        return None
    return [list(b) for b in buckets]


def apply_layout(ddp: Any, buckets: list[list[int]]) -> bool:
    """Rebuild ``ddp``'s reducer with ``buckets`` before its first forward. False (with a warning) when
    the DDP already ran, the layout does not fit its parameters, or the internals are not there."""
    import torch.distributed as dist
    import torch.nn.parallel.distributed as ddp_module

    data = _logging_data(ddp)
    if data.get("has_rebuilt_buckets") or data.get("prev_iteration_grad_ready_order_indices"):
        return False  # it ran already: its own layout is in place
    try:
        params, sparse = ddp._build_params_for_reducer()
    except Exception as exc:
        log.warning("cannot restore the gradient bucket layout of DDP (%s); with 3 or more ranks the first step "
                    "after this resume may differ in the last bits from an uninterrupted run", exc)
        return False
    if sorted(i for b in buckets for i in b) != list(range(len(params))):
        log.warning("the checkpoint's DDP bucket layout covers %d parameters, the model has %d: not restored; "
                    "with 3 or more ranks the first step after this resume may differ in the last bits",
                    sum(len(b) for b in buckets), len(params))
        return False
    original = ddp_module.dist._compute_bucket_assignment_by_size
    caps = [ddp._bucket_config.bucket_bytes_cap] * len(buckets)

    def assignment(*_args: Any, **_kwargs: Any) -> tuple[list[list[int]], list[int]]:
        # _ddp_init_helper hands the reducer the buckets reversed: give them in reverse, get them as recorded.
        return [list(b) for b in reversed(buckets)], caps

    try:
        mapping = ddp._build_debug_param_to_name_mapping(params)
        ddp.reducer._remove_autograd_hooks()
        ddp_module.dist._compute_bucket_assignment_by_size = assignment
        try:
            ddp._ddp_init_helper(params, sparse, mapping, ddp.static_graph)
        finally:
            ddp_module.dist._compute_bucket_assignment_by_size = original
        if ddp.static_graph:
            ddp.reducer._set_static_graph()
            ddp.logger._set_static_graph()
        for hook, hook_state in getattr(ddp, "_comm_hooks", []):
            dist._register_comm_hook(ddp.reducer, hook_state, hook)
    except Exception as exc:
        raise RuntimeError(f"restoring DDP's gradient bucket layout failed: {exc}") from exc
    return True


class DDPTracker:
    """The DDPs around the modules of one state, their layouts, and the hook that restores layouts."""

    def __init__(self) -> None:
        self._ddps: dict[str, weakref.ReferenceType[Any]] = {}
        self._final: dict[str, list[list[int]] | None] = {}
        self._pending: dict[int, tuple[weakref.ReferenceType[torch.nn.Module], list[list[int]]]] = {}
        self._hook: Any = None
        self._sampling: dict[str, Any] = {}  # state key -> the DDP iteration gradient_wait_s last used

    def scan(self, state: Mapping[str, Any]) -> None:
        """Find the DDP around each module of ``state`` (or the DDP itself, when the state holds it)."""
        ddp_cls = _ddp_class()
        self._ddps.clear()
        self._final.clear()
        if ddp_cls is None:
            return
        for k, v in state.items():
            ddp = v if isinstance(v, ddp_cls) else find_ddp(v) if isinstance(v, torch.nn.Module) else None
            if ddp is not None:
                self._ddps[k] = weakref.ref(ddp)

    def replicated_keys(self, state: Mapping[str, Any]) -> dict[str, frozenset[int] | None]:
        """State keys DDP keeps equal on its ranks, each with the global ranks of its DDP's process group
        (None: the default group, every rank): synchronized parameters (``model.<name>``) and, as key
        prefixes ending in ``.``, their optimizer state (``optim.state.<i>.``). Two pipeline stages each
        under a DDP of their own keep *different* values under one key (an optimizer keyed by index): the
        group says which ranks hold replicas."""
        out: dict[str, frozenset[int] | None] = {}
        groups: dict[int, frozenset[int] | None] = {}  # id(parameter) -> its DDP's ranks
        for k, ref in self._ddps.items():
            ddp = ref()
            if ddp is None:
                continue
            group = _group_ranks(getattr(ddp, "process_group", None))
            ignored = set(getattr(ddp, "parameters_to_ignore", ()) or ())
            synced = {id(p) for name, p in ddp.module.named_parameters() if name not in ignored}
            groups.update(dict.fromkeys(synced, group))
            # Names as the state's own object gives them (the DDP itself: "module.x"; a compiled module: "x").
            for name, p in state[k].named_parameters(remove_duplicate=False):
                if id(p) in synced:
                    out[f"{k}.{name}"] = group
        for k, v in state.items():
            if isinstance(v, torch.optim.Optimizer):
                flat = [p for g in v.param_groups for p in g["params"]]
                out.update({f"{k}.state.{i}.": groups[id(p)] for i, p in enumerate(flat) if id(p) in groups})
        return out

    def gradient_wait_s(self, window: int) -> float | None:
        """Seconds the last iteration DDP sampled waited for its gradient all-reduce after the backward
        computation ended, summed over the DDPs of the state: ``backward_comm_time -
        backward_compute_comm_overlap_time`` of DDP's runtime statistics (CPU timers for CPU modules, CUDA
        events for GPU ones). A fast rank waits there for a slow one; straggler detection subtracts it
        (stragglers.py). 0.0 without a DDP; None when no DDP sampled a new iteration since the last call
        (DDP samples iterations 1 to 10, then every 100th: this sets that period to ``window`` when
        shorter, so each straggler window sees one)."""
        total, fresh, found = 0.0, False, False
        for k, ref in self._ddps.items():
            ddp = ref()
            if ddp is None:
                continue
            found = True
            if k not in self._sampling and 0 < window < 100:
                try:
                    ddp._set_ddp_runtime_logging_sample_rate(window)
                except Exception:  # internals changed: DDP's default period
                    pass
            data = _logging_data(ddp)
            it = data.get("iteration")
            comm, overlap = data.get("backward_comm_time"), data.get("backward_compute_comm_overlap_time")
            if self._sampling.get(k) != it:
                fresh = True
            self._sampling[k] = it
            if isinstance(comm, int) and isinstance(overlap, int) and comm > overlap >= 0:
                total += (comm - overlap) / 1e9
        if not found:
            return 0.0
        return total if fresh else None

    def layouts(self) -> str | None:
        """The layouts to store with this save (JSON), or None when no DDP wraps a module of the state."""
        if not self._ddps:
            return None
        out: dict[str, list[list[int]] | None] = {}
        for k, ref in self._ddps.items():
            if k in self._final:
                out[k] = self._final[k]
                continue
            ddp = ref()
            buckets, final = current_layout(ddp) if ddp is not None else (None, False)
            if final:
                self._final[k] = buckets
            out[k] = buckets
        return json.dumps(out, sort_keys=True)

    def expect(self, state: Mapping[str, Any], saved: Any) -> None:
        """After a restore: re-apply each saved layout at the first forward of the DDP wrapping that module."""
        if not isinstance(saved, str):
            return
        try:
            layouts = json.loads(saved)
        except ValueError:
            log.warning("the checkpoint's DDP bucket layouts are unreadable; not restored")
            return
        ddp_cls = _ddp_class()
        if not isinstance(layouts, dict) or ddp_cls is None:
            return
        for k, buckets in layouts.items():
            v = state.get(k)
            if isinstance(v, ddp_cls):
                v = v.module
            if not buckets or not isinstance(v, torch.nn.Module):
                continue
            if not (isinstance(buckets, list) and all(isinstance(b, list) and all(isinstance(i, int) for i in b)
                                                      for b in buckets)):
                log.warning("the checkpoint's DDP bucket layout of %r is malformed; not restored", k)
                continue
            self._pending[id(v)] = (weakref.ref(v), buckets)
        if self._pending and self._hook is None:
            from torch.nn.modules.module import register_module_forward_pre_hook

            self._hook = register_module_forward_pre_hook(self._before_forward)

    def _before_forward(self, module: torch.nn.Module, _args: Any) -> None:
        ddp_cls = _ddp_class()
        if ddp_cls is None or not isinstance(module, ddp_cls):
            return
        entry = self._pending.pop(id(module.module), None)
        if entry is not None and entry[0]() is module.module:
            apply_layout(module, entry[1])
        if not self._pending:
            self.close()

    def close(self) -> None:
        """Remove the forward hook (nothing more to restore)."""
        self._pending.clear()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
