"""Every numeric setting is range-checked when it is read (flag, RSLURM_* variable, config file key,
explicit argument), malformed config files are ConfigErrors naming the file, and `rslurm launch` refuses
bad settings with exit 2 and one line before it starts any rank. Also: the launcher's node count."""

from __future__ import annotations

import logging
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import clean_env, run_rslurm

from resilient_slurm import ConfigError
from resilient_slurm import config as cfgmod
from resilient_slurm.config import SETTINGS, Number
from resilient_slurm.launcher.launch import Launcher, job_num_nodes

DOCS = Path(__file__).resolve().parent.parent / "docs"
NUMERIC = sorted(n for n, s in SETTINGS.items() if isinstance(s.parse, Number))
POSITIVE = ["collective_timeout", "control_timeout", "save_timeout", "term_grace", "cloud_notice_interval",
            "drain_poll_interval", "keep_last", "sync_every", "io_threads", "drain_threads", "s3_max_attempts",
            "straggler_window"]


def _number(name: str) -> Number:
    parse = SETTINGS[name].parse
    assert isinstance(parse, Number)
    return parse


# ---------------------------------------------------------------------------------------- the table
def test_the_numeric_settings_are_the_expected_ones() -> None:
    """A numeric setting added with a bare int/float parser would escape the range checks."""
    bare = [n for n, s in SETTINGS.items() if s.parse in (int, float)]
    assert not bare, f"settings parsed without a range check: {bare}"
    assert set(POSITIVE) <= set(NUMERIC)
    assert len(NUMERIC) == 30, NUMERIC


@pytest.mark.parametrize("name", NUMERIC)
def test_every_default_is_in_range(name: str) -> None:
    s = SETTINGS[name]
    if s.default is not None:
        assert _number(name).check(s.default) == s.default


@pytest.mark.parametrize("name", NUMERIC)
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "NaN", " Infinity ", "-1", "1e999"])
def test_non_finite_and_negative_values_are_refused_everywhere(home: Path, tmp_path: Path, name: str,
                                                               value: str) -> None:
    s = SETTINGS[name]
    rng = _number(name).range
    # environment
    with pytest.raises(ConfigError) as ei:
        cfgmod.resolve([name], {}, {s.env: value})
    msg = str(ei.value)
    assert s.env in msg and value in msg and rng in msg, msg
    # config file (TOML has nan and inf floats; other spellings go in as text)
    toml_value = {"nan": "nan", "inf": "inf", "-inf": "-inf", "-1": "-1"}.get(value, repr(value.strip()))
    path = tmp_path / "rslurm.toml"
    path.write_text(f"[rslurm]\n{name} = {toml_value}\n")
    with pytest.raises(ConfigError) as ei:
        cfgmod.resolve([name], {}, {"RSLURM_CONFIG": str(path)})
    msg = str(ei.value)
    assert str(path) in msg and repr(name) in msg and rng in msg, msg


@pytest.mark.parametrize("name", POSITIVE)
def test_zero_is_refused_where_it_makes_no_sense(home: Path, name: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(_number(name).range)):
        cfgmod.resolve([name], {}, {SETTINGS[name].env: "0"})


@pytest.mark.parametrize(("name", "value"), [
    ("keep_last", 0), ("keep_last", -2), ("save_timeout", math.nan), ("term_grace", -1.0), ("io_threads", 2.5),
    ("every_seconds", math.inf), ("collective_timeout", True), ("sync_every", "0"),
])
def test_explicit_arguments_are_checked_too(home: Path, name: str, value: object) -> None:
    with pytest.raises(ConfigError) as ei:
        cfgmod.resolve([name], {name: value}, {})
    msg = str(ei.value)
    assert msg.startswith(f"{name}={value!r}:") and _number(name).range in msg, msg


