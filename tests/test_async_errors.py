"""Background saves: a failure in the writer thread surfaces on the next call and is never lost; and
the save cadence (steps and seconds, with an injected clock)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import checkpoint_entries, clean_env

from resilient_slurm import Checkpointer, ConfigError
from resilient_slurm.checkpoint.policy import Cadence

# Failpoints are read when resilient_slurm.failpoints is imported, so the armed save runs in its own
# process. Each scenario starts a non-blocking save that fails in the background, then makes one call.
SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    import torch
    from resilient_slurm import Checkpointer, SaveError

    root = sys.argv[1]

    def state():
        return {"w": torch.arange(4096.0), "epoch": 1}

    def listing(name):
        d = os.path.join(root, name, "r")
        return sorted(n for n in os.listdir(d) if n != "events.jsonl") if os.path.isdir(d) else []

    def wait_background(ck):
        # Test-only peek: wait until the failed background save has finished, so the next call
        # takes the "already failed" path rather than the back-pressure wait.
        deadline = time.monotonic() + 60
        while not ck._inflight.done() and time.monotonic() < deadline:
            time.sleep(0.01)

    def after_step(ck):
        ck.step(2, state())

    def after_wait(ck):
        ck.wait()

    def after_close(ck):
        ck.close()

    def after_save(ck):
        ck.save(5, state(), blocking=False)

    def after_restore(ck):
        ck.restore(state())

    def after_not_due_step(ck):
        wait_background(ck)
        ck.step(3, state())  # not on the cadence: must still report the failure

    SCENARIOS = {
        "step": after_step, "wait": after_wait, "close": after_close, "save": after_save,
        "restore": after_restore, "not_due_step": after_not_due_step,
    }
    for name, call in SCENARIOS.items():
        ck = Checkpointer(local_dir=os.path.join(root, name), run_id="r",
                          every_steps=1 if name != "not_due_step" else 2)
        ck.step(1 if name != "not_due_step" else 2, state())  # on cadence: non-blocking save
        try:
            call(ck)
        except SaveError as exc:
            print(f"SURFACED {name} {type(exc).__name__}: {exc}", flush=True)
        else:
            print(f"LOST {name}", flush=True)
        # surfaced once, then cleared: the next call does not re-raise a stale error
        if name != "close":
            print(f"AFTER {name} {ck.wait()!r}", flush=True)
            ck.close()
        print(f"DIR {name} {listing(name)}", flush=True)

    # The context manager surfaces it too, when the block ends normally.
    try:
        with Checkpointer(local_dir=os.path.join(root, "ctx"), run_id="r", every_steps=1) as ck:
            ck.step(1, state())
    except SaveError as exc:
        print(f"SURFACED ctx {type(exc).__name__}: {exc}", flush=True)
    else:
        print("LOST ctx", flush=True)
    print(f"DIR ctx {listing('ctx')}", flush=True)
    print("END", flush=True)
    """
)

SCENARIOS = ["step", "wait", "close", "save", "restore", "not_due_step", "ctx"]


@pytest.fixture(scope="module")
def failed_saves(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("async")
    r = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(root)],
        env=clean_env({"RSLURM_FAILPOINTS": "after_shard_write=raise"}),
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "END" in r.stdout, out
    return r.stdout


@pytest.mark.proc
@pytest.mark.parametrize("name", SCENARIOS)
def test_background_failure_surfaces_on_next_call(failed_saves: str, name: str) -> None:
    lines = {tuple(line.split(" ", 2)[:2]): line for line in failed_saves.splitlines()}
    surfaced = lines.get(("SURFACED", name))
    assert surfaced is not None, f"the background failure was lost ({name}):\n{failed_saves}"
    assert "SaveError:" in surfaced
    step = 2 if name == "not_due_step" else 1
    assert f"save of step {step}" in surfaced and "failpoint after_shard_write" in surfaced, surfaced
    if name not in ("close", "ctx"):
        assert lines[("AFTER", name)] == f"AFTER {name} None"
    # nothing committed, nothing half-written left behind
    assert lines[("DIR", name)] == f"DIR {name} []", failed_saves


# ---------------------------------------------------------------------------------------- cadence
class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_cadence_every_steps() -> None:
    c = Cadence(every_steps=5, clock=FakeClock())
    assert [s for s in range(1, 21) if c.due(s)] == [5, 10, 15, 20]
    assert not c.time_based


def test_cadence_every_seconds() -> None:
    clk = FakeClock()
    c = Cadence(every_seconds=10.0, clock=clk)
    assert c.time_based
    assert not c.due(1)
    clk.t += 9.99
    assert not c.due(2)
    clk.t += 0.01
    assert c.due(3)
    assert c.due(3), "due() must not consume the window; only saved() does"
    c.saved()
    assert not c.due(4)
    clk.t += 5
    assert not c.due(5)
    clk.t += 5
    assert c.due(6)


def test_cadence_both_and_neither() -> None:
    clk = FakeClock()
    c = Cadence(every_steps=100, every_seconds=60.0, clock=clk)
    assert c.due(100) and not c.due(99)
    clk.t += 60
    assert c.due(99)
    never = Cadence(clock=clk)
    clk.t += 10**6
    assert not any(never.due(s) for s in range(1, 1000))


@pytest.mark.parametrize(
    "kw,name",
    [({"every_steps": 0}, "every_steps"), ({"every_steps": -3}, "every_steps"),
     ({"every_seconds": 0.0}, "every_seconds"), ({"every_seconds": -1.0}, "every_seconds")],
)
def test_cadence_invalid(kw: dict[str, float], name: str) -> None:
    with pytest.raises(ConfigError, match=name):
        Cadence(**kw)  # type: ignore[arg-type]


def test_checkpointer_saves_on_time_cadence(tmp_path: Path) -> None:
    """step() saves when the (injected) clock says so; a save restarts the window."""
    root = tmp_path / "nvme"
    clk = FakeClock()
    state = {"w": torch.zeros(16)}
    with Checkpointer(local_dir=str(root), run_id="t", every_seconds=60) as ck:
        ck.cadence = Cadence(every_seconds=60, clock=clk)
        run = root / "t"

        def steps() -> list[str]:
            ck.wait()
            return checkpoint_entries(run)

        ck.step(1, state)
        assert steps() == []
        clk.t += 61
        state["w"].fill_(2)
        ck.step(2, state)
        assert steps() == ["step_000000000002"]
        clk.t += 30
        ck.step(3, state)
        assert steps() == ["step_000000000002"]
        clk.t += 30
        ck.step(4, state)
        assert steps() == ["step_000000000002", "step_000000000004"]
