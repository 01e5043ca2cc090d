"""Kill a real process during a save, at every named point of the commit protocol and at random
moments, then check that a fresh process restores the last committed step with exactly that step's
content (never a partial or mixed state), cleans the leftovers and carries on saving."""

from __future__ import annotations

import os
import random
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import REPO, checkpoint_entries, clean_env

from resilient_slurm.failpoints import POINTS

pytestmark = pytest.mark.proc  # every test here starts processes (tests/check_tier.py)

WORKER = str(REPO / "tests" / "workers" / "crash_worker.py")
RUN = "crash"

# Step restored after a SIGKILL at each point during the save of step 2 (step 1 committed before).
EXPECTED_AFTER_KILL = {
    "before_shard_write": 1,
    "during_waves": 1,  # saved under staging_memory_limit: part of the shard written in the temp directory
    "after_shard_write": 1,
    "after_dcp_metadata": 1,
    "after_manifest": 1,  # complete-looking manifest, but still in the temp directory: not committed
    "after_commit_rename": 2,
    "during_retention": 2,
}
# Points a single process never reaches, tested where they fire.
ELSEWHERE = {"during_peer_send": "tests/test_peer_replicas.py (a replica round needs two nodes)",
             "during_range_fetch": "tests/test_ranged_fetch.py (a restore from the durable tier, not a save)",
             "gc_before_age": "tests/test_hostile_round2.py (rslurm gc measuring a temp directory, not a save)"}
SAVE_POINTS = tuple(p for p in POINTS if p not in ELSEWHERE)
# Points after which an in-progress directory (temp or retention-doomed) is necessarily left behind.
LEAVES_TMP = {"before_shard_write", "during_waves", "after_shard_write", "after_dcp_metadata", "after_manifest", "during_retention"}


@dataclass
class Run:
    rc: int
    out: str

    def values(self, word: str) -> list[int]:
        return [int(m) for m in re.findall(rf"^{word} (-?\d+)", self.out, re.M)]


class Zygote:
    """The worker in ``--zygote`` mode: every ``start`` forks a fresh worker process (torch imported
    once), so a test can kill and restart the "training job" many times cheaply."""

    def __init__(self, cwd: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, WORKER, "--zygote"],
            env=clean_env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            cwd=cwd,
        )
        self.lines: list[str] = []

    def readline(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            pytest.fail("the worker zygote died:\n" + "".join(self.lines[-50:]))
        self.lines.append(line)
        return line

    def start(self, root: Path, *extra: str, steps: int) -> int:
        """Fork a worker; return its pid."""
        assert self.proc.stdin is not None
        args = ["--local-dir", str(root), "--run-id", RUN, "--steps", str(steps), *extra]
        self.proc.stdin.write("run " + shlex.join(args) + "\n")
        self.proc.stdin.flush()
        self.mark = len(self.lines)
        while True:
            line = self.readline()
            if line.startswith("child "):
                return int(line.split()[1])

    def read_until(self, prefix: str) -> str:
        while True:
            line = self.readline()
            if line.startswith(prefix) or line.startswith("exited "):
                return line

    def finish(self, pid: int) -> Run:
        """Wait for the worker ``pid`` to exit; its output and exit code (negative: signal)."""
        while True:
            line = self.readline()
            if line.startswith(f"exited {pid} "):
                out = "".join(self.lines[self.mark :])
                return Run(int(line.split()[2]), out)

    def run(self, root: Path, *extra: str, steps: int) -> Run:
        return self.finish(self.start(root, *extra, steps=steps))

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def zygote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Zygote]:
    z = Zygote(tmp_path_factory.mktemp("zygote"))
    yield z
    z.close()


def run_dir_entries(root: Path) -> list[str]:
    return checkpoint_entries(root / RUN)


