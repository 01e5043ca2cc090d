"""The durable commit is linear in nodes (issue 29 item 1): each domain writes a commit marker under its save's
token, one LIST finds them, and only a node still waiting re-checks, less and less often.

The domains are emulated with bench/bench_commit.py (one real save cloned into N node-local roots, each one
domain of an N-rank step) and drained with the real ``StepDrainer`` / ``Daemon``, against POSIX and the S3
server the tests use (requests counted as they reach the wire)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import s3_support
from bench_support import load_bench

from resilient_slurm.checkpoint.policy import RetentionPolicy
from resilient_slurm.daemon import Daemon
from resilient_slurm.daemon.drain import RECHECK_MAX_S, LocalStep, StepDrainer, recheck_delay, scan_local
from resilient_slurm.manifest import (
    MANIFEST_NAME,
    Manifest,
    commit_marker_key,
    read_durable_manifest,
    save_token,
)
from resilient_slurm.storage.posix import PosixTier
from resilient_slurm.storage.s3 import S3Tier
from resilient_slurm.storage.tier import StorageTier

moto_server = s3_support.moto_server
s3_bucket = s3_support.s3_bucket



@pytest.fixture(scope="module")
def bc() -> ModuleType:
    return load_bench("bench_commit.py", "bench_commit")


@pytest.fixture(params=["posix", "s3"])
def make_tier(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    def make(tag: str) -> StorageTier:
        if request.param == "posix":
            return PosixTier(str(tmp_path / f"durable-{tag}"))
        server = request.getfixturevalue("moto_server")
        return S3Tier(f"{server.new_bucket()}/{tag}", endpoint_url=server.endpoint, region="us-east-1")

    return make


def test_a_commit_at_64_domains_makes_a_constant_number_of_requests_per_domain(bc: ModuleType, tmp_path: Path,
                                                                                 make_tier: Any) -> None:
    rows = {n: bc.commit_all(make_tier(f"n{n}"), bc.emulate_domains(str(tmp_path / f"local-{n}"), n))
            for n in (16, 64)}
    for n, r in rows.items():
        # Per domain: GET root manifest, HEAD own marker, LIST saves, HEAD + PUT shard, PUT .metadata,
        # manifest and marker, LIST markers; the last one 2 GETs + 2 PUTs more; 1 GET to see the commit.
        assert r["requests"] <= 9 * n + 5, r
        assert r["lists"] == 2 * n, r  # one LIST page of the saves and one of the markers per domain
    # Linear: four times the domains, four times the requests (the previous commit made 12 times as many).
    assert rows[64]["requests"] - 5 == pytest.approx(4 * (rows[16]["requests"] - 5), rel=0.02), rows


def test_the_previous_commit_was_quadratic(bc: ModuleType, tmp_path: Path) -> None:
    """The baseline the bench prints beside it really is N GETs per node (so the bench's ratio means what
    it says)."""
    steps = bc.emulate_domains(str(tmp_path / "local"), 16)
    r = bc.commit_all(PosixTier(str(tmp_path / "durable")), steps, previous=True)
    assert r["by_operation"]["get_bytes"] >= 16 * 16, r


def _resave(steps: list[LocalStep], created_at: float) -> list[LocalStep]:
    """The same step saved again (another ``created_at``) on every domain."""
    out = []
    for ls in steps:
        m = dataclasses.replace(ls.manifest, created_at=created_at)
        Path(ls.path, MANIFEST_NAME).write_text(m.to_json())
        (again,) = scan_local(str(Path(ls.path).parent.parent), [ls.run_id])
        out.append(again)
    return out


def test_markers_of_another_save_of_the_step_never_count(bc: ModuleType, tmp_path: Path, make_tier: Any) -> None:
    tier = make_tier("resave")
    first = bc.emulate_domains(str(tmp_path / "local"), 2)
    d0, d1 = (ls.domain for ls in first)
    assert StepDrainer(tier).drain(first[0]).state == "waiting"  # d0's marker of save A
    second = _resave(first, first[0].manifest.created_at + 1.0)  # save B of the same step, on both nodes
    res = StepDrainer(tier).drain(second[1])  # d1 drains B: d0's marker is of A, it does not count
    assert res.state == "waiting" and res.missing_domains == [d0], res
    with pytest.raises(Exception, match=r"manifest\.json"):
        read_durable_manifest(tier, bc.RUN, bc.STEP)
    res = StepDrainer(tier).drain(second[0])  # d0 drains B: its marker of A is deleted first, then B commits
    assert res.committed, res
    root = read_durable_manifest(tier, bc.RUN, bc.STEP)
    assert root.created_at == second[0].manifest.created_at
    assert tier.list_names(commit_marker_key(bc.RUN, bc.STEP, save_token(first[0].manifest))) == []
    assert tier.list_names(commit_marker_key(bc.RUN, bc.STEP, save_token(second[0].manifest))) == [d0, d1]


class NeverCommits(StepDrainer):
    """A node that dies after its marker is written and before the commit."""

    def try_commit(self, run_id: str, step: int, m: Manifest) -> list[str]:
        return ["(died)"]


def test_a_waiting_node_rechecks_less_and_less_and_commits_for_a_node_that_died(bc: ModuleType, tmp_path: Path,
                                                                                make_tier: Any) -> None:
    tier = make_tier("recheck")
    steps = bc.emulate_domains(str(tmp_path / "local"), 2)
    now = [1000.0]
    root0 = str(Path(steps[0].path).parent.parent)
    daemon = Daemon(root0, tier, node=steps[0].domain, retention=RetentionPolicy(5), min_free="0%",
                    poll_interval=5.0, clock=lambda: now[0], metrics_textfile=None)
    counts = bc.counting(tier)

    def step_requests() -> int:
        """Requests of the last pass that touched the step itself (not the run's listing or tags)."""
        before = dict(counts)
        daemon.run_pass()
        diff = {k: v - before.get(k, 0) for k, v in counts.items()}
        return sum(v for k, v in diff.items() if k.lower() in ("get_bytes", "stat", "list_names", "getobject",
                                                                "headobject"))

    assert step_requests() > 0
    st = daemon._status[(bc.RUN, bc.STEP)]
    assert st.state == "waiting" and st.waiting_for == [steps[1].domain]
    checks = []
    for _ in range(6):  # passes every 5 s for 30 s: re-checks at +5, +15 (after 10 more), then 20 later
        now[0] += 5.0
        before = st.checks
        step_requests()
        checks.append(st.checks - before)
    assert checks == [1, 0, 1, 0, 0, 0], checks
    assert NeverCommits(tier).drain(steps[1]).state == "waiting"  # the last node's marker, then it died
    now[0] += 20.0
    step_requests()
    assert st.state == "durable", st
    assert read_durable_manifest(tier, bc.RUN, bc.STEP).created_at == steps[0].manifest.created_at


def test_recheck_delay_doubles_up_to_its_cap() -> None:
    assert [recheck_delay(k, 5.0) for k in range(1, 8)] == [5, 10, 20, 40, 60, 60, 60]
    assert recheck_delay(1, 120.0) == 120.0  # never sooner than the poll interval
    assert RECHECK_MAX_S == 60.0


def test_list_names_lists_objects_one_level_down_without_links(tmp_path: Path) -> None:
    tier = PosixTier(str(tmp_path / "t"))
    for k in ("a/x", "a/y", "a/sub/z", "b/w"):
        tier.put_bytes(k, b"1")
    os.symlink(tmp_path / "t" / "a" / "x", tmp_path / "t" / "a" / "link")
    assert tier.list_names("a") == ["x", "y"]
    assert tier.list_names("nothing") == []
