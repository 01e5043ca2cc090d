"""The Slurm access layer (resilient_slurm.slurm).

1. Against the real test cluster (tests/slurm_cluster.py): job records, signals to the batch shell,
   requeue, requeue-and-hold with a visible reason, cancel, partitions, configuration, host lists, and
   the errors real Slurm 22.05 commands produce.
2. Failure paths with fake ``scontrol``/``scancel``/``sbatch`` executables first on PATH, so the real
   subprocess, timeout and retry code runs: hangs, transient errors, permanent errors, bounded retries.
3. Pure helpers: ``remaining_seconds``, durations, host lists, the ``scontrol -o`` parser.

The cluster comes from the session fixtures in tests/conftest.py (one cluster for the whole run).
"""

from __future__ import annotations

import math
import os
import socket
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from conftest import wait_for_text
from slurm_cluster import SlurmCluster
from tenacity import wait_none

from resilient_slurm.errors import (
    ConfigError,
    PermanentSlurmError,
    SlurmJobNotFoundError,
    SlurmJobStateError,
    SlurmTimeoutError,
    SlurmUnreachableError,
    TransientError,
    TransientSlurmError,
)
from resilient_slurm.slurm import (
    CliSlurmClient,
    JobInfo,
    expand_hostlist,
    parse_duration,
    remaining_seconds,
    signal_name,
    slurm_client,
)
from resilient_slurm.slurm.cli_backend import classify_failure, job_info_from_record, parse_scontrol_record

# A record printed by `scontrol show job -o` on Slurm 22.05.8 (the test cluster), with a Comment and a
# JobName that contain spaces and `Key=`-looking words, as a user or requeue_hold can set them.
RECORD_2205 = (
    "JobId=2 JobName=train run=3 UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=0 Nice=0 "
    "Account=(null) QOS=(null) JobState=PENDING Reason=job_requeued_in_held_state Dependency=(null) "
    "Requeue=1 Restarts=2 BatchFlag=1 Reboot=0 ExitCode=0:15 RunTime=00:00:00 TimeLimit=1-00:00:00 "
    "TimeMin=N/A SubmitTime=2026-11-22T03:45:11 EligibleTime=2026-11-22T03:45:17 "
    "AccrueTime=2026-11-22T03:45:17 StartTime=2026-11-22T03:45:17 EndTime=2026-11-23T03:45:17 Deadline=N/A "
    "PreemptEligibleTime=2026-11-22T03:45:17 PreemptTime=2026-11-22T03:46:00 SuspendTime=None "
    "SecsPreSuspend=0 LastSchedEval=2026-11-22T03:45:17 Scheduler=Backfill Partition=low "
    "AllocNode:Sid=localhost:4849 ReqNodeList=(null) ExcNodeList=(null) NodeList=n[1-2] BatchHost=n1 "
    "NumNodes=2 NumCPUs=4 NumTasks=2 CPUs/Task=1 ReqB:S:C:T=0:0:*:* TRES=cpu=4,node=2,billing=4 "
    "Socks/Node=* NtasksPerN:B:S:C=0:0:*:* CoreSpec=* MinCPUsNode=1 MinMemoryNode=0 MinTmpDiskNode=0 "
    "Features=(null) DelayBoot=00:00:00 OverSubscribe=NO Contiguous=0 Licenses=(null) Network=(null) "
    "Command=/work/run job.sh --lr=0.1 WorkDir=/tmp/work AdminComment=admin note x  "
    "Comment=rslurm held: no progress Restarts=3 x=y  StdErr=/tmp/o StdIn=/dev/null StdOut=/tmp/o Power= "
)


# ============================================================================== 3. pure helpers
def _job(**kw: object) -> JobInfo:
    base: dict[str, object] = dict(
        job_id=1, name="j", state="RUNNING", reason=None, restarts=0, requeue=True, priority=1,
        time_limit=3600.0, submit_time=None, start_time=None, end_time=None, preempt_time=None,
        partition="low", nodes=("n1",), node_list="n1", batch_host="n1", exit_code=0, exit_signal=0,
        comment=None)
    base.update(kw)
    return JobInfo(**base)  # type: ignore[arg-type]


T0 = datetime(2030, 1, 1, 12, 0, 0, tzinfo=timezone.utc)
NOW = T0.timestamp()


