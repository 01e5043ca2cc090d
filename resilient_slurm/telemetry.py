"""Telemetry: the per-run event log (JSON lines) and the drain daemon's Prometheus textfile.

Who writes what (the schema, every event and every metric: docs/telemetry.md):

* The event log of a run on a node is ``<local root>/<run_id>/events.jsonl``. Every component on that
  node appends to it through its own :class:`EventLog`: each rank (the
  :class:`~resilient_slurm.checkpoint.checkpointer.Checkpointer`: saves, restores, emergency requests),
  the launcher (signals, deadlines, requeue decisions) and the drain daemon (transfers, durable commits,
  retention, eviction, drain lag). Records carry ``source`` (``rank``, ``launcher``, ``daemon``).
* :meth:`EventLog.emit` formats one complete line and hands it to the kernel in one ``os.write`` on an
  ``O_APPEND`` descriptor: appends by several processes to one file on a local filesystem do not
  interleave (lines are kept under :data:`MAX_LINE` bytes). No fsync: an event log is for people and
  monitoring, not for recovery, and a save's stall must not pay for it. It never raises: a failing
  event log logs one warning per log and training goes on. The file is opened without following a
  symlink (at the run directory or the file) and without blocking on a FIFO, and must be a regular file
  (:func:`~resilient_slurm.paths.open_regular` with the local root); anything else is refused that way
  (one warning naming the path; the events are dropped).
* The daemon, after every transfer and at least every poll interval, builds a :class:`DaemonMetrics`
  snapshot and calls :func:`write_metrics_textfile`, which renders :data:`METRICS` with
  ``prometheus_client`` and replaces the ``.prom`` file atomically (temp file, rename) for
  node_exporter's textfile collector.

Standard library only at import time (the launcher and the CLI import this module without torch);
``prometheus_client`` is imported when the first textfile is written.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from .errors import ConfigError
from .paths import open_regular
from .rundir import EVENTS_FILE, RunDir

log = logging.getLogger(__name__)

SOURCES = ("rank", "launcher", "daemon")
# Below PIPE_BUF (4096 on Linux): small enough to be one write everywhere; longer strings are cut.
MAX_LINE = 4000
_CUT = 300  # a string field longer than this is cut when a line would exceed MAX_LINE


def events_path(root: str, run_id: str) -> str:
    """The event log of ``run_id`` under a node-local root."""
    return RunDir(root, run_id).events


class Event(StrEnum):
    """Every event name the product writes to a run's ``events.jsonl``, in one place (docs/telemetry.md
    documents each with its fields, and tests/test_telemetry.py checks the two agree). A member is the
    string it names, so records are unchanged."""

    CADENCE = "cadence"
    CODE_VERSION_CHANGED = "code_version_changed"
    COMMAND_LINE_CHANGED = "command_line_changed"
    COMMITTED = "committed"
    DEADLINE_MISSED = "deadline_missed"
    DECISION = "decision"
    DRAIN_FAILED = "drain_failed"
    DRAIN_LAG = "drain_lag"
    DRAIN_PROGRESS = "drain_progress"
    DRAIN_RETRY = "drain_retry"
    DRAIN_STARTED = "drain_started"
    DRAINED = "drained"
    DURABLE = "durable"
    DURABLE_COMMIT = "durable_commit"
    EMERGENCY_REQUESTED = "emergency_requested"
    EVICTED = "evicted"
    HANG = "hang"
    IN_JOB_RESTART = "in_job_restart"
    LAUNCHER_GONE = "launcher_gone"
    NODE_UNHEALTHY = "node_unhealthy"
    NOT_DURABLE = "not_durable"
    NOT_REQUEUED = "not_requeued"
    ORPHAN_TIMEOUT = "orphan_timeout"
    PEER_REPLICA = "peer_replica"
    RANKS_EXITED = "ranks_exited"
    RANKS_NOT_STARTED = "ranks_not_started"
    REPLICA_MISMATCH = "replica_mismatch"
    REQUEUE_CALL = "requeue_call"
    RESTORE = "restore"
    RESTORE_FAILED = "restore_failed"
    RESTORE_NONE = "restore_none"
    RESUME_DIVERGED = "resume_diverged"
    RESUME_VERIFIED = "resume_verified"
    RETENTION_DELETED = "retention_deleted"
    SAVE_COMMITTED = "save_committed"
    SAVE_FAILED = "save_failed"
    SAVE_REQUESTED = "save_requested"
    SAVE_SIGNAL_DEFERRED = "save_signal_deferred"
    SAVE_SIGNAL_SENT = "save_signal_sent"
    SAVE_SIGNAL_WITHHELD = "save_signal_withheld"
    SAVE_STAGED = "save_staged"
    SAVE_STARTED = "save_started"
    SIGNAL = "signal"
    START = "start"
    STARTUP_FAILED = "startup_failed"
    STARTUP_NOT_JUDGED = "startup_not_judged"
    STRAGGLER = "straggler"
    STRAGGLER_CLEARED = "straggler_cleared"
    TAGGED = "tagged"


class ExactFloat(float):
    """A float an event keeps to the last bit (``resume_diverged``'s ``before`` and ``after``: values that
    differ by 1e-12 must not be written as equal); every other float is rounded by :func:`_compact`."""


def _compact(value: Any) -> Any:
    """Floats rounded to microseconds/bytes-per-second precision: shorter lines, same meaning."""
    if isinstance(value, float) and not isinstance(value, ExactFloat):
        return round(value, 6)
    return value


class EventLog:
    """Appends events of one run, written by one component of one node, to the run's ``events.jsonl``.

    ``context`` fields (``job_id``, ``rank``, ``restart_count``) go into every record after the common
    ones (``t``, ``event``, ``source``, ``node``, ``run_id``). ``keep_open=False`` opens and closes the
    file for each event (the daemon and the launcher: few events, and a run directory that may be
    deleted and created again underneath them); ranks keep the descriptor open so that an event costs
    one ``write``. Thread-safe.
    """

    def __init__(self, root: str, run_id: str, *, source: str, node: str, keep_open: bool = True,
                 clock: Callable[[], float] = time.time, **context: Any) -> None:
        if source not in SOURCES:
            raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
        self.root = root
        self.path = events_path(root, run_id)
        self.keep_open = keep_open
        self._clock = clock
        self._head = {"source": source, "node": node, "run_id": run_id, **context}
        self._fd: int | None = None
        self._lock = threading.Lock()
        self._warned = False
        self.failures = 0

    def emit(self, event: Event, **fields: Any) -> None:
        """Append one record; never raises (a failure is logged once per log, then counted)."""
        try:
            with self._lock:
                rec = {"t": self._clock(), "event": event, **self._head}
                for k, v in fields.items():
                    rec.setdefault(k, _compact(v))  # the common fields win: events must not reuse their names
                self._write(_line(rec))
        except Exception as exc:  # an event log must never break training or a drain
            self.failures += 1
            if self._fd is not None:
                self._close_fd()  # reopen next time: the file may have been removed or the disk replaced
            level = logging.DEBUG if self._warned else logging.WARNING
            self._warned = True
            log.log(level, "cannot append to the event log %s (%s); events are dropped until it works again",
                    self.path, exc)

    def _write(self, data: bytes) -> None:
        fd = self._fd if self._fd is not None else self._open()
        try:
            n = os.write(fd, data)
            if n != len(data):  # only on a full disk; never leave half a line without a newline
                os.write(fd, b"\n")
                raise OSError(f"short write ({n} of {len(data)} bytes)")
        finally:
            if not self.keep_open:
                os.close(fd)
                self._fd = None

    def _open(self) -> int:
        # Never through a symlink (the run directory or the file), never blocking on a FIFO, only a regular
        # file: anything else raises ConfigError naming the path, which emit() logs once (then drops events).
        fd = open_regular(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600, root=self.root, make_dirs=True)
        self._fd = fd
        return fd

    def _close_fd(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

    def close(self) -> None:
        """Close the descriptor (the next event reopens the file)."""
        with self._lock:
            self._close_fd()


def _line(rec: dict[str, Any]) -> bytes:
    data = (json.dumps(rec, separators=(",", ":"), default=str) + "\n").encode()
    if len(data) <= MAX_LINE:
        return data
    # Long error messages or step lists: cut them, never the record.
    for k, v in rec.items():
        if isinstance(v, str) and len(v) > _CUT:
            rec[k] = v[:_CUT] + "...[cut]"
        elif isinstance(v, list) and len(v) > 50:
            rec[k] = [*v[:50], "...[cut]"]
    data = (json.dumps(rec, separators=(",", ":"), default=str) + "\n").encode()
    if len(data) > MAX_LINE:
        keep = {k: rec[k] for k in ("t", "event", "source", "node", "run_id") if k in rec}
        data = (json.dumps({**keep, "cut": True}, default=str) + "\n").encode()
    return data


# --------------------------------------------------------------------------- Prometheus textfile
@dataclass(frozen=True)
class MetricSpec:
    """One metric of the daemon's textfile (the same list is the table in docs/telemetry.md)."""

    name: str
    kind: str  # gauge | counter
    labels: tuple[str, ...]
    help: str


