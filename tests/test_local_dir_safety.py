"""The default local directory ``$TMPDIR/rslurm-<uid>`` and the files rslurm opens under the local root
are not another user's to choose.

* ``rslurm-<uid>`` is made mode 0700; one that exists must be a real directory of ours that group and
  others cannot write, or every entry point (Checkpointer, launcher, daemon, CLI) stops with a settings
  error naming it, what is wrong and what to do.
* ``events.jsonl`` and ``<local root>/.rslurm/`` (the daemon's lock and status) are opened without
  following symlinks and without blocking on a FIFO: the event log drops its events with one warning,
  the daemon refuses to start, the readers (``daemon_running``, ``read_status``) see nothing.

Tests run as root (here and in CI): "another user's directory" is one chowned to :data:`OTHER`.
"""

from __future__ import annotations

import fcntl
import logging
import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from conftest import run_rslurm

from resilient_slurm import Checkpointer
from resilient_slurm.daemon.service import daemon_running, read_status
from resilient_slurm.errors import ConfigError
from resilient_slurm.paths import default_local_dir, ensure_private_dir, open_regular, open_state_file
from resilient_slurm.telemetry import EventLog

OTHER = 12345
UID = os.getuid()
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown a directory to another uid")


@pytest.fixture
def tmpdir_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh $TMPDIR for this test (in this process and for the subprocesses it starts), no RSLURM_*
    settings: the default local directory resolves to ``<it>/rslurm-<uid>``."""
    base = tmp_path / "tmp"
    base.mkdir()
    monkeypatch.setenv("TMPDIR", str(base))
    monkeypatch.setattr(tempfile, "tempdir", str(base))  # gettempdir() caches $TMPDIR
    for k in [k for k in os.environ if k.startswith("RSLURM_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("RSLURM_NODE_NAME", "n1")
    return base


def mine(base: Path) -> Path:
    return base / f"rslurm-{UID}"


def hostile(base: Path, kind: str) -> Path:
    """Pre-create ``rslurm-<uid>`` under ``base`` the way another user (or a mistake) could; return it."""
    d = mine(base)
    if kind == "other-uid":
        d.mkdir(mode=0o700)
        os.chown(d, OTHER, OTHER)
    elif kind == "symlink":
        target = base / "someone-elses"
        target.mkdir(mode=0o700)  # even a private directory of ours: a link decides where files go
        d.symlink_to(target)
    elif kind == "group-writable":
        d.mkdir()
        d.chmod(0o775)
    elif kind == "file":
        d.write_text("not a directory\n")
    else:
        raise AssertionError(kind)
    return d


EXPECT = {"other-uid": f"belongs to uid {OTHER}", "symlink": "is a symlink", "group-writable": "mode 0775",
          "file": "not a real directory"}


# --------------------------------------------------------------------------- default_local_dir itself
def test_missing_default_dir_is_created_0700_whatever_the_umask(tmpdir_env: Path) -> None:
    old = os.umask(0)
    try:
        template = default_local_dir()
    finally:
        os.umask(old)
    assert template == str(mine(tmpdir_env) / "%n")
    st = os.lstat(mine(tmpdir_env))
    assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o700
    assert default_local_dir() == template  # again: ours and private, accepted


@pytest.mark.parametrize("mode", [0o700, 0o755, 0o750])
def test_existing_default_dir_of_ours_not_writable_by_others_is_accepted(tmpdir_env: Path, mode: int) -> None:
    d = mine(tmpdir_env)
    d.mkdir()
    d.chmod(mode)  # 0755: what earlier versions made (os.makedirs under a 022 umask)
    assert default_local_dir() == str(d / "%n")
    assert stat.S_IMODE(os.lstat(d).st_mode) == mode  # checked, not changed


@pytest.mark.parametrize("kind", [pytest.param("other-uid", marks=needs_root), "symlink", "group-writable",
                                  "file"])
def test_unsafe_default_dir_is_refused_naming_it_and_what_to_do(tmpdir_env: Path, kind: str) -> None:
    d = hostile(tmpdir_env, kind)
    with pytest.raises(ConfigError) as info:
        default_local_dir()
    msg = str(info.value)
    assert str(d) in msg and EXPECT[kind] in msg, msg
    assert "remove it" in msg and "RSLURM_LOCAL_DIR" in msg, msg
    if kind == "group-writable":
        assert f"chmod 700 {d}" in msg


@pytest.mark.parametrize("mode", [0o757, 0o1777, 0o770])
def test_default_dir_writable_by_others_is_refused(tmpdir_env: Path, mode: int) -> None:
    d = mine(tmpdir_env)
    d.mkdir()
    d.chmod(mode)
    with pytest.raises(ConfigError, match=f"{d} has mode {mode:04o}"):
        default_local_dir()


def test_default_dir_inside_a_directory_others_can_write_is_refused(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # world-writable, no sticky bit: another user could swap rslurm-<uid>
    monkeypatch.setattr(tempfile, "tempdir", str(shared))
    with pytest.raises(ConfigError, match=f"inside {shared} .*another user could modify.*RSLURM_LOCAL_DIR"):
        default_local_dir()
    shared.chmod(0o1777)  # like /tmp: accepted
    assert default_local_dir() == str(shared / f"rslurm-{UID}" / "%n")


def test_one_check_for_the_control_directory_and_the_local_directory() -> None:
    """The control socket's runtime directory is checked by the same function (no second copy)."""
    import inspect

    from resilient_slurm.control import server

    assert "paths.ensure_private_dir(" in inspect.getsource(server.ensure_private_dir)
    assert ensure_private_dir is server.paths.ensure_private_dir


