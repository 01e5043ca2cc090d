"""``rslurm doctor``: checks that a job will survive a preemption, a time limit or a lost node, before it
has to.

Run it on a login node with ``--script job.sh`` to check a batch script and the cluster's settings, or
inside an allocation (as the first line of the batch script, or in ``salloc``) to check the job itself:
its own script, its partition, the node-local directory, the durable tier, and whether the save signal
reaches every node. Each check reports OK, WARN, FAIL or SKIP with what it found and what to do, as a
table or as one JSON document (``--json``).

Call order: :func:`resilient_slurm.cli.build_parser` calls :func:`add_parser`; ``rslurm doctor`` runs
:func:`cmd_doctor`, which resolves the settings (a bad one is a ConfigError: exit 2), builds a
:class:`~resilient_slurm.doctor.context.DoctorContext` and calls :func:`run_checks`. That runs the
groups in this order, because later ones use what earlier ones found: ``where``, ``script``
(:mod:`.script`), ``cluster`` (:mod:`.cluster`), ``local`` and ``durable`` (:mod:`.storage`), ``signals``
(:mod:`.probe`). Exit codes: 0 no FAIL (WARN allowed), 1 at least one FAIL, 2 bad settings or usage.

This package's ``__init__`` is imported with the CLI, and before :mod:`.probe` whenever the probe task
starts on a node, so at module level it imports only the standard library, :mod:`resilient_slurm.config`
and :mod:`resilient_slurm.errors` (no rich, no boto3, no torch): the check modules are imported when the
command runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .. import config
from ..errors import ConfigError
from ..jobenv import JobEnv

if TYPE_CHECKING:
    from .context import DoctorContext, Finding

# Every check, by group, in report order (what --skip accepts: a group or one check).
CHECKS: dict[str, tuple[str, ...]] = {
    "where": ("where",),
    "script": ("script.signal", "script.grace", "script.requeue", "script.open-mode", "script.exec",
               "script.nccl"),
    "cluster": ("cluster.preemption", "cluster.user-signal", "cluster.kill-wait"),
    "local": ("local.dir", "local.space", "local.filesystem", "local.bandwidth"),
    "durable": ("durable",),
    "signals": ("signals.control-dir", "signals.delivery"),
}
JSON_VERSION = 1
EXIT_OK, EXIT_FAIL = 0, 1


def _size(text: str) -> int:
    try:
        return config.parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Register ``rslurm doctor`` on the CLI's sub-parsers (called by :func:`resilient_slurm.cli.build_parser`)."""
    sp: argparse.ArgumentParser = sub.add_parser(
        "doctor", help="check a batch script, the cluster, the local and durable tiers, and signal delivery",
        usage="rslurm doctor [options] [-- SBATCH_OPTION ...]",
        description="Check that a job will survive a preemption, a time limit or a lost node: the batch "
        "script's directives (--signal=B:..., --requeue, --open-mode=append, exec of the launcher, USR1 "
        "under NCCL), the cluster's preemption settings, the node-local directory (free space, filesystem, "
        "measured write bandwidth), the durable tier (a probe object written, read and deleted), and, inside "
        "an allocation, that the save signal reaches every node. Options given to sbatch on its command "
        "line can follow --, so that the script check sees them too.",
        epilog="Exit codes: 0 no FAIL (WARNs allowed), 1 at least one FAIL, 2 bad settings or usage. "
        "Check names for --skip: " + ", ".join(c for g in CHECKS.values() for c in g) + " (or a group: "
        + ", ".join(CHECKS) + "). See docs/doctor.md.")
    sp.add_argument("--script", default=None, metavar="FILE",
                    help="batch script to check (default inside an allocation: the job's own script)")
    sp.add_argument("--job", default=None, metavar="ID",
                    help="check this submitted job's script and partition (default: $SLURM_JOB_ID)")
    sp.add_argument("--local-dir", default=None, help="node-local root (RSLURM_LOCAL_DIR)")
    sp.add_argument("--durable", default=None, help="durable tier URL (RSLURM_DURABLE)")
    sp.add_argument("--bandwidth-size", type=_size, default=256 << 20, metavar="SIZE",
                    help="bytes written to measure the local dir's bandwidth (default 256M; 0 = do not measure)")
    sp.add_argument("--checkpoint-size", type=_size, default=None, metavar="SIZE",
                    help="bytes one node writes per checkpoint (e.g. 40G): checked against free space, "
                    "bandwidth and the signal's lead time")
    nccl = sp.add_mutually_exclusive_group()
    nccl.add_argument("--nccl", dest="nccl", action="store_true", default=None,
                      help="the job uses NCCL (default: detected from GPU requests and NCCL_* variables)")
    nccl.add_argument("--no-nccl", dest="nccl", action="store_false", help="the job does not use NCCL")
    sp.add_argument("--skip", action="append", default=[], metavar="CHECK",
                    help="skip a check or a group (repeatable), e.g. --skip local.bandwidth --skip signals")
    sp.add_argument("--signal-timeout", type=float, default=15.0, metavar="S",
                    help="seconds every node has to report the signal (default 15)")
    sp.add_argument("--json", action="store_true", help="one JSON document on stdout instead of the table")
    sp.add_argument("sbatch_args", nargs=argparse.REMAINDER,
                    help="-- then options given to sbatch on its command line (e.g. -- --signal=B:USR1@120)")
    sp.set_defaults(func=cmd_doctor)
    return sp


