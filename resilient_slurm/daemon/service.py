"""``rslurm daemon``: the per-node drain loop (a system service that outlives jobs, or a job step).

Call order: ``Daemon(...)`` then :meth:`Daemon.run` on the main thread. ``run`` takes the node's
daemon lock (``<local root>/.rslurm/daemon.lock``, ``flock``; a second daemon on the same directory
gets :class:`DaemonRunningError`), starts a watchdog observer on the local root (events only wake the
loop; a rescan every ``poll_interval`` seconds is the fallback when inotify is unavailable), removes
what an earlier daemon killed mid-transfer left behind, then loops:

1. scan the local root for committed steps; decide each one's state against the durable tier; merge
   each run's tags file with its durable copy and write back whichever differs (:mod:`~resilient_slurm.tags`);
2. drain the most urgent pending step (:func:`~.drain.drain_order`: emergency first, then newest),
   yielding between shard files when a more urgent step appears or a stop is requested; a tagged step
   is drained even when retention would not keep it;
3. apply retention on the durable tier (per ``keep_last``/``keep_every``; never the newest durable step,
   never a tagged one, nothing of a run whose tags cannot be read);
4. keep the local tier above ``local_min_free``: evict peer replicas first (``<run>/replicas/<domain>/``:
   spare copies of partner domains' steps, oldest first across runs; the partner's daemon drains the
   original); then durable steps, oldest first; then older non-durable ones, never the newest step that
   is not yet durable, never a tagged one;
5. write the status file (``<local root>/.rslurm/daemon.json``) that ``rslurm status`` reads and, with
   ``metrics_textfile`` set, the Prometheus textfile (also after every transfer, and at most every second
   while one runs); report each run's drain lag to its event log when it changes (or every minute while
   the durable tier trails).

``--once`` runs passes until nothing is left that this node can do, then exits (1 when a step failed: it
is not retried by that process, and its log line says so). A drain that fails because the durable tier is
full (ENOSPC, a quota's EDQUOT) deletes the oldest durable step that retention deletes anyway once that
step lands (never the newest durable step, never a tagged one) and drains it again at once; when there
is none, the error names ``keep_last`` and the room the tier needs (:meth:`Daemon._make_room`).

Each drain, durable commit, failure, retention deletion and eviction is appended with ``source: daemon``
to the event log of the run concerned (``<local root>/<run_id>/events.jsonl``; docs/telemetry.md). The
textfile's counters live in this process: they start from 0 when the daemon starts (Prometheus treats
that as a counter reset; ``rslurm_daemon_start_time_seconds`` shows when), and a clean exit writes
``rslurm_daemon_up 0``.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import math
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from tenacity import RetryCallState, Retrying, wait_exponential_jitter

from ..catalog.inventory import ReplicaStep, scan_replicas
from ..checkpoint.policy import RetentionPolicy
from ..early_signals import take_early
from ..errors import (
    ConfigError,
    CorruptCheckpointError,
    InsufficientSpaceError,
    ResilientSlurmError,
    StorageError,
    TagsFileError,
    UnsafePathError,
)
from ..flocks import close_locked_fd, open_locked_fd
from ..layout import StepBusy, StepTagged, TempKind, delete_durable_step, delete_step, list_runs
from ..manifest import MANIFEST_NAME, durable_step_key, parse_step_dirname
from ..paths import STATE_DIR, load_json, open_state_file
from ..rundir import RunDir
from ..sigsafe import WakeFlag
from ..storage.encoding import remove_stale_scratch
from ..storage.fileio import atomic_write
from ..storage.tier import StorageTier
from ..tags import (
    RunTags,
    empty,
    merge,
    read_durable_tags,
    read_local_tags,
    sync_durable_tags,
    update_local_tags,
)
from ..telemetry import DaemonMetrics, Event, EventLog, RunGauges, check_metrics_path, write_metrics_textfile
from .drain import (
    DrainResult,
    LocalStep,
    StepDrainer,
    drain_lag,
    drain_order,
    durable_steps,
    recheck_delay,
    scan_local,
)

log = logging.getLogger(__name__)
# How often the goodput metric may read a run's event log again (it grows with the run).
GOODPUT_EVERY_S = 60.0

LOCK_FILE = "daemon.lock"
STATUS_FILE = "daemon.json"
STATUS_MAX_BYTES = 16 << 20  # one line per local step
# Incomplete uploads (S3 multipart, POSIX temp files) older than this belong to nobody any more.
STALE_UPLOAD_AGE = 6 * 3600.0
MIN_PASS_INTERVAL = 0.05
# While the durable tier trails a run, its drain_lag event is repeated this often (and on every change).
LAG_EVENT_EVERY = 60.0
COUNTERS = ("rslurm_drained_bytes_total", "rslurm_drained_steps_total", "rslurm_drain_seconds_total",
            "rslurm_drain_retries_total", "rslurm_drain_failures_total", "rslurm_drain_step_retries_total",
            "rslurm_durable_commits_total", "rslurm_local_evicted_steps_total", "rslurm_replica_mismatches_total")
# A step whose drain failed for a reason that may pass (the durable tier read-only, unreachable, full)
# stays in the queue: retried after 2, 4, 8, 16 s, then every 30 s (each plus up to 2 s of jitter), for as
# long as the daemon runs. Only a fault in the data (a corrupt shard, a link in the tier) gives up.
STEP_RETRY_WAIT = wait_exponential_jitter(multiplier=2.0, max=30.0, jitter=2.0)


def step_retry_delay(attempt: int) -> float:
    """Seconds before the next drain of a step whose ``attempt``-th drain failed (:data:`STEP_RETRY_WAIT`)."""
    state = RetryCallState(Retrying(), None, (), {})
    state.attempt_number = attempt
    return float(STEP_RETRY_WAIT(state))


class _FromSettings:
    """Default of ``Daemon(metrics_textfile=...)``: the ``metrics_textfile`` setting."""


FROM_SETTINGS = _FromSettings()


class DaemonRunningError(ResilientSlurmError):
    """Another daemon already drains this local directory."""


def status_path(root: str) -> str:
    """Where a node's daemon writes its status."""
    return os.path.join(root, STATE_DIR, STATUS_FILE)