# --------------------------------------------------------------------------- entry points
def _state() -> dict[str, object]:
    model = torch.nn.Linear(4, 2)
    return {"model": model, "note": "x"}


@pytest.mark.parametrize("kind", [pytest.param("other-uid", marks=needs_root), "symlink", "group-writable"])
def test_checkpointer_refuses_an_unsafe_default_dir_and_writes_nothing(tmpdir_env: Path, kind: str) -> None:
    d = hostile(tmpdir_env, kind)
    before = sorted(p.name for p in d.iterdir()) if d.is_dir() else None
    target = sorted(p.name for p in (tmpdir_env / "someone-elses").iterdir()) if kind == "symlink" else None
    with pytest.raises(ConfigError) as info:
        with Checkpointer(run_id="safety") as ck:
            ck.save(1, _state())
    assert str(d) in str(info.value) and EXPECT[kind] in str(info.value)
    if before is not None:
        assert sorted(p.name for p in d.iterdir()) == before  # nothing planted in their directory
    if target is not None:
        assert sorted(p.name for p in (tmpdir_env / "someone-elses").iterdir()) == target


_RANK_PROGRAM = """
import os
from resilient_slurm import Checkpointer, init_distributed
from resilient_slurm.errors import ConfigError
init_distributed()
try:
    Checkpointer(run_id="safety")
except ConfigError as exc:
    print("CONFIGERROR", exc, flush=True)
    os._exit(3)  # not sys.exit: gloo may abort (SIGABRT) in interpreter teardown once the peer has gone
print("STARTED", flush=True)
"""


@pytest.mark.proc
@pytest.mark.parametrize("kind", ["group-writable", "file"])
def test_one_rank_refusing_its_directory_stops_every_rank_at_once(tmp_path: Path, kind: str) -> None:
    """Rank 1's default directory is unsafe (its own $TMPDIR), rank 0's is fine: both stop with a
    ConfigError in the topology collective, rank 0's naming rank 1 and the problem, instead of rank 0
    waiting collective_timeout (here 600 s) for a rank that already gave up."""
    from conftest import start_ranks

    bases = [tmp_path / "tmp0", tmp_path / "tmp1"]
    for b in bases:
        b.mkdir()
    d = hostile(bases[1], kind)
    job = start_ranks(["-c", _RANK_PROGRAM], 2, tmp_path, env={"RSLURM_COLLECTIVE_TIMEOUT": "600"},
                      per_rank_env=[{"TMPDIR": str(b), "RSLURM_NODE_NAME": f"n{r}"} for r, b in enumerate(bases)])
    codes = job.wait(timeout=240)  # far below the collective timeout: a waiting rank 0 fails here
    out = [log.read_text() for log in job.logs]
    assert codes == [3, 3], out
    assert str(d) in out[1] and EXPECT[kind] in out[1]
    assert "rank 1 (n1)" in out[0] and str(d) in out[0], out[0]


