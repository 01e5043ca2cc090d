"""Node loss: resume from the durable tier, bitwise identical to a run that never stopped.

Two emulated nodes (ranks with ``RSLURM_NODE_NAME`` n1 and n2, each with its own local directory
``nvme/%n``) train ``resilient_slurm.examples.train_toy`` under DDP over gloo. A real SIGTERM to every
rank's process group (what Slurm sends a job step on preemption) makes them commit an emergency
checkpoint and stop. Each node's ``rslurm daemon --once`` (a real process) drains its shards; the step
is durable once both have. Then a node's local directory is wiped (the node died, or the job was
requeued onto other nodes), the job is started again and must:

* restore the lost ranks from the durable tier (fetched, verified, prefetched into the local tier) and
  the others from their local tier, all at the emergency step;
* finish with every step's loss and batch, the final parameters, Adam moments, scheduler, scaler and
  RNG bitwise equal to an uninterrupted run.

Durable tiers: a POSIX directory, and S3 over real HTTP on loopback (moto's server).
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import s3_support
import torch
from conftest import assert_same, clean_env, read_jsonl, run_ranks, start_ranks, wait_for_step

from resilient_slurm.manifest import step_dirname

moto_server = s3_support.moto_server

STEPS = 16
EVERY = 5
RUN = "toy"

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="multi-process gloo test")


def _argv(root: Path, sleep: float) -> list[str]:
    return ["-m", "resilient_slurm.examples.train_toy", "--steps", str(STEPS), "--every-steps", str(EVERY),
            "--workers", "1", "--step-sleep", str(sleep), "--log", str(root / "log.%r.jsonl"),
            "--out", str(root / "out.%r.pt")]


def _env(root: Path, durable: dict[str, str]) -> dict[str, str]:
    return {"RSLURM_LOCAL_DIR": str(root / "nvme" / "%n"), "RSLURM_RUN_ID": RUN, "RSLURM_CONTROL_SOCKET": "off",
            "RSLURM_COLLECTIVE_TIMEOUT": "60", "RSLURM_LOG_LEVEL": "INFO", **durable}


def _nodes(*names: str) -> list[dict[str, str]]:
    return [{"RSLURM_NODE_NAME": n} for n in names]


def _steps(log: Path) -> dict[int, tuple[float, list[int]]]:
    """step -> (loss, batch), the last record of each step (a resumed run appends to the log)."""
    return {e["step"]: (e["loss"], e["batch"]) for e in read_jsonl(log) if "loss" in e}


def _daemon(root: Path, node: str, durable: dict[str, str]) -> subprocess.CompletedProcess[str]:
    env = clean_env({**_env(root, durable), "RSLURM_NODE_NAME": node})
    env.pop("RSLURM_CONTROL_SOCKET")
    return subprocess.run([sys.executable, "-m", "resilient_slurm.cli", "daemon", "--once"], env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[int, Any]], list[dict[str, Any]]]:
    """An uninterrupted two-rank run: per-rank step logs and final states."""
    root = tmp_path_factory.mktemp("reference")
    run_ranks(_argv(root, 0.0), 2, root, env=_env(root, {}), per_rank_env=_nodes("n1", "n2"), timeout=240)
    return ([_steps(root / f"log.{r}.jsonl") for r in range(2)],
            [torch.load(root / f"out.{r}.pt", weights_only=True) for r in range(2)])


@pytest.fixture(params=["posix", "s3"])
def durable(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[dict[str, str]]:
    """The durable tier's settings: a POSIX directory, or a bucket on moto's S3 server over real HTTP
    (the server runs in this process; its fake credentials are in the environment the ranks inherit)."""
    if request.param == "posix":
        yield {"RSLURM_DURABLE": f"file://{tmp_path / 'lustre'}"}
        return
    server = request.getfixturevalue("moto_server")
    yield {"RSLURM_DURABLE": f"s3://{server.new_bucket()}/ckpt", "RSLURM_S3_ENDPOINT_URL": server.endpoint,
           "RSLURM_S3_PART_SIZE": "5M"}


def _interrupted_run(root: Path, durable: dict[str, str]) -> int:
    """Train until step >= 7, SIGTERM both ranks, return the emergency step."""
    job = start_ranks(_argv(root, 0.15), 2, root, env=_env(root, durable), per_rank_env=_nodes("n1", "n2"))
    wait_for_step(root / "log.0.jsonl", 7, job=job)
    job.kill(signal.SIGTERM)  # rank and DataLoader worker: the process group, as Slurm signals a step
    codes = [p.wait(timeout=60) for p in job.procs]
    assert codes == [0, 0], f"ranks exited {codes}: {job.output(0)[-3000:]}\n{job.output(1)[-3000:]}"
    exits = [e for e in read_jsonl(root / "log.0.jsonl") if e.get("event") == "exit"]
    assert exits and exits[-1]["stopped"], "the ranks did not stop on an emergency checkpoint"
    step = exits[-1]["step"]
    assert 7 <= step < STEPS and step % EVERY != 0, f"emergency step {step} should not be an interval step"
    for node in ("n1", "n2"):
        assert (root / "nvme" / node / RUN / step_dirname(step) / "manifest.json").exists()
    return int(step)


def _drain_both(root: Path, durable: dict[str, str], step: int) -> None:
    first = _daemon(root, "n1", durable)
    assert first.returncode == 0, first.stderr
    assert "waiting for n2" in first.stderr, "n1 alone must not make the step durable:\n" + first.stderr
    second = _daemon(root, "n2", durable)
    assert second.returncode == 0, second.stderr
    assert f"step {step} is durable" in second.stderr, second.stderr


def _assert_identical(root: Path, reference: tuple[list[dict[int, Any]], list[dict[str, Any]]]) -> None:
    ref_steps, ref_out = reference
    for r in range(2):
        got = _steps(root / f"log.{r}.jsonl")
        assert sorted(got) == list(range(1, STEPS + 1)), f"rank {r} steps: {sorted(got)}"
        for s in range(1, STEPS + 1):
            assert got[s] == ref_steps[r][s], f"rank {r} step {s}: {got[s]} != {ref_steps[r][s]}"
        assert_same(torch.load(root / f"out.{r}.pt", weights_only=True), ref_out[r], f"rank{r}")


@pytest.mark.slow
def test_node_loss_resumes_from_the_durable_tier_bitwise(
    tmp_path: Path, durable: dict[str, str], reference: tuple[list[dict[int, Any]], list[dict[str, Any]]]
) -> None:
    step = _interrupted_run(tmp_path, durable)
    _drain_both(tmp_path, durable, step)
    shutil.rmtree(tmp_path / "nvme" / "n2")  # n2 died with its NVMe
    job = run_ranks(_argv(tmp_path, 0.0), 2, tmp_path, env=_env(tmp_path, durable),
                    per_rank_env=_nodes("n1", "n2"), timeout=240)
    starts = [[e for e in read_jsonl(tmp_path / f"log.{r}.jsonl") if e.get("event") == "start"] for r in range(2)]
    assert [s[-1]["step"] for s in starts] == [step, step], starts
    assert "fetched from the durable tier" in job.output(1)
    assert "for n2 from" in job.output(1), job.output(1)[-2000:]
    # The fetched copy is a committed local step again, verified on arrival.
    assert (tmp_path / "nvme" / "n2" / RUN / step_dirname(step) / "manifest.json").exists()
    _assert_identical(tmp_path, reference)


@pytest.mark.slow
def test_requeue_onto_new_nodes_restores_every_rank_from_a_posix_tier(
    tmp_path: Path, reference: tuple[list[dict[int, Any]], list[dict[str, Any]]]
) -> None:
    durable = {"RSLURM_DURABLE": str(tmp_path / "lustre")}
    step = _interrupted_run(tmp_path, durable)
    _drain_both(tmp_path, durable, step)
    # The requeued job lands on n3 and n4, whose local directories are empty.
    job = run_ranks(_argv(tmp_path, 0.0), 2, tmp_path, env=_env(tmp_path, durable),
                    per_rank_env=_nodes("n3", "n4"), timeout=240)
    assert "fetched" in job.output(0) and "fetched" in job.output(1)
    # Same world size: n3 fetched what n1 wrote and n4 what n2 wrote, each file once (not every file of the
    # step on every new node, which at N nodes would pull N times the checkpoint).
    saved = sum(f.stat().st_size for n in ("n1", "n2") for f in (tmp_path / "nvme" / n / RUN / step_dirname(step)).glob("*.distcp"))
    fetched = [e["fetched_bytes"] for n in ("n3", "n4") for e in read_jsonl(tmp_path / "nvme" / n / RUN / "events.jsonl")
               if e.get("event") == "restore"]
    assert len(fetched) == 2 and sum(fetched) == saved and all(0 < f < saved for f in fetched), (fetched, saved)
    _assert_identical(tmp_path, reference)


@pytest.mark.slow
def test_a_partial_durable_step_is_never_restored(
    tmp_path: Path, reference: tuple[list[dict[int, Any]], list[dict[str, Any]]]
) -> None:
    """Only n1 drained the emergency step, then n2 was lost: the durable tier holds n1's shards but no
    manifest, so the resumed job must fall back to the newest step that is durable (an interval step),
    and still finish bitwise identical."""
    durable = {"RSLURM_DURABLE": str(tmp_path / "lustre")}
    # 1.5 s a step (the step time does not enter the training): the ranks must still be training when the
    # SIGTERM comes, after both daemons ran. At 0.15 s a loaded machine's daemons took longer than the 10
    # steps left, the ranks had finished and closed their Checkpointer, and SIGTERM's default action ended
    # them (-15; seen in CI).
    job = start_ranks(_argv(tmp_path, 1.5), 2, tmp_path, env=_env(tmp_path, durable),
                      per_rank_env=_nodes("n1", "n2"))
    wait_for_step(tmp_path / "log.0.jsonl", EVERY + 1, job=job)
    # Both nodes drain the interval step while training goes on.
    for node in ("n1", "n2"):
        assert _daemon(tmp_path, node, durable).returncode == 0
    wait_for_step(tmp_path / "log.0.jsonl", EVERY + 3, job=job)
    assert not [e for e in read_jsonl(tmp_path / "log.0.jsonl") if e.get("event") == "exit"], "training ended first"
    job.kill(signal.SIGTERM)
    assert [p.wait(timeout=60) for p in job.procs] == [0, 0]
    step = [e for e in read_jsonl(tmp_path / "log.0.jsonl") if e.get("event") == "exit"][-1]["step"]
    assert _daemon(tmp_path, "n1", durable).returncode == 0
    assert not (tmp_path / "lustre" / RUN / step_dirname(step) / "manifest.json").exists()
    assert (tmp_path / "lustre" / RUN / step_dirname(step) / "domains" / "n1" / "manifest.json").exists()
    # The newest step both daemons drained: step 5, or 10 when training reached it before the daemons ran
    # (a loaded machine; seen in CI).
    def steps(d: Path) -> set[int]:
        return {int(m.parent.name.removeprefix("step_")) for m in d.glob("step_*/manifest.json")}

    durable_steps = sorted(steps(tmp_path / "lustre" / RUN))
    assert durable_steps and durable_steps[-1] < step and durable_steps[-1] % EVERY == 0, (durable_steps, step)
    # n1 also keeps a replica of n2's committed steps (the peer replica round after each save, when it
    # finished before the stop): a step that n1 holds itself and as n2's replica is whole without n2.
    whole = steps(tmp_path / "nvme" / "n1" / RUN) & steps(tmp_path / "nvme" / "n1" / RUN / "replicas" / "n2")
    expected = max([*durable_steps, *whole])
    shutil.rmtree(tmp_path / "nvme" / "n2")
    job = run_ranks(_argv(tmp_path, 0.0), 2, tmp_path, env=_env(tmp_path, durable),
                    per_rank_env=_nodes("n1", "n2"), timeout=240)
    starts = [e for e in read_jsonl(tmp_path / "log.0.jsonl") if e.get("event") == "start"]
    # Never the partial durable step (n2's shards of it are nowhere), unless n1 holds n2's part as a replica.
    assert starts[-1]["step"] == expected, (
        f"resumed from {starts[-1]['step']}, expected {expected}: the newest step that is durable "
        f"({durable_steps[-1]}) or whole on n1 with n2's replica ({sorted(whole)})")
    _assert_identical(tmp_path, reference)
