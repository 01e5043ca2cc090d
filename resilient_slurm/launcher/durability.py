"""The launcher's side of the durable tier: run a drain daemon for the job when no service does, and
wait (bounded) for a step to become durable before the job is requeued or ends.

Who calls what: the :class:`~.launch.Launcher` builds one :class:`JobDrain` when a durable tier is set,
calls :meth:`JobDrain.start` before starting the ranks, :func:`await_durable` (which calls
:meth:`JobDrain.wait_durable` with the time left before the job's deadline) once the ranks are gone, and
:meth:`JobDrain.stop` last.

* Inside a Slurm allocation the daemon runs as one job step with a task per node
  (``srun --overlap --ntasks-per-node=1``; ``--overlap`` so it never takes CPUs the ranks' step
  needs). On a node where a daemon service already holds the lock, that task exits at once.
* Locally it is one ``rslurm daemon --job-step`` process, unless a daemon already runs there.
* A daemon service (systemd) outlives the job and keeps draining after it; a job-step daemon dies with
  the job, and whatever it did not drain is drained by the next incarnation's daemon or a service.
* A job-step daemon ignores SIGTERM: on preemption Slurm sends it to every step, and the daemon must
  go on draining the emergency checkpoint the ranks are writing. :meth:`JobDrain.stop` ends it with
  SIGINT (twice for srun, which then forwards it to the tasks and ends the step).
"""

from __future__ import annotations

import logging
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping

from ..config import Settings
from ..daemon.service import daemon_running, read_status
from ..errors import ConfigError, ResilientSlurmError, TransientStorageError
from ..manifest import MANIFEST_NAME, durable_run_key, durable_step_key, read_manifest_file
from ..rundir import RunDir
from ..slurm.client import per_node_step, remaining_seconds
from ..storage.registry import open_durable, parse_url
from ..storage.tier import StorageTier
from ..telemetry import Event
from .context import LaunchContext, launch_log
from .policy import Outcome, Reason
from .processes import die_with_parent_by_sigint

log = logging.getLogger(__name__)

DAEMON_STEP_NAME = "rslurm-daemon"  # the drain daemon's srun step: the launcher's teardown spares it

POLL_S = 0.2
# Ends after which waiting for the newest step to become durable is not worth it (the ranks failed: that
# step, if any, was an interval save the daemon drains anyway).
NO_DURABLE_WAIT = frozenset({Reason.USER_ERROR, Reason.NODE_FAILURE, Reason.HANG, Reason.STORAGE_UNAVAILABLE,
                             Reason.KILLED_BY_SIGNAL, Reason.OUT_OF_MEMORY, Reason.COMMUNICATOR_ERROR,
                             Reason.STARTUP})