def test_remaining_seconds_until_time_limit():
    job = _job(end_time=T0 + timedelta(seconds=300))
    assert remaining_seconds(job, NOW) == 300
    assert remaining_seconds(job, NOW + 100) == 200
    assert remaining_seconds(job, NOW, kill_wait=30) == 330  # until SIGKILL instead of SIGTERM
    assert remaining_seconds(job, NOW + 400) == 0  # overdue: never negative


def test_remaining_seconds_preempted_uses_grace_time():
    # Preempted 10 s ago with GraceTime 60 s; the time limit is far away.
    job = _job(end_time=T0 + timedelta(hours=5), preempt_time=T0 - timedelta(seconds=10))
    assert remaining_seconds(job, NOW, grace_time=60) == 50
    assert remaining_seconds(job, NOW, grace_time=60, kill_wait=5) == 55
    # Without grace_time only EndTime counts (22.05 moves EndTime to preempt time + GraceTime itself).
    assert remaining_seconds(job, NOW) == 5 * 3600
    # The time limit comes first: it wins.
    job = _job(end_time=T0 + timedelta(seconds=20), preempt_time=T0 - timedelta(seconds=10))
    assert remaining_seconds(job, NOW, grace_time=60) == 20


def test_remaining_seconds_unlimited_job():
    assert remaining_seconds(_job(end_time=None, time_limit=None), NOW) == math.inf
    assert remaining_seconds(_job(end_time=None, time_limit=None), NOW, kill_wait=30) == math.inf
    preempted = _job(end_time=None, time_limit=None, preempt_time=T0)
    assert remaining_seconds(preempted, NOW + 4, grace_time=10) == 6


@pytest.mark.parametrize("text,seconds", [
    ("00:01:00", 60), ("1-00:00:00", 86400), ("2-12", 216000), ("05:30", 330), ("10", 10),
    ("5 sec", 5), ("0 min", 0), ("2 hours", 7200), ("UNLIMITED", None), ("INFINITE", None),
    ("NONE", None), ("Partition_Limit", None),
])
def test_parse_duration(text, seconds):
    assert parse_duration(text) == seconds


def test_parse_duration_rejects_garbage():
    with pytest.raises(ValueError, match="not a Slurm duration"):
        parse_duration("soon")


@pytest.mark.parametrize("nodelist,names", [
    ("n[1-2]", ["n1", "n2"]),
    ("n1", ["n1"]),
    ("gpu[01-03,7]", ["gpu01", "gpu02", "gpu03", "gpu7"]),
    ("n[8-10],login", ["n8", "n9", "n10", "login"]),
    ("r[1-2]-n[1-2]", ["r1-n1", "r1-n2", "r2-n1", "r2-n2"]),
    ("a[1-2]-ib,b", ["a1-ib", "a2-ib", "b"]),
    ("(null)", []),
    ("", []),
])
def test_expand_hostlist(nodelist, names):
    assert expand_hostlist(nodelist) == names


@pytest.mark.parametrize("bad", ["n[1-", "n1]", "n[a-b]", "n[3-1]"])
def test_expand_hostlist_rejects_malformed(bad):
    with pytest.raises(ValueError):
        expand_hostlist(bad)


def test_signal_name():
    import signal
    assert signal_name(signal.SIGUSR1) == "USR1"
    assert signal_name(int(signal.SIGTERM)) == "TERM"
    assert signal_name("sigusr2") == "USR2"
    assert signal_name("KILL") == "KILL"
    with pytest.raises(ValueError):
        signal_name("USR1; rm -rf /")


def test_parse_record_keeps_spaces_and_equals_inside_free_text():
    rec = parse_scontrol_record(RECORD_2205)
    assert rec["JobName"] == "train run=3"
    assert rec["Comment"] == "rslurm held: no progress Restarts=3 x=y"
    assert rec["AdminComment"] == "admin note x"
    assert rec["Command"] == "/work/run job.sh --lr=0.1"
    assert rec["Restarts"] == "2"  # the earlier, real field; not the word inside Comment
    assert rec["TRES"] == "cpu=4,node=2,billing=4"
    assert rec["AllocNode:Sid"] == "localhost:4849"
    assert rec["Power"] == ""
    assert rec["StdOut"] == "/tmp/o"


