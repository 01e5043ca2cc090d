"""``rslurm launch``: run the ranks, turn stop signals into an emergency checkpoint, then requeue.

Call order (one ``Launcher`` per job incarnation, on the batch host; or one per local run):

1. ``Launcher(command, nprocs=..., settings=...)`` resolves settings and decides the mode:
   inside a Slurm job (``SLURM_JOB_ID``) it may requeue; ``command`` starting with ``srun`` runs as one
   job step (ranks on every node), ``-n N`` starts N local ranks with torch.distributed variables set,
   anything else runs as one process.
2. :meth:`Launcher.run`: reads the newest committed step (the baseline), installs the signal traps,
   starts the control server for this node, the optional cloud notice watcher, then the children, and
   loops until they are gone:

   * a trapped signal (or cloud notice) sets the stop reason and a deadline (the job's end from
     ``scontrol``, minus ``requeue_margin``; ``save_timeout`` when Slurm gives none), asks this node's
     ranks over the control socket and, when the job spans several nodes, every rank through
     ``scancel --signal=<save_signal>``;
   * once every registered rank reported the emergency commit, ranks get ``term_grace`` seconds to
     exit on their own; after that, or at the deadline, their process trees are torn down;
   * a rank that failed on its own bounds how long the others may linger (``PEER_EXIT_WAIT``).

3. The outcome (why the incarnation ended) goes through :class:`~.policy.RequeuePolicy` with the
   :class:`~.policy.ProgressHistory` stored next to the checkpoints; the history is written, then the
   job is requeued, held, or the launcher exits with the rank's code. Requeueing kills the launcher,
   so it is the last thing done.

Every step is logged, and appended as an event with ``source: launcher`` to the run's event log
``<run dir>/events.jsonl`` (:mod:`resilient_slurm.telemetry`; signal, save request, commit, ranks gone,
decision, requeue call), so that signal-to-commit and signal-to-requeue latencies can be measured from
the outside. The ranks and the drain daemon on this node append to the same file.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import psutil

from .. import config
from ..control import ControlServer, default_socket_path
from ..control.heartbeat import DUMP_SIGNAL, STACKS_DIR, clear_heartbeats, read_heartbeats
from ..errors import ConfigError, ControlSetupError, ResilientSlurmError, SlurmError, SlurmJobNotFoundError
from ..jobenv import JobEnv
from ..layout import WRITER_ENV, RunWriter, claim_run, list_run_dir
from ..manifest import MANIFEST_NAME, read_manifest_file, step_dirname
from ..paths import default_local_dir, default_run_id, expand_local_dir, load_json, node_name, open_regular
from ..rendezvous import rendezvous_failure_line
from ..slurm import JobInfo, SlurmClient, slurm_client
from ..slurm.client import expand_hostlist, remaining_seconds
from ..storage.fileio import atomic_write
from ..telemetry import EventLog, events_path
from .attribution import HangCause, OomCounters, attribute_failure, attribute_hang
from .cloud import Notice, TerminationNoticeWatcher
from .durability import DAEMON_STEP_NAME, JobDrain
from .hang import Hang, HangWatch
from .health import NodeHealth, check_allocation, exclude, requested_nodes
from .health import summary as health_summary
from .policy import (
    HISTORY_FILE,
    HOLD_EXIT_CODE,
    REQUEUE_EXIT_CODE,
    Action,
    Decision,
    Outcome,
    ProgressHistory,
    RankRun,
    Reason,
    RequeuePolicy,
    describe_outcome,
    restartable,
    restore_unavailable,
    traceback_location,
)
from .processes import Children, LocalRanks, RankExit, SrunStep
from .rank_env import node_address_map
from .signals import SignalTrap, TrapEvent
from .stacks import pyspy, pyspy_dump
from .startup import RANKS_MARKER_VAR, NotJudged, StartupFailure, StartupWatch, startup_bound

log = logging.getLogger(__name__)

# After one rank failed on its own, how long the others may take to notice (a collective error) and
# exit before the launcher tears them down.
PEER_EXIT_WAIT = 30.0
STACK_DUMP_WAIT_S = 2.0  # after asking for the stacks, before the teardown
IN_JOB_BACKOFF_S = 2.0  # before the first in-job restart; doubled for each next one
IN_JOB_BACKOFF_MAX_S = 60.0
# Ends the ranks can come back from inside the allocation: the job and its nodes are fine, a rank was not
# (an out-of-memory only when the kernel killed the rank: one the program raised would repeat). A lost
# node is not among them: a new step would be placed on it again.
IN_JOB_RESTARTABLE = frozenset({Reason.HANG, Reason.KILLED_BY_SIGNAL, Reason.OUT_OF_MEMORY,
                                Reason.COMMUNICATOR_ERROR})
# Ends after which waiting for the newest step to become durable is not worth it (the ranks failed: that
# step, if any, was an interval save the daemon drains anyway).
_NO_DURABLE_WAIT = frozenset({Reason.USER_ERROR, Reason.NODE_FAILURE, Reason.HANG, Reason.STORAGE_UNAVAILABLE,
                              Reason.KILLED_BY_SIGNAL, Reason.OUT_OF_MEMORY, Reason.COMMUNICATOR_ERROR,
                              Reason.STARTUP})
# A stop signal with the job's end this close is the time limit (USR1 from --signal, or SIGTERM at the
# end); further away it is a preemption or an operator's request.
TIME_LIMIT_WINDOW = 15 * 60.0
INTERRUPT_EXIT_CODE = 130  # local mode, Ctrl-C: the shell convention


def newest_committed(run_dir: str) -> tuple[int | None, str | None]:
    """The newest step under ``run_dir`` with a readable manifest, and its reason."""
    try:
        committed = list_run_dir(run_dir).committed
    except OSError as exc:
        log.warning("cannot list %s: %s", run_dir, exc)
        return None, None
    for step in reversed(committed):
        path = os.path.join(run_dir, step_dirname(step), MANIFEST_NAME)
        try:
            return step, read_manifest_file(path).reason
        except (OSError, ResilientSlurmError):
            continue
    return None, None


@dataclass
class StopRequest:
    """Why and by when the ranks were asked to stop."""

    source: str  # SIGTERM, SIGUSR1, SIGUSR2, SIGINT, cloud
    at: float
    deadline: float
    reason: Reason
    job: JobInfo | None = None


@dataclass
class LaunchResult:
    """What one launcher run ended with (the exit code is also the process's)."""

    exit_code: int
    outcome: Outcome
    decision: Decision | None
    timings: dict[str, float] = field(default_factory=dict)


class Launcher:
    """Runs one incarnation of a job (see the module docstring for the call order)."""

    def __init__(self, command: Sequence[str], *, nprocs: int | None = None,
                 settings: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None,
                 slurm: SlurmClient | None = None, config_path: str | None = None) -> None:
        if not command:
            raise ConfigError("rslurm launch: no command given; usage: rslurm launch [options] -- srun ... "
                              "| -n N -- cmd ...")
        self.env = dict(os.environ if env is None else env)
        if config_path:  # `rslurm --config FILE launch`: the ranks and the daemon read the same file
            self.env["RSLURM_CONFIG"] = os.path.abspath(config_path)
        # Every setting, including those only the ranks and the daemon read: a bad value fails here,
        # before any rank starts.
        self.cfg = config.load(settings, self.env, config_path=config_path)
        if nprocs is not None and nprocs < 1:
            raise ConfigError(f"rslurm launch: -n must be >= 1, got {nprocs}")
        self.command = list(command)
        self.srun = os.path.basename(self.command[0]) == "srun"
        if self.srun and nprocs is not None:
            raise ConfigError("rslurm launch: -n starts local ranks; with srun, give the task count to srun")
        job = JobEnv.from_env(self.env)
        self.job_id: str | None = job.job_id
        if self.srun and not self.job_id:
            raise ConfigError("rslurm launch -- srun ...: not inside a Slurm allocation (SLURM_JOB_ID is not "
                              "set); submit it with sbatch, or run locally with `rslurm launch -n N -- cmd`")
        self.nprocs = nprocs
        self.node = node_name(self.cfg.node_name)
        self.run_id: str = self.cfg.run_id or default_run_id(self.env)
        root = expand_local_dir(self.cfg.local_dir or default_local_dir(), self.node)
        self.run_dir = os.path.join(root, self.run_id)
        self.restart_count = job.restart_count
        self.events = EventLog(root, self.run_id, source="launcher", node=self.node, keep_open=False,
                               job_id=self.job_id, restart_count=self.restart_count)
        self.policy = RequeuePolicy(max_restarts=self.cfg.max_restarts,
                                    no_progress_limit=self.cfg.no_progress_limit or None)
        self._slurm = slurm
        sock_name = self.job_id or f"local-{os.getpid()}"
        self.socket_path = default_socket_path(sock_name, self.node, runtime_dir=self.cfg.control_dir,
                                               env=self.env)
        self.stop: StopRequest | None = None
        self.timings: dict[str, float] = {}
        self._children: Children | None = None
        self._server: ControlServer | None = None
        self._emergency_seen = False
        self._interrupts = 0
        self._deferred_signal: int | None = None  # save signal held back until a rank registers
        self.hang_watch = HangWatch(self.socket_path, timeout=self.cfg.hang_timeout,
                                    startup_timeout=self.cfg.hang_startup_timeout)
        self.hang: Hang | None = None
        self.hang_cause: HangCause | None = None  # the hang verdict read with the ranks' output at that moment
        self.startup: StartupWatch | None = None  # the start-up bound of the current srun step of ranks
        self.startup_failure: StartupFailure | None = None
        self._ranks_seen = False  # a rank of this node registered or wrote a heartbeat in this run of the ranks
        self._ranks_seen_check = 0.0
        self._runs = 0  # runs of the ranks started by this launcher (each srun step gets its own marker)
        self._deferred_check_at = 0.0
        self._kill_wait_s: float | None = None
        self._oom = OomCounters()
        self._root_failures: list[RankExit] = []  # the ranks found failed first, in this run of the ranks
        self._in_job_runs: list[RankRun] = []  # runs of the ranks that ended in an in-job restart
        self._history_seen: ProgressHistory | None = None  # read once, for the default cadence
        self._unhealthy: list[NodeHealth] = []  # nodes the last health check found bad and could not exclude
        self._excluded: list[str] = []  # nodes taken out of the srun command (the allocation had spares)
        self._user_command = list(self.command)
        self.drain: JobDrain | None = None
        if self.cfg.durable:
            self.drain = JobDrain(self.cfg, self.env, root=root, run_id=self.run_id,
                                  slurm_nodes=self._num_nodes() if self.srun else None,
                                  enabled=self.cfg.daemon == "auto")

    # ------------------------------------------------------------------ helpers
    @property
    def slurm(self) -> SlurmClient:
        """The Slurm client (built on first use)."""
        if self._slurm is None:
            self._slurm = slurm_client(self.cfg.slurm_backend)
        return self._slurm

    def _event(self, kind: str, **fields: Any) -> None:
        self.events.emit(kind, **fields)

    def _job_info(self) -> JobInfo | None:
        if not self.job_id:
            return None
        try:
            return self.slurm.job_info(self.job_id)
        except SlurmError as exc:
            log.warning("cannot read job %s from Slurm (%s); going on without its end time", self.job_id, exc)
            return None

    def _rank_env(self) -> dict[str, str]:
        env = dict(self.env)
        if env.get("RSLURM_CONTROL_SOCKET", "").strip().lower() != "off":  # off: signals only (tests, policy)
            env["RSLURM_CONTROL_SOCKET"] = self.socket_path
        env["RSLURM_RUN_ID"] = self.run_id  # ranks and launcher must name the same run
        env["RSLURM_SAVE_SIGNAL"] = self.cfg.save_signal
        if self.cfg.failure_interval is None:  # the default cadence plans for what this run has seen
            m = self._observed_failure_interval()
            if m is not None:
                env["RSLURM_FAILURE_INTERVAL"] = f"{m:.0f}"
        return env

    def _observed_failure_interval(self) -> float | None:
        """The run's mean time between unannounced failures, from its history and this incarnation's
        in-job restarts so far; None before the first failure (the rank's default then applies). The
        history is read once per launcher run, from this node only (a durable tier that does not answer
        must not delay the ranks' start for a cadence hint)."""
        if self._history_seen is None:
            from ..catalog.history import read_history

            try:
                self._history_seen = read_history(os.path.dirname(self.run_dir), self.run_id, None).history
            except Exception as exc:  # a cadence hint is not worth a launch
                log.warning("cannot read the run's history for the default cadence: %s", exc)
                self._history_seen = ProgressHistory()
        return self._history_seen.failure_interval(now=time.time(), started_at=self.timings.get("start"),
                                                   in_job=self._in_job_runs)

    def _num_nodes(self) -> int:
        """Nodes of the job: the drain daemon's job step runs one task on each."""
        return job_num_nodes(self.env)

    def _multi_node(self) -> bool:
        """True when ranks may run on other nodes (save requests then go through Slurm)."""
        return job_num_nodes(self.env) > 1

    def _warn_if_not_exec(self) -> None:
        """``--signal=B:...`` reaches the batch shell only: a launcher under it never hears the signal."""
        if not self.job_id:
            return
        try:
            parent = psutil.Process(os.getppid()).cmdline()
        except (psutil.Error, OSError):
            return
        if any(os.path.basename(a) == "slurm_script" for a in parent):
            log.warning("rslurm launch runs as a child of the batch script: a `--signal=B:...` signal reaches "
                        "the shell, not rslurm. Start it with `exec rslurm launch ...` (or `exec rsrun ...`)")

    # ------------------------------------------------------------------ run
    def run(self) -> LaunchResult:
        """Run the incarnation to its end and act on the decision; returns the exit code to use. First the
        run is claimed (one writer per run, :func:`~resilient_slurm.layout.claim_run`): a run another
        launcher or rank set writes raises :class:`~resilient_slurm.layout.RunInUseError` (exit 2) before
        anything is started or written."""
        me = RunWriter.this_process(self.job_id)
        claim = claim_run(os.path.dirname(self.run_dir), self.run_id, me, job_ended=self._job_ended)
        self.env[WRITER_ENV] = me.token  # its ranks write for it (their Checkpointer shares the claim)
        try:
            return self._run()
        finally:
            claim.release()

    def _job_ended(self, job_id: str) -> bool:
        """Slurm says ``job_id`` (another run's writer) has ended; False when it cannot tell."""
        try:
            return self.slurm.job_info(job_id).finished
        except SlurmJobNotFoundError:
            return True  # purged after MinJobAge: long over
        except (ResilientSlurmError, OSError):
            return False

    def _run(self) -> LaunchResult:
        baseline, _ = newest_committed(self.run_dir)
        self.timings["start"] = time.time()
        self._event("start", command=self.command, baseline_step=baseline, socket=self.socket_path)
        self._warn_if_not_exec()
        trap = SignalTrap().install()
        server = self._server = ControlServer(self.socket_path)
        watcher: TerminationNoticeWatcher | None = None
        try:
            try:
                server.start()
            except ControlSetupError as exc:
                # The socket is a convenience, not a requirement: signals still reach every rank.
                log.error("control socket unavailable (%s); ranks get save requests by signal only", exc)
                self.env["RSLURM_CONTROL_SOCKET"] = "off"
            if self.cfg.cloud_notice != "off":
                def on_notice(n: Notice) -> None:
                    trap.notify("cloud", n.deadline_epoch)

                watcher = TerminationNoticeWatcher(self.cfg.cloud_notice_url, kind=self.cfg.cloud_notice,
                                                   interval=self.cfg.cloud_notice_interval,
                                                   on_notice=on_notice).start()
            if self.drain is not None:
                self.drain.start()
            restarts = stalled = 0
            first_baseline = baseline  # what the incarnation restored: its progress is measured from there
            children: Children | None = None
            while True:
                self._unhealthy = self._health_gate()
                if self._unhealthy:
                    break  # no spare nodes: the incarnation ends as a node failure, the job is requeued
                children = self._start_ranks()
                self._loop(trap, children, server)
                children.finish()
                outcome = self._outcome(children, baseline)
                if not self._restart_in_job(outcome, restarts, stalled, baseline, trap, server, children):
                    break
                self._in_job_runs.append(RankRun(outcome.reason.value, outcome.evidence or outcome.detail,
                                                 outcome.committed_step, time.time()))
                stalled = stalled + 1 if outcome.committed_step == baseline else 0
                restarts += 1
                baseline = outcome.committed_step
            baseline = first_baseline
        finally:
            if watcher is not None:
                watcher.stop()
            status = server.status() if server.running else None
            server.stop()
        if status and (status.get("last_committed") or {}).get("reason") == "emergency":
            self._emergency_seen = True
        outcome = self._outcome(children, baseline)
        try:
            self._await_durable(outcome)
            return self._act(outcome)
        finally:
            if self.drain is not None:
                self.drain.stop()
            trap.restore()

    def _allocation_nodes(self) -> list[str]:
        """The hosts of the job's allocation (SLURM_JOB_NODELIST), as Slurm names them."""
        nodelist = JobEnv.from_env(self.env).job_nodelist or ""
        try:
            return self.slurm.hostnames(nodelist) if nodelist else []
        except SlurmError:
            return expand_hostlist(nodelist)

    def _health_gate(self) -> list[NodeHealth]:
        """Check every node before a launch of the ranks. Unhealthy nodes are taken out of the srun command
        when the allocation still has the nodes it asks for (``srun -N``); returns those that could not be
        (then the incarnation ends as a node failure). A check that no node answered is logged and ignored:
        the check itself failed, not the nodes."""
        nodes = self._allocation_nodes() if self.srun else None
        if self.srun and not nodes:
            return []
        results = check_allocation(self.cfg, self._rank_env(), nodes=nodes, run_id=self.run_id,
                                   exclude=self._excluded)
        bad = [h for h in results if not h.ok]
        if not bad:
            return []
        if len(bad) == len(results) and all(h.problems[0].startswith("no answer") for h in bad) and len(results) > 1:
            log.warning("the node health check step failed on every node (%s); going on without it",
                        health_summary(bad))
            return []
        action = "requeue" if self.job_id else "exit"
        if self.srun and nodes is not None:
            need = requested_nodes(self._user_command)
            healthy = len(nodes) - len(self._excluded) - len(bad)
            if need is not None and healthy >= need:
                self._excluded += [h.node for h in bad]
                self.command = exclude(self._user_command, self._excluded)
                action = "excluded"
        (log.warning if action == "excluded" else log.error)(
            "unhealthy node(s): %s; %s", health_summary(bad),
            f"starting the ranks without them ({' '.join(self.command[:2])})" if action == "excluded"
            else "the allocation has no spare node for them")
        self._event("node_unhealthy", nodes=[{"node": h.node, "problems": list(h.problems)} for h in bad],
                    action=action, excluded=list(self._excluded))
        return [] if action == "excluded" else bad

    def _start_ranks(self) -> Children:
        """Start one run of the ranks (a new srun step, or new local processes)."""
        clear_heartbeats(self.socket_path)  # records of ranks killed in an earlier run would look hung
        self.hang, self.hang_cause = None, None
        self._root_failures = []
        self._oom = OomCounters()
        self.hang_watch = HangWatch(self.socket_path, timeout=self.cfg.hang_timeout,
                                    startup_timeout=self.cfg.hang_startup_timeout)
        env = self._rank_env()
        self.startup, self.startup_failure, self._ranks_seen, self._ranks_seen_check = None, None, False, 0.0
        self._runs += 1
        if self.srun:
            marker = f"{os.getpid()}.{self._runs}"
            env[RANKS_MARKER_VAR] = marker
            addrs = self._node_addresses(env)
            bound = startup_bound(self.cfg.startup_timeout, self._num_nodes())
            self.startup = StartupWatch(bound, marker=marker, node=self.node, started_at=time.time(),
                                        user_addr=JobEnv.from_env(self.env, warn=False).master_addr,
                                        expected=addrs or {})
            children: Children = SrunStep(self.command, env, addrs)
        elif self.nprocs is not None:
            children = LocalRanks(self.command, self.nprocs, env, _free_port())
        else:
            children = LocalRanks(self.command, 1, env, 0, dist_env=False)
        self._children = children
        try:
            children.start()
        except OSError as exc:
            children.teardown(0)  # ranks started before the one that failed
            raise ConfigError(f"rslurm launch: cannot start {self.command[0]!r}: {exc.strerror or exc}") from exc
        self._oom.watch(children.pids)
        return children

    def _node_addresses(self, env: Mapping[str, str]) -> dict[str, str | None] | None:
        """The rendezvous address of each node of the allocation (:func:`~.rank_env.node_address_map`: one
        ``scontrol show node``), for the task prolog's MASTER_ADDR; None when the user set MASTER_ADDR."""
        job = JobEnv.from_env(env, warn=False)
        if job.master_addr:
            return None
        nodes = self._allocation_nodes()
        nodelist = JobEnv.from_env(self.env).job_nodelist or ""
        if not nodes or not nodelist:
            return None
        addrs = node_address_map(nodes, lambda: self.slurm.node_addresses(nodelist))
        first = next((n for n in nodes if n not in self._excluded), nodes[0])
        log.info("rendezvous: each task's MASTER_ADDR is the address of its step's first node as Slurm knows it "
                 "(NodeAddr; %s -> %s), MASTER_PORT %s", first, addrs.get(first) or "none",
                 job.master_port or "derived from the job id")
        return addrs

    def _ranks_started(self, server: ControlServer) -> bool:
        """A rank of this node registered on the control socket or wrote a heartbeat (it built its
        Checkpointer, which comes after the rendezvous), in this run of the ranks."""
        if not self._ranks_seen:
            self._ranks_seen = bool(server.status()["ranks"]) or bool(read_heartbeats(self.socket_path))
        return self._ranks_seen

    def _on_startup_timeout(self, children: Children) -> None:
        """The start-up bound passed with no rank of this node started: judge it (:mod:`.startup`); a failed
        start is said in one message, recorded as a ``startup_failed`` event, and the ranks torn down."""
        assert self.startup is not None
        verdict = self.startup.examine(children.stderr_tail(0), self.run_dir)
        if isinstance(verdict, NotJudged):
            log.warning("%s", verdict.why)
            self._event("startup_not_judged", why=verdict.why)
            return
        self.startup_failure = verdict
        log.error("%s", verdict.message())
        self._event("startup_failed", message=verdict.message(), **verdict.to_json())
        self._teardown(children, grace=self.cfg.term_grace)

    def _restart_in_job(self, outcome: Outcome, restarts: int, stalled: int, baseline: int | None,
                        trap: SignalTrap, server: ControlServer, children: Children) -> bool:
        """After a hang or a rank killed by a signal (nothing asked the ranks to stop): restart them inside
        this allocation, from the last commit, after an exponential backoff; False when the outcome is not
        one for that, ``in_job_restarts`` are used up, or restarts in a row commit nothing new
        (``no_progress_limit``): then the usual requeue path decides."""
        if (outcome.reason not in IN_JOB_RESTARTABLE or not restartable(outcome) or self.stop is not None
                or self._interrupts):
            return False
        what = describe_outcome(outcome)
        if restarts >= self.cfg.in_job_restarts:
            log.error("in-job restarts used up (%d, in_job_restarts=%d) after %s; falling back to requeue",
                      restarts, self.cfg.in_job_restarts, what)
            return False
        no_progress = stalled + 1 if outcome.committed_step == baseline else 0
        if self.cfg.no_progress_limit and restarts and no_progress >= self.cfg.no_progress_limit:
            log.error("%d in-job restarts in a row committed nothing new (no_progress_limit=%d); falling back "
                      "to requeue", no_progress, self.cfg.no_progress_limit)
            return False
        backoff = min(IN_JOB_BACKOFF_MAX_S, IN_JOB_BACKOFF_S * 2 ** restarts)
        log.warning("%s; restarting the ranks in this allocation from step %s in %.0f s (in-job restart %d of %d)",
                    what, outcome.committed_step, backoff, restarts + 1, self.cfg.in_job_restarts)
        self._event("in_job_restart", attempt=restarts + 1, limit=self.cfg.in_job_restarts,
                    outcome=outcome.reason.value, detail=what, evidence=outcome.evidence,
                    committed_step=outcome.committed_step, backoff_s=backoff)
        end = time.time() + backoff
        while time.time() < end:  # a stop signal during the backoff ends the run as that stop
            if trap.wait(min(0.2, max(0.0, end - time.time()))):
                for ev in trap.pop():
                    self._on_event(ev, children, server)
            if self.stop is not None or self._interrupts:
                return False
        return True

    def _loop(self, trap: SignalTrap, children: Children, server: ControlServer) -> None:
        first_failure: float | None = None
        committed_at: float | None = None
        while not children.poll():
            if trap.wait(0.05):
                for ev in trap.pop():
                    self._on_event(ev, children, server)
            now = time.time()
            if self._interrupts >= 2:
                log.warning("second interrupt: tearing the ranks down now")
                children.teardown(0)
                break
            stop = self.stop
            self._send_deferred_signal(server, now)
            if stop is not None and committed_at is None and server.state.save_request is None:
                committed_at = now
                self.timings["committed"] = now
                last = server.status().get("last_committed") or {}
                self._emergency_seen = True
                log.info("emergency checkpoint of step %s committed %.2f s after %s", last.get("step"),
                         now - stop.at, stop.source)
                self._event("committed", step=last.get("step"), after_signal_s=now - stop.at)
            if stop is not None and now >= stop.deadline:
                log.error("ranks missed the deadline (%s + %.1f s): tearing their process trees down",
                          stop.source, stop.deadline - stop.at)
                self._event("deadline_missed", committed=committed_at is not None)
                self._teardown(children, grace=0)
                break
            if committed_at is not None and now >= committed_at + self.cfg.term_grace:
                log.warning("ranks did not exit within %.0f s of the committed emergency checkpoint; tearing "
                            "them down", self.cfg.term_grace)
                self._teardown(children, grace=min(2.0, max(0.0, stop.deadline - now)) if stop else 2.0)
                break
            if stop is None and first_failure is None and (hang := self.hang_watch.check(now)) is not None:
                self._on_hang(hang, children)
                break
            if not self._ranks_seen and now >= self._ranks_seen_check:
                self._ranks_seen_check = now + 1.0
                self._ranks_started(server)
            if (stop is None and first_failure is None and self.startup is not None
                    and self.startup.due(now, lambda: self._ranks_started(server))):
                self._on_startup_timeout(children)
                if self.startup_failure is not None:
                    break
            if first_failure is None and children.failures():
                first_failure = now
                self._root_failures = list(children.failures())
                log.warning("%s; the others get %.0f s to exit", children.failures()[0].describe(), PEER_EXIT_WAIT)
            if first_failure is not None and now >= first_failure + PEER_EXIT_WAIT:
                log.error("ranks still running %.0f s after a rank failed: tearing them down", PEER_EXIT_WAIT)
                self._teardown(children, grace=self.cfg.term_grace)
                break
        self.timings["ranks_exited"] = time.time()
        self._event("ranks_exited", torn_down=children.torn_down)

    def _on_hang(self, hang: Hang, children: Children) -> None:
        """The job is hung: every rank's stacks to the run directory, a ``hang`` event, then teardown. The
        verdict is classed with what the ranks said up to now (:func:`~.attribution.attribute_hang`), read
        before the teardown, whose signals make the ranks print errors of their own."""
        hang = self.hang = hang.with_states(_process_state)
        cause = self.hang_cause = attribute_hang(hang.describe(), self._rank_outputs(children))
        log.error("hang: %s; writing every rank's Python stacks to %s, then tearing the ranks down",
                  hang.describe(), os.path.join(self.run_dir, STACKS_DIR))
        if cause.reason is not Reason.HANG:
            log.error("the ranks' output before the hang says why: %s", cause.evidence)
        stacks = self._dump_stacks(hang)
        self._event("hang", ranks=[s.to_json() for s in hang.stuck], ranks_seen=hang.ranks_seen,
                    timeout_s=self.hang_watch.step_limit(), stacks=stacks, cause=cause.reason.value,
                    evidence=cause.evidence)
        self._teardown(children, grace=self.cfg.term_grace)

    @staticmethod
    def _rank_outputs(children: Children) -> list[tuple[int | None, str]]:
        """Each local rank's stderr tail with its rank; under srun, srun's (every task's lines, one stream)."""
        if isinstance(children, LocalRanks):
            return [(r, children.stderr_tail(r)) for r in range(len(children.pids))]
        return [(None, children.stderr_tail(0))]

    def _dump_stacks(self, hang: Hang) -> list[str]:
        """Ask every rank for its stacks: py-spy for this node's ranks when installed, else the dump signal
        (faulthandler, registered by each Checkpointer), through Slurm for ranks on other nodes. Returns
        the files written on this node."""
        pids = {r: t.last.pid for r, t in self.hang_watch.tracks().items()}
        exe = pyspy()
        asked = time.time()
        written = []
        for rank, pid in sorted(pids.items()):
            if exe and (dumped := pyspy_dump(pid, self.run_dir, rank, exe=exe)) is not None:
                written.append(dumped[0])
                continue
            try:
                os.kill(pid, DUMP_SIGNAL)
            except ProcessLookupError:
                pass
        if self.srun and self.job_id and self._multi_node():
            try:
                self.slurm.signal(self.job_id, DUMP_SIGNAL)
            except SlurmError as exc:
                log.warning("could not ask the ranks on other nodes for their stacks: %s", exc)
        time.sleep(STACK_DUMP_WAIT_S)  # faulthandler writes from the signal handler, at once
        stacks = os.path.join(self.run_dir, STACKS_DIR)
        try:  # the files the ranks of this node wrote (a rank writes into its own node's run directory)
            written += sorted(e.path for e in os.scandir(stacks)
                              if e.name.endswith(".txt") and not e.name.endswith(".py-spy.txt")
                              and e.stat(follow_symlinks=False).st_mtime >= asked - 1)
        except OSError:
            pass
        return written

    def _send_save_signal(self, sig: int) -> None:
        """The save signal to every task of the job, through Slurm."""
        assert self.job_id is not None
        name = signal.Signals(sig).name
        self._event("save_signal_sent", signal=name)
        try:
            self.slurm.signal(self.job_id, sig)
        except SlurmError as exc:
            log.warning("could not forward %s to the job's tasks: %s; ranks on this node still got the request "
                        "over the control socket", name, exc)

    def _send_deferred_signal(self, server: ControlServer, now: float) -> None:
        """Send the save signal held back while no rank had registered, once one has (every rank traps it
        then), or at half the time to the deadline (ranks that never register: no Checkpointer)."""
        stop = self.stop
        if self._deferred_signal is None or stop is None or now < self._deferred_check_at:
            return
        self._deferred_check_at = now + 0.5
        registered = bool(server.status()["ranks"])
        if registered and not self._multi_node():
            self._deferred_signal = None  # one node: the socket reached every rank
            return
        if registered or now >= stop.at + (stop.deadline - stop.at) / 2:
            sig, self._deferred_signal = self._deferred_signal, None
            self._send_save_signal(sig)

    def _teardown(self, children: Children, grace: float) -> None:
        if self.srun and self.job_id:
            try:  # every task of the ranks' steps on every node; srun then exits
                self._kill_rank_steps()
            except SlurmError as exc:
                log.warning("could not kill the job's steps through Slurm: %s", exc)
        children.teardown(grace)

    def _kill_rank_steps(self) -> None:
        """SIGKILL to the job's steps but the batch script (this launcher), the extern step and the drain
        daemon's step: `scancel --signal=KILL <job>` would cancel the whole job, and the launcher must
        outlive the ranks to restart them in-job or requeue."""
        assert self.job_id is not None
        keep = (".batch", ".extern")
        steps = [sid for sid, name in self.slurm.steps(self.job_id)
                 if not sid.endswith(keep) and name != DAEMON_STEP_NAME]
        for sid in steps:
            self.slurm.signal(self.job_id, signal.SIGKILL, step=sid.split(".", 1)[1])
        log.info("SIGKILL to the ranks' job steps %s", ", ".join(steps) or "(none left)")

    def _on_event(self, ev: TrapEvent, children: Children, server: ControlServer) -> None:
        log.warning("received %s", ev.source)
        self._event("signal", signal=ev.source, at=ev.at)
        if ev.source == "SIGINT" or (ev.source in ("SIGTERM", "SIGHUP") and not self.job_id):
            self._interrupts += 1
        if self.stop is not None:
            if ev.deadline is not None or ev.source == "SIGTERM":
                new = self._deadline(ev, self._job_info())
                if new < self.stop.deadline:
                    self.stop.deadline = new
                    server.request_save("emergency", new)
            return
        job = self._job_info()
        deadline = self._deadline(ev, job)
        reason = self._reason(ev, job)
        self.stop = StopRequest(ev.source, ev.at, deadline, reason, job)
        self.timings["signal"] = ev.at
        server.request_save("emergency", deadline)
        self.timings["save_requested"] = time.time()
        self._event("save_requested", signal=ev.source, reason=reason.value, deadline=deadline,
                    deadline_in_s=deadline - time.time())
        log.warning("%s: emergency checkpoint requested (%s); deadline in %.1f s", ev.source, reason.value,
                    deadline - time.time())
        sig_name = self.cfg.save_signal
        if sig_name != "none":
            sig = int(getattr(signal, "SIG" + sig_name))
            registered = bool(server.status()["ranks"])
            if self.srun and self.job_id and (self._multi_node() or not registered):
                # Ranks on other nodes have no socket to this launcher (and on this node, none may have
                # registered): reach them through Slurm.
                if not registered and self.env.get("RSLURM_CONTROL_SOCKET", "").strip().lower() != "off":
                    # No rank said hello yet: they are still starting (importing torch, restoring), where
                    # the save signal's default action would kill them. A hello comes after a collective
                    # every rank enters with its traps installed, so the signal waits for the first one
                    # (or half the time to the deadline); the request is already on the socket, and the
                    # ranks' first step shares it with every rank.
                    self._deferred_signal = sig
                    log.info("no rank registered yet (still starting): SIG%s goes to the job's tasks once one "
                             "does", sig_name)
                    self._event("save_signal_deferred", signal=f"SIG{sig_name}")
                else:
                    self._send_save_signal(sig)
            elif not self.srun and not registered:
                # No rank registered on the socket (still starting, socket off, or a program without a
                # Checkpointer): forward SIGTERM, which a Checkpointer traps like the save signal and
                # which means "stop" to any other program (a rank still importing torch just ends,
                # with nothing lost since nothing was trained yet).
                children.signal_ranks(signal.SIGTERM)

    def _deadline(self, ev: TrapEvent, job: JobInfo | None) -> float:
        now = time.time()
        deadline = now + self.cfg.save_timeout
        margin = self.cfg.requeue_margin
        if ev.deadline is not None:
            deadline = min(deadline, ev.deadline - margin)
        if job is not None and _ending(job):
            # Slurm is already killing the job (scancel, the time limit without --signal, the end of a
            # preemption's grace): its SIGKILL follows the SIGTERM after KillWait. Save within that;
            # no requeue is possible any more, so no margin is kept for one.
            return max(now, ev.at + self._kill_wait() - 1.0)
        if job is not None:
            rem = remaining_seconds(job, now)
            if not math.isinf(rem):
                deadline = min(deadline, now + rem - margin)
        return max(deadline, now)

    def _kill_wait(self) -> float:
        if self._kill_wait_s is None:
            try:
                self._kill_wait_s = self.slurm.config_seconds("KillWait") or 30.0
            except SlurmError as exc:
                log.warning("cannot read KillWait from Slurm (%s); assuming 30 s", exc)
                self._kill_wait_s = 30.0
        return self._kill_wait_s

    def _reason(self, ev: TrapEvent, job: JobInfo | None) -> Reason:
        if ev.source == "cloud":
            return Reason.CLOUD_TERMINATION
        if job is not None:
            if job.preempt_time is not None:
                return Reason.PREEMPTED
            if _ending(job):
                # Slurm is killing the job: at the time limit it says so (Reason=TimeLimit, state TIMEOUT);
                # a job the user cancelled has no such reason (state CANCELLED, or COMPLETING while its
                # processes end). EndTime cannot tell them apart: a cancel moves it to now.
                if job.state == "TIMEOUT" or job.reason == "TimeLimit":
                    return Reason.TIME_LIMIT
                if job.state == "CANCELLED" or (job.state == "COMPLETING" and job.reason is None):
                    return Reason.CANCELLED
            rem = remaining_seconds(job, time.time())
            if rem <= TIME_LIMIT_WINDOW:
                return Reason.TIME_LIMIT
        return Reason.PREEMPTED

    # ------------------------------------------------------------------ outcome and action
    def _outcome(self, children: Children | None, baseline: int | None) -> Outcome:
        committed, newest_reason = newest_committed(self.run_dir)
        if newest_reason == "emergency" and committed is not None and committed != baseline:
            self._emergency_seen = True
        base = Outcome(Reason.COMPLETED, committed_step=committed, restored_step=baseline,
                       restart_count=self.restart_count, job_id=self.job_id)
        if self._unhealthy or children is None:
            bad = self._unhealthy
            return replace(base, reason=Reason.NODE_FAILURE, node=",".join(h.node for h in bad) or None,
                           evidence=f"node health check: {health_summary(bad)}", detail=health_summary(bad))
        exits = children.exits()
        stop = self.stop
        if self.hang is not None:
            cause = self.hang_cause or HangCause(Reason.HANG, self.hang.describe())
            detail = self.hang.describe() if cause.reason is Reason.HANG else cause.evidence
            return replace(base, reason=cause.reason, rank=cause.rank, detail=detail, evidence=cause.evidence)
        if self.startup_failure is not None and stop is None:
            f = self.startup_failure
            where = f"{f.addr}:{f.port}" if f.addr and f.port else "an unknown address"
            return replace(base, reason=Reason.STARTUP, node=f.node, evidence=f.message(),
                           detail=f"no rank started within {f.bound_s:.0f} s; rendezvous at {where}")
        if stop is not None:
            # We asked the ranks to stop (or tore them down): whatever their exit codes, the job was
            # stopped from outside and can go on from the last commit.
            return replace(base, reason=stop.reason, detail=f"stopped by {stop.source}",
                           evidence=self._stop_evidence(stop))
        failed = self._failed_in_order(children, exits)
        if self._emergency_seen and not any(e.exit_code not in (None, 0) for e in exits):
            # Slurm signalled the ranks directly (preemption without --signal): they saved and left.
            job = self._job_info()
            reason = Reason.PREEMPTED
            if job is not None and job.preempt_time is None and remaining_seconds(job, time.time()) <= TIME_LIMIT_WINDOW:
                reason = Reason.TIME_LIMIT
            source = "a signal from Slurm" if self.job_id else "a signal sent to the ranks, not to the launcher"
            detail = f"ranks took an emergency checkpoint on {source}"
            return replace(base, reason=reason, detail=detail, evidence=detail)
        if not failed:
            return replace(base, reason=Reason.COMPLETED, evidence="every rank exited 0")
        first = failed[0]
        if first.signal is not None:
            job = self._job_info()
            if job is not None and job.preempt_time is not None:
                return replace(base, reason=Reason.PREEMPTED, rank=first.rank, signal=first.signal, node=first.node,
                               evidence=f"{first.describe()}; Slurm set the job's PreemptTime")
        coded = [e for e in failed if e.exit_code not in (None, 0)]
        if any(restore_unavailable(self._stderr_of(children, e)) for e in coded):
            return replace(base, reason=Reason.STORAGE_UNAVAILABLE, rank=coded[0].rank,
                           detail="a rank could not restore: checkpoint storage failed (RestoreUnavailableError)",
                           evidence="resilient_slurm.errors.RestoreUnavailableError")
        att = attribute_failure(failed, lambda e: self._stderr_of(children, e), oom_evidence=self._oom.evidence(),
                                srun_text=children.stderr_tail(0) if self.srun else "")
        assert att is not None
        who = att.failed
        if att.reason is Reason.COMMUNICATOR_ERROR and not self._ranks_seen and (
                said := rendezvous_failure_line([self._stderr_of(children, who), children.stderr_tail(0)])):
            # The collective that failed was the rendezvous: no rank had started, and torch said it could
            # not reach the store. The address is the cause, not the network of a running job.
            return replace(base, reason=Reason.STARTUP, rank=who.rank, exit_code=who.exit_code, node=who.node,
                           evidence=f"{att.evidence}; before it: {said[0]}",
                           detail=f"the rendezvous failed before any rank started: {att.evidence}")
        if att.reason is Reason.USER_ERROR:
            return replace(base, reason=Reason.USER_ERROR, rank=who.rank, exit_code=who.exit_code, node=who.node,
                           error_location=self._error_location(children, who),
                           evidence=att.evidence or f"exit code {who.exit_code}, no Python traceback")
        return replace(base, reason=att.reason, rank=who.rank, signal=who.signal, exit_code=who.exit_code,
                       node=who.node, evidence=att.evidence, detail=att.evidence)

    def _failed_in_order(self, children: Children, exits: Sequence[RankExit]) -> list[RankExit]:
        """The ranks that failed, the root cause first: those the loop found failed first (before any
        teardown), then the others that failed on their own. When the loop saw none first (every rank
        ended between two polls), ranks killed by a signal come before ranks that exited with a code."""
        failed = [e for e in exits if not e.ok and (e.signal is not None or e.exit_code not in (None, 0))]
        root = list(self._root_failures)
        if root:
            rest = [e for e in failed if e not in root and (e.signal is None or not children.torn_down)]
            return root + rest
        return [e for e in failed if e.signal is not None] + [e for e in failed if e.signal is None]

    def _stop_evidence(self, stop: StopRequest) -> str:
        """What a stop's class was read from: the signal, and what Slurm said about the job then."""
        parts = [f"{stop.source} at {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(stop.at))}"]
        job = stop.job
        if stop.reason is Reason.CLOUD_TERMINATION:
            parts.append(f"termination notice from {self.cfg.cloud_notice} metadata")
        elif job is not None and job.preempt_time is not None:
            parts.append("Slurm set the job's PreemptTime")
        elif job is not None:
            rem = remaining_seconds(job, stop.at)
            if not math.isinf(rem):
                parts.append(f"{max(rem, 0.0):.0f} s of the time limit left")
        return "; ".join(parts)

    def _await_durable(self, outcome: Outcome) -> None:
        """Give the newest committed step a bounded chance to become durable before the requeue (or the
        end of a completed job): within the deadline when stopped, ``durable_wait`` at most."""
        step = outcome.committed_step
        if self.drain is None or step is None or outcome.reason in _NO_DURABLE_WAIT:
            return
        now = time.time()
        timeout = self.cfg.durable_wait
        if self.stop is not None:
            timeout = min(timeout, self.stop.deadline - now)
        elif outcome.reason is not Reason.COMPLETED:
            job = self._job_info()
            if job is not None and not math.isinf(rem := remaining_seconds(job, now)):
                timeout = min(timeout, rem - self.cfg.requeue_margin)
        t0 = time.time()
        ok = timeout > 0 and self.drain.wait_durable(step, timeout)
        waited = time.time() - t0
        self.timings["durable" if ok else "not_durable"] = time.time()
        self._event("durable" if ok else "not_durable", step=step, waited_s=waited,
                    after_signal_s=(time.time() - self.stop.at) if self.stop else None)
        if ok:
            log.info("step %d is durable in %s (waited %.2f s)", step, self.cfg.durable, waited)
        else:
            log.warning("step %d is not durable yet after %.1f s; going ahead with the local commit (the daemon "
                        "drains it later; a resume on other nodes uses the newest durable step)", step, waited)

    @staticmethod
    def _stderr_of(children: Children, failed: RankExit) -> str:
        idx = failed.rank if isinstance(children, LocalRanks) and failed.rank is not None else 0
        return children.stderr_tail(idx)

    def _error_location(self, children: Children, failed: RankExit) -> str | None:
        return traceback_location(self._stderr_of(children, failed), failed.rank)

    def _read_history(self) -> ProgressHistory:
        """The run's history: this node's copy or the durable tier's (requeued onto another batch host, the
        history follows the run there), whichever ended last. An unreadable copy is logged and skipped:
        a broken history must not keep a preempted job from being requeued (it only resets the counts)."""
        from ..catalog.history import read_history

        try:
            run = read_history(os.path.dirname(self.run_dir), self.run_id,
                               self.drain.tier if self.drain is not None else None)
        except Exception as exc:  # the contract: a damaged run file never changes the exit code (75 stays 75)
            log.warning("cannot read the run's history (%s: %s); counting restarts without it", type(exc).__name__,
                        exc)
            return ProgressHistory()
        for err in run.errors:
            log.warning("%s; counting restarts without it", err)
        return run.history

    def _record_history(self, history: ProgressHistory, outcome: Outcome, decision: Decision | None) -> None:
        """Append this incarnation's end (class, evidence, in-job restarts, the action) to the run's history
        in the run directory and, when there is one, the durable tier (best effort: a failure is logged)."""
        data = history.record(outcome, started_at=self.timings.get("start"), ended_at=time.time(),
                              action=decision.action.value if decision else Action.EXIT.value,
                              in_job=self._in_job_runs).to_json().encode()
        try:  # never through a link at the run directory or the file (ConfigError naming it)
            atomic_write(os.path.join(self.run_dir, HISTORY_FILE), data, root=os.path.dirname(self.run_dir))
        except (OSError, ResilientSlurmError) as exc:
            log.warning("cannot write the run's history in %s: %s", self.run_dir, exc)
        if self.drain is not None:
            self.drain.write_object(HISTORY_FILE, data)

    def _ranks_resumed_from(self) -> str:
        """What this node's ranks reported restoring in this launcher run (their ``restore`` events; the
        last run of the ranks after in-job restarts), in words: the step on disk at the start is only
        what they could resume from."""
        last: dict[int, int] = {}
        started = self.timings.get("start", 0.0)
        try:
            fd = open_regular(events_path(os.path.dirname(self.run_dir), self.run_id), os.O_RDONLY,
                              root=os.path.dirname(self.run_dir))
            with os.fdopen(fd, "rb") as f:
                lines = f.read(64 << 20).splitlines()
        except (OSError, ConfigError):  # none yet, or a link or special file there
            return "unknown (no event log)"
        for line in lines:
            try:
                rec = load_json(line, source="events.jsonl")
            except ConfigError:
                continue
            if (isinstance(rec, dict) and rec.get("source") == "rank" and rec.get("event") in ("restore", "restore_none")
                    and isinstance(rec.get("t"), (int, float)) and rec["t"] >= started and isinstance(rec.get("rank"), int)):
                step = rec.get("step")  # a damaged line must not change the exit code: whole numbers only
                last[rec["rank"]] = step if rec["event"] == "restore" and isinstance(step, int) else 0
        if not last:
            return "nothing (no rank on this node reported a restore)"
        steps = sorted(set(last.values()))
        if steps == [0]:
            return "nothing (a fresh start)"
        return f"step {steps[0]}" if len(steps) == 1 else "steps " + ", ".join(map(str, steps))

    def _act(self, outcome: Outcome) -> LaunchResult:
        log.info("incarnation ended: %s (committed step %s; the ranks resumed from %s)", outcome.reason.value,
                 outcome.committed_step, self._ranks_resumed_from())
        if not self.job_id:
            return self._act_local(outcome)
        history = self._read_history()
        # The requeue rules count the earlier incarnations of this job only (a new submission starts afresh).
        decision = self.policy.decide(outcome, history.of_job(self.job_id, self.restart_count))
        cancelled = outcome.reason is Reason.CANCELLED
        job = self._job_info() if decision.action is not Action.EXIT or cancelled else None
        ending = job is not None and _ending(job)
        if ending and not cancelled:
            # A time limit that struck before rslurm heard of it, or the end of a preemption's grace: Slurm is
            # ending the job and `requeue Incomplete` would not touch it. Decided before anything is said
            # or recorded, so that neither claims a requeue that does not happen.
            assert job is not None
            if job.preempt_time is not None:
                hint = "Slurm requeues a preempted job itself when the partition's PreemptMode is REQUEUE"
            else:
                hint = ("if this was the time limit, ask for a warning signal so rslurm can requeue in time: "
                        "#SBATCH --signal=B:USR1@300")
            decision = replace(decision, action=Action.EXIT, rule="already_ending", message=(
                f"not requeued: job {self.job_id} is already ending ({job.state}) after "
                f"{describe_outcome(outcome)}; {hint}. The last committed step is {outcome.committed_step}"))
        self._record_history(history, outcome, decision)  # before the requeue: it kills this process
        self._event("decision", action=decision.action.value, rule=decision.rule, message=decision.message,
                    outcome=outcome.reason.value, committed_step=outcome.committed_step,
                    restored_step=outcome.restored_step, evidence=outcome.evidence)
        quiet = cancelled or ending  # what the user or Slurm asked for
        (log.error if not quiet and (decision.action is Action.HOLD
                                     or decision.exit_code not in (0, REQUEUE_EXIT_CODE))
         else log.warning if decision.action is Action.REQUEUE or quiet else log.info)("%s", decision.message)
        result = LaunchResult(decision.exit_code, outcome, decision, self.timings)
        if ending:
            assert job is not None
            self._event("not_requeued", state=job.state)
            return result
        if decision.action is Action.EXIT:
            return result
        if job is not None and not job.requeue:
            log.error("job %s was submitted with --no-requeue (or JobRequeue=0): Slurm will not requeue it; "
                      "resubmit it to resume from step %s", self.job_id, outcome.committed_step)
            return result
        self.timings["requeue"] = time.time()
        self._event("requeue_call", action=decision.action.value,
                    after_signal_s=(self.timings["requeue"] - self.stop.at) if self.stop else None)
        sys.stderr.flush()
        try:
            if decision.action is Action.HOLD:
                self.slurm.requeue_hold(self.job_id, decision.message)
            else:
                self.slurm.requeue(self.job_id)
        except SlurmError as exc:
            log.error("requeue of job %s failed: %s; exiting %d so the job is not recorded COMPLETED",
                      self.job_id, exc, decision.exit_code)
        else:
            if outcome.reason is Reason.NODE_FAILURE and outcome.node:
                self._exclude_from_job(outcome.node.split(","))
        return result

    def _exclude_from_job(self, nodes: list[str], wait_s: float = 10.0) -> None:
        """Keep the requeued job off ``nodes``: Slurm changes a job's excluded nodes only once it is pending
        again, which the requeue makes it within moments (this process is killed only after that)."""
        assert self.job_id is not None
        end = time.time() + wait_s
        while True:
            try:
                merged = self.slurm.exclude_nodes(self.job_id, nodes)
            except SlurmError as exc:
                if time.time() < end:
                    time.sleep(0.3)
                    continue
                log.error("could not exclude %s from job %s (%s): it may start there again; exclude it yourself "
                          "with `scontrol update JobId=%s ExcNodeList=%s`", ",".join(nodes), self.job_id, exc,
                          self.job_id, ",".join(nodes))
                return
            log.warning("job %s will not run on %s again (ExcNodeList=%s)", self.job_id, ",".join(nodes),
                        ",".join(merged))
            return

    def _act_local(self, outcome: Outcome) -> LaunchResult:
        result = self._decide_local(outcome)
        self._record_history(self._read_history(), outcome, result.decision)
        return result

    def _decide_local(self, outcome: Outcome) -> LaunchResult:
        if outcome.reason is Reason.COMPLETED:
            return LaunchResult(0, outcome, None, self.timings)
        if outcome.reason is Reason.USER_ERROR or not restartable(outcome):
            d = self.policy.decide(outcome, ProgressHistory())
            log.error("%s", d.message)
            return LaunchResult(d.exit_code, outcome, d, self.timings)
        step = outcome.committed_step
        code = INTERRUPT_EXIT_CODE if self.stop is not None and self.stop.source == "SIGINT" else REQUEUE_EXIT_CODE
        msg = (f"stopped ({outcome.detail or outcome.reason.value}); "
               + (f"step {step} is committed" if step is not None else "nothing is committed")
               + ": run the same command again to resume")
        log.warning("%s", msg)
        return LaunchResult(code, outcome, Decision(Action.EXIT, code, msg, outcome.reason.value), self.timings)


def job_num_nodes(env: Mapping[str, str]) -> int:
    """Nodes of the Slurm job, for :meth:`Launcher._num_nodes` and :meth:`Launcher._multi_node`:
    ``SLURM_JOB_NUM_NODES``, else ``SLURM_NNODES``, else the hosts in ``SLURM_JOB_NODELIST``, else 1.
    A malformed variable (not an integer >= 1) is logged as a warning that names it and skipped, so
    both callers go on with the next source: one node count, never two different guesses
    (:meth:`JobEnv.node_count <resilient_slurm.jobenv.JobEnv.node_count>`)."""
    return JobEnv.from_env(env).node_count(expand_hostlist)


def _ending(job: JobInfo) -> bool:
    """Slurm is killing the job or has ended it: a requeue request would be ignored."""
    return job.finished or job.state == "COMPLETING"


def _process_state(pid: int) -> str | None:
    """A process's state as psutil names it ("stopped", "disk-sleep", "running", ...); None when it is gone
    or not on this node."""
    try:
        return str(psutil.Process(pid).status())
    except (psutil.Error, OSError):
        return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


__all__ = ["HISTORY_FILE", "HOLD_EXIT_CODE", "LaunchResult", "Launcher", "StopRequest", "job_num_nodes",
           "newest_committed"]
