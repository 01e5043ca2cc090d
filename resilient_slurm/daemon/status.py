"""``rslurm status``: every step's state per tier, from the local tier, the daemon's status file and the
durable tier. Read-only; works with or without a daemon running.

States of a step:

* local tier: ``in_progress`` (a ``step_X.tmp-*`` directory: a save being written, or abandoned),
  ``committed`` (manifest present), ``-`` (not on this node: evicted, or never here);
* drain: the daemon's view: ``draining`` (transfer under way), ``waiting`` (this node's shards are
  durable, other nodes' are not yet), ``failed`` (with the error), ``local`` (not drained: retention
  would not keep it in the durable tier);
* durable tier: ``durable`` (its manifest is there), ``partial k/n`` (markers of k of n domains),
  ``-`` (nothing there).

The drain lag is the age of the oldest committed local step newer than the newest durable step: how far
the durable tier trails this node. The run's history (``catalog/history.py``) adds how its last incarnation
ended, with the evidence, and how many ends of each class it had. The ranks that rank 0 last found slower
than their peers (``<run dir>/stragglers.json``, checkpoint/stragglers.py) are listed when there are any.
So are the peer replicas this node holds (``<run dir>/replicas/<domain>/``: spare copies of a partner
domain's steps, never among the run's own steps): per run and partner domain, the committed replica steps
and their size, and the steps being received.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from ..catalog.history import label, read_history, summary
from ..catalog.inventory import scan_replicas
from ..checkpoint.stragglers import read_status as read_stragglers
from ..config import Settings
from ..errors import ConfigError, ResilientSlurmError
from ..layout import RUN_LINK, list_run_dir, root_runs, run_links
from ..manifest import durable_partial_steps
from ..rundir import RunDir
from .drain import drain_lag, durable_steps, scan_local
from .service import daemon_running, read_status, status_path


def _committed(root: str, run: str) -> list[int]:
    """The run's committed step directories (none when it cannot be listed: reported as unreachable already)."""
    try:
        return list_run_dir(RunDir(root, run).path).committed
    except OSError:
        return []


def _tmp_steps(root: str, run: str) -> list[int]:
    try:
        return [t.step for t in list_run_dir(RunDir(root, run).path).in_progress()]
    except OSError:
        return []


# The fields of a step in the daemon's status file, and what each must be to be shown.
_STEP_FIELDS: dict[str, Any] = {"state": str, "created_at": (int, float), "error": str, "next_retry_at": (int, float),
                                "throughput": (int, float)}


def _daemon_steps(daemon: Mapping[str, Any] | None, root: str, errors: list[str]) -> dict[tuple[str, int], Any]:
    """The daemon's steps by (run, step), each with only the fields of the right type; an entry or field of another
    shape (a damaged or foreign status file) is left out and named in ``errors``, once (the daemon rewrites it)."""
    steps = (daemon or {}).get("steps", [])
    out: dict[tuple[str, int], Any] = {}
    bad = not isinstance(steps, list)
    for s in steps if isinstance(steps, list) else []:
        if (not isinstance(s, dict) or not isinstance(s.get("run_id"), str) or type(s.get("step")) is not int):
            bad = True
            continue
        d = {k: v for k, v in s.items() if k in _STEP_FIELDS and isinstance(v, _STEP_FIELDS[k])
             and not isinstance(v, bool)}
        w = s.get("waiting_for")
        if isinstance(w, list) and all(isinstance(n, str) for n in w):
            d["waiting_for"] = w
        bad = bad or any(k not in d for k in s if k in (*_STEP_FIELDS, "waiting_for") and s[k] is not None)
        out[(s["run_id"], s["step"])] = d
    if bad:
        errors.append(f"daemon status {status_path(root)}: a step entry or field of another shape than the daemon writes was "
                      "left out (a damaged file: the daemon rewrites it as it drains)")
    return out