def test_parse_record_accepts_unknown_keys_after_plain_fields():
    rec = parse_scontrol_record("JobId=5 NewField2030=a JobState=RUNNING Comment=x NotAKey=1 StdIn=/dev/null")
    assert rec == {"JobId": "5", "NewField2030": "a", "JobState": "RUNNING", "Comment": "x NotAKey=1",
                   "StdIn": "/dev/null"}


def test_job_info_from_record():
    info = job_info_from_record(parse_scontrol_record(RECORD_2205))
    assert (info.job_id, info.name, info.state) == (2, "train run=3", "PENDING")
    assert info.reason == "job_requeued_in_held_state" and info.held and not info.finished
    assert (info.restarts, info.requeue, info.priority) == (2, True, 0)
    assert info.time_limit == 86400
    assert info.start_time == datetime(2026, 11, 22, 3, 45, 17, tzinfo=timezone.utc)
    assert info.preempt_time == datetime(2026, 11, 22, 3, 46, 0, tzinfo=timezone.utc)
    assert info.nodes == ("n1", "n2") and info.node_list == "n[1-2]" and info.batch_host == "n1"
    assert (info.exit_code, info.exit_signal) == (0, 15)
    assert info.comment == "rslurm held: no progress Restarts=3 x=y"
    assert info.partition == "low" and info.array_job_id is None
    assert info.raw["Scheduler"] == "Backfill"


@pytest.mark.parametrize("stderr,cls", [
    ("slurm_load_jobs error: Invalid job id specified", SlurmJobNotFoundError),
    ("scancel: error: Kill job error on job id 9: Invalid job id specified", SlurmJobNotFoundError),
    ("Job has already finished for job 5", SlurmJobStateError),
    ("Job is pending execution for job 1", SlurmJobStateError),
    ("Requested operation is presently disabled for job 4", SlurmJobStateError),
    ("scancel: error: Kill job error on job id 1: Access/permission denied", PermanentSlurmError),
    ("sbatch: unrecognized option '--bogus'", PermanentSlurmError),
    ("Unknown job signal: FOO", PermanentSlurmError),
    ("Partition nope not found", PermanentSlurmError),
    ("something nobody has seen before", PermanentSlurmError),
    ("slurm_load_jobs error: Unable to contact slurm controller (connect failure)", SlurmUnreachableError),
    ("sbatch: error: Batch job submission failed: Connection refused", SlurmUnreachableError),
    ("slurm_load_jobs error: Socket timed out on send/recv operation", TransientSlurmError),
    ("slurm_receive_msg: Zero Bytes were transmitted or received", TransientSlurmError),
    ("Unexpected message received for job 2", TransientSlurmError),  # scontrol requeue, controller down
    ("scancel: error: Kill job error on job id 1: Job can not be altered now, try again later",
     TransientSlurmError),
    ("sbatch: error: Resource temporarily unavailable", TransientSlurmError),
])
def test_classify_failure(stderr, cls):
    err = classify_failure(["scontrol", "show", "job", "9"], 1, stderr)
    assert type(err) is cls
    assert "`scontrol show job 9`" in str(err) and "exit code 1" in str(err) and stderr in str(err)
    assert err.command == ("scontrol", "show", "job", "9") and err.returncode == 1 and err.stderr == stderr


def test_pyslurm_backend_imports_without_pyslurm():
    from resilient_slurm.slurm import pyslurm_backend

    if pyslurm_backend.PYSLURM_AVAILABLE:
        pytest.skip("pyslurm is installed here")
    assert isinstance(pyslurm_backend.PYSLURM_IMPORT_ERROR, ImportError)
    with pytest.raises(PermanentSlurmError, match="needs pyslurm.*CliSlurmClient"):
        pyslurm_backend.PyslurmSlurmClient()
    with pytest.raises(PermanentSlurmError, match="needs pyslurm"):
        slurm_client("pyslurm")


def test_slurm_client_factory():
    assert isinstance(slurm_client("cli", timeout=3.0), CliSlurmClient)
    with pytest.raises(ConfigError, match="valid: cli, pyslurm"):
        slurm_client("slurmrestd")


