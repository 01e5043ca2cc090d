"""Model parallelism: pipeline stages, tensor parallel, 2-D and 3-D meshes, and a change of parallelism.

The program is tests/workers/parallel_worker.py: residual MLP blocks split into pipeline stages (activations
and gradients sent between stages), tensor parallel inside a stage (ColwiseParallel/RowwiseParallel),
FSDP2 or replicas across data-parallel ranks, Adam, the RNG streams, and ``best`` (a tensor on the last
stage, a float elsewhere, as nanoGPT's ``best_val_loss``). Its state is keyed three ways users key it:
per-stage keys (``stage<p>``/``opt<p>``), one key whose submodule differs per stage (``model``/``optim``,
the optimizer keyed by parameter index), and torchtitan's wrappers (``get/set_model_state_dict``,
flattened ``get/set_optimizer_state_dict``). Ranks thus hold different keys: a key is unexpected only
when no rank holds it (checkpoint/compat.py).

1. SIGKILL at a step, resume: every rank bitwise equal to a run never stopped (tests/resume_matrix.py), for
   pipeline stages keyed each way, TP on a 1-D mesh, FSDP2 x TP on a 2-D mesh, and PP x TP and PP x FSDP2
   on 4 ranks over two emulated nodes (stages in different storage domains). PP x TP runs with
   ``replica_check=off``: the two stages' Adam moments under one index-keyed key are DTensor chunks at the
   same offsets, replicas of each other only within a stage's mesh (written once for both stages, one
   stage's moments would come back as the other's).
2. A change of parallelism restores exactly (parameters and Adam moments, gathered by name, equal to what
   was saved): a pipeline re-split (2+2 blocks to 1+3, and interleaved stages), TP 2 -> 1, FSDP2 x TP ->
   FSDP2, FSDP2 at 2 -> 4 ranks, PP x TP (4 ranks) -> PP re-split (2 ranks).
3. An optimizer keyed by parameter index cannot follow a re-split: refused on every rank with a message
   naming the optimizer and what moved and pointing at ``get_optimizer_state_dict``; also when every
   rank has as many parameters as before (interleaved stages), where nothing else would notice.
4. ``rslurm rehearse --kill`` passes on a pipeline program.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import clean_env, start_ranks
from resume_matrix import PARALLEL_WORKER, check_resume

pytestmark = [pytest.mark.slow, pytest.mark.skipif(sys.platform != "linux", reason="multi-process gloo test")]


# ------------------------------------------------------------------------------- SIGKILL, then resume
@pytest.mark.parametrize(("nodes", "per_node", "args", "env"), [
    pytest.param(1, 2, ("--pp", "2", "--keys", "rank"), {}, id="pp2-per-stage-keys"),
    pytest.param(2, 1, ("--pp", "2", "--keys", "shared"), {}, id="pp2-one-key-2-nodes"),
    pytest.param(1, 2, ("--pp", "2", "--keys", "titan"), {}, id="pp2-torchtitan"),
    pytest.param(1, 2, ("--pp", "1", "--tp", "2", "--keys", "shared"), {}, id="tp2"),
    pytest.param(1, 4, ("--pp", "1", "--dp", "2", "--tp", "2", "--fsdp", "--keys", "shared"), {}, id="fsdp2xtp2"),
    pytest.param(2, 2, ("--pp", "2", "--tp", "2", "--keys", "shared"), {"RSLURM_REPLICA_CHECK": "off"},
                 id="pp2xtp2-2-nodes"),
    pytest.param(2, 2, ("--pp", "2", "--dp", "2", "--fsdp", "--keys", "titan"), {}, id="pp2xfsdp2-2-nodes"),
])
def test_sigkill_then_resume_is_bitwise_identical(nodes: int, per_node: int, args: tuple[str, ...],
                                                   env: dict[str, str]) -> None:
    check_resume(nodes, per_node, "node", (), kill_at=8, worker=PARALLEL_WORKER, args=args, env=env)


# ------------------------------------------------------------------------------ change of parallelism
def _run(d: Path, world: int, args: list[str], steps: int) -> tuple[list[int], str]:
    argv = [PARALLEL_WORKER, *args, "--steps", str(steps), "--every", "3", "--out", str(d / "out.%r.pt")]
    env = [{"SLURMD_NODENAME": "n1", "LOCAL_RANK": str(r), "RSLURM_LOCAL_DIR": str(d / "nvme" / "%n")}
           for r in range(world)]
    job = start_ranks(argv, world, d, env={"RSLURM_RUN_ID": "mp"}, per_rank_env=env)
    codes = job.wait(300)
    return codes, "\n".join(f"--- rank {r} (exit {c}) ---\n{job.output(r)[-3000:]}" for r, c in enumerate(codes))


def _by_name(d: Path, world: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Every parameter and its Adam state, by global name, from every rank's output (equal where ranks share)."""
    params: dict[str, torch.Tensor] = {}
    adam: dict[str, Any] = {}
    for r in range(world):
        out = torch.load(d / f"out.{r}.pt", weights_only=True)
        for k, v in out["params"].items():
            assert k not in params or torch.equal(params[k], v), f"rank {r}: {k} differs from another rank's"
            params[k] = v
        adam.update(out["adam"])
    return params, adam


