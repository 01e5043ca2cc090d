"""The rendezvous rule and the start-up bound, as units (resilient_slurm/rendezvous.py,
resilient_slurm/launcher/startup.py).

* what Slurm and torch print, read back: ``scontrol show node -o`` records (a real 22.05 line), torch's c10d
  lines when a rank cannot reach the store (as torch 2.13 prints them);
* the checks that name a failure, against real sockets and the real resolver: a name that does not resolve,
  a port where nothing listens, one that answers;
* the verdict on a start past its bound, with the evidence injected: a failure names the address, the
  port, what failed and what to set; a node that runs no task, a one-task step and ranks past the
  rendezvous are not failures; finding a step's tasks by their marker, on real processes.

The whole path on the real cluster (a rendezvous that cannot work ends within the bound, with stacks) is
in test_launcher_slurm.py; init_distributed's own checks are in test_distributed_env.py.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import clean_env, read_jsonl

from resilient_slurm.jobenv import JobEnv
from resilient_slurm.launcher.startup import (
    RANKS_MARKER_VAR,
    LocalTask,
    NotJudged,
    StartupFailure,
    StartupWatch,
    local_tasks,
    startup_bound,
)
from resilient_slurm.rendezvous import (
    decode_node_addresses,
    encode_node_addresses,
    node_addrs_from_records,
    probe,
    rendezvous_address,
    rendezvous_failure_line,
    resolve_error,
)

# `scontrol show node -o n[1-2]` on the test cluster (Slurm 22.05), shortened in the middle.
SCONTROL = (
    "NodeName=n1 Arch=x86_64 CoresPerSocket=1  CPUAlloc=0 CPUEfctv=2 CPUTot=2 CPULoad=0.21 AvailableFeatures=(null) "
    "NodeAddr=127.0.0.1 NodeHostName=localhost Port=57345 Version=22.05.8 OS=Linux 6.18 #1 SMP  RealMemory=1000 "
    "State=IDLE Partitions=low,high\n"
    "NodeName=gpu-st-7 Arch=x86_64 NodeAddr=fd00::7 NodeHostName=ip-10-0-3-7 State=IDLE\n"
    "NodeName=cloud9 Arch=x86_64 NodeAddr=(null) State=IDLE+CLOUD+POWERED_DOWN\n")

# torch 2.13's lines for a store it cannot reach (the time and place prefix included).
C10D = ("[W1126 14:36:04.965535082 socket.cpp:764] [c10d] The IPv6 network addresses of (n1, 15003) cannot be "
        "retrieved (gai error: -2 - Name or service not known).\n"
        "[W1126 14:37:14.215788260 TCPStore.cpp:340] [c10d] TCP client failed to connect/validate to host "
        "n1:15003 - retrying (try=0, timeout=120000ms, delay=88997ms): The client socket has timed out after "
        "120000ms while trying to connect to (n1, 15003).\n")
REFUSED = "[W socket.cpp:663] [c10d] The client socket has failed to connect to [head-7]:29500 (errno: 111 - Connection refused).\n"


def test_scontrol_node_records_give_each_nodes_address() -> None:
    assert node_addrs_from_records(SCONTROL) == {"n1": "127.0.0.1", "gpu-st-7": "fd00::7"}  # cloud9: none


def test_the_address_rule() -> None:
    def resolve(host: str) -> str | None:
        return None if host == "login1" else "Name or service not known"

    assert rendezvous_address("n1", "10.0.0.1", resolve) == "10.0.0.1"  # NodeAddr wins, whatever the name
    assert rendezvous_address("login1", None, resolve) == "login1"       # a name that resolves
    assert rendezvous_address("n1", None, resolve) is None               # neither


def test_the_prolog_map_round_trips_and_drops_what_a_shell_word_cannot_carry() -> None:
    text, left_out = encode_node_addresses({"n1": "10.0.0.1", "n2": "n2", "n3": None, "bad node": "1.2.3.4",
                                            "n4": "10.0.0.4;rm"})
    assert text == "n1=10.0.0.1 n3="
    assert left_out == ["bad node", "n4"]
    assert decode_node_addresses(text) == {"n1": "10.0.0.1", "n3": ""}


def test_torchs_failure_lines_name_the_host_and_port() -> None:
    line, host, port = rendezvous_failure_line(["all fine\n", C10D])  # type: ignore[misc]
    assert (host, port) == ("n1", 15003) and line.startswith("[c10d] TCP client failed to connect")
    assert rendezvous_failure_line([REFUSED])[1:] == ("head-7", 29500)  # type: ignore[index]
    assert rendezvous_failure_line(["[c10d] Rank 0 is connected to 1 peer ranks\n", ""]) is None


def test_resolve_error_and_probe_say_what_failed() -> None:
    assert resolve_error("localhost") is None
    assert resolve_error("rdzv-host.invalid") is not None  # .invalid never resolves (RFC 2606)
    assert "'rdzv-host.invalid' does not resolve" in (probe("rdzv-host.invalid", 1) or "")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert probe("127.0.0.1", port) is None
    assert probe("127.0.0.1", port) == f"nothing listens at 127.0.0.1:{port} (connection refused)"


def test_the_bound_scales_with_the_job_and_off_is_never() -> None:
    assert startup_bound(None, 2) == 300.5 and startup_bound(None, 4000) == 1300.0
    assert startup_bound(20.0, 4000) == 20.0
    watch = StartupWatch(startup_bound(float("inf"), 2), marker="m", node="n1", started_at=0.0)
    assert not watch.due(1e12, lambda: False)


def test_the_watch_is_due_once_past_the_bound_and_only_when_nothing_started() -> None:
    asked: list[float] = []

    def started() -> bool:
        asked.append(1)
        return False

    watch = StartupWatch(20.0, marker="m", node="n1", started_at=100.0)
    assert not watch.due(119.0, started) and asked == []  # not asked before the bound
    assert watch.due(120.5, started) and not watch.due(200.0, started) and len(asked) == 1
    watch = StartupWatch(20.0, marker="m", node="n1", started_at=100.0)
    assert not watch.due(121.0, lambda: True)


def _task(rank: int, **env: str) -> LocalTask:
    return LocalTask(1000 + rank, JobEnv.from_env({"RANK": str(rank), "WORLD_SIZE": "2", "SLURM_STEP_ID": "0",
                                                   "MASTER_PORT": "15003", **env}, warn=False))


STUCK = "Thread 7 (idle): \"MainThread\"\n    _create_c10d_store (torch/distributed/rendezvous.py:199)\n" \
        "    init_process_group (torch/distributed/distributed_c10d.py:1892)\n    main (train.py:40)\n"
TRAINING = "Thread 7 (active): \"MainThread\"\n    forward (model.py:12)\n    main (train.py:80)\n"


def test_a_failed_start_names_the_address_the_port_what_failed_and_what_to_set(tmp_path: Path) -> None:
    watch = StartupWatch(20.0, marker="m", node="n1", started_at=0.0, user_addr="rdzv-host.invalid")
    probed: list[tuple[str, int]] = []

    def prober(host: str, port: int) -> str | None:
        probed.append((host, port))
        return f"{host!r} does not resolve (Name or service not known)"

    verdict = watch.examine(C10D, str(tmp_path), tasks=lambda m, n: [_task(0, MASTER_ADDR="rdzv-host.invalid")],
                            dump=lambda pid, d, r: (f"{d}/stacks/rank{r}.py-spy.txt", STUCK), prober=prober)
    assert isinstance(verdict, StartupFailure), verdict
    # The ranks' own line names the host they tried (n1 here, as torch printed it): that is what is probed.
    assert probed == [("n1", 15003)] and (verdict.addr, verdict.port) == ("n1", 15003)
    assert verdict.in_rendezvous == (0,) and verdict.stacks == (f"{tmp_path}/stacks/rank0.py-spy.txt",)
    text = verdict.message()
    for words in ("no rank on n1 built its Checkpointer within 20 s", "n1:15003", "MASTER_ADDR set for the job",
                  "'n1' does not resolve", "a rank said: [c10d] TCP client failed to connect", "rank(s) 0 on n1",
                  f"stacks: {tmp_path}/stacks", "set MASTER_ADDR to an address of the node that runs rank 0",
                  "RSLURM_STARTUP_TIMEOUT", "startup_timeout=off"):
        assert words in text, (words, text)


def test_a_derived_address_points_at_slurms_node_addr_and_no_py_spy_is_said(tmp_path: Path) -> None:
    watch = StartupWatch(20.0, marker="m", node="n1", started_at=0.0, expected={"n1": "10.0.0.1", "n2": None})
    verdict = watch.examine("", str(tmp_path), tasks=lambda m, n: [_task(0, MASTER_ADDR="10.0.0.1")],
                            dump=lambda pid, d, r: None, prober=lambda h, p: f"{h}:{p} did not answer within 3 s")
    assert isinstance(verdict, StartupFailure) and verdict.stacks == ()
    text = verdict.message()
    assert "10.0.0.1:15003 (derived by rslurm: NodeAddr of n1)" in text, text
    assert "from n1, 10.0.0.1:15003 did not answer within 3 s" in text
    assert "no stacks: py-spy could not read the ranks" in text and "NodeAddr in slurm.conf" in text


@pytest.mark.parametrize(("tasks", "stacks", "stderr", "why"), [
    ([], TRAINING, "", "no task of the ranks' step runs on n1"),
    ([_task(0, WORLD_SIZE="1")], STUCK, "", "the step has one task"),
    ([_task(0), _task(1)], TRAINING, "", "their stacks show them past the rendezvous"),
], ids=["no task here", "one task", "past the rendezvous"])
def test_what_is_not_a_failed_start(tmp_path: Path, tasks: list[LocalTask], stacks: str, stderr: str,
                                    why: str) -> None:
    watch = StartupWatch(20.0, marker="m", node="n1", started_at=0.0)
    verdict = watch.examine(stderr, str(tmp_path), tasks=lambda m, n: tasks,
                            dump=lambda pid, d, r: (f"{d}/rank{r}", stacks), prober=lambda h, p: None)
    assert isinstance(verdict, NotJudged) and why in verdict.why, verdict


def test_ranks_past_the_rendezvous_after_c10d_complained_are_still_a_failed_start(tmp_path: Path) -> None:
    """torch's failure line is evidence on its own: a rank elsewhere could not reach the store."""
    watch = StartupWatch(20.0, marker="m", node="n1", started_at=0.0)
    verdict = watch.examine(REFUSED, str(tmp_path), tasks=lambda m, n: [_task(0)],
                            dump=lambda pid, d, r: (f"{d}/rank{r}", TRAINING), prober=lambda h, p: None)
    assert isinstance(verdict, StartupFailure) and verdict.addr == "head-7", verdict
    assert "head-7:29500 answers (so the ranks fail elsewhere" in verdict.message()