def test_client_argument_validation(tmp_path):
    with pytest.raises(ValueError):
        CliSlurmClient(timeout=0)
    with pytest.raises(ValueError):
        CliSlurmClient(retries=-1)
    c = CliSlurmClient()
    with pytest.raises(ValueError, match="must start with '#!'"):
        c.submit("echo hi\n")
    with pytest.raises(ValueError):
        c.signal(1, "USR1", batch=True, full=True)
    with pytest.raises(ValueError):
        c.signal(1, "USR1", step=0, batch=True)


# ============================================================================== 2. fake executables
class FakeBin:
    """A directory of fake Slurm tools placed first on PATH; each records its calls in ``state``."""

    def __init__(self, root: Path) -> None:
        self.bin = root / "bin"
        self.state = root / "state"
        self.bin.mkdir()
        self.state.mkdir()
        self.env = {**os.environ, "PATH": f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}"}

    def tool(self, name: str, body: str) -> None:
        """Write ``name`` as a bash script: it counts its calls, logs argv and stdin, then runs ``body``
        (with $n = this call's number, 1-based)."""
        s = self.state
        path = self.bin / name
        path.write_text(
            "#!/bin/bash\n"
            f'n=$(( $(cat {s}/{name}.count 2>/dev/null || echo 0) + 1 )); echo $n > {s}/{name}.count\n'
            f'echo "$*" >> {s}/{name}.argv\n'
            f'if [ ! -t 0 ]; then cat > {s}/{name}.stdin.$n; fi\n'
            + body)
        path.chmod(0o755)

    def count(self, name: str) -> int:
        f = self.state / f"{name}.count"
        return int(f.read_text()) if f.exists() else 0

    def argv(self, name: str) -> list[str]:
        return (self.state / f"{name}.argv").read_text().splitlines()

    def client(self, **kw: object) -> tuple[CliSlurmClient, list[float]]:
        """A client on this PATH whose retry waits are recorded instead of slept."""
        slept: list[float] = []
        kw.setdefault("timeout", 5.0)
        return CliSlurmClient(env=self.env, sleep=slept.append, **kw), slept  # type: ignore[arg-type]


@pytest.fixture
def fake(tmp_path: Path) -> FakeBin:
    return FakeBin(tmp_path)


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].startswith("Z")
    except (OSError, IndexError):
        return True


@pytest.mark.proc
def test_hanging_scontrol_is_killed_retried_then_transient(fake: FakeBin):
    """A scontrol that never answers (here a wrapper whose child keeps the output pipes open) is killed
    with its whole process group at the timeout, retried, and ends in SlurmTimeoutError."""
    fake.tool("scontrol", f"echo $$ >> {fake.state}/pids\nsleep 30 &\necho $! >> {fake.state}/pids\nwait\n")
    client, slept = fake.client(timeout=0.5, retries=2)
    with pytest.raises(SlurmTimeoutError) as ei:
        client.job_info(7)
    err = ei.value
    assert isinstance(err, TransientError)
    assert fake.count("scontrol") == 3 and err.attempts == 3 and len(slept) == 2
    assert "scontrol show job -o 7" in str(err) and "0.5s" in str(err) and "after 3 attempts" in str(err)
    pids = [int(p) for p in (fake.state / "pids").read_text().split()]
    assert len(pids) == 6
    deadline = time.monotonic() + 10
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(_gone(p) for p in pids), "the hung command or its child survived the timeout"


@pytest.mark.proc
def test_socket_timeout_twice_then_success(fake: FakeBin):
    (fake.state / "record").write_text(RECORD_2205 + "\n")
    fake.tool("scontrol", 'if [ $n -le 2 ]; then\n'
                          '  echo "slurm_load_jobs error: Socket timed out on send/recv operation" >&2; exit 1\n'
                          f'fi\ncat {fake.state}/record\n')
    client, slept = fake.client(retries=3)
    info = client.job_info(2)
    assert info.job_id == 2 and info.restarts == 2 and info.comment.startswith("rslurm held")
    assert fake.count("scontrol") == 3 and len(slept) == 2
    assert fake.argv("scontrol") == ["show job -o 2"] * 3


