"""A picture of a run (``rslurm report``): its timeline and its goodput, computed from the run's event log
and history.

The event log (``<local root>/<run>/events.jsonl``, docs/telemetry.md) says when each incarnation and
each run of its ranks started and ended, when every save stalled the training loop, when the ranks
restored and from which tier, and what the daemon drained; the history (``launcher-history.json``,
read with :func:`~.history.read_history`) says why each incarnation ended. :func:`build_report` turns them
into runs of the ranks (:class:`Segment`), each cut into labelled spans, and sums the spans into the
goodput and its losses by cause (docs/cli.md, ``rslurm report``, defines every number):

* ``startup``: from a run of the ranks' start to the beginning of its restore;
* ``restore``: the restore itself (the slowest rank's ``restore`` ``seconds``);
* ``save_stall``: each save's foreground stall (its slowest rank's ``stall_s``);
* ``recomputed``: training of steps past the step the next run of the ranks restored (lost, trained again);
* ``waiting``: between incarnations (the requeue) and the backoff before an in-job restart;
* ``other``: the rest (ranks shutting down after their last step, anything no event explains).

``kept`` (training of steps never trained again) plus the causes is the wall time, by construction.
:func:`plot_report` draws it with matplotlib, imported there only. Standard library only otherwise: no
torch, so ``rslurm report`` runs on a login node.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..paths import open_regular
from ..run_history import Incarnation, ProgressHistory
from ..rundir import RunDir
from .history import RunHistory, label

CAUSES = ("save_stall", "startup", "restore", "recomputed", "waiting", "other")
# Ends announced in time for an emergency save: the ranks stop at a committed step, nothing is lost.
ANNOUNCED = frozenset({"preempted", "time_limit", "cloud_termination", "cancelled", "completed"})
EVENTS_MAX_BYTES = 256 << 20  # a long run's log is far below this; more is read no further
REPORT_VERSION = 1


# ---------------------------------------------------------------------------------------------- reading
@dataclass
class EventLogRead:
    """The records of an event log and what was wrong with it (``problems``: one line each)."""

    path: str
    records: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    found: bool = False


def read_events(path: str) -> EventLogRead:
    """Every record of the event log at ``path`` that parses (an object with a number ``t`` and an
    ``event``), in time order. A torn last line (its writer was killed), a line that is not a record, a
    missing or unreadable file: said in ``problems``, never raised."""
    out = EventLogRead(path)
    try:  # a regular file only, never through a final link, never blocking on a FIFO planted there
        with os.fdopen(open_regular(path, os.O_RDONLY, error=OSError, where="its run directory"), "rb") as f:
            data = f.read(EVENTS_MAX_BYTES + 1)
    except FileNotFoundError:
        out.problems.append(f"no event log at {path}")
        return out
    except OSError as exc:
        out.problems.append(f"event log {path}: cannot read it: {exc.strerror or exc}")
        return out
    out.found = True
    if len(data) > EVENTS_MAX_BYTES:
        data = data[:EVENTS_MAX_BYTES]
        out.problems.append(f"event log {path}: larger than {EVENTS_MAX_BYTES} bytes; read up to there")
    lines = data.split(b"\n")
    torn = bool(lines) and lines[-1] != b""  # no newline at the end: the last write was cut
    bad = 0
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            if not (torn and i == len(lines) - 1):
                bad += 1
            continue
        if not isinstance(rec, dict) or not isinstance(rec.get("event"), str) or not _num(rec.get("t")):
            bad += 1
            continue
        out.records.append(rec)
    if torn:
        try:
            json.loads(lines[-1])
        except ValueError:
            out.problems.append(f"event log {path}: its last line is incomplete (the writer was killed while "
                                "writing it); left out")
    if bad:
        out.problems.append(f"event log {path}: {bad} line(s) are not event records; left out")
    out.records.sort(key=lambda r: float(r["t"]))
    return out


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) != float("inf")


def _f(v: Any, default: float = 0.0) -> float:
    return float(v) if _num(v) else default


def _step(v: Any) -> int | None:
    return int(v) if isinstance(v, int) and not isinstance(v, bool) else None


# ---------------------------------------------------------------------------------------------- the model
@dataclass
class Save:
    """One save as the training loop felt it: the largest ``stall_s`` of its ranks, ending at ``t``, when
    the last rank wrote ``save_staged`` (went on training)."""

    step: int
    reason: str
    t: float
    stall_s: float
    committed: bool = False
    total_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "reason": self.reason, "t": self.t, "stall_s": self.stall_s,
                "committed": self.committed, "total_s": self.total_s}


@dataclass
class Segment:
    """One run of the ranks: an incarnation's first, or one after an in-job restart.

    ``start``..``train_start``: startup then restore (``restore_begin`` between them); ``train_start``..
    ``train_end``: training, of which ``kept_until`` is the last moment whose steps were kept;
    ``train_end``..``end``: the ranks shutting down (``other``)."""

    incarnation: int
    attempt: int  # 0: the incarnation's first run of the ranks; n: after its n-th in-job restart
    start: float
    end: float
    end_reason: str | None = None
    end_evidence: str = ""
    end_source: str = ""  # which record says why it ended
    restored_step: int | None = None
    restore_tiers: list[str] = field(default_factory=list)
    restore_fetched_bytes: int = 0
    restore_failed: bool = False
    restore_begin: float | None = None
    train_start: float | None = None
    train_end: float | None = None
    kept_until: float | None = None
    committed_step: int | None = None
    last_step_seen: int | None = None
    launcher_last_step: int | None = None  # the launcher's `ranks_exited` reading of the heartbeats, if any
    saves: list[Save] = field(default_factory=list)
    waiting_before: float = 0.0  # an in-job restart's backoff, or the requeue gap before an incarnation
    step_marks: list[tuple[float, int]] = field(default_factory=list)  # (t, step) this run reached
    losses: dict[str, float] = field(default_factory=dict)
    kept: float = 0.0
    steps_recomputed: int | None = None
    next_restored_step: int | None = None
    notes: list[str] = field(default_factory=list)


@dataclass
class Report:
    run_id: str
    run_dir: str
    events_path: str
    history_source: str | None
    wall_start: float | None
    wall_end: float | None
    start_from: str
    end_from: str
    segments: list[Segment]
    drains: list[dict[str, Any]]
    drain_lag: list[tuple[float, float]]
    missing: list[str]
    incarnation_ends: list[dict[str, Any]]

    @property
    def wall_s(self) -> float:
        if self.wall_start is None or self.wall_end is None:
            return 0.0
        return max(0.0, self.wall_end - self.wall_start)

    def losses(self) -> dict[str, float]:
        out = {c: 0.0 for c in CAUSES}
        for s in self.segments:
            for c, v in s.losses.items():
                out[c] += v
        accounted = sum(out.values()) - out["other"] + self.kept_s()
        out["other"] = self.wall_s - accounted  # by definition: the rest (shutdowns, anything unexplained)
        return out

    def kept_s(self) -> float:
        return sum(s.kept for s in self.segments)

    def to_json(self) -> dict[str, Any]:
        wall = self.wall_s
        losses = self.losses()
        kept = self.kept_s()
        incs = []
        for n in sorted({s.incarnation for s in self.segments}):
            segs = [s for s in self.segments if s.incarnation == n]
            incs.append({
                "incarnation": n, "start": segs[0].start, "end": segs[-1].end,
                "end_reason": segs[-1].end_reason, "end_class": label(segs[-1].end_reason or "") or None,
                "end_evidence": segs[-1].end_evidence, "restored_step": segs[0].restored_step,
                "committed_step": segs[-1].committed_step,
                "steps_recomputed": _sum_opt(s.steps_recomputed for s in segs),
                "runs_of_ranks": [_seg_json(s) for s in segs],
            })
        return {
            "version": REPORT_VERSION, "run_id": self.run_id, "run_dir": self.run_dir, "events": self.events_path,
            "history": self.history_source, "wall_start": self.wall_start, "wall_end": self.wall_end,
            "wall_start_from": self.start_from, "wall_end_from": self.end_from, "wall_s": wall,
            "kept_s": kept, "goodput": (kept / wall) if wall > 0 else None,
            "losses_s": losses, "incarnations": incs,
            "saves": [v.to_json() | {"incarnation": s.incarnation, "attempt": s.attempt}
                      for s in self.segments for v in s.saves],
            "drains": self.drains,
            "drain_lag_max_s": max((lag for _, lag in self.drain_lag), default=None),
            "missing": self.missing,
        }


def _sum_opt(values: Iterable[int | None]) -> int | None:
    """The sum of the known values; None when none is known."""
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def _seg_json(s: Segment) -> dict[str, Any]:
    return {"attempt": s.attempt, "start": s.start, "end": s.end, "end_reason": s.end_reason,
            "end_evidence": s.end_evidence, "end_from": s.end_source, "restored_step": s.restored_step,
            "restore_tiers": s.restore_tiers, "restore_fetched_bytes": s.restore_fetched_bytes,
            "restore_failed": s.restore_failed, "train_start": s.train_start, "train_end": s.train_end,
            "kept_until": s.kept_until, "committed_step": s.committed_step, "last_step_seen": s.last_step_seen,
            "next_restored_step": s.next_restored_step, "steps_recomputed": s.steps_recomputed,
            "waiting_before_s": s.waiting_before, "kept_s": s.kept, "losses_s": dict(s.losses), "notes": s.notes}


# ---------------------------------------------------------------------------------------------- building
def _by(records: Sequence[dict[str, Any]], *names: str, source: str | None = None) -> list[dict[str, Any]]:
    return [r for r in records if r.get("event") in names and (source is None or r.get("source") == source)]


@dataclass(frozen=True)
class Bound:
    """Where a run of the ranks starts: ``start``, its incarnation and attempt, the waiting before it, what
    says so (``source``) and, after an in-job restart, the launcher's ``in_job_restart`` record."""

    start: float
    incarnation: int
    attempt: int
    waiting: float
    source: str
    restart: dict[str, Any] | None = None

    @property
    def previous_end(self) -> float:
        """Where the run of the ranks before this one ended."""
        return self.start - self.waiting