def _save_then_restore(tmp: Path, world_a: int, a: list[str], world_b: int, b: list[str]) -> tuple[list[int], str]:
    """Train layout ``a`` to step 6 (saved at 3 and 6), keep what it ended with, restore step 6 at layout ``b``
    (no further step: what it writes is what it restored)."""
    codes, text = _run(tmp, world_a, a, 6)
    assert codes == [0] * world_a, text
    saved = tmp / "saved"
    saved.mkdir()
    for r in range(world_a):
        shutil.move(tmp / f"out.{r}.pt", saved / f"out.{r}.pt")
    return _run(tmp, world_b, b, 6)


@pytest.mark.parametrize(("world_a", "a", "world_b", "b"), [
    pytest.param(2, "--pp 2 --keys titan", 2, "--pp 2 --keys titan --split 1,3", id="pp-resplit"),
    pytest.param(2, "--pp 2 --keys titan", 2, "--pp 2 --keys titan --split 0,2/1,3", id="pp-interleaved"),
    pytest.param(2, "--pp 1 --tp 2 --keys shared", 1, "--pp 1 --keys shared", id="tp2-to-1"),
    pytest.param(4, "--pp 1 --dp 2 --tp 2 --fsdp --keys shared", 2,
                 "--pp 1 --dp 2 --fsdp --keys shared --rank-map 0:0,1:1", id="fsdp2xtp2-to-fsdp2"),
    pytest.param(2, "--pp 1 --dp 2 --fsdp --keys titan", 4,
                 "--pp 1 --dp 4 --fsdp --keys titan --rank-map 0:0,1:1,2:0,3:1", id="fsdp2-to-4"),
    pytest.param(4, "--pp 2 --tp 2 --keys titan", 2, "--pp 2 --keys titan --split 3,1 --rank-map 0:0,1:2",
                 id="pp2xtp2-to-pp2-resplit"),
])
def test_a_change_of_parallelism_restores_exactly(tmp_path: Path, world_a: int, a: str, world_b: int, b: str) -> None:
    codes, text = _save_then_restore(tmp_path, world_a, a.split(), world_b, b.split())
    assert codes == [0] * world_b, text
    params_a, adam_a = _by_name(tmp_path / "saved", world_a)
    params_b, adam_b = _by_name(tmp_path, world_b)
    assert params_a.keys() == params_b.keys() and len(params_a) == 16
    for k in params_a:
        assert torch.equal(params_a[k], params_b[k]), k
    assert adam_a.keys() == adam_b.keys() == params_a.keys()
    for k in adam_a:
        for m in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(adam_a[k][m], adam_b[k][m]), (k, m)


@pytest.mark.parametrize(("split", "words"), [
    pytest.param("1,3", ["optimizer 'optim': its parameters changed", "get_optimizer_state_dict"], id="resplit"),
    pytest.param("0,2/1,3", ["optimizer 'optim' keys its state by parameter index",
                             "index 4 was model.layers.1.w1.weight, is now model.layers.2.w1.weight",
                             "get_optimizer_state_dict"], id="interleaved-same-counts"),
])
def test_an_optimizer_keyed_by_index_refuses_a_resplit(tmp_path: Path, split: str, words: list[str]) -> None:
    codes, text = _save_then_restore(tmp_path, 2, ["--pp", "2", "--keys", "shared"],
                                     2, ["--pp", "2", "--keys", "shared", "--split", split])
    assert codes[0] != 0 and codes[1] != 0, text
    assert "IncompatibleCheckpointError" in text and "on rank 0" in text and "on rank 1" in text, text
    for w in words:
        assert w in text, (w, text)
    assert not (tmp_path / "out.0.pt").exists()


# -------------------------------------------------------------------------------------------- rehearse
def test_rehearse_passes_on_a_pipeline_program(tmp_path: Path) -> None:
    out = tmp_path / "rehearse"
    argv = [sys.executable, "-m", "resilient_slurm.cli", "rehearse", "-n", "2", "--seed", "5", "--steps", "24",
            "--kill", "--dir", str(out), "--", sys.executable, PARALLEL_WORKER, "--pp", "2", "--keys", "shared",
            "--sleep", "0.05"]
    p = subprocess.run(argv, env=clean_env({"RSLURM_LOG_LEVEL": "WARNING"}), cwd=tmp_path, capture_output=True,
                       text=True, timeout=600)
    text = p.stdout + p.stderr
    assert p.returncode == 0, text
    assert "PASS" in text and "SIGKILL to rank process" in text, text
