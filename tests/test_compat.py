"""The compatibility check before a restore loads anything (checkpoint/compat.py).

* A real save, then a restore into a changed model (a new head, a dropped buffer, a reshaped output
  layer, a new plain value) and its optimizer: one IncompatibleCheckpointError lists every missing,
  unexpected and reshaped key, and the live model, optimizer and plain values are untouched.
* ``allow_missing`` / ``allow_unexpected`` restore everything else bitwise: the allowed keys keep their
  current values, an optimizer whose parameters changed starts afresh (no state), one whose parameters
  only changed shape keeps its reshaped moments and loads the rest.
* Two gloo ranks: every rank raises its own complete list naming itself and the other refusing rank,
  and nothing is loaded on either.
* Bad patterns are a ConfigError before anything is read.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import REPO, run_ranks

from resilient_slurm import Checkpointer
from resilient_slurm.errors import ConfigError, IncompatibleCheckpointError
from resilient_slurm.manifest import read_manifest_file, step_dirname

RUN = "compat"
WORKER = REPO / "tests" / "workers" / "provenance_worker.py"
sys.path.insert(0, str(WORKER.parent))
from provenance_worker import Net, train  # noqa: E402


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RSLURM_NODE_NAME", "n1")


def saved_run(root: Path) -> dict[str, Any]:
    """Save step 5 of the original model (classes=2, no head, a 'scale' buffer) with Adam; return copies of
    what was saved."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    train(model, opt, 5)
    with torch.no_grad():
        model.scale.mul_(3.0)  # a buffer value the restore would bring back
    with Checkpointer(local_dir=str(root), run_id=RUN) as ck:
        ck.save(5, {"model": model, "opt": opt, "epoch": 7})
    return {"model": {k: v.clone() for k, v in model.state_dict().items()},
            "opt": {i: {k: v.clone() for k, v in s.items()} for i, s in opt.state_dict()["state"].items()}}


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_one_error_lists_every_changed_key_and_nothing_is_loaded(tmp_path: Path) -> None:
    saved_run(tmp_path)
    torch.manual_seed(1)
    model = Net(classes=3, head=True, buffer=False)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    before = snapshot(model)
    state: dict[str, Any] = {"model": model, "opt": opt, "epoch": 0, "best": 1.5}
    with Checkpointer(local_dir=str(tmp_path), run_id=RUN) as ck, \
            pytest.raises(IncompatibleCheckpointError) as err:
        ck.restore(state)
    msg = str(err.value)
    missing, unexpected, reshaped = (next(ln for ln in msg.splitlines() if ln.strip().startswith(w))
                                     for w in ("missing", "unexpected", "reshaped"))
    # Parameter order: body.weight 0, body.bias 1, out.weight 2, out.bias 3, head.weight 4, head.bias 5.
    for key in ("model.head.weight", "model.head.bias", "best", "opt.state.4.exp_avg", "opt.state.5.step"):
        assert key in missing, msg
    assert "model.scale" in unexpected, msg
    for key in ("model.out.weight (saved tensor (2, 8) float32, state tensor (3, 8) float32)",
                "model.out.bias", "opt.state.2.exp_avg_sq", "opt.state.3.exp_avg"):
        assert key in reshaped, msg
    assert "optimizer 'opt'" in msg and "allow_missing" in msg and "step 5" in msg, msg
    for line, keys in ((missing, 2 + 1 + 6), (unexpected, 1), (reshaped, 2 + 4)):
        assert f"[{keys}]" in line, (line, keys)
    # Nothing loaded: the model bitwise as it was, the optimizer without state, the plain values as they were.
    assert same(snapshot(model), before)
    assert not opt.state and state["epoch"] == 0 and state["best"] == 1.5


def test_allowed_changes_restore_everything_else_bitwise(tmp_path: Path) -> None:
    saved = saved_run(tmp_path)
    torch.manual_seed(1)
    model = Net(classes=3, head=True, buffer=False)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    before = snapshot(model)
    state: dict[str, Any] = {"model": model, "opt": opt, "epoch": 0, "best": 1.5}
    with Checkpointer(local_dir=str(tmp_path), run_id=RUN) as ck:
        step = ck.restore(state, allow_missing=["model.head.*", "model.out.*", "opt.*", "best"],
                          allow_unexpected=["model.scale"])
    assert step == 5 and state["epoch"] == 7 and state["best"] == 1.5
    now = snapshot(model)
    for k in ("body.weight", "body.bias"):
        assert torch.equal(now[k], saved["model"][k]), k
    for k in ("out.weight", "out.bias", "head.weight", "head.bias"):
        assert torch.equal(now[k], before[k]), k
    assert not opt.state  # its parameters changed: it starts afresh, as a new optimizer would


def test_reshaped_parameters_keep_their_moments_and_the_optimizer_loads_the_rest(tmp_path: Path) -> None:
    saved = saved_run(tmp_path)
    torch.manual_seed(1)
    model = Net(classes=3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    before = snapshot(model)
    state: dict[str, Any] = {"model": model, "opt": opt}
    with Checkpointer(local_dir=str(tmp_path), run_id=RUN) as ck:
        with pytest.raises(IncompatibleCheckpointError, match="unexpected .*epoch"):
            ck.restore(state, allow_missing=["model.out.*", "opt.state.2.*", "opt.state.3.*"])
        assert ck.restore(state, allow_missing=["model.out.*", "opt.state.2.*", "opt.state.3.*"],
                          allow_unexpected=["epoch"]) == 5
    now = snapshot(model)
    assert torch.equal(now["body.weight"], saved["model"]["body.weight"])
    assert torch.equal(now["scale"], saved["model"]["scale"])
    assert torch.equal(now["out.weight"], before["out.weight"])
    got = opt.state_dict()["state"]
    for i in (0, 1):
        for k in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(got[i][k], saved["opt"][i][k]), (i, k)
    assert got[2]["exp_avg"].shape == (3, 8) and not got[2]["exp_avg"].any()  # kept: freshly initialised


def test_bad_patterns_are_refused_before_anything_is_read(tmp_path: Path) -> None:
    with Checkpointer(local_dir=str(tmp_path), run_id=RUN) as ck:
        with pytest.raises(ConfigError, match="allow_missing must be a list"):
            ck.restore({"x": torch.zeros(2)}, allow_missing="model.*")  # type: ignore[arg-type]


@pytest.mark.proc
def test_every_rank_raises_the_whole_list(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    argv = [str(WORKER), "save", str(tmp_path / "nvme"), str(out)]
    run_ranks(argv, 2, tmp_path, timeout=240)
    prov = read_manifest_file(str(tmp_path / "nvme" / "prov" / step_dirname(3) / "manifest.json")).provenance
    assert prov is not None and prov["world_size"] == 2 and prov["nodes"] == sorted(
        read_manifest_file(str(tmp_path / "nvme" / "prov" / step_dirname(3) / "manifest.json")).nodes)
    run_ranks([str(WORKER), "changed", str(tmp_path / "nvme"), str(out)], 2, tmp_path, timeout=240)
    docs = [json.loads((out / f"changed.{r}.json").read_text()) for r in range(2)]
    for r, d in enumerate(docs):
        assert d["untouched"] and d["opt_state"] == 0, d
        for key in ("model.head.weight", "model.scale", "model.out.weight", "opt.state.4.exp_avg"):
            assert key in d["error"], d["error"]
        # Each rank lists its own differences, and names the other rank that refused too.
        assert f"does not fit the state being restored on rank {r};" in d["error"], d["error"]
        assert f"does not fit on rank {1 - r} either" in d["error"], d["error"]
