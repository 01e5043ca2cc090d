"""DDP at 3+ ranks resumes bitwise: the cause of the drift, shown with DDP alone, and the fix end to end.

Cause (tests/workers/ddp_layout_worker.py, no Checkpointer): DDP's first iteration all-reduces one bucket
in parameter order; after the first backward it rebuilds its buckets in gradient-ready order. An
element's position in its bucket decides its chunk of the ring all-reduce and so the order in which
the ranks' values are added; with 3+ ranks that order changes the rounding. Wrapping the module in a new
DDP mid-run (what every resume does) therefore changes the result, for every bucket size and with a
static graph, and re-applying the first wrapper's layout to the new one removes the difference.

Fix, end to end: the Checkpointer records the layout with each save and re-applies it at the first
forward after a restore (resilient_slurm/checkpoint/ddp.py): a resume from step 1 or 2 at 4 ranks, before
DDP's own rebuild is visible, is bitwise here; DDP at 4 and 12 ranks resumed after a SIGKILL is bitwise in
the topology matrix (tests/test_topology_matrix.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, clean_env, free_port, run_ranks
from resume_matrix import assert_same_run, train

LAYOUT_WORKER = str(REPO / "tests" / "workers" / "ddp_layout_worker.py")

pytestmark = [pytest.mark.proc, pytest.mark.skipif(sys.platform != "linux", reason="multi-process gloo test")]


def test_predicted_layout_before_the_rebuild_is_the_layout_ddp_builds(tmp_path: Path) -> None:
    out = tmp_path / "layouts.json"
    subprocess.run([sys.executable, LAYOUT_WORKER, "predict", str(out)], check=True, timeout=120,
                   env=clean_env({"MASTER_PORT": str(free_port())}), capture_output=True)
    got = json.loads(out.read_text())
    for option in ("plain", "tiny", "multi"):
        before, one, two, three = got[option]["layouts"]
        assert before == [None, False], option  # nothing ran: nothing to restore
        assert one[1] is False and two[1] is True, option  # predicted after one backward, rebuilt after two
        assert one[0] == two[0] == three[0], (option, one, two)
        assert sorted(i for b in one[0] for i in b) == list(range(got[option]["params"]))
    assert len(got["multi"]["layouts"][2][0]) > 1 and len(got["tiny"]["layouts"][2][0]) > 1  # several buckets
    static = got["static"]["layouts"]
    assert static[2][1] is False and static[3][1] is True and static[2][0] == static[3][0]
    assert all(x == [None, True] for x in got["unused"]["layouts"][1:])  # find_unused_parameters: no rebuild


def test_the_ddp_around_a_module_is_found_also_through_torch_compile(tmp_path: Path) -> None:
    out = tmp_path / "found.json"
    subprocess.run([sys.executable, LAYOUT_WORKER, "find", str(out)], check=True, timeout=120,
                   env=clean_env({"MASTER_PORT": str(free_port())}), capture_output=True)
    assert json.loads(out.read_text()) == {"plain": True, "compiled": True, "alone": True}


REWRAP_OPTIONS = ["plain", "multi", "static", "tiny"]


@pytest.fixture(scope="module")
def compared(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, torch.Tensor]]:
    """The three runs of every DDP option at 4 ranks, from one start of the ranks (each run seeds its model
    and data afresh, so running the options one after another changes none of them)."""
    d = tmp_path_factory.mktemp("compare")
    run_ranks([LAYOUT_WORKER, "compare", str(d / "runs.pt"), ",".join(REWRAP_OPTIONS)], 4, d, timeout=240)
    return torch.load(d / "runs.pt", weights_only=True)


@pytest.mark.parametrize("option", REWRAP_OPTIONS)
def test_rewrapping_ddp_changes_the_result_and_the_recorded_layout_undoes_it(
        compared: dict[str, dict[str, torch.Tensor]], option: str) -> None:
    runs = compared[option]
    assert not torch.equal(runs["once"], runs["rewrapped"]), "a new DDP wrapper no longer changes the result"
    assert (runs["once"] - runs["rewrapped"]).abs().max() < 1e-5  # rounding, not a bug in the training
    assert torch.equal(runs["once"], runs["restored"])


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One uninterrupted 6-step run at 4 ranks, the reference of both resumes (same program, same seeds)."""
    ref = tmp_path_factory.mktemp("ref")
    train(4, ("ddp",), ref, steps=6, every=1)
    return ref


@pytest.mark.parametrize("first", [1, 2])
def test_ddp_resumed_from_step_1_or_2_is_bitwise(tmp_path: Path, uninterrupted: Path, first: int) -> None:
    """Saved before DDP's rebuild shows in its own records (after 1 step) or right after it (2 steps)."""
    ref, res = uninterrupted, tmp_path / "res"
    res.mkdir()
    train(4, ("ddp",), res, steps=first, every=1)
    train(4, ("ddp",), res, steps=6, every=1)
    assert_same_run(ref, res, 4)


