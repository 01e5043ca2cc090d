"""Failure attribution: every class produced for real and recognised, with its evidence, kept in the run's
history and shown by ``rslurm history`` and ``rslurm status``.

Real runs in local mode (``rslurm launch -n 2``, gloo, real signals; tests/workers/hang_worker.py):

* a rank that stops (SIGSTOP): its peer's collective times out (gloo) -> ``communicator_error``,
  restarted in-job, bitwise identical to a run never interrupted;
* a rank that allocates until the kernel's OOM killer ends it, inside a memory-limited cgroup
  (root only) -> ``out_of_memory`` with the cgroup's ``oom_kill`` counter as evidence, restarted in-job,
  bitwise;
* a rank that raises MemoryError -> ``out_of_memory`` raised by the program: not restarted, exit 1;
* a rank SIGKILLed -> ``killed_by_signal`` (test_hang.py restarts it and checks its history rows).

Preemption, the time limit, cloud notices, hangs and user errors are produced in test_launcher_slurm.py,
test_cloud*.py, test_hang.py and test_launcher_local.py; their ``decision`` events carry the evidence this
file's units check the wording of. The classification itself (srun's lines, NCCL's, a user error whose
peers then fail in a collective) is tested as units on the texts those tools print.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import clean_env
from test_hang import WORKER, _assert_like, _cli, _events, _history, _reference, _restored_steps

from resilient_slurm.launcher.attribution import (
    HangCause,
    OomCounters,
    attribute_failure,
    attribute_hang,
    exception_lines,
)
from resilient_slurm.launcher.hang import Hang, Stuck
from resilient_slurm.launcher.policy import Reason
from resilient_slurm.launcher.processes import RankExit, parse_task_line

STEPS = 12


def _launch(tmp: Path, out: Path, *worker_args: str, env: dict[str, str] | None = None, prefix: list[str] | None = None,
            timeout: float = 300) -> subprocess.CompletedProcess[str]:
    e = clean_env({"RSLURM_LOCAL_DIR": str(tmp / "nvme"), "RSLURM_RUN_ID": "hang", "RSLURM_NODE_NAME": "n1",
                   "RSLURM_CONTROL_DIR": str(tmp / "ctl"), "RSLURM_DAEMON": "off", **(env or {})})
    return subprocess.run([*(prefix or []), sys.executable, "-m", "resilient_slurm.cli", "launch", "-n", "2", "--",
                           *WORKER, "--steps", str(STEPS), "--out", str(out), *worker_args],
                          env=e, cwd=tmp, capture_output=True, text=True, timeout=timeout)


def _work(tmp_path: Path) -> tuple[Path, Path]:
    work = tmp_path / "work"
    out = work / "out"
    out.mkdir(parents=True)
    return work, out


# ------------------------------------------------------------------------------------------------ real runs
@pytest.mark.proc
def test_a_stopped_peer_is_a_communicator_error_restarted_in_job(tmp_path: Path) -> None:
    """Rank 1 stops (SIGSTOP, every thread) while step 8's save is being committed: its shard written, the commit's
    collective not joined. Rank 0's next all_reduce times out after 5 s (gloo): a communicator error on rank 0,
    not a user error. Its checkpoint writer waits in the commit's collective with the stopped rank; rank 0's exit
    waits for it at most EXIT_RANK_WAIT_S, not collective_timeout, so the run is not ended by the hang watch. The
    stopped rank is torn down (at once: it cannot exit by itself, and its SIGTERM is followed by SIGCONT), both
    restart in-job from the last commit (step 6) and end bitwise; the history and status name the class and
    gloo's line."""
    ref = _reference()
    work, out = _work(tmp_path)
    r = _launch(work, out, "--crash-at", "7", "--crash-rank", "1", "--crash-after-commit",
                "--failpoint", "after_shard_write=stop", "--pg-timeout", "5")
    assert r.returncode == 0, r.stderr[-4000:]
    assert "while the checkpoint writer (the save of step 8) has waited" in r.stderr, r.stderr[-4000:]
    assert not [e for e in _events(work) if e["event"] == "hang"], r.stderr[-4000:]
    # The stopped rank cannot exit by itself: it is torn down once seen stopped, not after the 30 s wait.
    assert "rank 1 stopped (SIGSTOP) after a rank failed" in r.stderr, r.stderr[-4000:]
    [restart] = [e for e in _events(work) if e["event"] == "in_job_restart"]
    assert restart["outcome"] == "communicator_error", restart
    assert "rank 0" in restart["detail"] or "Timed out" in restart["detail"], restart
    assert _restored_steps(work) == [restart["committed_step"]] == [6]
    _assert_like(ref, out)
    ends = _history(work)
    assert [(e["kind"], e["class"]) for e in ends] == [("in_job_restart", "communicator error"),
                                                       ("incarnation", "completed")], ends
    assert "Timed out" in ends[0]["evidence"] or "gloo" in ends[0]["evidence"].lower(), ends[0]
    table = _cli(work, "history", "--run-id", "hang")
    assert table.returncode == 0 and "communicator error" in table.stdout and "completed" in table.stdout, table
    status = _cli(work, "status", "--run-id", "hang")
    assert status.returncode == 0 and "last end     run hang: completed" in status.stdout, status.stdout
    assert "1 communicator error" in status.stdout, status.stdout


