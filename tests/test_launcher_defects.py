"""Two launcher defects, with real sockets, real processes and real signals.

* A phantom rank on the control socket: any process of the job's uid could say ``hello`` as a rank the job
  does not have (rank 7 of a 2-rank job), and the save request then waited for that rank's commit. The
  launcher now refuses such a hello (``unknown_rank``) and never waits for it.
* A rank that ended on the SIGTERM the launcher itself forwarded was reported as "killed by SIGTERM", as if
  someone else had killed it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import read_jsonl
from test_launcher_local import (  # noqa: F401
    REQUEUE,
    Sandbox,
    assert_emergency_at_last_logged_step,
    sandbox,
    wait_for,
    wait_for_steps,
)

from resilient_slurm.control import ControlServer, ErrorCode
from resilient_slurm.launcher.launch import Launcher
from resilient_slurm.launcher.outcome import classify_outcome
from resilient_slurm.launcher.policy import Reason, RequeuePolicy
from resilient_slurm.launcher.processes import LocalRanks, RankExit
from resilient_slurm.run_history import ProgressHistory

pytestmark = pytest.mark.proc  # every test here starts processes (tests/check_tier.py)

REPO = Path(__file__).resolve().parent.parent

# hello as RANK on SOCK, print the outcome as JSON: {"ok": true} or {"code": ...}; with WAIT, then wait for
# the save request and report the emergency commit of step 5. With CHILD, do it from a child process (a
# rank that is the launched process's descendant, as under torchrun). Waits for a line on stdin first.
CLIENT = textwrap.dedent("""
    import json, os, subprocess, sys, time
    from resilient_slurm.control import ControlClient
    from resilient_slurm.errors import ControlRejectedError
    sock, rank, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    if mode == "child":
        sys.stdin.readline()
        sys.exit(subprocess.run([sys.executable, "-c", sys.argv[4], sock, str(rank), "wait", sys.argv[4]],
                                stdin=subprocess.DEVNULL).returncode)
    if mode != "wait":
        sys.stdin.readline()
    with ControlClient(sock, timeout=10) as c:
        try:
            c.hello(rank, rank, step=0)
        except ControlRejectedError as exc:
            print(json.dumps({"code": exc.code, "pid": os.getpid()}), flush=True)
            sys.exit(0)
        print(json.dumps({"ok": True, "pid": os.getpid()}), flush=True)
        if mode in ("wait", "go-wait"):
            end = time.monotonic() + 60
            while not c.poll(rank, 5).get("save_requested"):
                if time.monotonic() > end:
                    sys.exit(3)
                time.sleep(0.02)
            c.committed(rank, 5, "emergency")
