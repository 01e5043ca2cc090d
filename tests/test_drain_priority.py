"""Emergency checkpoints jump the drain queue, even in the middle of another step's transfer.

The daemon runs in this process against a POSIX tier whose rate limiter blocks the first transfer
until the test has committed an emergency step (an injected ``sleep``: no wall-clock assumption). The
interval step's transfer must then pause (its temp file removed, nothing published), the emergency
step must become durable first, and the interval step after it. The same with S3, where the paused
multipart upload is resumed and its verified parts are not sent again.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import s3_support
import torch

from resilient_slurm import Checkpointer
from resilient_slurm.checkpoint.policy import RetentionPolicy
from resilient_slurm.daemon import Daemon, drain
from resilient_slurm.storage import RateLimiter, open_tier

moto_server = s3_support.moto_server
RUN = "prio"


class Gate:
    """A rate limiter ``sleep`` that holds the first transfer until ``open()``."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.opened = threading.Event()

    def sleep(self, _: float) -> None:
        self.entered.set()
        assert self.opened.wait(60), "the test never opened the gate"

    def open(self) -> None:
        self.opened.set()


def _save(local: Path, step: int, mib: int, reason: str, seed: int) -> None:
    torch.manual_seed(seed)
    state: dict[str, Any] = {"w": torch.randn(mib << 18)}  # float32: mib MiB
    with Checkpointer(local_dir=str(local), run_id=RUN, keep_last=5) as ck:
        ck.save(step, state, reason=reason)


@pytest.fixture(params=["posix", "s3"])
def tier_url(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, Any], Any]:
    """(url, open_tier options, moto server or None)."""
    if request.param == "posix":
        return str(tmp_path / "durable"), {}, None
    server = request.getfixturevalue("moto_server")
    return f"s3://{server.new_bucket()}/ckpt", {"endpoint_url": server.endpoint, "part_size": 5 << 20}, server


