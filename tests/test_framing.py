"""staging.tensor_prefix: the bytes torch.save writes before a tensor's data, made without torch.save.

The save frames each tensor item with what ``torch.save`` writes around its data (``framing_for``, made with
torch.save itself); a restore checks a large item's first bytes against that framing as they arrive, to read
the tensor bytes straight into the live tensor. A process's first torch.save runs code a cold node reads from
disk (12-23 ms of the restore's calling thread here, docs/benchmarks.md), so the restore makes the prefix in
Python instead. It must be byte for byte what torch.save writes, for every dtype and shape the save frames;
where it cannot be made (no storage type, an empty tensor, zip64 sizes), torch.save's own is used."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest
import torch
from conftest import read_jsonl

from resilient_slurm import Checkpointer
from resilient_slurm.checkpoint import staging
from resilient_slurm.checkpoint.staging import framing_for, tensor_prefix

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8, torch.int16,
          torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128]
SHAPES = [(), (1,), (3,), (255,), (256,), (65535,), (65536,), (1 << 24,), (1000, 1000), (1, 1, 1, 1),
          (2, 3, 4, 5, 6), (7, 1, 9), (300, 70000)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_prefix_is_what_torch_save_writes_for_every_dtype_and_shape(dtype: torch.dtype) -> None:
    for shape in SHAPES:
        made = staging._made_prefix(dtype, shape)
        assert made is not None, (dtype, shape)
        assert made == framing_for(dtype, shape).prefix, (dtype, shape)
        assert len(made) % 64 == 0  # the data starts on torch's storage alignment


def test_a_blob_framed_with_the_prefix_loads_with_torch_as_the_tensor() -> None:
    t = torch.arange(6 * 7, dtype=torch.float32).view(6, 7)
    fr = framing_for(t.dtype, tuple(t.shape))
    blob = tensor_prefix(t.dtype, tuple(t.shape)) + t.numpy().tobytes() + fr.suffix
    assert torch.equal(torch.load(io.BytesIO(blob), weights_only=True), t)


def test_what_it_does_not_cover_falls_back_to_torch_save() -> None:
    # an empty tensor (torch.save writes no data record to find), and a dtype without a storage type
    for dtype, shape in [(torch.float32, (0,)), (torch.float32, (3, 0, 4)), (torch.float8_e4m3fn, (5,)),
                         (torch.uint16, (5,))]:
        assert staging._made_prefix(dtype, shape) is None, (dtype, shape)
        assert tensor_prefix(dtype, shape) == framing_for(dtype, shape).prefix
    # a data record of 4 GiB or more: zip64 fields in its header
    assert staging._made_prefix(torch.float32, (1 << 30,)) is None
    # torch's save config without CRCs writes other descriptors
    from torch.utils.serialization import config

    config.save.compute_crc32 = False  # torch's config objects take assignment, not monkeypatch's undo
    try:
        assert staging._made_prefix(torch.float32, (4,)) is None
    finally:
        config.save.compute_crc32 = True
    assert staging._made_prefix(torch.float32, (4,)) is not None
    # a storage alignment whose padding does not fit the zip extra field's 16-bit length
    config.save.storage_alignment = 1 << 17
    try:
        assert staging._made_prefix(torch.float32, (4,)) is None
    finally:
        config.save.storage_alignment = 64


@pytest.mark.parametrize("align", [8, 100, 4096])
def test_another_storage_alignment_is_followed(align: int) -> None:
    from torch.utils.serialization import config

    config.save.storage_alignment = align
    staging._FRAMING_CACHE.clear()  # framings made under the default alignment
    try:
        for shape in [(3,), (1000, 1000)]:
            fr = framing_for(torch.float32, shape)  # torch.save under the same config
            assert staging._made_prefix(torch.float32, shape) == fr.prefix, (align, shape)
    finally:
        config.save.storage_alignment = 64
        staging._FRAMING_CACHE.clear()  # framings made under another alignment


def test_a_restore_reads_large_tensors_in_place_without_running_torch_save(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The restore's large items are checked against the prefix made in Python: torch.save is never called on
    the way (here it would raise), and the bytes still go straight into the live tensors."""
    big = {"w": torch.randn(1024, 1024), "m": torch.randn(512, 1024).to(torch.bfloat16), "b": torch.randn(7),
           "e": torch.zeros(0), "e2": torch.zeros(3, 0, dtype=torch.int64)}  # empty tensors: no prefix at all
    with Checkpointer(local_dir=str(tmp_path), run_id="framing", keep_last=1) as ck:
        ck.save(1, big)
        ck.wait()
    staging._PREFIX_CACHE.clear()
    staging._FRAMING_CACHE.clear()

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("torch.save called on a restore's path")

    monkeypatch.setattr(torch, "save", refuse)
    monkeypatch.setattr(sys.modules["torch.serialization"], "save", refuse)
    live = {"w": torch.zeros(1024, 1024), "m": torch.zeros(512, 1024, dtype=torch.bfloat16), "b": torch.zeros(7),
            "e": torch.ones(0), "e2": torch.ones(3, 0, dtype=torch.int64)}
    addresses = {k: v.data_ptr() for k, v in live.items()}
    with Checkpointer(local_dir=str(tmp_path), run_id="framing", keep_last=1) as ck:
        assert ck.restore(live) == 1
    assert all(torch.equal(live[k], big[k]) for k in big)
    assert {k: v.data_ptr() for k, v in live.items()} == addresses
    [event] = [e for e in read_jsonl(tmp_path / "framing" / "events.jsonl") if e["event"] == "restore"]
    assert event["placed_bytes"] == (1024 * 1024 * 4 + 512 * 1024 * 2), event  # both large tensors, in place
