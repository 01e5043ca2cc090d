"""Peer replicas: a node that comes back empty restores from its partner's replica, not the durable tier.

Two emulated nodes (ranks with ``RSLURM_NODE_NAME`` n1 and n2, each with its own local directory
``nvme/%n``) train ``resilient_slurm.examples.train_toy`` under DDP over gloo, with the default
``peer_replicas=auto``: after each interval save, n1's leader sends its step to n2 and keeps n2's, over the
job's own gloo connections. Both nodes' daemons drain the steps to a POSIX durable tier. Then the ranks are
SIGKILLed (a node failure: no emergency save), n2's local directory is wiped, and the job starts again:

* with n1's replica of n2 intact, n2 restores from it: 0 bytes from the durable tier, bitwise identical;
* with the replica gone, or a byte of it corrupted (refused on arrival: the checksum of the shard), n2
  falls back to the durable tier, still bitwise identical.

Beyond one rank per node (MATRIX): two ranks per node sharing the node's directory, and one directory per
GPU on one node with ``peer_replicas=on``; with no durable tier, the lost domain must come back from its
partner, bitwise.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import assert_same, clean_env, read_jsonl, run_ranks, start_ranks, wait_for_step

from resilient_slurm.layout import list_replicas
from resilient_slurm.manifest import step_dirname

STEPS = 16
EVERY = 5
RUN = "toy"

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="multi-process gloo test")


def _argv(root: Path, sleep: float) -> list[str]:
    return ["-m", "resilient_slurm.examples.train_toy", "--steps", str(STEPS), "--every-steps", str(EVERY),
            "--workers", "1", "--step-sleep", str(sleep), "--log", str(root / "log.%r.jsonl"),
            "--out", str(root / "out.%r.pt")]


def _env(root: Path, **extra: str) -> dict[str, str]:
    return {"RSLURM_LOCAL_DIR": str(root / "nvme" / "%n"), "RSLURM_RUN_ID": RUN, "RSLURM_CONTROL_SOCKET": "off",
            "RSLURM_COLLECTIVE_TIMEOUT": "60", "RSLURM_LOG_LEVEL": "INFO",
            "RSLURM_DURABLE": str(root / "lustre"), **extra}


def _nodes(*names: str) -> list[dict[str, str]]:
    return [{"RSLURM_NODE_NAME": n} for n in names]


def _steps(log: Path) -> dict[int, tuple[float, list[int]]]:
    return {e["step"]: (e["loss"], e["batch"]) for e in read_jsonl(log) if "loss" in e}


def _events(root: Path, node: str, name: str) -> list[dict[str, Any]]:
    path = root / "nvme" / node / RUN / "events.jsonl"
    return [e for e in read_jsonl(path) if e.get("event") == name] if path.exists() else []


def _daemon(root: Path, node: str) -> None:
    env = clean_env({**_env(root), "RSLURM_NODE_NAME": node})
    env.pop("RSLURM_CONTROL_SOCKET")
    out = subprocess.run([sys.executable, "-m", "resilient_slurm.cli", "daemon", "--once"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[int, Any]], list[dict[str, Any]]]:
    """An uninterrupted two-rank run: per-rank step logs and final states."""
    root = tmp_path_factory.mktemp("reference")
    run_ranks(_argv(root, 0.0), 2, root, env=_env(root, RSLURM_PEER_REPLICAS="off"),
              per_rank_env=_nodes("n1", "n2"), timeout=240)
    return ([_steps(root / f"log.{r}.jsonl") for r in range(2)],
            [torch.load(root / f"out.{r}.pt", weights_only=True) for r in range(2)])


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """A run killed (SIGKILL, no emergency save) after step 10 was committed, replicated both ways and
    drained by both daemons. Each test works on a copy."""
    root = tmp_path_factory.mktemp("killed")
    step = 2 * EVERY
    job = start_ranks(_argv(root, 0.15), 2, root, env=_env(root), per_rank_env=_nodes("n1", "n2"))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        got = {n: [e["received_step"] for e in _events(root, n, "peer_replica")] for n in ("n1", "n2")}
        if all(step in v for v in got.values()):
            break
        assert all(p.poll() is None for p in job.procs), job.output(0)[-3000:]
        time.sleep(0.05)
    else:
        pytest.fail(f"step {step} was not replicated both ways: {got}\n{job.output(0)[-3000:]}")
    wait_for_step(root / "log.0.jsonl", step + 1, job=job)
    job.kill(signal.SIGKILL)
    for node in ("n1", "n2"):
        _daemon(root, node)
    assert (root / "lustre" / RUN / step_dirname(step) / "manifest.json").exists()
    # n1 keeps exactly n2's newest replicated step, and n2 n1's.
    for here, there in (("n1", "n2"), ("n2", "n1")):
        held = list_replicas(str(root / "nvme" / here / RUN))
        assert list(held) == [there] and held[there].committed == [step], held
        assert not held[there].temps
    return root, step


def _copy(killed: tuple[Path, int], tmp_path: Path) -> tuple[Path, int]:
    src, step = killed
    root = tmp_path / "job"
    shutil.copytree(src, root, symlinks=True)
    shutil.rmtree(root / "nvme" / "n2")  # n2 died with its NVMe
    return root, step


def _resume(root: Path, reference: tuple[list[dict[int, Any]], list[dict[str, Any]]], step: int) -> list[dict[str, Any]]:
    run_ranks(_argv(root, 0.0), 2, root, env=_env(root), per_rank_env=_nodes("n1", "n2"), timeout=240)
    starts = [[e for e in read_jsonl(root / f"log.{r}.jsonl") if e.get("event") == "start"] for r in range(2)]
    assert [s[-1]["step"] for s in starts] == [step, step], starts
    ref_steps, ref_out = reference
    for r in range(2):
        got = _steps(root / f"log.{r}.jsonl")
        for s in range(1, STEPS + 1):
            assert got[s] == ref_steps[r][s], f"rank {r} step {s}: {got[s]} != {ref_steps[r][s]}"
        assert_same(torch.load(root / f"out.{r}.pt", weights_only=True), ref_out[r], f"rank{r}")
    return [_events(root, n, "restore")[-1] for n in ("n1", "n2")]


@pytest.mark.slow
def test_wiped_node_restores_from_its_partner_reading_nothing_from_the_durable_tier(
    killed: tuple[Path, int], tmp_path: Path, reference: tuple[list[dict[int, Any]], list[dict[str, Any]]]
) -> None:
    root, step = _copy(killed, tmp_path)
    replica = root / "nvme" / "n1" / RUN / "replicas" / "n2" / step_dirname(step)
    saved = sum(f.stat().st_size for f in replica.iterdir())
    n1, n2 = _resume(root, reference, step)
    assert (n1["tier"], n2["tier"]) == ("local", "peer"), (n1, n2)
    assert n1["fetched_bytes"] == n2["fetched_bytes"] == 0, "the durable tier was read"
    assert n2["peer_bytes"] == saved, (n2, saved)
    # The copy is n2's committed step again, under n2's own name.
    assert (root / "nvme" / "n2" / RUN / step_dirname(step) / "manifest.json").exists()


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["missing", "corrupt"])
def test_a_missing_or_corrupt_replica_falls_back_to_the_durable_tier(
    killed: tuple[Path, int], tmp_path: Path, reference: tuple[list[dict[int, Any]], list[dict[str, Any]]],
    damage: str,
) -> None:
    root, step = _copy(killed, tmp_path)
    replica = root / "nvme" / "n1" / RUN / "replicas" / "n2" / step_dirname(step)
    if damage == "missing":
        shutil.rmtree(replica)
    else:
        shard = max((f for f in replica.iterdir() if f.suffix == ".distcp"), key=lambda f: f.stat().st_size)
        with open(shard, "r+b") as f:
            f.seek(shard.stat().st_size // 2)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0xFF]))
    n1, n2 = _resume(root, reference, step)
    assert (n1["tier"], n2["tier"]) == ("local", "durable"), (n1, n2)
    assert n2["fetched_bytes"] > 0 and n2["peer_bytes"] == 0, n2


@pytest.mark.slow
def test_an_interrupted_replica_leaves_nothing_committed(tmp_path: Path) -> None:
    """n1's rank dies in the middle of sending its first replica (after one piece: the manifest): n2 keeps
    no replica of it, committed or half-written, and its own steps are intact."""
    job = start_ranks(_argv(tmp_path, 0.0), 2, tmp_path, env=_env(tmp_path),
                      per_rank_env=[{"RSLURM_NODE_NAME": "n1", "RSLURM_FAILPOINTS": "during_peer_send=kill"},
                                    {"RSLURM_NODE_NAME": "n2"}])
    codes = job.wait(180)
    assert codes[0] == -signal.SIGKILL, (codes, job.output(0)[-3000:])
    assert codes[1] != 0, job.output(1)[-3000:]  # its peer is gone: training cannot go on
    out = job.output(1)
    assert "peer replicas stop for this job" in out, out[-3000:]
    held = list_replicas(str(tmp_path / "nvme" / "n2" / RUN))
    assert all(not listing.committed and not listing.temps for listing in held.values()), held
    assert (tmp_path / "nvme" / "n2" / RUN / "replicas").stat().st_mode & 0o077 == 0  # private, like a run
    assert (tmp_path / "nvme" / "n2" / RUN / step_dirname(EVERY) / "manifest.json").exists()
    assert (tmp_path / "nvme" / "n1" / RUN / step_dirname(EVERY) / "manifest.json").exists()


@pytest.mark.proc
def test_a_bad_offer_or_a_bad_copy_is_refused_and_the_next_round_still_pairs(tmp_path: Path) -> None:
    """Real gloo rounds between two processes: an offer of another run is declined before any byte moves, a
    shard changed after its manifest was written is refused on arrival (nothing committed, no temp
    directory left), and the intact step sent next is committed: neither refusal unpaired the stream."""
    env = {"RSLURM_NODE_NAME": "n1", "RSLURM_CONTROL_SOCKET": "off", "RSLURM_AUTO_CADENCE": "off"}
    saver = f"""