# Every sample carries the node and the daemon's local root: one daemon per local root (its lock), and
# several per node where each user runs their own (docs/systemd), so (node, local_root) names a daemon and
# their textfiles never collide in node_exporter.
_NODE = ("node", "local_root")
_RUN = ("node", "local_root", "run_id")
METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("rslurm_daemon_up", "gauge", _NODE, "1 while the drain daemon runs; 0 after a clean exit"),
    MetricSpec("rslurm_daemon_start_time_seconds", "gauge", _NODE,
               "when this daemon process started (unix time); counters restart from 0 then"),
    MetricSpec("rslurm_daemon_last_update_timestamp_seconds", "gauge", _NODE,
               "when the daemon last wrote this file (unix time)"),
    MetricSpec("rslurm_drained_bytes_total", "counter", _NODE,
               "bytes sent to the durable tier (not counting objects already there)"),
    MetricSpec("rslurm_drained_steps_total", "counter", _NODE,
               "steps whose shards of this node reached the durable tier"),
    MetricSpec("rslurm_drain_seconds_total", "counter", _NODE, "seconds spent draining steps"),
    MetricSpec("rslurm_drain_retries_total", "counter", _NODE,
               "transient storage errors retried during drains"),
    MetricSpec("rslurm_drain_failures_total", "counter", _NODE, "step drains that failed"),
    MetricSpec("rslurm_drain_step_retries_total", "counter", _NODE,
               "step drains that failed and were queued again with a growing delay (drain_retry events)"),
    MetricSpec("rslurm_durable_commits_total", "counter", _NODE,
               "durable manifests written by this node (the durable commit of a step)"),
    MetricSpec("rslurm_local_evicted_steps_total", "counter", _NODE,
               "local steps evicted to keep local_min_free free"),
    MetricSpec("rslurm_replica_mismatches_total", "counter", _NODE,
               "replica mismatches recorded in the manifests of the steps this node drained"),
    MetricSpec("rslurm_drain_throughput_bytes_per_second", "gauge", _NODE,
               "throughput of the last step drain that sent bytes"),
    MetricSpec("rslurm_local_free_bytes", "gauge", _NODE, "free bytes on the local tier's filesystem"),
    MetricSpec("rslurm_local_min_free_bytes", "gauge", _NODE, "the local_min_free watermark in bytes"),
    MetricSpec("rslurm_drain_lag_seconds", "gauge", _RUN,
               "age of the oldest local step newer than the newest durable step (0: caught up)"),
    MetricSpec("rslurm_local_newest_step", "gauge", _RUN,
               "newest committed step in the local tier (-1: none)"),
    MetricSpec("rslurm_durable_newest_step", "gauge", _RUN,
               "newest durable step (-1: none)"),
    MetricSpec("rslurm_steps_pending_drain", "gauge", _RUN,
               "local steps this node still has to send to the durable tier"),
    MetricSpec("rslurm_run_goodput_ratio", "gauge", _RUN,
               "training time kept / wall time of the run, from its event log and history on this node "
               "(rslurm report)"),
    MetricSpec("rslurm_incarnation_ends", "gauge", (*_RUN, "reason"),
               "ends of the run's incarnations and in-job restarts in its history on this node, by class "
               "(preempted, time_limit, hang, out_of_memory, ...; rslurm history)"),
)