""")


def client(sock: str, rank: int, mode: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", CLIENT, sock, str(rank), mode, CLIENT], cwd=REPO,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def go(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.write("go\n")
    proc.stdin.flush()


def finish(proc: subprocess.Popen[str]) -> dict:
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, f"client exited {proc.returncode}: {out}"
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture
def sock_path() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="rsl-", dir="/tmp")  # short: Unix socket paths have 107 bytes
    yield os.path.join(d, "run", "42.n1.sock")
    shutil.rmtree(d, ignore_errors=True)


# --------------------------------------------------------------------------- defect 1: phantom ranks
def test_a_phantom_hello_is_refused_and_the_save_request_does_not_wait_for_it(
        sock_path: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="resilient_slurm.control.server")
    with ControlServer(sock_path) as srv:
        srv.state.expect_ranks(2)
        # Same uid, as a rank the job does not have.
        outside = client(sock_path, 7, "go")
        go(outside)
        out7 = finish(outside)
        assert out7 == {"code": ErrorCode.UNKNOWN_RANK, "pid": outside.pid}, out7
        assert srv.status()["ranks"] == {}, "a refused hello registered a rank"
        said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any("rank 7" in m and "world size 2" in m and f"peer pid {outside.pid}" in m for m in said), said

        # The job's ranks: rank 0 a launched process, rank 1 a child of one (as under torchrun).
        rank0 = client(sock_path, 0, "go-wait")
        rank1 = client(sock_path, 1, "child")
        go(rank0)
        go(rank1)
        end = time.monotonic() + 60
        while len(srv.status()["ranks"]) < 2 and time.monotonic() < end:
            time.sleep(0.02)
        srv.request_save("emergency", time.time() + 300)
        assert finish(rank0)["ok"]
        out, _ = rank1.communicate(timeout=60)
        assert rank1.returncode == 0, out
        assert json.loads(out.strip().splitlines()[-1])["ok"], out

        st = srv.status()
        assert sorted(st["ranks"]) == ["0", "1"], st
        assert st["last_committed"]["complete"], st
        assert srv.state.save_request is None, f"the save request still waits for a rank: {st}"

    # A world size not known (under srun, or one local process): any rank number registers.
    with ControlServer(sock_path) as srv:
        srv.state.expect_ranks(None)
        anyrank = client(sock_path, 7, "go")
        go(anyrank)
        assert finish(anyrank)["ok"]
        assert sorted(srv.status()["ranks"]) == ["7"]


def test_a_hello_as_a_rank_whose_process_still_runs_is_refused(sock_path: str) -> None:
    """Another process saying hello as rank 1 while rank 1's process still runs replaced its entry, and the
    launcher then waited for the impostor's commit. A rank registers again only once its old process ended
    (a restarted rank), or from the same process."""
    with ControlServer(sock_path) as srv:
        srv.state.expect_ranks(2)
        rank1 = client(sock_path, 1, "go-wait")
        go(rank1)
        end = time.monotonic() + 60
        while "1" not in srv.status()["ranks"] and time.monotonic() < end:
            time.sleep(0.02)
        impostor = client(sock_path, 1, "go")
        go(impostor)
        assert finish(impostor)["code"] == ErrorCode.UNKNOWN_RANK
        assert srv.status()["ranks"]["1"]["pid"] == rank1.pid, srv.status()
        srv.request_save("emergency", time.time() + 300)
        assert finish(rank1)["ok"]  # it committed, and ended
        assert srv.status()["ranks"]["1"]["committed_step"] == 5, srv.status()  # the real rank's commit
        again = client(sock_path, 1, "go")  # a restarted rank 1: its old process has ended
        go(again)
        assert finish(again)["ok"]
        assert srv.status()["ranks"]["1"]["pid"] == again.pid


def test_a_launcher_does_not_wait_for_a_phantom_ranks_emergency_commit(sandbox: Sandbox) -> None:  # noqa: F811
    sb = sandbox
    run = sb.launch(sb.toy())
    wait_for_steps(sb, run, 4)
    socks = list(sb.ctl.glob("*.sock"))
    assert len(socks) == 1, socks
    phantom = client(str(socks[0]), 7, "go")
    go(phantom)
    assert finish(phantom)["code"] == ErrorCode.UNKNOWN_RANK
    run.signal(signal.SIGTERM)
    rc = run.wait(60)
    err = run.stderr()
    assert rc == REQUEUE, f"exit code {rc}:\n{err[-4000:]}"
    assert f"rank 7 is outside the job's world size 2 (ranks 0-1); hello from peer pid {phantom.pid}" in err, err
    events = [e for e in read_jsonl(sb.run_dir / "events.jsonl") if e["source"] == "launcher"]
    assert [e["event"] for e in events].count("committed") == 1, \
        f"the launcher never saw the emergency commit complete:\n{events}\n{err[-4000:]}"
    assert "missed the deadline" not in err, err[-4000:]


# --------------------------------------------------------------------------- defect 2: the forwarded SIGTERM
# Rank 0 dies on SIGTERM (its default action); rank 1 traps it and exits 0 once rank 0 is gone, so the
# launcher always sees rank 0 end while rank 1 still runs. Neither talks to the control socket, so the
# launcher forwards SIGTERM. Writes ready.<RANK> with its pid.
ON_SIGTERM = textwrap.dedent("""
    import json, os, signal, sys, time
    rank = os.environ["RANK"]
    root = sys.argv[1]
    def leave(*_):
        with open(os.path.join(root, "ready.0")) as f:
            pid0 = json.load(f)["pid"]
        end = time.monotonic() + 60
        while os.path.exists(f"/proc/{pid0}") and time.monotonic() < end:
            time.sleep(0.02)
        os._exit(0)
    if rank == "1":
        signal.signal(signal.SIGTERM, leave)
    path = os.path.join(root, "ready." + rank)
    with open(path + ".tmp", "w") as f:
        json.dump({"pid": os.getpid()}, f)
    os.rename(path + ".tmp", path)
    while True:
        time.sleep(1)
""")


def test_a_rank_that_ends_on_the_sigterm_the_launcher_forwarded_is_not_called_killed(
        sandbox: Sandbox) -> None:  # noqa: F811
    sb = sandbox
    run = sb.launch([sys.executable, "-c", ON_SIGTERM, str(sb.root)])
    wait_for(lambda: all((sb.root / f"ready.{r}").exists() for r in range(2)), "both ranks to start", run)
    run.signal(signal.SIGTERM)
    rc = run.wait(60)
    err = run.stderr()
    assert "rank 0 ended on the SIGTERM the launcher forwarded (SIGTERM: preempted)" in err, err[-4000:]
    assert "was killed by SIGTERM" not in err, err[-4000:]
    # What follows is unchanged: a stop the launcher asked for, resumable by the same command.
    assert rc == REQUEUE, f"exit code {rc}:\n{err[-4000:]}"
    assert "stopped (stopped by SIGTERM); nothing is committed: run the same command again to resume" in err, \
        err[-4000:]


# --------------------------------------------------------------------------- a rank that leaves early
# Two gloo ranks allreduce in a loop; rank 1 leaves it after 3 steps and exits 0 (as on uneven data across
# ranks); rank 0's 4th collective then fails at once (the peer closed its connections), well within one
# look of the launcher's loop: the launcher orders the two ends by when each process ended.
LEAVES_EARLY = textwrap.dedent("""
    import sys
    import torch, torch.distributed as dist
    dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=60))
    rank = dist.get_rank()
    for step in range(1, 11):
        t = torch.ones(4)
        dist.all_reduce(t)
        print(f"rank {rank} step {step}", file=sys.stderr, flush=True)
        if rank == 1 and step == 3:
            break  # its data ran out: it leaves the loop, cleans up and ends as a finished program does
    dist.destroy_process_group()
