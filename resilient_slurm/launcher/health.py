"""Node health: checks run on every node before each launch of the ranks, and excluding a bad node.

Who calls what, and when:

* ``rslurm health [--json]`` runs :func:`check_node` on the node it runs on and prints the result (a JSON
  line with ``--json``); exit 0 healthy, 1 not. It is what the launcher runs on every node.
* The launcher, before it starts the ranks (the first time and before each in-job restart), calls
  :func:`check_allocation`: inside Slurm one job step with a task per node of the allocation
  (``srun --overlap``, named ``rslurm-health``, bounded by ``health_timeout``); locally
  :func:`check_node` in-process. A node that answers unhealthy, or not at all, is unhealthy.
* The launcher does both through :class:`HealthGate`, whose :meth:`HealthGate.check` runs the checks and,
  with unhealthy nodes, calls :func:`exclude` on the srun command when the allocation
  still has the nodes the command asks for (``srun -N``): the ranks start without them. Otherwise the
  incarnation ends as ``node_failure`` and, after the requeue call, :func:`~resilient_slurm.slurm.
  SlurmClient.exclude_nodes` adds them to the job's excluded nodes, so the requeued job runs elsewhere.

A stop request during the check (the launcher's trap, polled by :func:`run_check` every
``CHECK_POLL_S``) ends the check at once, with every process it started, and its result is not used: the
nodes were not judged, and the launcher acts on the stop as it would have without a check. A check that
found nodes bad when a stop request is pending blames no node either: Ctrl-C reaches the launcher's
whole process group, the check's command included, which then dies of it. Under Slurm, a check that
found nodes bad while Slurm was preempting or ending the job (its steps got Slurm's SIGTERM; the
launcher, without ``--signal``, none) blames no node: the gate hands the launcher a stop whose source is
``slurm`` instead (:meth:`HealthGate.check`). The check stays in the launcher's process group and
session, so that whatever ends the launcher's group (a terminal's hangup, ``kill -9 -PGID``) ends it
too; the processes it started and left behind (one that left its group, ``timeout`` or ``setsid``, or
was orphaned: :class:`_Tree`) are ended when it ends, and only the last ``CHECK_OUTPUT_CAP`` bytes of each
of its streams are kept, decoded leniently.

Built-in checks (``health_check=on``, the default): the run's local directory can be created and written
(a file written, fsynced, removed), its filesystem has room for the newest committed step of the run on
this node (one more save of that size must fit), and on a node with NVIDIA devices ``nvidia-smi -L``
succeeds and lists at least one GPU. ``health_check_command``: a shell command run on every node too;
a non-zero exit (or no exit within ``health_timeout``) marks the node unhealthy, and its last output line
is the evidence.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import psutil

from ..config import Settings
from ..layout import list_run_dir
from ..manifest import MANIFEST_NAME, read_manifest_file
from ..paths import default_local_dir, expand_local_dir, node_name
from ..rundir import RunDir
from ..slurm.client import per_node_step
from ..telemetry import Event
from ..terminal import printable
from .context import LaunchContext, launch_log
from .processes import StreamTail
from .rank_env import allocation_nodes, srun_options
from .stopping import ending

log = logging.getLogger(__name__)

HEALTH_STEP_NAME = "rslurm-health"  # the check's srun step: the teardown and `steps()` readers skip it
CHECK_POLL_S = 0.1  # how often a running check looks for a stop request (and for the processes it started)
CHECK_TERM_GRACE_S = 2.0  # SIGTERM to the check's processes, then SIGKILL (srun ends its step on SIGTERM)
CHECK_OUTPUT_CAP = 1 << 24  # bytes kept of each of the check's streams, the last ones: answers and evidence
_PIPE_WAIT_S = 0.5  # for output still in the pipes once the check's processes are gone
CHECK_MARK_VAR = "RSLURM_HEALTH_CHECK_MARK"  # in the check's environment: what it started is found by it


class CheckInterrupted(Exception):
    """A stop request came while the check ran: the check was ended and says nothing about the nodes."""


def _never() -> bool:
    return False


class _Tree:
    """The check's process and every process it started: its descendants as seen every ``CHECK_POLL_S``
    (one that left the check's process group or session, `timeout` or `setsid`, included) and, when it
    ends, every process of this node that inherited the check's mark (``CHECK_MARK_VAR`` in its
    environment: one orphaned before a poll saw it). All of them are ended with it."""

    def __init__(self, pid: int, mark: str) -> None:
        self.mark = mark
        self.seen: dict[int, psutil.Process] = {}
        try:
            self.root: psutil.Process | None = psutil.Process(pid)
        except psutil.Error:
            self.root = None
        self.observe()

    def _marked(self) -> None:
        me = os.getpid()
        for p in psutil.process_iter():
            if p.pid == me or p.pid in self.seen:
                continue
            with contextlib.suppress(psutil.Error, OSError):
                if p.environ().get(CHECK_MARK_VAR) == self.mark:
                    self.seen[p.pid] = p

    def observe(self) -> None:
        if self.root is None:
            return
        try:
            for child in self.root.children(recursive=True):
                self.seen.setdefault(child.pid, child)
        except psutil.Error:
            pass

    def _alive(self) -> list[psutil.Process]:
        out = []
        for p in (self.root, *self.seen.values()):
            with contextlib.suppress(psutil.Error):
                if p is not None and p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
        return out

    def end(self, grace: float) -> None:
        """SIGTERM to every process of the check, SIGKILL to those left after ``grace`` seconds. The SIGKILL
        comes whatever interrupts the wait (a second Ctrl-C in ``rslurm health``)."""
        self.observe()
        self._marked()
        try:
            alive = self._alive()
            for p in alive:
                with contextlib.suppress(psutil.Error):
                    p.send_signal(signal.SIGTERM)
            end = time.monotonic() + grace
            while time.monotonic() < end and self._alive():  # a zombie is gone (psutil.wait_procs waits for it)
                time.sleep(0.02)
        except psutil.Error:
            pass
        finally:
            self.observe()
            self._marked()  # what the SIGTERM made them start, orphaned at once
            for p in self._alive():
                with contextlib.suppress(psutil.Error):
                    p.kill()


def run_check(cmd: Sequence[str], env: Mapping[str, str], timeout: float,
              stop_requested: Callable[[], bool] = _never, *,
              cap: int = CHECK_OUTPUT_CAP) -> tuple[int | None, str, str]:
    """Run a check's command: ``(returncode, stdout, stderr)``, each stream's last ``cap`` bytes decoded
    leniently. returncode None when it did not exit within ``timeout``: it is ended then, with every process it
    started (:class:`_Tree`); so are the processes it left behind when it exits. Raises
    :class:`CheckInterrupted` (after ending them) as soon as ``stop_requested()`` is true; OSError when it
    cannot start."""
    mark = uuid.uuid4().hex
    proc = subprocess.Popen(list(cmd), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**env, CHECK_MARK_VAR: mark})
    tree: _Tree | None = None
    ended = False
    try:  # from here on, a SIGTERM (`rslurm health` ended by Slurm) ends the command and what it started
        assert proc.stdout is not None and proc.stderr is not None
        out = StreamTail(proc.stdout, cap=cap, name="rslurm-health-stdout")
        err = StreamTail(proc.stderr, cap=cap, name="rslurm-health-stderr")
        out.start()
        err.start()
        tree = _Tree(proc.pid, mark)
        deadline = time.monotonic() + timeout
        while True:
            try:
                code: int | None = proc.wait(max(0.0, min(CHECK_POLL_S, deadline - time.monotonic())))
                break
            except subprocess.TimeoutExpired:
                pass
            tree.observe()
            if stop_requested():
                tree.end(CHECK_TERM_GRACE_S)
                ended = True
                raise CheckInterrupted()
            if time.monotonic() >= deadline:
                code = None
                break
        tree.end(CHECK_TERM_GRACE_S if code is None else 0.0)  # the command, or what it left running
        ended = True
        return code, out.text(_PIPE_WAIT_S), err.text(_PIPE_WAIT_S)
    except BaseException:  # Ctrl-C or SIGTERM (cli_main) in `rslurm health`, or the stop above
        if not ended:
            (tree or _Tree(proc.pid, mark)).end(CHECK_TERM_GRACE_S)
        raise
    finally:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(CHECK_TERM_GRACE_S)  # reaped: it got SIGKILL at the latest


@dataclass(frozen=True)
class NodeHealth:
    """One node's answer: ``problems`` empty when healthy."""

    node: str
    problems: tuple[str, ...] = ()
    checked: tuple[str, ...] = field(default=())

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> str:
        return json.dumps({"node": self.node, "ok": self.ok, "problems": list(self.problems),
                           "checked": list(self.checked)})

    @classmethod
    def from_json(cls, line: str) -> NodeHealth | None:
        try:
            d = json.loads(line)
        except ValueError:
            return None
        if not isinstance(d, dict) or not isinstance(d.get("node"), str) or not isinstance(d.get("problems"), list):
            return None
        return cls(d["node"], tuple(str(p) for p in d["problems"]), tuple(str(c) for c in d.get("checked") or []))


