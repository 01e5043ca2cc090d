"""A save under a host-memory budget (``staging_memory_limit``) smaller than the tensor state: staged and
written in waves through one window (checkpoint/staging.py ``WaveWriter``). The shard file is byte for byte
the one a save without the budget writes, the step restores bitwise, the memory held is one window, and a
failure while writing the waves fails the save on every rank, with no hang and the older steps intact."""

from __future__ import annotations

import json
import os
import tracemalloc
from pathlib import Path

import pytest
import torch
from conftest import REPO, run_ranks

from resilient_slurm import Checkpointer, SaveError
from resilient_slurm.checkpoint.staging import StagingBuffer, WaveWriter
from resilient_slurm.errors import ConfigError
from resilient_slurm.manifest import step_dirname
from resilient_slurm.storage.fileio import BLOCK


def _state(plain: bool) -> dict[str, object]:
    g = torch.Generator().manual_seed(3)
    state: dict[str, object] = {
        "big": torch.randn(50_000, generator=g),  # 200 KB: spans many windows
        "half": torch.randn(1000, generator=g).to(torch.bfloat16),
        "t": torch.randn(64, 48, generator=g).t(),  # not contiguous
        "ids": torch.arange(777, dtype=torch.int64),
        "flag": torch.tensor(True),
        "empty": torch.empty(0),
        "conj": torch.randn(300, dtype=torch.complex64, generator=g).conj(),  # a view with the conjugate bit
        "model": torch.nn.Linear(33, 7),
    }
    if plain:  # plain values follow the tensor region in the file, after its padding to a block
        state["meta"] = {"lr": 0.1, "name": "waves"}
    return state


def _zeros(state: dict[str, object]) -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            out[k] = torch.zeros_like(v)
        elif isinstance(v, torch.nn.Module):
            m = torch.nn.Linear(33, 7)
            torch.nn.init.zeros_(m.weight)
            out[k] = m
        else:
            out[k] = {}
    return out


def _shard(root: Path, run: str) -> bytes:
    [f] = list((root / run).glob("step_*/__0_0.distcp"))
    return f.read_bytes()


@pytest.mark.parametrize("plain", [True, False], ids=["plain-values", "tensors-only"])
@pytest.mark.parametrize("limit", [3 * BLOCK + 100, 1, 1 << 30], ids=["windows-of-3-blocks", "one-block", "no-waves"])
def test_a_save_in_waves_writes_the_same_file_and_restores_bitwise(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   limit: int, plain: bool) -> None:
    state = _state(plain)
    with Checkpointer(local_dir=str(tmp_path), run_id="whole", capture_rng=False) as ck:
        ck.save(1, state)
        assert isinstance(ck._engine._staging, StagingBuffer)
    monkeypatch.setenv("RSLURM_STAGING_MEMORY_LIMIT", str(limit))
    with Checkpointer(local_dir=str(tmp_path), run_id="waves", capture_rng=False) as ck:
        ck.save(1, state)
        staging = ck._engine._staging
        if limit < 1 << 30:
            assert isinstance(staging, WaveWriter) and staging.nbytes == max(BLOCK, limit - limit % BLOCK)
            assert staging.buf.numel() == staging.nbytes  # the memory held: one window
        else:
            assert isinstance(staging, StagingBuffer)
    assert _shard(tmp_path, "waves") == _shard(tmp_path, "whole")
    whole = json.loads(next((tmp_path / "whole").glob("step_*/manifest.json")).read_text())
    waves = json.loads(next((tmp_path / "waves").glob("step_*/manifest.json")).read_text())
    assert waves["shards"] == whole["shards"]  # sizes, file checksums, each item's checksum
    back = _zeros(state)
    with Checkpointer(local_dir=str(tmp_path), run_id="waves", capture_rng=False) as ck:
        assert ck.restore(back) == 1
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(back[k], v) and back[k].dtype == v.dtype, k  # type: ignore[arg-type]
        elif isinstance(v, torch.nn.Module):
            for (n, a), b in zip(v.state_dict().items(), back[k].state_dict().values()):  # type: ignore[union-attr]
                assert torch.equal(a, b), n
        else:
            assert back[k] == v


