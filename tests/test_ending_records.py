"""A job Slurm is already ending (a cancel, a time limit without a warning signal, the end of a preemption's
grace) is SIGKILLed KillWait after its SIGTERM, whoever is still running. The launcher keeps part of that
time for its own records, and records the end (decision, ``not_requeued``, history) as soon as the emergency
step has committed, before it waits for the ranks to exit; what it does at the end then says nothing twice.

In process, with a Slurm client that answers from a table: no Slurm, rank or launcher process. The same on
the test cluster, with ranks that take longer than KillWait to exit: tests/test_launcher_slurm.py."""

from __future__ import annotations

import dataclasses
import json
import signal
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from conftest import read_jsonl
from test_launcher_units import _manifest, _step
from test_telemetry import check_records, read_docs

from resilient_slurm.launcher.launch import Launcher
from resilient_slurm.launcher.outcome import classify_outcome
from resilient_slurm.launcher.policy import Reason
from resilient_slurm.launcher.processes import RankExit
from resilient_slurm.launcher.requeue import act_on_outcome
from resilient_slurm.launcher.signals import TrapEvent
from resilient_slurm.launcher.stopping import RECORDS_RESERVE_S, records_reserve
from resilient_slurm.slurm import JobInfo, PartitionInfo, SlurmClient

RUNNING = JobInfo(job_id=42, name="train", state="RUNNING", reason=None, restarts=0, requeue=True, priority=1,
                  time_limit=None, submit_time=None, start_time=None, end_time=None, preempt_time=None,
                  partition="low", nodes=("n1",), node_list="n1", batch_host="n1", exit_code=None,
                  exit_signal=None, comment=None)
CANCELLING = dataclasses.replace(RUNNING, state="COMPLETING")  # scancel: no TimeLimit reason, no PreemptTime
PREEMPTED = dataclasses.replace(RUNNING, preempt_time=datetime.now(timezone.utc))
GRACE_ENDED = dataclasses.replace(PREEMPTED, state="COMPLETING")


class TableSlurm(SlurmClient):
    """Answers job_info with ``job`` and KillWait with ``kill_wait``; counts the questions; nothing else."""

    def __init__(self, job: JobInfo, kill_wait: float = 5) -> None:
        self.job = job
        self.kill_wait = kill_wait
        self.job_infos = 0

    def job_info(self, job_id: int | str) -> JobInfo:
        self.job_infos += 1
        return self.job

    def config_value(self, key: str) -> str:
        assert key == "KillWait", key
        return f"{self.kill_wait:g} sec"

    def _not_here(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"no Slurm command is expected here: {args} {kwargs}")

    def requeue(self, job_id: int | str, *, only_incomplete: bool = True) -> None:
        self._not_here("requeue", job_id)

    def requeue_hold(self, job_id: int | str, reason: str, *, only_incomplete: bool = True) -> None:
        self._not_here("requeue_hold", job_id)

    def signal(self, job_id: int | str, sig: signal.Signals | int, *, batch: bool = False, full: bool = False,
               step: str | None = None) -> None:
        self._not_here("signal", job_id, sig)

    def cancel(self, job_id: int | str) -> None:
        self._not_here("cancel", job_id)

    def submit(self, script: Any, args: Sequence[str] = ()) -> int:
        return self._not_here("submit", script)  # type: ignore[no-any-return]

    def partition_info(self, name: str) -> PartitionInfo:
        return self._not_here("partition_info", name)  # type: ignore[no-any-return]

    def hostnames(self, nodelist: str) -> list[str]:
        return self._not_here("hostnames", nodelist)  # type: ignore[no-any-return]

    def node_addresses(self, nodelist: str) -> dict[str, str]:
        return self._not_here("node_addresses", nodelist)  # type: ignore[no-any-return]

    def steps(self, job_id: int | str) -> list[tuple[str, str]]:
        return self._not_here("steps", job_id)  # type: ignore[no-any-return]

    def exclude_nodes(self, job_id: int | str, nodes: Sequence[str]) -> list[str]:
        return self._not_here("exclude_nodes", job_id, nodes)  # type: ignore[no-any-return]


class Server:
    """The control server as StopControl sees it: the save requests it got; a rank registered."""

    def __init__(self) -> None:
        self.requests: list[float] = []

    def request_save(self, reason: str, deadline: float) -> None:
        self.requests.append(deadline)

    def status(self) -> dict[str, Any]:
        return {"ranks": [0]}


class Ranks:
    """Ranks still running (the launcher has not seen them exit)."""

    torn_down = False

    def exits(self) -> list[RankExit]:
        return []

    def signal_ranks(self, sig: int) -> None:
        raise AssertionError("a registered rank gets the request over the socket")


def _launcher(tmp_path: Path, home: Path, slurm: TableSlurm) -> Launcher:
    env = {"HOME": str(home), "RSLURM_LOCAL_DIR": str(tmp_path / "nvme"), "RSLURM_CONTROL_DIR": str(tmp_path / "ctl"),
           "RSLURM_RUN_ID": "toy", "SLURM_JOB_ID": "42", "SLURMD_NODENAME": "n1"}
    launcher = Launcher(["true"], env=env, slurm=slurm)
    launcher.restored = 4
    launcher.timings["start"] = time.time()
    return launcher


def _signal(launcher: Launcher, source: str, at: float) -> None:
    launcher.stopping.on_event(TrapEvent(source, at), Ranks(), Server())  # type: ignore[arg-type]


