"""``rslurm``: the command-line entry point. The only place that configures logging.

Implemented now: ``launch``, ``daemon``, ``status``, inspection of the node-local tier (``ls``, ``show``,
``verify``) and the demo. ``submit``, ``gc``, ``export`` and ``doctor`` arrive with the CLI issue.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from . import __version__, config, doctor, submit
from .errors import ConfigError, ResilientSlurmError
from .manifest import MANIFEST_NAME, Manifest, parse_step_dirname, step_dirname
from .paths import default_local_dir, default_run_id, expand_local_dir, node_name
from .storage.registry import DURABLE_SETTINGS

if TYPE_CHECKING:
    from .checkpoint.verify import StepReport

log = logging.getLogger("resilient_slurm.cli")


def _root(args: argparse.Namespace) -> str:
    cfg = config.resolve(["local_dir", "node_name", "log_level"], {"local_dir": args.local_dir},
                         config_path=args.config)
    return expand_local_dir(cfg["local_dir"] or default_local_dir(), node_name(cfg["node_name"]))


def _runs(root: str, run_id: str | None) -> list[str]:
    if run_id:
        return [run_id]
    try:
        return sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)) and not d.startswith("."))
    except FileNotFoundError:
        return []


def _steps(run_dir: str) -> list[int]:
    try:
        names = os.listdir(run_dir)
    except FileNotFoundError:
        return []
    return sorted(s for n in names if (s := parse_step_dirname(n)) is not None)


def _load(step_dir: str) -> Manifest | None:
    try:
        with open(os.path.join(step_dir, MANIFEST_NAME), "rb") as f:
            return Manifest.from_json(f.read(), source=os.path.join(step_dir, MANIFEST_NAME))
    except (OSError, ResilientSlurmError):
        return None


def _age(t: float) -> str:
    s = max(0, int(time.time() - t))
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= n:
            return f"{s // n}{unit}"
    return f"{s}s"


def cmd_ls(args: argparse.Namespace) -> int:
    root = _root(args)
    rows: list[dict[str, Any]] = []
    for run in _runs(root, args.run_id):
        for s in _steps(os.path.join(root, run)):
            m = _load(os.path.join(root, run, step_dirname(s)))
            rows.append({
                "run_id": run, "step": s, "tier": "local", "state": "committed" if m else "invalid",
                "reason": m.reason if m else None, "bytes": sum(x.size for x in m.shards_of_node(m.node)) if m else None,
                "world_size": m.world_size if m else None, "created_at": m.created_at if m else None,
            })
    if args.json:
        print(json.dumps({"root": root, "steps": rows}, indent=1))
        return 0
    if not rows:
        print(f"no checkpoints under {root}")
        return 0
    print(f"{'RUN':<16} {'STEP':>10} {'TIER':<6} {'STATE':<10} {'REASON':<9} {'SIZE':>10} {'RANKS':>5} {'AGE':>5}")
    for r in rows:
        size = f"{r['bytes'] / 2**20:.1f} MiB" if r["bytes"] is not None else "-"
        age = _age(r["created_at"]) if r["created_at"] else "-"
        print(f"{r['run_id']:<16} {r['step']:>10} {r['tier']:<6} {r['state']:<10} {r['reason'] or '-':<9} "
              f"{size:>10} {r['world_size'] or '-':>5} {age:>5}")
    return 0


def _step_dir(args: argparse.Namespace, step: int | None) -> tuple[str, list[int]]:
    root = _root(args)
    run = args.run_id or default_run_id()
    run_dir = os.path.join(root, run)
    steps = _steps(run_dir)
    if not steps:
        raise ConfigError(f"no checkpoints for run {run!r} in {root} (set --run-id or RSLURM_RUN_ID)")
    if step is not None and step not in steps:
        raise ConfigError(f"step {step} not found in {run_dir}; committed steps: {steps}")
    return run_dir, steps if step is None else [step]


def cmd_show(args: argparse.Namespace) -> int:
    run_dir, steps = _step_dir(args, args.step)
    d = os.path.join(run_dir, step_dirname(steps[-1]))
    m = _load(d)
    if m is None:
        print(f"{d}: manifest missing or invalid; run `rslurm verify {steps[-1]}` for details", file=sys.stderr)
        return 1
    if args.json:
        print(m.to_json())
        return 0
    print(f"{d}\n  run {m.run_id}  step {m.step}  reason {m.reason}  world size {m.world_size}  "
          f"created {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(m.created_at))}")
    print(f"  torch {m.torch_version}  resilient_slurm {m.library_version}  format {m.format}  "
          f"schema {m.schema_version}")
    for dom, ranks in m.nodes.items():
        print(f"  storage domain {dom}: ranks {list(ranks)}")
    for s in m.shards:
        here = "" if s.node == m.node else "  (on another node)"
        print(f"  {s.path:<20} rank {s.rank:<4} {s.size / 2**20:9.2f} MiB  {s.algorithm}:{s.checksum}  "
              f"{len(s.chunks)} items{here}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from .checkpoint.verify import verify_step_dir  # imports torch; `rslurm launch` must stay light

    run_dir, steps = _step_dir(args, args.step)
    reports: list[StepReport] = [verify_step_dir(os.path.join(run_dir, step_dirname(s))) for s in steps]
    if args.json:
        print(json.dumps([{"path": r.path, "step": r.step, "ok": r.ok, "problems": r.problems,
                           "bytes_checked": r.bytes_checked} for r in reports], indent=1))
    else:
        for r in reports:
            status = "OK" if r.ok else "CORRUPT"
            print(f"{status:<8} {r.path}  ({r.bytes_checked / 2**20:.1f} MiB checked)")
            for p in r.problems:
                print(f"         {p}")
    return 0 if all(r.ok for r in reports) else 1


# Settings `rslurm launch` takes as flags: every one that ranks or the launcher read. Each given flag is
# checked here, then exported to the launcher and its ranks as the RSLURM_* variable of the same name.
LAUNCH_FLAG_COMPONENTS = ("checkpoint", "rank", "launcher")


def cmd_launch(args: argparse.Namespace) -> int:
    from .launcher.launch import Launcher

    command = list(args.cmd)
    if command and command[0] == "--":
        command = command[1:]
    env = dict(os.environ)
    for name, s in config.SETTINGS.items():
        value = getattr(args, f"set_{name}", None)
        if s.component not in LAUNCH_FLAG_COMPONENTS or value is None:
            continue
        try:
            s.parse(value)
        except ValueError as exc:
            raise ConfigError(f"--{name.replace('_', '-')}={value!r}: {exc}") from exc
        env[s.env] = value
    result = Launcher(command, nprocs=args.nprocs, env=env, config_path=args.config).run()
    return result.exit_code


DAEMON_SETTINGS = ["local_dir", "node_name", "run_id", "keep_last", "keep_every", "local_min_free",
                   "drain_poll_interval", *DURABLE_SETTINGS]


def _flag_settings(args: argparse.Namespace, components: tuple[str, ...]) -> dict[str, Any]:
    """Settings given as ``--name`` flags (parsed and checked like their environment variables)."""
    out: dict[str, Any] = {}
    for name, s in config.SETTINGS.items():
        value = getattr(args, f"set_{name}", None)
        if s.component not in components or value is None:
            continue
        try:
            out[name] = s.parse(value)
        except ValueError as exc:
            raise ConfigError(f"--{name.replace('_', '-')}={value!r}: {exc}") from exc
    return out


def cmd_daemon(args: argparse.Namespace) -> int:
    from .checkpoint.policy import RetentionPolicy
    from .daemon import Daemon, DaemonRunningError, daemon_running
    from .storage import open_durable

    given = _flag_settings(args, ("storage",))
    given.update(local_dir=args.local_dir, durable=args.durable, run_id=args.run_id)
    cfg = config.resolve(DAEMON_SETTINGS, given, config_path=args.config)
    node = node_name(cfg["node_name"])
    root = expand_local_dir(cfg["local_dir"] or default_local_dir(), node)
    if not cfg["durable"]:
        raise ConfigError("rslurm daemon: no durable tier; give --durable URL or set RSLURM_DURABLE "
                          "(/path, file:///path or s3://bucket/prefix)")
    if args.job_step and daemon_running(root):
        log.info("a rslurm daemon already drains %s on %s; this job step has nothing to do", root, node)
        return 0
    os.makedirs(root, mode=0o700, exist_ok=True)
    tier = open_durable(cfg)
    assert tier is not None
    save_signal = config.resolve(["save_signal"], {}, config_path=args.config)["save_signal"]
    daemon = Daemon(root, tier, node=node, retention=RetentionPolicy(cfg["keep_last"], cfg["keep_every"]),
                    run_ids=[cfg["run_id"]] if cfg["run_id"] else None, min_free=cfg["local_min_free"],
                    poll_interval=cfg["drain_poll_interval"],
                    ignore_signals=[] if save_signal == "none" else [getattr(signal, "SIG" + save_signal)])
    try:
        return daemon.run(once=args.once, job_step=args.job_step)
    except DaemonRunningError as exc:
        if args.job_step:
            log.info("%s; this job step has nothing to do", exc)
            return 0
        raise
    finally:
        tier.close()


def cmd_status(args: argparse.Namespace) -> int:
    from .daemon.status import collect_status, format_status

    cfg = config.resolve(["local_dir", "node_name", "run_id", *DURABLE_SETTINGS],
                         {"local_dir": args.local_dir, "durable": args.durable, "run_id": args.run_id},
                         config_path=args.config)
    node = node_name(cfg["node_name"])
    root = expand_local_dir(cfg["local_dir"] or default_local_dir(), node)
    report = collect_status(root, cfg, run_id=cfg["run_id"])
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(format_status(report))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import main as demo_main

    return demo_main(list(args.demo_args))


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (also used to document the CLI)."""
    p = argparse.ArgumentParser(prog="rslurm", description="Resilient checkpointing for PyTorch on Slurm.")
    p.add_argument("--version", action="version", version=f"resilient_slurm {__version__}")
    p.add_argument("--config", default=None, help="TOML config file (default: $RSLURM_CONFIG)")
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--local-dir", default=None, help="node-local root (RSLURM_LOCAL_DIR)")
        sp.add_argument("--run-id", default=None, help="run to inspect (RSLURM_RUN_ID; default: job id)")
        sp.add_argument("--json", action="store_true", help="machine-readable output")

    sp = sub.add_parser("ls", help="list runs and committed steps")
    common(sp)
    sp.set_defaults(func=cmd_ls)
    sp = sub.add_parser("show", help="show a step's manifest")
    common(sp)
    sp.add_argument("step", type=int, nargs="?", default=None, help="step (default: newest)")
    sp.set_defaults(func=cmd_show)
    sp = sub.add_parser("verify", help="verify checksums of one step or all steps; exit 1 on any fault")
    common(sp)
    sp.add_argument("step", type=int, nargs="?", default=None, help="step (default: all)")
    sp.set_defaults(func=cmd_verify)
    sp = sub.add_parser(
        "launch", help="run a job resiliently: -- srun ... inside an allocation, or -n N -- cmd ... locally",
        description="Run ranks, turn SIGTERM/SIGUSR1/SIGUSR2/SIGINT and cloud notices into an emergency "
        "checkpoint, then requeue the job (Slurm) or exit 75 (local). Every option below is also an "
        "RSLURM_* environment variable and a config key; ranks receive them as RSLURM_* variables.",
        usage="rslurm launch [options] -- srun [srun args] cmd ... | rslurm launch -n N [options] -- cmd ...")
    sp.add_argument("-n", "--nprocs", type=int, default=None,
                    help="start N local ranks (MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK set)")
    for name, s in config.SETTINGS.items():
        if s.component in LAUNCH_FLAG_COMPONENTS:
            sp.add_argument(f"--{name.replace('_', '-')}", dest=f"set_{name}", default=None, metavar="V",
                            help=f"{s.help} ({s.env})".replace("%", "%%"))
    sp.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the command (srun ... or the program)")
    sp.set_defaults(func=cmd_launch)
    sp = sub.add_parser(
        "daemon", help="drain committed steps from the node-local tier to the durable tier",
        description="Per node: watch the local tier, drain committed steps (emergency first) to the durable "
        "tier with verification, commit them there once every node's shards are in, apply retention on both "
        "tiers and keep the local tier above local_min_free. Runs until SIGTERM, or with --once until "
        "nothing is left to do. Exit codes: 0 ok, 1 a step could not be drained, 2 bad settings or another "
        "daemon already drains this directory.")
    sp.add_argument("--local-dir", default=None, help="node-local root (RSLURM_LOCAL_DIR)")
    sp.add_argument("--durable", default=None, help="durable tier URL (RSLURM_DURABLE)")
    sp.add_argument("--run-id", default=None, help="drain only this run (RSLURM_RUN_ID; default: every run)")
    sp.add_argument("--once", action="store_true", help="drain what is there, then exit")
    sp.add_argument("--job-step", action="store_true",
                    help="started by the launcher: exit 0 at once if a daemon service already drains this node")
    for name, s in config.SETTINGS.items():
        if s.component == "storage":
            sp.add_argument(f"--{name.replace('_', '-')}", dest=f"set_{name}", default=None, metavar="V",
                            help=f"{s.help} ({s.env})".replace("%", "%%"))
    sp.set_defaults(func=cmd_daemon)
    sp = sub.add_parser("status", help="each step's state per tier (in progress, local, draining, durable) "
                        "and the drain lag")
    common(sp)
    sp.add_argument("--durable", default=None, help="durable tier URL (RSLURM_DURABLE)")
    sp.set_defaults(func=cmd_status)
    submit.add_parser(sub)
    doctor.add_parser(sub)
    sp = sub.add_parser("demo", help="train, SIGKILL, resume, compare (see python -m resilient_slurm.demo -h)")
    sp.add_argument("demo_args", nargs=argparse.REMAINDER)
    sp.set_defaults(func=cmd_demo)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``rslurm`` console script."""
    args = build_parser().parse_args(argv)
    try:
        level = config.resolve(["log_level"], {}, config_path=args.config)["log_level"]
        logging.basicConfig(level=getattr(logging, str(level).upper(), logging.INFO), stream=sys.stderr,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        return int(args.func(args))
    except ResilientSlurmError as exc:
        print(f"rslurm: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