# ---------------------------------------------------------------------------------------- A: failpoints
@pytest.fixture(scope="module")
def killed_at_every_point(
    zygote: Zygote, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[Path, Run, list[str], Run]]:
    """For every failpoint: save step 1, SIGKILL during the save of step 2, then restart and save
    steps 3 and 4 (each run is a fresh process)."""
    unknown = set(POINTS) - set(EXPECTED_AFTER_KILL) - set(ELSEWHERE)
    assert not unknown, f"new failpoints {unknown}: add what a restart must restore to EXPECTED_AFTER_KILL"
    common = ("--keep-last", "1", "--tensors", "4", "--tensor-mb", "1")
    results = {}
    for pt in SAVE_POINTS:
        root = tmp_path_factory.mktemp(pt) / "nvme"
        waves = ("--staging-memory-limit", "256KiB") if pt == "during_waves" else ()  # the point's only path
        killed = zygote.run(root, *common, *waves, "--arm", f"{pt}=kill", "--arm-at", "2", steps=2)
        after_kill = run_dir_entries(root)
        resumed = zygote.run(root, *common, *waves, steps=4)
        results[pt] = (root, killed, after_kill, resumed)
    return results


@pytest.mark.parametrize("point", SAVE_POINTS)
def test_kill_at_failpoint_restores_last_committed_step(
    killed_at_every_point: dict[str, tuple[Path, Run, list[str], Run]], point: str
) -> None:
    root, killed, after_kill, resumed = killed_at_every_point[point]
    # The failpoint really fired during the save of step 2, after step 1 committed.
    assert killed.rc == -signal.SIGKILL, f"worker was not killed at {point} (rc {killed.rc}):\n{killed.out}"
    assert killed.values("committed") == [1] and killed.values("saving") == [1, 2], killed.out
    want = EXPECTED_AFTER_KILL[point]
    committed_dirs = [n for n in after_kill if ".tmp-" not in n]
    assert f"step_{want:012d}" in committed_dirs, after_kill
    if point in LEAVES_TMP:
        assert any(".tmp-" in n for n in after_kill), f"expected an abandoned directory: {after_kill}"
    # The restart restores exactly the last committed step, cleans up, and carries on.
    assert resumed.rc == 0, resumed.out
    assert resumed.values("restored") == [want], resumed.out
    assert resumed.values("verified") == [want], resumed.out
    assert resumed.values("leftover") == [0], f"temp directories survived the restore:\n{resumed.out}"
    assert resumed.values("committed") == list(range(want + 1, 5)), resumed.out
    assert run_dir_entries(root) == ["step_000000000004"]


# ---------------------------------------------------------------------------------------- B: random kills
def test_random_sigkill_during_saves_never_yields_a_mixed_state(zygote: Zygote, tmp_path: Path) -> None:
    root = tmp_path / "nvme"
    big = ("--tensors", "8", "--tensor-mb", "4", "--keep-last", "2")  # 32 MiB of state
    # Reference run: commit steps 1..3 and time the saves (the first includes buffer allocation).
    ref = zygote.run(root, *big, steps=3)
    assert ref.rc == 0 and ref.values("committed") == [1, 2, 3], ref.out
    save_s = max(float(x) for x in re.findall(r"^committed \d+ ([\d.]+)", ref.out, re.M))
    rng = random.Random(1234)
    last_committed, highest_started = 3, 3
    history = []
    for it in range(10):
        pid = zygote.start(root, *big, steps=10**6)
        line = zygote.read_until("saving")  # the restore is verified and the first save begins
        assert line.startswith("saving"), "".join(zygote.lines[zygote.mark :])
        delay = rng.uniform(0, 1.5 * save_s)
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
        run = zygote.finish(pid)
        assert run.rc == -signal.SIGKILL, run.out
        restored = run.values("restored")
        assert len(restored) == 1 and run.values("verified") == restored, f"iteration {it}: wrong state:\n{run.out}"
        # Never older than what an earlier process saw committed, never newer than it started.
        assert last_committed <= restored[0] <= highest_started, (last_committed, highest_started, run.out)
        assert run.values("leftover") == [0], f"iteration {it}: temp directories survived the restore:\n{run.out}"
        history.append((restored[0], round(delay, 3), run.values("committed")))
        last_committed = max([restored[0], *run.values("committed")])
        highest_started = max([restored[0], *run.values("saving")])
    final = zygote.run(root, *big, steps=highest_started + 1)
    assert final.rc == 0, final.out
    assert final.values("verified") == final.values("restored"), final.out
    assert last_committed <= final.values("restored")[0] <= highest_started, (history, final.out)
    assert final.values("leftover") == [0], final.out
