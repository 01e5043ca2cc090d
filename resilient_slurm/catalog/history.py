"""A run's history: every incarnation's end, classified with its evidence (``rslurm history``, the
history lines of ``rslurm status``, the daemon's ``rslurm_incarnation_ends`` metric).

The launcher writes the history (``run_history.py``'s :class:`ProgressHistory`, version 2) into the
run directory on its node, ``<local root>/<run>/launcher-history.json``, and a copy into the durable tier,
``<durable>/<run>/launcher-history.json``, after every incarnation. A job requeued onto another batch
host finds its history in the durable tier. Readers here take the copy whose last entry ended last.

Who calls what: ``cli.cmd_history`` calls :func:`read_history` per run, then :func:`history_rows` and
:func:`format_history`; ``daemon/status.collect_status`` calls :func:`read_history` and
:func:`summary`; the launcher reads its own copy with :func:`read_local_text`; the daemon's metrics count
:func:`ends_by_reason` of each run.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError, ObjectNotFoundError, ProgressHistoryError, ResilientSlurmError
from ..paths import open_regular
from ..run_history import REASON_LABELS, Incarnation, ProgressHistory, Reason
from ..rundir import HISTORY_FILE, RunDir
from ..terminal import printable

HISTORY_MAX_BYTES = 4 << 20  # 64 entries with long evidence are well under 1 MiB


def read_local_text(run_dir: str) -> str | None:
    """The history file of ``run_dir`` as text; None when there is none. A link, FIFO or device there, or
    a file over :data:`HISTORY_MAX_BYTES`, raises ProgressHistoryError naming it."""
    path = RunDir.at(run_dir).history
    try:
        fd = open_regular(path, os.O_RDONLY, where="the run directory",
                          root=os.path.dirname(os.path.abspath(run_dir)))
    except FileNotFoundError:
        return None
    except ConfigError as exc:
        raise ProgressHistoryError(str(exc), source=path) from None
    with os.fdopen(fd, "rb") as f:
        data = f.read(HISTORY_MAX_BYTES + 1)
    if len(data) > HISTORY_MAX_BYTES:
        raise ProgressHistoryError(f"progress history {path}: larger than {HISTORY_MAX_BYTES} bytes; not a "
                                   "history rslurm wrote: move it away", source=path)
    return data.decode("utf-8", errors="replace")


@dataclass(frozen=True)
class RunHistory:
    """One run's history and where it was read from (``source``: a path or a durable URL; None: none)."""

    run_id: str
    history: ProgressHistory
    source: str | None
    errors: tuple[str, ...] = ()


def _last_end(h: ProgressHistory) -> float:
    return max((e.ended_at or 0.0 for e in h.incarnations), default=-1.0)


def read_history(root: str, run_id: str, tier: Any = None) -> RunHistory:
    """``run_id``'s history from the local root and, with ``tier`` (an open durable tier), the durable
    copy: the one whose last incarnation ended last. An unreadable copy is reported in ``errors`` (naming
    the file and what to do) and the other one is used."""
    found: list[tuple[ProgressHistory, str]] = []
    errors: list[str] = []
    run = RunDir(root, run_id)
    path = run.history
    try:
        text = read_local_text(run.path)
        if text is not None:
            found.append((ProgressHistory.from_json(text, source=path), path))
    except ProgressHistoryError as exc:
        errors.append(str(exc))
    except OSError as exc:
        errors.append(f"progress history {path}: cannot read it: {exc.strerror or exc}")
    if tier is not None:
        key = run.durable_key(HISTORY_FILE)
        url = f"{tier.url.rstrip('/')}/{key}"
        try:
            data = tier.get_bytes(key, limit=HISTORY_MAX_BYTES)
            if len(data) > HISTORY_MAX_BYTES:
                raise ProgressHistoryError(f"progress history {url}: larger than {HISTORY_MAX_BYTES} bytes",
                                           source=url)
            found.append((ProgressHistory.from_json(data.decode("utf-8", errors="replace"), source=url), url))
        except ObjectNotFoundError:
            pass
        except ResilientSlurmError as exc:
            errors.append(str(exc))
    if not found:
        return RunHistory(run_id, ProgressHistory(), None, tuple(errors))
    history, source = max(found, key=lambda hs: (_last_end(hs[0]), len(hs[0].incarnations)))
    return RunHistory(run_id, history, source, tuple(errors))