def daemon_running(root: str) -> bool:
    """True when a daemon holds the lock of ``root`` (a service, or another job's step)."""
    try:
        fd = open_locked_fd(lambda: open_state_file(os.path.join(root, STATE_DIR), LOCK_FILE, os.O_RDONLY))
    except (OSError, ConfigError):  # no lock file, or one rslurm refuses (a symlink, a FIFO): no daemon
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        close_locked_fd(fd)


def min_free_bytes(spec: str, path: str) -> int:
    """Bytes ``local_min_free`` asks for on the filesystem of ``path``."""
    from ..config import parse_size

    if spec.strip().endswith("%"):
        st = os.statvfs(path)
        return int(st.f_blocks * st.f_frsize * float(spec.strip()[:-1]) / 100.0)
    return parse_size(spec)


@dataclass
class StepStatus:
    """One step as the daemon sees it (what ``rslurm status`` prints)."""

    run_id: str
    step: int
    reason: str
    bytes: int
    created_at: float
    state: str  # local | draining | waiting | durable | retrying (next_retry_at) | failed (gave up)
    durable_at: float | None = None
    drain_s: float | None = None
    throughput: float | None = None
    retries: int = 0
    waiting_for: list[str] = field(default_factory=list)
    error: str | None = None
    next_retry_at: float | None = None  # retrying: when the step is drained again
    next_check_at: float | None = None  # waiting: when the durable commit is checked again
    checks: int = 0  # waiting: commit checks made so far (drain.recheck_delay)