@pytest.mark.proc
def test_memory_error_raised_by_the_program_is_out_of_memory_and_not_restarted(tmp_path: Path) -> None:
    work, out = _work(tmp_path)
    r = _launch(work, out, "--crash-at", "5", "--crash-rank", "1", "--crash-signal", "MEMORYERROR")
    assert r.returncode == 1, r.stderr[-4000:]
    assert "ran out of memory" in r.stderr and "MemoryError" in r.stderr, r.stderr[-3000:]
    assert not [e for e in _events(work) if e["event"] == "in_job_restart"]
    [end] = _history(work)
    assert end["reason"] == "out_of_memory" and end["rank"] == 1 and end["action"] == "exit", end
    assert end["evidence"].startswith("MemoryError: hang_worker: out of memory on purpose"), end


def _memory_cgroup(limit: int) -> Iterator[Path]:
    """A fresh memory cgroup limited to ``limit`` bytes (no swap), v1 or v2; skips without root or a
    writable memory controller."""
    if os.geteuid() != 0:
        pytest.skip("a memory cgroup needs root")
    name = f"rslurmtest-{os.getpid()}"
    v1 = Path("/sys/fs/cgroup/memory")
    v2 = Path("/sys/fs/cgroup")
    if (v1 / "memory.limit_in_bytes").exists():
        d = v1 / name
        files = [("memory.limit_in_bytes", str(limit)), ("memory.memsw.limit_in_bytes", str(limit))]
    elif "memory" in (v2 / "cgroup.controllers").read_text(errors="replace") if (v2 / "cgroup.controllers").exists() else False:
        d = v2 / name
        files = [("memory.max", str(limit)), ("memory.swap.max", "0")]
    else:
        pytest.skip("no memory cgroup controller here")
    try:
        d.mkdir()
        for f, v in files:
            if (d / f).exists():
                (d / f).write_text(v)
    except OSError as exc:
        with contextlib.suppress(OSError):
            d.rmdir()
        pytest.skip(f"cannot create a memory cgroup: {exc}")
    try:
        yield d
    finally:
        for _ in range(50):
            try:
                d.rmdir()
                break
            except OSError:
                import time

                time.sleep(0.1)


@pytest.mark.proc
def test_a_rank_killed_by_the_oom_killer_is_out_of_memory_restarted_in_job(tmp_path: Path) -> None:
    """The launcher and its ranks run in a cgroup limited to 2.5 GiB; rank 1 allocates after step 7 until
    the kernel kills it. The launcher reads the cgroup's oom_kill counter: out_of_memory, with the counter
    as evidence, restarted in-job from the last commit, bitwise."""
    ref = _reference()
    work, out = _work(tmp_path)
    gen = _memory_cgroup(int(2.5 * 2**30))
    cg = next(gen)
    try:
        enter = ["sh", "-c", f'echo $$ > {cg}/cgroup.procs && exec "$@"', "sh"]
        r = _launch(work, out, "--crash-at", "7", "--crash-rank", "1", "--crash-signal", "OOM", prefix=enter)
    finally:
        with contextlib.suppress(StopIteration):
            next(gen)
    assert r.returncode == 0, r.stderr[-4000:]
    [restart] = [e for e in _events(work) if e["event"] == "in_job_restart"]
    assert restart["outcome"] == "out_of_memory", restart
    ends = _history(work)
    assert ends[0]["reason"] == "out_of_memory" and "oom_kill 0 -> 1" in ends[0]["evidence"], ends
    assert "rank 1 killed by SIGKILL" in ends[0]["evidence"], ends
    _assert_like(ref, out)


# ------------------------------------------------------------------------------------------------ units
GLOO = ("Traceback (most recent call last):\n  File \"train.py\", line 40, in <module>\n    dist.all_reduce(p)\n"
        "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:5000\n")
