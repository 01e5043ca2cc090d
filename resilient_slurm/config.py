"""Settings: one registry of every key, resolved as argument > ``RSLURM_*`` environment > config file >
default. Unknown keys (in the environment or in the file) are errors that list the valid ones.

The config file is TOML: ``$RSLURM_CONFIG`` if set, else ``~/.config/rslurm/config.toml`` if present.
Keys are the setting names below (``local_dir = "/nvme/%n"``), optionally under a ``[rslurm]`` table.
"""

from __future__ import annotations

import difflib
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib  # type: ignore[no-redef]

ENV_PREFIX = "RSLURM_"


def _bool(v: str) -> bool:
    s = v.strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean (1/0, true/false, yes/no), got {v!r}")


def _opt_int(v: str) -> int | None:
    return None if v.strip().lower() in ("", "none", "0") else int(v)


def _opt_float(v: str) -> float | None:
    return None if v.strip().lower() in ("", "none", "0") else float(v)


def _limit(v: str) -> int | None:
    """A count where 0 is a real value (0 restarts allowed) and ``none`` means no limit."""
    if v.strip().lower() in ("", "none", "unlimited"):
        return None
    n = int(v)
    if n < 0:
        raise ValueError(f"expected an integer >= 0 or 'none', got {v!r}")
    return n


def _choice(*choices: str) -> Callable[[str], str]:
    def parse(v: str) -> str:
        s = v.strip().lower()
        if s not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}, got {v!r}")
        return s

    return parse


def _signal_name(v: str) -> str:
    """A signal name for ranks (``USR2``, ``SIGUSR2``, ``TERM``...) normalized to ``USR2``, or ``none``."""
    s = v.strip().upper()
    if s in ("", "NONE", "OFF"):
        return "none"
    name = s[3:] if s.startswith("SIG") else s
    import signal as _signal

    if not hasattr(_signal, "SIG" + name) or name in ("KILL", "STOP"):
        raise ValueError(f"expected a catchable signal name such as USR2, TERM, URG or 'none', got {v!r}")
    return name


@dataclass(frozen=True)
class Setting:
    """One configuration key: its name, parser, default and meaning."""

    name: str
    parse: Callable[[str], Any]
    default: Any
    help: str
    component: str

    @property
    def env(self) -> str:
        """Environment variable that sets it."""
        return ENV_PREFIX + self.name.upper()


SETTINGS: dict[str, Setting] = {
    s.name: s
    for s in [
        Setting("local_dir", str, None, "node-local checkpoint root; '%n' expands to the node name "
                "(default: $TMPDIR/rslurm-<uid>/%n)", "checkpoint"),
        Setting("durable", str, None, "durable tier URL: /path, file:///path or s3://bucket/prefix (read by the drain daemon, which is not built yet; the Checkpointer only logs it)", "checkpoint"),
        Setting("run_id", str, None, "run identifier (default: Slurm job id, array-aware, else 'default')",
                "checkpoint"),
        Setting("every_steps", _opt_int, None, "save every N optimizer steps", "checkpoint"),
        Setting("every_seconds", _opt_float, None, "save when this many seconds passed since the last save",
                "checkpoint"),
        Setting("keep_last", int, 3, "committed checkpoints kept per tier", "checkpoint"),
        Setting("keep_every", _opt_int, None, "also keep every step that is a multiple of N", "checkpoint"),
        Setting("capture_rng", _bool, True, "capture and restore RNG state of every generator per rank",
                "checkpoint"),
        Setting("sync_every", int, 1, "steps between the cheap collective in which ranks agree to save "
                "(time cadence and emergency requests are seen at this granularity)", "checkpoint"),
        Setting("io_threads", int, 4, "parallel pwrite/pread calls per rank", "checkpoint"),
        Setting("collective_timeout", float, 600.0, "seconds before a checkpoint collective gives up",
                "checkpoint"),
        Setting("node_name", str, None, "storage node name (default: $SLURMD_NODENAME, else the hostname)",
                "checkpoint"),
        Setting("free_space_margin", int, 64 << 20, "bytes that must stay free after a save", "checkpoint"),
        Setting("control_socket", str, None, "control socket of this node's launcher; `rslurm launch` sets it "
                "for its ranks, 'off' disables it (ranks then rely on signals alone)", "rank"),
        Setting("control_timeout", float, 2.0, "seconds a rank waits for the control socket before it "
                "carries on without it", "rank"),
        Setting("trap_signals", _bool, True, "ranks turn SIGTERM and save_signal into an emergency save at "
                "the next step (only where the program left the default handler in place)", "rank"),
        Setting("save_signal", _signal_name, "USR2", "signal the launcher sends every rank to request an "
                "emergency save (`scancel --signal` reaches other nodes), and ranks trap; 'none' disables. "
                "Not USR1 under NCCL, which uses it", "launcher"),
        Setting("control_dir", str, None, "directory of the launcher's control sockets (default: "
                "$XDG_RUNTIME_DIR/rslurm, else /tmp/rslurm-<uid>/run)", "launcher"),
        Setting("max_restarts", _limit, None, "requeue at most this many times (Slurm's restart count; "
                "0 = never requeue, none = no limit)", "launcher"),
        Setting("no_progress_limit", _opt_int, 3, "hold the job after this many restarts in a row that "
                "committed no new step (0 or none disables)", "launcher"),
        Setting("save_timeout", float, 300.0, "seconds the emergency save may take when Slurm gives no "
                "deadline (local mode, no time limit)", "launcher"),
        Setting("requeue_margin", float, 3.0, "seconds kept before the job's end (time limit or end of "
                "GraceTime) for teardown and the requeue call", "launcher"),
        Setting("term_grace", float, 10.0, "seconds between SIGTERM and SIGKILL when the launcher tears "
                "the ranks' process trees down", "launcher"),
        Setting("cloud_notice", _choice("off", "aws", "gce", "generic"), "off", "poll the instance "
                "metadata service for a termination notice (aws, gce, generic URL) and save on one",
                "launcher"),
        Setting("cloud_notice_url", str, None, "metadata URL to poll (default: the provider's standard "
                "URL; required for generic)", "launcher"),
        Setting("cloud_notice_interval", float, 5.0, "seconds between metadata polls", "launcher"),
        Setting("slurm_backend", _choice("cli", "pyslurm"), "cli", "how rslurm talks to Slurm: scontrol/"
                "scancel commands, or libslurm through pyslurm when installed", "launcher"),
        Setting("config", str, None, "path of the TOML config file", "cli"),
        Setting("log_level", str, "INFO", "log level of rslurm commands and of the example programs", "cli"),
    ]
}