def _boundaries(records: Sequence[dict[str, Any]], history: ProgressHistory, missing: list[str]) -> list[Bound]:
    """Where each run of the ranks starts, oldest first, from the launcher's ``start`` and
    ``in_job_restart`` events; without them from the history; without either from the ranks' restores."""
    out: list[Bound] = []
    launcher = _by(records, "start", "in_job_restart", "ranks_not_started", source="launcher")
    if any(r["event"] == "start" for r in launcher):
        inc, attempt = -1, 0
        for r in launcher:
            if r["event"] == "start":
                inc, attempt = inc + 1, 0
                out.append(Bound(float(r["t"]), inc, 0, 0.0, "launcher start event"))
            elif r["event"] == "ranks_not_started":
                if out and out[-1].attempt:  # a stop in the backoff: that restart's run never began
                    out.pop()
                    attempt -= 1
            elif inc >= 0:
                attempt += 1
                backoff = max(0.0, _f(r.get("backoff_s")))
                out.append(Bound(float(r["t"]) + backoff, inc, attempt, backoff, "launcher in_job_restart event", r))
        return out
    if history.incarnations and all(e.started_at for e in history.incarnations):
        missing.append("no launcher events (start, in_job_restart): runs of the ranks are placed by the history")
        for n, e in enumerate(history.incarnations):
            out.append(Bound(float(e.started_at or 0.0), n, 0, 0.0, "history started_at"))
            for k, rr in enumerate(e.in_job):
                if rr.ended_at:
                    out.append(Bound(float(rr.ended_at), n, k + 1, 0.0, "history in_job ended_at"))
        return sorted(out, key=lambda b: b.start)
    missing.append("no launcher events and no history: each run of the ranks is taken to start at its ranks' "
                   "restore; incarnations and in-job restarts are not told apart, startup and waiting not known")
    seen: set[Any] = set()
    n = -1
    for r in _by(records, "restore", "restore_none", "restore_failed", source="rank"):
        key = (r.get("job_id"), r.get("restart_count"), r.get("rank"))
        if n < 0 or key in seen:
            n += 1
            seen = set()
            out.append(Bound(float(r["t"]) - max(0.0, _f(r.get("seconds"))), n, 0, 0.0, "ranks' restore events"))
        seen.add(key)
    return out


