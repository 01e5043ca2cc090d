"""Launcher building blocks, in process: srun task lines, the signal trap, the rank's link (signals and
control socket), ControlState's emergency bookkeeping, and finding the newest committed step."""

from __future__ import annotations

import io
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import clean_env

from resilient_slurm import early_signals
from resilient_slurm.control.orphan import LAUNCHER_PID_ENV, LauncherWatch, process_start
from resilient_slurm.control.rank import RankLink
from resilient_slurm.control.server import ControlServer, ControlState
from resilient_slurm.launcher.launch import newest_committed
from resilient_slurm.launcher.processes import (
    STOPPED_WAIT,
    Lingering,
    LocalRanks,
    RankExit,
    StreamTail,
    _Tee,
    kill_trees,
    parse_task_line,
)
from resilient_slurm.launcher.signals import TRAPPED, SignalTrap, TrapEvent
from resilient_slurm.manifest import ChunkEntry, Manifest, ShardEntry, step_dirname

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGUSR2"), reason="POSIX signals")

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT)


@pytest.fixture
def default_handlers() -> Iterator[None]:
    """SIGTERM/USR1/USR2 at SIG_DFL during the test (as in a fresh rank), whatever was there restored after.

    With SIG_DFL in place a stray signal would end pytest, so every test checks that a handler is
    installed before it signals itself."""
    saved = {s: signal.getsignal(s) for s in SIGNALS}
    for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(s, signal.SIG_DFL)
    try:
        yield
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


@pytest.fixture
def sock_path() -> Iterator[str]:
    """A socket path in a short private directory (tmp_path can exceed the Unix socket path limit)."""
    base = tempfile.mkdtemp(prefix="rsl-", dir="/tmp")
    yield os.path.join(base, "run", "7.n1.sock")
    shutil.rmtree(base, ignore_errors=True)


def kill_self(sig: int) -> None:
    assert signal.getsignal(sig) not in (signal.SIG_DFL, signal.SIG_IGN, None), (
        f"no handler for {signal.Signals(sig).name}: signalling ourselves would end the test run")
    os.kill(os.getpid(), sig)
    time.sleep(0.01)  # Python runs the handler at the next bytecode boundary of the main thread


# --------------------------------------------------------------------------- parse_task_line
@pytest.mark.parametrize(("line", "expected"), [
    ("srun: error: n2: task 1: Killed", [RankExit(1, None, signal.SIGKILL, "n2")]),
    ("srun: error: n2: task 1: Killed\n", [RankExit(1, None, signal.SIGKILL, "n2")]),
    ("srun: error: n1: tasks 0-1: Exited with exit code 3",
     [RankExit(0, 3, None, "n1"), RankExit(1, 3, None, "n1")]),
    ("srun: error: node-7: tasks 0,2-3: Terminated",
     [RankExit(r, None, signal.SIGTERM, "node-7") for r in (0, 2, 3)]),
    ("srun: error: n1: task 0: Segmentation fault (core dumped)", [RankExit(0, None, signal.SIGSEGV, "n1")]),
    ("srun: error: n1: task 0: Segmentation fault", [RankExit(0, None, signal.SIGSEGV, "n1")]),
    ("srun: error: n1: task 0: Aborted (core dumped)", [RankExit(0, None, signal.SIGABRT, "n1")]),
    ("srun: error: n1: task 0: Out Of Memory", [RankExit(0, None, signal.SIGKILL, "n1", oom=True)]),
    ("srun: error: gpu-a100-12: task 15: Exited with exit code 1", [RankExit(15, 1, None, "gpu-a100-12")]),
])
def test_parse_task_line_reads_srun_task_ends(line: str, expected: list[RankExit]) -> None:
    got = parse_task_line(line)
    assert got == expected
    assert all(isinstance(e.signal, (int, type(None))) and not e.ok for e in got)


