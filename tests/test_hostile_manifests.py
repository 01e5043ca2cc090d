"""A hostile or broken manifest.json is corruption, never a crash, a hang or a blow-up, for every entry point.

One clean run (steps 1 and 2) is copied for each case, and the newest step's manifest replaced by: JSON
nested 200,000 deep, a NUL byte in a shard path, ``"nodes": {}``, ``created_at: NaN``, a FIFO, a symlink
to /dev/zero, and a 300 MiB (sparse) file. Each entry point must say which file is bad, with the
documented exit code, no traceback, within a timeout (a FIFO must not block, /dev/zero must not be read
into memory), and step 1 must still restore, verify and drain:

* ``Checkpointer.restore`` falls back to step 1 with a warning naming the file;
* ``rslurm ls`` lists step 2 as invalid and exits 0; ``show 2`` and ``export 2`` exit 1 naming the file;
  ``verify`` exits 1 naming it, and ``verify 1`` exits 0; ``gc --dry-run`` exits 0;
* ``rslurm daemon --once`` drains step 1 to a POSIX durable tier, refuses step 2 naming it, and exits 1
  (docs/daemon.md: some step could not be drained);
* ``rslurm status`` exits 0.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import pickle
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import run_rslurm
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from resilient_slurm import Checkpointer
from resilient_slurm.checkpoint.metadata_pickle import scan
from resilient_slurm.checkpoint.planning import load_metadata
from resilient_slurm.errors import CorruptCheckpointError
from resilient_slurm.manifest import ChunkEntry, Manifest
from resilient_slurm.storage.fileio import checksum

RUN = "hostile"
STEP2 = "step_000000000002"


def _deep(p: Path) -> None:
    p.write_text("[" * 200_000 + "]" * 200_000)


def _field(**kw: object) -> Callable[[Path], None]:
    def mutate(p: Path) -> None:
        d = json.loads(p.read_text())
        d.update(kw)
        p.write_text(json.dumps(d))
    return mutate


def _nul_path(p: Path) -> None:
    d = json.loads(p.read_text())
    d["shards"][0]["path"] = "__0_0.distcp\x00.evil"
    p.write_text(json.dumps(d))


def _nan(p: Path) -> None:
    p.write_text(p.read_text().replace('"created_at": ', '"created_at": NaN, "x_created_at": ', 1))


def _fifo(p: Path) -> None:
    p.unlink()
    os.mkfifo(p)


def _dev_zero(p: Path) -> None:
    p.unlink()
    p.symlink_to("/dev/zero")


def _huge(p: Path) -> None:
    with open(p, "r+b") as f:
        f.truncate(300 << 20)  # sparse: no disk used


CASES = {"deep": _deep, "nul": _nul_path, "no_nodes": _field(nodes={}), "nan": _nan, "fifo": _fifo,
         "dev_zero": _dev_zero, "huge": _huge}


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("clean") / "nvme"
    with Checkpointer(local_dir=str(root), run_id=RUN, keep_last=5) as ck:
        for step in (1, 2):
            ck.save(step, {"w": torch.full((256,), float(step)), "meta": {"step": step}})
    return root


@pytest.fixture(params=sorted(CASES))
def damaged(request: pytest.FixtureRequest, clean: Path, tmp_path: Path) -> tuple[Path, Path]:
    root = tmp_path / "nvme"
    shutil.copytree(clean, root, symlinks=True)
    manifest = root / RUN / STEP2 / "manifest.json"
    CASES[request.param](manifest)
    return root, manifest


def _rslurm(root: Path, *args: str, durable: Path | None = None) -> subprocess.CompletedProcess[str]:
    return run_rslurm(*args, env={"RSLURM_LOCAL_DIR": str(root), "RSLURM_RUN_ID": RUN, "RSLURM_LOG_LEVEL": "INFO",
                                  **({"RSLURM_DURABLE": str(durable)} if durable else {})}, timeout=90)


def test_restore_falls_back_to_the_previous_step(damaged: tuple[Path, Path], caplog: pytest.LogCaptureFixture) -> None:
    root, manifest = damaged
    caplog.set_level(logging.WARNING, logger="resilient_slurm")
    state = {"w": torch.zeros(256), "meta": {"step": 0}}
    with Checkpointer(local_dir=str(root), run_id=RUN) as ck:
        assert ck.restore(state) == 1
    assert torch.equal(state["w"], torch.full((256,), 1.0)) and state["meta"] == {"step": 1}
    assert str(manifest) in caplog.text


@pytest.mark.proc
def test_inspection_commands_name_the_file(damaged: tuple[Path, Path]) -> None:
    root, manifest = damaged
    ls = _rslurm(root, "ls", "--json")
    assert ls.returncode == 0, ls.stderr
    steps = {s["step"]: s for s in json.loads(ls.stdout)["steps"]}
    assert steps[1]["local"]["state"] == "complete" and steps[2]["local"]["state"] == "invalid", steps
    assert str(manifest) in steps[2]["local"]["why"], steps[2]
    for args in (("show", "2"), ("export", "2", str(root.parent / "out.pt"), "--format", "torch"), ("verify",)):
        r = _rslurm(root, *args)
        assert r.returncode == 1 and str(manifest) in r.stdout + r.stderr, (args, r.stdout, r.stderr)
    assert not (root.parent / "out.pt").exists()
    assert _rslurm(root, "verify", "1").returncode == 0
    gc = _rslurm(root, "gc", "--dry-run")
    assert gc.returncode == 0, gc.stderr


@pytest.mark.proc
def test_daemon_drains_what_is_sound_and_names_the_rest(damaged: tuple[Path, Path]) -> None:
    root, manifest = damaged
    lustre = root.parent / "lustre"
    r = _rslurm(root, "daemon", "--once", durable=lustre)
    assert r.returncode == 1, r.stderr[-3000:]  # docs/daemon.md: 1 when some step could not be drained
    assert str(manifest) in r.stderr
    assert (lustre / RUN / "step_000000000001" / "manifest.json").is_file()
    assert not (lustre / RUN / STEP2 / "manifest.json").exists()
    st = _rslurm(root, "status", durable=lustre)
    assert st.returncode == 0, st.stderr


# ---------------------------------------------------------------- a fuzzer over every manifest field

_JSON = st.recursive(st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False)
                     | st.text(max_size=8), lambda kids: st.lists(kids, max_size=3)
                     | st.dictionaries(st.text(max_size=6), kids, max_size=3), max_leaves=8)


def _paths(v: object, at: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
    """Every place in a decoded manifest a value sits (dict keys and list indexes)."""
    out = [at] if at else []
    if isinstance(v, dict):
        for k, x in v.items():
            out += _paths(x, (*at, k))
    elif isinstance(v, list):
        for i, x in enumerate(v):
            out += _paths(x, (*at, i))
    return out


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_any_field_replaced_by_any_json_is_accepted_or_named(clean: Path, data: st.DataObject) -> None:
    """Replace one field anywhere (or delete it, or add an unknown one) with arbitrary JSON: ``from_json``
    returns a manifest that round-trips, or raises CorruptCheckpointError naming the file; nothing else."""
    text = (clean / RUN / STEP2 / "manifest.json").read_text()
    doc = json.loads(text)
    where = data.draw(st.sampled_from(_paths(doc)))
    parent: Any = doc
    for k in where[:-1]:
        parent = parent[k]
    action = data.draw(st.sampled_from(["replace", "delete", "add"]))
    if action == "delete":
        del parent[where[-1]]
    elif action == "add" and isinstance(parent, dict):
        parent[data.draw(st.text(max_size=6))] = data.draw(_JSON)
    else:
        parent[where[-1]] = data.draw(_JSON)
    try:
        m = Manifest.from_json(json.dumps(doc), source="fuzzed/manifest.json")
    except CorruptCheckpointError as exc:
        assert "fuzzed/manifest.json" in str(exc)
        return
    assert Manifest.from_json(m.to_json(), source="again") == m


# ---------------------------------------------------------------- a .metadata the restricted unpickler refuses

def _foreign_metadata(step_dir: Path) -> None:
    """Replace ``.metadata`` with a pickle naming a class outside DCP's (a plain ``dcp`` reader would run
    whatever it names), and record its true size and checksum in the manifest, as a tampered step would."""
    payload = pickle.dumps(collections.Counter(a=1))
    (step_dir / ".metadata").write_bytes(payload)
    mpath = step_dir / "manifest.json"
    m = Manifest.from_json(mpath.read_bytes())
    m = dataclasses.replace(m, dcp_metadata=ChunkEntry(0, len(payload), checksum(payload)))
    mpath.write_text(m.to_json())


@pytest.fixture
def foreign(clean: Path, tmp_path: Path) -> Path:
    root = tmp_path / "nvme"
    shutil.copytree(clean, root, symlinks=True)
    _foreign_metadata(root / RUN / STEP2)
    return root


@pytest.mark.proc
def test_a_refused_metadata_is_never_restored_drained_or_kept_over_a_valid_step(
        foreign: Path, caplog: pytest.LogCaptureFixture) -> None:
    md = str(foreign / RUN / STEP2 / ".metadata")
    caplog.set_level(logging.WARNING, logger="resilient_slurm")
    state = {"w": torch.zeros(256), "meta": {"step": 0}}
    with Checkpointer(local_dir=str(foreign), run_id=RUN) as ck:
        assert ck.restore(state) == 1
    assert md in caplog.text and "not allowed" in caplog.text
    lustre = foreign.parent / "lustre"
    r = _rslurm(foreign, "daemon", "--once", durable=lustre)
    assert r.returncode == 1 and md in r.stderr, r.stderr[-3000:]
    assert not (lustre / RUN / STEP2).exists() or not (lustre / RUN / STEP2 / "manifest.json").exists()
    assert (lustre / RUN / "step_000000000001" / "manifest.json").is_file()
    v = _rslurm(foreign, "verify", "2")
    assert v.returncode == 1 and md in v.stdout + v.stderr, v.stdout
    # retention with keep_last=1 keeps the only valid step, whatever the newer broken one says
    gc = _rslurm(foreign, "gc", "--keep-last", "1", durable=lustre)
    assert gc.returncode == 0, gc.stderr
    assert (foreign / RUN / "step_000000000001" / "manifest.json").is_file()
    assert (lustre / RUN / "step_000000000001" / "manifest.json").is_file()
    with Checkpointer(local_dir=str(foreign), run_id=RUN) as ck:
        assert ck.restore(state) == 1


# ---------------------------------------------------------------- the torch-free check of .metadata

class _Payload:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("true",))


@pytest.mark.parametrize("payload", [collections.Counter(a=1), _Payload(), os.system, {"x": [eval]}],
                         ids=["counter", "reduce", "function", "nested"])
def test_the_static_scan_refuses_what_the_unpickler_refuses(payload: object) -> None:
    for protocol in (0, 2, pickle.HIGHEST_PROTOCOL):
        data = pickle.dumps(payload, protocol=protocol)
        with pytest.raises(CorruptCheckpointError, match="not allowed"):
            scan(data, source="m/.metadata")
        with pytest.raises(CorruptCheckpointError, match="not allowed"):
            load_metadata(data, source="m/.metadata")


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_the_static_scan_is_never_laxer_than_the_unpickler(clean: Path, data: st.DataObject) -> None:
    """Random edits of a real ``.metadata`` (bytes flipped, inserted, cut): whatever the scan accepts, the
    restricted unpickler never finds a global it refuses (the daemon and gc, which only scan, never keep
    or drain what restore would refuse for that reason); the scan raises nothing but corruption."""
    real = bytearray((clean / RUN / STEP2 / ".metadata").read_bytes())
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(real) - 1))
        how = data.draw(st.sampled_from(["flip", "insert", "cut"]))
        if how == "flip":
            real[at] = data.draw(st.integers(0, 255))
        elif how == "insert":
            real[at:at] = data.draw(st.binary(min_size=1, max_size=8))
        else:
            del real[at:at + data.draw(st.integers(1, 8))]
    try:
        scan(bytes(real), source="m/.metadata")
    except CorruptCheckpointError:
        return
    try:
        load_metadata(bytes(real), source="m/.metadata")
    except CorruptCheckpointError as exc:
        assert "is not allowed" not in str(exc), exc
