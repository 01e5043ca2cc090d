"""torchdata's ``StatefulDataLoader`` as a value of the Checkpointer's state (``state["loader"] = loader``).

* In one process: a shuffling loader with worker processes, saved mid-epoch. Its state is stored as
  plain data: every item of the checkpoint decodes with ``torch.load(weights_only=True)`` (no
  unrestricted pickle), the sampler's generator state is a tensor. A fresh loader restored from it
  hands out exactly the batches the original goes on to hand out, to the end of the epoch and through
  the next one.
* End to end (tests/workers/stateful_loader_worker.py, 2 ranks under ``rslurm launch -n 2``, DDP over
  gloo, StatefulDistributedSampler, 2 workers per rank, dropout, augmentation in the workers): a run
  stopped mid-epoch, by SIGTERM to the launcher (emergency checkpoint) or by SIGKILL to the ranks
  (resume from the last interval checkpoint), and run again, sees exactly the same batches and ends
  bitwise identical to a run that never stopped.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import REPO, assert_same, clean_env, read_jsonl

from resilient_slurm import Checkpointer
from resilient_slurm.checkpoint.planning import load_metadata
from resilient_slurm.manifest import MANIFEST_NAME, Manifest

torchdata = pytest.importorskip("torchdata", reason="torchdata is in the test extra: pip install -e '.[test]'")
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402

pytestmark = [pytest.mark.proc, pytest.mark.filterwarnings("ignore:.*set_vital.*:UserWarning")]  # torchdata 0.11 on torch 2.13

WORKER = REPO / "tests" / "workers" / "stateful_loader_worker.py"
STEPS, EVERY = 40, 6  # 56 samples, 2 ranks, batches of 4: 7 steps per epoch
REQUEUE = 75


def _loader(seed: int = 3) -> StatefulDataLoader:
    data = [(torch.full((3,), float(i)), i) for i in range(30)]
    return StatefulDataLoader(data, batch_size=4, shuffle=True, num_workers=2,
                              generator=torch.Generator().manual_seed(seed))


def _ids(batches: Iterator) -> list[list[int]]:
    return [b[1].tolist() for b in batches]


def test_loader_state_is_plain_data_and_restores_the_exact_position(tmp_path: Path):
    root = tmp_path / "nvme"
    loader = _loader()
    it = iter(loader)
    seen = [next(it)[1].tolist() for _ in range(3)]  # mid-epoch: 3 of 8 batches
    saved = loader.state_dict()
    with Checkpointer(local_dir=str(root), run_id="sdl") as ck:
        ck.save(3, {"loader": loader})
    rest_of_epoch = _ids(it)
    next_epoch = _ids(iter(loader))
    assert len(seen) + len(rest_of_epoch) == 8 and sorted(sum(seen + rest_of_epoch, [])) == list(range(30))

    # Every item is plain data: it decodes with the safe loader, straight from the shard bytes.
    step_dir = root / "sdl" / "step_000000000003"
    manifest = Manifest.from_json((step_dir / MANIFEST_NAME).read_bytes())
    md = load_metadata((step_dir / ".metadata").read_bytes(), source=str(step_dir / ".metadata"))
    loader_keys = [k for k in md.state_dict_metadata if k.startswith("loader.")]
    assert any(k.endswith(".generator") for k in loader_keys), loader_keys  # the shuffle's generator state
    decoded = 0
    for index, info in md.storage_data.items():
        if not index.fqn.startswith("loader."):
            continue
        blob = (step_dir / info.relative_path).read_bytes()[info.offset:info.offset + info.length]
        torch.load(io.BytesIO(blob), weights_only=True)
        decoded += 1
    assert decoded == len(loader_keys) > 5 and manifest.reason == "manual"

    fresh = _loader(seed=999)  # another seed: only the restored state can give the same order
    with Checkpointer(local_dir=str(root), run_id="sdl") as ck:
        assert ck.restore({"loader": fresh}) == 3
    assert_same(fresh.state_dict(), saved, "loader")
    assert _ids(iter(fresh)) == rest_of_epoch
    assert _ids(iter(fresh)) == next_epoch


# --------------------------------------------------------------------------------------- end to end
def _launch(work: Path, *extra: str, env_extra: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    work.mkdir(parents=True, exist_ok=True)
    env = clean_env({"RSLURM_LOCAL_DIR": str(work / "nvme" / "%n"), "RSLURM_RUN_ID": "sdl", **(env_extra or {})})
    cmd = [sys.executable, "-m", "resilient_slurm.cli", "launch", "-n", "2", "--", sys.executable, str(WORKER),
           "--steps", str(STEPS), "--every-steps", str(EVERY), "--log", str(work / "log.%r.jsonl"),
           "--out", str(work / "out.%r.pt"), *extra]
    with open(work / "launcher.log", "ab") as f:
        return subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=work)


def _wait(proc: subprocess.Popen[bytes], work: Path, want: int) -> None:
    try:
        code = proc.wait(timeout=240)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
    assert code == want, (work / "launcher.log").read_text(errors="replace")[-4000:]


def _steps(work: Path, rank: int) -> list[dict]:
    return [e for e in read_jsonl(work / f"log.{rank}.jsonl") if "loss" in e]


def _starts(work: Path, rank: int) -> list[dict]:
    return [e for e in read_jsonl(work / f"log.{rank}.jsonl") if e.get("event") == "start"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("sdl-ref")
    _wait(_launch(work), work, 0)
    return work


@pytest.mark.slow
@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_stopped_mid_epoch_resumes_with_the_same_batches_bitwise(reference: Path, tmp_path: Path, how: str):
    work = tmp_path / how
    # SIGTERM while epoch 2 runs (steps 15-21), SIGKILL in epoch 2 as well: the last interval checkpoint
    # (step 12) is then in the middle of epoch 1 (steps 8-14).
    at = 16 if how == "sigterm" else 17
    # SIGKILL: in-job restarts off, so the launcher exits 75 and the second launch resumes (the requeue
    # path); an in-job restart resumes the same way (tests/test_hang.py)
    proc = _launch(work, "--step-sleep", "0.05",  # sleeping changes nothing computed, only when
                   env_extra={"RSLURM_IN_JOB_RESTARTS": "0"} if how == "sigkill" else None)
    deadline = time.monotonic() + 180
    while not (work / "log.0.jsonl").exists() or not any(e["step"] >= at for e in _steps(work, 0)):
        assert proc.poll() is None and time.monotonic() < deadline, (work / "launcher.log").read_text()[-3000:]
        time.sleep(0.005)
    if how == "sigterm":
        proc.send_signal(signal.SIGTERM)
    else:
        for r in range(2):
            os.killpg(_starts(work, r)[-1]["pid"], signal.SIGKILL)  # the rank and its DataLoader workers
    _wait(proc, work, REQUEUE)
    stopped_at = max(e["step"] for e in _steps(work, 0))
    _wait(_launch(work), work, 0)

    resumed_from = _starts(work, 0)[1]["step"]
    if how == "sigterm":
        assert resumed_from == stopped_at and resumed_from % 7 != 0, (resumed_from, stopped_at)
    else:
        assert resumed_from == 12 < stopped_at, (resumed_from, stopped_at)
    for r in range(2):
        want = {e["step"]: (e["batch"], e["x"], e["loss"]) for e in _steps(reference, r)}
        got: dict[int, tuple] = {}
        for e in _steps(work, r):
            now = (e["batch"], e["x"], e["loss"])
            assert got.setdefault(e["step"], now) == now, f"rank {r}: step {e['step']} differs when trained again"
        assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
        for s in range(1, STEPS + 1):
            assert got[s][0] == want[s][0], f"rank {r} step {s}: batch {got[s][0]} != {want[s][0]}"
            assert got[s] == want[s], f"rank {r} step {s}: same samples, but augmentation or loss differ"
        assert_same(torch.load(work / f"out.{r}.pt", weights_only=True),
                    torch.load(reference / f"out.{r}.pt", weights_only=True), f"rank{r}")
