"""A launcher that dies without a chance to clean up (SIGKILL, OOM) must not leave ranks running.

Ranks are started with PR_SET_PDEATHSIG=SIGTERM: when the launcher dies they get SIGTERM, which their
Checkpointer turns into an emergency checkpoint, and they exit. Nobody supervises them any more, so each
rank bounds itself (resilient_slurm/control/orphan.py): `term_grace` after its emergency commit, and
`save_timeout` + `term_grace` in any case, then SIGKILL to itself and its child processes. On a busy node
the exit alone (the interpreter's final garbage collection) took 10 s at a load of 20 on two cores and more
than a minute in a loaded CI run, before the bound existed.
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
from conftest import clean_env, read_jsonl, wait_for_step
from test_hang import WORKER
from test_telemetry import check_records, read_docs

pytestmark = pytest.mark.proc  # every test here starts processes (tests/check_tier.py)

#: Both tests wait this long for every process to be gone: the bound (10 s after a commit that takes about
#: a second; 7 s in the second test) plus the kernel's reaping of processes whose parent died, with room
#: for a machine whose load is many times its cores. Not a timing claim: the bound is what is tested.
GONE_WITHIN_S = 60


def _kill_launcher_and_wait(launcher: subprocess.Popen[bytes], procs: list[psutil.Process]) -> None:
    os.kill(launcher.pid, signal.SIGKILL)
    launcher.wait(timeout=30)
    _, alive = psutil.wait_procs(procs, timeout=GONE_WITHIN_S)
    assert not alive, f"ranks or their workers outlived the launcher: {alive}"


def _cleanup(launcher: subprocess.Popen[bytes], tmp_path: Path) -> None:
    if launcher.poll() is None:
        launcher.kill()
    for p in psutil.process_iter():
        try:
            if any(str(tmp_path) in a for a in p.cmdline()):
                p.kill()
        except psutil.Error:
            pass


def test_sigkilled_launcher_leaves_no_ranks_and_they_save_first(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "resilient_slurm.cli", "launch", "-n", "2", "--every-steps", "5", "--",
           sys.executable, "-m", "resilient_slurm.examples.train_toy", "--steps", "400", "--workers", "1",
           "--every-steps", "5", "--step-sleep", "0.05", "--log", str(tmp_path / "log.%r.jsonl")]
    env = clean_env({"RSLURM_LOCAL_DIR": str(tmp_path / "nvme"), "RSLURM_RUN_ID": "toy"})
    with open(tmp_path / "launcher.err", "wb") as err:
        launcher = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    try:
        wait_for_step(tmp_path / "log.0.jsonl", 7, timeout=120)
        wait_for_step(tmp_path / "log.1.jsonl", 7, timeout=30)
        pids = [e["pid"] for r in (0, 1) for e in read_jsonl(tmp_path / f"log.{r}.jsonl") if e.get("event") == "start"]
        procs = [psutil.Process(p) for p in pids]
        procs += [c for p in procs for c in p.children(recursive=True)]  # DataLoader workers
        before = max(e["step"] for e in read_jsonl(tmp_path / "log.0.jsonl") if "loss" in e)
        _kill_launcher_and_wait(launcher, procs)
    finally:
        _cleanup(launcher, tmp_path)
    newest = sorted((tmp_path / "nvme" / "toy").glob("step_*"))[-1]
    manifest = json.loads((newest / "manifest.json").read_text())
    assert manifest["reason"] == "emergency" and manifest["step"] >= before, (manifest, before)
    events = read_jsonl(tmp_path / "nvme" / "toy" / "events.jsonl")
    committed = [e for e in events if e["event"] == "save_committed" and e["reason"] == "emergency"]
    assert sorted(e["rank"] for e in committed) == [0, 1] and {e["step"] for e in committed} == {manifest["step"]}
    gone = [e for e in events if e["event"] == "launcher_gone"]
    assert sorted(e["rank"] for e in gone) == [0, 1] and all(e["launcher_pid"] == launcher.pid for e in gone), gone
    # Each rank left its loop on should_stop after that save and exited; or, on a node so busy that its exit
    # outlasted term_grace after the commit, its bound ended it then (saved).
    ended = {e["rank"]: e for e in events if e["event"] == "orphan_timeout"}
    assert all(e["saved"] for e in ended.values()), ended
    for r in (0, 1):
        exits = [e for e in read_jsonl(tmp_path / f"log.{r}.jsonl") if e.get("event") == "exit"]
        assert exits == [{"event": "exit", "step": manifest["step"], "stopped": True}] or (not exits and r in ended), (
            r, exits, ended)
    check_records(read_docs(), [e for e in events if e["event"] in ("launcher_gone", "orphan_timeout")])


def test_orphaned_ranks_that_cannot_save_are_ended_within_the_bound(tmp_path: Path) -> None:
    """Rank 1 sleeps for an hour after step 5, so rank 0 waits in step 6's collective (30 minutes before gloo
    gives up): neither can reach a step boundary to save. Once the launcher is SIGKILLed, both find it gone,
    and rank 1 is ended at save_timeout + term_grace (5 + 2 s here) with its stacks written (in its sleep)
    and an orphan_timeout event. Rank 0 is gone by then too: by its own bound, or at once when rank 1's end
    fails its collective (it then raises, and its bound's backstop covers its exit)."""
    out = tmp_path / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "resilient_slurm.cli", "launch", "-n", "2", "--", *WORKER, "--steps", "1000",
           "--out", str(out), "--hang-at", "5", "--hang-rank", "1"]
    env = clean_env({"RSLURM_LOCAL_DIR": str(tmp_path / "nvme"), "RSLURM_RUN_ID": "hang", "RSLURM_DAEMON": "off",
                     "RSLURM_SAVE_TIMEOUT": "5", "RSLURM_TERM_GRACE": "2", "RSLURM_HANG_TIMEOUT": "off"})
    with open(tmp_path / "launcher.out", "wb") as so, open(tmp_path / "launcher.err", "wb") as err:
        launcher = subprocess.Popen(cmd, env=env, stdout=so, stderr=err, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while b"hanging (after step 5)" not in (tmp_path / "launcher.out").read_bytes():
            assert launcher.poll() is None and time.monotonic() < deadline, (tmp_path / "launcher.err").read_text()[-3000:]
            time.sleep(0.2)
        procs = psutil.Process(launcher.pid).children(recursive=True)
        assert len(procs) == 2, procs
        _kill_launcher_and_wait(launcher, procs)
    finally:
        _cleanup(launcher, tmp_path)
    events = read_jsonl(tmp_path / "nvme" / "hang" / "events.jsonl")
    ends = [e for e in events if e["event"] == "orphan_timeout"]
    assert 1 in [e["rank"] for e in ends] and not any(e["saved"] for e in ends), ends
    assert all(abs(e["bound_s"] - 7) < 0.01 for e in ends), ends
    assert sorted(e["rank"] for e in events if e["event"] == "launcher_gone") == [0, 1], events
    check_records(read_docs(), [e for e in events if e["event"] in ("launcher_gone", "orphan_timeout")])
    stacks = (tmp_path / "nvme" / "hang" / "stacks" / "rank1.txt").read_text()
    assert "rank ended 7 s after its launcher" in stacks and "_sleep_forever" in stacks, stacks[-3000:]