@pytest.mark.proc
def test_invalid_job_id_is_not_retried(fake: FakeBin):
    fake.tool("scontrol", 'echo "slurm_load_jobs error: Invalid job id specified" >&2\nexit 1\n')
    client, slept = fake.client(retries=5)
    with pytest.raises(SlurmJobNotFoundError) as ei:
        client.job_info(99)
    assert fake.count("scontrol") == 1 and slept == [] and ei.value.attempts == 1
    msg = str(ei.value)
    assert "`scontrol show job -o 99`" in msg and "exit code 1" in msg and "Invalid job id specified" in msg


@pytest.mark.proc
def test_permission_denied_is_not_retried(fake: FakeBin):
    fake.tool("scancel", 'echo "scancel: error: Kill job error on job id 5: Access/permission denied" >&2\n'
                         'exit 1\n')
    client, slept = fake.client(retries=5)
    with pytest.raises(PermanentSlurmError, match="permission denied"):
        client.signal(5, "USR1", batch=True)
    assert fake.count("scancel") == 1 and slept == []
    assert fake.argv("scancel") == ["--signal=USR1 --batch 5"]


@pytest.mark.proc
def test_retries_are_bounded_with_exponential_jittered_waits(fake: FakeBin):
    fake.tool("scontrol", 'echo "slurm_load_jobs error: Unable to contact slurm controller (connect failure)" >&2\n'
                          'exit 1\n')
    client, slept = fake.client(retries=4)  # default wait: 0.5 s doubling (max 8 s) + 0..0.5 s jitter
    with pytest.raises(SlurmUnreachableError) as ei:
        client.job_info(1)
    assert fake.count("scontrol") == 5 and ei.value.attempts == 5
    assert len(slept) == 4
    for i, s in enumerate(slept):
        assert 0.5 * 2**i <= s <= 0.5 * 2**i + 0.5, slept


@pytest.mark.proc
def test_total_timeout_bounds_retries_of_a_hung_command(fake: FakeBin):
    fake.tool("scontrol", "exec sleep 30\n")
    client, _ = fake.client(timeout=0.3, retries=50, wait=wait_none(), total_timeout=0.5)
    with pytest.raises(SlurmTimeoutError) as ei:
        client.config_value("KillWait")
    assert 1 <= ei.value.attempts <= 2


@pytest.mark.proc
def test_requeue_retry_after_timeout_accepts_that_it_took_effect(fake: FakeBin):
    """First requeue hangs (the controller acted but the reply was lost); the retry is told the job is
    already pending: that means done, not an error."""
    fake.tool("scontrol", 'if [ $n -eq 1 ]; then exec sleep 30; fi\n'
                          'echo "Job is pending execution for job 5" >&2\nexit 1\n')
    client, _ = fake.client(timeout=0.5, retries=2)
    client.requeue(5)
    assert fake.count("scontrol") == 2
    assert fake.argv("scontrol") == ["requeue Incomplete 5"] * 2
    # On a first attempt the same message is an error: someone else requeued the job.
    fake.tool("scontrol", 'echo "Job is pending execution for job 5" >&2\nexit 1\n')
    (fake.state / "scontrol.count").unlink()
    with pytest.raises(SlurmJobStateError):
        client.requeue(5)


@pytest.mark.proc
def test_submit_is_retried_only_when_the_request_cannot_have_arrived(fake: FakeBin):
    fake.tool("sbatch", 'if [ $n -eq 1 ]; then echo "sbatch: error: Batch job submission failed: '
                        'Unable to contact slurm controller (connect failure)" >&2; exit 1; fi\n'
                        'echo "4242;cluster"\n')
    client, slept = fake.client(retries=3)
    script = "#!/bin/bash\necho 'hi there'\n"
    assert client.submit(script, ["-p", "low", "-J", "two words"]) == 4242
    assert fake.count("sbatch") == 2 and len(slept) == 1
    assert fake.argv("sbatch")[-1] == "--parsable -p low -J two words"
    assert (fake.state / "sbatch.stdin.2").read_text() == script

    # A socket timeout is ambiguous (the job may have been queued): raised at once, not resubmitted.
    fake.tool("sbatch", 'echo "sbatch: error: Batch job submission failed: Socket timed out on send/recv '
                        'operation" >&2\nexit 1\n')
    (fake.state / "sbatch.count").unlink()
    with pytest.raises(TransientSlurmError, match="Socket timed out"):
        client.submit(Path("/tmp/job.sh"))
    assert fake.count("sbatch") == 1
    assert fake.argv("sbatch")[-1] == "--parsable /tmp/job.sh"


