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
