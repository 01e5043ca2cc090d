"""Compressed shards on the durable tier (resilient_slurm.storage.encoding), on every tier kind.

A shard of trained-like floating-point state is stored compressed (smaller than the file) and read back
bitwise, whole and by items across frames, on a POSIX directory, on S3 (moto over real HTTP on loopback)
and on S3 through a proxy that injects 503s and connection resets; a file that does not compress is
stored as it is; a compressed object damaged anywhere (a frame, the index, the footer, a truncation) is
refused with its key named; a local file that does not match its manifest checksum publishes nothing; a
frame that claims more bytes than it may hold is refused before it is decoded.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import s3_support
import torch
import xxhash
import zstandard
from s3_support import FaultProxy, MotoServer

from resilient_slurm.errors import CorruptCheckpointError, ObjectNotFoundError, StorageError
from resilient_slurm.storage import encoding
from resilient_slurm.storage.encoding import (
    FRAME,
    decode_frame,
    get_shard,
    get_shard_ranges,
    holds,
    is_compressed,
    put_shard,
    read_layout,
)
from resilient_slurm.storage.posix import PosixTier
from resilient_slurm.storage.registry import compression_for
from resilient_slurm.storage.s3 import S3Tier
from resilient_slurm.storage.tier import Span, StorageTier

moto_server = s3_support.moto_server
fault_proxy = s3_support.fault_proxy

PART = 5 << 20
PREFIX = "ckpt/run"
FAST_RETRY = {"backoff": 0.01, "max_backoff": 0.05, "connect_timeout": 2}
KEY = "run/step_000000000010/__0_0.distcp"


def trained_like(n_bytes: int, seed: int = 0) -> bytes:
    """Bytes like a shard of trained state: fp32 weights of small magnitude, bf16 weights, Adam's second
    moments (tiny positive numbers), and 3 bytes of framing at the end (not a whole element)."""
    g = torch.Generator().manual_seed(seed)
    quarter = n_bytes // 4 // 3 + 1
    w32 = (torch.randn(quarter, generator=g) * 0.02).numpy().tobytes()
    w16 = (torch.randn(quarter, generator=g) * 0.02).to(torch.bfloat16).view(torch.int16).numpy().tobytes()
    v = (torch.rand(quarter, generator=g) * 1e-6).numpy().tobytes()
    body = w32 + w16 + v
    body = (body * (n_bytes // len(body) + 1))[:n_bytes - 3]
    return body + b"\x01\x02\x03"


def xxh(data: bytes) -> str:
    return xxhash.xxh3_64(data).hexdigest()


@pytest.fixture(params=["posix", "s3", "s3-faulty"])
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StorageTier]:
    t: StorageTier
    if request.param == "posix":
        t = PosixTier(str(tmp_path / "durable"), piece_size=PART)
    else:
        server: MotoServer = request.getfixturevalue("moto_server")
        bucket = server.new_bucket()
        endpoint = server.endpoint
        if request.param == "s3-faulty":
            proxy: FaultProxy = request.getfixturevalue("fault_proxy")
            proxy.trickle()
            endpoint = proxy.endpoint
        t = S3Tier(f"{bucket}/{PREFIX}", endpoint_url=endpoint, part_size=PART, threads=4, **FAST_RETRY)
        t._test_server = server  # type: ignore[attr-defined]  # to damage objects behind the tier's back
    t.compression = "zstd"
    yield t
    t.close()


def stored_bytes(t: StorageTier, key: str) -> bytes:
    info = t.stat(key)
    assert info is not None
    with t.open_ranges(key, info.size) as read:
        return read(0, info.size)


def replace_object(t: StorageTier, key: str, data: bytes) -> None:
    """Put ``data`` at ``key`` behind the tier's back (a damaged object), keeping nothing of the old one."""
    if isinstance(t, PosixTier):
        path = Path(t.root) / key
        path.write_bytes(data)
        return
    assert isinstance(t, S3Tier)
    t._test_server.client().put_object(Bucket=t.bucket, Key=f"{PREFIX}/{key}", Body=data)  # type: ignore[attr-defined]


