"""bench/common.py's ratio interval: what the benchmarks say of a target when the machine's rounds spread.

A benchmark that prints only a ratio of medians calls a target met or missed on noise; the interval must be
tight where the rounds agree, wide where they spread, keep each round's two measurements together, and the
verdict must say when the rounds cannot tell. Those tests are pure arithmetic: nothing is started or written.
The last one runs bench_restore.py's verified-copy floor over small files in a temporary directory: a floor
that copied or hashed wrong would make every restore look better or worse than it is."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from bench_support import load_bench


@pytest.fixture(scope="module")
def common() -> ModuleType:
    return load_bench("common.py", "bench_common_under_test")


def test_rounds_that_agree_give_a_tight_interval_and_a_verdict(common: ModuleType) -> None:
    raw = [0.300, 0.301, 0.299, 0.300, 0.302, 0.300, 0.301]
    fast = [t / 0.90 for t in raw]  # a restore at 0.90 of the raw read, every round
    lo, hi = common.ratio_interval(raw, fast)
    assert 0.899 < lo <= hi < 0.901
    assert common.against_target((lo, hi), 0.85) == "met"
    slow = [t / 0.80 for t in raw]
    assert common.against_target(common.ratio_interval(raw, slow), 0.85) == "missed"


def test_rounds_that_spread_more_than_the_gap_are_not_called_either_way(common: ModuleType) -> None:
    # the numbers of a run on a noisy disk (2026-12-01): the ratio of medians is 0.85
    raw = [0.419, 0.405, 0.396, 0.419, 0.416, 0.488, 0.430]
    ours = [0.494, 0.459, 0.451, 0.514, 0.632, 0.500, 0.480]
    lo, hi = common.ratio_interval(raw, ours)
    point = common.med(raw) / common.med(ours)
    assert lo <= point <= hi
    assert lo < 0.85 < hi and hi - lo > 0.05
    assert common.against_target((lo, hi), 0.85).startswith("not told apart")


def test_a_rounds_two_measurements_stay_together(common: ModuleType) -> None:
    # the disk's speed drifts by 2x over the run, and the restore follows it at 0.9 in each round: pairs kept
    # together give 0.9 exactly; resampling each list on its own would not
    raw = [0.2 * (1 + i / 6) for i in range(7)]
    ours = [t / 0.9 for t in raw]
    lo, hi = common.ratio_interval(raw, ours, resamples=500)
    assert lo == pytest.approx(0.9) and hi == pytest.approx(0.9)


def test_too_few_rounds_say_so_and_the_same_seed_gives_the_same_interval(common: ModuleType) -> None:
    assert common.ratio_interval([0.3, 0.3], [0.33, 0.35]) is None
    assert common.against_target(None, 0.85) == "too few rounds to say"
    raw, ours = [0.30, 0.31, 0.29, 0.35, 0.30], [0.33, 0.36, 0.34, 0.40, 0.31]
    assert common.ratio_interval(raw, ours) == common.ratio_interval(raw, ours)
    assert common.ratio_interval(raw, [*ours[:2], None, *ours[3:]]) is not None  # a failed round is left out


def test_a_failed_round_of_the_restore_benchmark_keeps_the_others_paired(
        capsys: pytest.CaptureFixture[str]) -> None:
    """bench_restore.py records a round whose child failed as None, so each later round's restore is still
    divided by the raw read of its own round (a drifting disk: round 2 reads at half the speed)."""
    bench = load_bench("bench_restore.py", "bench_restore_under_test")
    times = {"raw_prefaulted": [0.30, 0.60, 0.30, 0.30], "ours": [0.33, None, 0.66 * 0.5, 0.33],
             "ours_compare": [0.33, 0.66, 0.33, 0.33]}
    bench.report_times({"bytes": 2**30, "io_threads": 4}, times, "")
    out = capsys.readouterr().out
    assert "per round, raw read / ours: 0.91 failed 0.91 0.91" in out, out
    assert "per round, raw read / ours_compare: 0.91 0.91 0.91 0.91" in out, out
    assert "ours: 0.330-0.330 s" in out and "median of 4" in out, out


def test_the_verified_copy_floor_reads_hashes_and_copies_every_byte(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """bench_restore.py's ``verified_copy`` (the restore's read loop alone: what the machine allows a restore
    that verifies and places every byte) runs the product's own read_through over whole files, and says
    whether what it copied and hashed is each file's, so a floor measured wrong is not taken for one."""
    from resilient_slurm.storage import fileio

    bench = load_bench("bench_restore.py", "bench_restore_under_test")
    files = []
    for i, n in enumerate((5 * 2**20 + 123, 4096, 1)):  # past a ring slot, one block, one byte
        p = tmp_path / f"__{i}_0.distcp"
        p.write_bytes(os.urandom(n))
        files.append(str(p))
    s, equal = bench.verified_copy(files, threads=2)
    assert s > 0 and equal is True

    real = fileio.read_through

    def lossy(path: str, size: int, items: list[tuple[int, int]], sink: Callable[..., None], **kw: Any) -> list[str]:
        def flipped(k: int, at: int, view: memoryview) -> None:
            b = bytearray(view)
            b[-1] ^= 0xFF  # one byte of each hand-over copied wrong
            sink(k, at, memoryview(b))
        return real(path, size, items, flipped, **kw)

    monkeypatch.setattr(fileio, "read_through", lossy)
    assert bench.verified_copy(files, threads=2)[1] is False