@pytest.mark.parametrize("line", [
    "srun: error: Unable to create step for job 42: Job/step already completing or completed",
    "srun: error: Timed out waiting for job step to complete",
    "srun: Job step aborted: Waiting up to 32 seconds for job step to finish.",
    "slurmstepd: error: *** STEP 42.0 ON n1 CANCELLED AT 2024-05-01T10:00:00 DUE TO PREEMPTION ***",
    "slurmstepd: error: Detected 1 oom_kill event in StepId=42.0. Some of the step tasks have been OOM Killed.",
    "srun: error: n1: task 0: launch failed: Error configuring interconnect",
    "srun: launch/slurm: _step_signal: Terminating StepId=42.0",
    "srun: forcing job termination",
    "Traceback (most recent call last):",
    "",
])
def test_parse_task_line_ignores_other_lines(line: str) -> None:
    assert parse_task_line(line) == []


# --------------------------------------------------------------------------- StreamTail
class _Sink(io.BytesIO):
    """A sink that says when it has received something."""

    def __init__(self) -> None:
        super().__init__()
        self.got = threading.Event()

    def write(self, b: Any) -> int:
        n = super().write(b)
        self.got.set()
        return n


def _tail(sink: io.BytesIO | None, lines: list[bytes] | None = None) -> tuple[StreamTail, int]:
    r, w = os.pipe()
    tail = StreamTail(os.fdopen(r, "rb"), cap=100, name="test-tee", sink=sink,
                      on_line=lines.append if lines is not None else None)
    tail.start()
    return tail, w


def test_a_childs_output_without_a_line_end_reaches_the_terminal_at_once_and_is_bounded() -> None:
    """A progress bar redraws with carriage returns and no newline (tqdm, the HF Trainer's bar, on stderr).
    A reader of lines showed none of it until the line ended and held all of it meanwhile: the tee relays
    each redraw as it comes, keeps only the tail, and still parses srun's lines, split across reads or not,
    the last one without its newline too."""
    sink, lines = _Sink(), []
    tail, w = _tail(sink, lines)
    written = [b"epoch 1:  50%|#####     |\r", b"x" * (StreamTail.LINE_MAX + 10),  # too long to hold back
               b"\rdone\nsrun: error: n2: ta", b"sk 1: Killed\n", b"srun: error: n1: task 0: Killed"]
    try:
        os.write(w, written[0])
        assert sink.got.wait(5), "a redraw without a newline was held back"
        assert sink.getvalue() == written[0] and lines == []
        for chunk in written[1:]:
            os.write(w, chunk)
    finally:
        os.close(w)
    tail.join(5)
    assert not tail.is_alive()
    assert lines[-2:] == [b"srun: error: n2: task 1: Killed\n", b"srun: error: n1: task 0: Killed"], lines
    # the end of an endless line: what was kept of it (LINE_MAX) and the read that ended it (at most 64 KiB)
    assert all(len(line) <= 2 * StreamTail.LINE_MAX for line in lines), [len(line) for line in lines]
    assert tail.tail() == b"".join(written)[-100:].decode()
    assert sink.getvalue() == b"".join(written)


def test_srun_s_line_after_a_killed_ranks_endless_progress_bar_is_still_parsed() -> None:
    """A killed task never ends its bar's line, and srun writes its verdict right after it: the line is
    megabytes long, and the verdict at its end must still be read (a killed rank, not a user error)."""
    r, w = os.pipe()
    tee = _Tee(os.fdopen(r, "rb"), None, "test-tee", True)
    tee.start()
    try:
        for i in range(2000):
            os.write(w, f"\rstep {i}: {'#' * 60}|".encode())
        os.write(w, b"srun: error: n2: task 1: Killed\n")
    finally:
        os.close(w)
    tee.join(5)
    assert tee.task_exits == [RankExit(1, None, signal.SIGKILL, "n2")], tee.task_exits


