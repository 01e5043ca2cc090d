"""A cloud termination notice drives the launcher down the same path as a signal.

`rslurm launch -n 2` polls an AWS-style metadata endpoint (a real HTTP server on loopback): 404 while
the instance is safe, then 200 with a spot ``instance-action``. The ranks must commit an emergency
checkpoint, the launcher exits 75 with the outcome ``cloud_termination``, and the announced time
bounds the deadline.
"""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from conftest import clean_env, read_jsonl, wait_for_step
from test_cloud_notice import MetadataServer, Seen

pytestmark = pytest.mark.proc  # every test here starts processes (tests/check_tier.py)

SPOT = "/latest/meta-data/spot/instance-action"


def test_spot_notice_triggers_emergency_save_and_restartable_exit(tmp_path: Path) -> None:
    announced = datetime.now(timezone.utc) + timedelta(seconds=120)

    def behaviour(server: MetadataServer, req: Seen) -> tuple[int, str]:
        if req.method == "PUT":  # IMDSv2 token
            return 200, "token"
        if not server.release.is_set():
            return 404, "Not Found"
        return 200, json.dumps({"action": "terminate", "time": announced.strftime("%Y-%m-%dT%H:%M:%SZ")})

    server = MetadataServer(behaviour).start()
    try:
        cmd = [sys.executable, "-m", "resilient_slurm.cli", "launch", "-n", "2",
               "--cloud-notice", "aws", "--cloud-notice-url", server.url(SPOT), "--cloud-notice-interval", "0.2",
               "--", sys.executable, "-m", "resilient_slurm.examples.train_toy", "--steps", "400",
               "--every-steps", "5", "--workers", "0", "--step-sleep", "0.05", "--log", str(tmp_path / "log.%r.jsonl")]
        env = clean_env({"RSLURM_LOCAL_DIR": str(tmp_path / "nvme"), "RSLURM_RUN_ID": "toy"})
        with open(tmp_path / "launcher.err", "wb") as err:
            proc = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=err,
                                    start_new_session=True)
            try:
                wait_for_step(tmp_path / "log.0.jsonl", 6, timeout=120)
                assert len(server.gets()) >= 1, "the launcher never polled the metadata endpoint"
                server.release.set()
                rc = proc.wait(timeout=120)
            finally:
                if proc.poll() is None:
                    proc.kill()
        text = (tmp_path / "launcher.err").read_text(errors="replace")
        assert rc == 75, text[-3000:]
        events = [e for e in read_jsonl(tmp_path / "nvme" / "toy" / "events.jsonl") if e["source"] == "launcher"]
        sig = [e for e in events if e["event"] == "signal"]
        req = [e for e in events if e["event"] == "save_requested"]
        assert sig and sig[0]["signal"] == "cloud", events
        assert req and req[0]["reason"] == "cloud_termination", events
        # The announced time (minus requeue_margin) bounds the deadline, well before save_timeout (300 s).
        assert req[0]["deadline"] <= announced.timestamp() - 3 + 1, (req, announced)
        assert any(e["event"] == "committed" for e in events), events
        exits = [e for e in read_jsonl(tmp_path / "log.0.jsonl") if e.get("event") == "exit"]
        assert exits and exits[0]["stopped"] is True and exits[0]["step"] < 400, exits
        step_dirs = sorted((tmp_path / "nvme" / "toy").glob("step_*"))
        manifest = json.loads((step_dirs[-1] / "manifest.json").read_text())
        assert manifest["reason"] == "emergency" and manifest["step"] == exits[0]["step"], manifest
    finally:
        server.stop()
