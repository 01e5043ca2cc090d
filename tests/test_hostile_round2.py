"""Hostile inputs and transient faults, round 2 (issue 26): each case against the real entry point (the CLI
as a subprocess, the daemon as a process, ranks under ``rslurm launch -n N``), as an attacker or a new user
would try it. What every case gets: a clear message naming the file, id or key; exit 1 or 2 as
docs/cli.md says; nothing outside its tree touched; every committed step intact.

1. ``export --force`` into the tree it reads from (a run, the root, a shard, tags.json, a parent of the
   root, the durable tier): refused, nothing changed.
2. Run ids ``../esc``, absolute paths, ``.``, ``a/b``, control characters, and bad step names: ``launch``
   exits 2 before anything is written; every command and the daemon refuse them.
3. A ``metrics/`` directory or a run directory that is a link: never written through.
4. The POSIX durable tier read-only for a moment: the daemon retries with a growing delay and drains
   by itself once it is back; a launcher stops waiting as soon as the daemon gives up on a step.
5. A damaged history (nested, times of 1e308) never changes the launcher's exit code (75 stays 75), and
   ``history`` names the file.
6. ``RSLURM_CONFIG`` naming a FIFO, ``/dev/zero`` or a huge file: refused at once.
7. One writer per run: a second launcher or rank set is refused naming the holder; a stale holder is
   taken over; two launchers of one Slurm job share the run.
8. Untag of a tag stamped far ahead; ``gc`` on a temp directory that is committed meanwhile.
9. Control characters in a manifest's command line and a history's evidence: harmless in human output,
   exact in JSON.
10. ``file://`` and relative durable URLs: refused.
11. A program whose step counter went back after a restore: refused naming both steps; nothing committed
    replaced.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import REPO, clean_env, read_jsonl, run_rslurm

from resilient_slurm import Checkpointer
from resilient_slurm.manifest import step_dirname

pytestmark = pytest.mark.proc  # every test here starts processes (tests/check_tier.py)

RUN = "r1"
WORKER = str(REPO / "tests" / "workers" / "counter_worker.py")
ESC = "\x1b]0;pwned\x07\x1b[2J\x1b[31m"  # set the title, clear the screen, red


def rslurm_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "resilient_slurm.cli", *args]


def rslurm(*args: str, env: Mapping[str, str] | None = None, timeout: float = 120,
           traceback_ok: bool = False) -> subprocess.CompletedProcess[str]:
    """``rslurm ARGS`` on node n1 (``traceback_ok``: a rank's traceback, relayed by the launcher)."""
    return run_rslurm(*args, env={"RSLURM_NODE_NAME": "n1", **(env or {})}, timeout=timeout,
                      traceback_ok=traceback_ok)


def launch_argv(root: Path, *cmd: str, n: int = 2) -> list[str]:
    return rslurm_argv("launch", "-n", str(n), "--local-dir", str(root), "--", *cmd)


def launch(root: Path, *cmd: str, n: int = 2, env: Mapping[str, str] | None = None, timeout: float = 240,
           traceback_ok: bool = False) -> subprocess.CompletedProcess[str]:
    """``rslurm launch -n N --local-dir ROOT -- CMD`` in local mode."""
    return rslurm(*launch_argv(root, *cmd, n=n)[3:], env={"RSLURM_RUN_ID": RUN, **(env or {})}, timeout=timeout,
                  traceback_ok=traceback_ok)


def wait_for(what: str, check: Callable[[], Any], timeout: float, log: Path | None = None) -> Any:
    """Poll ``check`` until it returns something true (returned) or fail after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = check()
        if got:
            return got
        time.sleep(0.2)
    tail = log.read_text(errors="replace")[-4000:] if log is not None and log.exists() else ""
    pytest.fail(f"{what}: not within {timeout:.0f} s\n{tail}")


def tree(root: Path) -> dict[str, str]:
    """Every entry under ``root`` (links not followed) and a digest of each file's bytes; a launcher's own
    health probes (``.health-*``, written and removed while it runs) left out."""
    out: dict[str, str] = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            if name.startswith(".health-"):
                continue
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = f"link to {os.readlink(p)}"
            elif p.is_file():
                out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
            else:
                out[rel] = "dir"
    return out


def save_steps(root: Path, steps: list[int], run: str = RUN, **tags: int) -> None:
    """Steps of ``run`` saved by one Checkpointer in this process; ``tags``: name=step."""
    with Checkpointer(local_dir=str(root), run_id=run, keep_last=10) as ck:
        for s in steps:
            ck.save(s, {"w": torch.full((256,), float(s)), "step": s})
        for name, step in tags.items():
            ck.tag(step, name)


@pytest.fixture
def r1(tmp_path: Path) -> Path:
    """A local root with run r1: steps 2, 4, 6, step 4 tagged ``best``."""
    root = tmp_path / "root"
    save_steps(root, [2, 4, 6], best=4)
    return root


# ------------------------------------------------------------------------------- 1. exports
def test_1_export_never_writes_into_a_tier_or_a_run(r1: Path, tmp_path: Path) -> None:
    durable = tmp_path / "durable"
    durable.mkdir()
    before = tree(tmp_path)
    shard = next((r1 / RUN / step_dirname(4)).glob("__*.distcp"))
    outs = [r1 / RUN, r1, shard, r1 / RUN / "tags.json", tmp_path, durable, durable / RUN]
    for i, out in enumerate(outs):
        force = ["--force"] if i else []
        r = rslurm("export", "6", str(out), "--format", "dcp", *force, "--local-dir", str(r1), "--durable",
                   str(durable), "--run-id", RUN)
        assert r.returncode == 2, (out, r.stdout, r.stderr)
        assert f"OUT {out}" in r.stderr and "never" in r.stderr, r.stderr
    assert tree(tmp_path) == before, "an export wrote into a tier or a run"
    # A torch file next to the root (not inside) is fine.
    r = rslurm("export", "best", str(tmp_path / "best.pt"), "--format", "torch", "--local-dir", str(r1),
               "--run-id", RUN)
    assert r.returncode == 0, r.stderr
    assert torch.load(tmp_path / "best.pt", weights_only=True)["_rslurm_step"] == 4


# ------------------------------------------------------------------------------- 2. identifiers
def test_2_bad_run_ids_and_steps_are_refused_before_anything_is_written(tmp_path: Path) -> None:
    root = tmp_path / "a" / "root"
    for rid in ("../esc", str(tmp_path / "abs"), f"x{ESC}"):
        r = launch(root, sys.executable, "-c", "pass", env={"RSLURM_RUN_ID": rid})
        assert r.returncode == 2, (rid, r.stderr)
        assert "run id" in r.stderr and ESC not in r.stderr, r.stderr
    assert not list(tmp_path.rglob("*")), f"written before the id was refused: {list(tmp_path.rglob('*'))}"
    save_steps(root, [1])
    commands = (["ls"], ["runs"], ["gc", "--dry-run"], ["verify"], ["show"], ["history"], ["status"],
                ["tag", "1", "x"], ["daemon", "--once", "--durable", str(tmp_path / "d")], ["export", "1",
                str(tmp_path / "o.pt"), "--format", "torch"])
    for i, cmd in enumerate(commands):
        rid = ("..", ".", "a/b")[i % 3]
        r = rslurm(*cmd, "--local-dir", str(root), "--run-id", rid)
        assert r.returncode == 2 and "a run id holds letters" in r.stderr, (cmd, rid, r.stdout, r.stderr)
    for step in ("../1", "1e3", "99999999999999", "\u0663"):  # an Arabic-Indic three is no step
        r = rslurm("show", step, "--local-dir", str(root), "--run-id", RUN)
        assert r.returncode == 2, (step, r.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"], "a command wrote outside the root"


# ------------------------------------------------------------------------------- 3. links below the root
def test_3_a_linked_metrics_or_run_directory_is_never_written_through(tmp_path: Path) -> None:
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "rank0.jsonl").write_text("precious\n")
    (root / RUN).mkdir(parents=True)
    (root / RUN / "metrics").symlink_to(elsewhere)
    r = launch(root, sys.executable, WORKER, "--steps", "4")
    assert r.returncode == 0, r.stderr[-3000:]
    assert tree(elsewhere) == {"rank0.jsonl": hashlib.sha256(b"precious\n").hexdigest()}, "written through the link"
    assert str(root / RUN / "metrics") in r.stderr and "not a real directory" in r.stderr, r.stderr[-3000:]
    assert (root / RUN / step_dirname(4) / "manifest.json").is_file()  # metrics are not worth a run

    linked = tmp_path / "linked-run"
    linked.mkdir()
    (root / "r2").symlink_to(linked)
    r = launch(root, sys.executable, WORKER, "--steps", "2", env={"RSLURM_RUN_ID": "r2"})
    assert r.returncode == 2, r.stderr[-3000:]
    assert str(root / "r2") in r.stderr and "not a real directory" in r.stderr, r.stderr
    assert not list(linked.iterdir()), "the launcher wrote through a linked run directory"


# ------------------------------------------------------------------------------- 4. transient faults
@contextmanager
def read_only_for_a_while(path: Path) -> Iterator[Callable[[bool], None]]:
    """``path`` bind-mounted on itself, so it can be remounted read-only and back (as a Lustre client that
    loses its server for a moment); root only (CI runs the suite as root)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to remount a directory read-only (CI runs these tests as root)")
    r = subprocess.run(["mount", "--bind", str(path), str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot bind-mount here (root, but: {r.stderr.strip()})")

    def read_only(ro: bool) -> None:
        subprocess.run(["mount", "-o", f"remount,{'ro' if ro else 'rw'},bind", str(path)], check=True)

    try:
        yield read_only
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_4_a_durable_tier_outage_is_retried_until_it_drains_by_itself(tmp_path: Path) -> None:
    local, dur, log = tmp_path / "nvme", tmp_path / "lustre", tmp_path / "daemon.log"
    prom = tmp_path / "metrics.prom"
    dur.mkdir()
    with read_only_for_a_while(dur) as read_only:
        read_only(True)
        save_steps(local, [1, 2])
        with open(log, "wb") as f:
            daemon = subprocess.Popen(rslurm_argv("daemon", "--local-dir", str(local), "--durable", str(dur),
                                                  "--drain-poll-interval", "1", "--metrics-textfile", str(prom)),
                                      env=clean_env({"RSLURM_NODE_NAME": "n1", "RSLURM_LOCAL_MIN_FREE": "1M"}),
                                      stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            events = local / RUN / "events.jsonl"
            retries = wait_for("a drain_retry event", lambda: [e for e in read_jsonl(events)
                                                               if e["event"] == "drain_retry"], 120, log)
            assert "Read-only file system" in retries[0]["error"] and str(dur) in retries[0]["error"], retries
            assert retries[0]["attempt"] == 1 and retries[0]["retry_in_s"] > 0, retries
            read_only(False)
            back = time.monotonic()
            wait_for("steps 1 and 2 durable", lambda: all((dur / RUN / step_dirname(s) / "manifest.json").is_file()
                                                           for s in (1, 2)), 60, log)
            took = time.monotonic() - back
            print(f"durable {took:.1f} s after the tier came back; drain_retry delays: "
                  f"{[round(e['retry_in_s'], 1) for e in read_jsonl(events) if e['event'] == 'drain_retry']}")
            assert daemon.poll() is None, "the daemon must keep running through an outage"
            status = json.loads(rslurm("status", "--json", "--local-dir", str(local), "--durable", str(dur)).stdout)
            assert {r["step"]: r["durable"] for r in status["steps"]} == {1: "durable", 2: "durable"}, status
            text = wait_for("the metrics textfile", lambda: prom.exists() and prom.read_text(), 10)
            counted = [ln for ln in text.splitlines() if ln.startswith("rslurm_drain_step_retries_total{")]
            assert counted and float(counted[0].split()[-1]) >= 1, text
        finally:
            daemon.send_signal(signal.SIGINT)
            daemon.wait(timeout=60)
    assert daemon.returncode == 0, log.read_text()[-3000:]
    assert "Traceback" not in log.read_text()


def test_4_the_launcher_stops_waiting_once_the_daemon_gives_up(tmp_path: Path) -> None:
    root, dur, elsewhere = tmp_path / "root", tmp_path / "durable", tmp_path / "elsewhere"
    (dur / RUN).mkdir(parents=True)
    elsewhere.mkdir()
    (dur / RUN / step_dirname(4)).symlink_to(elsewhere)  # the newest step can never be drained
    r = launch(root, sys.executable, WORKER, "--steps", "4", n=1, timeout=300,
               env={"RSLURM_DURABLE": str(dur), "RSLURM_DURABLE_WAIT": "900"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "gave up on step 4" in r.stderr and str(dur / RUN / step_dirname(4)) in r.stderr, r.stderr[-3000:]
    waited = [e for e in read_jsonl(root / RUN / "events.jsonl") if e["event"] == "not_durable"]
    assert waited and waited[0]["step"] == 4 and waited[0]["waited_s"] < 300, waited
    assert not list(elsewhere.iterdir()), "the daemon wrote through a link in the durable tier"
    assert (dur / RUN / step_dirname(2) / "manifest.json").is_file()  # the others drain


# ------------------------------------------------------------------------------- 5. damaged history
NESTED = b"[" * 100_000 + b"]" * 100_000


def test_5_a_damaged_history_never_turns_a_requeue_into_a_failure(tmp_path: Path) -> None:
    root = tmp_path / "root"
    hist = root / RUN / "launcher-history.json"
    hist.parent.mkdir(parents=True)
    hist.write_bytes(NESTED)
    log = tmp_path / "launch.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(launch_argv(root, sys.executable, WORKER, "--steps", "100000", "--every", "1000",
                                            "--sleep", "0.05", n=1),
                                env=clean_env({"RSLURM_NODE_NAME": "n1", "RSLURM_RUN_ID": RUN}), stdout=f,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        metrics = root / RUN / "metrics" / "rank0.jsonl"
        wait_for("the rank's first steps", lambda: metrics.exists() and metrics.read_text().count("\n") >= 3, 120, log)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    out = log.read_text(errors="replace")
    assert proc.returncode == 75, out[-3000:]  # requeue me: the emergency step is committed
    assert str(hist) in out and "nested too deeply" in out and "Traceback" not in out, out[-3000:]
    for damaged, why in ((NESTED, "nested too deeply"),
                         (json.dumps({"version": 2, "incarnations": [
                             {"restart_count": 0, "reason": "preempted", "restored_step": None, "committed_step": 2,
                              "ended_at": 1e308}]}).encode(), "ended_at")):
        hist.write_bytes(damaged)
        r = rslurm("history", "--local-dir", str(root), "--run-id", RUN)
        assert r.returncode == 1 and str(hist) in r.stdout + r.stderr and why in r.stdout + r.stderr, (r.stdout, r.stderr)
        r = rslurm("status", "--local-dir", str(root), "--run-id", RUN)
        assert r.returncode == 0 and "Traceback" not in r.stdout, r.stdout


# ------------------------------------------------------------------------------- 6. config files
def test_6_a_config_file_that_is_a_fifo_a_device_or_huge_is_refused_at_once(tmp_path: Path) -> None:
    fifo, huge = tmp_path / "fifo.toml", tmp_path / "huge.toml"
    os.mkfifo(fifo)
    with open(huge, "wb") as f:
        f.truncate(300 << 20)
    for path, why in ((fifo, "FIFO"), (Path("/dev/zero"), "character device"), (huge, "more than")):
        r = rslurm("ls", "--local-dir", str(tmp_path / "root"), env={"RSLURM_CONFIG": str(path)}, timeout=60)
        assert r.returncode == 2 and str(path) in r.stderr and why in r.stderr, (path, r.stderr)


# ------------------------------------------------------------------------------- 7. one writer per run
def test_7_a_second_launcher_or_rank_set_is_refused_naming_the_holder(tmp_path: Path) -> None:
    from resilient_slurm.layout import RunInUseError

    root = tmp_path / "root"
    lock = root / ".rslurm" / f"run-{RUN}.lock"
    log = tmp_path / "holder.log"
    with open(log, "wb") as f:
        holder = subprocess.Popen(launch_argv(root, sys.executable, "-c", "import time; time.sleep(300)", n=1),
                                  env=clean_env({"RSLURM_RUN_ID": RUN}), stdout=f, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for("the first launcher's claim", lambda: lock.exists() and f'"pid": {holder.pid}' in lock.read_text(),
                 60, log)
        # ... and its own first writes after the claim (its start event), which a loaded machine may delay.
        events = root / RUN / "events.jsonl"
        wait_for("the first launcher's start event",
                 lambda: events.exists() and f"local-{holder.pid}." in events.read_text(), 60, log)
        before = tree(root)
        r = launch(root, sys.executable, "-c", "pass", n=1)
        assert r.returncode == 2, r.stderr
        assert f"in use by a local run on host {socket.gethostname()} (pid {holder.pid})" in r.stderr, r.stderr
        assert tree(root) == before, "the second launcher changed the first one's run"
        with pytest.raises(RunInUseError, match=rf"\(pid {holder.pid}\)"):
            Checkpointer(local_dir=str(root), run_id=RUN)  # a rank set without a launcher
    finally:
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait()
    # The holder was killed: its record stays, its lock does not. The next launcher takes over, saying so.
    r = launch(root, sys.executable, "-c", "pass", n=1)
    assert r.returncode == 0 and f"taking it over from a local run on host {socket.gethostname()} (pid {holder.pid})" \
        in r.stderr, r.stderr


def test_7_the_lock_is_per_run_per_slurm_job(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from resilient_slurm.layout import RunInUseError, RunWriter, claim_run

    root = str(tmp_path / "root")
    code = ("import sys, time\nfrom resilient_slurm.layout import RunWriter, claim_run\n"
            "c = claim_run(sys.argv[1], 'r1', RunWriter.this_process('111'))\nprint('held', flush=True)\n"
            "time.sleep(300)\n")
    other = subprocess.Popen([sys.executable, "-c", code, root], env=clean_env(), stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout is not None and other.stdout.readline().strip() == "held"
        same_job = claim_run(root, RUN, RunWriter.this_process("111"))  # another node's launcher of job 111
        assert not same_job.held
        with pytest.raises(RunInUseError, match=rf"Slurm job 111 on host .* \(pid {other.pid}\)"):
            claim_run(root, RUN, RunWriter.this_process("222"))
        with caplog.at_level("WARNING", logger="resilient_slurm"):
            taken = claim_run(root, RUN, RunWriter.this_process("222"), job_ended=lambda job: job == "111")
        assert taken.held and "that job has ended" in caplog.text
        taken.release()
    finally:
        other.kill()
        other.wait()


# ------------------------------------------------------------------------------- 8. wrong reports
def test_8_untag_and_gc_report_what_they_did(r1: Path) -> None:
    tags = r1 / RUN / "tags.json"
    doc = json.loads(tags.read_text())
    doc["tags"]["best"]["at"] = 253402300000.0  # the last year a date can show
    tags.write_text(json.dumps(doc))
    r = rslurm("untag", "4", "best", "--local-dir", str(r1), "--run-id", RUN)
    assert r.returncode == 0, r.stderr
    ls = json.loads(rslurm("ls", "--json", "--local-dir", str(r1), "--run-id", RUN).stdout)
    assert {s["step"]: s["tags"] for s in ls["steps"]} == {2: [], 4: [], 6: []}, ls
    doc = json.loads(tags.read_text())
    doc["tags"]["v2"] = {"step": 2, "at": 1e300}  # no date at all
    tags.write_text(json.dumps(doc))
    r = rslurm("untag", "2", "v2", "--local-dir", str(r1), "--run-id", RUN)
    assert r.returncode == 1 and str(tags) in r.stderr and "not a time" in r.stderr, (r.stdout, r.stderr)
    assert json.loads(tags.read_text()) == doc, "a tags file that cannot be read is never overwritten"

    tags.unlink()  # fixed by moving it away, as the message says
    temp = r1 / RUN / f"{step_dirname(8)}.tmp-abcd1234-1"  # a save in progress that commits meanwhile
    temp.mkdir()
    (temp / "__0_0.distcp").write_bytes(b"x")
    r = rslurm("gc", "--local-dir", str(r1), "--run-id", RUN, env={"RSLURM_FAILPOINTS": "gc_before_age=unlink"})
    assert r.returncode == 0 and "nothing to delete" in r.stdout, (r.stdout, r.stderr)


# ------------------------------------------------------------------------------- 9. terminal escapes
def test_9_control_characters_from_disk_are_harmless_in_human_output(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "root"
    for step in (1, 2):
        monkeypatch.setattr(sys, "argv", ["train.py", f"--name={ESC}{step}"])
        save_steps(root, [step])
    history = {"version": 2, "incarnations": [{"restart_count": 0, "reason": "preempted", "restored_step": None,
                                               "committed_step": 2, "ended_at": time.time(),
                                               "evidence": f"{ESC}every rank exited 0"}]}
    (root / RUN / "launcher-history.json").write_text(json.dumps(history))
    for cmd in (["show", "1"], ["diff", "1", "2"], ["history"], ["status"], ["ls"]):
        r = rslurm(*cmd, "--local-dir", str(root), "--run-id", RUN)
        out = r.stdout + r.stderr
        assert r.returncode in (0, 1) and "\x1b" not in out and "\x07" not in out, (cmd, out)
        if cmd[0] != "ls":
            assert "\\x1b" in out or "\\u001b" in out, (cmd, out)  # shown, as an escape
    doc = json.loads(rslurm("show", "1", "--json", "--local-dir", str(root), "--run-id", RUN).stdout)
    assert doc["provenance"]["command_line"] == ["train.py", f"--name={ESC}1"]  # JSON stays exact


# ------------------------------------------------------------------------------- 10. durable URLs
def test_10_a_durable_url_must_name_an_absolute_directory(tmp_path: Path) -> None:
    root = tmp_path / "root"
    for url, why in (("file://", "names no directory"), ("relative/dir", "not an absolute path"),
                     ("file:relative", "not an absolute path")):
        r = rslurm("ls", "--local-dir", str(root), "--durable", url)
        assert r.returncode == 2 and repr(url) in r.stderr and why in r.stderr, (url, r.stderr)
    r = launch(root, sys.executable, "-c", "pass", n=1, env={"RSLURM_DURABLE": "file://"})
    assert r.returncode == 2 and "names no directory" in r.stderr, r.stderr
    assert not root.exists() and not list(Path.cwd().glob(f"{RUN}*")), "written before the URL was refused"


# ------------------------------------------------------------------------------- 11. step numbers going back
def test_11_a_step_counter_that_goes_back_is_refused_and_nothing_committed_is_replaced(tmp_path: Path) -> None:
    root = tmp_path / "root"
    r = launch(root, sys.executable, WORKER, "--steps", "6")
    assert r.returncode == 0, r.stderr[-3000:]
    committed = {s: (root / RUN / step_dirname(s) / "manifest.json").read_bytes() for s in (2, 4, 6)}
    r = launch(root, sys.executable, WORKER, "--steps", "6", "--restart-counter", traceback_ok=True)
    assert r.returncode == 1, r.stderr[-3000:]  # the program's own error: not requeued
    assert "StepOrderError: step 1 refused: run r1 resumed from step 6" in r.stderr, r.stderr[-3000:]
    assert {s: (root / RUN / step_dirname(s) / "manifest.json").read_bytes() for s in (2, 4, 6)} == committed
    assert sorted(p.name for p in (root / RUN).glob("step_*")) == [step_dirname(s) for s in (2, 4, 6)]