def label(reason: str) -> str:
    """``out_of_memory`` -> ``out of memory``."""
    try:
        return REASON_LABELS[Reason(reason)]
    except ValueError:
        return reason


def history_rows(run: RunHistory) -> list[dict[str, Any]]:
    """One row per end, oldest first: each in-job restart of an incarnation, then the incarnation's own
    end (``kind``: ``in_job_restart`` or ``incarnation``)."""
    rows: list[dict[str, Any]] = []
    for n, e in enumerate(run.history.incarnations):
        common = {"run_id": run.run_id, "incarnation": n, "job_id": e.job_id, "restart_count": e.restart_count}
        for i, r in enumerate(e.in_job):
            rows.append({**common, "kind": "in_job_restart", "attempt": i + 1, "reason": r.reason,
                         "class": label(r.reason), "evidence": r.evidence, "ended_at": r.ended_at,
                         "committed_step": r.committed_step, "action": "restart_in_job"})
        rows.append({**common, "kind": "incarnation", "reason": e.reason, "class": label(e.reason),
                     "evidence": e.evidence, "rank": e.rank, "node": e.node, "started_at": e.started_at,
                     "ended_at": e.ended_at, "restored_step": e.restored_step, "committed_step": e.committed_step,
                     "action": e.action})
    return rows


def _when(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


def format_history(runs: Sequence[RunHistory]) -> str:
    """The ``rslurm history`` table: one line per end, the evidence under it."""
    lines: list[str] = []
    for run in runs:
        lines.append(f"run {run.run_id}" + (f"  ({run.source})" if run.source else "  (no history)"))
        rows = history_rows(run)
        if rows:
            lines.append(f"  {'#':>3} {'JOB':<10} {'ENDED':<19} {'CLASS':<19} {'STEPS':<11} {'ACTION':<15} WHERE")
        for r in rows:
            n = f"{r['incarnation']}" + (f".{r['attempt']}" if r["kind"] == "in_job_restart" else "")
            steps = (f"{r.get('restored_step') if r.get('restored_step') is not None else '-'}"
                     f"->{r['committed_step'] if r['committed_step'] is not None else '-'}")
            where = ""
            if r.get("rank") is not None:
                where = f"rank {r['rank']}" + (f" on {r['node']}" if r.get("node") else "")
            lines.append(f"  {n:>3} {r['job_id'] or 'local':<10} {_when(r['ended_at']):<19} {r['class']:<19} "
                         f"{steps:<11} {r['action'] or '-':<15} {where}")
            if r["evidence"]:
                lines.append(f"  {'':>3} {printable(r['evidence'])}")  # one line, whatever the file holds
        for err in run.errors:
            lines.append(f"  error: {err}")
    return "\n".join(lines) if lines else "(no runs)"


def summary(run: RunHistory) -> dict[str, Any] | None:
    """The last end of a run and the count of every class, for ``rslurm status``; None without history."""
    entries: Sequence[Incarnation] = run.history.incarnations
    if not entries:
        return None
    last = entries[-1]
    return {"incarnations": len(entries), "last_class": label(last.reason), "last_reason": last.reason,
            "last_evidence": last.evidence, "last_ended_at": last.ended_at, "last_action": last.action,
            "ends": ends_by_reason(run.history)}


def ends_by_reason(history: ProgressHistory) -> Mapping[str, int]:
    """How many ends of each class the history holds, in-job restarts included."""
    out: dict[str, int] = {}
    for e in history.incarnations:
        for r in e.in_job:
            out[r.reason] = out.get(r.reason, 0) + 1
        out[e.reason] = out.get(e.reason, 0) + 1
    return out


__all__ = ["HISTORY_MAX_BYTES", "RunHistory", "ends_by_reason", "format_history", "history_rows", "label",
           "read_history", "read_local_text", "summary"]
