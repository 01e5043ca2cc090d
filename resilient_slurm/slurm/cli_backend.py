"""``CliSlurmClient``: the default ``SlurmClient``, built on scontrol, scancel and sbatch.

Every command runs with a timeout (a hung scontrol must not hang the launcher) and its whole process group
is killed when it expires. Failures are classified from Slurm's messages: transient ones (timeouts, an
unreachable or overloaded controller) are retried with exponential backoff and jitter, a bounded number
of times; permanent ones (unknown job, permission, bad option) are raised at once. ``sbatch`` is not
idempotent, so a submission is retried only when the controller refused the connection (the request
cannot have arrived); after a timeout it may or may not have been queued, and the error says so.

Facts this parser relies on (Slurm 22.05, checked against a real cluster in tests/test_slurm_client.py):
- ``scontrol show job -o`` prints one ``Key=Value`` line per job (several for an array's master id);
  values may contain spaces and ``=`` (``JobName``, ``Comment``, ``Command``, ``StdOut``...).
- Times are local time in the format chosen by ``SLURM_TIME_FORMAT`` (``relative`` drops the date), so
  scontrol is run with ``SLURM_TIME_FORMAT=standard`` and ``TZ=UTC``.
- ``Unknown``/``None``/``(null)``/``N/A`` mean "no value"; an UNLIMITED job has ``EndTime=Unknown``.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shlex
import signal as _signal
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime, timezone
from difflib import get_close_matches
from os import PathLike
from typing import Protocol

from tenacity import RetryCallState, Retrying, retry_if_exception, stop_after_attempt, stop_after_delay
from tenacity.stop import stop_base
from tenacity.wait import wait_base, wait_exponential, wait_random

from ..errors import (
    PermanentSlurmError,
    SlurmError,
    SlurmJobNotFoundError,
    SlurmJobStateError,
    SlurmTimeoutError,
    SlurmUnreachableError,
    TransientSlurmError,
)
from ..rendezvous import node_addrs_from_records
from .client import JobInfo, PartitionInfo, Signal, SlurmClient, expand_hostlist, parse_duration, signal_name

log = logging.getLogger(__name__)


class Runner(Protocol):
    """What runs a command: ``subprocess.run`` or anything called the same way."""

    def __call__(self, args: Sequence[str], *, input: str | None, capture_output: bool, text: bool,
                 timeout: float | None, env: Mapping[str, str] | None,
                 check: bool) -> subprocess.CompletedProcess[str]: ...


def run_process(args: Sequence[str], *, input: str | None = None, capture_output: bool = True,
                text: bool = True, timeout: float | None = None, env: Mapping[str, str] | None = None,
                check: bool = False) -> subprocess.CompletedProcess[str]:
    """``subprocess.run`` that kills the command's whole process group on timeout.

    ``subprocess.run`` kills only the direct child and then waits for the output pipes to close, which
    never happens while a grandchild (a site wrapper around scontrol, a stuck helper) keeps them open.
    Output is always captured as text; ``capture_output``/``text`` exist for signature compatibility.

    The command ignores SIGTERM (:func:`_outlive_the_jobs_teardown`); the timeout's SIGKILL still ends it."""
    del capture_output, text
    with subprocess.Popen(list(args), stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=dict(env) if env is not None else None, start_new_session=True,
                          preexec_fn=_outlive_the_jobs_teardown) as proc:
        try:
            out, err = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            try:
                out, err = proc.communicate(timeout=2.0)
            except subprocess.TimeoutExpired:  # a descendant left the group and holds the pipes
                out, err = "", ""
            raise subprocess.TimeoutExpired(proc.args, timeout or 0.0, output=out, stderr=err) from None
        except BaseException:
            _kill_group(proc)
            raise
    cp = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    if check:
        cp.check_returncode()
    return cp


def _outlive_the_jobs_teardown() -> None:
    """In the child, before exec: ignore SIGTERM (kept across exec; scontrol leaves it so).

    When rslurm runs inside a job (the launcher is its batch script), the job's teardown sends SIGTERM to
    every process of the job, and a requeue is what starts that teardown: `scontrol requeue` run by the
    launcher was ended by it after the controller had requeued the job, and before it exited 0 (seen on a
    busy node), so the launcher took the requeue for failed and did not exclude a bad node from the next
    incarnation. A Slurm command is short and bounded by the client's timeout (SIGKILL), and Slurm's own
    SIGKILL after KillWait ends it with the job."""
    _signal.signal(_signal.SIGTERM, _signal.SIG_IGN)