def _skips(names: Sequence[str]) -> frozenset[str]:
    valid = set(CHECKS) | {c for g in CHECKS.values() for c in g}
    out: set[str] = set()
    for n in names:
        for part in n.split(","):
            p = part.strip()
            if not p:
                continue
            if p not in valid:
                raise ConfigError(f"--skip {p}: no such check; valid: {', '.join(sorted(valid))}")
            out |= ({p, *CHECKS[p]} if p in CHECKS else {p})
    return frozenset(out)


def build_context(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> DoctorContext:
    """Resolve the settings and gather where we are (raises ConfigError for bad settings)."""
    from ..paths import default_local_base, default_local_dir, expand_local_dir, node_name
    from ..storage.registry import parse_url
    from .context import DoctorContext, DoctorOptions, make_slurm_client

    env = os.environ if env is None else env
    cfg = config.load({"local_dir": args.local_dir, "durable": args.durable}, env, config_path=args.config)
    if cfg.durable:
        parse_url(cfg.durable)
    extra = list(args.sbatch_args)
    if extra and extra[0] != "--":
        raise ConfigError(f"rslurm doctor: unexpected argument {extra[0]!r}; sbatch options go after -- "
                          "(rslurm doctor --script job.sh -- --signal=B:USR1@120)")
    extra = extra[1:]
    if not math.isfinite(args.signal_timeout) or args.signal_timeout <= 0:
        raise ConfigError(f"--signal-timeout {args.signal_timeout:g}: must be a finite number of seconds > 0")
    options = DoctorOptions(script=args.script, job_id=args.job, sbatch_args=tuple(extra), nccl=args.nccl,
                            bandwidth_size=args.bandwidth_size, checkpoint_size=args.checkpoint_size,
                            signal_timeout=args.signal_timeout, skip=_skips(args.skip))
    own_job = JobEnv.from_env(env).job_id
    job_id = args.job or own_job
    node = node_name(cfg.node_name)
    problem = None
    try:
        template = cfg.local_dir or default_local_dir()
    except ConfigError as exc:  # an unsafe default directory: a local.dir FAIL finding, not an exit 2
        template, problem = os.path.join(default_local_base(), "%n"), str(exc)
    return DoctorContext(cfg=cfg, env=env, options=options, node=node,
                         local_dir=expand_local_dir(template, node), local_dir_problem=problem,
                         job_id=job_id, in_allocation=own_job is not None and job_id == own_job,
                         slurm=make_slurm_client(env))


def _where(ctx: DoctorContext) -> Finding:
    from .context import Finding, Status

    tools = "" if ctx.slurm_tools else "; the Slurm client tools (scontrol, srun) are not on PATH"
    details: dict[str, Any] = {"node": ctx.node, "job_id": ctx.job_id, "in_allocation": ctx.in_allocation,
                               "slurm_tools": ctx.slurm_tools}
    if ctx.in_allocation:
        job = ctx.job()
        slurm_env = JobEnv.from_env(ctx.env)
        step = slurm_env.step_id
        inside = f"step {step}" if step else "the batch shell" if job and job.raw.get("BatchFlag") == "1" \
            else "the allocation's shell"
        nodes = f"{len(job.nodes)} node(s) {job.node_list}, partition {job.partition}" if job else \
            f"nodes {slurm_env.raw.get('SLURM_JOB_NODELIST', '?')}"
        details.update(nodes=list(job.nodes) if job else None, partition=job.partition if job else None)
        return Finding("where", Status.OK, f"inside job {ctx.job_id} ({inside} on {ctx.node}; {nodes}){tools}",
                       "", details)
    if ctx.job_id:
        return Finding("where", Status.OK, f"on {ctx.node}, outside job {ctx.job_id} (--job): its script and "
                       f"partition are checked, signal delivery is not{tools}", "", details)
    return Finding("where", Status.OK, f"on {ctx.node}, not inside a Slurm allocation (no SLURM_JOB_ID): "
                   f"signal delivery is checked only inside one{tools}",
                   "also run rslurm doctor inside the job (first line of the batch script, or in salloc)", details)


def run_checks(ctx: DoctorContext) -> list[Finding]:
    """Every finding, in report order (see the module docstring for the order and why)."""
    from ..errors import ResilientSlurmError
    from . import cluster, probe, script, storage
    from .context import Finding, Status

    groups: list[tuple[str, Callable[[DoctorContext], list[Finding]]]] = [
        ("where", lambda c: [_where(c)]),
        ("script", script.check),
        ("cluster", cluster.check),
        ("local", storage.check_local),
        ("durable", storage.check_durable),
        ("signals", probe.check),
    ]
    skip = ctx.options.skip
    findings: list[Finding] = []
    for group, fn in groups:
        if group in skip:
            findings.append(Finding(group, Status.SKIP, f"skipped (--skip {group})"))
            continue
        try:
            rows = fn(ctx)
        except ConfigError:
            raise
        except (ResilientSlurmError, OSError) as exc:
            rows = [Finding(group, Status.FAIL, f"the {group} checks stopped: {exc}", "see the message")]
        for f in rows:
            if f.check in skip:
                findings.append(Finding(f.check, Status.SKIP, f"skipped (--skip {f.check})"))
            else:
                findings.append(f)
    return findings


def summary(findings: Sequence[Finding]) -> dict[str, int]:
    """Counts per status and the exit code they give."""
    from .context import Status

    counts = {s.value.lower(): sum(1 for f in findings if f.status is s) for s in Status}
    counts["exit_code"] = EXIT_FAIL if counts["fail"] else EXIT_OK
    return counts


def to_json(ctx: DoctorContext, findings: Sequence[Finding]) -> dict[str, Any]:
    """The ``--json`` document."""
    from .. import __version__

    return {"version": JSON_VERSION, "resilient_slurm": __version__, "node": ctx.node, "job_id": ctx.job_id,
            "in_allocation": ctx.in_allocation, "local_dir": ctx.local_dir,
            "checks": [f.to_json() for f in findings], "summary": summary(findings)}


_STYLES = {"OK": "green", "WARN": "yellow", "FAIL": "bold red", "SKIP": "dim"}


def render_table(ctx: DoctorContext, findings: Sequence[Finding]) -> None:
    """Print the findings as a table, then one summary line."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from ..terminal import printable

    width = None if os.isatty(1) or os.environ.get("COLUMNS") else 140
    console = Console(width=width, highlight=False)
    where = f"job {ctx.job_id}" if ctx.job_id else "no job"
    table = Table(title=f"rslurm doctor: {ctx.node}, {where}", title_justify="left", expand=False)
    table.add_column("check", no_wrap=True)
    table.add_column("status", no_wrap=True)
    table.add_column("finding", ratio=3)
    table.add_column("what to do", ratio=2)
    for f in findings:
        # A finding may quote a file (the batch script, a path): printable, never a terminal escape.
        table.add_row(f.check, Text(f.status.value, style=_STYLES[f.status.value]), Text(printable(f.finding)),
                      Text(printable(f.fix)))
    console.print(table)
    s = summary(findings)
    verdict = "no FAIL" if not s["fail"] else f"{s['fail']} FAIL"
    console.print(f"{verdict}: {s['ok']} OK, {s['warn']} WARN, {s['fail']} FAIL, {s['skip']} SKIP "
                  f"(exit {s['exit_code']})", style=_STYLES["FAIL"] if s["fail"] else None)


def cmd_doctor(args: argparse.Namespace) -> int:
    """``rslurm doctor``: run every check, print the report, exit 0 (no FAIL) or 1."""
    ctx = build_context(args)
    findings = run_checks(ctx)
    if args.json:
        print(json.dumps(to_json(ctx, findings), indent=1))
    else:
        render_table(ctx, findings)
    return summary(findings)["exit_code"]


__all__ = ["CHECKS", "add_parser", "build_context", "cmd_doctor", "run_checks", "summary", "to_json"]
