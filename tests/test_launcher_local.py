"""``rslurm launch -n N`` in local mode, end to end: real rank processes, real signals, gloo.

The ranks run ``resilient_slurm.examples.train_toy`` (DDP over gloo, a DataLoader with a worker process,
dropout, Adam, a schedule and a GradScaler) or small stubborn ``python -c`` programs. The launcher runs
as a subprocess in its own session, exactly as a user would start it, and gets real signals. Every
process a test starts carries a marker in its environment (inherited by ranks, DataLoader workers and
grandchildren), so "nothing survives the launcher" is checked over the whole process table.

What must hold:

* SIGTERM or one SIGINT to the launcher: the ranks commit an emergency checkpoint at the step they
  were at, exit on their own, the launcher exits 75 (SIGINT: 130); running the same command again
  resumes from that step and ends bitwise identical to a run that was never stopped.
* Two SIGINTs, or ranks that miss the deadline: their process trees are torn down, grandchildren
  included, and the launcher exits promptly.
* A rank that fails on its own is a user error (its exit code, never requeued, the traceback's
  location named); a rank killed from outside is a node failure (75) and the rerun resumes.
* ``--control-socket off``: the emergency save still happens: with no rank registered on the socket,
  the launcher forwards SIGTERM, which the ranks' Checkpointer traps.
* Bad settings are refused with exit 2 before any rank starts.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest
import torch
from conftest import REPO, assert_same, clean_env, read_jsonl

from resilient_slurm.manifest import step_dirname

pytestmark = pytest.mark.proc  # every test here starts processes (tests/check_tier.py)

TOY = [sys.executable, "-m", "resilient_slurm.examples.train_toy"]
TOY_SOURCE = REPO / "resilient_slurm" / "examples" / "train_toy.py"
MARK = "RSLTEST_LAUNCH_MARK"  # not RSLURM_*: unknown RSLURM_ variables are (rightly) refused
STEPS = 20
EVERY = 4
REQUEUE = 75
INTERRUPTED = 130
_STEP_DIR = re.compile(r"^step_(\d{12})$")

# A rank that does not stop: ignores SIGTERM, SIGINT and the save signal (whose default action would
# end it), never talks to the control socket, and has a grandchild (which inherits SIG_IGN for
# SIGTERM/SIGINT, so only SIGKILL ends it). Writes ready.<RANK> with its pid and the grandchild's.
STUBBORN = textwrap.dedent("""
    import json, os, signal, subprocess, sys, time
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2):
        signal.signal(s, signal.SIG_IGN)
    child = subprocess.Popen(["sleep", "300"])
    path = os.path.join(sys.argv[1], "ready." + os.environ.get("RANK", "0"))
    with open(path + ".tmp", "w") as f:
        json.dump({"pid": os.getpid(), "child": child.pid}, f)
    os.rename(path + ".tmp", path)
    while True:
        time.sleep(1)
""")

# A rank that starts a helper process and then fails on its own: the helper keeps the rank's stderr
# open. Writes exit.<RANK> with its pid, the helper's and when it exited.
ORPHANING = textwrap.dedent("""
    import json, os, subprocess, sys, time
    child = subprocess.Popen(["sleep", "300"])
    path = os.path.join(sys.argv[1], "exit." + os.environ.get("RANK", "0"))
    with open(path + ".tmp", "w") as f:
        json.dump({"pid": os.getpid(), "child": child.pid, "at": time.time()}, f)
    os.rename(path + ".tmp", path)
    sys.exit(3)
