"""The launcher end to end on the real two-node Slurm test cluster (tests/slurm_cluster.py).

Every job runs two ranks, one per node (n1, n2), each with its own node-local directory
(``RSLURM_LOCAL_DIR=<work>/nvme/%n``), training ``resilient_slurm.examples.train_toy`` under
``exec rslurm launch -- srun ...`` in the batch script. The ways a job ends, and what must follow:

* time limit (``--signal=B:USR1@<s>``): save, requeue, resume, finish bitwise identical to a run
  never interrupted;
* preemption by a job in the ``high`` partition, both with ``--signal`` (the launcher hears USR1) and
  without (Slurm sends SIGTERM to the ranks themselves): the same, with no step lost beyond the one
  the request arrived at;
* a rank SIGKILLed: restarted in the same allocation (a new srun step), resumed from the last commit;
* a hung collective: found past hang_timeout, every rank's stacks written, restarted in the allocation;
* an exception in the program: FAILED with the rank's exit code, not requeued;
* a checkpoint that kills the program right after every restore: held after K restarts;
* ``scancel``: saved, CANCELLED, never requeued, history ``cancelled``; with ranks that outlast KillWait,
  the end recorded all the same, before the launcher waits for them;
* a cloud termination notice (an AWS-style metadata server on loopback): save, requeue, resume;
* a rendezvous that cannot work (a MASTER_ADDR that does not resolve): ended within the start-up bound,
  with one message naming the address, classed ``startup``, held by the no-progress rule.

Nothing rendezvous-related is set in any job: n1 and n2 are names only Slurm knows (NodeAddr 127.0.0.1), as
on clusters whose node names are not host names; the launcher derives MASTER_ADDR and MASTER_PORT.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import torch
from conftest import REPO, assert_same, clean_env, once, read_jsonl, run_ranks, run_rslurm, wait_for_step
from slurm_cluster import SlurmCluster
from test_cloud_notice import MetadataServer, Seen
from test_telemetry import check_records, read_docs

from resilient_slurm.launcher.processes import parse_task_line

pytestmark = pytest.mark.proc  # every test here starts processes (tests/check_tier.py)

PY = sys.executable
TOY = [PY, "-m", "resilient_slurm.examples.train_toy"]
#: How long a job may take to reach its first steps: the batch script, the launcher, the node health step,
#: srun and two Python processes importing torch; about 8 s on an idle machine, 9-28 s here with the CPUs
#: oversubscribed four times. A generous bound that is not a timing claim: a job that does not get there
#: fails with its state and every process's stacks (_diagnose).
START_TIMEOUT_S = 240


def _toy_args(work: Path, steps: int, sleep: float | str) -> list[str]:
    """``sleep`` may be a shell expression (``"$STEP_SLEEP"``): the job script expands it."""
    return ["--steps", str(steps), "--every-steps", "4", "--workers", "1", "--step-sleep", str(sleep),
            "--log", str(work / "log.%r.jsonl"), "--out", str(work / "out.%r.pt")]


def _script(work: Path, program: list[str], *, extra_env: dict[str, str] | None = None,
            before: str = "", srun: tuple[str, ...] = ("-N2", "-n2")) -> str:
    # Nothing rendezvous-related: the emulated nodes n1 and n2 are names only Slurm knows (NodeAddr
    # 127.0.0.1), as on clusters whose node names are not host names; the launcher derives MASTER_ADDR
    # and MASTER_PORT.
    env = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "RSLURM_LOCAL_DIR": str(work / "nvme" / "%n"),
           "RSLURM_RUN_ID": "toy", "RSLURM_LOG_LEVEL": "INFO",
           # Test clusters that run at the same time (another pytest, a benchmark) may number jobs alike:
           # keep their sockets apart. work = <cluster root>/work/<test>.
           "RSLURM_CONTROL_DIR": str(work.parent.parent / "ctl"), **(extra_env or {})}
    exports = "".join(f"export {k}='{v}'\n" for k, v in env.items())
    cmd = " ".join([PY, "-m", "resilient_slurm.cli", "launch", "--", "srun", *srun, *program])
    return (f"#!/bin/bash\n{exports}"
            f'echo "incarnation ${{SLURM_RESTART_COUNT:-0}} start $(date +%s.%N)" >> {work}/batch.log\n'
            f"{before}"
            # exec: the launcher becomes the batch shell, so `--signal=B:...` reaches it.
            f"exec {cmd}\n")


def _submit(slurm: SlurmCluster, work: Path, script: str, *args: str) -> int:
    return slurm.sbatch(script, "-p", "low", "--requeue", "-N2", "--exclusive", "--open-mode=append",
                        "-o", str(work / "job.out"), *args)


def _reference(steps: int) -> Path:
    """Two ranks of the toy trained ``steps`` steps without a stop: what every run of ``steps`` steps here must
    end as (its checkpoint cadence and step sleep do not enter the training; made once per test process)."""
    def make(ref: Path) -> None:
        run_ranks(["-m", "resilient_slurm.examples.train_toy", *_toy_args(ref, steps, 0.0)], 2, ref,
                  env={"RSLURM_LOCAL_DIR": str(ref / "nvme"), "RSLURM_RUN_ID": "toy"})

    return once(("train_toy reference", 2, steps), make)


def _assert_identical_to(ref: Path, work: Path, steps: int) -> None:
    for r in range(2):
        a = torch.load(ref / f"out.{r}.pt", weights_only=True)
        b = torch.load(work / f"out.{r}.pt", weights_only=True)
        assert_same(a, b, f"rank{r}")
        seen: dict[int, dict] = {}
        for e in read_jsonl(work / f"log.{r}.jsonl"):
            if "loss" in e:
                if e["step"] in seen:  # a step re-done after a resume must repeat itself exactly
                    assert (seen[e["step"]]["batch"], seen[e["step"]]["loss"]) == (e["batch"], e["loss"]), e
                seen[e["step"]] = e
        want = {e["step"]: e for e in read_jsonl(ref / f"log.{r}.jsonl") if "loss" in e}
        assert sorted(seen) == list(range(1, steps + 1)) == sorted(want)
        for s in want:
            assert (seen[s]["batch"], seen[s]["loss"]) == (want[s]["batch"], want[s]["loss"]), f"rank {r} step {s}"


def _events(work: Path, node: str = "n1") -> list[dict]:  # n1: the batch host of a 2-node job
    """The launcher's records in the run's event log on ``node`` (ranks and the daemon write there too)."""
    return [e for e in read_jsonl(work / "nvme" / node / "toy" / "events.jsonl") if e["source"] == "launcher"]


def _history(work: Path, node: str = "n1", *args: str) -> list[dict]:
    """The run's history on the batch host (n1), as `rslurm history --json` shows it."""
    r = subprocess.run([sys.executable, "-m", "resilient_slurm.cli", "history", "--local-dir", str(work / "nvme" / node),
                        "--run-id", "toy", "--json", *args], env=clean_env(), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    [run] = json.loads(r.stdout)["runs"]
    return run["ends"]


def _job_text(work: Path) -> str:
    p = work / "job.out"
    return p.read_text(errors="replace") if p.exists() else ""


def _starts(work: Path) -> list[dict]:
    return [e for e in read_jsonl(work / "log.0.jsonl") if e.get("event") == "start"]


def _exits(work: Path) -> list[dict]:
    return [e for e in read_jsonl(work / "log.0.jsonl") if e.get("event") == "exit"]


def _diagnose(slurm: SlurmCluster, job: int, work: Path) -> str:
    """For a test that waited on ``job`` in vain: its state, its processes' stacks, what it printed."""
    return f"{slurm.diagnose(job)}\n--- {work / 'job.out'} ---\n{_job_text(work)[-6000:]}"


def _wait_started(slurm: SlurmCluster, job: int, work: Path, log: Path, step: int) -> None:
    """Wait until ``job``'s step log shows ``step`` (at most START_TIMEOUT_S; then fail with _diagnose)."""
    wait_for_step(log, step, timeout=START_TIMEOUT_S, diagnose=lambda: _diagnose(slurm, job, work))


def _wait_done(slurm: SlurmCluster, job: int, work: Path, timeout: float) -> dict[str, str]:
    try:
        return slurm.wait_state(job, "COMPLETED", timeout=timeout)
    except BaseException:
        print(_diagnose(slurm, job, work))
        raise


@pytest.mark.parametrize(("user_signal", "socket"), [(True, True), (True, False), (False, True)],
                         ids=["signal-to-launcher", "scancel-signal-only", "sigterm-to-ranks"])
def test_preemption_saves_requeues_and_resumes_bitwise(slurm: SlurmCluster, user_signal: bool,
                                                       socket: bool):
    """A `high` job preempts the training job. With ``--signal=B:USR1@5`` the launcher hears USR1 and asks
    the ranks (over the control socket, and with ``scancel --signal=USR2`` for other nodes; with the socket
    off, the signal alone must do); without ``--signal`` Slurm sends SIGTERM to the ranks themselves.
    Either way the ranks commit an emergency checkpoint at the step they were at, the job is requeued,
    waits for the high job, resumes from exactly that step and ends bitwise identical to an
    uninterrupted run."""
    steps = 60
    work = slurm.work_dir / f"launch-preempt-{'usr1' if user_signal else 'term'}-{'sock' if socket else 'nosock'}"
    work.mkdir()
    ref = _reference(steps)
    env = {} if socket else {"RSLURM_CONTROL_SOCKET": "off"}
    job = _submit(slurm, work, _script(work, [*TOY, *_toy_args(work, steps, 0.15)], extra_env=env),
                  *(["--signal=B:USR1@5"] if user_signal else []))
    _wait_started(slurm, job, work, work / "log.0.jsonl", 8)
    t0 = time.time()
    high = slurm.high_job(work)
    slurm.wait_state(high, "COMPLETED", timeout=120)
    info = _wait_done(slurm, job, work, timeout=180)
    assert int(info["Restarts"]) == 1, info
    starts, exits = _starts(work), _exits(work)
    assert len(starts) == 2 and len(exits) == 2, (starts, exits, _job_text(work)[-3000:])
    # The first incarnation stopped on the emergency checkpoint; the second resumed from that very step.
    assert exits[0]["stopped"] is True and starts[1]["step"] == exits[0]["step"] > 8, (starts, exits)
    events = _events(work)
    decision = [e for e in events if e["event"] == "decision"]
    assert decision and decision[0]["action"] == "requeue" and decision[0]["outcome"] == "preempted", decision
    if user_signal:
        sig = [e for e in events if e["event"] == "signal"]
        assert sig and sig[0]["signal"] == "SIGUSR1", events
    if user_signal and socket:
        committed = [e for e in events if e["event"] == "committed"]
        assert committed and committed[0]["after_signal_s"] < 5, events
    ends = _history(work)
    assert [(e["reason"], e["action"]) for e in ends] == [("preempted", "requeue"), ("completed", "exit")], ends
    assert ends[0]["job_id"] == ends[1]["job_id"] == str(job) and ends[0]["committed_step"] == exits[0]["step"], ends
    if user_signal:  # the launcher heard the signal, and scontrol showed the job's PreemptTime
        assert ends[0]["evidence"].startswith("SIGUSR1 at ") and "PreemptTime" in ends[0]["evidence"], ends
    else:
        assert "emergency checkpoint on a signal from Slurm" in ends[0]["evidence"], ends
    print(f"preemption cycle: {time.time() - t0:.1f} s")
    _assert_identical_to(ref, work, steps)


def test_time_limit_saves_requeues_and_resumes_bitwise(slurm: SlurmCluster):
    """``--time=2 --signal=B:USR1@50``: USR1 reaches the launcher when slurmctld's periodic time-limit check
    (every 30 s, later on a loaded machine) first runs within 60 s of the 50 s mark (sbatch(1)), so 10 to 70 s
    after the start: not in the first second, where it reached the batch shell before `exec rslurm launch`
    and Slurm ended the job as a launch failure (seen in CI with ``--time=1``); the ranks save, the job requeues itself before the
    limit, and the requeued incarnation (given a longer limit by the test, as a user would with a real time
    budget) finishes bitwise identical to an uninterrupted run. Until the ranks have stopped once, the job
    trains 0.5 s per step (450 s for the whole run), so it cannot finish before a late check; afterwards
    it trains at 0.02 s per step and gets 5 minutes. The step time does not enter the training, so the
    reference is the same. The switch is the ranks' own "stopped" record, not SLURM_RESTART_COUNT: when the
    first check runs within seconds of the start, USR1 reaches the ranks while they still import torch and
    that incarnation ends (and is requeued) before training anything (seen in CI)."""
    steps = 900
    work = slurm.work_dir / "launch-timelimit"
    work.mkdir()
    ref = _reference(steps)
    # After the first stop the job gets 5 minutes: the test needs exactly one time-limit stop of trained ranks.
    before = (f"STEP_SLEEP=0.5\nif grep -qs '\"stopped\": true' {work}/log.0.jsonl; then STEP_SLEEP=0.02; "
              "scontrol update JobId=$SLURM_JOB_ID TimeLimit=5; fi\n")
    job = _submit(slurm, work, _script(work, [*TOY, *_toy_args(work, steps, "$STEP_SLEEP")], before=before),
                  "--time=2", "--signal=B:USR1@50")
    info = _wait_done(slurm, job, work, timeout=300)
    starts, exits = _starts(work), _exits(work)
    diagnosis = (info, starts, exits, (work / "batch.log").read_text(), _job_text(work)[-6000:])
    assert int(info["Restarts"]) >= 1, diagnosis
    stopped = [e for e in exits if e["stopped"]]
    assert len(stopped) == 1 and starts[-1]["step"] == stopped[0]["step"] > 0, diagnosis
    assert exits[-1] == {"event": "exit", "step": steps, "stopped": False}, diagnosis
    decision = [e for e in _events(work) if e["event"] == "decision"]
    requeues = [d for d in decision if d["action"] == "requeue"]
    assert requeues and all(d["outcome"] == "time_limit" for d in requeues), decision
    assert decision[-1]["outcome"] == "completed" and len(decision) == len(requeues) + 1, decision
    _assert_identical_to(ref, work, steps)


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:  # gone
        return []


def test_a_stop_while_ranks_start_waits_for_them_instead_of_killing_them(slurm: SlurmCluster):
    """A stop that reaches the launcher while the ranks are still starting (seen on the test cluster: the
    first time-limit check seconds after a requeued job started): the save signal would kill a process
    that has not trapped it yet. The launcher holds it back until a rank registers (a rank registers
    only after a collective that every rank enters with its traps installed), so the ranks start,
    restore, take the emergency checkpoint at their first step and stop; none dies by a signal. Here
    each task sleeps 8 s in a shell before python starts, and USR1 reaches the launcher 2 s in.

    The save signal, once sent, can reach the ranks after they saved and closed their Checkpointer
    (scancel goes through slurmctld and slurmd: seconds on a busy node); it must not kill them then either.
    term_grace is raised to 60 s here: what is tested is that the stop is saved and that no signal ends a
    rank, not how fast a rank exits after its commit (10 s at a load of 20 on two cores, past the default
    term_grace, after which the launcher tears the ranks down as documented)."""
    work = slurm.work_dir / "launch-stop-while-starting"
    work.mkdir()
    program = ["bash", "-c", "'sleep 8; exec \"$@\"'", "task", *TOY, *_toy_args(work, 30, 0.05)]
    job = _submit(slurm, work, _script(work, program, extra_env={"RSLURM_TERM_GRACE": "60"}))
    deadline = time.monotonic() + 60
    # The tasks are in their shell's sleep: srun started them (the launcher's `start` event comes before its
    # set-up, and a stop then would not start the ranks at all, seen once in CI on a loaded machine).
    while not any(_cmdline(pid) == ["sleep", "8"] for pid in slurm.job_pids(job)):
        assert time.monotonic() < deadline, _job_text(work)[-3000:]
        time.sleep(0.2)
    time.sleep(2)
    slurm.scancel("--batch", "--signal=USR1", job)
    info = _wait_done(slurm, job, work, timeout=240)
    events = _events(work)
    diagnosis = "\n".join(map(str, events)) + _job_text(work)[-5000:]
    first = [e for e in events if e.get("restart_count", 0) == 0]
    kinds = [e["event"] for e in first]
    assert "save_signal_deferred" in kinds, diagnosis
    # Sent once a rank registers, or withheld: the held-back signal is looked at every 0.5 s
    # (StopControl.send_deferred_signal), and ranks that registered, took the requested save over the socket
    # and their first step's collective, committed it and said goodbye between two looks never needed it
    # (seen once in CI on a loaded machine). Either way the log says which, once.
    fate = [k for k in kinds if k in ("save_signal_sent", "save_signal_withheld")]
    assert len(fate) == 1, diagnosis
    assert kinds.index("save_signal_deferred") < kinds.index(fate[0]), diagnosis
    if fate == ["save_signal_withheld"]:
        withheld = next(e for e in first if e["event"] == "save_signal_withheld")
        assert withheld["reason"] in ("committed", "ranks_exited"), withheld  # two nodes: the socket is not enough
        assert "committed" in kinds, diagnosis
    deferred = next(e for e in first if e["event"] == "save_signal_deferred")
    assert set(deferred) == {"t", "event", "source", "node", "run_id", "job_id", "restart_count", "signal"}, deferred
    assert deferred["signal"] == "SIGUSR2", deferred  # docs/telemetry.md's fields, the default save signal
    decision = [e for e in first if e["event"] == "decision"]
    assert decision and decision[0]["action"] == "requeue", diagnosis
    exits = _exits(work)
    assert exits[0]["stopped"] is True and exits[0]["step"] >= 1, (exits, diagnosis)  # saved, not killed
    assert "killed by signal" not in _job_text(work), diagnosis
    # srun names each task a signal ended ("srun: error: n1: task 0: User defined signal 2", "...: Killed")
    assert not [e for line in _job_text(work).splitlines() for e in parse_task_line(line) if e.signal], diagnosis
    assert not [e for e in first if e["event"] == "deadline_missed"], diagnosis
    assert int(info["Restarts"]) == 1 and exits[-1] == {"event": "exit", "step": 30, "stopped": False}, diagnosis


def test_rank_sigkill_restarts_in_job_and_resumes_from_last_commit(slurm: SlurmCluster):
    """Rank 1 (on n2) is SIGKILLed mid-run, as the OOM killer or a dying node would: srun reports the task
    killed, the launcher classifies it killed by a signal and, without giving the allocation back, starts a new
    srun step that resumes from the last committed step; the job completes with no requeue and still
    ends bitwise identical."""
    steps = 60
    work = slurm.work_dir / "launch-sigkill"
    work.mkdir()
    ref = _reference(steps)
    job = _submit(slurm, work, _script(work, [*TOY, *_toy_args(work, steps, 0.1)]))
    _wait_started(slurm, job, work, work / "log.1.jsonl", 14)
    pid = [e for e in read_jsonl(work / "log.1.jsonl") if e.get("event") == "start"][0]["pid"]
    os.kill(pid, signal.SIGKILL)
    info = _wait_done(slurm, job, work, timeout=180)
    events = _events(work)
    assert int(info["Restarts"]) == 0, (info, events)
    [restart] = [e for e in events if e["event"] == "in_job_restart"]
    assert restart["outcome"] == "killed_by_signal" and restart["attempt"] == 1, restart
    # srun's task line names the rank, its node and the signal
    assert restart["evidence"].startswith("rank 1 on n") and restart["evidence"].endswith("killed by SIGKILL"), restart
    ends = _history(work)
    assert [(e["kind"], e["reason"]) for e in ends] == [("in_job_restart", "killed_by_signal"),
                                                        ("incarnation", "completed")], ends
    decision = [e for e in events if e["event"] == "decision"]
    assert [d["outcome"] for d in decision] == ["completed"], decision
    starts = _starts(work)
    assert len(starts) == 2 and starts[1]["step"] == restart["committed_step"], (starts, restart)
    assert starts[1]["step"] > 0 and starts[1]["step"] % 4 == 0, starts  # an interval checkpoint
    _assert_identical_to(ref, work, steps)


def test_a_node_that_lost_its_checkpoints_restores_from_its_partner_not_the_durable_tier(
        slurm: SlurmCluster, tmp_path: Path):
    """Peer replicas on the cluster: each node's leader keeps the other node's newest step (sent over the
    job's gloo connections after each save). Rank 1 (on n2) is SIGKILLed and n2's checkpoints are wiped,
    as when a node's NVMe is lost with it; the launcher restarts the job in its allocation, and n2 takes
    the step from n1's replica: 0 bytes from the durable tier (which holds it too), bitwise identical."""
    steps, every = 60, 20
    work = slurm.work_dir / "launch-peer-replica"
    work.mkdir()
    ref = _reference(steps)
    args = _toy_args(work, steps, 0.1)
    args[args.index("--every-steps") + 1] = str(every)
    job = _submit(slurm, work, _script(work, [*TOY, *args], extra_env={"RSLURM_DURABLE": str(work / "lustre")}))
    n1_events = work / "nvme" / "n1" / "toy" / "events.jsonl"

    def replicated() -> list[int]:
        return [e["received_step"] for e in read_jsonl(n1_events) if e.get("event") == "peer_replica"
                and e.get("received_step")] if n1_events.exists() else []

    deadline = time.monotonic() + 120
    while not replicated() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert replicated(), f"nothing replicated: {_job_text(work)[-3000:]}"
    step = replicated()[-1]  # the next save is `every` steps (2 s) away: n2 loses nothing newer than this
    pid = [e for e in read_jsonl(work / "log.1.jsonl") if e.get("event") == "start"][0]["pid"]
    os.kill(pid, signal.SIGKILL)
    for d in (work / "nvme" / "n2" / "toy").glob("step_*"):
        subprocess.run(["rm", "-rf", str(d)], check=False)
    info = _wait_done(slurm, job, work, timeout=180)
    (tmp_path / "job.out").write_text(_job_text(work))
    assert int(info["Restarts"]) == 0, info
    starts = _starts(work)
    assert len(starts) == 2, (starts, _job_text(work)[-4000:])
    restores = [e for e in read_jsonl(work / "nvme" / "n2" / "toy" / "events.jsonl") if e.get("event") == "restore"]
    assert restores[-1]["step"] == starts[1]["step"] == step, (restores, starts, step)
    assert restores[-1]["tier"] == "peer" and restores[-1]["fetched_bytes"] == 0, restores[-1]
    assert restores[-1]["peer_bytes"] > 0, restores[-1]
    _assert_identical_to(ref, work, steps)


def test_a_hung_collective_is_found_and_restarted_in_job(slurm: SlurmCluster, tmp_path: Path):
    """Rank 1 (on n2) stops after step 5; rank 0 (on n1, the launcher's node) then waits in step 6's
    all_reduce. The launcher finds rank 0 idle past hang_timeout, has every rank write its stacks (rank 1
    through `scancel --signal`, into n2's own run directory), tears the step down and starts a new srun
    step in the same allocation, which resumes from step 4 and finishes bitwise identical."""
    worker = [PY, str(REPO / "tests" / "workers" / "hang_worker.py")]
    ref = tmp_path / "ref"
    (ref / "out").mkdir(parents=True)
    run_ranks([str(REPO / "tests" / "workers" / "hang_worker.py"), "--steps", "12", "--out", str(ref / "out")], 2,
              ref, env={"RSLURM_LOCAL_DIR": str(ref / "nvme"), "RSLURM_RUN_ID": "toy"})
    work = slurm.work_dir / "launch-hang"
    (work / "out").mkdir(parents=True)
    program = [*worker, "--steps", "12", "--out", str(work / "out"), "--hang-at", "5", "--hang-rank", "1"]
    job = _submit(slurm, work, _script(work, program, extra_env={"RSLURM_HANG_TIMEOUT": "5"}))
    info = _wait_done(slurm, job, work, timeout=240)
    events = _events(work)
    diagnosis = "\n".join(map(str, events)) + _job_text(work)[-5000:]
    assert int(info["Restarts"]) == 0, (info, diagnosis)
    [hang] = [e for e in events if e["event"] == "hang"]
    # rank 0 for sure; rank 1 too on this cluster, whose "nodes" share one host (n2 sees n1's socket)
    stuck = {s["rank"]: s for s in hang["ranks"]}
    assert 0 in stuck and all(s["last_step"] == 5 for s in stuck.values()), diagnosis
    [restart] = [e for e in events if e["event"] == "in_job_restart"]
    assert restart["outcome"] == "hang" and restart["committed_step"] == 4, diagnosis
    for node, rank in (("n1", 0), ("n2", 1)):  # each rank wrote its stacks on its own node
        text = (work / "nvme" / node / "toy" / "stacks" / f"rank{rank}.txt").read_text()
        assert "hang_worker.py" in text, (node, text)
    assert "_sleep_forever" in (work / "nvme" / "n2" / "toy" / "stacks" / "rank1.txt").read_text()
    for rank in (0, 1):
        assert_same(torch.load(ref / "out" / f"final.{rank}.pt", weights_only=True),
                    torch.load(work / "out" / f"final.{rank}.pt", weights_only=True), f"rank{rank}")


def test_user_error_fails_the_job_without_requeue(slurm: SlurmCluster):
    """An exception in the training script: the job ends FAILED with the rank's exit code, is not
    requeued, and the output names the error and where it was raised."""
    work = slurm.work_dir / "launch-usererror"
    work.mkdir()
    job = _submit(slurm, work, _script(work, [*TOY, *_toy_args(work, 40, 0.0), "--fail-at-step", "6"]))
    info = slurm.wait_state(job, "FAILED", timeout=120)
    assert info["ExitCode"] == "1:0" and int(info["Restarts"]) == 0, info
    text = _job_text(work)
    assert "deliberate failure at step 6" in text
    assert "not requeued: rank" in text and "train_toy.py:" in text, text[-3000:]


CRASH_AFTER_RESTORE = """\
import os, signal, sys, torch
from resilient_slurm import Checkpointer, init_distributed
rank, world, _ = init_distributed(backend="gloo")
model = torch.nn.Linear(4, 4)
ckpt = Checkpointer()
step = ckpt.restore({"model": model})
print(f"rank {rank} restored step {step}", flush=True)
if step > 0:
    os.kill(os.getpid(), signal.SIGKILL)  # e.g. out of memory right after loading the checkpoint
for s in range(step + 1, 4):
    ckpt.step(s, {"model": model})
ckpt.save(3, {"model": model})
ckpt.close()
os.kill(os.getpid(), signal.SIGKILL)  # the first incarnation dies too, after committing step 3
"""


def test_no_progress_loop_is_held(slurm: SlurmCluster):
    """A program that is killed right after every restore makes no progress past the checkpoint: with
    ``no_progress_limit=2`` the job is requeued after the first deaths, then held (not looped) with a
    reason naming the cause, visible in the job's Comment. In-job restarts are off here: this is the
    requeue governor (test_hang.py covers the same rule for in-job restarts)."""
    work = slurm.work_dir / "launch-noprogress"
    work.mkdir()
    (work / "crash.py").write_text(CRASH_AFTER_RESTORE)
    job = _submit(slurm, work, _script(work, [PY, str(work / "crash.py")],
                                       extra_env={"RSLURM_NO_PROGRESS_LIMIT": "2", "RSLURM_IN_JOB_RESTARTS": "0"}))
    deadline = time.monotonic() + 180
    while True:
        info = slurm.job_info(job)
        assert info is not None
        if int(info["Restarts"]) >= 2 and info["JobState"] == "PENDING" and (
                info.get("Reason") == "job_requeued_in_held_state" or info.get("Priority") == "0"):
            break
        assert time.monotonic() < deadline, (info, _job_text(work)[-3000:])
        assert info["JobState"] not in ("COMPLETED", "FAILED", "CANCELLED"), (info, _job_text(work)[-3000:])
        time.sleep(0.5)
    assert "no progress" in info.get("Comment", ""), info
    decisions = [e for e in _events(work) if e["event"] == "decision"]
    assert [d["action"] for d in decisions] == ["requeue", "requeue", "hold"], decisions
    slurm.scancel(job)


def test_scancel_is_cancelled_saved_and_not_requeued(slurm: SlurmCluster):
    """`scancel` (no --signal) sends SIGTERM to the launcher like a preemption would, but the user meant it:
    Slurm is already ending the job (COMPLETING, with no TimeLimit reason, which a time limit would carry).
    The ranks still take their emergency checkpoint within KillWait, the job stays CANCELLED instead of being
    requeued, and the history says cancelled, not time limit."""
    work = slurm.work_dir / "launch-scancel"
    work.mkdir()
    job = _submit(slurm, work, _script(work, [*TOY, *_toy_args(work, 400, 0.1)]))
    _wait_started(slurm, job, work, work / "log.0.jsonl", 6)
    slurm.scancel(job)
    slurm.wait_state(job, "CANCELLED", timeout=60)
    deadline = time.monotonic() + 30
    while not any(e["event"] == "decision" for e in _events(work)):
        assert time.monotonic() < deadline, (_events(work), _job_text(work)[-3000:])
        time.sleep(0.2)
    time.sleep(slurm.cred_expire + 3)  # a requeued job would be PENDING or running again by now
    info = slurm.job_info(job)
    events = _events(work)
    diagnosis = "\n".join(map(str, events)) + _job_text(work)[-4000:]
    assert info is not None and info["JobState"] == "CANCELLED" and int(info["Restarts"]) == 0, info
    [asked] = [e for e in events if e["event"] == "save_requested"]
    assert asked["reason"] == "cancelled", diagnosis
    [decision] = [e for e in events if e["event"] == "decision"]
    assert (decision["action"], decision["outcome"], decision["rule"]) == ("exit", "cancelled", "cancelled"), diagnosis
    assert [e["state"] for e in events if e["event"] == "not_requeued"] == ["COMPLETING"], diagnosis
    exits = _exits(work)
    assert exits and exits[0]["stopped"] is True, (exits, diagnosis)
    ends = _history(work)
    assert [(e["reason"], e["action"]) for e in ends] == [("cancelled", "exit")], ends
    assert ends[0]["committed_step"] == exits[0]["step"], (ends, exits)
    text = _job_text(work)
    assert f"not requeued: job {job} was cancelled (scancel); step {exits[0]['step']} is committed" in text, diagnosis
    assert "time_limit" not in text and "requeued after" not in text, diagnosis


def test_a_cancelled_job_whose_ranks_outlast_killwait_has_its_end_recorded_before_they_exit(slurm: SlurmCluster):
    """`scancel` of ranks that save at once but are not gone before Slurm's SIGKILL (each sleeps 60 s after
    its loop; KillWait is 5 s): the launcher, SIGKILLed with them at the latest, has recorded the end all
    the same. It did so once the emergency step committed, before it waited for the ranks: `decision` and
    `not_requeued` come after `committed` and before any `ranks_exited`, and the history says cancelled at
    the step the ranks saved. An order of records, not a time: it holds however slow the node is, as long
    as the launcher runs at all between the commit and the SIGKILL."""
    work = slurm.work_dir / "launch-scancel-slow-exit"
    work.mkdir()
    worker = [PY, str(REPO / "tests" / "workers" / "slow_exit_worker.py"), "60"]
    job = _submit(slurm, work, _script(work, [*worker, *_toy_args(work, 400, 0.1)]))
    _wait_started(slurm, job, work, work / "log.0.jsonl", 6)
    slurm.scancel(job)
    slurm.wait_state(job, "CANCELLED", timeout=60)  # the ranks' processes are gone: so is the launcher
    events = _events(work)
    names = [e["event"] for e in events]
    diagnosis = "\n".join(map(str, events)) + _job_text(work)[-4000:]
    decisions = [e for e in events if e["event"] == "decision"]
    assert len(decisions) == 1, diagnosis
    decision = decisions[0]
    assert (decision["action"], decision["outcome"], decision["rule"]) == ("exit", "cancelled", "cancelled"), diagnosis
    assert [e["state"] for e in events if e["event"] == "not_requeued"] == ["COMPLETING"], diagnosis
    assert names.index("committed") < names.index("decision") < names.index("not_requeued"), diagnosis
    assert "ranks_exited" not in names[:names.index("decision")], diagnosis
    exits = _exits(work)
    assert exits and exits[0]["stopped"] is True, (exits, diagnosis)
    assert decision["committed_step"] == exits[0]["step"], diagnosis
    ends = _history(work)
    assert [(e["reason"], e["action"], e["committed_step"]) for e in ends] == [("cancelled", "exit", exits[0]["step"])], ends
    assert f"not requeued: job {job} was cancelled (scancel); step {exits[0]['step']} is committed" in _job_text(work), diagnosis


SPOT = "/latest/meta-data/spot/instance-action"


def test_a_cloud_notice_saves_requeues_and_resumes_on_the_cluster(slurm: SlurmCluster):
    """The launcher of a 2-node job polls an AWS-style metadata endpoint (a real HTTP server on loopback,
    IMDSv2 token first). Once a spot notice appears, the ranks commit an emergency checkpoint at the step
    they were at, the job is requeued (cloud_termination), and the next incarnation, whose endpoint is quiet,
    resumes from that very step and completes."""
    steps = 40
    announced = datetime.now(timezone.utc) + timedelta(seconds=120)

    def behaviour(server: MetadataServer, req: Seen) -> tuple[int, str]:
        if req.method == "PUT":  # IMDSv2 token
            return 200, "token"
        if not server.release.is_set() or server.state.get("served"):
            return 404, "Not Found"
        server.state["served"] = True  # one notice: the instance the first incarnation ran on
        return 200, json.dumps({"action": "terminate", "time": announced.strftime("%Y-%m-%dT%H:%M:%SZ")})

    server = MetadataServer(behaviour).start()
    try:
        work = slurm.work_dir / "launch-cloud"
        work.mkdir()
        env = {"RSLURM_CLOUD_NOTICE": "aws", "RSLURM_CLOUD_NOTICE_URL": server.url(SPOT),
               "RSLURM_CLOUD_NOTICE_INTERVAL": "0.2"}
        job = _submit(slurm, work, _script(work, [*TOY, *_toy_args(work, steps, 0.15)], extra_env=env))
        _wait_started(slurm, job, work, work / "log.0.jsonl", 8)
        assert server.gets(), "the launcher never polled the metadata endpoint"
        server.release.set()
        info = _wait_done(slurm, job, work, timeout=240)
    finally:
        server.stop()
    starts, exits = _starts(work), _exits(work)
    diagnosis = (info, starts, exits, _job_text(work)[-4000:])
    assert int(info["Restarts"]) == 1, diagnosis
    assert exits[0]["stopped"] is True and starts[1]["step"] == exits[0]["step"] > 8, diagnosis
    assert exits[-1] == {"event": "exit", "step": steps, "stopped": False}, diagnosis
    [asked] = [e for e in _events(work) if e["event"] == "save_requested"]
    assert (asked["signal"], asked["reason"]) == ("cloud", "cloud_termination"), diagnosis
    # The announced time (less requeue_margin) bounds the deadline, well before save_timeout (300 s).
    assert asked["deadline"] <= announced.timestamp() - 3 + 1, (asked, announced)
    ends = _history(work)
    assert [(e["reason"], e["action"]) for e in ends] == [("cloud_termination", "requeue"), ("completed", "exit")], ends
    assert "termination notice from aws metadata" in ends[0]["evidence"], ends


def test_a_rendezvous_that_cannot_work_ends_within_the_startup_bound(slurm: SlurmCluster):
    """A MASTER_ADDR set for the job that does not resolve (a user's typo): torch would retry it for the
    whole timeout and no rank would ever register. With startup_timeout=20 the launcher ends the start
    once the bound has passed, with one message naming the address, the port, what failed and what to set;
    the waiting rank's stacks (py-spy) are written; the incarnation is classed startup, the no-progress
    rule (no_progress_limit=1) holds the job at once, and `rslurm history` shows it. The program is the
    torchrun-style one: no Checkpointer, no resilient_slurm."""
    work = slurm.work_dir / "launch-bad-rendezvous"
    (work / "out").mkdir(parents=True)
    env = {"MASTER_ADDR": "rdzv-host.invalid", "RSLURM_STARTUP_TIMEOUT": "20", "RSLURM_NO_PROGRESS_LIMIT": "1"}
    venv = f'export PATH="{Path(PY).parent}:$PATH"\n'  # the user's environment, activated: py-spy is on PATH
    job = _submit(slurm, work, _script(work, [PY, str(REPO / "tests" / "workers" / "torchrun_style.py"),
                                              str(work / "out")], extra_env=env, before=venv))
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        info = slurm.job_info(job)
        assert info is not None
        if info["JobState"] == "PENDING" and info.get("Reason") == "job_requeued_in_held_state":
            break
        assert info["JobState"] not in ("COMPLETED", "FAILED", "CANCELLED"), _diagnose(slurm, job, work)
        assert time.monotonic() < deadline, _diagnose(slurm, job, work)
        time.sleep(0.5)
    slurm.scancel(job)
    events = _events(work)
    diagnosis = "\n".join(map(str, events)) + _job_text(work)[-5000:]
    port = 15000 + job % 17000
    check_records(read_docs(), events)  # startup_failed included, as docs/telemetry.md says
    [failed] = [e for e in events if e["event"] == "startup_failed"]
    assert (failed["addr"], failed["port"], failed["bound_s"]) == ("rdzv-host.invalid", port, 20.0), diagnosis
    assert failed["in_rendezvous"] == [0] and failed["ranks"] == [0], diagnosis  # n1 runs rank 0
    [start] = [e for e in events if e["event"] == "start"]
    print(f"failed start: ended {failed['t'] - start['t']:.1f} s after the launcher started (bound 20 s)")
    [decision] = [e for e in events if e["event"] == "decision"]
    assert (decision["action"], decision["outcome"]) == ("hold", "startup"), diagnosis
    ends = _history(work)
    assert [(e["reason"], e["action"]) for e in ends] == [("startup", "hold")], ends
    message = ends[0]["evidence"]
    for words in ("no rank on n1 built its Checkpointer within 20 s", f"rdzv-host.invalid:{port}",
                  "MASTER_ADDR set for the job", "'rdzv-host.invalid' does not resolve",
                  "a rank said: [c10d] The IPv6 network addresses of (rdzv-host.invalid,",
                  "set MASTER_ADDR to an address of the node that runs rank 0", "RSLURM_STARTUP_TIMEOUT"):
        assert words in message, (words, message)
    assert message in _job_text(work), diagnosis  # the same one message in the job's output
    stacks = (work / "nvme" / "n1" / "toy" / "stacks" / "rank0.py-spy.txt").read_text()
    assert "init_process_group" in stacks and "torchrun_style.py" in stacks, stacks


def test_preemption_with_a_durable_tier_resumes_after_losing_a_node(slurm: SlurmCluster, tmp_path: Path):
    """A durable tier is set: the launcher runs the drain daemon as a job step (``srun --overlap``, one
    task per node). A `high` job preempts the training job; the ranks commit an emergency checkpoint,
    both nodes' daemons drain it (they ignore the SIGTERM Slurm sends every step) and the launcher
    requeues only once the step is durable. The requeued incarnation finds n2's NVMe wiped: n2's rank
    restores from the durable tier, n1's from its local tier, and the run ends bitwise identical.
    Before the preemption rank 1 is SIGKILLed once (an in-job restart), so ``rslurm report`` has a run with
    an in-job restart, a preemption and a node loss to tell, on each node, its goodput matching the events."""
    steps = 60
    work = slurm.work_dir / "launch-durable-node-loss"
    work.mkdir()
    ref = _reference(steps)
    lustre = work / "lustre"
    wipe = f'if [ "${{SLURM_RESTART_COUNT:-0}}" = 1 ]; then rm -rf {work}/nvme/n2; fi\n'
    job = _submit(slurm, work, _script(work, [*TOY, *_toy_args(work, steps, 0.15)],
                                       extra_env={"RSLURM_DURABLE": str(lustre)}, before=wipe),
                  "--signal=B:USR1@5")
    _wait_started(slurm, job, work, work / "log.1.jsonl", 8)
    pid = [e for e in read_jsonl(work / "log.1.jsonl") if e.get("event") == "start"][0]["pid"]
    os.kill(pid, signal.SIGKILL)  # the in-job restart
    _wait_started(slurm, job, work, work / "log.1.jsonl", 16)  # the restarted ranks trained on
    high = slurm.high_job(work)
    slurm.wait_state(high, "COMPLETED", timeout=120)
    info = _wait_done(slurm, job, work, timeout=180)
    (tmp_path / "job.out").write_text(_job_text(work))  # kept by pytest after the cluster is gone
    assert int(info["Restarts"]) == 1, info
    starts, exits = _starts(work), _exits(work)
    stopped = [e for e in exits if e["stopped"]]
    assert len(starts) == 3 and len(stopped) == 1, (starts, exits, _job_text(work)[-3000:])
    step = stopped[0]["step"]
    assert starts[2]["step"] == step, (starts, exits, _job_text(work)[-8000:])
    events = _events(work)
    kinds = [e["event"] for e in events]
    durable = [e for e in events if e["event"] == "durable"]
    assert durable and durable[0]["step"] == step, events
    assert kinds.index("durable") < kinds.index("requeue_call"), kinds
    # The run went on to the end: durable retention (keep_last=3) kept the newest steps, the last included.
    assert (lustre / "toy" / f"step_{steps:012d}" / "manifest.json").exists()
    # The requeue history follows the run to the durable tier (a requeue may land on another batch host).
    assert '"incarnations"' in (lustre / "toy" / "launcher-history.json").read_text()
    text = _job_text(work)
    assert "SIGTERM received; draining on" in text, text[-4000:]
    assert "fetched from the durable tier" in text, text[-4000:]
    _assert_identical_to(ref, work, steps)
    _check_report_of_the_node_loss(work, step, steps)


def _check_report_of_the_node_loss(work: Path, step: int, steps: int) -> None:
    """``rslurm report`` of that run: on the batch host (n1), the in-job restart, the preemption and the requeued
    incarnation that restored ``step`` from n1's own tier, goodput from the events and the history; on n2,
    whose NVMe was wiped, the run of its rank that restored ``step`` from the durable tier."""
    docs = {}
    for node in ("n1", "n2"):
        r = run_rslurm("report", "--json", "toy", env={"RSLURM_LOCAL_DIR": str(work / "nvme" / node)})
        assert r.returncode == 0, r.stderr
        docs[node] = json.loads(r.stdout)
    doc = docs["n1"]
    incs = doc["incarnations"]
    runs = [[(r["end_reason"], r["restored_step"]) for r in i["runs_of_ranks"]] for i in incs]
    records = read_jsonl(work / "nvme" / "n1" / "toy" / "events.jsonl")
    [ij] = [e for e in records if e["event"] == "in_job_restart"]
    assert runs == [[("killed_by_signal", None), ("preempted", ij["committed_step"])], [("completed", step)]], runs
    assert incs[1]["committed_step"] == steps and incs[1]["runs_of_ranks"][0]["restore_tiers"] == ["local"], incs
    # The steps trained again after the in-job restart: from the step it restored to the furthest step begun
    # on this node (the launcher's last reading of the heartbeats).
    exited = [e for e in records if e["event"] == "ranks_exited"]
    assert incs[0]["runs_of_ranks"][0]["steps_recomputed"] == exited[0]["last_step"] - ij["committed_step"], exited
    hist = json.loads((work / "nvme" / "n1" / "toy" / "launcher-history.json").read_text())["incarnations"]
    starts = [e["t"] for e in records if e["source"] == "launcher" and e["event"] == "start"]
    assert doc["wall_start"] == starts[0]
    assert doc["wall_end"] == max([e["t"] for e in records if e["source"] in ("rank", "launcher")]
                                  + [h["ended_at"] for h in hist])
    assert doc["kept_s"] + sum(doc["losses_s"].values()) == pytest.approx(doc["wall_s"], abs=1e-6)
    assert doc["goodput"] == pytest.approx(doc["kept_s"] / doc["wall_s"]) and 0 < doc["goodput"] < 1
    # Waiting: the in-job restart's backoff, and the requeue, from the first incarnation's end (its last record,
    # or its history entry's end) to the second start.
    first_end = max([e["t"] for e in records if e["source"] in ("rank", "launcher") and e["t"] < starts[1]]
                    + [hist[0]["ended_at"]])
    assert doc["losses_s"]["waiting"] == pytest.approx(ij["backoff_s"] + starts[1] - first_end, abs=1e-6)
    assert doc["losses_s"]["recomputed"] > 0  # after the SIGKILL; the emergency save kept every step trained
    [lost] = [s for i in docs["n2"]["incarnations"] for s in i["runs_of_ranks"]]
    assert lost["restored_step"] == step and lost["restore_tiers"] == ["durable"], docs["n2"]


def test_an_unhealthy_node_is_excluded_when_the_allocation_has_a_spare(slurm: SlurmCluster):
    """A 2-node allocation whose srun asks for one node: the health check (a user command failing on n2)
    finds n2 unhealthy before the launch, and the launcher starts the ranks with ``--exclude=n2``: both
    run on n1, no requeue, bitwise identical."""
    steps = 12
    work = slurm.work_dir / "launch-health-spare"
    work.mkdir()
    ref = _reference(steps)
    env = {"RSLURM_HEALTH_CHECK_COMMAND": 'echo "disk on $SLURMD_NODENAME is gone"; test "$SLURMD_NODENAME" != n2'}
    job = _submit(slurm, work, _script(work, [*TOY, *_toy_args(work, steps, 0.0)], extra_env=env, srun=("-N1", "-n2")))
    info = _wait_done(slurm, job, work, timeout=180)
    assert int(info["Restarts"]) == 0, info
    events = _events(work)
    [bad] = [e for e in events if e["event"] == "node_unhealthy"]
    assert bad["action"] == "excluded" and bad["excluded"] == ["n2"], bad
    assert bad["nodes"] == [{"node": "n2", "problems": ["health_check_command exited 1: disk on n2 is gone"]}], bad
    ranks = [e for e in read_jsonl(work / "nvme" / "n1" / "toy" / "events.jsonl") if e["source"] == "rank"]
    assert {e["rank"] for e in ranks if e["event"] == "restore_none"} == {0, 1}, ranks[:5]
    assert not (work / "nvme" / "n2" / "toy" / "events.jsonl").exists()  # nothing ran on n2
    _assert_identical_to(ref, work, steps)


def test_an_unhealthy_node_without_a_spare_requeues_the_job_elsewhere(slurm: SlurmCluster):
    """A 1-node job whose node fails the health check (the first node checked is marked bad for good):
    no rank starts, the incarnation ends as a node failure, the job is requeued with that node in its
    ExcNodeList, and the next incarnation runs on the other node and completes. The history, kept in the
    durable tier, follows the run to the new batch host.

    The requeue starts the job's teardown, which sends SIGTERM to every process of the job, the launcher's
    `scontrol requeue` among them: on a busy node that SIGTERM ended it after the controller had requeued
    the job, the launcher took the requeue for failed, and the node was not excluded (the job ran there
    again, and was held after three such restarts). Here the `scontrol` on the job's PATH sends itself that
    SIGTERM after every requeue, as the teardown did on that node."""
    steps = 12
    work = slurm.work_dir / "launch-health-requeue"
    work.mkdir()
    ref = _reference(steps)
    bad_file = work / "bad-node"
    check = f'[ -e {bad_file} ] || echo "$SLURMD_NODENAME" > {bad_file}; ! grep -qx "$SLURMD_NODENAME" {bad_file}'
    wrapped = work / "bin"
    wrapped.mkdir()
    real = shutil.which("scontrol")
    assert real is not None
    (wrapped / "scontrol").write_text(f'#!/bin/sh\n{real} "$@"; rc=$?\n'
                                      'case "$1" in requeue|requeuehold) kill -TERM $$ ;; esac\nexit $rc\n')
    (wrapped / "scontrol").chmod(0o755)
    env = {"RSLURM_HEALTH_CHECK_COMMAND": check, "RSLURM_DURABLE": str(work / "durable"),
           "PATH": f"{wrapped}:{os.environ['PATH']}"}
    script = _script(work, [*TOY, *_toy_args(work, steps, 0.0)], extra_env=env, srun=("-N1", "-n2"))
    job = slurm.sbatch(script, "-p", "low", "--requeue", "-N1", "--exclusive", "--open-mode=append",
                       "-o", str(work / "job.out"))
    info = _wait_done(slurm, job, work, timeout=240)
    first = bad_file.read_text().strip()
    other = {"n1": "n2", "n2": "n1"}[first]
    assert int(info["Restarts"]) == 1 and info["NodeList"] == other, info
    assert info.get("ExcNodeList") == first, info
    [bad] = [e for e in _events(work, first) if e["event"] == "node_unhealthy"]
    assert bad["action"] == "requeue" and bad["nodes"][0]["node"] == first, bad
    ends = _history(work, other, "--durable", str(work / "durable"))
    assert [(e["reason"], e["action"]) for e in ends] == [("node_failure", "requeue"), ("completed", "exit")], ends
    assert ends[0]["evidence"].startswith(f"node health check: {first}: health_check_command exited 1"), ends
    assert "requeue of job" not in _job_text(work), _job_text(work)[-4000:]  # no "requeue of job J failed"
    _assert_identical_to(ref, work, steps)


def test_a_preemption_during_the_health_check_blames_no_node(slurm: SlurmCluster):
    """A 1-node job preempted while its health check runs (the user's command sleeps, in the first
    incarnation only). Slurm's SIGTERM ends the check's step, no node answers, and the launcher, without
    ``--signal``, hears nothing: that was a node failure, and the node went into the job's ExcNodeList.
    Now the launcher reads the job's PreemptTime, blames no node and stops as preempted: requeued (the
    node not excluded), resumed, completed, bitwise identical."""
    steps = 12
    work = slurm.work_dir / "launch-health-preempted"
    work.mkdir()
    ref = _reference(steps)
    checking = work / "checking"
    check = f'if [ "${{SLURM_RESTART_COUNT:-0}}" = 0 ]; then echo "$SLURMD_NODENAME" > {checking}; sleep 120; fi'
    env = {"RSLURM_HEALTH_CHECK_COMMAND": check, "RSLURM_DURABLE": str(work / "durable")}
    script = _script(work, [*TOY, *_toy_args(work, steps, 0.0)], extra_env=env, srun=("-N1", "-n2"))
    # `lowlong` (GraceTime 60 s): after the check the ranks start and save within the grace. In `low`'s 10 s,
    # a loaded CI runner's ranks took 9 s to start, and the grace ended before the launcher could requeue.
    job = slurm.sbatch(script, "-p", "lowlong", "--requeue", "-N1", "--exclusive", "--open-mode=append",
                       "-o", str(work / "job.out"))
    deadline = time.monotonic() + 120
    while not (checking.exists() and checking.read_text().strip()):
        assert time.monotonic() < deadline, _diagnose(slurm, job, work)
        time.sleep(0.2)
    high = slurm.high_job(work)
    slurm.wait_state(high, "COMPLETED", timeout=180)
    info = _wait_done(slurm, job, work, timeout=240)
    assert int(info["Restarts"]) == 1, info
    assert info.get("ExcNodeList") in (None, "(null)"), info
    events = [e for n in ("n1", "n2") if (work / "nvme" / n / "toy" / "events.jsonl").exists()
              for e in _events(work, n)]
    assert not [e for e in events if e["event"] == "node_unhealthy"], events
    assert "no node is blamed" in _job_text(work), _job_text(work)[-4000:]
    ends = _history(work, info["NodeList"], "--durable", str(work / "durable"))
    assert [(e["reason"], e["action"]) for e in ends] == [("preempted", "requeue"), ("completed", "exit")], ends
    _assert_identical_to(ref, work, steps)