def _launcher_events(tmp_path: Path) -> list[dict[str, Any]]:
    return [e for e in read_jsonl(tmp_path / "nvme" / "toy" / "events.jsonl") if e["source"] == "launcher"]


def _history(tmp_path: Path) -> list[dict[str, Any]]:
    return json.loads((tmp_path / "nvme" / "toy" / "launcher-history.json").read_text())["incarnations"]


@pytest.mark.parametrize(("kill_wait", "saves_for"), [(5, 3.0), (30, 28.0), (2, 1.0)])
def test_the_save_of_a_job_slurm_is_ending_leaves_the_records_reserve_of_killwait(
        tmp_path: Path, home: Path, kill_wait: float, saves_for: float) -> None:
    """scancel: the ranks get KillWait less the reserve (2 s, at most half of KillWait) from the signal."""
    assert records_reserve(kill_wait) == min(RECORDS_RESERVE_S, kill_wait / 2)
    launcher = _launcher(tmp_path, home, TableSlurm(CANCELLING, kill_wait))
    at = time.time()
    _signal(launcher, "SIGTERM", at)
    stop = launcher.stopping.stop
    assert stop is not None and stop.reason is Reason.CANCELLED and stop.ending == CANCELLING
    assert stop.deadline == pytest.approx(at + saves_for)


def test_a_sigterm_that_finds_the_grace_ended_marks_the_stop_ending_and_brings_the_deadline_closer(
        tmp_path: Path, home: Path) -> None:
    """USR1 at the start of a preemption's grace: the job can still be requeued. Slurm's SIGTERM at the end
    of the grace: it cannot any more, and the save gets KillWait less the reserve."""
    slurm = TableSlurm(PREEMPTED)
    launcher = _launcher(tmp_path, home, slurm)
    _signal(launcher, "SIGUSR1", time.time())
    stop = launcher.stopping.stop
    assert stop is not None and stop.ending is None and stop.reason is Reason.PREEMPTED
    slurm.job = GRACE_ENDED
    at = time.time()
    _signal(launcher, "SIGTERM", at)
    assert stop.ending == GRACE_ENDED and stop.deadline == pytest.approx(at + 5 - RECORDS_RESERVE_S)


@pytest.mark.parametrize(("job", "source", "rule", "outcome"),
                         [(CANCELLING, "SIGTERM", "cancelled", "cancelled"),
                          (GRACE_ENDED, "SIGTERM", "already_ending", "preempted")],
                         ids=["scancel", "grace-ended"])
def test_the_end_of_a_job_slurm_is_ending_is_recorded_before_the_ranks_exit_and_only_once(
        tmp_path: Path, home: Path, job: JobInfo, source: str, rule: str, outcome: str) -> None:
    """With the emergency step committed and the ranks still running, the launcher records the decision,
    ``not_requeued`` (the state Slurm gave at the signal) and the history, asking Slurm nothing more. At the
    end it returns that decision and records nothing again; a step that committed after the records (the
    ranks saved on before their teardown) corrects the history's entry, not the events."""
    slurm = TableSlurm(job)
    launcher = _launcher(tmp_path, home, slurm)
    run = tmp_path / "nvme" / "toy"
    _step(run, 4, _manifest(4, "interval"))
    _signal(launcher, source, time.time())
    _step(run, 8, _manifest(8, "emergency"))
    asked = slurm.job_infos

    launcher._record_if_ending(Ranks())  # type: ignore[arg-type]  # what the loop does once the commit is seen
    launcher._record_if_ending(Ranks())  # type: ignore[arg-type]  # and on its next turns
    events = _launcher_events(tmp_path)
    check_records(read_docs(), events)
    assert [e["event"] for e in events] == ["signal", "save_requested", "decision", "not_requeued"], events
    decision = events[2]
    assert (decision["action"], decision["rule"], decision["outcome"]) == ("exit", rule, outcome), decision
    assert (decision["committed_step"], decision["restored_step"]) == (8, 4), decision
    assert events[3]["state"] == "COMPLETING"
    assert [(h["reason"], h["action"], h["committed_step"]) for h in _history(tmp_path)] == [(outcome, "exit", 8)]
    assert slurm.job_infos == asked, "the records waited for no Slurm command"

    _step(run, 12, _manifest(12, "emergency"))  # committed between the records and the teardown
    result = act_on_outcome(launcher, classify_outcome(launcher, Ranks(), launcher.restored))  # type: ignore[arg-type]
    assert result.decision is not None and result.decision.rule == rule and result.outcome.committed_step == 12
    assert result.exit_code == (1 if rule == "cancelled" else 75)
    assert [e["event"] for e in _launcher_events(tmp_path)] == ["signal", "save_requested", "decision", "not_requeued"]
    assert [(h["reason"], h["action"], h["committed_step"]) for h in _history(tmp_path)] == [(outcome, "exit", 12)]
    assert slurm.job_infos == asked


def test_a_stop_slurm_is_not_ending_records_nothing_early(tmp_path: Path, home: Path) -> None:
    """USR1 for a preemption: the job is requeued at the end, as before; nothing is recorded before that."""
    launcher = _launcher(tmp_path, home, TableSlurm(PREEMPTED))
    _step(tmp_path / "nvme" / "toy", 8, _manifest(8, "emergency"))
    _signal(launcher, "SIGUSR1", time.time())
    launcher._record_if_ending(Ranks())  # type: ignore[arg-type]
    assert launcher.recorded_end is None
    assert [e["event"] for e in _launcher_events(tmp_path)] == ["signal", "save_requested"]
    assert not (tmp_path / "nvme" / "toy" / "launcher-history.json").exists()
