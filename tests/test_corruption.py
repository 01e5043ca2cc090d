"""Corrupt committed steps in every way we know and check that restore skips them, never runs code,
never touches live state with unverified bytes, and falls back to the previous valid step.

Single process, real files: two steps are saved with distinct states (model, Adam after a step, plain
values, a bare tensor), step 2 is damaged, and a *new* Checkpointer restores into *fresh* objects.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import json
import logging
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import checkpoint_entries
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex

from resilient_slurm import (
    Checkpointer,
    ConfigError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    SaveError,
)
from resilient_slurm.checkpoint.planning import dump_metadata, load_metadata
from resilient_slurm.storage.fileio import checksum

RUN = "r"
SHARD = "__0_0.distcp"


# ---------------------------------------------------------------------------------------- helpers
def make_state(seed: int, hidden: int = 32, *, stepped: bool = True) -> dict[str, Any]:
    """A small but complete training state whose every value depends on ``seed``."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3 * seed)
    if stepped:
        model(torch.randn(8, 16)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {
        "model": model,
        "optim": opt,
        "epoch": seed,
        "meta": {"name": f"seed{seed}", "history": [seed, seed * 2.5], "nested": {"flag": seed % 2 == 0}},
        "buf": torch.randn(300) + seed,
    }


def fresh_state(hidden: int = 32) -> dict[str, Any]:
    """What a restarted job builds before restore: other weights, an Adam that never stepped."""
    st = make_state(99, hidden, stepped=False)
    st["epoch"] = -1
    st["meta"] = {}
    st["buf"] = torch.zeros(300)
    return st


def snapshot(st: dict[str, Any]) -> dict[str, Any]:
    """A deep, detached copy of everything restore may change."""
    return {
        "model": {k: v.detach().clone() for k, v in st["model"].state_dict().items()},
        "optim": copy.deepcopy(st["optim"].state_dict()),
        "epoch": st["epoch"],
        "meta": copy.deepcopy(st["meta"]),
        "buf": st["buf"].detach().clone(),
    }


def assert_same(a: Any, b: Any, where: str = "") -> None:
    """Exact (bitwise for tensors) recursive equality."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{where}: tensor vs {type(b).__name__}"
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), f"{where}: tensors differ"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: keys {sorted(map(str, a))} vs {b!r}"
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), f"{where}: {a!r} vs {b!r}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def assert_restored(st: dict[str, Any], ref: dict[str, Any]) -> None:
    assert_same(snapshot(st), ref, "state")


@dataclasses.dataclass
class Saved:
    root: Path
    ref1: dict[str, Any]
    ref2: dict[str, Any]

    def step_dir(self, step: int) -> Path:
        return self.root / RUN / f"step_{step:012d}"

    def restore(self, st: dict[str, Any] | None = None, **kw: Any) -> tuple[int, dict[str, Any]]:
        st = fresh_state() if st is None else st
        with Checkpointer(local_dir=str(self.root), run_id=RUN, **kw) as ck:
            return ck.restore(st), st


@pytest.fixture
def saved(tmp_path: Path) -> Saved:
    root = tmp_path / "nvme"
    s1, s2 = make_state(1), make_state(2)
    with Checkpointer(local_dir=str(root), run_id=RUN) as ck:
        ck.save(1, s1)
        ck.save(2, s2)
    ref1, ref2 = snapshot(s1), snapshot(s2)
    # The two steps must really differ everywhere, or "restored step 1" would prove nothing.
    for k in ("model", "buf"):
        with pytest.raises(AssertionError):
            assert_same(ref1[k], ref2[k])
    return Saved(root, ref1, ref2)


@pytest.fixture
def warnings_log(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger="resilient_slurm")
    return caplog


def warning_text(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)


def read_manifest(d: Path) -> dict[str, Any]:
    return json.loads((d / "manifest.json").read_text())


def write_manifest(d: Path, m: dict[str, Any]) -> None:
    (d / "manifest.json").write_text(json.dumps(m))


def storage_of(d: Path, fqn: str) -> Any:
    md = load_metadata((d / ".metadata").read_bytes(), source="test")
    (info,) = [v for k, v in md.storage_data.items() if k.fqn == fqn]
    return info


def reseal(d: Path, metadata_bytes: bytes | None = None) -> None:
    """Rewrite the manifest so that sizes and checksums match the (tampered) files, as an attacker
    who can write the directory would: only the restricted unpicklers stand between us and the bytes."""
    m = read_manifest(d)
    if metadata_bytes is not None:
        (d / ".metadata").write_bytes(metadata_bytes)
    mdb = (d / ".metadata").read_bytes()
    m["dcp_metadata"] = {"offset": 0, "length": len(mdb), "checksum": checksum(mdb)}
    data = (d / SHARD).read_bytes()
    sh = m["shards"][0]
    sh["size"] = len(data)
    sh["checksum"] = checksum(data)
    sh["chunks"] = [
        {"offset": c["offset"], "length": c["length"], "checksum": checksum(data[c["offset"] : c["offset"] + c["length"]])}
        for c in sh["chunks"]
    ]
    write_manifest(d, m)


class _Evil:
    """Pickles to a call of os.system: what a malicious checkpoint would carry."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


# ---------------------------------------------------------------------------------------- baseline
def test_round_trip_restores_newest_step_exactly(saved: Saved) -> None:
    step, st = saved.restore()
    assert step == 2
    assert_restored(st, saved.ref2)


# ---------------------------------------------------------------------------------------- corruptions
def _truncate(d: Path, marker: Path) -> tuple[str, str]:
    p = d / SHARD
    with open(p, "r+b") as f:
        f.truncate(p.stat().st_size // 2)
    return str(p), "truncated"


def _flip_byte_in_tensor(d: Path, marker: Path) -> tuple[str, str]:
    info = storage_of(d, "model.0.weight")  # 32x16 float32: 2 KiB of data inside the blob
    p = d / SHARD
    pos = info.offset + info.length // 2
    with open(p, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0x01]))
    return str(p), "checksum mismatch in model.0.weight"


