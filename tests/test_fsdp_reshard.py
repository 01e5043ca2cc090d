"""FSDP2 (fully_shard) state saved at one world size restores exactly at another (resharding).

Real rank processes, gloo on CPU. The worker (tests/workers/fsdp_worker.py) trains a 4-layer MLP whose
dims do not divide by the world size (uneven shards, and one empty shard at 4 ranks) with Adam, saves
step 3 at 4 ranks, and restores into a fresh model and a fresh optimizer (no state yet) at 2 and at 4
ranks. Each job dumps the full unsharded model/optimizer state from rank 0; the dumps must be equal
tensor for tensor, Adam moments and step counts included.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import REPO, clean_env, read_jsonl, run_ranks

WORKER = str(REPO / "tests" / "workers" / "fsdp_worker.py")
ENV = {"RSLURM_COLLECTIVE_TIMEOUT": "60"}

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="multi-process gloo test")


def _job(mode: str, world: int, tmp: Path) -> dict[str, Any]:
    out = tmp / "out"
    out.mkdir(exist_ok=True)
    argv = [WORKER, mode, "--local-dir", str(tmp / "nvme"), "--run-id", "fsdp", "--out", str(out)]
    run_ranks(argv, world, tmp, timeout=120, env=ENV)
    return {
        "now": torch.load(out / f"{mode}_w{world}.pt", weights_only=True),
        "next": torch.load(out / f"{mode}_w{world}_next.pt", weights_only=True),
    }


def _assert_same(a: Any, b: Any, path: str = "") -> int:
    """Structural, bitwise equality; returns how many tensors were compared."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{path}: tensor vs {type(b).__name__}"
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
        assert torch.equal(a, b), f"{path}: values differ"
        return 1
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{path}: keys {sorted(a)} vs {sorted(b) if isinstance(b, dict) else b}"
        return sum(_assert_same(a[k], b[k], f"{path}.{k}") for k in a)
    if isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{path}: {a!r} vs {b!r}"
        return sum(_assert_same(x, y, f"{path}[{i}]") for i, (x, y) in enumerate(zip(a, b)))
    assert a == b and type(a) is type(b), f"{path}: {a!r} vs {b!r}"
    return 0


def _assert_close(a: dict[str, Any], b: dict[str, Any]) -> None:
    for k, t in a["model"].items():
        torch.testing.assert_close(t, b["model"][k], rtol=1e-4, atol=1e-5, msg=f"model.{k}")


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("fsdp")
    return tmp, _job("save", 4, tmp)


def _check_restored(saved_dump: dict[str, Any], restored: dict[str, Any]) -> None:
    ref, got = saved_dump["now"], restored["now"]
    assert got["step"] == 3
    assert got["extra"] == {"epoch": 7, "name": "fsdp-run", "lrs": [0.1, 0.01], "best": {"loss": 0.25, "at": 2}}
    # The dumps hold the full (unsharded) tensors: 4 layers x (weight, bias).
    assert len(ref["model"]) == 8
    assert ref["model"]["0.weight"].shape == (37, 13)
    opt_state = ref["optim"]["state"]
    assert len(opt_state) == 8
    for fqn, s in opt_state.items():
        assert set(s) == {"step", "exp_avg", "exp_avg_sq"}, fqn
        assert float(s["step"]) == 3.0, fqn
        assert s["exp_avg"].abs().sum() > 0, fqn  # trained: real moments, not zeros
    n = _assert_same(ref["model"], got["model"], "model")
    n += _assert_same(ref["optim"], got["optim"], "optim")
    assert n == 8 + 8 * 3


def test_fsdp_restore_at_half_world_size(saved: tuple[Path, dict[str, Any]]) -> None:
    tmp, ref = saved
    got = _job("restore", 2, tmp)
    _check_restored(ref, got)
    # One more step at 2 ranks ran; it reduces gradients in another order than at 4 ranks, so the
    # result is only close to the 4-rank continuation.
    _assert_close(ref["next"], got["next"])
    assert float(got["next"]["optim"]["state"]["0.weight"]["step"]) == 4.0


def test_fsdp_restore_at_same_world_size(saved: tuple[Path, dict[str, Any]]) -> None:
    tmp, ref = saved
    got = _job("restore", 4, tmp)
    _check_restored(ref, got)
    # Same world size: the resumed step is bitwise the step the saving job took after saving.
    _assert_same(ref["next"], got["next"], "next")