@dataclass(frozen=True)
class RunGauges:
    """Per-run gauges of one daemon snapshot."""

    drain_lag_seconds: float
    local_newest_step: int
    durable_newest_step: int
    steps_pending_drain: int
    ends: Mapping[str, int] = field(default_factory=dict)  # class -> count, from the run's history
    goodput: float | None = None  # kept / wall (rslurm report); None while not known: no sample


@dataclass(frozen=True)
class DaemonMetrics:
    """Everything one textfile shows: a consistent snapshot of the daemon's counters and gauges."""

    node: str
    local_root: str
    up: bool
    start_time: float
    updated_at: float
    counters: Mapping[str, float]  # metric name (with _total) -> value
    throughput: float
    local_free_bytes: float | None
    local_min_free_bytes: float | None
    runs: Mapping[str, RunGauges] = field(default_factory=dict)

    def samples(self) -> Iterator[tuple[MetricSpec, tuple[str, ...], float]]:
        """(metric, label values, value) for every sample, in :data:`METRICS` order."""
        node = (self.node, self.local_root)
        per_node: dict[str, float | None] = {
            "rslurm_daemon_up": 1.0 if self.up else 0.0,
            "rslurm_daemon_start_time_seconds": self.start_time,
            "rslurm_daemon_last_update_timestamp_seconds": self.updated_at,
            "rslurm_drain_throughput_bytes_per_second": self.throughput,
            "rslurm_local_free_bytes": self.local_free_bytes,
            "rslurm_local_min_free_bytes": self.local_min_free_bytes,
            **self.counters,
        }
        per_run = {
            "rslurm_drain_lag_seconds": lambda g: g.drain_lag_seconds,
            "rslurm_local_newest_step": lambda g: g.local_newest_step,
            "rslurm_durable_newest_step": lambda g: g.durable_newest_step,
            "rslurm_steps_pending_drain": lambda g: g.steps_pending_drain,
        }
        for spec in METRICS:
            if spec.name == "rslurm_incarnation_ends":
                for run, g in sorted(self.runs.items()):
                    for reason, n in sorted(g.ends.items()):
                        yield spec, (*node, run, reason), float(n)
            elif spec.name == "rslurm_run_goodput_ratio":
                for run, g in sorted(self.runs.items()):
                    if g.goodput is not None:
                        yield spec, (*node, run), float(g.goodput)
            elif spec.name in per_run:
                for run, g in sorted(self.runs.items()):
                    yield spec, (*node, run), float(per_run[spec.name](g))
            else:
                value = per_node.get(spec.name, 0.0)
                if value is not None:
                    yield spec, node, float(value)