@pytest.mark.proc
def test_submit_timeout_says_the_job_may_exist(fake: FakeBin):
    fake.tool("sbatch", "exec sleep 30\n")
    client, _ = fake.client(timeout=0.3, retries=3)
    with pytest.raises(SlurmTimeoutError, match="may have reached the controller.*squeue"):
        client.submit(Path("/tmp/job.sh"))
    assert fake.count("sbatch") == 1


@pytest.mark.proc
def test_missing_slurm_tools_is_a_clear_permanent_error(tmp_path: Path):
    client = CliSlurmClient(env={"PATH": str(tmp_path)}, sleep=lambda s: None)
    with pytest.raises(PermanentSlurmError, match="scontrol not found on PATH"):
        client.job_info(1)


@pytest.mark.proc
def test_requeue_hold_sets_comment_before_holding(fake: FakeBin):
    fake.tool("scontrol", "exit 0\n")
    client, _ = fake.client()
    client.requeue_hold(12, "no progress past step 40\nafter 3 restarts")
    assert fake.argv("scontrol") == [
        "update JobId=12 Comment=rslurm held: no progress past step 40 after 3 restarts",
        "requeuehold Incomplete 12",
    ]


# ============================================================================== 1. real Slurm cluster
@pytest.fixture
def client(slurm: SlurmCluster) -> CliSlurmClient:
    return CliSlurmClient(env=slurm.env())


def _wait_job(client: CliSlurmClient, job: int, ok: Callable[[JobInfo], bool], what: str,
              cluster: SlurmCluster, timeout: float = 60) -> JobInfo:
    deadline = time.monotonic() + timeout
    while True:
        info = client.job_info(job)
        if ok(info):
            return info
        if time.monotonic() > deadline:
            pytest.fail(f"job {job}: not {what} after {timeout}s: {info}\n{cluster.logs_tail()}")
        time.sleep(0.1)


# The batch shell logs its start (with the restart count) and the signals it gets; USR2 ends it (exit 0).
# `sleep & wait` keeps the shell responsive: bash runs traps only between foreground commands.
LOOP_SCRIPT = """\
#!/bin/bash
m={marks}/marks
trap 'echo "USR1 $SLURM_JOB_ID" >> $m' USR1
trap 'echo "USR2 $SLURM_JOB_ID" >> $m; exit 0' USR2
echo "start ${{SLURM_RESTART_COUNT:-0}} $SLURMD_NODENAME" >> $m
while true; do sleep 0.1 & wait $!; done
"""


def _marks(slurm: SlurmCluster, name: str) -> Path:
    d = slurm.work_dir / name
    d.mkdir()
    return d


@pytest.mark.proc
def test_job_info_signal_and_completion(slurm: SlurmCluster, client: CliSlurmClient):
    """job_info of a running 2-node job; a signal reaches the batch shell only with batch=True; the
    job then exits 0 and is reported COMPLETED."""
    d = _marks(slurm, "info")
    t_submit = time.time()
    job = client.submit(LOOP_SCRIPT.format(marks=d),
                        ["-N2", "--exclusive", "--time=1", "-J", "rs client", "-o", str(d / "out")])
    info = _wait_job(client, job, lambda i: i.state == "RUNNING", "RUNNING", slurm)
    wait_for_text(d / "marks", "start 0", slurm)
    assert info.job_id == job and info.name == "rs client"
    assert info.nodes == ("n1", "n2") and info.node_list == "n[1-2]" and info.batch_host in info.nodes
    assert info.partition == "low" and info.time_limit == 60
    assert info.restarts == 0 and info.requeue and not info.held and not info.finished
    assert info.preempt_time is None and info.reason is None
    # Times are parsed as UTC from a TZ=UTC scontrol: they match this clock (to the second).
    assert info.start_time is not None and info.end_time is not None
    assert t_submit - 2 <= info.start_time.timestamp() <= time.time() + 1
    assert info.end_time - info.start_time == timedelta(seconds=60)
    assert 0 < remaining_seconds(info, time.time()) <= 60

    # Without batch=True the signal goes to the job's steps only (there are none): the shell sees nothing.
    client.signal(job, "USR1")
    time.sleep(1.0)
    assert "USR1" not in (d / "marks").read_text()
    client.signal(job, "USR1", batch=True)
    wait_for_text(d / "marks", f"USR1 {job}", slurm, timeout=10)
    client.signal(job, "USR2", batch=True)
    info = _wait_job(client, job, lambda i: i.finished, "finished", slurm)
    assert info.state == "COMPLETED" and (info.exit_code, info.exit_signal) == (0, 0)