def _history_entry(history: ProgressHistory, start: float, n: int, by_time: bool) -> Incarnation | None:
    """The history entry of the ``n``-th incarnation, which started at ``start`` (matched by its start time
    when the launcher's events place the incarnations)."""
    if by_time:
        return next((e for e in history.incarnations if e.started_at and abs(e.started_at - start) < 1.0), None)
    return history.incarnations[n] if n < len(history.incarnations) else None


def build_report(run_dir: str, records: Sequence[dict[str, Any]], run_history: RunHistory | None,
                 problems: Sequence[str] = (), events_path: str | None = None) -> Report:
    """The report of the run in ``run_dir`` from its event ``records`` (time order) and its history."""
    missing = list(problems)
    history = run_history.history if run_history is not None else ProgressHistory()
    source = run_history.source if run_history is not None else None
    if source is None:
        missing.append("no history (launcher-history.json): why incarnations ended is taken from the events")
    if run_history is not None:
        missing += list(run_history.errors)
    run = RunDir.at(run_dir)
    records = [r for r in records if r.get("run_id") in (None, run.run_id)]
    activity = [r for r in records if r.get("source") in ("rank", "launcher")]
    bounds = _boundaries(records, history, missing)
    drains, lag = _drains(records)
    path = events_path or run.events
    if not bounds:
        missing.append("no launcher or rank events: no incarnation to report")
        return Report(run.run_id, run.path, path, source, None, None, "", "", [], drains, lag, missing, [])
    by_time = bounds[0].source == "launcher start event"
    last_activity = max((float(r["t"]) for r in activity), default=bounds[-1].start)
    hist_ends = [float(e.ended_at) for e in history.incarnations if e.ended_at]
    wall_end = max([last_activity, *hist_ends])
    end_from = "history ended_at" if hist_ends and max(hist_ends) > last_activity else "last launcher or rank event"
    inc_start = {b.incarnation: b.start for b in reversed(bounds)}
    segments: list[Segment] = []
    for i, b in enumerate(bounds):
        nxt = bounds[i + 1] if i + 1 < len(bounds) else None
        until = nxt.previous_end if nxt else wall_end
        recs = [r for r in activity if b.start - 1e-6 <= float(r["t"]) <= until + (0 if nxt else 1e-6)
                and (nxt is None or float(r["t"]) < nxt.start or nxt.attempt)]
        seg = Segment(b.incarnation, b.attempt, b.start, b.start, waiting_before=b.waiting)
        entry = _history_entry(history, inc_start[b.incarnation], b.incarnation, by_time)
        _fill(seg, recs, nxt, entry)
        segments.append(seg)
    for prev, seg in zip(segments, segments[1:]):
        if seg.attempt == 0:  # the requeue gap: from an incarnation's end to the next one's start
            prev.end = min(prev.end, seg.start)
            seg.waiting_before = max(0.0, seg.start - prev.end)
    segments[-1].end = max(segments[-1].end, wall_end)
    for seg in segments:
        _finish(seg)
    per = step_time([(seg.step_marks, seg.saves) for seg in segments])
    for i, seg in enumerate(segments):
        _account(seg, segments[i + 1] if i + 1 < len(segments) else None, per)
    ends = [{"incarnation": s.incarnation, "attempt": s.attempt, "reason": s.end_reason} for s in segments]
    return Report(run.run_id, run.path, path, source, segments[0].start, wall_end, bounds[0].source, end_from,
                  segments, drains, lag, missing, ends)