def test_checkpointer_with_the_default_dir_saves_into_a_private_one(tmpdir_env: Path) -> None:
    with Checkpointer(run_id="safety") as ck:
        ck.save(1, _state())
    assert stat.S_IMODE(os.lstat(mine(tmpdir_env)).st_mode) == 0o700
    assert (mine(tmpdir_env) / "n1" / "safety" / "step_000000000001" / "manifest.json").is_file()


@needs_root
def test_explicit_local_dir_is_the_users_choice_and_skips_the_default(tmpdir_env: Path,
                                                                      tmp_path: Path) -> None:
    hostile(tmpdir_env, "other-uid")
    own = tmp_path / "own"
    with Checkpointer(local_dir=str(own), run_id="safety") as ck:
        ck.save(1, _state())
    assert (own / "safety" / "step_000000000001" / "manifest.json").is_file()
    assert not any(mine(tmpdir_env).iterdir())


def _cli(base: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return run_rslurm(*args, env={"TMPDIR": str(base), "RSLURM_NODE_NAME": "n1"}, timeout=timeout)


def _assert_settings_error(r: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    assert "rslurm: error:" in r.stderr, r.stderr
    for n in needles:
        assert n in r.stderr, (n, r.stderr)


@pytest.mark.proc
@needs_root
@pytest.mark.parametrize("command", ["ls", "status", "daemon", "launch"])
def test_cli_entry_points_refuse_another_users_default_dir(tmpdir_env: Path, tmp_path: Path,
                                                           command: str) -> None:
    d = hostile(tmpdir_env, "other-uid")
    args = {"ls": ["ls"], "status": ["status"],
            "daemon": ["daemon", "--once", "--durable", str(tmp_path / "durable")],
            "launch": ["launch", "-n", "1", "--", sys.executable, "-c", "pass"]}[command]
    r = _cli(tmpdir_env, *args)
    _assert_settings_error(r, str(d), f"belongs to uid {OTHER}", "RSLURM_LOCAL_DIR")
    assert not any(d.iterdir())


@pytest.mark.proc
@pytest.mark.parametrize("kind", ["symlink", "group-writable"])
def test_cli_ls_refuses_a_symlinked_or_group_writable_default_dir(tmpdir_env: Path, kind: str) -> None:
    d = hostile(tmpdir_env, kind)
    _assert_settings_error(_cli(tmpdir_env, "ls"), str(d), EXPECT[kind])


# --------------------------------------------------------------------------- events.jsonl
def _events_root(tmp_path: Path) -> tuple[Path, Path]:
    root = tmp_path / "root"
    (root / "run").mkdir(parents=True)
    return root, root / "run" / "events.jsonl"


@pytest.mark.parametrize("keep_open", [True, False])
def test_symlinked_event_log_is_not_followed(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                             keep_open: bool) -> None:
    root, path = _events_root(tmp_path)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    victim.chmod(0o644)
    before = victim.stat()
    path.symlink_to(victim)
    log = EventLog(str(root), "run", source="rank", node="n1", keep_open=keep_open)
    with caplog.at_level(logging.DEBUG, logger="resilient_slurm.telemetry"):
        for i in range(3):
            log.emit("save_start", step=i)  # never raises
    assert victim.read_text() == "precious\n"
    after = victim.stat()
    assert (after.st_size, after.st_mtime_ns, stat.S_IMODE(after.st_mode)) == (
        before.st_size, before.st_mtime_ns, 0o644)
    assert log.failures == 3
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert str(path) in warnings[0].getMessage() and "symlink" in warnings[0].getMessage()


def test_dangling_symlink_event_log_creates_nothing(tmp_path: Path) -> None:
    root, path = _events_root(tmp_path)
    path.symlink_to(tmp_path / "would-be-created")
    EventLog(str(root), "run", source="launcher", node="n1", keep_open=False).emit("launch")
    assert not (tmp_path / "would-be-created").exists()


@pytest.mark.timeout(30)
def test_fifo_event_log_does_not_block_and_gets_nothing(tmp_path: Path,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    root, path = _events_root(tmp_path)
    os.mkfifo(path)
    log = EventLog(str(root), "run", source="daemon", node="n1", keep_open=False)
    with caplog.at_level(logging.WARNING, logger="resilient_slurm.telemetry"):
        log.emit("drain_start", step=1)  # no reader: an O_WRONLY open would block without O_NONBLOCK
        reader = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        try:
            log.emit("drain_start", step=2)  # with a reader the open succeeds; fstat refuses the FIFO
            assert os.read(reader, 4096) == b""  # nothing was written into the pipe (no writer left: EOF)
        finally:
            os.close(reader)
    assert log.failures == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and str(path) in warnings[0] and "FIFO" in warnings[0], warnings


def test_regular_event_log_still_appends_in_blocking_mode(tmp_path: Path) -> None:
    root, path = _events_root(tmp_path)
    log = EventLog(str(root), "run", source="rank", node="n1")
    log.emit("save_start", step=1)
    log.emit("save_end", step=1)
    assert log._fd is not None and not fcntl.fcntl(log._fd, fcntl.F_GETFL) & os.O_NONBLOCK
    log.close()
    assert len(path.read_text().splitlines()) == 2 and log.failures == 0
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_open_regular_refuses_a_directory_for_writing(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=f"{tmp_path / 'd'} is a directory"):
        (tmp_path / "d").mkdir()
        open_regular(str(tmp_path / "d"), os.O_WRONLY | os.O_CREAT)


# --------------------------------------------------------------------------- <local root>/.rslurm
def test_symlinked_state_dir_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (root / ".rslurm").symlink_to(elsewhere)
    for create in (True, False):
        with pytest.raises(ConfigError, match=f"{root / '.rslurm'} is a symlink"):
            open_state_file(str(root / ".rslurm"), "daemon.lock", os.O_RDWR | os.O_CREAT, create=create)
    assert not list(elsewhere.iterdir())
    assert daemon_running(str(root)) is False and read_status(str(root)) is None


@needs_root
def test_state_dir_of_another_user_is_refused_when_the_daemon_takes_its_lock(tmp_path: Path) -> None:
    state = tmp_path / "root" / ".rslurm"
    state.mkdir(parents=True, mode=0o700)
    os.chown(state, OTHER, OTHER)
    with pytest.raises(ConfigError, match=f"{state} belongs to uid {OTHER}"):
        open_state_file(str(state), "daemon.lock", os.O_RDWR | os.O_CREAT, create=True)
    assert not (state / "daemon.lock").exists()


def test_state_dir_is_created_0700(tmp_path: Path) -> None:
    state = tmp_path / "root" / ".rslurm"
    fd = open_state_file(str(state), "daemon.lock", os.O_RDWR | os.O_CREAT, create=True)
    os.close(fd)
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    assert stat.S_IMODE((state / "daemon.lock").stat().st_mode) == 0o600


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", ["daemon.lock", "daemon.json"])
def test_readers_neither_follow_nor_block_in_the_state_dir(tmp_path: Path, name: str) -> None:
    root = tmp_path / "root"
    state = root / ".rslurm"
    state.mkdir(parents=True, mode=0o700)
    os.mkfifo(state / name)  # O_RDONLY on a FIFO blocks until a writer comes, without O_NONBLOCK
    assert daemon_running(str(root)) is False and read_status(str(root)) is None  # pytest-timeout: no hang
    (state / name).unlink()
    secret = tmp_path / "secret.json"
    secret.write_text('{"pid": 1}')
    (state / name).symlink_to(secret)
    assert read_status(str(root)) is None


def _daemon(tmp_path: Path, root: Path) -> subprocess.CompletedProcess[str]:
    return _cli(tmp_path, "daemon", "--once", "--local-dir", str(root), "--durable",
                str(tmp_path / "durable"), timeout=60)


@pytest.mark.proc
@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_daemon_refuses_an_unsafe_lock_file(tmp_path: Path, kind: str) -> None:
    root = tmp_path / "root"
    state = root / ".rslurm"
    state.mkdir(parents=True, mode=0o700)
    lock = state / "daemon.lock"
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    if kind == "symlink":
        lock.symlink_to(victim)
    else:
        os.mkfifo(lock)
    r = _daemon(tmp_path, root)  # the subprocess timeout fails the test if it blocks
    _assert_settings_error(r, str(lock), "symlink" if kind == "symlink" else "FIFO")
    assert victim.read_text() == "precious\n"


@pytest.mark.proc
def test_daemon_refuses_a_symlinked_state_dir(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (root / ".rslurm").symlink_to(elsewhere)
    r = _daemon(tmp_path, root)
    _assert_settings_error(r, str(root / ".rslurm"), "symlink")
    assert not list(elsewhere.iterdir())


@pytest.mark.proc
@pytest.mark.parametrize("kind", ["symlink", "group-writable"])
def test_doctor_reports_an_unsafe_default_dir_as_a_failed_check(tmpdir_env: Path, kind: str) -> None:
    """`rslurm doctor` is where users look for what is wrong: an unsafe default directory is a local.dir
    FAIL naming it and what to do (exit 1, the other checks still run), not an exit 2 before any check."""
    import json

    d = hostile(tmpdir_env, kind)
    r = _cli(tmpdir_env, "doctor", "--skip", "script,cluster,durable,signals", "--json")
    assert r.returncode == 1 and "Traceback" not in r.stderr, (r.returncode, r.stdout, r.stderr)
    rows = {c["check"]: c for c in json.loads(r.stdout)["checks"]}
    assert rows["local.dir"]["status"] == "FAIL", rows["local.dir"]
    assert str(d) in rows["local.dir"]["finding"] and EXPECT[kind] in rows["local.dir"]["finding"]
    assert "RSLURM_LOCAL_DIR" in rows["local.dir"]["fix"]
    assert {rows[c]["status"] for c in ("local.space", "local.filesystem", "local.bandwidth")} == {"SKIP"}
    if kind == "symlink":
        assert not any((tmpdir_env / "someone-elses").iterdir())  # nothing probed through the link


@pytest.mark.parametrize("below", ["", "n1"])
def test_a_file_where_the_local_root_goes_is_a_settings_error_naming_it(
        tmp_path: Path, below: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A regular file at the local root (or above it): the Checkpointer, the launcher's run claim and the
    commands that read one root (status, history, report) stop with a settings error naming the file, not
    a traceback."""
    from resilient_slurm.cli import main as rslurm_main
    from resilient_slurm.layout import claim_run

    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    root = afile / below if below else afile
    with pytest.raises(ConfigError, match=f"{afile} is a regular file, not a directory"):
        claim_run(str(root), "r", "me")
    with pytest.raises(ConfigError, match="local checkpoint directory unusable") as err:
        with Checkpointer(local_dir=str(root), run_id="r") as ck:
            ck.save(1, {"w": torch.zeros(4)}, blocking=True)
    assert str(afile) in str(err.value), err.value
    for cmd in ("status", "history", "report"):
        capsys.readouterr()
        assert rslurm_main([cmd, "--local-dir", str(root)]) == 2, cmd
        err = capsys.readouterr().err
        assert "is not a directory" in err and "Traceback" not in err, (cmd, err)
    assert afile.read_text() == "not a directory"


def test_launch_refuses_a_durable_path_it_cannot_make_before_any_rank(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A durable path below a file: exit 2 naming it, and no rank started (in `make check`, any process start
    would fail the test), rather than every rank failing on it as if the program were wrong."""
    from resilient_slurm.cli import main as rslurm_main

    afile = tmp_path / "afile"
    afile.write_text("x")
    rc = rslurm_main(["launch", "-n", "1", "--local-dir", str(tmp_path / "nvme" / "%n"), "--durable",
                      str(afile / "ckpt"), "--run-id", "t1", "--", sys.executable, "-c", "print(1)"])
    err = capsys.readouterr().err
    assert rc == 2 and f"durable tier {afile / 'ckpt'}: cannot create it" in err and "no rank was started" in err, err
    assert err.count("durable tier") == 1, err
