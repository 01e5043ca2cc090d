"""Settings: one registry of every key, resolved as argument > ``RSLURM_*`` environment > config file >
default. Unknown keys (in the environment or in the file) are errors that list the valid ones.

The config file is TOML: ``$RSLURM_CONFIG`` if set, else ``~/.config/rslurm/config.toml`` if present.
Keys are the setting names below (``local_dir = "/nvme/%n"``), all at the top level or all under a
``[rslurm]`` table. Every value is parsed and range-checked when it is read (:class:`Number` for the
numeric ones); a bad value, or a file that is not UTF-8 TOML of that shape, is a ConfigError naming it.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError
from .paths import id_problem, read_regular

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


_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


class SizeError(ValueError):
    """A value that reads as a number but not as a byte count (below one byte, a fraction of a byte, more
    than any store holds); the message says why."""


MAX_SIZE = (1 << 63) - 1  # bytes: more than any file, memory or store holds


def parse_size(v: str) -> int:
    """A byte count: ``1048576``, ``64M``, ``64MiB``, ``1.5G`` (binary units; a fraction of the unit is
    rounded down to whole bytes). Digits alone are read exactly (not through a float)."""
    s = v.strip().lower().removesuffix("ib").removesuffix("b")
    unit = s[-1] if s and s[-1] in _UNITS else ""
    num = s[: len(s) - len(unit)].strip()
    n: int | float
    try:
        n = int(num) * _UNITS[unit] if num.isascii() and num.isdigit() else float(num) * _UNITS[unit]
    except ValueError:
        raise ValueError(f"expected a size such as 1048576, 64M or 1.5G, got {v!r}") from None
    if not math.isfinite(n):
        raise ValueError(f"expected a finite size such as 1048576, 64M or 1.5G, got {v!r}")
    if n < 0:
        raise ValueError(f"expected a size >= 0, got {v!r}")
    if 0 < n < 1 or (n == 0 and any(c in "123456789" for c in num.partition("e")[0])):  # 1e-400 underflows
        # would be 0, which a setting reads as "off" or "no limit"
        raise SizeError(f"{v!r} is less than one byte: give a unit (512M, 0.5G), or 0 for none")
    if not unit and not float(n).is_integer():
        raise SizeError(f"{v!r} is not a whole number of bytes: give whole bytes or a unit (1.5K)")
    if n > MAX_SIZE:
        raise SizeError(f"{v!r} is more than any store holds (at most {MAX_SIZE} bytes)")
    return int(n)


def _size_text(n: float) -> str:
    """``5M``, ``5G``: a byte count in the binary units :func:`parse_size` reads."""
    for unit in ("T", "G", "M", "K"):
        k = _UNITS[unit.lower()]
        if n >= k and n % k == 0:
            return f"{int(n // k)}{unit}"
    return str(int(n))


@dataclass(frozen=True)
class Number:
    """Parser of a numeric setting that checks its range: finite, ``>= low`` (``> low`` when ``above``)
    and ``<= high``. Spellings in ``unset`` (and, with ``zero_unset``, a value of 0) mean unset: None.
    :func:`resolve` calls it on environment and file values, the CLI on flags, and :meth:`check` on
    explicit arguments; :attr:`range` is what error messages and docs/configuration.md state."""

    kind: type  # int or float
    low: float
    above: bool = False
    high: float | None = None
    size: bool = False  # read with parse_size: 64M, 1.5G
    unset: tuple[str, ...] = ()
    zero_unset: bool = False
    unset_doc: str = ""  # what unset means, e.g. "0/none (off)"

    def _bound(self, x: float) -> str:
        return _size_text(x) if self.size else str(int(x)) if self.kind is int else f"{x:g}"

    @property
    def range(self) -> str:
        """The valid values, e.g. ``an integer >= 1, or 0/none (off)``."""
        what = "a size" if self.size else "an integer" if self.kind is int else "a finite number"
        if self.high is None:
            text = f"{what} {'>' if self.above else '>='} {self._bound(self.low)}"
        else:
            text = f"{what} in {'(' if self.above else '['}{self._bound(self.low)}, {self._bound(self.high)}]"
        return f"{text}, or {self.unset_doc}" if self.unset_doc else text

    def __call__(self, v: str) -> int | float | None:
        s = v.strip()
        if s.lower() in self.unset:
            return None
        try:
            n: int | float = parse_size(s) if self.size else self.kind(s)
        except SizeError as exc:
            raise ValueError(f"expected {self.range}, got {v!r}: {exc}") from None
        except (ValueError, OverflowError):
            raise ValueError(f"expected {self.range}, got {v!r}") from None
        return self.check(n, shown=v)

    def check(self, n: Any, *, shown: Any = None) -> int | float | None:
        """``n`` if it is in range (None for an unset 0), else ValueError naming the range."""
        bad = ValueError(f"expected {self.range}, got {n if shown is None else shown!r}")
        if isinstance(n, bool) or not isinstance(n, (int, float)):
            raise bad
        if self.zero_unset and n == 0:
            return None
        if not math.isfinite(n) or n < self.low or (self.above and n == self.low) or (
                self.high is not None and n > self.high):
            raise bad
        if self.kind is int:
            if isinstance(n, float) and not n.is_integer():
                raise bad
            return int(n)
        return float(n)


def _seconds(zero_ok: bool = False) -> Number:
    """Seconds: finite, > 0 (>= 0 with ``zero_ok``)."""
    return Number(float, 0.0, above=not zero_ok)


def _count(low: int = 1) -> Number:
    """An integer count >= ``low``."""
    return Number(int, low)


_OFF = ("", "none")
_OPT_COUNT = Number(int, 1, unset=_OFF, zero_unset=True, unset_doc="0/none (off)")
_OPT_SECONDS = Number(float, 0.0, above=True, unset=_OFF, zero_unset=True, unset_doc="0/none (off)")
_LIMIT = Number(int, 0, unset=(*_OFF, "unlimited"), unset_doc="none (no limit)")  # 0 is a real value here
_SIZE = Number(int, 0, size=True)
_FAILURE_INTERVAL = Number(float, 0.0, above=True, unset=(*_OFF, "auto"), zero_unset=True,
                           unset_doc="0/none/auto (observed by the launcher, else 86400)")
_RATIO = Number(float, 1.0, above=True, unset=_OFF, zero_unset=True, unset_doc="0/none (off)")
_BANDWIDTH = Number(int, 0, above=True, size=True, unset=(*_OFF, "off"), zero_unset=True,
                    unset_doc="0/none/off (no cap)")
_S3_PART = Number(int, 5 << 20, high=5 << 30, size=True)  # S3's smallest and largest part


def _free_space(v: str) -> str:
    """A free-space watermark: a percentage of the filesystem (``10%``) or a size (``50G``)."""
    s = v.strip()
    if s.endswith("%"):
        pct = float(s[:-1])
        if not 0 <= pct < 100:
            raise ValueError(f"expected a percentage in [0, 100), got {v!r}")
        return s
    parse_size(s)
    return s


def _prom_path(v: str) -> str | None:
    """A Prometheus textfile path (must end in .prom: node_exporter reads nothing else), or unset."""
    s = v.strip()
    if s.lower() in ("", "none", "off"):
        return None
    if not s.endswith(".prom"):
        raise ValueError("node_exporter's textfile collector reads only *.prom files; expected a path such as "
                         f"/var/lib/node_exporter/textfile_collector/rslurm.prom, got {v!r}")
    return os.path.abspath(os.path.expanduser(s))


def _choice(*choices: str) -> Callable[[str], str]:
    def parse(v: str) -> str:
        s = v.strip().lower()
        if s not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}, got {v!r}")
        return s

    return parse


def _hang_timeout(v: str) -> float | None:
    """``auto`` (None: the component works it out: from the step times, from the job's size), ``off`` (inf:
    never), or seconds > 0."""
    s = v.strip().lower()
    if s in ("", "auto"):
        return None
    if s in ("off", "none"):
        return math.inf
    try:
        n = float(s)
    except ValueError:
        raise ValueError(f"expected auto, off or a number of seconds > 0, got {v!r}") from None
    if not math.isfinite(n) or n <= 0:
        raise ValueError(f"expected auto, off or a finite number of seconds > 0, got {v!r}")
    return n


def _identifier(kind: str) -> Callable[[str], str]:
    """A run id or node name, checked by the one validation of identifiers (:func:`~.paths.id_problem`):
    it becomes a directory name and a durable key, so ``..``, ``/``, a control character are refused."""
    def parse(v: str) -> str:
        problem = id_problem(kind, v)
        if problem is not None:
            raise ValueError(problem)
        return v

    return parse


def _durable_url(v: str) -> str:
    """A durable tier URL: an absolute path, ``file:///absolute/path`` or ``scheme://bucket/prefix``
    (checked by :func:`resilient_slurm.storage.registry.parse_url`; the backend is imported on first use)."""
    from .storage.registry import parse_url

    try:
        parse_url(v)
    except ConfigError as exc:
        raise ValueError(str(exc).removeprefix("durable: ")) from None
    return v


def _log_level(v: str) -> str:
    """A logging level name (``debug``, ``INFO``, ``warn``...) normalized to logging's spelling."""
    s = v.strip().upper()
    s = "WARNING" if s == "WARN" else s
    if s not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise ValueError(f"expected one of DEBUG, INFO, WARNING, ERROR, CRITICAL, got {v!r}")
    return s


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