def test_the_lines_of_ranks_sharing_the_terminal_never_mix_mid_line() -> None:
    """Two ranks write their lines in pieces (unbuffered C++ streams, print() of several values): each tee
    relays whole lines, so the launcher's stderr shows every line as a rank wrote it."""
    sink = _Sink()
    tees = [_tail(sink) for _ in range(2)]
    try:
        for i in range(200):
            for r, (_, w) in enumerate(tees):
                os.write(w, f"rank{r} ".encode())
            for _, w in tees:
                os.write(w, f"step {i} ".encode())
            for r, (_, w) in enumerate(tees):
                os.write(w, f"loss {r}.{i}\n".encode())
    finally:
        for _, w in tees:
            os.close(w)
    for t, _ in tees:
        t.join(5)
    got = sink.getvalue().decode().splitlines()
    assert sorted(got) == sorted(f"rank{r} step {i} loss {r}.{i}" for r in range(2) for i in range(200)), got[:10]


# --------------------------------------------------------------------------- SignalTrap
def test_signal_trap_records_signals_and_restores_the_previous_handlers(default_handlers: None) -> None:
    seen: list[int] = []

    def previous_usr1(signum: int, frame: object) -> None:
        seen.append(signum)

    signal.signal(signal.SIGUSR1, previous_usr1)
    before = {s: signal.getsignal(s) for s in TRAPPED}
    trap = SignalTrap().install()
    try:
        assert all(signal.getsignal(s) not in (before[s], signal.SIG_DFL) for s in TRAPPED)
        assert trap.wait(0.05) is False and trap.pop() == []
        t0 = time.time()
        kill_self(signal.SIGUSR1)
        assert trap.wait(5) is True
        events = trap.pop()
        assert [e.source for e in events] == ["SIGUSR1"]
        assert t0 <= events[0].at <= time.time() and events[0].deadline is None
        assert seen == [], "the trap must replace the previous handler while installed"
        assert trap.pop() == [] and trap.wait(0.01) is False
    finally:
        trap.restore()
    assert {s: signal.getsignal(s) for s in TRAPPED} == before
    kill_self(signal.SIGUSR1)
    assert seen == [signal.SIGUSR1]
    assert trap.pop() == []


def test_signals_heard_before_the_launchers_trap_are_handed_to_it(default_handlers: None) -> None:
    """The console scripts trap the stop signals before the CLI is imported (early_signals): what they hear
    becomes the launcher trap's first events, in order, and the handlers from before come back at the end."""
    assert early_signals.is_launch(["launch", "--", "x"]) and early_signals.is_launch(["--config", "a", "launch"])
    assert early_signals.is_launch(["--config=a", "launch"]) and not early_signals.is_launch(["ls", "launch"])
    assert not early_signals.is_launch(["--config", "launch"]) and not early_signals.is_launch([])
    assert early_signals.is_launch(["--conf", "a", "launch"]) and not early_signals.is_launch(["--", "launch"])
    before = {s: signal.getsignal(s) for s in TRAPPED}
    early_signals.trap_early()
    try:
        t0 = time.time()
        kill_self(signal.SIGUSR1)
        kill_self(signal.SIGTERM)
        early_signals.trap_early()  # again (the CLI after the console script): nothing changes
        trap = SignalTrap().install()
        try:
            assert trap.wait(0.01) is True
            events = trap.pop()
            assert [e.source for e in events] == ["SIGUSR1", "SIGTERM"], events
            assert t0 <= events[0].at <= events[1].at <= time.time()
        finally:
            trap.restore()
    finally:
        early_signals.release_early()
    assert {s: signal.getsignal(s) for s in TRAPPED} == before
    assert early_signals.take_early() == []


def test_signal_trap_wait_wakes_on_a_signal_sent_while_it_blocks(default_handlers: None) -> None:
    trap = SignalTrap().install()
    try:
        timer = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGUSR2))
        t0 = time.monotonic()
        timer.start()
        assert trap.wait(10) is True
        assert time.monotonic() - t0 < 5, "wait() slept through the signal"
        assert [e.source for e in trap.pop()] == ["SIGUSR2"]
    finally:
        timer.join()
        trap.restore()