@pytest.mark.parametrize(("name", "value", "expected"), [
    ("save_timeout", "0.5", 0.5), ("requeue_margin", "0", 0.0), ("durable_wait", "0", 0.0),
    ("every_steps", "0", None), ("every_steps", "none", None), ("every_seconds", "0.0", None),
    ("keep_every", "100", 100), ("no_progress_limit", "0", None), ("max_restarts", "0", 0),
    ("max_restarts", "none", None), ("free_space_margin", "0", 0), ("replica_check_bytes", "0", 0),
    ("replica_check_bytes", "1.5M", 3 << 19), ("drain_bandwidth", "off", None), ("drain_bandwidth", "0", None),
    ("drain_bandwidth", "200M", 200 << 20), ("s3_part_size", "5M", 5 << 20), ("s3_part_size", "5G", 5 << 30),
    ("keep_last", " 1 ", 1),
])
def test_values_in_range_and_off_spellings_are_accepted(home: Path, name: str, value: str,
                                                        expected: object) -> None:
    assert cfgmod.resolve([name], {}, {SETTINGS[name].env: value})[name] == expected


@pytest.mark.parametrize(("name", "value"), [
    ("s3_part_size", "4M"), ("s3_part_size", "6G"), ("drain_bandwidth", "-1M"), ("free_space_margin", "-1"),
    ("max_restarts", "-1"), ("no_progress_limit", "-3"), ("keep_every", "-5"), ("local_min_free", "inf"),
    ("local_min_free", "nan%"), ("keep_last", "2.5"),
])
def test_out_of_range_values_name_the_variable_and_value(home: Path, name: str, value: str) -> None:
    env = SETTINGS[name].env
    with pytest.raises(ConfigError) as ei:
        cfgmod.resolve([name], {}, {env: value})
    assert f"{env}={value!r}: expected" in str(ei.value)


def test_parse_size_refuses_non_finite_sizes() -> None:
    for bad in ("inf", "nanM", "1e999G"):
        with pytest.raises(ValueError, match="finite"):
            cfgmod.parse_size(bad)
    assert cfgmod.parse_size("64MiB") == 64 << 20


def test_a_size_below_one_byte_is_refused_not_read_as_zero() -> None:
    """``0.5`` (no unit) would truncate to 0, which ``staging_memory_limit`` reads as "no limit"."""
    for bad in ("0.5", "0.9b", "1e-3", "1e-400", "1e-400G"):
        with pytest.raises(ValueError, match="less than one byte"):
            cfgmod.parse_size(bad)
    assert (cfgmod.parse_size("0.5G"), cfgmod.parse_size("0"), cfgmod.parse_size("1.3K")) == (1 << 29, 0, 1331)
    assert (cfgmod.parse_size("0.0"), cfgmod.parse_size("-0"), cfgmod.parse_size("0e5")) == (0, 0, 0)
    with pytest.raises(ConfigError, match="RSLURM_STAGING_MEMORY_LIMIT='0.5': expected a size >= 0, got '0.5': "
                                          "'0.5' is less than one byte"):
        cfgmod.validate({"RSLURM_STAGING_MEMORY_LIMIT": "0.5"})


def test_a_size_is_whole_bytes_read_exactly_and_bounded() -> None:
    """``1.5`` (no unit) was read as 1 byte; 26 digits went through a float (100000000000000004764729344)."""
    for bad in ("1.5", "2.5b", "1e-1"):
        with pytest.raises(ValueError, match="not a whole number of bytes|less than one byte"):
            cfgmod.parse_size(bad)
    assert cfgmod.parse_size("1e3") == 1000 and cfgmod.parse_size("9007199254740993") == 9007199254740993
    assert cfgmod.parse_size("3M") == 3 << 20 and cfgmod.parse_size(str(cfgmod.MAX_SIZE)) == cfgmod.MAX_SIZE
    for bad in ("99999999999999999999999999", "9999999T", "1e30"):
        with pytest.raises(ValueError, match="more than any store holds"):
            cfgmod.parse_size(bad)
    with pytest.raises(ConfigError, match="'1.5' is not a whole number of bytes"):
        cfgmod.validate({"RSLURM_STAGING_MEMORY_LIMIT": "1.5"})


