"""The default cadence: without every_steps / every_seconds a Checkpointer saves on a time cadence of its
own, chosen from the measured save cost and the failure interval (Daly's optimum within bounds), and
says so; `rslurm launch` hands its ranks the failure interval the run's history shows.

The Checkpointer tests run the real save path in this process with a stepped clock (the cadence's only
fake: a test must not sleep a minute); the launcher test runs `rslurm launch` on a real program.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import clean_env, read_jsonl

from resilient_slurm import Checkpointer
from resilient_slurm.checkpoint.policy import (
    AUTO_FAILURE_INTERVAL_S,
    AUTO_MAX_S,
    AUTO_MIN_S,
    AUTO_WRITE_FACTOR,
    Cadence,
    auto_interval,
    daly_interval,
)
from resilient_slurm.errors import ConfigError
from resilient_slurm.launcher.policy import HISTORY_FILE, Outcome, ProgressHistory, RankRun, Reason


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


# ------------------------------------------------------------------------------------------ formulas
def test_daly_and_the_bounds() -> None:
    assert daly_interval(0.5, 86400) == pytest.approx(math.sqrt(2 * 0.5 * 86400) - 0.5)
    assert daly_interval(10, 15) == 15  # a save costing more than half the failure interval: M
    assert daly_interval(-1, 100) == 0.0
    assert auto_interval(0.5, 1.0, 86400) == pytest.approx(daly_interval(0.5, 86400))  # ~293 s
    assert auto_interval(0.001, 0.1, 86400) == AUTO_MIN_S  # cheap saves: the floor
    assert auto_interval(0.5, 400.0, 86400) == AUTO_WRITE_FACTOR * 400.0  # the write bounds it from below
    assert auto_interval(30.0, 10.0, 1e9) == AUTO_MAX_S
    assert (AUTO_MIN_S, AUTO_MAX_S, AUTO_FAILURE_INTERVAL_S, AUTO_WRITE_FACTOR) == (60.0, 3600.0, 86400.0, 2.0)


def test_the_cadence_starts_at_the_floor_and_follows_the_median_costs() -> None:
    clock = Clock()
    c = Cadence(auto=True, clock=clock, failure_interval=7200.0)
    assert c.time_based and c.every_seconds == AUTO_MIN_S and c.costs() == (0.0, 0.0)
    clock.t += 59.9
    assert not c.due(1)
    clock.t += 0.2
    assert c.due(2)
    c.saved()
    want = daly_interval(2.0, 7200.0)  # ~168 s
    assert c.observe(2.0, 5.0) == pytest.approx(want)
    assert c.observe(2.0, 5.0) is None  # unchanged
    assert c.observe(50.0, 5.0) is None  # one outlier does not move the median of three
    assert c.costs() == (2.0, 5.0)
    for _ in range(3):
        c.observe(0.001, 0.1)
    assert c.every_seconds == AUTO_MIN_S  # the newest five: mostly cheap
    assert Cadence(every_steps=5).observe(1.0, 1.0) is None  # an explicit cadence is never changed
    with pytest.raises(ConfigError, match="only when every_steps and every_seconds are unset"):
        Cadence(every_steps=5, auto=True)


# ------------------------------------------------------------------------------------ Checkpointer
def _steps(ck: Checkpointer, clock: Clock, model: torch.nn.Module, n: int, dt: float) -> None:
    ck.cadence.clock = clock
    ck.cadence.saved()  # the window starts on the stepped clock
    for s in range(1, n + 1):
        with torch.no_grad():
            model.weight.add_(1.0)
        clock.t += dt
        ck.step(s, {"model": model})


def test_a_checkpointer_without_a_cadence_saves_on_its_own_and_says_so(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RSLURM_FAILURE_INTERVAL", "1e7")  # so that the measured cost moves it off the floor
    clock = Clock()
    model = torch.nn.Linear(64, 64)
    with Checkpointer(local_dir=str(tmp_path), run_id="auto") as ck:
        assert ck.cadence.auto and ck.cadence.every_seconds == AUTO_MIN_S
        _steps(ck, clock, model, 10, 15.0)  # 150 s of training: saves at steps 4 and 8
        ck.wait()
        ck.save(11, {"model": model}, reason="interval")  # a third interval save reports the second one
        ck.wait()
    events = read_jsonl(tmp_path / "auto" / "events.jsonl")
    assert [e["step"] for e in events if e["event"] == "save_committed" and e["reason"] == "interval"] == [4, 8, 11]
    cad = [e for e in events if e["event"] == "cadence"]
    assert cad[0]["basis"] == "start" and cad[0]["interval_s"] == AUTO_MIN_S, cad
    assert cad[0]["failure_interval_s"] == 1e7, cad
    # The first save's costs give Daly's interval for them, above the floor; the second save's may move the
    # medians by a quarter again (the first stall included allocating the staging buffer).
    assert 1 <= len(cad[1:]) <= 2, cad
    for measured in cad[1:]:
        assert measured["basis"] == "measured" and measured["stall_s"] > 0, measured
        want = auto_interval(measured["stall_s"], measured["write_s"], 1e7)
        assert measured["interval_s"] == pytest.approx(want, rel=1e-2), measured  # the fields are rounded
    assert cad[1]["interval_s"] > AUTO_MIN_S, cad
    restored = torch.nn.Linear(64, 64)
    with Checkpointer(local_dir=str(tmp_path), run_id="auto") as ck:
        assert ck.restore({"model": restored}) == 11
    assert torch.equal(restored.weight, model.weight)


@pytest.mark.parametrize("env", [{"RSLURM_AUTO_CADENCE": "off"}, {"RSLURM_EVERY_STEPS": "100"}])
def test_an_explicit_cadence_or_off_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, env: dict) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    clock = Clock()
    model = torch.nn.Linear(8, 8)
    with Checkpointer(local_dir=str(tmp_path), run_id="off") as ck:
        assert not ck.cadence.auto
        _steps(ck, clock, model, 10, 60.0)
    events = read_jsonl(tmp_path / "off" / "events.jsonl") if (tmp_path / "off" / "events.jsonl").exists() else []
    assert not [e for e in events if e["event"] in ("cadence", "save_started")], events


# ------------------------------------------------------------------------------------------ launcher
def test_the_history_gives_the_failure_interval() -> None:
    h = ProgressHistory()
    assert h.failure_interval(now=100.0, started_at=0.0) is None  # no failure yet
    h = h.record(Outcome(Reason.PREEMPTED), started_at=0.0, ended_at=3600.0)  # announced: not a failure
    h = h.record(Outcome(Reason.KILLED_BY_SIGNAL), started_at=4000.0, ended_at=7600.0,
                 in_job=[RankRun("hang"), RankRun("user_error")])
    # 7200 s of run time, 2 unannounced failures (a hang restarted in-job, the kill); + 1800 s now
    assert h.failure_interval() == 3600.0
    assert h.failure_interval(now=10000.0, started_at=8200.0, in_job=[RankRun("out_of_memory")]) == 9000.0 / 3


PRINT_ENV = "import os; print('FI=' + os.environ.get('RSLURM_FAILURE_INTERVAL', '-'))"


def _launch(tmp: Path, env: dict[str, str] | None = None) -> str:
    e = clean_env({"RSLURM_LOCAL_DIR": str(tmp / "nvme"), "RSLURM_RUN_ID": "fi", "RSLURM_NODE_NAME": "n1",
                   "RSLURM_CONTROL_DIR": str(tmp / "ctl"), "RSLURM_DAEMON": "off", "RSLURM_HEALTH_CHECK": "off",
                   **(env or {})})
    r = subprocess.run([sys.executable, "-m", "resilient_slurm.cli", "launch", "--", sys.executable, "-c", PRINT_ENV],
                       env=e, cwd=tmp, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return next(line for line in r.stdout.splitlines() if line.startswith("FI="))


@pytest.mark.proc
def test_the_launcher_passes_the_observed_failure_interval(tmp_path: Path) -> None:
    assert _launch(tmp_path) == "FI=-"  # no history: the rank's default
    h = ProgressHistory().record(Outcome(Reason.HANG), started_at=0.0, ended_at=5000.0)
    (tmp_path / "nvme" / "fi").mkdir(parents=True, exist_ok=True)
    (tmp_path / "nvme" / "fi" / HISTORY_FILE).write_text(h.to_json())
    # the earlier run's 5000 s over one hang, plus this launch's own few seconds
    got = int(_launch(tmp_path).removeprefix("FI="))
    assert 5000 <= got < 5100, got
    assert _launch(tmp_path, {"RSLURM_FAILURE_INTERVAL": "777"}) == "FI=777"  # set by the user: kept