def put(t: StorageTier, tmp_path: Path, data: bytes, key: str = KEY) -> int:
    src = tmp_path / "local" / "shard"
    src.parent.mkdir(parents=True, exist_ok=True)
    src.write_bytes(data)
    st = put_shard(t, str(src), key, size=len(data), checksum=xxh(data), scratch=str(tmp_path / "scratch"))
    assert not (tmp_path / "scratch").exists() or not os.listdir(tmp_path / "scratch"), "scratch left behind"
    return st.bytes


# ------------------------------------------------------------------------------------------ every tier
def test_a_trained_like_shard_is_stored_smaller_and_read_back_bitwise(tier: StorageTier, tmp_path: Path) -> None:
    data = trained_like(3 * FRAME + 12345)
    sent = put(tier, tmp_path, data)
    info = tier.stat(KEY)
    assert info is not None and info.size == sent < 0.95 * len(data)
    assert is_compressed(tier, KEY, len(data))
    assert holds(tier, KEY, size=len(data), checksum=xxh(data))
    assert not holds(tier, KEY, size=len(data), checksum=xxh(data + b"x")[:16])
    out = tmp_path / "out"
    st = get_shard(tier, KEY, str(out), size=len(data), checksum=xxh(data))
    assert out.read_bytes() == data
    assert st.bytes == info.size  # the stored bytes crossed the wire, not the file's