def test_signal_trap_notify_from_another_thread_wakes_wait_and_keeps_order(default_handlers: None) -> None:
    trap = SignalTrap().install()
    try:
        timer = threading.Timer(0.1, trap.notify, ("cloud", 1234.5))
        t0 = time.monotonic()
        timer.start()
        assert trap.wait(10) is True
        assert time.monotonic() - t0 < 5
        kill_self(signal.SIGTERM)
        events = trap.pop()
        assert [(e.source, e.deadline) for e in events] == [("cloud", 1234.5), ("SIGTERM", None)]
        assert isinstance(events[0], TrapEvent)
    finally:
        timer.join()
        trap.restore()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


# --------------------------------------------------------------------------- RankLink: signals
def test_rank_link_traps_term_and_the_save_signal_and_close_restores_term_and_ignores_the_save_signal(
        default_handlers: None) -> None:
    calls: list[str] = []
    link = RankLink(0, 0, on_request=lambda: calls.append("request"), socket_path=None, trap_signals=True,
                    save_signal="USR2")
    try:
        assert not link.connected
        kill_self(signal.SIGUSR2)
        assert calls == ["request"]
        assert link.signals_seen == ["SIGUSR2"]
        assert link.poll(1) is None  # no socket: only signals request a save
        kill_self(signal.SIGTERM)
        assert link.signals_seen == ["SIGUSR2", "SIGTERM"] and len(calls) == 2
        assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL, "USR1 is not the save signal here"
    finally:
        link.close()
    # a save signal that arrives after the save (scancel is slow on a busy node) must not end the rank
    assert signal.getsignal(signal.SIGUSR2) is signal.SIG_IGN
    os.kill(os.getpid(), signal.SIGUSR2)  # ignored: this test run goes on
    time.sleep(0.01)
    assert calls == ["request", "request"]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    # a later Checkpointer of the same program traps it again, and leaves it ignored again
    again = RankLink(0, 0, on_request=lambda: calls.append("again"), trap_signals=True, save_signal="USR2")
    try:
        kill_self(signal.SIGUSR2)
        assert calls[-1] == "again" and again.signals_seen == ["SIGUSR2"]
    finally:
        again.close()
    assert signal.getsignal(signal.SIGUSR2) is signal.SIG_IGN


@pytest.mark.proc
def test_a_late_save_signal_does_not_end_a_rank_whose_checkpointer_closed(tmp_path: Path) -> None:
    """In a real process, to its end: the Checkpointer's link closed, then USR2 arrives (as a scancel that
    took longer than the save does); the program still writes its final output and exits 0, also when the
    signal lands during the interpreter's shutdown."""
    code = textwrap.dedent(f"""
        import os, signal, sys, time
        from resilient_slurm.control.rank import RankLink
        link = RankLink(0, 0, on_request=lambda: None, trap_signals=True, save_signal="USR2")
        link.close()
        os.kill(os.getpid(), signal.SIGUSR2)
        time.sleep(0.05)
        open({str(tmp_path / "final")!r}, "w").write("done")
        import atexit
        atexit.register(lambda: (os.kill(os.getpid(), signal.SIGUSR2), time.sleep(0.05)))
    """)
    r = subprocess.run([sys.executable, "-c", code], env=clean_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.returncode, r.stderr)
    assert (tmp_path / "final").read_text() == "done"


def test_rank_link_leaves_a_handler_the_program_installed(default_handlers: None) -> None:
    mine: list[int] = []

    def program_handler(signum: int, frame: object) -> None:
        mine.append(signum)

    signal.signal(signal.SIGUSR2, program_handler)
    calls: list[str] = []
    link = RankLink(0, 0, on_request=lambda: calls.append("request"), trap_signals=True, save_signal="USR2")
    try:
        assert signal.getsignal(signal.SIGUSR2) is program_handler
        kill_self(signal.SIGUSR2)
        assert mine == [signal.SIGUSR2] and calls == [] and link.signals_seen == []
        kill_self(signal.SIGTERM)  # TERM had the default handler: trapped
        assert calls == ["request"] and link.signals_seen == ["SIGTERM"]
    finally:
        link.close()
    assert signal.getsignal(signal.SIGUSR2) is program_handler
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


