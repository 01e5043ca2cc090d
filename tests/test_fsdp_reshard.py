"""FSDP2 (fully_shard) state saved at one world size restores exactly at another (resharding).

Real rank processes, gloo on CPU. The worker (tests/workers/fsdp_worker.py) trains a 4-layer MLP whose
dims do not divide by the world size (uneven shards, and one empty shard at 4 ranks) with Adam, saves
step 3 at 4 ranks, and restores into a fresh model and a fresh optimizer (no state yet) at 2 and at 4
ranks. Each job dumps the full unsharded model/optimizer state from rank 0; the dumps must be equal
tensor for tensor, Adam moments and step counts included.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import REPO, RankJob, clean_env, read_jsonl, run_ranks, start_ranks

from resilient_slurm.checkpoint.verify import verify_step_dir
from resilient_slurm.manifest import partial_items, read_manifest_file
from resilient_slurm.storage.tier import Span, coalesce

WORKER = str(REPO / "tests" / "workers" / "fsdp_worker.py")
ENV = {"RSLURM_COLLECTIVE_TIMEOUT": "60"}

pytestmark = [pytest.mark.proc, pytest.mark.skipif(sys.platform != "linux", reason="multi-process gloo test")]


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


def _check_restored(saved_dump: dict[str, Any], restored: dict[str, Any], width: int = 1) -> None:
    ref, got = saved_dump["now"], restored["now"]
    assert got["step"] == 3
    assert got["extra"] == {"epoch": 7, "name": "fsdp-run", "lrs": [0.1, 0.01], "best": {"loss": 0.25, "at": 2}}
    # The dumps hold the full (unsharded) tensors: 4 layers x (weight, bias).
    assert len(ref["model"]) == 8
    assert ref["model"]["0.weight"].shape == (37 * width, 13 * width)
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
def _node_argv(mode: str, tmp: Path, *extra: str) -> list[str]:
    out = tmp / "out"
    out.mkdir(exist_ok=True)
    return [WORKER, mode, "--local-dir", str(tmp / "nvme" / "%n"), "--run-id", "fsdp", "--out", str(out), *extra]


def _node_job(mode: str, nodes: list[str], tmp: Path, durable: Path,
              env: dict[str, str] | None = None, extra: tuple[str, ...] = ()) -> tuple[dict[str, Any], RankJob]:
    job = run_ranks(_node_argv(mode, tmp, *extra), len(nodes), tmp, timeout=180,
                    env={**ENV, "RSLURM_DURABLE": str(durable), **(env or {})},
                    per_rank_env=[{"RSLURM_NODE_NAME": n} for n in nodes])
    return {"now": torch.load(tmp / "out" / f"{mode}_w{len(nodes)}.pt", weights_only=True)}, job


def _drain(tmp: Path, node: str, durable: Path, *args: str) -> None:
    env = clean_env({"RSLURM_LOCAL_DIR": str(tmp / "nvme" / "%n"), "RSLURM_NODE_NAME": node,
                     "RSLURM_DURABLE": str(durable)})
    r = subprocess.run([sys.executable, "-m", "resilient_slurm.cli", "daemon", "--once", *args], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


@pytest.fixture(scope="module")
def drained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """Step 3 saved at 4 ranks on n1 (ranks 0-1) and n2 (ranks 2-3), drained to a POSIX durable tier: made
    once, copied by each test that uses it (:func:`_saved_and_drained`)."""
    tmp = tmp_path_factory.mktemp("drained")
    durable = tmp / "lustre"
    ref, _ = _node_job("save", ["n1", "n1", "n2", "n2"], tmp, durable)
    for node in ("n1", "n2"):
        _drain(tmp, node, durable)
    assert (durable / "fsdp" / f"step_{3:012d}" / "manifest.json").exists()
    return tmp, ref


def _saved_and_drained(drained: tuple[Path, dict[str, Any]], tmp: Path) -> tuple[Path, dict[str, Any], Path]:
    """A copy of ``drained`` in ``tmp`` (a test may damage its durable files): the durable tier, the saved
    state, and the step's directory on the durable tier."""
    made, ref = drained

    def special(d: str, names: list[str]) -> list[str]:  # sockets and pipes: a live process's, not state
        return [n for n in names if not (os.path.isdir(os.path.join(d, n)) or os.path.isfile(os.path.join(d, n)))]

    shutil.copytree(made, tmp, symlinks=True, ignore=special, dirs_exist_ok=True)
    durable = tmp / "lustre"
    return durable, ref, durable / "fsdp" / f"step_{3:012d}"


