"""``rslurm runs``: one line per run of a tier, from the :class:`~.inventory.StepView` list of the run.

Who calls what: ``cli.py`` lists the runs of the tiers asked for (:meth:`~.inventory.Catalog.runs`,
``local_runs``, ``durable_runs``), gets each run's steps (:meth:`~.inventory.Catalog.steps`) and tags,
and calls :func:`summarize_run`; it prints the dicts it returns.

A run's ``state`` is its newest step's: ``durable`` (committed in the durable tier), ``committed`` (in
the local tier only: not drained yet, or no durable tier), ``in_progress`` (a save being written or a
drain under way, or abandoned: only a temp directory or a partial durable step), ``invalid`` (its
copies fail their checks: ``rslurm verify``), ``empty`` (a run directory with no step at all).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from ..tags import RunTags
from .inventory import StepView


def _tier(steps: dict[int, int], **extra: Any) -> dict[str, Any]:
    """A tier's part: committed steps (step -> bytes), their count, first, last and total size."""
    return {"steps": len(steps), "first_step": min(steps, default=None), "last_step": max(steps, default=None),
            "bytes": sum(steps.values()), **extra}


def summarize_run(run: str, views: list[StepView], tags: RunTags | None, *, tiers: Iterable[str],
                  now: float | None = None) -> dict[str, Any]:
    """One run of ``tiers`` (``local``, ``durable``) as a JSON-able dict (the rows of ``rslurm runs
    --json``); ``tags`` None: unreadable (left out)."""
    now = time.time() if now is None else now
    tiers = set(tiers)
    local: dict[int, int] = {}
    durable: dict[int, int] = {}
    saving: list[int] = []  # local: only a temp directory (a save being written, or abandoned)
    partial: list[int] = []  # durable: no manifest yet (a drain under way, or abandoned)
    seen: set[int] = set()
    for v in views:
        if "local" in tiers:
            if v.local or v.in_progress:
                seen.add(v.step)
            if v.valid_local and v.local_state[0] != "invalid":
                local[v.step] = v.local_bytes
            elif v.in_progress and not v.local:
                saving.append(v.step)
        if "durable" in tiers and v.durable is not None:
            seen.add(v.step)
            if v.durable.state == "durable" and v.durable.manifest is not None:
                durable[v.step] = v.durable.manifest.total_bytes
            elif v.durable.state == "partial":
                partial.append(v.step)
    pending = set(saving) | set(partial)
    committed = {v.step: v for v in views if v.step in local or v.step in durable}
    newest = max(seen, default=None)
    if newest is None:
        state = "empty"
    elif newest in durable:
        state = "durable"
    elif newest in local:
        state = "committed"
    elif newest in pending:
        state = "in_progress"
    else:
        state = "invalid"
    last = committed[max(committed)].manifest if committed else None
    doc: dict[str, Any] = {
        "run_id": run, "state": state, "steps": len(committed), "first_step": min(committed, default=None),
        "last_step": max(committed, default=None),
        "bytes": sum(m.total_bytes for v in committed.values() if (m := v.manifest) is not None),
        "created_at": last.created_at if last else None,
        "age_s": round(max(0.0, now - last.created_at), 1) if last else None,
        "tags": tags.tags if tags is not None else None,
        "local": _tier(local, in_progress=sorted(saving)) if "local" in tiers else None,
        "durable": _tier(durable, partial=sorted(partial)) if "durable" in tiers else None,
    }
    return doc


__all__ = ["summarize_run"]