def _delete_shard(d: Path, marker: Path) -> tuple[str, str]:
    (d / SHARD).unlink()
    return str(d / SHARD), "missing"


def _garbage_manifest(d: Path, marker: Path) -> tuple[str, str]:
    (d / "manifest.json").write_bytes(b"\x00\xffnot json at all{{{")
    return str(d / "manifest.json"), "not valid JSON"


def _manifest_wrong_type(d: Path, marker: Path) -> tuple[str, str]:
    m = read_manifest(d)
    m["world_size"] = "1"
    write_manifest(d, m)
    return str(d / "manifest.json"), "'world_size' must be an integer"


def _manifest_wrong_step(d: Path, marker: Path) -> tuple[str, str]:
    m = read_manifest(d)  # e.g. a directory copied from another step
    m["step"] = 7
    write_manifest(d, m)
    return str(d / "manifest.json"), "step 7"


def _metadata_garbage(d: Path, marker: Path) -> tuple[str, str]:
    p = d / ".metadata"
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0xFF
    p.write_bytes(bytes(data))
    return str(p), "checksum does not match"


def _metadata_missing(d: Path, marker: Path) -> tuple[str, str]:
    (d / ".metadata").unlink()
    return str(d / ".metadata"), "missing"


def _metadata_malicious(d: Path, marker: Path) -> tuple[str, str]:
    (d / ".metadata").write_bytes(pickle.dumps(_Evil(marker)))
    return str(d / ".metadata"), "checksum does not match"


def _metadata_malicious_resealed(d: Path, marker: Path) -> tuple[str, str]:
    reseal(d, pickle.dumps(_Evil(marker)))
    return str(d / ".metadata"), "not allowed"


def _metadata_malicious_nested_resealed(d: Path, marker: Path) -> tuple[str, str]:
    # A genuine Metadata object with the payload hidden inside (planner_data), checksums fixed up.
    md = load_metadata((d / ".metadata").read_bytes(), source="test")
    evil = dataclasses.replace(md, planner_data={**md.planner_data, "x": _Evil(marker)})
    reseal(d, pickle.dumps(evil))
    return str(d / ".metadata"), "not allowed"


CORRUPTIONS = {
    "truncated_shard": _truncate,
    "flipped_byte_in_tensor": _flip_byte_in_tensor,
    "deleted_shard": _delete_shard,
    "garbage_manifest": _garbage_manifest,
    "manifest_field_wrong_type": _manifest_wrong_type,
    "manifest_wrong_step": _manifest_wrong_step,
    "metadata_corrupted": _metadata_garbage,
    "metadata_missing": _metadata_missing,
    "metadata_malicious_pickle": _metadata_malicious,
    "metadata_malicious_pickle_resealed": _metadata_malicious_resealed,
    "metadata_malicious_nested_resealed": _metadata_malicious_nested_resealed,
}