""")


def test_a_rank_that_exits_0_while_its_peers_train_is_the_programs_error_not_a_communicator_one(
        sandbox: Sandbox) -> None:  # noqa: F811
    sb = sandbox
    run = sb.launch([sys.executable, "-c", LEAVES_EARLY])
    rc = run.wait(120)
    err = run.stderr()
    # Not restarted in the job nor requeued (a restart ends the same way): the program's error, with its cause.
    assert rc == 1, f"exit code {rc}:\n{err[-4000:]}"
    decision = [line for line in err.splitlines() if "not requeued" in line]
    assert decision and "rank 1 exited 0" in decision[-1] and "uneven data across ranks" in decision[-1], \
        err[-4000:]
    assert "in-job restart" not in err, err[-4000:]
    history = [e for e in read_jsonl(sb.run_dir / "events.jsonl") if e.get("event") == "run_end"] \
        if (sb.run_dir / "events.jsonl").exists() else []
    assert all(e.get("reason") in (None, "user_error") for e in history), history


class _Ended(LocalRanks):
    """Local ranks that ended as given (nothing started): their exits, stderr tails and early leavers."""

    def __init__(self, exits: list[RankExit], tails: dict[int, str], left: dict[int, float]) -> None:
        super().__init__(["true"], len(exits), {}, 0)
        self._exits, self._tails = exits, tails
        self._left_early = dict(left)

    def exits(self) -> list[RankExit]:
        return self._exits

    def stderr_tail(self, index: int = 0) -> str:
        return self._tails.get(index, "")


def _traceback(line: str) -> str:
    return f'Traceback (most recent call last):\n  File "train.py", line 9, in <module>\n{line}\n'


@pytest.mark.parametrize(("error", "left", "reason"), [
    ("RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.0.0.2]:4480", {1: 1.0},
     Reason.USER_ERROR),
    ("RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error [10.0.0.2]:32465: Connection reset by peer",
     {1: 1.0}, Reason.USER_ERROR),
    # The network stopped answering: not the rank that ended, whatever it did.
    ("RuntimeError: [gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 60000ms for recv operation",
     {1: 1.0}, Reason.COMMUNICATOR_ERROR),
    # No rank ended on its own first (rank 1 was torn down, or failed): the collective error as before.
    ("RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.0.0.2]:4480", {},
     Reason.COMMUNICATOR_ERROR),
], ids=["closed", "reset", "timeout", "no-early-exit"])
def test_only_a_peer_that_ended_on_its_own_and_closed_its_connections_makes_it_the_programs_error(
        tmp_path: Path, error: str, left: dict[int, float], reason: Reason) -> None:
    env = {"HOME": str(tmp_path), "RSLURM_LOCAL_DIR": str(tmp_path / "nvme"), "RSLURM_RUN_ID": "toy",
           "RSLURM_CONTROL_DIR": str(tmp_path / "ctl")}
    launcher = Launcher(["true"], env=env, nprocs=2)
    children = _Ended([RankExit(0, 1, None), RankExit(1, 0, None)], {0: _traceback(error)}, left)
    outcome = classify_outcome(launcher, children, None)
    assert outcome.reason is reason, outcome
    decision = RequeuePolicy().decide(outcome, ProgressHistory())
    if reason is Reason.USER_ERROR:
        assert outcome.rank == 0 and outcome.evidence.startswith("rank 1 exited 0 while the others ran"), outcome
        assert decision.exit_code == 1 and decision.message.startswith("not requeued: rank 1 exited 0"), decision
    else:
        assert "exited 0" not in outcome.evidence, outcome


# --------------------------------------------------------------------------- a stop delivered twice
def test_a_sigterm_delivered_twice_still_gets_its_emergency_save(sandbox: Sandbox) -> None:  # noqa: F811
    """Two SIGTERMs a moment apart (to the process group and to the launcher, two supervisors) are one stop:
    the ranks still commit their emergency step and the launcher exits 75. The second one used to count as
    a second Ctrl-C and tear the ranks down mid-save."""
    sb = sandbox
    run = sb.launch(sb.toy())
    wait_for_steps(sb, run, 6)
    run.signal(signal.SIGTERM)
    run.signal(signal.SIGTERM)
    rc = run.wait(60)
    err = run.stderr()
    assert rc == REQUEUE, f"exit code {rc}:\n{err[-4000:]}"
    assert "tearing the ranks down now" not in err and "tore down" not in err, err[-4000:]
    assert_emergency_at_last_logged_step(sb)