@pytest.mark.proc
def test_requeue_running_job_runs_again(slurm: SlurmCluster, client: CliSlurmClient):
    d = _marks(slurm, "requeue")
    job = client.submit(LOOP_SCRIPT.format(marks=d), ["--requeue", "-N1", "--time=1", "-o", str(d / "out")])
    _wait_job(client, job, lambda i: i.state == "RUNNING", "RUNNING", slurm)
    wait_for_text(d / "marks", "start 0", slurm)
    client.requeue(job)
    info = client.job_info(job)
    assert info.restarts == 1 and info.state in ("PENDING", "REQUEUED", "COMPLETING"), info
    assert not info.held
    # It starts again once requeue time + cred_expire + 1 s has passed, with SLURM_RESTART_COUNT=1.
    wait_for_text(d / "marks", "start 1", slurm, timeout=slurm.cred_expire + 30)
    info = _wait_job(client, job, lambda i: i.state == "RUNNING", "RUNNING again", slurm)
    assert info.restarts == 1
    client.cancel(job)
    info = _wait_job(client, job, lambda i: i.finished, "finished", slurm)
    assert info.state == "CANCELLED"


@pytest.mark.proc
def test_requeue_hold_keeps_job_held_with_visible_reason(slurm: SlurmCluster, client: CliSlurmClient):
    d = _marks(slurm, "hold")
    job = client.submit(LOOP_SCRIPT.format(marks=d), ["--requeue", "-N1", "--time=1", "-o", str(d / "out")])
    _wait_job(client, job, lambda i: i.state == "RUNNING", "RUNNING", slurm)
    wait_for_text(d / "marks", "start 0", slurm)
    reason = "no progress past step 40 in 3 restarts (Restarts=3); see rslurm status"
    client.requeue_hold(job, reason)
    info = _wait_job(client, job, lambda i: i.state == "PENDING", "PENDING", slurm)
    assert info.held and info.priority == 0 and info.reason == "job_requeued_in_held_state"
    assert info.restarts == 1
    assert info.comment == f"rslurm held: {reason}"
    squeue = slurm.run(["squeue", "-h", "-j", str(job), "-o", "%T|%r|%k"]).stdout.strip()
    assert squeue == f"PENDING|job requeued in held state|rslurm held: {reason}"
    # Still held after the requeue delay (cred_expire + 1 s) that a plain requeue waits.
    time.sleep(slurm.cred_expire + 2)
    info = client.job_info(job)
    assert info.state == "PENDING" and info.held
    assert "start 1" not in (d / "marks").read_text()
    client.cancel(job)
    assert client.job_info(job).state == "CANCELLED"
    client.cancel(job)  # cancelling a finished job is not an error


@pytest.mark.proc
def test_requeue_of_a_finished_job_does_nothing(slurm: SlurmCluster, client: CliSlurmClient):
    """Slurm would requeue (run again) a COMPLETED job; only_incomplete (the default) prevents it."""
    d = _marks(slurm, "finished")
    job = client.submit("#!/bin/bash\ntrue\n", ["-N1", "-o", str(d / "out")])
    _wait_job(client, job, lambda i: i.state == "COMPLETED", "COMPLETED", slurm)
    client.requeue(job)
    client.requeue_hold(job, "should not happen")
    info = client.job_info(job)
    assert info.state == "COMPLETED" and info.restarts == 0 and info.comment is None