""")


# --------------------------------------------------------------------------- helpers
@dataclass
class Launch:
    """One ``rslurm launch`` process (own session; stderr in a file)."""

    proc: subprocess.Popen[bytes]
    err: Path

    def stderr(self) -> str:
        return self.err.read_text(errors="replace") if self.err.exists() else ""

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def wait(self, timeout: float = 120) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=10)
            pytest.fail(f"launcher did not exit within {timeout}s; stderr:\n{self.stderr()[-4000:]}")


@dataclass
class Sandbox:
    """A private checkpoint root, control-socket directory and process marker for one launcher run."""

    root: Path
    ctl: Path = field(init=False)
    mark: str = field(default_factory=lambda: uuid.uuid4().hex)
    _ctl_base: str = field(init=False)

    def __post_init__(self) -> None:
        # pytest's tmp_path can exceed the 107-byte Unix socket path limit: keep the sockets short.
        self._ctl_base = tempfile.mkdtemp(prefix="rsl-", dir="/tmp")
        self.ctl = Path(self._ctl_base) / "run"

    @property
    def nvme(self) -> Path:
        return self.root / "nvme"

    @property
    def run_dir(self) -> Path:
        return self.nvme / "toy"

    def log(self, rank: int) -> Path:
        return self.root / f"log.{rank}.jsonl"

    def out(self, rank: int) -> Path:
        return self.root / f"out.{rank}.pt"

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        return clean_env({"RSLURM_LOCAL_DIR": str(self.nvme), "RSLURM_RUN_ID": "toy",
                          "RSLURM_CONTROL_DIR": str(self.ctl), MARK: self.mark, **(extra or {})})

    def toy(self, *extra: str, sleep: float = 0.1) -> list[str]:
        return [*TOY, "--steps", str(STEPS), "--every-steps", str(EVERY), "--workers", "1",
                "--step-sleep", str(sleep), "--log", str(self.root / "log.%r.jsonl"),
                "--out", str(self.root / "out.%r.pt"), *extra]

    def stubborn(self) -> list[str]:
        return [sys.executable, "-c", STUBBORN, str(self.root)]

    def launch(self, rank_argv: list[str], *flags: str, n: int = 2, env: dict[str, str] | None = None,
               name: str = "launch") -> Launch:
        cmd = [sys.executable, "-m", "resilient_slurm.cli", "launch", *flags, "-n", str(n), "--", *rank_argv]
        err = self.root / f"{name}.{time.monotonic_ns()}.err"
        with open(err, "wb") as e, open(err.with_suffix(".out"), "wb") as o:
            proc = subprocess.Popen(cmd, env=self.env(env), cwd=self.root, stdin=subprocess.DEVNULL, stdout=o,
                                    stderr=e, start_new_session=True)
        return Launch(proc, err)

    def processes(self) -> list[psutil.Process]:
        """Live (non-zombie) processes that carry this sandbox's marker."""
        found = []
        for p in psutil.process_iter():
            if p.pid == os.getpid():
                continue
            try:
                if p.environ().get(MARK) == self.mark and p.status() != psutil.STATUS_ZOMBIE:
                    found.append(p)
            except (psutil.Error, OSError):
                continue
        return found

    def close(self) -> None:
        for p in self.processes():  # a failed test must not leave ranks behind for the next one
            try:
                p.kill()
            except psutil.Error:
                pass
        shutil.rmtree(self._ctl_base, ignore_errors=True)


@pytest.fixture
def sandbox(tmp_path: Path) -> Iterator[Sandbox]:
    sb = Sandbox(tmp_path)
    try:
        yield sb
    finally:
        sb.close()


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def describe(procs: list[psutil.Process]) -> str:
    out = []
    for p in procs:
        try:
            out.append(f"pid {p.pid} (ppid {p.ppid()}): {' '.join(p.cmdline())[:200]}")
        except psutil.Error:
            out.append(f"pid {p.pid}")
    return "; ".join(out)


def assert_nothing_survives(sb: Sandbox, launch: Launch, pids: Sequence[int] = ()) -> None:
    """Nothing the launcher started (ranks, DataLoader workers, grandchildren) outlives it. A short
    poll only covers the kernel finishing a process that was already SIGKILLed."""
    deadline = time.monotonic() + 2.0
    while True:
        left = sb.processes()
        named = [pid for pid in pids if alive(pid)]
        if not left and not named:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"processes survived the launcher: {describe(left)}; pids still alive: {named}\n"
                        f"launcher stderr:\n{launch.stderr()[-3000:]}")
        time.sleep(0.05)


def wait_for(cond: Callable[[], bool], what: str, launch: Launch, timeout: float = 90) -> None:
    """Poll ``cond()``; fail early (with the launcher's stderr) if the launcher exits first."""
    deadline = time.monotonic() + timeout
    while not cond():
        if launch.proc.poll() is not None:
            pytest.fail(f"launcher exited ({launch.proc.returncode}) before {what}:\n{launch.stderr()[-4000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}:\n{launch.stderr()[-4000:]}")
        time.sleep(0.02)