import torch
from resilient_slurm import Checkpointer
c = Checkpointer(local_dir={str(tmp_path / 'src')!r}, run_id='r')
c.save(3, {{'w': torch.arange(200000, dtype=torch.float32), 'n': 7}})
c.close()
"""
    r = subprocess.run([sys.executable, "-c", saver], env=clean_env(env), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    step_dir = tmp_path / "src" / "r" / step_dirname(3)
    dest, out = tmp_path / "dest", tmp_path / "out.json"
    dest.mkdir()
    worker = Path(__file__).parent / "workers" / "peer_transfer_worker.py"
    run_ranks([str(worker), str(step_dir), str(dest), str(out)], 2, tmp_path, timeout=120)
    other, tampered, intact = json.loads(out.read_text())
    assert other["received"] == 0 and "someone-else" in other["declined"] and other["held"] == {}, other
    assert tampered["received"] == 0 and "does not match its manifest" in tampered["error"], tampered
    assert tampered["held"] == {"n1": [[], []]}, tampered  # nothing committed, the temp directory removed
    assert intact["received"] > 0 and intact["error"] is None and intact["held"] == {"n1": [[3], []]}, intact
    got = dest / "replicas" / "n1" / step_dirname(3)
    assert sorted(p.name for p in got.iterdir()) == sorted(p.name for p in step_dir.iterdir())
    for p in step_dir.iterdir():
        assert (got / p.name).read_bytes() == p.read_bytes(), p.name


def test_a_replica_of_another_save_of_the_same_step_is_never_mixed_in() -> None:
    """peer_sources: a replica is used only when it is of the save the other domains hold (created_at)."""
    from resilient_slurm.checkpoint.coordination import Topology
    from resilient_slurm.checkpoint.peers import Held, peer_sources

    topo = Topology(rank=0, world_size=2, node="n1", domain_of_rank=("n1", "n2"), root="/x", nonce="z",
                    node_of_rank=("n1", "n2"))
    held = {0: [Held("n2", 10, 2, (1,), 100.0)]}
    assert peer_sources(10, [1], held, topo, [100.0]) == {1: (0, "n2")}
    assert peer_sources(10, [1], held, topo, [200.0]) == {}, "a replica of an older save of step 10"
    assert peer_sources(10, [1], held, topo, []) == {1: (0, "n2")}  # nobody holds its own copy: any one save
    assert peer_sources(10, [1], {0: [Held("n2", 10, 4, (1,), 100.0)]}, topo, [100.0]) == {}  # other world size
    assert peer_sources(10, [1], {0: [Held("n2", 10, 2, (0, 1), 100.0)]}, topo, [100.0]) == {}  # other ranks


# --------------------------------------------------------------------------- beyond one rank per node
# name -> (each rank's node and local directory, relative to the test's root; peer_replicas). The last
# rank's directory is the one that is lost.
MATRIX = {
    # 8-GPU nodes in small: two ranks per node share the node's directory, one domain per node.
    "two ranks per node": ([("n1", "nvme/n1"), ("n1", "nvme/n1"), ("n2", "nvme/n2"), ("n2", "nvme/n2")], "auto"),
    # One NVMe per GPU on one node: each rank's directory is a domain; `on` pairs domains of one node.
    "a directory per GPU": ([("n1", "nvme/gpu0"), ("n1", "nvme/gpu1")], "on"),
}


@pytest.mark.slow
@pytest.mark.parametrize("topology", sorted(MATRIX))
def test_a_lost_domain_restores_from_its_partner_in_other_topologies(tmp_path: Path, topology: str) -> None:
    """With no durable tier at all, a run killed after step 10 was replicated loses the last rank's
    directory (its domain), starts again and must restore that domain from its partner's replica and
    finish bitwise identical to an uninterrupted run of the same topology."""
    layout, mode = MATRIX[topology]
    world, step = len(layout), 2 * EVERY

    def env(root: Path, peers: str) -> tuple[dict[str, str], list[dict[str, str]]]:
        common = {"RSLURM_RUN_ID": RUN, "RSLURM_CONTROL_SOCKET": "off", "RSLURM_COLLECTIVE_TIMEOUT": "60",
                  "RSLURM_LOG_LEVEL": "INFO", "RSLURM_PEER_REPLICAS": peers}
        return common, [{"RSLURM_NODE_NAME": n, "RSLURM_LOCAL_DIR": str(root / d)} for n, d in layout]

    ref = tmp_path / "ref"
    ref.mkdir()
    run_ranks(_argv(ref, 0.0), world, ref, env=env(ref, "off")[0], per_rank_env=env(ref, "off")[1], timeout=240)
    root = tmp_path / "job"
    root.mkdir()
    common, per_rank = env(root, mode)
    leaders = {d: r for r, (_, d) in reversed(list(enumerate(layout)))}  # directory -> its lowest rank

    def replicated(d: str) -> list[int]:
        path = root / d / RUN / "events.jsonl"
        return [e["received_step"] for e in read_jsonl(path) if e.get("event") == "peer_replica"] if path.exists() else []

    job = start_ranks(_argv(root, 0.15), world, root, env=common, per_rank_env=per_rank)
    deadline = time.monotonic() + 120
    while not all(step in replicated(d) for d in leaders):
        if time.monotonic() >= deadline:  # with the ranks' stacks: where they wait
            job.fail_hung(f"no replica of step {step} within 120 s: {({d: replicated(d) for d in leaders})}")
        assert all(p.poll() is None for p in job.procs), job.output(0)[-3000:]
        time.sleep(0.05)
    wait_for_step(root / "log.0.jsonl", step + 1, job=job)
    job.kill(signal.SIGKILL)
    lost = layout[-1][1]
    shutil.rmtree(root / lost)
    run_ranks(_argv(root, 0.0), world, root, env=common, per_rank_env=per_rank, timeout=240)
    for r in range(world):
        starts = [e for e in read_jsonl(root / f"log.{r}.jsonl") if e.get("event") == "start"]
        assert starts[-1]["step"] == step, (r, starts)
        assert _steps(root / f"log.{r}.jsonl") == _steps(ref / f"log.{r}.jsonl"), f"rank {r}"
        assert_same(torch.load(root / f"out.{r}.pt", weights_only=True),
                    torch.load(ref / f"out.{r}.pt", weights_only=True), f"rank{r}")
    for d, r in leaders.items():
        [restore] = [e for e in read_jsonl(root / d / RUN / "events.jsonl")
                     if e.get("event") == "restore" and e.get("rank") == r][-1:]
        assert restore["tier"] == ("peer" if d == lost else "local") and restore["fetched_bytes"] == 0, (d, restore)
        assert (restore["peer_bytes"] > 0) == (d == lost), (d, restore)
