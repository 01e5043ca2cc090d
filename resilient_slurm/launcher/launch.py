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
   * when Slurm is already ending the job (a cancel, the end of a preemption's grace), the end is
     decided and recorded (:func:`~.requeue.record_ending`) at the commit, or at the deadline, before
     the ranks are waited for: Slurm's SIGKILL follows KillWait after its SIGTERM;
   * a rank that failed on its own bounds how long the others may linger (``processes.Lingering``);
   * a hang (:mod:`.hang`) or a start that never got past the rendezvous (:mod:`.startup`) ends the run
     of the ranks, which may be restarted inside the allocation (:mod:`.restart`).

3. The outcome (why the incarnation ended, :mod:`.outcome`) goes through :class:`~.policy.RequeuePolicy`
   with the :class:`~.policy.ProgressHistory` stored next to the checkpoints (:mod:`.requeue`,
   :mod:`.history_io`); the history is written, then the job is requeued, held, or the launcher exits with
   the rank's code. Requeueing kills the launcher, so it is the last thing done.

What is here is the order of things; what each thing does lives in the module named for it: the health
gate (:mod:`.health`), a stop request, its deadline and the teardown (:mod:`.stopping`), the durability
wait (:mod:`.durability`). Each reads the launcher through :class:`~.context.LaunchContext`.

Every step is logged, and appended as an event with ``source: launcher`` to the run's event log
``<run dir>/events.jsonl`` (:mod:`resilient_slurm.telemetry`; signal, save request, commit, ranks gone,
decision, requeue call), so that signal-to-commit and signal-to-requeue latencies can be measured from
the outside. The ranks and the drain daemon on this node append to the same file.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

from .. import config
from ..control import ControlServer, default_socket_path
from ..control.heartbeat import clear_heartbeats, read_heartbeats
from ..control.rank import CONTROL_NODE_ENV
from ..errors import ConfigError, ControlSetupError, ResilientSlurmError, SlurmError, SlurmJobNotFoundError
from ..jobenv import JOB_PORTS, JobEnv
from ..layout import WRITER_ENV, RunWriter, claim_run
from ..paths import default_local_dir, default_run_id, expand_local_dir, node_name
from ..rendezvous import free_port
from ..rundir import RunDir
from ..slurm import JobInfo, SlurmClient, slurm_client
from ..slurm.client import expand_hostlist
from ..telemetry import Event, EventLog
from .attribution import HangCause, OomCounters
from .cloud import Notice, TerminationNoticeWatcher
from .context import launch_log as log
from .durability import JobDrain, await_durable
from .hang import Hang, HangWatch, respond_to_hang
from .health import HealthGate, NodeHealth
from .history_io import ObservedFailures
from .outcome import classify_outcome, newest_committed
from .policy import HISTORY_FILE, HOLD_EXIT_CODE, RequeuePolicy
from .processes import Children, Lingering, LocalRanks, RankExit, SrunStep
from .rank_env import rendezvous_addresses
from .requeue import LaunchResult, RecordedEnd, act_on_outcome, record_ending
from .restart import InJobRestarts
from .signals import SignalTrap, warn_if_not_exec
from .startup import RANKS_MARKER_VAR, StartupFailure, StartupWatch, judge_start, startup_bound
from .stopping import StopControl, StopRequest, teardown


def _check_command(command: Sequence[str], nprocs: int | None, job_id: str | None) -> bool:
    """Refuse a command line the launcher cannot run (ConfigError, before anything starts); True when the
    command is an ``srun``."""
    if not command:
        raise ConfigError("rslurm launch: no command given; usage: rslurm launch [options] -- srun ... "
                          "| -n N -- cmd ...")
    if nprocs is not None and nprocs < 1:
        raise ConfigError(f"rslurm launch: -n must be >= 1, got {nprocs}")
    srun = os.path.basename(command[0]) == "srun"
    if srun and nprocs is not None:
        raise ConfigError("rslurm launch: -n starts local ranks; with srun, give the task count to srun")
    if srun and not job_id:
        raise ConfigError("rslurm launch -- srun ...: not inside a Slurm allocation (SLURM_JOB_ID is not "
                          "set); submit it with sbatch, or run locally with `rslurm launch -n N -- cmd`")
    return srun


class Launcher:
    """Runs one incarnation of a job (see the module docstring for the call order): the orchestrator of
    :mod:`.health` (the gate before each start), :mod:`.stopping` (signals, deadlines, teardown),
    :mod:`.restart` (in-job restarts), :mod:`.outcome` (why the ranks ended), :mod:`.durability` and
    :mod:`.requeue` (acting on it). It is the :class:`~.context.LaunchContext` those parts read."""

    def __init__(self, command: Sequence[str], *, nprocs: int | None = None,
                 settings: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None,
                 slurm: SlurmClient | None = None, config_path: str | None = None) -> None:
        self.env = dict(os.environ if env is None else env)
        job = JobEnv.from_env(self.env)
        self.srun = _check_command(command, nprocs, job.job_id)
        if config_path:  # `rslurm --config FILE launch`: the ranks and the daemon read the same file
            self.env["RSLURM_CONFIG"] = os.path.abspath(config_path)
        # Every setting, including those only the ranks and the daemon read: a bad value fails here,
        # before any rank starts.
        self.cfg = config.load(settings, self.env, config_path=config_path)
        self.command = list(command)
        self.job_id: str | None = job.job_id
        self.nprocs = nprocs
        self.node = node_name(self.cfg.node_name)
        self.run_id: str = self.cfg.run_id or default_run_id(self.env)
        root = expand_local_dir(self.cfg.local_dir or default_local_dir(), self.node)
        self.run_dir = RunDir(root, self.run_id).path
        self.restart_count = job.restart_count
        self.events = EventLog(root, self.run_id, source="launcher", node=self.node, keep_open=False,
                               job_id=self.job_id, restart_count=self.restart_count)
        self.policy = RequeuePolicy(max_restarts=self.cfg.max_restarts,
                                    no_progress_limit=self.cfg.no_progress_limit or None)
        self._slurm = slurm
        sock_name = self.job_id or f"local-{os.getpid()}"
        self.socket_path = default_socket_path(sock_name, self.node, runtime_dir=self.cfg.control_dir,
                                               env=self.env)
        self.timings: dict[str, float] = {}
        self.stopping = StopControl(self)
        self.in_job = InJobRestarts(self, self.stopping)
        self.gate = HealthGate(self)
        self.emergency_seen = False
        self.unhealthy: list[NodeHealth] = []  # nodes the last health check found bad and could not exclude
        self.restored: int | None = None  # the step the incarnation restored (its baseline), once it ran
        self.recorded_end: RecordedEnd | None = None  # a job Slurm is ending: its end, recorded early
        self.failures = ObservedFailures(self.run_dir, self.run_id)  # for the default cadence
        self._runs = 0  # runs of the ranks started by this launcher (each srun step gets its own marker)
        self._new_run_of_ranks()
        self.drain: JobDrain | None = None
        if self.cfg.durable:
            self.drain = JobDrain(self.cfg, self.env, root=root, run_id=self.run_id,
                                  slurm_nodes=self.num_nodes() if self.srun else None,
                                  enabled=self.cfg.daemon == "auto")

    def _new_run_of_ranks(self) -> None:
        """Forget what the launcher saw of the last run of the ranks (before each start)."""
        self.hang_watch = HangWatch(self.socket_path, timeout=self.cfg.hang_timeout,
                                    startup_timeout=self.cfg.hang_startup_timeout)
        self.hang: Hang | None = None
        self.hang_cause: HangCause | None = None  # the hang verdict read with the ranks' output at that moment
        self.startup: StartupWatch | None = None  # the start-up bound of the current srun step of ranks
        self.startup_failure: StartupFailure | None = None
        self.ranks_seen = False  # a rank of this node registered or wrote a heartbeat in this run of the ranks
        self._ranks_seen_check = 0.0
        self.oom = OomCounters()
        self.root_failures: list[RankExit] = []  # the ranks found failed first, in this run of the ranks

    # ------------------------------------------------------------------ what the parts read (LaunchContext)
    @property
    def slurm(self) -> SlurmClient:
        """The Slurm client (built on first use)."""
        if self._slurm is None:
            self._slurm = slurm_client(self.cfg.slurm_backend)
        return self._slurm

    def event(self, kind: Event, **fields: Any) -> None:
        self.events.emit(kind, **fields)

    def job_info(self) -> JobInfo | None:
        if not self.job_id:
            return None
        try:
            return self.slurm.job_info(self.job_id)
        except SlurmError as exc:
            log.warning("cannot read job %s from Slurm (%s); going on without its end time", self.job_id, exc)
            return None

    def num_nodes(self) -> int:
        """Nodes of the job: the drain daemon's job step runs one task on each."""
        return job_num_nodes(self.env)

    def multi_node(self) -> bool:
        """True when ranks may run on other nodes (save requests then go through Slurm)."""
        return job_num_nodes(self.env) > 1

    def _rank_env(self) -> dict[str, str]:
        env = dict(self.env)
        if env.get("RSLURM_CONTROL_SOCKET", "").strip().lower() != "off":  # off: signals only (tests, policy)
            env["RSLURM_CONTROL_SOCKET"] = self.socket_path
            slurm_node = JobEnv.from_env(self.env).node_name
            if self.srun and slurm_node:  # the socket is this node's: tasks on other nodes use signals
                env[CONTROL_NODE_ENV] = slurm_node
        env["RSLURM_RUN_ID"] = self.run_id  # ranks and launcher must name the same run
        env["RSLURM_SAVE_SIGNAL"] = self.cfg.save_signal
        if self.cfg.failure_interval is None:  # the default cadence plans for what this run has seen
            m = self.failures.interval(started_at=self.timings.get("start"), in_job=self.in_job.runs)
            if m is not None:
                env["RSLURM_FAILURE_INTERVAL"] = f"{m:.0f}"
        return env

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
        self.event(Event.START, command=self.command, baseline_step=baseline, socket=self.socket_path)
        warn_if_not_exec(self.job_id)
        trap = SignalTrap().install()
        server = ControlServer(self.socket_path)
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
            self.restored = baseline  # what the incarnation restored: its progress is measured from there
            children: Children | None = None
            while True:
                self._new_run_of_ranks()  # a stop during the check ends it unjudged, and no rank starts:
                self.unhealthy = self.gate.check(self._rank_env, trap.pending, lambda: trap.notify("slurm"))
                if self.unhealthy or self.stopping.before_start(trap, server, baseline):
                    children = None  # no spare node (a node failure: requeued), or the stop is the outcome
                    break
                children = self._start_ranks(server)
                self._loop(trap, children, server)
                children.finish()
                outcome = classify_outcome(self, children, baseline)
                on_event = partial(self.stopping.on_event, children=children, server=server)
                if not self.in_job.restart(outcome, baseline, trap, on_event):
                    break
                baseline = outcome.committed_step
            self._record_if_ending(children)  # a stop during an in-job restart's backoff
            baseline = self.restored
        finally:
            if watcher is not None:
                watcher.stop()
            status = server.status() if server.running else None
            server.stop()
        if status and (status.get("last_committed") or {}).get("reason") == "emergency":
            self.emergency_seen = True
        outcome = classify_outcome(self, children, baseline)
        try:
            stop = self.stopping.stop
            await_durable(self, self.drain, outcome, signal_at=stop.at if stop else None,
                          deadline=stop.deadline if stop else None)
            return act_on_outcome(self, outcome)
        finally:
            if self.drain is not None:
                self.drain.stop()
            trap.restore()

    def _record_if_ending(self, children: Children | None) -> None:
        """Once, when Slurm is ending the job (:attr:`~.stopping.StopRequest.ending`): decide and record the
        incarnation's end now (:func:`~.requeue.record_ending`), as :meth:`run` would at the end, since
        Slurm's SIGKILL may come before the ranks have exited."""
        stop = self.stopping.stop
        if stop is None or stop.ending is None or self.recorded_end is not None or not self.job_id:
            return
        self.recorded_end = record_ending(self, stop, classify_outcome(self, children, self.restored))

    def _start_ranks(self, server: ControlServer) -> Children:
        """Start one run of the ranks (a new srun step, or new local processes), having told ``server`` their
        world size where it is known (``-n N``: a ``hello`` outside it is refused, ControlState.expect_ranks)."""
        clear_heartbeats(self.socket_path)  # records of ranks killed in an earlier run would look hung
        env = self._rank_env()
        self._runs += 1
        if self.srun:
            marker = f"{os.getpid()}.{self._runs}"
            env[RANKS_MARKER_VAR] = marker
            addrs = rendezvous_addresses(self, env, self.gate.excluded)
            bound = startup_bound(self.cfg.startup_timeout, self.num_nodes())
            self.startup = StartupWatch(bound, marker=marker, node=self.node, started_at=time.time(),
                                        user_addr=JobEnv.from_env(self.env, warn=False).master_addr,
                                        expected=addrs or {})
            children: Children = SrunStep(self.command, env, addrs)
        elif self.nprocs is not None:
            children = LocalRanks(self.command, self.nprocs, env, free_port(JOB_PORTS))
        else:  # one process that may start its own ranks (torchrun): their world size is its own
            children = LocalRanks(self.command, 1, env, 0, dist_env=False)
        server.state.expect_ranks(None if self.srun else self.nprocs)
        try:
            children.start()
        except OSError as exc:
            children.teardown(0)  # ranks started before the one that failed
            raise ConfigError(f"rslurm launch: cannot start {self.command[0]!r}: {exc.strerror or exc}") from exc
        self.oom.watch(children.pids)
        return children

    def _ranks_started(self, server: ControlServer) -> bool:
        """A rank of this node registered on the control socket or wrote a heartbeat (it built its
        Checkpointer, which comes after the rendezvous), in this run of the ranks."""
        if not self.ranks_seen:
            self.ranks_seen = bool(server.status()["ranks"]) or bool(read_heartbeats(self.socket_path))
        return self.ranks_seen

    def _on_startup_timeout(self, children: Children) -> None:
        """The start-up bound passed with no rank of this node started: judge it (:func:`~.startup.judge_start`;
        a failed start ends the run of the ranks)."""
        assert self.startup is not None
        self.startup_failure = judge_start(self, self.startup, children)

    def _loop(self, trap: SignalTrap, children: Children, server: ControlServer) -> None:
        lingering = Lingering()
        committed_at: float | None = None
        while not children.poll():
            if trap.wait(0.05):
                for ev in trap.pop():
                    self.stopping.on_event(ev, children, server)
            now = time.time()
            if self.stopping.interrupts >= 2:
                log.warning("second interrupt: tearing the ranks down now")
                children.teardown(0)
                break
            stop = self.stopping.stop
            self.stopping.send_deferred_signal(server, now)
            if stop is not None and committed_at is None and server.state.save_request is None:
                committed_at = now
                self.timings["committed"] = now
                self.emergency_seen = True
                self.stopping.committed((server.status().get("last_committed") or {}).get("step"), now)
            if committed_at is not None:
                self._record_if_ending(children)  # before waiting for the ranks to exit
            if stop is not None and now >= stop.deadline:
                log.error("ranks missed the deadline (%s + %.1f s): tearing their process trees down",
                          stop.source, stop.deadline - stop.at)
                self.event(Event.DEADLINE_MISSED, committed=committed_at is not None)
                self._record_if_ending(children)  # before the teardown
                teardown(self, children, grace=0)
                break
            if committed_at is not None and now >= committed_at + self.cfg.term_grace:
                log.warning("ranks did not exit within %.0f s of the committed emergency checkpoint; tearing "
                            "them down", self.cfg.term_grace)
                teardown(self, children, grace=min(2.0, max(0.0, stop.deadline - now)) if stop else 2.0)
                break
            if stop is None and lingering.since is None and (hang := self.hang_watch.check(now)) is not None:
                self.hang, self.hang_cause = respond_to_hang(self, self.hang_watch, hang, children)
                break
            if not self.ranks_seen and now >= self._ranks_seen_check:
                self._ranks_seen_check = now + 1.0
                self._ranks_started(server)
            if (stop is None and lingering.since is None and self.startup is not None
                    and self.startup.due(now, lambda: self._ranks_started(server))):
                self._on_startup_timeout(children)
                if self.startup_failure is not None:
                    break
            if lingering.since is None and children.failures():
                self.root_failures = lingering.begin(children, now, self.stopping.sent_to_ranks)
            if lingering.since is not None and (why := lingering.over(children, now)):
                log.error("%s: tearing them down", why)
                teardown(self, children, grace=self.cfg.term_grace)
                break
        self._record_if_ending(children)  # the ranks left before the launcher saw a commit
        self.stopping.withhold_deferred_signal("ranks_exited")
        self.timings["ranks_exited"] = time.time()
        # A last reading: a killed rank's record stays, so its last step is exact (rslurm report's recomputed steps).
        self.hang_watch.observe(read_heartbeats(self.socket_path))
        furthest = self.hang_watch.furthest
        self.event(Event.RANKS_EXITED, torn_down=children.torn_down, last_step=furthest[0] if furthest else None,
                   last_step_t=furthest[1] if furthest else None)


def job_num_nodes(env: Mapping[str, str]) -> int:
    """Nodes of the Slurm job, for :meth:`Launcher.num_nodes` and :meth:`Launcher.multi_node`:
    ``SLURM_JOB_NUM_NODES``, else ``SLURM_NNODES``, else the hosts in ``SLURM_JOB_NODELIST``, else 1.
    A malformed variable (not an integer >= 1) is logged as a warning that names it and skipped, so
    both callers go on with the next source: one node count, never two different guesses
    (:meth:`JobEnv.node_count <resilient_slurm.jobenv.JobEnv.node_count>`)."""
    return JobEnv.from_env(env).node_count(expand_hostlist)


__all__ = ["HISTORY_FILE", "HOLD_EXIT_CODE", "LaunchResult", "Launcher", "StopRequest", "job_num_nodes",
           "newest_committed"]