@pytest.mark.parametrize(("save_signal", "trapped"), [("none", {signal.SIGTERM}), ("TERM", {signal.SIGTERM}),
                                                      ("USR1", {signal.SIGTERM, signal.SIGUSR1})])
def test_rank_link_traps_only_term_and_the_configured_save_signal(
        default_handlers: None, save_signal: str, trapped: set[int]) -> None:
    link = RankLink(0, 0, on_request=lambda: None, trap_signals=True, save_signal=save_signal)
    try:
        got = {s for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2) if signal.getsignal(s) is not signal.SIG_DFL}
        assert got == trapped
    finally:
        link.close()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    assert {s for s in (signal.SIGUSR1, signal.SIGUSR2) if signal.getsignal(s) is signal.SIG_IGN} == trapped - {signal.SIGTERM}
    assert all(signal.getsignal(s) is signal.SIG_DFL for s in (signal.SIGUSR1, signal.SIGUSR2) if s not in trapped)


def test_rank_link_without_trap_signals_installs_nothing(default_handlers: None) -> None:
    link = RankLink(0, 0, on_request=lambda: None, trap_signals=False)
    assert all(signal.getsignal(s) is signal.SIG_DFL for s in (signal.SIGTERM, signal.SIGUSR2))
    link.close()


# --------------------------------------------------------------------------- RankLink: control socket
class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_rank_link_over_a_real_control_server(sock_path: str) -> None:
    calls: list[str] = []
    with ControlServer(sock_path) as server:
        assert oct(os.stat(os.path.dirname(sock_path)).st_mode & 0o777) == "0o700"
        link = RankLink(1, 1, on_request=lambda: calls.append("request"), socket_path=sock_path, timeout=2.0,
                        trap_signals=False)
        try:
            assert link.connected
            link.hello(3)
            ranks = server.status()["ranks"]
            assert list(ranks) == ["1"] and ranks["1"]["step"] == 3 and ranks["1"]["pid"] == os.getpid()
            assert link.poll(4) is None and calls == []
            assert server.status()["ranks"]["1"]["step"] == 4
            server.request_save("emergency", time.time() + 60)
            assert link.poll(5) == "emergency"
            assert calls == ["request"]
            assert server.state.save_request is not None
            link.committed(5, "emergency")
            assert server.state.save_request is None, "the only registered rank committed the emergency step"
            last = server.status()["last_committed"]
            assert last == {"step": 5, "reason": "emergency", "ranks_reported": [1], "complete": True}
            assert link.poll(6) is None and calls == ["request"]
            # A tool's manual request: a save, not an emergency (the flag is not set, the rank goes on).
            server.request_save("manual", time.time() + 60)
            assert link.poll(7) == "manual" and calls == ["request"]
            assert link.poll(8) is None, "the same request, still pending while its save is in flight: no second save"
            link.committed(7, "manual")
            assert server.state.save_request is None, "the manual save committed"
            server.request_save("manual", time.time() + 61)  # a new request: a new save
            assert link.poll(9) == "manual"
        finally:
            link.close()


def test_rank_link_carries_on_when_the_server_goes_away_and_retries_later(sock_path: str) -> None:
    clock = Clock()
    calls: list[str] = []
    server = ControlServer(sock_path)
    server.start()
    link = RankLink(0, 0, on_request=lambda: calls.append("request"), socket_path=sock_path, timeout=1.0,
                    trap_signals=False, clock=clock)
    try:
        link.hello(2)
        assert link.poll(3) is None
        server.stop()
        t0 = time.monotonic()
        assert link.poll(4) is None  # must not raise
        link.committed(4, "interval")
        assert time.monotonic() - t0 < 3.0, "a dead socket held the training thread up"
        t0 = time.monotonic()
        for step in range(5, 25):  # backing off: no socket call at all for a while
            assert link.poll(step) is None
        assert time.monotonic() - t0 < 0.5
        assert calls == []

        # A new server at the same path (a restarted launcher) is found again after the back-off.
        server = ControlServer(sock_path)
        server.start()
        server.request_save("emergency", time.time() + 60)
        assert link.poll(25) is None, "still backing off"
        clock.now += 31
        assert link.poll(26) == "emergency"
        assert calls == ["request"]
        assert server.status()["ranks"]["0"]["step"] == 26, "the link registered again before polling"
    finally:
        link.close()
        server.stop()