def test_exports_consolidate_the_shards(saved: tuple[Path, dict[str, Any]]) -> None:
    """`rslurm export` assembles each DTensor from the 4 ranks' shards (uneven, one empty): the safetensors
    file holds the full weights under the module's names, the torch file the full model too."""
    import subprocess

    from conftest import clean_env
    from safetensors.torch import load_file

    tmp, ref = saved
    st, pt = tmp / "model.safetensors", tmp / "state.pt"
    for fmt, out in (("safetensors", st), ("torch", pt)):
        r = subprocess.run([sys.executable, "-m", "resilient_slurm.cli", "export", "3", "--format", fmt, str(out),
                            "--local-dir", str(tmp / "nvme"), "--run-id", "fsdp"], env=clean_env(),
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
    assert _assert_same(load_file(st), ref["now"]["model"], "safetensors") == 8
    exported = torch.load(pt, weights_only=True)
    assert exported["_rslurm_step"] == 3
    assert _assert_same(exported["model"], ref["now"]["model"], "torch") == 8


# ------------------------------------------------------------- from the durable tier, onto other nodes
def _node_job(mode: str, nodes: list[str], tmp: Path, durable: Path) -> dict[str, Any]:
    out = tmp / "out"
    out.mkdir(exist_ok=True)
    argv = [WORKER, mode, "--local-dir", str(tmp / "nvme" / "%n"), "--run-id", "fsdp", "--out", str(out)]
    run_ranks(argv, len(nodes), tmp, timeout=180, env={**ENV, "RSLURM_DURABLE": str(durable)},
              per_rank_env=[{"RSLURM_NODE_NAME": n} for n in nodes])
    return {"now": torch.load(out / f"{mode}_w{len(nodes)}.pt", weights_only=True)}


def _drain(tmp: Path, node: str, durable: Path) -> None:
    env = clean_env({"RSLURM_LOCAL_DIR": str(tmp / "nvme" / "%n"), "RSLURM_NODE_NAME": node,
                     "RSLURM_DURABLE": str(durable)})
    r = subprocess.run([sys.executable, "-m", "resilient_slurm.cli", "daemon", "--once"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_fsdp_resharded_onto_other_nodes_fetches_only_what_each_plan_reads(tmp_path: Path) -> None:
    """Saved at 4 ranks on two nodes (n1: ranks 0-1, n2: ranks 2-3) and drained; restored at 2 ranks on two
    empty nodes (n3, n4). Each new node fetches from the durable tier only the files its rank's load plan
    reads (n3's rank holds the first rows of every tensor: the files of saved ranks 0 and 1), not every
    file of the step, and the restore is bitwise the saved state."""
    durable = tmp_path / "lustre"
    ref = _node_job("save", ["n1", "n1", "n2", "n2"], tmp_path, durable)
    for node in ("n1", "n2"):
        _drain(tmp_path, node, durable)
    step_dir = durable / "fsdp" / f"step_{3:012d}"
    assert (step_dir / "manifest.json").exists()
    files = {f.name: f.stat().st_size for f in step_dir.glob("*.distcp")}
    assert sorted(files) == [f"__{r}_0.distcp" for r in range(4)], files
    got = _node_job("restore", ["n3", "n4"], tmp_path, durable)
    _check_restored(ref, got)
    fetched: dict[str, int] = {}
    for node in ("n3", "n4"):
        [ev] = [e for e in read_jsonl(tmp_path / "nvme" / node / "fsdp" / "events.jsonl") if e["event"] == "restore"]
        assert ev["step"] == 3 and ev["tier"] == "durable", ev
        here = {f.name: f.stat().st_size for f in (tmp_path / "nvme" / node / "fsdp" / f"step_{3:012d}").glob("*.distcp")}
        assert ev["fetched_bytes"] == sum(here.values()), (node, ev, here)
        assert all(files[name] == size for name, size in here.items()), here
        fetched[node] = ev["fetched_bytes"]
    # n3's rank reads rows that saved ranks 0 and 1 held: it fetched neither rank 2's nor rank 3's file.
    n3 = {f.name for f in (tmp_path / "nvme" / "n3" / "fsdp" / f"step_{3:012d}").glob("*.distcp")}
    assert n3 == {"__0_0.distcp", "__1_0.distcp"}, n3
    assert fetched["n3"] < sum(files.values()) and sum(fetched.values()) < 2 * sum(files.values()), (fetched, files)
