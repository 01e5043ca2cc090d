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
from test_launcher_local import REQUEUE, Sandbox, sandbox, wait_for, wait_for_steps  # noqa: F401

from resilient_slurm.control import ControlServer, ErrorCode

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