def test_rank_link_ignores_an_unusable_socket_path(tmp_path: Path) -> None:
    for path in ("off", "OFF", "relative/x.sock", str(tmp_path / "missing.sock"), "/" + "x" * 200 + ".sock"):
        link = RankLink(0, 0, on_request=lambda: None, socket_path=path, trap_signals=False)
        assert not link.connected
        assert link.poll(1) is None
        link.close()


# --------------------------------------------------------------------------- ControlState
def test_an_emergency_request_that_meets_an_interval_step_is_satisfied_by_its_emergency_reports() -> None:
    clock = Clock()
    st = ControlState(clock=clock)
    st.hello(0, 0, 100, 0)
    st.hello(1, 1, 101, 0)
    st.committed(0, 8, "interval")
    st.committed(1, 8, "interval")
    clock.now += 1
    st.request_save("emergency", clock.now + 60)
    clock.now += 1
    assert st.save_request is not None, "step 8 was an interval save, committed before the request"
    st.committed(0, 8, "emergency")
    st.committed(1, 8, "emergency")
    assert st.save_request is None
    last = st.status()["last_committed"]
    assert last == {"step": 8, "reason": "emergency", "ranks_reported": [0, 1], "complete": True}


def test_interval_reports_after_an_emergency_request_do_not_satisfy_it() -> None:
    clock = Clock()
    st = ControlState(clock=clock)
    st.hello(0, 0, 100, 0)
    st.hello(1, 1, 101, 0)
    st.request_save("emergency", clock.now + 60)
    clock.now += 1
    st.committed(0, 8, "interval")  # the save in flight when the request came, finishing after it
    st.committed(1, 8, "interval")
    assert st.save_request is not None, "the ranks have not stopped: an interval commit is no emergency save"
    assert st.status()["last_committed"]["reason"] == "interval"
    clock.now += 1
    st.committed(0, 8, "emergency")
    st.committed(1, 8, "emergency")
    assert st.save_request is None
    assert st.status()["last_committed"]["reason"] == "emergency"


def test_an_emergency_request_waits_for_every_registered_rank() -> None:
    st = ControlState(clock=Clock())
    st.hello(0, 0, 100, 0)
    st.hello(1, 1, 101, 0)
    st.request_save("emergency", 1e12)
    st.committed(1, 9, "emergency")
    assert st.save_request is not None
    assert st.status()["last_committed"]["complete"] is False


# --------------------------------------------------------------------------- newest_committed
def _manifest(step: int, reason: str) -> str:
    return Manifest(run_id="toy", step=step, world_size=1, created_at=1700000000.0, reason=reason,
                    torch_version="2.13.0", library_version="0.1.0",
                    shards=(ShardEntry("__0_0.distcp", 0, "n1", 16, "00" * 8),), nodes={"n1": (0,)},
                    node="n1", dcp_metadata=ChunkEntry(0, 10, "11" * 8)).to_json()


def _step(run_dir: Path, step: int, manifest: str | None) -> None:
    d = run_dir / step_dirname(step)
    d.mkdir(parents=True)
    if manifest is not None:
        (d / "manifest.json").write_text(manifest)