def _newest_step_bytes(run_dir: str) -> int:
    """Bytes of this node's copy of the newest committed step of the run (0: none)."""
    try:
        committed = list_run_dir(run_dir).committed
    except OSError:
        return 0
    for step in reversed(committed):
        d = RunDir.at(run_dir).step(step)
        try:
            read_manifest_file(os.path.join(d, MANIFEST_NAME))
            total = 0
            for root, _dirs, files in os.walk(d):
                for name in files:
                    total += os.lstat(os.path.join(root, name)).st_size
            return total
        except Exception:  # a step being deleted, or invalid: the next older one
            continue
    return 0


def _gpu_problem(timeout: float) -> str | None:
    """None when there are no NVIDIA devices here, or nvidia-smi lists at least one GPU."""
    smi = shutil.which("nvidia-smi")
    if smi is None and not os.path.exists("/dev/nvidia0"):
        return None
    if smi is None:
        return "/dev/nvidia0 exists but nvidia-smi is not on PATH: cannot check the GPUs"
    try:
        r = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"nvidia-smi -L did not answer within {timeout:.0f} s"
    except OSError as exc:
        return f"nvidia-smi -L: {exc}"
    gpus = [line for line in r.stdout.splitlines() if line.startswith("GPU ")]
    if r.returncode != 0:
        last = (r.stderr or r.stdout).strip().splitlines()[-1:] or [""]
        return f"nvidia-smi -L failed (exit {r.returncode}): {last[0]}"
    if not gpus:
        return "nvidia-smi -L lists no GPU"
    return None


