"""Node health checks (launcher/health.py): the built-in checks and the user's command on a real node, the
launcher refusing to start ranks on an unhealthy node in local mode, and the srun command rewriting
that excludes a node. The Slurm cases (a spare node excluded; no spare: requeued with the node in the
job's ExcNodeList) are in test_launcher_slurm.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from conftest import clean_env, mounted_tmpfs, read_jsonl
from test_telemetry import check_records, read_docs

from resilient_slurm import Checkpointer
from resilient_slurm.config import load
from resilient_slurm.launcher.health import (
    CheckInterrupted,
    NodeHealth,
    check_node,
    exclude,
    requested_nodes,
    run_check,
)

SRUN_CASES = [
    (["srun", "-N1", "-n2", "python", "t.py", "-N", "5"], 1,
     ["srun", "--exclude=n2", "-N1", "-n2", "python", "t.py", "-N", "5"]),
    (["srun", "--nodes", "2", "-x", "n3", "python", "t.py"], 2,
     ["srun", "--exclude=n3,n2", "--nodes", "2", "python", "t.py"]),
    (["srun", "--nodes=1-3", "--exclude=n2", "--", "python"], 1, ["srun", "--exclude=n2", "--nodes=1-3", "--", "python"]),
    (["srun", "--overlap", "python", "-x", "y"], None, ["srun", "--exclude=n2", "--overlap", "python", "-x", "y"]),
    (["srun", "-N", "x", "python"], None, ["srun", "--exclude=n2", "-N", "x", "python"]),
]


@pytest.mark.parametrize(("command", "nodes", "excluded"), SRUN_CASES, ids=[" ".join(c[0]) for c in SRUN_CASES])
def test_srun_node_count_and_exclusion(command: list[str], nodes: int | None, excluded: list[str]) -> None:
    """srun's own options are told from the program's (``-N 5`` after the program is the program's), a
    user's exclusion is merged, and a command without ``-N`` has no spare nodes (srun takes them all)."""
    assert requested_nodes(command) == nodes
    assert exclude(command, ["n2"]) == excluded


def test_the_answer_round_trips_and_garbage_is_no_answer() -> None:
    h = NodeHealth("n2", ("disk gone",), ("local_dir", "command"))
    assert NodeHealth.from_json(h.to_json()) == h and not h.ok
    assert NodeHealth.from_json("srun: error: n2: task 1: Killed") is None
    assert NodeHealth.from_json('{"node": 3, "problems": []}') is None


def _cfg(local: Path, **settings: str) -> object:
    return load({"local_dir": str(local), "run_id": "r", "node_name": "n1", **settings}, env={})


def test_a_local_directory_that_cannot_be_written_is_unhealthy(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("x")
    h = check_node(_cfg(tmp_path / "afile" / "nvme"))  # a path under a file: mkdir fails
    assert not h.ok and "is not writable" in h.problems[0] and "afile" in h.problems[0], h
    ok = check_node(_cfg(tmp_path / "nvme"))
    assert ok.ok and ok.checked[:1] == ("local_dir",), ok
    assert not list((tmp_path / "nvme").iterdir())  # the probe file is gone


def test_no_room_for_the_next_save_is_unhealthy(tmp_path: Path) -> None:
    """A 128 MiB tmpfs holding a 5 MiB checkpoint of the run, then filled: the next save would not fit."""
    with mounted_tmpfs(tmp_path / "tiny", "128m") as mnt:
        with Checkpointer(local_dir=str(mnt), run_id="r", keep_last=1) as ck:
            ck.save(1, {"w": torch.zeros(5 << 18)})  # 5 MiB
        assert check_node(_cfg(mnt)).ok
        with open(mnt / "filler", "wb") as f:
            f.write(b"\0" * (120 << 20))
        h = check_node(_cfg(mnt))
        assert not h.ok and "the next save would not fit" in h.problems[0], h


@pytest.mark.proc
def test_the_users_command_and_its_timeout(tmp_path: Path) -> None:
    h = check_node(_cfg(tmp_path, health_check_command="echo 'ib0 down'; exit 4", health_check="off"))
    assert h.checked == ("command",) and h.problems == ("health_check_command exited 4: ib0 down",), h
    h = check_node(_cfg(tmp_path, health_check_command="sleep 30", health_timeout="1"))
    assert "did not exit within 1 s" in h.problems[0], h


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_file(path: Path, timeout: float = 60) -> str:
    end = time.monotonic() + timeout
    while not (path.exists() and path.read_text().strip()):
        assert time.monotonic() < end, f"{path} never written"
        time.sleep(0.05)
    return path.read_text()


@pytest.mark.proc
def test_a_timeout_ends_the_whole_command_even_a_child_that_holds_its_output(tmp_path: Path) -> None:
    """The command runs in a process group of its own, ended whole at the timeout. A child that kept the
    command's output open (``sleep 300 & ...; wait``) used to hold the check until it ended by itself."""
    pid_file = tmp_path / "child.pid"
    t0 = time.monotonic()
    h = check_node(_cfg(tmp_path, health_check="off", health_timeout="1",
                        health_check_command=f"sleep 300 & echo $! > {pid_file}; wait"))
    assert "did not exit within 1 s" in h.problems[0], h
    assert time.monotonic() - t0 < 120, "the check waited for the command's child"  # a hang bound: 300 s
    assert _gone(int(pid_file.read_text())), "the command's child outlived the check"


@pytest.mark.proc
@pytest.mark.parametrize("how", ["timeout", "setsid", "orphaned-at-exit", "started-on-sigterm"])
def test_processes_that_left_the_check_are_ended_with_it(tmp_path: Path, how: str) -> None:
    """Processes the command started and that left its process group (coreutils `timeout` makes a group of
    its own; `setsid`), or that it left running when it exited, are ended with the check, and the check
    does not wait for the output they still hold."""
    pid_file = tmp_path / "child.pid"
    command = {"timeout": f"timeout 500 sh -c 'echo $$ > {pid_file}; sleep 300'",
               "setsid": f"setsid sh -c 'echo $$ > {pid_file}; sleep 300' & wait",
               "orphaned-at-exit": f"sh -c 'echo $$ > {pid_file}; sleep 300' & sleep 0.5; echo fine; exit 0",
               # the timeout's SIGTERM makes it start one more, orphaned at once
               "started-on-sigterm": f"trap \"( sh -c 'echo \\$\\$ > {pid_file}; sleep 300' & ); sleep 0.5; exit 0\" TERM; "
                                     "while :; do sleep 0.2 & wait; done"}[how]
    t0 = time.monotonic()
    h = check_node(_cfg(tmp_path, health_check="off", health_timeout="2", health_check_command=command))
    assert time.monotonic() - t0 < 60, "the check waited for what its command left behind"  # a hang bound: 300 s
    if how == "orphaned-at-exit":
        assert h.ok, h  # it exited 0: healthy, not "did not exit within 2 s"
    else:
        assert "did not exit within 2 s" in h.problems[0], h
    assert _gone(int(pid_file.read_text())), "a process of the check outlived it"


@pytest.mark.proc
def test_output_that_is_not_utf8_or_without_end_is_read_leniently_and_bounded(tmp_path: Path) -> None:
    """A command's bytes are decoded with replacement (a byte that is not UTF-8 was a UnicodeDecodeError
    out of the launcher), and only the last ``cap`` bytes of a stream are kept."""
    h = check_node(_cfg(tmp_path, health_check="off", health_check_command="printf 'gpu \\377 bad\\n' >&2; exit 1"))
    assert h.problems == ("health_check_command exited 1: gpu \ufffd bad",), h
    code, out, err = run_check(["sh", "-c", "yes | head -c 3000000; echo last"], {"PATH": os.environ["PATH"]},
                               60, cap=1000)
    assert code == 0 and len(out) <= 1000 and out.endswith("y\nlast\n") and err == "", (code, len(out), out[-20:])


@pytest.mark.proc
def test_a_stop_request_ends_the_check_unjudged(tmp_path: Path) -> None:
    """The launcher's pending stop (``stop_requested``) ends a running check with its processes: no verdict,
    CheckInterrupted. A command killed by a signal for another reason is reported as such."""
    pid_file = tmp_path / "child.pid"
    cmd = f"sleep 300 & echo $! > {pid_file}; wait"
    with pytest.raises(CheckInterrupted):
        check_node(_cfg(tmp_path, health_check="off", health_check_command=cmd, health_timeout="300"),
                   stop_requested=lambda: pid_file.exists() and bool(pid_file.read_text().strip()))
    assert _gone(int(pid_file.read_text())), "the check's processes outlived the stop"
    h = check_node(_cfg(tmp_path, health_check="off", health_check_command="echo bye; kill -9 $$"))
    assert h.problems == ("health_check_command was killed by SIGKILL: bye",), h


@pytest.mark.proc
def test_rslurm_health_ended_by_sigterm_ends_its_command_too(tmp_path: Path) -> None:
    """Slurm's SIGTERM to the check's step (a preemption) reaches `rslurm health`, not its command, which
    runs in a session of its own: the command is ended with it, not left running on the node."""
    pid_file = tmp_path / "child.pid"
    env = clean_env({"RSLURM_LOCAL_DIR": str(tmp_path / "nvme"), "RSLURM_RUN_ID": "h", "RSLURM_NODE_NAME": "n1",
                     "RSLURM_HEALTH_CHECK_COMMAND": f"sleep 300 & echo $! > {pid_file}; wait"})
    p = subprocess.Popen([sys.executable, "-m", "resilient_slurm.cli", "health", "--json"], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        child = int(_wait_file(pid_file))
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 128 + signal.SIGTERM, p.returncode
    assert _gone(child), "the health command outlived `rslurm health`"


@pytest.mark.proc
@pytest.mark.parametrize("how", ["ctrl-c-to-the-group", "sigterm-to-the-launcher"])
def test_a_stop_during_the_health_check_is_a_stop_not_a_bad_node(tmp_path: Path, how: str) -> None:
    """A stop while ``health_check_command`` runs: Ctrl-C to the launcher's whole process group (the check
    used to die of it, the node was called unhealthy and the launcher exited 75, not 130), or SIGTERM to the
    launcher alone (acted on only when the check ended, up to ``health_timeout`` later). Now the check is
    ended at once, blames no node, and the stop ends the run as a stop, without starting the ranks (they
    would only restore the step they would save again, inside the stop's deadline)."""
    pid_file, started = tmp_path / "check.pid", tmp_path / "started"
    env = clean_env({"RSLURM_LOCAL_DIR": str(tmp_path / "nvme"), "RSLURM_RUN_ID": "h", "RSLURM_NODE_NAME": "n1",
                     "RSLURM_HEALTH_TIMEOUT": "600",
                     "RSLURM_HEALTH_CHECK_COMMAND": f"sleep 600 & echo $! > {pid_file}; wait"})
    p = subprocess.Popen([sys.executable, "-m", "resilient_slurm.cli", "launch", "-n", "2", "--", sys.executable,
                          "-c", f"open({str(started)!r}, 'a').close(); import time; time.sleep(600)"], env=env,
                         stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        check = int(_wait_file(pid_file))
        if how == "ctrl-c-to-the-group":
            os.killpg(p.pid, signal.SIGINT)
        else:
            p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
    assert p.returncode == (130 if how == "ctrl-c-to-the-group" else 75), err[-4000:]
    # Ctrl-C reaches the check's command too, which dies of it or is ended: either way no node is judged
    assert re.search(r"a stop request came (during|as) the node health check", err), err[-4000:]
    assert "unhealthy" not in err, err[-4000:]
    assert _gone(check), "the health check's command outlived the stop"
    events = read_jsonl(tmp_path / "nvme" / "h" / "events.jsonl")
    check_records(read_docs(), events)
    assert not [e for e in events if e["event"] == "node_unhealthy"], events
    assert [e["signal"] for e in events if e["event"] == "signal"] == \
        ["SIGINT" if how == "ctrl-c-to-the-group" else "SIGTERM"], events
    assert [(e["signal"], e["restored_step"]) for e in events if e["event"] == "ranks_not_started"] == \
        [("SIGINT" if how == "ctrl-c-to-the-group" else "SIGTERM", None)], events
    assert not started.exists(), "a rank was started after the stop"


@pytest.mark.proc
def test_the_check_dies_with_the_launchers_process_group(tmp_path: Path) -> None:
    """The check stays in the launcher's process group: `kill -9 -PGID` (or a terminal's hangup) ends it
    with the launcher, as it ends the ranks."""
    pid_file = tmp_path / "check.pid"
    env = clean_env({"RSLURM_LOCAL_DIR": str(tmp_path / "nvme"), "RSLURM_RUN_ID": "h", "RSLURM_NODE_NAME": "n1",
                     "RSLURM_HEALTH_CHECK_COMMAND": f"sleep 600 & echo $! > {pid_file}; wait"})
    p = subprocess.Popen([sys.executable, "-m", "resilient_slurm.cli", "launch", "--", "true"], env=env,
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)
    try:
        check = int(_wait_file(pid_file))
        shell = psutil.Process(check).ppid()
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(60)
        end = time.monotonic() + 30
        while not (_gone(check) and _gone(shell)) and time.monotonic() < end:
            time.sleep(0.1)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert _gone(check) and _gone(shell), "the health check outlived its launcher's process group"


@pytest.mark.proc
def test_the_launcher_does_not_start_ranks_on_an_unhealthy_node(tmp_path: Path) -> None:
    """Local mode has no other node: the run ends as a node failure (exit 75, like any restartable end)
    without starting a rank, and says why; `rslurm health` reports the same."""
    env = clean_env({"RSLURM_LOCAL_DIR": str(tmp_path / "nvme"), "RSLURM_RUN_ID": "h", "RSLURM_NODE_NAME": "n1",
                     "RSLURM_HEALTH_CHECK_COMMAND": "echo 'gpu 3 fell off the bus'; exit 1"})
    marker = tmp_path / "started"
    r = subprocess.run([sys.executable, "-m", "resilient_slurm.cli", "launch", "-n", "2", "--", sys.executable, "-c",
                        f"open({str(marker)!r}, 'w')"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 75, r.stderr
    assert not marker.exists()
    assert "unhealthy node(s): n1: health_check_command exited 1: gpu 3 fell off the bus" in r.stderr, r.stderr
    events = read_jsonl(tmp_path / "nvme" / "h" / "events.jsonl")
    check_records(read_docs(), events)  # as docs/telemetry.md says
    [bad] = [e for e in events if e["event"] == "node_unhealthy"]
    assert bad["action"] == "exit" and bad["nodes"][0]["node"] == "n1", bad
    hist = subprocess.run([sys.executable, "-m", "resilient_slurm.cli", "history", "--json"], env=env,
                          capture_output=True, text=True, timeout=60)
    [end] = json.loads(hist.stdout)["runs"][0]["ends"]
    assert end["reason"] == "node_failure" and "gpu 3 fell off the bus" in end["evidence"], end
    h = subprocess.run([sys.executable, "-m", "resilient_slurm.cli", "health"], env=env, capture_output=True,
                       text=True, timeout=60)
    assert h.returncode == 1 and "UNHEALTHY" in h.stdout and "gpu 3 fell off the bus" in h.stdout, h.stdout