def test_newest_committed_skips_steps_without_a_readable_manifest(tmp_path: Path) -> None:
    run = tmp_path / "toy"
    assert newest_committed(str(run)) == (None, None)  # no directory yet
    run.mkdir()
    assert newest_committed(str(run)) == (None, None)
    _step(run, 4, _manifest(4, "interval"))
    assert newest_committed(str(run)) == (4, "interval")
    _step(run, 8, _manifest(8, "emergency"))
    _step(run, 12, None)  # not committed (no manifest)
    _step(run, 10, "{ torn")  # unreadable manifest
    _step(run, 11, _manifest(11, "bogus-reason"))  # invalid manifest
    (run / (step_dirname(16) + ".tmp-abc")).mkdir()  # a save in progress
    (run / (step_dirname(16) + ".tmp-abc") / "manifest.json").write_text(_manifest(16, "interval"))
    (run / "events.jsonl").write_text("{}\n")
    (run / "step_99").mkdir()  # not a step directory name
    assert newest_committed(str(run)) == (8, "emergency")
    _step(run, 100, _manifest(100, "interval"))
    assert newest_committed(str(run)) == (100, "interval")


# --------------------------------------------------------------------------- LauncherWatch (orphan.py)
@pytest.mark.proc
def test_launcher_watch_finds_its_launcher_gone_and_sets_the_launchers_bounds() -> None:
    """A real process stands for the launcher; the watch gives the rank save_timeout + term_grace once it is
    gone, term_grace once the emergency save committed; a watch stopped while the launcher runs ends."""
    fake = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    seen: list[tuple[int, float]] = []
    watch = LauncherWatch.from_env({LAUNCHER_PID_ENV: str(fake.pid)}, save_timeout=300.0, term_grace=10.0,
                                   on_gone=lambda pid, bound: seen.append((pid, bound)),
                                   on_timeout=lambda pid, bound: pytest.fail("no bound may pass here"),
                                   check_every=0.05)
    assert watch is not None and process_start(fake.pid)
    try:
        watch.start()
        time.sleep(0.3)
        assert not watch.gone and seen == []
        fake.kill()
        fake.wait()
        deadline = time.monotonic() + 30
        while not watch.gone and time.monotonic() < deadline:
            time.sleep(0.05)
        assert watch.gone and seen == [(fake.pid, 310.0)]
        assert watch.deadline is not None and 300 < watch.deadline - time.monotonic() <= 310
        watch.saved()  # the emergency checkpoint committed: term_grace from now
        assert 0 < watch.deadline - time.monotonic() <= 10
        watch.stop()  # gone: the bound stays
        assert watch._thread is not None and watch._thread.is_alive()
    finally:
        import faulthandler

        faulthandler.cancel_dump_traceback_later()  # the backstop would end this test run
        watch._stop.set()
    assert process_start(fake.pid) is None
    # no launcher named, or a value that is no pid: no watch
    assert LauncherWatch.from_env({}, save_timeout=1.0, term_grace=1.0, on_gone=print, on_timeout=print) is None
    assert LauncherWatch.from_env({LAUNCHER_PID_ENV: "x1"}, save_timeout=1.0, term_grace=1.0, on_gone=print,
                                  on_timeout=print) is None
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        w = LauncherWatch(alive.pid, save_timeout=1.0, term_grace=1.0, on_gone=print, on_timeout=print,
                          check_every=0.05).start()
        w.stop()  # the launcher runs: the watch ends, nothing armed
        assert w._thread is not None
        w._thread.join(5)
        assert not w._thread.is_alive() and not w.gone and w.deadline is None
    finally:
        alive.kill()
        alive.wait()