@pytest.mark.parametrize("how", sorted(CORRUPTIONS))
def test_corrupt_step_is_skipped_with_reason(
    saved: Saved, how: str, tmp_path: Path, warnings_log: pytest.LogCaptureFixture
) -> None:
    marker = tmp_path / "pwned"
    path, reason = CORRUPTIONS[how](saved.step_dir(2), marker)
    step, st = saved.restore()
    assert not marker.exists(), "restore executed code from the checkpoint"
    assert step == 1
    assert_restored(st, saved.ref1)
    text = warning_text(warnings_log)
    assert "skipping step 2" in text, text
    assert path in text, f"warning does not name {path}: {text}"
    assert reason in text, f"warning does not give the reason {reason!r}: {text}"


def test_malicious_payload_is_live(tmp_path: Path) -> None:
    """Guard for the test above: the payload really runs code when unpickled without restriction."""
    marker = tmp_path / "pwned"
    pickle.loads(pickle.dumps(_Evil(marker)))
    assert marker.exists()


def test_malicious_plain_value_blob_runs_no_code_and_is_skipped(
    saved: Saved, tmp_path: Path, warnings_log: pytest.LogCaptureFixture
) -> None:
    """A plain value replaced by a torch.save blob that calls os.system, every checksum fixed up.

    The safe loader refuses it; the step must then be skipped like any other unreadable step, and the
    live state must not be half-restored (weights copied, then the plain value failing).
    """
    d = saved.step_dir(2)
    marker = tmp_path / "pwned"
    blob = io.BytesIO()
    torch.save(_Evil(marker), blob)
    shard = d / SHARD
    off = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(blob.getvalue())
    md = load_metadata((d / ".metadata").read_bytes(), source="test")
    storage = dict(md.storage_data)
    storage[MetadataIndex("epoch")] = _StorageInfo(SHARD, off, len(blob.getvalue()))
    m = read_manifest(d)
    m["shards"][0]["chunks"].append({"offset": off, "length": len(blob.getvalue()), "checksum": ""})
    write_manifest(d, m)
    reseal(d, dump_metadata(dataclasses.replace(md, storage_data=storage)))

    st = fresh_state()
    before = snapshot(st)
    try:
        step, _ = saved.restore(st)
    except Exception as exc:  # the engine must not let a raw unpickling error escape mid-restore
        assert not marker.exists(), "restore executed code from the checkpoint"
        changed = [k for k in ("model", "buf") if not _equal(snapshot(st)[k], before[k])]
        pytest.fail(
            f"restore raised {type(exc).__name__} instead of skipping step 2; live state changed: {changed}"
        )
    assert not marker.exists(), "restore executed code from the checkpoint"
    assert step == 1
    assert_restored(st, saved.ref1)
    assert "epoch" in warning_text(warnings_log)


def _equal(a: Any, b: Any) -> bool:
    try:
        assert_same(a, b)
    except AssertionError:
        return False
    return True


def test_leftover_tmp_dirs_are_ignored_and_removed(saved: Saved, warnings_log: pytest.LogCaptureFixture) -> None:
    run = saved.root / RUN
    # An uncommitted step 2 (killed before its rename) and a complete-looking higher step that never
    # got renamed: neither may be read, both must be removed.
    uncommitted = run / "step_000000000002.tmp-deadbeef-1"
    saved.step_dir(2).rename(uncommitted)
    higher = run / "step_000000000009.tmp-cafe-3"
    shutil.copytree(uncommitted, higher)
    m = read_manifest(higher)
    m["step"] = 9
    write_manifest(higher, m)
    step, st = saved.restore()
    assert step == 1
    assert_restored(st, saved.ref1)
    assert not uncommitted.exists() and not higher.exists()
    assert checkpoint_entries(run) == ["step_000000000001"]
    logged = "\n".join(r.getMessage() for r in warnings_log.records)
    assert str(higher) in logged and str(uncommitted) in logged