def write_metrics_textfile(path: str, metrics: DaemonMetrics) -> None:
    """Render ``metrics`` in the Prometheus text format and replace ``path`` atomically.

    Raises OSError (the caller logs it and goes on)."""
    from prometheus_client import CollectorRegistry, write_to_textfile
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    from prometheus_client.registry import Collector

    families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
    for spec in METRICS:
        if spec.kind == "counter":
            families[spec.name] = CounterMetricFamily(spec.name.removesuffix("_total"), spec.help,
                                                      labels=list(spec.labels))
        else:
            families[spec.name] = GaugeMetricFamily(spec.name, spec.help, labels=list(spec.labels))
    for spec, labels, value in metrics.samples():
        families[spec.name].add_metric(list(labels), value)

    class _Snapshot(Collector):
        def collect(self) -> Iterator[Any]:
            yield from families.values()

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot())
    write_to_textfile(path, registry)


def check_metrics_path(path: str, *, key: str = "metrics_textfile") -> str:
    """``path`` made absolute, or :class:`ConfigError` when node_exporter would not read it."""
    p = os.path.abspath(os.path.expanduser(path.strip()))
    if not p.endswith(".prom"):
        raise ConfigError(f"{key}={path!r}: node_exporter's textfile collector reads only *.prom files; use a "
                          "path such as /var/lib/node_exporter/textfile_collector/rslurm.prom")
    d = os.path.dirname(p)
    if not os.path.isdir(d):
        raise ConfigError(f"{key}={path!r}: directory {d} does not exist; create it (node_exporter's "
                          f"--collector.textfile.directory) or unset {key}")
    if not os.access(d, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}={path!r}: directory {d} is not writable by this user; the file is replaced "
                          "by a rename, so the daemon needs write access to the directory")
    return p


__all__ = ["EVENTS_FILE", "Event", "METRICS", "DaemonMetrics", "EventLog", "ExactFloat", "MetricSpec", "RunGauges", "check_metrics_path",
           "events_path", "write_metrics_textfile"]