def test_a_task_on_another_slurm_node_than_the_launchers_uses_signals_only() -> None:
    """Under srun the launcher names its node (RSLURM_CONTROL_NODE): a task elsewhere, even on a host it
    shares with the launcher's node or with a shared runtime directory, does not use that node's socket."""
    from resilient_slurm.control.rank import socket_for_this_node

    sock = "/run/user/0/rslurm/123.n1.sock"
    assert socket_for_this_node(sock, {"RSLURM_CONTROL_NODE": "n1", "SLURMD_NODENAME": "n2"}) is None
    assert socket_for_this_node(sock, {"RSLURM_CONTROL_NODE": "n1", "SLURMD_NODENAME": "n1"}) == sock
    assert socket_for_this_node(sock, {"SLURMD_NODENAME": "n2"}) == sock  # a local launcher names no node
    assert socket_for_this_node(sock, {"RSLURM_CONTROL_NODE": "n1"}) == sock  # not a Slurm task
    assert socket_for_this_node(None, {"RSLURM_CONTROL_NODE": "n1", "SLURMD_NODENAME": "n2"}) is None


def _stopped(pid: int) -> bool:
    import psutil

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if psutil.Process(pid).status() == psutil.STATUS_STOPPED:
            return True
        time.sleep(0.02)
    return False


@pytest.mark.proc
def test_a_teardown_reaches_a_stopped_process_with_its_sigterm() -> None:
    """A stopped process (SIGSTOP) takes no signal but SIGKILL and SIGCONT until it runs again: the teardown
    follows SIGTERM with SIGCONT, so a stopped rank ends on the SIGTERM (its handler runs) within the grace."""
    code = ("import signal, sys, time\nsignal.signal(signal.SIGTERM, lambda *a: (print('term', flush=True), sys.exit(7)))\n"
            "print('up', flush=True)\ntime.sleep(60)\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "up"
        os.kill(p.pid, signal.SIGSTOP)
        assert _stopped(p.pid)
        assert kill_trees([p.pid], grace=20) == 0  # no SIGKILL needed (psutil reaped it: no exit code here)
        assert p.stdout.read().strip() == "term"  # the SIGTERM handler ran
    finally:
        p.kill()
        p.wait()


@pytest.mark.proc
def test_ranks_left_after_a_failure_are_given_up_on_once_one_is_stopped() -> None:
    """After a rank failed, the others get PEER_EXIT_WAIT s to exit; a rank stopped meanwhile cannot, so the
    wait ends STOPPED_WAIT s after it is seen stopped, naming it."""
    ranks = LocalRanks([sys.executable, "-c", "import os, sys, time\nif os.environ['RANK'] == '0': sys.exit(3)\n"
                        "print('up', flush=True)\ntime.sleep(60)\n"], 2, clean_env(), 1, dist_env=True)
    ranks.start()
    try:
        deadline = time.monotonic() + 30
        while not ranks.failures():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        lingering = Lingering()
        t = 1000.0  # the launcher's clock, as its loop passes it: looks 0.5 s apart
        [failed] = lingering.begin(ranks, t)
        assert failed.rank == 0 and ranks.stopped_ranks() == []
        assert lingering.over(ranks, t + 0.5) is None  # rank 1 runs: it may still exit
        os.kill(ranks.pids[1], signal.SIGSTOP)
        assert _stopped(ranks.pids[1])
        t += 0.5
        for _ in range(int(STOPPED_WAIT / 0.5)):  # seen stopped, but not yet for STOPPED_WAIT s
            t += 0.5
            assert ranks.stopped_ranks() == [1] and lingering.over(ranks, t) is None
        why = lingering.over(ranks, t + 0.5)
        assert why is not None and why.startswith("rank 1 stopped (SIGSTOP)"), why
        # A fresh wait: one gap between looks (the launcher itself stopped, as a suspended job is) counts
        # at most LOOK_GAP s, so a rank stopped across the gap is not given up on at the first look after it.
        lingering = Lingering()
        lingering.begin(ranks, t)
        assert lingering.over(ranks, t + 0.1) is None
        assert lingering.over(ranks, t + 60) is None  # neither the 30 s wait nor the 2 s one passed
        os.kill(ranks.pids[1], signal.SIGCONT)  # running again: the wait goes on
        deadline = time.monotonic() + 10
        while ranks.stopped_ranks():
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert lingering.over(ranks, t + 60.5) is None
    finally:
        ranks.teardown(1)
        ranks.finish()