def _fill(seg: Segment, recs: Sequence[dict[str, Any]], nxt: Bound | None, entry: Incarnation | None) -> None:
    """What the events and the history say of one run of the ranks."""
    ranks = [r for r in recs if r.get("source") == "rank"]
    launcher = [r for r in recs if r.get("source") == "launcher"]
    # Restore: the slowest rank's; training starts when the last rank has restored.
    restores = _by(ranks, "restore", "restore_none", "restore_failed")
    ok = [r for r in restores if r["event"] != "restore_failed"]
    if ok and len(ok) == len(restores):
        last = max(ok, key=lambda r: float(r["t"]))
        seg.train_start = float(last["t"])
        seg.restore_begin = max(seg.start, seg.train_start - max(0.0, _f(last.get("seconds"))))
        steps = {s for r in ok if (s := _step(r.get("step"))) is not None}
        seg.restored_step = max(steps) if steps else None
        seg.restore_tiers = sorted({str(r.get("tier")) for r in ok if r["event"] == "restore" and r.get("tier")})
        seg.restore_fetched_bytes = sum(int(_f(r.get("fetched_bytes"))) for r in ok)
        if seg.restored_step is not None:
            seg.step_marks.append((seg.train_start, seg.restored_step))
    elif restores:
        seg.restore_failed = True
        seg.notes.append("the restore failed: no training")
    elif ranks:
        seg.train_start = seg.restore_begin = seg.start
        seg.notes.append("no restore event of its ranks: startup and restore are counted as training")
    elif _by(launcher, "ranks_not_started"):
        seg.notes.append("no rank started: a stop came first (ranks_not_started); its time is counted as startup")
    else:
        seg.notes.append("no event of its ranks: all of it is counted as startup")
    # Saves: per step, the largest stall of its ranks, ending when the last rank went on training.
    saves: dict[tuple[int, str], Save] = {}
    for r in _by(ranks, "save_staged"):
        step = _step(r.get("step"))
        if step is None:
            continue
        key = (step, str(r.get("reason")))
        stall = max(0.0, _f(r.get("stall_s")))
        cur = saves.get(key)
        if cur is None:
            saves[key] = Save(step, str(r.get("reason")), float(r["t"]), stall)
        else:  # the largest stall, ending when the last rank went on (records are in time order)
            cur.t, cur.stall_s = float(r["t"]), max(cur.stall_s, stall)
    for r in _by(ranks, "save_committed"):
        step = _step(r.get("step"))
        if step is not None and (cur := saves.get((step, str(r.get("reason"))))) is not None:
            cur.committed = True
            cur.total_s = max(cur.total_s or 0.0, _f(r.get("total_s")))
    seg.saves = sorted(saves.values(), key=lambda v: v.t)
    seg.step_marks += [(v.t, v.step) for v in seg.saves]
    seg.step_marks += [(float(r["t"]), st) for r in _by(ranks, "emergency_requested")
                       if (st := _step(r.get("step"))) is not None]
    # The launcher's last reading of the ranks' heartbeats: the furthest step begun, when (exact for killed ranks).
    reached = [(_f(r.get("last_step_t")), st) for r in _by(launcher, "ranks_exited")
               if (st := _step(r.get("last_step"))) is not None and _num(r.get("last_step_t"))]
    seg.step_marks += reached
    seg.launcher_last_step = max((st for _, st in reached), default=None)
    seg.step_marks.sort()
    seg.last_step_seen = max((st for _, st in seg.step_marks), default=None)
    # The end, and why.
    seg.end = max([seg.start, *(float(r["t"]) for r in recs)])
    if nxt is not None and nxt.attempt > 0:  # an in-job restart follows: this run ended where it says
        seg.end = max(seg.start, nxt.previous_end)
        if nxt.restart is not None:
            seg.end_reason = str(nxt.restart.get("outcome"))
            seg.end_evidence = str(nxt.restart.get("evidence") or "")
            seg.committed_step = _step(nxt.restart.get("committed_step"))
            seg.end_source = "in_job_restart event"
        elif entry is not None and nxt.attempt - 1 < len(entry.in_job):
            rr = entry.in_job[nxt.attempt - 1]
            seg.end_reason, seg.end_evidence, seg.committed_step = rr.reason, rr.evidence, rr.committed_step
            seg.end_source = "history (in-job restart)"
        return
    if entry is not None and entry.ended_at and (nxt is None or entry.ended_at <= nxt.start):
        seg.end = max(seg.end, float(entry.ended_at))
    decision = _by(launcher, "decision")
    requested = _by(launcher, "save_requested")
    if entry is not None:
        seg.end_reason, seg.end_evidence, seg.committed_step = entry.reason, entry.evidence, entry.committed_step
        seg.end_source = "history"
    elif decision:
        seg.end_reason = str(decision[-1].get("outcome"))
        seg.end_evidence = str(decision[-1].get("evidence") or "")
        seg.committed_step = _step(decision[-1].get("committed_step"))
        seg.end_source = "decision event"
    elif requested:
        seg.end_reason = str(requested[-1].get("reason"))
        seg.end_evidence = str(requested[-1].get("signal") or "")
        seg.end_source = "save_requested event"
    else:
        seg.notes.append("why it ended is not recorded (no history entry, decision or save request): still "
                         "running, or its launcher was killed")


