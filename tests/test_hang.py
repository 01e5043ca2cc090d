"""Hang detection: rank heartbeats (control/heartbeat.py) read by the launcher (launcher/hang.py).

End to end in local mode (``rslurm launch -n 2``, real processes, gloo, real signals): a rank that stops
in the middle of training (its peer then waits in an all_reduce: a hung collective) and a rank that
stops before its first step are found within the configured timeout; every rank's Python stacks (all
threads) are written to the run directory; a ``hang`` event names the ranks and their last step; the
process trees are torn down; the launcher exits 75 (restartable); and running the command again resumes
from the last commit and ends bitwise identical to a run that never hung. A rank inside a section with
its own limit is not a hang. The heartbeat record and the adaptive timeout are tested as units.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from conftest import REPO, assert_same, clean_env, once, read_jsonl, run_rslurm
from test_telemetry import check_records, read_docs

from resilient_slurm.control.heartbeat import Heartbeat, HeartbeatWriter, heartbeat_path, read_heartbeats
from resilient_slurm.launcher.hang import ADAPTIVE_FACTOR, ADAPTIVE_FLOOR_S, HangWatch

WORKER = [sys.executable, str(REPO / "tests" / "workers" / "hang_worker.py")]
REQUEUE = 75
STEPS = 12


def _launch(tmp: Path, out: Path, *worker_args: str, env: dict[str, str] | None = None,
            timeout: float = 240, n: int = 2) -> subprocess.CompletedProcess[str]:
    # The stacks come from the dump signal (faulthandler) here, whether or not the shell that runs the tests
    # has py-spy on its PATH (an activated venv has): test_launcher_slurm covers the py-spy dumps.
    path = os.pathsep.join(d for d in os.environ.get("PATH", "").split(os.pathsep)
                           if d and not os.path.exists(os.path.join(d, "py-spy")))
    e = clean_env({"RSLURM_LOCAL_DIR": str(tmp / "nvme"), "RSLURM_RUN_ID": "hang", "RSLURM_NODE_NAME": "n1",
                   "RSLURM_CONTROL_DIR": str(tmp / "ctl"), "RSLURM_DAEMON": "off", "PATH": path, **(env or {})})
    return subprocess.run([sys.executable, "-m", "resilient_slurm.cli", "launch", "-n", str(n), "--", *WORKER,
                           "--steps", str(STEPS), "--out", str(out), *worker_args],
                          env=e, cwd=tmp, capture_output=True, text=True, timeout=timeout)


def _events(tmp: Path) -> list[dict]:
    return read_jsonl(tmp / "nvme" / "hang" / "events.jsonl")


def _cli(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return run_rslurm(*args, env={"RSLURM_LOCAL_DIR": str(tmp / "nvme"), "RSLURM_NODE_NAME": "n1"})


def _history(tmp: Path) -> list[dict]:
    """The ends of the run's incarnations, from ``rslurm history --json`` (also test_attribution.py)."""
    r = _cli(tmp, "history", "--run-id", "hang", "--json")
    assert r.returncode == 0, r.stderr
    [run] = json.loads(r.stdout)["runs"]
    return run["ends"]


def _reference() -> Path:
    """The outputs of a run that never hung (the same for every test here and in test_attribution.py: made
    once per test process)."""
    def make(ref: Path) -> None:
        (ref / "out").mkdir()
        r = _launch(ref, ref / "out")
        assert r.returncode == 0, r.stderr[-3000:]

    return once(("hang_worker reference", STEPS), make) / "out"


def _no_worker_left(out: Path) -> None:
    left = [p for p in psutil.process_iter(["cmdline"]) if str(out) in " ".join(p.info["cmdline"] or [])]
    assert not left, [p.info["cmdline"] for p in left]


def _assert_like(ref: Path, out: Path) -> None:
    for rank in (0, 1):
        assert_same(torch.load(ref / f"final.{rank}.pt", weights_only=True),
                    torch.load(out / f"final.{rank}.pt", weights_only=True), f"rank{rank}")


def _restored_steps(work: Path) -> list[int]:
    return [e["step"] for e in _events(work) if e["event"] == "restore" and e.get("rank") == 0]