def _key(parse: Callable[[str], Any], default: Any, component: str, *help: str) -> Any:
    """A field of :class:`Settings`: its default, and its parser, component and meaning as metadata."""
    return dataclasses.field(default=default, metadata={"parse": parse, "component": component,
                                                        "help": "".join(help)})


@dataclass(frozen=True)
class Settings:
    """Every setting, resolved and typed (:func:`load`). Each field's metadata is its :class:`Setting`
    (parser, meaning, component); :data:`SETTINGS` is built from these fields, so a key has one definition."""

    local_dir: str | None = _key(str, None, "checkpoint",
                "node-local checkpoint root; '%n' expands to the node name (default: $TMPDIR/rslurm-<uid>/%n)")
    durable: str | None = _key(_durable_url, None, "checkpoint",
                'durable tier URL: /path, file:///path (Lustre or any shared filesystem) or s3://bucket/prefix; '
                '`rslurm daemon` drains committed steps there and restore falls back to it')
    run_id: str | None = _key(_identifier("run id"), None, "checkpoint",
                "run identifier (default: Slurm job id, array-aware, else 'default')")
    every_steps: int | None = _key(_OPT_COUNT, None, "checkpoint",
                'save every N optimizer steps')
    every_seconds: float | None = _key(_OPT_SECONDS, None, "checkpoint",
                'save when this many seconds passed since the last save')
    auto_cadence: str = _key(_choice("on", "off"), "on", "checkpoint",
                "on: without every_steps and every_seconds, save on a time cadence chosen from the measured save "
                "cost and failure_interval (Daly's optimum, between 60 s and 1 h, at least twice the background "
                "write; the first save 60 s after the start), logged at the start and when it changes; off: no "
                "periodic save unless every_steps or every_seconds is set")
    failure_interval: float | None = _key(_FAILURE_INTERVAL, None, "checkpoint",
                "mean seconds between unannounced failures (a rank killed, a node lost, a hang) that the default "
                "cadence plans for; auto: `rslurm launch` sets what the run's history shows (its run time over "
                "such failures, once there was one), else 86400")
    keep_last: int = _key(_count(), 3, "checkpoint",
                'committed checkpoints kept per tier')
    keep_every: int | None = _key(_OPT_COUNT, None, "checkpoint",
                'also keep every step that is a multiple of N')
    capture_rng: bool = _key(_bool, True, "checkpoint",
                'capture and restore RNG state of every generator per rank')
    sync_every: int = _key(_count(), 1, "checkpoint",
                'steps between the cheap collective in which ranks agree to save (time cadence and emergency requests'
                ' are seen at this granularity)')
    io_threads: int = _key(_count(), 4, "checkpoint",
                'parallel pwrite/pread calls per rank')
    collective_timeout: float = _key(_seconds(), 600.0, "checkpoint",
                'seconds before a checkpoint collective gives up')
    node_name: str | None = _key(_identifier("node name"), None, "checkpoint",
                'storage node name (default: $SLURMD_NODENAME, else the hostname)')
    replica_check: str = _key(_choice("warn", "fail", "off"), "warn", "checkpoint",
                'what copies of DDP-replicated or DTensor-replicated state that differ between ranks do at a save: '
                "warn (a replica_mismatch event and warning; each rank's copy is saved), fail (the save fails), off "
                '(not checked)')
    replica_check_bytes: int = _key(_SIZE, 32 << 20, "checkpoint",
                'bytes of DDP/DTensor-replicated state each rank digests per save for replica_check, a rotating slice'
                ' (0: only the free cross-node comparison)')
    restore_fallback: str = _key(_choice("fail", "fresh"), "fail", "checkpoint",
                'what restore does when committed checkpoints exist (or the durable tier cannot be listed) but none '
                'can be restored: fail (raise; a storage failure requeues the job under `rslurm launch`) or fresh '
                '(start from step 0 with a warning)')
    peer_replicas: str = _key(_choice("auto", "on", "off"), "auto", "checkpoint",
                "copy each committed step of a node's storage domain to a partner domain's local directory (on "
                "another node), in the background after the commit, so a node that comes back empty restores "
                "from its partner instead of the durable tier: auto (when the domains span several nodes), on "
                "(also between domains of one node), off")
    free_space_margin: int = _key(_count(0), 64 << 20, "checkpoint",
                'bytes that must stay free after a save')
    staging_memory_limit: int = _key(_SIZE, 0, "checkpoint",
                'host memory a rank may hold to stage its tensor state for a save; when the state is larger, the '
                'save copies and writes it in waves of this size while training waits (the stall grows, the memory '
                'does not); 0: no limit (the whole state is staged at once and written in the background)')
    control_socket: str | None = _key(str, None, "rank",
                "control socket of this node's launcher; `rslurm launch` sets it for its ranks, 'off' disables it "
                '(ranks then rely on signals alone)')
    control_timeout: float = _key(_seconds(), 2.0, "rank",
                'seconds a rank waits for the control socket before it carries on without it')
    trap_signals: bool = _key(_bool, True, "rank",
                'ranks turn SIGTERM and save_signal into an emergency save at the next step (only where the program '
                'left the default handler in place)')
    straggler_ratio: float | None = _key(_RATIO, 1.5, "rank",
                "a rank whose own step time (its work between two ckpt.step() calls, less the time it waited for "
                "its peers) is at least this many times its peers' median over a window is a straggler: a "
                "straggler event, a warning and a line in `rslurm status` (0/none: off)")
    straggler_window: int = _key(_count(), 100, "rank",
                "steps per straggler window: each rank's median own step time over this many steps is compared")
    resume_tolerance: float = _key(Number(float, 0.0), 0.0, "rank",
                "after a resume, a metric a rank records for a step it trains again (ckpt.step(..., metrics=...)) "
                "agrees with the value recorded before the stop when they differ by at most this fraction of the "
                "larger one; 0: only equal values agree (a deterministic program reproduces every bit). Also "
                "what `rslurm rehearse` compares with")
    save_signal: str = _key(_signal_name, "USR2", "launcher",
                'signal the launcher sends every rank to request an emergency save (`scancel --signal` reaches other '
                "nodes), and ranks trap; 'none' disables. Not USR1 under NCCL, which uses it")
    control_dir: str | None = _key(str, None, "launcher",
                "directory of the launcher's control sockets (default: $XDG_RUNTIME_DIR/rslurm, else "
                '/tmp/rslurm-<uid>/run)')
    max_restarts: int | None = _key(_LIMIT, None, "launcher",
                "requeue at most this many times (Slurm's restart count; 0 = never requeue, none = no limit)")
    no_progress_limit: int | None = _key(_OPT_COUNT, 3, "launcher",
                'hold the job after this many restarts in a row that committed no new step (0 or none disables)')
    save_timeout: float = _key(_seconds(), 300.0, "launcher",
                'seconds the emergency save may take when Slurm gives no deadline (local mode, no time limit); '
                "also what a local launcher's ranks give their emergency save once that launcher died")
    requeue_margin: float = _key(_seconds(zero_ok=True), 3.0, "launcher",
                "seconds kept before the job's end (time limit or end of GraceTime) for teardown and the requeue call")
    term_grace: float = _key(_seconds(), 10.0, "launcher",
                "seconds between SIGTERM and SIGKILL when the launcher tears the ranks' process trees down; also how "
                "long a local launcher's ranks take to exit after their emergency save once that launcher died, "
                "before they kill themselves and their child processes")
    hang_timeout: float | None = _key(_hang_timeout, None, "launcher",
                "seconds without a step on any rank of the launcher's node after which the job is hung: its "
                "ranks' Python stacks are written to the run directory, a hang event names the ranks and "
                "their last step, and the ranks are torn down; auto: 10 times the slowest of the recent "
                "steps, at least 120 s; off: never")
    in_job_restarts: int = _key(_count(0), 3, "launcher",
                "times the launcher restarts the ranks inside the same allocation (a new srun step; in local "
                "mode new processes) after a hang or a rank killed by a signal, from the last commit, with "
                "exponential backoff, before it falls back to requeue; 0: never")
    hang_startup_timeout: float = _key(_seconds(), 1800.0, "launcher",
                "seconds a rank may take from building its Checkpointer to its first step (restore "
                "included) before the job counts as hung")
    startup_timeout: float | None = _key(_hang_timeout, None, "launcher",
                "seconds from the start of the ranks' job step until a rank on the launcher's node has built "
                "its Checkpointer (srun's launch, the imports, the rendezvous of torch.distributed); past it "
                "the start failed: the ranks' stacks are written, the ranks torn down, and the incarnation "
                "ends as startup with one message naming the rendezvous address and port, what did not "
                "resolve or connect, and what to set. auto: 300 s plus 1 s for every 4 nodes of the job; off: "
                "never (a program that builds no Checkpointer but runs longer needs off, unless py-spy shows "
                "its ranks past the rendezvous)")
    health_check: str = _key(_choice("on", "off"), "on", "launcher",
                "on: before each launch of the ranks (and each in-job restart) check every node: its local "
                "directory is writable with room for the newest checkpoint, and its GPUs answer nvidia-smi when "
                "it has any; an unhealthy node is excluded (srun --exclude) when the allocation has spare nodes, "
                "else the job is requeued with the node excluded; off: no built-in checks")
    health_check_command: str | None = _key(str, None, "launcher",
                "a shell command run on every node before each launch, with the built-in checks; a non-zero exit "
                "marks the node unhealthy (its last output line is the evidence)")
    health_timeout: float = _key(_seconds(), 120.0, "launcher",
                "seconds the node health checks may take; a node that has not answered by then is unhealthy")
    cloud_notice: str = _key(_choice("off", "aws", "gce", "generic"), "off", "launcher",
                'poll the instance metadata service for a termination notice (aws, gce, generic URL) and save on one')
    cloud_notice_url: str | None = _key(str, None, "launcher",
                "metadata URL to poll (default: the provider's standard URL; required for generic)")
    cloud_notice_interval: float = _key(_seconds(), 5.0, "launcher",
                'seconds between metadata polls')
    slurm_backend: str = _key(_choice("cli", "pyslurm"), "cli", "launcher",
                'how rslurm talks to Slurm: scontrol/scancel commands, or libslurm through pyslurm when installed')
    durable_wait: float = _key(_seconds(zero_ok=True), 300.0, "launcher",
                "seconds the launcher waits, after the emergency commit (bounded by the job's deadline) or at the end"
                ' of a completed job, for the newest step to become durable before it requeues or exits; 0 = do not '
                'wait')
    daemon: str = _key(_choice("auto", "off"), "auto", "launcher",
                'auto: with a durable tier set and no `rslurm daemon` service on a node, the launcher runs one as a '
                'job step (srun --overlap) or a local process; off: never')
    drain_threads: int = _key(_count(), 8, "storage",
                'parallel transfers (file pieces, S3 parts) per node to and from the durable tier')
    durable_compression: str = _key(_choice("auto", "zstd", "off"), "auto", "storage",
                "how the daemon stores shards on the durable tier: zstd = compressed where a sample of the file "
                "shrinks by 3% or more (zstd level 1 over bytes grouped by element, so exponents compress), as "
                "it is otherwise; off = as they are; auto = zstd on S3, off on a POSIX path. Restore, verify and "
                "export read either kind whatever this says")
    drain_bandwidth: int | None = _key(_BANDWIDTH, None, "storage",
                "cap on the daemon's upload bandwidth in bytes/s (e.g. 200M), to protect shared storage; unset = no "
                'cap')
    local_min_free: str = _key(_free_space, "10%", "storage",
                'the daemon keeps at least this much free in the local tier (a percentage or a size) by evicting '
                'durable steps first, never the newest step that is not yet durable')
    drain_poll_interval: float = _key(_seconds(), 5.0, "storage",
                "seconds between the daemon's rescans of the local tier (it also reacts at once to filesystem events "
                'through watchdog)')
    metrics_textfile: str | None = _key(_prom_path, None, "storage",
                'the daemon writes its Prometheus metrics to this file (must end in .prom; e.g. '
                "/var/lib/node_exporter/textfile_collector/rslurm.prom for node_exporter's textfile collector), "
                'replaced atomically after every transfer and every poll interval; unset = no metrics file')
    s3_endpoint_url: str | None = _key(str, None, "storage",
                'S3 endpoint for any S3-compatible store (default: AWS, or $AWS_ENDPOINT_URL_S3)')
    s3_region: str | None = _key(str, None, "storage",
                "S3 region (default: boto3's usual chain)")
    s3_part_size: int = _key(_S3_PART, 64 << 20, "storage",
                'multipart part size for S3 transfers (>= 5M)')
    s3_max_attempts: int = _key(_count(), 8, "storage",
                'attempts per S3 request on transient errors (503 SlowDown, resets, timeouts), with jittered '
                'exponential backoff')
    config: str | None = _key(str, None, "cli",
                'path of the TOML config file')
    log_level: str = _key(_log_level, "INFO", "cli",
                'log level of rslurm commands and of the example programs')


