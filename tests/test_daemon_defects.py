"""Three daemon defects, each with real ``rslurm daemon --once`` processes on real files:

1. ``--once`` logged "retrying in N s" for a failed step although it exits after that one try;
2. a drain that failed part way left its empty or partial, uncommitted step directory in a POSIX durable
   tier (``rslurm ls`` listed it as a ``partial`` durable step);
3. a durable tier (a quota, a small filesystem: here a real tmpfs) with room for exactly ``keep_last`` steps
   made the daemon retry a newer step forever: the older ones go only once a newer one lands.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import mounted_tmpfs, sdir
from test_daemon import (
    RUN,
    MiB,
    assert_loads,
    assert_same_bytes,
    drain,
    durable_steps,
    flip_byte,
    ok,
    rslurm,
    save_steps,
    step_dirs,
    tmp_files,
)

pytestmark = [
    pytest.mark.proc,  # every test here starts processes (tests/check_tier.py)
    pytest.mark.skipif(sys.platform != "linux", reason="flock, xattrs and signals as on Linux"),
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
]


@pytest.fixture(autouse=True)
def _n1(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RSLURM_NODE_NAME", "n1")


def durable_rows(local: Path, dur: Path) -> dict[int, str]:
    """``rslurm ls --json``: step -> its durable state. An empty step directory in the tier was listed as a
    step of its own (no local copy, durable ``partial``: "not committed: 0/? domain manifests")."""
    r = rslurm("ls", "--json", "--local-dir", str(local), "--durable", str(dur), "--run-id", RUN)
    assert r.returncode == 0, r.stderr
    return {s["step"]: s["durable"]["state"] for s in json.loads(r.stdout)["steps"]}


# ------------------------------------------------------------------------------------ 1. --once message
def test_once_failure_says_it_is_not_retried_and_exits_1(tmp_path: Path) -> None:
    local, dur = tmp_path / "nvme", tmp_path / "lustre"
    save_steps(local, [1], 256 * 1024)
    (dur / RUN).mkdir(parents=True)
    (dur / RUN / sdir(1)).write_text("not a directory")  # the tier cannot take the step
    r = drain(local, dur)
    assert r.returncode == 1, r.stderr
    line = [ln for ln in r.stderr.splitlines() if f"draining run {RUN} step 1 failed (attempt 1)" in ln]
    assert line, r.stderr
    assert "retrying in" not in r.stderr, r.stderr
    assert "not retried (--once): the next `rslurm daemon` retries it" in line[0], line
    events = [json.loads(x) for x in (local / RUN / "events.jsonl").read_text().splitlines()]
    failed = [e for e in events if e["event"] == "drain_failed"]
    assert [e["will_retry"] for e in failed] == [False], failed
    assert not [e for e in events if e["event"] == "drain_retry"]
    # The next --once pass does try it again, and drains it once the tier takes it.
    (dur / RUN / sdir(1)).unlink()
    ok(drain(local, dur))
    assert durable_steps(dur) == {1}


# ------------------------------------------------------------- 2. failed drains leave no step directory
def test_a_drain_failing_before_any_object_leaves_no_empty_step_directory(tmp_path: Path) -> None:
    local, dur = tmp_path / "nvme", tmp_path / "lustre"
    env = {"RSLURM_KEEP_LAST": "2"}
    save_steps(local, [1], 256 * 1024)
    ok(drain(local, dur, env=env))
    save_steps(local, [2], 256 * 1024)
    flip_byte(local / RUN / sdir(2) / "__0_0.distcp", 100)  # the shard's copy fails its checksum
    r = drain(local, dur, env=env)
    assert r.returncode == 1, r.stderr
    assert "cannot be drained" in r.stderr, r.stderr
    assert step_dirs(dur) == {1}, f"an empty step directory stayed: {sorted((dur / RUN).iterdir())}"
    assert durable_rows(local, dur) == {1: "durable", 2: "absent"}
    assert_same_bytes(local / RUN / sdir(1), dur / RUN / sdir(1))


def test_a_drain_failing_part_way_removes_the_objects_it_wrote(tmp_path: Path) -> None:
    local, dur = tmp_path / "nvme", tmp_path / "lustre"
    save_steps(local, [3], 256 * 1024)
    flip_byte(local / RUN / sdir(3) / ".metadata", 10)  # checked after the shard was sent
    r = drain(local, dur)
    assert r.returncode == 1, r.stderr
    # The old code left step 3's directory holding the shard it had sent: a "partial" step in `rslurm ls`.
    assert step_dirs(dur) == set(), sorted((dur / RUN).rglob("*"))
    assert f"run {RUN} step 3: removed what the failed drain wrote" in r.stderr, r.stderr
    assert not tmp_files(dur)


def test_a_failed_drain_never_removes_a_step_directory_it_did_not_create(tmp_path: Path) -> None:
    local, dur = tmp_path / "nvme", tmp_path / "lustre"
    save_steps(local, [4], 256 * 1024)
    other = dur / RUN / sdir(4) / "other-node-shard"
    other.parent.mkdir(parents=True)
    other.write_bytes(b"x")  # there before this drain: another node's, or a person's
    flip_byte(local / RUN / sdir(4) / "__0_0.distcp", 100)
    r = drain(local, dur)
    assert r.returncode == 1, r.stderr
    assert other.read_bytes() == b"x" and step_dirs(dur) == {4}


# --------------------------------------------------------------- 3. a durable tier with room for keep_last
STEP = 10 * MiB


@pytest.fixture
def small_tier(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Path]:
    with mounted_tmpfs(tmp_path / "quota", request.param) as mnt:
        yield mnt


@pytest.mark.root
@pytest.mark.parametrize("small_tier", ["28m"], indirect=True)
def test_a_full_durable_tier_makes_room_by_removing_what_retention_removes_next(tmp_path: Path,
                                                                               small_tier: Path) -> None:
    """Room for 2 steps and keep_last=2: step 1 goes for step 3 (retention removes it once 3 lands anyway)."""
    local, dur, env = tmp_path / "nvme", small_tier, {"RSLURM_KEEP_LAST": "2", "RSLURM_FREE_SPACE_MARGIN": "0"}
    save_steps(local, [1, 2], STEP)
    ok(drain(local, dur, env=env))
    assert durable_steps(dur) == {1, 2}
    save_steps(local, [3], STEP)
    err = ok(drain(local, dur, env=env))
    assert durable_steps(dur) == {2, 3} and step_dirs(dur) == {2, 3}, err
    assert f"the durable tier is full: removed run {RUN} step 1" in err, err
    assert_same_bytes(local / RUN / sdir(3), dur / RUN / sdir(3))
    assert_loads(dur / RUN / sdir(3), 3, STEP)
    assert not tmp_files(dur)


@pytest.mark.root
@pytest.mark.parametrize("small_tier", ["16m"], indirect=True)
def test_a_full_durable_tier_never_removes_the_last_durable_step_and_says_what_to_set(
        tmp_path: Path, small_tier: Path) -> None:
    """Room for 1 step and keep_last=1: the only durable step stays; the error names the setting."""
    local, dur, env = tmp_path / "nvme", small_tier, {"RSLURM_KEEP_LAST": "1", "RSLURM_FREE_SPACE_MARGIN": "0"}
    save_steps(local, [1], STEP)
    ok(drain(local, dur, env=env))
    save_steps(local, [2], STEP)
    r = drain(local, dur, env=env)
    assert r.returncode == 1, r.stderr
    assert durable_steps(dur) == {1} and step_dirs(dur) == {1}, r.stderr
    assert_same_bytes(local / RUN / sdir(1), dur / RUN / sdir(1))
    said = [ln for ln in r.stderr.splitlines() if "durable tier is full" in ln]
    assert said and "holds 1 durable step(s)" in said[0] and "room for one more step (2" in said[0], said
    assert "lower keep_last" not in said[0], said  # it would not help: the only durable step is the newest
    assert "not retried (--once)" in r.stderr, r.stderr