def test_validate_checks_every_setting_of_the_environment_and_the_file(home: Path, tmp_path: Path) -> None:
    cfgmod.validate({"RSLURM_KEEP_LAST": "2"})
    with pytest.raises(ConfigError, match="RSLURM_S3_PART_SIZE"):
        cfgmod.validate({"RSLURM_S3_PART_SIZE": "1K"})
    path = tmp_path / "c.toml"
    path.write_text("sync_every = 0\n")
    with pytest.raises(ConfigError, match="sync_every"):
        cfgmod.validate({}, config_path=str(path))


# ---------------------------------------------------------------------------------------- config files
@pytest.mark.parametrize(("body", "expected"), [
    (b"rslurm = 5\n", ["'rslurm'", "[rslurm] table", "5"]),
    (b'rslurm = "x"\nkeep_last = 2\n', ["'rslurm'", "[rslurm] table"]),
    (b"keep_last = 3\n[rslurm]\nsave_timeout = 5\n", ["'keep_last'", "go under it"]),
    (b"keep_last = 3\nkeep_every = 4\n[rslurm]\n", ["'keep_every', 'keep_last'", "go under it"]),
    (b"[rslurm]\nkeep_last = 3\n[other]\nx = 1\n", ["'other'", "go under it"]),
    (b"keep_last = 3\n# caf\xe9 in latin-1\n", ["not UTF-8", "0xe9", "line 2"]),
    (b"\xff\xfe[\x00r\x00", ["not UTF-8", "0xff", "line 1"]),
], ids=["rslurm-int", "rslurm-string", "top-level-key", "top-level-keys", "other-table", "latin-1", "utf-16"])
def test_malformed_config_files_are_config_errors_naming_the_file(home: Path, tmp_path: Path, body: bytes,
                                                                  expected: list[str]) -> None:
    path = tmp_path / "bad.toml"
    path.write_bytes(body)
    with pytest.raises(ConfigError) as ei:
        cfgmod.resolve(["keep_last"], {}, {"RSLURM_CONFIG": str(path)})
    msg = str(ei.value)
    assert msg.startswith(f"config file {path}:") and all(e in msg for e in expected), msg


def test_a_well_formed_rslurm_table_and_a_flat_file_still_work(home: Path, tmp_path: Path) -> None:
    table = tmp_path / "table.toml"
    table.write_text("[rslurm]\nkeep_last = 4\nsave_timeout = 12.5\n")
    flat = tmp_path / "flat.toml"
    flat.write_text("keep_last = 5\n")
    assert cfgmod.resolve(["keep_last", "save_timeout"], {}, {}, config_path=str(table)) == {
        "keep_last": 4, "save_timeout": 12.5}
    assert cfgmod.resolve(["keep_last"], {}, {"RSLURM_CONFIG": str(flat)})["keep_last"] == 5


# ---------------------------------------------------------------------------------------- docs
def test_the_configuration_reference_states_each_range() -> None:
    text = (DOCS / "configuration.md").read_text()
    rows = {m.group(1): line for line in text.splitlines() if (m := re.match(r"\| `([a-z0-9_]+)` \|", line))}
    missing = [n for n in NUMERIC if f"| {_number(n).range} |" not in rows.get(n, "")]
    assert not missing, f"docs/configuration.md does not state the valid range of {missing}"


