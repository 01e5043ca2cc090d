"""Storage domains with DDP: replicated state is written once per node-local directory, spread across
that directory's ranks; every node holds a full copy; nodes sharing one directory form one domain.

Real rank processes (gloo on CPU); nodes are emulated with ``RSLURM_NODE_NAME`` per rank. The worker is
tests/workers/ddp_worker.py (a 4-layer MLP under DDP with Adam, ~2.4 MB of replicated tensors).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import REPO, checkpoint_entries, run_ranks, start_ranks

from resilient_slurm.checkpoint.planning import load_metadata

WORKER = str(REPO / "tests" / "workers" / "ddp_worker.py")
ENV = {"RSLURM_COLLECTIVE_TIMEOUT": "60"}
RUN = "ddp"
STEP_DIR = "step_000000000003"
TWO_NODES = [{"RSLURM_NODE_NAME": "n1"}, {"RSLURM_NODE_NAME": "n2"}]

pytestmark = [pytest.mark.proc, pytest.mark.skipif(sys.platform != "linux", reason="multi-process gloo test")]


def _job(mode: str, world: int, tmp: Path, local_dir: str, tag: str,
         per_rank_env: list[dict[str, str]] | None = None) -> tuple[list[dict[str, Any]], Any]:
    out = tmp / "out"
    out.mkdir(exist_ok=True)
    argv = [WORKER, mode, "--local-dir", local_dir, "--run-id", RUN, "--out", str(out), "--tag", tag]
    job = run_ranks(argv, world, tmp, timeout=120, env=ENV, per_rank_env=per_rank_env)
    dumps = [torch.load(out / f"{tag}_rank{r}.pt", weights_only=True) for r in range(world)]
    return dumps, job


def _manifest(step_dir: Path) -> dict[str, Any]:
    return json.loads((step_dir / "manifest.json").read_text())


def _storage_files(step_dir: Path) -> dict[str, set[str]]:
    """fqn -> the shard files the step's ``.metadata`` points at for it."""
    md = load_metadata((step_dir / ".metadata").read_bytes(), source=str(step_dir))
    files: dict[str, set[str]] = {}
    for idx, info in md.storage_data.items():
        files.setdefault(idx.fqn, set()).add(info.relative_path)
    # Every saved item has a stored copy.
    assert set(files) == set(md.state_dict_metadata), set(md.state_dict_metadata) ^ set(files)
    return files


def _replicated(fqn: str) -> bool:
    return fqn.startswith(("model.", "optim.", "extra."))


def _assert_weights_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _assert_restored(saved: list[dict[str, Any]], restored: list[dict[str, Any]]) -> None:
    for r, (s, g) in enumerate(zip(saved, restored)):
        assert g["step"] == 3, f"rank {r} restored step {g['step']}"
        assert not g["untouched"]
        _assert_weights_equal(s["model"], g["model"])
        assert g["extra"] == s["extra"]
        assert torch.equal(g["rng_torch"], s["rng_torch"]), f"rank {r}: torch RNG not restored"
        assert g["rng_py"] == s["rng_py"], f"rank {r}: Python RNG not restored"
        assert torch.equal(g["rng_np"][0], s["rng_np"][0]) and g["rng_np"][1:] == s["rng_np"][1:], f"rank {r}: NumPy RNG"


def test_one_node_writes_replicated_state_once_spread_across_ranks(tmp_path: Path) -> None:
    saved, _ = _job("save", 2, tmp_path, str(tmp_path / "nvme"), "save")
    _assert_weights_equal(saved[0]["model"], saved[1]["model"])  # DDP: replicated
    payload = saved[0]["payload_bytes"]
    run_dir = tmp_path / "nvme" / RUN
    assert checkpoint_entries(run_dir) == [STEP_DIR]
    step_dir = run_dir / STEP_DIR
    m = _manifest(step_dir)
    assert m["world_size"] == 2 and m["step"] == 3
    assert list(m["nodes"].values()) == [[0, 1]], m["nodes"]
    sizes = {s["rank"]: s["size"] for s in m["shards"]}
    assert sorted(sizes) == [0, 1]
    for s in m["shards"]:
        assert (step_dir / s["path"]).stat().st_size == s["size"]
    total = sum(sizes.values())
    # One copy of weights + Adam moments (plus framing, per-rank RNG and plain values), not two.
    assert payload <= total < 1.2 * payload, (total, payload)
    # Spread: each rank wrote a real share of the replicated tensors.
    for r, size in sizes.items():
        assert size > 0.3 * payload, f"rank {r} wrote {size} of {total} bytes (payload {payload})"
    files = _storage_files(step_dir)
    used: set[str] = set()
    for fqn, fs in files.items():
        if _replicated(fqn):
            assert len(fs) == 1, (fqn, fs)
            if fqn.startswith(("model.", "optim.state.")):
                used |= fs
    assert used == {"__0_0.distcp", "__1_0.distcp"}, used