SETTINGS: dict[str, Setting] = {
    f.name: Setting(f.name, f.metadata["parse"], f.default, f.metadata["help"], f.metadata["component"])
    for f in dataclasses.fields(Settings)
}

# Variables in the RSLURM_ namespace that are not settings but are set for ranks by our own tools.
RESERVED_ENV = {"RSLURM_CONFIG", "RSLURM_CONTROL_NODE", "RSLURM_FAILPOINTS", "RSLURM_HEALTH_CHECK_MARK",
                "RSLURM_LAUNCHER_PID", "RSLURM_REHEARSE_STEPS", "RSLURM_RUN_WRITER"}


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


def _config_file(path: str | None, env: Mapping[str, str]) -> str | None:
    """The config file to read (explicit path, $RSLURM_CONFIG, or the per-user default if present)."""
    explicit = path or env.get("RSLURM_CONFIG")
    candidate = explicit or os.path.join(os.path.expanduser("~"), ".config", "rslurm", "config.toml")
    if not os.path.exists(candidate):
        if explicit:
            raise ConfigError(f"config file {candidate} does not exist (set by --config or RSLURM_CONFIG)")
        return None
    return candidate


MAX_CONFIG_BYTES = 1 << 20  # every setting with a long comment is a few KiB


def _read_toml(candidate: str) -> dict[str, Any]:
    """The file's settings table: ``[rslurm]`` if there is one, else the top level. Keys are checked."""
    try:  # a regular file only (never a FIFO, a device, /dev/zero), at most MAX_CONFIG_BYTES
        raw = read_regular(candidate, MAX_CONFIG_BYTES, follow=True, what="a config file",
                           where="--config / RSLURM_CONFIG", error=lambda m: ConfigError(f"config file {m}"))
    except OSError as exc:
        raise ConfigError(f"config file {candidate}: {exc}") from exc
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise ConfigError(f"config file {candidate}: not UTF-8 text (byte 0x{raw[exc.start]:02x} on line "
                          f"{line}); TOML files must be UTF-8") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {candidate}: {exc}") from exc
    if "rslurm" in data:
        table = data["rslurm"]
        if not isinstance(table, dict):
            raise ConfigError(f"config file {candidate}: key 'rslurm' must be the [rslurm] table of settings, got "
                              f"{table!r}")
        others = sorted(k for k in data if k != "rslurm")
        if others:
            raise ConfigError(f"config file {candidate}: top-level key{'s' if len(others) > 1 else ''} "
                              f"{', '.join(map(repr, others))} next to the [rslurm] table; with an [rslurm] table, "
                              "settings go under it (move them below [rslurm])")
        data = table
    for k in data:
        if k not in SETTINGS:
            raise ConfigError(
                f"config file {candidate}: unknown key {k!r}{_suggest(k, list(SETTINGS))}; valid keys: "
                + ", ".join(sorted(SETTINGS))
            )
    return dict(data)