def logged_steps(log: Path) -> list[int]:
    return [e["step"] for e in read_jsonl(log) if "loss" in e] if log.exists() else []


def wait_for_steps(sb: Sandbox, launch: Launch, step: int, ranks: int = 2) -> None:
    wait_for(lambda: all(max(logged_steps(sb.log(r)), default=-1) >= step for r in range(ranks)),
             f"every rank's log to reach step {step}", launch)


def starts(log: Path) -> list[dict]:
    return [e for e in read_jsonl(log) if e.get("event") == "start"]


def rank_pids(sb: Sandbox, ranks: int = 2) -> list[int]:
    """The pids of the current run's ranks (from the last ``start`` record of each rank's log)."""
    return [starts(sb.log(r))[-1]["pid"] for r in range(ranks)]


def ranks_and_descendants(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            out += [pid, *(c.pid for c in p.children(recursive=True))]
        except psutil.NoSuchProcess:
            pass
    return out


def by_step(log: Path) -> dict[int, dict]:
    """Step -> logged record; a step re-done after a resume must repeat exactly what was logged."""
    seen: dict[int, dict] = {}
    for e in read_jsonl(log):
        if "loss" not in e:
            continue
        prev = seen.get(e["step"])
        assert prev is None or prev == e, f"{log}: step {e['step']} was re-done differently: {prev} vs {e}"
        seen[e["step"]] = e
    return seen


def newest_step(run_dir: Path) -> tuple[int, dict]:
    """The newest committed step directory (one with a manifest) and its manifest, read directly."""
    steps = sorted((int(m.group(1)), d) for d in run_dir.iterdir()
                   if (m := _STEP_DIR.match(d.name)) and (d / "manifest.json").exists())
    assert steps, f"no committed step under {run_dir}: {sorted(p.name for p in run_dir.iterdir())}"
    step, d = steps[-1]
    return step, json.loads((d / "manifest.json").read_text())


def assert_same_as_reference(sb: Sandbox, ref: Sandbox) -> None:
    for r in range(2):
        a = torch.load(ref.out(r), weights_only=True)
        b = torch.load(sb.out(r), weights_only=True)
        assert_same(a, b, f"rank{r}")
        ra, rb = by_step(ref.log(r)), by_step(sb.log(r))
        assert sorted(ra) == list(range(1, STEPS + 1))
        assert rb == ra, f"rank {r}: batches or losses differ from the uninterrupted run"


def assert_emergency_at_last_logged_step(sb: Sandbox) -> int:
    step, manifest = newest_step(sb.run_dir)
    assert manifest["reason"] == "emergency", manifest
    assert manifest["step"] == step
    assert 6 <= step < STEPS, f"the emergency step {step} is not mid-run"
    for r in range(2):
        assert max(logged_steps(sb.log(r))) == step, f"rank {r} logged steps past the emergency step {step}"
        last = read_jsonl(sb.log(r))[-1]
        # The ranks left on their own, after the save (not torn down).
        assert last == {"event": "exit", "step": step, "stopped": True}, last
    return step


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sandbox]:
    """The same launch, never interrupted."""
    ref = Sandbox(tmp_path_factory.mktemp("reference"))
    try:
        run = ref.launch(ref.toy(sleep=0.0), name="reference")
        assert run.wait(180) == 0, run.stderr()[-4000:]
        assert_nothing_survives(ref, run)
        yield ref
    finally:
        ref.close()


# --------------------------------------------------------------------------- tests
def test_sigterm_saves_at_the_current_step_exits_75_and_the_rerun_resumes_bitwise(
        sandbox: Sandbox, reference: Sandbox) -> None:
    sb = sandbox
    run = sb.launch(sb.toy())
    wait_for_steps(sb, run, 6)
    pids = ranks_and_descendants(rank_pids(sb))  # ranks and their DataLoader workers
    assert len(pids) >= 4, f"expected 2 ranks with a DataLoader worker each: {pids}"
    run.signal(signal.SIGTERM)
    rc = run.wait(60)
    assert rc == REQUEUE, f"exit code {rc}:\n{run.stderr()[-4000:]}"
    assert_nothing_survives(sb, run, pids)
    assert not list(sb.ctl.glob("*.sock")), "the launcher left its control socket behind"
    step = assert_emergency_at_last_logged_step(sb)
    assert not sb.out(0).exists()

    again = sb.launch(sb.toy())
    rc = again.wait(120)
    assert rc == 0, again.stderr()[-4000:]
    assert_nothing_survives(sb, again)
    for r in range(2):
        s = starts(sb.log(r))
        assert [e["step"] for e in s] == [0, step], f"rank {r} did not resume from the emergency step: {s}"
    assert_same_as_reference(sb, reference)