def _finish(seg: Segment) -> None:
    """Where training ended: at the last step saved when the end was announced (an emergency save, the
    last step of a completed run); otherwise when the ranks were found dead (the run's end)."""
    if seg.committed_step is None:
        committed = [v.step for v in seg.saves if v.committed]
        seg.committed_step = max(committed) if committed else seg.restored_step
    if seg.train_start is None:
        return
    seg.train_start = min(max(seg.train_start, seg.start), seg.end)
    seg.train_end = seg.end
    announced = seg.end_reason in ANNOUNCED or any(v.reason == "emergency" for v in seg.saves)
    at = [v.t for v in seg.saves if v.step == seg.committed_step]
    if announced and at:
        seg.train_end = max(at)
    seg.train_end = min(max(seg.train_end, seg.train_start), seg.end)


def _account(seg: Segment, nxt: Segment | None, per: float | None) -> None:
    """Cut a run of the ranks into kept training and losses. The steps kept are those up to the step the
    next run of the ranks restored (all of them for the last run)."""
    losses = {c: 0.0 for c in CAUSES}
    losses["waiting"] = seg.waiting_before
    if seg.train_start is None:  # no restore (failed, or not recorded): all of it is startup
        losses["startup"] = seg.end - seg.start
        seg.losses = losses
        return
    begin = seg.restore_begin if seg.restore_begin is not None else seg.start
    losses["startup"] = begin - seg.start
    losses["restore"] = seg.train_start - begin
    assert seg.train_end is not None
    kept_until = seg.train_end
    if nxt is not None:
        nxt_step = nxt.restored_step
        seg.next_restored_step = nxt_step
        if nxt_step is None or (seg.restored_step is not None and nxt_step <= seg.restored_step):
            kept_until = seg.train_start  # the next run of the ranks started over from before this one
        else:
            marks = [t for t, s in seg.step_marks if s == nxt_step]
            if marks:
                kept_until = min(max(marks), seg.train_end)
            elif seg.last_step_seen is None or nxt_step > seg.last_step_seen:
                kept_until = seg.train_end
                seg.notes.append(f"the next run restored step {nxt_step}, not seen in this run's events")
            else:
                seg.notes.append(f"step {nxt_step} (restored next) was not marked here: kept up to the last mark "
                                 "before it")
                kept_until = max([seg.train_start] + [t for t, s in seg.step_marks if s <= nxt_step])
    seg.kept_until = kept_until
    stall_kept = stall_lost = 0.0
    for v in seg.saves:
        a, b = max(v.t - v.stall_s, seg.train_start), min(v.t, seg.train_end)
        if b <= a:
            continue
        stall_kept += max(0.0, min(b, kept_until) - a)
        stall_lost += max(0.0, b - max(a, kept_until))
    losses["save_stall"] = stall_kept + stall_lost
    seg.kept = max(0.0, kept_until - seg.train_start - stall_kept)
    losses["recomputed"] = max(0.0, seg.train_end - kept_until - stall_lost)
    losses["other"] = seg.end - seg.train_end
    seg.losses = losses
    # Steps trained again: from the step the next run restored to the last this one reached. The events
    # mark only some steps (saves, emergency requests): past the last mark, estimated from the step time.
    if nxt is not None and nxt.restored_step is not None and seg.launcher_last_step is not None:
        seg.steps_recomputed = max(0, max(seg.launcher_last_step, seg.last_step_seen or 0) - nxt.restored_step)
    elif nxt is not None and nxt.restored_step is not None and losses["recomputed"] > 0:
        seen = seg.last_step_seen if seg.last_step_seen is not None else nxt.restored_step
        after = [t for t, s in seg.step_marks if s == seen]
        extra = int((seg.train_end - max(after)) / per) if after and per else 0
        seg.steps_recomputed = max(0, seen + extra - nxt.restored_step)
    elif nxt is not None:
        seg.steps_recomputed = 0


