"""A job never silently starts over from step 0 when checkpoints exist but cannot be restored.

* The durable tier cannot be listed (an S3 endpoint nobody answers on, real HTTP on loopback) and the
  local tier is empty: restore raises RestoreUnavailableError naming the endpoint on every rank, and
  ``rslurm launch`` requeues the job (the rank's exit reads as a storage failure, not a user error).
* A durable step exists but the fetch fails for a storage reason (the local disk is a real 8 MiB tmpfs,
  too small: root only, CI runs as root): RestoreUnavailableError naming the step.
* Every committed step is corrupt: CorruptCheckpointError naming the steps (a person must look).
* ``restore_fallback="fresh"`` (``RSLURM_RESTORE_FALLBACK``) starts from step 0 with a warning instead.
* A first run (nothing anywhere, durable tier reachable) still starts from step 0 without a word.
"""

from __future__ import annotations

import json
import logging
import socket
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import mounted_tmpfs

from resilient_slurm import Checkpointer
from resilient_slurm.errors import CorruptCheckpointError, RestoreUnavailableError

RUN = "fallback"
MiB = 1 << 20

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="tmpfs as on Linux")


def dead_endpoint() -> str:
    """A loopback port with nothing listening (bound, then closed: connections are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def fresh() -> dict[str, Any]:
    return {"w": torch.zeros(4 * MiB // 4), "step": 0}


def save(root: Path, steps: list[int], **kw: Any) -> None:
    with Checkpointer(local_dir=str(root), run_id=RUN, keep_last=10, **kw) as ck:
        for s in steps:
            ck.save(s, {"w": torch.full((4 * MiB // 4,), float(s)), "step": s})


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RSLURM_NODE_NAME", "n1")
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(k, "testing")
    monkeypatch.setenv("RSLURM_S3_MAX_ATTEMPTS", "1")


def test_an_unlistable_durable_tier_stops_the_restore(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RSLURM_S3_ENDPOINT_URL", dead_endpoint())
    kw = {"durable": "s3://bucket/ckpt"}
    with Checkpointer(local_dir=str(tmp_path / "nvme"), run_id=RUN, **kw) as ck:
        with pytest.raises(RestoreUnavailableError, match="cannot list s3://bucket/ckpt") as err:
            ck.restore(fresh())
    assert "restore_fallback=fresh" in str(err.value) and "step 0" in str(err.value)
    events = [json.loads(ln) for ln in (tmp_path / "nvme" / RUN / "events.jsonl").read_text().splitlines()]
    failed = [e for e in events if e["event"] == "restore_failed"]
    assert len(failed) == 1 and failed[0]["retry"] is True and "cannot list" in failed[0]["error"], events
    caplog.set_level(logging.WARNING, logger="resilient_slurm")
    st = fresh()
    with Checkpointer(local_dir=str(tmp_path / "nvme"), run_id=RUN, restore_fallback="fresh", **kw) as ck:
        assert ck.restore(st) == 0
    assert "restore_fallback=fresh" in caplog.text and st["step"] == 0


def test_local_steps_restore_even_when_the_durable_tier_is_down(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    save(tmp_path / "nvme", [1, 2])
    st = fresh()
    monkeypatch.setenv("RSLURM_S3_ENDPOINT_URL", dead_endpoint())
    with Checkpointer(local_dir=str(tmp_path / "nvme"), run_id=RUN, durable="s3://bucket/ckpt") as ck:
        assert ck.restore(st) == 2
    assert st["step"] == 2


@pytest.mark.proc
def test_a_fetch_that_fails_for_lack_of_space_stops_the_restore(tmp_path: Path) -> None:
    import subprocess

    from conftest import clean_env

    local, dur = tmp_path / "nvme", tmp_path / "lustre"
    save(local, [1], durable=str(dur))
    r = subprocess.run([sys.executable, "-m", "resilient_slurm.cli", "daemon", "--once", "--local-dir", str(local),
                        "--durable", str(dur)], env=clean_env({"RSLURM_NODE_NAME": "n1", "RSLURM_RUN_ID": RUN}),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    with mounted_tmpfs(tmp_path / "tiny", "2m") as tiny:
        with Checkpointer(local_dir=str(tiny), run_id=RUN, durable=str(dur)) as ck:
            with pytest.raises(RestoreUnavailableError, match="step 1") as err:
                ck.restore(fresh())
        assert "filled up" in str(err.value) or "free" in str(err.value), err.value


def test_every_step_corrupt_stops_the_restore_naming_them(tmp_path: Path) -> None:
    save(tmp_path / "nvme", [1, 2])
    for s in (1, 2):
        shard = next((tmp_path / "nvme" / RUN / f"step_{s:012d}").glob("*.distcp"))
        with open(shard, "r+b") as f:
            f.truncate(100)
    with Checkpointer(local_dir=str(tmp_path / "nvme"), run_id=RUN) as ck:
        with pytest.raises(CorruptCheckpointError, match=r"committed steps \[1, 2\]") as err:
            ck.restore(fresh())
    assert "rslurm verify" in str(err.value)


def test_a_first_run_starts_from_step_0(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="resilient_slurm")
    with Checkpointer(local_dir=str(tmp_path / "nvme"), run_id=RUN, durable=str(tmp_path / "lustre")) as ck:
        assert ck.restore(fresh()) == 0
    assert not caplog.records


RANK = """
import torch
from resilient_slurm import Checkpointer
with Checkpointer() as ck:
    print("restored", ck.restore({"w": torch.zeros(4)}), flush=True)
"""


@pytest.mark.proc
@pytest.mark.parametrize("fallback, code", [("fail", 75), ("fresh", 0)])
def test_rslurm_launch_runs_a_job_again_when_storage_kept_it_from_restoring(tmp_path: Path, fallback: str,
                                                                             code: int) -> None:
    import subprocess
    import tempfile

    from conftest import clean_env

    ctl = tempfile.mkdtemp(prefix="rsl-", dir="/tmp")  # a short control socket path
    env = clean_env({"RSLURM_LOCAL_DIR": str(tmp_path / "nvme"), "RSLURM_RUN_ID": RUN, "RSLURM_CONTROL_DIR": ctl,
                     "RSLURM_DURABLE": "s3://bucket/ckpt", "RSLURM_S3_ENDPOINT_URL": dead_endpoint(),
                     "RSLURM_S3_MAX_ATTEMPTS": "1", "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                     "RSLURM_RESTORE_FALLBACK": fallback})
    r = subprocess.run([sys.executable, "-m", "resilient_slurm.cli", "launch", "-n", "1", "--", sys.executable, "-c",
                        RANK], env=env, capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL)
    assert r.returncode == code, r.stderr[-3000:]
    if fallback == "fail":
        assert "RestoreUnavailableError" in r.stderr and "storage_unavailable" in r.stderr, r.stderr[-3000:]
        assert "not requeued" not in r.stderr
    else:
        assert "restored 0" in r.stdout
