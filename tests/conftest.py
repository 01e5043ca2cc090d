"""Shared test helpers: launching real rank processes, free ports, reading step logs."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import check_tier
import psutil
import pytest
from ports import free_port
from slurm_cluster import SlurmCluster, missing_tools

REPO = Path(__file__).resolve().parent.parent


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get(check_tier.ENV) == "1":  # `make check`: the in-process tier (tests/check_tier.py)
        check_tier.install()
    if hasattr(config, "workerinput"):
        # An xdist worker's environment has COLUMNS=80 and LINES=24, which a user's does not (the shell does
        # not export them): the CLI's tables would wrap at 80 columns in the commands the tests run.
        for name in ("COLUMNS", "LINES"):
            os.environ.pop(name, None)


SLURM_FIXTURES = frozenset({"slurm", "slurm_cluster"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Order for two workers (`make test` runs `pytest -n 2 --dist loadgroup`, docs/testing.md): the tests
    on the session's Slurm cluster first (one worker runs them all, one after another: tests/xdist_groups.py),
    then those marked ``slow``, then the others that start processes (``proc``), then the in-process ones,
    so that no long test starts last and runs alone. The sort is stable (a file's tests keep their order);
    without xdist only the order changes."""
    def rank(item: pytest.Item) -> int:
        if SLURM_FIXTURES & set(getattr(item, "fixturenames", ())):
            return 0
        return next((r for r, mark in ((1, "slow"), (2, "proc")) if item.get_closest_marker(mark)), 3)

    items.sort(key=rank)
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None and config.getvalue("loadgroup"):  # a worker of `--dist loadgroup`
        import xdist_groups
        xdist_groups.record(workerinput, {i.nodeid: xdist_groups.GROUP if rank(i) == 0 else xdist_groups.shared_scope(i)
                                          for i in items})


# Where the suite's minutes go (`make test` prints it at the end): each worker's test time (setup, call and
# teardown, as --durations counts them) and the files that take the most, to balance the workers and find
# redundant process runs (issue 28's time budget).
_TIME_BY_WORKER: dict[str, float] = {}
_TIME_BY_FILE: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    worker = getattr(getattr(getattr(report, "node", None), "gateway", None), "id", "main")
    _TIME_BY_WORKER[worker] = _TIME_BY_WORKER.get(worker, 0.0) + report.duration
    path = report.nodeid.split("::", 1)[0]
    _TIME_BY_FILE[path] = _TIME_BY_FILE.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if hasattr(terminalreporter.config, "workerinput") or sum(_TIME_BY_WORKER.values()) < 60:
        return
    tr = terminalreporter
    tr.write_sep("=", "test time by worker and by file")
    tr.write_line("workers: " + ", ".join(f"{w} {t:.0f} s" for w, t in sorted(_TIME_BY_WORKER.items())))
    top = sorted(_TIME_BY_FILE.items(), key=lambda kv: -kv[1])[:20]
    tr.write_line("files: " + ", ".join(f"{p.removeprefix('tests/')} {t:.0f} s" for p, t in top))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """``--dist loadgroup``: the Slurm tests as one group (tests/xdist_groups.py)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    import xdist_groups
    return xdist_groups.SlurmGroupScheduling(config, log)


def process_stacks(pids: Sequence[int], timeout: float = 30) -> str:
    """Every thread's stack, Python frames and native ones, of each process in ``pids`` (py-spy dump, which
    pauses a process for a moment and leaves it running), with its command line; for the message of a test
    that found something hung. A process that is not Python shows only its command line."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    parts = []
    for pid in pids:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            exe = os.path.basename(os.readlink(f"/proc/{pid}/exe"))
        except OSError:
            continue
        parts.append(f"--- pid {pid}: {cmd[:300]}")
        if not exe.startswith("python"):
            continue
        try:
            cp = subprocess.run([spy, "dump", "--native", "--pid", str(pid)], capture_output=True, text=True,
                                timeout=timeout)
            parts.append((cp.stdout + cp.stderr).strip())
        except (OSError, subprocess.TimeoutExpired) as e:
            parts.append(f"(py-spy dump failed: {e})")
    return "\n".join(parts) or "(no processes)"


def clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The test process's environment without distributed/Slurm/rslurm variables, plus ``extra``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("RSLURM_", "SLURM_", "TORCHELASTIC_"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")
    }
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    # A rank that hangs is sent SIGABRT before it is killed (RankJob.wait): faulthandler then writes every
    # thread's stack into its output, which the failure shows (a hang in CI is otherwise a bare timeout).
    env.setdefault("PYTHONFAULTHANDLER", "1")
    env.update(extra or {})
    return env


def sdir(step: int) -> str:
    """A step's directory name, as the on-disk layout in design.md fixes it."""
    return f"step_{step:012d}"