def _command_problem(command: str, env: Mapping[str, str], timeout: float,
                     stop_requested: Callable[[], bool]) -> str | None:
    try:
        code, out, err = run_check(["/bin/sh", "-c", command], env, timeout, stop_requested)
    except OSError as exc:
        return f"health_check_command cannot run: {exc}"
    if code is None:
        return f"health_check_command did not exit within {timeout:g} s: {command}"
    if code == 0:
        return None
    last = (out + err).strip().splitlines()[-1:] or ["(no output)"]
    how = f"was killed by {_signal_name(-code)}" if code < 0 else f"exited {code}"
    return f"health_check_command {how}: {last[0][:300]}"


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def check_node(cfg: Settings, env: Mapping[str, str] | None = None, *, run_id: str | None = None,
               stop_requested: Callable[[], bool] = _never) -> NodeHealth:
    """The built-in checks and the user's command on this node. Raises :class:`CheckInterrupted` when
    ``stop_requested()`` turns true while the command runs."""
    env = dict(os.environ if env is None else env)
    node = node_name(cfg.node_name)
    problems: list[str] = []
    checked: list[str] = []
    if cfg.health_check == "on":
        root = expand_local_dir(cfg.local_dir or default_local_dir(), node)
        run_dir = RunDir(root, run_id or cfg.run_id or "").path
        checked.append("local_dir")
        probe = os.path.join(root, f".health-{uuid.uuid4().hex}")
        try:
            os.makedirs(root, mode=0o700, exist_ok=True)
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            try:
                os.write(fd, b"rslurm health check\n")
                os.fsync(fd)
            finally:
                os.close(fd)
                os.unlink(probe)
        except OSError as exc:
            problems.append(f"local directory {root} is not writable: {exc.strerror or exc}")
        else:
            st = os.statvfs(root)
            free = st.f_bavail * st.f_frsize
            need = _newest_step_bytes(run_dir) if run_id or cfg.run_id else 0
            if free <= 0 or free < need:
                problems.append(f"local directory {root} has {free / 2**30:.2f} GiB free, less than the newest "
                                f"checkpoint of the run ({need / 2**30:.2f} GiB): the next save would not fit")
        checked.append("gpus")
        gpu = _gpu_problem(min(cfg.health_timeout, 60.0))
        if gpu:
            problems.append(gpu)
    if cfg.health_check_command:
        checked.append("command")
        p = _command_problem(cfg.health_check_command, env, cfg.health_timeout, stop_requested)
        if p:
            problems.append(p)
    return NodeHealth(node, tuple(problems), tuple(checked))