class JobDrain:
    """A job's drain daemon and durability checks (see the module docstring)."""

    def __init__(self, cfg: Settings, env: Mapping[str, str], *, root: str, run_id: str,
                 slurm_nodes: int | None, enabled: bool) -> None:
        self.cfg = cfg
        self.env = dict(env)
        self.root = root
        self.run_id = run_id
        self.slurm_nodes = slurm_nodes  # None: local mode
        self.enabled = enabled
        self.proc: subprocess.Popen[bytes] | None = None
        self._tier: StorageTier | None = None
        if parse_url(cfg.durable or "")[0] == "file":
            # A path the tier cannot be made at is a setting to fix, found before any rank starts (each rank
            # would fail on it, as if the program were wrong). An object store is left to the daemon's retries.
            try:
                self._tier = open_durable(cfg, upload_cap=False)
            except TransientStorageError as exc:
                log.warning("durable tier %s: %s; the daemon retries", cfg.durable, exc)
            except ResilientSlurmError as exc:
                raise ConfigError(f"{exc}; no rank was started") from None

    @property
    def tier(self) -> StorageTier | None:
        """The durable tier (opened on first use; None when it cannot be opened)."""
        if self._tier is None:
            try:
                self._tier = open_durable(self.cfg, upload_cap=False)
            except ResilientSlurmError as exc:
                log.error("%s", exc if str(self.cfg.durable) in str(exc) else f"durable tier {self.cfg.durable}: {exc}")
        return self._tier

    def start(self) -> None:
        """Start the job's daemon (job step or local process) unless a service already drains."""
        if not self.enabled:
            return
        daemon = [sys.executable, "-m", "resilient_slurm.cli", "daemon", "--job-step", "--run-id", self.run_id]
        env = {**self.env, "RSLURM_RUN_ID": self.run_id}
        env.pop("RSLURM_CONTROL_SOCKET", None)
        if self.slurm_nodes is None:
            if daemon_running(self.root):
                log.info("a rslurm daemon already drains %s; not starting one for this run", self.root)
                return
            cmd = daemon
        else:
            cmd = per_node_step(self.slurm_nodes, DAEMON_STEP_NAME, *daemon)
        try:
            self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, start_new_session=True,
                                         preexec_fn=die_with_parent_by_sigint)
        except OSError as exc:
            log.error("cannot start the drain daemon (%s): %s; committed steps stay on the local tier until a "
                      "daemon drains them", " ".join(cmd[:2]), exc)
            return
        log.info("drain daemon started for run %s (%s, pid %d)", self.run_id,
                 "job step" if self.slurm_nodes is not None else "local process", self.proc.pid)

    def is_durable(self, step: int) -> bool:
        """True when ``step`` of this run is committed in the durable tier."""
        tier = self.tier
        if tier is None:
            return False
        try:
            return tier.stat(durable_step_key(self.run_id, step, MANIFEST_NAME)) is not None
        except ResilientSlurmError as exc:
            log.warning("cannot check the durable tier: %s", exc)
            return False

    def wait_durable(self, step: int, timeout: float, *, interrupted: Callable[[], bool] = lambda: False) -> bool:
        """Wait up to ``timeout`` seconds for ``step`` to be durable; True if it is."""
        deadline = time.monotonic() + max(0.0, timeout)
        if self.proc is None and not daemon_running(self.root) and not self.is_durable(step):
            log.warning("no drain daemon runs for %s: step %d stays on the local tier until one does "
                        "(`rslurm daemon`, or --daemon auto)", self.root, step)
            return False
        while True:
            if self.is_durable(step):
                return True
            if time.monotonic() >= deadline or interrupted():
                return False
            gave_up = self.gave_up(step)
            if gave_up is not None:  # a corrupt shard, a link in the tier: waiting longer changes nothing
                log.warning("the drain daemon gave up on step %d: %s", step, gave_up)
                return False
            if self.proc is not None and self.proc.poll() is not None and not daemon_running(self.root):
                log.warning("the drain daemon exited (code %s) before step %d was durable", self.proc.returncode,
                            step)
                return self.is_durable(step)
            time.sleep(POLL_S)

    def gave_up(self, step: int) -> str | None:
        """The error of ``step`` when this node's daemon reports it gave up on it (state ``failed``:
        the data cannot be drained; a step it retries is ``retrying``); None otherwise."""
        status = read_status(self.root)
        try:  # the daemon's record must be of this save of the step, not of one it replaced
            created = read_manifest_file(RunDir(self.root, self.run_id).manifest(step)).created_at
        except (OSError, ResilientSlurmError):
            return None
        for st in (status or {}).get("steps") or []:
            if (isinstance(st, dict) and st.get("run_id") == self.run_id and st.get("step") == step
                    and st.get("state") == "failed" and st.get("created_at") == created):
                return str(st.get("error") or "no error recorded")
        return None

    def write_object(self, name: str, data: bytes) -> None:
        """Keep a small run-level file in the durable tier too (best effort)."""
        tier = self.tier
        if tier is None:
            return
        try:
            tier.put_bytes(durable_run_key(self.run_id, name), data)
        except ResilientSlurmError as exc:
            log.warning("cannot write %s to the durable tier: %s", name, exc)

    def stop(self, grace: float = 5.0) -> None:
        """Stop the job's daemon (it is restart-safe: an interrupted transfer resumes next time)."""
        proc, self.proc = self.proc, None
        if self._tier is not None:
            self._tier.close()
            self._tier = None
        if proc is None or proc.poll() is not None:
            return
        try:
            # SIGINT stops a job-step daemon (SIGTERM, which Slurm sends every step on preemption, does
            # not: the daemon keeps draining the emergency step). srun turns a second SIGINT within a
            # second into "forward to the tasks and end the step".
            os.kill(proc.pid, signal.SIGINT)
            if self.slurm_nodes is not None:
                time.sleep(0.2)
                os.kill(proc.pid, signal.SIGINT)
            proc.wait(timeout=grace)
        except (ProcessLookupError, PermissionError):
            pass
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=10)


def await_durable(ctx: LaunchContext, drain: JobDrain | None, outcome: Outcome, *, signal_at: float | None,
                  deadline: float | None) -> None:
    """Give the newest committed step a bounded chance to become durable before the requeue (or the end of
    a completed job): within the stop's ``deadline`` when the ranks were asked to stop (``signal_at``),
    ``durable_wait`` at most. Logged through the launcher's logger, with a ``durable`` or ``not_durable``
    event."""
    step = outcome.committed_step
    if drain is None or step is None or outcome.reason in NO_DURABLE_WAIT:
        return
    now = time.time()
    timeout = ctx.cfg.durable_wait
    if deadline is not None:
        timeout = min(timeout, deadline - now)
    elif outcome.reason is not Reason.COMPLETED:
        job = ctx.job_info()
        if job is not None and not math.isinf(rem := remaining_seconds(job, now)):
            timeout = min(timeout, rem - ctx.cfg.requeue_margin)
    t0 = time.time()
    ok = timeout > 0 and drain.wait_durable(step, timeout)
    waited = time.time() - t0
    ctx.timings["durable" if ok else "not_durable"] = time.time()
    ctx.event(Event.DURABLE if ok else Event.NOT_DURABLE, step=step, waited_s=waited,
              after_signal_s=(time.time() - signal_at) if signal_at is not None else None)
    if ok:
        launch_log.info("step %d is durable in %s (waited %.2f s)", step, ctx.cfg.durable, waited)
    else:
        launch_log.warning("step %d is not durable yet after %.1f s; going ahead with the local commit (the "
                           "daemon drains it later; a resume on other nodes uses the newest durable step)", step,
                           waited)


__all__ = ["DAEMON_STEP_NAME", "NO_DURABLE_WAIT", "JobDrain", "await_durable"]