def _kill_group(proc: subprocess.Popen[str]) -> None:
    try:
        os.killpg(proc.pid, _signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()


# ---------------------------------------------------------------------------------------------- errors
# Checked in order, first match wins; anything unmatched is permanent (never retry what is not known to
# be worth it). Messages are Slurm 22.05's, seen on stderr of scontrol/scancel/sbatch.
_FAILURES: tuple[tuple[re.Pattern[str], type[SlurmError]], ...] = tuple(
    (re.compile(p, re.IGNORECASE), cls) for p, cls in (
        # permanent, even where the wording sounds temporary
        (r"Invalid job id", SlurmJobNotFoundError),
        (r"Job has already finished|Job is pending execution|Requested operation is presently disabled"
         r"|Job is no longer pending|Only batch jobs|Job is not running", SlurmJobStateError),
        (r"Access/permission denied|Permission denied|Invalid user id|Invalid (partition|account|qos)"
         r"|unrecognized option|invalid option|Unknown job signal|does not look like a batch script"
         r"|not found", PermanentSlurmError),
        # never delivered: safe to retry even a submission
        (r"Connection refused|connect failure", SlurmUnreachableError),
        # transient: the controller is unreachable, slow or busy, or the job is changing state
        (r"Socket timed out|Zero Bytes were transmitted|Unable to contact slurm controller"
         r"|Communication connection failure|Connection reset|Network is unreachable|No route to host"
         r"|Resource temporarily unavailable|Unexpected message received|backup controller in standby"
         r"|try again later|temporarily unable|Transport endpoint", TransientSlurmError),
    ))

_HINTS: dict[type[SlurmError], str] = {
    SlurmJobNotFoundError: "the controller does not know this job (it never existed, or it ended more "
                           "than MinJobAge seconds ago)",
    SlurmJobStateError: "the job's current state does not allow this; check it with `scontrol show job`",
    SlurmUnreachableError: "the Slurm controller is not accepting connections; check `scontrol ping` "
                           "and SLURM_CONF",
    TransientSlurmError: "the Slurm controller is unreachable or overloaded; check `scontrol ping`",
}


def classify_failure(command: Sequence[str], returncode: int, stderr: str, stdout: str = "") -> SlurmError:
    """The error for a Slurm command that exited non-zero, chosen from its messages."""
    text = (stderr.strip() or stdout.strip())
    cls: type[SlurmError] = PermanentSlurmError
    for pattern, kind in _FAILURES:
        if pattern.search(text):
            cls = kind
            break
    cmd = shlex.join(command)
    hint = _HINTS.get(cls)
    msg = f"`{cmd}` failed with exit code {returncode}: {text or '(no output)'}"
    if hint:
        msg += f"; {hint}"
    return cls(msg, command=tuple(command), returncode=returncode, stderr=stderr)


# ---------------------------------------------------------------------------------------------- parsing
# Keys of `scontrol show job -o` in 22.05 (some only appear for arrays, het jobs, GPUs, reservations...).
# A `Key=` inside a free-text value starts a new field only if it is one of these and not seen yet.
JOB_KEYS = frozenset("""
JobId ArrayJobId ArrayTaskId ArrayTaskThrottle HetJobId HetJobOffset HetJobIdSet JobName UserId GroupId
MCS_label Priority Nice Account QOS WCKey JobState Reason Dependency Requeue Restarts BatchFlag Reboot
ExitCode DerivedExitCode RunTime TimeLimit TimeMin SubmitTime EligibleTime AccrueTime StartTime EndTime
Deadline PreemptEligibleTime PreemptTime SuspendTime SecsPreSuspend LastSchedEval Scheduler ResizeTime
Partition AllocNode:Sid ReqNodeList ExcNodeList NodeList SchedNodeList BatchHost NumNodes NumCPUs NumTasks
CPUs/Task ReqB:S:C:T TRES Socks/Node NtasksPerN:B:S:C CoreSpec ThreadSpec MinCPUsNode MinMemoryNode
MinMemoryCPU MinTmpDiskNode Features Prefer ClusterFeatures DelayBoot Reservation OverSubscribe Contiguous
Licenses Network Command WorkDir AdminComment SystemComment Comment StdErr StdIn StdOut Power TresPerNode
TresPerJob TresPerSocket TresPerTask CpusPerTres MemPerTres TresBind TresFreq NtasksPerTRES MailUser
MailType BurstBuffer BurstBufferState CpuFreqMin CpuFreqMax CpuFreqGov Container ContainerID FedOrigin
FedViableSiblings FedActiveSiblings Clusters Switches Wait-for-Switch ResvPort Nodes CPU_IDs Mem GRES
""".split())
# Fields whose value is free text (may contain spaces and `Key=`-looking words).
FREE_TEXT_KEYS = frozenset({"JobName", "Comment", "AdminComment", "SystemComment", "Command", "WorkDir",
                            "StdErr", "StdIn", "StdOut", "Reason", "Dependency", "MailUser"})
_KEY = re.compile(r"(?:^|(?<=\s))([A-Za-z][A-Za-z0-9_:/\-]*)=")
_NO_VALUE = frozenset({"", "(null)", "None", "N/A", "Unknown", "None assigned"})


def parse_scontrol_record(line: str, known_keys: Iterable[str] = JOB_KEYS,
                          free_text_keys: Iterable[str] = FREE_TEXT_KEYS) -> dict[str, str]:
    """Parse one ``scontrol show <entity> -o`` line (``Key=Value Key=Value ...``) into a dict.

    Values keep their inner spaces. Inside a free-text value (``Comment=held: Step=5``), a word that
    looks like ``Key=`` starts a new field only if it is a known key not seen yet; elsewhere any
    ``Key=`` does, so fields a newer Slurm adds are still parsed."""
    known, free = frozenset(known_keys), frozenset(free_text_keys)
    starts: list[tuple[str, int, int]] = []  # key, start of "Key=", start of value
    seen: set[str] = set()
    current: str | None = None
    for m in _KEY.finditer(line):
        key = m.group(1)
        if key in seen:
            continue
        if current in free and key not in known:
            continue
        starts.append((key, m.start(), m.end()))
        seen.add(key)
        current = key
    out: dict[str, str] = {}
    for i, (key, _, value_start) in enumerate(starts):
        end = starts[i + 1][1] if i + 1 < len(starts) else len(line)
        out[key] = line[value_start:end].strip()
    return out


def _opt(rec: Mapping[str, str], key: str) -> str | None:
    v = rec.get(key)
    return None if v is None or v.strip() in _NO_VALUE else v.strip()


def _opt_int(rec: Mapping[str, str], key: str) -> int | None:
    v = _opt(rec, key)
    try:
        return int(v) if v is not None else None
    except ValueError:
        return None


def parse_time(text: str | None) -> datetime | None:
    """A ``SLURM_TIME_FORMAT=standard`` time printed under ``TZ=UTC`` (``2026-01-02T03:04:05``)."""
    if text is None or text.strip() in _NO_VALUE:
        return None
    return datetime.strptime(text.strip(), "%Y-%m-%dT%H:%M:%S").replace(tzinfo=timezone.utc)


def job_info_from_record(rec: Mapping[str, str]) -> JobInfo:
    """A ``JobInfo`` from a parsed ``scontrol show job -o`` record."""
    try:
        job_id = int(rec["JobId"])
        state = rec["JobState"]
    except (KeyError, ValueError) as exc:
        raise PermanentSlurmError(f"not a job record (no JobId/JobState): {dict(rec)!r}") from exc
    code, _, sig = (rec.get("ExitCode") or "").partition(":")
    node_list = _opt(rec, "NodeList")
    time_limit = rec.get("TimeLimit", "")
    return JobInfo(
        job_id=job_id,
        name=rec.get("JobName", ""),
        state=state,
        reason=_opt(rec, "Reason"),
        restarts=_opt_int(rec, "Restarts") or 0,
        requeue=rec.get("Requeue") == "1",
        priority=_opt_int(rec, "Priority"),
        time_limit=parse_duration(time_limit) if time_limit else None,
        submit_time=parse_time(rec.get("SubmitTime")),
        start_time=parse_time(rec.get("StartTime")),
        end_time=parse_time(rec.get("EndTime")),
        preempt_time=parse_time(rec.get("PreemptTime")),
        partition=_opt(rec, "Partition"),
        nodes=tuple(expand_hostlist(node_list)) if node_list else (),
        node_list=node_list,
        batch_host=_opt(rec, "BatchHost"),
        exit_code=int(code) if code.isdigit() else None,
        exit_signal=int(sig) if sig.isdigit() else None,
        comment=_opt(rec, "Comment"),
        array_job_id=_opt_int(rec, "ArrayJobId"),
        array_task_id=_opt_int(rec, "ArrayTaskId"),
        raw=dict(rec),
    )


def partition_info_from_record(rec: Mapping[str, str]) -> PartitionInfo:
    """A ``PartitionInfo`` from a parsed ``scontrol show partition -o`` record."""
    nodes = _opt(rec, "Nodes")
    return PartitionInfo(
        name=rec["PartitionName"],
        grace_time=parse_duration(rec.get("GraceTime", "0")) or 0.0,
        preempt_mode=rec.get("PreemptMode", "OFF"),
        max_time=parse_duration(rec.get("MaxTime", "UNLIMITED")),
        default_time=parse_duration(rec.get("DefaultTime", "NONE")),
        nodes=tuple(expand_hostlist(nodes)) if nodes else (),
        priority_tier=_opt_int(rec, "PriorityTier"),
        state=rec.get("State", ""),
        raw=dict(rec),
    )


def parse_config(text: str) -> dict[str, str]:
    """``scontrol show config`` (``Key   = Value`` lines) as a dict; the first occurrence of a key wins
    (later sections, e.g. cgroup.conf's, may repeat names)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        m = re.match(r"^(\S+)\s*=\s?(.*)$", line)
        if m and m.group(1) not in out:
            out[m.group(1)] = m.group(2).strip()
    return out


def _comment_text(reason: str) -> str:
    text = " ".join(reason.split())  # one line: squeue and `scontrol show job -o` print it inline
    return f"rslurm held: {text}"[:1000]


# ---------------------------------------------------------------------------------------------- client
class CliSlurmClient(SlurmClient):
    """``SlurmClient`` over the Slurm command-line tools.

    - ``runner``: runs one command (``subprocess.run``-compatible); the default kills the whole process
      group on timeout.
    - ``timeout``: seconds for one command. scontrol against an unreachable controller gives up by
      itself after 4-8 s (22.05, MessageTimeout 5), so 10 s leaves it room to say why.
    - ``retries``: extra attempts after a transient failure (so at most ``retries + 1`` runs).
    - ``wait``: tenacity wait strategy between attempts (default: 0.5 s doubling up to 8 s, plus 0-0.5 s
      of random jitter so that many nodes do not retry in lockstep).
    - ``sleep``: how to wait between attempts (inject a recorder or a no-op in tests).
    - ``total_timeout``: stop retrying once this many seconds passed (a launcher near its deadline).
    - ``env``: environment for the commands (default: this process's at call time), e.g. SLURM_CONF.
    """

    def __init__(
        self,
        runner: Runner = run_process,
        *,
        timeout: float = 10.0,
        retries: int = 3,
        wait: wait_base | None = None,
        sleep: Callable[[float], None] = time.sleep,
        total_timeout: float | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        self.runner = runner
        self.timeout = timeout
        self.retries = retries
        # exponential + random: the same jittered backoff in every tenacity >= 8.2
        self.wait = wait if wait is not None else wait_exponential(multiplier=0.5, max=8.0) + wait_random(0, 0.5)
        self.sleep = sleep
        self.total_timeout = total_timeout
        self.env = dict(env) if env is not None else None

    # ------------------------------------------------------------------ running commands
    def _env(self, query: bool) -> dict[str, str]:
        env = dict(os.environ if self.env is None else self.env)
        if query:
            # Only for scontrol queries: sbatch exports its environment into the job, where a forced TZ
            # or time format would change the user's program.
            env["SLURM_TIME_FORMAT"] = "standard"
            env["TZ"] = "UTC"
        return env

    def run(self, argv: Sequence[str], *, input: str | None = None, query: bool = False,
            idempotent: bool = True, done_if_retry_says: str | None = None) -> subprocess.CompletedProcess[str]:
        """Run a Slurm command with timeout and retries; return its result or raise a SlurmError.

        ``query``: run with a fixed time format and UTC. ``idempotent=False``: retry only when the
        controller refused the connection. ``done_if_retry_says``: a message that, on a retry, means the
        previous attempt took effect before it timed out (e.g. "Job is pending execution" for requeue)."""
        argv = list(argv)
        cmd = shlex.join(argv)
        env = self._env(query)
        attempts = 0

        def once() -> subprocess.CompletedProcess[str]:
            nonlocal attempts
            attempts += 1
            try:
                cp = self.runner(argv, input=input, capture_output=True, text=True, timeout=self.timeout,
                                 env=env, check=False)
            except subprocess.TimeoutExpired as exc:
                note = (" The request may have reached the controller: check `squeue` before submitting "
                        "again." if not idempotent else "")
                raise SlurmTimeoutError(
                    f"`{cmd}` did not finish within {self.timeout:g}s and was killed (the Slurm controller is "
                    f"slow or unreachable; check `scontrol ping`).{note}",
                    command=tuple(argv), stderr=_text(exc.stderr)) from exc
            except FileNotFoundError as exc:
                raise PermanentSlurmError(
                    f"`{cmd}`: {argv[0]} not found on PATH={env.get('PATH', '')!r}; install the Slurm client "
                    "tools or fix PATH", command=tuple(argv)) from exc
            except OSError as exc:  # fork/exec failed: EAGAIN/ENOMEM pass, the rest will not
                cls = TransientSlurmError if exc.errno in (errno.EAGAIN, errno.ENOMEM, errno.EINTR) \
                    else PermanentSlurmError
                raise cls(f"`{cmd}` could not be started: {exc}", command=tuple(argv)) from exc
            if cp.returncode == 0:
                return cp
            if attempts > 1 and done_if_retry_says and done_if_retry_says in (cp.stderr or ""):
                log.info("`%s`: %s on attempt %d: the earlier attempt took effect", cmd,
                         done_if_retry_says, attempts)
                return cp
            raise classify_failure(argv, cp.returncode, cp.stderr or "", cp.stdout or "")

        def retryable(exc: BaseException) -> bool:
            if not isinstance(exc, TransientSlurmError):
                return False
            return idempotent or isinstance(exc, SlurmUnreachableError)

        stop: stop_base = stop_after_attempt(self.retries + 1)
        if self.total_timeout is not None:
            stop = stop | stop_after_delay(self.total_timeout)
        retrying = Retrying(stop=stop, wait=self.wait, sleep=self.sleep, retry=retry_if_exception(retryable),
                            reraise=True, before_sleep=_log_retry)
        try:
            return retrying(once)
        except SlurmError as exc:
            exc.attempts = attempts
            if attempts > 1:
                exc.args = (f"{exc.args[0]} [gave up after {attempts} attempts]", *exc.args[1:])
            raise

    # ------------------------------------------------------------------ SlurmClient
    def job_info(self, job_id: int | str) -> JobInfo:
        cp = self.run(["scontrol", "show", "job", "-o", str(job_id)], query=True)
        records = [parse_scontrol_record(line) for line in cp.stdout.splitlines() if line.strip()]
        if not records:
            raise SlurmJobNotFoundError(f"`scontrol show job -o {job_id}` printed no job record",
                                        command=("scontrol", "show", "job", "-o", str(job_id)))
        wanted = str(job_id)
        for rec in records:  # an array's master id lists every task; JobId=<id> is the one asked for
            if rec.get("JobId") == wanted or f"{rec.get('ArrayJobId')}_{rec.get('ArrayTaskId')}" == wanted:
                return job_info_from_record(rec)
        return job_info_from_record(records[0])

    def requeue(self, job_id: int | str, *, only_incomplete: bool = True) -> None:
        argv = ["scontrol", "requeue", *(["Incomplete"] if only_incomplete else []), str(job_id)]
        self.run(argv, done_if_retry_says="Job is pending execution")
        log.info("job %s: requeued", job_id)

    def requeue_hold(self, job_id: int | str, reason: str, *, only_incomplete: bool = True) -> None:
        # Comment first: requeueing kills the job's processes, which may include the caller.
        try:
            self.run(["scontrol", "update", f"JobId={job_id}", f"Comment={_comment_text(reason)}"])
        except SlurmJobStateError:
            if only_incomplete:
                log.info("job %s: already finished, not held", job_id)
                return
            raise
        argv = ["scontrol", "requeuehold", *(["Incomplete"] if only_incomplete else []), str(job_id)]
        self.run(argv, done_if_retry_says="Job is pending execution")
        log.warning("job %s: requeued and held: %s", job_id, reason)

    def signal(self, job_id: int | str, sig: Signal, *, batch: bool = False, full: bool = False,
               step: int | str | None = None) -> None:
        if batch and full:
            raise ValueError("batch=True and full=True together: --full already includes the batch shell")
        if step is not None and (batch or full):
            raise ValueError("step= selects one step; it cannot be combined with batch or full")
        target = f"{job_id}.{step}" if step is not None else str(job_id)
        argv = ["scancel", f"--signal={signal_name(sig)}", *(["--batch"] if batch else []),
                *(["--full"] if full else []), target]
        self.run(argv)

    def cancel(self, job_id: int | str) -> None:
        self.run(["scancel", str(job_id)])

    def submit(self, script: str | PathLike[str], args: Sequence[str] = ()) -> int:
        if isinstance(script, str):
            if not script.startswith("#!"):
                raise ValueError("script text must start with '#!' (sbatch refuses it otherwise); pass a "
                                 "pathlib.Path to submit a file")
            argv, text = ["sbatch", "--parsable", *args], script
        else:
            argv, text = ["sbatch", "--parsable", *args, os.fspath(script)], None
        cp = self.run(argv, input=text, idempotent=False)
        lines = [line for line in cp.stdout.splitlines() if line.strip()]
        try:
            return int(lines[-1].split(";")[0])
        except (IndexError, ValueError) as exc:
            raise PermanentSlurmError(f"`{shlex.join(argv)}` printed no job id: stdout={cp.stdout!r} "
                                      f"stderr={cp.stderr!r}", command=tuple(argv), stderr=cp.stderr) from exc

    def partition_info(self, name: str) -> PartitionInfo:
        cp = self.run(["scontrol", "show", "partition", "-o", name], query=True)
        for line in cp.stdout.splitlines():
            rec = parse_scontrol_record(line, known_keys=(), free_text_keys=())
            if rec.get("PartitionName") == name:
                return partition_info_from_record(rec)
        raise PermanentSlurmError(f"`scontrol show partition -o {name}` printed no record for {name!r}: "
                                  f"{cp.stdout!r}", command=("scontrol", "show", "partition", "-o", name))

    def config(self) -> dict[str, str]:
        """Every ``scontrol show config`` setting, as printed."""
        return parse_config(self.run(["scontrol", "show", "config"], query=True).stdout)

    def config_value(self, key: str) -> str:
        conf = self.config()
        if key in conf:
            return conf[key]
        folded = {k.lower(): v for k, v in conf.items()}
        if key.lower() in folded:
            return folded[key.lower()]
        close = get_close_matches(key, list(conf), n=5, cutoff=0.6)
        raise PermanentSlurmError(
            f"Slurm has no configuration key {key!r}"
            + (f"; did you mean {', '.join(close)}?" if close else "")
            + f" (`scontrol show config` lists {len(conf)} keys)", command=("scontrol", "show", "config"))

    def exclude_nodes(self, job_id: int | str, nodes: Sequence[str]) -> list[str]:
        current = self.job_info(job_id).raw.get("ExcNodeList", "")
        have = self.hostnames(current) if current and current != "(null)" else []
        merged = list(dict.fromkeys([*have, *nodes]))
        self.run(["scontrol", "update", f"JobId={job_id}", f"ExcNodeList={','.join(merged)}"])
        log.warning("job %s: nodes %s excluded (ExcNodeList=%s)", job_id, ",".join(nodes), ",".join(merged))
        return merged

    def node_addresses(self, nodelist: str) -> dict[str, str]:
        if not nodelist.strip():
            return {}
        return node_addrs_from_records(self.run(["scontrol", "show", "node", "-o", nodelist], query=True).stdout)

    def steps(self, job_id: int | str) -> list[tuple[str, str]]:
        cp = self.run(["squeue", "--noheader", "--steps", f"--jobs={job_id}", "--format=%i|%j"])
        out = []
        for line in cp.stdout.splitlines():
            sid, sep, name = line.strip().partition("|")
            if sep and sid:
                out.append((sid, name))
        return out

    def hostnames(self, nodelist: str) -> list[str]:
        if not nodelist.strip():
            return []
        argv = ["scontrol", "show", "hostnames", nodelist]
        cp = self.run(argv)
        if "Invalid hostlist" in (cp.stderr or ""):  # 22.05 says so on stderr but exits 0
            raise PermanentSlurmError(f"`{shlex.join(argv)}`: {cp.stderr.strip()}", command=tuple(argv),
                                      returncode=cp.returncode, stderr=cp.stderr)
        return [line.strip() for line in cp.stdout.splitlines() if line.strip()]


def _text(data: str | bytes | None) -> str:
    if data is None:
        return ""
    return data.decode(errors="replace") if isinstance(data, bytes) else data


def _log_retry(state: RetryCallState) -> None:
    exc = state.outcome.exception() if state.outcome else None
    delay = state.next_action.sleep if state.next_action else 0.0
    log.warning("attempt %d failed, retrying in %.1fs: %s", state.attempt_number, delay, exc)