@pytest.mark.proc
def test_local_tasks_are_found_by_their_marker_on_this_node(tmp_path: Path) -> None:
    """Real processes: a task (the marker, a step id, this node) started by a shell that lacks the marker,
    as slurmstepd starts them; its own child inherits the marker and is not a task; a task of another node
    and one of another step are not found."""
    child = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
    sleeper = "import time; time.sleep(60)"
    tasks = [("mk", "n1", "3", child), ("mk", "n2", "4", sleeper), ("other", "n1", "5", sleeper)]
    script = " ".join(f"env {RANKS_MARKER_VAR}={m} SLURM_STEP_ID=0 SLURMD_NODENAME={n} RANK={r} "
                      f"{sys.executable} -c \"{code}\" &" for m, n, r, code in tasks) + " wait"
    proc = subprocess.Popen(["sh", "-c", script], env=clean_env(), start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        found: list[LocalTask] = []
        while time.monotonic() < deadline:
            found = local_tasks("mk", "n1")
            if found and len(subprocess.run(["pgrep", "-s", str(proc.pid)], capture_output=True,
                                            text=True).stdout.split()) >= 5:
                break
            time.sleep(0.2)
        found = local_tasks("mk", "n1")
        assert [t.rank for t in found] == [3], found
        assert local_tasks("mk", None) and {t.rank for t in local_tasks("mk", None)} == {3, 4}
    finally:
        subprocess.run(["pkill", "-KILL", "-s", str(proc.pid)], check=False)
        proc.wait(timeout=30)


def test_a_start_that_cannot_be_judged_is_logged_and_recorded(tmp_path: Path, home: Path) -> None:
    """A launcher whose bound passed while no task of its step runs on its node (here: no task at all)
    says why it cannot judge, records ``startup_not_judged`` as docs/telemetry.md describes it, and
    leaves the ranks alone."""
    from test_telemetry import check_records, read_docs

    from resilient_slurm.launcher.launch import Launcher

    launcher = Launcher(["true"], env={"HOME": str(home), "RSLURM_LOCAL_DIR": str(tmp_path / "nvme"),
                                       "RSLURM_CONTROL_DIR": str(tmp_path / "ctl"), "RSLURM_RUN_ID": "r"})
    launcher.startup = StartupWatch(20.0, marker="no-such-step", node=launcher.node, started_at=0.0)

    class Step:
        torn_down = False

        def stderr_tail(self, index: int = 0) -> str:
            return ""

        def teardown(self, grace: float) -> None:
            self.torn_down = True

    step = Step()
    launcher._on_startup_timeout(step)  # type: ignore[arg-type]
    assert launcher.startup_failure is None and not step.torn_down
    events = read_jsonl(tmp_path / "nvme" / "r" / "events.jsonl")
    check_records(read_docs(), events)
    [e] = events
    assert e["event"] == "startup_not_judged" and "no task of the ranks' step runs on" in e["why"], e