def collect_status(root: str, cfg: Settings, *, run_id: str | None = None,
                   now: float | None = None) -> dict[str, Any]:
    """The status report as a JSON-able dict."""
    now = time.time() if now is None else now
    errors: list[str] = []
    unreachable: list[str] = []  # a tier that could not be listed (exit 2); ``errors`` also has damaged files
    damaged: dict[str, str] = {}  # a committed local step whose manifest cannot be used: its path -> why

    def not_listed(path: str, why: str) -> None:  # a run directory that cannot be listed, else a damaged step
        if why.startswith("cannot list it"):
            unreachable.append(f"local tier {path}: {why}")
        else:
            damaged[path] = why
            errors.append(f"local tier {path}: {why} (`rslurm verify` checks the step)")

    try:
        local = scan_local(root, [run_id] if run_id else None, invalid=not_listed)
        local_runs = root_runs(root) if not run_id else []
        # A run-named link is never followed: named, as `ls` and `runs` name it (with --run-id, scan_local does).
        unreachable += [f"local tier {RunDir(root, n).path}: cannot list it: {RUN_LINK}"
                        for n in (run_links(root) if not run_id else [])]
    except OSError as exc:
        unreachable.append(f"local tier {root}: cannot list it: {exc.strerror}")
        local, local_runs = [], []
    except ConfigError as exc:  # the nodes' roots where its runs go: no run of it is one
        unreachable.append(str(exc))
        local, local_runs = [], []
    daemon = read_status(root)
    alive = daemon_running(root)
    dstate = _daemon_steps(daemon, root, errors)
    runs = sorted({s.run_id for s in local} | ({run_id} if run_id else set()) | set(local_runs))
    tier = None
    if cfg.durable:
        from ..storage import open_durable

        try:
            tier = open_durable(cfg, upload_cap=False, create=False)
        except ResilientSlurmError as exc:
            unreachable.append(f"durable tier {cfg.durable}: {exc}")
    unknown = "?" if cfg.durable and tier is None else "-"  # a durable tier that could not be opened
    rows: list[dict[str, Any]] = []
    lags: dict[str, float] = {}
    histories: dict[str, Any] = {}
    stragglers: dict[str, Any] = {}
    replicas: dict[str, list[dict[str, Any]]] = {}
    try:
        for run in runs:
            held = scan_replicas(root, run, errors)
            if held:
                replicas[run] = [{"domain": rs.domain, "steps": [r.step for r in rs.steps], "bytes": rs.bytes,
                                  "receiving": [st for st, _ in rs.receiving]} for rs in held]
            strag = read_stragglers(RunDir(root, run).path)
            if strag is not None and strag["stragglers"]:
                stragglers[run] = strag
            h = read_history(root, run, tier)
            errors += list(h.errors)
            if (last := summary(h)) is not None:
                histories[run] = last
            by_step: dict[int, dict[str, Any]] = {}

            def row(step: int, by_step: dict[int, dict[str, Any]] = by_step, run: str = run) -> dict[str, Any]:
                return by_step.setdefault(step, {"run_id": run, "step": step, "local": "-", "drain": None,
                                                 "durable": unknown, "reason": None, "bytes": None,
                                                 "created_at": None})

            for s in local:
                if s.run_id == run:
                    r = row(s.step)
                    r.update(local="committed", reason=s.manifest.reason, bytes=s.local_bytes,
                             created_at=s.manifest.created_at, domains=len(s.manifest.nodes))
            for step in _committed(root, run) if damaged else ():
                if RunDir(root, run).step(step) in damaged:
                    row(step)["local"] = "invalid"  # not "-": the copy is there, and cannot be drained
            for step in _tmp_steps(root, run):
                if by_step.get(step, {}).get("local") != "committed":
                    row(step)["local"] = "in_progress"
            durable: list[int] = []
            listed = tier is not None
            if tier is not None:
                try:
                    durable = durable_steps(tier, run)
                    for step in durable:
                        row(step)["durable"] = "durable"
                    for step_n, marks in durable_partial_steps(tier, run).items():
                        r = row(step_n)
                        n = r.get("domains") or "?"
                        r["durable"] = f"partial {len(marks)}/{n}"
                except ResilientSlurmError as exc:
                    unreachable.append(f"durable tier {tier.url}, run {run}: {exc}")
                    listed = False  # what is durable is unknown: "?", and no drain lag (every step would count)
                    for r in by_step.values():
                        if r["durable"] == "-":
                            r["durable"] = "?"
            for step, r in by_step.items():
                d = dstate.get((run, step))
                if d is not None and d.get("created_at") == r.get("created_at"):
                    r["drain"] = d.get("state")
                    if d.get("waiting_for"):
                        r["waiting_for"] = d["waiting_for"]
                    if d.get("error"):
                        r["error"] = d["error"]
                    if d.get("next_retry_at") is not None:
                        r["next_retry_at"] = d["next_retry_at"]
                    if d.get("throughput"):
                        r["drain_mib_s"] = round(d["throughput"] / 2**20, 1)
            if listed:
                lags[run] = drain_lag([(r["step"], r["created_at"]) for r in by_step.values()
                                       if r["local"] == "committed" and r["created_at"]], durable, now)[0]
            rows.extend(by_step[s] for s in sorted(by_step))
    finally:
        if tier is not None:
            tier.close()
    return {"local_root": root, "durable": cfg.durable, "daemon": {
        "running": alive, "pid": (daemon or {}).get("pid"), "updated_at": (daemon or {}).get("updated_at"),
        "current": (daemon or {}).get("current")}, "drain_lag_s": lags, "steps": rows, "history": histories,
        "stragglers": stragglers, "replicas": replicas, "errors": unreachable + errors, "unreachable": unreachable}


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def format_status(report: Mapping[str, Any]) -> str:
    """A readable table of :func:`collect_status`'s report."""
    d = report["daemon"]
    lines = [f"local tier   {report['local_root']}", f"durable tier {report['durable'] or '(not set)'}"]
    if d["running"]:
        cur = d.get("current")
        doing = (f"draining run {cur['run_id']} step {cur['step']}: {_size(cur['bytes_done'])} of "
                 f"{_size(cur['bytes_total'])}" if cur else "idle")
        lines.append(f"daemon       running (pid {d['pid']}), {doing}")
    else:
        lines.append("daemon       not running on this node" + (" (status from its last run below)"
                                                               if d.get("updated_at") else ""))
    for run, lag in sorted(report["drain_lag_s"].items()):
        lines.append(f"drain lag    run {run}: {lag:.0f} s")
    for run, h in sorted(report.get("history", {}).items()):
        counts = ", ".join(f"{n} {label(r)}" for r, n in sorted(h["ends"].items()))
        lines.append(f"last end     run {run}: {h['last_class']} ({h['last_evidence'] or 'no evidence'}); "
                     f"{h['incarnations']} incarnation(s): {counts}; rslurm history --run-id {run}")
    for run, st in sorted(report.get("stragglers", {}).items()):
        when = f"at step {st['step']}" if st.get("step") is not None else "at an unknown step"
        if st.get("at"):
            when += f", {max(0, int(time.time() - st['at']))} s ago"
        for s in st["stragglers"]:
            lines.append(f"straggler    run {run}: rank {s['rank']} on {s['node']}: {s['ratio']:.2f}x its peers' "
                         f"step time ({s['step_time_s'] * 1e3:.1f} ms against {s['peer_median_s'] * 1e3:.1f} ms), "
                         f"{when}")
    for run, held in sorted(report.get("replicas", {}).items()):
        parts = []
        for h in held:
            whose = f"{h['domain']}'s "
            what = []
            if h["steps"]:
                what.append(f"{whose}step{'s' if len(h['steps']) > 1 else ''} {', '.join(map(str, h['steps']))} "
                            f"({_size(h['bytes'])})")
            if h["receiving"]:
                what.append(f"receiving {'' if h['steps'] else whose}step{'s' if len(h['receiving']) > 1 else ''} "
                            f"{', '.join(map(str, h['receiving']))}")
            parts.append(" and ".join(what))
        lines.append(f"replicas     run {run}: {'; '.join(parts)}")
    lines.append("")
    lines.append(f"{'RUN':<16} {'STEP':>10} {'REASON':<9} {'SIZE':>10} {'LOCAL':<11} {'DRAIN':<9} {'DURABLE':<12} AGE")
    now = time.time()
    for r in report["steps"]:
        age = f"{max(0, int(now - r['created_at']))}s" if r.get("created_at") else "-"
        drain = r.get("drain") or "-"
        lines.append(f"{r['run_id']:<16} {r['step']:>10} {r.get('reason') or '-':<9} {_size(r.get('bytes')):>10} "
                     f"{r['local']:<11} {drain:<9} {r['durable']:<12} {age}")
        if r.get("waiting_for"):
            lines.append(f"{'':<28}waiting for nodes: {', '.join(r['waiting_for'])}")
        if r.get("error"):
            retry = (f" (retried in {max(0, int(r['next_retry_at'] - now))} s)"
                     if isinstance(r.get("next_retry_at"), (int, float)) else "")
            lines.append(f"{'':<28}error: {r['error']}{retry}")
    if not report["steps"]:
        lines.append("(no checkpoints)")
    for e in report["errors"]:
        lines.append(f"error: {e}")
    return "\n".join(lines)


__all__ = ["collect_status", "format_status"]