USER = ("Traceback (most recent call last):\n  File \"train.py\", line 12, in <module>\n    main()\n"
        "ValueError: bad batch\n")


def _exit(rank: int, code: int | None = None, sig: int | None = None, **kw: object) -> RankExit:
    return RankExit(rank, code, sig, **kw)  # type: ignore[arg-type]


def test_exception_lines_per_rank_prefix() -> None:
    text = ("[rank1]: Traceback (most recent call last):\n[rank0]: Traceback (most recent call last):\n"
            "[rank1]:   File \"a.py\", line 1\n[rank1]: KeyError: 'x'\n[rank0]:   File \"b.py\", line 2\n"
            "[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n")
    assert exception_lines(text, 1) == ["KeyError: 'x'"]
    assert exception_lines(text, 0) == ["torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"]
    assert exception_lines(text) == ["KeyError: 'x'", "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"]
    assert exception_lines("no traceback here\n") == []


RDZV_UNRESOLVED = ("Traceback (most recent call last):\n  File \"train.py\", line 9, in <module>\n"
                   "resilient_slurm.errors.RendezvousError: rank 1 of 2: the rendezvous address 'n1' (port 15001; "
                   "from node n1, the first of SLURM_STEP_NODELIST: Slurm gave no NodeAddr for it) does not "
                   "resolve on n2: Name or service not known. Set MASTER_ADDR ...\n")
RDZV_TIMEOUT = ("Traceback (most recent call last):\n  File \"train.py\", line 9, in <module>\n"
                "torch.distributed.DistStoreError: Timed out after 61 seconds waiting for clients. 1/2 clients "
                "joined.\n")


TEARDOWN = ("terminate called without an active exception\nFatal Python error: Aborted\n\n"
            "Thread 0x00007f3036c76b80 (most recent call first):\n  <no Python frame>\n")
RAISED_THEN_ABORTED = ("[rank1]: Traceback (most recent call last):\n[rank1]:   File \"hang_worker.py\", line 57, in "
                       "_crash\n[rank1]:     raise MemoryError(\"hang_worker: out of memory on purpose\")\n"
                       "[rank1]: MemoryError: hang_worker: out of memory on purpose\n" + TEARDOWN)