def test_fsdp_resharded_onto_other_nodes_fetches_only_the_items_each_plan_reads(
        tmp_path: Path, drained: tuple[Path, dict[str, Any]]) -> None:
    """Saved at 4 ranks on two nodes (n1: ranks 0-1, n2: ranks 2-3) and drained; restored at 2 ranks on two
    empty nodes (n3, n4). Each new node fetches from the durable tier only what its rank's load plan reads
    (n3's rank holds the first rows of every tensor: items of saved ranks 0 and 1): a file whole when the
    plan reads most of it, else just the items read (ranged reads, each item checked against its
    checksum), and the restore is bitwise the saved state."""
    durable, ref, step_dir = _saved_and_drained(drained, tmp_path)
    files = {f.name: f.stat().st_size for f in step_dir.glob("*.distcp")}
    assert sorted(files) == [f"__{r}_0.distcp" for r in range(4)], files
    got, _ = _node_job("restore", ["n3", "n4"], tmp_path, durable)
    _check_restored(ref, got)
    fetched: dict[str, int] = {}
    touched: dict[str, set[str]] = {}  # files a node fetched, whole or in part
    partial: dict[str, set[str]] = {}
    for node in ("n3", "n4"):
        [ev] = [e for e in read_jsonl(tmp_path / "nvme" / node / "fsdp" / "events.jsonl") if e["event"] == "restore"]
        assert ev["step"] == 3 and ev["tier"] == "durable", ev
        local = tmp_path / "nvme" / node / "fsdp" / f"step_{3:012d}"
        m = read_manifest_file(str(local / "manifest.json"))
        here = {f.name: f.stat().st_size for f in local.glob("*.distcp")}
        assert all(files[name] == size for name, size in here.items()), here
        # Files its plan reads only a little of came as just those items, each at its own offset of
        # <file>.partial (the rest a hole), listed in the manifest and byte-equal to the durable file.
        held = partial_items(m)
        assert {f.name for f in local.glob("*.partial")} == {f"{p}.partial" for p in held}, (node, held)
        requested = 0
        for path, items in held.items():
            assert path not in here and items, (node, path)
            data, durable_data = (local / f"{path}.partial").read_bytes(), (step_dir / path).read_bytes()
            assert len(data) == files[path]
            assert all(data[o:o + n] == durable_data[o:o + n] for o, n in items), (node, path)
            assert sum(n for _, n in items) < 0.75 * files[path], (node, path, items)
            requested += sum(g[-1].end - g[0].offset for g in coalesce([Span(o, n, "") for o, n in sorted(items)]))
        assert ev["fetched_bytes"] == sum(here.values()) + requested, (node, ev, here, held)
        fetched[node], touched[node] = ev["fetched_bytes"], set(here) | set(held)
        partial[node] = set(held)
    # n3's rank reads rows that saved ranks 0 and 1 held: it fetched nothing of rank 2's or rank 3's file.
    assert touched["n3"] == {"__0_0.distcp", "__1_0.distcp"}, touched
    # The uneven rows overlap saved shards in part: some files were fetched as just the items read, and a
    # node fetched fewer bytes than the files it reads from, whole.
    assert partial["n3"] and partial["n4"], partial
    for node in ("n3", "n4"):
        assert fetched[node] < sum(files[f] for f in touched[node]), (node, fetched, touched)
    # `rslurm verify` checks each item a partial file holds against its checksum, and finds a changed byte.
    local = tmp_path / "nvme" / "n3" / "fsdp" / f"step_{3:012d}"
    report = verify_step_dir(str(local))
    assert not report.faults and report.files_checked == len(touched["n3"]), report
    [(path, items)] = partial_items(read_manifest_file(str(local / "manifest.json"))).items()
    offset, length = max(items, key=lambda it: it[1])
    with open(local / f"{path}.partial", "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))
    [fault] = verify_step_dir(str(local)).faults
    assert fault.where == str(local / f"{path}.partial") and f"bytes {offset}+{length}" in fault.problem, fault


def test_a_compressed_durable_step_is_resharded_onto_other_nodes_bitwise(tmp_path: Path) -> None:
    """The layout of the test above with every dim 15 times wider (shards of about 1 MiB), drained with
    `--durable-compression zstd`: every shard is stored compressed, and the restore at 2 ranks on two empty
    nodes decodes what its plans read (whole files, and the frames that hold the items of a file read in
    part) and is bitwise the saved state; `verify` of the durable step passes."""
    from resilient_slurm.checkpoint.verify import verify_durable_step
    from resilient_slurm.storage.encoding import is_compressed
    from resilient_slurm.storage.posix import PosixTier

    durable, wide = tmp_path / "lustre", ("--width", "15")
    ref, _ = _node_job("save", ["n1", "n1", "n2", "n2"], tmp_path, durable, extra=wide)
    for node in ("n1", "n2"):
        _drain(tmp_path, node, durable, "--durable-compression", "zstd")
    step_dir = durable / "fsdp" / f"step_{3:012d}"
    raw = {f.name: f.stat().st_size for node in ("n1", "n2")
           for f in (tmp_path / "nvme" / node / "fsdp" / f"step_{3:012d}").glob("*.distcp")}
    assert sorted(raw) == [f"__{r}_0.distcp" for r in range(4)] and min(raw.values()) > 256 << 10, raw
    with PosixTier(str(durable)) as tier:
        assert all(is_compressed(tier, f"fsdp/step_{3:012d}/{name}", size) for name, size in raw.items()), raw
        assert not verify_durable_step(tier, "fsdp", 3).faults
    stored = sum((step_dir / name).stat().st_size for name in raw)
    assert stored < 0.97 * sum(raw.values()), (stored, raw)
    got, _ = _node_job("restore", ["n3", "n4"], tmp_path, durable, extra=wide)
    _check_restored(ref, got, width=15)
    partial: dict[str, list[str]] = {}
    for node in ("n3", "n4"):
        [ev] = [e for e in read_jsonl(tmp_path / "nvme" / node / "fsdp" / "events.jsonl") if e["event"] == "restore"]
        assert ev["step"] == 3 and ev["tier"] == "durable", ev
        local = tmp_path / "nvme" / node / "fsdp" / f"step_{3:012d}"
        assert not verify_step_dir(str(local)).faults  # what was decoded is what the manifest's checksums say
        partial[node] = sorted(f.name for f in local.glob("*.partial"))
    assert partial["n3"] or partial["n4"], partial  # ranged reads of a compressed object: its frames decoded


def test_a_damaged_range_is_fetched_again_and_a_corrupt_item_is_never_restored(
        tmp_path: Path, drained: tuple[Path, dict[str, Any]]) -> None:
    """The resharded restore of the test above, twice more. Bytes damaged on the way (a failpoint inverts
    the first byte of one ranged read on each node) fail their item's checksum and are fetched again: the
    restore is still bitwise. Then a byte of the durable file is changed inside an item that n5 fetches as
    a range: the item is refused on arrival, and as the step has no other copy the restore fails on every
    rank with the file and the bytes named, restoring nothing."""
    durable, ref, step_dir = _saved_and_drained(drained, tmp_path)
    got, job = _node_job("restore", ["n3", "n4"], tmp_path, durable, {"RSLURM_FAILPOINTS": "during_range_fetch=flip"})
    _check_restored(ref, got)
    for r in range(2):
        assert "do not match their checksum in the manifest; fetching them again" in job.output(r), job.output(r)
    m = read_manifest_file(str(tmp_path / "nvme" / "n3" / "fsdp" / f"step_{3:012d}" / "manifest.json"))
    [(path, items)] = partial_items(m).items()
    offset, length = max(items, key=lambda it: it[1])  # n3 takes these bytes as a range
    with open(step_dir / path, "r+b") as f:
        f.seek(offset + length // 2)
        b = f.read(1)
        f.seek(offset + length // 2)
        f.write(bytes([b[0] ^ 0xFF]))
    job = start_ranks(_node_argv("restore", tmp_path), 2, tmp_path, env={**ENV, "RSLURM_DURABLE": str(durable)},
                      per_rank_env=[{"RSLURM_NODE_NAME": n} for n in ("n5", "n6")])
    codes = job.wait(180)
    assert all(c != 0 for c in codes), codes
    out = job.output(0)
    assert f"{path}: bytes {offset}+{length} do not match their checksum in the manifest, fetched twice" in out, out[-3000:]
    assert not (tmp_path / "nvme" / "n5" / "fsdp" / f"step_{3:012d}").exists()