def test_all_steps_corrupt_restores_nothing_and_leaves_state_untouched(
    saved: Saved, warnings_log: pytest.LogCaptureFixture
) -> None:
    _flip_byte_in_tensor(saved.step_dir(2), Path("/nonexistent"))
    _truncate(saved.step_dir(1), Path("/nonexistent"))
    st = fresh_state()
    before = snapshot(st)
    opt = st["optim"]
    assert not opt.state
    with pytest.raises(CorruptCheckpointError, match=r"committed steps \[1, 2\] exist"):
        saved.restore(st)  # by default a run is never silently started over (tests/test_restore_fallback.py)
    assert_restored(st, before)
    assert not opt.state
    step, st2 = saved.restore(st, restore_fallback="fresh")
    assert step == 0
    assert st2 is st
    assert_restored(st, before)
    assert not opt.state, "a fresh optimizer must stay pristine when nothing was restored"
    assert all(p.grad is None for p in st["model"].parameters())
    text = warning_text(warnings_log)
    assert "skipping step 2" in text and "skipping step 1" in text
    assert "starting from step 0" in text
    # A restored-from-nothing optimizer still trains like a fresh one.
    st["model"](torch.randn(2, 16)).sum().backward()
    opt.step()
    assert len(opt.state) == 4


def test_newer_schema_version_is_incompatible(saved: Saved) -> None:
    d = saved.step_dir(2)
    m = read_manifest(d)
    m["schema_version"] = 999
    write_manifest(d, m)
    st = fresh_state()
    before = snapshot(st)
    with pytest.raises(IncompatibleCheckpointError, match="schema_version 999") as ei:
        saved.restore(st)
    assert str(d / "manifest.json") in str(ei.value)
    assert_restored(st, before)


@pytest.mark.parametrize(
    "extra_key,value",
    [("scheduler_like", 3), ("ema", torch.zeros(5)), ("teacher", torch.nn.Linear(2, 2))],
    ids=["plain", "tensor", "module"],
)
def test_state_key_missing_from_checkpoint_is_incompatible(saved: Saved, extra_key: str, value: Any) -> None:
    st = fresh_state()
    st[extra_key] = value
    before = snapshot(st)
    with pytest.raises(IncompatibleCheckpointError, match=extra_key):
        saved.restore(st)
    assert_restored(st, before)
    assert not st["optim"].state


def test_shape_mismatch_is_incompatible_and_model_unchanged(saved: Saved) -> None:
    st = fresh_state(hidden=48)
    before = snapshot(st)
    with pytest.raises(IncompatibleCheckpointError, match="model.0.weight"):
        saved.restore(st)
    assert_restored(st, before)
    assert not st["optim"].state


def test_unloadable_plain_value_fails_at_save_or_round_trips(tmp_path: Path) -> None:
    """A numpy scalar is a very common plain value (``best_loss = np.float64(...)``). Either save refuses
    it up front (ConfigError naming the key) or restore gives it back; a save that succeeds and a
    restore that then blows up after overwriting the weights would lose the run."""
    np = pytest.importorskip("numpy")
    root = tmp_path / "nvme"
    st = make_state(1)
    st["best_loss"] = np.float64(0.25)
    try:
        with Checkpointer(local_dir=str(root), run_id=RUN) as ck:
            ck.save(1, st)
    except (ConfigError, SaveError) as exc:  # refused up front, naming the value
        assert "best_loss" in str(exc)
        return
    fresh = fresh_state()
    fresh["best_loss"] = None
    before = snapshot(fresh)
    try:
        with Checkpointer(local_dir=str(root), run_id=RUN) as ck:
            step = ck.restore(fresh)
    except Exception as exc:
        changed = not _equal(snapshot(fresh)["model"], before["model"])
        pytest.fail(f"save accepted best_loss but restore raised {type(exc).__name__}; weights changed: {changed}")
    assert step == 1
    assert float(fresh["best_loss"]) == 0.25


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_plain_dcp_reader_loads_our_step(saved: Saved) -> None:
    """A step directory is a valid DCP checkpoint: torch's own FileSystemReader reads it."""
    model = fresh_state()["model"]
    sd = {"model": model.state_dict()}
    dcp.load(sd, storage_reader=dcp.FileSystemReader(str(saved.step_dir(2))))
    model.load_state_dict(sd["model"])
    assert_same({k: v.detach().clone() for k, v in model.state_dict().items()}, saved.ref2["model"], "model")
    buf = {"buf": torch.zeros(300)}
    dcp.load(buf, storage_reader=dcp.FileSystemReader(str(saved.step_dir(1))))
    assert torch.equal(buf["buf"], saved.ref1["buf"])