@pytest.mark.parametrize(("failed", "stderr", "srun", "oom", "reason", "evidence"), [
    ([_exit(0, 1)], {0: GLOO}, "", None, Reason.COMMUNICATOR_ERROR, "Connection closed by peer"),
    # a user error on rank 1 makes rank 0's collective fail: the user error is the cause, whatever ended first
    ([_exit(0, 1), _exit(1, 1)], {0: GLOO, 1: USER}, "", None, Reason.USER_ERROR, "ValueError: bad batch"),
    ([_exit(1, 1)], {1: "Traceback (most recent call last):\n  File \"t.py\", line 3\n"
                        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB\n"}, "", None,
     Reason.OUT_OF_MEMORY, "CUDA out of memory"),
    ([_exit(1, None, 9, node="n2")], {}, "", None, Reason.KILLED_BY_SIGNAL, "rank 1 on n2 killed by SIGKILL"),
    ([_exit(1, None, 9)], {}, "", "memory cgroup /x: oom_kill 0 -> 1", Reason.OUT_OF_MEMORY, "oom_kill 0 -> 1"),
    (parse_task_line("srun: error: n2: task 1: Out Of Memory"), {}, "", None, Reason.OUT_OF_MEMORY,
     "srun: Out Of Memory"),
    ([_exit(1, None, 9)], {}, "slurmstepd: error: Detected 1 oom_kill event in StepId=12.0. Some of the step tasks "
     "have been OOM Killed.\n", None, Reason.OUT_OF_MEMORY, "Detected 1 oom_kill event"),
    ([_exit(0, None, int(signal.SIGABRT))],
     {0: "[rank0]:[E ProcessGroupNCCL.cpp:1182] [Rank 0] Watchdog caught collective operation timeout: "
         "WorkNCCL(SeqNum=5, OpType=ALLREDUCE) ran for 600000 milliseconds before timing out.\n"},
     "", None, Reason.COMMUNICATOR_ERROR, "Watchdog caught collective operation timeout"),
    # MemoryError raised, then the interpreter's exit aborted by a C++ thread still running (CI, 2026-11-29)
    ([_exit(1, None, int(signal.SIGABRT)), _exit(0, 1)], {1: RAISED_THEN_ABORTED, 0: GLOO}, "", None,
     Reason.OUT_OF_MEMORY, "MemoryError: hang_worker: out of memory on purpose"),
    # a handled error's traceback, more output, then an abort: a signal, not that exception
    ([_exit(1, None, int(signal.SIGABRT))], {1: USER + "step 7\n" + TEARDOWN}, "", None,
     Reason.KILLED_BY_SIGNAL, "rank 1 killed by SIGABRT"),
    ([_exit(1, None, 9, node="n2")], {}, "srun: error: Node failure on n2\n", None, Reason.NODE_FAILURE,
     "Node failure on n2"),
    ([_exit(0, 3)], {0: "exiting with 3\n"}, "", None, Reason.USER_ERROR, ""),
    # init_distributed's own error (the address does not resolve) while the peer times out in the store
    ([_exit(0, 1), _exit(1, 1)], {0: RDZV_TIMEOUT, 1: RDZV_UNRESOLVED}, "", None, Reason.STARTUP,
     "the rendezvous address 'n1' (port 15001; from node n1, the first of SLURM_STEP_NODELIST"),
], ids=["gloo peer closed", "user error beats the peers' collective errors", "cuda oom raised",
        "sigkill", "oom counter", "srun out of memory", "slurmstepd oom event", "nccl watchdog abort",
        "raised then aborted at exit", "aborted long after a handled error", "srun node failure", "exit code without traceback", "rendezvous error is a failed start"])
def test_attribution_of_what_the_tools_print(failed: list[RankExit], stderr: dict[int, str], srun: str,
                                             oom: str | None, reason: Reason, evidence: str) -> None:
    att = attribute_failure(failed, lambda e: stderr.get(e.rank or 0, ""), oom_evidence=oom, srun_text=srun)
    assert att is not None and att.reason is reason, att
    assert evidence in att.evidence, att
    if stderr.get(1) == RAISED_THEN_ABORTED:  # raised by the program: not restarted (run_history.raised_by_program)
        assert (att.failed.rank, att.failed.signal, att.failed.exit_code) == (1, None, 134), att


GLOO_TIMEOUT = ("[rank0]: Traceback (most recent call last):\n[rank0]:   File \"hang_worker.py\", line 92, in main\n"
                "[rank0]:     dist.all_reduce(p)\n[rank0]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/"
                "unbound_buffer.cc:81] Timed out waiting 5000ms for recv operation to complete\n")


def test_a_hang_after_a_failed_collective_is_that_communicator_error() -> None:
    """The hang watch and the collective's own timeout race when a rank stops: its peer's collective fails,
    and the peer may then stay alive past the hang timeout (its exit waits for the checkpoint writer's
    collective with the stopped rank). Read with the ranks' output at the verdict, both orders give the
    communicator error, with the hang as further evidence; without a failed collective it is a hang."""
    hang = Hang((Stuck(0, 100, 7, "", 121.0, 120.0), Stuck(1, 101, 7, "", 121.0, 120.0)), 2)
    hang = hang.with_states({100: "sleeping", 101: "stopped"}.get)
    said = hang.describe()
    assert said == "rank 0 after step 7, idle 121 s > 120 s; rank 1 after step 7 (process stopped), idle 121 s > 120 s"
    assert [s.to_json()["state"] for s in hang.stuck] == ["sleeping", "stopped"]
    cause = attribute_hang(said, [(0, GLOO_TIMEOUT), (1, "crashing with STOP\n")])
    assert cause.reason is Reason.COMMUNICATOR_ERROR and cause.rank == 0, cause
    assert "Timed out waiting 5000ms for recv operation" in cause.evidence and said in cause.evidence, cause
    # srun: every task's lines in one stream; NCCL's watchdog line before its abort
    nccl = ("[rank1]:[E ProcessGroupNCCL.cpp:1182] [Rank 1] Watchdog caught collective operation timeout: "
            "WorkNCCL(SeqNum=5, OpType=ALLREDUCE) ran for 600000 milliseconds before timing out.\n")
    assert attribute_hang(said, [(None, nccl)]).reason is Reason.COMMUNICATOR_ERROR
    # nothing failed before the verdict: a hang, even beside a traceback the program printed and handled
    assert attribute_hang(said, [(0, USER), (1, "hanging (after step 5)\n")]) == HangCause(Reason.HANG, said)
    assert attribute_hang(said, []) == HangCause(Reason.HANG, said)


def test_nothing_failed_is_no_attribution_and_the_counters_read_this_process() -> None:
    assert attribute_failure([], lambda e: "") is None
    c = OomCounters()
    c.watch([os.getpid()])
    assert c.evidence() is None  # nothing was OOM-killed meanwhile