@pytest.mark.proc
def test_partition_and_config(slurm: SlurmCluster, client: CliSlurmClient):
    low = client.partition_info("low")
    assert low.name == "low" and low.grace_time == slurm.grace_time and low.preempt_mode == "REQUEUE"
    assert low.nodes == ("n1", "n2") and low.priority_tier == 1 and low.state == "UP"
    assert low.max_time is None and low.default_time is None
    high = client.partition_info("high")
    assert high.grace_time == 0 and high.priority_tier == 10
    with pytest.raises(PermanentSlurmError, match="Partition nope not found"):
        client.partition_info("nope")

    assert client.config_value("KillWait") == f"{slurm.kill_wait} sec"
    assert client.config_value("killwait") == f"{slurm.kill_wait} sec"
    assert client.config_seconds("KillWait") == slurm.kill_wait
    assert client.config_value("PreemptType") == "preempt/partition_prio"
    assert client.config_value("SLURM_VERSION").startswith("22.05")
    with pytest.raises(PermanentSlurmError, match="did you mean KillWait"):
        client.config_value("KilWait")


@pytest.mark.proc
def test_hostnames_match_slurm(client: CliSlurmClient):
    assert client.hostnames("n[1-2]") == ["n1", "n2"]
    assert client.hostnames("") == []
    for nodelist in ("n1", "gpu[01-03,7]", "n[8-10],login", "r[1-2]-n[1-2]", "ib-[1-2]"):
        assert expand_hostlist(nodelist) == client.hostnames(nodelist), nodelist
    # 22.05 prints "Invalid hostlist" on stderr and exits 0 for these; the client raises.
    for bad in ("n[3-1]", "a[1-2]-ib"):
        with pytest.raises(PermanentSlurmError, match="Invalid hostlist"):
            client.hostnames(bad)


@pytest.mark.proc
def test_node_addresses_are_slurms_node_addr(client: CliSlurmClient):
    """One `scontrol show node` for a node list: each node's NodeAddr (the test cluster's names n1, n2 do
    not resolve; their address is 127.0.0.1). A node Slurm does not know is a permanent error."""
    assert client.node_addresses("n[1-2]") == {"n1": "127.0.0.1", "n2": "127.0.0.1"}
    assert client.node_addresses("") == {}
    with pytest.raises(PermanentSlurmError):
        client.node_addresses("no-such-node")


@pytest.mark.proc
def test_real_slurm_errors(slurm: SlurmCluster, client: CliSlurmClient):
    with pytest.raises(SlurmJobNotFoundError) as ei:
        client.job_info(987654)
    assert ei.value.attempts == 1 and ei.value.returncode == 1
    with pytest.raises(SlurmJobNotFoundError):
        client.signal(987654, "USR1")
    client.cancel(987654)  # scancel of an unknown job exits 0 in 22.05
    with pytest.raises(PermanentSlurmError, match="Invalid partition"):
        client.submit("#!/bin/bash\ntrue\n", ["-p", "nope"])
    with pytest.raises(PermanentSlurmError, match="unrecognized option"):
        client.submit("#!/bin/bash\ntrue\n", ["--bogus"])

    d = _marks(slurm, "norequeue")
    job = client.submit(LOOP_SCRIPT.format(marks=d), ["--no-requeue", "-N1", "-o", str(d / "out")])
    _wait_job(client, job, lambda i: i.state == "RUNNING", "RUNNING", slurm)
    assert not client.job_info(job).requeue
    with pytest.raises(SlurmJobStateError, match="presently disabled"):
        client.requeue(job)
    client.cancel(job)


@pytest.mark.proc
def test_unreachable_controller_is_transient(slurm: SlurmCluster, tmp_path: Path):
    """Real client tools pointed at a port nobody listens on: retried, then SlurmUnreachableError.
    scontrol requeue reports the same condition as "Unexpected message received"."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    conf = slurm.conf_path.read_text()
    lines = [f"SlurmctldPort={dead_port}" if ln.startswith("SlurmctldPort=") else
             "MessageTimeout=1" if ln.startswith("MessageTimeout=") else ln for ln in conf.splitlines()]
    bad = tmp_path / "slurm.conf"
    bad.write_text("\n".join(lines) + "\n")
    slept: list[float] = []
    client = CliSlurmClient(env=slurm.env({"SLURM_CONF": str(bad)}), retries=1, sleep=slept.append)
    with pytest.raises(SlurmUnreachableError, match="Unable to contact slurm controller") as ei:
        client.job_info(1)
    assert ei.value.attempts == 2 and len(slept) == 1
    with pytest.raises(TransientSlurmError, match="Unexpected message received") as ei2:
        client.requeue(1)
    assert ei2.value.attempts == 2