def step_time(runs: Iterable[tuple[Sequence[tuple[float, int]], Sequence[Save]]]) -> float | None:
    """Median seconds per step between consecutive step marks ``(t, step)`` within each run of the ranks
    (``runs``: its marks and saves), the saves' stalls left out; None without two marks in a run."""
    rates = []
    for marks, saves in runs:
        for (t0, s0), (t1, s1) in zip(marks, marks[1:]):
            if s1 > s0:
                stall = sum(v.stall_s for v in saves if t0 < v.t <= t1)
                rates.append(max(0.0, t1 - t0 - stall) / (s1 - s0))
    if not rates:
        return None
    rates.sort()
    return rates[len(rates) // 2]


def _drains(records: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[tuple[float, float]]]:
    """Each drain of a step (start, end, seconds, bytes, state) and the drain lag over time."""
    open_: dict[int, float] = {}
    out: list[dict[str, Any]] = []
    lag: list[tuple[float, float]] = []
    for r in records:
        if r.get("source") != "daemon":
            continue
        step = _step(r.get("step"))
        if r["event"] == "drain_started" and step is not None:
            open_.setdefault(step, float(r["t"]))
        elif r["event"] == "drained" and step is not None:
            t0 = open_.pop(step, float(r["t"]) - _f(r.get("seconds")))
            out.append({"step": step, "start": t0, "end": float(r["t"]), "seconds": _f(r.get("seconds")),
                        "bytes": int(_f(r.get("bytes"))), "state": r.get("state")})
        elif r["event"] == "drain_lag":
            lag.append((float(r["t"]), _f(r.get("seconds"))))
    return out, lag


def report_run(root: str, run_id: str, run_history: RunHistory | None) -> Report:
    """Read ``run_id``'s event log under ``root`` and build its report."""
    run = RunDir(root, run_id)
    log = read_events(run.events)
    return build_report(run.path, log.records, run_history, log.problems, run.events)


# ---------------------------------------------------------------------------------------------- text
def _dur(s: float | None) -> str:
    if s is None:
        return "-"
    if s >= 3600:
        return f"{s / 3600:.2f} h"
    if s >= 120:
        return f"{s / 60:.1f} min"
    return f"{s:.2f} s"


CAUSE_LABELS = {"save_stall": "save stalls", "startup": "startup", "restore": "restores",
                "recomputed": "recomputed steps", "waiting": "waiting (requeue, restart backoff)", "other": "other"}


def format_report(doc: Mapping[str, Any]) -> str:
    """The text of ``rslurm report``."""
    lines = [f"run {doc['run_id']}  ({doc['run_dir']})"]
    wall = doc["wall_s"]
    if doc["goodput"] is not None:
        lines.append(f"  wall {_dur(wall)}  kept training {_dur(doc['kept_s'])}  goodput {doc['goodput']:.1%}")
        for c in CAUSES:
            v = doc["losses_s"][c]
            lines.append(f"    {CAUSE_LABELS[c]:<36} {_dur(v):>10}  {v / wall if wall else 0:6.1%}")
    for inc in doc["incarnations"]:
        lines.append(f"  incarnation {inc['incarnation']}: {_dur(inc['end'] - inc['start'])}, restored "
                     f"{_opt(inc['restored_step'])}, committed {_opt(inc['committed_step'])}, ended "
                     f"{inc['end_class'] or 'unknown'}" + (f" ({inc['end_evidence']})" if inc["end_evidence"] else ""))
        for s in inc["runs_of_ranks"]:
            tiers = "/".join(s["restore_tiers"]) or ("none" if s["restored_step"] is None else "?")
            lines.append(f"    run {s['attempt']}: restored {_opt(s['restored_step'])} ({tiers}) in "
                         f"{_dur(s['losses_s']['restore'])} after {_dur(s['losses_s']['startup'])} of startup; "
                         f"{len([v for v in doc['saves'] if v['incarnation'] == inc['incarnation'] and v['attempt'] == s['attempt']])} saves, "
                         f"stalls {_dur(s['losses_s']['save_stall'])}; ended {label(s['end_reason'] or '') or 'unknown'}"
                         + (f"; {s['steps_recomputed']} steps recomputed ({_dur(s['losses_s']['recomputed'])})"
                            if s["steps_recomputed"] else ""))
    if doc["drains"]:
        lines.append(f"  drains: {len(doc['drains'])}, longest {_dur(max(d['seconds'] for d in doc['drains']))}, "
                     f"max drain lag {_dur(doc['drain_lag_max_s'])}")
    for m in doc["missing"]:
        lines.append(f"  missing: {m}")
    return "\n".join(lines)


def _opt(v: Any) -> str:
    return "-" if v is None else str(v)


# ---------------------------------------------------------------------------------------------- picture
COLORS = {"kept": "#2ca02c", "save_stall": "#d62728", "startup": "#9467bd", "restore": "#1f77b4",
          "recomputed": "#ff7f0e", "waiting": "#7f7f7f", "other": "#c7c7c7"}


def plot_report(doc: Mapping[str, Any], out: str) -> None:
    """Draw the run's timeline and goodput to the PNG ``out``. Raises ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    t0 = doc["wall_start"] or 0.0
    fig, (ax, axs, axg) = plt.subplots(3, 1, figsize=(13, 8.5), height_ratios=[2.2, 2.2, 0.9],
                                       constrained_layout=True)
    lanes = {"incarnations": 3, "time": 2, "saves": 1, "drains": 0}
    for inc in doc["incarnations"]:
        for s in inc["runs_of_ranks"]:
            x0, x1 = s["start"] - t0, s["end"] - t0
            ax.broken_barh([(x0, x1 - x0)], (lanes["incarnations"] - 0.35, 0.7), color="#dbe9f6", edgecolor="#1f77b4")
            name = f"#{inc['incarnation']}" + (f".{s['attempt']}" if s["attempt"] else "")
            why = label(s["end_reason"] or "") or "?"
            ax.text((x0 + x1) / 2, lanes["incarnations"], f"{name}: {why}", ha="center", va="center", fontsize=8,
                    clip_on=True)
            spans = _spans(s, t0)
            for cause, a, b in spans:
                ax.broken_barh([(a, b - a)], (lanes["time"] - 0.35, 0.7), color=COLORS[cause])
    for v in doc["saves"]:
        x = v["t"] - t0
        ax.plot([x], [lanes["saves"]], marker="v" if v["reason"] == "emergency" else "|", markersize=10,
                color=COLORS["save_stall"] if v["reason"] == "emergency" else "#444444")
    for d in doc["drains"]:
        ax.broken_barh([(d["start"] - t0, max(d["end"] - d["start"], 1e-3))], (lanes["drains"] - 0.3, 0.6),
                       color="#17becf")
    ax.set_yticks(list(lanes.values()), ["runs of the ranks", "time spent", "saves (v: emergency)", "drains"])
    ax.set_ylim(-0.7, 3.7)
    ax.set_xlim(0, max(doc["wall_s"], 1e-6))
    ax.set_xlabel("seconds since the run started")
    ax.set_title(f"run {doc['run_id']}: timeline", loc="left")
    ax.legend(handles=[Patch(color=COLORS[c], label=("kept training" if c == "kept" else CAUSE_LABELS[c]))
                       for c in COLORS], loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=7, fontsize=8,
              frameon=False)
    # Steps over time: where each run of the ranks restored and how far it got.
    for inc in doc["incarnations"]:
        for s in inc["runs_of_ranks"]:
            pts = s.get("_marks") or []
            if pts:
                axs.plot([t - t0 for t, _ in pts], [st for _, st in pts], marker=".", label=f"#{inc['incarnation']}"
                         + (f".{s['attempt']}" if s["attempt"] else ""))
    axs.set_ylabel("step (events that name one)")
    axs.set_xlim(0, max(doc["wall_s"], 1e-6))
    axs.grid(alpha=0.3)
    if axs.get_legend_handles_labels()[0]:
        axs.legend(fontsize=8, title="run of the ranks", title_fontsize=8, loc="upper left")
    # Goodput: one bar, kept then each loss.
    wall = doc["wall_s"] or 1.0
    left = 0.0
    parts = [("kept", doc["kept_s"])] + [(c, doc["losses_s"][c]) for c in CAUSES]
    for cause, v in parts:
        if v <= 0:
            continue
        axg.barh([0], [v / wall], left=[left], color=COLORS[cause])
        if v / wall > 0.06:
            axg.text(left + v / wall / 2, 0, f"{'kept' if cause == 'kept' else CAUSE_LABELS[cause].split(' (')[0]}\n"
                     f"{v / wall:.0%}", ha="center", va="center", fontsize=8)
        left += v / wall
    axg.set_xlim(0, 1)
    axg.set_yticks([])
    good = doc["goodput"]
    axg.set_title(f"goodput {good:.1%} of {_dur(doc['wall_s'])}" if good is not None else "goodput unknown",
                  loc="left")
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _spans(s: Mapping[str, Any], t0: float) -> list[tuple[str, float, float]]:
    """A run of the ranks as labelled spans (seconds since ``t0``) for the timeline."""
    out: list[tuple[str, float, float]] = []
    start, end = s["start"] - t0, s["end"] - t0
    if s["waiting_before_s"]:
        out.append(("waiting", start - s["waiting_before_s"], start))
    if s["train_start"] is None:
        out.append(("startup", start, end))
        return out
    ts, te = s["train_start"] - t0, s["train_end"] - t0
    ku = (s["kept_until"] if s["kept_until"] is not None else s["train_end"]) - t0
    rb = ts - s["losses_s"]["restore"]
    out += [("startup", start, rb), ("restore", rb, ts), ("kept", ts, ku), ("recomputed", ku, te), ("other", te, end)]
    for a, b in s.get("_stalls") or []:
        out.append(("save_stall", a - t0, b - t0))
    return [(c, a, b) for c, a, b in out if b > a]


def plot_doc(report: Report) -> dict[str, Any]:
    """The JSON document with what the picture needs beyond it (step marks, stall spans) under ``_`` keys."""
    doc = report.to_json()
    k = 0
    for inc in doc["incarnations"]:
        for s in inc["runs_of_ranks"]:
            seg = report.segments[k]
            k += 1
            s["_marks"] = list(seg.step_marks)
            s["_stalls"] = [(v.t - v.stall_s, v.t) for v in seg.saves]
    return doc


def write_png(report: Report, out: str) -> None:
    """``plot_report`` of ``report`` to ``out`` (written to a temporary name, then renamed)."""
    tmp = f"{out}.tmp-{os.getpid()}.png"
    try:
        plot_report(plot_doc(report), tmp)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


__all__ = ["ANNOUNCED", "CAUSES", "EventLogRead", "Report", "Save", "Segment", "build_report", "format_report",
           "plot_report", "read_events", "report_run", "step_time", "write_png"]