# `rslurm launch` in which the stop signal comes in its first instants: while the console script imports the
# CLI (after entry.py's early trap, as `rslurm` and `rsrun` run), or while the launcher sets up (reads its
# settings, claims the run, asks Slurm about the job), before its main loop: sent from inside Launcher.__init__.
SIGNAL_AT_START = textwrap.dedent("""
    import os, signal, sys
    when = sys.argv.pop(1)
    if when == "imports":
        from resilient_slurm import early_signals
        early_signals.trap_early()
        os.kill(os.getpid(), signal.SIGTERM)
    from resilient_slurm import cli
    from resilient_slurm.launcher import launch
    if when == "set-up":
        set_up = launch.Launcher.__init__
        def set_up_and_be_stopped(self, *args, **kwargs):
            os.kill(os.getpid(), signal.SIGTERM)
            set_up(self, *args, **kwargs)
        launch.Launcher.__init__ = set_up_and_be_stopped
    sys.exit(cli.main(sys.argv[1:]))
""")


@pytest.mark.parametrize("when", ["imports", "set-up"])
def test_a_stop_signal_in_the_launchers_first_instants_is_kept_not_fatal(sandbox: Sandbox, when: str) -> None:
    """A preemption SIGTERM or a time-limit USR1 in the launcher's first instants (Slurm may send ``--signal``
    up to a minute early, so a short job gets it at its start) is trapped from the start of ``rslurm launch``
    and acted on before the ranks start: the launcher exits 75 (requeue) with its records, instead of dying
    of the signal's default action unrecorded and not requeued (seen in CI, as a time-limit USR1). The ranks
    are not started (they would only restore and save again: docs/launcher.md); a rerun resumes."""
    sb = sandbox
    err = sb.root / "setup.err"
    cmd = [sys.executable, "-c", SIGNAL_AT_START, when, "launch", "-n", "2", "--", *sb.toy()]
    with open(err, "wb") as e:
        proc = subprocess.Popen(cmd, env=sb.env(), cwd=sb.root, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=e, start_new_session=True)
    run = Launch(proc, err)
    rc = run.wait(120)
    assert rc == REQUEUE, f"exit code {rc}:\n{run.stderr()[-4000:]}"
    assert_nothing_survives(sb, run)
    events = [e for e in read_jsonl(sb.run_dir / "events.jsonl") if e["source"] == "launcher"]
    assert [e["signal"] for e in events if e["event"] == "signal"] == ["SIGTERM"], events
    assert [e["event"] for e in events][-1] == "ranks_not_started", events
    assert not list(sb.root.glob("log.*.jsonl")), "a rank was started after the stop"
    assert "run the same command again to resume" in run.stderr()


def test_one_sigint_is_an_emergency_save_and_exit_130(sandbox: Sandbox) -> None:
    sb = sandbox
    run = sb.launch(sb.toy())
    wait_for_steps(sb, run, 6)
    pids = ranks_and_descendants(rank_pids(sb))
    run.signal(signal.SIGINT)
    rc = run.wait(60)
    assert rc == INTERRUPTED, f"exit code {rc}:\n{run.stderr()[-4000:]}"
    assert_nothing_survives(sb, run, pids)
    assert_emergency_at_last_logged_step(sb)
    assert "Traceback" not in run.stderr(), "Ctrl-C must not reach the ranks (or the launcher) as KeyboardInterrupt"


def _wait_ready(sb: Sandbox, run: Launch, ranks: int = 2) -> list[dict]:
    files = [sb.root / f"ready.{r}" for r in range(ranks)]
    wait_for(lambda: all(f.exists() for f in files), "the ranks to start", run, timeout=60)
    return [json.loads(f.read_text()) for f in files]