# ---------------------------------------------------------------------------------------- rslurm launch
def _rslurm(tmp_path: Path, *argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    return run_rslurm(*argv, env={"HOME": str(home), "RSLURM_LOCAL_DIR": str(tmp_path / "nvme"),
                                  "RSLURM_CONTROL_DIR": str(tmp_path / "ctl"), **(env or {})}, cwd=tmp_path)


@pytest.mark.parametrize(("argv", "env", "config", "names"), [
    (["--save-timeout", "-1"], {}, None, ["--save-timeout", "'-1'", "> 0"]),
    (["--save-timeout", "nan"], {}, None, ["--save-timeout", "'nan'", "finite"]),
    (["--keep-last", "0"], {}, None, ["--keep-last", "'0'", ">= 1"]),
    (["--term-grace=inf"], {}, None, ["--term-grace", "'inf'"]),
    (["--collective-timeout", "0"], {}, None, ["--collective-timeout"]),
    ([], {"RSLURM_KEEP_LAST": "0"}, None, ["RSLURM_KEEP_LAST", "'0'", ">= 1"]),
    ([], {"RSLURM_DRAIN_THREADS": "-4"}, None, ["RSLURM_DRAIN_THREADS", "'-4'"]),
    ([], {}, b"[rslurm]\nsave_timeout = nan\n", ["cfg.toml", "'save_timeout'", "finite"]),
    ([], {}, b"rslurm = 5\n", ["cfg.toml", "'rslurm'"]),
    ([], {}, b"keep_last = 2\n[rslurm]\nevery_steps = 5\n", ["cfg.toml", "'keep_last'", "[rslurm]"]),
    ([], {}, b"keep_last = '\xe9'\n", ["cfg.toml", "not UTF-8"]),
], ids=["save-timeout-negative", "save-timeout-nan", "keep-last-zero", "term-grace-inf", "collective-timeout-zero",
        "env-keep-last-zero", "env-drain-threads", "file-nan", "file-rslurm-int", "file-top-level", "file-latin-1"])
@pytest.mark.proc
def test_launch_refuses_bad_settings_with_exit_2_before_any_rank(tmp_path: Path, argv: list[str],
                                                                  env: dict[str, str], config: bytes | None,
                                                                  names: list[str]) -> None:
    marker = tmp_path / "rank-started"
    if config is not None:
        (tmp_path / "cfg.toml").write_bytes(config)
        env = {**env, "RSLURM_CONFIG": str(tmp_path / "cfg.toml")}
    r = _rslurm(tmp_path, "launch", *argv, "--", sys.executable, "-c", f"open({str(marker)!r}, 'w')", env=env)
    assert r.returncode == 2, f"exit {r.returncode}\n{r.stderr}"
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rslurm: error: "), r.stderr
    assert all(n in lines[0] for n in names), lines[0]
    assert not marker.exists(), "a rank started although the settings were refused"


@pytest.mark.proc
def test_launch_with_settings_in_range_runs_the_command(tmp_path: Path) -> None:
    marker = tmp_path / "rank-started"
    r = _rslurm(tmp_path, "launch", "--save-timeout", "0.5", "--keep-last", "1", "--requeue-margin", "0",
                "--", sys.executable, "-c", f"open({str(marker)!r}, 'w')")
    assert r.returncode == 0, r.stderr
    assert marker.exists()


@pytest.mark.proc
@pytest.mark.parametrize("argv", [
    ["daemon", "--drain-poll-interval", "nan", "--durable", "/nonexistent"],
    ["gc", "--keep-last", "0", "--dry-run"],
    ["ls", "--drain-threads", "0"],
])
def test_other_commands_refuse_out_of_range_flags(tmp_path: Path, argv: list[str]) -> None:
    r = _rslurm(tmp_path, *argv)
    assert r.returncode == 2, f"exit {r.returncode}\n{r.stderr}"
    assert "Traceback" not in r.stderr and f"rslurm: error: {argv[1]}=" in r.stderr, r.stderr


@pytest.mark.proc
def test_gc_stale_after_must_be_finite(tmp_path: Path) -> None:
    r = _rslurm(tmp_path, "gc", "--dry-run", "--stale-after", "nan")
    assert r.returncode == 2 and "--stale-after" in r.stderr and "finite" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


# ---------------------------------------------------------------------------------------- node count
@pytest.mark.parametrize(("env", "nodes", "warned"), [
    ({}, 1, None),
    ({"SLURM_JOB_NUM_NODES": "4", "SLURM_NNODES": "2"}, 4, None),
    ({"SLURM_NNODES": "3"}, 3, None),
    ({"SLURM_JOB_NUM_NODES": "two", "SLURM_NNODES": "2"}, 2, "SLURM_JOB_NUM_NODES"),
    ({"SLURM_JOB_NUM_NODES": "0", "SLURM_JOB_NODELIST": "n[1-3]"}, 3, "SLURM_JOB_NUM_NODES"),
    ({"SLURM_JOB_NUM_NODES": "-2", "SLURM_NNODES": "x", "SLURM_JOB_NODELIST": "a,b"}, 2, "SLURM_NNODES"),
    ({"SLURM_JOB_NUM_NODES": "2.5", "SLURM_JOB_NODELIST": "n1"}, 1, "SLURM_JOB_NUM_NODES"),
    ({"SLURM_JOB_NUM_NODES": "x", "SLURM_JOB_NODELIST": "n[1-"}, 1, "SLURM_JOB_NODELIST"),
])
def test_job_num_nodes_skips_malformed_variables_with_a_warning(
        caplog: pytest.LogCaptureFixture, env: dict[str, str], nodes: int, warned: str | None) -> None:
    with caplog.at_level(logging.WARNING, logger="resilient_slurm.launcher.launch"):
        assert job_num_nodes(env) == nodes
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    if warned is None:
        assert not warnings
    else:
        assert any(warned in w for w in warnings), warnings


@pytest.mark.parametrize(("env", "multi"), [
    ({"SLURM_JOB_NUM_NODES": "garbage", "SLURM_JOB_NODELIST": "n[1-2]"}, True),
    ({"SLURM_JOB_NUM_NODES": "garbage", "SLURM_JOB_NODELIST": "n1"}, False),
    ({"SLURM_JOB_NUM_NODES": "", "SLURM_NNODES": "8"}, True),
    ({"SLURM_JOB_NUM_NODES": "1"}, False),
])
def test_num_nodes_and_multi_node_agree(home: Path, tmp_path: Path, env: dict[str, str], multi: bool) -> None:
    launcher = Launcher(["true"], env={"HOME": str(home), "RSLURM_LOCAL_DIR": str(tmp_path / "nvme"),
                                       "RSLURM_CONTROL_DIR": str(tmp_path / "ctl")})
    launcher.env.update(env)
    assert launcher.multi_node() is multi
    assert (launcher.num_nodes() > 1) is multi


# ------------------------------------------------------------------------------------ typed settings
_TYPES = {"int": int, "float": (int, float), "str": str, "bool": bool}


def _allowed(annotation: str) -> tuple[type, ...]:
    out: list[type] = []
    for part in annotation.split("|"):
        part = part.strip()
        if part == "None":
            out.append(type(None))
        else:
            t = _TYPES[part]
            out.extend(t if isinstance(t, tuple) else (t,))
    return tuple(out)


def test_every_setting_is_a_typed_field_and_one_definition() -> None:
    """Settings reach the code as a typed, frozen object; its fields are the registry (one definition each)."""
    import dataclasses

    fields = {f.name: f for f in dataclasses.fields(cfgmod.Settings)}
    assert list(fields) == list(SETTINGS)
    for name, f in fields.items():
        assert SETTINGS[name].default == f.default and SETTINGS[name].parse is f.metadata["parse"]
    s = cfgmod.load({}, {})
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.keep_last = 5  # type: ignore[misc]


@pytest.mark.parametrize("source", ["default", "env", "file", "argument"])
def test_loaded_values_have_their_declared_types(source: str, tmp_path: Path) -> None:
    """Whatever the source, a value has the type its field declares: a file's `keep_last = 4` and the
    environment's "4" both give int 4, a size '64M' gives int bytes, 'true' gives bool."""
    import dataclasses

    given = {"keep_last": "4", "every_seconds": "2.5", "capture_rng": "false", "replica_check_bytes": "64M",
             "save_timeout": "30", "drain_bandwidth": "100M", "log_level": "debug", "max_restarts": "0"}
    env: dict[str, str] = {}
    args: dict[str, object] = {}
    if source == "env":
        env = {SETTINGS[k].env: v for k, v in given.items()}
    elif source == "file":
        body = "\n".join(f"{k} = {v if k in ('keep_last', 'max_restarts') else repr(v)}" for k, v in given.items())
        (tmp_path / "c.toml").write_text("[rslurm]\n" + body.replace("'", '"') + "\n")
        env = {"RSLURM_CONFIG": str(tmp_path / "c.toml")}
    elif source == "argument":
        args = {"keep_last": 4, "every_seconds": 2.5, "capture_rng": False, "replica_check_bytes": 64 << 20,
                "save_timeout": 30, "drain_bandwidth": 100 << 20, "log_level": "debug", "max_restarts": 0}
    s = cfgmod.load(args, env)
    for f in dataclasses.fields(s):
        v = getattr(s, f.name)
        assert isinstance(v, _allowed(str(f.type))), (f.name, v, f.type)
    if source != "default":
        assert (s.keep_last, s.every_seconds, s.capture_rng, s.replica_check_bytes) == (4, 2.5, False, 64 << 20)
        assert (s.drain_bandwidth, s.log_level, s.max_restarts) == (100 << 20, "DEBUG", 0)


def test_load_refuses_a_name_that_is_not_a_setting() -> None:
    with pytest.raises(TypeError, match="keep_lsat"):
        cfgmod.load({"keep_lsat": 2}, {})


@pytest.mark.parametrize("value", ["verbose", "5", ""])
def test_log_level_is_checked(value: str) -> None:
    env = {"RSLURM_LOG_LEVEL": value}
    if value == "":
        assert cfgmod.load({}, env).log_level == "INFO"  # empty: unset
        return
    with pytest.raises(ConfigError, match="RSLURM_LOG_LEVEL"):
        cfgmod.load({}, env)


@pytest.mark.proc
def test_launch_with_config_gives_the_file_to_the_ranks(tmp_path: Path) -> None:
    """`rslurm --config FILE launch`: the ranks' Checkpointer reads the same file as the launcher."""
    conf = tmp_path / "c.toml"
    conf.write_text("keep_last = 7\n")
    out = tmp_path / "seen"
    prog = ("import os, pathlib, sys; from resilient_slurm import config; "
            f"pathlib.Path({str(out)!r}).write_text(os.environ.get('RSLURM_CONFIG', '') + ' ' + "
            "str(config.load().keep_last))")
    env = clean_env({"RSLURM_LOCAL_DIR": str(tmp_path / "nvme"), "RSLURM_CONTROL_DIR": str(tmp_path / "ctl"),
                     "RSLURM_DAEMON": "off"})
    r = subprocess.run([sys.executable, "-m", "resilient_slurm.cli", "--config", str(conf), "launch", "-n", "1",
                        "--", sys.executable, "-c", prog], env=env, capture_output=True, text=True, timeout=120,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert out.read_text() == f"{conf} 7"


def test_an_explicit_unset_flag_wins_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """`rslurm gc --keep-every none` with RSLURM_KEEP_EVERY=10 set: the flag says "off", so off it is
    (the parsed None used to read as "not given" and let the variable through)."""
    import argparse

    from resilient_slurm import cliargs

    monkeypatch.setenv("RSLURM_KEEP_EVERY", "10")
    monkeypatch.setenv("RSLURM_DRAIN_BANDWIDTH", "100M")
    ns = argparse.Namespace(local_dir=None, durable=None, run_id=None, config=None, set_keep_every="none",
                            set_drain_bandwidth="off", set_keep_last=None)
    s = cliargs.inspect_settings(ns)
    assert s.keep_every is None and s.drain_bandwidth is None and s.keep_last == 3
    ns.set_keep_every, ns.set_drain_bandwidth = None, None
    s = cliargs.inspect_settings(ns)
    assert s.keep_every == 10 and s.drain_bandwidth == 100 << 20