def test_two_nodes_each_hold_a_full_copy_and_restore_locally(tmp_path: Path) -> None:
    local_dir = str(tmp_path / "%n")
    saved, _ = _job("save", 2, tmp_path, local_dir, "save", TWO_NODES)
    payload = saved[0]["payload_bytes"]
    for node, rank in (("n1", 0), ("n2", 1)):
        run_dir = tmp_path / node / RUN
        assert checkpoint_entries(run_dir) == [STEP_DIR], node
        step_dir = run_dir / STEP_DIR
        m = _manifest(step_dir)
        assert m["node"] == node
        assert m["nodes"] == {"n1": [0], "n2": [1]}
        mine = [s for s in m["shards"] if s["node"] == node]
        assert [s["rank"] for s in mine] == [rank]
        shard = mine[0]["path"]
        present = set(os.listdir(step_dir))
        assert present == {"manifest.json", ".metadata", shard}, present
        # This node's shard is a full copy of the replicated state.
        assert mine[0]["size"] >= payload, (node, mine[0]["size"], payload)
        files = _storage_files(step_dir)
        for fqn, fs in files.items():
            if _replicated(fqn) or fqn.startswith(f"_rslurm_rng.rank{rank}."):
                assert fs == {shard}, (node, fqn, fs)
        outside = {fqn for fqn, fs in files.items() if not fs <= present}
        # Only the other rank's private RNG state lives elsewhere (restore never needs it here).
        assert all(f.startswith(f"_rslurm_rng.rank{1 - rank}.") for f in outside), (node, outside)
        # The node's directory alone is a DCP checkpoint of the model that plain DCP can read.
        ref = saved[rank]["model"]
        target = {f"model.module.{k}": torch.zeros_like(v) for k, v in ref.items()}
        dcp.load(target, checkpoint_id=str(step_dir))
        for k, v in ref.items():
            assert torch.equal(target[f"model.module.{k}"], v), (node, k)

    restored, _ = _job("restore", 2, tmp_path, local_dir, "restore", TWO_NODES)
    _assert_restored(saved, restored)
    _assert_weights_equal(restored[0]["model"], restored[1]["model"])

    # Node n2 lost its NVMe, and n1 its replica of n2's step (peer replicas: tests/test_peer_replicas.py):
    # rank 1 cannot restore locally, and there is no durable tier to fetch from. By default every rank
    # stops, naming the step, rather than start a long run over from step 0.
    shutil.rmtree(tmp_path / "n2")
    shutil.rmtree(tmp_path / "n1" / RUN / "replicas")
    argv = [WORKER, "restore", "--local-dir", local_dir, "--run-id", RUN, "--out", str(tmp_path / "out"),
            "--tag", "refused"]
    refused = start_ranks(argv, 2, tmp_path, env=ENV, per_rank_env=TWO_NODES)
    assert refused.wait(120) == [1, 1]
    for r in range(2):
        assert "CorruptCheckpointError: committed steps [3] exist" in refused.output(r), refused.output(r)[-2000:]
    # restore_fallback=fresh starts from step 0, untouched, with a warning.
    lost, job = _job("restore", 2, tmp_path, local_dir, "lost",
                     [{**e, "RSLURM_RESTORE_FALLBACK": "fresh"} for e in TWO_NODES])
    for r, d in enumerate(lost):
        assert d["step"] == 0, f"rank {r} restored step {d['step']}"
        assert d["untouched"], f"rank {r}: weights changed although nothing was restored"
        assert d["extra"] == {"epoch": -1}
    # Not silently: the operator is told that step 3 exists but cannot be restored here.
    logs = (job.output(0) + job.output(1)).splitlines()
    warnings = [ln for ln in logs if "WARNING resilient_slurm" in ln and re.search(r"\b3\b", ln)]
    assert warnings, "no warning about the unreachable step 3:\n" + "\n".join(logs[-30:])


def test_two_nodes_sharing_one_dir_form_one_domain(tmp_path: Path) -> None:
    local_dir = str(tmp_path / "shared")
    saved, _ = _job("save", 2, tmp_path, local_dir, "save", TWO_NODES)
    payload = saved[0]["payload_bytes"]
    root = tmp_path / "shared"
    # probe files cleaned up; .rslurm holds the run's writer lock (layout.claim_run)
    assert sorted(os.listdir(root)) == [".rslurm", RUN]
    run_dir = root / RUN
    assert checkpoint_entries(run_dir) == [STEP_DIR]
    step_dir = run_dir / STEP_DIR
    m = _manifest(step_dir)
    assert m["nodes"] == {"n1": [0, 1]}, m["nodes"]
    assert sorted((s["rank"], s["node"]) for s in m["shards"]) == [(0, "n1"), (1, "n1")]
    assert set(os.listdir(step_dir)) == {"manifest.json", ".metadata", "__0_0.distcp", "__1_0.distcp"}
    total = sum(s["size"] for s in m["shards"])
    assert payload <= total < 1.2 * payload, (total, payload)
    for s in m["shards"]:
        assert s["size"] > 0.3 * payload, s
    restored, _ = _job("restore", 2, tmp_path, local_dir, "restore", TWO_NODES)
    _assert_restored(saved, restored)


def test_per_rank_rng_restored_on_four_ranks(tmp_path: Path) -> None:
    local_dir = str(tmp_path / "nvme")
    saved, _ = _job("save", 4, tmp_path, local_dir, "save")
    states = [s["rng_torch"] for s in saved]
    for i in range(4):
        for j in range(i):
            assert not torch.equal(states[i], states[j]), f"ranks {j} and {i} share an RNG state"
    restored, _ = _job("restore", 4, tmp_path, local_dir, "restore")
    _assert_restored(saved, restored)
