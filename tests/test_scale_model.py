"""bench/scale_model.py (issue 14 item 4): the model's arithmetic keeps the properties the code implies.

Runs the model only (no --measure: nothing is started, nothing is written but a JSON file), in well under a
second."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import ModuleType

import pytest
from bench_support import load_bench

NODES = (1, 16, 256, 4096)


@pytest.fixture(scope="module")
def sm() -> ModuleType:
    return load_bench("scale_model.py", "scale_model")


@pytest.fixture(scope="module")
def result(sm: ModuleType) -> dict:
    p = sm.params_from(sm.build_parser().parse_args(["--nodes", ",".join(map(str, NODES))]))
    return sm.run_model(p)


def _rows(result: dict):
    for tier, scenarios in result["restore"].items():
        for scenario, rows in scenarios.items():
            for row in rows:
                yield tier, scenario, row


def test_plan_driven_never_reads_more_than_today(result: dict) -> None:
    for tier, scenario, row in _rows(result):
        where = f"{tier} {scenario} at {row['nodes']} nodes"
        assert row["plan"]["durable_bytes"] <= row["today"]["durable_bytes"] * (1 + 1e-12), where
        assert row["peer"]["durable_bytes"] <= row["plan"]["durable_bytes"] * (1 + 1e-12), where
        assert row["plan"]["restore_s"] <= row["today"]["restore_s"] * 1.01, where


def test_one_node_the_three_agree(result: dict) -> None:
    for tier, scenario, row in _rows(result):
        if row["nodes"] != 1:
            continue
        where = f"{tier} {scenario}"
        today, plan, peer = row["today"], row["plan"], row["peer"]
        assert today["durable_bytes"] == pytest.approx(plan["durable_bytes"]) == pytest.approx(peer["durable_bytes"])
        assert today["durable_requests"] == plan["durable_requests"] == peer["durable_requests"], where
        # Today fetches file after file, the plan pipelines across files: the latency terms differ slightly.
        assert math.isclose(today["restore_s"], plan["restore_s"], rel_tol=0.01), where
        assert plan["restore_s"] == peer["restore_s"], where


def test_every_node_fetching_reads_the_checkpoint_once_today_and_n_times_before(result: dict) -> None:
    """A requeue onto other nodes and a restart on half the nodes: today each node fetches its share (the
    saved domain with its ranks, or its plans' files), 1 checkpoint in all; before, every node fetched every
    file, N checkpoints."""
    size = result["params"]["size"]
    for tier, scenarios in result["restore"].items():
        for scenario in ("other_nodes", "resharded"):
            rows = scenarios[scenario]
            before = [r["every_file"]["durable_bytes"] for r in rows]
            assert before == sorted(before) and len(set(before)) == len(before), (tier, scenario)
            for r in rows:
                assert r["every_file"]["durable_bytes"] == pytest.approx(r["nodes"] * size), (tier, scenario)
                assert r["today"]["durable_bytes"] == pytest.approx(size), (tier, scenario)
                assert r["plan"]["durable_bytes"] == pytest.approx(size), (tier, scenario)
                assert r["today"]["restore_s"] <= r["every_file"]["restore_s"] * (1 + 1e-12), (tier, scenario)


def test_a_replaced_node_fetches_its_share_and_files_in_parallel_beat_one_after_another(result: dict) -> None:
    size = result["params"]["size"]
    for tier, scenarios in result["restore"].items():
        for r in scenarios["one_replaced"]:
            assert r["today"]["durable_bytes"] == pytest.approx(size / r["nodes"]), tier
            assert r["every_file"]["durable_bytes"] == pytest.approx(size), tier
        wiped = scenarios["same_nodes_wiped"]
        # Same bytes before and now (its own files); 8 files at a time are never slower than one by one.
        for r in wiped:
            assert r["today"]["durable_bytes"] == pytest.approx(r["every_file"]["durable_bytes"]), tier
            assert r["today"]["restore_s"] <= r["every_file"]["restore_s"] * (1 + 1e-12), tier


def test_commit_requests_grow_with_nodes(result: dict) -> None:
    for tier, rows in result["commit"].items():
        for key in ("requests_per_check", "requests_per_step", "background_req_per_s", "requests_per_day",
                    "list_pages_per_check", "previous_requests_per_step"):
            got = [r[key] for r in rows]
            assert got == sorted(got), (tier, key, got)
        for r in rows:
            n = r["nodes"]
            # Today (drain.py): a LIST of commits/<save>/, 1,000 names a page, plus a GET and a HEAD per check.
            assert r["requests_per_check"] == 3 + math.ceil(n / 1000)
            assert r["requests_per_step"] <= n * (4 + r["requests_per_check"] * (1 + r["rechecks_per_node"])) + 4
            assert r["previous_gets_per_check"] == n + 2  # every node GET every domain's marker
        last = rows[-1]
        assert last["previous_requests_per_step"] >= last["nodes"] ** 2
        assert last["requests_per_step"] < last["previous_requests_per_step"] / 50


def test_rechecks_back_off(sm: ModuleType) -> None:
    # drain.recheck_delay with a 5 s poll: 5, 10, 20, 40, 60...; re-checks by 15 s: at 5 and 15.
    assert [sm.rechecks_within(w, 5.0) for w in (4, 5, 14.9, 15, 35, 75, 135, 195)] == [0, 1, 1, 2, 3, 4, 5, 6]


def test_cli_prints_tables_and_json(sm: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "scale.json"
    assert sm.main(["--nodes", "16,64", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "### S3: one node replaced" in text and "durable commit" in text
    data = json.loads(out.read_text())
    assert [r["nodes"] for r in data["commit"]["S3"]] == [16, 64]
    assert data["params"]["tiers"][1]["aggregate"] is None  # S3: no aggregate bound (inf)
