"""JobEnv: every SLURM_* and rank variable parsed in one place (resilient_slurm/jobenv.py)."""

from __future__ import annotations

import ast
import logging
import re
from pathlib import Path

import pytest

from resilient_slurm.jobenv import JobEnv
from resilient_slurm.paths import default_run_id

PKG = Path(__file__).resolve().parents[1] / "resilient_slurm"


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_outside_slurm_everything_is_absent(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        job = JobEnv.from_env({"PATH": "/bin"})
    assert job == JobEnv() and job.restart_count == 0 and not job.in_slurm and job.run_key() is None
    assert dict(job.raw) == {} and not _warnings(caplog)


def test_parses_every_field() -> None:
    env = {"SLURM_JOB_ID": "42", "SLURM_ARRAY_JOB_ID": "40", "SLURM_ARRAY_TASK_ID": "2", "SLURM_STEP_ID": "0",
           "SLURM_RESTART_COUNT": "3", "SLURMD_NODENAME": "n1", "SLURM_JOB_NODELIST": "n[1-2]",
           "SLURM_STEP_NODELIST": "n2", "SLURM_NODELIST": "n[1-2]", "SLURM_JOB_NUM_NODES": "2",
           "SLURM_PROCID": "1", "SLURM_LOCALID": "0", "SLURM_NTASKS": "2", "SLURM_OPEN_MODE": "a",
           "RANK": "1", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "n1", "MASTER_PORT": "29500", "HOME": "/h"}
    job = JobEnv.from_env(env)
    assert job == JobEnv(job_id="42", array_job_id="40", array_task_id="2", step_id="0", restart_count=3,
                         node_name="n1", job_nodelist="n[1-2]", step_nodelist="n2", nodelist="n[1-2]",
                         num_nodes=2, procid=1, localid=0, ntasks=2, open_mode="a", rank=1, local_rank=0,
                         world_size=2, local_world_size=1, master_addr="n1", master_port=29500)
    assert job.in_slurm and job.run_key() == "40_2" and "HOME" not in job.raw and job.raw["RANK"] == "1"


def test_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("WORLD_SIZE", " 4 ")
    job = JobEnv.from_env()
    assert job.job_id == "7" and job.world_size == 4


def test_empty_variables_are_absent_silently(caplog: pytest.LogCaptureFixture) -> None:
    env = {"SLURM_JOB_ID": "", "SLURM_RESTART_COUNT": "", "RANK": " ", "MASTER_ADDR": ""}
    with caplog.at_level(logging.WARNING):
        job = JobEnv.from_env(env)
    assert job.job_id is None and job.restart_count == 0 and job.rank is None and job.master_addr is None
    assert dict(job.raw) == env and not _warnings(caplog)


@pytest.mark.parametrize(("var", "value", "field"), [
    ("SLURM_RESTART_COUNT", "two", "restart_count"),
    ("SLURM_RESTART_COUNT", "-1", "restart_count"),
    ("RANK", "1.5", "rank"),
    ("LOCAL_RANK", "x", "local_rank"),
    ("WORLD_SIZE", "0", "world_size"),
    ("LOCAL_WORLD_SIZE", "many", "local_world_size"),
    ("SLURM_PROCID", "-3", "procid"),
    ("SLURM_LOCALID", "?", "localid"),
    ("SLURM_NTASKS", "0", "ntasks"),
    ("MASTER_PORT", "70000", "master_port"),
    ("MASTER_PORT", "http", "master_port"),
    ("SLURM_JOB_NUM_NODES", "0", "num_nodes"),
])
def test_a_malformed_integer_is_warned_once_and_absent(
        caplog: pytest.LogCaptureFixture, var: str, value: str, field: str) -> None:
    with caplog.at_level(logging.WARNING, logger="resilient_slurm.jobenv"):
        job = JobEnv.from_env({var: value})
    assert getattr(job, field) == (0 if field == "restart_count" else None)
    assert job.raw[var] == value  # kept verbatim for strict readers
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and var in warnings[0] and repr(value) in warnings[0], warnings


def test_warn_false_is_silent(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        job = JobEnv.from_env({"RANK": "x", "SLURM_JOB_NUM_NODES": "y"}, warn=False)
    assert job.rank is None and job.num_nodes is None and not _warnings(caplog)


# ------------------------------------------------------------------------------------------- precedence
@pytest.mark.parametrize(("env", "nodes"), [
    ({"SLURM_JOB_NUM_NODES": "4", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "a"}, 4),
    ({"SLURM_JOB_NUM_NODES": "bad", "SLURM_NNODES": "2"}, 2),
    ({"SLURM_NNODES": "3", "SLURM_JOB_NODELIST": "a"}, 3),
    ({"SLURM_JOB_NODELIST": "a,b,c"}, 3),
    ({}, 1),
])
def test_node_count_precedence(env: dict[str, str], nodes: int) -> None:
    assert JobEnv.from_env(env).node_count(lambda s: s.split(",") if s else []) == nodes


def test_node_count_warns_about_an_unreadable_nodelist(caplog: pytest.LogCaptureFixture) -> None:
    def bad(nodelist: str) -> list[str]:
        raise ValueError("unbalanced brackets")

    with caplog.at_level(logging.WARNING):
        assert JobEnv.from_env({"SLURM_JOB_NODELIST": "n[1-"}).node_count(bad) == 1
    assert any("SLURM_JOB_NODELIST" in w and "n[1-" in w for w in _warnings(caplog))


def test_a_valid_first_node_count_hides_the_second() -> None:
    """As before JobEnv: SLURM_NNODES is not looked at (nor warned about) when SLURM_JOB_NUM_NODES holds."""
    assert JobEnv.from_env({"SLURM_JOB_NUM_NODES": "2", "SLURM_NNODES": "x"}).num_nodes == 2


@pytest.mark.parametrize(("env", "run_id"), [
    ({"SLURM_ARRAY_JOB_ID": "10", "SLURM_ARRAY_TASK_ID": "3", "SLURM_JOB_ID": "13"}, "10_3"),
    ({"SLURM_ARRAY_JOB_ID": "10", "SLURM_JOB_ID": "13"}, "13"),
    ({"SLURM_ARRAY_JOB_ID": "10", "SLURM_ARRAY_TASK_ID": "", "SLURM_JOB_ID": "13"}, "13"),
    ({"SLURM_JOB_ID": ""}, "default"),
    ({}, "default"),
])
def test_run_id_precedence(env: dict[str, str], run_id: str) -> None:
    assert default_run_id(env) == run_id


def test_node_name_prefers_slurmd_nodename(monkeypatch: pytest.MonkeyPatch) -> None:
    from resilient_slurm.paths import node_name

    monkeypatch.setenv("SLURMD_NODENAME", "gpu07")
    assert node_name() == "gpu07" and node_name("explicit") == "explicit"
    monkeypatch.setenv("SLURMD_NODENAME", "")
    assert node_name() not in ("", "gpu07")


def test_distributed_keeps_torchrun_over_slurm_and_strict_errors(caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("torch")
    from resilient_slurm.distributed import resolve_distributed_env
    from resilient_slurm.errors import ConfigError

    env = {"RANK": "1", "WORLD_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_LOCALID": "3",
           "MASTER_ADDR": "h0", "MASTER_PORT": "1234", "SLURM_JOB_NODELIST": "n1"}
    resolved = resolve_distributed_env(env)
    assert resolved is not None
    assert (resolved.rank, resolved.world_size, resolved.local_rank, resolved.master_addr,
            resolved.master_port, resolved.source) == (1, 2, 3, "h0", 1234, "torchrun")
    with caplog.at_level(logging.WARNING), pytest.raises(ConfigError, match=r"RANK='x' is not an integer"):
        resolve_distributed_env({"RANK": "x", "WORLD_SIZE": "2"})
    assert not _warnings(caplog)  # the error says it; no warning besides


# ------------------------------------------------------------------------- one reader of the environment
JOB_VAR = re.compile(r"^(SLURM_|SLURMD_)[A-Z_]+$|^(RANK|LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|MASTER_ADDR|MASTER_PORT)$")
READERS = {"get", "getenv", "pop", "setdefault"}
NOT_ENVIRONMENT = {"SLURM_VERSION"}  # a key of `scontrol show config` (doctor/cluster.py), not a variable


def _is_raw(node: ast.expr) -> bool:
    """``job.raw`` or a local ``raw``: JobEnv's verbatim values, for strict readers (distributed.py)."""
    return (isinstance(node, ast.Attribute) and node.attr == "raw") or (isinstance(node, ast.Name)
                                                                         and node.id == "raw")


def _job_var(node: ast.expr | None) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and JOB_VAR.match(node.value) \
            and node.value not in NOT_ENVIRONMENT:
        return node.value
    return None


def direct_reads(source: str, filename: str = "<src>") -> list[str]:
    """Reads of a job variable by name outside JobEnv: ``X.get("SLURM_…")``, ``os.getenv("RANK")``,
    ``X["WORLD_SIZE"]`` (not as an assignment target) and ``"RANK" in X``, on any mapping but JobEnv.raw.
    Writes (``os.environ["RANK"] = ...``, for child processes) are not reads."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Call) and node.args and (var := _job_var(node.args[0])):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            receiver = func.value if isinstance(func, ast.Attribute) else None
            if name in READERS and not (receiver is not None and _is_raw(receiver)):
                found.append(f"{filename}:{node.lineno}: {name}({var!r})")
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and (var := _job_var(node.slice)):
            if not _is_raw(node.value):
                found.append(f"{filename}:{node.lineno}: [{var!r}]")
        elif isinstance(node, ast.Compare) and (var := _job_var(node.left)):
            if any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops) \
                    and not all(_is_raw(c) for c in node.comparators):
                found.append(f"{filename}:{node.lineno}: {var!r} in ...")
    return found


def _library_modules() -> list[Path]:
    return [p for p in sorted(PKG.rglob("*.py")) if "examples" not in p.relative_to(PKG).parts]


def test_no_module_but_jobenv_reads_job_variables() -> None:
    found = [hit for p in _library_modules() if p != PKG / "jobenv.py"
             for hit in direct_reads(p.read_text(), str(p.relative_to(PKG.parent)))]
    assert not found, "read these through resilient_slurm.jobenv.JobEnv: " + "; ".join(found)


def test_the_reader_check_sees_reads_and_ignores_writes() -> None:
    src = ("import os\n"
           "a = os.environ.get('SLURM_JOB_ID')\n"
           "b = os.getenv('RANK')\n"
           "c = env['WORLD_SIZE']\n"
           "d = 'MASTER_PORT' in os.environ\n"
           "e = int(os.environ.get('SLURM_RESTART_COUNT', '0'))\n"
           "os.environ['RANK'] = '0'\n"
           "f = os.environ.get('RSLURM_RUN_ID')\n"
           "g = job.raw.get('SLURM_JOB_ID')\n")
    assert sorted(h.split(": ", 1)[1] for h in direct_reads(src)) == sorted([
        "get('SLURM_JOB_ID')", "getenv('RANK')", "['WORLD_SIZE']", "'MASTER_PORT' in ...",
        "get('SLURM_RESTART_COUNT')"])


def test_every_derived_job_port_is_clear_of_the_ephemeral_range() -> None:
    """The job port and a launcher's own port are never ones an outgoing connection may already hold
    (Linux's default ephemeral range 32768-60999): a rank 0 would fail with EADDRINUSE, or its peers meet a
    stranger at that port."""
    from resilient_slurm.jobenv import PORT_BASE, PORT_SPAN, job_master_port

    ports = {job_master_port(j) for j in range(0, 2 * PORT_SPAN + 7)}
    assert min(ports) == PORT_BASE and max(ports) == PORT_BASE + PORT_SPAN - 1 < 32768
    assert len(ports) == PORT_SPAN


def test_free_port_skips_the_ephemeral_range_and_ports_in_use(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import contextlib
    import random
    import socket

    from resilient_slurm import rendezvous
    from resilient_slurm.rendezvous import ephemeral_ports, free_port

    ephemeral = ephemeral_ports()
    assert ephemeral.start > 1024 and ephemeral.stop <= 65536
    bad = tmp_path / "range"
    bad.write_text("garbage\n")
    assert ephemeral_ports(str(bad)) == range(32768, 61000)  # unreadable: Linux's default
    port = free_port(range(9000, 15000))
    assert 9000 <= port < 15000
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", port))  # one address only: the check binds every address, as TCPStore does
        busy.listen()
        for seed in range(20):  # the held port is never given, whatever the order
            with contextlib.suppress(OSError):  # port + 1 may be someone else's just now
                assert free_port(range(port - 1, port + 2), rng=random.Random(seed)) != port
        # No port of the range is free: the kernel's choice, with a warning, rather than no start at all.
        caplog.clear()
        with caplog.at_level("WARNING", logger="resilient_slurm.rendezvous"):
            other = free_port(range(port, port + 1))
        assert other != port and "no free TCP port in" in caplog.text
    # A host whose ephemeral range covers the whole range (ip_local_port_range "1024 65535") still starts:
    wide = tmp_path / "wide"
    wide.write_text("1024\t65535\n")
    real = rendezvous.ephemeral_ports
    try:
        rendezvous.ephemeral_ports = lambda path=str(wide): real(path)  # type: ignore[assignment]
        caplog.clear()
        with caplog.at_level("WARNING", logger="resilient_slurm.rendezvous"):
            inside = free_port(range(15000, 32000))
        assert 15000 <= inside < 32000 and "outside the kernel's ephemeral range 1024-65535" in caplog.text
    finally:
        rendezvous.ephemeral_ports = real  # type: ignore[assignment]
