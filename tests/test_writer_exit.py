"""The checkpoint writer at the interpreter's exit (checkpoint/writer.py): a program that ends without
``close()`` still gets its save written; one ending on an unhandled exception while its writer waits for other
ranks who are not coming ends after EXIT_RANK_WAIT_S, not after collective_timeout. Each case is a real
interpreter exiting (the hooks are the interpreter's own), with the waits made short."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from conftest import REPO

from resilient_slurm.checkpoint.coordination import RankWaits
from resilient_slurm.checkpoint.writer import WriterThread

PROGRAM = """
import sys, time
import resilient_slurm.checkpoint.writer as w
from resilient_slurm.checkpoint.coordination import RANK_WAITS
w.EXIT_RANK_WAIT_S = 1.0
writer = w.SaveWriter(None, None, None, None, None, "run")  # what the exit needs of it: its thread
out, case = sys.argv[1], sys.argv[2]

def local_work():  # writing shards: ends by itself
    time.sleep(1.5)
    open(out, "w").write("written")

def waiting_for_peers():  # a commit's collective whose peers stopped
    with RANK_WAITS.waiting():
        time.sleep(3600)

writer._pool.submit("the save of step 8", waiting_for_peers if case.endswith("peers") else local_work)
if case.startswith("fork"):  # a DataLoader worker forked while the save runs: it inherits the hook, not the thread
    import multiprocessing
    child = multiprocessing.get_context("fork").Process(target=lambda: None)
    child.start()
    child.join(60)
    print("child exit code", child.exitcode)
if case.startswith("close"):  # `with Checkpointer(...)` ending on an error: close(failed=True)
    class Link:
        def close(self): print("link closed")
    print("left:", writer.left_stuck("closing after an error", Link()))
if case.startswith(("raise", "close")):
    raise RuntimeError("the training collective timed out")
if case.startswith("interrupt"):
    raise KeyboardInterrupt
"""


def _run(tmp_path: Path, case: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = tmp_path / f"{case}.out"
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(PROGRAM), str(out), case], capture_output=True,
                       text=True, timeout=120, cwd=REPO, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)})
    return r, out


@pytest.mark.proc
@pytest.mark.parametrize("case", ["exit-local", "raise-local"])
def test_the_exit_waits_for_a_save_that_writes_whatever_the_ending(tmp_path: Path, case: str) -> None:
    r, out = _run(tmp_path, case)
    assert r.returncode == (1 if case.startswith("raise") else 0), r.stderr
    assert out.read_text() == "written", r.stderr  # the daemon thread was waited for
    assert "waited" not in r.stderr, r.stderr


@pytest.mark.proc
def test_a_forked_child_does_not_wait_for_its_parents_writer(tmp_path: Path) -> None:
    r, out = _run(tmp_path, "fork-local")
    assert r.returncode == 0 and "child exit code 0" in r.stdout, (r.stdout, r.stderr)
    assert out.read_text() == "written", r.stderr


@pytest.mark.proc
def test_an_exit_on_an_error_stops_waiting_for_ranks_that_are_not_coming(tmp_path: Path) -> None:
    r, _ = _run(tmp_path, "raise-peers")  # the hour's task was not waited for: run()'s timeout did not fire
    assert r.returncode == 1, r.stderr
    assert "RuntimeError: the training collective timed out" in r.stderr, r.stderr
    assert ("this rank is ending on RuntimeError while the checkpoint writer (the save of step 8) has waited more "
            "than 1 s for other ranks") in r.stderr, r.stderr
    assert "every step committed before it is intact" in r.stderr, r.stderr


@pytest.mark.proc
def test_a_close_after_an_error_leaves_a_stuck_writer_and_the_exit_does_not_wait_again(tmp_path: Path) -> None:
    r, _ = _run(tmp_path, "close-peers")
    assert r.returncode == 1 and "left: True" in r.stdout and "link closed" in r.stdout, (r.stdout, r.stderr)
    assert "closing after an error while the checkpoint writer (the save of step 8) has waited" in r.stderr, r.stderr
    assert r.stderr.count("has waited") == 1, r.stderr


@pytest.mark.proc
def test_an_interrupt_still_ends_the_process_by_sigint(tmp_path: Path) -> None:
    r, _ = _run(tmp_path, "interrupt-peers")
    assert r.returncode == -signal.SIGINT, (r.returncode, r.stderr)
    assert "ending on KeyboardInterrupt" in r.stderr, r.stderr


def test_the_writer_thread_runs_tasks_in_order_and_carries_their_errors() -> None:
    wt = WriterThread("rslurm-test")
    seen: list[int] = []
    futs = [wt.submit(f"task {i}", seen.append, i) for i in range(5)]
    bad = wt.submit("bad", lambda: 1 / 0)
    assert wt.wait_idle(10)
    assert seen == [0, 1, 2, 3, 4] and all(f.done() for f in futs)
    with pytest.raises(ZeroDivisionError):
        bad.result()
    assert wt.current == ""
    wt.shutdown()
    wt.shutdown()
    assert not wt._thread.is_alive() and wt._thread.daemon
    with pytest.raises(RuntimeError, match="closed"):
        wt.submit("late", print)


def test_rank_waits_are_per_thread_count_from_the_outer_wait_and_end_with_it() -> None:
    waits = RankWaits()
    me = threading.get_ident()
    assert waits.waited(me) == 0.0
    with waits.waiting():
        time.sleep(0.05)
        with waits.waiting():  # nested: still the outer wait's clock
            assert waits.waited(me) >= 0.05
        assert waits.waited(me, since=time.monotonic() + 10) == 0.0  # counted from `since` at the earliest
        other = threading.Thread(target=lambda: None)
        other.start()
        other.join()
        assert waits.waited(other.ident) == 0.0  # another thread's wait is its own
    assert waits.waited(me) == 0.0
