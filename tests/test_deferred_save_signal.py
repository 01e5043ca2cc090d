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
    launcher.stopping.withhold_deferred_signal("committed")  # the commit after it: nothing left to withhold
    launcher.stopping.send_deferred_signal(server, at + 3)
    assert slurm.signals == [signal.SIGUSR2]
    assert _signal_events(tmp_path) == [("save_signal_deferred", None), ("save_signal_sent", None)]


@pytest.mark.parametrize("reason", ["committed", "ranks_exited"])
def test_a_held_back_signal_no_longer_needed_is_withheld_and_never_sent(
        tmp_path: Path, home: Path, reason: str) -> None:
    """The ranks registered, saved what the stop asked for and said goodbye between two of the launcher's
    looks (or ended): the save signal would reach nobody who needs it, and is never sent, not even once half
    the time to the deadline has passed."""
    launcher, slurm, server, at = _stop(tmp_path, home, nodes=2)
    launcher.stopping.withhold_deferred_signal(reason)
    stop = launcher.stopping.stop
    assert stop is not None
    launcher.stopping.send_deferred_signal(server, stop.deadline)  # past half the time to the deadline
    server.ranks = [0]
    launcher.stopping.send_deferred_signal(server, stop.deadline + 1)
    assert slurm.signals == []
    assert _signal_events(tmp_path) == [("save_signal_deferred", None), ("save_signal_withheld", reason)]
    withheld = _events(tmp_path)[-1]
    assert withheld["signal"] == "SIGUSR2", withheld
    launcher.stopping.withhold_deferred_signal("ranks_exited")  # once only
    assert len(_signal_events(tmp_path)) == 2


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
    launcher.stopping.withhold_deferred_signal("committed")
    assert slurm.signals == [signal.SIGUSR2]
    assert _signal_events(tmp_path) == [("save_signal_sent", None)]