def test_an_emergency_step_pauses_a_running_drain(tmp_path: Path, tier_url: tuple[str, dict[str, Any], Any],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(drain, "YIELD_CHECK_S", 0.0)
    local = tmp_path / "nvme"
    _save(local, 10, 48, "interval", 0)
    gate = Gate()
    url, options, server = tier_url
    tier = open_tier(url, threads=2, limiter=RateLimiter(1.0, burst=1.0, sleep=gate.sleep), **options)
    daemon = Daemon(str(local), tier, node="n1", retention=RetentionPolicy(5), min_free="0%")
    rc: list[int] = []
    t = threading.Thread(target=lambda: rc.append(daemon.run(once=True, install_signals=False)))
    t.start()
    try:
        assert gate.entered.wait(60), "the interval step's transfer never started"
        _save(local, 11, 1, "emergency", 1)  # committed while step 10 is in flight
    finally:
        gate.open()
        t.join(120)
    tier.close()
    assert rc == [0]
    order = [(r.step, r.state) for r in daemon.drained]
    assert order[0] == (10, "preempted"), order
    durable = [s for s, state in order if state == "durable"]
    assert durable == [11, 10], order
    check = open_tier(url, **options)
    try:
        assert check.stat(f"{RUN}/step_000000000011/manifest.json") is not None
        assert check.stat(f"{RUN}/step_000000000010/manifest.json") is not None
        leftovers = [o.key for o in check.list(RUN) if ".tmp-rslurm-" in o.key]
        assert not leftovers, leftovers
    finally:
        check.close()
    if server is not None:
        assert not server.uploads(url[5:].split("/")[0]), "a paused upload was left behind"
        ten = [r for r in daemon.drained if r.step == 10 and r.state == "durable"][0]
        assert ten.bytes_reused > 0, "the paused upload's verified parts were sent again"


def test_an_emergency_step_waiting_for_its_retry_does_not_hold_the_others_in_a_loop(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """An emergency step whose drain failed (a full or read-only tier) waits for its retry; the other steps were
    paused for it again and again meanwhile: the daemon spun on a core and logged two lines a millisecond. They
    take their turn instead, and the emergency step is drained at its retry once the tier takes it."""
    import logging
    import time

    from resilient_slurm.errors import TransientStorageError

    local = tmp_path / "nvme"
    _save(local, 10, 1, "interval", 0)
    _save(local, 11, 1, "emergency", 1)
    _save(local, 12, 1, "interval", 2)
    tier = open_tier(str(tmp_path / "durable"))
    refuse = threading.Event()
    refuse.set()
    put_file = tier.put_file

    def refusing(src: str, key: str, **kw: Any) -> Any:
        if refuse.is_set() and "step_000000000011" in key:
            raise TransientStorageError(f"{key}: no space left on device (the test's tier)")
        return put_file(src, key, **kw)

    tier.put_file = refusing  # type: ignore[method-assign]
    daemon = Daemon(str(local), tier, node="n1", retention=RetentionPolicy(5), min_free="0%", poll_interval=0.05)
    rc: list[int] = []
    t = threading.Thread(target=lambda: rc.append(daemon.run(install_signals=False)))
    caplog.set_level(logging.INFO, logger="resilient_slurm")
    t.start()
    try:
        deadline = time.monotonic() + 60
        while not {(r.step, r.state) for r in daemon.drained} >= {(10, "durable"), (12, "durable")}:
            assert time.monotonic() < deadline, [(r.step, r.state) for r in daemon.drained]
            time.sleep(0.05)
        pauses = sum("pausing it for emergency step 11" in r.getMessage() for r in caplog.records)
        assert pauses <= 4, f"the interval steps were paused {pauses} times for a step waiting for its retry"
        refuse.clear()  # the tier takes the emergency step at its retry
        while (11, "durable") not in {(r.step, r.state) for r in daemon.drained}:
            assert time.monotonic() < deadline + 60, [(r.step, r.state) for r in daemon.drained]
            time.sleep(0.05)
    finally:
        daemon.stop_requested.set()
        t.join(60)
        tier.close()
    assert len(rc) == 1, "the daemon did not stop"


def test_once_with_a_failing_emergency_step_tries_it_once_and_ends(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """``--once`` (a job's epilog after a preemption): the emergency step's one try fails (a read-only tier).
    It is not tried again in that run, the other steps are not paused for it, and the run ends, exit 1. It
    used to pause them again and again (tens of thousands of log lines and events) and retry the emergency
    step on its backoff, never ending."""
    import logging

    from resilient_slurm.errors import TransientStorageError

    local = tmp_path / "nvme"
    _save(local, 10, 1, "interval", 0)
    _save(local, 11, 1, "emergency", 1)
    _save(local, 12, 1, "interval", 2)
    tier = open_tier(str(tmp_path / "durable"))
    put_file = tier.put_file
    tries: list[str] = []

    def refusing(src: str, key: str, **kw: Any) -> Any:
        if "step_000000000011" in key:
            tries.append(key)
            raise TransientStorageError(f"{key}: read-only file system (the test's tier)")
        return put_file(src, key, **kw)

    tier.put_file = refusing  # type: ignore[method-assign]
    daemon = Daemon(str(local), tier, node="n1", retention=RetentionPolicy(5), min_free="0%", poll_interval=0.05)
    caplog.set_level(logging.INFO, logger="resilient_slurm")
    rc: list[int] = []
    t = threading.Thread(target=lambda: rc.append(daemon.run(once=True, install_signals=False)), daemon=True)
    t.start()
    t.join(120)
    if t.is_alive():
        daemon.stop_requested.set()
        t.join(30)
        pytest.fail(f"--once did not end: {len(tries)} tries of the emergency step, "
                    f"{sum('pausing it' in r.getMessage() for r in caplog.records)} pauses")
    assert rc == [1]
    assert {(r.step, r.state) for r in daemon.drained} >= {(10, "durable"), (12, "durable")}
    assert len({k for k in tries}) == len(tries), f"the emergency step was tried again: {tries}"
    pauses = sum("pausing it for emergency step 11" in r.getMessage() for r in caplog.records)
    assert pauses <= 2, pauses
    said = [r.getMessage() for r in caplog.records if "step 11 failed" in r.getMessage()]
    assert len(said) == 1 and "not retried (--once)" in said[0], said