def test_second_sigint_tears_down_ranks_that_do_not_stop(sandbox: Sandbox) -> None:
    sb = sandbox
    run = sb.launch(sb.stubborn())
    ready = _wait_ready(sb, run)
    pids = [pid for r in ready for pid in (r["pid"], r["child"])]
    run.signal(signal.SIGINT)
    time.sleep(0.3)
    assert run.proc.poll() is None, "one SIGINT must not end the launcher while the ranks still run"
    assert all(alive(p) for p in pids)
    t0 = time.monotonic()
    run.signal(signal.SIGINT)
    rc = run.wait(30)
    elapsed = time.monotonic() - t0
    assert elapsed < 5, f"the launcher took {elapsed:.1f}s to exit after the second SIGINT"
    assert rc == INTERRUPTED, f"exit code {rc}:\n{run.stderr()[-4000:]}"
    assert_nothing_survives(sb, run, pids)


def test_ranks_that_miss_the_deadline_are_torn_down_with_their_grandchildren(sandbox: Sandbox) -> None:
    sb = sandbox
    run = sb.launch(sb.stubborn(), "--save-timeout", "2", "--term-grace", "1")
    ready = _wait_ready(sb, run)
    pids = [pid for r in ready for pid in (r["pid"], r["child"])]
    t0 = time.monotonic()
    run.signal(signal.SIGTERM)
    rc = run.wait(60)
    elapsed = time.monotonic() - t0
    assert rc == REQUEUE, f"exit code {rc}:\n{run.stderr()[-4000:]}"
    assert 1.5 <= elapsed <= 8, f"teardown {elapsed:.1f}s after SIGTERM; the save timeout was 2 s"
    assert "deadline" in run.stderr().lower()
    assert_nothing_survives(sb, run, pids)


def test_a_rank_that_fails_is_a_user_error_with_its_exit_code_and_location(sandbox: Sandbox) -> None:
    sb = sandbox
    raise_line = next(i for i, line in enumerate(TOY_SOURCE.read_text().splitlines(), 1)
                      if "raise RuntimeError(f\"deliberate failure" in line)
    run = sb.launch(sb.toy("--fail-at-step", "5", sleep=0.0))
    rc = run.wait(120)
    err = run.stderr()
    assert rc == 1, f"exit code {rc}:\n{err[-4000:]}"
    assert "not requeued" in err, err[-4000:]
    decision = [line for line in err.splitlines() if "not requeued" in line]
    assert any(f"train_toy.py:{raise_line}" in line for line in decision), (
        f"the decision does not name the failing line train_toy.py:{raise_line}: {decision}")
    assert_nothing_survives(sb, run)


def test_a_rank_killed_from_outside_is_killed_by_signal_and_the_rerun_resumes(
        sandbox: Sandbox, reference: Sandbox) -> None:
    """With in-job restarts off, the requeue path: exit 75, and running the command again resumes.
    (In-job restarts, the default, are tested in test_hang.py and test_launcher_slurm.py.)"""
    sb = sandbox
    run = sb.launch(sb.toy(), env={"RSLURM_IN_JOB_RESTARTS": "0"})
    wait_for_steps(sb, run, 6)
    wait_for(lambda: (sb.run_dir / step_dirname(EVERY) / "manifest.json").exists(),
             f"step {EVERY} to be committed", run)
    r0, r1 = rank_pids(sb)
    pids = ranks_and_descendants([r0, r1])
    os.kill(r1, signal.SIGKILL)
    rc = run.wait(90)
    err = run.stderr()
    assert rc == REQUEUE, f"exit code {rc}:\n{err[-4000:]}"
    assert not alive(r0), "rank 0 outlived the launcher"
    assert_nothing_survives(sb, run, pids)
    final = err.splitlines()[-5:]
    assert any("rank 1" in line and "killed" in line for line in final), final
    committed, manifest = newest_step(sb.run_dir)
    assert manifest["reason"] == "interval" and committed % EVERY == 0

    again = sb.launch(sb.toy())
    rc = again.wait(120)
    assert rc == 0, again.stderr()[-4000:]
    assert_nothing_survives(sb, again)
    for r in range(2):
        assert [e["step"] for e in starts(sb.log(r))] == [0, committed]
    assert_same_as_reference(sb, reference)