# Variables in the RSLURM_ namespace that are not settings but are set for ranks by our own tools.
RESERVED_ENV = {"RSLURM_CONFIG", "RSLURM_FAILPOINTS"}


def _suggest(key: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(key, valid, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _check_env(env: Mapping[str, str]) -> None:
    valid_env = {s.env for s in SETTINGS.values()} | RESERVED_ENV
    for k in env:
        if k.startswith(ENV_PREFIX) and k not in valid_env:
            raise ConfigError(
                f"unknown environment variable {k}{_suggest(k, sorted(valid_env))}; valid: "
                + ", ".join(sorted(valid_env))
            )


def load_file(path: str | None, env: Mapping[str, str]) -> dict[str, Any]:
    """Read the TOML config file (explicit path, $RSLURM_CONFIG, or the per-user default)."""
    explicit = path or env.get("RSLURM_CONFIG")
    candidate = explicit or os.path.join(os.path.expanduser("~"), ".config", "rslurm", "config.toml")
    if not os.path.exists(candidate):
        if explicit:
            raise ConfigError(f"config file {candidate} does not exist (set by --config or RSLURM_CONFIG)")
        return {}
    try:
        with open(candidate, "rb") as f:
            data = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"config file {candidate}: {exc}") from exc
    data = data.get("rslurm", data)
    for k in data:
        if k not in SETTINGS:
            raise ConfigError(
                f"config file {candidate}: unknown key {k!r}{_suggest(k, list(SETTINGS))}; valid keys: "
                + ", ".join(sorted(SETTINGS))
            )
    return dict(data)


def resolve(
    names: list[str],
    args: Mapping[str, Any],
    env: Mapping[str, str] | None = None,
    *,
    config_path: str | None = None,
) -> dict[str, Any]:
    """Resolve ``names``: explicit non-None argument > environment > config file > default."""
    env = os.environ if env is None else env
    _check_env(env)
    file_values = load_file(config_path, env)
    out: dict[str, Any] = {}
    for name in names:
        s = SETTINGS[name]
        if args.get(name) is not None:
            out[name] = args[name]
        elif s.env in env and env[s.env] != "":
            try:
                out[name] = s.parse(env[s.env])
            except ValueError as exc:
                raise ConfigError(f"{s.env}={env[s.env]!r}: {exc}") from exc
        elif name in file_values:
            v = file_values[name]
            try:
                out[name] = s.parse(str(v))  # the environment's parser: 2.5 or true is no int
            except ValueError as exc:
                raise ConfigError(f"config key {name!r}={v!r}: {exc}") from exc
        else:
            out[name] = s.default
    return out