@pytest.mark.proc
@pytest.mark.parametrize("where", ["collective", "startup"])
def test_a_hang_is_found_its_stacks_written_and_the_ranks_restarted_in_job(tmp_path: Path, where: str) -> None:
    """Rank 1 stops after step 5 (rank 0 then waits in step 6's all_reduce), or rank 0 stops before its
    restore (rank 1 waits in the restore's collective): found past the limit, stacks of every thread of
    every rank written, a hang event, the process trees torn down, and the ranks restarted in the same
    launcher run from the last commit: exit 0, bitwise identical to a run that never hung."""
    ref = _reference()
    work = tmp_path / "work"
    out = work / "out"
    out.mkdir(parents=True)
    hang = ["--hang-at", "5", "--hang-rank", "1"] if where == "collective" else ["--hang-startup", "--hang-rank", "0"]
    env = {"RSLURM_HANG_TIMEOUT": "4", "RSLURM_HANG_STARTUP_TIMEOUT": "20" if where == "collective" else "6"}
    t0 = time.time()
    r = _launch(work, out, *hang, env=env)
    diag = r.stderr[-4000:]
    assert r.returncode == 0, diag
    _no_worker_left(out)
    [ev] = [e for e in _events(work) if e["event"] == "hang"]
    check_records(read_docs(), _events(work))  # every record, the hang included, as docs/telemetry.md says
    stuck = {s["rank"]: s for s in ev["ranks"]}
    if where == "collective":
        # rank 1 sleeps after step 5; rank 0 waits in step 6's all_reduce: both stop at step 5
        assert set(stuck) == {0, 1} and {s["last_step"] for s in stuck.values()} == {5}, ev
        assert ev["timeout_s"] == 4 and all(s["limit_s"] == 4 for s in stuck.values()), ev
    else:
        # rank 0 sleeps before its restore; rank 1 waits for it in the restore's collective
        assert {s["section"] for s in stuck.values()} == {"startup"} and 0 in stuck, ev
        assert all(s["last_step"] == -1 and s["limit_s"] == 6 for s in stuck.values()), ev
    assert ev["t"] - t0 < 200  # found, not left to the test's own timeout
    for rank in (0, 1):  # every rank's stacks, all threads, in the run directory
        text = (work / "nvme" / "hang" / "stacks" / f"rank{rank}.txt").read_text()
        assert "thread 0x" in text.lower() and "hang_worker.py" in text, text
        # each dump begins with the launcher's line, so that a later hang's dump is told from this one
        assert text.count("--- stacks asked for by the launcher at ") == 1, text
    hung_rank = 1 if where == "collective" else 0
    assert "_sleep_forever" in (work / "nvme" / "hang" / "stacks" / f"rank{hung_rank}.txt").read_text()
    [restart] = [e for e in _events(work) if e["event"] == "in_job_restart"]
    assert restart["outcome"] == "hang" and restart["attempt"] == 1, restart
    assert "hang:" in r.stderr and "restarting the ranks" in r.stderr, diag
    # the restarted ranks resumed from the last commit (step 4 for the collective hang; none before it),
    # and the launcher says what they restored, not what was on disk when it started
    assert _restored_steps(work) == ([4] if where == "collective" else []), _events(work)
    said = "the ranks resumed from step 4" if where == "collective" else "the ranks resumed from nothing (a fresh start)"
    assert said in r.stderr, diag
    _assert_like(ref, out)


@pytest.mark.proc
def test_without_in_job_restarts_a_hang_requeues_and_the_rerun_resumes(tmp_path: Path) -> None:
    ref = _reference()
    work = tmp_path / "work"
    out = work / "out"
    out.mkdir(parents=True)
    env = {"RSLURM_HANG_TIMEOUT": "4", "RSLURM_IN_JOB_RESTARTS": "0"}
    r = _launch(work, out, "--hang-at", "5", "--hang-rank", "1", env=env)
    assert r.returncode == REQUEUE, r.stderr[-4000:]
    _no_worker_left(out)
    assert [e["event"] for e in _events(work)].count("hang") == 1
    assert not [e for e in _events(work) if e["event"] == "in_job_restart"]
    r2 = _launch(work, out, "--hang-at", "5", "--hang-rank", "1", env=env)
    assert r2.returncode == 0, r2.stderr[-4000:]
    assert _restored_steps(work) == [4]
    _assert_like(ref, out)