def test_the_framing_of_a_large_tensor_takes_no_memory_of_its_size() -> None:
    """A budget is set for tensors larger than the node can copy: finding a tensor's torch.save framing must
    not build an image of the whole blob (it touched the tensor's size in zeroed memory)."""
    from resilient_slurm.checkpoint.staging import _FRAMING_CACHE, _FramingSink, framing_for

    _FRAMING_CACHE.pop((torch.float32, (50_000_000,)), None)
    tracemalloc.start()
    try:
        fr = framing_for(torch.float32, (50_000_000,))  # 200 MB of data
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"{peak} bytes traced for the framing of a 200 MB tensor"
    assert len(fr.prefix) < 4096 and len(fr.suffix) < 4096
    for dtype, shape in ((torch.float32, (1000,)), (torch.bfloat16, (7, 3)), (torch.int64, ()), (torch.bool, (0,))):
        # what the framing was before: the writes placed in an image of the whole blob, the data hole cut out
        sink = _FramingSink()
        with torch.serialization.skip_data():
            torch.save(torch.empty(shape, dtype=dtype), sink)
        img = bytearray(sink.end)
        for pos, data in sink.parts:
            img[pos:pos + len(data)] = data
        small = framing_for(dtype, shape)
        nbytes = torch.empty(shape, dtype=dtype).nbytes
        assert len(small.prefix) + nbytes + len(small.suffix) == sink.end, (dtype, shape)
        assert (small.prefix, small.suffix) == (bytes(img[:len(small.prefix)]),
                                                bytes(img[len(small.prefix) + nbytes:])), (dtype, shape)


def test_a_save_in_waves_that_fails_closes_its_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A save refused in the write phase (a plain value the restore could not load) closes the shard file the
    waves opened: an open descriptor kept a deleted file's space until the process ended, and a full disk
    refused the next save."""
    import numpy as np

    monkeypatch.setenv("RSLURM_STAGING_MEMORY_LIMIT", "16KiB")
    def shard_fds() -> list[str]:
        links = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                links.append(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:  # closed meanwhile (the listing's own)
                continue
        return [link for link in links if ".distcp" in link]

    with Checkpointer(local_dir=str(tmp_path), run_id="refused", capture_rng=False) as ck:
        # A value restore would refuse is refused on the training thread when the plan is made (ConfigError);
        # one that changes kind later, under the same plan, in the write phase (SaveError).
        with pytest.raises(ConfigError, match="state value 'bad' cannot be restored safely"):
            ck.save(1, {"w": torch.randn(20_000), "bad": np.float32(1.0)})
        ck.save(2, {"w": torch.randn(20_000), "bad": 1.0})
        ck.wait()
        for step in (3, 4, 5):
            with pytest.raises(SaveError, match="cannot be restored safely"):
                ck.save(step, {"w": torch.randn(20_000), "bad": np.float32(1.0)})
        assert shard_fds() == []
        ck.save(6, {"w": torch.randn(20_000), "fine": 1.0})
        assert shard_fds() == []


@pytest.mark.proc
def test_a_failure_while_writing_waves_fails_the_save_on_every_rank(tmp_path: Path) -> None:
    """Two ranks save in waves; rank 1's first save fails after its first window (the ``during_waves``
    failpoint). Both ranks are told (no rank waits for the other in the write phase), no domain commits that
    step, the next save commits, and it restores bitwise."""
    job = run_ranks([str(REPO / "tests" / "workers" / "waves_worker.py"), str(tmp_path / "nvme")], 2,
                    tmp_path, env={"RSLURM_STAGING_MEMORY_LIMIT": "64KiB"},
                    per_rank_env=[{}, {"RSLURM_FAILPOINTS": "during_waves=raise"}], timeout=240)
    out = [json.loads(job.output(r).strip().splitlines()[-1]) for r in range(2)]
    for r, o in enumerate(out):
        assert o["staging"] == "WaveWriter", o
        assert len(o["errors"]) == 1 and "step 1" in o["errors"][0] and "rank 1" in o["errors"][0], (r, o)
        assert o["restored"] == 2 and o["equal"], o
    steps = sorted(p.name for p in (tmp_path / "nvme" / "waves").iterdir() if p.name.startswith("step_"))
    assert steps == [step_dirname(2)], steps  # step 1's temporary directory is gone too


@pytest.mark.proc
def test_a_plain_value_refused_on_one_rank_fails_that_save_on_every_rank(tmp_path: Path) -> None:
    """A value restore could not load (a torch.Generator) on rank 1 only: the save that makes the plan refuses it
    on both ranks, naming rank 1 and the key (none waits for the other), and the next save commits and restores."""
    job = run_ranks([str(REPO / "tests" / "workers" / "refused_value_worker.py"), str(tmp_path / "nvme")], 2,
                    tmp_path, timeout=240)
    for r in range(2):
        o = json.loads(job.output(r).strip().splitlines()[-1])
        assert len(o["errors"]) == 1 and "ConfigError" in o["errors"][0], (r, o)
        assert "rank 1" in o["errors"][0] and "state value 'extra' cannot be restored safely" in o["errors"][0], o
        assert "g.get_state()" in o["errors"][0] and o["restored"] == 2 and o["equal"], (r, o)
