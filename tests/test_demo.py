"""The README demo (``python -m resilient_slurm.examples.demo``) end to end, as a user runs it.

The demo runs the tiny transformer LM under ``rslurm launch`` (or sbatch) three times and prints its
verdict. These tests do not take the verdict on trust: they read the demo's output directory
themselves (the checkpoint manifests, each rank's step log, the final states and the PNG) and check:

* local mode, SIGTERM to the launcher: exit 0 and IDENTICAL; an emergency checkpoint committed at the
  very step the first run stopped at, which the rerun resumed from; the same losses, batches, weights
  and AdamW moments as the uninterrupted run; a real loss curve (it falls); a valid PNG;
* local mode, ``--kill`` (SIGKILL to the ranks): the rerun resumes from the last interval checkpoint
  and the steps trained again repeat themselves exactly;
* ``--slurm`` on the real two-node test cluster: the training job is requeued exactly once by the
  launcher after USR1, its second incarnation resumes from the emergency step, and the result is
  bitwise identical to the reference job;
* ``--slurm`` where there is no Slurm: a clear message and exit 2.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, assert_same, clean_env, read_jsonl
from slurm_cluster import SlurmCluster

from resilient_slurm.manifest import Manifest

pytestmark = pytest.mark.proc  # every test here starts processes (tests/check_tier.py)

STEPS = 48
EVERY = 12


def _demo(out: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 600) -> tuple[int, str]:
    cp = subprocess.run([sys.executable, "-m", "resilient_slurm.examples.demo", "--steps", str(STEPS),
                         "--every-steps", str(EVERY), "--out", str(out), *args], env=env or clean_env(), cwd=REPO,
                        capture_output=True, text=True, timeout=timeout)
    text = cp.stdout + cp.stderr
    print(text)
    return cp.returncode, text


def _stop_manifests(run: Path) -> list[Manifest]:
    """The newest committed step's manifests right after the stop, one per node, as the demo copied them
    before retention could remove that step."""
    return [Manifest.from_json(p.read_bytes(), source=str(p))
            for p in sorted(run.glob("stop-checkpoint.*.manifest.json"))]


def _starts(run: Path, rank: int = 0) -> list[dict]:
    return [e for e in read_jsonl(run / f"log.{rank}.jsonl") if e.get("event") == "start"]


def _steps_by_incarnation(run: Path, rank: int) -> list[dict[int, dict]]:
    out: list[dict[int, dict]] = []
    for e in read_jsonl(run / f"log.{rank}.jsonl"):
        if e.get("event") == "start":
            out.append({})
        elif "loss" in e:
            out[-1][e["step"]] = e
    return out


def _check_identical(out: Path, ranks: int = 2) -> None:
    """The interrupted run ends exactly like the uninterrupted one: every step (a step done twice does
    the same both times), the final weights, AdamW moments, scheduler and RNG of every rank."""
    ref, run = out / "uninterrupted", out / "interrupted"
    for r in range(ranks):
        want = {e["step"]: (e["loss"], e["batch"]) for e in read_jsonl(ref / f"log.{r}.jsonl") if "loss" in e}
        assert sorted(want) == list(range(1, STEPS + 1))
        got: dict[int, tuple[float, list[int]]] = {}
        for inc in _steps_by_incarnation(run, r):
            for s, e in inc.items():
                assert got.setdefault(s, (e["loss"], e["batch"])) == (e["loss"], e["batch"]), f"rank {r} step {s}"
        assert got == want, f"rank {r}"
        a = torch.load(ref / f"final.{r}.pt", weights_only=True)
        b = torch.load(run / f"final.{r}.pt", weights_only=True)
        assert_same(a, b, f"rank{r}")
        assert all("exp_avg_sq" in st for st in a["optimizer"]["state"].values())  # AdamW moments are there


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", "not a PNG file"
    assert data[-8:-4] == b"IEND", "PNG truncated"
    assert len(data) > 20_000, f"suspiciously small PNG ({len(data)} bytes)"
    return struct.unpack(">II", data[16:24])


@pytest.mark.slow
def test_demo_sigterm_saves_resumes_and_matches(tmp_path: Path):
    out = tmp_path / "demo-output"
    code, text = _demo(out)
    assert code == 0, text
    assert "RESULT: IDENTICAL" in text and "DIFFERENT" not in text
    assert "launcher exit code 75" in text
    run = out / "interrupted"
    starts = _starts(run)
    assert len(starts) == 2 and starts[0]["step"] == 0, starts
    first = _steps_by_incarnation(run, 0)[0]
    stopped_at, resumed_from = max(first), starts[1]["step"]
    # The emergency checkpoint is the step the ranks stopped at: nothing lost, nothing trained twice.
    assert resumed_from == stopped_at
    stop = _stop_manifests(run)
    assert [(m.step, m.reason) for m in stop] == [(stopped_at, "emergency")]
    assert stopped_at % EVERY != 0  # between two interval checkpoints
    assert stop[0].world_size == 2 and sorted(s.rank for s in stop[0].shards) == [0, 1]
    _check_identical(out)
    losses = [e["loss"] for e in read_jsonl(out / "uninterrupted" / "log.0.jsonl") if "loss" in e]
    assert losses[-1] < losses[0] - 1.0, "the model did not learn: no real loss curve"
    w, h = _png_size(out / "loss_curve.png")
    assert 600 <= w <= 3000 and 400 <= h <= 3000, (w, h)
    assert str(out / "loss_curve.png") in text


@pytest.mark.slow
def test_demo_kill_resumes_from_last_interval_checkpoint(tmp_path: Path):
    out = tmp_path / "demo-output"
    code, text = _demo(out, "--kill")
    assert code == 0, text
    assert "RESULT: IDENTICAL" in text
    run = out / "interrupted"
    starts = _starts(run)
    killed_after = max(_steps_by_incarnation(run, 0)[0])
    resumed_from = starts[1]["step"]
    assert resumed_from % EVERY == 0 and 0 < resumed_from < killed_after, (resumed_from, killed_after)
    # SIGKILL leaves no time to save: the newest step at the stop was an interval checkpoint
    assert [(m.step, m.reason) for m in _stop_manifests(run)] == [(resumed_from, "interval")]
    _check_identical(out)  # includes: the steps trained again repeat themselves exactly
    _png_size(out / "loss_curve.png")


@pytest.mark.slow
def test_demo_slurm_requeues_once_and_matches(slurm: SlurmCluster):
    out = slurm.work_dir / "demo-slurm"
    # Nothing rendezvous-related: the emulated nodes n1 and n2 are names only Slurm knows; the launcher
    # derives MASTER_ADDR (their NodeAddr) and MASTER_PORT.
    env = slurm.env({"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
                     # test clusters that run at the same time may number jobs alike: keep their sockets apart
                     "RSLURM_CONTROL_DIR": str(slurm.root / "ctl")})
    code, text = _demo(out, "--slurm", "--nodes", "2", "--partition", "low", env=env)
    assert code == 0, text
    assert "RESULT: IDENTICAL" in text
    run = out / "interrupted"
    starts = _starts(run)
    assert [s["restart_count"] for s in starts] == [0, 1], starts
    job = starts[0]["job_id"]
    assert starts[1]["job_id"] == job
    info = slurm.job_info(job)
    assert info is not None and info["JobState"] == "COMPLETED" and info["Restarts"] == "1", info
    stop = _stop_manifests(run)
    # one manifest per node (storage domain), both of the step the second incarnation resumed from, which
    # is the last step the first incarnation trained
    assert sorted(m.node for m in stop) == ["n1", "n2"], stop
    assert {(m.step, m.reason) for m in stop} == {(starts[1]["step"], "emergency")}
    assert starts[1]["step"] == max(_steps_by_incarnation(run, 0)[0])
    ref_starts = _starts(out / "uninterrupted")
    assert [s["restart_count"] for s in ref_starts] == [0]
    _check_identical(out)
    _png_size(out / "loss_curve.png")


def test_demo_slurm_without_slurm_exits_2(tmp_path: Path):
    env = clean_env({"PATH": str(Path(sys.executable).parent)})  # python, but no sbatch
    code, text = _demo(tmp_path / "out", "--slurm", env=env, timeout=60)
    assert code == 2, text
    assert "sbatch is not on PATH" in text and "without --slurm" in text
    assert not (tmp_path / "out").exists()  # refused before touching anything


def test_demo_refuses_bad_options(tmp_path: Path):
    code, text = _demo(tmp_path / "out", "--at", str(STEPS), timeout=60)
    assert code == 2 and f"--at {STEPS}" in text, text
    code, text = _demo(tmp_path / "out", "--kill", "--slurm", timeout=60)
    assert code == 2 and "--kill" in text, text


def test_tiny_lm_corpus_is_fixed():
    """The corpus the demo trains on is generated from a fixed seed: the same text everywhere."""
    from resilient_slurm.examples.train_tiny_lm import corpus

    a, b = corpus(), corpus()
    assert a == b and len(a) == 48_000
    assert len(set(a)) < 40 and a.count("\n") > 500
    env = {**os.environ, "PYTHONHASHSEED": "123"}
    other = subprocess.run([sys.executable, "-c", "from resilient_slurm.examples.train_tiny_lm import corpus;"
                            "import hashlib; print(hashlib.sha256(corpus().encode()).hexdigest())"],
                           env=env, cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    import hashlib

    assert other == hashlib.sha256(a.encode()).hexdigest()