def test_with_the_control_socket_off_a_forwarded_sigterm_still_gives_an_emergency_save(sandbox: Sandbox) -> None:
    sb = sandbox
    run = sb.launch(sb.toy(), "--control-socket", "off")
    wait_for_steps(sb, run, 6)
    pids = ranks_and_descendants(rank_pids(sb))
    run.signal(signal.SIGTERM)
    rc = run.wait(60)
    err = run.stderr()
    assert rc == REQUEUE, f"exit code {rc}:\n{err[-4000:]}"
    assert_nothing_survives(sb, run, pids)
    assert_emergency_at_last_logged_step(sb)
    # The ranks were told to leave the socket alone: the request can only have come as a signal.
    registered = [line for line in err.splitlines() if re.search(r"rank \d+ registered", line)]
    assert not registered, f"--control-socket off, yet ranks registered on the socket: {registered}"


def test_a_manual_save_request_on_the_control_socket_saves_and_training_goes_on(sandbox: Sandbox,
                                                                               reference: Sandbox) -> None:
    """A tool's ``request_save("manual")`` (documented beside the launcher's emergency requests) was taken as an
    emergency: the ranks saved, stopped, and the launcher exited 75 as if preempted. It is a save: every rank
    commits one step as ``manual``, the request is cleared, and the run trains to its end."""
    from resilient_slurm.control.client import ControlClient

    sb = sandbox
    run = sb.launch(sb.toy())
    wait_for_steps(sb, run, 6)
    (sock,) = sb.ctl.glob("*.sock")
    with ControlClient(str(sock)) as client:
        client.request_save("manual", time.time() + 60)
        wait_for(lambda: client.status()["save_request"] is None, "the manual request to be satisfied", run)
    rc = run.wait(120)
    err = run.stderr()
    assert rc == 0, f"exit code {rc}:\n{err[-4000:]}"
    assert "manual save request satisfied" in err, err[-4000:]
    events = [e for e in read_jsonl(sb.run_dir / "events.jsonl") if e.get("event") == "save_committed"]
    manual = {(e["rank"], e["step"]) for e in events if e["reason"] == "manual"}
    assert {r for r, _ in manual} == {0, 1} and len({s for _, s in manual}) == 1, events
    assert not [e for e in events if e["reason"] == "emergency"], events
    assert all(max(logged_steps(sb.log(r))) == STEPS for r in range(2))
    assert_same_as_reference(sb, reference)  # the extra save changed nothing of the training


@pytest.mark.parametrize(("flags", "env", "key"), [
    pytest.param([], {"RSLURM_SAVE_TIMEOT": "5"}, "RSLURM_SAVE_TIMEOT", id="unknown-env-var"),
    pytest.param(["--max-restarts=-1"], {}, "--max-restarts", id="negative-max-restarts"),
    pytest.param(["--save-signal=KILL"], {}, "--save-signal", id="uncatchable-save-signal"),
    pytest.param(["--term-grace=soon"], {}, "--term-grace", id="not-a-number"),
])
def test_bad_settings_exit_2_naming_the_key_before_any_rank_starts(
        sandbox: Sandbox, flags: list[str], env: dict[str, str], key: str) -> None:
    sb = sandbox
    marker = sb.root / "rank-started"
    run = sb.launch([sys.executable, "-c", f"open({str(marker)!r}, 'w')"], *flags, env=env, n=1)
    rc = run.wait(60)
    err = run.stderr()
    assert rc == 2, f"exit code {rc}:\n{err[-3000:]}"
    errors = [line for line in err.splitlines() if line.startswith("rslurm: error:")]
    assert len(errors) == 1 and key in errors[0], err[-3000:]
    assert "Traceback" not in err
    assert not marker.exists(), "a rank started although the settings were refused"