def health_step_command(nodes: int, exclude: Sequence[str]) -> list[str]:
    """The srun step that runs ``rslurm health --json`` once on each of ``nodes`` nodes of the allocation."""
    return per_node_step(nodes, HEALTH_STEP_NAME, sys.executable, "-m", "resilient_slurm.cli", "health", "--json",
                         exclude=exclude)


def check_allocation(cfg: Settings, env: Mapping[str, str], *, nodes: Sequence[str] | None, run_id: str,
                     exclude: Sequence[str] = (), stop_requested: Callable[[], bool] = _never) -> list[NodeHealth]:
    """Every node's health: ``nodes`` (the allocation's hosts, Slurm) through one srun step, or this node
    (``nodes`` None). A node that gives no answer within ``health_timeout`` is unhealthy. Raises
    :class:`CheckInterrupted` when ``stop_requested()`` turns true while the check runs."""
    if cfg.health_check == "off" and not cfg.health_check_command:
        return []
    if nodes is None:
        return [check_node(cfg, env, run_id=run_id, stop_requested=stop_requested)]
    want = [n for n in nodes if n not in exclude]
    if not want:
        return []
    cmd = health_step_command(len(want), exclude)
    step_env = {**env, "RSLURM_RUN_ID": run_id}
    for name in ("RSLURM_CONTROL_SOCKET", "RSLURM_NODE_NAME"):
        step_env.pop(name, None)  # each task names its own node (SLURMD_NODENAME)
    t0 = time.time()
    try:
        code, out, err = run_check(cmd, step_env, cfg.health_timeout + 30, stop_requested)
        if code is None:
            err = f"the health check step did not end within {cfg.health_timeout + 30:.0f} s"
    except OSError as exc:
        log.warning("cannot run the node health check step (%s): %s; going on without it", cmd[0], exc)
        return []
    answers = {h.node: h for line in out.splitlines() if (h := NodeHealth.from_json(line.strip())) is not None}
    result = []
    for n in want:
        if n in answers:
            result.append(answers[n])
        else:
            why = (err.strip().splitlines() or ["no answer"])[-1][:300]
            result.append(NodeHealth(n, (f"no answer from the node health check within {time.time() - t0:.0f} s "
                                         f"({why})",)))
    return result


def requested_nodes(command: Sequence[str]) -> int | None:
    """The node count an srun command asks for (``-N 2``, ``-N2``, ``--nodes=2``, ``--nodes 2``; the
    minimum of a range ``2-4``), or None when it does not say (srun then uses every node of the
    allocation, SLURM_NNODES)."""
    found = None
    for name, value, _, _ in srun_options(command)[0]:
        if name in ("-N", "--nodes") and value is not None:
            try:
                found = int(value.split("-", 1)[0])
            except ValueError:
                return None
    return found


def exclude(command: Sequence[str], nodes: Sequence[str]) -> list[str]:
    """The srun ``command`` with ``--exclude=<nodes>`` added right after ``srun``; a user's own
    ``--exclude`` / ``-x`` among srun's options is merged into it."""
    opts, program = srun_options(command)
    names: list[str] = []
    drop: set[int] = set()
    for name, value, first, last in opts:
        if name in ("-x", "--exclude") and value is not None:
            names += value.split(",")
            drop |= set(range(first, last + 1))
    names += list(nodes)
    kept = [a for i, a in enumerate(command[1:program], start=1) if i not in drop]
    merged = ",".join(dict.fromkeys(n for n in names if n))
    return [command[0], f"--exclude={merged}", *kept, *command[program:]]