def run_rslurm(*args: str, env: Mapping[str, str] | None = None, cwd: Path | str | None = None,
               timeout: float = 120, traceback_ok: bool = False) -> subprocess.CompletedProcess[str]:
    """``rslurm ARGS`` as a user runs it: its own process, :func:`clean_env` plus ``env``, no standard input,
    output captured. No Python traceback may reach its stderr (a clear error is the contract) unless
    ``traceback_ok`` (a command whose output carries a training program's own)."""
    r = subprocess.run([sys.executable, "-m", "resilient_slurm.cli", *args], env=clean_env(env), cwd=cwd,
                       stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)
    assert traceback_ok or "Traceback" not in r.stderr, f"rslurm {' '.join(args)}: {r.stderr[-3000:]}"
    return r


@dataclass
class RankJob:
    """N rank processes started together, like a local ``rslurm launch -n N``."""

    procs: list[subprocess.Popen[bytes]]
    logs: list[Path]

    def wait(self, timeout: float = 300) -> list[int]:
        """Wait for every rank; if any hangs, dump every rank's stacks, kill all and fail the test with the
        end of each rank's output (stacks included)."""
        deadline = time.monotonic() + timeout
        codes = []
        for p in self.procs:
            try:
                codes.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                self.fail_hung(f"rank process {p.pid} did not finish within {timeout}s")
        return codes

    def fail_hung(self, what: str) -> NoReturn:
        """Fail the test for ranks that made no progress (``what``): every rank's stacks (from the outside,
        then SIGABRT with faulthandler), all killed, and the end of each rank's output in the failure."""
        stacks = self.stacks()
        self.dump_stacks()
        self.kill()
        tails = "\n".join(f"--- rank {r} ({log}) ---\n{self.output(r)[-6000:]}" for r, log in enumerate(self.logs))
        pytest.fail(f"{what}\n{tails}\n--- stacks before SIGABRT ---\n{stacks}")

    def stacks(self) -> str:
        """Every thread's stack of each rank still running and of its children (DataLoader workers), which
        go on running (:func:`process_stacks`)."""
        pids = []
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(psutil.Error):
                    pids += [p.pid, *(c.pid for c in psutil.Process(p.pid).children(recursive=True))]
        return process_stacks(pids)

    def dump_stacks(self, wait_s: float = 3.0) -> None:
        """SIGABRT to every rank still running and its children (DataLoader workers): with
        PYTHONFAULTHANDLER (clean_env) each writes all its threads' stacks to its output and dies."""
        alive = [p for p in self.procs if p.poll() is None]
        for p in alive:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGABRT)
        deadline = time.monotonic() + wait_s
        for p in alive:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.1, deadline - time.monotonic()))

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to every rank's process group (ranks and their DataLoader workers)."""
        for p in self.procs:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
        for p in self.procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass

    def output(self, rank: int = 0) -> str:
        """What a rank printed (stdout and stderr)."""
        return self.logs[rank].read_text(errors="replace")


