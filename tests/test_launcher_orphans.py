"""A launcher that dies without a chance to clean up (SIGKILL, OOM) must not leave ranks running.

Ranks are started with PR_SET_PDEATHSIG=SIGTERM: when the launcher dies they get SIGTERM, which their
Checkpointer turns into an emergency checkpoint, and they exit.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
from conftest import clean_env, read_jsonl, wait_for_step


def test_sigkilled_launcher_leaves_no_ranks_and_they_save_first(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "resilient_slurm.cli", "launch", "-n", "2", "--every-steps", "5", "--",
           sys.executable, "-m", "resilient_slurm.examples.train_toy", "--steps", "400", "--workers", "1",
           "--every-steps", "5", "--step-sleep", "0.05", "--log", str(tmp_path / "log.%r.jsonl")]
    env = clean_env({"RSLURM_LOCAL_DIR": str(tmp_path / "nvme"), "RSLURM_RUN_ID": "toy"})
    with open(tmp_path / "launcher.err", "wb") as err:
        launcher = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    try:
        wait_for_step(tmp_path / "log.0.jsonl", 7, timeout=120)
        wait_for_step(tmp_path / "log.1.jsonl", 7, timeout=30)
        pids = [e["pid"] for r in (0, 1) for e in read_jsonl(tmp_path / f"log.{r}.jsonl") if e.get("event") == "start"]
        procs = [psutil.Process(p) for p in pids]
        procs += [c for p in procs for c in p.children(recursive=True)]  # DataLoader workers
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=30)
        gone, alive = psutil.wait_procs(procs, timeout=60)
        assert not alive, f"ranks or their workers outlived the launcher: {alive}"
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for p in psutil.process_iter():
            try:
                if any(str(tmp_path) in a for a in p.cmdline()):
                    p.kill()
            except psutil.Error:
                pass
    exits = [e for e in read_jsonl(tmp_path / "log.0.jsonl") if e.get("event") == "exit"]
    assert exits and exits[0]["stopped"] is True, exits
    newest = sorted((tmp_path / "nvme" / "toy").glob("step_*"))[-1]
    manifest = json.loads((newest / "manifest.json").read_text())
    assert manifest["reason"] == "emergency" and manifest["step"] == exits[0]["step"], manifest