def test_processes_left_by_ranks_that_failed_on_their_own_do_not_outlive_the_launcher(sandbox: Sandbox) -> None:
    sb = sandbox
    run = sb.launch([sys.executable, "-c", ORPHANING, str(sb.root)])
    rc = run.wait(60)
    ended = time.time()
    err = run.stderr()
    assert rc == 3, f"exit code {rc}:\n{err[-4000:]}"
    assert "not requeued" in err
    exits = [json.loads((sb.root / f"exit.{r}").read_text()) for r in range(2)]
    assert_nothing_survives(sb, run, [pid for e in exits for pid in (e["pid"], e["child"])])
    lingered = ended - max(e["at"] for e in exits)
    assert lingered < 4, f"the launcher exited {lingered:.1f}s after its ranks"


def test_a_program_that_cannot_be_started_is_a_clear_error(sandbox: Sandbox) -> None:
    sb = sandbox
    missing = sb.root / "no-such-program"
    run = sb.launch([str(missing), "--flag"])
    rc = run.wait(60)
    err = run.stderr()
    assert rc in (2, 127), f"exit code {rc}:\n{err[-3000:]}"
    assert "Traceback" not in err, err[-3000:]
    assert str(missing) in err
    assert_nothing_survives(sb, run)


def test_with_a_durable_tier_the_emergency_step_is_durable_before_exit_and_a_lost_disk_resumes_bitwise(
        sandbox: Sandbox, reference: Sandbox) -> None:
    """``RSLURM_DURABLE`` set, no daemon service: the launcher runs ``rslurm daemon --job-step`` next to
    the ranks. SIGTERM: the emergency step is durable before the launcher exits 75, and the daemon is
    gone with it. The node's local disk is then lost: the rerun restores from the durable tier,
    finishes bitwise identical, and its final step is durable before the launcher exits 0."""
    sb = sandbox
    durable = sb.root / "lustre"
    env = {"RSLURM_DURABLE": str(durable), "RSLURM_LOG_LEVEL": "INFO"}
    run = sb.launch(sb.toy(), env=env)
    wait_for_steps(sb, run, 6)
    run.signal(signal.SIGTERM)
    rc = run.wait(60)
    assert rc == REQUEUE, f"exit code {rc}:\n{run.stderr()[-4000:]}"
    assert_nothing_survives(sb, run)  # the job's daemon included
    step = assert_emergency_at_last_logged_step(sb)
    events = [e for e in read_jsonl(sb.run_dir / "events.jsonl") if e["source"] == "launcher"]
    durable_events = [e for e in events if e["event"] == "durable"]
    assert durable_events and durable_events[0]["step"] == step, events
    assert (durable / "toy" / step_dirname(step) / "manifest.json").exists()
    assert "drain daemon started" in run.stderr()

    shutil.rmtree(sb.nvme)  # the node's NVMe is gone
    again = sb.launch(sb.toy(), env=env)
    rc = again.wait(120)
    assert rc == 0, again.stderr()[-4000:]
    assert_nothing_survives(sb, again)
    assert "fetched from the durable tier" in again.stderr(), again.stderr()[-4000:]
    for r in range(2):
        s = starts(sb.log(r))
        assert [e["step"] for e in s] == [0, step], f"rank {r} did not resume from the emergency step: {s}"
    assert_same_as_reference(sb, reference)
    assert (durable / "toy" / step_dirname(STEPS) / "manifest.json").exists(), "the final step is not durable"


def test_a_launcher_started_without_stderr_starts_every_rank(tmp_path: Path) -> None:
    """``rslurm launch ... 2>&-`` (a cron line, a daemon): Python then has no sys.stderr. The launcher used to
    fail on it after starting rank 0 (AttributeError), and rank 1 never started. The ranks' stderr is now
    read, kept and parsed as always, and shown nowhere."""
    started = tmp_path / "started."
    prog = "import os, sys; open(sys.argv[1] + os.environ['RANK'], 'w').close(); print('to stderr', file=sys.stderr)"
    r = subprocess.run([sys.executable, "-m", "resilient_slurm.cli", "launch", "-n", "2", "--", sys.executable, "-c",
                        prog, str(started)],
                       env=clean_env({"RSLURM_LOCAL_DIR": str(tmp_path / "nvme"), "RSLURM_RUN_ID": "nostderr"}),
                       stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True, timeout=120,
                       preexec_fn=lambda: os.close(2))
    assert r.returncode == 0, r.stdout[-3000:]
    assert sorted(p.name for p in tmp_path.glob("started.*")) == ["started.0", "started.1"]