class Daemon:
    """Drains one node's local tier into one durable tier (see the module docstring)."""

    def __init__(self, root: str, tier: StorageTier, *, node: str, retention: RetentionPolicy,
                 run_ids: Iterable[str] | None = None, min_free: str = "10%", poll_interval: float = 5.0,
                 clock: Callable[[], float] = time.time, ignore_signals: Iterable[int] = (),
                 metrics_textfile: str | None | _FromSettings = FROM_SETTINGS) -> None:
        """``metrics_textfile``: the Prometheus textfile to write (None: none); by default the
        ``metrics_textfile`` setting from the environment or the config file. A path that node_exporter
        would not read (not ``*.prom``, no such directory) is a :class:`ConfigError`."""
        self.root = root
        self.ignore_signals = set(ignore_signals)
        self.tier = tier
        self.node = node
        self.retention = retention
        self.run_ids = sorted(run_ids) if run_ids else None
        self.min_free = min_free
        self.poll_interval = poll_interval
        self.clock = clock
        # Set from signal handlers: lock-free flags (sigsafe.py); the handlers log nothing themselves (a
        # handler writing to stderr while the main thread was writing there raises "reentrant call"), the
        # loop logs what they recorded (_log_signals).
        self.stop_requested = WakeFlag()
        self._wake = WakeFlag()
        self._signals: deque[tuple[str, bool]] = deque()  # (signal name, whether it stops the daemon)
        self._status: dict[tuple[str, int], StepStatus] = {}
        self._durable: dict[str, list[int]] = {}  # run -> durable steps, refreshed each pass
        # run -> (event log's size and mtime, when computed, goodput): see _goodput
        self._goodputs: dict[str, tuple[tuple[int, int], float, float | None]] = {}
        self._current: dict[str, Any] | None = None
        self._lock_fd: int | None = None
        self._last_status_write = 0.0
        self._failures: dict[tuple[str, int, float], int] = {}  # save -> failed drains in a row
        self._retry_at: dict[tuple[str, int, float], float] = {}  # save -> when it may be drained again
        self._gave_up: set[tuple[str, int, float]] = set()  # saves whose data cannot be drained
        self._invalid_paths: set[str] = set()  # committed-looking steps whose manifest is unreadable
        self._tags: dict[str, RunTags] = {}  # run -> both copies merged; absent: unknown (nothing deleted durably)
        self._local_tags: dict[str, RunTags] = {}  # run -> this node's copy; absent: unreadable (nothing evicted)
        self._tags_problems: dict[str, str] = {}  # run -> the last problem logged (once per change)
        self.drained: list[DrainResult] = []
        self.started_at = clock()
        if isinstance(metrics_textfile, _FromSettings):
            from ..config import load

            metrics_textfile = load().metrics_textfile
        assert not isinstance(metrics_textfile, _FromSettings)
        self.metrics_textfile = check_metrics_path(metrics_textfile) if metrics_textfile else None
        self.counters: dict[str, float] = dict.fromkeys(COUNTERS, 0.0)
        self._throughput = 0.0
        self._up = True
        self._runs: list[str] = []  # runs of the last scan: the per-run gauges
        self._pending_keys: set[tuple[str, int]] = set()  # steps this node still has to send
        self._logs: dict[str, EventLog] = {}
        self._lag_reported: dict[str, tuple[int | None, float]] = {}  # run -> (oldest step behind, when)
        self._publish_lock = threading.Lock()
        self._metrics_warned = False
        self._once = False  # run(once=True): a failed step is not retried by this process
        self._room_made = False  # a full durable tier was given room this pass: drain again at once

    # ------------------------------------------------------------------ lifecycle
    def acquire(self) -> None:
        """Take the node's daemon lock or raise :class:`DaemonRunningError`."""
        d = os.path.join(self.root, STATE_DIR)
        # ConfigError if unsafe; a child this process forks does not keep the lock (flocks)
        fd = open_locked_fd(lambda: open_state_file(d, LOCK_FILE, os.O_RDWR | os.O_CREAT, create=True))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            close_locked_fd(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise DaemonRunningError(f"another rslurm daemon already drains {self.root} (lock "
                                         f"{os.path.join(d, LOCK_FILE)})") from None
            raise
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd

    def release(self) -> None:
        """Give the lock back."""
        if self._lock_fd is not None:
            close_locked_fd(self._lock_fd)
            self._lock_fd = None

    def request_stop(self, *_: object) -> None:
        """Stop after the current shard file (safe from a signal handler)."""
        self.stop_requested.set()
        self._wake.set()

    def run(self, *, once: bool = False, install_signals: bool = True, job_step: bool = False) -> int:
        """Run until stopped (or, with ``once``, until nothing is left to do); return an exit code:
        0, or 1 when some step could not be drained.

        ``job_step``: SIGTERM is logged and ignored (Slurm sends it to every step on preemption, when the
        emergency checkpoint most needs draining); SIGINT and SIGHUP stop the daemon."""
        self._once = once
        self.acquire()
        if install_signals:
            handlers: dict[int, Callable[[int, FrameType | None], None]] = {
                int(sig): self._on_signal for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
            if job_step:
                # Slurm signals every step of the job: SIGTERM on preemption, and the launcher's
                # `scancel --signal=<save_signal>` meant for the ranks. None of them may stop the drain.
                for num in {int(signal.SIGTERM), int(signal.SIGUSR1), int(signal.SIGUSR2), *self.ignore_signals}:
                    handlers[num] = self._on_term_in_job_step
            for num, handler in handlers.items():
                signal.signal(num, handler)
            # What the early trap heard while the daemon was still importing (early_signals.py: the daemon a
            # launcher starts, which it stops with SIGINT), handled now as these handlers would have.
            for num, _ in take_early():
                if num in handlers:
                    handlers[num](num, None)
        observer = None if once else self._watch()
        log.info("rslurm daemon on %s: draining %s -> %s%s", self.node, self.root, self.tier.url,
                 f" (runs {', '.join(self.run_ids)})" if self.run_ids else "")
        try:
            self._cleanup_incomplete()
            failed = False
            while not self.stop_requested.is_set():
                self._log_signals()
                self._wake.clear()
                busy, failed = self.run_pass()
                if once and not busy:
                    break
                if not busy:
                    self._wake.wait(self._idle_wait())
                    time.sleep(MIN_PASS_INTERVAL)  # let a burst of events (a commit, a fetch) settle
            return 1 if failed else 0
        finally:
            self._log_signals()
            if observer is not None:
                # Events racing the observer's shutdown are logged by watchdog as errors; they mean nothing.
                logging.getLogger("watchdog.observers.inotify").setLevel(logging.CRITICAL)
                observer.stop()
                observer.join(timeout=5)
            self._up = False
            self._write_status(force=True)
            self.release()

    def _idle_wait(self) -> float:
        """Seconds until the next pass: the poll interval, or sooner when a failed step is due again."""
        now = self.clock()
        due = [t - now for t in self._retry_at.values()]
        return max(MIN_PASS_INTERVAL, min([self.poll_interval, *due]))

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signals.append((signal.Signals(signum).name, True))
        self.request_stop()

    def _on_term_in_job_step(self, signum: int, frame: FrameType | None) -> None:
        self._signals.append((signal.Signals(signum).name, False))
        self._wake.set()

    def _log_signals(self) -> None:
        """Log the signals the handlers recorded, on the daemon's own thread."""
        while self._signals:
            name, stops = self._signals.popleft()
            if stops:
                log.warning("rslurm daemon: %s received; stopping after the current file", name)
            else:
                log.warning("rslurm daemon (job step): %s received; draining on until the launcher stops this step "
                            "(SIGINT) or Slurm ends the job", name)

    def _watch(self) -> Any:
        try:
            from watchdog.events import FileSystemEvent, FileSystemEventHandler
            from watchdog.observers import Observer
        except ImportError:  # pragma: no cover - watchdog is a core dependency
            log.warning("watchdog is not installed; rescanning every %.0f s", self.poll_interval)
            return None
        wake = self._wake

        class Handler(FileSystemEventHandler):
            def on_any_event(self, event: FileSystemEvent) -> None:
                # A commit is a directory renamed to step_<N> (or a manifest appearing); the many other
                # writes (shards in temp dirs, event logs, our own status) need no rescan.
                path = str(getattr(event, "dest_path", "") or event.src_path)
                name = os.path.basename(path.rstrip(os.sep))
                if parse_step_dirname(name) is not None or name == MANIFEST_NAME:
                    wake.set()

        try:
            observer = Observer()
            observer.schedule(Handler(), self.root, recursive=True)
            observer.start()
            return observer
        except (OSError, RuntimeError) as exc:  # inotify limits, unsupported filesystem
            log.warning("cannot watch %s (%s); rescanning every %.0f s instead", self.root, exc, self.poll_interval)
            return None

    # ------------------------------------------------------------------ one pass
    def run_pass(self) -> tuple[bool, bool]:
        """Scan, drain the pending steps in :func:`drain_order` (stopping early to rescan when the local
        tier changed), retention, eviction, status. Returns (more work may be pending now, some step
        failed). Steps waiting for other nodes cost a few small reads per pass."""
        self._invalid_paths.clear()
        steps = scan_local(self.root, self.run_ids, invalid=self._invalid)
        runs = sorted({s.run_id for s in steps} | set(self.run_ids or ()))
        for run in runs:
            try:
                self._durable[run] = durable_steps(self.tier, run)
            except StorageError as exc:
                log.warning("cannot list the durable tier for run %s: %s", run, exc)
            self._sync_tags(run)
        pending = []
        for s in steps:
            st = self._step_status(s)
            if s.step in self._durable.get(s.run_id, ()):
                if st.state != "durable":
                    st.state, st.waiting_for = "durable", []
                    st.durable_at = st.durable_at or self.clock()
                continue
            if not self._worth_draining(s):
                st.state = "local"
                continue
            if s.manifest.save_id in self._gave_up:
                st.state = "failed"
                continue
            if self._retry_at.get(s.manifest.save_id, 0.0) > self.clock():
                st.state = "retrying"
                continue
            if st.state == "waiting" and st.next_check_at is not None and st.next_check_at > self.clock():
                continue  # the last node to finish commits; re-checks only cover one that died before it
            pending.append(s)
        present = {(x.run_id, x.step) for x in steps}
        for key in [k for k in self._status if k not in present]:
            del self._status[key]
        saves = {x.manifest.save_id for x in steps}  # forget the retries of steps that are gone
        for table in (self._failures, self._retry_at):
            for save in [k for k in table if k not in saves]:
                del table[save]
        self._gave_up &= saves
        self._runs = runs
        self._pending_keys = {(x.run_id, x.step) for x in pending}
        self._report_lag()  # what this pass found: new commits behind the durable tier
        busy = False
        self._room_made = False
        for i, ls in enumerate(drain_order(pending)):
            if self.stop_requested.is_set():
                break
            if i and self._wake.is_set() and ls.manifest.reason != "emergency":
                busy = True  # something changed on disk (maybe an emergency step): rescan first
                break
            if not self._worth_draining(ls):  # newer steps drained in this pass may have made it redundant
                self._step_status(ls).state = "local"
                continue
            result = self._drain_one(ls)
            if result is None:  # failed: its state says so (retrying, failed), counted below
                continue
            if result.state == "preempted":
                busy = True
                break
            if result.state == "durable" and ls.step not in self._durable.setdefault(ls.run_id, []):
                self._durable[ls.run_id] = sorted([*self._durable[ls.run_id], ls.step])
        busy = busy or self._room_made  # a step is due again at once, in the room made for it
        # What this pass left: a step retried in it (after a failure, or in room made for it) that is durable now
        # does not count.
        failed = any(st.state in ("failed", "retrying") for st in self._status.values()) or bool(self._invalid_paths)
        for run in runs:
            self._apply_durable_retention(run)
        self._evict_if_needed(steps)
        self._report_lag()  # and what it left
        self._write_status(force=True)
        return busy and not self.stop_requested.is_set(), failed

    def _step_status(self, s: LocalStep) -> StepStatus:
        key = (s.run_id, s.step)
        st = self._status.get(key)
        if st is None or st.created_at != s.manifest.created_at:
            st = StepStatus(s.run_id, s.step, s.manifest.reason, s.local_bytes, s.manifest.created_at, "local")
            self._status[key] = st
        return st

    def _worth_draining(self, s: LocalStep) -> bool:
        """Drain only steps that retention would keep in the durable tier next to what is there, and
        tagged steps."""
        durable = set(self._durable.get(s.run_id, ()))
        return s.step in self.retention.keep(durable | {s.step}) or s.step in self._tagged(s.run_id)

    def _tagged(self, run: str) -> frozenset[int]:
        """The run's tagged steps as far as known (both copies, else this node's)."""
        t = self._tags.get(run) or self._local_tags.get(run)
        return t.steps if t is not None else frozenset()

    def _sync_tags(self, run: str) -> None:
        """Merge this node's tags file of ``run`` with the durable copy, write back whichever differs from
        the merge, and remember it for the drain choice, retention and eviction. A copy that cannot be
        read (TagsFileError) leaves the run's tags unknown: neither durable retention nor eviction touch
        the run. A durable tier that cannot be reached stops durable retention only (eviction goes on
        with this node's copy). Nothing is overwritten that could not be read."""
        run_dir = RunDir(self.root, run).path
        self._tags.pop(run, None)
        self._local_tags.pop(run, None)
        problem: str | None = None
        level = logging.ERROR  # a copy that cannot be read needs a person; a store that failed does not
        try:
            local = read_local_tags(run_dir, run)
            self._local_tags[run] = local or empty(run)
            durable = read_durable_tags(self.tier, run)
            merged = merge(run, [local, durable])
            if merged.records and (local is None or local.records != merged.records) and os.path.isdir(run_dir):
                merged = update_local_tags(run_dir, run, merged.merged)  # re-read under the lock, merged again
                self._local_tags[run] = merged
                log.info("run %s: tags from %s written to %s", run, self.tier.url, run_dir)
            self._tags[run] = merged
            if merged.records and (durable is None or durable.records != merged.records):
                # Merged again with the copy as it is at the write: a tag written there meanwhile stays.
                self._tags[run] = sync_durable_tags(self.tier, merged)
                log.info("run %s: tags from %s written to %s", run, run_dir, self.tier.url)
        except TagsFileError as exc:
            problem = str(exc)
            self._local_tags.pop(run, None)  # either copy unreadable: nothing of the run is evicted either
        except (ResilientSlurmError, OSError) as exc:
            problem, level = f"run {run}: cannot bring its tags files in step ({exc}); retried at the next pass", \
                logging.WARNING
        if problem is None:
            self._tags_problems.pop(run, None)
        elif self._tags_problems.get(run) != problem:
            self._tags_problems[run] = problem
            log.log(level, "%s", problem)

    def _invalid(self, path: str, reason: str) -> None:
        if path not in self._invalid_paths:
            log.error("not draining %s: %s (run `rslurm verify` on it)", path, reason)
        self._invalid_paths.add(path)

    def _events(self, run: str) -> EventLog:
        ev = self._logs.get(run)
        if ev is None:
            ev = self._logs[run] = EventLog(self.root, run, source="daemon", node=self.node, keep_open=False,
                                            clock=self.clock)
        return ev

    def _drain_one(self, ls: LocalStep) -> DrainResult | None:
        st = self._step_status(ls)
        # A step whose shards of this node are durable already is only re-checked for the durable commit:
        # no drain events for that, every pass.
        recheck = st.state == "waiting"
        st.state, st.error = "draining", None
        self._current = {"run_id": ls.run_id, "step": ls.step, "bytes_total": ls.local_bytes, "bytes_done": 0,
                         "started_at": self.clock()}
        events = self._events(ls.run_id)
        if not recheck:
            events.emit(Event.DRAIN_STARTED, step=ls.step, reason=ls.manifest.reason, bytes=ls.local_bytes)
        self._write_status(force=True)
        last_report = [time.monotonic()]

        def progress(n: int) -> None:
            cur = self._current
            if cur is not None:
                cur["bytes_done"] += n
                now = time.monotonic()
                if now - last_report[0] >= self.poll_interval:
                    last_report[0] = now
                    events.emit(Event.DRAIN_PROGRESS, step=ls.step, bytes_done=cur["bytes_done"],
                                bytes_total=cur["bytes_total"])
            self._write_status()

        def should_yield(cur: LocalStep) -> bool:
            """Pause ``cur`` for a stop request, or for an emergency step this node has not drained yet and may
            drain now. An emergency step waiting for its retry (its drain failed: the tier is full, read-only or
            down) does not hold the others back: pausing them for it paused them again at once, in a loop that
            took a core and logged two lines a millisecond until the retry; they take their turn (and their own
            backoff when the tier fails them too)."""
            if self.stop_requested.is_set():
                return True
            if cur.manifest.reason == "emergency":
                return False
            now = self.clock()
            for s in scan_local(self.root, self.run_ids):
                if s.manifest.reason != "emergency" or (s.run_id, s.step) == (cur.run_id, cur.step):
                    continue
                known = self._status.get((s.run_id, s.step))
                current = known is not None and known.created_at == s.manifest.created_at
                done = current and known is not None and (known.state in ("waiting", "durable", "failed") or (
                    known.state == "retrying" and (known.next_retry_at is None or known.next_retry_at > now)))
                if not done and s.step not in self._durable.get(s.run_id, ()):
                    log.info("run %s step %d: pausing it for emergency step %d", cur.run_id, cur.step, s.step)
                    return True
            return False

        drainer = StepDrainer(self.tier, should_yield=should_yield, progress=progress)
        try:
            result = drainer.drain(ls)
        except (CorruptCheckpointError, UnsafePathError) as exc:
            # A fault in the data or a link in the tier does not heal by retrying: given up (`rslurm status`
            # shows it failed, and a launcher waiting for the step stops waiting).
            log.error("run %s step %d cannot be drained: %s", ls.run_id, ls.step, exc)
            st.state, st.error, st.next_retry_at = "failed", str(exc), None
            self._gave_up.add(ls.manifest.save_id)
            self._retry_at.pop(ls.manifest.save_id, None)
            self._failed(ls, str(exc), self._failures.get(ls.manifest.save_id, 0) + 1, retry=False)
            return None
        except (ResilientSlurmError, OSError) as exc:
            n = self._failures.get(ls.manifest.save_id, 0) + 1
            self._failures[ls.manifest.save_id] = n
            full = ""  # why a full durable tier cannot take the step, and what to change
            room = None  # the durable step removed to make room for it
            if isinstance(exc, InsufficientSpaceError):
                room, full = self._make_room(ls)
            delay = 0.0 if room is not None else step_retry_delay(n)
            if room is not None:
                self._room_made = True
                log.warning("draining run %s step %d failed (attempt %d): %s; the durable tier is full: removed run %s "
                            "step %d, the oldest durable step retention removes once step %d is durable "
                            "(keep_last=%d), and draining step %d again now", ls.run_id, ls.step, n, exc, ls.run_id,
                            room, ls.step, self.retention.keep_last, ls.step)
            elif self._once:
                log.error("draining run %s step %d failed (attempt %d): %s%s; not retried (--once): the next "
                          "`rslurm daemon` retries it", ls.run_id, ls.step, n, exc, full)
            else:
                log.error("draining run %s step %d failed (attempt %d): %s%s; retrying in %.0f s", ls.run_id, ls.step,
                          n, exc, full, delay)
            st.error = f"{exc}{full}"
            if room is None and self._once:
                # This process is done with it: still pending (the next daemon tries it afresh), with no retry
                # time; its later passes neither try it again nor pause other steps for it (an emergency step
                # waiting for a retry held the others back in a loop).
                st.state, st.next_retry_at = "retrying", None
                self._retry_at[ls.manifest.save_id] = math.inf
                self._failed(ls, st.error, n, retry=False)
                return None
            st.state = "retrying"
            st.next_retry_at = self._retry_at[ls.manifest.save_id] = self.clock() + delay
            self._failed(ls, st.error, n, retry=True)
            self.counters["rslurm_drain_step_retries_total"] += 1
            events.emit(Event.DRAIN_RETRY, step=ls.step, attempt=n, retry_in_s=delay, error=st.error)
            return None
        finally:
            self._current = None
        self._failures.pop(ls.manifest.save_id, None)
        self._retry_at.pop(ls.manifest.save_id, None)
        st.next_retry_at = None
        st.retries += result.retries
        self.counters["rslurm_drain_retries_total"] += result.retries
        self.counters["rslurm_drain_seconds_total"] += result.seconds
        if result.bytes_sent:
            self.counters["rslurm_drained_bytes_total"] += result.bytes_sent
            self._throughput = result.throughput
        if result.state in ("durable", "waiting") and not recheck:
            self.counters["rslurm_drained_steps_total"] += 1
            mismatches = ls.manifest.extra.get("replica_mismatch")
            self.counters["rslurm_replica_mismatches_total"] += len(mismatches) if isinstance(mismatches, list) else 0
            events.emit(Event.DRAINED, step=ls.step, state=result.state, bytes=result.bytes_sent,
                        file_bytes=result.file_bytes, reused_bytes=result.bytes_reused, seconds=result.seconds,
                        throughput_bytes_s=result.throughput, retries=result.retries)
        if result.committed:
            self.counters["rslurm_durable_commits_total"] += 1
            events.emit(Event.DURABLE_COMMIT, step=ls.step, since_created_s=self.clock() - ls.manifest.created_at)
        if result.state == "preempted":
            st.state = "local"
            log.info("run %s step %d: paused for a more urgent step", ls.run_id, ls.step)
            self.drained.append(result)
            return result
        if result.bytes_sent or result.bytes_reused:
            st.drain_s, st.throughput = result.seconds, result.throughput
            packed = (f"; the files sent hold {result.file_bytes / 2**20:.1f} MiB, compressed"
                      if result.bytes_sent < result.file_bytes else "")
            log.info("run %s step %d (%s): %.1f MiB sent, %.1f MiB already there, %.2f s, %.1f MiB/s, %d retries%s",
                     ls.run_id, ls.step, ls.manifest.reason, result.bytes_sent / 2**20, result.bytes_reused / 2**20,
                     result.seconds, result.throughput / 2**20, result.retries, packed)
        if result.state == "durable":
            st.state, st.waiting_for = "durable", []
            st.durable_at = self.clock()
            log.info("run %s step %d is durable in %s", ls.run_id, ls.step, self.tier.url)
            try:  # every domain is done: nothing may still be uploading for this step
                self.tier.cleanup_incomplete(durable_step_key(ls.run_id, ls.step))
            except StorageError as exc:
                log.warning("could not clean incomplete uploads of run %s step %d: %s", ls.run_id, ls.step, exc)
        elif result.state == "waiting":
            changed = not recheck or st.waiting_for != result.missing_domains
            st.checks = st.checks + 1 if recheck else 1
            st.next_check_at = self.clock() + recheck_delay(st.checks, self.poll_interval)
            st.state, st.waiting_for = "waiting", result.missing_domains
            (log.info if changed else log.debug)("run %s step %d: this node's shards are durable; waiting for %s", ls.run_id, ls.step,
                     ", ".join(result.missing_domains))
        self.drained.append(result)
        return result

    def _make_room(self, ls: LocalStep) -> tuple[int | None, str]:
        """The durable tier is full (ENOSPC, or a quota: EDQUOT) and cannot take ``ls``: delete the oldest
        durable step of its run that retention deletes anyway once ``ls`` is durable (its keep_last/keep_every
        decide, as for every step), never the run's newest durable step, never a tagged one, nothing of a run
        whose tags cannot be read. Returns (the step deleted, "") or, when none may go, (None, why the tier
        cannot take the step and which setting to change)."""
        run = ls.run_id
        durable = sorted(self._durable.get(run, ()))
        tags = self._tags.get(run)
        candidates = []
        if tags is not None and len(durable) > 1:
            going = set(self.retention.deletable([*durable, ls.step], protected=tags.steps))
            candidates = [s for s in durable if s in going and s != durable[-1] and s < ls.step]
        for s in candidates:
            try:
                delete_durable_step(self.tier, run, s)
            except StepTagged:
                continue  # tagged since this pass read the tags
            except (TagsFileError, StorageError) as exc:
                log.warning("durable tier full: cannot remove run %s step %d to make room: %s", run, s, exc)
                break
            self._durable[run] = [x for x in self._durable[run] if x != s]
            self._events(run).emit(Event.RETENTION_DELETED, tier="durable", steps=[s])
            return s, ""
        k = self.retention.keep_last
        if tags is None:
            return None, (f" (the durable tier is full; run {run}'s tags cannot be read, so none of its durable steps "
                          "is removed to make room)")
        n = len(durable)
        # Lowering keep_last helps only where it lets an older durable step go before the new one lands.
        lower = (f", or lower keep_last (RSLURM_KEEP_LAST, `keep_last` in the config file) to {n}" if 2 <= n < k
                 else "")
        return None, (f" (the durable tier is full: it holds {n} durable step(s) of run {run} and retention "
                      f"(keep_last={k}) removes an older one only once a newer one is durable, and never the newest "
                      f"or a tagged one; give the durable tier, or its quota, room for one more step ({n + 1}; "
                      f"keep_last={k} needs room for {k + 1}){lower})")

    def _failed(self, ls: LocalStep, error: str, attempt: int, *, retry: bool) -> None:
        self.counters["rslurm_drain_failures_total"] += 1
        self._events(ls.run_id).emit(Event.DRAIN_FAILED, step=ls.step, error=error, attempt=attempt, will_retry=retry)

    # ------------------------------------------------------------------ cleanup, retention, eviction
    def _cleanup_incomplete(self) -> None:
        # Compressed copies a killed daemon left (the root's lock says no other daemon drains here).
        remove_stale_scratch(os.path.join(self.root, STATE_DIR))
        steps = scan_local(self.root, self.run_ids)
        mine = {f"{durable_step_key(s.run_id, s.step)}/{sh.path}" for s in steps
                for sh in s.manifest.shards_of_node(s.domain)}
        for run in sorted({s.run_id for s in steps} | set(self.run_ids or ())):
            try:
                # Ours: resumed by the next put_file. Others': only when nobody can still be writing them.
                n = self.tier.cleanup_incomplete(run, older_than=STALE_UPLOAD_AGE, keep=mine.__contains__)
                if n:
                    log.info("removed %d incomplete uploads of run %s", n, run)
            except StorageError as exc:
                log.warning("cannot clean incomplete uploads of run %s: %s", run, exc)

    def _apply_durable_retention(self, run: str) -> None:
        tags = self._tags.get(run)
        if tags is None:
            return  # which steps are tagged is unknown (_sync_tags logged why): delete nothing
        steps = self._durable.get(run, [])
        deleted = []
        for s in self.retention.deletable(steps, protected=tags.steps):
            try:
                delete_durable_step(self.tier, run, s)
                log.info("retention: removed run %s step %d from %s", run, s, self.tier.url)
            except StepTagged:
                log.info("retention: run %s step %d was tagged meanwhile; keeping it", run, s)
                continue
            except TagsFileError as exc:
                log.error("retention on %s: %s", self.tier.url, exc)
                break
            except StorageError as exc:
                log.warning("retention on %s: cannot remove run %s step %d: %s", self.tier.url, run, s, exc)
                continue
            self._durable[run] = [x for x in self._durable[run] if x != s]
            deleted.append(s)
        if deleted:
            self._events(run).emit(Event.RETENTION_DELETED, tier="durable", steps=deleted)

    def _evict_if_needed(self, steps: list[LocalStep]) -> None:
        try:
            need = min_free_bytes(self.min_free, self.root)
            st = os.statvfs(self.root)
        except (OSError, ValueError) as exc:
            log.warning("cannot check free space of %s: %s", self.root, exc)
            return
        free = st.f_bavail * st.f_frsize
        if free >= need:
            return
        # Replicas first: spare copies of other domains' steps, whose originals their own nodes drain.
        for r in self._replicas():
            if free >= need:
                return
            if self._evict_replica(r):
                free = os.statvfs(self.root).f_bavail * st.f_frsize
        by_run: dict[str, list[LocalStep]] = {}
        for s in steps:
            by_run.setdefault(s.run_id, []).append(s)
        first: list[LocalStep] = []  # durable, not the run's newest local step
        second: list[LocalStep] = []  # durable, the run's newest
        third: list[LocalStep] = []  # not durable, but not the newest non-durable step of its run
        for run, ss in by_run.items():
            if run not in self._local_tags:
                continue  # this node's tags file cannot be read: which steps are tagged is unknown
            tagged = self._tagged(run)
            durable = set(self._durable.get(run, ()))
            newest = max(s.step for s in ss)
            non_durable = [s for s in ss if s.step not in durable]
            newest_nd = max((s.step for s in non_durable), default=None)
            for s in ss:
                if s.step in tagged:
                    continue
                if s.step in durable:
                    (second if s.step == newest else first).append(s)
                elif s.step != newest_nd:
                    third.append(s)
        for group in (first, second, third):
            for s in sorted(group, key=lambda x: x.step):
                if free >= need:
                    return
                if self._evict(s):
                    free = os.statvfs(self.root).f_bavail * st.f_frsize
        if free < need:
            log.warning("local tier %s: %.1f GiB free, below local_min_free=%s, and nothing more can be evicted "
                        "(the newest step that is not yet durable is kept, and so are tagged steps)", self.root,
                        free / 2**30, self.min_free)

    def _replicas(self) -> list[ReplicaStep]:
        """The committed peer replicas this node holds (of the daemon's runs), oldest save first across
        runs; one whose manifest cannot be read (no save time) comes first: it is of no use to a restore."""
        try:
            runs = self.run_ids if self.run_ids is not None else list_runs(self.root)
        except OSError as exc:
            log.warning("cannot list the runs of %s for replicas to evict: %s", self.root, exc)
            return []
        errors: list[str] = []
        out = [r for run in runs for rs in scan_replicas(self.root, run, errors) for r in rs.steps]
        for e in errors:
            log.warning("eviction: %s", e)
        return sorted(out, key=lambda r: (r.created_at if r.created_at is not None else float("-inf"), r.run_id,
                                          r.domain, r.step))

    def _evict(self, s: LocalStep) -> bool:
        try:
            if not delete_step(os.path.dirname(s.path), s.step, TempKind.EVICT):
                return False
        except StepBusy:
            return False  # being read (restore, drain), or the tags lock is held: keep it for now
        except StepTagged:
            return False  # tagged since this pass read the tags
        except TagsFileError as exc:
            log.error("eviction of %s: %s", s.path, exc)
            return False
        except OSError as exc:
            # Uncommitted but not all removed: the tree is an abandoned temp directory that retention
            # and `rslurm gc` remove; or not even uncommitted, and then not evicted.
            log.warning("eviction of %s: %s", s.path, exc)
            if os.path.lexists(s.path):
                return False
        durable = s.step in self._durable.get(s.run_id, ())
        log.warning("local tier below local_min_free=%s: evicted run %s step %d (%s)", self.min_free, s.run_id,
                    s.step, "durable" if durable else "older than the newest step, not durable")
        self._status.pop((s.run_id, s.step), None)
        self.counters["rslurm_local_evicted_steps_total"] += 1
        self._events(s.run_id).emit(Event.EVICTED, step=s.step, durable=durable, bytes=s.local_bytes,
                                    free_bytes=self._free_bytes(), replica_of=None)
        return True

    def _evict_replica(self, r: ReplicaStep) -> bool:
        """Delete one peer replica (:func:`delete_step` on its domain's replica directory; replicas are never
        tagged, and need no drain: they are not this node's data)."""
        try:
            if not delete_step(os.path.dirname(r.path), r.step, TempKind.EVICT):
                return False
        except StepBusy:
            return False  # being read (a restore copying it), or the lock is held: keep it for now
        except (StepTagged, TagsFileError) as exc:  # no tags file belongs there; one planted is refused
            log.error("eviction of replica %s: %s", r.path, exc)
            return False
        except OSError as exc:
            log.warning("eviction of replica %s: %s", r.path, exc)
            if os.path.lexists(r.path):
                return False
        # Whether the step is durable; None when this pass did not list the run's durable steps (a run
        # of which this node holds replicas only).
        durable = r.step in self._durable[r.run_id] if r.run_id in self._durable else None
        log.warning("local tier below local_min_free=%s: evicted run %s step %d (replica of domain %s: a spare "
                    "copy of another node's step)", self.min_free, r.run_id, r.step, r.domain)
        self.counters["rslurm_local_evicted_steps_total"] += 1
        self._events(r.run_id).emit(Event.EVICTED, step=r.step, durable=durable, bytes=r.bytes,
                                    free_bytes=self._free_bytes(), replica_of=r.domain)
        return True

    # ------------------------------------------------------------------ status
    def status(self) -> dict[str, Any]:
        """The status document (also written to :func:`status_path`)."""
        now = self.clock()
        lag = max((self._lag(run, now)[0] for run in self._runs), default=0.0)
        return {
            "version": 1, "node": self.node, "pid": os.getpid(), "local_root": self.root, "durable": self.tier.url,
            "started_at": self.started_at, "updated_at": now, "drain_lag_s": lag, "current": self._current,
            "steps": [vars(st) for st in sorted(self._status.values(), key=lambda x: (x.run_id, x.step))],
        }

    def _lag(self, run: str, now: float) -> tuple[float, int | None]:
        local = [(st.step, st.created_at) for st in list(self._status.values()) if st.run_id == run]
        return drain_lag(local, self._durable.get(run, ()), now)

    def _report_lag(self) -> None:
        """A ``drain_lag`` event per run when the oldest step behind changed, else every LAG_EVENT_EVERY
        seconds while the durable tier trails."""
        now = self.clock()
        for run in self._runs:
            if not any(k[0] == run for k in self._status):
                continue  # nothing of this run on this node (any more)
            seconds, oldest = self._lag(run, now)
            last = self._lag_reported.get(run)
            if last is not None and last[0] == oldest and (oldest is None or now - last[1] < LAG_EVENT_EVERY):
                continue
            self._lag_reported[run] = (oldest, now)
            newest = max(self._durable.get(run, ()), default=-1)
            behind = sum(1 for (r, step) in self._status if r == run and step > newest)
            self._events(run).emit(Event.DRAIN_LAG, seconds=seconds, oldest_step=oldest, steps_behind=behind)

    def _free_bytes(self) -> int | None:
        try:
            st = os.statvfs(self.root)
        except OSError:
            return None
        return st.f_bavail * st.f_frsize

    def metrics(self) -> DaemonMetrics:
        """A snapshot of what the Prometheus textfile shows."""
        now = self.clock()
        runs = {}
        statuses = list(self._status.values())
        for run in self._runs:
            mine = [st for st in statuses if st.run_id == run]
            pending = sum(1 for st in mine if st.state in ("draining", "retrying")
                          or (st.state == "local" and (run, st.step) in self._pending_keys))
            runs[run] = RunGauges(drain_lag_seconds=self._lag(run, now)[0],
                                  local_newest_step=max((st.step for st in mine), default=-1),
                                  durable_newest_step=max(self._durable.get(run, ()), default=-1),
                                  steps_pending_drain=pending, ends=self._ends(run), goodput=self._goodput(run))
        try:
            min_free: int | None = min_free_bytes(self.min_free, self.root)
        except (OSError, ValueError):
            min_free = None
        return DaemonMetrics(node=self.node, local_root=self.root, up=self._up, start_time=self.started_at, updated_at=now,
                             counters=dict(self.counters), throughput=self._throughput,
                             local_free_bytes=self._free_bytes(), local_min_free_bytes=min_free, runs=runs)

    def _goodput(self, run: str) -> float | None:
        """The run's goodput as ``rslurm report`` computes it from the event log and the history on this node
        (the batch host's log has the launcher's records). The log grows with the run: it is read again only
        when it changed, at most every :data:`GOODPUT_EVERY_S` once known. None when it cannot be told (no log, no
        wall time yet, a log that cannot be read: a metric must never stop the daemon)."""
        from ..catalog.history import read_history
        from ..catalog.report import report_run

        try:
            st = os.stat(RunDir(self.root, run).events)
        except OSError:
            return None
        key, now = (st.st_size, st.st_mtime_ns), time.monotonic()
        cached = self._goodputs.get(run)
        # Read again when the log changed: at most every GOODPUT_EVERY_S, but at once while the value is not
        # known yet and for the last snapshot a daemon writes before it exits.
        if cached is not None and (cached[0] == key or (now - cached[1] < GOODPUT_EVERY_S
                                                        and cached[2] is not None and self._up)):
            return cached[2]
        try:
            report = report_run(self.root, run, read_history(self.root, run))
            value = report.kept_s() / report.wall_s if report.wall_s > 0 else None
        except Exception as exc:  # a damaged log: the report names it; the metric is left out
            log.debug("goodput of run %s not computed: %s", run, exc)
            value = None
        self._goodputs[run] = (key, now, value)
        return value

    def _ends(self, run: str) -> Mapping[str, int]:
        """The run's ends by class, from its history on this node (the batch host's); empty elsewhere."""
        from ..catalog.history import ends_by_reason, read_history

        return ends_by_reason(read_history(self.root, run).history)

    def _write_status(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_status_write < 1.0:
            return
        # Transfers report progress from the tier's threads: one writer at a time, and none waits.
        if not self._publish_lock.acquire(blocking=force):
            return
        try:
            self._last_status_write = now
            try:
                atomic_write(status_path(self.root), json.dumps(self.status(), indent=1).encode(), root=self.root)
            except (OSError, ResilientSlurmError) as exc:
                log.warning("cannot write the daemon status: %s", exc)
            if self.metrics_textfile:
                self._write_metrics(self.metrics_textfile)
        finally:
            self._publish_lock.release()

    def _write_metrics(self, path: str) -> None:
        try:
            write_metrics_textfile(path, self.metrics())
        except (OSError, ValueError) as exc:
            (log.debug if self._metrics_warned else log.warning)("cannot write the metrics textfile %s: %s",
                                                                  path, exc)
            self._metrics_warned = True
        else:
            self._metrics_warned = False


def read_status(root: str) -> dict[str, Any] | None:
    """The status a node's daemon last wrote, or None."""
    try:
        with os.fdopen(open_state_file(os.path.join(root, STATE_DIR), STATUS_FILE, os.O_RDONLY), "rb") as f:
            raw = f.read(STATUS_MAX_BYTES + 1)
        data = load_json(raw, source=status_path(root)) if len(raw) <= STATUS_MAX_BYTES else None
        return data if isinstance(data, dict) else None
    except (OSError, ConfigError):  # ConfigError: a symlink or special file, or not JSON: not read
        return None


__all__ = ["Daemon", "DaemonRunningError", "StepStatus", "daemon_running", "min_free_bytes", "read_status",
           "status_path"]