def test_items_across_frames_are_read_from_a_compressed_shard(tier: StorageTier, tmp_path: Path) -> None:
    data = trained_like(3 * FRAME + 999, seed=1)
    put(tier, tmp_path, data)
    rng = random.Random(0)
    spans = [Span(0, 10, ""), Span(FRAME - 5, 10, ""), Span(2 * FRAME + 7, FRAME // 3, ""),
             Span(len(data) - 4, 4, "")]
    spans += [Span(o, 100, "") for o in sorted(rng.sample(range(11, FRAME - 200), 3))]
    spans = sorted((Span(s.offset, s.length, xxh(data[s.offset:s.end])) for s in spans), key=lambda s: s.offset)
    dest = tmp_path / "partial"
    get_shard_ranges(tier, KEY, str(dest), size=len(data), spans=spans)
    got = dest.read_bytes()
    assert len(got) == len(data)
    for s in spans:
        assert got[s.offset:s.end] == data[s.offset:s.end]
    bad = [Span(spans[0].offset, spans[0].length, "0" * 16)]
    with pytest.raises(CorruptCheckpointError, match="do not match their checksum"):
        get_shard_ranges(tier, KEY, str(tmp_path / "partial2"), size=len(data), spans=bad)
    assert not (tmp_path / "partial2").exists()


def test_a_file_that_does_not_compress_is_stored_as_it_is(tier: StorageTier, tmp_path: Path) -> None:
    data = random.Random(3).randbytes(FRAME + 77)
    assert put(tier, tmp_path, data) == len(data)
    info = tier.stat(KEY)
    assert info is not None and info.size == len(data) and info.checksum == xxh(data)
    assert not is_compressed(tier, KEY, len(data))
    get_shard(tier, KEY, str(tmp_path / "out"), size=len(data), checksum=xxh(data))
    assert (tmp_path / "out").read_bytes() == data


@pytest.mark.parametrize("damage", ["frame", "index", "footer", "truncated", "appended"])
def test_a_damaged_compressed_object_is_refused_naming_it(tier: StorageTier, tmp_path: Path, damage: str) -> None:
    data = trained_like(2 * FRAME + 5, seed=2)
    put(tier, tmp_path, data)
    blob = bytearray(stored_bytes(tier, KEY))
    with tier.open_ranges(KEY, len(blob)) as read:
        layout = read_layout(read, len(blob), KEY, len(data))
    assert layout is not None
    if damage == "frame":
        blob[layout.offsets[1] + (layout.offsets[2] - layout.offsets[1]) // 2] ^= 0x40
    elif damage == "index":
        blob[layout.offsets[-1] + 1] ^= 0x01
    elif damage == "footer":
        blob[-20] ^= 0x01
    elif damage == "truncated":
        del blob[len(blob) // 2:]
    else:
        blob += b"\0" * 100
    replace_object(tier, KEY, bytes(blob))
    with pytest.raises(CorruptCheckpointError, match=KEY.split("/")[-1]):
        get_shard(tier, KEY, str(tmp_path / "out"), size=len(data), checksum=xxh(data))
    assert not (tmp_path / "out").exists()
    assert not holds(tier, KEY, size=len(data), checksum=xxh(data)) or damage == "frame"
    if damage == "frame":  # the frame's items are refused too; the others are still readable
        with pytest.raises(CorruptCheckpointError, match=KEY.split("/")[-1]):
            get_shard_ranges(tier, KEY, str(tmp_path / "p"), size=len(data),
                             spans=[Span(FRAME + 1, 10, xxh(data[FRAME + 1:FRAME + 11]))])


def test_a_local_file_that_does_not_match_its_manifest_publishes_nothing(tier: StorageTier, tmp_path: Path) -> None:
    data = trained_like(FRAME + 5, seed=4)
    src = tmp_path / "shard"
    src.write_bytes(data)
    with pytest.raises(CorruptCheckpointError, match="does not match"):
        put_shard(tier, str(src), KEY, size=len(data), checksum=xxh(data[:-1] + b"\xff"),
                  scratch=str(tmp_path / "scratch"))
    assert tier.stat(KEY) is None
    assert not (tmp_path / "scratch").exists() or not os.listdir(tmp_path / "scratch")
    with pytest.raises(ObjectNotFoundError):
        get_shard(tier, KEY, str(tmp_path / "out"), size=len(data), checksum=xxh(data))


# ------------------------------------------------------------------------------------------ the codec
@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [0, 1, 7, 8, 4099])
def test_grouping_round_trips(k: int, n: int) -> None:
    data = random.Random(n * 10 + k).randbytes(n)
    blob, mode = encoding.encode_frame(data, k)
    assert decode_frame(blob, mode, n, "x") == data


def test_a_frame_that_claims_more_bytes_is_refused_before_it_is_decoded() -> None:
    bomb = zstandard.ZstdCompressor(write_checksum=True).compress(b"\0" * (64 << 20))
    assert len(bomb) < 64 << 10
    with pytest.raises(CorruptCheckpointError, match="holds 67108864 bytes, not 4096"):
        decode_frame(bomb, 1, 4096, "obj")
    with pytest.raises(CorruptCheckpointError, match="cannot be decoded"):
        decode_frame(b"garbage" * 10, 2, 70, "obj")


def test_compression_is_off_unless_asked_and_auto_means_s3(tmp_path: Path) -> None:
    data = trained_like(FRAME, seed=5)
    with PosixTier(str(tmp_path / "d")) as t:
        assert t.compression == "off"
        assert put(t, tmp_path, data) == len(data)
        assert not is_compressed(t, KEY, len(data))
    assert compression_for("auto", "s3") == "zstd" and compression_for("auto", "file") == "off"
    assert compression_for("off", "s3") == "off" and compression_for("zstd", "file") == "zstd"


def test_a_full_scratch_disk_uploads_the_file_as_it_is(tmp_path: Path) -> None:
    data = trained_like(FRAME, seed=6)
    (tmp_path / "scratch").write_text("a file where the scratch directory goes")
    with PosixTier(str(tmp_path / "d")) as t:
        t.compression = "zstd"
        src = tmp_path / "shard"
        src.write_bytes(data)
        st = put_shard(t, str(src), KEY, size=len(data), checksum=xxh(data), scratch=str(tmp_path / "scratch"))
        assert st.bytes == len(data) and not is_compressed(t, KEY, len(data))


# ------------------------------------------------------------------------------------------ a real step
def test_a_compressed_durable_step_restores_bitwise_into_an_empty_node_and_verify_names_damage(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine saves a step, the drain stores it compressed on a POSIX tier (``show`` tells the bytes it
    takes there), a node with an empty local tier restores it bitwise; a flipped byte in a compressed shard
    is named by verify."""
    from resilient_slurm import Checkpointer
    from resilient_slurm.checkpoint.verify import verify_durable_step
    from resilient_slurm.daemon.drain import StepDrainer, scan_local

    def state(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(3):
            model(torch.randn(8, 256)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        return model, opt

    model, opt = state(0)
    with Checkpointer(local_dir=str(tmp_path / "a"), run_id="r") as ck:
        ck.save(5, {"model": model, "optim": opt}, blocking=True)
    (step,) = scan_local(str(tmp_path / "a"), ["r"])
    with PosixTier(str(tmp_path / "durable")) as tier:
        tier.compression = "zstd"
        res = StepDrainer(tier).drain(step)
        assert res.state == "durable" and 0 < res.bytes_sent < 0.95 * step.local_bytes, res
        shards = step.manifest.shards_of_node(step.domain)
        assert any(is_compressed(tier, f"r/step_{5:012d}/{s.path}", s.size) for s in shards)
        assert not verify_durable_step(tier, "r", 5).faults
        assert not os.listdir(tmp_path / "a" / ".rslurm") or not [
            n for n in os.listdir(tmp_path / "a" / ".rslurm") if n.startswith("encode-")], "scratch left behind"

    # `rslurm show` tells the bytes each shard takes on the durable tier (one listing) beside the file's size.
    from resilient_slurm.cli import main as rslurm_main

    stored = {s.path: os.path.getsize(tmp_path / "durable" / "r" / f"step_{5:012d}" / s.path) for s in shards}
    for tier_name, expect in (("durable", stored), ("local", {s.path: s.size for s in shards})):
        capsys.readouterr()
        assert rslurm_main(["show", "5", "--local-dir", str(tmp_path / "a"), "--durable", str(tmp_path / "durable"),
                            "--run-id", "r", "--tier", tier_name, "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert {s["path"]: s["stored_bytes"] for s in doc["shards"]} == expect, tier_name
        assert doc["stored_bytes"] == sum(expect.values()) and doc["bytes"] == sum(s.size for s in shards)
    assert sum(stored.values()) < 0.95 * sum(s.size for s in shards)
    capsys.readouterr()
    assert rslurm_main(["show", "5", "--local-dir", str(tmp_path / "a"), "--durable", str(tmp_path / "durable"),
                        "--run-id", "r", "--tier", "durable"]) == 0
    text = capsys.readouterr().out
    assert "STORED" in text and f"{sum(stored.values()) / sum(s.size for s in shards):.2f} of it" in text, text
    # A walk that cannot read the step's directory lists nothing; the shards are then asked for by name, and a
    # tier that cannot say becomes a note (not `-`, which means "not there").
    with monkeypatch.context() as mp:
        mp.setattr(PosixTier, "list", lambda self, prefix: iter(()))
        mp.setattr(PosixTier, "stat", lambda self, key: (_ for _ in ()).throw(StorageError(f"{key}: EIO")))
        assert rslurm_main(["show", "5", "--local-dir", str(tmp_path / "a"), "--durable", str(tmp_path / "durable"),
                            "--run-id", "r", "--tier", "durable", "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["stored_bytes"] is None and any("stored sizes not listed" in n for n in doc["notes"]), doc["notes"]
    # A local shard that is a link is not a file rslurm reads: `-`, not the link's own size.
    link = tmp_path / "a" / "r" / f"step_{5:012d}" / shards[0].path
    os.rename(link, tmp_path / "moved")
    os.symlink(tmp_path / "moved", link)
    assert rslurm_main(["show", "5", "--local-dir", str(tmp_path / "a"), "--run-id", "r", "--tier", "local",
                        "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {s["path"]: s["stored_bytes"] for s in doc["shards"]}[shards[0].path] is None and doc["stored_bytes"] is None
    os.unlink(link)
    os.rename(tmp_path / "moved", link)

    fresh, fresh_opt = state(1)
    with Checkpointer(local_dir=str(tmp_path / "b"), run_id="r", durable=str(tmp_path / "durable")) as ck:
        assert ck.restore({"model": fresh, "optim": fresh_opt}) == 5
    for a, b in zip(list(model.state_dict().values()) + [v for s in opt.state.values() for v in s.values()],
                    list(fresh.state_dict().values()) + [v for s in fresh_opt.state.values() for v in s.values()]):
        assert torch.equal(a, b) and a.dtype == b.dtype

    big = max(shards, key=lambda s: s.size)
    path = tmp_path / "durable" / "r" / f"step_{5:012d}" / big.path
    sound = path.read_bytes()
    blob = bytearray(sound)
    blob[len(blob) // 3] ^= 0x10
    path.write_bytes(bytes(blob))
    with PosixTier(str(tmp_path / "durable")) as tier:
        faults = verify_durable_step(tier, "r", 5).faults
    assert [f.where for f in faults] == [f"{tmp_path / 'durable'}/r/step_{5:012d}/{big.path}"], faults
    assert faults[0].kind == "corrupt"

    # A damaged footer or frame index: verify and export said the object was truncated (it was then read as
    # the file as it is); they name the damage, as restore does.
    layout = read_layout(lambda at, n: sound[at:at + n], len(sound), big.path, big.size)
    assert layout is not None
    for where, said in ((len(sound) - 20, "footer is damaged"), (layout.offsets[-1] + 1, "index is damaged")):
        damaged = bytearray(sound)
        damaged[where] ^= 0x01
        path.write_bytes(bytes(damaged))
        with PosixTier(str(tmp_path / "durable")) as tier:
            assert is_compressed(tier, f"r/step_{5:012d}/{big.path}", big.size)
            rep = verify_durable_step(tier, "r", 5)
        faults = rep.faults
        assert len(faults) == 1 and said in faults[0].problem and "truncated" not in faults[0].problem, faults
        assert rep.files_checked == len(step.manifest.shards)  # the damaged file is counted as checked
        assert str(faults[0]).count(big.path) == 1, faults  # the object named once, not twice
        capsys.readouterr()
        assert rslurm_main(["export", "5", str(tmp_path / "out.pt"), "--format", "torch", "--durable",
                            str(tmp_path / "durable"), "--local-dir", str(tmp_path / "c"), "--run-id", "r",
                            "--tier", "durable"]) == 1
        err = capsys.readouterr().err
        assert said in err and "truncated" not in err, err


def test_a_drain_told_to_yield_stops_while_it_compresses_and_leaves_nothing(tmp_path: Path) -> None:
    from resilient_slurm.daemon.drain import DrainPreempted

    data = trained_like(4 * FRAME, seed=7)
    src = tmp_path / "shard"
    src.write_bytes(data)
    calls = []

    def progress(n: int) -> None:
        calls.append(n)
        if len(calls) == 2:
            raise DrainPreempted()

    with PosixTier(str(tmp_path / "d")) as t:
        t.compression = "zstd"
        with pytest.raises(DrainPreempted):
            put_shard(t, str(src), KEY, size=len(data), checksum=xxh(data), scratch=str(tmp_path / "scratch"),
                      progress=progress)
        assert t.stat(KEY) is None and calls == [0, 0]
    assert not os.listdir(tmp_path / "scratch")


@pytest.mark.parametrize("case", ["tiny frames", "other size", "index past the start"])
def test_a_forged_footer_is_refused_before_its_index_is_read(tmp_path: Path, case: str) -> None:
    """A footer with valid checksums that asks for a huge index, or names another file, is refused from the
    footer alone: a damaged or hostile object cannot make a reader allocate more than the file is worth."""
    size = 10 << 20
    frame, n, said = {"tiny frames": (16, -(-size // 16), size), "other size": (FRAME, 3, size + 1),
                      "index past the start": (FRAME, 3, size)}[case]
    body = b"\0" * (100 if case != "index past the start" else 5)
    obj = body + encoding._footer(said, frame, n, "0" * 16, b"")
    reads: list[tuple[int, int]] = []

    def read(offset: int, k: int) -> bytes:
        reads.append((offset, k))
        return obj[offset:offset + k]

    with pytest.raises(CorruptCheckpointError, match="obj"):
        read_layout(read, len(obj), "obj", size)
    assert reads == [(len(obj) - encoding.FOOTER.size, encoding.FOOTER.size)]


def test_decodes_of_many_files_share_a_small_budget_without_waiting_on_each_other(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Eight files decoded at once (as a fetch does) with room for two batches in the whole process, each
    batch one frame: every file arrives bitwise, and a file that fails gives its share back."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setattr(encoding, "_DECODE_BUDGET", threading.BoundedSemaphore(2))
    monkeypatch.setattr(encoding, "READ_BATCH", 1)
    datas = [trained_like(3 * FRAME + i, seed=10 + i) for i in range(8)]
    with PosixTier(str(tmp_path / "d")) as t:
        t.compression = "zstd"
        for i, d in enumerate(datas):
            put(t, tmp_path, d, key=f"f{i}")
        bad = bytearray(stored_bytes(t, "f7"))
        bad[100] ^= 1
        replace_object(t, "f7", bytes(bad))

        def one(i: int) -> bool:
            try:
                get_shard(t, f"f{i}", str(tmp_path / f"o{i}"), size=len(datas[i]), checksum=xxh(datas[i]))
            except CorruptCheckpointError:
                return False
            return (tmp_path / f"o{i}").read_bytes() == datas[i]

        with ThreadPoolExecutor(8) as ex:
            got = list(ex.map(one, range(8)))
    assert got == [True] * 7 + [False]
    assert encoding._DECODE_BUDGET.acquire(blocking=False) and encoding._DECODE_BUDGET.acquire(blocking=False)


def test_progress_of_a_compressed_upload_counts_the_files_raw_bytes(tmp_path: Path) -> None:
    data = trained_like(3 * FRAME + 1, seed=8)
    src = tmp_path / "shard"
    src.write_bytes(data)
    told: list[int] = []
    with PosixTier(str(tmp_path / "d"), piece_size=1 << 20) as t:
        t.compression = "zstd"
        st = put_shard(t, str(src), KEY, size=len(data), checksum=xxh(data), scratch=str(tmp_path / "s"),
                       progress=told.append)
    assert st.bytes < len(data) and sum(told) == len(data) and all(n >= 0 for n in told) and len(told) > 3


# ------------------------------------------------------------------------------------------ after an attack
def test_a_link_where_a_scratch_directory_goes_is_never_followed(tmp_path: Path) -> None:
    """A link named like a daemon's scratch directory (to a directory of someone's files) is left alone by
    the clean-up, and a drain that finds one there uploads the shard as it is instead of writing through it."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "model.pt").write_bytes(b"precious")
    (tmp_path / "encode-1").symlink_to(victim)
    encoding.remove_scratch(str(tmp_path / "encode-1"))
    assert (victim / "model.pt").read_bytes() == b"precious" and (tmp_path / "encode-1").is_symlink()
    data = trained_like(FRAME, seed=9)
    src = tmp_path / "shard"
    src.write_bytes(data)
    with PosixTier(str(tmp_path / "d")) as t:
        t.compression = "zstd"
        st = put_shard(t, str(src), KEY, size=len(data), checksum=xxh(data), scratch=str(tmp_path / "encode-1"))
    assert st.bytes == len(data) and os.listdir(victim) == ["model.pt"]


@pytest.mark.parametrize("kind", ["fifo", "link"])
def test_a_local_shard_that_is_not_a_regular_file_is_refused_when_compressing(tmp_path: Path, kind: str) -> None:
    from resilient_slurm.errors import UnsafePathError

    real = tmp_path / "real"
    real.write_bytes(trained_like(FRAME, seed=3))
    src = tmp_path / "shard"
    if kind == "fifo":
        os.mkfifo(src)
    else:
        src.symlink_to(real)
    with PosixTier(str(tmp_path / "d")) as t:
        t.compression = "zstd"
        with pytest.raises(UnsafePathError, match="shard"):
            put_shard(t, str(src), KEY, size=FRAME, checksum="0" * 16, scratch=str(tmp_path / "s"))
        assert t.stat(KEY) is None


def test_a_stale_copy_in_the_scratch_directory_leaks_nothing(tmp_path: Path) -> None:
    data = trained_like(FRAME, seed=4)
    src = tmp_path / "shard"
    src.write_bytes(data)
    scratch = tmp_path / "s"
    with PosixTier(str(tmp_path / "d")) as t:
        t.compression = "zstd"
        before = len(os.listdir("/proc/self/fd"))
        for _ in range(5):
            scratch.mkdir(exist_ok=True)
            import threading

            (scratch / f"shard.{os.getpid()}.{threading.get_ident()}").write_bytes(b"left by a killed daemon")
            st = put_shard(t, str(src), KEY, size=len(data), checksum=xxh(data), scratch=str(scratch))
            assert st.bytes < len(data)
        assert len(os.listdir("/proc/self/fd")) == before


def test_zeros_decode_in_batches_of_bounded_raw_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A shard that compresses to almost nothing is not decoded whole: each batch holds at most READ_BATCH
    of decoded bytes."""
    data = b"\0" * (10 * FRAME)
    with PosixTier(str(tmp_path / "d")) as t:
        t.compression = "zstd"
        put(t, tmp_path, data)
        assert t.stat(KEY).size < FRAME // 100  # type: ignore[union-attr]
        monkeypatch.setattr(encoding, "READ_BATCH", 2 * FRAME)
        decoded: list[int] = []
        real = encoding._frame_of
        monkeypatch.setattr(encoding, "_frame_of", lambda *a: decoded.append(a[-1]) or real(*a))
        got: list[int] = []
        real_fetch_reads = t.open_ranges

        @__import__("contextlib").contextmanager
        def spy(key: str, size: int):  # type: ignore[no-untyped-def]
            with real_fetch_reads(key, size) as read:
                yield lambda o, n: (got.append(n), read(o, n))[1]

        monkeypatch.setattr(t, "open_ranges", spy)
        get_shard(t, KEY, str(tmp_path / "out"), size=len(data), checksum=xxh(data))
    assert (tmp_path / "out").read_bytes() == data and sorted(decoded) == list(range(10))
    assert len(got) >= 5 + 2  # footer, index, then at least 5 batches of at most 2 frames


def test_a_padded_object_is_refused(tmp_path: Path) -> None:
    """An object no smaller than the file it encodes, or a frame no smaller than its bytes, was not written by
    rslurm: refused, so no reader fetches or holds more than the file is worth."""
    data = trained_like(2 * FRAME, seed=5)
    with PosixTier(str(tmp_path / "d")) as t:
        t.compression = "zstd"
        put(t, tmp_path, data)
        blob = stored_bytes(t, KEY)
        with t.open_ranges(KEY, len(blob)) as read:
            lay = read_layout(read, len(blob), KEY, len(data))
        assert lay is not None
        first = blob[:lay.offsets[1]] + b"\0" * (FRAME + 10)  # frame 0 padded past its raw size
        index = encoding.INDEX_ENTRY.pack(lay.offsets[1] + FRAME + 10, lay.modes[0]) + \
            encoding.INDEX_ENTRY.pack(lay.offsets[2] - lay.offsets[1], lay.modes[1])
        forged = first + blob[lay.offsets[1]:lay.offsets[2]] + index + encoding._footer(len(data), FRAME, 2, xxh(data),
                                                                                        index)
        replace_object(t, KEY, forged)
        with pytest.raises(CorruptCheckpointError, match=KEY.split("/")[-1]):
            get_shard(t, KEY, str(tmp_path / "out"), size=len(data), checksum=xxh(data))


def test_the_sample_covers_the_end_of_a_small_file(tmp_path: Path) -> None:
    """Random bytes then zeros (the compressible part at the end) are compressed, as zeros then random are."""
    rnd = random.Random(1).randbytes(2 * FRAME)
    for data in (rnd + b"\0" * (2 * FRAME), b"\0" * (2 * FRAME) + rnd):
        with PosixTier(str(tmp_path / "d")) as t:
            t.compression = "zstd"
            assert put(t, tmp_path, data) < 0.6 * len(data)


def test_an_object_replaced_between_its_stat_and_its_read_is_named_as_such(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = trained_like(2 * FRAME, seed=6)
    with PosixTier(str(tmp_path / "d")) as t:
        t.compression = "zstd"
        put(t, tmp_path, data)
        old = t.stat(KEY)
        shorter = stored_bytes(t, KEY)[:-1]
        real_stat = t.stat

        def stale_then_replaced(key: str):  # type: ignore[no-untyped-def]
            info = real_stat(key)
            replace_object(t, KEY, shorter)  # replaced after it was measured
            monkeypatch.setattr(t, "stat", real_stat)
            return info

        monkeypatch.setattr(t, "stat", stale_then_replaced)
        with pytest.raises(CorruptCheckpointError, match=f"changed while it was read \\(it was {old.size} bytes"):  # type: ignore[union-attr]
            get_shard(t, KEY, str(tmp_path / "out"), size=len(data), checksum=xxh(data))


def test_a_starting_daemon_removes_every_scratch_directory_but_never_through_a_link(tmp_path: Path) -> None:
    state = tmp_path / ".rslurm"
    (state / "encode-123").mkdir(parents=True)
    (state / "encode-123" / "shard.123.1").write_bytes(b"left by a killed daemon")
    (state / f"encode-{os.getpid()}").mkdir()  # a daemon before this one had this pid (a container)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "model.pt").write_bytes(b"precious")
    (state / "encode-99").symlink_to(victim)
    (state / "daemon.json").write_text("{}")
    encoding.remove_stale_scratch(str(state))
    assert sorted(os.listdir(state)) == ["daemon.json", "encode-99"]
    assert (victim / "model.pt").read_bytes() == b"precious"
