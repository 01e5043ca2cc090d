"""A real, private Slurm cluster on loopback for end-to-end tests.

``SlurmCluster`` runs Debian's Slurm 22.05 (``slurm-wlm``) as a two-node cluster on this one host:
one ``slurmctld``, one ``slurmd`` per node (``slurmd -N n1``, ``slurmd -N n2``, each on its own port),
and a private ``munged``. Everything it writes (slurm.conf, munge key and socket, state, spool, logs,
job scripts) lives in one temp directory, every port is picked free at start, and nothing touches the
system's /etc/slurm, /etc/munge or system services, so it can run next to a real installation.

Install the packages with ``tests/slurm/install.sh`` (root, apt-get). Typical use::

    with SlurmCluster() as c:                       # start() ... stop()
        job = c.sbatch("#!/bin/bash\\nsrun hostname\\n", "-N2", "-n2")
        info = c.wait_state(job, {"COMPLETED"}, timeout=60)

Every subprocess call has a timeout; ``stop()`` cancels jobs, stops the daemons and then kills any
process still carrying this cluster's marker (leftover ``slurmstepd`` and job tasks), so no orphans
survive a test session.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from ports import free_ports

NODES = ("n1", "n2")
REQUIRED_TOOLS = ("slurmctld", "slurmd", "munged", "mungekey", "munge", "unmunge", "sbatch", "srun",
                  "scontrol", "squeue", "sinfo", "scancel")
ROOT_PREFIX = "slurmtest-"  # default root: <tmp>/slurmtest-XXXXXXXX
MARKER_VAR = "RSLURMTEST_CLUSTER"  # set in every daemon's and client's environment: finds our orphans

# Job states as scontrol prints them (JobState=...); a job that reached one of these will not change again
# unless it is requeued.
FINISHED_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
                             "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"})


class SlurmError(RuntimeError):
    """A Slurm command or daemon failed; the message carries the command output and daemon logs."""


def missing_tools() -> list[str]:
    """The Slurm/munge programs that are not installed (empty when the cluster can run)."""
    path = _search_path(os.environ.get("PATH", ""))
    return [t for t in REQUIRED_TOOLS if shutil.which(t, path=path) is None]


def _search_path(path: str) -> str:
    """``path`` plus the sbin directories where Debian puts slurmctld, slurmd and munged (a non-login
    root shell or CI runner may lack them)."""
    parts = [p for p in path.split(os.pathsep) if p]
    return os.pathsep.join(parts + [d for d in ("/usr/sbin", "/sbin", "/usr/bin", "/bin") if d not in parts])


def parse_scontrol_record(line: str) -> dict[str, str]:
    """Parse one ``scontrol show ... -o`` line (``Key=Value Key=Value ...``) into a dict.

    Values may contain spaces (``Command=``, ``Reason=``, ``Comment=``...): a token that does not start
    with ``Key=`` is glued to the previous value.
    """
    out: dict[str, str] = {}
    last = None
    for tok in line.strip().split(" "):
        m = re.match(r"^([A-Za-z][A-Za-z0-9_:/]*)=(.*)$", tok)
        if m:
            last = m.group(1)
            out[last] = m.group(2)
        elif last is not None and tok:
            out[last] += " " + tok
    return out


def _proc_start_time(pid: int) -> str | None:
    """The start time of ``pid`` (clock ticks since boot, /proc/<pid>/stat field 22), None if gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _marker_roots() -> dict[str, list[int]]:
    """Cluster roots named by the marker variable of live processes, with their pids."""
    prefix = f"{MARKER_VAR}=".encode()
    roots: dict[str, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            env = (d / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for item in env:
            if item.startswith(prefix):
                roots.setdefault(item[len(prefix):].decode(errors="replace"), []).append(int(d.name))
                break
    return roots


def _pids_with_env(name: str, value: str, exclude: int | None = None) -> list[int]:
    """Live processes (not zombies, not ``exclude``) whose environment has ``name=value``."""
    needle = f"\0{name}={value}\0".encode()
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == exclude:
            continue
        try:
            if (d / "stat").read_text().split(") ", 1)[1].startswith("Z"):
                continue
            data = (d / "environ").read_bytes()
        except (OSError, IndexError):
            continue
        if needle in b"\0" + data + b"\0":
            pids.append(int(d.name))
    return pids


def reap_stale_clusters() -> list[int]:
    """Kill the processes of test clusters whose owner (the test process that started them) is gone,
    e.g. after a SIGKILLed or timed-out pytest run. Returns the pids killed.

    A cluster root holds ``owner`` = "<pid> <start time>" of the process that started it; a cluster is
    stale when that process no longer exists (the start time guards against pid reuse). Clusters without
    an owner file are left alone."""
    killed = []
    for root, pids in _marker_roots().items():
        try:
            pid_s, start = Path(root, "owner").read_text().split()
        except (OSError, ValueError):
            continue
        if _proc_start_time(int(pid_s)) == start:
            continue  # owner alive: not ours to touch
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
        if Path(root).parent == Path(tempfile.gettempdir()) and Path(root).name.startswith(ROOT_PREFIX):
            shutil.rmtree(root, ignore_errors=True)  # a default root: nobody else will clean it up
    return killed


class SlurmCluster:
    """A private two-node Slurm cluster (``n1``, ``n2`` on 127.0.0.1) with ``low`` and ``high`` partitions.

    Partitions: ``low`` (default, PriorityTier=1, PreemptMode=REQUEUE, GraceTime=``grace_time``),
    ``lowlong`` (the same with GraceTime=``long_grace_time``) and ``high`` (PriorityTier=10) over both nodes;
    a job in ``high`` preempts (requeues) jobs in ``low`` and ``lowlong``.

    ``low``'s short grace is what the launcher's own tests need: its deadlines and what Slurm does at the
    grace's end. ``lowlong`` is for tests whose ranks need more of the grace than that on a loaded 2-core
    runner: the framework integrations, whose ranks after their emergency commit still run the framework's
    teardown and the interpreter's exit before they can record how they ended (Slurm's SIGTERM at the
    end of a 10-s grace killed a rank that had saved and was leaving), and a preemption that comes before
    the ranks have started, which must start, save and be requeued within the grace (real clusters
    grant minutes, not seconds).
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        *,
        cpus_per_node: int = 2,
        grace_time: int = 10,
        long_grace_time: int = 60,
        kill_wait: int = 5,
        cred_expire: int = 5,
        slurmd_timeout: int = 30,
        preempt_send_user_signal: bool = True,
        debug: str = "debug",
    ) -> None:
        # Unix socket paths (munge socket, slurmstepd sockets under the spool dir) must stay below 108
        # bytes, so the default root is a short directory directly under the temp dir.
        self._own_root = root is None
        self.root = Path(root) if root is not None else Path(tempfile.mkdtemp(prefix=ROOT_PREFIX))
        self.cpus_per_node = cpus_per_node
        self.grace_time = grace_time
        self.long_grace_time = long_grace_time
        self.kill_wait = kill_wait
        self.cred_expire = cred_expire
        self.slurmd_timeout = slurmd_timeout
        self.preempt_send_user_signal = preempt_send_user_signal
        self.debug = debug
        self.first_job_id = random.randrange(1000, 10**6)
        self.nodes = NODES
        self.conf_path = self.root / "etc" / "slurm.conf"
        self.log_dir = self.root / "log"
        self.work_dir = self.root / "work"  # cwd of sbatch/srun: default slurm-%j.out files land here
        self.munge_socket = self.root / "munge" / "munge.sock"
        self._pick_ports()
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: list = []
        self.started = False
        self.start_seconds: float | None = None  # wall time of the last start(), for reports
        self.swept_pids: list[int] = []  # processes the last stop() had to kill by marker (orphans)
        self.reaped_pids: list[int] = []  # processes of stale clusters that start() killed

    def _pick_ports(self) -> None:
        self.ctld_port, *node_ports = free_ports(1 + len(NODES))
        self.node_ports = dict(zip(NODES, node_ports))

    # ------------------------------------------------------------------ configuration
    def slurm_conf(self) -> str:
        """The slurm.conf text. Each non-obvious setting says why it is there (facts for Slurm 22.05)."""
        r = self.root
        nodes = "\n".join(
            # One host, two nodes: both resolve to loopback and differ by port; `slurmd -N <name>` picks
            # the line. CPUs is declared, not detected (see config_overrides), so 2 CPUs per node also
            # works on a 1- or 2-core machine.
            f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={p} CPUs={self.cpus_per_node} "
            f"RealMemory=1000 State=UNKNOWN"
            for n, p in self.node_ports.items()
        )
        node_list = ",".join(NODES)
        return f"""\
# Generated by tests/slurm_cluster.py for a private test cluster; see that file for the reasons.
ClusterName=rslurmtest
# slurmctld only starts on a host named here (`hostname -s`); it listens on loopback only.
SlurmctldHost={socket.gethostname().split('.')[0]}(127.0.0.1)
# Non-default, free ports: never clashes with a system slurmctld/slurmd (6817/6818) or a parallel run.
SlurmctldPort={self.ctld_port}
# Everything runs as root: no 'slurm' account, no chown of state dirs.
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# socket=: our private munged, not /run/munge (22.05 syntax: comma-separated key=value list).
# cred_expire=: job-step credential lifetime, which ALSO sets how long a requeued job waits before it may
# start again (the requeued job gets BeginTime = requeue time + cred_expire + 1 s). 22.05 rejects values
# below 5 ("AuthInfo=cred_expire=N invalid" in the log) and silently falls back to the default 120 s,
# so 5 is the minimum that takes effect.
AuthInfo=socket={self.munge_socket},cred_expire={self.cred_expire}
StateSaveLocation={r}/state
# %n: one spool dir per node name, needed when several slurmd run on one host.
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/run/slurmctld.pid
SlurmdPidFile={r}/run/slurmd-%n.pid
SlurmctldLogFile={self.log_dir}/slurmctld.log
SlurmdLogFile={self.log_dir}/slurmd-%n.log
SlurmctldDebug={self.debug}
SlurmdDebug={self.debug}
# An empty SPANK stack: do not load plugins configured for the host's /etc/slurm.
PlugStackConfig={r}/etc/plugstack.conf
# No cgroups (not available in containers/gVisor): processes are tracked through the parent-pid tree and
# tasks are not bound. linuxproc is what makes two slurmd on one host work without cgroup namespaces.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
# Trust the CPUs declared above instead of rejecting nodes whose detected hardware is smaller
# (two 2-CPU nodes on one 2-core host would otherwise be INVALID).
SlurmdParameters=config_overrides
# Schedule CPUs only (no memory accounting), so -N2 -n2 fits and --exclusive takes a whole node.
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
# Fast scheduling on an idle test cluster (measured: submit -> batch script running in 0.2-1.0 s).
# No `defer`: jobs are considered at submit time. sched_interval=1 (default 60) and bf_interval=1
# (default 30): the main loop and backfill re-test the whole queue every second; that is what starts a
# requeued job as soon as its BeginTime has passed, since no event triggers a pass then.
# batch_sched_delay=0 (default 3 s): do not hold batch jobs back to batch them; sched_min_interval=0:
# no throttling between passes.
SchedulerParameters=sched_interval=1,sched_min_interval=0,batch_sched_delay=0,bf_interval=1
{self._preempt_signal_lines()}
# Preemption by partition priority: a job in `high` (PriorityTier=10) preempts jobs in `low`.
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
# Batch jobs are requeueable unless submitted with --no-requeue.
JobRequeue=1
# Job ids as a real cluster's: large, and different from those of another test cluster running at the same
# time. Numbered from 1 on every test cluster, two clusters' jobs would derive the same rendezvous port
# (15000 + job id % 17000) on this one host at the same time.
FirstJobId={self.first_job_id}
# Seconds between SIGTERM and SIGKILL at a time limit or at the end of GraceTime (default 30).
KillWait={self.kill_wait}
# Round-trip timeout for RPCs; small so that a dead peer is noticed quickly, but not so small that a
# loaded 2-core machine times out healthy daemons (default 10).
MessageTimeout=5
# No mail program is installed; the default (/bin/mail) makes slurmctld log "MailProg is invalid".
MailProg=/bin/true
# Keep completed job records only briefly (default 300 s), but long enough for tests to read the final
# state with `scontrol show job` (there is no accounting database to ask afterwards).
MinJobAge=60
# A node that was DOWN (e.g. a killed slurmd in a fault test) returns to service when its slurmd
# registers again, whatever the reason it went down.
ReturnToService=2
# Mark an unresponsive slurmd DOWN after this many seconds (default 300) so node-death tests are short.
SlurmdTimeout={self.slurmd_timeout}
# No limits that would cancel idle srun/salloc or delay job start.
InactiveLimit=0
Waittime=0
{nodes}
PartitionName=low Nodes={node_list} Default=YES PriorityTier=1 PreemptMode=REQUEUE GraceTime={self.grace_time} MaxTime=INFINITE State=UP
PartitionName=lowlong Nodes={node_list} PriorityTier=1 PreemptMode=REQUEUE GraceTime={self.long_grace_time} MaxTime=INFINITE State=UP
PartitionName=high Nodes={node_list} PriorityTier=10 MaxTime=INFINITE State=UP
"""

    def _preempt_signal_lines(self) -> str:
        if not self.preempt_send_user_signal:
            return ("# preempt_send_user_signal off: at preemption the step tasks get SIGCONT+SIGTERM (the batch\n"
                    "# shell nothing until the grace time ends), whatever --signal the job asked for.")
        return """\
# preempt_send_user_signal: a job preempted with GraceTime that was submitted with --signal gets THAT
# signal at the start of the grace time instead of SIGTERM; with --signal=B:USR1@N it goes to the batch
# shell only and the step tasks get nothing until the grace ends (then SIGCONT+SIGTERM, KillWait, SIGKILL
# to tasks and batch shell). A job without --signal still gets SIGCONT+SIGTERM to its step tasks.
# In 22.05 the option is read from SlurmctldParameters ONLY: in SchedulerParameters it is silently
# ignored (unknown SchedulerParameters are not reported), and a PreemptParameters line is rejected.
SlurmctldParameters=preempt_send_user_signal"""

    # ------------------------------------------------------------------ environment
    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """Environment for Slurm commands and the jobs they submit: this cluster's SLURM_CONF, no
        inherited SLURM_* variables (pytest itself may run inside a Slurm job), plus ``extra``."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_",
                                                                          "SALLOC_", "SQUEUE_"))}
        env["SLURM_CONF"] = str(self.conf_path)
        env[MARKER_VAR] = str(self.root)
        env["PATH"] = _search_path(env.get("PATH", ""))
        env.update(extra or {})
        return env

    def run(self, args: Sequence[str], *, timeout: float = 30, check: bool = True,
            input: str | None = None, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client command against this cluster (text output, always with a timeout)."""
        try:
            cp = subprocess.run(list(args), input=input, capture_output=True, text=True, timeout=timeout,
                                env=self.env(env), cwd=self.work_dir)
        except subprocess.TimeoutExpired as e:
            raise SlurmError(f"{' '.join(args)} timed out after {timeout}s\n{self.logs_tail()}") from e
        if check and cp.returncode != 0:
            raise SlurmError(f"{' '.join(args)} exited {cp.returncode}\nstdout: {cp.stdout}\n"
                             f"stderr: {cp.stderr}\n{self.logs_tail()}")
        return cp

    # ------------------------------------------------------------------ lifecycle
    def start(self, timeout: float = 90, attempts: int = 3) -> SlurmCluster:
        """Write the config, start munged, slurmctld and both slurmd, and wait until both nodes are idle.

        Ports are picked free but could be taken by someone else before the daemons bind them; then the
        start is retried with new ports (up to ``attempts`` times). Raises SlurmError with the daemon
        logs when the cluster does not come up within ``timeout`` seconds."""
        missing = missing_tools()
        if missing:
            raise SlurmError(f"Slurm/munge not installed (missing {missing}); run tests/slurm/install.sh as root")
        if os.geteuid() != 0:
            raise SlurmError("the test cluster runs its daemons and jobs as root (SlurmUser=root): run as root")
        t0 = time.monotonic()
        self.reaped_pids = reap_stale_clusters()
        for attempt in range(1, attempts + 1):
            try:
                self._start_once(deadline=t0 + timeout)
                break
            except SlurmError as e:
                if attempt == attempts or "Address already in use" not in str(e):
                    raise
                self._pick_ports()
        self.start_seconds = time.monotonic() - t0
        return self

    def _start_once(self, deadline: float) -> None:
        for f in self.log_dir.glob("*") if self.log_dir.is_dir() else ():
            f.unlink()
        for d in ("etc", "state", "run", "log", "work", "munge", *(f"spool/{n}" for n in NODES)):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        # munged refuses a socket dir that others cannot traverse ("execute permissions for all required")
        # and key/socket dirs that others can write; mkdtemp makes the root 0700.
        os.chmod(self.root, 0o755)
        os.chmod(self.root / "munge", 0o755)
        me = os.getpid()
        (self.root / "owner").write_text(f"{me} {_proc_start_time(me)}\n")  # see reap_stale_clusters()
        self.conf_path.write_text(self.slurm_conf())
        (self.root / "etc" / "plugstack.conf").write_text("")
        try:
            self._start_munge(deadline=deadline)
            # -D: stay in the foreground, so the Popen handle is the daemon and teardown can wait for it.
            self._spawn("slurmctld", ["slurmctld", "-D", "-f", str(self.conf_path)])
            for n in NODES:
                self._spawn(f"slurmd-{n}", ["slurmd", "-D", "-N", n, "-f", str(self.conf_path)])
            self.started = True
            self.wait_nodes_idle(timeout=max(5.0, deadline - time.monotonic()))
        except BaseException:
            logs = self.logs_tail()
            self.stop(remove=False)
            (self.root / "failed-start.log").write_text(logs)
            raise

    def _spawn(self, name: str, argv: list[str]) -> None:
        out = open(self.log_dir / f"{name}.stdout", "ab")
        self._logs.append(out)
        # Own session: a Ctrl-C in the test terminal does not hit the daemons, and teardown controls
        # their end. The marker variable is inherited by slurmstepd (forked by slurmd), which is how
        # stop() finds leftovers.
        self._procs[name] = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                             env=self.env(), cwd=self.root, start_new_session=True)

    def _start_munge(self, deadline: float) -> None:
        key = self.root / "munge" / "munge.key"
        if not key.exists():
            cp = subprocess.run(["mungekey", "--create", f"--keyfile={key}"], capture_output=True, text=True,
                                timeout=30)
            if cp.returncode != 0:
                raise SlurmError(f"mungekey failed: {cp.stderr}")
            os.chmod(key, 0o600)
        m = self.root / "munge"
        self._spawn("munged", [
            "munged", "--foreground", f"--socket={self.munge_socket}", f"--key-file={key}",
            f"--pid-file={m / 'munged.pid'}", f"--log-file={self.log_dir / 'munged.log'}",
            f"--seed-file={m / 'munged.seed'}", "--num-threads=4",
        ])
        # Ready when a credential round-trips through our socket.
        while True:
            try:
                enc = subprocess.run(["munge", "-S", str(self.munge_socket), "-n"], capture_output=True,
                                     timeout=10)
                if enc.returncode == 0:
                    dec = subprocess.run(["unmunge", "-S", str(self.munge_socket)], input=enc.stdout,
                                         capture_output=True, timeout=10)
                    if dec.returncode == 0:
                        return
            except subprocess.TimeoutExpired:
                pass
            proc = self._procs["munged"]
            if proc.poll() is not None:
                raise SlurmError(f"munged exited with {proc.returncode}\n{self.logs_tail()}")
            if time.monotonic() > deadline:
                raise SlurmError(f"munged not answering on {self.munge_socket}\n{self.logs_tail()}")
            time.sleep(0.1)

    def wait_nodes_idle(self, timeout: float = 60) -> None:
        """Poll ``sinfo`` until every node is idle (and every daemon is still alive)."""
        deadline = time.monotonic() + timeout
        last = ""
        while True:
            for name, p in self._procs.items():
                if p.poll() is not None:
                    raise SlurmError(f"{name} exited with {p.returncode} during start\n{self.logs_tail()}")
            try:
                cp = self.run(["sinfo", "-h", "-N", "-o", "%N %T"], timeout=15, check=False)
                last = (cp.stdout + cp.stderr).strip()
                states = dict(line.split()[:2] for line in cp.stdout.splitlines() if len(line.split()) >= 2)
                if cp.returncode == 0 and all(states.get(n) == "idle" for n in NODES):
                    return
            except SlurmError:
                pass
            if time.monotonic() > deadline:
                raise SlurmError(f"nodes not idle after {timeout:.0f}s; last sinfo: {last!r}\n{self.logs_tail()}")
            time.sleep(0.2)

    def stop(self, remove: bool | None = None) -> None:
        """Cancel all jobs, stop the daemons, kill anything left that belongs to this cluster.

        ``remove``: delete the temp dir (default: only if this object created it)."""
        if self.started and self._procs.get("slurmctld") and self._procs["slurmctld"].poll() is None:
            try:
                self.run(["scancel", "--full", "--quiet", "--user=root"], timeout=15, check=False)
                self.wait_queue_empty(timeout=20)
            except SlurmError:
                pass
        # slurmd first (it does not kill running steps on SIGTERM; the orphan sweep below does), then
        # the controller, then munged which the others need while shutting down.
        order = [n for n in self._procs if n.startswith("slurmd")] + ["slurmctld", "munged"]
        for name in order:
            p = self._procs.get(name)
            if p is not None:
                _terminate(p)
        self.swept_pids = self._kill_marked_processes()
        for f in self._logs:
            f.close()
        self._logs.clear()
        self._procs.clear()
        self.started = False
        if remove if remove is not None else self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def _kill_marked_processes(self, timeout: float = 10) -> list[int]:
        """SIGKILL every process whose environment carries this cluster's marker (slurmstepd, tasks).

        Returns the pids that were found."""
        found: list[int] = []
        deadline = time.monotonic() + timeout
        while True:
            pids = self.marked_pids()
            found.extend(p for p in pids if p not in found)
            if not pids:
                return found
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if time.monotonic() > deadline:
                return found
            time.sleep(0.1)

    def marked_pids(self) -> list[int]:
        """Live processes (not zombies, not this one) whose environment carries this cluster's marker."""
        return _pids_with_env(MARKER_VAR, str(self.root), exclude=os.getpid())

    def __enter__(self) -> SlurmCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ diagnostics
    def job_pids(self, job_id: int | str) -> list[int]:
        """Live processes of job ``job_id`` (its batch shell, launcher, sruns and ranks): those whose
        environment carries ``SLURM_JOB_ID=<job_id>``."""
        return _pids_with_env("SLURM_JOB_ID", str(job_id))

    def diagnose(self, job_id: int | str) -> str:
        """What a test that waited in vain on job ``job_id`` should show: the job's record, the queue,
        the nodes, the job's processes with every thread's stack (Python and native, py-spy; nothing is
        stopped) and the daemon logs."""
        from conftest import process_stacks  # conftest imports this module

        parts = [f"job {job_id}: {self.job_info(job_id)}"]
        for args in (["squeue", "-h", "-o", "%i %P %j %T %r %N %M"], ["sinfo", "-h", "-N", "-o", "%N %T %E"]):
            cp = self.run(args, timeout=15, check=False)
            parts.append(f"$ {' '.join(args)}\n{cp.stdout}{cp.stderr}")
        parts.append(process_stacks(self.job_pids(job_id)))
        parts.append(self.logs_tail())
        return "\n".join(parts)

    def logs_tail(self, lines: int = 40) -> str:
        """The last lines of every daemon log, for error messages.

        ``*.log`` are the Slurm log files; ``*.stdout`` hold what the daemons printed, which repeats the
        log file (under -D) except for errors before the log file was opened: only their error lines are
        shown (all of munged's, which has no other log in the foreground)."""
        parts = []
        if self.log_dir.is_dir():
            for f in sorted(self.log_dir.iterdir()):
                try:
                    text = f.read_text(errors="replace").splitlines()
                except OSError:
                    continue
                if f.suffix == ".stdout" and not f.name.startswith("munged"):
                    text = [t for t in text if re.search(r"error|fatal|abort", t, re.I)]
                text = text[-lines:]
                if text:
                    parts.append(f"--- {f.name} (last {len(text)} lines) ---\n" + "\n".join(text))
        return f"daemon logs in {self.log_dir}:\n" + ("\n".join(parts) or "(no daemon logs)")

    # ------------------------------------------------------------------ jobs
    def high_job(self, out_dir: Path) -> int:
        """Submit a job on the `high` partition that wants both nodes (``srun true``): it preempts the `low`
        or `lowlong` partition's job there (PreemptMode=REQUEUE). Returns its id; its output goes to ``out_dir/high.out``."""
        return self.sbatch("#!/bin/bash\nsrun true\n", "-p", "high", "-N2", "--exclusive", "-J", "high",
                           "-o", str(out_dir / "high.out"))

    def sbatch(self, script_text: str, *args: str, env: Mapping[str, str] | None = None,
               timeout: float = 30) -> int:
        """Submit ``script_text`` with extra sbatch ``args``; return the job id.

        The script is written to the work dir (kept for debugging); output defaults to
        ``<work>/slurm-<jobid>.out`` unless ``-o`` is given."""
        scripts = self.root / "work" / "scripts"
        scripts.mkdir(parents=True, exist_ok=True)
        path = scripts / f"job-{time.monotonic_ns()}.sh"
        path.write_text(script_text)
        cp = self.run(["sbatch", "--parsable", *args, str(path)], timeout=timeout, env=env)
        return int(cp.stdout.strip().split(";")[0])

    def job_info(self, job_id: int | str) -> dict[str, str] | None:
        """``scontrol show job -o <id>`` as a dict, or None when the controller no longer knows the job."""
        cp = self.run(["scontrol", "show", "job", "-o", str(job_id)], timeout=15, check=False)
        if cp.returncode != 0:
            if "Invalid job id" in cp.stderr:
                return None
            raise SlurmError(f"scontrol show job {job_id} failed: {cp.stderr}\n{self.logs_tail()}")
        lines = [line for line in cp.stdout.splitlines() if line.strip()]
        return parse_scontrol_record(lines[0]) if lines else None

    def wait_state(self, job_id: int | str, states: Iterable[str] | str, timeout: float = 60,
                   poll: float = 0.2, fail_on_end: bool = True) -> dict[str, str]:
        """Poll until the job's JobState is one of ``states``; return its record.

        Raises SlurmError (with the job record and daemon logs) on timeout, or (``fail_on_end``) when the
        job reaches an end state that was not asked for."""
        wanted = {states} if isinstance(states, str) else set(states)
        deadline = time.monotonic() + timeout
        info: dict[str, str] | None = None
        while True:
            info = self.job_info(job_id)
            state = info.get("JobState") if info else None
            if state in wanted:
                return info  # type: ignore[return-value]
            # PREEMPTED can be passing on the way to a requeue, so only the other end states are final.
            if state in FINISHED_STATES - {"PREEMPTED"} and fail_on_end:
                raise SlurmError(f"job {job_id} ended in {state}, wanted {sorted(wanted)}: {info}\n"
                                 f"{self.logs_tail()}")
            if time.monotonic() > deadline:
                raise SlurmError(f"job {job_id} not in {sorted(wanted)} after {timeout:.0f}s: {info}\n"
                                 f"{self.logs_tail()}")
            time.sleep(poll)

    def squeue(self, *args: str) -> list[dict[str, str]]:
        """Jobs in the queue: dicts with id, partition, name, state, reason, nodes (``squeue -h`` rows)."""
        fmt = "%i|%P|%j|%T|%r|%N"
        cp = self.run(["squeue", "-h", "-o", fmt, *args], timeout=15)
        keys = ("id", "partition", "name", "state", "reason", "nodes")
        return [dict(zip(keys, line.split("|"))) for line in cp.stdout.splitlines() if line.strip()]

    def scancel(self, *args: str | int) -> None:
        """``scancel`` with the given arguments (job ids and/or options)."""
        self.run(["scancel", *map(str, args)], timeout=15)

    def wait_queue_empty(self, timeout: float = 30) -> None:
        """Poll until no job is pending, running or completing."""
        deadline = time.monotonic() + timeout
        while True:
            jobs = self.squeue()
            if not jobs:
                return
            if time.monotonic() > deadline:
                raise SlurmError(f"queue not empty after {timeout:.0f}s: {jobs}\n{self.logs_tail()}")
            time.sleep(0.2)

    def reset(self, timeout: float = 60) -> None:
        """Cancel every job and wait until the queue is empty and both nodes are idle (between tests)."""
        self.run(["scancel", "--full", "--quiet", "--user=root"], timeout=15, check=False)
        self.wait_queue_empty(timeout=timeout)
        self.wait_nodes_idle(timeout=timeout)


def _terminate(p: subprocess.Popen[bytes], timeout: float = 10) -> None:
    """SIGTERM a daemon (and its process group), then SIGKILL if it does not exit in time."""
    if p.poll() is not None:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            pass
        try:
            p.wait(timeout=timeout)
            return
        except subprocess.TimeoutExpired:
            continue