def start_ranks(
    argv: Sequence[str],
    world_size: int,
    workdir: Path,
    env: Mapping[str, str] | None = None,
    per_rank_env: Sequence[Mapping[str, str]] | None = None,
    prefixes: Sequence[Sequence[str]] | None = None,
) -> RankJob:
    """Start ``world_size`` processes of ``python argv...`` with torch.distributed variables set
    (``prefixes[r]``: a command that runs rank r's python, e.g. in a UTS namespace of its own)."""
    port = free_port()
    procs, logs = [], []
    for r in range(world_size):
        e = clean_env(env)
        if world_size > 1:
            e.update(RANK=str(r), WORLD_SIZE=str(world_size), LOCAL_RANK=str(r),
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        if per_rank_env:
            e.update(per_rank_env[r])
        log = workdir / f"rank{r}.{time.monotonic_ns()}.out"
        with open(log, "wb") as f:
            cmd = [*(prefixes[r] if prefixes else ()), sys.executable, *argv]
            procs.append(subprocess.Popen(cmd, env=e, stdout=f, stderr=subprocess.STDOUT,
                                          cwd=workdir, start_new_session=True))
        logs.append(log)
    return RankJob(procs, logs)


def run_ranks(argv: Sequence[str], world_size: int, workdir: Path, *, timeout: float = 300,
              env: Mapping[str, str] | None = None,
              per_rank_env: Sequence[Mapping[str, str]] | None = None,
              prefixes: Sequence[Sequence[str]] | None = None) -> RankJob:
    """Start ranks and wait; fail with their output if any rank exits non-zero."""
    job = start_ranks(argv, world_size, workdir, env, per_rank_env, prefixes)
    codes = job.wait(timeout)
    if any(codes):
        out = "\n".join(f"--- rank {r} (exit {c}) ---\n{job.output(r)[-4000:]}" for r, c in enumerate(codes))
        pytest.fail(f"ranks failed: {codes}\n{out}")
    return job


# Outputs that depend only on their key (an uninterrupted reference run: the program, its arguments and the
# world size, not where it ran), made once per test process and kept until it exits.
_ONCE: dict[tuple[object, ...], Path] = {}
_ONCE_ROOT: list[Path] = []


def once(key: tuple[object, ...], make: Callable[[Path], object]) -> Path:
    """The directory ``make(directory)`` filled for ``key``, made by the first test that asks for it in this
    test process (xdist worker); later tests get the same directory and must only read it. A ``make`` that
    fails fails its test and is tried again by the next one."""
    if key not in _ONCE:
        if not _ONCE_ROOT:
            _ONCE_ROOT.append(Path(tempfile.mkdtemp(prefix="rslurm-once-")))
            atexit.register(shutil.rmtree, _ONCE_ROOT[0], ignore_errors=True)
        d = _ONCE_ROOT[0] / f"k{len(_ONCE)}-{os.urandom(4).hex()}"
        d.mkdir()
        make(d)
        _ONCE[key] = d
    return _ONCE[key]


def checkpoint_entries(d: Path | str) -> list[str]:
    """Sorted names in a run directory, leaving out the run's event log (every component appends to
    ``<run dir>/events.jsonl``) and the partner's replicas (``replicas/``, tests/test_peer_replicas.py):
    what is left is step directories and anything a save left behind."""
    from resilient_slurm.layout import REPLICAS_DIRNAME
    from resilient_slurm.telemetry import EVENTS_FILE

    return sorted(n for n in os.listdir(d) if n not in (EVENTS_FILE, REPLICAS_DIRNAME)) if os.path.isdir(d) else []


def read_jsonl(path: Path) -> list[dict]:
    """Parse a JSON-lines file, tolerating a torn last line (the writer may have been SIGKILLed)."""
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def wait_for_step(log: Path, step: int, timeout: float = 120, job: RankJob | None = None,
                  diagnose: Callable[[], str] | None = None) -> None:
    """Block until a step log shows ``step`` completed. On a timeout the failure shows ``diagnose()`` (a
    Slurm job's state and stacks), or the stacks of ``job``'s ranks."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.exists() and any(e.get("step", -1) >= step and "loss" in e for e in read_jsonl(log)):
            return
        if job is not None and any(p.poll() not in (None, 0) for p in job.procs):
            pytest.fail(f"a rank died before step {step}: {job.output(0)[-3000:]}")
        time.sleep(0.01)
    if diagnose is not None:
        why = diagnose()
    elif job is not None:
        why = job.stacks()
    else:
        why = ""
    tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-5:]) if log.exists() else "(no log)"
    pytest.fail(f"step {step} not reached within {timeout}s ({log}; its end: {tail})\n{why}")


def assert_same(a: object, b: object, path: str = "") -> None:
    """Fail naming the first path where two nested states (tensors, dicts, lists, values) differ."""
    import torch

    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), f"tensor differs at {path}"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"keys differ at {path}: {set(a) ^ set(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"length differs at {path}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"value differs at {path}: {a!r} vs {b!r}"


def wait_for_text(path: Path, pattern: str, cluster: SlurmCluster, timeout: float = 60.0) -> str:
    """Poll until ``path`` contains ``pattern`` (a marker a job writes); fail with the cluster's logs."""
    deadline = time.monotonic() + timeout
    while True:
        text = path.read_text() if path.exists() else ""
        if pattern in text:
            return text
        if time.monotonic() > deadline:
            pytest.fail(f"{pattern!r} not in {path} after {timeout}s: {text!r}\n{cluster.logs_tail()}")
        time.sleep(0.05)


@contextlib.contextmanager
def mounted_tmpfs(where: Path, size: str) -> Iterator[Path]:
    """A real tmpfs of ``size`` (``8m``) mounted at ``where`` for a full-disk test; skips unless root
    (CI runs the suite as root, so these tests run there)."""
    if os.geteuid() != 0:
        pytest.skip(f"needs root to mount a {size} tmpfs (CI runs these tests as root)")
    where.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True,
                       text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (root, but: {r.stderr.strip()})")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


# --------------------------------------------------------------------------- the real Slurm test cluster
@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    """One private two-node Slurm cluster for the whole session; stopped (nothing left) at the end.

    Needs Debian's slurm-wlm and munge (tests/slurm/install.sh) and root. Without them the tests that
    use it are skipped, or fail when RSLURMTEST_REQUIRE_SLURM=1 (CI sets it).
    """
    missing = missing_tools()
    msg = ""
    if missing:
        msg = f"Slurm not installed (missing {', '.join(missing)}): run tests/slurm/install.sh as root"
    elif os.geteuid() != 0:
        msg = "the Slurm test cluster needs root (SlurmUser=root)"
    if msg:
        if os.environ.get("RSLURMTEST_REQUIRE_SLURM") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    cluster = SlurmCluster()
    cluster.start(timeout=120)
    try:
        yield cluster
    finally:
        cluster.stop()
    assert not cluster.marked_pids(), "processes of the test cluster survived stop()"


@pytest.fixture
def slurm(slurm_cluster: SlurmCluster) -> Iterator[SlurmCluster]:
    """The session cluster with an empty queue and idle nodes; whatever a test leaves is cancelled."""
    slurm_cluster.reset(timeout=60)
    yield slurm_cluster
    slurm_cluster.reset(timeout=60)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty HOME and no RSLURM_* variables, so no per-user ~/.config/rslurm/config.toml or setting
    leaks into a test."""
    h = tmp_path / "home"
    h.mkdir()
    monkeypatch.setenv("HOME", str(h))
    for k in list(os.environ):
        if k.startswith("RSLURM_"):
            monkeypatch.delenv(k)
    return h
