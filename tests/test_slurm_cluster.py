"""Smoke tests for the real Slurm test cluster (tests/slurm_cluster.py): it runs, and it behaves as the
launcher's end-to-end tests assume (two nodes, preemption with grace time and requeue, --signal).

They need Debian's slurm-wlm and munge (``tests/slurm/install.sh``, as root). Without them they are
skipped, or fail when RSLURMTEST_REQUIRE_SLURM=1 (set it in CI where Slurm must be tested).

The fixtures ``slurm_cluster`` (session) and ``slurm`` (per test, starts from an empty queue) live in
tests/conftest.py.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from conftest import wait_for_text
from slurm_cluster import SlurmCluster

pytestmark = pytest.mark.proc  # every test here starts processes (tests/check_tier.py)

# Wall times of the phases, printed at the end of the session (pytest -s, or in the captured output).
TIMINGS: dict[str, float] = {}


@pytest.fixture(scope="module", autouse=True)
def _report_timings():  # type: ignore[no-untyped-def]
    """Print the measured phases once the module is done (visible with -s or in captured output)."""
    yield
    if TIMINGS:
        print("\nslurm smoke timings (s): " + ", ".join(f"{k}={v:.1f}" for k, v in TIMINGS.items()))


def _stamp(text: str, word: str) -> float:
    """The epoch time on the first line ``<word> <time>`` of a marker file."""
    for line in text.splitlines():
        parts = line.split()
        if parts and parts[0] == word:
            return float(parts[-1])
    raise AssertionError(f"no {word!r} line in {text!r}")


def test_cluster_config(slurm: SlurmCluster):
    """The settings the other tests (and the launcher's tests) rely on are in effect."""
    cfg = slurm.run(["scontrol", "show", "config"]).stdout
    assert "cred_expire=5" in cfg and str(slurm.munge_socket) in cfg
    assert "preempt/partition_prio" in cfg and "preempt_send_user_signal" in cfg
    low = slurm.run(["scontrol", "show", "partition", "low", "-o"]).stdout
    high = slurm.run(["scontrol", "show", "partition", "high", "-o"]).stdout
    assert "Default=YES" in low and "PriorityJobFactor=1 PriorityTier=1 " in low
    assert f"GraceTime={slurm.grace_time} " in low and "PreemptMode=REQUEUE" in low
    assert "PriorityTier=10 " in high
    long = slurm.run(["scontrol", "show", "partition", "lowlong", "-o"]).stdout
    assert "Default=NO" in long and "PriorityJobFactor=1 PriorityTier=1 " in long
    assert f"GraceTime={slurm.long_grace_time} " in long and "PreemptMode=REQUEUE" in long
    # sinfo -N prints a node once per partition.
    nodes = set(slurm.run(["sinfo", "-h", "-N", "-o", "%N %c %T"]).stdout.split("\n")) - {""}
    assert sorted(nodes) == ["n1 2 idle", "n2 2 idle"]


def test_two_node_job_runs_on_both_nodes(slurm: SlurmCluster):
    """sbatch -N2 -n2 with srun: one task on n1 and one on n2; the job ends COMPLETED."""
    out = slurm.work_dir / "two_nodes.out"
    t0 = time.time()
    job = slurm.sbatch(
        "#!/bin/bash\n"
        'echo "batch_start $(date +%s.%N)"\n'
        "srun bash -c 'echo task $SLURM_PROCID on $SLURMD_NODENAME'\n",
        "-N2", "-n2", "-o", str(out),
    )
    info = slurm.wait_state(job, "COMPLETED", timeout=60)
    TIMINGS["submit->batch start"] = _stamp(out.read_text(), "batch_start") - t0
    TIMINGS["two-node job total"] = time.time() - t0
    text = out.read_text()
    assert "task 0 on n1" in text and "task 1 on n2" in text, text
    assert info["NodeList"] == "n[1-2]" and info["ExitCode"] == "0:0"


# Step tasks write "start <time>" when they run and "TERM <time>" when SIGTERM arrives, then exit 0.
TASK_SCRIPT = """\
#!/bin/bash
f={marks}/task.$SLURMD_NODENAME.${{SLURM_RESTART_COUNT:-0}}
trap 'echo "TERM $(date +%s.%N)" >> $f; exit 0' TERM
trap 'echo "USR1 $(date +%s.%N)" >> $f' USR1
echo "start $(date +%s.%N)" >> $f
while true; do sleep 0.1; done
"""

# The batch shell of a preemptible job. First run: the step (one task per node) runs until signalled;
# srun runs in the background and the shell waits with `wait`, so the shell's own traps run at once
# (bash defers traps while a foreground command runs). After the step ends the shell keeps the job
# alive, as a training script would while saving, until Slurm ends the grace time. After a requeue
# (SLURM_RESTART_COUNT>=1) it runs a short step on both nodes and exits 0.
LOW_SCRIPT = """\
#!/bin/bash
b={marks}/batch.log
echo "start${{SLURM_RESTART_COUNT:-0}} $(date +%s.%N)" >> $b
trap 'echo "TERM $(date +%s.%N)" >> $b; exit 143' TERM
trap 'echo "USR1 $(date +%s.%N)" >> $b' USR1
if [ "${{SLURM_RESTART_COUNT:-0}}" -ge 1 ]; then
    srun bash -c 'echo rerun on $SLURMD_NODENAME' >> {marks}/rerun.out
    echo "done $(date +%s.%N)" >> $b
    exit 0
fi
srun bash {marks}/task.sh &
wait $!; wait $!
echo "step_end $(date +%s.%N)" >> $b
while true; do sleep 0.1 & wait $!; done
"""

HIGH_SCRIPT = """\
#!/bin/bash
echo "start $(date +%s.%N)" >> {marks}/high.log
srun bash -c 'echo high on $SLURMD_NODENAME' >> {marks}/high.log
echo "done $(date +%s.%N)" >> {marks}/high.log
"""


def _marks(slurm: SlurmCluster, name: str) -> Path:
    marks = slurm.work_dir / name
    marks.mkdir()
    (marks / "task.sh").write_text(TASK_SCRIPT.format(marks=marks))
    return marks


def _start_low(slurm: SlurmCluster, marks: Path, *extra: str) -> int:
    """Submit the preemptible job on both whole nodes and wait until its step runs on n1 and n2."""
    low = slurm.sbatch(LOW_SCRIPT.format(marks=marks), "-p", "low", "--requeue", "-N2", "--exclusive",
                       "-J", "low", "-o", str(marks / "low.out"), *extra)
    slurm.wait_state(low, "RUNNING", timeout=60)
    for n in ("n1", "n2"):
        wait_for_text(marks / f"task.{n}.0", "start", slurm, 30)
    return low


def test_preemption_requeues_low_job_and_it_runs_again(slurm: SlurmCluster):
    """A `high` job preempts a `low --requeue` job on both nodes: the low job's step tasks get SIGTERM
    at once (the batch shell only when GraceTime ends), the low job is requeued (PENDING, Restarts=1),
    the high job runs, and then the low job runs again (SLURM_RESTART_COUNT=1) and completes."""
    marks = _marks(slurm, "preempt")
    low = _start_low(slurm, marks)

    t0 = time.time()
    high = slurm.sbatch(HIGH_SCRIPT.format(marks=marks), "-p", "high", "-N2", "--exclusive", "-J", "high",
                        "-o", str(marks / "high.out"))
    # Step tasks on both nodes get SIGTERM at the start of the grace time.
    term = [_stamp(wait_for_text(marks / f"task.{n}.0", "TERM", slurm, slurm.grace_time + 30), "TERM")
            for n in ("n1", "n2")]
    TIMINGS["preempt->task SIGTERM"] = max(term) - t0
    assert max(term) - t0 < slurm.grace_time, "SIGTERM to the step tasks came after the grace time"

    # Requeued: back to PENDING with Restarts=1 once the grace time is over.
    info = slurm.wait_state(low, {"PENDING", "REQUEUED"}, timeout=slurm.grace_time + slurm.kill_wait + 60)
    TIMINGS["preempt->low requeued"] = time.time() - t0
    assert int(info["Restarts"]) >= 1 and info["Requeue"] == "1", info

    # The batch shell got SIGTERM only when the grace time ended, well after the tasks did.
    batch = (marks / "batch.log").read_text()
    assert "step_end" in batch, batch
    assert _stamp(batch, "TERM") - max(term) > slurm.grace_time / 2, batch

    slurm.wait_state(high, "COMPLETED", timeout=120)
    high_log = (marks / "high.log").read_text()
    assert "high on n1" in high_log and "high on n2" in high_log
    TIMINGS["preempt->high start"] = _stamp(high_log, "start") - t0

    # The low job runs again from the top of its script, on both nodes, and completes.
    info = slurm.wait_state(low, "COMPLETED", timeout=120)
    batch = (marks / "batch.log").read_text()
    TIMINGS["preempt->low restart"] = _stamp(batch, "start1") - t0
    TIMINGS["preempt cycle total"] = time.time() - t0
    assert int(info["Restarts"]) == 1, info
    rerun = (marks / "rerun.out").read_text()
    assert "rerun on n1" in rerun and "rerun on n2" in rerun
    # The restart waited for the high job (it started after the high job finished).
    assert _stamp(batch, "start1") >= _stamp(high_log, "done")


def test_preemption_sends_user_signal_to_batch_shell(slurm: SlurmCluster):
    """With preempt_send_user_signal, a job submitted with --signal=B:USR1@N gets USR1 in its batch shell
    at the start of the grace time, and its step tasks get no signal until the grace time ends."""
    marks = _marks(slurm, "usersig")
    low = _start_low(slurm, marks, "--signal=B:USR1@5")
    t0 = time.time()
    high = slurm.sbatch(HIGH_SCRIPT.format(marks=marks), "-p", "high", "-N2", "--exclusive", "-J", "high",
                        "-o", str(marks / "high.out"))
    batch = wait_for_text(marks / "batch.log", "USR1", slurm, slurm.grace_time + 30)
    usr1 = _stamp(batch, "USR1")
    TIMINGS["preempt->batch USR1"] = usr1 - t0
    assert usr1 - t0 < slurm.grace_time
    # Still inside the grace time: the step tasks have not been signalled.
    time.sleep(1.0)
    for n in ("n1", "n2"):
        text = (marks / f"task.{n}.0").read_text()
        assert "TERM" not in text and "USR1" not in text, (n, text)
    assert slurm.job_info(low)["JobState"] == "RUNNING"
    # Done: cancel both (the fixture waits until the cluster is idle again).
    slurm.scancel(low, high)


def test_signal_before_time_limit_reaches_batch_shell(slurm: SlurmCluster):
    """--time=1 --signal=B:USR1@59: USR1 reaches the batch shell before the time limit.

    slurmctld checks time limits (and so --signal times) only every 30 s, so the signal comes up to
    ~30 s after it is due: @59 with a 1-minute limit (the minimum) makes it arrive 1-31 s after start."""
    marks = slurm.work_dir / "timelimit"
    marks.mkdir()
    t0 = time.time()
    job = slurm.sbatch(
        "#!/bin/bash\n"
        f'echo "start $(date +%s.%N)" >> {marks}/batch.log\n'
        f"trap 'echo \"USR1 $(date +%s.%N)\" >> {marks}/batch.log; exit 0' USR1\n"
        "while true; do sleep 0.1 & wait $!; done\n",
        "--time=1", "--signal=B:USR1@59", "-N1", "-n1", "-o", str(marks / "out"),
    )
    info = slurm.wait_state(job, "COMPLETED", timeout=120)
    log = (marks / "batch.log").read_text()
    start, usr1 = _stamp(log, "start"), _stamp(log, "USR1")
    TIMINGS["job start->USR1 (time limit 60s)"] = usr1 - start
    TIMINGS["signal test total"] = time.time() - t0
    assert usr1 - start < 60, log
    assert info["ExitCode"] == "0:0", info