@pytest.mark.proc
@pytest.mark.parametrize("sig", ["KILL", "SEGV"])
def test_a_crashed_rank_is_restarted_in_job_and_ends_bitwise(tmp_path: Path, sig: str) -> None:
    """Rank 1 dies by SIGKILL or a real segmentation fault after step 7: the launcher
    tears down its peer, restarts both from the last commit in the same run after a short backoff, exit 0.
    The run's history (``rslurm history``) names the SIGKILL as ``killed_by_signal`` of rank 1, and a broken
    history file is named, exit 1 (failure attribution, test_attribution.py)."""
    ref = _reference()
    work = tmp_path / "work"
    out = work / "out"
    out.mkdir(parents=True)
    r = _launch(work, out, "--crash-at", "7", "--crash-rank", "1", "--crash-signal", sig)
    assert r.returncode == 0, r.stderr[-4000:]
    [restart] = [e for e in _events(work) if e["event"] == "in_job_restart"]
    # step 6's save is asynchronous: usually committed before the crash, else step 4 is the newest
    assert restart["outcome"] == "killed_by_signal" and restart["committed_step"] in (4, 6), restart
    assert f"SIG{sig}" in restart["detail"], restart
    assert _restored_steps(work) == [restart["committed_step"]]
    _assert_like(ref, out)
    if sig == "KILL":
        ends = _history(work)
        assert [e["reason"] for e in ends] == ["killed_by_signal", "completed"], ends
        assert ends[0]["evidence"] == "rank 1 killed by SIGKILL", ends
        # the history is JSON the launcher and `rslurm history` read; a broken one is named, exit 1
        (work / "nvme" / "hang" / "launcher-history.json").write_text("{broken")
        bad = _cli(work, "history", "--run-id", "hang")
        assert bad.returncode == 1 and "launcher-history.json" in bad.stdout and "not valid JSON" in bad.stdout, bad


