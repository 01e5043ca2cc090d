"""``rslurm verify``: which copies of a step to verify, in which tier.

Who calls what: ``cli.py`` lists the steps in scope (one, or every step of every run) and calls
:func:`verify_view` for each; it returns one :class:`~resilient_slurm.checkpoint.verify.StepReport` per
copy verified (each local domain copy, and/or the durable step), made by
:func:`~resilient_slurm.checkpoint.verify.verify_step_dir` and
:func:`~resilient_slurm.checkpoint.verify.verify_durable_step`.

Tier choice (``tier``):

* ``auto``: the local copies when the step is complete locally; else the durable step when it has a
  manifest there; else whatever local copies there are (a node's own domain, on a cluster); else, for a
  step that is only uncommitted (a drain or a save in progress), nothing: a note, or a fault when the
  step was asked for by number.
* ``local`` / ``durable``: that tier only; a step absent from it is a fault when asked for by number,
  and skipped otherwise.
* ``all``: every local copy and the durable step.

Domains whose local copy lives on other nodes are not faults (a note says to verify them there or in
the durable tier); a copy that is here and wrong always is.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from contextlib import AbstractContextManager

from ..checkpoint.verify import MISSING, Fault, StepReport, verify_durable_step, verify_step_dir
from .inventory import Catalog, StepView

ProgressFactory = Callable[[str, int], AbstractContextManager[Callable[[int], None]]]


def _note(view: StepView, tier: str, where: str, note: str) -> StepReport:
    return StepReport(tier=tier, where=where, run_id=view.run_id, step=view.step, notes=[note])


def _fault(view: StepView, tier: str, where: str, problem: str) -> StepReport:
    return StepReport(tier=tier, where=where, run_id=view.run_id, step=view.step,
                      faults=[Fault(where, problem, kind=MISSING)])


def _real_dir(path: str) -> bool:
    """Whether ``path`` is a directory itself (not a link to one)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def verify_view(catalog: Catalog, view: StepView, tier: str, *, explicit: bool, progress: ProgressFactory,
                scratch: str | None = None, threads: int = 4) -> list[StepReport]:
    """Verify the copies of ``view`` that ``tier`` selects (see the module docstring)."""
    lstate, _ = view.local_state
    dstate, dwhy = view.durable_state
    what = f"run {view.run_id} step {view.step}"
    local_where = ", ".join(c.path for c in view.local) or f"{catalog.this_root}/{view.run_id}"
    durable_where = view.durable.where if view.durable else f"{catalog.durable_url}/{view.run_id}"
    out: list[StepReport] = []

    def local() -> None:
        for c in view.local:
            if c.manifest is None and c.problem and not _real_dir(c.path):
                out.append(_fault(view, "local", c.path, c.problem))  # a link or a file: named, never read
                continue
            with progress(f"verify {what} local {c.domain or c.path}", c.bytes) as adv:
                rep = verify_step_dir(c.path, run_id=view.run_id, step=view.step, threads=threads, progress=adv)
            out.append(rep)
        missing = view.missing_domains
        if missing and out:
            out[-1].notes.append(f"domains {', '.join(missing)} of {what} are not here (other nodes' disks); verify "
                                 "them there, or the durable copy with --tier durable")

    def durable() -> None:
        assert catalog.durable is not None
        m = view.durable.manifest if view.durable else None
        with progress(f"verify {what} durable", m.total_bytes if m else 0) as adv:
            out.append(verify_durable_step(catalog.durable, view.run_id, view.step, scratch=scratch, progress=adv))

    def uncommitted(tier_name: str, where: str, why: str) -> None:
        if explicit:
            out.append(_fault(view, tier_name, where, f"{what} is not committed: {why}"))
        else:
            out.append(_note(view, tier_name, where, f"not verified: {why}"))

    if tier == "auto":
        if lstate == "complete":
            local()
        elif dstate in ("durable", "invalid"):
            durable()
            if lstate == "invalid":  # a copy that is here and wrong is a fault, whatever the durable copy is
                local()
        elif view.local:
            local()
        elif dstate == "partial":
            uncommitted("durable", durable_where, dwhy or "no manifest in the durable tier")
        else:
            uncommitted("local", local_where, "only an in-progress directory "
                        f"({', '.join(view.in_progress)}): a save being written, or abandoned")
        return out
    if tier in ("local", "all"):
        if view.local:
            local()
        elif explicit:
            out.append(_fault(view, "local", local_where, f"{what} is not in the local tier"
                              + (" (only in progress)" if view.in_progress else "")))
    if tier in ("durable", "all"):
        if dstate in ("durable", "invalid"):
            durable()
        elif dstate == "partial":
            uncommitted("durable", durable_where, dwhy or "no manifest in the durable tier")
        elif explicit:
            out.append(_fault(view, "durable", durable_where, f"{what} is not in the durable tier"))
    return out


__all__ = ["verify_view"]
