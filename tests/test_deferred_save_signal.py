"""The save signal a stop holds back while the ranks start (launcher/stopping.py: a signal sent before the
ranks trap it would kill them): sent once a rank registers on a job of several nodes, withheld with an event
saying why when it turns out not to be needed (one node, whose ranks the socket reaches; the requested save
committed; the ranks gone), and never sent after that.

In process, with a Slurm client that answers from a table and records the signals sent: no Slurm, rank or
launcher process. The same stop on the test cluster, with ranks that start slowly:
tests/test_launcher_slurm.py::test_a_stop_while_ranks_start_waits_for_them_instead_of_killing_them."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import read_jsonl
from test_ending_records import RUNNING, TableSlurm
from test_telemetry import check_records, read_docs

from resilient_slurm.launcher.launch import Launcher
from resilient_slurm.launcher.signals import TrapEvent


class SignalSlurm(TableSlurm):
    """A running job; records each signal sent to its tasks."""

    def __init__(self) -> None:
        super().__init__(RUNNING)
        self.signals: list[int] = []

    def signal(self, job_id: int | str, sig: signal.Signals | int, *, batch: bool = False, full: bool = False,
               step: str | None = None) -> None:
        assert not batch and step is None, (batch, step)  # every task of the job, not the batch shell
        self.signals.append(int(sig))


class Server:
    """The control server as StopControl sees it: the ranks registered so far."""

    def __init__(self) -> None:
        self.ranks: list[int] = []

    def request_save(self, reason: str, deadline: float) -> None:
        pass

    def status(self) -> dict[str, Any]:
        return {"ranks": list(self.ranks)}


class Starting:
    """Ranks that have not registered: nothing to signal directly (under srun, signals go through Slurm)."""

    torn_down = False

    def signal_ranks(self, sig: int) -> None:
        raise AssertionError("under srun the launcher signals the job's tasks through Slurm")


def _stop(tmp_path: Path, home: Path, nodes: int) -> tuple[Launcher, SignalSlurm, Server, float]:
    """A launcher of an srun job on ``nodes`` nodes, stopped by USR1 before any rank registered."""
    env = {"HOME": str(home), "RSLURM_LOCAL_DIR": str(tmp_path / "nvme"), "RSLURM_CONTROL_DIR": str(tmp_path / "ctl"),
           "RSLURM_RUN_ID": "toy", "SLURM_JOB_ID": "42", "SLURMD_NODENAME": "n1",
           "SLURM_JOB_NUM_NODES": str(nodes)}
    slurm = SignalSlurm()
    launcher = Launcher(["srun", "python", "train.py"], env=env, slurm=slurm)
    launcher.timings["start"] = time.time()
    server = Server()
    at = time.time()
    launcher.stopping.on_event(TrapEvent("SIGUSR1", at), Starting(), server)  # type: ignore[arg-type]
    assert slurm.signals == [], "no rank traps the save signal yet: it is held back"
    return launcher, slurm, server, at


def _events(tmp_path: Path) -> list[dict[str, Any]]:
    events = [e for e in read_jsonl(tmp_path / "nvme" / "toy" / "events.jsonl") if e["source"] == "launcher"]
    check_records(read_docs(), events)  # every field as docs/telemetry.md says
    return events


def _signal_events(tmp_path: Path) -> list[tuple[str, str | None]]:
    return [(e["event"], e.get("reason")) for e in _events(tmp_path) if e["event"].startswith("save_signal")]


def test_on_several_nodes_the_held_back_signal_goes_once_a_rank_registers(tmp_path: Path, home: Path) -> None:
    launcher, slurm, server, at = _stop(tmp_path, home, nodes=2)
    launcher.stopping.send_deferred_signal(server, at + 1)  # still starting: held
    assert slurm.signals == []
    server.ranks = [0]
    launcher.stopping.send_deferred_signal(server, at + 2)
    assert slurm.signals == [signal.SIGUSR2]  # the default save signal, to the ranks on the other node
    launcher.stopping.committed(8, at + 3)  # the commit after it: nothing left to withhold, nothing sent again
    launcher.stopping.send_deferred_signal(server, at + 4)
    assert slurm.signals == [signal.SIGUSR2]
    assert _signal_events(tmp_path) == [("save_signal_deferred", None), ("save_signal_sent", None)]


def test_a_save_committed_before_the_held_back_signal_went_withholds_it_for_good(tmp_path: Path, home: Path) -> None:
    """The ranks registered, saved what the stop asked for and said goodbye between two of the launcher's
    looks: once the launcher sees the commit (StopControl.committed, from its loop) the save signal would
    reach nobody who needs it, and is never sent, not even once half the time to the deadline has passed."""
    launcher, slurm, server, at = _stop(tmp_path, home, nodes=2)
    launcher.stopping.committed(8, at + 1.5)
    stop = launcher.stopping.stop
    assert stop is not None
    launcher.stopping.send_deferred_signal(server, stop.deadline)  # past half the time to the deadline
    server.ranks = [0]
    launcher.stopping.send_deferred_signal(server, stop.deadline + 1)
    assert slurm.signals == []
    events = _events(tmp_path)
    assert [(e["event"], e.get("reason")) for e in events[-2:]] == [("committed", None),
                                                                    ("save_signal_withheld", "committed")]
    assert events[-2]["step"] == 8 and events[-2]["after_signal_s"] == pytest.approx(1.5, abs=0.2)
    assert events[-1]["signal"] == "SIGUSR2", events[-1]
    launcher.stopping.withhold_deferred_signal("ranks_exited")  # once only
    assert len(_signal_events(tmp_path)) == 2


def test_ranks_that_end_before_the_held_back_signal_went_withhold_it(tmp_path: Path, home: Path) -> None:
    launcher, slurm, server, at = _stop(tmp_path, home, nodes=2)
    launcher.stopping.withhold_deferred_signal("ranks_exited")  # what the launcher's loop does as it ends
    launcher.stopping.send_deferred_signal(server, at + 1000)
    assert slurm.signals == []
    assert _signal_events(tmp_path) == [("save_signal_deferred", None), ("save_signal_withheld", "ranks_exited")]


def test_on_one_node_a_registered_rank_makes_the_signal_unneeded(tmp_path: Path, home: Path) -> None:
    """One node: the request on the control socket reached every rank; the signal is withheld, saying so."""
    launcher, slurm, server, at = _stop(tmp_path, home, nodes=1)
    server.ranks = [0]
    launcher.stopping.send_deferred_signal(server, at + 0.6)
    launcher.stopping.send_deferred_signal(server, at + 5)
    assert slurm.signals == []
    assert _signal_events(tmp_path) == [("save_signal_deferred", None), ("save_signal_withheld", "socket")]


def test_a_signal_that_was_never_held_back_is_never_withheld(tmp_path: Path, home: Path) -> None:
    """A stop with a rank registered already sends the signal at once (several nodes): nothing is withheld."""
    env = {"HOME": str(home), "RSLURM_LOCAL_DIR": str(tmp_path / "nvme"), "RSLURM_CONTROL_DIR": str(tmp_path / "ctl"),
           "RSLURM_RUN_ID": "toy", "SLURM_JOB_ID": "42", "SLURMD_NODENAME": "n1", "SLURM_JOB_NUM_NODES": "2"}
    slurm = SignalSlurm()
    launcher = Launcher(["srun", "python", "train.py"], env=env, slurm=slurm)
    server = Server()
    server.ranks = [0]
    launcher.stopping.on_event(TrapEvent("SIGUSR1", time.time()), Starting(), server)  # type: ignore[arg-type]
    launcher.stopping.committed(8, time.time())
    launcher.stopping.withhold_deferred_signal("ranks_exited")
    assert slurm.signals == [signal.SIGUSR2]
    assert _signal_events(tmp_path) == [("save_signal_sent", None)]


def test_a_stop_before_the_ranks_are_started_withholds_the_signal(tmp_path: Path, home: Path) -> None:
    """The stop reached the launcher during its set-up, before srun started this run's ranks: they are not
    started (StopControl.not_started), so the held-back signal would reach no task that traps it."""
    launcher, slurm, server, at = _stop(tmp_path, home, nodes=2)
    launcher.stopping.not_started(None)
    launcher.stopping.send_deferred_signal(server, at + 1000)
    assert slurm.signals == []
    assert [(e["event"], e.get("reason")) for e in _events(tmp_path)][-3:] == [
        ("save_signal_deferred", None), ("ranks_not_started", None), ("save_signal_withheld", "ranks_not_started")]