@pytest.mark.proc
def test_a_stop_during_the_backoff_starts_no_rank_and_the_report_shows_one_run(tmp_path: Path) -> None:
    """Rank 1 dies by SIGKILL after step 7 and the launcher waits out its in-job restart's backoff; a SIGTERM
    then comes. The ranks are not started again, the stop says so (ranks_not_started, restoring the step the
    restart would have), the run that died is in the history, and `rslurm report` shows one run of the
    ranks, ended by the stop, not a second one that never began."""
    work, out = tmp_path / "work", tmp_path / "work" / "out"
    out.mkdir(parents=True)
    path = os.pathsep.join(d for d in os.environ.get("PATH", "").split(os.pathsep)
                           if d and not os.path.exists(os.path.join(d, "py-spy")))
    env = clean_env({"RSLURM_LOCAL_DIR": str(work / "nvme"), "RSLURM_RUN_ID": "hang", "RSLURM_NODE_NAME": "n1",
                     "RSLURM_CONTROL_DIR": str(work / "ctl"), "RSLURM_DAEMON": "off", "PATH": path})
    p = subprocess.Popen([sys.executable, "-m", "resilient_slurm.cli", "launch", "-n", "2", "--", *WORKER, "--steps",
                          str(STEPS), "--out", str(out), "--crash-at", "7", "--crash-rank", "1", "--crash-signal",
                          "KILL"], env=env, cwd=work, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (work / "nvme" / "hang" / "events.jsonl").exists() or not [
                e for e in _events(work) if e["event"] == "in_job_restart"]:
            assert time.monotonic() < deadline and p.poll() is None, "no in-job restart"
            time.sleep(0.05)
        p.send_signal(signal.SIGTERM)  # within the backoff (2 s for the first restart)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == REQUEUE, err[-4000:]
    events = [e for e in _events(work) if e["source"] == "launcher"]
    [restart] = [e for e in events if e["event"] == "in_job_restart"]
    after = [e["event"] for e in events[events.index(restart) + 1:]]
    assert after[:3] == ["signal", "save_requested", "ranks_not_started"], after
    [skipped] = [e for e in events if e["event"] == "ranks_not_started"]
    assert skipped["signal"] == "SIGTERM" and skipped["restored_step"] == restart["committed_step"], skipped
    assert len([e for e in _events(work) if e["event"] in ("restore", "restore_none") and e.get("rank") == 0]) == 1
    report = json.loads(run_rslurm("report", "--json", env={"RSLURM_LOCAL_DIR": str(work / "nvme"),
                                                             "RSLURM_RUN_ID": "hang"}).stdout)
    [incarnation] = report["incarnations"]
    runs = incarnation["runs_of_ranks"]
    assert len(runs) == 1 and runs[0]["end_reason"] == "preempted", runs
    assert all(v >= 0 for v in report["losses_s"].values()), report["losses_s"]
    history = json.loads(run_rslurm("history", "--json", env={"RSLURM_LOCAL_DIR": str(work / "nvme"),
                                                               "RSLURM_RUN_ID": "hang"}).stdout)
    assert "killed_by_signal" in json.dumps(history), history


@pytest.mark.proc
@pytest.mark.parametrize("limit", ["in_job_restarts", "no_progress_limit"])
def test_repeated_crashes_fall_back_to_requeue(tmp_path: Path, limit: str) -> None:
    """A rank that dies after step 3 at every run (step 2 is the newest commit: the rank waits for its
    asynchronous save to commit first, which on a busy node it may not have done by step 3): two in-job
    restarts, then the launcher falls back to the requeue path (exit 75 in local mode) instead of looping;
    either because in_job_restarts=2 are used up, or because the two runs since the commit committed nothing
    new (no_progress_limit=2, with in_job_restarts=5)."""
    work = tmp_path / "work"
    out = work / "out"
    out.mkdir(parents=True)
    env = ({"RSLURM_IN_JOB_RESTARTS": "2"} if limit == "in_job_restarts"
           else {"RSLURM_IN_JOB_RESTARTS": "5", "RSLURM_NO_PROGRESS_LIMIT": "2"})
    r = _launch(work, out, "--crash-at", "3", "--crash-rank", "0", "--always", "--crash-after-commit", env=env)
    assert r.returncode == REQUEUE, r.stderr[-4000:]
    restarts = [e for e in _events(work) if e["event"] == "in_job_restart"]
    assert [e["attempt"] for e in restarts] == [1, 2], restarts
    assert [e["committed_step"] for e in restarts] == [2, 2], restarts
    assert restarts[1]["backoff_s"] > restarts[0]["backoff_s"], restarts
    why = "in-job restarts used up" if limit == "in_job_restarts" else "the last 2 runs of the ranks committed nothing new"
    assert why in r.stderr, r.stderr[-3000:]


@pytest.mark.proc
def test_a_section_with_its_own_limit_is_not_a_hang_and_off_disables(tmp_path: Path) -> None:
    """The rank spends 4 s in ``ckpt.section("eval", timeout=30)`` with a 2 s hang timeout: no hang. With
    ``hang_timeout=off``, a 4 s section without a limit is no hang either. One rank: the limits are each
    rank's own (its heartbeat record), and the hangs of several ranks are the other tests'."""
    for env, section_timeout in (({"RSLURM_HANG_TIMEOUT": "2"}, "30"), ({"RSLURM_HANG_TIMEOUT": "off"}, None)):
        work = tmp_path / f"w{len(env)}{section_timeout}"
        out = work / "out"
        out.mkdir(parents=True)
        args = ["--section-at", "3", *(["--section-timeout", section_timeout] if section_timeout else [])]
        r = _launch(work, out, *args, env=env, n=1)
        assert r.returncode == 0, r.stderr[-3000:]
        assert not [e for e in _events(work) if e["event"] == "hang"]


# ------------------------------------------------------------------------------------------------ units
def test_the_record_round_trips_and_is_removed_at_close(tmp_path: Path) -> None:
    sock = str(tmp_path / "job.n1.sock")
    w = HeartbeatWriter(heartbeat_path(sock, 3))
    hb = read_heartbeats(sock)[3]
    assert (hb.pid, hb.step, hb.section) == (os.getpid(), -1, "startup")
    w.beat(7)
    hb = read_heartbeats(sock)[3]
    assert (hb.step, hb.section) == (7, "") and abs(hb.beat_t - time.time()) < 60
    assert hb.reached_t == hb.step_t == hb.beat_t
    time.sleep(0.01)
    prev = w.section("eval", 90)
    hb = read_heartbeats(sock)[3]
    assert (hb.section, hb.section_timeout) == ("eval", 90)
    time.sleep(0.01)
    w.resume(prev)
    after = read_heartbeats(sock)[3]
    assert after.section == ""
    # A section entered or left restarts the hang clock (beat_t) but not when step 7 was reached (a save after
    # the step's beat made `rslurm report` count the save's time as training of that step).
    assert after.reached_t == hb.step_t < hb.beat_t < after.beat_t
    watch = HangWatch(sock, timeout=None, startup_timeout=50)
    watch.observe(read_heartbeats(sock))
    assert watch.furthest == (7, after.step_t)
    (tmp_path / "job.n1.sock.hb.x").write_text("not a rank")  # ignored
    os.symlink(tmp_path / "elsewhere", tmp_path / "job.n1.sock.hb.9")  # a link is not read
    assert set(read_heartbeats(sock)) == {3}
    w.close()
    assert read_heartbeats(sock) == {}


@pytest.mark.proc
def test_a_reader_never_sees_a_torn_record(tmp_path: Path) -> None:
    """A writer in another process beats as fast as it can; every record read is one it wrote whole
    (the time and the step move together: beat_t was taken after the step was set)."""
    sock = str(tmp_path / "s")
    code = (f"import sys, time; sys.path.insert(0, {str(REPO)!r})\n"
            "from resilient_slurm.control.heartbeat import HeartbeatWriter, heartbeat_path\n"
            f"w = HeartbeatWriter(heartbeat_path({sock!r}, 0)); print('ready', flush=True)\n"
            "for i in range(2_000_000): w.beat(i)\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    seen = []
    while p.poll() is None and len(seen) < 3000:
        hb = read_heartbeats(sock).get(0)
        if hb is not None:
            seen.append(hb)
    p.kill()
    p.wait()
    steps = [h.step for h in seen]
    assert steps == sorted(steps) and len(set(steps)) > 10, steps[:20]


def _hb(rank: int, step: int, t: float, section: str = "", section_t: float = 0.0, limit: float = 0.0,
        pid: int = 100) -> Heartbeat:
    return Heartbeat(rank, pid, step, t, section, section_t, limit)


def test_the_adaptive_timeout_follows_the_slowest_recent_step() -> None:
    w = HangWatch("/nonexistent", timeout=None, startup_timeout=50)
    w.observe({0: _hb(0, -1, 0.0, "startup", 0.0)})
    assert w.judge(49) is None and w.judge(51) is not None  # startup limit, from the section's start
    w.observe({0: _hb(0, 1, 60.0)})
    for s in range(2, 12):
        w.observe({0: _hb(0, s, 60.0 + 2.0 * (s - 1))})  # 2 s steps
    assert w.step_limit() == ADAPTIVE_FLOOR_S
    w.observe({0: _hb(0, 13, 60.0 + 20 + 40.0)})  # one 20 s step: 10 x 20 s
    assert w.step_limit() == ADAPTIVE_FACTOR * 20.0
    last = 60.0 + 20 + 40.0
    assert w.judge(last + 199) is None
    hang = w.judge(last + 201)
    assert hang is not None and hang.stuck[0].step == 13 and "after step 13" in hang.describe()


def test_a_rank_whose_clock_started_later_is_named_in_the_same_hang() -> None:
    """Rank 0 hangs before its restore; rank 1, which began its start-up 2 s earlier, waits for it and passes the
    limit first. The verdict names rank 0 too (half-way to its own limit), not only the rank that waits (a full
    run on a busy machine once named only rank 1)."""
    w = HangWatch("/nonexistent", timeout=4, startup_timeout=6)
    w.observe({0: _hb(0, -1, 102.0, "startup", 102.0), 1: _hb(1, -1, 100.0, "startup", 100.0)})
    assert w.judge(105.9) is None
    hang = w.judge(106.5)
    assert hang is not None and [s.rank for s in hang.stuck] == [0, 1], hang
    assert "rank 0 before its first step (startup), idle 4 s of 6 s" in hang.describe(), hang.describe()
    assert "rank 1 before its first step (startup), idle 6 s > 6 s" in hang.describe(), hang.describe()
    w.observe({0: _hb(0, -1, 104.0, "startup", 104.0, pid=101), 1: _hb(1, -1, 100.0, "startup", 100.0)})
    hang = w.judge(106.5)  # a rank not yet half-way to its limit is not named
    assert hang is not None and [s.rank for s in hang.stuck] == [1], hang


def test_sections_restarts_and_closed_ranks() -> None:
    w = HangWatch("/nonexistent", timeout=5, startup_timeout=50)
    w.observe({0: _hb(0, 3, 100.0, "eval", 100.0, 60.0), 1: _hb(1, 3, 100.0)})
    hang = w.judge(110)
    assert hang is not None and [s.rank for s in hang.stuck] == [1]  # rank 0 is inside its 60 s section
    w.observe({0: _hb(0, 3, 100.0, "eval", 100.0, 60.0)})  # rank 1's record is gone: it ended on its own
    assert w.judge(110) is None and w.judge(161) is not None
    w.observe({0: _hb(0, -1, 200.0, "startup", 200.0, pid=101)})  # a new process for rank 0
    assert w.judge(240) is None
    # How far the run got (the `ranks_exited` event's last_step): kept after the records are gone.
    assert w.furthest == (3, 100.0)
    off = HangWatch("/nonexistent", timeout=float("inf"), startup_timeout=1)
    off.observe({0: _hb(0, 1, 0.0)})
    assert not off.enabled and off.check(1e9) is None
    assert off.furthest == (1, 0.0)  # progress is read with hang detection off too
