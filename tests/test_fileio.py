"""The aligned-I/O primitives: O_DIRECT (or buffered on tmpfs) writes and reads, checksums of ranges."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from resilient_slurm.storage.fileio import (
    BLOCK,
    HostBuffer,
    aligned_buffer,
    checksum,
    read_file_into,
    round_up,
    write_file,
)

MIB = 1 << 20


@pytest.mark.parametrize("where", ["disk", "tmpfs"])
def test_segments_round_trip_with_range_checksums_across_piece_boundaries(tmp_path: Path, where: str) -> None:
    base = tmp_path if where == "disk" else Path("/dev/shm")
    path = str(base / f"rslurm-fileio-{os.getpid()}.bin")
    try:
        first_len = round_up(33 * MIB + 123)  # spans three 16 MiB pieces; block-multiple (not last)
        tail_len = 5 * MIB + 77  # odd length: padding written then truncated
        a = aligned_buffer(first_len)
        b = aligned_buffer(tail_len)
        data = os.urandom(first_len + tail_len)
        memoryview(a.numpy())[:first_len] = data[:first_len]
        memoryview(b.numpy())[:tail_len] = data[first_len:]
        ranges = [(0, 64), (16 * MIB - 10, 20), (5, 32 * MIB + 3), (first_len - 7, 7), (first_len, tail_len),
                  (first_len + tail_len - 1, 1)]
        chunk_ranges = [r for r in ranges if r[0] + r[1] <= first_len or r[0] >= first_len]
        written = write_file(path, [(memoryview(a.numpy()), first_len), (memoryview(b.numpy()), tail_len)],
                             chunk_ranges)
        assert os.path.getsize(path) == len(data) == written.size
        assert written.checksum == checksum(data)
        assert list(written.chunk_checksums) == [checksum(data[o : o + n]) for o, n in chunk_ranges]

        out = aligned_buffer(len(data), prefault=False)
        sums = read_file_into(path, memoryview(out.numpy()), len(data), ranges=ranges)
        assert bytes(memoryview(out.numpy())[: len(data)]) == data
        assert sums == [checksum(data[o : o + n]) for o, n in ranges]
    finally:
        if os.path.exists(path):
            os.unlink(path)


def test_truncated_file_is_a_short_read(tmp_path: Path) -> None:
    path = tmp_path / "short.bin"
    path.write_bytes(b"x" * (3 * BLOCK + 5))
    out = aligned_buffer(8 * BLOCK, prefault=False)
    with pytest.raises(Exception, match="short read"):
        read_file_into(str(path), memoryview(out.numpy()), 8 * BLOCK)


def test_a_host_buffer_is_one_memory_seen_as_a_view_an_address_and_on_demand_a_tensor() -> None:
    """Restore's small items are read into a HostBuffer through its memoryview and copied out by address; the
    tensor made for an item torch must parse is the same memory, not a copy."""
    import ctypes

    import torch

    buf = HostBuffer(10_000)
    assert buf.nbytes == 3 * BLOCK and len(buf.view) == buf.nbytes and buf.address % BLOCK == 0
    buf.view[5:9] = b"abcd"
    assert ctypes.string_at(buf.address + 5, 4) == b"abcd"
    t = buf.tensor()
    assert t is buf.tensor() and t.dtype == torch.uint8 and t.numel() == buf.nbytes
    assert t.data_ptr() == buf.address and bytes(t[5:9].numpy()) == b"abcd"
    t[0] = 7
    assert buf.view[0] == 7