def load_file(path: str | None, env: Mapping[str, str]) -> dict[str, Any]:
    """Read the TOML config file (explicit path, $RSLURM_CONFIG, or the per-user default)."""
    candidate = _config_file(path, env)
    return {} if candidate is None else _read_toml(candidate)


def _check_argument(s: Setting, value: Any) -> Any:
    """An explicit argument (``Checkpointer(keep_last=...)``, a parsed flag) checked like the environment's
    value: numbers against their range; strings go through the setting's parser."""
    try:
        if isinstance(value, str):
            return s.parse(value)
        if isinstance(s.parse, Number):
            return s.parse.check(value)
    except ValueError as exc:
        raise ConfigError(f"{s.name}={value!r}: {exc}") from exc
    return value


def resolve(
    names: list[str],
    args: Mapping[str, Any],
    env: Mapping[str, str] | None = None,
    *,
    config_path: str | None = None,
) -> dict[str, Any]:
    """Resolve ``names``: explicit non-None argument > environment > config file > default. Every value
    used is parsed and range-checked (:class:`Number`); a bad one is a ConfigError naming its source."""
    env = os.environ if env is None else env
    _check_env(env)
    path = _config_file(config_path, env)
    file_values = {} if path is None else _read_toml(path)
    out: dict[str, Any] = {}
    for name in names:
        s = SETTINGS[name]
        if args.get(name) is not None:
            out[name] = _check_argument(s, args[name])
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
                raise ConfigError(f"config file {path}: key {name!r}={v!r}: {exc}") from exc
        else:
            out[name] = s.default
    return out


def load(args: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None, *,
         config_path: str | None = None) -> Settings:
    """Every setting, typed: explicit non-None ``args`` (``Checkpointer(keep_last=...)``, parsed flags) >
    ``RSLURM_*`` in ``env`` > config file > default. Every value is parsed and range-checked, including the
    ones this caller does not use: one broken key fails every command the same way, naming it."""
    args = dict(args or {})
    unknown = sorted(set(args) - set(SETTINGS))
    if unknown:
        raise TypeError(f"not settings: {', '.join(unknown)}")
    return Settings(**resolve(list(SETTINGS), args, env, config_path=config_path))


def validate(env: Mapping[str, str] | None = None, *, config_path: str | None = None) -> None:
    """Parse and range-check every setting the environment and the config file set. ``rslurm launch``
    calls it before it starts a rank, so that a value only a rank reads fails there, as a ConfigError."""
    load({}, env, config_path=config_path)