def cli_main(cfg: Settings, *, as_json: bool) -> int:
    """``rslurm health``: this node's checks; exit 0 healthy, 1 not. A SIGTERM (Slurm's, to the check's
    step at a preemption) ends the check's command with its session before this process exits."""
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        h = check_node(cfg)
    except KeyboardInterrupt:  # the command was ended with its processes (run_check)
        return 128 + signal.SIGINT
    if as_json:
        print(h.to_json(), flush=True)
    else:
        print(printable(f"{h.node}: {'healthy' if h.ok else 'UNHEALTHY'} (checked: {', '.join(h.checked) or 'nothing'})"))
        for p in h.problems:
            print(f"  {printable(p)}")  # a health command's output line
    return 0 if h.ok else 1


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def summary(bad: Sequence[NodeHealth]) -> str:
    """``n2: local directory ... is not writable; n3: no answer ...``"""
    return "; ".join(f"{h.node}: {', '.join(h.problems)}" for h in bad)


class HealthGate:
    """The check before each start of the ranks, and the nodes it took out of the srun command."""

    def __init__(self, ctx: LaunchContext) -> None:
        self.ctx = ctx
        self.user_command = list(ctx.command)
        self.excluded: list[str] = []  # nodes taken out of the srun command (the allocation had spares)

    def check(self, rank_env: Callable[[], Mapping[str, str]], stop_requested: Callable[[], bool] = _never,
              on_slurm_stop: Callable[[], None] | None = None) -> list[NodeHealth]:
        """Check every node before a launch of the ranks. Unhealthy nodes are taken out of the srun command
        (``ctx.command``) when the allocation still has the nodes it asks for (``srun -N``); returns those
        that could not be (then the incarnation ends as a node failure). A check that no node answered is
        logged and ignored: the check itself failed, not the nodes. ``rank_env``: the ranks' environment,
        which the check's step runs with.

        ``stop_requested``: the launcher's pending stop; when it turns true the check is ended and nothing
        is returned (the launcher acts on the stop). ``on_slurm_stop``: called, and nothing returned, when
        the check found bad nodes while Slurm was preempting or ending the job (a step's tasks got Slurm's
        SIGTERM, which the launcher did not hear): the nodes are not to blame."""
        ctx = self.ctx
        nodes = allocation_nodes(ctx) if ctx.srun else None
        if ctx.srun and not nodes:
            return []
        try:
            results = check_allocation(ctx.cfg, rank_env(), nodes=nodes, run_id=ctx.run_id, exclude=self.excluded,
                                       stop_requested=stop_requested)
        except CheckInterrupted:
            launch_log.warning("a stop request came during the node health check: the check was ended, its "
                               "result is not used")
            return []
        bad = [h for h in results if not h.ok]
        if not bad:
            return []
        if stop_requested():
            launch_log.warning("a stop request came as the node health check ended (%s): no node is blamed",
                               summary(bad))
            return []
        job = ctx.job_info() if ctx.job_id else None
        if job is not None and (job.being_preempted or ending(job)):
            launch_log.warning("the node health check ended while Slurm was %s the job (%s): no node is blamed",
                               "preempting" if job.being_preempted else "ending", summary(bad))
            if on_slurm_stop is not None:
                on_slurm_stop()
            return []
        if len(bad) == len(results) and all(h.problems[0].startswith("no answer") for h in bad) and len(results) > 1:
            launch_log.warning("the node health check step failed on every node (%s); going on without it",
                               summary(bad))
            return []
        action = "requeue" if ctx.job_id else "exit"
        if ctx.srun and nodes is not None:
            need = requested_nodes(self.user_command)
            healthy = len(nodes) - len(self.excluded) - len(bad)
            if need is not None and healthy >= need:
                self.excluded += [h.node for h in bad]
                ctx.command = exclude(self.user_command, self.excluded)
                action = "excluded"
        (launch_log.warning if action == "excluded" else launch_log.error)(
            "unhealthy node(s): %s; %s", summary(bad),
            f"starting the ranks without them ({' '.join(ctx.command[:2])})" if action == "excluded"
            else "the allocation has no spare node for them")
        ctx.event(Event.NODE_UNHEALTHY, nodes=[{"node": h.node, "problems": list(h.problems)} for h in bad],
                  action=action, excluded=list(self.excluded))
        return [] if action == "excluded" else bad


__all__ = ["CHECK_POLL_S", "HEALTH_STEP_NAME", "CheckInterrupted", "HealthGate", "NodeHealth", "check_allocation",
           "check_node", "cli_main", "exclude", "health_step_command", "requested_nodes", "run_check", "summary"]

