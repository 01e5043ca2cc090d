"""State saved empty (a disabled GradScaler's ``{}``, an empty list) is kept: DCP stores no item for it, so
the manifest names it, and ``rslurm show`` and ``rslurm export --format torch`` keep the key with its empty
value instead of dropping it. The restore of such a state is unchanged (nothing to load).

Single process, real files, the real CLI in a subprocess.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import run_rslurm

from resilient_slurm import Checkpointer
from resilient_slurm.manifest import empty_keys, read_manifest_file, step_dirname

RUN = "e"


def _state(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 4)
    return {"model": model, "scaler": torch.amp.GradScaler("cpu", enabled=False), "history": [],
            "epoch": seed}


def _rslurm(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return run_rslurm(*args, env={"RSLURM_LOCAL_DIR": str(root), "RSLURM_RUN_ID": RUN})


@pytest.mark.proc
def test_empty_values_are_named_shown_exported_and_restore_as_before(tmp_path: Path) -> None:
    saved = _state(1)
    root = tmp_path / "nvme"  # exports go next to it: never inside a tier (docs/cli.md)
    with Checkpointer(local_dir=str(root), run_id=RUN) as ck:
        ck.save(5, saved)
        ck.wait()
    m = read_manifest_file(str(root / RUN / step_dirname(5) / "manifest.json"))
    assert empty_keys(m) == {"scaler": "dict"}  # an empty list is a plain value: stored as one

    shown = _rslurm(root, "show", "5", "--json")
    assert shown.returncode == 0, shown.stderr
    keys = {k["key"]: k for k in json.loads(shown.stdout)["keys"]}
    assert keys["scaler"]["empty"] == "dict" and keys["scaler"]["items"] == 0
    assert keys["history"]["values"] == 1 and "empty" not in keys["history"] and "empty" not in keys["model"]
    assert "empty dict" in _rslurm(root, "show", "5").stdout

    out = tmp_path / "all.pt"
    r = _rslurm(root, "export", "5", "--format", "torch", str(out))
    assert r.returncode == 0, r.stderr
    sd = torch.load(out, weights_only=True)
    assert sd["scaler"] == {} and sd["history"] == [] and sd["epoch"] == 1 and sd["_rslurm_step"] == 5
    torch.amp.GradScaler("cpu", enabled=False).load_state_dict(sd["scaler"])  # what torch.save would have held
    assert torch.equal(sd["model"]["weight"], saved["model"].weight.detach())

    only = tmp_path / "scaler.pt"
    r = _rslurm(root, "export", "5", "--format", "torch", "--only", "scaler", str(only))
    assert r.returncode == 0, r.stderr
    assert torch.load(only, weights_only=True) == {"scaler": {}}

    fresh = _state(2)
    with Checkpointer(local_dir=str(root), run_id=RUN) as ck:
        assert ck.restore(fresh) == 5
    assert fresh["history"] == [] and fresh["epoch"] == 1
    assert torch.equal(fresh["model"].weight, saved["model"].weight)


def test_a_malformed_empty_keys_entry_is_ignored(tmp_path: Path) -> None:
    with Checkpointer(local_dir=str(tmp_path), run_id=RUN) as ck:
        ck.save(1, _state(1))
        ck.wait()
    m = read_manifest_file(str(tmp_path / RUN / step_dirname(1) / "manifest.json"))
    for bad in ([1, 2], {"x": "set", 3: "dict", "y" * 300: "dict"}, "dict"):
        assert empty_keys(type(m)(**{**m.__dict__, "extra": {"empty_keys": bad}})) == {}
